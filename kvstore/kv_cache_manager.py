"""The scheduler-facing API of the cache layer."""

from __future__ import annotations

from dataclasses import replace

from kvstore import hashing
from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool, CacheStats, KVCacheEvent
from kvstore.kv_cache_coordinator import ComputedBlocks, KVCacheCoordinator
from kvstore.request import Request
from kvstore.specs import KVCacheConfig


class KVCacheManager:
    """Block bookkeeping for a scheduler: prefix hits, allocation, frees, forks, copies.

    Per step, the scheduler calls `get_computed_blocks` then `allocate_slots` for a new
    request (or `allocate_slots` alone for a running one), hands `take_pending_copies()`
    to the worker, which runs those copies before the forward pass, and after the step
    advances `request.num_computed_tokens`. Pins that keep copy sources and destinations
    alive are released by the next `take_pending_copies()` call, so the worker must have run a
    batch of copies before it asks for the next one.
    """

    def __init__(self, config: KVCacheConfig, enable_caching: bool = True,
                 enable_partial_hits: bool = True, enable_events: bool = False) -> None:
        self.config = config
        self.block_size = config.block_size
        self.enable_caching = enable_caching
        self.enable_partial_hits = enable_caching and enable_partial_hits
        self.pool = BlockPool(config.num_blocks, enable_caching, enable_events,
                              index_partial_blocks=self.enable_partial_hits)
        self.coordinator = KVCacheCoordinator(config, self.pool)
        self.requests: dict[str, Request] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Sources and destinations of copies not yet handed out, and of the last batch.
        self._pins: list[KVCacheBlock] = []
        self._pins_handed_out: list[KVCacheBlock] = []

    @property
    def stats(self) -> CacheStats:
        """Counters: lookups, hit tokens, partial hits, copies, evictions."""
        return self.pool.stats

    @property
    def usage(self) -> float:
        """Fraction of the pool's usable blocks in use."""
        return self.pool.usage

    def group_usage(self) -> list[float]:
        """Per group, the fraction of the pool's usable blocks it holds."""
        n = self.pool.num_usable_blocks
        return [self.pool.in_use_by_group[g] / n for g in range(len(self.config.groups))]

    # ---- lookups -----------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The request's longest cached prefix in every group; changes nothing.

        Pass the result to `allocate_slots`; if cached content it names is evicted in
        between, `allocate_slots` rejects it as stale."""
        self._check_request(request)
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already admitted")
        request.update_block_hashes(self.block_size, hashing.hash_block)
        if not self.enable_caching:
            return self._no_hit(request)
        # At least one token is computed so the model yields logits.
        return self.coordinator.find_longest_hit(request, request.num_tokens - 1,
                                                 self.enable_partial_hits)

    # ---- allocation --------------------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> list[list[KVCacheBlock]] | None:
        """Pages for `num_new_tokens` more tokens (plus lookahead), per group.

        For a new request pass its `get_computed_blocks` result (or None for no hit): on
        success its `num_computed_tokens` becomes the hit length (the full-block part alone
        when the partial block's copy is what would not fit; the new tokens then start there).
        Returns the blocks appended to each group's table (pages that replace shared ones,
        and copy destinations at admission, are in `block_table` only), or None when the
        pool cannot hold them; then nothing has changed."""
        self._check_request(request)
        rid = request.request_id
        if not isinstance(num_new_tokens, int) or num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be a positive int, got {num_new_tokens!r}")
        if not isinstance(num_lookahead_tokens, int) or num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}")
        admitting = rid not in self.requests
        request.update_block_hashes(self.block_size, hashing.hash_block)
        if admitting:
            if computed is None:
                computed = self._no_hit(request)
            self._check_computed(request, computed)
            num_computed = computed.num_computed_tokens
        else:
            if self.requests[rid] is not request:
                raise ValueError(f"duplicate request id {rid!r}: another request is live under it")
            if computed is not None:
                raise ValueError(f"request {rid!r} is already admitted; computed blocks are only "
                                 "for admission")
            num_computed = request.num_computed_tokens
        if num_computed + num_new_tokens > request.num_tokens:
            raise ValueError(
                f"request {rid!r}: {num_computed} computed + {num_new_tokens} new tokens exceeds "
                f"its {request.num_tokens} tokens")
        num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if not admitting and all(m.is_noop(request, num_tokens) for m in self.coordinator.managers):
            # Most decode steps: the pages exist, nothing to cache, drop or copy.
            return [[] for _ in self.coordinator.managers]
        need, released, resident = self.coordinator.num_blocks_needed(
            request, num_computed, num_tokens, computed if admitting else None)
        if resident > self.pool.num_usable_blocks:
            raise ValueError(
                f"request {rid!r} needs {resident} blocks for {num_tokens} tokens but the whole "
                f"pool has {self.pool.num_usable_blocks}")
        if need > self.pool.num_free_blocks + released:
            if not (admitting and computed is not None and computed.num_partial_tokens):
                return None
            # A partial hit costs a pinned source page on top of the request's own pages;
            # when only that makes it not fit, admit on the full-block hit alone (the
            # request then computes the partial block's tokens itself).
            computed = replace(computed, partial_sources=(None,) * len(computed.partial_sources),
                               num_partial_tokens=0)
            num_computed = computed.num_computed_tokens
            num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
            need, released, resident = self.coordinator.num_blocks_needed(
                request, num_computed, num_tokens, computed)
            if need > self.pool.num_free_blocks + released:
                return None
        copies_before = len(self._pending_copies)
        if admitting:
            assert computed is not None
            request.num_computed_tokens = num_computed
            self.coordinator.admit(request, computed, self._pending_copies, self._pins)
            self.requests[rid] = request
            stats = self.stats
            stats.lookups += 1
            stats.queried_tokens += request.num_tokens
            stats.hit_tokens += num_computed
            if computed.num_partial_tokens:
                stats.partial_hits += 1
                stats.partial_hit_tokens += computed.num_partial_tokens
        new_blocks, n_cow = self.coordinator.allocate(request, num_tokens, self._pending_copies,
                                                      self._pins)
        self.stats.fork_copies += n_cow
        self.stats.copies_queued += len(self._pending_copies) - copies_before
        return new_blocks

    def free(self, request: Request) -> None:
        """Release a finished or preempted request; its computed content stays cached."""
        self._check_request(request)
        if self.requests.get(request.request_id) is not request:
            raise ValueError(f"unknown request {request.request_id!r} (never admitted, or "
                             "already freed)")
        request.update_block_hashes(self.block_size, hashing.hash_block)
        self.coordinator.free(request)
        del self.requests[request.request_id]

    def fork(self, parent: Request, child: Request) -> None:
        """Admit `child` sharing every page of `parent` (parallel sampling)."""
        self._check_request(parent)
        self._check_request(child)
        if self.requests.get(parent.request_id) is not parent:
            raise ValueError(f"unknown parent request {parent.request_id!r}")
        if child.request_id in self.requests:
            raise ValueError(f"duplicate request id {child.request_id!r}")
        if (child.token_ids != parent.token_ids
                or child.num_computed_tokens != parent.num_computed_tokens
                or child.cache_salt != parent.cache_salt):
            raise ValueError("a forked child must have its parent's tokens, progress and salt "
                             "(use Request.fork)")
        child.block_hashes = list(parent.block_hashes)
        self.coordinator.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the worker must run, for every layer, before the next
        forward; releases the pins of the previous batch."""
        for block in self._pins_handed_out:
            block.pin_cnt -= 1
        self.pool.free_blocks(self._pins_handed_out)
        self._pins_handed_out, self._pins = self._pins, []
        pending, self._pending_copies = self._pending_copies, []
        copies = []
        # A copy out of a block that an earlier copy of this batch fills reads that
        # copy's source instead, so the batch can run as one gather and one scatter.
        src_of: dict[int, int] = {}
        for src, dst in pending:
            src = src_of.get(src, src)
            src_of[dst] = src
            copies.append((src, dst))
        return copies

    @property
    def pinned_blocks(self) -> list[KVCacheBlock]:
        """Copy sources and destinations currently held by pins (one entry per pin)."""
        return self._pins + self._pins_handed_out

    # ---- views -------------------------------------------------------------------------------
    def block_table(self, request_id: str) -> tuple[list[int], ...]:
        """Per-group block ids of a live request (0 = the null block)."""
        if request_id not in self.requests:
            raise ValueError(f"unknown request {request_id!r}")
        return self.coordinator.block_ids(request_id)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content; refuses (returns False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain BlockStored / BlockRemoved / AllBlocksCleared events (if enabled)."""
        return self.pool.take_events()

    # ---- checks ------------------------------------------------------------------------------
    @staticmethod
    def _check_request(request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")

    def _no_hit(self, request: Request) -> ComputedBlocks:
        n = len(self.coordinator.managers)
        return ComputedBlocks(request.request_id, tuple([] for _ in range(n)), (None,) * n, 0, 0)

    def _check_computed(self, request: Request, computed: ComputedBlocks) -> None:
        if computed.request_id != request.request_id:
            raise ValueError(f"computed blocks of {computed.request_id!r} passed for "
                             f"{request.request_id!r}")
        if computed.num_computed_tokens >= request.num_tokens:
            raise ValueError("a hit must leave at least one token to compute")
        if not self.coordinator.is_current(request, computed):
            raise ValueError(f"stale computed blocks for {request.request_id!r}: cached content "
                             "was evicted since the lookup; look it up again")
