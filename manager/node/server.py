"""The node service's engine endpoint: a Unix socket, one session per engine connection.

`kvtier serve` opens it (`NodeServer(cfg).start()`). Only local engines can reach it: a Unix
stream socket in a private directory (0700; 0710 and group-owned with `node.allowed_gid`),
the socket file 0600 (0660), each peer checked with SO_PEERCRED (the service's uid, or the
allowed primary gid). No TCP. A `node.lock` file in the directory, flocked for the service's
life, makes a second service on the same path fail at start; the socket a dead service left
is removed and bound again.

One session per connection, each on a thread of its own, so a slow engine only ever waits
for itself. Bounds (issue 34): deadlines, not idle timeouts (a byte now and then extends
nothing); connections that have not said HELLO are a pool of their own (`_connecting`, at
most node.max_connecting, the oldest dropped for a new one: a real engine says HELLO at
once, so a flood only pushes out the flood) and never count against node.max_engines; the
listen backlog is LISTEN_BACKLOG and the accept loop only accepts and hands off; an OPS frame
holds at most wire.MAX_FRAME_KEYS keys and is worked in slices of wire.SLICE_KEYS keys, one
keyed-cache call (one hold of the namespace's lock) each::

    connected    peer credentials checked (refused: ERROR frame, closed, one log line)
      -> HELLO, whole within node.hello_deadline_s of the accept (at most MAX_HELLO bytes of
         JSON nested at most MAX_JSON_DEPTH deep)
                                     counted against node.max_engines from here; namespace
                                     attached (`namespaces.Namespaces.attach`, its stack
                                     started on the first attach)  -> WELCOME
      -> OPS frames                  one-way ops applied in order; the asking op answered
                                     with one REPLY. Completions count only for keys this
                                     session prepared (another engine's copies are not its to
                                     finish). After EVENTS on, every REPLY carries the
                                     namespace's tier events this session has not had (its
                                     reader of `Namespace.fanout`)
      -> closed / killed / bad frame / reply not read within node.send_timeout_s
         (SO_SNDTIMEO) / a frame not whole within node.frame_deadline_s of its first byte
                                     session ends: its open loads unpinned at once, its open
                                     stores abandoned (never served) and their host blocks
                                     freed after node.abandon_grace_s (a copy the engine had
                                     started may still land), its storage queries forgotten,
                                     its events reader dropped; everything else stays cached

A stop with node.handover (issue 37) writes every namespace's ready host copies to the
hand-over file in the socket's folder and keeps the pools (`handover`); a start reads it
(`Adoption.load`, under the lock) and the namespaces adopt it as they attach; a completed
store is checksummed into the namespace's crash journal before it is published
(`journal`).

`kvtier serve --takeover` (`take_over`): the new service connects like an engine and sends
TAKEOVER instead of HELLO (`wire`, `takeover.ask`); the old one checks the peer's uid and
the deployment, answers TAKEN and stops (`on_takeover`), handing over whatever
`node.handover` says; the new one waits for the old one's `node.lock` (bounded), then
starts as after any restart. A start that found a hand-over starts its namespaces at once
(`_prestart`), so their stacks are up, or starting, when the engines reattach.

Request ids are the engine's; they are kept apart per session (`<session>:<id>`), so two
engines using the same ids never share a storage query.

Data structures: `NodeServer._sessions`: session id -> `Session`; a session's open copies are
its `engine`, a `kvtier.manager.sessions.EngineSession` over its namespace's cache with the
session id as owner (the embedded home's room too); `graves`: the one `Graves` of every
namespace, the abandoned stores held `node.abandon_grace_s` seconds, then released.
Invariant: a session's `engine.stores` / `engine.loads` count, per key, the copies it
prepared and has not completed; they are exactly what its end gives back.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvtier.manager.config import KvtierConfig
from kvtier.manager.errors import KvtierError
from kvtier.manager.launcher import WarmWorkers
from kvtier.manager.node import wire
from kvtier.manager.node.events import EventPublisher
from kvtier.manager.node.handover import Adoption, snapshot, write_handover
from kvtier.manager.node.namespaces import NamespaceRefused, Namespaces
from kvtier.manager.node.ops import Session, apply_ops
from kvtier.manager.node.takeover import TakeoverError, ask
from kvtier.manager.sessions import EngineSession, Graves

log = logging.getLogger("kvtier.node")

LISTEN_BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
SOCKET_NAME = "node.sock"
LOCK_NAME = "node.lock"
_UCRED = struct.Struct("3i")


class NodeSocketError(KvtierError):
    """The engine socket cannot be opened (path, directory, another live service)."""


class NodeLockHeld(NodeSocketError):
    """Another live service holds the socket's lock."""




def socket_path(cfg: KvtierConfig, env: Mapping[str, str] | None = None) -> Path:
    """`node.socket`, or $XDG_RUNTIME_DIR/kvtier/<deployment_id>/node.sock, or the state
    directory's node.sock when XDG_RUNTIME_DIR is unset or not absolute."""
    if cfg.node.socket:
        return Path(cfg.node.socket).absolute()
    e = os.environ if env is None else env
    run = e.get("XDG_RUNTIME_DIR", "")
    if run and os.path.isabs(run):
        return Path(run) / "kvtier" / cfg.deployment_id / SOCKET_NAME
    state = e.get("XDG_STATE_HOME", "")
    base = Path(state) if state and os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "kvtier" / cfg.deployment_id / SOCKET_NAME




class NodeServer:
    """The engine endpoint of one `kvtier serve` (see the module docstring)."""

    def __init__(self, cfg: KvtierConfig, namespaces: Namespaces | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.cfg = cfg
        self.path = socket_path(cfg, env)
        self.namespaces = namespaces or Namespaces(cfg)
        # a predecessor's hand-over (issue 37): read at start, adopted as namespaces attach
        self.adoption = self.namespaces.adoption = Adoption(cfg.deployment_id)
        self.nonce = os.urandom(16).hex()
        self._sessions: dict[int, Session] = {}  # attached (said HELLO)
        # connection id -> socket of the connections that have not said HELLO yet, oldest
        # first (`node.max_connecting`; never counted against node.max_engines)
        self._connecting: dict[int, socket.socket] = {}
        self._evicted, self._evicted_logged = 0, 0.0
        self._ids = itertools.count(1)
        self.graves = Graves()  # abandoned stores, held node.abandon_grace_s seconds
        self.namespaces.graves = self.graves  # a hand-over's held pages go there too
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._lock_fd: int | None = None
        self._threads: list[threading.Thread] = []
        self.dropped = 0  # connections refused or dropped
        self.events: EventPublisher | None = None  # node.events: started by `start`
        # `kvtier serve --takeover` (issue 37): what stops this service when a new one asks
        # (the serve command's stop), and who asked
        self.on_takeover: Callable[[], None] | None = None
        self.taken_over: wire.Takeover | None = None
        self._taking = False  # a TAKEN being sent (one take-over at a time)

    # ------------------------------------------------------------------ life cycle

    def _open_dir(self, wait_until: float | None = None) -> None:
        """The socket's private folder, and its lock taken (`wait_until`, monotonic: polled
        until then while another service holds it; NodeLockHeld after)."""
        d = self.path.parent
        gid = self.cfg.node.allowed_gid
        mode = 0o700 if gid < 0 else 0o710
        if len(os.fsencode(self.path)) > 107:
            raise NodeSocketError(f"node.socket = {str(self.path)!r}: {len(str(self.path))} "
                                  "bytes, a Unix socket path has at most 107")
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                d.mkdir(mode=mode)
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise NodeSocketError(f"node.socket: {d} is not a directory of this user")
            if gid >= 0 and st.st_gid != gid:
                os.chown(d, -1, gid)
            os.chmod(d, mode)
            fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise NodeSocketError(f"node.socket: cannot prepare {d}: {e.strerror}") from None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                # a take-over waits here for the old service's stop: polled, a 2 ms step is
                # nothing next to the hand-over it waits for
                if wait_until is not None and time.monotonic() < wait_until:
                    time.sleep(0.002)
                    continue
                os.close(fd)
                raise NodeLockHeld(f"node.socket = {str(self.path)!r}: another kvtier serve "
                                   "holds it (its node.lock is locked)") from None
        self._lock_fd = fd

    def take_over(self, timeout_s: float) -> wire.Taken:
        """`kvtier serve --takeover`: ask the service on this socket what it runs (TAKEOVER
        `prepare`, see `wire`), start that many worker processes warm (their imports done
        while it still serves), ask it to hand over, wait for its stop (its lock released)
        within `timeout_s` in all, then `start` as usual (the hand-over read, the socket
        bound, its namespaces started on the warm workers). TakeoverError, one line:
        nothing listens there, a service of another uid or deployment, a refusal, no
        answer, or the lock still held at the bound (the old service is still stopping:
        this one gives up rather than start beside it)."""
        deadline = time.monotonic() + timeout_s
        asked = ask(self.path, wire.Takeover(self.cfg.deployment_id, os.getpid(), True),
                    deadline)
        if asked.workers:
            warm = self.namespaces.warm = WarmWorkers()
            warm.start(asked.workers)
            t0 = time.monotonic()
            # a bounded share of the time left: the rest is the old one's stop
            n = warm.wait_warm(max(0.0, (deadline - t0) / 2))
            log.info("%d of %d worker process(es) warm in %.2f s", n, asked.workers,
                     time.monotonic() - t0)
        try:
            taken = ask(self.path, wire.Takeover(self.cfg.deployment_id, os.getpid()),
                        deadline)
            log.info("taking over kvtier serve pid %d (instance %s): waiting for its "
                     "hand-over", taken.pid, taken.nonce[:8])
            self.start(lock_until=deadline)
        except BaseException as e:
            if self.namespaces.warm is not None:
                self.namespaces.warm.close()
            if isinstance(e, NodeLockHeld):
                raise TakeoverError(
                    f"--takeover: {self.path}: kvtier serve pid {taken.pid} did not hand "
                    f"over within {timeout_s:g} s (--takeover-timeout); it still holds the "
                    "socket, so this service exits rather than start beside it",
                    usage=False) from None
            raise
        return taken

    def start(self, lock_until: float | None = None) -> NodeServer:
        self._open_dir(lock_until)
        self.adoption.load(self.path.parent)  # ours alone now (the lock is held)
        self.adoption.sweep(self.cfg.node.handover)
        # read before any engine can attach: an attach takes its namespace's record
        handed_over = self.adoption.hellos()
        try:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a dead service's socket (we hold the lock)
                log.info("removed the socket a stopped kvtier serve left: %s", self.path)
            lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            lst.bind(str(self.path))
            os.chmod(self.path, 0o600 if self.cfg.node.allowed_gid < 0 else 0o660)
            if self.cfg.node.allowed_gid >= 0:
                os.chown(self.path, -1, self.cfg.node.allowed_gid)
            lst.listen(LISTEN_BACKLOG)
            lst.settimeout(0.2)
        except OSError as e:
            self._release_lock()
            raise NodeSocketError(f"node.socket = {str(self.path)!r}: {e.strerror}") from None
        self._listener = lst
        if self.cfg.node.events:
            try:
                self.events = EventPublisher(self.cfg, self.path.parent,
                                             self.namespaces.all).start()
            except KvtierError as e:
                lst.close()
                with contextlib.suppress(OSError):
                    self.path.unlink()
                self._release_lock()
                raise NodeSocketError(str(e)) from None
        for name, target in (("kvtier-node-accept", self._accept_loop),
                             ("kvtier-node-graves", self._grave_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("node socket listening on %s (instance %s)", self.path, self.nonce[:8])
        # the handed-over namespaces' stacks started now, not at their first engine's HELLO:
        # the engines reattach to a namespace already starting (its workers adopting)
        # (a prestart whose namespace an engine's HELLO is starting waits for that start:
        # when these threads are done, every handed-over namespace is up or refused)
        starts = [threading.Thread(target=self._prestart, args=(hello,), daemon=True,
                                   name="kvtier-node-prestart")
                  for hello in handed_over]
        for t in starts:
            t.start()
        if self.namespaces.warm is not None:  # the warm workers no stack took: stopped
            threading.Thread(target=self._close_warm, args=(starts,), daemon=True,
                             name="kvtier-node-warm").start()
        return self

    def _close_warm(self, starts: list[threading.Thread]) -> None:
        for t in starts:
            t.join()
        if self.namespaces.warm is not None:
            self.namespaces.warm.close()

    def _prestart(self, hello: wire.Hello) -> None:
        try:
            self.namespaces.attach(hello, None)
        except NamespaceRefused as e:
            log.warning("namespace %r: not started from the hand-over: %s", hello.namespace, e)
        except Exception:
            log.exception("namespace %r: not started from the hand-over", hello.namespace)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def stop(self) -> None:
        """Close every connection, free what they held, stop every namespace's stack."""
        if self._stop.is_set():
            return
        t0 = time.monotonic()
        self._stop.set()
        # the listener first: an engine dropped below must not reattach to this service
        # while it stops (it waits for the next one: a take-over's, a restart's)
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the accept loop now (not at its
                self._listener.shutdown(socket.SHUT_RDWR)  # 0.2 s timeout)
            self._listener.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
        for t in self._threads:
            t.join(2.0)
        with self._lock:
            socks = [s.sock for s in self._sessions.values()] + list(self._connecting.values())
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + 5.0
        while self._sessions and time.monotonic() < deadline:
            time.sleep(0.01)
        handing_over = self.cfg.node.handover or self.taken_over is not None
        # the abandoned stores still in their grace go with the hand-over (an engine's
        # late copy may land in them after the next service started)
        held = self._held() if handing_over else {}
        self._bury(all_=True)
        if self.events is not None:
            self.events.stop()  # a last batch while the stacks are still there
        t1 = time.monotonic()
        if handing_over:
            self._hand_over(held)
        t2 = time.monotonic()
        self.namespaces.close()
        self.adoption.close()
        self._release_lock()
        self.namespaces.close_journals()  # a take-over does not wait for the unmapping
        log.info("node service stopped in %.0f ms (sessions ended %.0f ms, hand-over %.0f "
                 "ms, namespaces closed %.0f ms)", (time.monotonic() - t0) * 1e3,
                 (t1 - t0) * 1e3, (t2 - t1) * 1e3, (time.monotonic() - t2) * 1e3)

    def _held(self) -> dict[int, list[tuple[int, int, float]]]:
        """Per namespace cache (by id) its abandoned stores held now: (tree key, host
        block, seconds of grace left)."""
        out: dict[int, list[tuple[int, int, float]]] = {}
        for cache, nodes, left in self.graves.held_in_seconds():
            out.setdefault(id(cache), []).extend(
                (key, host, left) for key, host in cache.abandoned_pages(nodes))
        return out

    def _hand_over(self, held: dict[int, list[tuple[int, int, float]]]) -> None:
        """Every namespace's ready host copies, its abandoned stores still `held`, and its
        segments kept for the next service (`handover`); a namespace that cannot be is
        left out (one line), its pages lost."""
        records = []
        for ns in self.namespaces.all():
            try:
                records.append(snapshot(ns.name, ns.cfg.deployment_id, ns.geometry,
                                        ns.page_bytes, ns.host_blocks, ns.ranks, ns.keyed,
                                        held.get(id(ns.keyed), ())))
            except OSError as e:
                log.warning("namespace %r: not handed over: %s", ns.name, e)
        try:
            path = write_handover(self.path.parent, self.cfg.deployment_id, records)
        except OSError as e:
            log.warning("hand-over not written (%s): the next service starts cold", e)
            return
        log.info("hand-over written to %s: %d namespace(s), %d block(s)", path, len(records),
                 sum(len(r.pages) for r in records))

    # ------------------------------------------------------------------ status

    def sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.status() for s in self._sessions.values()]

    def status(self) -> dict[str, Any]:
        return {"socket": str(self.path), "instance": self.nonce,
                "engines": self.sessions(), "dropped": self.dropped,
                "events": None if self.events is None else self.events.status(),
                "namespaces": [ns.status() for ns in self.namespaces.all()]}

    def reset(self) -> dict[str, Any]:
        """Empty what every engine sees (every namespace's host tier)."""
        return self.namespaces.reset()

    # ------------------------------------------------------------------ connections

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("node socket: accept failed")
                time.sleep(0.1)
                continue
            conn.settimeout(None)
            cid = next(self._ids)
            with self._lock:
                # the pre-HELLO pool: full, its oldest connection makes room (a real engine
                # says HELLO at once, so a flood only ever pushes out the flood)
                evict = []
                while len(self._connecting) >= self.cfg.node.max_connecting:
                    old = next(iter(self._connecting))
                    evict.append(self._connecting.pop(old))
                self._connecting[cid] = conn
            for old_conn in evict:
                self.dropped += 1
                with contextlib.suppress(OSError):
                    old_conn.shutdown(socket.SHUT_RDWR)
            if evict:
                self._log_evictions(len(evict))
            t = threading.Thread(target=self._serve_conn, args=(conn, cid, time.monotonic()),
                                 daemon=True, name="kvtier-node-session")
            t.start()

    def _log_evictions(self, n: int) -> None:
        """One line per second at most while a flood of silent connections goes on."""
        self._evicted += n
        now = time.monotonic()
        if now - self._evicted_logged >= 1.0:
            log.warning("node socket: %d connection(s) that had not said HELLO dropped to "
                        "make room (node.max_connecting = %d)", self._evicted,
                        self.cfg.node.max_connecting)
            self._evicted, self._evicted_logged = 0, now

    def _refuse(self, conn: socket.socket, why: str) -> None:
        self.dropped += 1
        log.warning("node socket: %s", why)
        with contextlib.suppress(OSError):
            conn.settimeout(0.5)
            conn.sendall(wire.encode_error(why))
        conn.close()

    def _serve_conn(self, conn: socket.socket, cid: int, accepted: float) -> None:
        try:
            self._serve_conn_checked(conn, cid, accepted)
        finally:
            with self._lock:
                self._connecting.pop(cid, None)

    def _serve_conn_checked(self, conn: socket.socket, cid: int, accepted: float) -> None:
        try:
            pid, uid, gid = _UCRED.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError as e:
            self._refuse(conn, f"peer credentials unreadable ({e.strerror}): refused")
            return
        allowed = self.cfg.node.allowed_gid
        if uid != os.getuid() and not (allowed >= 0 and gid == allowed):
            self._refuse(conn, f"engine pid {pid} uid {uid} gid {gid}: refused (only uid "
                         f"{os.getuid()}" + (f" or gid {allowed}" if allowed >= 0 else "")
                         + " may attach)")
            return
        s = Session(cid, conn, pid, uid)
        # a reply the engine does not read within send_timeout_s fails the send: dropped
        t = self.cfg.node.send_timeout_s
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(t), int((t % 1) * 1e6)))
        why = "closed the connection"
        try:
            why = self._session(s, accepted)
        except wire.WireError as e:
            why = f"sent a bad frame: {e}"
            with contextlib.suppress(OSError):
                conn.settimeout(0.5)
                conn.sendall(wire.encode_error(str(e)))
        except (BlockingIOError, TimeoutError):
            why = (f"did not read its replies for {t:g} s (node.send_timeout_s): dropped")
        except OSError as e:
            why = f"connection lost ({e.strerror or e})"
        except NamespaceRefused as e:
            why = f"refused: {e}"
            with contextlib.suppress(OSError):
                conn.settimeout(0.5)
                conn.sendall(wire.encode_error(str(e)))
        except Exception:
            log.exception("node session %d (pid %d) failed", s.sid, s.pid)
            why = "failed (see the traceback above)"
        finally:
            conn.close()
            self._end(s, why)

    def _recv_exact(self, sock: socket.socket, n: int, deadline: float | None,
                    what: str) -> bytes:
        """n bytes, all of them before `deadline` (monotonic; None: no deadline). WireError
        when the peer closes first or the deadline passes: a deadline for the whole read,
        not an idle timeout a byte now and then would restart."""
        buf = bytearray()
        while len(buf) < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise wire.WireError(f"{what}: {len(buf)} of {n} bytes within the deadline")
                sock.settimeout(left)
            try:
                chunk = sock.recv(min(n - len(buf), 1 << 20))
            except TimeoutError:
                raise wire.WireError(f"{what}: {len(buf)} of {n} bytes within the deadline"
                                ) from None
            if not chunk:
                raise wire.WireError(f"{what}: connection closed {len(buf)} bytes into {n} "
                                "(truncated)")
            buf += chunk
        return bytes(buf)

    def _read_hello(self, sock: socket.socket,
                    accepted: float) -> tuple[wire.FrameType, int, bytes] | None:
        """The first frame, whole within node.hello_deadline_s of the accept (at most
        MAX_HELLO bytes of JSON); None when the peer closed before its first byte."""
        limit = self.cfg.node.hello_deadline_s
        deadline = accepted + limit
        what = f"HELLO: not complete within {limit:g} s (node.hello_deadline_s)"
        sock.settimeout(max(0.0, deadline - time.monotonic()))
        try:
            first = sock.recv(wire.LEN_BYTES)
        except TimeoutError:
            raise wire.WireError(f"{what}: nothing sent") from None
        finally:
            sock.settimeout(None)
        if not first:
            return None
        try:
            prefix = first + self._recv_exact(sock, wire.LEN_BYTES - len(first), deadline,
                                              what)
            n = wire.frame_length(prefix)
            if n > wire.HEAD_BYTES + wire.MAX_HELLO:
                raise wire.WireError(f"frame: {n} bytes announced before HELLO, a HELLO has at "
                                f"most {wire.HEAD_BYTES + wire.MAX_HELLO}")
            body = self._recv_exact(sock, n, deadline, what)
        finally:
            sock.settimeout(None)
        return wire.decode_takeover_head(body)

    def _read_frame(self, sock: socket.socket) -> tuple[wire.FrameType, int, bytes] | None:
        """The next frame: waited for as long as the engine likes, then whole within
        node.frame_deadline_s of its first byte. None on a clean close between frames."""
        sock.settimeout(None)
        first = sock.recv(wire.LEN_BYTES)
        if not first:
            return None
        limit = self.cfg.node.frame_deadline_s
        deadline = time.monotonic() + limit
        what = f"frame: not complete within {limit:g} s (node.frame_deadline_s)"
        try:
            prefix = first + self._recv_exact(sock, wire.LEN_BYTES - len(first), deadline,
                                              what)
            body = self._recv_exact(sock, wire.frame_length(prefix), deadline, what)
        finally:
            sock.settimeout(None)
        return wire.decode_head(body)

    def _session(self, s: Session, accepted: float) -> str:
        got = self._read_hello(s.sock, accepted)
        if got is None:
            return "closed before HELLO"
        ftype, seq, body = got
        if ftype is wire.FrameType.TAKEOVER:
            return self._give_over(s, seq, wire.decode_takeover(body))
        if ftype is not wire.FrameType.HELLO:
            raise wire.WireError(f"{ftype.name}: the first frame must be HELLO")
        hello = wire.decode_hello(body)
        s.pid = hello.pid
        with self._lock:
            if self._connecting.pop(s.sid, None) is None:
                return "dropped before HELLO (node.max_connecting)"
            if len(self._sessions) >= self.cfg.node.max_engines:
                raise NamespaceRefused(f"engine pid {s.pid}: refused, node.max_engines = "
                                       f"{self.cfg.node.max_engines} engines are attached")
            self._sessions[s.sid] = s
        if self._stop.is_set():
            raise NamespaceRefused("the node service is stopping")
        ns = self.namespaces.attach(hello, s.sid)
        s.ns = ns
        s.engine = EngineSession(ns.keyed, s.sid)
        try:
            segments = ns.segments()
        except KvtierError as e:
            raise NamespaceRefused(str(e)) from None
        s.sock.sendall(wire.encode_welcome(wire.Welcome(
            s.sid, self.nonce, ns.keyed.generation, ns.quota_bytes, segments,
            self.cfg.storage.backend), seq))
        log.info("engine pid %d attached (session %d, namespace %r)", s.pid, s.sid, ns.name)
        while not self._stop.is_set():
            got = self._read_frame(s.sock)
            if got is None:
                return "closed the connection"
            ftype, seq, body = got
            if ftype is not wire.FrameType.OPS:
                raise wire.WireError(f"{ftype.name}: only OPS frames after HELLO")
            reply = apply_ops(s, ns, wire.decode_ops(body), self._give_back)
            if reply is not None:
                s.sock.sendall(wire.encode_reply(reply, seq))
        return "service stopping"

    def _give_over(self, s: Session, seq: int, req: wire.Takeover) -> str:
        """A new service's TAKEOVER: only from this uid and deployment, once; answered
        TAKEN, then this service stops (`on_takeover`) and `stop` hands over."""
        if s.uid != os.getuid():
            raise NamespaceRefused(f"TAKEOVER: only uid {os.getuid()} may take this service "
                                   f"over, not uid {s.uid}")
        if req.pid != s.peer_pid:
            raise NamespaceRefused(f"TAKEOVER: pid {req.pid} asked, the peer is pid "
                                   f"{s.peer_pid}")
        if req.deployment_id != self.cfg.deployment_id:
            raise NamespaceRefused(f"TAKEOVER: this service is deployment "
                                   f"{self.cfg.deployment_id!r}, not {req.deployment_id!r}")
        if req.prepare:  # what to start warm; nothing changes here
            s.sock.sendall(wire.encode_taken(wire.Taken(
                self.cfg.deployment_id, os.getpid(), self.nonce,
                min(wire.MAX_TAKEOVER_WORKERS, sum(ns.ranks for ns in self.namespaces.all())),
                stopping=False), seq))
            return f"told kvtier serve pid {req.pid} what it runs (a take-over prepared)"
        with self._lock:
            why = ("it is stopping already" if self._stop.is_set() or self.taken_over
                   or self._taking else
                   "nothing here can stop it (no kvtier serve owns it)"
                   if self.on_takeover is None else "")
            if why:
                raise NamespaceRefused(f"TAKEOVER: refused, {why}")
            self._taking = True
        try:
            # the asker may have given up (its --takeover-timeout) and closed: the send
            # fails and this service keeps serving
            s.sock.sendall(wire.encode_taken(wire.Taken(self.cfg.deployment_id, os.getpid(),
                                                        self.nonce, 0, True), seq))
        finally:
            self._taking = False
        self.taken_over = req
        log.info("taken over by kvtier serve pid %d: stopping, handing over", req.pid)
        assert self.on_takeover is not None
        self.on_takeover()
        return f"took this service over (kvtier serve pid {req.pid})"

    # ------------------------------------------------------------------ session ends

    def _give_back(self, engine: EngineSession) -> tuple[int, int]:
        """Unpin the session's open loads now; abandon its open stores (freed after the
        grace, never served), a slice of wire.SLICE_KEYS keys per hold of the namespace's
        lock. Returns (stores, loads) it had open."""
        return engine.abandon(self.graves, seconds=self.cfg.node.abandon_grace_s,
                              unpin_loads=True, slice_keys=wire.SLICE_KEYS)

    def _end(self, s: Session, why: str) -> None:
        ns = s.ns
        if ns is not None:
            open_stores, open_loads = (0, 0) if s.engine is None else self._give_back(s.engine)
            if s.events is not None:
                ns.fanout.unsubscribe(s.events)
                s.events = None
            for rid in s.requests:
                ns.keyed.forget_request(rid)
            self.namespaces.detach(ns, s.sid)
            log.info("engine pid %d (session %d, namespace %r) %s; %d open store(s) "
                     "abandoned, %d open load(s) unpinned", s.pid, s.sid, ns.name, why,
                     open_stores, open_loads)
        else:
            self.dropped += 1
            # a connection that left without a word is not news (a flood would fill the log)
            (log.debug if why == "closed before HELLO" else log.warning)(
                "engine pid %d (session %d) %s", s.pid, s.sid, why)
        with self._lock:
            self._sessions.pop(s.sid, None)

    def _bury(self, all_: bool = False) -> None:
        with contextlib.suppress(KvtierError):
            self.graves.bury(all_=all_)

    def _grave_loop(self) -> None:
        # also the one drain of every namespace's tier events (`fanout`), each
        # node.events_interval_s: readers (engines, the publisher) only read
        refreshed = time.monotonic()
        while not self._stop.wait(min(0.1, self.cfg.node.events_interval_s)):
            self._bury()
            if time.monotonic() - refreshed >= 1.0:  # replaced workers' pools kept again
                refreshed = time.monotonic()
                self.namespaces.refresh_journals()
            for ns in self.namespaces.all():
                ns.drain_events()
