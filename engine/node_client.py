"""`EngineCache` over the node socket: an engine attached to `kvtier serve`.

The engine's scheduler calls this client exactly as it would call the embedded cache
(`kvtier.engine.cache_api`). What goes over the socket (`kvtier.manager.node.wire`):

* a lookup of a request asks the service about the block *and the request's following
  blocks* in one round trip; the service answers the leading ready blocks and the first other
  one, and the client answers the request's next lookups from that answer (each answer is
  used once: a block asked again is asked again);
* completions, touches, request bookkeeping are one-way: queued, and sent with the next
  question or at the end of the scheduler step (`end_step`), in order;
* `prepare_store` and `prepare_load` are one round trip each (whole batches);
* `remove_loaded` (the audit found a block it loaded wrong) is one round trip per
  `wire.MAX_REMOVE_KEYS` blocks: the service removes them from every tier of the node.

Connection states (one owner: this client, under `_lock`)::

    DOWN --(background thread: connect + HELLO + WELCOME, backoff 0.05 s doubling to 5 s,
            cut short when the socket path is bound anew)--> UP
    UP   --(send/receive error, timeout (`call_timeout_s`), ERROR frame, bad frame,
            or, while idle, the service closed the socket: seen within 0.5 s)--> DOWN

While DOWN every call answers at once: lookups MISS, `prepare_store` None, `prepare_load`
raises InvalidRequestError (the engine recomputes), one-way ops are dropped (the service ended
the session and gave back what it held). No call waits longer than `call_timeout_s` (default
1 s) for the service, and a call that timed out takes the client DOWN, so the next calls do
not wait at all.

The first attach, in the constructor (`connect_now`), waits up to `attach_timeout_s` (the
namespace's stack may be starting on the service); later ones run on the background thread.

Every UP starts a new `generation` (and so does a reply naming a new namespace generation:
the service replaced a rank's worker). Host block ids handed out under another generation
are void; `host_pools()` says which segments (name, inode) the current one means and the
service instance nonce, and each plan carries the pools of the reply that brought it (read
under the same hold of the client's lock), so an engine never copies into a pool of an
earlier service or worker. A plan the service made that has no pools on this side (a new
generation's segment not there yet) is given back at once (a failed store, an ended load)
and refused to the engine; the service's evictions for it stand.

Tier events (`enable_events`): the client subscribes its connection to the namespace's
events (the EVENTS op, again after every attach) and every reply carries what the service has
for it (`wire`: REPLY events). `take_events` returns them in order: the namespace's host and
storage tiers as this engine can be served from them, blocks other engines of the namespace
stored included. The client keeps what it has reported per tier (`_announced`), so it can
withdraw all of it when that stops being true: on DOWN (nothing of the node is servable to
this engine then) and on a RESYNC reply (the service's log was trimmed past this
connection's place); after a reattach the namespace's state is announced again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.engine.cache_api import (
    EngineCache,
    HostPools,
    InvalidRequestError,
    Lookup,
    PlannedLoad,
    PlannedStore,
    PoolSegment,
    TierEvent,
)
from kvtier.manager.keyed_events import HOST, STORAGE
from kvtier.manager.keys import keyed_storage_key
from kvtier.manager.node import wire
from kvtier.manager.tenants import Retention
from kvtier.worker.spec import segment_inode

log = logging.getLogger("kvtier.engine")

_LOOKUPS = {wire.LookupCode.HIT: Lookup.HIT, wire.LookupCode.PENDING: Lookup.PENDING,
            wire.LookupCode.MISS: Lookup.MISS, wire.LookupCode.RETRY: Lookup.RETRY}
_BY_CODE = {int(k): v for k, v in _LOOKUPS.items()}
_REMOVE_CODES = {reason: code for code, reason in wire.REMOVE_REASONS.items()}
MAX_OUTBOX = 4096  # one-way records queued before they are sent without waiting for a step
# `take_events` asks the service itself (a PENDING round trip) only when no reply came in
# this long: replies of the step's own questions carry the events, so a busy step pays
# nothing and a step that asked nothing pays one round trip per EVENTS_POLL_S at most
EVENTS_POLL_S = 0.02
# While DOWN, how often the socket path is looked at for a new service (one stat)
SOCKET_POLL_S = 0.02


class NodeUnavailable(Exception):
    """Internal: the service cannot be reached now (the caller answers a miss)."""


OPEN_STORES_KEPT = 1 << 16
"""Open stores the client remembers (about 10 MB of hashes at most). An engine has at most its
device pool's blocks in flight, and vLLM completes every store it plans: the bound only matters
for an engine that drops its completions (the oldest are forgotten first)."""


class NodeClient:
    """`EngineCache` over a node service's socket (see the module docstring).

    Data structures: `_sock` (None while DOWN); `_outbox`, one-way op records not sent yet;
    `_answers`, request id -> block hash -> the lookup answer the last round trip gave for
    it (each used once); `_asked`, requests counted already; `_pools`, the segments of the
    current generation; `_events`, tier events not taken yet; `_announced`, tier -> hashes
    reported stored there and not removed since; `_open_stores`, hash -> the attach its
    store was planned under, until completed; `_open_loads`, hash -> the attaches of its open
    loads. Invariants: `_outbox` and `_answers` are
    empty while DOWN (they belong to a session the service has ended); `_announced` is empty
    while DOWN (a DOWN withdraws it); a completion reaches the service only for a store or load
    planned under the current attach, and a hash with an earlier attach's store open is never
    planned for storing."""

    def __init__(self, path: str | Path, hello: wire.Hello, *, call_timeout_s: float = 1.0,
                 attach_timeout_s: float = 60.0, backoff_s: tuple[float, float] = (0.05, 5.0),
                 connect_now: bool = True) -> None:
        self.path = str(path)
        self.hello = hello
        self.call_timeout_s = call_timeout_s
        self.attach_timeout_s = attach_timeout_s
        self._backoff = backoff_s
        self._namespace = hello.namespace.encode()
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._seq = 0
        self._generation = 0
        self._server_gen = -1
        self._nonce = b""
        self._segments: tuple[wire.Segment, ...] = ()
        self._pools: HostPools | None = None
        self._reread = False  # segments to read again (a rank's worker being replaced)
        self._outbox: list[wire.OpRecord] = []
        self._answers: dict[str, dict[bytes, Lookup]] = {}
        self._asked: set[str] = set()
        self._pending = False
        self._pending_at = 0.0
        self._events_on = False
        self._events: list[TierEvent] = []
        self._announced: dict[str, set[bytes]] = {HOST: set(), STORAGE: set()}
        # hash -> the attach (`attaches`) its open store was planned under, until the engine
        # completes it: a completion of an earlier attach's plan is dropped, and that hash is
        # not planned again until it comes (see `prepare_store`); bounded by OPEN_STORES_KEPT
        self._open_stores: OrderedDict[bytes, int] = OrderedDict()
        # hash -> the attach of each of its open loads, oldest first (several requests may
        # load one block): a completion is the oldest open load's, and one of an earlier
        # attach is dropped (else it would unpin the new session's load of that hash while
        # its copy still reads the page); bounded by OPEN_STORES_KEPT hashes
        self._open_loads: dict[bytes, deque[int]] = {}
        self._closed = threading.Event()
        self._wake = threading.Event()
        self.session = 0
        self.quota_bytes = 0
        self._storage_backend = ""  # the service's (WELCOME): "" until the first attach
        self.last_error = ""
        self.attaches = 0
        if connect_now:
            self._try_attach()
        self._thread = threading.Thread(target=self._reconnect_loop, daemon=True,
                                        name="kvtier-node-client")
        self._thread.start()

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _try_attach(self) -> bool:
        """Connect, say HELLO, read WELCOME (bounded by attach_timeout_s); True when UP."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.attach_timeout_s)
            sock.connect(self.path)
            sock.sendall(wire.encode_hello(self.hello))
            ftype, _, body = _read_frame(sock, time.monotonic() + self.attach_timeout_s)
            if ftype is wire.FrameType.ERROR:
                raise NodeUnavailable(body.decode("utf-8", "replace"))
            if ftype is not wire.FrameType.WELCOME:
                raise wire.WireError(f"{ftype.name}: expected WELCOME")
            welcome = wire.decode_welcome(body)
        except (OSError, wire.WireError, NodeUnavailable) as e:
            sock.close()
            why = str(e) or e.__class__.__name__
            if why != self.last_error:
                log.warning("kvtier node %s: not attached (%s); lookups miss until it is",
                            self.path, why)
            self.last_error = why
            return False
        sock.settimeout(self.call_timeout_s)
        with self._lock:
            if self._closed.is_set():
                sock.close()
                return False
            self._sock = sock
            self._nonce = bytes.fromhex(welcome.nonce)
            self._segments = welcome.segments
            self.session = welcome.session
            self.quota_bytes = welcome.quota_bytes
            self._storage_backend = welcome.storage
            self.attaches += 1
            self._new_generation(welcome.generation, welcomed=True)
            if self._events_on:  # this session's reader (sent with the first question)
                self._outbox.append(wire.OpRecord(wire.Op.EVENTS, flag=1))
        self.last_error = ""
        log.info("kvtier node %s: attached (session %d, instance %s, generation %d)",
                 self.path, welcome.session, welcome.nonce[:8], self._generation)
        return True

    def _new_generation(self, server_gen: int, welcomed: bool = False) -> None:
        """A new generation: the segments as they are now. Right after WELCOME each must be
        the inode the service named (else it was replaced meanwhile: no pool until the
        service's next generation); later (a rank's worker replaced) they are read anew, and
        again by `host_pools` while a replacement has not created its segment yet."""
        self._server_gen = server_gen
        self._generation += 1
        self._pools = None
        self._reread = False
        self._read_pools(welcomed)

    def _read_pools(self, welcomed: bool) -> None:
        try:
            segs = tuple(PoolSegment(s.rank, s.name, segment_inode(s.name), s.num_blocks)
                         for s in self._segments)
        except OSError:
            self._reread = not welcomed
            return
        self._reread = False
        if welcomed and any(a.inode != b.inode
                            for a, b in zip(segs, self._segments, strict=True)):
            return
        self._pools = HostPools(self._generation, self._nonce, segs)

    def _drop(self, why: str) -> None:
        """DOWN: forget the session's state, void every host block id handed out."""
        sock = self._sock
        if sock is None:
            return
        self._sock = None
        with contextlib.suppress(OSError):
            sock.close()
        self._outbox.clear()
        self._answers.clear()
        self._asked.clear()
        self._pools = None
        self._generation += 1
        self._withdraw()
        self.last_error = why
        log.warning("kvtier node %s: connection lost (%s); lookups miss, reconnecting",
                    self.path, why)
        self._wake.set()

    def _reconnect_loop(self) -> None:
        delay = self._backoff[0]
        while not self._closed.is_set():
            if self._sock is not None:
                self._wake.wait(0.5)
                self._wake.clear()
                self._notice_closed()
                delay = self._backoff[0]
                continue
            seen = self._socket_id()
            if self._try_attach():
                delay = self._backoff[0]
                continue
            self._wait_for_socket(seen, delay)
            delay = min(self._backoff[1], delay * 2)

    def _socket_id(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_ctime_ns

    def _wait_for_socket(self, seen: tuple[int, int] | None, delay: float) -> None:
        """The backoff's `delay`, cut short when the socket path changes (a new service
        bound it: a restart or a take-over is then seen within SOCKET_POLL_S, not after a
        backoff grown to seconds while the old one was stopping). A stat per step."""
        end = time.monotonic() + delay
        while (left := end - time.monotonic()) > 0:
            if self._closed.wait(min(SOCKET_POLL_S, left)):
                return
            if self._socket_id() != seen:
                return

    def _notice_closed(self) -> None:
        """UP and idle: a service that ended (kill -9 included) has closed the socket. Notice
        it now, not at the engine's next call, so an idle engine reattaches by itself (and
        the service's admin lists it again) before traffic comes. A call in progress owns the
        socket (the lock is taken without waiting, so a call is never delayed) and notices a
        broken connection itself. Nothing is consumed: readable bytes of a live service are
        left for the next call."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            sock = self._sock
            if sock is None or not select.select([sock], [], [], 0)[0]:
                return  # open, nothing to read
            try:
                data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._drop(f"idle connection failed: {e}")
                return
            if not data:
                self._drop("the service closed the connection")
        finally:
            self._lock.release()

    # ------------------------------------------------------------------ frames

    def _send(self, records: list[wire.OpRecord]) -> int:
        sock = self._sock
        if sock is None:
            raise NodeUnavailable("not attached")
        try:
            # at most wire.MAX_FRAME_KEYS keys a frame (the service drops a bigger one)
            for batch in wire.frame_batches(records):
                self._seq = (self._seq + 1) & 0xFFFFFFFF
                sock.sendall(wire.encode_ops(batch, self._seq))
        except (OSError, wire.WireError) as e:
            self._drop(f"send failed: {getattr(e, 'strerror', None) or e}")
            raise NodeUnavailable(self.last_error) from None
        return self._seq

    def _ask(self, record: wire.OpRecord) -> wire.Reply:
        """One round trip: queued one-way ops, then `record`; its reply. NodeUnavailable
        (and DOWN) on any failure, within call_timeout_s."""
        with self._lock:
            records, self._outbox = self._outbox, []
            records.append(record)
            seq = self._send(records)
            sock = self._sock
            assert sock is not None
            try:
                ftype, rseq, body = _read_frame(sock, time.monotonic() + self.call_timeout_s)
                if ftype is wire.FrameType.ERROR:
                    raise wire.WireError("the service refused: "
                                         + body.decode("utf-8", "replace"))
                if ftype is not wire.FrameType.REPLY or rseq != seq:
                    raise wire.WireError(f"{ftype.name} seq {rseq}: expected REPLY seq {seq}")
                reply = wire.decode_reply(body)
            except (OSError, wire.WireError) as e:
                self._drop(str(e) or e.__class__.__name__)
                raise NodeUnavailable(self.last_error) from None
            if reply.generation != self._server_gen:
                self._new_generation(reply.generation)
            self._pending, self._pending_at = reply.pending, time.monotonic()
            if reply.resync:
                self._withdraw()
            for ev in reply.events:
                held = self._announced[ev.tier]
                if ev.removed:
                    held.difference_update(ev.hashes)
                else:
                    held.update(ev.hashes)
                self._events.append(ev)
            return reply

    def _queue(self, record: wire.OpRecord) -> None:
        with self._lock:
            if self._sock is None:
                return  # the session is gone, and what it held with it
            self._outbox.append(record)
            if len(self._outbox) >= MAX_OUTBOX:
                self._flush()

    def _flush(self) -> None:
        with self._lock:
            if not self._outbox or self._sock is None:
                return
            records, self._outbox = self._outbox, []
            with contextlib.suppress(NodeUnavailable):
                self._send(records)

    # ------------------------------------------------------------------ EngineCache

    @property
    def block_size(self) -> int:
        return self.hello.block_size

    @property
    def generation(self) -> int:
        return self._generation

    @property
    def wants_following(self) -> bool:
        return True

    def host_pools(self) -> HostPools | None:
        with self._lock:
            if self._pools is None and self._reread and self._sock is not None:
                self._read_pools(welcomed=False)
            return self._pools

    @property
    def storage_backend(self) -> str:
        return self._storage_backend

    def storage_key(self, block_hash: bytes) -> bytes:
        return keyed_storage_key(self._namespace, block_hash)

    def lookup(self, block_hash: bytes, request_id: str = "",
               following: Sequence[bytes] = (), *,
               threshold_tokens: int | None = None) -> Lookup:
        with self._lock:
            if self._sock is None:
                return Lookup.MISS
            known = self._answers.get(request_id) if request_id else None
            if known:
                found = known.pop(block_hash, None)
                if found is not None:
                    return found
            # the following blocks past one frame's keys are left out (a storage query
            # counts leading blocks: a later lookup asks about the rest)
            keys = [block_hash, *itertools.islice(following, wire.MAX_FRAME_KEYS - 1)]
            try:
                reply = self._ask(wire.OpRecord(
                    wire.Op.LOOKUP, keys, request_id,
                    value=-1 if threshold_tokens is None else threshold_tokens))
            except NodeUnavailable:
                return Lookup.MISS
            codes = reply.flags
            if not reply.ok or not codes:
                return Lookup.MISS
            if request_id:
                self._answers[request_id] = {keys[i]: _BY_CODE[codes[i]]
                                             for i in range(1, min(len(codes), len(keys)))}
            return _BY_CODE.get(codes[0], Lookup.MISS)

    def count_asked(self, request_id: str, blocks: int | Callable[[], int]) -> None:
        with self._lock:
            if self._sock is None or request_id in self._asked:
                return
            self._asked.add(request_id)
            n = blocks() if callable(blocks) else blocks
            self._queue(wire.OpRecord(wire.Op.COUNT_ASKED, request_id=request_id,
                                      value=min(n, (1 << 31) - 1)))

    def forget_request(self, request_id: str) -> None:
        with self._lock:
            self._asked.discard(request_id)
            self._answers.pop(request_id, None)
            self._queue(wire.OpRecord(wire.Op.FORGET, request_id=request_id))

    def pending_work(self) -> bool:
        with self._lock:
            if self._sock is None:
                return False
            if time.monotonic() - self._pending_at < 0.005:  # a reply of this step said
                return self._pending
            try:
                return self._ask(wire.OpRecord(wire.Op.PENDING)).pending
            except NodeUnavailable:
                return False

    def from_storage(self, block_hash: bytes) -> bool:
        return False  # known per load only (prepare_load's from_storage flags)

    def prepare_load(self, hashes: Sequence[bytes],
                     count_tokens: Sequence[bool] | None = None) -> PlannedLoad:
        if count_tokens is not None and len(count_tokens) != len(hashes):
            raise InvalidRequestError(
                f"prepare_load: {len(count_tokens)} count_tokens flags for {len(hashes)} "
                "blocks")
        if len(hashes) > wire.MAX_FRAME_KEYS:
            raise InvalidRequestError(f"prepare_load: {len(hashes)} blocks at once, the node "
                                      f"service takes at most {wire.MAX_FRAME_KEYS}")
        record = wire.OpRecord(wire.Op.PREPARE_LOAD, list(hashes),
                               flag=0 if count_tokens is None else 1,
                               extra=b"" if count_tokens is None else bytes(
                                   map(bool, count_tokens)))
        with self._lock:  # the reply and the pools it means read together
            try:
                reply = self._ask(record)
            except NodeUnavailable as e:
                raise InvalidRequestError(
                    f"prepare_load: the node service is unreachable ({e})") from None
            if not reply.ok:
                raise InvalidRequestError(reply.error or "prepare_load: refused")
            if len(reply.ids) != len(hashes):
                self.complete_load(hashes)
                raise InvalidRequestError(f"prepare_load: {len(reply.ids)} ids for "
                                          f"{len(hashes)} blocks")
            pools = self.host_pools()
            if pools is None:  # pinned on the service: unpinned at once
                self.complete_load(hashes)
                raise InvalidRequestError("prepare_load: the node's host pools of generation "
                                          f"{reply.generation} cannot be mapped here yet")
            attach = self.attaches
            for h in hashes:
                self._open_loads.setdefault(h, deque()).append(attach)
            while len(self._open_loads) > OPEN_STORES_KEPT:
                del self._open_loads[next(iter(self._open_loads))]
        return PlannedLoad(reply.ids, pools, [bool(b) for b in reply.flags])

    def complete_load(self, hashes: Sequence[bytes]) -> None:
        """The engine's copies out of these blocks are done. A completion of a load planned
        under an earlier attach is dropped: that session's loads ended with it, and the hash
        may be loaded again in this one (a completion names the hash, not the load)."""
        if not hashes:
            return
        with self._lock:
            attach = self.attaches
            current = []
            for h in hashes:
                opened = self._open_loads.get(h)
                was = opened.popleft() if opened else attach
                if opened is not None and not opened:
                    del self._open_loads[h]
                if was == attach:
                    current.append(h)
        if current:
            self._queue(wire.OpRecord(wire.Op.COMPLETE_LOAD, current))

    def touch(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self._queue(wire.OpRecord(wire.Op.TOUCH, list(hashes)))

    def prepare_store(self, hashes: Sequence[bytes], tenant: str = "") -> PlannedStore | None:
        """A plan for (some of) `hashes`. A hash whose store was planned under an earlier
        attach and not completed yet is left out: the service ended that session and freed
        the store, and the engine's completion of it is still to come. Were the hash planned
        again now, that late completion (hashes only, no plan id on the wire) would complete
        the new plan before its bytes were copied, and the node would serve a page never
        written (issue 37: a restart or reattach mid-store)."""
        with self._lock:  # the reply and the pools it means read together
            attach = self.attaches
            hashes = [h for h in hashes if self._open_stores.get(h, attach) == attach]
            if not hashes:
                pools = self.host_pools()
                return None if pools is None else PlannedStore([], [], pools)
            # one frame's keys at most: a plan for the leading blocks (a plan may cover a part)
            hashes = list(hashes[:wire.MAX_FRAME_KEYS])
            try:
                reply = self._ask(wire.store_record(hashes, tenant))
            except NodeUnavailable:
                return None
            if not reply.ok or len(reply.flags) != len(hashes):
                return None
            keys = [h for h, m in zip(hashes, reply.flags, strict=True) if m]
            pools = self.host_pools()
            if len(keys) != len(reply.ids) or pools is None:
                self.complete_store(keys, ok=False)  # given back: never copied, never served
                return None
            attach = self.attaches  # the attach that answered (a reply may follow a DOWN)
            for h in keys:
                self._open_stores[h] = attach
                self._open_stores.move_to_end(h)
            while len(self._open_stores) > OPEN_STORES_KEPT:
                self._open_stores.popitem(last=False)
        return PlannedStore(keys, reply.ids, pools, reply.evicted)

    def complete_store(self, hashes: Sequence[bytes], ok: bool = True) -> None:
        """The engine's copies of a plan's blocks are done (`ok`) or given up. Completions of
        stores planned under an earlier attach are dropped (that session's stores were
        abandoned by the service when it ended; see `prepare_store`)."""
        if not hashes:
            return
        with self._lock:
            attach = self.attaches
            current = [h for h in hashes if self._open_stores.pop(h, attach) == attach]
        if current:
            self._queue(wire.OpRecord(wire.Op.COMPLETE_STORE, current, flag=int(ok)))

    def retain(self, hashes: Sequence[bytes], retention: Retention, tenant: str = "") -> None:
        """One-way RETAIN (rides with the next question); the service checks the quota and
        counts a refusal in its session figures."""
        if hashes:
            self._queue(wire.retain_record(list(hashes), pin=retention.pin,
                                           ttl_s=retention.ttl_s, priority=retention.priority,
                                           tenant=tenant))

    def unpin(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self._queue(wire.retain_record(list(hashes), unpin=True))

    def remove_loaded(self, hashes: Sequence[bytes], reason: str) -> int:
        """The REMOVE op, `wire.MAX_REMOVE_KEYS` keys a round trip (the queued completions
        go first, so call it before completing the loads)."""
        code = _REMOVE_CODES.get(reason)
        if code is None:
            raise InvalidRequestError(f"remove: unknown reason {reason!r} (the node service "
                                      f"knows {sorted(_REMOVE_CODES)})")
        keys = list(dict.fromkeys(hashes))
        removed = 0
        for i in range(0, len(keys), wire.MAX_REMOVE_KEYS):
            try:
                reply = self._ask(wire.OpRecord(wire.Op.REMOVE,
                                                keys[i:i + wire.MAX_REMOVE_KEYS], flag=code))
            except NodeUnavailable as e:
                raise InvalidRequestError(f"remove: the node service is unreachable ({e})"
                                          ) from None
            if not reply.ok:
                raise InvalidRequestError(reply.error or "remove: refused")
            removed += reply.evicted
        return removed

    def end_step(self) -> None:
        self._flush()

    def enable_events(self) -> bool:
        """The namespace's tier events from now on (see the module docstring)."""
        with self._lock:
            if not self._events_on:
                self._events_on = True
                self._queue(wire.OpRecord(wire.Op.EVENTS, flag=1))
        return True

    def take_events(self) -> list[TierEvent]:
        """The namespace's tier events since the last call, in order (host and storage, by
        engine block hash)."""
        with self._lock:
            if (self._events_on and self._sock is not None
                    and time.monotonic() - self._pending_at >= EVENTS_POLL_S):
                with contextlib.suppress(NodeUnavailable):
                    self._ask(wire.OpRecord(wire.Op.PENDING))
            out, self._events = self._events, []
            return out

    def _withdraw(self) -> None:
        """Every block reported stored, reported removed (DOWN, RESYNC)."""
        for tier, held in self._announced.items():
            if held:
                self._events.append(TierEvent(tier, True, tuple(held)))
                held.clear()

    def reset(self) -> None:
        with self._lock:
            self._answers.clear()
            self._queue(wire.OpRecord(wire.Op.RESET))
            self._flush()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._flush()
        self._closed.set()
        self._wake.set()
        with self._lock:
            sock, self._sock = self._sock, None
            self._pools = None
        if sock is not None:
            sock.close()
        self._thread.join(2.0)


def _read_frame(sock: socket.socket, deadline: float) -> tuple[wire.FrameType, int, bytes]:
    """One frame, by `deadline`. The service sends exactly one frame per question, so a
    reply usually arrives whole in one receive; bytes past it are a protocol error."""
    buf = bytearray()
    need = wire.LEN_BYTES
    while True:
        while len(buf) < need:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no reply in time")
            sock.settimeout(left)
            chunk = sock.recv(max(need - len(buf), 65536))
            if not chunk:
                raise ConnectionResetError("the service closed the connection")
            buf += chunk
        if need == wire.LEN_BYTES:
            need += wire.frame_length(bytes(buf[:wire.LEN_BYTES]))
            continue
        if len(buf) != need:
            raise wire.WireError(f"frame: {len(buf) - need} bytes after a reply")
        return wire.decode_head(bytes(buf[wire.LEN_BYTES:]))


if TYPE_CHECKING:  # mypy holds the attached home to the contract
    def _conforms(c: NodeClient) -> EngineCache:
        return c
