"""Which sliding-window pages to offload, measured on the bench workload: the hybrid layout
replayed through the real scheduler and manager with a host tier below it (payload-free,
as ``kvstore bench --host-tier-bytes``), once per ``window_offload`` policy:

    python -m kvstore.benchmarks.tier_windows [--host-tier-bytes 4GiB] [--points 4]
                                              [--model-shape llama-3-8b] [--workload mixed_default]

* ``none``: only the pages a request holds at free (its last window) are offloaded;
* ``ends``: also the pages dropped mid-request that lie in the window before a likely hit
  end (the prompt's end, the lookup's hit end and branch point): the engine's default;
* ``all``: every dropped page.

Per pool size it prints first-admission hit rates (all tiers), the host tier's part of them
and the blocks offloaded, next to the device-only replay, as a Markdown table."""

from __future__ import annotations

import argparse
import sys

from kvstore.benchmarks.bench import load_bench_workload
from kvstore.benchmarks.simulator import TierOptions, simulate
from kvstore.benchmarks.sweep import MODEL_SHAPES, default_budgets, format_bytes, parse_pool_sizes, parse_size
from kvstore.errors import RequestTooLargeError
from kvstore.specs import make_kv_cache_config
from kvstore.tiers.connector import WINDOW_OFFLOADS


def main(argv: list[str] | None = None) -> int:
    """Run the comparison and print the table."""
    p = argparse.ArgumentParser(prog="python -m kvstore.benchmarks.tier_windows", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="mixed_default")
    p.add_argument("--model-shape", default="llama-3-8b", choices=sorted(MODEL_SHAPES))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--host-tier-bytes", default="4GiB")
    p.add_argument("--pool-sizes", default=None,
                   help="comma list of KV budgets (default: the bench's --points sizes)")
    p.add_argument("--points", type=int, default=4)
    args = p.parse_args(argv)
    shape = MODEL_SHAPES[args.model_shape]
    workload = load_bench_workload(args.workload)
    host = parse_size(args.host_tier_bytes)
    budgets = (parse_pool_sizes(args.pool_sizes, shape.block_bytes(args.block_size)) if args.pool_sizes
               else default_budgets(workload, shape, args.block_size, args.points))
    specs = shape.hybrid_specs(args.block_size)
    bpb = make_kv_cache_config(specs, num_blocks=2).bytes_per_block
    print(f"{workload.name}, {shape.name} hybrid layout, host tier {format_bytes(host)}: first-admission "
          "hit (host tier's part; blocks offloaded)")
    modes = sorted(WINDOW_OFFLOADS, key=("none", "ends", "all").index)
    print("| KV budget | device only | " + " | ".join(f"window_offload={m}" for m in modes) + " |")
    print("|---" + "|---:" * (1 + len(modes)) + "|")
    for budget in budgets:
        config = make_kv_cache_config(specs, num_blocks=budget // bpb)
        try:
            device = simulate(workload, config, enable_partial_hits=True)
        except RequestTooLargeError:
            print(f"| {format_bytes(budget)} | does not fit |" + " |" * len(modes))
            continue
        cells = [f"{100 * device.prompt_hit_rate:.1f}%"]
        for mode in modes:
            r = simulate(workload, config, enable_partial_hits=True,
                         tiers=TierOptions(host_bytes=host, window_offload=mode))
            host_part = r.prompt_host_hit_tokens / r.prompt_tokens
            cells.append(f"{100 * r.prompt_hit_rate:.1f}% ({100 * host_part:.1f}%; "
                         f"{r.tier_offloaded_blocks:,})")
        print(f"| {format_bytes(budget)} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
