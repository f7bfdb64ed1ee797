"""Device-agnostic attention entry point that model code calls."""

from __future__ import annotations

import torch

from ._triton import HAS_TRITON
from .metadata import AttentionMetadata
from .reference import paged_attention_reference
from .triton_attention import paged_attention

__all__ = ["attention"]

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
