"""Transfers as data: how the manager hands tasks to workers and learns their outcome.

The manager never copies bytes. It builds `kvtier.worker.wire.Task`s, gives them to a `Dispatcher`,
and applies each task's outcome when the dispatcher reports it (once per task, after every
rank answered: ok only if every rank was ok; for storage queries the smallest count of any
rank). Dispatchers:

* `ImmediateDispatcher` completes every task as it is submitted (unit tests, benchmarks, and
  embedding without workers).
* `ManualDispatcher` keeps tasks pending until a test completes them, in any order, with any
  outcome.
* `kvtier.manager.launcher.ProcessDispatcher` sends them to worker processes.

`LoadHandle` is what `match` returns for the model runner: it waits for the loads a request
depends on, per layer when the dispatcher can report layers.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection

from kvtier.manager.errors import TransferFailedError, TransferTimeoutError
from kvtier.worker.wire import Completion, Task

CompletionCallback = Callable[[Completion], None]


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

    def __init__(self, executor: Callable[[Task], Completion] | None = None) -> None:
        super().__init__()
        self._executor = executor

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
