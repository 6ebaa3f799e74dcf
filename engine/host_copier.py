"""The engine-side host-pool copier: copies between an engine's KV tensors and a kvtier host
pool segment, in the engine's worker process.

kvtier's host pool of a rank is a shared-memory segment created by a kvtier worker process
(embedded mode: the engine's own stack; attached mode: the node service). The engine copies
its own blocks in and out of it (CPU: one row copy per block and layer through numpy views;
CUDA: `index_select` / `index_copy_` kernels on a stream of their own through the pinned pool's
device view, completion by event). Every copy
names the segment and its inode as the cache side planned it; a segment replaced since then
(a restarted kvtier worker or service makes a new one under the same name, or names another)
is never touched: the copy is refused, and the adapter reports a refused load to its engine,
which recomputes.

    copy(job, segment, inode)  -> mapped segment is (segment, inode) and `segment` still
                                  names that inode?  yes: copy, job done
                                  no: remap `segment`; inode now as planned? yes: copy
                                                                              no: refused

Why the name is checked on every copy, not only when mapping: a dead kvtier worker's segment
stays mapped here after it was unlinked, under its old inode, so a plan made before the worker
died names exactly the mapping this copier holds; only the name shows it is gone (issue 34: a
store and a load planned before a worker was replaced were copied into the dead mapping and
reported done). One stat of /dev/shm per copy job (8 us on the loaded 2-core box).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
from kvtier.worker.errors import KvtierError
from kvtier.worker.kv_pools import HostPool, KVShape
from kvtier.worker.spec import segment_inode

log = logging.getLogger("kvtier.engine")


class HostCopier:
    """Copies one rank's blocks between the engine's KV and a kvtier host pool.

    Data structures: `groups[g][l]`, the engine's KV of layer l of KV cache group g as a uint8
    `[num_blocks, layer_bytes]` view (a host page holds one group's layers of one block, the
    group's layer l at layer slot l); `_pool` / `_host`, the segment mapped now and its
    `[num_host_blocks, num_layers, layer_bytes]` view; `_jobs`, CUDA copies in flight (job id,
    event, bytes, start); `_done`, finished jobs (job id, bytes, seconds).
    Invariant: a copy touches a host segment only when its name names, now, the inode the
    cache side planned the copy against."""

    def __init__(self, groups: list[list[torch.Tensor]], shape: KVShape) -> None:
        self.groups = groups
        self.shape = shape
        self.device = groups[0][0].device
        self._pool: HostPool | None = None
        self._host: torch.Tensor | None = None
        self._stream = (torch.cuda.Stream(self.device) if self.device.type == "cuda"
                        else None)
        # CPU: numpy views of the same memory (see `_copy_cpu` for why)
        self._np_groups = ([[t.numpy() for t in layers] for layers in groups]
                           if self.device.type == "cpu" else None)
        self._host_np: np.ndarray | None = None
        self.prefaulting: threading.Thread | None = None  # the mapped segment's, if any
        self._jobs: list[tuple[int, Any, int, float]] = []
        self._done: list[tuple[int, int, float]] = []
        self._lock = threading.Lock()

    @property
    def mapped(self) -> tuple[str, int] | None:
        """The segment mapped now (name, inode), if any."""
        return None if self._pool is None else (self._pool.name, self._pool.inode)

    def _host_view(self, segment: str, inode: int) -> torch.Tensor | None:
        pool = self._pool
        if (pool is None or pool.inode != inode or pool.name != segment
                or not _names(segment, inode)):
            if pool is not None:
                self._host = self._host_np = None
                pool.close()
                self._pool = None
            try:
                pool = HostPool.attach(segment, self.shape)
            except KvtierError as e:
                log.warning("kvtier host pool %s cannot be mapped: %s", segment, e)
                return None
            if pool.inode != inode:  # replaced again since the copy was planned
                pool.close()
                return None
            self._pool = pool
            # a fresh mapping faults on each page's first copy otherwise (HostPool.prefault)
            self.prefaulting = pool.prefault()
            host = pool.device_view(self.device) if self.device.type == "cuda" else None
            if host is None:
                host = pool.data
            # a page may be padded past its layers (kvtier.worker.page_layout)
            kv_bytes = self.shape.num_layers * self.shape.layer_bytes
            self._host = host[:, :kv_bytes].view(
                pool.num_blocks, self.shape.num_layers, self.shape.layer_bytes)
            if self._np_groups is not None:
                self._host_np = self._host.numpy()
        return self._host

    def copy(self, job_id: int, dev_ids: np.ndarray, host_ids: np.ndarray,
             group_sizes: list[int], segment: str, inode: int, *, store: bool) -> bool:
        """Copy `dev_ids[i]` <-> `host_ids[i]` (grouped: the first `group_sizes[0]` blocks of
        group 0, then group 1's, ...) against `segment` as of `inode`. False, copying nothing,
        when that segment is gone or replaced; the job is then finished (no bytes) all the
        same. `group_sizes` must match the groups (the adapter checks it against its
        engine's transfer first)."""
        start = time.perf_counter()
        host = self._host_view(segment, inode) if len(host_ids) else None
        if len(host_ids) and host is None:
            self.refuse(job_id)
            return False
        if host is not None:
            at = 0
            for g, (layers, n) in enumerate(zip(self.groups, group_sizes, strict=True)):
                if n and self._np_groups is not None and self._host_np is not None:
                    self._copy_cpu(self._host_np, dev_ids[at:at + n], host_ids[at:at + n],
                                   self._np_groups[g], store=store)
                elif n:
                    self._copy(host, dev_ids[at:at + n], host_ids[at:at + n], layers,
                               store=store)
                at += n
        nbytes = len(host_ids) * self.shape.page_bytes
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            with self._lock:
                self._jobs.append((job_id, event, nbytes, start))
        else:
            with self._lock:
                self._done.append((job_id, nbytes, time.perf_counter() - start))
        return True

    def refuse(self, job_id: int) -> None:
        """Finish a job that copies nothing (its segment is gone, or the cache side refused
        its plan): it is reported finished like any other, with no bytes."""
        with self._lock:
            self._done.append((job_id, 0, 0.0))

    @staticmethod
    def _copy_cpu(host: np.ndarray, dev_ids: np.ndarray, host_ids: np.ndarray,
                  layers: list[np.ndarray], *, store: bool) -> None:
        """`_copy` on the CPU, one row copy (a layer of a block, contiguous on both sides)
        per block and layer. Why not torch's `index_select` + `index_copy_`: they gather into
        a temporary and scatter it into a strided view, two passes and per-call overhead.
        `bench/host_copy.py` (12 layers of 64 KiB, scattered host pages, 2 threads): a 9-block
        store 8.09 ms that way, 1.85 ms this way; 64 blocks 59.9 ms against 10.9 ms; loads
        alike (4.4-5.5x). vLLM's worker runs the copy in its step, so on the CPU build this
        is time on the next request's first token (issue 25's low-reuse overhead)."""
        for d, h in zip(dev_ids.tolist(), host_ids.tolist(), strict=True):
            page = host[h]
            if store:
                for layer, kv in enumerate(layers):
                    page[layer] = kv[d]
                if len(layers) < page.shape[0]:
                    page[len(layers):] = 0
            else:
                for layer, kv in enumerate(layers):
                    kv[d] = page[layer]

    def _copy(self, host: torch.Tensor, dev_ids: np.ndarray, host_ids: np.ndarray,
              layers: list[torch.Tensor], *, store: bool) -> None:
        """Copy one group's blocks: its layer l to / from layer slot l of the host pages. A
        store into a page with more layer slots than the group has zeroes the rest (a page
        never carries bytes of a block it does not hold, into storage or elsewhere)."""
        dev = torch.from_numpy(dev_ids).to(self.device, non_blocking=True)
        hid = torch.from_numpy(np.ascontiguousarray(host_ids)).to(host.device,
                                                                  non_blocking=True)
        ctx = (torch.cuda.stream(self._stream) if self._stream is not None
               else contextlib.nullcontext())
        with ctx:
            if self._stream is not None:  # the KV it reads or writes was made on the
                self._stream.wait_stream(torch.cuda.current_stream(self.device))  # main stream
            for layer, kv in enumerate(layers):
                if store:
                    host[:, layer].index_copy_(0, hid, kv.index_select(0, dev))
                else:
                    kv.index_copy_(0, dev, host[:, layer].index_select(0, hid))
            if store and len(layers) < host.shape[1]:
                host[:, len(layers):].index_fill_(0, hid, 0)

    def finished(self) -> list[tuple[int, int, float]]:
        """Jobs finished since the last call: (job id, bytes copied, seconds)."""
        with self._lock:
            still: list[tuple[int, Any, int, float]] = []
            for job_id, event, nbytes, start in self._jobs:
                if event.query():
                    self._done.append((job_id, nbytes, time.perf_counter() - start))
                else:
                    still.append((job_id, event, nbytes, start))
            self._jobs = still
            done, self._done = self._done, []
            return done

    def wait(self, job_ids: set[int]) -> None:
        """Block until these CUDA jobs have finished (CPU jobs finish in `copy`)."""
        with self._lock:
            events = [e for j, e, _, _ in self._jobs if j in job_ids]
        for e in events:
            e.synchronize()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._host = self._host_np = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _names(segment: str, inode: int) -> bool:
    """Whether shared-memory name `segment` still names `inode` (not unlinked, not made anew)."""
    try:
        return segment_inode(segment) == inode
    except OSError:
        return False
