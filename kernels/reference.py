"""PyTorch reference implementations: the semantics every kernel is tested against.

Everything here is written for clarity, not speed: a Python loop over sequences, math in
fp32. The reference reads only *legitimate* cache positions -- for sequence ``i`` the keys
``key_start(first_query) .. seq_len - 1`` -- so garbage (even NaN) anywhere else in
the pages, in the null block or in table entries for dropped pages cannot reach its output.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .metadata import AttentionMetadata, check_attention_inputs

__all__ = [
    "paged_attention_reference",
    "write_kv_reference",
    "copy_blocks_reference",
    "visible_key_range",
    "key_start",
]


def key_start(q: torch.Tensor, window: int | None, chunk: int | None) -> torch.Tensor:
    """The first key position the query at position ``q`` (elementwise) attends: ``q - W +
    1`` with a window ``W``, the start of its chunk ``q // C * C`` with a chunk ``C``, the
    larger of the two with both, never below 0. Every query attends keys ``key_start(q) <=
    k <= q``."""
    lo = torch.zeros_like(q)
    if window is not None:
        lo = torch.maximum(lo, q - window + 1)
    if chunk is not None:
        lo = torch.maximum(lo, q // chunk * chunk)
    return lo


def visible_key_range(seq_len: int, q_len: int, window: int | None, chunk: int | None = None
                      ) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of key positions some query of the sequence may see.

    The queries are the last ``q_len`` positions of a sequence of ``seq_len`` tokens; the
    query at ``q`` sees keys ``key_start(q) <= k <= q`` (see :func:`key_start`), a start
    that does not decrease with ``q``.
    """
    first_q = torch.tensor(seq_len - q_len)
    return int(key_start(first_q, window, chunk)), seq_len


def _softcap(s: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None or softcap == 0:
        return s
    return softcap * torch.tanh(s / softcap)


def _softmax_with_sink(s: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of ``s`` ``[H, nq, nk]`` over keys with head ``h``'s sink logit as one more
    column, that column dropped (gpt-oss)."""
    sink = sinks.float().reshape(-1, 1, 1).expand(-1, s.shape[1], 1)
    combined = torch.cat([s, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1)[..., :-1]


def paged_attention_reference(
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
) -> torch.Tensor:
    """Causal, optionally windowed or chunked and soft-capped paged attention with optional
    attention sinks, computed in fp32.

    ``q`` is ``[total_q, num_heads, head_dim]``; the queries of sequence ``i`` are the rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of ``metadata`` and sit at the last ``q_len_i``
    absolute positions of its ``seq_lens[i]`` cached tokens. ``key_cache``/``value_cache``
    are ``[num_blocks, block_size, num_kv_heads, head_dim]``; position ``p`` of sequence
    ``i`` lives in block ``block_table[i, p // block_size]`` at slot ``p % block_size``.
    Query head ``h`` uses KV head ``h // (num_heads // num_kv_heads)``. ``window`` None
    means full attention; ``chunk`` ``C`` (None: off) limits the query at ``q`` to keys of
    its own chunk, ``q // C * C <= k <= q`` (chunked local attention); ``softcap`` None or
    0 disables the logit cap. ``sinks`` (None or ``[num_heads]``) is one learned logit per
    query head that joins every row's softmax denominator as gpt-oss defines it: the row's
    scores (scaled, then soft-capped) and the head's sink are softmaxed together and the
    sink's probability is dropped, so the weights of the keys sum to less than 1. The sink
    is neither scaled nor capped. Returns a tensor shaped and typed like ``q``.
    """
    window, softcap, chunk = check_attention_inputs(q, key_cache, value_cache, metadata, window,
                                                    softcap, sinks, chunk, scale)
    block_table = metadata.block_table
    num_heads = q.shape[1]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    cu = metadata.cu_seqlens_q.tolist()
    lens = metadata.seq_lens.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for i, seq_len in enumerate(lens):
        q0, q1 = cu[i], cu[i + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        lo, hi = visible_key_range(seq_len, q_len, window, chunk)
        kpos = torch.arange(lo, hi, device=q.device)
        blocks = block_table[i, kpos // block_size].long()
        slots = kpos % block_size
        k = key_cache[blocks, slots].float()  # [nk, Hkv, D]
        v = value_cache[blocks, slots].float()
        k = k.repeat_interleave(group, dim=1)  # [nk, H, D]
        v = v.repeat_interleave(group, dim=1)
        qs = q[q0:q1].float()  # [nq, H, D]
        s = torch.einsum("qhd,khd->hqk", qs, k) * scale
        s = _softcap(s, softcap)
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] >= key_start(qpos, window,
                                                                              chunk)[:, None])
        s = torch.where(mask[None], s, torch.tensor(float("-inf"), device=q.device))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            p = _softmax_with_sink(s, sinks)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, v)
    return out.to(q.dtype)


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Token-by-token reference of :func:`kvstore.kernels.write_kv` (negative slots are skipped)."""
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[t]
        value_cache[slot // block_size, slot % block_size] = value[t]


def copy_blocks_reference(
    caches: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]]
) -> None:
    """Pair-by-pair reference of :func:`kvstore.kernels.copy_blocks` on a flat list of tensors."""
    for t in caches:
        for src, dst in pairs:
            t[dst] = t[src].clone()
