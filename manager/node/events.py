"""The node service's KV-event publisher: every namespace's host tier and storage, as vLLM
KV events on ZMQ (the bytes: `kvtier.manager.node.events_wire`).

One publisher per `kvtier serve` (`node.events`), owned by `NodeServer`, on one thread of
its own (ZMQ sockets are used by that thread only)::

    start   PUB and ROUTER bound (ipc: in the engine socket's private 0700 directory unless
            configured, files 0600, a dead service's leftovers unlinked first)
    every node.events_interval_s
            per namespace: what its event log (`fanout.EventFanout`, this publisher one of
            its readers; it takes `KeyedHostCache.take_events()`: the tree reconciled with
            what was reported servable per tier) has for it -> one batch per tier with
            events, each its own seq, sent on `<prefix>/host/<ns>` or
            `<prefix>/storage/<ns>` and kept for replay. A reader that fell behind the
            log's bound (one take of more than `fanout.BOUND_HASHES` blocks) is told to
            resync: an AllBlocksCleared on both of the namespace's topics, then a stored
            event per tier with what is servable now
    between ticks
            replay requests answered from the buffer (the last node.events_buffer_batches
            batches), ended by the END_SEQ marker
    stop    a last tick (what changed since is still sent), sockets closed, ipc files
            unlinked (also when start fails half-way)

Every namespace's tier events are switched on when its stack starts (`Namespaces`), so a
block stored before the first tick is reported too. Host events are medium CPU, locality
LOCAL; storage events STORAGE, LOCAL for files and REMOTE for Redis (a store other nodes
share: Dynamo's indexer ignores remote events, so a router counts a shared store once, from
whichever source it trusts for it, never as this node's).

What a BlockStored carries: the engine's block hashes, the namespace's `block_size`, no
token ids and no parent hash (the service is told block hashes only; see the README's
"Routing on kvtier's events").

Data structures: `_buffer`, a deque of (seq, topic, payload) at most
`events_buffer_batches` long; `seq`, the next sequence number (one counter for every topic of
this publisher); `published`, batches sent; `_readers`, namespace -> its reader id in the
namespace's fan-out. Invariant: the buffer's seqs are consecutive and
end at `seq - 1`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import zmq
from kvtier.manager.config import KvtierConfig
from kvtier.manager.errors import KvtierError
from kvtier.manager.keyed_events import HOST, TierEvent
from kvtier.manager.node import events_wire as ew
from kvtier.manager.node.namespaces import Namespace

log = logging.getLogger("kvtier.node.events")

PUB_NAME = "events.pub"
REPLAY_NAME = "events.replay"


class EventsError(KvtierError):
    """The publisher's endpoints cannot be bound (one line naming the key)."""


def to_events(tier_events: Iterable[TierEvent], tier: str, block_size: int,
              storage_locality: str) -> list[ew.Event]:
    """A namespace's tier events of one tier as vLLM events, in order."""
    medium, locality = ((ew.MEDIUM_CPU, ew.LOCAL) if tier == HOST
                        else (ew.MEDIUM_STORAGE, storage_locality))
    out: list[ew.Event] = []
    for e in tier_events:
        if e.tier != tier:
            continue
        hashes: list[bytes | int] = list(e.hashes)
        if e.removed:
            out.append(ew.BlockRemoved(hashes, medium, locality=locality))
        else:
            out.append(ew.BlockStored(hashes, None, [], block_size, None, medium, None,
                                      locality=locality))
    return out


class EventPublisher:
    """See the module docstring. `namespaces`: called each tick for the namespaces now."""

    def __init__(self, cfg: KvtierConfig, directory: Path,
                 namespaces: Callable[[], list[Namespace]]) -> None:
        node = cfg.node
        self.cfg = cfg
        self.endpoint = node.events_endpoint or f"ipc://{directory / PUB_NAME}"
        self.replay_endpoint = (node.events_replay_endpoint
                                or f"ipc://{directory / REPLAY_NAME}")
        self.prefix = node.events_topic_prefix
        self.interval_s = node.events_interval_s
        self.storage_locality = ew.LOCAL if cfg.storage.backend == "file" else ew.REMOTE
        self._namespaces = namespaces
        self._readers: dict[str, int] = {}
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(
            maxlen=node.events_buffer_batches)
        self.seq = 0
        self.published = 0
        self.replays = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.Socket[bytes] | None = None
        self._ipc: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ life cycle

    def _bind(self, sock: zmq.Socket[bytes], endpoint: str, key: str) -> str:
        if endpoint.startswith("ipc://"):
            path = Path(endpoint[len("ipc://"):])
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a dead service's (the node lock is ours)
            self._ipc.append(path)
        elif endpoint.endswith(":0"):
            endpoint = endpoint[:-1] + "*"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise EventsError(f"{key} = {endpoint!r}: cannot bind ({e})") from None
        if endpoint.startswith("ipc://"):
            os.chmod(endpoint[len("ipc://"):], 0o600)
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> EventPublisher:
        self._ctx = zmq.Context()
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, 100_000)
            self.endpoint = self._bind(self._pub, self.endpoint, "node.events_endpoint")
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._replay, self.replay_endpoint,
                                              "node.events_replay_endpoint")
        except BaseException:
            self._close()
            raise
        self._thread = threading.Thread(target=self._loop, name="kvtier-node-events",
                                        daemon=True)
        self._thread.start()
        log.info("KV events on %s (replay %s), topics %s/host|storage/<namespace>",
                 self.endpoint, self.replay_endpoint, self.prefix)
        return self

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        for path in self._ipc:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._ipc.clear()

    def stop(self) -> None:
        """A last tick, then sockets closed and ipc files unlinked. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self._close()

    def status(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic_prefix": self.prefix, "next_seq": self.seq,
                "published": self.published, "replays": self.replays,
                "buffered": len(self._buffer)}

    # ------------------------------------------------------------------ the thread

    def _loop(self) -> None:
        assert self._replay is not None
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        due = time.monotonic()
        while True:
            stopping = self._stop.is_set()
            now = time.monotonic()
            if now >= due or stopping:
                try:
                    self.tick()
                except Exception:  # one bad tick must not end the stream
                    log.exception("KV events: a tick failed")
                due = now + self.interval_s
            if stopping:
                return
            wait_ms = max(0, int((due - time.monotonic()) * 1000))
            if poller.poll(min(wait_ms, 100)):
                try:
                    self._serve_replay()
                except zmq.ZMQError:
                    log.exception("KV events: a replay request failed")

    def tick(self) -> None:
        """Reconcile every namespace and publish what changed (publisher thread only)."""
        for ns in self._namespaces():
            try:
                reader = self._readers.get(ns.name)
                if reader is None:
                    reader = self._readers[ns.name] = ns.subscribe_events()
                resync, got = ns.fanout.read(reader)
            except KvtierError as e:
                log.warning("KV events of namespace %r skipped this tick: %s", ns.name, e)
                continue
            if not got and not resync:
                continue
            block_size = ns.cfg.cache.block_size
            for tier in (ew.HOST_TIER, ew.STORAGE_TIER):
                events = to_events(got, tier, block_size, self.storage_locality)
                if resync:
                    events.insert(0, ew.AllBlocksCleared())
                if events:
                    self._publish(ew.topic_for(self.prefix, tier, ns.name), events)

    def _publish(self, topic: bytes, events: list[ew.Event]) -> None:
        assert self._pub is not None
        payload = ew.encode_batch(ew.EventBatch(time.time(), events))
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, topic, payload))
        self._pub.send_multipart((topic, ew.seq_bytes(seq), payload))
        self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frame(s) is not [id, '', seq:8]: "
                        "ignored", len(frames))
            return
        ident = frames[0]
        start = int.from_bytes(frames[2], "big")
        self.replays += 1
        for seq, topic, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((ident, b"", topic, ew.seq_bytes(seq), payload))
        self._replay.send_multipart((ident, b"", b"", ew.END_SEQ, b""))
