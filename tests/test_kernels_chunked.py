"""The paged-attention kernel's chunk rule (chunked local attention, Llama 4) against the
reference, under TRITON_INTERPRET=1 on CPU: the query at q attends keys q // C * C <= k <= q.

Cases are poisoned as in test_kernels (NaN at every position no query may read, pages
wholly before the first query's chunk dropped), so a match also proves those are never
read."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _elements_read, _record_loads, needs_triton

from kvstore.kernels import attention, paged_attention, paged_attention_reference
from kvstore.kernels.reference import key_start, visible_key_range
from kvstore.kernels.testing import CHUNK_GRID, make_case, tolerance

pytestmark = needs_triton

FAST = {"mix-c20-r5-split3", "rag-c17-cap-split", "dec-c1-r4"}


def _grid_case(name, lens, h, hkv, d, bs, chunk, softcap, dtype):
    return make_case(*lens, h, hkv, d, bs, None, softcap, dtype, seed=hash(name) % 1000,
                     q_scale=3.0 if softcap else 1.0, chunk=chunk)


def _check(name, lens, h, hkv, d, bs, chunk, softcap, splits, dtype, bm, bn):
    case = _grid_case(name, lens, h, hkv, d, bs, chunk, softcap, dtype)
    ref = paged_attention_reference(*case.args(), **case.kwargs())
    assert not torch.isnan(ref).any(), "the reference read a poisoned position"
    out = paged_attention(*case.args(), **case.kwargs(), num_splits=splits, block_m=bm,
                          block_n=bn)
    atol, rtol = tolerance(dtype, out.device)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("args", [c for c in CHUNK_GRID if c[0] in FAST], ids=lambda c: c[0])
def test_chunk_cases_match_reference(args):
    _check(*args)


@pytest.mark.slow
@pytest.mark.parametrize("args", [c for c in CHUNK_GRID if c[0] not in FAST],
                         ids=lambda c: c[0])
def test_chunk_grid_matches_reference(args):
    _check(*args)


@pytest.mark.parametrize("chunk", [1, 3, 4, 6, 9])
def test_reference_matches_dense_sdpa_with_the_llama4_mask(chunk):
    """The reference equals dense attention under transformers' chunked mask rule, same
    chunk index and causal: (k // C == q // C) and k <= q."""
    h, hkv, d, bs, n = 4, 2, 16, 4, 23
    case = make_case([n], [n], h, hkv, d, bs, None, chunk=chunk)
    ref = paged_attention_reference(*case.args(), **case.kwargs())
    table = case.metadata.block_table[0]
    pos = torch.arange(n)
    k = case.key_cache[table[pos // bs].long(), pos % bs].repeat_interleave(h // hkv, 1)
    v = case.value_cache[table[pos // bs].long(), pos % bs].repeat_interleave(h // hkv, 1)
    mask = (pos[None, :] // chunk == pos[:, None] // chunk) & (pos[None, :] <= pos[:, None])
    dense = F.scaled_dot_product_attention(case.q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask,
                                           scale=case.scale).transpose(0, 1)
    torch.testing.assert_close(ref, dense, atol=1e-5, rtol=1e-5)


def test_window_and_chunk_together_take_the_later_start():
    q = torch.arange(40)
    assert torch.equal(key_start(q, 5, 8), torch.maximum(q - 4, q // 8 * 8).clamp(min=0))
    assert visible_key_range(30, 3, None, 8) == (24, 30)
    assert visible_key_range(30, 3, 2, 8) == (26, 30)
    assert visible_key_range(30, 6, None, 8) == (24, 30)
    assert visible_key_range(30, 7, None, 8) == (16, 30)
    case = make_case([5, 1], [40, 17], 4, 2, 16, 4, 6, chunk=8)
    out = paged_attention(*case.args(), **case.kwargs(), block_n=16)
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), **case.kwargs()),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("chunk", [1, 13, 16, 40])
def test_tile_loop_is_chunk_bounded(chunk):
    """Each program visits the key tiles from its first query's chunk start on, never more
    than cdiv(C + tokens per tile - 1, BN) + 1."""
    q_lens, seq_lens = [1, 1, 12], [300, 17, 260]
    h, hkv, bs, bn, bm = 8, 2, 16, 16, 16
    case = make_case(q_lens, seq_lens, h, hkv, 16, bs, None, chunk=chunk)
    tok = bm // (h // hkv)
    q_tiles = math.ceil(max(q_lens) / tok)
    counts = torch.full((len(q_lens), hkv, q_tiles, 1), -1, dtype=torch.int32)
    out = paged_attention(*case.args(), **case.kwargs(), block_m=bm, block_n=bn, num_splits=1,
                          tile_counts=counts)
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), **case.kwargs()),
                               atol=2e-5, rtol=2e-5)
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for t in range(q_tiles):
            if t * tok >= ql:
                continue
            first = sl - ql + t * tok
            last = min(first + tok, sl) - 1
            want = math.ceil((last + 1) / bn) - first // chunk * chunk // bn
            assert (counts[i, :, t, 0] == want).all()
    assert int(counts.max()) <= math.ceil((chunk + tok - 1) / bn) + 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="audits the interpreter's loads")
@pytest.mark.parametrize("chunk,splits", [(20, 1), (17, 3), (5, 2)])
def test_memory_audit_reads_only_the_chunk(monkeypatch, chunk, splits):
    """Every K/V element the kernel loads is at a position some query's chunk holds."""
    q_lens, seq_lens, h, hkv, d, bs = [1, 12, 4], [100, 40, 9], 8, 2, 16, 16
    case = make_case(q_lens, seq_lens, h, hkv, d, bs, None, poison_in_table=True, chunk=chunk)
    seen = _record_loads(monkeypatch)
    out = paged_attention(*case.args(), **case.kwargs(), block_m=16, block_n=32,
                          num_splits=splits)
    monkeypatch.undo()
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), **case.kwargs()),
                               atol=2e-5, rtol=2e-5)
    table = case.metadata.block_table
    legit = set()
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        lo, hi = visible_key_range(sl, ql, None, chunk)
        legit |= {(int(table[i, p // bs]), p % bs) for p in range(lo, hi)}
    for cache in (case.key_cache, case.value_cache):
        elems = _elements_read(seen, cache)
        read = set(zip((elems // cache.stride(0)).tolist(),
                       ((elems % cache.stride(0)) // cache.stride(1)).tolist(), strict=True))
        assert read and read <= legit


@pytest.mark.parametrize("chunk", [0, -3, 2.5, True])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_chunk_raises(chunk, backend):
    case = make_case([1], [20], 4, 2, 16, 16, None)
    with pytest.raises(ValueError, match="chunk must be None or an int >= 1"):
        attention(*case.args(), chunk=chunk, backend=backend)
