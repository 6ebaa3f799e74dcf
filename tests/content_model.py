"""A byte-level stand-in for the workers, for stateful tests of the manager.

Each block of each tier holds a "content" value: the key of what was written there (the
model runner writes a block's key when it computes the block; copies move contents). A
transfer copies at completion time and asserts its source did not change while it was in
flight, so a manager that reuses a block too early is caught. Failed transfers leave garbage
in their destinations, so a manager that serves them is caught too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.manager.transfers import ManualDispatcher
from kvtier.worker.wire import Task, TaskKind

GARBAGE = -1


@dataclass
class ContentModel:
    device: dict[int, int] = field(default_factory=dict)
    host: dict[int, int] = field(default_factory=dict)
    snapshots: dict[int, list[int]] = field(default_factory=dict)

    def tiers(self, kind: TaskKind) -> tuple[dict[int, int], dict[int, int]]:
        if kind == TaskKind.D2H:
            return self.device, self.host
        return self.host, self.device

    def on_submit(self, task: Task) -> None:
        if task.kind in (TaskKind.D2H, TaskKind.H2D):
            src, _ = self.tiers(task.kind)
            self.snapshots[task.seq] = [src.get(i, GARBAGE) for i in task.src]

    def on_complete(self, task: Task, ok: bool) -> None:
        if task.kind not in (TaskKind.D2H, TaskKind.H2D):
            return
        src, dst = self.tiers(task.kind)
        before = self.snapshots.pop(task.seq)
        now = [src.get(i, GARBAGE) for i in task.src]
        assert before == now, (
            f"task {task.seq} {task.kind.name}: source blocks {task.src} changed while the "
            f"copy was in flight: {before} -> {now}")
        for s, d in zip(task.src, task.dst, strict=True):
            dst[d] = src.get(s, GARBAGE) if ok else GARBAGE


class ModelDispatcher(ManualDispatcher):
    """ManualDispatcher whose completions move contents in a ContentModel."""

    def __init__(self, model: ContentModel, resolver=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(resolver)
        self.model = model

    def _send(self, task: Task) -> None:
        self.model.on_submit(task)
        super()._send(task)

    def complete(self, seq: int, ok: bool = True, result: int = 0,
                 detail: list[int] | None = None) -> None:
        self.model.on_complete(self.tasks[seq], ok)
        super().complete(seq, ok, result, detail)
