"""Every kernel object name of a deployment, their removal, and whether a process lives.

Every name derives from the deployment id, so two deployments never collide and a restart
can remove what a crashed run of the same id left behind:

    /kvtier_<id>_ctl        shared memory  control segment (flags, heartbeats, layer progress)
    /kvtier_<id>_arena      shared memory  id arena: tasks too large for one queue message
    /kvtier_<id>_notify     semaphore      "the control segment changed" (wakes manager waiters)
    /kvtier_<id>_task<r>    message queue  tasks for rank r (manager -> worker r), FIFO
    /kvtier_<id>_done       message queue  completions (every worker -> manager)

All are created with mode 0600 by the manager (`ManagerIPC`), after unlinking stale ones of
the same id, and unlinked by `ManagerIPC.close()` (also run at interpreter exit). Workers
(`WorkerIPC`) only attach.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import posix_ipc

MAX_RANKS = 64

_DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")


def validate_deployment_id(deployment_id: str) -> str:
    """The id itself, or ValueError: ids become parts of kernel object names."""
    if not isinstance(deployment_id, str) or not _DEPLOYMENT_ID.fullmatch(deployment_id):
        raise ValueError(
            f"deployment_id {deployment_id!r} is invalid: use 1-32 characters of A-Z a-z 0-9 _ -"
        )
    return deployment_id


@dataclass(frozen=True, slots=True)
class IPCNames:
    """Every kernel object name of one deployment with `num_ranks` ranks.

    No two deployment ids share a name: each name is `/kvtier_<id>_<suffix>` and no suffix
    contains `_`, so the id is everything between the prefix and the last `_`."""

    deployment_id: str
    num_ranks: int
    control: str
    arena: str
    notify: str
    completions: str
    tasks: tuple[str, ...]

    @property
    def segments(self) -> tuple[str, ...]:
        """Shared-memory segment names (visible in /dev/shm)."""
        return (self.control, self.arena)

    @property
    def semaphores(self) -> tuple[str, ...]:
        """Semaphore names (visible in /dev/shm as sem.<name>)."""
        return (self.notify,)

    @property
    def queues(self) -> tuple[str, ...]:
        """Message-queue names (in the mqueue namespace)."""
        return (*self.tasks, self.completions)

    def all(self) -> list[str]:
        """Every name, segments first."""
        return [*self.segments, *self.semaphores, *self.queues]


def ipc_names(deployment_id: str, num_ranks: int) -> IPCNames:
    """The names a deployment of `num_ranks` ranks uses."""
    validate_deployment_id(deployment_id)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
        raise ValueError(f"num_ranks must be an int, got {num_ranks!r}")
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks {num_ranks} out of range [1, {MAX_RANKS}]")
    p = f"/kvtier_{deployment_id}_"
    return IPCNames(
        deployment_id=deployment_id,
        num_ranks=num_ranks,
        control=p + "ctl",
        arena=p + "arena",
        notify=p + "notify",
        completions=p + "done",
        tasks=tuple(f"{p}task{r}" for r in range(num_ranks)),
    )


def _unlink(name: str, kind: str) -> bool:
    unlink = {
        "segment": posix_ipc.unlink_shared_memory,
        "semaphore": posix_ipc.unlink_semaphore,
        "queue": posix_ipc.unlink_message_queue,
    }[kind]
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _kinds(names: IPCNames) -> list[tuple[str, str]]:
    return (
        [(n, "segment") for n in names.segments]
        + [(n, "semaphore") for n in names.semaphores]
        + [(n, "queue") for n in names.queues]
    )


def cleanup_stale(deployment_id: str, max_ranks: int = MAX_RANKS) -> list[str]:
    """Unlink every name a deployment of this id (with up to `max_ranks` ranks) could have
    created; returns the names that existed. Only for ids no live manager uses."""
    removed = []
    for name, kind in _kinds(ipc_names(deployment_id, max_ranks)):
        if _unlink(name, kind):
            removed.append(name)
    return removed


def existing_names(deployment_id: str, max_ranks: int = MAX_RANKS) -> list[str]:
    """Which of the deployment's names exist now (tests use it to check nothing is left).

    Checked by opening each object, since /dev/mqueue is not necessarily mounted."""
    found = []
    for name, kind in _kinds(ipc_names(deployment_id, max_ranks)):
        try:
            if kind == "segment":
                posix_ipc.SharedMemory(name).close_fd()
            elif kind == "semaphore":
                posix_ipc.Semaphore(name).close()
            else:
                posix_ipc.MessageQueue(name).close()
        except posix_ipc.ExistentialError:
            continue
        found.append(name)
    return found


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22); None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text.rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
