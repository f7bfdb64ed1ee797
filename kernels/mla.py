"""Multi-head latent attention (DeepSeek-V2/V3) over paged latents: the page layout, the
PyTorch references (absorbed form, and decompressing the cached latents) and a Triton
decode kernel.

Every cached token holds one latent ``[kv_lora_rank + rope_dim]`` (the normalized
compressed K/V, then the RoPE'd shared key part), stored in one layer slot's K and V
pages as a single head of half its size: elements ``[0, L/2)`` in the K page, ``[L/2, L)``
in the V page (``kvstore.MLASpec``). With ``W_UK [H, nope, r]`` and ``W_UV [H, v, r]`` the
per-head up-projections of the latent ``c``, head ``h``'s score with a key is
``scale * (q_nope·W_UK c + q_rope·k_rope) = scale * ((W_UK^T q_nope)·c + q_rope·k_rope)``
and its output ``W_UV (sum_k p_k c_k)``: in the *absorbed* form the query is projected into
the latent space once (``q_latent = W_UK^T q_nope``), attention runs over the latents as
one K/V head shared by every query head, and the caller applies ``W_UV`` to the result.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ._triton import HAS_TRITON, check_device, is_interpreted, next_pow2, require_triton
from .metadata import AttentionMetadata, check_attention_inputs
from .triton_attention import choose_num_splits, merge_splits

__all__ = ["indexer_topk", "mla_attention_reference", "mla_decode",
           "mla_decompressed_reference", "page_latents", "split_latent"]


def split_latent(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-page and V-page halves ``[T, 1, L/2]`` of latents ``[T, L]``, as
    :func:`kvstore.kernels.write_kv` takes them."""
    half = latent.shape[-1] // 2
    if latent.dim() != 2 or 2 * half != latent.shape[-1]:
        raise ValueError(f"latents must be [T, L] with L even, got {tuple(latent.shape)}")
    return latent[:, None, :half], latent[:, None, half:]


def page_latents(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
                 slots: torch.Tensor) -> torch.Tensor:
    """The latents ``[n, L]`` at these (block, slot) pairs of one layer's pages."""
    return torch.cat([key_cache[blocks, slots, 0], value_cache[blocks, slots, 0]], dim=-1)


def _sequences(key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: AttentionMetadata
               ) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Per sequence of the batch with queries: its query rows ``[q0, q1)``, its pages' rows
    ``[seq_len, L]`` in fp32 (one per position, as :func:`page_latents` reads them) and the
    causal mask ``[q1 - q0, seq_len]`` of the positions each query does not see."""
    block_size = key_cache.shape[1]
    cu = metadata.cu_seqlens_q.tolist()
    for i, seq_len in enumerate(metadata.seq_lens.tolist()):
        q0, q1 = cu[i], cu[i + 1]
        if q1 == q0:
            continue
        kpos = torch.arange(seq_len, device=key_cache.device)
        rows = page_latents(key_cache, value_cache, metadata.block_table[i, kpos // block_size].long(),
                            kpos % block_size).float()
        qpos = torch.arange(seq_len - (q1 - q0), seq_len, device=key_cache.device)
        yield q0, q1, rows, kpos[None, :] > qpos[:, None]


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float) -> None:
    """ValueError unless the queries and pages fit each other and ``metadata``."""
    if q_latent.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2] or q_rope.dim() != 3:
        raise ValueError(f"expected q_latent [T, H, r] and q_rope [T, H, rope], got "
                         f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    if key_cache.dim() != 4 or key_cache.shape[2] != 1:
        raise ValueError(f"latent pages must be [num_blocks, block_size, 1, L/2], got "
                         f"{tuple(key_cache.shape)}")
    latent = 2 * key_cache.shape[3]
    if q_latent.shape[2] + q_rope.shape[2] != latent:
        raise ValueError(f"q_latent and q_rope have {q_latent.shape[2]} + {q_rope.shape[2]} "
                         f"elements, the pages hold latents of {latent}")
    # The shared checks (table, boundaries, page shapes) with the latent as one KV head.
    check_attention_inputs(q_latent[..., :1].expand(-1, -1, key_cache.shape[3]), key_cache,
                           value_cache, metadata, None, None, scale=scale)


def mla_attention_reference(q_latent: torch.Tensor, q_rope: torch.Tensor,
                            key_cache: torch.Tensor, value_cache: torch.Tensor,
                            metadata: AttentionMetadata, scale: float,
                            selected: torch.Tensor | None = None) -> torch.Tensor:
    """Causal MLA in the absorbed form over paged latents, in fp32: ``q_latent [T, H, r]``
    (queries projected into the latent space) and ``q_rope [T, H, rope]`` score against each
    visible token's latent ``c`` and RoPE key, and the output ``[T, H, r]`` is the softmax
    weighted sum of the ``c`` (the caller applies ``W_UV``). The batch layout is that of
    :func:`kvstore.kernels.paged_attention_reference`; decode and prefill over a cached
    prefix alike. With ``selected`` (int ``[T, k]``, token positions, ``-1`` for none, as
    :func:`indexer_topk` returns) each query attends only the visible tokens it lists
    (DeepSeek sparse attention). Returns a tensor typed like ``q_latent``."""
    _check(q_latent, q_rope, key_cache, value_cache, metadata, scale)
    if selected is not None and (selected.dim() != 2 or selected.shape[0] != q_latent.shape[0]):
        raise ValueError(f"selected must be [T, k] for {q_latent.shape[0]} queries, got "
                         f"{tuple(selected.shape)}")
    r = q_latent.shape[2]
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    for q0, q1, lat, hidden in _sequences(key_cache, value_cache, metadata):
        c, k_rope = lat[:, :r], lat[:, r:]
        s = (torch.einsum("qhr,kr->hqk", q_latent[q0:q1].float(), c)
             + torch.einsum("qhd,kd->hqk", q_rope[q0:q1].float(), k_rope)) * scale
        if selected is not None:
            hidden = hidden | ~_listed(selected[q0:q1], lat.shape[0])
        s = s.masked_fill(hidden[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,kr->qhr", torch.softmax(s, dim=-1), c)
    return out.to(q_latent.dtype)


def _listed(selected: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[n, seq_len]``: whether each query's row of ``selected`` lists each position."""
    index = torch.where(selected < 0, seq_len, selected).long()
    if bool((index > seq_len).any()):
        raise ValueError(f"selected lists positions past the sequence's {seq_len} tokens")
    listed = torch.zeros(selected.shape[0], seq_len + 1, dtype=torch.bool,
                         device=selected.device)
    return listed.scatter_(1, index, True)[:, :seq_len]


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                 topk: int, key_dim: int) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer over paged keys: the tokens each query attends.

    ``q [T, H, D]`` are the indexer's queries, ``weights [T, H]`` its per-head weights and
    the pages (one head, ``D = key_dim`` elements of a token's page row, K page then V
    page, as :func:`page_latents` reads them) hold each token's indexer key ``k``. A query
    scores each visible token ``sum_h weights[h] * relu(scale * q[h]·k)`` in fp32 and keeps
    the ``topk`` best (every visible token when it sees at most ``topk``), the earlier
    token among equal scores, so a query selects the same tokens however its sequence's
    steps are cut. Returns int64 ``[T, topk]`` positions in descending score, ``-1`` past a
    query's visible tokens."""
    if q.dim() != 3 or weights.shape != q.shape[:2] or q.shape[2] != key_dim:
        raise ValueError(f"expected q [T, H, {key_dim}] and weights [T, H], got "
                         f"{tuple(q.shape)} and {tuple(weights.shape)}")
    if topk < 1 or key_dim > 2 * key_cache.shape[3]:
        raise ValueError(f"topk {topk} must be positive and key_dim {key_dim} at most the "
                         f"page row's {2 * key_cache.shape[3]} elements")
    check_attention_inputs(q[:, :1, :1].expand(-1, 1, key_cache.shape[3]), key_cache,
                           value_cache, metadata, None, None)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for q0, q1, rows, hidden in _sequences(key_cache, value_cache, metadata):
        seq_len = rows.shape[0]
        k = rows[:, :key_dim]
        s = torch.relu(torch.matmul(q[q0:q1].float(), k.T) * scale)  # [n, H, seq_len]
        score = torch.matmul(weights[q0:q1].float().unsqueeze(-2), s).squeeze(-2)
        score = score.masked_fill(hidden, float("-inf"))
        # Equal scores (a ReLU'd score is often exactly 0) go to the earlier token: a stable
        # sort, not torch.topk, whose order among ties changes with the row's length.
        n = min(topk, seq_len)
        values, picked = score.sort(dim=-1, descending=True, stable=True)
        out[q0:q1, :n] = torch.where(values[:, :n] == float("-inf"), -1, picked[:, :n])
    return out


def mla_decompressed_reference(q_nope: torch.Tensor, q_rope: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               metadata: AttentionMetadata, scale: float,
                               kv_b_weight: torch.Tensor) -> torch.Tensor:
    """Causal MLA the way a prefill over a cached prefix runs it: each sequence's cached
    latents are read back and decompressed into per-head K and V with ``kv_b_weight``
    ``[H * (nope + v), r]`` (transformers' ``kv_b_proj.weight``), then ordinary attention.
    ``q_nope [T, H, nope]``, ``q_rope [T, H, rope]``; returns ``[T, H, v]`` in fp32 typed like
    ``q_nope``."""
    num_heads, nope = q_nope.shape[1], q_nope.shape[2]
    r = 2 * key_cache.shape[3] - q_rope.shape[2]
    w = kv_b_weight.float().view(num_heads, -1, r)
    v_dim = w.shape[1] - nope
    out = torch.zeros(q_nope.shape[0], num_heads, v_dim, device=q_nope.device)
    for q0, q1, lat, hidden in _sequences(key_cache, value_cache, metadata):
        kv = torch.einsum("kr,hdr->khd", lat[:, :r], w)  # [n, H, nope + v]
        k_nope, v = kv[..., :nope], kv[..., nope:]
        s = (torch.einsum("qhd,khd->hqk", q_nope[q0:q1].float(), k_nope)
             + torch.einsum("qhd,kd->hqk", q_rope[q0:q1].float(), lat[:, r:])) * scale
        s = s.masked_fill(hidden[None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out.to(q_nope.dtype)


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load_piece(ptr, rows, row_mask, col0, cols, stride_d, WIDTH: tl.constexpr, UPCAST: tl.constexpr):
        """Rows ``rows`` (element offsets) of columns ``[col0, col0 + cols)``, ``WIDTH`` wide."""
        c = tl.arange(0, WIDTH)
        x = tl.load(ptr + rows[:, None] + (col0 + c)[None, :] * stride_d,
                    mask=row_mask[:, None] & (c < cols)[None, :], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _dot(a, b, UPCAST: tl.constexpr):
        """``a @ b``; in fp32 (``ieee``, no TF32) when ``UPCAST``."""
        if UPCAST:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _store_piece(ptr, rows, row_mask, col0, cols, stride_d, x, WIDTH: tl.constexpr):
        """Store ``x`` into columns ``[col0, col0 + cols)`` of rows ``rows``, as ``_load_piece`` reads."""
        c = tl.arange(0, WIDTH)
        tl.store(ptr + rows[:, None] + (col0 + c)[None, :] * stride_d, x.to(ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (c < cols)[None, :])

    @triton.jit
    def _mla_decode_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
        block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        scale, num_heads, num_splits,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_ks, stride_kd,
        stride_vb, stride_vs, stride_vd,
        stride_os, stride_ot, stride_oh, stride_od,
        stride_ls, stride_lt, stride_lh,
        stride_btb, stride_btp,
        HALF: tl.constexpr,
        D1: tl.constexpr,
        D2: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PAGE: tl.constexpr,
        SPLIT: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        # One program per (BLOCK_H query heads, sequence, split); the sequence's one query
        # attends the cached latents of its split. A latent is two halves, the K page's
        # [0, HALF) and the V page's [HALF, L); each half is read as a head piece of D1
        # columns and, when HALF > D1, a tail of HALF - D1 columns padded to D2.
        h_tile = tl.program_id(0)
        seq = tl.program_id(1) // num_splits
        split = tl.program_id(1) % num_splits
        q_start = tl.load(cu_seqlens_q_ptr + seq)
        if tl.load(cu_seqlens_q_ptr + seq + 1) == q_start:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        h = h_tile * BLOCK_H + tl.arange(0, BLOCK_H)
        h_mask = h < num_heads
        q_rows = q_start.to(tl.int64) * stride_qt + h * stride_qh
        qa1 = _load_piece(q_ptr, q_rows, h_mask, 0, HALF, stride_qd, D1, UPCAST)
        qb1 = _load_piece(q_ptr, q_rows, h_mask, HALF, HALF, stride_qd, D1, UPCAST)
        qa2 = _load_piece(q_ptr, q_rows, h_mask, D1, HALF - D1, stride_qd, D2, UPCAST)
        qb2 = _load_piece(q_ptr, q_rows, h_mask, HALF + D1, HALF - D1, stride_qd, D2, UPCAST)
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc_a1 = tl.zeros([BLOCK_H, D1], dtype=tl.float32)
        acc_b1 = tl.zeros([BLOCK_H, D1], dtype=tl.float32)
        acc_a2 = tl.zeros([BLOCK_H, D2], dtype=tl.float32)
        acc_b2 = tl.zeros([BLOCK_H, D2], dtype=tl.float32)
        bt_row = block_table_ptr + seq.to(tl.int64) * stride_btb
        n = tl.arange(0, BLOCK_N)
        qk_scale = scale * 1.4426950408889634  # softmax in base 2
        t_lo = 0
        t_hi = tl.cdiv(seq_len, BLOCK_N)
        if SPLIT:
            per = tl.cdiv(t_hi, num_splits)
            t_lo = split * per
            t_hi = tl.minimum(t_lo + per, t_hi)
        for t in range(t_lo, t_hi):
            k_pos = t * BLOCK_N + n
            valid = k_pos < seq_len
            blk = tl.load(bt_row + (k_pos // PAGE) * stride_btp, mask=valid, other=0).to(tl.int64)
            slot = (k_pos % PAGE).to(tl.int64)
            k_rows = blk * stride_kb + slot * stride_ks
            v_rows = blk * stride_vb + slot * stride_vs
            a1 = _load_piece(k_ptr, k_rows, valid, 0, HALF, stride_kd, D1, UPCAST)
            b1 = _load_piece(v_ptr, v_rows, valid, 0, HALF, stride_vd, D1, UPCAST)
            s = _dot(qa1, tl.trans(a1), UPCAST) + _dot(qb1, tl.trans(b1), UPCAST)
            if HALF > D1:
                a2 = _load_piece(k_ptr, k_rows, valid, D1, HALF - D1, stride_kd, D2, UPCAST)
                b2 = _load_piece(v_ptr, v_rows, valid, D1, HALF - D1, stride_vd, D2, UPCAST)
                s += _dot(qa2, tl.trans(a2), UPCAST) + _dot(qb2, tl.trans(b2), UPCAST)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(a1.dtype)
            acc_a1 = acc_a1 * alpha[:, None] + _dot(p, a1, UPCAST)
            acc_b1 = acc_b1 * alpha[:, None] + _dot(p, b1, UPCAST)
            if HALF > D1:
                acc_a2 = acc_a2 * alpha[:, None] + _dot(p, a2, UPCAST)
                acc_b2 = acc_b2 * alpha[:, None] + _dot(p, b2, UPCAST)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_rows = split.to(tl.int64) * stride_os + q_start.to(tl.int64) * stride_ot + h * stride_oh
        _store_piece(o_ptr, o_rows, h_mask, 0, HALF, stride_od, acc_a1 / l_safe, D1)
        _store_piece(o_ptr, o_rows, h_mask, HALF, HALF, stride_od, acc_b1 / l_safe, D1)
        if HALF > D1:
            _store_piece(o_ptr, o_rows, h_mask, D1, HALF - D1, stride_od, acc_a2 / l_safe, D2)
            _store_piece(o_ptr, o_rows, h_mask, HALF + D1, HALF - D1, stride_od, acc_b2 / l_safe, D2)
        if SPLIT:  # log2-sum-exp of this split's scores; -inf when it saw no latent
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
            tl.store(lse_ptr + split.to(tl.int64) * stride_ls + q_start.to(tl.int64) * stride_lt
                     + h * stride_lh, lse, mask=h_mask)


def _pieces(half: int) -> tuple[int, int]:
    """The widths ``(D1, D2)`` a half-latent of ``half`` elements is read in: the largest
    power of two that fits (at least 16), and the rest padded to a power of two (at least
    16; unread where nothing is left)."""
    d1 = max(16, 1 << (half.bit_length() - 1))
    return d1, max(16, next_pow2(half - d1))


def mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, metadata: AttentionMetadata, scale: float, *,
               block_n: int = 64, block_h: int | None = None, num_warps: int = 8,
               num_splits: int | None = None) -> torch.Tensor:
    """Triton paged MLA decode in the absorbed form: the semantics of
    :func:`mla_attention_reference` for a batch where every sequence has at most one query
    (``max_seqlen_q <= 1``; ValueError otherwise). ``q_latent``, ``q_rope`` and the pages
    share one dtype of fp32/fp16/bf16. ``block_n`` (tokens per tile), ``block_h`` (query
    heads per program; default: the heads rounded up to a power of two, 16 to 64),
    ``num_warps`` and ``num_splits`` (split-KV factor; default: by the grid's size, as
    :func:`kvstore.kernels.paged_attention` chooses it) are the launch plan; the defaults
    were the fastest plan measured at DeepSeek-V3's shapes on an H200 (``kvstore bench
    kernels --mla-sweep``). Returns ``[T, H, r]``."""
    require_triton()
    _check(q_latent, q_rope, key_cache, value_cache, metadata, scale)
    for name, value, low in (("block_n", block_n, 16), ("block_h", block_h, 16), ("num_warps", num_warps, 1)):
        if value is not None and (value < low or value & (value - 1)):
            raise ValueError(f"{name} must be a power of two of at least {low}, got {value}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if metadata.max_seqlen_q > 1:
        raise ValueError(f"mla_decode runs one query per sequence, got max_seqlen_q "
                         f"{metadata.max_seqlen_q}")
    dtypes = {q_latent.dtype, q_rope.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1 or q_latent.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"q_latent, q_rope and the pages need one dtype of fp32/fp16/bf16, "
                        f"got {sorted(map(str, dtypes))}")
    check_device(_mla_decode_kernel, q_latent, q_rope, key_cache, value_cache,
                 metadata.block_table, metadata.cu_seqlens_q, metadata.seq_lens)
    total, num_heads, r = q_latent.shape
    half, page = key_cache.shape[3], key_cache.shape[1]
    q = torch.cat([q_latent, q_rope], dim=-1).contiguous()
    out = torch.empty_like(q)
    batch = metadata.batch_size
    if total == 0 or batch == 0:
        return out[..., :r]
    block_h = block_h or max(16, next_pow2(min(num_heads, 64)))
    h_tiles = triton.cdiv(num_heads, block_h)
    interpreted = is_interpreted(_mla_decode_kernel)
    if num_splits is None:
        tiles = triton.cdiv(metadata.block_table.shape[1] * page, block_n)
        num_splits = choose_num_splits(h_tiles * batch, tiles, q.device, interpreted)
    split = num_splits > 1
    o_dst = torch.empty((num_splits, *q.shape), dtype=torch.float32, device=q.device) if split else out[None]
    lse = torch.empty((num_splits, total, num_heads), dtype=torch.float32, device=q.device) if split else q
    d1, d2 = _pieces(half)
    _mla_decode_kernel[(h_tiles, batch * num_splits)](
        q, key_cache, value_cache, o_dst, lse,
        metadata.block_table, metadata.cu_seqlens_q.contiguous(), metadata.seq_lens.contiguous(),
        float(scale), num_heads, num_splits,
        *q.stride(),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(3),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(3),
        *o_dst.stride(),
        *(lse.stride() if split else (0, 0, 0)),
        *metadata.block_table.stride(),
        HALF=half, D1=d1, D2=d2,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        PAGE=page,
        SPLIT=split,
        UPCAST=interpreted or q.dtype == torch.float32,
        num_warps=num_warps,
    )
    if split:
        merge_splits(o_dst, lse, out, r)  # only the first r columns are output
    return out[..., :r]
