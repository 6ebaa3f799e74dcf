"""The ops of an engine session: one OPS frame applied to its namespace's keyed cache.

`NodeServer` (server.py) owns the connections, their deadlines and their ends; this module
owns what a session's frames do once read (`apply_ops`): completions, touches, storage-query
bookkeeping, retention, events on or off, and the one asking op a frame may carry (LOOKUP,
PREPARE_STORE, PREPARE_LOAD, REMOVE, PENDING), each worked in slices of wire.SLICE_KEYS keys
(`slices`: one keyed-cache call, so one hold of the namespace's lock, per slice). Split from
server.py when it passed 900 lines; the wire format stays `wire`'s.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

from kvtier.manager.errors import InvalidRequestError
from kvtier.manager.keyed import KeyedHostCache, Lookup
from kvtier.manager.node import wire
from kvtier.manager.node.namespaces import Namespace
from kvtier.manager.sessions import EngineSession
from kvtier.manager.tenants import Retention, SteeringError

log = logging.getLogger("kvtier.node")

_CODES = {Lookup.HIT: wire.LookupCode.HIT, Lookup.PENDING: wire.LookupCode.PENDING,
          Lookup.MISS: wire.LookupCode.MISS, Lookup.RETRY: wire.LookupCode.RETRY}


class _Tail(Sequence[bytes]):
    """keys[start:] without a copy (a storage query reads it only when it makes one)."""

    def __init__(self, keys: list[bytes], start: int) -> None:
        self._keys, self._start = keys, start

    def __len__(self) -> int:
        return max(0, len(self._keys) - self._start)

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        return self._keys[self._start:][i]

    def __iter__(self) -> Iterator[bytes]:
        return itertools.islice(self._keys, self._start, None)


class Session:
    """One engine connection (its life is drawn in server.py's module docstring).

    Data structures: `engine`: its open copies (`EngineSession`, from HELLO on);
    `requests`: the engine's request ids with a storage query record; figures for /status."""

    def __init__(self, sid: int, sock: socket.socket, pid: int, uid: int) -> None:
        self.sid = sid
        self.sock = sock
        self.peer_pid = pid
        self.uid = uid
        self.pid = pid  # the engine's own word (HELLO) replaces it
        self.ns: Namespace | None = None
        self.engine: EngineSession | None = None  # over ns.keyed, owner sid (attached)
        self.connected = time.time()
        self.requests: set[str] = set()
        self.events: int | None = None  # its reader of the namespace's events (EVENTS on)
        self.figures = dict.fromkeys(("lookups", "lookup_blocks", "hit_host_blocks",
                                      "hit_storage_blocks", "stores", "stores_failed",
                                      "loads", "removed", "retained", "retain_refused"), 0)
        self.refusal = ""  # the last kvtier.retain refused, in one line

    def status(self) -> dict[str, Any]:
        stores, loads = (0, 0) if self.engine is None else self.engine.open_copies()
        return {"session": self.sid, "pid": self.pid,
                "namespace": self.ns.name if self.ns else None,
                "connected_since": self.connected, **self.figures,
                "stores_open": stores, "loads_open": loads,
                "retain_last_refusal": self.refusal}


def slices(keys: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    """`keys` in slices of wire.SLICE_KEYS: one call, so one hold of the namespace's lock,
    per slice, and the GIL offered between them (another engine's call gets the lock)."""
    step = wire.SLICE_KEYS
    for i in range(0, len(keys), step):
        if i:
            time.sleep(0)
        yield keys[i:i + step]



def apply_ops(s: Session, ns: Namespace, ops: list[wire.OpRecord],
              give_back: Callable[[EngineSession], object]) -> wire.Reply | None:
    """One OPS frame of session `s` applied to its namespace, in order: the one-way ops
    done, the asking op (at most one per frame) answered; `give_back` ends the session's
    open copies (RESET)."""
    cache = ns.keyed
    engine = s.engine
    assert engine is not None  # attached
    f = s.figures
    reply: wire.Reply | None = None
    for r in ops:
        op = r.op
        if op is wire.Op.COMPLETE_STORE:
            done = 0
            for part in slices(r.keys):
                journal = ns.journal if r.flag else None
                if journal is not None:  # checksummed while still marked written
                    journal.record_stores(cache, part, s.sid)
                done += len(engine.complete_store(part, bool(r.flag)))
                late = ns.journal if r.flag and journal is None else None
                if late is not None:
                    # the journal made in the background appeared meanwhile: its scan of
                    # the ready copies may have come before these were published
                    late.record_published(cache, part)
            f["stores" if r.flag else "stores_failed"] += done
            if r.flag:
                ns.blocks["stored"] += done
        elif op is wire.Op.COMPLETE_LOAD:
            for part in slices(r.keys):
                engine.complete_load(part)
        elif op is wire.Op.TOUCH:
            for part in slices(r.keys):
                cache.touch(part)
        elif op is wire.Op.COUNT_ASKED:
            rid = f"{s.sid}:{r.request_id}"
            s.requests.add(rid)
            cache.count_asked(rid, max(0, r.value))
        elif op is wire.Op.FORGET:
            rid = f"{s.sid}:{r.request_id}"
            s.requests.discard(rid)
            cache.forget_request(rid)
        elif op is wire.Op.RESET:
            give_back(engine)
        elif op is wire.Op.RETAIN:
            _retain(s, cache, r)
        elif op is wire.Op.EVENTS:
            if r.flag and s.events is None:
                s.events = ns.subscribe_events()
            elif not r.flag and s.events is not None:
                ns.fanout.unsubscribe(s.events)
                s.events = None
        elif op is wire.Op.LOOKUP:
            reply = _lookup(s, ns, r)
        elif op is wire.Op.PREPARE_STORE:
            reply = _prepare_store(engine, r)
        elif op is wire.Op.PREPARE_LOAD:
            reply = _prepare_load(s, engine, ns, r)
        elif op is wire.Op.REMOVE:
            reply = _remove(s, engine, ns, r)
        else:  # PENDING
            reply = wire.Reply(op, True, cache.generation)
    if reply is not None:
        reply.pending = cache.pending_work()
        if s.events is not None:  # the events this connection has not had yet
            reply.resync, reply.events = ns.fanout.read(s.events, wire.REPLY_EVENT_BYTES)
    return reply

def _retain(s: Session, cache: KeyedHostCache, r: wire.OpRecord) -> None:
    """A request's `kvtier.retain` (one-way): refused whole when its values are out of
    range or a pin is over its tenant's quota, counted in the session's figures
    (`retain_refused`, the last reason in `retain_last_refusal`), never the connection's
    end."""
    if r.flag == 2:
        for part in slices(r.keys):
            cache.unpin(part)
        return
    pin, ttl, prio, tenant = wire.decode_retain(r)
    try:
        retention = Retention.parse({"pin": pin, "ttl_s": ttl, "priority": prio})
        cache.retain(r.keys, retention, tenant)
        s.figures["retained"] += len(r.keys)
    except SteeringError as e:
        s.figures["retain_refused"] += 1
        s.refusal = str(e)

def _lookup(s: Session, ns: Namespace, r: wire.OpRecord) -> wire.Reply:
    cache = ns.keyed
    keys = r.keys
    rid = f"{s.sid}:{r.request_id}" if r.request_id else ""
    if rid:
        s.requests.add(rid)
    # the leading ready blocks in one native call; the first other block asked as the
    # engine would ask it (a storage query from it covers the rest)
    n = 0
    for part in slices(keys):
        hits = cache.count_hits(part)
        n += hits
        if hits < len(part):
            break
    codes = bytes([wire.LookupCode.HIT]) * n
    if n < len(keys):
        found = cache.lookup(keys[n], rid, _Tail(keys, n + 1),
                             threshold_tokens=None if r.value < 0 else r.value)
        codes += bytes([_CODES[found]])
    s.figures["lookups"] += 1
    s.figures["lookup_blocks"] += len(keys)
    ns.blocks["looked_up"] += len(codes)
    return wire.Reply(wire.Op.LOOKUP, True, cache.generation, flags=codes)

def _prepare_store(engine: EngineSession, r: wire.OpRecord) -> wire.Reply:
    """Planned a slice at a time (each slice one `prepare_store`, all or nothing): a
    slice the host tier cannot take ends the plan there, the slices before it stand
    (the reply's mask says which keys to copy). More keys than the namespace has host
    blocks are refused before any slice, so nothing is evicted for a store that
    cannot fit."""
    cache = engine.cache
    capacity = cache.m.host_capacity
    if len(r.keys) > capacity:
        return wire.Reply(wire.Op.PREPARE_STORE, False, cache.generation,
                          error=f"{len(r.keys)} blocks, the namespace holds {capacity}")
    keys: list[bytes] = []
    ids: list[int] = []
    evicted = 0
    refused = False
    tenant = r.extra.decode()  # checked UTF-8 and bounded by the wire
    for part in slices(r.keys):
        plan = engine.prepare_store(part, tenant)
        if plan is None:
            refused = True
            break
        keys += plan.keys
        ids += plan.host_ids
        evicted += plan.evicted
    if refused and not keys:
        return wire.Reply(wire.Op.PREPARE_STORE, False, cache.generation,
                          error="the host tier cannot take them now")
    todo = set(keys)
    mask = bytearray(len(r.keys))
    for i, k in enumerate(r.keys):
        if k in todo:
            mask[i] = 1
            todo.discard(k)
    return wire.Reply(wire.Op.PREPARE_STORE, True, cache.generation,
                      evicted=evicted, ids=ids, flags=bytes(mask))

def _prepare_load(s: Session, engine: EngineSession, ns: Namespace,
                  r: wire.OpRecord) -> wire.Reply:
    cache = ns.keyed
    counted = list(map(bool, r.extra)) if r.flag else None
    from_storage: list[bool] = []
    ids: list[int] = []
    for i in range(0, len(r.keys), wire.SLICE_KEYS):  # all or nothing, a slice at a time
        if i:
            time.sleep(0)
        end = i + wire.SLICE_KEYS
        try:
            ids += engine.prepare_load(r.keys[i:end],
                                       None if counted is None else counted[i:end],
                                       from_storage)
        except InvalidRequestError as e:
            for part in slices(r.keys[:i]):  # the slices pinned before: unpinned
                engine.complete_load(part)
            return wire.Reply(wire.Op.PREPARE_LOAD, False, cache.generation,
                              error=f"{e} (from block {i} of {len(r.keys)})")
    stored = sum(from_storage)
    s.figures["loads"] += len(ids)
    s.figures["hit_storage_blocks"] += stored
    s.figures["hit_host_blocks"] += len(ids) - stored
    ns.blocks["loaded_storage"] += stored
    ns.blocks["loaded_host"] += len(ids) - stored
    return wire.Reply(wire.Op.PREPARE_LOAD, True, cache.generation, ids=ids,
                      flags=bytes(from_storage))

def _remove(s: Session, engine: EngineSession, ns: Namespace,
            r: wire.OpRecord) -> wire.Reply:
    """Blocks this engine holds a load of, removed from every tier of the node (see
    `wire`: REMOVE); anything else refused whole in one line, nothing removed."""
    gen = ns.keyed.generation
    reason = wire.REMOVE_REASONS.get(r.flag)
    if reason is None:
        return wire.Reply(wire.Op.REMOVE, False, gen,
                          error=f"REMOVE: unknown reason code {r.flag} (known: "
                                f"{sorted(wire.REMOVE_REASONS)})")
    if not r.keys or len(r.keys) > wire.MAX_REMOVE_KEYS:
        return wire.Reply(wire.Op.REMOVE, False, gen,
                          error=f"REMOVE: {len(r.keys)} keys, 1 to "
                                f"{wire.MAX_REMOVE_KEYS} (MAX_REMOVE_KEYS)")
    try:
        removal = engine.remove_loaded(r.keys, reason)
    except InvalidRequestError as e:
        return wire.Reply(wire.Op.REMOVE, False, gen, error=f"REMOVE: {e}")
    s.figures["removed"] += removal.host
    log.warning("kvtier serve: engine %d (pid %d) removed %d blocks of namespace %s from "
                "the node (%s): %d host copies, %d storage pages deleted",
                s.sid, s.pid, removal.blocks, ns.name, reason, removal.host,
                removal.storage_asked)
    return wire.Reply(wire.Op.REMOVE, True, gen, evicted=removal.host,
                      ids=[removal.blocks, removal.storage_asked])
