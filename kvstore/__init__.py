"""kvstore: a prefix-caching, paged KV-cache store with hybrid attention support.

The bookkeeping core (pool, managers, coordinator, specs, requests) imports neither torch
nor Triton; ``PagedKVCache``, the device side, loads them on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, CacheStats, KVCacheEvent
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.request import Request
from kvstore.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

if TYPE_CHECKING:
    from kvstore.paged_kv_cache import PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "ComputedBlocks",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "PagedKVCache",
    "Request",
    "SlidingWindowSpec",
    "make_kv_cache_config",
]


def __getattr__(name: str) -> Any:
    if name == "PagedKVCache":
        from kvstore.paged_kv_cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
