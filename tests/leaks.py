"""The session-end leak check (`conftest.pytest_sessionfinish`): what this run's tests left.

A test that starts `kvtier serve` (or a stack's workers) must stop it on every path: a leaked
serve holds its pools and POSIX queues, and two of them once exhausted the user's queue limit
and failed 56 tests of the next run. At the end of each test process (each xdist worker, or
the one process) `sweep` looks for

* `kvtier serve` / worker processes that are still this process's children, and
* /dev/shm names of this process's deployments (`support.new_deployment_id` puts the pid in
  every id: `<tag>-<pid>x...`): segments, semaphores, kept pools (`kvtier-keep_`),

kills and removes them (the deployment's queues too, `support.remove_leftovers`), and writes
what it found to `LEAKS_DIR/<pid>.txt`. The controller (`report`, after the workers are gone)
prints every file loudly and fails the session. Cost: one listing of /proc and of /dev/shm,
milliseconds.

vLLM's own segments (`psm_*`, Python's shared_memory names: 160-250 MB each) are left in
/dev/shm by a vLLM that is killed (the crash tests' SIGKILL, and vLLM's own SIGKILL of its
engine process on Ctrl-C and SIGTERM): 16 of them, 3.3 GB, had piled up on the build machine
over two days. `vllm_segments` (called by the controller) removes those created since the
session began that no process maps any more, and names them in one line; they are vLLM's
leak, not kvtier's, so they do not fail the session.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

from support import remove_leftovers

LEAKS_DIR = Path(".kvtier") / "leaks"
_SHM = Path("/dev/shm")


def _kvtier_child(argv: list[bytes]) -> bool:
    """`kvtier serve` (the console script or `-m kvtier.admin.cli`) or a worker process."""
    names = [a.rsplit(b"/", 1)[-1] for a in argv]
    serve = b"serve" in names and (b"kvtier" in names or b"kvtier.admin.cli" in names)
    return serve or b"kvtier.worker.process" in names


def _children(pid: int) -> list[tuple[int, list[bytes]]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == b"Z":
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        found.append((int(entry.name), argv))
    return found


def sweep(root: Path) -> list[str]:
    """This process's leftovers, killed and removed; one line each (also written to
    `root / LEAKS_DIR / <pid>.txt` when there are any)."""
    me = os.getpid()
    lines = []
    for pid, argv in _children(me):
        if _kvtier_child(argv):
            cmd = b" ".join(argv).decode(errors="replace")[:200]
            lines.append(f"process {pid} still running: {cmd}")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    tag = re.compile(rf"^(?:sem\.)?kvtier(?:_|-keep_)([A-Za-z0-9-]*-{me}x[A-Za-z0-9-]*?)_")
    deployments = set()
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(_SHM)):
            m = tag.match(name)
            if m:
                lines.append(f"/dev/shm/{name} left behind")
                deployments.add(m.group(1))
    for did in deployments:
        remove_leftovers(did)
    if lines:
        out = root / LEAKS_DIR
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{me}.txt").write_text("\n".join(lines) + "\n")
    return lines


def report(root: Path) -> list[str]:
    """Every test process's leak lines (their files taken)."""
    lines = []
    folder = root / LEAKS_DIR
    with contextlib.suppress(OSError):
        for path in sorted(folder.glob("*.txt")):
            lines += path.read_text().splitlines()
            path.unlink()
    return lines


def _mapped_shm() -> set[str]:
    """The /dev/shm files some live process maps now."""
    mapped: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", "rb") as f:
            for line in f:
                at = line.find(b" /dev/shm/")
                if at >= 0:
                    mapped.add(line[at + 10:].split(b" ", 1)[0].strip().decode(
                        errors="replace"))
    return mapped


def vllm_segments(since: float) -> str:
    """Remove the `psm_*` segments created at or after `since` (a wall-clock time) that no
    process maps; one line naming them, or "" when there were none."""
    try:
        names = [n for n in os.listdir(_SHM) if n.startswith("psm_")]
    except OSError:
        return ""
    fresh = []
    for name in names:
        with contextlib.suppress(OSError):
            st = (_SHM / name).stat()
            if st.st_mtime >= since and st.st_uid == os.getuid():
                fresh.append((name, st.st_size))
    if not fresh:
        return ""
    mapped = _mapped_shm()
    gone = []
    for name, size in fresh:
        if name not in mapped:
            with contextlib.suppress(OSError):
                (_SHM / name).unlink()
                gone.append((name, size))
    if not gone:
        return ""
    mb = sum(size for _, size in gone) / 2**20
    return (f"removed {len(gone)} shared-memory segment(s) vLLM left behind "
            f"({mb:.0f} MB): {', '.join(n for n, _ in gone)}")
