"""``kvstore bench replay``: hit rate against cache capacity on a block-hash trace (the
Mooncake format: each row names its 512-token blocks by prefix-chained hash ids).

What it replays, by ``--what``:

- ``lru``: kvstore's ``BlockPool`` next to the independent LRU model, with the paper's
  points (``mooncake_hit_rate``);
- ``policies``: every eviction policy through the pool, LIRS, the reuse oracle (LRU that
  knows which blocks never return) and Belady's MIN (``eviction_hit_rate``);
- ``layouts``: a hybrid layout (10 full + 52 sliding-window layers) under each policy,
  next to all-full LRU and the bound where windowed pages cost nothing
  (``eviction_hybrid``);
- ``tiers``: device-only LRU, a host tier below it, and instances sharing a store.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from kvstore.benchmarks import traces as tr

WHAT = ("lru", "policies", "layouts", "tiers")
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
    return path.stem, path


def _names(known: tuple[str, ...] | list[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; known: "
                                             f"{', '.join(known)}")
        return list(dict.fromkeys(names))
    return parse


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
    from kvstore.eviction import EVICTION_POLICIES

    p.add_argument("--trace", type=_trace, action="append", metavar="NAME|PATH",
                   help=f"a trace file, or a built-in name ({', '.join(TRACE_NAMES)}); "
                        "repeatable (default: both built-in traces)")
    p.add_argument("--what", type=_names(WHAT), default=["lru", "policies"], metavar="LIST",
                   help=f"comma list of {', '.join(WHAT)}")
    p.add_argument("--capacities", type=_tokens, metavar="LIST",
                   help="comma list of capacities in tokens (default per replay: lru the paper's "
                        "and a log grid, policies 1M..5M, layouts 1M..10M)")
    p.add_argument("--policies", type=_names(tuple(EVICTION_POLICIES)),
                   default=list(EVICTION_POLICIES), metavar="LIST",
                   help=f"eviction policies, comma list of {', '.join(EVICTION_POLICIES)}")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N rows of each trace")
    p.add_argument("--quick", action="store_true",
                   help="the first 2000 rows, the paper's capacities for lru")
    p.add_argument("--jobs", type=int, default=1, help="processes for layouts")
    p.add_argument("--device-tokens", type=int, default=3_000_000, help="tiers: device capacity")
    p.add_argument("--host-tokens", type=int, default=30_000_000, help="tiers: host tier capacity")
    p.add_argument("--instances", type=int, default=4, help="tiers: instances sharing a store")
    p.add_argument("--out", type=Path, default=Path("results/replay"), help="output folder")


def run(args: argparse.Namespace) -> int:
    """Run the replays `args` ask for; write figures, JSON and CSV; print tables and a
    headline."""
    from kvstore.benchmarks import eviction_replay, hybrid_replay, mooncake_replay

    if args.trace:
        traces = dict(args.trace)
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
        res = mooncake_replay.run_mooncake_replay(out, traces, caps, limit, quick=args.quick)
        agree = all(r.get("agree", True) for rows in res["curves"].values() for r in rows)
        for name, rows in res["curves"].items():
            top = rows[-1]
            print(f"lru {name}: hit {rows[0]['token_hit_rate']:.3f} at "
                  f"{rows[0]['capacity_tokens']:,} tokens .. {top['token_hit_rate']:.3f} at "
                  f"{top['capacity_tokens']:,}")
        headline.append(f"LRU: the pool {'equals' if agree else 'DIFFERS FROM'} the LRU model at "
                        f"every capacity ({out}/mooncake_hit_rate.png)")
    if "policies" in args.what:
        res = eviction_replay.run_eviction_replay(
            out, traces, caps or eviction_replay.GAP_CAPACITIES, args.policies, limit)
        print("\n".join(eviction_replay.format_table(res["curves"], args.policies)))
        best = max(((r[p] - r.get("lru", r[p]), p, n, r["capacity_tokens"])
                    for n, rows in res["curves"].items() for r in rows for p in args.policies))
        headline.append(f"policies: best gain over LRU {best[0]:+.3f} ({best[1]}, {best[2]} at "
                        f"{best[3]:,} tokens); MIN bounds every line ({out}/eviction_hit_rate.png)")
    if "layouts" in args.what:
        res = hybrid_replay.run_hybrid_replay(
            out, traces, caps or hybrid_replay.CAPACITIES, args.policies, limit, args.jobs)
        print("\n".join(hybrid_replay.format_table(res["curves"], args.policies)))
        print("\n".join(hybrid_replay.format_groups(res["curves"], args.policies)))
        worst = min((r[p] - r["full_lru"], p, n, r["capacity_tokens"])
                    for n, rows in res["curves"].items() for r in rows for p in args.policies)
        headline.append(f"layouts: the hybrid's largest loss against all-full LRU {worst[0]:+.3f} "
                        f"({worst[1]}, {worst[2]} at {worst[3]:,} tokens)")
    if "tiers" in args.what:
        for name, path in traces.items():
            headline.append(_tiers(name, path, args, limit))
    print("\n" + "\n".join(headline) + f"\n({time.perf_counter() - t0:.0f} s; files in {out}/)")
    return 0


def _exists(key: str) -> bool:
    try:
        tr.locate_trace(key)
    except FileNotFoundError:
        return False
    return True


def _tiers(name: str, path: Path, args: argparse.Namespace, limit: int | None) -> str:
    """Device-only LRU, device + host tier (both offload modes), instances sharing a store;
    printed, written as JSON, summed up in one line."""
    from kvstore.benchmarks.tier_replay import MODES, pooled_replay, tiered_replay

    rows = tr.load_mooncake(path, limit)
    bt = tr.MOONCAKE_BLOCK_TOKENS
    dev, host, n = args.device_tokens // bt, args.host_tokens // bt, args.instances
    if n < 1 or dev < n:
        args.usage_error(f"argument --instances: must be in 1..{dev} (device blocks), got {n}")
    out: dict[str, Any] = {"trace": str(path), "device_only": tr.mooncake_lru_replay(rows, dev),
                           "unbounded": tr.mooncake_lru_replay(rows, None)}
    for mode in MODES:
        out[mode] = tiered_replay(rows, dev, host, mode)
    one = pooled_replay(rows, 1, dev, 0)
    out["pooled"] = {"one": one, "local": pooled_replay(rows, n, dev // n, 0),
                     "shared": pooled_replay(rows, n, dev // n, None)}
    print(f"\ntiers {name}: {len(rows)} requests, device {args.device_tokens:,} tokens, host "
          f"{args.host_tokens:,}; block / token hit rate")
    for label, r in [("device-only LRU", out["device_only"]),
                     *((f"device + host, {m}", out[m]) for m in MODES),
                     ("unbounded", out["unbounded"]), ("one instance", one),
                     (f"{n} instances, local only", out["pooled"]["local"]),
                     (f"{n} instances + shared store", out["pooled"]["shared"])]:
        print(f"  {label:32s} {r['block_hit_rate']:6.3f} {r['token_hit_rate']:6.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    keep = ("block_hit_rate", "token_hit_rate", "host_hit_blocks", "store_hit_blocks")
    (args.out / f"tier_replay_{name}.json").write_text(json.dumps(
        {k: ({kk: v[kk] for kk in keep if kk in v} if "block_hit_rate" in v else
             {p: {kk: q[kk] for kk in keep if kk in q} for p, q in v.items()})
         if isinstance(v, dict) else v for k, v in out.items()}, indent=2))
    shared = out["pooled"]["shared"]["block_hit_rate"] / one["block_hit_rate"]
    return (f"tiers {name}: a host tier lifts LRU from {out['device_only']['block_hit_rate']:.3f} "
            f"to {out['write-back']['block_hit_rate']:.3f}; {n} instances sharing a store keep "
            f"{shared:.2f}x one instance's hits")
