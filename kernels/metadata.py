"""The per-batch description every paged-attention call reads, and its validation.

A batch's :class:`AttentionMetadata` (block table, query boundaries, sequence lengths,
query bound) is built once and shared by every layer that reads the same block table;
per-layer values (scale, window, chunk, softcap, sinks) are arguments of the attention call. Every
check the reference and the kernel have in common lives here: per-batch checks run when
the metadata is built, per-call checks in :func:`check_attention_inputs`.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.request import as_count

__all__ = ["AttentionMetadata", "check_attention_inputs"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the queries and cached keys of each sequence of one batch are.

    ``block_table`` int32 ``[B, max_blocks]``: page ``p`` of sequence ``i`` is block
    ``block_table[i, p]``. ``cu_seqlens_q`` int32 ``[B+1]``: the queries of sequence ``i``
    are rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``q``. ``seq_lens`` int32 ``[B]``:
    tokens in cache for sequence ``i``, its new queries included (they are its last
    positions). ``max_seqlen_q``: an upper bound of every sequence's query count (sizes the
    kernel's grid without a device sync).

    Built on CPU tensors, the values are checked too (boundaries start at 0 and do not
    decrease, ``q_len <= seq_len``, ``q_len <= max_seqlen_q``); on other devices only shapes
    and dtypes are, since reading values would cost a device sync. Raises ``TypeError`` for
    a wrong dtype, ``ValueError`` for anything else.
    """

    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int

    def __post_init__(self) -> None:
        if isinstance(self.max_seqlen_q, bool):
            raise TypeError("max_seqlen_q must be an int, got a bool")
        object.__setattr__(self, "max_seqlen_q", operator.index(self.max_seqlen_q))
        if self.max_seqlen_q < 0:
            raise ValueError(f"max_seqlen_q must be >= 0, got {self.max_seqlen_q}")
        for name in ("block_table", "cu_seqlens_q", "seq_lens"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {t.dtype}")
        batch = self.seq_lens.shape[0] if self.seq_lens.dim() == 1 else -1
        if (self.seq_lens.dim() != 1 or self.cu_seqlens_q.shape != (batch + 1,)
                or self.block_table.dim() != 2):
            raise ValueError(
                f"expected seq_lens [B], cu_seqlens_q [B+1] and block_table [B, max_blocks], "
                f"got {tuple(self.seq_lens.shape)}, {tuple(self.cu_seqlens_q.shape)} and "
                f"{tuple(self.block_table.shape)}"
            )
        if self.block_table.shape[0] != batch:
            raise ValueError(f"block_table has {self.block_table.shape[0]} rows, expected {batch}")
        devices = {t.device for t in (self.block_table, self.cu_seqlens_q, self.seq_lens)}
        if len(devices) != 1:
            raise ValueError(
                f"block_table, cu_seqlens_q and seq_lens must be on one device, got "
                f"{sorted(map(str, devices))}"
            )
        if self.device.type == "cpu":
            self._check_values()

    def _check_values(self) -> None:
        cu = self.cu_seqlens_q.tolist()
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens_q must start at 0, got {cu}")
        for i, seq_len in enumerate(self.seq_lens.tolist()):
            q_len = cu[i + 1] - cu[i]
            if q_len < 0 or q_len > seq_len:
                raise ValueError(f"sequence {i}: q_len {q_len} must be in [0, seq_len={seq_len}]")
            if q_len > self.max_seqlen_q:
                raise ValueError(
                    f"sequence {i}: q_len {q_len} exceeds max_seqlen_q {self.max_seqlen_q}"
                )

    @property
    def batch_size(self) -> int:
        """Number of sequences ``B``."""
        return int(self.seq_lens.shape[0])

    @property
    def device(self) -> torch.device:
        """The device of the index tensors."""
        return self.seq_lens.device


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_span(value: Any, name: str) -> int | None:
    """``window``/``chunk``: None or a count >= 1 (see ``as_count``), as an int."""
    if value is None:
        return None
    n = as_count(value)
    if n is None or n < 1:
        raise ValueError(f"{name} must be None or an int >= 1, got {type(value).__name__} "
                         f"{value!r:.60}")
    return n


def _check_softcap(softcap: Any) -> float | None:
    """``softcap``: None or 0 (off), or a finite real > 0, as a float."""
    if softcap is None:
        return None
    if (isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real)
            or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be None, 0 (off) or a finite number > 0, got "
                         f"{type(softcap).__name__} {softcap!r:.60}")
    return float(softcap)


def _check_scale(scale: float) -> None:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale < math.inf:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")


def _check_sinks(sinks: torch.Tensor, num_heads: int, device: torch.device) -> None:
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be None or a tensor, got {type(sinks).__name__}")
    if sinks.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"sinks must be float32, float16 or bfloat16, got {sinks.dtype}")
    if sinks.shape != (num_heads,):
        raise ValueError(
            f"sinks must have shape [num_heads] = ({num_heads},), got {tuple(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks are on {sinks.device}, q on {device}")


def check_attention_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    scale: float | None = None,
) -> tuple[int | None, float | None, int | None]:
    """Raise ``ValueError`` unless ``q`` and one layer's caches fit ``metadata`` and
    ``window``/``softcap``/``sinks``/``chunk`` are valid: the checks shared by the reference and the
    kernel. ``q`` and the caches must share one dtype of float32/float16/bfloat16
    (``TypeError``), with ``block_size >= 1``; ``scale`` (when given) a finite number > 0;
    ``window`` and ``chunk`` None or an int >= 1 (a numpy integer counts, a bool or float does
    not); ``softcap`` None, 0 (off) or a finite number > 0; ``sinks`` None or a
    float32/float16/bfloat16 tensor ``[num_heads]`` on ``q``'s device (``TypeError`` for a
    non-tensor or another dtype, as for ``q`` and the caches). Returns ``(window, softcap,
    chunk)`` as Python int, float, int (or None).

    On CPU it also checks the values that depend on ``q`` and the pool: ``cu_seqlens_q``
    ends at ``q``'s row count, the table is wide enough for every ``seq_len`` and holds
    only ids inside the pool, and no sink is NaN or +inf (-inf is no sink)."""
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    if q.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(
            "expected q [T, H, D] and caches [num_blocks, block_size, num_kv_heads, D], got "
            f"q {tuple(q.shape)}, key_cache {tuple(key_cache.shape)}"
        )
    if key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache {tuple(key_cache.shape)} and value_cache "
            f"{tuple(value_cache.shape)} differ in shape"
        )
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise TypeError(f"q, key_cache and value_cache must share one dtype, got {q.dtype}, "
                        f"{key_cache.dtype}, {value_cache.dtype}")
    if scale is not None:
        _check_scale(scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    if block_size == 0:
        raise ValueError(f"caches must have block_size >= 1, got shape {tuple(key_cache.shape)}")
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    layer_args = _check_span(window, "window"), _check_softcap(softcap), _check_span(chunk, "chunk")
    if sinks is not None:
        _check_sinks(sinks, num_heads, q.device)
    if metadata.device.type != "cpu":
        return layer_args
    if sinks is not None and bool((torch.isnan(sinks) | (sinks == math.inf)).any()):
        raise ValueError("sinks must be finite or -inf (no sink), got NaN or +inf")
    table = metadata.block_table
    total_q = int(metadata.cu_seqlens_q[-1])
    if total_q != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q must run from 0 to total_q={q.shape[0]}, "
            f"got {metadata.cu_seqlens_q.tolist()}"
        )
    for i, seq_len in enumerate(metadata.seq_lens.tolist()):
        if _cdiv(seq_len, block_size) > table.shape[1]:
            raise ValueError(
                f"sequence {i}: seq_len {seq_len} needs {_cdiv(seq_len, block_size)} blocks, "
                f"block_table has {table.shape[1]} columns"
            )
    if table.numel() and (table.min() < 0 or table.max() >= num_blocks):
        raise ValueError(f"block_table holds ids outside [0, {num_blocks})")
    return layer_args
