"""A shared store on Mooncake Store (``pip install mooncake-transfer-engine-non-cuda``; on
Debian it also needs ``libibverbs1`` and ``librdmacm1``). Each engine process is a Mooncake
client that contributes ``segment_bytes`` of its memory to the pool and talks to one
``mooncake_master`` (which here also serves the transfer metadata over HTTP).

Opt-in and not part of CI: see docs/tiers.md for why (its listeners bind every interface,
the wheel is large, and its fault behaviour is not bounded by a socket timeout)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.tiers.base import BackgroundWriter, StoreItem, TierStats, check_items, check_keys, leading_run
from kvstore.tiers.codec import Buffer

HOST = "127.0.0.1"


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """For ``preexec_fn``: on Linux the child gets SIGTERM when the process that started it
    exits, however it exits."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class MooncakeStore:
    """The ``Tier`` on Mooncake Store. ``master`` is ``host:port`` of mooncake_master,
    ``metadata`` its metadata URL (``http://host:port/metadata``). Keys are stored as
    ``namespace`` + hex; stores are upserts (the last writer wins) from a background writer
    unless ``sync_stores``. A failing call is a miss (or a drop) and a count in ``stats``."""

    name = "mooncake"

    def __init__(self, master: str, metadata: str, *, local_hostname: str = HOST,
                 segment_bytes: int = 256 << 20, buffer_bytes: int = 64 << 20, protocol: str = "tcp",
                 rdma_devices: str = "", namespace: str = "kvstore:", max_queue: int = 1024,
                 write_batch: int = 32, sync_stores: bool = False) -> None:
        try:
            MooncakeDistributedStore = importlib.import_module("mooncake.store").MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("MooncakeStore needs `pip install mooncake-transfer-engine-non-cuda` "
                              f"(and Debian's libibverbs1, librdmacm1): {exc}") from exc
        self.namespace = namespace
        self.stats = TierStats()
        self.last_error: str | None = None
        self._store: Any = MooncakeDistributedStore()
        rc = self._store.setup(local_hostname, metadata, segment_bytes, buffer_bytes, protocol,
                               rdma_devices, master)
        if rc != 0:
            raise ConnectionError(f"Mooncake setup against master {master} (metadata {metadata}) "
                                  f"returned {rc}")
        self._writer = None if sync_stores else BackgroundWriter(
            self.store_now, self.stats, max_queue=max_queue, batch=write_batch,
            name="kvstore-mooncake-writer")

    def _names(self, keys: Sequence[bytes]) -> list[str]:
        return [self.namespace + k.hex() for k in keys]

    def _failed(self, what: str) -> None:
        self.stats.add("errors")
        self.last_error = what

    def contains(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the store holds without a gap."""
        return leading_run(self.present(keys))

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each of ``keys`` (all False on failure)."""
        check_keys(keys)
        if not keys:
            return []
        try:
            flags = self._store.batch_is_exist(self._names(keys))
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return [False] * len(keys)
        if any(f < 0 for f in flags):
            self._failed("batch_is_exist reported an error")
        return [f == 1 for f in flags]

    def load(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """The value of each key, None where absent or on failure."""
        check_keys(keys)
        if not keys:
            return []
        try:
            got = self._store.get_batch(self._names(keys))
        except Exception as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return [None] * len(keys)
        values: list[Buffer | None] = [v if v else None for v in got]  # b"": absent
        self.stats.merge({"gets": len(keys), "get_hits": sum(v is not None for v in values)})
        return values

    def store(self, items: Sequence[StoreItem]) -> None:
        """Queue (key, value) pairs for the background writer (or write them now)."""
        check_items(items)
        if self._writer is None:
            self.store_now(list(items))
        else:
            self._writer.submit(items)

    def store_now(self, items: Sequence[StoreItem]) -> int:
        """Upsert pairs now; returns how many were written (all or none per batch)."""
        if not items:
            return 0
        try:
            rc = self._store.upsert_batch(self._names([k for k, _ in items]), [v for _, v in items])
        except Exception as exc:
            rc = -1
            self.last_error = f"{type(exc).__name__}: {exc}"
        if rc != 0:
            self._failed(self.last_error if rc == -1 and self.last_error else f"upsert_batch returned {rc}")
            self.stats.add("dropped_stores", len(items))
            return 0
        self.stats.add("stores", len(items))
        return len(items)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued stores are written or dropped; False on timeout."""
        return True if self._writer is None else self._writer.flush(timeout)

    def close(self) -> None:
        """Stop the writer and leave the pool (its segment is unmounted)."""
        if self._writer is not None:
            self._writer.close()
        with contextlib.suppress(Exception):
            self._store.close()


def find_master_binary() -> str:
    """The mooncake_master executable shipped in the mooncake wheel."""
    try:
        mooncake = importlib.import_module("mooncake")
    except ImportError as exc:
        raise FileNotFoundError("no mooncake_master: pip install mooncake-transfer-engine-non-cuda") from exc
    path = Path(str(mooncake.__file__)).parent / "mooncake_master"
    if not path.is_file():
        raise FileNotFoundError(f"no mooncake_master in {path.parent}")
    return str(path)


class MooncakeMaster:
    """A mooncake_master with its HTTP metadata server, asked to bind 127.0.0.1 (its RPC
    port does; the metadata server and the clients' transfer ports listen on every
    interface regardless, see docs/tiers.md). Dies with the process that started it."""

    def __init__(self) -> None:
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        """``127.0.0.1:RPC_PORT``."""
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        """The metadata server's URL."""
        return f"http://{HOST}:{self.http_port}/metadata"

    def start(self, timeout: float = 15.0) -> MooncakeMaster:
        """Start it and wait until its RPC port accepts connections."""
        import socket

        cmd = [find_master_binary(), f"-rpc_port={self.rpc_port}", f"-rpc_address={HOST}",
               "-enable_http_metadata_server=true", f"-http_metadata_server_host={HOST}",
               f"-http_metadata_server_port={self.http_port}", f"-metrics_host={HOST}",
               f"-metrics_port={self.metrics_port}", "-enable_metric_reporting=false"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                     env=dict(os.environ, GLOG_minloglevel="2"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            for port in (self.rpc_port, self.http_port):
                try:
                    socket.create_connection((HOST, port), timeout=0.2).close()
                except OSError:
                    break
            else:
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not come up on {self.master} within {timeout}s")

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
