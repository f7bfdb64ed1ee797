"""Replays a workload through the real scheduler and KVCacheManager with a cost-free executor."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import xxhash

from kvstore.benchmarks.manager import new_manager
from kvstore.benchmarks.workloads import RequestSpec, Workload
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.request import Request
from kvstore.specs import KVCacheConfig, LayerSpec, RecurrentStateSpec
from kvstore.utils import hit_rate

if TYPE_CHECKING:
    from kvstore.tiers.base import Tier


@dataclass(frozen=True)
class TierOptions:
    """Tiers below the pool for a replay (placeholder values): a host tier of ``host_bytes``
    and a store (``mem``: in-process, ``mem:SIZE``: bounded, or a ``valkey://`` URL)."""

    host_bytes: int | None = None
    store: str | None = None
    window_offload: str = "ends"  # kvstore.tiers.connector.WINDOW_OFFLOADS

    def __bool__(self) -> bool:
        return bool(self.host_bytes or self.store)

    def describe(self) -> str:
        """One line: the host tier's size, the store and a window offload other than ends."""
        from kvstore.benchmarks.sweep import format_bytes
        from kvstore.tiers.valkey_store import redact_url

        parts = [f"host tier {format_bytes(self.host_bytes)}"] if self.host_bytes else []
        if self.store:
            parts.append(f"store {redact_url(self.store)}")
        if self.window_offload != "ends":
            parts.append(f"window offload {self.window_offload}")
        return ", ".join(parts)


def parse_mem_store(text: str) -> int | None | bool:
    """For ``mem`` (unbounded): None; ``mem:SIZE``: its bytes; anything else: False."""
    from kvstore.benchmarks.sweep import parse_size

    if text == "mem":
        return None
    return parse_size(text[4:]) if text.startswith("mem:") else False


def open_store(spec: str) -> Tier:
    """A ``ModelTier`` for ``mem[:SIZE]``, else a synchronous ``ValkeyStore`` (ValueError: bad URL)."""
    from kvstore.benchmarks.tier_model import ModelTier
    from kvstore.tiers.valkey_store import ValkeyStore

    mem = parse_mem_store(spec)
    if mem is False:
        return ValkeyStore(spec, sync_stores=True, timeout_s=2.0)
    return ModelTier(None if mem is None else int(mem), name="store")


def check_store(spec: str, error: Callable[[str], NoReturn]) -> None:
    """A usage error (`error`, the parser's) unless a Valkey store `spec` answers now."""
    if parse_mem_store(spec) is not False:
        return
    store = open_store(spec)
    try:
        if not store.ping():  # type: ignore[attr-defined]
            from kvstore.tiers.valkey_store import redact_url

            error(f"argument --store: cannot reach {redact_url(spec)} "
                  f"({getattr(store, 'last_error', None) or 'no answer'})")
    finally:
        store.close()


@dataclass(frozen=True)
class StepTime:
    """A step computing ``n`` tokens takes ``a + b * n`` s (default: an 8B model on an H100)."""

    a: float = 0.005
    b: float = 40e-6

    def describe(self) -> str:
        """``5 ms + 40 us/token``."""
        return f"{self.a * 1e3:g} ms + {self.b * 1e6:g} us/token"


DEFAULT_STEP_TIME = StepTime()


@dataclass
class SimResult:
    """Figures of one replay, where computed + hit tokens == expected + discarded tokens."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    queried_tokens: int  # looked up, over every admission (re-admissions included)
    hit_tokens: int
    partial_hit_tokens: int
    partial_hits: int
    computed_tokens: int
    recomputed_tokens: int
    discarded_tokens: int  # computed, then thrown away by preemptions
    preemptions: int
    evictions: int
    steps: int
    peak_blocks: int
    copies: int
    idle_slot_steps: int  # slot-tokens reserved but holding no token, summed over steps
    mean_usage: float  # blocks in use over usable blocks, averaged over steps
    running_steps: int = 0  # requests running after each step was scheduled, summed
    prompt_hit_tokens: int = 0  # hit tokens at each request's first admission
    expected_tokens: int = 0  # sum of prompt + max_tokens - 1: no cache, no preemption
    num_blocks: int = 0  # the null block included
    bytes_per_block: int = 0  # over all layer slots
    block_size: int = 0
    peak_idle_slots: int = 0
    finish_time: float = 0.0  # the virtual clock when the last request finished (s)
    free_blocks_at_end: int = 0
    # Tiers (0 without them): tokens admitted from the host tier and the store, over all
    # admissions and at first admission; blocks offloaded, loaded and rejected.
    host_hit_tokens: int = 0
    store_hit_tokens: int = 0
    prompt_host_hit_tokens: int = 0
    prompt_store_hit_tokens: int = 0
    tier_offloaded_blocks: int = 0
    tier_loaded_blocks: int = 0
    tier_rejected_values: int = 0
    # Per KV cache group: "full" or "window W", cached pages (mean over steps), evictions.
    group_kinds: list[str] = field(default_factory=list)
    cached_by_group: list[float] = field(default_factory=list)
    evicted_by_group: list[int] = field(default_factory=list)

    # Derived from the above (the pool's usable blocks exclude the null block).
    full_cached_pages: float = field(init=False)
    full_evictions: int = field(init=False)
    window_cached_pages: float = field(init=False)
    window_evictions: int = field(init=False)
    hit_rate: float = field(init=False)  # device hits over tokens looked up
    total_hit_rate: float = field(init=False)  # device, host and store hits over looked up
    prompt_device_hit_tokens: int = field(init=False)  # first-admission hits on the device
    prompt_hit_rate: float = field(init=False)  # first-admission hits over prompt tokens
    mean_running: float = field(init=False)  # requests running per step
    saved_tokens: int = field(init=False)  # expected minus computed tokens
    usable_blocks: int = field(init=False)
    kv_bytes: int = field(init=False)  # the whole pool, the null block included
    peak_kv_bytes: int = field(init=False)  # the most blocks in use at once
    mean_idle_slots: float = field(init=False)  # reserved-but-idle slot-tokens per step
    mean_idle_bytes: float = field(init=False)
    peak_idle_bytes: int = field(init=False)
    mean_idle_fraction: float = field(init=False)  # idle over the pool's slot-tokens
    leaked_blocks: int = field(init=False)  # in use after every request finished

    def __post_init__(self) -> None:
        for kind in ("full", "window"):
            groups = [g for g, k in enumerate(self.group_kinds) if k.startswith(kind)]
            setattr(self, f"{kind}_cached_pages", sum(self.cached_by_group[g] for g in groups))
            setattr(self, f"{kind}_evictions", sum(self.evicted_by_group[g] for g in groups))
        self.hit_rate = hit_rate(self.hit_tokens, self.queried_tokens)
        self.total_hit_rate = hit_rate(
            self.hit_tokens + self.host_hit_tokens + self.store_hit_tokens, self.queried_tokens)
        self.prompt_device_hit_tokens = (self.prompt_hit_tokens - self.prompt_host_hit_tokens
                                         - self.prompt_store_hit_tokens)
        self.prompt_hit_rate = hit_rate(self.prompt_hit_tokens, self.prompt_tokens)
        self.mean_running = self.running_steps / self.steps if self.steps else 0.0
        self.saved_tokens = self.expected_tokens - self.computed_tokens
        self.usable_blocks = max(0, self.num_blocks - 1)
        self.kv_bytes = self.num_blocks * self.bytes_per_block
        self.peak_kv_bytes = self.peak_blocks * self.bytes_per_block
        self.mean_idle_slots = self.idle_slot_steps / self.steps if self.steps else 0.0
        slot_bytes = self.bytes_per_block // self.block_size if self.block_size else 0
        self.mean_idle_bytes = self.mean_idle_slots * slot_bytes
        self.peak_idle_bytes = self.peak_idle_slots * slot_bytes
        total = self.usable_blocks * self.block_size
        self.mean_idle_fraction = self.mean_idle_slots / total if total else 0.0
        self.leaked_blocks = self.usable_blocks - self.free_blocks_at_end

    def model_time(self, step: StepTime) -> float:
        """Seconds the replay's steps take under `step`."""
        return step.a * self.steps + step.b * self.computed_tokens

    def kept_and_evicted(self, kind: str) -> tuple[float, int]:
        """Cached pages (mean over steps) and evictions of the ``full`` or ``window`` groups."""
        return getattr(self, f"{kind}_cached_pages"), getattr(self, f"{kind}_evictions")

    def summary(self) -> dict[str, Any]:
        """Every counter and derived figure, flat (no per-group lists)."""
        return {k: v for k, v in asdict(self).items() if not isinstance(v, list)}


def _group_kind(spec: LayerSpec) -> str:
    if isinstance(spec, RecurrentStateSpec):
        return "recurrent"
    return "full" if spec.sliding_window is None else f"window {spec.sliding_window}"


def fake_token(request_id: str, position: int, vocab_size: int = 32000) -> int:
    """A deterministic stand-in for a sampled token."""
    return xxhash.xxh64_intdigest(f"{request_id}:{position}".encode()) % vocab_size


def _idle_slots(scheduler: Scheduler, output: SchedulerOutput) -> int:
    """Slot-tokens of running requests' pages beyond what they hold after this step."""
    written = {id(s.request): s.request.num_computed_tokens + s.num_new_tokens
               for s in output.scheduled}
    manager = scheduler.manager
    return sum(max(0, length * manager.block_size - written.get(id(r), r.num_computed_tokens))
               for r in scheduler.running if r.request_id in manager.requests
               for length in manager.table_lengths(r.request_id))


def simulate(workload: Workload | list[RequestSpec], config: KVCacheConfig, *,
             scheduler_config: SchedulerConfig | None = None, step_time: float = 0.02,
             on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None,
             tiers: TierOptions | None = None, **cache_options: Any) -> SimResult:
    """Replay requests in arrival order, `step_time` seconds a step, until all have finished
    (`cache_options`: ``CacheConfig`` fields; `on_step`: sees each scheduled step; `tiers`:
    below the pool). ValueError when a request can never fit, RuntimeError if pages leak."""
    from kvstore.benchmarks.tier_model import ModelTier, PlaceholderConnector

    specs = workload.requests if isinstance(workload, Workload) else workload
    connector = None
    if tiers:  # a name of its own: replays sharing a server never see each other's keys
        connector = PlaceholderConnector(
            config, f"kvstore-bench-{uuid.uuid4().hex}", window_offload=tiers.window_offload,
            host=ModelTier(tiers.host_bytes, name="host") if tiers.host_bytes else None,
            store=open_store(tiers.store) if tiers.store else None)
    try:
        manager = new_manager(config, tiers=connector, **cache_options)
        scheduler = Scheduler(manager, scheduler_config, connector)
        scripted = {s.request_id: s.output_token_ids for s in specs if s.output_token_ids}
        pending = sorted(specs, key=lambda s: s.arrival)[::-1]  # pop(): the earliest arrival
        clock = usage_sum = 0.0
        idle_slot_steps = peak_idle = running_steps = 0
        cached_sum = [0] * len(config.groups)  # per group, cached pages summed over steps
        first_hit: dict[str, int] = {}
        first_tiers: dict[str, tuple[int, int]] = {}
        while pending or scheduler.has_unfinished:
            if not scheduler.has_unfinished and pending[-1].arrival > clock:
                clock = float(pending[-1].arrival)
            while pending and pending[-1].arrival <= clock:
                spec = pending.pop()
                if spec.max_tokens >= 1:  # a request with nothing to decode is dropped
                    scheduler.add_request(Request(spec.request_id, spec.prompt_token_ids,
                                                  spec.cache_salt, spec.max_tokens))
            output = scheduler.schedule()
            running_steps += len(scheduler.running)
            if connector is not None:  # the worker's part: offloads, then loads
                connector.take_transfers().run(None)
            sampled = {}
            for item in output.scheduled:
                r = item.request
                rid = r.request_id
                tier_hit = connector.admitted_tokens.pop(rid, None) if connector is not None else None
                if rid not in first_hit:  # admitted this step: progress is the hit length
                    first_hit[rid] = r.num_computed_tokens
                    if tier_hit is not None:
                        first_tiers[rid] = tier_hit
                if item.samples:
                    script = scripted.get(rid)
                    pos = r.num_output_tokens
                    sampled[rid] = [script[pos] if script and pos < len(script)
                                    else fake_token(rid, r.num_tokens)]
            if on_step is not None:
                on_step(scheduler, output)
            in_use = manager.num_usable_blocks - manager.num_free_blocks
            usage_sum += in_use / manager.num_usable_blocks
            for g, n in enumerate(manager.cached_blocks_by_group()):
                cached_sum[g] += n
            idle = _idle_slots(scheduler, output)
            idle_slot_steps += idle
            peak_idle = max(peak_idle, idle)
            scheduler.update(output, sampled)
            clock += step_time
        # The worker has run the last batch of copies: release the pins on their sources.
        manager.take_pending_copies()
        tier_figures: dict[str, int] = {}
        if connector is not None:
            connector.take_transfers().run(None)  # the last requests' offloads
            t = connector.stats
            tier_figures = {
                "host_hit_tokens": t.host_hit_tokens, "store_hit_tokens": t.store_hit_tokens,
                "prompt_host_hit_tokens": sum(h for h, _ in first_tiers.values()),
                "prompt_store_hit_tokens": sum(s for _, s in first_tiers.values()),
                "tier_offloaded_blocks": t.offloaded_blocks,
                "tier_loaded_blocks": t.loaded_blocks, "tier_rejected_values": t.rejected_values}
    finally:
        if connector is not None:
            connector.close()
    stats, sstats = manager.stats, scheduler.stats
    live = [s for s in specs if s.max_tokens >= 1]
    prompt_tokens = sum(len(s.prompt_token_ids) for s in live)
    output_tokens = sum(s.max_tokens for s in live)
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
        expected_tokens=prompt_tokens + output_tokens - len(live), num_blocks=config.num_blocks,
        bytes_per_block=config.bytes_per_block, block_size=config.block_size,
        peak_idle_slots=peak_idle, finish_time=clock, free_blocks_at_end=manager.num_free_blocks,
        group_kinds=[_group_kind(group.spec) for group in config.groups],
        cached_by_group=[n / max(1, sstats.steps) for n in cached_sum],
        evicted_by_group=list(manager.evictions_by_group()), **tier_figures)
