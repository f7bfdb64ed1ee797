"""gpt-oss (attention sinks, 128-token sliding layers, mixture of experts) against
transformers 5.24's GptOssForCausalLM, eager fp32, CPU only.

The cases are tiny ``config.json`` dicts shaped like the published gpt-oss-20b one:
sliding / full layers alternating with ``sliding_window`` 128, GQA 8:1 with ``head_dim *
heads != hidden``, q/k/v/o biases, per-head sinks, ``num_local_experts`` experts of which
``num_experts_per_tok`` are routed per token, the clamped SwiGLU (``swiglu_limit`` 7),
untied embeddings, eps 1e-5 and YaRN RoPE (factor 32, untruncated, base 150000) over a
reduced original context. HF runs with eager attention and eager experts; sequences pass
the window and the original context. We check that each gpt-oss feature is exercised
(removing it from our side, or changing it on HF's side, changes the logits), the dense
reference, :class:`LLMEngine` (prefix hits, partial hits, a fork, preemption and
eviction, the Triton kernel under the interpreter), checkpoint loading (plain and MXFP4),
the config rules and the preset.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_engine import (  # noqa: E402
    BLOCK,
    check_against_hf,
    check_engine_against_hf,
    greedy,
    make_engine,
    tokens,
)
from test_models_hf import ATOL, hf_logits, our_logits, random_prompts, randomize_  # noqa: E402

import kvstore.kernels.api as kernels_api  # noqa: E402
from kvstore.cli import DEMO_MODELS  # noqa: E402
from kvstore.cli import main as cli_main  # noqa: E402
from kvstore.models.model import (  # noqa: E402
    PRESETS,
    DecoderModel,
    ModelConfig,
    RopeScaling,
    dense_causal_attention,
    dequantize_mxfp4,
    load_checkpoint_dir,
    load_state_dict_from_hf,
    tiny_gpt_oss,
    tiny_llama,
)

WINDOW = 128
ORIGINAL = 64  # YaRN's original context (4096 in gpt-oss-20b)

# gpt-oss-20b's config.json with reduced sizes (and no token ids, which exceed the vocab).
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "experts_per_token": 2, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initial_context_length": ORIGINAL, "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 32 * ORIGINAL, "num_attention_heads": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 1,
    "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": ORIGINAL, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": WINDOW,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 256,
}
# The same in transformers 5.x spelling, with 4 experts of which 3 per token and GQA 8:2.
GPT_OSS_V5 = dict(
    {k: v for k, v in GPT_OSS_20B.items() if k not in ("rope_scaling", "rope_theta")},
    num_local_experts=4, num_experts_per_tok=3, num_key_value_heads=2,
    rope_parameters=dict(GPT_OSS_20B["rope_scaling"], rope_theta=150000.0),
)
CASES = {"gpt-oss-20b": GPT_OSS_20B, "v5-spelling": GPT_OSS_V5}


def hf_config_from_dict(d: dict[str, Any]) -> transformers.PreTrainedConfig:
    """The config transformers builds from a ``config.json`` dict."""
    return transformers.CONFIG_MAPPING[d["model_type"]].from_dict(copy.deepcopy(d))


def build_hf(d: dict[str, Any], seed: int = 0) -> transformers.PreTrainedModel:
    """A randomised HF gpt-oss with eager attention and eager experts: peaked attention,
    sinks of either sign, expert projections large enough that the SwiGLU clamp bites."""
    hf = transformers.AutoModelForCausalLM.from_config(
        hf_config_from_dict(d), attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32,
    ).eval()
    assert hf.config._attn_implementation == "eager"
    assert hf.config._experts_implementation == "eager"
    randomize_(hf, False, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in hf.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(2.0 * torch.randn(sinks.shape, generator=g) + 1.0)
            layer.mlp.experts.gate_up_proj.mul_(3.0)
    return hf


def build_pair(d: dict[str, Any], seed: int = 0
               ) -> tuple[transformers.PreTrainedModel, DecoderModel]:
    """A randomised HF model built from ``d`` and our model from the same dict."""
    hf = build_hf(d, seed)
    ours = DecoderModel(ModelConfig.from_hf(copy.deepcopy(d))).eval()
    load_state_dict_from_hf(ours, hf.state_dict())
    return hf, ours


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[transformers.PreTrainedModel, DecoderModel]]:
    return {name: build_pair(d) for name, d in CASES.items()}


@torch.no_grad()
def dense_logits(model: DecoderModel, seq: torch.Tensor, **kw: Any) -> torch.Tensor:
    attn = dense_causal_attention(model, [len(seq)], **kw)
    return model.compute_logits(model(seq, torch.arange(len(seq)), attn))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", list(CASES))
def test_config_from_dict_and_object(name: str) -> None:
    d = CASES[name]
    cfg = ModelConfig.from_hf(copy.deepcopy(d))
    hf_cfg = hf_config_from_dict(d)
    assert cfg == ModelConfig.from_hf(hf_cfg)
    assert cfg.layer_types == tuple(hf_cfg.layer_types)
    assert cfg.sliding_layers == (0, 2) and cfg.sliding_window == WINDOW
    assert cfg.attention_sinks and cfg.attention_bias and not cfg.tie_word_embeddings
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (
        hf_cfg.num_local_experts, hf_cfg.num_experts_per_tok)
    assert (cfg.swiglu_alpha, cfg.swiglu_limit, cfg.rms_norm_eps) == (1.702, 7.0, 1e-5)
    assert cfg.rope_theta == 150000.0
    assert cfg.rope_scaling == RopeScaling("yarn", 32.0, ORIGINAL, truncate=False,
                                           attention_factor=0.1 * math.log(32.0) + 1.0)
    assert cfg.family == "gpt_oss"


def test_config_defaults_and_spellings() -> None:
    """What transformers fills in: alternating layers from a sliding one, YaRN (factor 32,
    untruncated, 4096 original positions, base 150000) when no RoPE is named, the
    ``num_experts`` alias; the window off with sliding layers is an error."""
    small = {"model_type": "gpt_oss", "num_hidden_layers": 5, "hidden_size": 64,
             "num_attention_heads": 16, "head_dim": 16, "num_experts": 6,
             "num_experts_per_tok": 2, "intermediate_size": 32, "vocab_size": 64}
    cfg = ModelConfig.from_hf(small)
    hf_cfg = hf_config_from_dict(small)
    assert cfg == ModelConfig.from_hf(hf_cfg)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2 + ("sliding_attention",)
    assert cfg.num_experts == 6 == hf_cfg.num_local_experts
    assert cfg.num_kv_heads == 8 and cfg.sliding_window == 128
    assert cfg.rope_scaling == RopeScaling("yarn", 32.0, 4096, truncate=False,
                                           attention_factor=0.1 * math.log(32.0) + 1.0)
    assert ModelConfig.from_hf(dict(small, rope_theta=1000.0)).rope_theta == 1000.0
    plain = ModelConfig.from_hf(dict(small, rope_parameters={"rope_type": "default"}))
    assert plain.rope_scaling is None and plain.rope_theta == 150000.0
    assert plain == ModelConfig.from_hf(hf_config_from_dict(
        dict(small, rope_parameters={"rope_type": "default"})))
    full = ModelConfig.from_hf(dict(small, layer_types=["full_attention"] * 5))
    assert full.sliding_layers == () and full.sliding_window is None
    with pytest.raises(ValueError, match="sliding_window is null"):
        ModelConfig.from_hf(dict(small, sliding_window=None))
    with pytest.raises(ValueError, match="'num_experts_per_tok' must be an integer"):
        ModelConfig.from_hf(dict(small, num_experts_per_tok=1.5))
    with pytest.raises(ValueError, match="num_experts_per_tok must be in 1..num_experts=6"):
        ModelConfig.from_hf(dict(small, num_experts_per_tok=7))


def test_layer_sinks() -> None:
    model = DecoderModel(tiny_gpt_oss())
    assert model.layer_sinks(0).shape == (4,)
    assert model.layer_sinks(3) is model.layers[3].attn.sinks
    with pytest.raises(IndexError):
        model.layer_sinks(4)
    assert DecoderModel(tiny_llama()).layer_sinks(0) is None


# ----------------------------------------------------------------------------- vs HF


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hf(name: str, pairs: dict) -> None:
    """Past the window and the original context, in one flat ragged batch."""
    hf, ours = pairs[name]
    seqs = random_prompts([WINDOW + ORIGINAL + 9, 7, 1, WINDOW + 1], 256, seed=11)
    refs = [hf_logits(hf, s) for s in seqs]
    for out, ref in zip(our_logits(ours, seqs), refs, strict=True):
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=1e-4)
    assert refs[0].std(dim=0).mean() > 0.2  # position-dependent outputs


@torch.no_grad()
def test_each_feature_is_exercised(pairs: dict) -> None:
    """Dropping any gpt-oss feature on our side visibly changes the logits; HF's eager path
    applies its sinks (sinks at -1e9 on both sides agree with no sinks)."""
    hf, ours = pairs["gpt-oss-20b"]
    seq = random_prompts([WINDOW + ORIGINAL + 9], 256, seed=12)[0]
    ref = hf_logits(hf, seq)
    torch.testing.assert_close(dense_logits(ours, seq), ref, atol=ATOL, rtol=1e-4)

    def off(**changes: Any) -> DecoderModel:
        other = DecoderModel(dataclasses.replace(ours.config, **changes)).eval()
        other.load_state_dict(ours.state_dict())
        return other

    wrong = {
        "no sinks": dense_logits(ours, seq, sinks_fn=lambda i: None),
        "window + 1": dense_logits(ours, seq, window_fn=lambda i: (
            None if ours.layer_window(i) is None else WINDOW + 1)),
        "no window": dense_logits(ours, seq, window_fn=lambda i: None),
        "no yarn": dense_logits(off(rope_scaling=None), seq),
        "no clamp": dense_logits(off(swiglu_limit=1e9), seq),
        "top-1": dense_logits(off(num_experts_per_tok=1), seq),
    }
    for what, logits in wrong.items():
        assert (logits - ref).abs().max() > 1e-2, what

    saved = [layer.self_attn.sinks.clone() for layer in hf.model.layers]
    try:
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e9)
        no_sinks = hf_logits(hf, seq)
    finally:
        for layer, s in zip(hf.model.layers, saved, strict=True):
            layer.self_attn.sinks.copy_(s)
    assert (no_sinks - ref).abs().max() > 1e-2
    torch.testing.assert_close(wrong["no sinks"], no_sinks, atol=ATOL, rtol=1e-4)

    # The router spreads tokens over every expert; the clamp sees values beyond its limit.
    x = ours.embed(seq)
    layer = ours.layers[0]
    h = layer.mlp_norm(x)
    _, idx = layer.mlp.router(h)
    assert idx.unique().numel() == ours.config.num_experts
    gate_up = h @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > ours.config.swiglu_limit).any()


# ----------------------------------------------------------------------------- engine


def test_engine_matches_hf(pairs: dict) -> None:
    """Through LLMEngine past the window and the original context: a chunked shared-prefix
    batch (caching on and off agree), a partial hit after a finish, a fork, and a pool small
    enough to preempt and evict."""
    hf, model = pairs["gpt-oss-20b"]
    check_engine_against_hf(hf, model, WINDOW + ORIGINAL // 2 + 6, max_tokens=4,
                            batched_tokens=48, small_batched_tokens=24)


def test_triton_kernel_matches_hf(pairs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton paged-attention kernel with sinks (interpreted on CPU) in the engine: a
    prompt longer than the window, then a partial prefix hit."""
    hf, model = pairs["gpt-oss-20b"]
    kernel = kernels_api.paged_attention
    sinks_seen: list[torch.Tensor | None] = []

    def recording_kernel(*args: Any, **kwargs: Any) -> torch.Tensor:
        sinks_seen.append(kwargs.get("sinks"))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(kernels_api, "paged_attention", recording_kernel)
    first = tokens(WINDOW + 3, seed=60)
    second = first[: BLOCK + 2] + tokens(2, seed=61)
    engine = make_engine(model, attention_backend="triton", max_num_batched_tokens=256)
    a = engine.generate([first], greedy(2))[0]
    b = engine.generate([second], greedy(2))[0]
    assert engine.stats.hit_tokens == BLOCK + 2
    assert engine.stats.partial_hits > 0
    check_against_hf(hf, a)
    check_against_hf(hf, b)
    assert sinks_seen and all(s is not None for s in sinks_seen)


# ----------------------------------------------------------------------------- loading


def test_checkpoint_dir(pairs: dict, tmp_path: Path) -> None:
    """save_pretrained's safetensors (fused expert tensors) load into an equal model."""
    hf, ours = pairs["gpt-oss-20b"]
    hf.save_pretrained(tmp_path)
    model = load_checkpoint_dir(tmp_path)
    assert model.config == ours.config
    seq = random_prompts([WINDOW + 5], 256, seed=13)[0]
    torch.testing.assert_close(our_logits(model, [seq])[0], hf_logits(hf, seq), atol=ATOL,
                               rtol=1e-4)


def random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks ``[E, rows, G, 16]`` and scales ``[E, rows, G]`` (2^-7..2^-3)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 125, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_mxfp4((3, 10, 2), seed=0)
    blocks[0, 0, 0, :2] = torch.tensor([0x10, 0xF8], dtype=torch.uint8)  # 0, 0.5; -0, -6
    scales[0, 0, 0] = 127
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 64, 10) and ours.dtype == torch.float32
    assert ours[0, :4, 0].tolist() == [0.0, 0.5, -0.0, -6.0]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1])


def test_mxfp4_checkpoint_dir(tmp_path: Path) -> None:
    """A checkpoint storing the experts as gpt-oss-20b does (MXFP4 blocks and scales, the
    rest dense, quantization_config in config.json) loads, dequantized as transformers
    dequantizes it."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = dict(GPT_OSS_20B, num_hidden_layers=2, layer_types=GPT_OSS_20B["layer_types"][:2])
    hf = build_hf(d, seed=3)
    e, h, i = d["num_local_experts"], d["hidden_size"], d["intermediate_size"]
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        for layer_idx, layer in enumerate(hf.model.layers):
            prefix = f"model.layers.{layer_idx}.mlp.experts."
            for j, (name, rows, cols) in enumerate((("gate_up_proj", 2 * i, h),
                                                    ("down_proj", h, i))):
                blocks, scales = random_mxfp4((e, rows, cols // 32), seed=10 * layer_idx + j)
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                del sd[prefix + name]
                sd[prefix + name + "_blocks"], sd[prefix + name + "_scales"] = blocks, scales
    hf.config.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    model = load_checkpoint_dir(tmp_path)
    seq = random_prompts([WINDOW + 3], 256, seed=14)[0]
    torch.testing.assert_close(our_logits(model, [seq])[0], hf_logits(hf, seq), atol=ATOL,
                               rtol=1e-4)

    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantized checkpoint"):
        load_checkpoint_dir(tmp_path)


# ----------------------------------------------------------------------------- preset, CLI


def test_preset_matches_hf() -> None:
    """tiny_gpt_oss (window 16) is what from_hf reads from its config.json, and matches HF."""
    cfg = tiny_gpt_oss()
    assert PRESETS["tiny_gpt_oss"] is tiny_gpt_oss and "gpt_oss" in DEMO_MODELS
    d = dict(GPT_OSS_20B, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, sliding_window=cfg.sliding_window,
             num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
             max_position_embeddings=32 * 32,
             rope_scaling=dict(GPT_OSS_20B["rope_scaling"], original_max_position_embeddings=32))
    assert ModelConfig.from_hf(d) == cfg
    hf, ours = build_pair(d, seed=7)
    seqs = random_prompts([3 * cfg.sliding_window + 5, 9], 256, seed=15)
    for out, seq in zip(our_logits(ours, seqs), seqs, strict=True):
        torch.testing.assert_close(out, hf_logits(hf, seq), atol=ATOL, rtol=1e-4)


def test_generate_accepts_gpt_oss(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--model", "gpt_oss", "--max-tokens", "3", "--block-size", "4",
                     "--device", "cpu"]) == 0
    assert "hit_tokens" in capsys.readouterr().out
