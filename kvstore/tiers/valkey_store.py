"""A shared store on Valkey (or Redis) through the ``redis`` client: pipelined, batched,
bounded by socket timeouts, and failing soft. A server that is down, slow or full turns
hits into misses and stores into drops, each counted; nothing raises to the caller, and the
client reconnects once the server answers again.

URLs: ``valkey://host:port/db`` (``valkeys://`` for TLS; ``redis://`` and ``rediss://``
also accepted) for one server, ``valkey+cluster://host:port`` for a Valkey cluster (any
node; the client discovers the others and batches per node)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from kvstore.tiers.base import (
    BackgroundWriter,
    StoreItem,
    TierStats,
    check_items,
    check_keys,
    leading_run,
)
from kvstore.tiers.codec import Buffer

_SCHEMES = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss"}
_CLUSTER_SCHEMES = {"valkey+cluster": "redis", "valkeys+cluster": "rediss",
                    "redis+cluster": "redis", "rediss+cluster": "rediss"}


def parse_store_url(url: str) -> tuple[str, bool]:
    """The ``redis``-client URL for a store URL, and whether it names a cluster.
    ValueError for another scheme or a URL without host."""
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES and scheme not in _CLUSTER_SCHEMES:
        raise ValueError(f"store URL {url!r}: scheme must be one of "
                         f"{sorted(_SCHEMES) + sorted(_CLUSTER_SCHEMES)}")
    if not parts.hostname:
        raise ValueError(f"store URL {url!r} has no host (expected valkey://host:port/db)")
    try:
        parts.port  # noqa: B018 (validates the port)
    except ValueError as exc:
        raise ValueError(f"store URL {url!r}: {exc}") from None
    cluster = scheme in _CLUSTER_SCHEMES
    if cluster and parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"store URL {url!r}: a cluster has only database 0")
    mapped = (_CLUSTER_SCHEMES if cluster else _SCHEMES)[scheme]
    return parts._replace(scheme=mapped).geturl(), cluster


class ValkeyStore:
    """The ``Tier`` on a Valkey server or cluster. Keys are stored as ``namespace + key``;
    ``ttl_s`` sets an expiry on every value. ``contains`` and ``load`` block for at most
    about ``timeout_s`` per round trip; ``store`` queues for a background writer (a full
    queue drops, counted) unless ``sync_stores``. After a failure the store is not asked
    again for ``retry_interval_s`` (calls are misses meanwhile, counted ``skipped``)."""

    name = "valkey"

    def __init__(self, url: str, *, namespace: bytes = b"kvstore:", ttl_s: float | None = None,
                 timeout_s: float = 0.5, connect_timeout_s: float | None = None,
                 retry_interval_s: float = 1.0, chunk: int = 256, max_queue: int = 1024,
                 write_batch: int = 32, sync_stores: bool = False, max_connections: int = 16) -> None:
        self.client_url, self.cluster = parse_store_url(url)
        self.url = url
        if not isinstance(namespace, bytes):
            raise ValueError(f"namespace must be bytes, got {type(namespace).__name__}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s!r}")
        for what, v in (("timeout_s", timeout_s), ("retry_interval_s", retry_interval_s)):
            if not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"{what} must be a positive number of seconds, got {v!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        self.namespace = namespace
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s if connect_timeout_s is not None else timeout_s)
        self.retry_interval_s = float(retry_interval_s)
        self.chunk = chunk
        self.max_connections = max_connections
        self.stats = TierStats()
        self.last_error: str | None = None
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_until = 0.0
        self._writer = None if sync_stores else BackgroundWriter(
            self.store_now, self.stats, max_queue=max_queue, batch=write_batch,
            name="kvstore-valkey-writer")

    # -- connection and failure handling -------------------------------------------------

    def _make_client(self) -> Any:
        from redis import Redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        opts: dict[str, Any] = dict(socket_timeout=self.timeout_s,
                                    socket_connect_timeout=self.connect_timeout_s,
                                    retry=Retry(NoBackoff(), 0), max_connections=self.max_connections)
        if self.cluster:
            from redis.cluster import RedisCluster

            return RedisCluster.from_url(self.client_url, **opts)
        return Redis.from_url(self.client_url, **opts)

    def _get_client(self) -> Any | None:
        """The client, or None while the store is considered down."""
        if time.monotonic() < self._down_until:
            return None
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make_client()
                except Exception as exc:
                    self._failed(exc)
                    return None
            return self._client

    def _failed(self, exc: BaseException) -> None:
        self.stats.add("errors")
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._down_until = time.monotonic() + self.retry_interval_s
        with self._lock:
            client, self._client = self._client, None
        if client is not None:  # drop stale connections: the next try connects afresh
            try:
                client.close()
            except Exception:
                pass

    @property
    def available(self) -> bool:
        """False while calls are skipped after a failure."""
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        """Whether the server answers now (ignores the retry interval)."""
        self._down_until = 0.0
        client = self._get_client()
        if client is None:
            return False
        try:
            return bool(client.ping(target_nodes="all") if self.cluster else client.ping())
        except Exception as exc:
            self._failed(exc)
            return False

    # -- the Tier interface --------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds without a gap (0 when
        unreachable). One pipelined round trip per ``chunk`` keys, stopping at a gap."""
        check_keys(keys)
        client = self._get_client()
        if client is None:
            self.stats.add("skipped")
            return 0
        found = 0
        try:
            for s in range(0, len(keys), self.chunk):
                part = keys[s:s + self.chunk]
                pipe = client.pipeline(transaction=False)
                for k in part:
                    pipe.exists(self.namespace + k)
                run = leading_run([bool(x) for x in pipe.execute()])
                found += run
                if run < len(part):
                    break
        except Exception as exc:
            self._failed(exc)
            return 0
        return found

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The value of each key, None where absent (all None when unreachable)."""
        check_keys(keys)
        misses: list[Buffer | None] = [None] * len(keys)
        if not keys:
            return misses
        client = self._get_client()
        if client is None:
            self.stats.add("skipped")
            return misses
        names = [self.namespace + k for k in keys]
        try:
            pipe = client.pipeline(transaction=False)
            if self.cluster:  # keys spread over slots: one GET each, batched per node
                for name in names:
                    pipe.get(name)
                values = pipe.execute()
            else:
                for s in range(0, len(names), self.chunk):
                    pipe.mget(names[s:s + self.chunk])
                values = [v for part in pipe.execute() for v in part]
        except Exception as exc:
            self._failed(exc)
            return misses
        self.stats.merge({"gets": len(keys), "get_hits": sum(v is not None for v in values)})
        return values

    def store(self, items: Sequence[StoreItem]) -> None:
        """Queue (key, value) pairs for the background writer (or write them now when
        ``sync_stores``); never raises for a store that is down or full."""
        check_items(items)
        if self._writer is None:
            self.store_now(list(items))
        else:
            self._writer.submit(items)

    def store_now(self, items: Sequence[StoreItem]) -> int:
        """Write pairs in pipelined SETs now; returns how many the server accepted. Refused
        writes (e.g. out of memory under ``noeviction``) and failures count as dropped."""
        if not items:
            return 0
        client = self._get_client()
        if client is None:
            self.stats.merge({"skipped": 1, "dropped_stores": len(items)})
            return 0
        try:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.namespace + key, value, px=self.ttl_ms)
            results = pipe.execute(raise_on_error=False)
        except Exception as exc:
            self._failed(exc)
            self.stats.add("dropped_stores", len(items))
            return 0
        ok = sum(r is True for r in results)
        refused = len(items) - ok
        if refused:
            self.last_error = next((f"{type(r).__name__}: {r}" for r in results if r is not True), None)
        self.stats.merge({"stores": ok, "store_errors": refused, "dropped_stores": refused})
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued stores are written or dropped; False on timeout."""
        return True if self._writer is None else self._writer.flush(timeout)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many existed (0 when unreachable)."""
        check_keys(keys)
        client = self._get_client()
        if client is None or not keys:
            return 0
        try:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(self.namespace + k)
            return sum(int(x) for x in pipe.execute())
        except Exception as exc:
            self._failed(exc)
            return 0

    def close(self) -> None:
        """Stop the writer (after what is queued, briefly) and close connections."""
        if self._writer is not None:
            self._writer.close(timeout=max(1.0, 2 * self.timeout_s))
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

    def __enter__(self) -> ValkeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ValkeyStore({self.url!r}, cluster={self.cluster})"
