"""kvstore: a prefix-caching, paged KV-cache store with hybrid attention support."""

from kvstore.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, CacheStats
from kvstore.kv_cache_coordinator import ComputedBlocks
from kvstore.kv_cache_manager import KVCacheManager
from kvstore.paged_kv_cache import PagedKVCache
from kvstore.request import Request
from kvstore.specs import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, make_kv_cache_config

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CacheStats",
    "ComputedBlocks",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheManager",
    "PagedKVCache",
    "Request",
    "SlidingWindowSpec",
    "make_kv_cache_config",
]
