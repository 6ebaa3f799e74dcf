"""Issue 12's engine rows "quantized KV with per-block scales" and "extra layers".

`model.kv_scales = "per_block_head"` gives every block float32 scales per layer, K and V and KV
head; `model.num_extra_layers` adds KV layers (MTP draft layers) after the model's. Both must
travel with their block through every tier: the device tier (kvtier's own pool or an engine's
registered tensors), the host page (scales as its trailer), storage pages (and their MAC), and
the storage namespace keeps deployments with another page apart.

Fast tests move bytes in this process and compare them raw (not through the content checker,
so a copy that skipped the scales or the extra layers cannot hide behind a checker that skips
them too). The slow tests wait for a load layer by layer up to the last extra layer through
worker processes, and run `kvtier replay --verify` through worker processes and file
storage on an fp8 + scales + extra-layer configuration, then a deployment with another number
of extra layers on the same storage folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier.manager.config import ConfigError, load_config, page_bytes
from kvtier.manager.stack import worker_spec
from kvtier.worker import content, kvreg
from kvtier.worker.copy_engine import CopyEngine
from kvtier.worker.engine_kv import KVRegistration, LayerWaiter, shared_kv_tensor
from kvtier.worker.engine_pool import EnginePool, check_record
from kvtier.worker.fused_copy import fused_unavailable
from kvtier.worker.kv_pools import DevicePool, HostPool, KVShape, PlanePool
from kvtier.worker.kvreg import EngineKVError
from kvtier.worker.spec import WorkerSpec
from kvtier.worker.storage.backend import namespace_for
from stack_support import running_stack
from storage_support import ModelRunner, prompt
from support import (
    clean_env,
    leftovers,
    module_command,
    new_deployment_id,
    remove_leftovers,
    shm_entries,
    tiny_config,
)

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
L, E, H, D, BS = 3, 2, 2, 8, 4  # model layers, extra layers, KV heads, head dim, block size
N, HOST = 16, 12
FP8 = "float8_e4m3fn"
SCALED = {"KVTIER_MODEL__DTYPE": FP8, "KVTIER_MODEL__KV_SCALES": "per_block_head"}


def shape(extra: int = E, scales: bool = True) -> KVShape:
    return KVShape(L, H, D, BS, FP8, extra, scales)


def randomize(t: torch.Tensor, seed: int) -> None:
    """Random bytes (any bit pattern: NaN scales included) into `t`."""
    raw = t.view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def block_bytes(kv: list[torch.Tensor], scales: list[torch.Tensor], block: int) -> bytes:
    """Every byte of one block: each KV plane's row, then each scale plane's row."""
    return b"".join(bytes(p[block].contiguous().view(torch.uint8).numpy()) for p in kv + scales)


@pytest.fixture
def host(shm_name: str) -> Iterator[HostPool]:
    pool = HostPool(shape(), HOST, shm_name)
    yield pool
    pool.close()


# ---------------------------------------------------------------------- geometry and config


@pytest.mark.parametrize(("extra", "scales"), [(0, False), (0, True), (2, False), (2, True)])
def test_page_holds_extra_layers_and_scales_and_the_manager_sizes_it_alike(
        extra: int, scales: bool) -> None:
    env = {"KVTIER_MODEL__NUM_LAYERS": str(L), "KVTIER_MODEL__NUM_EXTRA_LAYERS": str(extra),
           "KVTIER_MODEL__DTYPE": FP8,
           "KVTIER_MODEL__KV_SCALES": "per_block_head" if scales else "none"}
    cfg = tiny_config(extra=env)
    s = worker_spec(cfg, 0).shape
    assert (s.num_layers, s.num_extra_layers, s.kv_scales) == (L, extra, scales)
    kv = (L + extra) * 2 * BS * H * D  # one byte per fp8 element
    trailer = (L + extra) * 2 * H * 4 if scales else 0
    assert s.kv_bytes == kv
    assert kv + trailer <= s.page_bytes < kv + trailer + 32  # + alignment padding only
    assert page_bytes(cfg) == s.page_bytes  # the manager's sizing is the workers' layout


def test_config_keys_are_validated_with_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^model.kv_scales = 'per_block_head': scales need "
                       r"a quantized KV dtype, but model.dtype = 'float16'"):
        load_config(None, {"KVTIER_MODEL__KV_SCALES": "per_block_head"})
    with pytest.raises(ConfigError, match=r"^model.kv_scales = 'per_head': expected one of"):
        load_config(None, {"KVTIER_MODEL__KV_SCALES": "per_head", "KVTIER_MODEL__DTYPE": FP8})
    with pytest.raises(ConfigError, match=r"^model.num_extra_layers = -1: must be >= 0"):
        load_config(None, {"KVTIER_MODEL__NUM_EXTRA_LAYERS": "-1"})
    cfg = load_config(None, {**SCALED, "KVTIER_MODEL__NUM_EXTRA_LAYERS": "1"})
    assert (cfg.model.kv_scales, cfg.model.num_extra_layers) == ("per_block_head", 1)


def test_storage_namespace_tells_extra_layers_and_scales_apart() -> None:
    def ns(**kw: Any) -> str:
        fields: dict[str, Any] = dict(deployment_id="ns", rank=0, num_ranks=1, num_layers=L,
                                      num_kv_heads=H, head_dim=D, dtype=FP8, block_size=BS,
                                      device_blocks=N, host_blocks=HOST)
        return WorkerSpec(**(fields | kw)).storage_namespace()

    spaces = [ns(), ns(num_extra_layers=1), ns(num_extra_layers=2),
              ns(kv_scales="per_block_head"), ns(num_extra_layers=1, kv_scales="per_block_head")]
    assert len(set(spaces)) == len(spaces), spaces
    # A deployment with neither keeps the namespace (and the pages) it had before them.
    assert ns() == namespace_for({"num_layers": L, "num_kv_heads": H, "head_dim": D,
                                  "dtype": FP8, "block_size": BS}, 0, 1)


# ---------------------------------------------------------------------- copies, every path


@pytest.mark.parametrize("path", ["auto", "runs", "gather", "planes"])
def test_copies_carry_every_extra_layer_and_scale_byte(host: HostPool, path: str) -> None:
    """D2H then H2D onto other device blocks: every byte of the model's layers, the extra
    layers and the scales arrives, on kvtier's own pool (three copy strategies) and on an
    engine's planes; layer callbacks cover the extra layers, after the model's."""
    dev = DevicePool(shape(), N, "cpu")
    randomize(dev.data, 1)
    assert dev.scales is not None
    randomize(dev.scales, 2)
    pool: DevicePool | PlanePool = dev
    if path == "planes":  # the same memory, seen only as planes (an engine's registration)
        pool = PlanePool(dev.shape, dev.planes, scale_planes=dev.scale_planes)
        engine = CopyEngine(pool, host)
    else:
        engine = CopyEngine(pool, host, strategy=path)  # type: ignore[arg-type]
    src, mid, dst = [0, 1, 2, 3, 7, 9], [5, 6, 7, 8, 0, 11], [10, 11, 12, 13, 14, 4]
    before = [block_bytes(dev.planes, dev.scale_planes, b) for b in src]
    engine.d2h(src, mid)
    assert host.scales is not None
    for s, m in zip(src, mid, strict=True):  # the host page holds them, scales as its trailer
        assert torch.equal(host.kv[m].view(torch.uint8), dev.data[:, :, s].view(torch.uint8))
        assert torch.equal(host.scales[m].view(torch.int32),
                           dev.scales[:, s].view(torch.int32))
    layers: list[int] = []
    engine.h2d(mid, dst, layers.append)
    assert layers == list(range(L + E))
    after = [block_bytes(dev.planes, dev.scale_planes, b) for b in dst]
    assert after == before


@pytest.mark.cuda
@pytest.mark.parametrize("path", ["fused", "zero_copy", "staged", "planes_fused",
                                  "planes_zero_copy"])
def test_gpu_copies_carry_every_extra_layer_and_scale_byte(host: HostPool, path: str) -> None:
    """The same on a CUDA device pool: the fused path (Triton kernels through the pinned
    host pool mapped on the GPU), the zero-copy one (eager kernels through it), the staged
    one, and an engine's planes through the first two."""
    if "fused" in path and (why := fused_unavailable(torch.device("cuda"))):
        pytest.skip(f"fused copy path: {why}")
    dev = DevicePool(shape(), N, "cuda")
    assert dev.scales is not None
    for t, seed in ((dev.data, 1), (dev.scales, 2)):
        cpu = torch.empty(t.shape, dtype=t.dtype)
        randomize(cpu, seed)
        t.copy_(cpu)
    pool: DevicePool | PlanePool = dev
    if path.startswith("planes_"):
        pool = PlanePool(dev.shape, dev.planes, scale_planes=dev.scale_planes)
        engine = CopyEngine(pool, host, cuda_path=path.removeprefix("planes_"))  # type: ignore[arg-type]
        assert engine.cuda_path == path.removeprefix("planes_")
        assert engine._planes is not None
        assert (engine._planes._fused("h2d") is not None) == (path == "planes_fused")
    else:
        engine = CopyEngine(pool, host, cuda_path=path)  # type: ignore[arg-type]
        assert engine.cuda_path == path
    src, mid, dst = [0, 1, 2, 3, 7, 9], [5, 6, 7, 8, 0, 11], [10, 11, 12, 13, 14, 4]
    planes = [p.cpu() for p in dev.planes]
    scales = [p.cpu() for p in dev.scale_planes]
    before = [block_bytes(planes, scales, b) for b in src]
    engine.d2h(src, mid)
    layers: list[int] = []
    engine.h2d(mid, dst, layers.append)
    torch.cuda.synchronize()
    assert layers == list(range(L + E))
    planes = [p.cpu() for p in dev.planes]
    scales = [p.cpu() for p in dev.scale_planes]
    assert [block_bytes(planes, scales, b) for b in dst] == before


def test_content_check_covers_scales_and_extra_layers(host: HostPool) -> None:
    """What `replay --verify` checks: a block whose scales or extra layers changed fails."""
    dev = DevicePool(shape(), N, "cpu")
    keys = [bytes([i + 1]) * 8 for i in range(4)]
    content.fill(dev, [0, 1, 2, 3], keys, 0)
    assert content.check(dev, [0, 1, 2, 3], keys, 0) == []
    assert dev.scales is not None
    dev.scales.view(torch.int32)[2 * L + 1, 1, 0] ^= 1  # extra layer 0's V scale, head 0
    dev.data.view(torch.uint8)[L + E - 1, 0, 3, 0, 0, 0] ^= 1  # last extra layer's K
    assert content.check(dev, [0, 1, 2, 3], keys, 0) == [1, 3]
    engine = CopyEngine(dev, host)
    engine.d2h([0], [4])
    assert content.check(host, [4], keys[:1], 0) == []
    assert host.scales is not None
    host.scales.view(torch.int32)[4, 0, 1] ^= 1 << 30
    assert content.check(host, [4], keys[:1], 0) == [0]


# ---------------------------------------------------------------------- engine-owned KV


@pytest.fixture
def dep() -> Iterator[str]:
    d = new_deployment_id("sxl")
    yield d
    left = shm_entries(d)
    remove_leftovers(d)
    assert not left, f"deployment {d} left {left}"


def engine_spec(dep: str, **kw: Any) -> WorkerSpec:
    fields: dict[str, Any] = dict(
        deployment_id=dep, rank=0, num_ranks=1, num_layers=L, num_kv_heads=H, head_dim=D,
        dtype=FP8, block_size=BS, device_blocks=N, host_blocks=HOST, device="cpu",
        engine_kv=True, num_extra_layers=E, kv_scales="per_block_head")
    return WorkerSpec(**(fields | kw))


def runner_kv(dep: str, tag: str, layers: int = L + E) -> list[torch.Tensor]:
    """A runner's fp8 KV in vLLM's layout, in shared memory the worker side can map."""
    return [shared_kv_tensor(dep, 0, (2, N, BS, H, D), torch.float8_e4m3fn, tag=f"{tag}{i}")
            for i in range(layers)]


def test_engine_registration_carries_extra_layers_and_scale_tensors(
        dep: str, host: HostPool) -> None:
    """A runner registers L + E layers (vLLM layout) and a (K, V) pair of float32 scale
    tensors per layer; the worker side maps them, and a round trip through the host pool
    lands every byte in the runner's own tensors."""
    kv = runner_kv(dep, "a")
    scales = [(shared_kv_tensor(dep, 0, (N, H), torch.float32, tag=f"k{i}"),
               shared_kv_tensor(dep, 0, (N, H), torch.float32, tag=f"v{i}"))
              for i in range(L + E)]
    for i, t in enumerate(kv):
        randomize(t, 10 + i)
    for i, (k, v) in enumerate(scales):
        randomize(k, 100 + i)
        randomize(v, 200 + i)
    with KVRegistration(dep, 0, kv, "vllm", block_size=BS, num_kv_heads=H, head_dim=D,
                        scales=scales):
        rec = kvreg.read_record(dep, 0)
        assert rec is not None and rec.num_layers == L + E
        assert len(rec.scale_planes) == 2 * (L + E)
        assert set(rec.segments()) >= {f"/kvtier_{dep}_kvmem_r0_k0", f"/kvtier_{dep}_kvmem_r0_v4"}
        pool = EnginePool(engine_spec(dep), rec)
        try:
            runner_planes = [t[h].view(N, -1) for t in kv for h in (0, 1)]
            runner_scales = [s for pair in scales for s in pair]
            before = [block_bytes(runner_planes, runner_scales, b) for b in (1, 2)]
            engine = CopyEngine(pool, host)
            engine.d2h([1, 2], [0, 3])
            layers: list[int] = []
            engine.h2d([0, 3], [6, 9], layers.append)
            assert layers == list(range(L + E))
            assert [block_bytes(runner_planes, runner_scales, b) for b in (6, 9)] == before
        finally:
            pool.close()
        # What the configuration says must match what the runner registered.
        with pytest.raises(EngineKVError, match=re.escape(
                "num_layers = 5 in the registration, model.num_layers + model.num_extra_layers "
                "= 4")):
            check_record(rec, engine_spec(dep, num_extra_layers=1))
        with pytest.raises(EngineKVError, match=re.escape(
                "scale planes = 10 in the registration, model.kv_scales = 'none' = 0")):
            check_record(rec, engine_spec(dep, kv_scales="none"))
    with KVRegistration(dep, 0, runner_kv(dep, "b"), "vllm", block_size=BS, num_kv_heads=H,
                        head_dim=D):
        rec = kvreg.read_record(dep, 0)
        assert rec is not None and rec.scale_planes == ()
        with pytest.raises(EngineKVError, match="scale planes = 0 in the registration"):
            check_record(rec, engine_spec(dep))


def test_engine_scale_tensors_are_checked_when_registering(dep: str) -> None:
    kv = runner_kv(dep, "l", L)
    good = [(shared_kv_tensor(dep, 0, (N, H), torch.float32, tag=f"k{i}"),
             shared_kv_tensor(dep, 0, (N, H), torch.float32, tag=f"v{i}")) for i in range(L)]
    bad_dtype = [*good[:-1], (good[-1][0], good[-1][1].view(torch.int32))]
    cases: list[tuple[Any, str]] = [
        (good[:-1], f"scales: {L - 1} layers, the KV has {L}"),
        (bad_dtype, f"layer {L - 1} V scales: torch.int32 on cpu, expected torch.float32"),
        ([(k[:, :1], v) for k, v in good], "layer 0 K scales: dimension 1 (num_kv_heads) is 1"),
    ]
    for scales, message in cases:
        with pytest.raises(EngineKVError, match=re.escape(message)):
            KVRegistration(dep, 0, kv, "vllm", block_size=BS, num_kv_heads=H, head_dim=D,
                           scales=scales)
    # Refused, nothing was published; the good ones register (and their close() unlinks
    # every segment).
    assert kvreg.read_record(dep, 0) is None
    with KVRegistration(dep, 0, kv, "vllm", block_size=BS, num_kv_heads=H, head_dim=D,
                        scales=good) as reg:
        assert len(reg.scale_planes) == 2 * L


# ---------------------------------------------------------------------- end to end


@pytest.mark.slow  # a Stack with 2 worker processes
def test_a_load_reports_every_extra_layer_to_layer_waiters() -> None:
    """Through worker processes: a host hit's load is reported layer by layer up to the last
    extra layer (index num_layers + num_extra_layers - 1) on every rank, and the loaded
    blocks hold their K, V, extra layers and scales."""
    cfg = tiny_config(workers=2, num_layers=L, device_blocks=8, host_blocks=32,
                      write_policy="write_through",
                      extra={**SCALED, "KVTIER_MODEL__NUM_EXTRA_LAYERS": str(E)})
    with running_stack(cfg) as stack:
        m = stack.require_manager()
        runner = ModelRunner(stack)
        a = prompt(1, 6)
        runner.run(a)
        assert m.dispatcher.drain(20)
        runner.run(prompt(2, 7))  # takes every device block: `a` only stays on the host
        assert m.dispatcher.drain(20)
        hit = m.match("again", a)
        try:
            assert hit.host_tokens == 6 * 4 and hit.handle.seqs, hit
            with LayerWaiter(cfg.deployment_id, 2) as waiter:
                for seq in hit.handle.seqs:
                    waiter.wait(seq, L + E - 1, timeout=20)
                    assert waiter.layers_done(seq) == [L + E, L + E]
            hit.handle.wait(20)
            assert runner.check(a, hit.block_ids) == []
        finally:
            m.release("again")


def _replay(config: Path) -> dict[str, Any]:
    cmd = [*module_command(), "replay", "--workload", "chat", "--limit", "12", "--verify",
           "--json", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report: dict[str, Any] = json.loads(proc.stdout)
    assert report["corrupt_blocks"] == 0 and report["verified_blocks"] > 0, report
    return report


@pytest.mark.slow  # three `kvtier replay` processes with worker processes
def test_replay_verify_fp8_scales_and_extra_layers_through_every_tier(tmp_path: Path) -> None:
    """fp8 KV with per-block scales and an extra layer, through 2 worker processes, the host
    tier and file storage: every hit checked byte for byte (scales and extra layer included)
    finds nothing corrupt; a second run is served from storage. A deployment with two extra
    layers on the same folder never reads those pages; one with one extra layer again does."""
    storage = tmp_path / "storage"

    def config(extra_layers: int) -> Path:
        dep = new_deployment_id("sxl")
        path = tmp_path / f"kvtier-{dep}.toml"
        path.write_text(f"""\
deployment_id = "{dep}"
[model]
num_layers = 2
num_extra_layers = {extra_layers}
num_kv_heads = 2
head_dim = 8
dtype = "{FP8}"
kv_scales = "per_block_head"
[cache]
block_size = 4
device_blocks = 2048
host_blocks = 4096
write_policy = "write_through"
[storage]
backend = "file"
path = {json.dumps(str(storage))}
prefetch_policy = "wait_complete"
prefetch_threshold = 8
[workers]
count = 2
device = "cpu"
""")
        return path

    runs = []
    for extra_layers in (1, 1, 2, 1):
        path = config(extra_layers)
        report = _replay(path)
        dep = path.stem.removeprefix("kvtier-")
        assert leftovers(dep, 2) == []
        runs.append(report)
    first, second, other, again = runs
    assert first["hit_tokens"]["storage"] == 0
    assert first["hit_tokens"]["host"] + first["hit_tokens"]["device"] > 0
    assert second["hit_tokens"]["storage"] > 0 and second["transfer_bytes"]["storage_read"] > 0
    assert other["hit_tokens"]["storage"] == 0  # another page shape: another namespace
    assert again["hit_tokens"]["storage"] > 0
    # Two namespaces per rank on disk: one extra layer and two.
    assert len(list(storage.glob("*/r0"))) == 2, sorted(os.listdir(storage))
