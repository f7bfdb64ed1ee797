"""The allocator invariants of docs/design.md, checked from outside after every operation in the tests."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvstore.block_pool import BlockPool
from kvstore.kv_cache_coordinator import KVCacheCoordinator
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.single_type_kv_cache_manager import SingleTypeKVCacheManager


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
