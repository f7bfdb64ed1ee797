"""Paged-attention kernels (Triton) and their PyTorch references.

Public API: :func:`attention` (device-agnostic entry point), :func:`paged_attention`
(Triton kernel), :func:`paged_attention_reference`, all three taking a batch's
:class:`AttentionMetadata`; :func:`write_kv`, :func:`copy_blocks`.
"""

from .api import attention, mla_attention
from .cache_ops import copy_blocks, write_kv
from .metadata import AttentionMetadata
from .reference import paged_attention_reference
from .triton_attention import paged_attention

__all__ = [
    "AttentionMetadata",
    "attention",
    "copy_blocks",
    "mla_attention",
    "paged_attention",
    "paged_attention_reference",
    "write_kv",
]
