"""`kvtier.manager.sessions`: an engine's session over the keyed cache (its open copies, with
it as their owner) and the one abandon-and-release rule (`Graves`: a deadline in engine steps
or in seconds). Over a real keyed stack and its host pool."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
from kvtier.manager.core.nodes import ENGINE_READ
from kvtier.manager.keyed import KeyedHostCache, Lookup, engine_key
from kvtier.manager.sessions import EngineSession, Graves
from kvtier.manager.stack import Stack
from stack_support import running_stack
from support import tiny_config

pytestmark = pytest.mark.fast

HOST_BLOCKS = 8


def keys(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cfg = tiny_config(workers=1, device_blocks=2, host_blocks=HOST_BLOCKS)
    with running_stack(cfg, keyed_namespace=b"sessions") as s:
        yield s


@pytest.fixture
def cache(stack: Stack) -> KeyedHostCache:
    stack.reset()
    return KeyedHostCache(stack.require_manager(), stack.storage, namespace=b"sessions",
                          host_ready=stack.workers_ready)


def test_a_session_ends_only_its_own_copies(cache: KeyedHostCache) -> None:
    a, b = EngineSession(cache, "A"), EngineSession(cache, "B")
    h = keys("own", 2)
    plan = a.prepare_store(h)
    assert plan is not None and plan.keys == h and a.stores == dict.fromkeys(h, 1)
    assert b.prepare_store(h) == plan.__class__([], [], 0)  # being stored, by A
    assert b.complete_store(h) == []  # not B's to complete
    assert cache.complete_store(h, owner="B") is None  # nor through the cache as B
    assert b.abandon(Graves(), seconds=0.0, unpin_loads=True) == (0, 0)
    assert [cache.lookup(x) for x in h] == [Lookup.PENDING] * 2
    assert a.complete_store(h + h) == h  # each prepared store completed once
    assert a.stores == {} and cache.count_hits(h) == 2
    a.prepare_load(h)
    b.prepare_load(h[:1])
    assert b.complete_load(h) == h[:1] and b.loads == {}
    node = cache.m.lookup(engine_key(h[0]))
    assert node is not None and node.flags & ENGINE_READ  # A's load still pins it
    assert a.open_copies() == (0, 2)
    cache.check_invariants()
    a.complete_load(h)
    assert not node.flags & ENGINE_READ
    cache.check_invariants()


def test_abandoned_stores_are_held_for_their_steps_then_released(cache: KeyedHostCache) -> None:
    m = cache.m
    s = EngineSession(cache)
    graves = Graves()
    plan = s.prepare_store(keys("steps", 3))
    assert plan is not None
    loaded = keys("steps-loaded", 1)
    done = s.prepare_store(loaded)
    assert done is not None
    s.complete_store(loaded)
    ids = s.prepare_load(loaded)
    assert s.abandon(graves, steps=2, unpin_loads=False) == (3, 1)
    assert s.stores == {} and s.loads == {} and len(graves) == 1
    held = plan.host_ids + ids
    assert graves.bury() == 0  # a deadline in steps is not one in seconds
    assert graves.step() == 0 and not any(m.host_block_is_free(i) for i in plan.host_ids)
    assert [cache.lookup(x) for x in plan.keys] == [Lookup.PENDING] * 3  # never served
    cache.check_invariants()
    assert graves.step() == len(held) and len(graves) == 0
    assert all(m.host_block_is_free(i) for i in plan.host_ids)
    assert [cache.lookup(x) for x in plan.keys] == [Lookup.MISS] * 3
    node = m.lookup(engine_key(loaded[0]))
    assert node is not None and not node.flags & ENGINE_READ  # the held load ended too
    cache.check_invariants()


def test_a_dead_engines_stores_are_held_for_their_seconds_and_its_loads_unpinned_at_once(
        cache: KeyedHostCache) -> None:
    m = cache.m
    s, other = EngineSession(cache, 1), EngineSession(cache, 2)
    graves = Graves()
    loaded = keys("secs-loaded", 1)
    assert other.prepare_store(loaded) is not None
    other.complete_store(loaded)
    s.prepare_load(loaded)
    plan = s.prepare_store(keys("secs", 2))
    assert plan is not None
    assert s.abandon(graves, seconds=0.3, unpin_loads=True) == (2, 1)
    node = m.lookup(engine_key(loaded[0]))
    assert node is not None and not node.flags & ENGINE_READ  # unpinned now
    assert graves.step() == 0 and graves.bury() == 0  # not due yet
    assert not any(m.host_block_is_free(i) for i in plan.host_ids)
    time.sleep(0.35)
    assert graves.bury() == 2 and len(graves) == 0
    assert all(m.host_block_is_free(i) for i in plan.host_ids)
    cache.check_invariants()


def test_graves_want_one_deadline(cache: KeyedHostCache) -> None:
    g = Graves()
    with pytest.raises(ValueError, match="one of them"):
        g.hold(cache, [], steps=1, seconds=1.0)
    with pytest.raises(ValueError, match="one of them"):
        g.hold(cache, [])
    plan = EngineSession(cache, "x").prepare_store(keys("all", 1))
    assert plan is not None
    nodes = cache.abandon_stores(plan.keys, owner="x")
    g.hold(cache, nodes, seconds=3600.0)
    assert g.bury() == 0 and g.bury(all_=True) == 1
    assert cache.m.host_block_is_free(plan.host_ids[0])


def test_a_sliced_abandon_ends_what_an_unsliced_one_does(cache: KeyedHostCache) -> None:
    """The node service ends a session a slice of keys per hold of the lock (`slice_keys`):
    the same loads unpinned, the same stores abandoned and held, the records empty."""
    m = cache.m
    s, other = EngineSession(cache, 1), EngineSession(cache, 2)
    graves = Graves()
    loaded = keys("sliced-loaded", 3)
    assert other.prepare_store(loaded) is not None
    other.complete_store(loaded)
    s.prepare_load(loaded + loaded[:1])  # one key loaded twice: two pins
    plan = s.prepare_store(keys("sliced", 5))
    assert plan is not None
    assert s.abandon(graves, seconds=0.0, unpin_loads=True, slice_keys=2) == (5, 4)
    assert s.stores == {} and s.loads == {} and len(graves) == 1
    for k in loaded:
        node = m.lookup(engine_key(k))
        assert node is not None and not node.flags & ENGINE_READ
    assert not any(m.host_block_is_free(i) for i in plan.host_ids)
    cache.check_invariants()
    assert graves.bury() == 5
    assert all(m.host_block_is_free(i) for i in plan.host_ids)
    cache.check_invariants()


def test_graves_release_every_due_batch_when_one_fails(
        cache: KeyedHostCache, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.manager.errors import KvtierError
    g = Graves()
    plans = []
    for tag in ("fail-a", "fail-b"):
        plan = EngineSession(cache, tag).prepare_store(keys(tag, 1))
        assert plan is not None
        plans.append(plan)
        g.hold(cache, cache.abandon_stores(plan.keys, owner=tag), seconds=0.0)
    real = cache.release_abandoned
    calls = []

    def first_fails(nodes: list) -> None:  # type: ignore[type-arg]
        calls.append(nodes)
        if len(calls) == 1:
            raise KvtierError("planted")
        real(nodes)

    monkeypatch.setattr(cache, "release_abandoned", first_fails)
    with pytest.raises(KvtierError, match="planted"):
        g.bury()
    assert len(calls) == 2 and len(g) == 0  # the second batch was released all the same
    monkeypatch.undo()
    cache.release_abandoned(calls[0])  # the planted failure's batch, by hand
    assert all(cache.m.host_block_is_free(p.host_ids[0]) for p in plans)
    cache.check_invariants()
