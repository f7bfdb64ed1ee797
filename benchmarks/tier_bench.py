"""Transfer benchmark of the tiers, each path side by side with a plain copy of the same
bytes, measured in one run:

    kvstore bench tiers [--device cpu|cuda] [--blocks 64] [--layers 8]
                                            [--store valkey://host:port/db] [--json PATH]

* offload: ``gather_blocks`` (scattered pages of one group -> one host buffer, pinned on
  CUDA) against ``host.copy_(contiguous device tensor)`` of the same bytes;
* restore: ``scatter_blocks`` (host buffer -> scattered freshly chosen pages) against
  ``device_tensor.copy_(host)``;
* the full host-tier path: ``HostTier.store_blocks`` (gather straight into the arena's
  slots, then header, tokens and XXH3-128 written in place), and ``HostTier.load`` (views of
  the slots) + verify + scatter, against the same plain copies; and the generic path
  (``offload_items``: gather + encode into new ``bytes``, then ``HostTier.store`` copying
  them into slots);
* store put/get: ``ValkeyStore.store_now`` / ``ValkeyStore.load`` (and ``load_verified``,
  which also decodes) against raw pipelined SET / GET of the same keys and sizes through
  the same ``redis`` client. Without ``--store`` a throwaway valkey-server is started on
  127.0.0.1 (``--no-store`` skips this part).

Each pair runs alternately ``--reps`` times; figures are medians (GB/s of payload bytes)
and the ratio path / baseline."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def side_by_side(path: Callable[[], object], base: Callable[[], object], nbytes: int,
                 device: torch.device, reps: int) -> dict[str, float]:
    """Median GB/s of ``path`` and ``base`` run alternately, and their ratio."""
    path()
    base()
    tp, tb = [], []
    for _ in range(reps):
        tp.append(_time(path, device))
        tb.append(_time(base, device))
    gp, gb = nbytes / statistics.median(tp) / 1e9, nbytes / statistics.median(tb) / 1e9
    return {"path_GBps": round(gp, 3), "plain_GBps": round(gb, 3), "ratio": round(gp / gb, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """All measurements, as a dict of rows."""
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

    def plain_d2h() -> None:
        host_flat.copy_(dev_contig, non_blocking=pin)

    def plain_h2d() -> None:
        dev_contig.copy_(host_flat, non_blocking=pin)

    def pair(name: str, path: Callable[[], object], plain: Callable[[], object]) -> None:
        rows[name] = side_by_side(path, plain, nbytes, device, args.reps)

    pair("offload (gather pages -> host buffer)",
         lambda: gather_blocks(cache, 0, src_ids, out=host), plain_d2h)
    pair("restore (host buffer -> scattered pages)",
         lambda: scatter_blocks(cache, 0, dst_ids, host), plain_h2d)

    layout = BlockLayout("bench-model", spec, config.groups[0].layer_ids)
    tokens = [[i * args.block_size + j for j in range(args.block_size)] for i in range(n)]
    hashes, parent = [], root_hash(None)
    for block_tokens in tokens:
        parent = hash_block(parent, block_tokens)
        hashes.append(parent)
    keys = request_keys(layout, hashes, None)
    tier = HostTier(4 * n * HostTier.slot_nbytes_for(layout), pin=pin)

    def in_process(layout: BlockLayout, key: bytes, token_ids: Any, value: Any, counters: Any) -> Any:
        return decode_block(layout, key, token_ids, value, counters, trusted=True)

    # The engine's path: values that stay in this process carry no checksum.
    pair("host tier offload, engine (store_blocks, no checksum)",
         lambda: tier.store_blocks(cache, layout, 0, src_ids, keys, tokens, checksum=False), plain_d2h)
    pair("host tier restore, engine (load + check header/tokens + scatter)",
         lambda: restore_payloads(cache, 0, dst_ids, load_verified(
             tier, layout, keys, tokens, in_process, hashes=False)), plain_h2d)
    k = cache.key_caches[0].view(torch.uint8)
    assert torch.equal(k[dst_ids], k[src_ids]), "restored pages differ from the offloaded ones"
    pair("host tier offload (store_blocks: gather into slots + seal)",
         lambda: tier.store_blocks(cache, layout, 0, src_ids, keys, tokens), plain_d2h)
    pair("host tier restore (load + verify + scatter)",
         lambda: restore_payloads(cache, 0, dst_ids, load_verified(tier, layout, keys, tokens)),
         plain_h2d)
    assert torch.equal(k[dst_ids], k[src_ids]), "restored pages differ from the offloaded ones"
    pair("host tier verify only (load + XXH3 of every value)",
         lambda: load_verified(tier, layout, keys, tokens), plain_h2d)
    pair("host tier offload, generic (offload_items + store)",
         lambda: tier.store(offload_items(cache, layout, 0, src_ids, keys, tokens)), plain_d2h)

    sealed_rows(rows, offload_items(cache, layout, 0, src_ids, keys, tokens), layout, tokens, device,
                args.reps, nbytes, plain_d2h)
    if not args.no_store:
        rows.update(store_rows(args, offload_items(cache, layout, 0, src_ids, keys, tokens),
                               layout, tokens, device))
    return rows


def sealed_rows(rows: dict[str, Any], items: list, layout: BlockLayout, tokens: list,
                device: torch.device, reps: int, nbytes: int, plain: Callable[[], object]) -> None:
    """What a store value costs on this side of the socket, sealed (AES-256-GCM) or with its
    checksum only, against the same plain copy."""
    from kvstore.tiers.seal import Sealer

    sealer = Sealer(b"tier bench secret, not a real one")
    root = root_hash(None)
    keys = [k for k, _ in items]
    values = [v for _, v in items]
    sealed = [sealer.seal(root, k, v) for k, v in items]

    def verify_checked() -> None:
        for k, t, v in zip(keys, tokens, values, strict=True):
            assert decode_block(layout, k, t, v) is not None

    def open_and_verify() -> None:
        for k, t, v in zip(keys, tokens, sealed, strict=True):
            assert decode_block(layout, k, t, sealer.open(root, k, v)) is not None

    rows["store value, checksum path: encode (XXH3) of gathered pages"] = side_by_side(
        lambda: [encode_block(layout, k, t, v[-layout.payload_nbytes:])
                 for k, t, v in zip(keys, tokens, values, strict=True)], plain, nbytes, device, reps)
    rows["store value, sealed: encode + AES-GCM seal"] = side_by_side(
        lambda: [sealer.seal(root, k, encode_block(layout, k, t, v[-layout.payload_nbytes:]))
                 for k, t, v in zip(keys, tokens, values, strict=True)], plain, nbytes, device, reps)
    rows["store value, checksum path: verify (XXH3)"] = side_by_side(
        verify_checked, plain, nbytes, device, reps)
    rows["store value, sealed: AES-GCM open + verify"] = side_by_side(
        open_and_verify, plain, nbytes, device, reps)


def store_rows(args: argparse.Namespace, items: list, layout: BlockLayout, tokens: list,
               device: torch.device) -> dict[str, Any]:
    """Valkey put/get through ValkeyStore against raw pipelined SET/GET on its client."""
    from kvstore.benchmarks.valkey_server import ValkeyServer
    from kvstore.tiers.valkey_store import ValkeyStore

    server = None
    url = args.store
    if url is None:
        server = ValkeyServer().start()
        url = server.url
    try:
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

        rows = {
            "store put (ValkeyStore.store_now vs raw pipelined SET)": side_by_side(
                lambda: st.store_now(items), raw_set, nbytes, device, args.reps),
            "store get (ValkeyStore.load vs raw pipelined GET)": side_by_side(
                lambda: st.load(keys), raw_get, nbytes, device, args.reps),
            "store get + verify (load_verified vs raw pipelined GET)": side_by_side(
                lambda: load_verified(st, layout, keys, tokens), raw_get, nbytes, device, args.reps),
        }
        assert st.stats["errors"] == 0 and len(load_verified(st, layout, keys, tokens)) == len(keys)
        st.delete(keys)
        st.close()
        return rows
    finally:
        if server is not None:
            server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.tier_bench``: ``kvstore bench tiers``."""
    from kvstore.benchmarks.bench import add_tier_arguments

    p = argparse.ArgumentParser(prog="kvstore bench tiers")
    add_tier_arguments(p)
    args = p.parse_args(argv)
    args.usage_error = p.error
    return run_command(args)


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
    print("config: " + ", ".join(f"{k}={v}" for k, v in cfg.items()))
    print(f"{'path':58s} {'path GB/s':>10s} {'plain GB/s':>11s} {'ratio':>6s}")
    for name, r in rows.items():
        print(f"{name:58s} {r['path_GBps']:10.3f} {r['plain_GBps']:11.3f} {r['ratio']:6.2f}")
    if args.json:
        write_json(args.json, {"config": cfg, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
