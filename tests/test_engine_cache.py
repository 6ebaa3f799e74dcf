"""The embedded home of the engine contract (`kvtier.engine.embedded_cache.EmbeddedCache`)
over a real keyed stack (one worker process, its host pool in shared memory): the contract's
life cycle byte for byte through the host pool, and an engine reset whose open copies are
held for two scheduler steps, never served, then freed."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from kvtier.engine.cache_api import EngineCache, Lookup
from kvtier.engine.embedded_cache import ABANDON_STEPS, EmbeddedCache
from kvtier.manager.stack import Stack
from kvtier.worker.kv_pools import HostPool, KVShape
from support import remove_leftovers, tiny_config

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
        ids = cache.prepare_load(KEYS)
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
