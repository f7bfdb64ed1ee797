"""BlockPool and FreeBlockQueue: model-based state machines plus unit tests of LRU order,
lazy eviction, the prefix-cache indexes and events."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import check_pool, queued_events

from kvstore import block_pool
from kvstore.block import FreeBlockQueue, KVCacheBlock
from kvstore.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from kvstore.utils import common_prefix_len

BS = 4  # tokens in a full block in these tests (the pool itself is agnostic)
TOKENS = st.integers(0, 2)  # a tiny alphabet, so equal and overlapping contents are common

STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def pool_snapshot(pool: BlockPool) -> dict[str, Any]:
    """Everything observable about a pool's state, for "nothing changed" assertions."""
    return {
        "blocks": [(b.ref_cnt, b.pin_cnt, b.group_id, b.block_hash, b.token_ids, b.serial,
                    b.parent_serial) for b in pool.blocks],
        "queue": [b.block_id for b in pool.free_queue],
        "num_free": pool.num_free_blocks,
        "hash_entries": sorted(pool.hash_entries()),
        "index_entries": sorted(pool.index_entries()),
        "in_use_by_group": {g: n for g, n in pool.in_use_by_group.items() if n},
        "stats": pool.stats.as_dict(),
        "events": queued_events(pool),
    }


def full(*tokens: int) -> tuple[int, ...]:
    assert len(tokens) == BS
    return tuple(tokens)


def cached_chain(pool: BlockPool, n: int, group: int = 0, salt: str | None = None,
                 first_token: int = 0) -> list[KVCacheBlock]:
    """Allocate n blocks and cache them as one chain (as a request would); still in use."""
    blocks = pool.get_new_blocks(n, group)
    parent = pool.root_serial(salt)
    for i, block in enumerate(blocks):
        tokens = full(*range(first_token + i * BS, first_token + (i + 1) * BS))
        parent = pool.cache_full_block(block, hash((parent, tokens)), tokens, parent)
    return blocks


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


# =============================================================================================
# FreeBlockQueue against a list
# =============================================================================================


class FreeBlockQueueMachine(RuleBasedStateMachine):
    """The intrusive queue behaves like a Python list of block ids, links included."""

    N = 10

    def __init__(self) -> None:
        super().__init__()
        self.blocks = [KVCacheBlock(i) for i in range(self.N + 1)]  # index = block id
        self.queue = FreeBlockQueue()
        self.model: list[int] = []

    @initialize(ids=st.lists(st.integers(1, N), unique=True, max_size=N))
    def init(self, ids: list[int]) -> None:
        self.queue = FreeBlockQueue(self.blocks[i] for i in ids)
        self.model = list(ids)

    def absent(self) -> list[int]:
        return [i for i in range(1, self.N + 1) if i not in self.model]

    @precondition(lambda self: self.model)
    @rule()
    def popleft(self) -> None:
        assert self.queue.popleft() is self.blocks[self.model.pop(0)]

    @precondition(lambda self: not self.model)
    @rule()
    def popleft_empty(self) -> None:
        with pytest.raises(IndexError):
            self.queue.popleft()

    @rule(data=st.data())
    def popleft_n(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(0, len(self.model)), label="n")
        got = self.queue.popleft_n(n)
        assert [b.block_id for b in got] == self.model[:n]
        del self.model[:n]

    @rule(extra=st.integers(1, 3))
    def popleft_n_too_many(self, extra: int) -> None:
        with pytest.raises(IndexError):
            self.queue.popleft_n(len(self.model) + extra)

    @precondition(lambda self: len(self.model) < self.N)
    @rule(data=st.data(), left=st.booleans())
    def append(self, data: st.DataObject, left: bool) -> None:
        i = data.draw(st.sampled_from(self.absent()), label="block")
        if left:
            self.queue.appendleft(self.blocks[i])
            self.model.insert(0, i)
        else:
            self.queue.append(self.blocks[i])
            self.model.append(i)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), left=st.booleans())
    def append_present(self, data: st.DataObject, left: bool) -> None:
        i = data.draw(st.sampled_from(self.model), label="block")
        with pytest.raises(ValueError):
            (self.queue.appendleft if left else self.queue.append)(self.blocks[i])

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.model), label="block")
        self.queue.remove(self.blocks[i])
        self.model.remove(i)

    @precondition(lambda self: len(self.model) < self.N)
    @rule(data=st.data())
    def remove_absent(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.absent()), label="block")
        with pytest.raises(ValueError):
            self.queue.remove(self.blocks[i])

    @invariant()
    def matches_model(self) -> None:
        assert [b.block_id for b in self.queue] == self.model
        assert len(self.queue) == len(self.model)
        for i in self.absent():
            b = self.blocks[i]
            assert b.prev_free is None and b.next_free is None, f"block {i} left linked"
        # Backward links agree with forward order.
        if self.model:
            back = []
            node: KVCacheBlock | None = self.blocks[self.model[-1]]
            while node is not None and node.block_id > 0:
                back.append(node.block_id)
                node = node.prev_free
            assert node is not None and node.block_id == -1, "backward walk missed the head"
            assert back == self.model[::-1]
            assert self.blocks[self.model[-1]].next_free is not None
            assert self.blocks[self.model[-1]].next_free.block_id == -2  # type: ignore[union-attr]


TestFreeBlockQueue = FreeBlockQueueMachine.TestCase
TestFreeBlockQueue.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestFreeBlockQueue.pytestmark = [pytest.mark.slow]


def test_queue_initial_order_and_fifo() -> None:
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [1, 2, 3, 4, 5]
    q.remove(blocks[2])
    q.append(blocks[2])
    q.appendleft(q.popleft_n(2)[1])
    assert [b.block_id for b in q] == [2, 4, 5, 3]
    assert len(q) == 4


def test_queue_popleft_n_negative_is_rejected() -> None:
    q = FreeBlockQueue([KVCacheBlock(i) for i in range(1, 4)])
    with pytest.raises((ValueError, IndexError)):
        q.popleft_n(-1)
    assert len(q) == 3 and [b.block_id for b in q] == [1, 2, 3]


# =============================================================================================
# BlockPool against a model
# =============================================================================================


class BlockPoolMachine(RuleBasedStateMachine):
    """get_new_blocks / touch / free_blocks / cache_* / queries / reset against a model of
    references, free-queue order, indexed content and events."""

    NUM_BLOCKS = 9
    GROUPS = (0, 1)

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(self.NUM_BLOCKS, enable_events=True)
        self.refs: Counter[int] = Counter()
        self.holdings: list[list[KVCacheBlock]] = []
        self.queue: list[int] = list(range(1, self.NUM_BLOCKS))
        self.group: dict[int, int] = {}
        # block id -> (group, parent serial, tokens, hash or None for partial, serial)
        self.content: dict[int, tuple[int, int, tuple[int, ...], int | None, int]] = {}
        self.events: list[KVCacheEvent] = []
        self.evictions = 0
        self.roots = [self.pool.root_serial(None), self.pool.root_serial("salt")]
        assert len(set(self.roots)) == 2
        assert self.pool.root_serial(None) == self.roots[0]  # stable
        self.serials: set[int] = set(self.roots)

    # ---- helpers -----------------------------------------------------------------------------
    def in_use(self) -> list[int]:
        return sorted(b for b, n in self.refs.items() if n > 0)

    def writable(self) -> list[int]:
        return [b for b in self.in_use() if b not in self.content]

    def block(self, block_id: int) -> KVCacheBlock:
        return self.pool.blocks[block_id]

    # ---- allocation --------------------------------------------------------------------------
    @rule(n=st.integers(0, 4), group=st.sampled_from(GROUPS))
    def get_new_blocks(self, n: int, group: int) -> None:
        if n > len(self.queue):
            before = pool_snapshot(self.pool)
            with pytest.raises(RuntimeError):
                self.pool.get_new_blocks(n, group)
            assert pool_snapshot(self.pool) == before
            return
        got = self.pool.get_new_blocks(n, group)
        assert [b.block_id for b in got] == self.queue[:n], "not popped from the head"
        del self.queue[:n]
        for b in got:
            old = self.content.pop(b.block_id, None)
            if old is not None:
                self.evictions += 1
                if old[3] is not None:
                    self.events.append(BlockRemoved(old[3], old[0]))
            assert b.token_ids is None and b.block_hash is None
            self.refs[b.block_id] = 1
            self.group[b.block_id] = group
        if got:
            self.holdings.append(got)

    @precondition(lambda self: self.content or self.in_use())
    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        """A hit (on cached blocks, free or not) or a pin (on blocks in use)."""
        candidates = sorted(set(self.content) | set(self.in_use()))
        ids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=3), label="ids")
        blocks = [self.block(i) for i in ids]
        self.pool.touch(blocks)
        for i in ids:
            if self.refs[i] == 0:
                self.queue.remove(i)  # out of the middle
            self.refs[i] += 1
        self.holdings.append(blocks)

    @rule()
    def touch_null(self) -> None:
        before = pool_snapshot(self.pool)
        with pytest.raises(ValueError):
            self.pool.touch([self.pool.null_block])
        assert pool_snapshot(self.pool) == before

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def free_blocks(self, data: st.DataObject) -> None:
        """Release one holder's blocks, deepest first."""
        h = self.holdings.pop(data.draw(st.integers(0, len(self.holdings) - 1), label="holder"))
        self.pool.free_blocks(reversed(h))
        for b in reversed(h):
            self.refs[b.block_id] -= 1
            if self.refs[b.block_id] == 0:
                if b.block_id in self.content:
                    self.queue.append(b.block_id)
                else:
                    self.queue.insert(0, b.block_id)

    @precondition(lambda self: self.queue)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from(self.queue), label="block")
        before = pool_snapshot(self.pool)
        with pytest.raises(RuntimeError):
            self.pool.free_blocks([self.block(i)])
        assert pool_snapshot(self.pool) == before

    # ---- caching -----------------------------------------------------------------------------
    @precondition(lambda self: self.writable())
    @rule(data=st.data(), tokens=st.tuples(*[TOKENS] * BS), block_hash=st.integers(0, 2),
          parent_hash=st.none() | st.integers(0, 2))
    def cache_full_block(self, data: st.DataObject, tokens: tuple[int, ...], block_hash: int,
                         parent_hash: int | None) -> None:
        i = data.draw(st.sampled_from(self.writable()), label="block")
        parent = data.draw(st.sampled_from(sorted(self.serials)), label="parent serial")
        g = self.group[i]
        # Equal content: same group, parent, tokens and hash (a hash also covers extra keys,
        # e.g. an adapter, so equal tokens under another hash are other content).
        twins = {c[4] for c in self.content.values()
                 if c[0] == g and c[1] == parent and c[2] == tokens and c[3] == block_hash}
        assert len(twins) <= 1, "equal content under one parent must share one serial"
        serial = self.pool.cache_full_block(self.block(i), block_hash, tokens, parent, parent_hash)
        if twins:
            assert serial == twins.pop()
        else:
            assert serial not in self.serials, "a fresh content got a used serial"
        self.serials.add(serial)
        self.content[i] = (g, parent, tokens, block_hash, serial)
        self.events.append(BlockStored(block_hash, parent_hash, tokens, g))

    @precondition(lambda self: self.writable())
    @rule(data=st.data(), tokens=st.lists(TOKENS, min_size=1, max_size=BS - 1))
    def cache_partial_block(self, data: st.DataObject, tokens: list[int]) -> None:
        i = data.draw(st.sampled_from(self.writable()), label="block")
        parent = data.draw(st.sampled_from(sorted(self.serials)), label="parent serial")
        self.pool.cache_partial_block(self.block(i), tuple(tokens), parent)
        self.content[i] = (self.group[i], parent, tuple(tokens), None, 0)

    @precondition(lambda self: self.content)
    @rule(data=st.data(), partial=st.booleans())
    def cache_twice(self, data: st.DataObject, partial: bool) -> None:
        i = data.draw(st.sampled_from(sorted(self.content)), label="block")
        before = pool_snapshot(self.pool)
        with pytest.raises(RuntimeError):
            if partial:
                self.pool.cache_partial_block(self.block(i), (1,), self.roots[0])
            else:
                self.pool.cache_full_block(self.block(i), 0, (1,) * BS, self.roots[0])
        assert pool_snapshot(self.pool) == before

    # ---- queries (pure) ----------------------------------------------------------------------
    @rule(data=st.data(), group=st.sampled_from(GROUPS), block_hash=st.integers(0, 2),
          random_tokens=st.tuples(*[TOKENS] * BS))
    def find_cached(self, data: st.DataObject, group: int, block_hash: int,
                    random_tokens: tuple[int, ...]) -> None:
        fulls = [c for c in self.content.values() if c[3] is not None]
        tokens = random_tokens
        if fulls and data.draw(st.booleans(), label="existing tokens"):
            tokens = data.draw(st.sampled_from(fulls), label="entry")[2]
        parent = data.draw(st.sampled_from(sorted(self.serials)), label="parent")
        before = pool_snapshot(self.pool)
        got = self.pool.find_cached(group, block_hash, list(tokens), parent)
        every = self.pool.cached_blocks(group, block_hash, list(tokens))
        assert pool_snapshot(self.pool) == before
        matching = {i for i, c in self.content.items()
                    if c[0] == group and c[3] == block_hash and c[2] == tokens}
        assert {b.block_id for b in every} == matching
        ok = {i for i in matching if self.content[i][1] == parent}
        if ok:
            assert got is not None and got.block_id in ok
        else:
            assert got is None

    @rule(data=st.data(), group=st.sampled_from(GROUPS),
          query=st.lists(TOKENS, max_size=BS).map(tuple))
    def longest_partial_match(self, data: st.DataObject, group: int,
                              query: tuple[int, ...]) -> None:
        parent = data.draw(st.sampled_from(sorted(self.serials)), label="parent")
        before = pool_snapshot(self.pool)
        got, n = self.pool.longest_partial_match(group, parent, query)
        assert pool_snapshot(self.pool) == before
        lens = {i: common_prefix_len(c[2], query) for i, c in self.content.items()
                if c[0] == group and c[1] == parent}
        best = max(lens.values(), default=0)
        assert n == best
        if best == 0:
            assert got is None
        else:
            assert got is not None and lens.get(got.block_id) == best

    # ---- reset -------------------------------------------------------------------------------
    @rule()
    def reset_prefix_cache(self) -> None:
        before = pool_snapshot(self.pool)
        ok = self.pool.reset_prefix_cache()
        assert ok == (not self.in_use())
        if not ok:
            assert pool_snapshot(self.pool) == before
            return
        self.content.clear()
        self.events.append(AllBlocksCleared())
        assert self.pool.num_cached_blocks() == 0 and not self.pool.index_entries()

    # ---- invariants --------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self) -> None:
        pool = self.pool
        check_pool(pool, Counter({b: n for b, n in self.refs.items() if n}))
        assert queue_ids(pool) == self.queue
        for i in range(1, self.NUM_BLOCKS):
            b = pool.blocks[i]
            if i in self.group:
                assert b.group_id == self.group[i]
            c = self.content.get(i)
            if c is None:
                assert b.token_ids is None and b.block_hash is None
            else:
                assert (b.group_id, b.parent_serial, b.token_ids, b.block_hash) == c[:4]
                if c[3] is not None:
                    assert b.serial == c[4]
        assert pool.num_cached_blocks() == sum(c[3] is not None for c in self.content.values())
        assert pool.stats.evictions == self.evictions
        assert pool.take_events() == self.events
        self.events = []
        assert pool.usage == pytest.approx(1 - len(self.queue) / (self.NUM_BLOCKS - 1))


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = STATEFUL
TestBlockPoolMachine.pytestmark = [pytest.mark.slow]


# =============================================================================================
# Unit tests
# =============================================================================================


def test_pool_rejects_too_small() -> None:
    with pytest.raises(ValueError):
        BlockPool(1)


def test_fresh_pool() -> None:
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    assert queue_ids(pool) == [1, 2, 3, 4]
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    check_pool(pool, Counter())


def test_lru_least_recently_freed_cached_block_is_evicted_first() -> None:
    pool = BlockPool(4)  # three usable blocks, all of them cached below
    a, b, c = (cached_chain(pool, 1, first_token=10 * k)[0] for k in range(3))
    for block in (b, a, c):  # free order b, a, c
        pool.free_blocks([block])
    assert queue_ids(pool) == [b.block_id, a.block_id, c.block_id]
    assert pool.get_new_blocks(1, 0) == [b]
    assert b.token_ids is None and a.is_cached and c.is_cached
    assert pool.get_new_blocks(1, 0) == [a]
    assert pool.get_new_blocks(1, 0) == [c]
    assert pool.stats.evictions == 3
    check_pool(pool, Counter({a.block_id: 1, b.block_id: 1, c.block_id: 1}))


def test_chain_freed_deepest_first_is_evicted_tail_first() -> None:
    pool = BlockPool(5)
    chain = cached_chain(pool, 4)
    pool.free_blocks(reversed(chain))
    assert queue_ids(pool) == [b.block_id for b in reversed(chain)]
    # Evicting one block at a time drops the deepest first; the root survives longest.
    for k in range(4):
        victim = pool.get_new_blocks(1, 0)[0]
        assert victim is chain[3 - k]
        remaining = chain[:3 - k]
        assert all(b.is_cached for b in remaining)
        # The remaining prefix is still a findable chain.
        parent = pool.root_serial(None)
        for b in remaining:
            assert b.token_ids is not None and b.block_hash is not None
            assert pool.find_cached(0, b.block_hash, b.token_ids, parent_serial=parent) is b
            parent = b.serial


def test_uncached_free_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(5)
    (cached,) = cached_chain(pool, 1)
    (plain,) = pool.get_new_blocks(1, 0)
    pool.free_blocks([cached])
    pool.free_blocks([plain])
    # Uncached goes to the head, cached to the tail.
    assert queue_ids(pool) == [plain.block_id, 3, 4, cached.block_id]
    got = pool.get_new_blocks(3, 0)
    assert [b.block_id for b in got] == [plain.block_id, 3, 4]
    assert cached.is_cached and pool.stats.evictions == 0
    assert queue_ids(pool) == [cached.block_id]


def test_uncached_blocks_freed_together_keep_head_order() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3, 0)
    pool.free_blocks(reversed(blocks))  # deepest first; each goes to the head
    assert queue_ids(pool)[:3] == [b.block_id for b in blocks]


def test_hit_on_free_cached_block_pulls_it_out_of_the_middle() -> None:
    pool = BlockPool(4)
    x, a, y = (cached_chain(pool, 1, first_token=10 * k)[0] for k in range(3))
    pool.free_blocks([x])
    pool.free_blocks([a])
    pool.free_blocks([y])
    assert queue_ids(pool) == [x.block_id, a.block_id, y.block_id]
    assert a.block_hash is not None and a.token_ids is not None
    assert pool.cached_blocks(0, a.block_hash, a.token_ids) == [a]  # lazily evicted: still there
    pool.touch([a])
    assert a.ref_cnt == 1 and a.is_cached
    assert queue_ids(pool) == [x.block_id, y.block_id]
    assert pool.in_use_by_group[0] == 1
    check_pool(pool, Counter({a.block_id: 1}))
    # Popping now skips the hit block.
    assert pool.get_new_blocks(2, 0) == [x, y]
    assert a.is_cached
    pool.free_blocks([a])
    assert queue_ids(pool) == [a.block_id]


def test_touch_block_in_use_only_counts() -> None:
    pool = BlockPool(4)
    (a,) = cached_chain(pool, 1)
    pool.touch([a, a])
    assert a.ref_cnt == 3 and queue_ids(pool) == [2, 3]
    pool.free_blocks([a, a])
    assert a.ref_cnt == 1 and queue_ids(pool) == [2, 3]
    pool.free_blocks([a])
    assert queue_ids(pool) == [2, 3, a.block_id]


def test_lazy_eviction_drops_index_entries_and_emits_events() -> None:
    pool = BlockPool(3, enable_events=True)
    root = pool.root_serial(None)
    a, b = pool.get_new_blocks(2, 1)
    ta, tb = full(1, 2, 3, 4), full(5, 6, 7, 8)
    sa = pool.cache_full_block(a, 111, ta, root, None)
    pool.cache_partial_block(b, (5, 6), sa)
    assert pool.take_events() == [BlockStored(111, None, ta, 1)]
    assert pool.take_events() == []
    pool.free_blocks([b, a])
    # Free but still indexed.
    assert pool.find_cached(1, 111, ta, parent_serial=root) is a
    assert pool.longest_partial_match(1, sa, (5, 6, 9)) == (b, 2)
    assert pool.take_events() == []
    assert queue_ids(pool) == [b.block_id, a.block_id]
    # Reuse both (in group 0): evicted on pop.
    got = pool.get_new_blocks(2, 0)
    assert got == [b, a]
    assert pool.cached_blocks(1, 111, ta) == []
    assert pool.longest_partial_match(1, sa, (5, 6)) == (None, 0)
    assert pool.hash_entries() == [] and pool.index_entries() == []
    assert pool.take_events() == [BlockRemoved(111, 1)]  # partial blocks are not announced
    assert pool.stats.evictions == 2
    assert all(blk.group_id == 0 and blk.serial == 0 and blk.parent_serial == 0 for blk in got)
    # Cache b fully now and reset.
    pool.cache_full_block(b, 222, tb, root, None)
    pool.free_blocks(got)
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [BlockStored(222, None, tb, 0), AllBlocksCleared()]
    check_pool(pool, Counter())


def test_dropped_since_names_the_pages_dropped_and_forgets_across_a_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BlockPool(4)
    a, b = cached_chain(pool, 2)
    epoch = pool.cache_epoch
    assert pool.dropped_since(epoch) == []
    pool.free_blocks([b, a])
    pool.get_new_blocks(3, 0)  # the empty page first, then both cached ones, evicted
    assert pool.dropped_since(epoch) == [b.block_id, a.block_id]
    assert pool.dropped_since(pool.cache_epoch) == []
    pool.free_blocks(pool.blocks[1:])
    assert pool.reset_prefix_cache()
    assert pool.dropped_since(epoch) is None  # the reset dropped content it does not list
    assert pool.dropped_since(pool.cache_epoch) == []
    # Past the pages it keeps, the older half is forgotten: lookups that old are redone.
    monkeypatch.setattr(block_pool, "_DROPPED_KEPT", 4)
    start = pool.cache_epoch
    for _ in range(6):
        chain = cached_chain(pool, 1)
        pool.free_blocks(chain)
        pool.free_blocks(pool.get_new_blocks(3, 0))
    assert pool.dropped_since(start) is None
    assert pool.dropped_since(pool.cache_epoch - 1) == [chain[0].block_id]


def test_events_off_records_nothing() -> None:
    pool = BlockPool(3)
    (a,) = cached_chain(pool, 1)
    pool.free_blocks([a])
    pool.get_new_blocks(2, 0)
    assert pool.take_events() == []


def test_reset_refuses_while_blocks_in_use_and_changes_nothing() -> None:
    pool = BlockPool(5, enable_events=True)
    chain = cached_chain(pool, 2)
    (plain,) = pool.get_new_blocks(1, 0)
    pool.free_blocks(reversed(chain))
    pool.take_events()
    before = pool_snapshot(pool)
    assert pool.reset_prefix_cache() is False
    assert pool_snapshot(pool) == before
    pool.free_blocks([plain])
    order = queue_ids(pool)
    assert pool.reset_prefix_cache() is True
    assert queue_ids(pool) == order
    assert pool.num_cached_blocks() == 0 and pool.index_entries() == []
    assert all(not b.is_cached and b.block_hash is None for b in pool.blocks)
    assert pool.take_events() == [AllBlocksCleared()]
    # Reused blocks are not counted as evictions after a reset.
    pool.get_new_blocks(4, 0)
    assert pool.stats.evictions == 0


def test_get_new_blocks_too_many_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.get_new_blocks(1, 0)
    before = pool_snapshot(pool)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(3, 0)
    assert pool_snapshot(pool) == before


def test_get_new_blocks_negative_is_rejected() -> None:
    pool = BlockPool(4)
    before = pool_snapshot(pool)
    with pytest.raises((ValueError, RuntimeError, IndexError)):
        pool.get_new_blocks(-1, 0)
    assert pool_snapshot(pool) == before


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1, 0)
    pool.free_blocks([a])
    before = pool_snapshot(pool)
    with pytest.raises(RuntimeError):
        pool.free_blocks([a])
    assert pool_snapshot(pool) == before


def test_equal_content_under_one_parent_shares_a_serial() -> None:
    pool = BlockPool(6)
    root = pool.root_serial(None)
    a, b, c, d = pool.get_new_blocks(4, 0)
    t = full(1, 1, 2, 2)
    sa = pool.cache_full_block(a, 7, t, root)
    assert pool.cache_full_block(b, 7, t, root) == sa  # twin
    assert pool.cache_full_block(c, 7, t, pool.root_serial("x")) != sa  # other parent
    assert pool.cache_full_block(d, 8, full(1, 1, 2, 3), root) != sa  # other tokens
    assert pool.find_cached(0, 7, t, parent_serial=root) in (a, b)
    assert [x for x in pool.cached_blocks(0, 7, t) if x.serial == sa] == [a, b]
    assert pool.cached_blocks(1, 7, t) == []  # other group
    check_pool(pool, Counter({a.block_id: 1, b.block_id: 1, c.block_id: 1, d.block_id: 1}))


def test_find_cached_verifies_tokens_on_hash_collision() -> None:
    pool = BlockPool(4)
    root = pool.root_serial(None)
    a, b = pool.get_new_blocks(2, 0)
    pool.cache_full_block(a, 0, full(1, 2, 3, 4), root)
    pool.cache_full_block(b, 0, full(4, 3, 2, 1), root)
    assert pool.cached_blocks(0, 0, [1, 2, 3, 4]) == [a]
    assert pool.cached_blocks(0, 0, [4, 3, 2, 1]) == [b]
    assert pool.cached_blocks(0, 0, [1, 1, 1, 1]) == []
    assert pool.find_cached(0, 0, [1, 2, 3, 4], parent_serial=root + 1000) is None


def test_root_serials_differ_per_salt() -> None:
    pool = BlockPool(2)
    roots = {pool.root_serial(s) for s in (None, "a", "b")}
    assert len(roots) == 3
    assert pool.root_serial("a") == pool.root_serial("a")


# ---- common_prefix_len / longest_partial_match ---------------------------------------------


def brute_common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(("a", "b", "n"), [
    ((), (), 0), ((1,), (), 0), ((1, 2, 3), (1, 2, 3), 3), ((1, 2, 3), (1, 2), 2),
    ((1, 2, 3), (1, 3, 3), 1), ((1, 2), (2, 2), 0), ((5, 5, 5, 5), (5, 5, 5, 4), 3),
])
def test_common_prefix_len_cases(a: tuple[int, ...], b: tuple[int, ...], n: int) -> None:
    assert common_prefix_len(a, b) == n
    assert common_prefix_len(b, a) == n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=12).map(tuple),
       st.lists(st.integers(0, 2), max_size=12).map(tuple))
def test_common_prefix_len_matches_brute_force(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    assert common_prefix_len(a, b) == brute_common_prefix(a, b)
    assert common_prefix_len(list(a), list(b)) == brute_common_prefix(a, b)


@settings(max_examples=200, deadline=None)
@given(
    siblings=st.lists(st.lists(TOKENS, min_size=1, max_size=BS).map(tuple), max_size=10),
    others=st.lists(st.lists(TOKENS, min_size=1, max_size=BS).map(tuple), max_size=3),
    query=st.lists(TOKENS, max_size=BS).map(tuple),
)
def test_longest_partial_match_matches_brute_force(siblings: list[tuple[int, ...]],
                                                   others: list[tuple[int, ...]],
                                                   query: tuple[int, ...]) -> None:
    pool = BlockPool(len(siblings) + len(others) + 2)
    parent = pool.root_serial(None)
    other_parent = pool.root_serial("other")
    blocks = pool.get_new_blocks(len(siblings), 0)
    for block, tokens in zip(blocks, siblings, strict=True):
        if len(tokens) == BS:
            pool.cache_full_block(block, hash(tokens), tokens, parent)
        else:
            pool.cache_partial_block(block, tokens, parent)
    # Distractors under another parent, and in another group under the same parent.
    for k, tokens in enumerate(others):
        (block,) = pool.get_new_blocks(1, k % 2)
        pool.cache_partial_block(block, tokens[:BS - 1], other_parent if k % 2 == 0 else parent)
    got, n = pool.longest_partial_match(0, parent, query)
    best = max((brute_common_prefix(t, query) for t in siblings), default=0)
    assert n == best
    if best:
        assert got is not None and got in blocks
        assert got.token_ids is not None and got.token_ids[:n] == query[:n]
    else:
        assert got is None


