"""Device-agnostic attention entry point that model code calls."""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON
from .metadata import AttentionMetadata
from .mla import mla_attention_reference, mla_decode
from .reference import paged_attention_reference
from .triton_attention import paged_attention

__all__ = ["attention", "mla_attention"]

_BACKENDS = ("auto", "triton", "reference")


def attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    backend: str = "auto",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Paged attention on whatever device the tensors live on.

    ``backend="auto"`` runs the Triton kernel on CUDA and the PyTorch reference on other
    devices; ``"triton"`` forces the kernel (on CPU it needs ``TRITON_INTERPRET=1`` set
    before Triton is imported); ``"reference"`` forces the reference. Arguments and result
    are those of :func:`kvstore.kernels.paged_attention`; ``num_splits`` only affects the kernel.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.device.type == "cuda" and HAS_TRITON else "reference"
    if backend == "reference":
        return paged_attention_reference(q, key_cache, value_cache, metadata, scale,
                                         window=window, softcap=softcap, sinks=sinks,
                                         chunk=chunk)
    return paged_attention(q, key_cache, value_cache, metadata, scale, window=window,
                           softcap=softcap, sinks=sinks, chunk=chunk, num_splits=num_splits)


def mla_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Absorbed-form MLA over paged latents (see :mod:`kvstore.kernels.mla`) on whatever
    device the tensors live on: the Triton decode kernel for a batch of at most one query
    per sequence with ``backend`` ``"triton"`` (or ``"auto"`` on CUDA), the PyTorch
    reference otherwise (prefill, or ``"reference"``)."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q_latent.device.type == "cuda" and HAS_TRITON else "reference"
    if backend == "triton" and metadata.max_seqlen_q <= 1:
        return mla_decode(q_latent, q_rope, key_cache, value_cache, metadata, scale)
    return mla_attention_reference(q_latent, q_rope, key_cache, value_cache, metadata, scale)
