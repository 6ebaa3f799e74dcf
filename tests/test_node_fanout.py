"""The per-namespace event fan-out of the node service (`kvtier.manager.node.fanout`): one
log, a cursor per reader, a bound, RESYNC for a reader that fell behind.

A hypothesis state machine drives a model keyed cache (blocks become and stop being
servable per tier; each take hands out the changes since the last one, and the state) and
several readers that subscribe, read with small or no budgets and leave, under a tiny bound.
After every step, for every reader: what it rebuilt (stored adds, removed takes away, RESYNC
clears first) plus what it has not read yet adds up to the model's state; a reader that read
everything holds exactly the state; a removal only ever names a block the reader holds;
the log never holds more than the bound after a drain, nor entries every reader has read.
Reads drain only to resync (the server's housekeeping thread drains, `drain_if_due`).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvtier.manager.keyed_events import HOST, STORAGE, TierEvent
from kvtier.manager.node.fanout import EventFanout
from support import examples

pytestmark = pytest.mark.fast

TIERS = (HOST, STORAGE)


class ModelCache:
    """What `KeyedHostCache.take_events_and_state` gives: changes since the last take and
    the reported state."""

    def __init__(self) -> None:
        self.state: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.pending: list[TierEvent] = []

    def flip(self, tier: str, hashes: list[bytes]) -> None:
        held = self.state[tier]
        added = [h for h in dict.fromkeys(hashes) if h not in held]
        gone = [h for h in dict.fromkeys(hashes) if h in held]
        held.update(added)
        held.difference_update(gone)
        if gone:
            self.pending.append(TierEvent(tier, True, tuple(gone)))
        if added:
            self.pending.append(TierEvent(tier, False, tuple(added)))

    def take(self, state: bool) -> tuple[list[TierEvent],
                                         tuple[list[bytes], list[bytes]] | None]:
        out, self.pending = self.pending, []
        return out, ((list(self.state[HOST]), list(self.state[STORAGE])) if state else None)


class Reader:
    def __init__(self) -> None:
        self.held: dict[str, set[bytes]] = {t: set() for t in TIERS}
        self.resyncs = 0

    def apply(self, resync: bool, events: list[TierEvent]) -> None:
        if resync:
            self.resyncs += 1
            for s in self.held.values():
                s.clear()
        for e in events:
            if e.removed:
                stray = set(e.hashes) - self.held[e.tier]
                assert not stray, f"removal of {len(stray)} block(s) never announced"
                self.held[e.tier].difference_update(e.hashes)
            else:
                self.held[e.tier].update(e.hashes)


HASHES = [bytes([i]) * 32 for i in range(24)]


class FanoutMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.cache = ModelCache()
        self.now = 0.0
        self.fan = EventFanout(self.cache.take, interval_s=1.0, bound_hashes=10,
                               clock=lambda: self.now)
        self.readers: dict[int, Reader] = {}
        self.drained_state: dict[str, set[bytes]] = {t: set() for t in TIERS}

    def _drained(self) -> None:
        self.drained_state = {t: set(s) for t, s in self.cache.state.items()}

    @rule(tier=st.sampled_from(TIERS), picks=st.lists(st.sampled_from(HASHES), min_size=1,
                                                      max_size=12))
    def change(self, tier: str, picks: list[bytes]) -> None:
        self.cache.flip(tier, picks)

    @rule()
    def time_passes(self) -> None:
        self.now += 1.0

    @rule()
    def housekeeping(self) -> None:
        before = self.fan.drains
        self.fan.drain_if_due()
        if self.fan.drains != before:
            self._drained()

    @precondition(lambda self: len(self.readers) < 4)
    @rule()
    def subscribe(self) -> None:
        self.readers[self.fan.subscribe()] = Reader()
        self._drained()

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data())
    def unsubscribe(self, data: st.DataObject) -> None:
        cid = data.draw(st.sampled_from(sorted(self.readers)))
        self.fan.unsubscribe(cid)
        del self.readers[cid]

    @precondition(lambda self: bool(self.readers))
    @rule(data=st.data(), budget=st.sampled_from([None, 1, 40, 200]))
    def read(self, data: st.DataObject, budget: int | None) -> None:
        cid = data.draw(st.sampled_from(sorted(self.readers)))
        before = self.fan.drains
        resync, events = self.fan.read(cid, budget)
        if self.fan.drains != before:  # a RESYNC takes the state (and what is pending)
            self._drained()
        self.readers[cid].apply(resync, events)
        if budget is None:  # read everything: exactly the state of the last take
            assert self.readers[cid].held == self.drained_state

    @invariant()
    def bounded_and_trimmed(self) -> None:
        fan = self.fan
        assert fan.first_seq + len(fan._log) == fan.next_seq
        assert fan.held == sum(len(e.hashes) for e, _ in fan._log)
        assert fan.held <= fan.bound_hashes or len(fan._log) == 0
        live = [c.cursor for c in fan._consumers.values() if c.cursor >= fan.first_seq]
        if len(live) == len(fan._consumers):  # nobody due a resync: nothing read by all
            assert fan.first_seq == min(live, default=fan.next_seq)


TestFanout = FanoutMachine.TestCase
TestFanout.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None,
                               suppress_health_check=[HealthCheck.too_slow])


def _take_all(fan: EventFanout, cid: int, budget: int | None = None) -> list[Any]:
    out = []
    while True:
        resync, got = fan.read(cid, budget)
        if not got and not resync:
            return out
        out.append((resync, got))


def test_a_late_reader_starts_from_the_state_and_a_slow_one_resyncs() -> None:
    cache = ModelCache()
    fan = EventFanout(cache.take, interval_s=0.0, bound_hashes=4)
    cache.flip(HOST, HASHES[:3])
    early = fan.subscribe()
    resync, got = fan.read(early)
    assert not resync and [(e.tier, e.removed, set(e.hashes)) for e in got] == [
        (HOST, False, set(HASHES[:3]))]
    cache.flip(HOST, HASHES[:1])  # removed
    late = fan.subscribe()
    resync, got = fan.read(late)
    assert not resync and {h for e in got for h in e.hashes} == set(HASHES[1:3])
    # the early reader does not read while 7 changes (over the bound of 4) arrive; the
    # late one keeps up
    cache.flip(STORAGE, HASHES[3:6])
    assert fan.read(late) == (False, [])  # nothing before the housekeeping's drain
    fan.drain_if_due()
    assert fan.read(late) == (False, [TierEvent(STORAGE, False, tuple(HASHES[3:6]))])
    cache.flip(STORAGE, HASHES[6:9])
    fan.drain_if_due()
    assert fan.read(late) == (False, [TierEvent(STORAGE, False, tuple(HASHES[6:9]))])
    assert fan.trimmed == 2
    resync, got = fan.read(early)
    assert resync and fan.resyncs == 1
    r = Reader()
    r.apply(resync, got)
    assert r.held == {HOST: set(HASHES[1:3]), STORAGE: set(HASHES[3:9])}


def test_budgets_split_and_nothing_is_read_twice() -> None:
    cache = ModelCache()
    fan = EventFanout(cache.take, interval_s=0.0)
    cid = fan.subscribe()
    many = [i.to_bytes(32, "big") for i in range(20_000)]  # 640 KB of hashes: 3 chunks
    cache.flip(HOST, many)
    fan.drain_if_due()
    parts = _take_all(fan, cid, budget=1)
    assert len(parts) == 3 and not any(r for r, _ in parts)
    got = [h for _, events in parts for e in events for h in e.hashes]
    assert got == many
    assert fan.held == 0 and len(fan._log) == 0
