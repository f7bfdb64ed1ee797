"""Engine configs from one flat set of keyword arguments, for tests that vary a few."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvstore.engine.engine import EngineConfig, TierConfig
from kvstore.kv_cache_manager import CacheConfig

_CACHE = {f.name for f in fields(CacheConfig)}
_TIERS = {f.name for f in fields(TierConfig)}


def engine_config(**kw: Any) -> EngineConfig:
    """An EngineConfig whose CacheConfig and TierConfig (made when a tier field is given
    and not None) fields are taken from the same keyword arguments as its own."""
    cache = {k: kw.pop(k) for k in list(kw) if k in _CACHE}
    tiers = {k: v for k in list(kw) if k in _TIERS and (v := kw.pop(k)) is not None}
    return EngineConfig(cache=CacheConfig(**cache), tiers=TierConfig(**tiers) if tiers else None,
                        **kw)
