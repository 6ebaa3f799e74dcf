"""The engine-side copy between an engine's KV and a kvtier host pool on the CPU: the numpy
row path `HostCopier` takes on the CPU against torch's `index_select` / `index_copy_` (the
kernels of the CUDA path, and the CPU path before), same copier, same shared-memory pool,
interleaved, in one invocation. The geometry is `bench/vllm_ttft_real.py`'s model (12 layers,
4 KV heads of 64, 64-token blocks, bf16: 64 KiB per layer, 768 KiB per page).

    .venv/bin/python bench/host_copy.py            # ~20 s
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from kvtier.engine.host_copier import HostCopier
from kvtier.worker.kv_pools import HostPool, KVShape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = KVShape(num_layers=args.layers, num_kv_heads=4, head_dim=64, block_size=64,
                    dtype="bfloat16")
    dev_blocks, host_blocks = 256, 256
    layers = [torch.randint(0, 256, (dev_blocks, shape.layer_bytes), dtype=torch.uint8)
              for _ in range(args.layers)]
    pool = HostPool(shape, host_blocks, f"/kvtier_bench_hostcopy_{os.getpid()}")
    try:
        copier = HostCopier([layers], shape)
        rng = np.random.default_rng(0)
        print(f"torch {torch.__version__}, {args.threads} threads, page {shape.page_bytes >> 10}"
              f" KiB, load average {os.getloadavg()[0]:.2f}")
        print("| blocks | op | torch index ms | numpy rows ms | GB/s (rows) | speed-up |")
        print("|---|---|---|---|---|---|")
        for n in (9, 64, 192):
            for store in (True, False):
                dev = np.sort(rng.choice(dev_blocks, n, replace=False))
                host = rng.choice(host_blocks, n, replace=False)
                copier.copy(0, dev, host, [n], pool.name, pool.inode, store=store)  # map it
                view, rows = copier._host, copier._host_np
                assert view is not None and rows is not None
                idx: list[float] = []
                npy: list[float] = []
                for _ in range(args.repeat):  # interleaved
                    t = time.perf_counter()
                    copier._copy(view, dev, host, layers, store=store)
                    idx.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    copier._copy_cpu(rows, dev, host, copier._np_groups[0]  # type: ignore[index]
                                     if copier._np_groups else [], store=store)
                    npy.append(time.perf_counter() - t)
                a, b = statistics.median(idx), statistics.median(npy)
                print(f"| {n} | {'store' if store else 'load'} | {a * 1e3:.2f} | {b * 1e3:.2f} |"
                      f" {n * args.layers * shape.layer_bytes / b / 1e9:.1f} | {a / b:.1f}x |")
        copier.close()
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
