"""Encrypted storage pages (format version 4, `kvtier.worker.storage.page_crypto`) and the
storage tier's back-pressure, against real stores (files in a temp dir, a real redis-server,
a real 3-node Redis Cluster) and embedded stacks.

What must hold: a known byte pattern written through a backend never appears in what the
store holds (the file, the Redis value), while the same write in clear shows it (the negative
control that proves the search would find it); a page under a key id the reader does not list,
of the other format version, or with one bit flipped (ciphertext, tag, header) is a miss,
counted by reason, deleted, never data; compressed pages round trip byte-exact and are opened
by readers that do not compress; rotation works end to end between stacks sharing one storage
folder or one Redis; a slow backend (delay injection) makes the manager skip backups, counted,
never announced as stored, and slow queries make lookups miss at once instead of waiting.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from kvtier.manager.stack import Stack
from kvtier.worker.delays import STORAGE_DELAY_ENV, STORAGE_WRITE_DELAY_ENV
from kvtier.worker.storage import HEADER_BYTES, PageStatus, namespace_for
from kvtier.worker.storage.backend import StorageBackend
from kvtier.worker.storage.file_backend import FileBackend
from kvtier.worker.storage.page_crypto import (
    TAG_BYTES,
    AeadPageCodec,
    PageKeys,
    parse_key_ids,
)
from kvtier.worker.storage.redis_backend import RedisBackend
from stack_support import attached_host_pools, running_stack
from storage_support import BS, ModelRunner, namespaces, page_keys, prompt, stack_config
from support import new_deployment_id, tiny_config

pytestmark = pytest.mark.fast

PAGE = 4096
SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16", "block_size": 4}
NS = namespace_for(SHAPE, 0, 1)
SECRET = b"kvtier-test-storage-secret-crypto"
PATTERN = b"KNOWN-KV-PATTERN-0123456789abcdef"  # 33 bytes: never aligned to a 16-byte block
PAGE_BYTES = (PATTERN * (PAGE // len(PATTERN) + 1))[:PAGE]

OpenBackend = Callable[..., StorageBackend]


def make_keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"crypto/{salt}/{i}".encode()).digest() for i in range(n)]


@pytest.fixture(params=["file", "redis", "redis-cluster"])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_backend(backend_kind: str, tmp_path: Path,
                 request: pytest.FixtureRequest) -> Iterator[OpenBackend]:
    """Backends of the parametrized kind on one store (as several instances would open it),
    closed after the test."""
    url = ""
    if backend_kind == "redis":
        url = request.getfixturevalue("redis_server").url
    elif backend_kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    if url:
        flusher = RedisBackend(url, NS, secret=SECRET)
        flusher.client.flushall()
        flusher.close()
    opened: list[StorageBackend] = []

    def _open(keys: PageKeys | None = None, compression: str = "none") -> StorageBackend:
        backend: StorageBackend
        if backend_kind == "file":
            backend = FileBackend(tmp_path / "store", NS, secret=SECRET, page_bytes=PAGE,
                                  keys=keys, compression=compression)
        else:
            backend = RedisBackend(url, NS, secret=SECRET, page_bytes=PAGE, keys=keys,
                                   compression=compression)
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        backend.close()


def stored_values(backend: StorageBackend) -> list[bytes]:
    """Every stored byte string of the backend's namespace, read behind its back."""
    if isinstance(backend, FileBackend):
        return [p.read_bytes() for p in backend.root.rglob("*") if p.is_file()]
    assert isinstance(backend, RedisBackend)
    out: list[bytes] = []
    client = backend.client
    servers = ([n.redis_connection for n in client.get_primaries()]
               if isinstance(client, redis.RedisCluster) else [client])
    for server in servers:
        for name in server.scan_iter(match=b"kvtier:*"):
            value = server.get(name)
            if value is not None:
                out.append(value)
    return out


def raw_of(backend: StorageBackend, key: bytes) -> bytes:
    if isinstance(backend, FileBackend):
        return (backend.root / key.hex()[:2] / key.hex()).read_bytes()
    assert isinstance(backend, RedisBackend)
    value = backend.client.get(backend.redis_key(key))
    assert isinstance(value, bytes)
    return value


def put_raw(backend: StorageBackend, key: bytes, raw: bytes) -> None:
    if isinstance(backend, FileBackend):
        (backend.root / key.hex()[:2] / key.hex()).write_bytes(raw)
    else:
        assert isinstance(backend, RedisBackend)
        backend.client.set(backend.redis_key(key), raw)


def read_back(backend: StorageBackend, keys: list[bytes]) -> tuple[list[bool], list[bytes]]:
    dests = [bytearray(PAGE) for _ in keys]
    hits = backend.get_into(keys, dests)
    return hits, [bytes(d) for d in dests]


# ---------------------------------------------------------------------- at rest


def test_known_pattern_is_never_stored_in_clear_and_round_trips(
        open_backend: OpenBackend) -> None:
    keys = make_keys(8)
    clear = open_backend()  # negative control first: format 3, clear
    assert clear.set(keys[:4], [PAGE_BYTES] * 4) == 4
    shown = [v for v in stored_values(clear) if PATTERN in v]
    assert len(shown) == 4, "the search must find the pattern in clear pages"
    assert clear.delete(keys[:4]) == 4

    sealed = open_backend(PageKeys(SECRET))
    assert sealed.set(keys, [PAGE_BYTES] * 8) == 8
    values = stored_values(sealed)
    assert len(values) == 8
    assert all(len(v) == HEADER_BYTES + PAGE + TAG_BYTES for v in values)
    # not the pattern, nor any 16-byte piece of it (AES blocks are 16 bytes)
    for value in values:
        assert all(PAGE_BYTES[i:i + 16] not in value for i in range(0, 64))
    hits, pages = read_back(sealed, keys)
    assert hits == [True] * 8 and pages == [PAGE_BYTES] * 8  # byte-exact
    # another instance sharing the store (another writer salt) reads them too
    other = open_backend(PageKeys(SECRET))
    hits, pages = read_back(other, keys)
    assert hits == [True] * 8 and pages == [PAGE_BYTES] * 8
    # two writes of the same page under one key never repeat a nonce: ciphertexts differ
    assert other.set(keys[:1], [PAGE_BYTES]) == 1
    assert raw_of(other, keys[0]) not in values


def test_unknown_or_removed_key_id_is_refused_counted_and_deleted(
        open_backend: OpenBackend, caplog: pytest.LogCaptureFixture) -> None:
    keys = make_keys(3, "rotate")
    old = open_backend(PageKeys(SECRET, 1))
    assert old.set(keys, [PAGE_BYTES] * 3) == 3
    rotated = open_backend(PageKeys(SECRET, 2, (1,)))  # step 1: key 2 new, key 1 still read
    hits, pages = read_back(rotated, keys[:1])
    assert hits == [True] and pages == [PAGE_BYTES]
    retired = open_backend(PageKeys(SECRET, 2))  # step 2: key 1 removed
    hits, _ = read_back(retired, keys[1:])
    assert hits == [False, False]
    stats = retired.stats()
    assert stats["unknown_key_pages"] == 2 and stats["corrupt_pages"] == 2
    assert retired.exists(keys[1:]) == [False, False]  # deleted: not offered again
    assert "unknown_key" in caplog.text  # one line names the reason
    foreign = open_backend(PageKeys(SECRET, 7))  # an id no one configured
    assert read_back(foreign, keys[:1])[0] == [False]
    assert foreign.stats()["unknown_key_pages"] == 1


@pytest.mark.parametrize("where", ["ciphertext", "tag", "salt", "nonce", "key id"])
def test_a_flipped_bit_is_refused(open_backend: OpenBackend, where: str) -> None:
    keys = make_keys(2, where)
    sealed = open_backend(PageKeys(SECRET, 1, (2,)))
    assert sealed.set(keys, [PAGE_BYTES] * 2) == 2
    raw = bytearray(raw_of(sealed, keys[0]))
    offset = {"ciphertext": HEADER_BYTES + PAGE // 2, "tag": len(raw) - 3, "salt": 60,
              "nonce": 70, "key id": 48}[where]
    raw[offset] ^= 0x02  # key id 1 -> 3: listed nowhere
    put_raw(sealed, keys[0], bytes(raw))
    hits, pages = read_back(sealed, keys)
    assert hits == [False, True] and pages[1] == PAGE_BYTES
    expected = "unknown_key_pages" if where == "key id" else None
    stats = sealed.stats()
    assert stats["corrupt_pages"] == 1
    assert stats["unknown_key_pages"] == (1 if expected else 0)


def test_pages_of_the_other_format_are_refused_as_old_format(
        open_backend: OpenBackend) -> None:
    keys = make_keys(2, "format")
    clear = open_backend()
    assert clear.set(keys[:1], [PAGE_BYTES]) == 1
    sealed = open_backend(PageKeys(SECRET))
    assert sealed.set(keys[1:], [PAGE_BYTES]) == 1
    assert read_back(sealed, keys[:1])[0] == [False]  # a format 3 page, encryption on
    assert read_back(clear, keys[1:])[0] == [False]  # a format 4 page, encryption off
    assert sealed.stats()["old_format_pages"] == 1 and clear.stats()["old_format_pages"] == 1


def test_codec_binds_page_key_and_namespace() -> None:
    """The associated data: a page moved under another key or namespace fails."""
    keys = PageKeys(SECRET)
    codec = AeadPageCodec(keys, NS)
    a, b = make_keys(2, "bind")
    page = codec.encode_page(a, PAGE_BYTES)
    dest = memoryview(bytearray(PAGE))
    assert codec.decode_into(a, page, dest) is PageStatus.OK and bytes(dest) == PAGE_BYTES
    moved = bytearray(page)
    moved[8:40] = b  # claims to be the page of key b
    assert codec.decode_into(b, moved, dest) is PageStatus.BAD_TAG
    elsewhere = AeadPageCodec(keys, namespace_for(SHAPE, 1, 2))
    assert elsewhere.decode_into(a, page, dest) is PageStatus.BAD_TAG
    other_secret = AeadPageCodec(PageKeys(b"another-secret-of-32-bytes-xxxxx"), NS)
    assert other_secret.decode_into(a, page, dest) is PageStatus.BAD_TAG
    assert "secret" not in repr(keys).lower() or SECRET.decode() not in repr(keys)
    assert parse_key_ids(" 3, 2 ,") == (3, 2)
    with pytest.raises(ValueError, match="key id '0'"):
        parse_key_ids("0")


# ---------------------------------------------------------------------- compression


def test_compressed_pages_round_trip_byte_exact_and_stay_private(
        open_backend: OpenBackend) -> None:
    keys = make_keys(4, "zstd")
    noise = os.urandom(PAGE)  # incompressible: stored as it is (encoding 0)
    pages = [PAGE_BYTES, noise, PAGE_BYTES[::-1], bytes(PAGE)]
    writer = open_backend(PageKeys(SECRET), compression="zstd")
    assert writer.set(keys, pages) == 4
    sizes = [len(raw_of(writer, k)) for k in keys]
    full = HEADER_BYTES + PAGE + TAG_BYTES
    assert sizes[1] == full and all(n < full // 4 for n in (sizes[0], sizes[2], sizes[3]))
    assert [raw_of(writer, k)[67] for k in keys] == [1, 0, 1, 1]  # the encoding byte
    assert not any(PATTERN[:16] in raw_of(writer, k) for k in keys)
    # a reader that does not compress opens both encodings, byte-exact
    reader = open_backend(PageKeys(SECRET))
    hits, back = read_back(reader, keys)
    assert hits == [True] * 4 and back == pages
    assert reader.exists(keys) == [True] * 4  # a short file is a plausible page
    # a flipped bit in a compressed page is refused before anything is decompressed
    raw = bytearray(raw_of(writer, keys[0]))
    raw[HEADER_BYTES + 3] ^= 1
    put_raw(writer, keys[0], bytes(raw))
    assert read_back(reader, keys[:1])[0] == [False]
    assert reader.stats()["corrupt_pages"] == 1


def test_compression_needs_encryption() -> None:
    with pytest.raises(ValueError, match=re.escape("compression = 'zstd' needs storage.encrypt")):
        FileBackend("/nonexistent-kvtier", NS, secret=SECRET, compression="zstd")
    with pytest.raises(ValueError, match=re.escape("compression = 'lz4': expected one of")):
        AeadPageCodec(PageKeys(SECRET), NS, "lz4")


# ---------------------------------------------------------------------- two stacks


def _embedded(storage_dir: Path, url: str | None = None, **extra: str) -> Stack:
    """An embedded stack (2 ranks) on the file folder `storage_dir`, or on Redis at `url`."""
    env = {"KVTIER_STORAGE__SECRET": SECRET.decode(), "KVTIER_STORAGE__INDEX_REFRESH_S": "0"}
    env.update({f"KVTIER_STORAGE__{k.upper()}": v for k, v in extra.items()})
    cfg = stack_config(new_deployment_id(), storage_dir, backend="redis" if url else "file",
                       url=url, extra=env)
    stack = Stack(cfg, embedded=True)
    stack.start()
    return stack


def _storage_hits(runner: ModelRunner, tokens: list[int]) -> int:
    out = runner.run(tokens, compute=False)
    assert not out.corrupt_blocks  # every block served is byte-checked on both ranks
    return out.match.num_tokens // BS


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_rotation_end_to_end_across_two_stacks_sharing_one_store(
        kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    blocks = 6
    first, second = prompt(501, blocks), prompt(502, blocks)
    store = tmp_path / "shared"
    url = None
    if kind == "redis":
        url = request.getfixturevalue("redis_server").url
        redis.Redis.from_url(url).flushall()

    def stored(stack: Stack, key: bytes) -> list[bytes | None]:
        """The stored bytes of `key`'s page on each rank (None: not stored)."""
        out: list[bytes | None] = []
        for ns in namespaces(stack):
            if url is None:
                path = store / ns / key.hex()[:2] / key.hex()
                out.append(path.read_bytes() if path.exists() else None)
            else:
                value = redis.Redis.from_url(url).get(f"kvtier:{ns}:{key.hex()}")
                out.append(value if isinstance(value, bytes) else None)
        return out

    a = _embedded(store, url, key_id="1", compression="zstd")  # this writer compresses
    assert a.workers is not None
    assert all(r.spec.storage_compression == "zstd" for r in a.workers._ranks)
    try:
        ModelRunner(a).run(first)  # computed, written under key 1
        raw = [v for k in page_keys(first) for v in stored(a, k)]
        assert all(v is not None and int.from_bytes(v[48:52], "little") == 1 for v in raw)
    finally:
        a.close()
    b = _embedded(store, url, key_id="2", old_key_ids="1")  # rotated: reads 1, writes 2
    try:
        runner = ModelRunner(b)
        assert _storage_hits(runner, first) == blocks  # key 1 pages, another instance's
        runner.run(second)  # written under key 2
        raw = [v for k in page_keys(second) for v in stored(b, k)]
        assert all(v is not None and int.from_bytes(v[48:52], "little") == 2 for v in raw)
    finally:
        b.close()
    c = _embedded(store, url, key_id="2")  # key 1 retired
    try:
        runner = ModelRunner(c)
        assert _storage_hits(runner, second) == blocks
        assert _storage_hits(runner, first) == 0  # refused, never served
        assert c.workers is not None
        refused = [r.storage.stats()["unknown_key_pages"]  # type: ignore[union-attr]
                   for r in c.workers._ranks]
        assert min(refused) >= 1  # each rank refused the first page it read
        assert stored(c, page_keys(first)[0]) == [None, None]  # and deleted it
    finally:
        c.close()


# ---------------------------------------------------------------------- back-pressure


def test_slow_backend_skips_backups_counted_never_announced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STORAGE_WRITE_DELAY_ENV, "60")  # every BACKUP takes 60 ms
    stack = _embedded(tmp_path / "slow", slow_write_ms="40")
    try:
        tier = stack.storage
        assert tier is not None
        runner = ModelRunner(stack)
        runner.run(prompt(601, 4))  # the first backup measures 60 ms > 40 ms: slow
        assert tier.writes_slow()
        written = tier.counters["backup_pages"]
        t0 = time.monotonic()
        for i in range(3):
            runner.run(prompt(610 + i, 4))
        assert time.monotonic() - t0 < 0.06 * 3  # no request paid for a backup
        c = tier.counters
        assert c["backup_slow_skipped_pages"] == 12 and c["backup_pages"] == written
        skipped = page_keys(prompt(610, 4))
        assert not any(tier.holds(k) for k in skipped)  # never listed as stored
        files = {p.name for p in (tmp_path / "slow").rglob("*") if p.is_file()}
        assert not files & {k.hex() for k in skipped}
        status = stack.status()["storage"]["back_pressure"]
        assert status["writes_slow"] and status["write_latency_ms"] > 40
        # the backend is fast again: after the probe interval one probe batch goes through,
        # and its answer brings the average down
        monkeypatch.setenv(STORAGE_WRITE_DELAY_ENV, "0")
        assert stack.workers is not None
        for r in stack.workers._ranks:
            r.executor.storage_write_delay_s = 0.0
        deadline = time.monotonic() + 10
        n = 0
        while tier.writes_slow() and time.monotonic() < deadline:
            time.sleep(0.2)
            n += 1
            runner.run(prompt(700 + n, 4))
        assert not tier.writes_slow()
        assert tier.counters["backup_probes"] >= 1
    finally:
        stack.close()


def test_slow_reads_make_lookups_miss_at_once_counted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "reads"
    held = [prompt(801 + i, 6) for i in range(3)]
    fast = _embedded(store)
    try:
        runner = ModelRunner(fast)
        for p in held:
            runner.run(p)  # computed and written
    finally:
        fast.close()
    monkeypatch.setenv(STORAGE_DELAY_ENV, "60")  # every storage query and read: +60 ms
    slow = _embedded(store, slow_read_ms="40")
    try:
        tier = slow.storage
        assert tier is not None
        runner = ModelRunner(slow)
        assert _storage_hits(runner, held[0]) == 6  # waited for: the query measures 60 ms
        assert tier.reads_slow()
        t0 = time.monotonic()
        out = runner.run(held[1], compute=False)
        assert time.monotonic() - t0 < 0.06  # did not wait on the store...
        assert out.match.num_tokens == 0  # ...though it holds every block: a miss at once
        assert tier.counters["query_slow_skips"] == 1
        assert slow.status()["storage"]["back_pressure"]["reads_slow"]
    finally:
        slow.close()


def _chain(prompt_id: int, n: int) -> list[bytes]:
    """An engine's chained block hashes (the keyed surface's keys)."""
    out: list[bytes] = []
    parent = b""
    for i in range(n):
        parent = hashlib.sha256(parent + bytes([prompt_id, i])).digest()
        out.append(parent)
    return out


def test_a_store_skipped_by_back_pressure_is_never_an_event(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's path (the keyed surface, a worker process): a block whose storage write was
    skipped is announced in the host tier only, never in storage."""
    monkeypatch.setenv(STORAGE_WRITE_DELAY_ENV, "80")  # the worker's every BACKUP: +80 ms
    cfg = tiny_config(workers=1, device_blocks=2, host_blocks=64, storage="file",
                      storage_dir=tmp_path, write_policy="write_through",
                      extra={"KVTIER_STORAGE__SECRET": SECRET.decode(),
                             "KVTIER_STORAGE__SLOW_WRITE_MS": "40",
                             "KVTIER_STORAGE__INDEX_REFRESH_S": "0"})
    with (running_stack(cfg, keyed_namespace=b"ns") as stack,
          attached_host_pools(cfg) as pools):
        cache = stack.require_keyed()
        tier = stack.storage
        assert tier is not None
        cache.enable_events()

        def store_and_settle(hashes: list[bytes]) -> set[tuple[str, bool]]:
            plan = cache.prepare_store(hashes)
            assert plan is not None
            for hid in plan.host_ids:
                pools[0].data[hid].fill_(7)
            cache.complete_store(plan.keys, ok=True)
            deadline = time.monotonic() + 20
            while stack.require_manager().stats()["tasks_inflight"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            return {(e.tier, e.removed) for e in cache.take_events()}

        assert store_and_settle(_chain(1, 3)) == {("host", False), ("storage", False)}
        assert tier.writes_slow()  # that backup took 80 ms
        assert store_and_settle(_chain(2, 3)) == {("host", False)}  # skipped: host only
        assert tier.counters["backup_slow_skipped_pages"] == 3
