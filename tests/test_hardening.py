"""Hardening: bad input is refused at the door and changes nothing, salts cost no
memory once their requests are gone, the hit search is linear however the groups disagree,
and no hit ever serves content computed under another prefix or tenant, even when every
block hash collides. Also the hit statistics of an all-W = 1 model."""

from __future__ import annotations

import gc
import subprocess
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from invariants import check_manager, internals

from kvstore.block_pool import BlockPool
from kvstore.hashing import hash_block, make_keyed_hash
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request
from kvstore.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

BS = 4


def spec(window: int | None) -> KVCacheSpec:
    if window is None:
        return FullAttentionSpec(BS, 1, 8)
    return SlidingWindowSpec(BS, 1, 8, window=window)


def manager(windows: Sequence[int | None], num_blocks: int, partial: bool = True,
            hash_fn: Callable[[int, Sequence[int]], int] = hash_block) -> KVCacheManager:
    """One layer per entry (None = full attention), one group per distinct entry."""
    config = make_kv_cache_config([spec(w) for w in windows], num_blocks=num_blocks)
    return KVCacheManager(config, CacheConfig(enable_partial_hits=partial, hash_fn=hash_fn))


def constant_hash(parent: int, tokens: Sequence[int]) -> int:
    return 0  # every block of every prompt and tenant collides


def parent_only_hash(parent: int, tokens: Sequence[int]) -> int:
    return parent  # every block of one salt hashes to its root


def first_needed(window: int | None, num_computed: int) -> int:
    return 0 if window is None else max(0, num_computed - window + 1)


def snapshot(m: KVCacheManager) -> tuple[Any, ...]:
    """Everything a call could change."""
    pool = internals(m).pool
    return (
        tuple((b.ref_cnt, b.pin_cnt, b.group_id, b.block_hash, b.token_ids, b.serial,
               b.parent_serial) for b in pool.blocks),
        tuple(b.block_id for b in pool.free_queue),
        m.stats.as_dict(),
        {rid: (id(r), r.num_computed_tokens, tuple(r.token_ids), m.block_table(rid))
         for rid, r in m.requests.items()},
        m.pinned_blocks,
    )


class Shadow:
    """Simulated pages: slot s of page b holds (group, salt, tokens up to that position)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m = m
        self.windows = [g.spec.sliding_window for g in m.config.groups]
        self.pages: dict[int, list[Any]] = {}

    def run_copies(self) -> None:
        copies = self.m.take_pending_copies()
        data = [list(self.pages.get(src, [None] * BS)) for src, _ in copies]
        for (_, dst), page in zip(copies, data, strict=True):
            self.pages[dst] = page

    def expected(self, g: int, r: Request, p: int) -> tuple[int, str | None, tuple[int, ...]]:
        return (g, r.cache_salt, tuple(r.token_ids[:p + 1]))

    def forward(self, r: Request, n: int) -> None:
        """Write positions [computed, computed + n) of `r` in every group, then advance it."""
        pool = internals(self.m).pool
        start = r.num_computed_tokens
        for g, ids in enumerate(self.m.block_table(r.request_id)):
            for p in range(start, start + n):
                block = pool.blocks[ids[p // BS]]
                assert block.block_id != 0 and block.token_ids is None
                assert block.ref_cnt - block.pin_cnt == 1, "a shared page written"
                self.pages.setdefault(block.block_id, [None] * BS)[p % BS] = self.expected(g, r, p)
        r.num_computed_tokens = start + n

    def check_hit(self, r: Request, computed: ComputedBlocks) -> None:
        """Every hit block and copy source holds r's own content: its tenant, its prefix."""
        full = computed.num_full_hit_tokens
        for g, blocks in enumerate(computed.blocks):
            for i, block in enumerate(blocks):
                if block.block_id == 0:
                    continue
                page = self.pages.get(block.block_id)
                assert page is not None
                for s in range(BS):
                    assert page[s] == self.expected(g, r, i * BS + s), (
                        f"{r.request_id} group {g} hit block {i} (page {block.block_id}) slot {s} "
                        f"holds {page[s]}")
            src = computed.partial_sources[g]
            if src is not None:
                page = self.pages[src.block_id]
                for s in range(computed.num_partial_tokens):
                    assert page[s] == self.expected(g, r, full + s), f"copy source slot {s}"

    def check_reads(self, r: Request) -> None:
        """Every position r's next query attends holds r's own content."""
        nc = r.num_computed_tokens
        for g, ids in enumerate(self.m.block_table(r.request_id)):
            for p in range(first_needed(self.windows[g], nc), nc):
                page = self.pages.get(ids[p // BS])
                got = None if page is None else page[p % BS]
                assert got == self.expected(g, r, p), (
                    f"{r.request_id} (salt {r.cache_salt!r}) group {g} position {p}: page "
                    f"{ids[p // BS]} holds {got}")

    def run(self, r: Request, computed: ComputedBlocks | None = None, chunk: int = BS) -> None:
        """Admit r on its hit and compute all its tokens, a chunk per step."""
        m = self.m
        if computed is None:
            computed = m.get_computed_blocks(r)
        self.check_hit(r, computed)
        first = True
        while first or r.num_computed_tokens < r.num_tokens:
            nc = computed.num_computed_tokens if first else r.num_computed_tokens
            n = min(chunk, r.num_tokens - nc)
            assert m.allocate_slots(r, n, computed if first else None) is not None
            first = False
            self.run_copies()
            self.forward(r, n)
            self.check_reads(r)


def evict(m: KVCacheManager, block_ids: Sequence[int]) -> None:
    """Evict exactly these free cached blocks (made least recently used, then reused)."""
    pool = internals(m).pool
    queue = pool.free_queue
    for block_id in reversed(block_ids):
        block = pool.blocks[block_id]
        queue.remove(block)
        queue.appendleft(block)  # type: ignore[attr-defined]
    pool.free_blocks(pool.get_new_blocks(len(block_ids), 0))
    assert all(pool.blocks[b].token_ids is None for b in block_ids)
    check_manager(m)


# =============================================================================================
# 1-4. Validation at the door
# =============================================================================================

BAD_SALTS: list[Any] = [5, b"tenant", 1.5, ("a",), True, "\ud800", "tenant-\udfff", ["a"]]


@pytest.mark.parametrize("salt", BAD_SALTS)
def test_bad_salts_are_refused_at_the_door(salt: Any) -> None:
    with pytest.raises((TypeError, ValueError), match="cache_salt"):
        Request("r", [1, 2, 3], cache_salt=salt)
    r = Request("r", [1, 2, 3])
    with pytest.raises((TypeError, ValueError), match="cache_salt"):
        r.cache_salt = salt
    assert r.cache_salt is None


def test_a_salt_cannot_change_once_hashed() -> None:
    r = Request("r", list(range(9)), cache_salt="a")
    r.cache_salt = "b"  # nothing hashed yet
    r.update_block_hashes(BS, hash_block)
    with pytest.raises(ValueError, match="hashed"):
        r.cache_salt = "c"
    r.cache_salt = "b"
    assert r.cache_salt == "b"


def test_a_request_with_any_salt_can_always_be_freed() -> None:
    """The old failure: a bad salt was accepted while the prompt was shorter than a block,
    then the first full block made allocate_slots and free raise for ever. Now every salt
    that gets in is one the cache can hash, non-ASCII and empty ones included."""
    m = manager([None, 4], num_blocks=20)
    for salt in ("ténant-ü-😀", "", "\x00", "a" * 1000):
        r = Request("r", [1, 2, 3], cache_salt=salt)
        assert m.allocate_slots(r, 3, m.get_computed_blocks(r)) is not None
        r.num_computed_tokens = 3
        for _ in range(6):
            r.append_token_ids(7)
            assert m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
        m.free(r)
        m.take_pending_copies()
        m.take_pending_copies()
        assert m.reset_prefix_cache()


BAD_PROMPTS: list[Any] = [
    [2**63], [1, 2**63], [2**64 - 1], [-1], [True], [1, True, 2], [np.True_], [1.0], [1, 2.5],
    np.array([2**64 - 1], dtype=np.uint64), np.array([2**63], dtype=np.uint64),
    np.array([True, False]), np.array([1.5]), np.array([[1, 2]]), np.array([1, -1]),
    torch.tensor([True]), torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), torch.tensor(3),
    "abc", b"abc", 5, {1, 2}, [[1], [2]], [None],
]


@pytest.mark.parametrize("tokens", BAD_PROMPTS, ids=lambda t: f"{type(t).__name__}:{t!r:.30}")
def test_bad_token_ids_are_refused_at_the_door(tokens: Any) -> None:
    with pytest.raises((TypeError, ValueError)):
        Request("r", tokens)


def test_token_ids_from_lists_arrays_and_tensors_alike() -> None:
    expected = [0, 5, 2**63 - 1]
    for tokens in (expected, tuple(expected), np.array(expected, dtype=np.int64),
                   np.array(expected, dtype=np.uint64), np.array(expected, dtype=object),
                   [np.int64(0), np.uint64(5), 2**63 - 1], torch.tensor(expected)):
        r = Request("r", tokens)
        assert r.token_ids == expected and all(type(t) is int for t in r.token_ids)
    assert Request("r", np.array([1, 2], dtype=np.uint8)).token_ids == [1, 2]
    assert Request("r", range(3)).token_ids == [0, 1, 2]


BAD_APPENDS: list[Any] = [
    True, False, np.True_, 2**63, -1, 1.5, np.uint64(2**63), np.float64(1.0), [2**63], [True],
    np.array([2**64 - 1], dtype=np.uint64), torch.tensor(True), torch.tensor([1.5]), "7", None,
    [[1]],
]


@pytest.mark.parametrize("tokens", BAD_APPENDS, ids=lambda t: f"{type(t).__name__}:{t!r:.30}")
def test_bad_appended_tokens_change_nothing_and_the_request_still_frees(tokens: Any) -> None:
    m = manager([None, 4], num_blocks=20)
    shadow = Shadow(m)
    r = Request("r", list(range(10)))
    shadow.run(r)
    before = snapshot(m)
    with pytest.raises((TypeError, ValueError)):
        r.append_token_ids(tokens)
    assert snapshot(m) == before and r.num_tokens == 10
    r.append_token_ids(np.int64(3))
    r.append_token_ids(torch.tensor(4))
    r.append_token_ids(np.array([5, 6], dtype=np.uint64))
    assert r.token_ids[10:] == [3, 4, 5, 6] and all(type(t) is int for t in r.token_ids)
    assert m.allocate_slots(r, 4) is not None
    m.free(r)
    check_manager(m)


BAD_COUNTS: list[Any] = [True, False, 1.0, 0, -1, None, "1", np.float64(1.0)]


@pytest.mark.parametrize("count", BAD_COUNTS, ids=repr)
def test_bad_counts_change_nothing(count: Any) -> None:
    m = manager([None, 4], num_blocks=20)
    shadow = Shadow(m)
    running = Request("running", list(range(10)))
    shadow.run(running)
    running.append_token_ids(1)
    fresh = Request("fresh", list(range(6)))
    computed = m.get_computed_blocks(fresh)
    calls: list[Callable[[], object]] = [
        lambda: m.allocate_slots(running, count),
        lambda: m.allocate_slots(fresh, count, computed),
        lambda: m.grow(running, count),
        lambda: m.admit(fresh, count, computed),
    ]
    if not (type(count) is int and count == 0):  # 0 is a valid lookahead
        calls += [lambda: m.allocate_slots(running, 1, num_lookahead_tokens=count),
                  lambda: m.allocate_slots(fresh, 1, computed, num_lookahead_tokens=count)]
    for call in calls:
        before = snapshot(m)
        with pytest.raises((TypeError, ValueError)):
            call()
        assert snapshot(m) == before
    if not (type(count) is int and count == 0):
        with pytest.raises((TypeError, ValueError)):
            Request("x", [1], max_tokens=count)
    assert m.allocate_slots(running, 1) is not None
    m.free(running)
    check_manager(m)


def test_integer_like_counts_are_taken_everywhere() -> None:
    """One rule for counts: a numpy integer is a count wherever an int is (admission, growth,
    lookahead, progress, max_tokens); it is stored as an int."""
    m = manager([None, 4], num_blocks=20)
    r = Request("r", list(range(10)), max_tokens=np.int64(5))
    assert r.max_tokens == 5 and type(r.max_tokens) is int
    assert m.admit(r, np.int64(6), m.get_computed_blocks(r), num_lookahead_tokens=np.int32(1))
    r.num_computed_tokens = np.int64(6)
    assert m.grow(r, np.int64(4)) is not None
    assert type(r.num_computed_tokens) is int
    r.num_computed_tokens = np.int64(10)
    m.free(r)
    assert type(r.num_computed_tokens) is int
    check_manager(m)


@pytest.mark.parametrize("progress", [True, 2.5, -1, 12, None, np.bool_(True)], ids=repr)
def test_bad_progress_is_refused_and_the_request_frees_once_fixed(progress: Any) -> None:
    """num_computed_tokens is the scheduler's to advance: a value that is not an int in
    [0, num_tokens] is refused by grow and free, which change nothing."""
    m = manager([None, 4], num_blocks=20)
    shadow = Shadow(m)
    r = Request("r", list(range(10)))
    shadow.run(r)
    r.append_token_ids(1)
    before = snapshot(m)
    r.num_computed_tokens = progress
    for call in (lambda: m.allocate_slots(r, 1), lambda: m.free(r)):
        with pytest.raises(ValueError, match="num_computed_tokens"):
            call()
    r.num_computed_tokens = 10
    assert snapshot(m) == before
    m.free(r)
    check_manager(m)


@pytest.mark.parametrize("budget", [1.5e6, 1_500_000.0, True, "1500000", None])
def test_budgets_are_ints(budget: Any) -> None:
    specs = [spec(None), spec(4)]
    if budget is None:
        with pytest.raises(ValueError, match="exactly one"):
            make_kv_cache_config(specs, memory_bytes=budget)
        return
    with pytest.raises(ValueError, match="memory_bytes"):
        make_kv_cache_config(specs, memory_bytes=budget)
    with pytest.raises(ValueError, match="num_blocks"):
        make_kv_cache_config(specs, num_blocks=budget)
    config = make_kv_cache_config(specs, memory_bytes=np.int64(1_500_000))
    assert type(config.num_blocks) is int
    assert config.num_blocks == 1_500_000 // config.bytes_per_block


def test_configs_built_by_hand_are_checked() -> None:
    group = KVCacheGroup(spec(None), (0,))
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(93750.0, (group,), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(True, (group,), 1)
    with pytest.raises(ValueError, match="two groups"):
        KVCacheConfig(10, (group, KVCacheGroup(spec(4), (0,))), 1)
    with pytest.raises(ValueError, match="slots"):
        KVCacheConfig(10, (KVCacheGroup(spec(None), (0, 1)),), 1)
    other = KVCacheGroup(FullAttentionSpec(BS, 2, 4), (1,))  # same page bytes, other shape
    with pytest.raises(ValueError, match=r"group 1 pages are \[4, 2, 4\] float16"):
        KVCacheConfig(10, (group, other), 1)


@pytest.mark.parametrize("other", [
    FullAttentionSpec(BS, 2, 4),  # twice the heads, half the head dim
    FullAttentionSpec(BS, 1, 4, "float32"),  # half the head dim, twice the bytes per value
    SlidingWindowSpec(BS, 1, 8, "bfloat16", window=4),  # same bytes, other dtype
])
def test_specs_with_equal_page_bytes_but_other_pages_are_refused(other: KVCacheSpec) -> None:
    assert other.page_size_bytes == spec(None).page_size_bytes
    with pytest.raises(ValueError, match=r"layer 1 pages are .* layer 0 pages are \[4, 1, 8\] "
                                         r"float16.*shape .* and dtype"):
        make_kv_cache_config([spec(None), other], num_blocks=10)


# =============================================================================================
# 6. Copy ids
# =============================================================================================


@pytest.mark.parametrize("pairs", [
    [(1.5, 2.7)], [(1, 2.0)], [(True, 2)], [(1, False)], [(1, 8)], [(-1, 2)], [(0, 2)], [(1, 0)],
    [(1, 2, 3)], [(1,)], [1], ["12"], [(None, 2)], [(1, 2), (3, 2)], [(1, 2), (2, 3)],
    [(1, 2), (3.0, 4)],
], ids=repr)
def test_copy_blocks_refuses_bad_ids_and_copies_nothing(pairs: Any) -> None:
    cache = PagedKVCache(make_kv_cache_config([spec(None), spec(4)], num_blocks=8))
    gen = torch.Generator().manual_seed(0)
    for t in cache.key_caches + cache.value_caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in cache.key_caches + cache.value_caches]
    with pytest.raises((TypeError, ValueError)):
        cache.copy_blocks(pairs)
    assert cache.copies_executed == 0
    assert all(torch.equal(a, b) for a, b in zip(before, cache.key_caches + cache.value_caches,
                                                 strict=True))
    cache.copy_blocks([(np.int64(1), 2), (3, 4)])
    cache.copy_blocks(torch.tensor([[5, 6]]))
    assert cache.copies_executed == 3
    assert torch.equal(cache.key_caches[0][2], before[0][1])
    assert torch.equal(cache.key_caches[0][6], before[0][5])


# =============================================================================================
# 7. Salt roots cost nothing once their requests are gone
# =============================================================================================


@pytest.mark.slow
def test_salted_requests_leave_no_memory_behind() -> None:
    m = manager([None, 4], num_blocks=64)
    prompt = list(range(100, 111))  # two full blocks and a partial one

    def churn(n: int, tag: str) -> None:
        for i in range(n):
            r = Request(f"{tag}{i}", prompt, cache_salt=f"user-{tag}-{i}")
            assert m.allocate_slots(r, r.num_tokens, m.get_computed_blocks(r)) is not None
            r.num_computed_tokens = r.num_tokens
            m.free(r)
        m.take_pending_copies()
        m.take_pending_copies()
        assert m.reset_prefix_cache()

    churn(300, "warm")  # warm up every allocation pattern first
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        churn(5000, "x")
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    # One table entry per salt (the old design) would be about 5,000 * 115 bytes.
    assert grown < 20_000, f"{grown} bytes left behind by 5,000 salted requests"


# =============================================================================================
# 8. The hit search is linear in the prompt's blocks per group
# =============================================================================================


def count_lookups(m: KVCacheManager) -> list[int]:
    """Count every index lookup of the pool (hash index probes and cached_blocks calls)."""
    pool = internals(m).pool
    count = [0]
    probe, cached_blocks = pool.hash_index.probe, pool.cached_blocks

    def counting_probe(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return probe(*args, **kwargs)

    def counting_all(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return cached_blocks(*args, **kwargs)

    pool.hash_index.probe = counting_probe  # type: ignore[method-assign]
    pool.cached_blocks = counting_all  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("windows", [[None, 3, 4], [3, 4]], ids=["with-full", "windows-only"])
@pytest.mark.parametrize("num_blocks", [40, 160])
def test_disagreeing_windows_cost_linear_lookups(windows: list[int | None], num_blocks: int
                                                 ) -> None:
    """Windows 3 and 4 with block size 4: a hit ending before block e needs block e - 1 only.
    One windowed group keeps the even blocks, the other the odd ones, so every length one
    allows the other refuses: the agreement lowers the length one block per pass. The old
    lookup walked the full group's chain again on every pass (quadratic)."""
    m = manager(windows, num_blocks=3 * num_blocks + 8, partial=False)
    shadow = Shadow(m)
    prompt = list(range(1000, 1000 + num_blocks * BS)) + [1]
    shadow.run(Request("r1", prompt), chunk=num_blocks * BS + 1)
    m.free(m.requests["r1"])
    a, b = (g for g, w in enumerate(shadow.windows) if w is not None)
    tables = {g: [blk.block_id for blk in internals(m).pool.blocks if blk.group_id == g and blk.token_ids]
              for g in (a, b)}
    by_position = {g: {internals(m).pool.blocks[i].token_ids[0] - 1000: i for i in ids}  # type: ignore[index]
                   for g, ids in tables.items()}
    evict(m, [by_position[a][p * BS] for p in range(num_blocks) if p % 2 == 1]
          + [by_position[b][p * BS] for p in range(num_blocks) if p % 2 == 0])
    count = count_lookups(m)
    computed = m.get_computed_blocks(Request("r2", prompt))
    assert computed.num_full_hit_tokens == 0
    # The verified prefix (up to two lookups a block without a full group), then each
    # windowed group's blocks, each at most once: about 3n or 4n, where the old search
    # made about n * n / 2 at n = num_blocks.
    assert count[0] <= 4 * num_blocks + 8, (count[0], num_blocks)


def test_lookup_cost_of_a_long_hit_is_linear() -> None:
    m = manager([None, 8, 16], num_blocks=200, partial=False)
    shadow = Shadow(m)
    prompt = list(range(5000, 5000 + 60 * BS)) + [1]
    shadow.run(Request("r1", prompt), chunk=64)
    m.free(m.requests["r1"])
    count = count_lookups(m)
    computed = m.get_computed_blocks(Request("r2", prompt))
    assert computed.num_full_hit_tokens == 60 * BS
    assert count[0] <= 60 + 2 + 4 + 2  # the chain, then each window's blocks


# =============================================================================================
# 9. No hit crosses prefixes or tenants, even when every hash collides
# =============================================================================================


@pytest.mark.parametrize("hash_fn", [constant_hash, parent_only_hash, hash_block])
def test_window_left_edge_never_takes_another_tenants_block(
        hash_fn: Callable[[int, Sequence[int]], int]) -> None:
    """Window-only (W = 4): a hit ending before block 2 needs block 1 only. Tenant A cached a
    block 1 with tenant B's tokens under another block 0: under a colliding hash the old
    search took it as the left edge of B's window and served A's K/V to B."""
    m = manager([4], num_blocks=20, hash_fn=hash_fn)
    shadow = Shadow(m)
    shadow.run(Request("a", [1, 1, 1, 1, 5, 5, 5, 5, 9], cache_salt="A"))
    m.free(m.requests["a"])
    for rid, salt in (("b", "B"), ("a-unsalted", None)):
        r = Request(rid, [2, 2, 2, 2, 5, 5, 5, 5, 9], cache_salt=salt)
        computed = m.get_computed_blocks(r)
        assert computed.num_computed_tokens == 0
        shadow.run(r, computed)
        m.free(r)
    # Tenant B's own prefix is a hit now, and only B's.
    r = Request("b2", [2, 2, 2, 2, 5, 5, 5, 5, 9, 3], cache_salt="B")
    computed = m.get_computed_blocks(r)
    assert computed.num_full_hit_tokens == 8
    shadow.run(r, computed)
    check_manager(m)


@pytest.mark.parametrize("hash_fn", [constant_hash, parent_only_hash, hash_block])
def test_hybrid_window_never_takes_another_prefixs_block(
        hash_fn: Callable[[int, Sequence[int]], int]) -> None:
    """Hybrid (full + W = 4): B's own chain is cached in the full group, but B's window block
    was evicted while A's block with the same tokens (another prefix) was not. The old search
    took A's block; now the window must hang under B's prefix, so the hit stops before it."""
    m = manager([None, 4], num_blocks=30, hash_fn=hash_fn)
    shadow = Shadow(m)
    b_prompt = [2, 2, 2, 2, 5, 5, 5, 5, 9]
    shadow.run(Request("b1", b_prompt, cache_salt="B"))
    b_window_block_1 = m.block_table("b1")[1][1]
    m.free(m.requests["b1"])
    shadow.run(Request("a", [1, 1, 1, 1, 5, 5, 5, 5, 9], cache_salt="A"))
    m.free(m.requests["a"])
    evict(m, [b_window_block_1])
    r = Request("b2", b_prompt, cache_salt="B")
    computed = m.get_computed_blocks(r)
    assert computed.num_full_hit_tokens == 4  # block 0 needs no window block of its own
    shadow.run(r, computed)
    check_manager(m)


def test_keyed_hash() -> None:
    secret = bytes(range(32))
    h = make_keyed_hash(secret)
    assert h(1, [1, 2, 3, 4]) == h(1, [1, 2, 3, 4])
    assert h(1, [1, 2, 3, 4]) != h(2, [1, 2, 3, 4]) != h(1, [1, 2, 3, 5])
    assert h(1, [1, 2, 3, 4]) != make_keyed_hash(secret[::-1])(1, [1, 2, 3, 4])
    assert h(1, [1, 2, 3, 4]) != hash_block(1, [1, 2, 3, 4])
    assert 0 <= h(2**128 - 1, [2**63 - 1]) < 2**128
    for bad in (b"short", b"x" * 65, "a string secret" * 4):
        with pytest.raises((TypeError, ValueError), match="secret"):
            make_keyed_hash(bad)  # type: ignore[arg-type]
    # Through the manager: hits as with the default hash.
    m = manager([None, 4], num_blocks=20, hash_fn=h)
    shadow = Shadow(m)
    shadow.run(Request("a", list(range(13))))
    m.free(m.requests["a"])
    r = Request("b", list(range(13)))
    computed = m.get_computed_blocks(r)
    assert computed.num_computed_tokens == 12 and r.hash_fn is h
    shadow.run(r, computed)


# ---- the forced-collision state machines, every layout ---------------------------------------

FAMILIES = [(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 6, 6, 7, 8, 9, 10, 11, 12),
            (9, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)]  # equal blocks under other prefixes
SALTS = [None, "A", "B"]
MAX_TOKENS = 24


class CollisionMachine(RuleBasedStateMachine):
    """A scheduler over one layout with a hash under which blocks collide; a shadow device
    tags every slot with its group, tenant and prefix, and every read and every hit is checked
    against the reader's own. Also feeds the door bad input, which must change nothing."""

    WINDOWS: list[int | None] = [None]
    NUM_BLOCKS = 14
    HASH: Callable[[int, Sequence[int]], int] = staticmethod(constant_hash)

    def __init__(self) -> None:
        super().__init__()
        self.m = manager(self.WINDOWS, self.NUM_BLOCKS, hash_fn=type(self).HASH)
        self.shadow = Shadow(self.m)
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.next_id = 0

    def pick(self, data: st.DataObject, pool: dict[str, Request]) -> Request:
        return pool[data.draw(st.sampled_from(sorted(pool)))]

    def admit(self, r: Request, data: st.DataObject) -> None:
        m = self.m
        before = snapshot(m)
        computed = m.get_computed_blocks(r)
        assert snapshot(m) == before
        self.shadow.check_hit(r, computed)
        event(f"hit: {'yes' if computed.num_computed_tokens else 'no'}")
        n = data.draw(st.integers(1, r.num_tokens - computed.num_computed_tokens))
        try:
            out = m.allocate_slots(r, n, computed)
        except ValueError as e:
            assert "whole pool" in str(e)
            assert snapshot(m) == before
            return
        if out is None:
            assert snapshot(m) == before
            return
        self.waiting.pop(r.request_id, None)
        self.running[r.request_id] = r
        self.shadow.run_copies()
        self.shadow.forward(r, n)

    @rule(family=st.sampled_from(FAMILIES), n=st.integers(1, 12),
          suffix=st.lists(st.integers(0, 2), max_size=5), salt=st.sampled_from(SALTS),
          data=st.data())
    def arrive(self, family: tuple[int, ...], n: int, suffix: list[int], salt: str | None,
               data: st.DataObject) -> None:
        self.next_id += 1
        r = Request(f"r{self.next_id}", list(family[:n]) + suffix, cache_salt=salt)
        self.waiting[r.request_id] = r
        self.admit(r, data)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def readmit(self, data: st.DataObject) -> None:
        self.admit(self.pick(data, self.waiting), data)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        r = self.pick(data, self.running)
        if r.num_computed_tokens == r.num_tokens:
            if r.num_tokens >= MAX_TOKENS:
                self.finish(r)
                return
            r.append_token_ids(data.draw(st.integers(0, 2)))
        n = data.draw(st.integers(1, r.num_tokens - r.num_computed_tokens))
        before = snapshot(self.m)
        try:
            out = self.m.allocate_slots(r, n)
        except ValueError as e:
            assert "whole pool" in str(e)
            out = None
        if out is None:
            assert snapshot(self.m) == before
            self.preempt(r)
            return
        self.shadow.run_copies()
        self.shadow.forward(r, n)

    def finish(self, r: Request) -> None:
        self.m.free(r)
        del self.running[r.request_id]

    def preempt(self, r: Request) -> None:
        self.finish(r)
        r.num_computed_tokens = 0
        self.waiting[r.request_id] = r

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        r = self.pick(data, self.running)
        if preempt:
            self.preempt(r)
        else:
            self.finish(r)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = self.pick(data, self.running)
        self.next_id += 1
        child = parent.fork(f"r{self.next_id}")
        self.m.fork(parent, child)
        self.running[child.request_id] = child

    @rule()
    def worker(self) -> None:
        self.shadow.run_copies()

    @rule()
    def reset(self) -> None:
        before = snapshot(self.m)
        if not self.m.reset_prefix_cache():
            assert snapshot(self.m) == before

    @rule(data=st.data(), salt=st.sampled_from(BAD_SALTS),
          tokens=st.sampled_from(BAD_PROMPTS[:16]), token=st.sampled_from(BAD_APPENDS),
          count=st.sampled_from(BAD_COUNTS))
    def nasty(self, data: st.DataObject, salt: Any, tokens: Any, token: Any, count: Any) -> None:
        """Bad input at every door: each call raises and changes nothing."""
        before = snapshot(self.m)
        with pytest.raises((TypeError, ValueError)):
            Request("nasty", [1, 2, 3, 4, 5], cache_salt=salt)
        with pytest.raises((TypeError, ValueError)):
            Request("nasty", tokens)
        if self.running:
            r = self.pick(data, self.running)
            with pytest.raises((TypeError, ValueError)):
                r.append_token_ids(token)
            with pytest.raises((TypeError, ValueError)):
                self.m.allocate_slots(r, count)
            with pytest.raises((TypeError, ValueError)):
                r.cache_salt = salt
        assert snapshot(self.m) == before

    @invariant()
    def exact(self) -> None:
        check_manager(self.m)
        for r in self.running.values():
            self.shadow.check_reads(r)
        # One serial names one prefix: indexed full blocks with one parent and one token
        # block share their serial, whatever their group.
        serials: dict[tuple[int, tuple[int, ...]], set[int]] = {}
        for b in internals(self.m).pool.blocks[1:]:
            if b.block_hash is not None and b.token_ids is not None:
                serials.setdefault((b.parent_serial, b.token_ids), set()).add(b.serial)
        assert all(len(s) == 1 for s in serials.values()), serials

    def teardown(self) -> None:
        for r in list(self.running.values()):
            self.m.free(r)
        self.m.take_pending_copies()
        self.m.take_pending_copies()
        check_manager(self.m)
        assert self.m.num_free_blocks == self.m.num_usable_blocks
        assert self.m.reset_prefix_cache()


COLLISION_SETTINGS = settings(max_examples=40, stateful_step_count=40, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.filter_too_much],
                              report_multiple_bugs=False)
LAYOUTS: dict[str, tuple[list[int | None], int]] = {
    "Full": ([None], 10),
    "WindowOnly": ([4], 10),
    "TwoWindows": ([3, 6], 16),
    "Hybrid": ([None, 5], 16),
    "ThreeGroups": ([None, 3, 8], 22),
}
for _name, (_windows, _blocks) in LAYOUTS.items():
    for _hash_name, _hash in (("Constant", constant_hash), ("ParentOnly", parent_only_hash)):
        _machine = type(f"{_name}{_hash_name}Machine", (CollisionMachine,),
                        {"WINDOWS": _windows, "NUM_BLOCKS": _blocks, "HASH": staticmethod(_hash)})
        _case = _machine.TestCase
        _case.settings = COLLISION_SETTINGS
        _case.pytestmark = [pytest.mark.slow]
        globals()[f"Test{_name}{_hash_name}Collisions"] = _case
del _name, _windows, _blocks, _hash_name, _hash, _machine, _case


# =============================================================================================
# Hit statistics count only tokens that came from the cache
# =============================================================================================


def test_window_one_model_reports_no_hit_on_an_empty_cache() -> None:
    """All layers W = 1: every length is a valid hit for the window, but nothing was cached:
    the first request reports 0 hit tokens (it reported 12 of 13), the second the 12 tokens
    the first one cached."""
    m = manager([1], num_blocks=20)
    shadow = Shadow(m)
    prompt = list(range(13))
    r = Request("a", prompt)
    computed = m.get_computed_blocks(r)
    assert computed.num_computed_tokens == 0
    shadow.run(r, computed)
    assert m.stats.hit_tokens == 0 and m.stats.queried_tokens == 13
    m.free(r)
    again = Request("b", prompt)
    computed = m.get_computed_blocks(again)
    assert computed.num_computed_tokens == 12
    shadow.run(again, computed)
    assert m.stats.hit_tokens == 12


def test_window_one_engine_counts_only_cached_tokens() -> None:
    pytest.importorskip("transformers")
    from kvstore.engine.engine import EngineConfig, LLMEngine, SamplingParams
    from kvstore.models.presets import build_preset

    model = build_preset("mistral", sliding_window=1, num_hidden_layers=2)
    engine = LLMEngine(model, EngineConfig(num_blocks=64, block_size=BS))
    prompt = list(range(13))
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=2))
    assert first.num_cached_tokens == 0 and engine.stats.hit_tokens == 0
    (second,) = engine.generate([prompt], SamplingParams(max_tokens=2))
    assert second.num_cached_tokens == 12 and engine.stats.hit_tokens == 12


# =============================================================================================
# The bookkeeping core still loads no torch
# =============================================================================================


def test_import_kvstore_and_validate_tokens_without_torch() -> None:
    code = ("import sys, numpy as np, kvstore\n"
            "r = kvstore.Request('r', np.array([1, 2], dtype=np.uint64), cache_salt='s')\n"
            "r.append_token_ids(np.int64(3))\n"
            "assert r.token_ids == [1, 2, 3]\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pool_keeps_no_table_of_salts() -> None:
    pool = BlockPool(4)
    roots = {pool.root_serial(s) for s in (None, "", "\x00", "\x00\x00", "a", "\x00a", "é")}
    assert len(roots) == 7 and all(r < 0 for r in roots)
    assert pool.root_serial("a") == pool.root_serial("a")


# ---- requests shared between caches, progress past the pages, custom hashes ----------------


def test_a_request_hashed_at_another_block_size_is_refused() -> None:
    """A request's hashes name blocks of one size: a cache of another block size must not
    look them up (its blocks of 8 tokens would be found under 4-token hashes)."""
    small = KVCacheManager(make_kv_cache_config([FullAttentionSpec(4, 1, 8)], num_blocks=20))
    large = KVCacheManager(make_kv_cache_config([FullAttentionSpec(8, 1, 8)], num_blocks=20))
    r = Request("r", list(range(1, 10)))
    small.get_computed_blocks(r)
    before = snapshot(large)
    with pytest.raises(ValueError, match="block size"):
        large.get_computed_blocks(r)
    with pytest.raises(ValueError, match="block size"):
        large.allocate_slots(r, 9)
    assert snapshot(large) == before


def test_progress_past_the_allocated_pages_is_refused_and_changes_nothing() -> None:
    m = manager([None], 10)
    r = Request("r", list(range(12)))
    assert m.allocate_slots(r, 4, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 8  # pages cover 4 tokens
    before = snapshot(m)
    with pytest.raises(ValueError, match="cover 4"):
        m.allocate_slots(r, 1)
    assert snapshot(m) == before
    r.num_computed_tokens = 4
    assert m.allocate_slots(r, 1) is not None
    check_manager(m)


@pytest.mark.parametrize("windows", [[None], [6], [None, 6]])
def test_progress_moved_back_into_a_cached_block_is_refused_and_changes_nothing(
        windows: list[int | None]) -> None:
    m = manager(windows, 40)
    r = Request("r", [100 + i for i in range(30)])
    assert m.allocate_slots(r, 22, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 22
    assert m.allocate_slots(r, 1) is not None  # blocks 0-4 (tokens 0-19) are cached
    r.num_computed_tokens = 19  # recomputing token 19 would write into a cached block
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"moved back to 19 tokens.*\[16, 20\) is cached"):
        m.allocate_slots(r, 1)
    assert snapshot(m) == before
    r.num_computed_tokens = 21  # within the block being computed (and the window): allowed
    assert m.allocate_slots(r, 1) is not None
    check_manager(m)


@pytest.mark.parametrize("hold", [False, True])
def test_progress_moved_back_past_a_dropped_window_page_is_refused_and_changes_nothing(
        hold: bool) -> None:
    config = make_kv_cache_config([spec(6)], num_blocks=32)
    m = KVCacheManager(config, CacheConfig(enable_caching=False, hold_window_pages=hold))
    r = Request("r", [100 + i for i in range(30)])
    assert m.allocate_slots(r, 24, m.get_computed_blocks(r)) is not None
    r.num_computed_tokens = 24
    assert m.allocate_slots(r, 1) is not None  # the window (6 tokens) passed blocks 0-3
    assert m.block_table("r")[0][:4] == (0, 0, 0, 0)
    r.num_computed_tokens = 4  # a query at token 4 sees tokens 0-4: block 0 is gone
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"moved back to 4 tokens.*\[0, 4\) left the window"):
        m.allocate_slots(r, 1)
    assert snapshot(m) == before
    r.num_computed_tokens = 22  # back within the window: its pages are still there
    assert m.allocate_slots(r, 1) is not None
    check_manager(m)


def test_an_admission_past_its_device_hit_checkpoints_no_state_before_it_is_loaded() -> None:
    """A tier admission leaves the working state for the caller to load at the tier hit's
    end; a checkpoint due at the device hit's end (every 2 blocks here) whose page the
    admission evicted must not be taken again from that state, which is not loaded yet."""
    state = RecurrentStateSpec(BS, ((2, 40),), "float32")  # a large page of 2 blocks
    config = make_kv_cache_config([FullAttentionSpec(BS, 1, 8, "float32"), state], num_blocks=24)
    m = KVCacheManager(config, CacheConfig(checkpoint_every_blocks=2, eviction="lru"))
    for rid, first in (("a", 1), ("y", 200)):  # each leaves a checkpoint at 8 tokens
        r = Request(rid, list(range(first, first + 9)))
        assert m.allocate_slots(r, 8, m.get_computed_blocks(r)) is not None
        r.num_computed_tokens = 8
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens = 9
        m.free(r)
        m.take_pending_copies()
    for i, n in enumerate((3, 5, 2, 12)):  # running requests fill the pool
        r = Request(f"x{i}", list(range(1000 + 50 * i, 1000 + 50 * i + n)))
        assert m.allocate_slots(r, n, m.get_computed_blocks(r)) is not None
        m.take_pending_copies()
    b = Request("b", list(range(1, 30)))
    computed = m.get_computed_blocks(b)
    assert computed.num_full_hit_tokens == 8
    assert m.admit(b, 3, computed, num_external_tokens=4) is not None
    assert m.stats.checkpoints_evicted >= 1  # a's checkpoint made room for b's pages
    working = m.block_table("b")[1][0]
    assert all(src != working for src, _ in m.take_pending_copies())


@pytest.mark.parametrize("bad", [-1, 1 << 128, "x", 1.5])
def test_a_hash_function_returning_no_block_hash_is_refused(bad: object) -> None:
    m = manager([None], 10, hash_fn=lambda parent, tokens: bad)  # type: ignore[arg-type, return-value]
    r = Request("r", list(range(9)))
    before = snapshot(m)
    with pytest.raises(ValueError, match="128-bit unsigned int"):
        m.get_computed_blocks(r)
    assert snapshot(m) == before and r.block_hashes == [] and r.block_tokens == []


def test_gather_refuses_positions_and_ids_outside_the_table() -> None:
    cache = PagedKVCache(make_kv_cache_config([FullAttentionSpec(4, 1, 2, "float32")],
                                              num_blocks=8))
    for start, end in ((-4, 0), (0, 12), (5, 2), (0.5, 2)):
        with pytest.raises(ValueError, match="not in a table of 2 blocks"):
            cache.gather(0, [2, 3], start, end)  # type: ignore[arg-type]
    for table in ([2, 99], [2, -1], [2, None]):
        with pytest.raises(ValueError, match="is not a block of this cache"):
            cache.gather(0, table, 0, 8)  # type: ignore[arg-type]
    k, _ = cache.gather(0, [2, 3], 2, 6)
    assert k.shape[0] == 4


def test_config_types_get_clear_errors() -> None:
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheManager(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no layer spec"):
        KVCacheConfig(8, (KVCacheGroup("x", (0,)),), 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(\(3, 5\),\)"):
        RecurrentStateSpec(4, (3, 5))  # type: ignore[arg-type]
    # One torch dtype for every state, and numpy counts, as everywhere.
    spec = RecurrentStateSpec(np.int64(4), ((3, 5),), torch.float32)  # type: ignore[arg-type]
    assert spec.dtypes == ("float32",) and type(spec.block_size) is int
    window = SlidingWindowSpec(np.int64(4), 1, 8, window=np.int64(8))
    assert (type(window.block_size), type(window.window)) == (int, int)
    every = CacheConfig(checkpoint_every_blocks=np.int64(4)).checkpoint_every_blocks
    assert type(every) is int and every == 4


@pytest.mark.parametrize("recurrent", [False, True])
def test_next_checkpoints_checks_its_arguments_with_or_without_a_recurrent_group(
        recurrent: bool) -> None:
    specs = [FullAttentionSpec(4, 1, 8)] + ([RecurrentStateSpec(4, ((16, 16),))] if recurrent
                                            else [])
    m = KVCacheManager(make_kv_cache_config(specs, num_blocks=16))
    a, b = Request("a", list(range(9))), Request("b", list(range(9)))
    for n in (-1, True, 1.0):
        with pytest.raises(ValueError, match="num_new_tokens"):
            m.next_checkpoints(a, n)
    with pytest.raises(ValueError, match="lookup of 'a'"):
        m.next_checkpoints(a, 8, m.get_computed_blocks(b))
    assert (m.next_checkpoints(a, 8, m.get_computed_blocks(a)) != []) == recurrent


@pytest.mark.parametrize("spec", [SlidingWindowSpec(4, 1, 8, "float32", window=6),
                                  ChunkedLocalAttentionSpec(4, 1, 8, "float32", chunk=8)])
def test_a_partial_tail_past_a_tier_hit_window_is_not_indexed_under_the_root(spec) -> None:
    """After an admission on external tokens, a window group's entries below the window are
    null and its chain is not indexed: its partial tail has no known parent and must not
    serve a prompt that merely starts with the tail's tokens."""
    m = KVCacheManager(make_kv_cache_config([spec], num_blocks=24))
    a = Request("a", [3, 1, 3, 1, 2, 5, 2, 4, 3, 3, 5, 3, 2, 1, 1, 1, 4, 3, 4])
    m.admit(a, 6, m.get_computed_blocks(a), num_external_tokens=12)
    a.num_computed_tokens = 18
    m.free(a)
    b = Request("b", [4, 3, 9, 9, 9])  # starts with a's tokens at 16, 17
    hit = m.get_computed_blocks(b)
    assert hit.num_computed_tokens == 0 and hit.partial_sources == (None,)


def test_next_checkpoints_refuses_counts_and_progress_past_the_request() -> None:
    m = KVCacheManager(make_kv_cache_config([FullAttentionSpec(4, 1, 8),
                                             RecurrentStateSpec(4, ((2, 40),))], num_blocks=40))
    a = Request("a", list(range(1, 15)))
    m.admit(a, 14, m.get_computed_blocks(a))
    a.num_computed_tokens = 14
    with pytest.raises(ValueError, match="exceeds its 14 tokens"):
        m.next_checkpoints(a, 20)
    with pytest.raises(ValueError, match="exceeds its 14 tokens"):
        m.next_checkpoints(a, 10**30)
    for bad in (-1, True, 15, 1.5, None):
        a.num_computed_tokens = bad
        with pytest.raises(ValueError, match="num_computed_tokens must be an int"):
            m.next_checkpoints(a, 0)


def test_a_fork_spends_the_childs_pending_lookup() -> None:
    m = KVCacheManager(make_kv_cache_config([FullAttentionSpec(4, 1, 8)], num_blocks=16))
    parent = Request("p", list(range(1, 11)))
    m.admit(parent, 10, m.get_computed_blocks(parent))
    parent.num_computed_tokens = 10
    child = parent.fork("c")
    stale = m.get_computed_blocks(child)
    m.fork(parent, child)
    m.free(child)
    free = m.num_free_blocks
    with pytest.raises(ValueError, match="look this request up again"):
        m.admit(child, 1, stale)
    assert m.num_free_blocks == free


def test_groups_and_lookups_of_another_request_get_clear_errors() -> None:
    with pytest.raises(ValueError, match="layer_ids"):
        KVCacheGroup(FullAttentionSpec(4, 1, 8), ([0],))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tuple of KVCacheGroups"):
        KVCacheConfig(8, KVCacheGroup(FullAttentionSpec(4, 1, 8), (0,)), 1)  # type: ignore[arg-type]
    config = make_kv_cache_config([FullAttentionSpec(4, 1, 8),
                                   RecurrentStateSpec(4, ((16, 16),))], num_blocks=16)
    m = KVCacheManager(config)
    a, b = Request("a", list(range(9))), Request("b", list(range(9)))
    m.get_computed_blocks(a)
    with pytest.raises(ValueError, match="lookup of 'a'"):
        m.next_checkpoints(a, 8, m.get_computed_blocks(b))
