"""The KV bytes of one rank: the device pool (L1) and the host pool (L2).

The two pools are laid out for different readers:

* The **device pool** is what attention kernels read: per layer one K and one V tensor of shape
  `[num_blocks, block_size, num_kv_heads, head_dim]`. All of them are views into one allocation
  `[num_layers, 2, num_blocks, ...]`, so one block's bytes across every layer form a single
  strided view and a copy engine can move a whole block (all layers) with one copy.
* The **host pool** is `page_first`: block `b` holds every layer's K and V contiguously
  (`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`), so a block is one
  contiguous page. Storage I/O then reads or writes one page per block, and evictions write
  large contiguous runs. It lives in a POSIX shared-memory segment so other processes on the
  machine (tests, diagnostics) can map it, and it is pinned for DMA when CUDA is present.

"Every layer" means `total_layers` = the model's `num_layers`, then `num_extra_layers` (MTP
draft layers). With `kv_scales`, the device pool also holds the blocks' float32 scales in a
tensor of their own (`scales`), and each host page ends with its block's scales (a trailer,
`kvtier.worker.page_layout`), so a page still holds the whole block.

Sizes are validated up front against the memory the machine actually has, because a pool that
does not fit fails late and confusingly (OOM kill, SIGBUS on a full /dev/shm) otherwise; the
host segment's pages are also allocated at creation (`posix_fallocate`), so /dev/shm filling
up later can never turn a touch of the pool into a SIGBUS.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Literal

import numpy as np
import posix_ipc
import torch
from kvtier.worker import numa
from kvtier.worker.errors import KvtierError
from kvtier.worker.page_layout import PageLayout

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
}

DeviceChoice = Literal["auto", "cpu", "cuda"]

# cudaHostRegisterPortable | cudaHostRegisterMapped: the pinned host pool is usable from every
# CUDA context of the process (a rank's worker may register before it selects its device) and
# mapped into the device address space, so kernels read and write it directly (zero-copy, see
# `HostPool.device_view`).
_HOST_REGISTER_FLAGS = 0x01 | 0x02


class PoolConfigError(KvtierError, ValueError):
    """A pool cannot be built as asked (bad size, unknown dtype or device, not enough memory)."""


class BlockIdError(KvtierError, ValueError):
    """Block ids handed to a pool operation are malformed (range, length, duplicates)."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a config string such as "float16" to its torch dtype (torch dtypes pass through)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise PoolConfigError(f"dtype: {dtype} is not supported (one of {sorted(DTYPES)})")
        return dtype
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise PoolConfigError(
            f"dtype: {dtype!r} is not supported (one of {sorted(DTYPES)})"
        ) from None


@dataclass(frozen=True)
class KVShape:
    """The KV geometry of one rank. `dtype` may be given as a string ("float16", ...); it is
    stored as a torch dtype. All sizes are positive integers (checked at construction).

    `num_extra_layers` (>= 0) are KV layers beyond the model's `num_layers` (the MTP draft
    layers of speculative decoding); every pool holds `total_layers`, the extra ones after the
    main ones. `kv_scales`: every block also carries float32 scales per layer, K and V and KV
    head (quantized KV, e.g. float8), in every tier; see `kvtier.worker.page_layout`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_extra_layers: int = 0
    kv_scales: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PoolConfigError(f"{name}: must be a positive integer, got {value!r}")
        extra = self.num_extra_layers
        if isinstance(extra, bool) or not isinstance(extra, int) or extra < 0:
            raise PoolConfigError(f"num_extra_layers: must be an integer >= 0, got {extra!r}")
        if not isinstance(self.kv_scales, bool):
            raise PoolConfigError(f"kv_scales: must be a bool, got {self.kv_scales!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.num_layers, self.num_extra_layers, self.num_kv_heads,
                          self.head_dim, self.block_size, self.itemsize, self.kv_scales)

    @property
    def total_layers(self) -> int:
        """Layers in every pool: the model's `num_layers`, then the extra ones."""
        return self.num_layers + self.num_extra_layers

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's K (or V): [block_size, num_kv_heads, head_dim]."""
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def k_bytes(self) -> int:
        """Bytes of one block of one layer's K; V has the same size."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one block of one layer, K and V together."""
        return 2 * self.k_bytes

    @property
    def kv_bytes(self) -> int:
        """Bytes of one block's K and V over all layers (extra ones included)."""
        return self.total_layers * self.layer_bytes

    @property
    def scale_planes(self) -> int:
        """Scale planes of a device tier: K and V of every layer (0 without scales)."""
        return 2 * self.total_layers if self.kv_scales else 0

    @property
    def page_bytes(self) -> int:
        """Bytes of one block over all layers, K and V, and its scales (if any): one host
        page / storage page."""
        return self.layout.page_bytes


def page_kv_view(pages: torch.Tensor, shape: KVShape, dtype: torch.dtype) -> torch.Tensor:
    """The K and V of `pages` (a uint8 tensor `[n, page_bytes]`, rows contiguous) as
    `[n, total_layers, 2, row]` in `dtype` (the row is one block of one layer's K or V);
    a strided view (the page is the stride) when pages carry scales."""
    n = pages.shape[0]
    kv = pages if not shape.kv_scales else pages[:, : shape.kv_bytes]
    return kv.view(dtype).view(n, shape.total_layers, 2, -1)


def page_scale_view(pages: torch.Tensor, shape: KVShape) -> torch.Tensor | None:
    """The scales of `pages` (uint8 `[n, page_bytes]`) as float32 `[n, total_layers * 2,
    num_kv_heads]` (index 2 * layer + (0 for K, 1 for V)), or None without scales."""
    if not shape.kv_scales:
        return None
    lay = shape.layout
    n = pages.shape[0]
    return pages[:, lay.scale_offset : lay.scale_offset + lay.scale_bytes].view(
        torch.float32).view(n, 2 * shape.total_layers, shape.num_kv_heads)


def _mem_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where the file does not exist."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _shm_free_bytes() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PoolConfigError(f"{name}: must be a positive integer, got {value!r}")


def resolve_device(device: str) -> torch.device:
    """The torch device of a pool, always with an explicit index on CUDA.

    "auto" -> the current CUDA device when available, else cpu; "cuda" -> the current CUDA
    device; "cuda:N" -> device N (a rank's worker is handed its own, see
    the manager's `config.rank_device`). CUDA asked for where there is none, or an index
    past the visible devices, is an error, not a fallback: an operator who asked for a GPU
    must not silently get a CPU pool or another rank's GPU."""
    if device == "cpu":
        return torch.device("cpu")
    if device == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    if device in ("auto", "cuda"):
        device = "cuda"
    elif not (device.startswith("cuda:") and device[5:].isdigit()):
        raise PoolConfigError(
            f"device: {device!r} is not one of 'auto', 'cpu', 'cuda' or 'cuda:<index>'")
    if not torch.cuda.is_available():
        raise PoolConfigError(
            f"device: {device!r} requested but CUDA is not available (use 'auto' or 'cpu')")
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    index, visible = int(device[5:]), torch.cuda.device_count()
    if index >= visible:
        raise PoolConfigError(
            f"device: {device!r} but only {visible} CUDA device(s) are visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
    return torch.device("cuda", index)


def as_block_ids(
    ids: Sequence[int] | torch.Tensor, num_blocks: int, what: str, *, unique: bool
) -> torch.Tensor:
    """Validate block ids and return them as a 1-D int64 CPU tensor.

    `what` names the ids in error messages ("d2h: host ids"). `unique` rejects duplicates
    (destination ids: two sources for one block would leave its content undefined).
    """
    if isinstance(ids, torch.Tensor):
        t = ids
        if t.dtype != torch.int64 or t.device.type != "cpu" or t.requires_grad:
            t = ids.detach().to("cpu")
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise BlockIdError(f"{what}: ids must be integers, got dtype {t.dtype}")
            t = t.to(torch.int64)
    else:
        items = list(ids)
        if not all(isinstance(x, Integral) and not isinstance(x, bool) for x in items):
            bad = next(x for x in items if not isinstance(x, Integral) or isinstance(x, bool))
            raise BlockIdError(f"{what}: ids must be integers, got {bad!r}")
        try:
            t = torch.tensor(items, dtype=torch.int64)
        except (RuntimeError, OverflowError):
            raise BlockIdError(f"{what}: block id out of the int64 range") from None
    if t.dim() != 1:
        raise BlockIdError(f"{what}: ids must be one-dimensional, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        t = t.contiguous()
    n = t.numel()
    if n:
        # a load's ids are checked before its first copy is enqueued, so this is on the
        # critical path of every small load: torch ops on a 64-id tensor cost ~5-10 us of
        # host time each (an H100 host took 98 us for a copy's two checks). Small tasks go
        # through a Python list (min, max, a set), large ones through numpy: best of five on
        # the build machine, 64 ids took 17 us as a list against 34 us with numpy (41 us
        # with the torch conversions before), 256 ids 71 against 41.
        if n <= SMALL_IDS:
            lst = t.tolist()
            lo, hi = min(lst), max(lst)
            dup = unique and len(set(lst)) != n
        else:
            a = t.numpy()
            lo, hi = int(a.min()), int(a.max())
            dup = False
            if unique:
                srt = np.sort(a)
                dup = bool((srt[1:] == srt[:-1]).any())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise BlockIdError(f"{what}: block id {bad} out of range [0, {num_blocks})")
        if dup:
            first = min(x for x, c in Counter(t.tolist()).items() if c > 1)
            raise BlockIdError(f"{what}: block id {first} appears more than once")
    return t


SMALL_IDS = 128
"""Up to this many ids are checked as a Python list, more with numpy (the two took about
the same time at 128 ids on the build machine's CPU)."""


class DevicePool:
    """Per-layer K and V caches of one rank, in the layout attention kernels read.

    Data structures: `data` is one tensor `[total_layers, 2, num_blocks, block_size,
    num_kv_heads, head_dim]` (index 0 = K, 1 = V; the extra layers after the model's);
    `k_caches[l]` and `v_caches[l]` are contiguous views `data[l, 0]` and `data[l, 1]`.
    With `shape.kv_scales`, `scales` is float32 `[total_layers * 2, num_blocks,
    num_kv_heads]` (plane 2 * l + 0 = layer l's K scales, + 1 its V scales) and
    `scale_planes[p]` = `scales[p]`; without, `scales` is None and `scale_planes` empty.
    Invariant: the views never outlive or re-point away from `data`; block `b` of every
    layer is `data[:, :, b]`, its scales `scales[:, b]`.
    """

    def __init__(self, shape: KVShape, num_blocks: int, device: str = "auto") -> None:
        _check_positive("device_blocks", num_blocks)
        self.shape = shape
        self.num_blocks = num_blocks
        self.device = resolve_device(device)
        self.nbytes = num_blocks * shape.page_bytes
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            if self.nbytes > free:
                raise PoolConfigError(
                    f"device_blocks: {num_blocks} blocks need {_gib(self.nbytes)} but the GPU "
                    f"has {_gib(free)} free"
                )
        else:
            avail = _mem_available_bytes()
            if avail is not None and self.nbytes > avail:
                raise PoolConfigError(
                    f"device_blocks: {num_blocks} blocks need {_gib(self.nbytes)} but only "
                    f"{_gib(avail)} of memory is available (MemAvailable)"
                )
        self.data = torch.zeros(
            (shape.total_layers, 2, num_blocks, *shape.block_shape),
            dtype=shape.dtype,
            device=self.device,
        )
        # Per block, layer, half and KV head: one float32 (kv_scales), kept apart from the
        # KV as an engine keeps its scale tensors beside its caches.
        self.scales: torch.Tensor | None = None
        self.scale_planes: list[torch.Tensor] = []
        if shape.kv_scales:
            self.scales = torch.zeros((shape.scale_planes, num_blocks, shape.num_kv_heads),
                                      dtype=torch.float32, device=self.device)
            self.scale_planes = list(self.scales.unbind(0))
        layers = range(shape.total_layers)
        self.k_caches: list[torch.Tensor] = [self.data[layer, 0] for layer in layers]
        self.v_caches: list[torch.Tensor] = [self.data[layer, 1] for layer in layers]
        # The same memory as every other pool shows it (see PlanePool); the copy engine and
        # the content checker keep their single-allocation fast paths for this class.
        self.planes: list[torch.Tensor] = [
            self.data[layer, kv].view(num_blocks, -1) for layer in layers for kv in (0, 1)]

    def __repr__(self) -> str:
        return (
            f"DevicePool(blocks={self.num_blocks}, device={self.device}, "
            f"bytes={self.nbytes}, shape={self.shape})"
        )


class PlanePool:
    """A device pool kvtier did not allocate (an engine's KV, attached by
    `kvtier.worker.engine_pool`): only its **planes** are known, `2 * total_layers` views
    `[num_blocks, row]` (layer 0 K, layer 0 V, layer 1 K, ...; extra layers last), row =
    one block of one layer's K or V, contiguous, in the engine's element order. Planes may
    live anywhere (one allocation, one per layer, one per half) and rows may be strided
    apart. With `shape.kv_scales`, `scale_planes` are `2 * total_layers` float32 views
    `[num_blocks, num_kv_heads]` in the same order (the engine's K and V scale tensors).

    Invariants (checked here): every plane has shape [num_blocks, row elements] with the
    row contiguous, the pool's dtype and device; the row holds `shape.k_bytes` bytes; the
    scale planes likewise, float32, rows of `num_kv_heads`."""

    def __init__(self, shape: KVShape, planes: Sequence[torch.Tensor], *,
                 layout: str = "planes", scale_planes: Sequence[torch.Tensor] = ()) -> None:
        planes = list(planes)
        if len(planes) != 2 * shape.total_layers:
            raise PoolConfigError(
                f"{len(planes)} planes for {shape.total_layers} layers (expected "
                f"{2 * shape.total_layers}: K and V of every layer)")
        row = shape.k_bytes // shape.itemsize
        first = planes[0]
        for i, p in enumerate(planes):
            where = f"plane {i} (layer {i // 2} {'KV'[i % 2]})"
            if p.dtype != shape.dtype:
                raise PoolConfigError(f"{where}: dtype {p.dtype}, expected {shape.dtype}")
            if p.device != first.device:
                raise PoolConfigError(f"{where}: on {p.device}, plane 0 is on {first.device}")
            if p.dim() != 2 or p.shape[1] != row or p.shape[0] != first.shape[0]:
                raise PoolConfigError(
                    f"{where}: shape {tuple(p.shape)}, expected [{first.shape[0]}, {row}]")
            if row > 1 and p.stride(1) != 1:
                raise PoolConfigError(f"{where}: a row is not contiguous (strides {p.stride()})")
        scale_planes = list(scale_planes)
        if len(scale_planes) != shape.scale_planes:
            raise PoolConfigError(
                f"{len(scale_planes)} scale planes, expected {shape.scale_planes} (kv_scales "
                f"{'on' if shape.kv_scales else 'off'}, {shape.total_layers} layers)")
        for i, p in enumerate(scale_planes):
            where = f"scale plane {i} (layer {i // 2} {'KV'[i % 2]})"
            if p.dtype != torch.float32 or p.device != first.device:
                raise PoolConfigError(
                    f"{where}: {p.dtype} on {p.device}, expected torch.float32 on "
                    f"{first.device}")
            if (p.dim() != 2 or p.shape[0] != first.shape[0] or p.shape[1] != shape.num_kv_heads
                    or (shape.num_kv_heads > 1 and p.stride(1) != 1)):
                raise PoolConfigError(
                    f"{where}: shape {tuple(p.shape)} strides {p.stride()}, expected "
                    f"[{first.shape[0]}, {shape.num_kv_heads}] with contiguous rows")
        self.shape = shape
        self.planes = planes
        self.scale_planes = scale_planes
        self.num_blocks = int(first.shape[0])
        self.device = first.device
        self.layout = layout
        self.nbytes = self.num_blocks * shape.page_bytes

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(layout={self.layout!r}, blocks={self.num_blocks}, "
                f"device={self.device}, shape={self.shape})")


DeviceKV = DevicePool | PlanePool
"""What a device tier is to the copy engine, the content checker and the executor."""


class HostPool:
    """The host tier of one rank: `page_first` pages in a POSIX shared-memory segment.

    Data structures: `inode` identifies the segment (a replacement under the same name is
    another inode); `data` is a uint8 tensor `[num_blocks, page_bytes]` over the mmapped
    segment; `kv` is the K and V of the same memory typed as `[num_blocks, total_layers, 2,
    block_size, num_kv_heads, head_dim]` (strided by the page when pages carry scales);
    `scales` the scale trailer of every page as float32 `[num_blocks, total_layers * 2,
    num_kv_heads]`, or None (`kvtier.worker.page_layout`). Invariants: the segment exists
    under `name` from construction until `close()` (owner only); `close()` is idempotent
    and, for the owner, always unlinks the name; the mapping itself is released as soon as
    no view into it remains, so a view still held elsewhere never points into unmapped
    memory.
    """

    def __init__(self, shape: KVShape, num_blocks: int, name: str,
                 numa_node: int | None = None) -> None:
        _check_positive("host_blocks", num_blocks)
        _check_name(name)
        self.shape = shape
        self.num_blocks = num_blocks
        self.name = name
        self.nbytes = num_blocks * shape.page_bytes
        self.owner = True
        self.pinned = False
        self._closed = True
        self.numa_node = numa_node  # None: not bound (see kvtier.worker.numa)
        shm_free = _shm_free_bytes()
        if shm_free is not None and self.nbytes > shm_free:
            raise PoolConfigError(
                f"host_blocks: {num_blocks} blocks need {_gib(self.nbytes)} but /dev/shm has "
                f"{_gib(shm_free)} free (raise the container's shm_size or lower host_blocks)"
            )
        avail = _mem_available_bytes()
        if avail is not None and self.nbytes > avail:
            raise PoolConfigError(
                f"host_blocks: {num_blocks} blocks need {_gib(self.nbytes)} but only "
                f"{_gib(avail)} of memory is available (MemAvailable)"
            )
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)  # a stale segment of a dead deployment
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=self.nbytes)
        try:
            os.fchmod(shm.fd, 0o600)  # shm_open applies the umask; make the mode exact
            fd = shm.fd

            def place(address: int) -> None:
                # Before any page exists: the NUMA policy, then every page allocated under it.
                if numa_node is not None:
                    numa.bind(address, self.nbytes, numa_node)
                self._reserve(fd)

            self._map(fd, place)
        except BaseException:
            shm.close_fd()
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
            raise
        self.inode = os.fstat(shm.fd).st_ino
        shm.close_fd()
        self._arm_finalizer()

    def _reserve(self, fd: int) -> None:
        """Allocate every page of the segment now. A segment is sparse until written, so a
        /dev/shm that runs out later would kill the worker with SIGBUS on its first touch of
        an unbacked page; reserved up front, a shortage is this start-up error instead."""
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            on = "" if self.numa_node is None else f" on NUMA node {self.numa_node}"
            raise PoolConfigError(
                f"cache.host_blocks: {self.num_blocks} blocks need {_gib(self.nbytes)} of "
                f"/dev/shm{on} but reserving them failed ({os.strerror(e.errno or 0)}): raise "
                "the container's shm_size or lower cache.host_blocks"
                + ("" if self.numa_node is None else " (or set workers.host_numa)")
            ) from None

    @classmethod
    def attach(cls, name: str, shape: KVShape) -> HostPool:
        """Map an existing segment read/write from another process. The attached pool never
        unlinks the segment; its `close()` only drops this process's mapping."""
        _check_name(name)
        try:
            shm = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError:
            raise PoolConfigError(f"host pool segment {name!r} does not exist") from None
        try:
            size = shm.size
            if size == 0 or size % shape.page_bytes:
                raise PoolConfigError(
                    f"host pool segment {name!r} has {size} bytes, not a whole number of "
                    f"{shape.page_bytes}-byte pages for {shape}"
                )
            self = cls.__new__(cls)
            self.shape = shape
            self.num_blocks = size // shape.page_bytes
            self.name = name
            self.nbytes = size
            self.owner = False
            self.pinned = False
            self._closed = True
            self.numa_node = None  # the owner's binding holds; not known here
            # Which segment this is: a worker replaced under the same name creates a new one
            # (another inode), so an attacher can tell its mapping is of a dead worker's pool.
            self.inode = os.fstat(shm.fd).st_ino
            self._map(shm.fd)
        finally:
            shm.close_fd()
        self._arm_finalizer()
        return self

    def prefault(self) -> threading.Thread | None:
        """Fault this process's mapping of every page in, on a thread of its own, and return
        it (None where there is nothing to do: a pinned pool, whose registration already
        faulted it, or a closed one).

        Why: an attached mapping starts with no page table entries, so the first copy into
        each 4 KiB page of the segment takes a minor fault. Measured here (12-layer 768 KiB
        pages, 9-block store through `HostCopier`): 6.0 ms and 1,733 faults on pages this
        process never touched, 1.7 ms on pages it had, so until every page of a fresh pool had
        been used once, each store cost an engine step 3.5x its copy. MADV_POPULATE_WRITE
        (Linux >= 5.14; older kernels refuse it and pages fault on use as before) fills the
        table ahead at ~165 ms per GiB of kernel time here; through ctypes, which releases the
        GIL, in 64 MiB chunks, stopping when the pool closes. The thread holds a view of the
        mapping, so an unmapping waits for it (see `_release_mapping`)."""
        if self._closed or self.pinned:
            return None
        view = self.data  # keeps the mapping alive while the thread runs
        t = threading.Thread(target=self._populate, args=(view,), daemon=True,
                             name=f"kvtier-prefault{self.name.replace('/', '-')}")
        t.start()
        return t

    def _populate(self, view: torch.Tensor) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        base, end, chunk = view.data_ptr(), view.data_ptr() + self.nbytes, 64 << 20
        for at in range(base, end, chunk):
            if self._closed:
                return
            if libc.madvise(ctypes.c_void_p(at), ctypes.c_size_t(min(chunk, end - at)),
                            _MADV_POPULATE_WRITE) != 0:
                return  # EINVAL on kernels before 5.14: pages fault on first use instead

    def _arm_finalizer(self) -> None:
        """Last resort for a pool that is never closed (an exception path that skipped
        close()): at garbage collection or interpreter exit, unpin and (owner only) unlink, in
        this process only, so a forked child exiting never removes its parent's segment."""
        self._finalizer = weakref.finalize(
            self,
            _finalize,
            self.name if self.owner else None,
            os.getpid(),
            self.data.data_ptr() if self.pinned else 0,
        )

    def _map(self, fd: int, place: Callable[[int], None] | None = None) -> None:
        """Map the segment; `place(address)` runs before anything touches a page (the
        owner's NUMA binding and reservation)."""
        self._mm: mmap.mmap | None = mmap.mmap(fd, self.nbytes)
        self._closed = False
        try:
            raw = torch.frombuffer(self._mm, dtype=torch.uint8)
            if place is not None:
                place(raw.data_ptr())
            self.data = raw.view(self.num_blocks, self.shape.page_bytes)
            self.kv = page_kv_view(self.data, self.shape, self.shape.dtype).view(
                self.num_blocks, self.shape.total_layers, 2, *self.shape.block_shape
            )
            self.scales = page_scale_view(self.data, self.shape)
            if torch.cuda.is_available():
                err = torch.cuda.cudart().cudaHostRegister(
                    self.data.data_ptr(), self.nbytes, _HOST_REGISTER_FLAGS)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of {self.name} failed: {err}")
                self.pinned = True
        except BaseException:
            self._release_mapping()
            raise

    @property
    def closed(self) -> bool:
        return self._closed

    def device_view(self, device: torch.device) -> torch.Tensor | None:
        """The whole pool as a uint8 tensor *on `device`* that aliases the pinned mapping
        (unified addressing: the registered host pointer is valid on the GPU), so gather and
        scatter kernels move pages over the bus in one pass with no staging copy. None when
        the pool is not pinned or the runtime refuses the alias (then copies are staged).

        Measured on an H100 (PCIe Gen5, torch 2.11): a gather of 512 random 64 KiB blocks x 32
        layers through this view runs at 47 GB/s host->device against 54 GB/s for one
        contiguous pinned copy of the same bytes; staging through the CPU managed 21 GB/s.
        The view must not outlive the pool: `close()` unregisters the memory."""
        if not self.pinned or self._closed or device.type != "cuda":
            return None
        holder = _CudaArrayInterface(self.data, self.nbytes)
        try:
            return torch.as_tensor(holder, device=device)
        except (RuntimeError, TypeError, ValueError):
            return None

    def page_view(self, host_id: int) -> memoryview:
        """One block's page (all layers, K and V) as a writable memoryview, for storage I/O.
        Release it (or drop it) before expecting the mapping to go away."""
        off = self._page_offset(host_id)
        assert self._mm is not None
        return memoryview(self._mm)[off : off + self.shape.page_bytes]

    def page_tensor(self, host_id: int) -> torch.Tensor:
        """One block's page as a uint8 tensor view `[page_bytes]`."""
        self._page_offset(host_id)
        return self.data[host_id]

    def _page_offset(self, host_id: int) -> int:
        if self._closed:
            raise RuntimeError(f"host pool {self.name} is closed")
        if isinstance(host_id, bool) or not isinstance(host_id, int):
            raise BlockIdError(f"host id must be an integer, got {host_id!r}")
        if not 0 <= host_id < self.num_blocks:
            raise BlockIdError(f"host id {host_id} out of range [0, {self.num_blocks})")
        return host_id * self.shape.page_bytes

    def _release_mapping(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.data.data_ptr())
            self.pinned = False
        for attr in ("data", "kv", "scales"):
            if hasattr(self, attr):
                delattr(self, attr)
        mm, self._mm = self._mm, None
        self._closed = True
        if mm is None:
            return
        # Unmap now only when nothing else references the mapping (our local + the argument):
        # tensors built on it hold a reference, and closing under them would leave them
        # pointing at unmapped memory. Otherwise it is unmapped with its last view.
        if sys.getrefcount(mm) <= 2:
            with contextlib.suppress(BufferError):
                mm.close()

    def close(self) -> None:
        """Unpin, unmap and (owner only) unlink the segment. Safe to call more than once."""
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        if not self._closed:
            self._release_mapping()
        if self.owner:
            _finalize(self.name, os.getpid(), 0)
            self.owner = False

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostPool(name={self.name!r}, blocks={self.num_blocks}, bytes={self.nbytes}, "
            f"pinned={self.pinned}, closed={self._closed})"
        )


class _CudaArrayInterface:
    """`__cuda_array_interface__` over a pinned host tensor; holding `owner` keeps the
    mapping alive while a device alias made from it exists."""

    def __init__(self, owner: torch.Tensor, nbytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (owner.data_ptr(), False),
            "version": 3, "strides": None,
        }


def _finalize(name: str | None, creator_pid: int, pinned_ptr: int) -> None:
    if os.getpid() != creator_pid:
        return
    if pinned_ptr:
        torch.cuda.cudart().cudaHostUnregister(pinned_ptr)
    if name is not None:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; not in Python 3.11's mmap module


def _check_name(name: str) -> None:
    if (
        not isinstance(name, str)
        or len(name) < 2
        or not name.startswith("/")
        or "/" in name[1:]
        or len(name) > 255
    ):
        raise PoolConfigError(
            f"host pool name: {name!r} must look like '/kvtier_<deployment>_host_r<rank>' "
            "(one leading slash, no other slash, at most 255 characters)"
        )
