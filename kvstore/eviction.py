"""Eviction policies: the order in which the pool reuses free pages.

A policy holds every free page (ref_cnt == 0) of a :class:`kvstore.block_pool.BlockPool`
and nothing else, so it can never hand out a page in use or pinned. The pool tells it when
a page becomes free (`freed`), leaves the free set on a hit (`remove`), is made recent
again (`refresh`), loses its parent chain (`orphaned`) or its content (`evicted`), and asks
it for pages to reuse (`take`). Every call is O(1) per page.

- ``lru`` (the default): one list; pages without content at the head, freed cached pages
  at the tail, hits unlink. Exactly the order kvstore has always used.
- ``s3fifo``: reuse-aware admission in the spirit of S3-FIFO, adapted to prefix chains.
  Empty pages go first, then pages whose parent chain is gone (they can serve no hit),
  then a small probation FIFO of pages never reused, then the main LRU of pages that were
  reused or whose content was evicted from probation recently (a ghost list of content
  hashes). One-shot prompts pass through probation without flushing reused prefixes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import ClassVar

from kvstore.block import FreeBlockQueue, KVCacheBlock

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "EVICTION_POLICIES",
    "DEFAULT_EVICTION",
    "make_policy",
]

Evict = Callable[[KVCacheBlock], None]


class EvictionPolicy:
    """The free pages of one pool and the order they are reused in."""

    name: ClassVar[str] = ""
    # Whether the pool should tell the policy about orphaned and evicted content.
    tracks_content: ClassVar[bool] = False

    def attach(self, blocks: list[KVCacheBlock]) -> None:
        """Take the pool's usable pages (all free, none cached) at construction."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Every free page, the next to be reused first."""
        raise NotImplementedError

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """Remove n free pages for reuse, calling `evict` on each that holds content before
        choosing the next (the caller checked that n pages are free)."""
        raise NotImplementedError

    def freed(self, block: KVCacheBlock) -> None:
        """A page's ref count reached zero."""
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        """A free page was referenced again (a hit or a pin)."""
        raise NotImplementedError

    def refresh(self, block: KVCacheBlock) -> None:
        """A free cached page is as recent as the request that just ended."""
        raise NotImplementedError

    def orphaned(self, block: KVCacheBlock) -> None:
        """A free cached page's parent content is gone (only when `tracks_content`)."""

    def evicted(self, block: KVCacheBlock) -> None:
        """A page's content is about to be dropped (only when `tracks_content`)."""

    def reset(self) -> None:
        """All cached content was dropped (every page is free)."""


class LRUPolicy(FreeBlockQueue, EvictionPolicy):
    """Least recently freed cached page first; empty pages before any cached one."""

    __slots__ = ()
    name = "lru"

    def attach(self, blocks: list[KVCacheBlock]) -> None:
        """Queue the pages in id order."""
        self.append_n(blocks)

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """The first n pages of the queue; their content is evicted in that order."""
        blocks = self.popleft_n(n)
        for block in blocks:
            if block.token_ids is not None:
                evict(block)
        return blocks

    def freed(self, block: KVCacheBlock) -> None:
        """Cached pages to the tail, empty ones to the head."""
        if block.token_ids is None:
            self.appendleft(block)
        else:
            self.append(block)

    def refresh(self, block: KVCacheBlock) -> None:
        """Move to the tail."""
        self.remove(block)
        self.append(block)


# Free lists of S3FIFOPolicy, in the order they are drained.
_EMPTY, _ORPHAN, _SMALL, _MAIN = range(4)


class S3FIFOPolicy(EvictionPolicy):
    """Empty, then orphaned, then probation (FIFO, never reused), then main (LRU) pages.

    Probation is drained while it holds more than `small_fraction` of the free cached
    pages. Content evicted from probation is remembered by (group, block hash) in a ghost
    list as long as the pool; when it is cached and freed again it joins main directly."""

    name = "s3fifo"
    tracks_content = True

    def __init__(self, small_fraction: float = 0.25) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._lists = [FreeBlockQueue() for _ in range(4)]
        self._ghost: dict[tuple[int, int], None] = {}
        self._ghost_cap = 0

    def attach(self, blocks: list[KVCacheBlock]) -> None:
        """All pages start empty; the ghost list holds as many entries as there are pages."""
        self._ghost_cap = len(blocks)
        empty = self._lists[_EMPTY]
        for block in blocks:
            block.free_tag = _EMPTY
            empty.append(block)

    def __len__(self) -> int:
        return sum(len(q) for q in self._lists)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Empty, orphaned, probation, then main pages (the order `take` drains them in,
        up to how probation and main interleave)."""
        for q in self._lists:
            yield from q

    def _push(self, block: KVCacheBlock, tag: int) -> None:
        block.free_tag = tag
        self._lists[tag].append(block)

    def _pop(self) -> KVCacheBlock:
        empty, orphan, small, main = self._lists
        if len(empty):
            block = empty.popleft()
        elif len(orphan):
            block = orphan.popleft()
        else:
            n_small = len(small)
            if n_small and (not len(main)
                            or n_small > self.small_fraction * (n_small + len(main))):
                block = small.popleft()
                if block.block_hash is not None:
                    ghost = self._ghost
                    ghost[(block.group_id, block.block_hash)] = None
                    if len(ghost) > self._ghost_cap:
                        del ghost[next(iter(ghost))]
            else:
                block = main.popleft()
        block.free_tag = -1
        return block

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """One page at a time, so pages orphaned by an eviction go before any other."""
        out = []
        for _ in range(n):
            block = self._pop()
            if block.token_ids is not None:
                evict(block)
            out.append(block)
        return out

    def freed(self, block: KVCacheBlock) -> None:
        """Empty, orphaned, reused-or-ghost (main) or new (probation)."""
        if block.token_ids is None:
            self._push(block, _EMPTY)
        elif block.orphan:
            self._push(block, _ORPHAN)
        elif block.uses:
            self._push(block, _MAIN)
        elif block.block_hash is not None and self._ghost.pop((block.group_id, block.block_hash),
                                                               0) is None:
            self._push(block, _MAIN)
        else:
            self._push(block, _SMALL)

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink from its list."""
        self._lists[block.free_tag].remove(block)
        block.free_tag = -1

    def refresh(self, block: KVCacheBlock) -> None:
        """Move to the tail of its list."""
        q = self._lists[block.free_tag]
        q.remove(block)
        q.append(block)

    def orphaned(self, block: KVCacheBlock) -> None:
        """Move to the orphan list."""
        if block.free_tag != _ORPHAN:
            self._lists[block.free_tag].remove(block)
            self._push(block, _ORPHAN)

    def reset(self) -> None:
        """Every page becomes empty; the ghost list is forgotten."""
        empty = self._lists[_EMPTY]
        for q in self._lists[1:]:
            while len(q):
                block = q.popleft()
                block.free_tag = _EMPTY
                empty.append(block)
        self._ghost.clear()


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
}
DEFAULT_EVICTION = "lru"


def make_policy(eviction: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy by name (see EVICTION_POLICIES), or the given unattached policy."""
    if isinstance(eviction, EvictionPolicy):
        return eviction
    factory = EVICTION_POLICIES.get(eviction)
    if factory is None:
        raise ValueError(f"unknown eviction policy {eviction!r}; known: "
                         f"{', '.join(sorted(EVICTION_POLICIES))}")
    return factory()
