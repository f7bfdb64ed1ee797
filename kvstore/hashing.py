"""Chained block hashes: XXH3-128 over (parent hash, the block's token ids), rooted per salt."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

import xxhash

BlockHash = int
HashFn = Callable[[BlockHash, Sequence[int]], BlockHash]


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """XXH3-128 of the parent hash followed by the block's token ids (as int64)."""
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + array("q", token_ids).tobytes())


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a request's first block; differs per salt."""
    tag = b"kvstore-root" if cache_salt is None else b"kvstore-salt:" + cache_salt.encode()
    return xxhash.xxh3_128_intdigest(tag)
