"""kvtier.manager.janitor against real processes and real names: an owner that is killed with
SIGKILL (as vLLM kills its engine process tree) leaves its control segment, arena, semaphore,
queues, a host segment, a /tmp log folder and a state folder; the watcher removes them all once
the owner is gone, a start's sweep removes a dead owner's and never a live one's.

The owner is a child Python process holding a real `ManagerIPC` (what a manager creates first)
plus the files a launcher and an admin add; it prints "ready" and then sleeps until killed.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.manager import janitor
from support import clean_env, leftovers, pid_exists, remove_leftovers, wait_until

pytestmark = pytest.mark.fast

OWNER = """
import os, sys, time, tempfile
from pathlib import Path
import posix_ipc
from kvtier.worker.ipc import ManagerIPC
dep = sys.argv[1]
ipc = ManagerIPC(dep, 1)
posix_ipc.SharedMemory(f"/kvtier_{dep}_host_r0", posix_ipc.O_CREX, mode=0o600, size=4096)
tempfile.mkdtemp(prefix=f"kvtier-{dep}-")
state = Path(os.environ["XDG_STATE_HOME"]) / "kvtier" / dep
state.mkdir(parents=True)
(state / "admin-token").write_text("x")
print("ready", flush=True)
time.sleep(600)
"""


def new_id() -> str:
    return f"jan-{secrets.token_hex(6)}"


PATTERN = r"jan-[0-9a-f]{12}"


def everything(dep: str, state: Path) -> list[str]:
    found = leftovers(dep, 1)
    found += [str(p) for p in Path(tempfile.gettempdir()).glob(f"kvtier-{dep}-*")]
    if (state / "kvtier" / dep).exists():
        found.append(str(state / "kvtier" / dep))
    return found


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    return tmp_path / "state"


@pytest.fixture
def owner(state: Path) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    dep = new_id()
    proc = subprocess.Popen([sys.executable, "-c", OWNER, dep], stdout=subprocess.PIPE,
                            text=True, env=clean_env(XDG_STATE_HOME=str(state)))
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert any("_ctl" in n for n in everything(dep, state))
        yield dep, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        remove_leftovers(dep)
        for p in Path(tempfile.gettempdir()).glob(f"kvtier-{dep}-*"):
            os.rmdir(p)


@pytest.mark.slow  # waits out the dead owner's heartbeat (3 s)
def test_the_sweep_leaves_a_live_owner_alone_and_removes_a_killed_ones_everything(
        owner: tuple[str, subprocess.Popen[str]], state: Path) -> None:
    dep, proc = owner
    before = everything(dep, state)
    assert janitor.sweep_dead(PATTERN) == {}
    assert everything(dep, state) == before
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    # its heartbeat must go stale too (a pid of another namespace looks dead)
    wait_until(lambda: janitor.sweep_dead(PATTERN).get(dep), 30, "the dead owner swept", 0.2)
    assert everything(dep, state) == []


def test_the_watcher_removes_everything_once_the_owner_is_killed(
        owner: tuple[str, subprocess.Popen[str]], state: Path) -> None:
    dep, proc = owner
    janitor.spawn_watcher(dep, proc.pid)
    # detached: not a child of ours (a tree kill of the owner's parent does not reach it)
    watchers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                and f"janitor\0watch\0{dep}".encode() in _cmdline(p)]
    assert len(watchers) == 1
    watcher = int(watchers[0].name)
    assert _ppid(watcher) != os.getpid()
    assert everything(dep, state), "the watcher removed a live owner's names"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    wait_until(lambda: not everything(dep, state), 30, "the watcher removed the names", 0.1)
    wait_until(lambda: not pid_exists(watcher), 30, "the watcher exited", 0.1)


def test_the_watcher_of_a_clean_stop_finds_nothing_and_exits(state: Path) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    dep = new_id()
    try:
        janitor.spawn_watcher(dep, sleeper.pid)
    finally:
        sleeper.terminate()
        sleeper.wait(timeout=30)
    assert janitor.watch(dep, sleeper.pid) == []


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])
