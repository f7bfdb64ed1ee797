"""KVCacheManager: a scheduler-like state machine over a simulated device, plus unit tests of
the hit cap, salts, forced hash collisions, stats, bad input and stale lookups."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from invariants import EventMirror, check_manager, group_state, internals

from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockRemoved
from kvstore.errors import RequestTooLargeError
from kvstore.hashing import hash_block
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager
from kvstore.request import Request
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from kvstore.utils import cdiv, common_prefix_len

BS = 4
SPEC_A = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_dim=8)


def config(num_blocks: int, groups: int = 1) -> KVCacheConfig:
    """Full attention with one group (two identical layers) or two groups of one layer each
    (equal specs, as a large bucket is split into groups)."""
    if groups == 1:
        cfg = make_kv_cache_config([SPEC_A, SPEC_A], num_blocks=num_blocks)
    else:
        cfg = KVCacheConfig(num_blocks, (KVCacheGroup(SPEC_A, (0,)), KVCacheGroup(SPEC_A, (1,))), 1)
    assert len(cfg.groups) == groups
    return cfg


def degenerate_hash(parent: int, tokens: Sequence[int]) -> int:
    return 0


def parent_only_hash(parent: int, tokens: Sequence[int]) -> int:
    return parent  # ignores the tokens: every block of a salt hashes to its root


def snapshot(m: KVCacheManager) -> dict[str, Any]:
    """Everything observable about the manager and its pool."""
    pool = internals(m).pool
    return {
        "blocks": [(b.ref_cnt, b.pin_cnt, b.group_id, b.block_hash, b.token_ids, b.serial,
                    b.parent_serial) for b in pool.blocks],
        "queue": [b.block_id for b in pool.free_queue],
        "hash_entries": sorted(pool.hash_entries()),
        "index_entries": sorted(pool.index_entries()),
        "in_use_by_group": {g: n for g, n in pool.in_use_by_group.items() if n},
        "stats": m.stats.as_dict(),
        "requests": {rid: (id(r), r.num_computed_tokens, m.block_table(rid))
                     for rid, r in m.requests.items()},
        "cached": [group_state(s) for s in internals(m).groups],
        "pending": list(internals(m).pending_copies),
        "pins": list(m.pinned_blocks),
    }


def tables(m: KVCacheManager, request: Request) -> list[list[KVCacheBlock]]:
    return [s.table(request.request_id) for s in internals(m).groups]


class Device:
    """Simulated KV pages: entry (group, tokens[:p + 1]) is what position p holds."""

    def __init__(self) -> None:
        self.pages: dict[int, list[Any]] = {}

    def run_copies(self, copies: list[tuple[int, int]]) -> None:
        assert len({d for _, d in copies}) == len(copies), "two copies into one block"
        # One gather, then one scatter (the batch contract of take_pending_copies).
        data = [list(self.pages.get(s, [None] * BS)) for s, _ in copies]
        for (_, dst), page in zip(copies, data, strict=True):
            self.pages[dst] = page

    def forward(self, m: KVCacheManager, r: Request, n: int) -> None:
        """Write positions [computed, computed + n) of `r`, then advance it."""
        start = r.num_computed_tokens
        for g, table in enumerate(tables(m, r)):
            for p in range(start, start + n):
                block = table[p // BS]
                assert block.block_id != 0
                assert block.block_hash is None, \
                    f"cached full block {block.block_id} written"
                assert block.ref_cnt - block.pin_cnt == 1, f"shared block {block.block_id} written"
                page = self.pages.setdefault(block.block_id, [None] * BS)
                page[p % BS] = (g, tuple(r.token_ids[:p + 1]))
        r.num_computed_tokens = start + n

    def check_request(self, m: KVCacheManager, r: Request) -> None:
        """Reading r's KV through its tables gives what a dense cache would hold."""
        for g, table in enumerate(tables(m, r)):
            for p in range(r.num_computed_tokens):
                got = self.pages.get(table[p // BS].block_id, [None] * BS)[p % BS]
                assert got == (g, tuple(r.token_ids[:p + 1])), (
                    f"{r.request_id} group {g} position {p}: block {table[p // BS].block_id} "
                    f"holds {got}")

    def check_cached(self, m: KVCacheManager) -> None:
        """Every indexed block holds computed KV of its own tokens (after some prefix)."""
        for block_id, group, _parent, tokens in internals(m).pool.index_entries():
            page = self.pages.get(block_id)
            assert page is not None and page[0] is not None, f"block {block_id} cached unwritten"
            base = page[0][1][:-1]
            assert len(base) % BS == 0
            for i in range(len(tokens)):
                assert page[i] == (group, base + tokens[:i + 1]), f"block {block_id} slot {i}"


def brute_force_hit(m: KVCacheManager, r: Request,
                    scheduled: Mapping[str, tuple[Request, int]] | None = None
                    ) -> tuple[int, int]:
    """(full-block hit tokens, partial tokens) by scanning every block of the pool, then the
    pages `scheduled` requests (with the token count their last chunk was scheduled up to)
    fill past their cached blocks (a hit in flight)."""
    pool, bs = internals(m).pool, m.block_size
    max_tokens = r.num_tokens - 1
    root = pool.root_serial(r.cache_salt)
    groups = range(len(internals(m).groups))
    chains: list[list[KVCacheBlock]] = []
    for g in groups:
        chain: list[KVCacheBlock] = []
        parent = root
        while len(chain) < max_tokens // bs:
            i = len(chain)
            want = tuple(r.token_ids[i * bs:(i + 1) * bs])
            found = [b for b in pool.blocks[1:] if b.group_id == g and b.block_hash is not None
                     and b.block_hash == r.block_hashes[i] and b.parent_serial == parent
                     and b.token_ids == want]
            if not found:
                break
            chain.append(found[0])
            parent = found[0].serial
        chains.append(chain)
    k = min(len(c) for c in chains)
    if scheduled and len(chains[0]) == k:
        more = inflight_blocks(m, r, chains[0][:k], scheduled)
        if more:
            return (k + more) * bs, 0
    full = k * bs
    if not m.enable_partial_hits or max_tokens <= full:
        return full, 0
    query = tuple(r.token_ids[full:min(full + bs - 1, max_tokens)])
    best = len(query)
    for g in groups:
        parent = chains[g][k - 1].serial if k else root
        best = min(best, max((common_prefix_len(b.token_ids, query) for b in pool.blocks[1:]
                              if b.group_id == g and b.token_ids is not None
                              and b.parent_serial == parent), default=0))
    return full, best


def inflight_blocks(m: KVCacheManager, r: Request, chain: list[KVCacheBlock],
                    scheduled: Mapping[str, tuple[Request, int]]) -> int:
    """How many blocks past the cached `chain` (group 0's) a hit in flight adds: the most
    that a scheduled request of r's salt, whose cached blocks in every group end with that
    chain, holds uncached in every group with r's tokens, below its scheduled count."""
    bs, k = m.block_size, len(chain)
    limit = min((r.num_tokens - 1) // bs, len(r.block_hashes))
    best = 0
    for other, end in scheduled.values():
        if other is r or other.cache_salt != r.cache_salt:
            continue
        groups = internals(m).groups
        if any(g.num_cached_blocks(other.request_id) != k for g in groups):
            continue
        owned = tables(m, other)
        if k and owned[0][k - 1] is not chain[-1]:
            continue
        n = k
        while (n < min(limit, end // bs) and all(t[n].block_id and t[n].block_hash is None
                                                 for t in owned)
               and other.token_ids[n * bs:(n + 1) * bs] == r.token_ids[n * bs:(n + 1) * bs]):
            n += 1
        best = max(best, n - k)
    return best


def check_hit_blocks(m: KVCacheManager, r: Request, computed: ComputedBlocks) -> None:
    """Hit blocks hold exactly r's tokens and link by serial to the salt's root; a copy
    source holds r's next tokens under the last hit block."""
    pool, bs = internals(m).pool, m.block_size
    root = pool.root_serial(r.cache_salt)
    full = computed.num_full_hit_tokens
    assert full % bs == 0
    assert computed.num_computed_tokens < r.num_tokens, "hit covers the last token"
    source, cached = computed.inflight, full // bs - computed.num_inflight_blocks
    for g, blocks in enumerate(computed.blocks):
        assert len(blocks) == full // bs
        for i, b in enumerate(blocks[cached:], cached):  # a hit in flight: its request's pages
            assert source is not None and source.cache_salt == r.cache_salt
            assert b is tables(m, source)[g][i] and b.group_id == g
            assert source.token_ids[:(i + 1) * bs] == r.token_ids[:(i + 1) * bs], "wrong content"
        blocks = blocks[:cached]
        parent = root
        for i, b in enumerate(blocks):
            assert b.block_hash is not None and b.group_id == g
            assert b.token_ids == tuple(r.token_ids[i * bs:(i + 1) * bs]), "wrong content"
            assert b.parent_serial == parent, "hit chain broken"
            parent = b.serial
        src = computed.partial_sources[g]
        n = computed.num_partial_tokens
        if n == 0:
            assert src is None
            continue
        assert src is not None and src.token_ids is not None and src.group_id == g
        assert src.parent_serial == parent
        assert src.token_ids[:n] == tuple(r.token_ids[full:full + n]), "wrong partial content"


# =============================================================================================
# State machine
# =============================================================================================

PREFIXES = (
    (1, 2, 3, 4, 5, 6, 7, 8, 9, 10),
    (1, 2, 3, 4, 5, 6, 11, 12),
    (7, 7, 7, 7, 7, 7, 7),
)
SALTS = (None, "tenant-a", "tenant-b")
MAX_TOKENS = 14


@st.composite
def prompts(draw: st.DrawFn) -> list[int]:
    prefix = draw(st.sampled_from(PREFIXES))
    prefix = prefix[:draw(st.integers(0, len(prefix)))]
    suffix = draw(st.lists(st.integers(0, 3), min_size=0 if prefix else 1, max_size=6))
    return list(prefix) + suffix


class ManagerMachine(RuleBasedStateMachine):
    """A scheduler driving one KVCacheManager; a simulated device checks every byte read."""

    GROUPS = 1
    NUM_BLOCKS = 8  # 7 usable; a request grows to at most 5 blocks per group
    PARTIAL = True
    HASH: Callable[[int, Sequence[int]], int] | None = None
    EARLY_LOOKUPS = False  # allocate with lookups made steps earlier (possibly stale)
    EVICTION = "lru"  # the pool's eviction policy (only LRU's free order is checked exactly)

    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(config(self.NUM_BLOCKS, self.GROUPS),
            CacheConfig(enable_partial_hits=self.PARTIAL, hash_fn=type(self).HASH or hash_block,
                        eviction=self.EVICTION, enable_events=True))
        self.events = EventMirror()
        self.device = Device()
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.early: dict[str, ComputedBlocks] = {}
        # Running requests whose last chunk was more than one token, with the token count
        # it was scheduled up to: lookups may hit the pages it filled (a hit in flight).
        self.scheduled: dict[str, tuple[Request, int]] = {}
        self.counter = 0
        self.admissions = 0

    def teardown(self) -> None:
        self.teardown_events()

    # ---- helpers -----------------------------------------------------------------------------
    def pick(self, data: st.DataObject, pool: dict[str, Request]) -> Request:
        return pool[data.draw(st.sampled_from(sorted(pool)), label="request")]

    def after_allocation(self, r: Request, n: int) -> None:
        """The step: the worker runs the copies, then the forward writes n tokens."""
        self.device.run_copies(self.m.take_pending_copies())
        self.device.forward(self.m, r, n)

    def try_admit(self, r: Request, data: st.DataObject) -> None:
        m = self.m
        computed = self.early.pop(r.request_id, None)
        stale = computed is not None
        if computed is None:
            before = snapshot(m)
            computed = m.get_computed_blocks(r)
            assert snapshot(m) == before, "get_computed_blocks changed state"
            assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == \
                brute_force_hit(m, r, self.scheduled)
            check_hit_blocks(m, r, computed)
        n = data.draw(st.integers(1, r.num_tokens - computed.num_computed_tokens), label="chunk")
        before = snapshot(m)
        try:
            out = m.allocate_slots(r, n, computed)
        except ValueError as e:
            event("admission: stale lookup rejected")
            assert stale, f"fresh lookup rejected: {e}"
            assert "stale" in str(e)
            assert snapshot(m) == before
            return
        if out is None:
            event("admission: pool full")
            assert snapshot(m) == before, "a refused allocation changed state"
            return
        kind = ("partial" if computed.num_partial_tokens
                else "full" if computed.num_full_hit_tokens else "no")
        event(f"admission: {kind} hit{' (stale lookup)' if stale else ''}")
        self.admissions += 1
        assert m.stats.lookups == self.admissions
        if r.num_computed_tokens != computed.num_computed_tokens:
            # Admitted on the full-block hit alone: only the partial copy's page did not fit.
            event("admission: partial part dropped for room")
            assert computed.num_partial_tokens and r.num_computed_tokens == computed.num_full_hit_tokens
            computed = dataclasses.replace(
                computed, partial_sources=(None,) * len(computed.partial_sources), num_partial_tokens=0)
        # The hit is in the table and still holds the content it was found with.
        for g, table in enumerate(tables(m, r)):
            assert table[:len(computed.blocks[g])] == computed.blocks[g]
            src = computed.partial_sources[g]
            if src is not None:
                assert src.pin_cnt >= 1 and src.ref_cnt >= 1
                assert src.group_id == g
        check_hit_blocks(m, r, computed)
        del self.waiting[r.request_id]
        self.running[r.request_id] = r
        if n > 1:
            self.scheduled[r.request_id] = (r, r.num_computed_tokens + n)
        self.after_allocation(r, n)

    # ---- rules -------------------------------------------------------------------------------
    @rule(prompt=prompts(), salt=st.sampled_from(SALTS), data=st.data())
    def arrive(self, prompt: list[int], salt: str | None, data: st.DataObject) -> None:
        self.counter += 1
        r = Request(f"r{self.counter}", prompt, cache_salt=salt)
        self.waiting[r.request_id] = r
        self.try_admit(r, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_waiting(self, data: st.DataObject) -> None:
        self.try_admit(self.pick(data, self.waiting), data)

    @precondition(lambda self: self.EARLY_LOOKUPS and self.waiting)
    @rule(data=st.data())
    def lookup_early(self, data: st.DataObject) -> None:
        """Look up now, allocate with this result later (the cache may change meanwhile)."""
        r = self.pick(data, self.waiting)
        before = snapshot(self.m)
        lookups = self.m.stats.lookups
        self.early[r.request_id] = self.m.get_computed_blocks(r)
        assert snapshot(self.m) == before and self.m.stats.lookups == lookups

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A chunk of prefill, or one decode token (or finish at the length cap)."""
        r = self.pick(data, self.running)
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_TOKENS:
                self.finish(r)
                return
            r.append_token_ids(data.draw(st.integers(0, 3), label="token"))
            n = 1
        else:
            n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens), label="chunk")
        before = snapshot(self.m)
        out = self.m.allocate_slots(r, n)
        if n == 1:
            self.scheduled.pop(r.request_id, None)
        elif out is not None:
            self.scheduled[r.request_id] = (r, r.num_computed_tokens + n)
        if out is None:
            event("step: pool full")
            assert snapshot(self.m) == before, "a refused allocation changed state"
            # Like a scheduler: preempt someone (maybe r itself) to make room.
            self.preempt_request(self.pick(data, self.running))
            return
        assert [len(b) for b in out] == [cdiv(r.num_computed_tokens + n, BS)
                                         - cdiv(r.num_computed_tokens, BS)] * self.GROUPS
        self.after_allocation(r, n)

    def finish(self, r: Request) -> None:
        m = self.m
        old_queue = [b.block_id for b in internals(m).pool.free_queue]
        held = [list(t) for t in tables(m, r)]
        shared_tail = [t[r.num_computed_tokens // BS].ref_cnt > 1
                       if r.num_computed_tokens % BS else True for t in held]
        m.free(r)
        del self.running[r.request_id]
        self.scheduled.pop(r.request_id, None)
        # Freed pages join the queue deepest position first (across the groups, in group
        # order at one position): content to the tail, none to the head.
        expected = list(old_queue)
        n = max(len(table) for table in held)
        for i in range(n - 1, -1, -1):
            for b in (table[i] for table in held if i < len(table)):
                if b.ref_cnt == 0:
                    if b.token_ids is not None:
                        expected.append(b.block_id)
                    else:
                        expected.insert(0, b.block_id)
        if self.EVICTION == "lru":
            assert [b.block_id for b in internals(m).pool.free_queue] == expected, "free order"
        else:
            assert sorted(b.block_id for b in internals(m).pool.free_queue) == sorted(expected), "freed"
        # Everything computed stays cached: full blocks, and an unshared partial tail (only
        # indexed when partial hits are on: nothing else would read it).
        n_full = r.num_computed_tokens // BS
        for g, table in enumerate(held):
            for i in range(n_full):
                assert table[i].token_ids == tuple(r.token_ids[i * BS:(i + 1) * BS])
                assert table[i].block_hash == r.block_hashes[i]
            if not shared_tail[g]:
                want = (tuple(r.token_ids[n_full * BS:r.num_computed_tokens])
                        if m.enable_partial_hits else None)
                assert table[n_full].token_ids == want

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.finish(self.pick(data, self.running))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.preempt_request(self.pick(data, self.running))

    def preempt_request(self, r: Request) -> None:
        self.finish(r)
        r.num_computed_tokens = 0
        self.waiting[r.request_id] = r

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def free_unknown(self, data: st.DataObject) -> None:
        r = self.pick(data, self.waiting)
        before = snapshot(self.m)
        with pytest.raises(ValueError):
            self.m.free(r)
        assert snapshot(self.m) == before

    @rule()
    def idle_step(self) -> None:
        assert self.m.take_pending_copies() == []

    @rule()
    def reset_prefix_cache(self) -> None:
        before = snapshot(self.m)
        ok = self.m.reset_prefix_cache()
        assert ok == (not self.running and not self.m.pinned_blocks)
        if ok:
            pool = internals(self.m).pool
            assert pool.num_cached_blocks() == 0 and not pool.index_entries()
        else:
            assert snapshot(self.m) == before

    # ---- invariants --------------------------------------------------------------------------
    def teardown_events(self) -> None:
        s = self.m.stats
        event(f"evictions: {'0' if not s.evictions else '1-4' if s.evictions < 5 else '5+'}")
        event(f"partial hits: {min(s.partial_hits, 4)}")

    @invariant()
    def consistent(self) -> None:
        m = self.m
        check_manager(m)
        self.events.check(m)
        assert set(m.requests) == set(self.running)
        for r in self.running.values():
            for table in tables(m, r):
                assert len(table) == cdiv(r.num_computed_tokens, BS), "tables cover the tokens"
            self.device.check_request(m, r)
        self.device.check_cached(m)
        if not self.running and not m.pinned_blocks:
            assert m.num_free_blocks == m.num_usable_blocks


STATEFUL = settings(max_examples=60, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                    report_multiple_bugs=False)


class OneGroupMachine(ManagerMachine):
    pass


class TwoGroupMachine(ManagerMachine):
    GROUPS = 2
    NUM_BLOCKS = 12


class FullBlockHitsOnlyMachine(ManagerMachine):
    PARTIAL = False


class CollidingHashMachine(ManagerMachine):
    GROUPS = 2
    NUM_BLOCKS = 12
    HASH = staticmethod(degenerate_hash)


class StaleLookupMachine(ManagerMachine):
    EARLY_LOOKUPS = True


TestOneGroup = OneGroupMachine.TestCase
TestOneGroup.settings = STATEFUL
TestTwoGroups = TwoGroupMachine.TestCase
TestTwoGroups.settings = STATEFUL
TestTwoGroups.pytestmark = [pytest.mark.slow]
TestFullBlockHitsOnly = FullBlockHitsOnlyMachine.TestCase
TestFullBlockHitsOnly.settings = STATEFUL
TestFullBlockHitsOnly.pytestmark = [pytest.mark.slow]
TestCollidingHash = CollidingHashMachine.TestCase
TestCollidingHash.settings = STATEFUL
TestCollidingHash.pytestmark = [pytest.mark.slow]
TestStaleLookups = StaleLookupMachine.TestCase
TestStaleLookups.settings = STATEFUL
TestStaleLookups.pytestmark = [pytest.mark.slow]


# =============================================================================================
# Unit tests
# =============================================================================================


class Driver:
    """A minimal scheduler + simulated device around one manager, checking as it goes."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.device = Device()

    def lookup(self, r: Request) -> ComputedBlocks:
        computed = self.m.get_computed_blocks(r)
        check_hit_blocks(self.m, r, computed)
        return computed

    def admit(self, r: Request, n: int | None = None,
              computed: ComputedBlocks | None = None) -> ComputedBlocks | None:
        """Admit and compute n tokens (default: the whole prompt); None if it does not fit."""
        if computed is None:
            computed = self.lookup(r)
        if n is None:
            n = r.num_tokens - computed.num_computed_tokens
        if self.m.allocate_slots(r, n, computed) is None:
            return None
        self.run(r, n)
        return computed

    def step(self, r: Request, n: int = 1) -> bool:
        if self.m.allocate_slots(r, n) is None:
            return False
        self.run(r, n)
        return True

    def decode(self, r: Request, token: int) -> bool:
        r.append_token_ids(token)
        return self.step(r, 1)

    def run(self, r: Request, n: int) -> None:
        self.device.run_copies(self.m.take_pending_copies())
        self.device.forward(self.m, r, n)
        self.check()

    def complete(self, r: Request) -> ComputedBlocks:
        computed = self.admit(r)
        assert computed is not None
        self.m.free(r)
        self.check()
        return computed

    def check(self) -> None:
        check_manager(self.m)
        for r in self.m.requests.values():
            self.device.check_request(self.m, r)
        self.device.check_cached(self.m)


def ids(blocks: Sequence[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# ---- the one-token cap -----------------------------------------------------------------------


def test_fully_cached_prompt_hits_all_but_the_last_token_with_partial_hits() -> None:
    d = Driver(KVCacheManager(config(10)))
    a = Request("a", list(range(8)))
    d.complete(a)
    a_blocks = [b for b in internals(d.m).pool.blocks if b.is_cached]
    assert len(a_blocks) == 2
    b = Request("b", list(range(8)))
    computed = d.lookup(b)
    assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == (4, 3)
    assert d.m.allocate_slots(b, 1, computed) is not None
    assert b.num_computed_tokens == 7
    src = computed.partial_sources[0]
    assert src is not None and src.token_ids == (4, 5, 6, 7)
    table = tables(d.m, b)[0]
    assert table[0] is computed.blocks[0][0] and table[1] is not src
    copies = d.m.take_pending_copies()
    assert copies == [(src.block_id, table[1].block_id)]
    d.device.run_copies(copies)
    assert d.m.stats.partial_hits == 1 and d.m.stats.partial_hit_tokens == 3
    assert d.m.stats.hit_tokens == 7 and d.m.stats.queried_tokens == 16
    d.device.forward(d.m, b, 1)
    d.check()


def test_block_boundary_prompt_recomputes_last_block_without_partial_hits() -> None:
    d = Driver(KVCacheManager(config(10), CacheConfig(enable_partial_hits=False)))
    d.complete(Request("a", list(range(8))))
    b = Request("b", list(range(8)))
    computed = d.lookup(b)
    assert computed.num_computed_tokens == 4 and computed.partial_sources == (None,)
    old_second = [blk for blk in internals(d.m).pool.blocks if blk.token_ids == (4, 5, 6, 7)]
    assert d.admit(b, computed=computed) is not None
    table = tables(d.m, b)[0]
    assert table[0] is computed.blocks[0][0]
    assert table[1] not in old_second, "last block must be recomputed in a fresh block"
    assert d.m.take_pending_copies() == []
    # Not on a boundary: all full blocks hit.
    c = Request("c", list(range(10)))
    d.complete(c)
    e = Request("e", list(range(10)))
    assert d.lookup(e).num_computed_tokens == 8


@pytest.mark.parametrize(("partial", "expected"), [(True, 3), (False, 0)])
def test_single_block_prompt(partial: bool, expected: int) -> None:
    d = Driver(KVCacheManager(config(6), CacheConfig(enable_partial_hits=partial)))
    d.complete(Request("a", [5, 6, 7, 8]))
    again = Request("b", [5, 6, 7, 8])
    assert d.lookup(again).num_computed_tokens == expected
    assert d.admit(again) is not None
    one = Request("c", [5])
    assert d.lookup(one).num_computed_tokens == 0


# ---- salts -----------------------------------------------------------------------------------


def test_salts_isolate_and_same_salt_shares() -> None:
    d = Driver(KVCacheManager(config(20)))
    prompt = list(range(10))
    a = Request("a", prompt, cache_salt="A")
    b = Request("b", prompt, cache_salt="B")
    n = Request("n", prompt)
    for r in (a, b, n):
        computed = d.admit(r)
        assert computed is not None and computed.num_computed_tokens == 0, r
    ta, tb, tn = (set(ids(tables(d.m, r)[0])) for r in (a, b, n))
    assert not (ta & tb) and not (ta & tn) and not (tb & tn)
    assert d.decode(a, 11)  # a's full blocks are cached at its next allocation
    a2 = Request("a2", prompt + [99], cache_salt="A")
    computed = d.admit(a2)
    assert computed is not None and computed.num_computed_tokens == 8
    assert ids(tables(d.m, a2)[0])[:2] == ids(tables(d.m, a)[0])[:2]
    for r in (a, b, n, a2):
        d.m.free(r)
    # Cached but unreferenced: still isolated, partial stretch included.
    for salt, other in (("A", "B"), ("B", None), (None, "A")):
        probe = Request(f"p-{salt}-{other}", prompt[:3], cache_salt=other)
        computed = d.lookup(probe)
        assert all(src is None or src.parent_serial == internals(d.m).pool.root_serial(other)
                   for src in computed.partial_sources)
    c = Request("c", prompt[:6], cache_salt="C")
    assert d.lookup(c).num_computed_tokens == 0
    for salt in ("A", "B", None):
        assert d.lookup(Request(f"q{salt}", prompt[:6], cache_salt=salt)).num_computed_tokens == 5


# ---- forced collisions -----------------------------------------------------------------------

X, Y, Z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]


@pytest.mark.parametrize("hash_fn", [degenerate_hash, parent_only_hash])
@pytest.mark.parametrize("groups", [1, 2])
def test_forced_collisions_never_return_wrong_content(
        hash_fn: Callable[[int, Sequence[int]], int], groups: int) -> None:
    d = Driver(KVCacheManager(config(40, groups), CacheConfig(hash_fn=hash_fn)))
    computed_prefixes: set[tuple[int, ...]] = set()
    prompts = [X + Y + [0], Y + X + [0], X + X + [0], Y + Y + X, X + Z + Y + [0],
               Z + X + [0], X + Y + Z + [1], Y + X + Z + [2], Z + Z + Z, X + [3, 3],
               Y + X + [1, 2], X + Y + Z + X + [7], X + Y + [1, 2]]
    live: list[Request] = []
    for k, prompt in enumerate(prompts):
        r = Request(f"r{k}", prompt)
        computed = d.admit(r)
        assert computed is not None
        hit = tuple(prompt[:computed.num_computed_tokens])
        assert not hit or hit in computed_prefixes, f"{prompt}: hit {hit} never computed"
        computed_prefixes.update(tuple(prompt[:i]) for i in range(1, len(prompt) + 1))
        live.append(r)
        if k % 3 != 2:  # keep some live, so hits land on blocks in use too
            d.m.free(live.pop())
            d.check()
    assert d.m.stats.hit_tokens > 0
    for r in live:
        d.m.free(r)
    d.check()


def test_degenerate_hash_shared_block_in_different_positions() -> None:
    d = Driver(KVCacheManager(config(20), CacheConfig(hash_fn=degenerate_hash)))
    d.complete(Request("a", X + Y + [0]))
    r = Request("b", Y + X + [0])
    computed = d.lookup(r)
    assert computed.num_computed_tokens == 0  # Y at position 0 was never computed
    assert computed.partial_sources == (None,)
    r2 = Request("c", X + X + [0])
    computed = d.lookup(r2)
    assert computed.num_computed_tokens == 4  # X at position 1 (after X) was never computed
    assert d.admit(r2, computed=computed) is not None


# ---- stats -----------------------------------------------------------------------------------


def test_lookups_count_once_per_admission_not_per_retry() -> None:
    d = Driver(KVCacheManager(config(3)))  # two usable blocks
    a = Request("a", list(range(7)))
    assert d.admit(a) is not None
    assert d.decode(a, 7)  # caches a's first block
    assert d.m.stats.lookups == 1 and d.m.stats.queried_tokens == 7
    b = Request("b", [0, 1, 2, 3, 9])
    for _ in range(3):
        before = snapshot(d.m)
        computed = d.m.get_computed_blocks(b)
        assert computed.num_computed_tokens == 4
        assert d.m.allocate_slots(b, 1, computed) is None
        assert snapshot(d.m) == before
    assert d.m.stats.lookups == 1 and d.m.stats.queried_tokens == 7 and d.m.stats.hit_tokens == 0
    d.m.free(a)
    assert d.admit(b) is not None
    assert d.m.stats.lookups == 2 and d.m.stats.queried_tokens == 12
    assert d.m.stats.hit_tokens == 4
    # Steps of a running request are not lookups.
    assert d.decode(b, 1)
    assert d.m.stats.lookups == 2


# ---- bad input -------------------------------------------------------------------------------


@pytest.fixture
def busy() -> tuple[Driver, Request, Request]:
    """A manager with cached content, a live request `a` mid-prefill, and a freed one."""
    d = Driver(KVCacheManager(config(8)))
    freed = Request("freed", [7, 7, 7, 7, 7, 1])
    d.complete(freed)
    a = Request("a", [7, 7, 7, 7, 7, 2, 3, 4, 5, 6])
    assert d.admit(a, n=3) is not None  # hit 5, computed 8 of 10
    d.m.take_pending_copies()
    d.m.take_pending_copies()
    return d, a, freed


BAD_COUNTS: list[Any] = [0, -1, 1.0, "1", None, 2**70 * 1.0]


def test_bad_input_raises_and_changes_nothing(busy: tuple[Driver, Request, Request]) -> None:
    d, a, freed = busy
    m = d.m
    fresh = Request("fresh", [1, 2, 3])
    usable = m.num_usable_blocks
    huge = Request("huge", list(range(BS * usable + 1)))
    clone = Request("a", a.token_ids)  # another request object under a live id
    other = Request("other", [7, 7, 7, 7, 7, 9])
    other_computed = m.get_computed_blocks(other)
    assert other_computed.num_computed_tokens > 0
    a_computed = ComputedBlocks("a", ([],), (None,), 0, 0)
    calls: list[tuple[str, Callable[[], object]]] = [
        ("free unknown", lambda: m.free(Request("ghost", [1]))),
        ("double free", lambda: m.free(freed)),
        ("free non-request", lambda: m.free("a")),  # type: ignore[arg-type]
        ("free clone of live id", lambda: m.free(clone)),
        ("lookup clone of live id", lambda: m.get_computed_blocks(clone)),
        ("allocate clone of live id", lambda: m.allocate_slots(clone, 1)),
        ("lookup non-request", lambda: m.get_computed_blocks(None)),  # type: ignore[arg-type]
        ("allocate non-request", lambda: m.allocate_slots([1, 2], 1)),  # type: ignore[arg-type]
        ("running: too many tokens", lambda: m.allocate_slots(a, 3)),
        ("new: too many tokens", lambda: m.allocate_slots(fresh, 4)),
        ("new: too many after hit", lambda: m.allocate_slots(other, 2, other_computed)),
        ("negative lookahead", lambda: m.allocate_slots(a, 1, num_lookahead_tokens=-1)),
        ("more than the whole pool", lambda: m.allocate_slots(huge, huge.num_tokens)),
        ("lookahead beyond the pool", lambda: m.allocate_slots(
            a, 1, num_lookahead_tokens=BS * usable)),
        ("computed of another request", lambda: m.allocate_slots(fresh, 1, other_computed)),
        ("computed for a running request", lambda: m.allocate_slots(a, 1, a_computed)),
    ]
    for count in BAD_COUNTS:
        calls.append((f"running: num_new_tokens={count!r}", lambda c=count: m.allocate_slots(a, c)))
        calls.append((f"new: num_new_tokens={count!r}", lambda c=count: m.allocate_slots(fresh, c)))
    for what, call in calls:
        before = snapshot(m)
        with pytest.raises((ValueError, TypeError)):
            call()
            pytest.fail(f"{what}: no error")
        assert snapshot(m) == before, f"{what} changed the pool"
        check_manager(m)
    # Everything still works afterwards.
    assert d.step(a, 2)
    assert d.admit(fresh) is not None
    assert d.admit(other, computed=other_computed) is not None


def test_request_needing_more_than_the_pool_is_an_error_not_a_wait() -> None:
    m = KVCacheManager(config(4, groups=2))  # 3 usable blocks; 2 groups
    r = Request("r", list(range(5)))  # 2 blocks per group = 4 > 3
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.allocate_slots(r, 5, m.get_computed_blocks(r))
    assert snapshot(m) == before
    assert m.allocate_slots(r, 4) is not None  # 1 block per group fits
    check_manager(m)


@pytest.mark.parametrize("tokens", [
    [1.5, 2.0], [1, -1], [[1, 2], [3, 4]], [[1], [2, 3]], [], "abc", 5, [2**70],
])
def test_bad_token_ids_rejected(tokens: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        Request("r", tokens)


@pytest.mark.parametrize("tokens", [1.5, -1, [1.5], [-2], [[1]], [2**70], "x"])
def test_bad_appended_token_ids_rejected(busy: tuple[Driver, Request, Request],
                                         tokens: Any) -> None:
    d, a, _ = busy
    before = (list(a.token_ids), snapshot(d.m))
    with pytest.raises((ValueError, TypeError)):
        a.append_token_ids(tokens)
    assert (list(a.token_ids), snapshot(d.m)) == before


def test_bad_request_ids_rejected() -> None:
    for rid in ("", None, 3):
        with pytest.raises((ValueError, TypeError)):
            Request(rid, [1])  # type: ignore[arg-type]


# ---- stale lookups ---------------------------------------------------------------------------


def test_stale_full_hit_evicted_is_rejected() -> None:
    d = Driver(KVCacheManager(config(4)))  # three usable blocks
    d.complete(Request("a", list(range(9))))  # 2 full blocks + 1 partial, all cached
    b = Request("b", list(range(8)) + [50])
    computed = d.lookup(b)
    assert computed.num_computed_tokens == 8
    filler = Request("f", [60] * 12)
    assert d.admit(filler) is not None  # pops every free block: a's content is evicted
    d.m.free(filler)
    before = snapshot(d.m)
    with pytest.raises(ValueError, match="stale"):
        d.m.allocate_slots(b, 1, computed)
    assert snapshot(d.m) == before
    assert d.admit(b) is not None  # a fresh lookup works


def test_stale_partial_source_evicted_is_rejected() -> None:
    d = Driver(KVCacheManager(config(3)))  # two usable blocks
    d.complete(Request("a", [1, 2, 3]))
    b = Request("b", [1, 2, 3, 4])
    computed = d.lookup(b)
    src = computed.partial_sources[0]
    assert computed.num_partial_tokens == 3 and src is not None
    filler = Request("f", [8] * 6)
    assert d.admit(filler, n=5) is not None  # both blocks, src evicted and in use uncached
    assert src.token_ids is None
    before = snapshot(d.m)
    with pytest.raises(ValueError, match="stale"):
        d.m.allocate_slots(b, 1, computed)
    assert snapshot(d.m) == before


def allocate_stale_or_reject(d: Driver, r: Request, computed: ComputedBlocks) -> None:
    """A stale lookup must either be rejected without changes, or give correct content."""
    before = snapshot(d.m)
    try:
        out = d.m.allocate_slots(r, r.num_tokens - computed.num_computed_tokens, computed)
    except ValueError:
        assert snapshot(d.m) == before
        return
    assert out is not None
    d.run(r, r.num_tokens - computed.num_computed_tokens)  # the device check reads r's KV
    check_hit_blocks(d.m, r, computed)


def test_stale_partial_source_recached_with_other_content() -> None:
    d = Driver(KVCacheManager(config(3)))  # two usable blocks
    d.complete(Request("a", [1, 2, 3]))  # block 1: partial (1, 2, 3)
    b = Request("b", [1, 2, 3, 4])
    computed = d.lookup(b)
    src = computed.partial_sources[0]
    assert src is not None and src.token_ids == (1, 2, 3)
    # Block 1 is evicted, reused, and cached again holding other tokens.
    d.complete(Request("x", [8, 8, 8, 8, 8]))
    assert src.token_ids is not None and src.token_ids != (1, 2, 3)
    allocate_stale_or_reject(d, b, computed)


def test_stale_partial_source_recached_under_another_salt() -> None:
    d = Driver(KVCacheManager(config(3)))  # two usable blocks
    d.complete(Request("a", [1, 2, 3]))
    b = Request("b", [1, 2, 3, 4])
    computed = d.lookup(b)
    src = computed.partial_sources[0]
    assert src is not None
    y = Request("y", [6])
    assert d.admit(y) is not None  # takes the empty block; the next pop is the source
    d.complete(Request("x", [1, 2, 3], cache_salt="tenant"))
    d.m.free(y)
    assert src.token_ids == (1, 2, 3)
    assert src.parent_serial == internals(d.m).pool.root_serial("tenant")
    # Same tokens, but now another tenant's block: salt isolation forbids using it.
    allocate_stale_or_reject(d, b, computed)


@pytest.mark.parametrize("hash_fn", [None, degenerate_hash])
def test_stale_full_hit_recached_with_other_content(
        hash_fn: Callable[[int, Sequence[int]], int] | None) -> None:
    d = Driver(KVCacheManager(config(4), CacheConfig(hash_fn=hash_fn or hash_block)))  # three usable blocks
    d.complete(Request("p", [1, 2, 3, 4, 5]))
    q = Request("q", [1, 2, 3, 4, 6])
    computed = d.lookup(q)
    assert computed.num_computed_tokens == 4
    # Every block is reused; the hit block (evicted last) is cached again holding
    # r's third block.
    d.complete(Request("r", [9] * 12))
    assert computed.blocks[0][0].token_ids == (9, 9, 9, 9)
    allocate_stale_or_reject(d, q, computed)


# ---- ordering --------------------------------------------------------------------------------


def test_request_chain_is_evicted_tail_first() -> None:
    d = Driver(KVCacheManager(config(5)))  # four usable blocks
    a = Request("a", list(range(13)))  # 3 full blocks + 1 token
    assert d.admit(a) is not None
    chain = list(tables(d.m, a)[0])
    d.m.free(a)
    d.check()
    assert [b.block_id for b in internals(d.m).pool.free_queue] == ids(chain[::-1]), "not deepest first"
    assert all(b.is_cached for b in chain)
    # Two small requests evict the two deepest blocks; the root and its child remain.
    for k in range(2):
        d.complete(Request(f"f{k}", [90 + k]))
    assert chain[0].is_cached and chain[1].is_cached
    probe = Request("probe", list(range(12)) + [77])
    computed = d.lookup(probe)
    assert computed.num_full_hit_tokens == 8
    assert computed.blocks[0] == chain[:2]


def test_freed_blocks_without_content_are_reused_first() -> None:
    d = Driver(KVCacheManager(config(6)))  # five usable blocks
    a = Request("a", list(range(8)))
    assert d.admit(a) is not None
    a0, a1 = tables(d.m, a)[0]
    d.m.free(a)
    b = Request("b", [50] * 9)
    # 2 tokens computed in 3 blocks (the rest is lookahead).
    assert d.m.allocate_slots(b, 2, d.lookup(b), num_lookahead_tokens=7) is not None
    d.run(b, 2)
    b0, b1, b2 = tables(d.m, b)[0]
    d.m.free(b)  # b0 holds 2 computed tokens (indexed), b1 and b2 hold nothing
    d.check()
    assert b0.token_ids == (50, 50) and b1.token_ids is None and b2.token_ids is None
    assert [blk.block_id for blk in internals(d.m).pool.free_queue] == ids([b1, b2, a1, a0, b0])
    c = Request("c", [60] * 8)
    assert d.admit(c) is not None
    assert tables(d.m, c)[0] == [b1, b2]
    assert a0.is_cached and a1.is_cached and b0.is_cached


def test_two_group_admission_takes_hits_before_popping() -> None:
    """Group 0's copy target must not be popped from group 1's (free) hit or copy source."""
    d = Driver(KVCacheManager(config(7, groups=2)))  # six usable blocks
    a = Request("a", [1, 2, 3, 4, 5, 6])
    c = Request("c", [9, 9, 9, 9])
    assert d.admit(a) is not None and d.admit(c) is not None
    d.m.free(a)
    d.m.free(c)
    d.m.take_pending_copies()
    b = Request("b", [1, 2, 3, 4, 5, 6, 7])
    computed = d.lookup(b)
    assert (computed.num_full_hit_tokens, computed.num_partial_tokens) == (4, 2)
    assert d.admit(b, computed=computed) is not None
    check_hit_blocks(d.m, b, computed)
    for g, src in enumerate(computed.partial_sources):
        assert src is not None and src.group_id == g and src.token_ids == (5, 6)


# ---- preemption, exhaustion, reset, copies ---------------------------------------------------


def test_preempted_request_rehits_its_own_blocks() -> None:
    d = Driver(KVCacheManager(config(8)))
    r = Request("r", [1, 2, 3, 4, 5, 6])
    assert d.admit(r, n=4) is not None
    assert d.step(r, 2)
    for t in (7, 8, 9):
        assert d.decode(r, t)
    assert r.num_computed_tokens == 9
    d.m.free(r)
    r.num_computed_tokens = 0
    computed = d.lookup(r)
    assert computed.num_full_hit_tokens == 8 and computed.num_partial_tokens == 0
    assert d.admit(r, computed=computed) is not None
    assert r.num_computed_tokens == 9


def test_exhausted_pool_changes_nothing() -> None:
    d = Driver(KVCacheManager(config(8, groups=2), CacheConfig(enable_events=True)))  # 7 usable blocks
    d.complete(Request("a", list(range(6))))  # cached: 2 blocks per group
    b = Request("b", [40] * 8)
    assert d.admit(b, n=4) is not None  # 1 block per group
    f = Request("f", [0, 1, 2, 3, 50, 50, 50, 50])
    assert d.admit(f) is not None  # 1 hit + 1 new per group; some cached content evicted
    assert d.m.num_free_blocks == 1
    d.m.take_events()
    c = Request("c", list(range(6)) + [1, 2, 3])
    computed = d.m.get_computed_blocks(c)
    assert computed.num_computed_tokens > 0
    cases = [(c, c.num_tokens - computed.num_computed_tokens, computed), (b, 4, None)]
    for r, n, comp in cases:
        before = snapshot(d.m)
        assert d.m.allocate_slots(r, n, comp) is None
        assert snapshot(d.m) == before and d.m.take_events() == []
    d.check()


def test_reset_prefix_cache_refuses_while_in_use_or_pinned() -> None:
    d = Driver(KVCacheManager(config(8)))
    d.complete(Request("a", [1, 2, 3, 4, 5, 6]))
    b = Request("b", [1, 2, 3, 4, 5, 6, 7])
    assert d.admit(b) is not None  # partial hit: the source stays pinned one more batch
    before = snapshot(d.m)
    assert d.m.reset_prefix_cache() is False and snapshot(d.m) == before
    d.m.free(b)
    assert d.m.pinned_blocks
    before = snapshot(d.m)
    assert d.m.reset_prefix_cache() is False and snapshot(d.m) == before
    assert d.m.take_pending_copies() == []
    assert not d.m.pinned_blocks
    assert d.m.reset_prefix_cache() is True
    assert internals(d.m).pool.num_cached_blocks() == 0 and internals(d.m).pool.index_entries() == []
    assert d.lookup(Request("c", [1, 2, 3, 4, 5, 6, 7])).num_computed_tokens == 0
    d.check()


def test_take_pending_copies_releases_the_previous_batch() -> None:
    m = KVCacheManager(config(8))
    d = Driver(m)
    d.complete(Request("a", [1, 2, 3]))
    b = Request("b", [1, 2, 3, 4])
    computed = m.get_computed_blocks(b)
    src = computed.partial_sources[0]
    assert src is not None
    assert m.allocate_slots(b, 1, computed) is not None
    assert src.pin_cnt == 1 and src.ref_cnt == 1 and src not in list(internals(m).pool.free_queue)
    copies = m.take_pending_copies()
    assert copies == [(src.block_id, tables(m, b)[0][0].block_id)]
    assert src.pin_cnt == 1, "released before the worker ran the copy"
    check_manager(m)
    assert m.take_pending_copies() == []
    assert src.pin_cnt == 0 and src.ref_cnt == 0 and src.is_cached
    assert list(internals(m).pool.free_queue)[-1] is src
    check_manager(m)


# ---- the API hands out ids and read-only views -----------------------------------------------


def test_allocate_slots_returns_read_only_block_ids() -> None:
    m = KVCacheManager(config(12, groups=2))
    r = Request("r", list(range(10)))
    out = m.allocate_slots(r, 6, m.get_computed_blocks(r))
    assert out is not None
    # Per group, a tuple of int ids: the pages appended to the table, which is all of it here.
    assert isinstance(out, tuple) and all(isinstance(ids, tuple) for ids in out)
    assert all(type(i) is int for ids in out for i in ids)
    assert out == m.block_table("r")
    with pytest.raises(TypeError):
        out[0][0] = 99  # type: ignore[index]
    r.num_computed_tokens = 6
    grown = m.allocate_slots(r, 4)
    assert grown is not None and [len(ids) for ids in grown] == [1, 1]
    assert all(table[-1:] == ids for table, ids in zip(m.block_table("r"), grown, strict=True))
    # Nothing new: an empty tuple per group.
    r.num_computed_tokens = 10
    r.append_token_ids(7)
    assert m.allocate_slots(r, 1) == ((), ())
    check_manager(m)


def test_admit_and_grow_are_the_two_halves_of_allocate_slots() -> None:
    m = KVCacheManager(config(10))
    r = Request("r", list(range(7)))
    with pytest.raises(ValueError, match="admit it first"):
        m.grow(r, 1)
    assert m.admit(r, 4, m.get_computed_blocks(r)) is not None
    with pytest.raises(ValueError, match="already admitted"):
        m.admit(r, 1)
    r.num_computed_tokens = 4
    assert m.grow(r, 3) is not None
    assert m.block_table("r") == (tuple(ids(tables(m, r)[0])),)
    check_manager(m)


def test_accessors_report_the_pool_and_the_tables() -> None:
    specs = [SPEC_A, SlidingWindowSpec(BS, 1, 8, window=BS)]
    m = KVCacheManager(make_kv_cache_config(specs, num_blocks=20), CacheConfig(hold_window_pages=False))
    assert m.num_usable_blocks == 19 and m.num_free_blocks == 19
    assert m.blocks_in_use_by_group() == (0, 0)
    r = Request("r", list(range(14)))
    assert m.allocate_slots(r, 14, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 14
    r.append_token_ids(1)
    assert m.allocate_slots(r, 1) is not None  # the window drops blocks 0 and 1 of the sliding group
    assert m.table_lengths("r") == (4, 4)
    assert m.num_resident_blocks("r") == (4, 2)
    assert m.blocks_in_use_by_group() == (4, 2)
    assert m.num_free_blocks == 19 - 6
    assert m.group_usage() == [4 / 19, 2 / 19]
    for accessor in (m.block_table, m.table_lengths, m.num_resident_blocks):
        with pytest.raises(ValueError, match="unknown request"):
            accessor("ghost")
    # The live requests, read-only.
    assert dict(m.requests) == {"r": r}
    with pytest.raises(TypeError):
        m.requests["x"] = r  # type: ignore[index]


def test_block_states_is_a_snapshot() -> None:
    m = KVCacheManager(config(6))
    r = Request("r", list(range(6)))
    assert m.allocate_slots(r, 6, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 6
    live = m.block_states()
    assert [s.block_id for s in live] == [1, 2, 3, 4, 5]
    table = m.block_table("r")[0]
    for s in live:
        assert (s.ref_cnt > 0) == (s.block_id in table)
        assert not s.is_cached and s.block_hash is None and s.pin_cnt == 0
    m.free(r)
    after = {s.block_id: s for s in m.block_states()}
    full, tail = table
    assert after[full].is_cached and after[full].block_hash == r.block_hashes[0]
    assert after[tail].is_cached and after[tail].block_hash is None  # a partial block
    assert all(s.ref_cnt == 0 for s in after.values())
    # The earlier snapshot did not change.
    assert all(s.ref_cnt == 1 for s in live if s.block_id in table)


def test_stats_and_pins_are_copies() -> None:
    m = KVCacheManager(config(8))
    d = Driver(m)
    d.complete(Request("a", [1, 2, 3]))
    stats = m.stats
    stats.lookups = 1000
    assert m.stats.lookups == 1
    b = Request("b", [1, 2, 3, 4])
    assert d.admit(b, n=1) is not None
    # The partial hit pinned its source and destination until the worker has run the copy.
    src, dst = m.pinned_blocks
    assert dst == m.block_table("b")[0][0] and src != dst
    assert m.stats.copies_queued == 1


def test_hash_function_is_passed_in() -> None:
    calls: list[int] = []

    def counting(parent: int, tokens: Sequence[int]) -> int:
        calls.append(len(tokens))
        return hash_block(parent, tokens)

    m = KVCacheManager(config(10), CacheConfig(hash_fn=counting))
    assert m.hash_fn is counting
    r = Request("r", list(range(9)))
    m.get_computed_blocks(r)
    assert calls == [BS, BS] and r.hash_fn is counting
    # A request already hashed with another function cannot be used with this cache.
    other = Request("o", list(range(9)))
    other.update_block_hashes(BS, hash_block)
    with pytest.raises(ValueError, match="hash function"):
        m.get_computed_blocks(other)
    # A fork keeps its parent's hashes and their function.
    assert m.allocate_slots(r, 9, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 9
    child = r.fork("c")
    m.fork(r, child)
    assert child.hash_fn is counting and child.block_hashes == r.block_hashes


def test_a_request_larger_than_the_pool_raises_request_too_large() -> None:
    m = KVCacheManager(config(4))  # 3 usable blocks
    r = Request("r", list(range(4 * BS)))
    with pytest.raises(RequestTooLargeError) as info:
        m.allocate_slots(r, r.num_tokens, m.get_computed_blocks(r))
    assert info.value.blocks_needed == 4 and info.value.blocks_available == 3


# ---- hits in flight --------------------------------------------------------------------------
def test_a_request_admitted_in_the_step_computing_its_prefix_hits_those_pages() -> None:
    m = KVCacheManager(config(20, 2), CacheConfig(enable_partial_hits=False))
    prompt = list(range(100, 100 + 3 * BS + 2))
    a = Request("a", prompt)
    assert m.admit(a, a.num_tokens, m.get_computed_blocks(a)) is not None
    b = Request("b", prompt[:3 * BS] + [7, 8, 9])
    before = snapshot(m)
    hit = m.get_computed_blocks(b)
    assert snapshot(m) == before, "the lookup indexed something"
    # A's three full blocks are filled by this step's forward: b takes them, not cached yet.
    assert hit.num_computed_tokens == 3 * BS and hit.inflight is a
    assert hit.num_inflight_blocks == 3 and hit.parent_serials == (hit.parent_serials[0],)
    assert m.admit(b, b.num_tokens - hit.num_computed_tokens, hit) is not None
    for g in range(2):
        assert m.block_table("b")[g][:3] == m.block_table("a")[g][:3]
    # Admitting indexed them as a's blocks: a third prompt finds them cached.
    c = Request("c", prompt[:2 * BS] + [1])
    found = m.get_computed_blocks(c)
    assert found.num_computed_tokens == 2 * BS and found.inflight is None
    check_manager(m)
    a.num_computed_tokens = a.num_tokens
    m.free(a)
    check_manager(m)


def test_no_hit_in_flight_under_another_salt_or_past_a_divergence() -> None:
    m = KVCacheManager(config(20), CacheConfig(enable_partial_hits=False))
    prompt = list(range(40, 40 + 3 * BS + 1))
    a = Request("a", prompt)
    assert m.admit(a, 2 * BS + 1, m.get_computed_blocks(a)) is not None  # a chunk of 2 blocks
    assert m.get_computed_blocks(Request("s", prompt, cache_salt="t")).num_computed_tokens == 0
    diverged = prompt[:BS] + [0] + prompt[BS + 1:]
    assert m.get_computed_blocks(Request("d", diverged)).num_computed_tokens == BS
    # Only the blocks the chunk fills: the third is not scheduled.
    assert m.get_computed_blocks(Request("e", prompt)).num_computed_tokens == 2 * BS
    # A decode step ends a's prefill: nothing of it is in flight any more once cached.
    a.num_computed_tokens = 2 * BS + 1
    assert m.grow(a, BS) is not None
    a.num_computed_tokens = a.num_tokens
    a.append_token_ids(5)
    assert m.grow(a, 1) is not None
    hit = m.get_computed_blocks(Request("f", prompt + [5, 6]))
    assert hit.num_computed_tokens == 3 * BS and hit.inflight is None
    check_manager(m)


def admit_prefill(m: KVCacheManager, prompt: list[int]) -> Request:
    """Admit `a` on `prompt`, its whole prefill scheduled (the step not run yet)."""
    a = Request("a", prompt)
    assert m.admit(a, a.num_tokens, m.get_computed_blocks(a)) is not None
    return a


def admit_in_flight(m: KVCacheManager, prompt: list[int], other: list[int]) -> Request:
    """Admit `a` on `prompt`, its whole prefill scheduled, then `b` on `other` with a hit in
    flight of two blocks of a's pages; returns a."""
    a = admit_prefill(m, prompt)
    b = Request("b", other)
    hit = m.get_computed_blocks(b)
    assert hit.inflight is a and hit.num_partial_tokens == 0
    assert m.admit(b, b.num_tokens - hit.num_computed_tokens, hit) is not None
    assert b.num_computed_tokens == 2 * BS
    return a


def test_free_before_the_step_ran_is_refused_while_a_hit_in_flight_holds_its_pages() -> None:
    m = KVCacheManager(config(20), CacheConfig(enable_partial_hits=False))
    prompt = list(range(70, 70 + 2 * BS + 1))
    a = admit_in_flight(m, prompt, prompt)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match="before its step ran"):
        m.free(a)
    assert snapshot(m) == before
    a.num_computed_tokens = a.num_tokens  # the step ran: now a may go
    m.free(a)
    check_manager(m)


def test_a_step_that_never_ran_leaves_nothing_of_a_hit_in_flight_in_the_index() -> None:
    m = KVCacheManager(config(20), CacheConfig(enable_partial_hits=False, enable_events=True))
    prompt = list(range(50, 50 + 2 * BS + 1))
    a = admit_in_flight(m, prompt, prompt)
    b = m.requests["b"]
    m.take_events()
    # The step raised: its requests end, the one admitted on a's pages first (as the engine
    # does), with nothing of the step computed.
    b.num_computed_tokens = 0
    m.free(b)
    m.free(a)
    assert m.get_computed_blocks(Request("c", prompt)).num_computed_tokens == 0
    assert m.stats.evictions == 0
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2  # a's two blocks, indexed for b's hit, leave the index
    check_manager(m)


def test_two_hits_in_flight_on_the_same_pages_then_a_step_that_never_ran() -> None:
    m = KVCacheManager(config(20), CacheConfig(enable_partial_hits=False))
    prompt = list(range(60, 60 + 2 * BS + 1))
    a = admit_prefill(m, prompt)
    b, c = Request("b", prompt), Request("c", prompt[:2 * BS] + [7])
    hits = [m.get_computed_blocks(r) for r in (b, c)]  # both looked up before either is admitted
    assert all(hit.inflight is a and hit.num_computed_tokens == 2 * BS for hit in hits)
    for r, hit in zip((b, c), hits, strict=True):
        assert m.admit(r, r.num_tokens - hit.num_computed_tokens, hit) is not None
    for r in (c, b):  # the step raised: latest scheduled first, nothing computed
        r.num_computed_tokens = 0
        m.free(r)
    a.num_computed_tokens = 0
    m.free(a)
    assert m.get_computed_blocks(Request("d", prompt)).num_computed_tokens == 0
    check_manager(m)


def test_a_page_in_flight_is_no_copy_source_until_its_request_computed_it() -> None:
    m = KVCacheManager(config(20))
    prompt = list(range(10, 10 + 2 * BS + 1))
    a = admit_in_flight(m, prompt, prompt[:2 * BS] + [1])
    # a's block 1 is indexed now, but not written: a prompt sharing part of it copies nothing.
    c = Request("c", prompt[:BS + 2] + [0, 0, 0])
    hit = m.get_computed_blocks(c)
    assert hit.num_full_hit_tokens == BS and hit.num_partial_tokens == 0
    a.num_computed_tokens = a.num_tokens  # the step ran
    hit = m.get_computed_blocks(c)
    assert hit.num_full_hit_tokens == BS and hit.num_partial_tokens == 2
    check_manager(m)


def test_a_stale_hit_in_flight_is_refused() -> None:
    m = KVCacheManager(config(20), CacheConfig(enable_partial_hits=False))
    prompt = list(range(90, 90 + 2 * BS + 1))
    a = admit_prefill(m, prompt)
    b = Request("b", prompt)
    hit = m.get_computed_blocks(b)
    assert hit.inflight is a
    a.num_computed_tokens = 0  # preempted before its step (no hit took its pages yet)
    m.free(a)
    before = snapshot(m)
    with pytest.raises(ValueError, match="stale"):
        m.admit(b, b.num_tokens - hit.num_computed_tokens, hit)
    assert snapshot(m) == before
    assert m.get_computed_blocks(b).num_computed_tokens == 0


def test_a_prefill_chunk_inside_the_pages_it_has_is_in_flight_too() -> None:
    m = KVCacheManager(config(8))
    a = Request("a", [7, 7, 7, 7], cache_salt="t")
    assert m.allocate_slots(a, 1, m.get_computed_blocks(a)) is not None  # a page for 4 tokens
    a.num_computed_tokens = 1
    assert m.allocate_slots(a, 1) == ((),)
    a.num_computed_tokens = 2
    # A chunk of 2 needs no page (it fills the one a has) and completes it in this step.
    assert m.allocate_slots(a, 2) == ((),)
    hit = m.get_computed_blocks(Request("b", [7, 7, 7, 7, 7], cache_salt="t"))
    assert hit.num_computed_tokens == 4 and hit.inflight is a
