"""A device cache plus a host tier on a Mooncake trace, at block level: the hit rate the
host tier adds to device-only LRU.

The device is the LRU cache of :func:`kvstore.benchmarks.traces.mooncake_lru_replay` (a
request holds its hit blocks, evicts least recently used ones for the rest, releases
deepest first). The host tier is a second LRU of hash ids below it. A request hits its
device run, then the host tier extends it with the consecutive ids it holds (as
``TieredKVCacheManager`` does). Two ways to fill the host tier:

- ``on-free`` (what the engine does): when a request is freed, its blocks the host tier
  lacks are stored there (a host hit refreshes the block; a device hit does not);
- ``write-back``: blocks evicted from the device are stored there (exclusive of the
  device).

The second model is several instances sharing one store (:func:`pooled_replay`): the
rows are dealt round-robin (in replay order) over ``instances`` engines, each with its
own device LRU of a share of the capacity; each one extends its device run with the
consecutive ids the shared store holds, and on free writes the blocks the store lacks (as
the engine does: write-through on free). The store is an LRU of hash ids shared by all
instances, unbounded or of a given capacity; a load or a write refreshes an id. Requests
run one at a time, so a block written by one instance is visible to the next request on
any instance at once (no in-flight overlap, no store latency, no failures).

Run ``python -m kvstore.benchmarks.tier_replay`` (the conversation trace, 3M device
tokens, 30M host tokens; 4 instances with a store unbounded, of 30M and of 3M tokens)."""

from __future__ import annotations

import argparse
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    leading_run,
    load_mooncake,
    mooncake_lru_replay,
    trace_file,
)
from kvstore.utils import hit_rate

__all__ = ["MODES", "main", "pooled_replay", "tiered_replay"]

MODES = ("on-free", "write-back")


def lru_hold(lru: OrderedDict[int, None], keep: Sequence[int], capacity: int) -> list[int]:
    """A request's blocks ``keep`` enter the device LRU ``lru`` of ``capacity`` blocks as
    its most recent content, the root last (so it is evicted last); returns the blocks
    evicted to make room, oldest first."""
    for h in keep:
        lru.pop(h, None)
    evicted = []
    while lru and len(lru) + len(keep) > capacity:
        evicted.append(lru.popitem(last=False)[0])
    for h in reversed(keep):
        lru[h] = None
    return evicted


def tiered_replay(requests: Iterable[MooncakeRequest], device_blocks: int, host_blocks: int,
                  mode: str = "on-free") -> dict[str, Any]:
    """Replay rows (timestamp order) through a device LRU of ``device_blocks`` hash ids and
    a host LRU of ``host_blocks``; hit blocks per tier and the block hit rates."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if device_blocks < 1 or host_blocks < 0:
        raise ValueError(f"need device_blocks >= 1 and host_blocks >= 0, got {device_blocks}, "
                         f"{host_blocks}")
    rows = sorted(requests, key=lambda r: r.timestamp_ms)
    dev: OrderedDict[int, None] = OrderedDict()
    host: OrderedDict[int, None] = OrderedDict()
    total = dev_hits = host_hits = input_tokens = hit_tokens = 0

    def host_put(h: int) -> None:
        if h in host:
            host.move_to_end(h)
            return
        if host_blocks == 0:
            return
        while len(host) >= host_blocks:
            host.popitem(last=False)
        host[h] = None

    for req in rows:
        ids = req.hash_ids
        total += len(ids)
        k = leading_run(ids, dev)
        j = k
        while j < len(ids) and ids[j] in host:
            host.move_to_end(ids[j])  # a load refreshes the block in the host tier
            j += 1
        dev_hits += k
        host_hits += j - k
        input_tokens += req.input_length
        hit_tokens += min(j * MOONCAKE_BLOCK_TOKENS, req.input_length)
        keep = ids[:device_blocks]
        for evicted in lru_hold(dev, keep, device_blocks):
            if mode == "write-back":
                host_put(evicted)
        if mode == "on-free":
            for h in keep:
                if h not in host:
                    host_put(h)
    return {"mode": mode, "device_blocks": device_blocks, "host_blocks": host_blocks,
            "requests": len(rows), "total_blocks": total, "device_hit_blocks": dev_hits,
            "host_hit_blocks": host_hits, "device_hit_rate": hit_rate(dev_hits, total),
            "block_hit_rate": hit_rate(dev_hits + host_hits, total),
            "token_hit_rate": hit_rate(hit_tokens, input_tokens)}


def pooled_replay(requests: Iterable[MooncakeRequest], instances: int, device_blocks: int,
                  store_blocks: int | None = 0) -> dict[str, Any]:
    """Replay rows (timestamp order) dealt round-robin over ``instances`` device LRUs of
    ``device_blocks`` hash ids each, sharing one store LRU of ``store_blocks`` ids (None:
    unbounded; 0: no store, the instances are local-only). Hit blocks per tier, the block
    and token hit rates over all instances, and each instance's block hit rate.

    With one instance and no store this is :func:`mooncake_lru_replay` exactly."""
    if instances < 1 or device_blocks < 1:
        raise ValueError(f"need instances >= 1 and device_blocks >= 1, got {instances}, "
                         f"{device_blocks}")
    if store_blocks is not None and store_blocks < 0:
        raise ValueError(f"store_blocks must be >= 0 or None, got {store_blocks}")
    rows = sorted(requests, key=lambda r: r.timestamp_ms)
    devs: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(instances)]
    store: OrderedDict[int, None] = OrderedDict()
    use_store = store_blocks is None or store_blocks > 0
    total = dev_hits = store_hits = input_tokens = hit_tokens = 0
    per_total = [0] * instances
    per_hits = [0] * instances

    for i, req in enumerate(rows):
        n = i % instances
        dev = devs[n]
        ids = req.hash_ids
        total += len(ids)
        k = leading_run(ids, dev)
        j = k
        if use_store:
            while j < len(ids) and ids[j] in store:
                store.move_to_end(ids[j])  # a load refreshes the block in the store
                j += 1
        dev_hits += k
        store_hits += j - k
        per_total[n] += len(ids)
        per_hits[n] += j
        input_tokens += req.input_length
        hit_tokens += min(j * MOONCAKE_BLOCK_TOKENS, req.input_length)
        keep = ids[:device_blocks]
        lru_hold(dev, keep, device_blocks)
        if use_store:  # on free: write through the blocks the store lacks
            for h in keep:
                if h in store:
                    continue
                if store_blocks is not None:
                    while len(store) >= store_blocks:
                        store.popitem(last=False)
                store[h] = None
    return {"instances": instances, "device_blocks": device_blocks,
            "store_blocks": store_blocks, "requests": len(rows), "total_blocks": total,
            "device_hit_blocks": dev_hits, "store_hit_blocks": store_hits,
            "device_hit_rate": hit_rate(dev_hits, total),
            "block_hit_rate": hit_rate(dev_hits + store_hits, total),
            "token_hit_rate": hit_rate(hit_tokens, input_tokens),
            "per_instance_block_hit_rate": [hit_rate(h, t) for h, t in zip(per_hits, per_total, strict=True)]}


def _store_tokens(text: str) -> int | None:
    if text.lower() in ("inf", "unbounded", "none"):
        return None
    value = int(text.replace("_", "").replace(",", ""))
    if value < 1:
        raise argparse.ArgumentTypeError(f"store tokens must be >= 1 or 'inf', got {text!r}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """Print device-only LRU, device + host tier (both modes) and the unbounded bound."""
    p = argparse.ArgumentParser(prog="python -m kvstore.benchmarks.tier_replay",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="trace file (default: the conversation trace)")
    p.add_argument("--device-tokens", type=int, default=3_000_000)
    p.add_argument("--host-tokens", type=int, default=30_000_000)
    p.add_argument("--instances", type=int, default=4,
                   help="instances sharing one store, each with 1/N of --device-tokens")
    p.add_argument("--store-tokens", type=_store_tokens, nargs="+", default=None,
                   help="shared-store capacities in tokens ('inf': unbounded; default: "
                        "unbounded, 10x and 1x --device-tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    path = args.trace or trace_file("mooncake_conversation")
    rows = load_mooncake(path)
    bt = MOONCAKE_BLOCK_TOKENS
    dev_blocks, host_blocks = args.device_tokens // bt, args.host_tokens // bt
    t0 = time.perf_counter()
    device_only, unbounded = mooncake_lru_replay(rows, dev_blocks), mooncake_lru_replay(rows, None)
    out: dict[str, Any] = {
        "trace": str(path), "device_tokens": args.device_tokens, "host_tokens": args.host_tokens,
        "device_only": {k: device_only[k] for k in ("block_hit_rate", "token_hit_rate")},
        "unbounded": {k: unbounded[k] for k in ("block_hit_rate", "token_hit_rate")},
    }
    for mode in MODES:
        r = tiered_replay(rows, dev_blocks, host_blocks, mode)
        out[mode] = {k: r[k] for k in ("block_hit_rate", "token_hit_rate", "device_hit_rate",
                                       "device_hit_blocks", "host_hit_blocks", "total_blocks")}
    n = args.instances
    if n < 1 or dev_blocks < n:
        p.error(f"--instances must be in 1..{dev_blocks} (device blocks), got {n}")
    one = pooled_replay(rows, 1, dev_blocks, 0)
    assert one["block_hit_rate"] == device_only["block_hit_rate"]  # the same model
    pooled: dict[str, Any] = {"instances": n, "device_tokens_each": dev_blocks // n * bt,
                              "one_instance": one,
                              "local_only": pooled_replay(rows, n, dev_blocks // n, 0),
                              "shared": []}
    store_tokens = args.store_tokens or [None, 10 * args.device_tokens, args.device_tokens]
    for st in store_tokens:
        r = pooled_replay(rows, n, dev_blocks // n, None if st is None else max(1, st // bt))
        r["store_tokens"] = st
        pooled["shared"].append(r)
    for r in (pooled["local_only"], *pooled["shared"]):
        r["ratio_to_one_instance"] = r["block_hit_rate"] / one["block_hit_rate"]
        r["token_ratio_to_one_instance"] = r["token_hit_rate"] / one["token_hit_rate"]
    out["pooled"] = pooled
    out["seconds"] = round(time.perf_counter() - t0, 2)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{path}: {len(rows)} requests, device {args.device_tokens:,} tokens, host tier "
          f"{args.host_tokens:,} tokens ({bt}-token blocks)")
    print(f"  {'':26s} {'blocks':>7s} {'tokens':>7s}")
    rows_out = [("device-only LRU", out["device_only"])]
    rows_out += [(f"device + host, {mode}", out[mode]) for mode in MODES]
    rows_out.append(("unbounded (the bound)", out["unbounded"]))
    for name, r in rows_out:
        print(f"  {name:26s} {r['block_hit_rate']:7.3f} {r['token_hit_rate']:7.3f}")
    for mode in MODES:
        r = out[mode]
        print(f"  {mode}: the host tier adds {r['host_hit_blocks'] / r['total_blocks']:.3f} of "
              "all blocks")
    each = pooled["device_tokens_each"]
    print(f"\n{n} instances round-robin, {each:,} device tokens each, against one instance with "
          f"{dev_blocks * bt:,}")
    print(f"  {'':40s} {'blocks':>7s} {'tokens':>7s} {'ratio':>6s} {'store':>6s}")
    table = [("one instance, all the capacity", one),
             (f"{n} local-only instances", pooled["local_only"])]
    for r in pooled["shared"]:
        st = r["store_tokens"]
        table.append((f"{n} + shared store, " + ("unbounded" if st is None else f"{st:,} tokens"), r))
    for name, r in table:
        ratio = r["block_hit_rate"] / one["block_hit_rate"]
        sh = r.get("store_hit_blocks", 0) / r["total_blocks"]
        print(f"  {name:40s} {r['block_hit_rate']:7.3f} {r['token_hit_rate']:7.3f} "
              f"{ratio:5.2f}x {sh:6.3f}")
    print("  ratio: block hit rate over the one instance's (goal for the shared store: >= 0.9x); "
          "store: blocks hit in the store")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
