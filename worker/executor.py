"""What a rank does with a task: the one place that turns tasks into copies, content checks
and storage calls. The worker process runs it behind its queues; an engine that keeps its KV
in its own process can run it directly (`kvtier.worker.embedded`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvtier.worker import content
from kvtier.worker.copy_engine import CopyEngine
from kvtier.worker.delays import STORAGE_DELAY_ENV, delay_from_env
from kvtier.worker.engine_pool import EngineKVGone, EnginePool
from kvtier.worker.errors import KvtierError
from kvtier.worker.kv_pools import DeviceKV, DevicePool, HostPool
from kvtier.worker.spec import WorkerSpec
from kvtier.worker.storage.backend import StorageBackend
from kvtier.worker.storage.factory import make_backend
from kvtier.worker.wire import Task, TaskKind

log = logging.getLogger("kvtier.worker")

DEVICE_KINDS = frozenset({TaskKind.D2H, TaskKind.H2D, TaskKind.FILL, TaskKind.CHECK})
STORAGE_KINDS = frozenset({TaskKind.QUERY, TaskKind.PREFETCH, TaskKind.BACKUP, TaskKind.CLEAR})
MERGEABLE = frozenset({TaskKind.D2H, TaskKind.H2D})

"""Test hook: milliseconds to sleep before every storage read (QUERY, PREFETCH) on this rank,
so tests can show what each prefetch policy does with a slow store."""




class TaskExecutor:
    """Executes tasks on one rank's pools and storage backend.

    `device`, `host` (None: no host tier), `engine` (copies between them), `storage` (None:
    no storage tier). `backup_one_rank`: only rank 0 writes pages (every rank holds the same
    KV, as in MLA models), the others report success without writing. `storage_delay_s`
    (from `KVTIER_TEST_STORAGE_DELAY_MS`, read once) slows every storage read, for tests.
    """

    def __init__(self, rank: int, device: DeviceKV, host: HostPool | None,
                 storage: StorageBackend | None, *, backup_one_rank: bool = False) -> None:
        self.rank = rank
        self.device = device
        self.host = host
        self.storage = storage
        self.backup_one_rank = backup_one_rank
        self.engine = CopyEngine(device, host) if host is not None else None
        self.storage_delay_s = delay_from_env(STORAGE_DELAY_ENV)

    def set_device(self, device: DeviceKV) -> None:
        """Work on another device tier from the next task on (an engine's KV attached
        again after its model runner registered anew). Storage tasks never touch it."""
        self.device = device
        self.engine = CopyEngine(device, self.host) if self.host is not None else None

    def device_batch(self, kind: TaskKind, batch: list[Task],
                     on_layer_done: Callable[[list[int], int], None] | None = None,
                     ) -> list[tuple[int, list[int]]]:
        """Run same-kind device tasks as one batch; one (result, detail) per task.
        `on_layer_done(seqs, layer)` fires as each layer of an H2D batch lands."""
        if kind in (TaskKind.D2H, TaskKind.H2D):
            if self.engine is None:
                raise RuntimeError(f"{kind.name} needs a host tier, and this rank has none")
            src = [i for t in batch for i in t.src]
            dst = [i for t in batch for i in t.dst]
            if kind == TaskKind.D2H:
                self.engine.d2h(src, dst)
            else:
                seqs = [t.seq for t in batch]
                cb = None if on_layer_done is None else (lambda layer: on_layer_done(seqs, layer))
                events = getattr(self.device, "layer_events", None)  # an engine's CUDA KV
                self.engine.h2d(src, dst, cb, None if events is None else events.hook(seqs))
            return [(0, [])] * len(batch)
        if len(batch) != 1:
            raise ValueError(f"{kind.name} tasks are not merged")
        task = batch[0]
        if not (task.src or task.dst):
            return [(0, [])]  # nothing to fill or check
        if kind == TaskKind.FILL:
            content.fill(self.device, task.dst, task.keys, self.rank)
            return [(0, [])]
        if kind == TaskKind.CHECK:
            bad = content.check(self.device, task.src, task.keys, self.rank)
            return [(len(bad), bad)]
        raise ValueError(f"not a device task kind: {kind!r}")

    def storage_task(self, task: Task) -> int:
        """Run one storage task; returns its result (see `kvtier.worker.wire`). A backend that
        degrades to misses (Redis down, disk errors) answers anyway; the errors it counted
        during the call fail the task, so the manager counts storage errors by operation."""
        store = self.storage
        before = _backend_errors(store)
        result = self._storage_call(task)
        errors = _backend_errors(store) - before
        if errors:
            raise StorageError(
                f"storage {task.kind.name.lower()}: {errors} backend error(s) (see this rank's "
                f"log); {result} of {len(task.keys)} pages went through")
        return result

    def _storage_call(self, task: Task) -> int:
        store = self.storage
        if store is None:
            if task.kind in (TaskKind.QUERY, TaskKind.PREFETCH, TaskKind.CLEAR):
                return 0
            raise RuntimeError("no storage tier is configured on this rank")
        if self.storage_delay_s and task.kind in (TaskKind.QUERY, TaskKind.PREFETCH):
            time.sleep(self.storage_delay_s)
        if task.kind == TaskKind.QUERY:
            return store.leading_present(task.keys)
        if task.kind == TaskKind.CLEAR:
            return store.clear()
        host = self.host
        if host is None:
            raise RuntimeError(f"{task.kind.name} needs a host tier")
        if task.kind == TaskKind.PREFETCH:
            got = store.get_into(task.keys, [host.page_view(h) for h in task.dst])
            n = 0
            for ok in got:
                if not ok:
                    break
                n += 1
            return n
        if task.kind == TaskKind.BACKUP:
            if self.backup_one_rank and self.rank != 0:
                return len(task.keys)  # rank 0 writes the pages every rank shares
            return store.set(task.keys, [host.page_view(h) for h in task.src])
        raise ValueError(f"not a storage task kind: {task.kind!r}")


class RankResources:
    """One rank's device pool, host pool (the shared-memory segment `host_segment`), storage
    backend and executor, built from its spec; `close()` releases them all (idempotent) and
    unlinks the segment. Shared by the worker process and the embedded workers.

    With `spec.engine_kv` the device tier is the model runner's registered KV
    (`EnginePool`, waited for at most `spec.engine_kv_timeout_s`) instead of a `DevicePool`;
    `ensure_device()` checks it is still current before each device task."""

    def __init__(self, spec: WorkerSpec, host_segment: str) -> None:
        self.spec = spec
        self.host: HostPool | None = None
        self.storage: StorageBackend | None = None
        try:
            shape = spec.shape
            layout = None
            self.device: DeviceKV
            if spec.engine_kv:
                attached = EnginePool.attach(spec, spec.engine_kv_timeout_s)
                self.device, layout = attached, attached.layout
            else:
                self.device = DevicePool(shape, spec.device_blocks, spec.device)
            if spec.host_blocks:
                self.host = HostPool(shape, spec.host_blocks, host_segment)
            self.storage = make_backend(
                spec.storage_backend, namespace=spec.storage_namespace(layout),
                secret=spec.storage_secret_bytes, path=spec.storage_path, url=spec.storage_url,
                capacity_bytes=spec.storage_capacity_bytes, ttl_s=spec.storage_ttl_s,
                page_bytes=shape.page_bytes, timeout_s=spec.storage_timeout_s)
            self.executor = TaskExecutor(spec.rank, self.device, self.host, self.storage,
                                         backup_one_rank=spec.backup_one_rank)
        except BaseException:
            self.close()
            raise

    def ensure_device(self) -> None:
        """Before a device task: with engine KV, make sure the registration attached is the
        current one. A replaced registration (the model runner restarted) is attached in
        its place; one that is gone with none in its place raises EngineKVGone (the task
        fails with that reason; the next task looks again)."""
        dev = self.device
        if not isinstance(dev, EnginePool):
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


class StorageError(KvtierError, RuntimeError):
    """The storage backend reported errors during a task (it degraded to misses)."""


def _backend_errors(store: StorageBackend | None) -> int:
    if store is None:
        return 0
    return int(sum(v for k, v in store.stats().items()
                   if k.startswith("errors_") or k == "fast_failed_calls"))
