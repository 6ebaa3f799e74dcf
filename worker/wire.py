"""The wire format between the manager and its workers: the one module both sides import.

The manager never touches KV bytes; everything it needs done to them becomes a `Task` naming
block ids. A task is broadcast to every worker (one per tensor-parallel rank) and is complete
when every rank has answered it with a `Completion`. Nothing outside this module builds or
parses messages, so the encoding can change in one place (`kvtier.worker.ipc` only moves the bytes).

Task kinds and what their fields mean:

    kind       src            dst            keys                       result
    D2H        device ids     host ids       -                          -
    H2D        host ids       device ids     -                          - (per layer progress)
    FILL       -              device ids     content key per block      -
    CHECK      device ids     -              content key per block      indices that differ
    BACKUP     host ids       -              storage key per block      pages written
    PREFETCH   -              host ids       storage key per block      leading pages read
    QUERY      -              -              storage key per block      leading pages present
    CLEAR      -              -              -                          pages deleted
    DELETE     -              -              storage key per block      pages deleted
    REVOKE     PREFETCH seqs  -              -                          how many of them
                                                                        were not done yet
    LIST       [max pages]    -              -                          1: `detail` is the
                                                                        whole listing, 0: none
    RETAIN     [mode, pin,    -              storage key per block      pages marked
               ttl_ms, prio]                                            (mode 1: retain,
                                                                        2: unpin)

`priority`: larger runs first within a class of tasks (loads a request waits on outrank
backups). A worker runs four classes side by side, each on its own thread, so no class waits
behind another (`kvtier.worker.executor.TASK_CLASSES`): device loads (H2D, and the FILL and
CHECK diagnostics), device backups (D2H), storage reads (QUERY, PREFETCH) and storage writes
(BACKUP, CLEAR, DELETE, LIST, RETAIN). REVOKE is in no class: a worker applies it as it receives it
(a PREFETCH it names stops after the page batch it is reading and answers with the pages read
so far; one not started reads none).

LIST asks storage which pages it holds (the manager's index of what storage holds, see
`kvtier.manager.storage_tier`): rank 0 answers 1 and, in `detail`, the `key_tag` of every
page of its namespace, or 0 when it cannot list them all (more than `max pages`, longer than
the worker's time budget, no backend); the other ranks answer 1 and nothing. A page is
served only where every rank holds it, so rank 0's listing is a superset of what storage can
serve, which is all the index needs (a page it lists and another rank lacks costs a query's
wait, never data); listing on one rank spares the others the scan.

Encoding (all integers little-endian, no pickle: a worker never executes what it decodes).
Every message starts with the version byte `WIRE_VERSION` and a `MessageType` byte:

    TASK        32-byte head  <B B B x i q I I I H xx>
                version, type, kind, -, priority:i32, seq:i64, n_src:u32, n_dst:u32,
                n_keys:u32, key_width:u16
                then src ids (n_src x int64), dst ids (n_dst x int64), then the keys: when
                key_width > 0 every key has that many bytes and they follow back to back;
                when key_width == 0, n_keys u16 lengths come first, then the key bytes.
    COMPLETION  32-byte head  <B B B x I q q I I>
                version, type, ok:u8, -, rank:u32, seq:i64, result:i64, n_detail:u32,
                n_error:u32; then detail (n_detail x int64), then the error text (UTF-8).
    ARENA_REF   40-byte head  <B B 6x q Q Q Q>
                version, type, -, seq:i64, offset:u64, length:u64, end:u64 -- a TASK message
                too large for a queue message lies in the shared-memory arena at `offset`;
                `end` is the arena position the reader reports once it has copied it out.
    FRAGMENT    24-byte head  <B B xx I q H H I>
                version, type, -, sender:u32, seq:i64, index:u16, count:u16, length:u32;
                then `length` bytes: part `index` of `count` of one larger message (used for
                completions, whose sender cannot write the manager's arena).

Ids are 64-bit so any pool size fits; the 32-byte head keeps the id arrays 8-byte aligned.
Sequence numbers stay below `SEQ_LIMIT` (2**47) so that a (seq, layers_done) pair packs into
one 64-bit shared-memory word (see `kvtier.worker.ipc.control`). Decoding checks every length
against the head and raises ValueError naming the message and the field that does not add up.
"""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

WIRE_VERSION = 5  # 2: REVOKE, 3: LIST, 4: DELETE, 5: RETAIN
SEQ_LIMIT = 1 << 47
MAX_KEY_BYTES = 0xFFFF
_BIG_ENDIAN = sys.byteorder == "big"


class TaskKind(IntEnum):
    """What a worker is asked to do; values are part of the wire format."""

    D2H = 1
    H2D = 2
    FILL = 3
    CHECK = 4
    BACKUP = 5
    PREFETCH = 6
    QUERY = 7
    CLEAR = 8
    REVOKE = 9
    LIST = 10
    DELETE = 11
    RETAIN = 12


RETAIN_SET = 1
"""RETAIN's mode (`src[0]`): mark the pages (pin, TTL, priority in `src[1:4]`)."""
RETAIN_UNPIN = 2
"""RETAIN's mode: take the pin off the pages."""


class Priority(IntEnum):
    """Default priorities: a request waits on loads; nobody waits on backups."""

    BACKUP = 0
    EVICT = 10
    PREFETCH = 20
    LOAD = 30
    CONTROL = 40


class MessageType(IntEnum):
    """Second byte of every message; values are part of the wire format."""

    TASK = 1
    COMPLETION = 2
    ARENA_REF = 3
    FRAGMENT = 4


def _same_ids(a: Any, b: Any) -> bool:
    """Ids compare by value whether they are lists (as built) or int64 arrays (as decoded)."""
    if len(a) != len(b):
        return False
    return bool(np.array_equal(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)))


@dataclass(slots=True, eq=False)
class Task:
    """One unit of work for every rank. `seq` is unique per manager and names the task in
    completions.

    `src`/`dst` are block ids: the manager builds them as lists (any sequence of ints, or an
    int64 numpy array, encodes); a worker decodes them as lists, or as read-only int64 numpy
    arrays when it asks for arrays (cheaper for large tasks). Equality compares ids by value
    either way."""

    seq: int
    kind: TaskKind
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    priority: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Task):
            return NotImplemented
        return (
            self.seq == other.seq
            and self.kind == other.kind
            and self.priority == other.priority
            and list(self.keys) == list(other.keys)
            and _same_ids(self.src, other.src)
            and _same_ids(self.dst, other.dst)
        )


@dataclass(slots=True)
class Completion:
    """A rank's answer to task `seq`. `ok=False` carries `error`; `result` and `detail` are
    kind-specific (see the module table)."""

    seq: int
    rank: int
    ok: bool
    result: int = 0
    detail: list[int] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True, slots=True)
class ArenaRef:
    """Where the encoded TASK message `seq` lies in the shared-memory arena; `end` is the
    arena position the reader publishes once it has copied the bytes out (it frees them)."""

    seq: int
    offset: int
    length: int
    end: int


@dataclass(frozen=True, slots=True)
class Fragment:
    """Part `index` of `count` of one message too large for a queue message, sent by
    `sender` (a rank) about task `seq`."""

    sender: int
    seq: int
    index: int
    count: int
    data: bytes


_KINDS: dict[int, TaskKind] = {int(k): k for k in TaskKind}
_MESSAGE_TYPES: dict[int, MessageType] = {int(t): t for t in MessageType}
_TASK_HEAD = struct.Struct("<BBBxiqIIIHxx")
_COMPLETION_HEAD = struct.Struct("<BBBxIqqII")
_REF_HEAD = struct.Struct("<BB6xqQQQ")
_FRAGMENT_HEAD = struct.Struct("<BBxxIqHHI")
_U16 = np.dtype("<u2")
_I64 = np.dtype("<i8")

TASK_HEAD_BYTES = _TASK_HEAD.size
ARENA_REF_BYTES = _REF_HEAD.size
FRAGMENT_HEAD_BYTES = _FRAGMENT_HEAD.size

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U32_MAX = (1 << 32) - 1


# --------------------------------------------------------------------------- helpers


def _check_seq(what: str, seq: int) -> int:
    if isinstance(seq, bool) or not isinstance(seq, int | np.integer):
        raise ValueError(f"{what}: seq must be an int, got {type(seq).__name__}")
    seq = int(seq)
    if not 0 <= seq < SEQ_LIMIT:
        raise ValueError(f"{what}: seq {seq} out of range [0, 2**47)")
    return seq


@functools.lru_cache(maxsize=128)
def _int64s(count: int) -> struct.Struct:
    return struct.Struct(f"<{count}q")


def _ids_bytes(what: str, ids: Any) -> tuple[int, bytes]:
    """Block ids -> (count, little-endian int64 bytes); any int sequence or int array."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1:
            raise ValueError(f"{what}: ids must be one-dimensional, got shape {ids.shape}")
        if ids.size and ids.dtype.kind not in "iu":
            raise ValueError(f"{what}: ids must be integers, got dtype {ids.dtype}")
        if ids.dtype.kind == "u" and ids.size and int(ids.max()) > _I64_MAX:
            raise ValueError(f"{what}: id {int(ids.max())} does not fit in int64")
        return int(ids.size), ids.astype(_I64, copy=False).tobytes()
    try:
        count = len(ids)
        return count, _int64s(count).pack(*ids)
    except (TypeError, struct.error):
        pass
    if not hasattr(ids, "__len__"):
        raise ValueError(f"{what}: ids must be a sequence, got {type(ids).__name__}")
    for i, x in enumerate(ids):
        if isinstance(x, float | str | bytes) or not hasattr(x, "__index__"):
            raise ValueError(f"{what}: id {i} must be an integer, got {type(x).__name__} {x!r}")
        if not _I64_MIN <= int(x) <= _I64_MAX:
            raise ValueError(f"{what}: id {i} = {int(x)} does not fit in int64")
    raise ValueError(f"{what}: ids could not be encoded as int64")


def _read_ids(raw: bytes, offset: int, count: int, as_array: bool) -> Any:
    if as_array:
        out = np.frombuffer(raw, dtype=_I64, count=count, offset=offset)
        return out if not _BIG_ENDIAN else out.astype(np.int64)
    arr = array("q")
    arr.frombytes(raw[offset : offset + 8 * count])
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tolist()


def _keys_bytes(what: str, keys: Iterable[bytes]) -> tuple[int, int, bytes]:
    """Keys -> (count, uniform width or 0, encoded bytes)."""
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, bytes | bytearray | memoryview):
            raise ValueError(f"{what}: key {i} must be bytes, got {type(k).__name__}")
        if len(k) > MAX_KEY_BYTES:
            raise ValueError(f"{what}: key {i} is {len(k)} bytes, at most {MAX_KEY_BYTES}")
    if not keys:
        return 0, 0, b""
    width = len(keys[0])
    if width and all(len(k) == width for k in keys):
        return len(keys), width, b"".join(keys)
    lengths = np.fromiter((len(k) for k in keys), dtype=_U16, count=len(keys))
    return len(keys), 0, lengths.tobytes() + b"".join(keys)


def _raw(buf: bytes | bytearray | memoryview) -> bytes:
    return buf if isinstance(buf, bytes) else bytes(buf)


def _check_head(
    buf: bytes, what: str, head: struct.Struct, mtype: MessageType
) -> tuple[Any, ...]:
    if len(buf) < head.size:
        raise ValueError(
            f"{what} message: {len(buf)} bytes, shorter than its {head.size}-byte head"
        )
    fields = head.unpack_from(buf)
    if fields[0] != WIRE_VERSION:
        raise ValueError(f"{what} message: wire version {fields[0]}, expected {WIRE_VERSION}")
    if fields[1] != mtype:
        raise ValueError(f"{what} message: type byte {fields[1]}, expected {int(mtype)}")
    return fields


# --------------------------------------------------------------------------- dispatch


def message_type(buf: bytes | bytearray | memoryview) -> MessageType:
    """The type of an encoded message, after checking its version byte."""
    if len(buf) < 2:
        raise ValueError(f"message of {len(buf)} bytes: too short for a version and a type")
    if buf[0] != WIRE_VERSION:
        raise ValueError(f"message with wire version {buf[0]}, expected {WIRE_VERSION}")
    mtype = _MESSAGE_TYPES.get(buf[1])
    if mtype is None:
        raise ValueError(f"message with unknown type byte {buf[1]}")
    return mtype


# --------------------------------------------------------------------------- tasks


def encode_task(task: Task) -> bytes:
    """One TASK message holding the whole task (the transport decides where it travels)."""
    seq = _check_seq("task", task.seq)
    what = f"task seq={seq}"
    kind = (
        _KINDS.get(task.kind)
        if isinstance(task.kind, int) and not isinstance(task.kind, bool)
        else None
    )
    if kind is None:
        raise ValueError(f"{what}: unknown task kind {task.kind!r}")
    if isinstance(task.priority, bool) or not isinstance(task.priority, int | np.integer):
        raise ValueError(f"{what}: priority must be an int, got {task.priority!r}")
    if not _I32_MIN <= task.priority <= _I32_MAX:
        raise ValueError(f"{what}: priority {task.priority} does not fit in int32")
    n_src, src = _ids_bytes(f"{what} src", task.src)
    n_dst, dst = _ids_bytes(f"{what} dst", task.dst)
    n_keys, width, keys = _keys_bytes(f"{what} keys", task.keys)
    for name, n in (("src ids", n_src), ("dst ids", n_dst), ("keys", n_keys)):
        if n > _U32_MAX:
            raise ValueError(f"{what}: {n} {name}, at most {_U32_MAX}")
    head = _TASK_HEAD.pack(
        WIRE_VERSION, MessageType.TASK, kind, int(task.priority), seq, n_src, n_dst, n_keys, width
    )
    return b"".join((head, src, dst, keys))


def decode_task(buf: bytes | bytearray | memoryview, *, ids_as_arrays: bool = False) -> Task:
    """Inverse of `encode_task`. With `ids_as_arrays`, src/dst are read-only int64 arrays
    sharing `buf`'s memory (no per-id Python objects); otherwise lists of int."""
    raw = _raw(buf)
    _, _, kind, priority, seq, n_src, n_dst, n_keys, width = _check_head(
        raw, "task", _TASK_HEAD, MessageType.TASK
    )
    what = f"task message seq={seq}"
    if kind not in _KINDS:
        raise ValueError(f"{what}: unknown task kind {kind}")
    kind = _KINDS[kind]
    if not 0 <= seq < SEQ_LIMIT:
        raise ValueError(f"{what}: seq out of range [0, 2**47)")
    ids_end = _TASK_HEAD.size + 8 * (n_src + n_dst)
    if width:
        lengths = None
        expected = ids_end + n_keys * width
    else:
        if len(raw) < ids_end + 2 * n_keys:
            raise ValueError(
                f"{what}: {len(raw)} bytes, too short for {n_src} src + {n_dst} dst ids and "
                f"{n_keys} key lengths"
            )
        lengths = np.frombuffer(raw, dtype=_U16, count=n_keys, offset=ids_end).tolist()
        expected = ids_end + 2 * n_keys + sum(lengths)
    if len(raw) != expected:
        key_desc = f"{n_keys} keys of {width} bytes" if width else f"{n_keys} variable keys"
        raise ValueError(
            f"{what}: {len(raw)} bytes, but its head announces {n_src} src + {n_dst} dst ids "
            f"and {key_desc} = {expected} bytes"
        )
    src = _read_ids(raw, _TASK_HEAD.size, n_src, ids_as_arrays)
    dst = _read_ids(raw, _TASK_HEAD.size + 8 * n_src, n_dst, ids_as_arrays)
    if width:
        keys = [raw[o : o + width] for o in range(ids_end, expected, width)]
    else:
        keys = []
        o = ids_end + 2 * n_keys
        for n in lengths or ():
            keys.append(raw[o : o + n])
            o += n
    return Task(seq=seq, kind=kind, src=src, dst=dst, keys=keys, priority=priority)


# --------------------------------------------------------------------------- completions


def encode_completion(completion: Completion) -> bytes:
    """One COMPLETION message (the transport fragments it when it is too large)."""
    seq = _check_seq("completion", completion.seq)
    what = f"completion seq={seq}"
    rank = completion.rank
    if (
        isinstance(rank, bool)
        or not isinstance(rank, int | np.integer)
        or not 0 <= rank <= _U32_MAX
    ):
        raise ValueError(f"{what}: rank must be a non-negative int, got {rank!r}")
    if isinstance(completion.result, bool) or not isinstance(completion.result, int | np.integer):
        raise ValueError(f"{what}: result must be an int, got {completion.result!r}")
    if not _I64_MIN <= completion.result <= _I64_MAX:
        raise ValueError(f"{what}: result {completion.result} does not fit in int64")
    n_detail, detail = _ids_bytes(f"{what} detail", completion.detail)
    if not isinstance(completion.error, str):
        raise ValueError(f"{what}: error must be a str, got {type(completion.error).__name__}")
    error = completion.error.encode("utf-8", errors="replace")
    head = _COMPLETION_HEAD.pack(
        WIRE_VERSION,
        MessageType.COMPLETION,
        1 if completion.ok else 0,
        int(rank),
        seq,
        int(completion.result),
        n_detail,
        len(error),
    )
    return b"".join((head, detail, error))


def decode_completion(buf: bytes | bytearray | memoryview) -> Completion:
    """Inverse of `encode_completion`."""
    raw = _raw(buf)
    _, _, ok, rank, seq, result, n_detail, n_error = _check_head(
        raw, "completion", _COMPLETION_HEAD, MessageType.COMPLETION
    )
    what = f"completion message seq={seq} rank={rank}"
    if ok not in (0, 1):
        raise ValueError(f"{what}: ok byte is {ok}, expected 0 or 1")
    expected = _COMPLETION_HEAD.size + 8 * n_detail + n_error
    if len(raw) != expected:
        raise ValueError(
            f"{what}: {len(raw)} bytes, but its head announces {n_detail} detail ids and "
            f"{n_error} error bytes = {expected} bytes"
        )
    detail = _read_ids(raw, _COMPLETION_HEAD.size, n_detail, False)
    error = raw[_COMPLETION_HEAD.size + 8 * n_detail :].decode("utf-8", errors="replace")
    return Completion(seq=seq, rank=rank, ok=bool(ok), result=result, detail=detail, error=error)


# --------------------------------------------------------------------------- arena refs


def encode_arena_ref(ref: ArenaRef) -> bytes:
    """The small message that stands in the queue for a TASK message lying in the arena."""
    _check_seq("arena ref", ref.seq)
    if min(ref.offset, ref.length, ref.end) < 0:
        raise ValueError(f"arena ref seq={ref.seq}: negative offset, length or end {ref}")
    return _REF_HEAD.pack(
        WIRE_VERSION, MessageType.ARENA_REF, ref.seq, ref.offset, ref.length, ref.end
    )


def decode_arena_ref(buf: bytes | bytearray | memoryview) -> ArenaRef:
    """Inverse of `encode_arena_ref`."""
    raw = _raw(buf)
    _, _, seq, offset, length, end = _check_head(raw, "arena ref", _REF_HEAD, MessageType.ARENA_REF)
    if len(raw) != _REF_HEAD.size:
        raise ValueError(
            f"arena ref message seq={seq}: {len(raw)} bytes, expected {_REF_HEAD.size}"
        )
    return ArenaRef(seq=seq, offset=offset, length=length, end=end)


# --------------------------------------------------------------------------- fragments


def encode_fragments(message: bytes, *, sender: int, seq: int, max_size: int) -> list[bytes]:
    """Split `message` into FRAGMENT messages of at most `max_size` bytes each."""
    chunk = max_size - _FRAGMENT_HEAD.size
    if chunk <= 0:
        raise ValueError(f"fragments: max_size {max_size} leaves no room past the head")
    count = max(1, -(-len(message) // chunk))
    if count > 0xFFFF:
        raise ValueError(
            f"fragments: a {len(message)}-byte message needs {count} fragments, at most 65535"
        )
    out = []
    for index in range(count):
        part = message[index * chunk : (index + 1) * chunk]
        head = _FRAGMENT_HEAD.pack(
            WIRE_VERSION, MessageType.FRAGMENT, sender, seq, index, count, len(part)
        )
        out.append(head + part)
    return out


def decode_fragment(buf: bytes | bytearray | memoryview) -> Fragment:
    """One FRAGMENT message -> its `Fragment`."""
    raw = _raw(buf)
    _, _, sender, seq, index, count, length = _check_head(
        raw, "fragment", _FRAGMENT_HEAD, MessageType.FRAGMENT
    )
    what = f"fragment message sender={sender} seq={seq}"
    if count == 0 or index >= count:
        raise ValueError(f"{what}: index {index} of count {count}")
    if len(raw) != _FRAGMENT_HEAD.size + length:
        raise ValueError(f"{what}: {len(raw)} bytes, but its head announces {length} data bytes")
    return Fragment(
        sender=sender, seq=seq, index=index, count=count, data=raw[_FRAGMENT_HEAD.size :]
    )


class Reassembler:
    """Joins fragments back into messages.

    Data structure: `_parts[(sender, seq)]` is the list of parts received so far, in order.
    Invariant: fragments of one message arrive in order (each sender writes them to one FIFO
    queue back to back), so a fragment with an unexpected index means the sender restarted:
    its partial message is dropped and a ValueError names it."""

    def __init__(self) -> None:
        self._parts: dict[tuple[int, int], list[bytes]] = {}

    def add(self, fragment: Fragment) -> bytes | None:
        """The whole message once its last fragment arrives, else None."""
        key = (fragment.sender, fragment.seq)
        parts = self._parts.get(key, [])
        if fragment.index != len(parts):
            self._parts.pop(key, None)
            raise ValueError(
                f"fragment sender={fragment.sender} seq={fragment.seq}: got part "
                f"{fragment.index} of {fragment.count}, expected part {len(parts)}"
            )
        parts.append(fragment.data)
        if len(parts) < fragment.count:
            self._parts[key] = parts
            return None
        self._parts.pop(key, None)
        return b"".join(parts)

    def discard(self, sender: int) -> int:
        """Drop the partial messages of `sender` (e.g. a rank that died); returns how many."""
        stale = [k for k in self._parts if k[0] == sender]
        for k in stale:
            del self._parts[k]
        return len(stale)

    def pending(self) -> int:
        """How many messages are partially received."""
        return len(self._parts)


def key_tag(skey: bytes) -> int:
    """The 64-bit tag of a storage key in a LIST answer: its first 8 bytes as a signed
    little-endian int (completion details are int64s, and the ranks' details are merged as a
    set). Keys are SHA-256 digests, so two of 2**18 listed pages share a tag with odds of
    about 2**-28; a shared tag costs a lookup a query's wait, never data."""
    return int.from_bytes(skey[:8], "little", signed=True)


# How the ranks' results of one task combine into the task's result: a page counts only where
# every rank has it (minimum), every rank deletes its own pages (sum), other counts (CHECK
# mismatches) take the worst rank (maximum). A DELETE counts the blocks whose page every
# rank deleted (minimum): a block is gone from storage once no rank can serve its page.
MIN_RESULT_KINDS = frozenset({TaskKind.QUERY, TaskKind.PREFETCH, TaskKind.BACKUP,
                              TaskKind.LIST, TaskKind.DELETE, TaskKind.RETAIN})
SUM_RESULT_KINDS = frozenset({TaskKind.CLEAR})


def merge_results(kind: TaskKind, a: int, b: int) -> int:
    """Combine two ranks' results of a task of `kind`."""
    if kind in MIN_RESULT_KINDS:
        return min(a, b)
    if kind in SUM_RESULT_KINDS:
        return a + b
    return max(a, b)
