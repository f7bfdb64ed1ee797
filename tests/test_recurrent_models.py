"""Gated DeltaNet and Mamba2 hybrids through kvstore's engine against transformers (fp32).

Each tiny random config of a family runs in :class:`LLMEngine` (packed batches, chunked
prefill stopped at checkpoints, state pages, checkpoint hits, forks, preemption) and its
greedy tokens and logits are compared with transformers' eager forward over the whole
sequence, computed from scratch at every step, and with its ``generate``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvstore.engine.engine import (  # noqa: E402
    EngineConfig,
    LLMEngine,
    RequestOutput,
    SamplingParams,
    kv_cache_specs,
)
from kvstore.models.hf import HFCausalLM, load_hf_model  # noqa: E402
from kvstore.models.recurrent import (  # noqa: E402
    TINY_PRESETS,
    hybrid_layout,
    tiny_hybrid_config,
)
from kvstore.paged_kv_cache import PagedKVCache  # noqa: E402
from kvstore.specs import (  # noqa: E402
    FullAttentionSpec,
    RecurrentStateSpec,
    make_kv_cache_config,
)

FAMILIES = sorted(TINY_PRESETS)
BS = 4
VOCAB = 97
ATOL = 1e-4


def build(family: str, seed: int = 0, **overrides: Any) -> tuple[Any, HFCausalLM]:
    """(transformers' eager model, a copy of it wrapped for kvstore) with random weights
    large enough that attention and states matter."""
    return build_from(tiny_hybrid_config(family, **overrides), seed)


def build_from(config: Any, seed: int = 0) -> tuple[Any, HFCausalLM]:
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    with torch.no_grad():
        for module in ref.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.normal_(0.0, 0.2)
    return ref, HFCausalLM(copy.deepcopy(ref))


def large_page_blocks(model: HFCausalLM) -> int:
    return make_kv_cache_config(kv_cache_specs(model, BS), memory_bytes=1 << 24).large_page_blocks


def make_engine(model: HFCausalLM, large_pages: int = 24, **kwargs: Any) -> LLMEngine:
    """An engine whose pool holds `large_pages` large pages (block size 4)."""
    kwargs.setdefault("max_num_batched_tokens", 8)
    return LLMEngine(model, EngineConfig(num_blocks=large_page_blocks(model) * large_pages,
                                         block_size=BS, **kwargs))


@torch.no_grad()
def reference(ref: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and each step's logits from full eager forwards (no cache)."""
    ids = list(prompt)
    rows = []
    for _ in range(max_tokens):
        row = ref(torch.tensor([ids])).logits[0, -1]
        rows.append(row)
        ids.append(int(row.argmax()))
    return ids[len(prompt):], torch.stack(rows)


def check(ref: Any, out: RequestOutput, max_tokens: int) -> None:
    """Every sample of `out` is transformers' greedy continuation, logits within ATOL."""
    tokens, logits = reference(ref, out.prompt_token_ids, max_tokens)
    for sample in out.outputs:
        assert sample.token_ids == tokens
        assert sample.logits is not None
        assert (sample.logits - logits).abs().max().item() < ATOL


def tokens(gen: torch.Generator, n: int, avoid: int | None = None) -> list[int]:
    """`n` random token ids; the first differs from `avoid`."""
    out = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    if avoid is not None and out[0] == avoid:
        out[0] = (avoid + 1) % VOCAB
    return out


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int = 4,
            n: int = 1) -> tuple[RequestOutput, int]:
    """Run one request alone; returns its output and the tokens the engine computed."""
    before = engine.stats.computed_tokens
    params = SamplingParams(max_tokens=max_tokens, n=n, return_logits=True)
    (out,) = engine.generate([prompt], params)
    return out, engine.stats.computed_tokens - before


# ---------------------------------------------------------------- hits against transformers


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_hits_match_transformers(family: str) -> None:
    """Prompt-end, output-end and branch-point hits, a prompt diverging between two
    checkpoints, chunked prefill: tokens and logits are transformers', and the engine
    computes exactly the tokens past the hit."""
    ref, model = build(family)
    engine = make_engine(model)
    gen = torch.Generator().manual_seed(5)
    max_tokens = 4

    def served(prompt: list[int], hit: int, kind: str | None) -> RequestOutput:
        out, computed = run_one(engine, prompt, max_tokens)
        check(ref, out, max_tokens)
        assert (out.num_cached_tokens, out.hit_checkpoint_kind) == (hit, kind)
        assert computed == len(prompt) - hit + max_tokens - 1
        return out

    a = tokens(gen, 13)
    out_a = served(a, 0, None)  # chunks of 8, stopped at the prompt's end checkpoint (12)
    served(a[:12] + tokens(gen, 5, avoid=a[12]), 12, "prompt_end")
    turn = a + out_a.outputs[0].token_ids  # A computed 13 + 3 = 16 tokens: its output's end
    served(turn + tokens(gen, 3), 16, "output_end")
    served(a[:8] + tokens(gen, 7, avoid=a[8]), 0, None)  # learns the branch point 8
    served(a[:8] + tokens(gen, 6, avoid=a[8]), 8, "branch_point")
    # Diverging at 14, between the checkpoints at 12 and 16: falls back to 12.
    served(turn[:14] + tokens(gen, 4, avoid=turn[14]), 12, "prompt_end")


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_and_fork_match_generate(family: str) -> None:
    """Requests of different lengths in one packed batch, and a request forked into two
    samples (the state copied), give transformers' `generate` tokens."""
    ref, model = build(family, seed=1)
    engine = make_engine(model, max_num_batched_tokens=64)
    gen = torch.Generator().manual_seed(7)
    prompts = [tokens(gen, n) for n in (11, 5, 9, 1)]
    params = [SamplingParams(max_tokens=5, return_logits=True, n=2 if i == 0 else 1)
              for i in range(len(prompts))]
    outs = engine.generate(prompts, params)
    assert engine.stats.fork_copies > 0
    for prompt, out in zip(prompts, outs, strict=True):
        check(ref, out, 5)
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False)
        assert all(s.token_ids == want[0, len(prompt):].tolist() for s in out.outputs)


@pytest.mark.slow
def test_a_hybrid_without_a_preset_is_read_from_its_layer_types() -> None:
    """OLMo's hybrid (Gated DeltaNet): run because its layer_types name linear_attention
    layers, with no family list; a checkpoint hit, a packed batch and a fork."""
    config = transformers.AutoConfig.for_model(
        "olmo_hybrid", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
        max_position_embeddings=256, eos_token_id=None, pad_token_id=None,
        layer_types=["linear_attention", "full_attention", "linear_attention"])
    ref, model = build_from(config, seed=1)
    engine = make_engine(model, max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(7)
    a = tokens(gen, 13)
    first, _ = run_one(engine, a)
    check(ref, first, 4)
    again, computed = run_one(engine, a[:12] + tokens(gen, 5, avoid=a[12]))
    check(ref, again, 4)
    assert again.num_cached_tokens == 12 and computed == 17 - 12 + 3
    prompts = [tokens(gen, n) for n in (11, 5)]
    outs = engine.generate(prompts, [SamplingParams(max_tokens=4, return_logits=True, n=2),
                                      SamplingParams(max_tokens=4, return_logits=True)])
    assert engine.stats.fork_copies > 0
    for out in outs:
        check(ref, out, 4)


@pytest.mark.parametrize("family", ["qwen3_next", "bamba"])
def test_eviction_and_preemption_in_a_small_pool(family: str) -> None:
    """A pool of few large pages: checkpoints are evicted and requests preempted, and every
    output is still transformers'."""
    ref, model = build(family, seed=2)
    engine = make_engine(model, large_pages=3, max_num_batched_tokens=16)
    gen = torch.Generator().manual_seed(3)
    shared = tokens(gen, 8)
    prompts = [shared + tokens(gen, 3 + i) for i in range(5)]
    for round_ in range(2):
        outs = engine.generate(prompts if round_ == 0 else prompts[::-1],
                               SamplingParams(max_tokens=6, return_logits=True))
        for out in outs:
            check(ref, out, 6)
    stats = engine.stats
    assert stats.preemptions > 0 and stats.evictions > 0


@pytest.mark.slow
@pytest.mark.parametrize("family,overrides", [
    ("qwen3_next", dict(linear_conv_kernel_dim=2, num_attention_heads=2, num_key_value_heads=1,
                        layer_types=["full_attention", "linear_attention", "linear_attention",
                                     "linear_attention", "full_attention"])),
    ("bamba", dict(mamba_d_conv=4, mamba_chunk_size=4, num_hidden_layers=3,
                   attn_layer_indices=[2])),
    ("granitemoehybrid", dict(mamba_chunk_size=16, mamba_d_conv=2)),
    ("nemotron_h", dict(conv_kernel=2, chunk_size=4,
                        layers_block_type=["full_attention", "linear_attention", "mlp"])),
])
@pytest.mark.parametrize("seed", [3, 4])
def test_other_shapes_and_seeds(family: str, overrides: dict[str, Any], seed: int) -> None:
    """Other layer counts, head counts, conv widths and chunk sizes, other seeds: a hit at
    the prompt's end and a second turn still give transformers' tokens."""
    ref, model = build(family, seed=seed, **overrides)
    engine = make_engine(model)
    gen = torch.Generator().manual_seed(seed)
    a = tokens(gen, 10)
    out_a, _ = run_one(engine, a, 3)
    check(ref, out_a, 3)
    out_b, computed = run_one(engine, a[:8] + tokens(gen, 6, avoid=a[8]), 3)
    check(ref, out_b, 3)
    assert out_b.num_cached_tokens == 8 and computed == 14 - 8 + 2
    out_c, _ = run_one(engine, a + out_a.outputs[0].token_ids + tokens(gen, 2), 3)
    check(ref, out_c, 3)
    assert out_c.num_cached_tokens == 12 and out_c.hit_checkpoint_kind == "output_end"


# ---------------------------------------------------------------- layouts and refusals


def test_layout_numbers_only_cached_layers() -> None:
    """Nemotron-H's MLP and MoE layers keep no cache and get no kvstore layer."""
    layout = hybrid_layout(tiny_hybrid_config("nemotron_h"))
    assert layout.hf_layers == (0, 2, 3)
    assert [layout.is_recurrent(i) for i in range(3)] == [True, False, True]
    _, model = build("nemotron_h")
    assert model.config.num_layers == 3 and model.config.attention_layers() == {1}
    state = model.layer_state(0)
    assert state is not None and model.layer_state(1) is None
    # transformers' Mamba2 cache: conv (channels, kernel), SSM (heads, head dim, state size).
    assert state.shapes == ((32 * 2 + 2 * 8, 4), (4, 16, 8))


@pytest.mark.parametrize("layer_types,message", [
    (["linear_attention", "mamba3", "full_attention"], "layer_types\\[1\\] is 'mamba3'"),
    (["linear_attention", "mlp"], "no 'full_attention'"),
])
def test_unserved_layer_types_are_refused(layer_types: list[str], message: str) -> None:
    config = tiny_hybrid_config("nemotron_h")
    config.layer_types = layer_types
    with pytest.raises(ValueError, match=message):
        hybrid_layout(config)
    with pytest.raises(ValueError, match=message):  # before any model is built
        load_hf_model(config)


def test_unserved_settings_are_refused() -> None:
    config = tiny_hybrid_config("qwen3_next")
    config.sliding_window = 8
    with pytest.raises(ValueError, match="sliding_window"):
        hybrid_layout(config)
    with pytest.raises(ValueError, match="layer_types"):
        hybrid_layout(transformers.AutoConfig.for_model("llama"))


# ---------------------------------------------------------------- state pages on the device


def state_cache() -> PagedKVCache:
    full = FullAttentionSpec(BS, 2, 8, "float32")  # 512 bytes a block
    state = RecurrentStateSpec(BS, ((6, 3), (2, 5, 5)), "float32")  # 272 bytes a layer
    return PagedKVCache(make_kv_cache_config([full, state, state], num_blocks=12))


def test_state_pages_share_the_pools_memory() -> None:
    """A large page's states are the bytes of its k blocks: one memory budget."""
    cache = state_cache()
    config = cache.config
    k, n = config.large_page_blocks, config.num_blocks
    assert k == 2 and cache.num_bytes == n * config.bytes_per_block
    conv, recurrent = cache.state_views(2, n + 3)  # layer 2: after layer 1's states
    recurrent.fill_(1.0)
    touched = [b for b in range(n) if cache.key_caches[0][b].any() or cache.value_caches[0][b].any()]
    # Layer 2's SSM state is bytes [344, 544) of the page: blocks 6 (its V half) and 7.
    assert touched == [3 * k, 3 * k + 1]
    assert cache.value_caches[0][3 * k].view(-1)[(344 - 256) // 4:].eq(1.0).all()
    assert not cache.key_caches[0][3 * k].any()
    assert not any(t.any() for t in cache.state_views(1, n + 3))
    assert conv.shape == (6, 3) and recurrent.shape == (2, 5, 5)


def test_state_page_copies() -> None:
    cache = state_cache()
    n = cache.config.num_blocks
    src = cache.state_views(1, n + 1)
    src[0].copy_(torch.arange(18.0).view(6, 3))
    cache.key_caches[0][5].fill_(2.0)
    cache.copy_blocks([(n + 1, n + 4), (5, 6)])
    assert torch.equal(cache.state_views(1, n + 4)[0], src[0])
    assert torch.equal(cache.key_caches[0][6], cache.key_caches[0][5])
    assert cache.copies_executed == 2


@pytest.mark.parametrize("pairs,error", [
    ([(1, 12 + 2)], "between a block and a large page"),
    ([(12 + 6, 12 + 2)], "not a page of this cache"),
    ([(12, 12 + 2)], "not a page of this cache"),  # large page 0 holds the null block
])
def test_bad_state_copies_are_refused(pairs: list[tuple[int, int]], error: str) -> None:
    cache = state_cache()
    before = [t.clone() for t in cache.key_caches]
    with pytest.raises(ValueError, match=error):
        cache.copy_blocks(pairs)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.key_caches, strict=True))
    assert cache.copies_executed == 0


def test_state_views_refuse_attention_layers_and_small_pages() -> None:
    cache = state_cache()
    n = cache.config.num_blocks
    with pytest.raises(ValueError, match="keeps no recurrent state"):
        cache.state_views(0, n + 1)
    with pytest.raises(ValueError, match="not a large page"):
        cache.state_views(1, 3)
    with pytest.raises(TypeError, match="must be an int"):
        cache.state_views(1, True)  # type: ignore[arg-type]


# ---------------------------------------------------------------- kvstore generate


def test_generate_cli_runs_a_hybrid_preset(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvstore generate --model bamba`: each request's hit and the checkpoint it came from."""
    from kvstore.cli import main

    assert main(["generate", "--model", "bamba", "--max-tokens", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "served from" in out and "prompt_end" in out
    row = next(line for line in out.splitlines() if "req-1" in line)
    assert row.split("│")[3].strip() == "48"  # cached: the first prompt's end checkpoint


@pytest.mark.slow
def test_triton_attention_reads_the_shared_buffer() -> None:
    """The Triton paged-attention kernel (interpreted on CPU) reads K/V slot views carved
    from the one byte buffer, across a prompt-end hit."""
    ref, model = build("qwen3_next")
    engine = make_engine(model, attention_backend="triton")
    gen = torch.Generator().manual_seed(5)
    a = tokens(gen, 13)
    check(ref, run_one(engine, a)[0], 4)
    out, _ = run_one(engine, a[:12] + tokens(gen, 5, avoid=a[12]))
    check(ref, out, 4)
    assert out.num_cached_tokens == 12


def test_runner_refuses_a_cache_whose_states_do_not_fit_the_model() -> None:
    from kvstore.engine.runner import ModelRunner

    _, model = build("qwen3_next")
    specs = kv_cache_specs(model, BS)
    wrong = [RecurrentStateSpec(BS, ((64, 3), (4, 8, 8)), "float32")
             if isinstance(s, RecurrentStateSpec) else s for s in specs]
    cache = PagedKVCache(make_kv_cache_config(wrong, memory_bytes=1 << 16))
    with pytest.raises(ValueError, match="layer 0: cache state"):
        ModelRunner(model, cache)
    attention_only = [FullAttentionSpec(BS, 2, 8, "float32")] * 3
    with pytest.raises(ValueError, match="keeps a recurrent state, the cache has K/V pages"):
        ModelRunner(model, PagedKVCache(make_kv_cache_config(attention_only, num_blocks=8)))
