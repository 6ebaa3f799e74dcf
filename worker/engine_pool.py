"""A worker's device tier when the engine owns the KV memory (`workers.engine_kv = true`):
the model runner's registration (`kvtier.worker.engine_kv.KVRegistration`, record format in
`kvtier.worker.kvreg`) attached in the worker process.

* CPU: each KV segment named by the record is mapped by name; every plane is a strided view
  of its mapping, so a copy into a plane lands in the model runner's tensor.
* CUDA: each distinct storage is opened with `UntypedStorage._new_shared_cuda` (CUDA IPC) on
  the rank's own `cuda:<index>`, after checking by UUID that it is the GPU the runner
  exported from; planes are views of those storages.

The record is checked against the worker's spec before anything is mapped: layers, blocks
(`cache.device_blocks`), bytes of a row, dtype and device kind; each error names the field and
both values. `problem()` tells whether the registration attached is still the current one
(same nonce, its model runner alive); the worker asks before every device task.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from typing import Any

import posix_ipc
import torch
from kvtier.worker.errors import KvtierError
from kvtier.worker.kv_pools import PlanePool, parse_dtype
from kvtier.worker.kvreg import (
    SEGMENT_HEADER_BYTES,
    SEGMENT_MAGIC,
    EngineKVError,
    LayerEventWords,
    Record,
    check_private,
    decode_cuda_fields,
    read_record,
    registration_name,
)
from kvtier.worker.spec import WorkerSpec

log = logging.getLogger(__name__)


class EngineKVGone(KvtierError, RuntimeError):
    """The engine KV registration a worker attached to is gone (its model runner exited or
    closed it) and no new one is there yet."""


def check_record(rec: Record, spec: WorkerSpec) -> None:
    """Refuse a record that does not describe this rank's configured KV."""
    shape = spec.shape
    where = (f"engine KV registration of rank {spec.rank} "
             f"({registration_name(spec.deployment_id, spec.rank)})")
    try:
        rec_dtype = parse_dtype(rec.dtype)
    except KvtierError:
        raise EngineKVError(f"{where}: dtype {rec.dtype!r} is not supported") from None
    itemsize = torch.empty((), dtype=rec_dtype).element_size()
    if rec.row_bytes != rec.block_size * rec.num_kv_heads * rec.head_dim * itemsize:
        raise EngineKVError(
            f"{where} is inconsistent: row_bytes = {rec.row_bytes} but block_size * "
            f"num_kv_heads * head_dim * itemsize = {rec.block_size} * {rec.num_kv_heads} * "
            f"{rec.head_dim} * {itemsize}")
    pairs = (
        ("num_layers", rec.num_layers, "model.num_layers" + (
            " + model.num_extra_layers" if spec.num_extra_layers else ""), shape.total_layers),
        ("scale planes", len(rec.scale_planes), f"model.kv_scales = {spec.kv_scales!r}",
         shape.scale_planes),
        ("num_blocks", rec.num_blocks, "cache.device_blocks", spec.device_blocks),
        ("dtype", rec.dtype, "model.dtype", spec.dtype),
        ("block_size", rec.block_size, "cache.block_size", spec.block_size),
        ("row_bytes", rec.row_bytes,
         "block_size * model.num_kv_heads * model.head_dim * itemsize", shape.k_bytes),
    )
    for field, got, key, want in pairs:
        if got != want:
            raise EngineKVError(
                f"{where} does not match the configuration: {field} = {got!r} in the "
                f"registration, {key} = {want!r} in the configuration")
    spec_cuda = spec.device.startswith("cuda")
    if rec.is_cuda != spec_cuda:
        raise EngineKVError(
            f"{where} does not match the configuration: device = {rec.device!r} in the "
            f"registration, workers.device gives this rank {spec.device!r}")


class EnginePool(PlanePool):
    """The model runner's KV of one rank, attached (see the module docstring).

    `record` is the registration attached (its `nonce` identifies it); `layout` its layout.
    `close()` drops this process's views (a CPU mapping goes with its last view)."""

    def __init__(self, spec: WorkerSpec, rec: Record) -> None:
        check_record(rec, spec)
        self.spec = spec
        self.record = rec
        shape = spec.shape
        if rec.is_cuda:
            planes = _cuda_planes(rec.planes, shape.dtype, rec, spec)
            scale_planes = _cuda_planes(rec.scale_planes, torch.float32, rec, spec)
        else:
            mapped: dict[tuple[str, torch.dtype], torch.Tensor] = {}
            planes = _cpu_planes(rec.planes, shape.dtype, mapped, "", rec.owner_pid)
            scale_planes = _cpu_planes(rec.scale_planes, torch.float32, mapped, " scales",
                                       rec.owner_pid)
        super().__init__(shape, planes, layout=rec.layout, scale_planes=scale_planes)
        self.layer_events: WorkerLayerEvents | None = None
        if rec.layer_events is not None:
            self.layer_events = WorkerLayerEvents.open(rec, planes[0].device, spec.rank)

    # ------------------------------------------------------------------ attach

    @classmethod
    def attach(cls, spec: WorkerSpec, timeout: float) -> EnginePool:
        """Wait (at most `timeout` s) for rank `spec.rank`'s registration by a live model
        runner, then attach it. EngineKVError when none came or it does not fit."""
        deadline = time.monotonic() + timeout
        stale = None
        while True:
            pool = cls.try_attach(spec)
            if pool is not None:
                return pool
            rec = read_record(spec.deployment_id, spec.rank)
            if rec is not None:
                stale = rec
            if time.monotonic() > deadline:
                name = registration_name(spec.deployment_id, spec.rank)
                why = (f"the one there belongs to model runner pid {stale.owner_pid}, which "
                       "exited" if stale is not None else "none was registered")
                raise EngineKVError(
                    f"rank {spec.rank}: no engine KV registration {name} after {timeout:.1f} s "
                    f"({why}); with workers.engine_kv = true the model runner registers its "
                    "KV (kvtier.worker.engine_kv.KVRegistration) before the workers start")
            time.sleep(0.02)

    @classmethod
    def try_attach(cls, spec: WorkerSpec) -> EnginePool | None:
        """Attach the current registration if a live model runner published one, else None."""
        rec = read_record(spec.deployment_id, spec.rank)
        if rec is None or not rec.owner_alive():
            return None
        return cls(spec, rec)

    # ------------------------------------------------------------------ currency

    def problem(self) -> str | None:
        """None while the registration attached is the current one and its model runner
        lives; else the reason, as a sentence naming the rank and the runner's pid."""
        rank, pid = self.spec.rank, self.record.owner_pid
        try:
            now = read_record(self.spec.deployment_id, rank)
        except EngineKVError as e:
            return f"engine KV registration of rank {rank} is unreadable ({e})"
        alive = self.record.owner_alive()
        if now is not None and now.nonce == self.record.nonce:
            if alive:
                return None
            return f"engine KV registration of rank {rank} is gone (model runner pid {pid} exited)"
        if now is not None:
            return (f"engine KV registration of rank {rank} was replaced (model runner pid "
                    f"{now.owner_pid} registered again)")
        how = "closed it" if alive else "exited"
        return f"engine KV registration of rank {rank} is gone (model runner pid {pid} {how})"

    def close(self) -> None:
        """Drop the views into the model runner's memory (idempotent)."""
        self.planes = []
        self.scale_planes = []
        if self.layer_events is not None:
            self.layer_events.close()
            self.layer_events = None


class WorkerLayerEvents:
    """The worker's side of a registration's layer events (`kvtier.worker.kvreg`, "Layer
    events"): the runner's inter-process events opened on this worker's device,
    `events[slot][layer]`, and its word table. `hook(seqs)` is what the copy engine calls
    after enqueueing each layer of an H2D batch: record the event of every slot the batch's
    loads use on the copy stream, then publish each load's seq, in that order."""

    def __init__(self, events: list[list[Any]], words: LayerEventWords) -> None:
        self.events, self.words = events, words

    @classmethod
    def open(cls, rec: Record, device: torch.device, rank: int) -> WorkerLayerEvents | None:
        """Open them, or None when they cannot be (logged): the runner's `wait_stream` then
        finds its words never covering a load and waits on the host instead."""
        assert rec.layer_events is not None
        try:
            words = LayerEventWords.open(rec.layer_events["segment"], rec.layer_events["slots"],
                                         rec.num_layers)
        except EngineKVError as e:
            log.warning("rank %d: layer events not used: %s", rank, e)
            return None
        try:
            events = [[torch.cuda.Event.from_ipc_handle(device, h) for h in row]
                      for row in rec.event_handles()]
        except (RuntimeError, AttributeError) as e:
            words.close()
            log.warning("rank %d: the runner's CUDA layer events cannot be opened (%s); its "
                        "per-layer waits fall back to the host", rank, e)
            return None
        return cls(events, words)

    def hook(self, seqs: list[int]) -> Callable[[int, Any], None]:
        slots = len(self.events)
        newest: dict[int, int] = {}
        for seq in seqs:
            slot = seq % slots
            newest[slot] = max(seq, newest.get(slot, -1))

        def enqueued(layer: int, stream: Any) -> None:
            for slot in newest:
                self.events[slot][layer].record(stream)
            for seq in seqs:  # after every record call: a covered word means "issued"
                self.words.publish(seq, layer)

        return enqueued

    def close(self) -> None:
        self.words.close()
        self.events = []


def _cpu_planes(recs: tuple[dict[str, Any], ...], dtype: torch.dtype,
                mapped: dict[tuple[str, torch.dtype], torch.Tensor], what: str,
                owner_pid: int) -> list[torch.Tensor]:
    """Views of the CPU planes `recs` (KV or scale planes) as `dtype`; `mapped` caches each
    segment's typed mapping across calls. Every segment must be the record's owner's."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    planes = []
    for i, p in enumerate(recs):
        where = f"engine KV{what} plane {i} (layer {i // 2} {'KV'[i % 2]})"
        name = p["segment"]
        if (name, dtype) not in mapped:
            mapped[name, dtype] = _map_segment(name, dtype, owner_pid)
        base = mapped[name, dtype]
        offset = p["offset_bytes"]
        if offset < SEGMENT_HEADER_BYTES or offset % itemsize:
            raise EngineKVError(f"{where}: byte offset {offset} in {name} is not a data offset")
        planes.append(_view(base, offset // itemsize, p["shape"], p["strides"], where))
    return planes


def _map_segment(name: str, dtype: torch.dtype, owner_pid: int) -> torch.Tensor:
    """Map a runner's KV segment: this user's alone (mode 0600, `check_private`) and made by
    `owner_pid`, the record's runner (its header says so; issue 27)."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        raise EngineKVError(f"engine KV segment {name} does not exist") from None
    except posix_ipc.PermissionsError:
        raise EngineKVError(f"engine KV segment {name} is not this user's: refusing it"
                            ) from None
    try:
        check_private(shm.fd, f"engine KV segment {name}")
        size = shm.size
        mm = mmap.mmap(shm.fd, size)
    finally:
        shm.close_fd()
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping while views exist
    if size < SEGMENT_HEADER_BYTES or int(raw[:8].view(torch.int64)) != SEGMENT_MAGIC:
        raise EngineKVError(f"engine KV segment {name} has no kvtier header")
    made_by = int(raw[16:24].view(torch.int64))  # the header's owner pid (kvreg._HEADER)
    if made_by != owner_pid:
        raise EngineKVError(f"engine KV segment {name} was made by pid {made_by}, not by the "
                            f"registering model runner pid {owner_pid}: refusing it")
    itemsize = torch.empty((), dtype=dtype).element_size()
    return raw[: size - size % itemsize].view(dtype)


def _view(base: torch.Tensor, offset: int, shape: list[int], strides: list[int],
          where: str) -> torch.Tensor:
    if any(s < 0 for s in strides):
        raise EngineKVError(f"{where}: negative strides {strides}")
    last = offset + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    if shape[0] <= 0 or shape[1] <= 0 or last >= base.numel():
        raise EngineKVError(
            f"{where}: shape {shape} strides {strides} at element {offset} reach past the "
            f"{base.numel()} elements of its memory")
    return base.as_strided(shape, strides, base.storage_offset() + offset)


def _cuda_planes(recs: tuple[dict[str, Any], ...], dtype: torch.dtype, rec: Record,
                 spec: WorkerSpec) -> list[torch.Tensor]:
    """Views of the CUDA planes `recs` (KV or scale planes of `rec`) as `dtype`, opened
    through their IPC handles on this rank's device."""
    device = torch.device(spec.device if ":" in spec.device else "cuda:0")
    index = device.index if device.index is not None else 0
    if not recs:
        return []
    torch.cuda._lazy_init()
    if rec.device_uuid:
        here = str(torch.cuda.get_device_properties(index).uuid)
        if here != rec.device_uuid:
            raise EngineKVError(
                f"engine KV registration of rank {spec.rank}: the KV is on GPU "
                f"{rec.device_uuid} ({rec.device} in the model runner) but this worker's "
                f"{device} is GPU {here}; set workers.cuda_devices so rank {spec.rank} uses "
                "the model runner's GPU")
    storages: dict[tuple[str, int], torch.UntypedStorage] = {}
    itemsize = torch.empty((), dtype=dtype).element_size()
    planes = []
    for i, p in enumerate(recs):
        where = f"engine KV plane {i} (layer {i // 2} {'KV'[i % 2]})"
        fields = p["cuda"]
        key = (fields["handle"], fields["offset_bytes"])
        if key not in storages:
            try:
                storages[key] = torch.UntypedStorage._new_shared_cuda(
                    *decode_cuda_fields(fields, index))
            except RuntimeError as e:
                raise EngineKVError(f"{where}: cannot open its CUDA IPC handle ({e})") from None
        storage = storages[key]
        base = torch.empty(0, dtype=dtype, device=device)
        base.set_(storage, 0, (storage.nbytes() // itemsize,), (1,))
        planes.append(_view(base, p["storage_offset"], p["shape"], p["strides"], where))
    return planes
