"""Replays a workload through the real scheduler and KVCacheManager with a cost-free executor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from benchmarks.workloads import RequestSpec, Workload
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.request import Request
from kvstore.specs import KVCacheConfig
from models.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


@dataclass
class SimResult:
    """Figures of one replay."""

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
    # Slots reserved but holding no token, summed over steps (naive reservation's waste).
    idle_slot_steps: int
    # Mean of (blocks in use / usable blocks) over steps.
    mean_usage: float
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Tokens served from the cache over tokens looked up, over all admissions."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def fake_token(request_id: str, position: int, vocab_size: int = 32000) -> int:
    """A deterministic stand-in for a sampled token."""
    return xxhash.xxh64_intdigest(f"{request_id}:{position}".encode()) % vocab_size


def simulate(workload: Workload | list[RequestSpec], config: KVCacheConfig, *,
             enable_caching: bool = True, enable_partial_hits: bool = True,
             scheduler_config: SchedulerConfig | None = None, step_time: float = 0.02,
             record_timeline: bool = False,
             on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None) -> SimResult:
    """Replay requests in arrival order on a virtual clock (each step lasts `step_time`
    seconds; an idle system jumps to the next arrival) until all have finished."""
    specs = workload.requests if isinstance(workload, Workload) else workload
    manager = KVCacheManager(config, enable_caching=enable_caching,
                             enable_partial_hits=enable_partial_hits)
    scheduler = Scheduler(manager, scheduler_config)
    pool = manager.pool
    bs = config.block_size
    scripted = {s.request_id: s.output_token_ids for s in specs if s.output_token_ids}
    pending = list(reversed(specs))  # pop() yields the earliest arrival
    clock = 0.0
    idle_slot_steps = 0
    usage_sum = 0.0
    timeline: list[dict[str, float]] = []
    prompt_tokens = 0
    while pending or scheduler.has_unfinished:
        if not scheduler.has_unfinished and pending and pending[-1].arrival > clock:
            clock = pending[-1].arrival
        while pending and pending[-1].arrival <= clock:
            spec = pending.pop()
            if spec.max_tokens < 1:
                continue
            scheduler.add_request(Request(spec.request_id, spec.prompt_token_ids, spec.cache_salt,
                                          spec.max_tokens))
            prompt_tokens += len(spec.prompt_token_ids)
        output = scheduler.schedule()
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
        in_use = pool.num_usable_blocks - pool.num_free_blocks
        usage_sum += in_use / pool.num_usable_blocks
        held_tokens = sum(r.num_computed_tokens for r in scheduler.running) + output.num_tokens
        idle_slot_steps += max(0, in_use * bs * len(config.groups) - held_tokens * len(config.groups))
        if record_timeline:
            timeline.append({"step": scheduler.stats.steps, "time": clock, "blocks_in_use": in_use,
                             "running": len(scheduler.running), "waiting": len(scheduler.waiting),
                             "tokens": output.num_tokens})
        scheduler.update(output, sampled)
        clock += step_time
    stats, sstats = manager.stats, scheduler.stats
    if pool.num_free_blocks != pool.num_usable_blocks:
        raise RuntimeError("blocks leaked: the pool is not empty after every request finished")
    return SimResult(
        num_requests=len(specs), prompt_tokens=prompt_tokens,
        output_tokens=sum(s.max_tokens for s in specs), queried_tokens=stats.queried_tokens,
        hit_tokens=stats.hit_tokens,
        partial_hit_tokens=stats.partial_hit_tokens, partial_hits=stats.partial_hits,
        computed_tokens=sstats.computed_tokens, recomputed_tokens=sstats.recomputed_tokens,
        discarded_tokens=sstats.discarded_tokens,
        preemptions=sstats.preemptions, evictions=stats.evictions, steps=sstats.steps,
        peak_blocks=sstats.peak_blocks_in_use, copies=stats.copies_queued,
        idle_slot_steps=idle_slot_steps, mean_usage=usage_sum / max(1, sstats.steps),
        timeline=timeline)
