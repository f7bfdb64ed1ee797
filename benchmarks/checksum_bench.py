"""XXH3-128 throughput of the tier checksum, by thread count, on pinned and pageable memory.

    python -m kvstore.benchmarks.checksum_bench [--blocks 256] [--block-bytes 524288]

Every host-tier value is sealed and verified with XXH3-128 over all its bytes, on the CPU;
this says how fast that can go on a machine (``codec.map_values`` spreads a large batch over
``codec.checksum_threads()`` threads), to set against its host-to-device link.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash


def rate_gbps(views: list[memoryview], threads: int, reps: int = 5) -> float:
    """Best GB/s over ``reps`` passes of XXH3-128 over every view on ``threads`` threads."""
    nbytes = sum(v.nbytes for v in views)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda v: xxhash.xxh3_128(v).digest(), views))
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            list(pool.map(lambda v: xxhash.xxh3_128(v).digest(), views))
            best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    """Print GB/s per thread count for pinned (with CUDA) and pageable buffers."""
    ap = argparse.ArgumentParser(prog="python -m kvstore.benchmarks.checksum_bench",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=512 << 10)
    args = ap.parse_args(argv)
    n, size = args.blocks, args.block_bytes
    print(f"xxhash {xxhash.VERSION}; {os.cpu_count()} CPUs; {n} values of {size} bytes")
    kinds = {"pageable": False}
    if torch.cuda.is_available():
        kinds = {"pinned": True, **kinds}
    for kind, pin in kinds.items():
        buf = torch.empty(n * size, dtype=torch.uint8, pin_memory=pin).random_(0, 256)
        arr = buf.numpy()
        flat = memoryview(arr.data)  # one view, sliced per value
        views = [flat[i * size:(i + 1) * size] for i in range(n)]
        for threads in (1, 2, 4, 8, 16):
            print(f"{kind:8s} threads={threads:<2d} {rate_gbps(views, threads):6.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
