"""Chained block hashes, rooted per salt: XXH3-128 by default, or a keyed BLAKE2b
(`make_keyed_hash`) for deployments whose prompts come from users they do not trust."""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence

import xxhash

BlockHash = int
HashFn = Callable[[BlockHash, Sequence[int]], BlockHash]

# Bounds of the secret `make_keyed_hash` takes (BLAKE2b keys are at most 64 bytes).
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 64


# Packers of n little-endian int64s, by n (one per block size seen).
_INT64_PACKERS: dict[int, Callable[..., bytes]] = {}


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """XXH3-128 of the parent hash followed by the block's token ids (as int64)."""
    pack = _INT64_PACKERS.get(len(token_ids))
    if pack is None:
        pack = _INT64_PACKERS[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q").pack
    return xxhash.xxh3_128_intdigest(parent.to_bytes(16, "little") + pack(*token_ids))


def check_block_hash(value: object, what: str = "block_hash") -> int:
    """A block hash: an int in [0, 2**128) (ValueError otherwise), as every hash function
    must return."""
    if type(value) is not int or not 0 <= value < 1 << 128:
        raise ValueError(f"{what} must be a 128-bit unsigned int, got {value!r:.60}")
    return value


def make_keyed_hash(secret: bytes) -> HashFn:
    """A block hash keyed by a per-deployment secret: BLAKE2b-128 keyed with `secret` over the
    parent hash and the block's token ids (as int64). Without the secret nobody can predict a
    block's hash, so nobody can craft two prompts whose blocks collide. Pass it to
    `KVCacheManager(hash_fn=...)`; every engine that shares a store must use the same secret.
    ValueError unless the secret is 16 to 64 bytes."""
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"secret must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, got "
                         f"{len(secret)}")
    base = hashlib.blake2b(digest_size=16, key=bytes(secret), person=b"kvstore-block")

    def keyed_hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        """Keyed BLAKE2b-128 of the parent hash followed by the block's token ids (as int64)."""
        h = base.copy()
        h.update(parent.to_bytes(16, "little"))
        h.update(array("q", token_ids).tobytes())
        return int.from_bytes(h.digest(), "little")

    return keyed_hash_block


def root_hash(cache_salt: str | None) -> BlockHash:
    """The parent hash of a request's first block; differs per salt."""
    tag = b"kvstore-root" if cache_salt is None else b"kvstore-salt:" + cache_salt.encode()
    return xxhash.xxh3_128_intdigest(tag)


def root_serial(cache_salt: str | None) -> int:
    """The parent serial of a request's first block: derived from the salt alone, exactly
    (no hash, no table), so two salts never share one and nothing is stored per salt.
    Negative, so it is never a serial the pool hands out (those count up from 1)."""
    if cache_salt is None:
        return -1
    # The leading 0x01 byte keeps salts that differ only in leading NULs apart.
    return -2 - int.from_bytes(b"\x01" + cache_salt.encode(), "big")
