"""Hybrid attention (full + sliding-window groups over one pool): window drops, hits, all-or-nothing.

The hit checks here are brute force over the pool's blocks and do not use the pool's indexes.
The *verified prefix* of a request is the longest run of its blocks 0, 1, .. each held, in
some group, by a cached full block (`block_hash` set) whose `block_hash` equals the request's
i-th chained hash, whose `token_ids` equal the request's tokens of block i and whose
`parent_serial` is the serial of the verified block before it (the root serial of the
request's salt for block 0). A serial names one exact prefix, so those serials are unique per
position (checked); `parents[i]` is the serial block i must hang under.

A whole-block hit of `k` blocks (L = k * BS tokens) is *valid* for a group when k is at most
the verified prefix and, in that group, every block i in [s, k) is held by a cached full block
with that hash, those tokens and `parent_serial == parents[i]`, with s = 0 for a
full-attention group and, for a window W, s = max(0, L - W + 1) // BS: the blocks covering
positions [L - W + 1, L - 1], the keys before itself that the next query (at L) attends
(q - W < k <= q). For W = 1 that range is empty. Blocks before s must be null in the hit. The
coordinator's hit must be valid for every group, made of such blocks, and *maximal*: no
longer whole-block length up to the cap is valid for every group. A partial extension of p
tokens must come, in every group, from an indexed block whose parent serial is `parents[k]`
and whose first p tokens are the request's next p tokens, and p must be the largest such
length common to all groups (capped at BS - 1 and the cap).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from invariants import EventMirror, check_manager, group_state, internals, window_held

from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool
from kvstore.hashing import hash_block
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager
from kvstore.request import Request
from kvstore.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

BS = 4
HEADS, DIM = 1, 8


# ---- helpers -----------------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Chunk:
    """A chunked local layer of chunk `size` (the query at q attends q // C * C <= k <= q),
    where the helpers take a window."""

    size: int


#: A layer as the helpers take it: None (full attention), a window W, or a Chunk.
Layer = int | Chunk | None


def spec(window: Layer) -> KVCacheSpec:
    if window is None:
        return FullAttentionSpec(BS, HEADS, DIM)
    if isinstance(window, Chunk):
        return ChunkedLocalAttentionSpec(BS, HEADS, DIM, chunk=window.size)
    return SlidingWindowSpec(BS, HEADS, DIM, window=window)


def make_manager(windows: Sequence[Layer], num_blocks: int, partial: bool = True,
                 hold: bool = False, eviction: str = "lru", events: bool = False) -> KVCacheManager:
    """One layer per entry (None = full attention); groups come out in first-appearance order.
    Windows drop every page that leaves them unless `hold` (hold_window_pages); `events`
    records the cache's events."""
    config = make_kv_cache_config([spec(w) for w in windows], num_blocks=num_blocks)
    return KVCacheManager(config,
        CacheConfig(enable_partial_hits=partial, hold_window_pages=hold, eviction=eviction,
                    enable_events=events))


def group_windows(manager: KVCacheManager) -> list[Layer]:
    return [Chunk(g.spec.attention_chunk) if g.spec.attention_chunk is not None
            else g.spec.sliding_window for g in manager.config.groups]


def first_needed(window: Layer, num_computed: int) -> int:
    """Earliest position the query at `num_computed` attends: q - W < k <= q, or the start
    of its chunk."""
    if isinstance(window, Chunk):
        return num_computed // window.size * window.size
    return 0 if window is None else max(0, num_computed - window + 1)


def hit_start_block(window: Layer, num_blocks: int) -> int:
    """First block a hit of `num_blocks` blocks must hold: it covers [L - W + 1, L - 1]."""
    return first_needed(window, num_blocks * BS) // BS


def tables(manager: KVCacheManager, rid: str) -> tuple[list[int], ...]:
    return tuple(list(ids) for ids in manager.block_table(rid))


def non_null(ids: Sequence[int]) -> int:
    return sum(1 for i in ids if i != 0)


def prefill(manager: KVCacheManager, req: Request, chunk: int | None = None,
            upto: int | None = None) -> ComputedBlocks:
    """Admit `req` with its prefix hit (checked by brute force) and compute its tokens in
    chunks up to `upto` (default: all), checking the tables after every allocation."""
    computed = manager.get_computed_blocks(req)
    check_hit(manager, req, computed, req.num_tokens - 1, manager.enable_partial_hits)
    end = req.num_tokens if upto is None else upto
    first = True
    while first or req.num_computed_tokens < end:
        nc = computed.num_computed_tokens if first else req.num_computed_tokens
        n = min(chunk or end, end - nc)
        assert manager.allocate_slots(req, n, computed if first else None) is not None
        first = False
        nc = req.num_computed_tokens  # at admission: the hit taken
        check_tables_after_allocate(manager, req, nc + n)
        req.num_computed_tokens = nc + n
        check_manager(manager)
    return computed


def evict_head(manager: KVCacheManager, num: int) -> None:
    """Pop `num` blocks from the head of the free queue (evicting what they cached) and give
    them back unwritten, as a request freed before computing anything would."""
    pool = internals(manager).pool
    blocks = pool.get_new_blocks(num, 0)
    pool.free_blocks(blocks)
    check_manager(manager)


def evict_blocks(manager: KVCacheManager, block_ids: Sequence[int]) -> None:
    """Make these free blocks the least recently used, then evict exactly them."""
    queue = internals(manager).pool.free_queue
    for block_id in reversed(block_ids):
        block = internals(manager).pool.blocks[block_id]
        queue.remove(block)
        queue.appendleft(block)
    evict_head(manager, len(block_ids))
    assert all(internals(manager).pool.blocks[b].block_hash is None for b in block_ids)


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# ---- brute force over the pool -----------------------------------------------------------------


def candidates(pool: BlockPool, group: int | None, req: Request, i: int) -> list[KVCacheBlock]:
    """Cached full blocks of `group` (None: any group) holding exactly block i of `req` (hash
    and tokens)."""
    tokens = tuple(req.token_ids[i * BS:(i + 1) * BS])
    return [b for b in pool.blocks[1:]
            if (group is None or b.group_id == group) and b.block_hash is not None
            and b.block_hash == req.block_hashes[i] and b.token_ids == tokens]


def verified_parents(pool: BlockPool, req: Request, max_blocks: int) -> list[int]:
    """`parents[i]`, the serial block i hangs under, for every block of the verified prefix
    (at most `max_blocks`) and the one after it."""
    parents = [pool.root_serial(req.cache_salt)]
    for i in range(min(max_blocks, len(req.block_hashes))):
        serials = {b.serial for b in candidates(pool, None, req, i) if b.parent_serial == parents[i]}
        assert len(serials) <= 1, f"block {i}: two serials {serials} name one prefix"
        if not serials:
            break
        parents.append(serials.pop())
    return parents


def valid_for_group(pool: BlockPool, group: int, window: Layer, req: Request,
                    num_blocks: int) -> bool:
    """Whether the group holds every block a hit of `num_blocks` needs, under its prefix."""
    parents = verified_parents(pool, req, num_blocks)
    if num_blocks >= len(parents):  # past the verified prefix
        return False
    return all(any(c.parent_serial == parents[i] for c in candidates(pool, group, req, i))
               for i in range(hit_start_block(window, num_blocks), num_blocks))


def best_whole_block_hit(manager: KVCacheManager, req: Request, cap_tokens: int) -> int:
    """The longest whole-block length (in blocks, at most cap_tokens // BS) valid for all groups."""
    pool = internals(manager).pool
    windows = group_windows(manager)
    for k in range(cap_tokens // BS, -1, -1):
        if all(valid_for_group(pool, g, w, req, k) for g, w in enumerate(windows)):
            return k
    raise AssertionError("unreachable: 0 blocks is always valid")


def check_hit(manager: KVCacheManager, req: Request, computed: ComputedBlocks, cap_tokens: int,
              partial: bool) -> None:
    """The coordinator's hit is valid for every group, made of the right blocks, and maximal
    (a hit in flight: its cached part maximal, then its request's pages holding the
    prompt's tokens)."""
    if computed.num_inflight_blocks:
        check_inflight(manager, req, computed)
        k = computed.num_full_hit_tokens // BS - computed.num_inflight_blocks
        computed = replace(computed, blocks=tuple(b[:k] for b in computed.blocks),
                           num_full_hit_tokens=k * BS, inflight=None, num_inflight_blocks=0)
        partial = False  # a hit in flight takes no partial block
    pool = internals(manager).pool
    windows = group_windows(manager)
    full = computed.num_full_hit_tokens
    assert full % BS == 0
    k = full // BS
    assert computed.num_computed_tokens <= cap_tokens
    assert computed.num_computed_tokens < req.num_tokens, "a hit covered the last token"
    parents = verified_parents(pool, req, k)
    assert len(parents) > k, "a hit past the verified prefix"
    assert computed.parent_serials == tuple(parents[:k + 1]) or (k == 0 and not computed.parent_serials)
    for g, window in enumerate(windows):
        blocks = computed.blocks[g]
        assert len(blocks) == k, f"group {g}: {len(blocks)} hit blocks for a {k}-block hit"
        start = hit_start_block(window, k)
        for i, block in enumerate(blocks):
            if i < start:
                assert block.is_null, (f"group {g} (W={window}): hit block {i} should be null: "
                                       f"the query at {full} reads from {first_needed(window, full)}")
                continue
            assert not block.is_null, f"group {g} (W={window}): hit block {i} is null"
            assert block.group_id == g
            assert block.block_hash == req.block_hashes[i]
            assert block.token_ids == tuple(req.token_ids[i * BS:(i + 1) * BS])
            assert block.parent_serial == parents[i], f"group {g}: block {i} under another prefix"
        assert valid_for_group(pool, g, window, req, k)
    best = best_whole_block_hit(manager, req, cap_tokens)
    assert k == best, (f"hit of {k} blocks is not maximal: {best} blocks are valid for every "
                       f"group (windows {windows}, cap {cap_tokens} tokens)")
    # The partial (copy-on-write) extension.
    p = computed.num_partial_tokens
    assert 0 <= p <= BS - 1
    if not partial or cap_tokens <= full:
        assert p == 0
        return
    query = tuple(req.token_ids[full:min(full + BS - 1, cap_tokens)])
    expected = len(query)
    parent = parents[k]
    for g in range(len(windows)):
        longest = 0
        for b in pool.blocks[1:]:
            if b.group_id == g and b.token_ids is not None and b.parent_serial == parent:
                n = 0
                while n < min(len(b.token_ids), len(query)) and b.token_ids[n] == query[n]:
                    n += 1
                longest = max(longest, n)
        expected = min(expected, longest)
        src = computed.partial_sources[g]
        if p:
            assert src is not None and src.group_id == g and src.token_ids is not None
            assert src.parent_serial == parent
            assert src.token_ids[:p] == query[:p]
    assert p == expected, f"partial extension of {p} tokens, {expected} possible"
    if p == 0:
        assert all(s is None for s in computed.partial_sources)


def check_inflight(manager: KVCacheManager, req: Request, computed: ComputedBlocks) -> None:
    """The pages of a hit in flight are its request's, in every group, past its cached
    blocks, and hold the prompt's tokens under the prompt's salt."""
    source = computed.inflight
    assert source is not None and source is not req and source.cache_salt == req.cache_salt
    end = computed.num_full_hit_tokens // BS
    first = end - computed.num_inflight_blocks
    assert computed.num_partial_tokens == 0
    assert source.token_ids[:end * BS] == req.token_ids[:end * BS], "wrong content"
    for g, blocks in enumerate(computed.blocks):
        owned = internals(manager).groups[g].table(source.request_id)
        assert all(blocks[i] is owned[i] and not blocks[i].is_null for i in range(first, end))


def held(manager: KVCacheManager, g: int, rid: str, i: int) -> bool:
    """Whether group g keeps table entry i of request rid past its window (held)."""
    return window_held(internals(manager).groups[g], rid, i)


def check_tables_after_allocate(manager: KVCacheManager, req: Request, num_tokens: int) -> None:
    """Right after allocate_slots: windowed tables hold exactly the pages of the next query's
    window onwards (nulls before, but for held pages), full tables every page; tables cover
    `num_tokens`."""
    nc = req.num_computed_tokens
    for g, (window, ids) in enumerate(zip(group_windows(manager), tables(manager, req.request_id),
                                          strict=True)):
        assert len(ids) == cdiv(num_tokens, BS), f"group {g}: table of {len(ids)} for {num_tokens}"
        first = first_needed(window, nc) // BS
        for i, bid in enumerate(ids):
            if i < first and held(manager, g, req.request_id, i):
                pass  # held, or null where the admission's hit started past it
            elif i < first:
                assert bid == 0, (f"group {g} (W={window}): block {i} (positions "
                                  f"{i * BS}..{i * BS + BS - 1}) kept, but the next query at {nc} "
                                  f"attends only from {first_needed(window, nc)}")
            else:
                assert bid != 0, f"group {g} (W={window}): block {i} is null but still needed"


def snapshot(manager: KVCacheManager) -> tuple[Any, ...]:
    """Everything an allocation could change."""
    pool = internals(manager).pool
    blocks = tuple((b.ref_cnt, b.pin_cnt, b.group_id, b.block_hash, b.token_ids, b.serial,
                    b.parent_serial) for b in pool.blocks)
    subs = tuple(group_state(m) for m in internals(manager).groups)
    return (
        blocks,
        tuple(queue_ids(pool)),
        sorted(pool.hash_entries()),
        sorted(pool.index_entries()),
        subs,
        {rid: (r.num_computed_tokens, r.num_tokens) for rid, r in manager.requests.items()},
        {g: n for g, n in pool.in_use_by_group.items() if n},
        pool.stats.as_dict(),
        list(manager.pinned_blocks),
    )


def exact_fit(manager: KVCacheManager, req: Request, num_tokens: int,
              computed: ComputedBlocks | None, with_partial: bool = True) -> bool:
    """Whether growing `req` to `num_tokens` tokens can be done with the free blocks, counted
    exactly: at admission every group takes its hit blocks (and copy source) first, then pops
    the copy destinations, then drops what falls out of the window (a dropped hit block that
    was free is free again), and only then pops new pages."""
    pool = internals(manager).pool
    windows = group_windows(manager)
    free = pool.num_free_blocks
    if computed is not None:  # admission
        nc = computed.num_computed_tokens if with_partial else computed.num_full_hit_tokens
        taken_all = final = 0
        for g, window in enumerate(windows):
            hits = computed.blocks[g]
            src = computed.partial_sources[g] if with_partial else None
            dropped = first_needed(window, nc) // BS
            for i, b in enumerate(hits):
                if not b.is_null and b.ref_cnt == 0:
                    taken_all += 1
                    final += i >= dropped
            table_len = len(hits)
            if src is not None:
                extra = 1 + (src.ref_cnt == 0)
                taken_all += extra
                final += extra
                table_len += 1
            final += max(0, cdiv(num_tokens, BS) - table_len)
        return taken_all <= free and final <= free
    nc = req.num_computed_tokens
    need = released = 0
    # Held pages are let go only for a request running alone (then all of them).
    alone = len(manager.requests) == 1
    for g, (window, table) in enumerate(zip(windows, (m.table(req.request_id)
                                        for m in internals(manager).groups), strict=True)):
        dropped = first_needed(window, nc) // BS
        released += sum(1 for i, b in enumerate(table[:dropped]) if not b.is_null
                        and b.ref_cnt == 1 and (alone or not held(manager, g, req.request_id, i)))
        written = table[nc // BS:cdiv(num_tokens, BS)]
        need += sum(1 for b in written if b.ref_cnt - b.pin_cnt > 1)
        need += max(0, cdiv(num_tokens, BS) - len(table))
    return need <= free + released


def resident_after(manager: KVCacheManager, nc: int, num_tokens: int) -> int:
    return sum(cdiv(num_tokens, BS) - first_needed(w, nc) // BS for w in group_windows(manager))


# ---- edge cases --------------------------------------------------------------------------------


def test_window_one_keeps_only_the_page_being_written() -> None:
    m = make_manager([None, 1], num_blocks=30)
    req = Request("a", list(range(100, 110)))
    prefill(m, req, chunk=1)
    full_ids, sw_ids = tables(m, "a")
    assert non_null(full_ids) == 3
    # The query at 9 attends only itself: every earlier page is gone, the last one is kept
    # because the allocation for position 9 was made while 9 was the next query.
    assert sw_ids[:2] == [0, 0] and sw_ids[2] != 0
    for _ in range(6):  # decode: positions 10..15
        req.append_token_ids(5)
        assert m.allocate_slots(req, 1) is not None
        check_tables_after_allocate(m, req, req.num_computed_tokens + 1)
        assert non_null(tables(m, "a")[1]) == 1
        req.num_computed_tokens += 1
        check_manager(m)
    m.free(req)
    check_manager(m)


@pytest.mark.parametrize("window", [4, 8, 12])
def test_window_multiple_of_block_size(window: int) -> None:
    m = make_manager([None, window], num_blocks=40)
    req = Request("a", list(range(100, 125)))  # 25 tokens
    for nc in range(0, 25, 3):
        n = min(3, 25 - nc)
        assert m.allocate_slots(req, n, m.get_computed_blocks(req) if nc == 0 else None)
        check_tables_after_allocate(m, req, nc + n)
        # Query at nc attends nc - W + 1 .. nc: pages wholly before are null.
        expect_nulls = max(0, nc - window + 1) // BS
        sw_ids = tables(m, "a")[1]
        assert sw_ids[:expect_nulls] == [0] * expect_nulls and 0 not in sw_ids[expect_nulls:]
        req.num_computed_tokens = nc + n
        check_manager(m)
    m.free(req)
    # A hit of L tokens needs exactly the W / BS blocks before L.
    again = Request("b", list(range(100, 125)))
    computed = m.get_computed_blocks(again)
    assert computed.num_full_hit_tokens == 24
    check_hit(m, again, computed, 24, True)
    assert [b.is_null for b in computed.blocks[1]] == [i < (24 - window + 1) // BS
                                                       for i in range(6)]


@pytest.mark.parametrize("window", [2, 3, 5, 6, 7, 9, 13])
def test_window_not_a_multiple_of_block_size(window: int) -> None:
    m = make_manager([None, window], num_blocks=40)
    req = Request("a", list(range(100, 126)))  # 26 tokens
    prefill(m, req, chunk=1)
    nc = req.num_computed_tokens
    sw_ids = tables(m, "a")[1]
    # After the last allocation (for position 25): pages before block (25 - W + 1) // BS dropped.
    assert sw_ids.count(0) == max(0, 25 - window + 1) // BS
    m.free(req)
    again = Request("b", list(range(100, 126)))
    computed = m.get_computed_blocks(again)
    check_hit(m, again, computed, nc - 1, True)
    assert computed.num_full_hit_tokens == 24
    # Covering [L - W + 1, L - 1] with L = 24.
    first = max(0, 24 - window + 1) // BS
    assert [b.is_null for b in computed.blocks[1]] == [i < first for i in range(6)]


def test_window_longer_than_the_request() -> None:
    m = make_manager([64], num_blocks=12)
    req = Request("a", list(range(100, 117)))  # 17 tokens, one shot: no drops before the free
    prefill(m, req)
    table = tables(m, "a")[0]
    assert 0 not in table
    m.free(req)
    # Freed deepest first: the partial tail block and block 3 are evicted before blocks 0..2.
    assert queue_ids(internals(m).pool)[-5:] == table[::-1]
    evict_head(m, m.num_free_blocks - 3)
    again = Request("b", list(range(100, 117)) + [1, 2, 3])
    computed = prefill(m, again, chunk=2)
    # W > L: the hit needs every block from the root, like full attention.
    assert computed.num_full_hit_tokens == 12
    assert [b.block_id for b in computed.blocks[0]] == table[:3]
    while again.num_computed_tokens < 30:  # decode to 30 tokens: still no page dropped
        again.append_token_ids(1)
        assert m.allocate_slots(again, 1) is not None
        check_tables_after_allocate(m, again, again.num_computed_tokens + 1)
        again.num_computed_tokens += 1
    assert 0 not in tables(m, "b")[0]
    check_manager(m)


@pytest.mark.parametrize("partial", [True, False])
def test_prompt_ending_on_a_block_boundary(partial: bool) -> None:
    m = make_manager([None, 5], num_blocks=30, partial=partial)
    prompt = list(range(100, 116))  # 16 tokens: exactly 4 blocks
    req = Request("a", prompt)
    computed = m.get_computed_blocks(req)
    assert computed.num_computed_tokens == 0
    assert m.allocate_slots(req, 16, computed) is not None
    assert [len(t) for t in tables(m, "a")] == [4, 4]
    first_tables = tables(m, "a")
    req.num_computed_tokens = 16
    m.free(req)
    again = Request("b", list(prompt))
    computed = m.get_computed_blocks(again)
    check_hit(m, again, computed, 15, partial)
    # The last token is never a hit: whole blocks stop at 12; the partial hit copies 3 tokens
    # of block 3 so that exactly one token is computed.
    assert computed.num_full_hit_tokens == 12
    assert computed.num_computed_tokens == (15 if partial else 12)
    assert m.allocate_slots(again, 16 - computed.num_computed_tokens, computed) is not None
    check_tables_after_allocate(m, again, 16)
    copies = m.take_pending_copies()
    if partial:
        assert sorted(src for src, _ in copies) == sorted(t[3] for t in first_tables)
        full_ids, sw_ids = tables(m, "b")
        assert full_ids[:3] == first_tables[0][:3]
        # Next query at 15 attends 11..15: block 2 (positions 8..11) kept, blocks 0 and 1 null.
        assert sw_ids[:2] == [0, 0] and sw_ids[2] == first_tables[1][2]
        assert {dst for _, dst in copies} == {full_ids[3], sw_ids[3]}
    else:
        assert copies == []
    check_manager(m)


def record_ids(manager: KVCacheManager, req: Request, chunk: int) -> list[dict[int, int]]:
    """Prefill in chunks; returns, per group, position -> the block id that held it."""
    seen: list[dict[int, int]] = [{} for _ in manager.config.groups]
    computed = manager.get_computed_blocks(req)
    first = True
    while first or req.num_computed_tokens < req.num_tokens:
        nc = computed.num_computed_tokens if first else req.num_computed_tokens
        n = min(chunk, req.num_tokens - nc)
        assert manager.allocate_slots(req, n, computed if first else None) is not None
        first = False
        nc = req.num_computed_tokens
        check_tables_after_allocate(manager, req, nc + n)
        for g, ids in enumerate(tables(manager, req.request_id)):
            for i, bid in enumerate(ids):
                if bid:
                    seen[g].setdefault(i, bid)
        req.num_computed_tokens = nc + n
    check_manager(manager)
    return seen


def test_hit_after_early_blocks_were_evicted() -> None:
    """The windowed group's early pages were evicted; its last window is cached: still a hit,
    with null entries before the window."""
    m = make_manager([None, 8], num_blocks=30)
    prompt = list(range(100, 125))  # 25 tokens, 6 full blocks
    req = Request("a", prompt)
    ids = record_ids(m, req, chunk=4)
    m.free(req)
    pool = internals(m).pool
    # The window drops freed the windowed group's blocks 0..3 while the request ran, and
    # they stay where they were freed; its free put the rest in one order, deepest position
    # first, the window page before the full page at each position (the root's full page
    # last of all).
    sw_early = [ids[1][i] for i in range(4)]
    queue = queue_ids(pool)
    assert queue[-8:] == [ids[1][5], ids[0][5], ids[1][4], ids[0][4],
                          *(ids[0][i] for i in range(3, -1, -1))]
    assert all(queue.index(b) < len(queue) - 8 for b in sw_early)
    evict_blocks(m, sw_early)
    assert all(pool.blocks[ids[0][i]].block_hash is not None for i in range(6))
    again = Request("b", prompt + [1])
    computed = prefill(m, again, chunk=4)
    # L = 24 needs positions 17..23 = blocks 4 and 5 in the windowed group.
    assert computed.num_full_hit_tokens == 24
    assert [b.block_id for b in computed.blocks[1]] == [0, 0, 0, 0, ids[1][4], ids[1][5]]
    assert [b.block_id for b in computed.blocks[0]] == [ids[0][i] for i in range(6)]


@pytest.mark.parametrize("layers", [[None, 8], [8], [4, 8]], ids=["full+window", "window",
                                                                "windows"])
def test_a_waiting_request_looked_up_again_finds_what_a_fresh_lookup_finds(
        layers: list[int | None]) -> None:
    """A request left waiting is looked up at every step: after its hit's early blocks
    (null entries of a window group's hit, but links of the verified prefix) are evicted, and
    after the prefix it wants is computed further, its lookup finds what the same prompt's
    first lookup finds."""
    m = make_manager(layers, num_blocks=40)
    prompt = list(range(100, 125))  # 25 tokens, 6 full blocks
    first = Request("a", prompt[:17])
    ids = record_ids(m, first, chunk=4)  # blocks 0..3 cached
    m.free(first)
    waiting = Request("w", prompt + [1])

    def looked_up_again() -> int:
        again = m.get_computed_blocks(waiting)
        fresh = Request("fresh", waiting.token_ids)
        expected = m.get_computed_blocks(fresh)
        m.drop_lookup(fresh)
        assert again.num_computed_tokens == expected.num_computed_tokens
        assert again.num_verified_tokens == expected.num_verified_tokens
        assert [[b.block_id for b in blocks] for blocks in again.blocks] == \
            [[b.block_id for b in blocks] for blocks in expected.blocks]
        return again.num_full_hit_tokens

    assert looked_up_again() == 16
    assert looked_up_again() == 16
    # The prefix goes on: another request computes blocks 4 and 5.
    second = Request("b", prompt)
    prefill(m, second, chunk=4)
    m.free(second)
    assert looked_up_again() == 24
    # Block 0 is evicted in every group: the verified prefix ends before it.
    evict_blocks(m, [table[0] for table in ids])
    assert looked_up_again() == 0


@pytest.mark.parametrize("hold", [False, True])
def test_a_shared_prefix_hits_while_the_request_that_computed_it_runs(hold: bool) -> None:
    """Window 8 (2 blocks): request a computes a 6-token shared prefix then 14 more tokens,
    far past its window. Without the held head its windows dropped blocks 0 and 1, which a
    busy pool reuses first: b, sharing the prefix, finds the full chain and no window. With
    it, the head stays in a's table and b hits the whole prefix."""
    m = make_manager([None, 8], num_blocks=30, hold=hold)
    shared = list(range(100, 106))
    a = Request("a", shared + list(range(200, 214)))
    prefill(m, a, chunk=4)
    window_table = tables(m, "a")[1]
    assert (window_table[0] != 0 and window_table[1] != 0) == hold
    evict_head(m, m.num_free_blocks)  # every free page reused: the dropped ones too
    b = Request("b", shared + [1, 2, 3])
    computed = m.get_computed_blocks(b)
    assert computed.num_computed_tokens == (6 if hold else 0)  # 4 + a partial hit of 2
    assert m.allocate_slots(b, b.num_tokens - computed.num_computed_tokens, computed) is not None
    check_manager(m)


@pytest.mark.parametrize("hold", [False, True])
def test_a_branch_point_is_learned_and_its_window_shared_while_held(hold: bool) -> None:
    """Window 8 (2 blocks of 4); a shared 16-token prefix, then different tails.
    b (32 tokens) computes it; its window drops blocks 2 to 5 on the way. c (prefix + its
    own tail) hits the 16 tokens, which ends its lookup's chain there: the full page of
    block 3 becomes a branch point, and c holds the window before it (blocks 2, 3). d, b's
    continuation, hits b's 32 tokens: its own window starts at block 6, but the branch
    point on its chain makes it take c's blocks 2 and 3 too (shared, no free page taken).
    After c ends and every free page is reused, e still hits the shared prefix, through d.
    Without held windows nothing is learned or shared: e hits nothing."""
    from kvstore.block import BRANCH_POINT

    m = make_manager([None, 8], num_blocks=64, hold=hold)
    shared = list(range(100, 116))
    b = Request("b", shared + list(range(200, 216)))
    prefill(m, b, chunk=4)
    window_b = tables(m, "b")[1]
    assert window_b[2] == window_b[3] == 0  # dropped (still cached, free)
    m.free(b)
    c = Request("c", shared + [7] * 8)
    computed = m.get_computed_blocks(c)
    assert computed.num_full_hit_tokens == 16 and computed.num_verified_tokens == 16
    assert m.allocate_slots(c, 8, computed) is not None
    full_c, window_c = tables(m, "c")
    assert (internals(m).pool.blocks[full_c[3]].hint == BRANCH_POINT) == hold
    shared_pages = [internals(m).pool.blocks[i] for i in window_c[2:4]]
    assert 0 not in window_c[2:4] and [p.ref_cnt for p in shared_pages] == [1, 1]
    d = Request("d", b.token_ids + [9] * 6)
    computed = m.get_computed_blocks(d)
    assert computed.num_full_hit_tokens == 32
    assert m.allocate_slots(d, 6, computed) is not None
    window_d = tables(m, "d")[1]
    # Shared, not taken off the free queue: c still holds them too.
    assert window_d[2:4] == (window_c[2:4] if hold else [0, 0])
    assert [p.ref_cnt for p in shared_pages] == ([2, 2] if hold else [1, 1])
    check_manager(m)
    m.free(c)
    evict_head(m, m.num_free_blocks)
    e = Request("e", shared + [5] * 3)
    assert m.get_computed_blocks(e).num_full_hit_tokens == (16 if hold else 0)
    check_manager(m)


@pytest.mark.parametrize("partial", [False, True])
def test_a_conversations_next_turn_marks_no_branch_point_and_holds_no_window(
        partial: bool) -> None:
    """x caches 18 tokens (4 full blocks and, with partial hits, a partial one). y, its
    next turn, goes on past them: its lookup ends where x's chain ends, so nothing is
    marked; with partial hits the cache shows the chain ended there (y extends x's cached
    partial block) and y holds no window; without, nothing shows it, and y holds the
    window before its hit end (blocks 2 and 3). z leaves x's chain after 8 tokens, where
    x goes on with a whole block: a branch point, and z holds the window before it."""
    from kvstore.block import BRANCH_POINT

    m = make_manager([None, 8], num_blocks=64, partial=partial, hold=True)
    x = Request("x", list(range(100, 118)))
    prefill(m, x, chunk=4)
    m.free(x)
    y = Request("y", x.token_ids + list(range(200, 210)))
    prefill(m, y, chunk=4)
    pool = internals(m).pool
    assert not any(pool.blocks[i].hint == BRANCH_POINT for i in tables(m, "y")[0])
    held_y = [held(m, 1, "y", i) for i in range(len(tables(m, "y")[1]))]
    assert held_y == [False, False] + [not partial] * 2 + [False] * (len(held_y) - 4)
    z = Request("z", x.token_ids[:8] + [7] * 8)
    prefill(m, z, chunk=4)
    assert pool.blocks[tables(m, "z")[0][1]].hint == BRANCH_POINT
    assert [held(m, 1, "z", i) for i in range(4)] == [True, True, False, False]
    check_manager(m)


def test_a_next_turn_sent_while_the_last_one_runs_holds_no_window() -> None:
    """x has computed 17 of its 18 tokens (4 cached blocks; window 8, 2 blocks) and runs
    on. y, its next turn sent before it finished, hits those 16 tokens with nothing
    cached after them: x holds the chain's last page and is computing past it, so the
    chain goes on there and y holds no window before its hit end. Once x has ended, the
    same lookup (nothing shows the chain ends there) holds the window (blocks 2 and 3)."""
    m = make_manager([None, 8], num_blocks=64, partial=False, hold=True)
    x = Request("x", list(range(100, 118)))
    prefill(m, x, chunk=4, upto=17)
    y = Request("y", x.token_ids + list(range(200, 210)))
    assert prefill(m, y, chunk=4).num_full_hit_tokens == 16
    assert not any(held(m, 1, "y", i) for i in range(len(tables(m, "y")[1])))
    check_manager(m)
    m.free(x)
    m.free(y)
    w = Request("w", x.token_ids[:16] + list(range(300, 310)))
    prefill(m, w, chunk=4)
    held_w = [held(m, 1, "w", i) for i in range(len(tables(m, "w")[1]))]
    assert held_w == [False, False, True, True] + [False] * (len(held_w) - 4)
    check_manager(m)


@pytest.mark.parametrize("output", [True, False], ids=["output", "prompt"])
def test_a_hit_ending_in_output_nobody_continued_holds_no_window(output: bool) -> None:
    """x's 16 tokens are cached (4 blocks; window 8, 2 blocks), the last 8 its output (or
    all 16 its prompt). y, the conversation's next turn, hits those 16 tokens with nothing
    cached after them. Where they end in x's output, only this conversation goes on there,
    and y holds no window before its hit end; where they end in a prompt, other prompts may
    share it, and y holds the window (blocks 2 and 3)."""
    m = make_manager([None, 8], num_blocks=64, partial=False, hold=True)
    tokens = list(range(100, 116))
    x = Request("x", tokens[:8] if output else tokens)
    prefill(m, x, chunk=4)
    for t in tokens[x.num_tokens:]:  # decoded one at a time
        x.append_token_ids(t)
        assert m.allocate_slots(x, 1) is not None
        x.num_computed_tokens += 1
    m.free(x)
    y = Request("y", tokens + list(range(200, 210)))
    assert prefill(m, y, chunk=4).num_full_hit_tokens == 16
    held_y = [held(m, 1, "y", i) for i in range(len(tables(m, "y")[1]))]
    assert held_y[:4] == [False, False, not output, not output]
    check_manager(m)


@pytest.mark.parametrize("why", ["head", "branch"])
def test_held_windows_are_let_go_only_for_a_request_running_alone(why: str) -> None:
    """Held window pages cost pages; when a running request cannot grow they are let go
    only if it runs alone (else the scheduler preempts, keeping the held windows). a holds
    blocks 0 and 1 past its window: its first window (the cache had none of its prompt),
    or the window before a branch point (x cached 16 tokens; a shares its first 8, where x
    goes on with a whole block)."""
    m = make_manager([None, 8], num_blocks=13, hold=True)  # 12 usable pages
    prefix = list(range(100, 108))
    if why == "branch":
        x = Request("x", prefix + list(range(400, 408)))
        prefill(m, x, chunk=4)
        m.free(x)
    b = Request("b", list(range(300, 303)))
    prefill(m, b)  # 1 page in each group
    a = Request("a", prefix + list(range(108, 120)))  # 20 tokens: 5 full pages, 5 window pages
    prefill(m, a, chunk=4)
    assert held(m, 1, "a", 0) and held(m, 1, "a", 1) and not held(m, 1, "a", 2)
    assert m.num_free_blocks == 0 and non_null(tables(m, "a")[1]) == 5
    # Growing a block takes a full and a window page; its window lets go of one.
    for t in range(120, 124):
        a.append_token_ids(t)
    before = snapshot(m)
    assert m.allocate_slots(a, 4) is None  # b runs too: refused, nothing let go
    assert snapshot(m) == before
    m.free(b)
    released = False
    while not released:
        free_before, head_before = m.num_free_blocks, tables(m, "a")[1][:2]
        assert m.allocate_slots(a, 4) is not None  # alone: never refused
        released = tables(m, "a")[1][:2] == [0, 0]
        if released:  # only once nothing else was left; then all the window has passed
            assert free_before + 1 < 2 and 0 not in head_before
            passed = first_needed(8, a.num_computed_tokens) // BS
            assert tables(m, "a")[1][:passed] == [0] * passed
        check_tables_after_allocate(m, a, a.num_computed_tokens + 4)
        check_manager(m)
        a.num_computed_tokens += 4
        for t in range(4):
            a.append_token_ids(t)
    assert not any(held(m, 1, "a", i) for i in range(len(tables(m, "a")[1])))


def test_hit_stops_before_a_gap_in_the_window() -> None:
    """A block inside the window was evicted: the hit must not reach past it."""
    m = make_manager([8], num_blocks=30)
    prompt = list(range(100, 125))
    ids = record_ids(m, Request("a", prompt), chunk=4)[0]
    m.free(m.requests["a"])
    # Refresh blocks 0, 1 (hit of 8) and 3, 4 (hit of 20) so that block 2 is evicted first.
    for name, n in (("r01", 9), ("r34", 21)):
        r = Request(name, prompt[:n])
        computed = m.get_computed_blocks(r)
        assert computed.num_full_hit_tokens == n - 1
        assert m.allocate_slots(r, 1, computed) is not None
        m.free(r)
    queue = queue_ids(internals(m).pool)
    assert queue.index(ids[2]) < min(queue.index(ids[i]) for i in (0, 1, 3, 4))
    evict_head(m, queue.index(ids[2]) + 1)
    assert internals(m).pool.blocks[ids[2]].block_hash is None
    assert all(internals(m).pool.blocks[ids[i]].block_hash is not None for i in (0, 1, 3, 4))
    # Cap 16: L = 16 needs blocks 2, 3 and L = 12 blocks 1, 2: both cross the gap. L = 8 fits.
    req = Request("b", prompt[:17])
    computed = m.get_computed_blocks(req)
    check_hit(m, req, computed, 16, True)
    assert computed.num_full_hit_tokens == 8
    assert [b.block_id for b in computed.blocks[0]] == [ids[0], ids[1]]
    # Cap 20: L = 20 needs blocks 3, 4 only, but with block 2 gone nothing shows that they
    # hang under the request's prefix (their hashes say so, but a hash can collide): the hit
    # never passes the prefix verified from the root, so it stays at 8.
    req = Request("c", prompt[:21])
    computed = m.get_computed_blocks(req)
    check_hit(m, req, computed, 20, True)
    assert computed.num_full_hit_tokens == 8
    assert [b.block_id for b in computed.blocks[0]] == [ids[0], ids[1]]
    check_manager(m)


def test_gemma3_like_long_request_holds_far_fewer_blocks() -> None:
    window, prompt_len, decode = 16, 200, 40
    gemma = KVCacheManager(make_kv_cache_config(
        [spec(window if (i + 1) % 6 else None) for i in range(12)], num_blocks=200),
            CacheConfig(hold_window_pages=False))
    all_full = KVCacheManager(make_kv_cache_config([spec(None)] * 12, num_blocks=200))
    assert len(gemma.config.groups) == 6 and gemma.config.num_slots == 2
    windows = group_windows(gemma)
    assert windows.count(None) == 1 and windows.count(window) == 5
    for m in (gemma, all_full):
        req = Request("long", [(7 * i) % 50_000 for i in range(prompt_len)])
        prefill(m, req, chunk=32)
        for _ in range(decode):
            req.append_token_ids(3)
            assert m.allocate_slots(req, 1) is not None
            check_tables_after_allocate(m, req, req.num_computed_tokens + 1)
            req.num_computed_tokens += 1
        check_manager(m)
    total = prompt_len + decode  # 240 tokens, 60 blocks
    usable = gemma.num_usable_blocks
    per_group = [round(u * usable) for u in gemma.group_usage()]
    for g, (w, ids) in enumerate(zip(windows, gemma.block_table("long"), strict=True)):
        assert per_group[g] == non_null(ids)
        if w is None:
            assert non_null(ids) == total // BS
        else:
            # Positions 239 - 15 .. 239: blocks 56..59 (224 is a block start).
            assert non_null(ids) == cdiv(window, BS) == 4
    assert sum(per_group) == 60 + 5 * 4
    full_blocks = round(all_full.group_usage()[0] * all_full.num_usable_blocks)
    assert full_blocks == non_null(all_full.block_table("long")[0]) == 60
    # Pages (bytes) actually held: each block id costs num_slots pages.
    gemma_bytes = sum(per_group) * gemma.config.bytes_per_block
    full_bytes = full_blocks * all_full.config.bytes_per_block
    assert gemma_bytes * 4 < full_bytes, (gemma_bytes, full_bytes)
    for m in (gemma, all_full):
        m.free(m.requests["long"])
        check_manager(m)


def test_all_or_nothing_full_group_short() -> None:
    """The windowed group would fit by itself (its drop frees what it needs); the full group
    has no page: None, and nothing changes."""
    m = make_manager([None, 4], num_blocks=11)
    req = Request("a", list(range(100, 124)))
    prefill(m, req, chunk=4, upto=16)
    # Hold every remaining free page (4: two per group).
    assert m.num_free_blocks == 4
    holder = Request("holder", list(range(500, 508)))
    assert m.allocate_slots(holder, holder.num_tokens, m.get_computed_blocks(holder)) is not None
    assert m.num_free_blocks == 0
    full_ids, sw_ids = tables(m, "a")
    # Windowed: positions 13..16 needed next; block 3 is kept, block 2 (8..11) will be dropped.
    assert sw_ids == [0, 0, sw_ids[2], sw_ids[3]] and sw_ids[2] != 0
    before = snapshot(m)
    assert m.allocate_slots(req, 4) is None
    assert snapshot(m) == before
    check_manager(m)
    m.free(holder)
    assert m.allocate_slots(req, 4) is not None
    check_tables_after_allocate(m, req, 20)
    check_manager(m)


def test_all_or_nothing_at_admission() -> None:
    """A new request whose hit fits in every group but whose new pages do not: None, and the
    free-but-cached hit blocks stay where they were in the LRU queue."""
    m = make_manager([None, 5], num_blocks=15, partial=False)
    prompt = list(range(100, 117))
    prefill(m, Request("a", prompt))  # 5 pages per group
    m.free(m.requests["a"])
    # Hold the 4 pages never written, leaving the 10 cached ones free.
    holder = Request("holder", list(range(500, 508)))
    assert m.allocate_slots(holder, holder.num_tokens, m.get_computed_blocks(holder)) is not None
    assert m.num_free_blocks == 10 and internals(m).pool.num_cached_blocks() == 8
    req = Request("b", prompt + list(range(300, 312)))  # 29 tokens
    computed = m.get_computed_blocks(req)
    assert computed.num_computed_tokens == 16
    before = snapshot(m)
    assert m.allocate_slots(req, 13, computed) is None
    assert snapshot(m) == before
    assert "b" not in m.requests and req.num_computed_tokens == 0
    check_manager(m)
    assert m.allocate_slots(req, 4, computed) is not None
    check_manager(m)


def test_request_longer_than_the_pool_is_an_error() -> None:
    m = make_manager([None, 4], num_blocks=8)
    req = Request("a", list(range(100, 130)))
    before = snapshot(m)
    with pytest.raises(ValueError, match="whole pool"):
        m.allocate_slots(req, 30, m.get_computed_blocks(req))
    assert snapshot(m) == before


# ---- known bugs (minimal repros) ---------------------------------------------------------------


def test_windowed_hit_survives_a_stale_link_to_its_right() -> None:
    """Block 3's parent was evicted and blocks 0..2 recomputed (new serials). W = 8: a hit of
    16 needs blocks 2 and 3 (not linked), a hit of 12 blocks 1 and 2 (linked, valid). The
    lookup meets block 3 first, fails to link it to block 2, restarts left of block 2 instead of
    at it, and returns 8."""
    m = make_manager([8], num_blocks=14, partial=False)
    prompt = list(range(100, 121))  # 21 tokens
    ids = record_ids(m, Request("r1", prompt), chunk=4)[0]
    m.free(m.requests["r1"])
    evict_blocks(m, [ids[0], ids[1], ids[2]])  # keep blocks 3 and 4
    assert internals(m).pool.blocks[ids[3]].block_hash is not None
    prefill(m, Request("r2", prompt[:13]))  # no hit: recomputes blocks 0..2
    m.free(m.requests["r2"])
    req = Request("r3", prompt[:17])
    computed = m.get_computed_blocks(req)
    assert best_whole_block_hit(m, req, 16) == 3
    assert computed.num_full_hit_tokens == 12  # kvstore returns 8


def test_windowed_hit_tries_every_cached_copy_of_its_last_block() -> None:
    """Two cached blocks hold block 2's content (same hash): the first one's parent was
    evicted, the second one is linked to a cached block 1. W = 8: a hit of 12 needs blocks
    1 and 2. The lookup takes the first copy, fails to link it and never tries the second:
    a hit of 4 tokens instead of 12."""
    m = make_manager([8], num_blocks=14, partial=False)
    prompt = list(range(100, 117))  # 17 tokens
    ids = record_ids(m, Request("r1", prompt), chunk=4)[0]
    m.free(m.requests["r1"])
    evict_blocks(m, [ids[0], ids[1]])
    assert internals(m).pool.blocks[ids[2]].block_hash is not None
    prefill(m, Request("r2", prompt[:13]))  # no hit: recomputes blocks 0..2 under new serials
    m.free(m.requests["r2"])
    req = Request("r3", prompt[:13])
    computed = m.get_computed_blocks(req)
    assert best_whole_block_hit(m, req, 12) == 3
    assert computed.num_full_hit_tokens == 12  # kvstore returns 4


def test_window_one_group_needs_no_cached_block() -> None:
    """W = 1: the query at L attends only itself, so a hit of L tokens needs no cached page in
    that group. Here the full group holds all 4 blocks, the W = 1 group's pages (dropped as
    soon as computed) were evicted: the hit should be 16 tokens; kvstore's windowed lookup
    insists on a cached block L / BS - 1 and vetoes every hit."""
    m = make_manager([None, 1], num_blocks=20, partial=False)
    prompt = list(range(100, 117))
    ids = record_ids(m, Request("r1", prompt), chunk=4)
    m.free(m.requests["r1"])
    evict_blocks(m, [ids[1][i] for i in range(4)])
    assert all(internals(m).pool.blocks[ids[0][i]].block_hash is not None for i in range(4))
    req = Request("r2", prompt)
    computed = m.get_computed_blocks(req)
    assert best_whole_block_hit(m, req, 16) == 4
    assert computed.num_full_hit_tokens == 16  # kvstore returns 0


def test_partial_hit_kept_when_it_fits_exactly() -> None:
    """W = 4: a hit of 8 needs block 1; with 3 more tokens copied from the cached partial
    block 2 the next query is at 11, so block 1 is dropped again during the admission. The
    request then holds the copy source (pinned), its copy and one new page: 3 pages, and the
    pool has 3 free. allocate_slots counts block 1 as consumed, finds 4 > 3 and falls back to
    the whole-block hit (8 tokens computed instead of 11)."""
    m = make_manager([4], num_blocks=4)
    prompt = list(range(100, 111))  # 11 tokens: blocks 0, 1 full, block 2 partial
    prefill(m, Request("r1", prompt))
    m.free(m.requests["r1"])
    assert m.num_free_blocks == 3
    req = Request("r2", prompt + [1, 2, 3, 4, 5])
    computed = m.get_computed_blocks(req)
    assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == (8, 3)
    assert exact_fit(m, req, 16, computed)
    assert m.allocate_slots(req, 5, computed) is not None
    assert req.num_computed_tokens == 11  # kvstore: 8
    check_tables_after_allocate(m, req, 16)
    check_manager(m)


# ---- the state machine -------------------------------------------------------------------------

WINDOWS = [1, 3, 4, 5, 8, 13]
FAMILIES = [list(range(100, 124)), list(range(200, 224))]
PREFIX_LENS = [0, 3, 4, 5, 8, 9, 12, 16, 20]
MAX_TOKENS = 34


class HybridCacheMachine(RuleBasedStateMachine):
    """A scheduler's calls on a hybrid cache, with a shadow of every page's content."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.partial = True
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []  # preempted or refused, to be readmitted
        self.content: dict[int, list[int | None]] = {}
        self.next_id = 0
        self.events = EventMirror()

    @initialize(windows=st.lists(st.sampled_from(WINDOWS), min_size=1, max_size=2, unique=True),
                full_position=st.integers(0, 2), num_blocks=st.integers(8, 24),
                partial=st.booleans(), hold=st.booleans(), with_full=st.booleans())
    def setup(self, windows: list[int], full_position: int, num_blocks: int, partial: bool,
              hold: bool, with_full: bool) -> None:
        layers: list[int | None] = list(windows)
        if with_full:  # without: the verified prefix is found in the window groups
            layers.insert(min(full_position, len(layers)), None)
        self.manager = make_manager(layers, num_blocks, partial, hold, events=True)
        self.partial = partial
        for salt in (None, "tenant"):  # so that lookups create no serials later
            internals(self.manager).pool.root_serial(salt)

    @property
    def m(self) -> KVCacheManager:
        assert self.manager is not None
        return self.manager

    # ---- shadow pages ----------------------------------------------------------------------
    def run_copies(self) -> None:
        for src, dst in self.m.take_pending_copies():
            assert src in self.content, f"copy from page {src}, which was never written"
            self.content[dst] = list(self.content[src])

    def write(self, req: Request, start: int, end: int) -> None:
        """The forward pass writes K/V of positions [start, end) into every group's pages."""
        pool = internals(self.m).pool
        for ids in tables(self.m, req.request_id):
            for p in range(start, end):
                bid = ids[p // BS]
                block = pool.blocks[bid]
                assert bid != 0, f"writing position {p} into the null block"
                assert block.token_ids is None, f"writing into cached block {block}"
                assert block.ref_cnt - block.pin_cnt == 1, f"writing into shared block {block}"
                self.content.setdefault(bid, [None] * BS)[p % BS] = req.token_ids[p]

    def check_content(self) -> None:
        """Every position a live request's next query reads holds that request's token."""
        for req in self.running.values():
            nc = req.num_computed_tokens
            for window, ids in zip(group_windows(self.m), tables(self.m, req.request_id),
                                   strict=True):
                for p in range(first_needed(window, nc), nc):
                    bid = ids[p // BS]
                    assert bid != 0
                    page = self.content.get(bid)
                    assert page is not None and page[p % BS] == req.token_ids[p], (
                        f"{req.request_id} (W={window}) position {p}: page {bid} holds "
                        f"{None if page is None else page[p % BS]}, expected {req.token_ids[p]}")

    # ---- a step for one request ------------------------------------------------------------
    def step(self, req: Request, num_new: int, computed: ComputedBlocks | None) -> bool:
        """allocate_slots + checks + copies + forward; returns whether it was scheduled."""
        m = self.m
        admitting = computed is not None
        nc = computed.num_computed_tokens if computed is not None else req.num_computed_tokens
        before = snapshot(m)
        if resident_after(m, nc, nc + num_new) > m.num_usable_blocks:
            with pytest.raises(ValueError, match="whole pool"):
                m.allocate_slots(req, num_new, computed)
            assert snapshot(m) == before
            return False
        fits = exact_fit(m, req, nc + num_new, computed)
        # At admission a partial hit that does not fit falls back to the whole-block hit.
        fallback = computed is not None and computed.num_partial_tokens > 0
        fits_without_partial = fallback and exact_fit(
            m, req, computed.num_full_hit_tokens + num_new, computed, with_partial=False)
        out = m.allocate_slots(req, num_new, computed)
        if out is None:
            assert snapshot(m) == before, "a refused allocation changed the pool"
            assert not fits and not fits_without_partial, (
                f"allocate_slots refused {req.request_id} ({num_new} tokens from {nc}) though it "
                f"fits in {m.num_free_blocks} free blocks")
            return False
        if admitting:
            assert computed is not None
            self.running[req.request_id] = req  # first, so teardown frees it after a failure
            if req.num_computed_tokens != nc:
                assert fallback and req.num_computed_tokens == computed.num_full_hit_tokens
                assert not fits, "fell back to the whole-block hit though the partial hit fits"
                nc = req.num_computed_tokens
        num_tokens = nc + num_new
        assert len(out) == len(m.config.groups)
        check_tables_after_allocate(m, req, num_tokens)
        check_manager(m)
        self.run_copies()
        self.write(req, nc, num_tokens)
        req.num_computed_tokens = num_tokens
        if num_tokens == req.num_tokens and req.num_tokens < MAX_TOKENS:
            req.append_token_ids(7)  # the sampled token; any value, shared suffixes hit more
        return True

    # ---- rules -----------------------------------------------------------------------------
    def draw_request(self, data: st.DataObject) -> Request:
        family = FAMILIES[data.draw(st.integers(0, len(FAMILIES) - 1), label="family")]
        n = data.draw(st.sampled_from(PREFIX_LENS), label="prefix")
        suffix = data.draw(st.lists(st.integers(0, 2), min_size=0 if n else 1, max_size=9),
                           label="suffix")
        salt = data.draw(st.sampled_from([None, None, None, "tenant"]), label="salt")
        req = Request(f"r{self.next_id}", family[:n] + suffix, cache_salt=salt)
        self.next_id += 1
        return req

    @rule(data=st.data())
    def admit_new(self, data: st.DataObject) -> None:
        req = self.draw_request(data)
        if not self.admit(req, data) and len(self.waiting) < 4:
            self.waiting.append(req)  # refused: it waits, looked up again when readmitted

    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """A whole request: admission, chunked prefill, a few decode steps, then free (or left
        running if the pool refuses a step)."""
        req = self.draw_request(data)
        if not self.admit(req, data):
            return
        decode = data.draw(st.integers(0, 4), label="decode steps")
        while req.num_computed_tokens < req.num_prompt_tokens + decode:
            if req.num_computed_tokens == req.num_tokens:
                break  # MAX_TOKENS
            left = req.num_tokens - req.num_computed_tokens
            num_new = data.draw(st.integers(1, left), label="num_new")
            if not self.step(req, num_new, None):
                return
        self.m.free(self.running.pop(req.request_id))

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.waiting), label="preempted")
        if self.admit(req, data):
            self.waiting.remove(req)

    def admit(self, req: Request, data: st.DataObject) -> bool:
        m = self.m
        before = snapshot(m)
        computed = m.get_computed_blocks(req)
        assert snapshot(m) == before, "get_computed_blocks changed the pool"
        check_hit(m, req, computed, req.num_tokens - 1, self.partial)
        nc = computed.num_computed_tokens
        nulls = any(b.is_null for blocks in computed.blocks for b in blocks)
        event(f"admission: whole-block hit {computed.num_full_hit_tokens > 0}, partial "
              f"{computed.num_partial_tokens > 0}, nulls in the hit {nulls}")
        num_new = data.draw(st.integers(1, req.num_tokens - nc), label="num_new")
        return self.step(req, num_new, computed)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens
                                   for r in self.running.values()))
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        live = [r for r in self.running.values() if r.num_computed_tokens < r.num_tokens]
        req = data.draw(st.sampled_from(live), label="running")
        left = req.num_tokens - req.num_computed_tokens
        num_new = data.draw(st.integers(1, left), label="num_new")
        self.step(req, num_new, None)  # refused: the scheduler waits or preempts (own rule)

    @precondition(lambda self: any(r.num_computed_tokens for r in self.running.values()))
    @rule(data=st.data())
    def move_back(self, data: st.DataObject) -> None:
        """The caller moves a request's progress back: refused, changing nothing, below a
        block it cached or where a query needs a page a window let go of; else it computes
        again from there up to where it was."""
        live = [r for r in self.running.values() if r.num_computed_tokens]
        req = data.draw(st.sampled_from(live), label="move back")
        nc = req.num_computed_tokens
        back = req.num_computed_tokens = data.draw(st.integers(0, nc - 1), label="to")
        before = snapshot(self.m)
        try:
            out = self.m.allocate_slots(req, nc - back)
        except ValueError as e:
            assert "moved back" in str(e), e
            out = None
            event("moving back refused")
        if out is None:
            assert snapshot(self.m) == before
            req.num_computed_tokens = nc
            return
        event("moving back allowed")
        check_manager(self.m)
        self.run_copies()
        self.write(req, back, nc)  # computed again up to where it was
        req.num_computed_tokens = nc

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.running)), label="finish")
        self.m.free(self.running.pop(req))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="preempt")
        req = self.running.pop(rid)
        self.m.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="fork")
        parent = self.running[rid]
        child = parent.fork(f"r{self.next_id}")
        self.next_id += 1
        self.m.fork(parent, child)
        self.running[child.request_id] = child

    @rule(data=st.data())
    def probe(self, data: st.DataObject) -> None:
        """A pure lookup at an arbitrary cap, straight through the coordinator."""
        family = FAMILIES[data.draw(st.integers(0, len(FAMILIES) - 1), label="family")]
        n = data.draw(st.sampled_from(PREFIX_LENS + [24]), label="prefix")
        suffix = data.draw(st.lists(st.integers(0, 2), min_size=0 if n else 1, max_size=9),
                           label="suffix")
        req = Request("probe", family[:n] + suffix, cache_salt=None)
        req.update_block_hashes(BS, hash_block)
        cap = data.draw(st.integers(0, req.num_tokens - 1), label="cap")
        before = snapshot(self.m)
        computed = internals(self.m).coordinator.find_longest_hit(req, cap, self.partial)
        assert snapshot(self.m) == before
        check_hit(self.m, req, computed, cap, self.partial)

    @rule()
    def worker_copies(self) -> None:
        """A step with nothing scheduled still hands out (and releases) copies."""
        self.run_copies()

    @invariant()
    def consistent(self) -> None:
        if self.manager is None:
            return
        check_manager(self.m)
        self.events.check(self.m)
        self.check_content()

    def teardown(self) -> None:
        if self.manager is None:
            return
        for req in list(self.running.values()):
            self.m.free(req)
        self.running.clear()
        self.m.take_pending_copies()
        self.m.take_pending_copies()
        check_manager(self.m)
        pool = internals(self.m).pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        assert all(u == 0 for u in self.m.group_usage())
        assert self.m.reset_prefix_cache()
        assert pool.num_cached_blocks() == 0 and not pool.index_entries()


# Shrinking a failing run of this machine can take minutes; it is off unless
# KVSTORE_SHRINK=1, so that a failure is reported (unshrunk) within the file's time budget.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("KVSTORE_SHRINK") == "1":
    _PHASES.append(Phase.shrink)
HybridCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, report_multiple_bugs=False,
    phases=_PHASES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHybridCache = HybridCacheMachine.TestCase
TestHybridCache.pytestmark = [pytest.mark.slow]  # the longest machine: CI runs it, the inner loop skips it
