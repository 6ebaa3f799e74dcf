"""Workers as real processes: KV bytes across real shared memory and POSIX queues, worker
deaths, and the parent's death.

Every test runs a real Stack (manager in this process, one worker process per rank, host
pools in /dev/shm) and verifies bytes, never metadata alone: FILL writes content derived
from each block's key on every rank, CHECK compares every byte of K and V of every layer, and
host pages are read from this process through the workers' own segments.

Stacks are expensive (each worker imports torch), so the tests that leave a stack usable
share one per class; each starts from `stack.reset()`. `running_stack` asserts on exit that
the deployment left no segment, semaphore, queue or worker process behind.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize, invariant, rule, run_state_machine_as_test
from kvtier.manager.config import KvtierConfig
from kvtier.manager.core.nodes import EVICTING, LOADING, PREFETCHING, SAVING
from kvtier.manager.errors import TransferFailedError, TransferTimeoutError
from kvtier.manager.stack import Stack
from kvtier.worker import content
from kvtier.worker.copy_engine import LAYER_DELAY_ENV
from kvtier.worker.delays import BACKUP_DELAY_ENV, STORAGE_WRITE_DELAY_ENV
from kvtier.worker.ipc import MESSAGE_SIZE, QUEUE_DEPTH, pid_alive
from kvtier.worker.kv_pools import DevicePool, HostPool
from kvtier.worker.wire import Priority, Task, TaskKind
from stack_support import (
    attached_host_pools,
    check,
    fill,
    kv_shape,
    running_stack,
    submit,
)
from support import (
    clean_env,
    leftovers,
    new_deployment_id,
    remove_leftovers,
    tiny_config,
    wait_nothing_left,
    wait_until,
)
from test_manager_stateful import BS, PREFIXES, ManagerMachine

pytestmark = [pytest.mark.fast, pytest.mark.slow]  # real Stacks: worker processes that import torch

TESTS_DIR = Path(__file__).resolve().parent
_tokens = itertools.count(1)


def fresh_tokens(n: int) -> list[int]:
    """`n` token ids no other prompt of this run shares (so no accidental prefix hits)."""
    base = next(_tokens) * 1_000_000
    return list(range(base, base + n))


def assert_host_pages_hold(pools: list[HostPool], cfg: KvtierConfig, host_ids: list[int],
                           keys: list[int]) -> None:
    """Host page `host_ids[i]` of every rank holds the content of `keys[i]` for that rank,
    byte for byte, compared two ways: `content.check` on the segment, and equality with a
    block filled in this process by `content.fill` on a private device pool (so a layout or
    content bug shared by both sides of the workers does not cancel out)."""
    shape = kv_shape(cfg)
    kb = [k.to_bytes(16, "little") for k in keys]
    local = DevicePool(shape, len(keys), "cpu")
    for rank, pool in enumerate(pools):
        assert content.check(pool, host_ids, kb, rank) == [], f"rank {rank} host pages differ"
        other = (rank + 1) % len(pools)
        assert content.check(pool, host_ids, kb, other) == list(range(len(keys))), (
            f"rank {rank} holds rank {other}'s content: the check cannot tell ranks apart")
        content.fill(local, list(range(len(keys))), kb, rank)
        for i, h in enumerate(host_ids):
            want = local.data[:, :, i].contiguous().view(torch.int16)
            got = pool.kv[h].view(torch.int16)
            assert torch.equal(got, want), f"rank {rank}: host page {h} (block {i}) differs"


# --------------------------------------------------------------------------- state machine


class RealWorkersMachine(ManagerMachine):
    """`ManagerMachine` with the real Stack's manager and workers in place of the content
    model: the model runner's writes are FILL tasks, its reads CHECK tasks, and tasks
    complete on their own (rules that completed or failed model tasks are gone)."""

    stack: Stack
    host_pools: list[HostPool] = []
    totals: dict[str, int] = dict.fromkeys(
        ("steps", "checked_blocks", "hit_host_tokens", "evicted_device_demote"), 0)

    def __init__(self) -> None:
        super().__init__()  # builds a model-backed manager, replaced below
        stack = self.stack
        m = stack.require_manager()
        for rid in list(m._requests):  # left by an example that failed half-way
            m.release(rid)
        stack.reset(timeout=10)
        self.m = m
        self.dispatcher = m.dispatcher  # type: ignore[assignment]
        self.device_blocks = stack.cfg.cache.device_blocks
        self.host_blocks = stack.cfg.cache.host_blocks
        self.counters_at_start = dict(m.stats()["counters"])  # type: ignore[call-overload]

    @initialize()
    def warm_caches(self) -> None:
        """Every example starts from overflowing caches, so a short run still reaches
        demotions and host hits: each prefix computed with a 12-token tail (5 blocks each,
        15 in all for 10 device blocks: the oldest are demoted), then the first prefix
        again, whose blocks now come back from the host."""
        tail = (0, 1, 2) * 4
        for prefix in (*PREFIXES, PREFIXES[0]):
            self.whole_request(prefix + tail, None)

    def loads_done(self, r: dict) -> bool:
        """Real workers complete loads by themselves; read_rid waits for them."""
        return True

    def write_computed(self, blocks: list[int], keys: list[int]) -> None:
        """The model runner writes computed KV: a FILL of the blocks on every rank."""
        fill(self.m, blocks, keys)

    def read_rid(self, rid: str) -> None:
        r = self.reqs[rid]
        try:
            r["handle"].wait(10)
            valid = r["hit"]
        except TransferFailedError as e:
            valid = e.valid_tokens
        r["valid"] = min(r["valid"], valid)
        n = r["valid"] // BS
        if n:
            blocks = self.m.request_blocks(rid)
            bad = check(self.m, blocks[:n], r["keys"][:n])
            assert bad == [], f"{rid}: matched blocks {bad} of {blocks[:n]} hold other bytes"
            self.totals["checked_blocks"] += n

    # Tasks complete by themselves here; these model-only rules are not rules any more.
    def complete(self) -> None:  # type: ignore[override]
        raise AssertionError("not a rule with real workers")

    def fail_next_blocking_wait(self) -> None:
        raise AssertionError("not a rule with real workers")

    def pending_tasks_are_transfers(self) -> None:
        raise AssertionError("not an invariant with real workers")

    def device_lost(self) -> None:  # type: ignore[override]
        raise AssertionError("not a rule here: these workers own their device pools "
                             "(engine KV losses are tested in test_engine_kv)")

    @rule(roll=st.integers(0, 9))
    def reset(self, roll: int) -> None:  # type: ignore[override]
        if roll:
            return
        self.stack.reset(timeout=10)  # waits for the transfers in flight
        assert self.m.stats()["nodes"] == 0
        self.pins.clear()

    @invariant()
    def brief_invariants(self) -> None:  # type: ignore[override]
        self.totals["steps"] += 1
        self.m.check_invariants()

    @invariant()
    def cached_content_belongs_to_key(self) -> None:  # type: ignore[override]
        """Every cached block not being written holds its key's bytes: device blocks on
        every rank (CHECK), host pages on every rank (read from the segments)."""
        # A consistent snapshot: until the next scheduler call nothing writes these blocks
        # (completions only clear flags or free blocks; a queued load writes LOADING ones).
        with self.m._lock:
            dev = [(n.dev, n.key) for n in self.m._map.values()
                   if n.dev is not None and not n.flags & LOADING]
            host = [(n.host, n.key) for n in self.m._map.values()
                    if n.host is not None and not n.flags & (SAVING | EVICTING | PREFETCHING)]
        if dev:
            ids, keys = zip(*dev, strict=True)
            bad = check(self.m, ids, keys)
            assert bad == [], f"cached device blocks {[dev[i] for i in bad]} hold other bytes"
        if host:
            ids, keys = zip(*host, strict=True)
            kb = [k.to_bytes(16, "little") for k in keys]
            for rank, pool in enumerate(self.host_pools):
                bad = content.check(pool, list(ids), kb, rank)
                assert bad == [], f"rank {rank}: host pages {[host[i] for i in bad]} differ"

    def teardown(self) -> None:
        m = self.m
        assert m.dispatcher.drain(10), "transfers still in flight 10 s after the last step"
        for rid in list(self.reqs):
            m.release(rid)
        m.check_invariants()
        s = m.stats()
        assert s["device"]["owned_by_requests"] == 0, "blocks leaked to finished requests"
        c = s["counters"]
        for k in ("hit_host_tokens", "evicted_device_demote"):
            self.totals[k] += c[k] - self.counters_at_start[k]  # type: ignore[index]
        assert c["failed_tasks"] == self.counters_at_start["failed_tasks"]  # type: ignore[index]
        self.stack.reset(timeout=10)
        s = m.stats()
        assert s["device"]["free"] == self.device_blocks
        assert s["host"]["free"] == self.host_blocks


REAL_SETTINGS = settings(max_examples=5, stateful_step_count=25, deadline=None,
                         suppress_health_check=list(HealthCheck))


# --------------------------------------------------------------------------- shared stack:
# 2 workers, 3 layers, 10 device and 10 host blocks, write_back (eviction demotes to host)


@pytest.fixture(scope="class")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg = tiny_config(num_layers=3, device_blocks=10, host_blocks=10, write_policy="write_back")
    with running_stack(cfg, log_dir=tmp_path_factory.mktemp("small-logs")) as stack:
        yield stack


@pytest.mark.timeout(120)
class TestSharedStack:
    def test_round_trip_device_host_device_is_byte_identical(self, small: Stack) -> None:
        """Blocks written on device, demoted to host under pressure, loaded back into other
        device ids: identical on every rank and every layer, in both pools."""
        stack = small
        stack.reset()
        m = stack.manager
        assert m is not None
        cfg = stack.cfg
        ta, tb, tc = fresh_tokens(16), fresh_tokens(24), fresh_tokens(16)

        # A computes 4 blocks and leaves them cached on the device.
        assert m.match("A", ta).num_tokens == 0
        orig = m.allocate("A", 16, 0)
        keys_a = m.request_keys("A")
        assert len(orig) == 4 and len(keys_a) == 4
        fill(m, orig, keys_a)
        assert m.commit("A", ta, 16) == 4
        m.release("A")
        # B takes the 6 free blocks and stays active; C needs 4 more: A's blocks are
        # demoted (D2H) and C gets exactly A's old device ids, which it overwrites.
        m.match("B", tb)
        b_blocks = m.allocate("B", 24, 0)
        m.match("C", tc)
        c_blocks = m.allocate("C", 16, 0)
        assert sorted(c_blocks) == sorted(orig), "C should have received A's demoted blocks"
        keys_c = m.request_keys("C")
        fill(m, c_blocks, keys_c)
        nodes = [m._map[k] for k in keys_a]
        assert all(n.dev is None and n.host is not None for n in nodes), nodes
        host_ids = [n.host for n in nodes]  # type: ignore[misc]
        with attached_host_pools(cfg) as pools:
            assert_host_pages_hold(pools, cfg, host_ids, keys_a)  # type: ignore[arg-type]

        # B leaves: A's prefix matches from the host and loads into B's old ids, which
        # cannot be A's original ones (C holds those).
        m.release("B")
        res = m.match("A2", [*ta, 7])
        assert (res.device_tokens, res.host_tokens) == (0, 16)
        res.handle.wait(10)
        assert set(res.block_ids) <= set(b_blocks) and not set(res.block_ids) & set(orig)
        assert check(m, res.block_ids, keys_a) == []
        assert check(m, c_blocks, keys_c) == [], "the load overwrote another request's blocks"
        # A CHECK can fail: A's content is not in C's blocks.
        assert check(m, res.block_ids, keys_c) == [0, 1, 2, 3]

        m.release("A2")
        m.release("C")
        m.check_invariants()
        st = m.stats()
        assert st["counters"]["evicted_device_demote"] >= 4
        assert st["counters"]["failed_tasks"] == 0

    def test_manager_state_machine_on_real_workers(self, small: Stack) -> None:
        """The manager-core state machine, driven against the real workers: bytes are
        written by FILL when the machine computes blocks and compared by CHECK when it
        reads a matched prefix; cached device and host blocks are verified after every
        step (device through CHECK, host by reading the segments)."""
        RealWorkersMachine.stack = small
        RealWorkersMachine.totals = dict.fromkeys(RealWorkersMachine.totals, 0)
        with attached_host_pools(small.cfg) as pools:
            RealWorkersMachine.host_pools = pools
            try:
                run_state_machine_as_test(RealWorkersMachine, settings=REAL_SETTINGS)
            finally:
                RealWorkersMachine.host_pools = []
        totals = RealWorkersMachine.totals
        # The warm-up alone demotes blocks and serves host hits in every example.
        assert totals["steps"] >= REAL_SETTINGS.max_examples * 5, totals
        assert totals["checked_blocks"] > 0, totals
        assert totals["hit_host_tokens"] > 0 and totals["evicted_device_demote"] > 0, totals


# --------------------------------------------------------------------------- slow loads:
# 2 workers, 4 layers, 10,000 device and host blocks, write_through; every H2D layer takes
# DELAY_S longer (the workers' test hook), so a load is observable half-way.

DELAY_S = 0.2
_rids = itertools.count()


def _rid(prefix: str) -> str:
    return f"{prefix}{next(_rids)}"


@pytest.fixture(scope="class")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    old = os.environ.get(LAYER_DELAY_ENV)
    os.environ[LAYER_DELAY_ENV] = str(DELAY_S * 1000)  # replacements started later too
    try:
        cfg = tiny_config(num_layers=4, device_blocks=10_000, host_blocks=10_000,
                          write_policy="write_through")
        with running_stack(cfg, log_dir=tmp_path_factory.mktemp("slow-logs")) as stack:
            yield stack
    finally:
        if old is None:
            os.environ.pop(LAYER_DELAY_ENV, None)
        else:
            os.environ[LAYER_DELAY_ENV] = old


def evict_device(stack: Stack, *, overwrite: bool = False) -> list[int]:
    """One request takes every device block (evicting all cached ones: write_through drops
    them, their host copies stay) and leaves. With `overwrite` it first fills them with its
    own content, so whatever is later read there must have been loaded. Returns its ids."""
    m = stack.require_manager()
    n = stack.cfg.cache.device_blocks * stack.cfg.cache.block_size
    rid = _rid("evict")
    m.match(rid, fresh_tokens(n))
    ids = m.allocate(rid, n, 0)
    if overwrite:
        fill(m, ids, m.request_keys(rid))
    m.release(rid)
    return ids


def cache_on_host_only(stack: Stack, tokens: list[int]) -> list[int]:
    """Compute `tokens` (FILL), commit (write_through backs the blocks up to the host),
    release, then evict the device: the prefix is cached on the host only. Returns the keys
    of its full blocks."""
    m = stack.require_manager()
    bs = stack.cfg.cache.block_size
    rid = _rid("compute")
    m.match(rid, tokens)
    m.allocate(rid, len(tokens), 0)
    n = len(tokens) // bs
    keys = m.request_keys(rid)[:n]
    fill(m, m.request_blocks(rid)[:n], keys)
    m.commit(rid, tokens, len(tokens))
    m.release(rid)
    assert m.dispatcher.drain(20), "backups did not finish"
    evict_device(stack)
    nodes = [m._map[k] for k in keys]
    assert all(x.dev is None and x.host is not None for x in nodes), nodes
    return keys


def wait_replaced(stack: Stack, rank: int, old_pid: int, restarts: int) -> dict:
    """Wait (bounded) until `rank` runs a new, ready worker that counts one more restart."""
    def replaced() -> dict | None:
        w = stack.status()["workers"][rank]
        ok = w["pid"] != old_pid and w["state"] == "ready" and w["restarts"] == restarts + 1
        return w if ok else None

    w = wait_until(replaced, 60, f"rank {rank} (pid {old_pid}) replaced by a ready worker")
    assert not pid_alive(old_pid), f"killed worker {old_pid} still runs"
    assert stack.ready()[0], stack.ready()
    return w  # type: ignore[return-value]


@pytest.mark.timeout(150)
class TestSlowLoads:
    def test_task_of_10000_block_ids_under_default_mqueue_limits(self, slow: Stack) -> None:
        """FILL, D2H, H2D and CHECK tasks of 10,000 block ids each complete on both ranks,
        through queues no larger than the kernel's default limits allow."""
        stack = slow
        stack.reset()
        m = stack.require_manager()
        cfg = stack.cfg
        n = cfg.cache.device_blocks
        assert n == 10_000
        mq = Path("/proc/sys/fs/mqueue")
        assert int((mq / "msg_max").read_text()) >= QUEUE_DEPTH
        assert int((mq / "msgsize_max").read_text()) >= MESSAGE_SIZE
        assert stack.supervisor is not None
        ipc = stack.supervisor.ipc
        via_arena = ipc.stats()["tasks_via_arena"]
        bs = cfg.cache.block_size
        tokens = fresh_tokens(n * bs)
        m.match("big", tokens)
        ids = m.allocate("big", n * bs, 0)
        keys = m.request_keys("big")
        assert len(ids) == len(keys) == n
        fill(m, ids, keys)  # one FILL of 10,000 ids
        m.commit("big", tokens, n * bs)  # write_through: one D2H of 10,000 ids
        m.release("big")
        assert m.dispatcher.drain(30)
        host_ids = [m._map[k].host for k in keys]
        kb = [k.to_bytes(16, "little") for k in keys]
        with attached_host_pools(cfg) as pools:
            for rank, pool in enumerate(pools):
                assert content.check(pool, host_ids, kb, rank) == [], f"rank {rank} host"
        evict_device(stack, overwrite=True)  # 10,000 more ids filled with other content
        res = m.match("big2", [*tokens, 1])
        assert res.host_tokens == n * bs and len(res.block_ids) == n
        res.handle.wait(30)  # one H2D of 10,000 ids
        assert check(m, res.block_ids, keys) == []  # one CHECK of 10,000 ids
        m.release("big2")
        kinds = {kind for kind, blocks, _ in stack.supervisor.dispatcher.transfer_seconds
                 if blocks == n}
        assert kinds >= {TaskKind.FILL, TaskKind.D2H, TaskKind.H2D, TaskKind.CHECK}, kinds
        assert ipc.stats()["tasks_via_arena"] - via_arena >= 5
        assert m.stats()["counters"]["failed_tasks"] == 0

    def test_layer_0_waiter_released_before_the_last_layer(self, slow: Stack) -> None:
        """A load from the host publishes each layer as it lands: waiting on layer 0 (and 1)
        returns while the later layers are still being copied, and the loaded blocks are
        then exact on every rank."""
        stack = slow
        stack.reset()
        m = stack.require_manager()
        tokens = fresh_tokens(32)
        keys = cache_on_host_only(stack, tokens)
        t0 = time.monotonic()
        res = m.match("layers", [*tokens, 1])
        assert res.host_tokens == 32
        h = res.handle
        h.wait_layer(0, timeout=10)
        t1 = time.monotonic()
        assert not h.done, "layer 0 released only when the whole load was done"
        assert t1 - t0 < 4 * DELAY_S, f"layer 0 took {t1 - t0:.3f} s"
        h.wait_layer(1, timeout=10)
        assert not h.done
        h.wait(10)
        t2 = time.monotonic()
        # Layers 1-3 land DELAY_S apart after layer 0 (and the task ends DELAY_S later).
        assert t2 - t1 >= 3 * DELAY_S * 0.9, f"load ended {t2 - t1:.3f} s after layer 0"
        assert check(m, res.block_ids, keys) == []
        m.release("layers")

    def test_layer_wait_fails_fast_when_a_worker_dies_mid_load(self, slow: Stack) -> None:
        """SIGKILL to one rank half-way through a load: a waiter on the last layer gets an
        error within seconds (never hangs), the whole match counts as invalid, and the rank
        is replaced."""
        stack = slow
        stack.reset()
        m = stack.require_manager()
        tokens = fresh_tokens(32)
        cache_on_host_only(stack, tokens)
        victim = stack.status()["workers"][1]
        res = m.match("dies", [*tokens, 1])
        h = res.handle
        h.wait_layer(0, timeout=10)
        assert not h.done
        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises((TransferFailedError, TransferTimeoutError)) as err:
            h.wait_layer(3, timeout=10)
        took = time.monotonic() - t0
        assert took < 5, f"the layer wait took {took:.1f} s to give up"
        assert "load failed" in str(err.value) or "not complete" in str(err.value), err.value
        with pytest.raises(TransferFailedError) as failed:
            h.wait(10)
        assert failed.value.valid_tokens == 0
        m.release("dies")
        wait_replaced(stack, 1, victim["pid"], victim["restarts"])
        m.check_invariants()

    def test_kill_9_worker_mid_task(self, slow: Stack) -> None:
        """The tasks in flight fail, the rank is replaced, the manager's books balance
        once the requests leave, and the replacement serves loads byte-exactly."""
        stack = slow
        stack.reset()
        m = stack.require_manager()
        cfg = stack.cfg
        counters = dict(m.stats()["counters"])  # type: ignore[call-overload]
        tokens = fresh_tokens(32)
        cache_on_host_only(stack, tokens)
        own_tokens = fresh_tokens(20)
        m.match("own", own_tokens)
        own = m.allocate("own", 20, 0)
        own_keys = m.request_keys("own")
        fill(m, own, own_keys)
        res = m.match("load", [*tokens, 1])
        res.handle.wait_layer(0, timeout=10)
        # Queued behind the load on every rank, so it is in flight when the worker dies.
        seq, outcome = submit(m, TaskKind.CHECK, own, own_keys)
        victim = stack.status()["workers"][0]
        os.kill(victim["pid"], signal.SIGKILL)
        with pytest.raises(TransferFailedError):
            res.handle.wait(10)
        m.dispatcher.wait([seq], 10)
        assert len(outcome) == 1 and not outcome[0].ok and outcome[0].error, outcome
        wait_replaced(stack, 0, victim["pid"], victim["restarts"])
        m.check_invariants()
        after = m.stats()["counters"]
        assert after["lost_all"] == counters["lost_all"] + 1  # type: ignore[index]
        assert after["failed_tasks"] >= counters["failed_tasks"] + 2  # type: ignore[index]

        m.release("load")
        m.release("own")
        assert m.dispatcher.drain(20)
        m.check_invariants()
        st = m.stats()
        assert st["device"]["free"] == cfg.cache.device_blocks, st["device"]
        assert st["host"]["free"] == cfg.cache.host_blocks, st["host"]
        assert st["nodes"] == 0 and st["requests_active"] == 0

        # The replacement has fresh pools and serves a full round trip.
        tokens = fresh_tokens(16)
        keys = cache_on_host_only(stack, tokens)
        res = m.match("after", [*tokens, 1])
        assert res.host_tokens == 16
        res.handle.wait(10)
        assert check(m, res.block_ids, keys) == []
        m.release("after")

    def test_blocks_of_a_written_off_load_are_not_reused_while_a_rank_still_loads_them(
            self, slow: Stack) -> None:
        """A rank dies while a load is queued on the others; the scheduler drops the request
        without waiting for its handle; its blocks go to a new request, which writes them.
        The surviving rank's load must not land on top of the new request's KV. Transfers
        are paused while this is set up, so the order on the surviving rank is certain:
        the new request's write, queued later but of higher priority, runs first."""
        stack = slow
        stack.reset()
        m = stack.require_manager()
        tokens = fresh_tokens(16)
        cache_on_host_only(stack, tokens)
        lost = m.stats()["counters"]["lost_all"]  # type: ignore[index]
        stack.pause()
        try:
            res = m.match("stale", [*tokens, 1])
            assert res.host_tokens == 16
            victim = stack.status()["workers"][1]
            os.kill(victim["pid"], signal.SIGKILL)
            wait_until(lambda: m.stats()["counters"]["lost_all"] > lost,  # type: ignore[index]
                       10, "the manager learns that rank 1 is lost")
            m.release("stale")
            m.match("reuse", fresh_tokens(16))
            ids = m.allocate("reuse", 16, 0)  # today: exactly the blocks "stale" loads into
            keys = m.request_keys("reuse")
            seq, outcome = submit(m, TaskKind.FILL, ids, keys)
        finally:
            stack.resume()
        m.dispatcher.wait([seq], 60)  # rank 1's part runs on its replacement
        assert outcome and outcome[0].ok, outcome
        wait_replaced(stack, 1, victim["pid"], victim["restarts"])
        assert m.dispatcher.drain(10)
        bad = check(m, ids, keys)
        m.release("reuse")
        m.check_invariants()
        assert bad == [], f"blocks {[ids[i] for i in bad]} of the new request were overwritten"


# --------------------------------------------------------------------------- parent death

DRIVER = """
import json, signal, sys, time
sys.path.insert(0, sys.argv[3])
from support import tiny_config
from kvtier.manager.stack import Stack

stack = Stack(tiny_config(deployment_id=sys.argv[1], device_blocks=8, host_blocks=8),
              log_dir=sys.argv[4]).start()
if sys.argv[2] == "handler":
    def stop(signum, frame):
        stack.close()
        print(json.dumps([w.proc.returncode for w in stack.supervisor.workers]), flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
print(json.dumps([w.proc.pid for w in stack.supervisor.workers]), flush=True)
while True:
    time.sleep(0.1)
"""


@contextlib.contextmanager
def driver(deployment_id: str, mode: str, tmp: Path,
           ) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str], list[int]]]:
    """A separate manager process (a plain script running a Stack, mode "handler": with a
    SIGTERM handler that closes it) in a session of its own; yields it, the queue of its
    stdout lines and its workers' pids. Whatever a failed test left running of it is
    killed on exit, and the deployment's names removed."""
    env = clean_env()
    err_path = tmp / "driver.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", DRIVER, deployment_id, mode, str(TESTS_DIR), str(tmp)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    pids: list[int] = []
    try:
        try:
            pids = json.loads(lines.get(timeout=90))
        except queue.Empty:
            raise AssertionError(f"the driver printed no worker pids; stderr:\n"
                                 f"{err_path.read_text()[-3000:]}") from None
        assert len(pids) == 2 and all(pid_alive(p) for p in pids), pids
        yield proc, lines, pids
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for p in pids:
            if pid_alive(p):
                os.kill(p, signal.SIGKILL)
        if any(pid_alive(p) for p in pids):
            time.sleep(0.5)
        remove_leftovers(deployment_id)


def assert_stack_works(cfg: KvtierConfig, tmp: Path) -> None:
    """A Stack of `cfg` starts, runs a FILL and a CHECK, and leaves nothing when closed."""
    with running_stack(cfg, log_dir=tmp / "again") as stack:
        m = stack.require_manager()
        keys = list(range(1, 5))
        fill(m, [0, 1, 2, 3], keys)
        assert check(m, [0, 1, 2, 3], keys) == []


@pytest.mark.timeout(120)
def test_sigterm_to_a_parent_that_handles_it_leaves_nothing(tmp_path: Path) -> None:
    """SIGTERM to a manager whose handler closes its Stack: it exits 0, its workers exit
    cleanly, and within seconds no process, segment or queue of the deployment is left."""
    dep = new_deployment_id()
    with driver(dep, "handler", tmp_path) as (proc, lines, pids):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert json.loads(lines.get(timeout=5)) == [0, 0], "workers did not exit cleanly"
        wait_nothing_left(dep, 2, pids, timeout=10)


@pytest.mark.timeout(120)
def test_killed_parent_leaves_no_orphan_and_its_id_starts_again(tmp_path: Path) -> None:
    """SIGKILL to the manager: a worker notices on its own, exits within seconds and
    removes the deployment's names. A worker that dies with the manager cannot clean up
    (frozen here, then killed): its host segment stays behind, and a new Stack with the same
    id removes it, runs, and leaves nothing."""
    dep = new_deployment_id()
    with driver(dep, "plain", tmp_path) as (proc, _, (orphan, frozen)):
        os.kill(frozen, signal.SIGSTOP)
        proc.kill()
        proc.wait(timeout=10)
        t0 = time.monotonic()
        wait_until(lambda: not pid_alive(orphan), 10,
                   f"orphaned worker {orphan} exits by itself")
        took = time.monotonic() - t0
        os.kill(frozen, signal.SIGKILL)
        wait_until(lambda: not pid_alive(frozen), 10, "frozen worker killed")
        stale = leftovers(dep, 2)
        assert stale == [f"/dev/shm/kvtier_{dep}_host_r1"], (
            f"the orphan (gone after {took:.1f} s) should have removed every name but the "
            f"frozen worker's host segment: {stale}")
        assert_stack_works(tiny_config(deployment_id=dep), tmp_path)


# --------------------------------------------------------------------------- lanes: a load
# never waits behind a backup, a storage query never behind a storage write

LANE_DELAY_S = 2.0  # every D2H batch and every storage write waits this long first


@pytest.mark.timeout(120)
def test_a_load_and_a_query_never_wait_behind_backups(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A D2H backup and a storage BACKUP write, each held LANE_DELAY_S in the worker (the
    test hooks), then, while they run, an H2D load and a storage QUERY: both answer long
    before either backup does (each class of task has its own lane; with one task loop per
    rank they waited for the backups to finish), and every byte lands where it should."""
    monkeypatch.setenv(BACKUP_DELAY_ENV, str(int(LANE_DELAY_S * 1000)))
    monkeypatch.setenv(STORAGE_WRITE_DELAY_ENV, str(int(LANE_DELAY_S * 1000)))
    cfg = tiny_config(num_layers=2, device_blocks=64, host_blocks=64,
                      write_policy="write_through", storage="file",
                      storage_dir=tmp_path / "storage")
    with running_stack(cfg, log_dir=tmp_path / "logs") as stack:
        m = stack.require_manager()
        d = m.dispatcher
        keys = list(range(1001, 1033))
        fill(m, list(range(32)), keys)  # device blocks 0..31
        with m.lock:
            seqs = [m.next_seq() for _ in range(5)]
        skeys = [bytes([i]) * 32 for i in range(32)]
        d2h = Task(seqs[0], TaskKind.D2H, list(range(32)), list(range(32)), [], Priority.BACKUP)
        write = Task(seqs[1], TaskKind.BACKUP, [40, 41], [], skeys[:2], Priority.BACKUP)
        load = Task(seqs[2], TaskKind.H2D, [48, 49, 50], [48, 49, 50], [], Priority.LOAD)
        query = Task(seqs[3], TaskKind.QUERY, [], [], skeys[:4], Priority.PREFETCH)
        t0 = time.monotonic()
        d.submit(d2h)
        d.submit(write)
        # The backups are under way (each worker received them at once and is now held in
        # them); the load and the query come after, as a request's would.
        time.sleep(0.3)
        d.submit(load)
        d.submit(query)
        d.wait([load.seq, query.seq], LANE_DELAY_S * 0.6)
        took = time.monotonic() - t0
        assert d.is_pending(d2h.seq) and d.is_pending(write.seq), (
            f"the backups were not held back (took {took:.2f} s): the test proves nothing")
        d.wait([d2h.seq, write.seq], 20)
        assert time.monotonic() - t0 >= LANE_DELAY_S
        # The backup's bytes: loaded back into other device blocks, checked on every rank.
        back = Task(seqs[4], TaskKind.H2D, list(range(32)), list(range(32, 64)), [],
                    Priority.LOAD)
        d.submit(back)
        d.wait([back.seq], 20)
        assert check(m, list(range(32, 64)), keys) == []
        assert m.stats()["counters"]["failed_tasks"] == 0
