"""The manager <-> worker transport: named POSIX queues, shared-memory flags and an id arena.

One manager process talks to `num_ranks` worker processes (one per tensor-parallel rank).
Every name derives from the deployment id, so two deployments never collide and a restart
can remove what a crashed run of the same id left behind:

    /kvtier_<id>_ctl        shared memory  control segment (flags, heartbeats, layer progress)
    /kvtier_<id>_arena      shared memory  id arena: tasks too large for one queue message
    /kvtier_<id>_notify     semaphore      "the control segment changed" (wakes manager waiters)
    /kvtier_<id>_task<r>    message queue  tasks for rank r (manager -> worker r), FIFO
    /kvtier_<id>_done       message queue  completions (every worker -> manager)

All are created with mode 0600 by the manager (`ManagerIPC`), after unlinking stale ones of
the same id, and unlinked by `ManagerIPC.close()` (also run at interpreter exit). Workers
(`WorkerIPC`) only attach.

Why message queues, and why an arena: a POSIX message queue gives a blocking, timed,
kernel-woken receive with no polling, which is what keeps idle workers at ~0% CPU and a round
trip in tens of microseconds. But the kernel defaults (msg_max=10 messages, msgsize_max=8192
bytes; not raisable inside a container) and the per-user RLIMIT_MSGQUEUE budget (819,200 bytes
by default, shared by every queue of the user) make queues small: queues here are 10 messages
of `MESSAGE_SIZE` = 4096 bytes (about 41 KB of the budget each, so ~19 queues fit instead of 9
at 8 KiB). A task whose encoding does not fit (more than ~250 ids) is written once into the
arena, a ring owned by the manager, and every rank's queue gets a 40-byte `ArenaRef` instead.
Measured on a 2-vCPU machine, 2 workers: 8,192 ids round trip 285 us via the arena vs 396-462
us chunked through the queues; 60,000 ids 2.4 ms vs 4.2-5.0 ms (and chunks fill the queues).
Each rank copies the bytes out as soon as it receives the ref and publishes the arena position
it has reached; the manager reuses arena space once every rank the task was delivered to has
passed it (FIFO queues make positions monotonic). Completions are small except for rare long
`detail` lists; those are split into FRAGMENT messages (a worker cannot write the arena).

Control segment layout (all fields int64, native little-endian, 8-byte aligned; one aligned
64-bit store is atomic on the 64-bit platforms we run on, so readers never see torn values):

    byte off  field
    0         magic  (b"KVTIERC1")
    8         layout version (2)
    16        num_ranks
    24        progress slots per rank (K)
    32        manager pid
    40        manager heartbeat, time.monotonic_ns() (CLOCK_MONOTONIC: system-wide)
    48        instance nonce (random; tells this manager's segments from a successor's)
    56        paused (0/1)
    64        tree status (TreeStatus)
    72        arena bytes
    80        queue message size
    88        pools generation: even while the pools exist, odd while they are freed (sleep)
    96        device blocks of the next wake      104  host blocks of the next wake
    112..127  reserved
    128 + r * (136 + 8K)  rank r block:
        +0  ready (0/1)         +8  heartbeat ns       +16 pid          +24 tasks in flight
        +32 arena position consumed                    +40 tasks received
        +48 last seq received   +56 host pool NUMA node + 1 (0: not bound)
        +64 storage backend figures: one word per name of STORAGE_FIGURES, -1 where the
            rank's backend does not report that figure (or has not published yet)
        +128 pools generation this rank has reached (see "Sleep" below)
        +136 progress ring: K words, slot seq % K holds (seq << 16) | layers_done

Layer progress: a worker loading task `seq` layer by layer stores one word per layer into its
ring and posts the notify semaphore; the manager's watcher thread turns each post into a
`threading.Condition` broadcast, so `ManagerIPC.wait_layer(seq, layer, timeout)` returns as
soon as every rank has published that layer, with no message per layer. All waits are bounded.
A load that fails on a rank is published as `LAYERS_FAILED`; `LayerProgress` reads the rings
read-only for a model runner that waits per layer without a manager object.

Storage figures: what only a rank's backend knows (damaged pages it refused and deleted,
pages evicted for capacity, Redis outages, bytes held) is published by the worker after each
storage task into its rank block, so the admin reads it with no message and no lock.

Sleep (weight updates): the manager frees every rank's pools by making the pools generation
odd; each worker cancels what it holds (queued tasks fail, "cancelled: ..."), frees its device
and host pools and publishes the generation it reached. Waking makes it even again, with the
pool sizes in the two words before it; each worker re-creates its pools at those sizes and
publishes the generation. A worker never touches a pool while the generation is odd: every
task it receives then fails at once.

Liveness: the manager's two threads refresh its heartbeat at least every
`HEARTBEAT_INTERVAL_S`; a worker refreshes its own in every `recv_task` call and raises
`ManagerGone` when the manager's heartbeat is older than `manager_timeout` (default 3 s) or
its pid is gone, so orphaned workers exit by themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import queue
import re
import resource
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum

import posix_ipc
from kvtier.worker.errors import KvtierError
from kvtier.worker.wire import (
    ArenaRef,
    Completion,
    MessageType,
    Reassembler,
    Task,
    decode_arena_ref,
    decode_completion,
    decode_fragment,
    decode_task,
    encode_arena_ref,
    encode_completion,
    encode_fragments,
    encode_task,
    message_type,
)

log = logging.getLogger(__name__)

MAX_RANKS = 64
QUEUE_DEPTH = 10
MESSAGE_SIZE = 4096
DEFAULT_ARENA_BYTES = 8 << 20
PROGRESS_SLOTS = 256
HEARTBEAT_INTERVAL_S = 0.5
MANAGER_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 5.0
_SEND_SLICE_S = 0.05  # a send to a full queue re-checks its rank's worker this often
MAX_LAYERS = 0xFFFF

_DEPLOYMENT_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
_MAGIC = int.from_bytes(b"KVTIERC1", "little")
_LAYOUT_VERSION = 3

# header words
_W_MAGIC, _W_LAYOUT, _W_RANKS, _W_SLOTS = 0, 1, 2, 3
_W_MANAGER_PID, _W_MANAGER_BEAT, _W_INSTANCE = 4, 5, 6
_W_PAUSED, _W_TREE, _W_ARENA_BYTES, _W_MSG_SIZE = 7, 8, 9, 10
_W_POOLS, _W_WAKE_DEVICE, _W_WAKE_HOST = 11, 12, 13
_HEADER_WORDS = 16
# rank block words
_R_READY, _R_BEAT, _R_PID, _R_INFLIGHT = 0, 1, 2, 3
_R_CONSUMED, _R_RECEIVED, _R_LAST_SEQ, _R_NUMA = 4, 5, 6, 7
_R_STORAGE = 8
STORAGE_FIGURES = (
    "corrupt_pages",  # damaged pages refused (a miss) and deleted; counter
    "evicted_pages",  # pages deleted to stay under the capacity limit; counter
    "misses",  # pages a read asked for and did not get; counter
    "outages",  # times the store became unreachable; counter
    "available",  # 1 while the store answers, 0 while it does not; gauge
    "used_bytes",  # bytes of pages held; gauge
    "stored_pages",  # pages held; gauge
    "capacity_bytes",  # the byte limit (0: none); gauge
)
"""Backend figures a worker publishes (names as in `StorageBackend.stats()`)."""
_R_POOLS = _R_STORAGE + len(STORAGE_FIGURES)
_RANK_FIXED_WORDS = _R_POOLS + 1
_LAYER_BITS = 16
_LAYER_MASK = (1 << _LAYER_BITS) - 1
LAYERS_FAILED = _LAYER_MASK
"""Layer count a worker publishes for a load that failed on its rank (no real count reaches
it: `MAX_LAYERS` bounds them), so layer waiters outside the manager learn it at once."""


class TreeStatus(IntEnum):
    """Prefix-tree status flag shared with workers (values live in shared memory)."""

    NORMAL = 0
    CLEARING = 1
    CLEARED = 2


# --------------------------------------------------------------------------- errors


class IPCError(KvtierError, RuntimeError):
    """The transport cannot do what was asked (missing deployment, kernel limit, ...)."""


class DeploymentInUse(IPCError):
    """Another live manager holds this deployment id."""


class ManagerGone(IPCError):
    """Raised on the worker side when the manager died or stopped beating.

    `pid_gone` tells a dead manager (its names may be removed) from a stalled one."""

    def __init__(self, message: str, *, pid_gone: bool) -> None:
        super().__init__(message)
        self.pid_gone = pid_gone


class TaskAborted(IPCError):
    """A layer waiter's task failed on some rank, or the manager aborted it."""

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(f"task seq={seq} aborted: {reason}")
        self.seq = seq
        self.reason = reason


class DeploymentAsleep(IPCError):
    """The deployment's pools are freed (a sleep for a weight update), or were re-created
    since a load began: the loads of before the sleep were cancelled and never land."""


class SendTimeout(KvtierError, TimeoutError):
    """A bounded send gave up. `rank` is the rank whose queue stayed full (None for the
    completion queue or the arena); `delivered` lists the ranks that did get the task."""

    def __init__(self, message: str, *, rank: int | None, delivered: list[int]) -> None:
        super().__init__(message)
        self.rank = rank
        self.delivered = delivered


class LayerWaitTimeout(KvtierError, TimeoutError):
    """`wait_layer` timed out; `ranks` are the ranks that had not published the layer."""

    def __init__(self, message: str, *, seq: int, layer: int, ranks: list[int]) -> None:
        super().__init__(message)
        self.seq = seq
        self.layer = layer
        self.ranks = ranks


# --------------------------------------------------------------------------- names


def validate_deployment_id(deployment_id: str) -> str:
    """The id itself, or ValueError: ids become parts of kernel object names."""
    if not isinstance(deployment_id, str) or not _DEPLOYMENT_ID.fullmatch(deployment_id):
        raise ValueError(
            f"deployment_id {deployment_id!r} is invalid: use 1-32 characters of A-Z a-z 0-9 _ -"
        )
    return deployment_id


@dataclass(frozen=True, slots=True)
class IPCNames:
    """Every kernel object name of one deployment with `num_ranks` ranks.

    No two deployment ids share a name: each name is `/kvtier_<id>_<suffix>` and no suffix
    contains `_`, so the id is everything between the prefix and the last `_`."""

    deployment_id: str
    num_ranks: int
    control: str
    arena: str
    notify: str
    completions: str
    tasks: tuple[str, ...]

    @property
    def segments(self) -> tuple[str, ...]:
        """Shared-memory segment names (visible in /dev/shm)."""
        return (self.control, self.arena)

    @property
    def semaphores(self) -> tuple[str, ...]:
        """Semaphore names (visible in /dev/shm as sem.<name>)."""
        return (self.notify,)

    @property
    def queues(self) -> tuple[str, ...]:
        """Message-queue names (in the mqueue namespace)."""
        return (*self.tasks, self.completions)

    def all(self) -> list[str]:
        """Every name, segments first."""
        return [*self.segments, *self.semaphores, *self.queues]


def ipc_names(deployment_id: str, num_ranks: int) -> IPCNames:
    """The names a deployment of `num_ranks` ranks uses."""
    validate_deployment_id(deployment_id)
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int):
        raise ValueError(f"num_ranks must be an int, got {num_ranks!r}")
    if not 1 <= num_ranks <= MAX_RANKS:
        raise ValueError(f"num_ranks {num_ranks} out of range [1, {MAX_RANKS}]")
    p = f"/kvtier_{deployment_id}_"
    return IPCNames(
        deployment_id=deployment_id,
        num_ranks=num_ranks,
        control=p + "ctl",
        arena=p + "arena",
        notify=p + "notify",
        completions=p + "done",
        tasks=tuple(f"{p}task{r}" for r in range(num_ranks)),
    )


def _unlink(name: str, kind: str) -> bool:
    unlink = {
        "segment": posix_ipc.unlink_shared_memory,
        "semaphore": posix_ipc.unlink_semaphore,
        "queue": posix_ipc.unlink_message_queue,
    }[kind]
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _kinds(names: IPCNames) -> list[tuple[str, str]]:
    return (
        [(n, "segment") for n in names.segments]
        + [(n, "semaphore") for n in names.semaphores]
        + [(n, "queue") for n in names.queues]
    )


def cleanup_stale(deployment_id: str, max_ranks: int = MAX_RANKS) -> list[str]:
    """Unlink every name a deployment of this id (with up to `max_ranks` ranks) could have
    created; returns the names that existed. Only for ids no live manager uses."""
    removed = []
    for name, kind in _kinds(ipc_names(deployment_id, max_ranks)):
        if _unlink(name, kind):
            removed.append(name)
    return removed


def existing_names(deployment_id: str, max_ranks: int = MAX_RANKS) -> list[str]:
    """Which of the deployment's names exist now (tests use it to check nothing is left).

    Checked by opening each object, since /dev/mqueue is not necessarily mounted."""
    found = []
    for name, kind in _kinds(ipc_names(deployment_id, max_ranks)):
        try:
            if kind == "segment":
                posix_ipc.SharedMemory(name).close_fd()
            elif kind == "semaphore":
                posix_ipc.Semaphore(name).close()
            else:
                posix_ipc.MessageQueue(name).close()
        except posix_ipc.ExistentialError:
            continue
        found.append(name)
    return found


@dataclass(frozen=True, slots=True)
class OwnerState:
    """What a deployment's control segment says of its manager (`owner_state`)."""

    manager_pid: int
    beat_age_s: float  # seconds since the manager's last heartbeat
    worker_pids: tuple[int, ...]  # the pids the ranks last published (0: none)

    @property
    def alive(self) -> bool:
        """The manager runs, or beat recently (a pid of another pid namespace looks dead)."""
        return pid_alive(self.manager_pid) or self.beat_age_s < MANAGER_TIMEOUT_S


def owner_state(deployment_id: str) -> OwnerState | None:
    """The control segment's manager pid, heartbeat age and worker pids; None when the
    deployment has no control segment (or not a complete one). Read-only: for a sweep of
    dead deployments' names, which must never touch a live one."""
    try:
        mm = _open_segment(ipc_names(deployment_id, 1).control, 0, create=False,
                           read_only=True)
    except (posix_ipc.ExistentialError, ValueError, OSError):
        return None
    try:
        words = memoryview(mm).cast("q")
        try:
            if len(words) < _HEADER_WORDS or words[_W_MAGIC] != _MAGIC:
                return None
            ranks, slots = words[_W_RANKS], words[_W_SLOTS]
            stride = _RANK_FIXED_WORDS + slots
            pids = tuple(int(words[_HEADER_WORDS + r * stride + _R_PID])
                         for r in range(max(0, min(ranks, MAX_RANKS)))
                         if _HEADER_WORDS + r * stride + _R_PID < len(words))
            return OwnerState(int(words[_W_MANAGER_PID]),
                              (time.monotonic_ns() - words[_W_MANAGER_BEAT]) / 1e9, pids)
        finally:
            words.release()
    finally:
        mm.close()


# --------------------------------------------------------------------------- helpers


def process_start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot, /proc/<pid>/stat field 22); None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        return int(text.rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def _open_segment(name: str, size: int, *, create: bool, read_only: bool = False) -> mmap.mmap:
    if create:
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            # Reserve the pages now: a sparse segment on a /dev/shm that fills up later
            # would SIGBUS its first writer instead of failing here.
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as e:
            shm.close_fd()
            _unlink(name, "segment")
            raise IPCError(
                f"cannot reserve {size} bytes of /dev/shm for {name}: "
                f"{os.strerror(e.errno or 0)} (free space in /dev/shm, or the container's "
                "shm_size)"
            ) from None
    else:
        shm = posix_ipc.SharedMemory(name, read_only=read_only)
    try:
        access = mmap.ACCESS_READ if read_only else mmap.ACCESS_WRITE
        return mmap.mmap(shm.fd, size or shm.size, access=access)
    finally:
        shm.close_fd()


def _queue_budget_hint(depth: int, size: int) -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MSGQUEUE)
    per_queue = depth * (size + 64)
    fits = "unlimited" if soft < 0 else str(max(0, soft // per_queue))
    return (
        f"each user may hold RLIMIT_MSGQUEUE={soft} bytes of message queues (about {fits} "
        f"queues of {depth}x{size} bytes); other deployments or stale queues may hold it "
        "(remove them with worker.ipc.cleanup_stale), and depth/size must not exceed "
        "/proc/sys/fs/mqueue/msg_max and msgsize_max"
    )


class _Control:
    """Typed access to the control segment (layout in the module docstring).

    `words` is an int64 memoryview over the mapping; every field is one aligned word, read
    and written whole."""

    def __init__(self, mm: mmap.mmap, num_ranks: int, slots: int) -> None:
        self.mm = mm
        self.words = memoryview(mm).cast("q")
        self.num_ranks = num_ranks
        self.slots = slots
        self.stride = _RANK_FIXED_WORDS + slots

    @staticmethod
    def size(num_ranks: int, slots: int) -> int:
        return 8 * (_HEADER_WORDS + num_ranks * (_RANK_FIXED_WORDS + slots))

    def rank_word(self, rank: int, field: int) -> int:
        return _HEADER_WORDS + rank * self.stride + field

    def slot_word(self, rank: int, seq: int) -> int:
        return _HEADER_WORDS + rank * self.stride + _RANK_FIXED_WORDS + seq % self.slots

    def get(self, rank: int, field: int) -> int:
        return self.words[self.rank_word(rank, field)]

    def put(self, rank: int, field: int, value: int) -> None:
        self.words[self.rank_word(rank, field)] = value

    def clear_rank(self, rank: int) -> None:
        """Zero the rank's block; its storage figures read as not reported."""
        start = self.rank_word(rank, 0)
        for i in range(start, start + self.stride):
            self.words[i] = 0
        self.forget_storage_figures(rank)

    def forget_storage_figures(self, rank: int) -> None:
        for i in range(len(STORAGE_FIGURES)):
            self.put(rank, _R_STORAGE + i, -1)

    def close(self) -> None:
        self.words.release()
        self.mm.close()


@dataclass(frozen=True, slots=True)
class RankState:
    """A snapshot of one rank's flags, as the admin and the launcher show them."""

    rank: int
    ready: bool
    pid: int
    alive: bool
    heartbeat_age_s: float | None
    tasks_inflight: int
    tasks_received: int
    last_seq: int
    host_numa_node: int | None  # the NUMA node its host pool is bound to (None: not bound)
    pools_generation: int  # the pools generation the worker reached (odd: freed)

    def describe(self) -> str:
        """One phrase for error messages."""
        if self.pid == 0:
            return f"rank {self.rank}: no worker attached"
        if not self.alive:
            return f"rank {self.rank}: worker pid {self.pid} is not running"
        age = "never" if self.heartbeat_age_s is None else f"{self.heartbeat_age_s:.1f}s ago"
        return (
            f"rank {self.rank}: worker pid {self.pid} alive, "
            f"{'ready' if self.ready else 'not ready'}, heartbeat {age}, "
            f"{self.tasks_inflight} tasks in flight"
        )


def _rank_state(ctl: _Control, rank: int, now_ns: int) -> RankState:
    pid = ctl.get(rank, _R_PID)
    beat = ctl.get(rank, _R_BEAT)
    return RankState(
        rank=rank,
        ready=bool(ctl.get(rank, _R_READY)),
        pid=pid,
        alive=pid_alive(pid),
        heartbeat_age_s=(now_ns - beat) / 1e9 if beat else None,
        tasks_inflight=ctl.get(rank, _R_INFLIGHT),
        tasks_received=ctl.get(rank, _R_RECEIVED),
        last_seq=ctl.get(rank, _R_LAST_SEQ),
        host_numa_node=ctl.get(rank, _R_NUMA) - 1 if ctl.get(rank, _R_NUMA) > 0 else None,
        pools_generation=ctl.get(rank, _R_POOLS),
    )


def _layers_done(ctl: _Control, seq: int) -> list[int | None]:
    out: list[int | None] = []
    for r in range(ctl.num_ranks):
        word = ctl.words[ctl.slot_word(r, seq)]
        done = word & _LAYER_MASK
        out.append(done if word >> _LAYER_BITS == seq and done != LAYERS_FAILED else None)
    return out


def _missing_ranks(ctl: _Control, seq: int, layer: int) -> tuple[list[int], list[int]]:
    """(ranks that have not published layer `layer` of load `seq`, ranks where it failed);
    failed ranks are in both lists. IPCError when a rank's slot was overwritten by a newer
    task (the ring is too short for how far apart the tasks are)."""
    missing: list[int] = []
    failed: list[int] = []
    for r in range(ctl.num_ranks):
        word = ctl.words[ctl.slot_word(r, seq)]
        slot_seq = word >> _LAYER_BITS
        if slot_seq == seq:
            done = word & _LAYER_MASK
            if done == LAYERS_FAILED:
                failed.append(r)
                missing.append(r)
            elif done <= layer:
                missing.append(r)
        elif slot_seq > seq:
            raise IPCError(
                f"layer progress of task seq={seq} on rank {r} was overwritten by task "
                f"seq={slot_seq}: more than {ctl.slots} load tasks apart"
            )
        else:
            missing.append(r)
    return missing, failed


@dataclass(slots=True)
class _Allocation:
    start: int
    end: int
    seq: int
    ranks: set[int]


_LIVE_DEPLOYMENTS: set[str] = set()
_LIVE_LOCK = threading.Lock()


# --------------------------------------------------------------------------- manager


class ManagerIPC:
    """The manager's end: creates every name, broadcasts tasks, collects completions.

    Data structures:
      * `_task_queues[r]` (send-only) and `_completion_queue` (receive-only), `_notify` (sem).
      * `_ctl`: the control segment; `_arena`: the id arena mapping (written only here).
      * `_outstanding`: deque of arena allocations in arena order, each with the set of ranks
        it was delivered to and that have not yet copied it out.
      * `_cond`: a Condition broadcast by the watcher thread on every notify post; layer,
        ready and arena-space waiters wait on it (always with a timeout).
      * `_aborted`: seq -> reason for tasks whose layer waiters must fail (bounded LRU).
    Threads: a completion reader (calls `on_completion`, or fills `recv_completion`'s queue)
    and a notify watcher; both refresh the manager heartbeat.
    Invariants: `send_task` is serialised by `_send_lock`, so every rank's queue receives the
    tasks in the same order and arena positions grow in queue order; an arena byte range is
    reused only when every rank in its allocation's set has published a consumed position
    past its end; `close()` leaves no name of this deployment behind.

    Exit paths: `close()` runs on `with` exit, on exceptions through it and at interpreter
    exit (atexit). SIGTERM's default action skips atexit, so the process that owns the
    manager installs a SIGTERM handler that raises SystemExit (or calls `close()`).
    """

    def __init__(
        self,
        deployment_id: str,
        num_ranks: int,
        *,
        on_completion: Callable[[Completion], None] | None = None,
        arena_bytes: int = DEFAULT_ARENA_BYTES,
        progress_slots: int = PROGRESS_SLOTS,
        queue_depth: int = QUEUE_DEPTH,
        message_size: int = MESSAGE_SIZE,
        send_timeout: float = SEND_TIMEOUT_S,
    ) -> None:
        self.names = ipc_names(deployment_id, num_ranks)
        self.deployment_id = deployment_id
        self.num_ranks = num_ranks
        if not 64 << 10 <= arena_bytes <= 1 << 40:
            raise ValueError(f"arena_bytes {arena_bytes} out of range [64 KiB, 1 TiB]")
        if not 1 <= progress_slots <= 1 << 16:
            raise ValueError(f"progress_slots {progress_slots} out of range [1, 65536]")
        if not 1 <= queue_depth <= 1 << 16:
            raise ValueError(f"queue_depth {queue_depth} out of range [1, 65536]")
        if not 256 <= message_size <= 1 << 20:
            raise ValueError(f"message_size {message_size} out of range [256, 1 MiB]")
        if not send_timeout > 0:
            raise ValueError(f"send_timeout must be > 0 seconds, got {send_timeout}")
        self.message_size = message_size
        self.send_timeout = send_timeout
        self._on_completion = on_completion
        self._completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._aborted: OrderedDict[int, str] = OrderedDict()
        self._outstanding: deque[_Allocation] = deque()
        self._arena_head = 0
        self._reassembler = Reassembler()
        self._stopping = False
        self._closed = False
        self._owner_pid = os.getpid()
        self._threads: list[threading.Thread] = []
        self._stats = {"tasks_sent": 0, "tasks_via_arena": 0, "completions": 0}
        # Ranks whose worker could not be started: tasks fail at once instead of queueing
        # for nobody. `_max_seq_sent` is the highest seq handed to the queues so far;
        # `reset_rank` records it per rank (`seq_floor`).
        self._down: set[int] = set()
        self._max_seq_sent = 0
        self._seq_floor = [0] * num_ranks

        with _LIVE_LOCK:
            if deployment_id in _LIVE_DEPLOYMENTS:
                raise DeploymentInUse(
                    f"deployment {deployment_id!r} is already open in this process"
                )
            self._refuse_live_owner()
            _LIVE_DEPLOYMENTS.add(deployment_id)
        try:
            self._create(arena_bytes, progress_slots, queue_depth)
        except BaseException:
            with _LIVE_LOCK:
                _LIVE_DEPLOYMENTS.discard(deployment_id)
            raise
        self._start_threads()
        atexit.register(self.close)

    # ------------------------------------------------------------------ creation

    def _refuse_live_owner(self) -> None:
        try:
            mm = _open_segment(self.names.control, 0, create=False, read_only=True)
        except posix_ipc.ExistentialError:
            return
        try:
            words = memoryview(mm).cast("q")
            try:
                if len(words) < _HEADER_WORDS or words[_W_MAGIC] != _MAGIC:
                    return
                pid, beat = words[_W_MANAGER_PID], words[_W_MANAGER_BEAT]
            finally:
                words.release()
        finally:
            mm.close()
        age = (time.monotonic_ns() - beat) / 1e9
        if pid != os.getpid() and pid_alive(pid) and age < MANAGER_TIMEOUT_S:
            raise DeploymentInUse(
                f"deployment {self.deployment_id!r} is in use by manager pid {pid} "
                f"(heartbeat {age:.1f}s ago); choose another deployment_id or stop it"
            )

    def _create(self, arena_bytes: int, slots: int, depth: int) -> None:
        stale = cleanup_stale(self.deployment_id)
        if stale:
            log.info("removed stale IPC names of deployment %r: %s", self.deployment_id, stale)
        self._ctl: _Control | None = None
        self._arena: mmap.mmap | None = None
        self._notify: posix_ipc.Semaphore | None = None
        self._task_queues: list[posix_ipc.MessageQueue] = []
        self._completion_queue: posix_ipc.MessageQueue | None = None
        try:
            mm = _open_segment(
                self.names.control, _Control.size(self.num_ranks, slots), create=True
            )
            self._ctl = _Control(mm, self.num_ranks, slots)
            self._arena = _open_segment(self.names.arena, arena_bytes, create=True)
            self._arena_size = arena_bytes
            self._notify = posix_ipc.Semaphore(
                self.names.notify, posix_ipc.O_CREX, mode=0o600, initial_value=0
            )
            for name in self.names.queues:
                try:
                    q = posix_ipc.MessageQueue(
                        name,
                        posix_ipc.O_CREX,
                        mode=0o600,
                        max_messages=depth,
                        max_message_size=self.message_size,
                    )
                except (OSError, ValueError, posix_ipc.Error) as e:
                    hint = _queue_budget_hint(depth, self.message_size)
                    raise IPCError(
                        f"cannot create message queue {name} ({depth} messages of "
                        f"{self.message_size} bytes): {e}; {hint}"
                    ) from e
                if name == self.names.completions:
                    self._completion_queue = q
                else:
                    self._task_queues.append(q)
            w = self._ctl.words
            w[_W_LAYOUT] = _LAYOUT_VERSION
            w[_W_RANKS] = self.num_ranks
            w[_W_SLOTS] = slots
            w[_W_MANAGER_PID] = os.getpid()
            w[_W_MANAGER_BEAT] = time.monotonic_ns()
            self.instance = w[_W_INSTANCE] = secrets.randbits(62) + 1
            w[_W_PAUSED] = 0
            w[_W_TREE] = TreeStatus.NORMAL
            w[_W_ARENA_BYTES] = arena_bytes
            w[_W_MSG_SIZE] = self.message_size
            for rank in range(self.num_ranks):
                self._ctl.forget_storage_figures(rank)
            w[_W_MAGIC] = _MAGIC  # last: a worker attaching early sees a complete header
        except BaseException:
            self._release_handles()
            cleanup_stale(self.deployment_id, self.num_ranks)  # just created, all ours
            raise

    def threads(self) -> list[threading.Thread]:
        """The reader threads this manager side runs (completions, notify)."""
        return list(self._threads)

    def _start_threads(self) -> None:
        for target, name in (
            (self._read_completions, "completions"),
            (self._watch_notify, "notify"),
        ):
            t = threading.Thread(
                target=target, name=f"kvtier-ipc-{name}-{self.deployment_id}", daemon=True
            )
            t.start()
            self._threads.append(t)

    # ------------------------------------------------------------------ sending

    def send_task(self, task: Task, timeout: float | None = None) -> None:
        """Broadcast `task` to every rank, in order with the tasks sent before it.

        Raises ValueError for a malformed task (nothing sent), SendTimeout when a rank's
        queue (or the arena) stays full past `timeout` (default `send_timeout`) -- the error
        names the rank and lists the ranks that did get the task."""
        msg = encode_task(task)
        budget = self.send_timeout if timeout is None else timeout
        with self._send_lock:
            self._check_open()
            if self._down:
                rank = min(self._down)
                raise SendTimeout(
                    f"task seq={task.seq}: rank {rank} is down (its worker could not be "
                    f"started); delivered to no rank",
                    rank=rank,
                    delivered=[],
                )
            deadline = time.monotonic() + budget
            alloc = None
            if len(msg) > self.message_size:
                alloc = self._arena_put(msg, task.seq, deadline)
                msg = encode_arena_ref(
                    ArenaRef(
                        seq=task.seq,
                        offset=alloc.start % self._arena_size,
                        length=len(msg),
                        end=alloc.end,
                    )
                )
            for rank, q in enumerate(self._task_queues):
                try:
                    q.send(msg, 0)
                except posix_ipc.BusyError:
                    self._send_blocking(q, msg, rank, task.seq, deadline, budget, alloc)
            self._stats["tasks_sent"] += 1
            if task.seq > self._max_seq_sent:
                self._max_seq_sent = task.seq
            if alloc is not None:
                self._stats["tasks_via_arena"] += 1

    def _send_blocking(
        self,
        q: posix_ipc.MessageQueue,
        msg: bytes,
        rank: int,
        seq: int,
        deadline: float,
        budget: float,
        alloc: _Allocation | None,
    ) -> None:
        # Wait in short slices: a rank whose worker is gone (dead, or not started yet after a
        # reset) will never empty its queue, so the send fails at once instead of holding
        # the send lock (and its caller's locks) for the whole budget.
        ctl = self._require_open()
        gone = False
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                q.send(msg, min(remaining, _SEND_SLICE_S))
                return
            except posix_ipc.BusyError:
                pass
            if not pid_alive(ctl.get(rank, _R_PID)):
                gone = True
                break
        if alloc is not None:
            alloc.ranks.difference_update(range(rank, self.num_ranks))
        state = self.rank_state(rank).describe()
        waited = "and its worker is gone" if gone else f"for {budget:.1f}s"
        raise SendTimeout(
            f"task seq={seq}: the task queue of rank {rank} stayed full {waited} "
            f"({state}); delivered to ranks {list(range(rank))}",
            rank=rank,
            delivered=list(range(rank)),
        )

    def _arena_put(self, msg: bytes, seq: int, deadline: float) -> _Allocation:
        n = len(msg)
        if n > self._arena_size:
            raise ValueError(
                f"task seq={seq}: encodes to {n} bytes, more than the id arena "
                f"({self._arena_size} bytes); split the task or raise arena_bytes"
            )
        size = self._arena_size
        ctl, arena = self._ctl, self._arena
        assert ctl is not None and arena is not None  # send_task checked that the IPC is open
        with self._cond:
            while True:
                self._reclaim()
                head = self._arena_head
                phys = head % size
                start = head if phys + n <= size else head + (size - phys)
                end = start + n
                tail = self._outstanding[0].start if self._outstanding else start
                if end - tail <= size:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    oldest = self._outstanding[0]
                    lagging = sorted(
                        r for r in oldest.ranks if ctl.get(r, _R_CONSUMED) < oldest.end
                    )
                    states = "; ".join(self.rank_state(r).describe() for r in lagging)
                    raise SendTimeout(
                        f"task seq={seq}: no room for {n} bytes in the id arena: ranks "
                        f"{lagging} have not read task seq={oldest.seq} ({states})",
                        rank=lagging[0] if lagging else None,
                        delivered=[],
                    )
                self._cond.wait(remaining)
        phys = start % size
        arena[phys : phys + n] = msg
        self._arena_head = end
        alloc = _Allocation(start=start, end=end, seq=seq, ranks=set(range(self.num_ranks)))
        self._outstanding.append(alloc)
        return alloc

    def _reclaim(self) -> None:
        out = self._outstanding
        if not out:
            return
        ctl = self._require_open()
        while out:
            a = out[0]
            if any(ctl.get(r, _R_CONSUMED) < a.end for r in a.ranks):
                return
            out.popleft()

    def arena_bytes_in_use(self) -> int:
        """Arena bytes still held by tasks some rank has not read yet."""
        with self._send_lock:
            self._reclaim()
            if not self._outstanding:
                return 0
            return self._arena_head - self._outstanding[0].start

    # ------------------------------------------------------------------ completions

    def _read_completions(self) -> None:
        q, ctl = self._completion_queue, self._ctl
        assert q is not None and ctl is not None  # opened by _create, before the threads start
        while not self._stopping:
            ctl.words[_W_MANAGER_BEAT] = time.monotonic_ns()
            try:
                msg, _ = q.receive(HEARTBEAT_INTERVAL_S)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                continue
            if not msg:  # close() wakes us with an empty message
                continue
            try:
                completion = self._decode_completion(msg)
            except ValueError:
                log.exception(
                    "completion queue of %r: dropped a malformed message", self.deployment_id
                )
                continue
            if completion is not None:
                self._dispatch(completion)

    def _decode_completion(self, msg: bytes) -> Completion | None:
        mtype = message_type(msg)
        if mtype == MessageType.COMPLETION:
            return decode_completion(msg)
        if mtype == MessageType.FRAGMENT:
            whole = self._reassembler.add(decode_fragment(msg))
            return None if whole is None else decode_completion(whole)
        raise ValueError(f"unexpected {mtype.name} message on the completion queue")

    def _dispatch(self, completion: Completion) -> None:
        self._stats["completions"] += 1
        if not completion.ok:
            self.abort_task(completion.seq, f"rank {completion.rank}: {completion.error}")
        if self._on_completion is None:
            self._completions.put(completion)
            return
        try:
            self._on_completion(completion)
        except Exception:
            log.exception(
                "on_completion raised for task seq=%d rank=%d; the reader goes on",
                completion.seq,
                completion.rank,
            )

    def recv_completion(self, timeout: float) -> Completion | None:
        """Next completion, or None after `timeout` s -- only when no `on_completion`
        callback was given (otherwise the callback receives them all)."""
        if self._on_completion is not None:
            raise IPCError("completions go to on_completion; recv_completion is unavailable")
        try:
            return self._completions.get(timeout=timeout)
        except queue.Empty:
            return None

    # ------------------------------------------------------------------ notify / waits

    def _watch_notify(self) -> None:
        sem, ctl = self._notify, self._ctl
        assert sem is not None and ctl is not None  # opened by _create, before the threads start
        while not self._stopping:
            ctl.words[_W_MANAGER_BEAT] = time.monotonic_ns()
            try:
                sem.acquire(HEARTBEAT_INTERVAL_S)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                continue
            with self._cond:
                self._cond.notify_all()

    def abort_task(self, seq: int, reason: str) -> None:
        """Make current and future `wait_layer` calls on `seq` raise TaskAborted (the
        launcher calls this for tasks in flight on a dead rank; failed completions do it
        automatically)."""
        with self._cond:
            self._aborted[seq] = reason
            self._aborted.move_to_end(seq)
            while len(self._aborted) > 4096:
                self._aborted.popitem(last=False)
            self._cond.notify_all()

    def layers_done(self, seq: int) -> list[int | None]:
        """Per rank, how many layers of H2D task `seq` are loaded (None: the rank's slot
        holds another task -- not started yet, or overwritten by a much newer one -- or the
        load failed there)."""
        return _layers_done(self._require_open(), seq)

    def _missing(self, seq: int, layer: int) -> list[int]:
        # A failed load counts as missing here: its failed completion aborts the waiters.
        return _missing_ranks(self._require_open(), seq, layer)[0]

    def wait_layer(self, seq: int, layer: int, timeout: float) -> None:
        """Return once every rank has loaded layer `layer` (0-based) of H2D task `seq`.

        Raises LayerWaitTimeout naming the ranks not done after `timeout` s, TaskAborted if
        the task failed on a rank (or `abort_task` was called)."""
        if layer < 0 or layer >= MAX_LAYERS:
            raise ValueError(f"layer {layer} out of range [0, {MAX_LAYERS})")
        if not self._missing(seq, layer) and seq not in self._aborted:
            return
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                reason = self._aborted.get(seq)
                if reason is not None:
                    raise TaskAborted(seq, reason)
                missing = self._missing(seq, layer)
                if not missing:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    ctl, now = self._require_open(), time.monotonic_ns()
                    states = "; ".join(_rank_state(ctl, r, now).describe() for r in missing)
                    raise LayerWaitTimeout(
                        f"task seq={seq}: layer {layer} not loaded after {timeout:.1f}s on "
                        f"ranks {missing} ({states})",
                        seq=seq,
                        layer=layer,
                        ranks=missing,
                    )
                self._cond.wait(remaining)

    def wait_ready(self, timeout: float) -> None:
        """Return once every rank has set its ready flag; TimeoutError naming the others."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                ctl = self._require_open()
                waiting = [r for r in range(self.num_ranks) if not ctl.get(r, _R_READY)]
                if not waiting:
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    states = "; ".join(self.rank_state(r).describe() for r in waiting)
                    raise TimeoutError(
                        f"deployment {self.deployment_id!r}: ranks {waiting} not ready after "
                        f"{timeout:.1f}s ({states})"
                    )
                self._cond.wait(remaining)

    # ------------------------------------------------------------------ flags

    @property
    def paused(self) -> bool:
        """Global pause flag workers read (transfers stop while set)."""
        return bool(self._require_open().words[_W_PAUSED])

    @paused.setter
    def paused(self, value: bool) -> None:
        self._require_open().words[_W_PAUSED] = 1 if value else 0

    @property
    def tree_status(self) -> TreeStatus:
        """Prefix-tree status flag workers read."""
        return TreeStatus(self._require_open().words[_W_TREE])

    @tree_status.setter
    def tree_status(self, value: TreeStatus) -> None:
        self._require_open().words[_W_TREE] = TreeStatus(value)

    @property
    def pools_generation(self) -> int:
        """Even while the workers' pools exist, odd while they are freed (sleep)."""
        return self._require_open().words[_W_POOLS]

    def set_pools_generation(self, generation: int, device_blocks: int = 0,
                             host_blocks: int = 0) -> None:
        """Ask every worker to free its pools (odd `generation`) or to re-create them with
        these sizes (even); the sizes are written before the generation that names them."""
        words = self._require_open().words
        if generation % 2 == 0:
            words[_W_WAKE_DEVICE] = device_blocks
            words[_W_WAKE_HOST] = host_blocks
        words[_W_POOLS] = generation

    def rank_state(self, rank: int) -> RankState:
        """A snapshot of rank `rank`'s flags."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        return _rank_state(self._require_open(), rank, time.monotonic_ns())

    def ranks(self) -> list[RankState]:
        """Snapshots of every rank's flags."""
        return [self.rank_state(r) for r in range(self.num_ranks)]

    def storage_figures(self, rank: int) -> dict[str, int]:
        """The storage figures rank `rank`'s worker last published (names of
        `STORAGE_FIGURES`; figures its backend does not report are left out). Counters start
        again from zero when a replacement worker takes the rank."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        ctl = self._require_open()
        values = (ctl.get(rank, _R_STORAGE + i) for i in range(len(STORAGE_FIGURES)))
        return {name: v for name, v in zip(STORAGE_FIGURES, values, strict=True) if v >= 0}

    def stats(self) -> dict[str, int]:
        """Counters: tasks sent (and via the arena), completions received."""
        return dict(self._stats)

    def reset_rank(self, rank: int) -> int:
        """Forget rank `rank`'s worker after it exited (before starting a replacement):
        drops the tasks still queued for it, releases its hold on the arena, clears its
        flags and layer progress. Returns how many queued messages were dropped.

        Every task sent before the reset has a seq <= `seq_floor(rank)` afterwards (sends are
        serialised and the manager numbers tasks in the order it sends them): those are lost
        with the old worker; a task sent later reaches the rank's next worker."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        with self._send_lock:
            ctl = self._require_open()
            self._seq_floor[rank] = self._max_seq_sent
            dropped = 0
            q = self._task_queues[rank]
            while True:
                try:
                    q.receive(0)
                except posix_ipc.BusyError:
                    break
                dropped += 1
            for a in self._outstanding:
                a.ranks.discard(rank)
            self._reclaim()
            ctl.clear_rank(rank)
            ctl.put(rank, _R_CONSUMED, self._arena_head)
            self._reassembler.discard(rank)
        with self._cond:
            self._cond.notify_all()
        return dropped

    def seq_floor(self, rank: int) -> int:
        """The highest seq sent before rank `rank` was last reset (0: never reset)."""
        return self._seq_floor[rank]

    def set_rank_down(self, rank: int, down: bool) -> None:
        """Mark rank `rank` as having no worker to come (its start failed): while any rank is
        down, `send_task` raises SendTimeout at once, delivering to no rank."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} out of range [0, {self.num_ranks})")
        with self._send_lock:
            if down:
                self._down.add(rank)
            else:
                self._down.discard(rank)

    # ------------------------------------------------------------------ shutdown

    def _check_open(self) -> None:
        if self._closed:
            raise IPCError(f"deployment {self.deployment_id!r}: the manager IPC is closed")

    def _require_open(self) -> _Control:
        self._check_open()
        assert self._ctl is not None
        return self._ctl

    def names_owner(self) -> str:
        """Whose the deployment's names are now: "self" while the control segment under its
        name is this instance's, "other" once a successor (started while this manager was
        frozen past its heartbeat) has replaced them, "none" when it is gone."""
        try:
            mm = _open_segment(self.names.control, 0, create=False, read_only=True)
        except posix_ipc.ExistentialError:
            return "none"
        try:
            words = memoryview(mm).cast("q")
            try:
                mine = (len(words) >= _HEADER_WORDS and words[_W_MAGIC] == _MAGIC
                        and words[_W_INSTANCE] == self.instance)
            finally:
                words.release()
        finally:
            mm.close()
        return "self" if mine else "other"

    def unlink_all(self) -> list[str]:
        """Unlink every name of this deployment (idempotent); returns the ones that existed.
        Open handles keep working, but no worker can attach any more. Names a successor
        instance took over are left alone (split brain after a frozen manager)."""
        if self.names_owner() == "other":
            log.warning("deployment %r: its names belong to another manager instance now; "
                        "leaving them", self.deployment_id)
            return []
        return cleanup_stale(self.deployment_id, self.num_ranks)

    def unlink_owned_segment(self, name: str) -> bool:
        """Unlink shared-memory segment `name` of this deployment (a worker's host pool)
        unless a successor instance took the deployment's names over. True if removed."""
        if self.names_owner() == "other":
            return False
        return _unlink(name, "segment")

    def _release_handles(self) -> None:
        for q in [*getattr(self, "_task_queues", []), getattr(self, "_completion_queue", None)]:
            if q is not None:
                with contextlib.suppress(posix_ipc.Error):
                    q.close()
        self._task_queues = []
        self._completion_queue = None
        notify = getattr(self, "_notify", None)
        if notify is not None:
            with contextlib.suppress(posix_ipc.Error):
                notify.close()
            self._notify = None
        ctl = getattr(self, "_ctl", None)
        if ctl is not None:
            ctl.close()
            self._ctl = None
        arena = getattr(self, "_arena", None)
        if arena is not None:
            arena.close()
            self._arena = None

    def close(self) -> None:
        """Stop the threads, unlink every name and release every handle (idempotent). In a
        forked child it only releases the inherited handles."""
        if self._closed:
            return
        if os.getpid() != self._owner_pid:  # a forked child: the names are not its own
            self._closed = True
            self._release_handles()
            return
        self._stopping = True
        if self._completion_queue is not None:
            with contextlib.suppress(posix_ipc.Error):
                self._completion_queue.send(b"", 0)
        if self._notify is not None:
            with contextlib.suppress(posix_ipc.Error):
                self._notify.release()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=2 * HEARTBEAT_INTERVAL_S + 1.0)
        with self._send_lock, self._cond:
            self._closed = True
            self.unlink_all()
            self._release_handles()
            self._cond.notify_all()
        with _LIVE_LOCK:
            _LIVE_DEPLOYMENTS.discard(self.deployment_id)
        atexit.unregister(self.close)

    def __enter__(self) -> ManagerIPC:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- worker


class WorkerIPC:
    """A worker's end (rank `rank`): receives its tasks, posts completions, keeps its flags.

    Data structures: the control segment (its own rank block written here, the header read),
    the arena mapped read-only, its task queue (receive-only), the completion queue
    (send-only) and the notify semaphore (posted after every change a manager may wait on).
    Invariants: an arena task is copied out of the arena before its consumed position is
    published; fragments of one completion are sent back to back (under `_send_lock`).
    Never unlinks names, except in `close()` after the manager's process has died."""

    def __init__(
        self,
        deployment_id: str,
        rank: int,
        *,
        manager_timeout: float = MANAGER_TIMEOUT_S,
        ids_as_arrays: bool = False,
        expect_instance: int = 0,
    ) -> None:
        validate_deployment_id(deployment_id)
        self.deployment_id = deployment_id
        self.rank = rank
        self.expect_instance = expect_instance  # 0: any (else the manager that started us)
        self.manager_timeout = manager_timeout
        self.ids_as_arrays = ids_as_arrays
        self._send_lock = threading.Lock()
        self._closed = False
        self._ctl: _Control | None = None
        self._arena: mmap.mmap | None = None
        self._tasks: posix_ipc.MessageQueue | None = None
        self._completions: posix_ipc.MessageQueue | None = None
        self._notify: posix_ipc.Semaphore | None = None
        control = f"/kvtier_{deployment_id}_ctl"
        try:
            self._attach(control)
        except posix_ipc.ExistentialError as e:
            self._release_handles()
            raise IPCError(
                f"deployment {deployment_id!r}: no manager is running ({e}; {control} and its "
                "queues are created by the manager)"
            ) from None
        except BaseException:
            self._release_handles()
            raise
        self._last_check = time.monotonic()

    def _attach(self, control: str) -> None:
        mm = _open_segment(control, 0, create=False)
        if len(mm) < 8 * _HEADER_WORDS:
            mm.close()
            raise IPCError(f"{control}: {len(mm)} bytes, too small for a control segment")
        head = memoryview(mm).cast("q")
        try:
            magic, layout = head[_W_MAGIC], head[_W_LAYOUT]
            num_ranks, slots = head[_W_RANKS], head[_W_SLOTS]
            self._manager_pid, self._instance = head[_W_MANAGER_PID], head[_W_INSTANCE]
            self._arena_size, self.message_size = head[_W_ARENA_BYTES], head[_W_MSG_SIZE]
        finally:
            head.release()
        if magic != _MAGIC or layout != _LAYOUT_VERSION:
            mm.close()
            raise IPCError(
                f"{control}: not a kvtier control segment of layout {_LAYOUT_VERSION} "
                "(being created, or from another version)"
            )
        if self.expect_instance and self._instance != self.expect_instance:
            mm.close()
            raise IPCError(
                f"{control}: belongs to another manager instance (pid {self._manager_pid}) "
                "than the one that started this worker"
            )
        self._ctl = _Control(mm, num_ranks, slots)
        if not isinstance(self.rank, int) or not 0 <= self.rank < num_ranks:
            raise ValueError(
                f"rank {self.rank!r} out of range: deployment {self.deployment_id!r} has "
                f"{num_ranks} ranks"
            )
        self.num_ranks = num_ranks
        self.names = ipc_names(self.deployment_id, num_ranks)
        self._arena = _open_segment(self.names.arena, 0, create=False, read_only=True)
        self._tasks = posix_ipc.MessageQueue(self.names.tasks[self.rank], write=False)
        self._completions = posix_ipc.MessageQueue(self.names.completions, read=False)
        self._notify = posix_ipc.Semaphore(self.names.notify)
        ctl = self._ctl
        ctl.put(self.rank, _R_READY, 0)
        ctl.put(self.rank, _R_INFLIGHT, 0)
        ctl.put(self.rank, _R_PID, os.getpid())
        ctl.put(self.rank, _R_BEAT, time.monotonic_ns())
        ctl.forget_storage_figures(self.rank)  # a replacement's counters start again

    # ------------------------------------------------------------------ tasks

    def recv_task(self, timeout: float = HEARTBEAT_INTERVAL_S) -> Task | None:
        """The next task for this rank, or None after `timeout` s (0: don't wait).

        Refreshes this rank's heartbeat; raises ManagerGone when the manager died or
        stopped beating (the worker should then close and exit), ValueError for a
        malformed message. Keep `timeout` short (<= 0.5 s) so the heartbeat stays fresh.
        A signal arriving during the wait (SIGTERM asking the worker to stop) ends it
        early with None, so the caller sees its stop flag instead of an exception."""
        if timeout is None or not timeout >= 0:
            raise ValueError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
        ctl = self._require_open()
        tasks = self._tasks
        assert tasks is not None  # opened with the control segment (_attach)
        ctl.put(self.rank, _R_BEAT, time.monotonic_ns())
        try:
            msg, _ = tasks.receive(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            self.check_manager()
            return None
        if time.monotonic() - self._last_check > HEARTBEAT_INTERVAL_S:
            self.check_manager()
        mtype = message_type(msg)
        if mtype == MessageType.ARENA_REF:
            task = self._read_arena(decode_arena_ref(msg))
        elif mtype == MessageType.TASK:
            task = decode_task(msg, ids_as_arrays=self.ids_as_arrays)
        else:
            raise ValueError(f"rank {self.rank}: unexpected {mtype.name} message on the task queue")
        ctl.put(self.rank, _R_RECEIVED, ctl.get(self.rank, _R_RECEIVED) + 1)
        ctl.put(self.rank, _R_LAST_SEQ, task.seq)
        return task

    def _read_arena(self, ref: ArenaRef) -> Task:
        if ref.offset + ref.length > self._arena_size:
            raise ValueError(
                f"rank {self.rank}: arena ref of task seq={ref.seq} spans "
                f"[{ref.offset}, {ref.offset + ref.length}) beyond the "
                f"{self._arena_size}-byte arena"
            )
        ctl, arena, notify = self._require_open(), self._arena, self._notify
        assert arena is not None and notify is not None  # opened with the control segment
        raw = arena[ref.offset : ref.offset + ref.length]
        ctl.put(self.rank, _R_CONSUMED, ref.end)
        notify.release()
        task = decode_task(raw, ids_as_arrays=self.ids_as_arrays)
        if task.seq != ref.seq:
            raise ValueError(
                f"rank {self.rank}: arena holds task seq={task.seq} where the ref names "
                f"seq={ref.seq}"
            )
        return task

    def post_completion(self, completion: Completion, timeout: float = SEND_TIMEOUT_S) -> None:
        """Send this rank's answer to the manager (bounded: SendTimeout, or ManagerGone if
        the manager is not there to read it)."""
        if completion.rank != self.rank:
            raise ValueError(
                f"completion of task seq={completion.seq} names rank {completion.rank}, "
                f"but this worker is rank {self.rank}"
            )
        msg = encode_completion(completion)
        if len(msg) <= self.message_size:
            parts = [msg]
        else:
            parts = encode_fragments(
                msg, sender=self.rank, seq=completion.seq, max_size=self.message_size
            )
        with self._send_lock:
            self._require_open()
            completions = self._completions
            assert completions is not None  # opened with the control segment (_attach)
            deadline = time.monotonic() + timeout
            for part in parts:
                try:
                    completions.send(part, 0)
                    continue
                except posix_ipc.BusyError:
                    pass
                remaining = deadline - time.monotonic()
                try:
                    if remaining <= 0:
                        raise posix_ipc.BusyError("timed out")
                    completions.send(part, remaining)
                except posix_ipc.BusyError:
                    self.check_manager()
                    raise SendTimeout(
                        f"rank {self.rank}: completion of task seq={completion.seq} not "
                        f"accepted within {timeout:.1f}s: the completion queue stayed full "
                        f"(manager pid {self._manager_pid} is not reading it)",
                        rank=None,
                        delivered=[],
                    ) from None

    # ------------------------------------------------------------------ flags

    def publish_layers_done(self, seq: int, layers_done: int) -> None:
        """Record that the first `layers_done` layers of H2D task `seq` are loaded on this
        rank (call after each layer, counts only grow) and wake the manager's waiters."""
        if not 0 <= seq < 1 << 47:
            raise ValueError(f"seq {seq} out of range [0, 2**47)")
        if not 0 <= layers_done < MAX_LAYERS:
            raise ValueError(f"layers_done {layers_done} out of range [0, {MAX_LAYERS})")
        ctl = self._require_open()
        notify = self._notify
        assert notify is not None  # opened with the control segment (_attach)
        ctl.words[ctl.slot_word(self.rank, seq)] = (seq << _LAYER_BITS) | layers_done
        notify.release()

    def publish_load_failed(self, seq: int) -> None:
        """Record that H2D task `seq` failed on this rank: layer waiters that read the ring
        (`LayerProgress`) give up at once instead of waiting out their timeout."""
        if not 0 <= seq < 1 << 47:
            raise ValueError(f"seq {seq} out of range [0, 2**47)")
        ctl = self._require_open()
        notify = self._notify
        assert notify is not None  # opened with the control segment (_attach)
        ctl.words[ctl.slot_word(self.rank, seq)] = (seq << _LAYER_BITS) | LAYERS_FAILED
        notify.release()

    def set_ready(self, ready: bool = True) -> None:
        """Set this rank's ready flag (after its pools are allocated)."""
        self._require_open().put(self.rank, _R_READY, 1 if ready else 0)
        notify = self._notify
        assert notify is not None  # opened with the control segment (_attach)
        notify.release()

    def publish_storage_figures(self, stats: Mapping[str, float]) -> None:
        """Publish this rank's backend figures (a `StorageBackend.stats()` dict; names of
        `STORAGE_FIGURES` it lacks read as not reported)."""
        ctl = self._require_open()
        for i, name in enumerate(STORAGE_FIGURES):
            value = stats.get(name)
            ctl.put(self.rank, _R_STORAGE + i, -1 if value is None else max(0, int(value)))

    def publish_host_numa(self, node: int | None) -> None:
        """Publish the NUMA node this rank's host pool is bound to (None: not bound)."""
        self._require_open().put(self.rank, _R_NUMA, 0 if node is None else node + 1)

    def pools_request(self) -> tuple[int, int, int]:
        """(pools generation, device blocks, host blocks) the manager asks for (see Sleep)."""
        words = self._require_open().words
        generation = words[_W_POOLS]
        return generation, words[_W_WAKE_DEVICE], words[_W_WAKE_HOST]

    def publish_pools_generation(self, generation: int) -> None:
        """This rank has freed (odd) or re-created (even) its pools for `generation`."""
        self._require_open().put(self.rank, _R_POOLS, generation)
        notify = self._notify
        assert notify is not None
        notify.release()

    def set_inflight(self, tasks: int) -> None:
        """Publish how many tasks this rank holds (received and not completed)."""
        self._require_open().put(self.rank, _R_INFLIGHT, tasks)

    def beat(self) -> None:
        """Refresh this rank's heartbeat (recv_task does it; call it in long operations)."""
        self._require_open().put(self.rank, _R_BEAT, time.monotonic_ns())

    @property
    def paused(self) -> bool:
        """The manager's global pause flag."""
        return bool(self._require_open().words[_W_PAUSED])

    @property
    def tree_status(self) -> TreeStatus:
        """The manager's prefix-tree status flag."""
        return TreeStatus(self._require_open().words[_W_TREE])

    def manager_alive(self) -> bool:
        """False once the manager's pid is gone or its heartbeat is stale."""
        try:
            self.check_manager()
        except ManagerGone:
            return False
        return True

    def check_manager(self) -> None:
        """Raise ManagerGone when the manager died or its heartbeat is older than
        `manager_timeout`."""
        ctl = self._require_open()
        self._last_check = time.monotonic()
        if not pid_alive(self._manager_pid):
            raise ManagerGone(
                f"rank {self.rank}: manager pid {self._manager_pid} of deployment "
                f"{self.deployment_id!r} is gone",
                pid_gone=True,
            )
        age = (time.monotonic_ns() - ctl.words[_W_MANAGER_BEAT]) / 1e9
        if age > self.manager_timeout:
            raise ManagerGone(
                f"rank {self.rank}: manager pid {self._manager_pid} of deployment "
                f"{self.deployment_id!r} has not beaten for {age:.1f}s "
                f"(limit {self.manager_timeout:.1f}s)",
                pid_gone=False,
            )

    # ------------------------------------------------------------------ shutdown

    def _require_open(self) -> _Control:
        if self._closed or self._ctl is None:
            raise IPCError(f"rank {self.rank}: the worker IPC is closed")
        return self._ctl

    def _release_handles(self) -> None:
        for h in (self._tasks, self._completions, self._notify):
            if h is not None:
                with contextlib.suppress(posix_ipc.Error):
                    h.close()
        self._tasks = self._completions = self._notify = None
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None
        if self._arena is not None:
            self._arena.close()
            self._arena = None

    def _orphaned(self) -> bool:
        """The manager process is gone and the names still belong to its instance."""
        if pid_alive(self._manager_pid):
            return False
        try:
            mm = _open_segment(self.names.control, 0, create=False, read_only=True)
        except posix_ipc.ExistentialError:
            return False
        try:
            words = memoryview(mm).cast("q")
            try:
                return words[_W_INSTANCE] == self._instance
            finally:
                words.release()
        finally:
            mm.close()

    def close(self) -> None:
        """Clear the ready flag and release every handle (idempotent). If the manager's
        process is dead, also unlink the deployment's names so an orphaned deployment
        leaves nothing behind."""
        if self._closed:
            return
        with self._send_lock:
            if self._ctl is not None:
                self._ctl.put(self.rank, _R_READY, 0)
                self._ctl.put(self.rank, _R_INFLIGHT, 0)
            orphaned = self._ctl is not None and self._orphaned()
            self._closed = True
            self._release_handles()
        if orphaned:
            removed = cleanup_stale(self.deployment_id, self.num_ranks)
            if removed:
                log.info("rank %d: manager gone, removed %s", self.rank, removed)

    def __enter__(self) -> WorkerIPC:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- read-only


class LayerProgress:
    """A read-only view of a deployment's layer-progress rings, for a model runner that waits
    for a load per layer without a manager object (`kvtier.worker.engine_kv.LayerWaiter`).

    It maps the control segment read-only and never posts or takes the notify semaphore (its
    posts belong to the manager's watcher), so waits poll the ring with short sleeps (50 us
    growing to 1 ms), bounded by their timeout. A rank whose worker died or was replaced
    while the load was missing there fails the wait at once, as does a rank that published
    the load as failed, and a manager that is gone; a deployment asleep (its pools freed for
    a weight update) or woken since the wait began fails it with `DeploymentAsleep`."""

    def __init__(self, deployment_id: str, num_ranks: int) -> None:
        validate_deployment_id(deployment_id)
        self.deployment_id = deployment_id
        control = f"/kvtier_{deployment_id}_ctl"
        try:
            mm = _open_segment(control, 0, create=False, read_only=True)
        except posix_ipc.ExistentialError:
            raise IPCError(
                f"deployment {deployment_id!r}: no manager is running ({control} does not exist)"
            ) from None
        try:
            if len(mm) < 8 * _HEADER_WORDS:
                raise IPCError(f"{control}: {len(mm)} bytes, too small for a control segment")
            head = memoryview(mm).cast("q")
            try:
                magic, layout = head[_W_MAGIC], head[_W_LAYOUT]
                ranks, slots = head[_W_RANKS], head[_W_SLOTS]
                self._manager_pid = head[_W_MANAGER_PID]
            finally:
                head.release()
            if magic != _MAGIC or layout != _LAYOUT_VERSION:
                raise IPCError(f"{control}: not a kvtier control segment of layout "
                               f"{_LAYOUT_VERSION}")
            if ranks != num_ranks:
                raise IPCError(f"deployment {deployment_id!r} has {ranks} ranks, not {num_ranks}")
        except BaseException:
            mm.close()
            raise
        self.num_ranks = num_ranks
        self._ctl: _Control | None = _Control(mm, ranks, slots)

    def _require_open(self) -> _Control:
        if self._ctl is None:
            raise IPCError(f"deployment {self.deployment_id!r}: the layer progress is closed")
        return self._ctl

    def layers_done(self, seq: int) -> list[int | None]:
        """Per rank, how many layers of load `seq` are on the device (None: not started, or
        failed there)."""
        return _layers_done(self._require_open(), seq)

    @property
    def tree_status(self) -> TreeStatus:
        """The manager's prefix-tree status (clearing / cleared during a sleep or reset)."""
        return TreeStatus(self._require_open().words[_W_TREE])

    @property
    def asleep(self) -> bool:
        """Whether the deployment's pools are freed (a sleep for a weight update)."""
        return bool(self._require_open().words[_W_POOLS] % 2)

    def wait_layer(self, seq: int, layer: int, timeout: float) -> None:
        """Return once every rank has loaded layer `layer` (0-based) of H2D task `seq`."""
        if layer < 0 or layer >= MAX_LAYERS:
            raise ValueError(f"layer {layer} out of range [0, {MAX_LAYERS})")
        ctl = self._require_open()
        pids = [ctl.get(r, _R_PID) for r in range(self.num_ranks)]
        generation = ctl.words[_W_POOLS]
        self._check_awake(generation, generation, seq)
        deadline = time.monotonic() + timeout
        pause = 50e-6
        checked = 0.0
        while True:
            missing, failed = _missing_ranks(ctl, seq, layer)
            if not missing:
                return
            if failed:
                self._check_awake(generation, ctl.words[_W_POOLS], seq)
                raise TaskAborted(seq, f"the load failed on ranks {failed}")
            now = time.monotonic()
            if now - checked > 0.05:  # a few syscalls: not on every poll
                checked = now
                self._check_awake(generation, ctl.words[_W_POOLS], seq)
                self._check_alive(ctl, seq, missing, pids)
            if now > deadline:
                states = "; ".join(_rank_state(ctl, r, time.monotonic_ns()).describe()
                                   for r in missing)
                raise LayerWaitTimeout(
                    f"task seq={seq}: layer {layer} not loaded after {timeout:.1f}s on ranks "
                    f"{missing} ({states})", seq=seq, layer=layer, ranks=missing)
            time.sleep(min(pause, max(0.0, deadline - now)))
            pause = min(pause * 2, 1e-3)

    def _check_awake(self, began: int, now: int, seq: int) -> None:
        if now % 2:
            raise DeploymentAsleep(
                f"deployment {self.deployment_id!r} is asleep (its KV pools are freed for a "
                f"weight update): load seq={seq} was cancelled; match again after the wake")
        if now != began:
            raise DeploymentAsleep(
                f"deployment {self.deployment_id!r} slept while load seq={seq} was waited "
                "for: it was cancelled; match again")

    def _check_alive(self, ctl: _Control, seq: int, missing: list[int],
                     pids: list[int]) -> None:
        if not pid_alive(self._manager_pid):
            raise IPCError(f"deployment {self.deployment_id!r}: manager pid "
                           f"{self._manager_pid} is gone")
        for r in missing:
            pid = ctl.get(r, _R_PID)
            if pids[r] and (pid != pids[r] or not pid_alive(pid)):
                raise TaskAborted(seq, f"rank {r}'s worker pid {pids[r]} died during the load")

    def close(self) -> None:
        if self._ctl is not None:
            self._ctl.close()
            self._ctl = None

    def __enter__(self) -> LayerProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
