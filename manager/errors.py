"""The errors of the scheduler API, and `KvtierError`, the root of every error kvtier raises
on purpose (re-exported from `kvtier.worker.errors`: the root lives in the bottom layer so
that the worker's errors derive from it too). Each message names the request, field or count
at fault.

Errors defined elsewhere that also derive from `KvtierError`: `ConfigError`
(`kvtier.manager.config`), `TokenKeyError` (`kvtier.manager.keys`), `TraceError`
(`kvtier.manager.workloads`), `WorkerStartError` (`kvtier.manager.launcher`), `IPCError` and
its subclasses, `SendTimeout`, `LayerWaitTimeout` (`kvtier.worker.ipc`), `StorageError`
(`kvtier.worker.executor`), `PoolConfigError`, `BlockIdError` (`kvtier.worker.kv_pools`),
`AdminBindError`, `AdminStartError` (`kvtier.admin.server`), `AdminCallError`
(`kvtier.admin.client`), `NumaError`
(`kvtier.worker.numa`), `PoolsFreedError` (`kvtier.worker.executor`), `DeploymentAsleep`
(`kvtier.worker.ipc`). Each keeps its built-in base
(`ValueError`, `TimeoutError`, `OSError`, `RuntimeError`) where it has one.
"""

from __future__ import annotations

from kvtier.worker.errors import KvtierError

__all__ = [
    "AsleepError",
    "BlockPoolError",
    "InvalidRequestError",
    "KvtierError",
    "OutOfBlocksError",
    "RequestCancelledError",
    "ResetBusyError",
    "TransferFailedError",
    "TransferTimeoutError",
    "UnknownRequestError",
]


class InvalidRequestError(KvtierError, ValueError):
    """A scheduler call with arguments that cannot be right (negative counts, bad tokens)."""


class UnknownRequestError(KvtierError, KeyError):
    """A request id the manager does not know (never matched, or already released)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown request"


class OutOfBlocksError(KvtierError):
    """Not enough free or evictable blocks; nothing was changed."""


class BlockPoolError(KvtierError):
    """A block id freed twice or not belonging to the pool: a bug in the caller."""


class TransferFailedError(KvtierError):
    """A load the caller waited on failed; `valid_tokens` of the match are still good."""

    def __init__(self, message: str, valid_tokens: int) -> None:
        super().__init__(message)
        self.valid_tokens = valid_tokens


class TransferTimeoutError(KvtierError, TimeoutError):
    """A wait on a transfer ran out of time (a worker stopped answering)."""


class ResetBusyError(KvtierError):
    """A reset could not run because transfers did not finish in time; nothing was cleared."""


class AsleepError(KvtierError):
    """The deployment is asleep (its pools are freed for a weight update) or going to sleep
    or waking: scheduler calls are refused until the wake is complete."""


class RequestCancelledError(UnknownRequestError):
    """The request was active when the deployment went to sleep: its blocks were reclaimed
    and nothing it computed is cached (match it again after the wake; `release` is a no-op)."""
