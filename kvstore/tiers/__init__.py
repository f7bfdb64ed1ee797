"""Tiers below device memory: a host tier and shared stores (Valkey), with their keys,
value format and device-page transfers. Importing this package imports no torch."""

from kvstore.tiers.base import (
    BackgroundWriter,
    StoreItem,
    Tier,
    TierStats,
    extend_hit,
    leading_run,
    load_verified,
)
from kvstore.tiers.codec import (
    REJECT_REASONS,
    BlockLayout,
    Buffer,
    block_key,
    block_keys,
    decode_block,
    encode_block,
    request_keys,
)
from kvstore.tiers.host import (
    HostTier,
    block_payload_nbytes,
    gather_blocks,
    host_buffer,
    offload_items,
    restore_payloads,
    scatter_blocks,
    stack_payloads,
)

__all__ = [
    "REJECT_REASONS",
    "BackgroundWriter",
    "BlockLayout",
    "Buffer",
    "HostTier",
    "StoreItem",
    "Tier",
    "TierStats",
    "block_key",
    "block_keys",
    "block_payload_nbytes",
    "decode_block",
    "encode_block",
    "extend_hit",
    "gather_blocks",
    "host_buffer",
    "leading_run",
    "load_verified",
    "offload_items",
    "request_keys",
    "restore_payloads",
    "scatter_blocks",
    "stack_payloads",
]
