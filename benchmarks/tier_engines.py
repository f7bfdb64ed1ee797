"""``kvstore bench tiers --engines``: two engine processes sharing one Valkey store, the
second hitting the prefixes the first computed, both checked against one engine without
tiers (docs/tiers.md, "Two engine processes, one store")."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

from kvstore.benchmarks.output import write_json

ENGINE_OPTIONS = ("layers", "num_blocks", "block_size", "prefixes", "prefix_len", "suffix_len", "max_tokens")


def prompts_for(role: str, num_prefixes: int, prefix_len: int, suffix_len: int,
                vocab: int) -> list[list[int]]:
    """The prompts of engine ``role`` (``a`` or ``b``): each shared prefix plus a suffix of
    its own."""
    import torch

    out = []
    for i in range(num_prefixes):
        g = torch.Generator().manual_seed(1000 + i)
        prefix = torch.randint(0, vocab, (prefix_len,), generator=g).tolist()
        g = torch.Generator().manual_seed(2000 + 100 * "ab".index(role) + i)
        out.append(prefix + torch.randint(0, vocab, (suffix_len,), generator=g).tolist())
    return out


def serve(role: str, store_url: str | None, a: argparse.Namespace, q: Any) -> None:
    """Put on `q` the tokens and counters of an engine (with the store when `store_url`)
    serving the prompts of `role` (``a``, ``b``, or ``ab`` for both in turn)."""
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
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    options = argparse.Namespace(**{k: getattr(a, k) for k in ENGINE_OPTIONS})
    p = ctx.Process(target=serve, args=(role, url, options, q))
    p.start()
    out: dict[str, Any] = q.get(timeout=600)
    p.join(60)
    return out


def run_command(a: argparse.Namespace) -> int:
    """Run A, then B, against one store, and a reference engine; print the figures; 1 when
    B loads under 95% of A's prefix tokens or any output differs."""
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
    if a.json:
        write_json(a.json, result)
    print(f"A computed {prefix_tokens} prefix tokens (full blocks) over {n} prefixes; "
          f"B loaded {second['store_hit_tokens']} of them from the store: "
          f"{result['fraction']:.3f}")
    print(f"tokens equal to one engine without tiers: A {result['a_tokens_equal']}, "
          f"B {result['b_tokens_equal']}")
    print(f"computed tokens: A {first['computed_tokens']}, B {second['computed_tokens']}; "
          f"seconds: A {first['seconds']}, B {second['seconds']}")
    ok = result["fraction"] >= 0.95 and result["a_tokens_equal"] and result["b_tokens_equal"]
    return 0 if ok else 1
