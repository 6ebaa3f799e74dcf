"""The model-runner side of an engine that owns its KV memory: register the rank's KV tensors
so the rank's kvtier worker attaches to them, and wait for a load layer by layer. It needs no
manager; the engine imports it in its own (model runner) process.

    kv = [shared_kv_tensor(dep, rank, (2, blocks, bs, heads, dim), torch.float16, tag=f"l{i}")
          for i in range(layers)]                       # CPU; on a GPU: torch.zeros(..., "cuda")
    with KVRegistration(dep, rank, kv, "vllm", block_size=bs, num_kv_heads=heads,
                        head_dim=dim) as reg:
        ...                                             # start the stack with workers.engine_kv
        waiter = LayerWaiter(dep, num_ranks)
        waiter.wait(hit.handle.seq, layer, timeout=5.0)  # per layer, before attention reads it
        # on a GPU, without a host sync: the compute stream waits on the worker's copy
        waiter.wait_stream(hit.handle.seq, layer, 5.0, registration=reg, stream=compute)

Layouts (every one without a copy; a *plane* is one layer's K or V as `[num_blocks, row]`,
row = block_size * num_kv_heads * head_dim elements, contiguous within a block):

* "kvtier":     one tensor `[layers, 2, blocks, block_size, heads, head_dim]`
* "vllm":       per layer one tensor `[2, blocks, block_size, heads, head_dim]`
* "fastdeploy": per layer a (K, V) pair, each `[blocks, heads, block_size, head_dim]`

The bytes of a row are moved as they lie, so pages written by one layout are only ever read
by the same layout: the workers' storage namespace includes the layout name.

Every layout lists the model's layers first and then its extra layers (`model.num_extra_layers`,
e.g. the MTP draft layers of speculative decoding): the registration holds
`num_layers + num_extra_layers` layers. With `model.kv_scales = "per_block_head"` (float8 KV)
the runner also registers its scale tensors, `scales=`: per layer (same order) a (K scales,
V scales) pair of float32 `[blocks, num_kv_heads]` tensors, which kvtier moves with their blocks
through every tier.

Where the memory must live: on a GPU any tensor of the caching allocator works (its storage is
exported through CUDA IPC, `UntypedStorage._share_cuda_`); on the CPU the worker maps the
memory by name, so it must come from `shared_kv_tensor` (a POSIX shared-memory segment).
The registration record format is described in `kvtier.worker.kvreg`.

Per-layer readiness on CUDA: a CUDA registration also exports `layer_event_slots` (default 4)
sets of per-layer inter-process events and a word table (see `kvtier.worker.kvreg`, "Layer
events"); the worker records event [seq % slots][layer] on its copy stream after enqueueing
that layer and publishes seq in the table; `LayerWaiter.wait_stream` polls the table (host
memory, no GPU call) and then has the compute stream wait on the event, so no host thread
waits for a copy. Where events are missing (CPU KV, a torch or driver that cannot export or
open them) it waits on the host as `wait` does. What has run: the record field, the word
table and the fallback, on the CPU; the GPU path is tested only where a GPU is (`cuda`
marker).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import mmap
import os
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvtier.worker.ipc import (
    LayerProgress,
    LayerWaitTimeout,
    TreeStatus,
    process_start_time,
    validate_deployment_id,
)
from kvtier.worker.kv_pools import DTYPES, PoolConfigError, parse_dtype
from kvtier.worker.kvreg import (
    LAYOUTS,
    SEGMENT_HEADER_BYTES,
    EngineKVError,
    LayerEventWords,
    Layout,
    Record,
    create_segment,
    encode_cuda_fields,
    encode_record,
    kv_segment_name,
    live_segment_owner,
    publish_segment,
    read_record,
    registration_name,
    remove_registration,
    segment_header,
    segment_owner,
    unlink,
)

__all__ = [
    "EngineKVError",
    "KVRegistration",
    "LayerWaiter",
    "Layout",
    "kv_planes",
    "shared_kv_tensor",
]

log = logging.getLogger(__name__)

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
DEFAULT_LAYER_EVENT_SLOTS = 4
"""Event sets a CUDA registration exports: loads `seq` and `seq + 4` share one (the later
only makes a wait longer); more slots cost 64 bytes of IPC handle and one event each."""
_HALVES = ("K", "V")


# --------------------------------------------------------------------------- CPU memory


@dataclass
class _Segment:
    name: str
    mm: mmap.mmap
    base: int  # address of the first data byte (after the header)
    nbytes: int
    pid: int


_SEGMENTS: dict[str, _Segment] = {}
_LOCK = threading.Lock()


def shared_kv_tensor(deployment_id: str, rank: int, shape: Sequence[int], dtype: torch.dtype,
                     *, tag: str = "kv") -> torch.Tensor:
    """A zeroed CPU tensor of `shape` and `dtype` in a POSIX shared-memory segment
    `/kvtier_<deployment_id>_kvmem_r<rank>_<tag>` (mode 0600) that the rank's worker maps
    by name once the tensor is registered (`KVRegistration`). The registration's `close()`
    unlinks the segment; one never registered is unlinked when this process exits."""
    name = kv_segment_name(deployment_id, rank, tag)
    dims = list(shape)
    if not dims or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                           for d in dims):
        raise EngineKVError(f"shared_kv_tensor: shape must be positive integers, got {dims!r}")
    try:
        dtype = parse_dtype(dtype)
    except PoolConfigError as e:
        raise EngineKVError(f"shared_kv_tensor: {e}") from None
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(dims) * itemsize
    with _LOCK:
        if name in _SEGMENTS:
            raise EngineKVError(
                f"shared_kv_tensor: {name} already exists in this process; give each tensor "
                "of a rank its own tag")
        owner = live_segment_owner(name)  # issue 27: a reused pid is not the owner
        if owner is not None and owner != os.getpid():
            raise EngineKVError(f"shared_kv_tensor: {name} is in use by pid {owner}")
        unlink(name)  # a dead runner's segment of the same name
        mm = create_segment(name, size=SEGMENT_HEADER_BYTES + nbytes)
        try:
            mm[: len(segment_header(0, 0))] = segment_header(os.getpid(), nbytes)
            raw = torch.frombuffer(mm, dtype=torch.uint8, offset=SEGMENT_HEADER_BYTES,
                                   count=nbytes)
            t = raw.view(dtype).view(dims)
        except BaseException:
            unlink(name)
            raise
        _SEGMENTS[name] = _Segment(name, mm, raw.data_ptr(), nbytes, os.getpid())
    return t


def _release_segments(names: Sequence[str]) -> None:
    """Unlink segments this process made (the tensors on them stay valid)."""
    with _LOCK:
        for name in names:
            seg = _SEGMENTS.pop(name, None)
            if seg is not None and seg.pid == os.getpid():
                unlink(name)


@atexit.register
def _unlink_unregistered() -> None:
    _release_segments(list(_SEGMENTS))


def _segment_of(plane: torch.Tensor, where: str) -> tuple[str, int]:
    """The segment a CPU plane lives in and the plane's byte offset in it."""
    start = plane.data_ptr()
    extent = (sum((s - 1) * st for s, st in zip(plane.shape, plane.stride(), strict=True)) + 1
              ) * plane.element_size()
    with _LOCK:
        for seg in _SEGMENTS.values():
            if seg.base <= start and start + extent <= seg.base + seg.nbytes:
                return seg.name, SEGMENT_HEADER_BYTES + (start - seg.base)
    raise EngineKVError(
        f"{where}: a CPU KV tensor must be allocated with "
        "kvtier.worker.engine_kv.shared_kv_tensor(...) so the worker can map it; this one "
        "lives in this process's private memory")


# --------------------------------------------------------------------------- planes


@dataclass(frozen=True)
class KVPlanes:
    """What `kv_planes` found: the planes and the geometry they share."""

    planes: list[torch.Tensor]
    num_layers: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype


def _as_list(kv: object, what: str) -> list[Any]:
    if isinstance(kv, torch.Tensor) or not isinstance(kv, Sequence) or isinstance(kv, str):
        raise EngineKVError(f"layout {what!r}: expected a sequence with one entry per layer, "
                            f"got {type(kv).__name__}")
    if not kv:
        raise EngineKVError(f"layout {what!r}: no layers given")
    return list(kv)


def _check_dims(t: torch.Tensor, where: str, names: Sequence[str],
                want: dict[str, int]) -> None:
    if not isinstance(t, torch.Tensor):
        raise EngineKVError(f"{where}: expected a tensor, got {type(t).__name__}")
    if t.dim() != len(names):
        raise EngineKVError(
            f"{where}: {t.dim()} dimensions {tuple(t.shape)}, expected {len(names)} "
            f"[{', '.join(names)}]")
    for d, (name, size) in enumerate(zip(names, t.shape, strict=True)):
        if name in want and size != want[name]:
            raise EngineKVError(
                f"{where}: dimension {d} ({name}) is {size}, expected {want[name]}")


def _plane(t: torch.Tensor, where: str, row: int) -> torch.Tensor:
    try:
        p = t.view(t.shape[0], row)
    except RuntimeError:
        raise EngineKVError(
            f"{where}: the elements of one block are not contiguous (shape "
            f"{tuple(t.shape)}, strides {t.stride()}); a block must be one run of memory"
        ) from None
    if row > 1 and p.stride(1) != 1:
        raise EngineKVError(f"{where}: the elements of one block are not contiguous")
    return p


def kv_planes(kv: torch.Tensor | Sequence[torch.Tensor] | Sequence[tuple[torch.Tensor,
              torch.Tensor]], layout: Layout, *, block_size: int, num_kv_heads: int,
              head_dim: int) -> KVPlanes:
    """The planes of `kv` in `layout` (views, no copy): layer 0 K, layer 0 V, layer 1 K, ...
    Checks dtype, shape and device consistency; errors name the layer and the dimension."""
    if layout not in LAYOUTS:
        raise EngineKVError(f"layout {layout!r} is not one of {LAYOUTS}")
    for name, value in (("block_size", block_size), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise EngineKVError(f"{name} must be a positive integer, got {value!r}")
    row = block_size * num_kv_heads * head_dim
    want = {"block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "2 (K, V)": 2}
    block_dims = ("num_blocks", "block_size", "num_kv_heads", "head_dim")
    halves: list[tuple[str, torch.Tensor]] = []
    if layout == "kvtier":
        if not isinstance(kv, torch.Tensor):
            raise EngineKVError(
                f"layout 'kvtier': expected one tensor [layers, 2, blocks, block_size, "
                f"heads, head_dim], got {type(kv).__name__}")
        _check_dims(kv, "layout 'kvtier' tensor", ("num_layers", "2 (K, V)", *block_dims),
                    want)
        for layer in range(kv.shape[0]):
            halves += [(f"layer {layer} {h}", kv[layer, i]) for i, h in enumerate(_HALVES)]
    elif layout == "vllm":
        for layer, t in enumerate(_as_list(kv, layout)):
            _check_dims(t, f"layer {layer}", ("2 (K, V)", *block_dims), want)
            halves += [(f"layer {layer} {h}", t[i]) for i, h in enumerate(_HALVES)]
    else:
        fd_dims = ("num_blocks", "num_kv_heads", "block_size", "head_dim")
        for layer, pair in enumerate(_as_list(kv, layout)):
            if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
                raise EngineKVError(f"layer {layer}: expected a (K, V) pair of tensors")
            for h, t in zip(_HALVES, pair, strict=True):
                _check_dims(t, f"layer {layer} {h}", fd_dims, want)
                halves.append((f"layer {layer} {h}", t))
    first_where, first = halves[0]
    dtype, device, blocks = first.dtype, first.device, first.shape[0]
    if dtype not in _DTYPE_NAMES:
        raise EngineKVError(f"{first_where}: dtype {dtype} is not supported "
                            f"(one of {sorted(DTYPES)})")
    planes: list[torch.Tensor] = []
    seen: dict[int, str] = {}
    for where, t in halves:
        if t.dtype != dtype:
            raise EngineKVError(f"{where}: dtype {t.dtype}, {first_where} has {dtype}")
        if t.device != device:
            raise EngineKVError(f"{where}: on {t.device}, {first_where} is on {device}")
        if t.shape[0] != blocks:
            raise EngineKVError(
                f"{where}: dimension 0 (num_blocks) is {t.shape[0]}, {first_where} has {blocks}")
        p = _plane(t, where, row)
        if p.data_ptr() in seen:
            raise EngineKVError(f"{where} and {seen[p.data_ptr()]} are the same memory")
        seen[p.data_ptr()] = where
        planes.append(p)
    return KVPlanes(planes, len(planes) // 2, blocks, device, dtype)


def _scale_planes(scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
                  found: KVPlanes, num_kv_heads: int) -> list[torch.Tensor]:
    """The scale planes of `scales` (per layer a (K, V) pair of float32 `[blocks, heads]`),
    in plane order; checked against the KV planes `found`."""
    if scales is None:
        return []
    pairs = _as_list(scales, "scales")
    if len(pairs) != found.num_layers:
        raise EngineKVError(f"scales: {len(pairs)} layers, the KV has {found.num_layers}")
    out: list[torch.Tensor] = []
    for layer, pair in enumerate(pairs):
        if isinstance(pair, torch.Tensor) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise EngineKVError(f"scales of layer {layer}: expected a (K, V) pair of tensors")
        for h, t in zip(_HALVES, pair, strict=True):
            where = f"layer {layer} {h} scales"
            _check_dims(t, where, ("num_blocks", "num_kv_heads"),
                        {"num_blocks": found.num_blocks, "num_kv_heads": num_kv_heads})
            if t.dtype != torch.float32 or t.device != found.device:
                raise EngineKVError(f"{where}: {t.dtype} on {t.device}, expected "
                                    f"torch.float32 on {found.device} (where the KV is)")
            out.append(_plane(t, where, num_kv_heads))
    return out


# --------------------------------------------------------------------------- registration

_LIVE: dict[str, KVRegistration] = {}


class KVRegistration:
    """Publishes rank `rank`'s KV memory to its worker (see the module docstring); a context
    manager. The record lives in `/kvtier_<deployment_id>_kvreg_r<rank>` (mode 0600) until
    `close()`, which also unlinks the KV segments `shared_kv_tensor` made for it; a finalizer
    does both if the object is dropped unclosed, and the manager removes a dead runner's
    record when it starts or stops.

    Attributes: `planes` (2 * num_layers views `[num_blocks, row]`, layer 0 K, layer 0 V,
    ...; `num_layers` counts extra layers too), `scale_planes` (the same order, float32
    `[num_blocks, num_kv_heads]`; empty without `scales`), `num_blocks`, `num_layers`,
    `device`, `dtype`, `layout`, `nonce`, `name`."""

    def __init__(self, deployment_id: str, rank: int,
                 kv: torch.Tensor | Sequence[torch.Tensor]
                 | Sequence[tuple[torch.Tensor, torch.Tensor]],
                 layout: Layout, *, block_size: int, num_kv_heads: int, head_dim: int,
                 scales: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                 layer_event_slots: int = DEFAULT_LAYER_EVENT_SLOTS) -> None:
        validate_deployment_id(deployment_id)
        self.name = registration_name(deployment_id, rank)
        self.deployment_id, self.rank, self.layout = deployment_id, rank, layout
        self._closed = True
        found = kv_planes(kv, layout, block_size=block_size, num_kv_heads=num_kv_heads,
                          head_dim=head_dim)
        self.planes = found.planes
        self.num_layers, self.num_blocks = found.num_layers, found.num_blocks
        self.device, self.dtype = found.device, found.dtype
        self.scale_planes = _scale_planes(scales, found, num_kv_heads)
        self._kv = (kv, scales)  # keeps the memory alive as long as the registration
        if found.device.type not in ("cpu", "cuda"):
            raise EngineKVError(f"KV on {found.device}: only cpu and cuda can be registered")
        with _LOCK:
            if self.name in _LIVE:
                raise EngineKVError(
                    f"rank {rank} of deployment {deployment_id!r} is already registered in "
                    "this process; close that registration first")
        self._take_over_stale()
        segments: list[str] = []
        planes, device, uuid = self._describe(self.planes, "", segments)
        scale_planes = self._describe(self.scale_planes, " scales", segments)[0]
        self.events: list[list[Any]] = []  # [slot][layer] torch.cuda.Event (CUDA only)
        self.event_words: LayerEventWords | None = None
        owned: list[str] = []
        layer_events = None
        if self.device.type == "cuda" and layer_event_slots:
            layer_events = self._export_layer_events(layer_event_slots)
            if layer_events is not None:
                owned.append(layer_events["segment"])
        self.nonce = secrets.token_hex(16)
        itemsize = self.planes[0].element_size()
        record = Record(
            deployment_id=deployment_id, rank=rank, owner_pid=os.getpid(),
            owner_start=process_start_time(os.getpid()) or 0, nonce=self.nonce,
            device=device, device_uuid=uuid, dtype=_DTYPE_NAMES[self.dtype], layout=layout,
            num_layers=self.num_layers, num_blocks=self.num_blocks, block_size=block_size,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            row_bytes=block_size * num_kv_heads * head_dim * itemsize, planes=tuple(planes),
            scale_planes=tuple(scale_planes), layer_events=layer_events)
        self.record = record
        self._segments = segments
        self._owned = owned
        try:  # whole or not at all (issue 27: a half-written record blocked the rank)
            publish_segment(self.name, encode_record(record))
        except FileExistsError:
            raise EngineKVError(
                f"rank {rank} of deployment {deployment_id!r}: {self.name} was registered "
                "meanwhile by another process; close that registration first") from None
        self._closed = False
        with _LOCK:
            _LIVE[self.name] = self
        self._finalizer = weakref.finalize(self, _finalize, self.name, self.deployment_id,
                                           rank, self.nonce, segments, os.getpid(), owned)

    def _export_layer_events(self, slots: int) -> dict[str, Any] | None:
        """Create `slots x num_layers` inter-process CUDA events on the KV's device and the
        word table the worker publishes into; the record field describing them. None (the
        runner then waits on the host, `LayerWaiter.wait_stream`'s fallback) when this
        torch or driver cannot export events."""
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device())
        try:
            with torch.cuda.device(index):
                events = [[torch.cuda.Event(interprocess=True) for _ in range(self.num_layers)]
                          for _ in range(slots)]
                handles = [[bytes(e.ipc_handle()).hex() for e in row] for row in events]
        except (RuntimeError, AttributeError) as e:
            log.warning("rank %d: CUDA layer events cannot be exported (%s); per-layer waits "
                        "fall back to the host", self.rank, e)
            return None
        words = LayerEventWords.create(self.deployment_id, self.rank, slots, self.num_layers)
        self.events, self.event_words = events, words
        return {"segment": words.name, "slots": slots, "handles": handles}

    def layer_event(self, seq: int, layer: int) -> Any:
        """The CUDA event the worker records after enqueueing layer `layer` of load `seq`
        (None without layer events)."""
        if not self.events:
            return None
        return self.events[seq % len(self.events)][layer]

    def _take_over_stale(self) -> None:
        try:
            old = read_record(self.deployment_id, self.rank)
        except EngineKVError as e:
            # Malformed (a writer died before publish_segment existed) or not ours alone:
            # nobody can use it. Ours is replaced; another user's cannot be (one line).
            if not unlink(self.name):
                raise EngineKVError(f"rank {self.rank} of deployment {self.deployment_id!r} "
                                    f"cannot be registered: {e}") from None
            return
        if old is None:
            return
        if old.owner_pid != os.getpid() and old.owner_alive():
            raise EngineKVError(
                f"rank {self.rank} of deployment {self.deployment_id!r} is registered by the "
                f"running pid {old.owner_pid}; close that registration first")
        remove_registration(old)

    def _describe(self, tensors: list[torch.Tensor], what: str, segments: list[str]
                  ) -> tuple[list[dict[str, Any]], str, str]:
        """Plane records of `tensors` (KV or scale planes), the CPU segments they live in
        added to `segments`; the device name and the GPU's UUID."""
        planes: list[dict[str, Any]] = []
        if self.device.type == "cpu":
            for i, p in enumerate(tensors):
                seg, offset = _segment_of(p, f"layer {i // 2} {_HALVES[i % 2]}{what}")
                if seg not in segments:
                    segments.append(seg)
                planes.append({"segment": seg, "offset_bytes": offset,
                               "shape": list(p.shape), "strides": list(p.stride())})
            return planes, "cpu", ""
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device())
        shared: dict[tuple[int, int], dict[str, Any]] = {}
        for i, p in enumerate(tensors):
            storage = p.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in shared:
                try:
                    fields = storage._share_cuda_()  # type: ignore[no-untyped-call]
                except RuntimeError as e:
                    raise EngineKVError(
                        f"layer {i // 2} {_HALVES[i % 2]}{what}: its CUDA memory cannot be "
                        f"exported through CUDA IPC ({e})") from None
                shared[key] = encode_cuda_fields(fields)
            planes.append({"cuda": shared[key], "storage_offset": p.storage_offset(),
                           "shape": list(p.shape), "strides": list(p.stride())})
        return planes, f"cuda:{index}", _device_uuid(index)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unlink the record (if it is still this registration's) and the KV segments
        `shared_kv_tensor` made for it; the tensors stay valid in this process. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        if self.event_words is not None:
            self.event_words.close()
        _finalize(self.name, self.deployment_id, self.rank, self.nonce, self._segments,
                  os.getpid(), self._owned)

    def __enter__(self) -> KVRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVRegistration({self.name}, layout={self.layout!r}, layers={self.num_layers}, "
                f"blocks={self.num_blocks}, device={self.device}, closed={self._closed})")


def _finalize(name: str, deployment_id: str, rank: int, nonce: str, segments: list[str],
              pid: int, owned: Sequence[str] = ()) -> None:
    if os.getpid() != pid:  # a forked child never removes its parent's registration
        return
    for seg in owned:  # the layer-event word table: made for this registration only
        if segment_owner(seg) in (None, pid):
            unlink(seg)
    with _LOCK:
        _LIVE.pop(name, None)
    with contextlib.suppress(EngineKVError):
        current = read_record(deployment_id, rank)
        if current is not None and current.nonce == nonce:
            unlink(name)
    _release_segments(segments)


def _device_uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except (AttributeError, RuntimeError):
        return ""


# --------------------------------------------------------------------------- layer waits


class LayerWaiter:
    """Waits in the model runner until layer `layer` of a load is on every rank's device,
    reading the per-layer progress the workers publish in the deployment's control segment
    (read-only; no manager object needed). `wait` raises `LayerWaitTimeout` after `timeout`
    seconds, `TaskAborted` when the load failed on a rank or a rank's worker died during it,
    `DeploymentAsleep` while the deployment sleeps (or when it slept during the wait: the load
    was cancelled), `IPCError` when the deployment stopped. `tree_status` and `asleep` read the
    manager's flags."""

    def __init__(self, deployment_id: str, num_ranks: int) -> None:
        self._progress = LayerProgress(deployment_id, num_ranks)

    def wait(self, seq: int, layer: int, timeout: float) -> None:
        self._progress.wait_layer(seq, layer, timeout)

    def layers_done(self, seq: int) -> list[int | None]:
        """Per rank, the layers of load `seq` on the device (None: not started there)."""
        return self._progress.layers_done(seq)

    @property
    def tree_status(self) -> TreeStatus:
        """The manager's prefix-tree status: NORMAL, or CLEARING / CLEARED while a sleep or a
        reset empties it (block ids of before it are no longer the manager's)."""
        return self._progress.tree_status

    @property
    def asleep(self) -> bool:
        """True while the deployment sleeps (the workers' pools are freed, loads fail with
        `DeploymentAsleep`); False once a wake re-created them."""
        return self._progress.asleep

    def wait_stream(self, seq: int, layer: int, timeout: float, *,
                    registration: KVRegistration | None = None, stream: Any = None) -> bool:
        """Make `stream` (default: the current stream of the registration's device) wait for
        layer `layer` of load `seq` on this runner's rank without a host sync: once the
        worker has enqueued the layer's copy and recorded the registration's layer event
        (`LayerEventWords.covers`), the stream waits on that event on the GPU. Returns True
        then. Without layer events (a CPU registration, or events that could not be
        exported or opened), or when the layer is already on every rank's device, it waits
        on the host like `wait` and returns False. Raises like `wait` (LayerWaitTimeout,
        TaskAborted when the load failed, IPCError)."""
        words = registration.event_words if registration is not None else None
        if registration is None or words is None:
            self.wait(seq, layer, timeout)
            return False
        deadline = time.monotonic() + timeout
        pause = 50e-6
        while True:
            if words.covers(seq, layer):
                if stream is None:
                    stream = torch.cuda.current_stream(registration.device)
                stream.wait_event(registration.layer_event(seq, layer))
                return True
            try:  # the load failed (raises), or was copied without recording an event
                self._progress.wait_layer(seq, layer, 0.0)
                return False
            except LayerWaitTimeout:
                pass
            now = time.monotonic()
            if now > deadline:
                raise LayerWaitTimeout(
                    f"task seq={seq}: layer {layer} not enqueued on rank "
                    f"{registration.rank} after {timeout:.1f}s", seq=seq, layer=layer,
                    ranks=[registration.rank])
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, 1e-3)


    def close(self) -> None:
        self._progress.close()

    def __enter__(self) -> LayerWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_record(deployment_id: str, rank: int, timeout: float) -> Record:
    """The record of rank `rank` once there (tests, tools); TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        rec = read_record(deployment_id, rank)
        if rec is not None:
            return rec
        if time.monotonic() > deadline:
            raise TimeoutError(f"no registration {registration_name(deployment_id, rank)}")
        time.sleep(0.01)
