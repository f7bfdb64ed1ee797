"""GPU benchmark and correctness check for the paged-attention kernel.

    kvstore bench kernels [--quick] [--check] [--skip-bench] [--json PATH]

* decode: achieved bandwidth = bytes of K/V the step *needs* (every visible key, K and V,
  once) / time, over batch x context x window (none / 4096), GQA 8:1, head dim 128, bf16;
* prefill: TFLOP/s over visible (query, key) pairs (4 * pairs * head_dim * heads), for
  whole prompts and for chunks over a cached prefix;
* baselines on the same K/V gathered contiguous: PyTorch ``scaled_dot_product_attention``,
  FlashAttention (``flash_attn``) if importable; FlashInfer's paged decode on the very same
  pool if importable;
* device copy bandwidth (a large tensor copy, read + write bytes / time) so decode figures
  read as a percentage of what the memory system delivers.

Times are CUDA-event times of a CUDA graph holding ``iters`` x (L2 flush + call), minus the
same graph with the flushes alone; a callable that cannot be captured is timed eagerly
(marked ``eager``). ``--check`` first runs the kernel correctness grid compiled on this GPU
against the reference (NaN-poisoned pages, as in the CPU tests), then the benchmark unless
``--skip-bench``. Exit codes: 0 ok, 1 a check failed, 2 cannot run here (no CUDA device, or
TRITON_INTERPRET set).
"""

from __future__ import annotations

import argparse
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

from kvstore.benchmarks.output import write_json
from kvstore.kernels import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 64, 8, 128, 16
DTYPE = torch.bfloat16
FLUSH_BYTES = 256 << 20  # > L2 of any current GPU (H100/H200: 50 MiB)


@dataclass
class Row:
    kind: str  # "decode" | "prefill"
    impl: str  # "triton" | "sdpa" | "flash_attn" | "flashinfer"
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


# --------------------------------------------------------------------------- timing


def _time_graph(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    g_all, g_flush = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the allocator on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(g_all):
        for _ in range(iters):
            flush.zero_()
            fn()
    with torch.cuda.graph(g_flush):
        for _ in range(iters):
            flush.zero_()
    best_all = best_flush = math.inf
    for _ in range(3):
        for g in (g_all, g_flush):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end)
            if g is g_all:
                best_all = min(best_all, t)
            else:
                best_flush = min(best_flush, t)
    return max(best_all - best_flush, 0.0) / iters


def _time_eager(fn: Callable[[], object], iters: int, flush: torch.Tensor) -> float:
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def time_ms(fn: Callable[[], object], iters: int, flush: torch.Tensor,
            graph: bool = True) -> tuple[float, str]:
    """Milliseconds per call of ``fn`` with a cold L2, and how it was timed."""
    fn()  # compile / autotune / lazy init outside the timed region
    torch.cuda.synchronize()
    if not graph:
        return _time_eager(fn, iters, flush), "eager"
    try:
        return _time_graph(fn, iters, flush), "graph"
    except Exception:  # noqa: BLE001 - any capture failure: fall back to eager timing
        torch.cuda.synchronize()
        return _time_eager(fn, iters, flush), "eager"


def read_bandwidth_gbps(flush: torch.Tensor, nbytes: int = 4 << 30) -> float:
    """Device read bandwidth: a max-reduction over a large tensor, bytes read / time (GB/s).
    Decode only reads K/V, so this, not a copy, is its roof."""
    bufs = {"src": torch.empty(nbytes // 4, dtype=torch.int32, device="cuda").random_(0, 1 << 20)}
    ms, _ = time_ms(lambda: bufs["src"].amax(), 5, flush)
    bufs.clear()
    torch.cuda.empty_cache()
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth_gbps(flush: torch.Tensor, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, counting read + write bytes (GB/s, 1e9)."""
    bufs = {"src": torch.empty(nbytes, dtype=torch.uint8, device="cuda")}
    bufs["dst"] = torch.empty_like(bufs["src"])
    ms, _ = time_ms(lambda: bufs["dst"].copy_(bufs["src"]), 5, flush)
    bufs.clear()
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- workloads


@dataclass
class Paged:
    """A paged batch: pool and attention metadata, laid out like the cache manager does."""

    q: torch.Tensor
    kc: torch.Tensor
    vc: torch.Tensor
    metadata: AttentionMetadata
    q_len: int
    first_kept: int  # first key position any query sees (pages before it: null block)


def build_paged(batch: int, context: int, q_len: int, window: int | None,
                gen: torch.Generator, device: str = "cuda") -> Paged:
    first_q = context - q_len
    first_kept = 0 if window is None else max(0, first_q - window + 1)
    pages = math.ceil(context / BLOCK_SIZE)
    first_page = first_kept // BLOCK_SIZE
    kept = pages - first_page
    num_blocks = 1 + batch * kept
    ids = torch.randperm(num_blocks - 1, generator=gen) + 1  # realistic scattered pages
    table = torch.zeros(batch, pages, dtype=torch.int32)  # dropped pages: null block 0
    table[:, first_page:] = ids.view(batch, kept).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kc = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    vc = torch.empty(shape, dtype=DTYPE, device=device).normal_()
    q = torch.randn(batch * q_len, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return Paged(q, kc, vc, AttentionMetadata(table.to(device), cu, seq_lens, q_len), q_len,
                 first_kept)


def visible_pairs(context: int, q_len: int, window: int | None) -> int:
    """Number of (query, key) pairs that are attended, per sequence and head."""
    total = 0
    for qpos in range(context - q_len, context):
        total += qpos + 1 if window is None else min(qpos + 1, window)
    return total


def needed_kv_bytes(batch: int, context: int, q_len: int, window: int | None) -> int:
    first_kept = 0 if window is None else max(0, context - q_len - window + 1)
    keys = context - first_kept
    return batch * keys * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize  # K and V


def _dense_inputs(batch: int, context: int, q_len: int, window: int | None):
    """Contiguous q [B, H, q, D] and the visible K/V [B, Hkv, n, D] (values irrelevant)."""
    first_kept = 0 if window is None else max(0, context - q_len - window + 1)
    n = context - first_kept
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=DTYPE, device="cuda")
    k = torch.randn(batch, KV_HEADS, n, HEAD_DIM, dtype=DTYPE, device="cuda")
    v = torch.randn_like(k)
    return q, k, v, first_kept


def _window_mask(context: int, q_len: int, first_kept: int, window: int | None) -> torch.Tensor:
    qpos = torch.arange(context - q_len, context, device="cuda")
    kpos = torch.arange(first_kept, context, device="cuda")
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    return mask


def sdpa_fn(batch: int, context: int, q_len: int, window: int | None) -> Callable[[], object]:
    q, k, v, first_kept = _dense_inputs(batch, context, q_len, window)
    n = k.shape[2]
    causal = window is None and q_len == n and q_len > 1  # whole prompt: built-in causal
    mask = None  # a decode query sees every gathered key
    if q_len > 1 and not causal:
        mask = _window_mask(context, q_len, first_kept, window)  # bottom-right aligned
    try:
        F.scaled_dot_product_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], enable_gqa=True)
        kw: dict[str, Any] = {"enable_gqa": True}
    except TypeError:  # torch < 2.5: expand the KV heads instead
        k = k.repeat_interleave(HEADS // KV_HEADS, 1)
        v = v.repeat_interleave(HEADS // KV_HEADS, 1)
        kw = {}
    if causal:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)


def flash_attn_fn(batch: int, context: int, q_len: int,
                  window: int | None) -> Callable[[], object] | None:
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    q, k, v, _ = _dense_inputs(batch, context, q_len, window)
    q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, n, H, D]
    win = (-1, -1) if window is None else (window - 1, 0)
    # flash-attn aligns the causal mask bottom-right (queries are the last q_len keys)
    return lambda: flash_attn_func(q, k, v, causal=True, window_size=win)


def flashinfer_decode_fn(p: Paged, window: int | None) -> Callable[[], object] | None:
    try:
        import flashinfer
    except ImportError:
        return None
    batch, pages = p.metadata.block_table.shape
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * pages
    indices = p.metadata.block_table.reshape(-1).contiguous()
    context = int(p.metadata.seq_lens[0])
    last = torch.full((batch,), context - (pages - 1) * BLOCK_SIZE, dtype=torch.int32,
                      device="cuda")
    wrapper.plan(indptr, indices, last, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                 window_left=-1 if window is None else window - 1,
                 q_data_type=DTYPE, kv_data_type=DTYPE)
    q = p.q.view(batch, HEADS, HEAD_DIM)
    return lambda: wrapper.run(q, (p.kc, p.vc))


# --------------------------------------------------------------------------- benchmark


def _fits(nbytes: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return nbytes < 0.4 * free


def _measure(rows: list[Row], row: Row, make: Callable[[], Callable[[], object] | None],
             iters: int, flush: torch.Tensor, nbytes: int, flops: float,
             copy_bw: float, read_bw: float, graph: bool = True) -> None:
    try:
        fn = make()
        if fn is None:
            return  # library not installed
        row.ms, row.timing = time_ms(fn, iters, flush, graph)
        if row.ms > 0:
            if row.kind == "decode":
                row.gbps = nbytes / (row.ms * 1e-3) / 1e9
                row.pct_copy = 100.0 * row.gbps / copy_bw
                row.pct_read = 100.0 * row.gbps / read_bw
            row.tflops = flops / (row.ms * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - a baseline failing must not stop the sweep
        row.note = f"error: {type(e).__name__}: {str(e)[:120]}"
    finally:
        torch.cuda.empty_cache()
    rows.append(row)


def run_bench(args: argparse.Namespace) -> dict:
    from kvstore.kernels import paged_attention
    from kvstore.kernels.triton_attention import launch_plan

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copy_bw = copy_bandwidth_gbps(flush)
    read_bw = read_bandwidth_gbps(flush)
    print(f"device copy bandwidth (read+write): {copy_bw:.0f} GB/s; read bandwidth: {read_bw:.0f} GB/s")
    rows: list[Row] = []
    scale = 1.0 / math.sqrt(HEAD_DIM)
    if args.quick:
        decode_grid = [(b, c) for b in (1, 32) for c in (4096, 65536)]
        prefill_grid = [(1, 4096, 4096), (1, 32768, 2048)]
        iters = 5
    else:
        decode_grid = [(b, c) for b in (1, 4, 16, 64, 256)
                       for c in (1024, 4096, 16384, 65536, 131072)]
        prefill_grid = [(1, 1024, 1024), (1, 4096, 4096), (1, 16384, 16384), (4, 4096, 4096),
                        (1, 16384, 512), (1, 65536, 2048), (8, 32768, 512)]
        iters = 20
    windows = (None, 4096)
    print(f"GQA {HEADS}:{KV_HEADS}, head_dim {HEAD_DIM}, {DTYPE}, block_size {BLOCK_SIZE}; "
          "decode: needed K/V bytes / time; prefill: 4*pairs*D*H / time")
    print(f"{'kind':7s} {'batch':6s} {'context':11s} {'q':8s} {'window':7s} {'impl':11s} "
          f"{'time':>12s}  metric")

    def triton_case(kind: str, b: int, ctx: int, ql: int, w: int | None):
        n_iter = iters if kind == "decode" else max(3, iters // 4)
        nbytes = needed_kv_bytes(b, ctx, ql, w)
        flops = 4.0 * b * visible_pairs(ctx, ql, w) * HEAD_DIM * HEADS
        row = Row(kind, "triton", b, ctx, ql, w)
        plan = launch_plan(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, math.ceil(ctx / BLOCK_SIZE),
                           b, ql, w, torch.device("cuda"))
        row.num_splits = plan.num_splits
        row.extra = {"block_m": plan.block_m, "block_n": plan.block_n,
                     "num_warps": plan.num_warps, "q_tiles": plan.q_tiles}
        state: dict = {}

        def make():
            p = build_paged(b, ctx, ql, w, gen)
            state["p"] = p
            return lambda: paged_attention(p.q, p.kc, p.vc, p.metadata, scale, window=w)

        _measure(rows, row, make, n_iter, flush, nbytes, flops, copy_bw, read_bw)
        if kind == "decode" and "p" in state:
            _measure(rows, Row(kind, "flashinfer", b, ctx, ql, w),
                     lambda: flashinfer_decode_fn(state["p"], w), n_iter, flush, nbytes, flops,
                     copy_bw, read_bw, graph=False)  # its plain wrapper is not made for capture
        state.clear()
        torch.cuda.empty_cache()
        for impl, mk in (("sdpa", sdpa_fn), ("flash_attn", flash_attn_fn)):
            factory: Callable[[], Callable[[], object] | None] = partial(mk, b, ctx, ql, w)
            _measure(rows, Row(kind, impl, b, ctx, ql, w), factory, n_iter, flush, nbytes, flops,
                     copy_bw, read_bw)
        _print_group(rows, kind, b, ctx, ql, w)

    for w in windows:
        for b, ctx in decode_grid:
            nbytes = needed_kv_bytes(b, ctx, 1, w)
            if not _fits(nbytes):
                print(f"skip decode B={b} ctx={ctx} W={w}: {nbytes / 1e9:.0f} GB of K/V")
                continue
            triton_case("decode", b, ctx, 1, w)
    for w in windows:
        for b, ctx, ql in prefill_grid:
            if not _fits(needed_kv_bytes(b, ctx, ql, w) + b * ql * HEADS * HEAD_DIM * 4):
                print(f"skip prefill B={b} ctx={ctx} q={ql} W={w}: memory")
                continue
            triton_case("prefill", b, ctx, ql, w)
    props = torch.cuda.get_device_properties(0)
    import triton

    return {"device": props.name, "sm_count": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(),
            "config": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                       "block_size": BLOCK_SIZE, "dtype": str(DTYPE), "quick": args.quick},
            "copy_bandwidth_gbps": copy_bw, "read_bandwidth_gbps": read_bw,
            "rows": [asdict(r) for r in rows]}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_group(rows: list[Row], kind: str, b: int, ctx: int, ql: int,
                 w: int | None) -> None:
    for r in rows:
        if (r.kind, r.batch, r.context, r.q_len, r.window) != (kind, b, ctx, ql, w):
            continue
        metric = (f"{_fmt(r.gbps, '8.0f')} GB/s {_fmt(r.pct_read, '5.1f')}% read"
                  if kind == "decode" else f"{_fmt(r.tflops, '7.1f')} TFLOP/s")
        split = f" splits={r.num_splits}" if r.num_splits else ""
        print(f"{kind:7s} B={b:<4d} ctx={ctx:<7d} q={ql:<6d} W={str(w):<5s} {r.impl:11s} "
              f"{_fmt(r.ms, '9.4f')} ms  {metric}  [{r.timing}]{split} {r.note}")


# --------------------------------------------------------------------------- check


def run_check() -> bool:
    """Correctness grid compiled on this GPU against the reference; True when all pass."""
    from kvstore.kernels import copy_blocks, paged_attention, paged_attention_reference, write_kv
    from kvstore.kernels.testing import GRID, make_case, tolerance

    extra = [
        # long-context decode, split heuristic and forced splits, the benchmark's shapes
        ("long-dec-w4096-auto", ([1, 1], [20000, 9000]), 64, 8, 128, 16, 4096, None, None,
         torch.bfloat16, None, None),
        ("long-dec-full-split7", ([1, 1], [20000, 9000]), 64, 8, 128, 16, None, None, 7,
         torch.bfloat16, None, None),
        ("long-prefill-w4096-cap", ([300, 1, 64], [9000, 5000, 64]), 32, 8, 128, 16, 4096,
         30.0, None, torch.bfloat16, None, None),
        ("long-prefill-full-f16", ([700, 5], [3000, 4100]), 32, 4, 128, 32, None, None, None,
         torch.float16, None, None),
        ("r32-dec", ([1, 1, 1], [513, 4096, 77]), 64, 2, 128, 16, 1000, None, None,
         torch.bfloat16, None, None),
        # gpt-oss shapes: head_dim 64, GQA 8:1, window 128 (checked with sinks below)
        ("gptoss-dec-w128-split5", ([1, 1], [20000, 9000]), 64, 8, 64, 16, 128, None, 5,
         torch.bfloat16, None, None),
        ("gptoss-prefill-full", ([700, 1], [3000, 4100]), 64, 8, 64, 16, None, None, None,
         torch.bfloat16, None, None),
    ]
    ok = True
    # every case without and with attention sinks (per-head logits, gpt-oss)
    cases = [(c, s) for c in [*GRID, *extra] for s in (False, True)]
    for (name, lens, h, hkv, d, bs, w, cap, splits, dtype, bm, bn), sinks in cases:
        case = make_case(*lens, h, hkv, d, bs, w, cap, dtype, seed=1, device="cuda",
                         q_scale=3.0 if cap else 1.0, with_sinks=sinks)
        name += "+sinks" if sinks else ""
        ref = paged_attention_reference(*case.args(), **case.kwargs())
        out = paged_attention(*case.args(), **case.kwargs(), num_splits=splits, block_m=bm,
                              block_n=bn)
        torch.cuda.synchronize()
        atol, rtol = tolerance(dtype, "cuda")
        err = (out.float() - ref.float()).abs()
        bad = ~(err <= atol + rtol * ref.float().abs())
        passed = not bool(bad.any()) and not bool(torch.isnan(out).any())
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'} {name}: max abs err {float(err.max()):.2e}")

    # write path and block copy, bitwise: Triton (auto on CUDA) against the torch path
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        kc = torch.randn(64, 16, 8, 128, generator=g).to(dtype).cuda()
        vc = torch.randn(64, 16, 8, 128, generator=g).to(dtype).cuda()
        key = torch.randn(100, 8, 128, generator=g).to(dtype).cuda()
        val = torch.randn(100, 8, 128, generator=g).to(dtype).cuda()
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
        c_ok = torch.equal(kc, ek) and torch.equal(vc, ev)
        ok &= w_ok and c_ok
        print(f"{'PASS' if w_ok else 'FAIL'} write_kv {dtype}")
        print(f"{'PASS' if c_ok else 'FAIL'} copy_blocks {dtype}")
    return ok


# --------------------------------------------------------------------------- split sweep

SPLIT_CASES = ((1, 4096, None), (1, 16384, None), (1, 131072, None), (4, 4096, None),
               (4, 65536, None), (16, 16384, None), (1, 131072, 4096), (4, 131072, 4096),
               (16, 131072, 4096))


def run_split_sweep(iters: int = 20) -> dict:
    """Decode time per split-KV factor, next to the heuristic's choice, for small batches
    (where the grid alone does not fill the GPU)."""
    from kvstore.kernels import paged_attention
    from kvstore.kernels.triton_attention import MAX_SPLITS, launch_plan

    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    scale = 1.0 / math.sqrt(HEAD_DIM)
    out: dict[str, Any] = {}
    print("decode ms per num_splits (* = the heuristic's choice)")
    for b, ctx, w in SPLIT_CASES:
        p = build_paged(b, ctx, 1, w, gen)
        auto = launch_plan(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, math.ceil(ctx / BLOCK_SIZE), b,
                           1, w, torch.device("cuda")).num_splits
        times = {}
        for n in sorted({1, 2, 4, 8, 16, 32, MAX_SPLITS, auto}):
            fn = partial(paged_attention, p.q, p.kc, p.vc, p.metadata, scale, window=w,
                         num_splits=n)
            times[n], _ = time_ms(fn, iters, flush)
        best = min(times, key=times.__getitem__)
        print(f"B={b:<3d} ctx={ctx:<7d} W={str(w):<5s} " + " ".join(
            f"{n}{'*' if n == auto else ''}:{t:.4f}" for n, t in times.items())
              + f"  best {best} ({times[auto] / times[best]:.2f}x of auto)")
        out[f"{b}/{ctx}/{w}"] = {"auto": auto, "best": best, "ms": times}
        del p, fn
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.kernel_bench``: the options of ``kvstore bench kernels``."""
    from kvstore.benchmarks.bench import add_kernel_arguments

    ap = argparse.ArgumentParser(prog="kvstore bench kernels")
    add_kernel_arguments(ap)
    return run_command(ap.parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """Run the check and/or the benchmark the options ask for; return the exit status."""
    if not torch.cuda.is_available():
        print("kernel_bench: no CUDA device found; this benchmark needs an NVIDIA GPU "
              "(the CPU tests cover correctness under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("kernel_bench: TRITON_INTERPRET=1 is set; unset it to run compiled kernels",
              file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}")
    if args.split_sweep:
        results = {"device": torch.cuda.get_device_name(0), "splits": run_split_sweep()}
        write_json(args.json, results)
        return 0
    if args.check:
        t0 = time.perf_counter()
        ok = run_check()
        print(f"check: {'all passed' if ok else 'FAILED'} ({time.perf_counter() - t0:.0f} s)")
        if not ok:
            return 1
        if args.skip_bench:
            return 0
    results = run_bench(args)
    write_json(args.json, results)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
