"""Cache write path (K/V into pages by slot mapping) and block copy for copy-on-write.

Both are bit-exact moves: no arithmetic touches the values. On CUDA tensors they run as
Triton kernels (no host synchronisation); on CPU tensors as vectorised torch ops unless
``backend="triton"`` asks for the (interpreted) kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.request import as_count

from ._triton import HAS_TRITON, cdiv, check_device, next_pow2, require_triton

__all__ = ["write_kv", "copy_blocks"]

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(
        key_ptr, value_ptr, kc_ptr, vc_ptr, slot_ptr,
        num_kv_heads,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_kcb, stride_kcs, stride_kch, stride_kcd,
        stride_vcb, stride_vcs, stride_vch, stride_vcd,
        HEAD_DIM: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot < 0:  # padding token
            return
        blk = slot // PAGE
        off = slot % PAGE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
        k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd,
                    mask=mask)
        v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd,
                    mask=mask)
        tl.store(kc_ptr + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch
                 + d[None, :] * stride_kcd, k, mask=mask)
        tl.store(vc_ptr + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch
                 + d[None, :] * stride_vcd, v, mask=mask)

    @triton.jit
    def _copy_blocks_kernel(
        ptrs_ptr, block_strides_ptr, src_ptr, dst_ptr, block_numel,
        ELEM_BYTES: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        pair = tl.program_id(0)
        tensor = tl.program_id(1)
        chunk = tl.program_id(2)
        addr = tl.load(ptrs_ptr + tensor)
        if ELEM_BYTES == 1:
            base = addr.to(tl.pointer_type(tl.int8))
        elif ELEM_BYTES == 2:
            base = addr.to(tl.pointer_type(tl.int16))
        elif ELEM_BYTES == 4:
            base = addr.to(tl.pointer_type(tl.int32))
        else:
            base = addr.to(tl.pointer_type(tl.int64))
        bstride = tl.load(block_strides_ptr + tensor)
        src = tl.load(src_ptr + pair)
        dst = tl.load(dst_ptr + pair)
        e = chunk.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        mask = e < block_numel
        x = tl.load(base + src * bstride + e, mask=mask)
        tl.store(base + dst * bstride + e, x, mask=mask)


def _pick_backend(backend: str, device: torch.device) -> str:
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    return backend


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Store token ``t``'s K/V (``[T, num_kv_heads, head_dim]``) into the pages at slot
    ``slot_mapping[t] = block * block_size + offset``; negative slots (padding) are skipped.

    Exact (a bitwise copy). Caches are ``[num_blocks, block_size, num_kv_heads, head_dim]``
    with any strides and must have the dtype of ``key``/``value``. Slots must be distinct:
    on CPU a repeated slot raises ``ValueError`` and one outside the pool ``IndexError``; on
    other devices they are not checked (that would cost a device sync).
    """
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must be [T, num_kv_heads, head_dim] and equal, got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache/value_cache must be equal [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"key {tuple(key.shape)} does not fit cache {tuple(key_cache.shape)}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype):
        raise TypeError(f"dtype mismatch: key {key.dtype}, value {value.dtype}, caches "
                        f"{key_cache.dtype}/{value_cache.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if block_size == 0:
        raise ValueError(f"caches must have block_size >= 1, got shape {tuple(key_cache.shape)}")
    if key.shape[0] == 0:
        return
    if slot_mapping.device.type == "cpu":  # free to check on the host
        if int(slot_mapping.max()) >= num_blocks * block_size:
            raise IndexError(f"slot {int(slot_mapping.max())} outside a pool of "
                             f"{num_blocks * block_size} slots")
        slots, counts = slot_mapping[slot_mapping >= 0].unique(return_counts=True)
        if counts.numel() and int(counts.max()) > 1:
            raise ValueError(f"slot_mapping repeats slot(s) {slots[counts > 1].tolist()}; "
                             "slots must be distinct")
    if _pick_backend(backend, key.device) == "torch":
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        blocks, offs = slots // block_size, slots % block_size
        key_cache[blocks, offs] = key[valid]
        value_cache[blocks, offs] = value[valid]
        return
    require_triton()
    check_device(_write_kv_kernel, key, value, key_cache, value_cache, slot_mapping)
    _write_kv_kernel[(key.shape[0],)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads,
        *key.stride(), *value.stride(), *key_cache.stride(), *value_cache.stride(),
        HEAD_DIM=head_dim,
        PAGE=block_size,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def _flatten_caches(caches: Sequence) -> list[torch.Tensor]:
    flat: list[torch.Tensor] = []
    for item in caches:
        if isinstance(item, torch.Tensor):
            flat.append(item)
        elif isinstance(item, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in item):
            flat.extend(item)
        else:
            raise TypeError("caches must be a list of tensors or of (key_cache, value_cache)")
    return flat


def _normalize_pairs(pairs: Sequence[tuple[int, int]] | torch.Tensor) -> list[tuple[int, int]]:
    if isinstance(pairs, torch.Tensor):
        if pairs.numel() and (pairs.dim() != 2 or pairs.shape[1] != 2):
            raise ValueError(f"pairs tensor must be [N, 2], got {tuple(pairs.shape)}")
        pairs = pairs.tolist()
    out = []
    for k, pair in enumerate(pairs):  # as PagedKVCache.copy_blocks checks them
        if isinstance(pair, torch.Tensor):
            pair = pair.tolist()
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"copy {k}: expected a (src, dst) pair of block ids, got "
                             f"{pair!r:.60}")
        src, dst = as_count(pair[0]), as_count(pair[1])
        if src is None or dst is None:
            raise TypeError(f"copy {k}: block ids must be ints, got {pair!r:.60}")
        out.append((src, dst))
    return out


def _block_dense(t: torch.Tensor) -> bool:
    """Whether each page ``t[b]`` fills one dense run of ``t[0].numel()`` elements (in any
    dimension order), so a page can be moved as a flat run."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape[1:], t.stride()[1:],
                                                            strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def copy_blocks(
    caches: Sequence[torch.Tensor] | Sequence[tuple[torch.Tensor, torch.Tensor]],
    pairs: Sequence[tuple[int, int]] | torch.Tensor,
    *,
    backend: str = "auto",
) -> None:
    """Copy page ``src`` onto page ``dst`` in every cache tensor, for each ``(src, dst)``.

    ``caches`` is a list of page tensors (dim 0 = block id) or of ``(key_cache,
    value_cache)`` pairs. Exact (bitwise). Raises TypeError for an id that is not an int
    (``as_count``), ValueError for a pair that is not a pair, when a destination repeats,
    when a destination is also a source in the same batch (the result would depend on the
    order), or when an id is outside the pool. On CUDA every tensor that shares dtype size
    and page size moves in one kernel launch.
    """
    tensors = _flatten_caches(caches)
    pair_list = _normalize_pairs(pairs)
    if not tensors or not pair_list:
        return
    srcs = [s for s, _ in pair_list]
    dsts = [d for _, d in pair_list]
    if len(set(dsts)) != len(dsts):
        dup = sorted({d for d in dsts if dsts.count(d) > 1})
        raise ValueError(f"copy_blocks: duplicate destination block(s) {dup}")
    hazard = sorted(set(dsts) & set(srcs))
    if hazard:
        raise ValueError(f"copy_blocks: block(s) {hazard} are both a source and a destination "
                         "in one batch (order-dependent result); split the batch")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all cache tensors must be on one device, got {devices}")
    for t in tensors:
        lo, hi = min(min(srcs), min(dsts)), max(max(srcs), max(dsts))
        if lo < 0 or hi >= t.shape[0]:
            raise ValueError(f"copy_blocks: block ids must be in [0, {t.shape[0]}), got "
                             f"{lo}..{hi}")
    (device,) = devices
    if _pick_backend(backend, device) == "torch":
        src_t = torch.tensor(srcs, dtype=torch.long, device=device)
        dst_t = torch.tensor(dsts, dtype=torch.long, device=device)
        for t in tensors:
            t.index_copy_(0, dst_t, t.index_select(0, src_t))
        return
    require_triton()
    check_device(_copy_blocks_kernel, *tensors)
    # One launch per (element size, page numel) group; strided pages fall back to torch.
    groups: dict[tuple[int, int], list[torch.Tensor]] = {}
    for t in tensors:
        if not _block_dense(t):
            idx_s = torch.tensor(srcs, dtype=torch.long, device=device)
            idx_d = torch.tensor(dsts, dtype=torch.long, device=device)
            t.index_copy_(0, idx_d, t.index_select(0, idx_s))
            continue
        groups.setdefault((t.element_size(), t[0].numel()), []).append(t)
    if not groups:
        return
    # Host-built tables, moved to the device in one transfer each.
    src_t = torch.tensor(srcs, dtype=torch.int64).to(device, non_blocking=True)
    dst_t = torch.tensor(dsts, dtype=torch.int64).to(device, non_blocking=True)
    for (elem, numel), ts in groups.items():
        ptrs = torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64).to(device)
        bstrides = torch.tensor([t.stride(0) for t in ts], dtype=torch.int64).to(device)
        chunk = min(4096, max(16, next_pow2(numel)))
        grid = (len(pair_list), len(ts), cdiv(numel, chunk))
        _copy_blocks_kernel[grid](ptrs, bstrides, src_t, dst_t, numel, ELEM_BYTES=elem,
                                  CHUNK=chunk, num_warps=4)
