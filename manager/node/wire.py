"""The wire format between an engine (`kvtier.engine.node_client`) and the node service
(`kvtier serve`, `kvtier.manager.node.server`): the one module both sides import.

A Unix stream socket carries frames. Every frame is a 4-byte little-endian body length
(at most `MAX_FRAME` bytes) and a body that opens with an 8-byte head::

    head     <B B H I>   version (WIRE_VERSION), frame type, -, seq:u32

Frame types, client -> service:

    HELLO    the head, then a UTF-8 JSON object (at most MAX_HELLO bytes): who the engine is
             (`Hello`: namespace, KV geometry, block size, hash algorithm and seed, ranks,
             pid). First frame of a connection, and only there.
    OPS      the head, then `count:u32`, then `count` op records (at most MAX_FRAME_KEYS
             keys over all of them). Ops other than the asking ones (LOOKUP,
             PREPARE_STORE, PREPARE_LOAD, PENDING, REMOVE) are one-way; a frame holds at
             most one asking op, as its last record, and the service answers the frame (same
             seq) with one REPLY. So a scheduler step's completions travel with its next
             question, one write and one read per round trip.

An op record: a 20-byte head, then the request id, the keys, and `n_extra` extra bytes::

    record   <B B H i I H xx I>  op, flag, rid_len:u16, value:i32, n_keys:u32,
                                 key_width:u16, -, n_extra:u32
    keys     key_width > 0: n_keys keys of that many bytes back to back;
             key_width == 0: n_keys u16 lengths, then the keys' bytes

    op              flag          value                 extra
    LOOKUP          -             prefetch threshold    -            keys: [block, *following]
                                  tokens, -1: default
    PREPARE_STORE   -             -                     tenant       (UTF-8, at most
                                                                     MAX_TENANT_BYTES; none:
                                                                     the default pool)
    PREPARE_LOAD    1: counted    -                     one u8 count flag per key
    PENDING         -             -                     -            no keys
    REMOVE          reason code   -                     -            at most MAX_REMOVE_KEYS
                    (REMOVE_REASONS)                                 keys, each one this
                                                                     engine holds a load of
    COMPLETE_STORE  1: ok         -                     -
    COMPLETE_LOAD   -             -                     -
    TOUCH           -             -                     -
    COUNT_ASKED     -             blocks                -            no keys
    FORGET          -             -                     -            no keys
    RESET           -             -                     -            no keys, no request id
    EVENTS          1: on, 0: off -                     -            no keys, no request id
    RETAIN          1: retain,    priority              <d B> ttl_s, pin, then the tenant
                    2: unpin                                         (UTF-8); unpin: none

REMOVE asks the service to take blocks out of every tier of the node (the host copy, the
storage page on every rank; removal events to every reader): `KeyedHostCache.remove` through
`EngineSession.remove_loaded`. An engine removes only blocks it was served and still holds a
load of (its audit found the copy wrong): any other key (unknown, another engine's, another
namespace's), more than MAX_REMOVE_KEYS keys or an unknown reason code is refused whole, in
one line (`ok` 0, the error text), nothing removed, the connection kept. Its REPLY: `evicted`
= host copies removed, `ids` = [blocks named, storage pages asked to delete].

EVENTS on subscribes this connection to its namespace's tier events (host and storage, the
service's `fanout.EventFanout`): from then on every REPLY carries the events the connection
has not had yet (at most REPLY_EVENT_BYTES of hashes each; the rest ride on the next ones),
so a scheduler step that asks anything gets them without a round trip of its own. The
first events after EVENTS on are the namespace's state (a stored event per tier).

Frame types, service -> client:

    WELCOME  the head, then a UTF-8 JSON object (`Welcome`: the session id, the service
             instance nonce, the namespace's generation, quota and host pool segments per
             rank, the storage backend: what a STORAGE event's locality is).
    REPLY    the head (seq of the OPS frame answered), then
             <B B B B Q I I I I>  op answered, ok, pending, event flags (1: RESYNC),
                                  generation:u64, evicted:u32, n_ids:u32, n_flags:u32,
                                  n_events:u32
             then n_ids int64 (host block ids), n_flags u8 (LOOKUP: one `LookupCode` per key
             answered; PREPARE_STORE: 1 for each asked key in the plan, in order;
             PREPARE_LOAD: came-from-storage per key), then n_events tier events, then the
             error text (UTF-8, rest). A tier event:
                 <B B H I>  tier (1 host, 2 storage), removed (0, 1), key_width:u16,
                            n_keys:u32 (at least 1), then the keys as in an op record
             RESYNC: the connection fell behind its namespace's event log (see
             `fanout`): every block announced before is to be taken as removed; the
             events that follow (this reply's and the next ones') start from the
             namespace's state.
    ERROR    the head, then UTF-8 text: why the service drops this connection.

A new service takes over the running one (`kvtier serve --takeover`, issue 37) on the same
socket instead of an engine's HELLO:

    TAKEOVER client -> service, the head, then a UTF-8 JSON object (`Takeover`: the new
             service's deployment id and pid, `prepare`). The first frame of a connection,
             and only there; only a peer of the service's own uid may send it.
    TAKEN    service -> client, the head, then a UTF-8 JSON object (`Taken`: the old
             service's deployment id, pid and instance nonce, its worker processes over
             every namespace, `stopping`). To a `prepare`: nothing else happens (the new
             one starts that many workers warm, then asks again on a new connection).
             Otherwise it stops taking work, ends its sessions, writes the hand-over and
             releases the socket's lock. Or ERROR: why it will not (another deployment,
             already stopping).

These two frames are read whatever the head's wire version (`decode_head`): the point of a
take-over is an upgrade, so a newer service must be able to ask an older one.

No pickle and no eval: decoding builds only ints, bytes, str and the dataclasses below, and
checks every length against the frame; a bad frame raises `WireError` naming the frame, the
record and the field. Integers are little-endian.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from kvtier.manager.errors import KvtierError
from kvtier.manager.keyed_events import HOST, STORAGE, TierEvent

WIRE_VERSION = 4  # 2: EVENTS, tier events on REPLY, WELCOME's storage; 3: REMOVE; 4: tenant, RETAIN
MAX_FRAME = 8 << 20  # 8 MiB: a 1M-token prompt's 65,536 32-byte hashes is 2 MiB
MAX_HELLO = 64 << 10
MAX_JSON_DEPTH = 8  # HELLO / WELCOME nest 3 deep (object, shape or segments, a segment)
# Keys over every record of one OPS frame (issue 34): a 1M-token prompt at 16 tokens a block
# is 65,536 hashes. Measured on a 2-core box, one PREPARE_STORE of 2.8 M keys held its
# namespace for 8.6 s (~3 us a key); the service works a frame in slices of `SLICE_KEYS`
# keys, taking the namespace's lock once per slice, so a frame at this cap holds it a few
# milliseconds at a time and the frame as a whole takes about 0.2 s.
MAX_FRAME_KEYS = 65_536
SLICE_KEYS = 512
MAX_KEY_BYTES = 1024
MAX_REQUEST_ID = 1024
MAX_ERROR_TEXT = 4096
MAX_TENANT_BYTES = 256  # kvtier.manager.tenants' bound
# Keys one REMOVE may name: an audit removes the blocks of one store (a request's blocks,
# 1,024 of them are 16k tokens at 16 a block); a client cuts a longer list into several.
MAX_REMOVE_KEYS = 1024
# REMOVE's reason codes (the flag) -> the reason `KeyedHostCache.remove` counts
REMOVE_REASONS = {1: "audit_mismatch"}
# Warm workers a take-over starts at most (TAKEN's `workers`): a bound on what an answer
# can make the new service spawn
MAX_TAKEOVER_WORKERS = 256
REPLY_EVENT_BYTES = 1 << 20  # hash bytes of tier events per REPLY (a chunk more at most)

_LEN = struct.Struct("<I")
_HEAD = struct.Struct("<BBHI")
_COUNT = struct.Struct("<I")
_REC = struct.Struct("<BBHiIHxxI")
_REPLY = struct.Struct("<BBBBQIIII")
_EVENT = struct.Struct("<BBHI")
_RETAIN = struct.Struct("<dB")
LEN_BYTES = _LEN.size
HEAD_BYTES = _HEAD.size


class WireError(KvtierError, ValueError):
    """A frame that does not decode: the message names the frame and field at fault."""


class FrameType(IntEnum):
    HELLO = 1
    OPS = 2
    TAKEOVER = 3
    WELCOME = 101
    REPLY = 102
    ERROR = 103
    TAKEN = 104


class Op(IntEnum):
    LOOKUP = 1
    PREPARE_STORE = 2
    PREPARE_LOAD = 3
    PENDING = 4
    REMOVE = 5
    COMPLETE_STORE = 10
    COMPLETE_LOAD = 11
    TOUCH = 12
    COUNT_ASKED = 13
    FORGET = 14
    RESET = 15
    EVENTS = 16
    RETAIN = 17


ASKING = frozenset({Op.LOOKUP, Op.PREPARE_STORE, Op.PREPARE_LOAD, Op.PENDING, Op.REMOVE})
_KEYED = frozenset({Op.LOOKUP, Op.PREPARE_STORE, Op.PREPARE_LOAD, Op.COMPLETE_STORE,
                    Op.COMPLETE_LOAD, Op.TOUCH, Op.REMOVE, Op.RETAIN})
_WITH_RID = frozenset({Op.LOOKUP, Op.COUNT_ASKED, Op.FORGET})
_OPS = {int(o): o for o in Op}
_FRAMES = {int(t): t for t in FrameType}
_TIERS = {HOST: 1, STORAGE: 2}
_TIER_NAMES = {v: k for k, v in _TIERS.items()}


class LookupCode(IntEnum):
    """One key's answer in a LOOKUP reply (values are part of the wire format)."""

    HIT = 1
    PENDING = 2
    MISS = 3
    RETRY = 4


@dataclass(slots=True)
class OpRecord:
    """One op of an OPS frame (see the module table for what each field means per op)."""

    op: Op
    keys: list[bytes] = field(default_factory=list)
    request_id: str = ""
    flag: int = 0
    value: int = 0
    extra: bytes = b""


@dataclass(slots=True)
class Reply:
    """The service's answer to the asking op of an OPS frame."""

    op: Op
    ok: bool
    generation: int
    pending: bool = False
    evicted: int = 0
    ids: list[int] = field(default_factory=list)
    flags: bytes = b""
    error: str = ""
    resync: bool = False
    events: list[TierEvent] = field(default_factory=list)


# ------------------------------------------------------------------------------ hello


@dataclass(frozen=True, slots=True)
class Hello:
    """Who an engine is. Engines of one `namespace` share blocks and must agree on the
    geometry (`shape`: KVShape's fields), `block_size`, the hash algorithm and its seed, and
    the rank count; `pid` is shown to the operator. `hash_block_size`: the tokens per block
    hash of the engine (vLLM's `cache_config.hash_block_size`; 0 = not said, taken as
    `block_size`): token-id steering names blocks only where the two are equal. `kv_groups`:
    the engine's KV cache groups (a hybrid model's several are keyed per group, so token-id
    steering is refused). Both optional in the frame (an engine of before them sends none)."""

    namespace: str
    shape: dict[str, Any]
    block_size: int
    hash_algo: str
    hash_seed: str
    ranks: int
    pid: int
    hash_block_size: int = 0
    kv_groups: int = 1

    def geometry(self) -> dict[str, Any]:
        """What must be equal for two engines to share a namespace's blocks."""
        return {"shape": dict(sorted(self.shape.items())), "block_size": self.block_size,
                "hash_algo": self.hash_algo, "hash_seed": self.hash_seed, "ranks": self.ranks}


SHAPE_FIELDS = {"num_layers": int, "num_kv_heads": int, "head_dim": int, "dtype": str,
                "num_extra_layers": int, "kv_scales": str}


@dataclass(frozen=True, slots=True)
class Segment:
    rank: int
    name: str
    inode: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class Welcome:
    """The service's answer to HELLO: this connection's `session` id, the service instance
    `nonce` (hex), the namespace's `generation` and host quota, its host pool
    segments (one per rank), and the service's `storage` backend ("none", "file", "redis",
    ...)."""

    session: int
    nonce: str
    generation: int
    quota_bytes: int
    segments: tuple[Segment, ...]
    storage: str = "none"


def _field(obj: dict[str, Any], frame: str, name: str, kind: type) -> Any:
    if name not in obj:
        raise WireError(f"{frame}: field {name!r} is missing")
    value = obj[name]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise WireError(f"{frame}: field {name!r} must be an integer, got {value!r:.60}")
    if kind is not int and not isinstance(value, kind):
        raise WireError(f"{frame}: field {name!r} must be {kind.__name__}, got {value!r:.60}")
    return value


_JSON_TOKEN = re.compile(rb'\\.|["\[\]{}]')  # an escape pair, a quote, a bracket


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (brackets in strings skipped),
    without parsing it, in one linear pass: a bound checked before `json.loads`, whose
    recursion a deep text exhausts."""
    depth = deepest = 0
    in_string = False
    for m in _JSON_TOKEN.finditer(body):
        t = m.group()
        if t == b'"':
            in_string = not in_string
        elif in_string or len(t) == 2:
            continue
        elif t in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def _json_body(body: bytes, frame: str) -> dict[str, Any]:
    if len(body) > MAX_HELLO:
        raise WireError(f"{frame}: {len(body)} bytes of JSON, at most {MAX_HELLO}")
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise WireError(f"{frame}: JSON nested {depth} deep, at most {MAX_JSON_DEPTH}")
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise WireError(f"{frame}: not a UTF-8 JSON object ({e.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise WireError(f"{frame}: not a JSON object")
    return obj


def encode_hello(h: Hello, seq: int = 0) -> bytes:
    body = json.dumps({"namespace": h.namespace, "shape": h.shape, "block_size": h.block_size,
                       "hash_algo": h.hash_algo, "hash_seed": h.hash_seed, "ranks": h.ranks,
                       "pid": h.pid, "hash_block_size": h.hash_block_size,
                       "kv_groups": h.kv_groups}).encode()
    return _frame(FrameType.HELLO, seq, body)


def decode_hello(body: bytes) -> Hello:
    obj = _json_body(body, "HELLO")
    ns = _field(obj, "HELLO", "namespace", str)
    if not ns or len(ns) > 256 or not ns.isprintable():
        raise WireError("HELLO: field 'namespace' must be 1-256 printable characters")
    shape = _field(obj, "HELLO", "shape", dict)
    for name, kind in SHAPE_FIELDS.items():
        _field(shape, "HELLO shape", name, kind)
    extra = set(shape) - set(SHAPE_FIELDS)
    if extra:
        raise WireError(f"HELLO shape: unknown field(s) {sorted(extra)}")
    block = _field(obj, "HELLO", "block_size", int)
    ranks = _field(obj, "HELLO", "ranks", int)
    pid = _field(obj, "HELLO", "pid", int)
    hash_block = _field(obj, "HELLO", "hash_block_size", int) if "hash_block_size" in obj else 0
    groups = _field(obj, "HELLO", "kv_groups", int) if "kv_groups" in obj else 1
    for name, v, lo in (("block_size", block, 1), ("ranks", ranks, 1), ("pid", pid, 0),
                        ("hash_block_size", hash_block, 0), ("kv_groups", groups, 1)):
        if not lo <= v < 1 << 31:
            raise WireError(f"HELLO: field {name!r} = {v} is out of range")
    if not 1 <= ranks <= 64:
        raise WireError(f"HELLO: field 'ranks' = {ranks}: 1 to 64 ranks")
    return Hello(ns, dict(shape), block, _field(obj, "HELLO", "hash_algo", str)[:128],
                 _field(obj, "HELLO", "hash_seed", str)[:256], ranks, pid, hash_block,
                 groups)


def encode_welcome(w: Welcome, seq: int = 0) -> bytes:
    body = json.dumps({"session": w.session, "nonce": w.nonce, "generation": w.generation,
                       "quota_bytes": w.quota_bytes, "storage": w.storage,
                       "segments": [{"rank": s.rank, "name": s.name, "inode": s.inode,
                                     "num_blocks": s.num_blocks} for s in w.segments]}).encode()
    return _frame(FrameType.WELCOME, seq, body)


def decode_welcome(body: bytes) -> Welcome:
    obj = _json_body(body, "WELCOME")
    segs = []
    for s in _field(obj, "WELCOME", "segments", list):
        if not isinstance(s, dict):
            raise WireError("WELCOME: a segment is not an object")
        segs.append(Segment(_field(s, "WELCOME segment", "rank", int),
                            _field(s, "WELCOME segment", "name", str),
                            _field(s, "WELCOME segment", "inode", int),
                            _field(s, "WELCOME segment", "num_blocks", int)))
    return Welcome(_field(obj, "WELCOME", "session", int), _field(obj, "WELCOME", "nonce", str),
                   _field(obj, "WELCOME", "generation", int),
                   _field(obj, "WELCOME", "quota_bytes", int), tuple(segs),
                   _field(obj, "WELCOME", "storage", str)[:64])


@dataclass(frozen=True, slots=True)
class Takeover:
    """A new service asking the running one to hand over (TAKEOVER); `prepare`: only to
    say what it runs (the new one starts its workers warm, then asks again)."""

    deployment_id: str
    pid: int
    prepare: bool = False


@dataclass(frozen=True, slots=True)
class Taken:
    """The running service's answer (TAKEN): who it is, its worker processes over every
    namespace, and whether it is stopping now (False: a `prepare` answered)."""

    deployment_id: str
    pid: int
    nonce: str
    workers: int = 0
    stopping: bool = True


def encode_takeover(t: Takeover, seq: int = 0) -> bytes:
    body = json.dumps({"deployment_id": t.deployment_id, "pid": t.pid,
                       "prepare": t.prepare}).encode()
    return _frame(FrameType.TAKEOVER, seq, body)


def decode_takeover(body: bytes) -> Takeover:
    obj = _json_body(body, "TAKEOVER")
    return Takeover(_field(obj, "TAKEOVER", "deployment_id", str)[:256],
                    _field(obj, "TAKEOVER", "pid", int),
                    bool(_field(obj, "TAKEOVER", "prepare", bool)))


def encode_taken(t: Taken, seq: int = 0) -> bytes:
    body = json.dumps({"deployment_id": t.deployment_id, "pid": t.pid, "nonce": t.nonce,
                       "workers": t.workers, "stopping": t.stopping}).encode()
    return _frame(FrameType.TAKEN, seq, body)


def decode_taken(body: bytes) -> Taken:
    obj = _json_body(body, "TAKEN")
    workers = _field(obj, "TAKEN", "workers", int)
    if not 0 <= workers <= MAX_TAKEOVER_WORKERS:
        raise WireError(f"TAKEN: field 'workers' = {workers}, 0 to {MAX_TAKEOVER_WORKERS}")
    return Taken(_field(obj, "TAKEN", "deployment_id", str)[:256],
                 _field(obj, "TAKEN", "pid", int), _field(obj, "TAKEN", "nonce", str)[:64],
                 workers, bool(_field(obj, "TAKEN", "stopping", bool)))


# ------------------------------------------------------------------------------ frames


def _frame(ftype: FrameType, seq: int, body: bytes) -> bytes:
    n = HEAD_BYTES + len(body)
    if n > MAX_FRAME:
        raise WireError(f"{ftype.name}: a frame of {n} bytes is over MAX_FRAME ({MAX_FRAME})")
    return _LEN.pack(n) + _HEAD.pack(WIRE_VERSION, ftype, 0, seq & 0xFFFFFFFF) + body


def frame_length(prefix: bytes) -> int:
    """The body length a 4-byte prefix announces; WireError when over MAX_FRAME or under a
    head."""
    (n,) = _LEN.unpack(prefix)
    if n > MAX_FRAME:
        raise WireError(f"frame: {n} bytes announced, at most {MAX_FRAME} (MAX_FRAME)")
    if n < HEAD_BYTES:
        raise WireError(f"frame: {n} bytes announced, shorter than the {HEAD_BYTES}-byte head")
    return int(n)


def decode_head(body: bytes) -> tuple[FrameType, int, bytes]:
    """(frame type, seq, the rest) of a frame body."""
    if len(body) < HEAD_BYTES:
        raise WireError(f"frame: {len(body)} bytes, shorter than the {HEAD_BYTES}-byte head")
    version, ftype, _, seq = _HEAD.unpack_from(body)
    if version != WIRE_VERSION:
        raise WireError(f"frame: wire version {version}, this side speaks {WIRE_VERSION}")
    t = _FRAMES.get(ftype)
    if t is None:
        raise WireError(f"frame: unknown frame type {ftype}")
    return t, seq, body[HEAD_BYTES:]


def decode_takeover_head(body: bytes) -> tuple[FrameType, int, bytes]:
    """`decode_head`, except that TAKEOVER, TAKEN and ERROR frames are read whatever the
    head's wire version (a newer service asks an older one to hand over)."""
    if len(body) >= HEAD_BYTES:
        _, ftype, _, seq = _HEAD.unpack_from(body)
        if ftype in (FrameType.TAKEOVER, FrameType.TAKEN, FrameType.ERROR):
            return FrameType(ftype), seq, body[HEAD_BYTES:]
    return decode_head(body)


def encode_error(text: str, seq: int = 0) -> bytes:
    return _frame(FrameType.ERROR, seq, text.encode("utf-8", "replace")[:MAX_ERROR_TEXT])


def _pack_keys(keys: list[bytes]) -> tuple[int, bytes]:
    if not keys:
        return 0, b""
    width = len(keys[0])
    if 0 < width <= MAX_KEY_BYTES and all(len(k) == width for k in keys):
        return width, b"".join(keys)
    for k in keys:
        if not 0 < len(k) <= MAX_KEY_BYTES:
            raise WireError(f"OPS: a key of {len(k)} bytes (1 to {MAX_KEY_BYTES})")
    lens = struct.pack(f"<{len(keys)}H", *(len(k) for k in keys))
    return 0, lens + b"".join(keys)


def _unpack_keys(body: bytes, at: int, n_keys: int, width: int,
                 where: str) -> tuple[list[bytes], int]:
    """`n_keys` keys packed as `_pack_keys` packs them, from `at`; (keys, the offset after)."""
    keys: list[bytes] = []
    if not n_keys:
        return keys, at
    if width:
        end = at + n_keys * width
        if end > len(body):
            raise WireError(f"{where}: truncated keys ({n_keys} x {width} bytes "
                            f"announced, {len(body) - at} left)")
        return [body[j:j + width] for j in range(at, end, width)], end
    if at + 2 * n_keys > len(body):
        raise WireError(f"{where}: truncated key lengths ({n_keys} announced)")
    lens = struct.unpack_from(f"<{n_keys}H", body, at)
    at += 2 * n_keys
    if sum(lens) > len(body) - at:
        raise WireError(f"{where}: truncated keys ({sum(lens)} bytes announced, "
                        f"{len(body) - at} left)")
    for j, n in enumerate(lens):
        if not 0 < n <= MAX_KEY_BYTES:
            raise WireError(f"{where}: key {j} of {n} bytes (1 to {MAX_KEY_BYTES})")
        keys.append(body[at:at + n])
        at += n
    return keys, at


def encode_ops(records: list[OpRecord], seq: int) -> bytes:
    parts = [_COUNT.pack(len(records))]
    for r in records:
        rid = r.request_id.encode()
        if len(rid) > MAX_REQUEST_ID:
            raise WireError(f"OPS {r.op.name}: request id of {len(rid)} bytes, at most "
                            f"{MAX_REQUEST_ID}")
        width, keys = _pack_keys(r.keys)
        parts.append(_REC.pack(r.op, r.flag, len(rid), r.value, len(r.keys), width,
                               len(r.extra)))
        parts.append(rid)
        parts.append(keys)
        parts.append(r.extra)
    return _frame(FrameType.OPS, seq, b"".join(parts))


def frame_batches(records: list[OpRecord]) -> list[list[OpRecord]]:
    """`records` in order, cut into OPS frames of at most MAX_FRAME_KEYS keys each; a one-way
    record with more keys is cut into several records of its op. An asking op must fit in
    one frame (WireError)."""
    out: list[list[OpRecord]] = []
    cur: list[OpRecord] = []
    n = 0
    for r in records:
        pieces = [r]
        if len(r.keys) > MAX_FRAME_KEYS:
            if r.op in ASKING:
                raise WireError(f"OPS {r.op.name}: {len(r.keys)} keys, at most "
                                f"{MAX_FRAME_KEYS} (MAX_FRAME_KEYS)")
            pieces = [OpRecord(r.op, r.keys[i:i + MAX_FRAME_KEYS], r.request_id, r.flag,
                               r.value, r.extra)
                      for i in range(0, len(r.keys), MAX_FRAME_KEYS)]
        for p in pieces:
            if cur and n + len(p.keys) > MAX_FRAME_KEYS:
                out.append(cur)
                cur, n = [], 0
            cur.append(p)
            n += len(p.keys)
    if cur:
        out.append(cur)
    return out


def decode_ops(body: bytes) -> list[OpRecord]:
    """The op records of an OPS frame body (after the head). At most one asking op, last."""
    if len(body) < _COUNT.size:
        raise WireError("OPS: no record count")
    (count,) = _COUNT.unpack_from(body)
    at = _COUNT.size
    if count > (len(body) - at) // _REC.size:
        raise WireError(f"OPS: {count} records announced, the frame holds at most "
                        f"{(len(body) - at) // _REC.size}")
    out: list[OpRecord] = []
    mv = memoryview(body)
    total_keys = 0
    for i in range(count):
        where = f"OPS record {i}"
        if at + _REC.size > len(body):
            raise WireError(f"{where}: truncated head")
        op_v, flag, rid_len, value, n_keys, width, n_extra = _REC.unpack_from(body, at)
        at += _REC.size
        op = _OPS.get(op_v)
        if op is None:
            raise WireError(f"{where}: unknown op {op_v}")
        where = f"OPS record {i} ({op.name})"
        if rid_len > MAX_REQUEST_ID:
            raise WireError(f"{where}: field rid_len = {rid_len}, at most {MAX_REQUEST_ID}")
        if rid_len and op not in _WITH_RID:
            raise WireError(f"{where}: field rid_len = {rid_len}, this op takes no request id")
        if n_keys and op not in _KEYED:
            raise WireError(f"{where}: field n_keys = {n_keys}, this op takes no keys")
        if op is Op.EVENTS and flag > 1:
            raise WireError(f"{where}: field flag = {flag} (1: on, 0: off)")
        if width > MAX_KEY_BYTES:
            raise WireError(f"{where}: field key_width = {width}, at most {MAX_KEY_BYTES}")
        total_keys += n_keys
        if total_keys > MAX_FRAME_KEYS:  # refused before a key is built
            raise WireError(f"{where}: {total_keys} keys in the frame so far, at most "
                            f"{MAX_FRAME_KEYS} (MAX_FRAME_KEYS)")
        if at + rid_len > len(body):
            raise WireError(f"{where}: truncated request id ({rid_len} bytes announced)")
        try:
            rid = bytes(mv[at:at + rid_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"{where}: the request id is not UTF-8") from None
        at += rid_len
        keys, at = _unpack_keys(body, at, n_keys, width, where)
        if op is Op.RETAIN and flag not in (1, 2):
            raise WireError(f"{where}: field flag = {flag} (1: retain, 2: unpin)")
        if n_extra or op is Op.RETAIN:
            _check_extra(op, flag, n_keys, n_extra, where)
            if at + n_extra > len(body):
                raise WireError(f"{where}: truncated extra bytes ({n_extra} announced)")
        extra = body[at:at + n_extra]
        at += n_extra
        if op in (Op.PREPARE_STORE, Op.RETAIN):
            try:
                (extra[_RETAIN.size:] if op is Op.RETAIN and flag == 1 else extra).decode()
            except UnicodeDecodeError:
                raise WireError(f"{where}: the tenant is not UTF-8") from None
        if op in ASKING and i != count - 1:
            raise WireError(f"{where}: an asking op must be the frame's last record")
        out.append(OpRecord(op, keys, rid, flag, value, extra))
    if at != len(body):
        raise WireError(f"OPS: {len(body) - at} bytes after the last record")
    return out


def _check_extra(op: Op, flag: int, n_keys: int, n_extra: int, where: str) -> None:
    if op is Op.PREPARE_LOAD:
        if n_extra != n_keys:
            raise WireError(f"{where}: field n_extra = {n_extra}, one count flag per key "
                            f"({n_keys})")
    elif op is Op.PREPARE_STORE:
        if n_extra > MAX_TENANT_BYTES:
            raise WireError(f"{where}: field n_extra = {n_extra}, a tenant of at most "
                            f"{MAX_TENANT_BYTES} bytes")
    elif op is Op.RETAIN:
        lo, hi = (_RETAIN.size, _RETAIN.size + MAX_TENANT_BYTES) if flag == 1 else (0, 0)
        if not lo <= n_extra <= hi:
            raise WireError(f"{where}: field n_extra = {n_extra}, must be in [{lo}, {hi}]")
    else:
        raise WireError(f"{where}: field n_extra = {n_extra}: only PREPARE_LOAD, "
                        "PREPARE_STORE and RETAIN carry extra bytes")


def store_record(hashes: list[bytes], tenant: str = "") -> OpRecord:
    """A PREPARE_STORE of `tenant`'s blocks."""
    return OpRecord(Op.PREPARE_STORE, hashes, extra=tenant.encode())


def retain_record(hashes: list[bytes], *, pin: bool = False, ttl_s: float = 0.0,
                  priority: int = 0, tenant: str = "", unpin: bool = False) -> OpRecord:
    """A RETAIN of these blocks (the `kvtier.retain` v1 payload), or their unpin."""
    if unpin:
        return OpRecord(Op.RETAIN, hashes, flag=2)
    return OpRecord(Op.RETAIN, hashes, flag=1, value=priority,
                    extra=_RETAIN.pack(ttl_s, int(pin)) + tenant.encode())


def decode_retain(r: OpRecord) -> tuple[bool, float, int, str]:
    """(pin, ttl_s, priority, tenant) of a RETAIN retain record (checked by `decode_ops`;
    the values' ranges are the receiver's to check)."""
    ttl, pin = _RETAIN.unpack_from(r.extra)
    return bool(pin), ttl, r.value, r.extra[_RETAIN.size:].decode()


def encode_reply(r: Reply, seq: int) -> bytes:
    err = r.error.encode("utf-8", "replace")[:MAX_ERROR_TEXT]
    parts = [_REPLY.pack(r.op, r.ok, r.pending, int(r.resync), r.generation, r.evicted,
                         len(r.ids), len(r.flags), len(r.events)),
             struct.pack(f"<{len(r.ids)}q", *r.ids), r.flags]
    for e in r.events:
        if not e.hashes:
            raise WireError(f"REPLY ({r.op.name}): a tier event without keys")
        width, keys = _pack_keys(list(e.hashes))
        parts.append(_EVENT.pack(_TIERS[e.tier], e.removed, width, len(e.hashes)))
        parts.append(keys)
    parts.append(err)
    return _frame(FrameType.REPLY, seq, b"".join(parts))


def decode_reply(body: bytes) -> Reply:
    if len(body) < _REPLY.size:
        raise WireError("REPLY: truncated head")
    op_v, ok, pending, ev_flags, gen, evicted, n_ids, n_flags, n_events = _REPLY.unpack_from(
        body)
    op = _OPS.get(op_v)
    if op is None:
        raise WireError(f"REPLY: unknown op {op_v}")
    if ev_flags > 1:
        raise WireError(f"REPLY ({op.name}): field event_flags = {ev_flags} (0 or 1)")
    at = _REPLY.size
    if at + 8 * n_ids + n_flags > len(body):
        raise WireError(f"REPLY ({op.name}): {n_ids} ids and {n_flags} flags announced, "
                        f"{len(body) - at} bytes left")
    ids = list(struct.unpack_from(f"<{n_ids}q", body, at))
    at += 8 * n_ids
    flags = body[at:at + n_flags]
    at += n_flags
    if n_events > (len(body) - at) // _EVENT.size:
        raise WireError(f"REPLY ({op.name}): field n_events = {n_events}, the frame holds at "
                        f"most {(len(body) - at) // _EVENT.size}")
    events: list[TierEvent] = []
    for i in range(n_events):
        where = f"REPLY ({op.name}) event {i}"
        if at + _EVENT.size > len(body):
            raise WireError(f"{where}: truncated head")
        tier_v, removed, width, n_keys = _EVENT.unpack_from(body, at)
        at += _EVENT.size
        tier = _TIER_NAMES.get(tier_v)
        if tier is None:
            raise WireError(f"{where}: field tier = {tier_v} (1 host, 2 storage)")
        if removed > 1:
            raise WireError(f"{where}: field removed = {removed} (0 or 1)")
        if not n_keys:
            raise WireError(f"{where}: field n_keys = 0 (an event names at least one block)")
        if width > MAX_KEY_BYTES:
            raise WireError(f"{where}: field key_width = {width}, at most {MAX_KEY_BYTES}")
        keys, at = _unpack_keys(body, at, n_keys, width, where)
        events.append(TierEvent(tier, bool(removed), tuple(keys)))
    return Reply(op, bool(ok), gen, bool(pending), evicted, ids, flags,
                 body[at:].decode("utf-8", "replace"), bool(ev_flags), events)
