"""A shared store on Valkey (or Redis) through the ``redis`` client: pipelined, batched,
bounded by socket timeouts, and failing soft. A server that is down, slow or full turns
hits into misses and stores into drops, each counted; nothing raises to the caller, and the
client reconnects once the server answers again. Settings an operator must fix (a wrong
password, a missing database, a user the ACL refuses) are also reported once as a
:class:`StoreConfigWarning`.

URLs: ``valkey://[user:password@]host:port/db[?option=value...]`` (``valkeys://`` for TLS;
``redis://`` and ``rediss://`` also accepted) for one server;
``valkey+cluster://[user:password@]host:port[,host:port...]`` for a Valkey cluster (any
reachable seed will do; the store reads the cluster's slot map and talks to each master
itself, so a master that is down is a miss for its slots only)."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstore.tiers.base import (
    BackgroundWriter,
    StoreItem,
    TierStats,
    check_items,
    check_keys,
    leading_run,
)
from kvstore.tiers.codec import Buffer

__all__ = ["URL_OPTIONS", "StoreConfigWarning", "ValkeyStore", "parse_store_url", "redact_url"]

_SCHEMES = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss"}
_CLUSTER_SCHEMES = {"valkey+cluster": "redis", "valkeys+cluster": "rediss",
                    "redis+cluster": "redis", "rediss+cluster": "rediss"}
_DEFAULT_PORT = 6379
_NUM_SLOTS = 16384
#: Called with the keys the server accepted and the keys that were not written.
WrittenFn = Callable[[Sequence[bytes], Sequence[bytes]], None]


class StoreConfigWarning(UserWarning):
    """The store refuses this client for a reason only the operator can fix (credentials,
    database index, ACL): every lookup misses until it is fixed."""


def redact_url(url: str) -> str:
    """``url`` with the password (or a user-info without ``:``, which may be one) replaced
    by ``***``; anything else unchanged. Never raises for a str."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    head, sep, rest = url.partition("://")
    if not sep:
        return url
    end = len(rest)
    for c in "/?#":
        i = rest.find(c)
        if i != -1:
            end = min(end, i)
    netloc, tail = rest[:end], rest[end:]
    userinfo, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    redacted = f"{user}:***" if colon else "***"
    return f"{head}://{redacted}@{hosts}{tail}"


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name}={text!r} must be a positive number of seconds")
    return value


def _flag(name: str, text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={text!r} must be true or false")


def _cert_reqs(name: str, text: str) -> str:
    if text.lower() not in ("none", "optional", "required"):
        raise ValueError(f"{name}={text!r} must be none, optional or required")
    return text.lower()


def _text(name: str, text: str) -> str:
    if not text:
        raise ValueError(f"{name} is empty")
    return text


#: The query options a store URL may carry, each parsed and checked at construction. The
#: ``ssl_*`` ones need a TLS scheme. ``socket_timeout`` / ``socket_connect_timeout`` may
#: only lower the store's ``timeout_s`` / ``connect_timeout_s``.
URL_OPTIONS: dict[str, Callable[[str, str], Any]] = {
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "client_name": _text,
    "ssl_cert_reqs": _cert_reqs,
    "ssl_ca_certs": _text,
    "ssl_ca_path": _text,
    "ssl_certfile": _text,
    "ssl_keyfile": _text,
    "ssl_check_hostname": _flag,
}


@dataclass(frozen=True)
class _Address:
    """A parsed store URL."""

    tls: bool
    cluster: bool
    nodes: tuple[tuple[str, int], ...]
    db: int
    username: str | None = field(repr=False)
    password: str | None = field(repr=False)
    options: dict[str, Any]
    client_url: str = field(repr=False)


def _parse(url: str) -> _Address:
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a str, got {type(url).__name__}")
    shown = redact_url(url)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES and scheme not in _CLUSTER_SCHEMES:
        raise ValueError(f"store URL {shown!r}: scheme must be one of "
                         f"{sorted(_SCHEMES) + sorted(_CLUSTER_SCHEMES)}")
    cluster = scheme in _CLUSTER_SCHEMES
    mapped = (_CLUSTER_SCHEMES if cluster else _SCHEMES)[scheme]
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    nodes = []
    for entry in hostlist.split(","):
        sub = urlsplit("//" + entry)
        if not sub.hostname:
            raise ValueError(f"store URL {shown!r} has no host (expected valkey://host:port/db)")
        try:
            port = sub.port
        except ValueError as exc:
            raise ValueError(f"store URL {shown!r}: {exc}") from None
        nodes.append((sub.hostname, port or _DEFAULT_PORT))
    if len(nodes) > 1 and not cluster:
        raise ValueError(f"store URL {shown!r}: several hosts name cluster seeds "
                         "(valkey+cluster://h1:p1,h2:p2); one server takes one host")
    path = unquote(parts.path).strip("/")
    if path and not path.isdigit():
        raise ValueError(f"store URL {shown!r}: the database must be a number (/0, /1, ...), "
                         f"got {path!r}")
    db = int(path) if path else 0
    if cluster and db != 0:
        raise ValueError(f"store URL {shown!r}: a cluster has only database 0")
    options: dict[str, Any] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ValueError(f"store URL {shown!r}: malformed query {parts.query!r}") from None
    for name, text in pairs:
        if name not in URL_OPTIONS:
            raise ValueError(f"store URL {shown!r}: unsupported option {name!r} "
                             f"(supported: {', '.join(sorted(URL_OPTIONS))})")
        if name in options:
            raise ValueError(f"store URL {shown!r}: option {name!r} given twice")
        try:
            options[name] = URL_OPTIONS[name](name, text)
        except ValueError as exc:
            raise ValueError(f"store URL {shown!r}: {exc}") from None
        if name.startswith("ssl_") and mapped != "rediss":
            raise ValueError(f"store URL {shown!r}: {name} needs TLS (valkeys:// or "
                             "valkeys+cluster://)")
    return _Address(mapped == "rediss", cluster, tuple(nodes), db, username, password, options,
                    parts._replace(scheme=mapped).geturl())


def parse_store_url(url: str) -> tuple[str, bool]:
    """The ``redis``-client URL for a store URL, and whether it names a cluster.
    ValueError (naming what is wrong, the password redacted) for another scheme, a URL
    without host, a bad port, a database that is not a number (or not 0 for a cluster),
    several hosts outside a cluster, or an unsupported or malformed option (see
    ``URL_OPTIONS``)."""
    address = _parse(url)
    return address.client_url, address.cluster


_FAIL = object()  # a command that got no answer (its node was down or failed)
# Errors an operator can fix, by what the warning says: (exception class names, message parts).
_OPERATOR_ERRORS = (
    ("the server refused the credentials (wrong or missing password or user)",
     ("AuthenticationError", "AuthenticationWrongNumberOfArgsError"), ("WRONGPASS", "NOAUTH")),
    ("the database index does not exist on the server", (), ("DB index is out of range",
                                                             "Invalid Database")),
    ("the server's ACL refuses a command this store needs", ("NoPermissionError",), ("NOPERM",)),
)


def _operator_error(exc: BaseException | str) -> str | None:
    """What an operator must fix, when this failure is one of those (else None)."""
    names = {c.__name__ for c in type(exc).__mro__} if isinstance(exc, BaseException) else set()
    text = str(exc)
    for what, classes, texts in _OPERATOR_ERRORS:
        if names.intersection(classes) or any(t in text for t in texts):
            return what
    return None


class ValkeyStore:
    """The ``Tier`` on a Valkey server or cluster. Keys are stored as ``namespace + key``;
    ``ttl_s`` sets an expiry on every value. ``contains`` and ``load`` block for at most
    about ``timeout_s`` per round trip (per node reached, in a cluster, in parallel);
    ``store`` queues for a background writer (a full queue drops, counted) unless
    ``sync_stores``. After a failure the server (in a cluster: that master) is not asked
    again for ``retry_interval_s`` (its keys are misses meanwhile, counted ``skipped``).

    ``on_written(accepted, failed)``, when set, is called with the keys each write got
    accepted by the server and those it did not write (refused, dropped, unreachable)."""

    name = "valkey"

    def __init__(self, url: str, *, namespace: bytes = b"kvstore:", ttl_s: float | None = None,
                 timeout_s: float = 0.5, connect_timeout_s: float | None = None,
                 retry_interval_s: float = 1.0, chunk: int = 256, max_queue: int = 1024,
                 write_batch: int = 32, sync_stores: bool = False, max_connections: int = 16) -> None:
        address = _parse(url)
        if not isinstance(namespace, bytes):
            raise ValueError(f"namespace must be bytes, got {type(namespace).__name__}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s!r}")
        for what, v in (("timeout_s", timeout_s), ("retry_interval_s", retry_interval_s),
                        ("connect_timeout_s", timeout_s if connect_timeout_s is None else connect_timeout_s)):
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{what} must be a positive number of seconds, got {v!r}")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be a positive int, got {max_connections!r}")
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s if connect_timeout_s is not None else timeout_s)
        for option, bound, what in (("socket_timeout", self.timeout_s, "timeout_s"),
                                    ("socket_connect_timeout", self.connect_timeout_s,
                                     "connect_timeout_s")):
            if address.options.get(option, 0) > bound:
                raise ValueError(
                    f"store URL {redact_url(url)!r}: {option}={address.options[option]:g} exceeds "
                    f"the store's {what}={bound:g}, which bounds every call; pass a larger "
                    f"{what} to the store (store_timeout_s in the engine) instead")
        self._address = address
        self.cluster = address.cluster
        #: The URL with its password redacted (safe to print).
        self.url = redact_url(url)
        #: The ``redis``-client URL; it holds the password, never print it.
        self.client_url = address.client_url
        self.namespace = namespace
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_interval_s = float(retry_interval_s)
        self.chunk = chunk
        self.max_connections = max_connections
        self.stats = TierStats()
        self.last_error: str | None = None
        self.on_written: WrittenFn | None = None
        self._lock = threading.Lock()
        self._client: Any = None  # one server: its client
        self._down_until = 0.0
        self._failures = 0
        self._warned: set[str] = set()
        # A cluster: a client per node, the slot map, nodes down until a time.
        self._node_clients: dict[tuple[str, int], Any] = {}
        self._node_down: dict[tuple[str, int], float] = {}
        self._slots: list[tuple[str, int] | None] | None = None
        self._known: tuple[tuple[str, int], ...] = address.nodes
        self._refresh = True
        self._pool: ThreadPoolExecutor | None = None
        self._writer = None if sync_stores else BackgroundWriter(
            self.store_now, self.stats, max_queue=max_queue, batch=write_batch,
            name="kvstore-valkey-writer")

    # -- connection and failure handling -------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        a = self._address
        opts: dict[str, Any] = dict(socket_timeout=self.timeout_s,
                                    socket_connect_timeout=self.connect_timeout_s,
                                    retry=Retry(NoBackoff(), 0), max_connections=self.max_connections,
                                    username=a.username, password=a.password, db=a.db, ssl=a.tls)
        opts.update(a.options)
        return opts

    def _make_client(self, node: tuple[str, int]) -> Any:
        from redis import Redis

        return Redis(host=node[0], port=node[1], **self._client_options())

    def _get_client(self) -> Any | None:
        """One server's client, or None while it is considered down (or for a cluster)."""
        if self.cluster or time.monotonic() < self._down_until:
            return None
        error: Exception | None = None
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._make_client(self._address.nodes[0])
                except Exception as exc:  # a client the library refuses to build
                    error = exc
            client = self._client
        if error is not None:
            self._failed(error)
            return None
        return client

    def _note_error(self, exc: BaseException | str) -> None:
        """Record a failure's text, and warn once (and count) where the operator must act."""
        self.last_error = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        what = _operator_error(exc)
        if what is None:
            return
        self.stats.add("config_errors")
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(f"kvstore store {self.url}: {what} ({self.last_error}); lookups miss "
                          "and writes are dropped until this is fixed", StoreConfigWarning, stacklevel=3)

    def _failed(self, exc: BaseException) -> None:
        """The server (every node, for a cluster) failed: drop connections, skip it a while."""
        self.stats.add("errors")
        self._failures += 1
        self._note_error(exc)
        self._down_until = time.monotonic() + self.retry_interval_s
        with self._lock:
            clients = [self._client, *self._node_clients.values()]
            self._client = None
            self._node_clients = {}
            self._refresh = True
        _close_all(clients)

    def _node_failed(self, node: tuple[str, int], exc: BaseException) -> None:
        """One cluster node failed: its slots miss for a while; the slot map is read again."""
        self.stats.add("errors")
        self._failures += 1
        self._note_error(exc)
        with self._lock:
            self._node_down[node] = time.monotonic() + self.retry_interval_s
            client = self._node_clients.pop(node, None)
            self._refresh = True
        _close_all([client])

    @property
    def failure_count(self) -> int:
        """How many times the server (or a cluster node) failed so far: a caller that saw it
        change cannot trust what it believed the store held."""
        return self._failures

    @property
    def available(self) -> bool:
        """False while calls are skipped after a failure."""
        return time.monotonic() >= self._down_until

    def _node_client(self, node: tuple[str, int]) -> Any:
        with self._lock:
            client = self._node_clients.get(node)
            if client is None:
                client = self._node_clients[node] = self._make_client(node)
            return client

    def _node_up(self, node: tuple[str, int], now: float) -> bool:
        return self._node_down.get(node, 0.0) <= now

    def _slot_map(self) -> list[tuple[str, int] | None] | None:
        """The cluster's slot -> master map, read again after a failure or a redirection
        (from the first answering node among those known, then the URL's seeds); None
        while no node answers."""
        now = time.monotonic()
        if now < self._down_until:
            return None
        if self._slots is not None and not self._refresh:
            return self._slots
        seeds = list(dict.fromkeys(self._known + self._address.nodes))
        seeds.sort(key=lambda n: not self._node_up(n, now))  # nodes not known down first
        last: Exception | None = None
        for node in seeds:
            try:
                reply = self._node_client(node).execute_command("CLUSTER", "SLOTS")
            except Exception as exc:
                last = exc
                with self._lock:
                    client = self._node_clients.pop(node, None)
                _close_all([client])
                if _operator_error(exc):
                    break
                continue
            slots: list[tuple[str, int] | None] = [None] * _NUM_SLOTS
            known = []
            for entry in reply:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                owner = (host if host not in ("", "?") else node[0], int(master[1]))
                known.append(owner)
                slots[start:end + 1] = [owner] * (end - start + 1)
            with self._lock:
                self._slots, self._refresh = slots, False
                self._known = tuple(dict.fromkeys(known)) or self._known
            return slots
        assert last is not None
        self._failed(last)
        return None

    def _call(self, op: str, names: Sequence[bytes], values: Sequence[Buffer] = ()) -> list[Any] | None:
        """Run one command per name (``exists``, ``get``, ``set`` with ``values``,
        ``delete``) in pipelines: the result of each, ``_FAIL`` where its node failed or was
        down; None when the store as a whole is unreachable (counted ``skipped``)."""
        if not self.cluster:
            client = self._get_client()
            if client is None:
                self.stats.add("skipped")
                return None
            try:
                pipe = client.pipeline(transaction=False)
                if op == "get":  # MGET per chunk: one command each
                    for s in range(0, len(names), self.chunk):
                        pipe.mget(names[s:s + self.chunk])
                    return [v for part in pipe.execute() for v in part]
                for i, name in enumerate(names):
                    _queue(pipe, op, name, values[i] if values else None, self.ttl_ms)
                return list(pipe.execute(raise_on_error=op != "set"))
            except Exception as exc:
                self._failed(exc)
                return None
        slots = self._slot_map()
        if slots is None:
            self.stats.add("skipped")
            return None
        from redis.crc import key_slot

        now = time.monotonic()
        by_node: dict[tuple[str, int], list[int]] = {}
        out: list[Any] = [_FAIL] * len(names)
        skipped = 0
        for i, name in enumerate(names):
            node = slots[key_slot(name)]
            if node is None or not self._node_up(node, now):
                skipped += 1
                continue
            by_node.setdefault(node, []).append(i)
        if skipped:
            self.stats.add("skipped")
            if any(n is None for n in slots):
                self._refresh = True  # slots without a master: perhaps a failover since

        def run(node: tuple[str, int], idx: list[int]) -> None:
            try:
                pipe = self._node_client(node).pipeline(transaction=False)
                for i in idx:
                    _queue(pipe, op, names[i], values[i] if values else None, self.ttl_ms)
                results = pipe.execute(raise_on_error=False)
            except Exception as exc:
                self._node_failed(node, exc)
                return
            for i, r in zip(idx, results, strict=True):
                if isinstance(r, Exception):
                    if type(r).__name__ in ("MovedError", "AskError", "ClusterDownError", "TryAgainError"):
                        self._refresh = True  # resharded or failed over: read the map again
                    if op != "set":
                        continue  # a miss
                out[i] = r

        if len(by_node) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(16, thread_name_prefix="kvstore-valkey-node")
            for f in [self._pool.submit(run, node, idx) for node, idx in by_node.items()]:
                f.result()
        else:
            for node, idx in by_node.items():
                run(node, idx)
        return out

    def ping(self) -> bool:
        """Whether the server (every master of a cluster) answers now (ignores the retry
        interval)."""
        self._down_until = 0.0
        if not self.cluster:
            client = self._get_client()
            if client is None:
                return False
            try:
                return bool(client.ping())
            except Exception as exc:
                self._failed(exc)
                return False
        self._node_down.clear()
        self._refresh = True
        slots = self._slot_map()
        if slots is None or any(n is None for n in slots):
            return False
        for node in dict.fromkeys(slots):
            assert node is not None
            try:
                if not self._node_client(node).ping():
                    return False
            except Exception as exc:
                self._node_failed(node, exc)
                return False
        return True

    # -- the Tier interface --------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds without a gap (0 when
        unreachable). One pipelined round trip per ``chunk`` keys, stopping at a gap."""
        check_keys(keys)
        found = 0
        for s in range(0, len(keys), self.chunk):
            part = keys[s:s + self.chunk]
            results = self._call("exists", [self.namespace + k for k in part])
            if results is None:
                return found
            run = leading_run([r is not _FAIL and bool(r) for r in results])
            found += run
            if run < len(part):
                break
        return found

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of ``keys`` (False where unreachable): one pipelined
        round trip per ``chunk`` keys."""
        check_keys(keys)
        out: list[bool] = []
        for s in range(0, len(keys), self.chunk):
            part = keys[s:s + self.chunk]
            results = self._call("exists", [self.namespace + k for k in part])
            if results is None:
                return out + [False] * (len(keys) - len(out))
            out.extend(r is not _FAIL and bool(r) for r in results)
        return out

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The value of each key, None where absent (all None when unreachable; in a cluster,
        None for the keys of a master that is down)."""
        check_keys(keys)
        if not keys:
            return []
        results = self._call("get", [self.namespace + k for k in keys])
        if results is None:
            return [None] * len(keys)
        values: list[Buffer | None] = [None if r is _FAIL else r for r in results]
        self.stats.merge({"gets": len(keys), "get_hits": sum(v is not None for v in values)})
        return values

    def store(self, items: Sequence[StoreItem]) -> None:
        """Queue (key, value) pairs for the background writer (or write them now when
        ``sync_stores``); never raises for a store that is down or full."""
        check_items(items)
        if self._writer is None:
            self.store_now(list(items))
            return
        dropped = self._writer.submit(items)
        if dropped and self.on_written is not None:
            self.on_written((), [k for k, _ in dropped])

    def store_now(self, items: Sequence[StoreItem]) -> int:
        """Write pairs in pipelined SETs now; returns how many the server accepted. Refused
        writes (e.g. out of memory under ``noeviction``) and failures count as dropped."""
        if not items:
            return 0
        results = self._call("set", [self.namespace + k for k, _ in items], [v for _, v in items])
        if results is None:
            results = [_FAIL] * len(items)
        ok = sum(r is True for r in results)
        refused = [r for r in results if r is not True and r is not _FAIL]
        failed = len(items) - ok
        if refused:
            self._note_error(refused[0] if isinstance(refused[0], Exception) else repr(refused[0]))
        self.stats.merge({"stores": ok, "store_errors": len(refused), "dropped_stores": failed})
        if self.on_written is not None:
            self.on_written([k for (k, _), r in zip(items, results, strict=True) if r is True],
                            [k for (k, _), r in zip(items, results, strict=True) if r is not True])
        return ok

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued stores are written or dropped; False on timeout."""
        return True if self._writer is None else self._writer.flush(timeout)

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many existed (0 when unreachable)."""
        check_keys(keys)
        if not keys:
            return 0
        results = self._call("delete", [self.namespace + k for k in keys])
        return 0 if results is None else sum(int(r) for r in results if r is not _FAIL)

    def close(self) -> None:
        """Stop the writer (after what is queued, briefly) and close connections."""
        if self._writer is not None:
            self._writer.close(timeout=max(1.0, 2 * self.timeout_s))
        with self._lock:
            clients = [self._client, *self._node_clients.values()]
            self._client = None
            self._node_clients = {}
            pool, self._pool = self._pool, None
        _close_all(clients)
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> ValkeyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ValkeyStore({self.url!r}, cluster={self.cluster})"


def _queue(pipe: Any, op: str, name: bytes, value: Buffer | None, ttl_ms: int | None) -> None:
    if op == "exists":
        pipe.exists(name)
    elif op == "get":
        pipe.get(name)
    elif op == "set":
        pipe.set(name, value, px=ttl_ms)
    else:
        pipe.delete(name)


def _close_all(clients: Sequence[Any]) -> None:
    for client in clients:
        if client is not None:  # drop stale connections: the next try connects afresh
            try:
                client.close()
            except Exception:
                pass
