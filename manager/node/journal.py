"""After a crash of the node service, the host copies whose bytes can be vouched for are kept
(issue 37, item 2).

A `kill -9` of `kvtier serve` leaves no hand-over: its workers notice the dead manager and
unlink their pools, the janitor removes every `kvtier_<id>_*` name. With `node.handover =
true` each namespace keeps, for as long as it runs:

* every rank's host pool hard-linked under `kept_segment_name` (re-linked when a worker is
  replaced: `refresh`), so the bytes outlive any death;
* a journal segment (`journal_name`, 0600) of one slot per host block, written when an
  engine's store of that block completes and before the block is published (while it is
  still marked ENGINE_WRITE, so nothing can evict or reuse it meanwhile): the block's tree
  key, its storage key, the page length and the CRC-32 of the page on every rank, and a
  CRC-32 of the slot itself (a torn slot reads as empty).

A slot is never cleared: a block evicted and rewritten keeps its old slot until the new
store completes, and the old checksums no longer match the new bytes. So at the next
start (`recover`) a page is adopted only when its slot is whole and every rank's bytes
checksum to what the slot says: a store that never completed, a page overwritten while the
service was down, a pool that is not the one the journal describes, all fail the check and
their blocks are freed::

    namespace starts (cold, adopted, or recovered)   `Journal.create`: a fresh journal (the
                                                     adopted pages recorded again), kept
                                                     links made
    engine completes a store (ok)                    `record`: slots written, then the copy
                                                     published
    housekeeping (each second)                       `refresh`: a replaced worker's pool
                                                     linked and mapped again
    clean stop, no hand-over                         `close(keep=False)`: links and journal
                                                     unlinked
    kill -9                                          nothing runs: links and journal stay
    next start, no hand-over                         `recover`: whole slots whose checksums
                                                     match the adopted pools' bytes

CRC-32 (zlib) rather than a keyed MAC: the threat is bytes that changed (a half-written
store, a page overwritten while the service was down), not a forger, who as this user could
rewrite the journal too. Measured here on one core (`zlib.crc32` vs `hashlib.blake2b`,
16-byte digest): 43 us vs 251 us per 64 KiB page, 0.60 ms vs 3.5 ms per 768 KiB page
(1.3-1.5 GB/s vs 0.26 GB/s); zlib releases the GIL over large buffers, and the cost falls on
the completing engine's own session thread (a one-way op), not on other engines.

Data structures: `Journal`: the journal mapping (HEADER, then `host_blocks` slots of
SLOT_BYTES), one read-only mapping per rank's pool with its inode. Invariant: a slot is
written only for a block this service saw completed, with checksums of its bytes then.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import stat
import struct
import threading
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.manager.keyed import KeyedHostCache, engine_key
from kvtier.manager.node.handover import geometry_text
from kvtier.worker.spec import KEPT_PREFIX, SHM_DIR, host_segment_name, kept_segment_name

log = logging.getLogger("kvtier.node")

MAGIC = b"KVTJ"
VERSION = 1
HEADER = 4096
MAX_RANKS = 16
_HEAD = struct.Struct("<4sIIIQI")  # magic, version, ranks, host blocks, page bytes, geometry
_SLOT = struct.Struct(f"<4sI16s32sB3x{MAX_RANKS}I")  # magic, length, key, skey, flags, crcs
_SLOT_CRC = struct.Struct("<I")
SLOT_BYTES = _SLOT.size + _SLOT_CRC.size
SLOT_MAGIC = b"PAGE"
_HAS_SKEY, _STORED = 1, 2


def journal_name(deployment_id: str) -> str:
    return f"{KEPT_PREFIX}{deployment_id}_journal"


def _header(ranks: int, host_blocks: int, page_bytes: int, geometry: str) -> bytes:
    g = geometry.encode()
    return _HEAD.pack(MAGIC, VERSION, ranks, host_blocks, page_bytes, len(g)) + g


class Journal:
    """One namespace's kept pools and page journal (see the module docstring)."""

    def __init__(self, deployment_id: str, ranks: int, host_blocks: int,
                 page_bytes: int) -> None:
        self.did = deployment_id
        self.ranks = ranks
        self.host_blocks = host_blocks
        self.page_bytes = page_bytes
        self._jm: mmap.mmap | None = None
        self._pools: list[tuple[int, mmap.mmap] | None] = [None] * ranks
        self.recorded = 0
        self._lock = threading.Lock()  # mappings replaced or closed vs. slots written
        # pools mapped populated (a recovery checksums every page at once); else faulted in
        # as pages are checksummed: populating 4 GiB held the GIL 0.15-0.2 s (mmap() does
        # not release it), stalling the service's every thread after a restart
        self.populate = False

    # ------------------------------------------------------------------ life cycle

    @classmethod
    def create(cls, deployment_id: str, ranks: int, host_blocks: int, page_bytes: int,
               geometry: dict[str, Any], populate: bool = False) -> Journal:
        """A fresh journal (the old one of this namespace replaced) and kept links of
        every rank's pool (OSError)."""
        if ranks > MAX_RANKS:
            raise OSError(0, f"{ranks} ranks, a journal holds at most {MAX_RANKS}")
        j = cls(deployment_id, ranks, host_blocks, page_bytes)
        j.populate = populate
        path = SHM_DIR + journal_name(deployment_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        size = HEADER + host_blocks * SLOT_BYTES
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            j._jm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        head = _header(ranks, host_blocks, page_bytes, geometry_text(geometry))
        if len(head) > HEADER:
            j.close(keep=False)
            raise OSError(0, "the namespace's geometry does not fit the journal's header")
        j._jm[:len(head)] = head
        j.refresh()
        return j

    def refresh(self) -> None:
        """Each rank's pool kept-linked and mapped (again, when its worker was replaced)."""
        for r in range(self.ranks):
            name = SHM_DIR + host_segment_name(self.did, r)
            kept = SHM_DIR + kept_segment_name(self.did, r)
            try:
                ino = os.stat(name).st_ino
            except OSError:
                continue  # being replaced: the next refresh
            with contextlib.suppress(OSError):
                if os.stat(kept).st_ino != ino:
                    os.unlink(kept)
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                os.link(name, kept)
            have = self._pools[r]
            if have is None or have[0] != ino:
                new = _map_pool(name, ino, self.host_blocks * self.page_bytes,
                                self.populate)
                with self._lock:
                    if self._jm is None:  # closed meanwhile
                        if new is not None:
                            new[1].close()
                        return
                    self._pools[r] = new
                if have is not None:
                    have[1].close()

    def close(self, keep: bool) -> None:
        """Mappings released; `keep`: links and journal left for the next service."""
        with self._lock:
            jm, self._jm = self._jm, None
            pools, self._pools = self._pools, [None] * self.ranks
        if jm is not None:
            jm.close()
        for p in pools:
            if p is not None:
                p[1].close()
        if not keep:
            names = [journal_name(self.did)] + [kept_segment_name(self.did, r)
                                                for r in range(self.ranks)]
            for n in names:
                with contextlib.suppress(OSError):
                    os.unlink(SHM_DIR + n)

    # ------------------------------------------------------------------ records

    def _crcs(self, host: int) -> list[int] | None:
        """Every rank's CRC-32 of page `host` (None while a rank's pool is not mapped).
        Caller holds `_lock` (a mapping closed under a running crc32 would be freed)."""
        off = host * self.page_bytes
        out = []
        for p in self._pools:
            if p is None:
                return None
            with memoryview(p[1]) as mv:
                out.append(zlib.crc32(mv[off:off + self.page_bytes]))
        return out

    def checksums(self, host: int) -> list[int] | None:
        with self._lock:
            return self._crcs(host)

    def record(self, pages: Sequence[tuple[bytes, int, bytes | None, bool]]) -> int:
        """Slots for these blocks as their bytes are now: (tree key, 16 bytes; host block;
        storage key; stored). Returns how many were written."""
        n = 0
        with self._lock:
            jm = self._jm
            if jm is None:
                return 0
            for key, host, skey, stored in pages:
                if not 0 <= host < self.host_blocks or len(key) != 16:
                    continue
                crcs = self._crcs(host)
                if crcs is None:
                    continue
                flags = (_HAS_SKEY if skey is not None else 0) | (_STORED if stored else 0)
                body = _SLOT.pack(SLOT_MAGIC, self.page_bytes, key,
                                  (skey or b"")[:32].ljust(32, b"\0"), flags, *crcs,
                                  *([0] * (MAX_RANKS - len(crcs))))
                at = HEADER + host * SLOT_BYTES
                jm[at:at + SLOT_BYTES] = body + _SLOT_CRC.pack(zlib.crc32(body))
                n += 1
            self.recorded += n
        return n

    def record_ready(self, keyed: KeyedHostCache, chunk: int = 32) -> int:
        """Slots for every ready host copy of `keyed` (the pages a hand-over gave this
        service), a chunk at a time under the namespace's lock, each checked to be still
        cached in the same block and not being written (engines may run meanwhile).
        Returns how many were written."""
        m = keyed.m
        with m.lock:
            todo = [(key, host) for key, host, _, _ in m.ready_host_copies()]
        n = 0
        for i in range(0, len(todo), chunk):
            n += self._record_if_ready(keyed, todo[i:i + chunk])
            if self._jm is None:
                break
        return n

    def record_published(self, keyed: KeyedHostCache, hashes: Sequence[bytes]) -> int:
        """Slots for these engine blocks if they are ready host copies now: stores whose
        completion was applied while this journal was being made in the background, after
        `record_ready` had listed the ready copies (so it missed them) but before their
        session saw the journal (so it did not checksum them: `ops.apply_ops`)."""
        return self._record_if_ready(keyed, [(engine_key(h), None) for h in hashes])

    def _record_if_ready(self, keyed: KeyedHostCache,
                         todo: Sequence[tuple[int, int | None]]) -> int:
        """Slots for the (tree key, host block or None: any) that are still cached there
        with a whole host copy, under the namespace's lock (engines run meanwhile: nothing
        writes a ready copy's page while the lock is held)."""
        m = keyed.m
        with m.lock:
            still = []
            for key, host in todo:
                ready = m.ready_host_copy(key)
                if ready is not None and (host is None or ready[1] == host):
                    still.append((key.to_bytes(16, "little"), ready[1], ready[2], ready[3]))
            return self.record(still)

    def record_stores(self, keyed: KeyedHostCache, hashes: Sequence[bytes],
                      owner: object) -> int:
        """Slots for the open stores of `owner` among `hashes` (before their completion
        publishes them)."""
        return self.record([(engine_key(h).to_bytes(16, "little"), host, skey, False)
                            for h, host, skey in keyed.open_store_pages(hashes, owner=owner)])


def _map_pool(path: str, ino: int, size: int,
              populate: bool) -> tuple[int, mmap.mmap] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if st.st_ino != ino or st.st_size != size:
            return None
        # populated at once: a recovery checksums every page, and faulting 4 KiB at a time
        # made that 5x slower (4 GiB: 15 s against ~3 s of CRC-32 on a loaded 2-core box)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        return ino, mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def recover(deployment_id: str, ranks: int, host_blocks: int, page_bytes: int,
            geometry: dict[str, Any]) -> list[tuple[bytes, int, bytes | None, bool, list[int]]]:
    """The whole slots of the journal a dead service of this namespace left (tree key, host
    block, storage key, stored, checksums), taken; [] when there is none or it is not one
    this namespace can use (one log line)."""
    path = SHM_DIR + journal_name(deployment_id)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        st = os.fstat(fd)
        size = HEADER + host_blocks * SLOT_BYTES
        why = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
               f"owned by uid {st.st_uid}" if st.st_uid != os.geteuid() else
               f"mode {st.st_mode & 0o777:o}" if st.st_mode & 0o077 else
               f"{st.st_size} bytes, {size} expected" if st.st_size != size else "")
        if why:
            log.warning("namespace journal %s refused (%s): nothing recovered", path, why)
            return []
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as jm:
            head = _header(ranks, host_blocks, page_bytes, geometry_text(geometry))
            if jm[:len(head)] != head:
                log.warning("namespace journal %s is of another geometry or version: "
                            "nothing recovered", path)
                return []
            out = []
            for host in range(host_blocks):
                at = HEADER + host * SLOT_BYTES
                raw = jm[at:at + SLOT_BYTES]
                body, (crc,) = raw[:_SLOT.size], _SLOT_CRC.unpack(raw[_SLOT.size:])
                if body[:4] != SLOT_MAGIC or zlib.crc32(body) != crc:
                    continue
                _magic, length, key, skey, flags, *crcs = _SLOT.unpack(body)
                if length != page_bytes:
                    continue
                out.append((key, host, skey if flags & _HAS_SKEY else None,
                            bool(flags & _STORED), list(crcs[:ranks])))
            return out
    finally:
        os.close(fd)


def adopt_recovered(journal: Journal, keyed: KeyedHostCache,
                    slots: list[tuple[bytes, int, bytes | None, bool, list[int]]]
                    ) -> tuple[int, int]:
    """Of the recovered slots, the pages whose every rank's bytes still checksum as recorded
    (in `journal`'s mappings of the adopted pools; one page per key) become ready host
    copies of `keyed`, and are recorded in the new journal. Returns (adopted, discarded)."""
    good: list[tuple[int, int, bytes | None, bool]] = []
    rec: list[tuple[bytes, int, bytes | None, bool]] = []
    keys: set[bytes] = set()
    has_storage = keyed.storage is not None
    # every page checksummed on a few threads (zlib releases the GIL over a page); the
    # journal's lock held throughout (nothing else uses it before the namespace is served)
    with journal._lock, ThreadPoolExecutor(min(4, os.cpu_count() or 1)) as pool:
        now = list(pool.map(journal._crcs, [slot[1] for slot in slots], chunksize=64))
    for (key, host, skey, stored, crcs), found in zip(slots, now, strict=True):
        if key in keys or found != crcs:
            continue
        keys.add(key)
        s = skey if has_storage else None
        good.append((engine_key(key), host, s, stored and s is not None))
        rec.append((key, host, s, stored and s is not None))
    m = keyed.m
    with m.lock:
        m.adopt_host_copies(good, 0.0)
    journal.record(rec)
    return len(good), len(slots) - len(good)
