"""``kvstore bench kernels``: the paged-attention kernel compiled on a GPU, checked against the
reference and timed against SDPA on the same K/V (grid, metrics and timing: docs/kernels.md).
Exit codes: 0 ok, 1 a check failed, 2 cannot run here (no CUDA device, or TRITON_INTERPRET set)."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvstore.benchmarks.output import check_folder, fmt, write_json
from kvstore.kernels import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 8, 128, 16
DTYPE = torch.bfloat16
SCALE = 1.0 / math.sqrt(HEAD_DIM)
FLUSH_BYTES = 256 << 20  # > L2 of any current GPU (H100/H200: 50 MiB)
# (batch, context, query length) of the decode and the prefill sweep, and timed iterations
QUICK_SWEEP = ([(b, c, 1) for b in (1, 32) for c in (4096, 65536)], [(1, 4096, 4096), (1, 32768, 2048)], 5)
FULL_SWEEP = ([(b, c, 1) for b in (1, 4, 16, 64, 256) for c in (1024, 4096, 16384, 65536, 131072)],
              [(1, 1024, 1024), (1, 4096, 4096), (1, 16384, 16384), (4, 4096, 4096), (1, 16384, 512),
               (1, 65536, 2048), (8, 32768, 512)], 20)


@dataclass
class Row:
    """One (configuration, implementation) of the sweep and its figures."""

    kind: str  # "decode" | "prefill"
    impl: str  # "triton" | "sdpa"
    batch: int
    context: int  # tokens in cache per sequence (including the new queries)
    q_len: int  # new query tokens per sequence
    window: int | None
    ms: float | None = None
    gbps: float | None = None  # decode: needed K/V bytes / time
    tflops: float | None = None  # prefill: 4 * visible pairs * head_dim * heads / time
    pct_copy: float | None = None  # decode: gbps / copy bandwidth
    pct_read: float | None = None  # decode: gbps / read bandwidth (its roof)
    num_splits: int | None = None
    timing: str = "graph"
    note: str = ""
    extra: dict = field(default_factory=dict)


def _event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _time_graph(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the allocator on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graphs = (torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph())  # flushes + calls, flushes
    for g, call in zip(graphs, (fn, None), strict=True):
        with torch.cuda.graph(g):
            for _ in range(iters):
                flush.zero_()
                if call is not None:
                    call()
    best = [math.inf, math.inf]
    for _ in range(3):
        for i, g in enumerate(graphs):
            best[i] = min(best[i], _event_ms(g.replay))
    return max(best[0] - best[1], 0.0) / iters


def time_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> tuple[float, str]:
    """Milliseconds per call of ``fn`` with a cold L2, and how it was timed."""
    fn()  # compile / autotune / lazy init outside the timed region
    torch.cuda.synchronize()
    try:
        return _time_graph(fn, iters, flush), "graph"
    except Exception:  # noqa: BLE001 - any capture failure: fall back to eager timing
        torch.cuda.synchronize()
    times = []
    for _ in range(iters):  # the median of single calls
        flush.zero_()
        times.append(_event_ms(fn))
    return sorted(times)[iters // 2], "eager"


def bandwidth_gbps(flush: torch.Tensor, copy: bool) -> float:
    """Device bandwidth in GB/s (1e9), 4 GiB moved: a 2 GiB copy (read + write bytes) with `copy`,
    else a max-reduction over 4 GiB (bytes read: decode's roof)."""
    if copy:
        src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms, _ = time_ms(lambda: dst.copy_(src), 5, flush)
        del src, dst
    else:
        src = torch.empty(1 << 30, dtype=torch.int32, device="cuda").random_(0, 1 << 20)
        ms, _ = time_ms(lambda: src.amax(), 5, flush)
        del src
    torch.cuda.empty_cache()
    return (4 << 30) / (ms * 1e-3) / 1e9


@dataclass
class Paged:
    """A paged batch: pool and attention metadata, laid out like the cache manager does."""

    q: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    metadata: AttentionMetadata
    first_kept: int  # first key position any query sees (pages before it: null block)


def _first_kept(context: int, q_len: int, window: int | None) -> int:
    return 0 if window is None else max(0, context - q_len - window + 1)


def build_paged(batch: int, context: int, q_len: int, window: int | None,
                gen: torch.Generator, device: str = "cuda") -> Paged:
    """Random K/V on pages scattered at random, dropped pages pointing at the null block."""
    first_kept = _first_kept(context, q_len, window)
    pages = math.ceil(context / BLOCK_SIZE)
    first_page = first_kept // BLOCK_SIZE
    kept = pages - first_page
    num_blocks = 1 + batch * kept
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(batch, pages, dtype=torch.int32)
    table[:, first_page:] = ids.view(batch, kept).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kc = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    vc = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return Paged(q, kc, vc, AttentionMetadata(table.to(device), cu, seq_lens, q_len), first_kept)


def visible_pairs(context: int, q_len: int, window: int | None) -> int:
    """Number of (query, key) pairs that are attended, per sequence and head."""
    return sum(q + 1 if window is None else min(q + 1, window) for q in range(context - q_len, context))


def needed_kv_bytes(batch: int, context: int, q_len: int, window: int | None) -> int:
    """Bytes of K and V the step reads: each visible key's once."""
    keys = context - _first_kept(context, q_len, window)
    return batch * keys * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize


def triton_fn(batch: int, context: int, q_len: int, window: int | None,
              gen: torch.Generator) -> Callable[..., object]:
    """The Triton kernel on a batch from `build_paged`."""
    from kvstore.kernels import paged_attention

    p = build_paged(batch, context, q_len, window, gen)
    return partial(paged_attention, p.q, p.kc, p.vc, p.metadata, SCALE, window=window)


def sdpa_fn(batch: int, context: int, q_len: int, window: int | None) -> Callable[[], object]:
    """SDPA on the visible K/V gathered contiguous, with a bottom-right causal/window mask."""
    first_kept = _first_kept(context, q_len, window)
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(batch, KV_HEADS, context - first_kept, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    if window is None and q_len == k.shape[2] and q_len > 1:  # whole prompt: built-in causal
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = None  # a decode query sees every gathered key
    if q_len > 1:
        qpos = torch.arange(context - q_len, context, device="cuda")[:, None]
        kpos = torch.arange(first_kept, context, device="cuda")[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - (window or context + 1))
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _plan(batch: int, context: int, q_len: int, window: int | None) -> Any:
    from kvstore.kernels.triton_attention import launch_plan

    return launch_plan(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, math.ceil(context / BLOCK_SIZE), batch,
                       q_len, window, torch.device("cuda"))


def run_bench(args: argparse.Namespace) -> dict:
    """The decode and prefill sweep; prints a line per row and returns the JSON record."""
    import triton

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copy_bw, read_bw = bandwidth_gbps(flush, copy=True), bandwidth_gbps(flush, copy=False)
    print(f"device copy bandwidth (read+write): {copy_bw:.0f} GB/s; read bandwidth: {read_bw:.0f} GB/s")
    rows: list[Row] = []
    decode_grid, prefill_grid, iters = QUICK_SWEEP if args.quick else FULL_SWEEP
    print(f"GQA {HEADS}:{KV_HEADS}, head_dim {HEAD_DIM}, {DTYPE}, block_size {BLOCK_SIZE}; "
          "decode: needed K/V bytes / time; prefill: 4*pairs*D*H / time")
    print(f"{'kind':7s} {'batch':6s} {'context':11s} {'q':8s} {'window':7s} {'impl':11s} "
          f"{'time':>12s}  metric")

    def measure(row: Row, make: Callable[[], Callable[[], object]]) -> None:
        """Time `make()`'s callable into `row`; a failure is noted in the row, not raised."""
        kind, b, ctx, ql, w = row.kind, row.batch, row.context, row.q_len, row.window
        try:
            row.ms, row.timing = time_ms(make(), iters if kind == "decode" else max(3, iters // 4), flush)
            if row.ms > 0:
                if kind == "decode":
                    row.gbps = needed_kv_bytes(b, ctx, ql, w) / (row.ms * 1e-3) / 1e9
                    row.pct_copy = 100.0 * row.gbps / copy_bw
                    row.pct_read = 100.0 * row.gbps / read_bw
                row.tflops = 4.0 * b * visible_pairs(ctx, ql, w) * HEAD_DIM * HEADS / (row.ms * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a baseline failing must not stop the sweep
            row.note = f"error: {type(e).__name__}: {str(e)[:120]}"
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
        metric = (f"{fmt(row.gbps, '8.0f')} GB/s {fmt(row.pct_read, '5.1f')}% read"
                  if kind == "decode" else f"{fmt(row.tflops, '7.1f')} TFLOP/s")
        split = f" splits={row.num_splits}" if row.num_splits else ""
        print(f"{kind:7s} B={b:<4d} ctx={ctx:<7d} q={ql:<6d} W={str(w):<5s} {row.impl:11s} "
              f"{fmt(row.ms, '9.4f')} ms  {metric}  [{row.timing}]{split} {row.note}")

    for kind, grid in (("decode", decode_grid), ("prefill", prefill_grid)):
        for w, (b, ctx, ql) in itertools.product((None, 4096), grid):
            nbytes = needed_kv_bytes(b, ctx, ql, w) + b * ql * HEADS * HEAD_DIM * 4  # and q, out
            if nbytes >= 0.4 * torch.cuda.mem_get_info()[0]:
                print(f"skip {kind} B={b} ctx={ctx} q={ql} W={w}: {nbytes / 1e9:.0f} GB")
                continue
            plan = _plan(b, ctx, ql, w)
            extra = {k: getattr(plan, k) for k in ("block_m", "block_n", "num_warps", "q_tiles")}
            measure(Row(kind, "triton", b, ctx, ql, w, num_splits=plan.num_splits, extra=extra),
                    partial(triton_fn, b, ctx, ql, w, gen))
            measure(Row(kind, "sdpa", b, ctx, ql, w), partial(sdpa_fn, b, ctx, ql, w))
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                       "block_size": BLOCK_SIZE, "dtype": str(DTYPE), "quick": args.quick},
            "copy_bandwidth_gbps": copy_bw, "read_bandwidth_gbps": read_bw,
            "rows": [asdict(r) for r in rows]}


# (name, (query lengths, sequence lengths), heads, kv heads, head dim, block size, window,
# softcap, splits, dtype, block_m, block_n): long contexts and gpt-oss shapes beside GRID.
BF16, F16 = torch.bfloat16, torch.float16
CHECK_CASES = [
    ("long-dec-w4096-auto", ([1, 1], [20000, 9000]), 64, 8, 128, 16, 4096, None, None, BF16, None, None),
    ("long-dec-full-split7", ([1, 1], [20000, 9000]), 64, 8, 128, 16, None, None, 7, BF16, None, None),
    ("long-prefill-w4096-cap", ([300, 1, 64], [9000, 5000, 64]), 32, 8, 128, 16, 4096, 30.0, None, BF16,
     None, None),
    ("long-prefill-full-f16", ([700, 5], [3000, 4100]), 32, 4, 128, 32, None, None, None, F16, None, None),
    ("r32-dec", ([1, 1, 1], [513, 4096, 77]), 64, 2, 128, 16, 1000, None, None, BF16, None, None),
    ("gptoss-dec-w128-split5", ([1, 1], [20000, 9000]), 64, 8, 64, 16, 128, None, 5, BF16, None, None),
    ("gptoss-prefill-full", ([700, 1], [3000, 4100]), 64, 8, 64, 16, None, None, None, BF16, None, None),
]
# Llama 4's chunked local layers (chunk 8192) across a chunk boundary; the seventh column is a chunk.
CHUNK_CHECK_CASES = [
    ("llama4-prefill-c8192", ([900, 1], [12000, 9000]), 40, 8, 128, 16, 8192, None, None, BF16, None, None),
    ("llama4-dec-c8192-split6", ([1, 1], [16390, 8192]), 40, 8, 128, 16, 8192, None, 6, BF16, None, None),
]
# MLA decode launch plans checked at DeepSeek-V3's latent: the default and the others swept.
MLA_CHECK_PLANS = [{}, {"num_splits": 5}, *(dict(block_h=bh, block_n=bn, num_warps=w)
                                             for bh, bn, w in ((16, 16, 4), (16, 64, 8), (32, 32, 8)))]


def run_check() -> bool:
    """Correctness grid compiled on this GPU against the reference (chunked cases, then every
    other case without and with sinks), write_kv and copy_blocks bitwise, and MLA decode
    against its reference; True when all pass."""
    from kvstore.kernels import copy_blocks, paged_attention, paged_attention_reference, write_kv
    from kvstore.kernels.mla import mla_attention_reference, mla_decode
    from kvstore.kernels.testing import (
        CHUNK_GRID,
        GRID,
        MLA_DECODE,
        MLA_GRID,
        make_case,
        make_mla_case,
        tolerance,
    )

    ok = True

    def report(passed: bool, what: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {what}")

    def report_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
        """PASS when `out` has no NaN and is within the compiled tolerance of `ref`."""
        atol, rtol = tolerance(dtype, "cuda")
        err = (out.float() - ref.float()).abs()
        report(bool((err <= atol + rtol * ref.float().abs()).all()) and not bool(torch.isnan(out).any()),
               f"{what}: max abs err {float(err.max()):.2e}")

    # (row, sinks, chunk): CHUNK_GRID's and CHUNK_CHECK_CASES' seventh column is a chunk, not a window
    cases: list[tuple[Any, bool, Any]] = [(row, False, row[6]) for row in (*CHUNK_GRID, *CHUNK_CHECK_CASES)]
    cases += [(row, sinks, None) for row in (*GRID, *CHECK_CASES) for sinks in (False, True)]
    for (name, (q_lens, seq_lens), h, hkv, d, bs, w, cap, splits, dtype, bm, bn), sinks, chunk in cases:
        case = make_case(q_lens, seq_lens, h, hkv, d, bs, None if chunk else w, cap, dtype, seed=1,
                         device="cuda", q_scale=3.0 if cap else 1.0, with_sinks=sinks, chunk=chunk)
        ref = paged_attention_reference(*case.args(), **case.kwargs())
        out = paged_attention(*case.args(), **case.kwargs(), num_splits=splits, block_m=bm, block_n=bn)
        torch.cuda.synchronize()
        report_close(out, ref, dtype, f"{name}{'+sinks' if sinks else ''}")

    # write path and block copy, bitwise: Triton (auto on CUDA) against the torch path
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kc, vc = (torch.randn(64, 16, 8, 128, generator=g).to(dtype).cuda() for _ in range(2))
        key, val = (torch.randn(100, 8, 128, generator=g).to(dtype).cuda() for _ in range(2))
        slots = torch.randperm(64 * 16, generator=g)[:100].cuda()
        slots[::7] = -1  # padding
        ek, ev = kc.clone(), vc.clone()
        write_kv(key, val, ek, ev, slots, backend="torch")
        write_kv(key, val, kc, vc, slots)
        torch.cuda.synchronize()
        w_ok = torch.equal(kc, ek) and torch.equal(vc, ev)
        srcs, dsts = [1, 2, 3], [40, 41, 63]
        ek[dsts], ev[dsts] = ek[srcs], ev[srcs]
        copy_blocks([(kc, vc)], list(zip(srcs, dsts, strict=True)))
        torch.cuda.synchronize()
        report(w_ok, f"write_kv {dtype}")
        report(torch.equal(kc, ek) and torch.equal(vc, ev), f"copy_blocks {dtype}")

    # MLA decode: the interpreter's grid, then DeepSeek-V3's latent at each launch plan
    mla_cases = [(MLA_DECODE, h, r, rope, bs, dt, {"block_n": bn}) for h, r, rope, bs, dt, bn in MLA_GRID]
    mla_cases += [(([1, 1, 1, 1], [1, 700, 5000, 33]), h, 512, 64, bs, BF16, plan)
                  for h, bs in ((16, 16), (128, 16), (128, 64)) for plan in MLA_CHECK_PLANS]
    for lens, h, r, rope, bs, dtype, plan in mla_cases:
        q_lat, q_rope, kc, vc, md = make_mla_case(*lens, h, r, rope, bs, dtype, seed=h + r, device="cuda")
        ref = mla_attention_reference(q_lat, q_rope, kc, vc, md, (r + rope) ** -0.5)
        try:
            out = mla_decode(q_lat, q_rope, kc, vc, md, (r + rope) ** -0.5, **plan)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a plan that cannot launch fails the check, the rest run
            report(False, f"mla h={h} rank={r} rope={rope} bs={bs} {dtype} {plan}: {type(e).__name__}: {e}")
            continue
        report_close(out, ref, dtype, f"mla h={h} rank={r} rope={rope} bs={bs} {dtype} {plan}")
    return ok


SPLIT_CASES = ((1, 4096, None), (1, 16384, None), (1, 131072, None), (4, 4096, None), (4, 65536, None),
               (16, 16384, None), (1, 131072, 4096), (4, 131072, 4096), (16, 131072, 4096))


def run_split_sweep(iters: int = 20) -> dict:
    """Decode time per split-KV factor beside the heuristic's choice, for batches that underfill the GPU."""
    from kvstore.kernels.triton_attention import MAX_SPLITS

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {}
    print("decode ms per num_splits (* = the heuristic's choice)")
    for b, ctx, w in SPLIT_CASES:
        fn = triton_fn(b, ctx, 1, w, gen)
        auto = _plan(b, ctx, 1, w).num_splits
        times = {n: time_ms(partial(fn, num_splits=n), iters, flush)[0]
                 for n in sorted({1, 2, 4, 8, 16, 32, MAX_SPLITS, auto})}
        best = min(times, key=times.__getitem__)
        print(f"B={b:<3d} ctx={ctx:<7d} W={str(w):<5s} "
              + " ".join(f"{n}{'*' if n == auto else ''}:{t:.4f}" for n, t in times.items())
              + f"  best {best} ({times[auto] / times[best]:.2f}x of auto)")
        out[f"{b}/{ctx}/{w}"] = {"auto": auto, "best": best, "ms": times}
        del fn
        torch.cuda.empty_cache()
    return out


MLA_HEADS, MLA_RANK, MLA_ROPE = 128, 512, 64  # DeepSeek-V3's attention
MLA_CASES = [(b, c) for b in (1, 16, 64, 128) for c in (4096, 32768)]
# (block_h, block_n, num_warps)
MLA_PLANS = [(bh, bn, w) for bh in (16, 32, 64) for bn in (16, 32, 64) for w in (4, 8)]


def run_mla_sweep(iters: int = 10) -> dict:
    """MLA decode at DeepSeek-V3's shapes (bf16, block size 16) at every launch plan in
    MLA_PLANS beside the default plan: needed latent bytes (each token's once) / time, and
    for the best plan that as a share of the read bandwidth and as TFLOP/s."""
    from kvstore.kernels.mla import mla_decode

    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    read_bw = bandwidth_gbps(flush, copy=False)
    half = (MLA_RANK + MLA_ROPE) // 2
    # each latent's scores (r + rope) and output (r) for every head, per byte of latent read
    flop_per_byte = 2 * MLA_HEADS * (2 * MLA_RANK + MLA_ROPE) / (2 * half * DTYPE.itemsize)
    out: dict[str, Any] = {"read_bandwidth_gbps": read_bw, "flop_per_byte": flop_per_byte, "cases": {}}
    print(f"MLA decode, {MLA_HEADS} heads, latent {MLA_RANK}+{MLA_ROPE}, bf16, read {read_bw:.0f} GB/s:")
    print("GB/s of needed latent bytes, default plan, best plan, then each block_h/block_n/warps")
    for b, ctx in MLA_CASES:
        pages = math.ceil(ctx / BLOCK_SIZE)
        table = (torch.randperm(b * pages, device="cuda") + 1).to(torch.int32).view(b, pages)
        kc, vc = (torch.empty(1 + b * pages, BLOCK_SIZE, 1, half, dtype=DTYPE, device="cuda").normal_()
                  for _ in range(2))
        md = AttentionMetadata(table, torch.arange(b + 1, dtype=torch.int32, device="cuda"),
                               torch.full((b,), ctx, dtype=torch.int32, device="cuda"), 1)
        q_lat = torch.randn(b, MLA_HEADS, MLA_RANK, dtype=DTYPE, device="cuda")
        q_rope = torch.randn(b, MLA_HEADS, MLA_ROPE, dtype=DTYPE, device="cuda")
        nbytes = b * ctx * 2 * half * DTYPE.itemsize
        times: dict[str, float | str] = {}
        for plan in [None, *MLA_PLANS]:
            kw = {} if plan is None else dict(zip(("block_h", "block_n", "num_warps"), plan, strict=True))
            try:
                times["default" if plan is None else "/".join(map(str, plan))] = time_ms(
                    partial(mla_decode, q_lat, q_rope, kc, vc, md, (MLA_RANK + MLA_ROPE) ** -0.5, **kw),
                    iters, flush)[0]
            except Exception as e:  # noqa: BLE001 - a plan that cannot launch is noted, not fatal
                times["/".join(map(str, plan or ()))] = f"{type(e).__name__}: {str(e)[:80]}"
        gbps = {k: nbytes / v / 1e6 for k, v in times.items() if isinstance(v, float) and v > 0}
        best = max(gbps, key=gbps.__getitem__, default=None)
        pct = fmt(gbps[best] / read_bw * 100 if best else None, ".0f")
        tflops = fmt(gbps[best] * flop_per_byte / 1e3 if best else None, ".0f")
        print(f"B={b:<4d} ctx={ctx:<6d} default {fmt(gbps.get('default'), '6.0f')} GB/s; best {best} "
              f"{fmt(gbps[best] if best else None, '6.0f')} GB/s ({pct}% read, {tflops} TFLOP/s); "
              + " ".join(f"{k}:{fmt(gbps[k], '.0f') if k in gbps else v}"
                         for k, v in times.items() if k != "default"))
        out["cases"][f"{b}/{ctx}"] = {"bytes": nbytes, "ms": times, "best": best}
        del kc, vc, table
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.kernel_bench``: ``kvstore bench kernels``."""
    from kvstore.cli import main as cli_main

    return cli_main(["bench", "kernels", *(sys.argv[1:] if argv is None else argv)])


def run_command(args: argparse.Namespace) -> int:
    """Run the check and/or the benchmark the options ask for; return the exit status."""
    if args.skip_bench and not args.check:
        args.usage_error("argument --skip-bench: only with --check (it skips the timing after the check)")
    if args.split_sweep and args.mla_sweep:
        args.usage_error("argument --mla-sweep: not with --split-sweep (each is a run of its own)")
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device found; this benchmark needs an NVIDIA GPU "
              "(the CPU tests cover correctness under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_bench: TRITON_INTERPRET=1 is set; unset it to run compiled kernels", file=sys.stderr)
        return 2
    if not args.skip_bench:
        check_folder(args.json.parent, args.usage_error, "--json")
    print(f"device: {torch.cuda.get_device_name(0)}")
    if args.split_sweep or args.mla_sweep:
        key, sweep = ("splits", run_split_sweep) if args.split_sweep else ("mla", run_mla_sweep)
        write_json(args.json, {"device": torch.cuda.get_device_name(0), key: sweep()})
        return 0
    if args.check:
        t0 = time.perf_counter()
        ok = run_check()
        print(f"check: {'all passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
        if not ok or args.skip_bench:
            return 0 if ok else 1
    write_json(args.json, run_bench(args))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
