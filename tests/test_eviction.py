"""Eviction policies: the seam, LRU bit-identity, MIN against brute force, and every policy
under the manager and hybrid state machines."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import test_hybrid as th
import test_kv_cache_manager as tm
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from invariants import check_pool, internals, spy_evictions

from kvstore.benchmarks.replay import (
    gap_closed,
    hybrid_replay,
    layer_specs,
    min_replay,
    pool_replay,
    reuse_oracle_replay,
)
from kvstore.benchmarks.traces import MooncakeRequest, leading_run, mooncake_lru_replay
from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool
from kvstore.eviction import (
    EVICTION_POLICIES,
    AdaptivePolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from kvstore.kv_cache_manager import CacheConfig, KVCacheManager

POLICIES = sorted(EVICTION_POLICIES)
NON_LRU = [p for p in POLICIES if p != "lru"]
BT = 512


def trie_trace(paths: Sequence[Sequence[int]]) -> list[MooncakeRequest]:
    """Requests whose ids are the nodes of a trie path (prefix-chained, like Mooncake's)."""
    ids: dict[tuple[int, ...], int] = {}
    out = []
    for t, path in enumerate(paths):
        hs = [ids.setdefault(tuple(path[:i + 1]), len(ids)) for i in range(len(path))]
        out.append(MooncakeRequest(timestamp_ms=t, input_length=len(hs) * BT, output_length=1,
                                   hash_ids=tuple(hs)))
    return out


paths_st = st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), min_size=1, max_size=7)


# ---- the seam ----------------------------------------------------------------------------------

def test_make_policy_names_and_errors() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    p = S3FIFOPolicy()
    assert make_policy(p) is p
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        KVCacheManager(th.make_kv_cache_config([th.spec(None)], num_blocks=8), CacheConfig(eviction="nope"))


def test_default_pool_is_lru() -> None:
    assert BlockPool(4).free_queue.name == "lru"


@settings(max_examples=80, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 6))
def test_lru_pool_replay_equals_oracle(paths: list[list[int]], cap: int) -> None:
    rows = trie_trace(paths)
    pool = pool_replay(rows, cap, eviction="lru")
    ref = mooncake_lru_replay(rows, cap)
    assert pool["per_request_hit_tokens"] == ref["per_request_hit_tokens"]
    assert pool["evictions"] == ref["evictions"]


# ---- MIN ---------------------------------------------------------------------------------------

def brute_force_best_hit_blocks(requests: Sequence[MooncakeRequest], capacity_blocks: int) -> int:
    """The most leading-run hit blocks any eviction schedule achieves: an exhaustive search
    over which unheld blocks each request evicts (tiny traces only)."""
    rows = sorted(requests, key=lambda r: r.timestamp_ms)

    def best(r: int, cache: frozenset[int]) -> int:
        if r == len(rows):
            return 0
        ids = rows[r].hash_ids
        held = set(ids[:capacity_blocks])
        need = len(cache | held) - capacity_blocks
        k = leading_run(ids, cache)
        if need <= 0:
            return k + best(r + 1, cache | held)
        return k + max(best(r + 1, (cache - set(out)) | held)
                       for out in itertools.combinations(sorted(cache - held), need))

    return best(0, frozenset())


@settings(max_examples=150, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 4))
def test_min_equals_brute_force_optimum(paths: list[list[int]], cap: int) -> None:
    rows = trie_trace(paths)
    res = min_replay(rows, cap)
    assert res["unlinked_present"] == 0, "MIN's cache is not prefix-closed"
    assert res["hit_blocks"] == brute_force_best_hit_blocks(rows, cap)


@settings(max_examples=60, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 6))
def test_no_policy_beats_min(paths: list[list[int]], cap: int) -> None:
    rows = trie_trace(paths)
    best = min_replay(rows, cap)["hit_blocks"]
    for name in POLICIES:
        assert pool_replay(rows, cap, eviction=name)["hit_blocks"] <= best


def test_min_on_a_hand_trace() -> None:
    # Chains A, B, C, A of two blocks with room for two chains: MIN evicts B (never used
    # again) for C, so A hits both blocks; LRU evicts A, the least recent.
    rows = trie_trace([[0, 0], [1, 1], [2, 2], [0, 0]])
    assert min_replay(rows, 4)["hit_blocks"] == 2
    assert mooncake_lru_replay(rows, 4)["hit_blocks"] == 0


def test_gap_closed() -> None:
    assert gap_closed(0.3, 0.2, 0.4) == pytest.approx(0.5)
    assert gap_closed(0.2, 0.2, 0.2) is None


# ---- properties of every policy on chain replays -------------------------------------------------

def reachable(pool: BlockPool, block: KVCacheBlock, roots: set[int]) -> bool:
    """Whether the block's parent chain is cached back to a root (brute force)."""
    serials = {b.serial for b in pool.blocks[1:] if b.block_hash is not None}
    parents = {b.serial: b.parent_serial for b in pool.blocks[1:] if b.block_hash is not None}
    s = block.parent_serial
    seen = set()
    while s not in roots:
        if s not in serials or s in seen:
            return False
        seen.add(s)
        s = parents[s]
    return True


@pytest.mark.parametrize("name", NON_LRU)
@settings(max_examples=60, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 6))
def test_orphans_go_before_reachable_pages(name: str, paths: list[list[int]], cap: int) -> None:
    """Replay a chain trace and check at every eviction: a reachable page is evicted only when
    no free page is an orphan; nothing in use or pinned is ever taken."""
    rows = trie_trace(paths)
    pool = BlockPool(cap + 1, eviction=name)
    roots = {pool.root_serial(None)}
    def check(block: KVCacheBlock) -> None:
        assert block.ref_cnt == 0 and block.pin_cnt == 0
        if reachable(pool, block, roots):
            for other in pool.free_queue:
                if other.token_ids is not None and other is not block:
                    assert reachable(pool, other, roots), "an orphan kept over a reachable page"

    spy_evictions(pool, check)
    for req in rows:
        keep = req.hash_ids[:cap]
        table: list[KVCacheBlock | None] = []
        parent = next(iter(roots))
        for h in keep:
            b = pool.find_cached(0, h, (h,), parent_serial=parent)
            if b is None:
                break
            table.append(b)
            parent = b.serial
        # Unlinked present blocks are not reused here: every missing block is computed anew.
        pool.touch(b for b in table if b is not None)
        new = pool.get_new_blocks(len(keep) - len(table), 0)
        for b in new:
            assert b.ref_cnt == 1
        table += new
        parent = next(iter(roots))
        for i, (h, b) in enumerate(zip(keep, table, strict=True)):
            assert b is not None
            if b.token_ids is None:
                parent = pool.cache_full_block(b, h, (h,), parent)
            else:
                parent = b.serial
            del i
        pool.free_blocks(reversed(table))  # type: ignore[arg-type]
        check_pool(pool)


@pytest.mark.parametrize("name", POLICIES)
def test_reset_empties_every_policy(name: str) -> None:
    rows = trie_trace([[0, 1], [0, 2], [1]])
    pool = BlockPool(4, eviction=name)
    root = pool.root_serial(None)
    for req in rows:
        blocks = pool.get_new_blocks(len(req.hash_ids), 0)
        parent = root
        for h, b in zip(req.hash_ids, blocks, strict=True):
            parent = pool.cache_full_block(b, h, (h,), parent)
        pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    check_pool(pool)
    assert len(pool.free_queue) == 3 and all(b.token_ids is None for b in pool.free_queue)


# ---- every policy under the existing state machines ----------------------------------------------

def _machine(base: type, name: str) -> type:
    return type(f"{base.__name__}_{name}", (base,), {"EVICTION": name})


for _name in NON_LRU:
    for _base in (tm.OneGroupMachine, tm.TwoGroupMachine, tm.StaleLookupMachine):
        _case = _machine(_base, _name).TestCase
        _case.pytestmark = [pytest.mark.slow]
        _case.settings = tm.STATEFUL
        globals()[f"Test{_base.__name__}_{_name}"] = _case


class HybridPolicyMachine(th.HybridCacheMachine):
    """The hybrid state machine with the eviction policy drawn too."""

    @initialize(windows=st.lists(st.sampled_from(th.WINDOWS), min_size=1, max_size=2, unique=True),
                full_position=st.integers(0, 2), num_blocks=st.integers(8, 24),
                partial=st.booleans(), eviction=st.sampled_from(NON_LRU))
    def setup(self, windows: list[int], full_position: int, num_blocks: int, partial: bool,
              eviction: str = "lru") -> None:
        layers: list[int | None] = list(windows)
        layers.insert(min(full_position, len(layers)), None)
        config = th.make_kv_cache_config([th.spec(w) for w in layers], num_blocks=num_blocks)
        self.manager = KVCacheManager(config, CacheConfig(enable_partial_hits=partial, eviction=eviction,
                                                          enable_events=True))
        self.partial = partial
        for salt in (None, "tenant"):
            internals(self.manager).pool.root_serial(salt)


TestHybridPolicies = HybridPolicyMachine.TestCase
TestHybridPolicies.settings = th.HybridCacheMachine.TestCase.settings
TestHybridPolicies.pytestmark = [pytest.mark.slow]


def test_window_policy_drops_far_window_pages_first_and_keeps_units() -> None:
    """Untagged window pages go before any full page; a tagged window page leaves right after
    the full page of its content (a unit), before an unrelated full page."""
    pool = BlockPool(6, eviction="window", chained_groups=frozenset({0}), num_groups=2)
    root = pool.root_serial(None)
    full_a, full_b = pool.get_new_blocks(2, 0)
    near, far = pool.get_new_blocks(2, 1)
    s_a = pool.cache_full_block(full_a, 1, (1,), root)
    pool.cache_full_block(full_b, 2, (2,), root)
    pool.cache_full_block(near, 1, (1,), root, serial=s_a)
    pool.cache_full_block(far, 3, (3,), root)
    near.hint, far.hint = 1, 0
    pool.free_blocks([full_a, full_b, near, far])
    order = [b.block_id for b in pool.free_queue if b.token_ids is not None]
    assert order[0] == far.block_id and order[-1] == near.block_id
    taken = [pool.get_new_blocks(1, 0)[0] for _ in range(5)]
    ids = [b.block_id for b in taken if b.block_id in (full_a.block_id, full_b.block_id,
                                                       near.block_id, far.block_id)]
    assert ids == [far.block_id, full_a.block_id, near.block_id, full_b.block_id]
    check_pool(pool)


def test_window_policy_ages_used_ends_in_main_and_holds_fresh_ones() -> None:
    """A tagged window page a hit already used (an end a request continued past) joins main
    with the full pages and leaves before a fresh tagged end, which is held."""
    pool = BlockPool(8, eviction="window", chained_groups=frozenset({0}), num_groups=2)
    policy = pool.free_queue
    root = pool.root_serial(None)
    full_old, full_new, other = pool.get_new_blocks(3, 0)
    used_end, fresh_end = pool.get_new_blocks(2, 1)
    s_old = pool.cache_full_block(full_old, 1, (1,), root)
    s_new = pool.cache_full_block(full_new, 2, (2,), s_old)
    pool.cache_full_block(other, 3, (3,), root)
    pool.cache_full_block(used_end, 1, (1,), root, serial=s_old)
    pool.cache_full_block(fresh_end, 2, (2,), s_old, serial=s_new)
    pool.touch([used_end])  # a hit used it; the request continued to full_new
    used_end.hint = fresh_end.hint = 1
    pool.free_blocks([full_new, full_old, other, fresh_end, used_end, used_end])
    order = [b.block_id for b in policy if b.token_ids is not None]
    assert order.index(used_end.block_id) < order.index(fresh_end.block_id)
    assert order[-1] == fresh_end.block_id  # held: only when nothing else is free
    assert used_end.free_tag == 3  # main, with the reused full pages
    check_pool(pool)


@settings(max_examples=40, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 6))
def test_window_policy_is_adaptive_without_window_pages(paths: list[list[int]], cap: int) -> None:
    rows = trie_trace(paths)
    assert pool_replay(rows, cap, eviction="window") == pool_replay(rows, cap, eviction="adaptive")


def _cycle(pool: BlockPool, h: int) -> KVCacheBlock:
    """Compute block `h` (a root block) in a fresh page and free it."""
    (block,) = pool.get_new_blocks(1, 0)
    pool.cache_full_block(block, h, (h,), pool.root_serial(None))
    pool.free_blocks([block])
    return block


def test_adaptive_share_grows_on_probation_ghost_hits_and_shrinks_on_main_ones() -> None:
    pool = BlockPool(3, eviction="adaptive")
    policy = pool.free_queue
    assert isinstance(policy, AdaptivePolicy)
    root = pool.root_serial(None)
    _cycle(pool, 1)
    _cycle(pool, 2)  # both in probation
    _cycle(pool, 3)  # evicts 1 from probation into the ghost list
    assert pool.find_cached(0, 1, (1,), root) is None
    assert pool.find_cached(0, 2, (2,), root) is not None
    share = policy.small_fraction
    _cycle(pool, 1)  # 1 recomputed: probation was too short; it joins main
    assert policy.small_fraction > share
    share = policy.small_fraction
    blk = pool.find_cached(0, 1, (1,), root)
    assert blk is not None and blk.free_tag == 3
    for h in (4, 5, 6, 7):  # new content pushes 1 out of main
        _cycle(pool, h)
    assert pool.find_cached(0, 1, (1,), root) is None
    _cycle(pool, 1)  # recomputed after leaving main: main was too small
    assert policy.small_fraction < share
    check_pool(pool)


# ---- the reuse oracle and the hybrid replay -----------------------------------------------------

def test_reuse_oracle_on_a_hand_trace() -> None:
    # Chains A, B, C, A: B and C never return, so the oracle evicts them and A hits.
    rows = trie_trace([[0, 0], [1, 1], [2, 2], [0, 0]])
    assert reuse_oracle_replay(rows, 4)["hit_blocks"] == 2
    assert reuse_oracle_replay(rows, 2)["hit_blocks"] == 0  # A is evicted to admit B


@settings(max_examples=60, deadline=None)
@given(paths=paths_st, cap=st.integers(1, 6))
def test_reuse_oracle_within_lru_and_min(paths: list[list[int]], cap: int) -> None:
    rows = trie_trace(paths)
    oracle = reuse_oracle_replay(rows, cap)["hit_blocks"]
    assert oracle <= min_replay(rows, cap)["hit_blocks"]
    # Unbounded, it is LRU (nothing is evicted either way).
    big = sum(len(r.hash_ids) for r in rows)
    assert reuse_oracle_replay(rows, big)["hit_blocks"] == mooncake_lru_replay(rows, big)["hit_blocks"]


def _turns() -> list[MooncakeRequest]:
    """A conversation: turn 2 repeats turn 1's 3 full blocks (its partial 4th block gets a
    new id, as in the Mooncake traces) and adds 2; turn 3 continues turn 2 the same way."""
    return [MooncakeRequest(0, 3 * BT + 100, 10, (0, 1, 2, 3)),
            MooncakeRequest(1, 5 * BT + 7, 10, (0, 1, 2, 4, 5, 6)),
            MooncakeRequest(2, 6 * BT + 1, 10, (0, 1, 2, 4, 5, 7, 8))]


@pytest.mark.parametrize("layout", ["hybrid", "full"])
@pytest.mark.parametrize("name", POLICIES)
def test_hybrid_replay_continues_at_the_last_full_block(layout: str, name: str) -> None:
    """With room for everything, each turn hits exactly the previous turn's full blocks: the
    window pages before the prompt end are there, the partial block is not a hit."""
    res = hybrid_replay(_turns(), 1_000_000, name, layout=layout)
    assert res["per_request_hit_tokens"] == [0, 3 * BT, 5 * BT]
    assert res["cut_tokens"] == 0
    kinds = {g["kind"] for g in res["groups"]}
    assert kinds == ({"full", "window"} if layout == "hybrid" else {"full"})
    for g in res["groups"]:
        assert g["stored"] - g["evicted"] == g["cached_end"]
        # Full blocks computed: 3, then 2 more, then 1 more (partial blocks are not stored).
        assert g["stored"] == 6
        assert g["evicted"] == 0
    full = [g for g in res["groups"] if g["kind"] == "full"]
    assert [g["hit_pages"] for g in full] == [8]
    # A window group's hit holds only the window before the hit end (W = 2 blocks).
    for g in res["groups"]:
        if g["kind"] == "window":
            assert g["hit_pages"] == 4


def test_hybrid_layout_pages_and_budget() -> None:
    specs = layer_specs("hybrid")
    assert sum(s.sliding_window is None for s in specs) == 10 and len(specs) == 62
    # 1M tokens of an all-full cache: 1953 blocks x 62 layers = 12108 pages of 10 layers.
    res = hybrid_replay(_turns()[:1], 1_000_000, "lru")
    assert res["num_blocks"] == 1_000_000 // BT * 62 // 10
    assert hybrid_replay(_turns()[:1], 1_000_000, "lru", layout="full")["num_blocks"] == 1953
