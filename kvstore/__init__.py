"""kvstore: a prefix-caching, paged KV-cache store with hybrid attention support.

The bookkeeping core (pool, managers, coordinator, specs, requests) imports neither torch
nor Triton; ``PagedKVCache``, the device side, loads them on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.block_pool import (
    AllBlocksCleared,
    BlockRemoved,
    BlockState,
    BlockStored,
    CacheStats,
    KVCacheEvent,
)
from kvstore.errors import RequestTooLargeError
from kvstore.hashing import BlockHash, HashFn, hash_block, make_keyed_hash
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import (
    BlockIds,
    CacheConfig,
    CopyBatch,
    KVCacheManager,
    ReleasedPages,
)
from kvstore.request import Request
from kvstore.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MLASpec,
    SlidingWindowSpec,
    make_kv_cache_config,
)

if TYPE_CHECKING:
    from kvstore.paged_kv_cache import PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHash",
    "BlockIds",
    "BlockRemoved",
    "BlockState",
    "BlockStored",
    "CacheStats",
    "ChunkedLocalAttentionSpec",
    "ComputedBlocks",
    "FullAttentionSpec",
    "HashFn",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroup",
    "CacheConfig",
    "CopyBatch",
    "KVCacheManager",
    "KVCacheSpec",
    "MLASpec",
    "PagedKVCache",
    "ReleasedPages",
    "Request",
    "RequestTooLargeError",
    "SlidingWindowSpec",
    "hash_block",
    "make_keyed_hash",
    "make_kv_cache_config",
]


def __getattr__(name: str) -> Any:
    if name == "PagedKVCache":
        from kvstore.paged_kv_cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
