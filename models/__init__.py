"""Small hybrid-attention models and a minimal engine (scheduler + runner) over kvstore.

The engine names are exported lazily, so importing ``models.scheduler`` alone (as the
benchmark simulator does) does not pull in torch, Triton or the kernels.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompletionOutput": "models.engine",
    "EngineStats": "models.engine",
    "LLMEngine": "models.engine",
    "RequestOutput": "models.engine",
    "SamplingParams": "models.engine",
    "ModelRunner": "models.runner",
    "ModelRunnerOutput": "models.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
