"""The shared pool of pages: allocation, ref counts, eviction and the prefix-cache indexes."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from typing import NamedTuple

from kvstore.block import KVCacheBlock
from kvstore.eviction import DEFAULT_EVICTION, EvictionPolicy, make_policy
from kvstore.hashing import BlockHash, root_serial
from kvstore.specs import GroupKind
from kvstore.utils import common_prefix_len, hit_rate

_group_of = attrgetter("group_id")
# Drops remembered for `BlockPool.dropped_since`: a lookup older than the last half of
# these is recomputed in full.
_DROPPED_KEPT = 1 << 16
_NO_BLOCKS = range(0)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A full block (or, in a recurrent group, a checkpoint: the state after the prefix
    that ends with this block) entered the prefix cache, in group `group_id` of kind
    `kind`."""

    block_hash: BlockHash
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    group_id: int
    kind: GroupKind = "full"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """A full block or a checkpoint left the prefix cache (evicted or reset)."""

    block_hash: BlockHash
    group_id: int
    kind: GroupKind = "full"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockState(NamedTuple):
    """A read-only snapshot of one block of the pool."""

    block_id: int
    ref_cnt: int  # block-table references plus pins of pending copies
    pin_cnt: int  # references held by pending copies
    group_id: int  # group whose layers the page belongs to (-1 before its first use)
    is_cached: bool  # holds indexed content (a full cached block or a finished partial one)
    block_hash: BlockHash | None  # set while the block is in the full-block hash index


class PartialMatch(NamedTuple):
    """A cached block sharing leading tokens with a query, and how many it shares."""

    block: KVCacheBlock | None
    num_tokens: int


@dataclass(slots=True)
class CacheStats:
    """Counters since creation; `lookups` counts once per admission. With recurrent groups:
    `recurrent_hits` counts admissions whose hit restored checkpoints, `checkpoints_taken`
    checkpoints indexed, `checkpoints_used` checkpoints copied into a working state by a
    hit, `checkpoints_evicted` checkpoints whose page was taken for reuse (also counted in
    `evictions`), `checkpoints_refused` prompt- and output-end checkpoints not taken (see
    `TwoSizeBlockPool.admit_checkpoint`)."""

    lookups: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0
    partial_hits: int = 0
    partial_hit_tokens: int = 0
    copies_queued: int = 0
    fork_copies: int = 0
    evictions: int = 0
    recurrent_hits: int = 0
    checkpoints_taken: int = 0
    checkpoints_used: int = 0
    checkpoints_evicted: int = 0
    checkpoints_refused: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens."""
        return hit_rate(self.hit_tokens, self.queried_tokens)

    def as_dict(self) -> dict[str, float]:
        """All counters plus the hit rate."""
        out: dict[str, float] = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hit_rate"] = self.hit_rate
        return out


class HashIndex:
    """Full cached blocks by (group, block hash). A key can hold several blocks (twins
    computed side by side, or hash collisions); a probe verifies a block's tokens and
    parent, so it never returns another prefix's content."""

    def __init__(self) -> None:
        # Per group, the first block indexed under each hash; `_more` holds the others,
        # rare, so the common probe is one dict lookup (by the hash alone: no key tuple).
        self._first: defaultdict[int, dict[BlockHash, KVCacheBlock]] = defaultdict(dict)
        self._more: dict[tuple[int, BlockHash], list[KVCacheBlock]] = {}

    def probe(self, group_id: int, block_hash: BlockHash, token_ids: Sequence[int],
              parent_serial: int) -> KVCacheBlock | None:
        """A block indexed under (group, hash) that holds these tokens under this parent
        serial, or None."""
        block = self._first[group_id].get(block_hash)
        if block is None or (block.parent_serial == parent_serial
                             and block.token_ids == token_ids):
            return block
        return self._probe_all(group_id, block_hash, token_ids, parent_serial)

    def probe_any(self, group_ids: Iterable[int], block_hash: BlockHash,
                  token_ids: Sequence[int], parent_serial: int) -> KVCacheBlock | None:
        """`probe` in each of these groups in turn: the first block found, or None."""
        first = self._first
        for g in group_ids:
            block = first[g].get(block_hash)
            if block is not None:
                if block.parent_serial == parent_serial and block.token_ids == token_ids:
                    return block
                block = self._probe_all(g, block_hash, token_ids, parent_serial)
                if block is not None:
                    return block
        return None

    def probe_row(self, group_ids: Sequence[int], block_hash: BlockHash,
                  token_ids: Sequence[int], parent_serial: int) -> list[KVCacheBlock] | None:
        """`probe` in each of these groups: their blocks, or None if some group has none."""
        first = self._first
        row = []
        for g in group_ids:
            block = first[g].get(block_hash)
            if block is None:
                return None
            if block.parent_serial != parent_serial or block.token_ids != token_ids:
                block = self._probe_all(g, block_hash, token_ids, parent_serial)
                if block is None:
                    return None
            row.append(block)
        return row

    def chain(self, group_id: int, block_hashes: Sequence[BlockHash],
              block_tokens: Sequence[Sequence[int]], parent_serial: int,
              max_blocks: int) -> list[KVCacheBlock]:
        """The longest run of blocks 0, 1, ... (at most `max_blocks`) that `probe` finds in
        the group, block 0 under `parent_serial` and each next one under the serial of the
        block found before it."""
        first = self._first[group_id]
        out: list[KVCacheBlock] = []
        for i in range(max_blocks):
            block = first.get(block_hashes[i])
            if block is None:
                break
            if block.parent_serial != parent_serial or block.token_ids != block_tokens[i]:
                block = self._probe_all(group_id, block_hashes[i], block_tokens[i],
                                        parent_serial)
                if block is None:
                    break
            out.append(block)
            parent_serial = block.serial
        return out

    def _probe_all(self, group_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                   parent_serial: int) -> KVCacheBlock | None:
        """`probe` past the first block of the key (a twin or a collision)."""
        if type(token_ids) is not tuple:
            token_ids = tuple(token_ids)
        for block in self.blocks(group_id, block_hash):
            if block.parent_serial == parent_serial and block.token_ids == token_ids:
                return block
        return None

    def blocks(self, group_id: int, block_hash: BlockHash) -> list[KVCacheBlock]:
        """Every block indexed under (group, hash), oldest first."""
        first = self._first[group_id].get(block_hash)
        if first is None:
            return []
        more = self._more.get((group_id, block_hash))
        return [first] if more is None else [first, *more]

    def add(self, group_id: int, block_hash: BlockHash, block: KVCacheBlock) -> None:
        """Index a block under (group, hash), after those indexed there already."""
        first = self._first[group_id]
        if block_hash in first:
            key = (group_id, block_hash)
            more = self._more.get(key)
            if more is None:
                self._more[key] = [block]
            else:
                more.append(block)
        else:
            first[block_hash] = block

    def remove(self, group_id: int, block_hash: BlockHash, block: KVCacheBlock) -> None:
        """Drop an indexed block's entry (the oldest of the others becomes the first)."""
        first = self._first[group_id]
        more = self._more.get((group_id, block_hash)) if self._more else None
        if more is None:
            del first[block_hash]
            return
        if first[block_hash] is block:
            first[block_hash] = more.pop(0)
        else:
            more.remove(block)
        if not more:
            del self._more[(group_id, block_hash)]

    def clear(self) -> None:
        """Drop every entry."""
        self._first.clear()
        self._more.clear()

    def __len__(self) -> int:
        return sum(len(first) for first in self._first.values()) + sum(
            len(v) for v in self._more.values())

    def entries(self) -> list[tuple[int, int, BlockHash]]:
        """(block_id, group, hash) of every entry."""
        out = [(b.block_id, g, h) for g, first in self._first.items() for h, b in first.items()]
        out += [(b.block_id, g, h) for (g, h), more in self._more.items() for b in more]
        return out


class BlockPool:
    """All pages of one cache, shared by every KV cache group.

    Block 0 is the null block. Free blocks are held by an eviction policy
    (`free_queue`, LRU by default: freed blocks that hold cached content join its
    tail, blocks without content its head). Cached content stays findable until its
    block is taken for reuse (lazy eviction). `chained_groups` names the groups whose
    hits need a block's whole parent chain (None: all); in those, a policy that tracks
    content learns when a block's parent content is gone; one that tracks units also learns
    when the pages of the other `num_groups` groups holding an evicted chained block's
    content became useless (every hit through them needs that block). `group_kinds` names
    each group's kind in events (empty: "full" for chained groups, "sliding" for others).
    `index_children`: keep the index `children` reads even where neither partial hits nor
    the policy need it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 enable_events: bool = False, index_partial_blocks: bool = True,
                 eviction: str | EvictionPolicy = DEFAULT_EVICTION,
                 chained_groups: frozenset[int] | None = None, num_groups: int = 1,
                 group_kinds: Sequence[GroupKind] = (), index_children: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"a pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Whether finished requests' partially filled last blocks are indexed (for partial hits).
        self.index_partial_blocks = enable_caching and index_partial_blocks
        self.enable_events = enable_events
        if group_kinds and len(group_kinds) != num_groups:
            raise ValueError(f"{len(group_kinds)} group kinds for {num_groups} groups")
        self._group_kinds = tuple(group_kinds)
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # The free blocks, in the order the policy reuses them.
        self.free_queue = make_policy(eviction)
        self.free_queue.attach(self.blocks[1:])
        self._tracks_content = self.free_queue.tracks_content
        # Whether an eviction marks what it leaves without its chain (see `_orphan_children`).
        self._marks_orphans = self._tracks_content
        # The policy's `evicted` hook, or None where it keeps the base class's no-op.
        self._evicted_hook = (self.free_queue.evicted if type(self.free_queue).evicted
                              is not EvictionPolicy.evicted else None)
        self._chained_groups = chained_groups
        self.free_queue.set_layout(chained_groups is None or bool(chained_groups))
        # Groups whose twins of an evicted chained block become orphans (policies tracking units).
        self._unit_groups: tuple[int, ...] = (
            tuple(range(num_groups)) if self.free_queue.tracks_units else ())
        # Full cached blocks by (group, hash); the hit searches probe it (read-only outside
        # the pool).
        self.hash_index = HashIndex()
        # (group, parent serial) -> sorted [(token_ids, block_id)] of full and partial
        # children: kept only where something reads it (partial hits by longest common
        # prefix, orphan marking by a content-tracking policy, `children`).
        self._index_children = (self.index_partial_blocks or self._tracks_content
                                or (enable_caching and index_children))
        self._children: dict[tuple[int, int], list[tuple[tuple[int, ...], int]]] = {}
        self._next_serial = 1
        self._events: list[KVCacheEvent] = []
        # Per group counts (a group never counted reads 0): a defaultdict, whose item
        # updates cost a third of a Counter's.
        self.in_use_by_group: defaultdict[int, int] = defaultdict(int)
        # The ids of the pages whose content was dropped at epochs `_dropped_base` on, in
        # order (the older half is forgotten past `_DROPPED_KEPT` entries; see `cache_epoch`).
        self._dropped: list[int] = []
        self._dropped_base = 0
        self.stats = CacheStats()
        # Per group: pages holding indexed content (full or partial), and evictions so far.
        self.cached_by_group: defaultdict[int, int] = defaultdict(int)
        self.evicted_by_group: defaultdict[int, int] = defaultdict(int)

    def group_kind(self, group_id: int) -> GroupKind:
        """The kind of a group, as events name it."""
        if group_id < len(self._group_kinds):
            return self._group_kinds[group_id]
        chained = self._chained_groups
        return "full" if chained is None or group_id in chained else "sliding"

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached or not)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # ---- allocation --------------------------------------------------------------------------
    def get_new_blocks(self, n: int, group_id: int) -> list[KVCacheBlock]:
        """Take n free blocks in the eviction policy's order, evicting cached content they hold."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free_queue)} free")
        blocks = self.free_queue.take(n, self._evict)
        for block in blocks:
            block.ref_cnt = 1
            block.uses = 0
            block.hint = -1
            block.group_id = group_id
        if n:
            self.in_use_by_group[group_id] += n
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a hit or a pin); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                if block.block_id == 0:
                    raise ValueError("the null block cannot be referenced")
                self.free_queue.remove(block)
                self.in_use_by_group[block.group_id] += 1
            block.ref_cnt += 1
            block.uses += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock], group_id: int = -1) -> None:
        """Drop one reference per block, in the order given (callers pass deepest first);
        `group_id`, when given, is the group every block belongs to."""
        now_free = self._drop_refs(blocks)
        if now_free:
            self._count_freed(now_free, group_id)
            self.free_queue.freed_all(now_free)

    def _count_freed(self, blocks: list[KVCacheBlock], group_id: int) -> None:
        """Lower the in-use counts of the groups of `blocks`, just freed (`group_id`: the
        group of all of them, or -1)."""
        in_use = self.in_use_by_group
        if group_id >= 0:
            in_use[group_id] -= len(blocks)
        else:  # pages of several groups: counted per group in one C pass
            for group, n in Counter(map(_group_of, blocks)).items():
                in_use[group] -= n

    @staticmethod
    def _drop_refs(blocks: Iterable[KVCacheBlock]) -> list[KVCacheBlock]:
        """Drop one reference per block, in the order given; returns those left with none.
        RuntimeError on a double free, with every count as it was."""
        if type(blocks) is not list:
            blocks = list(blocks)
        now_free = []
        for i, block in enumerate(blocks):
            n = block.ref_cnt - 1
            if n < 0:
                for b in blocks[:i]:  # a bad free leaves the pool as it was
                    b.ref_cnt += 1
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt = n
            if n == 0:
                now_free.append(block)
        return now_free

    def reused(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Tell the policy these cached blocks were asked for again though not taken."""
        queue = self.free_queue
        for block in blocks:
            queue.reused(block)

    # ---- prefix cache ------------------------------------------------------------------------
    def root_serial(self, cache_salt: str | None) -> int:
        """The parent serial of first blocks under this salt: derived from the salt alone, so
        the pool keeps nothing per salt (see `kvstore.hashing.root_serial`)."""
        return root_serial(cache_salt)

    def find_cached(self, group_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                    parent_serial: int) -> KVCacheBlock | None:
        """A full cached block with this hash, these stored tokens and this parent."""
        return self.hash_index.probe(group_id, block_hash, token_ids, parent_serial)

    def cached_blocks(self, group_id: int, block_hash: BlockHash,
                      token_ids: Sequence[int]) -> list[KVCacheBlock]:
        """Every full cached block with this hash and these stored tokens, whatever its parent."""
        token_ids = tuple(token_ids)
        return [b for b in self.hash_index.blocks(group_id, block_hash)
                if b.token_ids == token_ids]

    def new_serial(self) -> int:
        """A serial no cached block has: the parent of blocks that follow unknown content."""
        serial = self._next_serial
        self._next_serial += 1
        return serial

    def twin_serial(self, block_hash: BlockHash, parent_serial: int, token_ids: tuple[int, ...],
                    group_ids: Iterable[int]) -> int:
        """The serial of a full cached block with this hash, parent and tokens in any of
        `group_ids` (searched in order), or 0 if there is none."""
        block = self.hash_index.probe_any(group_ids, block_hash, token_ids, parent_serial)
        return 0 if block is None else block.serial

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash,
                         token_ids: tuple[int, ...], parent_serial: int,
                         parent_hash: BlockHash | None = None, serial: int = 0) -> int:
        """Index a full block (in use by the caller); returns its content serial: `serial` if
        given, else that of a twin in its group (same parent, same tokens), else a new one."""
        if block.token_ids is not None:
            raise RuntimeError(f"block {block.block_id} is already cached")
        group = block.group_id
        if serial == 0:
            # Same parent and same tokens means same content: share the serial so chains
            # computed independently by concurrent requests link up.
            serial = (self.twin_serial(block_hash, parent_serial, token_ids, (group,))
                      or self.new_serial())
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.serial = serial
        block.parent_serial = parent_serial
        if self._index_children:
            self._add_child(group, parent_serial, token_ids, block.block_id)
        self.hash_index.add(group, block_hash, block)
        self.cached_by_group[group] += 1
        if self.enable_events:
            self._events.append(BlockStored(block_hash, parent_hash, token_ids, group,
                                            self.group_kind(group)))
        return serial

    def cache_partial_block(self, block: KVCacheBlock, token_ids: tuple[int, ...],
                            parent_serial: int) -> None:
        """Index a partially filled block by its tokens so later prompts can copy from it."""
        if block.token_ids is not None:
            raise RuntimeError(f"block {block.block_id} is already cached")
        if not self.index_partial_blocks:
            raise RuntimeError("this pool does not index partial blocks")
        block.token_ids = token_ids
        block.serial = 0
        block.parent_serial = parent_serial
        self._add_child(block.group_id, parent_serial, token_ids, block.block_id)
        self.cached_by_group[block.group_id] += 1

    def _add_child(self, group_id: int, parent_serial: int, token_ids: tuple[int, ...],
                   block_id: int) -> None:
        key = (group_id, parent_serial)
        siblings = self._children.get(key)
        if siblings is None:
            self._children[key] = [(token_ids, block_id)]
        else:
            insort(siblings, (token_ids, block_id))

    def children(self, group_id: int, serial: int) -> Sequence[tuple[tuple[int, ...], int]]:
        """The cached full and partial blocks of this group whose parent content is `serial`,
        as (token ids, block id) sorted by tokens (read only); raises where the pool keeps
        no such index."""
        if not self._index_children:
            raise RuntimeError("this pool keeps no index of children (see index_children)")
        return self._children.get((group_id, serial), ())

    def longest_partial_match(self, group_id: int, parent_serial: int, query: tuple[int, ...]
                              ) -> PartialMatch:
        """The indexed child of `parent_serial` sharing the longest token prefix with `query`."""
        siblings = self._children.get((group_id, parent_serial))
        if not siblings or not query:
            return PartialMatch(None, 0)
        # In sorted order the longest common prefix with `query` sits next to its insertion
        # point, and shrinks moving away from it: the nearest entry on each side is the best
        # there.
        i = bisect_left(siblings, (query,))
        best, best_len = None, 0
        for j in (i - 1, i):
            if 0 <= j < len(siblings):
                tokens, block_id = siblings[j]
                n = common_prefix_len(tokens, query)
                if n > best_len:
                    best, best_len = self.blocks[block_id], n
        return PartialMatch(best, best_len)

    def _evict(self, blocks: list[KVCacheBlock], leaving: range = _NO_BLOCKS) -> None:
        """Drop cached blocks' content from every index, in order (telling a content-tracking
        policy, and marking the children orphans when no twin keeps the content); pages whose
        ids are in `leaving` are not marked (they leave the free queue with these)."""
        if not self._index_children:
            self._drop_content(blocks)
            return
        children, tracks = self._children, self._marks_orphans
        hook, chained = self._evicted_hook, self._chained_groups
        for block in blocks:
            key = (block.group_id, block.parent_serial)
            siblings = children[key]
            if len(siblings) == 1:  # most blocks: the only child of their parent
                del children[key]
                siblings = []
            else:
                del siblings[bisect_left(siblings, (block.token_ids, block.block_id))]
                if not siblings:
                    del children[key]
            if tracks:
                if hook is not None:
                    hook(block)
                if block.block_hash is not None and (chained is None
                                                     or block.group_id in chained):
                    self._orphan_children(block, siblings, leaving)
        # Dropped after all the marking: marking finds twins and children through the
        # children index, which each of these blocks has already left.
        self._drop_content(blocks)

    def uncache(self, blocks: list[KVCacheBlock]) -> None:
        """Drop the index entries and content of blocks in use that were indexed before their
        tokens were computed and never will be (not counted as evictions)."""
        if any(block.ref_cnt <= 0 or block.token_ids is None for block in blocks):
            raise RuntimeError("only indexed blocks in use can be uncached")
        self._evict(blocks)
        self.stats.evictions -= len(blocks)
        for block in blocks:
            self.evicted_by_group[block.group_id] -= 1

    def _drop_content(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Remove pages' hash-index entries (announced as removed) and their content, each
        counted as an eviction of its group."""
        remove = self.hash_index.remove
        events = self._events if self.enable_events else None
        cached, evicted = self.cached_by_group, self.evicted_by_group
        dropped = self._dropped
        for block in blocks:
            block_hash, group = block.block_hash, block.group_id
            if block_hash is not None:
                remove(group, block_hash, block)
                if events is not None:
                    events.append(BlockRemoved(block_hash, group, self.group_kind(group)))
            block.block_hash = block.token_ids = None
            block.serial = block.parent_serial = 0
            block.orphan = False
            cached[group] -= 1
            evicted[group] += 1
            dropped.append(block.block_id)
        self.stats.evictions += len(blocks)
        while len(dropped) > _DROPPED_KEPT:
            del dropped[:_DROPPED_KEPT // 2]
            self._dropped_base += _DROPPED_KEPT // 2

    @property
    def cache_epoch(self) -> int:
        """A count of the drops of cached content (and resets) so far: lookups taken at the
        same epoch are current."""
        return self._dropped_base + len(self._dropped)

    def dropped_since(self, epoch: int) -> list[int] | None:
        """The ids of the pages whose cached content was dropped since `cache_epoch` was
        `epoch`, or None when that is no longer known (the cache was reset since, or it
        is too long ago)."""
        start = epoch - self._dropped_base
        return None if start < 0 else self._dropped[start:]

    def _orphan_children(self, block: KVCacheBlock, siblings: list[tuple[tuple[int, ...], int]],
                         leaving: range = _NO_BLOCKS) -> None:
        """Mark the children of an evicted full block orphans unless a twin (same parent,
        same tokens, same serial) still holds its content (pages whose ids are in `leaving`
        excepted)."""
        children = self._children.get((block.group_id, block.serial))
        if not children and len(self._unit_groups) < 2:
            return  # nothing to mark (most evictions: a chain's deepest cached block)
        if self._twin_keeps(block, siblings):
            return
        queue = self.free_queue
        for g in self._unit_groups:
            if g != block.group_id:
                self._orphan_twins(g, block, leaving)
        if not children:
            return
        for _, child_id in children:
            child = self.blocks[child_id]
            if not child.orphan and child_id not in leaving:
                child.orphan = True
                if child.ref_cnt == 0:
                    queue.orphaned(child)

    def _twin_keeps(self, block: KVCacheBlock, siblings: list[tuple[tuple[int, ...], int]]) -> bool:
        """Whether a full block among `siblings` (the cached children of `block`'s parent, less
        `block`) holds `block`'s content: same tokens, same serial."""
        i = bisect_left(siblings, (block.token_ids,))
        while i < len(siblings) and siblings[i][0] == block.token_ids:
            twin = self.blocks[siblings[i][1]]
            if twin.block_hash is not None and twin.serial == block.serial:
                return True
            i += 1
        return False

    def _orphan_twins(self, group_id: int, block: KVCacheBlock, leaving: range) -> None:
        """Mark the full blocks of `group_id` holding `block`'s content (same parent, tokens
        and serial) orphans (pages whose ids are in `leaving` excepted)."""
        siblings = self._children.get((group_id, block.parent_serial))
        if not siblings:
            return
        i = bisect_left(siblings, (block.token_ids,))
        while i < len(siblings) and siblings[i][0] == block.token_ids:
            twin = self.blocks[siblings[i][1]]
            if (twin.block_hash is not None and twin.serial == block.serial and not twin.orphan
                    and twin.block_id not in leaving):
                twin.orphan = True
                if twin.ref_cnt == 0:
                    self.free_queue.orphaned(twin)
            i += 1

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; refuses (returns False) while any block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            block.block_hash = None
            block.token_ids = None
            block.serial = 0
            block.parent_serial = 0
            block.orphan = False
        self.hash_index.clear()
        self._children.clear()
        self.cached_by_group.clear()
        self.free_queue.reset()
        self._dropped_base = self.cache_epoch + 1  # the reset's own epoch
        self._dropped.clear()
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the events recorded since the last call."""
        events, self._events = self._events, []
        return events

    # ---- introspection -----------------------------------------------------------------------
    def block_states(self) -> tuple[BlockState, ...]:
        """A snapshot of every block but the null block, by block id."""
        return tuple(BlockState(b.block_id, b.ref_cnt, b.pin_cnt, b.group_id, b.token_ids is not None,
                                b.block_hash) for b in self.blocks[1:])

    def num_cached_blocks(self) -> int:
        """Blocks in the full-block hash index."""
        return len(self.hash_index)

    def index_entries(self) -> list[tuple[int, int, int, tuple[int, ...]]]:
        """(block_id, group, parent_serial, tokens) of every indexed block, for invariant checks."""
        if not self._index_children:  # only full blocks are indexed: the hash index has them
            return [(b.block_id, b.group_id, b.parent_serial, b.token_ids)
                    for b in self.blocks[1:] if b.token_ids is not None]
        out = []
        for (group, parent), siblings in self._children.items():
            for tokens, block_id in siblings:
                out.append((block_id, group, parent, tokens))
        return out

    def hash_entries(self) -> list[tuple[int, int, BlockHash]]:
        """(block_id, group, hash) of every full-block index entry, for invariant checks."""
        return self.hash_index.entries()



class PendingCopies:
    """Copy-on-write work the worker has not run yet, and the pins that keep its pages alive.

    A pin is one reference on a copy's source or destination, held from the moment the copy
    is queued until the worker has run it: `take` hands the queued copies out and releases
    the pins of the batch it handed out before. A copy between two pages the caller keeps
    holding (`queue_held`) is pinned only if the caller lets go of one of them before then
    (`pin_pending`)."""

    __slots__ = ("_pool", "_copies", "_pins", "_pins_handed_out", "_held", "_held_handed_out")

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._copies: list[tuple[int, int]] = []
        self._pins: list[KVCacheBlock] = []
        self._pins_handed_out: list[KVCacheBlock] = []
        # Pages of `queue_held` copies, by id: of the queued batch, of the handed-out one.
        self._held: dict[int, KVCacheBlock] = {}
        self._held_handed_out: dict[int, KVCacheBlock] = {}

    def pin(self, block: KVCacheBlock) -> None:
        """Mark one reference the caller holds on `block` as held by the pending copies."""
        block.pin_cnt += 1
        self._pins.append(block)

    def queue(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Queue a copy of `src`'s page into `dst`'s (both pinned by the caller)."""
        self._copies.append((src.block_id, dst.block_id))
        self._pool.stats.copies_queued += 1

    def queue_held(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Queue a copy between two pages the caller holds; before it drops its reference on
        either, it calls `pin_pending` on it."""
        self.queue(src, dst)
        self._held[src.block_id] = src
        self._held[dst.block_id] = dst

    def pin_pending(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Pin those of `blocks` that a `queue_held` copy not run yet reads or writes, until
        the worker has run it (the caller is about to drop its reference)."""
        for block in blocks:
            for held, pins in ((self._held, self._pins),
                               (self._held_handed_out, self._pins_handed_out)):
                if block.block_id in held:
                    block.ref_cnt += 1  # held by the caller: in no free list, and not a use
                    block.pin_cnt += 1
                    pins.append(block)
                    break

    def take(self) -> list[tuple[int, int]]:
        """The queued (src, dst) copies, in an order that runs as one gather and one scatter;
        releases the pins of the previous batch."""
        if not (self._copies or self._pins_handed_out or self._pins or self._held_handed_out):
            return []
        if self._pins_handed_out:
            for block in self._pins_handed_out:
                block.pin_cnt -= 1
            self._pool.free_blocks(self._pins_handed_out)
        self._pins_handed_out, self._pins = self._pins, []
        self._held_handed_out, self._held = self._held, {}
        pending = self._copies
        if not pending:
            return []
        self._copies = []
        if len(pending) == 1:  # nothing to chain
            return pending
        copies = []
        # A copy out of a block that an earlier copy of this batch fills reads that
        # copy's source instead, so the batch can run as one gather and one scatter.
        src_of: dict[int, int] = {}
        for src, dst in pending:
            src = src_of.get(src, src)
            src_of[dst] = src
            copies.append((src, dst))
        return copies

    def queued_into(self, block_id: int) -> bool:
        """Whether a queued copy (not handed out yet) writes page `block_id`."""
        return any(dst == block_id for _, dst in self._copies)

    @property
    def pinned_block_ids(self) -> tuple[int, ...]:
        """Ids of the pinned blocks, queued batch then handed-out batch (one entry per pin)."""
        return tuple(b.block_id for b in self._pins) + tuple(b.block_id for b in self._pins_handed_out)


#: Optional checkpoints of a kind (prompt ends, output ends) take a page holding cached
#: content only while at least this share of that kind's settled chances were hits (see
#: `TwoSizeBlockPool.admit_checkpoint`) ...
ADMIT_HIT_RATIO = 0.1
#: ... once this many (decayed) chances of the kind are settled ...
ADMIT_WARMUP = 8
#: ... each settled chance weighing this much less than the next.
ADMIT_DECAY = 1 - 1 / 64
#: Refused checkpoints remembered by hash, per large page of the pool.
REFUSED_PER_LARGE_PAGE = 4


class TwoSizeBlockPool(BlockPool):
    """A pool with pages of two sizes over one memory budget: blocks (small pages, one per
    attention block) and large pages of `large_page_blocks` (k) consecutive blocks each,
    which hold one recurrent state (a request's working state or a checkpoint).

    Large page j spans blocks [j * k, (j + 1) * k); its id is `num_blocks + j`. A large page
    is whole (free and empty, a free cached checkpoint, or in use) or split: its blocks are
    then pages of their own, in the eviction policy's free queue while free. Small pages
    come from split large pages: free empty blocks of split pages first, then a whole empty
    large page is split, then checkpoints worth nothing (their full-attention chain gone,
    or an interior point of one chain, where the policy's checkpoint order tracks chains)
    and stale ones (no hit used them and the pool handed out its whole capacity since they
    were freed), then cached blocks are evicted (the policy's
    order), then cached checkpoints (the policy's checkpoint order: least recently freed
    first, or by worth). A split page returns whole as soon as its last block is freed
    empty, and is reclaimed (its cached blocks evicted) when a large page is needed and
    none is free whole. Large page 0 holds the null block and stays split.
    `recurrent_groups` are the groups whose pages are large. Free lists are O(1) (a worth
    order: O(log n)); `num_free_blocks` counts free capacity in blocks (a free whole page
    counts k)."""

    def __init__(self, num_blocks: int, large_page_blocks: int,
                 recurrent_groups: frozenset[int], enable_caching: bool = True,
                 enable_events: bool = False, index_partial_blocks: bool = True,
                 eviction: str | EvictionPolicy = DEFAULT_EVICTION,
                 chained_groups: frozenset[int] | None = None, num_groups: int = 1,
                 bytes_per_block: int = 1, group_kinds: Sequence[GroupKind] = (),
                 index_children: bool = False) -> None:
        k = large_page_blocks
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"large_page_blocks must be a positive int, got {k!r}")
        if num_blocks < 2 * k or num_blocks % k:
            raise ValueError(f"a two-size pool needs a multiple of {k} blocks, at least {2 * k} "
                             f"(one large page beside the null block's), got {num_blocks}")
        super().__init__(num_blocks, enable_caching, enable_events, index_partial_blocks,
                         eviction, chained_groups, num_groups, group_kinds, index_children)
        self.large_page_blocks = k
        self.bytes_per_block = bytes_per_block
        self.recurrent_groups = recurrent_groups
        # Unit-tracking policies orphan twins in attention groups only (small pages).
        self._unit_groups = tuple(g for g in self._unit_groups if g not in recurrent_groups)
        self.num_large = num_blocks // k
        self.large_blocks = [KVCacheBlock(num_blocks + j) for j in range(self.num_large)]
        # Per large page: whether it is split, and how many of its blocks are in use (the
        # null block counts as in use).
        self._split = [False] * self.num_large
        self._used = [0] * self.num_large
        self._split[0] = True
        self._used[0] = 1
        queue = self.free_queue
        for block in self.blocks[k:]:
            queue.remove(block)
        # Whole free large pages: empty ones (a stack) and cached checkpoints (the policy's
        # checkpoint order).
        self._large_empty: list[KVCacheBlock] = self.large_blocks[:0:-1]
        self._large_cached = self.free_queue.checkpoints()
        # Groups whose evicted blocks can leave a checkpoint without its chain (where the
        # checkpoint order wants to know).
        self._chain_groups = (
            frozenset() if not self._large_cached.tracks_chains
            else (chained_groups if chained_groups is not None
                  else frozenset(range(num_groups))) - recurrent_groups)
        if self._chain_groups:  # evictions look for the checkpoints they leave chainless
            self._marks_orphans = self._index_children = True
        # Split pages none of whose blocks is in use, in the order they became so.
        self._empty_split: dict[int, None] = {}
        # Free blocks of split pages that hold cached content: in all, and per page.
        self._free_cached = 0
        self._page_cached = [0] * self.num_large
        self.large_in_use_by_group: defaultdict[int, int] = defaultdict(int)
        # Blocks of capacity handed out so far (k per large page), and the free checkpoints
        # no hit has used and not at a branch of their chain when freed, by that count when
        # they were freed (oldest first): one freed `_stale_after` blocks ago or more is
        # stale, evicted before cached blocks. The hashes of the last stale checkpoints
        # evicted (at most one per large page): a lookup that wanted one of them raises
        # `_stale_after` by the pool's capacity; each stale eviction lowers it by a large
        # page, to the capacity at least.
        self._handed_out = 0
        self._unhit: dict[int, int] = {}
        self._stale_after = num_blocks
        self._stale_evicted: dict[BlockHash, None] = {}
        # Admission of optional checkpoints (see `admit_checkpoint`): per kind, the decayed
        # counts of settled chances and of those that were hits; the kind of each cached
        # optional checkpoint not yet settled; the hashes of the last ones refused, with
        # their kind.
        self._admission: dict[str, list[float]] = {}
        self._kind_of: dict[int, str] = {}
        self._refused: dict[BlockHash, str] = {}
        # Whether a tier below keeps what requests release (see `admit_checkpoint`).
        self.tiered = False
        # Cached checkpoints by the serial of the prefix they hold.
        self._checkpoints_at: dict[int, list[KVCacheBlock]] = {}

    def group_kind(self, group_id: int) -> GroupKind:
        """See BlockPool.group_kind; "recurrent" for a recurrent group without given kinds."""
        if not self._group_kinds and group_id in self.recurrent_groups:
            return "recurrent"
        return super().group_kind(group_id)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Free capacity in blocks: free blocks of split pages plus k per free whole page."""
        return len(self.free_queue) + self.large_page_blocks * (
            len(self._large_empty) + len(self._large_cached))

    @property
    def num_free_large_pages(self) -> int:
        """Large pages a large allocation can take now: whole free ones (empty or a cached
        checkpoint) and split ones with no block in use."""
        return len(self._large_empty) + len(self._large_cached) + len(self._empty_split)

    def large_pages_fit(self, n: int, hit_blocks: Iterable[KVCacheBlock]) -> bool:
        """Whether n large pages are free once the free blocks among `hit_blocks` are
        referenced (a split page none of whose blocks is in use then has one)."""
        whole = len(self._large_empty) + len(self._large_cached)
        if n <= whole:
            return True
        k = self.large_page_blocks
        taken = {b.block_id // k for b in hit_blocks
                 if b.ref_cnt == 0 and b.block_id != 0 and b.block_id < self.num_blocks}
        split = self._empty_split
        return n <= whole + len(split) - sum(1 for j in taken if j in split)

    @property
    def num_split_pages(self) -> int:
        """Large pages split into blocks (page 0, with the null block, included)."""
        return sum(self._split)

    @property
    def num_fragmented_blocks(self) -> int:
        """Free blocks inside large pages that have some block in use: capacity no large
        allocation can take until those blocks are freed."""
        k = self.large_page_blocks
        return sum(k - used for split, used in zip(self._split, self._used, strict=True)
                   if split and used)

    @property
    def fragmented_bytes(self) -> int:
        """`num_fragmented_blocks` in bytes."""
        return self.num_fragmented_blocks * self.bytes_per_block

    def is_large(self, block: KVCacheBlock) -> bool:
        """Whether `block` is a large page of this pool."""
        return block.block_id >= self.num_blocks

    def large_page_of(self, block_id: int) -> int:
        """The index of the large page a block lies in."""
        return block_id // self.large_page_blocks

    # ---- small pages -------------------------------------------------------------------------
    def get_new_blocks(self, n: int, group_id: int) -> list[KVCacheBlock]:
        """Take n blocks: free empty blocks of split pages, then blocks of newly split empty
        pages, then of split checkpoints worth nothing or stale, then (evicting) cached
        blocks, then blocks of split cached checkpoints."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        queue = self.free_queue
        if n > len(queue) - self._free_cached:
            if n > self.num_free_blocks:
                raise RuntimeError(f"asked for {n} blocks with {self.num_free_blocks} free")
            self._split_for(n)
        blocks = queue.take(n, self._evict_free)
        k = self.large_page_blocks
        used, empty_split = self._used, self._empty_split
        for block in blocks:
            block.ref_cnt = 1
            block.uses = 0
            block.hint = -1
            block.group_id = group_id
            j = block.block_id // k
            if used[j] == 0:
                del empty_split[j]
            used[j] += 1
        if n:
            self.in_use_by_group[group_id] += n
            self._handed_out += n
        return blocks

    def _split_for(self, n: int) -> None:
        """Split large pages until n free blocks are empty (whole empty pages, then spent
        checkpoints) or, failing that, until n blocks are free (cached checkpoints)."""
        queue = self.free_queue
        while n > len(queue) - self._free_cached and self._large_empty:
            self._split_page(self._large_empty.pop())
        while n > len(queue) - self._free_cached:
            spent = self._pop_spent()
            if spent is None:
                break
            self._evict_large(spent)
            self._split_page(spent)
        while n > len(queue):
            page = self._large_cached.pop()
            self._evict_large(page)
            self._split_page(page)

    def _pop_spent(self) -> KVCacheBlock | None:
        """A free checkpoint worth nothing (where the order tracks chains), else a stale one,
        taken out of the checkpoint order; None if there is neither."""
        return self._large_cached.pop_worthless() or self._pop_stale()

    def _pop_stale(self) -> KVCacheBlock | None:
        """The free checkpoint no hit used (and not at a branch of its chain) that was freed
        longest ago, if it is stale (taken out of the checkpoint order)."""
        page_id = self._stale_head()
        if page_id is None:
            return None
        page = self.large_blocks[page_id - self.num_blocks]
        self._large_cached.remove(page)
        assert page.block_hash is not None
        evicted = self._stale_evicted
        evicted[page.block_hash] = None
        if len(evicted) > self.num_large:
            del evicted[next(iter(evicted))]
        self._stale_after = max(self.num_blocks, self._stale_after - self.large_page_blocks)
        return page

    @property
    def stale_evicted(self) -> dict[BlockHash, None]:
        """The hashes of the last checkpoints evicted as stale (read only: a lookup reports
        one it wanted through `wanted_stale`)."""
        return self._stale_evicted

    @property
    def stale_after(self) -> int:
        """Blocks the pool hands out after a checkpoint no hit used was freed before that
        checkpoint is stale."""
        return self._stale_after

    def wanted_stale(self, block_hash: BlockHash) -> None:
        """A lookup wanted the checkpoint of this hash, evicted as stale: checkpoints stay
        one pool capacity longer before they are stale."""
        if block_hash in self._stale_evicted:
            del self._stale_evicted[block_hash]
            self._stale_after += self.num_blocks

    def _stale_head(self) -> int | None:
        """The page id of the free checkpoint no hit used that was freed longest ago, if it
        is stale."""
        if not self._unhit:
            return None
        page_id, when = next(iter(self._unhit.items()))
        return page_id if when + self._stale_after <= self._handed_out else None

    def has_spare_large_page(self) -> bool:
        """Whether a large page is free that holds nothing of worth: whole and empty, or a
        checkpoint worth nothing or stale."""
        return (bool(self._large_empty) or self._large_cached.has_worthless()
                or self._stale_head() is not None)

    def admit_checkpoint(self, kind: str) -> bool:
        """Whether to take an optional checkpoint of `kind` (a prompt's or an output's end,
        which the caller may skip) now: yes when the pool is `tiered` (a tier below keeps
        what requests release: room taken from cached content is lost on the device only,
        and the checkpoint offloads) or a spare large page is free (`has_spare_large_page`),
        else only while the kind's chances settle as hits often enough (`ADMIT_HIT_RATIO`
        of them, decayed, after `ADMIT_WARMUP`). A chance settles as a hit when a
        checkpoint taken is first hit or a lookup wants one refused, as a miss when one
        taken is evicted unhit or one refused is no longer remembered (the caller reports
        refusals through `refused_checkpoint`)."""
        record = self._admission.setdefault(kind, [0.0, 0.0])
        return (self.tiered or self.has_spare_large_page() or record[0] < ADMIT_WARMUP
                or record[1] >= ADMIT_HIT_RATIO * record[0])

    @property
    def admission(self) -> dict[str, tuple[float, float]]:
        """Per optional kind asked about: (settled chances, hits among them), decayed."""
        return {kind: (record[0], record[1]) for kind, record in self._admission.items()}

    def refused_checkpoint(self, kind: str, block_hash: BlockHash) -> None:
        """A checkpoint of `kind` at the prefix ending with a block of this hash was refused
        (`admit_checkpoint`); the last `REFUSED_PER_LARGE_PAGE` per large page are
        remembered."""
        self.stats.checkpoints_refused += 1
        refused = self._refused
        refused.pop(block_hash, None)
        refused[block_hash] = kind
        if len(refused) > REFUSED_PER_LARGE_PAGE * self.num_large:
            self._settle(refused.pop(next(iter(refused))), False)

    @property
    def refused(self) -> dict[BlockHash, str]:
        """The hashes of the last checkpoints refused, with their kind (read only: a lookup
        reports one it wanted through `wanted_refused`)."""
        return self._refused

    def wanted_refused(self, block_hash: BlockHash) -> None:
        """A lookup wanted a checkpoint refused at this hash: a hit for its kind."""
        kind = self._refused.pop(block_hash, None)
        if kind is not None:
            self._settle(kind, True)

    def _settle(self, kind: str, hit: bool) -> None:
        """One chance of an optional checkpoint of `kind` settled."""
        record = self._admission[kind]
        record[0] = record[0] * ADMIT_DECAY + 1
        record[1] = record[1] * ADMIT_DECAY + hit

    def _continuations(self, serial: int) -> int:
        """How many ways the cached full-attention chain continues after the prefix of
        content `serial` (0 where the checkpoint order tracks no chains)."""
        chain = self._chain_groups
        return len(self.children(min(chain), serial)) if chain else 0

    def _evict_free(self, blocks: list[KVCacheBlock]) -> None:
        """Evict free cached blocks the policy is handing out."""
        self._free_cached -= len(blocks)
        page_cached, k = self._page_cached, self.large_page_blocks
        for block in blocks:
            page_cached[block.block_id // k] -= 1
        self._evict(blocks)

    def _split_page(self, page: KVCacheBlock) -> None:
        """Hand a whole free empty large page's blocks to the free queue."""
        j = page.block_id - self.num_blocks
        k = self.large_page_blocks
        self._split[j] = True
        self._used[j] = 0
        self._empty_split[j] = None
        self.free_queue.freed_all(self.blocks[j * k:(j + 1) * k])

    def _merge_page(self, j: int) -> KVCacheBlock:
        """Take a split page none of whose blocks is in use out of the free queue, whole and
        empty (its cached blocks evicted)."""
        k = self.large_page_blocks
        queue = self.free_queue
        del self._empty_split[j]
        self._free_cached -= self._page_cached[j]
        self._page_cached[j] = 0
        blocks = self.blocks[j * k:(j + 1) * k]
        # Evicted while still queued; none of them is marked an orphan (all leave the queue).
        self._evict([block for block in blocks if block.token_ids is not None],
                    range(j * k, (j + 1) * k))
        for block in blocks:
            queue.remove(block)
        self._split[j] = False
        return self.large_blocks[j]

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each page (either size); free ones leave their list."""
        k, num_blocks = self.large_page_blocks, self.num_blocks
        unqueue = self.free_queue.remove
        used, page_cached, empty_split = self._used, self._page_cached, self._empty_split
        in_use = self.in_use_by_group
        for block in blocks:
            if block.ref_cnt == 0:
                block_id = block.block_id
                if block_id == 0:
                    raise ValueError("the null block cannot be referenced")
                if block_id >= num_blocks:
                    self._take_free_checkpoint(block)
                else:
                    unqueue(block)
                    j = block_id // k
                    if block.token_ids is not None:
                        self._free_cached -= 1
                        page_cached[j] -= 1
                    if not used[j]:
                        del empty_split[j]
                    used[j] += 1
                    in_use[block.group_id] += 1
            block.ref_cnt += 1
            block.uses += 1

    def _take_free_checkpoint(self, page: KVCacheBlock) -> None:
        """A free cached checkpoint is referenced again (a hit): out of the checkpoint order,
        its kind's chance settled as a hit."""
        kind = self._kind_of.pop(page.block_id, None)
        if kind is not None:
            self._settle(kind, True)
        self._large_cached.remove(page)
        self._unhit.pop(page.block_id, None)
        self.large_in_use_by_group[page.group_id] += 1
        self.in_use_by_group[page.group_id] += self.large_page_blocks

    def free_blocks(self, blocks: Iterable[KVCacheBlock], group_id: int = -1) -> None:
        """Drop one reference per page (either size), in the order given; a split page whose
        blocks are all free and empty returns whole."""
        dropped = self._drop_refs(blocks)
        if not dropped:
            return
        num_blocks, k = self.num_blocks, self.large_page_blocks
        used, page_cached = self._used, self._page_cached
        now_free: list[KVCacheBlock] = []
        large: list[KVCacheBlock] = []
        emptied: list[int] = []
        num_cached = 0
        for block in dropped:
            block_id = block.block_id
            if block_id >= num_blocks:
                large.append(block)
                continue
            now_free.append(block)
            j = block_id // k
            if block.token_ids is not None:
                num_cached += 1
                page_cached[j] += 1
            used[j] -= 1
            if not used[j]:
                emptied.append(j)
        if large:
            self._freed_large(large)
            if not now_free:
                return
        self._count_freed(now_free, group_id)
        self._free_cached += num_cached
        self.free_queue.freed_all(now_free)
        for j in emptied:
            self._empty_split[j] = None
            if not page_cached[j]:  # nothing cached in it: the page returns whole
                self._large_empty.append(self._merge_page(j))

    def _freed_large(self, pages: list[KVCacheBlock]) -> None:
        """Large pages whose last reference was dropped: to the empty stack, or (cached) to
        the checkpoint order."""
        in_use = self.in_use_by_group
        for page in pages:
            in_use[page.group_id] -= self.large_page_blocks
            self.large_in_use_by_group[page.group_id] -= 1
            if page.token_ids is None:
                self._large_empty.append(page)
            else:
                self._large_cached.freed(page)
                if not page.uses and self._continuations(page.serial) < 2:
                    self._unhit[page.block_id] = self._handed_out

    # ---- large pages -------------------------------------------------------------------------
    def get_large_pages(self, n: int, group_id: int) -> list[KVCacheBlock]:
        """Take n large pages: whole empty ones, then checkpoints worth nothing (where
        tracked) and stale ones, then split pages with no block in use (their cached blocks
        evicted, the page emptied longest ago first), then cached checkpoints (the policy's
        checkpoint order). RuntimeError, changing nothing, if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of large pages ({n})")
        if n > self.num_free_large_pages:
            raise RuntimeError(f"asked for {n} large pages with {self.num_free_large_pages} free")
        pages = []
        for _ in range(n):
            spent = None if self._large_empty else self._pop_spent()
            if self._large_empty:
                page = self._large_empty.pop()
            elif spent is not None:
                page = spent
                self._evict_large(page)
            elif self._empty_split:
                page = self._merge_page(next(iter(self._empty_split)))
            else:
                page = self._large_cached.pop()
                self._evict_large(page)
            page.ref_cnt = 1
            page.uses = 0
            page.group_id = group_id
            pages.append(page)
        if n:
            self.in_use_by_group[group_id] += n * self.large_page_blocks
            self.large_in_use_by_group[group_id] += n
            self._handed_out += n * self.large_page_blocks
        return pages

    def cache_checkpoint(self, page: KVCacheBlock, block_hash: BlockHash,
                         token_ids: tuple[int, ...], parent_serial: int, serial: int,
                         parent_hash: BlockHash | None = None, worth: float = 0.0,
                         kind: str = "") -> None:
        """Index a large page in use as the checkpoint of the prefix that ends with a block of
        this hash and these tokens under `parent_serial` (`serial`: that prefix's serial);
        `worth`: the tokens it saves per block of memory (see `kvstore.eviction`); `kind`:
        why it was taken (an optional kind's chance settles as a hit at its first hit, as a
        miss at its eviction before any: see `admit_checkpoint`)."""
        if page.block_id < self.num_blocks:
            raise RuntimeError(f"block {page.block_id} is not a large page")
        if page.token_ids is not None:
            raise RuntimeError(f"large page {page.block_id} is already cached")
        page.block_hash = block_hash
        page.token_ids = token_ids
        page.serial = serial
        page.parent_serial = parent_serial
        page.uses = 0  # from here on: the hits that restored it
        if kind in self._admission:
            self._kind_of[page.block_id] = kind
        self.hash_index.add(page.group_id, block_hash, page)
        self._checkpoints_at.setdefault(serial, []).append(page)
        self.cached_by_group[page.group_id] += 1
        self._large_cached.note(page, worth)
        self.stats.checkpoints_taken += 1
        if self.enable_events:
            self._events.append(BlockStored(block_hash, parent_hash, token_ids, page.group_id,
                                            self.group_kind(page.group_id)))

    def passed_checkpoint(self, page: KVCacheBlock, serial: int) -> None:
        """A request computed past this checkpoint (of content `serial`): hit once at most
        (by that request) and where the cached full-attention chain continues one way only
        after it, it is an interior point of one chain (told to the checkpoint order, where
        it tracks chains)."""
        if (page.token_ids is None or page.serial != serial or not self._chain_groups
                or page.uses > 1):
            return
        if self._continuations(serial) <= 1:
            self._large_cached.demote(page)

    def _evict_large(self, page: KVCacheBlock) -> None:
        """Drop a checkpoint's index entry and content."""
        assert page.block_hash is not None
        self._unhit.pop(page.block_id, None)
        kind = self._kind_of.pop(page.block_id, None)
        if kind is not None:
            self._settle(kind, False)
        at = self._checkpoints_at[page.serial]
        at.remove(page)
        if not at:
            del self._checkpoints_at[page.serial]
        self._drop_content([page])
        self._large_cached.forget(page)
        self.stats.checkpoints_evicted += 1

    def _orphan_children(self, block: KVCacheBlock, siblings: list[tuple[tuple[int, ...], int]],
                         leaving: range = _NO_BLOCKS) -> None:
        """See BlockPool._orphan_children; evicting the last block of a chain position also
        leaves the checkpoints of that position without their chain (told to the checkpoint
        order)."""
        super()._orphan_children(block, siblings, leaving)
        serial = block.serial
        at = self._checkpoints_at.get(serial)
        if at is None or block.group_id not in self._chain_groups:
            return
        pages = [page for page in at if not page.orphan]
        if not pages or self._twin_keeps(block, siblings):
            return  # no checkpoint there, or a twin keeps the chain
        for page in pages:
            page.orphan = True
            if page.ref_cnt == 0:
                self._large_cached.orphaned(page)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content of either size; every page returns whole."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self._checkpoints_at.clear()
        for page in self.large_blocks:
            page.block_hash = page.token_ids = None
            page.serial = page.parent_serial = 0
            page.orphan = False
            self._large_cached.forget(page)
        if not super().reset_prefix_cache():
            return False
        self._free_cached = 0
        self._page_cached = [0] * self.num_large
        self._unhit.clear()
        self._stale_evicted.clear()
        self._kind_of.clear()
        self._refused.clear()
        for j in list(self._empty_split):
            self._large_empty.append(self._merge_page(j))
        while len(self._large_cached):
            self._large_empty.append(self._large_cached.pop())
        return True

    # ---- introspection -----------------------------------------------------------------------
    def large_page_states(self) -> tuple[tuple[int, bool, int, int, bool], ...]:
        """Per large page: (id, split, blocks in use when split, ref count, cached)."""
        return tuple((p.block_id, self._split[j], self._used[j], p.ref_cnt,
                      p.token_ids is not None) for j, p in enumerate(self.large_blocks))

    def free_list_sizes(self) -> tuple[int, int, int, int]:
        """(free blocks in the queue, whole empty pages, cached checkpoints free, split
        pages with no block in use)."""
        return (len(self.free_queue), len(self._large_empty), len(self._large_cached),
                len(self._empty_split))
