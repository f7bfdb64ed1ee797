"""Eviction policies on the Mooncake traces, next to LRU and Belady's MIN.

Every online policy runs through the real :class:`kvstore.block_pool.BlockPool` with
:func:`kvstore.benchmarks.mooncake_replay.pool_replay` (one full-attention group, whole
512-token blocks, leading-run hits as the Mooncake paper counts them). MIN is an offline
oracle over the same request model (:func:`min_replay`): when a request's blocks need
room, it evicts the cached block (not held by the request) whose next use is furthest,
deeper blocks first on ties, which keeps the cache prefix-closed, so every present block
of a request is in its hit run and MIN maximizes hit blocks. Each policy is reported as
its token hit rate and as the fraction of the LRU-to-MIN gap it closes. A second offline
line, :func:`reuse_oracle_replay`, is LRU that knows which blocks are never used again and
evicts those first: what a perfect predictor of *whether* a block returns (not when) is
worth. :func:`lirs_replay` is an online line outside the pool: LIRS at block level, the
classic answer to reuse distances longer than the cache.

Run ``kvstore bench replay --what policies --out docs/figures``.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.benchmarks.mooncake_replay import pool_replay
from kvstore.benchmarks.output import pyplot, write_csv, write_json
from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    leading_run,
    load_mooncake,
)
from kvstore.eviction import EVICTION_POLICIES
from kvstore.utils import hit_rate

__all__ = [
    "GAP_CAPACITIES",
    "min_replay",
    "reuse_oracle_replay",
    "lirs_replay",
    "brute_force_best_hit_blocks",
    "gap_closed",
    "policy_curves",
    "run_eviction_replay",
]

# The paper's capacities where the goal applies, in tokens.
GAP_CAPACITIES: tuple[int, ...] = (1_000_000, 2_000_000, 3_000_000, 5_000_000)

_NEVER = 1 << 62


def _sorted(requests: Sequence[MooncakeRequest]) -> list[MooncakeRequest]:
    return sorted(requests, key=lambda r: r.timestamp_ms)


def min_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """Belady's MIN over the request model of `mooncake_lru_replay`: totals
    (``input_tokens``, ``hit_tokens``, ``total_blocks``, ``hit_blocks``, ``evictions``),
    ``token_hit_rate``, ``block_hit_rate``, ``per_request_hit_tokens`` and
    ``unlinked_present`` (present blocks outside the hit run; 0 when prefix-closed)."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    rows = _sorted(requests)
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
    input_tokens = hit_tokens = total_blocks = hit_blocks = evictions = unlinked = 0
    per_request: list[int] = []
    for r, req in enumerate(rows):
        ids = req.hash_ids
        k = leading_run(ids, cache)
        keep = ids[:cap]
        unlinked += sum(1 for h in keep[k:] if h in cache)
        hit = min(k * block_tokens, req.input_length)
        per_request.append(hit)
        hit_tokens += hit
        hit_blocks += k
        input_tokens += req.input_length
        total_blocks += len(ids)
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
    return {
        "capacity_blocks": cap,
        "capacity_tokens": cap * block_tokens,
        "requests": len(rows),
        "input_tokens": input_tokens,
        "hit_tokens": hit_tokens,
        "total_blocks": total_blocks,
        "hit_blocks": hit_blocks,
        "evictions": evictions,
        "unlinked_present": unlinked,
        "token_hit_rate": hit_rate(hit_tokens, input_tokens),
        "block_hit_rate": hit_rate(hit_blocks, total_blocks),
        "per_request_hit_tokens": per_request,
    }


def reuse_oracle_replay(requests: Sequence[MooncakeRequest], capacity_blocks: int,
                        block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> dict[str, Any]:
    """LRU over the request model of `mooncake_lru_replay`, except that a block no later
    request uses is evicted before any other (least recently used first among those, then
    among the rest): offline, it knows whether a block returns but not when. Returns
    ``token_hit_rate``, ``hit_tokens``, ``hit_blocks``, ``evictions``."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    rows = _sorted(requests)
    cap = capacity_blocks
    later: set[int] = set()
    returns: list[frozenset[int]] = [frozenset()] * len(rows)
    for r in range(len(rows) - 1, -1, -1):
        ids = rows[r].hash_ids[:cap]
        returns[r] = frozenset(h for h in ids if h in later)
        later.update(ids)
    dead: OrderedDict[int, None] = OrderedDict()  # never used again; first = LRU
    live: OrderedDict[int, None] = OrderedDict()
    input_tokens = hit_tokens = hit_blocks = evictions = 0
    for r, req in enumerate(rows):
        ids = req.hash_ids
        k = 0
        while k < len(ids) and (ids[k] in live or ids[k] in dead):
            k += 1
        hit_tokens += min(k * block_tokens, req.input_length)
        hit_blocks += k
        input_tokens += req.input_length
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
    return {"capacity_blocks": cap, "hit_tokens": hit_tokens, "hit_blocks": hit_blocks,
            "evictions": evictions, "token_hit_rate": hit_rate(hit_tokens, input_tokens)}


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
    rows = _sorted(requests)
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

    input_tokens = hit_tokens = hit_blocks = evictions = 0
    for req in rows:
        ids = req.hash_ids
        k = leading_run(ids, resident)
        hit_tokens += min(k * block_tokens, req.input_length)
        hit_blocks += k
        input_tokens += req.input_length
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
    return {"capacity_blocks": cap, "hit_tokens": hit_tokens, "hit_blocks": hit_blocks,
            "evictions": evictions, "token_hit_rate": hit_rate(hit_tokens, input_tokens)}


def brute_force_best_hit_blocks(requests: Sequence[MooncakeRequest], capacity_blocks: int) -> int:
    """The most leading-run hit blocks any eviction schedule achieves (exhaustive search over
    which unheld blocks each request evicts; for tiny traces only)."""
    rows = _sorted(requests)
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
                  policies: Sequence[str]) -> list[dict[str, Any]]:
    """One row per capacity: each policy's token hit rate, LIRS's, the reuse oracle's, MIN's,
    and the gap each closes."""
    rows = _sorted(rows)
    out = []
    for cap_tokens in capacities:
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


def plot_policy_curves(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str],
                       path: str | Path) -> None:
    """Hit rate against capacity, one panel per trace, one line per policy plus MIN."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], curves.items(), strict=True):
        xs = [r["capacity_tokens"] for r in rows]
        for p in list(policies):
            ax.plot(xs, [r[p] for r in rows], "-o", ms=3, label=p)
        ax.plot(xs, [r["lirs"] for r in rows], "-.", color="tab:brown",
                label="LIRS, block level (online, outside the pool)")
        ax.plot(xs, [r["reuse_oracle"] for r in rows], ":", color="gray",
                label="LRU knowing which blocks return (offline)")
        ax.plot(xs, [r["min"] for r in rows], "--", color="black", label="MIN (offline)")
        ax.set_xscale("log")
        ax.set_xlabel("capacity (tokens, 512-token blocks)")
        ax.set_ylabel("token hit rate (whole blocks)")
        ax.set_title(f"Mooncake {name}: eviction policies")
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
        curves[name] = policy_curves(rows, capacities, policies)
        log(f"eviction {name}: {len(rows)} requests, {len(capacities)} capacities in "
            f"{time.perf_counter() - t0:.1f}s")
    plot_policy_curves(curves, policies, out / "eviction_hit_rate.png")
    write_csv(out / "eviction_hit_rate.csv",
              [{"trace": name, **r} for name, rows in curves.items() for r in rows])
    result = {"capacities_tokens": list(capacities), "policies": list(policies), "limit": limit,
              "curves": curves}
    write_json(out / "eviction_hit_rate.json", result)
    return result


def format_table(curves: dict[str, list[dict[str, Any]]], policies: Sequence[str]) -> list[str]:
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
