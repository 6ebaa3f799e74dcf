"""The embedding example runs and proves what it claims; `EmbeddedWorkers` moves real bytes
through real pools, shared memory and storage, and merges ranks like the worker processes;
`Stack(cfg, embedded=True)` puts a manager on them."""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.manager.config import ConfigError, KvtierConfig
from kvtier.manager.errors import KvtierError
from kvtier.manager.stack import Stack, worker_specs
from kvtier.worker.embedded import EmbeddedWorkers, embedded_host_segment_name
from kvtier.worker.process import WorkerSpec
from kvtier.worker.wire import Completion, Task, TaskKind
from support import new_deployment_id, tiny_config

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[1]
SHM = Path("/dev/shm")


def config(ranks: int = 2, storage_dir: Path | None = None, **cache: Any) -> KvtierConfig:
    """The tiny shape with 3 layers, 16 device and 16 host blocks per rank (`cache` overrides
    the sizes and the write policy), file storage under `storage_dir` when one is given
    (prefetch `wait_complete`, the one policy embedded workers honour)."""
    sizes: dict[str, Any] = {"device_blocks": 16, "host_blocks": 16, **cache}
    return tiny_config(deployment_id=new_deployment_id("embt"), workers=ranks, num_layers=3,
                       storage="none" if storage_dir is None else "file",
                       storage_dir=storage_dir,
                       extra={"KVTIER_STORAGE__PREFETCH_POLICY": "wait_complete"}, **sizes)


def embedded_workers(cfg: KvtierConfig) -> EmbeddedWorkers:
    """Every rank of `cfg`, in this process, from the specs the stack hands any worker."""
    return EmbeddedWorkers(worker_specs(cfg))


def segment(cfg: KvtierConfig, rank: int) -> Path:
    return SHM / embedded_host_segment_name(cfg.deployment_id, rank).lstrip("/")


# ---------------------------------------------------------------------------- the example


@pytest.mark.slow  # runs the example: a Python process that imports torch
def test_example_runs_and_serves_every_tier_exactly() -> None:
    proc = subprocess.Popen([sys.executable, "examples/tiny_attention.py"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0, out + err
    for label, tier in (("device hit", "device"), ("host hit", "host"),
                        ("storage hit", "storage")):
        line = re.search(rf"^{label}\s*: .*$", out, re.MULTILINE)
        assert line is not None, f"no {label!r} line in:\n{out}"
        served = re.search(rf"\b{tier} (\d+)", line.group(0))
        assert served is not None and int(served.group(1)) > 0, line.group(0)
    assert re.search(r"^ok: ", out, re.MULTILINE), out
    # The example names its deployment after its pid: nothing of it may be left.
    assert not list(SHM.glob(f"kvtier_tinyattn-{proc.pid}_*")), "a segment was left behind"


# ---------------------------------------------------------------------------- EmbeddedWorkers


def test_fill_then_check_round_trip_over_two_ranks() -> None:
    with embedded_workers(config(ranks=2)) as w:
        ids, keys = [0, 5, 9], [b"alpha", b"beta", b"gamma"]
        done = w.execute(Task(1, TaskKind.FILL, [], ids, keys))
        assert done.ok and done.seq == 1, done.error
        ok = w.execute(Task(2, TaskKind.CHECK, ids, [], keys))
        assert (ok.ok, ok.result, ok.detail) == (True, 0, [])
        # Content is per rank: rank 1's blocks are not rank 0's.
        assert not torch.equal(w.device_pool(0).data[:, :, 5], w.device_pool(1).data[:, :, 5])
        # One block corrupted on rank 1 only: the merged answer names it.
        w.device_pool(1).k_caches[2][9, 3, 1, 4] += 1
        bad = w.execute(Task(3, TaskKind.CHECK, ids, [], keys))
        assert bad.ok and (bad.result, bad.detail) == (1, [2])
        swapped = w.execute(Task(4, TaskKind.CHECK, ids, [], [keys[1], keys[0], keys[2]]))
        assert swapped.detail == [0, 1, 2]


def test_d2h_then_h2d_is_byte_exact_on_every_rank() -> None:
    with embedded_workers(config(ranks=2)) as w:
        g = torch.Generator().manual_seed(7)
        originals = []
        for r in range(2):
            raw = w.device_pool(r).data.view(torch.int16)  # every bit pattern, NaNs included
            raw.copy_(torch.randint(-2**15, 2**15, raw.shape, generator=g, dtype=torch.int16))
            originals.append(w.device_pool(r).data.clone())
        dev, host = [3, 4, 11, 0], [15, 2, 7, 8]
        assert w.execute(Task(1, TaskKind.D2H, dev, host)).ok
        for r in range(2):
            hp, dp = w.host_pool(r), w.device_pool(r)
            assert hp is not None
            for d, h in zip(dev, host, strict=True):
                assert torch.equal(hp.kv[h].view(torch.int16), dp.data[:, :, d].view(torch.int16))
            dp.data.zero_()
        back = [1, 2, 6, 12]
        assert w.execute(Task(2, TaskKind.H2D, host, back)).ok
        for r in range(2):
            data = w.device_pool(r).data
            for d, b in zip(dev, back, strict=True):
                assert torch.equal(data[:, :, b].view(torch.int16),
                                   originals[r][:, :, d].view(torch.int16))
            untouched = [i for i in range(16) if i not in back]
            assert not data[:, :, untouched].view(torch.int16).any()


def test_segments_exist_while_open_and_are_unlinked_after_close() -> None:
    cfg = config(ranks=2)
    w = embedded_workers(cfg)
    for r in range(2):
        st = segment(cfg, r).stat()
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 16 * w.shape.page_bytes
    w.close()
    w.close()  # idempotent
    assert not segment(cfg, 0).exists() and not segment(cfg, 1).exists()
    late = w.execute(Task(9, TaskKind.D2H, [0], [0]))
    assert not late.ok and "closed" in late.error
    with pytest.raises(RuntimeError, match="closed"):
        w.device_pool(0)

    cfg = config(ranks=1)
    with pytest.raises(KeyError), embedded_workers(cfg):
        assert segment(cfg, 0).exists()
        raise KeyError("an engine error inside the with block")
    assert not segment(cfg, 0).exists()


def test_a_stale_segment_of_the_same_deployment_is_replaced() -> None:
    cfg = config(ranks=1)
    stale = segment(cfg, 0)
    stale.write_bytes(b"left by a crashed run")
    try:
        with embedded_workers(cfg) as w:
            assert stale.stat().st_size == 16 * w.shape.page_bytes
    finally:
        stale.unlink(missing_ok=True)
    assert not stale.exists()


def test_failures_become_failed_completions_naming_the_rank() -> None:
    with embedded_workers(config(ranks=2)) as w:
        comp = w.execute(Task(5, TaskKind.H2D, [0], [99]))  # device id out of range
        assert isinstance(comp, Completion) and not comp.ok
        assert "rank 0:" in comp.error and "rank 1:" in comp.error and "99" in comp.error
        # No storage tier: a backup is an error, a query simply finds nothing.
        assert not w.execute(Task(6, TaskKind.BACKUP, [0], [], [b"k" * 32])).ok
        assert w.execute(Task(7, TaskKind.QUERY, [], [], [b"k" * 32])).result == 0


def test_storage_results_merge_like_the_worker_processes(tmp_path: Path) -> None:
    with embedded_workers(config(ranks=2, storage_dir=tmp_path)) as w:
        keys = [bytes([i]) * 32 for i in range(3)]
        assert w.execute(Task(1, TaskKind.FILL, [], [0, 1, 2], keys)).ok
        assert w.execute(Task(2, TaskKind.D2H, [0, 1, 2], [0, 1, 2])).ok
        backend0 = w.storage_backend(0)
        assert backend0 is not None
        h0 = w.host_pool(0)
        assert h0 is not None
        backend0.set(keys, [h0.page_view(i) for i in range(3)])  # rank 0 only
        assert w.execute(Task(3, TaskKind.QUERY, [], [], keys)).result == 0  # min over ranks
        backup = w.execute(Task(4, TaskKind.BACKUP, [0, 1, 2], [], keys))
        assert backup.ok and backup.result == 3
        assert w.execute(Task(5, TaskKind.QUERY, [], [], keys)).result == 3
        # Read back into other host blocks and then other device blocks: the content holds.
        assert w.execute(Task(6, TaskKind.PREFETCH, [], [10, 11, 12], keys)).result == 3
        assert w.execute(Task(7, TaskKind.H2D, [10, 11, 12], [7, 8, 9])).ok
        check = w.execute(Task(8, TaskKind.CHECK, [7, 8, 9], [], keys))
        assert check.ok and check.detail == []
        assert w.execute(Task(9, TaskKind.CLEAR)).result == 6  # summed over ranks


def test_manager_on_embedded_workers_serves_verified_host_hits() -> None:
    cfg = config(ranks=2, device_blocks=4, write_policy="write_back")
    with Stack(cfg, embedded=True) as stack:
        m = stack.require_manager()
        assert stack.storage is None and stack.require_workers().num_ranks == 2
        prompt = list(range(100, 113))  # 3 full blocks + 1 token
        m.match("a", prompt)
        blocks = m.allocate("a", len(prompt))
        keys = [f"block-{i}".encode() for i in range(3)]
        m.submit_diagnostic(TaskKind.FILL, blocks[:3], keys)
        m.commit("a", prompt, len(prompt))
        m.release("a")
        m.match("b", list(range(200, 213)))
        m.allocate("b", 13)  # 4 blocks: every cached block of "a" is demoted to the host
        m.release("b")
        hit = m.match("c", prompt)
        assert (hit.device_tokens, hit.host_tokens) == (0, 12)
        hit.handle.wait()
        outcome: list[Completion] = []
        m.submit_diagnostic(TaskKind.CHECK, hit.block_ids, keys,
                            lambda ok, comp: outcome.append(comp))
        assert outcome and outcome[0].ok and outcome[0].detail == []
        m.release("c")
        m.check_invariants()


def test_embedded_stack_wires_the_storage_tier_and_clears_it(tmp_path: Path) -> None:
    cfg = config(ranks=2, storage_dir=tmp_path, write_policy="write_through")
    with Stack(cfg, embedded=True) as stack:
        assert stack.alive()[0] and stack.ready()[0]
        m = stack.require_manager()
        assert stack.storage is not None and m.storage is stack.storage
        prompt = list(range(9))  # 2 full blocks + 1 token
        m.match("a", prompt)
        m.allocate("a", len(prompt))
        m.commit("a", prompt, len(prompt))  # device -> host -> storage, synchronously
        m.release("a")
        assert stack.storage.counters["backup_pages"] == 2
        cleared = stack.reset(storage=True)
        assert cleared["storage_pages"] == 4  # 2 pages on each of 2 ranks
        assert m.match("b", prompt).num_tokens == 0
        m.release("b")
        m.check_invariants()
    assert not segment(cfg, 0).exists() and not segment(cfg, 1).exists()
    with pytest.raises(KvtierError, match="not running"):
        stack.require_manager()
    with pytest.raises(KvtierError, match="not embedded"):
        Stack(cfg).require_workers()


@pytest.mark.parametrize("policy", ["best_effort", "timeout"])
def test_embedded_stack_refuses_a_prefetch_policy_it_cannot_honour(
        tmp_path: Path, policy: str) -> None:
    cfg = config(ranks=1, storage_dir=tmp_path)
    cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(
        update={"prefetch_policy": policy})})
    stack = Stack(cfg, embedded=True)
    with pytest.raises(ConfigError) as refused:
        stack.start()
    message = str(refused.value)
    assert "\n" not in message
    assert f"storage.prefetch_policy = {policy!r}" in message
    assert "embedded" in message and "'wait_complete'" in message
    assert stack.manager is None and not segment(cfg, 0).exists()
    # Without a storage tier there is no prefetch: any policy is fine.
    bare = config(ranks=1)
    bare = bare.model_copy(update={"storage": bare.storage.model_copy(
        update={"prefetch_policy": policy})})
    with Stack(bare, embedded=True) as ok:
        assert ok.storage is None


def test_specs_must_form_one_deployment() -> None:
    base = dict(deployment_id="embt-specs", num_layers=1, num_kv_heads=1, head_dim=4,
                dtype="float32", block_size=2, device_blocks=2, host_blocks=0, device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        EmbeddedWorkers([])
    with pytest.raises(ValueError, match="spec 1 has rank 0 of 2"):
        EmbeddedWorkers([WorkerSpec(rank=0, num_ranks=2, **base),  # type: ignore[arg-type]
                         WorkerSpec(rank=0, num_ranks=2, **base)])  # type: ignore[arg-type]
    other = {**base, "head_dim": 8}
    with pytest.raises(ValueError, match="rank 1 differs"):
        EmbeddedWorkers([WorkerSpec(rank=0, num_ranks=2, **base),  # type: ignore[arg-type]
                         WorkerSpec(rank=1, num_ranks=2, **other)])  # type: ignore[arg-type]
