"""The embedded home of the engine contract (`kvtier.engine.embedded_cache.EmbeddedCache`)
over a real keyed stack (one worker process, its host pool in shared memory): the contract's
life cycle byte for byte through the host pool, an engine reset whose open copies are
held for two scheduler steps, never served, then freed, and plans that carry the pools they
were made against: a store and a load planned before a worker (and its pool) was replaced are
refused at copy time, never copied into the new pool (issue 34)."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from kvtier.engine.cache_api import EngineCache, Lookup, PlannedStore
from kvtier.engine.embedded_cache import ABANDON_STEPS, EmbeddedCache
from kvtier.engine.host_copier import HostCopier
from kvtier.manager.stack import Stack
from kvtier.worker.kv_pools import HostPool, KVShape
from stack_support import kv_shape, worker_pids
from support import remove_leftovers, tiny_config, wait_until

pytestmark = pytest.mark.fast

KEYS = [hashlib.sha256(b"embedded-%d" % i).digest() for i in range(6)]


@pytest.fixture
def cache() -> Iterator[EmbeddedCache]:
    cfg = tiny_config(workers=1, host_blocks=16)
    c = EmbeddedCache(Stack(cfg, keyed_namespace=b"embedded-test").start())
    try:
        yield c
    finally:
        c.close()
        remove_leftovers(cfg.deployment_id)


def test_embedded_cache_serves_what_was_stored(cache: EmbeddedCache) -> None:
    assert isinstance(cache, EngineCache)
    pools = cache.host_pools()
    assert pools is not None and pools.generation == cache.generation
    seg = pools.segments[0]
    pool = HostPool.attach(seg.name, KVShape(2, 2, 8, 4, "float16"))
    try:
        assert pool.inode == seg.inode and seg.num_blocks == 16
        assert cache.lookup(KEYS[0], "r", KEYS[1:]) is Lookup.MISS
        plan = cache.prepare_store(KEYS)
        assert plan is not None and plan.keys == KEYS
        for i, hid in enumerate(plan.host_ids):
            pool.data[hid].fill_(i + 1)
        assert cache.lookup(KEYS[0]) is Lookup.PENDING  # being written: never served
        cache.complete_store(KEYS)
        assert [cache.lookup(k) for k in KEYS] == [Lookup.HIT] * len(KEYS)
        load = cache.prepare_load(KEYS)
        assert load.pools == plan.pools == pools and load.from_storage == [False] * len(KEYS)
        ids = load.host_ids
        assert [int(pool.data[h][0]) for h in ids] == list(range(1, len(KEYS) + 1))
        cache.complete_load(KEYS)
        cache.end_step()
        cache.cache.check_invariants()
    finally:
        pool.close()


def test_an_engine_reset_holds_open_copies_two_steps_then_frees_them(
        cache: EmbeddedCache) -> None:
    m = cache.cache.m
    plan = cache.prepare_store(KEYS[:3])
    assert plan is not None
    cache.reset()
    assert [cache.lookup(k) for k in KEYS[:3]] == [Lookup.MISS] * 3  # never served
    held = m.host_capacity - m.host_free
    assert held == 3  # a deferred copy may still land in them
    for _ in range(ABANDON_STEPS - 1):
        cache.end_step()
        assert m.host_capacity - m.host_free == 3
    cache.end_step()
    assert m.host_free == m.host_capacity
    cache.complete_store(KEYS[:3])  # the engine's late completion changes nothing
    assert cache.lookup(KEYS[0]) is Lookup.MISS
    cache.cache.check_invariants()


def _copy(copier: HostCopier, job: int, dev: list[int], host: list[int],
          segment: tuple[str, int], *, store: bool) -> bool:
    return copier.copy(job, np.asarray(dev, dtype=np.int64), np.asarray(host, dtype=np.int64),
                       [len(dev)], *segment, store=store)


@pytest.mark.timeout(120)
def test_a_plan_made_before_the_pools_were_replaced_is_refused_at_copy_time(
        cache: EmbeddedCache) -> None:
    """A store and a load are planned, then the worker dies and a new one makes a new pool
    under the same name. Each copy goes against its plan's pools (as vLLM's worker does with
    the adapter's spec): the old plans' copies are refused, the new pool is not touched, the
    late completion serves nothing; a plan made now carries the new pools and copies."""
    shape = kv_shape(cache.stack.cfg)
    g = torch.Generator().manual_seed(3)
    kv = [torch.randint(0, 256, (8, shape.layer_bytes), dtype=torch.uint8, generator=g)
          for _ in range(shape.num_layers)]
    copier = HostCopier([kv], shape)
    try:
        # two blocks stored and servable, then a load of them and a store of two more planned
        first = cache.prepare_store(KEYS[:2])
        assert isinstance(first, PlannedStore) and first.keys == KEYS[:2]
        seg0 = first.pools.names()[0]
        assert _copy(copier, 1, [0, 1], first.host_ids, seg0, store=True)
        cache.complete_store(first.keys)
        load = cache.prepare_load(KEYS[:2])
        store = cache.prepare_store(KEYS[2:4])
        assert store is not None and load.pools == store.pools == first.pools

        old_pid = worker_pids(cache.stack)[0]
        os.kill(old_pid, signal.SIGKILL)
        new = wait_until(lambda: (p := cache.host_pools()) is not None
                         and p.generation != first.pools.generation and p, 60,
                         "the replaced worker's new pool")
        assert new.names()[0][0] == seg0[0] and new.names()[0][1] != seg0[1], (new, seg0)
        pool = HostPool.attach(new.segments[0].name, shape)
        try:
            before = pool.data.clone()
            # the old plans' copies: refused, nothing written into the new pool
            assert not _copy(copier, 2, [4, 5], store.host_ids, store.pools.names()[0],
                             store=True)
            assert not _copy(copier, 3, [6, 7], load.host_ids, load.pools.names()[0],
                             store=False)
            assert torch.equal(pool.data, before)
            cache.complete_store(store.keys)  # late: changes nothing
            cache.complete_load(KEYS[:2])
            assert [cache.lookup(k) for k in KEYS[:4]] == [Lookup.MISS] * 4
            # a plan made now names the new pool: stored and loaded back byte for byte
            again = cache.prepare_store(KEYS[2:4])
            assert again is not None and again.pools == new and again.keys == KEYS[2:4]
            assert _copy(copier, 4, [4, 5], again.host_ids, new.names()[0], store=True)
            cache.complete_store(again.keys)
            back = cache.prepare_load(KEYS[2:4])
            assert back.pools == new
            for t in kv:
                t[6:8] = 0
            assert _copy(copier, 5, [6, 7], back.host_ids, new.names()[0], store=False)
            cache.complete_load(KEYS[2:4])
            assert all(torch.equal(t[6:8], t[4:6]) for t in kv)
        finally:
            pool.close()
        cache.end_step()
        cache.cache.check_invariants()
    finally:
        copier.close()
