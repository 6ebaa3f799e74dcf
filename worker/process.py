"""The worker process of one tensor-parallel rank: owns the rank's KV bytes, runs its tasks.

    python -m worker.process --spec '<json WorkerSpec>'
    python -m worker.process --spec-env NAME      (the JSON in environment variable NAME)

The launcher uses `--spec-env`: a spec may hold secrets (a Redis URL with a password), and a
process's environment is readable by its user only, its command line by everybody.

Started by the manager's launcher, one per rank. It attaches to the deployment's IPC names,
builds the device pool, the host pool (a shared-memory segment named after the deployment and
rank) and the storage backend, sets its ready flag, then loops:

* receive every task waiting in its queue (the receive refreshes the heartbeat), keep them in
  a priority heap (higher `priority` first, then arrival order);
* while the paused flag is set, hold every device transfer (storage tasks go on);
* run the best task, merged with the queued tasks of the same kind and priority into one
  batch (one copy for many tasks); H2D loads publish each layer as it lands;
* storage tasks (QUERY, PREFETCH, BACKUP, CLEAR) run on a second thread, so a slow store never
  holds up a device transfer;
* post one completion per task: ok, or failed with the error text — an exception in a task
  fails that task, never the loop; after a storage task, publish the backend's figures
  (corrupt and evicted pages, outages, bytes held) into the rank's flags for the admin.

With `workers.engine_kv` the device tier is the model runner's KV: the worker waits for the
rank's registration before it reports ready, and checks before every device task that the
registration is still current (a task fails with "engine KV registration of rank r is gone
(model runner pid N exited)" otherwise, and a new registration is attached when it appears).

Sleep (a weight update, see the "Sleep" section of `kvtier.worker.ipc`): when the manager
makes the pools generation odd, the worker fails every task it holds or receives from then on
("... the pools are freed ...; task cancelled"; a cancelled load is published as failed to
layer waiters), lets the storage thread finish the one task it may be running, frees its
device and host pools (the host segment is unlinked) and publishes the generation. When the
generation turns even again it re-creates the pools at the sizes the manager wrote (with
engine KV: attaches the runner's current registration) and publishes it; a failure is
published as the negated generation and logged, and the rank stays asleep.

    awake --(odd generation)--> cancelling --(storage thread idle)--> asleep (pools freed)
    asleep --(even generation)--> awake (pools re-created) | asleep (re-creation failed)

It exits on SIGTERM/SIGINT, or by itself when the manager stops beating (no orphans), and
always unlinks its host-pool segment on the way out.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback

from kvtier.worker.executor import MERGEABLE, STORAGE_KINDS, RankResources
from kvtier.worker.ipc import ManagerGone, WorkerIPC
from kvtier.worker.spec import WorkerSpec, host_segment_name
from kvtier.worker.wire import Completion, Task, TaskKind

__all__ = ["Worker", "WorkerSpec", "host_segment_name", "main"]

log = logging.getLogger("kvtier.worker")


class Worker:
    """One rank's task loop.

    Data structures: `_heap` of (-priority, arrival, task) for device tasks; `_storage_q` a
    FIFO of storage tasks for the storage thread; `_inflight` the number of tasks received and
    not yet answered (published in the rank's flags).
    Invariant: every task received is answered by exactly one completion.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self._stop = threading.Event()
        self._heap: list[tuple[int, int, Task]] = []
        self._arrival = itertools.count()
        self._storage_q: queue.Queue[Task | threading.Event | None] = queue.Queue()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.ipc = WorkerIPC(spec.deployment_id, spec.rank,
                             manager_timeout=spec.manager_timeout_s,
                             expect_instance=spec.ipc_instance)
        try:
            self.res = RankResources(spec, host_segment_name(spec.deployment_id, spec.rank))
        except BaseException:
            self.ipc.close()
            raise
        self.executor = self.res.executor
        self._asleep = False  # the pools are freed: every task fails (read by both threads)
        self._generation = 0  # the pools generation this worker reached
        self._storage_thread = threading.Thread(target=self._storage_loop, daemon=True,
                                                name=f"kvtier-storage-r{self.rank}")

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stop.set()

    def _beat_loop(self) -> None:
        """Keep the heartbeat fresh while the main loop is inside a long copy."""
        while not self._stop.wait(0.25):
            self.ipc.beat()

    def run(self) -> None:
        self._storage_thread.start()
        threading.Thread(target=self._beat_loop, daemon=True,
                         name=f"kvtier-beat-r{self.rank}").start()
        self._publish_storage_figures()
        self.ipc.publish_host_numa(self.res.numa.node if self.res.host is not None else None)
        generation, _, _ = self.ipc.pools_request()
        if generation % 2:  # started while the deployment sleeps
            self._sleep(generation)
        else:
            self._generation = generation
            self.ipc.publish_pools_generation(generation)
        self.ipc.set_ready(True)
        log.info("rank %d ready (pid %d, device %s, %d device / %d host blocks, storage %s)",
                 self.rank, os.getpid(), self.spec.device, self.spec.device_blocks,
                 self.spec.host_blocks, self.spec.storage_backend)
        try:
            while not self._stop.is_set():
                self._follow_pools()
                wait = 0.0 if self._heap and not self.ipc.paused else 0.2
                task = self.ipc.recv_task(timeout=wait)
                while task is not None:
                    self._accept(task)
                    task = self.ipc.recv_task(timeout=0)
                if self._heap and not self.ipc.paused:
                    self._run_best()
        except ManagerGone as e:
            log.warning("rank %d: %s; exiting", self.rank, e)
        finally:
            self._stop.set()  # ends the heartbeat thread before the IPC handles close
            self.ipc.set_ready(False)
            self._storage_q.put(None)
            self._storage_thread.join(timeout=5)

    def _accept(self, task: Task) -> None:
        with self._inflight_lock:
            self._inflight += 1
            self.ipc.set_inflight(self._inflight)
        if self._asleep:  # never touch a freed pool
            self._cancel(task)
        elif task.kind in STORAGE_KINDS:
            self._storage_q.put(task)
        else:
            heapq.heappush(self._heap, (-task.priority, next(self._arrival), task))

    def _answer(self, comp: Completion) -> None:
        self.ipc.post_completion(comp)
        with self._inflight_lock:
            self._inflight -= 1
            self.ipc.set_inflight(self._inflight)

    def _run_best(self) -> None:
        _, _, first = heapq.heappop(self._heap)
        batch = [first]
        if first.kind in MERGEABLE:
            while (self._heap and self._heap[0][2].kind == first.kind
                   and self._heap[0][2].priority == first.priority):
                batch.append(heapq.heappop(self._heap)[2])
        try:
            self.res.ensure_device()  # engine KV: the model runner's registration still holds
            results = self.executor.device_batch(first.kind, batch, self._layer_done)
        except Exception as e:  # a task fails; the loop goes on
            log.error("rank %d: %s task(s) %s failed: %s\n%s", self.rank, first.kind.name,
                      [t.seq for t in batch], e, traceback.format_exc())
            for t in batch:
                if t.kind == TaskKind.H2D:  # layer waiters outside the manager give up now
                    self.ipc.publish_load_failed(t.seq)
                self._answer(Completion(t.seq, self.rank, False, error=f"{type(e).__name__}: {e}"))
            return
        for t, (result, detail) in zip(batch, results, strict=True):
            self._answer(Completion(t.seq, self.rank, True, result, detail))

    def _cancel(self, task: Task) -> None:
        """Answer `task` failed without running it (the pools are or are about to be freed)."""
        if task.kind == TaskKind.H2D:  # layer waiters outside the manager give up now
            self.ipc.publish_load_failed(task.seq)
        self._answer(Completion(
            task.seq, self.rank, False,
            error=f"PoolsFreedError: rank {self.rank}: the pools are freed (the deployment is "
            f"asleep for a weight update); {task.kind.name} task cancelled"))

    # ------------------------------------------------------------------ sleep

    def _follow_pools(self) -> None:
        """Free or re-create the pools when the manager's pools generation changed."""
        generation, device_blocks, host_blocks = self.ipc.pools_request()
        if generation == self._generation:
            return
        if generation % 2:
            self._sleep(generation)
        else:
            self._wake(generation, device_blocks, host_blocks)

    def _sleep(self, generation: int) -> None:
        self._asleep = True
        cancelled = len(self._heap)
        while self._heap:
            self._cancel(heapq.heappop(self._heap)[2])
        parked = threading.Event()  # set by the storage thread once its queue is behind it
        self._storage_q.put(parked)
        while not parked.wait(5.0):  # a storage call is bounded by its backend's timeout
            log.warning("rank %d: sleep waits for a storage task to finish", self.rank)
        self.res.free_pools()
        self.executor = self.res.executor
        self.ipc.publish_host_numa(None)
        self._generation = generation
        self.ipc.publish_pools_generation(generation)
        log.info("rank %d asleep: %d queued task(s) cancelled, device and host pools freed",
                 self.rank, cancelled)

    def _wake(self, generation: int, device_blocks: int, host_blocks: int) -> None:
        self._generation = generation
        try:
            self.res.rebuild(device_blocks, host_blocks)
        except Exception as e:
            log.error("rank %d: re-creating the pools (%d device / %d host blocks) failed: "
                      "%s: %s", self.rank, device_blocks, host_blocks, type(e).__name__, e)
            self.ipc.publish_pools_generation(-generation)
            return
        self.executor = self.res.executor
        self.ipc.publish_host_numa(self.res.numa.node if self.res.host is not None else None)
        self._asleep = False
        self.ipc.publish_pools_generation(generation)
        log.info("rank %d awake: %d device / %d host blocks", self.rank, device_blocks,
                 host_blocks)

    def _layer_done(self, seqs: list[int], layer: int) -> None:
        for s in seqs:
            self.ipc.publish_layers_done(s, layer + 1)

    # ------------------------------------------------------------------ storage

    def _storage_loop(self) -> None:
        while True:
            task = self._storage_q.get()
            if task is None:
                return
            if isinstance(task, threading.Event):  # a sleep waits for this point
                task.set()
                continue
            if self._asleep:
                self._cancel(task)
                continue
            try:
                result = self.executor.storage_task(task)
            except Exception as e:
                log.error("rank %d: storage %s task %d failed: %s", self.rank, task.kind.name,
                          task.seq, e)
                self._publish_storage_figures()
                self._answer(Completion(task.seq, self.rank, False,
                                        error=f"{type(e).__name__}: {e}"))
                continue
            self._publish_storage_figures()  # before the answer: a reader of it sees them
            self._answer(Completion(task.seq, self.rank, True, result))

    def _publish_storage_figures(self) -> None:
        store = self.res.storage
        if store is not None:
            self.ipc.publish_storage_figures(store.stats())

    # ------------------------------------------------------------------ exit

    def close(self) -> None:
        """Release everything; the host segment is unlinked (idempotent)."""
        self.res.close()
        self.ipc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier-worker", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--spec", help="WorkerSpec as JSON")
    src.add_argument("--spec-env", metavar="NAME",
                     help="environment variable holding the WorkerSpec as JSON")
    args = ap.parse_args(argv)
    spec = WorkerSpec.from_json(args.spec if args.spec is not None
                                else os.environ.pop(args.spec_env))
    logging.basicConfig(level=os.environ.get("KVTIER_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s rank{spec.rank} %(levelname)s %(message)s",
                        stream=sys.stderr)
    if spec.device.startswith("cuda:"):
        # The whole process works for one GPU: make it the current device before anything
        # touches CUDA, so streams, events and the pinned host pool all belong to it.
        import torch

        index = int(spec.device[5:])
        if torch.cuda.is_available() and index < torch.cuda.device_count():
            torch.cuda.set_device(index)  # else the device pool refuses it in one line
    worker = Worker(spec)

    def on_signal(signum: int, _frame: object) -> None:
        log.info("rank %d: signal %d, stopping", spec.rank, signum)
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        worker.run()
    finally:
        worker.close()
        time.sleep(0)  # let log handlers flush before the interpreter goes
    return 0


if __name__ == "__main__":
    sys.exit(main())
