"""Routes every call to the per-group managers and agrees on one hit length for all groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool, PendingCopies
from kvstore.request import Request
from kvstore.single_type_kv_cache_manager import SingleTypeKVCacheManager, make_manager
from kvstore.specs import KVCacheConfig


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix hit: per-group hit blocks, and per-group copy sources for a partial block."""

    request_id: str
    blocks: tuple[list[KVCacheBlock], ...]
    partial_sources: tuple[KVCacheBlock | None, ...]
    num_full_hit_tokens: int
    num_partial_tokens: int
    cache_epoch: int = -1

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the request need not compute."""
        return self.num_full_hit_tokens + self.num_partial_tokens


class AllocationPlan(NamedTuple):
    """What growing a request's tables costs, summed over groups."""

    num_free_needed: int  # free blocks consumed: new pages, hits and pins taken off the queue
    num_released: int  # blocks that window drops return to the free queue first
    num_resident: int  # pages the request holds afterwards


class KVCacheCoordinator:
    """All KV cache groups of one cache over one shared pool."""

    __slots__ = ("config", "pool", "block_size", "managers")

    def __init__(self, config: KVCacheConfig, pool: BlockPool, copies: PendingCopies) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(pool, group.spec, g, copies) for g, group in enumerate(config.groups))

    def find_longest_hit(self, request: Request, max_tokens: int,
                         partial: bool) -> ComputedBlocks:
        """The longest prefix of at most `max_tokens` tokens cached for every group.

        Whole blocks first: each group lowers the candidate length in turn until none
        does. Then, if `partial`, the next block's leading tokens that every group has
        under its last hit block, at most block_size - 1 of them."""
        bs = self.block_size
        num_blocks = max_tokens // bs
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        changed = True
        while changed:
            changed = False
            for g, manager in enumerate(self.managers):
                hits[g] = manager.find_longest_hit(request, num_blocks)
                if len(hits[g]) < num_blocks:
                    num_blocks = len(hits[g])
                    changed = True
        # Every group's hit has exactly num_blocks blocks now (longer ones were cut by the loop).
        hits = [h[:num_blocks] for h in hits]
        full = num_blocks * bs
        sources: list[KVCacheBlock | None] = [None] * len(self.managers)
        num_partial = 0
        if partial and max_tokens > full:
            query = tuple(request.token_ids[full:min(full + bs - 1, max_tokens)])
            num_partial = len(query)
            for g, manager in enumerate(self.managers):
                parent = manager.parent_serial_after(request, hits[g])
                sources[g], n = self.pool.longest_partial_match(g, parent, query)
                num_partial = min(num_partial, n)
                if num_partial == 0:
                    break
            if num_partial == 0:
                sources = [None] * len(self.managers)
        return ComputedBlocks(request.request_id, tuple(hits), tuple(sources), full, num_partial,
                              self.pool.cache_epoch)

    def is_current(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether a lookup's blocks still hold what it found (nothing evicted since, or
        every hit block and copy source still holds the request's content, linked)."""
        if computed.cache_epoch == self.pool.cache_epoch:
            return True
        bs = self.block_size
        tokens, hashes = request.token_ids, request.block_hashes
        full = computed.num_full_hit_tokens
        for g, manager in enumerate(self.managers):
            prev = None
            for i, block in enumerate(computed.blocks[g]):
                if block.block_id == 0:
                    continue
                if (block.block_hash != hashes[i] or block.group_id != g
                        or block.token_ids != tuple(tokens[i * bs:(i + 1) * bs])
                        or (prev is not None and block.parent_serial != prev.serial)):
                    return False
                prev = block
            src = computed.partial_sources[g]
            if src is not None:
                n = computed.num_partial_tokens
                if (src.token_ids is None or src.group_id != g
                        or src.parent_serial != manager.parent_serial_after(request, computed.blocks[g])
                        or src.token_ids[:n] != tuple(tokens[full:full + n])):
                    return False
        return True

    def num_blocks_needed(self, request: Request, num_computed_tokens: int, num_tokens: int,
                          computed: ComputedBlocks | None) -> AllocationPlan:
        """What growing the tables to `num_tokens` costs; `computed` at admission, else None."""
        need = released = resident = 0
        rid = request.request_id
        for g, manager in enumerate(self.managers):
            if computed is None:
                need += manager.num_blocks_to_allocate(rid, num_computed_tokens, num_tokens,
                                                       None, None)
                released += manager.num_skippable(rid, num_computed_tokens).num_freed
            else:
                need += manager.num_blocks_to_allocate(rid, num_computed_tokens, num_tokens,
                                                       computed.blocks[g],
                                                       computed.partial_sources[g])
            resident += manager.spec.num_resident_blocks(num_computed_tokens, num_tokens)
        return AllocationPlan(need, released, resident)

    def admit(self, request: Request, computed: ComputedBlocks) -> None:
        """Take a checked prefix hit in every group."""
        for g, manager in enumerate(self.managers):
            manager.take_hit(computed.blocks[g], computed.partial_sources[g],
                             computed.num_computed_tokens)
        for g, manager in enumerate(self.managers):
            manager.admit(request, computed.blocks[g], computed.partial_sources[g])

    def allocate(self, request: Request, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Grow every group's table to `num_tokens` tokens (the caller checked it fits);
        returns the ids of the pages appended to each group's table."""
        for manager in self.managers:
            manager.release_computed(request)
        return tuple([manager.allocate(request, num_tokens) for manager in self.managers])

    def free(self, request: Request) -> None:
        """Release the request's pages in every group."""
        for manager in self.managers:
            manager.free(request)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Share every page of the parent with the child, in every group."""
        for manager in self.managers:
            manager.fork(parent_id, child_id)

    def block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Per-group block tables (0 = the null block)."""
        return tuple([m.block_ids(request_id) for m in self.managers])
