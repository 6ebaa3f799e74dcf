"""The copy engine's two helpers for device tiers other than its own fast paths, moved out
of `copy_engine.py` (one owner each: the engine owns its streams, lock, staging, host views
and fused launches; these only use them):

* `PlaneCopier`: K and V of a device tier known only by its planes (`PlanePool`: an
  engine's KV in its own layout), fused, zero-copy, staged or on the CPU;
* `ScaleCopier`: the blocks' scales (`shape.kv_scales`) between the device tier's scale
  planes and the host pages' scale trailer;
* `LayerEvents`: a CUDA load's per-layer completion (an event per layer or layer group,
  callbacks in layer order).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch
from kvtier.worker.fused_copy import GraphLaunches, IdRing, Launch, plane_launches
from kvtier.worker.kv_pools import DeviceKV, DevicePool, HostPool, KVShape, page_scale_view


class CopyEngine(Protocol):
    """What the helpers use of their `kvtier.worker.copy_engine.CopyEngine` (named here,
    not imported: the engine imports this module)."""

    shape: KVShape
    device_pool: DeviceKV
    host_pool: HostPool
    wide: torch.dtype
    layer_delay_s: float
    stage_bytes: int
    backup_step_bytes: int
    fused_block_bytes: int
    fused_order: str
    _row: int
    _cuda: bool
    _fused: bool
    _host_w: torch.Tensor
    _host_dev: torch.Tensor | None
    _lock: threading.Lock
    _d2h_stream: torch.cuda.Stream
    _h2d_stream: torch.cuda.Stream
    _rings: tuple[IdRing, IdRing]
    _graph_sets: tuple[GraphLaunches, GraphLaunches]

    def _staging(self, key: str, shape: tuple[int, ...], device: torch.device
                 ) -> torch.Tensor: ...

    def _backup_step(self) -> contextlib.AbstractContextManager[None]: ...

    def _after_compute(self, stream: torch.cuda.Stream) -> None: ...

# CUDA zero-copy path: device-side temporaries of one gather are bounded by this much (the
# gather reads the pinned host pool over the bus; the scatter is a device-memory copy).
ZERO_COPY_CHUNK_BYTES = 64 << 20


class PlaneCopier:
    """D2H and H2D for a device tier known only by its planes (`PlanePool`: an engine's KV
    in its own layout), for one `CopyEngine` (its host views, lock, staging, streams and
    layer delay).

    CPU: per chunk of blocks, each plane's rows are gathered with `index_select` into one
    staging buffer `[planes, blocks, row]` and scattered as whole host pages (D2H); per layer,
    the layer's rows of the pages are gathered and `index_copy_`d into its K and V planes
    (H2D). CUDA: the same per plane on the GPU, through the host pool aliased on the device
    (zero-copy) when it can be, else staged through host memory; each H2D layer records an
    event and its callback fires once the event completed, as on the fast paths."""

    def __init__(self, engine: CopyEngine, planes: list[torch.Tensor]) -> None:
        self.e = engine
        self.planes = planes
        self.device = planes[0].device
        self._launches: dict[str, list[Launch] | None] = {}

    def _fused(self, key: str) -> list[Launch] | None:
        """Per layer one prepared launch between the layer's K and V planes and the mapped
        pages (`key` "h2d" or "d2h"), or None when the engine has no fused path or a layer's
        K and V planes differ in block stride (then the eager path moves them)."""
        e = self.e
        if not e._fused:
            return None
        if key not in self._launches:
            assert e._host_dev is not None
            self._launches[key] = plane_launches(self.planes, e._host_dev, e.shape.k_bytes,
                                                 key == "h2d", e.fused_block_bytes,
                                                 e.fused_order)
        return self._launches[key]

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        e, planes = self.e, self.planes
        rows, row = len(planes), e._row
        n = int(src.numel())
        if e._cuda:
            self._d2h_cuda(src, dst)
            return
        host3 = e._host_w.view(e.host_pool.num_blocks, rows, row)
        c = max(1, min(n, e.backup_step_bytes // e.shape.page_bytes))
        for i in range(0, n, c):
            gs, gd = src[i : i + c], dst[i : i + c]
            part = e._staging("d2h", (rows, gs.numel(), row), host3.device)
            with e._backup_step():
                for p, plane in enumerate(planes):
                    torch.index_select(plane, 0, gs, out=part[p])
                host3.index_put_((gd,), part.transpose(0, 1))

    def h2d(self, src: torch.Tensor, dst: torch.Tensor, done: Callable[[int], None],
            enqueued: Callable[[int, torch.cuda.Stream], None] | None = None) -> None:
        e, planes = self.e, self.planes
        if e._cuda:
            self._h2d_cuda(src, dst, done, enqueued)
            return
        n = int(src.numel())
        c = max(1, min(max(n, 1), e.stage_bytes // e.shape.layer_bytes))
        stage = e._staging("h2d", (c, 2, e._row), e._host_w.device)
        for layer in range(e.shape.total_layers):
            host_l = e._host_w[:, layer]  # [pages, 2, row]
            k, v = planes[2 * layer], planes[2 * layer + 1]
            for i in range(0, n, c):
                gs, gd = src[i : i + c], dst[i : i + c]
                part = stage[: gs.numel()]
                torch.index_select(host_l, 0, gs, out=part)
                k.index_copy_(0, gd, part[:, 0])
                v.index_copy_(0, gd, part[:, 1])
            done(layer)
            if e.layer_delay_s:
                time.sleep(e.layer_delay_s)

    def _host(self) -> torch.Tensor:
        """The host pool as [pages, layers, 2, row]: aliased on the device, else the CPU's."""
        e = self.e
        return e._host_dev if e._host_dev is not None else e._host_w

    def _d2h_cuda(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        e, planes, dev = self.e, self.planes, self.device
        stream = e._d2h_stream
        fused = self._fused("d2h")
        if fused is not None:
            e._after_compute(stream)  # KV written by compute
        else:
            stream.wait_stream(torch.cuda.current_stream(dev))
        n = int(src.numel())
        graphs = e._graph_sets[0] if fused is not None else None
        if fused is not None and graphs is not None and (cap := graphs.cap_for(n)):
            with graphs.lock:  # a small backup: every layer's launch in one graph
                got = graphs.graphs("planes_d2h", cap, [fused])
                if got is not None:
                    graphs.stage(src, dst, cap)
                    with torch.cuda.stream(stream):
                        got[0].replay()
                    stream.synchronize()  # before the row is rewritten
                    return
        if fused is not None:  # one launch per layer, rows straight into the mapped pages
            with torch.cuda.stream(stream):
                ids = e._rings[0].put(src, dst, stream)
                for launch in fused:
                    launch.run(ids, n)
            stream.synchronize()
            return
        host = self._host()
        host3 = host.view(host.shape[0], len(planes), e._row)
        c = max(1, ZERO_COPY_CHUNK_BYTES // e.shape.page_bytes)
        with torch.cuda.stream(stream):
            s_all, d_all = src.to(dev), dst.to(host.device)
            for i in range(0, n, c):
                s = s_all[i : i + c]
                part = torch.empty((len(planes), s.numel(), e._row), dtype=e.wide, device=dev)
                for p, plane in enumerate(planes):
                    torch.index_select(plane, 0, s, out=part[p])
                pages = part.transpose(0, 1)
                if host.device != dev:  # staged: through host memory
                    pages = pages.to("cpu")
                host3.index_copy_(0, d_all[i : i + c], pages)
        stream.synchronize()

    def _h2d_cuda(self, src: torch.Tensor, dst: torch.Tensor, done: Callable[[int], None],
                  enqueued: Callable[[int, torch.cuda.Stream], None] | None = None) -> None:
        e, planes, dev = self.e, self.planes, self.device
        host = self._host()
        stream = e._h2d_stream
        n = int(src.numel())
        c = max(1, ZERO_COPY_CHUNK_BYTES // e.shape.layer_bytes)
        layers = LayerEvents(done, enqueued)
        fused = self._fused("h2d")
        if fused is not None:
            e._after_compute(stream)  # readers of the old content
        else:
            stream.wait_stream(torch.cuda.current_stream(dev))
        graphs = e._graph_sets[1] if fused is not None else None
        cap = graphs.cap_for(n) if graphs is not None and not e.layer_delay_s else 0
        if fused is not None and graphs is not None and cap:
            with graphs.lock:  # a small load: per layer one graph replay and its event
                got = graphs.graphs("planes_h2d", cap, [[launch] for launch in fused])
                if got is not None:
                    graphs.stage(src, dst, cap)
                    with torch.cuda.stream(stream):
                        for layer, graph in enumerate(got):
                            graph.replay()
                            layers.recorded(layer, stream)
                    layers.finish()  # the last replay has run: the row may be rewritten
                    return
        if fused is not None:  # per layer one launch from the mapped pages into K and V
            with torch.cuda.stream(stream):
                ids = e._rings[1].put(src, dst, stream)
                for layer, launch in enumerate(fused):
                    launch.run(ids, n)
                    layers.recorded(layer, stream)
                    if e.layer_delay_s:
                        time.sleep(e.layer_delay_s)
            layers.finish()
            return
        with torch.cuda.stream(stream):
            s_all, d_all = src.to(host.device), dst.to(dev)
            for layer in range(e.shape.total_layers):
                host_l = host[:, layer]  # [pages, 2, row]
                k, v = planes[2 * layer], planes[2 * layer + 1]
                for i in range(0, n, c):
                    rows = torch.index_select(host_l, 0, s_all[i : i + c])
                    if rows.device != dev:  # staged: through host memory
                        rows = rows.to(dev)
                    d = d_all[i : i + c]
                    k.index_copy_(0, d, rows[:, 0])
                    v.index_copy_(0, d, rows[:, 1])
                layers.recorded(layer, stream)
                if e.layer_delay_s:
                    time.sleep(e.layer_delay_s)
        layers.finish()


class ScaleCopier:
    """D2H and H2D of the blocks' scales (`shape.kv_scales`) for one `CopyEngine`: between
    the device tier's scale planes (kvtier's own pool: one tensor `[planes, blocks, heads]`,
    moved with one gather and one scatter; an engine's: plane by plane) and the scale
    trailer of the host pages (`[pages, planes, heads]`, strided by the page). Scales are
    moved as int32 words, so any bit pattern (NaN payloads included) survives.

    Sizes: a block's scales are `planes * heads * 4` bytes (2 KiB for 32 layers x 8 heads),
    under 1% of its K and V at any realistic block size, so D2H moves them in a step of their
    own and H2D before the first layer, on the same stream as the K and V. Measured on the
    2-vCPU build machine (CPU pools, float8, 32 layers x 8 KV heads x 128, 4-token blocks,
    64 and 256 random blocks, medians of 15): the scale step took 1.2-2.1% of a D2H and
    0.1% of an H2D."""

    def __init__(self, engine: CopyEngine, alias_pages: torch.Tensor | None) -> None:
        self.e = engine
        shape = engine.shape
        dev = engine.device_pool
        self.stacked: torch.Tensor | None = None
        if isinstance(dev, DevicePool):
            assert dev.scales is not None
            self.stacked = dev.scales.view(torch.int32)
        self.planes = [p.view(torch.int32) for p in dev.scale_planes]
        host = engine.host_pool.scales
        assert host is not None
        self.host = host.view(torch.int32)  # [pages, planes, heads] on the CPU
        alias = None if alias_pages is None else page_scale_view(alias_pages, shape)
        self.host_dev = None if alias is None else alias.view(torch.int32)
        self.device = dev.device

    def _gather_device(self, src: torch.Tensor) -> torch.Tensor:
        """`[n, planes, heads]` of device blocks `src` (on the device)."""
        if self.stacked is not None:
            return torch.index_select(self.stacked, 1, src).transpose(0, 1)
        return torch.stack([torch.index_select(p, 0, src) for p in self.planes], dim=1)

    def _scatter_device(self, dst: torch.Tensor, rows: torch.Tensor) -> None:
        if self.stacked is not None:
            self.stacked.index_copy_(1, dst, rows.transpose(0, 1))
            return
        for p, plane in enumerate(self.planes):
            plane.index_copy_(0, dst, rows[:, p])

    def d2h(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        e = self.e
        if not e._cuda:
            with e._lock:
                self.host.index_copy_(0, dst, self._gather_device(src))
            return
        stream = e._d2h_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # scales set by compute
        with torch.cuda.stream(stream):
            rows = self._gather_device(src.to(self.device))
            if self.host_dev is not None:
                self.host_dev.index_copy_(0, dst.to(self.device), rows)
            else:
                self.host.index_copy_(0, dst, rows.to("cpu"))
        stream.synchronize()

    def h2d(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        e = self.e
        if not e._cuda:
            with e._lock:
                self._scatter_device(dst, torch.index_select(self.host, 0, src))
            return
        stream = e._h2d_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # readers of old scales
        with torch.cuda.stream(stream):
            if self.host_dev is not None:
                rows = torch.index_select(self.host_dev, 0, src.to(self.device))
            else:
                rows = torch.index_select(self.host, 0, src).to(self.device)
            self._scatter_device(dst.to(self.device), rows)
        # No synchronize: the layers' K and V follow on the same stream, and each layer's
        # event (what `done(layer)` waits for) is recorded after these copies.


class LayerEvents:
    """Per-layer completion of a CUDA load: an event recorded on the copy stream after each
    layer; `done(layer)` fires once that layer's event has completed, in layer order, as early
    as the enqueueing loop notices (queried after every layer) and at the latest in `finish`."""

    def __init__(self, done: Callable[[int], None],
                 enqueued: Callable[[int, torch.cuda.Stream], None] | None = None) -> None:
        self.done = done
        self.enqueued = enqueued
        self.pending: deque[tuple[int, torch.cuda.Event]] = deque()

    def recorded(self, layer: int, stream: torch.cuda.Stream) -> None:
        self.recorded_range(layer, layer + 1, stream)

    def recorded_range(self, first: int, end: int, stream: torch.cuda.Stream) -> None:
        """Layers `first..end-1` were enqueued together: one event completes them all."""
        event = torch.cuda.Event()
        event.record(stream)
        for layer in range(first, end):
            if self.enqueued is not None:  # the engine's inter-process event, no host sync
                self.enqueued(layer, stream)
            self.pending.append((layer, event))
        while self.pending and self.pending[0][1].query():
            self.done(self.pending.popleft()[0])

    def finish(self) -> None:
        while self.pending:
            layer, event = self.pending.popleft()
            event.synchronize()
            self.done(layer)
