"""One-launch gather-scatter of KV rows between a CUDA device tier and the pinned host pool.

Why (README "Transfers", H200 and H100, torch 2.11): the eager zero-copy path moves a load
with two PyTorch kernels per layer (an `index_select` into a device temporary, an
`index_copy_` out of it) and a backup with one gather into a temporary plus one scatter over
the bus. Small loads pay the launches and the temporaries (0.32-0.59 of one pinned
`cudaMemcpyAsync` at 16 KiB blocks), large ones come within 0.86-0.91. Here one Triton
kernel reads every row of the task where it is and writes it where it goes, in one pass over
the bus, no temporary: per layer for a load (so each layer still gets its own event), one
launch for every layer of a backup.

The kernel's model (the one interface both sides are described through): a side is a base
pointer and three strides in elements: `block` (between two block ids), `layer` (between two
layers) and `kv` (from a layer's K row to its V row). Plane `p` of the launch is layer
`p // 2`, half `p % 2`; pair `i` moves the row `src[ids[i]]` of every plane to
`dst[ids[n + i]]`. kvtier's own device pool is `[layers, 2, blocks, row]` (uniform strides,
a backup is one launch over `2 * layers` planes); a host page is `[layers, 2, row]` at the
page's stride; an engine's planes (`PlanePool`) are separate tensors, described per layer
with `kv` the distance from its K plane to its V plane (flat unified addresses, so the two
may be separate allocations; they must be a whole number of elements apart).

Vector width: rows are moved as the widest of int32 / int16 / uint8 that divides the row
and every stride; Triton specialises pointers and integers that are multiples of 16, so an
aligned row moves in 16-byte accesses; `BLOCK` elements per program (at most
`FUSED_BLOCK_BYTES`, default 8 KiB: four 16-byte accesses in flight per thread of 4 warps)
and a program per (pair, plane, chunk of the row).

Triton is optional (it ships inside CUDA builds of torch, not the CPU one): without it, or
without CUDA, `fused_unavailable()` says why and the copy engine keeps its PyTorch paths.
`TRITON_INTERPRET=1` runs the same kernel on the CPU (tests/test_fused_copy.py checks its
indexing against PyTorch there).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

try:  # optional: CUDA torch wheels bring Triton, the CPU build does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

FUSED_ENV = "KVTIER_FUSED_COPY"
"""`0` turns the fused path off (the copy engine then uses the eager zero-copy path)."""
FUSED_BLOCK_BYTES = int(os.environ.get("KVTIER_FUSED_BLOCK_BYTES", 8 << 10))
FUSED_ORDERS = ("auto", "pair", "page")
FUSED_ORDER = os.environ.get("KVTIER_FUSED_ORDER", "auto")
"""The grid's order (`KVTIER_FUSED_ORDER`): `pair` puts the pairs on the grid's fastest axis
(neighbouring programs move the same row of different blocks), `page` sweeps one block's
rows in address order, chunk fastest then plane, blocks on the second axis (neighbouring
programs read or write one host page front to back). `auto`: `page` for rows of at least
`PAGE_ORDER_MIN_ROW` bytes, else `pair`. See `Launch.run`."""
PAGE_ORDER_MIN_ROW = 32 << 10
"""Measured on an H100 (bench/transfer.py --fused-orders, two runs, ratios to one pinned
copy): page order took the 256 KiB x 512-block backup from 0.83-0.86 to 0.95-0.96 and the
64 KiB x 512 one from 0.86-0.91 to 0.94; at 16 KiB blocks (8 KiB rows) it was 0.01-0.03
below pair order in every backup measured. Rows are half a block (K or V)."""
MAX_GRID_YZ = 65535  # CUDA's limit on the grid's 2nd and 3rd dimensions

_ELEMENT_DTYPES: tuple[tuple[int, torch.dtype], ...] = (
    (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def fused_unavailable(device: torch.device) -> str | None:
    """Why the fused path cannot run on `device`, or None when it can."""
    if os.environ.get(FUSED_ENV, "1") == "0":
        return f"{FUSED_ENV}=0"
    if triton is None:
        return "Triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None  # the interpreter runs on the CPU (tests)
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    return None


if triton is not None:

    @triton.jit(do_not_specialize=["n"])  # type: ignore[untyped-decorator]
    def _move_rows(src, dst, ids, n,  # type: ignore[no-untyped-def]
                   s_block, s_layer, s_kv, d_block, d_layer, d_kv, row, chunks,
                   BLOCK: tl.constexpr, EVEN: tl.constexpr, PAGE_ORDER: tl.constexpr,
                   PADDED: tl.constexpr):
        if PAGE_ORDER:  # grid (chunks * planes, pairs): one block's rows in address order
            pair = tl.program_id(1)
            flat = tl.program_id(0)
            plane = flat // chunks
            chunk = flat % chunks
        else:  # grid (pairs, planes, chunks)
            pair = tl.program_id(0)
            plane = tl.program_id(1)
            chunk = tl.program_id(2)
        s_id = tl.load(ids + pair).to(tl.int64)
        d_id = tl.load(ids + n + pair).to(tl.int64)
        kv = (plane % 2).to(tl.int64)
        layer = (plane // 2).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        s_ptr = src + (s_id * s_block + layer * s_layer + kv * s_kv) + offs
        d_ptr = dst + (d_id * d_block + layer * d_layer + kv * d_kv) + offs
        if PADDED:  # a graph's launch over a padded id row: pairs with a source id < 0 idle
            mask = (offs < row) & (s_id >= 0)
            tl.store(d_ptr, tl.load(s_ptr, mask=mask), mask=mask)
        elif EVEN:
            tl.store(d_ptr, tl.load(s_ptr))
        else:
            mask = offs < row
            tl.store(d_ptr, tl.load(s_ptr, mask=mask), mask=mask)


@dataclass(frozen=True)
class Side:
    """One side of a launch: `base` (a view whose first element is layer 0's K row of block
    0 on that side) and its strides in BYTES (so two sides, or a K and a V plane in separate
    allocations, need not share an element type)."""

    base: torch.Tensor
    block: int
    layer: int
    kv: int

    @staticmethod
    def of(base: torch.Tensor, block: int, layer: int, kv: int) -> Side:
        """A side from strides in `base`'s elements."""
        es = base.element_size()
        return Side(base, block * es, layer * es, kv * es)


def element_dtype(row_bytes: int, *byte_quantities: int) -> torch.dtype:
    """The widest kernel element that divides the row and every byte offset or stride."""
    for size, dtype in _ELEMENT_DTYPES:
        if row_bytes % size == 0 and all(q % size == 0 for q in byte_quantities):
            return dtype
    raise AssertionError("unreachable: every size is a multiple of 1")


def launch_shape(row: int, elem_bytes: int, block_bytes: int = 0) -> tuple[int, int, bool]:
    """BLOCK (elements per program, a power of two), num_warps and whether the row is a
    whole number of BLOCKs (no mask), for a row of `row` elements."""
    cap = max(16, (block_bytes or FUSED_BLOCK_BYTES) // elem_bytes)
    block = 1
    while block < min(row, cap):
        block *= 2
    # 512 bytes per warp per access round (32 threads x 16 bytes); four rounds in flight
    # per thread before adding a warp, up to 4 warps
    warps = max(1, min(4, block * elem_bytes // 2048))
    return block, warps, row % block == 0


@dataclass(frozen=True)
class Launch:
    """One prepared launch of `_move_rows` (everything but the ids): made once per geometry
    and direction (or per layer), so a copy pays only the launch itself.

    Triton's own dispatch is used for every launch: calling the compiled kernel's launcher
    directly after the first dispatch was measured on the H100 (Triton 3.6) and was not
    faster (16 KiB x 64-block backups 0.64-0.70 of a pinned copy against 0.73-0.74)."""

    src: torch.Tensor
    dst: torch.Tensor
    strides: tuple[int, int, int, int, int, int]
    row: int
    planes: int
    chunks: int
    block: int
    warps: int
    even: bool
    order: str = "pair"

    def run(self, ids: torch.Tensor, n: int, padded: bool = False) -> None:
        """Copy the planes' rows of pairs `ids[i] -> ids[n + i]` (`ids`: int64, `2n` long,
        on the device or pinned and mapped) on the current stream, one launch: a program
        per (pair, plane, chunk of the row). Order `pair`: the pair on the grid's first
        dimension (up to 2**31 - 1); `page` (up to 65,535 pairs, else `pair`): a block's
        chunks and planes flattened on the first. `padded`: pairs whose source id is
        negative move nothing (a graph's row padded to its size)."""
        if not n:
            return
        page = self.order == "page" and n <= MAX_GRID_YZ
        grid = (self.chunks * self.planes, n, 1) if page else (n, self.planes, self.chunks)
        _move_rows[grid](self.src, self.dst, ids, n, *self.strides, self.row, self.chunks,
                         BLOCK=self.block, EVEN=self.even, PAGE_ORDER=page,
                         PADDED=padded, num_warps=self.warps)


def prepare(src: Side, dst: Side, row_bytes: int, planes: int, block_bytes: int = 0,
            order: str = "") -> Launch:
    """A launch moving `planes` plane rows of `row_bytes` per pair from `src` to `dst`,
    with the widest element that every address and stride allows; `order`: one of
    `FUSED_ORDERS` ("": `FUSED_ORDER`)."""
    order = order or FUSED_ORDER
    if order not in FUSED_ORDERS:
        raise ValueError(f"fused copy order: {order!r} is not one of {', '.join(FUSED_ORDERS)}")
    if triton is None:
        raise RuntimeError("fused copy: Triton is not installed")
    byte_strides = (src.block, src.layer, src.kv, dst.block, dst.layer, dst.kv)
    dtype = element_dtype(row_bytes, src.base.data_ptr(), dst.base.data_ptr(), *byte_strides)
    es = torch.empty((), dtype=dtype).element_size()
    row = row_bytes // es
    block, warps, even = launch_shape(row, es, block_bytes)
    chunks = -(-row // block)
    if planes > MAX_GRID_YZ or chunks > MAX_GRID_YZ:
        raise ValueError(f"fused copy: {planes} planes x {chunks} chunks exceed the grid")
    if order == "auto":
        order = "page" if row_bytes >= PAGE_ORDER_MIN_ROW else "pair"
    s = tuple(b // es for b in byte_strides)
    return Launch(_as_elements(src.base, dtype), _as_elements(dst.base, dtype),
                  (s[0], s[1], s[2], s[3], s[4], s[5]), row, planes, chunks, block, warps,
                  even, order)


def layer_groups(layers: int) -> list[tuple[int, int]]:
    """The layer ranges `[a, b)` a load launches one kernel for: 1, 1, 2, 4, 8, ... layers.
    Layer 0 alone comes first (what a model runner waits on), and no group copies more
    layers than all before it, so while each layer computes at least as long as it copies
    the runner never waits after layer 0; a 32-layer load is 6 launches instead of 32
    (H100: a launch and its event cost the host about 40-60 us, a 16 KiB x 64-block layer
    copies in about 20 us, so one launch per layer left the GPU idle between layers)."""
    out, a, size = [], 0, 1
    while a < layers:
        b = min(layers, a + size)
        out.append((a, b))
        size = max(1, b)  # the next group is as large as everything before it
        a = b
    return out


def pool_launches(dev: torch.Tensor, pages: torch.Tensor, row_bytes: int,
                  block_bytes: int = 0, order: str = ""
                  ) -> tuple[Launch, list[tuple[int, int, Launch]]]:
    """kvtier's own pool `dev` `[layers, 2, blocks, row]` and host pages `pages` `[pages,
    layers, 2, row]` (any strides; rows contiguous): the backup's one launch over every
    plane, and a load's launches, one per layer group (`layer_groups`) as `(first, end,
    launch)`."""
    d2h = prepare(Side.of(dev, dev.stride(2), dev.stride(0), dev.stride(1)),
                  Side.of(pages, pages.stride(0), pages.stride(1), pages.stride(2)),
                  row_bytes, 2 * dev.shape[0], block_bytes, order)
    h2d = [(a, b, prepare(Side.of(pages[:, a], pages.stride(0), pages.stride(1),
                                  pages.stride(2)),
                          Side.of(dev[a], dev.stride(2), dev.stride(0), dev.stride(1)),
                          row_bytes, 2 * (b - a), block_bytes, order))
           for a, b in layer_groups(dev.shape[0])]
    return d2h, h2d


def plane_launches(planes: list[torch.Tensor], pages: torch.Tensor, row_bytes: int,
                   to_device: bool, block_bytes: int = 0, order: str = ""
                   ) -> list[Launch] | None:
    """An engine's planes (layer 0 K, layer 0 V, ...: `[blocks, row]` each, anywhere) and
    host pages `[pages, layers, 2, row]`: per layer one launch, towards the planes
    (`to_device`, a load) or towards the pages; None when a layer's K and V planes differ
    in block stride or a row is not contiguous (the kernel's model has one block stride)."""
    out: list[Launch] = []
    for layer in range(len(planes) // 2):
        k, v = planes[2 * layer], planes[2 * layer + 1]
        if k.stride(0) != v.stride(0) or k.stride(1) != 1 or v.stride(1) != 1:
            return None
        side = Side(k, k.stride(0) * k.element_size(), 0, v.data_ptr() - k.data_ptr())
        host = Side.of(pages[:, layer], pages.stride(0), 0, pages.stride(2))
        src, dst = (host, side) if to_device else (side, host)
        out.append(prepare(src, dst, row_bytes, 2, block_bytes, order))
    return out


def _as_elements(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat view of `t`'s storage from `t`'s first element to the storage's end, as
    `dtype` (the kernel needs only the base pointer and its element type; the caller checked
    that the base is aligned to `dtype`)."""
    size = torch.empty((), dtype=dtype).element_size()
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()
    numel = (storage.nbytes() - start) // size
    return torch.empty(0, dtype=dtype, device=t.device).set_(
        storage, start // size, (numel,), (1,))


class IdRing:
    """Block ids of one copy stream's tasks, moved to the device without a pageable copy or
    an allocation per task: `slots` pinned host rows and as many device rows, `[2, cap]`
    int64 each (sources then destinations), reused round-robin.

    (Kernels reading the ids from the pinned row in place, with no DMA, were measured on an
    H100: host time before the first launch fell from about 108 to 68 us, but every program
    then reads its two ids over the bus, and the 256 KiB x 512-block copies lost 0.02-0.05
    of a pinned copy's rate; the DMA stayed.)

    Invariants: a host row is rewritten only after the DMA that read it has completed (its
    event); a device row is rewritten by a DMA on the same stream as every kernel that reads
    it, so stream order keeps the readers ahead of the next write. A task with more ids than
    `cap` grows the ring (after the stream drained, so no reader of the old rows is left)."""

    def __init__(self, device: torch.device, slots: int = 8, cap: int = 1024) -> None:
        self.device = device
        self.slots = slots
        self._lock = threading.Lock()
        self._alloc(cap)

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        pin = self.device.type == "cuda"
        self._host = torch.empty((self.slots, 2 * cap), dtype=torch.int64, pin_memory=pin)
        self._dev = torch.empty((self.slots, 2 * cap), dtype=torch.int64, device=self.device)
        self._host_np = self._host.numpy()
        self._events: list[torch.cuda.Event | None] = [None] * self.slots
        self._event_pool = [torch.cuda.Event() for _ in range(self.slots)] if pin else []
        self._next = 0

    def put(self, src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream | None
            ) -> torch.Tensor:
        """`[src..., dst...]` on the device, enqueued on `stream` (the current one when None)."""
        n = int(src.numel())
        with self._lock:
            if n > self.cap:
                if stream is not None:
                    stream.synchronize()
                cap = self.cap
                while cap < n:
                    cap *= 2
                self._alloc(cap)
            slot = self._next
            self._next = (slot + 1) % self.slots
            ev = self._events[slot]
            if ev is not None:
                ev.synchronize()  # the DMA that read this host row is done (rarely waits)
            # numpy for the two small fills: a torch op on a 64-id tensor costs ~5-10 us of
            # host time each, which a small load pays before its first launch
            row = self._host_np[slot]
            row[:n] = src.numpy()
            row[n : 2 * n] = dst.numpy()
            host = self._host[slot, : 2 * n]
            dev = self._dev[slot, : 2 * n]
            if self.device.type != "cuda":
                dev.copy_(host)
                return dev
            dev.copy_(host, non_blocking=True)
            done = self._event_pool[slot]
            done.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            self._events[slot] = done
            return dev


GRAPH_ENV = "KVTIER_FUSED_GRAPH_MAX_IDS"
GRAPH_MAX_IDS = int(os.environ.get(GRAPH_ENV, 256))
"""Tasks of up to this many pairs replay CUDA graphs that read their ids in place from a
pinned row (`GraphLaunches`); larger ones go through the `IdRing` and Triton's dispatch.
Why by size: a small copy is bound by the host time before its first launch (H100, 16 KiB
x 64-block backup: ring 88 us, launch 50 us of about 200 us of host time, the kernel itself
as fast as a memcpy), a large one by the bus, where every program reading its two ids over
the bus cost the 256 KiB x 512-block copies 0.02-0.05 of a pinned copy's rate. `0` turns
the graphs off."""
GRAPH_MIN_IDS = 16
"""The smallest padded size: every task of up to 16 pairs shares one set of graphs."""


def graph_cap(n: int, max_ids: int = -1) -> int:
    """The padded size whose graphs replay a task of `n` pairs (the next power of two, at
    least `GRAPH_MIN_IDS`), or 0 when the task goes through the ring (`n` over `max_ids`,
    default `GRAPH_MAX_IDS`, or no pairs)."""
    limit = GRAPH_MAX_IDS if max_ids < 0 else max_ids
    if n <= 0 or n > limit:
        return 0
    cap = GRAPH_MIN_IDS
    while cap < n:
        cap *= 2
    return cap


class GraphLaunches:
    """CUDA graphs of prepared launches, replayed with a new task's ids: the host writes the
    ids into a pinned row and replays, two cheap calls where the dispatch path pays an id
    DMA, its event and Triton's argument handling per launch.

    Data: `_rows[cap]` one pinned int64 row `[2 * cap]` per padded size (`graph_cap`):
    sources, padded with -1, then destinations; the graphs' kernels read it in place through
    the mapped address (`Launch.run(..., padded=True)`: a pair with a negative source moves
    nothing). `_graphs[(key, cap)]` the graphs of one launch sequence (`key` names it: a
    direction, a layer group list), one graph per group, so a caller can record an event
    between two replays (a load's layer 0).

    Invariants: a row is rewritten only when no replay that reads it can still run: callers
    hold `lock` from `stage` until the copy stream has passed the last replay (a backup
    synchronises, a load waits for its last layer's event). A capture that fails sets
    `broken` (the reason) and every later call answers None: the caller keeps the dispatch
    path, which moves the same bytes."""

    def __init__(self, device: torch.device, max_ids: int = -1) -> None:
        self.device = device
        self.max_ids = GRAPH_MAX_IDS if max_ids < 0 else max_ids
        self.lock = threading.Lock()
        self.broken: str | None = None
        self._rows: dict[int, torch.Tensor] = {}
        self._graphs: dict[tuple[str, int], list[torch.cuda.CUDAGraph]] = {}

    def cap_for(self, n: int) -> int:
        """The padded size for `n` pairs, or 0 when the graphs are off or broken for it."""
        return 0 if self.broken is not None else graph_cap(n, self.max_ids)

    def _row(self, cap: int) -> torch.Tensor:
        row = self._rows.get(cap)
        if row is None:
            row = torch.full((2 * cap,), -1, dtype=torch.int64, pin_memory=True)
            self._rows[cap] = row
        return row

    def graphs(self, key: str, cap: int, groups: list[list[Launch]]
               ) -> list[torch.cuda.CUDAGraph] | None:
        """The graphs of `groups` (each a list of launches replayed as one) at size `cap`,
        captured on first use (under `lock`); None when capturing failed."""
        got = self._graphs.get((key, cap))
        if got is not None or self.broken is not None:
            return got
        row = self._row(cap)
        row.fill_(-1)  # the warm-up launches move nothing
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        out: list[torch.cuda.CUDAGraph] = []
        try:
            with torch.cuda.stream(side):
                for group in groups:  # compile outside the capture
                    for launch in group:
                        launch.run(row, cap, padded=True)
                side.synchronize()
                for group in groups:
                    g = torch.cuda.CUDAGraph()
                    # thread-local: the other direction's thread keeps working meanwhile
                    g.capture_begin(capture_error_mode="thread_local")
                    try:
                        for launch in group:
                            launch.run(row, cap, padded=True)
                    finally:
                        g.capture_end()
                    out.append(g)
            side.synchronize()
        except RuntimeError as e:  # pragma: no cover - depends on the driver and Triton
            self.broken = f"CUDA graph capture failed: {e}"
            return None
        self._graphs[(key, cap)] = out
        return out

    def stage(self, src: torch.Tensor, dst: torch.Tensor, cap: int) -> None:
        """Write a task's ids (CPU int64, `n <= cap` each) into the row the graphs of size
        `cap` read (the caller holds `lock` and the previous replays have finished)."""
        n = int(src.numel())
        row = self._row(cap).numpy()
        row[:n] = src.numpy()
        row[n:cap] = -1
        row[cap : cap + n] = dst.numpy()
