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
from urllib.parse import SplitResult, parse_qsl, unquote, urlsplit

from kvstore.tiers.base import (
    BackgroundWriter,
    StoreItem,
    TierStats,
    check_items,
    check_keys,
    leading_run,
)
from kvstore.tiers.codec import Buffer
from kvstore.utils import check_seconds

__all__ = ["URL_OPTIONS", "StoreConfigWarning", "ValkeyStore", "parse_store_url", "redact_url"]

_SCHEMES = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss"}
_CLUSTER_SCHEMES = {"valkey+cluster": "redis", "valkeys+cluster": "rediss",
                    "redis+cluster": "redis", "rediss+cluster": "rediss"}
_DEFAULT_PORT = 6379
#: The longest expiry a store sets, in milliseconds (about 146 million years): the server
#: refuses one whose deadline passes the range of its millisecond clock.
MAX_TTL_MS = 1 << 62
_NUM_SLOTS = 16384
#: Called with the keys the server accepted and the keys that were not written.
WrittenFn = Callable[[Sequence[bytes], Sequence[bytes]], None]


class StoreConfigWarning(UserWarning):
    """The store refuses this client for a reason only the operator can fix (credentials,
    database index, ACL): every lookup misses until it is fixed."""


def _split(url: str) -> SplitResult | None:
    """``url``'s parts when it reads as ``scheme://netloc...`` with no ``@`` after the
    netloc; else None: where its user-info ends is unclear (a ``/``, ``?`` or ``#`` in a
    password not percent-encoded, a scheme typo, a bad IPv6 address)."""
    if "://" not in url:
        return None
    try:
        parts = urlsplit(url)
    except ValueError:
        return None
    if "@" in parts.path + parts.query + parts.fragment:
        return None
    return parts


def redact_url(url: str) -> str:
    """``url`` safe to show: the password (or a user-info without ``:``, which may be one)
    as ``***``, and so the value of each query option outside ``URL_OPTIONS`` and any
    fragment; a URL that does not parse (``_split``) is not shown at all, nor a string
    holding ``@``, ``?`` or ``#`` without ``://``. Never raises."""
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    if "://" not in url and not any(c in url for c in "@?#"):
        return url  # no URL: nothing in it can be a password
    parts = _split(url)
    if parts is None:
        return "<malformed URL, not shown>"
    userinfo, at, hosts = parts.netloc.rpartition("@")
    shown = f"{parts.scheme}://"
    if at:
        shown += f"{userinfo.partition(':')[0]}:***@" if ":" in userinfo else "***@"
    shown += hosts + parts.path
    if parts.query:
        pieces = [p.partition("=") for p in parts.query.split("&")]
        shown += "?" + "&".join(name + eq + (value if unquote(name) in URL_OPTIONS else "***")
                                if eq else "***" for name, eq, value in pieces)
    return shown + ("#***" if parts.fragment else "")


def _seconds(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    return check_seconds(value, name)


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


def _client_name(name: str, text: str) -> str:
    # the server refuses a name with a space, a newline or a character outside '!'..'~'
    if not text or not all("!" <= c <= "~" for c in text):
        raise ValueError(f"{name}={text!r} must be printable ASCII without spaces (Valkey "
                         "refuses other names, and with them every connection)")
    return text


#: The query options a store URL may carry, each parsed and checked at construction. The
#: ``ssl_*`` ones need a TLS scheme. ``socket_timeout`` / ``socket_connect_timeout`` may
#: only lower the store's ``timeout_s`` / ``connect_timeout_s``.
URL_OPTIONS: dict[str, Callable[[str, str], Any]] = {
    "socket_timeout": _seconds,
    "socket_connect_timeout": _seconds,
    "client_name": _client_name,
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
    parts = _split(url)
    if parts is None:
        raise ValueError(f"store URL {shown!r} is malformed: expected scheme://[user:password@]"
                         "host:port/db ([address]:port for IPv6); percent-encode '/', '?', "
                         "'#', '@' and '%' in a password, and '@' after the host (%2F, %3F, "
                         "%23, %40, %25)")
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
        try:
            sub = urlsplit("//" + entry)
            host, port = sub.hostname, sub.port
        except ValueError:  # a bad IPv6 address, or a port that is no number in 0..65535
            host, port = entry, -1
        if not host:
            raise ValueError(f"store URL {shown!r} has no host (expected valkey://host:port/db)")
        if port in (0, -1) or port is None and entry.endswith(":"):
            raise ValueError(f"store URL {shown!r}: {entry!r} must be host:port with a port in "
                             "1..65535 ([address]:port for IPv6)")
        nodes.append((host, port or _DEFAULT_PORT))
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
        raise ValueError(f"store URL {shown!r}: malformed query (expected "
                         "?option=value&option=value)") from None
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
        ttl_ms = None if ttl_s is None else round(check_seconds(ttl_s, "ttl_s") * 1000)
        if ttl_ms is not None and not 1 <= ttl_ms <= MAX_TTL_MS:
            raise ValueError(f"ttl_s must be in [0.001, {MAX_TTL_MS // 1000}] (expiry is in "
                             f"milliseconds, and the server refuses one past its clock's "
                             f"range), got {ttl_s!r}")
        self.timeout_s = check_seconds(timeout_s, "timeout_s")
        self.connect_timeout_s = check_seconds(
            timeout_s if connect_timeout_s is None else connect_timeout_s, "connect_timeout_s")
        self.retry_interval_s = check_seconds(retry_interval_s, "retry_interval_s")
        if not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        if not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections must be a positive int, got {max_connections!r}")
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
        self.ttl_ms = ttl_ms
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
                                    username=a.username, password=a.password, db=a.db, ssl=a.tls,
                                    redis_connect_func=_bound_round_trips)
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
        """The server failed: drop connections, skip it a while."""
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
        (from the first answering node among those known, then the URL's seeds, skipping
        nodes down and giving up once ``timeout_s`` has passed); None while no node
        answers."""
        now = time.monotonic()
        if now < self._down_until:
            return None
        if self._slots is not None and not self._refresh:
            return self._slots
        seeds = [n for n in dict.fromkeys(self._known + self._address.nodes) if self._node_up(n, now)]
        failed = False
        for node in seeds:
            if failed and time.monotonic() > now + self.timeout_s:
                break  # the cluster is hung, not just a seed down: one timeout per call
            try:
                reply = self._node_client(node).execute_command("CLUSTER", "SLOTS")
            except Exception as exc:
                self._node_failed(node, exc)
                failed = True
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
        if failed:  # no node answered: skip them all a while, as a single server
            self._down_until = time.monotonic() + self.retry_interval_s
        return None  # (or every node is down: skipped, as their keys are)

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
        items = check_items(items)
        if self._writer is None:
            self.store_now(items)
            return
        dropped = self._writer.submit(items)
        if dropped and self.on_written is not None:
            self.on_written((), [k for k, _ in dropped])

    def store_now(self, items: Sequence[StoreItem]) -> int:
        """Write pairs in pipelined SETs now; returns how many the server accepted. Refused
        writes (e.g. out of memory under ``noeviction``) and failures count as dropped.
        ValueError for bad items, as ``store``."""
        items = check_items(items)
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


class _RoundTrip:
    """A connected socket (plain or TLS) whose round trips each end ``timeout`` seconds
    after they begin (the first send after a read begins one): each send and blocking read
    waits at most the time left, then raises ``TimeoutError`` (``socket.timeout``), so a
    server that drips its answer holds a call no longer than a hung one. Everything else is
    the socket's own."""

    def __init__(self, sock: Any, timeout: float) -> None:
        self._sock = sock
        self._timeout = timeout
        self._wait: float | None = timeout  # what the client last asked for (settimeout)
        self._deadline = 0.0
        self._answered = True  # read since the last send: the next send begins a round trip

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def settimeout(self, wait: float | None) -> None:
        self._wait = wait

    def gettimeout(self) -> float | None:
        return self._wait

    def _arm(self) -> None:
        wait = self._wait
        if wait != 0:  # 0: a poll, which never waits
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("round trip exceeded the store's timeout")
            wait = left if wait is None else min(wait, left)
        self._sock.settimeout(wait)

    def sendall(self, *args: Any) -> None:
        if self._answered:
            self._deadline, self._answered = time.monotonic() + self._timeout, False
        self._arm()
        self._sock.sendall(*args)

    def recv(self, *args: Any) -> Any:
        self._arm()
        self._answered = True
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._arm()
        self._answered = True
        return self._sock.recv_into(*args)


def _bound_round_trips(connection: Any) -> None:
    """The client calls this as each connection opens: bound its round trips by its socket
    timeout (``_RoundTrip``), then greet the server as the client would."""
    connection._sock = _RoundTrip(connection._sock, connection.socket_timeout)
    connection.on_connect()


def _close_all(clients: Sequence[Any]) -> None:
    for client in clients:
        if client is not None:  # drop stale connections: the next try connects afresh
            try:
                client.close()
            except Exception:
                pass
