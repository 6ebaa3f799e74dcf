"""Retention in the storage tier (issue 36): pin, TTL and priority reach the pages of a real
file store and a real redis-server (and a Redis Cluster, slow tier).

File: the capacity eviction never takes a pinned page or one within its TTL, takes lower
priorities first, and refuses a write rather than break the capacity when everything else is
held. Redis: a pinned page's key loses its expiry and gets it back on unpin; a TTL lifts the
expiry to at least that long, never shortens it; a page written while a mark holds is written
with it. End to end: a retain through the keyed surface reaches the pages stored now and
those backed up later, through a real worker process.
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.stack import Stack
from kvtier.manager.tenants import Retention, StorageMarks
from kvtier.worker.storage.file_backend import FileBackend
from kvtier.worker.storage.redis_backend import RedisBackend
from kvtier.worker.storage.retention import RetentionMarks
from redis_server import RedisClusterServers, RedisServer
from stack_support import running_stack, worker_pids
from storage_support import page_file
from support import tiny_config, wait_until

pytestmark = pytest.mark.fast

SECRET = b"kvtier-test-storage-secret-0001"
PAGE = 1024


def keys_of(tag: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}".encode()).digest() for i in range(n)]


def pages(n: int) -> list[np.ndarray]:
    return [np.full(PAGE, i % 251, dtype=np.uint8) for i in range(n)]


def file_store(tmp_path: Path, capacity_pages: int) -> FileBackend:
    probe = FileBackend(tmp_path / "probe", "p/r0", secret=SECRET, page_bytes=PAGE)
    overhead = probe._overhead
    probe.close()
    return FileBackend(tmp_path / "store", "ret/r0", secret=SECRET, page_bytes=PAGE,
                       capacity_bytes=capacity_pages * (PAGE + overhead))


def present(store: FileBackend | RedisBackend, keys: list[bytes]) -> list[bool]:
    return store.exists(keys)


# ------------------------------------------------------------------------------ file


def test_file_pinned_page_survives_pressure_and_unpin_lets_it_go(tmp_path: Path) -> None:
    with file_store(tmp_path, 4) as store:
        old = keys_of("old", 4)
        assert store.set(old, pages(4)) == 4
        assert store.retain(old[:1], pin=True) == 1  # the least recently used page
        flood = keys_of("flood", 8)
        for k, p in zip(flood, pages(8), strict=True):
            assert store.set([k], [p]) == 1
        assert present(store, old) == [True, False, False, False], "the pinned page was evicted"
        assert store.stats()["retained_pinned_pages"] == 1
        assert store.unpin(old[:1]) == 1
        assert store.set(keys_of("more", 4), pages(4)) == 4
        assert present(store, old[:1]) == [False], "an unpinned page stayed past the capacity"


def test_file_ttl_keeps_a_page_at_least_its_ttl_then_lets_it_go(tmp_path: Path) -> None:
    with file_store(tmp_path, 2) as store:
        kept, pinned = keys_of("kept", 1), keys_of("pinned", 1)
        assert store.set(kept + pinned, pages(2)) == 2
        assert store.retain(pinned, pin=True) == 1
        assert store.retain(kept, ttl_s=0.6) == 1
        deadline = time.monotonic() + 0.6
        # the store is full of held pages: a write is refused, the TTL page stays
        assert store.set(keys_of("a", 1), pages(1)) == 0
        assert present(store, kept) == [True], "a page within its TTL was evicted"
        time.sleep(max(0.0, deadline - time.monotonic()) + 0.05)
        assert store.set(keys_of("b", 1), pages(1)) == 1
        assert present(store, kept + pinned) == [False, True], "the TTL outlived its end"


def test_file_evicts_lower_priority_first(tmp_path: Path) -> None:
    with file_store(tmp_path, 4) as store:
        low, plain, high, plain2 = (keys_of(t, 1) for t in ("low", "plain", "high", "plain2"))
        # written oldest first: high, plain, plain2, low (the newest)
        for k in (high, plain, plain2, low):
            assert store.set(k, pages(1)) == 1
        assert store.retain(low, priority=-2) == 1
        assert store.retain(high, priority=3) == 1
        order: list[str] = []
        names = {low[0]: "low", plain[0]: "plain", plain2[0]: "plain2", high[0]: "high"}
        new = keys_of("new", 4)
        for i, k in enumerate(new[:3]):
            assert store.set([k], pages(1)) == 1
            gone = [n for key, n in names.items() if not store.exists([key])[0]]
            order.extend(n for n in gone if n not in order)
            assert len(order) == i + 1
        assert order == ["low", "plain", "plain2"]
        assert store.set(new[3:], pages(1)) == 1  # a newer plain page goes before `high`
        assert present(store, high + new) == [True, False, True, True, True]


def test_file_write_is_refused_when_every_other_page_is_held(tmp_path: Path) -> None:
    with file_store(tmp_path, 2) as store:
        held = keys_of("held", 2)
        assert store.set(held, pages(2)) == 2
        assert store.retain(held, pin=True) == 2
        assert store.set(keys_of("new", 1), pages(1)) == 0
        assert present(store, held) == [True, True]
        stats = store.stats()
        assert stats["retained_full_refusals"] == 1 and stats["used_bytes"] <= stats[
            "capacity_bytes"]


def test_retention_bad_arguments_raise_and_change_nothing(tmp_path: Path) -> None:
    with file_store(tmp_path, 2) as store:
        k = keys_of("k", 1)
        for kwargs in ({"ttl_s": -1.0}, {"ttl_s": float("nan")}, {"priority": 9},
                       {"priority": True}):
            with pytest.raises(ValueError, match="retain: "):
                store.retain(k, **kwargs)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="key 0 is 3 bytes"):
            store.retain([b"abc"], pin=True)
        assert store.stats()["retention_marks"] == 0


def test_marks_are_bounded_and_never_shorten_a_ttl() -> None:
    marks = RetentionMarks(limit=2)
    assert marks.retain(["a", "b", "c"], pin=False, ttl_s=10, priority=0, now=0) == ["a", "b"]
    assert marks.counts(0)["retain_refused_pages"] == 1 and len(marks) == 2
    assert marks.retain(["a"], pin=False, ttl_s=1, priority=0, now=0) == ["a"]
    a = marks.get("a", 5)
    assert a is not None and a.until == 10, "a shorter TTL shortened a mark"
    assert marks.retain(["b"], pin=True, ttl_s=0, priority=2, now=0) == ["b"]
    assert marks.unpin(["a", "b"], now=20) == ["b"]
    assert marks.get("a", 20) is None  # its TTL passed: dropped when met
    b = marks.get("b", 20)
    assert b is not None and not b.pin and b.priority == 2  # unpin keeps the priority


def test_the_books_record_of_storage_marks_merges_as_the_worker_and_resends_what_holds(
) -> None:
    """`StorageMarks` (the tenant book's record, re-sent to a replaced worker): merged as
    the worker merges marks, bounded, grouped into one retention per kind when re-sent,
    what holds nothing any more dropped, deleted pages forgotten."""
    marks = StorageMarks(limit=4)
    marks.retain([b"p1", b"p2"], Retention(pin=True), now=0)
    marks.retain([b"t1", b"t2"], Retention(ttl_s=10), now=0)
    marks.retain([b"x"], Retention(ttl_s=1), now=0)  # the table is full
    assert marks.unrecorded == 1 and len(marks) == 4
    marks.retain([b"t1"], Retention(ttl_s=1, priority=3), now=0)  # TTL kept, priority new
    marks.unpin([b"p2"])
    got = {tuple(sorted(k)): r for k, r in marks.resend(now=2.5)}
    assert got == {(b"p1",): Retention(pin=True), (b"t1",): Retention(ttl_s=8.0, priority=3),
                   (b"t2",): Retention(ttl_s=8.0)}, got  # p2 holds nothing: dropped
    assert len(marks) == 3 and marks.resent == 3
    assert {tuple(k) for k, _ in marks.resend(now=11)} == {(b"p1",), (b"t1",)}
    marks.forget([b"p1"])
    marks.forget()
    assert len(marks) == 0 and marks.resend(now=11) == []


# ------------------------------------------------------------------------------ redis


@pytest.fixture(params=["redis", pytest.param("redis-cluster", marks=pytest.mark.slow)])
def redis_url(request: pytest.FixtureRequest) -> str:
    server: RedisServer | RedisClusterServers = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster")
    flusher = RedisBackend(server.url, "flush/r0", secret=SECRET)
    flusher.client.flushall()
    flusher.close()
    return server.url


def ttl_of(store: RedisBackend, key: bytes) -> int:
    """The key's TTL in milliseconds as Redis reports it (-1: no expiry, -2: no key)."""
    return int(store.client.pttl(store.redis_key(key)))  # type: ignore[arg-type]


@pytest.fixture
def expiring(redis_url: str) -> Iterator[RedisBackend]:
    with RedisBackend(redis_url, "ret/r0", secret=SECRET, ttl_s=1) as store:
        yield store


@pytest.mark.slow
def test_redis_pin_survives_expiry_and_unpin_restores_it(expiring: RedisBackend) -> None:
    store = expiring
    now_keys, later = keys_of("now", 2), keys_of("later", 1)
    assert store.set(now_keys, pages(2)) == 2
    assert store.retain([now_keys[0], later[0]], pin=True) == 2
    assert ttl_of(store, now_keys[0]) == -1, "a pinned page kept its expiry"
    assert store.set(later, pages(1)) == 1  # backed up while the pin holds
    assert ttl_of(store, later[0]) == -1, "a page written while pinned got an expiry"
    wait_until(lambda: not store.exists(now_keys[1:])[0], 5.0, "the unpinned page expired")
    assert store.exists([now_keys[0], later[0]]) == [True, True]
    assert store.unpin([now_keys[0], later[0]]) == 2
    assert 0 < ttl_of(store, now_keys[0]) <= 1000, "unpin did not restore the ordinary expiry"
    wait_until(lambda: not any(store.exists([now_keys[0], later[0]])), 5.0,
               "the unpinned pages expired")


@pytest.mark.slow
def test_redis_ttl_lifts_expiry_never_shortens_it(redis_server: RedisServer) -> None:
    redis_url = redis_server.url
    redis.Redis.from_url(redis_url).flushall()
    with RedisBackend(redis_url, "ret/r0", secret=SECRET, ttl_s=1) as store:
        k, later = keys_of("ttl", 2), keys_of("ttl-later", 1)
        assert store.set(k, pages(2)) == 2
        assert store.retain(k[:1] + later, ttl_s=2.0) == 2
        assert ttl_of(store, k[0]) > 1000, "the TTL did not lift the expiry"
        assert store.set(later, pages(1)) == 1
        assert ttl_of(store, later[0]) > 1000, "a page written within a TTL: ordinary expiry"
        wait_until(lambda: not store.exists(k[1:])[0], 5.0, "the plain page expired")
        assert store.exists(k[:1] + later) == [True, True], "a page within its TTL expired"
        wait_until(lambda: not any(store.exists(k[:1] + later)), 5.0, "the TTL ended")
        with RedisBackend(redis_url, "ret/r0", secret=SECRET, ttl_s=100) as long_lived:
            assert long_lived.set(k[:1], pages(1)) == 1
            assert long_lived.retain(k[:1], ttl_s=5.0) == 1
            assert ttl_of(long_lived, k[0]) > 90_000, "a shorter retention TTL shortened it"


def test_redis_delete_and_clear_drop_marks(expiring: RedisBackend) -> None:
    store = expiring
    k = keys_of("drop", 2)
    assert store.set(k, pages(2)) == 2
    assert store.retain(k, pin=True) == 2
    assert store.delete(k[:1]) == 1
    assert store.stats()["retained_pinned_pages"] == 1
    assert store.clear() == 1
    assert store.stats()["retention_marks"] == 0
    assert store.set(k[:1], pages(1)) == 1
    assert 0 < ttl_of(store, k[0]) <= 1000, "a mark outlived its page's deletion"


def test_redis_without_ordinary_ttl_sends_nothing(redis_server: RedisServer) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    with RedisBackend(redis_server.url, "forever/r0", secret=SECRET) as store:
        k = keys_of("forever", 1)
        assert store.set(k, pages(1)) == 1
        calls = raw.info("commandstats").get("cmdstat_persist", {}).get("calls", 0)
        assert store.retain(k, pin=True, ttl_s=10) == 1
        assert store.unpin(k) == 1
        assert raw.info("commandstats").get("cmdstat_persist", {}).get("calls", 0) == calls
        assert ttl_of(store, k[0]) == -1


def test_redis_allkeys_policy_is_reported_at_the_first_pin(redis_server: RedisServer) -> None:
    """Under an allkeys-* maxmemory policy Redis may evict a pinned page: the backend says
    so (`pins_evictable`); under the default (noeviction) it does not."""
    k = keys_of("policy", 1)
    with RedisBackend(redis_server.url, "policy/r0", secret=SECRET) as store:
        store.retain(k, pin=True)
        assert store.stats()["pins_evictable"] == 0
    with RedisServer(extra_args=["--maxmemory-policy", "allkeys-lru"]) as lru, \
            RedisBackend(lru.url, "policy/r0", secret=SECRET) as store:
        store.retain(k, ttl_s=5)
        assert store.stats()["pins_evictable"] == 0  # asked at the first pin only
        store.retain(k, pin=True)
        assert store.stats()["pins_evictable"] == 1


# ------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One worker, 8 host blocks, a file store of 8 pages (tiny_config's page: 512 bytes +
    96 of header and tag)."""
    cfg = tiny_config(workers=1, device_blocks=2, host_blocks=8, storage="file",
                      storage_dir=tmp_path_factory.mktemp("retention-storage"),
                      extra={"KVTIER_STORAGE__CAPACITY_BYTES": str(8 * (512 + 96))})
    with running_stack(cfg, keyed_namespace=b"ret") as stack:
        yield stack


@pytest.fixture
def cache(keyed_stack: Stack) -> KeyedHostCache:
    keyed_stack.reset(storage=True)
    return KeyedHostCache(keyed_stack.require_manager(), keyed_stack.storage,
                          namespace=b"ret", host_ready=keyed_stack.workers_ready)


def in_storage(stack: Stack, cache: KeyedHostCache, hashes: list[bytes]) -> list[bool]:
    return [page_file(stack, 0, cache.storage_key(h)).exists() for h in hashes]


@pytest.mark.slow
def test_keyed_retain_reaches_pages_stored_now_and_backed_up_later(
        keyed_stack: Stack, cache: KeyedHostCache) -> None:
    """A pin set through the keyed surface (what /retain and kv_hints call) keeps a prefix's
    storage pages through a flood that overruns the file store's capacity: the pages stored
    before the pin and those backed up after it; the unpinned flood is evicted."""
    stack = keyed_stack
    before, after = keys_of("before", 2), keys_of("after", 2)
    store_blocks(stack, cache, before)
    cache.retain(before + after, Retention(pin=True))
    store_blocks(stack, cache, after)
    floods = [keys_of(f"flood{i}", 2) for i in range(8)]
    for f in floods:
        store_blocks(stack, cache, f)
    pinned = in_storage(stack, cache, before + after)
    flooded = sum(sum(in_storage(stack, cache, f)) for f in floods)
    assert pinned == [True] * 4, f"pinned pages lost in storage: {pinned}"
    assert flooded == 4, f"the store holds {flooded} flood pages, expected 8 - 4 pinned"
    assert stack.storage is not None
    counters = stack.storage.counters
    assert counters["retain_pages"] == 4 and counters["errors_retain"] == 0
    # unpinned through the keyed surface, the prefix goes under the next flood
    cache.unpin(before + after)
    for i in range(4):
        store_blocks(stack, cache, keys_of(f"again{i}", 2))
    assert in_storage(stack, cache, before + after) == [False] * 4


def test_clear_by_tenant_deletes_that_tenants_pages_only(keyed_stack: Stack,
                                                         cache: KeyedHostCache) -> None:
    stack = keyed_stack
    x, y = keys_of("x", 3), keys_of("y", 3)
    store_blocks(stack, cache, x, "x")
    store_blocks(stack, cache, y, "y")
    assert in_storage(stack, cache, x + y) == [True] * 6
    out = cache.clear(tenant="x", storage=True, wait_s=20.0)
    assert out == {"host_blocks_removed": 3, "storage_pages_asked": 3,
                   "storage_pages_deleted": 3}, out
    assert in_storage(stack, cache, x + y) == [False] * 3 + [True] * 3


def test_a_page_the_worker_deletes_by_itself_drops_its_mark(keyed_stack: Stack,
                                                            cache: KeyedHostCache) -> None:
    """A pinned page found damaged by a prefetch is deleted by the worker itself: the book's
    record of its mark goes with it (a re-send to a replaced worker would mark the key
    again, and hold a later write of it); the other page's mark stays."""
    stack = keyed_stack
    x = keys_of("damaged", 2)
    store_blocks(stack, cache, x, "x")
    cache.retain(x, Retention(pin=True), "x")
    marks = cache.tenants.storage_marks
    assert len(marks) == 2
    cache.clear(hashes=x)  # host only: the pages stay, the next lookup prefetches them
    page = page_file(stack, 0, cache.storage_key(x[0]))
    data = bytearray(page.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of the payload: its MAC fails
    page.write_bytes(bytes(data))
    cache.lookup(x[0], "damaged-read", [x[1]], threshold_tokens=0)
    wait_until(lambda: not page.exists(), 20.0, "the worker to delete the damaged page")
    wait_until(lambda: len(marks) == 1, 5.0, "the damaged page's mark dropped")
    assert in_storage(stack, cache, x) == [False, True]
    assert marks.resend(time.monotonic())[0][0] == [cache.storage_key(x[1])]


@pytest.mark.slow
def test_a_replaced_worker_is_told_the_retention_again(keyed_stack: Stack) -> None:
    """The storage marks live in the worker process: when it is killed, the tenant book's
    record (`StorageMarks`) is sent to its replacement once ready, so a pinned page still
    outlasts a flood of the file store afterwards. The stack's own keyed surface (the one
    the supervisor's hook reaches)."""
    stack = keyed_stack
    keyed = stack.require_keyed()
    stack.reset(storage=True)
    storage = stack.storage
    assert storage is not None
    pinned = keys_of("survivor", 4)
    store_blocks(stack, keyed, pinned)
    asked = storage.counters["retain_pages"]
    keyed.retain(pinned, Retention(pin=True))
    wait_until(lambda: storage.counters["retain_pages"] >= asked + 4, 20.0, "the pin sent")
    old = worker_pids(stack)[0]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: worker_pids(stack)[0] != old and stack.workers_ready(), 60.0,
               "the replacement ready")
    # the pin is queued before the rank reads as ready: ahead of the flood's backups
    for i in range(8):  # 16 pages through a store of 8
        store_blocks(stack, keyed, keys_of(f"after-restart{i}", 2))
    kept = in_storage(stack, keyed, pinned)
    assert kept == [True] * 4, f"the replaced worker forgot the pin: {kept}"
    assert storage.counters["retain_pages"] == asked + 8  # sent once more, to the new one
    keyed.unpin(pinned)
    stack.reset(storage=True)
    assert len(keyed.tenants.storage_marks) == 0  # a storage reset forgets the marks


def test_clear_by_tenant_reaches_pages_whose_host_copy_is_gone(keyed_stack: Stack,
                                                                 cache: KeyedHostCache) -> None:
    """Storage pages carry no tenant: the book remembers who stored each block
    (`StoredPages`), so a clear by tenant with storage deletes x's pages after x's host
    copies left (here a host-only clear), and y's stay."""
    stack = keyed_stack
    x, y = keys_of("gone-x", 3), keys_of("gone-y", 3)
    store_blocks(stack, cache, x, "x")
    store_blocks(stack, cache, y, "y")
    assert cache.clear(tenant="x")["host_blocks_removed"] == 3  # host only: pages stay
    assert in_storage(stack, cache, x) == [True] * 3
    out = cache.clear(tenant="x", storage=True, wait_s=20.0)
    assert out == {"host_blocks_removed": 0, "storage_pages_asked": 3,
                   "storage_pages_deleted": 3}, out
    assert in_storage(stack, cache, x + y) == [False] * 3 + [True] * 3
    assert cache.tenants.stored_pages.hashes("x") == [] and len(cache.tenants.stored_pages) == 3


def store_blocks(stack: Stack, cache: KeyedHostCache, hashes: list[bytes],
                 tenant: str = "") -> None:
    """Store these blocks on the host (write_through backs them up) and wait for it."""
    plan = cache.prepare_store(hashes, tenant=tenant)
    assert plan is not None
    cache.complete_store(plan.keys)
    storage = stack.storage
    assert storage is not None
    target = storage.counters["backup_pages"] + len(hashes)
    wait_until(lambda: storage.counters["backup_pages"] >= target, 20.0,
               f"{len(hashes)} pages backed up ({storage.counters})", interval=0.01)
