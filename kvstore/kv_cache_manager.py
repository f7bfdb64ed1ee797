"""The scheduler-facing API of the cache layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType

from kvstore.block_pool import (
    BlockPool,
    BlockState,
    CacheStats,
    KVCacheEvent,
    PendingCopies,
    TwoSizeBlockPool,
)
from kvstore.errors import RequestTooLargeError
from kvstore.eviction import DEFAULT_EVICTION, EVICTION_POLICIES, RECURRENT_EVICTION, EvictionPolicy
from kvstore.hashing import HashFn, hash_block
from kvstore.kv_cache_coordinator import (
    AllocationPlan,
    ComputedBlocks,
    KVCacheCoordinator,
    LookupMemo,
)
from kvstore.request import Request, as_count
from kvstore.single_type_kv_cache_manager import RecurrentManager, SlidingWindowManager
from kvstore.specs import FullAttentionSpec, KVCacheConfig
from kvstore.utils import cdiv

# Per group, block ids (0 = the null block).
BlockIds = tuple[tuple[int, ...], ...]

#: `ReleasedPages.cause` values.
RELEASE_CAUSES = ("free", "window", "held")


@dataclass(frozen=True)
class ReleasedPages:
    """Pages of one group that a request let go of, reported to the manager's release
    listener before they can be reused:

    - `free`: every page the request held when freed (finished, preempted or aborted);
    - `window`: pages its sliding window moved past in one `grow`;
    - `held`: the same, in a `grow` in which the request, running alone, let go of the
      pages it held past its window (see `KVCacheManager`).

    `pages` are (table index, page id) pairs by table index; for window drops, `near_end[i]`
    says whether page i lies in the window before one of the request's likely hit ends. For
    a recurrent group they are the large pages holding a state of the request's prefix at a
    block boundary (`RecurrentManager.held_checkpoints`), each with the index of the block
    that prefix ends with."""

    request: Request
    group_id: int
    cause: str
    pages: tuple[tuple[int, int], ...]
    near_end: tuple[bool, ...] = ()


ReleaseListener = Callable[[ReleasedPages], None]


@dataclass(frozen=True)
class CacheConfig:
    """How a `KVCacheManager` caches, checked when made.

    - `enable_caching`: index computed blocks and serve prefix hits (off: every request
      computes everything; the options below then have no effect).
    - `enable_partial_hits`: also hit the leading tokens of a cached block (copy-on-write).
    - `enable_events`: record BlockStored / BlockRemoved events (`take_events`).
    - `hash_fn`: the block hash, (parent hash, token ids) -> hash, an int in [0, 2**128);
      `make_keyed_hash(secret)` where prompts come from untrusted users. Every request a
      manager sees is hashed with it (and its block size).
    - `eviction`: the policy ordering free cached pages for reuse, by name (see
      `kvstore.eviction.EVICTION_POLICIES`) or a policy object used by one manager only;
      None: `lru`, or `worth` for a layout with recurrent groups (checkpoints evicted by
      the compute they save).
    - `hold_window_pages`: sliding-window groups keep the pages past the window that later
      prompts are likely to hit until the request ends (see `KVCacheManager`); off,
      windows drop every page as they pass it, as vLLM does.
    - `checkpoint_every_blocks`: recurrent groups also take a checkpoint every that many
      blocks (default 512: 8,192 tokens of 16-token blocks, vLLM's default step budget, so
      a long prompt has no fewer checkpoints than vLLM's `align` mode takes in it; 0: only
      at prompt ends, output ends and branch points; 1: at every block boundary a step ends
      on).
    """

    enable_caching: bool = True
    enable_partial_hits: bool = True
    enable_events: bool = False
    hash_fn: HashFn = hash_block
    eviction: str | EvictionPolicy | None = None
    hold_window_pages: bool = True
    checkpoint_every_blocks: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and type(value) is not bool:
                raise TypeError(f"CacheConfig.{f.name} must be a bool, got "
                                f"{type(value).__name__} {value!r:.60}")
        every = as_count(self.checkpoint_every_blocks)
        if every is None or every < 0:
            raise ValueError(f"CacheConfig.checkpoint_every_blocks must be an int >= 0, got "
                             f"{self.checkpoint_every_blocks!r:.60}")
        object.__setattr__(self, "checkpoint_every_blocks", every)
        if not callable(self.hash_fn):
            raise TypeError(f"CacheConfig.hash_fn must be callable, got {self.hash_fn!r:.60}")
        if isinstance(self.eviction, str):
            if self.eviction not in EVICTION_POLICIES:
                raise ValueError(f"unknown eviction policy {self.eviction!r}; known: "
                                 f"{', '.join(sorted(EVICTION_POLICIES))}")
        elif self.eviction is not None and not isinstance(self.eviction, EvictionPolicy):
            raise TypeError(f"CacheConfig.eviction must be a policy name, an EvictionPolicy or "
                            f"None, "
                            f"got {type(self.eviction).__name__}")


class CopyBatch(list[tuple[int, int]]):
    """The (src, dst) page copies one `take_pending_copies` call handed out; `issuer` is
    the manager whose pages they name."""

    __slots__ = ("issuer",)

    def __init__(self, pairs: list[tuple[int, int]], issuer: object) -> None:
        super().__init__(pairs)
        self.issuer = issuer


class KVCacheManager:
    """Block bookkeeping for a scheduler: prefix hits, allocation, frees, forks, copies.

    Per step, the scheduler calls `get_computed_blocks` then `admit` for a new request, or
    `grow` for a running one (`allocate_slots` does either, by whether the request is
    live), hands `take_pending_copies()` to the worker, which runs those copies before the
    forward pass, and after the step advances `request.num_computed_tokens`. Pins that keep
    copy sources and destinations alive are released by the next `take_pending_copies()`
    call, so the worker must have run a batch of copies before it asks for the next one.

    `cache_config` (a `CacheConfig`; its defaults if None) says how it caches: block hashes
    are computed with its `hash_fn` (XXH3-128 by default), and every request this manager
    sees must be hashed with it; its `eviction` policy orders free cached pages for reuse
    (see kvstore.eviction; LRU by default, `worth` with recurrent groups).

    With `hold_window_pages` (default), a sliding-window group keeps, until the request
    ends, the pages past its window that what its lookup found says later prompts will
    hit: the window before the branch points on its hit's chain (where a lookup left the
    cached chain at a block after which it goes on another way; the pages another request
    holds there are shared), before its hit end unless the cache shows the chain goes on
    the prompt's way there (it simply ended there, it ends in the output of the request
    that cached it, or another running request is computing past it: a conversation's next
    turn), and the first W tokens of a prompt the cache had nothing of. They are let go
    when a request that runs alone cannot grow otherwise. Off, windows drop every page as
    they pass it, as vLLM does.

    Beside it, a connector (tiers below the device pool, as vLLM's KV connectors) supplies
    tokens past a device hit (`admit(..., num_external_tokens=)`) and hears of the pages
    requests let go of (`set_release_listener`).

    Hits in flight. A block is indexed once computed, at its request's next growth or free.
    A lookup also goes on past its cached hit into the pages of a running request whose
    last prefill chunk (an admission or growth of more than one token) fills them with the
    prompt's tokens, where that request's cached blocks end exactly at the hit (without a
    recurrent group): requests admitted in the step that computes their shared prefix hit
    it, as in vLLM. Admitting such a hit indexes those pages as their request's blocks, no
    copy source until it has computed them. Two promises make it exact, and the caller
    keeps both: the worker writes every scheduled token's K/V of a layer before any
    attention of that layer reads (`kvstore.engine`'s runner does), and a request is not
    freed between being scheduled and its step running (preemption victims are requests
    not yet scheduled in the step; aborts come between steps). Freeing a request whose step
    did not run drops the pages it had indexed that way; `free` raises, changing nothing,
    while another request still holds one (free the requests admitted on them first).
    """

    __slots__ = ("config", "cache_config", "block_size", "enable_caching", "enable_partial_hits",
                 "_hash_fn",
                 "_pool", "_copies", "_coordinator", "_requests", "_no_new_blocks", "_quiet",
                 "_num_paged_groups", "_lookups", "_num_lookups", "_listener", "_drops",
                 "_scheduled")

    def __init__(self, config: KVCacheConfig, cache_config: CacheConfig | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig (make_kv_cache_config), got "
                            f"{type(config).__name__}")
        if cache_config is None:
            cache_config = CacheConfig()
        elif not isinstance(cache_config, CacheConfig):
            raise TypeError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
        self.config = config
        self.cache_config = cache_config
        self.block_size = config.block_size
        enable_caching = cache_config.enable_caching
        self.enable_caching = enable_caching
        self.enable_partial_hits = enable_caching and cache_config.enable_partial_hits
        self._hash_fn = cache_config.hash_fn
        chained = frozenset(g for g, group in enumerate(config.groups)
                            if isinstance(group.spec, FullAttentionSpec))
        eviction = cache_config.eviction
        if eviction is None:
            eviction = RECURRENT_EVICTION if config.has_recurrent else DEFAULT_EVICTION
        index_children = KVCacheCoordinator.learns_branches(config,
                                                            cache_config.hold_window_pages)
        if config.has_recurrent:
            # A recurrent state never sits inside a block: no partial hits.
            self.enable_partial_hits = False
            self._pool: BlockPool = TwoSizeBlockPool(
                config.num_blocks, config.large_page_blocks,
                frozenset(g for g, group in enumerate(config.groups) if group.is_recurrent),
                enable_caching, cache_config.enable_events, index_partial_blocks=False,
                eviction=eviction, chained_groups=chained,
                num_groups=len(config.groups), bytes_per_block=config.bytes_per_block,
                group_kinds=tuple(group.kind for group in config.groups),
                index_children=index_children)
        else:
            self._pool = BlockPool(config.num_blocks, enable_caching, cache_config.enable_events,
                                   index_partial_blocks=self.enable_partial_hits,
                                   eviction=eviction, chained_groups=chained,
                                   num_groups=len(config.groups),
                                   group_kinds=tuple(group.kind for group in config.groups),
                                   index_children=index_children)
        # Copies queued for the worker and the pins that keep their pages alive.
        self._copies = PendingCopies(self._pool)
        self._coordinator = KVCacheCoordinator(config, self._pool, self._copies,
                                               cache_config.hold_window_pages,
                                               cache_config.checkpoint_every_blocks)
        self._requests: dict[str, Request] = {}
        self._no_new_blocks: BlockIds = ((),) * len(config.groups)
        # Groups with a page per block of tokens (a recurrent group's large pages are not).
        self._num_paged_groups = sum(not group.is_recurrent for group in config.groups)
        # Per live request, (lo, hi, max_tokens, request) from its last growth: growing to
        # at most max_tokens with a computed count in [lo, hi) needs nothing until the
        # request's tables change (allocate, free, fork drop the entry).
        # Other requests cannot change it: they can only share its cached pages, and a
        # range is only given while none of its pages from lo on is cached or shared.
        self._quiet: dict[str, tuple[int, int, int, Request]] = {}
        # Per request id not yet admitted, the request object looked up last, the id of
        # that lookup (`admit` takes only that lookup, for that object) and what it found
        # (the next lookup of that object may find it again).
        self._lookups: dict[str, tuple[Request, int, LookupMemo]] = {}
        self._num_lookups = 0
        # Who hears of released pages, and the window drops of the call under way.
        self._listener: ReleaseListener | None = None
        self._drops: list[tuple[str, int, int, int, bool, bool]] = []
        # Per live request whose last admission or growth scheduled a prefill chunk, the
        # request and the token count that step computes up to: lookups may hit the pages
        # it fills (see "Hits in flight").
        self._scheduled: dict[str, tuple[Request, int]] = {}

    # ---- state -------------------------------------------------------------------------------
    @property
    def hash_fn(self) -> HashFn:
        """The block hash function: (parent hash, token ids) -> hash."""
        return self._hash_fn

    @property
    def stats(self) -> CacheStats:
        """A copy of the counters: lookups, hit tokens, partial hits, copies, evictions."""
        return replace(self._pool.stats)

    @property
    def usage(self) -> float:
        """Fraction of the pool's usable blocks in use."""
        return self._pool.usage

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self._pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request or pending copy holds (cached content included)."""
        return self._pool.num_free_blocks

    def group_usage(self) -> list[float]:
        """Per group, the fraction of the pool's usable blocks it holds."""
        n = self._pool.num_usable_blocks
        return [count / n for count in self.blocks_in_use_by_group()]

    def cached_blocks_by_group(self) -> tuple[int, ...]:
        """Per group, the pages holding indexed content (in use or free)."""
        cached = self._pool.cached_by_group
        return tuple(cached[g] for g in range(len(self.config.groups)))

    def evictions_by_group(self) -> tuple[int, ...]:
        """Per group, the cached pages evicted so far (`stats.evictions` split by group)."""
        evicted = self._pool.evicted_by_group
        return tuple(evicted[g] for g in range(len(self.config.groups)))

    def blocks_in_use_by_group(self) -> tuple[int, ...]:
        """Per group, the blocks it holds (shared pages once)."""
        in_use = self._pool.in_use_by_group
        return tuple(in_use[g] for g in range(len(self.config.groups)))

    @property
    def requests(self) -> Mapping[str, Request]:
        """Live requests by id (a read-only view)."""
        return MappingProxyType(self._requests)

    @property
    def pinned_blocks(self) -> tuple[int, ...]:
        """Ids of the copy sources and destinations held by pins (one entry per pin)."""
        return self._copies.pinned_block_ids

    def block_states(self) -> tuple[BlockState, ...]:
        """A snapshot of every block but the null block, by block id."""
        return self._pool.block_states()

    # ---- lookups -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The request's longest cached prefix in every group; changes nothing.

        Pass the result to `admit` of this manager, for this request object; it is refused
        once the request was admitted, its lookup dropped, or it was looked up again, and as
        stale if cached content it names was evicted in between."""
        self._check_request(request)
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        request.update_block_hashes(self.block_size, self._hash_fn)
        self._num_lookups += 1
        lookup_id = self._num_lookups
        entry = self._lookups.get(rid)
        memo = entry[2] if entry is not None and entry[0] is request else LookupMemo()
        self._lookups[rid] = (request, lookup_id, memo)
        if not self.enable_caching:
            return self._no_hit(request, lookup_id)
        # At least one token is computed so the model yields logits.
        return self._coordinator.find_longest_hit(request, request.num_tokens - 1,
                                                  self.enable_partial_hits, self, lookup_id, memo,
                                                  self._scheduled)

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> BlockIds | None:
        """`admit` a request that is not live (with its `get_computed_blocks` result, or None
        for no hit), else `grow` it; see those."""
        if type(request) is Request and computed is None:
            # The decode hot path: a live request inside its quiet range (see `_quiet`) needs
            # nothing; every check `grow` makes is made here too. (A prefill chunk goes on to
            # `grow`, which records it: "Hits in flight".)
            quiet = self._quiet.get(request.request_id)
            if quiet is not None and quiet[3] is request \
                    and type(num_new_tokens) is int and num_new_tokens == 1 \
                    and type(num_lookahead_tokens) is int and num_lookahead_tokens >= 0:
                num_computed = request.num_computed_tokens
                if type(num_computed) is int and quiet[0] <= num_computed < quiet[1] \
                        and num_computed + num_new_tokens <= len(request.token_ids) \
                        and num_computed + num_new_tokens + num_lookahead_tokens <= quiet[2]:
                    return self._no_new_blocks
        self._check_request(request)
        if request.request_id not in self._requests:
            return self._admit(request, num_new_tokens, computed, num_lookahead_tokens)
        if computed is not None and self._requests[request.request_id] is request:
            raise ValueError(f"request {request.request_id!r} is already admitted; computed "
                             "blocks are only for admission")
        return self._grow(request, num_new_tokens, num_lookahead_tokens)

    def admit(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None,
              num_lookahead_tokens: int = 0, num_external_tokens: int = 0) -> BlockIds | None:
        """Admit a new request on its prefix hit (`get_computed_blocks`; None for no hit) with
        pages for `num_new_tokens` more tokens (plus lookahead), per group.

        On success its `num_computed_tokens` becomes the hit length (the full-block part
        alone when the partial block's copy is what would not fit; the new tokens then start
        there). Returns the ids of the pages appended to each group's table (copy
        destinations are in `block_table` only), or None when the pool cannot hold them;
        then nothing has changed.

        `num_external_tokens` (whole blocks) are supplied by a source outside the pool (a
        connector's tiers) right after the hit's full blocks: they get fresh pages that the
        caller fills before the next forward, the hit's partial block is not taken, and
        they count as computed. A sliding-window group keeps only the window before the
        hit's end: its entries below it are null (those the tokens would have filled take
        no page), as for a device hit that long. A recurrent group takes no device
        checkpoint: the caller loads the state at the hit's end into its working state
        (the table's one large page). `RequestTooLargeError` when those pages
        and the new tokens' exceed the whole pool; then nothing has changed."""
        self._check_request(request)
        return self._admit(request, num_new_tokens, computed, num_lookahead_tokens,
                           num_external_tokens)

    def grow(self, request: Request, num_new_tokens: int,
             num_lookahead_tokens: int = 0) -> BlockIds | None:
        """Pages for `num_new_tokens` more tokens (plus lookahead) of a running request, per
        group, from its `num_computed_tokens` on.

        Returns the ids of the pages appended to each group's table (pages that replace
        shared ones are in `block_table` only), or None when the pool cannot hold them;
        then nothing has changed."""
        self._check_request(request)
        return self._grow(request, num_new_tokens, num_lookahead_tokens)

    def _admit(self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None,
               num_lookahead_tokens: int, num_external_tokens: int = 0) -> BlockIds | None:
        num_new_tokens, num_lookahead_tokens = self._check_counts(num_new_tokens,
                                                                  num_lookahead_tokens)
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is already admitted")
        request.update_block_hashes(self.block_size, self._hash_fn)
        if computed is None:
            computed = self._no_hit(request, 0)
        else:
            self._check_computed(request, computed)
        if num_external_tokens:
            return self._admit_external(request, num_new_tokens, computed, num_lookahead_tokens,
                                        num_external_tokens)
        self._check_length(request, computed.num_computed_tokens, num_new_tokens)
        fitting = self._fit_admission(request, computed, num_new_tokens + num_lookahead_tokens)
        if fitting is None:
            return None
        if fitting.num_inflight_blocks:
            fitting = self._index_inflight(request, fitting)
        request.num_computed_tokens = fitting.num_computed_tokens
        self._quiet.pop(rid, None)
        self._lookups.pop(rid, None)
        stats = self._pool.stats
        restored = stats.checkpoints_used
        self._coordinator.admit(request, fitting)
        self._requests[rid] = request
        stats.lookups += 1
        stats.queried_tokens += request.num_tokens
        stats.hit_tokens += fitting.num_computed_tokens
        if fitting.num_partial_tokens:
            stats.partial_hits += 1
            stats.partial_hit_tokens += fitting.num_partial_tokens
        if stats.checkpoints_used > restored:  # not on a tier admission: the caller loads it
            stats.recurrent_hits += 1
        ids = self._coordinator.allocate(
            request, fitting.num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        if num_new_tokens > 1:
            self._scheduled[rid] = (request, fitting.num_computed_tokens + num_new_tokens)
        if self._drops:
            self._report_drops()
        return ids

    def _admit_external(self, request: Request, num_new_tokens: int, computed: ComputedBlocks,
                        num_lookahead_tokens: int, num_external_tokens: int) -> BlockIds | None:
        """`admit` with tokens from outside the pool (see there)."""
        n = as_count(num_external_tokens)
        bs = self.block_size
        if n is None or n < 0 or n % bs:
            raise ValueError(f"num_external_tokens must be a whole number of blocks (an int >= 0, "
                             f"a multiple of {bs}), got {num_external_tokens!r}")
        start = computed.num_full_hit_tokens
        end = start + n
        self._check_length(request, end, num_new_tokens)
        if computed.num_inflight_blocks:
            computed = self._index_inflight(request, computed)
        # A sliding-window group keeps only the window before the hit's end: its device hit
        # blocks below it are null, like those of a device hit that long.
        specs = [group.spec for group in self.config.groups]
        window = [min(end // bs, spec.first_needed_block(end)) for spec in specs]
        null = self._pool.null_block
        blocks = tuple(b if not window[g] else [null] * min(len(b), window[g]) + b[window[g]:]
                       for g, b in enumerate(computed.blocks))
        device = replace(computed, blocks=blocks, partial_sources=(None,) * len(blocks),
                         num_partial_tokens=0)
        # The external blocks are pages allocated like new tokens.
        ids = self._admit(request, num_new_tokens + n, device, num_lookahead_tokens)
        if ids is None:
            return None
        out = []
        first = start // bs
        for g, group_ids in enumerate(ids):
            k = max(0, window[g] - first)  # below the window: null entries, pages back
            if k:
                self._coordinator.managers[g].null_fresh_entries(request.request_id, first,
                                                                 first + k)
            out.append(group_ids[k:])
        request.num_computed_tokens = end
        for recurrent in self._coordinator.recurrent:  # its working state is loaded
            recurrent.loaded_state(request)
        return tuple(out)

    def _grow(self, request: Request, num_new_tokens: int,
              num_lookahead_tokens: int) -> BlockIds | None:
        # The decode hot path: checks inline (exact types: a bool is not a count).
        if type(num_new_tokens) is not int or num_new_tokens <= 0 or type(
                num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            num_new_tokens, num_lookahead_tokens = self._check_counts(num_new_tokens,
                                                                      num_lookahead_tokens)
        rid = request.request_id
        live = self._requests.get(rid)
        if live is not request:
            if live is None:
                raise ValueError(f"unknown request {rid!r}: admit it first")
            raise ValueError(f"duplicate request id {rid!r}: another request is live under it")
        num_computed = request.num_computed_tokens
        if type(num_computed) is not int or num_computed < 0 or \
                num_computed + num_new_tokens > request.num_tokens:
            num_computed = self._check_progress(request)
            self._check_length(request, num_computed, num_new_tokens)
        coordinator = self._coordinator
        num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        quiet = self._quiet.pop(rid, None)
        if quiet is not None and quiet[0] <= num_computed < quiet[1] and num_tokens <= quiet[2]:
            # Most decode steps: the pages exist, nothing to cache, drop or copy.
            self._quiet[rid] = quiet
            if num_new_tokens > 1:  # a prefill chunk inside its pages (see "Hits in flight")
                self._scheduled[rid] = (request, num_computed + num_new_tokens)
            return self._no_new_blocks
        # Past the quiet range (it ends where some group has work: a block to cache or to
        # add, a page leaving the window), or none known: the progress must lie within the
        # pages; without a range, each group is asked whether it has work.
        covered = coordinator.num_allocated_tokens(rid)
        if num_computed > covered:
            raise ValueError(f"request {rid!r}: {num_computed} tokens computed, but its pages "
                             f"cover {covered}: progress ran past what was allocated")
        # At or past the range's start, nothing the groups cached or let go of since is needed.
        if quiet is None or num_computed < quiet[0]:
            coordinator.check_resumable(rid, num_computed)
        if num_new_tokens == 1 and self._scheduled:  # decoding: no prefill chunk in flight
            self._scheduled.pop(rid, None)
        if quiet is None and all(m.is_noop(request, num_tokens) for m in coordinator.managers):
            if num_new_tokens > 1:
                self._scheduled[rid] = (request, num_computed + num_new_tokens)
            self._note_quiet(request)
            return self._no_new_blocks
        request.update_block_hashes(self.block_size, self._hash_fn)
        # Each table position written from the computed count on costs a paged group at most
        # one free page (a new page, or a private copy of a shared one), a recurrent group
        # none: when the free pages cover that bound the exact plan is not needed.
        bs = self.block_size
        if self._num_paged_groups * (cdiv(num_tokens, bs) - num_computed // bs) > self._pool.num_free_blocks:
            plan = coordinator.num_blocks_needed(request, num_computed, num_tokens, None)
            self._check_pool_holds(rid, plan.num_resident, num_tokens)
            if plan.num_free_needed > self._pool.num_free_blocks + plan.num_released:
                # The pages running requests hold past their windows are let go only when
                # this request runs alone, and only if that makes it fit: else the scheduler
                # preempts one, which keeps the held pages of the prefixes still running.
                held = sum(m.num_held_freed(rid, num_computed) for m in coordinator.managers)
                if len(self._requests) > 1 or plan.num_free_needed > (
                        self._pool.num_free_blocks + plan.num_released + held):
                    return None
                self._release_held(request)
        ids = coordinator.allocate(request, num_tokens)
        if num_new_tokens > 1:  # a prefill chunk (see "Hits in flight")
            self._scheduled[rid] = (request, num_computed + num_new_tokens)
        if self._drops:
            self._report_drops()
        # The tables now hold everything growing to num_tokens needs at this computed count
        # (each group's `is_noop` holds), so the next quiet range starts here.
        self._note_quiet(request)
        return ids

    def _report_drops(self) -> None:
        """Hand the window drops of this call to the listener: one record per request and
        group (`held` where that request let go of its held pages), by table index."""
        drops, self._drops[:] = sorted(self._drops), []
        by_request: dict[tuple[str, int], list[tuple[str, int, int, int, bool, bool]]] = {}
        for drop in drops:
            by_request.setdefault((drop[0], drop[1]), []).append(drop)
        listener = self._listener
        assert listener is not None
        for (rid, g), rows in by_request.items():
            cause = "held" if any(row[5] for row in rows) else "window"
            listener(ReleasedPages(self._requests[rid], g, cause,
                                   tuple((row[2], row[3]) for row in rows),
                                   tuple(row[4] for row in rows)))

    def _release_held(self, request: Request) -> None:
        """Let go of the pages held past the windows (`request` runs alone and cannot grow
        otherwise): those the windows have passed are dropped now, the others as they pass."""
        self._coordinator.release_held(self._requests)
        self._quiet.clear()

    def _note_quiet(self, request: Request) -> None:
        """Record the live request's quiet range (its tables give what growing needs)."""
        quiet = self._coordinator.quiet_range(request)
        if quiet is not None:
            self._quiet[request.request_id] = (*quiet, request)

    def _fit_admission(self, request: Request, computed: ComputedBlocks,
                       num_more_tokens: int) -> ComputedBlocks | None:
        """The hit to admit on so that its pages and `num_more_tokens` more fit the pool:
        `computed`, or its full-block part alone, or None."""
        num_tokens = computed.num_computed_tokens + num_more_tokens
        num_free = self._pool.num_free_blocks
        # Every paged group takes a new page for each position past the hit (and its partial
        # block), a recurrent group large pages besides: when the free pages do not cover
        # that, neither the hit nor its full-block part fits, and the exact plan is not
        # needed.
        num_hit_blocks = computed.num_full_hit_tokens // self.block_size
        bound = self._num_paged_groups * (cdiv(num_tokens, self.block_size) - num_hit_blocks
                                    - (computed.num_partial_tokens > 0))
        if bound > num_free:
            self._check_pool_holds(request.request_id, self._coordinator.num_resident_blocks(
                computed.num_computed_tokens, num_tokens), num_tokens)
            return None
        plan = self._coordinator.num_blocks_needed(request, computed.num_computed_tokens,
                                                   num_tokens, computed)
        self._check_pool_holds(request.request_id, plan.num_resident, num_tokens)
        if plan.num_free_needed <= num_free + plan.num_released:
            return computed if self._large_fit(plan, computed) else None
        if not computed.num_partial_tokens:
            return None
        # A partial hit costs a pinned source page on top of the request's own pages;
        # when only that makes it not fit, admit on the full-block hit alone (the
        # request then computes the partial block's tokens itself).
        computed = replace(computed, partial_sources=(None,) * len(computed.partial_sources),
                           num_partial_tokens=0)
        num_tokens = computed.num_computed_tokens + num_more_tokens
        plan = self._coordinator.num_blocks_needed(request, computed.num_computed_tokens,
                                                   num_tokens, computed)
        if plan.num_free_needed > self._pool.num_free_blocks + plan.num_released:
            return None
        return computed

    def _large_fit(self, plan: AllocationPlan, computed: ComputedBlocks) -> bool:
        """Whether the large pages an admission takes are free once its hit blocks are
        referenced (always, without a recurrent group)."""
        if not plan.num_large:
            return True
        pool = self._pool
        assert isinstance(pool, TwoSizeBlockPool)
        return pool.large_pages_fit(plan.num_large,
                                    (b for blocks in computed.blocks for b in blocks))

    def next_checkpoints(self, request: Request, num_new_tokens: int,
                         computed: ComputedBlocks | None = None) -> list[int]:
        """Positions among the request's next `num_new_tokens` where a recurrent group takes
        a checkpoint if a step ends there, ascending: a scheduler stops a chunk at the first
        so the model writes the state out. From the request's computed count; for a request
        about to be admitted, pass its lookup as `computed`: the positions then count from
        its hit and include the branch point the lookup found. Empty without a recurrent
        group (the arguments are checked all the same)."""
        self._check_request(request)
        n = as_count(num_new_tokens)
        if n is None or n < 0:
            raise ValueError(f"num_new_tokens must be an int >= 0, got {num_new_tokens!r}")
        if computed is not None:
            if not isinstance(computed, ComputedBlocks) or computed.issuer is not self or \
                    computed.request_id != request.request_id:
                raise ValueError(f"computed must be this manager's lookup of "
                                 f"{request.request_id!r}")
            self._coordinator.check_shape(request, computed)
            if request.request_id in self._requests:
                raise ValueError(f"request {request.request_id!r} is admitted already: its "
                                 "positions count from its computed tokens (pass no lookup)")
            self._check_length(request, computed.num_computed_tokens, n)
        else:
            self._check_length(request, self._check_progress(request), n)
        if not self._coordinator.recurrent:
            return []
        return self._coordinator.next_checkpoints(request, n, computed)

    def hit_checkpoint_kind(self, request_id: str) -> str | None:
        """For a running request whose admission hit a recurrent checkpoint, why that
        checkpoint was taken (one of `CHECKPOINT_KINDS`: ``"prompt_end"``,
        ``"branch_point"``, ``"every_n"``, ``"output_end"``, ``"request_end"``); None
        without such a hit or without a recurrent group."""
        for manager in self._coordinator.recurrent:
            kind = manager.hit_kinds.get(request_id)
            if kind is not None:
                return kind
        return None

    @property
    def fragmented_bytes(self) -> int:
        """Bytes of free blocks inside large pages that also hold blocks in use (memory no
        recurrent state can take until those blocks are freed); 0 without a recurrent
        group."""
        pool = self._pool
        return pool.fragmented_bytes if isinstance(pool, TwoSizeBlockPool) else 0

    def free(self, request: Request) -> None:
        """Release a finished or preempted request; its computed content stays cached.
        Pages a hit in flight indexed from it that it has not computed (its step did not run)
        leave the index; RuntimeError, changing nothing, while another request still holds
        one of them (see "Hits in flight")."""
        self._check_admitted(request)
        self._check_progress(request)
        unwritten = self._coordinator.unwritten(request)
        if any(block.ref_cnt - block.pin_cnt > 1 for block in unwritten):
            raise RuntimeError(f"request {request.request_id!r} is freed before its step ran, "
                               "and another request's hit holds pages that step computes")
        if unwritten:
            self._pool.uncache(unwritten)
        request.update_block_hashes(self.block_size, self._hash_fn)
        self._quiet.pop(request.request_id, None)
        self._scheduled.pop(request.request_id, None)
        listener = self._listener
        if listener is not None:
            managers = self._coordinator.managers
            for g, table in enumerate(self._coordinator.block_ids(request.request_id)):
                manager = managers[g]
                pages = (manager.held_checkpoints(request) if isinstance(manager, RecurrentManager)
                         else tuple((i, b) for i, b in enumerate(table) if b))
                listener(ReleasedPages(request, g, "free", pages))
        self._coordinator.free(request)
        self._coordinator.release_writes(request)
        del self._requests[request.request_id]

    def _index_inflight(self, request: Request, computed: ComputedBlocks) -> ComputedBlocks:
        """Index the pages a hit in flight takes (`ComputedBlocks.inflight`'s) as that
        request's blocks; returns the hit as one of cached blocks."""
        source = computed.inflight
        assert source is not None
        self._quiet.pop(source.request_id, None)  # its pages become shared
        return self._coordinator.index_inflight(request, computed)

    def drop_lookup(self, request: Request) -> bool:
        """Forget what looking up a request that leaves the waiting queue without being
        admitted (aborted) holds; returns whether it held anything. A device lookup holds
        no page (a connector's lookup may hold what it found: drop it there too); its result
        can no longer be admitted. An admitted request is released by `free`."""
        self._check_request(request)
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"request {rid!r} is admitted: free it instead")
        entry = self._lookups.get(rid)
        if entry is not None and entry[0] is request:
            del self._lookups[rid]
        return False

    def fork(self, parent: Request, child: Request) -> None:
        """Admit `child` sharing every page of `parent` (parallel sampling)."""
        self._check_request(parent)
        self._check_request(child)
        if self._requests.get(parent.request_id) is not parent:
            raise ValueError(f"unknown parent request {parent.request_id!r}")
        self._check_progress(parent)
        if child.request_id in self._requests:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        if (child.token_ids != parent.token_ids
                or child.num_computed_tokens != parent.num_computed_tokens
                or child.cache_salt != parent.cache_salt):
            raise ValueError("a forked child must have its parent's tokens, progress and salt "
                             "(use Request.fork)")
        child.copy_block_hashes(parent)
        self._quiet.pop(parent.request_id, None)  # its pages become shared
        self._coordinator.fork(parent.request_id, child.request_id, parent.num_computed_tokens)
        self._requests[child.request_id] = child
        self._lookups.pop(child.request_id, None)  # admitted: its lookup is spent

    def set_release_listener(self, listener: ReleaseListener | None) -> None:
        """Call `listener` with a `ReleasedPages` record whenever a request lets go of pages
        (freed, or dropped from a sliding window), before they can be reused; None stops
        it. One listener at a time."""
        if listener is not None and not callable(listener):
            raise TypeError(f"listener must be callable or None, got {type(listener).__name__}")
        self._listener = listener
        if isinstance(self._pool, TwoSizeBlockPool):
            self._pool.tiered = listener is not None
        for manager in self._coordinator.managers:
            if isinstance(manager, SlidingWindowManager):
                manager.drop_log = self._drops if listener is not None else None

    def take_pending_copies(self) -> CopyBatch:
        """(src, dst) block copies the worker must run, for every layer, before the next
        forward; releases the pins of the previous batch. A device cache bound to another
        manager (`PagedKVCache.bind`) refuses the batch."""
        return CopyBatch(self._copies.take(), self)

    # ---- views -------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> BlockIds:
        """Per-group block ids of a live request (0 = the null block)."""
        self._check_live(request_id)
        return self._coordinator.block_ids(request_id)

    def num_resident_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the pages a live request holds (null entries aside)."""
        self._check_live(request_id)
        return tuple([m.num_resident_blocks(request_id) for m in self._coordinator.managers])

    def table_lengths(self, request_id: str) -> tuple[int, ...]:
        """Per group, the length of a live request's block table (null entries included):
        it covers `length * block_size` token positions."""
        self._check_live(request_id)
        return tuple([len(m.table(request_id)) for m in self._coordinator.managers])

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; refuses (returns False) while any block is in use."""
        return self._pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain BlockStored / BlockRemoved / AllBlocksCleared events (if enabled)."""
        return self._pool.take_events()

    # ---- checks ------------------------------------------------------------------------------
    @staticmethod
    def _check_request(request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")

    def _check_admitted(self, request: Request) -> None:
        self._check_request(request)
        if self._requests.get(request.request_id) is not request:
            raise ValueError(f"unknown request {request.request_id!r} (never admitted, or "
                             "already freed)")

    @staticmethod
    def _check_counts(num_new_tokens: int, num_lookahead_tokens: int) -> tuple[int, int]:
        """The counts as ints (integer-likes are taken, as everywhere: `as_count`)."""
        n = as_count(num_new_tokens)
        if n is None or n <= 0:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        k = as_count(num_lookahead_tokens)
        if k is None or k < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}")
        return n, k

    @staticmethod
    def _check_progress(request: Request) -> int:
        """The request's computed count, stored back as an int."""
        n = as_count(request.num_computed_tokens)
        if n is None or not 0 <= n <= request.num_tokens:
            raise ValueError(f"request {request.request_id!r}: num_computed_tokens must be an int "
                             f"in [0, {request.num_tokens}], got {request.num_computed_tokens!r}")
        request.num_computed_tokens = n
        return n

    @staticmethod
    def _check_length(request: Request, num_computed: int, num_new_tokens: int) -> None:
        if num_computed + num_new_tokens > request.num_tokens:
            raise ValueError(
                f"request {request.request_id!r}: {num_computed} computed + {num_new_tokens} new "
                f"tokens exceeds its {request.num_tokens} tokens")

    def _check_pool_holds(self, request_id: str, num_resident: int, num_tokens: int) -> None:
        usable = self._pool.num_usable_blocks
        if num_resident > usable:
            raise RequestTooLargeError(
                f"request {request_id!r} needs {num_resident} blocks for {num_tokens} tokens but "
                f"the whole pool has {usable}", request_id=request_id,
                blocks_needed=num_resident, blocks_available=usable)

    def _check_live(self, request_id: str) -> None:
        if request_id not in self._requests:
            raise ValueError(f"unknown request {request_id!r}")

    def _no_hit(self, request: Request, lookup_id: int) -> ComputedBlocks:
        n = len(self._coordinator.managers)
        return ComputedBlocks(request.request_id, tuple([] for _ in range(n)), (None,) * n, 0, 0,
                              issuer=self, lookup_id=lookup_id)

    def _check_computed(self, request: Request, computed: ComputedBlocks) -> None:
        """ValueError unless `computed` is this manager's latest lookup of this request
        object and still current."""
        if not isinstance(computed, ComputedBlocks):
            raise TypeError(f"computed must be a get_computed_blocks result or None, got "
                            f"{type(computed).__name__}")
        if computed.issuer is not self:
            raise ValueError(f"computed blocks for {computed.request_id!r} were not looked up by "
                             "this manager (pass what its get_computed_blocks returned)")
        if computed.request_id != request.request_id:
            raise ValueError(f"computed blocks of {computed.request_id!r} passed for "
                             f"{request.request_id!r}")
        entry = self._lookups.get(request.request_id)
        if entry is None or entry[0] is not request:
            raise ValueError(f"computed blocks for {request.request_id!r} were looked up for "
                             "another request object under that id, or for one since admitted "
                             "or dropped: look this request up again")
        if entry[1] != computed.lookup_id:
            raise ValueError(f"computed blocks for {request.request_id!r} are not its latest "
                             "lookup: pass what the last get_computed_blocks returned")
        if computed.num_computed_tokens >= request.num_tokens:
            raise ValueError("a hit must leave at least one token to compute")
        if not self._coordinator.is_current(request, computed):
            raise ValueError(f"stale computed blocks for {request.request_id!r}: cached content "
                             "was evicted since the lookup; look it up again")
