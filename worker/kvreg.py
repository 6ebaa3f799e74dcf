"""Engine KV registrations: the record a model runner publishes so that its rank's worker can
map the runner's own KV memory. Torch-free, so the manager can clean up after a dead runner
without importing torch.

Names (every one under the deployment's `/kvtier_<id>_` prefix, mode 0600):

    /kvtier_<id>_kvreg_r<rank>          shared memory  the registration record of rank r (JSON)
    /kvtier_<id>_kvmem_r<rank>_<tag>    shared memory  KV memory of a CPU model runner
                                                       (`engine_kv.shared_kv_tensor`)

Record: UTF-8 JSON, the whole segment (no pickle, nothing executable). Fields:

    format, version       "kvtier-engine-kv", RECORD_VERSION
    deployment_id, rank   whose KV this is
    owner_pid             the model runner's pid (a record whose owner is dead is stale)
    owner_start           its start time (clock ticks after boot, /proc/<pid>/stat field 22):
                          with the pid it names one process for good, so a dead runner's pid
                          reused by another process does not make its record live
    nonce                 32 random hex digits, new for every registration
    device                "cpu" or "cuda:<index>" (the index in the runner's process)
    device_uuid           the GPU's UUID (CUDA only; "" elsewhere)
    dtype, layout         torch dtype name ("float16"), "kvtier" | "vllm" | "fastdeploy"
    num_layers, num_blocks, block_size, num_kv_heads, head_dim, row_bytes
                          num_layers counts every KV layer registered, extra (MTP) layers
                          included, which come last
    planes                2 * num_layers entries, layer 0 K, layer 0 V, layer 1 K, ...; each
                          a view [num_blocks, row] of the runner's memory:
        CPU:  {"segment": name, "offset_bytes": int, "shape": [n, row], "strides": [s, 1]}
        CUDA: {"cuda": {the 8 fields of `UntypedStorage._share_cuda_()`, bytes hex-encoded:
                        device, handle, size_bytes, offset_bytes, ref_counter_handle,
                        ref_counter_offset, event_handle, event_sync_required},
               "storage_offset": elements, "shape": [n, row], "strides": [s, 1]}
    scale_planes          [] without scales, else 2 * num_layers entries in the same order and
                          format: the float32 K and V scales of every layer as views
                          [num_blocks, num_kv_heads] (model.kv_scales = "per_block_head");
                          CPU offsets are in bytes, CUDA storage offsets in float32 elements

    layer_events          optional (CUDA only; absent or null: none), the per-layer
                          inter-process CUDA events of the load path, see below:
        {"segment": "/kvtier_<id>_kvmem_r<rank>_layerevents", "slots": R,
         "handles": R lists of num_layers hex strings, each a 64-byte
                    `torch.cuda.Event(interprocess=True).ipc_handle()`}

Layer events (CUDA): the model runner creates R x num_layers inter-process events and a
small word table (`LayerEventWords`, a KV segment of its own). The worker, after enqueueing
layer l of load `seq` on its copy stream, records event [seq % R][l] on that stream and then
writes seq + 1 into word [seq % R][l]. The runner's compute stream may wait on that event as
soon as the word covers its seq (`covers`): waiting on an event takes the record issued
before the wait, so the word is what proves that record was issued. A slot reused by a later
load (seq + R, ...) only makes the runner wait longer, never less: the copy stream is in
order, so the later record completes after the earlier copy. No host thread waits for a copy
on the GPU.

A KV segment starts with a `SEGMENT_HEADER_BYTES` header (magic, version, owner pid, data
bytes, the owner's start time; little-endian int64 words) so a stale one can be told from a
live one even when no record names it; the tensor data starts at that page-aligned offset.

Trust (issue 27): a record or KV segment is used only when it belongs to this user and has
mode 0600 (what `create_segment` makes); anything else is refused, naming it and why. A record
is published whole: written under a temporary name, then linked to its own (a writer that
dies half-way leaves no record, only a temporary name the manager removes), so a malformed
record is reported at once instead of waited for, and the next runner replaces it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass
from typing import Any, Literal

import posix_ipc
from kvtier.worker.errors import KvtierError
from kvtier.worker.ipc import pid_alive, process_start_time, validate_deployment_id

Layout = Literal["kvtier", "vllm", "fastdeploy"]
LAYOUTS: tuple[str, ...] = ("kvtier", "vllm", "fastdeploy")
RECORD_FORMAT = "kvtier-engine-kv"
# 2: scale_planes (a version 1 worker would drop scales silently); 3: owner_start
RECORD_VERSION = 3
MAX_RECORD_BYTES = 16 << 20
SEGMENT_HEADER_BYTES = 4096
SEGMENT_MAGIC = int.from_bytes(b"KVTIERM1", "little")
SEGMENT_VERSION = 2  # 2: the owner's start time (issue 27: a reused pid is not the owner)
CUDA_FIELDS = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle",
               "ref_counter_offset", "event_handle", "event_sync_required")
_HEX_FIELDS = frozenset({"handle", "ref_counter_handle", "event_handle"})
EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)
MAX_EVENT_SLOTS = 64
LAYER_EVENTS_TAG = "layerevents"
_TAG = re.compile(r"[A-Za-z0-9-]{1,32}")
_HEADER = struct.Struct("<5q")  # magic, version, owner pid, data bytes, owner start time
_SHM_DIR = "/dev/shm"


class EngineKVError(KvtierError, ValueError):
    """An engine KV registration is malformed, does not match the deployment, or is gone."""


def registration_name(deployment_id: str, rank: int) -> str:
    """The shared-memory name of rank `rank`'s registration record."""
    validate_deployment_id(deployment_id)
    _check_rank(rank)
    return f"/kvtier_{deployment_id}_kvreg_r{rank}"


def kv_segment_name(deployment_id: str, rank: int, tag: str) -> str:
    """The shared-memory name of a CPU model runner's KV segment (`shared_kv_tensor`)."""
    validate_deployment_id(deployment_id)
    _check_rank(rank)
    if not isinstance(tag, str) or not _TAG.fullmatch(tag):
        raise EngineKVError(f"tag {tag!r} is invalid: use 1-32 characters of A-Z a-z 0-9 -")
    return f"/kvtier_{deployment_id}_kvmem_r{rank}_{tag}"


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 16:
        raise EngineKVError(f"rank must be an integer in [0, 65536), got {rank!r}")


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Record:
    """A decoded registration record (see the module docstring)."""

    deployment_id: str
    rank: int
    owner_pid: int
    nonce: str
    device: str
    device_uuid: str
    dtype: str
    layout: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    row_bytes: int
    planes: tuple[dict[str, Any], ...]
    scale_planes: tuple[dict[str, Any], ...] = ()
    layer_events: dict[str, Any] | None = None
    owner_start: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def segments(self) -> list[str]:
        """The distinct segment names the record's memory lives in, in first-use order: the
        planes' (CPU) and the layer-event word table's (CUDA with layer events)."""
        names: list[str] = []
        for p in (*self.planes, *self.scale_planes):
            name = p.get("segment")
            if isinstance(name, str) and name not in names:
                names.append(name)
        if self.layer_events is not None:
            names.append(self.layer_events["segment"])
        return names

    def event_handles(self) -> list[list[bytes]]:
        """The layer events' IPC handles, [slot][layer] (empty without layer events)."""
        if self.layer_events is None:
            return []
        return [[bytes.fromhex(h) for h in row] for row in self.layer_events["handles"]]

    def owner_alive(self) -> bool:
        """Whether the process that registered runs: its pid alive with the start time
        recorded (another process under a reused pid is not the owner)."""
        return (pid_alive(self.owner_pid)
                and process_start_time(self.owner_pid) == self.owner_start)


def encode_record(rec: Record) -> bytes:
    """The record as the bytes of its segment."""
    body: dict[str, Any] = {"format": RECORD_FORMAT, "version": RECORD_VERSION}
    for name in Record.__dataclass_fields__:
        value = getattr(rec, name)
        body[name] = list(value) if name in ("planes", "scale_planes") else value
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def _field(body: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = body.get(name)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise EngineKVError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise EngineKVError(
            f"{where}: field {name!r} must be a {kind.__name__}, got {value!r:.60}")
    return value


def _ints(value: Any, what: str, where: str) -> list[int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise EngineKVError(f"{where}: {what} must be a list of two integers, got {value!r:.60}")
    return value


def decode_record(raw: bytes, where: str = "engine KV record") -> Record:
    """Parse and check a record's bytes; EngineKVError naming the field otherwise."""
    try:
        body = json.loads(raw.rstrip(b"\0").decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise EngineKVError(f"{where}: not a JSON registration record ({e})") from None
    if not isinstance(body, dict) or body.get("format") != RECORD_FORMAT:
        raise EngineKVError(f"{where}: not a kvtier engine KV record")
    if body.get("version") != RECORD_VERSION:
        raise EngineKVError(
            f"{where}: record version {body.get('version')!r}, this kvtier reads version "
            f"{RECORD_VERSION} (model runner and workers run different kvtier versions)")
    ints = ("rank", "owner_pid", "owner_start", "num_layers", "num_blocks", "block_size",
            "num_kv_heads", "head_dim", "row_bytes")
    strs = ("deployment_id", "nonce", "device", "device_uuid", "dtype", "layout")
    values: dict[str, Any] = {n: _field(body, n, int, where) for n in ints}
    values |= {n: _field(body, n, str, where) for n in strs}
    if values["layout"] not in LAYOUTS:
        raise EngineKVError(f"{where}: layout {values['layout']!r} is not one of {LAYOUTS}")
    for n in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "row_bytes"):
        if values[n] <= 0:
            raise EngineKVError(f"{where}: field {n!r} must be positive, got {values[n]}")
    planes = _field(body, "planes", list, where)
    if len(planes) != 2 * values["num_layers"]:
        raise EngineKVError(
            f"{where}: {len(planes)} planes for {values['num_layers']} layers (expected "
            f"{2 * values['num_layers']}: K and V of every layer)")
    cuda = values["device"].startswith("cuda")
    for i, p in enumerate(planes):
        _check_plane(p, f"{where}: plane {i} (layer {i // 2} {'KV'[i % 2]})", values, cuda)
    scale_planes = body.get("scale_planes", [])
    if not isinstance(scale_planes, list) or len(scale_planes) not in (0, len(planes)):
        raise EngineKVError(
            f"{where}: scale_planes must be a list of 0 or {len(planes)} entries (K and V "
            "scales of every layer)")
    for i, p in enumerate(scale_planes):
        at = f"{where}: scale plane {i} (layer {i // 2} {'KV'[i % 2]})"
        _check_plane(p, at, values, cuda)
        if p["shape"][1] != values["num_kv_heads"]:
            raise EngineKVError(f"{at}: {p['shape'][1]} scales a block, the record says "
                                f"num_kv_heads = {values['num_kv_heads']}")
    values["scale_planes"] = tuple(scale_planes)
    values["planes"] = tuple(planes)
    values["layer_events"] = _layer_events(body.get("layer_events"), values, where)
    return Record(**values)


def _check_plane(p: Any, at: str, values: dict[str, Any], cuda: bool) -> None:
    if not isinstance(p, dict):
        raise EngineKVError(f"{at}: must be an object")
    shape = _ints(p.get("shape"), "shape", at)
    _ints(p.get("strides"), "strides", at)
    if shape[0] != values["num_blocks"]:
        raise EngineKVError(
            f"{at}: {shape[0]} blocks, the record says num_blocks = {values['num_blocks']}")
    if cuda:
        fields = p.get("cuda")
        if not isinstance(fields, dict) or set(fields) != set(CUDA_FIELDS):
            raise EngineKVError(f"{at}: 'cuda' must hold the fields {list(CUDA_FIELDS)}")
        _field(p, "storage_offset", int, at)
    else:
        seg = _field(p, "segment", str, at)
        if not seg.startswith(f"/kvtier_{values['deployment_id']}_kvmem_r"):
            raise EngineKVError(
                f"{at}: segment {seg!r} is not a KV segment of deployment "
                f"{values['deployment_id']!r}")
        _field(p, "offset_bytes", int, at)


def _layer_events(obj: Any, values: dict[str, Any], where: str) -> dict[str, Any] | None:
    """Check the optional `layer_events` field (see the module docstring)."""
    if obj is None:
        return None
    at = f"{where}: layer_events"
    if not values["device"].startswith("cuda"):
        raise EngineKVError(f"{at}: only a CUDA registration has layer events")
    if not isinstance(obj, dict) or set(obj) != {"segment", "slots", "handles"}:
        raise EngineKVError(f"{at}: must be an object with segment, slots and handles")
    slots = _field(obj, "slots", int, at)
    if not 1 <= slots <= MAX_EVENT_SLOTS:
        raise EngineKVError(f"{at}: slots = {slots}, expected 1..{MAX_EVENT_SLOTS}")
    segment = _field(obj, "segment", str, at)
    want = kv_segment_name(values["deployment_id"], values["rank"], LAYER_EVENTS_TAG)
    if segment != want:
        raise EngineKVError(f"{at}: segment {segment!r}, expected {want!r}")
    handles = obj["handles"]
    layers = values["num_layers"]
    if (not isinstance(handles, list) or len(handles) != slots
            or not all(isinstance(row, list) and len(row) == layers for row in handles)):
        raise EngineKVError(f"{at}: handles must be {slots} lists of {layers} (slots x layers)")
    for row in handles:
        for h in row:
            if not isinstance(h, str) or len(h) != 2 * EVENT_HANDLE_BYTES:
                raise EngineKVError(
                    f"{at}: a handle must be {2 * EVENT_HANDLE_BYTES} hex digits, got {h!r:.40}")
            try:
                bytes.fromhex(h)
            except ValueError:
                raise EngineKVError(f"{at}: handle {h[:16]}... is not hexadecimal") from None
    return {"segment": segment, "slots": slots, "handles": handles}


_WORD = struct.Struct("<q")


class LayerEventWords:
    """The word table of a registration's layer events: `slots x layers` little-endian int64
    words after a KV segment header, word [slot][layer] = 1 + the highest load seq whose
    layer `layer` the worker has enqueued and recorded event [slot][layer] for (0: none).

    One writer (the rank's worker, `publish`), any number of readers (`covers`); aligned
    8-byte stores and loads, so a reader sees the old or the new word, never a torn one.
    The model runner creates it (`create`) and owns its name; the worker opens it (`open`)."""

    def __init__(self, name: str, mm: mmap.mmap, slots: int, layers: int) -> None:
        self.name, self.slots, self.layers = name, slots, layers
        self._mm: mmap.mmap | None = mm

    @classmethod
    def create(cls, deployment_id: str, rank: int, slots: int, layers: int) -> LayerEventWords:
        if not 1 <= slots <= MAX_EVENT_SLOTS or layers <= 0:
            raise EngineKVError(f"layer events: slots must be 1..{MAX_EVENT_SLOTS} and layers "
                                f"positive, got {slots} and {layers}")
        name = kv_segment_name(deployment_id, rank, LAYER_EVENTS_TAG)
        owner = live_segment_owner(name)
        if owner is not None and owner != os.getpid():
            raise EngineKVError(f"layer events: {name} is in use by pid {owner}")
        unlink(name)  # a dead runner's table of the same name
        nbytes = slots * layers * _WORD.size
        mm = create_segment(name, size=SEGMENT_HEADER_BYTES + nbytes)
        mm[: _HEADER.size] = segment_header(os.getpid(), nbytes)
        return cls(name, mm, slots, layers)

    @classmethod
    def open(cls, name: str, slots: int, layers: int) -> LayerEventWords:
        """Map a runner's table read-write (the worker); EngineKVError when it is missing,
        has no kvtier header or is too small for `slots x layers`."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise EngineKVError(f"layer events: {name} does not exist") from None
        except posix_ipc.PermissionsError:
            raise EngineKVError(f"layer events: {name} is not this user's: refusing it") from None
        try:
            check_private(shm.fd, f"layer events: {name}")
            size = shm.size
            need = SEGMENT_HEADER_BYTES + slots * layers * _WORD.size
            if size < need:
                raise EngineKVError(f"layer events: {name} has {size} bytes, {need} needed")
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        magic, version, _, _, _ = _HEADER.unpack(mm[: _HEADER.size])
        if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION:
            mm.close()
            raise EngineKVError(f"layer events: {name} has no kvtier header")
        return cls(name, mm, slots, layers)

    def _offset(self, slot: int, layer: int) -> int:
        if not (0 <= slot < self.slots and 0 <= layer < self.layers):
            raise IndexError(f"layer events: slot {slot} layer {layer} out of "
                             f"{self.slots} x {self.layers}")
        return SEGMENT_HEADER_BYTES + (slot * self.layers + layer) * _WORD.size

    def _mapped(self) -> mmap.mmap:
        if self._mm is None:
            raise EngineKVError(f"layer events: {self.name} is closed")
        return self._mm

    def word(self, slot: int, layer: int) -> int:
        return int(_WORD.unpack_from(self._mapped(), self._offset(slot, layer))[0])

    def publish(self, seq: int, layer: int) -> None:
        """After recording event [seq % slots][layer]: the record for `seq` is issued."""
        slot = seq % self.slots
        if seq + 1 > self.word(slot, layer):  # a batch may record an older seq after a newer
            _WORD.pack_into(self._mapped(), self._offset(slot, layer), seq + 1)

    def covers(self, seq: int, layer: int) -> bool:
        """Whether event [seq % slots][layer] was recorded for `seq` or a later load."""
        return self.word(seq % self.slots, layer) >= seq + 1

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def encode_cuda_fields(fields: tuple[Any, ...] | list[Any]) -> dict[str, Any]:
    """`UntypedStorage._share_cuda_()`'s 8-tuple as a JSON object (bytes as hex)."""
    if len(fields) != len(CUDA_FIELDS):
        raise EngineKVError(
            f"_share_cuda_() gave {len(fields)} fields, expected {len(CUDA_FIELDS)} "
            f"({', '.join(CUDA_FIELDS)}): an unsupported torch version")
    out: dict[str, Any] = {}
    for name, value in zip(CUDA_FIELDS, fields, strict=True):
        if name in _HEX_FIELDS:
            out[name] = None if value is None else bytes(value).hex()
        elif name == "event_sync_required":
            out[name] = bool(value)
        else:
            out[name] = int(value)
    return out


def decode_cuda_fields(obj: dict[str, Any], device_index: int | None = None) -> tuple[Any, ...]:
    """The arguments of `UntypedStorage._new_shared_cuda` from `encode_cuda_fields`'s
    object; `device_index` replaces the exporter's device index (the importer's own index
    of the same GPU)."""
    out: list[Any] = []
    for name in CUDA_FIELDS:
        value = obj[name]
        if name in _HEX_FIELDS:
            out.append(None if value is None else bytes.fromhex(value))
        elif name == "event_sync_required":
            out.append(bool(value))
        elif name == "device" and device_index is not None:
            out.append(int(device_index))
        else:
            out.append(int(value))
    return tuple(out)


# --------------------------------------------------------------------------- shared memory


def check_private(fd: int, name: str) -> None:
    """Refuse a segment this user does not own alone (issue 27): another user's, or one of
    a mode other users may read or write. EngineKVError naming it and why."""
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        raise EngineKVError(
            f"{name}: owned by uid {info.st_uid}, not this user (uid {os.geteuid()}): "
            "refusing engine KV somebody else controls")
    if info.st_mode & 0o077:
        raise EngineKVError(
            f"{name}: mode {stat.S_IMODE(info.st_mode):o}, other users may read or write it "
            "(kvtier makes these 0600): refusing it")


def publish_segment(name: str, data: bytes) -> None:
    """Create `name` (mode 0600, failing with FileExistsError if it exists) holding `data`,
    appearing whole: written under a temporary name, then linked to `name` (a writer that
    dies half-way leaves no `name`)."""
    tmp = f"{name}_tmp{os.getpid()}x{secrets.token_hex(4)}"  # the pid: see remove_dead_...
    create_segment(tmp, data).close()
    try:
        os.link(os.path.join(_SHM_DIR, tmp.lstrip("/")), os.path.join(_SHM_DIR, name.lstrip("/")))
    finally:
        unlink(tmp)


def create_segment(name: str, data: bytes | None = None, size: int | None = None) -> mmap.mmap:
    """Create `name` (mode 0600, failing if it exists) of `size` bytes, or holding `data`;
    returns its mapping."""
    n = len(data) if data is not None else size
    assert n is not None and n > 0
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=n)
    try:
        os.fchmod(shm.fd, 0o600)  # shm_open applies the umask; make the mode exact
        mm = mmap.mmap(shm.fd, n)
    except BaseException:
        shm.close_fd()
        unlink(name)
        raise
    shm.close_fd()
    if data is not None:
        mm[:] = data
    return mm


def unlink(name: str) -> bool:
    """Unlink a segment; False when it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return False  # gone, or another user's (the caller then refuses it)
    return True


def read_segment(name: str, limit: int = MAX_RECORD_BYTES) -> bytes | None:
    """The whole content of segment `name`, or None when it does not exist."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except posix_ipc.ExistentialError:
        return None
    except posix_ipc.PermissionsError:
        raise EngineKVError(f"{name}: not readable by this user: refusing engine KV somebody "
                            "else controls") from None
    try:
        check_private(shm.fd, name)
        size = shm.size
        if size > limit:
            raise EngineKVError(f"{name}: {size} bytes, more than a record may hold ({limit})")
        return os.pread(shm.fd, size, 0) if size else b""
    finally:
        shm.close_fd()


def read_record(deployment_id: str, rank: int) -> Record | None:
    """Rank `rank`'s registration record, or None when there is none. EngineKVError when
    it is there and malformed (records are published whole: `publish_segment`) or not this
    user's alone (`check_private`)."""
    name = registration_name(deployment_id, rank)
    raw = read_segment(name)
    if raw is None:
        return None
    rec = decode_record(raw, name)
    if rec.deployment_id != deployment_id or rec.rank != rank:
        raise EngineKVError(
            f"{name}: the record is for deployment {rec.deployment_id!r} rank {rec.rank}")
    owner_uid = _process_uid(rec.owner_pid)
    if owner_uid is not None and owner_uid != os.geteuid():
        raise EngineKVError(
            f"{name}: names model runner pid {rec.owner_pid}, a process of uid {owner_uid}, "
            f"not of this user (uid {os.geteuid()}): refusing it")
    return rec


def _process_uid(pid: int) -> int | None:
    """The real uid of process `pid`, None when there is no such process."""
    if pid <= 0:
        return None
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def segment_header(owner_pid: int, data_bytes: int) -> bytes:
    start = process_start_time(owner_pid) if owner_pid > 0 else None
    return _HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, owner_pid, data_bytes, start or 0)


def _header_owner(name: str) -> tuple[int, int] | None:
    """(owner pid, owner start time) from a KV segment's header; None when the segment is
    gone or has no valid header."""
    try:
        shm = posix_ipc.SharedMemory(name, read_only=True)
    except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        return None
    try:
        if shm.size < _HEADER.size:
            return None
        magic, version, pid, _, start = _HEADER.unpack(os.pread(shm.fd, _HEADER.size, 0))
    finally:
        shm.close_fd()
    return (pid, start) if magic == SEGMENT_MAGIC and version == SEGMENT_VERSION else None


def live_segment_owner(name: str) -> int | None:
    """The pid of the process that made KV segment `name`, while it runs (pid alive with
    the start time in the header: a reused pid is not the owner); None otherwise."""
    owner = _header_owner(name)
    if owner is None:
        return None
    pid, start = owner
    return pid if pid_alive(pid) and process_start_time(pid) == start else None


def segment_owner(name: str) -> int | None:
    """The owner pid written in a KV segment's header; None when the segment is gone or has
    no valid header."""
    owner = _header_owner(name)
    return None if owner is None else owner[0]


def deployment_entries(deployment_id: str, kind: str) -> list[str]:
    """Names (with the leading '/') of the deployment's `kind` segments ("kvreg" or "kvmem")
    in /dev/shm."""
    validate_deployment_id(deployment_id)
    prefix = f"kvtier_{deployment_id}_{kind}_r"
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return []
    return sorted("/" + n for n in entries if n.startswith(prefix))


def remove_registration(rec: Record) -> list[str]:
    """Unlink a record and the KV segments it names, each only while it is still that
    registration's (the record's nonce, the segment header's owner pid): a new runner may
    already have taken the names over. Returns the names unlinked."""
    removed = []
    name = registration_name(rec.deployment_id, rec.rank)
    try:
        current = read_record(rec.deployment_id, rec.rank)
    except EngineKVError:
        current = None
    if (current is None or current.nonce == rec.nonce) and unlink(name):
        removed.append(name)
    for seg in rec.segments():
        owner = segment_owner(seg)
        if owner in (None, rec.owner_pid) and unlink(seg):
            removed.append(seg)
    return removed


def remove_dead_registrations(deployment_id: str) -> list[str]:
    """Unlink the registration records of this deployment whose model runner is dead, with
    their KV segments, and KV segments no record names whose owner is dead (a runner killed
    before it registered). Live runners' names are left alone. Returns what was removed."""
    removed: list[str] = []
    for name in deployment_entries(deployment_id, "kvreg"):
        rank_text = name.rsplit("_r", 1)[-1]
        if not rank_text.isdigit():
            writer = rank_text.rpartition("_tmp")[2].partition("x")[0]
            if writer.isdigit() and not pid_alive(int(writer)) and unlink(name):
                removed.append(name)  # a record a writer died publishing (publish_segment)
            continue
        try:
            rec = read_record(deployment_id, int(rank_text))
        except EngineKVError:
            # refused (malformed, another user's, a mode others may use, another user's
            # pid): left where it is, so that the worker's start names it and why, at once
            # (removed here, the start waited engine_kv_timeout_s and said none was
            # registered); the next runner replaces it
            continue
        if rec is not None and not rec.owner_alive():
            removed += remove_registration(rec)
    for name in deployment_entries(deployment_id, "kvmem"):
        owner = segment_owner(name)  # None: being created right now, or not ours
        if owner is not None and live_segment_owner(name) is None and unlink(name):
            removed.append(name)
    return removed


def problem(rec: Record, attached_nonce: str | None = None) -> str | None:
    """Why `rec` can no longer be used (owner gone, or replaced), or None."""
    if attached_nonce is not None and rec.nonce != attached_nonce:
        return f"replaced by a new registration of pid {rec.owner_pid}"
    if not rec.owner_alive():
        return f"model runner pid {rec.owner_pid} exited"
    return None
