"""What a rank does with a task: the one place that turns tasks into copies, content checks
and storage calls. The worker process runs it behind its queues; an engine that keeps its KV
in its own process can run it directly (`kvtier.worker.embedded`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import IntEnum

from kvtier.worker import content, numa
from kvtier.worker.copy_engine import CheckedIds, CopyEngine, LoadGate
from kvtier.worker.delays import (
    BACKUP_DELAY_ENV,
    PREFETCH_PAGE_DELAY_ENV,
    STORAGE_DELAY_ENV,
    STORAGE_WRITE_DELAY_ENV,
    delay_from_env,
)
from kvtier.worker.engine_pool import EngineKVGone, EnginePool
from kvtier.worker.errors import KvtierError
from kvtier.worker.kv_pools import DeviceKV, DevicePool, HostPool
from kvtier.worker.spec import WorkerSpec
from kvtier.worker.storage.backend import StorageBackend
from kvtier.worker.storage.factory import make_backend
from kvtier.worker.wire import RETAIN_SET, RETAIN_UNPIN, Task, TaskKind, key_tag

log = logging.getLogger("kvtier.worker")

DEVICE_KINDS = frozenset({TaskKind.D2H, TaskKind.H2D, TaskKind.FILL, TaskKind.CHECK})
STORAGE_KINDS = frozenset({TaskKind.QUERY, TaskKind.PREFETCH, TaskKind.BACKUP, TaskKind.CLEAR,
                           TaskKind.LIST, TaskKind.DELETE, TaskKind.RETAIN})
MERGEABLE = frozenset({TaskKind.D2H, TaskKind.H2D})


CHECKED_KEPT = 1024
"""Prechecked tasks kept at most (`TaskExecutor.precheck`): far more than a worker has in
flight; tasks cancelled before they ran leave theirs until they age out."""


class TaskClass(IntEnum):
    """The lanes of a worker: each has its own queue and thread, so a task of one class never
    waits behind a task of another. Loads are what a request waits on; a backup of 512 blocks
    or a slow storage write must not hold them (nor a storage hit query) up."""

    LOAD = 1  # H2D, and the FILL / CHECK diagnostics (a request waits on them)
    BACKUP = 2  # D2H: write-through backups and write-back demotions
    STORAGE_READ = 3  # QUERY, PREFETCH
    STORAGE_WRITE = 4  # BACKUP (host -> storage), CLEAR, DELETE, LIST, RETAIN (background)


TASK_CLASSES: dict[TaskKind, TaskClass] = {
    TaskKind.H2D: TaskClass.LOAD,
    TaskKind.FILL: TaskClass.LOAD,
    TaskKind.CHECK: TaskClass.LOAD,
    TaskKind.D2H: TaskClass.BACKUP,
    TaskKind.QUERY: TaskClass.STORAGE_READ,
    TaskKind.PREFETCH: TaskClass.STORAGE_READ,
    TaskKind.BACKUP: TaskClass.STORAGE_WRITE,
    TaskKind.CLEAR: TaskClass.STORAGE_WRITE,
    # A DELETE runs on the write lane after every BACKUP sent before it (same priority, FIFO
    # within it): a page being backed up when its block was removed is written, then deleted.
    TaskKind.DELETE: TaskClass.STORAGE_WRITE,
    # A listing is background work like a write: a scan of a large store (a scandir per
    # shard, or SCAN round trips) must not hold up the queries and prefetches a request
    # waits on, so it runs on the niced write lane, never on the read lane.
    TaskKind.LIST: TaskClass.STORAGE_WRITE,
    # A RETAIN runs in order with the backups (same lane, FIFO within a priority): one sent
    # before a page's backup marks it first, so the backup is written with its retention.
    TaskKind.RETAIN: TaskClass.STORAGE_WRITE,
}
"""The lane of every task kind but REVOKE, which a worker applies as it receives it."""

# A PREFETCH reads its pages in batches of about this many bytes and looks for a revoke
# between batches: large enough that the file backend's I/O threads and a Redis pipeline
# stay busy (a batch is one backend call), small enough that a revoked prefetch stops within
# a few milliseconds of storage time.
PREFETCH_BATCH_BYTES = 8 << 20

# The backend error counters (`errors_<op>`) each task kind may raise: with storage reads
# and writes on two threads, a task is failed only by errors of its own operations.
_TASK_OPS: dict[TaskKind, tuple[str, ...]] = {
    TaskKind.QUERY: ("exists",),
    TaskKind.PREFETCH: ("get", "delete"),  # a damaged page is deleted as it is read
    TaskKind.BACKUP: ("set", "delete"),  # the file backend deletes pages beyond capacity
    TaskKind.CLEAR: ("clear", "delete"),
    TaskKind.DELETE: ("delete",),
    TaskKind.LIST: ("list",),
    TaskKind.RETAIN: ("retain",),
}

# A LIST reads the backend's listing in batches of this many keys (one scandir of a few
# shards, or one SCAN round trip) and gives up (answers 0: the manager's index then stays
# incomplete) once it took longer than LIST_BUDGET_S: a Redis shared with other applications
# may hold millions of other keys, which SCAN walks too.
LIST_BATCH_KEYS = 4096
LIST_BUDGET_S = 5.0


class TaskExecutor:
    """Executes tasks on one rank's pools and storage backend.

    `device`, `host` (None: no host tier), `engine` (copies between them), `storage` (None:
    no storage tier). `backup_one_rank`: only rank 0 writes pages (every rank holds the same
    KV, as in MLA models), the others report success without writing. Test hooks, read once
    from the environment (`kvtier.worker.delays`): `storage_delay_s` slows every storage
    read, `storage_write_delay_s` every BACKUP and CLEAR, `prefetch_page_delay_s` every page
    a PREFETCH reads (one page a batch then), `backup_delay_s` every D2H batch.

    `_checked` (under `_checked_lock`): seq -> `CheckedIds` of D2H/H2D tasks checked on
    receipt (`precheck`, the receiver thread), taken by `device_batch` (a batch of one
    task); at most `CHECKED_KEPT`, oldest dropped; a missing or stale entry only means the
    copy checks its ids itself.

    Thread safety: the worker runs each `TaskClass` on its own thread, so `device_batch` may
    run a D2H and an H2D at once (the copy engine orders their steps) and `storage_task` a
    read and a write at once (backends are thread-safe).
    """

    def __init__(self, rank: int, device: DeviceKV, host: HostPool | None,
                 storage: StorageBackend | None, *, backup_one_rank: bool = False) -> None:
        self.rank = rank
        self.device: DeviceKV | None = device
        self.host = host
        self.storage = storage
        self.backup_one_rank = backup_one_rank
        self.load_gate = LoadGate()  # shared by every copy engine of this rank
        self.engine = (CopyEngine(device, host, gate=self.load_gate) if host is not None
                       else None)
        self.storage_delay_s = delay_from_env(STORAGE_DELAY_ENV)
        self.storage_write_delay_s = delay_from_env(STORAGE_WRITE_DELAY_ENV)
        self.prefetch_page_delay_s = delay_from_env(PREFETCH_PAGE_DELAY_ENV)
        self.backup_delay_s = delay_from_env(BACKUP_DELAY_ENV)
        self.freed = False  # the pools were released (sleep): no task may run on them
        # D2H/H2D ids checked on receipt (`precheck`), by seq; bounded (oldest dropped): an
        # entry only saves the copy its check, a missing one is checked on the copy path
        self._checked: OrderedDict[int, CheckedIds] = OrderedDict()
        self._checked_lock = threading.Lock()

    def release_pools(self) -> None:
        """Drop every reference to the device and host pools (a sleep frees them); from now
        on every task that would touch them fails with PoolsFreedError."""
        self.freed = True
        self.device = None
        self.host = None
        self.engine = None
        self._forget_checked()

    def _forget_checked(self) -> None:
        """Drop the prechecked ids: each holds the engine it was checked against, so an
        entry left by a task cancelled before it ran (a sleep's held load) would keep the
        freed pools mapped (tests/test_sleep.py saw the host pool stay mapped, deleted)."""
        with self._checked_lock:
            self._checked.clear()

    def _freed_error(self, kind: TaskKind) -> PoolsFreedError:
        return PoolsFreedError(
            f"rank {self.rank}: {kind.name} refused: the pools are freed (the deployment is "
            "asleep for a weight update); task cancelled")

    def set_device(self, device: DeviceKV) -> None:
        """Work on another device tier from the next task on (an engine's KV attached
        again after its model runner registered anew). Storage tasks never touch it."""
        self.device = device
        self.engine = (CopyEngine(device, self.host, gate=self.load_gate)
                       if self.host is not None else None)
        self._forget_checked()  # checked against the old engine: rechecked, and let go

    def precheck(self, task: Task) -> None:
        """Check a D2H or H2D task's block ids when the worker receives it (the receiver
        thread), so its lane's copy starts without checking them (H100: the two checks of
        a 64-block copy were 41 us of the ~200 us of host time before its first launch).
        Bad ids are left to the copy path, which fails the task with the same one-line
        error; other kinds are ignored."""
        engine = self.engine
        if engine is None or task.kind not in (TaskKind.D2H, TaskKind.H2D):
            return
        op = "d2h" if task.kind == TaskKind.D2H else "h2d"
        try:
            checked = engine.check(op, task.src, task.dst)
        except ValueError:
            return
        with self._checked_lock:
            self._checked[task.seq] = checked
            while len(self._checked) > CHECKED_KEPT:
                self._checked.popitem(last=False)

    def _take_checked(self, batch: list[Task]) -> CheckedIds | None:
        """The ids `precheck` left for a batch of one task (merged batches are checked
        whole: two tasks' destinations must not overlap either)."""
        with self._checked_lock:
            got = [self._checked.pop(t.seq, None) for t in batch]
        return got[0] if len(got) == 1 else None

    def device_batch(self, kind: TaskKind, batch: list[Task],
                     on_layer_done: Callable[[list[int], int], None] | None = None,
                     ) -> list[tuple[int, list[int]]]:
        """Run same-kind device tasks as one batch; one (result, detail) per task.
        `on_layer_done(seqs, layer)` fires as each layer of an H2D batch lands."""
        device = self.device
        if device is None:
            raise self._freed_error(kind)
        if kind in (TaskKind.D2H, TaskKind.H2D):
            if self.engine is None:
                raise RuntimeError(f"{kind.name} needs a host tier, and this rank has none")
            engine = self.engine  # set_device may swap it; this batch keeps its own
            checked = self._take_checked(batch)
            if checked is None:  # re-checked by the engine if made against another one
                src = [i for t in batch for i in t.src]
                dst = [i for t in batch for i in t.dst]
                checked = engine.check("d2h" if kind == TaskKind.D2H else "h2d", src, dst)
            if kind == TaskKind.D2H:
                if self.backup_delay_s:
                    time.sleep(self.backup_delay_s)
                engine.d2h_checked(checked)
            else:
                seqs = [t.seq for t in batch]
                cb = None if on_layer_done is None else (lambda layer: on_layer_done(seqs, layer))
                events = getattr(self.device, "layer_events", None)  # an engine's CUDA KV
                engine.h2d_checked(checked, cb, None if events is None else events.hook(seqs))
            return [(0, [])] * len(batch)
        if len(batch) != 1:
            raise ValueError(f"{kind.name} tasks are not merged")
        task = batch[0]
        if not (task.src or task.dst):
            return [(0, [])]  # nothing to fill or check
        if kind == TaskKind.FILL:
            content.fill(device, task.dst, task.keys, self.rank)
            return [(0, [])]
        if kind == TaskKind.CHECK:
            bad = content.check(device, task.src, task.keys, self.rank)
            return [(len(bad), bad)]
        raise ValueError(f"not a device task kind: {kind!r}")

    def storage_task(self, task: Task, revoked: Callable[[int], bool] | None = None,
                     ) -> tuple[int, list[int]]:
        """Run one storage task; returns its result and detail (see `kvtier.worker.wire`). A
        backend that degrades to misses (Redis down, disk errors) answers anyway; the errors it
        counted during the call fail the task, so the manager counts storage errors by
        operation.
        `revoked(seq)`: a PREFETCH asks it before each page batch and, once it says True,
        stops and answers with the pages read so far."""
        store = self.storage
        ops = _TASK_OPS.get(task.kind, ())
        before = _backend_errors(store, ops)
        detail: list[int] = []
        if task.kind == TaskKind.LIST:
            result, detail = self._list(task, store)
        else:
            result = self._storage_call(task, revoked)
        errors = _backend_errors(store, ops) - before
        if errors:
            raise StorageError(
                f"storage {task.kind.name.lower()}: {errors} backend error(s) (see this rank's "
                f"log); {result} of {len(task.keys)} pages went through")
        return result, detail

    def _list(self, task: Task, store: StorageBackend | None) -> tuple[int, list[int]]:
        """LIST: (1, the key tag of every page) on rank 0, (1, []) on the others (see
        `kvtier.worker.wire`); (0, []) when the listing has more than `task.src[0]` pages,
        outlasts `LIST_BUDGET_S`, or there is no backend."""
        if store is None:
            return 0, []
        if self.rank != 0:
            return 1, []
        limit = int(task.src[0]) if len(task.src) else 0
        deadline = time.monotonic() + LIST_BUDGET_S
        tags: set[int] = set()  # a key may come twice (SCAN)
        cursor = 0
        while True:
            keys, cursor = store.list_keys(cursor, LIST_BATCH_KEYS)
            tags.update(key_tag(k) for k in keys)
            if len(tags) > limit:
                return 0, []
            if cursor == 0:
                return 1, sorted(tags)
            if time.monotonic() > deadline:
                log.warning("rank %d: listing storage took over %.0f s; stopped after %d "
                            "pages", self.rank, LIST_BUDGET_S, len(tags))
                return 0, []

    def _storage_call(self, task: Task, revoked: Callable[[int], bool] | None) -> int:
        store = self.storage
        if store is None:
            if task.kind in (TaskKind.QUERY, TaskKind.PREFETCH, TaskKind.CLEAR,
                             TaskKind.DELETE, TaskKind.RETAIN):
                return 0
            raise RuntimeError("no storage tier is configured on this rank")
        if self.storage_delay_s and task.kind in (TaskKind.QUERY, TaskKind.PREFETCH):
            time.sleep(self.storage_delay_s)
        if task.kind == TaskKind.QUERY:
            return store.leading_present(task.keys)
        if task.kind == TaskKind.CLEAR:
            if self.storage_write_delay_s:  # a slow clear (a large store) for the tests
                time.sleep(self.storage_write_delay_s)
            return store.clear()
        if task.kind == TaskKind.DELETE:
            return store.delete(task.keys)
        if task.kind == TaskKind.RETAIN:
            return _retain(store, task)
        host = self.host
        if host is None:
            if self.freed:
                raise self._freed_error(task.kind)
            raise RuntimeError(f"{task.kind.name} needs a host tier")
        if task.kind == TaskKind.PREFETCH:
            return self._prefetch(task, store, host, revoked)
        if task.kind == TaskKind.BACKUP:
            if self.storage_write_delay_s:
                time.sleep(self.storage_write_delay_s)
            if self.backup_one_rank and self.rank != 0:
                return len(task.keys)  # rank 0 writes the pages every rank shares
            return store.set(task.keys, [host.page_view(h) for h in task.src])
        raise ValueError(f"not a storage task kind: {task.kind!r}")

    def _prefetch(self, task: Task, store: StorageBackend, host: HostPool,
                  revoked: Callable[[int], bool] | None) -> int:
        """Read the task's pages into its host blocks batch by batch; stop at the first page
        missing or damaged, or once the task is revoked. Returns the leading pages read."""
        keys, dst = task.keys, task.dst
        per_batch = max(1, PREFETCH_BATCH_BYTES // max(1, host.shape.page_bytes))
        if self.prefetch_page_delay_s:
            per_batch = 1
        n = 0
        while n < len(keys):
            if revoked is not None and revoked(task.seq):
                break
            part = keys[n : n + per_batch]
            got = store.get_into(part, [host.page_view(h) for h in dst[n : n + len(part)]])
            if self.prefetch_page_delay_s:
                time.sleep(self.prefetch_page_delay_s)
            lead = 0
            for ok in got:
                if not ok:
                    break
                lead += 1
            n += lead
            if lead < len(part):
                break
        return n


def _retain(store: StorageBackend, task: Task) -> int:
    """RETAIN (`kvtier.worker.wire`): mark or unpin the task's pages; the pages marked."""
    if len(task.src) != 4:
        raise ValueError(f"RETAIN needs [mode, pin, ttl_ms, priority], got {len(task.src)} "
                         "values")
    mode, pin, ttl_ms, priority = (int(v) for v in task.src)
    if mode == RETAIN_UNPIN:
        return store.unpin(task.keys)
    if mode != RETAIN_SET:
        raise ValueError(f"RETAIN mode {mode} is unknown (1: retain, 2: unpin)")
    return store.retain(task.keys, pin=bool(pin), ttl_s=ttl_ms / 1000, priority=priority)


class RankResources:
    """One rank's device pool, host pool (the shared-memory segment `host_segment`), storage
    backend and executor, built from its spec; `close()` releases them all (idempotent) and
    unlinks the segment. Shared by the worker process and the embedded workers.

    With `spec.engine_kv` the device tier is the model runner's registered KV
    (`EnginePool`, waited for at most `spec.engine_kv_timeout_s`) instead of a `DevicePool`;
    `ensure_device()` checks it is still current before each device task. The host pool is
    bound to the NUMA node `numa` names (`workers.host_numa`; `topology` reads a fake sysfs
    in tests)."""

    def __init__(self, spec: WorkerSpec, host_segment: str,
                 topology: numa.Topology | None = None) -> None:
        self.spec = spec
        self.host_segment = host_segment
        self.host: HostPool | None = None
        self.storage: StorageBackend | None = None
        self.device: DeviceKV | None = None
        try:
            shape = spec.shape
            layout = None
            if spec.engine_kv:
                attached = EnginePool.attach(spec, spec.engine_kv_timeout_s)
                self.device, layout = attached, attached.layout
            else:
                self.device = DevicePool(shape, spec.device_blocks, spec.device)
            self.layout = layout
            self.topology = topology
            self.numa = self._numa_choice(self.device, topology)
            if spec.host_blocks:
                self.host = HostPool(shape, spec.host_blocks, host_segment, self.numa.node,
                                     adopt=spec.host_adopt)
            self.storage = make_backend(
                spec.storage_backend, namespace=spec.storage_namespace(layout),
                secret=spec.storage_secret_bytes, path=spec.storage_path, url=spec.storage_url,
                capacity_bytes=spec.storage_capacity_bytes, ttl_s=spec.storage_ttl_s,
                page_bytes=shape.page_bytes, timeout_s=spec.storage_timeout_s,
                keys=spec.storage_keys(), compression=spec.storage_compression)
            self.executor = TaskExecutor(spec.rank, self.device, self.host, self.storage,
                                         backup_one_rank=spec.backup_one_rank)
        except BaseException:
            self.close()
            raise

    def _numa_choice(self, device_kv: DeviceKV,
                     topology: numa.Topology | None) -> numa.NumaChoice:
        """The NUMA node of the host pool (`workers.host_numa`), logged with the reason."""
        spec = self.spec
        setting = numa.check_setting(spec.host_numa)
        where = device_kv.device
        device = str(where)
        pci = None
        if setting == "auto" and where.type == "cuda":
            pci = numa.cuda_pci_address(where.index or 0, topology)
        choice = numa.choose_node(setting, device, topology, pci)
        if spec.host_blocks:
            log.info("rank %d: host pool %s (%s)", spec.rank, "not bound to a NUMA node"
                     if choice.node is None else f"on NUMA node {choice.node}", choice.reason)
        return choice

    def device_current(self) -> bool:
        """Whether the device tier attached is still good to use (always, unless it is an
        engine's KV whose registration changed or went away: then `ensure_device`)."""
        dev = self.device
        return not isinstance(dev, EnginePool) or dev.problem() is None

    def ensure_device(self) -> None:
        """Before a device task: with engine KV, make sure the registration attached is the
        current one. A replaced registration (the model runner restarted) is attached in
        its place; one that is gone with none in its place raises EngineKVGone (the task
        fails with that reason; the next task looks again)."""
        dev = self.device
        if not isinstance(dev, EnginePool) or self.executor.freed:
            return
        reason = dev.problem()
        if reason is None:
            return
        fresh = EnginePool.try_attach(self.spec)
        if fresh is not None and fresh.layout != dev.layout:
            raise EngineKVGone(
                f"{reason}; the new registration has layout {fresh.layout!r} but this rank's "
                f"host and storage pages are in layout {dev.layout!r}: restart the stack")
        dev.close()
        if fresh is None:
            self.executor.engine = None  # drop every view of the runner's memory
            raise EngineKVGone(reason)
        log.warning("rank %d: %s; attached the new registration of pid %d", self.spec.rank,
                    reason, fresh.record.owner_pid)
        self.device = fresh
        self.executor.set_device(fresh)

    def free_pools(self) -> None:
        """Release the device pool (or the engine's KV, attached) and the host pool, whose
        segment is unlinked: the memory goes back to the system (sleep). Idempotent."""
        self.executor.release_pools()
        if isinstance(self.device, EnginePool):
            self.device.close()
        self.device = None
        if self.host is not None:
            self.host.close()
            self.host = None
        # Views caught in reference cycles keep their mappings until collected: without this
        # the engine KV segments stayed mapped in the worker after a sleep (test_sleep).
        gc.collect()
        if self.spec.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()  # hand the device pool back to the driver, not the cache

    def rebuild(self, device_blocks: int, host_blocks: int) -> None:
        """Re-create freed pools at these sizes (wake); the storage backend is kept. With
        engine KV the current registration is attached (its layout must be the same).
        On failure the pools stay freed and the error propagates."""
        if self.device is not None:
            self.free_pools()
        spec = dataclasses.replace(self.spec, device_blocks=device_blocks,
                                   host_blocks=host_blocks)
        shape = spec.shape
        device: DeviceKV
        if spec.engine_kv:
            attached = EnginePool.attach(spec, spec.engine_kv_timeout_s)
            if attached.layout != self.layout:
                attached.close()
                raise EngineKVGone(
                    f"rank {spec.rank}: the new registration has layout {attached.layout!r} "
                    f"but this rank's storage pages are in layout {self.layout!r}")
            device = attached
        else:
            device = DevicePool(shape, device_blocks, spec.device)
        try:
            choice = self._numa_choice(device, self.topology)
            host = (HostPool(shape, host_blocks, self.host_segment, choice.node)
                    if host_blocks else None)
        except BaseException:
            if isinstance(device, EnginePool):
                device.close()
            raise
        self.spec, self.device, self.host, self.numa = spec, device, host, choice
        self.executor = TaskExecutor(spec.rank, device, host, self.storage,
                                     backup_one_rank=spec.backup_one_rank)

    def close(self) -> None:
        if isinstance(self.device, EnginePool):
            self.device.close()
        if self.storage is not None:
            try:
                self.storage.close()
            except Exception as e:  # closing must go on to the host segment
                log.warning("rank %d: closing storage: %s", self.spec.rank, e)
            self.storage = None
        if self.host is not None:
            self.host.close()
            self.host = None


class PoolsFreedError(KvtierError, RuntimeError):
    """A task reached a rank whose pools are freed (the deployment sleeps)."""


class StorageError(KvtierError, RuntimeError):
    """The storage backend reported errors during a task (it degraded to misses)."""


def _backend_errors(store: StorageBackend | None, ops: tuple[str, ...]) -> int:
    """The backend's error count of operations `ops` (every failed call, a fast-failed one
    during a Redis outage included, counts one `errors_<op>`)."""
    if store is None:
        return 0
    stats = store.stats()
    return int(sum(stats.get(f"errors_{op}", 0) for op in ops))
