"""The allocator invariants of docs/design.md, and the host tier's arena, checked from outside
after every operation in the tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.block import KVCacheBlock
from kvstore.block_pool import (
    REFUSED_PER_LARGE_PAGE,
    AllBlocksCleared,
    BlockPool,
    BlockStored,
    TwoSizeBlockPool,
)
from kvstore.kv_cache_coordinator import KVCacheCoordinator
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.single_type_kv_cache_manager import (
    RecurrentManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from kvstore.tiers.host import HostTier


@dataclass(frozen=True)
class Internals:
    """A manager's parts, for tests that check an invariant beneath the public API: its
    pool, its coordinator, the per-group managers and the copies queued for the worker."""

    pool: BlockPool
    coordinator: KVCacheCoordinator
    groups: tuple[SingleTypeKVCacheManager, ...]
    pending_copies: tuple[tuple[int, int], ...]


def internals(manager: KVCacheManager) -> Internals:
    """The one place the tests read a manager's private attributes."""
    coordinator = manager._coordinator
    return Internals(manager._pool, coordinator, coordinator.managers,
                     tuple(manager._copies._copies))


def check_pool(pool: BlockPool, table_refs: Counter[int] | None = None,
               pin_refs: Counter[int] | None = None) -> None:
    """Free-queue states, counts, and index agreement; ref counts when refs are given."""
    queued = [b.block_id for b in pool.free_queue]
    assert len(queued) == len(set(queued)), "a block is in the free queue twice"
    assert len(queued) == len(pool.free_queue)
    queued_set = set(queued)
    assert 0 not in queued_set, "the null block is in the free queue"
    in_use = 0
    by_group: Counter[int] = Counter()
    for block in pool.blocks[1:]:
        if block.ref_cnt > 0:
            assert block.block_id not in queued_set, f"block {block.block_id} in use and free"
            in_use += 1
            by_group[block.group_id] += 1
        else:
            assert block.ref_cnt == 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert block.block_id in queued_set, f"block {block.block_id} free but not queued"
            assert block.pin_cnt == 0
        assert 0 <= block.pin_cnt <= block.ref_cnt
    assert pool.num_free_blocks + in_use == pool.num_blocks - 1
    assert {g: n for g, n in pool.in_use_by_group.items() if n} == dict(by_group)
    # Index agreement.
    hashed = {}
    for block_id, group, h in pool.hash_entries():
        block = pool.blocks[block_id]
        assert block.block_hash == h and block.group_id == group
        assert block.token_ids is not None
        hashed[block_id] = h
    children = {}
    for block_id, group, parent, tokens in pool.index_entries():
        block = pool.blocks[block_id]
        assert block_id not in children, f"block {block_id} indexed twice"
        assert block.token_ids == tokens and block.parent_serial == parent
        assert block.group_id == group
        children[block_id] = tokens
    for block in pool.blocks[1:]:
        assert (block.block_hash is not None) == (block.block_id in hashed)
        assert (block.token_ids is not None) == (block.block_id in children), (
            f"block {block.block_id} content and index disagree")
    cached = Counter(b.group_id for b in pool.blocks[1:] if b.token_ids is not None)
    assert {g: n for g, n in pool.cached_by_group.items() if n} == dict(cached)
    assert sum(pool.evicted_by_group.values()) == pool.stats.evictions
    null = pool.null_block
    assert null.ref_cnt == 0 and null.token_ids is None and null.block_hash is None
    if table_refs is not None:
        pins = pin_refs or Counter()
        for block in pool.blocks[1:]:
            expected = table_refs.get(block.block_id, 0) + pins.get(block.block_id, 0)
            assert block.ref_cnt == expected, (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {expected} table/pin refs")
            assert block.pin_cnt == pins.get(block.block_id, 0)


def check_manager(manager: KVCacheManager) -> None:
    """Pool invariants with ref counts derived from every live block table and pin."""
    table_refs: Counter[int] = Counter()
    for rid, request in manager.requests.items():
        tables = manager.block_table(rid)
        for g, ids in enumerate(tables):
            table_refs.update(i for i in ids if i != 0)
            sub = internals(manager).groups[g]
            bs = manager.block_size
            # Cached blocks of a live request hold exactly its content.
            for i in range(sub.num_cached_blocks(rid)):
                block = sub.table(rid)[i]
                if block.block_id == 0:
                    continue
                assert block.block_hash == request.block_hashes[i]
                assert block.token_ids == tuple(request.token_ids[i * bs:(i + 1) * bs])
    pin_refs = Counter(manager.pinned_blocks)
    check_pool(internals(manager).pool, table_refs, pin_refs)


class EventMirror:
    """The prefix cache as a consumer of a manager's events rebuilds it: `check` replays the
    events recorded since its last call and asserts the replay holds exactly the pool's
    index entries (group, hash), each announced with its group's kind."""

    def __init__(self) -> None:
        self.entries: Counter[tuple[int, int]] = Counter()

    def check(self, manager: KVCacheManager) -> None:
        pool = internals(manager).pool
        assert pool.enable_events, "the mirror needs a manager with enable_events"
        for e in manager.take_events():
            if isinstance(e, AllBlocksCleared):
                self.entries.clear()
                continue
            assert e.kind == manager.config.groups[e.group_id].kind, f"{e}: the wrong kind"
            key = (e.group_id, e.block_hash)
            if isinstance(e, BlockStored):
                self.entries[key] += 1
            else:
                assert self.entries[key] > 0, f"{e} removes what no event stored"
                self.entries[key] -= 1
        self.entries += Counter()  # drop the zero counts
        indexed = Counter((g, h) for _, g, h in pool.hash_entries())
        assert self.entries == indexed, "the events disagree with the index: " \
            f"announced only {self.entries - indexed}, indexed only {indexed - self.entries}"


# ---- reads of private parts, each for an invariant or a "changes nothing" snapshot ----------
def checkpoint_order(pool: TwoSizeBlockPool) -> Any:
    """The two-size pool's order over its free checkpoints (the eviction policy's)."""
    return pool._large_cached


def group_state(sub: SingleTypeKVCacheManager) -> tuple[Any, ...]:
    """A group manager's per-request bookkeeping: cached counts, last serials, table ids."""
    return (dict(sub._num_cached_blocks), dict(sub._last_serial),
            {rid: [b.block_id for b in t] for rid, t in sub._req_to_blocks.items()})


def window_held(sub: SingleTypeKVCacheManager, request_id: str, i: int) -> bool:
    """Whether a sliding group keeps table entry ``i`` of a request past its window."""
    return isinstance(sub, SlidingWindowManager) and sub._held(request_id, i)


def working_state(sub: SingleTypeKVCacheManager, request_id: str) -> KVCacheBlock | None:
    """A recurrent group's working-state page of a request (None: it has none)."""
    rolling = sub._rolling.get(request_id) if isinstance(sub, RecurrentManager) else None
    return None if rolling is None else rolling[0]


def queued_events(pool: BlockPool) -> list[Any]:
    """The pool's events not yet taken, without taking them."""
    return list(pool._events)


def spy_evictions(pool: BlockPool, check: Callable[[KVCacheBlock], None]) -> None:
    """Call ``check`` on each block the pool is about to evict, before it is evicted."""
    evict = pool._evict

    def checked(blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            check(block)
        evict(blocks)

    pool._evict = checked  # type: ignore[method-assign]


def check_two_size_pool(pool: TwoSizeBlockPool, small_refs: Counter[int] | None = None,
                        large_refs: Counter[int] | None = None) -> None:
    """Every page of either size in exactly one state (no memory owned twice across sizes: a
    block in use lies in a split page, a large page in use is not split), the free counts per
    size, the split pages' use counts, the fragmentation and (given) the ref counts."""
    k = pool.large_page_blocks
    queued = [b.block_id for b in pool.free_queue]
    assert len(queued) == len(set(queued)) == len(pool.free_queue), "a block queued twice"
    queued_set = set(queued)
    empty_large = {p.block_id for p in pool._large_empty}
    cached_large = [p.block_id for p in checkpoint_order(pool)]
    assert len(cached_large) == len(set(cached_large))
    assert not empty_large & set(cached_large), "a large page in two free lists"
    assert len(empty_large) == len(pool._large_empty), "a large page on the empty stack twice"
    fragmented = 0
    free_small = 0
    for j, page in enumerate(pool.large_blocks):
        blocks = pool.blocks[j * k:(j + 1) * k]
        in_use = sum(1 for b in blocks if b.ref_cnt > 0 or b.block_id == 0)
        if pool._split[j]:
            assert page.ref_cnt == 0 and page.token_ids is None, f"split page {j} in use whole"
            assert page.block_id not in empty_large and page.block_id not in cached_large
            assert pool._used[j] == in_use, f"page {j}: {pool._used[j]} used, {in_use} counted"
            for b in blocks:
                if b.block_id == 0:
                    assert b.block_id not in queued_set
                elif b.ref_cnt > 0:
                    assert b.block_id not in queued_set, f"block {b.block_id} in use and free"
                else:
                    assert b.block_id in queued_set, f"free block {b.block_id} not queued"
                    free_small += 1
            assert (j in pool._empty_split) == (in_use == 0)
            if in_use == 0:
                # Returned whole unless some block holds cached content.
                assert any(b.token_ids is not None for b in blocks), \
                    f"page {j}: every block free and empty but the page is still split"
            else:
                fragmented += k - in_use
        else:
            assert j not in pool._empty_split
            for b in blocks:
                assert b.ref_cnt == 0 and b.block_id not in queued_set and b.token_ids is None, \
                    f"block {b.block_id} of whole page {j} is in use, queued or cached"
            if page.ref_cnt > 0:
                assert page.block_id not in empty_large and page.block_id not in cached_large
            elif page.token_ids is None:
                assert page.block_id in empty_large, f"free empty large page {j} not listed"
            else:
                assert page.block_id in cached_large, f"free checkpoint {j} not listed"
    assert free_small == len(pool.free_queue)
    assert pool.num_free_blocks == len(pool.free_queue) + k * (len(empty_large) + len(cached_large))
    assert pool.num_fragmented_blocks == fragmented
    assert pool._free_cached == sum(1 for b in pool.free_queue if b.token_ids is not None)
    assert pool._page_cached == [
        sum(1 for b in pool.blocks[j * k:(j + 1) * k] if b.ref_cnt == 0 and b.token_ids is not None
            and pool._split[j] and b.block_id != 0) for j in range(pool.num_large)]
    # Free checkpoints no hit used (those at a branch of their chain when freed are left
    # out), oldest free first.
    unhit = pool._unhit
    assert set(unhit) <= {p.block_id for p in checkpoint_order(pool) if p.uses == 0}
    assert list(unhit.values()) == sorted(unhit.values())
    assert all(when <= pool._handed_out for when in unhit.values())
    assert pool.stale_after >= pool.num_blocks and len(pool.stale_evicted) <= pool.num_large
    # Optional checkpoints' admission: a kind's hits never exceed its settled chances;
    # unsettled kinds belong to cached checkpoints only; refused ones remembered are bounded.
    for settled, hits in pool._admission.values():
        assert 0 <= hits <= settled + 1e-9
    for page_id, kind in pool._kind_of.items():
        page = pool.large_blocks[page_id - pool.num_blocks]
        assert page.token_ids is not None and kind in pool._admission
    assert len(pool.refused) <= REFUSED_PER_LARGE_PAGE * pool.num_large
    assert pool.num_free_large_pages == (len(empty_large) + len(cached_large)
                                         + len(pool._empty_split))
    # Free checkpoints whose chain is gone come first in an order that tracks chains.
    demoted = getattr(checkpoint_order(pool), "_demoted", {})
    ranks = [0 if p.orphan or p.block_id in demoted else 1 for p in checkpoint_order(pool)]
    assert ranks == sorted(ranks), "a checkpoint with a chain before an orphan"
    if not checkpoint_order(pool).tracks_chains:
        assert not any(p.orphan for p in pool.large_blocks)
    # Index agreement, both sizes.
    for block_id, group, h in pool.hash_entries():
        page = (pool.blocks[block_id] if block_id < pool.num_blocks
                else pool.large_blocks[block_id - pool.num_blocks])
        assert page.block_hash == h and page.group_id == group
    indexed = {bid for bid, _, _ in pool.hash_entries()}
    for page in pool.blocks[1:] + pool.large_blocks:
        assert (page.block_hash is not None) == (page.block_id in indexed)
    in_use_units: Counter[int] = Counter()
    for b in pool.blocks[1:]:
        if b.ref_cnt:
            in_use_units[b.group_id] += 1
    for page in pool.large_blocks:
        if page.ref_cnt:
            in_use_units[page.group_id] += k
    assert {g: n for g, n in pool.in_use_by_group.items() if n} == dict(in_use_units)
    if small_refs is not None:
        for b in pool.blocks[1:]:
            assert b.ref_cnt == small_refs.get(b.block_id, 0), f"block {b.block_id} refs"
    if large_refs is not None:
        for page in pool.large_blocks:
            assert page.ref_cnt == large_refs.get(page.block_id, 0), f"page {page.block_id} refs"


def check_host_tier(tier: HostTier) -> None:
    """A host tier's arena at rest (no store under way): every slot taken once, by a value
    in the index or a held view of a replaced one; every page free or carved for one slot
    size, its free slots listed exactly when it has some; slot bytes within the capacity."""
    ids, classes, per_page = tier._ids, tier._classes, tier._per_page
    pages = len(tier._page_class)
    assert tier.arena_bytes == pages * (tier.slot_nbytes or 0) <= tier.capacity_bytes
    owner: dict[int, bytes | None] = {}
    for key, slot in tier._index.items():
        assert slot not in owner, f"slot {slot} owned twice"
        owner[slot] = key
        assert tier._key[slot] == key
    for slot in tier._retired:
        assert slot in tier._held and slot not in owner, f"retired slot {slot}"
        owner[slot] = None
    assert set(tier._held) <= set(owner) and all(n > 0 for n in tier._held.values())
    assert tier.num_bytes == sum(tier._len[s] for s in tier._index.values())
    free_pages = Counter(tier._free_pages)
    assert all(n == 1 for n in free_pages.values()), "a page is free twice"
    slot_bytes = 0
    for page in range(pages):
        c = tier._page_class[page]
        taken = [s for s in range(page * ids, (page + 1) * ids) if s in owner]
        assert tier._page_used[page] == len(taken)
        if c < 0:
            assert not taken and page in free_pages and not tier._page_free[page]
            continue
        assert page not in free_pages and taken, f"page {page} carved and empty"
        n = per_page[c]
        free = tier._page_free[page] if n > 1 else []
        assert sorted(free + [s - page * ids for s in taken]) == list(range(n))
        assert (page in tier._partial[c]) == bool(free)
        for s in taken:
            assert tier._start[s] + tier._len[s] <= classes[c]
        slot_bytes += len(taken) * classes[c]
    for c, partial in enumerate(tier._partial):
        assert all(tier._page_class[p] == c for p in partial)
    assert tier.num_bytes <= slot_bytes <= tier.arena_bytes
