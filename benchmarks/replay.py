"""``kvstore bench replay``: hit rate against cache capacity on a block-hash trace (the
Mooncake format: each row names its 512-token blocks by prefix-chained hash ids). Hits
are counted in whole blocks, at most the row's input length, as the Mooncake paper does.

What it replays, by ``--what``:

- ``lru``: kvstore's ``BlockPool`` next to the LRU model (``traces.mooncake_lru_replay``),
  with the paper's points (``mooncake_hit_rate``);
- ``policies``: every eviction policy through the pool, LIRS, the reuse oracle (LRU that
  knows which blocks never return) and Belady's MIN (``eviction_hit_rate``);
- ``layouts``: a hybrid layout (10 full + 52 sliding-window layers) through the real
  ``KVCacheManager`` under each policy, next to all-full LRU and the bound where windowed
  pages cost nothing (``eviction_hybrid``);
- ``tiers``: device-only LRU, a host tier below it, and instances sharing a store;
- ``memory`` (no trace): a Gemma-3-like hybrid layout against the same layers all full at
  one byte budget, through the simulator: memory per request, concurrency, prefix hits
  (``hybrid_memory``).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from kvstore.benchmarks import traces as tr
from kvstore.benchmarks.manager import new_manager
from kvstore.benchmarks.output import (
    mark_x,
    name_list,
    non_negative_int,
    positive_int,
    pyplot,
    short_count,
    write_csv,
    write_json,
)
from kvstore.benchmarks.simulator import SimResult, simulate
from kvstore.benchmarks.sweep import ModelShape
from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    HitCount,
    MooncakeRequest,
    leading_run,
    load_mooncake,
    mooncake_lru_replay,
    mooncake_paper_points,
)
from kvstore.benchmarks.workloads import RequestSpec, ideal_hit_tokens, shared_system_prompts
from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool, BlockRemoved, BlockStored
from kvstore.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvstore.eviction import EVICTION_POLICIES, EvictionPolicy
from kvstore.hashing import BlockHash
from kvstore.request import Request
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from kvstore.utils import hit_rate


def _by_time(requests: Iterable[MooncakeRequest]) -> list[MooncakeRequest]:
    return sorted(requests, key=lambda r: r.timestamp_ms)


WHAT = ("lru", "policies", "layouts", "tiers", "memory")
# Built-in trace names -> trace file keys.
TRACE_NAMES: dict[str, str] = {"conversation": "mooncake_conversation",
                               "synthetic": "mooncake_synthetic"}


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
        raise argparse.ArgumentTypeError(f"{e} (expected Mooncake JSONL: a JSON object a line "
                                         "with timestamp, input_length, output_length, "
                                         "hash_ids)") from None
    return path.stem, path


def _store_tokens(text: str) -> list[int | None]:
    """argparse type: a comma list of token counts, ``inf`` for unbounded."""
    return [None if t.strip() == "inf" else _tokens(t)[0] for t in text.split(",") if t.strip()]


def _tokens(text: str) -> list[int]:
    from kvstore.benchmarks.sweep import parse_size

    try:
        caps = [int(float(c)) if c.replace(".", "").replace("e", "").isdigit() else parse_size(c)
                for c in text.replace("_", "").split(",") if c]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not caps or min(caps) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of token counts >= 1, got {text!r}")
    return caps


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench replay``."""
    p.add_argument("--trace", type=_trace, action="append", metavar="NAME|PATH",
                   help=f"a trace file, or a built-in name ({', '.join(TRACE_NAMES)}); "
                        "repeatable (default: both built-in traces)")
    p.add_argument("--what", type=name_list(WHAT), default=["lru", "policies"], metavar="LIST",
                   help=f"comma list of {', '.join(WHAT)}")
    p.add_argument("--capacities", type=_tokens, metavar="LIST",
                   help="comma list of capacities in tokens (default per replay: lru the paper's "
                        "and a log grid, policies 1M..5M, layouts 1M..10M)")
    p.add_argument("--policies", type=name_list(tuple(EVICTION_POLICIES)),
                   default=list(EVICTION_POLICIES), metavar="LIST",
                   help=f"eviction policies, comma list of {', '.join(EVICTION_POLICIES)}")
    p.add_argument("--limit", type=positive_int, default=None, metavar="N",
                   help="first N rows of each trace; memory: requests per phase (default 100, "
                        "40 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="the first 2000 rows, the paper's capacities for lru")
    p.add_argument("--jobs", type=positive_int, default=1, help="processes for layouts")
    p.add_argument("--device-tokens", type=positive_int, default=3_000_000,
                   help="tiers: device capacity")
    p.add_argument("--host-tokens", type=non_negative_int, default=30_000_000,
                   help="tiers: host tier capacity")
    p.add_argument("--instances", type=positive_int, default=4,
                   help="tiers: instances sharing a store")
    p.add_argument("--store-tokens", type=_store_tokens, metavar="LIST",
                   help="tiers: comma list of store capacities in tokens, inf for unbounded "
                        "(default: inf, 10x and 1x --device-tokens)")
    p.add_argument("--out", type=Path, default=Path("results/replay"), help="output folder")


def run(args: argparse.Namespace) -> int:
    """Run the replays `args` ask for; write figures, JSON and CSV; print tables and a
    headline. A bad row in a trace file is a usage error."""
    try:
        return _run(args)
    except ValueError as e:
        if "bad Mooncake row" not in str(e):
            raise
        return args.usage_error(f"argument --trace: {e}")


def _run(args: argparse.Namespace) -> int:
    if args.trace or args.what == ["memory"]:
        traces = dict(args.trace or [])
    else:
        traces = {name: _trace(name)[1] for name in TRACE_NAMES} if all(
            _exists(k) for k in TRACE_NAMES.values()) else args.usage_error(
            "argument --trace: the built-in traces are not here; " + tr.trace_source(
                "mooncake_conversation"))
    limit = args.limit if args.limit is not None else (2000 if args.quick else None)
    out = Path(args.out)
    t0 = time.perf_counter()
    headline: list[str] = []
    caps = args.capacities
    if "lru" in args.what:
        res = run_mooncake_replay(out, traces, caps, limit, quick=args.quick)
        agree = all(r.get("agree", True) for rows in res["curves"].values() for r in rows)
        for name, rows in res["curves"].items():
            top = rows[-1]
            print(f"lru {name}: hit {rows[0]['token_hit_rate']:.3f} at "
                  f"{rows[0]['capacity_tokens']:,} tokens .. {top['token_hit_rate']:.3f} at "
                  f"{top['capacity_tokens']:,}")
        headline.append(f"LRU: the pool {'equals' if agree else 'DIFFERS FROM'} the LRU model at "
                        f"every capacity ({out}/mooncake_hit_rate.png)")
    if "policies" in args.what:
        res = run_eviction_replay(
            out, traces, caps or GAP_CAPACITIES, args.policies, limit)
        print("\n".join(format_policies(res["curves"], args.policies)))
        best = max(((r[p] - r.get("lru", r[p]), p, n, r["capacity_tokens"])
                    for n, rows in res["curves"].items() for r in rows for p in args.policies))
        headline.append(f"policies: best gain over LRU {best[0]:+.3f} ({best[1]}, {best[2]} at "
                        f"{best[3]:,} tokens); MIN bounds every line ({out}/eviction_hit_rate.png)")
    if "layouts" in args.what:
        res = run_hybrid_replay(
            out, traces, caps or CAPACITIES, args.policies, limit, args.jobs)
        print("\n".join(format_layouts(res["curves"], args.policies)))
        print("\n".join(format_groups(res["curves"], args.policies)))
        worst = min((r[p] - r["full_lru"], p, n, r["capacity_tokens"])
                    for n, rows in res["curves"].items() for r in rows for p in args.policies)
        headline.append(f"layouts: the hybrid's largest loss against all-full LRU {worst[0]:+.3f} "
                        f"({worst[1]}, {worst[2]} at {worst[3]:,} tokens)")
    if "tiers" in args.what:
        for name, path in traces.items():
            headline.append(_tiers(name, path, args, limit))
    if "memory" in args.what:
        headline.append(run_memory(out, args.limit or (40 if args.quick else 100)))
    print("\n" + "\n".join(headline) + f"\n({time.perf_counter() - t0:.0f} s; files in {out}/)")
    return 0


def _progress(what: str, capacities: Sequence[int]) -> Callable[[int], None]:
    """A progress line on stderr as each capacity starts."""
    order = {c: i for i, c in enumerate(capacities, 1)}
    return lambda cap: print(f"  {what}: [{order[cap]}/{len(order)}] {cap:,} tokens ...",
                             file=sys.stderr, flush=True)


def _exists(key: str) -> bool:
    try:
        tr.locate_trace(key)
    except FileNotFoundError:
        return False
    return True


def _tiers(name: str, path: Path, args: argparse.Namespace, limit: int | None) -> str:
    """The LRU model device-only, with a host tier below it (written on free, or with what
    the device evicts), and as instances sharing a store; printed, written as JSON, summed
    up in one line."""
    rows = tr.load_mooncake(path, limit)
    bt = tr.MOONCAKE_BLOCK_TOKENS
    dev, host, n = args.device_tokens // bt, args.host_tokens // bt, args.instances
    if n < 1 or dev < n:
        args.usage_error(f"argument --instances: must be in 1..{dev} (device blocks), got {n}")
    runs = {"device-only LRU": mooncake_lru_replay(rows, dev),
            "device + host, on-free": mooncake_lru_replay(rows, dev, tier_blocks=host),
            "device + host, write-back": mooncake_lru_replay(rows, dev, tier_blocks=host,
                                                             write_back=True),
            "unbounded": mooncake_lru_replay(rows, None),
            f"{n} instances, local only": mooncake_lru_replay(rows, dev // n, instances=n)}
    for tokens in args.store_tokens or (None, 10 * args.device_tokens, args.device_tokens):
        runs[f"{n} instances + store {'unbounded' if tokens is None else f'{tokens:,}'}"] = (
            mooncake_lru_replay(rows, dev // n, instances=n,
                                tier_blocks=None if tokens is None else tokens // bt))
    print(f"\ntiers {name}: {len(rows)} requests, device {args.device_tokens:,} tokens, host "
          f"{args.host_tokens:,}; block / token hit rate")
    for label, r in runs.items():
        print(f"  {label:32s} {r['block_hit_rate']:6.3f} {r['token_hit_rate']:6.3f}")
    keep = ("block_hit_rate", "token_hit_rate", "device_hit_rate", "tier_hit_blocks")
    write_json(args.out / f"tier_replay_{name}.json", {"trace": str(path), "rows": {
        label: {k: r[k] for k in keep} for label, r in runs.items()}})
    one, shared = runs["device-only LRU"], runs[f"{n} instances + store unbounded"]
    return (f"tiers {name}: a host tier lifts LRU from {one['block_hit_rate']:.3f} to "
            f"{runs['device + host, write-back']['block_hit_rate']:.3f}; {n} instances sharing "
            f"a store keep {shared['block_hit_rate'] / one['block_hit_rate']:.2f}x one "
            f"instance's hits")


# --------------------------------------------------- lru: the pool against the LRU model


PAPER_CAPACITIES: tuple[int, ...] = (10_000, 100_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000,
                                     10_000_000, 50_000_000, 100_000_000, 1_000_000_000)


def default_capacities(per_decade: int = 4, quick: bool = False) -> list[int]:
    """Capacities in tokens: the paper's, plus a log grid from 1e4 to 1e9 (none in quick mode)."""
    caps = set(PAPER_CAPACITIES)
    if not quick:
        for e in range(4 * per_decade, 9 * per_decade + 1):
            caps.add(int(round(10 ** (e / per_decade), -2)))
    return sorted(caps)


def pool_replay(requests: Iterable[MooncakeRequest], capacity_blocks: int | None,
                block_tokens: int = MOONCAKE_BLOCK_TOKENS, eviction: str = "lru") -> dict[str, Any]:
    """Replay Mooncake rows through a BlockPool of ``capacity_blocks`` usable blocks
    (None: unbounded) under the named eviction policy. Returns the LRU model's totals plus
    ``pool_blocks`` (capped at the distinct ids: identical results), ``link_breaks`` (a
    leading id cached but not linked to its parent; 0 on a consistent trace),
    ``unlinked_present`` (ids cached after the hit run) and ``partial_tail_tokens`` /
    ``token_hit_rate_with_tails`` (an estimate adding a chat turn's reuse of the previous
    turn's cached partial last block)."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    rows = _by_time(requests)
    distinct = len({h for r in rows for h in r.hash_ids})
    cap = capacity_blocks
    pool_blocks = distinct if cap is None else min(cap, distinct)
    out: dict[str, Any] = {"capacity_blocks": cap,
                           "capacity_tokens": None if cap is None else cap * block_tokens,
                           "pool_blocks": pool_blocks}
    count = HitCount(block_tokens)
    if pool_blocks == 0:  # nothing can be cached
        for req in rows:
            count.add(req, 0)
        out.update(count.totals(), evictions=0, link_breaks=0, unlinked_present=0,
                   partial_tail_tokens=0, token_hit_rate_with_tails=0.0)
        return out
    pool = BlockPool(pool_blocks + 1, enable_caching=True, eviction=eviction)
    root = pool.root_serial(None)
    find, cached, touch = pool.find_cached, pool.cached_blocks, pool.touch
    link_breaks = unlinked = tail_tokens = 0
    last_full: dict[int, MooncakeRequest] = {}  # id of a request's last full block -> request
    for req in rows:
        keep = req.hash_ids if cap is None else req.hash_ids[:cap]
        table: list[KVCacheBlock | None] = []
        parent = root
        k = 0
        for h in keep:  # the hit: consecutive linked blocks from the root
            block = find(0, h, (h,), parent_serial=parent)
            if block is None:
                break
            table.append(block)
            parent = block.serial
            k += 1
        if k < len(keep) and cached(0, keep[k], (keep[k],)):
            link_breaks += 1
        tail_tokens += _continued_tail(req, k, last_full, block_tokens,
                                       lambda h: bool(cached(0, h, (h,))))
        for h in keep[k:]:  # after the run: present blocks are reused, missing ones computed
            same = cached(0, h, (h,))
            block = same[0] if same else None
            unlinked += block is not None
            table.append(block)
        touch(b for b in table if b is not None)
        missing = [i for i, b in enumerate(table) if b is None]
        for i, block in zip(missing, pool.get_new_blocks(len(missing), 0), strict=True):
            table[i] = block
        parent = root
        new = set(missing)
        for i, (h, block) in enumerate(zip(keep, table, strict=True)):
            assert block is not None
            parent = (pool.cache_full_block(block, block_hash=h, token_ids=(h,), parent_serial=parent)
                      if i in new else block.serial)
        pool.free_blocks(reversed(table))  # type: ignore[arg-type]
        n_full = req.input_length // block_tokens
        if n_full:
            last_full[req.hash_ids[n_full - 1]] = req
        count.add(req, k)
    if pool.num_free_blocks != pool.num_usable_blocks:
        raise RuntimeError("pool replay leaked blocks")
    out.update(count.totals(), evictions=pool.stats.evictions, link_breaks=link_breaks,
               unlinked_present=unlinked, partial_tail_tokens=tail_tokens,
               token_hit_rate_with_tails=hit_rate(count.hit_tokens + tail_tokens, count.input_tokens))
    return out


def _continued_tail(req: MooncakeRequest, k: int, last_full: dict[int, MooncakeRequest],
                    block_tokens: int, present: Callable[[int], bool]) -> int:
    """Tokens of an earlier request's partial last block that `req` repeats, when `req`
    continues that request (its hit run of `k` blocks ends at the earlier request's last
    full block and it is longer than the earlier input plus output) and the partial
    block is still cached; else 0."""
    p = last_full.get(req.hash_ids[k - 1]) if k else None
    if p is None or req.input_length <= p.input_length + p.output_length:
        return 0
    tail = p.input_length - k * block_tokens
    if k != p.input_length // block_tokens or tail <= 0 or not present(p.hash_ids[-1]):
        return 0
    return tail


def replay_curve(requests: Sequence[MooncakeRequest], capacities_tokens: Sequence[int],
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                 progress: Callable[[int], None] = lambda cap: None) -> list[dict[str, Any]]:
    """Pool replay (and the oracle) at each capacity; one row per capacity, with
    ``agree`` True when the pool and the oracle give the same hits per request and the
    same eviction count."""
    rows = _by_time(requests)
    out = []
    for cap_tokens in capacities_tokens:
        progress(cap_tokens)
        blocks = cap_tokens // block_tokens
        t0 = time.perf_counter()
        res = pool_replay(rows, blocks, block_tokens)
        t_pool = time.perf_counter() - t0
        row = {k: v for k, v in res.items() if k != "per_request_hit_tokens"}
        row.update(capacity_tokens=cap_tokens, pool_s=t_pool)
        t0 = time.perf_counter()
        ref = mooncake_lru_replay(rows, blocks, block_tokens)
        row["oracle_s"] = time.perf_counter() - t0
        row["oracle_token_hit_rate"] = ref["token_hit_rate"]
        row["oracle_evictions"] = ref["evictions"]
        row["agree"] = (ref["per_request_hit_tokens"] == res["per_request_hit_tokens"]
                        and ref["evictions"] == res["evictions"])
        out.append(row)
    return out


def gap_analysis(requests: Sequence[MooncakeRequest],
                 block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """What bounds the curve: the unbounded (infinite cache) hit rate under the paper's
    whole-block counting, and what it would be if reuse also covered the previous turn's
    partial last block and its output.

    A request "continues" an earlier one when its hit run ends exactly at the earlier
    request's last full block and it is longer than that request's input plus output
    (a chat's next turn: the trace hashes the earlier partial block anew once it fills).
    """
    rows = _by_time(requests)
    seen: set[int] = set()
    last_full: dict[int, MooncakeRequest] = {}  # id of a request's last full block -> request
    input_tokens = sum(r.input_length for r in rows)
    total_blocks = sum(len(r.hash_ids) for r in rows)
    base = tails = outputs = continuing = 0
    for r in rows:
        ids = r.hash_ids
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        base += min(k * block_tokens, r.input_length)
        p = last_full.get(ids[k - 1]) if k else None
        if p is not None and r.input_length > p.input_length + p.output_length:
            p_full = p.input_length // block_tokens
            if k == p_full:
                continuing += 1
                tails += p.input_length - p_full * block_tokens
                outputs += p.output_length
        seen.update(ids)
        n_full = r.input_length // block_tokens
        if n_full:
            last_full[ids[n_full - 1]] = r
    distinct = len(seen)
    rate = (lambda x: x / input_tokens) if input_tokens else (lambda x: 0.0)
    return {
        "requests": len(rows),
        "input_tokens": input_tokens,
        "total_blocks": total_blocks,
        "distinct_blocks": distinct,
        "block_ceiling": 1 - distinct / total_blocks if total_blocks else 0.0,
        "token_ceiling": rate(base),
        "continuing_requests": continuing,
        "ceiling_with_partial_tails": rate(base + tails),
        "ceiling_with_tails_and_outputs": rate(base + tails + outputs),
        "starts_with_block_0": sum(1 for r in rows if r.hash_ids and r.hash_ids[0] == 0),
    }


def plot_curves(curves: dict[str, list[dict[str, Any]]],
                paper: dict[str, list[tuple[int, float]]], path: str | Path,
                ceilings: dict[str, dict[str, Any]] | None = None) -> None:
    """One figure: each trace's pool-replay curve (and oracle markers), the paper's
    points, and each trace's unbounded ceiling, against capacity in tokens (log x)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = {"conversation": "tab:blue", "synthetic": "tab:orange"}
    for name, rows in curves.items():
        c = colors.get(name, None)
        xs = [r["capacity_tokens"] for r in rows]
        ax.plot(xs, [r["token_hit_rate"] for r in rows], "-", color=c, lw=2,
                label=f"{name}: kvstore BlockPool replay")
        if rows and "oracle_token_hit_rate" in rows[0]:
            ax.plot(xs, [r["oracle_token_hit_rate"] for r in rows], "x", color=c, ms=6,
                    label=f"{name}: LRU oracle")
        if rows and "token_hit_rate_with_tails" in rows[0]:
            ax.plot(xs, [r["token_hit_rate_with_tails"] for r in rows], "--", color=c, lw=1.2,
                    label=f"{name}: + previous turn's cached partial block (estimate)")
        pts = paper.get(name, [])
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", mfc="none", color=c, ms=9,
                    mew=1.5, label=f"{name}: paper Fig. 9 (read by eye)")
        if ceilings and name in ceilings:
            ax.axhline(ceilings[name]["token_ceiling"], color=c, ls=":", lw=1)
    mark_x(ax, [r["capacity_tokens"] for rows in curves.values() for r in rows], short_count)
    ax.set_xlabel("LRU cache capacity (tokens, 512-token blocks)")
    ax.set_ylabel("token hit rate (whole-block counting)")
    ax.set_title("Mooncake FAST'25 traces: hit rate vs cache capacity\n"
                 "(dotted: the trace's infinite-cache ceiling)")
    ax.set_ylim(0, max(0.75, ax.get_ylim()[1]))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_mooncake_replay(out_dir: str | Path, traces: dict[str, Path],
                        capacities: Sequence[int] | None = None, limit: int | None = None,
                        paper_path: str | Path | None = None, quick: bool = False,
                        log: Any = print) -> dict[str, Any]:
    """Replay each trace over the capacities, write ``mooncake_hit_rate.{png,json,csv}``
    into `out_dir`, and return what was written (curves, gap analysis, paper points)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    caps = list(capacities) if capacities is not None else default_capacities(quick=quick)
    try:
        paper = mooncake_paper_points(paper_path)
    except FileNotFoundError:
        paper = {}
    curves: dict[str, list[dict[str, Any]]] = {}
    gaps: dict[str, dict[str, Any]] = {}
    for name, path in traces.items():
        rows = load_mooncake(path, limit)
        t0 = time.perf_counter()
        curves[name] = replay_curve(rows, caps, progress=_progress(f"lru {name}", caps))
        gaps[name] = gap_analysis(rows)
        agree = all(r.get("agree", True) for r in curves[name])
        log(f"mooncake {name}: {len(rows)} requests, {len(caps)} capacities in "
            f"{time.perf_counter() - t0:.1f}s; pool == oracle at every capacity: {agree}")
    plot_curves(curves, paper, out / "mooncake_hit_rate.png", gaps)
    table = []
    for name, curve in curves.items():
        for r in curve:
            table.append({"trace": name, "source": "kvstore_pool", **r})
    for name in curves:
        for cap, rate in paper.get(name, []):
            table.append({"trace": name, "source": "paper_fig9", "capacity_tokens": cap,
                          "token_hit_rate": rate})
    write_csv(out / "mooncake_hit_rate.csv", table)
    result = {"capacities_tokens": caps, "limit": limit, "curves": curves, "gap": gaps,
              "paper_points": {k: v for k, v in paper.items() if k in curves},
              "comparison": compare_with_paper(curves, paper)}
    write_json(out / "mooncake_hit_rate.json", result)
    return result


def compare_with_paper(curves: dict[str, list[dict[str, Any]]],
                       paper: dict[str, list[tuple[int, float]]]) -> list[dict[str, Any]]:
    """The replay next to each paper point at the same capacity."""
    out = []
    for name, rows in curves.items():
        at = {r["capacity_tokens"]: r for r in rows}
        for cap, rate in paper.get(name, []):
            r = at.get(cap)
            if r is not None:
                out.append({"trace": name, "capacity_tokens": cap, "paper": rate,
                            "kvstore": r["token_hit_rate"],
                            "oracle": r.get("oracle_token_hit_rate"),
                            "diff": r["token_hit_rate"] - rate,
                            "with_tails": r.get("token_hit_rate_with_tails"),
                            "diff_with_tails": r.get("token_hit_rate_with_tails", 0.0) - rate})
    return out


# -------------------------------- policies: online policies, LIRS, the reuse oracle, MIN


# The paper's capacities where the goal applies, in tokens.
GAP_CAPACITIES: tuple[int, ...] = (1_000_000, 2_000_000, 3_000_000, 5_000_000)

_NEVER = 1 << 62


def min_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """Belady's MIN over the request model of `mooncake_lru_replay`: totals
    (``input_tokens``, ``hit_tokens``, ``total_blocks``, ``hit_blocks``, ``evictions``),
    ``token_hit_rate``, ``block_hit_rate``, ``per_request_hit_tokens`` and
    ``unlinked_present`` (present blocks outside the hit run; 0 when prefix-closed)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    rows = _by_time(requests)
    cap = capacity_blocks
    # next_use[r][j]: index of the next request after r that uses rows[r].hash_ids[j].
    last_seen: dict[int, int] = {}
    next_use: list[list[int]] = [[] for _ in rows]
    for r in range(len(rows) - 1, -1, -1):
        ids = rows[r].hash_ids[:cap]
        next_use[r] = [last_seen.get(h, _NEVER) for h in ids]
        for h in ids:
            last_seen[h] = r
    cache: dict[int, int] = {}  # id -> its current next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, id); stale entries skipped
    count = HitCount(block_tokens)
    evictions = unlinked = 0
    for r, req in enumerate(rows):
        ids = req.hash_ids
        k = leading_run(ids, cache)
        keep = ids[:cap]
        unlinked += sum(1 for h in keep[k:] if h in cache)
        count.add(req, k)
        held = set(keep)
        need = len(cache) + sum(1 for h in keep if h not in cache) - cap
        while need > 0:
            neg_next, _, h = heapq.heappop(heap)
            if cache.get(h) != -neg_next or h in held:
                continue  # stale, or held (its entry is replaced below)
            del cache[h]
            evictions += 1
            need -= 1
        for depth, (h, nxt) in enumerate(zip(keep, next_use[r], strict=True)):
            cache[h] = nxt
            heapq.heappush(heap, (-nxt, -depth, h))
    return {"capacity_blocks": cap, "capacity_tokens": cap * block_tokens, **count.totals(),
            "evictions": evictions, "unlinked_present": unlinked}


def reuse_oracle_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """LRU over the request model of `mooncake_lru_replay`, except that a block no later
    request uses is evicted before any other (least recently used first among those, then
    among the rest): offline, it knows whether a block returns but not when. Returns
    ``token_hit_rate``, ``hit_tokens``, ``hit_blocks``, ``evictions``."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    rows = _by_time(requests)
    cap = capacity_blocks
    later: set[int] = set()
    returns: list[frozenset[int]] = [frozenset()] * len(rows)
    for r in range(len(rows) - 1, -1, -1):
        ids = rows[r].hash_ids[:cap]
        returns[r] = frozenset(h for h in ids if h in later)
        later.update(ids)
    dead: OrderedDict[int, None] = OrderedDict()  # never used again; first = LRU
    live: OrderedDict[int, None] = OrderedDict()
    count = HitCount(block_tokens)
    evictions = 0
    for r, req in enumerate(rows):
        ids = req.hash_ids
        k = 0
        while k < len(ids) and (ids[k] in live or ids[k] in dead):
            k += 1
        count.add(req, k)
        keep = ids[:cap]
        for h in keep:
            live.pop(h, None)
            dead.pop(h, None)
        while (dead or live) and len(dead) + len(live) + len(keep) > cap:
            (dead if dead else live).popitem(last=False)
            evictions += 1
        back = returns[r]
        for h in reversed(keep):
            (live if h in back else dead)[h] = None
    return {"capacity_blocks": cap, **count.totals(), "evictions": evictions}


def lirs_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int,
                hir_fraction: float = 0.05, block_tokens: int = MOONCAKE_BLOCK_TOKENS
                ) -> dict[str, Any]:
    """LIRS (Jiang and Zhang, 2002) over the request model of `mooncake_lru_replay`, adapted
    to prefix chains: online, block by block, outside the pool. A block is LIR once it is
    reused within the recency of the least recent LIR block (its inter-reference recency is
    small); LIR blocks fill all but `hir_fraction` of the cache and leave only when a block
    with a smaller recency takes their place, so a set of chains outlives a stream of chains
    whose reuse distance exceeds the cache (where LRU keeps none). Blocks whose parent was
    evicted go first, then resident HIR blocks (FIFO), then the least recent LIR block.
    Returns ``token_hit_rate``, ``hit_tokens``, ``hit_blocks``, ``evictions``."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    if not 0.0 < hir_fraction < 1.0:
        raise ValueError(f"hir_fraction must be in (0, 1), got {hir_fraction}")
    rows = _by_time(requests)
    cap = capacity_blocks
    num_lir = max(1, cap - max(1, int(cap * hir_fraction)))  # LIRS needs an LIR block
    stack: OrderedDict[int, None] = OrderedDict()  # recency of LIR and HIR ids; last = newest
    hir: OrderedDict[int, None] = OrderedDict()  # resident HIR blocks; first = next out
    orphans: OrderedDict[int, None] = OrderedDict()  # resident blocks whose parent left
    lir: set[int] = set()
    resident: set[int] = set()
    children: dict[int, set[int]] = {}

    def prune() -> None:  # the stack's bottom is always an LIR block
        while stack:
            h = next(iter(stack))
            if h in lir:
                return
            del stack[h]

    def demote_bottom() -> None:
        h, _ = stack.popitem(last=False)
        assert h in lir and h in resident
        lir.discard(h)
        hir[h] = None
        prune()

    def unlink(h: int) -> None:  # out of LIR or HIR bookkeeping, still resident
        if h in lir:
            lir.discard(h)
            del stack[h]
            prune()
        hir.pop(h, None)

    count = HitCount(block_tokens)
    evictions = 0
    for req in rows:
        ids = req.hash_ids
        count.add(req, leading_run(ids, resident))
        keep = ids[:cap]
        held = set(keep)
        for parent, child in itertools.pairwise(keep):
            children.setdefault(parent, set()).add(child)
        for h in keep:  # an orphan this request links again is live
            orphans.pop(h, None)
        need = len(resident) + sum(1 for h in keep if h not in resident) - cap
        while need > 0:
            victim = next((h for q in (orphans, hir) for h in q if h not in held), None)
            if victim is None:
                victim = next(h for h in stack if h in lir and h not in held)
            unlink(victim)
            orphans.pop(victim, None)
            resident.discard(victim)
            evictions += 1
            need -= 1
            for child in children.get(victim, ()):
                if child in resident and child not in orphans:
                    unlink(child)
                    orphans[child] = None
        for h in reversed(keep):  # the root last: most recent, as LRU orders a chain
            if h in lir:
                stack.move_to_end(h)
                prune()
            elif h in hir:  # a resident HIR block
                if h in stack:  # reused within the LIR recency: it becomes LIR
                    del hir[h]
                    lir.add(h)
                    stack.move_to_end(h)
                    demote_bottom()
                else:
                    stack[h] = None
                    hir.move_to_end(h)
            else:  # missing, or an orphan linked again
                resident.add(h)
                if len(lir) < num_lir:
                    lir.add(h)
                    stack[h] = None
                    stack.move_to_end(h)
                elif h in stack:
                    lir.add(h)
                    stack.move_to_end(h)
                    demote_bottom()
                else:
                    stack[h] = None
                    hir[h] = None
    return {"capacity_blocks": cap, **count.totals(), "evictions": evictions}


def brute_force_best_hit_blocks(requests: Sequence[MooncakeRequest], capacity_blocks: int) -> int:
    """The most leading-run hit blocks any eviction schedule achieves (exhaustive search over
    which unheld blocks each request evicts; for tiny traces only)."""
    rows = _by_time(requests)
    cap = capacity_blocks

    def best(r: int, cache: frozenset[int]) -> int:
        if r == len(rows):
            return 0
        ids = rows[r].hash_ids
        k = leading_run(ids, cache)
        keep = ids[:cap]
        held = set(keep)
        need = len(cache | held) - cap
        others = sorted(cache - held)
        if need <= 0:
            return k + best(r + 1, cache | held)
        return k + max(best(r + 1, (cache - set(out)) | held)
                       for out in itertools.combinations(others, need))

    return best(0, frozenset())


def gap_closed(rate: float, lru: float, opt: float) -> float | None:
    """The fraction of the LRU-to-MIN gap a policy's hit rate closes (None without a gap)."""
    return None if opt - lru <= 1e-12 else (rate - lru) / (opt - lru)


def policy_curves(rows: Sequence[MooncakeRequest], capacities: Sequence[int],
                  policies: Sequence[str],
                  progress: Callable[[int], None] = lambda cap: None) -> list[dict[str, Any]]:
    """One row per capacity: each policy's token hit rate, LIRS's, the reuse oracle's, MIN's,
    and the gap each closes."""
    rows = _by_time(rows)
    out = []
    for cap_tokens in capacities:
        progress(cap_tokens)
        blocks = cap_tokens // MOONCAKE_BLOCK_TOKENS
        row: dict[str, Any] = {"capacity_tokens": cap_tokens}
        t0 = time.perf_counter()
        opt = min_replay(rows, blocks)
        row["min"] = opt["token_hit_rate"]
        row["min_unlinked_present"] = opt["unlinked_present"]
        row["min_s"] = time.perf_counter() - t0
        row["reuse_oracle"] = reuse_oracle_replay(rows, blocks)["token_hit_rate"]
        row["lirs"] = lirs_replay(rows, blocks)["token_hit_rate"]
        for name in policies:
            t0 = time.perf_counter()
            row[name] = pool_replay(rows, blocks, eviction=name)["token_hit_rate"]
            row[f"{name}_s"] = time.perf_counter() - t0
        lru = row.get("lru")
        if lru is not None:
            for name in [*policies, "lirs", "reuse_oracle"]:
                row[f"{name}_gap_closed"] = gap_closed(row[name], lru, row["min"])
        out.append(row)
    return out


Line = tuple[str, str, dict[str, Any], str]  # row key, format, plot keywords, label


def plot_panels(curves: dict[str, list[dict[str, Any]]], lines: Sequence[Line], xlabel: str,
                title: str, path: str | Path) -> None:
    """Hit rate against capacity (log x), one panel per trace ("{name}" in `title`), one
    line per entry of `lines`."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        xs = [r["capacity_tokens"] for r in rows]
        for key, fmt, kw, label in lines:
            ax.plot(xs, [r[key] for r in rows], fmt, label=label, **kw)
        mark_x(ax, xs, short_count)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("token hit rate (whole blocks)")
        ax.set_title(title.format(name=name))
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_eviction_replay(out_dir: str | Path, traces: dict[str, Path],
                        capacities: Sequence[int] = GAP_CAPACITIES,
                        policies: Sequence[str] = tuple(EVICTION_POLICIES),
                        limit: int | None = None, log: Any = print) -> dict[str, Any]:
    """Replay each trace under every policy and MIN; write ``eviction_hit_rate.{png,json,csv}``
    into `out_dir` and return the curves."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, list[dict[str, Any]]] = {}
    for name, path in traces.items():
        rows = load_mooncake(path, limit)
        t0 = time.perf_counter()
        curves[name] = policy_curves(rows, capacities, policies,
                                     _progress(f"policies {name}", capacities))
        log(f"eviction {name}: {len(rows)} requests, {len(capacities)} capacities in "
            f"{time.perf_counter() - t0:.1f}s")
    plot_panels(curves, [
        *((p, "-o", {"ms": 3}, p) for p in policies),
        ("lirs", "-.", {"color": "tab:brown"}, "LIRS, block level (online, outside the pool)"),
        ("reuse_oracle", ":", {"color": "gray"}, "LRU knowing which blocks return (offline)"),
        ("min", "--", {"color": "black"}, "MIN (offline)")],
        "capacity (tokens, 512-token blocks)", "Mooncake {name}: eviction policies",
        out / "eviction_hit_rate.png")
    write_csv(out / "eviction_hit_rate.csv",
              [{"trace": name, **r} for name, rows in curves.items() for r in rows])
    result = {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit,
              "curves": curves}
    write_json(out / "eviction_hit_rate.json", result)
    return result


def format_policies(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> list[str]:
    """A markdown table: per trace and capacity, each policy's hit rate (gap closed) and MIN."""
    head = "| trace | capacity | " + " | ".join(policies) + " | LIRS | reuse oracle | MIN |"
    lines = [head, "|" + "---|" * (5 + len(policies))]
    for name, rows in curves.items():
        for r in rows:
            cells = []
            for p in [*policies, "lirs", "reuse_oracle"]:
                g = r.get(f"{p}_gap_closed")
                cells.append(f"{r[p]:.3f}" + ("" if p == "lru" or g is None else f" ({g:+.0%})"))
            lines.append(f"| {name} | {r['capacity_tokens'] / 1e6:g}M | " + " | ".join(cells)
                         + f" | {r['min']:.3f} |")
    return lines


# ------------------------------------------ layouts: a hybrid layout through the manager


# Gemma-3-27B-like: 62 layers, 10 full attention and 52 sliding window of 1024 tokens.
FULL_LAYERS = 10
WINDOW_LAYERS = 52
WINDOW = 1024
CAPACITIES: tuple[int, ...] = (300_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 10_000_000)
# Prefill chunk (tokens), vLLM's default token budget per step.
CHUNK_TOKENS = 8192


def layer_specs(layout: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[KVCacheSpec]:
    """The 62 layer specs of a layout: ``hybrid`` (every sixth layer full, as Gemma 3, the
    rest windowed) or ``full``."""
    full = FullAttentionSpec(block_tokens, 16, 128, "bfloat16")
    if layout == "full":
        return [full] * (FULL_LAYERS + WINDOW_LAYERS)
    if layout != "hybrid":
        raise ValueError(f"unknown layout {layout!r}; known: hybrid, full")
    window = SlidingWindowSpec(block_tokens, 16, 128, "bfloat16", window=WINDOW)
    return [full if i % 6 == 5 else window for i in range(FULL_LAYERS + WINDOW_LAYERS)]


def _fast_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The block's first token chained to its parent: enough, since a block's first token
    names its trace id, which names its whole prefix (the pool verifies tokens anyway)."""
    return hash((parent, token_ids[0])) & ((1 << 64) - 1)


def hybrid_replay(requests: Sequence[MooncakeRequest], capacity_tokens: int,
                  eviction: str | EvictionPolicy = "lru", layout: str = "hybrid",
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS,
                  chunk_tokens: int = CHUNK_TOKENS) -> dict[str, Any]:
    """Replay Mooncake rows through a KVCacheManager of `layout` at the bytes of an all-full
    cache of `capacity_tokens` tokens. Returns ``token_hit_rate``, ``hit_tokens``,
    ``input_tokens``, ``hit_blocks``, ``total_blocks``, ``num_blocks`` (the pool's pages),
    ``truncated`` (rows cut to what the pool can hold at once), ``cut_tokens`` and
    ``cut_rate`` (tokens past the hit whose full-attention chain was cached but whose window
    pages were not: hits a sliding-window group cut), ``per_request_hit_tokens``
    and, per group, ``groups``: its layers, pages stored, evicted, cached at the end and on
    average (sampled after every request), and hit pages."""
    specs = layer_specs(layout, block_tokens)
    groups_probe = make_kv_cache_config(specs, num_blocks=2)
    slots = groups_probe.num_slots
    num_pages = capacity_tokens // block_tokens * len(specs) // slots
    config = make_kv_cache_config(specs, num_blocks=num_pages + 1)
    ng = len(config.groups)
    manager = new_manager(config, enable_partial_hits=False, enable_events=True,
                          hash_fn=_fast_hash, eviction=eviction)
    # The most blocks a request may hold at once: every group's page per block, one more
    # page per group for the extra token.
    max_blocks = num_pages // ng - 1
    rows = sorted(requests, key=lambda r: r.timestamp_ms)
    stored = [0] * ng
    evicted = [0] * ng
    resident = [0] * ng
    resident_sum = [0] * ng
    hit_pages = [0] * ng
    count = HitCount(block_tokens)
    truncated = cut_tokens = 0
    for n, row in enumerate(rows):
        ids = row.hash_ids
        if len(ids) > max_blocks:
            ids = ids[:max_blocks]
            truncated += 1
        num_tokens = min(row.input_length, len(ids) * block_tokens)
        tokens = np.zeros(num_tokens, dtype=np.int64)
        tokens[::block_tokens] = np.asarray(ids[:-(-num_tokens // block_tokens)],
                                            dtype=np.int64) + 1
        req = Request(f"r{n}", tokens)
        computed = manager.get_computed_blocks(req)
        k = computed.num_computed_tokens // block_tokens
        for g in range(ng):
            hit_pages[g] += sum(1 for b in computed.blocks[g] if b.block_id != 0)
        end = min(num_tokens, computed.num_computed_tokens + chunk_tokens)
        if manager.admit(req, end - computed.num_computed_tokens, computed) is None:
            raise RuntimeError(f"row {n} ({len(ids)} blocks) does not fit {num_pages} pages")
        while True:
            req.num_computed_tokens = end
            if end == num_tokens:
                break
            end = min(num_tokens, end + chunk_tokens)
            if manager.grow(req, end - req.num_computed_tokens) is None:
                raise RuntimeError(f"row {n} ({len(ids)} blocks) does not fit {num_pages} pages")
        manager.free(req)
        for ev in manager.take_events():
            if isinstance(ev, BlockStored):
                stored[ev.group_id] += 1
                resident[ev.group_id] += 1
            elif isinstance(ev, BlockRemoved):
                evicted[ev.group_id] += 1
                resident[ev.group_id] -= 1
        for g in range(ng):
            resident_sum[g] += resident[g]
        hit = min(k * block_tokens, row.input_length)
        cut_tokens += min(computed.num_verified_tokens, row.input_length) - min(
            hit, computed.num_verified_tokens)
        count.add(row, k)
    if manager.num_free_blocks != manager.num_usable_blocks:
        raise RuntimeError("hybrid replay leaked pages")
    groups = []
    for g, group in enumerate(config.groups):
        groups.append({
            "group": g,
            "kind": "full" if isinstance(group.spec, FullAttentionSpec) else "window",
            "layers": len(group.layer_ids),
            "stored": stored[g],
            "evicted": evicted[g],
            "cached_end": resident[g],
            "cached_mean": resident_sum[g] / max(1, len(rows)),
            "hit_pages": hit_pages[g],
        })
    return {
        "layout": layout,
        "eviction": eviction if isinstance(eviction, str) else eviction.name,
        "capacity_tokens": capacity_tokens,
        "num_blocks": num_pages,
        "truncated": truncated,
        **count.totals(),
        "cut_tokens": cut_tokens,
        "cut_rate": hit_rate(cut_tokens, count.input_tokens),
        "groups": groups,
    }


def window_free_bound(requests: Sequence[MooncakeRequest], capacity_tokens: int,
                      block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> float:
    """LRU hit rate when windowed pages cost nothing: the full group alone holds every byte
    of the budget (its pages are 10 of the 62 layers)."""
    blocks = capacity_tokens // block_tokens * (FULL_LAYERS + WINDOW_LAYERS) // FULL_LAYERS
    return float(pool_replay(requests, blocks, block_tokens)["token_hit_rate"])


def capacity_row(rows: Sequence[MooncakeRequest], cap: int,
                 policies: Sequence[str]) -> dict[str, Any]:
    """At one budget: each hybrid policy's hit rate (and per-group breakdown), all-full
    LRU's, and the bound where windowed pages cost nothing."""
    row: dict[str, Any] = {"capacity_tokens": cap}
    t0 = time.perf_counter()
    row["full_lru"] = hybrid_replay(rows, cap, "lru", layout="full")["token_hit_rate"]
    row["bound"] = window_free_bound(rows, cap)
    row["groups"] = {}
    for name in policies:
        res = hybrid_replay(rows, cap, name)
        row[name] = res["token_hit_rate"]
        row[f"{name}_cut"] = res["cut_rate"]
        row["groups"][name] = res["groups"]
        row["truncated"] = res["truncated"]
    row["seconds"] = time.perf_counter() - t0
    return row


def _task(args: tuple[Path, int, tuple[str, ...], int | None]) -> dict[str, Any]:
    path, cap, policies, limit = args
    return capacity_row(load_mooncake(path, limit), cap, policies)


def format_layouts(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> list[str]:
    """A markdown table: per trace and capacity, all-full LRU, each hybrid policy, the bound."""
    lines = ["| trace | budget | all-full lru | " + " | ".join(f"hybrid {p}" for p in policies)
             + " | bound |", "|" + "---|" * (4 + len(policies))]
    for name, rows in curves.items():
        for r in rows:
            lines.append(f"| {name} | {r['capacity_tokens'] / 1e6:g}M | {r['full_lru']:.3f} | "
                         + " | ".join(f"{r[p]:.3f}" for p in policies) + f" | {r['bound']:.3f} |")
    return lines


def format_groups(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> list[str]:
    """A markdown table: per trace, capacity and policy, pages kept (mean cached) and
    evicted, and hit pages, for the full group and the window groups together, and the
    share of input tokens a window group cut from a cached full chain."""
    lines = ["| trace | budget | policy | full: mean cached / evicted / hit | "
             "window: mean cached / evicted / hit | cut by a window |",
             "|---|---|---|---|---|---|"]
    for name, rows in curves.items():
        for r in rows:
            for p in policies:
                cells = []
                for kind in ("full", "window"):
                    gs = [g for g in r["groups"][p] if g["kind"] == kind]
                    cells.append(f"{sum(g['cached_mean'] for g in gs):,.0f} / "
                                 f"{sum(g['evicted'] for g in gs):,} / "
                                 f"{sum(g['hit_pages'] for g in gs):,}")
                lines.append(f"| {name} | {r['capacity_tokens'] / 1e6:g}M | {p} | "
                             + " | ".join(cells) + f" | {r[f'{p}_cut']:.3f} |")
    return lines


def run_hybrid_replay(out_dir: str | Path, traces: dict[str, Path],
                      capacities: Sequence[int] = CAPACITIES,
                      policies: Sequence[str] = tuple(EVICTION_POLICIES),
                      limit: int | None = None, jobs: int = 1,
                      log: Any = print) -> dict[str, Any]:
    """Replay each trace under every policy, all-full LRU and the bound (one task per trace
    and budget, `jobs` processes); write ``eviction_hybrid.{png,json,csv}`` into `out_dir`
    and return the curves."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tasks = [(path, cap, tuple(policies), limit) for path in traces.values() for cap in capacities]
    names = [name for name in traces for _ in capacities]
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            results = list(pool.map(_task, tasks))
    else:
        results = [_task(t) for t in tasks]
    curves: dict[str, list[dict[str, Any]]] = {name: [] for name in traces}
    for name, (_, cap, _, _), row in zip(names, tasks, results, strict=True):
        curves[name].append(row)
        log(f"hybrid {name} {cap / 1e6:g}M: " + ", ".join(
            f"{k} {row[k]:.3f}" for k in ["full_lru", *policies, "bound"])
            + f" ({row['seconds']:.0f}s)")
    plot_panels(curves, [
        *((p, "-o", {"ms": 3}, f"hybrid {p}") for p in policies),
        ("full_lru", "-s", {"color": "black", "ms": 3}, "all-full lru"),
        ("bound", "--", {"color": "gray"}, "bound: windowed pages free")],
        "budget (tokens of an all-full cache, 512-token blocks)",
        "Mooncake {name}: 10 full + 52 window (W=1024) layers", out / "eviction_hybrid.png")
    write_csv(out / "eviction_hybrid.csv",
              [{"trace": name, **{k: v for k, v in r.items() if k != "groups"}}
               for name, rows in curves.items() for r in rows])
    result = {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit,
              "curves": curves}
    write_json(out / "eviction_hybrid.json", result)
    return result


# ------------------------------------- memory: a Gemma-3-like hybrid against all-full layers


MiB = 1 << 20
MEMORY_SHAPE = ModelShape("gemma-3-1b-like", num_layers=26, num_kv_heads=1, head_dim=256,
                          dtype="float16", sliding_per_full=5)
MEMORY_BUDGET = 1024 * MiB
MEMORY_RATE = 1.5


@dataclass
class LayoutRun:
    """One layout's simulator replay at the memory budget and what each step saw."""

    name: str
    config: KVCacheConfig
    sim: SimResult | None = None
    running: list[int] = field(default_factory=list)
    preempting: list[bool] = field(default_factory=list)
    mib_per_running: list[float] = field(default_factory=list)
    samples: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # (context, blocks)
    wall_s: float = 0.0

    @property
    def max_running_no_preemption(self) -> int:
        """Most requests running at a step that preempted nobody."""
        return max((r for r, p in zip(self.running, self.preempting, strict=True) if not p),
                   default=0)

    @property
    def mean_running(self) -> float:
        """Mean running requests over steps."""
        return float(np.mean(self.running)) if self.running else 0.0

    def resident_blocks(self, num_tokens: int) -> int:
        """Blocks a lone decoding request of `num_tokens` computed tokens holds."""
        return sum(g.spec.num_resident_blocks(num_tokens, num_tokens + 1)
                   for g in self.config.groups)


def run_layout(name: str, layer_specs: Sequence[KVCacheSpec], specs: Sequence[RequestSpec],
               sample_ids: Sequence[str]) -> LayoutRun:
    """Replay the workload through the simulator on one layout at `MEMORY_BUDGET`."""
    config = make_kv_cache_config(layer_specs, memory_bytes=MEMORY_BUDGET)
    run = LayoutRun(name, config)
    wanted = set(sample_ids)

    def on_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
        manager = scheduler.manager
        run.running.append(len(scheduler.running))
        run.preempting.append(bool(output.preempted))
        used = sum(manager.blocks_in_use_by_group())
        run.mib_per_running.append(used * config.bytes_per_block / MiB
                                   / max(len(scheduler.running), 1))
        for item in output.scheduled:
            rid = item.request.request_id
            if rid in wanted:
                run.samples.setdefault(rid, []).append(
                    (item.start + item.num_new_tokens, sum(manager.num_resident_blocks(rid))))

    t0 = time.perf_counter()
    run.sim = simulate(list(specs), config, on_step=on_step, scheduler_config=SchedulerConfig(
        max_num_batched_tokens=2048, max_num_seqs=256))
    run.wall_s = time.perf_counter() - t0
    return run


def memory_table(saturated: Sequence[LayoutRun], steady: Sequence[LayoutRun],
                 specs: Sequence[RequestSpec], steady_specs: Sequence[RequestSpec],
                 sample_ids: Sequence[str]) -> Table:
    """Layouts side by side: memory per request, concurrency, prefix hits."""
    t = Table(title=f"Gemma-3-like hybrid vs all-full attention, same budget "
              f"({MEMORY_BUDGET / MiB:,.0f} MiB of pages)")
    t.add_column("")
    for r in saturated:
        t.add_column(r.name, justify="right")
    plens = [len(s.prompt_token_ids) for s in specs]
    probe = int(np.median(plens)) + 128
    by_id = {s.request_id: s for s in specs}

    def row(label: str, runs: Sequence[LayoutRun], cell: Callable[[LayoutRun], str],
            end_section: bool = False) -> None:
        t.add_row(label, *(cell(r) for r in runs), end_section=end_section)

    def sample(r: LayoutRun, rid: str) -> str:
        pts = r.samples.get(rid)
        if not pts:
            return "-"
        mib = r.config.bytes_per_block / MiB
        return (f"{pts[-1][1]:,} blk = {pts[-1][1] * mib:,.1f} MiB "
                f"(peak {max(p[1] for p in pts) * mib:,.1f})")

    sat, st = saturated, steady
    row("groups: layers (W = windowed, F = full)", sat, lambda r: " ".join(
        f"{len(g.layer_ids)}{'W' if g.spec.sliding_window else 'F'}" for g in r.config.groups))
    row("slots / padding layers", sat,
        lambda r: f"{r.config.num_slots} / {r.config.num_padding_layers}")
    row("KiB per block id", sat, lambda r: f"{r.config.bytes_per_block / 1024:,.0f}")
    row("blocks in the pool", sat, lambda r: f"{r.config.num_blocks - 1:,}")
    row(f"blocks (MiB) held by one {probe}-token request", sat, lambda r: (
        f"{r.resident_blocks(probe):,} "
        f"({r.resident_blocks(probe) * r.config.bytes_per_block / MiB:,.1f})"))
    row("  such requests the pool holds", sat,
        lambda r: f"{(r.config.num_blocks - 1) // r.resident_blocks(probe):,}", end_section=True)
    row(f"[b]saturated[/]: {len(specs)} requests all waiting at t=0", sat, lambda r: "")
    for rid in sample_ids:
        spec = by_id[rid]
        row(f"  {rid} ({len(spec.prompt_token_ids)}+{spec.max_tokens} tok) held at its end", sat,
            lambda r, rid=rid: sample(r, rid))  # type: ignore[misc]
    row("  mean MiB per running request", sat, lambda r: f"{np.mean(r.mib_per_running):,.1f}")
    row("  max running without preemption", sat, lambda r: f"{r.max_running_no_preemption}")
    row("  mean running", sat, lambda r: f"{r.mean_running:.1f}")
    sim = (("preemptions", lambda s: f"{s.preemptions}"), ("steps to drain", lambda s: f"{s.steps:,}"),
           ("prefix hit rate", lambda s: f"{s.hit_rate:.1%}"), ("evictions", lambda s: f"{s.evictions:,}"))
    for k, (label, fmt) in enumerate(sim):
        row(f"  {label}", sat, lambda r, fmt=fmt: fmt(r.sim) if r.sim else "-",  # type: ignore[misc]
            end_section=k == len(sim) - 1)
    row(f"[b]steady[/]: {len(steady_specs)} requests, Poisson {MEMORY_RATE:g}/s", st, lambda r: "")
    row("  mean / max running", st, lambda r: f"{r.mean_running:.1f} / {max(r.running, default=0)}")
    for label, fmt in sim:
        if label != "steps to drain":
            row(f"  {label}", st, lambda r, fmt=fmt: fmt(r.sim) if r.sim else "-",  # type: ignore[misc]
                end_section=label == "evictions")
    t.add_row("replay wall s, saturated + steady (this CPU)",
              *(f"{a.wall_s:.1f} + {b.wall_s:.1f}" for a, b in zip(sat, st, strict=True)))
    ideal, ideal_s = ideal_hit_tokens(specs), ideal_hit_tokens(steady_specs)
    t.caption = (f"Prompts {min(plens)}..{max(plens)} tokens (median {int(np.median(plens))}), "
                 "6 shared system prompts of 1.5k/3k/5k tokens. Ideal hit rate (infinite "
                 f"cache): saturated {ideal.rate:.1%}, steady {ideal_s.rate:.1%} "
                 f"(block-rounded {ideal_hit_tokens(specs, 16).rate:.1%} / "
                 f"{ideal_hit_tokens(steady_specs, 16).rate:.1%}).")
    return t


def plot_memory(saturated: Sequence[LayoutRun], steady: Sequence[LayoutRun],
                sample_ids: Sequence[str], path: Path) -> None:
    """Four panels: sample requests' memory against their context, memory per running
    request and running requests per step (saturated), concurrency and hit rates."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax = axes[0, 0]
    for k, r in enumerate(saturated):
        for j, rid in enumerate(sample_ids):
            pts = r.samples.get(rid, [])
            ax.plot([p[0] for p in pts], [p[1] * r.config.bytes_per_block / MiB for p in pts],
                    color=colors[k % len(colors)], linestyle=["-", "--", ":", "-."][j % 4],
                    label=r.name if j == 0 else None)
    ax.set(xlabel="tokens in the request's context", ylabel="MiB of pages the request holds",
           title=f"{len(sample_ids)} sample requests (line style = request)")
    ax.legend(fontsize=8)
    for ax, key, ylabel, title in (
            (axes[0, 1], "mib_per_running", "MiB in use / running requests",
             "Mean memory per running request"),
            (axes[1, 0], "running", "running requests", "Concurrency, same byte budget")):
        for k, r in enumerate(saturated):
            ax.plot(getattr(r, key), color=colors[k % len(colors)], label=r.name, lw=0.8)
        ax.set(xlabel="engine step (saturated)", ylabel=ylabel, title=title)
        ax.legend(fontsize=8)
    ax = axes[1, 1]
    x = np.arange(len(saturated))
    ax.bar(x - 0.2, [r.mean_running for r in saturated], 0.4, label="mean running")
    ax.bar(x + 0.2, [r.max_running_no_preemption for r in saturated], 0.4,
           label="max running, no preemption")
    ax.set_xticks(x, [r.name for r in saturated], fontsize=8)
    ax.set(ylabel="requests (saturated)", title="Concurrency and prefix hits")
    ax2 = ax.twinx()
    for runs, style, label in ((saturated, "ko-", "saturated"), (steady, "ks--", "steady")):
        ax2.plot(x, [100 * r.sim.hit_rate if r.sim else 0 for r in runs], style,
                 label=f"hit rate %, {label}")
    ax2.set(ylim=(0, 100), ylabel="prefix hit rate (%)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper right")
    fig.suptitle("Gemma-3-like hybrid (every 6th layer full, block 16) vs all-full attention, "
                 "same byte budget")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_memory(out: Path, num_requests: int) -> str:
    """Gemma-3-like layouts (windows 512 and 1024) against all-full layers at one byte
    budget, saturated and steady; prints the table, writes ``hybrid_memory.png``."""
    def workload(rate: float, seed: int) -> list[RequestSpec]:
        return shared_system_prompts(
            num_requests, num_prompts=6, system_lens=(1500, 3000, 5000), user_len=(500, 3000),
            output_median=128, output_max=512, rate=rate, seed=seed).requests

    specs, steady_specs = workload(math.inf, 0), workload(MEMORY_RATE, 1)
    sample_ids = [specs[i].request_id for i in (0, num_requests // 3, 2 * num_requests // 3)]
    layouts = [(f"hybrid W={w}", replace(MEMORY_SHAPE, sliding_window=w).hybrid_specs(16))
               for w in (512, 1024)] + [("all full", MEMORY_SHAPE.full_specs(16))]
    runs = []
    for k, (phase, reqs, ids) in enumerate((("saturated", specs, sample_ids),
                                              ("steady", steady_specs, ()))):
        for j, (name, ls) in enumerate(layouts):
            print(f"  memory: [{k * len(layouts) + j + 1}/{2 * len(layouts)}] {name}, {phase} ...",
                  file=sys.stderr, flush=True)
            runs.append(run_layout(name, ls, reqs, ids))
    saturated, steady = runs[:len(layouts)], runs[len(layouts):]
    Console(width=160).print(memory_table(saturated, steady, specs, steady_specs, sample_ids))
    plot_memory(saturated, steady, sample_ids, out / "hybrid_memory.png")
    most = max(saturated[:-1], key=lambda r: r.max_running_no_preemption)
    return (f"memory: {most.name} runs {most.max_running_no_preemption} requests without "
            f"preemption where all-full runs {saturated[-1].max_running_no_preemption} "
            f"({out}/hybrid_memory.png)")
