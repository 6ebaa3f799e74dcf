"""Serving the admin app with uvicorn on a thread of the manager process.

Why a thread and not a process: the admin reads the manager's state directly (snapshots,
counters, the worker table), which only works inside the process that owns it.

Why the socket is bound in the constructor, before uvicorn starts: `kvtier serve` binds it
before starting any worker, so a port already in use is a one-line error at once rather than
after the workers were built; and with `admin.port = 0` the real port is known (and printed)
the moment the socket exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI
from kvtier.manager.errors import KvtierError

log = logging.getLogger("kvtier.admin")


class AdminBindError(KvtierError, OSError):
    """The admin address cannot be bound; the message names the address and the reason."""


class AdminStartError(KvtierError, RuntimeError):
    """uvicorn did not start serving the bound socket."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port), IPv4 or IPv6 as `host`
    resolves. Raises AdminBindError naming the address."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise AdminBindError(f"cannot resolve admin.host {host!r}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise AdminBindError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


class AdminServer:
    """One uvicorn server for `app` on a daemon thread, on a socket bound at construction.

    Life cycle: `AdminServer(app, host, port)` binds -> `start()` serves (returns once
    uvicorn accepts connections) -> `stop()` finishes in-flight requests (bounded) and closes
    the socket. `stop()` is idempotent and safe before `start()`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *,
                 sock: socket.socket | None = None, graceful_timeout_s: float = 5.0) -> None:
        """Bind host:port now, or adopt `sock` (already bound by `bind_socket`)."""
        self.app = app
        self.host = host
        self.sock = sock if sock is not None else bind_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        config = uvicorn.Config(
            app, log_config=None, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=int(max(1, graceful_timeout_s)))
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{shown}:{self.port}"

    def start(self, timeout: float = 10.0) -> AdminServer:
        """Serve on the thread; return once uvicorn is accepting connections
        (AdminStartError if it stopped or did not get there within `timeout` seconds)."""
        self._thread = threading.Thread(target=self._run, name="kvtier-admin", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise AdminStartError(f"the admin server stopped while starting: {self._error}")
            if time.monotonic() > deadline:
                self.stop()
                raise AdminStartError(f"the admin server did not start within {timeout:g} s")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # SystemExit from a failed uvicorn startup included
            self._error = e
            log.error("admin server stopped: %r", e)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting connections, let requests in flight finish (bounded by the graceful
        timeout), then close the socket."""
        self.server.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            if self._thread.is_alive():
                self.server.force_exit = True
                self._thread.join(5.0)
        with contextlib.suppress(OSError):
            self.sock.close()
