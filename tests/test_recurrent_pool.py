"""The two-size pool (TwoSizeBlockPool): blocks carved from large pages of k blocks. The
checks read the pool's pages from outside and rebuild what each list must hold."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from invariants import check_two_size_pool, checkpoint_order

from kvstore.block import KVCacheBlock
from kvstore.block_pool import (
    ADMIT_DECAY,
    ADMIT_WARMUP,
    REFUSED_PER_LARGE_PAGE,
    TwoSizeBlockPool,
)
from kvstore.eviction import EVICTION_POLICIES, LRUPolicy, WorthCheckpoints
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    RecurrentStateSpec,
    make_kv_cache_config,
)

RECURRENT = 1  # the recurrent group's id in these pools


class TwoSizePoolMachine(RuleBasedStateMachine):
    """Allocations, hits, frees and caching of pages of both sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: TwoSizeBlockPool | None = None
        self.small: list[KVCacheBlock] = []  # one entry per reference held
        self.large: list[KVCacheBlock] = []
        self.next_hash = 1
        # Checkpoints indexed as the twin of a cached block: (page, hash, serial).
        self.twins: list[tuple[KVCacheBlock, int, int]] = []

    @initialize(k=st.integers(1, 4), num_large=st.integers(2, 6),
                eviction=st.sampled_from(sorted(EVICTION_POLICIES)))
    def setup(self, k: int, num_large: int, eviction: str) -> None:
        self.pool = TwoSizeBlockPool(k * num_large, k, frozenset({RECURRENT}),
                                     eviction=eviction, chained_groups=frozenset({0}),
                                     num_groups=2, bytes_per_block=10)

    @property
    def p(self) -> TwoSizeBlockPool:
        assert self.pool is not None
        return self.pool

    def snapshot(self) -> tuple[object, ...]:
        p = self.p
        return (p.block_states(), p.large_page_states(), p.free_list_sizes(),
                tuple(b.block_id for b in p.free_queue), p.stats.evictions)

    @rule(n=st.integers(0, 9))
    def alloc_small(self, n: int) -> None:
        before = self.snapshot()
        if n > self.p.num_free_blocks:
            with pytest.raises(RuntimeError):
                self.p.get_new_blocks(n, 0)
            assert self.snapshot() == before
            return
        uncached_free = sum(1 for b in self.p.free_queue if b.token_ids is None)
        split_before = self.p.num_split_pages
        blocks = self.p.get_new_blocks(n, 0)
        assert len({b.block_id for b in blocks}) == n
        if n <= uncached_free:  # free blocks of split pages are used before splitting more
            assert self.p.num_split_pages == split_before
        self.small += blocks

    @rule(n=st.integers(0, 3))
    def alloc_large(self, n: int) -> None:
        before = self.snapshot()
        if n > self.p.num_free_large_pages:
            with pytest.raises(RuntimeError):
                self.p.get_large_pages(n, RECURRENT)
            assert self.snapshot() == before
            return
        pages = self.p.get_large_pages(n, RECURRENT)
        assert len({p.block_id for p in pages}) == n
        self.large += pages

    @precondition(lambda self: bool(self.small))
    @rule(data=st.data())
    def free_small(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.small) - 1))
        self.p.free_blocks([self.small.pop(i)])

    @precondition(lambda self: bool(self.large))
    @rule(data=st.data())
    def free_large(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.large) - 1))
        self.p.free_blocks([self.large.pop(i)])

    @precondition(lambda self: bool(self.small) or bool(self.large))
    @rule(data=st.data())
    def free_mixed(self, data: st.DataObject) -> None:
        """One call frees pages of both sizes."""
        pages = self.small[-2:] + self.large[-1:]
        del self.small[-2:]
        del self.large[-1:]
        self.p.free_blocks(pages)

    @precondition(lambda self: any(b.token_ids is None for b in self.small))
    @rule(data=st.data())
    def cache_small(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from([b for b in self.small if b.token_ids is None]))
        self.p.cache_full_block(block, self.next_hash, (self.next_hash,), 7)
        self.next_hash += 1

    @precondition(lambda self: any(p.token_ids is None for p in self.large))
    @rule(data=st.data(), kind=st.sampled_from(["", "prompt_end", "output_end"]))
    def cache_checkpoint(self, data: st.DataObject, kind: str) -> None:
        page = data.draw(st.sampled_from([p for p in self.large if p.token_ids is None]))
        if kind and not self.p.admit_checkpoint(kind):
            self.p.refused_checkpoint(kind, self.next_hash)
        else:
            self.p.cache_checkpoint(page, self.next_hash, (self.next_hash,), 7, self.next_hash,
                                    kind=kind)
        self.next_hash += 1

    @rule(offset=st.integers(1, 6))
    def want_refused(self, offset: int) -> None:
        """A lookup wants a checkpoint at a recent hash (refused, taken or never asked)."""
        before = self.p.admission
        self.p.wanted_refused(self.next_hash - offset)
        after = self.p.admission
        assert all(after[k][1] >= before[k][1] * ADMIT_DECAY for k in before)

    @precondition(lambda self: any(p.token_ids is None for p in self.large))
    @rule(data=st.data(), worth=st.integers(0, 8))
    def cache_chain_checkpoint(self, data: st.DataObject, worth: int) -> None:
        """A checkpoint of the prefix a cached block ends (same hash, tokens and serial)."""
        chain = [b for b in self.p.blocks[1:] if b.block_hash is not None]
        if not chain:
            return
        block = data.draw(st.sampled_from(chain))
        page = data.draw(st.sampled_from([p for p in self.large if p.token_ids is None]))
        assert block.block_hash is not None and block.token_ids is not None
        if self.p.find_cached(RECURRENT, block.block_hash, block.token_ids,
                              block.parent_serial) is not None:
            return  # one checkpoint per prefix, as the manager keeps it
        self.p.cache_checkpoint(page, block.block_hash, block.token_ids, block.parent_serial,
                                block.serial, worth=worth)
        self.twins.append((page, block.block_hash, block.serial))

    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        """A hit on a cached page of either size, free or not."""
        cached = [b for b in self.p.blocks[1:] + self.p.large_blocks if b.block_hash is not None]
        if not cached:
            return
        page = data.draw(st.sampled_from(cached))
        found = self.p.find_cached(page.group_id, page.block_hash, page.token_ids,
                                   page.parent_serial)
        assert found is not None
        self.p.touch([found])
        (self.large if self.p.is_large(found) else self.small).append(found)

    @rule()
    def double_free_is_refused(self) -> None:
        free = [b for b in self.p.blocks[1:] if b.ref_cnt == 0]
        if not free:
            return
        before = self.snapshot()
        with pytest.raises(RuntimeError, match="double free"):
            self.p.free_blocks(self.small[:1] + free[:1])
        assert self.snapshot() == before

    @invariant()
    def consistent(self) -> None:
        if self.pool is None:
            return
        small_refs = Counter(b.block_id for b in self.small)
        large_refs = Counter(p.block_id for p in self.large)
        check_two_size_pool(self.p, small_refs, large_refs)
        assert self.p.fragmented_bytes == 10 * self.p.num_fragmented_blocks
        # A checkpoint order that tracks chains knows every checkpoint whose chain is gone.
        tracks = checkpoint_order(self.p).tracks_chains
        live = []
        for page, block_hash, serial in self.twins:
            if page.block_hash != block_hash or page.serial != serial:
                assert not page.orphan
                continue  # evicted since
            live.append((page, block_hash, serial))
            chained = any(b.serial == serial for b in self.p.hash_index.blocks(0, block_hash))
            assert page.orphan == (tracks and not chained), f"checkpoint {page.block_id} orphan"
        self.twins = live

    def teardown(self) -> None:
        if self.pool is None:
            return
        self.p.free_blocks(self.small + self.large)
        check_two_size_pool(self.p, Counter(), Counter())
        assert self.p.num_free_blocks == self.p.num_usable_blocks
        assert self.p.reset_prefix_cache()
        # Every page returns whole once nothing is cached.
        assert self.p.num_split_pages == 1 and self.p.num_fragmented_blocks == \
            self.p.large_page_blocks - 1
        check_two_size_pool(self.p, Counter(), Counter())


def test_checkpoints_without_their_chain_go_first_then_the_least_worth() -> None:
    pool = TwoSizeBlockPool(8, 2, frozenset({RECURRENT}), eviction="worth",
                            chained_groups=frozenset({0}), num_groups=2)
    blocks = pool.get_new_blocks(2, 0)  # block 1, then page 1 split: blocks 2 and 3
    pool.cache_full_block(blocks[0], 11, (1,), 7, serial=5)
    pool.cache_full_block(blocks[1], 12, (2,), 5, serial=6)
    pages = pool.get_large_pages(2, RECURRENT)
    pool.cache_checkpoint(pages[0], 11, (1,), 7, 5, worth=8)  # the prefix block 1 ends
    pool.cache_checkpoint(pages[1], 12, (2,), 5, 6, worth=1)  # the one block 2 ends
    pool.free_blocks(pages)
    order = checkpoint_order(pool)
    assert isinstance(order, WorthCheckpoints)
    assert list(order) == [pages[1], pages[0]]  # the least worth first
    pool.free_blocks(blocks)
    assert pool.get_new_blocks(1, 0)[0].block_id == 3  # a free empty block first
    # Then a cached block: block 1, whose eviction leaves pages[0] without its chain.
    assert pool.get_new_blocks(1, 0)[0].block_id == 1
    assert pages[0].orphan and not pages[1].orphan
    assert list(order) == [pages[0], pages[1]]
    taken = pool.get_large_pages(1, RECURRENT)[0]
    assert taken is pages[0] and taken.token_ids is None  # the orphan goes first
    assert pages[1].block_hash == 12  # the other stays findable
    check_two_size_pool(pool)


class _LRUBlocksWorthCheckpoints(LRUPolicy):
    """LRU for blocks, free checkpoints by worth: a block order that tracks no content."""

    checkpoints = WorthCheckpoints


def test_a_block_order_tracking_no_content_still_orphans_checkpoints() -> None:
    # As a manager makes it: no partial blocks indexed.
    pool = TwoSizeBlockPool(8, 2, frozenset({RECURRENT}), eviction=_LRUBlocksWorthCheckpoints(),
                            chained_groups=frozenset({0}), num_groups=2,
                            index_partial_blocks=False)
    blocks = pool.get_new_blocks(2, 0)
    pool.cache_full_block(blocks[0], 11, (1,), 7, serial=5)
    pool.cache_full_block(blocks[1], 12, (2,), 5, serial=6)
    pages = pool.get_large_pages(2, RECURRENT)
    pool.cache_checkpoint(pages[0], 11, (1,), 7, 5, worth=8)
    pool.cache_checkpoint(pages[1], 12, (2,), 5, 6, worth=1)
    pool.free_blocks(pages)  # freeing a checkpoint asks the children index how its chain goes on
    pool.free_blocks(blocks)
    taken = pool.get_new_blocks(2, 0)  # the empty block, then the first cached one freed
    assert taken[0].block_hash is None and taken[1] is blocks[0]
    assert pages[0].orphan and not pages[1].orphan  # block 1's eviction left it chainless
    taken = pool.get_large_pages(1, RECURRENT)[0]
    assert taken is pages[0] and taken.token_ids is None  # the orphan goes first
    assert pages[1].block_hash == 12
    check_two_size_pool(pool)


def test_worth_ages_with_the_clock() -> None:
    order = WorthCheckpoints()
    pages = [KVCacheBlock(100 + i) for i in range(3)]
    for page, worth in zip(pages, (5, 1, 3), strict=True):
        order.note(page, worth)
        order.freed(page)
    assert order.pop() is pages[1] and order.clock == 1
    order.remove(pages[2])
    order.freed(pages[2])  # freed again: now 1 + 3 = 4, below page 0's 5
    assert order.pop() is pages[2] and order.clock == 4
    order.note(pages[1], 2)
    order.freed(pages[1])  # 4 + 2 = 6: a new checkpoint outranks an old worthier one
    assert [order.pop(), order.pop()] == [pages[0], pages[1]]
    with pytest.raises(ValueError, match="worth"):
        order.note(pages[0], -1)


TwoSizePoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestTwoSizePool = TwoSizePoolMachine.TestCase


# ---- fixed cases ---------------------------------------------------------------------------------
def make_pool(k: int = 4, num_large: int = 4) -> TwoSizeBlockPool:
    return TwoSizeBlockPool(k * num_large, k, frozenset({RECURRENT}),
                            chained_groups=frozenset({0}), num_groups=2)


def test_small_pages_prefer_split_pages_and_a_page_returns_whole_only_when_all_free() -> None:
    pool = make_pool()
    a = pool.get_new_blocks(5, 0)  # blocks 1-3 (page 0, with the null block), two of page 1
    assert pool.num_split_pages == 2
    b = pool.get_new_blocks(2, 0)  # page 1's other two: no page split for them
    assert pool.num_split_pages == 2
    page1 = [x for x in a + b if x.block_id // 4 == 1]
    assert len(page1) == 4
    pool.free_blocks(page1[:3])
    assert pool.num_split_pages == 2  # one block of page 1 is still in use
    pool.free_blocks(page1[3:])
    assert pool.num_split_pages == 1  # all free and empty: whole again
    check_two_size_pool(pool, Counter(x.block_id for x in a + b if x.block_id < 4), Counter())


def test_a_large_page_is_reclaimed_from_an_emptied_split_page_only_when_needed() -> None:
    pool = make_pool(k=2, num_large=3)
    blocks = pool.get_new_blocks(3, 0)  # block 1, then page 1 split
    pool.cache_full_block(blocks[1], 11, (1,), 7)
    pool.free_blocks(blocks)
    assert pool.num_split_pages == 2  # page 1 keeps its cached block
    pages = pool.get_large_pages(2, RECURRENT)  # page 2 whole, then page 1 reclaimed
    assert pool.num_split_pages == 1 and pool.stats.evictions == 1
    check_two_size_pool(pool, Counter(), Counter(p.block_id for p in pages))
    with pytest.raises(RuntimeError, match="large pages"):
        pool.get_large_pages(1, RECURRENT)


@pytest.mark.parametrize("eviction", ["lru", "worth"])
def test_a_checkpoint_no_hit_used_leaves_before_cached_blocks_once_the_pool_turned_over(
        eviction: str) -> None:
    pool = TwoSizeBlockPool(12, 2, frozenset({RECURRENT}), eviction=eviction,
                            chained_groups=frozenset({0}), num_groups=2)
    pages = pool.get_large_pages(2, RECURRENT)
    for i, page in enumerate(pages):
        pool.cache_checkpoint(page, 20 + i, (i,), 7, 30 + i, worth=5)
    pool.free_blocks(pages[:1])  # never hit
    pool.touch(pages[1:])  # hit, then freed
    pool.free_blocks(pages[1:] * 2)
    blocks = pool.get_new_blocks(7, 0)  # every free block: 4 + 7 of 12 handed out
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, 40 + i, (40 + i,), 7)
    pool.free_blocks(blocks)

    def cached_blocks() -> int:
        return sum(1 for b in pool.blocks if b.token_ids is not None)

    # 15 handed out, 11 since pages[0] was freed: cached blocks go first, as always.
    pool.free_blocks(pool.get_new_blocks(4, 0))
    assert cached_blocks() == 3 and pool.stats.checkpoints_evicted == 0
    check_two_size_pool(pool)
    pool.free_blocks(pool.get_new_blocks(1, 0))  # a free empty block: 16 handed out
    assert pool.stats.evictions == 4
    # The pool has turned over since pages[0] was freed: the checkpoint no hit used goes
    # before any cached block; the one a hit used stays.
    free_empty = pool.num_free_blocks - 2 * len(checkpoint_order(pool)) - cached_blocks()
    taken = pool.get_new_blocks(free_empty + 1, 0)
    assert pool.stats.checkpoints_evicted == 1 and pages[0].block_hash is None
    assert pages[1].block_hash == 21 and cached_blocks() == 3
    assert list(pool.stale_evicted) == [20] and pool.stale_after == pool.num_blocks
    pool.wanted_stale(21)  # not evicted stale: nothing changes
    assert pool.stale_after == pool.num_blocks
    pool.wanted_stale(20)  # a lookup wanted it: checkpoints stay one capacity longer
    assert pool.stale_after == 2 * pool.num_blocks and not pool.stale_evicted
    check_two_size_pool(pool, Counter(b.block_id for b in taken), Counter())


def test_fragmentation_is_the_free_room_in_partly_used_large_pages() -> None:
    pool = make_pool(k=4, num_large=3)
    assert pool.num_fragmented_blocks == 3  # page 0: the null block and three free blocks
    blocks = pool.get_new_blocks(4, 0)  # block 1..3, then one of page 1
    assert pool.num_fragmented_blocks == 3
    pool.free_blocks(blocks[:3])
    assert pool.num_fragmented_blocks == 6


@pytest.mark.parametrize("shapes", [((0,),), ((-1, 4),), (), ((4, 0),)])
def test_bad_state_shapes_are_refused(shapes: tuple[tuple[int, ...], ...]) -> None:
    with pytest.raises(ValueError, match="shape"):
        RecurrentStateSpec(16, shapes)


def test_a_state_larger_than_the_pool_is_refused() -> None:
    full = FullAttentionSpec(16, 1, 8)  # 512 bytes a block
    big = RecurrentStateSpec(16, ((4096,),), "float32")  # 16 KiB: 32 blocks
    with pytest.raises(ValueError, match="holds no large page"):
        make_kv_cache_config([full, big], num_blocks=40)
    config = make_kv_cache_config([full, big], num_blocks=64)
    assert config.large_page_blocks == 32


def test_a_state_that_cannot_be_carved_from_the_given_large_page_is_refused() -> None:
    full = FullAttentionSpec(16, 1, 8)
    state = RecurrentStateSpec(16, ((300,),), "float32")  # 1200 bytes: 3 blocks of 512
    groups = (KVCacheGroup(full, (0,)), KVCacheGroup(state, (1,)))
    with pytest.raises(ValueError, match="cannot be carved"):
        KVCacheConfig(num_blocks=32, groups=groups, num_slots=1, large_page_blocks=2)
    with pytest.raises(ValueError, match="multiple"):
        KVCacheConfig(num_blocks=32, groups=groups, num_slots=1, large_page_blocks=3)
    assert KVCacheConfig(num_blocks=33, groups=groups, num_slots=1).large_page_blocks == 3
    with pytest.raises(ValueError, match="block_size"):
        KVCacheConfig(num_blocks=32, groups=(KVCacheGroup(full, (0,)),
                                             KVCacheGroup(RecurrentStateSpec(8, ((4,),)), (1,))),
                      num_slots=1)


def test_layout_groups_full_sliding_and_recurrent_layers() -> None:
    from kvstore.specs import SlidingWindowSpec
    full = FullAttentionSpec(16, 2, 64)
    window = SlidingWindowSpec(16, 2, 64, window=128)
    state = RecurrentStateSpec(16, ((4, 64), (2, 64, 64)), ("float32", "bfloat16"))
    layers = [state, state, window, full] * 3
    config = make_kv_cache_config(layers, memory_bytes=64 << 20)
    kinds = [(type(g.spec).__name__, g.layer_ids) for g in config.groups]
    assert kinds == [("SlidingWindowSpec", (2, 6, 10)), ("FullAttentionSpec", (3, 7, 11)),
                     ("RecurrentStateSpec", (0, 1, 4, 5, 8, 9))] or \
        sorted(kinds) == sorted([("SlidingWindowSpec", (2, 6, 10)),
                                 ("FullAttentionSpec", (3, 7, 11)),
                                 ("RecurrentStateSpec", (0, 1, 4, 5, 8, 9))])
    assert config.num_slots == 3 and config.num_padding_layers == 0
    state_bytes = 6 * (4 * 64 * 4 + 2 * 64 * 64 * 2)
    assert config.groups[-1].state_bytes == state_bytes
    k = config.large_page_blocks
    assert (k - 1) * config.bytes_per_block < state_bytes <= k * config.bytes_per_block
    assert config.num_blocks % k == 0
    assert config.num_blocks * config.bytes_per_block <= 64 << 20


def test_a_checkpoint_where_its_chain_branches_is_never_stale() -> None:
    pool = TwoSizeBlockPool(12, 2, frozenset({RECURRENT}), eviction="worth",
                            chained_groups=frozenset({0}), num_groups=2)
    blocks = pool.get_new_blocks(3, 0)
    pool.cache_full_block(blocks[0], 11, (1,), 7, serial=5)
    pool.cache_full_block(blocks[1], 12, (2,), 5, serial=6)  # two ways on after serial 5
    pool.cache_full_block(blocks[2], 13, (3,), 5, serial=8)
    branch, leaf = pool.get_large_pages(2, RECURRENT)
    pool.cache_checkpoint(branch, 11, (1,), 7, 5, worth=5)
    pool.cache_checkpoint(leaf, 12, (2,), 5, 6, worth=5)
    pool.free_blocks([branch, leaf])
    for _ in range(pool.num_blocks):  # its capacity handed out, free empty blocks only
        pool.free_blocks(pool.get_new_blocks(1, 0))
    pool.free_blocks(blocks)
    assert pool.stats.evictions == 0
    free_empty = pool.num_free_blocks - 2 * 2 - 3
    taken = pool.get_new_blocks(free_empty + 3, 0)  # a large page's room and one more
    # The leaf went stale and goes first; then a cached block, not the branch point.
    assert leaf.block_hash is None and branch.block_hash == 11
    assert pool.stats.checkpoints_evicted == 1 and pool.stats.evictions == 2
    check_two_size_pool(pool, Counter(b.block_id for b in taken), Counter())


def test_optional_checkpoints_take_cached_room_only_while_their_kind_is_hit() -> None:
    pool = TwoSizeBlockPool(12, 2, frozenset({RECURRENT}), eviction="worth",
                            chained_groups=frozenset({0}), num_groups=2)
    page = pool.get_large_pages(1, RECURRENT)[0]
    blocks = pool.get_new_blocks(pool.num_free_blocks, 0)  # every other page split, in use
    for i, block in enumerate(blocks):
        pool.cache_full_block(block, 40 + i, (40 + i,), 7)
    pool.free_blocks(blocks)
    assert not pool.has_spare_large_page()  # free room holds cached blocks only
    # The first chances of a kind are taken whatever they settle as.
    for i in range(ADMIT_WARMUP):
        assert pool.admit_checkpoint("prompt_end")
        pool.refused_checkpoint("prompt_end", 100 + i)
    # Refused ones no lookup wanted settle as misses once forgotten.
    remembered = REFUSED_PER_LARGE_PAGE * pool.num_large
    for i in range(remembered + ADMIT_WARMUP):
        pool.refused_checkpoint("prompt_end", 200 + i)
    assert pool.admission["prompt_end"][1] == 0
    assert pool.admission["prompt_end"][0] >= ADMIT_WARMUP
    assert not pool.admit_checkpoint("prompt_end")
    pool.tiered = True  # a tier below keeps what is released: every one is taken
    assert pool.admit_checkpoint("prompt_end")
    pool.tiered = False
    assert pool.admit_checkpoint("output_end")  # another kind: its own record
    # Lookups wanting refused ones settle them as hits: the kind is admitted again.
    for i in range(3):
        pool.wanted_refused(200 + remembered + ADMIT_WARMUP - 1 - i)
    pool.wanted_refused(999)  # never refused: nothing changes
    assert pool.admit_checkpoint("prompt_end")
    check_two_size_pool(pool, Counter(), Counter({page.block_id: 1}))
    # A checkpoint taken settles as a hit at its first hit, a miss at its eviction unhit.
    pool.free_blocks([page])
    taken = pool.get_large_pages(1, RECURRENT)[0]
    pool.cache_checkpoint(taken, 50, (50,), 7, 60, kind="prompt_end")
    pool.free_blocks([taken])
    settled, hits = pool.admission["prompt_end"]
    pool.touch([taken])
    assert pool.admission["prompt_end"] == (settled * ADMIT_DECAY + 1, hits * ADMIT_DECAY + 1)
    pool.free_blocks([taken])
    check_two_size_pool(pool)
    # A spare page (whole and empty) admits whatever the record says.
    pool.reset_prefix_cache()
    assert pool.has_spare_large_page() and pool.admit_checkpoint("prompt_end")


def test_reclaiming_a_split_page_orphans_the_children_left_outside_it() -> None:
    pool = TwoSizeBlockPool(8, 2, frozenset({RECURRENT}), eviction="worth",
                            chained_groups=frozenset({0}), num_groups=2)
    b1, b2, b3, b4, b5 = pool.get_new_blocks(5, 0)  # page 1 holds b2 and b3, page 2 b4 and b5
    assert [b.block_id for b in (b2, b3, b4, b5)] == [2, 3, 4, 5]
    pool.cache_full_block(b2, 12, (2,), 7, serial=5)
    pool.cache_full_block(b3, 13, (3,), 5, serial=6)
    pool.cache_full_block(b4, 14, (4,), 6, serial=8)  # the chain's third block, on page 2
    pool.free_blocks([b3, b2])  # page 1 is emptied first
    pool.free_blocks([b5, b4])
    assert pool.get_large_pages(1, RECURRENT)[0].block_hash is None  # the whole empty page 3
    page = pool.get_large_pages(1, RECURRENT)[0]  # page 1, reclaimed: b2 and b3 evicted
    assert page.block_id == pool.num_blocks + 1
    assert b2.block_hash is None and b3.block_hash is None and pool.stats.evictions == 2
    assert b4.orphan and b4.block_hash == 14  # its parent went with the page
    assert pool.get_new_blocks(2, 0) == [b5, b4]  # the empty block, then the orphan
    check_two_size_pool(pool)
