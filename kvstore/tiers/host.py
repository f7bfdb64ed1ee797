"""The host tier (encoded values in slots of a few sizes carved from the pages of a
preallocated CPU arena, with its own byte capacity and LRU order) and the batched transfers
between device pages and packed host buffers.

Importing this module imports no torch; the arena and the transfer functions import it
when first used."""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.specs import RecurrentStateSpec
from kvstore.tiers.base import StoreItem, TierStats, check_items, check_keys, leading_run
from kvstore.tiers.codec import (
    HEADER_NBYTES,
    BlockLayout,
    Buffer,
    checked_copy,
    encode_block,
    map_values,
    seal_block,
)

if TYPE_CHECKING:
    import torch

    from kvstore.paged_kv_cache import PagedKVCache

EvictFn = Callable[[list[StoreItem]], None]

# Slots are multiples of this, and a block's payload starts at such an offset in its slot.
_ALIGN = 64
# Bytes of arena allocated at a time (the arena grows up to the capacity, then slots are reused).
_CHUNK_BYTES = 256 << 20


def _payload_offset(layout: BlockLayout) -> int:
    """Where a value starts in its slot, so that its payload starts on an aligned offset."""
    return -(HEADER_NBYTES + 8 * layout.block_size) % _ALIGN


class HostTier:
    """Encoded block values in CPU memory, least recently loaded or stored evicted first.
    Thread-safe.

    Values live in slots of a preallocated uint8 arena (pinned when ``pin``, default: when
    CUDA is available) made of pages of the largest slot size; the arena grows in chunks up
    to ``capacity_bytes // largest`` pages, then reuses them. ``slot_nbytes`` gives the slot
    sizes: one int, or several (``slot_nbytes_for(layout)`` of each layout stored: attention
    blocks and recurrent checkpoints); by default the size of the first value stored. A
    value takes a slot of the smallest size that holds it. A page holds one slot of the
    largest size or is carved into ``largest // size`` slots of a smaller one, so values of
    every size share one byte budget, each in a slot of about its own size. Pages rather
    than a general allocator: O(1) bookkeeping, and views that stay put, as values are
    never moved; the price is that a large value needs a whole page. A value larger than
    every slot is dropped and counted by ``store``; ``store_blocks`` raises ValueError for
    its layout.

    Room for a value: a free slot of its size in a carved page, else a free page (carved for
    it), else eviction in LRU order: the least recent unheld value whose slot has that size
    is evicted and its slot reused; one of another size is evicted with every value of its
    page (pages fill in store order, so those are values of about its age) and the page is
    carved anew. A page with a held slot, or one a ``store_blocks`` under way is filling, is
    not carved anew.

    ``store_blocks`` gathers device pages straight into slots and seals them in place;
    ``load`` returns views of the slots (no copy), valid until the slot is reused: ``hold``
    keeps slots from reuse until ``release``. ``on_evict`` receives copies of what is
    evicted (a write-back hook, e.g. into a shared store's ``store``).

    Its order is its own LRU: the device pool's eviction policies do not reach it.

    Its values never leave this process except as copies (``peek``, ``on_evict``), which
    always carry their checksum: ``store_blocks(..., checksum=False)`` skips the checksum
    pass for values only this process reads (``in_process``)."""

    name = "host"
    #: Values stay in this process's memory: a reader may skip their checksum.
    in_process = True

    def __init__(self, capacity_bytes: int, *, on_evict: EvictFn | None = None,
                 slot_nbytes: int | Sequence[int] | None = None, pin: bool | None = None) -> None:
        if not isinstance(capacity_bytes, int) or isinstance(capacity_bytes, bool) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be a non-negative int, got {capacity_bytes!r}")
        classes = _slot_classes(slot_nbytes)
        self.capacity_bytes = capacity_bytes
        self.stats = TierStats()
        self._on_evict = on_evict
        self._pin = pin
        self._lock = threading.RLock()
        #: The largest slot size: the page the arena is made of (None until known).
        self.slot_nbytes: int | None = None
        self._classes: tuple[int, ...] = ()  # slot sizes, ascending
        self._per_page: tuple[int, ...] = ()  # slots of each size a page holds
        self._ids = 1  # slot ids per page: slot id = page * self._ids + index in the page
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot id, LRU first
        # Per slot id:
        self._start: list[int] = []  # where its value starts in the slot
        self._len: list[int] = []  # its value's length (0: free)
        self._key: list[bytes | None] = []  # the key it holds in the index
        # Per page:
        self._page_class: list[int] = []  # the size (index into _classes) it is carved for; -1: free
        self._page_used: list[int] = []  # slots taken: values, retired views, stores under way
        self._page_free: list[list[int]] = []  # its free slots, when carved into several
        self._free_pages: list[int] = []
        self._partial: list[OrderedDict[int, None]] = []  # per size: carved pages with a free slot
        self._held: dict[int, int] = {}  # slot -> holds
        self._holds: dict[int, _Hold] = {}  # the handles not yet released, by id
        self._retired: set[int] = set()  # held slots whose key was replaced or dropped
        self._unchecked: set[int] = set()  # slots sealed without their checksum
        self._chunks: list[Any] = []  # uint8 tensors [pages, page bytes]
        self._rows: list[Any] = []  # their numpy views
        self._per_chunk = 0
        self._nbytes = 0
        if classes:
            self._set_classes(classes)

    @staticmethod
    def slot_nbytes_for(layout: BlockLayout) -> int:
        """The slot size that holds one value of ``layout`` with its payload aligned."""
        n = _payload_offset(layout) + layout.value_nbytes
        return -(-n // _ALIGN) * _ALIGN

    @property
    def slot_classes(self) -> tuple[int, ...]:
        """The slot sizes, ascending (empty until known); the last is the page."""
        return self._classes

    @property
    def num_slots(self) -> int:
        """Pages the capacity allows, each one slot of the largest size (0 until the slot
        sizes are known)."""
        return self.capacity_bytes // self.slot_nbytes if self.slot_nbytes else 0

    @property
    def num_bytes(self) -> int:
        """Bytes of the values held."""
        return self._nbytes

    @property
    def arena_bytes(self) -> int:
        """Bytes of arena allocated so far."""
        return len(self._page_class) * (self.slot_nbytes or 0)

    def __len__(self) -> int:
        return len(self._index)

    # ---- slots ---------------------------------------------------------------------------------
    def _set_classes(self, classes: tuple[int, ...]) -> None:
        page = classes[-1]
        self.slot_nbytes = page
        self._classes = classes
        self._per_page = tuple(page // c for c in classes)
        self._ids = self._per_page[0]
        self._partial = [OrderedDict() for _ in classes]

    def _class_of(self, nbytes: int) -> int | None:
        """The smallest slot size (its index) that holds ``nbytes``; None if none does."""
        classes = self._classes
        if len(classes) == 1:
            return 0 if nbytes <= classes[0] else None
        i = bisect_left(classes, nbytes)
        return i if i < len(classes) else None

    def _base(self, slot: int) -> tuple[Any, int]:
        """A slot's page (a numpy view of the arena) and where the slot starts in it."""
        page, i = divmod(slot, self._ids)
        row = self._rows[page // self._per_chunk][page % self._per_chunk]
        return row, i * self._classes[self._page_class[page]] if i else 0

    def _view(self, slot: int) -> memoryview:
        """The value held in a slot (a view of the arena)."""
        page, i = divmod(slot, self._ids)
        row = self._rows[page // self._per_chunk][page % self._per_chunk]
        start = self._start[slot] + (i * self._classes[self._page_class[page]] if i else 0)
        return memoryview(row[start:start + self._len[slot]]).cast("B")

    def _copy(self, slot: int) -> bytes:
        """A copy of a slot's value, checksum included."""
        view = self._view(slot)
        return checked_copy(view) if slot in self._unchecked else bytes(view)

    def _grow(self) -> bool:
        """Allocate the next chunk of pages; False at the capacity, or when the chunk cannot
        be allocated (counted ``alloc_errors``; a later call tries again)."""
        total = self.num_slots
        have = len(self._page_class)
        if have >= total:
            return False
        import torch

        assert self.slot_nbytes is not None
        if not self._per_chunk:
            self._per_chunk = max(1, min(total, _CHUNK_BYTES // self.slot_nbytes))
        n = min(self._per_chunk, total - have)  # the last chunk stops at the capacity
        pin = torch.cuda.is_available() if self._pin is None else self._pin
        try:
            chunk = torch.empty((n, self.slot_nbytes), dtype=torch.uint8, pin_memory=bool(pin))
        except (RuntimeError, MemoryError):  # host memory short: the tier stays this size for now
            self.stats.add("alloc_errors")
            return False
        self._chunks.append(chunk)
        self._rows.append(chunk.numpy())
        ids = n * self._ids
        self._start.extend([0] * ids)
        self._len.extend([0] * ids)
        self._key.extend([None] * ids)
        self._page_class.extend([-1] * n)
        self._page_used.extend([0] * n)
        self._page_free.extend([] for _ in range(n))
        self._free_pages.extend(range(have + n - 1, have - 1, -1))
        return True

    def _take(self, c: int) -> int | None:
        """A free slot of size ``c``: in a carved page, else in a free page carved for it."""
        partial = self._partial[c]
        if partial:
            page = next(reversed(partial))
            free = self._page_free[page]
            i = free.pop()
            if not free:
                del partial[page]
            self._page_used[page] += 1
            return page * self._ids + i
        if not self._free_pages and not self._grow():
            return None
        page = self._free_pages.pop()
        self._page_class[page] = c
        self._page_used[page] = 1
        n = self._per_page[c]
        if n > 1:
            self._page_free[page] = list(range(n - 1, 0, -1))
            partial[page] = None
        return page * self._ids

    def _free_slot(self, slot: int) -> None:
        """Return an unheld slot whose value left the index; a page left empty is free again."""
        self._len[slot] = 0
        page, i = divmod(slot, self._ids)
        used = self._page_used[page] - 1
        self._page_used[page] = used
        c = self._page_class[page]
        if used:
            self._page_free[page].append(i)
            self._partial[c][page] = None
            return
        self._page_class[page] = -1
        if self._per_page[c] > 1:
            self._page_free[page] = []
            self._partial[c].pop(page, None)
        self._free_pages.append(page)

    def _evict(self, key: bytes, evicted: list[StoreItem]) -> int:
        """Drop an unheld key's value, handed to ``evicted``; returns its slot, still taken."""
        slot = self._index.pop(key)
        evicted.append((key, self._copy(slot) if self._on_evict is not None else b""))
        self._nbytes -= self._len[slot]
        self._key[slot] = None
        return slot

    def _take_slot(self, c: int, evicted: list[StoreItem]) -> int | None:
        """A free slot of size ``c``, evicting in LRU order when there is none."""
        slot = self._take(c)
        if slot is not None:
            return slot
        ids, held = self._ids, self._held
        for key, s in self._index.items():  # the least recent unheld value that makes room
            if s in held:
                continue
            page = s // ids
            if self._page_class[page] == c:
                return self._evict(key, evicted)  # its slot, reused
            values = self._page_values(page)
            if values is not None:
                break
        else:
            return None  # every slot is held
        for k in values:
            self._free_slot(self._evict(k, evicted))
        return self._take(c)

    def _page_values(self, page: int) -> list[bytes] | None:
        """The keys of a page's values, in slot order; None when the page cannot be carved
        anew (a slot held, or taken by a store under way)."""
        first = page * self._ids
        keys = []
        for s in range(first, first + self._per_page[self._page_class[page]]):
            if s in self._held:
                return None
            k = self._key[s]
            if k is not None:
                keys.append(k)
        return keys if len(keys) == self._page_used[page] else None

    def _unlink(self, key: bytes) -> None:
        """Drop a key's value (its slot is freed, or retired while held)."""
        slot = self._index.pop(key, None)
        if slot is None:
            return
        self._nbytes -= self._len[slot]
        self._key[slot] = None
        if slot in self._held:
            self._retired.add(slot)
        else:
            self._free_slot(slot)

    def _place(self, key: bytes, nbytes: int, start: int, evicted: list[StoreItem]) -> int | None:
        """A slot for a new value of ``key`` (the old one dropped), or None when it cannot fit."""
        self._unlink(key)
        if self.slot_nbytes is None:
            self._set_classes((max(1, start + nbytes),))
        c = self._class_of(start + nbytes)
        if c is None or not self.num_slots:
            return None
        slot = self._take_slot(c, evicted)
        if slot is None:
            return None
        self._start[slot] = start
        self._len[slot] = nbytes
        self._unchecked.discard(slot)
        return slot

    def _publish(self, key: bytes, slot: int) -> None:
        self._index[key] = slot
        self._key[slot] = key
        self._nbytes += self._len[slot]

    def _finish_store(self, stored: int, dropped: int, evicted: list[StoreItem]) -> None:
        self.stats.merge({"stores": stored, "dropped_stores": dropped, "evictions": len(evicted)})
        if evicted and self._on_evict is not None:
            self._on_evict(evicted)

    # ---- the Tier interface --------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are held without a gap (order unchanged)."""
        check_keys(keys)
        with self._lock:
            return leading_run([k in self._index for k in keys])

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is held (order unchanged)."""
        check_keys(keys)
        with self._lock:
            return [k in self._index for k in keys]

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """A view of each key's value (None where absent); a hit becomes most recent. A view
        stays valid until its slot is reused: ``hold`` the keys to use it later."""
        check_keys(keys)
        out: list[Buffer | None] = []
        with self._lock:
            for k in keys:
                slot = self._index.get(k)
                if slot is None:
                    out.append(None)
                    continue
                self._index.move_to_end(k)
                out.append(self._view(slot))
        hits = sum(v is not None for v in out)
        self.stats.merge({"gets": len(keys), "get_hits": hits})
        return out

    def peek(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the keys' values, checksum included (None where absent); order and
        counters unchanged."""
        check_keys(keys)
        with self._lock:
            return [None if (slot := self._index.get(k)) is None else self._copy(slot) for k in keys]

    def store(self, items: Sequence[StoreItem]) -> None:
        """Copy the values into slots as most recent, evicting the least recent to make room;
        a value larger than every slot (or than the capacity) is dropped and counted."""
        items = check_items(items)
        evicted: list[StoreItem] = []
        dropped = 0
        with self._lock:
            for key, value in items:
                view = memoryview(value)
                slot = self._place(key, view.nbytes, 0, evicted)
                if slot is None:
                    dropped += 1
                    continue
                row, base = self._base(slot)
                row[base:base + view.nbytes] = view
                self._publish(key, slot)
        self._finish_store(len(items) - dropped, dropped, evicted)

    def store_blocks(self, cache: PagedKVCache, layout: BlockLayout, group_id: int,
                     block_ids: Sequence[int], keys: Sequence[bytes],
                     token_ids: Sequence[Sequence[int]], checksum: bool = True) -> int:
        """Gather blocks of one group straight into slots and seal each as the value
        ``encode_block`` would make (no intermediate buffer); returns how many were stored.
        Without ``checksum`` the values are sealed unchecked (``seal_block``): for readers in
        this process (``decode_block(..., trusted=True)``); ``peek`` and ``on_evict`` still
        hand out checked copies. ValueError for a layout whose values no slot holds."""
        if not len(block_ids) == len(keys) == len(token_ids):
            raise ValueError(f"got {len(block_ids)} block ids, {len(keys)} keys, "
                             f"{len(token_ids)} token lists")
        check_keys(keys)
        P = block_payload_nbytes(cache, group_id)
        if P != layout.payload_nbytes:
            raise ValueError(f"layout packs {layout.payload_nbytes} bytes per block, group {group_id} "
                             f"of this cache holds {P}")
        _block_index(cache, block_ids, unique=False, group_id=group_id)
        start = _payload_offset(layout)
        off = start + HEADER_NBYTES + 8 * layout.block_size
        V = layout.value_nbytes
        evicted: list[StoreItem] = []
        with self._lock:
            if self.slot_nbytes is None:
                self._set_classes((self.slot_nbytes_for(layout),))
            elif self._class_of(start + V) is None:
                raise ValueError(f"values of this layout need slots of {self.slot_nbytes_for(layout)} "
                                 f"bytes; this host tier's largest slot is {self.slot_nbytes}")
            placed: list[tuple[int, int]] = []  # (slot, i)
            last = {key: i for i, key in enumerate(keys)}
            for i, key in enumerate(keys):
                if last[key] != i:
                    continue  # the last of repeated keys wins, as in store()
                slot = self._place(key, V, start, evicted)
                if slot is not None:
                    placed.append((slot, i))
            placed.sort()
            # Runs of slots lying back to back in one chunk: one gather each.
            where = [self._where(slot) for slot, _ in placed]
            s = 0
            while s < len(placed):
                c, o, size = where[s]
                e = s + 1
                while e < len(placed) and where[e] == (c, o + (e - s) * size, size):
                    e += 1
                rows = self._chunks[c].view(-1)[o:o + (e - s) * size].view(e - s, size)
                _gather_rows(cache, group_id, [block_ids[i] for _, i in placed[s:e]], rows, off, P)
                s = e

            def seal(item: tuple[int, int]) -> None:
                slot, i = item
                row, base = self._base(slot)
                value = memoryview(row[base + start:base + start + V]).cast("B")
                seal_block(layout, keys[i], token_ids[i], value, checksum)

            if checksum:
                map_values(seal, placed, len(placed) * V)
            else:  # headers and tokens only: no pass over the payloads
                for item in placed:
                    seal(item)
                self._unchecked.update(slot for slot, _ in placed)
            for slot, i in placed:
                self._publish(keys[i], slot)
        self._finish_store(len(placed), len(keys) - len(placed), evicted)
        return len(placed)

    def _where(self, slot: int) -> tuple[int, int, int]:
        """A slot's chunk, its offset in the chunk's bytes, and its size."""
        page, i = divmod(slot, self._ids)
        c, row = divmod(page, self._per_chunk)
        assert self.slot_nbytes is not None
        size = self._classes[self._page_class[page]]
        return c, row * self.slot_nbytes + i * size, size

    def hold(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Keep the slots of these keys (those held) from reuse until ``release`` of the
        returned handle (the slots, empty when none is held), so views from ``load`` stay
        valid."""
        check_keys(keys)
        with self._lock:
            slots = tuple(self._index[k] for k in keys if k in self._index)
            if not slots:
                return ()
            handle = _Hold(slots)
            self._holds[id(handle)] = handle
            for slot in slots:
                self._held[slot] = self._held.get(slot, 0) + 1
        return handle

    def release(self, handle: Sequence[int]) -> None:
        """Undo one ``hold``; ValueError for a handle `hold` did not return or that was
        released already (nothing changes)."""
        if not handle:
            return
        with self._lock:
            if self._holds.pop(id(handle), None) is not handle:
                raise ValueError("release of a handle this tier's hold did not return, or "
                                 "released already")
            for slot in handle:
                n = self._held.get(slot, 0) - 1
                if n > 0:
                    self._held[slot] = n
                    continue
                self._held.pop(slot, None)
                if slot in self._retired:
                    self._retired.discard(slot)
                    self._free_slot(slot)

    def discard(self, keys: Sequence[bytes]) -> int:
        """Drop these keys; returns how many were held."""
        check_keys(keys)
        with self._lock:
            n = sum(k in self._index for k in keys)
            for k in keys:
                self._unlink(k)
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Stores are synchronous: always True."""
        return True

    def close(self) -> None:
        """Drop everything held and the arena."""
        with self._lock:
            self._index.clear()
            self._chunks.clear()
            self._rows.clear()
            for per_slot in (self._start, self._len, self._key):
                per_slot.clear()
            for per_page in (self._page_class, self._page_used, self._page_free, self._free_pages):
                per_page.clear()
            for partial in self._partial:
                partial.clear()
            self._held.clear()
            self._holds.clear()
            self._retired.clear()
            self._unchecked.clear()
            self._nbytes = 0


class _Hold(tuple[int, ...]):
    """The slots one `HostTier.hold` kept: its handle for `release`, told apart from an
    equal tuple by identity."""

    __slots__ = ()


def _slot_classes(slot_nbytes: int | Sequence[int] | None) -> tuple[int, ...]:
    """The distinct slot sizes, ascending (empty for None); ValueError unless positive ints."""
    if slot_nbytes is None:
        return ()
    sizes = [slot_nbytes] if isinstance(slot_nbytes, int) else slot_nbytes
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence) or not sizes or any(
            not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise ValueError(f"slot_nbytes must be a positive int, a non-empty sequence of them, or "
                         f"None, got {slot_nbytes!r}")
    return tuple(sorted(set(sizes)))


# --- device pages <-> packed host buffers -------------------------------------------------

# Bytes of device staging used per chunk of a gather or scatter on an accelerator.
_STAGING_BYTES = 256 << 20


def _group_slots(cache: PagedKVCache, group_id: int) -> int:
    groups = cache.config.groups
    if not isinstance(group_id, int) or isinstance(group_id, bool) or not 0 <= group_id < len(groups):
        raise ValueError(f"group_id must be in [0, {len(groups)}), got {group_id!r}")
    return len(groups[group_id].layer_ids)


def _is_recurrent(cache: PagedKVCache, group_id: int) -> bool:
    _group_slots(cache, group_id)
    return cache.config.groups[group_id].is_recurrent


def block_payload_nbytes(cache: PagedKVCache, group_id: int) -> int:
    """Bytes of one block of one group packed: K and V of each of its layers; for a
    recurrent group, the states of each of its layers in one large page."""
    if _is_recurrent(cache, group_id):
        spec = cache.config.groups[group_id].spec
        assert isinstance(spec, RecurrentStateSpec)
        return _group_slots(cache, group_id) * spec.state_bytes
    page = cache.key_caches[0][0]
    return 2 * _group_slots(cache, group_id) * page.numel() * page.element_size()


def _block_index(cache: PagedKVCache, block_ids: Sequence[int], unique: bool,
                 group_id: int | None = None) -> list[int]:
    ids = list(block_ids)
    nb = cache.config.num_blocks
    if group_id is not None and _is_recurrent(cache, group_id):
        lo, hi = nb + 1, nb + nb // cache.config.large_page_blocks
        what = f"group {group_id} is recurrent: its page ids are large pages in ({nb}, {hi})"
    else:
        lo, hi = 1, nb
        what = f"block ids must be ints in [1, {nb}) (0 is the null block)"
    for b in ids:
        if not isinstance(b, int) or isinstance(b, bool) or not lo <= b < hi:
            raise ValueError(f"{what}, got {b!r}")
    if unique and len(set(ids)) != len(ids):
        dup = sorted({b for b in ids if ids.count(b) > 1})
        raise ValueError(f"block ids repeat: {dup}")
    return ids


def _state_bytes(cache: PagedKVCache, group_id: int, page_id: int) -> list[torch.Tensor]:
    """The state tensors of every layer of recurrent group ``group_id`` in large page
    ``page_id``, as flat uint8 views, in the order a payload packs them (layer, state)."""
    import torch

    return [v.reshape(-1).view(torch.uint8)
            for layer in cache.config.groups[group_id].layer_ids
            for v in cache.state_views(layer, page_id)]


def _gather_states(cache: PagedKVCache, group_id: int, page_ids: Sequence[int],
                   rows: torch.Tensor, off: int) -> None:
    """Pack large pages of a recurrent group into ``rows[i, off:]``, one row per page."""
    for i, page in enumerate(page_ids):
        o = off
        for piece in _state_bytes(cache, group_id, page):
            rows[i, o:o + piece.numel()].copy_(piece, non_blocking=True)
            o += piece.numel()
    if cache.device.type != "cpu":
        import torch

        torch.cuda.current_stream(cache.device).synchronize()


def _scatter_states(cache: PagedKVCache, group_id: int, page_ids: Sequence[int],
                    payloads: Sequence[Buffer], nbytes: int) -> None:
    """Write packed payloads into large pages of a recurrent group (queued on the current
    stream on an accelerator)."""
    import numpy as np
    import torch

    for i, (page, payload) in enumerate(zip(page_ids, payloads, strict=True)):
        view = memoryview(payload).cast("B")
        if view.nbytes != nbytes:
            raise ValueError(f"payload {i} is {view.nbytes} bytes, expected {nbytes}")
        src = np.frombuffer(view, dtype=np.uint8)
        if cache.device.type != "cpu":
            staged = torch.empty(nbytes, dtype=torch.uint8, device=cache.device)
            staged.copy_(torch.from_numpy(src.copy()), non_blocking=False)
            src_t: Any = staged
        o = 0
        for piece in _state_bytes(cache, group_id, page):
            n = piece.numel()
            if cache.device.type == "cpu":
                piece.numpy()[:] = src[o:o + n]
            else:
                piece.copy_(src_t[o:o + n])
            o += n


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
    For a recurrent group the ids are large pages and a row is the states of each layer
    (in the group's order), each state tensor's bytes in the spec's order.
    Writes into ``out`` when given; a new buffer is pinned when the cache is on CUDA."""
    import torch

    ids = _block_index(cache, block_ids, unique=False, group_id=group_id)
    L = _group_slots(cache, group_id)
    P = block_payload_nbytes(cache, group_id)
    n = len(ids)
    if out is None:
        out = host_buffer(n, P, pin=cache.device.type == "cuda")
    else:
        _check_buffer(out, n, P, "out")
    if n == 0:
        return out
    if _is_recurrent(cache, group_id):
        _gather_states(cache, group_id, ids, out, 0)
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


def _gather_rows(cache: PagedKVCache, group_id: int, block_ids: Sequence[int], rows: torch.Tensor,
                 off: int, nbytes: int) -> None:
    """Pack blocks into ``rows[i, off:off + nbytes]`` (``rows``: a contiguous uint8 host
    tensor, one row per block), laid out as ``gather_blocks`` lays out a row."""
    import torch

    if _is_recurrent(cache, group_id):
        _gather_states(cache, group_id, block_ids, rows, off)
        return
    L = _group_slots(cache, group_id)
    n = len(block_ids)
    nb = cache.config.num_blocks
    if cache.device.type == "cpu":
        dst = rows[:, off:off + nbytes].view(cache.dtype).view(n, L, 2, -1)
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        for j in range(L):
            for kv, caches in enumerate((cache.key_caches, cache.value_caches)):
                torch.index_select(caches[j].view(nb, -1), 0, idx, out=dst[:, j, kv])
        return
    # On an accelerator: gather whole rows in device staging, then one contiguous copy each.
    chunk = max(1, _STAGING_BYTES // rows.shape[1])
    idx_all = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
    for s in range(0, n, chunk):
        idx = idx_all[s:s + chunk]
        staging = torch.empty((len(idx), rows.shape[1]), dtype=torch.uint8, device=cache.device)
        sv = staging[:, off:off + nbytes].view(cache.dtype).view(len(idx), L, 2, -1)
        for j in range(L):
            sv[:, j, 0] = cache.key_caches[j].view(nb, -1)[idx]
            sv[:, j, 1] = cache.value_caches[j].view(nb, -1)[idx]
        rows[s:s + len(idx)].copy_(staging, non_blocking=True)
    torch.cuda.current_stream(cache.device).synchronize()


def scatter_blocks(cache: PagedKVCache, group_id: int, block_ids: Sequence[int],
                   packed: torch.Tensor) -> None:
    """Unpack rows of ``packed`` (as ``gather_blocks`` lays them out) into pages
    ``block_ids`` of one group; the ids must be distinct. On CUDA the copies are queued on
    the current stream (a forward queued after them sees the pages)."""
    import torch

    ids = _block_index(cache, block_ids, unique=True, group_id=group_id)
    L = _group_slots(cache, group_id)
    P = block_payload_nbytes(cache, group_id)
    n = len(ids)
    _check_buffer(packed, n, P, "packed")
    if n == 0:
        return
    if _is_recurrent(cache, group_id):
        rows = packed.numpy()
        _scatter_states(cache, group_id, ids, [rows[i] for i in range(n)], P)
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
        _write_staged(cache, L, idx, packed[s:s + len(idx)].to(cache.device, non_blocking=True))


def _write_staged(cache: PagedKVCache, num_slots: int, idx: torch.Tensor,
                  staging: torch.Tensor) -> None:
    """Write rows of ``staging`` (uint8 on the cache's device, laid out as ``gather_blocks``
    lays out a row) into pages ``idx`` of a group's ``num_slots`` layer slots."""
    nb = cache.config.num_blocks
    src = staging.view(cache.dtype).view(len(idx), num_slots, 2, -1)
    for j in range(num_slots):
        cache.key_caches[j].view(nb, -1).index_copy_(0, idx, src[:, j, 0])
        cache.value_caches[j].view(nb, -1).index_copy_(0, idx, src[:, j, 1])


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
    if _is_recurrent(cache, group_id):
        ids = _block_index(cache, block_ids, unique=True, group_id=group_id)
        _scatter_states(cache, group_id, ids, payloads, P)
        return
    if cache.device.type != "cpu":
        _restore_on_device(cache, group_id, block_ids, payloads, P)
        return
    import numpy as np
    import torch

    ids = _block_index(cache, block_ids, unique=True)
    L = _group_slots(cache, group_id)
    nb = cache.config.num_blocks
    pages = [c[j].view(nb, -1).view(torch.uint8).numpy()  # the row order of a payload: layer, K/V
             for j in range(L) for c in (cache.key_caches, cache.value_caches)]
    rows = []
    for i, p in enumerate(payloads):
        view = memoryview(p).cast("B")
        if view.nbytes != P:
            raise ValueError(f"payload {i} is {view.nbytes} bytes, expected {P}")
        rows.append(np.frombuffer(view, dtype=np.uint8))
    where = np.asarray(ids)
    for start, stop, stride in _equal_strides(rows):  # straight from the values: no staging copy
        src = np.lib.stride_tricks.as_strided(rows[start], (stop - start, len(pages), P // len(pages)),
                                              (stride, P // len(pages), 1), writeable=False)
        for piece, page in enumerate(pages):
            page[where[start:stop]] = src[:, piece]


def _equal_strides(rows: Sequence[Any]) -> list[tuple[int, int, int]]:
    """Runs ``(start, stop, stride)`` of the numpy byte arrays ``rows`` (all of one size)
    that lie at equal distances in memory (forwards or backwards), as neighbouring slots of
    the host arena do: rows ``start..stop-1`` are one array of ``stride``-spaced rows, read
    with one copy per page instead of one per row and page."""
    addresses = [r.__array_interface__["data"][0] for r in rows]
    size = rows[0].nbytes if rows else 0
    runs = []
    start = 0
    while start < len(rows):
        stop, stride = start + 1, size
        if stop < len(rows) and abs(addresses[stop] - addresses[start]) >= size:
            stride = addresses[stop] - addresses[start]
            while stop < len(rows) and addresses[stop] - addresses[stop - 1] == stride:
                stop += 1
        runs.append((start, stop, stride))
        start = stop
    return runs


def _restore_on_device(cache: PagedKVCache, group_id: int, block_ids: Sequence[int],
                       payloads: Sequence[Buffer], nbytes: int) -> None:
    """``restore_payloads`` on an accelerator: each payload copied as it lies (the host
    arena's slots are pinned, so these are DMA copies queued back to back, with no host-side
    gather into a fresh buffer) into device staging, then one scatter per layer slot."""
    import torch

    ids = _block_index(cache, block_ids, unique=True)
    L = _group_slots(cache, group_id)
    views = []
    for i, p in enumerate(payloads):
        view = memoryview(p).cast("B")
        if view.nbytes != nbytes:
            raise ValueError(f"payload {i} is {view.nbytes} bytes, expected {nbytes}")
        views.append(view)
    chunk = max(1, _STAGING_BYTES // nbytes)
    idx_all = torch.as_tensor(ids, dtype=torch.long, device=cache.device)
    for s in range(0, len(ids), chunk):
        part = views[s:s + chunk]
        staging = torch.empty((len(part), nbytes), dtype=torch.uint8, device=cache.device)
        for row, view in zip(staging, part, strict=True):
            row.copy_(torch.frombuffer(view, dtype=torch.uint8), non_blocking=True)
        _write_staged(cache, L, idx_all[s:s + len(part)], staging)
