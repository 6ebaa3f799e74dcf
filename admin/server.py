"""Serving the admin app with uvicorn on a thread of the manager process.

Why a thread and not a process: the admin reads the manager's state directly (snapshots,
counters, the worker table), which only works inside the process that owns it.

Why the socket is bound in the constructor, before uvicorn starts: `kvtier serve` binds it
before starting any worker, so a port already in use is a one-line error at once rather than
after the workers were built; and with `admin.port = 0` the real port is known (and printed)
the moment the socket exists.

Why a protocol of our own (`TimedH11Protocol`, uvicorn's h11 protocol plus three limits):
uvicorn arms no timer on a connection until its first response, so a client that connects and
sends nothing, or trickles its headers or body, holds a connection (and a file descriptor)
forever. Here every request must arrive whole (headers and body) within
`admin.request_timeout_s` of its first byte, or of the connection's opening (408 and closed
when something arrived, closed otherwise); an idle keep-alive connection is closed after
`admin.keep_alive_s`. Request headers are limited to 16 KiB by h11 (400 beyond).

A connection beyond `admin.max_connections` open ones takes the place of the one that has
waited longest without a request in progress (silent since it opened, trickling headers or a
body, or idle between requests): that one is closed (with a 503 naming the limit when it had
sent part of a request). Only when every open connection has a request being handled is the
new one answered 503 and closed. So a local user who holds every connection open, trickling
bytes, cannot starve the health probes or an operator (issue 27: 19 of 25 probes got 503):
their requests arrive whole at once and are in progress before a newer staller comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from kvtier.manager.config import AdminConfig
from kvtier.manager.errors import KvtierError
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

log = logging.getLogger("kvtier.admin")


MAX_HEADER_BYTES = 16 * 1024
"""h11's limit on a request's line and headers; uvicorn answers 400 beyond it."""


class AdminUvicornConfig(uvicorn.Config):
    """uvicorn's configuration plus the admin's connection limits, which the protocol reads."""

    def __init__(self, app: FastAPI, limits: AdminConfig, **kwargs: Any) -> None:
        super().__init__(app, http=TimedH11Protocol, ws="none",
                         timeout_keep_alive=limits.keep_alive_s,
                         h11_max_incomplete_event_size=MAX_HEADER_BYTES, **kwargs)
        self.request_timeout_s = limits.request_timeout_s
        self.max_connections = limits.max_connections


def _raw_response(status: int, reason: str, detail: str) -> bytes:
    """A whole HTTP/1.1 response with a JSON body, for answers given outside h11's state
    machine (before a request was parsed, or instead of the one in progress)."""
    body = json.dumps({"detail": detail}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline per request and a connection limit (see the
    module docstring). The deadline runs from the connection's opening or a request's first
    byte until its last byte arrived; handlers taking long are not limited by it."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState,
                 app_state: dict[str, Any], _loop: asyncio.AbstractEventLoop | None = None,
                 ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        limits = config if isinstance(config, AdminUvicornConfig) else None
        self.request_timeout_s = limits.request_timeout_s if limits else 10.0
        self.max_connections = limits.max_connections if limits else None
        self._deadline: asyncio.TimerHandle | None = None
        self._bytes_seen = False
        # since when the connection has had no request in progress (see `_waiting`)
        self._quiet_since = time.monotonic()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            victim = min((c for c in self.connections
                          if c is not self and isinstance(c, TimedH11Protocol)
                          and c._waiting() and not c.transport.is_closing()),
                         key=lambda c: c._quiet_since, default=None)
            if victim is None:  # every other connection has a request being handled
                self._refuse(self.transport)
                return
            victim._make_room()
        self._arm()

    def _refuse(self, transport: asyncio.Transport) -> None:
        transport.write(_raw_response(
            503, "Service Unavailable", f"more than admin.max_connections = "
            f"{self.max_connections} connections are open; try again later"))
        transport.close()

    def _waiting(self) -> bool:
        """No request of this connection is being handled: nothing or part of a request
        arrived (headers or body still coming), or it is idle between requests."""
        if self.conn.their_state is h11.SEND_BODY:
            return True
        cycle = self.cycle
        return self.conn.their_state is h11.IDLE and (
            cycle is None or cycle.response_complete)

    def _make_room(self) -> None:
        """Closed for a newer connection (see the module docstring)."""
        self._disarm()
        if self._bytes_seen or self.conn.their_state is h11.SEND_BODY:
            self._refuse(self.transport)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._bytes_seen = True
        if self._deadline is None:
            self._arm()
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._quiet_since = time.monotonic()
        if self.conn.their_state is h11.IDLE:
            self._bytes_seen = False
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _watch(self) -> None:
        """Keep the deadline only while a request is partly received."""
        arriving = self.conn.their_state is h11.SEND_BODY or (
            self.conn.their_state is h11.IDLE and self._bytes_seen)
        if not arriving:
            self._disarm()
        elif self._deadline is None:
            self._arm()

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        answered = cycle is not None and cycle.response_started and (
            self.conn.their_state is not h11.IDLE)
        if self._bytes_seen and not answered:
            self.transport.write(_raw_response(
                408, "Request Timeout", "the request did not arrive whole within "
                f"admin.request_timeout_s = {self.request_timeout_s:g} s"))
        self.transport.close()


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
                 sock: socket.socket | None = None, graceful_timeout_s: float = 5.0,
                 limits: AdminConfig | None = None) -> None:
        """Bind host:port now, or adopt `sock` (already bound by `bind_socket`). `limits`:
        the connection limits of `admin.*` (default: the embedded defaults)."""
        self.app = app
        self.host = host
        self.sock = sock if sock is not None else bind_socket(host, port)
        self.port: int = self.sock.getsockname()[1]
        config = AdminUvicornConfig(
            app, limits or AdminConfig(), log_config=None, log_level="warning",
            access_log=False, lifespan="off", proxy_headers=False,
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
