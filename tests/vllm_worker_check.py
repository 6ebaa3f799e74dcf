"""The vLLM adapter's worker side against a real kvtier stack, run in vLLM's environment by
tests/test_vllm.py (it imports vLLM, which kvtier's own environment does not have).

It plays vLLM's worker: per-layer KV tensors in vLLM's canonical form, stores into kvtier's host
pool and loads back (byte-exact), then the refusals that keep a replaced kvtier worker's pool
safe: a load planned against another segment inode is reported as a load error (vLLM then
recomputes) and copies nothing, a store planned against the old segment never writes into the
replacement's. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time

import torch
from kvtier.integrations.vllm.adapter import KvtierLoadStoreSpec, KvtierOffloadingWorker
from kvtier.manager.config import load_config
from kvtier.manager.stack import Stack
from kvtier.worker.kv_pools import HostPool, KVShape
from kvtier.worker.spec import host_segment_name
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)

LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 8
LAYER_BYTES = 2 * BLOCK * HEADS * DIM * 2  # float16


def wait(pred, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def main() -> int:
    state = tempfile.mkdtemp(prefix="kvtier-vllm-check-")
    env = {"KVTIER_DEPLOYMENT_ID": f"vck-{os.getpid()}", "KVTIER_MODEL__NUM_LAYERS": "2",
           "KVTIER_MODEL__NUM_KV_HEADS": "2", "KVTIER_MODEL__HEAD_DIM": "8",
           "KVTIER_MODEL__DTYPE": "float16", "KVTIER_CACHE__BLOCK_SIZE": "4",
           "KVTIER_CACHE__DEVICE_BLOCKS": "1", "KVTIER_CACHE__DECODE_RESERVE_BLOCKS": "0",
           "KVTIER_CACHE__HOST_BLOCKS": "8", "KVTIER_STORAGE__BACKEND": "none",
           "KVTIER_WORKERS__COUNT": "1", "KVTIER_WORKERS__DEVICE": "cpu"}
    os.environ.setdefault("XDG_STATE_HOME", state)
    cfg = load_config(None, env)
    seg = host_segment_name(cfg.deployment_id, 0)
    out: dict[str, object] = {}
    with Stack(cfg) as stack:
        gen = torch.Generator().manual_seed(0)
        layers = [torch.randint(-128, 127, (8, LAYER_BYTES), dtype=torch.int8, generator=gen)
                  for _ in range(LAYERS)]
        kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, LAYER_BYTES) for t in layers],
            [[CanonicalKVCacheRef(i, LAYER_BYTES) for i in range(LAYERS)]])
        worker = KvtierOffloadingWorker(kv, cfg, 0)
        inode = os.stat("/dev/shm" + seg).st_ino
        original = [t.clone() for t in layers]

        def dev(ids: list[int]) -> GPULoadStoreSpec:
            return GPULoadStoreSpec(ids, [len(ids)], [0])

        # store vLLM blocks 3 and 5 into host blocks 0 and 1, then load them into 6 and 7
        worker.submit_store(1, dev([3, 5]), KvtierLoadStoreSpec([0, 1], ((seg, inode),)))
        worker.submit_load(2, KvtierLoadStoreSpec([0, 1], ((seg, inode),)), dev([6, 7]))
        done = sorted(r.job_id for r in worker.get_finished())
        out["jobs_done"] = done
        out["round_trip_exact"] = all(
            torch.equal(layers[i][6], original[i][3]) and torch.equal(layers[i][7], original[i][5])
            for i in range(LAYERS))
        with HostPool.attach(seg, KVShape(LAYERS, HEADS, DIM, BLOCK, torch.float16)) as pool:
            page = pool.data[0].view(LAYERS, LAYER_BYTES)
            out["host_page_is_block_3"] = all(
                torch.equal(page[i].view(torch.int8), original[i][3]) for i in range(LAYERS))

        # a load planned against another segment copies nothing and is reported
        before = [t.clone() for t in layers]
        worker.submit_load(3, KvtierLoadStoreSpec([0, 1], ((seg, inode + 1),)), dev([1, 2]))
        out["stale_load_errors"] = sorted(worker.take_load_errors())
        out["stale_load_copied_nothing"] = all(torch.equal(a, b)
                                               for a, b in zip(layers, before, strict=True))
        # the spec the scheduler side hands out for a load it could not plan
        worker.submit_load(4, KvtierLoadStoreSpec([-1, -1], ()), dev([4, 5]))
        out["refused_load_errors"] = sorted(worker.take_load_errors())
        out["failed_jobs_still_finish"] = sorted(r.job_id for r in worker.get_finished())

        # kill kvtier's worker: its replacement has a new segment, which a store planned
        # against the old one must never touch
        sup = stack.supervisor
        assert sup is not None and sup.workers[0].proc is not None
        old_pid = sup.workers[0].proc.pid
        os.kill(old_pid, signal.SIGKILL)
        wait(lambda: stack.workers_ready() and sup.workers[0].proc is not None
             and sup.workers[0].proc.pid != old_pid, 60, "the replacement worker")
        new_inode = os.stat("/dev/shm" + seg).st_ino
        out["replaced_segment"] = new_inode != inode
        worker.submit_store(5, dev([3, 5]), KvtierLoadStoreSpec([0, 1], ((seg, inode),)))
        with HostPool.attach(seg, KVShape(LAYERS, HEADS, DIM, BLOCK, torch.float16)) as pool:
            out["stale_store_left_new_pool_alone"] = bool((pool.data[:2] == 0).all())
        worker.submit_store(6, dev([3]), KvtierLoadStoreSpec([2], ((seg, new_inode),)))
        with HostPool.attach(seg, KVShape(LAYERS, HEADS, DIM, BLOCK, torch.float16)) as pool:
            page = pool.data[2].view(LAYERS, LAYER_BYTES)
            out["store_into_new_pool_exact"] = all(
                torch.equal(page[i].view(torch.int8), original[i][3]) for i in range(LAYERS))
        worker.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
