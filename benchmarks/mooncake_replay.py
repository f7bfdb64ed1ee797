"""The Mooncake FAST'25 hit-rate-vs-capacity curve, replayed through kvstore's BlockPool.

Each trace row names its 512-token blocks by prefix-chained hash ids. The replay drives
the real :class:`kvstore.block_pool.BlockPool` with those ids directly (one
full-attention group, one block id per hash id, a pool of ``capacity_tokens / 512``
usable blocks): per request in timestamp order it looks up the longest run of leading
ids present, touches them, allocates the missing blocks (the pool evicts least recently
used cached blocks), caches them, then frees the request's blocks deepest first. Hits
are counted in whole blocks, as the paper does. The independent oracle
:func:`kvstore.benchmarks.traces.mooncake_lru_replay` must agree exactly.

Run ``kvstore bench replay --what lru --out docs/figures`` for the figure, a JSON
and a CSV.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kvstore.benchmarks.output import pyplot, write_csv, write_json
from kvstore.benchmarks.traces import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRequest,
    load_mooncake,
    mooncake_lru_replay,
    mooncake_paper_points,
)
from kvstore.block import KVCacheBlock
from kvstore.block_pool import BlockPool
from kvstore.utils import hit_rate

__all__ = [
    "TRACES",
    "PAPER_CAPACITIES",
    "default_capacities",
    "pool_replay",
    "replay_curve",
    "gap_analysis",
    "plot_curves",
    "run_mooncake_replay",
]

# Trace short name -> (trace_file key, the paper's workload name).
TRACES: dict[str, tuple[str, str]] = {
    "conversation": ("mooncake_conversation", "conversation"),
    "synthetic": ("mooncake_synthetic", "synthetic"),
}

PAPER_CAPACITIES: tuple[int, ...] = (10_000, 100_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000,
                                     10_000_000, 50_000_000, 100_000_000, 1_000_000_000)


def default_capacities(per_decade: int = 4, quick: bool = False) -> list[int]:
    """Capacities in tokens: the paper's, plus a log grid from 1e4 to 1e9 (none in quick mode)."""
    caps = set(PAPER_CAPACITIES)
    if not quick:
        for e in range(4 * per_decade, 9 * per_decade + 1):
            caps.add(int(round(10 ** (e / per_decade), -2)))
    return sorted(caps)


def _sorted_rows(requests: Iterable[MooncakeRequest]) -> list[MooncakeRequest]:
    return sorted(requests, key=lambda r: r.timestamp_ms)


def pool_replay(requests: Iterable[MooncakeRequest], capacity_blocks: int | None,
                block_tokens: int = MOONCAKE_BLOCK_TOKENS, eviction: str = "lru") -> dict[str, Any]:
    """Replay Mooncake rows through a BlockPool of ``capacity_blocks`` usable blocks
    (None: unbounded) under the named eviction policy and count hits as the paper does.

    Returns the oracle's totals (``input_tokens``, ``hit_tokens``, ``total_blocks``,
    ``hit_blocks``, ``evictions``, ``token_hit_rate``, ``block_hit_rate``,
    ``per_request_hit_tokens``) plus ``pool_blocks`` (the pool actually built: a pool at
    least as large as the number of distinct ids never evicts, so it is capped there
    with identical results), ``link_breaks`` (a leading id present in the pool but not
    linked to the block before it; 0 on a consistent trace), ``unlinked_present``
    (ids present after the hit run ended; reused, not recomputed, as the oracle does) and
    ``partial_tail_tokens`` / ``token_hit_rate_with_tails``: an estimate that also counts
    a chat turn's reuse of the previous turn's partial last block while that block is
    cached (a token-level cache with partial hits reuses it; the trace's ids cannot say
    so, since the block gets a new id once it fills). The replay itself is unchanged."""
    if capacity_blocks is not None and capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
    rows = _sorted_rows(requests)
    distinct = len({h for r in rows for h in r.hash_ids})
    cap = capacity_blocks
    pool_blocks = distinct if cap is None else min(cap, distinct)
    input_tokens = sum(r.input_length for r in rows)
    total_blocks = sum(len(r.hash_ids) for r in rows)
    out: dict[str, Any] = {
        "capacity_blocks": cap,
        "capacity_tokens": None if cap is None else cap * block_tokens,
        "pool_blocks": pool_blocks,
        "requests": len(rows),
        "input_tokens": input_tokens,
        "total_blocks": total_blocks,
    }
    if pool_blocks == 0:  # nothing can be cached
        out.update(hit_tokens=0, hit_blocks=0, evictions=0, link_breaks=0, unlinked_present=0,
                   token_hit_rate=0.0, partial_tail_tokens=0, token_hit_rate_with_tails=0.0,
                   block_hit_rate=0.0, per_request_hit_tokens=[0] * len(rows))
        return out
    pool = BlockPool(pool_blocks + 1, enable_caching=True, eviction=eviction)
    root = pool.root_serial(None)
    find, cached, touch = pool.find_cached, pool.cached_blocks, pool.touch
    hit_tokens = hit_blocks = link_breaks = unlinked = tail_tokens = 0
    per_request: list[int] = []
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
        hit = min(k * block_tokens, req.input_length)
        per_request.append(hit)
        hit_tokens += hit
        hit_blocks += k
    if pool.num_free_blocks != pool.num_usable_blocks:
        raise RuntimeError("pool replay leaked blocks")
    out.update(hit_tokens=hit_tokens, hit_blocks=hit_blocks, evictions=pool.stats.evictions,
               link_breaks=link_breaks, unlinked_present=unlinked,
               token_hit_rate=hit_rate(hit_tokens, input_tokens),
               partial_tail_tokens=tail_tokens,
               token_hit_rate_with_tails=hit_rate(hit_tokens + tail_tokens, input_tokens),
               block_hit_rate=hit_rate(hit_blocks, total_blocks),
               per_request_hit_tokens=per_request)
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
                 check_oracle: bool = True) -> list[dict[str, Any]]:
    """Pool replay (and the oracle) at each capacity; one row per capacity, with
    ``agree`` True when the pool and the oracle give the same hits per request and the
    same eviction count."""
    rows = _sorted_rows(requests)
    out = []
    for cap_tokens in capacities_tokens:
        blocks = cap_tokens // block_tokens
        t0 = time.perf_counter()
        res = pool_replay(rows, blocks, block_tokens)
        t_pool = time.perf_counter() - t0
        row = {k: v for k, v in res.items() if k != "per_request_hit_tokens"}
        row.update(capacity_tokens=cap_tokens, pool_s=t_pool)
        if check_oracle:
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
    rows = _sorted_rows(requests)
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
    ax.set_xscale("log")
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
                        check_oracle: bool = True, log: Any = print) -> dict[str, Any]:
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
        curves[name] = replay_curve(rows, caps, check_oracle=check_oracle)
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
