"""transformers' own decoders through kvstore's paged cache (kvstore.models.hf), CPU only.

Each family is a tiny random config of transformers 5.24 (the config keys below are test
data; kvstore has no per-family code), with weights re-drawn at a scale that gives peaked
attention. Through LLMEngine, every output's logits must be within 1e-4 of transformers'
eager forward over the final sequence and its greedy tokens HF's argmax wherever HF's
top-2 gap exceeds 1e-3; one request per family is also compared with ``generate``. Each
family runs prefix hits, a partial hit, a fork, chunked prefill, and a pool small enough
to preempt and evict.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from engines import check_against_hf, eager_reference, greedy  # noqa: E402
from engines import tokens as _tokens  # noqa: E402

from kvstore.engine.engine import EngineConfig, LLMEngine, RequestOutput  # noqa: E402
from kvstore.kv_cache_manager import CacheConfig  # noqa: E402
from kvstore.models.hf import (  # noqa: E402
    ATTENTION_NAME,
    HFCausalLM,
    layer_windows,
    load_hf_model,
    paged_attention_forward,
)
from kvstore.models.presets import randomize_weights_  # noqa: E402

BLOCK = 4
WINDOW = 8
VOCAB = 256

BASE: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
SLIDING = dict(sliding_window=WINDOW)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# model_type -> config keys beyond BASE (sliding windows, experts, layer patterns).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": SLIDING,
    "gemma": {},
    "gemma2": SLIDING,
    "gemma3_text": dict(SLIDING, sliding_window_pattern=2),
    "qwen2": dict(SLIDING, use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(SLIDING, use_sliding_window=True, max_window_layers=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "gpt_oss": dict(SLIDING, **MOE),
    "phi3": SLIDING,
    "olmo": {},
    "olmo2": {},
    "olmo3": SLIDING,
    "granite": {},
    "granitemoe": MOE,
    "cohere": {},
    "cohere2": SLIDING,
    "starcoder2": SLIDING,
    "glm": {},
    "glm4": {},
    "smollm3": {},
    "exaone4": SLIDING,
    "ministral": SLIDING,
    "mixtral": dict(SLIDING, **MOE),
    "hunyuan_v1_dense": {},
    "seed_oss": {},
    "arcee": {},
    "helium": {},
    "apertus": {},
    "phi": {},
    "ernie4_5": {},
    "gpt2": dict(num_key_value_heads=4),  # learned absolute positions, no RoPE, fused QKV
}
FAST = ["llama", "gemma2", "gpt_oss"]


def hf_config(model_type: str, config: dict[str, Any] | None = None) -> Any:
    """A tiny transformers config: BASE with ``config`` (by default FAMILIES[model_type])."""
    keys = FAMILIES[model_type] if config is None else config
    return transformers.AutoConfig.for_model(model_type, **{**BASE, **keys})


def build(model_type: str, seed: int = 0, config: dict[str, Any] | None = None
          ) -> tuple[HFCausalLM, torch.nn.Module]:
    """(kvstore's model, transformers' eager copy with the same weights drawn by ``seed``)."""
    return with_reference(load_hf_model(hf_config(model_type, config), seed=0), seed)


def with_reference(model: HFCausalLM, seed: int = 0) -> tuple[HFCausalLM, torch.nn.Module]:
    randomize_weights_(model.hf, seed)
    return model, eager_reference(model)


def tokens(n: int, seed: int) -> list[int]:
    return _tokens(n, seed, VOCAB)


def make_engine(model: HFCausalLM, num_blocks: int = 128, batched: int = 8) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=num_blocks, block_size=BLOCK,
                                         max_num_batched_tokens=batched,
                                         cache=CacheConfig(enable_partial_hits=True)))


def run_family(model_type: str, seed: int = 0, config: dict[str, Any] | None = None) -> None:
    model, ref = build(model_type, seed, config)
    n, max_tokens = 18, 5
    shared = tokens(n, seed=1)

    # A request alone (chunked prefill: 8 tokens a step), equal to transformers' generate.
    engine = make_engine(model)
    (first,) = engine.generate([shared + tokens(3, seed=2)], greedy(max_tokens))
    prompt = torch.tensor([first.prompt_token_ids])
    with torch.no_grad():
        hf_tokens = ref.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    assert first.outputs[0].token_ids == hf_tokens[0, prompt.shape[1]:].tolist()
    check_against_hf(ref, first)

    # Full-block hits, a partial hit (mid-block), a fork of 2 samples copying the partial
    # block, and a request that shares nothing, batched.
    cut = n - 1 if (n - 1) % BLOCK else n - 2
    outs = engine.generate(
        [shared + tokens(2, seed=3), shared[:cut] + [(shared[cut] + 1) % VOCAB], shared[:cut],
         tokens(7, seed=4)],
        [greedy(max_tokens), greedy(3), greedy(max_tokens, n=2), greedy(max_tokens)])
    stats = engine.stats
    assert stats.hit_tokens > 0 and stats.partial_hits > 0 and stats.fork_copies > 0
    assert outs[1].num_cached_tokens == cut
    for out in outs:
        check_against_hf(ref, out)
    assert engine.manager.usage == 0.0

    # A pool with room for the longest request alone: preemption and eviction (outputs
    # long enough that requests running together outgrow it, windows or not).
    prompts = [tokens(n + k, seed=10 + k) for k in range(4)] + [tokens(5, seed=14)]
    longer = 9
    longest = n + 3 + longer
    groups = len(make_engine(model, num_blocks=64).config.groups)
    small = make_engine(model, num_blocks=1 + groups * -(-longest // BLOCK), batched=16)
    outs = small.generate(prompts, greedy(longer))
    assert small.stats.preemptions > 0 and small.stats.evictions > 0
    for out in outs:
        check_against_hf(ref, out)
    assert small.manager.usage == 0.0


@pytest.mark.parametrize("model_type", FAST)
def test_family_matches_transformers(model_type: str) -> None:
    run_family(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [m for m in FAMILIES if m not in FAST])
def test_family_matches_transformers_grid(model_type: str) -> None:
    run_family(model_type)


# ------------------------------------------------------------- published config shapes

# config.json dicts shaped like published ones (same RoPE, window rule and head layout;
# reduced widths and depths), read by transformers as from_pretrained reads them.
PUBLISHED: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: llama3 RoPE (factor 32, low/high 1/4, theta 5e5), GQA 4:1, tied.
    "llama3.2-llama3-rope": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "head_dim": 16,
        "max_position_embeddings": 256, "num_attention_heads": 4, "num_hidden_layers": 3,
        "num_key_value_heads": 1, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 40, "rope_type": "llama3"},
        "rope_theta": 500000.0, "vocab_size": VOCAB},
    # Gemma-3-4B's text_config: only the keys it spells out, linear factor 8 on global layers.
    "gemma3-4b-linear-rope": {
        "model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 256,
        "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": VOCAB, "sliding_window": WINDOW,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    # Qwen2.5-7B-Instruct with its model card's YaRN block (legacy "type" key), window off.
    "qwen2.5-yarn-rope": {
        "model_type": "qwen2", "hidden_size": 112, "intermediate_size": 224,
        "max_position_embeddings": 256, "max_window_layers": 3, "num_attention_heads": 7,
        "num_hidden_layers": 3, "num_key_value_heads": 1, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False,
        "vocab_size": VOCAB,
        "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 40, "type": "yarn"}},
    # Qwen2 naming its sliding layers in layer_types (which win over max_window_layers).
    "qwen2-layer-types": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "max_window_layers": 3, "use_sliding_window": True, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_shapes_match_transformers(name: str) -> None:
    """Past the RoPE's original context and the windows, alone and after a prefix hit."""
    d = PUBLISHED[name]
    cfg = transformers.CONFIG_MAPPING[d["model_type"]].from_dict(copy.deepcopy(d))
    model, ref = with_reference(load_hf_model(cfg, seed=0))
    engine = make_engine(model, batched=32)
    prompt = tokens(60, seed=30)
    (a,) = engine.generate([prompt], greedy(3))
    (b,) = engine.generate([prompt[:50] + tokens(3, seed=31)], greedy(3))
    assert b.num_cached_tokens >= 48
    check_against_hf(ref, a)
    check_against_hf(ref, b)


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(("model_type", "keys", "named"), [
    ("llama", dict(attention_chunk_size=16), "attention_chunk_size"),
    ("llama", dict(layer_types=["full_attention", "linear_attention", "full_attention"]),
     "linear_attention"),
    ("llama", dict(layer_types=["full_attention", "conv", "full_attention"]), "layer_types"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("mistral", dict(sliding_window=0), "sliding_window"),
])
def test_unsupported_config_is_refused_naming_the_key(model_type: str, keys: dict, named: str
                                                      ) -> None:
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **keys})
    with pytest.raises(ValueError, match=named):
        load_hf_model(cfg)


@pytest.mark.parametrize(("model_type", "named"), [
    ("doge", "attention_mask"),  # a dynamic mask of its own, passed to the attention call
    ("diffllama", "more than once"),  # two attention calls a layer (differential attention)
    ("falcon", "attn_implementation"),  # its own table of attention classes
    ("mpt", "attn_implementation"),  # its forward needs transformers' mask
    ("gemma4_text", "head_dim"),  # a head_dim per layer
    ("mimo_v2_flash", "head_dim"),  # values wider than keys
])
def test_unsupported_modeling_is_refused_naming_it(model_type: str, named: str) -> None:
    cls = transformers.CONFIG_MAPPING[model_type]
    declared = {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map)
    cfg = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in BASE.items()
                                                           if k in declared})
    with pytest.raises(ValueError, match=named):
        load_hf_model(cfg)


def test_attention_call_with_a_tensor_it_cannot_apply_is_refused() -> None:
    """A tensor keyword (a block selection, a bias) the paged kernel would ignore."""
    module = torch.nn.Module().eval()
    module.layer_idx = 0
    q, kv = torch.zeros(1, 4, 2, 16), torch.zeros(1, 2, 2, 16)
    with pytest.raises(ValueError, match="block_indices"):
        paged_attention_forward(module, q, kv, kv, None, kvstore_attention=object(),
                                block_indices=torch.zeros(1, 1, 2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        paged_attention_forward(module, q, kv, kv, torch.zeros(1, 1, 2, 2),
                                kvstore_attention=object())


def test_model_whose_attention_drops_the_batch_is_refused() -> None:
    """stablelm's attention does not pass keyword arguments through: refused at wrap time."""
    cfg = transformers.AutoConfig.for_model("stablelm", **BASE)
    with pytest.raises(ValueError, match="keyword arguments"):
        load_hf_model(cfg)


def test_kv_heads_that_differ_from_the_config_are_refused() -> None:
    """gpt_neox ignores num_key_value_heads: the K/V it computes do not fit the pages."""
    cfg = transformers.AutoConfig.for_model("gpt_neox", **BASE)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        load_hf_model(cfg)


@pytest.mark.parametrize(("change", "named"), [
    (lambda attn: setattr(attn, "sliding_window", WINDOW + 1), "sliding_window"),
    (lambda attn: delattr(attn, "layer_idx"), "layer"),
])
def test_attention_modules_that_do_not_fit_the_cache_are_refused_at_wrap(change: Any, named: str
                                                                        ) -> None:
    """A module whose window differs from the config's, or one without its layer_idx, is
    refused when wrapped, before any step runs."""
    cfg = transformers.AutoConfig.for_model("mistral", **{**BASE, **SLIDING})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    change(model.model.layers[1].self_attn)
    with pytest.raises(ValueError, match=named):
        HFCausalLM(model)


def test_windows_from_the_config() -> None:
    assert layer_windows(hf_config("gemma2")) == (WINDOW, None, WINDOW)
    assert layer_windows(hf_config("mistral")) == (WINDOW,) * 3
    # A sliding_window key the config class does not declare is ignored by its model.
    assert layer_windows(transformers.AutoConfig.for_model("llama", **BASE, **SLIDING)) == (None,) * 3


def test_attention_outside_the_engine_raises() -> None:
    model, _ = build("llama")
    assert model.hf.config._attn_implementation == ATTENTION_NAME
    with pytest.raises(RuntimeError, match="kvstore"):
        model.hf(torch.tensor([[1, 2, 3]]))


def test_checkpoint_dir_loads(tmp_path) -> None:
    model, ref = build("qwen3")
    ref.save_pretrained(tmp_path)
    loaded = load_hf_model(tmp_path)
    for (name, a), (_, b) in zip(sorted(ref.state_dict().items()),
                                 sorted(loaded.hf.state_dict().items()), strict=True):
        assert torch.equal(a, b), name
    (out,) = make_engine(loaded).generate([tokens(21, seed=3)], greedy(4))
    check_against_hf(ref, out)


def test_missing_path_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_hf_model(tmp_path / "nothing")


@pytest.mark.slow
def test_triton_kernel_through_transformers_modules() -> None:
    """The Triton kernel (interpreted on CPU) with a window, softcap and sinks' families."""
    for model_type in ("gemma2", "gpt_oss"):
        model, ref = build(model_type)
        engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=BLOCK,
                                               max_num_batched_tokens=8,
                                               attention_backend="triton"))
        shared = tokens(13, seed=1)
        engine.generate([shared + [1]], greedy(2))
        outs = engine.generate([shared + [2, 3], tokens(5, seed=2)], greedy(3))
        assert engine.stats.hit_tokens > 0
        for out in outs:
            check_against_hf(ref, out)


def test_host_tier_restores_a_prefix_the_device_pool_dropped() -> None:
    """Tiers run on the new path: a prefix evicted from the device comes back from host
    memory, and the outputs still match transformers."""
    from kvstore.engine.engine import TierConfig

    model, ref = build("gemma2")
    prefix = tokens(24, seed=200)
    prompts = [prefix + tokens(3, 201)] + [tokens(20, s) for s in range(202, 206)] \
        + [prefix + tokens(5, 209)]
    engine = LLMEngine(model, EngineConfig(num_blocks=30, block_size=BLOCK,
                                           tiers=TierConfig(host_tier_bytes=1 << 22)))
    try:
        outs = [engine.generate([p], greedy(3))[0] for p in prompts]
        stats = engine.stats
        assert stats.evictions > 0 and stats.host_hit_tokens > 0
        for out in outs:
            check_against_hf(ref, out)
    finally:
        engine.close()


def test_abort_leaves_the_others_exact() -> None:
    model, ref = build("llama")
    engine = make_engine(model)
    keep = engine.add_request(tokens(15, seed=1), greedy(4))
    gone = engine.add_request(tokens(15, seed=1)[:9] + [3], greedy(4, n=2))
    engine.step()
    engine.step()
    assert engine.abort_request(gone)
    done: list[RequestOutput] = []
    while engine.has_unfinished_requests:
        done += engine.step()
    assert [o.request_id for o in done] == [keep]
    check_against_hf(ref, done[0])
    assert engine.manager.usage == 0.0


def test_cli_generate_takes_a_checkpoint_path(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvstore.cli import main as cli_main

    _, ref = build("cohere2")
    ref.save_pretrained(tmp_path / "tiny-cohere2")
    assert cli_main(["generate", "--model", str(tmp_path / "tiny-cohere2"), "--max-tokens", "3",
                     "--block-size", "4", "--num-blocks", "128", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tiny-cohere2" in out and "hit_tokens" in out
    with pytest.raises(SystemExit):
        cli_main(["generate", "--model", str(tmp_path / "nowhere")])
    assert "neither a model name" in capsys.readouterr().err
