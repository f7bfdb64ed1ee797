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

Run ``kvstore bench replay --what tiers`` (the conversation trace, 3M device
tokens, 30M host tokens; 4 instances with a store unbounded, of 30M and of 3M tokens)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    leading_run,
)
from kvstore.utils import hit_rate

__all__ = ["MODES", "pooled_replay", "tiered_replay"]

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
