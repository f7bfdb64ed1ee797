"""A minimal engine over kvstore: scheduler, model runner and ``LLMEngine``.

The names below load lazily, so importing ``kvstore.engine.scheduler`` alone (as the
benchmark simulator does) pulls in neither torch nor Triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CompletionOutput": "kvstore.engine.engine",
    "EngineConfig": "kvstore.engine.engine",
    "EngineStats": "kvstore.engine.engine",
    "LLMEngine": "kvstore.engine.engine",
    "RequestOutput": "kvstore.engine.engine",
    "SamplingParams": "kvstore.engine.engine",
    "ModelRunner": "kvstore.engine.runner",
    "ModelRunnerOutput": "kvstore.engine.runner",
    "Scheduler": "kvstore.engine.scheduler",
    "SchedulerConfig": "kvstore.engine.scheduler",
    "SchedulerOutput": "kvstore.engine.scheduler",
    "TierConfig": "kvstore.engine.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvstore.engine' has no attribute {name!r}")
