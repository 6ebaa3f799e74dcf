"""A byte-level stand-in for the workers, for stateful tests of the manager.

Each block of each tier holds a "content" value: the key of what was written there (the
model runner writes a block's key when it computes the block; copies move contents). A
transfer copies at completion time and asserts its source did not change while it was in
flight, so a manager that reuses a block too early is caught. Failed transfers leave garbage
in their destinations, so a manager that serves them is caught too.

Storage: `storage` maps a page's storage key to its content. A BACKUP stores its host blocks'
contents (checked unchanged since submission, like a copy's source); a PREFETCH that answers
`result` fills its first `result` host blocks from storage and leaves garbage in the rest (a
revoked or cut-short prefetch: the manager must never serve those).
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
    storage: dict[bytes, int] = field(default_factory=dict)

    def tiers(self, kind: TaskKind) -> tuple[dict[int, int], dict[int, int]]:
        if kind == TaskKind.D2H:
            return self.device, self.host
        return self.host, self.device

    def on_submit(self, task: Task) -> None:
        if task.kind in (TaskKind.D2H, TaskKind.H2D):
            src, _ = self.tiers(task.kind)
            self.snapshots[task.seq] = [src.get(i, GARBAGE) for i in task.src]
        elif task.kind == TaskKind.BACKUP:
            self.snapshots[task.seq] = [self.host.get(i, GARBAGE) for i in task.src]

    def leading_stored(self, keys: list[bytes]) -> int:
        """How many leading pages of `keys` storage holds (a truthful QUERY answer)."""
        n = 0
        for k in keys:
            if self.storage.get(k, GARBAGE) == GARBAGE:
                break
            n += 1
        return n

    def on_complete(self, task: Task, ok: bool, result: int = 0) -> None:
        if task.kind == TaskKind.BACKUP:
            before = self.snapshots.pop(task.seq)
            now = [self.host.get(i, GARBAGE) for i in task.src]
            assert before == now, (
                f"task {task.seq} BACKUP: host blocks {task.src} changed while being written "
                f"to storage: {before} -> {now}")
            for key, content in zip(task.keys, now, strict=True):
                if ok and content != GARBAGE:  # a lost worker's bytes never reach storage
                    self.storage[key] = content
            return
        if task.kind == TaskKind.PREFETCH:
            for i, (key, h) in enumerate(zip(task.keys, task.dst, strict=True)):
                self.host[h] = (self.storage.get(key, GARBAGE) if ok and i < result
                                else GARBAGE)
            return
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
        self.model.on_complete(self.tasks[seq], ok, result)
        super().complete(seq, ok, result, detail)
