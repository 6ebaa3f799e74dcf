"""The task ledger: every task the core emits, from its sequence number to its completion.

A task is queued (`submit` / `track`), sent once the scheduler call that made it has finished
changing state (`flush`: an immediate dispatcher answers inside `submit`, re-entering the
core), and answered by the dispatcher's thread (`complete`), which routes it to the core's
transition for its kind and then to the task's own `on_done`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.manager.core.hooks import OnDone
from kvtier.manager.core.nodes import PINNED, Node
from kvtier.manager.transfers import Dispatcher, LoadHandle
from kvtier.worker.wire import Completion, Task, TaskKind

Finish = Callable[["Inflight", bool, str], None]
"""A core transition applying a task's outcome: `finish(record, ok, error)`."""


@dataclass(slots=True)
class Inflight:
    """A submitted task the core still waits to hear about."""

    task: Task
    nodes: list[Node]
    first_block: int = 0
    handles: list[tuple[LoadHandle, int]] = field(default_factory=list)  # (waiter, block idx)
    on_done: OnDone | None = None  # diagnostic and storage-tier tasks


class TaskLedger:
    """Sequence numbers, tasks in flight, the outbox and completion routing of one core.

    Data structures: `inflight` seq -> Inflight for every task not yet answered (insertion
    order = seq order); `outbox` tasks queued and not yet handed to the dispatcher; `loading`
    node -> seq of the H2D task filling its device block (what a hit on a LOADING node waits
    for: one dict lookup, where a scan of the tasks in flight used to be); `finishers` task
    kind -> the core transition that applies an answer of that kind.

    Invariants: every task in `outbox` is in `inflight`; `loading[n] == s` exactly when
    `inflight[s]` is an H2D task whose nodes include `n` (the latest one, should a node be
    loaded twice).
    """

    __slots__ = ("dispatcher", "finishers", "inflight", "loading", "outbox", "seq")

    def __init__(self, dispatcher: Dispatcher, finishers: dict[TaskKind, Finish]) -> None:
        self.dispatcher = dispatcher
        self.finishers = finishers
        self.seq = 0
        self.inflight: dict[int, Inflight] = {}
        self.outbox: list[Task] = []
        self.loading: dict[Node, int] = {}

    def __len__(self) -> int:
        return len(self.inflight)

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def submit(self, kind: TaskKind, src: list[int], dst: list[int], nodes: list[Node],
               priority: int, first_block: int = 0) -> int:
        """Queue a transfer of the core's own (H2D, D2H); returns its seq."""
        self.seq = seq = self.seq + 1
        task = Task(seq, kind, src, dst, [], priority)
        self.inflight[seq] = Inflight(task, nodes, first_block)
        self.outbox.append(task)
        if kind == TaskKind.H2D:
            loading = self.loading
            for node in nodes:
                loading[node] = seq
        return seq

    def track(self, task: Task, nodes: list[Node], on_done: OnDone | None = None) -> None:
        """Queue a task built by a client (storage tier, diagnostics). The record keeps
        `nodes` itself, not a copy (`hand_over` changes it in place)."""
        self.inflight[task.seq] = Inflight(task, nodes, on_done=on_done)
        self.outbox.append(task)

    def hand_over(self, old: Node, fresh: Node) -> None:
        """`old`'s host copy, which tasks in flight still use (a storage backup reading it),
        moved to `fresh` (a failed load detached `old`): those tasks name `fresh` from now on.
        Each record's node list is changed in place, so a client's `on_done` that holds the
        list it gave `track` (the storage tier's BACKUP batches) sees `fresh` too. A scan of
        the tasks in flight: only on a failed load."""
        for rec in self.inflight.values():
            nodes = rec.nodes
            for i, node in enumerate(nodes):
                if node is old:
                    nodes[i] = fresh

    def loading_seq(self, node: Node) -> int | None:
        """The seq of the H2D task filling `node`'s device block, if one is in flight."""
        return self.loading.get(node)

    def add_waiter(self, seq: int, handle: LoadHandle, block: int) -> None:
        """`handle` hears of a failure of task `seq` (from block `block` of its request on)."""
        rec = self.inflight.get(seq)
        if rec is not None:
            rec.handles.append((handle, block))

    def flush(self) -> None:
        """Hand queued tasks to the dispatcher (the state they describe is complete)."""
        while self.outbox:
            tasks, self.outbox = self.outbox, []
            submit = self.dispatcher.submit
            for t in tasks:
                submit(t)

    def complete(self, comp: Completion) -> Inflight | None:
        """Route an answer: forget the task, apply it through the core's transition for its
        kind, then its `on_done`. Caller holds the core's lock. None for an unknown seq (an
        answer after a rebuild, or twice)."""
        rec = self.inflight.pop(comp.seq, None)
        if rec is None:
            return None
        kind = rec.task.kind
        if kind == TaskKind.H2D:
            loading = self.loading
            seq = comp.seq
            for node in rec.nodes:
                if loading.get(node) == seq:
                    del loading[node]
        finish = self.finishers.get(kind)
        if finish is not None:
            finish(rec, comp.ok, comp.error)
        if rec.on_done is not None:
            rec.on_done(comp.ok, comp)
        return rec

    def busy_device_blocks(self) -> list[tuple[int, int]]:
        """(seq, blocks) of the transfers in flight whose device blocks no request holds: each
        block becomes free or evictable when its task is answered. Oldest first. A scan of
        the tasks in flight: only for allocations that would otherwise fail."""
        out: list[tuple[int, int]] = []
        for seq, rec in self.inflight.items():
            if rec.task.kind not in (TaskKind.D2H, TaskKind.H2D):
                continue
            n = sum(1 for node in rec.nodes
                    if node.dev is not None and node.ref == 0 and not node.flags & PINNED)
            if n:
                out.append((seq, n))
        out.sort()
        return out

    def check(self) -> None:
        """Assert the ledger's invariants (a full scan)."""
        queued = {t.seq for t in self.outbox}
        assert queued <= self.inflight.keys(), "a queued task is not in flight"
        for node, seq in self.loading.items():
            rec = self.inflight.get(seq)
            assert rec is not None and rec.task.kind == TaskKind.H2D, (
                f"{node} indexed as loading by task {seq}, which is not an H2D in flight")
            assert any(n is node for n in rec.nodes), f"{node} not among task {seq}'s nodes"
        for seq, rec in self.inflight.items():
            if rec.task.kind == TaskKind.H2D:
                for n in rec.nodes:
                    assert n in self.loading, f"{n} of load {seq} missing from the index"
