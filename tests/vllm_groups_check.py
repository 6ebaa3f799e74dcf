"""The vLLM adapter's KV cache groups, run in vLLM's environment by tests/test_vllm.py (it
imports vLLM, which kvtier's own environment does not have).

With vLLM's own KV cache spec classes: a full-attention and a sliding-window group are told
apart (kind, window, a key space each); a state (Mamba) group, groups of different geometry and a
several-group model without vLLM's KV cache config are refused in one line naming the problem.
Then the worker side against a real kvtier stack: two groups of different layer counts sharing
vLLM's tensors, each group's blocks copied into host pages of their own (a smaller group's page
zero-filled past its layers) and back, byte for byte. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import torch
from kvtier.integrations.vllm import KvtierOffloadingWorker, VllmAdapterError, kv_groups
from kvtier.integrations.vllm.adapter import KvtierLoadStoreSpec, kvtier_config
from kvtier.manager.config import load_config
from kvtier.manager.stack import Stack
from kvtier.worker.spec import host_segment_name
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig

BLOCK, HEADS, DIM = 32, 2, 8
LAYER_BYTES = 2 * BLOCK * HEADS * DIM * 2  # bfloat16


def offloading(groups: list[tuple[int, int, list[str]]]) -> Any:
    """The parts of vLLM's OffloadingConfig the adapter reads: (group id, tokens per block,
    layer names) per group."""
    return SimpleNamespace(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=b, layer_names=tuple(n),
                                           group_id=g) for g, b, n in groups),
        model=SimpleNamespace(name="tiny", dtype="bfloat16"),
        cache=SimpleNamespace(blocks_per_chunk=1, tokens_per_hash=BLOCK),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                 rank=0),
        engine_id="groups-check", extra_config={}, worker_kv_bytes_per_block=2 * LAYER_BYTES,
        kv_cache_layout=None)


def kv_cache_config(specs: list[Any]) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def refusal(fn: Any) -> str:
    try:
        fn()
    except VllmAdapterError as e:
        return str(e)
    return ""


def main() -> int:
    out: dict[str, Any] = {}
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                             dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                            dtype=torch.bfloat16, sliding_window=64)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 16)),
                      dtypes=(torch.bfloat16, torch.bfloat16))
    two = offloading([(0, BLOCK, ["l0", "l2"]), (1, BLOCK, ["l1"])])
    groups = kv_groups(two, kv_cache_config([swa, full]))
    assert groups is not None
    out["kinds"] = [g.kind for g in groups]
    out["window_blocks"] = [g.window_blocks for g in groups]
    h = os.urandom(32)
    keys = [g.key(h) for g in groups]
    out["keys_differ"] = len({h, *keys}) == 3
    cfg = kvtier_config(two, {}, groups)
    out["page_layers"] = cfg.model.num_layers

    out["mamba_refused"] = refusal(lambda: kv_groups(
        offloading([(0, BLOCK, ["l0"]), (1, BLOCK, ["mixer1"])]),
        kv_cache_config([full, mamba])))
    out["geometry_refused"] = refusal(lambda: kv_groups(
        offloading([(0, BLOCK, ["l0"]), (1, 2 * BLOCK, ["l1"])]),
        kv_cache_config([full, FullAttentionSpec(block_size=2 * BLOCK, num_kv_heads=HEADS,
                                                 head_size=DIM, dtype=torch.bfloat16)])))
    out["no_kv_cache_config_refused"] = refusal(lambda: kv_groups(two))

    # the worker side: group 0 has layers l0, l2; group 1 has l1 (it shares l0's tensor, as
    # vLLM's hybrid allocator lays groups over the same tensors)
    state = tempfile.mkdtemp(prefix="kvtier-vllm-groups-")
    os.environ.setdefault("XDG_STATE_HOME", state)
    env = {"KVTIER_DEPLOYMENT_ID": f"vgc-{os.getpid()}", "KVTIER_MODEL__NUM_LAYERS": "2",
           "KVTIER_MODEL__NUM_KV_HEADS": str(HEADS), "KVTIER_MODEL__HEAD_DIM": str(DIM),
           "KVTIER_MODEL__DTYPE": "bfloat16", "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK),
           "KVTIER_CACHE__DEVICE_BLOCKS": "1", "KVTIER_CACHE__DECODE_RESERVE_BLOCKS": "0",
           "KVTIER_CACHE__HOST_BLOCKS": "8", "KVTIER_STORAGE__BACKEND": "none",
           "KVTIER_WORKERS__COUNT": "1", "KVTIER_WORKERS__DEVICE": "cpu"}
    kcfg = load_config(None, env)
    with Stack(kcfg):
        gen = torch.Generator().manual_seed(0)
        tensors = [torch.randint(-128, 127, (8, LAYER_BYTES), dtype=torch.int8, generator=gen)
                   for _ in range(2)]
        kv = CanonicalKVCaches(
            [CanonicalKVCacheTensor(t, LAYER_BYTES) for t in tensors],
            [[CanonicalKVCacheRef(0, LAYER_BYTES), CanonicalKVCacheRef(1, LAYER_BYTES)],
             [CanonicalKVCacheRef(0, LAYER_BYTES)]])
        worker = KvtierOffloadingWorker(kv, kcfg, 0)
        seg = host_segment_name(kcfg.deployment_id, 0)
        inode = os.stat("/dev/shm" + seg).st_ino
        original = [t.clone() for t in tensors]
        # host page 0 is stale (another block's bytes were there): a group-1 store must not
        # carry them on
        pool_bytes = worker.copier._host_view(seg, inode)
        assert pool_bytes is not None
        pool_bytes[3].fill_(0x5A)
        # vLLM block 2 of group 0 -> host 1; vLLM block 5 of group 1 -> host 3
        worker.submit_store(1, GPULoadStoreSpec([2, 5], [1, 1], [0, 0]),
                            KvtierLoadStoreSpec([1, 3], ((seg, inode),)))
        host = pool_bytes
        out["group0_page_exact"] = (torch.equal(host[1, 0].view(torch.int8), original[0][2])
                                    and torch.equal(host[1, 1].view(torch.int8),
                                                    original[1][2]))
        out["group1_page_exact"] = torch.equal(host[3, 0].view(torch.int8), original[0][5])
        out["group1_page_rest_zero"] = bool((host[3, 1] == 0).all())
        # and back into other vLLM blocks: group 0 -> block 6, group 1 -> block 7
        worker.submit_load(2, KvtierLoadStoreSpec([1, 3], ((seg, inode),)),
                           GPULoadStoreSpec([6, 7], [1, 1], [0, 0]))
        out["round_trip_exact"] = (torch.equal(tensors[0][6], original[0][2])
                                   and torch.equal(tensors[1][6], original[1][2])
                                   and torch.equal(tensors[0][7], original[0][5])
                                   and torch.equal(tensors[1][7], original[1][7]))
        out["jobs_done"] = sorted(r.job_id for r in worker.get_finished())
        out["bad_group_sizes_refused"] = refusal(lambda: worker.submit_store(
            3, GPULoadStoreSpec([2, 5], [2], [0]),
            KvtierLoadStoreSpec([1, 3], ((seg, inode),))))
        worker.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
