"""One namespace's tier events, read by several consumers: the service's publisher
(`node.events`) and every engine connection that asked for its namespace's events (the
EVENTS op), each at its own pace.

`KeyedHostCache.take_events()` hands each event out once, so it has one caller: this fan-out
(`drain_if_due`, once per `interval_s`, called by the server's housekeeping thread: the
reconciliation's pass over the tree never runs on an engine's reply path, and nothing piles
up in the keyed cache while nobody reads). What it takes goes into a bounded log; each
consumer has a cursor into it::

    subscribe          consumer at the log's end, its backlog = the namespace's reported
                       state now (a stored event per tier with blocks): a late consumer
                       starts from what is servable, not from an empty tier
    read(budget)       its backlog first, then the log from its cursor on, at most `budget`
                       hash bytes (at least one chunk): the cursor advances over what it got
    fell behind        the log was trimmed past its cursor (more than `bound_hashes` hashes
                       arrived since it last read): its next read says RESYNC and carries,
                       as its backlog, the reported state at that moment; the consumer treats
                       every block it announced as removed, then applies what follows (the
                       state, then the log). A removal is never lost: either it is in the
                       log from the cursor on, or the state no longer holds the block
    unsubscribe        the cursor and backlog dropped

The snapshot and the log agree because both come from one `take_events_and_state` call (the
keyed cache's lock held across the take and the copy of its reported sets): the state is
exactly what the log's events up to `next_seq` add up to.

Data structures: `_log`, a deque of (event, hash bytes) chunks of at most `CHUNK_BYTES`
hash bytes each, entry i has seq `first_seq + i`; `next_seq`; `held`, the hashes in the log;
`_consumers`: id -> `_Consumer` (cursor, backlog deque, resync flag). Invariants:
`first_seq + len(_log) == next_seq`; `held` <= `bound_hashes` after every drain; a
consumer's cursor is in [first_seq, next_seq] or it is due a resync; entries every
consumer has read are dropped (the log holds only what someone still has to read).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvtier.manager.keyed_events import HOST, STORAGE, TierEvent

# a chunk's hash bytes: 8,192 32-byte hashes; a POST /reset of a large host tier is one
# TierEvent, split so that a reply can carry part of it and a slow reader trims in steps
CHUNK_BYTES = 256 << 10
BOUND_HASHES = 1 << 17  # ~131k hashes (~10 MiB with their tuples) kept per namespace

# (events since the last take, the reported state (host hashes, storage hashes) or None)
Take = Callable[[bool], tuple[list[TierEvent], tuple[list[bytes], list[bytes]] | None]]


@dataclass(slots=True)
class _Consumer:
    cursor: int
    backlog: deque[tuple[TierEvent, int]] = field(default_factory=deque)
    resync: bool = False


def _chunks(events: Iterable[TierEvent]) -> Iterable[tuple[TierEvent, int]]:
    """Each event in pieces of at most CHUNK_BYTES hash bytes, with their byte count."""
    for e in events:
        part: list[bytes] = []
        size = 0
        for h in e.hashes:
            if part and size + len(h) > CHUNK_BYTES:
                yield TierEvent(e.tier, e.removed, tuple(part)), size
                part, size = [], 0
            part.append(h)
            size += len(h)
        if part:
            yield TierEvent(e.tier, e.removed, tuple(part)), size


class EventFanout:
    """See the module docstring. `take(state)`: the keyed cache's events since its last
    take, and with `state` its reported host / storage sets, atomically."""

    def __init__(self, take: Take, interval_s: float, bound_hashes: int = BOUND_HASHES,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._take = take
        self.interval_s = interval_s
        self.bound_hashes = bound_hashes
        self._clock = clock
        self._lock = threading.Lock()
        self._log: deque[tuple[TierEvent, int]] = deque()
        self._sizes: deque[int] = deque()  # hashes per log entry
        self.first_seq = 0
        self.next_seq = 0
        self.held = 0
        self._consumers: dict[int, _Consumer] = {}
        self._ids = itertools.count(1)
        self._drained_at = -float("inf")
        self.resyncs = 0
        self.drains = 0
        self.trimmed = 0  # entries dropped before every consumer had read them

    # ------------------------------------------------------------------ consumers

    def subscribe(self) -> int:
        """A new consumer; its first read starts with the reported state now."""
        with self._lock:
            cid = next(self._ids)
            c = _Consumer(self.next_seq)
            self._consumers[cid] = c
            self._restart(c, resync=False)
            return cid

    def unsubscribe(self, cid: int) -> None:
        with self._lock:
            self._consumers.pop(cid, None)
            self._drop_read()

    @property
    def consumers(self) -> int:
        return len(self._consumers)

    def read(self, cid: int, budget: int | None = None) -> tuple[bool, list[TierEvent]]:
        """(resync, events) for consumer `cid`: see the module docstring. `budget`: hash
        bytes at most (None: everything), at least one chunk when there is one."""
        with self._lock:
            c = self._consumers[cid]
            if c.cursor < self.first_seq:
                self._restart(c, resync=True)
            out: list[TierEvent] = []
            left = budget
            backlog = c.backlog
            while backlog and (left is None or left > 0 or not out):
                e, n = backlog.popleft()
                out.append(e)
                if left is not None:
                    left -= n
            log, first = self._log, self.first_seq
            while c.cursor < self.next_seq and (left is None or left > 0 or not out):
                e, n = log[c.cursor - first]
                out.append(e)
                c.cursor += 1
                if left is not None:
                    left -= n
            resync, c.resync = c.resync, False
            self._drop_read()
            return resync, out

    # ------------------------------------------------------------------ draining

    def drain_if_due(self) -> None:
        """Take the keyed cache's events if `interval_s` has passed since the last take
        (the server's housekeeping thread)."""
        with self._lock:
            if self._clock() - self._drained_at >= self.interval_s:
                self._drain(state=False)

    def _drain(self, state: bool) -> tuple[list[bytes], list[bytes]] | None:
        events, snap = self._take(state)
        self._drained_at = self._clock()
        self.drains += 1
        # nobody to read them: dropped (a new consumer starts from the state)
        if self._consumers:
            for e, n in _chunks(events):
                self._log.append((e, n))
                self._sizes.append(len(e.hashes))
                self.held += len(e.hashes)
                self.next_seq += 1
        while self.held > self.bound_hashes and self._log:
            self._pop()
            self.trimmed += 1
        return snap

    def _restart(self, c: _Consumer, resync: bool) -> None:
        """Consumer `c` from the reported state now on (under the lock)."""
        snap = self._drain(state=True)
        assert snap is not None
        host, storage = snap
        c.backlog = deque(_chunks(
            TierEvent(tier, False, tuple(hashes))
            for tier, hashes in ((HOST, host), (STORAGE, storage)) if hashes))
        c.cursor = self.next_seq
        c.resync = resync
        if resync:
            self.resyncs += 1
        self._drop_read()

    def _pop(self) -> None:
        self._log.popleft()
        self.held -= self._sizes.popleft()
        self.first_seq += 1

    def _drop_read(self) -> None:
        """Entries every consumer has read leave the log."""
        low = min((c.cursor for c in self._consumers.values()), default=self.next_seq)
        while self.first_seq < low:
            self._pop()
