"""The default name under which an engine's blocks are stored in the tiers: a digest of
everything that decides the K/V bytes of a block."""

from __future__ import annotations

import dataclasses
import json

import torch
import xxhash

__all__ = ["model_fingerprint"]


def model_fingerprint(model: torch.nn.Module, block_size: int | None = None) -> str:
    """A name for what the K/V of a model's blocks depend on: its class, its whole
    configuration (RoPE base and scaling, norm epsilon and style, attention scaling and
    softcaps, windows, sinks, compute dtype, ...), ``block_size`` when given, and an
    XXH3-128 over its parameters and buffers (names, shapes, dtypes, bytes). Engines share
    tier keys only when these are equal."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool)
                                   or block_size < 1):
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    h = xxhash.xxh3_128()
    config = getattr(model, "config", None)
    described = dataclasses.asdict(config) if dataclasses.is_dataclass(config) and \
        not isinstance(config, type) else repr(config)
    h.update(json.dumps({"class": f"{type(model).__module__}.{type(model).__qualname__}",
                         "config": described, "block_size": block_size},
                        sort_keys=True, default=str).encode())
    state: dict[str, torch.Tensor] = model.state_dict()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        t = t.contiguous().cpu()
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return f"{type(model).__name__}:{h.hexdigest()}"
