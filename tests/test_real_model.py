"""examples/real_model.py: a Hugging Face Llama whose prefix KV kvtier serves from the device,
the host, file storage and Redis gets bitwise the logits of computing that prefix fresh, with
kvtier's worker processes doing the copies; a prefix read from the wrong blocks is caught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import SHM_DIR, clean_env, pid_exists, require_tool

# runs the example: a process importing torch and transformers
pytestmark = [pytest.mark.engines, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("device", "host", "storage_file", "storage_redis")


def run_example(*args: str, redis: bool = True
                ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the example with this venv's interpreter; its result and its last line as JSON.
    The example names its deployments `realmodel-<pid>-*`: nothing of them may be left."""
    if redis:
        require_tool("redis-server", "redis-server")  # the storage_redis tier needs it
    proc = subprocess.Popen([sys.executable, "examples/real_model.py", "--json", *args],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=110)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    lines = out.strip().splitlines()
    assert lines, f"no output (exit {proc.returncode}):\n{err}"
    result = json.loads(lines[-1])
    left = sorted(p.name for p in SHM_DIR.iterdir() if f"realmodel-{proc.pid}-" in p.name)
    assert not left, f"left behind in {SHM_DIR}: {left}"
    alive = [p for p in result.get("worker_pids", []) if pid_exists(p)]
    assert not alive, f"worker processes still running: {alive}"
    return done, result


def test_every_tier_serves_the_prefix_bitwise_through_worker_processes() -> None:
    done, result = run_example()
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["dtypes"] == ["float32", "bfloat16"]
    diffs = result["max_abs_logit_diff"]
    assert set(diffs) == set(TIERS), diffs
    for tier in TIERS:
        assert diffs[tier] == 0.0, (tier, result)
        for dtype in result["dtypes"]:
            assert result["max_abs_logit_diff_by_dtype"][tier][dtype] == 0.0, (tier, dtype)
            assert result["served_tokens"][tier][dtype] > 0, (tier, dtype)
    assert result["worker_processes"] >= 1, result
    # The workers did every kind of copy: the device<->host loads the runner waited for layer
    # by layer, the backups to storage and the prefetches back.
    copies = result["worker_copy_tasks"]
    assert all(copies.get(k, 0) > 0 for k in ("d2h", "h2d", "backup", "prefetch")), copies
    assert result["layer_waits"] > 0, result


def test_a_prefix_read_from_the_wrong_blocks_is_caught() -> None:
    """foreign-block reads the served prefix's last block from a block holding other KV: the
    logits differ by far more than rounding on every tier, and the example exits 1. (Its other
    control, wrong-block-table, swaps two blocks of the prefix: attention cannot tell, since
    the cached keys carry their RoPE positions and every suffix query sees the whole prefix,
    so only float32 rounding differs; too thin a margin for a test.) float32 only, to keep the
    test short."""
    control = "foreign-block"
    done, result = run_example("--negative-control", control, "--dtypes", "float32")
    assert done.returncode == 1, done.stdout + done.stderr
    assert result["negative_control"] == control
    diffs = result["max_abs_logit_diff"]
    assert set(diffs) == set(TIERS), diffs
    assert min(diffs.values()) > 1e-3, result


def test_float8_kv_with_per_block_scales_comes_back_bitwise_from_every_tier() -> None:
    """A float32 model over a float8 paged KV whose per-block, per-head float32 scales live in
    the runner's own scale tensors, registered with the KV (`model.kv_scales =
    "per_block_head"`): served from every tier and dequantized on read, the logits equal
    those of the fresh prefix quantized the same way, bit for bit, so every fp8 byte and every
    scale came back exactly. Reading the last block's scales from another block (the
    foreign-scales control) changes the logits on every tier."""
    done, result = run_example("--dtypes", "float8_e4m3fn")
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["dtypes"] == ["float8_e4m3fn"]
    assert set(result["max_abs_logit_diff"]) == set(TIERS), result
    assert all(d == 0.0 for d in result["max_abs_logit_diff"].values()), result
    copies = result["worker_copy_tasks"]
    assert all(copies.get(k, 0) > 0 for k in ("d2h", "h2d", "backup", "prefetch")), copies
    done, result = run_example("--dtypes", "float8_e4m3fn", "--negative-control",
                               "foreign-scales")
    assert done.returncode == 1, done.stdout + done.stderr
    assert set(result["max_abs_logit_diff"]) == set(TIERS), result
    assert min(result["max_abs_logit_diff"].values()) > 1e-3, result


@pytest.mark.cuda
def test_on_a_gpu_the_worker_process_opens_the_kv_through_cuda_ipc() -> None:
    """The model and its paged KV on cuda:0 in the example's process, kvtier's worker process
    opening that memory through CUDA IPC handles: every tier bitwise, both dtypes; and the
    foreign-block control fails there too. (Redis only where redis-server is installed.)"""
    import shutil

    redis = shutil.which("redis-server") is not None
    done, result = run_example("--device", "cuda", redis=redis)
    assert done.returncode == 0, done.stdout + done.stderr
    assert result["device"] == "cuda"
    tiers = set(TIERS) if redis else set(TIERS) - {"storage_redis"}
    assert set(result["max_abs_logit_diff"]) == tiers, result
    assert all(d == 0.0 for d in result["max_abs_logit_diff"].values()), result
    assert result["worker_processes"] >= 1, result
    done, result = run_example("--device", "cuda", "--negative-control", "foreign-block",
                               "--dtypes", "float32", redis=redis)
    assert done.returncode == 1 and min(result["max_abs_logit_diff"].values()) > 1e-3, result
    # float8 KV with scale tensors on the GPU, opened through CUDA IPC too
    done, result = run_example("--device", "cuda", "--dtypes", "float8_e4m3fn", redis=redis)
    assert done.returncode == 0, done.stdout + done.stderr
    assert set(result["max_abs_logit_diff"]) == tiers, result
    assert all(d == 0.0 for d in result["max_abs_logit_diff"].values()), result
