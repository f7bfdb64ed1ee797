"""Gated DeltaNet and Mamba2 hybrids on the transformers path: transformers' own mixers,
run one request at a time over kvstore's state pages.

A hybrid's decoder layers are full-attention layers (routed to kvstore's paged attention
like any transformers model, see :mod:`kvstore.models.hf`), recurrent layers (a mixer whose
``layer_type`` is ``"linear_attention"``: a short causal convolution and a matrix state)
and, in some families, layers without any cache (MLP or MoE only). :func:`wrap_hybrid`
replaces each mixer by a :class:`PagedStateMixer`, which splits the step's packed tokens by
request and calls the original module on each request's tokens with a transformers
``Cache`` whose conv and recurrent state tensors are views of that request's working
state page in :class:`~kvstore.paged_kv_cache.PagedKVCache`: the module reads the state
the request had before the step (none at position 0, or the checkpoint a hit copied in)
and writes the state after it in place. The shapes and dtypes of a layer's states are
those transformers' own cache gives them (read by running the mixer once at wrap time).

kvstore numbers only the layers that keep a cache (attention or state): a layer without
one has no kvstore layer id, and the modules' ``layer_idx`` are set to kvstore's ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvstore.specs import dtype_name

if TYPE_CHECKING:
    from kvstore.engine.runner import PagedAttention

__all__ = [
    "FAMILIES",
    "HybridLayout",
    "PagedStateMixer",
    "StateShape",
    "TINY_PRESETS",
    "hybrid_layout",
    "is_hybrid",
    "tiny_hybrid_config",
    "wrap_hybrid",
]

#: transformers ``model_type`` -> what its recurrent layers are (the families checked
#: against transformers; any config whose ``layer_types`` name ``linear_attention`` layers
#: is run as a hybrid, see :func:`is_hybrid`).
FAMILIES: dict[str, str] = {
    "qwen3_next": "Gated DeltaNet",
    "qwen3_5_text": "Gated DeltaNet",
    "qwen3_5_moe_text": "Gated DeltaNet",
    "olmo_hybrid": "Gated DeltaNet",
    "nemotron_h": "Mamba2",
    "granitemoehybrid": "Mamba2",
    "bamba": "Mamba2",
}

_FULL, _RECURRENT = "full_attention", "linear_attention"
_NO_CACHE = ("mlp", "moe")  # layer types with neither K/V nor state
_BATCH_KWARG = "kvstore_attention"  # the step's PagedAttention (as in models/hf.py)


@dataclass(frozen=True)
class StateShape:
    """The state tensors of one recurrent layer (no batch dimension) and their dtypes."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class HybridLayout:
    """Which transformers layers keep a cache and of what kind: ``hf_layers[i]`` is the
    transformers layer of kvstore layer ``i``, ``kinds[i]`` is ``"full_attention"`` or
    ``"linear_attention"``."""

    model_type: str
    hf_layers: tuple[int, ...]
    kinds: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        """kvstore layers (those with a cache)."""
        return len(self.hf_layers)

    def is_recurrent(self, layer: int) -> bool:
        """Whether kvstore layer ``layer`` keeps a recurrent state."""
        return self.kinds[layer] == _RECURRENT


def is_hybrid(hf_config: Any) -> bool:
    """Whether a transformers config has recurrent layers: a ``layer_types`` entry
    ``linear_attention`` (whether kvstore can drive them is checked by :func:`hybrid_layout`
    and :func:`wrap_hybrid`)."""
    layer_types = getattr(hf_config, "layer_types", None)
    return isinstance(layer_types, (list, tuple)) and _RECURRENT in layer_types


def hybrid_layout(hf_config: Any) -> HybridLayout:
    """The :class:`HybridLayout` of a hybrid's config. ValueError naming the key for what
    kvstore does not serve: a layer type other than full attention, ``linear_attention``
    (the family's recurrent mixer), ``mlp`` or ``moe``, a sliding window,
    multi-token-prediction layers."""
    model_type = getattr(hf_config, "model_type", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if not isinstance(layer_types, (list, tuple)) or not layer_types:
        raise ValueError(f"{model_type}: layer_types must list every layer's type, got "
                         f"{layer_types!r}")
    for key in ("sliding_window", "attention_chunk_size"):
        if getattr(hf_config, key, None) is not None:
            raise ValueError(f"{model_type}: {key} {getattr(hf_config, key)!r} is not served "
                             "in hybrid models")
    if getattr(hf_config, "num_nextn_predict_layers", 0) or getattr(hf_config, "mtp_num_layers", 0):
        raise ValueError(f"{model_type}: num_nextn_predict_layers: multi-token prediction "
                         "layers are not served")
    hf_layers: list[int] = []
    kinds: list[str] = []
    for i, kind in enumerate(layer_types):
        if kind in (_FULL, _RECURRENT):
            hf_layers.append(i)
            kinds.append(kind)
        elif kind not in _NO_CACHE:
            raise ValueError(f"{model_type}: layer_types[{i}] is {kind!r}: kvstore serves "
                             f"{_FULL!r}, {_RECURRENT!r} and cache-free {_NO_CACHE} layers")
    if _FULL not in kinds:
        raise ValueError(f"{model_type}: layer_types has no {_FULL!r} layer: kvstore's cache "
                         "needs at least one attention layer")
    return HybridLayout(str(model_type), tuple(hf_layers), tuple(kinds))


class PagedStateMixer(nn.Module):
    """A transformers recurrent mixer run request by request over kvstore's state pages.

    ``forward`` takes the decoder layer's call (``hidden_states`` ``[1, T, hidden]`` packed
    by request, and the step's :class:`~kvstore.engine.runner.PagedAttention` as the
    ``kvstore_attention`` keyword) and returns ``[1, T, hidden]``. Outside a step (no
    batch: the one-token probe made when a model is wrapped) the mixer runs without a
    cache, as on a single fresh sequence."""

    def __init__(self, mixer: nn.Module, layer: int) -> None:
        super().__init__()
        self.mixer = mixer
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor, cache: object = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """The mixer's output over every request of the step, in packed order."""
        paged: PagedAttention | None = kwargs.pop(_BATCH_KWARG, None)
        kwargs.pop("cache_params", None)
        batch = getattr(paged, "batch", None)
        if paged is None or batch is None:
            return self.mixer(hidden_states, cache=None, attention_mask=None, **kwargs)
        if hidden_states.shape[0] != 1:
            raise ValueError(f"kvstore runs a packed batch as one row, got batch size "
                             f"{hidden_states.shape[0]}")
        outs = []
        for (start, end), has_state, states in zip(
                batch.query_ranges, batch.has_state, paged.layer_states(self.layer), strict=True):
            state_cache = _state_cache(self.layer, states, has_state)
            outs.append(self.mixer(hidden_states[:, start:end], cache=state_cache,
                                   attention_mask=None, **kwargs))
        return torch.cat(outs, dim=1)


def _state_cache(layer: int, states: tuple[torch.Tensor, ...], has_state: bool) -> Any:
    """A transformers ``Cache`` whose layer ``layer`` holds ``states`` (conv, recurrent; views
    of a state page) as transformers' own linear-attention layer would after earlier tokens
    (``has_state``) or before any."""
    from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

    conv, recurrent = (s.unsqueeze(0) for s in states)
    state: Any = LinearAttentionLayer()
    state.conv_states[0] = conv
    state.recurrent_states[0] = recurrent
    state.is_conv_states_initialized[0] = state.is_recurrent_states_initialized[0] = True
    state.has_previous_state[0] = has_state
    state.conv_kernel_size[0] = conv.shape[-1]
    state.dtype, state.device = conv.dtype, conv.device
    layers: list[Any] = [DummyLayer()] * layer + [state]
    return Cache(layers=layers)


def _probe_states(mixer: nn.Module, layer: int, hidden_size: int) -> StateShape:
    """The conv and recurrent state of a mixer as transformers' own cache keeps them, read
    from a two-token forward with a fresh cache."""
    from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

    param = next(mixer.parameters())
    state = LinearAttentionLayer()
    layers: list[Any] = [DummyLayer()] * layer + [state]
    with torch.inference_mode():
        mixer(torch.zeros(1, 2, hidden_size, dtype=param.dtype, device=param.device),
              cache=Cache(layers=layers), attention_mask=None)
    tensors = [t for t in (state.conv_states[0], state.recurrent_states[0]) if t is not None]
    if len(tensors) != 2 or any(t.shape[0] != 1 for t in tensors):
        raise ValueError(f"layer {layer}: {type(mixer).__name__} does not keep one conv and one "
                         "recurrent state per sequence in transformers' cache")
    return StateShape(tuple(tuple(t.shape[1:]) for t in tensors),
                      tuple(dtype_name(t.dtype) for t in tensors))


def wrap_hybrid(model: nn.Module) -> tuple[HybridLayout, tuple[StateShape | None, ...]]:
    """Make a hybrid transformers model run on kvstore: number its cached layers as kvstore
    does (``layer_idx`` of its attention modules and mixers), replace each recurrent mixer
    by a :class:`PagedStateMixer`. Returns the layout and, per kvstore layer, its state
    (None for attention). ValueError when a recurrent layer has no mixer kvstore can drive
    or an attention layer no attention module."""
    hf_config: Any = model.config
    layout = hybrid_layout(hf_config)
    kv_of = {hf: kv for kv, hf in enumerate(layout.hf_layers)}
    hidden_size = int(hf_config.hidden_size)
    mixers: dict[int, tuple[nn.Module, str, Any]] = {}
    attention: set[int] = set()
    for parent in model.modules():
        for name, child in parent.named_children():
            idx = getattr(child, "layer_idx", None)
            if not isinstance(idx, int) or idx not in kv_of:
                continue
            kind = layout.kinds[kv_of[idx]]
            if kind == _RECURRENT and getattr(child, "layer_type", None) == _RECURRENT \
                    and hasattr(child, "conv1d"):
                mixers[idx] = (parent, name, child)
            elif kind == _FULL and hasattr(child, "is_causal"):
                attention.add(idx)
    states: list[StateShape | None] = []
    for kv, (hf, kind) in enumerate(zip(layout.hf_layers, layout.kinds, strict=True)):
        if kind == _FULL:
            if hf not in attention:
                raise ValueError(f"{layout.model_type}: layer {hf} is full_attention but has no "
                                 "attention module")
            states.append(None)
            continue
        if hf not in mixers:
            raise ValueError(f"{layout.model_type}: layer {hf} is linear_attention but has no "
                             "recurrent mixer kvstore can drive")
        parent, name, mixer = mixers[hf]
        mixer.layer_idx = kv
        states.append(_probe_states(mixer, kv, hidden_size))
        setattr(parent, name, PagedStateMixer(mixer, kv))
    module: Any
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if hasattr(module, "is_causal") and isinstance(idx, int) and idx in kv_of:
            module.layer_idx = kv_of[idx]
    return layout, tuple(states)


#: Tiny random configs of each family (kvstore generate's presets, the tests' models):
#: model_type -> transformers config keywords.
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, decoder_sparse_step=1,
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "qwen3_5_text": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=3,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention",
                     "full_attention"]),
    "nemotron_h": dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=1, ssm_state_size=8, conv_kernel=4, expand=2, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention",
                           "moe"]),
    "granitemoehybrid": dict(
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=4,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
        layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "bamba": dict(
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=8,
        num_hidden_layers=5, attn_layer_indices=[1, 4]),
}


def tiny_hybrid_config(model_type: str, **overrides: Any) -> Any:
    """A tiny transformers config of a hybrid family (:data:`TINY_PRESETS`; vocabulary 97,
    hidden size 32, no end-of-sequence token), with ``overrides`` applied. ValueError for a
    family kvstore does not run."""
    from transformers import AutoConfig

    if model_type not in TINY_PRESETS:
        raise ValueError(f"no tiny preset for {model_type!r} (presets: "
                         f"{', '.join(sorted(TINY_PRESETS))})")
    kwargs: dict[str, Any] = dict(vocab_size=97, hidden_size=32, intermediate_size=48,
                                  max_position_embeddings=256, eos_token_id=None)
    kwargs.update(TINY_PRESETS[model_type])
    kwargs.update(overrides)
    layer_types = kwargs.get("layer_types", kwargs.get("layers_block_type"))
    if layer_types is not None and "num_hidden_layers" not in overrides:
        kwargs["num_hidden_layers"] = len(layer_types)
    return AutoConfig.for_model(model_type, **kwargs)
