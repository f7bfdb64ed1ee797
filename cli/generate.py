"""The `kvstore generate` demo: a tiny model (or a local checkpoint) over built-in prompts
that share prefixes, run through the engine, with the cache statistics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.cli import DEMO_MODELS
from kvstore.engine.engine import EngineStats, LLMEngine, RequestOutput, SamplingParams
from kvstore.models.model import PRESETS, DecoderModel, load_checkpoint_dir


def randomize_weights_(model: DecoderModel, seed: int = 0) -> DecoderModel:
    """Re-initialise every parameter with seeded noise at a scale that gives peaked
    attention and varied tokens (default inits make tiny random models near-uniform)."""
    g = torch.Generator().manual_seed(seed)
    gemma = model.config.gemma_norm
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif "embed_tokens" in name:
                # Gemma scales embeddings by sqrt(hidden): undo it, or the residual stream
                # is all embedding and a tied head keeps predicting the input token.
                scale = model.config.hidden_size ** -0.5 if model.config.scale_embeddings else 1.0
                p.copy_(noise * scale)
            else:
                p.copy_(noise * 2.0 / p.shape[-1] ** 0.5)
    return model


def build_demo_model(name: str = "gemma3", checkpoint: str | None = None, seed: int = 0,
                     device: torch.device | str = "cpu") -> DecoderModel:
    """A tiny random-initialised preset (``llama``, ``mistral``, ``gemma2``, ``gemma3``), or
    the model of a local HF checkpoint dir when ``checkpoint`` is given."""
    if checkpoint is not None:
        return load_checkpoint_dir(checkpoint, device=device)
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {DEMO_MODELS}")
    model = randomize_weights_(DecoderModel(PRESETS[f"tiny_{name}"]()), seed)
    return model.to(device).eval()


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


def run_generate_demo(model: DecoderModel, prompts: Sequence[Sequence[int]],
                      sampling: SamplingParams, model_name: str = "", **engine_kwargs: Any
                      ) -> DemoResult:
    """Run the first prompt alone, then the rest as one batch (which hit its cached
    prefix), on a fresh engine built with ``engine_kwargs``."""
    engine = LLMEngine(model, **engine_kwargs)
    outputs = engine.generate(prompts[:1], sampling) + engine.generate(prompts[1:], sampling)
    return DemoResult(model_name, outputs, engine.stats, engine.describe())


def render_demo(result: DemoResult, console: Any = None) -> None:
    """Print the demo's per-prompt outputs, cache statistics and layout as rich tables."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    outs = Table(title=f"generated tokens ({result.model_name})")
    for col in ("request", "prompt", "cached", "sample", "tokens", "finish"):
        outs.add_column(col, justify="right" if col in ("prompt", "cached", "sample") else "left")
    for out in result.outputs:
        for s in out.outputs:
            outs.add_row(out.request_id, str(len(out.prompt_token_ids)),
                         str(out.num_cached_tokens), str(s.index),
                         " ".join(map(str, s.token_ids)), s.finish_reason or "")
    console.print(outs)
    stats = Table(title="cache statistics")
    stats.add_column("counter")
    stats.add_column("value", justify="right")
    for key, value in result.stats.as_dict().items():
        stats.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(stats)
    layout = Table(title="cache layout")
    layout.add_column("group", justify="right")
    layout.add_column("window", justify="right")
    layout.add_column("layers")
    for g, (window, layers) in enumerate(result.layout["groups"]):
        layout.add_row(str(g), "full" if window is None else str(window),
                       ", ".join(map(str, layers)))
    console.print(layout)
    console.print(
        f"{result.layout['num_blocks']} blocks of {result.layout['block_size']} tokens, "
        f"{result.layout['num_slots']} layer slot(s), {result.layout['bytes_per_block']} bytes "
        f"per block, {result.layout['padding_layers']} padding slot(s)")
