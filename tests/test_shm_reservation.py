"""Shared memory is reserved when it is created (issue 11 item 6): the host pool, the control
segment and the id arena allocate every page at start (`posix_fallocate`), so a /dev/shm that
fills up later can never SIGBUS a worker or the manager, and a /dev/shm too small is a clear
start-up error naming the key.

Filling the real /dev/shm is not an option on a shared machine: the shortage is simulated
with an `os.posix_fallocate` that fails with ENOSPC, and the reservation itself is checked on
real segments through their allocated blocks (`st_blocks`), which a sparse segment lacks.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from kvtier.worker.ipc import IPCError, ManagerIPC, existing_names
from kvtier.worker.kv_pools import HostPool, KVShape, PoolConfigError
from support import new_deployment_id

pytestmark = pytest.mark.fast

SHAPE = KVShape(2, 2, 8, 4, "float16")  # 512-byte pages
SHM = Path("/dev/shm")


def allocated_bytes(name: str) -> int:
    """Bytes of memory backing segment `name` (/dev/shm is a tmpfs: blocks of 512 bytes)."""
    return os.stat(SHM / name.lstrip("/")).st_blocks * 512


def no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_host_pool_pages_are_allocated_at_creation(shm_name: str) -> None:
    with HostPool(SHAPE, 64, shm_name) as pool:
        assert allocated_bytes(shm_name) >= pool.nbytes == 64 * SHAPE.page_bytes


def test_host_pool_on_a_full_dev_shm_is_a_start_error_naming_the_key(
        shm_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(PoolConfigError, match=r"^cache\.host_blocks: 64 blocks need .* of "
                                              r"/dev/shm but reserving them failed"):
        HostPool(SHAPE, 64, shm_name)
    assert not (SHM / shm_name.lstrip("/")).exists(), "the failed segment was left behind"


def test_control_segment_and_arena_are_allocated_at_creation() -> None:
    dep = new_deployment_id("resv")
    with ManagerIPC(dep, 2, arena_bytes=1 << 20) as ipc:
        assert allocated_bytes(ipc.names.arena) >= 1 << 20
        assert allocated_bytes(ipc.names.control) >= os.stat(
            SHM / ipc.names.control.lstrip("/")).st_size
    assert existing_names(dep) == []


def test_ipc_on_a_full_dev_shm_fails_at_start_and_leaves_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dep = new_deployment_id("resv")
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(IPCError, match=r"cannot reserve \d+ bytes of /dev/shm for "
                                       rf"/kvtier_{dep}_ctl"):
        ManagerIPC(dep, 2)
    assert existing_names(dep) == []
