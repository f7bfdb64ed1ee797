"""``kvstore bench replay``: hit rate against cache capacity on Mooncake block-hash traces, in whole
512-token blocks as the Mooncake paper counts. ``--what``: ``lru`` (docs/benchmarks.md), ``policies``
and ``layouts`` (docs/eviction.md), ``tiers`` (docs/tiers.md)."""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time
from collections import ChainMap, OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.benchmarks import output
from kvstore.benchmarks import traces as tr
from kvstore.benchmarks.manager import new_manager
from kvstore.benchmarks.recurrent import serve
from kvstore.benchmarks.sweep import ModelShape
from kvstore.benchmarks.traces import HitCount, MooncakeRequest, leading_run, load_mooncake
from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool, BlockRemoved, BlockStored
from kvstore.eviction import EVICTION_POLICIES
from kvstore.hashing import BlockHash
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheSpec, make_kv_cache_config
from kvstore.utils import hit_rate

BT = tr.MOONCAKE_BLOCK_TOKENS
WHAT = ("lru", "policies", "layouts", "tiers")
TRACE_NAMES: dict[str, str] = {"conversation": "mooncake_conversation", "synthetic": "mooncake_synthetic"}
Row = dict[str, Any]  # one capacity of a curve, as written to JSON and CSV
Curves = dict[str, list[Row]]  # trace name -> rows by capacity
Line = tuple[str, str, dict[str, Any], str]  # row key, format, plot keywords, label
Table = tuple[str, list[str], list[list[str]]]  # legend, header, rows (each first cell a trace name)


def _trace(text: str) -> tuple[str, Path]:
    """argparse type: a built-in trace name or a path to a trace file -> (name, path)."""
    if text in TRACE_NAMES:
        try:
            return text, tr.locate_trace(TRACE_NAMES[text])
        except FileNotFoundError as e:
            raise argparse.ArgumentTypeError(f"{text} {e}") from None
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a built-in trace ({', '.join(TRACE_NAMES)}) nor a file")
    try:
        if not load_mooncake(path, 1):
            raise ValueError(f"{path} has no rows")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{e} (expected Mooncake JSONL: a JSON object a line with "
                                         "timestamp, input_length, output_length, hash_ids)") from None
    return path.stem, path


def _tokens(text: str) -> list[int]:
    """argparse type: a comma list of token counts >= 1 (``1e6`` allowed)."""
    try:
        caps = [int(float(c)) for c in text.replace("_", "").split(",")]
    except (ValueError, OverflowError):
        caps = []
    if not caps or min(caps) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts >= 1, got {text!r}")
    return caps


def _store_tokens(text: str) -> list[int | None]:
    """argparse type: a comma list of token counts, ``inf`` for unbounded."""
    parts = [t.strip() for t in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts >= 1 or inf, got {text!r}")
    return [None if t == "inf" else _tokens(t)[0] for t in parts]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench replay``."""
    p.add_argument("--trace", type=_trace, action="append", metavar="NAME|PATH",
                   help=f"a trace file, or a built-in name ({', '.join(TRACE_NAMES)}); repeatable "
                        "(default: both built-in traces)")
    p.add_argument("--what", type=output.name_list(WHAT), default=["lru", "policies"], metavar="LIST",
                   help=f"comma list of {', '.join(WHAT)}")
    p.add_argument("--capacities", type=_tokens, metavar="LIST",
                   help="comma list of capacities in tokens (default per replay: lru the paper's and a "
                        "log grid, policies 1M..5M, layouts 0.3M..10M)")
    p.add_argument("--policies", type=output.name_list(tuple(EVICTION_POLICIES)),
                   default=list(EVICTION_POLICIES), metavar="LIST",
                   help=f"eviction policies, comma list of {', '.join(EVICTION_POLICIES)}")
    p.add_argument("--limit", type=output.positive_int, metavar="N", help="first N rows of each trace")
    p.add_argument("--quick", action="store_true",
                   help="the first 2000 rows; the paper's capacities for lru, three for layouts")
    p.add_argument("--jobs", type=output.positive_int, default=min(4, os.cpu_count() or 1),
                   help="processes for layouts (default: the CPU count, at most 4)")
    tier_options = (("--device-tokens", output.positive_int, 3_000_000, "device capacity"),
                    ("--host-tokens", output.non_negative_int, 30_000_000, "host tier capacity"),
                    ("--instances", output.positive_int, 4, "instances sharing a store"))
    for flag, kind, default, text in tier_options:
        p.add_argument(flag, type=kind, default=default, help=f"tiers: {text}")
    p.add_argument("--store-tokens", type=_store_tokens, metavar="LIST",
                   help="tiers: comma list of store capacities in tokens, inf for unbounded (default: inf, "
                        "10x and 1x --device-tokens)")
    p.add_argument("--out", type=output.out_folder, default=Path("results/replay"), help="output folder")


def run(args: argparse.Namespace) -> int:
    """Run the replays `args` ask for: figures, JSON and CSV in ``--out``, tables and a headline on
    stdout. A bad row in a trace file is a usage error."""
    try:
        return _run(args)
    except ValueError as e:
        if "bad Mooncake row" not in str(e):
            raise
        return args.usage_error(f"argument --trace: {e}")


def _run(args: argparse.Namespace) -> int:
    traces = dict(args.trace or [])
    if not traces:
        try:
            traces = {name: tr.locate_trace(key) for name, key in TRACE_NAMES.items()}
        except FileNotFoundError as e:
            return args.usage_error(f"argument --trace: {e}")
    limit = args.limit or (2000 if args.quick else None)
    out, caps, policies = args.out, args.capacities, args.policies
    output.check_folder(out, args.usage_error)
    t0 = time.perf_counter()
    headline: list[str] = []
    if "lru" in args.what:
        result = run_mooncake_replay(out, traces, caps, limit, quick=args.quick)
        for name, rows in result["curves"].items():
            lo, hi = rows[0], rows[-1]
            print(f"lru {name}: hit {lo['token_hit_rate']:.3f} at {lo['capacity_tokens']:,} tokens .. "
                  f"{hi['token_hit_rate']:.3f} at {hi['capacity_tokens']:,}")
        if result["comparison"]:
            _show(out, "mooncake_hit_rate", *format_paper(result["comparison"]))
        agree = all(r["agree"] for rows in result["curves"].values() for r in rows)
        headline.append(f"LRU: the pool {'equals' if agree else 'DIFFERS FROM'} the LRU model at every "
                        f"capacity ({out}/mooncake_hit_rate.png)")
    if "policies" in args.what:
        curves = run_eviction_replay(out, traces, caps or GAP_CAPACITIES, policies, limit)["curves"]
        _show(out, "eviction_hit_rate", *format_policies(curves, policies))
        best = max((r[p] - r.get("lru", r[p]), p, n, r["capacity_tokens"])
                   for n, rows in curves.items() for r in rows for p in policies)
        headline.append(f"policies: best gain over LRU {best[0]:+.3f} ({best[1]}, {best[2]} at {best[3]:,} "
                        f"tokens); MIN bounds every line ({out}/eviction_hit_rate.png)")
    if "layouts" in args.what:
        layout_caps = caps or (QUICK_CAPACITIES if args.quick else CAPACITIES)
        curves = run_hybrid_replay(out, traces, layout_caps, policies, limit, args.jobs)["curves"]
        _show(out, "eviction_hybrid", *format_layouts(curves, policies))
        _show(out, "eviction_hybrid_groups", *format_groups(curves, policies))
        worst = min((r[p] - r["full_lru"], p, n, r["capacity_tokens"])
                    for n, rows in curves.items() for r in rows for p in policies)
        headline.append(f"layouts: the hybrid's largest loss against all-full LRU {worst[0]:+.3f} "
                        f"({worst[1]}, {worst[2]} at {worst[3]:,} tokens)")
    if "tiers" in args.what:
        headline += [_tiers(name, path, args, limit) for name, path in traces.items()]
    print("\n" + "\n".join(output.wrap(line) for line in headline)
          + f"\n({time.perf_counter() - t0:.0f} s; files in {out}/)")
    return 0


def _show(out: Path, stem: str, legend: str, head: list[str], rows: list[list[str]]) -> None:
    """Print a table per trace (at most 80 columns, the trace's name above it) and the legend; write
    them all as one Markdown table, the legend under it, to ``{stem}.md``."""
    left = (0, head.index("policy") - 1) if "policy" in head else (0,)
    for name in dict.fromkeys(r[0] for r in rows):
        print(f"\n{name}:\n" + output.text_table(head[1:], [r[1:] for r in rows if r[0] == name], left))
    print(output.wrap(legend))
    markdown = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                *("| " + " | ".join(r) + " |" for r in rows)]
    (out / f"{stem}.md").write_text("\n".join([*markdown, "", legend, ""]), encoding="utf-8")


def _by_time(requests: Iterable[MooncakeRequest]) -> list[MooncakeRequest]:
    return sorted(requests, key=lambda r: r.timestamp_ms)


def _curves(what: str, traces: dict[str, Path], capacities: Sequence[int], limit: int | None,
            row: Callable[[list[MooncakeRequest], int], Row], log: Any, jobs: int = 1,
            note: Callable[[list[Row]], str] = lambda rows: "") -> Curves:
    """``row(trace rows, capacity)`` for each trace and capacity (`jobs` processes), with a progress
    line on stderr per capacity and one `log` line per trace."""
    curves: Curves = {}
    for name, path in traces.items():
        rows = _by_time(load_mooncake(path, limit))
        t0 = time.perf_counter()
        workers = min(jobs, len(capacities))
        if workers > 1:
            with ProcessPoolExecutor(workers) as pool:
                futures = {pool.submit(row, rows, cap): i for i, cap in enumerate(capacities)}
                done: dict[int, Row] = {}
                for future in as_completed(futures):
                    done[futures[future]] = future.result()
                    print(f"  {what} {name}: [{len(done)}/{len(capacities)}] "
                          f"{capacities[futures[future]]:,} tokens done", file=sys.stderr, flush=True)
                curves[name] = [done[i] for i in range(len(capacities))]
        else:
            curves[name] = []
            for i, cap in enumerate(capacities, 1):
                print(f"  {what} {name}: [{i}/{len(capacities)}] {cap:,} tokens ...", file=sys.stderr,
                      flush=True)
                curves[name].append(row(rows, cap))
        log(output.wrap(f"{what} {name}: {len(rows)} requests, {len(capacities)} capacities in "
                        f"{time.perf_counter() - t0:.1f}s{note(curves[name])}"))
    return curves


def write_panels(out: Path, stem: str, curves: Curves, lines: Sequence[Line], xlabel: str, title: str,
                 meta: dict[str, Any],
                 extra: Callable[[Any, str], None] = lambda ax, name: None) -> dict[str, Any]:
    """``{stem}.png`` (hit rate against capacity, a panel per trace, a line per entry of `lines`, plus
    what `extra` draws), ``{stem}.csv`` and ``{stem}.json`` (`meta` + curves)."""
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = output.pyplot().subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        xs = [r["capacity_tokens"] for r in rows]
        for key, fmt, kw, label in lines:
            ax.plot(xs, [r[key] for r in rows], fmt, label=label, **kw)
        extra(ax, name)
        output.mark_x(ax, xs, output.short_count)
        ax.set(xlabel=xlabel, ylabel="token hit rate (whole blocks)", title=title.format(name=name))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    output.save_figure(fig, out / f"{stem}.png", dpi=120)
    output.write_csv(out / f"{stem}.csv", [{"trace": name, **{k: v for k, v in r.items() if k != "groups"}}
                                          for name, rows in curves.items() for r in rows])
    result = {**meta, "curves": curves}
    output.write_json(out / f"{stem}.json", result)
    return result


def _million(r: Row) -> str:
    return f"{r['capacity_tokens'] / 1e6:g}M"


def _tiers(name: str, path: Path, args: argparse.Namespace, limit: int | None) -> str:
    """The LRU model device-only, with a host tier below it and as instances sharing a store: printed,
    written as JSON, summed up in one line."""
    rows = load_mooncake(path, limit)
    dev, host, n = args.device_tokens // BT, args.host_tokens // BT, args.instances
    if dev < n:
        args.usage_error(f"argument --instances: must be in 1..{dev} (device blocks), got {n}")
    runs = {"device-only LRU": tr.mooncake_lru_replay(rows, dev),
            "device + host, on-free": tr.mooncake_lru_replay(rows, dev, tier_blocks=host),
            "device + host, write-back": tr.mooncake_lru_replay(rows, dev, tier_blocks=host, write_back=True),
            "unbounded": tr.mooncake_lru_replay(rows, None),
            f"{n} instances, local only": tr.mooncake_lru_replay(rows, dev // n, instances=n)}
    stores = {f"{n} instances + store {'unbounded' if t is None else f'{t:,}'}": t
              for t in args.store_tokens or [None, 10 * args.device_tokens, args.device_tokens]}
    for label, t in stores.items():
        runs[label] = tr.mooncake_lru_replay(rows, dev // n, instances=n,
                                             tier_blocks=None if t is None else t // BT)
    print("\n" + output.wrap(f"tiers {name}: {len(rows)} requests, device {args.device_tokens:,} tokens, "
                             f"host {args.host_tokens:,}; block / token hit rate"))
    for label, r in runs.items():
        print(f"  {label:32s} {r['block_hit_rate']:6.3f} {r['token_hit_rate']:6.3f}")
    keep = ("block_hit_rate", "token_hit_rate", "device_hit_rate", "tier_hit_blocks",
            "per_instance_block_hit_rate")
    output.write_json(args.out / f"tier_replay_{name}.json", {"trace": str(path), "rows": {
        label: {k: r[k] for k in keep} for label, r in runs.items()}})
    one, shared = runs["device-only LRU"], runs[next(iter(stores))]  # the first store listed
    return (f"tiers {name}: a host tier lifts LRU from {one['block_hit_rate']:.3f} to "
            f"{runs['device + host, write-back']['block_hit_rate']:.3f}; {n} instances sharing a store "
            f"keep {shared['block_hit_rate'] / one['block_hit_rate']:.2f}x one instance's hits")


# --------------------------------------------------- lru: the pool against the LRU model
PAPER_CAPACITIES: tuple[int, ...] = (10_000, 100_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000,
                                     10_000_000, 50_000_000, 100_000_000, 1_000_000_000)


def default_capacities(quick: bool = False) -> list[int]:
    """The paper's capacities in tokens, and unless `quick` four a decade from 1e4 to 1e9."""
    grid = () if quick else range(16, 37)
    return sorted(set(PAPER_CAPACITIES) | {int(round(10 ** (e / 4), -2)) for e in grid})


def pool_replay(requests: Iterable[MooncakeRequest], capacity_blocks: int | None,
                eviction: str = "lru") -> dict[str, Any]:
    """Replay rows through a BlockPool of ``capacity_blocks`` usable blocks (None: unbounded) under
    `eviction`: the LRU model's totals plus ``pool_blocks``, ``link_breaks`` (a leading id cached but
    not linked to its parent), ``unlinked_present`` (ids cached after the hit run) and
    ``token_hit_rate_with_tails`` (adding the previous turn's cached partial block)."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    rows, cap = _by_time(requests), capacity_blocks
    pool_blocks = len({h for r in rows for h in r.hash_ids})  # more than the distinct ids: no change
    pool_blocks = pool_blocks if cap is None else min(cap, pool_blocks)
    pool = BlockPool(max(pool_blocks, 1) + 1, enable_caching=True, eviction=eviction)
    root = pool.root_serial(None)
    count = HitCount(BT)
    last_full: dict[int, MooncakeRequest] = {}  # a row's last full block id -> the row
    link_breaks = unlinked = tail_tokens = 0

    def cached(h: int) -> list[KVCacheBlock]:
        return pool.cached_blocks(0, h, (h,))

    for req in rows:
        keep = req.hash_ids[:cap]
        table: list[KVCacheBlock | None] = []
        parent = root
        for h in keep:  # the hit: consecutive linked blocks from the root
            if (block := pool.find_cached(0, h, (h,), parent_serial=parent)) is None:
                break
            table.append(block)
            parent = block.serial
        k = len(table)
        link_breaks += k < len(keep) and bool(cached(keep[k]))
        # A chat's next turn: the hit ends at an earlier row's last full block and the row is longer
        # than that row's input and output; the trace gives the earlier partial block, now full, a new id.
        p = last_full.get(keep[k - 1]) if k else None
        if (p is not None and k == p.input_length // BT and p.input_length > k * BT
                and req.input_length > p.input_length + p.output_length and cached(p.hash_ids[-1])):
            tail_tokens += p.input_length - k * BT
        for h in keep[k:]:  # after the run: present blocks are reused, missing ones computed
            same = cached(h)
            unlinked += bool(same)
            table.append(same[0] if same else None)
        pool.touch(b for b in table if b is not None)
        missing = [i for i, b in enumerate(table) if b is None]
        for i, block in zip(missing, pool.get_new_blocks(len(missing), 0), strict=True):
            table[i] = block
        parent, new = root, set(missing)
        for i, (h, block) in enumerate(zip(keep, table, strict=True)):
            assert block is not None
            parent = (block.serial if i not in new else pool.cache_full_block(
                block, block_hash=h, token_ids=(h,), parent_serial=parent))
        pool.free_blocks(reversed(table))  # type: ignore[arg-type]
        if n_full := req.input_length // BT:
            last_full[req.hash_ids[n_full - 1]] = req
        count.add(req, k)
    if pool.num_free_blocks != pool.num_usable_blocks:
        raise RuntimeError("pool replay leaked blocks")
    return {"capacity_blocks": cap, "capacity_tokens": None if cap is None else cap * BT,
            "pool_blocks": pool_blocks, **count.totals(), "evictions": pool.stats.evictions,
            "link_breaks": link_breaks, "unlinked_present": unlinked, "partial_tail_tokens": tail_tokens,
            "token_hit_rate_with_tails": hit_rate(count.hit_tokens + tail_tokens, count.input_tokens)}


def lru_row(rows: Sequence[MooncakeRequest], cap_tokens: int) -> Row:
    """Pool replay and the LRU model at one capacity; ``agree`` when they give the same hits per
    request and the same eviction count."""
    res = pool_replay(rows, cap_tokens // BT)
    ref = tr.mooncake_lru_replay(rows, cap_tokens // BT)
    row = {k: v for k, v in res.items() if k != "per_request_hit_tokens"}
    row.update(capacity_tokens=cap_tokens, oracle_token_hit_rate=ref["token_hit_rate"],
               oracle_evictions=ref["evictions"],
               agree=(ref["per_request_hit_tokens"] == res["per_request_hit_tokens"]
                      and ref["evictions"] == res["evictions"]))
    return row


def run_mooncake_replay(out_dir: str | Path, traces: dict[str, Path],
                        capacities: Sequence[int] | None = None, limit: int | None = None,
                        paper_path: str | Path | None = None, quick: bool = False,
                        log: Any = print) -> dict[str, Any]:
    """Replay each trace over the capacities, write ``mooncake_hit_rate.{png,json,csv}`` into
    `out_dir`, and return what was written: the curves, each trace's unbounded hit rate (``ceiling``),
    the paper's points and the comparison with them."""
    caps = list(capacities) if capacities is not None else default_capacities(quick)
    try:
        paper = {k: v for k, v in tr.mooncake_paper_points(paper_path).items() if k in traces}
    except FileNotFoundError:
        paper = {}
    curves = _curves("lru", traces, caps, limit, lru_row, log, note=lambda rows: (
        f"; pool == oracle at every capacity: {all(r['agree'] for r in rows)}"))
    ceiling = {name: tr.mooncake_lru_replay(load_mooncake(path, limit), None)["token_hit_rate"]
               for name, path in traces.items()}
    comparison = []
    for name, rows in curves.items():
        at = {r["capacity_tokens"]: r for r in rows}
        comparison += [{"trace": name, "capacity_tokens": cap, "paper": rate,
                        "kvstore": r["token_hit_rate"], "with_tails": r["token_hit_rate_with_tails"]}
                       for cap, rate in paper.get(name, []) if (r := at.get(cap)) is not None]

    def paper_and_ceiling(ax: Any, name: str) -> None:
        if pts := paper.get(name):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", mfc="none", color="tab:red",
                    ms=9, mew=1.5, label="paper Fig. 9 (read by eye)")
        ax.axhline(ceiling[name], color="gray", ls=":", lw=1, label="unbounded cache")

    return write_panels(Path(out_dir), "mooncake_hit_rate", curves, [
        ("token_hit_rate", "-", {"lw": 2}, "kvstore BlockPool replay"),
        ("oracle_token_hit_rate", "x", {"ms": 6, "color": "black"}, "LRU model"),
        ("token_hit_rate_with_tails", "--", {"lw": 1.2},
         "+ previous turn's cached partial block (estimate)")],
        "LRU cache capacity (tokens, 512-token blocks)", "Mooncake {name}: hit rate vs capacity",
        {"capacities_tokens": caps, "limit": limit, "ceiling": ceiling, "paper_points": paper,
         "comparison": comparison}, paper_and_ceiling)


def format_paper(comparison: Sequence[Row]) -> Table:
    """At each of the paper's capacities, its hit rate and the pool's (with and without the previous
    turn's partial block), each with its difference to the paper."""
    legend = ("paper: the Mooncake paper's Fig. 9, read by eye; pool: kvstore's pool, equal to the LRU "
              "model; +tail: the pool with the previous turn's partial block cached (an estimate); diff: "
              "against the paper")
    return legend, ["trace", "capacity", "paper", "pool", "diff", "+tail", "diff"], [
        [c["trace"], f"{c['capacity_tokens']:,}", f"{c['paper']:.3f}", f"{c['kvstore']:.3f}",
         f"{c['kvstore'] - c['paper']:+.3f}", f"{c['with_tails']:.3f}",
         f"{c['with_tails'] - c['paper']:+.3f}"] for c in comparison]


# --------------------------------------- policies: online policies, the reuse oracle, MIN
# The paper's capacities where the eviction goal applies, in tokens.
GAP_CAPACITIES: tuple[int, ...] = (1_000_000, 2_000_000, 3_000_000, 5_000_000)

_NEVER = 1 << 62


def _offline(requests: Iterable[MooncakeRequest], capacity_blocks: int, cache: Container[int],
             hold: Callable[[tuple[int, ...], list[int]], int]) -> dict[str, Any]:
    """The request model of `mooncake_lru_replay` under an offline policy: each row (timestamp order)
    hits its leading run in `cache`, then ``hold(kept ids, the row where each is next used)`` admits
    its first `capacity_blocks` ids and returns how many it evicted."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    rows, cap = _by_time(requests), capacity_blocks
    last_seen: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in rows]  # per row, each kept id's next row (or _NEVER)
    for r in range(len(rows) - 1, -1, -1):
        next_use[r] = [last_seen.get(h, _NEVER) for h in rows[r].hash_ids[:cap]]
        last_seen.update((h, r) for h in rows[r].hash_ids[:cap])
    count = HitCount(BT)
    evictions = unlinked = 0
    for req, nxt in zip(rows, next_use, strict=True):
        k = leading_run(req.hash_ids, cache)
        keep = req.hash_ids[:cap]
        unlinked += sum(1 for h in keep[k:] if h in cache)
        count.add(req, k)
        evictions += hold(keep, nxt)
    return {"capacity_blocks": cap, "capacity_tokens": cap * BT, **count.totals(), "evictions": evictions,
            "unlinked_present": unlinked}


def min_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int) -> dict[str, Any]:
    """Belady's MIN: evict the unheld block whose next use is furthest (deeper first on ties).
    ``unlinked_present`` counts present blocks outside the hit run (0: prefix-closed)."""
    cache: dict[int, int] = {}  # id -> its current next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, id); stale entries skipped

    def hold(keep: tuple[int, ...], next_use: list[int]) -> int:
        held = set(keep)
        need = len(cache) + sum(1 for h in keep if h not in cache) - capacity_blocks
        evicted = 0
        while evicted < need:
            neg_next, _, h = heapq.heappop(heap)
            if cache.get(h) == -neg_next and h not in held:  # else stale, or held
                del cache[h]
                evicted += 1
        for depth, (h, nxt) in enumerate(zip(keep, next_use, strict=True)):
            cache[h] = nxt
            heapq.heappush(heap, (-nxt, -depth, h))
        return evicted

    return _offline(requests, capacity_blocks, cache, hold)


def reuse_oracle_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int) -> dict[str, Any]:
    """LRU that evicts first the blocks no later request uses (LRU among those, then among the rest):
    it knows whether a block returns, not when."""
    dead: OrderedDict[int, None] = OrderedDict()  # never used again; first = LRU
    live: OrderedDict[int, None] = OrderedDict()

    def hold(keep: tuple[int, ...], next_use: list[int]) -> int:
        for h in keep:
            live.pop(h, None)
            dead.pop(h, None)
        evicted = 0
        while (dead or live) and len(dead) + len(live) + len(keep) > capacity_blocks:
            (dead if dead else live).popitem(last=False)
            evicted += 1
        for h, nxt in zip(reversed(keep), reversed(next_use), strict=True):
            (dead if nxt == _NEVER else live)[h] = None
        return evicted

    return _offline(requests, capacity_blocks, ChainMap(live, dead), hold)


def gap_closed(rate: float, lru: float, opt: float) -> float | None:
    """The fraction of the LRU-to-MIN gap a policy's hit rate closes (None without a gap)."""
    return None if opt - lru <= 1e-12 else (rate - lru) / (opt - lru)


def policy_row(policies: Sequence[str], rows: Sequence[MooncakeRequest], cap_tokens: int) -> Row:
    """At one capacity: each policy's token hit rate, the reuse oracle's, MIN's, and the gap each
    closes."""
    blocks = cap_tokens // BT
    opt = min_replay(rows, blocks)
    row: Row = {"capacity_tokens": cap_tokens, "min": opt["token_hit_rate"],
                "min_unlinked_present": opt["unlinked_present"],
                "reuse_oracle": reuse_oracle_replay(rows, blocks)["token_hit_rate"]}
    for name in policies:
        row[name] = pool_replay(rows, blocks, eviction=name)["token_hit_rate"]
    if "lru" in row:
        for name in [*policies, "reuse_oracle"]:
            row[f"{name}_gap_closed"] = gap_closed(row[name], row["lru"], row["min"])
    return row


def run_eviction_replay(out_dir: Path, traces: dict[str, Path], capacities: Sequence[int],
                        policies: Sequence[str], limit: int | None) -> dict[str, Any]:
    """Replay each trace under every policy and MIN; write ``eviction_hit_rate.{png,json,csv}`` into
    `out_dir` and return the curves."""
    curves = _curves("policies", traces, capacities, limit, partial(policy_row, policies), print)
    return write_panels(out_dir, "eviction_hit_rate", curves, [
        *((p, "-o", {"ms": 3}, p) for p in policies),
        ("reuse_oracle", ":", {"color": "gray"}, "LRU knowing which blocks return (offline)"),
        ("min", "--", {"color": "black"}, "MIN (offline)")],
        "capacity (tokens, 512-token blocks)", "Mooncake {name}: eviction policies",
        {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit})


def format_policies(curves: Curves, policies: Sequence[str]) -> Table:
    """Per trace and capacity, each policy's hit rate (gap closed), the reuse oracle's and MIN's."""
    legend = ("token hit rate (whole 512-token blocks) per eviction policy, and the share of the LRU-to-MIN "
              "gap it closes; oracle: the reuse oracle (LRU that knows which blocks never return); MIN: "
              "Belady's offline optimum")

    def cell(r: Row, p: str) -> str:
        g = r.get(f"{p}_gap_closed")
        return f"{r[p]:.3f}" + ("" if p == "lru" or g is None else f" {g:+.0%}")

    return legend, ["trace", "capacity", *policies, "oracle", "MIN"], [
        [name, _million(r), *(cell(r, p) for p in [*policies, "reuse_oracle"]), f"{r['min']:.3f}"]
        for name, rows in curves.items() for r in rows]


# ------------------------------------------ layouts: a hybrid layout through the manager
# Gemma-3-27B-like: 62 layers, every sixth full attention (10), the rest windows of 1024.
LAYOUT = ModelShape("gemma-3-27b-like", num_layers=62, num_kv_heads=16, head_dim=128)
FULL_LAYERS = 10
CAPACITIES: tuple[int, ...] = (300_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000)
QUICK_CAPACITIES: tuple[int, ...] = (1_000_000, 3_000_000, 10_000_000)


def layer_specs(layout: str) -> list[KVCacheSpec]:
    """The 62 layer specs of a layout: ``hybrid`` (Gemma-3-27B-like) or ``full``."""
    if layout not in ("hybrid", "full"):
        raise ValueError(f"unknown layout {layout!r}; known: hybrid, full")
    return (LAYOUT.hybrid_specs if layout == "hybrid" else LAYOUT.full_specs)(BT)


def _fast_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The block's first token (its trace id, which names its prefix) chained to its parent."""
    return hash((parent, token_ids[0])) & ((1 << 64) - 1)


def hybrid_replay(requests: Sequence[MooncakeRequest], capacity_tokens: int,
                  eviction: str = "lru", layout: str = "hybrid") -> dict[str, Any]:
    """Replay rows through a KVCacheManager of `layout` at the bytes of an all-full cache of
    `capacity_tokens` tokens: hit totals, ``truncated`` rows, ``cut_rate`` (tokens whose full chain
    was cached but not their window pages) and per-group page counts (``groups``)."""
    specs = layer_specs(layout)
    num_pages = capacity_tokens // BT * len(specs) // make_kv_cache_config(specs, num_blocks=2).num_slots
    config = make_kv_cache_config(specs, num_blocks=num_pages + 1)
    ng = len(config.groups)
    manager = new_manager(config, enable_partial_hits=False, enable_events=True, hash_fn=_fast_hash,
                          eviction=eviction)
    max_blocks = num_pages // ng - 1  # a page per group per block, and one for the extra token
    rows = _by_time(requests)
    stored, evicted, cached_sum, hit_pages = (np.zeros(ng, dtype=np.int64) for _ in range(4))
    count = HitCount(BT)
    truncated = cut_tokens = 0
    for n, row in enumerate(rows):
        ids = row.hash_ids[:max_blocks]
        truncated += len(ids) < len(row.hash_ids)
        num_tokens = min(row.input_length, len(ids) * BT)
        tokens = np.zeros(num_tokens, dtype=np.int64)
        tokens[::BT] = np.asarray(ids[:-(-num_tokens // BT)]) + 1
        _, _, computed = serve(manager, Request(f"r{n}", tokens), "chunks", BT, [0.0])
        hit_pages += [sum(1 for b in blocks if b.block_id != 0) for blocks in computed.blocks]
        for ev in manager.take_events():
            if isinstance(ev, BlockStored):
                stored[ev.group_id] += 1
            elif isinstance(ev, BlockRemoved):
                evicted[ev.group_id] += 1
        cached_sum += stored - evicted
        k = computed.num_computed_tokens // BT
        verified = min(computed.num_verified_tokens, row.input_length)
        cut_tokens += verified - min(k * BT, row.input_length, verified)
        count.add(row, k)
    if manager.num_free_blocks != manager.num_usable_blocks:
        raise RuntimeError("hybrid replay leaked pages")
    groups = [{"group": g, "kind": "full" if isinstance(group.spec, FullAttentionSpec) else "window",
               "layers": len(group.layer_ids), "stored": int(stored[g]), "evicted": int(evicted[g]),
               "cached_end": int(stored[g] - evicted[g]),
               "cached_mean": int(cached_sum[g]) / max(1, len(rows)), "hit_pages": int(hit_pages[g])}
              for g, group in enumerate(config.groups)]
    return {"layout": layout, "eviction": eviction, "capacity_tokens": capacity_tokens,
            "num_blocks": num_pages, "truncated": truncated, **count.totals(), "cut_tokens": cut_tokens,
            "cut_rate": hit_rate(cut_tokens, count.input_tokens), "groups": groups}


def capacity_row(policies: Sequence[str], rows: Sequence[MooncakeRequest], cap: int) -> Row:
    """At one budget: each hybrid policy's hit rate (and per-group breakdown), all-full LRU's, and the
    bound where windowed pages cost nothing (the full group holds every byte)."""
    row: Row = {"capacity_tokens": cap,
                "full_lru": hybrid_replay(rows, cap, "lru", layout="full")["token_hit_rate"],
                "bound": pool_replay(rows, cap // BT * LAYOUT.num_layers // FULL_LAYERS)["token_hit_rate"],
                "groups": {}}
    for name in policies:
        res = hybrid_replay(rows, cap, name)
        row.update({name: res["token_hit_rate"], f"{name}_cut": res["cut_rate"],
                    "truncated": res["truncated"]})
        row["groups"][name] = res["groups"]
    return row


def format_layouts(curves: Curves, policies: Sequence[str]) -> Table:
    """Per trace and budget, all-full LRU, the hybrid layout under each policy, the bound."""
    legend = ("token hit rate (whole 512-token blocks) of the hybrid layout under each policy; all-full "
              "lru: every layer full attention, LRU; bound: the full group alone with every byte (windowed "
              "pages free)")
    return legend, ["trace", "budget", "all-full lru", *policies, "bound"], [
        [name, _million(r), *(f"{r[k]:.3f}" for k in ["full_lru", *policies, "bound"])]
        for name, rows in curves.items() for r in rows]


def format_groups(curves: Curves, policies: Sequence[str]) -> Table:
    """Per trace, budget and policy, pages mean cached / evicted / hit for the full group and the
    window groups, and the input share a window cut from a full-attention hit."""
    legend = ("pages of the full group and of the window groups: mean cached, evicted and hit (k/M: "
              "thousands/millions); cut: the input share a window cut from a full-attention hit")

    def cells(r: Row, p: str, kind: str) -> list[str]:
        gs = [g for g in r["groups"][p] if g["kind"] == kind]
        return [output.short_count(round(sum(g[k] for g in gs)))
                for k in ("cached_mean", "evicted", "hit_pages")]

    return legend, ["trace", "budget", "policy", "full kept", "evicted", "hit", "window kept", "evicted",
                    "hit", "cut"], [
        [name, _million(r), p, *cells(r, p, "full"), *cells(r, p, "window"), f"{r[f'{p}_cut']:.3f}"]
        for name, rows in curves.items() for r in rows for p in policies]


def run_hybrid_replay(out_dir: Path, traces: dict[str, Path], capacities: Sequence[int],
                      policies: Sequence[str], limit: int | None, jobs: int) -> dict[str, Any]:
    """Replay each trace under every policy, all-full LRU and the bound (`jobs` processes); write
    ``eviction_hybrid.{png,json,csv}`` into `out_dir` and return the curves."""
    row = partial(capacity_row, tuple(policies))
    curves = _curves("layouts", traces, capacities, limit, row, print, jobs)
    return write_panels(out_dir, "eviction_hybrid", curves, [
        *((p, "-o", {"ms": 3}, f"hybrid {p}") for p in policies),
        ("full_lru", "-s", {"color": "black", "ms": 3}, "all-full lru"),
        ("bound", "--", {"color": "gray"}, "bound: windowed pages free")],
        "budget (tokens of an all-full cache, 512-token blocks)",
        "Mooncake {name}: 10 full + 52 window (W=1024) layers",
        {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit})
