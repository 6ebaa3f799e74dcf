"""Randomized sequences of scheduler calls and transfer completions, invariants after every step.

The manager runs against `ModelDispatcher`: tasks stay pending until a rule completes them (in
any order, some failing), and their completions move block contents in a `ContentModel`. After
every step the test checks the brief's invariants (`check_invariants`: every block id of a
tier is exactly one of free / tree / request, counts add up, LRU lists hold exactly the
evictable nodes) and, against the content model, that every cached block holds the content of
its key, that a request reads only blocks whose content belongs to its prefix, and that pinned
prefixes stay cached.

The same machine runs with each write policy, with and without a host tier, and (in
test_worker_processes) against real worker processes.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
from content_model import GARBAGE, ContentModel, ModelDispatcher
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from kvtier.manager.config import KvtierConfig
from kvtier.manager.core.nodes import EVICTING, LOADING, PREFETCHING, SAVING, STORED
from kvtier.manager.errors import (
    AsleepError,
    OutOfBlocksError,
    RequestCancelledError,
    ResetBusyError,
    TransferFailedError,
)
from kvtier.manager.keys import chain_keys
from kvtier.manager.scheduler import TREE_CLEARING, KVCacheManager
from kvtier.manager.storage_tier import StorageTier
from kvtier.manager.transfers import ManualDispatcher
from kvtier.worker.wire import TaskKind
from support import tiny_config

pytestmark = pytest.mark.fast

BS = 4
PREFIXES = [tuple(range(100 * p, 100 * p + 8)) for p in range(3)]
tokens_st = st.builds(
    lambda p, tail: PREFIXES[p] + tuple(tail),
    st.integers(0, len(PREFIXES) - 1),
    st.lists(st.integers(0, 2), min_size=0, max_size=22),
)


# What the randomized runs reached, summed over all of them (checked by the last test).
REACHED = dict.fromkeys(("hit_device_tokens", "hit_host_tokens", "evicted_device_drop",
                         "evicted_device_demote", "evicted_host_drop", "failed_tasks",
                         "resets", "lost_all", "lost_device", "steps"), 0)


class ManagerMachine(RuleBasedStateMachine):
    """Drives one KVCacheManager; subclasses fix the policy and tiers."""

    policy = "write_through_selective"
    device_blocks = 10
    host_blocks = 10

    def __init__(self) -> None:
        super().__init__()
        self.model = ContentModel()
        self.dispatcher = ModelDispatcher(self.model, resolver=self._resolve)
        self.m = KVCacheManager(block_size=BS, device_blocks=self.device_blocks,
                                host_blocks=self.host_blocks, write_policy=self.policy,
                                hit_threshold=2, dispatcher=self.dispatcher,
                                transfer_timeout_s=5.0)
        # as with engine KV: host copies wait for a registration check (`confirm` below)
        self.m.track_device_copies = True
        self.reqs: dict[str, dict] = {}
        self.next_id = 0
        self.fail_next_blocking = False
        self.pins: list[tuple[tuple[int, ...], int]] = []

    def _resolve(self, task):  # type: ignore[no-untyped-def]
        """Outcome of a task the manager blocks on (write-back eviction)."""
        ok = not self.fail_next_blocking
        self.fail_next_blocking = False
        return ok, 0

    # ------------------------------------------------------------------ rules

    def complete_all(self) -> None:
        for seq in sorted(self.dispatcher.tasks):
            self.dispatcher.complete(seq, True)

    @initialize()
    def warm_caches(self) -> None:
        """Every example starts from overflowing caches: each prefix with a 12-token tail (5
        blocks each, 15 for 10 device blocks: the oldest are evicted), then the first prefix
        again with its loads completed. So every run holds evicted blocks and, with a host
        tier that keeps them, has served host hits, however short its random part is (left to
        chance, a run reached no host hit about once in 20)."""
        tail = (0, 1, 2) * 4
        for prefix in (*PREFIXES, PREFIXES[0]):
            tokens = prefix + tail
            self.match(tokens)
            rid = f"r{self.next_id - 1}"
            self.complete_all()
            r = self.reqs[rid]
            self.m.allocate(rid, len(tokens) - r["hit"], reserve_blocks=0)
            r["alloc"] = True
            self.read_rid(rid)
            self.commit_rid(rid, 1.0)
            self.release_rid(rid)
            self.complete_all()

    @rule(tokens=tokens_st)
    def match(self, tokens: tuple[int, ...]) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        res = self.m.match(rid, list(tokens))
        keys = self.m.request_keys(rid)
        assert res.num_tokens % BS == 0 and res.num_tokens <= max(0, len(tokens) - 1)
        assert len(res.block_ids) * BS == res.num_tokens
        self.reqs[rid] = {"tokens": tokens, "keys": keys, "hit": res.num_tokens,
                          "handle": res.handle, "alloc": False, "valid": res.num_tokens}
        for p_tokens, p_blocks in self.pins:
            if tokens[: len(p_tokens)] == p_tokens:
                cap = (len(tokens) - 1) // BS
                assert res.num_tokens // BS >= min(p_blocks, cap), (
                    f"pinned prefix of {p_blocks} blocks not matched: {res}")

    @rule(tokens=tokens_st, data=st.data())
    def whole_request(self, tokens: tuple[int, ...], data) -> None:  # type: ignore[no-untyped-def]
        """match, allocate, compute, commit and release in one go (fills the caches)."""
        self.match(tokens)
        rid = f"r{self.next_id - 1}"
        r = self.reqs[rid]
        try:
            self.m.allocate(rid, len(tokens) - r["hit"], reserve_blocks=0)
        except OutOfBlocksError:
            self.release_rid(rid)
            return
        r["alloc"] = True
        if self.loads_done(r):
            self.read_rid(rid)
            self.commit_rid(rid, 1.0)
        self.release_rid(rid)

    def loads_done(self, r: dict) -> bool:
        """Whether the request's loads have landed (here: completed by a rule)."""
        return bool(r["handle"].done)

    def _pick(self, data):  # type: ignore[no-untyped-def]
        return data.draw(st.sampled_from(sorted(self.reqs)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.integers(0, 6))
    def allocate(self, data, extra: int) -> None:  # type: ignore[no-untyped-def]
        rid = self._pick(data)
        r = self.reqs[rid]
        if r["alloc"]:
            return
        need = len(r["tokens"]) - r["hit"] + extra
        before = self.m.stats()
        before_blocks = self.m.request_blocks(rid)
        try:
            self.m.allocate(rid, need, reserve_blocks=0)
            r["alloc"] = True
        except OutOfBlocksError:
            after = self.m.stats()
            assert self.m.request_blocks(rid) == before_blocks
            assert after["device"]["free"] == before["device"]["free"]  # nothing taken or evicted
            assert after["nodes"] == before["nodes"]

    @precondition(lambda self: any(r["alloc"] for r in self.reqs.values()))
    @rule(data=st.data(), frac=st.floats(0, 1))
    def compute_and_commit(self, data, frac: float) -> None:  # type: ignore[no-untyped-def]
        rid = data.draw(st.sampled_from(sorted(k for k, r in self.reqs.items() if r["alloc"])))
        self.commit_rid(rid, frac)

    def commit_rid(self, rid: str, frac: float) -> None:
        r = self.reqs[rid]
        tokens = r["tokens"]
        upto = r.get("committed", r["valid"]) + int(frac * (len(tokens) - r["valid"]))
        upto = min(len(tokens), max(upto, r.get("committed", 0)))
        blocks = self.m.request_blocks(rid)
        keys = r["keys"]
        first = r.get("computed_blocks", r["valid"] // BS)
        if upto // BS > first:  # the model runner writes the KV of every full block it computes
            self.write_computed(blocks[first:upto // BS], keys[first:upto // BS])
        r["computed_blocks"] = max(first, upto // BS)
        self.m.commit(rid, list(tokens), upto)
        r["committed"] = upto

    def write_computed(self, blocks: list[int], keys: list[int]) -> None:
        """The model runner writes computed KV: here, each block's content becomes its key."""
        for block, key in zip(blocks, keys, strict=True):
            self.model.device[block] = key

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def read(self, data) -> None:  # type: ignore[no-untyped-def]
        """The model runner reads the matched prefix once its loads are done."""
        self.read_rid(self._pick(data))

    def read_rid(self, rid: str) -> None:
        r = self.reqs[rid]
        handle = r["handle"]
        if not handle.done:
            return
        try:
            handle.wait(0)
            valid = r["hit"]
        except TransferFailedError as e:
            valid = e.valid_tokens
        r["valid"] = min(r["valid"], valid)
        blocks = self.m.request_blocks(rid)
        for i in range(r["valid"] // BS):
            got = self.model.device.get(blocks[i], GARBAGE)
            assert got == r["keys"][i], (
                f"{rid} block {i} (device {blocks[i]}) holds {got}, expected {r['keys'][i]}")

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def release(self, data) -> None:  # type: ignore[no-untyped-def]
        self.release_rid(self._pick(data))

    def release_rid(self, rid: str) -> None:
        self.m.release(rid)
        del self.reqs[rid]

    @precondition(lambda self: self.dispatcher.tasks)
    @rule(data=st.data(), ok=st.booleans(), ok_bias=st.integers(0, 3))
    def complete(self, data, ok: bool, ok_bias: int) -> None:  # type: ignore[no-untyped-def]
        seq = data.draw(st.sampled_from(sorted(self.dispatcher.tasks)))
        self.dispatcher.complete(seq, ok or ok_bias > 0)

    @rule()
    def fail_next_blocking_wait(self) -> None:
        self.fail_next_blocking = True

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:
        if roll:  # resets are rare, so the caches get to fill and evict
            return
        pending = bool(self.dispatcher.tasks)
        before = self.m.stats()
        try:
            self.m.reset(timeout=0.01)
        except ResetBusyError:
            assert pending
            assert self.m.stats()["nodes"] == before["nodes"]
            return
        assert not pending
        assert self.m.stats()["nodes"] == 0
        self.pins.clear()

    @rule(roll=st.integers(0, 14))
    def worker_lost(self, roll: int) -> None:
        """A worker died with its pools: every byte is gone, the tree is forgotten, the
        requests in flight are dropped by the engine -- while transfers may still be
        pending on the surviving ranks (they complete later, in any order)."""
        if roll:
            return
        self.m.lose_all()
        for contents in (self.model.device, self.model.host):
            for k in contents:
                contents[k] = GARBAGE
        for seq, snap in self.model.snapshots.items():
            self.model.snapshots[seq] = [GARBAGE] * len(snap)
        self.pins.clear()
        for rid in list(self.reqs):
            self.release_rid(rid)
        assert self.m.stats()["nodes"] == 0
        # The engine goes on at once: a new request takes whatever blocks are free now,
        # possibly while transfers of the lost tree are still pending.
        self.whole_request(PREFIXES[0] + (2, 1, 0, 2, 1, 0, 2, 1, 0, 2), None)

    @rule(roll=st.integers(0, 2))
    def confirm(self, roll: int) -> None:
        """A registration check found the model runner's memory unchanged."""
        if not roll:
            self.m.confirm_device_copies(self.m.device_copy_mark())

    @rule(roll=st.integers(0, 14))
    def device_lost(self, roll: int) -> None:
        """The model runner registered new (zeroed) KV memory: every device byte is gone,
        copies from the device in flight read the new memory, kvtier's host blocks keep
        their bytes. The host copies the manager keeps must still hold their keys (the
        content invariant checks it), requests active at the loss commit nothing, and the
        engine drops them."""
        if roll:
            return
        self.m.lose_device()
        for k in self.model.device:
            self.model.device[k] = GARBAGE
        for seq, task in self.dispatcher.tasks.items():
            if task.kind == TaskKind.D2H and seq in self.model.snapshots:
                self.model.snapshots[seq] = [GARBAGE] * len(task.src)
        for rid in list(self.reqs):
            self.release_rid(rid)
        self.pins = [(t, n) for t, n in self.pins if self._pinned(t)]
        self.whole_request(PREFIXES[1] + (0, 2, 1, 0, 2, 1, 0, 2, 1, 0), None)

    def _pinned(self, tokens: tuple[int, ...]) -> bool:
        """Whether every block of a pinned prefix is still in the tree (a pin lives on with
        its host copy; without one it went with the device)."""
        from kvtier.manager.keys import chain_keys

        return all(k in self.m._map for k in chain_keys(list(tokens), BS))

    @rule(tokens=tokens_st)
    def pin(self, tokens: tuple[int, ...]) -> None:
        n = self.m.pin(list(tokens))
        if n:
            self.pins.append((tokens[: n * BS], n))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data) -> None:  # type: ignore[no-untyped-def]
        i = data.draw(st.integers(0, len(self.pins) - 1))
        tokens, n = self.pins.pop(i)
        assert self.m.unpin(list(tokens)) == n

    # ------------------------------------------------------------------ invariants

    @invariant()
    def brief_invariants(self) -> None:
        REACHED["steps"] += 1
        self.m.check_invariants()

    @invariant()
    def cached_content_belongs_to_key(self) -> None:
        for node in list(self.m._map.values()):
            if node.dev is not None and not node.flags & LOADING:
                got = self.model.device.get(node.dev, GARBAGE)
                assert got == node.key, f"device block of {node} holds {got}"
            if node.host is not None and not node.flags & (SAVING | EVICTING | PREFETCHING):
                got = self.model.host.get(node.host, GARBAGE)
                assert got == node.key, f"host block of {node} holds {got}"

    @invariant()
    def pending_tasks_are_transfers(self) -> None:
        assert not self.m.ledger.outbox, f"queued, never sent: {self.m.ledger.outbox}"
        for t in self.dispatcher.tasks.values():
            assert t.kind in (TaskKind.D2H, TaskKind.H2D)

    def teardown(self) -> None:
        c = self.m.stats()["counters"]
        for k in REACHED:
            if k != "steps":
                REACHED[k] += c[k]  # type: ignore[index]
        for seq in sorted(self.dispatcher.tasks):
            self.dispatcher.complete(seq, True)
        for rid in list(self.reqs):
            self.m.release(rid)
        self.m.check_invariants()
        s = self.m.stats()
        assert s["device"]["owned_by_requests"] == 0, "blocks leaked to finished requests"
        self.m.reset(timeout=1)
        s = self.m.stats()
        assert s["device"]["free"] == self.device_blocks
        assert s["host"]["free"] == self.host_blocks


SETTINGS = settings(max_examples=25, stateful_step_count=50, deadline=None,
                    suppress_health_check=list(HealthCheck))


def _machine(policy: str, host_blocks: int) -> type[ManagerMachine]:
    return type(f"Machine_{policy}_{host_blocks}", (ManagerMachine,),
                {"policy": policy, "host_blocks": host_blocks})


TestWriteThroughSelective = _machine("write_through_selective", 10).TestCase
TestWriteThroughSelective.settings = SETTINGS
TestWriteThrough = _machine("write_through", 10).TestCase
TestWriteThrough.settings = SETTINGS
TestWriteBack = _machine("write_back", 10).TestCase
TestWriteBack.settings = SETTINGS
TestNoHostTier = _machine("write_through_selective", 0).TestCase
TestNoHostTier.settings = settings(SETTINGS, max_examples=15)


# ---------------------------------------------------------------------- with a storage tier

STORAGE_REACHED = dict.fromkeys(("hit_storage_tokens", "revoked_queries", "revoked_prefetches",
                                 "revoked_pages_kept", "revoked_pages_dropped"), 0)
# What each storage write policy's runs wrote, and host copies evicted unwritten (all runs).
WRITE_REACHED = dict.fromkeys(("write_through_selective", "write_back", "evicted_unstored"), 0)
_storage_dirs: list[str] = []
_storage_configs: dict[str, KvtierConfig] = {}
WRITE_THRESHOLD = 2


def _storage_config(write_policy: str = "write_through") -> KvtierConfig:
    """One loaded configuration per storage write policy for every storage machine (a file
    backend that is never written: the dispatcher stands in for the workers)."""
    if not _storage_dirs:
        _storage_dirs.append(tempfile.mkdtemp(prefix="kvtier-stateful-"))
        atexit.register(shutil.rmtree, _storage_dirs[0], True)
    if write_policy not in _storage_configs:
        _storage_configs[write_policy] = tiny_config(
            workers=1, device_blocks=10, host_blocks=10, storage="file",
            storage_dir=_storage_dirs[0], extra={
                "KVTIER_STORAGE__PREFETCH_POLICY": "best_effort",
                "KVTIER_STORAGE__PREFETCH_THRESHOLD": str(BS),
                "KVTIER_STORAGE__PREFETCH_HOST_BLOCKS_LIMIT": "8",
                "KVTIER_STORAGE__WRITE_POLICY": write_policy,
                "KVTIER_STORAGE__WRITE_THRESHOLD": str(WRITE_THRESHOLD)})
    return _storage_configs[write_policy]


class StorageMachine(ManagerMachine):
    """The same machine with a storage tier (write_through: every committed block reaches
    the host, then storage), best-effort prefetches a scheduler starts and revokes, and
    storage answers chosen by the test: a QUERY tells the truth, a PREFETCH reads any number
    of the leading pages storage holds (0 to all: a revoke or a miss cut it short). The
    content model fills only the pages read; every other block of a prefetch holds garbage,
    so serving one fails the content invariants."""

    policy = "write_through"
    storage_policy = "write_through"

    def __init__(self) -> None:
        super().__init__()
        # kvtier's own device pools here: host copies are trusted (and backed up) at once;
        # copies awaiting a registration check are the base machine's engine-KV case
        self.m.track_device_copies = False
        cfg = _storage_config(self.storage_policy)
        self.tier = StorageTier(self.m, cfg)
        self.m.storage = self.tier
        self._watch_storage_writes()

    def _watch_storage_writes(self) -> None:
        """Check the storage write policy where it acts (the core calls these through the
        instance): every BACKUP as it is made (selective: no copy below the threshold;
        write_back: only while the host tier is full, i.e. evicting), and every host
        eviction against the content model (whether storage held the evicted page)."""
        m, tier, model = self.m, self.tier, self.model
        self.evictions = 0  # host copies take_host_block evicted
        self.evicted_lost = 0  # ... whose page storage (the model) did not hold
        track, take = m.track, m.take_host_block

        def tracked(task, nodes, on_done=None):  # type: ignore[no-untyped-def]
            policy = tier.write_policy
            if task.kind == TaskKind.BACKUP:
                if policy.hit_threshold:
                    low = [n for n in nodes if n.hits < policy.hit_threshold]
                    assert not low, f"write_through_selective wrote {low} below the threshold"
                    WRITE_REACHED[policy.name] += len(nodes)
                if policy.on_host_evict:
                    assert m.host_free == 0, "write_back wrote while the host tier had room"
                    WRITE_REACHED[policy.name] += len(nodes)
            track(task, nodes, on_done)

        def take_host_block():  # type: ignore[no-untyped-def]
            held = [n for n in m._map.values() if n.host is not None]
            hb = take()
            for n in held:
                if n.host is None:  # the copy this call evicted
                    self.evictions += 1
                    self.evicted_lost += model.storage.get(n.skey, GARBAGE) == GARBAGE
            return hb

        m.track = tracked  # type: ignore[method-assign]
        m.take_host_block = take_host_block  # type: ignore[method-assign]

    def _resolve(self, task):  # type: ignore[no-untyped-def]
        if task.kind == TaskKind.QUERY:
            return True, self.model.leading_stored(list(task.keys))
        return super()._resolve(task)

    @rule(tokens=tokens_st)
    def prefetch(self, tokens: tuple[int, ...]) -> None:
        self.m.prefetch(list(tokens))

    def drain(self) -> None:
        """Answer every task, truthfully and in full, until none is left (answers start more
        tasks: a query its prefetch, a device->host copy its storage backup)."""
        while self.dispatcher.tasks:
            for seq in sorted(self.dispatcher.tasks):
                task = self.dispatcher.tasks[seq]
                result = (self.model.leading_stored(list(task.keys))
                          if task.kind in (TaskKind.QUERY, TaskKind.PREFETCH)
                          else len(task.keys))
                self.dispatcher.complete(seq, True, result)

    @rule(tokens=tokens_st, data=st.data())
    def scheduler_prefetch_then_request(self, tokens: tuple[int, ...], data) -> None:  # type: ignore[no-untyped-def]
        """What an engine does with a queued request: prefetch its prompt, maybe revoke it
        (the request is scheduled before it landed), the prefetch answers with some of its
        pages, then the request runs; what it reads must be its own content."""
        queries = {seq for seq, t in self.dispatcher.tasks.items() if t.kind == TaskKind.QUERY}
        if not self.m.prefetch(list(tokens)):
            return
        revoke_early = data.draw(st.integers(0, 3)) == 0
        if revoke_early:  # aborted while its query is in flight
            self.m.revoke_prefetch(list(tokens))
        for seq, t in list(self.dispatcher.tasks.items()):
            if t.kind == TaskKind.QUERY and seq not in queries:
                self.dispatcher.complete(seq, True, self.model.leading_stored(list(t.keys)))
        prefetches = [seq for seq, t in self.dispatcher.tasks.items()
                      if t.kind == TaskKind.PREFETCH]
        if data.draw(st.booleans()):
            self.m.revoke_prefetch(list(tokens))
        for seq in prefetches:
            t = self.dispatcher.tasks[seq]
            got = data.draw(st.integers(0, self.model.leading_stored(list(t.keys))))
            self.dispatcher.complete(seq, True, got)
        self.whole_request(tokens, data)

    @rule(tokens=tokens_st, data=st.data(), revoke=st.booleans())
    def comes_back_from_storage(self, tokens: tuple[int, ...], data,  # type: ignore[no-untyped-def]
                                revoke: bool) -> None:
        """A prompt computed and backed up, the device and host tiers emptied, the prompt
        prefetched (maybe revoked after part of it was read), then requested again: what
        comes back from storage must be its own content (the content invariants). Random
        steps line this up too rarely for a fresh run to reach every storage path."""
        if len(tokens) < 2 * BS + 1:
            return
        self.whole_request(tokens, data)
        self.drain()  # its device->host copies and their backups land
        self.m.reset(timeout=1)
        self.pins.clear()
        queries = {seq for seq, t in self.dispatcher.tasks.items() if t.kind == TaskKind.QUERY}
        if not self.m.prefetch(list(tokens)):
            return
        for seq, t in list(self.dispatcher.tasks.items()):
            if t.kind == TaskKind.QUERY and seq not in queries:
                self.dispatcher.complete(seq, True, self.model.leading_stored(list(t.keys)))
        prefetches = [seq for seq, t in self.dispatcher.tasks.items()
                      if t.kind == TaskKind.PREFETCH]
        if revoke:
            self.m.revoke_prefetch(list(tokens))
        for seq in prefetches:
            stored = self.model.leading_stored(list(self.dispatcher.tasks[seq].keys))
            got = data.draw(st.integers(min(1, stored), stored)) if revoke else stored
            self.dispatcher.complete(seq, True, got)
        self.drain()
        self.whole_request(tokens, data)

    @rule(roll=st.integers(0, 3))
    def only_storage_left(self, roll: int) -> None:
        """Every backup lands, then the device and host tiers are emptied (an operator's
        reset): what follows finds its prefixes in storage only."""
        if roll:
            return
        self.drain()
        self.m.reset(timeout=1)
        self.pins.clear()

    @rule(tokens=tokens_st)
    def revoke_prefetch(self, tokens: tuple[int, ...]) -> None:
        before = self.tier.counters["revoked_prefetches"]
        n = self.m.revoke_prefetch(list(tokens))
        assert n >= self.tier.counters["revoked_prefetches"] - before

    @precondition(lambda self: self.dispatcher.tasks)
    @rule(data=st.data(), ok=st.booleans(), ok_bias=st.integers(0, 3))
    def complete(self, data, ok: bool, ok_bias: int) -> None:  # type: ignore[no-untyped-def]
        seq = data.draw(st.sampled_from(sorted(self.dispatcher.tasks)))
        task = self.dispatcher.tasks[seq]
        ok = ok or ok_bias > 0
        result = 0
        if task.kind == TaskKind.QUERY:
            result = self.model.leading_stored(list(task.keys))
        elif task.kind == TaskKind.PREFETCH:
            result = data.draw(st.integers(0, self.model.leading_stored(list(task.keys))))
        elif task.kind == TaskKind.BACKUP:
            result = len(task.keys) if ok else 0
        self.dispatcher.complete(seq, ok, result)

    @invariant()
    def pending_tasks_are_transfers(self) -> None:
        # every API call sends the tasks it made before it returns: none waits in the outbox
        assert not self.m.ledger.outbox, f"queued, never sent: {self.m.ledger.outbox}"
        for t in self.dispatcher.tasks.values():
            assert t.kind in (TaskKind.D2H, TaskKind.H2D, TaskKind.QUERY, TaskKind.PREFETCH,
                              TaskKind.BACKUP, TaskKind.REVOKE), t

    @invariant()
    def evicted_copies_are_stored_or_counted(self) -> None:
        """Every host eviction of a page storage lacks is counted (`evicted_host_unstored`;
        a copy whose page an earlier node wrote may be counted too: the flag, not storage,
        is what the core knows)."""
        counted = self.m.counters.evicted_host_unstored
        assert self.evicted_lost <= counted <= self.evictions, (
            self.evicted_lost, counted, self.evictions)

    @invariant()
    def prefetch_accounting(self) -> None:
        tier = self.tier
        assert tier.prefetching_blocks == sum(
            1 for n in self.m._map.values() if n.flags & PREFETCHING) + sum(
            1 for n in self.m._written_off if n.flags & PREFETCHING)
        assert tier._revoked <= set(tier._queries) | set(tier._prefetches)

    def teardown(self) -> None:
        c = self.m.stats()["counters"]
        STORAGE_REACHED["hit_storage_tokens"] += c["hit_storage_tokens"]  # type: ignore[index]
        for k in STORAGE_REACHED:
            if k != "hit_storage_tokens":
                STORAGE_REACHED[k] += self.tier.counters[k]
        WRITE_REACHED["evicted_unstored"] += self.m.counters.evicted_host_unstored
        self.drain()
        assert self.tier.prefetching_blocks == 0 and not self.tier._revoked
        super().teardown()


TestWithStorage = StorageMachine.TestCase
TestWithStorage.settings = settings(SETTINGS, max_examples=100)


class StorageSelectiveMachine(StorageMachine):
    """write_through_selective to storage: a copy is written once its block was hit twice."""

    storage_policy = "write_through_selective"


class StorageWriteBackMachine(StorageMachine):
    """write_back to storage: copies are written only when the host tier evicts them."""

    storage_policy = "write_back"


TestWithStorageSelective = StorageSelectiveMachine.TestCase
TestWithStorageSelective.settings = settings(SETTINGS, max_examples=50)
TestWithStorageWriteBack = StorageWriteBackMachine.TestCase
TestWithStorageWriteBack.settings = settings(SETTINGS, max_examples=50)


def test_storage_write_policies_reached_every_path() -> None:
    """Each storage write policy's machine wrote pages its own way, and some run evicted a
    host copy storage lacked (the counted path)."""
    missing = [k for k, v in WRITE_REACHED.items() if v == 0]
    assert not missing, f"never reached: {missing} ({WRITE_REACHED})"


def _check_all(state: ManagerMachine) -> None:
    """Every invariant of the machine, as hypothesis checks them after each step."""
    for name in dir(type(state)):
        method = getattr(type(state), name)
        if getattr(method, "hypothesis_stateful_invariant", None) is not None:
            method(state)


def test_a_load_failing_under_a_storage_backup_loses_no_block() -> None:
    """The sequence behind a rare TestWithStorage failure ("device: 7 free + 0 tree + 0 owned
    != capacity 10" after the release, then "BACKUP host blocks changed while being
    written"): host copies being written to storage (BACKING) are hit by a match and their
    load fails while the request holds them. The failed load moved each host copy to a
    fresh node but left BACKING, and the BACKUP task, on the detached node: its device block
    came back neither at the release (a transfer in flight) nor as a written-off node's, and
    the fresh node's host copy could be evicted, and its block reused, mid-write. The fresh
    node now carries the backup; the detached node's block goes back with the release."""
    state = StorageMachine()
    tasks = state.dispatcher.tasks

    def complete(kind: TaskKind, ok: bool) -> None:
        for seq in sorted(s for s, t in tasks.items() if t.kind == kind):
            task = tasks[seq]
            result = (state.model.leading_stored(list(task.keys)) if kind == TaskKind.QUERY
                      else len(task.keys))
            state.dispatcher.complete(seq, ok, result)
        _check_all(state)

    tokens = PREFIXES[0] + (0, 1, 2, 0, 1)  # 3 full blocks (13 tokens)
    state.match(tokens)
    complete(TaskKind.QUERY, True)  # storage holds nothing
    state.m.allocate("r0", len(tokens), reserve_blocks=0)
    state.reqs["r0"]["alloc"] = True
    state.commit_rid("r0", 1.0)  # 3 blocks join the tree, their device->host copies start
    complete(TaskKind.D2H, True)  # the host copies land; their BACKUP starts (BACKING)
    assert [t.kind for t in tasks.values()] == [TaskKind.BACKUP]
    state.release_rid("r0")
    _check_all(state)
    big = PREFIXES[1] + (0,) * 32  # all 10 device blocks: the 3 device copies are evicted
    state.match(big)
    state.m.allocate("r1", len(big), reserve_blocks=0)
    state.release_rid("r1")
    _check_all(state)
    complete(TaskKind.QUERY, True)
    state.match(tokens)  # r2: 3 host hits, still BACKING; one H2D loads them
    assert state.reqs["r2"]["hit"] == 3 * BS
    complete(TaskKind.QUERY, True)
    complete(TaskKind.H2D, False)  # the load fails: r2 keeps the blocks to recompute
    state.release_rid("r2")
    _check_all(state)  # failed here: the 3 device blocks were lost to every tier
    stats = state.m.stats()
    assert stats["device"]["free"] == 10 and stats["host"]["cached"] == 3, stats
    # The host copies stay cached, and out of the host LRU while the BACKUP reads them:
    # requests whose backups want every host block cannot evict them (it evicted them, and
    # their blocks were overwritten before the BACKUP answered).
    state.whole_request(PREFIXES[2] + (0,) * 20, None)  # 7 blocks, backed up: 7 host blocks
    complete(TaskKind.QUERY, True)
    complete(TaskKind.D2H, True)  # their BACKUPs start: every host block is busy
    state.whole_request(PREFIXES[1] + (1,) * 20, None)  # 7 more want host blocks: none free
    complete(TaskKind.QUERY, True)
    complete(TaskKind.D2H, True)
    complete(TaskKind.BACKUP, True)  # the pages written are the copies' own
    for key in chain_keys(list(tokens), BS):
        node = state.m.lookup(key)
        assert node is not None and node.host is not None and node.flags & STORED, node
    state.match(tokens)  # host hits again, their content checked by the invariants
    rid = f"r{state.next_id - 1}"
    assert state.reqs[rid]["hit"] == 3 * BS
    complete(TaskKind.H2D, True)
    state.read_rid(rid)
    state.teardown()


def test_storage_runs_reached_every_path() -> None:
    """The storage machine must have served storage hits and revoked queries and
    prefetches, keeping read pages and dropping the rest."""
    missing = [k for k, v in STORAGE_REACHED.items() if v == 0]
    assert not missing, f"never reached: {missing} ({STORAGE_REACHED})"


def test_randomized_runs_reached_every_path() -> None:
    """The machines above must have exercised hits from both tiers, evictions of every
    kind, failed transfers and resets; a generator change that stops reaching them fails."""
    missing = [k for k, v in REACHED.items() if v == 0]
    assert not missing, f"never reached: {missing} ({REACHED})"
    assert REACHED["steps"] >= 2000, f"only {REACHED['steps']} steps checked"


# ---------------------------------------------------------------------- sleep racing waits


def _waiting_storage_manager(on_wait):  # type: ignore[no-untyped-def]
    """A manager with a host tier and a storage tier whose prefetches `match` waits for
    (wait_complete); `on_wait(task)` runs while a match waits with the lock released, as a
    sleep or reset on another thread would."""
    def resolve(task):  # type: ignore[no-untyped-def]
        on_wait(task)
        return True, 0  # storage holds nothing

    dispatcher = ManualDispatcher(resolve)
    m = KVCacheManager(block_size=BS, device_blocks=6, host_blocks=10,
                       write_policy="write_through", dispatcher=dispatcher,
                       transfer_timeout_s=5.0)
    cfg = tiny_config(workers=1, device_blocks=6, host_blocks=10, storage="file",
                      storage_dir=_storage_config().storage.path, extra={
                          "KVTIER_STORAGE__PREFETCH_POLICY": "wait_complete",
                          "KVTIER_STORAGE__PREFETCH_THRESHOLD": str(BS)})
    m.storage = StorageTier(m, cfg)
    return m, dispatcher


def test_a_sleep_while_a_match_waits_for_storage_leaves_nothing_in_flight() -> None:
    """Issue 27, item 1 (stuck asleep): a match that found host hits (flagged LOADING, their
    H2D not sent yet) and then waited for a storage query is cancelled by a sleep. The
    written-off host hits must settle, or every wake answers 'still in flight' for good."""
    sleep_now = [False]

    def on_wait(task):  # type: ignore[no-untyped-def]
        if sleep_now[0] and task.kind == TaskKind.QUERY:
            sleep_now[0] = False
            m.sleep()

    m, dispatcher = _waiting_storage_manager(on_wait)

    def settle_all() -> None:
        while dispatcher.tasks:
            for seq in sorted(dispatcher.tasks):
                dispatcher.complete(seq, True, 0)

    head = list(range(1000, 1000 + 2 * BS))
    m.match("a", [*head, 0])
    m.allocate("a", 2 * BS + 1, reserve_blocks=0)
    m.commit("a", [*head, 0], 2 * BS + 1)
    m.release("a")
    settle_all()  # the head's host copies land
    other = list(range(5000, 5000 + 5 * BS))
    m.match("b", [*other, 0])  # pushes the head off the device (6 device blocks)
    m.allocate("b", 5 * BS + 1, reserve_blocks=0)
    m.commit("b", [*other, 0], 5 * BS + 1)
    m.release("b")
    settle_all()
    assert m.stats()["host"]["cached"] >= 2
    sleep_now[0] = True
    with pytest.raises(RequestCancelledError, match="sleep"):
        m.match("c", head + list(range(7000, 7000 + 3 * BS)) + [0])
    assert m.asleep
    settle_all()
    m.check_invariants()
    assert m.settled(), (f"{len(m._inflight)} task(s), {len(m._written_off)} written-off "
                         "node(s) that no answer will ever settle")
    m.rebuild(6, 10)
    m.wake()
    m.check_invariants()


SLEEP_REACHED = dict.fromkeys(("sleep_in_match_wait", "sleep_in_reset", "sleep_plain",
                               "wakes"), 0)


class SleepMachine(StorageMachine):
    """The storage machine with sleeps (issue 27): matches wait for storage (wait_complete),
    and a sleep lands at a random point -- while a match waits for a storage query or
    prefetch with the lock released, while a reset waits for transfers, or between calls
    with transfers pending. The workers then cancel every task (answered failed), and the
    wake must find nothing in flight (`settled`) at once: a host hit of a cancelled match
    left flagged in flight kept every wake refused on main. A reset the sleep overtook
    answers AsleepError (a 409) and changes nothing of what the sleep did."""

    def __init__(self) -> None:
        super().__init__()
        cfg = tiny_config(workers=1, device_blocks=10, host_blocks=10, storage="file",
                          storage_dir=_storage_config().storage.path, extra={
                              "KVTIER_STORAGE__PREFETCH_POLICY": "wait_complete",
                              "KVTIER_STORAGE__PREFETCH_THRESHOLD": str(BS),
                              "KVTIER_STORAGE__PREFETCH_HOST_BLOCKS_LIMIT": "8"})
        self.cfg = cfg
        self.tier = StorageTier(self.m, cfg)
        self.m.storage = self.tier
        self.sleep_in_wait = False
        self.sleep_in_drain = False
        drain = self.dispatcher.drain

        def drain_then_maybe_sleep(timeout: float) -> bool:
            if self.sleep_in_drain:  # the sleep lands while a reset waits for transfers
                self.sleep_in_drain = False
                SLEEP_REACHED["sleep_in_reset"] += 1
                self.m.sleep()
            return drain(timeout)

        self.dispatcher.drain = drain_then_maybe_sleep  # type: ignore[method-assign]

    def _resolve(self, task):  # type: ignore[no-untyped-def]
        if self.sleep_in_wait and task.kind in (TaskKind.QUERY, TaskKind.PREFETCH):
            self.sleep_in_wait = False  # a match waits for storage, lock released: sleep
            SLEEP_REACHED["sleep_in_match_wait"] += 1
            self.m.sleep()
        if task.kind == TaskKind.PREFETCH:
            return True, self.model.leading_stored(list(task.keys))
        return super()._resolve(task)

    def _wake_up(self) -> None:
        """What Stack.wake does after a sleep: every rank cancels what it holds (answered
        failed), nothing may be left in flight, the pools come back empty."""
        assert self.m.asleep
        for rid in list(self.reqs):
            self.release_rid(rid)  # a no-op for a request the sleep cancelled
        while self.dispatcher.tasks:
            for seq in sorted(self.dispatcher.tasks):
                self.dispatcher.complete(seq, False)
        assert self.m.settled(), (
            f"asleep with {len(self.m._inflight)} task(s) and {len(self.m._written_off)} "
            "written-off node(s) that no answer will ever settle: every wake is refused")
        for contents in (self.model.device, self.model.host):
            for k in contents:
                contents[k] = GARBAGE
        self.m.rebuild(self.device_blocks, self.host_blocks)
        self.tier.resize(self.cfg)
        self.m.wake()
        self.pins.clear()
        SLEEP_REACHED["wakes"] += 1

    @rule(tokens=tokens_st)
    def match(self, tokens: tuple[int, ...]) -> None:
        try:
            super().match(tokens)
        except RequestCancelledError:
            assert self.m.asleep
            self._wake_up()
            super().match(tokens)  # the engine runs it again after the wake

    @rule(roll=st.integers(0, 2))
    def arm_sleep_in_match_wait(self, roll: int) -> None:
        """The next match that waits for storage is overtaken by a sleep."""
        self.sleep_in_wait = roll == 0

    @rule(settle_first=st.booleans())
    def reset_racing_sleep(self, settle_first: bool) -> None:
        """A sleep lands while a reset waits for transfers (all answered, or some pending)."""
        if settle_first:
            self.drain()
        self.sleep_in_drain = True
        resets = self.m.counters.resets
        with pytest.raises((AsleepError, ResetBusyError)) as e:
            self.m.reset(timeout=0.01)
        assert isinstance(e.value, AsleepError) or self.dispatcher.tasks, e.value
        assert self.m.asleep and self.m.tree_status == TREE_CLEARING, self.m.tree_status
        assert self.m.counters.resets == resets
        with pytest.raises(AsleepError):
            self.m.reset(timeout=0.01)  # asleep: refused at once
        self._wake_up()

    @rule(roll=st.integers(0, 3))
    def sleep_with_transfers_pending(self, roll: int) -> None:
        if roll:
            return
        SLEEP_REACHED["sleep_plain"] += 1
        self.m.sleep()
        self._wake_up()


TestSleepRaces = SleepMachine.TestCase
TestSleepRaces.settings = settings(SETTINGS, max_examples=60)


def test_sleep_runs_reached_every_race() -> None:
    """The sleep machine must have slept inside a match's storage wait and inside a reset's
    wait for transfers, and woken after each."""
    missing = [k for k, v in SLEEP_REACHED.items() if v == 0]
    assert not missing, f"never reached: {missing} ({SLEEP_REACHED})"
