"""A worker's end of the transport (`WorkerIPC`, one per rank): it attaches to the names the
manager created (`names`), receives its tasks (from its queue, or copied out of the manager's
id arena), posts completions (split into FRAGMENT messages when long: a worker cannot write the
arena) and keeps its own rank block of the control segment (`control`)."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Mapping

import posix_ipc
from kvtier.worker.ipc.control import (
    _HEADER_WORDS,
    _LAYER_BITS,
    _LAYOUT_VERSION,
    _MAGIC,
    _R_BEAT,
    _R_CONSUMED,
    _R_INFLIGHT,
    _R_LAST_SEQ,
    _R_NUMA,
    _R_PID,
    _R_POOLS,
    _R_READY,
    _R_RECEIVED,
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
    LAYERS_FAILED,
    MANAGER_TIMEOUT_S,
    MAX_LAYERS,
    SEND_TIMEOUT_S,
    STORAGE_FIGURES,
    TreeStatus,
    _Control,
    _open_segment,
)
from kvtier.worker.ipc.errors import IPCError, ManagerGone, SendTimeout
from kvtier.worker.ipc.names import cleanup_stale, ipc_names, pid_alive, validate_deployment_id
from kvtier.worker.wire import (
    ArenaRef,
    Completion,
    MessageType,
    Task,
    decode_arena_ref,
    decode_task,
    encode_completion,
    encode_fragments,
    message_type,
)

log = logging.getLogger(__name__)


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
