"""Triton paged attention for full, sliding-window and chunked local layers: decode and
chunked prefill.

One kernel serves both: every program owns a *query tile* (up to ``BLOCK_M // GROUP``
consecutive query tokens of one sequence, times the ``GROUP`` query heads sharing one KV
head) and walks the key tiles of ``BLOCK_N`` positions that some query of its tile may see.
With a window the walk starts at the tile holding ``first_query - W + 1``, with a chunk
``C`` at the tile holding ``first_query // C * C``; keys before it are neither visited nor
loaded. Optional per-head attention sinks (gpt-oss) join each row's
softmax denominator once: at the end of the walk, or in the merge when the walk is split.
See ``docs/kernels.md`` for the layout, grid and formulas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import (
    HAS_TRITON,
    cdiv,
    check_device,
    is_interpreted,
    next_pow2,
    require_triton,
    sm_count,
)
from .metadata import AttentionMetadata, check_attention_inputs

__all__ = ["paged_attention", "choose_num_splits", "launch_config", "launch_plan", "LaunchPlan"]

LOG2E = 1.4426950408889634
MAX_SPLITS = 64
# A split should own at least this many key tiles, else the merge costs more than it saves.
MIN_TILES_PER_SPLIT = 4

if HAS_TRITON:
    import triton
    import triton.language as tl

    from ._triton import tanh_f32

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, tiles_ptr, sinks_ptr,
        block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        scale, softcap, window, chunk, num_splits,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_btb, stride_btp,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_CHUNK: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
        USE_SINKS: tl.constexpr,
        SPLIT: tl.constexpr,
        UPCAST: tl.constexpr,
        COUNT_TILES: tl.constexpr,
    ):
        # With split-KV the sink enters once, in the merge, never per split.
        tl.static_assert(not (USE_SINKS and SPLIT))
        TOK: tl.constexpr = BLOCK_M // GROUP  # query tokens per tile
        q_tile = tl.program_id(0)
        kvh = tl.program_id(1)
        pid2 = tl.program_id(2)
        seq = pid2 // num_splits
        split = pid2 % num_splits

        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        tok0 = q_tile * TOK
        if tok0 >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        ctx = seq_len - q_len  # absolute position of the sequence's first query

        rows = tl.arange(0, BLOCK_M)
        r_tok = rows // GROUP
        r_head = rows % GROUP
        row_valid = (r_tok < TOK) & (tok0 + r_tok < q_len)
        q_pos = ctx + tok0 + r_tok  # absolute position of each row's query
        head = kvh * GROUP + r_head
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM

        tok_idx = (q_start + tok0 + r_tok).to(tl.int64)
        q_off = tok_idx[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
        q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # Keys some query of this tile may see: [k_lo, k_hi).
        last_q = tl.minimum(ctx + tok0 + TOK, seq_len) - 1
        k_hi = last_q + 1
        k_lo = 0
        if USE_WINDOW:
            k_lo = tl.maximum(ctx + tok0 - window + 1, 0)
        if USE_CHUNK:
            k_lo = tl.maximum(k_lo, (ctx + tok0) // chunk * chunk)
        t_lo = k_lo // BLOCK_N
        t_hi = (k_hi + BLOCK_N - 1) // BLOCK_N
        if SPLIT:
            per = (t_hi - t_lo + num_splits - 1) // num_splits
            t_lo = t_lo + split * per
            t_hi = tl.minimum(t_lo + per, t_hi)

        if USE_SOFTCAP:
            qk_scale = scale
        else:
            qk_scale = scale * 1.4426950408889634  # fold log2(e): softmax in base 2

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_btb
        n_cols = tl.arange(0, BLOCK_N)
        k_head = k_ptr + kvh.to(tl.int64) * stride_kh
        v_head = v_ptr + kvh.to(tl.int64) * stride_vh

        for t in range(t_lo, t_hi):
            k_pos = t * BLOCK_N + n_cols
            kv_valid = (k_pos >= k_lo) & (k_pos < k_hi)
            blk = tl.load(bt_row + (k_pos // PAGE) * stride_btp, mask=kv_valid, other=0)
            slot = k_pos % PAGE
            k_base = blk.to(tl.int64) * stride_kb + slot.to(tl.int64) * stride_ks
            v_base = blk.to(tl.int64) * stride_vb + slot.to(tl.int64) * stride_vs
            kv_mask = kv_valid[None, :] & d_mask[:, None]
            # K loaded transposed: [BLOCK_D, BLOCK_N].
            k = tl.load(k_head + k_base[None, :] + d[:, None] * stride_kd, mask=kv_mask, other=0.0)
            v = tl.load(
                v_head + v_base[:, None] + d[None, :] * stride_vd,
                mask=kv_valid[:, None] & d_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * qk_scale
            if USE_SOFTCAP:
                s = softcap * tanh_f32(s / softcap) * 1.4426950408889634
            vis = kv_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                vis = vis & (k_pos[None, :] > q_pos[:, None] - window)
            if USE_CHUNK:
                vis = vis & (k_pos[None, :] >= q_pos[:, None] // chunk * chunk)
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if UPCAST:
                acc += tl.dot(p, v, input_precision="ieee")
            else:
                acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if COUNT_TILES:
            n_slot = ((seq * tl.num_programs(1) + kvh) * tl.num_programs(0) + q_tile)
            tl.store(tiles_ptr + n_slot * num_splits + split, t_hi - t_lo)

        if USE_SINKS:
            # The head's sink logit (base 2) joins the denominator: rescale to
            # max(m, sink) and add its term.
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_f)
            m_i = m_f
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        o_off = (
            split.to(tl.int64) * stride_os
            + tok_idx[:, None] * stride_ot
            + head[:, None] * stride_oh
            + d[None, :] * stride_od
        )
        tl.store(
            o_ptr + o_off,
            out.to(o_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )
        if SPLIT:
            # log2-sum-exp of this split's scores; -inf when it saw no key.
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            l_off = split.to(tl.int64) * stride_ls + tok_idx * stride_lt + head * stride_lh
            tl.store(lse_ptr + l_off, lse, mask=row_valid)

    @triton.jit
    def _merge_splits_kernel(
        o_part_ptr, lse_ptr, sinks_ptr, out_ptr, num_splits, num_heads,
        stride_ps, stride_pt, stride_ph, stride_pd,
        stride_ls, stride_lt, stride_lh,
        stride_ot, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        USE_SINKS: tl.constexpr,
    ):
        # One program per (query token, BLOCK_H heads): out = sum_s w_s o_s / sum_s w_s with
        # w_s = 2^(lse_s - M), M = max_s lse_s; a sink adds 2^(sink - M) to the denominator
        # once (M then also covers the sink).
        tok = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < num_heads
        d = tl.arange(0, BLOCK_D)
        hd_mask = h_mask[:, None] & (d[None, :] < HEAD_DIM)
        l_row = lse_ptr + tok * stride_lt + h * stride_lh
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        for s in range(num_splits):
            lse = tl.load(l_row + s * stride_ls, mask=h_mask, other=float("-inf"))
            m = tl.maximum(m, lse)
        if USE_SINKS:
            sink = tl.load(sinks_ptr + h, mask=h_mask, other=float("-inf")).to(tl.float32)
            sink = sink * 1.4426950408889634
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key: output 0
        den = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        o_row = o_part_ptr + tok * stride_pt + h[:, None] * stride_ph + d[None, :] * stride_pd
        for s in range(num_splits):
            lse = tl.load(l_row + s * stride_ls, mask=h_mask, other=float("-inf"))
            w = tl.exp2(lse - m)
            o = tl.load(o_row + s * stride_ps, mask=hd_mask, other=0.0)
            acc += o * w[:, None]
            den += w
        if USE_SINKS:
            den += tl.exp2(sink - m)
        den = tl.where(den == 0.0, 1.0, den)
        out = acc / den[:, None]
        tl.store(
            out_ptr + tok * stride_ot + h[:, None] * stride_oh + d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=hd_mask,
        )

def launch_config(
    group: int, head_dim: int, max_seqlen_q: int, block_m: int | None, block_n: int | None
) -> tuple[int, int, int, int]:
    """Tile sizes ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for one launch.

    ``BLOCK_M`` counts tile *rows* = query tokens x query heads of one KV head.
    """
    if block_m is None:
        if max_seqlen_q <= 1:
            block_m = max(16, next_pow2(group))
        else:
            cap = 128 if head_dim <= 128 else 64  # rows per tile for prefill
            block_m = max(16, min(cap, next_pow2(group * max_seqlen_q)), next_pow2(group))
    if block_n is None:
        block_n = 64 if head_dim <= 128 else 32
    # BLOCK_D = max(16, next_pow2(head_dim)) is >= 16 by construction (masked padding).
    if block_m < 16 or block_n < 16:
        raise ValueError(
            f"tl.dot needs tiles >= 16 in every dim, got BLOCK_M={block_m}, BLOCK_N={block_n}"
        )
    if block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_M={block_m} and BLOCK_N={block_n} must be powers of two")
    if block_m < group:
        raise ValueError(f"BLOCK_M={block_m} must hold all {group} query heads of a KV head")
    # 8 warps once the fp32 accumulator reaches 64 x 128 (keeps ptxas under 255 registers)
    num_warps = 8 if block_m * max(16, next_pow2(head_dim)) >= 64 * 128 else 4
    return block_m, block_n, num_warps, 2


def choose_num_splits(
    num_programs: int, max_tiles: int, device: torch.device, interpreted: bool = False
) -> int:
    """Split-KV factor: 1 when the grid already fills the GPU, else enough splits to give
    about four waves of programs, each split keeping at least ``MIN_TILES_PER_SPLIT`` tiles,
    rounded down to a power of two. Measured on an H200 (``kernel_bench --split-sweep``,
    batch 1 to 16, 4k to 128k keys): the best count was a power of two in every case (5
    splits took 1.25x as long as 4, 17 1.03x as long as 16), and four waves were best or
    within 13% of it, where two were up to 1.34x slower at 64k to 128k keys."""
    if interpreted or device.type != "cuda":
        return 1
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1
    want = min(cdiv(4 * sms, max(num_programs, 1)), max_tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    return 1 << (max(1, want).bit_length() - 1)


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is tiled and launched (see :func:`launch_plan`)."""

    block_m: int  # tile rows = query tokens per tile x query heads per KV head
    block_n: int  # key positions per tile
    num_warps: int
    num_stages: int
    q_tiles: int  # grid axis 0: query tiles per sequence (early exit past q_len)
    num_splits: int  # split-KV factor; grid axis 2 = batch * num_splits
    group: int  # query heads per KV head, packed into the tile rows

    @property
    def tokens_per_tile(self) -> int:
        """Query tokens per tile."""
        return self.block_m // self.group


def launch_plan(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    batch: int,
    max_seqlen_q: int,
    window: int | None,
    device: torch.device,
    *,
    chunk: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    interpreted: bool = False,
) -> LaunchPlan:
    """Tile sizes, grid and split-KV factor for one :func:`paged_attention` call.

    Decided on the host from shapes alone (no device sync): the longest key range a
    program may walk is bounded by ``max_blocks * block_size`` and, with a window or a
    chunk, by ``W + tokens_per_tile - 1`` (``C + tokens_per_tile - 1``).
    """
    group = num_heads // num_kv_heads
    max_seqlen_q = max(int(max_seqlen_q), 1)
    bm, bn, num_warps, num_stages = launch_config(group, head_dim, max_seqlen_q, block_m,
                                                  block_n)
    tok_per_tile = bm // group
    q_tiles = cdiv(max_seqlen_q, tok_per_tile)
    if num_splits is None:
        max_kv = max_blocks * block_size
        for span in (window, chunk):
            if span is not None:
                max_kv = min(max_kv, span + tok_per_tile - 1)
        max_tiles = cdiv(max_kv, bn) + 1
        num_splits = choose_num_splits(batch * num_kv_heads * q_tiles, max_tiles, device,
                                       interpreted)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    return LaunchPlan(bm, bn, num_warps, num_stages, q_tiles, num_splits, group)


def paged_attention(
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
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    tile_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention over a block table, for decode and prefill over a cached prefix.

    Same semantics as :func:`kvstore.kernels.paged_attention_reference`: the batch's
    layout is ``metadata`` (see :class:`kvstore.kernels.AttentionMetadata`); caches are
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` with any strides; ``q``, caches and
    ``out`` share one dtype of fp32/fp16/bf16. ``window`` None means full attention;
    ``chunk`` ``C`` limits the query at ``q`` to keys ``q // C * C <= k <= q``;
    ``softcap`` None or 0 disables the logit cap; ``sinks`` (None or ``[num_heads]``, any of
    the three float dtypes) adds one learned logit per query head to each row's softmax
    denominator (gpt-oss attention sinks). Returns ``out`` (allocated like ``q`` when None).

    Keyword-only tuning: ``num_splits`` forces the split-KV factor (None = heuristic);
    ``block_m``/``block_n`` override tile rows / keys per tile; ``tile_counts`` (int32, at
    least ``B * num_kv_heads * q_tiles * num_splits`` elements) receives the number of key
    tiles each program visited, for tests that prove the loop is window-bounded.
    """
    require_triton()
    window, softcap, chunk = check_attention_inputs(q, key_cache, value_cache, metadata, window,
                                                    softcap, sinks, chunk, scale)
    block_table = metadata.block_table
    check_device(_paged_attn_kernel, q, key_cache, value_cache, block_table,
                 metadata.cu_seqlens_q, metadata.seq_lens)
    cu_seqlens_q = metadata.cu_seqlens_q.contiguous()
    seq_lens = metadata.seq_lens.contiguous()
    total_q, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype}")
    if batch == 0 or total_q == 0:
        return out
    plan = launch_plan(num_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
                       batch, metadata.max_seqlen_q, window, q.device, chunk=chunk,
                       num_splits=num_splits,
                       block_m=block_m, block_n=block_n,
                       interpreted=is_interpreted(_paged_attn_kernel))
    bm, bn, num_warps, num_stages = plan.block_m, plan.block_n, plan.num_warps, plan.num_stages
    q_tiles, num_splits = plan.q_tiles, plan.num_splits
    interpreted = is_interpreted(_paged_attn_kernel)
    split = num_splits > 1
    if split:
        o_dst = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty((num_splits, total_q, num_heads), dtype=torch.float32,
                          device=q.device)
        o_strides = o_dst.stride()
        l_strides = lse.stride()
    else:
        o_dst, lse = out, out  # lse unused without splits
        o_strides = (0, *out.stride())
        l_strides = (0, 0, 0)
    count = tile_counts is not None
    use_sinks = sinks is not None
    # unused pointer arguments get a tensor that is never read
    sinks_arg = sinks.contiguous() if sinks is not None else seq_lens
    if tile_counts is not None:
        need = batch * num_kv_heads * q_tiles * num_splits
        if tile_counts.dtype != torch.int32 or tile_counts.numel() < need:
            raise ValueError(f"tile_counts must be int32 with >= {need} elements")

    grid = (q_tiles, num_kv_heads, batch * num_splits)
    _paged_attn_kernel[grid](
        q, key_cache, value_cache, o_dst, lse, tile_counts if count else seq_lens, sinks_arg,
        block_table, cu_seqlens_q, seq_lens,
        float(scale), float(softcap or 0.0), int(window or 0), int(chunk or 0), num_splits,
        *q.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *o_strides,
        *l_strides,
        *block_table.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        GROUP=group,
        BLOCK_M=bm,
        BLOCK_N=bn,
        PAGE=block_size,
        USE_WINDOW=window is not None,
        USE_CHUNK=chunk is not None,
        USE_SOFTCAP=bool(softcap),
        USE_SINKS=use_sinks and not split,  # split: the merge adds the sink
        SPLIT=split,
        UPCAST=interpreted or q.dtype == torch.float32,
        COUNT_TILES=count,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        merge_splits(o_dst, lse, out, head_dim, sinks)
    return out


def merge_splits(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, head_dim: int,
                 sinks: torch.Tensor | None = None) -> None:
    """Combine split-KV partial outputs ``o_part [splits, T, H, >= head_dim]`` (fp32) and
    their log2-sum-exp ``lse [splits, T, H]`` into ``out [T, H, >= head_dim]``'s first
    ``head_dim`` columns; ``sinks`` adds each head's sink to the softmax's denominator."""
    num_splits, total_q, num_heads = lse.shape
    block_h = min(16, next_pow2(num_heads))
    _merge_splits_kernel[(total_q, cdiv(num_heads, block_h))](
        o_part, lse, sinks.contiguous() if sinks is not None else lse, out, num_splits, num_heads,
        *o_part.stride(),
        *lse.stride(),
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_H=block_h,
        USE_SINKS=sinks is not None,
        num_warps=4,
    )
