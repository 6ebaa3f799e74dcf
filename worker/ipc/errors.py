"""The transport's errors: what a caller of `ManagerIPC`, `WorkerIPC` or `LayerProgress` may
catch. Every one derives from `KvtierError`; the timeouts keep `TimeoutError` and the others
`RuntimeError` as their built-in base, so existing `except` clauses still work."""

from __future__ import annotations

from kvtier.worker.errors import KvtierError


class IPCError(KvtierError, RuntimeError):
    """The transport cannot do what was asked (missing deployment, kernel limit, ...)."""


class DeploymentInUse(IPCError):
    """Another live manager holds this deployment id."""


class ManagerGone(IPCError):
    """Raised on the worker side when the manager died or stopped beating.

    `pid_gone` tells a dead manager (its names may be removed) from a stalled one."""

    def __init__(self, message: str, *, pid_gone: bool) -> None:
        super().__init__(message)
        self.pid_gone = pid_gone


class TaskAborted(IPCError):
    """A layer waiter's task failed on some rank, or the manager aborted it."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"task seq={seq} aborted: {reason}")
        self.seq = seq
        self.reason = reason


class DeploymentAsleep(IPCError):
    """The deployment's pools are freed (a sleep for a weight update), or were re-created
    since a load began: the loads of before the sleep were cancelled and never land."""


class SendTimeout(KvtierError, TimeoutError):
    """A bounded send gave up. `rank` is the rank whose queue stayed full (None for the
    completion queue or the arena); `delivered` lists the ranks that did get the task."""

    def __init__(self, message: str, *, rank: int | None, delivered: list[int]) -> None:
        super().__init__(message)
        self.rank = rank
        self.delivered = delivered


class LayerWaitTimeout(KvtierError, TimeoutError):
    """`wait_layer` timed out; `ranks` are the ranks that had not published the layer."""

    def __init__(self, message: str, *, seq: int, layer: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.seq = seq
        self.layer = layer
        self.ranks = ranks
