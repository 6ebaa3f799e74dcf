"""The worker process of one tensor-parallel rank: owns the rank's KV bytes, runs its tasks.

    python -m worker.process --spec '<json WorkerSpec>'
    python -m worker.process --spec-env NAME      (the JSON in environment variable NAME)
    python -m worker.process --spec-stdin         (a warm worker: the JSON on stdin, later)

The launcher uses `--spec-env`: a spec may hold secrets (a Redis URL with a password), and a
process's environment is readable by its user only, its command line by everybody.

Started by the manager's launcher, one per rank. It attaches to the deployment's IPC names,
builds the device pool, the host pool (a shared-memory segment named after the deployment and
rank) and the storage backend, sets its ready flag, then runs five threads:

* the receiver (the main thread) takes every task off the rank's queue as it arrives (the
  receive refreshes the heartbeat) and hands it to the lane of its class
  (`kvtier.worker.executor.TASK_CLASSES`); it never runs a task, so a task is never left in
  the queue behind a long copy. A REVOKE is applied right there (see below);
* four lanes, one thread each, so no class of task waits behind another: **load** (H2D, and
  the FILL/CHECK diagnostics), **backup** (D2H), **storage read** (QUERY, PREFETCH) and
  **storage write** (BACKUP, CLEAR, and LIST: a listing of what storage holds, background
  work like a write). A 512-block backup or a slow storage write never holds up a load or a
  storage hit query queued after it. On the CPU the copy engine lets a load's
  copy steps go before a backup's (a backup waits between its ~4 MiB steps while a load
  runs); on CUDA they run on two streams, the load stream at the higher priority;
* within a lane, tasks wait in a priority heap (higher `priority` first, then arrival order);
  a device lane runs the best task merged with the queued tasks of the same kind and priority
  into one batch (one copy for many tasks); H2D loads publish each layer as it lands;
* while the paused flag is set, the device lanes hold their tasks (storage lanes go on);
* every task gets one completion: ok, or failed with the error text -- an exception in a
  task fails that task, never its lane; after a storage task, the backend's figures
  (corrupt and evicted pages, outages, bytes held) are published into the rank's flags.

Revoke (a scheduler cancelled a prefetch): the receiver marks the PREFETCH seqs a REVOKE
names that this rank still holds; the storage-read lane checks the mark before every page
batch, so a revoked prefetch stops after the batch it is reading (one not started reads
nothing) and answers with the pages it read; the manager keeps those and frees the rest.

Sleep (a weight update, see the "Sleep" section of `kvtier.worker.ipc.control`): when the manager
makes the pools generation odd, the worker fails every task it holds or receives from then on
("... the pools are freed ...; task cancelled"; a cancelled load is published as failed to
layer waiters), waits until no lane is inside a batch (a storage call is bounded by its
backend's timeout), frees its device and host pools (the host segment is unlinked) and
publishes the generation. When the generation turns even again it re-creates the pools at the
sizes the manager wrote (with engine KV: attaches the runner's current registration) and
publishes it; a failure is published as the negated generation and logged, and the rank stays
asleep.

    awake --(odd generation)--> cancelling --(every lane idle)--> asleep (pools freed)
    asleep --(even generation)--> awake (pools re-created) | asleep (re-creation failed)

With `workers.engine_kv` the device tier is the model runner's KV: the worker waits for the
rank's registration before it reports ready, and checks before every device task that the
registration is still current (a task fails with "engine KV registration of rank r is gone
(model runner pid N exited)" otherwise, and a new registration is attached when it appears).

It exits on SIGTERM/SIGINT, or by itself when the manager stops beating (no orphans), and
always unlinks its host-pool segment on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import itertools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator

from kvtier.worker.errors import KvtierError
from kvtier.worker.executor import MERGEABLE, TASK_CLASSES, RankResources, TaskClass
from kvtier.worker.ipc import ManagerGone, WorkerIPC
from kvtier.worker.spec import (
    REFUSED_EXIT,
    REFUSED_PREFIX,
    WARM_LINE,
    WorkerSpec,
    host_segment_name,
)
from kvtier.worker.wire import Completion, Task, TaskKind

__all__ = ["Worker", "WorkerSpec", "host_segment_name", "main"]

log = logging.getLogger("kvtier.worker")


BACKGROUND_LANES = frozenset({TaskClass.BACKUP, TaskClass.STORAGE_WRITE})
"""Lanes whose thread runs at a lower CPU priority: nobody waits on a D2H backup nor on a
storage write (issue 25: on a low-reuse workload every new block is written to storage, on the
cores the engine computes on). Storage writes run in the lane's own thread only (the file
backend's `set` never hands pages to its I/O threads, which reads share and which would
inherit the nice value if a write started them)."""
# Nice value of the backup lane's thread (and of the copy threads it starts: on Linux a
# thread's nice value is its own and new threads inherit it). On a busy machine the receiver,
# the load lane and the manager then get a core first when they wake. Measured with
# bench/load_under_backup.py on 2 cores shared with other jobs (load average 5-7.5): a load
# under a 512-block backup at 1.8-3.5x an idle worker's latency (median of paired ratios)
# with every lane at one priority, 0.95-1.4x in 10 of 11 runs with this (nice 19 measured
# the same). Backups still use every idle cycle.
# The copy engine never makes a load wait for a backup's lock (that would be a priority
# inversion); what is left is the GIL, which a backup holds only between two copy calls.
BACKGROUND_NICE = 10


def _lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (never needs a privilege)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (OSError, AttributeError) as e:  # not Linux: every lane at one priority
        log.debug("could not lower the priority of %s: %s", threading.current_thread().name, e)


def _use_cuda_device(device: str) -> None:
    """Make `cuda:N` the calling thread's current CUDA device (as `main` does for the main
    thread), so what a copy allocates or records without naming a device lands on it."""
    if not device.startswith("cuda:"):
        return
    import torch

    index = int(device[5:])
    if torch.cuda.is_available() and index < torch.cuda.device_count():
        torch.cuda.set_device(index)


class _Lane:
    """One class of tasks and the thread that runs them.

    Data structures: `heap` of (-priority, arrival, task); `cond` guards it and wakes the
    thread; `running` is True from the moment a batch is taken until it was answered (a sleep
    waits for it to drop). Invariant: a task put here is taken exactly once (`take`), unless
    the worker stops or sleeps first. A lane that `holds_on_pause` takes nothing while the
    manager's paused flag is set (it looks at the flag every 50 ms then)."""

    def __init__(self, cls: TaskClass, holds_on_pause: bool) -> None:
        self.cls = cls
        self.holds_on_pause = holds_on_pause
        self.heap: list[tuple[int, int, Task]] = []
        self.cond = threading.Condition()
        self.running = False

    def put(self, task: Task, arrival: int) -> None:
        with self.cond:
            heapq.heappush(self.heap, (-task.priority, arrival, task))
            self.cond.notify()

    def take(self, stop: threading.Event, paused: Callable[[], bool]) -> list[Task] | None:
        """The next batch: the best task, merged with queued tasks of its kind and priority
        when its kind merges. None once `stop` is set."""
        with self.cond:
            while True:
                if stop.is_set():
                    return None
                if self.heap and not (self.holds_on_pause and paused()):
                    break
                self.cond.wait(0.05 if self.heap else 0.25)
            _, _, first = heapq.heappop(self.heap)
            self.running = True
            batch = [first]
            if first.kind in MERGEABLE:
                heap = self.heap
                while (heap and heap[0][2].kind == first.kind
                       and heap[0][2].priority == first.priority):
                    batch.append(heapq.heappop(heap)[2])
            return batch

    def done(self) -> None:
        """The batch `take` gave was answered."""
        with self.cond:
            self.running = False
            self.cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no batch of this lane is in progress (True) or `timeout` passed."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.running, timeout)

    def drop_all(self) -> list[Task]:
        """The worker stops: empty the heap (returns what was in it) and wake the thread."""
        with self.cond:
            dropped = [t for _, _, t in self.heap]
            self.heap.clear()
            self.cond.notify_all()
            return dropped


class _DeviceUse:
    """Device lanes share the device tier; re-attaching an engine's KV (its model runner
    registered anew) replaces it and closes the old mapping, so it waits until no lane is
    inside a batch. A small readers/writer lock: `use()` shared, `exclusive()` alone."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._users = 0
        self._writer = False

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._users += 1
        try:
            yield
        finally:
            with self._cond:
                self._users -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._users:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class Worker:
    """One rank: the receiver loop and one lane thread per task class.

    Data structures: `_lanes` TaskClass -> _Lane; `_inflight` the number of tasks received
    and not yet answered (published in the rank's flags); `_prefetches` the PREFETCH seqs
    received and not answered, `_revoked` those of them a REVOKE named (both under
    `_revoke_lock`). Invariant: every task received is answered by exactly one completion;
    a seq leaves `_revoked` when its task is answered, so the set stays bounded.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self._stop = threading.Event()
        self._arrival = itertools.count()
        self._lanes = {
            TaskClass.LOAD: _Lane(TaskClass.LOAD, holds_on_pause=True),
            TaskClass.BACKUP: _Lane(TaskClass.BACKUP, holds_on_pause=True),
            TaskClass.STORAGE_READ: _Lane(TaskClass.STORAGE_READ, holds_on_pause=False),
            TaskClass.STORAGE_WRITE: _Lane(TaskClass.STORAGE_WRITE, holds_on_pause=False),
        }
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self._revoke_lock = threading.Lock()
        self._prefetches: set[int] = set()
        self._revoked: set[int] = set()
        self._device_use = _DeviceUse()
        self._asleep = False  # the pools are freed: every task fails (read by every thread)
        self._generation = 0  # the pools generation this worker reached
        self.ipc = WorkerIPC(spec.deployment_id, spec.rank,
                             manager_timeout=spec.manager_timeout_s,
                             expect_instance=spec.ipc_instance)
        try:
            self.res = RankResources(spec, host_segment_name(spec.deployment_id, spec.rank))
        except BaseException:
            self.ipc.close()
            raise
        self.executor = self.res.executor
        self._threads = [
            threading.Thread(target=self._lane_loop, args=(lane,), daemon=True,
                             name=f"kvtier-{lane.cls.name.lower()}-r{self.rank}")
            for lane in self._lanes.values()]

    # ------------------------------------------------------------------ loop

    def stop(self) -> None:
        self._stop.set()

    def _beat_loop(self) -> None:
        """Keep the heartbeat fresh even if the receiver is held up (a full queue, a GC)."""
        while not self._stop.wait(0.25):
            self.ipc.beat()

    def run(self) -> None:
        for t in self._threads:
            t.start()
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
                task = self.ipc.recv_task(timeout=0.2)
                if task is not None:
                    self._accept(task)
        except ManagerGone as e:
            log.warning("rank %d: %s; exiting", self.rank, e)
        finally:
            self._stop.set()  # ends the heartbeat thread before the IPC handles close
            self.ipc.set_ready(False)
            for lane in self._lanes.values():
                for task in lane.drop_all():  # never run now: a backup must not wait on them
                    if task.kind == TaskKind.H2D:
                        self.executor.load_gate.exit()
            for t in self._threads:
                t.join(timeout=5)

    def _accept(self, task: Task) -> None:
        with self._inflight_lock:
            self._inflight += 1
            self.ipc.set_inflight(self._inflight)
        if task.kind == TaskKind.REVOKE:
            self._answer(Completion(task.seq, self.rank, True, self._revoke(task.src)))
            return
        if self._asleep:  # never touch a freed pool
            self._cancel(task)
            return
        if task.kind == TaskKind.PREFETCH:
            with self._revoke_lock:
                self._prefetches.add(task.seq)
        elif task.kind == TaskKind.H2D:
            self.executor.load_gate.enter()  # backups step aside until it is answered
        if task.kind in (TaskKind.D2H, TaskKind.H2D):
            self.executor.precheck(task)  # off the lane's copy path
        self._lanes[TASK_CLASSES[task.kind]].put(task, next(self._arrival))

    def _cancel(self, task: Task) -> None:
        """Answer `task` failed without running it (the pools are or are about to be freed)."""
        if task.kind == TaskKind.H2D:  # layer waiters outside the manager give up now
            self.ipc.publish_load_failed(task.seq)
        self._answer(Completion(
            task.seq, self.rank, False,
            error=f"PoolsFreedError: rank {self.rank}: the pools are freed (the deployment is "
            f"asleep for a weight update); {task.kind.name} task cancelled"))

    def _revoke(self, seqs: Iterable[int]) -> int:
        """Mark the PREFETCH tasks among `seqs` this rank still holds; returns how many."""
        with self._revoke_lock:
            hit = {int(s) for s in seqs} & self._prefetches
            self._revoked |= hit
            return len(hit)

    def _is_revoked(self, seq: int) -> bool:
        with self._revoke_lock:
            return seq in self._revoked

    def _answer(self, comp: Completion) -> None:
        if self._prefetches:
            with self._revoke_lock:
                self._prefetches.discard(comp.seq)
                self._revoked.discard(comp.seq)
        self.ipc.post_completion(comp)
        with self._inflight_lock:
            self._inflight -= 1
            self.ipc.set_inflight(self._inflight)

    def _lane_loop(self, lane: _Lane) -> None:
        run = self._run_storage if lane.cls in (TaskClass.STORAGE_READ,
                                                TaskClass.STORAGE_WRITE) else self._run_device
        if lane.cls in BACKGROUND_LANES:
            _lower_thread_priority(BACKGROUND_NICE)
        if lane.cls in (TaskClass.LOAD, TaskClass.BACKUP):
            _use_cuda_device(self.spec.device)  # the current device is per thread
        try:
            while True:
                batch = lane.take(self._stop, lambda: self.ipc.paused)
                if batch is None:
                    return
                try:
                    if self._asleep:  # taken just as a sleep began: never run on freed pools
                        for t in batch:
                            self._cancel_taken(t)
                    else:
                        run(batch)
                finally:
                    lane.done()
        except BaseException as e:  # the manager is gone (an answer could not be sent)
            if not self._stop.is_set():
                log.warning("rank %d: %s lane stops: %s: %s", self.rank, lane.cls.name,
                            type(e).__name__, e)
            self._stop.set()

    def _cancel_taken(self, task: Task) -> None:
        if task.kind == TaskKind.H2D:
            self.executor.load_gate.exit()  # entered when it was received (`_accept`)
        self._cancel(task)

    def _run_device(self, batch: list[Task]) -> None:
        loads = sum(1 for t in batch if t.kind == TaskKind.H2D)
        try:
            self._run_device_batch(batch)
        finally:
            for _ in range(loads):  # entered when each was received (`_accept`)
                self.executor.load_gate.exit()

    def _run_device_batch(self, batch: list[Task]) -> None:
        first = batch[0]
        try:
            if not self.res.device_current():
                with self._device_use.exclusive():
                    self.res.ensure_device()  # engine KV: attach the runner's new registration
            with self._device_use.use():
                results = self.executor.device_batch(first.kind, batch, self._layer_done)
        except Exception as e:  # a task fails; the lane goes on
            log.error("rank %d: %s task(s) %s failed: %s\n%s", self.rank, first.kind.name,
                      [t.seq for t in batch], e, traceback.format_exc())
            for t in batch:
                if t.kind == TaskKind.H2D:  # layer waiters outside the manager give up now
                    self.ipc.publish_load_failed(t.seq)
                self._answer(Completion(t.seq, self.rank, False, error=f"{type(e).__name__}: {e}"))
            return
        for t, (result, detail) in zip(batch, results, strict=True):
            self._answer(Completion(t.seq, self.rank, True, result, detail))

    def _layer_done(self, seqs: list[int], layer: int) -> None:
        for s in seqs:
            self.ipc.publish_layers_done(s, layer + 1)

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
        self._asleep = True  # from now on the receiver and the lanes cancel what they get
        cancelled = 0
        for lane in self._lanes.values():
            for task in lane.drop_all():
                self._cancel_taken(task)
                cancelled += 1
        for lane in self._lanes.values():  # a storage call is bounded by its backend's timeout
            while not lane.wait_idle(5.0):
                log.warning("rank %d: sleep waits for a %s batch to finish", self.rank,
                            lane.cls.name)
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

    # ------------------------------------------------------------------ storage

    def _run_storage(self, batch: list[Task]) -> None:
        for task in batch:
            try:
                result, detail = self.executor.storage_task(task, self._is_revoked)
            except Exception as e:
                log.error("rank %d: storage %s task %d failed: %s", self.rank, task.kind.name,
                          task.seq, e)
                self._publish_storage_figures()
                self._answer(Completion(task.seq, self.rank, False,
                                        error=f"{type(e).__name__}: {e}"))
                continue
            self._publish_storage_figures()  # before the answer: a reader of it sees them
            self._answer(Completion(task.seq, self.rank, True, result, detail))

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
    src.add_argument("--spec-stdin", action="store_true",
                     help="the WorkerSpec as JSON on stdin, read to its end: a warm worker "
                          "(started before its spec was known, its imports done by then)")
    args = ap.parse_args(argv)
    if args.spec_stdin:
        # the imports above are done: say so (the launcher's `WarmWorkers` waits for this
        # line), then wait for the spec; the launcher gone before sending it is an EOF
        print(WARM_LINE, file=sys.stderr, flush=True)
        text = sys.stdin.read()
        if not text.strip():
            return 0
    spec = WorkerSpec.from_json(args.spec if args.spec is not None
                                else text if args.spec_stdin
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
    try:
        worker = Worker(spec)
    except KvtierError as e:  # a deliberate refusal: one line for the manager to report
        log.info("rank %d: start refused", spec.rank, exc_info=True)  # the traceback: the log
        print(REFUSED_PREFIX + " ".join(str(e).split()), file=sys.stderr, flush=True)
        return REFUSED_EXIT

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


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown once everything is closed (pools, IPC,
    storage): torch's modules and finalizers took 1.8 s of a worker's exit on the 2-core
    box, all of it on a node take-over's path (the next service adopts the host pool only
    once this process is gone, issue 37). The logs are flushed first."""
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_now(main())
