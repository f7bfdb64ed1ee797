"""Two engine processes sharing one Valkey store: the second hits the prefixes the first
computed, and both produce the tokens of one engine without tiers.

A throwaway valkey-server starts on 127.0.0.1 (or ``--store URL``). Process A serves
``--prefixes`` long shared prefixes, each with its own suffix, then flushes its store
writes and exits. Process B serves the same prefixes with other suffixes. A third process
runs A's and B's prompts through one engine without tiers. Reported: the fraction of the
prefix tokens A computed (full blocks) that B loaded from the store, and whether every
output agrees.

Run ``kvstore bench tiers --engines``."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from collections.abc import Sequence
from typing import Any

from kvstore.benchmarks.output import write_json


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


def serve(role: str, store_url: str | None, args: dict[str, Any]) -> dict[str, Any]:
    """Build the seeded model and an engine (with the store when ``store_url``), run the
    prompts of ``role`` (``a``, ``b``, or ``ab`` for both in turn), return tokens and
    counters."""
    from kvstore.engine.engine import EngineConfig, LLMEngine, SamplingParams, TierConfig
    from kvstore.models.presets import build_preset

    model = build_preset("llama", seed=0, num_hidden_layers=args["layers"])
    engine = LLMEngine(model, EngineConfig(
        num_blocks=args["num_blocks"], block_size=args["block_size"],
        tiers=TierConfig(store_url=store_url) if store_url else None))
    prompts: list[list[int]] = []
    for r in role:
        prompts += prompts_for(r, args["prefixes"], args["prefix_len"], args["suffix_len"],
                               model.config.vocab_size)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=args["max_tokens"]))
    seconds = time.perf_counter() - t0
    flushed = engine.flush_tiers(30.0)
    s = engine.stats
    engine.close()
    return {"tokens": [o.outputs[0].token_ids for o in outs], "seconds": seconds,
            "flushed": flushed, "computed_tokens": s.computed_tokens,
            "store_hit_tokens": s.store_hit_tokens, "hit_tokens": s.hit_tokens,
            "tier_stats": engine.tier_stats()}


def _child(role: str, url: str | None, args: dict[str, Any], q: Any) -> None:
    q.put(serve(role, url, args))


def _in_process(role: str, url: str | None, args: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(role, url, args, q))
    p.start()
    out: dict[str, Any] = q.get(timeout=600)
    p.join(60)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore.benchmarks.tier_engines``: ``kvstore bench tiers --engines``."""
    from kvstore.benchmarks.bench import add_tier_arguments

    p = argparse.ArgumentParser(prog="kvstore bench tiers")
    add_tier_arguments(p)
    return run_command(p.parse_args([*(argv or []), "--engines"]))


def run_command(a: argparse.Namespace) -> int:
    """Run A, then B, against one store, and a reference engine; print the figures."""
    a.layers = a.layers or 4
    args = {"prefixes": a.prefixes, "prefix_len": a.prefix_len, "suffix_len": a.suffix_len,
            "max_tokens": a.max_tokens, "block_size": a.block_size, "num_blocks": a.num_blocks,
            "layers": a.layers}
    server = None
    url = a.store
    if url is None:
        from kvstore.benchmarks.valkey_server import ValkeyServer

        server = ValkeyServer().start()
        url = server.url
    try:
        first = _in_process("a", url, args)
        second = _in_process("b", url, args)
        ref = _in_process("ab", None, args)
    finally:
        if server is not None:
            server.stop()
    prefix_tokens = a.prefixes * (a.prefix_len // a.block_size) * a.block_size
    n = a.prefixes
    result = {
        "prefix_tokens_a_computed": prefix_tokens,
        "store_hit_tokens_b": second["store_hit_tokens"],
        "fraction": second["store_hit_tokens"] / prefix_tokens,
        "tokens_equal": first["tokens"] + second["tokens"] == ref["tokens"],
        "a_tokens_equal": first["tokens"] == ref["tokens"][:n],
        "b_tokens_equal": second["tokens"] == ref["tokens"][n:],
        "computed_tokens": {"a": first["computed_tokens"], "b": second["computed_tokens"]},
        "seconds": {"a": round(first["seconds"], 3), "b": round(second["seconds"], 3)},
        "a_flushed": first["flushed"], "store_b": second["tier_stats"].get("store", {}),
    }
    if a.json:
        write_json(a.json, result)
    print(f"A computed {prefix_tokens} prefix tokens (full blocks) over {n} prefixes; "
          f"B loaded {second['store_hit_tokens']} of them from the store: "
          f"{result['fraction']:.3f}")
    print(f"tokens equal to one engine without tiers: A {result['a_tokens_equal']}, "
          f"B {result['b_tokens_equal']}")
    print(f"computed tokens: A {first['computed_tokens']}, B {second['computed_tokens']}; "
          f"seconds: A {result['seconds']['a']}, B {result['seconds']['b']}")
    return 0 if result["fraction"] >= 0.95 and result["tokens_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
