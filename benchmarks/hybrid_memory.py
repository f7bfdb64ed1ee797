"""Memory held per request, concurrency and prefix hits: Gemma-3-like hybrid layout vs all-full.

Run as ``python -m kvstore.benchmarks.hybrid_memory`` (``--quick`` for a smaller run). A 26-layer
model where every 6th layer is full attention and the others use a sliding window (512
and 1024 tokens), and the same model with every layer full attention, get the same
byte budget (``make_kv_cache_config(layer_specs, memory_bytes=...)``) and replay the same
workload of long prompts with shared prefixes through the real scheduler and manager
(``kvstore.benchmarks.simulator.simulate``). Prints one table and writes the plot
``docs/figures/hybrid_memory.png``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.benchmarks.output import pyplot
from kvstore.benchmarks.simulator import SimResult, simulate
from kvstore.benchmarks.sweep import ModelShape
from kvstore.benchmarks.workloads import RequestSpec, ideal_hit_tokens, shared_system_prompts
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.specs import KVCacheConfig, KVCacheSpec, make_kv_cache_config

BLOCK_SIZE = 16
# Gemma-3-1B-like: 26 layers, every 6th full attention, one KV head of dimension 256, fp16.
SHAPE = ModelShape("gemma-3-1b-like", num_layers=26, num_kv_heads=1, head_dim=256,
                   dtype="float16", sliding_per_full=5)
MiB = 1 << 20
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "figures" / "hybrid_memory.png"


def gemma3_like(window: int) -> list[KVCacheSpec]:
    """26 layers; layers 5, 11, 17, 23 (every 6th) are full attention, the rest windowed."""
    return replace(SHAPE, sliding_window=window).hybrid_specs(BLOCK_SIZE)


def all_full() -> list[KVCacheSpec]:
    """The same 26 layers, all full attention."""
    return SHAPE.full_specs(BLOCK_SIZE)


def make_workload(num_requests: int, rate: float = math.inf, seed: int = 0) -> list[RequestSpec]:
    """Prompts of about 2k..8k tokens: one of 6 shared system prompts (1.5k, 3k or 5k
    tokens) and a unique user part of 500..3000 tokens; outputs lognormal (median 128,
    at most 512). With `rate` infinite everyone waits from t=0, so the pool, not the
    arrivals, bounds concurrency; otherwise Poisson arrivals at `rate` per second."""
    return shared_system_prompts(
        num_requests, num_prompts=6, system_lens=(1500, 3000, 5000), user_len=(500, 3000),
        output_median=128, output_max=512, rate=rate, seed=seed).requests


def resident_blocks(config: KVCacheConfig, num_tokens: int) -> int:
    """Blocks a lone request of `num_tokens` computed tokens holds (all groups), decoding."""
    return sum(g.spec.num_resident_blocks(num_tokens, num_tokens + 1) for g in config.groups)


@dataclass
class LayoutRun:
    """One layout's replay and what the step hook saw."""

    name: str
    config: KVCacheConfig
    sim: SimResult | None = None
    running: list[int] = field(default_factory=list)
    preempting: list[bool] = field(default_factory=list)
    blocks_full: list[int] = field(default_factory=list)  # in use, full-attention groups
    blocks_sliding: list[int] = field(default_factory=list)  # in use, windowed groups
    # request id -> [(tokens in its context after this step, blocks it holds)]
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs over every layer slot."""
        return self.config.bytes_per_block

    def mib_per_running(self) -> np.ndarray:
        """Per step, MiB of pages in use divided by running requests (shared pages once)."""
        run = np.maximum(np.asarray(self.running), 1)
        used = np.asarray(self.blocks_full) + np.asarray(self.blocks_sliding)
        return used * self.bytes_per_block / MiB / run

    @property
    def max_running_no_preemption(self) -> int:
        """Most requests running at a step that preempted nobody."""
        return max((r for r, p in zip(self.running, self.preempting, strict=True) if not p),
                   default=0)

    @property
    def mean_running(self) -> float:
        """Mean running requests over steps."""
        return float(np.mean(self.running)) if self.running else 0.0


def run_layout(name: str, layer_specs: Sequence[KVCacheSpec], memory_bytes: int,
               specs: Sequence[RequestSpec], sample_ids: Sequence[str],
               scheduler_config: SchedulerConfig) -> LayoutRun:
    """Replay the workload on one layout and record per-step memory and concurrency."""
    config = make_kv_cache_config(layer_specs, memory_bytes=memory_bytes)
    run = LayoutRun(name, config)
    full_groups = [g for g, group in enumerate(config.groups) if group.spec.sliding_window is None]
    sliding_groups = [g for g, group in enumerate(config.groups)
                      if group.spec.sliding_window is not None]
    wanted = set(sample_ids)

    def on_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
        manager = scheduler.manager
        in_use = manager.blocks_in_use_by_group()
        run.running.append(len(scheduler.running))
        run.preempting.append(bool(output.preempted))
        run.blocks_full.append(sum(in_use[g] for g in full_groups))
        run.blocks_sliding.append(sum(in_use[g] for g in sliding_groups))
        for item in output.scheduled:
            rid = item.request.request_id
            if rid in wanted:
                held = sum(manager.num_resident_blocks(rid))
                run.samples.setdefault(rid, []).append((item.start + item.num_new_tokens, held))

    t0 = time.perf_counter()
    run.sim = simulate(list(specs), config, scheduler_config=scheduler_config, on_step=on_step)
    run.wall_s = time.perf_counter() - t0
    return run


def _sample_cells(r: LayoutRun, rid: str) -> str:
    pts = r.samples.get(rid)
    if not pts:
        return "-"
    peak = max(p[1] for p in pts)
    return (f"{pts[-1][1]:,} blk = {pts[-1][1] * r.bytes_per_block / MiB:,.1f} MiB "
            f"(peak {peak * r.bytes_per_block / MiB:,.1f})")


def results_table(saturated: Sequence[LayoutRun], steady: Sequence[LayoutRun],
                  specs: Sequence[RequestSpec], steady_specs: Sequence[RequestSpec],
                  sample_ids: Sequence[str], budget: int, rate: float) -> Table:
    """The comparison table: layout, memory per request, concurrency, prefix hits."""
    t = Table(title=f"Gemma-3-like hybrid vs all-full attention, same budget "
              f"({budget / MiB:,.0f} MiB of pages)")
    t.add_column("")
    for r in saturated:
        t.add_column(r.name, justify="right")
    plens = [len(s.prompt_token_ids) for s in specs]
    probe = int(np.median(plens)) + 128
    by_id = {s.request_id: s for s in specs}

    def row(label: str, cells: Sequence[str], end_section: bool = False) -> None:
        t.add_row(label, *cells, end_section=end_section)

    row("groups: layers (W = windowed, F = full)", [
        " ".join(f"{len(g.layer_ids)}{'W' if g.spec.sliding_window else 'F'}"
                 for g in r.config.groups) for r in saturated])
    row("slots / padding layers",
        [f"{r.config.num_slots} / {r.config.num_padding_layers}" for r in saturated])
    row("KiB per block id", [f"{r.bytes_per_block / 1024:,.0f}" for r in saturated])
    row("blocks in the pool", [f"{r.config.num_blocks - 1:,}" for r in saturated])
    row(f"blocks (MiB) held by one {probe}-token request", [
        f"{resident_blocks(r.config, probe):,} "
        f"({resident_blocks(r.config, probe) * r.bytes_per_block / MiB:,.1f})" for r in saturated])
    row("  such requests the pool holds", [
        f"{(r.config.num_blocks - 1) // resident_blocks(r.config, probe):,}" for r in saturated],
        end_section=True)
    row(f"[b]saturated[/]: {len(specs)} requests all waiting at t=0", [""] * len(saturated))
    for rid in sample_ids:
        spec = by_id[rid]
        row(f"  {rid} ({len(spec.prompt_token_ids)}+{spec.max_tokens} tok) held at its end",
            [_sample_cells(r, rid) for r in saturated])
    row("  mean MiB per running request", [f"{np.mean(r.mib_per_running()):,.1f}" for r in saturated])
    row("  max running without preemption", [f"{r.max_running_no_preemption}" for r in saturated])
    row("  mean running", [f"{r.mean_running:.1f}" for r in saturated])
    row("  preemptions", [f"{r.sim.preemptions}" if r.sim else "-" for r in saturated])
    row("  steps to drain", [f"{r.sim.steps:,}" if r.sim else "-" for r in saturated])
    row("  prefix hit rate", [f"{r.sim.hit_rate:.1%}" if r.sim else "-" for r in saturated])
    row("  evictions", [f"{r.sim.evictions:,}" if r.sim else "-" for r in saturated],
        end_section=True)
    row(f"[b]steady[/]: {len(steady_specs)} requests, Poisson {rate:g}/s", [""] * len(steady))
    row("  mean / max running", [f"{r.mean_running:.1f} / {max(r.running, default=0)}"
                                 for r in steady])
    row("  preemptions", [f"{r.sim.preemptions}" if r.sim else "-" for r in steady])
    row("  prefix hit rate", [f"{r.sim.hit_rate:.1%}" if r.sim else "-" for r in steady])
    row("  evictions", [f"{r.sim.evictions:,}" if r.sim else "-" for r in steady],
        end_section=True)
    row("replay wall s, saturated + steady (this CPU)",
        [f"{a.wall_s:.1f} + {b.wall_s:.1f}" for a, b in zip(saturated, steady, strict=True)])
    ideal, ideal_s = ideal_hit_tokens(specs), ideal_hit_tokens(steady_specs)
    t.caption = (f"Prompts {min(plens)}..{max(plens)} tokens (median {int(np.median(plens))}), "
                 "6 shared system prompts of 1.5k/3k/5k tokens. Ideal hit rate (infinite "
                 f"cache): saturated {ideal.rate:.1%}, steady {ideal_s.rate:.1%} "
                 f"(block-rounded {ideal_hit_tokens(specs, BLOCK_SIZE).rate:.1%} / "
                 f"{ideal_hit_tokens(steady_specs, BLOCK_SIZE).rate:.1%}).")
    return t


def plot(saturated: Sequence[LayoutRun], steady: Sequence[LayoutRun], sample_ids: Sequence[str],
         path: Path) -> None:
    """Four panels: sample requests' memory vs their context, mean memory per running
    request and running requests per step (saturated), concurrency and hit rates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    styles = ["-", "--", ":", "-."]
    ax = axes[0, 0]
    for k, r in enumerate(saturated):
        for j, rid in enumerate(sample_ids):
            pts = r.samples.get(rid)
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] * r.bytes_per_block / MiB for p in pts],
                    color=colors[k % len(colors)], linestyle=styles[j % len(styles)],
                    label=r.name if j == 0 else None)
    ax.set_xlabel("tokens in the request's context")
    ax.set_ylabel("MiB of pages the request holds")
    ax.set_title(f"{len(sample_ids)} sample requests (line style = request)")
    ax.legend(fontsize=8)
    ax = axes[0, 1]
    for k, r in enumerate(saturated):
        ax.plot(r.mib_per_running(), color=colors[k % len(colors)], label=r.name, lw=0.8)
    ax.set_xlabel("engine step (saturated)")
    ax.set_ylabel("MiB in use / running requests")
    ax.set_title("Mean memory per running request")
    ax.legend(fontsize=8)
    ax = axes[1, 0]
    for k, r in enumerate(saturated):
        ax.plot(r.running, color=colors[k % len(colors)], label=r.name, lw=0.8)
    ax.set_xlabel("engine step (saturated)")
    ax.set_ylabel("running requests")
    ax.set_title("Concurrency, same byte budget")
    ax.legend(fontsize=8)
    ax = axes[1, 1]
    x = np.arange(len(saturated))
    ax.bar(x - 0.2, [r.mean_running for r in saturated], 0.4, label="mean running")
    ax.bar(x + 0.2, [r.max_running_no_preemption for r in saturated], 0.4,
           label="max running, no preemption")
    ax.set_xticks(x, [r.name for r in saturated], fontsize=8)
    ax.set_ylabel("requests (saturated)")
    ax2 = ax.twinx()
    ax2.plot(x, [100 * r.sim.hit_rate if r.sim else 0 for r in saturated], "ko-",
             label="hit rate %, saturated")
    ax2.plot(x, [100 * r.sim.hit_rate if r.sim else 0 for r in steady], "ks--",
             label="hit rate %, steady")
    ax2.set_ylim(0, 100)
    ax2.set_ylabel("prefix hit rate (%)")
    ax.set_title("Concurrency and prefix hits")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    fig.suptitle("Gemma-3-like hybrid (every 6th layer full, block 16) vs all-full attention, "
                 "same byte budget")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller workload")
    ap.add_argument("--requests", type=int, default=None, help="requests per phase")
    ap.add_argument("--rate", type=float, default=1.5, help="arrivals per second, steady phase")
    ap.add_argument("--budget-mib", type=int, default=1024, help="MiB of pages per layout")
    ap.add_argument("--out", type=Path, default=FIGURE, help="where to write the plot")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    console = Console(width=160)
    n = args.requests or (40 if args.quick else 100)
    specs = make_workload(n)
    steady_specs = make_workload(n, rate=args.rate, seed=1)
    sample_ids = [specs[i].request_id for i in (0, n // 3, 2 * n // 3)]
    budget = args.budget_mib * MiB
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)
    layouts = (("hybrid W=512", gemma3_like(512)), ("hybrid W=1024", gemma3_like(1024)),
               ("all full", all_full()))
    saturated = [run_layout(name, ls, budget, specs, sample_ids, sched) for name, ls in layouts]
    steady = [run_layout(name, ls, budget, steady_specs, (), sched) for name, ls in layouts]
    console.print(results_table(saturated, steady, specs, steady_specs, sample_ids, budget,
                                args.rate))
    plot(saturated, steady, sample_ids, args.out)
    console.print(f"plot written to {args.out}; total wall time {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
