"""Transfers as data: how the manager hands tasks to workers and learns their outcome.

The manager never copies bytes. It builds `kvtier.worker.wire.Task`s, gives them to a `Dispatcher`,
and applies each task's outcome when the dispatcher reports it (once per task, after every
rank answered: ok only if every rank was ok; for storage queries the smallest count of any
rank). Dispatchers:

* `ImmediateDispatcher` completes every task as it is submitted (unit tests, benchmarks, and
  embedding without workers).
* `ManualDispatcher` keeps tasks pending until a test completes them, in any order, with any
  outcome.
* `ProcessDispatcher` sends them to worker processes over `kvtier.worker.ipc.ManagerIPC`
  (made by `kvtier.manager.launcher.WorkerSupervisor`, which starts the processes): it
  broadcasts each task to every rank and merges their answers. A task succeeds when every
  rank succeeded; counts (storage queries and prefetches) take the minimum over ranks,
  because a page is only usable where every rank has it. Completions are applied on a thread
  of their own, so the IPC reader never waits for the manager's lock (which a scheduler call
  may hold while it sends).

`LoadHandle` is what `match` returns for the model runner: it waits for the loads a request
depends on, per layer when the dispatcher can report layers.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvtier.manager.errors import TransferFailedError, TransferTimeoutError
from kvtier.worker.ipc import ManagerIPC, SendTimeout, TaskAborted
from kvtier.worker.wire import Completion, Task, TaskKind, merge_results

log = logging.getLogger("kvtier.transfers")

CompletionCallback = Callable[[Completion], None]
TransferObserver = Callable[[TaskKind, int, float], None]
"""Called as `observer(kind, blocks, seconds)` once per finished task (every rank answered)."""


class Dispatcher(ABC):
    """Carries tasks to the workers and outcomes back.

    Invariant: every submitted task is reported exactly once to the bound callback (ok or
    failed), and `wait` returns only after the callback for each named task has returned.
    """

    num_ranks: int = 1

    def __init__(self) -> None:
        self._on_complete: CompletionCallback | None = None
        self._cond = threading.Condition()
        self._pending: set[int] = set()

    def bind(self, on_complete: CompletionCallback) -> None:
        self._on_complete = on_complete

    def submit(self, task: Task) -> None:
        with self._cond:
            self._pending.add(task.seq)
        self._send(task)

    @abstractmethod
    def _send(self, task: Task) -> None:
        """Deliver `task`; its outcome must later reach `_deliver`."""

    def _deliver(self, completion: Completion) -> None:
        """Apply one task's merged outcome, then wake waiters."""
        assert self._on_complete is not None, "dispatcher used before bind()"
        try:
            self._on_complete(completion)
        finally:
            with self._cond:
                self._pending.discard(completion.seq)
                self._cond.notify_all()

    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def is_pending(self, seq: int) -> bool:
        with self._cond:
            return seq in self._pending

    def wait(self, seqs: Collection[int], timeout: float) -> None:
        """Block until every task in `seqs` has been applied; TransferTimeoutError after
        `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(s in self._pending for s in seqs):
                left = deadline - time.monotonic()
                if left <= 0:
                    late = sorted(s for s in seqs if s in self._pending)
                    raise TransferTimeoutError(
                        f"transfer task(s) {late[:8]} not complete after {timeout:.3g} s"
                    )
                self._cond.wait(left)

    def wait_layer(self, seq: int, layer: int, timeout: float) -> None:
        """Block until layer `layer` of load `seq` is on the device of every rank. The base
        class knows only whole tasks."""
        self.wait((seq,), timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until nothing is pending; False if that took longer than `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Release what the dispatcher holds (processes, queues); nothing by default."""
        return None


class ImmediateDispatcher(Dispatcher):
    """Completes each task as it is submitted, successfully unless `executor` says otherwise.

    `executor(task) -> Completion` lets a test or an in-process runner do real work.
    """

    def __init__(self, executor: Callable[[Task], Completion] | None = None,
                 num_ranks: int = 1) -> None:
        super().__init__()
        self._executor = executor
        self.num_ranks = num_ranks

    def _send(self, task: Task) -> None:
        if self._executor is None:
            self._deliver(Completion(task.seq, -1, True))
        else:
            self._deliver(self._executor(task))


class ManualDispatcher(Dispatcher):
    """Keeps tasks until `complete` is called, in any order and with any outcome.

    `resolver(task) -> (ok, result)` decides the outcome of tasks the manager blocks on (a
    write-back eviction waits for its copy); by default they succeed.
    """

    def __init__(self, resolver: Callable[[Task], tuple[bool, int]] | None = None) -> None:
        super().__init__()
        self.tasks: dict[int, Task] = {}
        self._resolver = resolver

    def _send(self, task: Task) -> None:
        self.tasks[task.seq] = task

    def complete(self, seq: int, ok: bool = True, result: int = 0,
                 detail: list[int] | None = None) -> None:
        task = self.tasks.pop(seq)
        self._deliver(Completion(task.seq, -1, ok, result, detail or [],
                                 "" if ok else "failed by test"))

    def wait(self, seqs: Collection[int], timeout: float) -> None:
        for seq in list(seqs):
            task = self.tasks.get(seq)
            if task is not None:
                ok, result = self._resolver(task) if self._resolver else (True, 0)
                self.complete(seq, ok, result)
        super().wait(seqs, timeout)


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

    def __init__(self, ipc: ManagerIPC, num_ranks: int,
                 on_transfer: TransferObserver | None = None) -> None:
        super().__init__()
        self.ipc = ipc
        # Called with every entry of `transfer_seconds` as it is logged (under the acks
        # lock, on the IPC reader's thread): a histogram fed here sees every task, where one
        # drained from the bounded log at scrape time would miss those pushed out.
        self._on_transfer = on_transfer
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
        except Exception as e:  # a dead rank's full queue, a rank down: fail, never hang
            log.warning("task %d (%s) could not be sent: %s", task.seq, task.kind.name, e)
            # Ranks that did get the task still run it: it is reported once they answered,
            # so no block it names is reused under their copy.
            delivered = set(e.delivered) if isinstance(e, SendTimeout) else set()
            with self._acks_lock:
                pend = self._acks.get(task.seq)
                if pend is not None:
                    pend.ok = False
                    pend.errors.append(str(e))
                    pend.ranks &= delivered
                    if not pend.ranks:
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

    def fail_rank(self, rank: int, reason: str, upto_seq: int | None = None) -> list[int]:
        """Fail every task still waiting for `rank` (it died), or only those with a seq up to
        `upto_seq` (sent to the dead worker; later ones go to its replacement). Returns their
        seqs: each is reported once the other ranks have answered it too."""
        failed: list[int] = []
        with self._acks_lock:
            for seq, pend in list(self._acks.items()):
                if rank in pend.ranks and (upto_seq is None or seq <= upto_seq):
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
            took = time.monotonic() - t0
            self.transfer_seconds.append((kind, blocks, took))
            if self._on_transfer is not None:
                try:
                    self._on_transfer(kind, blocks, took)
                except Exception:  # an observer must never break the dispatcher
                    log.exception("transfer observer %r failed", self._on_transfer)
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

    @property
    def applier(self) -> threading.Thread:
        """The thread that applies merged completions."""
        return self._applier

    def close(self) -> None:
        self._applyq.put(None)
        self._applier.join(timeout=5)


class LoadHandle:
    """Waits for the host->device loads a matched prefix depends on.

    `_loads` holds (seq, first block index the task covers) pairs; `failed_at` is filled in by
    the manager when a load fails, so the caller learns how many matched tokens are still good.
    """

    __slots__ = ("_dispatcher", "_loads", "block_size", "failed_at", "num_tokens", "reason",
                 "timeout")

    def __init__(self, dispatcher: Dispatcher | None, loads: list[tuple[int, int]],
                 num_tokens: int, block_size: int, timeout: float) -> None:
        self._dispatcher = dispatcher
        self._loads = loads
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.timeout = timeout
        self.failed_at: int | None = None
        self.reason = ""  # why the load failed, as the workers said (e.g. cancelled by a sleep)

    @property
    def has_loads(self) -> bool:
        return bool(self._loads)

    @property
    def seqs(self) -> list[int]:
        """Task seqs of the loads the prefix depends on (the load this match started, and
        loads of other requests' blocks it shares), for a model runner that waits per layer
        without the manager (`kvtier.worker.engine_kv.LayerWaiter.wait(seq, layer, ...)`)."""
        return list(dict.fromkeys(s for s, _ in self._loads))

    @property
    def seq(self) -> int | None:
        """The task seq of the one load the prefix depends on; None when nothing loads
        (every block was on the device). ValueError when it depends on several (a load of
        another request's blocks too): wait for each of `seqs` then."""
        seqs = self.seqs
        if not seqs:
            return None
        if len(seqs) > 1:
            raise ValueError(f"the prefix depends on {len(seqs)} loads {seqs}: use `seqs`")
        return seqs[0]

    @property
    def done(self) -> bool:
        d = self._dispatcher
        return d is None or not any(d.is_pending(s) for s, _ in self._loads)

    def note_failure(self, first_block: int, reason: str = "") -> None:
        if self.failed_at is None or first_block < self.failed_at:
            self.failed_at = first_block
        if reason and not self.reason:
            self.reason = reason

    def wait_layer(self, layer: int, timeout: float | None = None) -> None:
        """Return once layer `layer` of every block of the prefix is on the device."""
        if self._dispatcher is not None:
            t = self.timeout if timeout is None else timeout
            deadline = time.monotonic() + t
            for seq, _ in self._loads:
                left = max(0.0, deadline - time.monotonic())
                self._dispatcher.wait_layer(seq, layer, left)
        self._raise_if_failed()

    def wait(self, timeout: float | None = None) -> None:
        """Return once every load is complete; TransferFailedError if one failed (its
        `valid_tokens` say how much of the match is still good)."""
        if self._dispatcher is not None and self._loads:
            t = self.timeout if timeout is None else timeout
            self._dispatcher.wait([s for s, _ in self._loads], t)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.failed_at is not None:
            valid = self.failed_at * self.block_size
            why = f" ({self.reason})" if self.reason else ""
            raise TransferFailedError(
                f"a host->device load failed{why}: {valid} of {self.num_tokens} matched tokens "
                f"are valid, recompute the rest", valid)
