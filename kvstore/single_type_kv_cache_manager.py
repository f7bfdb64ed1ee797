"""Per-group block tables: full attention keeps every block, sliding-window and chunked
local layers drop the ones no later query attends."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool, PendingCopies, TwoSizeBlockPool
from kvstore.request import Request
from kvstore.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    LayerSpec,
    LocalAttentionSpec,
    MLASpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)
from kvstore.utils import cdiv

if TYPE_CHECKING:
    from kvstore.kv_cache_coordinator import ComputedBlocks


def is_shared(block: KVCacheBlock) -> bool:
    """Whether another block table also holds this block (pins of pending copies aside)."""
    return block.ref_cnt - block.pin_cnt > 1


def is_read_only(block: KVCacheBlock, i: int, num_cached: int) -> bool:
    """Whether a request must not write entry `i` of its table in place: another table holds
    the page, or it is indexed content the request did not index itself (a fork parent
    computed and cached it); `num_cached` is how many leading entries the request indexed."""
    return block.ref_cnt - block.pin_cnt > 1 or (block.block_hash is not None
                                                 and i >= num_cached)


class Skippable(NamedTuple):
    """Table entries that fall out of the window, and how many of them would become free."""

    num_entries: int
    num_freed: int


NOTHING_SKIPPABLE = Skippable(0, 0)

# No bound on a computed-token count.
_UNBOUNDED = 1 << 62


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group; all groups draw from one shared pool, and queue
    their copies in the one `PendingCopies` of the cache."""

    __slots__ = ("pool", "spec", "group_id", "block_size", "_copies", "_twin_groups",
                 "_req_to_blocks", "_num_cached_blocks", "_last_serial")
    #: Whether pages past a request's window that likely hits need stay in its table until
    #: it ends (see SlidingWindowManager).
    holds_ends: bool = False

    def __init__(self, pool: BlockPool, spec: LayerSpec, group_id: int,
                 copies: PendingCopies, cache_order: Sequence[int] = ()) -> None:
        self.pool = pool
        self.spec: LayerSpec = spec
        self.group_id = group_id
        self.block_size = spec.block_size
        self._copies = copies
        # Where a newly cached block looks for a twin to take its serial from: every group
        # of the pool, so that every group names one prefix by one serial; in the order
        # the groups cache a request's blocks, so a group caching after another in one
        # call finds that group's twin with its first probe.
        self._twin_groups = tuple(cache_order) or (group_id,)
        self._req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # Serial of each request's last cached block (its next block's parent).
        self._last_serial: dict[str, int] = {}

    # ---- views -------------------------------------------------------------------------------
    def table(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table in this group (the live list: read, do not modify)."""
        return self._req_to_blocks[request_id]

    def block_ids(self, request_id: str) -> tuple[int, ...]:
        """The request's block table as ids (0 = the null block)."""
        return tuple([b.block_id for b in self._req_to_blocks[request_id]])

    def num_resident_blocks(self, request_id: str) -> int:
        """Pages the request holds in this group (null entries aside)."""
        return sum(1 for b in self._req_to_blocks[request_id] if b.block_id != 0)

    def num_cached_blocks(self, request_id: str) -> int:
        """How many leading blocks of the request's table are in the prefix cache."""
        return self._num_cached_blocks[request_id]

    # ---- hits (pure) -------------------------------------------------------------------------
    @staticmethod
    def hit_search(managers: Sequence[SingleTypeKVCacheManager], request: Request,
                   parents: Sequence[int]) -> HitSearch:
        """The hit search of one lookup over these groups of this type (one spec);
        `parents[i]` is the serial block i must hang under (the prefix before it, verified
        in the cache)."""
        raise NotImplementedError

    def kept_hit_blocks(self, hit_blocks: Sequence[KVCacheBlock],
                        num_computed_tokens: int) -> list[KVCacheBlock]:
        """The hit as the table starts: blocks the next query cannot see become null."""
        k = self.spec.first_needed_block(num_computed_tokens)
        if k == 0:
            return list(hit_blocks)
        k = min(k, len(hit_blocks))
        return [self.pool.null_block] * k + list(hit_blocks[k:])

    # ---- allocation planning (pure) ----------------------------------------------------------
    def num_skippable(self, request_id: str, num_computed_tokens: int) -> Skippable:
        """Table entries that fall out of the window, and how many of them would become free."""
        return NOTHING_SKIPPABLE

    def has_skippable(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether any table entry falls out of the window."""
        return False

    def resume_error(self, request_id: str, num_computed_tokens: int) -> str | None:
        """Why the request cannot go on from `num_computed_tokens` (its progress moved back
        past what this group holds as computed: a block it indexed), or None."""
        i = num_computed_tokens // self.block_size
        if i < self._num_cached_blocks[request_id]:
            bs = self.block_size
            return f"its block of tokens [{i * bs}, {(i + 1) * bs}) is cached already"
        return None

    def num_blocks_to_allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int,
                               hit_blocks: Sequence[KVCacheBlock] | None,
                               partial_src: KVCacheBlock | None) -> int:
        """Free blocks this allocation consumes: new pages, hits and pins taken off the queue."""
        if hit_blocks is not None:  # admission
            n = sum(1 for b in self.kept_hit_blocks(hit_blocks, num_computed_tokens)
                    if b.ref_cnt == 0 and b.block_id != 0)
            table_len = len(hit_blocks)
            if partial_src is not None:
                n += 1 + (partial_src.ref_cnt == 0)
                table_len += 1
        else:
            table = self._req_to_blocks[request_id]
            table_len = len(table)
            n = len(self._read_only_to_write(request_id, num_computed_tokens, num_tokens))
        return n + max(0, cdiv(num_tokens, self.block_size) - table_len)

    def is_noop(self, request: Request, num_tokens: int) -> bool:
        """Whether growing to `num_tokens` needs nothing: no new page, nothing newly full to
        cache, no shared page to copy, no page leaving the window."""
        rid = request.request_id
        table = self._req_to_blocks[rid]
        bs = self.block_size
        num_computed = request.num_computed_tokens
        if cdiv(num_tokens, bs) > len(table):
            return False
        if self.pool.enable_caching and num_computed // bs > self._num_cached_blocks[rid]:
            return False
        if self._read_only_to_write(rid, num_computed, num_tokens):
            return False
        return not self.has_skippable(rid, num_computed)

    def quiet_range(self, request_id: str, num_computed_tokens: int) -> tuple[int, int] | None:
        """Right after `is_noop` held at `num_computed_tokens`: (hi, max_tokens) such that
        growing to at most `max_tokens` tokens stays a no-op for every computed count in
        [num_computed_tokens, hi) until this request's table changes; None if no such
        promise can be given (a page from here on is shared or cached: another request's
        hit or a fork could change that)."""
        table = self._req_to_blocks[request_id]
        bs = self.block_size
        for i in range(num_computed_tokens // bs, len(table)):
            b = table[i]
            if b.token_ids is not None or b.ref_cnt - b.pin_cnt > 1:
                return None
        hi = ((self._num_cached_blocks[request_id] + 1) * bs if self.pool.enable_caching
              else _UNBOUNDED)
        return hi, len(table) * bs

    def _read_only_to_write(self, request_id: str, num_computed_tokens: int,
                            num_tokens: int) -> list[int]:
        """Table indexes the request writes growing to `num_tokens` whose pages it must
        replace first (`is_read_only`)."""
        table = self._req_to_blocks[request_id]
        num_cached = self._num_cached_blocks[request_id]
        bs = self.block_size
        return [i for i in range(num_computed_tokens // bs, min(cdiv(num_tokens, bs), len(table)))
                if is_read_only(table[i], i, num_cached)]

    # ---- mutation (only after the coordinator has checked the plan fits) ---------------------
    def take_hit(self, hit_blocks: list[KVCacheBlock], partial_src: KVCacheBlock | None,
                 num_computed_tokens: int) -> None:
        """Reference the kept hit blocks and pin the copy source (before any group pops new
        pages, so none of them is evicted by the admission itself)."""
        self.pool.touch(b for b in self.kept_hit_blocks(hit_blocks, num_computed_tokens)
                        if b.block_id != 0)
        if partial_src is not None:
            self.pool.touch((partial_src,))
            self._copies.pin(partial_src)

    def admit(self, request: Request, hit_blocks: list[KVCacheBlock],
              partial_src: KVCacheBlock | None, parent_serial: int) -> None:
        """Start the table from the (already referenced) hit blocks and, for a partial hit,
        a private copy of the source block; the request's next block hangs under
        `parent_serial` (the serial of the hit's prefix)."""
        rid = request.request_id
        table = self.kept_hit_blocks(hit_blocks, request.num_computed_tokens)
        if partial_src is not None:
            table.append(self._copy_destination(partial_src))
        self._req_to_blocks[rid] = table
        self._num_cached_blocks[rid] = len(hit_blocks)
        self._last_serial[rid] = parent_serial

    def note_hit_ends(self, request: Request, ends: Sequence[int]) -> None:
        """Token counts where the admitted request's lookup found a likely hit end (its hit,
        the verified prefix); only sliding-window groups use them."""

    def _copy_destination(self, src: KVCacheBlock) -> KVCacheBlock:
        """A fresh page that will receive a copy of `src`, pinned like the source until the
        copy has been handed out, so it is neither reused nor given a second copy before."""
        dst = self.pool.get_new_blocks(1, self.group_id)[0]
        self.pool.touch((dst,))
        self._copies.pin(dst)
        self._copies.queue(src, dst)
        return dst

    def release_computed(self, request: Request) -> None:
        """Cache the blocks computed so far and drop pages out of the next query's window
        (done for every group before any group allocates, so dropped pages can be reused)."""
        self.cache_blocks(request, request.num_computed_tokens)

    def allocate(self, request: Request, num_tokens: int) -> tuple[int, ...]:
        """Copy shared pages about to be written and append pages up to `num_tokens`;
        returns the ids of the appended pages."""
        pool = self.pool
        rid = request.request_id
        table = self._req_to_blocks[rid]
        bs = self.block_size
        num_computed = request.num_computed_tokens
        end = cdiv(num_tokens, bs)
        num_cached = self._num_cached_blocks[rid]
        for i in range(num_computed // bs, min(end, len(table))):
            block = table[i]
            if not is_read_only(block, i, num_cached):
                continue
            if i * bs >= num_computed:
                # Holding no token the request computed: a fresh page will do.
                table[i] = pool.get_new_blocks(1, self.group_id)[0]
                pool.free_blocks((block,))
                continue
            # Shared with a fork, or cached by one: write into a private copy; our
            # reference on the original becomes the copy's pin.
            self._copies.pin(block)
            table[i] = self._copy_destination(block)
            pool.stats.fork_copies += 1
        n_new = end - len(table)
        if n_new <= 0:
            return ()
        new_blocks = pool.get_new_blocks(n_new, self.group_id)
        table.extend(new_blocks)
        return tuple([b.block_id for b in new_blocks])

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index the request's blocks that are full and computed."""
        if not self.pool.enable_caching:
            return
        rid = request.request_id
        bs = self.block_size
        first = self._num_cached_blocks[rid]
        last = num_computed_tokens // bs
        if last <= first:
            return
        table = self._req_to_blocks[rid]
        hashes = request.block_hashes
        block_tokens = request.block_tokens
        parent_serial = self._last_serial[rid]
        pool = self.pool
        twin_serial, twin_groups = pool.twin_serial, self._twin_groups
        fresh = False  # whether parent_serial was made by this call: no block has it as parent
        for i in range(first, last):
            block = table[i]
            if block.block_hash is not None:  # shared with a fork that cached it already
                parent_serial = block.serial
                fresh = False
                continue
            tokens = block_tokens[i]
            # The serial of this content in whichever group holds it already, so that the
            # serial names the prefix in every group (a windowed run is checked against it).
            serial = 0 if fresh else twin_serial(hashes[i], parent_serial, tokens, twin_groups)
            if block.block_id == 0:
                # Null below the window of a tier hit: nothing to index; the chain goes on
                # with the serial of a group that holds the block (full attention caches
                # first), or waits for it.
                if not serial:
                    last = i
                    break
                parent_serial = serial
                continue
            fresh = not serial
            parent_serial = pool.cache_full_block(block, hashes[i], tokens, parent_serial,
                                                  hashes[i - 1] if i else None,
                                                  serial or pool.new_serial())
        self._num_cached_blocks[rid] = last
        self._last_serial[rid] = parent_serial

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace pages no future query can attend with the null block (sliding window)."""

    def release_held(self, requests: Mapping[str, Request]) -> bool:
        """Stop holding pages past the window for every live request (`requests`, by id; see
        SlidingWindowManager); whether any were."""
        return False

    def num_held_freed(self, request_id: str, num_computed_tokens: int) -> int:
        """Pages `release_held` would free of this request's (held past the window)."""
        return 0

    def hold_windows(self, request: Request, ends: Sequence[int], parents: Sequence[int],
                     head: bool) -> None:
        """Hold the windows before these token counts, and the first one if `head` (see
        SlidingWindowManager)."""

    def null_fresh_entries(self, request_id: str, start: int, stop: int) -> None:
        """Make table entries [start, stop) null and free their pages: fresh pages, not yet
        written or cached, that a tier hit does not load (below a window's start)."""
        table = self._req_to_blocks[request_id]
        pages = [b for b in table[start:stop] if b.block_id != 0]
        table[start:stop] = [self.pool.null_block] * (stop - start)
        self.pool.free_blocks(reversed(pages))

    def free(self, request: Request) -> list[KVCacheBlock]:
        """Index computed content (full blocks and the partial tail) and forget the request;
        returns its table (the caller frees the pages)."""
        rid = request.request_id
        table = self._req_to_blocks[rid]
        num_computed = min(request.num_computed_tokens, len(table) * self.block_size)
        self.cache_blocks(request, num_computed)
        bs = self.block_size
        tail = num_computed // bs
        # The partial tail hangs under the serial of the block before it: only when the chain
        # is indexed up to there (a run below a tier hit's window may not be).
        if self.pool.index_partial_blocks and num_computed % bs and tail < len(table) \
                and self._num_cached_blocks[rid] == tail:
            block = table[tail]
            if block.ref_cnt - block.pin_cnt == 1 and block.token_ids is None and block.block_id != 0:
                self.pool.cache_partial_block(
                    block, tuple(request.token_ids[tail * bs:num_computed]), self._last_serial[rid])
        del self._req_to_blocks[rid]
        del self._num_cached_blocks[rid]
        del self._last_serial[rid]
        return table

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """The child shares every page of the parent; it counts as indexed only the blocks
        both have computed (`num_computed_tokens`)."""
        table = self._req_to_blocks[parent_id]
        self.pool.touch(b for b in table if b.block_id != 0)
        self._req_to_blocks[child_id] = list(table)
        num_cached = self._num_cached_blocks[parent_id]
        k = min(num_cached, num_computed_tokens // self.block_size)
        self._num_cached_blocks[child_id] = k
        # The serial the child's next block hangs under: that of its last indexed block.
        self._last_serial[child_id] = (self._last_serial[parent_id] if k == num_cached
                                       else table[k].parent_serial)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Every block is kept; the hit is the longest run of cached blocks from the start."""

    __slots__ = ()

    @staticmethod
    def hit_search(managers: Sequence[SingleTypeKVCacheManager], request: Request,
                   parents: Sequence[int]) -> HitSearch:
        """The hit search of one lookup over these groups of this type (one spec):
        cached blocks from block 0, each under its prefix's serial (`parents[i]`)."""
        return ChainSearch(managers, request, parents)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the positions the next query can attend are kept (the last W for a sliding
    window, the current chunk for chunked local attention: the spec's window methods say
    which); older pages return to the pool (still cached).

    Except, with `hold` (the default), the pages the lookup's evidence says later hits
    need (`hold_windows`, chosen by the coordinator): the window before each branch point
    marked on the request's hit chain (where a lookup's prompt left a cached chain that
    goes on another way: prompts sharing the prefix come back there), the window before
    the lookup's own hit end unless the cache shows the chain goes on the prompt's way
    there (it simply ended there, it ends in the output of the request that cached it, or
    another running request is computing past it: a conversation's next turn goes on past
    it), and the first window of a prompt the cache had nothing of (its prefix may be
    shared by the next prompts). They stay in its table until it ends, or until a request
    running alone cannot grow otherwise (`release_held`). Once dropped they are the first
    pages a busy pool reuses, which leaves the full-attention chain of a shared prefix
    unusable while the request that computed it still runs. The window before the prompt's
    end is not held."""

    __slots__ = ("_cursor", "_ends", "_head_blocks", "_held_ranges", "_holding",
                 "holds_ends", "drop_log")
    spec: LocalAttentionSpec

    def __init__(self, pool: BlockPool, spec: LocalAttentionSpec, group_id: int,
                 copies: PendingCopies, cache_order: Sequence[int] = (), hold: bool = True
                 ) -> None:
        super().__init__(pool, spec, group_id, copies, cache_order)
        span = spec.local_span
        assert span is not None
        self.holds_ends = hold
        self._head_blocks = span // self.block_size  # the first W (or C) tokens
        # Per request: whether it still holds pages past the window, and the table index
        # from which entries have not been dropped or kept yet.
        self._holding: dict[str, bool] = {}
        self._cursor: dict[str, int] = {}
        # Per request, the table index ranges [start, stop) within the window before a
        # likely hit end (prompt end, lookup's hit and branch points): pages freed there
        # are tagged worth keeping (KVCacheBlock.hint). And the ranges it holds (see above).
        self._ends: dict[str, list[tuple[int, int]]] = {}
        self._held_ranges: dict[str, list[tuple[int, int]]] = {}
        # Where dropped pages are reported, when someone listens: (request id, group, table
        # index, page id, before a likely hit end, let go of as held).
        self.drop_log: list[tuple[str, int, int, int, bool, bool]] | None = None

    def admit(self, request: Request, hit_blocks: list[KVCacheBlock],
              partial_src: KVCacheBlock | None, parent_serial: int) -> None:
        """Start the table (see the base class) and the prompt end as a likely hit end (a
        repeat hits one token short of it)."""
        super().admit(request, hit_blocks, partial_src, parent_serial)
        rid = request.request_id
        self._holding[rid] = self.holds_ends
        # Entries below the next query's window are null already (the hit starts there), and
        # so are those a tier admission's window starts past.
        table = self._req_to_blocks[rid]
        k = min(len(table), self.spec.first_needed_block(request.num_computed_tokens))
        while k < len(table) and table[k].block_id == 0:
            k += 1
        self._cursor[rid] = k
        p = request.num_prompt_tokens
        end_range = self.spec.hit_end_range
        self._ends[rid] = [end_range(p - 1), end_range(p)]
        self._held_ranges[rid] = []

    def note_hit_ends(self, request: Request, ends: Sequence[int]) -> None:
        """Tag the pages before these token counts too (the lookup's hit and branch point)."""
        ranges = self._ends[request.request_id]
        for end in ends:
            if end > 0:
                ranges.append(self.spec.hit_end_range(end))

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """Share the parent's pages and its hit ends; the child has dropped none yet."""
        super().fork(parent_id, child_id, num_computed_tokens)
        self._ends[child_id] = list(self._ends[parent_id])
        self._held_ranges[child_id] = list(self._held_ranges[parent_id])
        self._holding[child_id] = self._holding[parent_id]
        self._cursor[child_id] = self._cursor[parent_id]

    def free(self, request: Request) -> list[KVCacheBlock]:
        """See the base class; where the pool's eviction policy reads the tags
        (`reads_hints`), the table's pages are tagged by whether they sit before the output
        end or another likely hit end."""
        rid = request.request_id
        table = self._req_to_blocks[rid]
        if self.pool.free_queue.reads_hints:
            near = bytearray(len(table))  # 1 where a table index is before a likely hit end
            for start, stop in (self.spec.hit_end_range(min(request.num_computed_tokens,
                                                    len(table) * self.block_size)),
                                *self._ends[rid]):
                start = max(start, 0)
                if stop > start:
                    near[start:stop] = b"\x01" * (min(stop, len(near)) - min(start, len(near)))
            for block, hint in zip(table, near, strict=True):
                if block.block_id != 0:
                    block.hint = hint
        table = super().free(request)
        del self._ends[rid], self._held_ranges[rid], self._holding[rid], self._cursor[rid]
        return table

    def hold_windows(self, request: Request, ends: Sequence[int], parents: Sequence[int],
                     head: bool) -> None:
        """Right after admission: hold the pages in the window before each of these ends
        (see the class; `parents[i]`: the serial block i hangs under), and those of the
        first window if `head`; put in the table those below the next query's window that
        another request holds (shared: no free page is taken, so admission's plan is
        unchanged)."""
        rid = request.request_id
        if not self._holding[rid]:
            return
        table = self._req_to_blocks[rid]
        ranges, held = self._ends[rid], self._held_ranges[rid]
        if head:
            held.append((0, self._head_blocks))
        pool = self.pool
        for end in ends:
            if end <= 0:
                continue
            start, stop = self.spec.hit_end_range(end)
            if (start, stop) not in ranges:  # the hit ends are tagged already
                ranges.append((start, stop))
            held.append((start, stop))
            for i in range(max(start, 0), min(stop, len(table), len(parents))):
                if table[i].block_id == 0:
                    block = pool.hash_index.probe(self.group_id, request.block_hashes[i],
                                                  request.block_tokens[i], parents[i])
                    if block is not None and block.ref_cnt > block.pin_cnt:
                        pool.touch((block,))
                        table[i] = block

    def num_held_freed(self, request_id: str, num_computed_tokens: int) -> int:
        """See the base class."""
        table = self._req_to_blocks[request_id]
        k = min(len(table), self.spec.first_needed_block(num_computed_tokens))
        return sum(1 for i in range(k) if table[i].block_id != 0 and table[i].ref_cnt == 1
                   and self._held(request_id, i))

    def release_held(self, requests: Mapping[str, Request]) -> bool:
        """Stop holding pages past the window for every live request (`requests`, by id; the
        pool is short): those the window has passed at its computed count are dropped now,
        deepest first, the others as it passes them. Returns whether any request held
        pages."""
        released = False
        for rid, holding in self._holding.items():
            if not holding:
                continue
            self._holding[rid] = False
            released = True
            table = self._req_to_blocks[rid]
            k = min(len(table), self.spec.first_needed_block(requests[rid].num_computed_tokens))
            k = max(k, self._cursor[rid])
            self._cursor[rid] = k
            out = [i for i in range(k - 1, -1, -1) if table[i].block_id != 0]
            if out:
                self._drop(rid, out, held=True)
        return released

    def release_computed(self, request: Request) -> None:
        """Cache the blocks computed so far, then drop the pages out of the next query's
        window (see the base class)."""
        self.cache_blocks(request, request.num_computed_tokens)
        self.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    @staticmethod
    def hit_search(managers: Sequence[SingleTypeKVCacheManager], request: Request,
                   parents: Sequence[int]) -> HitSearch:
        """The hit search of one lookup over these groups of this type (one spec): null
        blocks, then cached blocks under their prefix's serial (`parents[i]`) covering the
        keys the next query can see before itself."""
        return WindowSearch(managers, request, parents)

    def _held(self, request_id: str, i: int) -> bool:
        """Whether table entry i is held past the window (see the class)."""
        if not self._holding[request_id]:
            return False
        for start, stop in self._held_ranges[request_id]:
            if start <= i < stop:
                return True
        return False

    def _out_of_window(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Table indexes of pages no query from `num_computed_tokens` on can attend, not
        yet null and not held, deepest first."""
        table = self._req_to_blocks[request_id]
        k = min(len(table), self.spec.first_needed_block(num_computed_tokens))
        return [i for i in range(k - 1, self._cursor[request_id] - 1, -1)
                if table[i].block_id != 0 and not self._held(request_id, i)]

    def resume_error(self, request_id: str, num_computed_tokens: int) -> str | None:
        """See the base class; also a page a query from `num_computed_tokens` on needs that
        the request let go of when its window passed it."""
        error = super().resume_error(request_id, num_computed_tokens)
        if error is not None:
            return error
        cursor = self._cursor[request_id]
        k = self.spec.first_needed_block(num_computed_tokens)
        if k >= cursor:
            return None
        table = self._req_to_blocks[request_id]
        for i in range(k, min(cursor, len(table))):
            if table[i].block_id == 0:
                bs = self.block_size
                return f"its page for tokens [{i * bs}, {(i + 1) * bs}) left the window"
        return None

    def null_fresh_entries(self, request_id: str, start: int, stop: int) -> None:
        """See the base class; the entries below `stop` count as dropped."""
        super().null_fresh_entries(request_id, start, stop)
        self._cursor[request_id] = max(self._cursor[request_id], stop)

    def has_skippable(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether the window moved past entries not yet dropped or kept."""
        k = min(len(self._req_to_blocks[request_id]),
                self.spec.first_needed_block(num_computed_tokens))
        return k > self._cursor[request_id]

    def quiet_range(self, request_id: str, num_computed_tokens: int) -> tuple[int, int] | None:
        """See the base class; also bounded where the window moves past the next entry it
        drops (the window passing held entries changes nothing: `remove_skipped_blocks`
        steps over them whenever it next runs)."""
        quiet = super().quiet_range(request_id, num_computed_tokens)
        if quiet is None:
            return None
        i = self._next_unheld(request_id, self._cursor[request_id])
        if i < len(self._req_to_blocks[request_id]):
            return min(quiet[0], self.spec.leaves_window_at(i)), quiet[1]
        return quiet

    def _next_unheld(self, request_id: str, i: int) -> int:
        """The first table index from `i` on that is not held past the window (`_held`)."""
        if not self._holding[request_id]:
            return i
        ends = self._held_ranges[request_id]
        moved = True
        while moved:
            moved = False
            for start, stop in ends:
                if start <= i < stop:
                    i, moved = stop, True
        return i

    def num_skippable(self, request_id: str, num_computed_tokens: int) -> Skippable:
        """Table entries that fall out of the window, and how many of them would become free."""
        table = self._req_to_blocks[request_id]
        skipped = self._out_of_window(request_id, num_computed_tokens)
        return Skippable(len(skipped), sum(table[i].ref_cnt == 1 for i in skipped))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace pages no future query can attend with the null block, deepest freed first
        (held pages stay)."""
        k = min(len(self._req_to_blocks[request_id]),
                self.spec.first_needed_block(num_computed_tokens))
        if k <= self._cursor[request_id]:
            return  # the window has not moved past a new entry
        out = self._out_of_window(request_id, num_computed_tokens)
        self._cursor[request_id] = k
        if out:
            self._drop(request_id, out)

    def _drop(self, request_id: str, indexes: list[int], held: bool = False) -> None:
        """Null these table entries (deepest first) and free their pages, each tagged by
        whether it sits before a likely hit end (`held`: pages let go of by `release_held`);
        reported to `drop_log` when set."""
        table = self._req_to_blocks[request_id]
        removed = []
        ends = self._ends[request_id]
        null = self.pool.null_block
        for i in indexes:
            block = table[i]
            block.hint = 0
            for start, stop in ends:
                if start <= i < stop:
                    block.hint = 1
                    break
            removed.append(block)
            table[i] = null
        log = self.drop_log
        if log is not None:
            g = self.group_id
            log.extend((request_id, g, i, b.block_id, b.hint == 1, held)
                       for i, b in zip(indexes, removed, strict=True))
        self.pool.free_blocks(removed, self.group_id)


def longest_window_hit(end: int, missing: Callable[[int], int]) -> int:
    """The longest hit of at most `end` blocks in sliding-window groups. `missing(e)` is a
    block j that the windows of a hit of `e` blocks need and do not all hold (so no hit
    ending in (j, e] is possible: windows only move right), or `e` when none is missing."""
    while end > 0:
        j = missing(end)
        if j >= end:
            return end
        end = j
    return 0


class HitSearch:
    """The longest hit of one lookup in a set of groups sharing one spec, asked again each
    time the agreed length falls.

    `longest(cap)` is the longest hit of at most `cap` blocks every group of the set can
    supply, and `blocks(n)` the hit blocks of a length `longest` returned, one list per group.
    Every hit block holds the request's tokens of its position and hangs under the serial of
    the request's prefix before it (`parents`), so it holds exactly what the request would
    compute, whatever the hash. Caps passed to `longest` never rise; each block of the prompt
    is looked up at most once per group per lookup, however often the cap falls. Groups with
    one spec are searched together, block by block, as one group whose block is present
    only where every group holds it (their agreed hit is the same)."""

    __slots__ = ("pool", "group_ids", "block_size", "hashes", "tokens", "parents")

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], request: Request,
                 parents: Sequence[int]) -> None:
        self.pool = managers[0].pool
        self.group_ids = tuple(m.group_id for m in managers)
        self.block_size = managers[0].block_size
        self.hashes = request.block_hashes
        self.tokens = request.block_tokens
        self.parents = parents

    def longest(self, cap: int) -> int:
        """The longest hit of at most `cap` blocks (at most the previous cap)."""
        raise NotImplementedError

    def blocks(self, num_blocks: int) -> list[list[KVCacheBlock]]:
        """Per group of the set, the hit blocks of a length `longest` returned (null where
        not needed)."""
        raise NotImplementedError


class ChainSearch(HitSearch):
    """Full attention: every block from block 0 must be cached."""

    __slots__ = ("found", "complete")

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], request: Request,
                 parents: Sequence[int], found: list[KVCacheBlock] | None = None) -> None:
        super().__init__(managers, request, parents)
        # Blocks 0.. found so far (one group) or rows of them (several); `complete` once a
        # block is missing. `found`, for a single group, is its chain verified already.
        self.found: list = [] if found is None else found
        self.complete = found is not None

    def longest(self, cap: int) -> int:
        """The cached blocks from block 0, at most `cap` of them."""
        found = self.found
        if not self.complete and len(found) < cap:
            if len(self.group_ids) > 1:
                probe_row, groups = self.pool.hash_index.probe_row, self.group_ids
                hashes, tokens, parents = self.hashes, self.tokens, self.parents
                for i in range(len(found), cap):
                    row = probe_row(groups, hashes[i], tokens[i], parents[i])
                    if row is None:
                        self.complete = True
                        break
                    found.append(row)
                return min(cap, len(found))
            probe, g = self.pool.hash_index.probe, self.group_ids[0]
            hashes, tokens, parents = self.hashes, self.tokens, self.parents
            for i in range(len(found), cap):
                block = probe(g, hashes[i], tokens[i], parents[i])
                if block is None:
                    self.complete = True
                    break
                found.append(block)
        return min(cap, len(found))

    def blocks(self, num_blocks: int) -> list[list[KVCacheBlock]]:
        """The first `num_blocks` blocks of the chain, per group."""
        rows = self.found[:num_blocks]
        if len(self.group_ids) == 1:
            return [rows]
        return [[row[k] for row in rows] for k in range(len(self.group_ids))]


class WindowSearch(HitSearch):
    """Sliding window or chunked local: a hit ending before block `end` needs the blocks
    covering the keys its next query (at `end * block_size`) sees before itself, from block
    `start(end)` on (`start` never decreases as `end` grows).

    The search keeps a candidate `end` and the lowest block `low` such that blocks
    [low, end) are verified. A missing block j rules out every end in (j, end] (all of their
    windows contain j), so the candidate drops to j; otherwise `low` moves left until it
    reaches the window's start. Both only move left, so each block is looked up once."""

    __slots__ = ("spec", "found", "end", "low")

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], request: Request,
                 parents: Sequence[int]) -> None:
        super().__init__(managers, request, parents)
        self.spec = managers[0].spec
        # Block index -> its block (one group) or its row of blocks (several).
        self.found: dict = {}
        self.end = -1  # no cap seen yet
        self.low = 0

    def start(self, end: int) -> int:
        """The first block a hit ending before block `end` needs."""
        return self.spec.first_needed_block(end * self.block_size)

    def longest(self, cap: int) -> int:
        """The longest hit of at most `cap` blocks whose window is cached in every group."""
        if self.end < 0 or cap < self.end:
            self.low = cap if self.end < 0 else min(self.low, cap)
            self.end = cap
        self.end = longest_window_hit(self.end, self._missing)
        return self.end

    def _missing(self, end: int) -> int:
        """A block the window of a hit of `end` blocks needs that is not cached in every
        group, or `end` if none is (blocks [low, end) are verified already)."""
        probe, probe_row = self.pool.hash_index.probe, self.pool.hash_index.probe_row
        groups = self.group_ids
        g0 = self.group_ids[0] if len(self.group_ids) == 1 else -1
        hashes, tokens, parents, found = self.hashes, self.tokens, self.parents, self.found
        start = self.start(end)
        low = self.low
        while low > start:
            j = low - 1
            found_j: KVCacheBlock | list[KVCacheBlock] | None
            if g0 >= 0:  # one group: one probe
                found_j = probe(g0, hashes[j], tokens[j], parents[j])
            else:
                found_j = probe_row(groups, hashes[j], tokens[j], parents[j])
            if found_j is None:
                self.low = j  # every end in (j, end] needs block j
                return j
            found[j] = found_j
            low = j
        self.low = low
        return end

    def blocks(self, num_blocks: int) -> list[list[KVCacheBlock]]:
        """Per group, null blocks before the window of a hit of `num_blocks` blocks, then its
        blocks."""
        start = min(self.start(num_blocks), num_blocks)
        null = [self.pool.null_block] * start
        rows = [self.found[j] for j in range(start, num_blocks)]
        if len(self.group_ids) == 1:
            return [null + rows]
        return [null + [row[k] for row in rows] for k in range(len(self.group_ids))]


# The manager class of each spec type.
class CheckpointSearch(HitSearch):
    """Recurrent layers: a hit of n blocks needs a checkpoint of exactly the prefix of n
    blocks (keyed by the hash of block n - 1, verified by its tokens and parent serial);
    0 blocks needs none. The hit is the null block n - 1 times, then the checkpoint."""

    __slots__ = ("answer", "row")

    def __init__(self, managers: Sequence[SingleTypeKVCacheManager], request: Request,
                 parents: Sequence[int]) -> None:
        super().__init__(managers, request, parents)
        self.answer = -1
        self.row: list[KVCacheBlock] = []

    def longest(self, cap: int) -> int:
        """The largest n <= `cap` with a checkpoint of the first n blocks in every group."""
        if 0 <= self.answer <= cap:
            return self.answer
        probe_row, groups = self.pool.hash_index.probe_row, self.group_ids
        hashes, tokens, parents = self.hashes, self.tokens, self.parents
        pool = self.pool
        assert isinstance(pool, TwoSizeBlockPool)
        stale, refused = pool.stale_evicted, pool.refused

        def has_checkpoint(n: int) -> bool:
            row = probe_row(groups, hashes[n - 1], tokens[n - 1], parents[n - 1])
            if row is not None:
                self.row = row
            elif stale and hashes[n - 1] in stale:
                pool.wanted_stale(hashes[n - 1])
            elif refused and hashes[n - 1] in refused:
                pool.wanted_refused(hashes[n - 1])
            return row is not None

        self.answer = longest_checkpoint_hit(cap, has_checkpoint)
        if not self.answer:
            self.row = []
        return self.answer

    def blocks(self, num_blocks: int) -> list[list[KVCacheBlock]]:
        """Per group: null entries, then the checkpoint of the first `num_blocks` blocks."""
        if num_blocks == 0:
            return [[] for _ in self.group_ids]
        assert num_blocks == self.answer
        null = self.pool.null_block
        return [[null] * (num_blocks - 1) + [page] for page in self.row]


def _checkpoint_of(hit_blocks: Sequence[KVCacheBlock]) -> KVCacheBlock | None:
    """The checkpoint a recurrent group's hit copies (its last entry), None for no hit or
    one whose entries are all null (the state comes from outside the pool)."""
    if hit_blocks and hit_blocks[-1].block_id != 0:
        return hit_blocks[-1]
    return None


def longest_checkpoint_hit(cap: int, has_checkpoint: Callable[[int], bool]) -> int:
    """The largest n <= `cap` such that `has_checkpoint(n)` (a checkpoint of exactly the
    first n blocks exists), asked from `cap` down; 0 when none does."""
    for n in range(cap, 0, -1):
        if has_checkpoint(n):
            return n
    return 0


def agreed_hit(cap: int, searches: Sequence[Callable[[int], int]]) -> int:
    """The longest hit of at most `cap` blocks that every search serves: each
    (`HitSearch.longest`-like: the longest hit it serves of at most its argument) lowers the
    candidate in turn until none does."""
    changed = True
    while changed:
        changed = False
        for longest in searches:
            n = longest(cap)
            if n < cap:
                cap, changed = n, True
    return cap


#: Where a recurrent group finds the cached attention block at a table index of a request
#: (None if no attention group holds it cached): a checkpoint takes its identity.
ChainBlockAt = Callable[[Request, int], KVCacheBlock | None]


#: Why a checkpoint was taken: at the prompt's end, at a branch point a lookup learned, every
#: N blocks, at the end of a request's output, at the end of a request preempted in its
#: prompt.
CHECKPOINT_KINDS = ("prompt_end", "branch_point", "every_n", "output_end", "request_end")


class RecurrentManager(SingleTypeKVCacheManager):
    """A recurrent group (linear attention, state-space, short convolution): no page per
    token; each running request owns one working state (a large page, never cached or
    shared while it runs), and checkpoints (large pages holding the state at a block
    boundary) serve hits.

    A hit at n blocks copies the checkpoint of that exact prefix into the working state
    (a pending copy). Checkpoints are taken where the request's computed count lands on a
    planned position: its prompt's end, the branch point its lookup learned (where the
    cached chain it verified ended past its hit), every `checkpoint_every` blocks if set,
    and at its end (preempted or finished) when that is a block boundary, else at the last
    block boundary its output reached (kept in a second large page while it decodes).
    Taking one queues a copy of the working state into a fresh large page, when one is
    free (for a prompt's or an output's end, when the pool admits it:
    `TwoSizeBlockPool.admit_checkpoint`): checkpoints never make an allocation fail. A
    checkpoint's worth (for eviction by worth) is the tokens since the last checkpoint the
    request knew on its chain (its hit, or one it took or found), or since 0, per block of
    a large page. The pool must be a TwoSizeBlockPool."""

    __slots__ = ("_plan", "_rolling", "_every", "chain_block_at", "_caching", "_kinds",
                 "hit_kinds", "_known", "_passed", "_refused", "two_size_pool", "_unloaded")

    def __init__(self, pool: BlockPool, spec: LayerSpec, group_id: int,
                 copies: PendingCopies, cache_order: Sequence[int] = (),
                 checkpoint_every: int = 0) -> None:
        if not isinstance(pool, TwoSizeBlockPool):
            raise TypeError("a recurrent group needs a TwoSizeBlockPool (pages of two sizes)")
        super().__init__(pool, spec, group_id, copies, cache_order)
        # The pool, as the two-size pool it is.
        self.two_size_pool: TwoSizeBlockPool = pool
        self._every = checkpoint_every * self.block_size
        self._caching = pool.enable_caching
        # Per request: planned checkpoint positions past its computed count (sorted).
        self._plan: dict[str, list[int]] = {}
        # Per decoding request: a large page with the state at its last block boundary past
        # its prompt, and that position.
        self._rolling: dict[str, tuple[KVCacheBlock, int]] = {}
        # Per request: the position of the last checkpoint it knows on its chain, and the
        # checkpoints it hit or took (page, serial, position), told to the pool as passed
        # at its end (`checkpoint_at_end`).
        self._known: dict[str, int] = {}
        self._passed: dict[str, list[tuple[KVCacheBlock, int, int]]] = {}
        self.chain_block_at: ChainBlockAt = lambda request, i: None
        # Why each checkpoint page was taken (CHECKPOINT_KINDS), and per running request the
        # kind of the checkpoint its hit copied (absent without a hit).
        self._kinds: dict[int, str] = {}
        self.hit_kinds: dict[str, str] = {}
        # Running requests refused a state kept for their output's end (see
        # `TwoSizeBlockPool.admit_checkpoint`).
        self._refused: set[str] = set()
        # Running requests admitted past their device hit whose working state the caller
        # has yet to load (`loaded_state`): no checkpoint copies it before.
        self._unloaded: set[str] = set()

    @staticmethod
    def hit_search(managers: Sequence[SingleTypeKVCacheManager], request: Request,
                   parents: Sequence[int]) -> HitSearch:
        """Checkpoints of exactly the prefix (see CheckpointSearch)."""
        return CheckpointSearch(managers, request, parents)

    # ---- planning (pure) ---------------------------------------------------------------------
    def num_blocks_to_allocate(self, request_id: str, num_computed_tokens: int, num_tokens: int,
                               hit_blocks: Sequence[KVCacheBlock] | None,
                               partial_src: KVCacheBlock | None) -> int:
        """Blocks taken off the free lists, counting k per large page (see
        `num_large_to_allocate`)."""
        return self.num_large_to_allocate(hit_blocks) * self.two_size_pool.large_page_blocks

    def num_large_to_allocate(self, hit_blocks: Sequence[KVCacheBlock] | None) -> int:
        """Large pages an admission takes (None: growing, which takes none): the working
        state, and the hit's checkpoint when it is free."""
        if hit_blocks is None:
            return 0
        return 1 + (_checkpoint_of(hit_blocks) is not None and hit_blocks[-1].ref_cnt == 0)

    def _on_every_n(self, position: int) -> bool:
        """Whether `position` is one of the every-N checkpoint positions (none if N = 0)."""
        return bool(self._every) and position % self._every == 0

    def _due(self, request_id: str, num_computed_tokens: int,
             num_prompt_tokens: int) -> Literal["planned", "every_n", "output", ""]:
        """Why a checkpoint is due at this computed count: "planned" (a position planned at
        admission), "every_n", "output" (a block boundary past the prompt: the state kept for
        the output's end), or "" (none)."""
        if not self._caching or num_computed_tokens == 0:
            return ""
        plan = self._plan[request_id]
        if plan:
            while plan and plan[0] < num_computed_tokens:
                plan.pop(0)
            if plan and plan[0] == num_computed_tokens:
                return "planned"
        if self._on_every_n(num_computed_tokens):
            return "every_n"
        return ("output" if num_computed_tokens > num_prompt_tokens
                and num_computed_tokens % self.block_size == 0 else "")

    def next_checkpoints(self, request: Request, num_new_tokens: int,
                         computed: ComputedBlocks | None = None) -> list[int]:
        """Positions in (computed, computed + `num_new_tokens`] where this group takes a
        checkpoint if a step ends there: the scheduler stops a chunk at the first one. For
        a waiting request, `computed` (its lookup) gives the computed count and the branch
        point its admission will plan."""
        if not self._caching:
            return []
        if computed is None:
            nc = request.num_computed_tokens
            plan = self._plan.get(request.request_id)
            verified = nc
        else:
            nc, plan = computed.num_computed_tokens, None
            verified = max(nc, computed.num_verified_tokens)
        end = nc + num_new_tokens
        out = {p for p in (plan if plan is not None else self._positions(request, nc, verified))
               if nc < p <= end}
        if self._every:
            first = (nc // self._every + 1) * self._every
            out.update(range(first, end + 1, self._every))
        bs = self.block_size
        prompt = request.num_prompt_tokens
        first = max(nc // bs + 1, prompt // bs + 1) * bs
        out.update(range(first, end + 1, bs))
        return sorted(out)

    def _positions(self, request: Request, num_computed_tokens: int,
                   num_verified_tokens: int) -> list[int]:
        """Planned checkpoint positions past the computed count: the prompt's end (the last
        block boundary before it and at it) and a branch point."""
        bs = self.block_size
        n = request.num_prompt_tokens
        ends = {(n - 1) // bs * bs, n // bs * bs}
        if num_verified_tokens % bs == 0:
            ends.add(num_verified_tokens)
        return sorted(p for p in ends if p > num_computed_tokens)

    def is_noop(self, request: Request, num_tokens: int) -> bool:
        """Whether growing needs nothing here: no checkpoint due at the computed count."""
        return not self._due(request.request_id, request.num_computed_tokens,
                             request.num_prompt_tokens)

    def quiet_range(self, request_id: str, num_computed_tokens: int) -> tuple[int, int] | None:
        """(hi, max_tokens): quiet until the next block boundary where a checkpoint may be
        due."""
        if not self._caching:
            return _UNBOUNDED, _UNBOUNDED
        return (num_computed_tokens // self.block_size + 1) * self.block_size, _UNBOUNDED

    # ---- mutation ----------------------------------------------------------------------------
    def take_hit(self, hit_blocks: list[KVCacheBlock], partial_src: KVCacheBlock | None,
                 num_computed_tokens: int) -> None:
        """Reference and pin the hit's checkpoint (the source of the working state's copy)."""
        checkpoint = _checkpoint_of(hit_blocks)
        if checkpoint is not None:
            self.pool.touch((checkpoint,))
            self._copies.pin(checkpoint)

    def admit(self, request: Request, hit_blocks: list[KVCacheBlock],
              partial_src: KVCacheBlock | None, parent_serial: int) -> None:
        """Give the request its working state: a copy of the hit's checkpoint, or a fresh
        state (the model starts it from zero, or a tier's checkpoint is loaded into it: the
        hit's entries are then all null, see `loaded_state`)."""
        rid = request.request_id
        pool = self.two_size_pool
        working = pool.get_large_pages(1, self.group_id)[0]
        checkpoint = _checkpoint_of(hit_blocks)
        if checkpoint is not None:
            pool.touch((working,))
            self._copies.pin(working)
            self._copies.queue(checkpoint, working)
            self.hit_kinds[rid] = self._kinds.get(checkpoint.block_id, "")
            pool.stats.checkpoints_used += 1
        self._req_to_blocks[rid] = [working]
        self._num_cached_blocks[rid] = 0
        self._last_serial[rid] = parent_serial
        self._plan[rid] = self._positions(request, request.num_computed_tokens, 0)
        self._known[rid] = request.num_computed_tokens if checkpoint is not None else 0
        self._passed[rid] = ([(checkpoint, checkpoint.serial, request.num_computed_tokens)]
                             if checkpoint is not None else [])
        if checkpoint is None and request.num_computed_tokens:
            self._unloaded.add(rid)

    def loaded_state(self, request: Request) -> None:
        """The request's working state was loaded from outside the pool (a tier's
        checkpoint) at its computed count: the last checkpoint it knows on its chain."""
        self._known[request.request_id] = request.num_computed_tokens
        self._unloaded.discard(request.request_id)

    def held_checkpoints(self, request: Request) -> tuple[tuple[int, int], ...]:
        """The large pages of a live request that hold a state of its prefix at a block
        boundary, as (index of the block that prefix ends with, page id), by index: its
        working state when its computed count is a block boundary, the state kept at its
        output's last block boundary, and the checkpoints it hit or took that still hold
        theirs. A page that a queued copy has yet to fill is left out."""
        rid = request.request_id
        nc = request.num_computed_tokens
        candidates: list[tuple[int, KVCacheBlock]] = []
        if nc and nc % self.block_size == 0:
            candidates.append((nc, self._req_to_blocks[rid][0]))
        rolling = self._rolling.get(rid)
        if rolling is not None:
            candidates.append((rolling[1], rolling[0]))
        candidates += [(at, page) for page, serial, at in self._passed[rid]
                       if page.serial == serial and page.token_ids is not None]
        found: dict[int, int] = {}
        for at, page in candidates:
            if not self._copies.queued_into(page.block_id):
                found.setdefault(at // self.block_size - 1, page.block_id)
        return tuple(sorted(found.items()))

    def note_hit_ends(self, request: Request, ends: Sequence[int]) -> None:
        """Plan a checkpoint at the lookup's branch point (the verified chain's end) when it
        lies past the hit."""
        self._plan[request.request_id] = self._positions(
            request, request.num_computed_tokens, max(ends))

    def release_computed(self, request: Request) -> None:
        """Nothing to cache before allocating (checkpoints are taken after, see
        `take_checkpoint`)."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Nothing: a recurrent group has no per-token pages to index."""

    def allocate(self, request: Request, num_tokens: int) -> tuple[int, ...]:
        """Nothing to append: the working state covers every position."""
        return ()

    def take_checkpoint(self, request: Request) -> None:
        """Queue a copy of the working state into a checkpoint if one is due at the computed
        count (after every group allocated, so it only takes a large page left free)."""
        rid = request.request_id
        if rid in self._unloaded:
            return
        nc = request.num_computed_tokens
        due = self._due(rid, nc, request.num_prompt_tokens)
        if not due:
            return
        pool = self.two_size_pool
        working = self._req_to_blocks[rid][0]
        if due != "output":
            planned = due == "planned"
            every_n = not planned or self._on_every_n(nc)
            if planned:
                self._plan[rid].pop(0)
            chain = self.chain_block_at(request, nc // self.block_size - 1)
            if chain is None:
                return
            if self._has_checkpoint(chain):
                self._known[rid] = nc
                return
            if not pool.num_free_large_pages:
                return
            n, bs = request.num_prompt_tokens, self.block_size
            kind = ("prompt_end" if nc in ((n - 1) // bs * bs, n // bs * bs)
                    else "branch_point" if planned else "every_n")
            optional = kind == "prompt_end" and not every_n
            if optional and not pool.admit_checkpoint(kind):
                assert chain.block_hash is not None
                pool.refused_checkpoint(kind, chain.block_hash)
                return
            page = pool.get_large_pages(1, self.group_id)[0]
            self._copy(working, page)
            pool.free_blocks((page,))  # no table holds a checkpoint: its pin is all
            self._index(page, request, chain, kind, nc)
            self._passed[rid].append((page, page.serial, nc))
            return
        # Past the prompt: keep the state at the last block boundary for the output's end
        # (asked once per request whether to, at the first boundary with a large page free).
        rolling = self._rolling.get(rid)
        if rolling is None:
            if not pool.num_free_large_pages or rid in self._refused:
                return
            if not pool.admit_checkpoint("output_end"):
                self._refused.add(rid)
                return
            page = pool.get_large_pages(1, self.group_id)[0]
        else:
            page = rolling[0]
        # Both pages stay the request's: pinned only if it lets go of them first (`free`).
        # A copy still pending into the page is overwritten after it, in batch order.
        self._copies.queue_held(working, page)
        self._rolling[rid] = (page, nc)

    def _copy(self, src: KVCacheBlock, dst: KVCacheBlock) -> None:
        """Queue a copy between two large pages the request holds, pinning both."""
        self.pool.touch((src, dst))
        self._copies.pin(src)
        self._copies.pin(dst)
        self._copies.queue(src, dst)

    def _has_checkpoint(self, chain: KVCacheBlock) -> bool:
        """Whether a checkpoint of the prefix ending with cached block `chain` exists."""
        assert chain.block_hash is not None and chain.token_ids is not None
        return self.pool.hash_index.probe(self.group_id, chain.block_hash, chain.token_ids,
                                          chain.parent_serial) is not None

    def _index(self, page: KVCacheBlock, request: Request, chain: KVCacheBlock,
               kind: str, position: int) -> None:
        """Index a large page as the checkpoint at `position`, the prefix ending with block
        `chain`, taken for `kind` (one of CHECKPOINT_KINDS), worth the tokens since the last
        checkpoint the request knew per block."""
        assert chain.block_hash is not None and chain.token_ids is not None
        rid = request.request_id
        pool = self.two_size_pool
        saved = position - self._known[rid]
        self._kinds[page.block_id] = kind
        pool.cache_checkpoint(page, chain.block_hash, chain.token_ids, chain.parent_serial,
                              chain.serial, worth=max(saved, 0) / pool.large_page_blocks,
                              kind=kind)
        self._known[rid] = position

    def checkpoint_at_end(self, request: Request) -> None:
        """At the request's end (finished or preempted), while the attention groups still
        hold its cached blocks: index the working state as the checkpoint of its computed
        prefix when that ends on a block boundary, else the state kept at its output's last
        block boundary."""
        if not self._caching:
            return
        rid = request.request_id
        working = self._req_to_blocks[rid][0]
        nc = request.num_computed_tokens
        bs = self.block_size
        rolling = self._rolling.get(rid)
        if nc and nc % bs == 0:
            page, position = working, nc
        elif rolling is not None:
            page, position = rolling
        else:
            if rid in self._refused:
                chain = self.chain_block_at(request, nc // bs - 1)
                if chain is not None and chain.block_hash is not None:
                    self.two_size_pool.refused_checkpoint("output_end", chain.block_hash)
            return
        chain = self.chain_block_at(request, position // bs - 1)
        if chain is None:
            return
        if page.token_ids is None and not self._has_checkpoint(chain):
            kind = "output_end" if position > request.num_prompt_tokens else "request_end"
            self._index(page, request, chain, kind, position)
        pool = self.two_size_pool
        for passed, serial, at in self._passed[rid]:
            if at < position:
                pool.passed_checkpoint(passed, serial)

    def free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request; returns its large pages (working state, and the state kept
        for its output's end) for the caller to free, pinned first where a copy between them
        has not been released yet."""
        rid = request.request_id
        table = self._req_to_blocks.pop(rid)
        rolling = self._rolling.pop(rid, None)
        if rolling is not None:
            table = [rolling[0], *table]
            self._copies.pin_pending(table)
        del self._num_cached_blocks[rid]
        del self._last_serial[rid]
        del self._plan[rid]
        self.hit_kinds.pop(rid, None)
        self._refused.discard(rid)
        self._unloaded.discard(rid)
        del self._known[rid]
        del self._passed[rid]
        return table

    def num_resident_blocks(self, request_id: str) -> int:
        """Large pages the request holds (working state, and its output's end state)."""
        return len(self._req_to_blocks[request_id]) + (request_id in self._rolling)

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """The child gets its own working state, a copy of the parent's (the caller checked
        a large page is free)."""
        parent = self._req_to_blocks[parent_id][0]
        working = self.two_size_pool.get_large_pages(1, self.group_id)[0]
        self._copy(parent, working)
        self._req_to_blocks[child_id] = [working]
        self._num_cached_blocks[child_id] = 0
        self._last_serial[child_id] = self._last_serial[parent_id]
        self._plan[child_id] = list(self._plan[parent_id])
        self._known[child_id] = self._known[parent_id]
        self._passed[child_id] = []

    def null_fresh_entries(self, request_id: str, start: int, stop: int) -> None:
        """Nothing: a recurrent group has no per-token entries (a tier's checkpoint is
        loaded into the working state)."""


MANAGER_TYPES: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLASpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: SlidingWindowManager,
    RecurrentStateSpec: RecurrentManager,
}


def make_manager(pool: BlockPool, spec: LayerSpec, group_id: int, copies: PendingCopies,
                 cache_order: Sequence[int] = (), hold: bool = True, checkpoint_every: int = 0
                 ) -> SingleTypeKVCacheManager:
    """The manager for a spec's layer type, one of the groups over `pool`: `cache_order`
    lists them all in the order they cache a request's blocks (empty: this group alone;
    `hold`: see SlidingWindowManager; `checkpoint_every`: see RecurrentManager)."""
    cls = MANAGER_TYPES.get(type(spec))
    if cls is None:
        raise TypeError(f"no KV cache manager for {type(spec).__name__}")
    if isinstance(spec, (SlidingWindowSpec, ChunkedLocalAttentionSpec)):
        return SlidingWindowManager(pool, spec, group_id, copies, cache_order, hold)
    if cls is RecurrentManager:
        return RecurrentManager(pool, spec, group_id, copies, cache_order, checkpoint_every)
    return cls(pool, spec, group_id, copies, cache_order)
