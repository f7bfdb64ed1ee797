"""The tier interface every backend implements, the counters they keep, a bounded background
writer for stores, and the batched helpers a lookup uses across tiers. Imports no torch."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvstore.tiers.codec import KEY_NBYTES, BlockLayout, Buffer, decode_block, map_values

StoreItem = tuple[bytes, Buffer]
#: Writes a batch of items (the return value is ignored).
WriteFn = Callable[[list[StoreItem]], object]
#: Verifies one value (``decode_block``'s signature): its payload, or None and a counted reason.
DecodeFn = Callable[[BlockLayout, bytes, Sequence[int], Buffer | None, dict[str, int] | None],
                    memoryview | None]


class TierStats:
    """Named event counters of one tier (hits, misses, errors, rejected values by reason,
    stores queued/written/dropped, evictions); safe to bump from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name``."""
        with self._lock:
            self._counts[name] += n

    def merge(self, counts: dict[str, int]) -> None:
        """Add every counter of ``counts``."""
        with self._lock:
            self._counts.update(counts)

    def __getitem__(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of all non-zero counters."""
        with self._lock:
            return {k: v for k, v in self._counts.items() if v}

    def __repr__(self) -> str:
        return f"TierStats({self.snapshot()})"


@runtime_checkable
class Tier(Protocol):
    """A key-value tier below device memory. Keys are 32-byte ``block_key``s; values are
    ``encode_block`` bytes. No method raises because the backend failed: a failure is a
    miss (or a dropped store) and a count in ``stats``."""

    name: str
    stats: TierStats

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are present without a gap."""
        ...

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` is present (all False when unreachable)."""
        ...

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The value of each key, None where absent or unreachable."""
        ...

    def store(self, items: Sequence[StoreItem]) -> None:
        """Store (key, value) pairs; may return before they are written."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until stores queued so far are written or dropped; False on timeout."""
        ...

    def close(self) -> None:
        """Stop background work and release connections."""
        ...


def check_keys(keys: Sequence[bytes]) -> None:
    """ValueError unless every key is a 32-byte ``bytes``."""
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or len(k) != KEY_NBYTES:
            raise ValueError(f"key {i} must be {KEY_NBYTES} bytes (from block_key), got {k!r:.60}")


def check_items(items: Sequence[StoreItem]) -> list[StoreItem]:
    """The items, each value a ``bytes``, ``bytearray`` or flat byte memoryview (a
    memoryview of another shape or item format is recast as one: its ``len`` is then its
    size, as a backend writing ``len`` bytes expects). ValueError unless every item is
    (32-byte key, bytes-like value), a memoryview value C-contiguous."""
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"store item {i} must be a (key, value) pair, got {type(item).__name__}")
        key, value = item
        if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
            raise ValueError(f"store item {i}: key must be {KEY_NBYTES} bytes, got {key!r:.60}")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ValueError(f"store item {i}: value must be bytes-like, got {type(value).__name__}")
        if isinstance(value, memoryview):
            if not value.c_contiguous:
                raise ValueError(f"store item {i}: a memoryview value must be C-contiguous")
            value = value.cast("B")
        out.append((key, value))
    return out


def leading_run(present: Sequence[bool]) -> int:
    """Length of the run of True at the start."""
    for i, p in enumerate(present):
        if not p:
            return i
    return len(present)


def load_verified(tier: Tier, layout: BlockLayout, keys: Sequence[bytes],
                  token_ids: Sequence[Sequence[int]], decode: DecodeFn = decode_block, *,
                  hashes: bool = True) -> list[memoryview]:
    """Payloads of the leading run of ``keys`` that load and verify (size, layout digest, key,
    tokens, checksum): the first block that fails ends the run. Counts ``hits``, ``misses``
    and each rejected value's reason in ``tier.stats``. ``decode`` verifies one value
    (``decode_block``, or ``kvstore.benchmarks.tier_model.decode_placeholder`` for
    payload-free values). ``hashes``: ``decode`` hashes each value, so a large batch is
    verified on several threads; a decode that only compares headers runs on the caller's."""
    if len(keys) != len(token_ids):
        raise ValueError(f"{len(keys)} keys but {len(token_ids)} token id lists")
    if not keys:
        return []
    values = tier.load(keys)

    def verify(item: tuple[bytes, Sequence[int], Buffer | None]
               ) -> tuple[memoryview | None, dict[str, int]]:
        why: dict[str, int] = {}
        return decode(layout, item[0], item[1], item[2], why), why

    nbytes = sum(memoryview(v).nbytes for v in values if v is not None) if hashes else 0
    out: list[memoryview] = []
    reasons: dict[str, int] = {}
    for payload, why in map_values(verify, zip(keys, token_ids, values, strict=True), nbytes):
        for reason, n in why.items():  # counted up to the first failure, as one pass would
            reasons[reason] = reasons.get(reason, 0) + n
        if payload is None:
            break
        out.append(payload)
    reasons.pop("miss", None)
    reasons["hits"] = len(out)
    reasons["misses"] = len(keys) - len(out)
    tier.stats.merge(reasons)
    return out


def extend_hit(tiers: Sequence[Tier], keys: Sequence[bytes], num_hit: int) -> list[int]:
    """Blocks each tier adds, in order, to a hit of ``num_hit`` blocks already found above
    them: tier i is asked only for the keys after what the tiers before it hold."""
    if not 0 <= num_hit <= len(keys):
        raise ValueError(f"num_hit must be in [0, {len(keys)}], got {num_hit}")
    found = []
    pos = num_hit
    for tier in tiers:
        n = tier.contains(keys[pos:]) if pos < len(keys) else 0
        found.append(n)
        pos += n
    return found


class BackgroundWriter:
    """Runs ``write(items)`` on a daemon thread from a bounded queue, so a caller never waits
    for a store: when the queue is full the items are dropped and counted
    (``dropped_stores``). Items queued together are written together, up to ``batch``."""

    def __init__(self, write: WriteFn, stats: TierStats, *, max_queue: int = 4096,
                 batch: int = 64, name: str = "kvstore-tier-writer") -> None:
        if max_queue < 1 or batch < 1:
            raise ValueError(f"max_queue and batch must be >= 1, got {max_queue}, {batch}")
        self._write = write
        self._stats = stats
        self._batch = batch
        self._queue: queue.Queue[StoreItem | None] = queue.Queue(max_queue)
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, items: Sequence[StoreItem]) -> list[StoreItem]:
        """Queue items; those that do not fit are dropped, counted and returned."""
        if self._closed:
            self._stats.add("dropped_stores", len(items))
            return list(items)
        dropped: list[StoreItem] = []
        for item in items:
            with self._idle:
                self._pending += 1
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                dropped.append(item)
                self._done(1)
        if dropped:
            self._stats.add("dropped_stores", len(dropped))
        self._stats.add("stores_queued", len(items) - len(dropped))
        return dropped

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is written or dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float = 2.0) -> None:
        """Stop the thread after what is queued (waiting at most ``timeout``)."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _done(self, n: int) -> None:
        with self._idle:
            self._pending -= n
            if not self._pending:
                self._idle.notify_all()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < self._batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._flush_batch(batch)
                    return
                batch.append(nxt)
            self._flush_batch(batch)

    def _flush_batch(self, batch: list[StoreItem]) -> None:
        try:
            self._write(batch)
        except Exception:  # a backend bug must not kill the writer thread
            self._stats.add("errors")
            self._stats.add("dropped_stores", len(batch))
        finally:
            self._done(len(batch))
