"""A planned restart of the node service keeps every namespace's host tier (issue 37).

The host pools are POSIX shared memory: their bytes outlive the service; only the index of
what they hold (hash -> page) lives in the service. A stopping service with
`node.handover = true` writes that index and keeps the segments; the next service of the
same deployment adopts both when each namespace attaches again::

    old service, SIGTERM / SIGINT     sessions end (open stores abandoned, never served);
                                      the abandoned stores still in their grace listed
                                      (page, deadline), then released here
      -> `write_handover`             per namespace, under its lock: every ready host copy
                                      (hash, page, storage key, stored; version 3: its
                                      tenant and retention, the TTL as seconds left) oldest
                                      first, the held pages (version 2: `HeldPage`), the
                                      tenant book (version 3: tenants and quotas, the
                                      storage marks that still hold); each
                                      rank's segment hard-linked under `kept_segment_name`
                                      (worker and janitor unlink only `kvtier_<id>_*`);
                                      HANDOVER_NAME written 0600 in the socket's private
                                      folder (a temporary file renamed: whole or absent)
      -> stacks closed                workers unlink the pool names; the kept links hold the
                                      bytes
    new service, start                `read_handover`: the file taken (unlinked) and checked
                                      field by field (version, owner uid, bounded counts,
                                      every name ours); refused -> one log line, every kept
                                      segment of the deployment unlinked, a cold start
    first attach of namespace N       `Adoption.check_config`: geometry, ranks, page size,
                                      host blocks as recorded, else one line, cold
      -> stack started, workers adopt the kept segments (renamed back: same name and inode)
      -> `Adoption.adopt`             every rank's segment is the inode recorded, every page
                                      in range and once, every storage key the one this
                                      namespace derives: the pages become ready host copies
                                      (`CacheCore.adopt_host_copies`); else none is adopted
      -> `Adoption._rebook`           the quotas restored and each page booked to its tenant
                                      with its retention through the book's own calls
                                      (`TenantBook.set_quota`, `retain`), a TTL less the wall
                                      time since the writing; the storage marks recorded and
                                      sent to the new workers (`resend_storage_retention`,
                                      as to a replaced worker)
      -> `Adoption.hold`              the held pages whose deadline has not passed taken
                                      out of the free list (`adopt_abandoned_writes`: marked
                                      written, never served) and held in the server's
                                      `Graves` until that deadline: an engine's late copy of
                                      a store planned before the restart lands in a page
                                      nobody else has been given (the engine's copier checks
                                      the segment's name and inode, which an adopted pool
                                      keeps)
    service stops                     kept segments of namespaces that never attached
                                      unlinked

What is never handed over: copies being written by an engine (ENGINE_WRITE) or prefetched
from storage (PREFETCHING): their bytes may be partial. Nothing is served from a segment
whose inode differs from the recorded one (a worker that could not adopt creates a fresh
pool: another inode).

What the crash journal cannot give (`journal.py`): tenants and retention. A crash keeps the
bytes it vouches for, booked to no tenant, with no pin, TTL, quota or storage mark.

Data structures: `HandOver` (msgspec, the file; version 3; version 2 read as one with no
tenant book, version 1 as one with nothing held either): `namespaces` -> `NamespaceRecord`
(`segments`, `pages` each with its tenant as an index into `tenants` and its retention,
`held`, `tenants` (`TenantRecord`), `default_quota`, `marks` (`MarkRecord`)).
`Adoption`: the records read at start, by namespace, and the figures
per namespace (`handed_over`, `adopted`, `discarded`, `held`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import stat
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Annotated, Any

import msgspec
from kvtier.manager.errors import KvtierError
from kvtier.manager.keyed import KeyedHostCache, engine_key
from kvtier.manager.node.wire import Hello
from kvtier.manager.sessions import Graves
from kvtier.manager.tenants import (
    MAX_STORAGE_MARKS,
    MAX_TENANT_BYTES,
    MAX_TTL_S,
    PRIORITY_MAX,
    PRIORITY_MIN,
    Retention,
    SteeringError,
)
from kvtier.worker.spec import KEPT_PREFIX, SHM_DIR, host_segment_name, kept_segment_name

log = logging.getLogger("kvtier.node")

HANDOVER_VERSION = 3  # 3: tenants, quotas, each page's tenant and retention, storage marks
# 2: `NamespaceRecord.held` (abandoned stores still held). Version 1 reads as one with
# nothing held, versions 1 and 2 as ones with no tenant (the default pool, no retention)
READABLE_VERSIONS = (1, 2, 3)
HANDOVER_NAME = "handover.msgpack"
MAX_FILE_BYTES = 1 << 30  # ~10M pages of ~100 bytes: far past any host tier's page count
MAX_NAMESPACES = 4096
MAX_RANKS = 64
MAX_PAGES = 1 << 24
SKEY_BYTES = 32  # `keys.keyed_storage_key`: a SHA-256
MAX_TEXT = 4096
MAX_HOLD_S = 3600.0  # a held page's deadline at most this far past the hand-over's writing
MAX_TENANTS = 1 << 16  # tenants listed per namespace (names of at most MAX_TENANT_BYTES)

_Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
_Ttl = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TTL_S)]
_Priority = Annotated[int, msgspec.Meta(ge=PRIORITY_MIN, le=PRIORITY_MAX)]


class Page(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """One ready host copy: its tree key (the first 16 bytes of the engine's block hash,
    little-endian: `engine_key` reads them back as the same key), its host block (`page`),
    its storage key (None without storage), whether storage holds it, the generation it
    was made in."""

    key: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    page: _Count
    storage_key: Annotated[bytes, msgspec.Meta(min_length=SKEY_BYTES,
                                               max_length=SKEY_BYTES)] | None
    stored: bool
    generation: _Count
    # version 3 (absent before: no tenant, no retention): the tenant it is booked to, as
    # an index into `NamespaceRecord.tenants` (-1: booked to none, a prefetched copy), and
    # its retention, the TTL as the seconds left when the hand-over was written
    tenant: Annotated[int, msgspec.Meta(ge=-1, lt=MAX_TENANTS)] = -1
    pin: bool = False
    ttl_s: _Ttl = 0.0
    priority: _Priority = 0


class TenantRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A tenant of the namespace (version 3): its name and its own quota in host blocks
    (None: the namespace's default quota)."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_TENANT_BYTES)]
    quota: _Count | None


class MarkRecord(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A retention sent to a storage page that still holds (version 3: `StorageMarks`),
    the TTL as the seconds left when the hand-over was written: the next service sends it
    to its new workers, whose tables start empty."""

    key: Annotated[bytes, msgspec.Meta(min_length=SKEY_BYTES, max_length=SKEY_BYTES)]
    pin: bool
    ttl_s: _Ttl
    priority: _Priority


class HeldPage(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """An engine store the old service had abandoned (never served) and still held when it
    handed over: the engine may still copy into `page` until `until` (wall-clock seconds,
    `node.abandon_grace_s` after the abandonment), so the next service keeps the page out
    of its free list until then. `key` as `Page.key`."""

    key: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]
    page: _Count
    until: Annotated[float, msgspec.Meta(ge=0.0)]


class SegmentRecord(msgspec.Struct, forbid_unknown_fields=True):
    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
    name: _Text
    kept: _Text
    inode: _Count
    size: _Count


class NamespaceRecord(msgspec.Struct, forbid_unknown_fields=True):
    namespace: _Text
    deployment_id: _Text
    geometry: _Text  # Hello.geometry() as canonical JSON
    page_bytes: _Count
    host_blocks: _Count
    ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]
    generation: _Count
    segments: Annotated[list[SegmentRecord], msgspec.Meta(max_length=MAX_RANKS)]
    pages: Annotated[list[Page], msgspec.Meta(max_length=MAX_PAGES)]
    held: Annotated[list[HeldPage], msgspec.Meta(max_length=MAX_PAGES)] = []  # version 2
    # version 3: the tenant book (`TenantBook`): its tenants, the default quota, the
    # storage marks (bounded as the book bounds them)
    tenants: Annotated[list[TenantRecord], msgspec.Meta(max_length=MAX_TENANTS)] = []
    default_quota: _Count | None = None
    marks: Annotated[list[MarkRecord], msgspec.Meta(max_length=MAX_STORAGE_MARKS)] = []


class _Head(msgspec.Struct):
    """The one field read before the rest: a version this service cannot read is refused
    before its layout is guessed at."""

    version: int


class HandOver(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    owner_uid: _Count
    deployment_id: _Text
    written: float
    namespaces: Annotated[list[NamespaceRecord], msgspec.Meta(max_length=MAX_NAMESPACES)]


class _PeekNamespace(msgspec.Struct):
    ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)]


class _Peek(msgspec.Struct):
    """What `handover_workers` reads of a hand-over (the rest is skipped unread)."""

    version: int
    deployment_id: str
    namespaces: Annotated[list[_PeekNamespace], msgspec.Meta(max_length=MAX_NAMESPACES)]


class HandOverRefused(KvtierError):
    """A hand-over this service does not adopt; the message is the one log line."""


def geometry_text(geometry: dict[str, Any]) -> str:
    return json.dumps(geometry, sort_keys=True, separators=(",", ":"))


def _kept_prefix(base_deployment_id: str) -> str:
    """The kept names of every namespace of deployment `base` start with this (namespace
    deployment ids are `<base[:19]>-n<digest>`, `namespaces.namespace_deployment_id`)."""
    return f"{KEPT_PREFIX[1:]}{base_deployment_id[:19].rstrip('-')}-n"


def unlink_kept(base_deployment_id: str, only: str | None = None,
                keep: Collection[str] = ()) -> list[str]:
    """Unlink this user's kept segments of deployment `base` (`only`: of that namespace
    deployment id; `keep`: not those of these namespace deployment ids); returns their
    names."""
    prefix = (_kept_prefix(base_deployment_id) if only is None
              else kept_segment_name(only, 0)[1:].rsplit("_host_r", 1)[0] + "_host_r")
    spared = tuple(f"{KEPT_PREFIX[1:]}{did}_" for did in keep)
    gone = []
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for e in entries:
            if not e.name.startswith(prefix) or e.name.startswith(spared):
                continue
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_uid == os.geteuid():
                    os.unlink(e.path)
                    gone.append(e.name)
    return gone


# ---------------------------------------------------------------------- the old service

def snapshot(name: str, deployment_id: str, geometry: dict[str, Any], page_bytes: int,
             host_blocks: int, ranks: int, keyed: KeyedHostCache,
             held: Sequence[tuple[int, int, float]] = ()) -> NamespaceRecord:
    """One namespace's ready host copies, oldest first, and its segments kept under their
    hand-over names (OSError when a segment is not there); `held`: its abandoned stores
    still held (tree key, host block, seconds left: `NodeServer._held`), with their
    deadlines."""
    m = keyed.m
    with m.lock:
        gen = keyed.generation
        # the tree key (the engine hash's first 16 bytes, `engine_key`) stands for the hash:
        # the whole hash is not kept, and the storage key derived from it is recorded
        book = keyed.tenants
        mono = time.monotonic()
        # stale entries purged (a copy that left the tree without the book: its tenant and
        # hold are not the ready copy's) and TTLs read at this instant (`retention_of`)
        book.figures(mono)
        names = {name: i for i, name in enumerate(book.tenants)}
        tenants = [TenantRecord(t.name, t.quota) for t in book.tenants.values()]
        pages = []
        for key, host, skey, stored in m.ready_host_copies():
            owner = book.tenant_of(key)
            ret = book.retention_of(key) or {}
            pages.append(Page(key.to_bytes(16, "little"), host, skey, stored, gen,
                              -1 if owner is None else names[owner], bool(ret.get("pin")),
                              min(MAX_TTL_S, float(ret.get("ttl_left_s", 0.0))),
                              int(ret.get("priority", 0))))
        marks = ([MarkRecord(k, pin, min(MAX_TTL_S, left), prio)
                  for k, pin, left, prio in book.storage_marks.held(mono)]
                 if keyed.storage is not None else [])
        now = time.time()
        still = [HeldPage(key.to_bytes(16, "little"), host, now + left)
                 for key, host, left in held]
        segments = []
        for r in range(ranks):
            seg = host_segment_name(deployment_id, r)
            kept = kept_segment_name(deployment_id, r)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR + kept)
            os.link(SHM_DIR + seg, SHM_DIR + kept)
            st = os.stat(SHM_DIR + kept)
            segments.append(SegmentRecord(r, seg, kept, st.st_ino, st.st_size))
    return NamespaceRecord(name, deployment_id, geometry_text(geometry), page_bytes,
                           host_blocks, ranks, gen, segments, pages, still, tenants,
                           book.default_quota, marks)


def write_handover(folder: Path, base_deployment_id: str,
                   records: list[NamespaceRecord]) -> Path:
    """The hand-over file, 0600, whole or absent (a temporary file renamed)."""
    doc = HandOver(HANDOVER_VERSION, os.geteuid(), base_deployment_id, time.time(), records)
    data = msgspec.msgpack.encode(doc)
    path = folder / HANDOVER_NAME
    tmp = folder / f".{HANDOVER_NAME}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------- the new service

def handover_workers(folder: Path, base_deployment_id: str, most: int) -> int:
    """How many worker processes the hand-over waiting in `folder` will start (its
    namespaces' ranks, at most `most`), read without taking it: 0 when there is none or it
    would be refused at a glance (another owner, version or deployment). The checks that
    count are `read_handover`'s, at the start proper: this only lets a plain restart start
    its workers warm before its own imports (a wrong count costs an idle process)."""
    try:
        fd = os.open(folder / HANDOVER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                or st.st_size > MAX_FILE_BYTES):
            return 0
        with open(fd, "rb", closefd=False) as f:
            doc = msgspec.msgpack.decode(f.read(), type=_Peek)
    except (OSError, msgspec.MsgspecError):
        return 0
    finally:
        os.close(fd)
    if doc.version not in READABLE_VERSIONS or doc.deployment_id != base_deployment_id:
        return 0
    return min(most, sum(ns.ranks for ns in doc.namespaces))


def read_handover(folder: Path, base_deployment_id: str) -> HandOver:
    """The hand-over in `folder`, taken (unlinked whatever it holds: it is read once), and
    checked: HandOverRefused with the one line to log. FileNotFoundError when there is
    none."""
    path = folder / HANDOVER_NAME
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            os.unlink(path)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HandOverRefused(f"{path}: not a regular file")
        if st.st_uid != os.geteuid():
            raise HandOverRefused(f"{path}: owned by uid {st.st_uid}, not this service's "
                                  f"{os.geteuid()}")
        if st.st_mode & 0o077:
            raise HandOverRefused(f"{path}: mode {st.st_mode & 0o777:o}, a hand-over is 0600")
        if st.st_size > MAX_FILE_BYTES:
            raise HandOverRefused(f"{path}: {st.st_size} bytes, at most {MAX_FILE_BYTES}")
        data = b""
        while len(data) < st.st_size:
            chunk = os.read(fd, st.st_size - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    try:
        head = msgspec.msgpack.decode(data, type=_Head)
    except msgspec.MsgspecError as e:
        raise HandOverRefused(f"{path}: unreadable ({e})") from None
    if head.version not in READABLE_VERSIONS:
        raise HandOverRefused(f"{path}: version {head.version}, this service reads versions "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    try:
        doc = msgspec.msgpack.decode(data, type=HandOver)
    except msgspec.MsgspecError as e:
        raise HandOverRefused(f"{path}: {e}") from None
    if doc.owner_uid != os.geteuid():
        raise HandOverRefused(f"{path}: written by uid {doc.owner_uid}, this service runs as "
                              f"{os.geteuid()}")
    if doc.deployment_id != base_deployment_id:
        raise HandOverRefused(f"{path}: of deployment {doc.deployment_id!r}, not "
                              f"{base_deployment_id!r}")
    seen = set()
    for rec in doc.namespaces:
        if rec.namespace in seen:
            raise HandOverRefused(f"{path}: namespace {rec.namespace!r} twice")
        seen.add(rec.namespace)
        if head.version < 2 and rec.held:
            raise HandOverRefused(f"{path}: namespace {rec.namespace!r}: held pages in a "
                                  f"version {head.version} hand-over")
        if head.version < 3 and (rec.tenants or rec.marks or rec.default_quota is not None
                                 or any(p.tenant != -1 or p.pin or p.ttl_s or p.priority
                                        for p in rec.pages)):
            raise HandOverRefused(f"{path}: namespace {rec.namespace!r}: tenants or "
                                  f"retention in a version {head.version} hand-over")
        _check_record(rec, base_deployment_id, doc.written)
    return doc


def _check_record(rec: NamespaceRecord, base: str, written: float) -> None:
    """Every name one this deployment's namespace would use; counts within the pool; held
    pages within the pool, none twice nor also handed over, their deadlines bounded."""
    where = f"namespace {rec.namespace!r}"
    if not rec.deployment_id.startswith(_kept_prefix(base)[len(KEPT_PREFIX) - 1:]):
        raise HandOverRefused(f"{where}: deployment id {rec.deployment_id!r} is not one of "
                              f"{base!r}'s")
    if len(rec.segments) != rec.ranks:
        raise HandOverRefused(f"{where}: {len(rec.segments)} segments for {rec.ranks} ranks")
    if len(rec.pages) > rec.host_blocks:
        raise HandOverRefused(f"{where}: {len(rec.pages)} pages, the pool has "
                              f"{rec.host_blocks}")
    for r, seg in enumerate(rec.segments):
        if (seg.rank != r or seg.name != host_segment_name(rec.deployment_id, r)
                or seg.kept != kept_segment_name(rec.deployment_id, r)):
            raise HandOverRefused(f"{where}: segment {r} is {seg.name!r} kept as "
                                  f"{seg.kept!r}, not this namespace's names")
        if seg.size != rec.host_blocks * rec.page_bytes:
            raise HandOverRefused(f"{where}: segment {r} of {seg.size} bytes, "
                                  f"{rec.host_blocks} pages of {rec.page_bytes} bytes")
    if len(rec.pages) + len(rec.held) > rec.host_blocks:
        raise HandOverRefused(f"{where}: {len(rec.pages)} pages and {len(rec.held)} held, "
                              f"the pool has {rec.host_blocks}")
    pages = {p.page for p in rec.pages}
    keys = {p.key for p in rec.pages}
    for h in rec.held:
        why = (f"page {h.page} out of 0..{rec.host_blocks - 1}" if h.page >= rec.host_blocks
               else f"page {h.page} handed over or held twice" if h.page in pages
               else "a key handed over or held twice" if h.key in keys
               else f"a deadline {h.until - written:.0f} s past the hand-over, at most "
                    f"{MAX_HOLD_S:.0f}" if h.until > written + MAX_HOLD_S else "")
        if why:
            raise HandOverRefused(f"{where}: held {why}")
        pages.add(h.page)
        keys.add(h.key)
    _check_tenants(rec, where)


def _check_tenants(rec: NamespaceRecord, where: str) -> None:
    """Version 3's tenant book: names unique and at most MAX_TENANT_BYTES of UTF-8, quotas
    within the pool, every page's tenant listed, TTLs finite, a tenant's pins within its
    quota (the book refuses a pin over quota)."""
    names: set[str] = set()
    for t in rec.tenants:
        why = (f"tenant {t.name[:40]!r} of more than {MAX_TENANT_BYTES} bytes"
               if len(t.name.encode()) > MAX_TENANT_BYTES else
               f"tenant {t.name[:40]!r} twice" if t.name in names else
               f"tenant {t.name[:40]!r} has a quota of {t.quota} blocks, the pool has "
               f"{rec.host_blocks}" if t.quota is not None and t.quota > rec.host_blocks
               else "")
        if why:
            raise HandOverRefused(f"{where}: {why}")
        names.add(t.name)
    if rec.default_quota is not None and rec.default_quota > rec.host_blocks:
        raise HandOverRefused(f"{where}: a default quota of {rec.default_quota} blocks, the "
                              f"pool has {rec.host_blocks}")
    pins = [0] * len(rec.tenants)
    for p in rec.pages:
        if p.tenant >= len(rec.tenants):
            raise HandOverRefused(f"{where}: page {p.page} booked to tenant #{p.tenant}, "
                                  f"{len(rec.tenants)} listed")
        if not math.isfinite(p.ttl_s):
            raise HandOverRefused(f"{where}: page {p.page} with a TTL of {p.ttl_s}")
        if p.pin:
            if p.tenant < 0:
                raise HandOverRefused(f"{where}: page {p.page} pinned, booked to no tenant")
            pins[p.tenant] += 1
    for t, n in zip(rec.tenants, pins, strict=True):
        quota = t.quota if t.quota is not None else rec.default_quota
        if n and quota is not None and n > quota:
            raise HandOverRefused(f"{where}: tenant {t.name[:40]!r} has {n} pinned pages, "
                                  f"its quota is {quota} blocks")
    if any(not math.isfinite(k.ttl_s) for k in rec.marks):
        raise HandOverRefused(f"{where}: a storage mark with a TTL that is not finite")


class Adoption:
    """The hand-over read at start, adopted namespace by namespace (see the module
    docstring). Figures per namespace: `figures[name]` = handed_over / adopted /
    discarded."""

    def __init__(self, base_deployment_id: str) -> None:
        self.base = base_deployment_id
        self._records: dict[str, NamespaceRecord] = {}
        self._written = 0.0  # the hand-over's wall-clock writing time (TTLs run on)
        self.figures: dict[str, dict[str, int]] = {}

    def load(self, folder: Path) -> None:
        """Read the hand-over in `folder`, if any; refused: one line, every kept segment of
        the deployment unlinked (a cold start)."""
        try:
            doc = read_handover(folder, self.base)
        except FileNotFoundError:
            return
        except (HandOverRefused, OSError) as e:
            gone = unlink_kept(self.base)
            log.warning("hand-over refused, cold start (%d kept segment(s) unlinked): %s",
                        len(gone), e)
            return
        self._records = {r.namespace: r for r in doc.namespaces}
        self._written = doc.written
        for r in doc.namespaces:
            self.figures[r.namespace] = {"handed_over": len(r.pages), "adopted": 0,
                                         "discarded": 0, "held": 0}
        log.info("hand-over read: %d namespace(s), %d block(s)", len(doc.namespaces),
                 sum(len(r.pages) for r in doc.namespaces))

    def sweep(self, handover: bool) -> None:
        """At start: with `node.handover` off nothing will adopt a kept segment the
        hand-over does not name (no crash journal is read), so every other one of the
        deployment is unlinked now (a hand-over's are adopted as its namespaces start,
        at once). With it on they stay: a crashed namespace's journal needs them when it
        attaches again."""
        if handover:
            return
        gone = unlink_kept(self.base, keep={r.deployment_id for r in self._records.values()})
        if gone:
            log.info("swept %d kept segment(s) of deployment %r no hand-over names (left by "
                     "an earlier stop or crash; node.handover is off)", len(gone), self.base)

    def hellos(self) -> list[Hello]:
        """A HELLO for each namespace still to adopt, from its recorded geometry: its stack
        is started at once (`NodeServer._prestart`), not at its first engine's attach. A
        geometry that does not read back is skipped (its engines' HELLO starts it)."""
        out = []
        for rec in self._records.values():
            try:
                g = json.loads(rec.geometry)
                out.append(Hello(rec.namespace, dict(g["shape"]), int(g["block_size"]),
                                 str(g["hash_algo"]), str(g["hash_seed"]), int(g["ranks"]),
                                 0))
            except (ValueError, TypeError, KeyError):
                continue
        return out

    def take(self, namespace: str, deployment_id: str, geometry: dict[str, Any],
             page_bytes: int, host_blocks: int, ranks: int) -> NamespaceRecord | None:
        """The record of `namespace` if its stack can adopt it (same deployment id,
        geometry, ranks, page size and pool size), else None (one line, its kept segments
        unlinked, all its pages discarded). Taken once."""
        rec = self._records.pop(namespace, None)
        if rec is None:
            return None
        why = ("its deployment id differs" if rec.deployment_id != deployment_id else
               "its geometry differs" if rec.geometry != geometry_text(geometry) else
               f"{rec.ranks} ranks, now {ranks}" if rec.ranks != ranks else
               f"{rec.page_bytes}-byte pages, now {page_bytes}"
               if rec.page_bytes != page_bytes else
               f"{rec.host_blocks} host blocks, now {host_blocks}"
               if rec.host_blocks != host_blocks else "")
        if why:
            self.discard(rec, why)
            return None
        return rec

    def discard(self, rec: NamespaceRecord, why: str) -> None:
        unlink_kept(self.base, rec.deployment_id)
        self.figures[rec.namespace]["discarded"] = len(rec.pages)
        log.warning("namespace %r: hand-over of %d block(s) discarded, cold start: %s",
                    rec.namespace, len(rec.pages), why)

    def adopt(self, rec: NamespaceRecord, keyed: KeyedHostCache,
              inodes: list[int]) -> int:
        """The recorded pages made ready host copies of `keyed` (just started, empty) when
        every rank's segment now is the recorded inode and every page checks; else none
        (one line). Returns how many were adopted."""
        fig = self.figures[rec.namespace]
        if inodes != [s.inode for s in rec.segments]:
            self.discard(rec, f"the segments now are inodes {inodes}, recorded "
                         f"{[s.inode for s in rec.segments]} (not adopted by the workers)")
            return 0
        blocks = keyed.m.host_capacity
        pages: list[tuple[int, int, bytes | None, bool]] = []
        seen_pages: set[int] = set()
        has_storage = keyed.storage is not None
        for p in rec.pages:
            why = (f"page {p.page} out of 0..{blocks - 1}" if p.page >= blocks else
                   f"page {p.page} twice" if p.page in seen_pages else "")
            if why:
                self.discard(rec, why)
                return 0
            seen_pages.add(p.page)
            # a namespace without storage now: the pages are kept, their storage names not
            skey = p.storage_key if has_storage else None
            pages.append((engine_key(p.key), p.page, skey, p.stored and skey is not None))
        m = keyed.m
        t0 = time.perf_counter()
        try:
            with m.lock:
                m.adopt_host_copies(pages, time.monotonic())
                booked = self._rebook(rec, keyed)
        except KvtierError as e:
            self.discard(rec, str(e))
            return 0
        fig["adopted"] = len(pages)
        # the new workers' tables are empty: the path a replaced worker's takes
        marks = keyed.resend_storage_retention() if rec.marks else 0
        log.info("namespace %r: %d handed-over block(s) adopted, %d booked to %d tenant(s), "
                 "%d storage mark(s) sent again (%.1f ms)", rec.namespace, len(pages), booked,
                 len(rec.tenants), marks, (time.perf_counter() - t0) * 1e3)
        return len(pages)

    def _rebook(self, rec: NamespaceRecord, keyed: KeyedHostCache) -> int:
        """The adopted pages (ready copies, booked to nobody yet) booked to their tenants
        with their retention, the quotas restored and the storage marks recorded, all
        through the book's own calls (`set_quota`, `retain`: a copy nobody booked becomes
        the tenant's, in its priority's bucket, oldest first as handed over). A TTL runs on
        across the restart: the seconds left at the hand-over less the time since. Caller
        holds the keyed lock. Returns the pages booked."""
        book = keyed.tenants
        try:
            for t in rec.tenants:
                book.set_quota(t.name, t.quota)
            book.set_quota(None, rec.default_quota)
        except SteeringError as e:  # checked not to be (`_check_tenants`): one line
            log.warning("namespace %r: handed-over quotas not all restored: %s",
                        rec.namespace, e)
        now = time.monotonic()
        gone = max(0.0, time.time() - self._written)
        booked = 0
        # one `retain` per run of pages with the same tenant and retention (usually one)
        run: list[tuple[int, Any]] = []  # (key, node): the node service names no core type
        last: tuple[int, Retention] | None = None

        def flush() -> int:
            if not run or last is None:
                return 0
            name = rec.tenants[last[0]].name
            try:
                return book.retain(run, name, last[1], now)["applied"]
            except SteeringError as e:  # checked not to be (`_check_tenants`): one line
                log.warning("namespace %r: %d handed-over block(s) not booked to %r: %s",
                            rec.namespace, len(run), name, e)
                return 0

        for p in rec.pages:
            if p.tenant < 0:
                continue  # booked to none before either (a prefetched copy)
            key = engine_key(p.key)
            this = (p.tenant, Retention(p.pin, max(0.0, p.ttl_s - gone), p.priority))
            if this != last:
                booked += flush()
                run, last = [], this
            run.append((key, keyed.m.lookup(key)))
        booked += flush()
        if keyed.storage is not None:
            for k in rec.marks:
                left = k.ttl_s - gone
                if k.pin or left > 0 or k.priority != 0:
                    book.storage_marks.retain([k.key], Retention(
                        k.pin, max(0.0, left), k.priority), now)
        return booked

    def hold(self, rec: NamespaceRecord, keyed: KeyedHostCache, graves: Graves) -> int:
        """After `adopt`: the predecessor's abandoned stores still held at the hand-over
        taken out of `keyed`'s free list and held in `graves` until their deadlines (an
        engine's late copy lands in a page nobody else is given). Returns how many; those
        whose deadline passed are left free."""
        now = time.time()
        # one batch per deadline (the old service held one per abandonment)
        by_deadline: dict[float, list[HeldPage]] = {}
        for h in rec.held:
            if h.until > now:  # else its grace is over: the page is free
                by_deadline.setdefault(h.until, []).append(h)
        n = 0
        for until, batch in by_deadline.items():
            try:
                nodes = keyed.adopt_abandoned([(engine_key(h.key), h.page) for h in batch])
            except KvtierError as e:  # checked not to be (`_check_record`): one line
                log.warning("namespace %r: %d held page(s) not held: %s", rec.namespace,
                            len(batch), e)
                continue
            graves.hold(keyed, nodes, seconds=max(0.0, until - now))
            n += len(nodes)
        if n:
            self.figures[rec.namespace]["held"] = n
            log.info("namespace %r: %d abandoned store(s) of the old service held until "
                     "their deadline (at most %.1f s)", rec.namespace, n,
                     max(by_deadline) - now)
        return n

    def close(self) -> None:
        """Kept segments of namespaces that never attached again: unlinked."""
        for rec in list(self._records.values()):
            self.discard(rec, "its namespace did not attach before the service stopped")
        self._records.clear()
