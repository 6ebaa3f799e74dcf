"""KV pools: shape arithmetic, validation, and the host pool's shared-memory lifecycle.

The host pool is exercised on real POSIX shared memory, including a second process that maps
the segment by name, reads what this process wrote and writes bytes this process then sees.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import posix_ipc
import pytest
import torch
from kvtier.worker.kv_pools import (
    BlockIdError,
    DevicePool,
    HostPool,
    KVShape,
    PoolConfigError,
    as_block_ids,
    parse_dtype,
)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name.lstrip("/")


# ---------------------------------------------------------------- KVShape


def test_shape_sizes_and_dtype_from_string() -> None:
    s = KVShape(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
    assert s.dtype is torch.bfloat16
    assert s.k_bytes == 16 * 8 * 128 * 2
    assert s.layer_bytes == 2 * s.k_bytes
    assert s.page_bytes == 32 * 2 * s.k_bytes
    assert KVShape(1, 1, 1, 1, torch.float32).k_bytes == 4
    assert parse_dtype("float32") is torch.float32


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "block_size"]
)
@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_shape_rejects_non_positive_sizes(field: str, bad: object) -> None:
    kwargs: dict[str, object] = dict(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16"
    )
    kwargs[field] = bad
    with pytest.raises(PoolConfigError, match=field):
        KVShape(**kwargs)  # type: ignore[arg-type]


def test_shape_rejects_unknown_dtype() -> None:
    with pytest.raises(PoolConfigError, match="dtype: 'float13'"):
        KVShape(2, 2, 8, 4, "float13")  # type: ignore[arg-type]
    with pytest.raises(PoolConfigError, match="dtype"):
        KVShape(2, 2, 8, 4, torch.complex64)


# ---------------------------------------------------------------- DevicePool


def test_device_pool_layout_is_per_layer_k_and_v() -> None:
    pool = DevicePool(SHAPE, 5, "cpu")
    assert pool.device == torch.device("cpu")
    assert len(pool.k_caches) == len(pool.v_caches) == SHAPE.num_layers
    for layer in range(SHAPE.num_layers):
        k, v = pool.k_caches[layer], pool.v_caches[layer]
        assert k.shape == v.shape == (5, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim)
        assert k.is_contiguous() and v.is_contiguous() and k.dtype is torch.float16
        k[2].fill_(float(layer + 1))
        assert bool((pool.data[layer, 0, 2] == layer + 1).all())  # a view, not a copy
        assert bool((pool.data[layer, 1] == 0).all())
    assert pool.nbytes == 5 * SHAPE.page_bytes


def test_device_pool_validation() -> None:
    with pytest.raises(PoolConfigError, match="device_blocks"):
        DevicePool(SHAPE, 0, "cpu")
    with pytest.raises(PoolConfigError, match="device: 'tpu'"):
        DevicePool(SHAPE, 1, "tpu")
    with pytest.raises(PoolConfigError, match=r"device_blocks: .* available"):
        DevicePool(SHAPE, 1 << 50, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available on this machine")
def test_device_pool_without_cuda() -> None:
    """No GPU: asking for CUDA is an error, never a silent CPU pool; `auto` means the CPU."""
    with pytest.raises(PoolConfigError, match="CUDA is not available"):
        DevicePool(SHAPE, 1, "cuda")
    assert DevicePool(SHAPE, 1, "auto").device.type == "cpu"


@pytest.mark.cuda
def test_device_pool_on_a_cuda_gpu() -> None:
    """`cuda` and `auto` give a pool on the current GPU, with an explicit index, in the same
    per-layer K/V layout as on the CPU; a pool larger than the GPU's free memory is refused."""
    current = torch.cuda.current_device()
    for device in ("cuda", "auto", f"cuda:{current}"):
        pool = DevicePool(SHAPE, 5, device)
        assert pool.device == torch.device("cuda", current), device
        assert pool.data.is_cuda and pool.nbytes == 5 * SHAPE.page_bytes
        assert all(k.is_cuda and k.is_contiguous() for k in pool.k_caches)
        pool.k_caches[1][2].fill_(3.0)
        assert bool((pool.data[1, 0, 2] == 3).all()) and not pool.data[1, 1].any()
    with pytest.raises(PoolConfigError, match=r"device_blocks: .* the GPU has"):
        DevicePool(SHAPE, 1 << 50, "cuda")
    with pytest.raises(PoolConfigError, match="CUDA device"):
        DevicePool(SHAPE, 1, f"cuda:{torch.cuda.device_count()}")


def test_block_id_validation() -> None:
    assert as_block_ids([3, 0, 2], 4, "x", unique=True).tolist() == [3, 0, 2]
    assert as_block_ids(torch.tensor([1, 1], dtype=torch.int32), 4, "x", unique=False).tolist() == [
        1,
        1,
    ]
    with pytest.raises(BlockIdError, match="x: block id 4 out of range"):
        as_block_ids([0, 4], 4, "x", unique=False)
    with pytest.raises(BlockIdError, match="block id -1 out of range"):
        as_block_ids([-1], 4, "x", unique=False)
    with pytest.raises(BlockIdError, match="block id 2 appears more than once"):
        as_block_ids([2, 1, 2], 4, "x", unique=True)
    with pytest.raises(BlockIdError, match="integers"):
        as_block_ids([1.0], 4, "x", unique=False)  # type: ignore[list-item]
    with pytest.raises(BlockIdError, match="integers"):
        as_block_ids(torch.tensor([1.0]), 4, "x", unique=False)
    with pytest.raises(BlockIdError, match="one-dimensional"):
        as_block_ids(torch.zeros(2, 2, dtype=torch.int64), 4, "x", unique=False)


# ---------------------------------------------------------------- HostPool


def test_host_pool_segment_mode_layout_and_close(shm_name: str) -> None:
    pool = HostPool(SHAPE, 6, shm_name)
    path = shm_path(shm_name)
    assert path.exists()
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.stat().st_size == 6 * SHAPE.page_bytes
    assert pool.data.shape == (6, SHAPE.page_bytes)
    assert pool.kv.shape == (6, SHAPE.num_layers, 2, *SHAPE.block_shape)
    assert pool.kv.dtype is torch.float16
    # page_first: block 4's K and V of every layer are one contiguous page
    pool.kv[4].fill_(1.5)
    page = pool.page_tensor(4)
    assert bool((page.view(torch.float16) == 1.5).all())
    assert bool((pool.data[3] == 0).all()) and bool((pool.data[5] == 0).all())
    mv = pool.page_view(4)
    assert len(mv) == SHAPE.page_bytes and not mv.readonly
    mv[0:2] = b"\x00\x3c"  # float16 1.0
    assert float(pool.kv[4, 0, 0, 0, 0, 0]) == 1.0
    mv.release()
    with pytest.raises(BlockIdError, match="out of range"):
        pool.page_view(6)
    del page
    pool.close()
    assert not path.exists()
    assert pool.closed
    pool.close()  # idempotent
    maps = Path("/proc/self/maps").read_text()
    assert shm_name.lstrip("/") not in maps, "mapping still present after close"
    with pytest.raises(RuntimeError, match="closed"):
        pool.page_view(0)


def test_host_pool_view_outliving_close_stays_valid(shm_name: str) -> None:
    """close() unlinks at once; a view still held elsewhere keeps the mapping alive (never a
    dangling pointer) and the mapping goes with the last view."""
    pool = HostPool(SHAPE, 2, shm_name)
    page = pool.page_tensor(1)
    page.fill_(7)
    pool.close()
    assert not shm_path(shm_name).exists()
    assert shm_name.lstrip("/") in Path("/proc/self/maps").read_text()
    assert int(page.sum()) == 7 * SHAPE.page_bytes  # still readable
    del page
    assert shm_name.lstrip("/") not in Path("/proc/self/maps").read_text()


def test_host_pool_context_manager_unlinks_on_exception(shm_name: str) -> None:
    with pytest.raises(ZeroDivisionError), HostPool(SHAPE, 2, shm_name):
        assert shm_path(shm_name).exists()
        raise ZeroDivisionError
    assert not shm_path(shm_name).exists()


def test_host_pool_dropped_without_close_is_unlinked(shm_name: str) -> None:
    pool = HostPool(SHAPE, 2, shm_name)
    assert shm_path(shm_name).exists()
    del pool
    gc.collect()
    assert not shm_path(shm_name).exists()
    assert shm_name.lstrip("/") not in Path("/proc/self/maps").read_text()


def test_host_pool_replaces_stale_segment(shm_name: str) -> None:
    stale = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=0o644, size=4096)
    os.write(stale.fd, b"stale bytes")
    stale.close_fd()
    with HostPool(SHAPE, 3, shm_name) as pool:
        st = shm_path(shm_name).stat()
        assert st.st_size == 3 * SHAPE.page_bytes
        assert st.st_mode & 0o777 == 0o600
        assert int(pool.data.count_nonzero()) == 0  # a fresh segment, not the stale bytes


@pytest.mark.slow  # a second Python process that imports torch
def test_host_pool_visible_from_second_process(shm_name: str) -> None:
    with HostPool(SHAPE, 4, shm_name) as pool:
        pool.data[1].copy_(torch.arange(SHAPE.page_bytes, dtype=torch.int64).remainder(251))
        code = textwrap.dedent(
            f"""
            import torch
            from kvtier.worker.kv_pools import HostPool, KVShape
            shape = KVShape(**{dict(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)!r},
                            dtype="float16")
            pool = HostPool.attach({shm_name!r}, shape)
            assert pool.num_blocks == 4 and not pool.owner
            want = torch.arange(shape.page_bytes, dtype=torch.int64).remainder(251)
            assert torch.equal(pool.data[1].to(torch.int64), want), "page 1 differs"
            pool.page_view(2)[:5] = b"hello"
            pool.close()
            print("ok")
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "ok"
        assert bytes(pool.page_view(2)[:5]) == b"hello"
        assert shm_path(shm_name).exists(), "the attached process must not unlink the segment"
    assert not shm_path(shm_name).exists()


def test_host_pool_attach_errors(shm_name: str) -> None:
    with pytest.raises(PoolConfigError, match="does not exist"):
        HostPool.attach(shm_name, SHAPE)
    with HostPool(SHAPE, 2, shm_name):
        other = KVShape(5, 2, 8, 4, "float16")  # 2 pages of SHAPE are not whole pages of it
        with pytest.raises(PoolConfigError, match="whole number"):
            HostPool.attach(shm_name, other)


def test_host_pool_validation(shm_name: str) -> None:
    with pytest.raises(PoolConfigError, match="host_blocks"):
        HostPool(SHAPE, 0, shm_name)
    with pytest.raises(PoolConfigError, match=r"host_blocks: .*/dev/shm"):
        HostPool(SHAPE, 1 << 40, shm_name)
    for bad in ("kvtier_no_slash", "/a/b", "/"):
        with pytest.raises(PoolConfigError, match="host pool name"):
            HostPool(SHAPE, 1, bad)
    assert not shm_path(shm_name).exists()
