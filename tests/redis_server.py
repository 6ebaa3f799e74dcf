"""A real `redis-server` process on a free 127.0.0.1 port, for tests and benchmarks.

Storage tests run against the Redis that production uses, not a fake: only a real server shows
real timeouts, refused connections and recovery. The server persists nothing (`--save ""`,
`--appendonly no`), works in its own temp directory, and every wait on it is bounded. For outage
tests it can be killed, paused (SIGSTOP: a server that accepts connections but never answers)
and restarted on the same port, which is what a client sees when its Redis restarts. Security
tests give it extra arguments (`--requirepass`, `--user` ACL rules) or TLS files made by
`make_tls_files` (a private CA and a server certificate for 127.0.0.1, with the openssl CLI):
it then listens with TLS only and `url` is a `rediss://` URL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def redis_server_binary() -> str:
    """Path of `redis-server`, or a RuntimeError that says how to install it."""
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server is not installed or not on PATH; the storage tests need a real "
            "Redis server (Debian/Ubuntu: apt-get install -y redis-server)"
        )
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(port: int, timeout_s: float = 0.2, *, auth_required: bool = False) -> bool:
    """True if a Redis server on 127.0.0.1:`port` answers PING within `timeout_s` (with
    `auth_required`, a NOAUTH refusal counts as an answer: the server is up)."""
    answers = (b"+PONG", b"-NOAUTH") if auth_required else (b"+PONG",)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(answers)
    except OSError:
        return False


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a private CA and of a server certificate it signed for 127.0.0.1."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(folder: Path) -> TlsFiles:
    """A throw-away CA and a server certificate (subjectAltName IP:127.0.0.1, so hostname
    checks pass) under `folder`, made with the openssl CLI in well under a second (EC keys)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl is not on PATH (Debian/Ubuntu: apt-get install -y openssl)")
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"
    cert, key, csr = folder / "server.pem", folder / "server.key", folder / "server.csr"
    ext = folder / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\nbasicConstraints = CA:FALSE\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=kvtier test CA"],
        [openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"openssl failed: {' '.join(step[:3])}: {done.stderr[-500:]}")
    return TlsFiles(ca=ca, cert=cert, key=key)


class RedisServer:
    """One redis-server child process.

    State: `port` (fixed once the first start succeeds, reused by `restart`), `proc` (the
    running child or None), `workdir` (temp dir holding the server's log; removed by `stop`).
    Invariant: when a method returns, `proc` is either None or a server answering PING.
    """

    def __init__(self, port: int | None = None, *, extra_args: Sequence[str] = (),
                 tls: TlsFiles | None = None) -> None:
        self.binary = redis_server_binary()
        self.port = port
        self.extra_args = list(extra_args)
        self.tls = tls
        # a server that wants a password answers a bare PING with NOAUTH: still up
        self._auth_required = any(a in ("--requirepass", "--user") for a in self.extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.workdir = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
        self._log_start = 0

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://127.0.0.1:{self.port}/0"

    def _listen_args(self, port: int) -> list[str]:
        if self.tls is None:
            return ["--port", str(port)]
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.tls.cert),
                "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "no"]

    def _ready(self, port: int) -> bool:
        if self.tls is None:
            return ping(port, auth_required=self._auth_required)
        # a plain PING cannot cross TLS: the server logs when it listens (this start's part of
        # the log only: a restart appends to the same file)
        with contextlib.suppress(OSError), open(self.workdir / "redis.log", "rb") as log:
            log.seek(self._log_start)
            return b"Ready to accept connections" in log.read()
        return False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> RedisServer:
        """Start the server (on a free port unless one is fixed) and wait for PING."""
        if self.proc is not None:
            raise RuntimeError(f"redis-server already running on port {self.port}")
        attempts = 1 if self.port is not None else 3
        last_error = ""
        for _ in range(attempts):
            port = self.port if self.port is not None else free_port()
            error = self._spawn_and_wait(port)
            if error is None:
                self.port = port
                return self
            last_error = error
        raise RuntimeError(f"redis-server did not start: {last_error}")

    def _spawn_and_wait(self, port: int) -> str | None:
        log_path = self.workdir / "redis.log"
        self._log_start = log_path.stat().st_size if log_path.exists() else 0
        with open(self.workdir / "stdout.log", "ab") as out:
            proc = subprocess.Popen(
                [
                    self.binary,
                    *self._listen_args(port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--daemonize", "no",
                    "--dir", str(self.workdir),
                    "--logfile", str(log_path),
                    *self.extra_args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return f"exited with {proc.returncode} on port {port}: {self._log_tail()}"
            if self._ready(port):
                self.proc = proc
                return None
            time.sleep(0.02)
        self._reap(proc, signal.SIGKILL)
        return f"no PING answer on port {port} within {START_TIMEOUT_S}s: {self._log_tail()}"

    def _log_tail(self) -> str:
        text = ""
        for name in ("redis.log", "stdout.log"):
            with contextlib.suppress(OSError):
                text += (self.workdir / name).read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-3:])

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes], sig: int) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL the server (an abrupt outage) and reap it; the port stays reserved for
        `restart`."""
        if self.proc is not None:
            self.resume()
            self._reap(self.proc, signal.SIGKILL)
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections but nothing is answered."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> RedisServer:
        """Start again on the same port (after `kill`), empty, as a restarted Redis is."""
        if self.port is None:
            raise RuntimeError("restart() needs a server that was started once")
        self.kill()
        return self.start()

    def stop(self) -> None:
        """Terminate the server, reap it and remove its directory. Safe to call twice."""
        if self.proc is not None:
            self.resume()
            self._reap(self.proc, signal.SIGTERM)
            self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    """A redis-server shared by the tests of one module. Fails (does not skip) when
    redis-server is missing: the storage tier must be tested against real Redis."""
    try:
        server: RedisServer | None = RedisServer()
        problem = ""
    except RuntimeError as exc:
        server, problem = None, str(exc)
    if server is None:
        pytest.fail(problem, pytrace=False)
    with server:
        yield server


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(50):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


class RedisClusterServers:
    """A real Redis Cluster of `nodes` primaries (no replicas) on 127.0.0.1, each a
    `redis-server --cluster-enabled yes` child, joined with `redis-cli --cluster create`.

    State: `ports` (one per node), `procs`, `workdir` (node configs and logs; removed by
    `stop`). Invariant: when `start` returns, every node reports `cluster_state:ok`.
    """

    def __init__(self, nodes: int = 3) -> None:
        self.binary = redis_server_binary()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (Debian: apt-get install -y "
                               "redis-tools, which redis-server pulls in)")
        self.cli = cli
        self.nodes = nodes
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="kvtier-redis-cluster-"))

    @property
    def url(self) -> str:
        """What kvtier's storage.url takes: any one node, with the cluster scheme."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self) -> RedisClusterServers:
        try:
            for i in range(self.nodes):
                port = _cluster_port()
                node_dir = self.workdir / f"node{i}"
                node_dir.mkdir()
                with open(node_dir / "stdout.log", "ab") as out:
                    self.procs.append(subprocess.Popen(
                        [self.binary, "--port", str(port), "--bind", "127.0.0.1",
                         "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                         "--cluster-node-timeout", "2000", "--save", "", "--appendonly", "no",
                         "--daemonize", "no", "--dir", str(node_dir),
                         "--logfile", str(node_dir / "redis.log")],
                        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
                self.ports.append(port)
            for port, proc in zip(self.ports, self.procs, strict=True):
                self._wait(lambda port=port: ping(port), f"node {port} to answer PING", proc)
            created = subprocess.run(
                [self.cli, "--cluster", "create",
                 *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", "0", "--cluster-yes"],
                capture_output=True, text=True, timeout=START_TIMEOUT_S)
            if created.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: "
                                   f"{(created.stdout + created.stderr)[-500:]}")
            for port in self.ports:
                self._wait(lambda port=port: self._state_ok(port),
                           f"node {port} to report cluster_state:ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _state_ok(self, port: int) -> bool:
        info = subprocess.run([self.cli, "-p", str(port), "cluster", "info"],
                              capture_output=True, text=True, timeout=2)
        return "cluster_state:ok" in info.stdout

    @staticmethod
    def _wait(ready: Callable[[], bool], what: str,
              proc: subprocess.Popen[bytes] | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode} waiting for "
                                   f"{what}")
            if ready():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out after {START_TIMEOUT_S}s waiting for {what}")

    def stop(self) -> None:
        """Terminate every node, reap it and remove the directory. Safe to call twice."""
        for proc in self.procs:
            RedisServer._reap(proc, signal.SIGTERM)
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A 3-node Redis Cluster shared by the tests of one module (fails when redis-server or
    redis-cli is missing, like `redis_server`)."""
    try:
        cluster = RedisClusterServers()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    with cluster:
        yield cluster
