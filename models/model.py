"""Small decoder-only models with per-layer full / sliding-window attention.

One decoder family covers Llama-, Mistral-, Gemma-2-, Gemma-3-, Qwen2-, Qwen3- and
gpt-oss-style models (attention sinks, a mixture-of-experts MLP), with default, linear,
llama3 and YaRN RoPE.
The model owns no KV cache: every attention call goes through an ``AttentionFn``
supplied by the caller (the engine's paged cache, or the dense reference in
:func:`dense_causal_attention`), over a flat ragged batch of tokens.

Sliding-window convention
-------------------------
``DecoderModel.layer_window(i)`` returns ``W`` such that the query at position
``q`` attends the keys ``k`` with ``q - W < k <= q`` (``W`` keys, itself
included), or ``None`` for a full-attention layer.

Finding for transformers 5.24.0 (read in ``masking_utils.py`` and checked by
``tests/test_models_hf.py``): ``sliding_window_overlay(w)`` keeps
``kv_idx > q_idx - w``, and ``create_sliding_window_causal_mask`` passes
``config.sliding_window`` to it unchanged, for Mistral, Gemma 2, Gemma 3 and
Qwen2/Qwen3 and gpt-oss alike (Qwen's sliding layers are ``layer_types``, by default the
layers from ``max_window_layers`` on when ``use_sliding_window``). So
``W == config.sliding_window`` with no off-by-one for all of them (eager path,
and the decode path through HF's sliding cache layers). The one exception is
Gemma 3 with ``use_bidirectional_attention=True``, where the config rewrites
``sliding_window`` to ``w // 2 + 1``; that mode is not causal and is rejected
by :meth:`ModelConfig.from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]``.

``q`` and ``k`` already carry RoPE (and q/k norm). The callee knows which tokens
belong to which sequence and which earlier keys/values (cached) they attend.
"""


# --------------------------------------------------------------------------- config

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE variants :meth:`ModelConfig.from_hf` accepts (transformers' ``rope_type`` names)."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "gemma2", "gemma3_text", "qwen2", "qwen3", "gpt_oss")
"""HuggingFace ``model_type`` values :meth:`ModelConfig.from_hf` accepts."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A scaled RoPE variant, with transformers 5.24's frequencies (``rope_type`` names).

    * ``linear``: every inverse frequency divided by ``factor``;
    * ``llama3``: frequencies whose wavelength exceeds ``original_max_position_embeddings /
      low_freq_factor`` divided by ``factor``, those under ``original_max_position_embeddings
      / high_freq_factor`` kept, a smooth blend in between;
    * ``yarn``: original frequencies below the ``beta_fast`` rotation count, ``factor``-
      interpolated ones above ``beta_slow``, a linear ramp in between (``truncate`` rounds its
      ends outwards); cos and sin are multiplied by ``attention_factor``.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # yarn

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise ValueError(
                f"RopeScaling.rope_type must be one of {ROPE_TYPES[1:]}, got {self.rope_type!r}"
            )
        if not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.rope_type in ("llama3", "yarn") and (
            self.original_max_position_embeddings is None or self.original_max_position_embeddings < 1
        ):
            raise ValueError(
                f"{self.rope_type} RoPE needs original_max_position_embeddings >= 1, "
                f"got {self.original_max_position_embeddings}"
            )
        if self.rope_type == "llama3" and (
            self.low_freq_factor is None or self.high_freq_factor is None
            or not self.high_freq_factor > self.low_freq_factor
        ):
            raise ValueError(
                "llama3 RoPE needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )
        if self.rope_type != "yarn" and self.attention_factor != 1.0:
            raise ValueError(f"{self.rope_type} RoPE has no attention_factor")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`DecoderModel`.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``;
    sliding layers use ``sliding_window`` (see the module docstring for the
    convention). RoPE: base ``rope_theta`` with ``rope_scaling`` on every layer,
    except that when ``local_rope_theta`` is set the sliding layers use that base
    with ``local_rope_scaling`` instead (Gemma 3). The style flags select the
    Llama, Gemma or Qwen variants of each component.

    gpt-oss: ``attention_sinks`` gives every attention layer one learned logit per query
    head that joins each softmax denominator (its probability dropped); ``num_experts > 0``
    replaces the gated MLP by a mixture of experts: a router (with bias) picks the top
    ``num_experts_per_tok`` experts per token and weights them by a softmax over the picked
    logits; each expert (with biases, ``intermediate_size`` wide) applies the clamped SwiGLU
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``
    (``swiglu_alpha``, ``swiglu_limit``) to its interleaved gate/up projection.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    local_rope_theta: float | None = None
    rms_norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None
    local_rope_scaling: RopeScaling | None = None
    # style flags
    hidden_act: str = "silu"
    gemma_norm: bool = False  # RMSNorm scales by (1 + weight) instead of weight
    sandwich_norm: bool = False  # extra norms after attention and after the MLP
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    scale_embeddings: bool = False  # embeddings multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attn scale = this**-0.5 (else head_dim**-0.5)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # biases on q, k, v and o projections
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    mlp_bias: bool = False
    attention_sinks: bool = False  # per-head sink logits in the softmax denominator (gpt-oss)
    num_experts: int = 0  # > 0: a mixture-of-experts MLP (gpt-oss experts)
    num_experts_per_tok: int = 0  # experts each token is routed to (MoE only)
    swiglu_alpha: float = 1.702  # the experts' sigmoid gain
    swiglu_limit: float = 7.0  # the experts' clamp on gate (above) and up (both sides)
    dtype: torch.dtype = torch.float32
    family: str = "llama"  # informational: llama | mistral | gemma2 | gemma3 | qwen2 | qwen3 | gpt_oss

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_layers={self.num_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"unknown layer types {bad}; expected one of {LAYER_TYPES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if SLIDING_ATTENTION in self.layer_types and (
            self.sliding_window is None or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding layers need sliding_window >= 1, got {self.sliding_window}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected {ACTIVATIONS}")
        for name in ("rope_scaling", "local_rope_scaling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, RopeScaling):
                raise ValueError(f"ModelConfig.{name} must be a RopeScaling or None, got {value!r}")
        if self.local_rope_scaling is not None and self.local_rope_theta is None:
            raise ValueError("local_rope_scaling needs local_rope_theta (the sliding layers' base)")
        if self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts={self.num_experts}, got "
                f"{self.num_experts_per_tok}"
            )
        if self.num_experts and not self.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {self.swiglu_limit}")

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    def layer_rope(self, layer_idx: int) -> tuple[float, RopeScaling | None]:
        """RoPE base and scaling of layer ``layer_idx``."""
        if self.layer_types[layer_idx] == SLIDING_ATTENTION and self.local_rope_theta is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype = torch.float32) -> ModelConfig:
        """Build from a HuggingFace config (object or ``config.json`` dict).

        Supports the ``model_type`` values in :data:`SUPPORTED_MODEL_TYPES` (Llama,
        Mistral, Gemma 2, Gemma 3 text, Qwen2, Qwen3, gpt-oss) as transformers 5.24 defines them:
        a key missing from a dict takes that config class's default, RoPE comes from
        ``rope_parameters`` or the legacy ``rope_scaling``/``rope_theta`` keys, with
        transformers' precedence, and may be any of :data:`ROPE_TYPES`. Raises
        ValueError naming the key for other model types, unsupported features (other
        RoPE types, partial rotary, unknown RoPE keys, bidirectional Gemma 3) and values
        of the wrong type.
        """
        cfg = _HFConfigReader(hf_config)
        model_type = cfg.model_type
        num_layers = cfg.integer("num_hidden_layers")
        num_heads = cfg.integer("num_attention_heads")
        num_kv_heads = cfg.integer("num_key_value_heads", optional=True) or num_heads
        hidden_size = cfg.integer("hidden_size")
        head_dim = cfg.integer("head_dim", optional=True) or hidden_size // num_heads
        is_gemma = model_type in ("gemma2", "gemma3_text")
        is_gpt_oss = model_type == "gpt_oss"
        common: dict[str, Any] = dict(
            vocab_size=cfg.integer("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=cfg.integer("intermediate_size"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.number("rms_norm_eps"),
            tie_word_embeddings=cfg.flag("tie_word_embeddings"),
            # Bias flags each transformers class reads; the others hard-code theirs.
            attention_bias=model_type in ("llama", "gemma2", "gemma3_text", "qwen3", "gpt_oss")
            and cfg.flag("attention_bias"),
            qkv_bias=model_type == "qwen2",
            mlp_bias=model_type == "llama" and cfg.flag("mlp_bias"),
            # gpt-oss's experts hard-code their activation; transformers ignores hidden_act.
            hidden_act="silu" if is_gpt_oss
            else cfg.text("hidden_activation" if is_gemma else "hidden_act"),
            dtype=dtype,
            family=model_type.removesuffix("_text"),
        )
        common.update(_rope_from_hf(cfg))
        if model_type == "gemma3_text" and cfg.flag("use_bidirectional_attention", optional=True):
            raise ValueError("Gemma 3 with use_bidirectional_attention=True is not causal")

        if model_type == "llama":
            return cls(layer_types=(FULL_ATTENTION,) * num_layers, **common)
        sliding_window = cfg.integer("sliding_window", optional=True)
        if model_type == "mistral":  # one window on every layer, or none
            kind = FULL_ATTENTION if sliding_window is None else SLIDING_ATTENTION
            return cls(layer_types=(kind,) * num_layers, sliding_window=sliding_window, **common)
        if is_gpt_oss:
            # transformers: layer_types, by default sliding / full alternating from layer 0.
            layer_types = cfg.layer_types(num_layers)
            if layer_types is None:
                layer_types = tuple(SLIDING_ATTENTION if (i + 1) % 2 else FULL_ATTENTION
                                    for i in range(num_layers))
            if SLIDING_ATTENTION in layer_types and sliding_window is None:
                raise ValueError("gpt_oss layer_types has sliding layers but sliding_window is "
                                 "null; transformers cannot run this config")
            # `num_experts` is an alias of `num_local_experts` (the config's attribute_map).
            experts_key = ("num_experts" if cfg.is_dict and cfg.has("num_experts")
                           and not cfg.has("num_local_experts") else "num_local_experts")
            return cls(
                layer_types=layer_types,
                sliding_window=sliding_window if SLIDING_ATTENTION in layer_types else None,
                attention_sinks=True,
                num_experts=cfg.integer(experts_key),
                num_experts_per_tok=cfg.integer("num_experts_per_tok"),
                swiglu_alpha=cfg.number("swiglu_alpha"),
                swiglu_limit=cfg.number("swiglu_limit"),
                **common,
            )
        if model_type in ("qwen2", "qwen3"):
            # transformers: the window applies only with use_sliding_window, to the layers
            # from max_window_layers on, unless layer_types names the sliding layers.
            if not cfg.flag("use_sliding_window"):
                sliding_window = None
            layer_types = cfg.layer_types(num_layers)
            if layer_types is None:
                first = cfg.integer("max_window_layers")
                layer_types = tuple(
                    SLIDING_ATTENTION if sliding_window is not None and i >= first
                    else FULL_ATTENTION
                    for i in range(num_layers)
                )
            if SLIDING_ATTENTION in layer_types and sliding_window is None:
                raise ValueError(
                    "layer_types has sliding layers but the window is off (sliding_window="
                    f"{cfg.get('sliding_window')!r}, use_sliding_window="
                    f"{cfg.get('use_sliding_window')!r}); transformers cannot run this config"
                )
            return cls(
                layer_types=layer_types,
                sliding_window=sliding_window if SLIDING_ATTENTION in layer_types else None,
                qk_norm=model_type == "qwen3",
                **common,
            )

        # Gemma 2 / Gemma 3
        layer_types = cfg.layer_types(num_layers)
        if layer_types is None:  # every `pattern`-th layer is full
            pattern = 2
            if model_type == "gemma3_text":
                pattern = cfg.integer("sliding_window_pattern")
            layer_types = tuple(SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                                for i in range(num_layers))
        return cls(
            layer_types=layer_types,
            sliding_window=sliding_window,
            gemma_norm=True,
            sandwich_norm=True,
            qk_norm=model_type == "gemma3_text",
            scale_embeddings=True,
            query_pre_attn_scalar=cfg.number("query_pre_attn_scalar"),
            # HF's Gemma 3 attention never applies attn_logit_softcapping.
            attn_logit_softcap=(
                None if model_type == "gemma3_text"
                else cfg.number("attn_logit_softcapping", optional=True)
            ),
            final_logit_softcap=cfg.number("final_logit_softcapping", optional=True),
            **common,
        )


# transformers 5.24 class defaults of the keys from_hf reads (`None`: derived, as HF does:
# num_key_value_heads = num_attention_heads, head_dim = hidden_size // num_attention_heads).
_BASE_DEFAULTS: dict[str, Any] = dict(
    num_key_value_heads=None, head_dim=None, hidden_act="silu", rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_theta=10_000.0,
)
_QWEN_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
    num_attention_heads=32, max_position_embeddings=32768, use_sliding_window=False,
    sliding_window=4096, max_window_layers=28,
)
_GEMMA_DEFAULTS: dict[str, Any] = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
)
HF_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(_BASE_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=2048),
    "mistral": dict(_BASE_DEFAULTS, vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    max_position_embeddings=4096 * 32, sliding_window=4096),
    "gemma2": dict(_BASE_DEFAULTS, **_GEMMA_DEFAULTS, vocab_size=256000,
                   max_position_embeddings=8192, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(_BASE_DEFAULTS, **_GEMMA_DEFAULTS, vocab_size=262_208,
                        max_position_embeddings=131_072, attn_logit_softcapping=None,
                        final_logit_softcapping=None, rope_theta=1_000_000.0,
                        rope_local_base_freq=10_000.0, sliding_window_pattern=6,
                        use_bidirectional_attention=False),
    "qwen2": dict(_BASE_DEFAULTS, **_QWEN_DEFAULTS),
    "qwen3": dict(_BASE_DEFAULTS, **_QWEN_DEFAULTS, head_dim=128),
    "gpt_oss": dict(_BASE_DEFAULTS, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                    num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                    head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                    sliding_window=128, attention_bias=True, rope_theta=150000.0,
                    num_local_experts=128, num_experts_per_tok=4, swiglu_alpha=1.702,
                    swiglu_limit=7.0),
}
"""Per ``model_type``: the value :meth:`ModelConfig.from_hf` uses for a key a dict lacks."""


class _HFConfigReader:
    """Typed reads of a HF config object or ``config.json`` dict, with the class defaults."""

    def __init__(self, hf_config: Any) -> None:
        self.is_dict = isinstance(hf_config, Mapping)
        self._config = hf_config
        model_type = self.raw("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            hint = (" (for a multimodal gemma3 checkpoint, use its text model: its "
                    "text_config)" if model_type == "gemma3" else "")
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected one of "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}{hint}"
            )
        self.model_type: str = model_type
        self.defaults = HF_CONFIG_DEFAULTS[model_type]

    def raw(self, key: str) -> Any:
        """The value as given (None when absent), no default."""
        if self.is_dict:
            return self._config.get(key)
        return getattr(self._config, key, None)

    def has(self, key: str) -> bool:
        """Whether the config names ``key`` (a dict's key, an object's attribute)."""
        if self.is_dict:
            return key in self._config
        return hasattr(self._config, key)

    def get(self, key: str) -> Any:
        """The value, or the class default when the config lacks the key."""
        return self.raw(key) if self.has(key) else self.defaults.get(key)

    def _fail(self, key: str, expected: str, value: Any) -> ValueError:
        return ValueError(f"{self.model_type} config key {key!r} must be {expected}, "
                          f"got {value!r} ({type(value).__name__})")

    def integer(self, key: str, optional: bool = False) -> Any:
        """An integer (None allowed when ``optional``)."""
        value = self.get(key)
        if value is None and optional:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._fail(key, "an integer" + (" or null" if optional else ""), value)
        return value

    def number(self, key: str, optional: bool = False) -> Any:
        """A number as float (None allowed when ``optional``)."""
        value = self.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._fail(key, "a number" + (" or null" if optional else ""), value)
        return float(value)

    def flag(self, key: str, optional: bool = False) -> bool:
        """A bool (None read as False when ``optional``)."""
        value = self.get(key)
        if value is None and optional:
            return False
        if not isinstance(value, bool):
            raise self._fail(key, "true or false", value)
        return value

    def text(self, key: str) -> str:
        """A string."""
        value = self.get(key)
        if not isinstance(value, str):
            raise self._fail(key, "a string", value)
        return value

    def layer_types(self, num_layers: int) -> tuple[str, ...] | None:
        """``layer_types`` if given (checked), else None."""
        value = self.raw("layer_types")
        if value is None:
            return None
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not all(
            isinstance(t, str) for t in value
        ):
            raise self._fail("layer_types", "a list of strings", value)
        if len(value) != num_layers:
            raise ValueError(f"layer_types has {len(value)} entries but num_hidden_layers="
                             f"{num_layers}")
        bad = sorted({t for t in value if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"layer_types has unsupported entries {bad}; expected {LAYER_TYPES}")
        return tuple(value)


# Keys each RoPE type may carry, as transformers 5.24's validators list them.
_ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor",
                         "high_freq_factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
}
_ROPE_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})
# transformers 5.24's GptOssConfig RoPE when the config names none.
GPT_OSS_DEFAULT_ROPE: dict[str, Any] = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _rope_from_hf(cfg: _HFConfigReader) -> dict[str, Any]:
    """The RoPE fields of ModelConfig (``rope_theta``, ``rope_scaling`` and, for Gemma 3,
    the local ones) the way transformers 5.24 resolves them from the config."""
    params = cfg.raw("rope_parameters")
    # In a config.json, legacy `rope_scaling` wins over `rope_parameters` (transformers
    # 5.x moves it there); on a config object it is only an alias of rope_parameters.
    legacy = cfg.raw("rope_scaling") if cfg.is_dict else None
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, Mapping):
            raise cfg._fail(key, "a dict or null", value)
    max_pos = cfg.integer("max_position_embeddings")
    partial = cfg.number("partial_rotary_factor", optional=True)
    if cfg.model_type != "gemma3_text":
        where = "rope_scaling" if legacy else "rope_parameters"
        default = GPT_OSS_DEFAULT_ROPE if cfg.model_type == "gpt_oss" else {}
        theta, scaling = _parse_rope(
            dict(legacy or params or default), where, cfg.number("rope_theta"), max_pos,
            top_level_original=cfg.integer("original_max_position_embeddings", optional=True),
            partial=partial)
        return dict(rope_theta=theta, rope_scaling=scaling)
    # Gemma 3: rope_parameters nested by layer type; legacy rope_scaling updates the
    # global (full-attention) entry only, sliding layers take rope_local_base_freq.
    params = dict(params or {})
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"gemma3_text rope_parameters must be nested by layer type "
                         f"{LAYER_TYPES}; unexpected keys {unknown}")
    full = dict(params.get(FULL_ATTENTION) or {"rope_type": "default"})
    if legacy:
        full.update(legacy)
    local = dict(params.get(SLIDING_ATTENTION) or {"rope_type": "default"})
    theta, scaling = _parse_rope(
        full, f"rope_parameters[{FULL_ATTENTION!r}]", cfg.number("rope_theta"), max_pos,
        partial=partial, nested=True)
    local_theta, local_scaling = _parse_rope(
        local, f"rope_parameters[{SLIDING_ATTENTION!r}]", cfg.number("rope_local_base_freq"),
        max_pos, partial=partial, nested=True)
    return dict(rope_theta=theta, rope_scaling=scaling,
                local_rope_theta=local_theta, local_rope_scaling=local_scaling)


def _parse_rope(
    params: dict[str, Any],
    where: str,
    theta: float,
    max_pos: int,
    top_level_original: int | None = None,
    partial: float | None = None,
    nested: bool = False,
) -> tuple[float, RopeScaling | None]:
    """Base and scaling from one RoPE parameter dict (``where`` names it in errors)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r} in {where}; supported: "
                         f"{', '.join(ROPE_TYPES)}")
    unknown = sorted(set(params) - _ROPE_COMMON_KEYS - _ROPE_KEYS[rope_type])
    if unknown:
        raise ValueError(f"{where}: keys {unknown} are not used by RoPE type {rope_type!r} "
                         "(unsupported)")

    def number(key: str, default: Any = None) -> Any:
        value = params.get(key, default)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise ValueError(f"{where}[{key!r}] must be a number, got {value!r}")
        return value

    def required(key: str) -> Any:
        if params.get(key) is None:
            raise ValueError(f"{where}: RoPE type {rope_type!r} needs {key!r}")
        return number(key)

    partial = number("partial_rotary_factor", partial)
    if partial is not None and partial != 1.0:
        raise ValueError(f"partial rotary embeddings are not supported (partial_rotary_factor="
                         f"{partial} in {where})")
    theta = float(number("rope_theta", theta))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(required("factor")))
    # transformers: a top-level original_max_position_embeddings (Phi-3 style) wins over
    # the rope dict's, which defaults to max_position_embeddings.
    original = top_level_original or params.get("original_max_position_embeddings") or max_pos
    if isinstance(original, float) and original.is_integer():
        original = int(original)
    if not isinstance(original, int) or isinstance(original, bool):
        raise ValueError(f"{where}['original_max_position_embeddings'] must be an integer, "
                         f"got {original!r}")
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3", float(required("factor")), original,
            low_freq_factor=float(required("low_freq_factor")),
            high_freq_factor=float(required("high_freq_factor")),
        )
    if "factor" not in params:
        raise ValueError(f"{where}: RoPE type 'yarn' needs 'factor'")
    factor = float(number("factor") or max_pos / original)
    attention_factor = number("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = number("mscale"), number("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{where}['truncate'] must be true or false, got {truncate!r}")
    if nested and not truncate:
        # transformers 5.24 reads `truncate` from the outer rope_parameters dict, so a
        # per-layer-type value never takes effect there.
        raise ValueError(f"{where}['truncate'] = false is ignored by transformers for "
                         "per-layer-type RoPE; not supported")
    return theta, RopeScaling(
        "yarn", factor, original,
        beta_fast=float(number("beta_fast") or 32), beta_slow=float(number("beta_slow") or 1),
        truncate=truncate, attention_factor=float(attention_factor),
    )


# --------------------------------------------------------------------------- presets


def tiny_llama() -> ModelConfig:
    """A 4-layer full-attention Llama-style model (GQA 4:2, head_dim 16)."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16,
        layer_types=(FULL_ATTENTION,) * 4, rope_theta=10000.0, rms_norm_eps=1e-6,
        family="llama",
    )


def tiny_mistral() -> ModelConfig:
    """A 4-layer Mistral-style model, every layer sliding with window 16 (MQA 4:1)."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=1, head_dim=16,
        layer_types=(SLIDING_ATTENTION,) * 4, sliding_window=16,
        rope_theta=10000.0, rms_norm_eps=1e-5, family="mistral",
    )


def tiny_gemma2() -> ModelConfig:
    """A 4-layer Gemma-2-style model: sliding (window 12) / full alternating, softcaps."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16,
        layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2, sliding_window=12,
        rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
        gemma_norm=True, sandwich_norm=True, scale_embeddings=True,
        query_pre_attn_scalar=24.0, attn_logit_softcap=20.0, final_logit_softcap=15.0,
        tie_word_embeddings=True, family="gemma2",
    )


def tiny_gemma3() -> ModelConfig:
    """A 6-layer Gemma-3-style model: 5 sliding (window 8, base 1e4) : 1 full (base 1e6)."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=6,
        num_heads=2, num_kv_heads=1, head_dim=32,
        layer_types=(SLIDING_ATTENTION,) * 5 + (FULL_ATTENTION,), sliding_window=8,
        rope_theta=1_000_000.0, local_rope_theta=10_000.0, rms_norm_eps=1e-6,
        hidden_act="gelu_pytorch_tanh", gemma_norm=True, sandwich_norm=True, qk_norm=True,
        scale_embeddings=True, query_pre_attn_scalar=32.0, final_logit_softcap=15.0,
        tie_word_embeddings=True, family="gemma3",
    )


def tiny_qwen2() -> ModelConfig:
    """A 4-layer Qwen2-style model: q/k/v biases, GQA 4:2, layers 2-3 sliding (window 16),
    as transformers builds ``use_sliding_window=True, max_window_layers=2``."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16,
        layer_types=(FULL_ATTENTION,) * 2 + (SLIDING_ATTENTION,) * 2, sliding_window=16,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, qkv_bias=True, family="qwen2",
    )


def tiny_qwen3() -> ModelConfig:
    """A 4-layer Qwen3-style model: q/k RMSNorm per head, no biases, head_dim 32 wider than
    hidden / heads (GQA 4:2), tied embeddings, full attention."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=32,
        layer_types=(FULL_ATTENTION,) * 4, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        qk_norm=True, tie_word_embeddings=True, family="qwen3",
    )


def tiny_gpt_oss() -> ModelConfig:
    """A 4-layer gpt-oss-style model: sliding (window 16) / full alternating, attention sinks,
    8 experts with 2 per token (clamped SwiGLU, biases), q/k/v/o biases, GQA 4:1, untied
    embeddings, and YaRN RoPE as gpt-oss-20b sets it (factor 32, untruncated, base 150000)
    over an original context of 32 positions. The window is 16 instead of gpt-oss's 128
    so that the short demo prompts outgrow it."""
    return ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=64, num_layers=4,
        num_heads=4, num_kv_heads=1, head_dim=16,
        layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) * 2, sliding_window=16,
        rope_theta=150000.0, rms_norm_eps=1e-5,
        rope_scaling=RopeScaling("yarn", 32.0, 32, truncate=False,
                                 attention_factor=0.1 * math.log(32.0) + 1.0),
        attention_bias=True, attention_sinks=True, num_experts=8, num_experts_per_tok=2,
        family="gpt_oss",
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny_llama": tiny_llama,
    "tiny_mistral": tiny_mistral,
    "tiny_gemma2": tiny_gemma2,
    "tiny_gemma3": tiny_gemma3,
    "tiny_qwen2": tiny_qwen2,
    "tiny_qwen3": tiny_qwen3,
    "tiny_gpt_oss": tiny_gpt_oss,
}


# --------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """RMS normalisation over the last dim, Llama (``w``) or Gemma (``1 + w``) scaling."""

    def __init__(self, dim: int, eps: float, gemma: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        init = torch.zeros if gemma else torch.ones
        self.weight = nn.Parameter(init(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (computed in fp32, returned in ``x.dtype``)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Projections, q/k norm and RoPE around a caller-supplied attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        qkv_bias = c.attention_bias or c.qkv_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, qkv_bias, dtype=dt)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias, dtype=dt)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, qkv_bias, dtype=dt)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, dtype=dt)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.gemma_norm, dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.gemma_norm, dt)
        # One learned logit per query head in every softmax denominator (gpt-oss); the
        # AttentionFn applies it (DecoderModel.layer_sinks).
        self.sinks: nn.Parameter | None = None
        if c.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads, dtype=dt))

    def forward(
        self,
        layer_idx: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        """Attention sub-block output ``[T, hidden]`` for normed input ``x [T, hidden]``."""
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        out = attention(layer_idx, q, k, v)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype=dt)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, dtype=dt)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, dtype=dt)
        self.act = c.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output for ``x [T, hidden]``."""
        g = self.gate_proj(x)
        if self.act == "silu":
            g = F.silu(g)
        elif self.act == "gelu_pytorch_tanh":
            g = F.gelu(g, approximate="tanh")
        else:
            g = F.gelu(g)
        return self.down_proj(g * self.up_proj(x))


class TopKRouter(nn.Module):
    """gpt-oss router: a biased linear map to expert logits, the top ``k`` of them kept and
    softmaxed (in the logits' dtype) into routing weights."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.top_k = c.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(c.num_experts, c.hidden_size, dtype=c.dtype))
        self.bias = nn.Parameter(torch.zeros(c.num_experts, dtype=c.dtype))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights ``[T, k]`` and expert indices ``[T, k]`` for ``x [T, hidden]``."""
        logits = F.linear(x, self.weight, self.bias)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=1, dtype=top.dtype), indices


class Experts(nn.Module):
    """gpt-oss experts, stored as transformers stores them: ``gate_up_proj [E, hidden,
    2 * inter]`` (gate and up interleaved along the last dim), ``down_proj [E, inter,
    hidden]``, and their biases."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, dt = config, config.dtype
        e, h, i = c.num_experts, c.hidden_size, c.intermediate_size
        self.num_experts = e
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i, dtype=dt))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dt))
        self.down_proj = nn.Parameter(torch.zeros(e, i, h, dtype=dt))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h, dtype=dt))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)

    def swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of an interleaved gate/up projection ``[..., 2 * inter]``."""
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{indices[t, j]}(x[t])`` for ``x [T, hidden]``."""
        out = torch.zeros_like(x)
        # [E, k, T]: which tokens picked expert e as their j-th choice. Experts in
        # ascending order, as transformers adds them.
        mask = F.one_hot(indices, num_classes=self.num_experts).permute(2, 1, 0)
        hit = torch.nonzero(mask.sum(dim=(-1, -2)) > 0).flatten().tolist()
        for e in hit:
            slot, tok = torch.where(mask[e])
            h = x[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            y = self.swiglu(h) @ self.down_proj[e] + self.down_proj_bias[e]
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(x.dtype))
        return out


class MoEMLP(nn.Module):
    """gpt-oss mixture-of-experts MLP: the router's top-k experts, weighted."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = TopKRouter(config)
        self.experts = Experts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MLP output for ``x [T, hidden]``."""
        weights, indices = self.router(x)
        return self.experts(x, indices, weights)


class DecoderLayer(nn.Module):
    """Pre-norm residual block; with ``sandwich_norm`` each sub-block output is normed too."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.layer_idx = layer_idx
        self.attn = Attention(c)
        self.mlp: MLP | MoEMLP = MoEMLP(c) if c.num_experts else MLP(c)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
        self.attn_post_norm: RMSNorm | None = None
        self.mlp_post_norm: RMSNorm | None = None
        if c.sandwich_norm:
            self.attn_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
            self.mlp_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Hidden states after this layer, ``[T, hidden]``."""
        h = self.attn(self.layer_idx, self.attn_norm(x), cos, sin, attention)
        if self.attn_post_norm is not None:
            h = self.attn_post_norm(h)
        x = x + h
        h = self.mlp(self.mlp_norm(x))
        if self.mlp_post_norm is not None:
            h = self.mlp_post_norm(h)
        return x + h


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the half-split RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` by per-token ``cos``/``sin`` ``[T, D]``."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """Default-RoPE inverse frequencies ``[head_dim // 2]`` (fp32)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def rope_frequencies(
    theta: float, head_dim: int, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[head_dim // 2]`` (fp32) and the cos/sin multiplier of a RoPE.

    Computed as transformers 5.24's ``ROPE_INIT_FUNCTIONS`` do, operation for operation.
    """
    inv_freq = rope_inv_freq(theta, head_dim)
    if scaling is None:
        return inv_freq, 1.0
    factor, dim = scaling.factor, head_dim
    if scaling.rope_type == "linear":
        return inv_freq / factor, 1.0
    if scaling.rope_type == "llama3":
        assert scaling.original_max_position_embeddings is not None
        assert scaling.low_freq_factor is not None and scaling.high_freq_factor is not None
        old_context_len = scaling.original_max_position_embeddings
        low, high = scaling.low_freq_factor, scaling.high_freq_factor
        low_freq_wavelen = old_context_len / low
        high_freq_wavelen = old_context_len / high
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed, inv_freq_llama), 1.0
    # yarn
    assert scaling.original_max_position_embeddings is not None
    original = scaling.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low_dim, high_dim = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low_dim, high_dim = math.floor(low_dim), math.ceil(high_dim)
    low_dim, high_dim = max(low_dim, 0), min(high_dim, dim - 1)
    if low_dim == high_dim:
        high_dim += 0.001  # as transformers: no division by zero
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32) - low_dim) / (high_dim - low_dim), 0, 1
    )
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, scaling.attention_factor


# --------------------------------------------------------------------------- model


class DecoderModel(nn.Module):
    """Decoder-only LM over a flat ragged batch; attention is supplied by the caller.

    ``forward`` returns the final-normed hidden states; ``compute_logits`` maps
    (a subset of) them to vocabulary logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, dtype=c.dtype)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, c.dtype)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=c.dtype)
        if c.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # One RoPE table per distinct (base, scaling): global (full) and local (sliding) layers.
        layer_ropes = [c.layer_rope(i) for i in range(c.num_layers)]
        ropes = list(dict.fromkeys(layer_ropes))
        self._rope_scales: list[float] = []
        for j, (theta, scaling) in enumerate(ropes):
            inv_freq, attention_factor = rope_frequencies(theta, c.head_dim, scaling)
            self.register_buffer(f"inv_freq_{j}", inv_freq, persistent=False)
            self._rope_scales.append(attention_factor)
        self._layer_rope = [ropes.index(r) for r in layer_ropes]
        self.attn_scale: float = (
            c.query_pre_attn_scalar ** -0.5 if c.query_pre_attn_scalar is not None
            else c.head_dim ** -0.5
        )
        self.attn_softcap: float | None = c.attn_logit_softcap

    def layer_window(self, layer_idx: int) -> int | None:
        """Window ``W`` of layer ``layer_idx`` (query ``q`` sees ``q-W < k <= q``), None if full."""
        if not 0 <= layer_idx < self.config.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.config.num_layers})")
        if self.config.layer_types[layer_idx] == SLIDING_ATTENTION:
            return self.config.sliding_window
        return None

    def layer_chunk(self, layer_idx: int) -> int | None:
        """Chunk ``C`` of layer ``layer_idx`` (query ``q`` sees ``q // C * C <= k <= q``):
        None, these models have no chunked local layers."""
        self.layer_window(layer_idx)  # IndexError out of range
        return None

    def layer_latent(self, layer_idx: int) -> tuple[int, int] | None:
        """``(kv_lora_rank, rope_dim)`` of a multi-head latent attention layer: None, these
        models have none."""
        self.layer_window(layer_idx)  # IndexError out of range
        return None

    def layer_sinks(self, layer_idx: int) -> torch.Tensor | None:
        """Sink logits ``[num_heads]`` of layer ``layer_idx`` (one per query head, joining each
        softmax denominator unscaled), or None when the model has no attention sinks."""
        if not 0 <= layer_idx < self.config.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.config.num_layers})")
        layer = self.layers[layer_idx]
        assert isinstance(layer, DecoderLayer)
        return layer.attn.sinks

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, hidden]``, scaled by sqrt(hidden) in Gemma style."""
        x = self.embed_tokens(input_ids)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` for a flat ragged batch.

        ``input_ids`` and ``positions`` are ``[T]`` int64 (each token's position
        in its own sequence). The returned states are already final-normed; pass them (or the rows
        that need a next token) to :meth:`compute_logits`.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        x = self.embed(input_ids)
        pos = positions.to(x.device).float()[:, None]
        tables = []
        for j, scale in enumerate(self._rope_scales):
            freqs = pos * getattr(self, f"inv_freq_{j}")
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            if scale != 1.0:  # YaRN's attention factor, applied as transformers does
                cos, sin = cos * scale, sin * scale
            tables.append((cos.to(x.dtype), sin.to(x.dtype)))
        for i, layer in enumerate(self.layers):
            cos, sin = tables[self._layer_rope[i]]
            x = layer(x, cos, sin, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits ``[..., vocab]`` for final hidden states (with final softcap)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


# --------------------------------------------------------------------------- dense reference


def dense_causal_attention(
    model: DecoderModel,
    seq_lens: Sequence[int],
    window_fn: Callable[[int], int | None] | None = None,
    sinks_fn: Callable[[int], torch.Tensor | None] | None = None,
) -> AttentionFn:
    """Reference AttentionFn over a flat batch of whole sequences (no cache).

    Tokens are laid out sequence after sequence with lengths ``seq_lens``; each
    attends causally within its own sequence, limited to the layer's window
    (``window_fn(layer_idx)``, by default ``model.layer_window``). Computed in
    fp32 with the model's scale and softcap; with the layer's attention sinks
    (``sinks_fn(layer_idx)``, by default ``model.layer_sinks``: ``[num_heads]`` logits
    softmaxed with each row's scores, their probability dropped, as transformers'
    gpt-oss does); returns in q's dtype.
    """
    window_fn = model.layer_window if window_fn is None else window_fn
    sinks_fn = model.layer_sinks if sinks_fn is None else sinks_fn
    lens = torch.as_tensor(list(seq_lens), dtype=torch.int64)
    if (lens <= 0).any():
        raise ValueError(f"sequence lengths must be positive, got {list(seq_lens)}")
    total = int(lens.sum())
    seq_id = torch.repeat_interleave(torch.arange(len(lens)), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total) - starts[seq_id]
    same = seq_id[:, None] == seq_id[None, :]
    dist = pos[:, None] - pos[None, :]  # query pos - key pos
    base_mask = same & (dist >= 0)
    masks: dict[int | None, torch.Tensor] = {}
    scale, softcap = model.attn_scale, model.attn_softcap

    def attention(
        layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if q.shape[0] != total:
            raise ValueError(f"expected {total} tokens, got {q.shape[0]}")
        window = window_fn(layer_idx)
        if window not in masks:
            masks[window] = base_mask if window is None else base_mask & (dist < window)
        mask = masks[window].to(q.device)
        rep = q.shape[1] // k.shape[1]
        kf = k.float().repeat_interleave(rep, dim=1)
        vf = v.float().repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~mask, -math.inf)
        sinks = sinks_fn(layer_idx)
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().to(q.device).reshape(-1, 1, 1).expand(-1, total, 1)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)

    return attention


# --------------------------------------------------------------------------- loading


def hf_parameter_names(config: ModelConfig) -> dict[str, str]:
    """Map HF parameter name -> this model's parameter name (lm_head omitted when tied)."""
    names = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    # HF's "post_attention_layernorm" is the pre-MLP norm in Llama/Mistral but the
    # post-attention sandwich norm in Gemma 2/3 (which add pre_feedforward_layernorm).
    if config.sandwich_norm:
        norms = {
            "input_layernorm": "attn_norm",
            "post_attention_layernorm": "attn_post_norm",
            "pre_feedforward_layernorm": "mlp_norm",
            "post_feedforward_layernorm": "mlp_post_norm",
        }
    else:
        norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
    mlp = [] if config.num_experts else ["gate_proj", "up_proj", "down_proj"]
    moe = (["router.weight", "router.bias"]
           + [f"experts.{p}" for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj",
                                       "down_proj_bias")]) if config.num_experts else []
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for hf_norm, our_norm in norms.items():
            names[f"{hf}{hf_norm}.weight"] = f"{ours}{our_norm}.weight"
        for p in attn:
            names[f"{hf}self_attn.{p}.weight"] = f"{ours}attn.{p}.weight"
            if config.attention_bias or (config.qkv_bias and p != "o_proj"):
                names[f"{hf}self_attn.{p}.bias"] = f"{ours}attn.{p}.bias"
        if config.qk_norm:
            names[f"{hf}self_attn.q_norm.weight"] = f"{ours}attn.q_norm.weight"
            names[f"{hf}self_attn.k_norm.weight"] = f"{ours}attn.k_norm.weight"
        if config.attention_sinks:
            names[f"{hf}self_attn.sinks"] = f"{ours}attn.sinks"
        for p in moe:
            names[f"{hf}mlp.{p}"] = f"{ours}mlp.{p}"
        for p in mlp:
            names[f"{hf}mlp.{p}.weight"] = f"{ours}mlp.{p}.weight"
            if config.mlp_bias:
                names[f"{hf}mlp.{p}.bias"] = f"{ours}mlp.{p}.bias"
    return names


FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                   -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an FP4 (E2M1) code, by code."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An MXFP4-packed gpt-oss expert weight as the fp32 tensor transformers loads.

    ``blocks`` (uint8 ``[E, rows, G, 16]``) hold two FP4 codes per byte, the low nibble
    first, for ``G`` groups of 32 values per row; ``scales`` (uint8 ``[E, rows, G]``) are
    each group's power-of-two exponent biased by 127. Returns ``[E, G * 32, rows]``: the
    unpacked ``[E, rows, G * 32]`` matrix transposed, as transformers 5.24's
    ``convert_moe_packed_tensors`` returns it (``rows`` are the output features).
    """
    _check_mxfp4(blocks, scales)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    e, rows, groups, width = blocks.shape
    values = torch.empty(e, rows, groups, 2 * width, dtype=torch.float32, device=blocks.device)
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return values.reshape(e, rows, groups * 2 * width).transpose(1, 2).contiguous()


def _check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [E, rows, G, B] and scales [E, rows, G] do not match: "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")


@dataclasses.dataclass(frozen=True)
class _PackedMXFP4:
    """An MXFP4 weight of a checkpoint, dequantized only when copied into the model."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        e, rows, groups, width = self.blocks.shape
        return (e, groups * 2 * width, rows)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales).to(dtype)


def _collect_packed(sd: dict[str, Any]) -> None:
    """Replace every ``<name>_blocks`` / ``<name>_scales`` pair of ``sd`` by ``<name>``."""
    for key in [k for k in sd if k.endswith("_blocks")]:
        base = key.removesuffix("_blocks")
        if f"{base}_scales" in sd:
            packed = _PackedMXFP4(sd.pop(key), sd.pop(f"{base}_scales"))
            _check_mxfp4(packed.blocks, packed.scales)
            sd[base] = packed


def load_state_dict_from_hf(model: DecoderModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a HF ``*ForCausalLM`` state dict into ``model`` (cast to the model's dtype).

    ``lm_head.weight`` may be absent when embeddings are tied (if present it
    must equal the embeddings). gpt-oss expert weights may be MXFP4-packed, as the
    published checkpoints store them (``<name>_blocks`` and ``<name>_scales``, see
    :func:`dequantize_mxfp4`). Raises ValueError naming every missing,
    unexpected or mis-shaped key; the model is left unchanged in that case.
    """
    names = hf_parameter_names(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    sd: dict[str, Any] = dict(state_dict)
    _collect_packed(sd)
    problems: list[str] = []
    if model.config.tie_word_embeddings and "lm_head.weight" in sd:
        head = sd.pop("lm_head.weight")
        emb = sd.get("model.embed_tokens.weight")
        if emb is not None and (head.shape != emb.shape or not torch.equal(head, emb)):
            problems.append("lm_head.weight differs from model.embed_tokens.weight "
                            "but the config ties word embeddings")
    missing = sorted(set(names) - set(sd))
    unexpected = sorted(set(sd) - set(names))
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:
        problems.append(f"unexpected keys: {unexpected}")
    shapes = [
        f"{hf}: checkpoint {tuple(sd[hf].shape)} vs model {tuple(params[ours].shape)}"
        for hf, ours in names.items()
        if hf in sd and tuple(sd[hf].shape) != tuple(params[ours].shape)
    ]
    if shapes:
        problems.append(f"shape mismatches: {shapes}")
    if problems:
        raise ValueError("checkpoint does not match the model config: " + "; ".join(problems))
    with torch.no_grad():
        for hf, ours in names.items():
            params[ours].copy_(sd[hf].to(params[ours].dtype))


def load_checkpoint_dir(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> DecoderModel:
    """Build a DecoderModel from a local HF checkpoint dir (``config.json`` + ``*.safetensors``).

    Reads only local files. Needs ``transformers`` (for the config class
    defaults) and ``safetensors``.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    try:
        from safetensors.torch import load_file
        from transformers import AutoConfig
    except ImportError as e:  # pragma: no cover - optional dependencies
        raise ImportError("load_checkpoint_dir needs transformers and safetensors") from e
    with open(path / "config.json") as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r} in {path / 'config.json'}; "
                         f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)}")
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    quantization = getattr(hf_config, "quantization_config", None) or {}
    method = (quantization.get("quant_method") if isinstance(quantization, Mapping)
              else getattr(quantization, "quant_method", None))
    if method not in (None, "mxfp4"):
        raise ValueError(f"quantized checkpoint ({method!r}) in {path}: only MXFP4 gpt-oss "
                         "experts are dequantized on load")
    config = ModelConfig.from_hf(hf_config, dtype=dtype)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file), device="cpu"))
    model = DecoderModel(config)
    load_state_dict_from_hf(model, state_dict)
    return model.to(device).eval()
