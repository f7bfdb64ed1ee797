"""The host tier (CPU memory with its own byte capacity and LRU order) and the batched
transfers between device pages and packed host buffers.

The tier itself stores encoded values and imports no torch; the transfer functions import
torch when called."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.tiers.base import StoreItem, TierStats, check_items, check_keys, leading_run
from kvstore.tiers.codec import BlockLayout, Buffer, encode_block

if TYPE_CHECKING:
    import torch

    from kvstore.paged_kv_cache import PagedKVCache

EvictFn = Callable[[list[StoreItem]], None]


class HostTier:
    """Encoded block values in CPU memory, at most ``capacity_bytes`` of them (values only),
    least recently loaded or stored evicted first. ``on_evict`` receives what is evicted
    (a write-back hook, e.g. into a shared store's ``store``). Thread-safe.

    The LRU order here is a stand-in: once the block pool has its eviction-policy seam, the
    host tier should take its order from that policy."""

    name = "host"

    def __init__(self, capacity_bytes: int, *, on_evict: EvictFn | None = None) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._nbytes = 0

    @property
    def num_bytes(self) -> int:
        """Bytes of the values held."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._values)

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are held without a gap (order unchanged)."""
        check_keys(keys)
        with self._lock:
            return leading_run([k in self._values for k in keys])

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The held value of each key (None where absent); a hit becomes most recent."""
        check_keys(keys)
        out: list[Buffer | None] = []
        with self._lock:
            for k in keys:
                v = self._values.get(k)
                if v is not None:
                    self._values.move_to_end(k)
                out.append(v)
        hits = sum(v is not None for v in out)
        self.stats.merge({"gets": len(keys), "get_hits": hits})
        return out

    def store(self, items: Sequence[StoreItem]) -> None:
        """Copy the values in as most recent, evicting the least recent to make room; a value
        larger than the whole capacity is dropped and counted."""
        check_items(items)
        evicted: list[StoreItem] = []
        dropped = 0
        with self._lock:
            for key, value in items:
                data = value if isinstance(value, bytes) else bytes(value)
                old = self._values.pop(key, None)
                if old is not None:
                    self._nbytes -= len(old)
                if len(data) > self.capacity_bytes:
                    dropped += 1
                    continue
                while self._nbytes + len(data) > self.capacity_bytes:
                    k, v = self._values.popitem(last=False)
                    self._nbytes -= len(v)
                    evicted.append((k, v))
                self._values[key] = data
                self._nbytes += len(data)
        self.stats.merge({"stores": len(items) - dropped, "dropped_stores": dropped,
                          "evictions": len(evicted)})
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop these keys; returns how many were held."""
        check_keys(keys)
        n = 0
        with self._lock:
            for k in keys:
                v = self._values.pop(k, None)
                if v is not None:
                    self._nbytes -= len(v)
                    n += 1
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Stores are synchronous: always True."""
        return True

    def close(self) -> None:
        """Drop everything held."""
        with self._lock:
            self._values.clear()
            self._nbytes = 0


# --- device pages <-> packed host buffers -------------------------------------------------

# Bytes of device staging used per chunk of a gather or scatter on an accelerator.
_STAGING_BYTES = 256 << 20


def _group_slots(cache: PagedKVCache, group_id: int) -> int:
    groups = cache.config.groups
    if not isinstance(group_id, int) or isinstance(group_id, bool) or not 0 <= group_id < len(groups):
        raise ValueError(f"group_id must be in [0, {len(groups)}), got {group_id!r}")
    return len(groups[group_id].layer_ids)


def block_payload_nbytes(cache: PagedKVCache, group_id: int) -> int:
    """Bytes of one block of one group packed: K and V of each of its layers."""
    page = cache.key_caches[0][0]
    return 2 * _group_slots(cache, group_id) * page.numel() * page.element_size()


def _block_index(cache: PagedKVCache, block_ids: Sequence[int], unique: bool) -> list[int]:
    ids = list(block_ids)
    nb = cache.config.num_blocks
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool) or not 1 <= b < nb:
            raise ValueError(f"block ids must be ints in [1, {nb}) (0 is the null block), got {b!r}")
    if unique and len(set(ids)) != len(ids):
        dup = sorted({b for b in ids if ids.count(b) > 1})
        raise ValueError(f"block ids repeat: {dup}")
    return ids


def host_buffer(num_blocks: int, nbytes_per_block: int, *, pin: bool | None = None) -> torch.Tensor:
    """An uninitialized uint8 host tensor ``[num_blocks, nbytes_per_block]``, pinned when
    ``pin`` (default: when CUDA is available)."""
    import torch

    if pin is None:
        pin = torch.cuda.is_available()
    return torch.empty((num_blocks, nbytes_per_block), dtype=torch.uint8, pin_memory=bool(pin))


def _check_buffer(buf: torch.Tensor, n: int, nbytes: int, what: str) -> None:
    import torch

    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.device.type != "cpu":
        raise ValueError(f"{what} must be a uint8 CPU tensor")
    if tuple(buf.shape) != (n, nbytes) or not buf.is_contiguous():
        raise ValueError(f"{what} must be a contiguous [{n}, {nbytes}] tensor, got "
                         f"{list(buf.shape)}{'' if buf.is_contiguous() else ' (not contiguous)'}")


def gather_blocks(cache: PagedKVCache, group_id: int, block_ids: Sequence[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack blocks of one group into host memory: row i of the returned uint8 tensor
    ``[len(block_ids), block_payload_nbytes]`` is block ``block_ids[i]``, laid out as layer
    (in the group's order), then K before V, then the page ``[block_size, heads, dim]``.
    Writes into ``out`` when given; a new buffer is pinned when the cache is on CUDA."""
    import torch

    ids = _block_index(cache, block_ids, unique=False)
    L = _group_slots(cache, group_id)
    P = block_payload_nbytes(cache, group_id)
    n = len(ids)
    if out is None:
        out = host_buffer(n, P, pin=cache.device.type == "cuda")
    else:
        _check_buffer(out, n, P, "out")
    if n == 0:
        return out
    nb = cache.config.num_blocks
    dst = out.view(cache.dtype).view(n, L, 2, -1)
    if cache.device.type == "cpu":
        idx = torch.as_tensor(ids, dtype=torch.long)
        for j in range(L):
            for kv, caches in enumerate((cache.key_caches, cache.value_caches)):
                torch.index_select(caches[j].view(nb, -1), 0, idx, out=dst[:, j, kv])
        return out
    chunk = max(1, _STAGING_BYTES // P)
    idx_all = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    for s in range(0, n, chunk):
        idx = idx_all[s:s + chunk]
        staging = torch.empty((len(idx), L, 2, dst.shape[-1]), dtype=cache.dtype, device=cache.device)
        for j in range(L):
            staging[:, j, 0] = cache.key_caches[j].view(nb, -1)[idx]
            staging[:, j, 1] = cache.value_caches[j].view(nb, -1)[idx]
        dst[s:s + len(idx)].copy_(staging, non_blocking=True)
    torch.cuda.current_stream(cache.device).synchronize()
    return out


def scatter_blocks(cache: PagedKVCache, group_id: int, block_ids: Sequence[int],
                   packed: torch.Tensor) -> None:
    """Unpack rows of ``packed`` (as ``gather_blocks`` lays them out) into pages
    ``block_ids`` of one group; the ids must be distinct. On CUDA the copies are queued on
    the current stream (a forward queued after them sees the pages)."""
    import torch

    ids = _block_index(cache, block_ids, unique=True)
    L = _group_slots(cache, group_id)
    P = block_payload_nbytes(cache, group_id)
    n = len(ids)
    _check_buffer(packed, n, P, "packed")
    if n == 0:
        return
    nb = cache.config.num_blocks
    if cache.device.type == "cpu":
        # numpy's fancy assignment copies whole rows; torch's CPU index_copy_ goes element-wise
        rows = packed.numpy().reshape(n, L, 2, -1)
        where = torch.as_tensor(ids, dtype=torch.long).numpy()
        for j in range(L):
            for kv, caches in enumerate((cache.key_caches, cache.value_caches)):
                caches[j].view(nb, -1).view(torch.uint8).numpy()[where] = rows[:, j, kv]
        return
    chunk = max(1, _STAGING_BYTES // P)
    idx_all = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    for s in range(0, n, chunk):
        idx = idx_all[s:s + chunk]
        staging = packed[s:s + len(idx)].to(cache.device, non_blocking=True)
        src_t = staging.view(cache.dtype).view(len(idx), L, 2, -1)
        for j in range(L):
            cache.key_caches[j].view(nb, -1).index_copy_(0, idx, src_t[:, j, 0])
            cache.value_caches[j].view(nb, -1).index_copy_(0, idx, src_t[:, j, 1])


def stack_payloads(payloads: Sequence[Buffer], nbytes: int, *, pin: bool | None = None) -> torch.Tensor:
    """Copy payloads (e.g. from ``decode_block``) into one host buffer ``[n, nbytes]`` for
    ``scatter_blocks``."""
    import numpy as np

    buf = host_buffer(len(payloads), nbytes, pin=pin)
    arr = buf.numpy()
    for i, p in enumerate(payloads):
        view = memoryview(p).cast("B")
        if view.nbytes != nbytes:
            raise ValueError(f"payload {i} is {view.nbytes} bytes, expected {nbytes}")
        arr[i] = np.frombuffer(view, dtype=np.uint8)
    return buf


def offload_items(cache: PagedKVCache, layout: BlockLayout, group_id: int, block_ids: Sequence[int],
                  keys: Sequence[bytes], token_ids: Sequence[Sequence[int]]) -> list[StoreItem]:
    """Gather blocks of one group and encode each as a tier value: (key, value) items ready
    for any tier's ``store``."""
    if not len(block_ids) == len(keys) == len(token_ids):
        raise ValueError(f"got {len(block_ids)} block ids, {len(keys)} keys, {len(token_ids)} token lists")
    P = block_payload_nbytes(cache, group_id)
    if P != layout.payload_nbytes:
        raise ValueError(f"layout packs {layout.payload_nbytes} bytes per block, group {group_id} "
                         f"of this cache holds {P}")
    packed = gather_blocks(cache, group_id, block_ids).numpy()
    return [(k, encode_block(layout, k, t, packed[i]))
            for i, (k, t) in enumerate(zip(keys, token_ids, strict=True))]


def restore_payloads(cache: PagedKVCache, group_id: int, block_ids: Sequence[int],
                     payloads: Sequence[Buffer]) -> None:
    """Write verified payloads (``load_verified``'s result) into pages ``block_ids``."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids but {len(payloads)} payloads")
    P = block_payload_nbytes(cache, group_id)
    if cache.device.type != "cpu":  # one pinned buffer, then one async copy per chunk
        scatter_blocks(cache, group_id, block_ids, stack_payloads(payloads, P, pin=True))
        return
    import numpy as np
    import torch

    ids = _block_index(cache, block_ids, unique=True)
    L = _group_slots(cache, group_id)
    nb = cache.config.num_blocks
    pages = [[c[j].view(nb, -1).view(torch.uint8).numpy() for c in (cache.key_caches, cache.value_caches)]
             for j in range(L)]
    rows = []
    for i, p in enumerate(payloads):
        view = memoryview(p).cast("B")
        if view.nbytes != P:
            raise ValueError(f"payload {i} is {view.nbytes} bytes, expected {P}")
        rows.append(np.frombuffer(view, dtype=np.uint8).reshape(L, 2, -1))
    for b, row in zip(ids, rows, strict=True):  # straight from the values: no staging copy
        for j in range(L):
            pages[j][0][b] = row[j, 0]
            pages[j][1][b] = row[j, 1]
