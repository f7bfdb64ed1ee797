"""The sweep behind ``kvstore bench``: one workload replayed under several cache policies at
KV byte budgets for a model shape."""

from __future__ import annotations

import math
import multiprocessing
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvstore.benchmarks.simulator import DEFAULT_STEP_TIME, SimResult, StepTime, TierOptions, simulate
from kvstore.benchmarks.workloads import Workload, ideal_hit_tokens
from kvstore.engine.scheduler import SchedulerConfig
from kvstore.errors import RequestTooLargeError
from kvstore.specs import (
    DTYPE_ITEMSIZE,
    FullAttentionSpec,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)
from kvstore.utils import cdiv


@dataclass(frozen=True)
class ModelShape:
    """The KV-relevant shape of a model: its hybrid layout repeats ``sliding_per_full`` sliding
    layers (0: none) then one full layer; ``kv_lora_rank`` makes the layers MLA (``MLASpec``)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    sliding_window: int = 1024
    sliding_per_full: int = 5
    kv_lora_rank: int = 0
    rope_dim: int = 0

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token with every layer full attention."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_ITEMSIZE[self.dtype]

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block id of the all-full layout."""
        return self.bytes_per_token * block_size

    def full_specs(self, block_size: int) -> list[KVCacheSpec]:
        """Every layer full attention."""
        return [self._full(block_size)] * self.num_layers

    def _full(self, block_size: int) -> FullAttentionSpec:
        if self.kv_lora_rank:
            return MLASpec(block_size, dtype=self.dtype, kv_lora_rank=self.kv_lora_rank,
                           rope_dim=self.rope_dim)
        return FullAttentionSpec(block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def hybrid_specs(self, block_size: int) -> list[KVCacheSpec]:
        """The hybrid layout's layers."""
        full = self._full(block_size)
        local = SlidingWindowSpec(block_size, self.num_kv_heads, self.head_dim, self.dtype,
                                  window=self.sliding_window)
        period = self.sliding_per_full + 1
        return [full if i % period == period - 1 else local for i in range(self.num_layers)]

    def describe(self) -> str:
        """One line: layers, heads (or the latent), dtype, bytes per token, hybrid layout."""
        per_layer = (f"MLA latent {self.kv_lora_rank} + {self.rope_dim}" if self.kv_lora_rank
                     else f"{self.num_kv_heads} kv heads x head_dim {self.head_dim}")
        hybrid = (f"hybrid = {self.sliding_per_full} sliding (W={self.sliding_window}) : 1 full"
                  if self.sliding_per_full else "no sliding layers")
        return (f"{self.name}: {self.num_layers} layers x {per_layer}, {self.dtype}; "
                f"{format_bytes(self.bytes_per_token)}/token all-full; {hybrid}")


MODEL_SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    ModelShape("llama-3-8b", 32, 8, 128),  # also Mistral 7B
    ModelShape("llama-3-70b", 80, 8, 128),
    ModelShape("qwen2.5-7b", 28, 4, 128),
    ModelShape("gemma-3-12b", 48, 8, 256),  # its native layout is the hybrid one
    ModelShape("gemma-3-4b", 34, 4, 256),
    # DeepSeek-V3 / Kimi K2 (a latent of 512 + 64 per token), and as a GQA model would cache.
    ModelShape("deepseek-v3", 61, 1, 288, sliding_per_full=0, kv_lora_rank=512, rope_dim=64),
    ModelShape("deepseek-v3-gqa", 61, 8, 128, sliding_per_full=0),
    ModelShape("tiny", 6, 1, 8, dtype="float16", sliding_window=64),  # tests and demos
)}


@dataclass(frozen=True)
class Policy:
    """One way to run the cache (``base``: the device-only policy a tiered one extends)."""

    name: str
    label: str
    layout: str = "full"  # "full" or "hybrid"
    enable_caching: bool = True
    enable_partial_hits: bool = False
    reserve_full_output: bool = False
    eviction: str = "lru"
    tiered: bool = False
    base: str = ""

    @property
    def reference(self) -> str:
        """The policy whose unbounded replay this one is scored against."""
        return self.base or self.name


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("naive", "naive reservation (prompt + max output, no caching)", enable_caching=False,
           reserve_full_output=True),
    Policy("paged", "paged, no prefix caching", enable_caching=False),
    Policy("prefix", "paged + full-block prefix caching"),
    Policy("partial", "paged + prefix caching with partial hits (CoW)", enable_partial_hits=True),
    Policy("hybrid", "hybrid 5 sliding : 1 full, prefix caching + partial hits",
           layout="hybrid", enable_partial_hits=True),
)}
DEFAULT_POLICIES: tuple[str, ...] = tuple(POLICIES)
TIERED_SUFFIX = "+tiers"


def policy_named(name: str) -> Policy:
    """A policy by name; ``BASE@EVICTION`` and ``NAME+tiers`` are registered on first use."""
    from kvstore.eviction import EVICTION_POLICIES

    if name in POLICIES:
        return POLICIES[name]
    if name.endswith(TIERED_SUFFIX):
        b = policy_named(name.removesuffix(TIERED_SUFFIX))
        if not b.enable_caching or b.tiered:
            raise KeyError(f"unknown policy {name!r}: tiers need a caching policy")
        policy = replace(b, name=name, label=f"{b.label}, with tiers", tiered=True, base=b.name)
    else:
        base, _, eviction = name.partition("@")
        if base not in POLICIES or eviction not in EVICTION_POLICIES:
            raise KeyError(f"unknown policy {name!r}")
        b = POLICIES[base]
        policy = replace(b, name=name, label=f"{b.label}, {eviction} eviction", eviction=eviction)
    POLICIES[name] = policy
    return policy


def with_evictions(policies: Sequence[str], evictions: Sequence[str]) -> list[str]:
    """Caching policies once per eviction policy (``BASE@EVICTION``, LRU: BASE), others once."""
    return list(dict.fromkeys(
        p if e == "lru" or not POLICIES[p].enable_caching else policy_named(f"{p}@{e}").name
        for p in policies for e in evictions))


def with_tiers(policies: Sequence[str]) -> list[str]:
    """Each caching policy followed by itself with tiers (``NAME+tiers``)."""
    out: list[str] = []
    for p in policies:
        out += [p, policy_named(p + TIERED_SUFFIX).name] if policy_named(p).enable_caching else [p]
    return out


_UNITS = {
    "": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str) -> int:
    """A positive byte count from text like ``1GiB``, ``512MiB``, ``1.5GB`` or ``1048576``."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or (not m.group(2) and "." in m.group(1)):
        raise ValueError(f"bad size {text!r}: use a byte count or a number with a unit (B, KiB, "
                         "MiB, GiB, KB, MB, GB)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return size


def parse_pool_sizes(text: str | Sequence[str], block_bytes: int) -> list[int]:
    """Byte budgets, largest first, from a comma list of sizes and all-full block counts."""
    out = []
    for item in (i.strip() for i in (text.split(",") if isinstance(text, str) else text)):
        if item.isdigit():
            n = int(item)
            if n < 2:
                raise ValueError(f"a pool needs at least 2 blocks, got {n}")
            out.append(n * block_bytes)
        elif item:
            out.append(parse_size(item))
    if not out:
        raise ValueError("no pool sizes given")
    return sorted(set(out), reverse=True)


def format_bytes(n: float) -> str:
    """Bytes in binary units, three significant digits, no exponent: ``39.2 GiB``, ``1023 MiB``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if abs(v) >= 100 else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def request_blocks(workload: Workload, block_size: int) -> list[int]:
    """Blocks each request holds at its longest (prompt + max output) with full attention."""
    return [cdiv(len(r.prompt_token_ids) + r.max_tokens, block_size) for r in workload.requests
            if r.max_tokens >= 1]


def typical_tokens(workload: Workload) -> int:
    """The mean length a request reaches, which a hybrid layout's groups are packed for."""
    lengths = request_blocks(workload, 1)  # blocks of one token: the lengths
    return max(1, round(sum(lengths) / len(lengths))) if lengths else 1


def hybrid_layout_line(workload: Workload, shape: ModelShape, block_size: int) -> str:
    """How the hybrid layout's layers are grouped for this workload (one line)."""
    typical = typical_tokens(workload)
    c = make_kv_cache_config(shape.hybrid_specs(block_size), num_blocks=2,
                             typical_tokens=typical)
    return (f"hybrid layout, packed for requests of {typical:,} tokens (the mean): "
            f"{len(c.groups)} groups of {c.num_slots} layer slots, {c.num_padding_layers} "
            f"padding, {c.num_kept_whole_layers} sliding layer(s) kept whole")


def default_budgets(workload: Workload, shape: ModelShape, block_size: int,
                    num_points: int = 10) -> list[int]:
    """Geometric budgets from every request held at once down to the largest alone (+ null)."""
    need = request_blocks(workload, block_size)
    if not need:
        raise ValueError("empty workload")
    hi = (sum(need) + 1) * shape.block_bytes(block_size)
    lo = (max(need) + 1) * shape.block_bytes(block_size)
    if num_points < 2 or hi <= lo:
        return [hi]
    ratio = (hi / lo) ** (1 / (num_points - 1))
    return [hi] + [int(hi / ratio**i) for i in range(1, num_points - 1)] + [lo]


@dataclass
class SweepRow:
    """A policy at one budget (None: unbounded); no ``metrics`` when the pool cannot hold some
    request (the reason in ``error``); :func:`run_sweep` fills in the fields after them."""

    policy: str
    layout: str
    point: int  # position of the budget in the sweep (-1: unbounded)
    budget_bytes: int | None
    unbounded: bool
    num_blocks: int  # in the pool, the null block included
    num_groups: int
    layer_slots: int
    padding_layers: int
    kept_whole_layers: int  # sliding layers held as full attention (group packing)
    bytes_per_block: int
    feasible: bool = False
    error: str = ""
    wall_s: float = 0.0
    metrics: SimResult | None = None
    budget_label: str | None = None
    vs_unbounded: float | None = None
    vs_ideal: float | None = None
    model_time_s: float | None = None  # the steps under the sweep's StepTime

    def as_dict(self) -> dict[str, Any]:
        """The flat JSON and CSV row: the pool, the metrics, then labels and ratios that apply."""
        names = [f.name for f in fields(self)]
        out = {n: getattr(self, n) for n in names[:names.index("metrics")]}
        if self.metrics is not None:
            out.update(self.metrics.summary())
            out["model_time_s"] = self.model_time_s
        if self.budget_label is not None:
            out["budget_label"] = self.budget_label
            if self.feasible:
                out["vs_unbounded"] = self.vs_unbounded
                out["vs_ideal"] = self.vs_ideal
        return out


@dataclass
class SweepMeta:
    """What a sweep replayed: the workload, the model shape, the budgets and the bounds."""

    workload: str
    description: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    model_shape: str
    model_shape_desc: str
    block_size: int
    bytes_per_token: int
    block_bytes_full: int
    budgets: list[int]
    everything_fits_bytes: int
    largest_request_bytes: int
    largest_request_tokens: int
    policies: dict[str, str]  # name -> label
    scheduler: dict[str, int]
    ideal_token_hit_rate: float
    ideal_block_hit_rate: float
    ideal_token_hit_tokens: int
    ideal_block_hit_tokens: int
    jobs: int
    wall_s: float = 0.0
    total_replays: int = 0
    completed_replays: int = 0
    interrupted: bool = False  # Ctrl-C: only `completed_replays` of the rows are present
    tiers: dict[str, Any] = field(default_factory=dict)  # TierOptions' fields; {}: none
    step_time: StepTime = DEFAULT_STEP_TIME  # the model behind each row's model_time_s


@dataclass
class SweepResult:
    """Rows of every (budget, policy) replay, the unbounded references and the findings."""

    meta: SweepMeta
    rows: list[SweepRow]
    unbounded: dict[str, SweepRow]
    findings: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"meta": asdict(self.meta), "rows": [r.as_dict() for r in self.rows],
                "unbounded": {p: r.as_dict() for p, r in self.unbounded.items()},
                "findings": self.findings}

    @property
    def nothing_fits(self) -> bool:
        """Whether no bounded replay fitted (every budget too small for some request)."""
        return not any(r.feasible for r in self.rows)


def run_point(workload: Workload, policy: Policy, shape: ModelShape, block_size: int,
              budget: int | None, sched: SchedulerConfig | None = None,
              index: int = 0, tiers: TierOptions | None = None) -> SweepRow:
    """One policy at one budget (None: a pool that never evicts); not ``feasible`` when the pool
    holds fewer than 2 blocks or some request can never fit it."""
    if policy.tiered and not tiers:
        raise ValueError(f"policy {policy.name} needs tiers (TierOptions)")
    sched = replace(sched or SchedulerConfig(), reserve_full_output=policy.reserve_full_output)
    t0 = time.perf_counter()
    hybrid = policy.layout == "hybrid"
    specs = shape.hybrid_specs(block_size) if hybrid else shape.full_specs(block_size)
    # A hybrid layout is packed for this workload's requests, as an engine would be set up.
    typical = typical_tokens(workload) if hybrid else None
    layout = make_kv_cache_config(specs, num_blocks=2, typical_tokens=typical)  # its size is unused
    bpb = layout.bytes_per_block
    # Unbounded: room for every page any request ever holds, in every group, at once.
    num_blocks = (budget // bpb if budget is not None
                  else sum(request_blocks(workload, block_size)) * len(layout.groups) + 1)
    row = SweepRow(policy.name, policy.layout, index, budget, budget is None, num_blocks,
                   len(layout.groups), layout.num_slots, layout.num_padding_layers,
                   layout.num_kept_whole_layers, bpb)
    if num_blocks < 2:
        row.error = (f"{format_bytes(budget or 0)} holds {num_blocks} blocks of "
                     f"{format_bytes(bpb)}; a pool needs at least 2 (one is the null block)")
    else:
        config = make_kv_cache_config(specs, num_blocks=num_blocks, typical_tokens=typical)
        try:
            row.metrics = simulate(
                workload, config, enable_caching=policy.enable_caching,
                enable_partial_hits=policy.enable_partial_hits, scheduler_config=sched,
                eviction=policy.eviction, tiers=tiers if policy.tiered else None)
            row.feasible = True
        except RequestTooLargeError as e:
            row.error = str(e)
    row.wall_s = time.perf_counter() - t0
    return row


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_sweep`: ``partial`` holds the replays that had finished."""

    def __init__(self, partial: SweepResult) -> None:
        super().__init__(f"sweep interrupted after {partial.meta.completed_replays} of "
                         f"{partial.meta.total_replays} replays")
        self.partial = partial


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore Ctrl-C for the block (in the main thread; elsewhere signals cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


Task = tuple[str, int | None, int]  # policy, budget (None: unbounded), budget index
_WORKER: dict[str, Any] = {}  # run_point's other arguments, set once per process


def _init_worker(context: dict[str, Any], ignore_sigint: bool = False) -> None:
    if ignore_sigint:  # Ctrl-C is the parent's to handle: it terminates the workers
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER.update(context)


def _run_task(task: Task) -> SweepRow:
    policy, budget, index = task
    w = _WORKER
    return run_point(w["workload"], policy_named(policy), w["shape"], w["block_size"], budget,
                     w["sched"], index=index, tiers=w["tiers"])


def _run_parallel(tasks: Sequence[Task], jobs: int, context: dict[str, Any],
                  on_row: Callable[[SweepRow], None]) -> None:
    """Run `tasks` on `jobs` processes that ignore Ctrl-C; on any exception, terminate them."""
    with sigint_ignored():  # the workers start with SIGINT ignored, before their initializer
        pool = multiprocessing.get_context().Pool(jobs, initializer=_init_worker,
                                                  initargs=(context, True))
    try:
        for row in pool.imap_unordered(_run_task, tasks):
            on_row(row)
    except BaseException:
        with sigint_ignored():  # a second Ctrl-C must not interrupt the cleanup
            pool.terminate()
            pool.join()
        raise
    pool.close()
    pool.join()


def run_sweep(workload: Workload, *, shape: ModelShape | str = "llama-3-8b", block_size: int = 16,
              budgets: Sequence[int] | None = None, num_points: int = 10,
              policies: Sequence[str] = DEFAULT_POLICIES,
              scheduler_config: SchedulerConfig | None = None, jobs: int | None = None,
              progress: Callable[[SweepRow], None] | None = None,
              on_start: Callable[[int], None] | None = None,
              tiers: TierOptions | None = None, step_time: StepTime = DEFAULT_STEP_TIME) -> SweepResult:
    """Replay `workload` under every policy at every budget (bytes) and unbounded, over `jobs`
    processes (`on_start(n)`: n replays; `progress(row)`: one finished; Ctrl-C: SweepInterrupted)."""
    from kvstore.tiers.valkey_store import redact_url

    if isinstance(shape, str):
        shape = MODEL_SHAPES[shape]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {list(POLICIES)}")
    if tiers and not any(POLICIES[p].tiered for p in policies):
        policies = with_tiers(policies)
    if not tiers and any(POLICIES[p].tiered for p in policies):
        raise ValueError("tiered policies need tiers (TierOptions)")
    sched = scheduler_config or SchedulerConfig()
    budgets = sorted(budgets if budgets is not None else default_budgets(
        workload, shape, block_size, num_points), reverse=True)
    tasks: list[Task] = [(p, b, i) for i, b in enumerate(budgets) for p in policies]
    tasks += [(p, None, -1) for p in policies
              if POLICIES[p].enable_caching and not POLICIES[p].tiered]
    if on_start is not None:
        on_start(len(tasks))
    need = request_blocks(workload, block_size)
    blk = shape.block_bytes(block_size)
    ideal_tok = ideal_hit_tokens(workload.requests, include_outputs=True)
    ideal_blk = ideal_hit_tokens(workload.requests, block_size, include_outputs=True)
    meta = SweepMeta(
        workload=workload.name, description=workload.description,
        num_requests=len(workload.requests), prompt_tokens=workload.num_prompt_tokens,
        output_tokens=workload.num_output_tokens, model_shape=shape.name,
        model_shape_desc=shape.describe(), block_size=block_size,
        bytes_per_token=shape.bytes_per_token, block_bytes_full=blk, budgets=budgets,
        everything_fits_bytes=(sum(need) + 1) * blk, largest_request_bytes=(max(need) + 1) * blk,
        largest_request_tokens=max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests),
        policies={p: POLICIES[p].label for p in policies},
        scheduler={"max_num_batched_tokens": sched.max_num_batched_tokens,
                   "max_num_seqs": sched.max_num_seqs},
        ideal_token_hit_rate=ideal_tok.rate, ideal_block_hit_rate=ideal_blk.rate,
        ideal_token_hit_tokens=ideal_tok.total, ideal_block_hit_tokens=ideal_blk.total,
        jobs=jobs if jobs is not None else min(4, os.cpu_count() or 1), total_replays=len(tasks),
        step_time=step_time,
        tiers=asdict(replace(tiers, store=tiers.store and redact_url(tiers.store))) if tiers else {})
    context = {"workload": workload, "shape": shape, "block_size": block_size, "sched": sched,
               "tiers": tiers}
    rows: list[SweepRow] = []

    def on_row(row: SweepRow) -> None:
        rows.append(row)
        if progress is not None:
            progress(row)

    t0 = time.perf_counter()
    try:
        if meta.jobs <= 1:
            _init_worker(context)
            for task in tasks:
                on_row(_run_task(task))
        else:  # longest first (small pools run the most steps) to balance the workers
            _run_parallel(sorted(tasks, key=lambda t: math.inf if t[1] is None else t[1]),
                          meta.jobs, context, on_row)
    except KeyboardInterrupt:
        with sigint_ignored():
            partial = _score(meta, rows, time.perf_counter() - t0)
        raise SweepInterrupted(partial) from None
    return _score(meta, rows, time.perf_counter() - t0)


def _score(meta: SweepMeta, rows: list[SweepRow], wall: float) -> SweepResult:
    """The finished rows sorted, labelled and scored against the unbounded replays and ideal."""
    order = {p: i for i, p in enumerate(meta.policies)}
    rows = sorted(rows, key=lambda r: (r.point, order[r.policy]))
    unbounded = {r.policy: r for r in rows if r.unbounded}
    rows = [r for r in rows if not r.unbounded]
    for r in [*rows, *unbounded.values()]:
        if r.metrics is not None:
            r.model_time_s = r.metrics.model_time(meta.step_time)
    for r in rows:
        assert r.budget_bytes is not None
        r.budget_label = format_bytes(r.budget_bytes)
        policy = POLICIES[r.policy]
        if r.metrics is None or not policy.enable_caching:
            continue
        ref = unbounded.get(policy.reference)
        ideal = meta.ideal_token_hit_tokens if policy.enable_partial_hits else meta.ideal_block_hit_tokens
        hits = r.metrics.prompt_hit_tokens
        r.vs_unbounded = (hits / ref.metrics.prompt_hit_tokens
                          if ref and ref.metrics and ref.metrics.prompt_hit_tokens else None)
        r.vs_ideal = hits / ideal if ideal else None
    done = len(rows) + len(unbounded)
    meta = replace(meta, wall_s=wall, completed_replays=done, interrupted=done < meta.total_replays)
    result = SweepResult(meta, rows, unbounded)
    result.findings = find_tension(result)
    return result


def find_tension(result: SweepResult) -> dict[str, Any]:
    """Per policy, the first budget (largest first) with a preemption and, with caching, the
    unbounded hit rate and the first budget below 95% of it."""
    out: dict[str, Any] = {}
    rows = [r for r in result.rows if r.metrics is not None]
    budgets = sorted({r.budget_bytes for r in rows if r.budget_bytes is not None}, reverse=True)
    by = {(r.policy, r.budget_bytes): r.metrics for r in rows}

    def first(name: str, pred: Callable[[SimResult], bool]) -> dict[str, Any]:
        b = next((b for b in budgets if (m := by.get((name, b))) and pred(m)), None)
        return {"budget_bytes": b, "label": format_bytes(b) if b else None}

    for name in dict.fromkeys(r.policy for r in rows):
        info: dict[str, Any] = {"first_preemption": first(name, lambda m: m.preemptions > 0)}
        ref = result.unbounded.get(policy_named(name).reference)
        if ref is not None and ref.metrics is not None:
            bend = 0.95 * ref.metrics.prompt_hit_rate
            info["unbounded_prompt_hit_rate"] = ref.metrics.prompt_hit_rate
            info["hit_below_95pct"] = first(name, lambda m: m.prompt_hit_rate < bend)  # noqa: B023
        out[name] = info
    return out
