"""gpt-oss (attention sinks, 128-token sliding layers, mixture of experts) through kvstore's
paged cache on transformers 5.24's own GptOssForCausalLM, CPU only.

The case is a tiny ``config.json`` dict shaped like the published gpt-oss-20b one: sliding /
full layers alternating with ``sliding_window`` 128, GQA 8:1 with ``head_dim * heads !=
hidden``, q/k/v/o biases, per-head sinks, routed experts with the clamped SwiGLU, untied
embeddings and YaRN RoPE (factor 32, untruncated, base 150000) over a reduced original
context. Sequences pass the window and the original context; the reference is transformers'
eager attention over the same weights. Also: the sinks reach kvstore's kernels (reference
and Triton under the interpreter), safetensors and MXFP4 checkpoints load, bf16 runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from engines import check_against_hf, eager_reference, greedy, tokens  # noqa: E402
from test_engine import BLOCK, check_engine_against_hf, make_engine  # noqa: E402

import kvstore.kernels.api as kernels_api  # noqa: E402
from kvstore.models.hf import HFCausalLM, load_hf_model  # noqa: E402
from kvstore.models.presets import build_preset, randomize_weights_  # noqa: E402

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
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def build(d: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32) -> HFCausalLM:
    """gpt-oss of config dict ``d`` over kvstore: peaked weights, sinks of either sign, expert
    projections large enough that the SwiGLU clamp bites."""
    config = transformers.CONFIG_MAPPING["gpt_oss"].from_dict(dict(d))
    model = load_hf_model(config, dtype=dtype)
    randomize_weights_(model.hf, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.hf.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(2.0 * torch.randn(sinks.shape, generator=g) + 1.0)
            layer.mlp.experts.gate_up_proj.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, HFCausalLM]:
    model = build(GPT_OSS_20B)
    return eager_reference(model), model


def test_engine_matches_hf(pair: tuple) -> None:
    """Through LLMEngine past the window and the original context: a chunked shared-prefix
    batch (caching on and off agree), a partial hit after a finish, a fork, and a pool small
    enough to preempt and evict."""
    hf, model = pair
    check_engine_against_hf(hf, model, WINDOW + ORIGINAL // 2 + 6, max_tokens=4,
                            batched_tokens=48, small_batched_tokens=24)


@torch.no_grad()
def test_sinks_reach_the_paged_attention(pair: tuple) -> None:
    """The module's sinks decide the output: with every sink at -1e9 (no sink mass) the
    engine's logits change, and still equal transformers' with the same sinks."""
    hf, model = pair
    prompt = tokens(WINDOW + 9, seed=12)
    (with_sinks,) = make_engine(model, max_num_batched_tokens=256).generate([prompt], greedy(2))
    saved = [layer.self_attn.sinks.clone() for layer in model.hf.model.layers]
    try:
        for net in (model.hf, hf):
            for layer in net.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
        (without,) = make_engine(model, max_num_batched_tokens=256).generate([prompt], greedy(2))
        check_against_hf(hf, without)
    finally:
        for net in (model.hf, hf):
            for layer, s in zip(net.model.layers, saved, strict=True):
                layer.self_attn.sinks.copy_(s)
    assert with_sinks.outputs[0].logits is not None and without.outputs[0].logits is not None
    assert (with_sinks.outputs[0].logits - without.outputs[0].logits).abs().max() > 1e-2


def test_triton_kernel_matches_hf(pair: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton paged-attention kernel with sinks (interpreted on CPU) in the engine: a
    prompt longer than the window, then a partial prefix hit."""
    hf, model = pair
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


def test_checkpoint_dir(pair: tuple, tmp_path: Path) -> None:
    """save_pretrained's safetensors (fused expert tensors) load into an equal model."""
    hf, model = pair
    model.hf.save_pretrained(tmp_path)
    loaded = load_hf_model(tmp_path)
    for (name, a), (_, b) in zip(sorted(model.hf.state_dict().items()),
                                 sorted(loaded.hf.state_dict().items()), strict=True):
        assert torch.equal(a, b), name
    (out,) = make_engine(loaded).generate([tokens(WINDOW + 5, seed=13)], greedy(3))
    check_against_hf(hf, out)


def test_mxfp4_checkpoint_dir(tmp_path: Path) -> None:
    """A checkpoint storing the experts as gpt-oss-20b does (MXFP4 blocks and scales, the
    rest dense, quantization_config in config.json) loads on CPU through transformers, which
    dequantizes the experts, and serves them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = dict(GPT_OSS_20B, num_hidden_layers=2, layer_types=GPT_OSS_20B["layer_types"][:2])
    model = build(d, seed=3)
    c = model.hf.config
    e, h, i = c.num_local_experts, c.hidden_size, c.intermediate_size
    sd = {k: v.contiguous() for k, v in model.hf.state_dict().items()}
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.hf.model.layers):
            prefix = f"model.layers.{layer_idx}.mlp.experts."
            for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g,
                                       dtype=torch.uint8)
                scales = torch.randint(120, 125, (e, rows, cols // 32), generator=g,
                                       dtype=torch.uint8)
                getattr(layer.mlp.experts, name).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                del sd[prefix + name]
                sd[prefix + name + "_blocks"], sd[prefix + name + "_scales"] = blocks, scales
    c.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = MXFP4
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(sd, str(tmp_path / "model.safetensors"))
    loaded = load_hf_model(tmp_path)
    for name, p in model.hf.named_parameters():
        assert torch.equal(loaded.hf.get_parameter(name), p), name
    (out,) = make_engine(loaded).generate([tokens(WINDOW + 3, seed=14)], greedy(3))
    check_against_hf(eager_reference(model), out)


@torch.no_grad()
def test_bf16_preset_runs_on_bf16_pages() -> None:
    """The gpt_oss preset in bf16: pages hold bf16, and its logits are no farther from the
    fp32 model's (same weights) than transformers' own eager bf16 forward is."""
    model = build_preset("gpt_oss", dtype=torch.bfloat16)
    engine = make_engine(model, max_num_batched_tokens=64)
    assert engine.cache.dtype == torch.bfloat16
    prompt = tokens(40, seed=15)
    (out,) = engine.generate([prompt], greedy(3))
    fp32 = eager_reference(model).float()
    seq = torch.tensor([prompt + out.outputs[0].token_ids])
    want = fp32(seq).logits[0, 39:42]
    eager_bf16 = eager_reference(model)(seq).logits[0, 39:42].float()
    assert out.outputs[0].logits is not None
    ours = (out.outputs[0].logits - want).abs().max()
    assert ours <= 1.5 * (eager_bf16 - want).abs().max() + 0.05
