"""Helpers every kind of test needs, in one place: bounded waits, fresh deployment ids and
segment names, what a deployment left behind (and removing it), tiny configurations, free
ports, a clean environment and the command line for `kvtier` child processes, and the external
tools some tests run (promtool, prometheus, docker-compose).

This module imports neither torch nor the Stack, so the wire, IPC and pool tests use it at no
cost. What needs more lives next to it: running Stacks and diagnostics in stack_support,
`kvtier serve` children in serve_support, the storage tier's model runner in storage_support,
redis-server processes in redis_server (which stays standalone: bench/ imports it too).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import posix_ipc
import pytest
from kvtier.manager.config import KvtierConfig, load_config
from kvtier.worker.ipc import cleanup_stale, existing_names, ipc_names
from redis_server import free_port as free_port  # one home for "a free port" in the tests

SHM_DIR = Path("/dev/shm")
# Where tiny_config puts the workers' device pools: "cpu" everywhere by default; "cuda" runs the
# same worker-process tests on a GPU (scripts/gpu-check.sh sets it).
TEST_DEVICE = os.environ.get("KVTIER_TEST_DEVICE", "cpu")
T = TypeVar("T")
_ids = itertools.count()


# --------------------------------------------------------------------------- waiting


# Hypothesis budgets per machine (profiles registered in conftest.py): CI (CI=true) runs the
# budgets the tests state; a contributor's `make test` runs `DEV_SHARE` of them. Set
# KVTIER_HYPOTHESIS_PROFILE=ci (or dev) to choose. The stateful machines whose "reached every
# path" checks add up their runs (test_manager_stateful, test_keyed, test_worker_processes)
# keep their stated budgets on both: fewer runs would miss paths, not find bugs faster.
HYPOTHESIS_PROFILE = os.environ.get(
    "KVTIER_HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev")
DEV_SHARE = 0.4


def examples(n: int) -> int:
    """`max_examples` for a test whose CI budget is `n`, under the profile in force."""
    return n if HYPOTHESIS_PROFILE == "ci" else max(10, round(n * DEV_SHARE))


def require_built(*needs: tuple[Path, str]) -> None:
    """For an engine-tier module's autouse fixture: each (path, make target) must exist. Missing
    under CI (CI=true) fails the module's tests in one line; elsewhere skips them. Checked when
    the tests run, never at import: `make test` collects every module (the tier check sees
    every test) without vLLM's environment built."""
    for path, make in needs:
        if not path.exists():
            if os.environ.get("CI"):
                pytest.fail(f"{path} is missing: `make test-engines` builds it ({make})",
                            pytrace=False)
            pytest.skip(f"{path} is not built ({make})")


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `pred` every `interval` seconds until it returns something truthy, and return
    that; AssertionError naming `what` after `timeout` seconds. Every wait in the tests is
    bounded this way, so a stuck process fails a test instead of hanging it."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.1f} s")
        time.sleep(interval)


# --------------------------------------------------------------------------- names


def new_deployment_id(tag: str = "t") -> str:
    """A deployment id no other test, and no other test run on this machine, uses:
    `<tag>-<pid>x<n><4 random hex>`, at most 32 letters, digits and '-' (never '_', so the
    `kvtier_<id>_` prefix of one id never matches another's names)."""
    suffix = f"{os.getpid()}x{next(_ids)}{uuid.uuid4().hex[:4]}"
    return f"{tag[:32 - len(suffix) - 1]}-{suffix}"


def new_segment_name(tag: str = "seg") -> str:
    """A fresh POSIX shared-memory name shaped like a host pool's (`/kvtier_<id>_host_r0`),
    for tests that build pools without a deployment."""
    return f"/kvtier_{new_deployment_id(tag)}_host_r0"


# --------------------------------------------------------------------------- leftovers


def pid_exists(pid: int) -> bool:
    """True while `pid` is a live process (a zombie counts as gone). Read from /proc, apart
    from kvtier's own `pid_alive`, so the tests do not check kvtier with kvtier."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def shm_entries(deployment_id: str) -> list[str]:
    """Entries of /dev/shm belonging to the deployment: segments (`kvtier_<id>_*`, host pools
    included) and semaphores (`sem.kvtier_<id>_*`)."""
    prefix = f"kvtier_{deployment_id}_"
    return sorted(n for n in os.listdir(SHM_DIR)
                  if n.startswith(prefix) or n.startswith("sem." + prefix))


def queues_left(deployment_id: str, num_ranks: int) -> list[str]:
    """The deployment's message queues that still exist (opened, since /dev/mqueue may not
    be mounted)."""
    left = []
    for name in ipc_names(deployment_id, num_ranks).queues:
        try:
            posix_ipc.MessageQueue(name).close()
        except posix_ipc.ExistentialError:
            continue
        left.append(name)
    return left


def leftovers(deployment_id: str, num_ranks: int, pids: Sequence[int] = ()) -> list[str]:
    """Everything of the deployment still there: /dev/shm entries (as `/dev/shm/<name>`),
    IPC names (every kind, any rank count), queues, and the pids in `pids` still running.
    After a deployment stopped this must be empty."""
    found = [f"/dev/shm/{n}" for n in shm_entries(deployment_id)]
    found += [n for n in existing_names(deployment_id) if f"/dev/shm{n}" not in found]
    found += [q for q in queues_left(deployment_id, num_ranks) if q not in found]
    found += [f"pid {p} alive" for p in pids if pid_exists(p)]
    return found


def wait_nothing_left(deployment_id: str, num_ranks: int, pids: Sequence[int],
                      timeout: float) -> None:
    """Wait (bounded) until none of the deployment's names and of `pids` remain."""
    left: list[str] = []

    def clean() -> bool:
        nonlocal left
        left = leftovers(deployment_id, num_ranks, pids)
        return not left

    try:
        wait_until(clean, timeout, f"deployment {deployment_id} gone")
    except AssertionError:
        raise AssertionError(
            f"deployment {deployment_id}: still there after {timeout:.0f} s: {left}") from None


def remove_leftovers(deployment_id: str) -> None:
    """Unlink every IPC name and /dev/shm segment of the deployment (after a failed test)."""
    cleanup_stale(deployment_id)
    for entry in SHM_DIR.iterdir():
        if entry.name.startswith(f"kvtier_{deployment_id}_"):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory("/" + entry.name)
        elif entry.name.startswith(f"kvtier-keep_{deployment_id}_"):  # node.handover's
            with contextlib.suppress(OSError):
                entry.unlink()


# --------------------------------------------------------------------------- configuration


def tiny_config(
    *,
    deployment_id: str | None = None,
    workers: int = 2,
    num_layers: int = 2,
    device_blocks: int = 16,
    host_blocks: int = 32,
    write_policy: str = "write_back",
    decode_reserve_blocks: int = 0,
    storage: str = "none",
    storage_dir: str | os.PathLike[str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> KvtierConfig:
    """A configuration small enough that pools cost nothing: 2 KV heads of 8 float16
    elements, 4-token blocks, device pools on KVTIER_TEST_DEVICE (cpu); no storage tier
    unless `storage` names a backend (`storage_dir` is the file backend's path). `extra`
    adds or overrides KVTIER_ variables. Loaded as the operator's environment would be
    (`load_config`)."""
    env = {
        "KVTIER_DEPLOYMENT_ID": deployment_id or new_deployment_id(),
        "KVTIER_MODEL__NUM_LAYERS": str(num_layers),
        "KVTIER_MODEL__NUM_KV_HEADS": "2",
        "KVTIER_MODEL__HEAD_DIM": "8",
        "KVTIER_MODEL__DTYPE": "float16",
        "KVTIER_CACHE__BLOCK_SIZE": "4",
        "KVTIER_CACHE__DEVICE_BLOCKS": str(device_blocks),
        "KVTIER_CACHE__HOST_BLOCKS": str(host_blocks),
        "KVTIER_CACHE__WRITE_POLICY": write_policy,
        "KVTIER_CACHE__DECODE_RESERVE_BLOCKS": str(decode_reserve_blocks),
        "KVTIER_STORAGE__BACKEND": storage,
        "KVTIER_WORKERS__COUNT": str(workers),
        "KVTIER_WORKERS__DEVICE": TEST_DEVICE,
    }
    if TEST_DEVICE == "cuda":  # every rank on the one GPU of a GPU test machine
        env["KVTIER_WORKERS__CUDA_DEVICES"] = ",".join(["0"] * workers)
    if storage_dir is not None:
        env["KVTIER_STORAGE__PATH"] = str(storage_dir)
    env.update(extra or {})
    return load_config(None, env)


# --------------------------------------------------------------------------- file systems


@contextlib.contextmanager
def tmpfs_mount(where: Path, *options: str, size: str = "64k") -> Iterator[Path]:
    """A small tmpfs mounted at `where` (created) for the duration, with mount `options`
    ("ro", ...): a read-only or a full file system for the storage checks. The tests run as
    root, as `make test` does; a failed mount fails the test."""
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join((f"size={size}", *options)),
                              "tmpfs", str(where)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs (the test needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def fill(directory: Path) -> None:
    """Write one file into `directory` until its file system is full."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while os.write(fd, b"x" * 4096):
            pass
    except OSError:  # ENOSPC
        pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- child processes


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any KVTIER_ variable (they would override a child's
    config file), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVTIER_")}
    env.update(extra)
    return env


def kvtier_script() -> Path:
    """The `kvtier` console script of the environment running the tests."""
    path = Path(sys.executable).parent / "kvtier"
    if not path.exists():
        raise RuntimeError(f"{path} not found: install the project (pip install -e .)")
    return path


def module_command() -> list[str]:
    """`kvtier` run as a module by the tests' interpreter (what the console script runs)."""
    return [sys.executable, "-m", "kvtier.admin.cli"]


def require_tool(name: str, package: str) -> str:
    """The path of an external program a test needs; fails (does not skip) naming the
    Debian package when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: install the Debian package {package}")
    return path


def promtool(*args: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `promtool ARGS` (package prometheus), `input` on its stdin."""
    return subprocess.run([require_tool("promtool", "prometheus"), *args], input=input,
                          capture_output=True, text=True, timeout=60)
