"""The engine-side host-pool copier (`kvtier.engine.host_copier.HostCopier`) on the CPU, over a
real shared-memory host pool: a store then a load through the numpy row path gives back every
byte, in the page layout the torch index path (the CUDA path's kernels, run here on the CPU)
writes; a group with fewer layers than the page zeroes the rest; a replaced segment is never
touched."""

from __future__ import annotations

import os
import resource

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.engine.host_copier import HostCopier
from kvtier.worker.kv_pools import HostPool, KVShape
from support import examples

pytestmark = pytest.mark.fast

SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
DEV_BLOCKS, HOST_BLOCKS = 16, 12


def engine_kv(layers: int, seed: int) -> list[torch.Tensor]:
    """An engine's KV of `layers` layers as the adapter registers it: uint8 [blocks,
    layer_bytes] views (here of a wider tensor, as vLLM's are)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        t = torch.randint(0, 256, (DEV_BLOCKS, SHAPE.layer_bytes + 16), dtype=torch.uint8,
                          generator=g)
        out.append(t[:, : SHAPE.layer_bytes])
    return out


@pytest.fixture()
def pool() -> HostPool:
    p = HostPool(SHAPE, HOST_BLOCKS, f"/kvtier_test_copier_{os.getpid()}")
    yield p
    p.close()


def page_layers(pool: HostPool, h: int) -> np.ndarray:
    kv_bytes = SHAPE.num_layers * SHAPE.layer_bytes
    return pool.data[h, :kv_bytes].view(SHAPE.num_layers, SHAPE.layer_bytes).numpy()


@settings(max_examples=examples(40), deadline=None)
@given(data=st.data())
def test_a_store_then_a_load_gives_back_every_byte(data: st.DataObject) -> None:
    p = HostPool(SHAPE, HOST_BLOCKS, f"/kvtier_test_copier_h{os.getpid()}")
    try:
        n = data.draw(st.integers(1, HOST_BLOCKS))
        dev = np.array(data.draw(st.permutations(range(DEV_BLOCKS)))[:n], dtype=np.int64)
        host = np.array(data.draw(st.permutations(range(HOST_BLOCKS)))[:n], dtype=np.int64)
        src = engine_kv(SHAPE.num_layers, seed=1)
        copier = HostCopier([src], SHAPE)
        assert copier.copy(1, dev, host, [n], p.name, p.inode, store=True)
        for d, h in zip(dev, host, strict=True):
            for layer in range(SHAPE.num_layers):
                assert np.array_equal(page_layers(p, h)[layer], src[layer][d].numpy())
        dst = engine_kv(SHAPE.num_layers, seed=2)
        untouched = [t.clone() for t in dst]
        back = HostCopier([dst], SHAPE)
        assert back.copy(2, dev, host, [n], p.name, p.inode, store=False)
        for layer in range(SHAPE.num_layers):
            for b in range(DEV_BLOCKS):
                want = src[layer][b] if b in dev else untouched[layer][b]
                assert torch.equal(dst[layer][b], want), (layer, b)
        assert [j for j, _, _ in copier.finished()] == [1]
        copier.close()
        back.close()
    finally:
        p.close()


def test_the_cpu_path_writes_the_pages_the_index_path_writes(pool: HostPool) -> None:
    """The numpy rows and torch's index kernels (the CUDA path's) agree byte for byte, a
    one-layer group zeroing the page's other slots in both."""
    src = engine_kv(1, seed=3)
    copier = HostCopier([src], SHAPE)
    dev = np.array([5, 0, 9], dtype=np.int64)
    host = np.array([2, 7, 3], dtype=np.int64)
    pool.data.fill_(0xAB)  # a page's old bytes must not survive a store
    assert copier.copy(1, dev, host, [3], pool.name, pool.inode, store=True)
    rows = pool.data.clone()
    pool.data.fill_(0xAB)
    view = copier._host
    assert view is not None
    copier._copy(view, dev, host, src, store=True)  # the torch index path
    assert torch.equal(rows, pool.data)
    for d, h in zip(dev, host, strict=True):
        assert np.array_equal(page_layers(pool, h)[0], src[0][d].numpy())
        assert not page_layers(pool, h)[1:].any()
    copier.close()


def test_a_replaced_segment_is_never_touched(pool: HostPool) -> None:
    src = engine_kv(SHAPE.num_layers, seed=4)
    copier = HostCopier([src], SHAPE)
    before = pool.data.clone()
    ok = copier.copy(7, np.array([1]), np.array([1]), [1], pool.name, pool.inode + 1,
                     store=True)
    assert not ok and torch.equal(before, pool.data)
    assert copier.finished() == [(7, 0, 0.0)]
    copier.close()


def test_a_fresh_mapping_is_prefaulted_so_first_copies_take_no_page_faults(
        pool: HostPool) -> None:
    """The copier's mapping of a pool is faulted in ahead (MADV_POPULATE_WRITE): a store into
    pages this process never touched through it takes (almost) no minor faults; without the
    prefault it takes one per 4 KiB page (960 here)."""
    big = KVShape(num_layers=4, num_kv_heads=4, head_dim=64, block_size=64, dtype="bfloat16")
    p = HostPool(big, 16, f"/kvtier_test_copier_pf{os.getpid()}")
    try:
        layers = [torch.zeros((16, big.layer_bytes), dtype=torch.uint8) for _ in range(4)]
        copier = HostCopier([layers], big)
        assert copier.copy(1, np.arange(1), np.arange(1), [1], p.name, p.inode, store=True)
        assert copier.prefaulting is not None
        copier.prefaulting.join(timeout=10)
        assert not copier.prefaulting.is_alive()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        assert copier.copy(2, np.arange(1, 16), np.arange(1, 16), [15], p.name, p.inode,
                           store=True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        pages = 15 * big.page_bytes // 4096  # 960
        assert faults < pages // 10, (faults, pages)
        copier.close()
    finally:
        p.close()
