"""Chunked local attention (Llama 4): the spec's key range, its manager (the sliding-window
manager driven by the chunk rule) and hybrid caches mixing it with full attention.

A query at position p attends keys [p // C * C, p]. The hit, table and content checks are
the brute-force ones of test_hybrid, whose helpers take a chunked layer as `th.Chunk(C)`."""

from __future__ import annotations

import pytest
import test_hybrid as th
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from invariants import check_manager, internals

from kvstore.eviction import EVICTION_POLICIES
from kvstore.request import Request
from kvstore.specs import (
    NEVER,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    make_kv_cache_config,
)

BS = th.BS
CHUNKS = [1, 3, 4, 5, 8, 13]  # below, at, past and around the block size
POLICIES = sorted(EVICTION_POLICIES)


# ---- the spec ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [0, -4, 2.0, True, None, "8"])
def test_bad_chunk_is_refused(chunk: object) -> None:
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        ChunkedLocalAttentionSpec(BS, 1, 8, chunk=chunk)  # type: ignore[arg-type]


def test_bad_chunk_changes_no_cache() -> None:
    """A refused spec leaves a running cache exactly as it was."""
    m = th.make_manager([None, th.Chunk(5)], num_blocks=16)
    req = Request("a", list(range(11)))
    th.prefill(m, req, chunk=4)
    before = th.snapshot(m)
    with pytest.raises(ValueError, match="chunk"):
        make_kv_cache_config([FullAttentionSpec(BS, 1, 8),
                              ChunkedLocalAttentionSpec(BS, 1, 8, chunk=0)], num_blocks=16)
    assert th.snapshot(m) == before
    m.free(req)
    check_manager(m)


@settings(max_examples=200, deadline=None)
@given(chunk=st.integers(1, 40), bs=st.sampled_from([1, 2, 4, 16]), n=st.integers(0, 200))
def test_window_arithmetic_follows_the_chunk_rule(chunk: int, bs: int, n: int) -> None:
    """Each method against its definition: the next query at n sees [n // C * C, n]."""
    spec = ChunkedLocalAttentionSpec(bs, 1, 8, chunk=chunk)
    start = n // chunk * chunk
    assert spec.first_needed_position(n) == start
    assert spec.first_needed_block(n) == start // bs
    assert spec.sliding_window is None and spec.attention_chunk == spec.local_span == chunk
    b = n // bs
    leaves = spec.leaves_window_at(b)
    assert spec.first_needed_block(leaves) > b
    assert leaves == 0 or spec.first_needed_block(leaves - 1) <= b
    assert leaves != NEVER
    lo, hi = spec.hit_end_range(n)
    assert (lo, hi) == ((n // bs * bs) // chunk * chunk // bs, -(-n // bs))


@settings(max_examples=100, deadline=None)
@given(chunk=st.integers(1, 20), step=st.integers(1, 12), total=st.integers(1, 80))
def test_resident_span_bounds_the_pages_held(chunk: int, step: int, total: int) -> None:
    """No step of a request growing by at most `step` holds more pages than the span's
    (the scheduler's bound on what a request can hold at once)."""
    spec = ChunkedLocalAttentionSpec(BS, 1, 8, chunk=chunk)
    span = spec.resident_span(total, step)
    assert span <= total
    for nc in range(total):
        held = spec.num_resident_blocks(nc, min(total, nc + step))
        assert held <= th.cdiv(span, BS)


def test_chunked_layers_group_apart_from_full_ones() -> None:
    full = FullAttentionSpec(BS, 1, 8)
    chunked = ChunkedLocalAttentionSpec(BS, 1, 8, chunk=6)
    config = make_kv_cache_config([chunked, chunked, chunked, full] * 2, num_blocks=16,
                                  typical_tokens=100)
    assert [g.spec for g in config.groups] == [chunked, chunked, chunked, full]
    assert all(len(g.layer_ids) == 2 and not g.kept_whole for g in config.groups)


# ---- the manager ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", CHUNKS)
def test_pages_of_finished_chunks_are_dropped(chunk: int) -> None:
    """Decoding one token a step, the table holds exactly the pages of the current chunk."""
    m = th.make_manager([th.Chunk(chunk)], num_blocks=16)
    req = Request("a", list(range(30)))
    th.prefill(m, req, chunk=1)  # checks the tables after every step
    (ids,) = th.tables(m, "a")
    start = 29 // chunk * chunk // BS  # the last step ran the query at 29
    assert all(b == 0 for b in ids[:start]) and all(b != 0 for b in ids[start:])
    m.free(req)
    check_manager(m)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_hit_needs_only_the_chunk_of_its_end(chunk: int) -> None:
    """With every block of the chunked group but those of the hit end's chunk evicted, the
    cache still hits the whole prompt (the full group verifies the prefix); the chunked
    group's blocks before that chunk come back as null."""
    m = th.make_manager([None, th.Chunk(chunk)], num_blocks=24)
    tokens = list(range(100, 121))
    a = Request("a", tokens)
    th.prefill(m, a, chunk=3)
    m.free(a)
    b = Request("b", tokens)
    full = (len(tokens) - 1) // BS * BS
    need = full // chunk * chunk // BS  # the first block the hit needs
    pool = internals(m).pool
    cached = [blk for blk in pool.blocks[1:] if blk.block_hash is not None and blk.group_id == 1]
    keep = {a.block_hashes[i] for i in range(need, full // BS)}
    th.evict_blocks(m, [blk.block_id for blk in cached if blk.block_hash not in keep])
    computed = th.prefill(m, b)
    assert computed.num_full_hit_tokens == full
    assert [blk.is_null for blk in computed.blocks[1]] == [i < need for i in range(full // BS)]
    m.free(b)
    check_manager(m)


# ---- the state machine: chunked and full layers, every eviction policy ------------------------


class ChunkedHybridMachine(th.HybridCacheMachine):
    """The hybrid state machine (shadow pages, brute-force hits) over full and chunked
    layers, with the eviction policy drawn."""

    @initialize(chunks=st.lists(st.sampled_from(CHUNKS), min_size=1, max_size=2, unique=True),
                full_position=st.integers(0, 2), num_blocks=st.integers(8, 24),
                partial=st.booleans(), hold=st.booleans(),
                eviction=st.sampled_from(POLICIES))
    def setup(self, chunks: list[int], full_position: int, num_blocks: int,  # type: ignore[override]
              partial: bool, hold: bool, eviction: str) -> None:
        layers: list[th.Layer] = [th.Chunk(c) for c in chunks]
        layers.insert(min(full_position, len(layers)), None)
        self.manager = th.make_manager(layers, num_blocks, partial, hold, eviction, events=True)
        self.partial = partial
        for salt in (None, "tenant"):
            internals(self.manager).pool.root_serial(salt)


TestChunkedHybrid = ChunkedHybridMachine.TestCase
TestChunkedHybrid.settings = settings(th.HybridCacheMachine.TestCase.settings, max_examples=40)
