"""CPU cost of the cache layer's bookkeeping, driven the way a continuous-batching engine drives it.

Run as ``python -m kvstore.benchmarks.manager_overhead`` (``--quick`` for a small run, ``--profile``
to add a cProfile of the hot path). The :class:`KVCacheManager` is called directly: no
scheduler, no model. Each step of the driver

1. gives every running request one decode token (``allocate_slots(request, 1)``; when the
   pool cannot hold it, the newest running request is preempted, as the scheduler does),
2. admits waiting requests while there is room (``get_computed_blocks`` then
   ``allocate_slots`` for the whole uncached prompt) up to ``max_running`` requests and a
   prefill token budget,
3. hands the pending copies to a (fake) worker, then advances every scheduled request,
   appends a sampled (or scripted) token and frees the finished ones.

Only the manager calls are timed (``time.perf_counter`` around each one; cyclic garbage
collection is off during the replays, as in ``timeit``). Block hashing,
which an engine does when a request is created or a token appended, is done by the
driver just before the manager needs it and timed on its own.

Part 2 (copy-on-write): token-level workloads whose shared prefixes do not end on block
boundaries (multi-turn chats, where each turn extends the previous one, and few-shot
prompts), replayed with full-block caching only and with partial hits, against the
infinite-cache ideal, and the manager's cost with the partial index lookup on and off.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pstats
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.benchmarks.workloads import (
    RequestSpec,
    few_shot,
    ideal_hit_tokens,
    multi_turn_chat,
    shared_system_prompts,
)
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheConfig, make_kv_cache_config

BLOCK_SIZE = 16
SPEC = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_dim=128)
NUM_LAYERS = 32


# ------------------------------------------------------------------------------ workloads


def overhead_workload(num_requests: int, seed: int = 0) -> list[RequestSpec]:
    """Prompts of 500..4000 tokens that start with one of 8 shared system prompts
    (400..2400 tokens), then 100..500 decode tokens each; every request waits from t=0."""
    base = shared_system_prompts(
        num_requests, num_prompts=8, system_lens=(400, 900, 1500, 2400), user_len=(100, 1600),
        rate=math.inf, seed=seed)
    rng = np.random.default_rng(seed + 1)
    outs = rng.integers(100, 501, size=len(base.requests))
    return [replace(r, max_tokens=int(n)) for r, n in zip(base.requests, outs, strict=True)]


def cow_workloads(quick: bool, seed: int = 0) -> dict[str, list[RequestSpec]]:
    """Token-level workloads whose shared prefixes are not block-aligned."""
    n_conv = 30 if quick else 120
    n_few = 150 if quick else 600
    chat = multi_turn_chat(n_conv, (3, 8), system_len=301, user_len=(20, 300),
                           output_median=100, output_max=600, rate=2.0, think_time=2.0,
                           seed=seed)
    shots = few_shot(n_few, 8, num_tasks=6, example_len=(40, 200), question_len=(16, 128),
                     output_median=60, output_max=400, rate=20.0, seed=seed)
    return {"multi-turn chat": chat.requests, "few-shot": shots.requests}


def make_config(num_blocks: int) -> KVCacheConfig:
    """One full-attention group (the common case) of `num_blocks` blocks."""
    return make_kv_cache_config([SPEC] * NUM_LAYERS, num_blocks=num_blocks)


# --------------------------------------------------------------------------------- driver


@dataclass
class DriveResult:
    """Per-call timings (seconds) and counters of one replay."""

    name: str
    prefill: list[float] = field(default_factory=list)  # get_computed_blocks + allocate_slots
    lookup: list[float] = field(default_factory=list)  # get_computed_blocks alone
    decode: list[float] = field(default_factory=list)  # allocate_slots(request, 1)
    free: list[float] = field(default_factory=list)
    copies_s: float = 0.0  # take_pending_copies
    failed_s: float = 0.0  # admissions that did not fit (lookup + refused allocation)
    hash_s: float = 0.0  # block hashing done by the driver (outside the manager)
    num_requests: int = 0
    finished: int = 0
    steps: int = 0
    preemptions: int = 0
    failed_admissions: int = 0
    copies: int = 0
    max_running: int = 0
    running_sum: int = 0
    peak_usage: float = 0.0
    wall_s: float = 0.0
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def manager_s(self) -> float:
        """Seconds spent inside the manager, over all calls."""
        return (sum(self.prefill) + sum(self.decode) + sum(self.free) + self.copies_s
                + self.failed_s)

    @property
    def requests_per_s(self) -> float:
        """Finished requests per second of manager time."""
        return self.finished / self.manager_s if self.manager_s else 0.0

    @property
    def mean_running(self) -> float:
        """Mean running requests per step."""
        return self.running_sum / self.steps if self.steps else 0.0


def _fake_tokens(rng: np.random.Generator, n: int) -> deque[int]:
    return deque(rng.integers(0, 32000, size=n).tolist())


def drive(name: str, specs: Sequence[RequestSpec], manager: KVCacheManager, **kw: Any
          ) -> DriveResult:
    """Replay `specs` through `manager` to the end (see `drive_steps`)."""
    steps = drive_steps(name, specs, manager, **kw)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def drive_side_by_side(runs: Sequence[tuple[str, Sequence[RequestSpec], KVCacheManager]],
                       **kw: Any) -> list[DriveResult]:
    """Replay several (name, workload, manager) runs at once, one engine step of each in
    turn, so that load from other processes on this machine hits every run alike."""
    gens = [drive_steps(name, specs, manager, **kw) for name, specs, manager in runs]
    out: list[DriveResult | None] = [None] * len(gens)
    live = list(range(len(gens)))
    while live:
        for k in list(live):
            try:
                next(gens[k])
            except StopIteration as stop:
                out[k] = stop.value
                live.remove(k)
    return [r for r in out if r is not None]


def drive_steps(name: str, specs: Sequence[RequestSpec], manager: KVCacheManager, *,
                max_running: int = 64, max_prefill_tokens: int = 16384, step_time: float = 0.02,
                seed: int = 0) -> Generator[None, None, DriveResult]:
    """Replay `specs` through `manager` as a continuous-batching engine would (see the
    module docstring), yielding after every engine step; returns the result. Requests
    join the waiting queue at their arrival time on a virtual clock of `step_time`
    seconds per step. `wall_s` counts only the time spent in this generator."""
    perf = time.perf_counter
    bs = manager.block_size
    res = DriveResult(name, num_requests=len(specs))
    pending = deque(sorted(specs, key=lambda s: s.arrival))
    scripts = {s.request_id: s.output_token_ids for s in specs if s.output_token_ids}
    fake = _fake_tokens(np.random.default_rng(seed), sum(s.max_tokens for s in specs) + 1)
    waiting: deque[Request] = deque()
    running: list[Request] = []
    clock = 0.0
    t_start = perf()
    paused = 0.0
    prefill, lookup, decode, free = res.prefill, res.lookup, res.decode, res.free

    def hash_now(request: Request) -> None:
        t0 = perf()
        request.update_block_hashes(bs, manager.hash_fn)
        res.hash_s += perf() - t0

    while pending or waiting or running:
        if not waiting and not running and pending[0].arrival > clock:
            clock = pending[0].arrival
        while pending and pending[0].arrival <= clock:
            s = pending.popleft()
            waiting.append(Request(s.request_id, s.prompt_token_ids, s.cache_salt, s.max_tokens))
        # 1. one decode token per running request; preempt the newest when the pool is full.
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        i = 0
        while i < len(running):
            request = running[i]
            t0 = perf()
            ok = manager.allocate_slots(request, 1)
            decode.append(perf() - t0)
            if ok is not None:
                scheduled.append((request, 1))
                i += 1
                continue
            victim = running.pop()
            t0 = perf()
            manager.free(victim)
            free.append(perf() - t0)
            victim.num_computed_tokens = 0
            waiting.appendleft(victim)
            res.preemptions += 1
            preempted = True
        # 2. admissions.
        budget = max_prefill_tokens
        while (not preempted and waiting and len(running) < max_running
               and (budget == max_prefill_tokens or waiting[0].num_tokens <= budget)):
            request = waiting[0]
            hash_now(request)
            t0 = perf()
            computed = manager.get_computed_blocks(request)
            t1 = perf()
            num_new = request.num_tokens - computed.num_computed_tokens
            ok = manager.allocate_slots(request, num_new, computed)
            t2 = perf()
            if ok is None:
                res.failed_s += t2 - t0
                res.failed_admissions += 1
                break
            lookup.append(t1 - t0)
            prefill.append(t2 - t0)
            waiting.popleft()
            running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        # 3. the worker runs the copies, the step runs, tokens are sampled.
        t0 = perf()
        res.copies += len(manager.take_pending_copies())
        res.copies_s += perf() - t0
        res.steps += 1
        res.running_sum += len(running)
        res.max_running = max(res.max_running, len(running))
        res.peak_usage = max(res.peak_usage, manager.usage)
        done = []
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            script = scripts.get(request.request_id)
            pos = request.num_output_tokens
            request.append_token_ids(script[pos] if script and pos < len(script) else fake.popleft())
            if request.num_output_tokens >= request.max_tokens:
                done.append(request)
            elif request.num_tokens % bs == 0:
                hash_now(request)
        for request in done:
            running.remove(request)
            hash_now(request)
            t0 = perf()
            manager.free(request)
            free.append(perf() - t0)
            res.finished += 1
        clock += step_time
        t_pause = perf()
        yield
        paused += perf() - t_pause
    res.wall_s = perf() - t_start - paused
    if manager.num_free_blocks != manager.num_usable_blocks:
        raise RuntimeError("blocks leaked: the pool is not empty after every request finished")
    res.stats = manager.stats.as_dict()
    return res


# -------------------------------------------------------------------------------- reports


def us(xs: Sequence[float], q: float | None = None) -> float:
    """Mean (or the q-quantile) of timings in seconds, in microseconds."""
    if not xs:
        return float("nan")
    if q is None:
        return 1e6 * sum(xs) / len(xs)
    return 1e6 * float(np.quantile(np.asarray(xs), q))


def overhead_table(results: Sequence[DriveResult], title: str) -> Table:
    """Per-call costs of one or more replays, side by side."""
    t = Table(title=title)
    t.add_column("")
    for r in results:
        t.add_column(r.name, justify="right")
    rows: list[tuple[str, list[str]]] = [
        ("requests finished", [f"{r.finished}" for r in results]),
        ("steps", [f"{r.steps}" for r in results]),
        ("running: mean / max", [f"{r.mean_running:.1f} / {r.max_running}" for r in results]),
        ("peak pool usage", [f"{r.peak_usage:.1%}" for r in results]),
        ("prefill calls", [f"{len(r.prefill)}" for r in results]),
        ("prefill µs: mean", [f"{us(r.prefill):.1f}" for r in results]),
        ("prefill µs: p50 / p99",
         [f"{us(r.prefill, .5):.1f} / {us(r.prefill, .99):.1f}" for r in results]),
        ("  of which lookup µs (mean)", [f"{us(r.lookup):.1f}" for r in results]),
        ("decode calls", [f"{len(r.decode)}" for r in results]),
        ("decode µs: mean", [f"{us(r.decode):.2f}" for r in results]),
        ("decode µs: p50 / p99",
         [f"{us(r.decode, .5):.2f} / {us(r.decode, .99):.2f}" for r in results]),
        ("free µs: mean", [f"{us(r.free):.1f}" for r in results]),
        ("manager s (all calls)", [f"{r.manager_s:.3f}" for r in results]),
        ("requests / s through the manager", [f"{r.requests_per_s:,.0f}" for r in results]),
        ("hashing s (driver, outside)", [f"{r.hash_s:.3f}" for r in results]),
        ("driver wall s", [f"{r.wall_s:.2f}" for r in results]),
        ("token hit rate", [f"{r.stats['hit_rate']:.1%}" for r in results]),
        ("hit tokens", [f"{int(r.stats['hit_tokens']):,}" for r in results]),
        ("partial hits (tokens)",
         [f"{int(r.stats['partial_hits'])} ({int(r.stats['partial_hit_tokens']):,})"
          for r in results]),
        ("evictions", [f"{int(r.stats['evictions']):,}" for r in results]),
        ("preemptions / refused admissions",
         [f"{r.preemptions} / {r.failed_admissions}" for r in results]),
        ("copies", [f"{r.copies}" for r in results]),
    ]
    for label, cells in rows:
        t.add_row(label, *cells)
    return t


def profile_hot_path(specs: Sequence[RequestSpec], num_blocks: int, top: int = 20) -> str:
    """cProfile of one replay: the manager's API calls by cumulative time, then the top
    functions by own time, with microseconds per call (profiling inflates every call)."""
    manager = KVCacheManager(make_config(num_blocks))
    prof = cProfile.Profile()
    gc.collect()
    gc.disable()
    try:
        prof.enable()
        drive("profile", specs, manager)
        prof.disable()
    finally:
        gc.enable()
    stats = pstats.Stats(prof)
    api = ("get_computed_blocks", "allocate_slots", "free", "take_pending_copies")
    rows = []
    api_rows = []
    profile = stats.stats  # type: ignore[attr-defined]  # pstats keeps its table untyped
    for (filename, line, func), (_cc, ncalls, tottime, cumtime, _callers) in profile.items():
        name = f"{filename.split('/')[-1]}:{line}({func})"
        if filename.split("/")[-1] == "kv_cache_manager.py" and func in api:
            api_rows.append((cumtime, ncalls, name))
        if "kvstore" in filename or "sortedcontainers" in filename or "xxhash" in filename \
                or filename == "~":
            rows.append((tottime, cumtime, ncalls, name))
    out = io.StringIO()
    out.write(f"{'cumtime s':>10} {'calls':>10} {'cum µs/call':>12}  manager API\n")
    for cumtime, ncalls, name in sorted(api_rows, reverse=True):
        out.write(f"{cumtime:10.3f} {ncalls:10d} {1e6 * cumtime / ncalls:12.2f}  {name}\n")
    out.write(f"\n{'tottime s':>10} {'cumtime s':>10} {'calls':>10} {'own µs/call':>12}  function\n")
    for tottime, cumtime, ncalls, name in sorted(rows, reverse=True)[:top]:
        out.write(f"{tottime:10.3f} {cumtime:10.3f} {ncalls:10d} {1e6 * tottime / ncalls:12.2f}  "
                  f"{name}\n")
    return out.getvalue()


def run_eviction(console: Console, num_requests: int, num_blocks: int, repeats: int,
                 names: Sequence[str]) -> list[DriveResult]:
    """Part 1's workload once per eviction policy (LRU first), side by side, with each
    policy's manager time over LRU's."""
    specs = overhead_workload(num_requests)
    names = ["lru"] + [n for n in names if n != "lru"]
    results = _best_of(repeats, lambda: [
        (name, specs, KVCacheManager(make_config(num_blocks), eviction=name)) for name in names])
    console.print(overhead_table(results, "Manager cost per call by eviction policy"))
    for r in results[1:]:
        console.print(f"{r.name} / lru: " + _ratio_line(r, results[0]))
    return results


# ----------------------------------------------------------------------------------- main


def _best_of(repeats: int, make_runs: Callable[[], list[tuple[str, Sequence[RequestSpec], KVCacheManager]]]
             ) -> list[DriveResult]:
    """Run `make_runs()` side by side `repeats` times; per run, keep the fastest replay."""
    best: list[DriveResult] = []
    for _ in range(repeats):
        runs = make_runs()
        # Cyclic GC off while timing (as timeit does): otherwise a full collection over the
        # other runs' objects lands in whichever run happens to trigger it.
        gc.collect()
        gc.disable()
        try:
            results = drive_side_by_side(runs)
        finally:
            gc.enable()
        if not best:
            best = results
        else:
            best = [r if r.manager_s < b.manager_s else b for r, b in zip(results, best, strict=True)]
    return best


def _ratio_line(on: DriveResult, off: DriveResult) -> str:
    return (f"prefill mean {us(on.prefill) / us(off.prefill):.3f}x (p50 "
            f"{us(on.prefill, .5) / us(off.prefill, .5):.3f}x), decode mean "
            f"{us(on.decode) / us(off.decode):.3f}x (p50 {us(on.decode, .5) / us(off.decode, .5):.3f}x), "
            f"all manager time {on.manager_s / off.manager_s:.3f}x")


def run_overhead(console: Console, num_requests: int, num_blocks: int, repeats: int
                 ) -> list[DriveResult]:
    """Part 1: the synthetic continuous-batching workload, partial index lookup on and off,
    side by side."""
    specs = overhead_workload(num_requests)
    plens = [len(s.prompt_token_ids) for s in specs]
    console.print(
        f"[bold]Part 1[/]: {len(specs)} requests, prompts {min(plens)}..{max(plens)} tokens "
        f"(mean {np.mean(plens):.0f}) over 8 shared system prompts, 100..500 decode tokens; "
        f"block size {BLOCK_SIZE}; pool of {num_blocks - 1} usable blocks "
        f"({(num_blocks - 1) * BLOCK_SIZE:,} tokens); up to 64 running, one decode token each "
        "per step; the two settings run side by side, one engine step each in turn.")
    results = _best_of(repeats, lambda: [
        ("partial hits on", specs, KVCacheManager(make_config(num_blocks))),
        ("full blocks only", specs,
         KVCacheManager(make_config(num_blocks), enable_partial_hits=False))])
    console.print(overhead_table(results, "Manager cost per call (this machine's CPU)"))
    ideal = ideal_hit_tokens(specs)
    ideal_b = ideal_hit_tokens(specs, BLOCK_SIZE)
    console.print(f"ideal hit rate (infinite cache, first admissions only): {ideal.rate:.1%} "
                  f"token-exact, {ideal_b.rate:.1%} block-rounded; the manager's rate also counts "
                  "re-admissions after preemption, which hit their own earlier blocks")
    console.print("partial index on / off: " + _ratio_line(*results))
    return results


def run_cow(console: Console, quick: bool, repeats: int) -> None:
    """Part 2: full-block caching versus partial hits, against the ideal."""
    ideal_table = Table(title="Copy-on-write: prompt tokens served from the cache")
    for col in ("workload", "requests", "prompt tokens", "full blocks only", "with partial hits",
                "partial hits (tokens)", "ideal, block-rounded", "ideal, token-exact",
                "evictions"):
        ideal_table.add_column(col, justify="right")
    cost_table = Table(title="Copy-on-write: manager cost, partial index lookup off vs on, "
                       "side by side (this machine's CPU)")
    for col in ("workload", "prefill µs off", "prefill µs on", "ratio", "decode µs off",
                "decode µs on", "ratio", "manager s off", "manager s on", "ratio"):
        cost_table.add_column(col, justify="right")
    for name, specs in cow_workloads(quick).items():
        total_tokens = sum(len(s.prompt_token_ids) + s.max_tokens for s in specs)
        num_blocks = total_tokens // BLOCK_SIZE + len(specs) + 64  # holds everything: no eviction
        def runs(name: str = name, specs: Sequence[RequestSpec] = specs, n: int = num_blocks
                 ) -> list[tuple[str, Sequence[RequestSpec], KVCacheManager]]:
            return [(name, specs, KVCacheManager(make_config(n), enable_partial_hits=False)),
                    (name, specs, KVCacheManager(make_config(n)))]

        off, on = _best_of(repeats, runs)
        ideal = ideal_hit_tokens(specs, include_outputs=True)
        ideal_b = ideal_hit_tokens(specs, BLOCK_SIZE, include_outputs=True)
        prompt = ideal.prompt_tokens

        def pct(n: float, prompt: int = prompt) -> str:
            return f"{int(n):,} ({n / prompt:.1%})"

        ideal_table.add_row(
            name, f"{len(specs)}", f"{prompt:,}", pct(off.stats["hit_tokens"]),
            pct(on.stats["hit_tokens"]),
            f"{int(on.stats['partial_hits'])} ({int(on.stats['partial_hit_tokens']):,})",
            pct(ideal_b.total), pct(ideal.total),
            f"{int(off.stats['evictions'])} / {int(on.stats['evictions'])}")
        cost_table.add_row(
            name, f"{us(off.prefill):.1f}", f"{us(on.prefill):.1f}",
            f"{us(on.prefill) / us(off.prefill):.3f}", f"{us(off.decode):.2f}",
            f"{us(on.decode):.2f}", f"{us(on.decode) / us(off.decode):.3f}",
            f"{off.manager_s:.3f}", f"{on.manager_s:.3f}", f"{on.manager_s / off.manager_s:.3f}")
    console.print(ideal_table)
    console.print("Ideal = longest common prefix with any earlier prompt (or earlier prompt + "
                  "its scripted output), infinite cache, capped at prompt length - 1; "
                  "block-rounded = that rounded down to whole blocks (the best full-block "
                  "caching can do). Pools hold every token: no eviction.")
    console.print(cost_table)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small run (~300 requests)")
    ap.add_argument("--requests", type=int, default=None, help="requests in part 1")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="pool size in part 1 (default: tight for 64 running requests)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="alternated runs per setting; the fastest is kept")
    ap.add_argument("--profile", action="store_true", help="cProfile the hot path as well")
    ap.add_argument("--skip-cow", action="store_true", help="part 1 only")
    ap.add_argument("--eviction", default=None,
                    help="comma list of eviction policies: part 1 once per policy next to LRU "
                         "(instead of the partial-index comparison)")
    args = ap.parse_args(argv)
    console = Console(width=150)
    num_requests = args.requests or (300 if args.quick else 2000)
    num_blocks = args.num_blocks or 5000
    repeats = args.repeats or 1
    t0 = time.perf_counter()
    if args.eviction:
        run_eviction(console, num_requests, num_blocks, repeats, args.eviction.split(","))
    else:
        run_overhead(console, num_requests, num_blocks, repeats)
    if not args.skip_cow:
        run_cow(console, args.quick, repeats)
    if args.profile:
        specs = overhead_workload(min(num_requests, 400))
        console.print(f"[bold]cProfile[/] of part 1 with {len(specs)} requests (own time; "
                      "profiling inflates every call):")
        print(profile_hot_path(specs, num_blocks), flush=True)
    console.print(f"total wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
