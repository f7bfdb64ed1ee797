"""The tiers beside the cache layer: a connector that the scheduler asks how many tokens
beyond a request's device hit the tiers hold, tells what was allocated for them, and that
hears from the manager what requests let go of; and the transfers (offloads, loads) the
worker runs before a forward.

- Lookup (``TierConnector.lookup``): after the device hit of ``d`` blocks, each tier in
  order (host, then store) adds the longest run of consecutive blocks that load and verify
  in every group. The hit is kept (its host slots held) until the request is admitted or
  ``drop_lookup``.
- Admission: the manager admits the request with those tokens as external ones
  (``KVCacheManager.admit(..., num_external_tokens=)``): fresh device pages, counted as
  computed. ``TierConnector.admitted`` queues a ``PendingLoad`` per group for them. The
  worker writes the payloads into the pages before the step's forward; the pages are
  indexed in the device pool at the request's next step, like computed blocks.
- Offload: when a request is freed (finished or preempted), its full computed blocks that
  the tiers do not hold yet are queued as a ``PendingOffload`` (the manager's release
  listener, ``TierConnector.released``); the worker gathers them before anything else of
  the next step can overwrite the pages, into the host tier's slots (synchronous) and as
  values for the store (a background writer: the engine never waits for a store write).

Hybrid layouts: sliding-window groups load only their window before the hit's end (null
entries below) and offload the pages they hold at free, and the pages they drop
mid-request that lie in the window before a likely hit end (``window_offload``). A
recurrent group's unit is a checkpoint (keyed like the block its prefix ends with): a hit
ends only where every recurrent group has one in a tier, which is loaded into the
request's working state; a freed request's checkpoints are offloaded with its blocks. The
hit length is agreed as on the device (``agreed_hit``). A layout needs a full-attention
group (the verified chain): :class:`TierConnector` refuses window-only configs.

Imports no torch; the worker-side functions import it when called."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvstore.hashing import root_hash
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import BlockIds, KVCacheManager, ReleasedPages
from kvstore.request import Request, check_count
from kvstore.single_type_kv_cache_manager import (
    agreed_hit,
    longest_checkpoint_hit,
    longest_window_hit,
)
from kvstore.specs import AttentionSpec, FullAttentionSpec, KVCacheConfig
from kvstore.tiers.base import StoreItem, Tier, load_verified
from kvstore.tiers.codec import REJECT_REASONS, BlockLayout, Buffer, decode_block, request_keys
from kvstore.utils import check_seconds

if TYPE_CHECKING:
    from kvstore.paged_kv_cache import PagedKVCache
    from kvstore.tiers.seal import Sealer

__all__ = [
    "PendingLoad",
    "PendingOffload",
    "TierConnector",
    "TierHit",
    "TierHitStats",
    "TierTransfers",
]


@dataclass(frozen=True)
class PendingLoad:
    """Verified payloads to write into fresh device pages of one group, in order."""

    group_id: int
    block_ids: tuple[int, ...]
    payloads: tuple[memoryview, ...]


@dataclass(frozen=True)
class PendingOffload:
    """Full computed blocks of one group to gather and store in the tiers, with their keys
    and tokens; ``to_host`` / ``to_store`` say which tiers each block goes to."""

    group_id: int
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    token_ids: tuple[tuple[int, ...], ...]
    to_host: tuple[bool, ...]
    to_store: tuple[bool, ...]
    salt_root: int = 0  # the request's ``root_hash(cache_salt)``: whose key seals the values


@dataclass(frozen=True)
class TierHit:
    """Blocks ``[start, start + num_blocks)`` of a request found below the device:
    ``per_tier[i]`` of them from tier i, and per group their verified payloads."""

    start: int
    num_tokens: int  # the request's length when looked up
    per_tier: tuple[int, ...]
    payloads: tuple[tuple[memoryview, ...], ...]
    # Per group, the first block (counted from ``start``) it loads: 0 for full attention;
    # a sliding-window group loads only its window before the hit's end; a recurrent group
    # the checkpoint at the hit's end (stored under its last block).
    first_loaded: tuple[int, ...] = ()
    request_id: str = ""
    # The host tier's hold on the slots the payloads view (released once loaded or dropped).
    held: tuple[int, ...] = ()
    # The chain hash of the hit's last block: it names the whole prefix the hit extends,
    # tokens and salt, so a kept hit is reused only for that prefix.
    prefix_hash: int = 0

    @property
    def num_blocks(self) -> int:
        """Blocks the tiers add to the device hit."""
        return sum(self.per_tier)


@dataclass
class TierHitStats:
    """Counters of the tiers as the cache layer uses them."""

    lookups: int = 0  # lookups that asked the tiers (the device hit left blocks to find)
    host_hit_tokens: int = 0  # tokens admitted from the host tier
    store_hit_tokens: int = 0  # tokens admitted from the shared store
    loaded_blocks: int = 0  # blocks written into device pages by the worker (all groups)
    offloaded_blocks: int = 0  # blocks gathered from device pages and handed to the tiers
    rejected_values: int = 0  # values that failed verification (wrong size, tokens, checksum...)
    # Hits dropped because admitting them at once would take more pages than the pool has.
    oversized_hits: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter."""
        return dict(self.__dict__)


#: Which sliding-window pages dropped mid-request are offloaded as they are dropped:
#: ``ends``, those in the window before a likely hit end; ``all``; ``none`` (only the pages
#: held at free are offloaded).
WINDOW_OFFLOADS = ("ends", "all", "none")


# What a tier must offer (the `Tier` protocol's methods).
_TIER_METHODS = ("contains", "present", "load", "store", "flush", "close")


class TierConnector:
    """The tiers of one engine (``host`` then ``store``, either optional), with the block
    layout of each KV cache group and the bookkeeping of what was offloaded.
    ``window_offload`` (one of ``WINDOW_OFFLOADS``) picks the sliding-window pages dropped
    mid-request that are offloaded.

    It sits beside one ``KVCacheManager`` (``attach``) and is driven by the scheduler: per
    waiting request, ``lookup`` (tokens the tiers add to the device hit), then the manager's
    ``admit`` with that many external tokens, then ``admitted`` (queues the loads), or
    ``drop_lookup`` when the request leaves the queue unadmitted; ``take_transfers`` hands a
    step's loads and offloads to the worker. The manager reports what requests let go of
    (``released``): freed requests and dropped window pages are queued for offload.

    The store is not written again for a key it holds as far as the connector knows: one
    the store accepted (a store with an ``on_written`` hook reports that; for another, one
    handed to it) or loaded from it, among the last ``recent_keys``, for at most
    ``remember_s`` seconds (None: no limit). A key is forgotten when a read of it misses
    or fails verification, and every key when the store fails (its ``failure_count``
    changes): a restarted, flushed or evicting store gets the blocks written again.

    With a ``sealer``, every key is keyed with its secret and every store value is sealed
    for the request's tenant (see :mod:`kvstore.tiers.seal`); a value that does not open
    is a miss, counted ``bad_seal``."""

    def _spec(self, g: int) -> AttentionSpec:
        """The attention spec of attention group g."""
        spec = self.config.groups[g].spec
        assert isinstance(spec, AttentionSpec)
        return spec

    def __init__(self, config: KVCacheConfig, model_name: str, *, host: Tier | None = None,
                 store: Tier | None = None, extra: str = "",
                 recent_keys: int = 1 << 16, window_offload: str = "ends",
                 remember_s: float | None = 60.0, sealer: Sealer | None = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if remember_s is not None:
            remember_s = check_seconds(remember_s, "remember_s")
        recent_keys = check_count(recent_keys, "recent_keys")
        for name, tier in (("host", host), ("store", store)):
            missing = [m for m in _TIER_METHODS if not callable(getattr(tier, m, None))]
            if tier is not None and missing:
                raise TypeError(f"{name} must be a Tier (kvstore.tiers.base), got "
                                f"{type(tier).__name__} without {', '.join(missing)}")
        if window_offload not in WINDOW_OFFLOADS:
            raise ValueError(f"window_offload must be one of {WINDOW_OFFLOADS}, got {window_offload!r}")
        self.window_offload = window_offload
        full = tuple(g for g, group in enumerate(config.groups)
                     if isinstance(group.spec, FullAttentionSpec))
        if not full:
            # A hit is verified against the full-attention chain (every block from the
            # start); a window-only layout has no such chain in the tiers.
            raise ValueError(
                "tiers need at least one full-attention group; every group of this layout "
                f"is sliding-window (window {config.groups[0].spec.sliding_window}). Run "
                "this model without host_tier_bytes / store_url")
        if host is None and store is None:
            raise ValueError("a TierConnector needs a host tier, a store, or both")
        self.config = config
        self.block_size = config.block_size
        self.layouts = tuple(BlockLayout.for_group(model_name, config, g, extra)
                             for g in range(len(config.groups)))
        self.host = host
        self.store = store
        self.tiers: tuple[Tier, ...] = tuple(t for t in (host, store) if t is not None)
        self._full_groups = full
        self._recurrent_groups = tuple(g for g, group in enumerate(config.groups)
                                       if group.is_recurrent)
        self._window_groups = tuple(g for g in range(len(config.groups))
                                    if g not in full and g not in self._recurrent_groups)
        self.stats = TierHitStats()
        self.sealer = sealer
        self._key_secret = sealer.key_secret if sealer is not None else None
        # Keys the store holds as far as we know (accepted, or read from it), with when they
        # were remembered: not written again. Keys handed to the store and not yet reported.
        self._in_store: OrderedDict[bytes, float] = OrderedDict()
        self._store_pending: set[bytes] = set()
        self._store_lock = threading.Lock()  # the store's writer thread reports writes
        self._recent_keys = recent_keys
        self._remember_s = remember_s
        self._store_failures = getattr(store, "failure_count", 0)
        self._acked = store is not None and hasattr(store, "on_written")
        if self._acked:
            store.on_written = self._written  # type: ignore[union-attr]
        self._offloads: list[PendingOffload] = []
        self._host_pending: set[bytes] = set()  # keys queued for the host tier, not yet taken
        self._host_keys: list[bytes] = []  # host keys verified by the lookup under way
        self._manager: KVCacheManager | None = None
        self._holds_windows = False  # the manager holds window pages likely hits need
        self._hits: dict[str, TierHit] = {}  # by request id: looked up, not yet admitted
        self._loads: list[PendingLoad] = []
        self._holds: list[tuple[int, ...]] = []  # of the hits admitted since the last take
        # Per request, the sliding-window (group, table index) entries to offload when
        # dropped (window pages are not held).
        self._watch: dict[str, set[tuple[int, int]]] = {}

    @classmethod
    def create(cls, config: KVCacheConfig, model_name: str, *, host_tier_bytes: int | None = None,
               store_url: str | None = None, store_timeout_s: float = 0.5,
               extra: str = "", window_offload: str = "ends",
               store_key: bytes | os.PathLike[str] | None = None) -> TierConnector:
        """A connector with a ``HostTier`` of ``host_tier_bytes`` and a ``ValkeyStore`` at
        ``store_url`` (either may be None); ``store_key`` (the operator secret, or a key
        file's path) seals the store's values and keys its keys."""
        sealer = None
        if store_key is not None:
            if not store_url:
                raise ValueError("store_key seals store values: it needs a store_url")
            from kvstore.tiers.seal import Sealer

            sealer = Sealer(store_key)
        from kvstore.tiers.host import HostTier

        # One slot size per layout: checkpoints and attention blocks share the capacity,
        # each in a slot of about its own size.
        slots = [HostTier.slot_nbytes_for(BlockLayout.for_group(model_name, config, g, extra))
                 for g in range(len(config.groups))]
        host = HostTier(host_tier_bytes, slot_nbytes=slots) if host_tier_bytes else None
        store: Tier | None = None
        if store_url:
            from kvstore.tiers.valkey_store import ValkeyStore

            store = ValkeyStore(store_url, timeout_s=store_timeout_s)
        return cls(config, model_name, host=host, store=store, extra=extra,
                   window_offload=window_offload, sealer=sealer)

    def tier_name(self, i: int) -> str:
        """``host`` or ``store`` for tier i."""
        return "host" if self.tiers[i] is self.host else "store"

    # ---- beside the manager ------------------------------------------------------------------
    def attach(self, manager: KVCacheManager) -> None:
        """Serve ``manager``: hear what its requests let go of. ValueError for a manager of
        another KV cache config."""
        if manager.config is not self.config and manager.config != self.config:
            raise ValueError("the TierConnector was built for another KV cache config")
        if self._manager is not None and self._manager is not manager:
            self._manager.set_release_listener(None)
        self._manager = manager
        self._holds_windows = manager.cache_config.hold_window_pages
        manager.set_release_listener(self.released if manager.enable_caching else None)

    def _attached(self) -> KVCacheManager:
        if self._manager is None:
            raise ValueError("attach the TierConnector to a KVCacheManager first")
        return self._manager

    @property
    def hits(self) -> Mapping[str, TierHit]:
        """The hits looked up and neither admitted nor dropped, by request id (read-only)."""
        return MappingProxyType(self._hits)

    def watching(self, request_id: str) -> bool:
        """Whether dropped window pages of this live request are watched for offload."""
        return request_id in self._watch

    def lookup(self, request: Request, computed: ComputedBlocks) -> int:
        """Tokens beyond the device hit ``computed`` (the manager's ``get_computed_blocks``)
        that the tiers hold for ``request``: whole blocks after its full-block part, 0 for
        none. What it found is kept for ``admitted`` (a request looked up again at the same
        hit, length and prefix reuses it; one that reuses the id for another prompt is looked
        up afresh), until ``drop_lookup``."""
        manager = self._attached()
        if not isinstance(computed, ComputedBlocks):
            raise TypeError(f"computed must be the manager's get_computed_blocks result, got "
                            f"{type(computed).__name__}")
        rid = request.request_id
        previous = self._hits.pop(rid, None)
        bs = self.block_size
        start = computed.num_full_hit_tokens // bs
        if previous is not None and previous.start == start and \
                previous.num_tokens == request.num_tokens and previous.prefix_hash == \
                request.block_hashes[start + previous.num_blocks - 1]:
            hit: TierHit | None = previous  # an admission that did not fit: reuse the payloads
        else:
            if previous is not None:
                self.release(previous.held)
            if not manager.enable_caching:
                return 0
            hit = self.find(request, start, (request.num_tokens - 1) // bs)
        if hit is None:
            return 0
        self._hits[rid] = hit
        return hit.num_blocks * bs

    def admitted(self, request: Request, computed: ComputedBlocks | None,
                 num_external_tokens: int = 0) -> None:
        """``request`` was admitted on ``computed`` with ``num_external_tokens`` from its
        lookup (0: on the device hit alone): queue the loads into the pages allocated for
        them, and note which of its window pages to offload when they drop."""
        manager = self._attached()
        rid = request.request_id
        hit = self._hits.pop(rid, None)
        bs = self.block_size
        hit_end = computed.num_full_hit_tokens if computed is not None else 0
        if num_external_tokens:
            if hit is None or hit.num_blocks * bs != num_external_tokens:
                raise ValueError(f"request {rid!r} was admitted with {num_external_tokens} "
                                 "external tokens its lookup did not find")
            if hit.start * bs != hit_end:
                self._hits[rid] = hit
                raise ValueError(f"request {rid!r} was admitted on a device hit of {hit_end} "
                                 f"tokens, but its tier lookup followed one of "
                                 f"{hit.start * bs}: pass the lookup the admission used")
            tables = manager.block_table(rid)
            stop = hit.start + hit.num_blocks
            for g, table in enumerate(tables):
                if g in self._recurrent_groups:  # the checkpoint, into the working state
                    self._loads.append(PendingLoad(g, (table[0],), hit.payloads[g]))
                    continue
                first = hit.start + (hit.first_loaded[g] if hit.first_loaded else 0)
                self._loads.append(PendingLoad(g, tuple(table[first:stop]), hit.payloads[g]))
            hit_end = stop * bs
            self.record_admission(hit)
            if hit.held:
                self._holds.append(hit.held)
        elif hit is not None:
            self.release(hit.held)
        self._watch_window_ends(request, computed, hit_end)

    def drop_lookup(self, request: Request) -> bool:
        """Release what the request's lookup holds (host tier slots) when it leaves the
        waiting queue unadmitted; returns whether it held a hit."""
        hit = self._hits.pop(request.request_id, None)
        if hit is None:
            return False
        self.release(hit.held)
        return True

    def drop_oversized(self, request: Request) -> None:
        """Drop the request's hit: admitting it at once takes more pages than the whole pool
        (counted as ``oversized_hits``); the request is admitted on its device hit."""
        if self.drop_lookup(request):
            self.stats.oversized_hits += 1

    def released(self, record: ReleasedPages) -> None:
        """The manager's release listener: queue for offload a freed request's full computed
        blocks, and the window pages it dropped that ``window_offload`` wants."""
        request = record.request
        rid = request.request_id
        g = record.group_id
        # A page whose load has not run yet holds no content to offload (the request was
        # let go of between its admission and the step's transfers).
        loading = {b for load in self._loads if load.group_id == g for b in load.block_ids}
        if record.cause == "free":
            if g == 0:
                hit = self._hits.pop(rid, None)
                if hit is not None:
                    self.release(hit.held)
                self._watch.pop(rid, None)
            n = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
            self.queue_offload_blocks(request, g, [(i, b) for i, b in record.pages
                                                   if i < n and b not in loading])
            return
        mode = self.window_offload
        if mode == "none":
            return
        pages: Sequence[tuple[int, int]] = record.pages
        if self._holds_windows:
            # Held pages reach the tiers at free (or as a lone request lets go of them);
            # the manager tags those before likely hit ends.
            if mode == "ends":
                pages = [p for p, near in zip(pages, record.near_end, strict=True) if near]
        elif mode == "ends":
            watch = self._watch.get(rid, ())
            pages = [(i, b) for i, b in pages if (g, i) in watch]
        pages = [(i, b) for i, b in pages if b not in loading]
        if pages:
            self.queue_offload_blocks(request, g, pages)

    def _watch_window_ends(self, request: Request, computed: ComputedBlocks | None,
                           hit_end: int) -> None:
        """Note which sliding-window pages of an admitted request to offload when dropped
        (``window_offload="ends"``, window pages not held): those in the window before the
        prompt's end and, for a hit, before its end and the lookup's branch point."""
        if not self._window_groups or self.window_offload != "ends" or self._holds_windows:
            return
        bs = self.block_size
        p = request.num_prompt_tokens
        ends = {(p - 1) // bs, p // bs}
        if computed is not None:
            ends |= {hit_end // bs, computed.num_verified_tokens // bs}
        watch = {(g, i) for g in self._window_groups for e in ends if e > 0
                 for i in range(*self._spec(g).hit_end_range(e * bs))}
        if watch:
            self._watch[request.request_id] = watch

    def take_transfers(self) -> TierTransfers:
        """This step's offloads and loads, for the worker to run before the copies."""
        holds, self._holds = self._holds, []
        loads, self._loads = self._loads, []
        return TierTransfers(self, self.take_offloads(), loads, holds)

    # ---- lookup ------------------------------------------------------------------------------
    def find(self, request: Request, start: int, max_blocks: int) -> TierHit | None:
        """The run of blocks ``[start, ...)`` (at most up to ``max_blocks``) that the tiers
        hold and that verify in every group, or None for none. A sliding-window group needs
        only the blocks of its window before the run's end (the others stay null in its
        table, as a device hit leaves them); a recurrent group, a checkpoint of exactly the
        prefix the run ends. Bounded by the store's timeout; never raises for a tier that
        fails."""
        if start >= max_blocks:
            return None
        self._check_store()
        self.stats.lookups += 1
        self._host_keys = []
        bs = self.block_size
        hashes = request.block_hashes[start:max_blocks]
        tokens = [tuple(request.token_ids[i * bs:(i + 1) * bs]) for i in range(start, max_blocks)]
        keys = [request_keys(layout, hashes, request.cache_salt, self._key_secret)
                for layout in self.layouts]
        salt_root = root_hash(request.cache_salt)
        payloads: list[list[memoryview]] = [[] for _ in self.layouts]
        per_tier: list[int] = []
        full, windowed = self._full_groups, self._window_groups
        pos = 0
        # Full-attention groups: the longest run every one of them holds, tier after tier.
        for tier in self.tiers:
            n = tier.contains(keys[full[0]][pos:]) if pos < len(tokens) else 0
            got: dict[int, list[memoryview]] = {}
            for g in full:
                if n == 0:
                    break
                got[g] = self._load(tier, g, keys[g][pos:pos + n], tokens[pos:pos + n], salt_root)
                n = min(n, len(got[g]))
            for g in (got if n else ()):
                payloads[g].extend(got[g][:n])
            if tier is self.store:
                self._remember([k for g in full for k in keys[g][pos:pos + n]])
                self._forget([k for g in full for k in keys[g][pos + n:]])
            per_tier.append(n)
            pos += n
        # Sliding-window groups: the longest end <= pos whose window they all hold. A block
        # j missing from a window rules out every end above j (their windows hold j too).
        found: dict[int, dict[int, memoryview]] = {g: {} for g in windowed}

        def first_missing(end: int) -> int:
            missing = end
            for g in windowed:
                j = self._first_needed(g, start, end)
                while j < missing:
                    if j in found[g]:
                        j += 1
                        continue
                    stop = j
                    while stop < missing and stop not in found[g]:
                        stop += 1
                    best: list[memoryview] = []
                    for tier in self.tiers:
                        got_w = self._load(tier, g, keys[g][j:stop], tokens[j:stop], salt_root)
                        if tier is self.store:
                            self._remember(keys[g][j:j + len(got_w)])
                            self._forget(keys[g][j + len(got_w):stop])
                        if len(got_w) > len(best):
                            best = got_w
                        if len(best) == stop - j:
                            break
                    for i, payload in enumerate(best):
                        found[g][j + i] = payload
                    if len(best) < stop - j:
                        missing = j + len(best)
                        break
                    j = stop
            return missing

        # Recurrent groups: a checkpoint of exactly the hit's prefix, in some tier.
        checkpoints: dict[int, dict[int, memoryview | None]] = {
            g: {} for g in self._recurrent_groups}
        tiered: dict[int, list[list[bool]]] = {}  # per group and tier: which checkpoints it holds

        def checkpoint(g: int, n: int) -> memoryview | None:
            """Group g's checkpoint of the first ``start + n`` blocks, or None."""
            if n not in checkpoints[g]:
                checkpoints[g][n] = None
                if g not in tiered:
                    tiered[g] = [tier.present(keys[g][:pos]) for tier in self.tiers]
                for tier, held in zip(self.tiers, tiered[g], strict=True):
                    if not held[n - 1]:
                        continue
                    got = self._load(tier, g, keys[g][n - 1:n], tokens[n - 1:n], salt_root)
                    if tier is self.store:
                        (self._remember if got else self._forget)(keys[g][n - 1:n])
                    if got:
                        checkpoints[g][n] = got[0]
                        break
            return checkpoints[g][n]

        searches = []
        if windowed:
            searches.append(lambda cap: longest_window_hit(cap, first_missing))
        if self._recurrent_groups:
            searches.append(lambda cap: longest_checkpoint_hit(
                cap, lambda n: all(checkpoint(g, n) is not None for g in self._recurrent_groups)))
        end = agreed_hit(pos, searches)
        host_keys, self._host_keys = self._host_keys, []
        if end == 0:
            return None
        hold = getattr(self.host, "hold", None)
        held = hold(host_keys) if hold is not None and host_keys else ()
        # The tiers' shares of the run, cut at its end.
        cut, left = [], end
        for n in per_tier:
            cut.append(min(n, left))
            left -= cut[-1]
        per_tier = cut
        first = [0] * len(self.layouts)
        for g in windowed:
            first[g] = self._first_needed(g, start, end)
            payloads[g] = [found[g][j] for j in range(first[g], end)]
        for g in full:
            payloads[g] = payloads[g][:end]
        for g in self._recurrent_groups:
            state = checkpoints[g][end]
            assert state is not None
            first[g], payloads[g] = end - 1, [state]
        return TierHit(start, request.num_tokens, tuple(per_tier),
                       tuple(tuple(p) for p in payloads), tuple(first), request.request_id, held,
                       request.block_hashes[start + end - 1])

    def _first_needed(self, g: int, start: int, end: int) -> int:
        """The first block (counted from ``start``) group g needs for a hit of ``start + end``
        blocks: 0 for full attention, the window's first block for a sliding window."""
        first = self._spec(g).first_needed_block((start + end) * self.block_size)
        return min(end, max(0, first - start))

    def _load(self, tier: Tier, g: int, keys: Sequence[bytes], tokens: Sequence[tuple[int, ...]],
              salt_root: int = 0) -> list[memoryview]:
        """The leading run of group g's blocks under ``keys`` that ``tier`` holds and verify
        (store values opened first when sealed)."""
        if not keys:
            return []
        before = _rejections(tier)
        decode = self.decode_value
        checksums = True
        if getattr(tier, "in_process", False) and type(self).decode_value is TierConnector.decode_value:
            decode, checksums = _decode_in_process, False  # values that never left this process
        sealer = self.sealer
        if sealer is not None and tier is self.store:
            def decode(layout: BlockLayout, key: bytes, token_ids: Sequence[int],
                       value: Buffer | None, counters: dict[str, int] | None) -> memoryview | None:
                opened = sealer.open(salt_root, key, value)
                if opened is None and value is not None:
                    if counters is not None:
                        counters["bad_seal"] = counters.get("bad_seal", 0) + 1
                    return None
                return self.decode_value(layout, key, token_ids, opened, counters)

        verified = load_verified(tier, self.layouts[g], keys, tokens, decode, hashes=checksums)
        self.stats.rejected_values += _rejections(tier) - before
        if tier is self.host and verified:
            self._host_keys.extend(keys[:len(verified)])
        return verified

    def release(self, held: Sequence[int]) -> None:
        """Undo the host tier's hold of a hit's slots (once loaded, or dropped)."""
        release = getattr(self.host, "release", None)
        if held and release is not None:
            release(held)

    def decode_value(self, layout: BlockLayout, key: bytes, token_ids: Sequence[int],
                     value: Buffer | None, counters: dict[str, int] | None) -> memoryview | None:
        """One value's verified payload, or None with the reason counted (``decode_block``)."""
        return decode_block(layout, key, token_ids, value, counters)

    def record_admission(self, hit: TierHit) -> None:
        """Count a hit's tokens per tier once its request is admitted on it."""
        for i, n in enumerate(hit.per_tier):
            if self.tier_name(i) == "host":
                self.stats.host_hit_tokens += n * self.block_size
            else:
                self.stats.store_hit_tokens += n * self.block_size

    # ---- offload -----------------------------------------------------------------------------
    def queue_offload(self, request: Request, tables: BlockIds, num_full_blocks: int) -> None:
        """Queue the first ``num_full_blocks`` blocks of a request's tables (computed, full)
        that some tier does not hold yet. Call before the pages are released."""
        n = min(num_full_blocks, len(request.block_hashes))
        for g in range(len(self.layouts)):
            self.queue_offload_blocks(request, g, [(i, b) for i, b in enumerate(tables[g][:n])])

    def queue_offload_blocks(self, request: Request, group_id: int,
                             blocks: Sequence[tuple[int, int]]) -> None:
        """Queue blocks of one group, as (block index in the request, page id) pairs of full
        computed blocks, that some tier does not hold yet (null pages are skipped). Call
        before the pages can be overwritten."""
        bs = self.block_size
        # A store that just failed would drop the writes: skip it (and remember nothing).
        store_up = self.store is not None and bool(getattr(self.store, "available", True))
        if store_up:
            self._check_store()
        blocks = [(i, b) for i, b in blocks if b != 0]
        hashes = request.block_hashes
        keys = request_keys(self.layouts[group_id], [hashes[i] for i, _ in blocks], request.cache_salt,
                            self._key_secret)
        rows = []
        for (i, block_id), key in zip(blocks, keys, strict=True):
            to_host = (self.host is not None and key not in self._host_pending
                       and self.host.contains([key]) == 0)
            if to_host:
                self._host_pending.add(key)
            to_store = store_up and self._wanted_in_store(key)
            if to_host or to_store:
                rows.append((block_id, key, tuple(request.token_ids[i * bs:(i + 1) * bs]),
                             to_host, to_store))
        if (to_store_keys := [r[1] for r in rows if r[4]]) and not self._acked:
            self._remember(to_store_keys)
        if rows:
            ids, ks, toks, th, ts = zip(*rows, strict=True)
            self._offloads.append(PendingOffload(group_id, ids, ks, toks, th, ts,
                                                 root_hash(request.cache_salt)))

    def take_offloads(self) -> list[PendingOffload]:
        """The queued offloads (the worker must run them before pages are overwritten)."""
        out, self._offloads = self._offloads, []
        self._host_pending.clear()
        return out

    def _wanted_in_store(self, key: bytes) -> bool:
        """Whether to write ``key`` to the store: not known to be there nor on its way (it
        is then marked on its way, when the store reports its writes)."""
        with self._store_lock:
            if key in self._store_pending:
                return False
            when = self._in_store.get(key)
            if when is not None and (self._remember_s is None
                                     or time.monotonic() - when < self._remember_s):
                return False
            if self._acked:
                self._store_pending.add(key)
            return True

    def _remember(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        now = time.monotonic()
        with self._store_lock:
            seen = self._in_store
            for k in keys:
                seen[k] = now
                seen.move_to_end(k)
            while len(seen) > self._recent_keys:
                seen.popitem(last=False)

    def _forget(self, keys: Sequence[bytes]) -> None:
        if keys:
            with self._store_lock:
                for k in keys:
                    self._in_store.pop(k, None)

    def _written(self, accepted: Sequence[bytes], failed: Sequence[bytes]) -> None:
        """The store's report of a write: what it accepted is remembered."""
        with self._store_lock:
            self._store_pending.difference_update(accepted)
            self._store_pending.difference_update(failed)
        self._remember(accepted)

    def _check_store(self) -> None:
        """Forget every key when the store failed since the last look (it may have restarted
        empty)."""
        failures = getattr(self.store, "failure_count", 0)
        if failures != self._store_failures:
            self._store_failures = failures
            with self._store_lock:
                self._in_store.clear()

    # ---- worker side -------------------------------------------------------------------------
    def offload_values(self, cache: PagedKVCache | None, off: PendingOffload) -> list[StoreItem]:
        """The (key, value) items of one offload: its pages gathered and encoded."""
        from kvstore.tiers.host import offload_items

        if cache is None:
            raise ValueError("this connector moves payloads: it needs the device cache")
        return offload_items(cache, self.layouts[off.group_id], off.group_id,
                             off.block_ids, off.keys, off.token_ids)

    def run_offloads(self, cache: PagedKVCache | None, offloads: Sequence[PendingOffload]) -> None:
        """Hand the blocks to the host tier (a ``HostTier`` gathers them straight into its
        slots) and the store (encoded values; copies of the host tier's where it has them)."""
        from kvstore.tiers.host import HostTier

        host, store = self.host, self.store
        for off in offloads:
            n = len(off.block_ids)
            to_host = [i for i in range(n) if off.to_host[i]] if host is not None else []
            to_store = [i for i in range(n) if off.to_store[i]] if store is not None else []
            self.stats.offloaded_blocks += len(set(to_host) | set(to_store))
            direct = isinstance(host, HostTier) and cache is not None
            if to_host and direct:
                assert isinstance(host, HostTier) and cache is not None
                host.store_blocks(cache, self.layouts[off.group_id], off.group_id,
                                  [off.block_ids[i] for i in to_host], [off.keys[i] for i in to_host],
                                  [off.token_ids[i] for i in to_host], checksum=False)
            values: dict[int, Buffer] = {}
            if direct and to_store:
                assert isinstance(host, HostTier)
                copies = host.peek([off.keys[i] for i in to_store])
                values.update((i, v) for i, v in zip(to_store, copies, strict=True) if v is not None)
            need = sorted((set() if direct else set(to_host)) | (set(to_store) - set(values)))
            if need:
                items = self.offload_values(cache, _subset(off, need))
                values.update((i, v) for i, (_, v) in zip(need, items, strict=True))
            if to_host and not direct:
                assert host is not None
                host.store([(off.keys[i], values[i]) for i in to_host])
            if to_store:
                assert store is not None
                sealer = self.sealer
                if sealer is not None:
                    store.store([(off.keys[i], sealer.seal(off.salt_root, off.keys[i], values[i]))
                                 for i in to_store])
                else:
                    store.store([(off.keys[i], values[i]) for i in to_store])

    def run_loads(self, cache: PagedKVCache | None, loads: Sequence[PendingLoad]) -> None:
        """Write verified payloads into their device pages (queued on the current stream on
        CUDA, so a forward queued after sees them)."""
        from kvstore.tiers.host import restore_payloads

        if loads and cache is None:
            raise ValueError("this connector moves payloads: it needs the device cache")
        for load in loads:
            if load.block_ids:
                assert cache is not None
                restore_payloads(cache, load.group_id, load.block_ids, load.payloads)
                self.stats.loaded_blocks += len(load.block_ids)

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Each tier's own counters (``TierStats.snapshot``), by ``host`` / ``store``."""
        return {self.tier_name(i): t.stats.snapshot() for i, t in enumerate(self.tiers)}

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until stores queued so far are written or dropped; False on timeout."""
        return all(t.flush(timeout) for t in self.tiers)

    def close(self) -> None:
        """Stop background writers and release connections."""
        for t in self.tiers:
            t.close()


def _subset(off: PendingOffload, rows: Sequence[int]) -> PendingOffload:
    """The offload of rows ``rows`` of ``off`` only."""
    return PendingOffload(off.group_id, tuple(off.block_ids[i] for i in rows),
                          tuple(off.keys[i] for i in rows), tuple(off.token_ids[i] for i in rows),
                          tuple(off.to_host[i] for i in rows), tuple(off.to_store[i] for i in rows),
                          off.salt_root)


def _decode_in_process(layout: BlockLayout, key: bytes, token_ids: Sequence[int],
                       value: Buffer | None, counters: dict[str, int] | None) -> memoryview | None:
    """``decode_block`` for a tier whose values never left this process (no checksum)."""
    return decode_block(layout, key, token_ids, value, counters, trusted=True)


def _rejections(tier: Tier) -> int:
    stats = tier.stats
    return sum(stats[r] for r in REJECT_REASONS) + stats["bad_seal"]


@dataclass
class TierTransfers:
    """One step's tier work for the worker: offloads first (their pages may be reused by
    this step), then loads; run before the step's copies and forward."""

    connector: TierConnector
    offloads: list[PendingOffload] = field(default_factory=list)
    loads: list[PendingLoad] = field(default_factory=list)
    # The host tier's holds on the slots the loads read, released once they ran.
    holds: list[tuple[int, ...]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads or self.holds)

    def run(self, cache: PagedKVCache | None) -> None:
        """Run the offloads, then the loads, on ``cache`` (None for a payload-free
        connector), then release the loads' holds."""
        if self.offloads:
            self.connector.run_offloads(cache, self.offloads)
        if self.loads:
            self.connector.run_loads(cache, self.loads)
        for held in self.holds:
            self.connector.release(held)
        self.holds = []
