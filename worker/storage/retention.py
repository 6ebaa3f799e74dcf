"""Retention marks of one storage backend: what the manager asked to keep (issue 36).

The manager owns retention (`kvtier.manager.tenants.TenantBook`, per block: pin, TTL,
priority, set over REST or through a `kvtier.retain` kv_hints action). It sends the same
retention for the blocks' storage pages as one RETAIN task (`kvtier.worker.wire`) to every
rank; each rank's backend records it here and applies it in its own way:

    file    capacity eviction never takes a held page (pinned, or within its TTL) and takes
            lower priorities first (`FileBackend._evict_locked`)
    redis   a pinned page's key loses its expiry (PERSIST) and gets the ordinary one back on
            unpin; a TTL lifts the key's expiry to at least that long (EXPIRE ... GT); a page
            written while a mark holds is written with that expiry (`RedisBackend.set`)

A mark is set before or after its page exists: a RETAIN sent ahead of a backup makes the
backup honour it (RETAIN and BACKUP share the storage-write lane, in order).

Mark life::

    retain(pin)      -> pinned until unpin (a later retain without pin leaves it pinned)
    retain(ttl_s)    -> held until max(until, now + ttl_s): never shortened
    retain(priority) -> priority replaced (the manager's book does the same)
    unpin            -> pin off; the TTL and priority stay
    a mark neither pinned, within its TTL nor of priority != 0 is dropped when met
    delete / clear   -> the page's mark is dropped with the page
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

MAX_MARKS = 1 << 17
"""Marks one backend keeps (about 200 B each with the dict: 26 MB at most). 2**17 pages of
64-token blocks are 8.4M tokens per rank; a retain past it is refused for the pages that do
not fit (`retain_refused_pages`), the manager's host retention is not affected."""


@dataclass(slots=True)
class Mark:
    """The retention of one page: `pin`, `until` (time.monotonic() deadline of its TTL; 0:
    none), `priority` (-8..8, lower goes first), `seq` (when its priority was last set:
    the order within a priority other than 0)."""

    pin: bool = False
    until: float = 0.0
    priority: int = 0
    seq: int = 0

    def held(self, now: float) -> bool:
        """Kept whatever the pressure: pinned, or within its TTL."""
        return self.pin or self.until > now

    def live(self, now: float) -> bool:
        return self.pin or self.until > now or self.priority != 0


class RetentionMarks:
    """Marks by hex page key (`_marks`: hex key -> `Mark`, at most `MAX_MARKS`), guarded by
    `_lock` (the write lane sets them; the read lane's file evictions read them).
    Invariant: every mark in `_marks` was live when last set or met (a dead one is dropped
    when met)."""

    def __init__(self, limit: int = MAX_MARKS) -> None:
        self._lock = threading.Lock()
        self._marks: dict[str, Mark] = {}
        self._seq = 0
        self._gen = 0  # bumped by every change: the cached eviction plan is stale then
        self._plan: tuple[int, float, set[str], list[str], list[str]] | None = None
        self.limit = limit
        self.refused = 0

    def __len__(self) -> int:
        return len(self._marks)

    def __bool__(self) -> bool:
        return bool(self._marks)

    def retain(self, hexkeys: Iterable[str], *, pin: bool, ttl_s: float, priority: int,
               now: float | None = None) -> list[str]:
        """Mark these pages; returns the keys marked (those past `limit` are refused)."""
        now = time.monotonic() if now is None else now
        until = now + ttl_s if ttl_s > 0 else 0.0
        out: list[str] = []
        changed = False
        with self._lock:
            marks = self._marks
            for h in hexkeys:
                m = marks.get(h)
                if m is None:
                    if not (pin or until or priority):
                        continue  # nothing to keep: no mark (and one less dead entry)
                    if len(marks) >= self.limit:
                        self.refused += 1
                        continue
                    m = marks[h] = Mark()
                    changed = True
                was_held = m.held(now)
                m.pin = m.pin or pin
                m.until = max(m.until, until)
                # a TTL refreshed on a page still held changes no eviction plan: the
                # per-request refreshes of a kv_hints retention do not make it recomputed
                changed = changed or was_held != m.held(now)
                if m.priority != priority:
                    self._seq += 1
                    m.priority, m.seq = priority, self._seq
                    changed = True
                if not m.live(now):
                    del marks[h]
                    changed = True
                out.append(h)
            if changed:
                self._gen += 1
        return out

    def unpin(self, hexkeys: Iterable[str], now: float | None = None) -> list[str]:
        """Take the pin off these pages; returns the keys that were pinned."""
        now = time.monotonic() if now is None else now
        out: list[str] = []
        with self._lock:
            self._gen += 1  # (a no-op unpin recomputes the plan once: unpins are rare)
            for h in hexkeys:
                m = self._marks.get(h)
                if m is None or not m.pin:
                    continue
                m.pin = False
                out.append(h)
                if not m.live(now):
                    del self._marks[h]
        return out

    def get(self, hexkey: str, now: float) -> Mark | None:
        """The page's live mark (a copy), or None; a dead one is dropped."""
        with self._lock:
            m = self._marks.get(hexkey)
            if m is None:
                return None
            if not m.live(now):
                del self._marks[hexkey]
                self._gen += 1
                return None
            return Mark(m.pin, m.until, m.priority, m.seq)

    def eviction_plan(self, now: float) -> tuple[set[str], list[str], list[str]]:
        """For a capacity eviction: (every marked key, kept out of the plain LRU walk; the
        keys to take before it: priority < 0, lowest first, oldest mark first; the keys to
        take after it: priority > 0, the same order). Held pages are in neither list; dead
        marks are dropped. The plan is cached until a mark changes or the first TTL in it
        passes: an eviction per page write then costs O(1) here, not O(marks). Measured
        on the shared 2-core box (a micro-benchmark quoted in the i36s note): 131,072 marks
        take 109 ms to plan afresh (after any retain), 22 us when cached; a file write under
        capacity pressure costs 75 us a page without marks, 86 us with 64 pinned pages and
        99 us with 1,024 (2,048-page capacity, 1 KiB pages). The plan's validity: a pinned
        or TTL-held page whose TTL is refreshed stays held, so that changes nothing."""
        with self._lock:
            plan = self._plan
            if plan is not None and plan[0] == self._gen and now < plan[1]:
                return plan[2], plan[3], plan[4]
            low: list[tuple[int, int, str]] = []
            high: list[tuple[int, int, str]] = []
            dead = [h for h, m in self._marks.items() if not m.live(now)]
            for h in dead:
                del self._marks[h]
            if dead:
                self._gen += 1
            valid_until = float("inf")
            for h, m in self._marks.items():
                if m.until > now:
                    valid_until = min(valid_until, m.until)
                if m.held(now):
                    continue
                (low if m.priority < 0 else high).append((m.priority, m.seq, h))
            low.sort()
            high.sort()
            marked = set(self._marks)
            lows, highs = [h for _, _, h in low], [h for _, _, h in high]
            self._plan = (self._gen, valid_until, marked, lows, highs)
            return marked, lows, highs

    def drop(self, hexkeys: Iterable[str]) -> None:
        with self._lock:
            self._gen += 1
            for h in hexkeys:
                self._marks.pop(h, None)

    def clear(self) -> None:
        with self._lock:
            self._gen += 1
            self._marks.clear()

    def counts(self, now: float) -> dict[str, int]:
        """Figures for `stats()`: pages pinned, held by a TTL only, marks, refusals."""
        with self._lock:
            pinned = sum(m.pin for m in self._marks.values())
            ttl = sum(not m.pin and m.until > now for m in self._marks.values())
            return {"retained_pinned_pages": pinned, "retained_ttl_pages": ttl,
                    "retention_marks": len(self._marks), "retain_refused_pages": self.refused}
