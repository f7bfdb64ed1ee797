"""``kvstore bench tiers``: each transfer path of the tiers against a plain copy of the same
bytes (docs/tiers.md, "Transfer figures"); ``--engines``: two engine processes sharing one
Valkey store, against one engine without tiers (docs/tiers.md, "Two engine processes, one store")."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import accumulate
from typing import Any

import torch
import xxhash

from kvstore.benchmarks.output import check_folder, text_table, wrap, write_json
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
ENGINE_OPTIONS = ("layers", "num_blocks", "block_size", "prefixes", "prefix_len", "suffix_len", "max_tokens")


def side_by_side(name: str, path: Callable[[], object], base: Callable[[], object], nbytes: int,
                 device: torch.device, reps: int) -> dict[str, float]:
    """Median GB/s of ``path`` and ``base`` run alternately, and their ratio."""
    print(f"  {name} ...", file=sys.stderr, flush=True)
    cuda = device.type == "cuda"
    sync: Callable[[], object] = partial(torch.cuda.synchronize, device) if cuda else lambda: None

    def seconds(fn: Callable[[], object]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    path()
    base()
    times = [(seconds(path), seconds(base)) for _ in range(reps)]
    gp, gb = (nbytes / statistics.median(t) / 1e9 for t in zip(*times, strict=True))
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
    d2h = partial(host_flat.copy_, dev_contig, non_blocking=pin)
    h2d = partial(dev_contig.copy_, host_flat, non_blocking=pin)
    layout = BlockLayout("bench-model", spec, config.groups[0].layer_ids)
    tokens = [[i * args.block_size + j for j in range(args.block_size)] for i in range(n)]
    hashes = list(accumulate(tokens, hash_block, initial=root_hash(None)))[1:]  # the chain
    keys = request_keys(layout, hashes, None)
    tier = HostTier(4 * n * HostTier.slot_nbytes_for(layout), pin=pin)

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
            k = cache.key_caches[0].view(torch.uint8)
            assert torch.equal(k[dst_ids], k[src_ids]), "restored pages differ from the offloaded ones"
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
    """What a store value costs on this side of the socket, checksummed or sealed (AES-256-GCM;
    its rows are left out, saying so, where cryptography is not installed)."""
    from kvstore.tiers.seal import Sealer

    triples = [(k, t, v) for (k, v), t in zip(items, tokens, strict=True)]

    def encode(k: bytes, t: list[int], v: bytes) -> bytes:
        return encode_block(layout, k, t, v[-layout.payload_nbytes:])

    def verify(stored: list[bytes], opened: Callable[[bytes, bytes], bytes | None] | None = None) -> None:
        for (k, t, _), v in zip(triples, stored, strict=True):
            assert decode_block(layout, k, t, v if opened is None else opened(k, v)) is not None

    paths: list[tuple[str, Callable[[], object]]] = [
        ("store value, checksum path: encode (XXH3) of gathered pages",
         lambda: [encode(k, t, v) for k, t, v in triples]),
        ("store value, checksum path: verify (XXH3)", partial(verify, [v for _, v in items]))]
    try:
        sealer = Sealer(b"tier bench secret, not a real one")
    except ImportError as e:
        print(f"  store value, sealed: left out ({e})", file=sys.stderr)
        return paths
    root = root_hash(None)
    sealed = [sealer.seal(root, k, v) for k, v in items]
    return [*paths, ("store value, sealed: encode + AES-GCM seal",
                     lambda: [sealer.seal(root, k, encode(k, t, v)) for k, t, v in triples]),
            ("store value, sealed: AES-GCM open + verify",
             partial(verify, sealed, partial(sealer.open, root)))]


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

        def raw(command: str, *columns: list[bytes]) -> Callable[[], object]:
            """Pipelined `command` (SET or GET) of every key, with its value from `columns`."""
            def go() -> object:
                pipe = client.pipeline(transaction=False)
                for row in zip(names, *columns, strict=True):
                    getattr(pipe, command)(*row)
                return pipe.execute()
            return go

        raw_set, raw_get = raw("set", [v for _, v in items]), raw("get")
        rows = {name: side_by_side(name, path, plain, nbytes, device, args.reps)
                for name, path, plain in (
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
    """Measure the transfers (or with ``--engines`` run two engines); print them (and ``--json``)."""
    from kvstore.benchmarks.simulator import check_store
    from kvstore.cli import resolve_device

    if args.store:
        check_store(args.store, args.usage_error)
    if args.json:
        check_folder(args.json.parent, args.usage_error, "--json")
    if args.engines:
        return run_engines(args)
    if args.pool_blocks < 2 * args.blocks + 1:
        args.usage_error(f"argument --pool-blocks: need at least 2 * --blocks + 1 = "
                         f"{2 * args.blocks + 1}, got {args.pool_blocks}")
    args.device = str(resolve_device(args.device, args.usage_error))
    args.layers = args.layers or 8
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args)
    cfg = rows.pop("config")
    print(wrap("config: " + ", ".join(f"{k}={v}" for k, v in cfg.items())))
    print(text_table(("path", "path GB/s", "plain GB/s", "ratio"), (
        [name, f"{r['path_GBps']:.3f}", f"{r['plain_GBps']:.3f}", f"{r['ratio']:.2f}"]
        for name, r in rows.items())))
    print("ratio: the path's speed over its baseline, a plain copy of the same bytes (the\n"
          "store rows: raw pipelined SET / GET); above 1: faster")
    worst = min(rows, key=lambda name: rows[name]["ratio"])
    print("\n" + wrap(f"slowest against its baseline ({rows[worst]['ratio']:.2f}x its speed): {worst}"))
    if args.json:
        write_json(args.json, {"config": cfg, "rows": rows})
        print(f"wrote {args.json}")
    return 0


# ------------------------------------------------- --engines: two engines, one store


def prompts_for(role: str, num_prefixes: int, prefix_len: int, suffix_len: int,
                vocab: int) -> list[list[int]]:
    """The prompts of engine ``role`` (``a`` or ``b``): each shared prefix plus its own suffix."""
    def tokens(seed: int, n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    return [tokens(1000 + i, prefix_len) + tokens(2000 + 100 * "ab".index(role) + i, suffix_len)
            for i in range(num_prefixes)]


def serve(role: str, store_url: str | None, a: argparse.Namespace, q: Any) -> None:
    """Put on `q` the tokens and counters of an engine serving `role`'s prompts (``ab``: both)."""
    from kvstore.engine.engine import EngineConfig, LLMEngine, SamplingParams, TierConfig
    from kvstore.models.presets import build_preset

    model = build_preset("llama", seed=0, num_hidden_layers=a.layers)
    engine = LLMEngine(model, EngineConfig(
        num_blocks=a.num_blocks, block_size=a.block_size,
        tiers=TierConfig(store_url=store_url) if store_url else None))
    prompts = [p for r in role for p in prompts_for(r, a.prefixes, a.prefix_len, a.suffix_len,
                                                    model.config.vocab_size)]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=a.max_tokens))
    seconds = time.perf_counter() - t0
    flushed = engine.flush_tiers(30.0)
    stats = engine.stats
    engine.close()
    q.put({"tokens": [o.outputs[0].token_ids for o in outs], "seconds": round(seconds, 3),
           "flushed": flushed, "computed_tokens": stats.computed_tokens,
           "store_hit_tokens": stats.store_hit_tokens,
           "store": engine.tier_stats().get("store", {})})


def in_child(role: str, url: str | None, a: argparse.Namespace) -> dict[str, Any]:
    """`serve` in a fresh (spawned) process."""
    print(f"  engine {role.upper()}{' (store)' if url else ', no tiers'} ...", file=sys.stderr, flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    options = argparse.Namespace(**{k: getattr(a, k) for k in ENGINE_OPTIONS})
    p = ctx.Process(target=serve, args=(role, url, options, q))
    p.start()
    out: dict[str, Any] = q.get(timeout=600)
    p.join(60)
    return out


def run_engines(a: argparse.Namespace) -> int:
    """Run A then B on one store, and a reference engine: 1 when B hits < 95% or outputs differ."""
    from kvstore.benchmarks.valkey_server import valkey_url

    a.layers = a.layers or 4
    with valkey_url(a.store) as url:
        first, second = in_child("a", url, a), in_child("b", url, a)
    ref = in_child("ab", None, a)
    prefix_tokens = a.prefixes * (a.prefix_len // a.block_size) * a.block_size
    n = a.prefixes
    result = {
        "prefix_tokens_a_computed": prefix_tokens,
        "store_hit_tokens_b": second["store_hit_tokens"],
        "fraction": second["store_hit_tokens"] / prefix_tokens,
        "a_tokens_equal": first["tokens"] == ref["tokens"][:n],
        "b_tokens_equal": second["tokens"] == ref["tokens"][n:],
        "computed_tokens": {"a": first["computed_tokens"], "b": second["computed_tokens"]},
        "seconds": {"a": first["seconds"], "b": second["seconds"]},
        "a_flushed": first["flushed"], "store_b": second["store"],
    }
    print(wrap(f"A computed {prefix_tokens} prefix tokens (full blocks) over {n} prefixes; B "
               f"loaded {second['store_hit_tokens']} of them from the store: "
               f"{result['fraction']:.3f}"))
    print(f"tokens equal to one engine without tiers: A {result['a_tokens_equal']}, "
          f"B {result['b_tokens_equal']}")
    print(f"computed tokens: A {first['computed_tokens']}, B {second['computed_tokens']}; "
          f"seconds: A {first['seconds']}, B {second['seconds']}")
    ok = result["fraction"] >= 0.95 and result["a_tokens_equal"] and result["b_tokens_equal"]
    if a.json:
        write_json(a.json, result)
        print(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
