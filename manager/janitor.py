"""A deployment's kernel names, worker logs and private state removed once its owner is gone,
whichever way it went.

Why a separate process: an engine that embeds kvtier may end the process that owns a deployment
(the one running the manager) and every process below it with SIGKILL. vLLM does exactly that on
Ctrl-C or SIGTERM of `vllm serve` (its default shutdown timeout is 0 s: the engine core process
and its whole process tree, kvtier's workers included, are killed at once), so no code of the
owner or of its workers runs afterwards and nothing inside them can unlink a name. Two things
clean up instead:

* `spawn_watcher(id)`: a small process (`python -m kvtier.manager.janitor watch ID PID`) that
  detaches at once (a double fork in a session of its own), so neither a kill of the owner's
  process tree nor the terminal's Ctrl-C reaches it. It waits on the owner's pid (a pidfd, no
  polling), then up to `WORKER_GRACE_S` for the deployment's worker processes to end, and then
  removes what is left of the deployment. After a clean stop nothing is left: it exits quietly.
* `sweep_dead(pattern)`: at start, every deployment whose id matches `pattern` and whose owner is
  dead (no control segment, or its manager pid gone and its heartbeat stale) is removed: what a
  crash that also took the watcher (kill -9 of everything, a container's cgroup killed) left.

What belongs to deployment `<id>` (`remove_deployment`):

    /dev/shm/kvtier_<id>_*          control, arena, host pools, every other segment of the id
    /dev/shm/sem.kvtier_<id>_*      its semaphores
    message queues                  /kvtier_<id>_task<r>, /kvtier_<id>_done, unlinked by name
                                    (/dev/mqueue is not mounted everywhere)
    <tmp>/kvtier-<id>-XXXXXXXX      the launcher's worker log folders of its runs
    <state>/<id>/                   its private state (a generated admin token)

A live owner is never touched: `owner_state(...).alive` is true while the manager's pid runs or
its heartbeat is fresh (a pid of another pid namespace looks dead, its heartbeat does not).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import posix_ipc
from kvtier.manager.private_state import state_base
from kvtier.worker.ipc import cleanup_stale, owner_state, pid_alive, validate_deployment_id

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
MQUEUE_DIR = Path("/dev/mqueue")
WORKER_GRACE_S = 10.0  # workers notice a dead manager within 3 s (MANAGER_TIMEOUT_S)
_POLL_S = 0.5  # only where pidfd_open is unavailable


def _log_dirs(deployment_id: str) -> list[Path]:
    """The launcher's worker log folders of this id (`tempfile.mkdtemp(prefix="kvtier-<id>-")`:
    8 characters of [a-z0-9_] follow, so another id's folders never match)."""
    pattern = re.compile(re.escape(f"kvtier-{deployment_id}-") + r"[a-z0-9_]{8}")
    try:
        return [p for p in Path(tempfile.gettempdir()).iterdir()
                if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return []


def _shm_names(deployment_id: str) -> list[tuple[str, str]]:
    """(name, kind) of this id's segments and semaphores found in /dev/shm."""
    prefix = f"kvtier_{deployment_id}_"
    found: list[tuple[str, str]] = []
    with contextlib.suppress(OSError), os.scandir(SHM_DIR) as entries:
        for e in entries:
            if e.name.startswith(prefix):
                found.append(("/" + e.name, "segment"))
            elif e.name.startswith("sem." + prefix):
                found.append(("/" + e.name.removeprefix("sem."), "semaphore"))
    with contextlib.suppress(OSError), os.scandir(MQUEUE_DIR) as entries:
        for e in entries:
            if e.name.startswith(prefix):
                found.append(("/" + e.name, "queue"))
    return found


def remove_deployment(deployment_id: str) -> list[str]:
    """Remove every name, log folder and state folder of `deployment_id` (see the module
    docstring); returns what existed. Only for an id no live owner holds."""
    validate_deployment_id(deployment_id)
    try:
        removed = cleanup_stale(deployment_id)
    except OSError:  # a name of another user's (not ours to remove): the rest still goes
        removed = []
    unlink = {"segment": posix_ipc.unlink_shared_memory,
              "semaphore": posix_ipc.unlink_semaphore,
              "queue": posix_ipc.unlink_message_queue}
    for name, kind in _shm_names(deployment_id):
        with contextlib.suppress(posix_ipc.ExistentialError, OSError):
            unlink[kind](name)
            removed.append(name)
    for path in _log_dirs(deployment_id):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    state = state_base() / deployment_id
    if state.is_dir() and not state.is_symlink():
        shutil.rmtree(state, ignore_errors=True)
        removed.append(str(state))
    return removed


def _mine(entry: os.DirEntry[str]) -> bool:
    """Owned by this user: another user's names are neither readable nor removable here."""
    try:
        return entry.stat(follow_symlinks=False).st_uid == os.geteuid()
    except OSError:
        return False


def _ids_seen(pattern: re.Pattern[str]) -> set[str]:
    """Ids matching `pattern` that own something of this user's in /dev/shm, /dev/mqueue,
    the temporary folder (log folders) or the state folder."""
    ids: set[str] = set()
    name = re.compile(r"(?:sem\.)?kvtier_(.+?)_[a-z0-9]+(?:_[a-z0-9]+)*")
    for folder in (SHM_DIR, MQUEUE_DIR):
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for e in entries:
                m = name.fullmatch(e.name)
                if m is not None and pattern.fullmatch(m.group(1)) and _mine(e):
                    ids.add(m.group(1))
    log_dir = re.compile(r"kvtier-(.+)-[a-z0-9_]{8}")
    with contextlib.suppress(OSError), os.scandir(tempfile.gettempdir()) as entries:
        for e in entries:
            m = log_dir.fullmatch(e.name)
            if m is not None and pattern.fullmatch(m.group(1)) and _mine(e):
                ids.add(m.group(1))
    with contextlib.suppress(OSError), os.scandir(state_base()) as entries:
        for e in entries:
            if pattern.fullmatch(e.name):
                ids.add(e.name)
    return ids


def sweep_dead(pattern: str, *, keep: str = "") -> dict[str, list[str]]:
    """Remove every deployment whose id fully matches `pattern` (a regular expression), other
    than `keep`, whose owner is dead; returns the removed names per id."""
    regex = re.compile(pattern)
    swept: dict[str, list[str]] = {}
    for deployment_id in sorted(_ids_seen(regex) - {keep}):
        state = owner_state(deployment_id)
        if state is not None and state.alive:
            continue
        removed = remove_deployment(deployment_id)
        if removed:
            swept[deployment_id] = removed
    return swept


# ---------------------------------------------------------------------------- the watcher


def _wait_for_exit(pid: int) -> None:
    """Return once `pid` has ended (blocking on a pidfd; polling where there is none)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (OSError, AttributeError):
        while pid_alive(pid):
            time.sleep(_POLL_S)
        return
    try:
        while pid_alive(pid):
            select.select([fd], [], [], 60.0)
    finally:
        os.close(fd)


def watch(deployment_id: str, owner_pid: int) -> list[str]:
    """Wait until `owner_pid` ends, then until the deployment's workers have ended (at most
    `WORKER_GRACE_S`), and remove what is left of the deployment."""
    _wait_for_exit(owner_pid)

    def taken_over() -> bool:  # a given (stable) id restarted meanwhile: not ours to clean
        now = owner_state(deployment_id)
        return now is not None and now.manager_pid != owner_pid and now.alive

    state = owner_state(deployment_id)
    if taken_over():
        return []
    workers = [p for p in (state.worker_pids if state else ()) if p > 0]
    deadline = time.monotonic() + WORKER_GRACE_S
    while any(pid_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [] if taken_over() else remove_deployment(deployment_id)


def spawn_watcher(deployment_id: str, owner_pid: int | None = None) -> None:
    """Start the watcher of `deployment_id` for `owner_pid` (default: this process). Returns
    once it has detached (its intermediate process exits at once); its own lines go to this
    process's stderr (the engine's log)."""
    validate_deployment_id(deployment_id)
    pid = os.getpid() if owner_pid is None else owner_pid
    subprocess.run(
        [sys.executable, "-m", "kvtier.manager.janitor", "watch", deployment_id, str(pid)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        close_fds=True, check=True, timeout=60)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] != "watch" or not args[2].isdigit():
        print("usage: python -m kvtier.manager.janitor watch DEPLOYMENT_ID OWNER_PID",
              file=sys.stderr)
        return 2
    deployment_id, owner_pid = validate_deployment_id(args[1]), int(args[2])
    if os.fork():  # the parent returns to spawn_watcher at once; the child is reparented
        os._exit(0)
    try:
        removed = watch(deployment_id, owner_pid)
    except Exception as e:  # the engine's log says so; the next start's sweep retries
        print(f"kvtier janitor: deployment {deployment_id}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        return 1
    if removed:
        print(f"kvtier janitor: deployment {deployment_id}'s owner pid {owner_pid} ended "
              f"without removing its names; removed {len(removed)}: {' '.join(removed)}",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
