"""The manager's end of the transport (`ManagerIPC`): it creates every name of the deployment
(`names`), writes the control segment's header (`control`), owns the id arena and sends tasks.

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
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import queue
import resource
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import posix_ipc
from kvtier.worker.ipc.control import (
    _HEADER_WORDS,
    _LAYOUT_VERSION,
    _MAGIC,
    _R_CONSUMED,
    _R_PID,
    _R_READY,
    _R_STORAGE,
    _W_ARENA_BYTES,
    _W_INSTANCE,
    _W_LAYOUT,
    _W_MAGIC,
    _W_MANAGER_BEAT,
    _W_MANAGER_PID,
    _W_MSG_SIZE,
    _W_PAUSED,
    _W_POOLS,
    _W_RANKS,
    _W_SLOTS,
    _W_TREE,
    _W_WAKE_DEVICE,
    _W_WAKE_HOST,
    HEARTBEAT_INTERVAL_S,
    MANAGER_TIMEOUT_S,
    MAX_LAYERS,
    SEND_TIMEOUT_S,
    STORAGE_FIGURES,
    RankState,
    TreeStatus,
    _Control,
    _layers_done,
    _missing_ranks,
    _open_segment,
    _rank_state,
)
from kvtier.worker.ipc.errors import (
    DeploymentInUse,
    IPCError,
    LayerWaitTimeout,
    SendTimeout,
    TaskAborted,
)
from kvtier.worker.ipc.names import _unlink, cleanup_stale, ipc_names, pid_alive
from kvtier.worker.wire import (
    ArenaRef,
    Completion,
    MessageType,
    Reassembler,
    Task,
    decode_completion,
    decode_fragment,
    encode_arena_ref,
    encode_task,
    message_type,
)

log = logging.getLogger(__name__)

QUEUE_DEPTH = 10
MESSAGE_SIZE = 4096
DEFAULT_ARENA_BYTES = 8 << 20
PROGRESS_SLOTS = 256
_SEND_SLICE_S = 0.05  # a send to a full queue re-checks its rank's worker this often


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


@dataclass(slots=True)
class _Allocation:
    start: int
    end: int
    seq: int
    ranks: set[int]


_LIVE_DEPLOYMENTS: set[str] = set()
_LIVE_LOCK = threading.Lock()


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
