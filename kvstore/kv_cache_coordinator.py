"""Routes every call to the per-group managers and agrees on one hit length for all groups."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import chain
from typing import NamedTuple

from kvstore.block import BRANCH_POINT, OUTPUT, KVCacheBlock
from kvstore.block_pool import BlockPool, PendingCopies
from kvstore.request import Request
from kvstore.single_type_kv_cache_manager import (
    ChainSearch,
    HitSearch,
    RecurrentManager,
    SingleTypeKVCacheManager,
    agreed_hit,
    make_manager,
)
from kvstore.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
)


@dataclass(frozen=True, slots=True)
class ComputedBlocks:
    """A prefix hit: per-group hit blocks, and per-group copy sources for a partial block.

    `parent_serials[i]` is the serial the request's block i hangs under (the salt's root
    serial for block 0), for every hit block and the one after the hit; empty means no
    hit. `num_verified_tokens` is how far the prompt's prefix was found cached in the chain
    the lookup verified (at least the hit; past it where a group cut the hit): a branch
    point where later requests are likely to hit; `cut_blocks` are the blocks of that chain
    past the hit. `issuer` and `lookup_id` name the manager and the lookup that made it:
    a result is admitted only by that manager, for that request object, as its latest
    lookup. Its lists are read-only: a waiting request's next lookup may return them
    again.

    The last `num_inflight_blocks` hit blocks are pages of `inflight`, a running request
    scheduled to compute them in the current step (see `KVCacheManager`, "Hits in flight"):
    `parent_serials` covers the hit before them; admitting indexes them."""

    request_id: str
    blocks: tuple[list[KVCacheBlock], ...]
    partial_sources: tuple[KVCacheBlock | None, ...]
    num_full_hit_tokens: int
    num_partial_tokens: int
    cache_epoch: int = -1
    parent_serials: tuple[int, ...] = ()
    num_verified_tokens: int = 0
    cut_blocks: tuple[KVCacheBlock, ...] = ()
    issuer: object = None
    lookup_id: int = 0
    inflight: Request | None = None
    num_inflight_blocks: int = 0

    @property
    def num_computed_tokens(self) -> int:
        """Tokens the request need not compute."""
        return self.num_full_hit_tokens + self.num_partial_tokens


@dataclass(slots=True)
class LookupMemo:
    """One request's last lookup, kept for its next one (`find_longest_hit`)."""

    computed: ComputedBlocks | None = None
    # The request's token count and salt (settable while no block is hashed) and the cap
    # of that lookup.
    key: tuple[int, str | None, int] = (0, None, 0)
    found: set[int] | None = None  # the ids of `computed`'s blocks, once asked for


class PendingWrite(NamedTuple):
    """A page indexed before its request computed it (a hit in flight took it): it holds its
    content once `request` has computed `num_tokens` tokens, and is no copy source before.
    `serial`: the content serial it was indexed under (another: the page was reused since)."""

    request: Request
    num_tokens: int
    serial: int


class AllocationPlan(NamedTuple):
    """What growing a request's tables costs, summed over groups."""

    num_free_needed: int  # free blocks consumed: new pages, hits and pins taken off the queue
    num_released: int  # blocks that window drops return to the free queue first
    num_resident: int  # pages the request holds afterwards
    num_large: int = 0  # large pages (recurrent states) among the free blocks consumed


class KVCacheCoordinator:
    """All KV cache groups of one cache over one shared pool."""

    __slots__ = ("config", "pool", "block_size", "managers", "_full_group", "_free_order",
                 "_learns_branches", "_spine_groups", "_search_sets", "_cache_order", "recurrent",
                 "_recurrent_groups", "_writes", "_writers")

    def __init__(self, config: KVCacheConfig, pool: BlockPool, copies: PendingCopies,
                 hold_window_pages: bool = True, checkpoint_every: int = 0) -> None:
        self.config = config
        self.pool = pool
        self.block_size = config.block_size
        n = len(config.groups)
        full = [g for g, group in enumerate(config.groups)
                if isinstance(group.spec, FullAttentionSpec)]
        # Full-attention groups cache their blocks first: a sliding group's null entries
        # below a tier hit's window take their serials from them.
        cache_order = tuple(full) + tuple(g for g in range(n) if g not in full)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            make_manager(pool, group.spec, g, copies, cache_order, hold_window_pages,
                         checkpoint_every)
            for g, group in enumerate(config.groups))
        # Recurrent groups (their pages are large; they index no per-token page).
        self.recurrent: tuple[RecurrentManager, ...] = tuple(
            m for m in self.managers if isinstance(m, RecurrentManager))
        for recurrent in self.recurrent:
            recurrent.chain_block_at = self._chain_block_at
        # Where the lookup verifies the prompt's prefix block by block: the first
        # full-attention group (which needs every block anyway), else every attention group.
        self._full_group = full[0] if full else -1
        self._spine_groups: tuple[int, ...] = (full[0],) if full else tuple(
            g for g, group in enumerate(config.groups) if not group.is_recurrent)
        # The other groups, in sets sharing one spec: each set is searched as one.
        sets: dict[object, list[SingleTypeKVCacheManager]] = {}
        for g, manager in enumerate(self.managers):
            if g != self._full_group:
                sets.setdefault(manager.spec, []).append(manager)
        self._search_sets = tuple(tuple(ms) for ms in sets.values())
        # The groups that index blocks, in caching order (a recurrent group indexes none).
        self._cache_order = tuple(self.managers[g] for g in cache_order
                                  if not config.groups[g].is_recurrent)
        self._learns_branches = self.learns_branches(config, hold_window_pages)
        # Freeing lists a position's window pages before its full-attention ones (a
        # recurrent group's large pages, on lists of their own, go first, apart).
        paged = [g for g in range(n) if not config.groups[g].is_recurrent]
        self._free_order = tuple(g for g in paged if g not in full) + tuple(full)
        self._recurrent_groups = tuple(g for g in range(n) if g not in paged)
        # Pages indexed before their request computed them (`index_inflight`), by page, and
        # per such request the pages it was given.
        self._writes: dict[KVCacheBlock, PendingWrite] = {}
        self._writers: dict[str, list[KVCacheBlock]] = {}

    @staticmethod
    def learns_branches(config: KVCacheConfig, hold_window_pages: bool) -> bool:
        """Whether admissions choose window pages to hold past the window and learn branch
        points: window groups beside a full-attention group, holding on (the pool must then
        index children, see `children`)."""
        specs = [group.spec for group in config.groups]
        return (hold_window_pages and any(isinstance(s, FullAttentionSpec) for s in specs)
                and any(isinstance(s, (SlidingWindowSpec, ChunkedLocalAttentionSpec))
                        for s in specs))

    def _verified_prefix(self, request: Request, max_blocks: int
                         ) -> tuple[list[int], list[KVCacheBlock]]:
        """The longest prefix of the request cached block by block from the salt's root in
        some group: `parents[i]` is the serial block i hangs under for each of its blocks and
        the one after it, and `blocks` the cached blocks it was found in (one per block).

        A serial names one prefix exactly (the salt and every token before it) in every
        group, so a block found under `parents[i]` holding block i's tokens holds exactly the
        request's content there, whatever the hash says."""
        pool = self.pool
        hashes, tokens = request.block_hashes, request.block_tokens
        parent = pool.root_serial(request.cache_salt)
        parents = [parent]
        blocks: list[KVCacheBlock] = []
        groups = self._spine_groups
        n = min(max_blocks, len(hashes))
        if len(groups) == 1:
            blocks = pool.hash_index.chain(groups[0], hashes, tokens, parent, n)
            parents += [block.serial for block in blocks]
            return parents, blocks
        probe = pool.hash_index.probe
        at = 0  # the group that held the previous block is asked first
        for i in range(n):
            block_tokens = tokens[i]
            for k in range(len(groups)):
                g = groups[(at + k) % len(groups)]
                block = probe(g, hashes[i], block_tokens, parents[i])
                if block is not None:
                    at = (at + k) % len(groups)
                    break
            else:
                break
            blocks.append(block)
            parents.append(block.serial)
        return parents, blocks

    def find_longest_hit(self, request: Request, max_tokens: int, partial: bool,
                         issuer: object = None, lookup_id: int = 0,
                         memo: LookupMemo | None = None,
                         inflight: Mapping[str, tuple[Request, int]] | None = None
                         ) -> ComputedBlocks:
        """The longest prefix of at most `max_tokens` tokens cached for every group.

        Whole blocks first: never past the prefix verified in the cache, then each group
        lowers the candidate length in turn until none does (each group's search resumes
        where it stopped, so the lookup is linear in the prompt's blocks per group). Then, if
        `partial`, the next block's leading tokens that every group has under the hit's
        prefix, at most block_size - 1 of them.

        `memo` carries one request's lookups from one to the next (a request waiting for
        room is looked up at every step): at the same cap, with the same tokens and salt,
        the last one's whole blocks are found again when none of them was dropped since and
        the verified prefix cannot have grown. The result is recorded in it.

        `inflight` (running requests with the token count their current step computes up
        to, by id): where the whole-block hit ends at the cached part of such a request's
        table, the hit goes on over the pages that step fills with the prompt's tokens
        (`_inflight_hit`); such a hit takes no partial block and is not memoized."""
        bs = self.block_size
        parents: Sequence[int]
        key = (request.num_tokens, request.cache_salt, max_tokens)
        last = memo.computed if memo is not None and memo.key == key else None
        if memo is not None and last is not None and self._still_found(request, max_tokens,
                                                                        memo, last):
            hits = last.blocks
            num_blocks = last.num_full_hit_tokens // bs
            parents = last.parent_serials or (self.pool.root_serial(request.cache_salt),)
            num_verified, cut = last.num_verified_tokens, last.cut_blocks
        else:
            if memo is not None:
                memo.key, memo.found = key, None
            hits, parents, num_blocks, num_verified, cut = self._whole_blocks(request,
                                                                               max_tokens // bs)
        source: Request | None = None
        num_inflight = 0
        if inflight and num_verified == num_blocks * bs:
            source, extra = self._inflight_hit(request, hits, num_blocks, max_tokens // bs,
                                               inflight)
            if source is not None:
                num_inflight = len(extra[0])
                hits = tuple([*hit, *more] for hit, more in zip(hits, extra, strict=True))
                num_verified = (num_blocks + num_inflight) * bs
        full = (num_blocks + num_inflight) * bs
        parent = parents[num_blocks]
        sources: list[KVCacheBlock | None] = [None] * len(self.managers)
        num_partial = 0
        if partial and max_tokens > full and not self.recurrent and not num_inflight:
            # (A recurrent group has no state inside a block: no partial hit with one.)
            query = tuple(request.token_ids[full:min(full + bs - 1, max_tokens)])
            num_partial = len(query)
            for g in range(len(self.managers)):
                sources[g], n = self.pool.longest_partial_match(g, parent, query)
                src = sources[g]
                if src is not None and self._writes and not self._written(src):
                    n = 0  # not written yet: no copy source
                num_partial = min(num_partial, n)
                if num_partial == 0:
                    break
            if num_partial == 0:
                sources = [None] * len(self.managers)
        computed = ComputedBlocks(request.request_id, hits, tuple(sources), full, num_partial,
                                  self.pool.cache_epoch, tuple(parents[:num_blocks + 1]),
                                  num_verified, cut, issuer, lookup_id, source, num_inflight)
        if memo is not None:
            memo.computed = None if num_inflight else computed
        return computed

    def _inflight_hit(self, request: Request, hits: tuple[list[KVCacheBlock], ...],
                      num_blocks: int, max_blocks: int,
                      inflight: Mapping[str, tuple[Request, int]]
                      ) -> tuple[Request | None, list[list[KVCacheBlock]]]:
        """The running request (of `inflight`, with the token count its step computes up to)
        whose pages continue the whole-block hit of `num_blocks` blocks furthest, with those
        pages per group (None, [] if none does). Such a request has the salt of `request`,
        the hit's last block in its own table (of the first group that caches), nothing
        cached past it in any group, and in every group uncached pages after it holding,
        block for block, the prompt's tokens, which its current step fills; a recurrent
        group has no state there to share."""
        if self.recurrent:
            return None, []
        bs = self.block_size
        hashes, tokens = request.block_hashes, request.block_tokens
        limit = min(max_blocks, len(hashes))
        h = num_blocks
        if h >= limit:
            return None, []
        g0 = self._cache_order[0].group_id
        last = hits[g0][h - 1] if h else None
        rid = request.request_id
        best: Request | None = None
        best_end = h
        for other, scheduled_end in inflight.values():
            orid = other.request_id
            end = min(limit, scheduled_end // bs, len(other.block_hashes))
            if end <= best_end or orid == rid or other.cache_salt != request.cache_salt:
                continue
            tables = [m.table(orid) for m in self.managers]
            if (h and tables[g0][h - 1] is not last) or any(
                    m.num_cached_blocks(orid) != h for m in self.managers):
                continue
            other_hashes, other_tokens = other.block_hashes, other.block_tokens
            n = h
            while n < end and other_hashes[n] == hashes[n] and other_tokens[n] == tokens[n] \
                    and all(t[n].block_id != 0 and t[n].block_hash is None for t in tables):
                n += 1
            if n > best_end:
                best, best_end = other, n
        if best is None:
            return None, []
        orid = best.request_id
        return best, [m.table(orid)[h:best_end] for m in self.managers]

    def index_inflight(self, request: Request, computed: ComputedBlocks) -> ComputedBlocks:
        """Index the pages of a hit in flight (`computed.inflight`'s, checked current) as
        that request's own blocks, pending until it computes them; returns the hit as one
        of cached blocks."""
        source = computed.inflight
        assert source is not None
        bs = self.block_size
        end = computed.num_full_hit_tokens // bs
        first = end - computed.num_inflight_blocks
        for manager in self._cache_order:
            manager.cache_blocks(source, end * bs)
        writes = self._writes
        given = self._writers.setdefault(source.request_id, [])
        for manager in self.managers:
            for i, block in enumerate(manager.table(source.request_id)[first:end], first):
                known = writes.get(block)
                if known is not None and known.request is source and known.serial == block.serial:
                    continue  # indexed for an earlier hit in flight on the same pages
                writes[block] = PendingWrite(source, (i + 1) * bs, block.serial)
                given.append(block)
        spine = self._cache_order[0].table(source.request_id)
        parents = computed.parent_serials or (self.pool.root_serial(request.cache_salt),)
        parents += tuple(block.serial for block in spine[first:end])
        return replace(computed, parent_serials=parents, cache_epoch=self.pool.cache_epoch,
                       inflight=None, num_inflight_blocks=0)

    def _written(self, block: KVCacheBlock) -> bool:
        """Whether a cached page holds its content (no write of it is pending)."""
        write = self._writes.get(block)
        if write is None:
            return True
        if write.serial != block.serial or write.request.num_computed_tokens >= write.num_tokens:
            del self._writes[block]
            return True
        return False

    def pending_writer(self, block: KVCacheBlock) -> Request | None:
        """The request whose step has yet to write this indexed page (a hit in flight took
        it first), or None."""
        write = self._writes.get(block)
        return None if write is None or self._written(block) else write.request

    def unwritten(self, request: Request) -> list[KVCacheBlock]:
        """The pages of `request` indexed for a hit in flight that it has yet to compute (its
        step has not run)."""
        writes = self._writes
        return [block for block in self._writers.get(request.request_id, ())
                if block in writes and writes[block].request is request
                and not self._written(block)]

    def release_writes(self, request: Request) -> None:
        """Forget the pending writes of a request that ends (they are all written)."""
        writes = self._writes
        for block in self._writers.pop(request.request_id, ()):
            write = writes.get(block)
            if write is not None and write.request is request:
                del writes[block]

    def _whole_blocks(self, request: Request, max_blocks: int
                      ) -> tuple[tuple[list[KVCacheBlock], ...], list[int], int, int,
                                 tuple[KVCacheBlock, ...]]:
        """`find_longest_hit`'s whole blocks: per group hit blocks, the parent serials of
        the verified prefix, the hit's and that prefix's lengths in blocks and tokens, and
        the verified blocks past the hit."""
        parents, spine_blocks = self._verified_prefix(request, max_blocks)
        num_blocks = len(spine_blocks)
        searches: list[HitSearch] = []
        if self._full_group >= 0:  # its chain is the verified prefix
            searches.append(ChainSearch((self.managers[self._full_group],), request, parents,
                                        spine_blocks))
        for managers in self._search_sets:
            searches.append(managers[0].hit_search(managers, request, parents))
        num_blocks = agreed_hit(num_blocks, [search.longest for search in searches])
        # Every group's last answer was exactly num_blocks.
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        for search in searches:
            for g, blocks in zip(search.group_ids, search.blocks(num_blocks), strict=True):
                per_group[g] = blocks
        return (tuple(per_group), parents, num_blocks, len(spine_blocks) * self.block_size,
                tuple(spine_blocks[num_blocks:]))

    def _still_found(self, request: Request, max_tokens: int, memo: LookupMemo,
                     last: ComputedBlocks) -> bool:
        """Whether a lookup of `request` at `max_tokens` finds `last`'s whole blocks (its
        last lookup at that cap, with the same tokens and salt): its hit reached the end of
        the verified prefix, no block of it was dropped since, and that prefix does not go
        on now. Only where the verified prefix is a full-attention group's hit blocks:
        without such a group its early links are blocks no hit names (below every window).
        A hit cut short by a window group, or one with a recurrent group, is looked up again
        in full too."""
        if (self._full_group < 0 or self.recurrent
                or last.num_verified_tokens != last.num_full_hit_tokens):
            return False
        dropped = self.pool.dropped_since(last.cache_epoch)
        if dropped is None:
            return False
        if dropped:
            found = memo.found
            if found is None:
                found = memo.found = {block.block_id for blocks in last.blocks for block in blocks}
            if not found.isdisjoint(dropped):
                return False
        n = last.num_full_hit_tokens // self.block_size
        hashes = request.block_hashes
        if n >= min(max_tokens // self.block_size, len(hashes)):
            return True
        parent = (last.parent_serials[n] if last.parent_serials
                  else self.pool.root_serial(request.cache_salt))
        return self.pool.hash_index.probe_any(self._spine_groups, hashes[n],
                                              request.block_tokens[n], parent) is None

    def parent_serial(self, request: Request, computed: ComputedBlocks) -> int:
        """The serial the block after the hit hangs under (the salt's root without a hit)."""
        n = computed.num_full_hit_tokens // self.block_size
        if n == 0 and not computed.parent_serials:
            return self.pool.root_serial(request.cache_salt)
        return computed.parent_serials[n]

    def check_shape(self, request: Request, computed: ComputedBlocks) -> None:
        """ValueError unless `computed` is shaped like a lookup of this cache for `request`."""
        bs = self.block_size
        n = computed.num_full_hit_tokens // bs if isinstance(computed.num_full_hit_tokens,
                                                              int) else -1
        k = computed.num_inflight_blocks  # the parent serials stop before them
        ok = (n >= 0 and computed.num_full_hit_tokens == n * bs
              and isinstance(k, int) and 0 <= k <= n
              and (k == 0) == (computed.inflight is None)
              and (k == 0 or computed.num_partial_tokens == 0)
              and len(computed.blocks) == len(self.managers)
              and all(len(blocks) == n for blocks in computed.blocks)
              and len(computed.partial_sources) == len(self.managers)
              and isinstance(computed.num_partial_tokens, int)
              and 0 <= computed.num_partial_tokens < bs
              and all((src is None) == (computed.num_partial_tokens == 0)
                      for src in computed.partial_sources)
              and (len(computed.parent_serials) == n - k + 1
                   or (n == k and not computed.parent_serials))
              and (not computed.parent_serials
                   or computed.parent_serials[0] == self.pool.root_serial(request.cache_salt)))
        if not ok:
            raise ValueError(f"computed blocks for {request.request_id!r} are not a lookup of this "
                             "cache (pass what get_computed_blocks returned)")

    def is_current(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether a lookup's blocks still hold what it found (nothing evicted since, or
        every hit block and copy source still holds the request's content under its
        prefix). ValueError for a result that is not a lookup of this cache."""
        self.check_shape(request, computed)
        if computed.num_inflight_blocks and not self._inflight_current(request, computed):
            return False
        if computed.cache_epoch == self.pool.cache_epoch:
            return True
        tokens, hashes = request.token_ids, request.block_hashes
        block_tokens = request.block_tokens
        full = computed.num_full_hit_tokens
        parents = computed.parent_serials
        cached = full // self.block_size - computed.num_inflight_blocks
        for g in range(len(self.managers)):
            for i, block in enumerate(computed.blocks[g][:cached]):
                if block.block_id == 0:
                    continue
                if (block.block_hash != hashes[i] or block.group_id != g
                        or block.token_ids != block_tokens[i]
                        or block.parent_serial != parents[i]):
                    return False
            src = computed.partial_sources[g]
            if src is not None:
                n = computed.num_partial_tokens
                if (src.token_ids is None or src.group_id != g
                        or src.parent_serial != self.parent_serial(request, computed)
                        or src.token_ids[:n] != tuple(tokens[full:full + n])):
                    return False
        return True

    def _inflight_current(self, request: Request, computed: ComputedBlocks) -> bool:
        """Whether the pages of a hit in flight are still its request's, each one not cached
        yet or cached with the prompt's block."""
        source = computed.inflight
        assert source is not None
        end = computed.num_full_hit_tokens // self.block_size
        first = end - computed.num_inflight_blocks
        hashes, block_tokens = request.block_hashes, request.block_tokens
        for manager, blocks in zip(self.managers, computed.blocks, strict=True):
            try:
                table = manager.table(source.request_id)
            except KeyError:
                return False
            if len(table) < end:
                return False
            for i in range(first, end):
                block = blocks[i]
                if table[i] is not block or (block.block_hash is not None and (
                        block.block_hash != hashes[i] or block.token_ids != block_tokens[i])):
                    return False
        return True

    def num_blocks_needed(self, request: Request, num_computed_tokens: int, num_tokens: int,
                          computed: ComputedBlocks | None) -> AllocationPlan:
        """What growing the tables to `num_tokens` costs; `computed` at admission, else None."""
        need = released = large = 0
        rid = request.request_id
        for recurrent in self.recurrent:
            large += recurrent.num_large_to_allocate(
                None if computed is None else computed.blocks[recurrent.group_id])
        for g, manager in enumerate(self.managers):
            if computed is None:
                need += manager.num_blocks_to_allocate(rid, num_computed_tokens, num_tokens,
                                                       None, None)
                released += manager.num_skippable(rid, num_computed_tokens).num_freed
            else:
                need += manager.num_blocks_to_allocate(rid, num_computed_tokens, num_tokens,
                                                       computed.blocks[g],
                                                       computed.partial_sources[g])
        return AllocationPlan(need, released,
                              self.num_resident_blocks(num_computed_tokens, num_tokens), large)

    def num_resident_blocks(self, num_computed_tokens: int, num_tokens: int) -> int:
        """Pages a request of `num_tokens` tokens holds in all groups once its next query is
        at `num_computed_tokens`."""
        return sum(m.spec.num_resident_blocks(num_computed_tokens, num_tokens)
                   for m in self.managers)

    def quiet_range(self, request: Request) -> tuple[int, int, int] | None:
        """Right after every group's `is_noop` held: (lo, hi, max_tokens) such that growing
        the request to at most `max_tokens` tokens needs nothing in any group while its
        computed count is in [lo, hi) and its tables are unchanged; None if not promised."""
        rid = request.request_id
        lo = request.num_computed_tokens
        hi = max_tokens = 1 << 62
        for manager in self.managers:
            quiet = manager.quiet_range(rid, lo)
            if quiet is None:
                return None
            if quiet[0] < hi:
                hi = quiet[0]
            if quiet[1] < max_tokens:
                max_tokens = quiet[1]
        return lo, hi, max_tokens

    def admit(self, request: Request, computed: ComputedBlocks) -> None:
        """Take a checked prefix hit in every group."""
        for g, manager in enumerate(self.managers):
            manager.take_hit(computed.blocks[g], computed.partial_sources[g],
                             computed.num_computed_tokens)
        parent = self.parent_serial(request, computed)
        ends = (computed.num_full_hit_tokens, computed.num_verified_tokens)
        for g, manager in enumerate(self.managers):
            manager.admit(request, computed.blocks[g], computed.partial_sources[g], parent)
            manager.note_hit_ends(request, ends)
        if self._learns_branches:
            self._hold_likely_ends(request, computed)
        # A prefix the lookup found but a group cut: it was asked for again.
        self.pool.reused(block for block in computed.cut_blocks if block.block_hash is not None)

    def _hold_likely_ends(self, request: Request, computed: ComputedBlocks) -> None:
        """Have the window groups hold the windows later hits are likely to need, by what
        the lookup found (verified: the full-attention chain of the prompt's prefix):

        - where the verified chain ends at a page the cache continues with another whole
          block, the chain branches: prompts sharing the prefix come back there. Before the
          prompt's last block, the page is marked a branch point (`BRANCH_POINT`);
        - the window before each branch point marked on the hit's chain (the pages there
          another request holds are shared, so a window a running request keeps for a
          branch point outlives it);
        - the window before the lookup's hit end, unless the cache shows the chain goes on
          the prompt's way there: it ended there (no whole block continues it, and the
          prompt extends a cached partial one), or nothing is cached after it and either
          its last page holds output of the request that cached it (`OUTPUT`) or no window
          cut the hit and another running request holds that page (computing past it).
          Each way a conversation's next turn goes on past it;
        - the first window of a prompt the cache had nothing of."""
        bs = self.block_size
        g = self._full_group
        hit = computed.blocks[g]
        num_verified = computed.num_verified_tokens // bs
        last_block = (request.num_tokens - 1) // bs
        ends = []
        if num_verified:
            last = computed.cut_blocks[-1] if computed.cut_blocks else hit[num_verified - 1]
            children = self.pool.children(g, last.serial)
            branches = any(len(tokens) == bs for tokens, _ in children)
            if branches and num_verified < last_block:
                last.hint = BRANCH_POINT
            # Where no whole block continues the chain and the prompt extends a cached
            # partial one, the chain ended there: a conversation's next turn. Where nothing
            # is cached after it and its last page is output, or another running request
            # holds that page (in the uncut hit, this admission holds it once) and is
            # computing past it, this is a conversation's next turn too.
            start = num_verified * bs
            ended = not branches and any(
                tuple(request.token_ids[start:start + len(tokens)]) == tokens
                for tokens, _ in children)
            extended = not children and (last.hint == OUTPUT or (
                not computed.cut_blocks and last.ref_cnt - last.pin_cnt > 1))
            if not ended and not extended:
                ends += [computed.num_full_hit_tokens, computed.num_verified_tokens]
        ends += [(j + 1) * bs for j, block in enumerate(hit) if block.hint == BRANCH_POINT]
        if ends or not num_verified:
            for manager in self.managers:
                manager.hold_windows(request, ends, computed.parent_serials,
                                     head=not num_verified)

    def check_resumable(self, request_id: str, num_computed_tokens: int) -> None:
        """Raise ValueError when a group cannot go on from `num_computed_tokens` (the
        request's progress moved back below a block it cached or a page a window let go
        of)."""
        for manager in self.managers:
            error = manager.resume_error(request_id, num_computed_tokens)
            if error is not None:
                raise ValueError(f"request {request_id!r}: progress moved back to "
                                 f"{num_computed_tokens} tokens, but in group "
                                 f"{manager.group_id} {error}")

    def num_allocated_tokens(self, request_id: str) -> int:
        """The tokens a live request's pages cover (every paged group's table has one entry
        per block)."""
        return len(self._cache_order[0].table(request_id)) * self.block_size

    def allocate(self, request: Request, num_tokens: int) -> tuple[tuple[int, ...], ...]:
        """Grow every group's table to `num_tokens` tokens (the caller checked it fits);
        returns the ids of the pages appended to each group's table."""
        for manager in self._cache_order:
            manager.release_computed(request)
        ids = tuple([manager.allocate(request, num_tokens) for manager in self.managers])
        for manager in self.recurrent:
            manager.take_checkpoint(request)
        return ids

    def _chain_block_at(self, request: Request, i: int) -> KVCacheBlock | None:
        """The cached attention block at table index `i` of a live request holding its
        block i (None if no attention group holds it cached)."""
        if i < 0 or i >= len(request.block_hashes):
            return None
        rid = request.request_id
        block_hash = request.block_hashes[i]
        for manager in self._cache_order:
            table = manager.table(rid)
            if i < len(table):
                block = table[i]
                if block.block_id != 0 and block.block_hash == block_hash and i < \
                        manager.num_cached_blocks(rid):
                    return block
        return None

    def next_checkpoints(self, request: Request, num_new_tokens: int,
                         computed: ComputedBlocks | None = None) -> list[int]:
        """Positions of the next `num_new_tokens` where a recurrent group takes a checkpoint
        if a step ends there (from the hit of `computed` when the request waits)."""
        out: set[int] = set()
        for manager in self.recurrent:
            out.update(manager.next_checkpoints(request, num_new_tokens, computed))
        return sorted(out)

    def free(self, request: Request) -> None:
        """Release the request's pages in every group (full attention's blocks indexed first,
        see `allocate`; a recurrent group's end checkpoint after them)."""
        if self.recurrent or (len(self._cache_order) > 1
                              and self._cache_order[0] is not self.managers[0]):
            for manager in self._cache_order:
                manager.cache_blocks(request, min(request.num_computed_tokens,
                                                  len(manager.table(request.request_id))
                                                  * self.block_size))
            for manager in self.recurrent:
                manager.checkpoint_at_end(request)
        tables = [manager.free(request) for manager in self.managers]
        pool = self.pool
        if self._learns_branches:  # its output pages, for `_hold_likely_ends`
            for block in tables[self._full_group][request.num_prompt_tokens // self.block_size:]:
                if block.hint < 0 and block.block_hash is not None:
                    block.hint = OUTPUT
        if self._recurrent_groups:  # large pages, on lists of their own: deepest entry first
            pages = [tables[g] for g in self._recurrent_groups]
            pool.free_blocks([table[i] for i in range(max(map(len, pages)) - 1, -1, -1)
                              for table in pages if i < len(table)])
        if len(self._free_order) == 1:  # one table, deepest first: a chain's root goes last
            g = self._free_order[0]
            pool.free_blocks([b for b in reversed(tables[g]) if b.block_id != 0], g)
            return
        # Several groups: one order over the paged ones, deepest position first (window
        # pages before the full-attention page at the same position). A prefix's pages
        # then leave together from its end, and its root last, as they would from one
        # all-full table. Pages dropped from windows earlier stay where they were freed.
        paged = [tables[g] for g in self._free_order]
        n = max(len(table) for table in paged)
        if any(len(table) != n for table in paged):  # pad, so that entry i is position i
            paged = [table + [pool.null_block] * (n - len(table)) for table in paged]
        by_position = zip(*map(reversed, paged), strict=True)
        pool.free_blocks([block for block in chain.from_iterable(by_position)
                          if block.block_id != 0])

    def release_held(self, requests: Mapping[str, Request]) -> bool:
        """Every sliding-window group stops holding pages past the windows of the live
        `requests` (by id; see SlidingWindowManager); returns whether any group held some."""
        released = [manager.release_held(requests) for manager in self.managers]  # every group
        return any(released)

    def fork(self, parent_id: str, child_id: str, num_computed_tokens: int) -> None:
        """Share every page of the parent with the child, in every group (see
        SingleTypeKVCacheManager.fork); a recurrent group gives the child a copy of the
        parent's working state. RuntimeError, changing nothing, if no large page is free
        for it."""
        if self.recurrent:
            pool = self.pool
            free = getattr(pool, "num_free_large_pages", 0)
            if free < len(self.recurrent):
                raise RuntimeError(f"forking {parent_id!r} needs {len(self.recurrent)} free "
                                   f"large pages for the child's working states; {free} free")
        for manager in self.managers:
            manager.fork(parent_id, child_id, num_computed_tokens)

    def block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """Per-group block tables (0 = the null block)."""
        return tuple([m.block_ids(request_id) for m in self.managers])
