"""``kvstore bench``: the parser of every benchmark question, and the sweep's table, headline,
figures, JSON and CSV (docs/benchmarks.md).

For every pool size (a KV byte budget for a model shape) and every policy (naive
reservation, paged, full-block prefix caching, partial hits, hybrid layout) it replays
the workload through the real scheduler and cache manager and reports hit rates against
the unbounded replay and the ideal, the cost (evictions, preemptions, recomputed
tokens, steps) and the memory (peak in use, reserved but idle).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from kvstore.benchmarks import output, sweep, traces
from kvstore.benchmarks.output import RunInfo, name_list, non_negative_int, out_file, positive_int
from kvstore.benchmarks.simulator import StepTime, TierOptions, check_store, parse_mem_store
from kvstore.benchmarks.sweep import MODEL_SHAPES, POLICIES, SweepResult, SweepRow, format_bytes, policy_named
from kvstore.benchmarks.workloads import WORKLOADS, Workload, make_workload
from kvstore.engine.scheduler import SchedulerConfig
from kvstore.eviction import EVICTION_POLICIES
from kvstore.specs import DTYPE_ITEMSIZE, dtype_name

TRACE_WORKLOADS: dict[str, str] = {  # CLI name -> trace_file key
    "mooncake-synthetic": "mooncake_synthetic",
    "mooncake-conversation": "mooncake_conversation",
    "azure-code": "azure_code",
    "azure-conv": "azure_conv",
}
DEFAULT_TRACE_LIMIT = 200  # a token-level replay of a whole trace takes hours
QUICK_LIMIT = 60
QUICK_POINTS = 4
DEFAULT_POINTS = 10
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_NOTHING_FITS = 1


def load_bench_workload(name: str, trace: str | Path | None = None, limit: int | None = None,
                        seed: int = 0) -> Workload:
    """A built-in workload or a trace (FileNotFoundError if missing), its first `limit` requests."""
    if name in TRACE_WORKLOADS:
        path = Path(trace) if trace else traces.locate_trace(TRACE_WORKLOADS[name])
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


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _count(n: float) -> str:
    """At most 5 characters: ``9999``, ``12.3k``, ``123k``, ``1.23M``."""
    if n >= 1e6:
        return f"{n / 1e6:.2f}M"
    if n >= 1e5:
        return f"{n / 1e3:.0f}k"
    return f"{n / 1e3:.1f}k" if n >= 1e4 else f"{n:.0f}"


def _seconds(x: float | None) -> str:
    """At most 6 characters: ``0.52s``, ``12.3s``, ``1234s``, ``1.2e5s``."""
    if x is None:
        return "-"
    return f"{x:.2f}s" if x < 10 else f"{x:.1f}s" if x < 100 else f"{x:.0f}s" if x < 1e4 else f"{x:.1e}s"


# The table's columns: (name, name in the narrow table or None); all but policy right-aligned.
# The narrow table leaves out _DROP_ORDER's columns, in order, until it fits TABLE_WIDTH; the
# tier columns appear only in a sweep with tiers.
_COLUMNS: tuple[tuple[str, str | None], ...] = (
    ("KV budget", "KV budget"), ("policy", "policy"), ("blocks", None), ("hit", "hit"),
    ("device", None), ("host", "host"), ("store", "store"), ("total hit", None),
    ("vs unbnd", "vs unb"), ("vs ideal", None), ("partial tok", None), ("evict", "evict"),
    ("preempt", "preempt"), ("recompute", "recomp"), ("computed", "computed"), ("steps", "steps"),
    ("conc", "conc"), ("time", "time"), ("peak KV", "peak KV"), ("idle KV", None),
)
_TIER_COLUMNS = frozenset({"device", "host", "store", "total hit"})
_DROP_ORDER = ("peak KV", "vs unbnd", "recompute", "evict", "store", "preempt")
TABLE_WIDTH = 80


def table_legend(result: SweepResult) -> str:
    """What the narrow table's columns mean."""
    tiers = bool(result.meta.tiers)
    hit = ("prompt tokens served at first admission, from the device pool or the tiers; host, "
           "store: the part of it from the host tier and the store; NAME+tiers: NAME with the "
           "tiers below its pool" if tiers else "prompt tokens served from the cache at first "
           "admission; vs unb: hit tokens over the unbounded replay's")
    return (f"hit: {hit}; evict: cached blocks reused for new content; preempt: preemptions; "
            "recomp: tokens computed again after a preemption; computed: all tokens computed; "
            "steps: scheduler steps to finish; conc: requests running per step (mean); time: "
            f"the steps under the step-time model ({result.meta.step_time.describe()}, "
            "--step-time); peak KV: most KV memory in use; k/M: thousands/millions; -: not "
            "applicable. --wide adds blocks, vs ideal, partial-hit tokens and idle reserved KV"
            + (", the device's part of hit and the hit rate over all admissions." if tiers else ".")
            + (" no fit: the pool cannot hold some request."
               if not all(r.feasible for r in result.rows) else ""))


def _cells(r: SweepRow, wide: bool) -> list[str]:
    """Every column's cell of one row, in ``_COLUMNS`` order."""
    budget = format_bytes(r.budget_bytes or 0)
    m = r.metrics
    if m is None:
        return [budget, r.policy, str(r.num_blocks), *(["-"] * (len(_COLUMNS) - 4)),
                "[red]does not fit[/red]" if wide else "[red]no fit[/red]"]
    policy = policy_named(r.policy)
    caching = policy.enable_caching

    def share(n: int, shown: bool) -> str:
        return _pct(n / m.prompt_tokens if m.prompt_tokens else 0.0) if shown else "-"

    return [budget, r.policy, str(r.num_blocks), _pct(m.prompt_hit_rate if caching else None),
            share(m.prompt_device_hit_tokens, caching), share(m.prompt_host_hit_tokens, policy.tiered),
            share(m.prompt_store_hit_tokens, policy.tiered), _pct(m.total_hit_rate if caching else None),
            _pct(r.vs_unbounded), _pct(r.vs_ideal), _count(m.partial_hit_tokens) if caching else "-",
            _count(m.evictions), str(m.preemptions), _count(m.recomputed_tokens),
            _count(m.computed_tokens), str(m.steps), f"{m.mean_running:.1f}",
            _seconds(r.model_time_s), format_bytes(m.peak_kv_bytes), format_bytes(m.mean_idle_bytes)]


def _table(result: SweepResult, wide: bool, drop: Sequence[str] = ()) -> Any:
    from rich import box
    from rich.table import Table

    m = result.meta
    parts = [f"{m.workload} on {m.model_shape} (block {m.block_size})",
             f"ideal hit {_pct(m.ideal_token_hit_rate)} token / {_pct(m.ideal_block_hit_rate)} block"]
    if m.tiers:
        parts.append("tiers: " + TierOptions(**m.tiers).describe())
    # Narrow, a phrase a line (the console would wrap it mid-phrase).
    title = "\n".join(parts) if not wide else f"{parts[0]}: " + "; ".join(parts[1:])
    if wide:
        t = Table(title=title, show_lines=False)
    else:  # no borders or padding: one space between columns
        t = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 0), show_edge=False)
    keep = [i for i, (name, narrow) in enumerate(_COLUMNS)
            if (m.tiers or name not in _TIER_COLUMNS) and name not in drop and (wide or narrow)]
    for i in keep:
        name, narrow = _COLUMNS[i]
        t.add_column(name if wide else narrow or name, no_wrap=True,
                     justify="left" if name == "policy" else "right")
    last = None
    for r in result.rows:
        cells = _cells(r, wide)
        if r.point != last and last is not None:
            t.add_section()
        elif r.point == last:
            cells[0] = ""
        last = r.point
        t.add_row(*(cells[i] for i in keep))
    return t


def _render(table: Any, width: int) -> str:
    """`table` as plain text at a console `width`."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None).print(table)
    return buf.getvalue()


def print_table(result: SweepResult, console: Any, wide: bool = False) -> list[str]:
    """Print the sweep's table (narrow: what fits ``TABLE_WIDTH``, and a legend) and the
    per-group table; returns the columns left out."""
    drop: list[str] = []
    while True:
        table = _table(result, wide, drop)
        width = max((len(line.rstrip()) for line in _render(table, 1000).splitlines()[1:]),
                    default=0)
        if wide or width <= TABLE_WIDTH or len(drop) == len(_DROP_ORDER):
            break
        drop.append(_DROP_ORDER[len(drop)])
    if not wide and width > TABLE_WIDTH:
        console.print(f"the table needs {width} columns even without "
                      f"{', '.join(drop)} (long policy names): it is in table.txt only")
        return drop
    shown = console.width
    if wide:  # every column at its natural width, wider than the console if need be
        console.width = max(shown, width)
    console.print(table)
    console.width = shown
    if not wide:
        console.print(table_legend(result), style="dim")
    if (group := _group_table(result)) is not None:
        console.print(group)
    return drop


def _group_table(result: SweepResult) -> Any:
    """What each group kept and evicted, per budget and policy with sliding-window groups
    (and the all-full partial replay); None without such groups."""
    from rich import box
    from rich.table import Table

    rows = [r for r in result.rows if r.metrics is not None and any(
        r.metrics.kept_and_evicted("window"))]
    if not rows:
        return None
    points = {r.point for r in rows}
    full = {r.point: r for r in result.rows  # the all-full reference: partial, LRU
            if r.point in points and r.metrics is not None and r.policy == "partial"}
    t = Table(title="Per group: cached pages kept (mean over steps) and evicted",
              box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    for name in ("budget", "policy", "hit", "full kept", "evicted", "window kept", "evicted"):
        t.add_column(name, justify="left" if name in ("budget", "policy") else "right")
    for r in sorted([*rows, *full.values()], key=lambda r: (r.point, r.policy)):
        m = r.metrics
        assert m is not None
        (full_kept, full_evicted), (window_kept, window_evicted) = (
            m.kept_and_evicted(kind) for kind in ("full", "window"))
        t.add_row(format_bytes(r.budget_bytes or 0), r.policy, _pct(m.prompt_hit_rate),
                  _count(round(full_kept)), _count(full_evicted),
                  _count(round(window_kept)) if r in rows else "-",
                  _count(window_evicted) if r in rows else "-")
    return t


def _markdown(table: Any) -> str:
    """A rich table as Markdown: its title, then its header and rows (markup dropped)."""
    from rich.text import Text

    cols = table.columns
    lines = [str(table.title), "", "| " + " | ".join(str(c.header) for c in cols) + " |",
             "|" + "|".join("---:" if c.justify == "right" else "---" for c in cols) + "|"]
    lines += ["| " + " | ".join(Text.from_markup(str(cell)).plain for cell in row) + " |"
              for row in zip(*(c.cells for c in cols), strict=True)]
    return "\n".join(lines) + "\n"


_STYLE = {
    "naive": ("tab:red", "s"), "paged": ("tab:gray", "o"), "prefix": ("tab:blue", "^"),
    "partial": ("tab:green", "v"), "hybrid": ("tab:purple", "D"),
}
# A panel: (metric, title, policies, y scale divisor, log y: plot only positive values).
Panel = tuple[str, str, Sequence[str], float, bool]


def _plot_panels(axes: Sequence[Any], rows: Sequence[dict[str, Any]], panels: Sequence[Panel]) -> None:
    """Each panel's metric against the budget (log x, largest left), a line per policy."""
    for ax, (key, title, policies, scale, log) in zip(axes, panels, strict=True):
        shown = [d for d in rows if not log or (d[key] or 0) > 0]
        for p in policies:
            pts = [(d["budget_bytes"] / 2**30, d[key]) for d in shown
                   if d["policy"] == p and d[key] is not None]
            if pts:
                base = p.removesuffix("+tiers")
                color, marker = _STYLE.get(base, (None, "o"))
                ax.plot([x for x, _ in pts], [y / scale for _, y in pts], marker=marker,
                        color=color, label=p, ms=5, ls="--" if base != p else "-")
        output.mark_x(ax, [d["budget_bytes"] / 2**30 for d in shown], lambda b: format_bytes(b * 2**30))
        ax.invert_xaxis()
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(title)
        ax.set_xlabel("KV budget (GiB, log)")
        if log:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=8)


def write_figures(result: SweepResult, out: Path) -> list[Path]:
    """The sweep's three figures as PNG (what they plot is in ``sweep.csv``)."""
    plt = output.pyplot()
    m = result.meta
    policies = list(m.policies)
    caching = [p for p in policies if POLICIES[p].enable_caching]
    sub = f"{m.workload}, {m.model_shape}, block {m.block_size}"
    rows = [r.as_dict() for r in result.rows if r.feasible]
    # name: (subplot grid, size, title, panels)
    figures: dict[str, tuple[tuple[int, int], tuple[float, float], str | None, list[Panel]]] = {
        "hit_rate_vs_pool": ((1, 2), (12, 4.5), None, [
            ("prompt_hit_rate", f"Prefix hit rate vs KV memory\n{sub}", caching, 1.0, False),
            ("partial_hit_tokens", "Partial-hit reuse",
             [p for p in caching if POLICIES[p].enable_partial_hits], 1.0, False)]),
        "cost_vs_pool": ((2, 2), (12, 8), f"Cost vs KV memory — {sub}", [
            ("computed_tokens", "tokens computed (total work)", policies, 1.0, False),
            ("recomputed_tokens", "tokens recomputed after preemption", policies, 1.0, False),
            ("preemptions", "preemptions", policies, 1.0, False),
            ("evictions", "cache evictions", policies, 1.0, False)]),
        "paged_vs_naive": ((1, 3), (15, 4.5), f"Paged vs naive reservation — {sub}", [
            ("steps", "steps to finish the workload", policies, 1.0, True),
            ("mean_idle_bytes", "reserved but idle KV, mean per step (MiB, log)", policies,
             2**20, True),
            ("peak_kv_bytes", "peak KV in use (GiB)", policies, 2**30, False)]),
    }
    for name, (grid, size, title, panels) in figures.items():
        fig, axes = plt.subplots(*grid, figsize=size)
        axes = list(axes.flat)
        _plot_panels(axes, rows, panels)
        if title:
            fig.suptitle(title)
        if name == "hit_rate_vs_pool":
            ax, ax2 = axes
            ax.axhline(m.ideal_token_hit_rate, color="k", ls="--", lw=1, label="ideal (token)")
            ax.axhline(m.ideal_block_hit_rate, color="k", ls=":", lw=1, label="ideal (whole blocks)")
            ax.set_xlabel("KV budget (GiB, log; smaller to the right)")
            ax.set_ylabel("prompt tokens served from cache (first admission)")
            ax.set_ylim(0, 1)
            ax.legend(fontsize=8)
            ax2.set_ylabel("tokens reused by partial hits (copy-on-write)")
            if not ax2.lines:
                ax2.set_title("Partial-hit reuse (no partial-hit policy)")
        output.save_figure(fig, out / f"{name}.png")
    return [out / f"{name}.png" for name in figures]


def write_results(result: SweepResult, out: Path, run: RunInfo, figures: bool = True) -> list[Path]:
    """``sweep.json``, ``sweep.csv``, ``tables.md`` (wide and per-group), ``table.txt`` (wide)
    and, with `figures`, the figures."""
    output.write_json(out / "sweep.json", {**result.as_dict(), "run": asdict(run)})
    output.write_csv(out / "sweep.csv", [r.as_dict() for r in [*result.rows, *result.unbounded.values()]])
    table, group = _table(result, wide=True), _group_table(result)
    tables = _markdown(table) + ("" if group is None else "\n" + _markdown(group))
    (out / "tables.md").write_text(tables, encoding="utf-8")
    (out / "table.txt").write_text(_render(table, 400), encoding="utf-8")
    written = [out / "sweep.json", out / "sweep.csv", out / "tables.md", out / "table.txt"]
    return (written + write_figures(result, out)) if figures else written


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type: `parse`, its ValueError as a usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


def _pool_sizes(text: str) -> str:
    sweep.parse_pool_sizes(text, 1)  # the syntax; block counts become bytes once the shape is known
    return text


def _store_spec(text: str, mem: bool = True) -> str:
    """A Valkey URL's syntax, or with `mem` also ``mem`` or ``mem:SIZE``."""
    from kvstore.tiers.valkey_store import parse_store_url, redact_url

    text = text.strip()
    try:
        if not mem or parse_mem_store(text) is False:
            parse_store_url(text)
    except ValueError as e:
        raise ValueError(str(e).replace(text, redact_url(text))
                         + ("; or mem, or mem:SIZE for an in-process store" if mem else "")) from None
    return text


def _step_time(text: str) -> StepTime:
    """``A,B``: a step of n tokens takes A ms + n x B us."""
    try:
        a, b = (float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"expected A,B (ms per step, us per token), got {text!r}") from None
    if not (a >= 0 and b >= 0) or a + b == 0 or math.isinf(a + b):
        raise ValueError(f"A and B must be finite, >= 0 and not both 0, got {text!r}")
    return StepTime(a / 1e3, b / 1e6)


def _trace_path(text: str) -> Path:
    path = Path(text).expanduser()
    if path.is_dir():
        raise ValueError(f"{text} is a folder; give a trace file")
    if not path.is_file():
        raise ValueError(f"{text}: no such file")
    return path


def _trace_help() -> str:
    files = ", ".join(traces.TRACE_FILES[k] for k in TRACE_WORKLOADS.values())
    where = "; ".join(f"{w}: {traces.TRACE_SOURCES[k][1]} from {traces.TRACE_SOURCES[k][0]}"
                      for w, k in TRACE_WORKLOADS.items())
    return (f"The trace workloads ({', '.join(TRACE_WORKLOADS)}) need trace files that a pip "
            f"install does not ship. Download them ({where}) and pass --trace PATH, or set "
            f"{traces.ENV_VAR} to a folder holding them as {files}. A source checkout finds them in "
            f"../shared/traces.")


class _Questions(argparse._SubParsersAction):
    """``kvstore bench``'s subcommands: a sweep option before one is a usage error (it would
    be silently replaced)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given = [f"--{k.replace('_', '-')}" for k, v in vars(namespace).items()
                 if v != parser.get_default(k)]
        if given:
            raise argparse.ArgumentError(
                self, f"{', '.join(given)} given before {values[0]}: put options after the question")
        super().__call__(parser, namespace, values, option_string)


def add_bench_parser(subparsers: Any) -> None:
    """Register ``bench`` (the sweep, also ``bench sweep``) and a subcommand per question."""
    from kvstore.benchmarks import manager, recurrent, replay

    doc = __doc__.split("\n\n")[1] if __doc__ else None
    p = subparsers.add_parser(
        "bench", help="benchmarks: the sweep (default), manager, replay, tiers, kernels, recurrent",
        description=f"{doc} Other questions are subcommands.", epilog=_trace_help())
    _add_arguments(p)
    p.set_defaults(func=run_bench, usage_error=p.error)
    sub = p.add_subparsers(title="questions", metavar="QUESTION", action=_Questions)
    commands = (
        ("sweep", "hit rate and cost against KV memory (the default)", _add_arguments, run_bench),
        ("manager", "what the cache manager's calls cost, against a revision or vLLM",
         manager.add_arguments, manager.run),
        ("replay", "hit rate against capacity on a trace: LRU, pool policies, layouts, MIN",
         replay.add_arguments, replay.run),
        ("tiers", "host tier and store: transfer speeds, two engines sharing a store",
         add_tier_arguments, partial(_run_module, "tier_bench")),
        ("kernels", "the paged-attention kernels against SDPA (GPU)",
         add_kernel_arguments, partial(_run_module, "kernel_bench")),
        ("recurrent", "recurrent hybrids: kvstore's checkpoints against vLLM's inflated block",
         recurrent.add_arguments, recurrent.run))
    for name, help_text, add, func in commands:
        q = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=p.formatter_class,
                           epilog=_trace_help() if name in ("sweep", "replay") else None)
        add(q)
        q.set_defaults(func=func, usage_error=q.error)


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench kernels``."""
    flag = partial(p.add_argument, action="store_true")
    flag("--quick", help="small grid, few iterations")
    flag("--check", help="run the correctness grid on the GPU first (exit 1 on failure)")
    flag("--skip-bench", help="with --check: check only")
    flag("--split-sweep", help="only time small-batch decode at every split-KV factor")
    flag("--mla-sweep", help="only time MLA decode at DeepSeek-V3's shapes at every launch plan")
    p.add_argument("--json", type=out_file, default=Path("results/kernel_bench.json"),
                   help="where to write the results")


def _run_module(module: str, args: argparse.Namespace) -> int:
    """``run_command`` of benchmarks module `module`, imported only now: it needs torch."""
    import importlib

    return int(importlib.import_module(f"kvstore.benchmarks.{module}").run_command(args))


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench tiers``."""
    p.add_argument("--engines", action="store_true",
                   help="two engine processes sharing one store: B's store hits on A's "
                        "prefixes, and both outputs against one engine without tiers")
    p.add_argument("--store", type=_arg_type(partial(_store_spec, mem=False)), metavar="URL",
                   help="valkey:// URL (default: start a valkey-server on 127.0.0.1)")
    p.add_argument("--no-store", action="store_true", help="transfers: skip the store part")
    p.add_argument("--device", default=None, help="transfers: torch device (default: cuda if "
                   "available, else cpu)")
    count = partial(p.add_argument, type=positive_int)
    count("--blocks", default=64, help="transfers: blocks per batch")
    count("--pool-blocks", default=512, help="transfers: blocks in the device pool")
    count("--layers", default=None, help="layers in the group (default: 8 for transfers, 4 for --engines)")
    count("--block-size", default=16, help="tokens per block")
    count("--kv-heads", default=8, help="KV heads per layer")
    count("--head-dim", default=128, help="head dimension")
    p.add_argument("--dtype", type=_arg_type(dtype_name), default="bfloat16",
                   help=f"KV page dtype: {', '.join(DTYPE_ITEMSIZE)}")
    count("--reps", default=9, help="transfers: timed repetitions, median kept")
    count("--threads", default=None, help="torch CPU threads (default: torch's own)")
    count("--prefixes", default=8, help="--engines: shared prefixes")
    count("--prefix-len", default=250, help="--engines: tokens per shared prefix")
    count("--suffix-len", default=20, help="--engines: tokens after the prefix per prompt")
    count("--max-tokens", default=8, help="--engines: tokens generated per prompt")
    count("--num-blocks", default=512, help="--engines: pool size")
    p.add_argument("--json", type=out_file, default=None, help="also write the results here")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    count = partial(p.add_argument, type=positive_int)
    flag = partial(p.add_argument, action="store_true")
    p.add_argument("--workload", default="mixed_default",
                   choices=sorted(WORKLOADS) + list(TRACE_WORKLOADS), metavar="NAME",
                   help=f"built-in workload ({', '.join(sorted(WORKLOADS))}) or a trace "
                        f"({', '.join(TRACE_WORKLOADS)}; see below for their files)")
    p.add_argument("--trace", metavar="PATH", type=_arg_type(_trace_path),
                   help=f"trace file for a trace workload (default: ${traces.ENV_VAR}/<file name>, "
                        "else ../shared/traces in a source checkout)")
    count("--limit", metavar="N", help=f"first N requests (default: all of a built-in workload, "
                                        f"{DEFAULT_TRACE_LIMIT} of a trace, {QUICK_LIMIT} with --quick)")
    p.add_argument("--model-shape", default="llama-3-8b", choices=sorted(MODEL_SHAPES),
                   metavar="NAME", help=f"model whose KV bytes per token size the pools: "
                                        f"{', '.join(sorted(MODEL_SHAPES))}")
    count("--block-size", default=16, help="tokens per block")
    p.add_argument("--pool-sizes", metavar="LIST", type=_arg_type(_pool_sizes),
                   help="comma list of KV budgets (1GiB,512MiB) or all-full block counts "
                        "(4000,2000) (default: --points sizes down to the largest request)")
    count("--points", help=f"number of default pool sizes (default: {DEFAULT_POINTS}, "
                           f"{QUICK_POINTS} with --quick)")
    p.add_argument("--policies", type=name_list(sweep.DEFAULT_POLICIES), default=list(sweep.DEFAULT_POLICIES),
                   metavar="LIST", help=f"comma list of {', '.join(POLICIES)} (default: all)")
    p.add_argument("--eviction", type=name_list(tuple(EVICTION_POLICIES)), metavar="LIST",
                   help="comma list of eviction policies: each caching policy runs once per "
                        "name, as NAME@EVICTION (as NAME for lru) (default: lru)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="workload seed")
    flag("--quick", help=f"{QUICK_POINTS} pool sizes, the first {QUICK_LIMIT} requests")
    count("--jobs", help="worker processes (default: the CPU count, at most 4)")
    count("--max-num-batched-tokens", default=2048, help="scheduler: tokens per step")
    count("--max-num-seqs", default=256, help="scheduler: requests running at once")
    p.add_argument("--out", default=Path("results/bench"), type=output.out_folder,
                   metavar="DIR", help="each run writes into a fresh DIR/YYYYMMDD-HHMMSS/")
    flag("--in-place", help="write into --out itself, replacing files of the same names")
    p.add_argument("--step-time", type=_arg_type(_step_time), default=StepTime(), metavar="A,B",
                   help="the time column's model: a step computing n tokens takes A ms + n x B "
                        "us (default: 5,40)")
    flag("--wide", help="print every column of the table (the default fits 80 columns)")
    p.add_argument("--host-tier-bytes", type=_arg_type(sweep.parse_size), metavar="N",
                   help="a host tier of N bytes (8GiB, or a byte count) below the device pool; "
                        "each caching policy also runs as NAME+tiers")
    p.add_argument("--store", type=_arg_type(_store_spec), metavar="URL",
                   help="a shared store below the pool (and the host tier): valkey://host:port/db, "
                        "valkey+cluster://host:port, mem or mem:SIZE; as --host-tier-bytes")
    p.add_argument("--window-offload", choices=("none", "ends", "all"), default="ends",
                   help="with tiers, which pages a sliding-window group drops mid-request are "
                        "offloaded (docs/tiers.md)")


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed options as plain values, for the run record (a store URL redacted)."""
    from kvstore.tiers.valkey_store import redact_url

    out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
           if not callable(v)}
    if out.get("store"):
        out["store"] = redact_url(out["store"])
    return out


def run_bench(args: argparse.Namespace) -> int:
    """Run, print and write the sweep; 0, ``EXIT_NOTHING_FITS`` or ``EXIT_INTERRUPTED``."""
    from rich.console import Console

    error = args.usage_error
    t0 = time.perf_counter()
    shape = MODEL_SHAPES[args.model_shape]
    policies = sweep.with_evictions(args.policies, args.eviction) if args.eviction else args.policies
    limit = QUICK_LIMIT if args.quick and args.limit is None else args.limit
    try:
        workload = load_bench_workload(args.workload, args.trace, limit, args.seed)
    except FileNotFoundError as e:
        error(f"argument --workload: {args.workload} {e}")
    except ValueError as e:
        error(f"argument --trace: {e}")
    try:
        budgets = (sweep.parse_pool_sizes(args.pool_sizes, shape.block_bytes(args.block_size))
                   if args.pool_sizes else None)
    except ValueError as e:
        error(f"argument --pool-sizes: {e}")
    if not workload.requests:
        where = f"--trace: {args.trace}" if args.trace else f"--workload: {args.workload}"
        error(f"argument {where} has no requests")
    tiers = TierOptions(args.host_tier_bytes, args.store, args.window_offload)
    if tiers and not any(policy_named(p).enable_caching for p in policies):
        flag = "--host-tier-bytes" if tiers.host_bytes else "--store"
        error(f"argument {flag}: tiers need a caching policy in --policies")
    if tiers.store:
        check_store(tiers.store, error)
    out: Path = args.out
    output.check_folder(out, error)
    points = args.points if args.points is not None else (QUICK_POINTS if args.quick else DEFAULT_POINTS)
    run = RunInfo.now(_arguments(args), seed=args.seed)
    console = Console()
    if not console.is_terminal:  # piped or captured: room for the findings
        console = Console(width=max(console.width, 150))
    console.print(f"[bold]{workload.name}[/bold]: {workload.description}")
    console.print(f"{len(workload.requests)} requests, {workload.num_prompt_tokens:,} prompt + "
                  f"{workload.num_output_tokens:,} output tokens; {shape.describe()}")
    if any(policy_named(p).layout == "hybrid" for p in policies):
        console.print(sweep.hybrid_layout_line(workload, shape, args.block_size))
    try:
        result = _sweep_with_progress(
            console, workload, shape=shape.name, block_size=args.block_size, budgets=budgets,
            num_points=points, policies=policies, tiers=tiers or None, step_time=args.step_time,
            scheduler_config=SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs),
            jobs=args.jobs)
    except sweep.SweepInterrupted as e:
        return _save_interrupted(e.partial, out, args.in_place, run)
    dropped = print_table(result, console, wide=args.wide)
    if result.nothing_fits:
        print(f"kvstore bench: nothing fits: every pool size is too small for some request of "
              f"{workload.name} (the largest, {result.meta.largest_request_tokens} tokens, needs "
              f"{format_bytes(result.meta.largest_request_bytes)} of {args.model_shape} KV with "
              f"every layer full attention); give larger --pool-sizes, or omit them",
              file=sys.stderr)
        return EXIT_NOTHING_FITS
    for line in headline(result):
        console.print(f"[bold]{line}[/bold]")
    folder = output.run_folder(out, args.in_place)
    written = write_results(result, folder, run)
    if dropped:
        narrow = dict(_COLUMNS)  # the names the legend and docs use
        console.print(f"left out to fit {TABLE_WIDTH} columns: "
                      f"{', '.join(narrow[c] or c for c in dropped)}; every column "
                      f"is in {folder}/table.txt (or run with --wide)", style="dim")
    pngs = ", ".join(sorted(p.name for p in written if p.suffix == ".png"))
    console.print(f"wrote {len(written)} files to {folder}/ (sweep.json, sweep.csv, tables.md, "
                  f"{pngs} ...) in {time.perf_counter() - t0:.1f}s with {result.meta.jobs} jobs")
    return 0


def _sweep_with_progress(console: Any, workload: Workload, **options: Any) -> SweepResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("sweep", total=None)

        def on_done(row: SweepRow) -> None:
            where = "unbounded" if row.budget_bytes is None else format_bytes(row.budget_bytes)
            progress.update(task, advance=1, description=f"{row.policy:>7} @ {where:>9}")

        return sweep.run_sweep(workload, progress=on_done, **options,
                               on_start=lambda n: progress.update(task, total=n))


def _save_interrupted(partial: SweepResult, out: Path, in_place: bool, run: RunInfo) -> int:
    """After Ctrl-C: write the finished replays (no figures; Ctrl-C ignored meanwhile)."""
    m = partial.meta
    if m.completed_replays == 0:
        print("kvstore bench: interrupted before any replay finished; nothing written",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    with sweep.sigint_ignored():  # a second press must not lose them (this takes well under a second)
        folder = output.run_folder(out, in_place)
        write_results(partial, folder, run, figures=False)
    print(f"kvstore bench: interrupted; kept the {m.completed_replays} of {m.total_replays} "
          f"replays that finished in {folder}/ (sweep.json, sweep.csv, tables.md, table.txt)",
          file=sys.stderr)
    return EXIT_INTERRUPTED


def headline(result: SweepResult) -> list[str]:
    """Two or three lines a user can act on (docs/benchmarks.md, what a run prints)."""
    f = result.findings
    caching = [p for p in result.meta.policies if policy_named(p).enable_caching]
    if not caching:
        return ["no caching policy in --policies: add prefix, partial or hybrid to see hits"]
    ref = "partial" if "partial" in caching else caching[0]
    info = f.get(ref, {})
    lines = []
    if "unbounded_prompt_hit_rate" in info:
        bend = info["hit_below_95pct"]["label"]
        lines.append(
            f"{ref}: {_pct(info['unbounded_prompt_hit_rate'])} of prompt tokens hit with room for "
            + (f"everything, under 95% of that from {bend} down: give the cache more than {bend}"
               if bend else "everything, and at least 95% of that at every budget here"))
    first = info.get("first_preemption", {}).get("label")
    lines.append(f"{ref}: " + (f"preemptions start at {first}: from there down, tokens are computed "
                               "again" if first else "no preemption at any budget here"))
    feasible = [r for r in result.rows if r.metrics is not None and r.budget_bytes]
    small = max((r.point for r in feasible), default=None)
    at = {r.policy: r for r in feasible if r.point == small}
    base = at.get("paged") or at.get("naive")
    best = min((p for p in caching if p in at),
               key=lambda p: at[p].model_time_s or 0.0, default=None)
    if best is not None and base is not None:
        m, b = at[best].metrics, base.metrics
        assert m is not None and b is not None
        lines.append(f"at the smallest budget ({format_bytes(at[best].budget_bytes or 0)}) {best} "
                     f"computes {m.computed_tokens / b.computed_tokens:.0%} of the tokens of no "
                     f"caching ({base.policy}), in {m.steps / max(1, b.steps):.0%} of the steps "
                     f"and {(at[best].model_time_s or 0) / (base.model_time_s or 1):.0%} of the "
                     f"modeled time")
    return lines
