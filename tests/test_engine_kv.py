"""The engine owns the KV memory: the model runner registers its tensors
(`kvtier.worker.engine_kv`), each rank's worker attaches to them (`kvtier.worker.engine_pool`)
and moves their bytes, plane by plane, between them and its host pool.

Fast tests check the pieces in this process: planes of every layout are views of the engine's
tensors, validation names the layer and the dimension, the registration record (CPU and the
CUDA fields, encoded and decoded here without a GPU), the attach and its checks against the
configuration, the copy engine and the content checker on planes, stale cleanup, and the
layer waiter over a real control segment. Slow tests run real Stacks with
`workers.engine_kv = true`: the test process (or a child process) is the model runner, writes
its own tensors and reads them back after a round trip device -> host -> other device blocks,
byte for byte on every layer, K and V, on 2 ranks. The CUDA tests do the same with the
runner's tensors on cuda:0 in a child process, exported through CUDA IPC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import queue
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_runner import LAYOUTS, RunnerKV, make_kv
from kvtier.manager.config import KvtierConfig
from kvtier.manager.errors import KvtierError
from kvtier.manager.launcher import WorkerStartError
from kvtier.manager.stack import Stack
from kvtier.worker import content, engine_kv, kvreg
from kvtier.worker.copy_engine import LAYER_DELAY_ENV, CopyEngine
from kvtier.worker.engine_kv import KVRegistration, LayerWaiter, kv_planes, shared_kv_tensor
from kvtier.worker.engine_pool import EnginePool, check_record
from kvtier.worker.ipc import LayerWaitTimeout, ManagerIPC, TaskAborted, WorkerIPC
from kvtier.worker.kv_pools import HostPool, PlanePool
from kvtier.worker.kvreg import EngineKVError, Record
from kvtier.worker.spec import WorkerSpec
from kvtier.worker.wire import TaskKind
from stack_support import assert_clean_exits, check, diagnose, fill, worker_pids
from support import (
    leftovers,
    new_deployment_id,
    pid_exists,
    remove_leftovers,
    shm_entries,
    tiny_config,
    wait_until,
)

pytestmark = pytest.mark.fast

TESTS_DIR = Path(__file__).resolve().parent
L, N, BS, H, D = 3, 16, 4, 2, 8  # tiny_config's KV geometry with 3 layers, 16 blocks
HOST_BLOCKS = 16
_tokens = itertools.count(1)


def fresh_tokens(n: int) -> list[int]:
    base = next(_tokens) * 1_000_000 + os.getpid() % 1000 * 1000
    return list(range(base, base + n))


@pytest.fixture
def dep() -> Iterator[str]:
    """A fresh deployment id; the test must leave nothing of it in /dev/shm."""
    d = new_deployment_id("ekv")
    yield d
    left = shm_entries(d)
    remove_leftovers(d)
    assert not left, f"deployment {d} left {left}"


def spec_for(dep: str, rank: int = 0, **kw: Any) -> WorkerSpec:
    fields: dict[str, Any] = dict(deployment_id=dep, rank=rank, num_ranks=2, num_layers=L,
                                  num_kv_heads=H, head_dim=D, dtype="float16", block_size=BS,
                                  device_blocks=N, host_blocks=HOST_BLOCKS, device="cpu",
                                  engine_kv=True)
    fields.update(kw)
    return WorkerSpec(**fields)


def randomize(t: torch.Tensor, seed: int) -> None:
    raw = t.view(torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def raw_tensors(kv: Any) -> list[torch.Tensor]:
    if isinstance(kv, torch.Tensor):
        return [kv]
    return [t for item in kv for t in (item if isinstance(item, tuple) else (item,))]


# --------------------------------------------------------------------------- planes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_planes_are_views_in_layer_k_v_order(layout: str) -> None:
    kv = _private_kv(layout)
    found = kv_planes(kv, layout, block_size=BS, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
    assert (found.num_layers, found.num_blocks, found.dtype) == (L, N, torch.float16)
    assert len(found.planes) == 2 * L
    for i, p in enumerate(found.planes):
        layer, half = divmod(i, 2)
        assert p.shape == (N, BS * H * D)
        src = _half(kv, layout, layer, half)  # the engine's own view of that layer's K or V
        p[5].fill_(float(i + 1))  # a write through the plane lands in the engine's tensor
        assert torch.all(src[5] == float(i + 1))
        assert src.data_ptr() == p.data_ptr()


def _private_kv(layout: str) -> Any:
    if layout == "kvtier":
        return torch.zeros(L, 2, N, BS, H, D, dtype=torch.float16)
    if layout == "vllm":
        return [torch.zeros(2, N, BS, H, D, dtype=torch.float16) for _ in range(L)]
    return [(torch.zeros(N, H, BS, D, dtype=torch.float16),
             torch.zeros(N, H, BS, D, dtype=torch.float16)) for _ in range(L)]


def _half(kv: Any, layout: str, layer: int, half: int) -> torch.Tensor:
    """Layer `layer`'s K (half 0) or V (half 1) as the engine indexes it."""
    return kv[layer, half] if layout == "kvtier" else kv[layer][half]  # type: ignore[no-any-return]


@pytest.mark.parametrize(("layout", "break_it", "message"), [
    ("vllm", lambda kv: kv.__setitem__(1, kv[1].to(torch.bfloat16)),
     "layer 1 K: dtype torch.bfloat16, layer 0 K has torch.float16"),
    ("vllm", lambda kv: kv.__setitem__(2, torch.zeros(2, N, BS, H, D + 1, dtype=torch.float16)),
     "layer 2: dimension 4 (head_dim) is 9, expected 8"),
    ("vllm", lambda kv: kv.__setitem__(1, torch.zeros(2, N - 1, BS, H, D, dtype=torch.float16)),
     "layer 1 K: dimension 0 (num_blocks) is 15, layer 0 K has 16"),
    ("vllm", lambda kv: kv.__setitem__(0, torch.zeros(3, N, BS, H, D, dtype=torch.float16)),
     "layer 0: dimension 0 (2 (K, V)) is 3, expected 2"),
    ("vllm", lambda kv: kv.__setitem__(1, kv[1].to("meta")),
     "layer 1 K: on meta, layer 0 K is on cpu"),
    ("vllm", lambda kv: kv.__setitem__(1, kv[0]), "layer 1 K and layer 0 K are the same memory"),
    ("vllm", lambda kv: kv.__setitem__(
        1, torch.zeros(2, N, H, BS, D, dtype=torch.float16).transpose(2, 3)),
     "layer 1 K: the elements of one block are not contiguous"),
    ("fastdeploy", lambda kv: kv.__setitem__(2, (kv[2][0], torch.zeros(N, BS, H, D))),
     "layer 2 V: dimension 1 (num_kv_heads) is 4, expected 2"),
    ("fastdeploy", lambda kv: kv.__setitem__(0, kv[0][0]), "layer 0: expected a (K, V) pair"),
    ("kvtier", lambda kv: None, ""),
])
def test_plane_validation_names_layer_and_dimension(layout: str, break_it: Any,
                                                    message: str) -> None:
    kv = _private_kv(layout)
    break_it(kv)
    if not message:
        kv_planes(kv, layout, block_size=BS, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
        with pytest.raises(EngineKVError, match=r"dimension 3 \(block_size\) is 4, expected 8"):
            kv_planes(kv, layout, block_size=8, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
        return
    with pytest.raises(EngineKVError) as e:
        kv_planes(kv, layout, block_size=BS, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
    assert message in str(e.value)


def test_other_misuse_is_refused(dep: str) -> None:
    with pytest.raises(EngineKVError, match="layout 'paged'"):
        kv_planes(_private_kv("vllm"), "paged", block_size=BS, num_kv_heads=H,  # type: ignore[arg-type]
                  head_dim=D)
    with pytest.raises(EngineKVError, match="expected one tensor"):
        kv_planes(_private_kv("vllm"), "kvtier", block_size=BS, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
    with pytest.raises(EngineKVError, match=r"must be allocated with kvtier\.worker\.engine_kv"):
        KVRegistration(dep, 0, _private_kv("vllm"), "vllm", block_size=BS, num_kv_heads=H,
                       head_dim=D)
    with pytest.raises(EngineKVError, match="tag 'a_b' is invalid"):
        shared_kv_tensor(dep, 0, (4,), torch.float16, tag="a_b")
    with pytest.raises(EngineKVError, match="shape must be positive"):
        shared_kv_tensor(dep, 0, (4, 0), torch.float16)
    t = shared_kv_tensor(dep, 0, (4,), torch.float16, tag="once")
    with pytest.raises(EngineKVError, match="already exists in this process"):
        shared_kv_tensor(dep, 0, (4,), torch.float16, tag="once")
    kvreg_release = [f"/kvtier_{dep}_kvmem_r0_once"]
    del t
    from kvtier.worker import engine_kv
    engine_kv._release_segments(kvreg_release)
    assert shm_entries(dep) == []


# --------------------------------------------------------------------------- registration


@pytest.mark.parametrize("layout", LAYOUTS)
def test_registration_record_and_segments(dep: str, layout: str) -> None:
    runner = RunnerKV(dep, 1, layout, layers=L, blocks=N)
    reg = runner.regs[0]
    names = shm_entries(dep)
    assert f"kvtier_{dep}_kvreg_r0" in names
    kv_segments = [n for n in names if "_kvmem_r0_" in n]
    assert len(kv_segments) == {"kvtier": 1, "vllm": L, "fastdeploy": 2 * L}[layout]
    for n in names:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{n}").st_mode) == 0o600, n
    rec = kvreg.read_record(dep, 0)
    assert rec is not None
    assert (rec.owner_pid, rec.nonce, rec.layout, rec.device) == (
        os.getpid(), reg.nonce, layout, "cpu")
    assert (rec.num_layers, rec.num_blocks, rec.row_bytes, rec.dtype) == (
        L, N, BS * H * D * 2, "float16")
    assert sorted("/" + n for n in kv_segments) == sorted(rec.segments())
    raw = kvreg.read_segment(f"/kvtier_{dep}_kvreg_r0")
    assert raw is not None and json.loads(raw)["version"] == kvreg.RECORD_VERSION
    assert all(p["offset_bytes"] >= kvreg.SEGMENT_HEADER_BYTES for p in rec.planes)
    assert all((t == 0).all() for t in reg.planes)  # shared_kv_tensor memory starts zeroed
    with pytest.raises(EngineKVError, match="already registered in this process"):
        KVRegistration(dep, 0, runner.kvs[0], layout, block_size=BS,  # type: ignore[arg-type]
                       num_kv_heads=H, head_dim=D)
    runner.close()
    assert shm_entries(dep) == []
    assert reg.closed
    reg.close()  # idempotent


def test_record_decoding_refuses_what_it_cannot_trust(dep: str) -> None:
    rec = Record(deployment_id=dep, rank=0, owner_pid=1, nonce="ab", device="cpu",
                 device_uuid="", dtype="float16", layout="vllm", num_layers=1, num_blocks=4,
                 block_size=4, num_kv_heads=2, head_dim=8, row_bytes=128,
                 planes=tuple({"segment": f"/kvtier_{dep}_kvmem_r0_kv", "offset_bytes": 4096,
                               "shape": [4, 64], "strides": [64, 1]} for _ in range(2)))
    raw = kvreg.encode_record(rec)
    assert kvreg.decode_record(raw) == rec
    body = json.loads(raw)
    for change, message in [
        ({"version": 99}, "record version 99"),
        ({"format": "pickle"}, "not a kvtier engine KV record"),
        ({"layout": "paged"}, "layout 'paged'"),
        ({"num_blocks": "4"}, "field 'num_blocks' must be an integer"),
        ({"planes": body["planes"][:1]}, "1 planes for 1 layers"),
        ({"planes": [dict(body["planes"][0], segment="/etc_passwd")] * 2},
         "is not a KV segment of deployment"),
        ({"planes": [dict(body["planes"][0], shape=[3, 64])] * 2}, "3 blocks"),
    ]:
        with pytest.raises(EngineKVError, match=message):
            kvreg.decode_record(json.dumps(body | change).encode())
    with pytest.raises(EngineKVError, match="not a JSON"):
        kvreg.decode_record(b"\x80\x03}q\x00.")  # a pickle is not read


def test_cuda_fields_round_trip_as_hex() -> None:
    """What `_share_cuda_` returns survives the JSON record byte for byte, and the importer's
    device index replaces the exporter's."""
    fields = (3, b"\x00\xffhandle" * 8, 1 << 20, 512, b"/torch_123_ref", 7, b"\x01ev" * 16, True)
    obj = kvreg.encode_cuda_fields(fields)
    assert obj["handle"] == fields[1].hex() and obj["event_sync_required"] is True
    again = json.loads(json.dumps(obj))
    assert kvreg.decode_cuda_fields(again) == fields
    assert kvreg.decode_cuda_fields(again, device_index=0) == (0, *fields[1:])
    none_event = (*fields[:6], None, False)
    assert kvreg.decode_cuda_fields(kvreg.encode_cuda_fields(none_event)) == none_event
    with pytest.raises(EngineKVError, match="unsupported torch version"):
        kvreg.encode_cuda_fields(fields[:7])
    plane = {"cuda": obj, "storage_offset": 0, "shape": [4, 64], "strides": [64, 1]}
    rec = Record(deployment_id="d", rank=1, owner_pid=1, nonce="n", device="cuda:3",
                 device_uuid="GPU-x", dtype="bfloat16", layout="fastdeploy", num_layers=1,
                 num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, row_bytes=128,
                 planes=(plane, plane))
    assert kvreg.decode_record(kvreg.encode_record(rec)) == rec
    body = json.loads(kvreg.encode_record(rec))
    body["planes"][1]["cuda"] = {"handle": "00"}
    with pytest.raises(EngineKVError, match="'cuda' must hold the fields"):
        kvreg.decode_record(json.dumps(body).encode())


# --------------------------------------------------------------------------- attach


@pytest.mark.parametrize("layout", LAYOUTS)
def test_attach_maps_the_runners_memory(dep: str, layout: str) -> None:
    with contextlib.closing(RunnerKV(dep, 1, layout, layers=L, blocks=N)) as runner:
        pool = EnginePool.attach(spec_for(dep), timeout=1)
        assert pool.layout == layout and pool.num_blocks == N and pool.problem() is None
        for mine, theirs in zip(runner.regs[0].planes, pool.planes, strict=True):
            assert mine.data_ptr() != theirs.data_ptr()  # another mapping ...
            randomize(mine, 1)
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))  # ... same bytes
            theirs[3].view(torch.int16).fill_(7)
            assert torch.all(mine[3].view(torch.int16) == 7)
        pool.close()


@pytest.mark.parametrize(("change", "message"), [
    ({"num_layers": 4}, "num_layers = 3 in the registration, model.num_layers = 4"),
    ({"device_blocks": 32}, "num_blocks = 16 in the registration, cache.device_blocks = 32"),
    ({"dtype": "bfloat16"}, "dtype = 'float16' in the registration, model.dtype = 'bfloat16'"),
    ({"head_dim": 16}, "row_bytes = 128 in the registration"),
    ({"block_size": 8, "head_dim": 4}, "block_size = 4 in the registration, cache.block_size = 8"),
    ({"device": "cuda:0"}, "device = 'cpu' in the registration, workers.device gives this rank"),
])
def test_attach_checks_the_registration_against_the_configuration(
        dep: str, change: dict[str, Any], message: str) -> None:
    with contextlib.closing(RunnerKV(dep, 1, "vllm", layers=L, blocks=N)):
        rec = kvreg.read_record(dep, 0)
        assert rec is not None
        with pytest.raises(EngineKVError) as e:
            check_record(rec, spec_for(dep, **change))
        assert message in str(e.value)
        assert f"rank 0 (/kvtier_{dep}_kvreg_r0)" in str(e.value)


def test_attach_waits_bounded_and_names_what_is_missing(dep: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineKVError) as e:
        EnginePool.attach(spec_for(dep), timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    assert f"no engine KV registration /kvtier_{dep}_kvreg_r0 after 0.3 s" in str(e.value)
    assert "none was registered" in str(e.value)
    # a registration appearing during the wait is attached
    runner: list[RunnerKV] = []
    timer = threading.Timer(0.2, lambda: runner.append(RunnerKV(dep, 1, "kvtier")))
    timer.start()
    try:
        pool = EnginePool.attach(spec_for(dep), timeout=10)
        assert pool.layout == "kvtier"
    finally:
        timer.join()
        for r in runner:
            r.close()


def test_problem_tells_closed_replaced_and_current_apart(dep: str) -> None:
    runner = RunnerKV(dep, 1, "vllm")
    try:
        pool = EnginePool.attach(spec_for(dep), timeout=1)
        assert pool.problem() is None
        runner.reregister(0)
        assert pool.problem() == (f"engine KV registration of rank 0 was replaced (model runner "
                                  f"pid {os.getpid()} registered again)")
        runner.regs[0].close()
        assert pool.problem() == (f"engine KV registration of rank 0 is gone (model runner pid "
                                  f"{os.getpid()} closed it)")
        assert EnginePool.try_attach(spec_for(dep)) is None
    finally:
        runner.close()


# --------------------------------------------------------------------------- copies on planes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("chunked", [False, True])
def test_copy_engine_round_trips_planes(dep: str, layout: str, chunked: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """D2H then H2D into other block ids, byte-exact on every layer, K and V; blocks not
    named stay untouched; the layer callbacks fire in order."""
    kv = _private_kv(layout)
    found = kv_planes(kv, layout, block_size=BS, num_kv_heads=H, head_dim=D)  # type: ignore[arg-type]
    pool = PlanePool(spec_for(dep).shape, found.planes, layout=layout)
    for i, t in enumerate(raw_tensors(kv)):
        randomize(t, i)
    with HostPool(pool.shape, HOST_BLOCKS, f"/kvtier_{dep}_host_r0") as host:
        stage = {"stage_bytes": pool.shape.layer_bytes * 2} if chunked else {}
        engine = CopyEngine(pool, host, **stage)  # type: ignore[arg-type]
        before = [p.clone() for p in pool.planes]
        src, pages, dst = [1, 3, 5, 6, 7], [9, 0, 2, 15, 4], [0, 14, 8, 3, 2]
        engine.d2h(src, pages)
        for j, (s, h) in enumerate(zip(src, pages, strict=True)):
            page = host.kv[h].view(2 * L, -1)
            for p in range(2 * L):
                assert torch.equal(page[p].view(torch.int16), before[p][s].view(torch.int16)), (
                    f"page {h} plane {p} (block {j})")
        layers: list[int] = []
        engine.h2d(pages, dst, layers.append)
        assert layers == list(range(L))
        for p in range(2 * L):
            got, want = pool.planes[p].view(torch.int16), before[p].view(torch.int16)
            assert torch.equal(got[dst], want[src]), f"plane {p}"
            rest = [b for b in range(N) if b not in dst]
            assert torch.equal(got[rest], want[rest]), f"plane {p}: other blocks changed"
        assert engine.bytes_d2h == engine.bytes_h2d == len(src) * pool.shape.page_bytes


def test_content_fill_check_on_planes_matches_the_own_pool(dep: str) -> None:
    """FILL on an engine's planes writes the same row bytes FILL writes into kvtier's own
    pool, and CHECK finds a single flipped byte."""
    from kvtier.worker.kv_pools import DevicePool

    shape = spec_for(dep).shape
    kv = _private_kv("fastdeploy")
    pool = PlanePool(shape, kv_planes(kv, "fastdeploy", block_size=BS, num_kv_heads=H,
                                      head_dim=D).planes, layout="fastdeploy")
    own = DevicePool(shape, N, "cpu")
    keys = [b"k1", b"k2", b"k3"]
    content.fill(pool, [4, 0, 9], keys, 1)
    content.fill(own, [4, 0, 9], keys, 1)
    for p in range(2 * L):
        assert torch.equal(pool.planes[p].view(torch.int16), own.planes[p].view(torch.int16))
    assert content.check(pool, [4, 0, 9], keys, 1) == []
    assert content.check(pool, [4, 0, 9], keys, 0) == [0, 1, 2]
    kv[2][1].view(torch.uint8)[0, 1, 3, 5] ^= 1  # one byte of layer 2's V in block 0
    assert content.check(pool, [4, 0, 9], keys, 1) == [1]


def test_own_pool_planes_alias_its_data() -> None:
    from kvtier.worker.kv_pools import DevicePool, KVShape

    pool = DevicePool(KVShape(L, H, D, BS, "float16"), N, "cpu")
    assert len(pool.planes) == 2 * L
    pool.planes[3][2].fill_(5)  # layer 1 V, block 2
    assert torch.all(pool.v_caches[1][2] == 5) and torch.all(pool.data[1, 1, 2] == 5)


# --------------------------------------------------------------------------- life cycle


def _child_runner(dep: str, layout: str, device: str = "cpu", ranks: int = 2) -> ChildRunner:
    return ChildRunner(dep, layout, device, ranks)


class ChildRunner:
    """`engine_runner.py` as a child process: a model runner in another process, killable."""

    def __init__(self, dep: str, layout: str, device: str, ranks: int) -> None:
        # a file, never a pipe nobody drains; closed in close()
        self._stderr = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, str(TESTS_DIR / "engine_runner.py"), "--deployment", dep,
             "--ranks", str(ranks), "--layout", layout, "--device", device, "--layers", str(L),
             "--blocks", str(N), "--block-size", str(BS), "--heads", str(H),
             "--head-dim", str(D)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.proc.pid
        ready = self._reply(120)
        assert ready == {"ready": self.pid}, ready

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _reply(self, timeout: float = 30) -> Any:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"runner pid {self.pid}: no answer in {timeout} s") from None
        if line is None:
            self._stderr.seek(0)
            raise AssertionError(f"runner pid {self.pid} exited: {self._stderr.read()[-2000:]}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        out = self._reply()
        assert "error" not in out, out
        return out

    def write(self, rank: int, ids: list[int], seed: int) -> None:
        self.ask(op="write", rank=rank, ids=ids, seed=seed)

    def digests(self, rank: int, ids: list[int]) -> list[list[str]]:
        return self.ask(op="digest", rank=rank, ids=ids)["digests"]  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, AssertionError):
                self.ask(op="exit")
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self._stderr):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()


@pytest.mark.slow  # a model runner child process (imports torch)
def test_dead_runners_names_are_removed_and_live_ones_kept(dep: str) -> None:
    """What the manager runs at start and stop: a dead runner's record and segments go, a
    live runner's stay."""
    child = _child_runner(dep, "vllm", ranks=1)  # rank 0 in a child process
    kv = make_kv(dep, 1, "kvtier", "cpu", layers=L, blocks=N, block_size=BS, heads=H,
                 head_dim=D)
    live = KVRegistration(dep, 1, kv, "kvtier", block_size=BS, num_kv_heads=H, head_dim=D)
    try:
        dead_names = [n for n in shm_entries(dep) if "_r0" in n]
        assert len(dead_names) == 1 + L
        assert kvreg.remove_dead_registrations(dep) == []  # both alive: nothing removed
        child.kill()
        removed = kvreg.remove_dead_registrations(dep)
        assert sorted(n.lstrip("/") for n in removed) == sorted(dead_names)
        assert sorted(shm_entries(dep)) == sorted([f"kvtier_{dep}_kvreg_r1",
                                                   f"kvtier_{dep}_kvmem_r1_kv"])
    finally:
        child.close()
        live.close()


@pytest.mark.slow  # a model runner child process (imports torch)
def test_a_dead_runners_registration_is_taken_over(dep: str) -> None:
    child = _child_runner(dep, "fastdeploy", ranks=1)
    child.kill()
    rec = kvreg.read_record(dep, 0)
    assert rec is not None and rec.owner_pid == child.pid
    with pytest.raises(EngineKVError, match=f"belongs to model runner pid {child.pid}, which "
                       "exited"):
        EnginePool.attach(spec_for(dep), timeout=0.1)
    # The new runner's segments get the dead one's names (same layout, same tags): taking
    # the registration over must remove the dead one's record, never the new segments.
    with contextlib.closing(RunnerKV(dep, 1, "fastdeploy")):
        rec = kvreg.read_record(dep, 0)
        assert rec is not None and rec.owner_pid == os.getpid()
        assert len(rec.segments()) == 2 * L
        assert all(kvreg.segment_owner(n) == os.getpid() for n in rec.segments())
        assert sorted(shm_entries(dep)) == sorted(
            [f"kvtier_{dep}_kvreg_r0", *(n.lstrip("/") for n in rec.segments())])
        pool = EnginePool.attach(spec_for(dep), timeout=1)
        assert pool.problem() is None
        pool.close()
    child.close()


def test_layer_waiter_reads_the_progress_ring(dep: str) -> None:
    with ManagerIPC(dep, 2) as mgr, WorkerIPC(dep, 0) as w0, WorkerIPC(dep, 1) as w1, \
            LayerWaiter(dep, 2) as waiter:
        w0.publish_layers_done(7, 2)
        with pytest.raises(LayerWaitTimeout) as e:
            waiter.wait(7, 0, timeout=0.1)
        assert e.value.ranks == [1]
        w1.publish_layers_done(7, 1)
        waiter.wait(7, 0, timeout=1)
        assert waiter.layers_done(7) == [2, 1]
        w1.publish_load_failed(7)
        t0 = time.monotonic()
        with pytest.raises(TaskAborted, match=r"failed on ranks \[1\]"):
            waiter.wait(7, 1, timeout=10)
        assert time.monotonic() - t0 < 1
        assert waiter.layers_done(7) == [2, None]
        assert mgr.layers_done(7) == [2, None]
        with pytest.raises(TimeoutError):  # the manager waits for the failed completion
            mgr.wait_layer(7, 1, timeout=0.05)
        with pytest.raises(Exception, match="has 2 ranks, not 3"):
            LayerWaiter(dep, 3)
    with pytest.raises(Exception, match="no manager is running"):
        LayerWaiter(dep, 2)


# --------------------------------------------------------------------------- real stacks


def engine_config(dep: str, **extra: str) -> KvtierConfig:
    """2 ranks, 3 layers, 16 device and host blocks, write_through, engine KV; workers on
    the CPU unless `extra` says otherwise (the runner's KV decides, not KVTIER_TEST_DEVICE)."""
    env = {"KVTIER_WORKERS__ENGINE_KV": "true", "KVTIER_WORKERS__READY_TIMEOUT_S": "60",
           "KVTIER_WORKERS__DEVICE": "cpu"}
    env.update(extra)
    return tiny_config(deployment_id=dep, workers=2, num_layers=L, device_blocks=N,
                       host_blocks=HOST_BLOCKS, write_policy="write_through", extra=env)


@contextlib.contextmanager
def engine_stack(cfg: KvtierConfig, runner: Any) -> Iterator[Stack]:
    """A started Stack over `runner`'s registrations. On exit the stack stops, then the
    runner closes; after both nothing of the deployment may be left: no /dev/shm entry, no
    queue, no worker process; every worker exited cleanly."""
    stack = Stack(cfg, transfer_timeout_s=20)
    seen: list[int] = []
    try:
        stack.start()
        seen += worker_pids(stack)
        yield stack
        seen += worker_pids(stack)
    finally:
        stack.close()
        runner.close()
    assert_clean_exits(stack)
    wait_until(lambda: not leftovers(cfg.deployment_id, cfg.workers.count, seen), 10,
               "the deployment leaves nothing")


def manager_noticed_new_registrations(stack: Stack, dep: str, ranks: int = 2) -> None:
    """Wait until the manager's engine-KV check has seen every rank's current registration:
    it drops the whole cache once on each change, so a test caching blocks before that would
    see them dropped under it (dropping is what keeps a restarted runner from being served
    blocks of its predecessor's memory)."""
    sup = stack.supervisor
    assert sup is not None

    def seen() -> bool:
        recs = [kvreg.read_record(dep, r) for r in range(ranks)]
        return all(rec is not None and sup.seen_kv_nonce(r) == rec.nonce
                   for r, rec in enumerate(recs))

    wait_until(seen, 10, "the manager saw the new registrations")


def round_trip(stack: Stack, runner: Any, ranks: int = 2) -> None:
    """The runner computes 4 blocks (writes its own tensors), the manager backs them up to
    the host (D2H), another request takes over exactly those device blocks and writes them,
    then the prefix is matched from the host and loaded into *other* device blocks (H2D):
    the runner reads back exactly what it wrote, on every rank, layer, K and V, and the other
    request's blocks are untouched."""
    m = stack.require_manager()
    stack.reset()
    assert m.stats()["device"]["free"] == N
    failed = m.stats()["counters"]["failed_tasks"]
    ta = fresh_tokens(4 * BS)
    m.match("A", ta)
    a_ids = m.allocate("A", 4 * BS, 0)
    for r in range(ranks):
        runner.write(r, a_ids, seed=11 + r)
    want = {r: runner.digests(r, a_ids) for r in range(ranks)}
    assert want[0] != want[1] and len(set(want[0][0])) == 2 * L  # every plane differs
    m.commit("A", ta, 4 * BS)  # write_through: D2H of A's blocks
    m.release("A")
    assert m.dispatcher.drain(20), "the backup did not finish"
    m.match("P", fresh_tokens((N - 4) * BS))
    m.allocate("P", (N - 4) * BS, 0)  # every free block
    m.match("Q", fresh_tokens(4 * BS))
    q_ids = m.allocate("Q", 4 * BS, 0)  # evicts A's blocks from the device
    assert sorted(q_ids) == sorted(a_ids)
    for r in range(ranks):
        runner.write(r, q_ids, seed=101 + r)
    q_want = {r: runner.digests(r, q_ids) for r in range(ranks)}
    m.release("P")
    res = m.match("A2", [*ta, 7])
    assert (res.device_tokens, res.host_tokens) == (0, 4 * BS)
    res.handle.wait(20)  # H2D
    assert not set(res.block_ids) & set(a_ids)
    for r in range(ranks):
        assert runner.digests(r, res.block_ids) == want[r], f"rank {r}: loaded blocks differ"
        assert runner.digests(r, q_ids) == q_want[r], f"rank {r}: the load overwrote Q"
    m.release("A2")
    m.release("Q")
    assert m.stats()["counters"]["failed_tasks"] == failed


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trip_through_worker_processes(layout: str) -> None:
    """Each layout, 2 ranks, the test process as the model runner: round trip byte for byte,
    then FILL/CHECK tasks run by the workers land in (and read) the runner's own tensors."""
    dep = new_deployment_id("ekv")
    runner = RunnerKV(dep, 2, layout)
    with engine_stack(engine_config(dep), runner) as stack:
        round_trip(stack, runner)
        m = stack.require_manager()
        ids, keys = [2, 9, 13], [101, 102, 103]
        fill(m, ids, keys)
        shape = spec_for(dep).shape
        kb = [k.to_bytes(16, "little") for k in keys]
        for r in range(2):  # the workers' FILL is in the runner's memory
            mine = PlanePool(shape, runner.regs[r].planes, layout=layout)
            assert content.check(mine, ids, kb, r) == []
        assert check(m, ids, keys) == []
        assert check(m, ids, [7, 8, 9]) == [0, 1, 2]
        assert stack.ready()[0]


def test_engine_kv_is_refused_for_an_embedded_stack() -> None:
    cfg = engine_config(new_deployment_id("ekv"))
    with pytest.raises(KvtierError, match="engine_kv = true needs worker processes"):
        Stack(cfg, embedded=True).start()


@pytest.fixture(scope="class")
def slow_loads() -> Iterator[tuple[Stack, RunnerKV]]:
    """2 ranks over the test process's "vllm" KV; every H2D layer takes DELAY_S longer."""
    old = os.environ.get(LAYER_DELAY_ENV)
    os.environ[LAYER_DELAY_ENV] = str(DELAY_S * 1000)
    dep = new_deployment_id("ekv")
    try:
        runner = RunnerKV(dep, 2, "vllm")
        with engine_stack(engine_config(dep), runner) as stack:
            yield stack, runner
    finally:
        if old is None:
            os.environ.pop(LAYER_DELAY_ENV, None)
        else:
            os.environ[LAYER_DELAY_ENV] = old


DELAY_S = 0.2


def _host_only(stack: Stack, runner: RunnerKV) -> tuple[list[int], dict[int, Any]]:
    """4 blocks computed, backed up, evicted from the device: cached on the host only."""
    m = stack.require_manager()
    stack.reset()
    tokens = fresh_tokens(4 * BS)
    m.match("c", tokens)
    ids = m.allocate("c", 4 * BS, 0)
    for r in range(2):
        runner.write(r, ids, seed=5 + r)
    want = {r: runner.digests(r, ids) for r in range(2)}
    m.commit("c", tokens, 4 * BS)
    m.release("c")
    assert m.dispatcher.drain(20)
    m.match("e", fresh_tokens(N * BS))
    m.allocate("e", N * BS, 0)
    m.release("e")
    return tokens, want


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestLifeCycle:
    def test_layer_waiter_releases_layer_0_before_the_last_layer(
            self, slow_loads: tuple[Stack, RunnerKV]) -> None:
        stack, runner = slow_loads
        m = stack.require_manager()
        tokens, want = _host_only(stack, runner)
        with LayerWaiter(stack.cfg.deployment_id, 2) as waiter:
            t0 = time.monotonic()
            res = m.match("w", [*tokens, 1])
            seq = res.handle.seq
            assert seq is not None and res.handle.seqs == [seq]
            waiter.wait(seq, 0, timeout=10)
            t1 = time.monotonic()
            assert not res.handle.done, "layer 0 released only when the whole load was done"
            assert t1 - t0 < 5, f"layer 0 took {t1 - t0:.3f} s"
            waiter.wait(seq, L - 1, timeout=10)
            t2 = time.monotonic()
            assert t2 - t1 >= (L - 1) * DELAY_S * 0.9, f"last layer {t2 - t1:.3f} s after 0"
            assert waiter.layers_done(seq) == [L, L]
        res.handle.wait(10)
        for r in range(2):
            assert runner.digests(r, res.block_ids) == want[r]
        m.release("w")

    def test_registration_gone_fails_tasks_then_a_new_one_works(
            self, slow_loads: tuple[Stack, RunnerKV]) -> None:
        stack, runner = slow_loads
        m = stack.require_manager()
        stack.reset()
        bs = stack.cfg.cache.block_size
        tokens = list(range(7000, 7000 + 3 * bs + 1))  # a prefix cached in the first memory
        m.match("cached", tokens)
        m.allocate("cached", len(tokens))
        m.commit("cached", tokens, len(tokens))
        m.release("cached")
        assert m.stats()["device"]["cached"] == 3
        runner.regs[0].close()
        # the memory those blocks were in is gone: the manager must forget them by itself
        wait_until(lambda: m.stats()["device"]["cached"] == 0, 10,
                   "the device blocks of a closed registration dropped")
        out = diagnose(m, TaskKind.FILL, [1, 2], [1, 2])
        assert not out.ok
        assert (f"rank 0: EngineKVGone: engine KV registration of rank 0 is gone (model runner "
                f"pid {os.getpid()} closed it)") in out.error, out.error
        assert "rank 1" not in out.error  # rank 1's registration is still there
        out = diagnose(m, TaskKind.CHECK, [1], [1])  # and the next task fails the same way
        assert not out.ok and "is gone" in out.error
        runner.regs[0] = runner.register(0)  # the model runner is back, with new memory
        # nothing served from the old device memory (write_through host copies, kvtier's
        # own, may be: see test_host_copies_survive_a_runner_that_registers_again)
        assert m.match("again", tokens).device_tokens == 0
        m.release("again")
        manager_noticed_new_registrations(stack, stack.cfg.deployment_id)
        round_trip(stack, runner)
        assert stack.ready()[0]

    def test_host_copies_survive_a_runner_that_registers_again(
            self, slow_loads: tuple[Stack, RunnerKV]) -> None:
        """Issue 9: the host pools are the workers' own, so a model runner that closes its
        registration and registers new memory costs the device tier only: a prefix cached
        on the host (confirmed by a registration check) is still a host hit, loaded into the
        new memory byte for byte; a prefix cached only on the device is a miss."""
        stack, runner = slow_loads
        m = stack.require_manager()
        tokens, want = _host_only(stack, runner)
        bs = stack.cfg.cache.block_size
        dev_only = list(range(9000, 9000 + 2 * bs))
        m.match("d", dev_only)
        m.allocate("d", len(dev_only), 0)
        m.commit("d", dev_only, len(dev_only))  # write_through: its D2H may be in flight
        m.release("d")
        wait_until(lambda: m.unconfirmed_device_copies() == 0, 10,
                   "the host copies confirmed by a registration check")
        host_before = m.stats()["host"]["cached"]
        counters = dict(m.stats()["counters"])  # type: ignore[call-overload]
        for r in range(2):  # the model runner registers new memory on both ranks
            runner.reregister(r)
        manager_noticed_new_registrations(stack, stack.cfg.deployment_id)
        wait_until(lambda: m.stats()["counters"]["lost_device"] > counters["lost_device"],
                   10, "the manager dropped the device tier")
        after = m.stats()
        assert after["counters"]["lost_all"] == counters["lost_all"]  # type: ignore[index]
        assert after["device"]["cached"] == 0
        assert after["host"]["cached"] >= 4 and after["host"]["cached"] <= host_before
        res = m.match("again", [*tokens, 1])
        assert (res.device_tokens, res.host_tokens) == (0, 4 * bs)
        res.handle.wait(20)  # H2D into the new registration's memory
        for r in range(2):
            assert runner.digests(r, res.block_ids) == want[r], f"rank {r}: host copy differs"
        m.release("again")
        gone = m.match("gone", [*dev_only, 1])
        assert gone.device_tokens == 0
        m.release("gone")
        m.check_invariants()

    def test_kill_9_of_a_worker_is_replaced_and_reattaches(
            self, slow_loads: tuple[Stack, RunnerKV]) -> None:
        stack, runner = slow_loads
        victim = stack.status()["workers"][1]
        os.kill(victim["pid"], signal.SIGKILL)

        def replaced() -> bool:
            w = stack.status()["workers"][1]
            return w["pid"] != victim["pid"] and w["state"] == "ready"

        wait_until(replaced, 60, "rank 1 replaced by a ready worker")
        assert not pid_exists(victim["pid"])
        round_trip(stack, runner)


class _NoRunner:
    def close(self) -> None:
        """The child runners are closed by the test itself."""


def _child_round_trip_and_death(device: str, layout: str) -> None:
    """A model runner in a child process (tensors on `device`): round trip through the
    workers; kill -9 of the runner fails the next device task with the runner's pid; a new
    runner registers (taking the dead one's names over) and the round trip works again; the
    second runner is killed too, and stopping the stack removes its names."""
    dep = new_deployment_id("ekv")
    extra = {}
    if device != "cpu":
        extra = {"KVTIER_WORKERS__DEVICE": "cuda", "KVTIER_WORKERS__CUDA_DEVICES": "0,0"}
    cfg = engine_config(dep, **extra)
    runners = [_child_runner(dep, layout, device)]
    try:
        with engine_stack(cfg, _NoRunner()) as stack:
            round_trip(stack, runners[0])
            runners[0].kill()
            out = diagnose(stack.require_manager(), TaskKind.CHECK, [0], [1])
            assert not out.ok
            for r in range(2):
                assert (f"rank {r}: EngineKVGone: engine KV registration of rank {r} is gone "
                        f"(model runner pid {runners[0].pid} exited)") in out.error, out.error
            runners.append(_child_runner(dep, layout, device))
            manager_noticed_new_registrations(stack, dep)
            round_trip(stack, runners[1])
            runners[1].kill()
        assert shm_entries(dep) == []  # the stop removed the dead runner's names
    finally:
        for r in runners:
            r.close()
        remove_leftovers(dep)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_runner_in_a_child_process_dies_and_comes_back() -> None:
    _child_round_trip_and_death("cpu", "fastdeploy")


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_round_trip_through_ipc_handles(layout: str) -> None:
    """The model runner's KV on cuda:0 in a child process, exported through CUDA IPC; both
    ranks' workers on cuda:0 attach it: the same round trip and runner death as on the CPU."""
    _child_round_trip_and_death("cuda:0", layout)


@pytest.mark.cuda
def test_cuda_registration_exports_and_reimports_in_a_child(dep: str) -> None:
    """A CUDA registration's record, opened in another process through the worker's attach,
    shows the same bytes and takes writes (the simplest CUDA IPC check, no stack)."""
    kv = make_kv(dep, 0, "vllm", "cuda:0", layers=L, blocks=N, block_size=BS, heads=H,
                 head_dim=D)
    for i, t in enumerate(kv):
        randomize(t, i)
    torch.cuda.synchronize()
    with KVRegistration(dep, 0, kv, "vllm", block_size=BS, num_kv_heads=H, head_dim=D) as reg:
        sums = [str(int(p.view(torch.int16).sum())) for p in reg.planes]  # before the child writes
        rec = kvreg.read_record(dep, 0)
        assert rec is not None and rec.device == "cuda:0" and rec.device_uuid
        code = (
            "import sys, torch\n"
            "from kvtier.worker.engine_pool import EnginePool\n"
            "from kvtier.worker.spec import WorkerSpec\n"
            f"spec = WorkerSpec({dep!r}, 0, 1, {L}, {H}, {D}, 'float16', {BS}, {N}, 0, "
            "device='cuda:0', engine_kv=True)\n"
            "pool = EnginePool.attach(spec, 10)\n"
            "print(','.join(str(int(p.view(torch.int16).sum())) for p in pool.planes))\n"
            "for p in pool.planes: p[3].view(torch.int16).fill_(9)\n"
            "torch.cuda.synchronize()\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == ",".join(sums)
        assert all(bool((p[3].view(torch.int16) == 9).all()) for p in reg.planes)


# --------------------------------------------------------------------------- CUDA layer events
# The per-layer inter-process CUDA events (issue 9): the record field and the word table are
# torch-free and run here on the CPU; the event path itself needs a GPU (marked cuda).


def _cuda_record(dep: str, layers: int = 2, slots: int = 3, **events: Any) -> Record:
    fields = dict.fromkeys(kvreg.CUDA_FIELDS, 0) | {"handle": "00" * 8}
    planes = tuple({"cuda": fields, "storage_offset": 0, "shape": [4, 64], "strides": [64, 1]}
                   for _ in range(2 * layers))
    layer_events = {"segment": kvreg.kv_segment_name(dep, 0, kvreg.LAYER_EVENTS_TAG),
                    "slots": slots,
                    "handles": [[bytes([s, layer]).hex() * 32 for layer in range(layers)]
                                for s in range(slots)]} | events
    return Record(deployment_id=dep, rank=0, owner_pid=1, nonce="ab", device="cuda:0",
                  device_uuid="GPU-x", dtype="float16", layout="vllm", num_layers=layers,
                  num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, row_bytes=128,
                  planes=planes, layer_events=layer_events)


def test_layer_event_handles_round_trip_in_the_record(dep: str) -> None:
    """The events' IPC handles travel in the record as hex, per slot and layer, and come
    back as the 64-byte handles `torch.cuda.Event.from_ipc_handle` takes; the word table is
    one of the record's segments, so a dead runner's is removed with its record."""
    rec = _cuda_record(dep)
    back = kvreg.decode_record(kvreg.encode_record(rec))
    assert back == rec
    handles = back.event_handles()
    assert len(handles) == 3 and all(len(row) == 2 for row in handles)
    assert handles[2][1] == bytes([2, 1]) * 32 and len(handles[0][0]) == 64
    assert back.segments() == [f"/kvtier_{dep}_kvmem_r0_layerevents"]
    no_events = kvreg.decode_record(kvreg.encode_record(dataclasses.replace(rec,
                                                                            layer_events=None)))
    assert no_events.layer_events is None and no_events.event_handles() == []


def test_layer_event_records_that_cannot_be_trusted_are_refused(dep: str) -> None:
    rec = _cuda_record(dep)
    body = json.loads(kvreg.encode_record(rec))
    ev = body["layer_events"]
    for change, message in [
        ({"slots": 0}, "slots = 0, expected 1..64"),
        ({"slots": 2}, "handles must be 2 lists of 2"),
        ({"segment": "/kvtier_other_kvmem_r0_layerevents"}, "expected '/kvtier_"),
        ({"handles": [["ab"] * 2] * 3}, "a handle must be 128 hex digits"),
        ({"handles": [["zz" * 64] * 2] * 3}, "is not hexadecimal"),
        ({"extra": 1}, "must be an object with segment, slots and handles"),
    ]:
        with pytest.raises(EngineKVError, match=message):
            kvreg.decode_record(json.dumps(body | {"layer_events": ev | change}).encode())
    cpu = json.loads(kvreg.encode_record(dataclasses.replace(
        rec, device="cpu", planes=tuple({"segment": f"/kvtier_{dep}_kvmem_r0_kv",
                                         "offset_bytes": 4096, "shape": [4, 64],
                                         "strides": [64, 1]} for _ in range(4)))))
    with pytest.raises(EngineKVError, match="only a CUDA registration has layer events"):
        kvreg.decode_record(json.dumps(cpu).encode())


_PUBLISHER = """
import sys
from kvtier.worker.kvreg import LayerEventWords
words = LayerEventWords.open(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
for item in sys.argv[4:]:
    seq, layer = map(int, item.split(":"))
    words.publish(seq, layer)
words.close()
"""


def test_layer_event_words_between_processes(dep: str) -> None:
    """The runner creates the word table; a worker process opens it by name and publishes
    the loads whose layer events it recorded. A word covers its own load and any earlier
    load of the same slot (the later record completes after it: the copy stream is in
    order), never a later one; a batch publishing an older seq after a newer one never
    moves a word back."""
    words = kvreg.LayerEventWords.create(dep, 0, slots=4, layers=3)
    try:
        assert not words.covers(0, 0)
        args = ["9:0", "9:1", "5:0", "2:2"]  # 9 and 5 share slot 1; 5 comes after 9
        done = subprocess.run([sys.executable, "-c", _PUBLISHER, words.name, "4", "3", *args],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert words.word(1, 0) == 10 and words.word(1, 1) == 10 and words.word(2, 2) == 3
        assert words.covers(9, 0) and words.covers(5, 0) and words.covers(1, 0)
        assert not words.covers(13, 0)  # a later load of slot 1: not recorded yet
        assert not words.covers(9, 2) and words.covers(2, 2) and not words.covers(6, 2)
        with pytest.raises(IndexError):
            words.word(4, 0)
        with pytest.raises(EngineKVError, match="does not exist"):
            kvreg.LayerEventWords.open(f"/kvtier_{dep}_kvmem_r1_layerevents", 4, 3)
        with pytest.raises(EngineKVError, match=r"bytes, .* needed"):
            kvreg.LayerEventWords.open(words.name, 4, 4)
        with pytest.raises(EngineKVError, match="in use by pid"):
            _create_in_child(dep)
    finally:
        words.close()
        kvreg.unlink(words.name)


def _create_in_child(dep: str) -> None:
    """Another live process asking for the same table is refused (raised here)."""
    code = ("import sys\nfrom kvtier.worker.kvreg import LayerEventWords, EngineKVError\n"
            "try:\n    LayerEventWords.create(sys.argv[1], 0, 4, 3)\n"
            "except EngineKVError as e:\n    print(e); sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, dep], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    raise EngineKVError(done.stdout.strip())


def test_a_dead_runners_word_table_is_removed_with_its_record(dep: str) -> None:
    """A record naming a word table is cleaned up whole when its runner is dead."""
    code = ("import sys, json\nfrom kvtier.worker import kvreg\n"
            "w = kvreg.LayerEventWords.create(sys.argv[1], 0, 2, 2)\nprint(w.name)\n")
    done = subprocess.run([sys.executable, "-c", code, dep], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip()
    assert kvreg.segment_owner(name) not in (None, os.getpid())  # the dead child's
    assert name in kvreg.remove_dead_registrations(dep)
    assert kvreg.segment_owner(name) is None


def test_wait_stream_falls_back_to_the_host_without_layer_events(dep: str) -> None:
    """A CPU registration has no layer events: `wait_stream` waits on the host like `wait`
    (the worker's published progress) and says so by returning False."""
    kv = make_kv(dep, 0, "vllm", "cpu", layers=L, blocks=N, block_size=BS, heads=H,
                 head_dim=D)
    with KVRegistration(dep, 0, kv, "vllm", block_size=BS, num_kv_heads=H, head_dim=D) as reg, \
            ManagerIPC(dep, 1), WorkerIPC(dep, 0) as w0, LayerWaiter(dep, 1) as waiter:
        assert reg.record.layer_events is None and reg.layer_event(3, 0) is None
        with pytest.raises(LayerWaitTimeout):
            waiter.wait_stream(3, 0, 0.05, registration=reg)
        w0.publish_layers_done(3, 1)
        assert waiter.wait_stream(3, 0, 1.0, registration=reg) is False
        assert waiter.wait_stream(3, 0, 1.0) is False
        w0.publish_load_failed(4)
        with pytest.raises(TaskAborted):
            waiter.wait_stream(4, 0, 1.0, registration=reg)


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cuda_layer_events_let_the_compute_stream_wait_without_a_host_sync() -> None:
    """On a GPU: the runner's registration exports layer events; the workers (on cuda:0)
    record them after each layer's copy; `wait_stream` returns True (a GPU-side wait) and a
    kernel enqueued on the waiting stream reads exactly the loaded bytes, with layer copies
    slowed down so a missing wait would read stale zeros."""
    old = os.environ.get(LAYER_DELAY_ENV)
    os.environ[LAYER_DELAY_ENV] = str(DELAY_S * 1000)
    dep = new_deployment_id("ekv")
    try:
        runner = RunnerKV(dep, 2, "vllm", "cuda:0")
        assert all(r.record.layer_events is not None for r in runner.regs)
        cfg = engine_config(dep, KVTIER_WORKERS__DEVICE="cuda", KVTIER_WORKERS__CUDA_DEVICES="0,0")
        with engine_stack(cfg, runner) as stack:
            m = stack.require_manager()
            tokens, want = _host_only(stack, runner)
            with LayerWaiter(dep, 2) as waiter:
                res = m.match("ev", [*tokens, 1])
                seq = res.handle.seq
                assert seq is not None
                stream = torch.cuda.Stream(torch.device("cuda:0"))
                ids = torch.tensor(res.block_ids, device="cuda:0")
                for layer in range(L):
                    for r in range(2):
                        assert waiter.wait_stream(seq, layer, 10, registration=runner.regs[r],
                                                  stream=stream) is True
                with torch.cuda.stream(stream):  # reads after the GPU-side waits
                    got = {r: [p.view(torch.uint8)[ids].clone() for p in runner.regs[r].planes]
                           for r in range(2)}
                stream.synchronize()
                for r in range(2):
                    digests = [[hashlib.sha256(p[i].cpu().numpy().tobytes()).hexdigest()[:16]
                                for p in got[r]] for i in range(len(res.block_ids))]
                    assert digests == want[r], f"rank {r}"
                res.handle.wait(20)
            m.release("ev")
    finally:
        if old is None:
            os.environ.pop(LAYER_DELAY_ENV, None)
        else:
            os.environ[LAYER_DELAY_ENV] = old


# --------------------------------------------------------------------------- trust (issue 27)


def _shm_path(name: str) -> Path:
    return Path("/dev/shm", name.lstrip("/"))


def test_a_record_or_segment_not_private_to_this_user_is_refused(dep: str) -> None:
    """Issue 27, item 4: a registration record or KV segment with mode 0666, or owned by
    another user, was attached (and `kvtier serve` started on it). Only this user's 0600
    names are trusted: anything else is refused in one line naming the name and why."""
    with contextlib.closing(RunnerKV(dep, 1, "vllm", layers=L, blocks=N)):
        name = kvreg.registration_name(dep, 0)
        rec = kvreg.read_record(dep, 0)
        assert rec is not None
        _shm_path(name).chmod(0o666)
        with pytest.raises(EngineKVError, match=rf"{name}: mode 666.*refusing"):
            kvreg.read_record(dep, 0)
        with pytest.raises(EngineKVError, match="mode 666"):
            EnginePool.attach(spec_for(dep), timeout=0.2)
        _shm_path(name).chmod(0o600)
        seg = rec.segments()[0]
        _shm_path(seg).chmod(0o644)
        with pytest.raises(EngineKVError, match=rf"{seg}: mode 644"):
            EnginePool(spec_for(dep), rec)
        _shm_path(seg).chmod(0o600)
        if os.geteuid() == 0:  # only root can give a name to another user
            os.chown(_shm_path(name), 12345, -1)
            with pytest.raises(EngineKVError, match="owned by uid 12345, not this user"):
                kvreg.read_record(dep, 0)
            os.chown(_shm_path(name), 0, -1)
        pool = EnginePool.attach(spec_for(dep), timeout=1)  # private again: attached
        pool.close()


def test_a_record_naming_a_live_pid_that_is_not_its_runner_is_stale(dep: str) -> None:
    """Issue 27, item 4: after a crash the dead runner's pid may be reused by a live
    process; its record then named a live pid, was taken for live, and the restarted runner
    failed with "registered by the running pid ...". The record's owner is the pid and its
    start time: another process under the same pid is not the owner."""
    runner = RunnerKV(dep, 1, "vllm", layers=L, blocks=N)
    rec = kvreg.read_record(dep, 0)
    assert rec is not None
    runner.close()
    # The runner "died" and its pid went to another process: a live one started later.
    other = subprocess.Popen(["sleep", "60"])
    try:
        forged = dataclasses.replace(rec, owner_pid=other.pid)
        kvreg.create_segment(kvreg.registration_name(dep, 0),
                             kvreg.encode_record(forged)).close()
        now = kvreg.read_record(dep, 0)
        assert now is not None and now.owner_pid == other.pid
        assert not now.owner_alive()
        with contextlib.closing(RunnerKV(dep, 1, "vllm", layers=L, blocks=N)):  # taken over
            mine = kvreg.read_record(dep, 0)
            assert mine is not None and mine.owner_pid == os.getpid() and mine.owner_alive()
    finally:
        other.kill()
        other.wait()


def test_a_half_written_record_is_replaced_and_reported_at_once(dep: str) -> None:
    """Issue 27, items 6 and 7: a record its writer left half-written (it died) blocked the
    rank for good (the next runner died with a raw posix_ipc.ExistentialError), and a worker
    waited its whole timeout to report "none was registered". A record is now published
    whole or not at all, so a malformed one is reported at once, naming it, and the next
    runner replaces it."""
    name = kvreg.registration_name(dep, 0)
    kvreg.create_segment(name, b'{"format":"kvtier-engine-kv","version":3,"rank').close()
    t0 = time.monotonic()
    with pytest.raises(EngineKVError, match=f"{name}: not a JSON registration record"):
        EnginePool.attach(spec_for(dep), timeout=5)
    assert time.monotonic() - t0 < 2
    with contextlib.closing(RunnerKV(dep, 1, "vllm", layers=L, blocks=N)):
        pool = EnginePool.attach(spec_for(dep), timeout=1)
        pool.close()


@pytest.mark.slow  # worker processes
def test_a_registration_the_workers_refuse_is_one_line_at_start() -> None:
    """Issue 27, item 7: a registration whose geometry does not match the configuration
    made `Stack.start` (and `kvtier serve`) fail with a 17-line worker traceback. A worker
    refusing to start is one line naming the rank and the field, the traceback in its log."""
    dep = new_deployment_id("ekv")
    runner = RunnerKV(dep, 2, "vllm", blocks=8)  # the configuration says 16 device blocks
    stack = Stack(engine_config(dep), transfer_timeout_s=20)
    try:
        with pytest.raises(WorkerStartError) as e:
            stack.start()
    finally:
        stack.close()
        runner.close()
    message = str(e.value)
    assert len(message.splitlines()) == 1, message
    assert "Traceback" not in message
    assert "num_blocks = 8 in the registration, cache.device_blocks = 16" in message, message
    assert message.startswith("worker rank "), message
    wait_until(lambda: not leftovers(dep, 2), 10, "the deployment leaves nothing")


def test_a_kv_segment_whose_owner_pid_was_reused_is_taken_over(dep: str) -> None:
    """Issue 27, item 4, for KV segments: a dead runner's segment whose pid another process
    now has blocked `shared_kv_tensor` ("in use by pid ...") and was kept by the manager's
    cleanup. Its header names the owner by pid and start time too."""
    name = kvreg.kv_segment_name(dep, 0, "kv")
    mm = kvreg.create_segment(name, size=kvreg.SEGMENT_HEADER_BYTES + 64)
    mm[: len(kvreg.segment_header(0, 0))] = kvreg.segment_header(os.getpid(), 64)
    header = bytearray(mm[:64])
    mm.close()
    other = subprocess.Popen(["sleep", "60"])  # alive, started after this process
    try:
        header[16:24] = other.pid.to_bytes(8, "little")  # the owner pid, as if reused
        with open(_shm_path(name), "r+b") as f:
            f.write(header)
        assert kvreg.segment_owner(name) == other.pid
        assert kvreg.remove_dead_registrations(dep) == [name]  # not the owner: removed
        mm = kvreg.create_segment(name, size=kvreg.SEGMENT_HEADER_BYTES + 64)
        mm[:64] = bytes(header)
        mm.close()
        t = shared_kv_tensor(dep, 0, [4, 8], torch.float16)  # taken over, not "in use"
        assert kvreg.segment_owner(name) == os.getpid() and t.shape == (4, 8)
    finally:
        other.kill()
        other.wait()
        engine_kv._release_segments([name])
