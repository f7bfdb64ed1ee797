"""``kvstore bench recurrent``: prefix hits of recurrent hybrids at one byte budget each, for
kvstore's checkpoints, vLLM's policy (``vllm-align``), an ``oracle`` (a free checkpoint at every
block boundary), ``all-full`` attention and kvstore over a host tier (``kvstore+host``)."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

from kvstore.benchmarks.manager import new_manager
from kvstore.benchmarks.output import (
    check_folder,
    name_list,
    out_folder,
    positive_int,
    text_table,
    wrap,
    write_csv,
    write_json,
)
from kvstore.benchmarks.simulator import fake_token
from kvstore.benchmarks.tier_model import ModelTier, PlaceholderConnector
from kvstore.benchmarks.traces import locate_trace, mooncake_to_workload
from kvstore.benchmarks.workloads import RequestSpec, ideal_hit_tokens, make_workload
from kvstore.errors import RequestTooLargeError
from kvstore.eviction import EVICTION_POLICIES
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.request import Request
from kvstore.specs import (
    DTYPE_ITEMSIZE,
    FullAttentionSpec,
    LayerSpec,
    RecurrentStateSpec,
    make_kv_cache_config,
)
from kvstore.utils import cdiv, hit_rate

GiB = 1 << 30
BLOCK_SIZE = 16
CHUNK_TOKENS = 8192  # prefill chunk (tokens): vLLM's default token budget per step


@dataclass(frozen=True)
class Layout:
    """A hybrid's cache layers: `pattern`, ``A`` (attention) or ``R`` (recurrent) per layer."""

    name: str
    pattern: str
    kv_heads: int
    head_dim: int
    state: tuple[tuple[int, ...], ...]
    dtype: str
    source: str

    def specs(self, block_size: int, recurrent: bool = True, all_full: bool = False) -> list[LayerSpec]:
        """The layer specs: the model's, without its recurrent layers, or all full attention."""
        full = FullAttentionSpec(block_size, self.kv_heads, self.head_dim, self.dtype)
        if all_full:
            return [full] * len(self.pattern)
        state = RecurrentStateSpec(block_size, self.state, (self.dtype,))
        return [full if c == "A" else state for c in self.pattern if c == "A" or recurrent]

    @property
    def state_bytes(self) -> int:
        """Bytes of one recurrent layer's state."""
        return RecurrentStateSpec(BLOCK_SIZE, self.state, (self.dtype,)).state_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V of one token in one attention layer."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_ITEMSIZE[self.dtype]

    @property
    def vllm_block_size(self) -> int:
        """vLLM's attention block: the fewest 16-token multiples whose page holds a state."""
        return 16 * cdiv(self.state_bytes, 16 * self.kv_bytes_per_token)

    def budget_of_tokens(self, tokens: int) -> int:
        """Bytes of `tokens` tokens of the layout's attention K/V."""
        return tokens * self.kv_bytes_per_token * self.pattern.count("A")


LAYOUTS = {
    "qwen3-next": Layout(
        "qwen3-next", "RRRA" * 12, kv_heads=2, head_dim=256,
        state=((8192, 3), (32, 128, 128)), dtype="bfloat16",
        source="Qwen3-Next-80B-A3B: 48 layers, full attention every 4th (16 heads, 2 KV heads "
               "of 256); Gated DeltaNet: conv state (2*16*128 + 32*128 channels, kernel 4 - 1), "
               "delta-rule state (32 value heads, 128 x 128), bfloat16"),
    "nemotron-h": Layout(
        "nemotron-h", "".join("R" if c == "M" else "A" for c in
                              "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" if c != "-"),
        kv_heads=8, head_dim=128, state=((10240, 3), (128, 64, 128)), dtype="bfloat16",
        source="Nemotron-H-8B: 52 layers, 24 Mamba2 + 4 attention (32 heads, 8 KV heads of "
               "128) + 24 MLP (no cache); Mamba2: conv state (128*64 + 2*8*128 channels, "
               "kernel 4 - 1), SSM state (128 heads, 64 x 128), bfloat16"),
}

Stops = Literal["checkpoints", "align", "chunks"]


@dataclass(frozen=True)
class System:
    """One row's cache: its layers, block size, policy and where its steps stop."""

    name: str
    specs: list[LayerSpec]
    block_size: int
    eviction: str
    stops: Stops
    checkpoint_every_blocks: int | None = None  # None: CacheConfig's default
    host_tier_bytes: int = 0  # a host tier of this many bytes below the pool (0: none)


def systems(layout: Layout, eviction: str = "worth", host_gib: Sequence[float] = ()) -> list[System]:
    """kvstore, vllm-align, the oracle and all-full for `layout`, then kvstore over each host tier."""
    vbs, bs = layout.vllm_block_size, BLOCK_SIZE
    return [System("kvstore", layout.specs(bs), bs, eviction, "checkpoints"),
            System("vllm-align", layout.specs(vbs), vbs, "lru", "align", checkpoint_every_blocks=1),
            System("oracle", layout.specs(bs, recurrent=False), bs, "worth", "chunks"),
            System("all-full", layout.specs(bs, all_full=True), bs, "lru", "chunks"),
            *(System("kvstore+host", layout.specs(bs), bs, eviction, "checkpoints",
                     host_tier_bytes=int(gib * GiB)) for gib in host_gib)]


@dataclass(frozen=True, slots=True)
class Row:
    """One system at one budget on one workload."""

    layout: str
    workload: str
    system: str
    budget_bytes: int
    block_size: int
    prompt_tokens: int
    hit_tokens: int
    checkpoints_taken: int
    checkpoints_used: int
    checkpoints_evicted: int
    fragmented_bytes_mean: float
    calls: int
    manager_seconds: float
    host_tier_bytes: int = 0
    host_hit_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens computed: those not hit on the device or in the host tier."""
        return self.prompt_tokens - self.hit_tokens

    @property
    def hit_rate(self) -> float:
        """Prompt tokens hit over prompt tokens."""
        return hit_rate(self.hit_tokens, self.prompt_tokens)

    @property
    def us_per_call(self) -> float:
        """Manager time per call, in microseconds."""
        return 1e6 * self.manager_seconds / max(1, self.calls)

    def as_dict(self) -> dict[str, Any]:
        """The fields plus the hit rate, the tokens computed and the time per call."""
        return {**asdict(self), "hit_rate": self.hit_rate, "computed_tokens": self.computed_tokens,
                "us_per_call": self.us_per_call}


def _step_end(m: KVCacheManager, req: Request, nc: int, end: int, stops: Stops, bs: int,
              computed: ComputedBlocks | None) -> int:
    """Where a step from `nc` computed tokens towards `end` stops (a decode step: one token)."""
    if nc >= req.num_prompt_tokens:
        return nc + 1
    if stops == "checkpoints":  # counted from the device hit; a tier hit may lie past some
        base = computed.num_computed_tokens if computed is not None else nc
        positions = [p for p in m.next_checkpoints(req, end - base, computed) if p > nc]
        return positions[0] if positions else end
    last = end // bs * bs  # align: the state at the step's last block boundary is kept
    return last if stops == "align" and nc < last < end else end


def serve(m: KVCacheManager, req: Request, stops: Stops, bs: int, clock: list[float],
          tiers: PlaceholderConnector | None = None, outputs: Sequence[int] = ()
          ) -> tuple[int, int, ComputedBlocks]:
    """Serve one request alone (prefill in chunks, then `outputs` or stand-ins); returns its
    hit tokens (device and tiers), the manager calls (timed into `clock[0]`) and its lookup."""
    n = req.num_prompt_tokens
    t0 = time.perf_counter()
    lookup = m.get_computed_blocks(req)
    clock[0] += time.perf_counter() - t0
    external = tiers.lookup(req, lookup) if tiers is not None else 0
    hit = nc = lookup.num_full_hit_tokens + external if external else lookup.num_computed_tokens
    computed: ComputedBlocks | None = lookup  # None once admitted
    calls, target = 3, n  # the lookup, the free and its copies
    while nc < target:
        t0 = time.perf_counter()
        end = _step_end(m, req, nc, min(nc + CHUNK_TOKENS, target), stops, bs, computed)
        ids = (m.grow(req, end - nc) if computed is None
               else m.admit(req, end - nc, computed, num_external_tokens=external))
        m.take_pending_copies()
        clock[0] += time.perf_counter() - t0
        calls += 2 + (stops == "checkpoints" and nc < n)  # next_checkpoints in prefill only
        if ids is None:
            raise RequestTooLargeError(f"{req.request_id} ({n} prompt tokens) does not fit the "
                                       "pool", request_id=req.request_id)
        if tiers is not None:
            if computed is not None:
                tiers.admitted(req, computed, external)
            tiers.take_transfers().run(None)
        computed = None
        req.num_computed_tokens = nc = end
        if end == n and req.max_tokens > 1:  # the outputs, decoded (all but the last fed)
            req.append_token_ids(list(outputs or [
                fake_token(req.request_id, n + i) for i in range(req.max_tokens)]))
            target = n + req.max_tokens - 1
    t0 = time.perf_counter()
    m.free(req)
    m.take_pending_copies()
    clock[0] += time.perf_counter() - t0
    if tiers is not None:
        tiers.take_transfers().run(None)  # its blocks and checkpoints, into the host tier
    return hit, calls, lookup


def run_systems(requests: Sequence[RequestSpec], compared: Sequence[System], budget: int,
                layout: str, workload: str, repeats: int = 1) -> list[Row]:
    """Replay `requests` through each of `compared` in `repeats` turns, keeping the fastest time."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    best: list[Row | None] = [None] * len(compared)
    for _ in range(repeats):
        for i, system in enumerate(compared):
            gc.collect()
            gc.disable()
            try:
                row = _replay(requests, system, budget, layout, workload)
            finally:
                gc.enable()
            kept = best[i]
            if kept is not None and row.hit_tokens != kept.hit_tokens:
                raise RuntimeError(f"{system.name}: a repeated replay hit differently")
            if kept is None or row.manager_seconds < kept.manager_seconds:
                best[i] = row
    return [row for row in best if row is not None]


def _replay(requests: Sequence[RequestSpec], system: System, budget: int, layout: str, workload: str) -> Row:
    config = make_kv_cache_config(system.specs, memory_bytes=budget)
    # Whole blocks only, as a recurrent state has no value inside one.
    options: dict[str, Any] = {"eviction": system.eviction, "enable_partial_hits": False}
    if system.checkpoint_every_blocks is not None:
        options["checkpoint_every_blocks"] = system.checkpoint_every_blocks
    tiers = (PlaceholderConnector(config, layout, host=ModelTier(system.host_tier_bytes, name="host"))
             if system.host_tier_bytes else None)
    m = new_manager(config, tiers, **options)
    clock = [0.0]
    hits = calls = 0
    fragmented = 0.0
    for spec in sorted(requests, key=lambda r: r.arrival):
        req = Request(spec.request_id, spec.prompt_token_ids, spec.cache_salt, max(1, spec.max_tokens))
        hit, c, _ = serve(m, req, system.stops, system.block_size, clock, tiers, spec.output_token_ids or ())
        hits += hit
        calls += c
        fragmented += m.fragmented_bytes
    if m.num_free_blocks != m.num_usable_blocks:
        raise RuntimeError(f"{system.name}: pages leaked")
    s = m.stats
    return Row(layout, workload, system.name, budget, system.block_size,
               sum(len(r.prompt_token_ids) for r in requests), hits, s.checkpoints_taken,
               s.checkpoints_used, s.checkpoints_evicted, fragmented / max(1, len(requests)),
               calls, clock[0], system.host_tier_bytes,
               tiers.stats.host_hit_tokens if tiers is not None else 0)


#: The goals checked per layout, workload and budget, by key.
GOALS = {
    "vllm": "kvstore >= 2x vllm-align's hit rate (> 0 where it is 0)",
    "oracle": "kvstore >= 80% of the oracle where all-full reaches 80% of its ideal",
    "time": "manager time per call <= 1.3x that without the recurrent group",
}


@dataclass(frozen=True, slots=True)
class Goal:
    """One goal (a key of GOALS) at one cell: whether it holds, and its figures."""

    goal: str
    where: str
    met: bool
    text: str
    reachable: bool = True  # False where no cache of its block size could (2x vllm-align above the ideal)


def goals(rows: Sequence[Row], ideal: dict[str, float]) -> list[Goal]:
    """Each goal, per layout, workload and budget: its figures and whether it holds."""
    by = {(r.layout, r.workload, r.budget_bytes, r.system): r for r in rows}
    out = []
    for (layout, workload, budget, system), r in sorted(by.items()):
        if system != "kvstore":
            continue
        v, o, f = (by.get((layout, workload, budget, s)) for s in ("vllm-align", "oracle", "all-full"))
        where = f"{layout} {workload} {budget / GiB:.3g} GiB"
        if v is not None:
            ok = r.hit_rate >= 2 * v.hit_rate if v.hit_rate > 0 else r.hit_rate > 0
            bound = ideal.get(workload)  # an infinite cache's: no cache of its block size gets more
            beyond = (f"; 2x is above the ideal {bound:.3f}"
                      if bound is not None and 2 * v.hit_rate > bound else "")
            out.append(Goal("vllm", where, ok, f"kvstore {r.hit_rate:.3f} vs vllm-align "
                            f"{v.hit_rate:.3f}{beyond}", reachable=not beyond))
        if o is not None and f is not None and workload in ideal and f.hit_rate >= 0.8 * ideal[workload]:
            ok = r.hit_rate >= 0.8 * o.hit_rate
            out.append(Goal("oracle", where, ok,
                            f"kvstore {r.hit_rate:.3f} vs oracle {o.hit_rate:.3f} (all-full "
                            f"{f.hit_rate:.3f} of ideal {ideal[workload]:.3f})"))
        if o is not None and o.calls:
            ratio = r.us_per_call / max(o.us_per_call, 1e-9)
            total = r.manager_seconds / max(o.manager_seconds, 1e-9)
            out.append(Goal("time", where, ratio <= 1.3,
                            f"{r.us_per_call:.1f} us vs {o.us_per_call:.1f} us a call: "
                            f"{ratio:.2f}x; in all {total:.2f}x ({r.calls} calls vs {o.calls})"))
    return out


def summary(checked: Sequence[Goal], shown: int = 3) -> list[str]:
    """One line per goal: in how many cells it holds, and the first cells where it does not."""
    lines = []
    for key, what in GOALS.items():
        cells = [g for g in checked if g.goal == key]
        if not cells:
            continue
        beyond = sum(1 for g in cells if not g.met and not g.reachable)
        missed = [f"{g.where} ({g.text})" for g in cells if not g.met and g.reachable]
        line = f"{what}: met in {len(cells) - len(missed) - beyond} of {len(cells)}"
        if beyond:
            line += (f" ({beyond} out of any cache's reach: 2x vllm-align above the ideal, an "
                     f"infinite cache's in {BLOCK_SIZE}-token blocks)")
        if missed:
            more = f"; and {len(missed) - shown} more" if len(missed) > shown else ""
            line += "; missed at " + "; ".join(missed[:shown]) + more
        lines.append(line)
    return lines


WORKLOADS = ("shared_system_prompts", "multi_turn_chat", "mixed_default")


def _sizes(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of numbers, got {text!r}") from None
    if out and min(out) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``kvstore bench recurrent``."""
    p.add_argument("--layouts", type=name_list(tuple(LAYOUTS)), default=list(LAYOUTS),
                   metavar="LIST", help=f"comma list of {', '.join(LAYOUTS)}")
    p.add_argument("--workloads", type=name_list(WORKLOADS), default=list(WORKLOADS),
                   metavar="LIST", help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--budgets", type=_sizes, default=[0.5, 1, 2, 4, 8, 16], metavar="GIB",
                   help="comma list of byte budgets in GiB")
    p.add_argument("--requests", type=positive_int, default=200, help="requests per workload")
    p.add_argument("--mooncake", type=_sizes, default=[1e6, 3e6, 1e7], metavar="TOKENS",
                   help="budgets for the Mooncake conversation trace with the qwen3-next "
                        "layout, in tokens of its attention K/V (empty: skip)")
    p.add_argument("--limit", type=positive_int, help="first N rows of the trace (default: every row)")
    p.add_argument("--host-tier-gib", type=_sizes, default=[16], metavar="GIB",
                   help="host tiers below kvstore's pool for the qwen3-next layout, in GiB: a "
                        "kvstore+host row each (empty: none)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="replays of the built-in workloads' kvstore and oracle rows, in turns, "
                        "fastest manager time kept (the Mooncake rows run once)")
    p.add_argument("--eviction", choices=sorted(EVICTION_POLICIES), default="worth",
                   help="kvstore's eviction policy")
    p.add_argument("--out", type=out_folder, default=Path("results/recurrent"), help="output folder")


def run(args: argparse.Namespace) -> int:
    """Every layout x workload x budget x system, the Mooncake rows, then the goals."""
    if args.mooncake:
        try:
            trace_path = locate_trace("mooncake_conversation", option=None)
        except FileNotFoundError as e:
            args.usage_error(f"argument --mooncake: the Mooncake replay {e}; or skip it with --mooncake ''")
    check_folder(args.out, args.usage_error)
    ideal: dict[str, float] = {}
    # Per run: requests, layout, budget, workload, systems and the option that set the budget.
    runs: list[tuple[list[RequestSpec], Layout, int, str, list[System], str]] = []
    for name in args.workloads:
        size = ({"num_conversations": args.requests // 4} if name == "multi_turn_chat"
                else {"num_requests": args.requests})
        specs = make_workload(name, seed=0, **size).requests
        ideal[name] = ideal_hit_tokens(specs, BLOCK_SIZE, include_outputs=True).rate
        for layout in (LAYOUTS[n] for n in args.layouts):
            host_gib = args.host_tier_gib if layout.name == "qwen3-next" else ()
            runs += [(specs, layout, int(gib * GiB), name, systems(layout, args.eviction, host_gib),
                      "--budgets") for gib in args.budgets]
    if args.mooncake:  # prompts without outputs: the trace has no output content
        trace = [replace(r, max_tokens=1)
                 for r in mooncake_to_workload(trace_path, limit=args.limit).requests]
        ideal["mooncake_conversation"] = ideal_hit_tokens(trace, BLOCK_SIZE, include_outputs=True).rate
        layout = LAYOUTS["qwen3-next"]
        runs += [(trace, layout, layout.budget_of_tokens(int(tokens)), "mooncake_conversation",
                  systems(layout, args.eviction)[:3], "--mooncake") for tokens in args.mooncake]
    if not runs:
        args.usage_error("nothing to run: --budgets and --mooncake are both empty")
    for _, layout, budget, _, row_systems, flag in runs:
        for system in row_systems:  # a budget too small for the layout's pages
            try:
                make_kv_cache_config(system.specs, memory_bytes=budget)
            except ValueError as e:
                args.usage_error(f"argument {flag}: {budget / GiB:.3g} GiB is too small for "
                                 f"{layout.name} ({system.name}): {e}")
    rows: list[Row] = []
    for specs, layout, budget, workload, row_systems, flag in runs:
        # The built-in workloads' kvstore and oracle times are compared: replayed in turns.
        timed = [s for s in row_systems if s.name in ("kvstore", "oracle") and flag == "--budgets"]
        once = [s for s in row_systems if s not in timed]
        try:
            done = (run_systems(specs, timed, budget, layout.name, workload, args.repeats)
                    + run_systems(specs, once, budget, layout.name, workload))
        except RequestTooLargeError as e:
            args.usage_error(f"argument {flag}: {budget / GiB:.3g} GiB cannot hold a request of "
                             f"{workload} on {layout.name}: {e}")
        for r in done:
            rows.append(r)
            print(f"  {r.layout} {r.workload} {r.budget_bytes / GiB:.3g} GiB {_name(r)}: "
                  f"{r.hit_rate:.3f} ({r.manager_seconds:.1f} s)", file=sys.stderr, flush=True)
    checked = goals(rows, ideal)
    write_json(args.out / "recurrent.json", {
        "layouts": {n: {**asdict(LAYOUTS[n]), **{k: getattr(LAYOUTS[n], k) for k in (
            "state_bytes", "kv_bytes_per_token", "vllm_block_size")}} for n in args.layouts},
        "ideal": ideal, "rows": [r.as_dict() for r in rows], "goals": [asdict(g) for g in checked]})
    write_csv(args.out / "recurrent.csv", [r.as_dict() for r in rows])
    for layout_name, workload in dict.fromkeys((r.layout, r.workload) for r in rows):
        print("\n" + wrap(f"{layout_name}, {workload}: prompt hit rate at one byte budget; "
                          "checkpoints taken/used/evicted"))
        print(text_table(("GiB", "system", "block", "hit rate", "checkpoints", "frag MiB", "us/call"), (
            [f"{r.budget_bytes / GiB:.3g}", _name(r), r.block_size, f"{r.hit_rate:.3f}",
             f"{r.checkpoints_taken}/{r.checkpoints_used}/{r.checkpoints_evicted}",
             f"{r.fragmented_bytes_mean / (1 << 20):.1f}", f"{r.us_per_call:.1f}"]
            for r in rows if (r.layout, r.workload) == (layout_name, workload)), left=(1,)))
    print()
    for line in summary(checked):
        print(wrap(line))
    print(wrap(f"Every cell's figures: {args.out / 'recurrent.json'} (goals), {args.out / 'recurrent.csv'}"))
    return 0


def _name(r: Row) -> str:
    """The row's system, or ``+host NG`` for kvstore with an N GiB host tier."""
    return f"+host {r.host_tier_bytes / GiB:.3g}G" if r.host_tier_bytes else r.system
