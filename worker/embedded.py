"""kvtier's worker side inside the engine's own process: every rank's pools and executor,
driven synchronously by the manager's dispatcher.

This module is the worker-level half of an embedded deployment: ranks built from
`WorkerSpec`s, tasks run on every rank, answers merged. It knows nothing of the manager
(the worker layer never imports it); the manager's `Stack(cfg, embedded=True)` is the one
place that turns a configuration into worker specs, builds these ranks, and puts the
manager on a dispatcher that calls `EmbeddedWorkers.execute`.

When to use it instead of the worker processes (the manager's default `Stack(cfg)`):

* the engine's model runner owns the KV memory and runs in one process (a single-process
  engine, a notebook, a test): its attention layers read `device_pool(rank).k_caches[layer]`
  directly, and there is nothing to attach to from another process;
* tests and examples that want real copies, real shared memory and real storage I/O without
  starting processes.

It runs the same `kvtier.worker.executor.TaskExecutor` the worker processes run, so the bytes moved
are the same; what is gone is the IPC (no queues, no heartbeats, no supervisor). Each task
runs to completion on every rank inside `Dispatcher.submit`, before the scheduler call that
emitted it returns, so a `LoadHandle` is already complete when `match` returns: per-layer
overlap of loads with compute is moot here. An engine that needs loads and backups to overlap
with compute, or a crashed rank to be replaced, uses the worker processes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.worker.executor import DEVICE_KINDS, STORAGE_KINDS, RankResources
from kvtier.worker.kv_pools import DevicePool
from kvtier.worker.spec import WorkerSpec
from kvtier.worker.wire import (
    MIN_RESULT_KINDS,
    SUM_RESULT_KINDS,
    Completion,
    Task,
    TaskKind,
    merge_results,
)

if TYPE_CHECKING:
    from kvtier.worker.kv_pools import HostPool
    from kvtier.worker.storage.backend import StorageBackend

log = logging.getLogger("kvtier.embedded")

# How per-rank results combine: the rule of worker.wire, as ProcessDispatcher applies it.
MIN_KINDS = MIN_RESULT_KINDS
SUM_KINDS = SUM_RESULT_KINDS


def embedded_host_segment_name(deployment_id: str, rank: int) -> str:
    """The host pool's shared-memory name; distinct from a worker process's segment, so an
    embedded deployment never collides with `kvtier serve` of the same id."""
    return f"/kvtier_{deployment_id}_emb_host_r{rank}"


class _Rank:
    """One rank's resources, and a task runner that never raises."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        if spec.engine_kv:
            raise ValueError(
                f"rank {spec.rank}: engine_kv needs worker processes; embedded ranks allocate "
                "the device pools the engine's model runner uses")
        self.res = RankResources(spec, embedded_host_segment_name(spec.deployment_id, spec.rank))
        device = self.res.device
        assert isinstance(device, DevicePool)  # engine_kv (PlanePool) is refused above
        self.device = device
        self.host = self.res.host
        self.storage = self.res.storage
        self.executor = self.res.executor

    def run(self, task: Task) -> Completion:
        """The task on this rank; an exception fails the task, never the caller."""
        rank = self.spec.rank
        try:
            if task.kind == TaskKind.REVOKE:
                return Completion(task.seq, rank, True, 0)  # every task here ran to its end
            if task.kind in STORAGE_KINDS:
                result, detail = self.executor.storage_task(task)
                return Completion(task.seq, rank, True, result, detail)
            if task.kind in DEVICE_KINDS:
                [(result, detail)] = self.executor.device_batch(task.kind, [task])
                return Completion(task.seq, rank, True, result, list(detail))
            raise ValueError(f"unknown task kind {task.kind!r}")
        except Exception as e:
            return Completion(task.seq, rank, False, error=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        self.res.close()
        self.host = self.storage = None


class EmbeddedWorkers:
    """The pools and executors of every rank of one deployment, in this process.

    Data structures: `_ranks[r]` holds rank r's DevicePool, HostPool (shared-memory segment
    `/kvtier_<deployment>_emb_host_r<rank>`, or None without a host tier), storage backend
    (or None) and TaskExecutor. `_lock` serialises `execute`, so a task runs on all ranks
    before the next one starts. Invariants: ranks are 0..n-1 with one KV shape and one
    deployment id; after `close()` no segment of these ranks exists and `execute` fails
    every task (it never raises: the manager must hear about each task exactly once).
    """

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        specs = list(specs)
        if not specs:
            raise ValueError("EmbeddedWorkers: at least one rank's WorkerSpec is needed")
        for i, s in enumerate(specs):
            if s.rank != i or s.num_ranks != len(specs):
                raise ValueError(
                    f"EmbeddedWorkers: spec {i} has rank {s.rank} of {s.num_ranks}; expected "
                    f"rank {i} of {len(specs)}")
            if s.deployment_id != specs[0].deployment_id or s.shape != specs[0].shape:
                raise ValueError(
                    f"EmbeddedWorkers: rank {i} differs from rank 0 in deployment id or KV "
                    f"shape ({s.deployment_id!r}, {s.shape} vs {specs[0].deployment_id!r}, "
                    f"{specs[0].shape})")
        self.deployment_id = specs[0].deployment_id
        self.shape = specs[0].shape
        self._lock = threading.Lock()
        self._ranks: list[_Rank] = []
        self._closed = False
        try:
            for s in specs:
                self._ranks.append(_Rank(s))
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ access

    @property
    def num_ranks(self) -> int:
        return len(self._ranks)

    def _rank(self, rank: int) -> _Rank:
        if self._closed:
            raise RuntimeError("embedded workers are closed")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self._ranks):
            raise ValueError(f"rank {rank!r} out of range [0, {len(self._ranks)})")
        return self._ranks[rank]

    def device_pool(self, rank: int = 0) -> DevicePool:
        """Rank `rank`'s device pool: the K/V tensors the model's attention reads and writes."""
        return self._rank(rank).device

    def host_pool(self, rank: int = 0) -> HostPool | None:
        return self._rank(rank).host

    def storage_backend(self, rank: int = 0) -> StorageBackend | None:
        return self._rank(rank).storage

    # ------------------------------------------------------------------ tasks

    def execute(self, task: Task) -> Completion:
        """Run `task` on every rank and merge the answers: ok only if every rank was ok;
        QUERY/PREFETCH/BACKUP results are the minimum over ranks, CLEAR's the sum, others the
        maximum; `detail` is the union; errors are joined, each naming its rank."""
        with self._lock:
            if self._closed:
                return Completion(task.seq, -1, False, error="embedded workers are closed")
            answers = [r.run(task) for r in self._ranks]
        result = answers[0].result
        for a in answers[1:]:
            result = merge_results(task.kind, result, a.result)
        detail = sorted({d for a in answers for d in a.detail})
        errors = "; ".join(f"rank {a.rank}: {a.error}" for a in answers if not a.ok)
        return Completion(task.seq, -1, all(a.ok for a in answers), result, detail, errors)

    # ------------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Close every rank's storage backend and unlink its host segment (idempotent)."""
        with self._lock:
            self._closed = True
            ranks, self._ranks = self._ranks, []
        for r in ranks:
            r.close()

    def __enter__(self) -> EmbeddedWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"EmbeddedWorkers(deployment={self.deployment_id!r}, ranks={self.num_ranks}, "
                f"shape={self.shape}, closed={self._closed})")
