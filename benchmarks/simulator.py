"""Replays a workload through the real scheduler and KVCacheManager with a cost-free executor."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.benchmarks.manager import new_manager
from kvstore.benchmarks.workloads import RequestSpec, Workload
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.request import Request
from kvstore.specs import KVCacheConfig, LayerSpec, RecurrentStateSpec
from kvstore.utils import hit_rate

if TYPE_CHECKING:
    from kvstore.benchmarks.tier_model import PlaceholderConnector
    from kvstore.tiers.base import Tier


@dataclass(frozen=True)
class TierOptions:
    """Tiers below the device pool for a replay: a host tier of ``host_bytes`` and a shared
    store (``mem``: in-process and unbounded, ``mem:SIZE``: bounded, or a ``valkey://`` URL).
    Values are placeholders (:mod:`kvstore.benchmarks.tier_model`): capacities are charged the real
    value sizes, and lookups and offloads follow the engine's connector."""

    host_bytes: int | None = None
    store: str | None = None
    window_offload: str = "ends"  # kvstore.tiers.connector.WINDOW_OFFLOADS

    def __bool__(self) -> bool:
        return bool(self.host_bytes or self.store)

    def describe(self) -> str:
        """One line: the host tier's size and the store."""
        from kvstore.benchmarks.sweep import format_bytes

        parts = []
        if self.host_bytes:
            parts.append(f"host tier {format_bytes(self.host_bytes)}")
        if self.store:
            from kvstore.tiers.valkey_store import redact_url

            parts.append(f"store {redact_url(self.store)}")
        if self.window_offload != "ends":
            parts.append(f"window offload {self.window_offload}")
        return ", ".join(parts)


def parse_mem_store(text: str) -> int | None | bool:
    """For ``mem`` (unbounded): None; ``mem:SIZE``: its bytes; anything else: False."""
    from kvstore.benchmarks.sweep import parse_size

    if text == "mem":
        return None
    if text.startswith("mem:"):
        size = parse_size(text[4:])
        if size <= 0:
            raise ValueError(f"store size must be positive, got {text[4:]!r}")
        return size
    return False


def open_store(spec: str, timeout_s: float = 2.0) -> Tier:
    """The store a replay writes to: a ``ModelTier`` for ``mem[:SIZE]``, else a synchronous
    ``ValkeyStore`` on the URL (ValueError for a bad one)."""
    from kvstore.benchmarks.tier_model import ModelTier

    mem = parse_mem_store(spec)
    if mem is not False:
        assert not isinstance(mem, bool)
        return ModelTier(mem, name="store")
    from kvstore.tiers.valkey_store import ValkeyStore

    return ValkeyStore(spec, sync_stores=True, timeout_s=timeout_s)


def _tier_connector(config: KVCacheConfig, tiers: TierOptions) -> PlaceholderConnector:
    from kvstore.benchmarks.tier_model import ModelTier, PlaceholderConnector

    host = ModelTier(tiers.host_bytes, name="host") if tiers.host_bytes else None
    store = open_store(tiers.store) if tiers.store else None
    # A name of its own: replays sharing a server never see each other's keys.
    return PlaceholderConnector(config, f"kvstore-bench-{uuid.uuid4().hex}", host=host, store=store,
                                window_offload=tiers.window_offload)


def _close_tiers(connector: PlaceholderConnector) -> None:
    """Delete what the replay wrote to a server, then close."""
    store = connector.store
    delete = getattr(store, "delete", None)
    if delete is not None:
        keys = connector.stored_keys
        for s in range(0, len(keys), 1024):
            delete(keys[s:s + 1024])
    connector.close()


@dataclass(frozen=True)
class StepTime:
    """A step-time model: a step that computes ``n`` tokens takes ``a + b * n`` seconds.

    The default (5 ms + 40 us per token) is an 8B model on one H100-class GPU: the weights
    read once per step, about 16 GFLOP per token at about 400 TFLOP/s."""

    a: float = 0.005
    b: float = 40e-6

    def describe(self) -> str:
        """``5 ms + 40 us/token``."""
        return f"{self.a * 1e3:g} ms + {self.b * 1e6:g} us/token"


DEFAULT_STEP_TIME = StepTime()


@dataclass
class SimResult:
    """Figures of one replay.

    Token identity (holds for every replay): ``computed_tokens + hit_tokens ==
    expected_tokens + discarded_tokens``, where ``expected_tokens`` is the sum over
    requests of ``prompt + max_tokens - 1`` (the last sampled token is never fed back).
    """

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    queried_tokens: int  # tokens looked up, over every admission (re-admissions included)
    hit_tokens: int
    partial_hit_tokens: int
    partial_hits: int
    computed_tokens: int
    recomputed_tokens: int
    discarded_tokens: int  # computed tokens thrown away by preemptions
    preemptions: int
    evictions: int
    steps: int
    peak_blocks: int
    copies: int
    # Slot-tokens allocated to running requests but holding no token yet, summed over
    # steps and groups (naive reservation's waste; one slot-token = one position of
    # one block id).
    idle_slot_steps: int
    # Mean of (blocks in use / usable blocks) over steps.
    mean_usage: float
    running_steps: int = 0  # requests running after each step was scheduled, summed over steps
    # Hit tokens at each request's first admission (what an infinite cache bounds).
    prompt_hit_tokens: int = 0
    # Sum over requests of prompt + max_tokens - 1: the work with no cache and no preemption.
    expected_tokens: int = 0
    num_blocks: int = 0  # blocks in the pool, the null block included
    bytes_per_block: int = 0  # bytes one block id costs over all layer slots
    block_size: int = 0  # tokens per block
    peak_idle_slots: int = 0  # most idle slot-tokens in any one step
    finish_time: float = 0.0  # virtual clock when the last request finished (s)
    free_blocks_at_end: int = 0
    # Tiers below the device (0 without them). Over all admissions: tokens admitted from
    # the host tier and the store (``hit_tokens`` stays the device's); at first admission:
    # the same split of ``prompt_hit_tokens``. Blocks offloaded to and loaded from them.
    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    prompt_host_hit_tokens: int = 0
    prompt_store_hit_tokens: int = 0
    tier_offloaded_blocks: int = 0
    tier_loaded_blocks: int = 0
    tier_rejected_values: int = 0
    # Per KV cache group: its kind ("full" or "window W"), its cached pages (mean over steps)
    # and its evictions: what each group kept and what it lost.
    group_kinds: list[str] = field(default_factory=list)
    cached_by_group: list[float] = field(default_factory=list)
    evicted_by_group: list[int] = field(default_factory=list)
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Tokens served from the cache over tokens looked up, over all admissions."""
        return hit_rate(self.hit_tokens, self.queried_tokens)

    @property
    def total_hit_rate(self) -> float:
        """Device, host and store hit tokens over tokens looked up, over all admissions."""
        return hit_rate(self.hit_tokens + self.host_hit_tokens + self.store_hit_tokens,
                        self.queried_tokens)

    @property
    def prompt_device_hit_tokens(self) -> int:
        """First-admission hit tokens found in the device pool."""
        return self.prompt_hit_tokens - self.prompt_host_hit_tokens - self.prompt_store_hit_tokens

    @property
    def prompt_hit_rate(self) -> float:
        """First-admission hit tokens over prompt tokens (comparable to `ideal_hit_tokens`)."""
        return hit_rate(self.prompt_hit_tokens, self.prompt_tokens)

    @property
    def mean_running(self) -> float:
        """Requests running per step, on average (the batch's concurrency)."""
        return self.running_steps / self.steps if self.steps else 0.0

    @property
    def saved_tokens(self) -> int:
        """Work the cache saved: expected minus computed tokens (negative: recompute cost more)."""
        return self.expected_tokens - self.computed_tokens

    def model_time(self, step: StepTime) -> float:
        """Seconds the replay's steps take under `step` (each step costs
        ``a + b * tokens computed in it``)."""
        return step.a * self.steps + step.b * self.computed_tokens

    @property
    def usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return max(0, self.num_blocks - 1)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the whole pool by the page-size formula (the null block included)."""
        return self.num_blocks * self.bytes_per_block

    @property
    def peak_kv_bytes(self) -> int:
        """Bytes of the most blocks in use at once."""
        return self.peak_blocks * self.bytes_per_block

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot-token (one position of one block id, all layer slots)."""
        return self.bytes_per_block // self.block_size if self.block_size else 0

    @property
    def mean_idle_slots(self) -> float:
        """Idle reserved slot-tokens per step, on average."""
        return self.idle_slot_steps / self.steps if self.steps else 0.0

    @property
    def mean_idle_bytes(self) -> float:
        """Reserved-but-idle KV bytes per step, on average."""
        return self.mean_idle_slots * self.bytes_per_slot

    @property
    def peak_idle_bytes(self) -> int:
        """Most reserved-but-idle KV bytes in any one step."""
        return self.peak_idle_slots * self.bytes_per_slot

    @property
    def mean_idle_fraction(self) -> float:
        """Idle reserved slot-tokens over the pool's slot-tokens, averaged over steps."""
        total = self.usable_blocks * self.block_size
        return self.mean_idle_slots / total if total else 0.0

    @property
    def leaked_blocks(self) -> int:
        """Blocks still in use after every request finished (0 unless something leaks)."""
        return self.usable_blocks - self.free_blocks_at_end

    def kept_and_evicted(self, kind: str) -> tuple[float, int]:
        """Cached pages (mean over steps) and evictions summed over the groups whose kind
        starts with `kind` ("full" or "window")."""
        groups = [g for g, k in enumerate(self.group_kinds) if k.startswith(kind)]
        return (sum(self.cached_by_group[g] for g in groups),
                sum(self.evicted_by_group[g] for g in groups))

    def summary(self) -> dict[str, Any]:
        """Every counter and derived figure, flat (no per-group lists, no timeline)."""
        out = {k: v for k, v in asdict(self).items()
               if k not in ("timeline", "group_kinds", "cached_by_group", "evicted_by_group")}
        for kind in ("full", "window"):
            out[f"{kind}_cached_pages"], out[f"{kind}_evictions"] = self.kept_and_evicted(kind)
        for name in ("hit_rate", "total_hit_rate", "prompt_device_hit_tokens",
                     "prompt_hit_rate", "mean_running", "saved_tokens", "usable_blocks",
                     "kv_bytes", "peak_kv_bytes", "mean_idle_slots", "mean_idle_bytes",
                     "peak_idle_bytes", "mean_idle_fraction", "leaked_blocks"):
            out[name] = getattr(self, name)
        return out


def group_kind(spec: LayerSpec) -> str:
    """"full", "window W" for a sliding-window group, or "recurrent"."""
    if isinstance(spec, RecurrentStateSpec):
        return "recurrent"
    return "full" if spec.sliding_window is None else f"window {spec.sliding_window}"


def fake_token(request_id: str, position: int, vocab_size: int = 32000) -> int:
    """A deterministic stand-in for a sampled token."""
    return xxhash.xxh64_intdigest(f"{request_id}:{position}".encode()) % vocab_size


def idle_slots(scheduler: Scheduler, output: SchedulerOutput) -> int:
    """Slot-tokens of running requests' pages beyond what they will hold after this step,
    over all groups (pages reserved ahead of use)."""
    written = {id(s.request): s.request.num_computed_tokens + s.num_new_tokens
               for s in output.scheduled}
    manager = scheduler.manager
    bs = manager.block_size
    live = manager.requests
    idle = 0
    for r in scheduler.running:
        end = written.get(id(r), r.num_computed_tokens)
        if r.request_id in live:
            for length in manager.table_lengths(r.request_id):
                idle += max(0, length * bs - end)
    return idle


def simulate(workload: Workload | list[RequestSpec], config: KVCacheConfig, *,
             enable_caching: bool = True, enable_partial_hits: bool = True,
             scheduler_config: SchedulerConfig | None = None, step_time: float = 0.02,
             record_timeline: bool = False,
             on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
             eviction: str = "lru", tiers: TierOptions | None = None,
             hold_window_pages: bool = True) -> SimResult:
    """Replay requests in arrival order on a virtual clock (each step lasts `step_time`
    seconds; an idle system jumps to the next arrival) until all have finished.

    Decoded tokens are the requests' scripted outputs when they have them, else
    deterministic stand-ins. `on_step` sees the scheduler right after each step was
    scheduled (pages allocated, copies taken) and before it is applied. With `tiers`,
    lookups reach into a host tier and a store as the engine's do (the step's offloads
    and loads run right after it is scheduled; writes are synchronous), and a server's
    keys written by the replay are deleted at its end. `hold_window_pages`: see
    KVCacheManager. Raises ValueError when a request
    can never fit the pool, RuntimeError if pages leak."""
    specs = workload.requests if isinstance(workload, Workload) else workload
    connector = _tier_connector(config, tiers) if tiers else None
    try:
        return _replay(specs, config, connector, enable_caching, enable_partial_hits,
                       scheduler_config, step_time, record_timeline, on_step, eviction,
                       hold_window_pages)
    finally:
        if connector is not None:
            _close_tiers(connector)


def _replay(specs: list[RequestSpec], config: KVCacheConfig,
            connector: PlaceholderConnector | None, enable_caching: bool,
            enable_partial_hits: bool, scheduler_config: SchedulerConfig | None,
            step_time: float, record_timeline: bool,
            on_step: Callable[[Scheduler, SchedulerOutput], None] | None, eviction: str,
            hold_window_pages: bool) -> SimResult:
    manager = new_manager(config, tiers=connector, enable_caching=enable_caching,
                          enable_partial_hits=enable_partial_hits, eviction=eviction,
                          hold_window_pages=hold_window_pages)
    scheduler = Scheduler(manager, scheduler_config, connector)
    scripted = {s.request_id: s.output_token_ids for s in specs if s.output_token_ids}
    # pop() yields the earliest arrival; ties in the given order.
    pending = list(reversed(sorted(specs, key=lambda s: s.arrival)))
    clock = 0.0
    idle_slot_steps = peak_idle = running_steps = 0
    usage_sum = 0.0
    cached_sum = [0] * len(config.groups)  # per group, cached pages summed over steps
    timeline: list[dict[str, float]] = []
    prompt_tokens = expected_tokens = output_tokens = 0
    first_hit: dict[str, int] = {}
    first_tiers: dict[str, tuple[int, int]] = {}
    while pending or scheduler.has_unfinished:
        if not scheduler.has_unfinished and pending and pending[-1].arrival > clock:
            clock = float(pending[-1].arrival)
        while pending and pending[-1].arrival <= clock:
            spec = pending.pop()
            if spec.max_tokens < 1:
                continue
            scheduler.add_request(Request(spec.request_id, spec.prompt_token_ids, spec.cache_salt,
                                          spec.max_tokens))
            prompt_tokens += len(spec.prompt_token_ids)
            output_tokens += spec.max_tokens
            expected_tokens += len(spec.prompt_token_ids) + spec.max_tokens - 1
        output = scheduler.schedule()
        running_steps += len(scheduler.running)
        if connector is not None:  # the worker's part: offloads, then loads
            connector.take_transfers().run(None)
        for item in output.scheduled:
            rid = item.request.request_id
            if rid not in first_hit:  # admitted this step: progress is the hit length
                first_hit[rid] = item.request.num_computed_tokens
                if connector is not None and rid in connector.admitted_tokens:
                    first_tiers[rid] = connector.admitted_tokens[rid]
            if connector is not None:
                connector.admitted_tokens.pop(rid, None)
        if on_step is not None:
            on_step(scheduler, output)
        sampled = {}
        for item in output.scheduled:
            if item.samples:
                r = item.request
                script = scripted.get(r.request_id)
                pos = r.num_output_tokens
                sampled[r.request_id] = [script[pos] if script and pos < len(script)
                                         else fake_token(r.request_id, r.num_tokens)]
        in_use = manager.num_usable_blocks - manager.num_free_blocks
        usage_sum += in_use / manager.num_usable_blocks
        for g, n in enumerate(manager.cached_blocks_by_group()):
            cached_sum[g] += n
        idle = idle_slots(scheduler, output)
        idle_slot_steps += idle
        peak_idle = max(peak_idle, idle)
        if record_timeline:
            timeline.append({"step": scheduler.stats.steps, "time": clock, "blocks_in_use": in_use,
                             "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                             "tokens": output.num_tokens, "idle_slots": idle})
        scheduler.update(output, sampled)
        clock += step_time
    # The worker has run the last batch of copies: release the pins on their sources.
    manager.take_pending_copies()
    if connector is not None:
        connector.take_transfers().run(None)  # the last requests' offloads
    stats, sstats = manager.stats, scheduler.stats
    if manager.num_free_blocks != manager.num_usable_blocks:
        raise RuntimeError("blocks leaked: the pool is not empty after every request finished")
    return SimResult(
        num_requests=len(specs), prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        queried_tokens=stats.queried_tokens, hit_tokens=stats.hit_tokens,
        partial_hit_tokens=stats.partial_hit_tokens, partial_hits=stats.partial_hits,
        computed_tokens=sstats.computed_tokens, recomputed_tokens=sstats.recomputed_tokens,
        discarded_tokens=sstats.discarded_tokens, preemptions=sstats.preemptions,
        evictions=stats.evictions, steps=sstats.steps, peak_blocks=sstats.peak_blocks_in_use,
        copies=stats.copies_queued, idle_slot_steps=idle_slot_steps, running_steps=running_steps,
        mean_usage=usage_sum / max(1, sstats.steps), prompt_hit_tokens=sum(first_hit.values()),
        expected_tokens=expected_tokens, num_blocks=config.num_blocks,
        bytes_per_block=config.bytes_per_block, block_size=config.block_size,
        peak_idle_slots=peak_idle, finish_time=clock, free_blocks_at_end=manager.num_free_blocks,
        timeline=timeline, group_kinds=[group_kind(group.spec) for group in config.groups],
        cached_by_group=[n / max(1, sstats.steps) for n in cached_sum],
        evicted_by_group=list(manager.evictions_by_group()),
        **_tier_figures(connector, first_tiers))


def _tier_figures(connector: PlaceholderConnector | None,
                  first: dict[str, tuple[int, int]]) -> dict[str, int]:
    if connector is None:
        return {}
    t = connector.stats
    return {"host_hit_tokens": t.host_hit_tokens, "store_hit_tokens": t.store_hit_tokens,
            "prompt_host_hit_tokens": sum(h for h, _ in first.values()),
            "prompt_store_hit_tokens": sum(s for _, s in first.values()),
            "tier_offloaded_blocks": t.offloaded_blocks, "tier_loaded_blocks": t.loaded_blocks,
            "tier_rejected_values": t.rejected_values}
