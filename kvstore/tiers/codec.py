"""Tier keys and values: what identifies one block of one group (or, for a recurrent group,
one checkpoint) outside device memory, and the self-checking byte format it is stored in.
Imports no torch."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from array import array
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import cached_property
from typing import TypeAlias, TypeVar

import xxhash

from kvstore.hashing import BlockHash, check_block_hash, root_hash
from kvstore.specs import (
    DTYPE_ITEMSIZE,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    RecurrentStateSpec,
    SlidingWindowSpec,
)

#: What a tier hands back: anything exposing the buffer protocol.
Buffer: TypeAlias = bytes | bytearray | memoryview

CODEC_VERSION = 1
MAGIC = b"KVT1"
KEY_NBYTES = 32
DIGEST_NBYTES = 16
# magic, version, flags, layout digest, key, num_tokens, payload bytes, checksum (XXH3-128)
_HEADER = struct.Struct("<4sHH16s32sIQ16s")
HEADER_NBYTES = _HEADER.size
_CHECKSUM_OFFSET = HEADER_NBYTES - 16
_TOKEN = "q"  # token ids as int64, little-endian, like the chained hash
#: Header flag: the checksum was not computed (a value that never left this process).
FLAG_UNCHECKED = 1

_T = TypeVar("_T")
_R = TypeVar("_R")
#: Batches of at least this many bytes are checksummed on several threads.
PARALLEL_MIN_NBYTES = 4 << 20
_checksum_pool: ThreadPoolExecutor | None = None


def checksum_threads() -> int:
    """Threads a large batch of values is checksummed on (at most 8, one per core)."""
    return max(1, min(8, os.cpu_count() or 1))


def map_values(fn: Callable[[_T], _R], items: Iterable[_T], nbytes: int) -> list[_R]:
    """``[fn(x) for x in items]``, in order; spread over a shared thread pool when the batch
    holds at least PARALLEL_MIN_NBYTES (XXH3 releases the GIL, so sealing and verifying
    scale with cores: one core hashes about 7 GB/s, under a PCIe 5 link's 50)."""
    global _checksum_pool
    items = list(items)
    if nbytes < PARALLEL_MIN_NBYTES or len(items) < 2 or checksum_threads() == 1:
        return [fn(x) for x in items]
    if _checksum_pool is None:
        _checksum_pool = ThreadPoolExecutor(checksum_threads(), thread_name_prefix="kvstore-xxh3")
    return list(_checksum_pool.map(fn, items))


@dataclass(frozen=True)
class BlockLayout:
    """What the bytes of one block of one group mean: the model, the group's spec (window
    included), the model layers the group holds (two groups with equal specs hold different
    layers), the page shape and dtype. ``extra`` separates anything else that changes the
    bytes (tensor-parallel rank, quantization recipe).

    For a recurrent group (a ``RecurrentStateSpec``) the unit is one checkpoint: the state
    tensors of every layer of the group at a block boundary, stored under the key of the
    block its prefix ends with, with that block's token ids."""

    model: str
    spec: KVCacheSpec | RecurrentStateSpec
    layer_ids: tuple[int, ...]
    extra: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"BlockLayout.model must be a non-empty str, got {self.model!r}")
        if not isinstance(self.spec, (FullAttentionSpec, SlidingWindowSpec, RecurrentStateSpec)):
            raise TypeError(f"BlockLayout.spec must be a FullAttentionSpec, SlidingWindowSpec or "
                            f"RecurrentStateSpec, got {type(self.spec).__name__}")
        layers = tuple(self.layer_ids)
        if not layers or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers):
            raise ValueError(f"BlockLayout.layer_ids must be non-negative ints, at least one, got "
                             f"{self.layer_ids!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"BlockLayout.layer_ids repeat a layer: {layers}")
        if not isinstance(self.extra, str):
            raise TypeError(f"BlockLayout.extra must be a str, got {type(self.extra).__name__}")
        object.__setattr__(self, "layer_ids", layers)

    @classmethod
    def for_group(cls, model: str, config: KVCacheConfig, group_id: int, extra: str = "") -> BlockLayout:
        """The layout of group ``group_id`` of a cache config."""
        if not isinstance(group_id, int) or not 0 <= group_id < len(config.groups):
            raise ValueError(f"group_id must be in [0, {len(config.groups)}), got {group_id!r}")
        group = config.groups[group_id]
        spec = group.spec
        if not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec, RecurrentStateSpec)):
            raise ValueError(f"group {group_id} has a {type(spec).__name__}: tiers do not hold it")
        return cls(model, spec, group.layer_ids, extra)

    @property
    def is_recurrent(self) -> bool:
        """Whether a value holds a checkpoint (a recurrent group's states), not K/V pages."""
        return isinstance(self.spec, RecurrentStateSpec)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self.spec.block_size

    @property
    def num_layers(self) -> int:
        """Layers packed in one value."""
        return len(self.layer_ids)

    @cached_property
    def page_nbytes(self) -> int:
        """Bytes of one K (or one V) page of one layer; for a recurrent group, of one
        layer's state (every state tensor)."""
        s = self.spec
        if isinstance(s, RecurrentStateSpec):
            return s.state_bytes
        return s.block_size * s.num_kv_heads * s.head_dim * DTYPE_ITEMSIZE[s.dtype]

    @cached_property
    def payload_nbytes(self) -> int:
        """Bytes of the packed K and V pages of every layer of one block; for a recurrent
        group, of the states of every layer."""
        return (1 if self.is_recurrent else 2) * self.num_layers * self.page_nbytes

    @cached_property
    def value_nbytes(self) -> int:
        """Bytes of one encoded value: header, token ids, payload."""
        return HEADER_NBYTES + 8 * self.block_size + self.payload_nbytes

    @cached_property
    def digest(self) -> bytes:
        """16-byte BLAKE2b digest of everything that gives the payload its meaning: the
        model, every field of the spec, the layers and the packing."""
        s = self.spec
        spec = {f.name: getattr(s, f.name) for f in fields(s)}
        packing = "layer,state" if isinstance(s, RecurrentStateSpec) else "block,layer,kv,token,head,dim"
        desc = {"codec": CODEC_VERSION, "model": self.model, "kind": type(s).__name__,
                "spec": spec, "layer_ids": list(self.layer_ids), "packing": packing,
                "extra": self.extra}
        text = json.dumps(desc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(text, digest_size=DIGEST_NBYTES, person=b"kvstore-layout").digest()


def _check_hash(value: int, what: str) -> bytes:
    return check_block_hash(value, what).to_bytes(16, "little")


def block_key(layout: BlockLayout, block_hash: BlockHash, salt_root: BlockHash,
              key_secret: bytes | None = None) -> bytes:
    """The 32-byte key of one block of one group: BLAKE2b-256 over the block's chained hash,
    the layout digest and the salt's root hash, keyed with ``key_secret`` when given (then
    nobody without it can tell which key a given prompt has). It carries no token ids."""
    if key_secret is not None and (not isinstance(key_secret, bytes) or not 16 <= len(key_secret) <= 64):
        raise ValueError("key_secret must be 16 to 64 bytes or None")
    h = hashlib.blake2b(digest_size=KEY_NBYTES, person=b"kvstore-tierkey", key=key_secret or b"")
    h.update(_check_hash(block_hash, "block_hash"))
    h.update(layout.digest)
    h.update(_check_hash(salt_root, "salt_root"))
    return h.digest()


def block_keys(layout: BlockLayout, block_hashes: Sequence[BlockHash], salt_root: BlockHash,
               key_secret: bytes | None = None) -> list[bytes]:
    """Keys of consecutive blocks of one chain, in order."""
    return [block_key(layout, h, salt_root, key_secret) for h in block_hashes]


def request_keys(layout: BlockLayout, block_hashes: Sequence[BlockHash],
                 cache_salt: str | None, key_secret: bytes | None = None) -> list[bytes]:
    """Keys of a request's full blocks, from its ``block_hashes`` and ``cache_salt``."""
    return block_keys(layout, block_hashes, root_hash(cache_salt), key_secret)


def _token_bytes(layout: BlockLayout, token_ids: Sequence[int]) -> bytes:
    if len(token_ids) != layout.block_size:
        raise ValueError(f"a block holds {layout.block_size} tokens, got {len(token_ids)} token ids")
    try:
        return array(_TOKEN, token_ids).tobytes()
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"token ids must be ints in the int64 range: {exc}") from None


def encode_block(layout: BlockLayout, key: bytes, token_ids: Sequence[int], payload: Buffer) -> bytes:
    """One value: header (magic, version, layout digest, key, sizes, XXH3-128 checksum), the
    block's token ids (int64) and the packed payload of ``layout.payload_nbytes`` bytes."""
    if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
        raise ValueError(f"key must be {KEY_NBYTES} bytes (from block_key), got {key!r:.60}")
    tokens = _token_bytes(layout, token_ids)
    body = memoryview(payload).cast("B")
    if body.nbytes != layout.payload_nbytes:
        raise ValueError(f"payload is {body.nbytes} bytes, the layout packs {layout.payload_nbytes}")
    head = _HEADER.pack(MAGIC, CODEC_VERSION, 0, layout.digest, key, layout.block_size,
                        body.nbytes, b"\0" * 16)[:_CHECKSUM_OFFSET]
    check = xxhash.xxh3_128()
    for part in (head, tokens, body):
        check.update(part)
    return b"".join((head, check.digest(), tokens, body))  # the payload is copied once


def seal_block(layout: BlockLayout, key: bytes, token_ids: Sequence[int], value: memoryview,
               checksum: bool = True) -> None:
    """Write the header (checksum included) and token ids into ``value``, a writable
    ``layout.value_nbytes`` buffer whose payload (from ``HEADER_NBYTES + 8 * block_size``)
    is already in place: the bytes ``encode_block`` would return for that payload. Without
    ``checksum`` the header is flagged ``FLAG_UNCHECKED`` instead (for a value that stays in
    this process: only ``decode_block(..., trusted=True)`` accepts it, and
    ``checked_copy`` makes it a value any reader accepts)."""
    if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
        raise ValueError(f"key must be {KEY_NBYTES} bytes (from block_key), got {key!r:.60}")
    if value.nbytes != layout.value_nbytes:
        raise ValueError(f"value buffer is {value.nbytes} bytes, the layout needs {layout.value_nbytes}")
    tokens = _token_bytes(layout, token_ids)
    _HEADER.pack_into(value, 0, MAGIC, CODEC_VERSION, 0 if checksum else FLAG_UNCHECKED, layout.digest,
                      key, layout.block_size, layout.payload_nbytes, b"\0" * 16)
    value[HEADER_NBYTES:HEADER_NBYTES + len(tokens)] = tokens
    if not checksum:
        return
    check = xxhash.xxh3_128()
    check.update(value[:_CHECKSUM_OFFSET])
    check.update(value[HEADER_NBYTES:])
    value[_CHECKSUM_OFFSET:HEADER_NBYTES] = check.digest()


def checked_copy(value: Buffer) -> bytes:
    """A copy of an encoded value with its checksum in place: ``value`` itself when it has
    one, else (``FLAG_UNCHECKED``) the bytes ``encode_block`` makes for it."""
    view = memoryview(value).cast("B")
    if view.nbytes < HEADER_NBYTES or not _HEADER.unpack_from(view)[2] & FLAG_UNCHECKED:
        return bytes(view)
    head = bytearray(view[:_CHECKSUM_OFFSET])
    struct.pack_into("<H", head, 6, _HEADER.unpack_from(view)[2] & ~FLAG_UNCHECKED)
    check = xxhash.xxh3_128()
    check.update(head)
    check.update(view[HEADER_NBYTES:])
    return b"".join((head, check.digest(), view[HEADER_NBYTES:]))


#: Names of the counters decode_block increments, one per way a value can be refused.
REJECT_REASONS = ("wrong_size", "bad_header", "wrong_version", "wrong_layout", "wrong_key",
                  "wrong_tokens", "bad_checksum")


def decode_block(layout: BlockLayout, key: bytes, token_ids: Sequence[int], value: Buffer | None,
                 counters: dict[str, int] | None = None, trusted: bool = False) -> memoryview | None:
    """The payload of ``value`` when it is this key's block of this layout holding exactly
    ``token_ids``, with a checksum that matches; otherwise None and one count in ``counters``
    under the reason (see REJECT_REASONS; ``miss`` for None). Never raises for a bad value.
    ``trusted`` (a value that never left this process) skips the checksum, and only it."""
    reason = _verify(layout, key, token_ids, value, trusted)
    if reason is None:
        assert value is not None
        return memoryview(value).cast("B")[HEADER_NBYTES + 8 * layout.block_size:]
    if counters is not None:
        counters[reason] = counters.get(reason, 0) + 1
    return None


def _verify(layout: BlockLayout, key: bytes, token_ids: Sequence[int], value: Buffer | None,
            trusted: bool = False) -> str | None:
    if value is None:
        return "miss"
    try:
        view = memoryview(value).cast("B")
    except TypeError:  # not a contiguous bytes-like object: no value of this codec
        return "bad_header"
    if view.nbytes != layout.value_nbytes:
        return "wrong_size"
    magic, version, _flags, digest, stored_key, n_tokens, n_payload, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        return "bad_header"
    if version != CODEC_VERSION:
        return "wrong_version"
    if n_tokens != layout.block_size or n_payload != layout.payload_nbytes:
        return "wrong_size"
    if digest != layout.digest:
        return "wrong_layout"
    if stored_key != key:
        return "wrong_key"
    try:
        expected = _token_bytes(layout, token_ids)
    except ValueError:
        return "wrong_tokens"
    if view[HEADER_NBYTES:HEADER_NBYTES + len(expected)] != expected:
        return "wrong_tokens"
    if trusted:
        return None
    check = xxhash.xxh3_128()
    check.update(view[:_CHECKSUM_OFFSET])
    check.update(view[HEADER_NBYTES:])
    if check.digest() != checksum:
        return "bad_checksum"
    return None
