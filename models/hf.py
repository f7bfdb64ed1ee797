"""Any transformers decoder through kvstore's paged cache.

transformers' own modules run unchanged; only attention is routed to kvstore. The
attention function registered under :data:`ATTENTION_NAME` (in transformers'
``AttentionInterface``, and absent from its mask registry, so no mask is ever built) takes
the step's :class:`~kvstore.engine.runner.PagedAttention` from its keyword arguments,
writes the layer's K/V into kvstore's pages and runs kvstore's paged attention with the
module's scaling, window or attention chunk, softcap and sinks. :class:`HFCausalLM` wraps an
``AutoModelForCausalLM`` for :class:`~kvstore.engine.engine.LLMEngine`: the packed batch is
one row of ``input_ids`` with per-token ``position_ids``.

transformers is imported only when a model is loaded or wrapped.
"""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from kvstore.engine.runner import PagedAttention
    from kvstore.models.recurrent import StateShape

__all__ = [
    "ATTENTION_NAME",
    "HFCausalLM",
    "HFModelConfig",
    "layer_chunks",
    "layer_windows",
    "load_hf_model",
    "paged_attention_forward",
    "register_attention",
]

ATTENTION_NAME = "kvstore_paged"
"""The ``attn_implementation`` under which kvstore's attention is registered."""

_BATCH_KWARG = "kvstore_attention"  # the keyword that carries a step's PagedAttention
_FULL, _SLIDING, _CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
_INDEXED = "indexed_attention"  # DeepSeek sparse attention: full attention over a top-k
# Tensor keywords of an attention call that kvstore applies (position_ids: the runner's own).
_APPLIED_TENSORS = ("position_ids", "s_aux", "sinks")


@dataclass(frozen=True)
class HFModelConfig:
    """What the engine and the cache need to know of a transformers model: its vocabulary,
    layers, K/V heads and head size, dtype, each layer's window (None: full attention;
    0: a recurrent layer of a hybrid, whose state is ``states[i]``, see
    :mod:`kvstore.models.recurrent`) and attention chunk (None: not chunked; empty: none
    is); for multi-head latent attention, ``latent`` ``(kv_lora_rank, rope_dim)`` (the
    cache then holds one latent per token as one K/V head of half its size) and, for
    DeepSeek sparse attention, ``index_dim`` (the indexer key's size: layer ``i``'s keys are
    cache layer ``num_layers + i``, pages shaped as the latents'). ``hf_config`` is
    transformers' config as JSON (part of the model's fingerprint)."""

    model_type: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    windows: tuple[int | None, ...]
    hf_config: str
    chunks: tuple[int | None, ...] = ()
    latent: tuple[int, int] | None = None
    states: tuple[StateShape | None, ...] = ()
    index_dim: int | None = None
    #: The most positions (prompt and output tokens) the model was made for, its
    #: ``max_position_embeddings`` (None: the config names none).
    max_positions: int | None = None

    def attention_layers(self) -> set[int]:
        """The layers that run attention (every layer but a hybrid's recurrent ones)."""
        return {i for i, w in enumerate(self.windows) if w != 0}


def _get(hf_config: Any, key: str, default: Any = None) -> Any:
    try:
        return getattr(hf_config, key, default)
    except RuntimeError as e:  # transformers refuses a global read of a per-layer setting
        raise ValueError(f"{getattr(hf_config, 'model_type', '?')}: {key} is set per layer "
                         f"(per_layer_config): kvstore serves one {key} for every layer") from e


def _positive_int(hf_config: Any, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{hf_config.model_type}: {key} must be a positive int, got {value!r}")
    return value


def layer_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's window from a transformers config: ``sliding_window`` for the layers
    that ``layer_types`` calls ``sliding_attention``, None for ``full_attention``; without
    ``layer_types``, every layer slides when ``sliding_window`` is set and the config's class
    declares it (as the models of Mistral's style build their mask); None for
    ``chunked_attention`` layers (see :func:`layer_chunks`). ValueError naming the key for
    what kvstore does not serve: any other layer type, bidirectional attention, an
    ``attention_chunk_size`` without ``layer_types`` naming the chunked layers."""
    model_type = _get(hf_config, "model_type", "?")
    num_layers = _positive_int(hf_config, "num_hidden_layers", _get(hf_config, "num_hidden_layers"))
    chunk = _get(hf_config, "attention_chunk_size")
    if chunk is not None and _CHUNKED not in (_get(hf_config, "layer_types") or ()):
        raise ValueError(f"{model_type}: attention_chunk_size {chunk!r} but no layer_types "
                         f"entry {_CHUNKED!r}: which layers are chunked is not known")
    for key in ("use_bidirectional_attention", "is_encoder_decoder"):
        if _get(hf_config, key):
            raise ValueError(f"{model_type}: {key} is set: only causal decoders are served")
    sliding = _get(hf_config, "sliding_window")
    layer_types = _get(hf_config, "layer_types")
    if layer_types is None:
        # A sliding_window the config class does not declare is a stray key its model ignores.
        if sliding is None or not hasattr(type(hf_config), "sliding_window"):
            return (None,) * num_layers
        return (_positive_int(hf_config, "sliding_window", sliding),) * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"{model_type}: layer_types has {len(layer_types)} entries for "
                         f"{num_layers} layers")
    windows: list[int | None] = []
    for i, kind in enumerate(layer_types):
        if kind == _FULL:
            windows.append(None)
        elif kind == _SLIDING:
            windows.append(_positive_int(hf_config, "sliding_window", sliding))
        elif kind == _CHUNKED or (kind == _INDEXED and model_type in _INDEXED_MODEL_TYPES):
            windows.append(None)
        else:
            raise ValueError(f"{model_type}: layer_types[{i}] is {kind!r}: kvstore serves "
                             f"{_FULL!r}, {_SLIDING!r} and {_CHUNKED!r} layers (and "
                             f"{_INDEXED!r} for {_INDEXED_MODEL_TYPES})")
    return tuple(windows)


def layer_chunks(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's attention chunk from a transformers config: ``attention_chunk_size``
    for the layers that ``layer_types`` calls ``chunked_attention`` (the query at ``q``
    attends keys ``q // C * C <= k <= q``, as transformers' chunked mask does), None for
    the others. ValueError naming the key for a chunked layer without a positive
    ``attention_chunk_size``."""
    num_layers = len(layer_windows(hf_config))
    layer_types = _get(hf_config, "layer_types")
    if layer_types is None:
        return (None,) * num_layers
    size = _get(hf_config, "attention_chunk_size")
    return tuple(_positive_int(hf_config, "attention_chunk_size", size) if kind == _CHUNKED
                 else None for kind in layer_types)


def hf_model_config(hf_config: Any, dtype: torch.dtype,
                    states: tuple[StateShape | None, ...] = ()) -> HFModelConfig:
    """The :class:`HFModelConfig` of a transformers config (ValueError naming the key for
    settings kvstore does not serve); a hybrid family's layers are those with a cache
    (see :func:`kvstore.models.recurrent.hybrid_layout`), ``states`` their states."""
    from kvstore.models.recurrent import hybrid_layout, is_hybrid

    if is_hybrid(hf_config):
        layout = hybrid_layout(hf_config)
        windows: tuple[int | None, ...] = tuple(0 if layout.is_recurrent(i) else None
                                                for i in range(layout.num_layers))
    else:
        windows = layer_windows(hf_config)
    num_heads = _positive_int(hf_config, "num_attention_heads", _get(hf_config, "num_attention_heads"))
    kv = _get(hf_config, "num_key_value_heads")
    num_kv_heads = num_heads if kv is None else _positive_int(hf_config, "num_key_value_heads", kv)
    head_dim = _get(hf_config, "head_dim")
    if head_dim is None:
        head_dim = _positive_int(hf_config, "hidden_size", _get(hf_config, "hidden_size")) // num_heads
    latent = _mla_latent(hf_config)
    if latent is not None:
        num_kv_heads, head_dim = 1, sum(latent) // 2
    return HFModelConfig(
        model_type=str(_get(hf_config, "model_type", "")),
        vocab_size=_positive_int(hf_config, "vocab_size", _get(hf_config, "vocab_size")),
        num_layers=len(windows), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=_positive_int(hf_config, "head_dim", head_dim), dtype=dtype, windows=windows,
        hf_config=hf_config.to_json_string(use_diff=False) if hasattr(hf_config, "to_json_string")
        else json.dumps(dict(hf_config), sort_keys=True, default=str),
        chunks=() if is_hybrid(hf_config) else layer_chunks(hf_config), latent=latent,
        states=states, index_dim=_index_dim(hf_config, latent),
        max_positions=None if _get(hf_config, "max_position_embeddings") is None else _positive_int(
            hf_config, "max_position_embeddings", _get(hf_config, "max_position_embeddings")))


_INDEXED_MODEL_TYPES = ("deepseek_v32",)


def _index_dim(hf_config: Any, latent: tuple[int, int] | None) -> int | None:
    """The indexer key's size (``index_head_dim``) of a DeepSeek sparse attention config,
    None for other models. ValueError naming the keys for a key that does not fit a latent
    page row or is shorter than its RoPE part."""
    model_type = _get(hf_config, "model_type", "?")
    if model_type not in _INDEXED_MODEL_TYPES or latent is None:
        return None
    dim = _positive_int(hf_config, "index_head_dim", _get(hf_config, "index_head_dim"))
    _positive_int(hf_config, "index_topk", _get(hf_config, "index_topk"))
    _positive_int(hf_config, "index_n_heads", _get(hf_config, "index_n_heads"))
    if not latent[1] <= dim <= sum(latent):
        raise ValueError(f"{model_type}: index_head_dim {dim} must lie between qk_rope_head_dim "
                         f"{latent[1]} and kv_lora_rank + qk_rope_head_dim {sum(latent)}: the "
                         "indexer key is RoPE'd and kept in a page shaped as the latents'")
    return dim


def _mla_latent(hf_config: Any) -> tuple[int, int] | None:
    """``(kv_lora_rank, qk_rope_head_dim)`` of a multi-head latent attention config, None
    without ``kv_lora_rank``. Latent attention is served in DeepSeek-V3's form: a config
    that chooses its RoPE by ``rope_interleave``, or DeepSeek-V3.2's (always interleaved).
    ValueError naming the key for another MLA config, or a latent that does not fill two
    equal page halves."""
    rank = _get(hf_config, "kv_lora_rank")
    if rank is None:
        return None
    model_type = _get(hf_config, "model_type", "?")
    if model_type not in _INDEXED_MODEL_TYPES and not hasattr(hf_config, "rope_interleave"):
        raise ValueError(f"{model_type}: kv_lora_rank is set without rope_interleave: "
                         "multi-head latent attention is served in DeepSeek-V3's form, whose "
                         "config chooses its RoPE by rope_interleave")
    rank = _positive_int(hf_config, "kv_lora_rank", rank)
    rope = _positive_int(hf_config, "qk_rope_head_dim", _get(hf_config, "qk_rope_head_dim"))
    if (rank + rope) % 2:
        raise ValueError(f"{model_type}: kv_lora_rank {rank} + qk_rope_head_dim {rope} is odd: "
                         "the latent does not fill the two halves of a page")
    return rank, rope


def _mla_forward(self: nn.Module, hidden_states: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor],
                 attention_mask: torch.Tensor | None, cache: Any = None, **kwargs: Any
                 ) -> tuple[torch.Tensor, None]:
    """A DeepSeek-V3 (or V3.2) attention module's forward over kvstore's pages: the module's
    own projections, norms and RoPE make the queries and the token's latent (normalized
    compressed K/V, then the RoPE'd shared key); the latent is written to the layer's pages
    and attention runs in the absorbed form over the cached latents
    (:meth:`~kvstore.engine.runner.PagedAttention.attend_latent`), then ``W_UV`` and the
    output projection. A V3.2 module's lightning indexer (its own projections, norm and
    half-split RoPE) makes the token's indexer key and the queries' indexer queries and
    weights, and each query attends only the top-k tokens they select
    (:meth:`~kvstore.engine.runner.PagedAttention.attend_indexed`). Under another
    ``attn_implementation`` (the model switched back to transformers' own attention) it is
    transformers' forward."""
    m: Any = self
    if m.config._attn_implementation != ATTENTION_NAME:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask,
                                  cache, **kwargs)
    paged = kwargs.get(_BATCH_KWARG)
    if paged is None:
        raise _MissingBatch(f"attn_implementation {ATTENTION_NAME!r} runs only inside kvstore's "
                            f"engine (no {_BATCH_KWARG!r} keyword argument)")
    if hidden_states.shape[0] != 1:
        raise ValueError(f"kvstore runs a packed batch as one row, got batch size "
                         f"{hidden_states.shape[0]}")
    t = hidden_states.shape[1]
    nope, rope, rank = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
    indexer = getattr(m, "indexer", None)
    q_resid = None if m.q_lora_rank is None else m.q_a_layernorm(m.q_a_proj(hidden_states))
    q = m.q_proj(hidden_states) if q_resid is None else m.q_b_proj(q_resid)
    q = q.view(1, t, -1, m.qk_head_dim).transpose(1, 2)
    q_pass, q_rot = torch.split(q, [nope, rope], dim=-1)
    kv_nope, k_rot = torch.split(m.kv_a_proj_with_mqa(hidden_states), [rank, rope], dim=-1)
    kv_nope = m.kv_a_layernorm(kv_nope)
    k_rot = k_rot.view(1, 1, t, rope)
    family = sys.modules[type(self).__module__]  # transformers' own RoPE for this module
    interleave = indexer is not None or m.config.rope_interleave  # V3.2: always interleaved
    rotate = family.apply_rotary_pos_emb_interleave if interleave else family.apply_rotary_pos_emb
    cos, sin = position_embeddings
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    w = m.kv_b_proj.weight.view(m.num_heads, nope + m.v_head_dim, rank)
    q_latent = torch.einsum("htn,hnr->thr", q_pass[0], w[:, :nope])
    latent = torch.cat([kv_nope[0], k_rot[0, 0]], dim=-1)
    if indexer is None:
        out = paged.attend_latent(m.layer_idx, latent, q_latent, q_rot[0].transpose(0, 1),
                                  scale=float(m.scaling))
    elif q_resid is None:
        raise ValueError(f"layer {m.layer_idx}: an indexer needs q_lora_rank")
    else:
        index_key, index_q, weights = _indexer_inputs(indexer, hidden_states, q_resid,
                                                      position_embeddings, family)
        out = paged.attend_indexed(m.layer_idx, latent, q_latent, q_rot[0].transpose(0, 1),
                                   scale=float(m.scaling), index_key=index_key,
                                   index_q=index_q, index_weights=weights,
                                   index_scale=float(indexer.softmax_scale),
                                   topk=int(indexer.index_topk))
    out = torch.einsum("thr,hvr->thv", out, w[:, nope:]).reshape(1, t, -1)
    return m.o_proj(out), None


def _indexer_inputs(ix: Any, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                    position_embeddings: tuple[torch.Tensor, torch.Tensor], family: Any
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A DeepSeek-V3.2 lightning indexer's key ``[T, D]``, queries ``[T, H, D]`` and fp32
    per-head weights ``[T, H]`` for the packed row ``hidden_states`` ``[1, T, hidden]``,
    made by the indexer's own modules as its forward makes them."""
    t, rope = hidden_states.shape[1], ix.qk_rope_head_dim
    q = ix.wq_b(q_resid).view(1, t, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [rope, ix.head_dim - rope], dim=-1)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, ix.head_dim - rope], dim=-1)
    cos, sin = position_embeddings
    q_rot, k_rot = family.apply_rotary_pos_emb(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)[0]
    k = torch.cat([k_rot, k_pass], dim=-1)[0, :, 0]
    weights = ix.weights_proj(hidden_states.to(ix.weights_proj.weight.dtype)).float()
    return k, q, weights[0] * ix.n_heads ** -0.5


def _serve_latent_attention(model: nn.Module) -> None:
    """Run every multi-head latent attention module's forward over kvstore's latent pages
    (:func:`_mla_forward`); the attention registry alone cannot, as it sees the
    decompressed K/V."""
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
            module.forward = types.MethodType(_mla_forward, module)


class _MissingBatch(RuntimeError):
    """The attention function was called without a step's batch."""


def paged_attention_forward(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over kvstore's paged cache.

    ``query`` is ``[1, heads, T, head_dim]`` (``key``/``value`` with the K/V heads) for the
    step's packed tokens; the step's :class:`~kvstore.engine.runner.PagedAttention` comes as
    the ``kvstore_attention`` keyword. Returns ``([1, T, heads, head_dim], None)``. The
    module's ``layer_idx`` and window are checked once per layer by the wrap-time probe
    (:func:`_check_call`), not at every step."""
    paged: PagedAttention | None = kwargs.get(_BATCH_KWARG)
    if paged is None:
        raise _MissingBatch(f"attn_implementation {ATTENTION_NAME!r} runs only inside kvstore's "
                           f"engine (no {_BATCH_KWARG!r} keyword argument)")
    if query.shape[0] != 1:
        raise ValueError(f"kvstore runs a packed batch as one row, got batch size {query.shape[0]}")
    # The module's own attributes, read from its __dict__: a name missing from an nn.Module
    # costs an AttributeError in nn.Module.__getattr__ on every call.
    attrs = module.__dict__
    if dropout and attrs["training"]:
        raise ValueError("dropout: kvstore's attention is for inference (call model.eval())")
    if isinstance(paged, _Probe):
        _check_call(module, kwargs, paged)
    layer = attrs["layer_idx"]
    if attention_mask is not None:
        raise ValueError(f"layer {layer}: attention_mask: {type(module).__name__} brings a mask "
                         "or bias of its own (no mask is built for kvstore's attention), which "
                         "the paged kernel does not apply")
    if kwargs.get("is_causal") is False:
        raise ValueError(f"layer {layer}: is_causal is False: only causal attention is served")
    for name, arg in kwargs.items():
        if isinstance(arg, torch.Tensor) and name not in _APPLIED_TENSORS:
            raise ValueError(f"layer {layer}: {name}: {type(module).__name__} passes a tensor "
                             "to the attention function that the paged kernel does not apply")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1)
    if attrs.get("attn_temperature_tuning", False) and not attrs.get("use_rope", True):
        q = _retune_temperature(module, q, paged.positions)
    out = paged.attend(layer, q, key[0].transpose(0, 1), value[0].transpose(0, 1),
                       scale=float(scaling), softcap=kwargs.get("softcap"),
                       sinks=kwargs.get("s_aux", kwargs.get("sinks")))
    return out.unsqueeze(0), None


def _check_call(module: nn.Module, kwargs: dict[str, Any], probe: _Probe) -> None:
    """ValueError unless an attention call's module has an int ``layer_idx`` and its
    ``sliding_window`` (the keyword, else the module's attribute) is the cache's window for
    the layer. Run by the wrap-time probe: these are fixed per module."""
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer, int):
        raise ValueError(f"{type(module).__name__} has no int layer_idx")
    if "sliding_window" in kwargs or hasattr(module, "sliding_window"):
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        if window != probe.window(layer):
            raise ValueError(f"layer {layer}: the module's sliding_window {window!r} is not the "
                             f"cache's window {probe.window(layer)!r}")


def _temperature(module: Any, positions: torch.Tensor) -> torch.Tensor:
    """Llama 4's query scale at each position (attention temperature tuning of its NoPE
    layers), ``[T, 1, 1]``."""
    floor_scale, attn_scale = float(module.floor_scale), float(module.attn_scale)
    floor = torch.floor((positions.float() + 1.0) / floor_scale)
    return (torch.log1p(floor) * attn_scale + 1.0).view(-1, 1, 1)


def _retune_temperature(module: nn.Module, q: torch.Tensor, positions: torch.Tensor
                        ) -> torch.Tensor:
    """``q`` ``[T, heads, head_dim]`` with Llama 4's temperature at the tokens' positions.

    transformers' Llama 4 scales a NoPE layer's queries by the temperature of the token's
    row index plus the cache's length, not of ``position_ids``; in kvstore's packed row (no
    transformers cache) the row index is not the position, so the scale of the row index
    is divided out and that of the position applied (exact up to one rounding)."""
    rows = torch.arange(q.shape[0], device=q.device)
    ratio = _temperature(module, positions.to(q.device)) / _temperature(module, rows)
    return (q * ratio).to(q.dtype)


def register_attention() -> str:
    """Register :func:`paged_attention_forward` with transformers' ``AttentionInterface``
    under :data:`ATTENTION_NAME` (not with the mask registry: no mask is built for it);
    returns the name. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME


def _check_modules(model: nn.Module, config: HFModelConfig) -> None:
    """ValueError, before anything runs, for attention modules kvstore cannot honor."""
    seen: set[int] = set()
    for name, module in model.named_modules():
        if not hasattr(module, "is_causal") or not isinstance(getattr(module, "layer_idx", None), int):
            continue
        layer = int(module.layer_idx)
        if not module.is_causal:
            raise ValueError(f"{name}: is_causal is False: only causal attention is served")
        if hasattr(module, "sliding_window") and isinstance(module.sliding_window, (int, type(None))):
            if module.sliding_window != config.windows[layer]:
                raise ValueError(f"{name}: sliding_window {module.sliding_window!r} differs from "
                                 f"the config's window {config.windows[layer]!r} for layer {layer}")
        seen.add(layer)
    if seen and seen != config.attention_layers():
        raise ValueError(f"attention modules cover layers {sorted(seen)}, the config has "
                         f"{config.num_layers} (num_hidden_layers)")


class _Probe:
    """Stands in for a step's PagedAttention in a one-token forward at wrap time: records
    what each layer's attention call brings, returns zeros."""

    def __init__(self, config: HFModelConfig) -> None:
        self.config = config
        self.calls: dict[int, tuple[int, int, int, int]] = {}
        self.repeated: set[int] = set()
        self.positions = torch.zeros(1, dtype=torch.long)

    def window(self, layer: int) -> int | None:
        return self.config.windows[layer] if 0 <= layer < self.config.num_layers else None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        if layer in self.calls:
            self.repeated.add(layer)
        self.calls[layer] = (int(k.shape[1]), int(k.shape[2]), int(v.shape[1]), int(v.shape[2]))
        return q.new_zeros(*q.shape[:2], v.shape[2])

    def attend_latent(self, layer: int, latent: torch.Tensor, q_latent: torch.Tensor,
                      q_rope: torch.Tensor, *, scale: float) -> torch.Tensor:
        half = latent.shape[-1] // 2
        if layer in self.calls:
            self.repeated.add(layer)
        self.calls[layer] = (1, half, 1, half)
        return torch.zeros_like(q_latent)

    def attend_indexed(self, layer: int, latent: torch.Tensor, q_latent: torch.Tensor,
                       q_rope: torch.Tensor, *, scale: float, index_key: torch.Tensor,
                       index_q: torch.Tensor, index_weights: torch.Tensor, index_scale: float,
                       topk: int) -> torch.Tensor:
        if index_key.shape[-1] != self.config.index_dim:
            raise ValueError(f"{self.config.model_type}: layer {layer}'s indexer key has "
                             f"{index_key.shape[-1]} elements, index_head_dim is "
                             f"{self.config.index_dim}")
        return self.attend_latent(layer, latent, q_latent, q_rope, scale=scale)


def _probe(model: nn.Module, config: HFModelConfig) -> None:
    """ValueError unless a one-token forward runs without transformers' mask and cache and
    calls the registered attention of every layer exactly once, with the keyword arguments
    passed through, no mask or bias of the model's own, and K/V shaped as the config says."""
    probe = _Probe(config)
    device = next(model.parameters()).device
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    try:
        with torch.inference_mode():
            model(input_ids=one, position_ids=one, use_cache=False, logits_to_keep=1,
                  **{_BATCH_KWARG: probe})
    except _MissingBatch as e:
        raise ValueError(f"{config.model_type}: its attention modules do not pass keyword "
                         f"arguments through to the attention function") from e
    except ValueError:
        raise
    except Exception as e:  # the model's own code needs what kvstore's attention lacks
        raise ValueError(f"{config.model_type}: its forward fails under attn_implementation "
                         f"{ATTENTION_NAME!r}, which builds no attention mask and no "
                         f"transformers cache ({type(e).__name__}: {e})") from e
    missing = sorted(config.attention_layers() - set(probe.calls))
    if missing:
        raise ValueError(f"{config.model_type}: layers {missing} do not call the attention "
                         f"function of attn_implementation (num_hidden_layers "
                         f"{config.num_layers})")
    if probe.repeated:
        raise ValueError(f"{config.model_type}: layers {sorted(probe.repeated)} call the "
                         "attention function more than once a forward: kvstore keeps one "
                         "K/V per layer and token")
    want = (config.num_kv_heads, config.head_dim, config.num_kv_heads, config.head_dim)
    for layer, got in sorted(probe.calls.items()):
        if got != want:
            raise ValueError(f"{config.model_type}: layer {layer} K/V heads x dims {got} differ "
                             f"from num_key_value_heads x head_dim {want}")


class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` whose attention runs on kvstore's paged cache, in the
    shape :class:`~kvstore.engine.engine.LLMEngine` runs.

    Wrapping switches the model's ``attn_implementation`` to :data:`ATTENTION_NAME`.
    ``forward(input_ids, positions, attention, logits_indices)`` runs a packed step (``[T]``
    token ids and positions, the step's ``PagedAttention``) and returns the logits of the
    rows in ``logits_indices`` (every row when None), computed by the model's own head
    (final softcap and logit scaling included)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        hf_config = getattr(model, "config", None)
        if hf_config is None:
            raise ValueError("model has no config: expected a transformers PreTrainedModel")
        dtype = next(model.parameters()).dtype
        from kvstore.models.recurrent import is_hybrid, wrap_hybrid

        states: tuple[StateShape | None, ...] = ()
        if is_hybrid(hf_config):
            hf_model_config(hf_config, dtype)  # refuse before changing the model
            states = wrap_hybrid(model)[1]
        self.config = hf_model_config(hf_config, dtype, states)
        _check_modules(model, self.config)
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
        if self.config.latent is not None:
            _serve_latent_attention(model)
        self.hf = model.eval()
        _probe(model, self.config)

    def layer_window(self, layer_idx: int) -> int | None:
        """Window ``W`` of layer ``layer_idx`` (query ``q`` sees ``q-W < k <= q``), None if full."""
        if not 0 <= layer_idx < self.config.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.config.num_layers})")
        return self.config.windows[layer_idx]

    def layer_chunk(self, layer_idx: int) -> int | None:
        """Chunk ``C`` of layer ``layer_idx`` (query ``q`` sees ``q // C * C <= k <= q``),
        None if not chunked."""
        self.layer_window(layer_idx)  # IndexError out of range
        return self.config.chunks[layer_idx] if self.config.chunks else None

    def layer_latent(self, layer_idx: int) -> tuple[int, int] | None:
        """``(kv_lora_rank, rope_dim)`` of a multi-head latent attention layer, None for any
        other."""
        self.layer_window(layer_idx)  # IndexError out of range
        return self.config.latent

    def layer_indexer(self, layer_idx: int) -> int | None:
        """The cache layer that holds the indexer keys of DeepSeek sparse attention layer
        ``layer_idx`` (``num_layers + layer_idx``), None for any other layer."""
        self.layer_window(layer_idx)  # IndexError out of range
        return None if self.config.index_dim is None else self.config.num_layers + layer_idx

    def layer_state(self, layer_idx: int) -> StateShape | None:
        """The recurrent state of layer ``layer_idx`` of a hybrid (None: attention)."""
        if not 0 <= layer_idx < self.config.num_layers:
            raise IndexError(f"layer {layer_idx} out of range [0, {self.config.num_layers})")
        return self.config.states[layer_idx] if self.config.states else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attention: PagedAttention, logits_indices: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (or ``[T, vocab]``) of a packed step."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must be 1-D of equal length, got "
                             f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        keep: int | torch.Tensor = 0 if logits_indices is None else logits_indices
        out = self.hf(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                      logits_to_keep=keep, **{_BATCH_KWARG: attention})
        return out.logits[0]


def load_hf_model(source: Any, dtype: torch.dtype = torch.float32,
                  device: torch.device | str = "cpu", seed: int | None = None) -> HFCausalLM:
    """An :class:`HFCausalLM` from a transformers config (random weights, seeded by
    ``seed`` when given), a local checkpoint directory (``config.json`` + safetensors), or
    a local GGUF file (read by transformers' GGUF loader, dequantized). Nothing is
    downloaded. ValueError naming the key for a config kvstore does not serve."""
    name = register_attention()
    try:
        model = _build_hf_model(source, name, dtype, seed)
    except KeyError as e:
        if e.args != (name,):
            raise
        raise ValueError(f"{_source_model_type(source)}: attn_implementation {name!r}: its "
                         "modeling code picks attention classes from a table of its own, "
                         "not from transformers' AttentionInterface") from e
    return HFCausalLM(model.to(device=device, dtype=dtype))


def _source_model_type(source: Any) -> str:
    model_type = getattr(source, "model_type", None)
    return str(model_type) if model_type else str(source)


def _build_hf_model(source: Any, name: str, dtype: torch.dtype, seed: int | None) -> Any:
    """transformers' ``*ForCausalLM`` of :func:`load_hf_model`'s ``source``, built with
    ``attn_implementation`` ``name``."""
    from transformers import AutoModelForCausalLM, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        hf_model_config(source, dtype)  # refuse before building anything
        if seed is not None:
            torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(source, attn_implementation=name, dtype=dtype)
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        kwargs: dict[str, Any] = dict(attn_implementation=name, dtype=dtype,
                                      local_files_only=True)
        if path.is_file() and path.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         **kwargs)
        elif path.is_dir() and (path / "config.json").is_file():
            from transformers import AutoConfig

            hf_model_config(AutoConfig.from_pretrained(str(path), local_files_only=True), dtype)
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        else:
            raise ValueError(f"{source}: expected a directory with config.json or a .gguf file")
    else:
        raise ValueError(f"source must be a transformers config or a path, got "
                         f"{type(source).__name__}")
    return model
