"""The Mooncake traces through the real KVCacheManager with a Gemma-3-27B-like hybrid layout.

Each trace row names its 512-token blocks by prefix-chained hash ids. A row becomes a
request whose prompt holds one 512-token block per id (block h: token h + 1 then zeros, so
equal ids mean equal content) plus one more token, so a repeat can hit every block. Per
row in timestamp order the replay looks the request up (`get_computed_blocks`), admits it
on its hit, prefills the rest in chunks (`grow`; a sliding-window group drops the pages
that leave its window as it goes), and frees it: the request model of the block-level
replays (a request holds its blocks while its missing ones are computed), with the real
managers, pool and eviction policies. Hits are counted in whole blocks (at most the row's
input length), as the Mooncake paper does.

Layouts, at one byte budget stated as tokens of an all-full cache (C tokens: C / 512
blocks of 62 layers):

- ``hybrid``: 10 full-attention layers and 52 sliding-window layers (W = 1024), grouped as
  the manager groups them (one full group and six window groups of 10 layer slots, the
  last holding 2 layers), so the pool has C / 512 x 62 / 10 pages.
- ``full``: all 62 layers full attention (one group, C / 512 pages).
- the bound where windowed pages cost nothing: the full group alone with every byte
  (C / 512 x 6.2 pages of one full group), LRU, block-level (`pool_replay`).

Run ``kvstore bench replay --what layouts --out docs/figures``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.benchmarks.mooncake_replay import pool_replay
from kvstore.benchmarks.output import pyplot, write_csv, write_json
from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    load_mooncake,
)
from kvstore.block_pool import BlockRemoved, BlockStored
from kvstore.eviction import EVICTION_POLICIES, EvictionPolicy
from kvstore.hashing import BlockHash
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, make_kv_cache_config
from kvstore.utils import hit_rate

__all__ = [
    "FULL_LAYERS",
    "WINDOW_LAYERS",
    "WINDOW",
    "CAPACITIES",
    "layer_specs",
    "hybrid_replay",
    "capacity_row",
    "run_hybrid_replay",
]

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
    manager = KVCacheManager(config, enable_partial_hits=False, enable_events=True,
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
    input_tokens = hit_tokens = hit_blocks = total_blocks = truncated = cut_tokens = 0
    per_request: list[int] = []
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
        per_request.append(hit)
        hit_tokens += hit
        hit_blocks += k
        input_tokens += row.input_length
        total_blocks += len(row.hash_ids)
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
        "requests": len(rows),
        "truncated": truncated,
        "input_tokens": input_tokens,
        "hit_tokens": hit_tokens,
        "total_blocks": total_blocks,
        "hit_blocks": hit_blocks,
        "token_hit_rate": hit_rate(hit_tokens, input_tokens),
        "cut_tokens": cut_tokens,
        "cut_rate": hit_rate(cut_tokens, input_tokens),
        "groups": groups,
        "per_request_hit_tokens": per_request,
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


def plot_hybrid_curves(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str],
                       path: str | Path) -> None:
    """Hit rate against capacity, one panel per trace: each hybrid policy, all-full LRU and
    the bound where windowed pages cost nothing."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        xs = [r["capacity_tokens"] for r in rows]
        for p in policies:
            ax.plot(xs, [r[p] for r in rows], "-o", ms=3, label=f"hybrid {p}")
        ax.plot(xs, [r["full_lru"] for r in rows], "-s", color="black", ms=3, label="all-full lru")
        ax.plot(xs, [r["bound"] for r in rows], "--", color="gray",
                label="bound: windowed pages free")
        ax.set_xscale("log")
        ax.set_xlabel("budget (tokens of an all-full cache, 512-token blocks)")
        ax.set_ylabel("token hit rate (whole blocks)")
        ax.set_title(f"Mooncake {name}: 10 full + 52 window (W=1024) layers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> list[str]:
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
    plot_hybrid_curves(curves, policies, out / "eviction_hybrid.png")
    write_csv(out / "eviction_hybrid.csv",
              [{"trace": name, **{k: v for k, v in r.items() if k != "groups"}}
               for name, rows in curves.items() for r in rows])
    result = {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit,
              "curves": curves}
    write_json(out / "eviction_hybrid.json", result)
    return result
