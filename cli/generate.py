"""The `kvstore generate` demo: a tiny random transformers model (or a local checkpoint dir
or GGUF file) over built-in prompts that share prefixes, run through the engine, with the
cache statistics; or, with
``--model smollm2``, a real chat model answering a multi-turn
conversation and side requests that share its system prompt, with hit rates per request."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch

from kvstore.cli import CHAT_MAX_TOKENS, DEMO_MODELS, HYBRID_MODELS
from kvstore.engine.engine import (
    EngineConfig,
    EngineStats,
    LLMEngine,
    RequestOutput,
    SamplingParams,
)
from kvstore.kv_cache_manager import CacheConfig
from kvstore.models.hf import HFCausalLM, load_hf_model
from kvstore.models.presets import build_preset

if TYPE_CHECKING:
    from kvstore.models.chat import ChatModel


def build_demo_model(name: str | Path = "gemma3", checkpoint: str | None = None, seed: int = 0,
                     device: torch.device | str = "cpu") -> HFCausalLM:
    """A tiny preset with seeded random weights (``llama``, ``mistral``, ``gemma2``,
    ``gemma3``, ...: :mod:`kvstore.models.presets`; the recurrent hybrids ``qwen3_next``,
    ``qwen3_5``, ``nemotron_h``, ``granitemoehybrid``, ``bamba``:
    :mod:`kvstore.models.recurrent`), or the model of a local checkpoint dir
    (``checkpoint``, or ``name`` as a path) or GGUF file (``name``)."""
    if isinstance(name, Path) or checkpoint is not None:
        return load_hf_model(name if isinstance(name, Path) else checkpoint, device=device)
    if name in HYBRID_MODELS:
        from kvstore.models.recurrent import tiny_hybrid_config

        model_type = "qwen3_5_text" if name == "qwen3_5" else name
        return load_hf_model(tiny_hybrid_config(model_type), seed=seed, device=device)
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {DEMO_MODELS + HYBRID_MODELS}")
    return build_preset(name, seed, device=device)


def whole_large_pages(model: HFCausalLM, block_size: int, num_blocks: int) -> int:
    """`num_blocks` rounded down to whole large pages of the model's cache layout (the same
    count without recurrent layers)."""
    from kvstore.engine.engine import kv_cache_specs
    from kvstore.specs import make_kv_cache_config

    k = make_kv_cache_config(kv_cache_specs(model, block_size),
                             memory_bytes=1 << 40).large_page_blocks or 1
    return num_blocks - num_blocks % k


def demo_prompts(vocab_size: int, block_size: int, seed: int = 0) -> list[list[int]]:
    """Built-in prompts: three share a 'system prompt' (one of them only up to mid-block,
    for a partial hit), one shares nothing."""
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()

    system = rand(3 * block_size + block_size // 2)
    return [
        system + rand(5),
        system + rand(block_size + 3),
        system[: 2 * block_size + block_size // 2 + 1] + rand(4),
        rand(2 * block_size + 1),
    ]


@dataclass
class DemoResult:
    """What ``kvstore generate`` prints: the prompts' outputs, merged stats, cache layout."""

    model_name: str
    outputs: list[RequestOutput]
    stats: EngineStats
    layout: dict[str, Any]


def engine_config(args: Any) -> EngineConfig:
    """The engine settings of `kvstore generate`'s parsed options."""
    return EngineConfig(
        num_blocks=args.num_blocks, block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.backend,
        cache=CacheConfig(enable_caching=not args.no_prefix_caching,
                          enable_partial_hits=not args.no_partial_hits))


def run_generate_demo(model: HFCausalLM, prompts: Sequence[Sequence[int]],
                      sampling: SamplingParams, config: EngineConfig, model_name: str = "",
                      device: torch.device | str | None = None) -> DemoResult:
    """Run the first prompt alone, then the rest as one batch (which hit its cached
    prefix), on a fresh engine of `config`."""
    engine = LLMEngine(model, config, device)
    outputs = engine.generate(prompts[:1], sampling) + engine.generate(prompts[1:], sampling)
    return DemoResult(model_name, outputs, engine.stats, engine.describe())


def render_demo(result: DemoResult, console: Any = None) -> None:
    """Print the demo's per-prompt outputs, cache statistics and layout as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    outs = Table(title=f"generated tokens ({result.model_name})")
    recurrent = any(window == 0 for window, _ in result.layout["groups"])
    columns = ("request", "prompt", "cached", *(("served from",) if recurrent else ()), "sample",
               "tokens", "finish")
    for col in columns:
        outs.add_column(col, justify="right" if col in ("prompt", "cached", "sample") else "left")
    for out in result.outputs:
        served = ((out.hit_checkpoint_kind or "-",) if recurrent else ())
        for s in out.outputs:
            outs.add_row(out.request_id, str(len(out.prompt_token_ids)),
                         str(out.num_cached_tokens), *served, str(s.index),
                         " ".join(map(str, s.token_ids)), s.finish_reason or "")
    console.print(outs)
    _render_stats_and_layout(result.stats, result.layout, console)
    st = result.stats
    console.print(f"{st.hit_tokens} of {st.queried_tokens} prompt tokens came from the cache "
                  f"({st.partial_hit_tokens} by a partial hit); {st.finished} requests finished "
                  f"in {st.steps} steps, {st.computed_tokens} tokens computed")


# --------------------------------------------------------------------------- real text


SYSTEM_PROMPT = ("You are a concise geography assistant. Answer every question in one short, "
                 "factual sentence.")

_FIRST = "What is the capital of France?"
_FOLLOW_UP = "And what is the capital of Germany?"
_THIRD = "What language do people speak there?"


@dataclass
class ChatRequest:
    """One request of the chat demo: its round, label, messages, and what came back."""

    round: int
    label: str
    messages: list[dict[str, str]]
    output: RequestOutput
    replies: list[str]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the cache at admission over prompt tokens."""
        return self.output.num_cached_tokens / max(len(self.output.prompt_token_ids), 1)


@dataclass
class ChatDemoResult:
    """What ``kvstore generate --model smollm2`` prints: every request, merged stats,
    cache layout."""

    model_name: str
    requests: list[ChatRequest]
    stats: EngineStats
    layout: dict[str, Any]


def _chat_rounds(system: str) -> list[list[tuple[str, list[dict[str, str]] | None]]]:
    """The demo's rounds of ``(label, messages)``; ``None`` messages are the multi-turn
    request, built from the previous round's reply."""
    sys_msg = {"role": "system", "content": system}

    def user(text: str) -> dict[str, str]:
        return {"role": "user", "content": text}

    return [
        [("turn 1", [sys_msg, user(_FIRST)])],
        [("turn 2", None),
         ("same system", [sys_msg, user("What is the capital of Italy?")]),
         ("same system", [sys_msg, user("Name the longest river in Europe.")]),
         ("no system", [user(_FIRST)])],
        [("turn 3", None)],
    ]


class Progress:
    """Progress lines for a run that takes minutes, on ``stream`` (stderr in the CLI; None:
    silent). :meth:`stage` prints a line; :meth:`update` prints a running count at most
    every ``interval`` seconds, rewriting one line in place on a terminal; :meth:`end`
    finishes that line. Every line carries the seconds since the start."""

    def __init__(self, stream: TextIO | None = None, prog: str = "kvstore generate",
                 interval: float | None = None) -> None:
        self.stream = stream
        self.prog = prog
        self.tty = bool(stream is not None and stream.isatty())
        self.interval = interval if interval is not None else (0.25 if self.tty else 5.0)
        self._start = time.monotonic()
        self._last = self._start
        self._open = False  # an in-place line waits for its end

    def _line(self, message: str) -> str:
        return f"{self.prog}: {message} ({time.monotonic() - self._start:.0f} s)"

    def stage(self, message: str) -> None:
        """A stage starts: one line, at once."""
        if self.stream is None:
            return
        self.end()
        print(self._line(message), file=self.stream, flush=True)
        self._last = time.monotonic()

    def update(self, message: str) -> None:
        """A running count: shown if ``interval`` seconds passed since the last line."""
        if self.stream is None or time.monotonic() - self._last < self.interval:
            return
        if self.tty:
            self.stream.write("\r\x1b[K" + self._line(message))
            self.stream.flush()
            self._open = True
        else:
            print(self._line(message), file=self.stream, flush=True)
        self._last = time.monotonic()

    def end(self) -> None:
        """Finish an in-place line (a no-op when none is open)."""
        if self._open and self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()
        self._open = False


def generate_with_progress(engine: LLMEngine, prompts: Sequence[Sequence[int]],
                            sampling: SamplingParams, what: str, progress: Progress
                            ) -> list[RequestOutput]:
    """``engine.generate(prompts, sampling)``, step by step, telling ``progress`` what the
    step did: prompt tokens left to prefill, then tokens generated and requests done."""
    progress.stage(f"{what}: {len(prompts)} request(s), {sum(map(len, prompts))} prompt tokens")
    steps = 0

    def report(done: list[RequestOutput]) -> None:
        nonlocal steps
        steps += 1
        live = [*engine.scheduler.running, *engine.scheduler.waiting]
        to_prefill = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in live)
        generated = (sum(r.num_output_tokens for r in live)
                     + sum(len(s.token_ids) for o in done for s in o.outputs))
        phase = (f"prefill, {to_prefill} prompt tokens to go" if to_prefill
                 else f"decode, {generated} tokens generated")
        progress.update(f"{what}: step {steps}, {phase}, {len(done)}/{len(prompts)} done")

    outs = engine.generate(prompts, sampling, on_step=report)
    progress.end()
    return outs


def run_chat_demo(chat: ChatModel, sampling: SamplingParams, config: EngineConfig,
                  system_prompt: str = SYSTEM_PROMPT, progress: Progress | None = None,
                  device: torch.device | str | None = None) -> ChatDemoResult:
    """Run a conversation and side requests through one fresh engine, round by round.

    Round 1 asks one question under the system prompt; round 2 batches the conversation's
    second turn (its history is round 1's prompt and reply) with new questions under the
    same system prompt and one with the template's default system prompt; round 3 is the
    third turn. Replies stop at the model's stop tokens. ``progress`` reports each round's
    steps as they run; the engine is built from `config` on `device`.
    """
    progress = progress or Progress()
    engine = LLMEngine(chat.model, config, device)
    sampling = dataclasses.replace(
        sampling, stop_token_ids=tuple(dict.fromkeys(sampling.stop_token_ids + chat.stop_token_ids)))
    followups = iter([_FOLLOW_UP, _THIRD])
    conversation: list[dict[str, str]] = []
    requests: list[ChatRequest] = []
    rounds = _chat_rounds(system_prompt)
    for r, round_ in enumerate(rounds, start=1):
        batch: list[tuple[str, list[dict[str, str]]]] = []
        for label, messages in round_:
            if messages is None:
                messages = conversation + [{"role": "user", "content": next(followups)}]
            batch.append((label, messages))
        outs = generate_with_progress(engine, [chat.encode_chat(m) for _, m in batch], sampling,
                                       f"round {r}/{len(rounds)}", progress)
        for (label, messages), out in zip(batch, outs, strict=True):
            replies = [chat.decode(s.token_ids).strip() for s in out.outputs]
            requests.append(ChatRequest(r, label, messages, out, replies))
            if label.startswith("turn"):
                conversation = messages + [{"role": "assistant", "content": replies[0]}]
    return ChatDemoResult(chat.name, requests, engine.stats, engine.describe())


def render_chat_demo(result: ChatDemoResult, console: Any = None) -> None:
    """Print each request (its hit rate, new user message and replies), then the cache
    statistics and layout."""
    from rich.console import Console

    console = console or Console()
    console.print(f"model: {result.model_name}", markup=False, highlight=False)
    for req in result.requests:
        out = req.output
        console.print(
            f"\nround {req.round}  {out.request_id}  {req.label}: prompt {len(out.prompt_token_ids)} "
            f"tokens, {out.num_cached_tokens} cached, hit rate {req.hit_rate:.1%}",
            markup=False, highlight=False)
        console.print(f"  user: {req.messages[-1]['content']}", markup=False, highlight=False)
        for s, reply in zip(out.outputs, req.replies, strict=True):
            tag = "assistant" if len(out.outputs) == 1 else f"assistant #{s.index}"
            console.print(f"  {tag}: {reply}  ({s.finish_reason}, {len(s.token_ids)} tokens)",
                          markup=False, highlight=False)
    console.print()
    _render_stats_and_layout(result.stats, result.layout, console)


def _render_stats_and_layout(stats: EngineStats, layout: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(title="cache statistics")
    table.add_column("counter")
    table.add_column("value", justify="right")
    for key, value in stats.as_dict().items():
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    groups = Table(title="cache layout")
    groups.add_column("group", justify="right")
    groups.add_column("window", justify="right")
    groups.add_column("layers")
    for g, (window, layers) in enumerate(layout["groups"]):
        groups.add_row(str(g), "full" if window is None else "state" if window == 0 else str(window),
                       ", ".join(map(str, layers)))
    console.print(groups)
    console.print(
        f"{layout['num_blocks']} blocks of {layout['block_size']} tokens, "
        f"{layout['num_slots']} layer slot(s), {layout['bytes_per_block']} bytes "
        f"per block, {layout['padding_layers']} padding slot(s)")


def run_chat_cli(args: argparse.Namespace, device: torch.device | str | None = None) -> int:
    """``kvstore generate --model smollm2``: load the packaged GGUF chat model, run
    :func:`run_chat_demo` with the parsed options, print it. Returns 2 with a message on
    stderr when the model's packages are missing, ``--checkpoint`` is given too, the backend
    cannot run on ``device`` or the pool cannot hold a request."""
    from kvstore.errors import RequestTooLargeError
    from kvstore.models.chat import load_gguf_chat_model, smollm2_gguf_path

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if getattr(args, "checkpoint", None):
        print(f"kvstore generate: --checkpoint and --model {args.model} exclude each other",
              file=sys.stderr)
        return 2
    if (args.backend == "triton" and device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        print(f"kvstore generate: --backend triton needs a CUDA device (this run is on {device})",
              file=sys.stderr)
        return 2
    progress = Progress(sys.stderr)
    try:
        chat = load_gguf_chat_model(smollm2_gguf_path(), device=device, progress=progress.stage)
    except ImportError as e:
        print(f"kvstore generate: {e}", file=sys.stderr)
        return 2
    sampling = SamplingParams(
        max_tokens=args.max_tokens if args.max_tokens is not None else CHAT_MAX_TOKENS,
        n=args.n, temperature=args.temperature, seed=args.seed)
    try:
        result = run_chat_demo(chat, sampling, engine_config(args), progress=progress,
                               device=device)
    except RequestTooLargeError as e:
        progress.end()
        print(f"kvstore generate: --num-blocks {args.num_blocks} is too small: {e}", file=sys.stderr)
        return 2
    progress.stage("done")
    render_chat_demo(result)
    return 0
