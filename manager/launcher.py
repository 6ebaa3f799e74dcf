"""Worker processes: start them, watch them, replace them, stop them.

`WorkerSupervisor` owns the deployment's IPC names (through `kvtier.worker.ipc.ManagerIPC`) and one
worker process per rank. A monitor thread checks every worker's process and heartbeat; a
worker that died or stopped beating is killed, its in-flight tasks are failed, the manager is
told every cached block is lost (the rank's pools went with it), and a replacement is
started. `/readyz` is 503 until it is ready again.

The dispatcher that sends the workers tasks (`kvtier.manager.transfers.ProcessDispatcher`)
is made here (`make_dispatcher`), over the supervisor's IPC; the IPC reader hands it every
rank's answer.

Worker states (`WORKER_STATES`; exported per rank as `kvtier_worker_state`):

    starting --ready--> ready --died / no heartbeat--> dead --respawn--> starting
    starting --exited / not ready in time--> start_failed --backoff over--> starting
    any --stop()--> stopped
A replacement that does not become ready (it exits, or `ready_timeout_s` passes) is
`start_failed`: tasks for the deployment fail at once (the rank is down) and the start is
tried again after a backoff (`restart_backoff_s`, doubling up to `max_restart_backoff_s`).
After `max_start_failures` failed starts in a row the deployment counts as unable to recover
(`unrecoverable()`: the admin's /healthz turns 503) while the retries go on.

Worker logs go to a temporary folder `<tmp>/kvtier-<id>-XXXXXXXX` (or the caller's
`log_dir`, which is never removed). The folder is removed at a clean stop; after a worker
failure it is moved to `<tmp>/kvtier-<id>-last-failure` (replacing the previous one) and its
path logged (`failure_logs`). Folders of earlier runs of the same deployment id are removed
at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from kvtier.manager.config import NON_CONFIG_ENV
from kvtier.manager.errors import KvtierError, TransferTimeoutError
from kvtier.manager.transfers import ProcessDispatcher, TransferObserver
from kvtier.worker.ipc import MAX_RANKS, ManagerIPC
from kvtier.worker.kvreg import EngineKVError, read_record, remove_dead_registrations
from kvtier.worker.spec import (
    REFUSED_EXIT,
    REFUSED_PREFIX,
    WARM_LINE,
    WorkerSpec,
    host_segment_name,
)
from kvtier.worker.wire import (
    MIN_RESULT_KINDS,
    SUM_RESULT_KINDS,
    Completion,
)

log = logging.getLogger("kvtier.launcher")

SPEC_ENV = "KVTIER_WORKER_SPEC"
"""The environment variable a worker process reads its `WorkerSpec` from."""

MIN_KINDS = MIN_RESULT_KINDS
SUM_KINDS = SUM_RESULT_KINDS


class WorkerStartError(KvtierError):
    """A worker did not become ready; the message names the rank and its last log lines,
    or, when the worker refused to start (`refused`), is the one line of its reason."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


WORKER_STATES = ("starting", "ready", "dead", "start_failed", "stopped")
"""Every value `WorkerHandle.state` takes (the module docstring draws the transitions)."""


class WorkerStatus(TypedDict):
    """One rank's row of `WorkerSupervisor.status()` (the admin API's `workers`)."""

    rank: int
    pid: int | None
    state: str
    heartbeat_age_s: float | None
    tasks_inflight: int
    restarts: int
    start_failures: int  # failed starts of a replacement in a row (0 once one is ready)
    start_failures_total: int  # failed starts of the rank since the supervisor started
    next_start_in_s: float | None  # state start_failed: seconds to the next try
    last_error: str  # why the last start failed ("" if none did)
    host_numa_node: int | None  # NUMA node its host pool is bound to (workers.host_numa)


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVTIER_") or k in NON_CONFIG_ENV}
    # torch's OpenMP threads spin while they wait; a worker shares its cores with the
    # engine and the other ranks, and spinning threads stall everybody's short copies.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


class WarmWorkers:
    """Worker processes started before their specs are known (issue 37's take-over): each
    does its imports (torch: seconds) and waits for its spec on stdin
    (`kvtier.worker.process --spec-stdin`); a supervisor's `_spawn` takes one and sends it
    the spec, so a stack started then does not pay for the imports.

    Data structures: `_procs`, the warm processes not taken yet, each with its log file (in
    `_dir`, a temporary folder; a taken one's log is moved into its supervisor's folder).
    Invariant: a process here has had no spec; `close` kills them (a warm process whose
    launcher dies reads an EOF and exits by itself)."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-warm-"))
        self._procs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._lock = threading.Lock()
        self._ids = 0

    def start(self, n: int) -> None:
        """`n` more warm processes."""
        with self._lock:
            for _ in range(n):
                self._ids += 1
                path = self._dir / f"warm-{self._ids}.log"
                with path.open("ab") as logf:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "kvtier.worker.process", "--spec-stdin"],
                        stdin=subprocess.PIPE, stdout=logf, stderr=subprocess.STDOUT,
                        env=_worker_env(), start_new_session=True)
                self._procs.append((proc, path))

    def wait_warm(self, timeout: float) -> int:
        """Until every process here has done its imports (WARM_LINE in its log), at most
        `timeout` seconds; how many are warm."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                procs = list(self._procs)
            warm = 0
            for _, path in procs:
                with contextlib.suppress(OSError):
                    warm += WARM_LINE in path.read_text(errors="replace")
            if warm == len(procs) or time.monotonic() > deadline:
                return warm
            time.sleep(0.02)

    def take(self) -> tuple[subprocess.Popen[bytes], Path] | None:
        """A live warm process and its log, or None."""
        with self._lock:
            while self._procs:
                proc, path = self._procs.pop(0)
                if proc.poll() is None:
                    return proc, path
        return None

    def __len__(self) -> int:
        with self._lock:
            return len(self._procs)

    def close(self) -> None:
        """The processes not taken: stopped (their stdin closed: they exit at the EOF; killed
        if they do not)."""
        with self._lock:
            procs, self._procs = self._procs, []
        for proc, _ in procs:
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc, _ in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class WorkerHandle:
    rank: int
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    state: str = "starting"
    restarts: int = 0
    started_at: float = 0.0
    start_failures: int = 0
    start_failures_total: int = 0
    next_start_at: float = 0.0
    last_error: str = ""


class WorkerSupervisor:
    """Starts, watches and restarts the worker processes of one deployment."""

    def __init__(self, spec_for_rank: Callable[[int], WorkerSpec], num_ranks: int,
                 deployment_id: str, *, ready_timeout_s: float = 60.0,
                 heartbeat_timeout_s: float = 5.0, log_dir: str | None = None,
                 on_worker_lost: Callable[[int, str], None] | None = None,
                 restart_backoff_s: float = 1.0, max_restart_backoff_s: float = 30.0,
                 max_start_failures: int = 5, keep_logs: bool = False,
                 on_device_lost: Callable[[int, str], None] | None = None,
                 device_copy_mark: Callable[[], int] | None = None,
                 on_device_confirmed: Callable[[int], None] | None = None,
                 on_worker_replaced: Callable[[int], None] | None = None) -> None:
        self.deployment_id = deployment_id
        self.num_ranks = num_ranks
        self.spec_for_rank = spec_for_rank
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.on_worker_lost = on_worker_lost
        # a replacement of a lost worker is ready (its rank's tasks run again): what lived
        # only in the lost process (storage retention marks) is sent again
        self.on_worker_replaced = on_worker_replaced
        # workers.engine_kv: a registration change costs the device tier only (the host pools
        # are the workers' own and live on); see _check_engine_kv
        self.on_device_lost = on_device_lost
        self.device_copy_mark = device_copy_mark
        self.on_device_confirmed = on_device_confirmed
        self.restart_backoff_s = restart_backoff_s
        self.max_restart_backoff_s = max_restart_backoff_s
        self.max_start_failures = max_start_failures
        self.workers = [WorkerHandle(r) for r in range(num_ranks)]
        # workers.engine_kv: the registration nonce each rank's device blocks were cached
        # under; a different one (or none) means the model runner's KV memory was replaced and
        # every device block the manager lists is gone with it (see _check_engine_kv)
        self._engine_kv = spec_for_rank(0).engine_kv
        self._kv_nonce: dict[int, str | None] = {}
        self._kv_checked = 0.0
        # While the pools sleep the runner may free its KV and register anew: not a loss
        self.pools_asleep = False
        self._kv_lock = threading.Lock()  # the watcher and check_engine_kv_now
        self.restarts_total = 0
        self.start_failures_total = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.dispatcher: ProcessDispatcher | None = None
        # Refuses a deployment id a live manager holds, and removes the stale IPC names of
        # a dead one; the host segments of every rank it may have had go too (a restart
        # with fewer ranks would not otherwise touch them).
        self.ipc = ManagerIPC(deployment_id, num_ranks,
                              on_completion=self._on_completion)
        self._remove_dead_registrations()
        for rank in range(MAX_RANKS):
            self._unlink_host_segment(rank)
        # Worker logs go to `log_dir` (kept), or to a temporary folder of this run, removed
        # at a clean stop unless `keep_logs`, moved to `failure_logs` after a failure.
        self._own_log_dir = log_dir is None
        self._keep_logs = keep_logs
        self._failed = False
        self.failure_logs: Path | None = None
        if self._own_log_dir:
            self._remove_stale_log_dirs()
        self._log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"kvtier-{deployment_id}-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._monitor: threading.Thread | None = None
        # warm processes to take before starting new ones (issue 37's take-over), or None
        self.warm: WarmWorkers | None = None

    @property
    def log_dir(self) -> Path:
        """Where the workers of this run write their logs."""
        return self._log_dir

    def _stale_log_dirs(self) -> list[Path]:
        """This deployment's log folders of earlier runs (`tempfile.mkdtemp` names: the id,
        '-' and 8 characters of [a-z0-9_], so another id's folders never match)."""
        pattern = re.compile(re.escape(f"kvtier-{self.deployment_id}-") + r"[a-z0-9_]{8}")
        tmp = Path(tempfile.gettempdir())
        try:
            return [p for p in tmp.iterdir() if pattern.fullmatch(p.name) and p.is_dir()]
        except OSError:
            return []

    def _remove_stale_log_dirs(self) -> None:
        for path in self._stale_log_dirs():
            shutil.rmtree(path, ignore_errors=True)
            log.info("removed the worker logs of an earlier run: %s", path)

    def _on_completion(self, comp: Completion) -> None:
        if self.dispatcher is not None:
            self.dispatcher.on_rank_completion(comp)

    def manager_threads(self) -> list[threading.Thread] | None:
        """The threads the manager side of this deployment runs (the watcher, the completion
        applier, the IPC readers); None until `start` and `make_dispatcher` made them."""
        if self._monitor is None or self.dispatcher is None:
            return None
        return [self._monitor, self.dispatcher.applier, *self.ipc.threads()]

    def make_dispatcher(self, on_transfer: TransferObserver | None = None) -> ProcessDispatcher:
        """The dispatcher to these workers (`on_transfer`: see `ProcessDispatcher`)."""
        self.dispatcher = ProcessDispatcher(self.ipc, self.num_ranks, on_transfer)
        return self.dispatcher

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Start every worker and wait until all are ready (WorkerStartError otherwise,
        with everything started so far stopped again)."""
        try:
            for w in self.workers:
                self._spawn(w)
            self._wait_ready(self.workers, self.ready_timeout_s)
        except BaseException as e:
            self._failed = True
            self.stop()
            if (isinstance(e, WorkerStartError) and self.failure_logs is not None
                    and not e.refused):  # a refusal is one line (issue 27)
                raise WorkerStartError(
                    f"{e}\n(worker logs kept in {self.failure_logs})") from None
            raise
        if self._engine_kv:  # the registrations the ready workers attached
            self._kv_checked = 0.0
            self._check_engine_kv()
        self._monitor = threading.Thread(target=self._watch, daemon=True,
                                         name="kvtier-supervisor")
        self._monitor.start()

    def _spawn(self, w: WorkerHandle) -> None:
        if self.ipc.names_owner() != "self":
            raise WorkerStartError(
                f"worker rank {w.rank} not started: the names of deployment "
                f"{self.deployment_id!r} no longer belong to this manager (another manager "
                "instance took them over while this one was frozen)")
        self._unlink_host_segment(w.rank)
        spec = dataclasses.replace(self.spec_for_rank(w.rank), ipc_instance=self.ipc.instance)
        w.log_path = self._log_dir / f"worker-r{w.rank}.log"
        if self.warm is not None and self._spawn_warm(w, spec):
            return
        logf = w.log_path.open("ab")
        env = _worker_env()
        # In the environment, not on the command line: the spec may carry a Redis password.
        env[SPEC_ENV] = spec.to_json()
        w.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.worker.process", "--spec-env", SPEC_ENV],
            # A session of its own: a terminal's Ctrl-C goes to the manager, which stops the
            # workers in order; orphans still exit by themselves (manager heartbeat).
            stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        w.state = "starting"
        w.started_at = time.monotonic()
        log.info("worker rank %d starting (pid %d, log %s)", w.rank, w.proc.pid, w.log_path)

    def _spawn_warm(self, w: WorkerHandle, spec: WorkerSpec) -> bool:
        """A warm process (`warm`) made this rank's worker: its log moved into this run's
        folder (the file it writes to), the spec sent on its stdin (a pipe: never on a
        command line). False when none is left or it died meanwhile."""
        assert self.warm is not None
        got = self.warm.take()
        if got is None:
            return False
        proc, path = got
        assert proc.stdin is not None and w.log_path is not None
        try:
            os.replace(path, w.log_path)
            proc.stdin.write(spec.to_json().encode())
            proc.stdin.close()
        except OSError as e:
            log.warning("worker rank %d: the warm process %d failed (%s); starting one",
                        w.rank, proc.pid, e)
            proc.kill()
            proc.wait(5)
            return False
        w.proc = proc
        w.state = "starting"
        w.started_at = time.monotonic()
        log.info("worker rank %d starting (pid %d, warm, log %s)", w.rank, proc.pid,
                 w.log_path)
        return True

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
                if code == REFUSED_EXIT and (why := self._refusal(w.rank)):
                    raise WorkerStartError(f"worker rank {w.rank}: {why}", refused=True)
                if code is not None:
                    raise WorkerStartError(
                        f"worker rank {w.rank} exited with status {code} before it was ready; "
                        f"its last log lines:\n{self.last_log_lines(w.rank)}")
                if time.monotonic() > deadline:
                    raise WorkerStartError(
                        f"worker rank {w.rank} not ready after {timeout:.0f} s; its last log "
                        f"lines:\n{self.last_log_lines(w.rank)}")
                time.sleep(0.02)

    def _refusal(self, rank: int) -> str | None:
        """The one-line reason a worker that refused to start gave (`REFUSED_PREFIX`)."""
        for line in reversed(self.last_log_lines(rank, 5).splitlines()):
            if line.startswith(REFUSED_PREFIX):
                return line[len(REFUSED_PREFIX):]
        return None

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
        scheduler side, or `manager.lose_device()`): when a rank's registration disappears or
        is replaced, the manager forgets every device copy (`on_device_lost`), so a block id
        is never served over memory that no longer holds its KV. The host pools are the
        workers' own and outlive the model runner, so host copies (and storage) stay, except
        those not yet confirmed. Checked twice a second, and at start; every change counts:
        gone (closed, or its runner dead), replaced, or back after a gap (blocks cached in the
        gap were never backed by live memory). `seen_kv_nonce` tells what was seen.

        Confirmation: a D2H copy that completed before a check began, and that check found
        every registration unchanged, was read from the memory the manager cached: the
        record showed the old nonce after the copy ended, so no worker could yet have attached
        a new one. Such copies are trusted (`on_device_confirmed(mark)`); copies completed
        later wait for the next check, and a change drops them with the device copies."""
        with self._kv_lock:
            self._check_engine_kv_locked()

    def check_engine_kv_now(self) -> None:
        """Check the registrations at once (a stack closing confirms the host copies its last
        D2H tasks made, so their storage backups are written before the workers stop)."""
        if self._engine_kv:
            with self._kv_lock:
                self._kv_checked = 0.0
                self._check_engine_kv_locked()

    def _check_engine_kv_locked(self) -> None:
        now = time.monotonic()
        if now - self._kv_checked < 0.5:
            return
        self._kv_checked = now
        mark = self.device_copy_mark() if self.device_copy_mark is not None else 0
        changed = False
        for rank in range(self.num_ranks):
            try:
                rec = read_record(self.deployment_id, rank)
            except EngineKVError:
                rec = None  # unreadable: no worker can use it either
            alive = rec is not None and rec.owner_alive()
            nonce = rec.nonce if rec is not None and alive else None
            first = rank not in self._kv_nonce
            seen = self._kv_nonce.get(rank)
            self._kv_nonce[rank] = nonce
            if first or nonce == seen or self.pools_asleep:
                continue
            changed = True
            reason = ("the model runner's KV registration was replaced" if nonce is not None
                      else "the model runner's KV registration is gone")
            lost = self.on_device_lost or self.on_worker_lost
            log.error("rank %d: %s; every device block is dropped%s", rank, reason,
                      " (host copies kept)" if self.on_device_lost is not None else "")
            if lost is not None:
                try:
                    lost(rank, reason)
                except Exception:
                    log.exception("handling the lost KV memory of rank %d failed", rank)
        if not changed and self.on_device_confirmed is not None:
            try:
                self.on_device_confirmed(mark)
            except Exception:
                log.exception("confirming host copies failed")

    def wait_pools(self, generation: int, timeout: float) -> None:
        """Wait until every rank's worker reached pools generation `generation` (freed its
        pools when odd, re-created them when even). WorkerStartError naming the ranks that
        failed (with their last log lines) or did not answer within `timeout`."""
        deadline = time.monotonic() + timeout
        what = "free" if generation % 2 else "re-create"
        while True:
            states = [self.ipc.rank_state(r) for r in range(self.num_ranks)]
            failed = [s.rank for s in states if s.pools_generation == -generation]
            waiting = [s.rank for s in states if s.pools_generation != generation]
            if failed:
                raise WorkerStartError(
                    f"rank(s) {failed} could not {what} their pools; last log lines:\n"
                    + "\n".join(self.last_log_lines(r, 5) for r in failed))
            if not waiting:
                if generation % 2 == 0 and self._engine_kv:
                    self._kv_nonce.clear()  # the registrations attached now are the baseline
                    self._kv_checked = 0.0
                return
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"rank(s) {waiting} did not {what} their pools within {timeout:.3g} s: "
                    + "; ".join(s.describe() for s in states if s.rank in waiting))
            time.sleep(0.01)

    def seen_kv_nonce(self, rank: int) -> str | None:
        """The registration nonce of `rank` the last engine-KV check saw (None: none live)."""
        return self._kv_nonce.get(rank)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            if self._engine_kv:
                self._check_engine_kv()
            for w in self.workers:
                if self._stop.is_set():
                    return
                try:
                    self._check(w)
                except Exception:  # the watcher must go on watching the other ranks
                    log.exception("watching worker rank %d failed", w.rank)

    def _check(self, w: WorkerHandle) -> None:
        """One look at one rank: replace a dead ready worker, see a replacement through its
        start, retry a failed start when its backoff is over."""
        if w.state == "start_failed":
            if time.monotonic() >= w.next_start_at:
                self._respawn(w)
            return
        if w.proc is None:
            return
        if w.state == "starting":  # a replacement (the first start is start()'s)
            self._check_starting(w)
            return
        if w.state != "ready":
            return
        code = w.proc.poll()
        if code is not None:
            self._replace(w, f"exited with status {code}")
            return
        age = self.ipc.rank_state(w.rank).heartbeat_age_s
        if age is not None and age > self.heartbeat_timeout_s:
            self._replace(w, f"no heartbeat for {age:.1f} s")

    def _forget_worker(self, w: WorkerHandle, reason: str) -> None:
        """The rank's worker process is gone: drop what is queued for it and fail every task
        it owed. Tasks sent after the reset (seq above its floor) wait for the next worker."""
        if w.proc is not None and w.proc.poll() is None:
            w.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.proc.wait(timeout=5)
        self.ipc.reset_rank(w.rank)
        if self.dispatcher is not None:
            # Each task is reported once the surviving ranks have answered it too; until then
            # the manager keeps its blocks out of the free lists (see KVCacheManager.lose_all).
            self.dispatcher.fail_rank(w.rank, f"worker {reason}",
                                      upto_seq=self.ipc.seq_floor(w.rank))

    def _replace(self, w: WorkerHandle, reason: str) -> None:
        log.error("worker rank %d (pid %d) %s; last log lines:\n%s\n(logs in %s)", w.rank,
                  w.proc.pid if w.proc else -1, reason, self.last_log_lines(w.rank, 5),
                  self._log_dir)
        w.state = "dead"
        self._failed = True
        self._forget_worker(w, reason)
        if self.on_worker_lost is not None:
            try:
                self.on_worker_lost(w.rank, reason)
            except Exception:
                log.exception("handling the loss of rank %d failed", w.rank)
        w.restarts += 1
        self.restarts_total += 1
        if self._stop.is_set():
            return
        self._respawn(w)

    def _respawn(self, w: WorkerHandle) -> None:
        """Start a replacement without waiting for it (the watcher sees it through)."""
        self.ipc.set_rank_down(w.rank, False)  # its tasks queue for the new worker again
        try:
            self._spawn(w)
        except Exception as e:  # cannot even start the process
            self._start_failed(w, f"could not be started: {e}")

    def _check_starting(self, w: WorkerHandle) -> None:
        proc = w.proc
        assert proc is not None
        st = self.ipc.rank_state(w.rank)
        if st.ready and st.pid == proc.pid:
            if self.on_worker_replaced is not None:
                # before the rank reads as ready: what it is told again is queued ahead of
                # every task sent once it is ready
                try:
                    self.on_worker_replaced(w.rank)
                except Exception:  # the watcher must go on watching
                    log.exception("handling the replacement of rank %d failed", w.rank)
            w.state = "ready"
            if w.start_failures:
                log.info("worker rank %d ready (pid %d) after %d failed start(s)", w.rank,
                         proc.pid, w.start_failures)
            else:
                log.info("worker rank %d ready (pid %d)", w.rank, proc.pid)
            w.start_failures = 0
            return
        code = proc.poll()
        if code is not None:
            self._start_failed(w, f"exited with status {code} before it was ready")
        elif time.monotonic() - w.started_at > self.ready_timeout_s:
            self._start_failed(w, f"not ready after {self.ready_timeout_s:.0f} s")

    def _start_failed(self, w: WorkerHandle, reason: str) -> None:
        """A replacement did not start: the rank is down (tasks fail at once) until the next
        try, `restart_backoff_s` doubling per failure in a row."""
        w.start_failures += 1
        w.start_failures_total += 1
        self.start_failures_total += 1
        w.last_error = reason
        delay = min(self.max_restart_backoff_s,
                    self.restart_backoff_s * 2 ** (w.start_failures - 1))
        log.error("worker rank %d %s (failed start %d in a row; next try in %.1f s); its last "
                  "log lines:\n%s\n(logs in %s)", w.rank, reason, w.start_failures, delay,
                  self.last_log_lines(w.rank), self._log_dir)
        self._forget_worker(w, reason)
        self.ipc.set_rank_down(w.rank, True)
        w.next_start_at = time.monotonic() + delay
        w.state = "start_failed"

    def unrecoverable(self) -> tuple[bool, str]:
        """True (with the reason) once some rank failed `max_start_failures` starts in a
        row: the deployment cannot recover by itself (retries go on meanwhile)."""
        for w in self.workers:  # counted until a start succeeds, retries in progress too
            if w.start_failures >= self.max_start_failures:
                return True, (f"worker rank {w.rank} failed to start {w.start_failures} times "
                              f"in a row: {w.last_error}")
        return False, ""

    # ------------------------------------------------------------------ status

    def ready(self) -> tuple[bool, str]:
        not_ready = [w for w in self.workers if w.state != "ready"]
        if not not_ready:
            return True, "every worker is ready"

        def why(w: WorkerHandle) -> str:
            if w.state != "start_failed":
                return f"rank {w.rank} is {w.state}"
            left = max(0.0, w.next_start_at - time.monotonic())
            return (f"rank {w.rank} is start_failed ({w.start_failures} failed start(s): "
                    f"{w.last_error}; next try in {left:.1f} s)")

        return False, "; ".join(why(w) for w in not_ready)

    def status(self) -> list[WorkerStatus]:
        out: list[WorkerStatus] = []
        for w in self.workers:
            st = self.ipc.rank_state(w.rank)
            age = st.heartbeat_age_s
            retry = (round(max(0.0, w.next_start_at - time.monotonic()), 3)
                     if w.state == "start_failed" else None)
            out.append({
                "rank": w.rank, "pid": w.proc.pid if w.proc else None, "state": w.state,
                "heartbeat_age_s": None if age is None else round(age, 3),
                "tasks_inflight": st.tasks_inflight, "restarts": w.restarts,
                "start_failures": w.start_failures,
                "start_failures_total": w.start_failures_total, "next_start_in_s": retry,
                "last_error": w.last_error, "host_numa_node": st.host_numa_node,
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
        self._settle_logs()

    def _settle_logs(self) -> None:
        """A run's own log folder: removed after a clean run, kept as the deployment's
        `-last-failure` folder (replacing the previous one) after a failure."""
        if not self._own_log_dir or not self._log_dir.exists():
            if self._failed:
                log.info("worker logs kept in %s", self._log_dir)
            return
        if self._keep_logs:
            log.info("worker logs kept in %s", self._log_dir)
            return
        if not self._failed:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            return
        last = self._log_dir.with_name(f"kvtier-{self.deployment_id}-last-failure")
        try:
            shutil.rmtree(last, ignore_errors=True)
            self._log_dir.rename(last)
        except OSError as e:
            log.warning("could not move the worker logs to %s: %s", last, e)
            last = self._log_dir
        self.failure_logs = last
        log.info("worker logs of the failure kept in %s", last)

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
        # Never a successor's: a manager frozen past its heartbeat may have been replaced.
        self.ipc.unlink_owned_segment(host_segment_name(self.deployment_id, rank))
