"""Tenants and retention in one keyed namespace (issue 36): quotas evict a tenant's own
copies first and never another's within its quota; pin, TTL and priority keep copies in
place; refusals change nothing. A real keyed stack (worker process, shared-memory host
pool), no engine."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator

import pytest
from kvtier.manager.keyed import KeyedHostCache, engine_key
from kvtier.manager.stack import Stack
from kvtier.manager.tenants import Retention, SteeringError, retention_from_hints
from stack_support import running_stack
from support import tiny_config

pytestmark = pytest.mark.fast

HOST_BLOCKS = 16


def chain(tag: bytes, n: int) -> list[bytes]:
    out: list[bytes] = []
    parent = tag
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([i])).digest()
        out.append(parent)
    return out


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    cfg = tiny_config(workers=1, device_blocks=2, host_blocks=HOST_BLOCKS)
    with running_stack(cfg, keyed_namespace=b"tenants") as s:
        yield s


@pytest.fixture
def cache(stack: Stack) -> KeyedHostCache:
    stack.reset()
    return KeyedHostCache(stack.require_manager(), None, namespace=b"tenants",
                          host_ready=stack.workers_ready)


def store(cache: KeyedHostCache, hashes: list[bytes], tenant: str) -> bool:
    plan = cache.prepare_store(hashes, tenant=tenant)
    if plan is None:
        return False
    cache.complete_store(plan.keys)
    return True


def held(cache: KeyedHostCache, hashes: list[bytes]) -> int:
    return cache.count_hits(hashes) if hashes else 0


def present(cache: KeyedHostCache, hashes: list[bytes]) -> int:
    with cache.m.lock:
        return sum(cache.m.lookup(engine_key(h)) is not None for h in hashes)


def check(cache: KeyedHostCache) -> None:
    cache.tenants.check_invariants()
    cache.check_invariants()


def test_quota_evicts_own_blocks_never_another_tenants(cache: KeyedHostCache) -> None:
    cache.set_quota("a", 10)
    cache.set_quota("b", 6)
    b = chain(b"b", 6)
    assert store(cache, b, "b")
    for i in range(8):  # A floods: 8 x 4 one-shot blocks, 3x its quota
        assert store(cache, chain(b"a%d" % i, 4), "a")
        check(cache)
    assert present(cache, b) == 6, "a tenant within its quota lost blocks to another's flood"
    figs = cache.tenant_figures()
    assert figs["a"]["host_blocks"] == 10 and figs["a"]["evictions"] == 22
    assert figs["b"]["evictions"] == 0 and figs["b"]["host_blocks"] == 6
    assert sum(f["host_blocks"] for f in figs.values()) == (
        cache.m.host_capacity - cache.m.host_free)


def test_store_that_would_take_a_protected_block_is_refused(cache: KeyedHostCache) -> None:
    cache.set_quota("b", 8)
    b = chain(b"b", 8)
    assert store(cache, b, "b")
    assert store(cache, chain(b"c", 8), "c")  # default tenant, no quota: fills the tier
    assert cache.m.host_free == 0
    # the namespace's order would take b's (oldest) copies: refused, nothing changed
    assert not store(cache, chain(b"d", 2), "d")
    assert present(cache, b) == 8 and present(cache, chain(b"c", 8)) == 8
    assert cache.tenant_figures()["d"]["stores_refused"] == 1
    check(cache)


def test_pin_survives_flood_and_pin_over_quota_is_refused_whole(cache: KeyedHostCache) -> None:
    cache.set_quota(None, 8)  # every tenant without a quota: 8 blocks
    sys_prompt = chain(b"sys", 4)
    assert store(cache, sys_prompt, "b")
    out = cache.retain(sys_prompt, Retention(pin=True), "b")
    assert out["applied"] == 4
    for i in range(10):
        store(cache, chain(b"flood%d" % i, 4), "b")  # its own flood: unpinned ones go
        store(cache, chain(b"aflood%d" % i, 4), "a")
        check(cache)
    assert held(cache, sys_prompt) == 4
    more = chain(b"more", 4)
    assert store(cache, more, "b")
    assert not store(cache, chain(b"big", 6), "b"), "a store past its pins' room went in"
    cache.set_quota("b", 7)
    before = cache.tenant_figures()["b"]
    with pytest.raises(SteeringError, match="pin of 4 blocks refused: tenant 'b' has 4 pinned"):
        cache.retain(more, Retention(pin=True), "b")
    after = cache.tenant_figures()["b"]
    assert after["pinned_blocks"] == before["pinned_blocks"] == 4
    assert cache.unpin(sys_prompt) == 4
    check(cache)


def test_ttl_holds_then_ordinary_eviction(cache: KeyedHostCache) -> None:
    cache.set_quota(None, 8)
    kept = chain(b"ttl", 4)
    assert store(cache, kept, "t")
    cache.retain(kept, Retention(ttl_s=0.5), "t")
    for i in range(4):
        store(cache, chain(b"x%d" % i, 2), "t")
    assert held(cache, kept) == 4
    time.sleep(0.6)
    for i in range(4):
        store(cache, chain(b"y%d" % i, 2), "t")
    assert present(cache, kept) == 0, "a block outlived its TTL under pressure"
    check(cache)


def test_priority_lower_goes_first(cache: KeyedHostCache) -> None:
    cache.set_quota(None, 6)
    low, mid, high = chain(b"lo", 2), chain(b"mid", 2), chain(b"hi", 2)
    assert store(cache, high, "p") and store(cache, mid, "p") and store(cache, low, "p")
    cache.retain(high, Retention(priority=5), "p")
    cache.retain(low, Retention(priority=-3), "p")
    assert store(cache, chain(b"n1", 2), "p")
    assert present(cache, low) == 0 and present(cache, mid) == 2 and present(cache, high) == 2
    assert store(cache, chain(b"n2", 2), "p")
    assert present(cache, mid) == 0 and present(cache, high) == 2
    check(cache)


@pytest.mark.parametrize("payload, why", [
    ({"ttl_s": -1}, "ttl_s = -1"),
    ({"priority": 99}, "priority = 99"),
    ({"pin": "yes"}, "pin = 'yes'"),
    ({"pinned": True}, "unknown field"),
])
def test_bad_retention_is_one_line(payload: dict[str, object], why: str) -> None:
    with pytest.raises(SteeringError, match=why) as e:
        Retention.parse(payload)
    assert "\n" not in str(e.value)


class _Action:
    def __init__(self, action_type: str, version: str, payload: object) -> None:
        self.action_type, self.action_version, self.payload = action_type, version, payload


def test_kv_hints_retain_action() -> None:
    found = retention_from_hints([_Action("other.thing", "9", {}),
                                  _Action("kvtier.retain", "1",
                                          {"pin": True, "ttl_s": 5, "tenant": "b"})])
    assert found == (Retention(pin=True, ttl_s=5.0), "b")
    assert retention_from_hints([_Action("other.thing", "1", {})]) is None
    for action, why in ((_Action("kvtier.retain", "2", {"pin": True}), "version '2'"),
                        (_Action("kvtier.retain", "1", [1]), "payload must be an object"),
                        (_Action("kvtier.retain", "1", {"ttl_s": -5}), "ttl_s = -5")):
        with pytest.raises(SteeringError, match=why) as e:
            retention_from_hints([action])
        assert "\n" not in str(e.value)


def test_engine_block_hashes_equal_vllms() -> None:
    """Golden values from vLLM 0.32's own `hash_block_tokens` (sha256, seed "vllm-none-hash",
    tokens 100..163 in 16-token blocks, cache_salt "b"), computed in .venv-vllm."""
    from kvtier.manager.keys import engine_block_hashes

    got = engine_block_hashes("sha256", "vllm-none-hash", 16, list(range(100, 164)), "b")
    assert got[0].hex() == "ba10f772fcfe0a4f3a74c6b595e0395c9473d0620d16691251141ee3d26ce70b"
    assert got[1].hex() == "33f4542e9d45a5a0b5116f01aea78be994e2ce47bee26a0bacd01a51c1da09e4"
    none_hash = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
    assert engine_block_hashes("sha256", none_hash, 16, list(range(100, 164)), "b") == got


def test_clear_by_tenant_is_announced_and_leaves_the_other(cache: KeyedHostCache) -> None:
    cache.enable_events()
    x, y = chain(b"x", 3), chain(b"y", 3)
    assert store(cache, x, "x") and store(cache, y, "y")
    cache.take_events()  # the stores' announcements
    out = cache.clear(tenant="x", storage=True)
    assert out == {"host_blocks_removed": 3, "storage_pages_asked": 0,  # no storage tier
                   "storage_pages_deleted": 0}
    events = cache.take_events()
    gone = {h for e in events if e.removed and e.tier == "host" for h in e.hashes}
    assert gone == set(x), events
    assert present(cache, x) == 0 and held(cache, y) == 3
    assert "x" not in {k for k, f in cache.tenant_figures().items() if f["host_blocks"]}
    check(cache)
