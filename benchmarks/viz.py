"""``kvstore viz``: the pool's block layout after every step of a small built-in scenario, as
an ASCII map and a PNG (the cell codes are in ``LEGEND``; docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import string
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.benchmarks.output import check_folder, int_at_least, out_file, pyplot, save_figure, wrap
from kvstore.benchmarks.simulator import SimResult, simulate
from kvstore.benchmarks.workloads import RequestSpec
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.specs import FullAttentionSpec, make_kv_cache_config

LEGEND = ("A-Z in use by one request | * shared | + copy destination (CoW) | = pinned copy "
          "source | a-z free, cached full block (writer) | . free, cached partial block | "
          "blank free")


@dataclass
class PoolSnapshot:
    """The pool after one step: each block's cell code (ids 1..N-1), who runs and waits, what happened."""

    step: int
    cells: list[str]
    running: list[str]
    waiting: list[str]
    events: list[str]


class PoolRecorder:
    """An `on_step` hook for :func:`kvstore.benchmarks.simulator.simulate` that snapshots the pool."""

    def __init__(self, letters: dict[str, str]) -> None:
        self.letters = letters
        self.snapshots: list[PoolSnapshot] = []
        self._writer: dict[int, str] = {}  # block id -> the letter of the request that filled it
        self._seen: set[str] = set()
        self._prev_running: set[str] = set()

    def _letter(self, request_id: str) -> str:
        return self.letters.get(request_id, "?")

    def _cell(self, block: Any, owners: set[str], copy_destination: bool) -> str:
        if copy_destination:
            return "+"
        if len(owners) > 1:
            return "*"
        if owners:
            return next(iter(owners))
        if block.ref_cnt > 0:
            return "="
        if not block.is_cached:
            return " "
        writer = self._writer.get(block.block_id, "")
        return writer.lower() if block.block_hash is not None and writer else "."

    def __call__(self, scheduler: Scheduler, output: SchedulerOutput) -> None:
        """Record the state right after `output` was scheduled."""
        manager = scheduler.manager
        owners: dict[int, set[str]] = {}
        for rid in manager.requests:
            for table in manager.block_table(rid):
                for bid in table:
                    if bid:
                        owners.setdefault(bid, set()).add(self._letter(rid))
        copy_dst = {dst for _, dst in output.copies}
        cells = []
        for block in manager.block_states():
            who = owners.get(block.block_id, set())
            if len(who) == 1 and not block.is_cached:
                self._writer[block.block_id] = next(iter(who))  # fresh page: its owner writes it
            cells.append(self._cell(block, who, block.block_id in copy_dst))
        new = [i.request for i in output.scheduled if i.request.request_id not in self._seen]
        self._seen.update(r.request_id for r in new)
        events = [f"{self._letter(r.request_id)} admitted, hit {r.num_computed_tokens}" for r in new]
        running = {self._letter(r.request_id) for r in scheduler.running}
        preempted = {self._letter(p.request_id) for p in output.preempted}
        events += [f"{self._letter(p.request_id)} preempted" for p in output.preempted]
        events += [f"copy {src}->{dst}" for src, dst in output.copies]
        done = sorted(self._prev_running - running - preempted)
        if done:
            events.append("finished " + ",".join(done))
        self._prev_running = running
        self.snapshots.append(PoolSnapshot(len(self.snapshots) + 1, cells, sorted(running),
                                           [self._letter(r.request_id) for r in scheduler.waiting],
                                           events))


def demo_scenario(block_size: int = 4) -> list[RequestSpec]:
    """A handful of requests that show sharing, a partial hit, evictions and a re-hit: A and
    B share a two-block system prompt S; C repeats A's prompt but diverges inside A's last
    prompt block; D is long and unique; E comes back to S after D."""
    bs = block_size
    s = tuple(range(100, 100 + 2 * bs))
    a = s + tuple(range(200, 200 + bs - 1))
    b = s + tuple(range(300, 300 + bs + 1))
    c = a[: 2 * bs + bs // 2] + tuple(range(400, 400 + bs))
    d = tuple(range(500, 500 + 7 * bs))
    e = s + tuple(range(600, 600 + 2))
    return [RequestSpec("A", 0.0, a, 4), RequestSpec("B", 1.0, b, 3), RequestSpec("C", 6.0, c, 2),
            RequestSpec("D", 9.0, d, 3), RequestSpec("E", 15.0, e, 2)]


def run_viz(num_blocks: int = 13, block_size: int = 4, max_num_batched_tokens: int = 8,
            enable_caching: bool = True, enable_partial_hits: bool = True) -> tuple[PoolRecorder, SimResult]:
    """Replay the demo scenario (one full-attention layer) and record the pool at every step."""
    reqs = demo_scenario(block_size)
    letters = {r.request_id: string.ascii_uppercase[i] for i, r in enumerate(reqs)}
    config = make_kv_cache_config([FullAttentionSpec(block_size, 1, 8)], num_blocks=num_blocks)
    recorder = PoolRecorder(letters)
    result = simulate(reqs, config, enable_caching=enable_caching,
                      enable_partial_hits=enable_partial_hits,
                      scheduler_config=SchedulerConfig(max_num_batched_tokens, 16),
                      step_time=1.0, on_step=recorder)
    return recorder, result


def plot_layout(snapshots: Sequence[PoolSnapshot], path: str | Path, title: str = "") -> None:
    """Block id against step: the request using (solid) or that filled (hatched) a block, grey ``*+=``."""
    plt = pyplot()
    from matplotlib.patches import Patch, Rectangle

    letters = sorted({c.upper() for s in snapshots for c in s.cells if c.isalpha()})
    cmap = plt.get_cmap("tab10" if len(letters) <= 10 else "tab20")
    color = {c: cmap(i % cmap.N) for i, c in enumerate(letters)}
    n_blocks = len(snapshots[0].cells) if snapshots else 0
    fig, ax = plt.subplots(figsize=(max(6, 0.28 * len(snapshots) + 2), max(3, 0.3 * n_blocks + 1.5)))
    for s in snapshots:
        for i, cell in enumerate(s.cells):
            x, y = s.step - 0.5, i + 0.5  # block id i + 1
            if cell in "*+=":
                ax.add_patch(Rectangle((x, y), 1, 1, color="0.35"))
                ax.text(x + 0.5, y + 0.5, cell, ha="center", va="center", fontsize=9,
                        color="white", fontweight="bold")
            elif cell.isupper():
                ax.add_patch(Rectangle((x, y), 1, 1, color=color[cell]))
            elif cell != " ":  # free but cached: its writer's colour, hatched
                face = color.get(cell.upper(), "0.7")
                ax.add_patch(Rectangle((x, y), 1, 1, facecolor=face, alpha=0.35, edgecolor="none"))
                ax.add_patch(Rectangle((x, y), 1, 1, fill=False, hatch="///", edgecolor="0.3", lw=0))
    ax.set_xlim(0.5, len(snapshots) + 0.5)
    ax.set_ylim(0.5, n_blocks + 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("block id")
    ax.set_title(title or "Pool layout over time")
    handles = [Patch(color=color[c], label=f"request {c}") for c in letters]
    handles += [Patch(color="0.35", label="shared (*) / copy (+)"),
                Patch(facecolor="0.8", hatch="///", edgecolor="0.3", label="free, cached")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    save_figure(fig, Path(path))


def add_viz_parser(subparsers: Any) -> None:
    """Register ``viz`` on an argparse subparsers object."""
    p = subparsers.add_parser(
        "viz", help="draw the block pool's layout step by step (ASCII and PNG)",
        description="Replay a small built-in scenario through the real scheduler and cache "
                    "and draw the pool after every step.")
    for flag, low, default, what in (("--num-blocks", 2, 13, "pool size incl. the null block"),
                                     ("--block-size", 1, 4, "tokens per block"),
                                     ("--max-num-batched-tokens", 1, 8, "tokens scheduled per step")):
        p.add_argument(flag, type=int_at_least(low), default=default, help=what)  # the help adds the default
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-partial-hits", action="store_true")
    p.add_argument("--out", type=_png_path, default=Path("results/viz/pool_layout.png"),
                   help="PNG path (.png added when it has another suffix)")
    p.add_argument("--no-png", action="store_true", help="print the ASCII map only")
    p.set_defaults(func=run_viz_command, usage_error=p.error)


def _png_path(text: str) -> Path:
    """argparse type: an output file, ``.png`` appended unless it ends so (as matplotlib saves it)."""
    path = out_file(text)
    return path if text.lower().endswith(".png") else out_file(text + ".png")


def run_viz_command(args: argparse.Namespace) -> int:
    """Print the per-step ASCII map and write the PNG."""
    if not args.no_png:
        check_folder(args.out.parent, args.usage_error)
    try:
        recorder, result = run_viz(args.num_blocks, args.block_size, args.max_num_batched_tokens,
                                   not args.no_prefix_caching, not args.no_partial_hits)
    except ValueError as e:
        args.usage_error(str(e))
    width = len(recorder.snapshots[0].cells) * 3 if recorder.snapshots else 0
    print(f"pool of {args.num_blocks - 1} blocks x {args.block_size} tokens (block 0, the null "
          "block, not shown)")
    print(wrap(f"legend: {LEGEND}"))
    print(f"{'step':>4}  {'blocks 1..' + str(args.num_blocks - 1):<{width}}  running / waiting  events")
    for s in recorder.snapshots:
        row = (f"{s.step:>4}  {''.join(f'[{c}]' for c in s.cells)}  {''.join(s.running) or '-':>7} / "
               f"{''.join(s.waiting) or '-':<7} ")
        events = textwrap.wrap("; ".join(s.events), max(80 - len(row), 10)) or [""]
        print((row + events[0]).rstrip())
        for line in events[1:]:
            print(" " * len(row) + line)
    print(wrap(f"hits {result.hit_tokens} of {result.queried_tokens} tokens "
               f"({result.partial_hit_tokens} by partial hits, {result.copies} copies), "
               f"{result.evictions} evictions, {result.preemptions} preemptions, "
               f"{result.steps} steps"))
    if not args.no_png:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot_layout(recorder.snapshots, args.out,
                    f"Pool layout: {args.num_blocks - 1} blocks x {args.block_size} tokens")
        print(f"wrote {args.out}")
    return 0
