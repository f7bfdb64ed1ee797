"""The ``kvstore`` console script: a dispatcher over subcommands.

Each subcommand registers itself through a small ``_add_<name>(subparsers)`` function
listed in ``_SUBCOMMANDS``; it sets ``func`` (called with the parsed arguments, returning an
exit code). The work itself lives in library modules; this file only parses arguments.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

SubparsersAction = Any  # argparse's private _SubParsersAction

# Tiny preset styles of `kvstore generate` (here so that building the parser loads no torch).
DEMO_MODELS = ("llama", "mistral", "gemma2", "gemma3", "qwen2", "qwen3")


def _add_generate(subparsers: SubparsersAction) -> None:
    """``kvstore generate``: greedy (or sampled) generation on a tiny model over built-in
    prompts that share prefixes, then the cache statistics."""
    p = subparsers.add_parser(
        "generate", help="generate with a tiny hybrid-attention model and show cache stats",
        description="Run a tiny random-initialised model (or a local HF checkpoint) over a few "
                    "built-in prompts with shared prefixes and print the generated tokens and "
                    "the cache statistics.")
    p.add_argument("--model", choices=DEMO_MODELS, default="gemma3",
                   help="tiny preset style (default: gemma3, 5 sliding : 1 full)")
    p.add_argument("--checkpoint", metavar="PATH",
                   help="local HF checkpoint dir (config.json + *.safetensors) instead of a preset")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens to generate per sample")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (forked)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512, help="pool size incl. the null block")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-partial-hits", action="store_true")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="attention backend (auto: Triton on CUDA, reference on CPU)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    import torch

    from kvstore.cli.generate import build_demo_model, demo_prompts, render_demo, run_generate_demo
    from kvstore.engine.engine import SamplingParams

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = build_demo_model(args.model, args.checkpoint, seed=args.seed, device=device)
    prompts = demo_prompts(model.config.vocab_size, args.block_size, seed=args.seed)
    sampling = SamplingParams(max_tokens=args.max_tokens, n=args.n,
                              temperature=args.temperature, seed=args.seed)
    result = run_generate_demo(
        model, prompts, sampling, model_name=Path(args.checkpoint).name if args.checkpoint else args.model,
        num_blocks=args.num_blocks, block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_partial_hits=not args.no_partial_hits,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.backend, device=device)
    render_demo(result)
    return 0


def _add_bench(subparsers: SubparsersAction) -> None:
    """``kvstore bench``: the prefix-reuse sweep against pool size (the main job)."""
    from kvstore.benchmarks.bench import add_bench_parser

    add_bench_parser(subparsers)


def _add_viz(subparsers: SubparsersAction) -> None:
    """``kvstore viz``: the pool's block layout, as text per step and as a PNG over time."""
    from kvstore.benchmarks.viz import add_viz_parser

    add_viz_parser(subparsers)


# Subcommand registrars, in help order.
_SUBCOMMANDS: list[Callable[[SubparsersAction], None]] = [_add_bench, _add_viz, _add_generate]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="kvstore", description="A prefix-caching paged KV-cache store with hybrid attention.")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in _SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script; with no subcommand, prints help."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    return int(func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
