"""One deployment's running parts, built from its configuration: the workers, the dispatcher
that feeds them, the manager and its storage tier. This is the one place a configuration
becomes a manager plus workers: `assemble` builds the manager side over a dispatcher (the
cache core and its scheduler API, the storage tier handed to its constructor, and on request
the key-addressed surface), `Stack` adds the workers. `kvtier serve` and `kvtier replay` run
a Stack, the vLLM adapter does (`Stack(cfg, keyed_namespace=...)`, then `stack.keyed`), and
engine builders do too (`with Stack(cfg) as stack:`, then `stack.manager` is the scheduler
API).

Two kinds of workers, one wiring:

* `Stack(cfg)`: one worker process per rank (`kvtier.manager.launcher.WorkerSupervisor`),
  tasks over IPC, loads reported layer by layer, a crashed rank replaced. With
  `workers.engine_kv` each worker attaches to the KV its rank's model runner registered
  (`kvtier.worker.engine_kv`) instead of allocating a device pool; the runner registers
  before the stack starts.
* `Stack(cfg, embedded=True)`: every rank's pools and executor in this process
  (`kvtier.worker.embedded.EmbeddedWorkers`, reachable as `stack.workers`), each task run on
  every rank inside the scheduler call that emitted it. For an engine whose model runner owns
  the KV memory in one process, notebooks, tests and examples. Since every transfer is
  complete when the call returns, a storage tier must use `storage.prefetch_policy =
  "wait_complete"`: `best_effort` and `timeout` cannot be honoured and are refused
  (`ConfigError`) at start.

Either way the workers get the same `WorkerSpec`s (`worker_specs(cfg)`), and `assemble`
builds the same `KVCacheManager`, with a `StorageTier` handed to its constructor when a
storage backend is configured.

Sleep and wake (weight updates, FastDeploy's "clear the tree, free the KV, re-create it"):

    stack.sleep()      pause; the manager clears its tree without waiting and cancels active
                       requests (`KVCacheManager.sleep`); tree status CLEARING; every worker
                       cancels the tasks it holds and frees its device and host pools (pools
                       generation odd, see `kvtier.worker.ipc`); once every rank freed them
                       and every cancelled task is answered (blocks reclaimed, never
                       served): tree status CLEARED
    ... the engine updates its weights (with engine KV: frees its KV, re-registers) ...
    stack.wake(device_blocks=None, host_blocks=None)
                       sizes checked like the configuration; the manager's free lists and
                       every worker's pools re-created at them (pools generation even); the
                       configuration takes the sizes; tree status NORMAL; resumed

While asleep every scheduler call raises AsleepError, a task reaching a worker fails at once,
and a model runner's `LayerWaiter.wait` raises `DeploymentAsleep`. A failed wake (a rank
could not re-create its pools) leaves the deployment asleep: wake again, e.g. smaller.

Start order: IPC names (stale ones of this deployment removed) -> worker processes (each
builds its pools and reports ready) -> dispatcher -> `assemble`: manager with its storage
tier (-> keyed surface; then the index of what storage holds is listed, see
`kvtier.manager.storage_tier`, and refreshed on a thread until `close`). Stop order is
the reverse, and `close()` is safe to call from any state: it always ends with every process
stopped (or every embedded rank closed) and every shared-memory segment and queue of the
deployment unlinked.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.manager.config import (
    ConfigError,
    KvtierConfig,
    page_bytes,
    rank_device,
    summary,
    with_pool_sizes,
)
from kvtier.manager.core.cache import CacheCore
from kvtier.manager.errors import AsleepError, KvtierError, TransferTimeoutError
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.launcher import WarmWorkers, WorkerSupervisor
from kvtier.manager.private_state import storage_secret
from kvtier.manager.scheduler import TREE_CLEARED, KVCacheManager
from kvtier.manager.storage_tier import StorageTier
from kvtier.manager.transfers import Dispatcher, ImmediateDispatcher, TransferObserver
from kvtier.worker.ipc import TreeStatus
from kvtier.worker.spec import WorkerSpec, kept_segment_name
from kvtier.worker.storage.page_crypto import parse_key_ids
from kvtier.worker.wire import TaskKind

if TYPE_CHECKING:
    from kvtier.worker.embedded import EmbeddedWorkers

log = logging.getLogger("kvtier.stack")



@dataclass(frozen=True, slots=True)
class Assembly:
    """What `assemble` built: the scheduler API, the storage tier (None without a storage
    backend) and the key-addressed surface (None unless asked for)."""

    manager: KVCacheManager
    storage: StorageTier | None
    keyed: KeyedHostCache | None


def assemble(cfg: KvtierConfig, dispatcher: Dispatcher, *, transfer_timeout_s: float = 30.0,
             track_device_copies: bool = False, keyed_namespace: bytes | None = None,
             host_ready: Callable[[], bool] | None = None) -> Assembly:
    """The one place a configuration becomes a manager over a dispatcher: the cache core
    with its scheduler API (`KVCacheManager`), the storage tier handed to the manager's
    constructor when `storage.backend` is not "none", and, with `keyed_namespace`, the
    key-addressed surface of an engine that owns its device tier (`KeyedHostCache`,
    `host_ready`: whether its host pools can be used now). Nothing is wired afterwards.
    `Stack.start` calls it (and so `kvtier serve`, `kvtier replay` and the vLLM adapter)."""
    c = cfg
    built: list[StorageTier] = []

    def storage_tier(core: CacheCore) -> StorageTier:
        built.append(StorageTier(core, c))
        return built[-1]

    manager = KVCacheManager(
        block_size=c.cache.block_size, device_blocks=c.cache.device_blocks,
        host_blocks=c.cache.host_blocks, write_policy=c.cache.write_policy,
        hit_threshold=c.cache.hit_threshold, eviction_policy=c.cache.eviction_policy,
        host_eviction_policy=c.cache.host_eviction_policy,
        decode_reserve_blocks=c.cache.decode_reserve_blocks, dispatcher=dispatcher,
        page_bytes=page_bytes(c), num_layers=c.model.num_layers + c.model.num_extra_layers,
        transfer_timeout_s=transfer_timeout_s,
        storage=storage_tier if c.storage.backend != "none" else None,
        track_device_copies=track_device_copies)
    storage = built[0] if built else None
    keyed = None
    if keyed_namespace is not None:
        keyed = KeyedHostCache(manager, storage, namespace=keyed_namespace,
                               host_ready=host_ready or (lambda: True))
    return Assembly(manager, storage, keyed)


def worker_spec(cfg: KvtierConfig, rank: int, storage_tag: str = "") -> WorkerSpec:
    """What rank `rank` of the deployment `cfg` describes needs to build its pools, storage
    backend and executor (in a worker process or embedded). `storage_tag` keeps the pages
    apart from untagged ones (see `WorkerSpec.storage_tag`)."""
    c = cfg
    s = c.storage
    # Resolved here, in the manager, and handed over inside the spec (an environment variable
    # of the worker, never its command line): the worker never reads the secret file.
    secret = (b"" if s.backend == "none"
              else storage_secret(s.secret.get_secret_value(), s.secret_file))
    return WorkerSpec(
        deployment_id=c.deployment_id, rank=rank, num_ranks=c.workers.count,
        num_layers=c.model.num_layers, num_kv_heads=c.model.num_kv_heads,
        head_dim=c.model.head_dim, dtype=c.model.dtype, block_size=c.cache.block_size,
        device_blocks=c.cache.device_blocks, host_blocks=c.cache.host_blocks,
        device=rank_device(c, rank), storage_backend=s.backend, storage_path=c.storage_dir(),
        storage_url=s.url, storage_capacity_bytes=s.capacity_bytes,
        storage_ttl_s=int(s.ttl_s), backup_one_rank=s.backup_one_rank,
        manager_timeout_s=max(3.0, c.workers.heartbeat_timeout_s), model_name=c.model.name,
        storage_tag=storage_tag, storage_secret=secret.hex(),
        num_extra_layers=c.model.num_extra_layers, kv_scales=c.model.kv_scales,
        storage_encrypt=s.encrypt, storage_key_id=s.key_id,
        storage_old_key_ids=parse_key_ids(s.old_key_ids),
        storage_compression=s.compression,
        host_numa=str(c.workers.host_numa),
        # the wait for the model runner's registration ends inside the supervisor's
        # ready timeout, so the worker's own error (what is missing) is the one reported
        engine_kv=c.workers.engine_kv, engine_kv_timeout_s=0.8 * c.workers.ready_timeout_s)


def worker_specs(cfg: KvtierConfig, storage_tag: str = "") -> list[WorkerSpec]:
    """One `WorkerSpec` per rank (`workers.count`)."""
    return [worker_spec(cfg, r, storage_tag) for r in range(cfg.workers.count)]


def _check_embedded(cfg: KvtierConfig) -> None:
    """Refuse what embedded workers cannot honour: they run every task synchronously inside
    the scheduler call that emitted it, so a storage prefetch is always complete when `match`
    returns and `best_effort` / `timeout` would silently mean `wait_complete`."""
    s = cfg.storage
    if s.backend != "none" and s.prefetch_policy != "wait_complete":
        raise ConfigError(
            f"storage.prefetch_policy = {s.prefetch_policy!r}: embedded workers "
            f"(Stack(cfg, embedded=True)) run every transfer inside the scheduler call, so a "
            f"prefetch cannot be left running or cut short; set storage.prefetch_policy = "
            f"'wait_complete' (or run worker processes: Stack(cfg))")


class Stack:
    """Manager + workers (+ storage tier) of one deployment; `embedded=True` runs the workers
    in this process (`workers`) instead of one process per rank (`supervisor`).

    Invariant: `manager` exists only while the workers it dispatches to are running.
    """

    def __init__(self, cfg: KvtierConfig, *, embedded: bool = False,
                 log_dir: str | None = None, transfer_timeout_s: float = 30.0,
                 keep_worker_logs: bool = False, storage_tag: str = "",
                 keyed_namespace: bytes | None = None) -> None:
        self.cfg = cfg
        self.embedded = embedded
        self.log_dir = log_dir  # None: a temporary folder (see WorkerSupervisor)
        self.keep_worker_logs = keep_worker_logs
        self.storage_tag = storage_tag  # pages apart from untagged ones ("verify": replay)
        self.transfer_timeout_s = transfer_timeout_s
        self.supervisor: WorkerSupervisor | None = None
        self.workers: EmbeddedWorkers | None = None
        self.manager: KVCacheManager | None = None
        self.storage: StorageTier | None = None
        # An engine that owns its device tier (vLLM) addresses the host and storage tiers by
        # its own block hashes: `keyed` is that surface, built when `keyed_namespace` is given
        # (the storage keys' namespace, see KeyedHostCache).
        self.keyed_namespace = keyed_namespace
        self.keyed: KeyedHostCache | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._sleep_lock = threading.Lock()  # one sleep, wake or reset at a time
        self._transfer_observers: list[TransferObserver] = []
        # Workers adopt the host pools kept under `kept_segment_name` instead of creating
        # them (the node service sets it for the start that takes a hand-over, then clears
        # it: a worker restarted later creates a fresh pool).
        self.adopt_host = False
        # Warm worker processes its first start takes before starting new ones (a node
        # service's take-over, issue 37); a worker replaced later is a new process.
        self.warm: WarmWorkers | None = None

    # ------------------------------------------------------------------ life cycle

    def worker_spec(self, rank: int) -> WorkerSpec:
        spec = worker_spec(self.cfg, rank, self.storage_tag)
        if self.adopt_host:  # a node service's hand-over (issue 37): the first start only
            spec = dataclasses.replace(
                spec, host_adopt=kept_segment_name(self.cfg.deployment_id, rank))
        return spec

    def start(self) -> Stack:
        c = self.cfg
        try:
            dispatcher: Dispatcher
            if self.embedded and c.workers.engine_kv:
                raise KvtierError(
                    "workers.engine_kv = true needs worker processes: an embedded stack's "
                    "ranks live in the engine's process, whose model runner uses "
                    "stack.require_workers().device_pool(rank) directly")
            if self.embedded:
                _check_embedded(c)
                # Imported here: the pools load torch, which a manager of worker processes
                # never needs (seconds of start-up).
                from kvtier.worker.embedded import EmbeddedWorkers

                self.workers = EmbeddedWorkers(worker_specs(c, self.storage_tag))
                dispatcher = ImmediateDispatcher(executor=self.workers.execute,
                                                 num_ranks=self.workers.num_ranks)
            else:
                self.supervisor = WorkerSupervisor(
                    self.worker_spec, c.workers.count, c.deployment_id,
                    ready_timeout_s=c.workers.ready_timeout_s,
                    heartbeat_timeout_s=c.workers.heartbeat_timeout_s, log_dir=self.log_dir,
                    on_worker_lost=self._on_worker_lost, keep_logs=self.keep_worker_logs,
                    on_worker_replaced=self._on_worker_replaced,
                    on_device_lost=self._on_device_lost,
                    device_copy_mark=self._device_copy_mark,
                    on_device_confirmed=self._on_device_confirmed)
                dispatcher = self.supervisor.make_dispatcher(on_transfer=self._observe_transfer)
                self.supervisor.warm = self.warm
                try:
                    self.supervisor.start()
                finally:
                    self.supervisor.warm = None
            # engine KV: host copies read from the model runner's memory are trusted once a
            # registration check confirms that memory (see WorkerSupervisor._check_engine_kv)
            parts = assemble(c, dispatcher, transfer_timeout_s=self.transfer_timeout_s,
                             track_device_copies=c.workers.engine_kv and not self.embedded,
                             keyed_namespace=self.keyed_namespace,
                             host_ready=self.workers_ready)
            self.manager, self.storage, self.keyed = parts.manager, parts.storage, parts.keyed
            if self.storage is not None and self.keyed is not None and not self.embedded:
                # The key-addressed surface answers a miss at once for a block storage's
                # listing lacks: the first listing comes before the first lookup when it can
                # (a new process finds what another one wrote on its first request). Embedded
                # workers answer each query inside the lookup that asks it: nothing to list.
                self.storage.start_index()
        except BaseException:
            self.close()
            raise
        return self

    @property
    def page_bytes(self) -> int:
        """Bytes of one block on one rank (all layers, K and V)."""
        return page_bytes(self.cfg)

    def _on_worker_lost(self, rank: int, reason: str) -> None:
        if self.manager is not None:
            cleared = self.manager.lose_all()
            log.error("rank %d lost (%s): every cached block is gone with its pools (%s)",
                      rank, reason, cleared)

    def _on_worker_replaced(self, rank: int) -> None:
        """A lost rank's replacement is ready: the storage retention its predecessor held
        (in that process only) is sent again from the tenant book."""
        if self.keyed is not None:
            pages = self.keyed.resend_storage_retention()
            if pages:
                log.info("rank %d replaced: the retention of %d storage pages sent again",
                         rank, pages)

    def _on_device_lost(self, rank: int, reason: str) -> None:
        """A model runner's KV registration changed: its device memory is gone, kvtier's own
        host pools (the workers') and storage are not."""
        if self.manager is not None:
            kept = self.manager.lose_device()
            log.error("rank %d: %s: device copies dropped, host copies kept (%s)", rank, reason,
                      kept)

    def _device_copy_mark(self) -> int:
        return 0 if self.manager is None else self.manager.device_copy_mark()

    def _on_device_confirmed(self, mark: int) -> None:
        if self.manager is not None:
            self.manager.confirm_device_copies(mark)

    def close(self) -> None:
        """Stop everything (idempotent): drain transfers briefly, stop workers, unlink."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self.storage is not None:
            self.storage.stop_index()
        if self.manager is not None:
            self.manager.dispatcher.drain(5.0)
            if self.supervisor is not None and self.manager.track_device_copies:
                # engine KV: host copies wait for a registration check before their storage
                # backups start; check now, then let those backups finish
                self.supervisor.check_engine_kv_now()
                self.manager.dispatcher.drain(5.0)
        if self.supervisor is not None:
            self.supervisor.stop()
        if self.workers is not None:
            self.workers.close()
        self.manager = None
        self.keyed = None

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ operations

    def require_manager(self) -> KVCacheManager:
        if self.manager is None:
            raise KvtierError("the stack is not running")
        return self.manager

    def require_keyed(self) -> KeyedHostCache:
        """The key-addressed surface (`Stack(cfg, keyed_namespace=...)`)."""
        if self.keyed is None:
            raise KvtierError("the stack is not running, or was built without "
                              "keyed_namespace (no key-addressed surface)")
        return self.keyed

    def _observe_transfer(self, kind: TaskKind, blocks: int, seconds: float) -> None:
        for observe in self._transfer_observers:
            try:
                observe(kind, blocks, seconds)
            except Exception:  # an observer must never break the dispatcher
                log.exception("transfer observer %r failed", observe)

    def add_transfer_observer(self, observer: TransferObserver) -> None:
        """Call `observer(kind, blocks, seconds)` for every task that finishes from now on
        (on the dispatcher's thread, under its lock: keep it to a counter update). Worker
        processes only: an embedded stack does not time its tasks."""
        self._transfer_observers.append(observer)

    def alive(self) -> tuple[bool, str]:
        """Whether the manager's own threads still run: the supervisor's watcher, the
        completion applier and the IPC reader and notify watcher. Without any of them the
        manager stops hearing from its workers, whatever the workers' state. Also False once
        a rank's replacement failed to start `max_start_failures` times in a row: the
        deployment cannot recover by itself (a process supervisor should restart it)."""
        if self._closed:
            return False, "stopped"
        if self.embedded:  # no manager threads: every task runs in the caller's thread
            if self.manager is None:
                return False, "starting"
            return True, "embedded workers (no manager threads)"
        sup = self.supervisor
        threads = None if sup is None or self.manager is None else sup.manager_threads()
        if sup is None or threads is None:
            return False, "starting"
        dead = [t.name for t in threads if not t.is_alive()]
        if dead:
            return False, "manager thread(s) stopped: " + ", ".join(map(str, dead))
        stuck, why = sup.unrecoverable()
        if stuck:
            return False, why
        return True, "manager threads running"

    def workers_ready(self) -> bool:
        """Every rank's worker is up (cheap: for per-block callers such as
        `KeyedHostCache`'s `host_ready`)."""
        if self.manager is None:
            return False
        sup = self.supervisor
        return sup is None or all(w.state == "ready" for w in sup.workers)

    def ready(self) -> tuple[bool, str]:
        if self.manager is None:
            return False, "starting"
        if self.supervisor is None:
            return True, "embedded workers ready"
        return self.supervisor.ready()

    def require_workers(self) -> EmbeddedWorkers:
        """The in-process ranks of an embedded stack (`device_pool(rank)` is the KV memory
        the model's attention reads and writes)."""
        if not self.embedded:
            raise KvtierError("the stack runs worker processes, not embedded workers")
        if self.workers is None or self.manager is None:
            raise KvtierError("the stack is not running")
        return self.workers

    def pause(self) -> None:
        m = self.require_manager()
        m.paused = True
        if self.supervisor is not None:
            self.supervisor.ipc.paused = True

    def resume(self) -> None:
        m = self.require_manager()
        if m.asleep:
            raise AsleepError("resume: the deployment is asleep; wake it (which resumes)")
        m.paused = False
        if self.supervisor is not None:
            self.supervisor.ipc.paused = False

    def reset(self, *, storage: bool = False, timeout: float = 10.0,
              storage_timeout: float | None = None) -> dict[str, Any]:
        """Empty the tree and the device and host caches after in-flight transfers finish;
        with `storage`, also this deployment's storage namespace (given `storage_timeout`
        seconds, default `timeout`). Raises ResetBusyError (nothing cleared) when transfers do
        not finish in time. A storage clear that outlasts its wait goes on in the background:
        `storage_clear` is then "running" (else "done") and `storage_pages` absent.
        AsleepError (nothing cleared) while asleep or while a sleep or wake runs."""
        m = self.require_manager()
        # Issue 27: one reset, sleep or wake at a time. A sleep that came in while a reset
        # ran cancelled the reset's waits (a 500); now the sleep waits for the reset (at most
        # its timeouts), and a reset while a sleep or wake runs is refused (a 409).
        if not self._sleep_lock.acquire(blocking=False):
            raise AsleepError("reset: a sleep or wake of the deployment is under way; "
                              "nothing was cleared")
        try:
            if m.asleep:  # the sleep cleared everything; its tree status must stand
                raise AsleepError("reset: the deployment is asleep (its pools are freed); "
                                  "wake it")
            self._publish_tree_status(TreeStatus.CLEARING)
            try:
                cleared: dict[str, Any] = dict(m.reset(timeout))
                if storage:
                    wait = timeout if storage_timeout is None else storage_timeout
                    pages = self.storage.clear(wait) if self.storage is not None else 0
                    if self.keyed is not None:
                        self.keyed.storage_emptied()
                    if pages is None:
                        cleared["storage_clear"] = "running"
                    else:
                        cleared["storage_pages"] = pages
                        cleared["storage_clear"] = "done"
                self._publish_tree_status(TreeStatus.CLEARED)
                return cleared
            finally:
                self._publish_tree_status(TreeStatus.NORMAL)
        finally:
            self._sleep_lock.release()

    def sleep(self, timeout: float = 30.0) -> dict[str, Any]:
        """Free every pool for a weight update (see the module docstring): returns what was
        cleared and cancelled. AsleepError when already asleep; TransferTimeoutError when a
        rank did not free its pools or cancelled tasks were not answered within `timeout`
        (the deployment stays asleep: wake it, or sleep again)."""
        m = self.require_manager()
        sup = self.supervisor
        if sup is None:
            raise KvtierError("sleep needs worker processes: embedded ranks live in the "
                              "engine's process, which frees and re-creates them itself")
        with self._sleep_lock:
            cleared: dict[str, Any] = dict(m.sleep())
            sup.pools_asleep = True
            sup.ipc.paused = True
            self._publish_tree_status(TreeStatus.CLEARING)
            generation = sup.ipc.pools_generation + 1  # even while awake; odd: freed
            sup.ipc.set_pools_generation(generation)
            deadline = time.monotonic() + timeout
            sup.wait_pools(generation, timeout)
            if not m.dispatcher.drain(max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError(
                    f"sleep: {m.dispatcher.pending()} cancelled task(s) not answered within "
                    f"{timeout:.3g} s (the pools are freed; wake when they are)")
            m.tree_status = TREE_CLEARED
            self._publish_tree_status(TreeStatus.CLEARED)
            log.info("asleep: pools freed on every rank (%s)", cleared)
            return cleared

    def wake(self, device_blocks: int | None = None, host_blocks: int | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        """Re-create the pools (at new sizes when given) and serve again. ConfigError (still
        asleep, nothing changed) when the sizes are invalid or do not fit this machine;
        AsleepError when not asleep; WorkerStartError / TransferTimeoutError when a rank could
        not re-create its pools (still asleep). Returns the sizes now in force."""
        m = self.require_manager()
        sup = self.supervisor
        if sup is None:
            raise KvtierError("wake needs worker processes (see sleep)")
        with self._sleep_lock:
            if not m.asleep:
                raise AsleepError("wake: the deployment is not asleep")
            c = self.cfg.cache
            cfg = with_pool_sizes(self.cfg, c.device_blocks if device_blocks is None
                                  else device_blocks,
                                  c.host_blocks if host_blocks is None else host_blocks)
            wait = self.cfg.workers.ready_timeout_s if timeout is None else timeout
            if not m.dispatcher.drain(wait) or not m.settled():
                raise TransferTimeoutError("wake: tasks (or an engine's own host copies) of "
                                           "before the sleep are still in flight; try again")
            ipc = sup.ipc
            if ipc.pools_generation % 2 == 0:  # a failed wake: free what it made first
                ipc.set_pools_generation(ipc.pools_generation + 1)
                sup.wait_pools(ipc.pools_generation, wait)
            generation = ipc.pools_generation + 1
            dev, host = cfg.cache.device_blocks, cfg.cache.host_blocks
            m.rebuild(dev, host)
            ipc.set_pools_generation(generation, dev, host)
            sup.wait_pools(generation, wait)
            self.cfg = cfg  # replacements of workers start at these sizes
            if self.storage is not None:
                self.storage.resize(cfg)
            sup.pools_asleep = False
            m.wake()
            ipc.paused = False
            self._publish_tree_status(TreeStatus.NORMAL)
            log.info("awake: %d device / %d host blocks per rank", dev, host)
            return {"device_blocks": dev, "host_blocks": host}

    def _publish_tree_status(self, status: TreeStatus) -> None:
        """Tell the worker processes (a shared-memory flag); embedded ranks need no telling."""
        if self.supervisor is not None:
            self.supervisor.ipc.tree_status = status

    def status(self) -> dict[str, Any]:
        m = self.require_manager()
        st = m.stats()
        pb = self.page_bytes
        tiers: dict[str, Any] = {}
        for tier, counts in (("device", st["device"]), ("host", st["host"])):
            t = dict(counts)
            t["bytes_per_block"] = pb * self.cfg.workers.count
            for k in ("capacity", "free", "cached", "in_use"):
                t[f"{k}_bytes"] = t[k] * pb * self.cfg.workers.count
            tiers[tier] = t
        c = st["counters"]
        lookup = c["lookup_tokens"] or 0
        hits = {"device": c["hit_device_tokens"], "host": c["hit_host_tokens"],
                "storage": c["hit_storage_tokens"]}
        storage = self.storage.status() if self.storage is not None else None
        if storage is not None and self.supervisor is not None:
            storage["ranks"] = self.supervisor.storage_figures()
        return {
            "deployment_id": self.cfg.deployment_id,
            "tiers": tiers,
            "storage": storage,
            "workers": self.supervisor.status() if self.supervisor else [],
            "worker_logs": str(self.supervisor.log_dir) if self.supervisor else None,
            "hit_rate": {k: (v / lookup if lookup else 0.0) for k, v in hits.items()}
            | {"total": (sum(hits.values()) / lookup if lookup else 0.0)},
            "paused": m.paused,
            "asleep": m.asleep,
            "tree_status": st["tree_status"],
            "requests_active": st["requests_active"],
            "tasks_inflight": st["tasks_inflight"],
            "config": summary(self.cfg),
        }
