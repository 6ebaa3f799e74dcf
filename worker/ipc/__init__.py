"""The manager <-> worker transport: named POSIX queues, shared-memory flags and an id arena.

One manager process talks to `num_ranks` worker processes (one per tensor-parallel rank). The
bytes of each message are `kvtier.worker.wire`'s; this package only moves them and keeps the
flags both sides share. Its parts, bottom to top (import-linter contract `worker-ipc`):

* `errors`: what a caller may catch (`IPCError` and its kin, `SendTimeout`,
  `LayerWaitTimeout`).
* `names`: every kernel object name of a deployment (the table is in its docstring), their
  removal (`cleanup_stale`), and whether a process lives (`pid_alive`).
* `control`: the control segment's word layout (drawn in its docstring) and the protocols
  over its words: layer progress, storage figures, sleep, liveness; `owner_state` reads it.
* `manager_side`: `ManagerIPC`, which creates the names, owns the id arena (why queues and
  an arena: its docstring) and sends tasks; `worker_side`: `WorkerIPC`, one rank's end;
  `progress`: `LayerProgress`, layer waits without a manager object.

Everything public is re-exported here: `from kvtier.worker.ipc import ManagerIPC` is the way
to import it. `manager_side` and `worker_side` (with `kvtier.worker.wire`, hence numpy: about
0.3 s of CPU) load on first use of one of their names (`__getattr__` below), so a process that
needs only `names` or `control` (`kvtier status`, the configuration's `MAX_RANKS`, the admin's
token checks) does not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvtier.worker.ipc.control import (
    HEARTBEAT_INTERVAL_S,
    LAYERS_FAILED,
    MANAGER_TIMEOUT_S,
    MAX_LAYERS,
    SEND_TIMEOUT_S,
    STORAGE_FIGURES,
    OwnerState,
    RankState,
    TreeStatus,
    owner_state,
)
from kvtier.worker.ipc.errors import (
    DeploymentAsleep,
    DeploymentInUse,
    IPCError,
    LayerWaitTimeout,
    ManagerGone,
    SendTimeout,
    TaskAborted,
)
from kvtier.worker.ipc.names import (
    MAX_RANKS,
    IPCNames,
    cleanup_stale,
    existing_names,
    ipc_names,
    pid_alive,
    process_start_time,
    validate_deployment_id,
)
from kvtier.worker.ipc.progress import LayerProgress

if TYPE_CHECKING:
    from kvtier.worker.ipc.manager_side import (
        DEFAULT_ARENA_BYTES,
        MESSAGE_SIZE,
        PROGRESS_SLOTS,
        QUEUE_DEPTH,
        ManagerIPC,
    )
    from kvtier.worker.ipc.worker_side import WorkerIPC

_LAZY = {
    "DEFAULT_ARENA_BYTES": "manager_side",
    "MESSAGE_SIZE": "manager_side",
    "PROGRESS_SLOTS": "manager_side",
    "QUEUE_DEPTH": "manager_side",
    "ManagerIPC": "manager_side",
    "WorkerIPC": "worker_side",
}
"""The names whose modules load on first use: name -> module of this package."""


def __getattr__(name: str) -> object:
    """Load a `_LAZY` name's module on first use and keep the name here (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value

__all__ = [
    "DEFAULT_ARENA_BYTES",
    "HEARTBEAT_INTERVAL_S",
    "LAYERS_FAILED",
    "MANAGER_TIMEOUT_S",
    "MAX_LAYERS",
    "MAX_RANKS",
    "MESSAGE_SIZE",
    "PROGRESS_SLOTS",
    "QUEUE_DEPTH",
    "SEND_TIMEOUT_S",
    "STORAGE_FIGURES",
    "DeploymentAsleep",
    "DeploymentInUse",
    "IPCError",
    "IPCNames",
    "LayerProgress",
    "LayerWaitTimeout",
    "ManagerGone",
    "ManagerIPC",
    "OwnerState",
    "RankState",
    "SendTimeout",
    "TaskAborted",
    "TreeStatus",
    "WorkerIPC",
    "cleanup_stale",
    "existing_names",
    "ipc_names",
    "owner_state",
    "pid_alive",
    "process_start_time",
    "validate_deployment_id",
]
