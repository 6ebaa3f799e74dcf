"""Copy engine and diagnostic content, on a real shared-memory host pool.

Every copy is checked byte for byte against a reference computed independently (one page or
one row at a time from the source pool), on every layer and on both K and V, and blocks the
task did not name must stay untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator

import posix_ipc
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.worker import content
from kvtier.worker.copy_engine import LAYER_DELAY_ENV, CopyEngine, plan_copy, wide_dtype
from kvtier.worker.executor import TaskExecutor
from kvtier.worker.fused_copy import fused_unavailable
from kvtier.worker.kv_pools import BlockIdError, DevicePool, HostPool, KVShape
from kvtier.worker.wire import Task, TaskKind
from support import examples, new_segment_name

pytestmark = pytest.mark.fast

# 256-byte rows (complex128 path) and 6-byte rows (int16 path)
SHAPES = {
    "wide": KVShape(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16"),
    "narrow": KVShape(num_layers=3, num_kv_heads=1, head_dim=3, block_size=1, dtype="float16"),
}
DEV_BLOCKS, HOST_BLOCKS = 40, 48
SEGMENT_TAG = "ce"  # every host segment of this module is /kvtier_ce-<pid>x...


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` on the CPU (a copy for a CUDA tensor: compare with it, never write)."""
    return t.contiguous().view(torch.uint8).cpu()


def randomize(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


class Rig:
    """A device pool (on `device`), a host pool in /dev/shm and an engine over them."""

    def __init__(self, shape: KVShape, device: str = "cpu", **engine_kwargs: object) -> None:
        self.shape = shape
        self.name = new_segment_name(SEGMENT_TAG)
        self.dev = DevicePool(shape, DEV_BLOCKS, device)
        self.host = HostPool(shape, HOST_BLOCKS, self.name)
        self.engine = CopyEngine(self.dev, self.host, **engine_kwargs)  # type: ignore[arg-type]

    def close(self) -> None:
        self.host.close()
        assert not os.path.exists("/dev/shm/" + self.name[1:])

    def dev_block(self, b: int) -> torch.Tensor:
        """Block b of every layer, K and V, in page order [L, 2, ...] as bytes."""
        return as_bytes(self.dev.data[:, :, b])

    def host_block(self, h: int) -> torch.Tensor:
        return as_bytes(self.host.kv[h])


# Every rig test runs on the CPU, and on a GPU through the three CUDA copy paths (fused:
# Triton kernels through the mapped host pool, small tasks through CUDA graphs, and
# `fused_ring`: the same with the graphs off, every task through the id ring and Triton's
# dispatch; zero-copy: eager PyTorch kernels through it; staged through pinned buffers).
RIG_PARAMS = [
    *((name, "cpu", "auto") for name in sorted(SHAPES)),
    *(pytest.param((name, "cuda", path), marks=pytest.mark.cuda)
      for name in sorted(SHAPES) for path in ("fused", "fused_ring", "zero_copy", "staged")),
]


@pytest.fixture(params=RIG_PARAMS, ids=lambda p: "-".join(p) if isinstance(p, tuple) else p)
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    name, device, path = request.param
    if path.startswith("fused") and (why := fused_unavailable(torch.device(device))):
        pytest.skip(f"fused copy path: {why}")
    kwargs: dict[str, object] = {"cuda_path": path} if device == "cuda" else {}
    if path == "fused_ring":
        kwargs = {"cuda_path": "fused", "fused_graph_max_ids": 0}
    r = Rig(SHAPES[name], device, **kwargs)
    if device == "cuda":
        assert r.engine.cuda_path == kwargs["cuda_path"]
    yield r
    r.close()


def check_d2h(rig: Rig, src: list[int], dst: list[int]) -> None:
    """Run D2H and compare every host page with a per-block reference."""
    gen = torch.Generator().manual_seed(len(src))
    randomize(rig.dev.data, gen)
    randomize(rig.host.data, gen)
    before = rig.host.data.clone()
    rig.engine.d2h(src, dst)
    want = before.clone()
    for s, d in zip(src, dst, strict=True):
        want[d] = as_bytes(rig.dev.data[:, :, s]).reshape(-1)
    assert torch.equal(rig.host.data, want)


def check_h2d(rig: Rig, src: list[int], dst: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(src) + 1)
    randomize(rig.dev.data, gen)
    randomize(rig.host.data, gen)
    before = as_bytes(rig.dev.data).clone()
    seen: list[int] = []
    rig.engine.h2d(src, dst, seen.append)
    assert seen == list(range(rig.shape.num_layers))
    want = before.clone()
    for s, d in zip(src, dst, strict=True):
        want[:, :, d] = as_bytes(rig.host.kv[s])
    assert torch.equal(as_bytes(rig.dev.data), want)


# ---------------------------------------------------------------- planning


def test_wide_dtype_divides_row() -> None:
    assert wide_dtype(256) is torch.complex128
    assert wide_dtype(24) is torch.int64
    assert wide_dtype(6) is torch.int16
    assert wide_dtype(3) is torch.uint8


def test_plan_copy_runs_and_gathers() -> None:
    src = torch.tensor([5, 6, 7, 1, 2, 9])
    dst = torch.tensor([10, 11, 12, 3, 9, 0])
    plan = plan_copy(src, dst, unit_bytes=100, min_run_bytes=0)
    runs = sorted(zip(plan.run_src, plan.run_dst, plan.run_len, strict=True))
    assert runs == [(1, 3, 1), (2, 9, 1), (5, 10, 3), (9, 0, 1)]
    assert plan.gather_src.numel() == 0
    plan = plan_copy(src, dst, unit_bytes=100, min_run_bytes=300)
    assert list(zip(plan.run_src, plan.run_dst, plan.run_len, strict=True)) == [(5, 10, 3)]
    assert sorted(zip(plan.gather_src.tolist(), plan.gather_dst.tolist(), strict=True)) == [
        (1, 3),
        (2, 9),
        (9, 0),
    ]
    plan = plan_copy(src, dst, unit_bytes=100, min_run_bytes=float("inf"))
    assert plan.run_len == [] and plan.gather_src.numel() == 6
    assert plan_copy(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64),
                     1, 0).num_pairs == 0


def id_patterns(n_src: int, n_dst: int) -> st.SearchStrategy[tuple[list[int], list[int]]]:
    """Adversarial (src, dst) pairs: random permutations, consecutive runs broken at random
    points, reversed ranges, duplicated sources, and mixtures of those."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[list[int], list[int]]:
        n = draw(st.integers(0, min(n_src, n_dst)))
        kind = draw(st.sampled_from(["random", "runs", "reversed", "dup_src", "mixed"]))
        rnd = draw(st.randoms(use_true_random=False))
        dst = rnd.sample(range(n_dst), n)
        if kind == "random":
            src = rnd.sample(range(n_src), n)
        elif kind == "runs":
            # consecutive on both sides, cut into segments whose destinations are shuffled:
            # runs break exactly at the cuts
            s0, d0 = rnd.randrange(n_src - n + 1), rnd.randrange(n_dst - n + 1)
            cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randrange(4)))) if n > 1 else []
            bounds = [0, *cuts, n]
            segs = [range(d0 + a, d0 + b) for a, b in itertools.pairwise(bounds)]
            rnd.shuffle(segs)
            src, dst = list(range(s0, s0 + n)), [d for seg in segs for d in seg]
        elif kind == "reversed":
            s0, d0 = rnd.randrange(n_src - n + 1), rnd.randrange(n_dst - n + 1)
            src, dst = list(range(s0 + n - 1, s0 - 1, -1)), list(range(d0, d0 + n))
        elif kind == "dup_src":
            src = [rnd.randrange(min(3, n_src)) for _ in range(n)]
        else:
            src = []
            while len(src) < n:
                start = rnd.randrange(n_src)
                length = rnd.randrange(1, 6)
                src.extend(x % n_src for x in range(start, start + length))
            src = src[:n]
            dst = sorted(dst) if rnd.random() < 0.5 else dst
        return src, dst

    return build()


@settings(max_examples=examples(150), deadline=None)
@given(pairs=id_patterns(DEV_BLOCKS, HOST_BLOCKS), min_run=st.sampled_from([0, 2, 3, 10**9]))
def test_plan_covers_every_pair_once(pairs: tuple[list[int], list[int]], min_run: int) -> None:
    src, dst = pairs
    plan = plan_copy(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64),
                     unit_bytes=1, min_run_bytes=min_run)
    got = list(zip(plan.gather_src.tolist(), plan.gather_dst.tolist(), strict=True))
    for s0, d0, k in zip(plan.run_src, plan.run_dst, plan.run_len, strict=True):
        assert k >= min_run
        got.extend((s0 + i, d0 + i) for i in range(k))
    assert sorted(got) == sorted(zip(src, dst, strict=True))


# ---------------------------------------------------------------- byte-exact round trips


@pytest.mark.parametrize("strategy", ["auto", "runs", "gather"])
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_round_trip_to_other_device_ids(strategy: str, shape_name: str) -> None:
    """Device -> host -> other device ids: byte-identical on every layer, K and V."""
    r = Rig(SHAPES[shape_name], strategy=strategy, stage_bytes=3 * SHAPES[shape_name].page_bytes)
    try:
        gen = torch.Generator().manual_seed(7)
        randomize(r.dev.data, gen)
        original = as_bytes(r.dev.data).clone()
        n = 25
        dev_ids = torch.randperm(DEV_BLOCKS, generator=gen)[:n].tolist()
        host_ids = torch.randperm(HOST_BLOCKS, generator=gen)[:n].tolist()
        r.engine.d2h(dev_ids, host_ids)
        for d, h in zip(dev_ids, host_ids, strict=True):
            assert torch.equal(r.host_block(h), original[:, :, d])
        randomize(r.dev.data, gen)  # the device forgets everything
        others = torch.randperm(DEV_BLOCKS, generator=gen)[:n].tolist()
        r.engine.h2d(host_ids, others)
        for d_old, d_new in zip(dev_ids, others, strict=True):
            for layer in range(r.shape.num_layers):
                assert torch.equal(as_bytes(r.dev.k_caches[layer][d_new]),
                                   original[layer, 0, d_old]), (layer, "K")
                assert torch.equal(as_bytes(r.dev.v_caches[layer][d_new]),
                                   original[layer, 1, d_old]), (layer, "V")
        assert r.engine.bytes_d2h == r.engine.bytes_h2d == n * r.shape.page_bytes
    finally:
        r.close()


@pytest.mark.parametrize("strategy", ["auto", "runs", "gather"])
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_adversarial_id_patterns(strategy: str, shape_name: str) -> None:
    """Small thresholds so that runs and gathers mix within one task."""
    shape = SHAPES[shape_name]
    r = Rig(shape, strategy=strategy, stage_bytes=2 * shape.page_bytes,
            d2h_min_run_bytes=2 * shape.page_bytes, h2d_min_run_bytes=3 * shape.layer_bytes)

    @settings(max_examples=examples(40), deadline=None)
    @given(pairs=id_patterns(DEV_BLOCKS, HOST_BLOCKS))
    def d2h_case(pairs: tuple[list[int], list[int]]) -> None:
        check_d2h(r, *pairs)

    @settings(max_examples=examples(40), deadline=None)
    @given(pairs=id_patterns(HOST_BLOCKS, DEV_BLOCKS))
    def h2d_case(pairs: tuple[list[int], list[int]]) -> None:
        check_h2d(r, *pairs)

    try:
        d2h_case()
        h2d_case()
    finally:
        r.close()


def test_tensor_ids_and_full_pool(rig: Rig) -> None:
    src = torch.randperm(DEV_BLOCKS)
    dst = torch.randperm(HOST_BLOCKS)[:DEV_BLOCKS].to(torch.int32)
    check_d2h(rig, src.tolist(), dst.tolist())
    # New device bytes, so the copy with tensor ids has to move them (after the list copy
    # above the host already held the old ones: comparing those proved nothing).
    randomize(rig.dev.data, torch.Generator().manual_seed(99))
    rig.engine.d2h(src, dst)  # tensors accepted as well as lists
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        assert torch.equal(rig.host_block(d), rig.dev_block(s))


# ---------------------------------------------------------------- layer by layer


def test_layer_callbacks_fire_in_order_as_each_layer_lands(rig: Rig) -> None:
    L = rig.shape.num_layers
    gen = torch.Generator().manual_seed(3)
    randomize(rig.host.data, gen)
    rig.dev.data.zero_()
    src, dst = [5, 6, 1, 30], [0, 1, 2, 39]
    observed: list[tuple[int, bool, bool]] = []

    def on_layer(layer: int) -> None:
        here = all(
            torch.equal(as_bytes(rig.dev.data[layer, :, d]), as_bytes(rig.host.kv[s, layer]))
            for s, d in zip(src, dst, strict=True)
        )
        last = all(
            torch.equal(as_bytes(rig.dev.data[L - 1, :, d]), as_bytes(rig.host.kv[s, L - 1]))
            for s, d in zip(src, dst, strict=True)
        )
        observed.append((layer, here, last))

    rig.engine.h2d(src, dst, on_layer)
    assert [o[0] for o in observed] == list(range(L))
    assert all(o[1] for o in observed), "a callback fired before its layer was copied"
    assert observed[0][2] is False, "layer 0 was released only after the last layer landed"
    assert observed[-1][2] is True


def test_empty_load_still_releases_every_layer(rig: Rig) -> None:
    seen: list[int] = []
    rig.engine.h2d([], [], seen.append)
    assert seen == list(range(rig.shape.num_layers))
    rig.engine.d2h([], [])


def test_layer_delay_hook_separates_first_and_last_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    delay_ms = 40
    monkeypatch.setenv(LAYER_DELAY_ENV, str(delay_ms))
    r = Rig(SHAPES["wide"])
    monkeypatch.delenv(LAYER_DELAY_ENV)  # read once, at construction
    try:
        assert r.engine.layer_delay_s == pytest.approx(delay_ms / 1000)
        first = threading.Event()
        released_at: list[float] = []

        def waiter() -> None:
            if first.wait(timeout=10):
                released_at.append(time.monotonic())

        t = threading.Thread(target=waiter)
        t.start()
        start = time.monotonic()
        r.engine.h2d([1, 2], [3, 4], lambda layer: first.set() if layer == 0 else None)
        end = time.monotonic()
        t.join(timeout=10)
        L = r.shape.num_layers
        assert released_at, "waiter on layer 0 was never released"
        assert end - start >= L * delay_ms / 1000 * 0.9
        assert end - released_at[0] >= (L - 1) * delay_ms / 1000 * 0.9
    finally:
        r.close()


def test_layer_delay_env_must_be_a_number(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LAYER_DELAY_ENV, "soon")
    with (
        HostPool(SHAPES["wide"], 2, new_segment_name(SEGMENT_TAG)) as host,
        pytest.raises(ValueError, match=f"{LAYER_DELAY_ENV}: 'soon'"),
    ):
        CopyEngine(DevicePool(SHAPES["wide"], 2, "cpu"), host)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("op", "src", "dst", "message"),
    [
        ("d2h", [1, 2], [3], "d2h: 2 device ids but 1 host ids"),
        ("d2h", [1, DEV_BLOCKS], [3, 4], f"d2h: device ids: block id {DEV_BLOCKS} out of range"),
        ("d2h", [1, 2], [3, HOST_BLOCKS], f"host ids: block id {HOST_BLOCKS} out of range"),
        ("d2h", [1, 2], [-1, 4], "host ids: block id -1 out of range"),
        ("d2h", [1, 2, 3], [7, 8, 7], "d2h: host ids: block id 7 appears more than once"),
        ("h2d", [1, 2], [5, 5], "h2d: device ids: block id 5 appears more than once"),
        ("h2d", [HOST_BLOCKS], [5], f"h2d: host ids: block id {HOST_BLOCKS} out of range"),
        ("h2d", [1.5], [5], "integers"),
    ],
)
def test_bad_ids_are_rejected_before_any_copy(
    rig: Rig, op: str, src: list[int], dst: list[int], message: str
) -> None:
    gen = torch.Generator().manual_seed(11)
    randomize(rig.dev.data, gen)
    randomize(rig.host.data, gen)
    dev_before, host_before = as_bytes(rig.dev.data).clone(), rig.host.data.clone()
    seen: list[int] = []
    with pytest.raises(BlockIdError, match=message):
        if op == "d2h":
            rig.engine.d2h(src, dst)
        else:
            rig.engine.h2d(src, dst, seen.append)
    assert seen == []
    assert torch.equal(as_bytes(rig.dev.data), dev_before)
    assert torch.equal(rig.host.data, host_before)


def test_ids_checked_ahead_copy_alike_and_are_rechecked_for_another_engine() -> None:
    """A worker checks a task's ids on receipt (`CopyEngine.check`) and copies them later
    (`d2h_checked`, `h2d_checked`); ids checked against a larger pool are checked again
    by the engine that copies them, with the same one-line error."""
    big = Rig(SHAPES["wide"], "cpu")
    small_host = HostPool(SHAPES["wide"], 2, new_segment_name(SEGMENT_TAG))
    try:
        small = CopyEngine(DevicePool(SHAPES["wide"], 2, "cpu"), small_host)
        gen = torch.Generator().manual_seed(3)
        randomize(big.dev.data, gen)
        ids = big.engine.check("d2h", [2, 0], [1, 3])
        assert len(ids) == 2
        big.engine.d2h_checked(ids)
        assert torch.equal(big.host_block(1), big.dev_block(2))
        assert torch.equal(big.host_block(3), big.dev_block(0))
        seen: list[int] = []
        big.engine.h2d_checked(big.engine.check("h2d", [3], [4]), seen.append)
        assert seen == list(range(big.shape.num_layers))
        assert torch.equal(big.dev_block(4), big.host_block(3))
        with pytest.raises(BlockIdError, match="d2h: device ids: block id 2 out of range"):
            small.d2h_checked(ids)
        backup = big.engine.check("d2h", [0], [45])
        with pytest.raises(BlockIdError, match="h2d: device ids: block id 45 out of range"):
            big.engine.h2d_checked(backup)  # a backup's ids handed to a load: checked as such
    finally:
        big.close()
        small_host.close()


def test_worker_checks_ids_on_receipt_and_its_lane_copies_them_unchecked() -> None:
    """`TaskExecutor.precheck` (the receiver thread) leaves a task's checked ids for its
    lane; bad ids leave nothing and the lane's copy fails with the same one-line error;
    a merged batch is checked whole (two tasks naming one destination)."""
    rig = Rig(SHAPES["wide"], "cpu")
    try:
        ex = TaskExecutor(0, rig.dev, rig.host, None)
        randomize(rig.dev.data, torch.Generator().manual_seed(5))
        good = Task(1, TaskKind.D2H, src=[3, 4], dst=[7, 8])
        ex.precheck(good)
        assert list(ex._checked) == [1]
        assert ex.device_batch(TaskKind.D2H, [good]) == [(0, [])]
        assert not ex._checked  # taken by the lane
        assert torch.equal(rig.host_block(7), rig.dev_block(3))
        bad = Task(2, TaskKind.H2D, src=[HOST_BLOCKS], dst=[1])
        ex.precheck(bad)
        assert not ex._checked
        with pytest.raises(BlockIdError, match=f"h2d: host ids: block id {HOST_BLOCKS} out"):
            ex.device_batch(TaskKind.H2D, [bad])
        a, b = Task(3, TaskKind.D2H, [1], [9]), Task(4, TaskKind.D2H, [2], [9])
        ex.precheck(a)
        ex.precheck(b)
        with pytest.raises(BlockIdError, match="block id 9 appears more than once"):
            ex.device_batch(TaskKind.D2H, [a, b])
        assert not ex._checked
    finally:
        rig.close()


def test_engine_rejects_mismatched_pools_and_strategy() -> None:
    with HostPool(SHAPES["wide"], 2, new_segment_name(SEGMENT_TAG)) as host:
        with pytest.raises(ValueError, match="differs from host pool shape"):
            CopyEngine(DevicePool(SHAPES["narrow"], 2, "cpu"), host)
        with pytest.raises(ValueError, match="strategy: 'fast'"):
            CopyEngine(DevicePool(SHAPES["wide"], 2, "cpu"), host, strategy="fast")  # type: ignore[arg-type]


# ---------------------------------------------------------------- diagnostic content


def keys_for(n: int, salt: bytes = b"") -> list[bytes]:
    return [salt + i.to_bytes(16, "little") for i in range(n)]


def test_content_fill_check_round_trip_through_host(rig: Rig) -> None:
    keys = keys_for(10)
    ids = [3, 9, 0, 17, 22, 5, 6, 7, 38, 39]
    content.fill(rig.dev, ids, keys, rank=1)
    assert content.check(rig.dev, ids, keys, rank=1) == []
    assert content.check(rig.dev, ids, keys, rank=0) == list(range(10))  # rank matters
    assert content.check(rig.dev, ids, keys[1:] + keys[:1], rank=1) == list(range(10))
    hosts = list(range(20, 30))
    rig.engine.d2h(ids, hosts)
    assert content.check(rig.host, hosts, keys, rank=1) == []  # host pool checks too
    rig.dev.data.zero_()
    others = [30, 31, 32, 33, 34, 1, 2, 8, 10, 11]
    rig.engine.h2d(hosts, others)
    assert content.check(rig.dev, others, keys, rank=1) == []


@pytest.mark.parametrize("where", ["first K byte", "last V byte", "middle"])
def test_content_detects_a_single_flipped_byte(rig: Rig, where: str) -> None:
    keys = keys_for(4, b"flip")
    ids = [10, 11, 12, 13]
    content.fill(rig.dev, ids, keys, rank=0)
    L = rig.shape.num_layers
    if where == "first K byte":
        target = rig.dev.data[0, 0, 12].reshape(-1).view(torch.uint8)[:1]
    elif where == "last V byte":
        target = rig.dev.data[L - 1, 1, 12].view(-1)[-1:].view(torch.uint8)[-1:]
    else:
        target = rig.dev.data[L // 2, 1, 12].view(-1).view(torch.uint8)[3:4]
    target ^= 0x10
    assert content.check(rig.dev, ids, keys, rank=0) == [2]


def write_page_prefix(rig: Rig, page: torch.Tensor, block: int, nbytes: int) -> None:
    """Copy the first `nbytes` of a page_first page into device block `block`, row by row."""
    k = rig.shape.k_bytes
    for row in range(2 * rig.shape.num_layers):
        lo = row * k
        take = min(k, nbytes - lo)
        if take <= 0:
            break
        dest = rig.dev.data[row // 2, row % 2, block].view(-1).view(torch.uint8)
        dest[:take].copy_(page[lo : lo + take])


def test_content_detects_half_copied_and_misplaced_blocks(rig: Rig) -> None:
    L = rig.shape.num_layers
    keys = keys_for(3, b"half")
    content.fill(rig.dev, [0, 1, 2], keys, rank=0)
    rig.engine.d2h([0], [5])
    # "load" page 5 into block 7 but stop halfway through the page
    write_page_prefix(rig, rig.host.data[5], 7, rig.shape.page_bytes // 2)
    assert content.check(rig.dev, [7], [keys[0]], 0) == [0]
    rig.engine.h2d([5], [7])
    assert content.check(rig.dev, [7], [keys[0]], 0) == []
    # K and V swapped in one layer, or one layer's bytes duplicated into the next
    rig.dev.data[0, :, 1] = rig.dev.data[0, :, 1].flip(0).clone()
    if L > 1:
        rig.dev.data[1, :, 2] = rig.dev.data[0, :, 2]
    assert content.check(rig.dev, [0, 1, 2], keys, 0) == ([1, 2] if L > 1 else [1])


def test_content_differs_everywhere_between_keys_layers_and_kv() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=4, head_dim=64, block_size=8, dtype="bfloat16")
    pool = DevicePool(shape, 3, "cpu")
    content.fill(pool, [0, 1], [b"key-a", b"key-b"], rank=0)
    a, b = as_bytes(pool.data[:, :, 0]), as_bytes(pool.data[:, :, 1])
    k0, v0, k1 = a[0, 0].view(-1), a[0, 1].view(-1), a[1, 0].view(-1)
    for x, y in [(a.view(-1), b.view(-1)), (k0, v0), (k0, k1)]:
        equal = (x == y).float().mean().item()
        assert equal < 0.02, equal  # random-like: ~1/256 of bytes coincide
        assert bool((x.view(-1, 8) != y.view(-1, 8)).any(1).all())  # every 8-byte word differs
    # positions: the per-key pattern is not simply repeated along the row, so a correct chunk
    # landing at the wrong offset inside a block does not match
    row = k0.view(-1, 512)
    assert row.shape[0] >= 2
    assert not torch.equal(row[0], row[1])
    assert bool((row[0] != row[1]).float().mean() > 0.9)


def test_content_validation(rig: Rig) -> None:
    with pytest.raises(BlockIdError, match="fill: 2 block ids but 1 keys"):
        content.fill(rig.dev, [0, 1], [b"k"], rank=0)
    with pytest.raises(BlockIdError, match="fill: block ids: block id 1 appears more than once"):
        content.fill(rig.dev, [1, 1], [b"a", b"b"], rank=0)
    with pytest.raises(BlockIdError, match="out of range"):
        content.check(rig.dev, [DEV_BLOCKS], [b"a"], rank=0)
    with pytest.raises(ValueError, match="key 0 must be non-empty bytes"):
        content.fill(rig.dev, [0], [""], rank=0)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="rank"):
        content.check(rig.dev, [0], [b"a"], rank=-1)
    assert content.check(rig.dev, [], [], rank=0) == []


def test_content_is_fast_enough() -> None:
    """Not a timing benchmark: a guard against an accidental per-element Python path.
    32 MiB of blocks must fill and check well within a second each."""
    shape = KVShape(num_layers=8, num_kv_heads=4, head_dim=128, block_size=16, dtype="float16")
    pool = DevicePool(shape, 300, "cpu")
    ids = torch.randperm(300)[:256].tolist()
    keys = keys_for(256)
    t0 = time.perf_counter()
    content.fill(pool, ids, keys, rank=0)
    t1 = time.perf_counter()
    assert content.check(pool, ids, keys, rank=0) == []
    t2 = time.perf_counter()
    assert t1 - t0 < 2.0 and t2 - t1 < 2.0, (t1 - t0, t2 - t1)


def test_no_segment_leaks_from_this_module() -> None:
    prefix = f"kvtier_{SEGMENT_TAG}-{os.getpid()}x"
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
    for n in leftovers:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + n)
    assert leftovers == []


def test_a_pending_load_holds_a_cpu_backup_between_steps() -> None:
    """While a load is pending on the engine's gate, a D2H finishes at most the step it is
    in and then waits; once the load is answered it completes, every page exact. A load
    meanwhile never waits for the backup."""
    shape = SHAPES["wide"]
    rig = Rig(shape, backup_step_bytes=shape.page_bytes)  # one block per step
    try:
        gen = torch.Generator().manual_seed(3)
        randomize(rig.dev.data, gen)
        rig.host.data.zero_()
        gate = rig.engine.gate
        gate.enter()  # a load the worker has received and not answered yet
        src, dst = list(range(0, 32, 2)), list(range(16))  # strided: one step per block
        backup = threading.Thread(target=rig.engine.d2h, args=(src, dst))
        backup.start()
        time.sleep(0.3)
        assert backup.is_alive(), "the backup ran while a load was pending"
        landed = [h for h in dst if rig.host_block(h).any()]
        assert len(landed) <= 1, f"{len(landed)} backup steps ran while a load was pending"
        t0 = time.monotonic()
        rig.engine.h2d([40, 41], [38, 39])  # the load itself goes through at once
        assert time.monotonic() - t0 < 0.25 and backup.is_alive()
        gate.exit()
        backup.join(10)
        assert not backup.is_alive()
        for s, h in zip(src, dst, strict=True):
            assert torch.equal(rig.host_block(h), rig.dev_block(s))
    finally:
        rig.close()
