"""Worker processes: start them, watch them, replace them, stop them; and the dispatcher that
sends them tasks.

`WorkerSupervisor` owns the deployment's IPC names (through `kvtier.worker.ipc.ManagerIPC`) and one
worker process per rank. A monitor thread checks every worker's process and heartbeat; a
worker that died or stopped beating is killed, its in-flight tasks are failed, the manager is
told every cached block is lost (the rank's pools went with it), and a replacement is
started. `/readyz` is 503 until it is ready again.

`ProcessDispatcher` broadcasts each task to every rank and merges their answers: a task
succeeds when every rank succeeded; counts (storage queries and prefetches) take the minimum
over ranks, because a page is only usable where every rank has it. Completions are applied on
a thread of their own, so the IPC reader never waits for the manager's lock (which a
scheduler call may hold while it sends).

Worker states:  starting -> ready -> (dead -> restarting -> starting ...) | stopped
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import posix_ipc
from kvtier.manager.config import NON_CONFIG_ENV
from kvtier.manager.errors import KvtierError, TransferTimeoutError
from kvtier.manager.transfers import Dispatcher
from kvtier.worker.ipc import ManagerIPC, TaskAborted
from kvtier.worker.kvreg import read_record, remove_dead_registrations
from kvtier.worker.spec import WorkerSpec, host_segment_name
from kvtier.worker.wire import (
    MIN_RESULT_KINDS,
    SUM_RESULT_KINDS,
    Completion,
    Task,
    TaskKind,
    merge_results,
)

log = logging.getLogger("kvtier.launcher")

MIN_KINDS = MIN_RESULT_KINDS
SUM_KINDS = SUM_RESULT_KINDS


class WorkerStartError(KvtierError):
    """A worker did not become ready; the message names the rank and its last log lines."""


@dataclass
class _Pending:
    kind: TaskKind
    ranks: set[int]
    ok: bool = True
    result: int | None = None
    detail: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class ProcessDispatcher(Dispatcher):
    """Tasks to worker processes over `ManagerIPC`; outcomes merged over ranks.

    Data structures: `_acks` seq -> _Pending (ranks that still owe an answer, merged
    outcome); `_applyq` merged completions waiting for the apply thread.
    """

    def __init__(self, ipc: ManagerIPC, num_ranks: int) -> None:
        super().__init__()
        self.ipc = ipc
        self.num_ranks = num_ranks
        self._acks: dict[int, _Pending] = {}
        self._acks_lock = threading.Lock()
        self._applyq: queue.SimpleQueue[Completion | None] = queue.SimpleQueue()
        self._applier = threading.Thread(target=self._apply_loop, daemon=True,
                                         name="kvtier-apply")
        self._applier.start()
        self.transfer_seconds: collections.deque[tuple[TaskKind, int, float]] = (
            collections.deque(maxlen=4096))
        self._sent_at: dict[int, tuple[TaskKind, int, float]] = {}

    def _send(self, task: Task) -> None:
        with self._acks_lock:
            self._acks[task.seq] = _Pending(task.kind, set(range(self.num_ranks)))
            self._sent_at[task.seq] = (task.kind, max(len(task.src), len(task.dst)),
                                       time.monotonic())
        try:
            self.ipc.send_task(task)
        except Exception as e:  # a dead rank's full queue: fail the task, never hang
            log.warning("task %d (%s) could not be sent: %s", task.seq, task.kind.name, e)
            with self._acks_lock:
                pend = self._acks.get(task.seq)
                if pend is not None:
                    pend.ok = False
                    pend.errors.append(str(e))
                    pend.ranks.clear()
                    self._finish_locked(task.seq)

    def on_rank_completion(self, comp: Completion) -> None:
        """Called by the IPC reader thread for every rank's answer."""
        with self._acks_lock:
            pend = self._acks.get(comp.seq)
            if pend is None or comp.rank not in pend.ranks:
                return  # a late answer for a task already failed
            pend.ranks.discard(comp.rank)
            if not comp.ok:
                pend.ok = False
                pend.errors.append(f"rank {comp.rank}: {comp.error}")
                self.ipc.abort_task(comp.seq, f"rank {comp.rank}: {comp.error}")
            pend.result = (comp.result if pend.result is None
                           else merge_results(pend.kind, pend.result, comp.result))
            pend.detail.update(comp.detail)
            if not pend.ranks:
                self._finish_locked(comp.seq)

    def fail_rank(self, rank: int, reason: str) -> list[int]:
        """Fail every task still waiting for `rank` (it died). Returns their seqs: each is
        reported once the other ranks have answered it too."""
        failed: list[int] = []
        with self._acks_lock:
            for seq, pend in list(self._acks.items()):
                if rank in pend.ranks:
                    pend.ranks.discard(rank)
                    pend.ok = False
                    pend.errors.append(f"rank {rank}: {reason}")
                    self.ipc.abort_task(seq, f"rank {rank}: {reason}")
                    failed.append(seq)
                    if not pend.ranks:
                        self._finish_locked(seq)
        return failed

    def _finish_locked(self, seq: int) -> None:
        pend = self._acks.pop(seq)
        sent = self._sent_at.pop(seq, None)
        if sent is not None:
            kind, blocks, t0 = sent
            self.transfer_seconds.append((kind, blocks, time.monotonic() - t0))
        self._applyq.put(Completion(seq, -1, pend.ok, pend.result or 0, sorted(pend.detail),
                                    "; ".join(pend.errors)))

    def _apply_loop(self) -> None:
        while True:
            comp = self._applyq.get()
            if comp is None:
                return
            try:
                self._deliver(comp)
            except Exception:  # the manager must keep hearing about later tasks
                log.exception("applying the completion of task %d failed", comp.seq)

    def wait_layer(self, seq: int, layer: int, timeout: float) -> None:
        try:
            self.ipc.wait_layer(seq, layer, timeout)
        except TaskAborted:
            # The load failed: wait until the manager has applied that, so the caller's
            # handle reports it.
            self.wait((seq,), timeout)
        except TimeoutError as e:
            if not self.is_pending(seq):
                return  # completed (layer words may have been overwritten since)
            raise TransferTimeoutError(str(e)) from None

    def close(self) -> None:
        self._applyq.put(None)
        self._applier.join(timeout=5)


class WorkerStatus(TypedDict):
    """One rank's row of `WorkerSupervisor.status()` (the admin API's `workers`)."""

    rank: int
    pid: int | None
    state: str
    heartbeat_age_s: float | None
    tasks_inflight: int
    restarts: int


@dataclass
class WorkerHandle:
    rank: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    state: str = "starting"
    restarts: int = 0
    started_at: float = 0.0


class WorkerSupervisor:
    """Starts, watches and restarts the worker processes of one deployment."""

    def __init__(self, spec_for_rank: Callable[[int], WorkerSpec], num_ranks: int,
                 deployment_id: str, *, ready_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 5.0, log_dir: str | None = None,
                 on_worker_lost: Callable[[int, str], None] | None = None) -> None:
        self.deployment_id = deployment_id
        self.num_ranks = num_ranks
        self.spec_for_rank = spec_for_rank
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_worker_lost = on_worker_lost
        # Worker logs go to `log_dir`, or to a temporary folder removed at stop unless a
        # worker failed (then its log is worth keeping, and its path was logged).
        self._own_log_dir = log_dir is None
        self._keep_logs = False
        self._log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvtier-{deployment_id}-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.workers = [WorkerHandle(r) for r in range(num_ranks)]
        # workers.engine_kv: the registration nonce each rank's device blocks were cached
        # under; a different one (or none) means the model runner's KV memory was replaced and
        # every device block the manager lists is gone with it (see _check_engine_kv)
        self._engine_kv = spec_for_rank(0).engine_kv
        self._kv_nonce: dict[int, str | None] = {}
        self._kv_checked = 0.0
        self.restarts_total = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.dispatcher: ProcessDispatcher | None = None
        self.ipc = ManagerIPC(deployment_id, num_ranks,
                              on_completion=self._on_completion)
        self._remove_dead_registrations()
        self._monitor: threading.Thread | None = None

    def _on_completion(self, comp: Completion) -> None:
        if self.dispatcher is not None:
            self.dispatcher.on_rank_completion(comp)

    def make_dispatcher(self) -> ProcessDispatcher:
        self.dispatcher = ProcessDispatcher(self.ipc, self.num_ranks)
        return self.dispatcher

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every worker and wait until all are ready (WorkerStartError otherwise,
        with everything started so far stopped again)."""
        try:
            for w in self.workers:
                self._spawn(w)
            self._wait_ready(self.workers, self.ready_timeout_s)
        except BaseException:
            self._keep_logs = True
            self.stop()
            raise
        if self._engine_kv:  # the registrations the ready workers attached
            self._kv_checked = 0.0
            self._check_engine_kv()
        self._monitor = threading.Thread(target=self._watch, daemon=True,
                                         name="kvtier-supervisor")
        self._monitor.start()

    def _spawn(self, w: WorkerHandle) -> None:
        self._unlink_host_segment(w.rank)
        w.log_path = self._log_dir / f"worker-r{w.rank}.log"
        logf = w.log_path.open("ab")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KVTIER_") or k in NON_CONFIG_ENV}
        # torch's OpenMP threads spin while they wait; a worker shares its cores with the
        # engine and the other ranks, and spinning threads stall everybody's short copies.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.worker.process", "--spec",
             self.spec_for_rank(w.rank).to_json()],
            # A session of its own: a terminal's Ctrl-C goes to the manager, which stops the
            # workers in order; orphans still exit by themselves (manager heartbeat).
            stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        w.state = "starting"
        w.started_at = time.monotonic()
        log.info("worker rank %d starting (pid %d, log %s)", w.rank, w.proc.pid, w.log_path)

    def _wait_ready(self, workers: list[WorkerHandle], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in workers:
            proc = w.proc
            assert proc is not None  # _spawn started it
            while True:
                st = self.ipc.rank_state(w.rank)
                if st.ready and st.pid == proc.pid:
                    w.state = "ready"
                    log.info("worker rank %d ready (pid %d)", w.rank, st.pid)
                    break
                code = proc.poll()
                if code is not None:
                    raise WorkerStartError(
                        f"worker rank {w.rank} exited with status {code} before it was ready; "
                        f"its last log lines:\n{self.last_log_lines(w.rank)}")
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"worker rank {w.rank} not ready after {timeout:.0f} s; its last log "
                        f"lines:\n{self.last_log_lines(w.rank)}")
                time.sleep(0.02)

    def last_log_lines(self, rank: int, n: int = 15) -> str:
        path = self.workers[rank].log_path
        try:
            lines = path.read_text(errors="replace").splitlines() if path else []
        except OSError:
            lines = []
        return "\n".join(lines[-n:]) or "(no output)"

    # ------------------------------------------------------------------ watch

    def _check_engine_kv(self) -> None:
        """A safety net under the engine's own duty (a restarted model runner means a new
        scheduler side, or `manager.lose_all()`): when a rank's registration disappears or is
        replaced, the manager forgets every cached block, so a block id is never served over
        memory that no longer holds its KV. Checked twice a second."""
        now = time.monotonic()
        if now - self._kv_checked < 0.5:
            return
        self._kv_checked = now
        for rank in range(self.num_ranks):
            rec = read_record(self.deployment_id, rank)
            nonce = rec.nonce if rec is not None else None
            seen = self._kv_nonce.get(rank)
            self._kv_nonce[rank] = nonce
            if seen is None or nonce == seen:
                continue
            reason = ("the model runner's KV registration was replaced" if nonce is not None
                      else "the model runner's KV registration is gone")
            log.error("rank %d: %s; every cached block is dropped", rank, reason)
            if self.on_worker_lost is not None:
                try:
                    self.on_worker_lost(rank, reason)
                except Exception:
                    log.exception("handling the lost KV memory of rank %d failed", rank)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if self._engine_kv:
                self._check_engine_kv()
            for w in self.workers:
                if self._stop.is_set():
                    return
                if w.state != "ready" or w.proc is None:  # a ready worker has a process
                    continue
                code = w.proc.poll()
                if code is not None:
                    self._replace(w, f"exited with status {code}")
                    continue
                age = self.ipc.rank_state(w.rank).heartbeat_age_s
                if age is not None and age > self.heartbeat_timeout_s:
                    self._replace(w, f"no heartbeat for {age:.1f} s")

    def _replace(self, w: WorkerHandle, reason: str) -> None:
        log.error("worker rank %d (pid %d) %s; last log lines:\n%s", w.rank,
                  w.proc.pid if w.proc else -1, reason, self.last_log_lines(w.rank, 5))
        w.state = "dead"
        self._keep_logs = True
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        # Drop what is queued for the dead rank first, then fail everything it still owed:
        # a task sent in between is answered by the replacement (a late answer is ignored).
        self.ipc.reset_rank(w.rank)
        if self.dispatcher is not None:
            # Each task is reported once the surviving ranks have answered it too; until then
            # the manager keeps its blocks out of the free lists (see KVCacheManager.lose_all).
            self.dispatcher.fail_rank(w.rank, f"worker {reason}")
        if self.on_worker_lost is not None:
            try:
                self.on_worker_lost(w.rank, reason)
            except Exception:
                log.exception("handling the loss of rank %d failed", w.rank)
        w.state = "restarting"
        w.restarts += 1
        self.restarts_total += 1
        if self._stop.is_set():
            return
        try:
            self._spawn(w)
            self._wait_ready([w], self.ready_timeout_s)
        except WorkerStartError as e:
            log.error("%s", e)
            w.state = "dead"  # the watcher sees a dead process and tries again

    # ------------------------------------------------------------------ status

    def ready(self) -> tuple[bool, str]:
        not_ready = [w for w in self.workers if w.state != "ready"]
        if not not_ready:
            return True, "every worker is ready"
        return False, "; ".join(f"rank {w.rank} is {w.state}" for w in not_ready)

    def status(self) -> list[WorkerStatus]:
        out: list[WorkerStatus] = []
        for w in self.workers:
            st = self.ipc.rank_state(w.rank)
            age = st.heartbeat_age_s
            out.append({
                "rank": w.rank, "pid": w.proc.pid if w.proc else None, "state": w.state,
                "heartbeat_age_s": None if age is None else round(age, 3),
                "tasks_inflight": st.tasks_inflight, "restarts": w.restarts,
            })
        return out

    def storage_figures(self) -> list[dict[str, int]]:
        """Per rank, the storage backend figures its worker last published (lock-free reads
        of the control segment; see `kvtier.worker.ipc.STORAGE_FIGURES`)."""
        return [self.ipc.storage_figures(w.rank) for w in self.workers]

    # ------------------------------------------------------------------ stop

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every worker, SIGKILL what is left after `timeout`, then remove every
        shared-memory segment and queue of the deployment."""
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=timeout)
        procs = [w.proc for w in self.workers if w.proc is not None]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for w in self.workers:
            w.state = "stopped"
            self._unlink_host_segment(w.rank)
        self._remove_dead_registrations()
        if self.dispatcher is not None:
            self.dispatcher.close()
        self.ipc.close()
        if self._own_log_dir and not self._keep_logs:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        elif self._keep_logs:
            log.info("worker logs kept in %s", self._log_dir)

    def _remove_dead_registrations(self) -> None:
        """Engine KV registrations (and KV segments) of this deployment whose model runner
        died without closing them: no worker may attach them, and nobody else unlinks them.
        A live runner's registration is left alone."""
        try:
            removed = remove_dead_registrations(self.deployment_id)
        except (OSError, KvtierError) as e:
            log.warning("could not remove dead engine KV registrations: %s", e)
            return
        if removed:
            log.info("removed engine KV names of dead model runners: %s", removed)

    def _unlink_host_segment(self, rank: int) -> None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(host_segment_name(self.deployment_id, rank))
