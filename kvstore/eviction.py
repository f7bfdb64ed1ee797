"""Eviction policies: the order in which the pool reuses free pages.

A policy holds every free page (ref_cnt == 0) of a :class:`kvstore.block_pool.BlockPool`
and nothing else, so it can never hand out a page in use or pinned. The pool tells it when
pages become free (`freed_all`), one leaves the free set on a hit (`remove`), one loses
its parent chain (`orphaned`) or its content (`evicted`), and asks it for pages to reuse
(`take`). Every call is O(1) per page.

- ``lru`` (the default): one list; pages without content at the head, freed cached pages
  at the tail, hits unlink. Exactly the order kvstore has always used.
- ``s3fifo``: reuse-aware admission in the spirit of S3-FIFO, adapted to prefix chains.
  Empty pages go first, then pages whose parent chain is gone (they can serve no hit),
  then a small probation FIFO of pages never reused, then the main LRU of pages that were
  reused or whose content was evicted from probation recently (a ghost list of content
  hashes). One-shot prompts pass through probation without flushing reused prefixes.
- ``adaptive``: ``s3fifo`` whose probation share adapts as ARC's target does, from a second
  ghost list of content evicted from main: recomputed content that had left probation grows
  the share, recomputed content that had left main shrinks it.
- ``window``: ``adaptive`` plus window-aware retention for layouts with sliding-window groups.
  A windowed page can serve only hits that end within W tokens after it, so the sliding
  window groups tag the pages they free (`KVCacheBlock.hint`): near a likely hit end (a
  prompt end, an output end, a branch point a lookup found) or not. Untagged window pages
  go right after orphans, before any full-attention page. Tagged ones are kept as a unit
  with the full-attention page of the same content: they leave only when that page's
  content is evicted (the pool then marks them orphans) or when nothing else is free; once a
  hit has used them and a request continued past them, they age in main with the full pages.
- ``worth``: ``window`` for blocks; free **checkpoints** (large pages holding a recurrent
  state, see `kvstore.block_pool.TwoSizeBlockPool`) ordered by their worth. A checkpoint is
  worth the compute it saves per block of memory: the tokens since the previous checkpoint
  its request knew on its chain (its hit, or one it took), or since 0, over the blocks of a
  large page. Checkpoints whose full-attention chain is gone (no hit can reach them) go
  first, before any cached block; the others leave in GreedyDual-Size order (priority: the
  worth plus an inflation clock that rises to each evicted priority, so worth decays with
  age), in a sorted container. A checkpoint a request hit or took and then computed past,
  hit once at most and where the cached chain has one continuation only, is an interior
  point of one chain
  (only a request diverging exactly there could use it): it is worth nothing and goes
  with the orphans until a hit takes it again. Every other policy keeps free checkpoints
  in LRU order and evicts them only after every cached block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import count
from typing import ClassVar

from sortedcontainers import SortedList

from kvstore.block import FreeBlockQueue, KVCacheBlock

__all__ = [
    "EvictionPolicy",
    "LRUPolicy",
    "S3FIFOPolicy",
    "AdaptivePolicy",
    "WindowPolicy",
    "WorthPolicy",
    "CheckpointOrder",
    "LRUCheckpoints",
    "WorthCheckpoints",
    "EVICTION_POLICIES",
    "DEFAULT_EVICTION",
    "RECURRENT_EVICTION",
    "make_policy",
]

Evict = Callable[[list[KVCacheBlock]], None]


class EvictionPolicy:
    """The free pages of one pool and the order they are reused in."""

    name: ClassVar[str] = ""
    # Whether the pool should tell the policy about orphaned and evicted content.
    tracks_content: ClassVar[bool] = False
    # Whether evicting a full-attention page's content (no twin left in its group) should
    # also orphan the pages of other groups holding the same content (same serial).
    tracks_units: ClassVar[bool] = False
    # Whether the order of freed pages depends on their `KVCacheBlock.hint` (only then do
    # sliding-window groups tag every page they free).
    reads_hints: ClassVar[bool] = False
    #: Whether a pool took this policy (`make_policy`): it orders that pool's pages only.
    in_use: bool = False
    #: The order of a two-size pool's free checkpoints under this policy.
    checkpoints: ClassVar[type[CheckpointOrder]]

    def attach(self, blocks: list[KVCacheBlock]) -> None:
        """Take the pool's usable pages (all free, none cached) at construction."""
        raise NotImplementedError

    def set_layout(self, has_chain: bool) -> None:
        """Whether the pool has a full-attention group (hits need its whole chain)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Every free page, the next to be reused first."""
        raise NotImplementedError

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """Remove n free pages for reuse, calling `evict` on those that hold content (in the
        order taken; a policy whose choice depends on what an eviction orphans evicts each
        before choosing the next) (the caller checked that n pages are free)."""
        raise NotImplementedError

    def freed_all(self, blocks: list[KVCacheBlock]) -> None:
        """These pages' ref counts reached zero, in this order (one call per `free`)."""
        raise NotImplementedError

    def remove(self, block: KVCacheBlock) -> None:
        """A free page was referenced again (a hit or a pin)."""
        raise NotImplementedError

    def orphaned(self, block: KVCacheBlock) -> None:
        """A free cached page's parent content is gone (only when `tracks_content`)."""

    def reused(self, block: KVCacheBlock) -> None:
        """A lookup found this cached page (free or not) but another group cut the hit
        before it."""

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
        self.extend(blocks)

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """The first n pages of the queue; their content is evicted in that order."""
        blocks = self.popleft_n(n)
        cached = [block for block in blocks if block.token_ids is not None]
        if cached:
            evict(cached)
        return blocks

    def freed_all(self, blocks: list[KVCacheBlock]) -> None:
        """Cached pages to the tail, empty ones to the head, each in turn (so the last empty
        page freed is reused first)."""
        empty = [block for block in blocks if block.token_ids is None]
        if not empty:
            self.extend(blocks)
            return
        empty.reverse()
        self.extendleft(empty)
        if len(empty) < len(blocks):
            self.extend([block for block in blocks if block.token_ids is not None])


# Free lists of S3FIFOPolicy, in the order they are drained.
_EMPTY, _ORPHAN, _SMALL, _MAIN = range(4)
# Bounds of an adaptive probation share.
_MIN_SHARE, _MAX_SHARE = 0.05, 0.9


class S3FIFOPolicy(EvictionPolicy):
    """Empty, then orphaned, then probation (FIFO, never reused), then main (LRU) pages.

    Probation is drained while it holds more than `small_fraction` of the free cached
    pages. Content evicted from probation is remembered by (group, block hash) in a ghost
    list as long as the pool; when it is cached and freed again it joins main directly.

    With `adaptive` (the ``adaptive`` policy), content evicted from main is remembered in a
    second ghost list as long as the pool, and the share adapts as ARC adapts its target:
    content recomputed after leaving probation grows it (probation was too short to see
    the reuse), content recomputed after leaving main shrinks it (main was too small), each
    by max(1, other ghost / this ghost) pages, within [0.05, 0.9] of the free pages."""

    name = "s3fifo"
    tracks_content = True
    adaptive: ClassVar[bool] = False

    def __init__(self, small_fraction: float = 0.25) -> None:
        if isinstance(small_fraction, bool) or not isinstance(small_fraction, (int, float)) \
                or not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self._lists = [FreeBlockQueue() for _ in range(4)]
        # FIFOs of (group, block hash): an OrderedDict pops its oldest entry in O(1), where
        # a dict's next(iter()) rescans the slots its earlier deletions left.
        self._ghost: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._main_ghost: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._ghost_cap = 0
        self._first_lists: list[FreeBlockQueue] = []
        self._size = 0  # pages in all lists

    def attach(self, blocks: list[KVCacheBlock]) -> None:
        """All pages start empty; each ghost list holds as many entries as there are pages."""
        self._ghost_cap = max(1, len(blocks))
        self._first_lists = [self._lists[t] for t in self._first]
        empty = self._lists[_EMPTY]
        for block in blocks:
            block.free_tag = _EMPTY
            empty.append(block)
        self._size += len(blocks)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Empty, orphaned, probation, then main pages (the order `take` drains them in,
        up to how probation and main interleave)."""
        for q in self._lists:
            yield from q

    def _push(self, block: KVCacheBlock, tag: int) -> None:
        block.free_tag = tag
        self._lists[tag].append(block)

    def _probation_ghost_hit(self) -> None:
        """Content evicted from probation came back: grow the probation share."""
        step = max(1.0, len(self._main_ghost) / max(1, len(self._ghost))) / self._ghost_cap
        self.small_fraction = min(_MAX_SHARE, self.small_fraction + step)

    def _main_ghost_hit(self, key: tuple[int, int]) -> None:
        """Content evicted from main came back: shrink the probation share."""
        ghost = self._main_ghost
        del ghost[key]
        step = max(1.0, len(self._ghost) / max(1, len(ghost))) / self._ghost_cap
        self.small_fraction = max(_MIN_SHARE, self.small_fraction - step)

    # Lists drained before probation and main, in order.
    _first: ClassVar[tuple[int, ...]] = (_EMPTY, _ORPHAN)

    def take(self, n: int, evict: Evict) -> list[KVCacheBlock]:
        """One page at a time, so pages orphaned by an eviction go before any other: the
        first of the lists drained first that has one, else probation while it holds more
        than its share (its content joins the ghost list), else main."""
        lists = self._lists
        empty = lists[_EMPTY]
        if n <= empty.size:  # no content to evict
            out = empty.popleft_n(n)
            for page in out:
                page.free_tag = -1
            self._size -= n
            return out
        first = self._first_lists
        small, main = lists[_SMALL], lists[_MAIN]
        ghost = self._ghost
        main_ghost = self._main_ghost if self.adaptive else None
        cap = self._ghost_cap
        out = []
        for _ in range(n):
            remember = None
            for q in first:
                if q.size:
                    break
            else:
                n_small = small.size
                if n_small and (not main.size
                                or n_small > self.small_fraction * (n_small + main.size)):
                    q, remember = small, ghost
                elif main.size:
                    q, remember = main, main_ghost
                else:
                    q, remember = self._last_resort()
            block = q.popleft()
            block.free_tag = -1
            if remember is not None and block.block_hash is not None:
                remember[(block.group_id, block.block_hash)] = None
                if len(remember) > cap:
                    remember.popitem(last=False)
            if block.token_ids is not None:
                evict([block])
            out.append(block)
        self._size -= n
        return out

    def _last_resort(self) -> tuple[FreeBlockQueue, OrderedDict[tuple[int, int], None] | None]:
        """The list to take from when every other is empty, and the ghost list its evicted
        content joins (None: none)."""
        raise IndexError("take from an empty policy")

    def freed_all(self, blocks: list[KVCacheBlock]) -> None:
        """Each page, in order, to the tail of the list `_free_tag` picks for it (an empty
        page: the empty list, whatever the policy)."""
        tag_of = self._free_tag
        by_tag: dict[int, list[KVCacheBlock]] = {}
        for block in blocks:
            if block.prev_free is not None or block.next_free is not None:
                raise ValueError(f"block {block.block_id} is already in the free queue")
            tag = _EMPTY if block.token_ids is None else tag_of(block)
            block.free_tag = tag
            same = by_tag.get(tag)
            if same is None:
                by_tag[tag] = [block]
            else:
                same.append(block)
        lists = self._lists
        for tag, same in by_tag.items():
            lists[tag].extend(same)
        self._size += len(blocks)

    def _free_tag(self, block: KVCacheBlock) -> int:
        """The list a freed page with content joins (`freed_all` puts empty ones on the empty
        list): orphaned, main (reused, or its content was evicted from probation, or with
        `adaptive` from main, recently), or probation."""
        if block.orphan:
            return _ORPHAN
        if block.uses:
            return _MAIN
        if block.block_hash is None:
            return _SMALL
        key = (block.group_id, block.block_hash)
        ghost = self._ghost
        if ghost and ghost.pop(key, 0) is None:
            if self.adaptive:
                self._probation_ghost_hit()
            return _MAIN
        main_ghost = self._main_ghost
        if main_ghost and key in main_ghost:
            self._main_ghost_hit(key)
            return _MAIN
        return _SMALL

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink from its list."""
        if block.free_tag < 0:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._lists[block.free_tag].remove(block)
        block.free_tag = -1
        self._size -= 1

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
        self._main_ghost.clear()


class AdaptivePolicy(S3FIFOPolicy):
    """``s3fifo`` whose probation share adapts to the workload (see `S3FIFOPolicy`)."""

    name = "adaptive"
    adaptive = True


# Extra free lists of WindowPolicy: window pages far from any likely hit end, and window
# pages kept with the full-attention page of the same content (never reused, reused).
_COLD, _HELD, _HELD_MAIN = 4, 5, 6


class WindowPolicy(S3FIFOPolicy):
    """``adaptive`` with window-aware retention: empty, orphaned, then window pages far from a
    likely hit end (FIFO), then probation and main as in ``adaptive`` (full-attention pages,
    partial blocks, tagged window pages a hit already used, and tagged window pages of a
    window-only layout), then tagged window pages whose full-attention twin is still cached,
    only when nothing else is free: first those never used (FIFO), then those recomputed
    after such an eviction (LRU; the ghost list is shared with probation).

    A tagged window page of a layout with a full-attention group leaves the held list when
    the pool evicts the last full-attention page of the same content (it becomes an orphan),
    so the full pages of a prefix and the window pages at its end are dropped together. A
    tagged page that a hit used and that is freed again sits at an end a request already
    continued past (a conversation's earlier turn, or a shared prefix's end): it ages in main
    with the full pages, so ends nobody returns to leave and busy ones stay.

    The probation share adapts as in ``adaptive``."""

    name = "window"
    tracks_units = True
    reads_hints = True
    adaptive = True

    def __init__(self, small_fraction: float = 0.25) -> None:
        super().__init__(small_fraction)
        self._lists += [FreeBlockQueue(), FreeBlockQueue(), FreeBlockQueue()]
        self._has_chain = True  # see set_layout

    def set_layout(self, has_chain: bool) -> None:
        """Without a full-attention group, tagged window pages age in probation and main."""
        self._has_chain = has_chain

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Empty, orphaned, far window, probation, main, then held window pages."""
        lists = self._lists
        for tag in (_EMPTY, _ORPHAN, _COLD, _SMALL, _MAIN, _HELD, _HELD_MAIN):
            yield from lists[tag]

    _first = (_EMPTY, _ORPHAN, _COLD)

    def _free_tag(self, block: KVCacheBlock) -> int:
        """As in ``adaptive``, except for a window page with content and a parent chain: one
        far from any likely hit end joins the far list, and a tagged one (its full-attention
        twin still cached, in a layout with a full-attention group) the held lists unless a
        hit used it (never reused, or recomputed after its content was evicted)."""
        if not block.orphan:
            if block.hint == 0:
                return _COLD
            if self._has_chain and block.hint == 1 and block.block_hash is not None:
                if block.uses:
                    return _MAIN
                if self._ghost.pop((block.group_id, block.block_hash), 0) is None:
                    return _HELD_MAIN
                return _HELD
        return super()._free_tag(block)

    def _last_resort(self) -> tuple[FreeBlockQueue, OrderedDict[tuple[int, int], None] | None]:
        """Held window pages never used (their content joins the probation ghost list), then
        those recomputed after such an eviction."""
        if self._lists[_HELD].size:
            return self._lists[_HELD], self._ghost
        return self._lists[_HELD_MAIN], None

    def reused(self, block: KVCacheBlock) -> None:
        """Counted as a use (it would have been hit): out of probation into main."""
        block.uses += 1
        if block.ref_cnt == 0 and block.free_tag == _SMALL:
            self._lists[_SMALL].remove(block)
            self._push(block, _MAIN)


class CheckpointOrder:
    """The free checkpoints of a two-size pool (whole large pages holding a cached recurrent
    state) and the order they are evicted in. The pool tells it a checkpoint's worth when
    it is indexed (`note`) and forgotten (`forget`), when one becomes free (`freed`) or is
    referenced again (`remove`), and when its full-attention chain is gone (`orphaned`,
    only when `tracks_chains`)."""

    #: Whether the pool should tell the order which checkpoints lost their chain.
    tracks_chains: ClassVar[bool] = False

    def __len__(self) -> int:
        raise NotImplementedError

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Every free checkpoint, the next to be evicted first."""
        raise NotImplementedError

    def note(self, page: KVCacheBlock, worth: float) -> None:
        """A checkpoint was indexed (in use); `worth`: tokens it saves per block."""

    def forget(self, page: KVCacheBlock) -> None:
        """A checkpoint's content is dropped (it is in use, or was just popped)."""

    def freed(self, page: KVCacheBlock) -> None:
        """A cached checkpoint's ref count reached zero."""
        raise NotImplementedError

    def remove(self, page: KVCacheBlock) -> None:
        """A free checkpoint was referenced again (a hit)."""
        raise NotImplementedError

    def pop(self) -> KVCacheBlock:
        """Remove the next checkpoint to evict (IndexError when empty)."""
        raise NotImplementedError

    def pop_worthless(self) -> KVCacheBlock | None:
        """Remove a free checkpoint worth nothing (its chain gone, or demoted), if any (None:
        none known)."""
        return None

    def has_worthless(self) -> bool:
        """Whether `pop_worthless` would return a checkpoint."""
        return False

    def orphaned(self, page: KVCacheBlock) -> None:
        """A checkpoint's full-attention chain is gone (free or not); `page.orphan` is set."""

    def demote(self, page: KVCacheBlock) -> None:
        """A checkpoint (free or not) is an interior point of one cached chain."""


class LRUCheckpoints(FreeBlockQueue, CheckpointOrder):
    """Least recently freed checkpoint first."""

    __slots__ = ()

    def freed(self, page: KVCacheBlock) -> None:
        """To the tail."""
        self.append(page)

    def pop(self) -> KVCacheBlock:
        """The head."""
        return self.popleft()


class WorthCheckpoints(CheckpointOrder):
    """Checkpoints worth nothing first (their chain gone, or demoted), then the lowest
    GreedyDual-Size priority: a checkpoint freed gets the clock plus its
    worth; the clock rises to the priority of each checkpoint evicted by worth. O(log n)
    per change (a sorted list of (orphan rank, priority, tie) keys)."""

    tracks_chains = True

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        # page id -> its key in _order: (0 if worth nothing else 1, priority, tie, page id)
        self._key: dict[int, tuple[int, float, int, int]] = {}
        self._pages: dict[int, KVCacheBlock] = {}  # page id -> page, for keys in _order
        self._worth: dict[int, float] = {}  # page id -> worth, while cached
        self._demoted: dict[int, float] = {}  # page id -> worth before `demote`
        self._clock = 0.0
        self._tie = count()

    def __len__(self) -> int:
        return len(self._pages)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Orphans, then by priority."""
        pages = self._pages
        for *_, page_id in self._order:
            yield pages[page_id]

    @property
    def clock(self) -> float:
        """The inflation value: the priority of the last checkpoint evicted by worth."""
        return self._clock

    def priority(self, page: KVCacheBlock) -> float:
        """The priority a free checkpoint holds now (the clock plus its worth when freed)."""
        return self._key[page.block_id][1]

    def note(self, page: KVCacheBlock, worth: float) -> None:
        """Remember the checkpoint's worth."""
        if worth < 0:
            raise ValueError(f"a checkpoint's worth must be >= 0, got {worth}")
        self._worth[page.block_id] = worth

    def forget(self, page: KVCacheBlock) -> None:
        """Drop its worth."""
        self._worth.pop(page.block_id, None)
        self._demoted.pop(page.block_id, None)

    def _insert(self, page: KVCacheBlock) -> None:
        worthless = page.orphan or page.block_id in self._demoted
        key = (0 if worthless else 1, self._clock + self._worth.get(page.block_id, 0.0),
               next(self._tie), page.block_id)
        self._key[page.block_id] = key
        self._pages[page.block_id] = page
        self._order.add(key)

    def _unlink(self, page: KVCacheBlock) -> None:
        key = self._key.pop(page.block_id, None)
        if key is None:
            raise ValueError(f"checkpoint {page.block_id} is not free")
        del self._pages[page.block_id]
        self._order.remove(key)

    def freed(self, page: KVCacheBlock) -> None:
        """In at the clock plus its worth (orphans ahead of all)."""
        if page.block_id in self._key:
            raise ValueError(f"checkpoint {page.block_id} is already free")
        self._insert(page)

    def remove(self, page: KVCacheBlock) -> None:
        """Out of the order; a demoted checkpoint is worth its tokens again."""
        self._unlink(page)
        worth = self._demoted.pop(page.block_id, None)
        if worth is not None:
            self._worth[page.block_id] = worth

    def pop(self) -> KVCacheBlock:
        """The first key's page; the clock rises to its priority unless it is an orphan."""
        if not self._order:
            raise IndexError("pop from an empty checkpoint order")
        rank, priority, _, page_id = self._order.pop(0)
        del self._key[page_id]
        if rank:
            self._clock = max(self._clock, priority)
        return self._pages.pop(page_id)

    def has_worthless(self) -> bool:
        """Whether the first key's page is worth nothing."""
        return bool(self._order) and self._order[0][0] == 0

    def pop_worthless(self) -> KVCacheBlock | None:
        """The first key's page if it is worth nothing."""
        if self._order and self._order[0][0] == 0:
            return self.pop()
        return None

    def orphaned(self, page: KVCacheBlock) -> None:
        """A free one moves ahead of every checkpoint with a chain."""
        if page.block_id in self._key:
            self._unlink(page)
            self._insert(page)

    def demote(self, page: KVCacheBlock) -> None:
        """Worth nothing (with the orphans when free) until a hit takes it."""
        pid = page.block_id
        if pid in self._worth and pid not in self._demoted:
            self._demoted[pid] = self._worth[pid]
            self._worth[pid] = 0.0
            if pid in self._key:
                self._unlink(page)
                self._insert(page)


EvictionPolicy.checkpoints = LRUCheckpoints


class WorthPolicy(WindowPolicy):
    """``window`` for blocks, free checkpoints by worth (see `WorthCheckpoints`)."""

    name = "worth"
    checkpoints = WorthCheckpoints


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "adaptive": AdaptivePolicy,
    "window": WindowPolicy,
    "worth": WorthPolicy,
}
DEFAULT_EVICTION = "lru"
#: The default for a layout with recurrent groups.
RECURRENT_EVICTION = "worth"


def make_policy(eviction: str | EvictionPolicy) -> EvictionPolicy:
    """A fresh policy by name (see EVICTION_POLICIES), or the given policy object, which
    then orders this pool's pages and no other's (ValueError if it already orders some)."""
    if isinstance(eviction, EvictionPolicy):
        if eviction.in_use:
            raise ValueError(f"this {type(eviction).__name__} already orders another pool's "
                             "pages: give each pool a fresh policy object, or a policy name")
        eviction.in_use = True
        return eviction
    factory = EVICTION_POLICIES.get(eviction)
    if factory is None:
        raise ValueError(f"unknown eviction policy {eviction!r}; known: "
                         f"{', '.join(sorted(EVICTION_POLICIES))}")
    policy = factory()
    policy.in_use = True
    return policy
