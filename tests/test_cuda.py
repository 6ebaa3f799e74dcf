"""Which CUDA device each rank uses, and the CUDA-only mechanisms of the worker side.

The mapping tests run everywhere: they fake the visible GPUs (`torch.cuda.device_count`,
`mem_get_info`) and check what the configuration resolves, what it refuses (one line naming the
key) and what a worker is told to build. The tests marked `cuda` need a GPU (scripts/gpu-check.sh
runs them): the pinned host pool aliased on the device, and real worker processes placed on the
configured GPU -- two ranks on one GPU, and a rank whose GPU is not visible.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvtier.manager.config import ConfigError, load_config, rank_device
from kvtier.manager.config import checks as config_checks
from kvtier.manager.stack import worker_specs
from kvtier.worker import kv_pools
from kvtier.worker.kv_pools import HostPool, KVShape, PoolConfigError
from stack_support import check, fill, running_stack
from support import clean_env, new_segment_name, tiny_config

pytestmark = pytest.mark.fast

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int, free: int = 80 << 30) -> None:
    """Pretend this machine has `count` CUDA devices with `free` bytes each."""
    monkeypatch.setattr(config_checks, "resolve_device", lambda cfg: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (free, free))


def env(count: int, **extra: str) -> dict[str, str]:
    e = {"KVTIER_WORKERS__COUNT": str(count), "KVTIER_WORKERS__DEVICE": "cuda",
         "KVTIER_CACHE__DEVICE_BLOCKS": "64", "KVTIER_CACHE__HOST_BLOCKS": "64",
         "KVTIER_STORAGE__BACKEND": "none", "KVTIER_MODEL__NUM_LAYERS": "2"}
    e.update(extra)
    return e


# --------------------------------------------------------------------------- the mapping


def test_rank_r_uses_cuda_r_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    cfg = load_config(None, env(4))
    assert [rank_device(cfg, r) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [s.device for s in worker_specs(cfg)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


def test_cuda_devices_places_ranks_explicitly(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_gpus(monkeypatch, 4)
    cfg = load_config(None, env(3, KVTIER_WORKERS__CUDA_DEVICES="3, 1,3"))
    assert cfg.workers.cuda_devices == "3,1,3"
    assert [s.device for s in worker_specs(cfg)] == ["cuda:3", "cuda:1", "cuda:3"]


def test_two_ranks_on_one_gpu_need_both_pools_there(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = load_config(None, env(1), check_resources=False)
    per_rank = 64 * pool.model.num_layers * 2 * pool.cache.block_size * (
        pool.model.num_kv_heads * pool.model.head_dim * 2)
    fake_gpus(monkeypatch, 1, free=per_rank + per_rank // 2)  # room for one pool, not two
    cfg = load_config(None, env(1))
    assert rank_device(cfg, 0) == "cuda:0"
    with pytest.raises(ConfigError) as e:
        load_config(None, env(2, KVTIER_WORKERS__CUDA_DEVICES="0,0"))
    assert str(e.value).startswith("cache.device_blocks = 64: the device pools of ranks [0, 1]")
    assert "cuda:0" in str(e.value)


@pytest.mark.parametrize(("count", "devices", "message"), [
    (2, "", "workers.count = 2: rank 1 would use cuda:1 but 1 CUDA device(s) are visible"),
    (2, "0,4", "workers.cuda_devices = '0,4': rank 1 would use cuda:4 but 1 CUDA device(s)"),
    (2, "0", "workers.cuda_devices = '0': names 1 device(s) but workers.count = 2"),
    (1, "0,x", "workers.cuda_devices = '0,x': expected CUDA device indices separated by commas"),
    (1, "-1", "workers.cuda_devices = '-1': expected CUDA device indices"),
])
def test_a_rank_without_its_gpu_is_one_line(monkeypatch: pytest.MonkeyPatch, count: int,
                                             devices: str, message: str) -> None:
    fake_gpus(monkeypatch, 1)
    extra = {"KVTIER_WORKERS__CUDA_DEVICES": devices} if devices else {}
    with pytest.raises(ConfigError) as e:
        load_config(None, env(count, **extra))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_pool_device_strings(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker does with the device string it is handed."""
    assert kv_pools.resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(PoolConfigError, match="'cuda:x' is not one of"):
        kv_pools.resolve_device("cuda:x")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert kv_pools.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert kv_pools.resolve_device("cuda") == torch.device("cuda", 1)
    assert kv_pools.resolve_device("auto") == torch.device("cuda", 1)
    with pytest.raises(PoolConfigError, match=r"'cuda:2' but only 2 CUDA device\(s\) are visible"):
        kv_pools.resolve_device("cuda:2")


def test_host_pool_has_no_device_view_off_cuda() -> None:
    with HostPool(SHAPE, 4, new_segment_name("cu")) as pool:
        assert pool.device_view(torch.device("cpu")) is None


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_pinned_host_pool_is_one_memory_with_its_device_view() -> None:
    """Bytes written by a kernel through the device view are in the segment, and bytes
    written into the segment are what a kernel reads: one memory, no copy."""
    with HostPool(SHAPE, 4, new_segment_name("cu")) as pool:
        assert pool.pinned
        view = pool.device_view(torch.device("cuda", 0))
        assert view is not None and view.is_cuda and view.numel() == pool.nbytes
        view[: SHAPE.page_bytes].fill_(0x5A)
        torch.cuda.synchronize()
        assert bool((pool.data[0] == 0x5A).all()) and not bool((pool.data[1] == 0x5A).any())
        pool.data[3].fill_(0x33)
        assert bool((view[3 * SHAPE.page_bytes :].cpu() == 0x33).all())
        del view


@pytest.mark.cuda
def test_two_ranks_share_one_gpu_and_round_trip_through_host(tmp_path: Path) -> None:
    """Two worker processes with their device pools on cuda:0 (workers.cuda_devices = "0,0"):
    every block written on the GPU, evicted to the host and loaded back into other device
    blocks checks out byte for byte on both ranks; each worker says it built cuda:0."""
    cfg = tiny_config(workers=2, device_blocks=8, host_blocks=32,
                      extra={"KVTIER_WORKERS__DEVICE": "cuda",
                             "KVTIER_WORKERS__CUDA_DEVICES": "0,0"})
    with running_stack(cfg, log_dir=tmp_path) as stack:
        m = stack.require_manager()
        bs = cfg.cache.block_size
        prompts = [[1000 * i + t for t in range(4 * bs + 1)] for i in range(1, 5)]
        written: dict[int, list[int]] = {}
        for i, toks in enumerate(prompts):  # 4 x 4 blocks through 8 device blocks
            rid = f"w{i}"
            m.match(rid, toks)
            m.allocate(rid, len(toks))
            blocks = m.request_blocks(rid)[:4]
            keys = m.request_keys(rid)[:4]
            fill(m, blocks, keys)
            m.commit(rid, toks, len(toks))
            m.release(rid)
            written[i] = keys
        hit = m.match("again", prompts[0])
        assert hit.host_tokens == 4 * bs, hit  # evicted to the host, loaded back
        hit.handle.wait_layer(cfg.model.num_layers - 1)
        check(m, hit.block_ids[:4], written[0])
        m.release("again")
        for rank in range(2):
            log = (tmp_path / f"worker-r{rank}.log").read_text()
            assert "device cuda:0" in log, log[-2000:]


@pytest.mark.cuda
def test_a_rank_whose_gpu_is_hidden_is_refused_at_start() -> None:
    """CUDA_VISIBLE_DEVICES=0 leaves one GPU: rank 1's default cuda:1 is refused with the
    one-line error `kvtier replay` exits 2 with, naming the key."""
    script = ("from kvtier.manager.config import ConfigError, load_config\n"
              "try:\n"
              "    load_config(None, {'KVTIER_WORKERS__COUNT': '2',"
              " 'KVTIER_WORKERS__DEVICE': 'cuda',"
              " 'KVTIER_CACHE__DEVICE_BLOCKS': '16', 'KVTIER_CACHE__HOST_BLOCKS': '16',"
              " 'KVTIER_STORAGE__BACKEND': 'none'})\n"
              "except ConfigError as e:\n"
              "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=clean_env(CUDA_VISIBLE_DEVICES="0"), check=True)
    assert "workers.count = 2: rank 1 would use cuda:1 but 1 CUDA device(s) are visible" in (
        out.stdout), out.stdout + out.stderr
