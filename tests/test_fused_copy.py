"""The fused gather-scatter path (`kvtier.worker.fused_copy`): its launch geometry on any
machine, and its kernel's indexing against PyTorch on the CPU through Triton's interpreter
where Triton is installed (it ships in CUDA builds of torch, not in the CPU one this
project's venv holds: then that check is skipped and says why). On a GPU the copy engine's
own tests run the fused path byte for byte (`tests/test_copy_engine.py`, `fused` rigs;
`tests/test_scales_extra_layers.py`, scales and extra layers; `scripts/gpu-check.sh`)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from kvtier.worker.fused_copy import (
    FUSED_ENV,
    IdRing,
    element_dtype,
    fused_unavailable,
    graph_cap,
    launch_shape,
    layer_groups,
)

pytestmark = pytest.mark.fast

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def test_element_is_the_widest_that_divides_row_addresses_and_strides() -> None:
    assert element_dtype(4096, 0, 8192, 65536) is torch.int32
    assert element_dtype(4096, 2) is torch.int16  # one address only 2-aligned
    assert element_dtype(6, 0) is torch.int16  # the "narrow" rig's 6-byte rows
    assert element_dtype(4096, -3) is torch.uint8  # a V plane 3 bytes before its K plane


@pytest.mark.parametrize(("row", "es", "block", "warps", "even"), [
    (2048, 4, 2048, 4, True),     # 8 KiB rows: one program per row, 4 warps
    (8192, 4, 2048, 4, True),     # 32 KiB rows: four programs, no mask
    (40, 4, 64, 1, False),        # short rows: one small masked program
    (3, 2, 4, 1, False),          # the narrow rig: 6 bytes
    (16, 4, 16, 1, True),
])
def test_launch_shape_fits_block_and_warps_to_the_row(
        row: int, es: int, block: int, warps: int, even: bool) -> None:
    assert launch_shape(row, es) == (block, warps, even)


def test_launch_shape_honours_a_smaller_program() -> None:
    block, warps, even = launch_shape(2048, 4, block_bytes=2048)
    assert (block, warps, even) == (512, 1, True)


def test_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FUSED_ENV, "0")
    assert fused_unavailable(torch.device("cuda")) == f"{FUSED_ENV}=0"
    monkeypatch.delenv(FUSED_ENV)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    why = fused_unavailable(torch.device("cpu"))
    assert why in ("Triton is not installed", "device cpu is not CUDA")


@pytest.mark.parametrize(("layers", "groups"), [
    (1, [(0, 1)]),
    (2, [(0, 1), (1, 2)]),
    (5, [(0, 1), (1, 2), (2, 4), (4, 5)]),
    (33, [(0, 1), (1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 33)]),
])
def test_load_groups_start_with_layer_zero_alone_and_double(
        layers: int, groups: list[tuple[int, int]]) -> None:
    assert layer_groups(layers) == groups


@pytest.mark.parametrize(("n", "limit", "cap"), [
    (1, 256, 16), (16, 256, 16), (17, 256, 32), (64, 256, 64), (65, 256, 128),
    (256, 256, 256), (257, 256, 0), (0, 256, 0), (8, 0, 0)])
def test_graph_sizes_pad_to_a_power_of_two_up_to_the_limit(n: int, limit: int,
                                                            cap: int) -> None:
    assert graph_cap(n, limit) == cap


def test_id_ring_reuses_rows_and_grows() -> None:
    ring = IdRing(torch.device("cpu"), slots=2, cap=4)
    a = ring.put(torch.tensor([1, 2]), torch.tensor([3, 4]), None)
    assert a.tolist() == [1, 2, 3, 4]
    b = ring.put(torch.arange(6), torch.arange(6, 12), None)  # over cap: grows
    assert ring.cap == 8 and b.tolist() == list(range(12))
    c = ring.put(torch.tensor([9]), torch.tensor([8]), None)
    assert c.tolist() == [9, 8]


@pytest.mark.cuda
@pytest.mark.skipif(not HAVE_TRITON or not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (and Triton)")
def test_ring_rows_on_cuda_hold_each_tasks_ids_through_reuse_and_growth() -> None:
    """Two slots reused ten times each, then grown: every task's kernel (a clone on the
    stream) reads that task's ids, never a later task's (the host row is rewritten only
    after its DMA completed)."""
    dev = torch.device("cuda")
    ring = IdRing(dev, slots=2, cap=4)
    stream = torch.cuda.Stream(dev)
    outs = []
    with torch.cuda.stream(stream):
        for i in range(20):
            ids = ring.put(torch.tensor([i, i + 1]), torch.tensor([i + 2, i + 3]), stream)
            assert ids.device.type == "cuda"
            outs.append(ids.clone())  # a kernel reading the row, ordered on the stream
        big = ring.put(torch.arange(9), torch.arange(9, 18), stream)  # grows past cap
        outs.append(big.clone())
    stream.synchronize()
    want = [[i, i + 1, i + 2, i + 3] for i in range(20)] + [list(range(18))]
    assert [o.tolist() for o in outs] == want


# The interpreter run: kvtier's own pool and an engine's planes, pages with a scale trailer
# (the page stride is not the K/V bytes), extra layers, rows that are and are not a whole
# number of programs, a V plane in another allocation than its K plane. Every copy is
# compared with PyTorch indexing; rows the task did not name must be untouched.
INTERPRETED = textwrap.dedent("""
    import torch
    from kvtier.worker.fused_copy import IdRing, plane_launches, pool_launches
    from kvtier.worker.kv_pools import KVShape, page_kv_view

    gen = torch.Generator().manual_seed(7)
    ring = IdRing(torch.device("cpu"))

    def rand(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    cases = [
        # layers, heads, head_dim, block, dtype, extra, scales, block_bytes
        (3, 2, 16, 4, "float16", 0, False, 0),
        (2, 1, 3, 1, "float16", 1, True, 0),     # 6-byte rows, masked, a scale trailer
        (2, 2, 8, 8, "float32", 1, True, 256),   # 512-byte rows in two programs each
    ]
    import kvtier.worker.fused_copy as fc
    # every case in both grid orders (KVTIER_FUSED_ORDER: pair-major and page-major)
    for order, (layers, heads, hd, bs, dtype, extra, scales, bb) in [
            (o, c) for o in ("pair", "page") for c in cases]:
        fc.FUSED_ORDER = order
        shape = KVShape(layers, heads, hd, bs, dtype, num_extra_layers=extra,
                        kv_scales=scales)
        L, row_bytes = shape.total_layers, shape.k_bytes
        blocks, npages = 9, 11
        dev = rand(L, 2, blocks, row_bytes)
        pages_raw = rand(npages, shape.page_bytes)
        pages = page_kv_view(pages_raw, shape, torch.uint8)
        assert pages.shape == (npages, L, 2, row_bytes)
        src, dst = torch.tensor([4, 0, 8, 2]), torch.tensor([10, 3, 0, 7])
        n = len(src)
        fc.FUSED_BLOCK_BYTES = bb or fc.FUSED_BLOCK_BYTES
        d2h, h2d = pool_launches(dev, pages, row_bytes)
        # backup: device blocks src -> pages dst, every layer in one launch
        want = pages_raw.clone()
        page_kv_view(want, shape, torch.uint8)[dst] = dev[:, :, src].permute(2, 0, 1, 3)
        d2h.run(ring.put(src, dst, None), n)
        assert torch.equal(pages_raw, want), ("d2h", order, shape)
        # load: pages dst -> device blocks (a permutation), layer by layer
        back = torch.tensor([5, 1, 6, 3])
        want_dev = dev.clone()
        want_dev[:, :, back] = pages[dst].permute(1, 2, 0, 3)
        ids = ring.put(dst, back, None)
        for _first, _end, launch in h2d:  # layer groups 1, 1, 2, ...
            launch.run(ids, n)
        assert torch.equal(dev, want_dev), ("h2d", shape)
        # a graph's padded row (size 8: pairs 4..7 have source -1 and move nothing; their
        # destination slots hold ids a stray write would be seen at)
        want_dev = dev.clone()
        want_dev[:, :, dst[:2] - 2] = pages[src[:2]].permute(1, 2, 0, 3)
        row = torch.tensor([*src[:2].tolist(), -1, -1, -1, -1, -1, -1,
                            *(dst[:2] - 2).tolist(), 0, 1, 2, 4, 5, 6])
        for _first, _end, launch in h2d:
            launch.run(row, 8, padded=True)
        assert torch.equal(dev, want_dev), ("padded h2d", order, shape)
        # an engine's planes: K planes in one allocation, V planes in another
        ks, vs = rand(L, blocks, row_bytes), rand(L, blocks, row_bytes)
        planes = [p for layer in range(L) for p in (ks[layer], vs[layer])]
        to_pages = plane_launches(planes, pages, row_bytes, to_device=False)
        to_planes = plane_launches(planes, pages, row_bytes, to_device=True)
        assert to_pages is not None and to_planes is not None
        want = pages.clone()
        want[dst] = torch.stack([ks[:, src], vs[:, src]], 1).permute(2, 0, 1, 3)
        ids = ring.put(src, dst, None)
        for launch in to_pages:
            launch.run(ids, n)
        assert torch.equal(pages, want), ("planes d2h", shape)
        want_k, want_v = ks.clone(), vs.clone()
        want_k[:, back], want_v[:, back] = pages[dst, :, 0].transpose(0, 1), \\
            pages[dst, :, 1].transpose(0, 1)
        ids = ring.put(dst, back, None)
        for launch in to_planes:
            launch.run(ids, n)
        assert torch.equal(ks, want_k) and torch.equal(vs, want_v), ("planes h2d", shape)
        # a K and V plane with different block strides: not the kernel's model
        odd = [ks[0], vs[0][:, :-1] if row_bytes > 1 else vs[0]]
        odd[1] = torch.empty(blocks, row_bytes + 16, dtype=torch.uint8)[:, :row_bytes]
        assert plane_launches(odd, pages[:, :1], row_bytes, to_device=True) is None
    print("interpreted fused copies: ok")
""")


@pytest.mark.skipif(not HAVE_TRITON, reason="Triton is not installed (CPU torch does not "
                    "bring it); the interpreter check runs where it is")
def test_kernel_indexing_matches_torch_under_the_interpreter() -> None:
    """Break check: swap `s_kv` and `d_kv` in `_move_rows` (the V row read from the K row's
    offset) and this fails at the first case's backup; swap `plane` and `chunk` in the
    page order's decode and it fails at the first page-order case with two programs a row."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "interpreted fused copies: ok" in run.stdout
