"""Tiny random transformers models: the presets of ``kvstore generate`` and the tests.

Each preset is a transformers config of a real family's layout (its layer pattern, window
rule, RoPE, softcaps, sinks, experts) at toy widths: vocabulary 256, hidden size 64, four
to six layers. :func:`build_preset` loads one through :func:`~kvstore.models.hf.load_hf_model`
with seeded weights drawn at a scale that gives peaked attention and varied tokens
(transformers' own init makes tiny models near-uniform).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvstore.models.hf import HFCausalLM, load_hf_model

__all__ = ["PRESETS", "build_preset", "preset_config", "randomize_weights_"]

_FULL, _SLIDING = "full_attention", "sliding_attention"
_COMMON: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _rope(theta: float, **scaling: Any) -> dict[str, Any]:
    return {"rope_type": scaling.pop("rope_type", "default"), "rope_theta": theta, **scaling}


_LLAMA = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              rms_norm_eps=1e-6, rope_parameters=_rope(1e4))

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    # 4 full-attention layers (GQA 4:2, head_dim 16).
    "llama": ("llama", _LLAMA),
    # 4 layers, every one sliding with window 16 (MQA 4:1).
    "mistral": ("mistral", dict(_LLAMA, num_key_value_heads=1, sliding_window=16,
                                rms_norm_eps=1e-5)),
    # 4 layers, sliding (window 12) / full alternating, attention and final softcaps.
    "gemma2": ("gemma2", dict(_LLAMA, layer_types=[_SLIDING, _FULL] * 2, sliding_window=12,
                              query_pre_attn_scalar=24, attn_logit_softcapping=20.0,
                              final_logit_softcapping=15.0, tie_word_embeddings=True,
                              hidden_activation="gelu_pytorch_tanh")),
    # 6 layers, 5 sliding (window 8, RoPE base 1e4) : 1 full (base 1e6), q/k norms.
    "gemma3": ("gemma3_text", dict(num_hidden_layers=6, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32,
                                   layer_types=[_SLIDING] * 5 + [_FULL], sliding_window=8,
                                   query_pre_attn_scalar=32, final_logit_softcapping=15.0,
                                   hidden_activation="gelu_pytorch_tanh",
                                   tie_word_embeddings=True, rms_norm_eps=1e-6,
                                   rope_parameters={_FULL: _rope(1e6), _SLIDING: _rope(1e4)})),
    # 4 layers with q/k/v biases; layers 2-3 slide (window 16).
    "qwen2": ("qwen2", dict(_LLAMA, use_sliding_window=True, max_window_layers=2,
                            sliding_window=16, rope_parameters=_rope(1e6))),
    # 4 full-attention layers, q/k norms, head_dim 32 wider than hidden / heads, tied.
    "qwen3": ("qwen3", dict(_LLAMA, head_dim=32, rope_parameters=_rope(1e6),
                            tie_word_embeddings=True)),
    # 4 layers, sliding (window 16) / full alternating, attention sinks, 8 experts with 2 per
    # token, YaRN RoPE as gpt-oss-20b sets it (factor 32, untruncated, base 150000) over an
    # original context of 32 positions.
    "gpt_oss": ("gpt_oss", dict(_LLAMA, num_key_value_heads=1, intermediate_size=64,
                                max_position_embeddings=1024,
                                layer_types=[_SLIDING, _FULL] * 2, sliding_window=16,
                                num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
                                tie_word_embeddings=False,
                                rope_parameters=_rope(150000.0, rope_type="yarn", factor=32.0,
                                                      original_max_position_embeddings=32,
                                                      beta_fast=32.0, beta_slow=1.0,
                                                      truncate=False))),
}
"""Preset name -> (transformers ``model_type``, its config keys)."""


def preset_config(name: str, **changes: Any) -> Any:
    """The transformers config of preset ``name``, its keys updated by ``changes`` (a
    ``num_hidden_layers`` change without ``layer_types`` repeats the preset's pattern).
    ValueError for an unknown name."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {tuple(PRESETS)}")
    model_type, keys = PRESETS[name]
    keys = {**_COMMON, **keys, **changes}
    pattern = keys.get("layer_types")
    if pattern is not None and "layer_types" not in changes:
        keys["layer_types"] = [pattern[i % len(pattern)] for i in range(keys["num_hidden_layers"])]
    return AutoConfig.for_model(model_type, **keys)


def randomize_weights_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Re-draw every parameter with seeded noise: norms keep their offset (1, or Gemma's 0),
    embeddings get unit-norm rows, biases and sinks small noise, matrices a gain of 2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            if "norm" in name:
                p.add_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.1 * noise)
            elif "embed" in name:
                p.copy_(noise * p.shape[-1] ** -0.5)
            else:
                p.copy_(noise * 2.0 / math.sqrt(p.shape[-1]))
    return model


def build_preset(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", **changes: Any) -> HFCausalLM:
    """Preset ``name`` (with config ``changes``) as an :class:`HFCausalLM` with seeded
    random weights."""
    model = load_hf_model(preset_config(name, **changes), dtype=dtype, device=device)
    randomize_weights_(model.hf, seed)
    return model
