"""Paged-attention kernel against the reference, under TRITON_INTERPRET=1 on CPU.

Every case poisons with NaN every position that is not legitimately readable (null block,
dropped pages, slots past seq_len, unused blocks), so a match also proves those are never
read. Cases are chosen to cover each axis value, not the cartesian product.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvstore.kernels import (
    AttentionMetadata,
    attention,
    paged_attention,
    paged_attention_reference,
)
from kvstore.kernels.reference import visible_key_range
from kvstore.kernels.testing import GRID, make_case, tolerance
from kvstore.kernels.triton_attention import launch_config

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
pytestmark = needs_triton


def _run(case, **kw):
    return paged_attention(*case.args(), window=case.window, softcap=case.softcap, **kw)


def _ref(case):
    return paged_attention_reference(*case.args(), window=case.window, softcap=case.softcap)


@pytest.mark.parametrize(
    "name,lens,h,hkv,d,bs,window,softcap,splits,dtype,bm,bn", GRID, ids=[c[0] for c in GRID]
)
@pytest.mark.slow
def test_grid_matches_reference(name, lens, h, hkv, d, bs, window, softcap, splits, dtype, bm,
                                bn):
    case = make_case(*lens, h, hkv, d, bs, window, softcap, dtype, seed=hash(name) % 1000,
                     q_scale=3.0 if softcap else 1.0)
    ref = _ref(case)
    assert not torch.isnan(ref).any(), "the reference read a poisoned position"
    out = _run(case, num_splits=splits, block_m=bm, block_n=bn)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    atol, rtol = tolerance(dtype, out.device)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


def test_reference_matches_dense_sdpa():
    """The reference agrees with dense SDPA with an explicit causal+window mask."""
    h, hkv, d, bs, w = 8, 2, 64, 16, 13
    q_lens, seq_lens = [5, 1], [29, 40]
    case = make_case(q_lens, seq_lens, h, hkv, d, bs, None)  # window None: all K/V legit
    ref = paged_attention_reference(*case.args(), window=w)
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(sl)
        blocks = case.metadata.block_table[i, pos // bs].long()
        k = case.key_cache[blocks, pos % bs].repeat_interleave(h // hkv, 1).transpose(0, 1)
        v = case.value_cache[blocks, pos % bs].repeat_interleave(h // hkv, 1).transpose(0, 1)
        c0 = int(case.metadata.cu_seqlens_q[i])
        qi = case.q[c0:c0 + ql].transpose(0, 1)
        qpos = torch.arange(sl - ql, sl)
        mask = (pos[None] <= qpos[:, None]) & (pos[None] > qpos[:, None] - w)
        dense = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=case.scale)
        torch.testing.assert_close(ref[c0:c0 + ql], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_softcap_reference_formula():
    """Soft-capping is cap * tanh(scaled score / cap) on the scaled scores."""
    case = make_case([1], [3], 4, 4, 16, 16, None, dtype=torch.float32, q_scale=5.0)
    cap = 1.5
    out = paged_attention_reference(*case.args(), softcap=cap)
    k = case.key_cache[case.metadata.block_table[0, 0].long(), :3, 0]
    v = case.value_cache[case.metadata.block_table[0, 0].long(), :3, 0]
    s = (case.q[0, 0] @ k.T) * case.scale
    p = torch.softmax(cap * torch.tanh(s / cap), -1)
    torch.testing.assert_close(out[0, 0], p @ v)


@pytest.mark.parametrize("window", [4, 20])
def test_pages_in_table_but_out_of_window_are_skipped(window):
    """Real (non-null) NaN blocks sit in the table for pages before every window."""
    case = make_case([1, 6, 1], [100, 70, 33], 8, 2, 64, 16, window, poison_in_table=True)
    # the table really holds non-null blocks for the dropped pages
    assert (case.metadata.block_table[:, :2] != 0).all()
    out = _run(case, block_n=16)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)


def _expected_tiles(q_lens, seq_lens, window, tok_per_tile, bn, q_tiles):
    exp = torch.full((len(q_lens), q_tiles), -1, dtype=torch.int32)
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for t in range(q_tiles):
            if t * tok_per_tile >= ql:
                continue
            first = sl - ql + t * tok_per_tile
            last = min(first + tok_per_tile, sl) - 1
            lo = 0 if window is None else max(0, first - window + 1)
            exp[i, t] = math.ceil((last + 1) / bn) - lo // bn
    return exp


@pytest.mark.parametrize("window", [None, 1, 20, 48])
def test_tile_loop_is_window_bounded(window):
    """Count the key tiles each program visits: they follow the window, not the context."""
    q_lens, seq_lens = [1, 1, 12], [300, 17, 260]
    h, hkv, bs, bn, bm = 8, 2, 16, 16, 16
    case = make_case(q_lens, seq_lens, h, hkv, 16, bs, window)
    tok = bm // (h // hkv)
    q_tiles = math.ceil(max(q_lens) / tok)
    counts = torch.full((len(q_lens), hkv, q_tiles, 1), -1, dtype=torch.int32)
    out = _run(case, block_m=bm, block_n=bn, num_splits=1, tile_counts=counts)
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)
    exp = _expected_tiles(q_lens, seq_lens, window, tok, bn, q_tiles)
    for kvh in range(hkv):
        assert torch.equal(counts[:, kvh, :, 0], exp)
    if window is not None:
        # cost follows the window: never more than cdiv(W + tokens per tile - 1, BN) + 1
        assert int(counts.max()) <= math.ceil((window + tok - 1) / bn) + 1


def test_split_tiles_partition_the_window_range():
    """With splits, each split walks a disjoint share; together they cover the range once."""
    q_lens, seq_lens, window, bn = [1, 1], [500, 40], 100, 16
    case = make_case(q_lens, seq_lens, 4, 4, 16, 16, window)
    counts = torch.full((2, 4, 1, 3), -1, dtype=torch.int32)
    out = _run(case, block_m=16, block_n=bn, num_splits=3, tile_counts=counts)
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)
    exp = _expected_tiles(q_lens, seq_lens, window, 4, bn, 1)
    total = counts.clamp(min=0).sum(-1)[:, :, 0]
    assert torch.equal(total, exp.expand(2, 4))
    assert (counts >= 0).all()


def test_noncontiguous_layouts():
    """Strides are honoured: pages stored head-major, q a slice of a fused qkv tensor."""
    case = make_case([1, 7], [40, 29], 8, 2, 64, 16, 20)
    nb, bs, hkv, d = case.key_cache.shape
    k_hm = case.key_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    v_hm = case.value_cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not k_hm.is_contiguous()
    qkv = torch.randn(case.q.shape[0], 12, d)
    qkv[:, :8] = case.q
    q = qkv[:, :8]
    assert not q.is_contiguous()
    out = paged_attention(q, k_hm, v_hm, case.metadata, case.scale, window=case.window,
                          block_n=32)
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)


def test_tiny_head_dim_is_padded_to_a_dot_tile():
    case = make_case([1, 3], [21, 9], 4, 2, 8, 16, 5)
    torch.testing.assert_close(_run(case, block_n=16), _ref(case), atol=2e-5, rtol=2e-5)


def test_max_seqlen_q_upper_bound_and_preallocated_out():
    case = make_case([2, 5], [10, 50], 4, 4, 64, 16, None)
    out = torch.full_like(case.q, 7.0)
    meta = replace(case.metadata, max_seqlen_q=9)
    res = paged_attention(case.q, case.key_cache, case.value_cache, meta, case.scale, out=out,
                          block_m=16, block_n=16)
    assert res is out
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)


def test_attention_entry_point_backends():
    case = make_case([1, 4], [20, 33], 8, 2, 64, 16, 16, 2.0, q_scale=3.0)
    args = case.args()
    kw = {"window": case.window, "softcap": case.softcap}
    ref = _ref(case)
    # CPU tensors: "auto" is the reference, bit for bit
    assert torch.equal(attention(*args, **kw), ref)
    assert torch.equal(attention(*args, **kw, backend="reference"), ref)
    torch.testing.assert_close(attention(*args, **kw, backend="triton"), ref, atol=2e-5,
                               rtol=2e-5)
    with pytest.raises(ValueError, match="backend"):
        attention(*args, **kw, backend="cuda")


def test_bad_inputs_raise_clear_errors():
    case = make_case([1], [20], 8, 2, 64, 16, None)
    q, kc, vc, meta, scale = case.args()
    with pytest.raises(ValueError, match="window"):
        paged_attention(q, kc, vc, meta, scale, window=0)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(q, kc, vc, meta, scale, softcap=-1.0)
    with pytest.raises(ValueError, match=">= 16"):
        paged_attention(q, kc, vc, meta, scale, block_n=8)
    with pytest.raises(TypeError, match="int32"):
        paged_attention(q, kc, vc, replace(meta, block_table=meta.block_table.long()), scale)
    with pytest.raises(TypeError, match="dtype"):
        paged_attention(q.half(), kc, vc, meta, scale)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :7], kc, vc, meta, scale)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(q, kc, vc, replace(meta, block_table=meta.block_table[:, :1]), scale)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        c2 = make_case([3], [20], 8, 2, 64, 16, None)
        paged_attention(c2.q, c2.key_cache, c2.value_cache,
                        replace(c2.metadata, max_seqlen_q=2), c2.scale)


BACKENDS = ["reference", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_must_be_off_or_finite_positive(backend):
    """NaN or inf made an all-NaN output; a bool or a string is no cap either."""
    case = make_case([1], [9], 2, 1, 16, 4, None)
    for bad in (float("nan"), float("inf"), -float("inf"), -1.0, True, "2.0", torch.tensor(2.0)):
        with pytest.raises(ValueError, match="softcap must be None, 0 \\(off\\) or a finite"):
            attention(*case.args(), softcap=bad, backend=backend)
    off = attention(*case.args(), backend=backend)
    assert torch.equal(attention(*case.args(), softcap=0, backend=backend), off)
    torch.testing.assert_close(attention(*case.args(), softcap=np.float64(2.0), backend=backend),
                               attention(*case.args(), softcap=2.0, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_and_chunk_are_counts(backend):
    """window 2.5 was truncated to 2 and True ran as 1 (or crashed the reference); numpy
    integers are ints for both window and chunk, as ``as_count`` takes them."""
    case = make_case([2], [9], 2, 1, 16, 4, None)
    for name in ("window", "chunk"):
        for bad in (2.5, True, np.True_, np.float64(2.0), "2", 0):
            with pytest.raises(ValueError, match=f"{name} must be None or an int >= 1"):
                attention(*case.args(), **{name: bad}, backend=backend)
        want = attention(*case.args(), **{name: 2}, backend=backend)
        assert torch.equal(attention(*case.args(), **{name: np.int64(2)}, backend=backend), want)
        assert torch.equal(attention(*case.args(), **{name: np.uint8(2)}, backend=backend), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_size_zero_and_non_float_dtypes_are_refused(backend):
    case = make_case([1], [5], 2, 1, 8, 4, None)
    q, kc, vc, meta, scale = case.args()
    empty = kc[:, :0]
    with pytest.raises(ValueError, match="block_size >= 1"):
        attention(q, empty, empty, meta, scale, backend=backend)
    for bad, name in (((q.long(), kc.long(), vc.long()), "q"), ((q, kc.long(), vc), "key_cache"),
                      ((q, kc, vc.double()), "value_cache")):
        with pytest.raises(TypeError, match=f"{name} must be float32, float16 or bfloat16"):
            attention(*bad, meta, scale, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes_and_bad_scales_are_refused_by_both_backends(backend):
    """The reference ran fp16 q over fp32 caches where the kernel refused them; a NaN, zero
    or negative scale gave NaN or reversed attention."""
    case = make_case([1], [5], 2, 1, 8, 4, None)
    q, kc, vc, meta, scale = case.args()
    for bad in ((q.half(), kc, vc), (q, kc.bfloat16(), vc), (q, kc, vc.half())):
        with pytest.raises(TypeError, match="share one dtype"):
            attention(*bad, meta, scale, backend=backend)
    for bad_scale in (float("nan"), float("inf"), 0.0, -scale, True, "0.5"):
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            attention(q, kc, vc, meta, bad_scale, backend=backend)
    assert torch.equal(attention(q, kc, vc, meta, np.float32(scale), backend=backend),
                       attention(q, kc, vc, meta, float(np.float32(scale)), backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_or_plus_inf_sinks_are_refused(backend):
    """-inf is no sink; NaN or +inf made every output row NaN."""
    case = make_case([1], [5], 2, 1, 8, 4, None)
    q, kc, vc, meta, scale = case.args()
    for value in (float("nan"), float("inf")):
        sinks = torch.zeros(q.shape[1])
        sinks[-1] = value
        with pytest.raises(ValueError, match="sinks must be finite or -inf"):
            attention(q, kc, vc, meta, scale, sinks=sinks, backend=backend)
    no_sink = torch.full((q.shape[1],), -float("inf"))
    torch.testing.assert_close(attention(q, kc, vc, meta, scale, sinks=no_sink, backend=backend),
                               attention(q, kc, vc, meta, scale, backend=backend))


def test_metadata_checks_each_batch_once():
    """Per-batch checks run when the metadata is built, for the reference and kernel alike."""
    case = make_case([2, 1], [10, 30], 4, 4, 16, 16, None)
    meta = case.metadata
    assert meta.batch_size == 2 and meta.device.type == "cpu"
    with pytest.raises(ValueError, match="B\\+1"):
        replace(meta, cu_seqlens_q=meta.cu_seqlens_q[:2])
    with pytest.raises(ValueError, match="rows"):
        replace(meta, block_table=meta.block_table[:1])
    with pytest.raises(ValueError, match="q_len"):
        AttentionMetadata(meta.block_table, meta.cu_seqlens_q,
                          torch.tensor([1, 30], dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="start at 0"):
        replace(meta, cu_seqlens_q=meta.cu_seqlens_q + 1)
    with pytest.raises(TypeError, match="bool"):
        replace(meta, max_seqlen_q=True)
    with pytest.raises(ValueError, match=">= 0"):
        replace(meta, max_seqlen_q=-1)
    with pytest.raises(AttributeError):
        meta.max_seqlen_q = 5  # frozen: one batch, one layout
    # per-call checks (rows of q, table width, ids in the pool) hold for the reference too
    with pytest.raises(ValueError, match="total_q"):
        paged_attention_reference(case.q[:2], case.key_cache, case.value_cache, meta,
                                  case.scale)
    with pytest.raises(ValueError, match="block_table"):
        paged_attention_reference(case.q, case.key_cache[:2], case.value_cache[:2], meta,
                                  case.scale)


def test_launch_config_respects_dot_minimum():
    assert launch_config(8, 128, 1, None, None)[:2] == (16, 64)
    assert launch_config(32, 128, 1, None, None)[0] == 32
    assert launch_config(5, 80, 100, None, None)[0] == 128
    assert launch_config(8, 256, 100, None, None)[:2] == (64, 32)
    assert launch_config(4, 64, 3, None, None)[0] == 16
    with pytest.raises(ValueError):
        launch_config(8, 64, 1, None, 8)
    with pytest.raises(ValueError):
        launch_config(8, 64, 1, 8, None)


def test_visible_key_range_edges():
    assert visible_key_range(10, 1, 1) == (9, 10)
    assert visible_key_range(10, 1, None) == (0, 10)
    assert visible_key_range(10, 3, 4) == (4, 10)
    assert visible_key_range(10, 1, 100) == (0, 10)


# --- memory audit: record every address the interpreted kernel loads -------------------

def _record_loads(monkeypatch):
    """Patch the interpreter's load so each executed (unmasked) address is recorded."""
    import numpy as np
    from triton.runtime import interpreter

    seen: list[np.ndarray] = []
    orig = interpreter.InterpreterBuilder.create_masked_load

    def spy(self, ptrs, mask, other, cache_policy, is_volatile):
        seen.append(np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel())
        return orig(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", spy)
    return seen


def _elements_read(seen, t: torch.Tensor) -> torch.Tensor:
    """Element indices (into ``t``'s storage span) of recorded loads that fall inside ``t``."""
    import numpy as np

    addrs = np.concatenate(seen).astype(np.int64) if seen else np.zeros(0, np.int64)
    base = t.data_ptr()
    nbytes = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    inside = addrs[(addrs >= base) & (addrs < base + nbytes)]
    return torch.from_numpy(np.unique((inside - base) // t.element_size()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="audits the interpreter's loads")
@pytest.mark.parametrize(
    "q_lens,seq_lens,window,splits",
    [([1, 1, 6], [100, 9, 70], 20, 1), ([1, 12], [130, 40], 17, 3), ([4, 1], [50, 33], None, 2)],
)
def test_memory_audit_reads_only_visible_positions(monkeypatch, q_lens, seq_lens, window,
                                                   splits):
    """Every K/V element and block-table entry the kernel loads is one some query may see."""
    h, hkv, d, bs = 8, 2, 16, 16
    case = make_case(q_lens, seq_lens, h, hkv, d, bs, window, poison_in_table=True)
    kc, vc, table = case.key_cache, case.value_cache, case.metadata.block_table
    seen = _record_loads(monkeypatch)
    out = _run(case, block_m=16, block_n=32, num_splits=splits)
    monkeypatch.undo()
    torch.testing.assert_close(out, _ref(case), atol=2e-5, rtol=2e-5)

    legit_slots = set()  # (block, slot)
    legit_cols = set()  # (row, col) of the block table
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        lo, hi = visible_key_range(sl, ql, window)
        for pos in range(lo, hi):
            legit_slots.add((int(table[i, pos // bs]), pos % bs))
            legit_cols.add((i, pos // bs))
    for cache in (kc, vc):
        elems = _elements_read(seen, cache)
        assert elems.numel() > 0
        blk = elems // cache.stride(0)
        slot = (elems % cache.stride(0)) // cache.stride(1)
        read = set(zip(blk.tolist(), slot.tolist(), strict=True))
        assert read <= legit_slots, f"illegitimate reads: {sorted(read - legit_slots)[:5]}"
    cols = _elements_read(seen, table)
    read_cols = {(int(e) // table.stride(0), int(e) % table.stride(0)) for e in cols}
    assert read_cols <= legit_cols, f"block-table reads: {sorted(read_cols - legit_cols)[:5]}"


def test_split_heuristic(monkeypatch):
    """Split only when the grid underfills the GPU, and only the window-bounded range."""
    import kvstore.kernels.triton_attention as ta

    monkeypatch.setattr(ta, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert ta.choose_num_splits(8, 2049, cuda) == 64  # B=1, 8 KV heads, 128k context: cap
    assert ta.choose_num_splits(32, 2049, cuda) == 16  # B=4: about four waves of 132, 2^k
    assert ta.choose_num_splits(132, 2049, cuda) == 1  # the grid fills the GPU
    assert ta.choose_num_splits(128, 2049, cuda) == 4
    assert ta.choose_num_splits(8, 65, cuda) == 16  # window 4096: few tiles to share
    assert ta.choose_num_splits(8, 3, cuda) == 1  # short context: merging costs more
    assert ta.choose_num_splits(8, 2049, torch.device("cpu")) == 1
    plan = ta.launch_plan(64, 8, 128, 16, 8192, 1, 1, 4096, cuda)
    assert (plan.block_m, plan.block_n, plan.q_tiles, plan.num_splits) == (16, 64, 1, 16)
    plan = ta.launch_plan(64, 8, 128, 16, 8192, 1, 1, None, cuda)
    assert plan.num_splits == 64
    plan = ta.launch_plan(64, 8, 128, 16, 8192, 1, 1, None, cuda, num_splits=5)
    assert plan.num_splits == 5
