"""DecoderModel against HuggingFace transformers (eager, fp32), CPU only.

Each tiny preset is mirrored by a HF config, the HF model gets larger random
weights (HF's default init makes attention near-uniform, which would hide
masking and RoPE bugs), and its state dict is loaded into our model. Our
model runs through the dense reference attention over a flat ragged batch.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from kvstore.models.model import (  # noqa: E402
    DecoderModel,
    ModelConfig,
    dense_causal_attention,
    load_checkpoint_dir,
    load_state_dict_from_hf,
    tiny_gemma2,
    tiny_gemma3,
    tiny_llama,
    tiny_mistral,
    tiny_qwen2,
    tiny_qwen3,
)

PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "llama": tiny_llama,
    "mistral": tiny_mistral,
    "gemma2": tiny_gemma2,
    "gemma3": tiny_gemma3,
    "qwen2": tiny_qwen2,
    "qwen3": tiny_qwen3,
}
WINDOWED = ["mistral", "gemma2", "gemma3", "qwen2"]
ATOL = 1e-4


def hf_config(cfg: ModelConfig) -> transformers.PreTrainedConfig:
    """The HuggingFace config that describes the same architecture as ``cfg``."""
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.family == "llama":
        return transformers.LlamaConfig(rope_parameters=rope, **common)
    if cfg.family == "mistral":
        return transformers.MistralConfig(
            sliding_window=cfg.sliding_window, rope_parameters=rope, **common
        )
    if cfg.family in ("qwen2", "qwen3"):
        # Sliding layers as transformers derives them: from max_window_layers on.
        first = min(cfg.sliding_layers, default=cfg.num_layers)
        assert cfg.sliding_layers == tuple(range(first, cfg.num_layers))
        qwen = transformers.Qwen2Config if cfg.family == "qwen2" else transformers.Qwen3Config
        return qwen(
            use_sliding_window=bool(cfg.sliding_layers), sliding_window=cfg.sliding_window,
            max_window_layers=first, rope_parameters=rope, **common
        )
    gemma = dict(
        sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types),
        query_pre_attn_scalar=int(cfg.query_pre_attn_scalar),
        final_logit_softcapping=cfg.final_logit_softcap,
        hidden_activation=cfg.hidden_act,
    )
    if cfg.family == "gemma2":
        return transformers.Gemma2Config(
            attn_logit_softcapping=cfg.attn_logit_softcap, rope_parameters=rope, **gemma, **common
        )
    local = {"rope_type": "default", "rope_theta": cfg.local_rope_theta}
    return transformers.Gemma3TextConfig(
        rope_parameters={"full_attention": rope, "sliding_attention": local}, **gemma, **common
    )


def randomize_(hf_model: torch.nn.Module, gemma: bool, seed: int) -> None:
    """Re-initialise every parameter at a scale that gives peaked attention."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * 2.0 / p.shape[-1] ** 0.5)


def build_pair(
    cfg: ModelConfig, seed: int = 0
) -> tuple[transformers.PreTrainedModel, DecoderModel]:
    """A randomised HF model and our model loaded from its state dict."""
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_config(cfg), attn_implementation="eager", dtype=torch.float32
    ).eval()
    randomize_(hf, cfg.gemma_norm, seed)
    ours = DecoderModel(cfg).eval()
    load_state_dict_from_hf(ours, hf.state_dict())
    return hf, ours


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[transformers.PreTrainedModel, DecoderModel]]:
    return {style: build_pair(make()) for style, make in PRESETS.items()}


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@torch.no_grad()
def hf_logits(hf: transformers.PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids[None]).logits[0]


@torch.no_grad()
def our_logits(
    model: DecoderModel,
    seqs: list[torch.Tensor],
    window_fn: Callable[[int], int | None] | None = None,
) -> list[torch.Tensor]:
    """Per-sequence logits from one flat ragged forward through dense attention."""
    lens = [len(s) for s in seqs]
    flat = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in lens])
    attn = dense_causal_attention(model, lens, window_fn)
    logits = model.compute_logits(model(flat, positions, attn))
    return list(logits.split(lens))


@pytest.mark.parametrize("style", list(PRESETS))
def test_from_hf_reproduces_preset(style: str) -> None:
    cfg = PRESETS[style]()
    assert ModelConfig.from_hf(hf_config(cfg)) == cfg


def test_from_hf_rejects_unsupported() -> None:
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    scaled = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )
    with pytest.raises(ValueError, match="RoPE type 'dynamic' in rope_parameters"):
        ModelConfig.from_hf(scaled)
    gemma3 = transformers.Gemma3TextConfig(use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_hf(gemma3)


@pytest.mark.parametrize("style", list(PRESETS))
def test_full_sequence_logits_match_hf(style: str, pairs: dict) -> None:
    hf, ours = pairs[style]
    window = ours.config.sliding_window or 16
    lens = [5, window + 3, 2 * window + 7, 1]
    seqs = random_prompts(lens, ours.config.vocab_size, seed=1)
    got = our_logits(ours, seqs)
    for seq, out in zip(seqs, got, strict=True):
        ref = hf_logits(hf, seq)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    # The weights must make outputs position-dependent, or the test proves little.
    long_ref = hf_logits(hf, seqs[2])
    assert long_ref.std(dim=0).mean() > 0.2


def test_gemma2_attention_softcap_is_exercised(pairs: dict) -> None:
    hf, ours = pairs["gemma2"]
    seq = random_prompts([20], ours.config.vocab_size, seed=2)
    ref = hf_logits(hf, seq[0])
    cap = ours.attn_softcap
    try:
        ours.attn_softcap = None
        uncapped = our_logits(ours, seq)[0]
    finally:
        ours.attn_softcap = cap
    assert (uncapped - ref).abs().max() > 1e-2
    torch.testing.assert_close(our_logits(ours, seq)[0], ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("style", list(PRESETS))
def test_greedy_generation_matches_hf(style: str, pairs: dict) -> None:
    hf, ours = pairs[style]
    n_new = 10
    prompt_len = (ours.config.sliding_window or 16) + 2
    prompt = random_prompts([prompt_len], ours.config.vocab_size, seed=3)[0]
    with torch.no_grad():
        gen = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            do_sample=False,
            max_new_tokens=n_new,
            min_new_tokens=n_new,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = gen.sequences[0]
    assert len(tokens) == prompt_len + n_new
    for step in range(n_new):
        # Re-run the whole reference prefix through dense attention each step.
        prefix = tokens[: prompt_len + step]
        last = our_logits(ours, [prefix])[0][-1]
        torch.testing.assert_close(last, gen.logits[step][0], atol=ATOL, rtol=1e-4)
        assert int(last.argmax()) == int(tokens[prompt_len + step])


@pytest.mark.parametrize("style", WINDOWED)
def test_window_is_exact(style: str, pairs: dict) -> None:
    """W = config.sliding_window matches HF; W - 1 and W + 1 do not."""
    hf, ours = pairs[style]
    w = ours.config.sliding_window
    assert all(
        ours.layer_window(i) == (w if t == "sliding_attention" else None)
        for i, t in enumerate(ours.config.layer_types)
    )
    seq = random_prompts([w + 2], ours.config.vocab_size, seed=4)
    ref = hf_logits(hf, seq[0])
    torch.testing.assert_close(our_logits(ours, seq)[0], ref, atol=ATOL, rtol=1e-4)
    # Rows before position W see the whole prefix under any window >= W.
    for offset in (-1, 1):
        def shifted(i: int, offset: int = offset) -> int | None:
            base = ours.layer_window(i)
            return None if base is None else base + offset

        out = our_logits(ours, seq, shifted)[0]
        assert (out[w - 1 :] - ref[w - 1 :]).abs().max() > 1e-2, offset


@pytest.mark.parametrize("window", [1, 2, 5, 64])
def test_window_edges_mistral(window: int) -> None:
    """Tiny windows (W = 1: attend to self only) and a window wider than the sequence."""
    import dataclasses

    cfg = dataclasses.replace(tiny_mistral(), sliding_window=window, num_layers=2,
                              layer_types=("sliding_attention",) * 2)
    hf, ours = build_pair(cfg, seed=5)
    seqs = random_prompts([12, 3], cfg.vocab_size, seed=6)
    for seq, out in zip(seqs, our_logits(ours, seqs), strict=True):
        torch.testing.assert_close(out, hf_logits(hf, seq), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("style", list(PRESETS))
def test_safetensors_round_trip(style: str, pairs: dict, tmp_path: Path) -> None:
    hf, _ = pairs[style]
    hf.save_pretrained(tmp_path)
    assert list(tmp_path.glob("*.safetensors"))
    model = load_checkpoint_dir(tmp_path)
    assert model.config == PRESETS[style]()
    raw = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf(raw) == PRESETS[style]()
    seqs = random_prompts([7, 25], model.config.vocab_size, seed=7)
    for seq, out in zip(seqs, our_logits(model, seqs), strict=True):
        torch.testing.assert_close(out, hf_logits(hf, seq), atol=ATOL, rtol=1e-4)


def test_mismatched_state_dict_raises(pairs: dict) -> None:
    hf, _ = pairs["llama"]
    sd = dict(hf.state_dict())
    model = DecoderModel(tiny_llama())
    before = {k: v.clone() for k, v in model.state_dict().items()}

    missing = {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"missing keys.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_state_dict_from_hf(model, missing)

    extra = {**sd, "model.layers.9.self_attn.q_proj.weight": torch.zeros(64, 64)}
    with pytest.raises(ValueError, match=r"unexpected keys.*model\.layers\.9"):
        load_state_dict_from_hf(model, extra)

    reshaped = {**sd, "model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(ValueError, match=r"shape mismatches.*k_proj.*\(16, 64\)"):
        load_state_dict_from_hf(model, reshaped)

    # A Gemma-2 checkpoint into a Llama model: extra sandwich norms are unexpected.
    gemma_sd = pairs["gemma2"][0].state_dict()
    with pytest.raises(ValueError, match="pre_feedforward_layernorm"):
        load_state_dict_from_hf(model, gemma_sd)

    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a failed load"


def test_mismatched_checkpoint_dir_raises(pairs: dict, tmp_path: Path) -> None:
    hf, _ = pairs["gemma3"]
    hf.save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    raw["num_hidden_layers"] = 5
    raw["layer_types"] = raw["layer_types"][:5]
    config_path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"unexpected keys.*model\.layers\.5\."):
        load_checkpoint_dir(tmp_path)
