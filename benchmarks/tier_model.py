"""Payload-free tiers for replaying workloads without device tensors (``kvstore bench``):
placeholder values, ``ModelTier`` and ``PlaceholderConnector``. Imports no torch."""

from __future__ import annotations

import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import xxhash

from kvstore.specs import KVCacheConfig
from kvstore.tiers.base import StoreItem, TierStats, check_items, check_keys, leading_run
from kvstore.tiers.codec import KEY_NBYTES, BlockLayout, Buffer
from kvstore.tiers.connector import PendingLoad, PendingOffload, TierConnector, TierHit

if TYPE_CHECKING:
    from kvstore.paged_kv_cache import PagedKVCache

PLACEHOLDER_MAGIC = b"KVP1"
# magic, layout digest, key, bytes of the real value, token count
_HEAD = struct.Struct("<4s16s32sQI")
_CHECK_NBYTES = 8
_EMPTY = memoryview(b"")


def encode_placeholder(layout: BlockLayout, key: bytes, token_ids: Sequence[int]) -> bytes:
    """A placeholder value for the block ``token_ids`` of ``layout`` under ``key``."""
    if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
        raise ValueError(f"key must be {KEY_NBYTES} bytes (from block_key), got {key!r:.60}")
    if len(token_ids) != layout.block_size:
        raise ValueError(f"a block holds {layout.block_size} tokens, got {len(token_ids)}")
    body = _HEAD.pack(PLACEHOLDER_MAGIC, layout.digest, key, layout.value_nbytes,
                      layout.block_size) + array("q", token_ids).tobytes()
    return body + xxhash.xxh3_64_digest(body)


def placeholder_nbytes(value: Buffer) -> int:
    """The size of the real value a placeholder stands for (the length of anything else)."""
    view = memoryview(value).cast("B")
    if view.nbytes >= _HEAD.size and bytes(view[:4]) == PLACEHOLDER_MAGIC:
        return int(_HEAD.unpack_from(view)[3])
    return view.nbytes


def decode_placeholder(layout: BlockLayout, key: bytes, token_ids: Sequence[int],
                       value: Buffer | None, counters: dict[str, int] | None = None
                       ) -> memoryview | None:
    """An empty payload when ``value`` is this key's intact placeholder for ``token_ids``;
    otherwise None and one count under the reason (``decode_block``'s names). Never raises."""
    reason = _verify(layout, key, token_ids, value)
    if reason is None:
        return _EMPTY
    if counters is not None:
        counters[reason] = counters.get(reason, 0) + 1
    return None


def _verify(layout: BlockLayout, key: bytes, token_ids: Sequence[int], value: Buffer | None) -> str | None:
    if value is None:
        return "miss"
    view = memoryview(value).cast("B")
    if view.nbytes != _HEAD.size + 8 * layout.block_size + _CHECK_NBYTES:
        return "wrong_size"
    magic, digest, stored_key, nbytes, n_tokens = _HEAD.unpack_from(view)
    if magic != PLACEHOLDER_MAGIC:
        return "bad_header"
    if n_tokens != layout.block_size or nbytes != layout.value_nbytes:
        return "wrong_size"
    if digest != layout.digest:
        return "wrong_layout"
    if stored_key != key:
        return "wrong_key"
    try:
        expected = array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        return "wrong_tokens"
    if len(token_ids) != layout.block_size or view[_HEAD.size:-_CHECK_NBYTES] != expected:
        return "wrong_tokens"
    if xxhash.xxh3_64_digest(view[:-_CHECK_NBYTES]) != bytes(view[-_CHECK_NBYTES:]):
        return "bad_checksum"
    return None


class ModelTier:
    """An in-process LRU tier whose capacity (``None``: unbounded) is charged the size of the
    real value each placeholder stands for (``placeholder_nbytes``). Thread-safe."""

    def __init__(self, capacity_bytes: int | None, *, name: str = "model") -> None:
        if capacity_bytes is not None and (not isinstance(capacity_bytes, int)
                                           or isinstance(capacity_bytes, bool) or capacity_bytes < 0):
            raise ValueError(f"capacity_bytes must be a non-negative int or None, got {capacity_bytes!r}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, tuple[bytes, int]] = OrderedDict()
        self._nbytes = 0

    @property
    def num_bytes(self) -> int:
        """Bytes charged for the values held."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._values)

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are held without a gap (order unchanged)."""
        return leading_run(self.present(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is held (order unchanged)."""
        check_keys(keys)
        with self._lock:
            return [k in self._values for k in keys]

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The held value of each key (None where absent); a hit becomes most recent."""
        check_keys(keys)
        out: list[Buffer | None] = []
        with self._lock:
            for k in keys:
                held = self._values.get(k)
                if held is not None:
                    self._values.move_to_end(k)
                out.append(None if held is None else held[0])
        self.stats.merge({"gets": len(keys), "get_hits": sum(v is not None for v in out)})
        return out

    def store(self, items: Sequence[StoreItem]) -> None:
        """Keep the values as most recent, evicting the least recent (one over capacity: dropped)."""
        check_items(items)
        cap = self.capacity_bytes
        dropped = evicted = 0
        with self._lock:
            for key, value in items:
                data = bytes(value)
                size = placeholder_nbytes(data)
                old = self._values.pop(key, None)
                if old is not None:
                    self._nbytes -= old[1]
                if cap is not None and size > cap:
                    dropped += 1
                    continue
                while cap is not None and self._nbytes + size > cap:
                    self._nbytes -= self._values.popitem(last=False)[1][1]
                    evicted += 1
                self._values[key] = (data, size)
                self._nbytes += size
        self.stats.merge({"stores": len(items) - dropped, "dropped_stores": dropped, "evictions": evicted})

    def flush(self, timeout: float | None = None) -> bool:
        """True: stores are synchronous."""
        return True

    def close(self) -> None:
        """Drop everything held."""
        with self._lock:
            self._values.clear()
            self._nbytes = 0


class PlaceholderConnector(TierConnector):
    """A ``TierConnector`` over placeholder values: nothing to gather or scatter (``cache``
    may be None); each admitted hit's tokens per tier by request id in ``admitted_tokens``."""

    def __init__(self, config: KVCacheConfig, model_name: str, **options: Any) -> None:
        super().__init__(config, model_name, **options)
        self.stored_keys: list[bytes] = []
        self.admitted_tokens: dict[str, tuple[int, int]] = {}  # request id -> (host, store)

    def decode_value(self, layout: BlockLayout, key: bytes, token_ids: Sequence[int],
                     value: Buffer | None, counters: dict[str, int] | None) -> memoryview | None:
        """``decode_placeholder``."""
        return decode_placeholder(layout, key, token_ids, value, counters)

    def offload_values(self, cache: PagedKVCache | None, off: PendingOffload) -> list[StoreItem]:
        """Placeholder values for the blocks of one offload (``cache`` is not read)."""
        layout = self.layouts[off.group_id]
        self.stored_keys.extend(k for k, s in zip(off.keys, off.to_store, strict=True) if s)
        return [(k, encode_placeholder(layout, k, t)) for k, t in zip(off.keys, off.token_ids, strict=True)]

    def run_loads(self, cache: PagedKVCache | None, loads: Sequence[PendingLoad]) -> None:
        """Count the loads; there are no pages to write."""
        self.stats.loaded_blocks += sum(len(load.block_ids) for load in loads)

    def record_admission(self, hit: TierHit) -> None:
        """Count a hit's tokens per tier, and note them under its request id."""
        host, store = self.stats.host_hit_tokens, self.stats.store_hit_tokens
        super().record_admission(hit)
        self.admitted_tokens[hit.request_id] = (self.stats.host_hit_tokens - host,
                                                self.stats.store_hit_tokens - store)

    def close(self) -> None:
        """Delete the keys this connector wrote to a store that can delete, then close."""
        delete = getattr(self.store, "delete", None)
        if delete is not None:
            for s in range(0, len(self.stored_keys), 1024):
                delete(self.stored_keys[s:s + 1024])
        super().close()
