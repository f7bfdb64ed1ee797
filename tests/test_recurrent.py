"""Recurrent groups beside full and sliding-window groups: hits only where a checkpoint of
exactly the prefix exists, and a simulated device that checks every hit restores the state
a from-scratch run has at that position (a state is modelled as the salt and the prefix)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import (
    EventMirror,
    check_two_size_pool,
    checkpoint_order,
    internals,
    spy_evictions,
    working_state,
)

from kvstore.block_pool import ADMIT_DECAY, TwoSizeBlockPool
from kvstore.eviction import EVICTION_POLICIES, WorthCheckpoints
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, RecurrentStateSpec, SlidingWindowSpec, make_kv_cache_config

BS = 4
FULL = FullAttentionSpec(BS, 1, 8, "float32")  # 256 bytes a block (K and V)
WINDOW = SlidingWindowSpec(BS, 1, 8, "float32", window=6)
STATE = RecurrentStateSpec(BS, ((2, 40),), "float32")  # 320 bytes: 2 blocks of 256 (1 slot)
FAMILIES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
            [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23, 24, 25, 26, 27],
            [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]]


def make(layers: list, num_blocks: int, **cache: object) -> KVCacheManager:
    config = make_kv_cache_config(layers, num_blocks=num_blocks)
    return KVCacheManager(config, CacheConfig(**cache))  # type: ignore[arg-type]


def state_of(req: Request, n: int) -> tuple[object, ...]:
    """What a from-scratch run of the request holds in its state after n tokens."""
    return (req.cache_salt, tuple(req.token_ids[:n]))


class RecurrentMachine(RuleBasedStateMachine):
    """A scheduler's calls on a cache with a recurrent group, and a simulated device."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.pages: dict[int, list[object]] = {}  # block id -> token per slot
        self.states: dict[int, object] = {}  # large page id -> state
        self.next_id = 0
        # The copies handed out last: the worker may still be running them.
        self.handed_out: list[tuple[int, int]] = []
        self.events = EventMirror()

    @initialize(layout=st.sampled_from(["full", "full+window", "window"]),
                num_large=st.integers(4, 14), every=st.sampled_from([0, 0, 1, 2]),
                eviction=st.sampled_from(sorted(EVICTION_POLICIES)),
                hold=st.booleans())
    def setup(self, layout: str, num_large: int, every: int, eviction: str, hold: bool) -> None:
        layers: list[object] = {"full": [FULL, STATE], "full+window": [FULL, WINDOW, STATE],
                                "window": [WINDOW, STATE]}[layout]
        self.manager = make(layers, 2 * num_large, checkpoint_every_blocks=every, eviction=eviction,
                            hold_window_pages=hold, enable_events=True)
        for salt in (None, "tenant"):
            internals(self.m).pool.root_serial(salt)

    @property
    def m(self) -> KVCacheManager:
        assert self.manager is not None
        return self.manager

    @property
    def pool(self) -> TwoSizeBlockPool:
        pool = internals(self.m).pool
        assert isinstance(pool, TwoSizeBlockPool)
        return pool

    def recurrent_group(self) -> int:
        return next(g for g, group in enumerate(self.m.config.groups) if group.is_recurrent)

    def working(self, req: Request) -> int:
        return self.m.block_table(req.request_id)[self.recurrent_group()][0]

    # ---- device ------------------------------------------------------------------------------
    def run_copies(self) -> None:
        n = self.pool.num_blocks
        self.handed_out = list(self.m.take_pending_copies())
        for src, dst in self.handed_out:
            if src >= n:
                assert dst >= n, "a state copied into a block"
                assert src in self.states, f"copy from large page {src}, never written"
                self.states[dst] = self.states[src]
            else:
                assert dst < n
                self.pages[dst] = list(self.pages[src])

    def forward(self, req: Request, start: int, end: int) -> None:
        """The model reads the working state (which must be the state at `start`), then
        writes K/V of [start, end) and leaves the state at `end`."""
        g_rec = self.recurrent_group()
        ids = self.m.block_table(req.request_id)
        working = ids[g_rec][0]
        if start:
            assert self.states.get(working) == state_of(req, start), (
                f"{req.request_id}: working state at {start} is {self.states.get(working)!r:.80}")
        self.states[working] = state_of(req, end)
        for g, table in enumerate(ids):
            if g == g_rec:
                continue
            for p in range(start, end):
                bid = table[p // BS]
                assert bid != 0
                self.pages.setdefault(bid, [None] * BS)[p % BS] = req.token_ids[p]

    def check_content(self) -> None:
        g_rec = self.recurrent_group()
        for req in self.running.values():
            nc = req.num_computed_tokens
            for g, (group, table) in enumerate(zip(self.m.config.groups,
                                                   self.m.block_table(req.request_id),
                                                   strict=True)):
                if g == g_rec:
                    continue
                window = group.spec.sliding_window
                first = 0 if window is None else max(0, nc - window + 1)
                for p in range(first, nc):
                    page = self.pages.get(table[p // BS])
                    assert page is not None and page[p % BS] == req.token_ids[p]

    def snapshot(self) -> tuple[object, ...]:
        pool = self.pool
        return (pool.block_states(), pool.large_page_states(), pool.free_list_sizes(),
                pool.stats.evictions, tuple(self.m.pinned_blocks))

    # ---- a step ------------------------------------------------------------------------------
    def step(self, req: Request, num_new: int, computed: ComputedBlocks | None,
             data: st.DataObject) -> bool:
        m = self.m
        nc = computed.num_computed_tokens if computed is not None else req.num_computed_tokens
        stops = m.next_checkpoints(req, num_new) if computed is None else []
        assert all(nc < p <= nc + num_new for p in stops)
        if stops and data.draw(st.booleans(), label="stop at a checkpoint"):
            num_new = stops[0] - nc
        before = self.snapshot()
        try:
            out = m.allocate_slots(req, num_new, computed)
        except ValueError as e:
            assert "whole pool" in str(e)
            assert self.snapshot() == before
            return False
        if out is None:
            assert self.snapshot() == before, "a refused allocation changed the pool"
            return False
        if computed is not None:
            self.running[req.request_id] = req
            nc = req.num_computed_tokens
        self.run_copies()
        self.forward(req, nc, nc + num_new)
        req.num_computed_tokens = nc + num_new
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < 30:
            req.append_token_ids(99)
        return True

    def draw_request(self, data: st.DataObject) -> Request:
        family = data.draw(st.sampled_from(FAMILIES), label="family")
        n = data.draw(st.integers(0, len(family)), label="prefix")
        suffix = data.draw(st.lists(st.integers(50, 52), min_size=0 if n else 1, max_size=6))
        salt = data.draw(st.sampled_from([None, None, "tenant"]), label="salt")
        req = Request(f"r{self.next_id}", family[:n] + suffix, cache_salt=salt)
        self.next_id += 1
        return req

    def admit(self, req: Request, data: st.DataObject) -> bool:
        m = self.m
        before = self.snapshot()
        computed = m.get_computed_blocks(req)
        assert self.snapshot() == before
        hit = computed.num_computed_tokens
        assert computed.num_partial_tokens == 0
        g_rec = self.recurrent_group()
        rec = computed.blocks[g_rec]
        if hit:
            # Hits only at a checkpoint of exactly this prefix.
            page = rec[-1]
            assert self.pool.is_large(page) and all(b.block_id == 0 for b in rec[:-1])
            assert page.block_hash == req.block_hashes[hit // BS - 1]
            assert page.token_ids == tuple(req.token_ids[hit - BS:hit])
        event(f"recurrent hit {bool(hit)}")
        num_new = data.draw(st.integers(1, req.num_tokens - hit), label="num_new")
        admitted = self.step(req, num_new, computed, data)
        if admitted and hit:
            event("a hit restored a checkpoint")
        return admitted

    # ---- rules -------------------------------------------------------------------------------
    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        req = self.draw_request(data)
        if not self.admit(req, data):
            return
        decode = data.draw(st.integers(0, 6), label="decode")
        while req.num_computed_tokens < min(req.num_tokens, req.num_prompt_tokens + decode):
            left = req.num_tokens - req.num_computed_tokens
            if not self.step(req, data.draw(st.integers(1, left)), None, data):
                return
        self.m.free(self.running.pop(req.request_id))

    @rule(data=st.data())
    def admit_new(self, data: st.DataObject) -> None:
        self.admit(self.draw_request(data), data)

    @rule(data=st.data())
    def admit_from_a_tier(self, data: st.DataObject) -> None:
        """Admit past the device hit on whole blocks a tier supplies: the caller fills their
        pages and loads the state at their end into the working state (which holds nothing
        before that: no checkpoint may copy it)."""
        m = self.m
        req = self.draw_request(data)
        computed = m.get_computed_blocks(req)
        start = computed.num_full_hit_tokens
        room = (req.num_tokens - 1 - start) // BS
        if room < 1:
            return
        end = start + data.draw(st.integers(1, room), label="tier blocks") * BS
        num_new = data.draw(st.integers(1, req.num_tokens - end), label="num_new")
        before = self.snapshot()
        try:
            ids = m.admit(req, num_new, computed, num_external_tokens=end - start)
        except ValueError as e:
            assert "whole pool" in str(e)
            assert self.snapshot() == before
            return
        if ids is None:
            assert self.snapshot() == before, "a refused admission changed the pool"
            return
        assert req.num_computed_tokens == end
        self.running[req.request_id] = req
        self.states[self.working(req)] = "not loaded"
        self.run_copies()
        assert all(self.states.get(dst) != "not loaded" for _, dst in self.handed_out), (
            "a checkpoint copied a working state not loaded yet")
        self.states[self.working(req)] = state_of(req, end)
        g_rec = self.recurrent_group()
        for g, table in enumerate(m.block_table(req.request_id)):
            if g != g_rec:
                for p in range(start, end):
                    if table[p // BS]:
                        self.pages.setdefault(table[p // BS], [None] * BS)[p % BS] = req.token_ids[p]
        event("admitted from a tier")
        self.forward(req, end, end + num_new)
        req.num_computed_tokens = end + num_new

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        if self.admit(req, data):
            self.waiting.remove(req)

    @precondition(lambda self: any(r.num_computed_tokens < r.num_tokens
                                   for r in self.running.values()))
    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        live = [r for r in self.running.values() if r.num_computed_tokens < r.num_tokens]
        req = data.draw(st.sampled_from(live))
        self.step(req, data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens)),
                  None, data)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.m.free(self.running.pop(rid))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        req = self.running.pop(rid)
        self.m.free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        parent = self.running[rid]
        child = parent.fork(f"r{self.next_id}")
        self.next_id += 1
        before = self.snapshot()
        if self.pool.num_free_large_pages == 0:
            with pytest.raises(RuntimeError, match="large pages"):
                self.m.fork(parent, child)
            assert self.snapshot() == before
            return
        self.m.fork(parent, child)
        self.running[child.request_id] = child
        assert self.working(child) != self.working(parent)

    @rule()
    def worker_copies(self) -> None:
        self.run_copies()

    @invariant()
    def consistent(self) -> None:
        if self.manager is None:
            return
        self.events.check(self.m)
        small: Counter[int] = Counter()
        large: Counter[int] = Counter()
        n = self.pool.num_blocks
        for rid in self.m.requests:
            for ids in self.m.block_table(rid):
                for i in ids:
                    if i >= n:
                        large[i] += 1
                    elif i:
                        small[i] += 1
        rec = internals(self.m).coordinator.recurrent[0]
        for rid in self.m.requests:
            page = working_state(rec, rid)
            if page is not None:
                large[page.block_id] += 1
        for i in self.m.pinned_blocks:
            (large if i >= n else small)[i] += 1
        check_two_size_pool(self.pool, small, large)
        # No page of a copy the worker may still be running is free (whoever let go of it).
        refs = {b.block_id: b.ref_cnt for b in self.pool.block_states()}
        refs.update((p[0], p[3]) for p in self.pool.large_page_states())
        for src, dst in self.handed_out:
            assert refs[src] > 0 and refs[dst] > 0, f"copy {src} -> {dst} lost a page"
        stats = self.pool.stats
        assert stats.checkpoints_taken - stats.checkpoints_evicted == sum(
            1 for p in self.pool.large_blocks if p.token_ids is not None)
        assert stats.checkpoints_used == stats.recurrent_hits <= stats.lookups
        # A working state is never cached nor shared.
        for rid in self.m.requests:
            page = self.pool.large_blocks[self.working(self.m.requests[rid]) - n]
            assert page.token_ids is None and large[page.block_id] - page.pin_cnt == 1
        self.check_content()

    def teardown(self) -> None:
        if self.manager is None:
            return
        for req in list(self.running.values()):
            self.m.free(req)
        self.run_copies()
        self.run_copies()
        check_two_size_pool(self.pool, Counter(), Counter())
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        assert self.m.reset_prefix_cache()


RecurrentMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestRecurrentCache = RecurrentMachine.TestCase
TestRecurrentCache.pytestmark = [pytest.mark.slow]  # about a minute: CI runs it


# ---- fixed cases ---------------------------------------------------------------------------------
def run(m: KVCacheManager, req: Request, chunks: list[int]) -> ComputedBlocks:
    computed = m.get_computed_blocks(req)
    first = True
    for n in chunks:
        assert m.allocate_slots(req, n, computed if first else None) is not None
        m.take_pending_copies()
        req.num_computed_tokens = (computed.num_computed_tokens if first
                                   else req.num_computed_tokens) + n
        first = False
    return computed


def test_hit_at_a_checkpoint_only_and_at_attention_block_granularity() -> None:
    m = make([FULL, STATE], num_blocks=60)
    a = Request("a", list(range(10)))
    run(m, a, [10])
    m.free(a)
    # One step from 0 to 10 passes the prompt-end checkpoint (8) and ends off a block boundary:
    # no checkpoint, no hit, though the attention blocks are cached.
    b = Request("b", list(range(10)) + [77])
    assert m.get_computed_blocks(b).num_computed_tokens == 0
    c = Request("c", list(range(10)))
    assert m.next_checkpoints(c, 10) == [8]
    run(m, c, [8, 2])  # the scheduler stops the chunk at the checkpoint
    m.free(c)
    d = Request("d", list(range(10)) + [77])
    computed = m.get_computed_blocks(d)
    assert computed.num_computed_tokens == 8  # 2 blocks of 4: no inflated block
    assert m.allocate_slots(d, 3, computed) is not None
    copies = m.take_pending_copies()
    assert copies and all(src >= 60 and dst >= 60 for src, dst in copies)


def test_checkpoint_at_the_output_end_serves_the_next_turn() -> None:
    m = make([FULL, WINDOW, STATE], num_blocks=60)
    turn = Request("t1", [5, 6, 7])
    run(m, turn, [3])
    for _ in range(6):  # decode to 10 tokens: boundary 8 is kept for the output's end
        turn.append_token_ids(1)
        run_grow = m.allocate_slots(turn, 1)
        assert run_grow is not None
        m.take_pending_copies()
        turn.num_computed_tokens += 1
    m.free(turn)
    m.take_pending_copies()
    nxt = Request("t2", turn.token_ids[:9] + [3, 3, 3])
    assert m.get_computed_blocks(nxt).num_computed_tokens == 8


@pytest.mark.parametrize("handed_out", [False, True])
def test_the_output_end_copy_pins_its_pages_only_once_the_request_lets_go(handed_out: bool) -> None:
    """The request lets go with its copy still queued, or handed out to the worker (which
    may be running it): the pins hold both pages until the batch after the copy's."""
    m = make([FULL, STATE], num_blocks=60)
    turn = Request("t", [5, 6, 7])
    run(m, turn, [3])
    for _ in range(2):  # computed 3 -> 4 -> 5: the step from 4 keeps the state at 4
        turn.append_token_ids(1)
        assert m.allocate_slots(turn, 1) is not None
        if turn.num_computed_tokens < 4:
            m.take_pending_copies()
            turn.num_computed_tokens += 1
    g = next(g for g, group in enumerate(m.config.groups) if group.is_recurrent)
    working = m.block_table("t")[g][0]
    assert m.pinned_blocks == ()  # both pages are the request's while it holds them
    pool = internals(m).pool
    assert isinstance(pool, TwoSizeBlockPool)

    def refs(page_id: int) -> int:
        return next(ref for pid, _, _, ref, _ in pool.large_page_states() if pid == page_id)

    batch = m.take_pending_copies() if handed_out else None
    m.free(turn)  # before the worker ran (or finished) the copy: its pins hold the pages now
    assert len(m.pinned_blocks) == 2 and working in m.pinned_blocks
    rolling = next(p for p in m.pinned_blocks if p != working)
    assert refs(working) == refs(rolling) == 1
    check_two_size_pool(pool, Counter(), Counter(m.pinned_blocks))
    if not handed_out:
        batch = m.take_pending_copies()
        assert refs(working) == refs(rolling) == 1  # the worker runs the batch now
    assert batch == [(working, rolling)]
    assert m.take_pending_copies() == []
    assert refs(working) == refs(rolling) == 0 and m.pinned_blocks == ()
    check_two_size_pool(pool, Counter(), Counter())


def test_a_window_beside_a_recurrent_group_frees_dropped_pages_first() -> None:
    """A sliding window's pages of a finished request: those its window dropped while it
    ran stay where they were freed, so an eviction for an unrelated request takes them
    first, in the order they were dropped, before the pages the request held to its end."""
    m = make([WINDOW, STATE], num_blocks=24, eviction="lru", checkpoint_every_blocks=4)
    a = Request("a", list(range(1, 33)))
    run(m, a, [4] * 8)
    held = [b for b in m.block_table("a")[0] if b]  # the pages in its table at its end
    m.free(a)
    m.take_pending_copies()
    m.take_pending_copies()
    pool = internals(m).pool
    evicted: list[tuple[int, int]] = []  # (position, page id)
    spy_evictions(pool, lambda block: evicted.append((block.token_ids[0] // BS, block.block_id))
                  if block.group_id == 0 and block.token_ids[0] < 33 else None)
    f = Request("f", [1000 + j for j in range(44)])
    assert m.allocate_slots(f, 44, m.get_computed_blocks(f)) is not None
    assert evicted and not {page for _, page in evicted} & set(held)
    positions = [position for position, _ in evicted]
    assert positions == sorted(positions) and positions[0] == 0  # as the window dropped them


def test_a_prompt_is_admitted_when_its_blocks_and_working_state_fit() -> None:
    """A recurrent group takes a working state (a large page of 2 blocks here), no page per
    block: 10 blocks of prompt and the state fit 15 free blocks; 14 blocks and the state
    do not."""
    m = make([FULL, STATE], num_blocks=16)
    assert m.num_free_blocks == 15
    fits = Request("fits", list(range(40)))
    assert m.allocate_slots(fits, 40, m.get_computed_blocks(fits)) is not None
    m.free(fits)
    m.take_pending_copies()
    m.take_pending_copies()
    too_long = Request("too_long", list(range(100, 156)))
    assert m.allocate_slots(too_long, 56, m.get_computed_blocks(too_long)) is None


def test_salted_requests_do_not_hit_each_others_checkpoints() -> None:
    m = make([FULL, STATE], num_blocks=60)
    a = Request("a", list(range(12)), cache_salt="x")
    run(m, a, [8, 4])
    m.free(a)
    assert m.get_computed_blocks(Request("b", list(range(12)))).num_computed_tokens == 0
    assert m.get_computed_blocks(Request("c", list(range(12)),
                                         cache_salt="x")).num_computed_tokens == 8


def test_every_n_blocks_and_a_branch_point() -> None:
    m = make([FULL, STATE], num_blocks=90, checkpoint_every_blocks=1)
    a = Request("a", list(range(16)))
    assert m.next_checkpoints(a, 16) == [4, 8, 12, 16]
    run(m, a, [4, 4, 4, 4])
    m.free(a)
    for n in (4, 8, 12):
        assert m.get_computed_blocks(Request(f"q{n}", list(range(n)) + [99])
                                     ).num_computed_tokens == n
    # Without every-N: a lookup whose verified chain ends past its hit plans a checkpoint there.
    m = make([FULL, STATE], num_blocks=90)
    a = Request("a", list(range(16)))
    run(m, a, [16])  # attention blocks cached, no checkpoint inside the prompt
    m.free(a)
    b = Request("b", list(range(8)) + [50, 51, 52, 53, 54])
    assert m.next_checkpoints(b, 13) == [12]  # its prompt's end only, before the lookup
    computed = m.get_computed_blocks(b)
    assert computed.num_computed_tokens == 0 and computed.num_verified_tokens == 8
    assert m.next_checkpoints(b, 13, computed) == [8, 12]  # with the lookup's branch point
    assert m.allocate_slots(b, 8, computed) is not None
    with pytest.raises(ValueError, match="admitted already"):
        m.next_checkpoints(b, 5, computed)
    b.num_computed_tokens = 8
    assert m.allocate_slots(b, 5) is not None  # the checkpoint at the branch point is taken
    m.take_pending_copies()
    b.num_computed_tokens = 13
    m.free(b)
    c = Request("c", list(range(8)) + [70, 71])
    assert m.get_computed_blocks(c).num_computed_tokens == 8


def test_without_a_recurrent_group_nothing_changes() -> None:
    m = make([FULL, WINDOW], num_blocks=20)
    assert not isinstance(internals(m).pool, TwoSizeBlockPool)
    r = Request("a", list(range(9)))
    assert m.next_checkpoints(r, 9) == [] and m.fragmented_bytes == 0


def test_bad_checkpoint_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="checkpoint_every_blocks"):
        CacheConfig(checkpoint_every_blocks=-1)


def test_events_name_the_group_and_its_kind_and_stats_count_checkpoints() -> None:
    from kvstore.block_pool import BlockRemoved, BlockStored

    m = make([FULL, WINDOW, STATE], num_blocks=24, enable_events=True, eviction="worth")
    kinds = [group.kind for group in m.config.groups]
    assert sorted(kinds) == ["full", "recurrent", "sliding"]
    a = Request("a", list(range(10)))
    run(m, a, [8, 2])  # the prompt-end checkpoint at 8
    m.free(a)
    m.take_pending_copies()
    stored = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert {(e.group_id, e.kind) for e in stored} == set(enumerate(kinds))
    rec = kinds.index("recurrent")
    assert [e.block_hash for e in stored if e.kind == "recurrent"] == [a.block_hashes[1]]
    stats = m.stats
    assert (stats.checkpoints_taken, stats.checkpoints_used, stats.recurrent_hits) == (1, 0, 0)
    b = Request("b", list(range(8)) + [60, 61])
    run(m, b, [2])
    assert m.stats.recurrent_hits == 1 and m.stats.checkpoints_used == 1
    m.free(b)
    m.take_pending_copies()
    m.take_events()
    # A long unrelated prompt needs every page: the checkpoint is evicted.
    c = Request("c", list(range(100, 164)))
    run(m, c, [4] * 16)
    m.free(c)
    m.take_pending_copies()
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert (a.block_hashes[1], rec, "recurrent") in {(e.block_hash, e.group_id, e.kind)
                                                    for e in removed}
    stats = m.stats
    assert 1 <= stats.checkpoints_evicted <= stats.evictions
    assert stats.checkpoints_taken - stats.checkpoints_evicted == sum(
        1 for p in internals(m).pool.large_blocks if p.token_ids is not None)  # type: ignore[attr-defined]


def test_by_default_a_recurrent_layout_evicts_by_worth_and_others_by_lru() -> None:
    assert CacheConfig().eviction is None
    recurrent = internals(make([FULL, STATE], num_blocks=90)).pool
    assert recurrent.free_queue.name == "worth"
    assert isinstance(checkpoint_order(recurrent), WorthCheckpoints)
    assert internals(make([FULL, FULL], num_blocks=90)).pool.free_queue.name == "lru"
    chosen = internals(make([FULL, STATE], num_blocks=90, eviction="lru")).pool
    assert chosen.free_queue.name == "lru"
    assert not isinstance(checkpoint_order(chosen), WorthCheckpoints)


def worth_manager() -> tuple[KVCacheManager, WorthCheckpoints, int]:
    """A full + recurrent manager evicting by worth, its pool's checkpoint order, and the
    blocks a large page spans."""
    m = make([FULL, STATE], num_blocks=90, eviction="worth")
    pool = internals(m).pool
    assert isinstance(pool, TwoSizeBlockPool)
    order = checkpoint_order(pool)
    assert isinstance(order, WorthCheckpoints)
    return m, order, pool.large_page_blocks


def test_a_checkpoint_is_worth_the_tokens_since_the_last_one_its_request_knew() -> None:
    m, order, k = worth_manager()
    a = Request("a", list(range(20)))
    run(m, a, [16, 4])  # the prompt's end: 16 (from 0), then 20 at its end (from 16)
    m.free(a)
    m.take_pending_copies()
    assert order.clock == 0
    # 16 is an interior point of one cached chain now (a computed past it): worth nothing.
    assert sorted(order.priority(p) for p in order) == [0, 4 / k]
    b = Request("b", list(range(16)) + list(range(50, 58)))
    computed = run(m, b, [4, 4])  # hits 16; its prompt's end: 20 and 24
    assert computed.num_computed_tokens == 16
    m.free(b)
    m.take_pending_copies()
    # The hit gave 16 its worth back, and two chains continue there now; b's 20 is the
    # interior point of b's chain.
    assert sorted(order.priority(p) for p in order) == [0, 4 / k, 4 / k, 16 / k]


def test_a_checkpoint_its_request_computed_past_is_worth_nothing_until_hit() -> None:
    m, order, k = worth_manager()
    a = Request("a", list(range(8)))
    run(m, a, [8])  # prompt end 8: taken at the next step's start
    a.append_token_ids([40, 41, 42, 43, 44])
    assert m.allocate_slots(a, 4) is not None  # the checkpoint at 8 is taken
    m.take_pending_copies()
    a.num_computed_tokens = 12
    m.free(a)  # its output's end, 12, is indexed: 8 is an interior point of one chain now
    m.take_pending_copies()
    assert {p.block_hash: order.priority(p) for p in order} == {
        a.block_hashes[1]: 0.0, a.block_hashes[2]: 4 / k}
    # A hit on it makes it worth its tokens again once freed.
    b = Request("b", list(range(8)) + [70, 71])
    assert run(m, b, [2]).num_computed_tokens == 8
    m.free(b)
    m.take_pending_copies()
    assert sorted(order.priority(p) for p in order) == [4 / k, 8 / k]


def test_a_lookup_that_wanted_a_stale_checkpoint_keeps_checkpoints_longer() -> None:
    m = make([FULL, STATE], num_blocks=40, eviction="worth")
    pool = internals(m).pool
    assert isinstance(pool, TwoSizeBlockPool)
    a = Request("a", list(range(8)))
    run(m, a, [8])  # the prompt's end (8) is a checkpoint no hit has used
    m.free(a)
    m.take_pending_copies()
    assert pool.stale_after == pool.num_blocks
    for _ in range(pool.num_blocks):  # its capacity handed out, free empty blocks only
        pool.free_blocks(pool.get_new_blocks(1, 0))
    assert pool.stats.evictions == 0
    k = pool.large_page_blocks
    empty = pool.num_free_blocks - k * len(checkpoint_order(pool)) - 2  # a's 2 blocks cached
    taken = pool.get_new_blocks(empty + 1, 0)  # one more than the free empty blocks
    assert pool.stats.checkpoints_evicted == 1 and pool.stats.evictions == 1
    pool.free_blocks(taken)
    check_two_size_pool(pool)
    # a's attention blocks are cached, its checkpoint gone: the lookup wanted it.
    b = Request("b", list(range(8)) + [99])
    assert m.get_computed_blocks(b).num_computed_tokens == 0
    assert pool.stale_after == 2 * pool.num_blocks and not pool.stale_evicted


def serve_prompt(m: KVCacheManager, req: Request) -> int:
    """Look up, compute the prompt in chunks stopping at checkpoint positions, free; the
    lookup's hit tokens."""
    computed: ComputedBlocks | None = m.get_computed_blocks(req)
    assert computed is not None
    hit = nc = computed.num_computed_tokens
    while nc < req.num_prompt_tokens:
        stops = m.next_checkpoints(req, req.num_prompt_tokens - nc, computed)
        end = stops[0] if stops else req.num_prompt_tokens
        assert m.allocate_slots(req, end - nc, computed) is not None
        m.take_pending_copies()
        req.num_computed_tokens = nc = end
        computed = None
    m.free(req)
    m.take_pending_copies()
    return hit


def test_prompt_ends_never_hit_stop_taking_room_from_a_shared_prefix() -> None:
    m = make([FULL, STATE], num_blocks=24, eviction="worth")
    pool = internals(m).pool
    assert isinstance(pool, TwoSizeBlockPool)
    shared = list(range(8))
    reqs = [Request(f"r{i}", shared + [1000 * i + j for j in range(6)]) for i in range(40)]
    hits = [serve_prompt(m, req) for req in reqs]
    # The shared prefix's branch point is hit by every request after the first two; the
    # one-off prompts' ends (12) were evicted unhit, so later ones are refused (remembered).
    assert hits[2:] == [8] * 38
    refused = [req for req in reqs if req.block_hashes[2] in pool.refused]
    assert refused and pool.stats.checkpoints_taken < 38
    assert pool.stats.checkpoints_refused >= len(refused)
    settled, hit_count = pool.admission["prompt_end"]
    assert settled >= 8 and hit_count == 0
    check_two_size_pool(pool)
    # With a tier listening to released pages, the pool takes every optional checkpoint.
    m.set_release_listener(lambda released: None)
    assert pool.tiered
    m.set_release_listener(None)
    assert not pool.tiered
    # A lookup wanting a refused one settles it as a hit.
    again = Request("again", refused[-1].token_ids + [5])
    assert m.get_computed_blocks(again).num_computed_tokens == 8  # no checkpoint at 12
    assert pool.admission["prompt_end"] == (settled * ADMIT_DECAY + 1, 1)
    assert refused[-1].block_hashes[2] not in pool.refused
    check_two_size_pool(pool)
