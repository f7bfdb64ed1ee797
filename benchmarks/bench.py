"""``kvstore bench``: the prefix-reuse sweep on a workload, as a table, plots, JSON and CSV.

For every pool size (a KV byte budget for a model shape) and every policy (naive
reservation, paged, full-block prefix caching, partial hits, hybrid layout) it replays
the workload through the real scheduler and cache manager and reports hit rates against
the unbounded replay and the ideal, the cost (evictions, preemptions, recomputed
tokens, steps) and the memory (peak in use, reserved but idle). On a Mooncake trace it
also replays the hash-level hit-rate-vs-capacity curve next to the paper's points.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.benchmarks.output import pyplot, write_csv, write_json
from kvstore.benchmarks.sweep import (
    DEFAULT_POLICIES,
    MODEL_SHAPES,
    POLICIES,
    SweepResult,
    format_bytes,
    parse_pool_sizes,
    run_sweep,
)
from kvstore.benchmarks.workloads import WORKLOADS, Workload, make_workload
from kvstore.engine.scheduler import SchedulerConfig

__all__ = [
    "TRACE_WORKLOADS",
    "DEFAULT_TRACE_LIMIT",
    "load_bench_workload",
    "add_bench_parser",
    "run_bench",
    "print_table",
    "write_figures",
    "markdown_tables",
    "main",
]

# CLI name -> trace_file key.
TRACE_WORKLOADS: dict[str, str] = {
    "mooncake-synthetic": "mooncake_synthetic",
    "mooncake-conversation": "mooncake_conversation",
    "azure-code": "azure_code",
    "azure-conv": "azure_conv",
}
# Requests taken from a trace when --limit is not given (token-level replay of a whole
# trace takes hours).
DEFAULT_TRACE_LIMIT = 200
QUICK_LIMIT = 60
QUICK_POINTS = 4


def load_bench_workload(name: str, trace: str | Path | None = None, limit: int | None = None,
                        seed: int = 0) -> Workload:
    """A built-in workload (first `limit` requests by arrival) or a trace's first `limit`
    rows (default ``DEFAULT_TRACE_LIMIT``) as a token-level workload."""
    from kvstore.benchmarks import traces

    if name in TRACE_WORKLOADS:
        path = Path(trace) if trace else traces.trace_file(TRACE_WORKLOADS[name])
        n = limit if limit is not None else DEFAULT_TRACE_LIMIT
        if name.startswith("mooncake"):
            return traces.mooncake_to_workload(path, limit=n, seed=seed, name=name)
        return traces.load_azure(path, limit=n, seed=seed, name=name)
    if trace:
        raise ValueError(f"--trace only applies to trace workloads ({', '.join(TRACE_WORKLOADS)})")
    w = make_workload(name, seed=seed)
    if limit is not None and limit < len(w.requests):
        w = Workload(w.name, w.requests[:limit], f"{w.description}; first {limit} requests")
    return w


# ------------------------------------------------------------------------------ output


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _count(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


def print_table(result: SweepResult, console: Any) -> None:
    """The sweep as a rich table, a row per (budget, policy)."""
    from rich.table import Table

    m = result.meta
    t = Table(title=f"{m['workload']} on {m['model_shape']} (block {m['block_size']}): "
                    f"ideal hit {_pct(m['ideal_token_hit_rate'])} token / "
                    f"{_pct(m['ideal_block_hit_rate'])} block", show_lines=False)
    for col, just in (("KV budget", "right"), ("policy", "left"), ("blocks", "right"),
                      ("hit", "right"), ("vs unbnd", "right"), ("vs ideal", "right"),
                      ("partial tok", "right"), ("evict", "right"), ("preempt", "right"),
                      ("recompute", "right"), ("computed", "right"), ("steps", "right"),
                      ("peak KV", "right"), ("idle KV", "right")):
        t.add_column(col, justify=just)
    last = None
    for r in result.rows:
        budget = ""
        if r["point"] != last:
            if last is not None:
                t.add_section()
            budget = r["budget_label"]
        last = r["point"]
        if not r.get("feasible"):
            t.add_row(budget, r["policy"], str(r.get("num_blocks", "-")),
                      *(["-"] * 10), "[red]does not fit[/red]")
            continue
        caching = POLICIES[r["policy"]].enable_caching
        t.add_row(
            budget, r["policy"], str(r["num_blocks"]),
            _pct(r["prompt_hit_rate"]) if caching else "-",
            _pct(r["vs_unbounded"]), _pct(r["vs_ideal"]),
            _count(r["partial_hit_tokens"]) if caching else "-",
            _count(r["evictions"]), str(r["preemptions"]), _count(r["recomputed_tokens"]),
            _count(r["computed_tokens"]), str(r["steps"]), format_bytes(r["peak_kv_bytes"]),
            format_bytes(r["mean_idle_bytes"]))
    console.print(t)


def _series(result: SweepResult, keys: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for r in result.rows:
        if not r.get("feasible"):
            continue
        row = {"policy": r["policy"], "budget_bytes": r["budget_bytes"],
               "budget_gib": r["budget_bytes"] / 2**30}
        row.update({k: r.get(k) for k in keys})
        out.append(row)
    return out


_STYLE = {
    "naive": ("tab:red", "s"), "paged": ("tab:gray", "o"), "prefix": ("tab:blue", "^"),
    "partial": ("tab:green", "v"), "hybrid": ("tab:purple", "D"),
}


def _plot_metric(ax: Any, data: Sequence[dict[str, Any]], key: str, policies: Sequence[str],
                 scale: float = 1.0) -> None:
    for p in policies:
        pts = [(d["budget_gib"], d[key]) for d in data if d["policy"] == p and d[key] is not None]
        if not pts:
            continue
        color, marker = _STYLE.get(p, (None, "o"))
        ax.plot([x for x, _ in pts], [y / scale for _, y in pts], marker=marker, color=color,
                label=p, ms=5)
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.grid(True, which="both", alpha=0.3)


def write_figures(result: SweepResult, out: Path) -> list[Path]:
    """The sweep's figures as PNG, each with a JSON and a CSV of what it plots."""
    plt = pyplot()

    m = result.meta
    policies = list(m["policies"])
    caching = [p for p in policies if POLICIES[p].enable_caching]
    sub = f"{m['workload']}, {m['model_shape']}, block {m['block_size']}"
    written: list[Path] = []

    def save(fig: Any, name: str, data: list[dict[str, Any]], extra: dict[str, Any]) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)
        write_csv(out / f"{name}.csv", data)
        write_json(out / f"{name}.json", {"figure": name, **extra, "rows": data})
        written.extend(out / f"{name}.{ext}" for ext in ("png", "json", "csv"))

    # 1. Hit rate against pool size, with the unbounded replays and the ideal bounds.
    data = _series(result, ("prompt_hit_rate", "hit_rate", "vs_unbounded", "vs_ideal",
                            "partial_hit_tokens"))
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_metric(ax, data, "prompt_hit_rate", caching)
    ax.axhline(m["ideal_token_hit_rate"], color="k", ls="--", lw=1, label="ideal (token)")
    ax.axhline(m["ideal_block_hit_rate"], color="k", ls=":", lw=1, label="ideal (whole blocks)")
    ax.set_xlabel("KV budget (GiB, log; smaller to the right)")
    ax.set_ylabel("prompt tokens served from cache (first admission)")
    ax.set_title(f"Prefix hit rate vs KV memory\n{sub}")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    _plot_metric(ax2, data, "partial_hit_tokens", [p for p in caching if POLICIES[p].enable_partial_hits])
    ax2.set_xlabel("KV budget (GiB, log)")
    ax2.set_ylabel("tokens reused by partial hits (copy-on-write)")
    ax2.set_title("Partial-hit reuse")
    ax2.legend(fontsize=8)
    save(fig, "hit_rate_vs_pool", data, {
        "ideal_token_hit_rate": m["ideal_token_hit_rate"],
        "ideal_block_hit_rate": m["ideal_block_hit_rate"],
        "unbounded": {p: r.get("prompt_hit_rate") for p, r in result.unbounded.items()}})

    # 2. What it costs: work, recompute, preemptions, evictions.
    keys = ("computed_tokens", "recomputed_tokens", "preemptions", "evictions")
    data = _series(result, keys + ("saved_tokens",))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    titles = ("tokens computed (total work)", "tokens recomputed after preemption",
              "preemptions", "cache evictions")
    for ax, key, title in zip(axes.flat, keys, titles, strict=True):
        _plot_metric(ax, data, key, policies)
        ax.set_title(title)
        ax.set_xlabel("KV budget (GiB, log)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Cost vs KV memory — {sub}")
    save(fig, "cost_vs_pool", data, {})

    # 3. Paged vs naive reservation: steps to finish, idle reserved memory, peak memory.
    keys = ("steps", "mean_idle_bytes", "peak_kv_bytes")
    data = _series(result, keys + ("mean_idle_fraction", "peak_idle_bytes", "finish_time"))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    _plot_metric(axes[0], data, "steps", policies)
    axes[0].set_title("steps to finish the workload")
    axes[0].set_yscale("log")
    _plot_metric(axes[1], [d for d in data if d["mean_idle_bytes"] > 0], "mean_idle_bytes",
                 policies, scale=2**20)
    axes[1].set_title("reserved but idle KV, mean per step (MiB, log)")
    axes[1].set_yscale("log")
    _plot_metric(axes[2], data, "peak_kv_bytes", policies, scale=2**30)
    axes[2].set_title("peak KV in use (GiB)")
    for ax in axes:
        ax.set_xlabel("KV budget (GiB, log)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Paged vs naive reservation — {sub}")
    save(fig, "paged_vs_naive", data, {})
    return written


def _size(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def markdown_tables(result: SweepResult) -> str:
    """The sweep's two summary tables (hit rate and cost; paged vs naive) as Markdown."""
    by = {(r["policy"], r["point"]): r for r in result.rows if r.get("feasible")}
    points = sorted({r["point"] for r in result.rows})
    caching = [p for p in result.meta["policies"] if POLICIES[p].enable_caching]
    lines = ["| KV budget | blocks | " + " | ".join(f"{p} hit" for p in caching)
             + " | vs ideal | partial-hit tokens | evictions | preemptions | recomputed | computed |",
             "|---" * (8 + len(caching)) + "|"]
    show = [p for p in ("paged", "partial") if p in result.meta["policies"]]
    for i in points:
        rows = [by.get((p, i)) for p in result.meta["policies"]]
        first = next((r for r in rows if r), None)
        if first is None:
            continue
        ref = by.get(("partial", i)) or by.get((caching[0], i)) if caching else None

        def cell(key: str, fmt: str = "{:,}", pols: Sequence[str] = show, i: int = i) -> str:
            vals = [by.get((p, i)) for p in pols]
            return " / ".join("-" if v is None else fmt.format(v[key]) for v in vals)

        blocks = " / ".join(str(by[(p, i)]["num_blocks"]) for p in ("partial", "hybrid")
                            if (p, i) in by) or str(first["num_blocks"])
        hits = " | ".join("-" if (p, i) not in by else f"{100 * by[(p, i)]['prompt_hit_rate']:.1f}%"
                          for p in caching)
        lines.append(
            f"| {first['budget_label']} | {blocks} | {hits} | "
            f"{_pct(ref['vs_ideal']) if ref else '-'} | "
            f"{ref['partial_hit_tokens'] if ref else '-'} | {ref['evictions'] if ref else '-'} | "
            f"{cell('preemptions')} | {cell('recomputed_tokens')} | {cell('computed_tokens')} |")
    lines.append("")
    lines.append(f"Blocks: partial / hybrid layouts. Preemptions, recomputed and computed: "
                 f"{' / '.join(show)}. vs ideal, partial-hit tokens, evictions: partial.")
    lines.append("")
    lines += ["| KV budget | steps naive | steps paged | steps partial | naive / paged | idle reserved "
              "naive (mean, % of pool) | idle reserved paged | peak in use naive / paged / partial "
              "| computed naive / paged |",
              "|---" * 9 + "|"]
    for i in points:
        n, pa, pt = by.get(("naive", i)), by.get(("paged", i)), by.get(("partial", i))
        if not (n and pa and pt):
            continue
        lines.append(
            f"| {pt['budget_label']} | {n['steps']} | {pa['steps']} | {pt['steps']} | "
            f"{n['steps'] / pa['steps']:.2f} | {_size(n['mean_idle_bytes'])} "
            f"({100 * n['mean_idle_fraction']:.1f}%) | {_size(pa['mean_idle_bytes'])} "
            f"({100 * pa['mean_idle_fraction']:.2f}%) | {_size(n['peak_kv_bytes'])} / "
            f"{_size(pa['peak_kv_bytes'])} / {_size(pt['peak_kv_bytes'])} | "
            f"{n['computed_tokens']:,} / {pa['computed_tokens']:,} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- CLI


def add_bench_parser(subparsers: Any) -> None:
    """Register ``bench`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "bench", help="prefix reuse and its cost against KV memory (sweep, table, plots)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    _add_arguments(p)
    p.set_defaults(func=run_bench)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mixed_default",
                   choices=sorted(WORKLOADS) + list(TRACE_WORKLOADS),
                   help="built-in workload or trace (default: mixed_default)")
    p.add_argument("--trace", metavar="PATH", help="trace file (default: the shared traces folder)")
    p.add_argument("--limit", type=int, metavar="N",
                   help=f"first N requests (traces default to {DEFAULT_TRACE_LIMIT})")
    p.add_argument("--model-shape", default="llama-3-8b", choices=sorted(MODEL_SHAPES),
                   help="model whose KV bytes per token size the pools (default: llama-3-8b)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    p.add_argument("--pool-sizes", metavar="LIST",
                   help="comma list of KV budgets (1GiB,512MiB) or block counts of the all-full "
                        "layout (4000,2000); default: from everything-fits to the largest request")
    p.add_argument("--points", type=int, default=None,
                   help="number of default pool sizes (default 10, --quick 4)")
    p.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                   help=f"comma list of {', '.join(POLICIES)} (default: all)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_POINTS} pool sizes, the first {QUICK_LIMIT} requests, "
                        "paper capacities only for the Mooncake curve")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: CPU count, at most 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-mooncake-curve", action="store_true",
                   help="on a Mooncake workload, skip the hash-level hit-rate-vs-capacity replay")
    p.add_argument("--out", default="results/bench", help="output folder (default results/bench)")


def run_bench(args: argparse.Namespace) -> int:
    """Run the sweep the arguments describe; print the table, write plots, JSON and CSV."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console()
    if not console.is_terminal:  # piped or captured: room for the whole table
        console = Console(width=max(console.width, 150))
    t0 = time.perf_counter()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        console.print(f"[red]unknown policies {unknown}; known: {', '.join(POLICIES)}[/red]")
        return 2
    if args.block_size < 1:
        console.print("[red]--block-size must be >= 1[/red]")
        return 2
    shape = MODEL_SHAPES[args.model_shape]
    limit = args.limit
    if args.quick and limit is None:
        limit = QUICK_LIMIT
    try:
        workload = load_bench_workload(args.workload, args.trace, limit, args.seed)
        budgets = (parse_pool_sizes(args.pool_sizes, shape.block_bytes(args.block_size))
                   if args.pool_sizes else None)
    except (ValueError, FileNotFoundError) as e:
        console.print(f"[red]{e}[/red]")
        return 2
    if not workload.requests:
        console.print("[red]the workload has no requests[/red]")
        return 2
    points = args.points if args.points is not None else (QUICK_POINTS if args.quick else 10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]{workload.name}[/bold]: {workload.description}")
    console.print(f"{len(workload.requests)} requests, {workload.num_prompt_tokens:,} prompt + "
                  f"{workload.num_output_tokens:,} output tokens; {shape.describe()}")
    sched = SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs)
    jobs = args.jobs if args.jobs is not None else min(4, os.cpu_count() or 1)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                  transient=False) as progress:
        task = progress.add_task("sweep", total=None)

        def on_start(n: int) -> None:
            progress.update(task, total=n)

        def on_done(t: Any, row: dict[str, Any]) -> None:
            where = "unbounded" if t.budget is None else format_bytes(t.budget)
            progress.update(task, advance=1, description=f"{t.policy:>7} @ {where:>9}")

        result = run_sweep(workload, shape=shape, block_size=args.block_size, budgets=budgets,
                           num_points=points, policies=policies, scheduler_config=sched,
                           jobs=jobs, progress=on_done, on_start=on_start)
    print_table(result, console)
    _print_findings(result, console)
    write_json(out / "sweep.json", result.as_dict())
    write_csv(out / "sweep.csv", result.rows + list(result.unbounded.values()))
    written = write_figures(result, out)
    (out / "tables.md").write_text(markdown_tables(result), encoding="utf-8")
    if args.workload.startswith("mooncake") and not args.no_mooncake_curve:
        from kvstore.benchmarks.mooncake_replay import run_mooncake_replay

        name = args.workload.split("-", 1)[1]
        paths = {name: args.trace} if args.trace else None
        run_mooncake_replay(out, [name], limit=args.limit, trace_paths=paths, quick=args.quick,
                            log=console.print)
        written += [out / f"mooncake_hit_rate.{ext}" for ext in ("png", "json", "csv")]
    console.print(f"wrote {len(written) + 3} files to {out}/ (sweep.json, sweep.csv, tables.md, "
                  f"{', '.join(sorted({p.name for p in written if p.suffix == '.png'}))} ...) "
                  f"in {time.perf_counter() - t0:.1f}s with {result.meta['jobs']} jobs")
    return 0


def _print_findings(result: SweepResult, console: Any) -> None:
    f = result.findings
    for name in result.meta["policies"]:
        info = f.get(name)
        if not info:
            continue
        parts = [f"first preemption at {info['first_preemption']['label'] or 'none'}",
                 f"recompute >= 25% of work at {info['thrash']['label'] or 'none'}"]
        if "unbounded_prompt_hit_rate" in info:
            parts = [f"unbounded hit {_pct(info['unbounded_prompt_hit_rate'])}",
                     f"hit < 95% of unbounded at {info['hit_below_95pct']['label'] or 'none'}",
                     f"< 50% at {info['hit_below_50pct']['label'] or 'none'}",
                     f"recompute > hits at {info['recompute_exceeds_hits']['label'] or 'none'}",
                     *parts]
        console.print(f"[bold]{name}[/bold]: " + "; ".join(parts))
    for c in f.get("naive_vs_paged", []):
        console.print(
            f"naive vs paged @ {c['budget_label']}: steps {c['steps_naive']} vs "
            f"{c['steps_paged']} (x{c['steps_ratio']:.2f}), idle reserved "
            f"{format_bytes(c['mean_idle_bytes_naive'])} vs "
            f"{format_bytes(c['mean_idle_bytes_paged'])} per step, computed "
            f"{_count(c['computed_naive'])} vs {_count(c['computed_paged'])} tokens")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.bench [options]``: the same as ``kvstore bench``."""
    parser = argparse.ArgumentParser(prog="kvstore")
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    argv = list(argv) if argv is not None else None
    import sys

    if argv is None:
        argv = sys.argv[1:]
    if not argv or argv[0] != "bench":
        argv = ["bench", *argv]
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
