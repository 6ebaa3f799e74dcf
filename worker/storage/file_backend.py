"""The embedded storage tier: one file per page under a local directory.

Layout: `<path>/<namespace>/<first two hex digits of the key>/<64 hex digits of the key>`. The
two-digit shard keeps directories small (256 of them) so lookups stay fast with millions of
pages.

Why this is safe without fsync: a write goes to a temp file in the page's own directory and is
published with `os.replace`, so a reader sees either the old page, no page, or the whole new
one. If the machine loses power before the data reaches the disk, the renamed file may hold
zeros or a prefix of the page; the header's length and MAC turn that into a miss, and the
reader deletes it. Durability of a cache page is not worth an fsync per block. The MAC (keyed
with the storage secret) also turns a page forged or edited by anyone else who can write the
folder into a miss.

Reads go straight into the caller's buffer: one vectored `readv` fills a small header buffer,
the destination page, and one spare byte (which proves the file is not longer than it should
be), then the payload is verified in place.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from kvtier.worker.storage.backend import (
    Buffer,
    RateLimitedLog,
    StorageBackend,
    check_keys,
    log,
    refusals,
)
from kvtier.worker.storage.page_crypto import PageKeys, make_codec
from kvtier.worker.storage.page_format import HEADER_BYTES, PageStatus

# Threads one read batch is spread over, the caller included (a write batch: the caller only).
# Neither copying a page out of the page cache nor verifying its MAC (keyed BLAKE3 over every
# byte) holds the GIL, so two threads overlap one page's MAC with the next page's copy (see
# bench/storage.py for the measurement).
DEFAULT_IO_THREADS = 2

_PAGE_NAME = re.compile(r"^[0-9a-f]{64}$")
_SHARD_NAME = re.compile(r"^[0-9a-f]{2}$")
_TEMP_PREFIX = ".tmp-"
# A temp file older than this at start-up belongs to a writer that died mid-write.
STALE_TEMP_S = 600.0
# A read refreshes a page's on-disk mtime (its recency after a restart) only when the last
# refresh this process knows of is older than this: an mtime update dirties the inode, which
# would turn every read into a metadata write. Restart order is thus exact to within a minute.
MTIME_REFRESH_S = 60.0

T = TypeVar("T")


class _Page:
    """Index entry of one page file: its size and the mtime (wall-clock seconds) it has on disk
    as far as this process knows."""

    __slots__ = ("mtime", "size")

    def __init__(self, size: int, mtime: float) -> None:
        self.size = size
        self.mtime = mtime


def _advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The parts of `buffers` (filled in order) that remain after the first `done` bytes."""
    out = []
    for buf in buffers:
        if done >= buf.nbytes:
            done -= buf.nbytes
            continue
        out.append(buf[done:] if done else buf)
        done = 0
    return out


def _readv_full(fd: int, buffers: list[memoryview]) -> int:
    """Fill `buffers` in order from `fd` until they are full or the file ends; returns the
    number of bytes read."""
    total = 0
    remaining = [b for b in buffers if b.nbytes]
    while remaining:
        got = os.readv(fd, remaining)
        if got == 0:
            break
        total += got
        remaining = _advance(remaining, got)
    return total


def _read_page_file(fd: int, header: memoryview, dest: memoryview, spare: memoryview) -> int:
    """Read a page file into (header, dest) plus one spare byte that is filled only when the
    file is longer than a page; returns the bytes read. One `readv` does it: a regular file
    returns a short read only at end of file, so a read that filled header and payload is
    complete. A shorter one (a truncated file, or an interrupted read) continues until EOF."""
    buffers = [header, dest, spare]
    total = os.readv(fd, buffers)
    if total == 0 or total >= header.nbytes + dest.nbytes:
        return total
    return total + _readv_full(fd, _advance(buffers, total))


def _writev_full(fd: int, buffers: list[memoryview]) -> None:
    remaining = [b for b in buffers if b.nbytes]
    while remaining:
        put = os.writev(fd, remaining)
        remaining = _advance(remaining, put)


def _make_private_dirs(path: Path, namespace: str) -> None:
    """Create `path/namespace` with every directory kvtier creates mode 0700 whatever the
    umask, and refuse (ValueError) a directory of it not owned by this user or writable by
    group or others: pages read from there become KV that attention reads, so whoever can
    write them must be this user."""
    dirs = [path]
    for part in Path(namespace).parts:
        dirs.append(dirs[-1] / part)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        try:
            os.mkdir(d, 0o700)
            os.chmod(d, 0o700)  # mkdir applies the umask
        except FileExistsError:
            pass
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"storage path {str(d)!r} is not a directory")
        if st.st_uid != os.geteuid():
            raise ValueError(
                f"storage path {str(d)!r} is owned by uid {st.st_uid}, not by this user "
                f"(uid {os.geteuid()}): refusing to read pages anybody else may write")
        if st.st_mode & 0o022:
            raise ValueError(
                f"storage path {str(d)!r} is writable by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): refusing it (chmod go-w {str(d)!r})")


class FileBackend(StorageBackend):
    """Pages as files under `root = <path>/<namespace>`, with a byte capacity and LRU deletion.

    Data structures (all guarded by `_lock`):
    * `_lru`: OrderedDict hex key -> `_Page` (file size incl. header, known on-disk mtime),
      least recently used first. It lists the pages this process knows are on disk; it is
      rebuilt at start from the directory, ordered by file mtime (reads refresh the order, and
      the mtime at most once per `MTIME_REFRESH_S`, so recency survives a restart). Within
      one batch, earlier keys count as more recent (see `_touch_batch`).
    * `_used`: the sum of `_lru` sizes. Invariant after every call: `_used <= capacity_bytes`
      when a capacity is set (0 = unlimited), unless held pages alone (retention marks:
      pinned or within their TTL, `_marks`) that another process wrote and this one read
      exceed it; a write that cannot fit beside the held pages is refused.
    * `_marks` (the base class's `RetentionMarks`): what the manager asked to keep; the
      capacity eviction follows it (`_evict_locked`).
    * `_shards`: shard directories known to exist (saves a mkdir per write).
    Page bytes move outside the lock; a written page becomes visible (os.replace) and enters
    `_lru` under the lock, so the index and the directory agree for this process.

    Several processes may share one root (e.g. two instances of one model on one machine):
    each reads the other's pages (the directory is the truth), but each enforces the capacity
    only over pages it wrote or read, so the shared total can exceed one process's limit.
    """

    kind = "file"

    def __init__(
        self,
        path: str | os.PathLike[str],
        namespace: str,
        *,
        secret: bytes,
        capacity_bytes: int = 0,
        page_bytes: int | None = None,
        io_threads: int = DEFAULT_IO_THREADS,
        keys: PageKeys | None = None,
        compression: str = "none",
    ) -> None:
        super().__init__(namespace, page_bytes)
        self._codec = make_codec(secret, self.namespace, keys, compression)
        overhead = self._overhead = self._codec.overhead
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ValueError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0 = unlimited), got {capacity_bytes}")
        if page_bytes is not None and 0 < capacity_bytes < overhead + page_bytes:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} cannot hold one page "
                f"({overhead + page_bytes} bytes with its header)"
            )
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be an int >= 1, got {io_threads!r}")
        self.capacity_bytes = capacity_bytes
        self.root = Path(path) / namespace
        self._root_s = str(self.root)
        try:
            _make_private_dirs(Path(path), namespace)
        except OSError as exc:
            raise ValueError(f"storage path {str(self.root)!r} cannot be created: {exc}") from exc
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, _Page] = OrderedDict()
        self._used = 0
        self._shards: set[str] = set()
        self._temp_ids = itertools.count()
        self._pool = (
            ThreadPoolExecutor(io_threads - 1, thread_name_prefix="kvtier-file-io")
            if io_threads > 1
            else None
        )
        self._io_threads = io_threads
        self._closed = False
        self._warn = RateLimitedLog(log, 30.0)
        self._stats.add(evicted_pages=0, retained_full_refusals=0)
        self._rebuild()

    # -- start-up --------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Index the pages already on disk, oldest mtime first, remove temp files left by
        writers that died, and enforce the capacity."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.root) as shards:
            for shard in shards:
                if not (_SHARD_NAME.match(shard.name) and shard.is_dir(follow_symlinks=False)):
                    continue
                self._shards.add(shard.name)
                with os.scandir(shard.path) as entries:
                    for entry in entries:
                        if not entry.is_file(follow_symlinks=False):
                            continue
                        st = entry.stat(follow_symlinks=False)
                        if _PAGE_NAME.match(entry.name):
                            found.append((st.st_mtime, entry.name, st.st_size))
                        elif (
                            entry.name.startswith(_TEMP_PREFIX)
                            and now - st.st_mtime > STALE_TEMP_S
                        ):
                            self._unlink_quietly(entry.path)
        found.sort()
        with self._lock:
            for mtime, name, size in found:
                self._lru[name] = _Page(size, mtime)
                self._used += size
            victims = self._evict_locked()
        self._stats.add(evicted_pages=victims)

    # -- paths and small helpers -------------------------------------------------------------
    def _page_path(self, hexkey: str) -> str:
        return f"{self._root_s}/{hexkey[:2]}/{hexkey}"

    @staticmethod
    def _unlink_quietly(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def _evict_locked(self, spare: str = "") -> int:
        """Delete pages until the capacity holds. Caller holds `_lock`. Without retention
        marks: least recently used first. With them (`_victims_locked`): pages of priority
        < 0, then unmarked pages least recently used first, then pages of priority > 0;
        never a held one (pinned or within its TTL), nor `spare` (the page being written:
        if only it could go, the write is refused instead)."""
        if not self.capacity_bytes or self._used <= self.capacity_bytes:
            return 0
        evicted = 0
        if self._marks:
            victims = self._victims_locked(self._used - self.capacity_bytes, spare)
        else:
            victims = []
            need = self._used - self.capacity_bytes
            for hexkey, page in self._lru.items():
                if need <= 0:
                    break
                if hexkey == spare:
                    continue
                victims.append(hexkey)
                need -= page.size
        for hexkey in victims:
            page = self._lru.pop(hexkey)
            self._used -= page.size
            # A page that cannot be deleted (permissions changed under us) leaves the index
            # anyway; the next start re-indexes it and tries again.
            with contextlib.suppress(OSError):
                self._unlink_quietly(self._page_path(hexkey))
            evicted += 1
        return evicted

    def _victims_locked(self, need: int, spare: str) -> list[str]:
        """The pages to delete to free `need` bytes, in retention order (see
        `_evict_locked`); fewer when held pages are all that is left. Marked pages met in
        the LRU walk move to its young end, so held pages at its old end are passed over
        once, not at every eviction (a page whose retention ends re-enters LRU order from
        about when it was last passed over)."""
        marked, low, high = self._marks.eviction_plan(time.monotonic())
        lru = self._lru
        out: list[str] = []
        passed: list[str] = []
        for hexkey in low:
            if need <= 0:
                return out
            page = lru.get(hexkey)
            if page is not None and hexkey != spare:
                out.append(hexkey)
                need -= page.size
        for hexkey, page in lru.items():
            if need <= 0:
                break
            if hexkey in marked:
                passed.append(hexkey)
                continue
            if hexkey == spare:
                continue
            out.append(hexkey)
            need -= page.size
        for hexkey in passed:
            lru.move_to_end(hexkey)
        for hexkey in high:
            if need <= 0:
                break
            page = lru.get(hexkey)
            if page is not None and hexkey != spare:
                out.append(hexkey)
                need -= page.size
        return out

    def _forget_locked(self, hexkey: str) -> None:
        page = self._lru.pop(hexkey, None)
        if page is not None:
            self._used -= page.size

    def _ensure_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _map(self, fn: Callable[[int, int], list[T]], n: int) -> list[T]:
        """Run `fn(start, stop)` over [0, n) split into `io_threads` contiguous ranges, the
        last one in the calling thread, and concatenate the results in order."""
        parts = min(self._io_threads, n)
        if self._pool is None or parts < 2:
            return fn(0, n)
        bounds = [n * i // parts for i in range(parts + 1)]
        futures = [self._pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(parts - 1)]
        last = fn(bounds[parts - 1], n)
        out: list[T] = []
        for future in futures:
            out.extend(future.result())
        out.extend(last)
        return out

    # -- reads -----------------------------------------------------------------------------
    def _read_range(
        self, keys: list[bytes], hexkeys: list[str], dests: list[memoryview], lo: int, hi: int
    ) -> list[str]:
        """Read and verify pages lo..hi-1 into their destinations. Returns per page "" (hit),
        "absent", a `PageStatus` value (corrupt: already deleted and un-indexed) or
        "error: ..." (an I/O error). This is the prefetch hot path: one open, one readv, one
        MAC and one close per page; index updates are applied once per range."""
        out: list[str] = []
        hits: list[tuple[str, int, bool]] = []  # (hexkey, file size, mtime refreshed)
        header = bytearray(HEADER_BYTES)
        header_view = memoryview(header)
        spare = memoryview(bytearray(1))
        # an encrypted page's ciphertext + tag land here, then decrypt into the destination
        in_place = self._codec.in_place
        scratch = None if in_place else memoryview(
            bytearray(max((dests[i].nbytes for i in range(lo, hi)), default=0)
                      + self._overhead - HEADER_BYTES))
        now = time.time()
        flags = os.O_RDONLY | os.O_CLOEXEC
        verify_split = self._codec.verify_split
        lru_get = self._lru.get  # unlocked reads are hints only; the index is updated below
        for i in range(lo, hi):
            hexkey = hexkeys[i]
            path = f"{self._root_s}/{hexkey[:2]}/{hexkey}"
            try:
                fd = os.open(path, flags)
            except FileNotFoundError:
                out.append("absent")
                continue
            except OSError as exc:
                out.append(f"error: {exc}")
                continue
            try:
                dest = dests[i]
                body = dest if scratch is None else scratch[
                    :dest.nbytes + self._overhead - HEADER_BYTES]
                total = _read_page_file(fd, header_view, body, spare)
                status = verify_split(keys[i], header, body, total, dest)
                if status is PageStatus.OK:
                    known = lru_get(hexkey)
                    refreshed = False
                    if known is None or now - known.mtime >= MTIME_REFRESH_S:
                        with contextlib.suppress(OSError):
                            os.utime(fd)  # recency that survives a restart
                            refreshed = True
                    hits.append((hexkey, total, refreshed))
                    out.append("")
                else:
                    self._drop_corrupt(path, hexkey, os.fstat(fd).st_ino)
                    out.append(status.value)
            except OSError as exc:
                out.append(f"error: {exc}")
            finally:
                os.close(fd)
        with self._lock:
            for hexkey, size, refreshed in hits:
                page = self._lru.get(hexkey)
                if page is not None:
                    if refreshed:
                        page.mtime = now
                else:  # written by another process sharing this root
                    self._lru[hexkey] = _Page(size, now)
                    self._used += size
            for i, why in enumerate(out, start=lo):
                if why == "absent":
                    self._forget_locked(hexkeys[i])
            evicted = self._evict_locked()
        if evicted:
            self._stats.add(evicted_pages=evicted)
        return out

    def _touch_batch(self, hexkeys: list[str]) -> None:
        """Make the pages of one batch the most recently used, the first key last: a batch
        is a prefix in order, and its tail is worth less than its head (without the head the
        tail is unreachable), so within a batch later pages are evicted first."""
        with self._lock:
            for hexkey in reversed(hexkeys):
                if hexkey in self._lru:
                    self._lru.move_to_end(hexkey)

    def _drop_corrupt(self, path: str, hexkey: str, inode: int) -> None:
        """Delete a damaged page, unless a writer replaced it since it was opened."""
        with self._lock:
            try:
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            self._forget_locked(hexkey)

    def get_into(self, keys: Sequence[bytes], dests: Sequence[Buffer]) -> list[bool]:
        self._ensure_open()
        keys_b, views = self._check_pages(keys, dests, writable=True, what="destination buffers")
        hexkeys = [k.hex() for k in keys_b]
        start = time.perf_counter()

        def run(lo: int, hi: int) -> list[str]:
            return self._read_range(keys_b, hexkeys, views, lo, hi)

        outcomes = self._map(run, len(keys_b))
        hits = [not why for why in outcomes]
        self._touch_batch([h for h, ok in zip(hexkeys, hits, strict=True) if ok])
        errors = [why for why in outcomes if why.startswith("error: ")]
        corrupt = [
            i for i, why in enumerate(outcomes) if why and why != "absent" and why[:7] != "error: "
        ]
        pages = sum(hits)
        self._stats.add(
            pages_read=pages,
            bytes_read=sum(v.nbytes for v, ok in zip(views, hits, strict=True) if ok),
            misses=len(hits) - pages,
            errors_get=len(errors),
            **refusals([outcomes[i] for i in corrupt]),
        )
        self._stats.observe("read", time.perf_counter() - start)
        if corrupt:
            i = corrupt[0]
            self._warn.warning(
                f"file storage {self.namespace}: {len(corrupt)} corrupt page(s) deleted "
                f"(first: key {keys_b[i].hex()[:16]}..., {outcomes[i]})"
            )
        if errors:
            self._warn.warning(f"file storage {self.namespace}: read failed: {errors[0][7:]}")
        return hits

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._ensure_open()
        keys_b = check_keys(keys)
        return [self._present(k.hex()) for k in keys_b]

    def leading_present(self, keys: Sequence[bytes]) -> int:
        self._ensure_open()
        keys_b = check_keys(keys)
        count = 0
        for key in keys_b:
            if not self._present(key.hex()):
                break
            count += 1
        return count

    def _present(self, hexkey: str) -> bool:
        """A page file exists with a plausible size; its MAC (or GCM tag) is verified on read.
        Pages are renamed into place whole, so a wrong size can only be a damaged page: it is
        counted and deleted here rather than offered to a prefetch. Encrypted pages may be
        shorter (compressed, `storage.compression`, by this or another writer): for them only
        a file longer than a whole page, or too short for a header and tag, is refused here;
        a truncated one is refused by its tag when read."""
        path = self._page_path(hexkey)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._stats.add(errors_exists=1)
            self._warn.warning(f"file storage {self.namespace}: stat failed: {exc}")
            return False
        if self.page_bytes is None:
            plausible = st.st_size >= self._overhead
        elif self._codec.variable:  # a compressed page is shorter; its tag is checked on read
            plausible = HEADER_BYTES < st.st_size <= self._overhead + self.page_bytes
        else:
            plausible = st.st_size == self._overhead + self.page_bytes
        if not plausible:
            self._drop_corrupt(path, hexkey, st.st_ino)
            self._stats.add(corrupt_pages=1)
            self._warn.warning(
                f"file storage {self.namespace}: page {hexkey[:16]}... has {st.st_size} bytes; "
                "deleted as damaged"
            )
        return plausible

    # -- writes ----------------------------------------------------------------------------
    def _ensure_shard(self, shard: str) -> None:
        if shard in self._shards:
            return
        shard_path = os.path.join(self.root, shard)
        try:
            os.mkdir(shard_path, 0o700)
            os.chmod(shard_path, 0o700)  # mkdir applies the umask
        except FileExistsError:
            pass
        with self._lock:
            self._shards.add(shard)

    def _write_one(self, key: bytes, payload: memoryview) -> None:
        hexkey = key.hex()
        parts = [memoryview(p) for p in self._codec.encode_parts(key, payload)]
        size = sum(p.nbytes for p in parts)  # a compressed page is shorter
        if self.capacity_bytes and size > self.capacity_bytes:
            raise OSError(f"page of {size} bytes exceeds capacity_bytes={self.capacity_bytes}")
        self._ensure_shard(hexkey[:2])
        final = self._page_path(hexkey)
        temp = os.path.join(
            self.root,
            hexkey[:2],
            f"{_TEMP_PREFIX}{hexkey[:16]}-{os.getpid()}-{next(self._temp_ids)}",
        )
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:  # shard removed behind our back: recreate once
            with self._lock:
                self._shards.discard(hexkey[:2])
            self._ensure_shard(hexkey[:2])
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        full = False
        try:
            try:
                _writev_full(fd, parts)
            finally:
                os.close(fd)
            with self._lock:
                os.replace(temp, final)
                self._forget_locked(hexkey)
                self._lru[hexkey] = _Page(size, time.time())
                self._used += size
                evicted = self._evict_locked(spare=hexkey)
                if self.capacity_bytes and self._used > self.capacity_bytes:
                    # every other page is held (pinned or within its TTL): refuse this one
                    # rather than break the capacity (as a pin over quota is refused)
                    self._forget_locked(hexkey)
                    self._unlink_quietly(final)
                    full = True
        except BaseException:
            self._unlink_quietly(temp)
            raise
        if evicted:
            self._stats.add(evicted_pages=evicted)
        if full:
            self._stats.add(retained_full_refusals=1)
            raise OSError(f"capacity_bytes={self.capacity_bytes} is held by retained pages "
                          "(pinned or within their TTL): page not written")

    def set(self, keys: Sequence[bytes], pages: Sequence[Buffer]) -> int:
        self._ensure_open()
        keys_b, views = self._check_pages(keys, pages, writable=False, what="pages")
        start = time.perf_counter()

        def run(lo: int, hi: int) -> list[str]:
            out = []
            for i in range(lo, hi):
                try:
                    self._write_one(keys_b[i], views[i])
                    out.append("")
                except OSError as exc:
                    out.append(str(exc) or type(exc).__name__)
            return out

        # the calling thread only: writes are background work (a niced lane, see
        # kvtier.worker.process.BACKGROUND_LANES); the I/O threads are the reads'
        outcomes = run(0, len(keys_b))
        written = [i for i, err in enumerate(outcomes) if not err]
        self._touch_batch([keys_b[i].hex() for i in written])
        failed = [err for err in outcomes if err]
        self._stats.add(
            pages_written=len(written),
            bytes_written=sum(views[i].nbytes for i in written),
            errors_set=len(failed),
        )
        self._stats.observe("write", time.perf_counter() - start)
        if failed:
            self._warn.warning(
                f"file storage {self.namespace}: {len(failed)} page write(s) failed: {failed[0]}"
            )
        return len(written)

    def delete(self, keys: Sequence[bytes]) -> int:
        self._ensure_open()
        keys_b = check_keys(keys)
        removed = 0
        with self._lock:
            for key in keys_b:
                hexkey = key.hex()
                try:
                    removed += self._unlink_quietly(self._page_path(hexkey))
                except OSError as exc:
                    self._stats.add(errors_delete=1)
                    self._warn.warning(f"file storage {self.namespace}: delete failed: {exc}")
                self._forget_locked(hexkey)
        self._marks.drop(k.hex() for k in keys_b)
        self._stats.add(pages_deleted=removed)
        return removed

    def clear(self) -> int:
        """Delete every page (and temp file) directly under this namespace's shard
        directories. Pages of other namespaces live in other directories and are not
        touched, even when one namespace path is nested under another."""
        self._ensure_open()
        removed = 0
        with self._lock:
            try:
                with os.scandir(self.root) as shards:
                    shard_paths = [
                        s.path for s in shards
                        if _SHARD_NAME.match(s.name) and s.is_dir(follow_symlinks=False)
                    ]
                for shard_path in shard_paths:
                    with os.scandir(shard_path) as entries:
                        for entry in entries:
                            if not entry.is_file(follow_symlinks=False):
                                continue
                            if _PAGE_NAME.match(entry.name):
                                removed += self._unlink_quietly(entry.path)
                            elif entry.name.startswith(_TEMP_PREFIX):
                                self._unlink_quietly(entry.path)
            except OSError as exc:
                self._stats.add(errors_clear=1)
                self._warn.warning(f"file storage {self.namespace}: clear failed: {exc}")
            self._lru.clear()
            self._used = 0
            self._marks.clear()
        self._stats.add(pages_deleted=removed)
        return removed

    def list_keys(self, cursor: int, count: int) -> tuple[list[bytes], int]:
        """The pages of whole shard directories from shard number `cursor` (0..255) on, until
        `count` keys are gathered: one `scandir` per shard (the directory is the truth, pages
        of other processes sharing the root included; this process's index is not asked).
        The next cursor is the next shard's number, 0 after shard ff."""
        self._ensure_open()
        if isinstance(cursor, bool) or not isinstance(cursor, int) or not 0 <= cursor < 256:
            raise ValueError(f"list_keys: cursor {cursor!r} is not a shard number 0..255")
        keys: list[bytes] = []
        shard = cursor
        while shard < 256 and len(keys) < count:
            try:
                with os.scandir(f"{self._root_s}/{shard:02x}") as entries:
                    keys.extend(bytes.fromhex(e.name) for e in entries
                                if _PAGE_NAME.match(e.name))
            except FileNotFoundError:
                pass  # no page was ever written to this shard
            except OSError as exc:
                self._stats.add(errors_list=1)
                self._warn.warning(f"file storage {self.namespace}: listing failed: {exc}")
                return keys, 0
            shard += 1
        return keys, shard if shard < 256 else 0

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def stats(self) -> dict[str, float]:
        out = super().stats()
        with self._lock:
            out["used_bytes"] = self._used
            out["stored_pages"] = len(self._lru)
        out["capacity_bytes"] = self.capacity_bytes
        return out
