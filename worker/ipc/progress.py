"""Layer progress read-only (`LayerProgress`): the per-rank progress rings of the control
segment (`control`), for a model runner in a process with no manager object."""

from __future__ import annotations

import time

import posix_ipc
from kvtier.worker.ipc.control import (
    _HEADER_WORDS,
    _LAYOUT_VERSION,
    _MAGIC,
    _R_PID,
    _W_LAYOUT,
    _W_MAGIC,
    _W_MANAGER_PID,
    _W_POOLS,
    _W_RANKS,
    _W_SLOTS,
    _W_TREE,
    MAX_LAYERS,
    TreeStatus,
    _Control,
    _layers_done,
    _missing_ranks,
    _open_segment,
    _rank_state,
)
from kvtier.worker.ipc.errors import DeploymentAsleep, IPCError, LayerWaitTimeout, TaskAborted
from kvtier.worker.ipc.names import pid_alive, validate_deployment_id


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
