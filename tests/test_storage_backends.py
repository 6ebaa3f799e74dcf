"""Storage-tier backends against real stores: files in a temp dir and a real redis-server.

What must hold for every backend: pages come back byte-exact into caller-owned buffers;
namespaces (model shape + TP layout + rank) isolate pages while two backend objects on the same
namespace (two kvtier instances) share them; damaged pages are misses, counted, never data;
clear() touches only its own namespace. Then per backend: the file tier's LRU capacity and
atomic writes, and Redis outages (killed, frozen) degrading to bounded-time misses with
recovery on the same backend object.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis
import torch
from kvtier.worker.storage import HEADER_BYTES, PageStatus, make_backend, namespace_for
from kvtier.worker.storage.backend import StorageBackend
from kvtier.worker.storage.file_backend import FileBackend
from kvtier.worker.storage.page_format import PageCodec
from kvtier.worker.storage.redis_backend import RedisBackend
from redis_server import RedisClusterServers, RedisServer
from support import free_port, wait_until

pytestmark = pytest.mark.fast

PAGE = 64 * 1024
SHAPE = {"num_layers": 8, "num_kv_heads": 4, "head_dim": 64, "dtype": "float16", "block_size": 64}
NS = namespace_for(SHAPE, 0, 2)
SECRET = b"kvtier-test-storage-secret-0001"


def make_keys(n: int, salt: str = "") -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def make_pages(n: int, size: int = PAGE, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, size), dtype=np.uint8)


OpenBackend = Callable[..., StorageBackend]


@pytest.fixture(params=["file", "redis",
                        pytest.param("redis-cluster", marks=pytest.mark.slow)])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_backend(
    backend_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[OpenBackend]:
    """Opens backends of the parametrized kind on one store (one dir / the one server), the
    way several processes or instances would; closes them after the test."""
    url = ""
    if backend_kind == "redis":
        url = request.getfixturevalue("redis_server").url
    elif backend_kind == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
    if url:
        flusher = RedisBackend(url, NS, secret=SECRET)
        flusher.client.flushall()  # a cluster client flushes every primary
        flusher.close()
    opened: list[StorageBackend] = []

    def _open(namespace: str = NS, **kwargs: object) -> StorageBackend:
        kwargs.setdefault("secret", SECRET)
        if backend_kind == "file":
            backend: StorageBackend = FileBackend(tmp_path / "store", namespace, **kwargs)
        else:
            backend = RedisBackend(url, namespace, **kwargs)
        opened.append(backend)
        return backend

    yield _open
    for backend in opened:
        backend.close()


# --- damage helpers: reach the stored bytes of one page behind the backend's back -------------

def read_raw(backend: StorageBackend, key: bytes) -> bytes | None:
    if isinstance(backend, FileBackend):
        path = backend.root / key.hex()[:2] / key.hex()
        return path.read_bytes() if path.exists() else None
    assert isinstance(backend, RedisBackend)
    return backend.client.get(backend.redis_key(key))  # type: ignore[no-any-return]


def write_raw(backend: StorageBackend, key: bytes, raw: bytes) -> None:
    if isinstance(backend, FileBackend):
        path = backend.root / key.hex()[:2] / key.hex()
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(raw)
    else:
        assert isinstance(backend, RedisBackend)
        backend.client.set(backend.redis_key(key), raw)


# --- round trip --------------------------------------------------------------------------------

def test_round_trip_into_numpy_and_torch(open_backend: OpenBackend) -> None:
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(12), make_pages(12)
    assert backend.set(keys, list(pages)) == 12

    absent = make_keys(1, "absent")[0]
    assert backend.exists([*keys[:3], absent]) == [True, True, True, False]
    assert backend.leading_present([*keys[:5], absent, *keys[5:]]) == 5
    assert backend.leading_present(keys) == 12

    dest_np = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest_np)) == [True] * 12
    assert np.array_equal(dest_np, pages)

    dest_t = torch.zeros((12, PAGE), dtype=torch.uint8)
    order = [3, 0, 11, 7]
    got = backend.get_into([keys[i] for i in order] + [absent],
                           [dest_t[j].numpy() for j in range(5)])
    assert got == [True, True, True, True, False]
    for j, i in enumerate(order):
        assert torch.equal(dest_t[j], torch.from_numpy(pages[i]))

    stats = backend.stats()
    assert stats["pages_written"] == 12 and stats["bytes_written"] == 12 * PAGE
    assert stats["pages_read"] == 16 and stats["bytes_read"] == 16 * PAGE
    assert stats["misses"] == 1 and stats["corrupt_pages"] == 0
    assert stats["read_calls"] == 2 and stats["read_seconds_total"] > 0
    hist = backend.latency_histograms()
    assert hist["read"]["count"] == 2 and hist["write"]["count"] == 1
    assert hist["read"]["cumulative_counts"][-1] == 2

    assert backend.delete([keys[0], absent]) == 1
    assert backend.exists(keys[:2]) == [False, True]


def test_bad_arguments_raise_and_change_nothing(open_backend: OpenBackend) -> None:
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(3), make_pages(3)
    with pytest.raises(ValueError, match="key 1 is 31 bytes"):
        backend.set([keys[0], keys[1][:31], keys[2]], list(pages))
    with pytest.raises(ValueError, match="3 keys but 2 pages"):
        backend.set(keys, list(pages[:2]))
    with pytest.raises(ValueError, match="page 2 is 100 bytes"):
        backend.set(keys, [pages[0], pages[1], pages[2][:100]])
    with pytest.raises(TypeError, match="key 0 has type str"):
        backend.exists(["ab" * 16])  # type: ignore[list-item]
    assert backend.exists(keys) == [False, False, False]
    assert backend.stats()["pages_written"] == 0

    assert backend.set(keys, list(pages)) == 3
    with pytest.raises(ValueError, match="page 0 is a read-only buffer"):
        backend.get_into(keys[:1], [bytes(PAGE)])
    with pytest.raises(ValueError, match="page 1 is not a contiguous buffer"):
        backend.get_into(keys[:2], [bytearray(PAGE), np.zeros((PAGE, 2), np.uint8)[:, 0]])


# --- namespaces --------------------------------------------------------------------------------

def test_namespace_for_is_deterministic_and_separates_shapes() -> None:
    assert namespace_for(SHAPE, 0, 2) == namespace_for(dict(reversed(SHAPE.items())), 0, 2)
    assert re.fullmatch(r"[0-9a-f]{16}-tp2/r0", NS)
    names = {
        NS,
        namespace_for(SHAPE, 1, 2),
        namespace_for(SHAPE, 0, 4),
        namespace_for({**SHAPE, "head_dim": 128}, 0, 2),
        namespace_for({**SHAPE, "dtype": "bfloat16"}, 0, 2),
    }
    assert len(names) == 5
    with pytest.raises(ValueError, match="rank must be an int in"):
        namespace_for(SHAPE, 2, 2)
    with pytest.raises(ValueError, match="field 'layers' has type list"):
        namespace_for({"layers": [1]}, 0, 1)
    with pytest.raises(ValueError, match="namespace"):
        FileBackend("/tmp", "../escape", secret=SECRET)


def test_namespaces_isolate_and_same_namespace_shares(open_backend: OpenBackend) -> None:
    keys, pages = make_keys(4), make_pages(4, seed=1)
    writer = open_backend(NS, page_bytes=PAGE)
    assert writer.set(keys, list(pages)) == 4

    # A second backend object on the same namespace: another kvtier instance, same model.
    other_instance = open_backend(NS, page_bytes=PAGE)
    dest = np.zeros_like(pages)
    assert other_instance.get_into(keys, list(dest)) == [True] * 4
    assert np.array_equal(dest, pages)

    for namespace in (
        namespace_for(SHAPE, 1, 2),  # other rank
        namespace_for(SHAPE, 0, 4),  # other TP layout
        namespace_for({**SHAPE, "num_layers": 16}, 0, 2),  # other model shape
    ):
        foreign = open_backend(namespace, page_bytes=PAGE)
        assert foreign.exists(keys) == [False] * 4
        assert foreign.leading_present(keys) == 0
        assert foreign.get_into(keys, list(np.zeros_like(pages))) == [False] * 4


# --- corruption --------------------------------------------------------------------------------

def _flip(offset: int) -> Callable[[bytes], bytes]:
    def damage(raw: bytes) -> bytes:
        b = bytearray(raw)
        b[offset] ^= 0x40
        return bytes(b)
    return damage


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "payload_byte": _flip(HEADER_BYTES + 1000),
    "last_payload_byte": _flip(HEADER_BYTES + PAGE - 1),
    "magic": _flip(0),
    "version": _flip(4),
    "key": _flip(8 + 5),
    "length": _flip(40),
    "mac": _flip(60),
    "truncated_payload": lambda raw: raw[:-1],
    "truncated_header": lambda raw: raw[:30],
    "empty": lambda raw: b"",
    "extended": lambda raw: raw + b"\0",
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_page_is_a_counted_miss(open_backend: OpenBackend, damage: str) -> None:
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(3, damage), make_pages(3, seed=2)
    assert backend.set(keys, list(pages)) == 3
    raw = read_raw(backend, keys[1])
    assert raw is not None and len(raw) == HEADER_BYTES + PAGE
    write_raw(backend, keys[1], DAMAGES[damage](raw))

    dest = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest)) == [True, False, True]
    assert np.array_equal(dest[0], pages[0]) and np.array_equal(dest[2], pages[2])
    stats = backend.stats()
    assert stats["corrupt_pages"] == 1 and stats["misses"] == 1
    assert read_raw(backend, keys[1]) is None  # deleted, so it is not offered again
    assert backend.exists(keys) == [True, False, True]


@pytest.mark.parametrize("damage", ["truncated_payload", "truncated_header", "extended"])
def test_file_page_of_the_wrong_size_is_deleted_by_the_query(tmp_path: Path, damage: str) -> None:
    """A query (before any read) refuses a page file of the wrong size, counts it and deletes
    it, so the next query does not meet it again."""
    backend = FileBackend(tmp_path / "store", NS, secret=SECRET, page_bytes=PAGE)
    keys, pages = make_keys(3, damage), make_pages(3, seed=4)
    assert backend.set(keys, list(pages)) == 3
    raw = read_raw(backend, keys[1])
    assert raw is not None
    write_raw(backend, keys[1], DAMAGES[damage](raw))
    assert backend.leading_present(keys) == 1
    assert backend.stats()["corrupt_pages"] == 1
    assert read_raw(backend, keys[1]) is None
    assert backend.exists(keys) == [True, False, True]
    assert backend.stats()["corrupt_pages"] == 1  # counted once: the file is gone
    backend.close()


def test_page_stored_under_another_key_is_a_miss(open_backend: OpenBackend) -> None:
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(2, "swap"), make_pages(2, seed=3)
    assert backend.set(keys[:1], [pages[0]]) == 1
    raw = read_raw(backend, keys[0])
    assert raw is not None
    write_raw(backend, keys[1], raw)  # intact page, wrong name
    assert backend.get_into([keys[1]], [np.zeros(PAGE, np.uint8)]) == [False]
    assert backend.stats()["corrupt_pages"] == 1


def test_page_format_statuses() -> None:
    key = make_keys(1)[0]
    payload = make_pages(1, 256)[0]
    codec = PageCodec(SECRET, NS)
    page = codec.encode_page(key, payload)
    assert len(page) == HEADER_BYTES + 256 and HEADER_BYTES == 80
    dest = bytearray(256)
    assert codec.decode_into(key, page, memoryview(dest)) is PageStatus.OK
    assert dest == payload.tobytes()
    untouched = bytearray(256)
    decode = codec.decode_into
    assert decode(key, page[:-1], memoryview(untouched)) is PageStatus.TRUNCATED
    assert decode(key, page + b"x", memoryview(untouched)) is PageStatus.TOO_LONG
    assert decode(make_keys(2)[1], page, memoryview(untouched)) is PageStatus.BAD_KEY
    bad = bytearray(page)
    bad[-1] ^= 1
    assert decode(key, bytes(bad), memoryview(untouched)) is PageStatus.BAD_MAC
    # the same bytes under another secret or in another namespace are not authentic
    other_secret = PageCodec(b"another-storage-secret-0002", NS)
    assert other_secret.decode_into(key, page, memoryview(untouched)) is PageStatus.BAD_MAC
    other_ns = PageCodec(SECRET, namespace_for(SHAPE, 1, 2))
    assert other_ns.decode_into(key, page, memoryview(untouched)) is PageStatus.BAD_MAC
    assert untouched == bytearray(256)
    assert decode(key, page, memoryview(bytearray(255))) is PageStatus.TOO_LONG
    assert "SECRET" not in repr(codec) and SECRET.hex() not in repr(codec)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PageCodec(b"short", NS)


# --- authentication ------------------------------------------------------------------------------

def _v1_page(key: bytes, payload: bytes) -> bytes:
    """A page of format version 1 (64-byte header, xxh3-128 checksum, no MAC): what kvtier
    wrote before pages were authenticated."""
    import struct

    import xxhash

    header = struct.pack("<4sHH32sQ16s", b"KVTP", 1, 64, key, len(payload),
                         xxhash.xxh3_128_digest(payload))
    return header + payload


def _forge(raw: bytes, evil: bytes) -> bytes:
    """What someone who can write the store but lacks the secret can do: keep the header of a
    genuine page, put their own payload in and recompute the integrity field as well as they
    can (an unkeyed BLAKE2b of the same input, and the version 1 checksum)."""
    import hashlib as _hashlib

    prefix = raw[:48]
    mac = _hashlib.blake2b(prefix + evil, digest_size=32).digest()
    return prefix + mac + evil


def test_forged_page_with_a_recomputed_checksum_is_refused(open_backend: OpenBackend) -> None:
    """A page whose payload was replaced by someone without the secret (a file edited in the
    storage folder, a value SET by another Redis client), with a recomputed checksum, is a
    counted miss: its bytes never reach the destination."""
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(3, "forge"), make_pages(3, seed=7)
    assert backend.set(keys, list(pages)) == 3
    raw = read_raw(backend, keys[1])
    assert raw is not None
    evil = bytes([0x5A]) * PAGE
    write_raw(backend, keys[1], _forge(raw, evil))  # Redis: SET by a plain, keyless client
    dest = np.zeros_like(pages)
    # a miss leaves its destination unspecified (the file backend reads into it before the
    # check); what matters is that it is reported as a miss, so the caller never uses it
    assert backend.get_into(keys, list(dest)) == [True, False, True]
    assert np.array_equal(dest[0], pages[0]) and np.array_equal(dest[2], pages[2])
    stats = backend.stats()
    assert stats["corrupt_pages"] == 1 and stats["misses"] == 1
    assert read_raw(backend, keys[1]) is None  # dropped: not offered again


def test_forged_page_under_a_guessed_secret_is_refused(open_backend: OpenBackend) -> None:
    """A page correctly encoded by kvtier's own code under another secret (a forger who knows
    the format but not the secret) is refused too."""
    backend = open_backend(page_bytes=PAGE)
    key = make_keys(1, "guess")[0]
    evil = make_pages(1, seed=8)[0]
    write_raw(backend, key, PageCodec(b"guessed-secret-000000000", backend.namespace)
              .encode_page(key, evil))
    dest = np.zeros(PAGE, np.uint8)
    assert backend.get_into([key], [dest]) == [False]
    assert backend.stats()["corrupt_pages"] == 1


def test_instances_with_one_secret_share_pages_another_secret_misses_them_all(
        open_backend: OpenBackend) -> None:
    writer = open_backend(page_bytes=PAGE, secret=SECRET)
    keys, pages = make_keys(6, "secrets"), make_pages(6, seed=9)
    assert writer.set(keys, list(pages)) == 6

    same = open_backend(page_bytes=PAGE, secret=bytes(SECRET))  # a second instance
    dest = np.zeros_like(pages)
    assert same.get_into(keys, list(dest)) == [True] * 6
    assert np.array_equal(dest, pages) and same.stats()["corrupt_pages"] == 0

    stranger = open_backend(page_bytes=PAGE, secret=b"a-different-storage-secret-03")
    dest = np.zeros_like(pages)
    assert stranger.get_into(keys, list(dest)) == [False] * 6
    stats = stranger.stats()
    assert stats["corrupt_pages"] == 6 and stats["misses"] == 6 and stats["pages_read"] == 0


def test_pages_of_the_old_format_version_are_counted_misses(open_backend: OpenBackend) -> None:
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(2, "v1"), make_pages(2, seed=10)
    for key, page in zip(keys, pages, strict=True):
        write_raw(backend, key, _v1_page(key, page.tobytes()))
    dest = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest)) == [False, False]
    assert backend.stats()["corrupt_pages"] == 2
    assert [read_raw(backend, k) for k in keys] == [None, None]



def _v2_page(key: bytes, payload: bytes, secret: bytes, namespace: str) -> bytes:
    """A genuine page of format version 2 (80-byte header, keyed BLAKE2b-256 MAC under the same
    secret): what kvtier wrote before version 3 moved the MAC to keyed BLAKE3."""
    import hashlib
    import struct

    prefix = struct.pack("<4sHH32sQ", b"KVTP", 2, 80, key, len(payload))
    mac = hashlib.blake2b(key=secret, digest_size=32, person=b"kvtier-page-v2")
    encoded = namespace.encode()
    mac.update(struct.pack("<H", len(encoded)) + encoded + prefix + payload)
    return prefix + mac.digest() + payload


def test_authentic_pages_of_format_version_2_are_counted_misses(
        open_backend: OpenBackend) -> None:
    """A version 2 page with a MAC that was valid under this very secret is a counted miss
    after the move to version 3, never an error and never data."""
    backend = open_backend(page_bytes=PAGE)
    keys, pages = make_keys(2, "v2"), make_pages(2, seed=11)
    for key, page in zip(keys, pages, strict=True):
        write_raw(backend, key, _v2_page(key, page.tobytes(), SECRET, backend.namespace))
    dest = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest)) == [False, False]
    assert backend.stats()["corrupt_pages"] == 2
    assert [read_raw(backend, k) for k in keys] == [None, None]


# --- clear -------------------------------------------------------------------------------------

def test_clear_only_clears_its_namespace(open_backend: OpenBackend, backend_kind: str) -> None:
    keys, pages = make_keys(5, "clear"), make_pages(5, seed=4)
    mine = open_backend(NS, page_bytes=PAGE)
    neighbours = [
        open_backend(namespace_for(SHAPE, 1, 2), page_bytes=PAGE),
        open_backend(f"{NS}/ab", page_bytes=PAGE),  # nested under mine on disk
        open_backend(f"{NS}x", page_bytes=PAGE),  # shares mine as a string prefix
    ]
    for backend in (mine, *neighbours):
        assert backend.set(keys, list(pages)) == 5
    # Something that is not a kvtier page, in the same store.
    if isinstance(mine, RedisBackend):
        raw = mine.client
        raw.set(b"other-app:key", b"v")
    else:
        assert isinstance(mine, FileBackend)
        (mine.root / "notes.txt").write_text("operator notes")

    assert mine.clear() == 5
    assert mine.exists(keys) == [False] * 5
    for backend in neighbours:
        assert backend.exists(keys) == [True] * 5
        assert backend.get_into(keys, list(np.zeros_like(pages))) == [True] * 5
    if isinstance(mine, RedisBackend):
        assert raw.get(b"other-app:key") == b"v"
    else:
        assert (mine.root / "notes.txt").read_text() == "operator notes"
    assert mine.set(keys[:1], [pages[0]]) == 1  # usable after clear
    if backend_kind == "file":
        assert mine.stats()["used_bytes"] == HEADER_BYTES + PAGE


# --- file backend: capacity, LRU, atomic writes, restart ----------------------------------------

def list_all(backend: StorageBackend, count: int) -> tuple[list[bytes], int]:
    """Every key a listing in batches of about `count` gives, and how many batches."""
    keys: list[bytes] = []
    cursor, batches = 0, 0
    while True:
        got, cursor = backend.list_keys(cursor, count)
        keys.extend(got)
        batches += 1
        assert batches < 10_000, "the listing never ends"
        if cursor == 0:
            return keys, batches


def test_listing_gives_every_page_of_its_namespace_and_nothing_else(
        open_backend: OpenBackend, backend_kind: str) -> None:
    """The index of what storage holds is filled from this listing: every page of the
    namespace (written by any instance), none of another namespace, none deleted; in bounded
    batches with a cursor (a cluster: every primary in turn)."""
    mine, theirs, other = open_backend(), open_backend(), open_backend(NS + "-other")
    keys, pages = make_keys(300, "list"), make_pages(300, 1024)
    assert mine.set(keys[:200], list(pages[:200])) == 200
    assert theirs.set(keys[200:], list(pages[200:])) == 100  # another instance's pages
    assert other.set(make_keys(5, "elsewhere"), list(pages[:5])) == 5
    assert mine.delete(keys[:10]) == 10
    listed, batches = list_all(mine, 16)
    assert set(listed) == set(keys[10:]), len(set(listed))
    assert batches > 1  # bounded batches, not one answer of everything
    assert mine.stats()["errors_list"] == 0
    assert list_all(other, 1000)[0] and not set(list_all(other, 1000)[0]) & set(keys)
    with pytest.raises(ValueError, match="cursor"):
        mine.list_keys(-1, 10)
    mine.clear()
    assert list_all(theirs, 1000)[0] == []


def test_listing_during_a_redis_outage_is_a_counted_error(redis_server: RedisServer) -> None:
    """An outage ends a listing at once and counts `errors_list` (the worker then answers
    that it cannot list: the manager's index stays incomplete)."""
    with RedisBackend(f"redis://127.0.0.1:{free_port()}/0", "down/r0", secret=SECRET,
                      timeout_s=0.2) as down:
        assert down.list_keys(0, 100) == ([], 0)
        assert down.stats()["errors_list"] == 1


def _files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_file_capacity_evicts_least_recently_used(tmp_path: Path) -> None:
    size = 4096
    page_file = HEADER_BYTES + size
    backend = FileBackend(tmp_path, NS, secret=SECRET, capacity_bytes=4 * page_file,
                          page_bytes=size)
    keys, pages = make_keys(6, "lru"), make_pages(6, size, seed=5)
    # One batch is a prefix in order: its tail is least recent (k3, k2, k1, k0).
    assert backend.set(keys[:4], list(pages[:4])) == 4
    assert backend.get_into([keys[3]], [np.zeros(size, np.uint8)]) == [True]  # k3 now recent
    assert backend.set([keys[4]], [pages[4]]) == 1
    assert backend.exists(keys[:5]) == [True, True, False, True, True]
    stats = backend.stats()
    assert stats["evicted_pages"] == 1 and stats["used_bytes"] == 4 * page_file
    assert backend.set([keys[5]], [pages[5]]) == 1  # next victim: k1
    assert backend.exists(keys) == [True, False, False, True, True, True]
    assert all(re.fullmatch(r"[0-9a-f]{64}", n) for n in _files(backend.root))  # no temp files
    backend.close()

    with pytest.raises(ValueError, match="cannot hold one page"):
        FileBackend(tmp_path, NS, secret=SECRET, capacity_bytes=size, page_bytes=size)


def test_file_index_rebuilt_from_disk_by_mtime(tmp_path: Path) -> None:
    size = 4096
    page_file = HEADER_BYTES + size
    keys, pages = make_keys(4, "mtime"), make_pages(4, size, seed=6)
    writer = FileBackend(tmp_path, NS, secret=SECRET, page_bytes=size)
    assert writer.set(keys, list(pages)) == 4
    writer.close()
    now = time.time()
    for age, key in zip((100, 400, 300, 200), keys, strict=True):  # k1 oldest, then k2
        path = writer.root / key.hex()[:2] / key.hex()
        os.utime(path, (now - age, now - age))
    stale = writer.root / "00" / ".tmp-dead-writer"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"partial")
    os.utime(stale, (now - 3600, now - 3600))

    # Reading k1 refreshes its (old) mtime on disk, so it survives the restart below.
    reader = FileBackend(tmp_path, NS, secret=SECRET, page_bytes=size)
    assert not stale.exists()
    assert reader.get_into([keys[1]], [np.zeros(size, np.uint8)]) == [True]
    reader.close()

    second = FileBackend(tmp_path, NS, secret=SECRET, capacity_bytes=3 * page_file,
                         page_bytes=size)
    assert second.exists(keys) == [True, True, False, True]  # k2 was the oldest
    assert second.stats()["used_bytes"] == 3 * page_file
    dest = np.zeros((4, size), np.uint8)
    assert second.get_into(keys, list(dest)) == [True, True, False, True]
    assert np.array_equal(dest[[0, 1, 3]], pages[[0, 1, 3]])


def test_file_io_errors_degrade_to_misses_and_failed_writes(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, NS, secret=SECRET, page_bytes=PAGE)
    keys, pages = make_keys(2, "io-error"), make_pages(2, seed=10)
    # A regular file where a key's shard directory should be: every open under it fails.
    blocker = backend.root / keys[0].hex()[:2]
    blocker.write_bytes(b"not a directory")
    assert keys[1].hex()[:2] != keys[0].hex()[:2]
    assert backend.set(keys, list(pages)) == 1
    dest = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest)) == [False, True]
    assert np.array_equal(dest[1], pages[1])
    stats = backend.stats()
    assert stats["errors_set"] == 1 and stats["errors_get"] == 1
    assert stats["pages_written"] == 1 and stats["misses"] == 1
    assert blocker.read_bytes() == b"not a directory"


def test_file_concurrent_writers_leave_whole_pages(tmp_path: Path) -> None:
    keys, pages = make_keys(32, "threads"), make_pages(32, seed=7)
    a = FileBackend(tmp_path, NS, secret=SECRET, page_bytes=PAGE, io_threads=1)
    b = FileBackend(tmp_path, NS, secret=SECRET, page_bytes=PAGE, io_threads=3)
    assert a.set(keys, list(pages)) == 32
    assert b.set(keys, list(pages)) == 32  # rewrite the same pages from another "process"
    dest = np.zeros_like(pages)
    assert a.get_into(keys, list(dest)) == [True] * 32
    assert np.array_equal(dest, pages)
    assert all(re.fullmatch(r"[0-9a-f]{64}", n) for n in _files(a.root))


# --- redis backend: TTL, outages ---------------------------------------------------------------

def test_redis_ttl(redis_server: RedisServer) -> None:
    raw = redis.Redis.from_url(redis_server.url)
    keys, pages = make_keys(2, "ttl"), make_pages(2, 1024)
    with RedisBackend(redis_server.url, "ttl-test/r0", secret=SECRET, ttl_s=100) as expiring:
        assert expiring.set(keys[:1], [pages[0]]) == 1
        assert 0 < raw.ttl(expiring.redis_key(keys[0])) <= 100
    with RedisBackend(redis_server.url, "ttl-test/r0", secret=SECRET) as forever:
        assert forever.set(keys[1:], [pages[1]]) == 1
        assert raw.ttl(forever.redis_key(keys[1])) == -1


def _timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.monotonic()
    result = fn()
    return result, time.monotonic() - start


def test_redis_outage_degrades_then_recovers_by_itself(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.storage")
    keys, pages = make_keys(8, "outage"), make_pages(8, seed=8)
    with RedisServer() as server:
        backend = RedisBackend(server.url, NS, secret=SECRET, page_bytes=PAGE, timeout_s=0.5,
                               backoff_s=0.1, backoff_max_s=0.4)
        assert backend.set(keys, list(pages)) == 8
        dest = np.zeros_like(pages)

        server.kill()
        calls: dict[str, Callable[[], object]] = {
            "get": lambda: backend.get_into(keys, list(dest)),
            "exists": lambda: backend.exists(keys),
            "leading": lambda: backend.leading_present(keys),
            "set": lambda: backend.set(keys, list(pages)),
            "delete": lambda: backend.delete(keys),
            "clear": backend.clear,
        }
        expected = {"get": [False] * 8, "exists": [False] * 8, "leading": 0, "set": 0,
                    "delete": 0, "clear": 0}
        for _ in range(2):  # first round: real failures; second: inside the backoff window
            for name, call in calls.items():
                result, elapsed = _timed(call)
                assert result == expected[name], name
                assert elapsed < 2.0, f"{name} took {elapsed:.2f}s during the outage"
            time.sleep(0.15)
        stats = backend.stats()
        for op in ("get", "exists", "set", "delete", "clear"):
            assert stats[f"errors_{op}"] >= 1, op
        assert stats["available"] == 0 and stats["outages"] == 1
        assert stats["pages_read"] == 0 and stats["misses"] >= 16
        warnings = [r for r in caplog.records if r.name == "kvtier.storage"]
        assert len(warnings) == 1, "an outage must not flood the log"
        assert "unavailable" in warnings[0].getMessage()

        server.restart()  # same port, empty (nothing persisted)
        assert server.url == backend.url
        wait_until(lambda: backend.set(keys, list(pages)) == 8, 5.0,
                   "writes to the restarted Redis")
        assert backend.get_into(keys, list(dest)) == [True] * 8
        assert np.array_equal(dest, pages)
        assert backend.stats()["available"] == 1
        backend.close()


def test_redis_frozen_server_times_out_instead_of_hanging() -> None:
    keys, pages = make_keys(4, "frozen"), make_pages(4, seed=9)
    with RedisServer() as server:
        backend = RedisBackend(server.url, NS, secret=SECRET, page_bytes=PAGE, timeout_s=0.3,
                               backoff_s=0.1, backoff_max_s=0.2)
        assert backend.set(keys, list(pages)) == 4
        server.pause()  # accepts connections, answers nothing
        try:
            dest = np.zeros_like(pages)
            # One socket timeout (0.3 s) per call, no hidden retries.
            got, elapsed = _timed(lambda: backend.get_into(keys, list(dest)))
            assert got == [False] * 4 and 0.25 < elapsed < 1.0, elapsed
            time.sleep(0.25)  # past the backoff window: the next call tries the network again
            written, elapsed = _timed(lambda: backend.set(keys, list(pages)))
            assert written == 0 and 0.25 < elapsed < 1.0, elapsed
            assert backend.stats()["errors_get"] >= 1
        finally:
            server.resume()
        wait_until(lambda: backend.get_into(keys, list(dest)) == [True] * 4, 5.0,
                   "reads from the resumed Redis")
        assert np.array_equal(dest, pages)
        backend.close()


def test_redis_unreachable_from_the_start_logs_no_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.storage")
    port = free_port()  # nothing listens there
    backend = RedisBackend(f"redis://:hunter2@127.0.0.1:{port}/0", NS, secret=SECRET,
                           page_bytes=PAGE)
    keys = make_keys(2, "unreachable")
    got, elapsed = _timed(lambda: backend.get_into(keys, list(make_pages(2))))
    assert got == [False, False] and elapsed < 2.0
    assert backend.stats()["errors_get"] == 1
    messages = [r.getMessage() for r in caplog.records if r.name == "kvtier.storage"]
    assert messages and all("hunter2" not in m for m in messages)
    assert ":***@127.0.0.1" in messages[0]
    backend.close()


# --- factory -----------------------------------------------------------------------------------

def test_make_backend(tmp_path: Path, redis_server: RedisServer) -> None:
    assert make_backend("none", namespace=NS, secret=SECRET) is None
    file_backend = make_backend("file", namespace=NS, secret=SECRET, path=str(tmp_path),
                                capacity_bytes=1 << 20)
    assert isinstance(file_backend, FileBackend) and file_backend.capacity_bytes == 1 << 20
    redis_backend = make_backend("redis", namespace=NS, secret=SECRET, url=redis_server.url,
                                 ttl_s=5)
    assert isinstance(redis_backend, RedisBackend) and redis_backend.ttl_s == 5
    assert redis_backend.exists(make_keys(1)) == [False]
    with pytest.raises(ValueError, match="'s3' is unknown; choose one of none, file, redis"):
        make_backend("s3", namespace=NS, secret=SECRET)
    with pytest.raises(ValueError, match="not a valid Redis URL"):
        make_backend("redis", namespace=NS, secret=SECRET, url="http://127.0.0.1:1")
    file_backend.close()
    redis_backend.close()


@pytest.mark.slow  # starts a 3-node Redis Cluster
def test_cluster_pages_spread_over_every_primary(redis_cluster: RedisClusterServers) -> None:
    """No hash tag pins a namespace to one slot: one batch's pages land on every node, and a
    batch read gathers them back in order."""
    backend = RedisBackend(redis_cluster.url, NS, secret=SECRET, page_bytes=PAGE)
    backend.client.flushall()
    keys, pages = make_keys(60, "spread"), make_pages(60, seed=11)
    assert backend.set(keys, list(pages)) == 60
    per_node = [redis.Redis(port=port).dbsize() for port in redis_cluster.ports]
    assert sum(per_node) == 60 and all(n > 0 for n in per_node), per_node
    dest = np.zeros_like(pages)
    assert backend.get_into(keys, list(dest)) == [True] * 60
    assert np.array_equal(dest, pages)
    assert backend.clear() == 60
    assert [redis.Redis(port=port).dbsize() for port in redis_cluster.ports] == [0, 0, 0]
    backend.close()


@pytest.mark.slow  # a 3-node Redis Cluster of its own, and timeouts waited out
def test_stalled_cluster_node_costs_one_timeout_and_recovers() -> None:
    """A cluster node that accepts connections but answers nothing (SIGSTOP): each call
    costs at most one socket timeout (not one per command, as redis-py's own cluster retries
    would), the next ones fail fast, and the tier reads its pages again once the node is back.
    A cluster of its own: stalling a node of the shared one would disturb other tests."""
    with RedisClusterServers() as cluster:
        backend = RedisBackend(cluster.url, NS, secret=SECRET, page_bytes=PAGE, timeout_s=0.3,
                               backoff_s=0.1, backoff_max_s=0.2)
        keys, pages = make_keys(30, "stall"), make_pages(30, seed=12)
        assert backend.set(keys, list(pages)) == 30
        stalled = cluster.procs[1]
        os.kill(stalled.pid, signal.SIGSTOP)
        try:
            dest = np.zeros_like(pages)
            got, elapsed = _timed(lambda: backend.get_into(keys, list(dest)))
            assert got == [False] * 30 and elapsed < 0.9, elapsed
            got, elapsed = _timed(lambda: backend.get_into(keys, list(dest)))
            assert got == [False] * 30 and elapsed < 0.1, elapsed  # fail fast in the window
            time.sleep(0.25)
            written, elapsed = _timed(lambda: backend.set(keys, list(pages)))
            assert written < 30 and elapsed < 0.9, elapsed
            assert backend.stats()["outages"] == 1 and backend.stats()["available"] == 0
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        wait_until(lambda: backend.get_into(keys, list(dest)) == [True] * 30, 10.0,
                   "reads from the resumed cluster node")
        assert np.array_equal(dest, pages)
        assert backend.stats()["available"] == 1
        backend.close()


# ---------------------------------------------------------------------- trust (issue 11 item 9)


def test_file_storage_directories_are_private_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o000)
    try:
        backend = FileBackend(tmp_path / "store", "ns-tp1/r0", secret=SECRET, page_bytes=PAGE)
        backend.set(make_keys(1), list(make_pages(1)))
        backend.close()
    finally:
        os.umask(old)
    made = [tmp_path / "store", tmp_path / "store" / "ns-tp1", tmp_path / "store/ns-tp1/r0",
            *(p for p in (tmp_path / "store/ns-tp1/r0").iterdir() if p.is_dir())]
    assert len(made) == 4
    assert {oct(p.stat().st_mode & 0o777) for p in made} == {oct(0o700)}


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_file_storage_refuses_a_directory_others_can_write(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ValueError, match=r"writable by group or others .*chmod go-w"):
        FileBackend(shared, "ns-tp1/r0", secret=SECRET, page_bytes=PAGE)


def test_file_storage_refuses_a_directory_another_user_owns(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 4242, 4242)  # the tests run as root (the README's machine)
    with pytest.raises(ValueError, match=r"owned by uid 4242, not by this user"):
        FileBackend(theirs, "ns-tp1/r0", secret=SECRET, page_bytes=PAGE)


def test_redis_acl_user_url_works_and_its_password_is_never_shown(
        redis_server: RedisServer) -> None:
    admin = redis.Redis.from_url(redis_server.url)
    admin.acl_setuser("kvtier-acl", enabled=True, passwords=["+s3cret-pw"],
                      categories=["+@all"], keys=["*"])
    try:
        url = redis_server.url.replace("redis://", "redis://kvtier-acl:s3cret-pw@", 1)
        backend = make_backend("redis", namespace="acl-tp1/r0", secret=SECRET, url=url,
                               page_bytes=PAGE)
        assert backend is not None
        keys, pages = make_keys(2, "acl"), make_pages(2)
        assert backend.set(keys, list(pages)) == 2
        dest = np.zeros_like(pages)
        assert backend.get_into(keys, list(dest)) == [True, True]
        assert np.array_equal(dest, pages)
        backend.close()
        bad = make_backend("redis", namespace="acl-tp1/r0", secret=SECRET, page_bytes=PAGE,
                           url=url.replace("s3cret-pw", "wrong-pw"))  # refused: misses
        assert bad is not None and bad.get_into(keys, list(dest)) == [False, False]
        bad.close()
        with pytest.raises(ValueError) as err:
            make_backend("redis", namespace="acl-tp1/r0", secret=SECRET, page_bytes=PAGE,
                         url="redis://kvtier-acl:s3cret-pw@127.0.0.1:notaport/0")
        assert "s3cret-pw" not in str(err.value)
    finally:
        admin.acl_deluser("kvtier-acl")
