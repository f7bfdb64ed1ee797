"""Small decoder-only models with per-layer full / sliding-window attention.

One decoder family covers Llama-, Mistral-, Gemma-2- and Gemma-3-style models.
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
``config.sliding_window`` to it unchanged, for Mistral, Gemma 2 and Gemma 3
alike. So ``W == config.sliding_window`` with no off-by-one for all three
(eager path, and the decode path through HF's sliding cache layers). The one
exception is Gemma 3 with ``use_bidirectional_attention=True``, where the config
rewrites ``sliding_window`` to ``w // 2 + 1``; that mode is not causal and is
rejected by :meth:`ModelConfig.from_hf`.
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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`DecoderModel`.

    ``layer_types[i]`` is ``"full_attention"`` or ``"sliding_attention"``;
    sliding layers use ``sliding_window`` (see the module docstring for the
    convention) and RoPE base ``local_rope_theta`` (``None``: same as
    ``rope_theta``). The style flags select the Llama or Gemma variants of each
    component.
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
    attention_bias: bool = False
    mlp_bias: bool = False
    dtype: torch.dtype = torch.float32
    family: str = "llama"  # informational: llama | mistral | gemma2 | gemma3

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

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the sliding-window layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == SLIDING_ATTENTION)

    @property
    def full_layers(self) -> tuple[int, ...]:
        """Indices of the full-attention layers."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype = torch.float32) -> ModelConfig:
        """Build from a HuggingFace config (object or ``config.json`` dict).

        Supports LlamaConfig, MistralConfig, Gemma2Config and Gemma3TextConfig as
        transformers 5.x defines them (defaults are only those classes' defaults
        when given a config object; a raw dict must spell out every field).
        Raises ValueError for other model types and unsupported features.
        """
        get = _getter(hf_config)
        model_type = get("model_type")
        if model_type not in ("llama", "mistral", "gemma2", "gemma3_text"):
            raise ValueError(
                f"unsupported model_type {model_type!r}; expected llama, mistral, gemma2 "
                "or gemma3_text (for a multimodal gemma3 checkpoint, use its text model)"
            )
        num_layers = int(get("num_hidden_layers"))
        num_heads = int(get("num_attention_heads"))
        num_kv_heads = int(get("num_key_value_heads") or num_heads)
        hidden_size = int(get("hidden_size"))
        head_dim = int(get("head_dim") or hidden_size // num_heads)
        sliding_window = get("sliding_window")
        common: dict[str, Any] = dict(
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(get("intermediate_size")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(get("rms_norm_eps")),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            attention_bias=bool(get("attention_bias", False)),
            mlp_bias=bool(get("mlp_bias", False)),
            dtype=dtype,
            family=model_type.removesuffix("_text"),
        )
        rope = get("rope_parameters")
        if model_type == "gemma3_text":
            if get("use_bidirectional_attention", False):
                raise ValueError("Gemma 3 with use_bidirectional_attention=True is not causal")
            rope = rope or {}
            global_theta = _rope_theta(rope.get(FULL_ATTENTION), get("rope_theta"), 1_000_000.0)
            local_theta = _rope_theta(
                rope.get(SLIDING_ATTENTION), get("rope_local_base_freq"), 10_000.0
            )
        else:
            global_theta = _rope_theta(rope, get("rope_theta"), 10_000.0)
            local_theta = None

        if model_type in ("llama", "mistral"):
            if model_type == "mistral" and sliding_window is not None:
                layer_types = (SLIDING_ATTENTION,) * num_layers
            else:
                layer_types = (FULL_ATTENTION,) * num_layers
                sliding_window = None
            return cls(
                layer_types=layer_types,
                sliding_window=None if sliding_window is None else int(sliding_window),
                rope_theta=global_theta,
                hidden_act=str(get("hidden_act", "silu")),
                **common,
            )

        # Gemma 2 / Gemma 3
        layer_types = get("layer_types")
        if layer_types is None:  # older configs: every `pattern`-th layer is full
            default_pattern = 6 if model_type == "gemma3_text" else 2
            pattern = int(get("sliding_window_pattern") or default_pattern)
            layer_types = [SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION
                           for i in range(num_layers)]
        softcap = get("attn_logit_softcapping")
        final_softcap = get("final_logit_softcapping")
        return cls(
            layer_types=tuple(layer_types),
            sliding_window=None if sliding_window is None else int(sliding_window),
            rope_theta=global_theta,
            local_rope_theta=local_theta,
            hidden_act=str(get("hidden_activation") or get("hidden_act", "gelu_pytorch_tanh")),
            gemma_norm=True,
            sandwich_norm=True,
            qk_norm=model_type == "gemma3_text",
            scale_embeddings=True,
            query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
            # HF's Gemma 3 attention never applies attn_logit_softcapping.
            attn_logit_softcap=(
                None if model_type == "gemma3_text" or softcap is None else float(softcap)
            ),
            final_logit_softcap=None if final_softcap is None else float(final_softcap),
            **common,
        )


def _getter(hf_config: Any) -> Callable[..., Any]:
    if isinstance(hf_config, Mapping):
        return lambda name, default=None: hf_config.get(name, default)
    return lambda name, default=None: getattr(hf_config, name, default)


def _rope_theta(params: Any, legacy_theta: Any, default: float) -> float:
    """RoPE base from a transformers 5 ``rope_parameters`` dict (or legacy field)."""
    if params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE type {rope_type!r} (only 'default' RoPE)")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial rotary embeddings are not supported")
        if params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    return float(legacy_theta) if legacy_theta is not None else default


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


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny_llama": tiny_llama,
    "tiny_mistral": tiny_mistral,
    "tiny_gemma2": tiny_gemma2,
    "tiny_gemma3": tiny_gemma3,
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
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, c.attention_bias, dtype=dt)
        self.k_proj = nn.Linear(
            c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype=dt
        )
        self.v_proj = nn.Linear(
            c.hidden_size, c.num_kv_heads * c.head_dim, c.attention_bias, dtype=dt
        )
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, c.attention_bias, dtype=dt)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.gemma_norm, dt)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.gemma_norm, dt)
        else:
            self.q_norm = self.k_norm = None

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
        if self.q_norm is not None:
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


class DecoderLayer(nn.Module):
    """Pre-norm residual block; with ``sandwich_norm`` each sub-block output is normed too."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        c, dt = config, config.dtype
        self.layer_idx = layer_idx
        self.attn = Attention(c)
        self.mlp = MLP(c)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
        if c.sandwich_norm:
            self.attn_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
            self.mlp_post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.gemma_norm, dt)
        else:
            self.attn_post_norm = self.mlp_post_norm = None

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
        # One RoPE table per distinct base: global (full) and local (sliding) layers.
        self._layer_theta = [
            c.local_rope_theta if t == SLIDING_ATTENTION and c.local_rope_theta is not None
            else c.rope_theta
            for t in c.layer_types
        ]
        self._thetas = sorted(set(self._layer_theta))
        for j, theta in enumerate(self._thetas):
            inv_freq = rope_inv_freq(theta, c.head_dim)
            self.register_buffer(f"inv_freq_{j}", inv_freq, persistent=False)
        self._layer_rope = [self._thetas.index(th) for th in self._layer_theta]
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
        for j in range(len(self._thetas)):
            freqs = pos * getattr(self, f"inv_freq_{j}")
            emb = torch.cat((freqs, freqs), dim=-1)
            tables.append((emb.cos().to(x.dtype), emb.sin().to(x.dtype)))
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
) -> AttentionFn:
    """Reference AttentionFn over a flat batch of whole sequences (no cache).

    Tokens are laid out sequence after sequence with lengths ``seq_lens``; each
    attends causally within its own sequence, limited to the layer's window
    (``window_fn(layer_idx)``, by default ``model.layer_window``). Computed in
    fp32 with the model's scale and softcap; returns in q's dtype.
    """
    window_fn = model.layer_window if window_fn is None else window_fn
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
        probs = torch.softmax(scores, dim=-1)
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
    mlp = ["gate_proj", "up_proj", "down_proj"]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for hf_norm, our_norm in norms.items():
            names[f"{hf}{hf_norm}.weight"] = f"{ours}{our_norm}.weight"
        for p in attn:
            names[f"{hf}self_attn.{p}.weight"] = f"{ours}attn.{p}.weight"
            if config.attention_bias:
                names[f"{hf}self_attn.{p}.bias"] = f"{ours}attn.{p}.bias"
        if config.qk_norm:
            names[f"{hf}self_attn.q_norm.weight"] = f"{ours}attn.q_norm.weight"
            names[f"{hf}self_attn.k_norm.weight"] = f"{ours}attn.k_norm.weight"
        for p in mlp:
            names[f"{hf}mlp.{p}.weight"] = f"{ours}mlp.{p}.weight"
            if config.mlp_bias:
                names[f"{hf}mlp.{p}.bias"] = f"{ours}mlp.{p}.bias"
    return names


def load_state_dict_from_hf(model: DecoderModel, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy a HF ``*ForCausalLM`` state dict into ``model`` (cast to the model's dtype).

    ``lm_head.weight`` may be absent when embeddings are tied (if present it
    must equal the embeddings). Raises ValueError naming every missing,
    unexpected or mis-shaped key; the model is left unchanged in that case.
    """
    names = hf_parameter_names(model.config)
    params = dict(model.named_parameters(remove_duplicate=False))
    sd = dict(state_dict)
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
    if model_type not in ("llama", "mistral", "gemma2", "gemma3_text"):
        raise ValueError(f"unsupported model_type {model_type!r} in {path / 'config.json'}")
    hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    config = ModelConfig.from_hf(hf_config, dtype=dtype)
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        state_dict.update(load_file(str(file), device="cpu"))
    model = DecoderModel(config)
    load_state_dict_from_hf(model, state_dict)
    return model.to(device).eval()
