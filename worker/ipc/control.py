"""The control segment: its word layout, typed access to it, and the protocols that run over
its words (layer progress, storage figures, sleep, liveness). Every module of the transport
that reads or writes a flag goes through `_Control` and the word indices defined here.

Control segment layout (all fields int64, native little-endian, 8-byte aligned; one aligned
64-bit store is atomic on the 64-bit platforms we run on, so readers never see torn values):

    byte off  field
    0         magic  (b"KVTIERC1")
    8         layout version (`_LAYOUT_VERSION`, 4)
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
    128 + r * (152 + 8K)  rank r block:
        +0  ready (0/1)         +8  heartbeat ns       +16 pid          +24 tasks in flight
        +32 arena position consumed                    +40 tasks received
        +48 last seq received   +56 host pool NUMA node + 1 (0: not bound)
        +64 storage backend figures: one word per name of STORAGE_FIGURES, -1 where the
            rank's backend does not report that figure (or has not published yet)
        +144 pools generation this rank has reached (see "Sleep" below)
        +152 progress ring: K words, slot seq % K holds (seq << 16) | layers_done

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

import mmap
import os
import time
from dataclasses import dataclass
from enum import IntEnum

import posix_ipc
from kvtier.worker.ipc.errors import IPCError
from kvtier.worker.ipc.names import MAX_RANKS, _unlink, ipc_names, pid_alive

HEARTBEAT_INTERVAL_S = 0.5
MANAGER_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 5.0
MAX_LAYERS = 0xFFFF

_MAGIC = int.from_bytes(b"KVTIERC1", "little")
_LAYOUT_VERSION = 4  # 4: two more storage figures (encrypted pages' refusals)

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
    "unknown_key_pages",  # pages under a key id the configuration does not list; counter
    "old_format_pages",  # pages of another page format version; counter
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
