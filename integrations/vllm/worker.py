"""The worker side: vLLM's `OffloadingWorker` copying between vLLM's KV tensors and kvtier's
host pool of its rank, and the load/store spec that names the host pages and segments."""

from __future__ import annotations

import threading

import numpy as np
import torch
from kvtier.engine.embedded import KvtierConfig
from kvtier.engine.geometry import kv_shape
from kvtier.engine.host_copier import HostCopier
from kvtier.integrations.vllm.errors import VllmAdapterError
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

# ---------------------------------------------------------------------------- load/store spec


class KvtierLoadStoreSpec(LoadStoreSpec):  # type: ignore[misc,unused-ignore]
    """Where blocks live in kvtier's host pools: one host block id per vLLM block, and each
    rank's host segment (name, inode) when the copy was planned (a kvtier worker or service
    replaced since then has a new segment: the copy is refused rather than done into it).
    The worker side maps the segment the spec names, so it needs no connection of its own."""

    def __init__(self, host_ids: list[int], segments: tuple[tuple[str, int], ...]) -> None:
        self.block_ids = np.asarray(host_ids, dtype=np.int64)
        self.segments = segments

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({self.block_ids.tolist()}, segments={self.segments})"



# ---------------------------------------------------------------------------- worker side


class KvtierOffloadingWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Copies between vLLM's KV tensors and kvtier's host pool of this rank, in vLLM's worker
    process.

    Data structures: `groups[g][l]`, vLLM's KV of layer l of group g as a uint8
    `[num_blocks, layer_bytes]` view; `copier`, kvtier's host-pool copier over them
    (`kvtier.engine.host_copier`: it maps the segment each copy names, lazily, and refuses a
    segment replaced since the copy was planned); `_load_errors`, vLLM block ids of loads
    refused, and `_failed_load_jobs` their job ids. Invariant: a copy touches a host segment
    only when its name and inode are the ones the scheduler side planned it against."""

    def __init__(self, kv_caches: CanonicalKVCaches, cfg: KvtierConfig, rank: int) -> None:
        shape = kv_shape(cfg)
        self.shape = shape
        self.rank = rank
        # groups[g][l]: vLLM's KV of layer l of group g (a host page holds one group's layers
        # of one block, the group's layer l at layer slot l; groups may share vLLM tensors)
        self.groups: list[list[torch.Tensor]] = []
        for g, refs in enumerate(kv_caches.group_data_refs):
            if not refs or len(refs) > shape.num_layers:
                raise VllmAdapterError(
                    f"vLLM registered {len(refs)} KV layers in group {g}, the spec was built "
                    f"for pages of at most {shape.num_layers}")
            layers: list[torch.Tensor] = []
            for ref in refs:
                t = kv_caches.tensors[ref.tensor_idx].tensor
                if ref.page_size_bytes != shape.layer_bytes:
                    raise VllmAdapterError(
                        f"a vLLM KV page holds {ref.page_size_bytes} bytes per layer "
                        f"(group {g}), kvtier expects {shape.layer_bytes}")
                layers.append(t.view(torch.uint8)[:, : shape.layer_bytes])
            self.groups.append(layers)
        if not self.groups:
            raise VllmAdapterError("vLLM registered no KV cache group")
        if len(self.groups) == 1 and len(self.groups[0]) != shape.num_layers:
            raise VllmAdapterError(
                f"vLLM registered {len(self.groups[0])} KV layers, the spec was built for "
                f"{shape.num_layers}")
        self.layers = self.groups[0]
        self.copier = HostCopier(self.groups, shape)
        self._load_errors: set[int] = set()
        self._failed_load_jobs: set[int] = set()  # their job ids (several-group models)
        self._lock = threading.Lock()

    # -- OffloadingWorker

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def _submit(self, job_id: int, dev_spec: GPULoadStoreSpec, host_spec: LoadStoreSpec,
                *, store: bool) -> bool:
        if not isinstance(host_spec, KvtierLoadStoreSpec):
            raise VllmAdapterError(f"not a kvtier spec: {host_spec!r}")
        dev_ids = np.asarray(dev_spec.block_ids, dtype=np.int64)
        host_ids = host_spec.block_ids
        segments = host_spec.segments
        sizes = list(getattr(dev_spec, "group_sizes", None) or [len(dev_ids)])
        if len(host_ids) and self.rank >= len(segments):
            self.copier.refuse(job_id)  # a plan the scheduler side refused (no segments)
            copied = False
        else:
            if len(host_ids) and (len(sizes) != len(self.groups) or sum(sizes) != len(dev_ids)):
                raise VllmAdapterError(
                    f"vLLM's transfer names {len(sizes)} groups of {sizes} blocks; kvtier "
                    f"copies {len(self.groups)} groups of {len(dev_ids)} blocks")
            name, inode = segments[self.rank] if len(host_ids) else ("", 0)
            copied = self.copier.copy(job_id, dev_ids, host_ids, sizes, name, inode,
                                      store=store)
        if not copied and not store:
            # The segment the copy was planned against is gone (kvtier worker or service
            # replaced), or the plan was refused: the blocks are reported so vLLM recomputes
            # them. A store is dropped (the cache side wrote those blocks off).
            with self._lock:
                self._load_errors.update(int(b) for b in dev_ids)
                self._failed_load_jobs.add(job_id)
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(job_id, True, nbytes, seconds)
                for job_id, nbytes, seconds in self.copier.finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.copier.wait(job_ids)

    def take_load_errors(self) -> set[int]:
        """vLLM block ids of the loads refused since the last call."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
            return errors

    def take_failed_load_jobs(self) -> set[int]:
        """Job ids of the loads refused since the last call (and their block ids dropped)."""
        with self._lock:
            jobs, self._failed_load_jobs = self._failed_load_jobs, set()
            self._load_errors.clear()
            return jobs

    def shutdown(self) -> None:
        self.copier.close()


