"""Prefix reuse and its cost against KV memory: one workload, several cache policies, a
range of pool sizes from "everything fits" down to "barely the largest request".

Pool sizes are KV byte budgets for a named model shape; each policy turns a budget into
a pool with the page-size formula (bytes per block = 2 * block_size * kv_heads *
head_dim * dtype_size * layer slots), so the hybrid layout gets more block ids from the
same bytes. Every point replays the whole workload through the real scheduler and
cache manager (:func:`kvstore.benchmarks.simulator.simulate`).
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from kvstore.benchmarks.simulator import SimResult, simulate
from kvstore.benchmarks.workloads import Workload, ideal_hit_tokens
from kvstore.engine.scheduler import SchedulerConfig
from kvstore.specs import (
    DTYPE_ITEMSIZE,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from kvstore.utils import cdiv

__all__ = [
    "ModelShape",
    "MODEL_SHAPES",
    "Policy",
    "POLICIES",
    "DEFAULT_POLICIES",
    "SweepResult",
    "parse_size",
    "parse_pool_sizes",
    "format_bytes",
    "default_budgets",
    "run_sweep",
    "find_tension",
]


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model, and the hybrid layout it would have.

    The hybrid layout makes every ``sliding_per_full + 1``-th layer full attention and
    the others sliding-window layers of ``sliding_window`` tokens (Gemma 3: 5 local : 1
    global, window 1024)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    sliding_window: int = 1024
    sliding_per_full: int = 5
    note: str = ""

    @property
    def dtype_size(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token with every layer full attention."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_size

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id of the all-full layout."""
        return self.bytes_per_token * block_size

    def full_specs(self, block_size: int) -> list[KVCacheSpec]:
        """Every layer full attention."""
        spec = FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, self.dtype)
        return [spec] * self.num_layers

    def hybrid_specs(self, block_size: int) -> list[KVCacheSpec]:
        """``sliding_per_full`` sliding-window layers, then one full layer, repeated."""
        full = FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, self.dtype)
        local = SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, self.dtype,
                                  window=self.sliding_window)
        period = self.sliding_per_full + 1
        return [full if i % period == period - 1 else local for i in range(self.num_layers)]

    def describe(self) -> str:
        """One line: layers, heads, dtype, bytes per token."""
        return (f"{self.name}: {self.num_layers} layers x {self.num_kv_heads} kv heads x "
                f"head_dim {self.head_dim}, {self.dtype}; {format_bytes(self.bytes_per_token)}/token "
                f"all-full; hybrid = {self.sliding_per_full} sliding (W={self.sliding_window}) "
                f": 1 full")


MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama-3-8b", 32, 8, 128, note="Llama 3 8B / Mistral 7B"),
        ModelShape("llama-3-70b", 80, 8, 128, note="Llama 3 70B"),
        ModelShape("qwen2.5-7b", 28, 4, 128, note="Qwen2.5 7B"),
        ModelShape("gemma-3-12b", 48, 8, 256, sliding_window=1024, sliding_per_full=5,
                   note="Gemma 3 12B (its native layout is the hybrid one)"),
        ModelShape("gemma-3-4b", 34, 4, 256, sliding_window=1024, sliding_per_full=5,
                   note="Gemma 3 4B (its native layout is the hybrid one)"),
        ModelShape("tiny", 6, 1, 8, dtype="float16", sliding_window=64, sliding_per_full=5,
                   note="a toy shape for tests and demos"),
    )
}


# --------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class Policy:
    """One way to run the cache: layout, prefix caching, admission reservation."""

    name: str
    label: str
    layout: str = "full"  # "full" or "hybrid"
    enable_caching: bool = True
    enable_partial_hits: bool = False
    reserve_full_output: bool = False

    def layer_specs(self, shape: ModelShape, block_size: int) -> list[KVCacheSpec]:
        """The layer list this policy's pool is built for."""
        if self.layout == "hybrid":
            return shape.hybrid_specs(block_size)
        return shape.full_specs(block_size)


POLICIES: dict[str, Policy] = {
    p.name: p
    for p in (
        Policy("naive", "naive reservation (prompt + max output, no caching)", enable_caching=False,
               reserve_full_output=True),
        Policy("paged", "paged, no prefix caching", enable_caching=False),
        Policy("prefix", "paged + full-block prefix caching"),
        Policy("partial", "paged + prefix caching with partial hits (CoW)",
               enable_partial_hits=True),
        Policy("hybrid", "hybrid 5 sliding : 1 full, prefix caching + partial hits",
               layout="hybrid", enable_partial_hits=True),
    )
}
DEFAULT_POLICIES: tuple[str, ...] = tuple(POLICIES)


# ------------------------------------------------------------------------------ sizes

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """A byte count from text like ``1GiB``, ``512MiB``, ``1.5GB`` or ``1048576B``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or not m.group(2):
        raise ValueError(f"bad size {text!r}: use a number with a unit (B, KiB, MiB, GiB, KB, MB, GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_pool_sizes(text: str | Sequence[str], block_bytes: int) -> list[int]:
    """Byte budgets from a comma list: sizes with a unit are bytes, bare integers are
    block counts of the all-full layout (``block_bytes`` each, the null block included)."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        if item.isdigit():
            n = int(item)
            if n < 2:
                raise ValueError(f"a pool needs at least 2 blocks, got {n}")
            out.append(n * block_bytes)
        else:
            out.append(parse_size(item))
    if not out:
        raise ValueError("no pool sizes given")
    return sorted(set(out), reverse=True)


def format_bytes(n: float) -> str:
    """Human-readable bytes in binary units."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def request_blocks(workload: Workload, block_size: int) -> list[int]:
    """Blocks each request holds at its longest (prompt + max output) with full attention."""
    return [cdiv(len(r.prompt_token_ids) + r.max_tokens, block_size) for r in workload.requests
            if r.max_tokens >= 1]


def default_budgets(workload: Workload, shape: ModelShape, block_size: int,
                    num_points: int = 10) -> list[int]:
    """Geometric budgets, largest first: from every request held at once ("everything
    fits": no eviction and no preemption is possible) down to the largest request alone
    (plus the null block)."""
    need = request_blocks(workload, block_size)
    if not need:
        raise ValueError("empty workload")
    hi = (sum(need) + 1) * shape.block_bytes(block_size)
    lo = (max(need) + 1) * shape.block_bytes(block_size)
    if num_points < 2 or hi <= lo:
        return [hi]
    ratio = (hi / lo) ** (1 / (num_points - 1))
    return [hi] + [int(hi / ratio**i) for i in range(1, num_points - 1)] + [lo]


# ------------------------------------------------------------------------------ sweep


@dataclass(frozen=True)
class SweepTask:
    """One replay: a policy at a budget (None: the unbounded reference)."""

    policy: str
    budget: int | None
    index: int  # position of the budget in the sweep (-1: unbounded)


_WORKER: dict[str, Any] = {}


def _init_worker(workload: Workload, shape: ModelShape, block_size: int,
                 sched: SchedulerConfig) -> None:
    _WORKER.update(workload=workload, shape=shape, block_size=block_size, sched=sched)


def _config_for(policy: Policy, shape: ModelShape, block_size: int, budget: int | None,
                workload: Workload) -> KVCacheConfig:
    specs = policy.layer_specs(shape, block_size)
    if budget is not None:
        return make_kv_cache_config(specs, memory_bytes=budget)
    # Unbounded: room for every page any request ever holds, in every group, at once.
    groups = make_kv_cache_config(specs, num_blocks=2).groups
    total = sum(request_blocks(workload, block_size)) * len(groups)
    return make_kv_cache_config(specs, num_blocks=total + 1)


def _run_task(task: SweepTask) -> dict[str, Any]:
    w = _WORKER
    return run_point(w["workload"], POLICIES[task.policy], w["shape"], w["block_size"],
                     task.budget, w["sched"], index=task.index)


def run_point(workload: Workload, policy: Policy, shape: ModelShape, block_size: int,
              budget: int | None, sched: SchedulerConfig | None = None,
              index: int = 0) -> dict[str, Any]:
    """One policy at one budget: the replay's figures as a flat row (``feasible`` False
    with an ``error`` when the pool cannot hold some request)."""
    sched = sched or SchedulerConfig()
    if policy.reserve_full_output != sched.reserve_full_output:
        sched = SchedulerConfig(sched.max_num_batched_tokens, sched.max_num_seqs,
                                policy.reserve_full_output)
    row: dict[str, Any] = {"policy": policy.name, "layout": policy.layout, "point": index,
                           "budget_bytes": budget, "unbounded": budget is None}
    t0 = time.perf_counter()
    try:
        config = _config_for(policy, shape, block_size, budget, workload)
        row.update(num_blocks=config.num_blocks, num_groups=len(config.groups),
                   layer_slots=config.num_slots, padding_layers=config.num_padding_layers,
                   bytes_per_block=config.bytes_per_block)
        res = simulate(workload, config, enable_caching=policy.enable_caching,
                       enable_partial_hits=policy.enable_partial_hits, scheduler_config=sched)
    except ValueError as e:
        row.update(feasible=False, error=str(e), wall_s=time.perf_counter() - t0)
        return row
    row.update(feasible=True, error="", wall_s=time.perf_counter() - t0)
    row.update(_result_fields(res))
    return row


def _result_fields(res: SimResult) -> dict[str, Any]:
    s = res.summary()
    keep = ("num_requests", "prompt_tokens", "output_tokens", "expected_tokens", "queried_tokens",
            "hit_tokens", "hit_rate", "prompt_hit_tokens", "prompt_hit_rate", "partial_hits",
            "partial_hit_tokens", "copies", "evictions", "preemptions", "recomputed_tokens",
            "discarded_tokens", "computed_tokens", "steps", "finish_time", "peak_blocks",
            "peak_kv_bytes", "kv_bytes", "mean_usage", "idle_slot_steps", "mean_idle_bytes",
            "peak_idle_bytes", "mean_idle_fraction", "leaked_blocks")
    out = {k: s[k] for k in keep}
    out["saved_tokens"] = res.expected_tokens - res.computed_tokens
    return out


@dataclass
class SweepResult:
    """Rows of every (budget, policy) replay, the unbounded references and the bounds."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    unbounded: dict[str, dict[str, Any]]
    findings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"meta": self.meta, "rows": self.rows, "unbounded": self.unbounded,
                "findings": self.findings}

    def row(self, policy: str, point: int) -> dict[str, Any] | None:
        """The row of `policy` at budget index `point`."""
        for r in self.rows:
            if r["policy"] == policy and r["point"] == point:
                return r
        return None


def run_sweep(workload: Workload, *, shape: ModelShape | str = "llama-3-8b", block_size: int = 16,
              budgets: Sequence[int] | None = None, num_points: int = 10,
              policies: Sequence[str] = DEFAULT_POLICIES,
              scheduler_config: SchedulerConfig | None = None, jobs: int | None = None,
              progress: Callable[[SweepTask, dict[str, Any]], None] | None = None,
              on_start: Callable[[int], None] | None = None) -> SweepResult:
    """Replay `workload` under every policy at every budget (bytes, largest first), plus
    an unbounded reference per caching policy, over `jobs` processes.

    `on_start(n)` is told how many replays will run; `progress(task, row)` is called as
    each one finishes."""
    if isinstance(shape, str):
        shape = MODEL_SHAPES[shape]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {list(POLICIES)}")
    sched = scheduler_config or SchedulerConfig()
    budgets = list(budgets) if budgets is not None else default_budgets(
        workload, shape, block_size, num_points)
    budgets = sorted(budgets, reverse=True)
    tasks = [SweepTask(p, b, i) for i, b in enumerate(budgets) for p in policies]
    tasks += [SweepTask(p, None, -1) for p in policies if POLICIES[p].enable_caching]
    if on_start is not None:
        on_start(len(tasks))
    jobs = jobs if jobs is not None else min(4, os.cpu_count() or 1)
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if jobs <= 1:
        _init_worker(workload, shape, block_size, sched)
        for task in tasks:
            row = _run_task(task)
            rows.append(row)
            if progress is not None:
                progress(task, row)
    else:
        with ProcessPoolExecutor(jobs, initializer=_init_worker,
                                 initargs=(workload, shape, block_size, sched)) as ex:
            # Longest first (small pools run the most steps) to balance the workers.
            futures = {ex.submit(_run_task, t): t for t in sorted(
                tasks, key=lambda t: math.inf if t.budget is None else t.budget)}
            for fut in as_completed(futures):
                row = fut.result()
                rows.append(row)
                if progress is not None:
                    progress(futures[fut], row)
    wall = time.perf_counter() - t0
    order = {p: i for i, p in enumerate(policies)}
    rows.sort(key=lambda r: (r["point"], order[r["policy"]]))
    unbounded = {r["policy"]: r for r in rows if r["unbounded"]}
    rows = [r for r in rows if not r["unbounded"]]
    ideal_tok = ideal_hit_tokens(workload.requests, include_outputs=True)
    ideal_blk = ideal_hit_tokens(workload.requests, block_size, include_outputs=True)
    for r in rows:
        r["budget_label"] = format_bytes(r["budget_bytes"])
        if not r.get("feasible"):
            continue
        policy = POLICIES[r["policy"]]
        ref = unbounded.get(r["policy"])
        ideal = ideal_tok if policy.enable_partial_hits else ideal_blk
        if policy.enable_caching:
            r["vs_unbounded"] = (r["prompt_hit_tokens"] / ref["prompt_hit_tokens"]
                                 if ref and ref.get("prompt_hit_tokens") else None)
            r["vs_ideal"] = r["prompt_hit_tokens"] / ideal.total if ideal.total else None
        else:
            r["vs_unbounded"] = r["vs_ideal"] = None
    need = request_blocks(workload, block_size)
    meta = {
        "workload": workload.name,
        "description": workload.description,
        "num_requests": len(workload.requests),
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens": workload.num_output_tokens,
        "model_shape": shape.name,
        "model_shape_desc": shape.describe(),
        "block_size": block_size,
        "bytes_per_token": shape.bytes_per_token,
        "block_bytes_full": shape.block_bytes(block_size),
        "budgets": budgets,
        "everything_fits_bytes": (sum(need) + 1) * shape.block_bytes(block_size),
        "largest_request_bytes": (max(need) + 1) * shape.block_bytes(block_size),
        "largest_request_tokens": max(len(r.prompt_token_ids) + r.max_tokens
                                      for r in workload.requests),
        "policies": {p: POLICIES[p].label for p in policies},
        "scheduler": {"max_num_batched_tokens": sched.max_num_batched_tokens,
                      "max_num_seqs": sched.max_num_seqs},
        "ideal_token_hit_rate": ideal_tok.rate,
        "ideal_block_hit_rate": ideal_blk.rate,
        "ideal_token_hit_tokens": ideal_tok.total,
        "ideal_block_hit_tokens": ideal_blk.total,
        "jobs": jobs,
        "wall_s": wall,
    }
    result = SweepResult(meta, rows, unbounded)
    result.findings = find_tension(result)
    return result


# ---------------------------------------------------------------------------- analysis


def find_tension(result: SweepResult) -> dict[str, Any]:
    """Where caching stops paying, read off the rows (budgets largest first).

    Per policy: the first budget with a preemption, and the first where tokens
    recomputed after preemptions are at least a quarter of all computed tokens
    ("thrash"). Per caching policy also: the first budget whose first-admission hit rate
    is below 95% and below 50% of the unbounded replay's, the first where recomputed
    tokens exceed the tokens the cache served at first admission, and per budget the
    compute saved against paged without caching. For naive vs paged: steps and idle
    reserved memory per budget."""
    out: dict[str, Any] = {}
    rows = [r for r in result.rows if r.get("feasible")]
    budgets = sorted({r["budget_bytes"] for r in rows}, reverse=True)
    by = {(r["policy"], r["budget_bytes"]): r for r in rows}
    policies = list(dict.fromkeys(r["policy"] for r in rows))

    def first(name: str, pred: Any) -> dict[str, Any]:
        b = next((b for b in budgets if (r := by.get((name, b))) and pred(r)), None)
        return {"budget_bytes": b, "label": format_bytes(b) if b else None}

    for name in policies:
        info: dict[str, Any] = {
            "first_preemption": first(name, lambda r: r["preemptions"] > 0),
            "thrash": first(name, lambda r: r["recomputed_tokens"] >= 0.25 * r["computed_tokens"]),
        }
        ref = result.unbounded.get(name)
        if ref is not None and ref.get("feasible"):
            base = ref["prompt_hit_rate"]
            info["unbounded_prompt_hit_rate"] = base
            info["hit_below_95pct"] = first(name, lambda r, b=base: r["prompt_hit_rate"] < 0.95 * b)
            info["hit_below_50pct"] = first(name, lambda r, b=base: r["prompt_hit_rate"] < 0.5 * b)
            info["recompute_exceeds_hits"] = first(
                name, lambda r: r["recomputed_tokens"] > r["prompt_hit_tokens"])
            savings = []
            for b in budgets:
                r, p = by.get((name, b)), by.get(("paged", b))
                if r and p:
                    savings.append({"budget_bytes": b, "budget_label": format_bytes(b),
                                    "computed_paged": p["computed_tokens"],
                                    "computed": r["computed_tokens"],
                                    "saved_vs_paged": p["computed_tokens"] - r["computed_tokens"],
                                    "saved_frac": 1 - r["computed_tokens"] / p["computed_tokens"],
                                    "steps_paged": p["steps"], "steps": r["steps"]})
            info["savings_vs_paged"] = savings
        out[name] = info
    cmp = []
    for b in budgets:
        n, p = by.get(("naive", b)), by.get(("paged", b))
        if n and p:
            cmp.append({"budget_bytes": b, "budget_label": format_bytes(b),
                        "steps_naive": n["steps"], "steps_paged": p["steps"],
                        "steps_ratio": n["steps"] / p["steps"],
                        "mean_idle_bytes_naive": n["mean_idle_bytes"],
                        "mean_idle_bytes_paged": p["mean_idle_bytes"],
                        "mean_idle_frac_naive": n["mean_idle_fraction"],
                        "mean_idle_frac_paged": p["mean_idle_fraction"],
                        "peak_kv_bytes_naive": n["peak_kv_bytes"],
                        "peak_kv_bytes_paged": p["peak_kv_bytes"],
                        "computed_naive": n["computed_tokens"],
                        "computed_paged": p["computed_tokens"],
                        "preemptions_paged": p["preemptions"]})
    out["naive_vs_paged"] = cmp
    return out
