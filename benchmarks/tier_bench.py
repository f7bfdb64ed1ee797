"""``kvstore bench tiers``: each transfer path of the tiers side by side with a plain copy of
the same bytes (gather/scatter, the host tier's paths, store values checksummed or sealed,
XXH3 alone by thread count, Valkey put/get against raw pipelined SET/GET), alternated
``--reps`` times; medians in GB/s of payload bytes and the ratio path / plain
(docs/tiers.md, "Transfer figures")."""

from __future__ import annotations

import argparse
import statistics
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import xxhash

from kvstore.benchmarks.output import write_json
from kvstore.hashing import hash_block, root_hash
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.specs import FullAttentionSpec, make_kv_cache_config
from kvstore.tiers import (
    BlockLayout,
    HostTier,
    block_payload_nbytes,
    decode_block,
    encode_block,
    gather_blocks,
    host_buffer,
    load_verified,
    offload_items,
    request_keys,
    restore_payloads,
    scatter_blocks,
)

CHECKSUM_THREADS = (1, 2, 4, 8, 16)


def side_by_side(name: str, path: Callable[[], object], base: Callable[[], object], nbytes: int,
                 device: torch.device, reps: int) -> dict[str, float]:
    """Median GB/s of ``path`` and ``base`` run alternately, and their ratio (``name`` is
    shown on stderr while it runs)."""
    print(f"  {name} ...", file=sys.stderr, flush=True)

    def seconds(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    path()
    base()
    tp, tb = [], []
    for _ in range(reps):
        tp.append(seconds(path))
        tb.append(seconds(base))
    gp, gb = nbytes / statistics.median(tp) / 1e9, nbytes / statistics.median(tb) / 1e9
    return {"path_GBps": round(gp, 3), "plain_GBps": round(gb, 3), "ratio": round(gp / gb, 3)}


def xxh3_all(pool: ThreadPoolExecutor, views: list[memoryview]) -> list[bytes]:
    """XXH3-128 digests of every view, spread over `pool` (the tier checksum's rate)."""
    return list(pool.map(lambda v: xxhash.xxh3_128(v).digest(), views))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All measurements: the configuration under ``config``, then one row per path."""
    device = torch.device(args.device)
    spec = FullAttentionSpec(args.block_size, args.kv_heads, args.head_dim, args.dtype)
    config = make_kv_cache_config([spec] * args.layers, num_blocks=args.pool_blocks)
    cache = PagedKVCache(config, device=device)
    for t in cache.key_caches + cache.value_caches:
        t.view(torch.uint8).random_(0, 256)
    n = args.blocks
    gen = torch.Generator().manual_seed(0)
    perm = (torch.randperm(args.pool_blocks - 1, generator=gen) + 1).tolist()
    src_ids, dst_ids = perm[:n], perm[n:2 * n]
    P = block_payload_nbytes(cache, 0)
    nbytes = n * P
    pin = device.type == "cuda"
    host = host_buffer(n, P, pin=pin)
    dev_contig = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    host_flat = host.view(-1)
    rows: dict[str, Any] = {"config": {
        "device": str(device), "dtype": args.dtype, "block_size": args.block_size,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim, "layers_per_group": args.layers,
        "blocks_per_batch": n, "block_payload_bytes": P, "batch_bytes": nbytes,
        "torch_threads": torch.get_num_threads()}}

    def d2h() -> None:
        host_flat.copy_(dev_contig, non_blocking=pin)

    def h2d() -> None:
        dev_contig.copy_(host_flat, non_blocking=pin)

    layout = BlockLayout("bench-model", spec, config.groups[0].layer_ids)
    tokens = [[i * args.block_size + j for j in range(args.block_size)] for i in range(n)]
    hashes = list(accumulate(tokens, hash_block, initial=root_hash(None)))[1:]  # the chain
    keys = request_keys(layout, hashes, None)
    tier = HostTier(4 * n * HostTier.slot_nbytes_for(layout), pin=pin)

    def restored_equal() -> None:
        k = cache.key_caches[0].view(torch.uint8)
        assert torch.equal(k[dst_ids], k[src_ids]), "restored pages differ from the offloaded ones"

    # The engine's host path: values that stay in this process carry no checksum.
    paths: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("offload (gather pages -> host buffer)", lambda: gather_blocks(cache, 0, src_ids, out=host), d2h),
        ("restore (host buffer -> scattered pages)", lambda: scatter_blocks(cache, 0, dst_ids, host), h2d),
        ("host tier offload, engine (store_blocks, no checksum)",
         lambda: tier.store_blocks(cache, layout, 0, src_ids, keys, tokens, checksum=False), d2h),
        ("host tier restore, engine (load + check header/tokens + scatter)",
         lambda: restore_payloads(cache, 0, dst_ids, load_verified(
             tier, layout, keys, tokens, partial(decode_block, trusted=True), hashes=False)),
         h2d),
        ("host tier offload (store_blocks: gather into slots + seal)",
         lambda: tier.store_blocks(cache, layout, 0, src_ids, keys, tokens), d2h),
        ("host tier restore (load + verify + scatter)",
         lambda: restore_payloads(cache, 0, dst_ids, load_verified(tier, layout, keys, tokens)),
         h2d),
        ("host tier verify only (load + XXH3 of every value)",
         lambda: load_verified(tier, layout, keys, tokens), h2d),
        ("host tier offload, generic (offload_items + store)",
         lambda: tier.store(offload_items(cache, layout, 0, src_ids, keys, tokens)), d2h)]
    for name, path, plain in paths:
        rows[name] = side_by_side(name, path, plain, nbytes, device, args.reps)
        if name.startswith("host tier restore"):
            restored_equal()
    items = offload_items(cache, layout, 0, src_ids, keys, tokens)
    for name, path in value_paths(items, layout, tokens):
        rows[name] = side_by_side(name, path, d2h, nbytes, device, args.reps)
    views = [memoryview(host[i].numpy().data) for i in range(n)]
    for threads in CHECKSUM_THREADS:
        with ThreadPoolExecutor(threads) as pool:
            name = f"checksum only: XXH3-128 of host buffer, {threads} thread(s)"
            rows[name] = side_by_side(name, partial(xxh3_all, pool, views), d2h, nbytes, device, args.reps)
    if not args.no_store:
        rows.update(store_rows(args, items, layout, tokens, device))
    return rows


def value_paths(items: list, layout: BlockLayout, tokens: list) -> list[tuple[str, Callable[[], object]]]:
    """What a store value costs on this side of the socket, with its checksum only or
    sealed (AES-256-GCM)."""
    from kvstore.tiers.seal import Sealer

    sealer = Sealer(b"tier bench secret, not a real one")
    root = root_hash(None)
    triples = [(k, t, v) for (k, v), t in zip(items, tokens, strict=True)]
    sealed = [sealer.seal(root, k, v) for k, v in items]

    def encode() -> list[bytes]:
        return [encode_block(layout, k, t, v[-layout.payload_nbytes:]) for k, t, v in triples]

    def verify_checked() -> None:
        for k, t, v in triples:
            assert decode_block(layout, k, t, v) is not None

    def open_and_verify() -> None:
        for (k, t, _), s in zip(triples, sealed, strict=True):
            assert decode_block(layout, k, t, sealer.open(root, k, s)) is not None

    return [("store value, checksum path: encode (XXH3) of gathered pages", encode),
            ("store value, sealed: encode + AES-GCM seal",
             lambda: [sealer.seal(root, k, encode_block(layout, k, t, v[-layout.payload_nbytes:]))
                      for k, t, v in triples]),
            ("store value, checksum path: verify (XXH3)", verify_checked),
            ("store value, sealed: AES-GCM open + verify", open_and_verify)]


def store_rows(args: argparse.Namespace, items: list, layout: BlockLayout, tokens: list,
               device: torch.device) -> dict[str, Any]:
    """Valkey put/get through ValkeyStore against raw pipelined SET/GET on its client."""
    from kvstore.benchmarks.valkey_server import valkey_url
    from kvstore.tiers.valkey_store import ValkeyStore

    with valkey_url(args.store) as url:
        st = ValkeyStore(url, timeout_s=10.0, sync_stores=True, chunk=len(items))
        assert st.ping(), f"no Valkey at {st.url}"
        client = st._get_client()
        assert client is not None, f"no client for {st.url}"
        keys = [k for k, _ in items]
        names = [st.namespace + k for k in keys]
        nbytes = sum(len(v) for _, v in items)

        def raw_set() -> None:
            pipe = client.pipeline(transaction=False)
            for name, (_, v) in zip(names, items, strict=True):
                pipe.set(name, v)
            pipe.execute()

        def raw_get() -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            pipe.execute()

        rows = {name: side_by_side(name, path, raw, nbytes, device, args.reps)
                for name, path, raw in (
            ("store put (ValkeyStore.store_now vs raw pipelined SET)",
             lambda: st.store_now(items), raw_set),
            ("store get (ValkeyStore.load vs raw pipelined GET)", lambda: st.load(keys), raw_get),
            ("store get + verify (load_verified vs raw pipelined GET)",
             lambda: load_verified(st, layout, keys, tokens), raw_get))}
        assert st.stats["errors"] == 0 and len(load_verified(st, layout, keys, tokens)) == len(keys)
        st.delete(keys)
        st.close()
        return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.tier_bench``: ``kvstore bench tiers``."""
    from kvstore.cli import main as cli_main

    return cli_main(["bench", "tiers", *(sys.argv[1:] if argv is None else argv)])


def run_command(args: argparse.Namespace) -> int:
    """Measure the transfers, print a table (and JSON with ``--json``)."""
    if args.pool_blocks < 2 * args.blocks + 1:
        args.usage_error(f"argument --pool-blocks: need at least 2 * --blocks + 1 = "
                         f"{2 * args.blocks + 1}, got {args.pool_blocks}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.layers = args.layers or 8
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    cfg = rows.pop("config")
    print(textwrap.fill("config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()), 80,
                        subsequent_indent="  "))
    print(f"{'path':48s} {'path GB/s':>10s} {'plain GB/s':>11s} {'ratio':>6s}")
    for name, r in rows.items():
        if len(name) > 48:  # a long path name gets a line of its own
            print(name)
            name = ""
        print(f"{name:48s} {r['path_GBps']:10.3f} {r['plain_GBps']:11.3f} {r['ratio']:6.2f}")
    print("ratio: the path's speed over its baseline, a plain copy of the same bytes (the\n"
          "store rows: raw pipelined SET / GET); above 1: faster")
    if args.json:
        write_json(args.json, {"config": cfg, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
