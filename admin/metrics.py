"""Prometheus metrics of one running Stack, built at scrape time from its snapshots.

Why a custom collector rather than counters incremented on the hot path: the scheduler
already keeps plain integer counters and O(1) occupancy figures (`KVCacheManager.stats()`,
`StorageTier.counters`, the supervisor's worker table), readable without its lock. Turning
them into metric families when Prometheus asks costs the scheduler nothing per request, and a
scrape costs the same with ten cached blocks or ten million (nothing here walks the tree).

The one figure no snapshot holds is the duration of each transfer, so `kvtier_transfer_seconds`
is a real histogram, fed by the stack's transfer observer once per finished task.

Names follow Prometheus conventions (checked by `promtool check metrics` in the tests): every
name starts with `kvtier_`, carries its unit (`_seconds`, `_bytes`, `_blocks`, `_tokens`,
`_pages`), and counters end in `_total`. Every label value a family can take is always
exported (zero when nothing happened), so dashboards and alerts see a series from the first
scrape on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from kvtier.manager.config import resolve_device
from kvtier.manager.launcher import WORKER_STATES
from kvtier.manager.node.steering import TOP_TENANTS
from kvtier.worker.wire import TaskKind
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvtier.manager.node.server import NodeServer
    from kvtier.manager.node.steering import NamespaceSource
    from kvtier.manager.scheduler import SchedulerStats
    from kvtier.manager.stack import Stack

log = logging.getLogger("kvtier.admin.metrics")

TIERS: Final = ("device", "host")  # Final: literal keys of SchedulerStats
BLOCK_STATES = ("free", "cached", "in_use", "evictable")
HIT_TIERS = ("device", "host", "storage")
DIRECTIONS = ("d2h", "h2d", "storage_read", "storage_write")
DIRECTION_OF_KIND: dict[TaskKind, str] = {
    TaskKind.D2H: "d2h",
    TaskKind.H2D: "h2d",
    TaskKind.PREFETCH: "storage_read",
    TaskKind.BACKUP: "storage_write",
}
"""Task kinds that move KV bytes; queries, clears and diagnostic fills/checks are not
transfers and stay out of the transfer histogram."""

TRANSFER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                      0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""From a 100 us copy of a few CPU blocks to a 30 s storage batch (the transfer timeout)."""

STORAGE_ERROR_OPS = ("query", "prefetch", "backup", "clear", "list")

BACKEND_FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    # (figure of worker.ipc.STORAGE_FIGURES, kvtier_storage_backend_<name>, type, help)
    ("corrupt_pages", "corrupt_pages", "counter",
     "Damaged pages (bad header, checksum or size) the rank's backend refused and deleted."),
    ("evicted_pages", "evicted_pages", "counter",
     "Pages the rank's backend deleted to stay under storage.capacity_bytes."),
    ("misses", "missed_pages", "counter",
     "Pages a prefetch read asked the rank's backend for and did not get."),
    ("outages", "outages", "counter", "Times the rank's store became unreachable."),
    ("available", "available", "gauge", "1 while the rank's store answers, 0 during an outage."),
    ("used_bytes", "used_bytes", "gauge", "Bytes of pages the rank's backend holds."),
    ("stored_pages", "stored_pages", "gauge", "Pages the rank's backend holds."),
    ("capacity_bytes", "capacity_bytes", "gauge",
     "The rank's byte limit for stored pages (0: none)."),
    ("unknown_key_pages", "unknown_key_pages", "counter",
     "Pages refused because their key id is not storage.key_id or in storage.old_key_ids "
     "(retired or foreign keys); also counted as corrupt pages."),
    ("old_format_pages", "old_format_pages", "counter",
     "Pages refused because they are of another page format version (clear pages in an "
     "encrypting deployment, or the reverse); also counted as corrupt pages."),
)


class StackCollector(Collector):
    """Metric families of one Stack, read from its lock-free snapshots at every scrape.

    Holds only a reference to the stack: the manager, supervisor and storage tier are looked
    up on each scrape, so the collector follows the stack through start and close (families
    whose source is not running are left out of that scrape).
    """

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def collect(self) -> Iterator[Metric]:
        stack = self.stack
        yield self._info()
        manager = stack.manager
        if manager is not None:
            yield from self._manager_families(manager.stats())
        yield from self._storage_families()
        yield from self._keyed_families()
        yield from self._backend_families()
        yield from self._worker_families()

    # ------------------------------------------------------------------ families

    def _info(self) -> Metric:
        cfg = self.stack.cfg
        device: str
        try:
            device = resolve_device(cfg)
        except Exception:  # CUDA asked for but gone: the info line still names the request
            device = cfg.workers.device
        info = GaugeMetricFamily(
            "kvtier_info", "Constant 1, labelled with this deployment's identity and settings.",
            labels=["deployment_id", "device", "storage_backend", "write_policy", "ranks"])
        info.add_metric([cfg.deployment_id, device, cfg.storage.backend,
                         cfg.cache.write_policy, str(cfg.workers.count)], 1)
        return info

    def _manager_families(self, st: SchedulerStats) -> Iterator[Metric]:
        cfg = self.stack.cfg
        ranks = cfg.workers.count
        block_bytes = self.stack.page_bytes * ranks
        c = st["counters"]

        capacity = GaugeMetricFamily(
            "kvtier_capacity_blocks", "Blocks in the pool of each tier.", labels=["tier"])
        blocks = GaugeMetricFamily(
            "kvtier_blocks",
            "Blocks of each tier by state: free (in the free list), cached (held by the prefix "
            "tree), evictable (cached and evictable now), in_use (capacity - free - evictable: "
            "referenced by requests, pinned or in transfer).",
            labels=["tier", "state"])
        for tier in TIERS:
            t = st[tier]
            capacity.add_metric([tier], t["capacity"])
            for state in BLOCK_STATES:
                blocks.add_metric([tier, state], t[state])
        yield capacity
        yield blocks
        yield GaugeMetricFamily(
            "kvtier_block_bytes", "Bytes of one block over all ranks (all layers, K and V).",
            value=block_bytes)
        yield GaugeMetricFamily(
            "kvtier_tree_nodes", "Nodes of the prefix tree (cached blocks of any tier).",
            value=st["nodes"])
        yield GaugeMetricFamily(
            "kvtier_requests_active", "Requests matched and not yet released.",
            value=st["requests_active"])
        yield GaugeMetricFamily(
            "kvtier_pinned_blocks", "Prefix-tree nodes pinned through the admin API.",
            value=st["pinned_blocks"])
        yield GaugeMetricFamily(
            "kvtier_transfer_tasks_inflight",
            "Tasks sent to the workers whose outcome the manager has not applied yet.",
            value=st["tasks_inflight"])
        yield GaugeMetricFamily(
            "kvtier_paused", "1 while transfers are paused (POST /pause), else 0.",
            value=1 if st["paused"] else 0)

        yield CounterMetricFamily(
            "kvtier_requests", "Requests matched (scheduler match calls).", value=c["requests"])
        yield CounterMetricFamily(
            "kvtier_lookup_tokens",
            "Prompt tokens looked up by match (the denominator of every hit rate).",
            value=c["lookup_tokens"])
        hits = CounterMetricFamily(
            "kvtier_hit_tokens", "Prompt tokens found cached, by the tier that held them.",
            labels=["tier"])
        for tier in HIT_TIERS:
            hits.add_metric([tier], c[f"hit_{tier}_tokens"])
        yield hits
        evicted = CounterMetricFamily(
            "kvtier_evicted_blocks",
            "Blocks evicted, by tier and action (demote: copied down to host; drop: gone).",
            labels=["tier", "action"])
        evicted.add_metric(["device", "drop"], c["evicted_device_drop"])
        evicted.add_metric(["device", "demote"], c["evicted_device_demote"])
        evicted.add_metric(["host", "drop"], c["evicted_host_drop"])
        yield evicted
        yield CounterMetricFamily(
            "kvtier_host_evicted_unstored_blocks",
            "Host copies evicted before storage held them (a backup skipped, failed or not "
            "due yet under storage.write_policy): a later request recomputes them.",
            value=c["evicted_host_unstored"])

        storage = self.stack.storage
        sc = storage.counters if storage is not None else None
        writers = 1 if cfg.storage.backup_one_rank else ranks
        moved = {
            "d2h": c["d2h_blocks"] * block_bytes,
            "h2d": c["h2d_blocks"] * block_bytes,
            "storage_read": (sc["prefetch_pages_completed"] * block_bytes) if sc else 0,
            "storage_write": (sc["backup_pages"] * self.stack.page_bytes * writers) if sc else 0,
        }
        transfer_bytes = CounterMetricFamily(
            "kvtier_transfer_bytes",
            "KV bytes moved, by direction, summed over ranks (blocks x block bytes x ranks).",
            labels=["direction"])
        for direction in DIRECTIONS:
            transfer_bytes.add_metric([direction], moved[direction])
        yield transfer_bytes
        yield CounterMetricFamily(
            "kvtier_transfer_failed_tasks", "Tasks that failed on at least one rank.",
            value=c["failed_tasks"])
        yield CounterMetricFamily(
            "kvtier_resets", "Successful resets (POST /reset) of the device and host caches.",
            value=c["resets"])
        yield CounterMetricFamily(
            "kvtier_cache_losses",
            "Times every cached block was dropped because a worker died with its pools.",
            value=c["lost_all"])

    def _storage_families(self) -> Iterator[Metric]:
        """Storage counters; zeros when the deployment has no storage tier, so that the same
        dashboard works on every deployment."""
        storage = self.stack.storage
        sc: dict[str, int] = storage.counters if storage is not None else {}

        def get(name: str) -> int:
            return sc.get(name, 0)

        yield CounterMetricFamily(
            "kvtier_storage_queries", "Batched 'which pages does storage hold' queries.",
            value=get("queries"))
        yield CounterMetricFamily(
            "kvtier_storage_query_hit_pages",
            "Pages the queries found on every rank (before the prefetch limit).",
            value=get("query_hit_pages"))
        prefetch = CounterMetricFamily(
            "kvtier_storage_prefetch_pages",
            "Pages prefetched from storage into the host tier: issued, completed (read and "
            "verified on every rank), revoked (cancelled, failed or incomplete: a miss).",
            labels=["outcome"])
        for outcome in ("issued", "completed", "revoked"):
            prefetch.add_metric([outcome], get(f"prefetch_pages_{outcome}"))
        yield prefetch
        revoked = CounterMetricFamily(
            "kvtier_storage_revoked",
            "Storage queries and prefetches a scheduler revoked (revoke_prefetch), by what.",
            labels=["what"])
        revoked.add_metric(["query"], get("revoked_queries"))
        revoked.add_metric(["prefetch"], get("revoked_prefetches"))
        yield revoked
        revoked_pages = CounterMetricFamily(
            "kvtier_storage_revoked_pages",
            "Pages of revoked prefetches: kept (read before the revoke took effect, host "
            "copies) or dropped (never read, freed).", labels=["outcome"])
        revoked_pages.add_metric(["kept"], get("revoked_pages_kept"))
        revoked_pages.add_metric(["dropped"], get("revoked_pages_dropped"))
        yield revoked_pages
        yield CounterMetricFamily(
            "kvtier_storage_backup_pages", "Pages backed up from the host tier to storage.",
            value=get("backup_pages"))
        yield CounterMetricFamily(
            "kvtier_storage_backup_failed_pages", "Pages whose backup to storage failed.",
            value=get("backup_failed_pages"))
        yield CounterMetricFamily(
            "kvtier_storage_backup_skipped_pages",
            "Pages not backed up because storage.max_backup_mb_s had no budget left.",
            value=get("backup_skipped_pages"))
        yield CounterMetricFamily(
            "kvtier_storage_backup_slow_skipped_pages",
            "Pages not backed up because storage writes were slow (back-pressure: the backup "
            "latency average above storage.slow_write_ms); never announced as stored.",
            value=get("backup_slow_skipped_pages"))
        bp = storage.status()["back_pressure"] if storage is not None else {}
        latency = GaugeMetricFamily(
            "kvtier_storage_latency_average_seconds",
            "Moving average of storage task latency, sent to answered (write: backups, "
            "queueing included; read: queries; prefetch: prefetches); absent before the first "
            "answer.",
            labels=["op"])
        for op in ("write", "read", "prefetch"):
            ms = bp.get(f"{op}_latency_ms")
            if ms is not None:
                latency.add_metric([op], ms / 1000)
        yield latency
        yield GaugeMetricFamily(
            "kvtier_storage_writes_slow",
            "1 while back-pressure skips backups (storage.slow_write_ms), else 0.",
            value=int(bool(bp.get("writes_slow"))))
        yield GaugeMetricFamily(
            "kvtier_storage_reads_slow",
            "1 while back-pressure answers lookups without asking storage "
            "(storage.slow_read_ms), else 0.", value=int(bool(bp.get("reads_slow"))))
        yield CounterMetricFamily(
            "kvtier_storage_query_slow_skips",
            "Lookups answered as a miss without asking storage because storage reads were "
            "slow (back-pressure).", value=get("query_slow_skips"))
        errors = CounterMetricFamily(
            "kvtier_storage_errors", "Storage tasks that failed, by operation.", labels=["op"])
        for op in STORAGE_ERROR_OPS:
            errors.add_metric([op], get(f"errors_{op}"))
        yield errors
        yield GaugeMetricFamily(
            "kvtier_storage_prefetching_blocks", "Host blocks held by prefetches in flight.",
            value=storage.prefetching_blocks if storage is not None else 0)
        # The index of what storage holds (storage.index_refresh_s): how often it was listed,
        # what it lists, whether it is complete (a block it lacks is then a miss at once), and
        # the misses it answered without a query on the scheduler API (the keyed surface's
        # are kvtier_engine_storage_index_misses_total).
        yield CounterMetricFamily(
            "kvtier_storage_index_listings",
            "Listings of what storage holds asked of the backend (LIST tasks; failures are "
            "kvtier_storage_errors_total{op=\"list\"}).", value=get("index_listings"))
        index = storage.status()["index"] if storage is not None else {}
        yield GaugeMetricFamily(
            "kvtier_storage_index_pages",
            "Storage pages the index lists (last listing plus pages written or found since).",
            value=index.get("pages", 0))
        yield GaugeMetricFamily(
            "kvtier_storage_index_complete",
            "1 while the index lists every page storage held at a recent listing (a block it "
            "lacks is a miss without a query), else 0.", value=int(bool(index.get("complete"))))
        yield CounterMetricFamily(
            "kvtier_storage_index_misses",
            "Scheduler-API misses the complete index answered without a storage query.",
            value=get("index_misses"))

    def _keyed_families(self) -> Iterator[Metric]:
        """The key-addressed surface's counters (an engine that owns its device tier, such as
        vLLM, calls it); absent when the stack has none."""
        keyed = self.stack.keyed
        if keyed is None:
            return
        c = dict(keyed.counters)
        stores = CounterMetricFamily(
            "kvtier_engine_stores",
            "Engine block stores into the host tier, by outcome: prepared (host blocks "
            "given), completed (servable), failed (the engine's copy failed or was abandoned), "
            "refused (the host tier could not take them all).", labels=["outcome"])
        for outcome in ("prepared", "completed", "failed", "refused"):
            stores.add_metric([outcome], c.get(f"stores_{outcome}", 0))
        yield stores
        loads = CounterMetricFamily(
            "kvtier_engine_loads", "Engine block loads from the host tier, by phase.",
            labels=["phase"])
        for phase in ("prepared", "completed"):
            loads.add_metric([phase], c.get(f"loads_{phase}", 0))
        yield loads
        yield CounterMetricFamily(
            "kvtier_engine_storage_queries",
            "Storage queries the engine's lookups started (one per request and block run).",
            value=c.get("storage_queries", 0))
        yield CounterMetricFamily(
            "kvtier_engine_storage_index_misses",
            "Engine lookups storage's complete index answered as a miss without a query.",
            value=c.get("storage_index_misses", 0))
        removed = CounterMetricFamily(
            "kvtier_engine_removed_blocks",
            "Blocks removed from every tier of the node (KeyedHostCache.remove), by reason "
            "(audit_mismatch: the sampled audit found the copy wrong) and tier: host copies "
            "taken out, storage pages whose deletion was sent to every rank.",
            labels=["reason", "tier"])
        for reason, (host, pages) in sorted(dict(keyed.removals).items()):
            removed.add_metric([reason, "host"], host)
            removed.add_metric([reason, "storage"], pages)
        yield removed

    def _backend_families(self) -> Iterator[Metric]:
        """What each rank's storage backend alone knows, as its worker last published it.
        A family appears once some rank's backend reports it (Redis has no byte count, a
        file store no outages); counters restart from zero when a worker is replaced."""
        sup = self.stack.supervisor
        if sup is None or self.stack.cfg.storage.backend == "none":
            return
        try:
            figures = sup.storage_figures()
        except Exception as e:  # the IPC closed under us (stack closing)
            log.debug("storage figures unavailable: %s", e)
            return
        for figure, name, kind, text in BACKEND_FAMILIES:
            family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                f"kvtier_storage_backend_{name}", text, labels=["rank"])
            reported = [(rank, f[figure]) for rank, f in enumerate(figures) if figure in f]
            for rank, value in reported:
                family.add_metric([str(rank)], value)
            if reported:
                yield family

    def _worker_families(self) -> Iterator[Metric]:
        sup = self.stack.supervisor
        if sup is None:
            return
        try:
            workers = sup.status()
        except Exception as e:  # the IPC closed under us (stack closing): no worker figures
            log.debug("worker status unavailable: %s", e)
            return
        up = GaugeMetricFamily(
            "kvtier_worker_up", "1 while the worker of the rank is ready, else 0.",
            labels=["rank"])
        age = GaugeMetricFamily(
            "kvtier_worker_heartbeat_age_seconds",
            "Seconds since the worker of the rank last beat (absent before its first beat).",
            labels=["rank"])
        inflight = GaugeMetricFamily(
            "kvtier_worker_tasks_inflight", "Tasks the worker of the rank has received and "
            "not answered.", labels=["rank"])
        restarts = CounterMetricFamily(
            "kvtier_worker_restarts", "Times the worker of the rank was replaced after dying.",
            labels=["rank"])
        # Issue 11 item 1: a replacement that fails to start is retried with backoff; these
        # make that visible to alerts (the /status rows hold the same figures).
        start_failures = CounterMetricFamily(
            "kvtier_worker_start_failures",
            "Starts of a worker for the rank that failed (exited or not ready in time) since "
            "the manager started.", labels=["rank"])
        in_a_row = GaugeMetricFamily(
            "kvtier_worker_consecutive_start_failures",
            "Failed starts of the rank's worker in a row (0 once one is ready); the deployment "
            "counts as unable to recover from the supervisor's max_start_failures (5).",
            labels=["rank"])
        state = GaugeMetricFamily(
            "kvtier_worker_state",
            "1 for the state the worker of the rank is in, 0 for the others: starting, ready, "
            "dead (lost, a replacement is being started), start_failed (waiting for the next "
            "try), stopped.", labels=["rank", "state"])
        for w in workers:
            rank = [str(w["rank"])]
            up.add_metric(rank, 1 if w["state"] == "ready" else 0)
            if w["heartbeat_age_s"] is not None:
                age.add_metric(rank, float(w["heartbeat_age_s"]))
            inflight.add_metric(rank, int(w["tasks_inflight"]))
            restarts.add_metric(rank, int(w["restarts"]))
            start_failures.add_metric(rank, int(w["start_failures_total"]))
            in_a_row.add_metric(rank, int(w["start_failures"]))
            for name in WORKER_STATES:
                state.add_metric([*rank, name], 1 if w["state"] == name else 0)
        unrecoverable = GaugeMetricFamily(
            "kvtier_workers_unrecoverable",
            "1 once some rank failed max_start_failures (5) starts in a row (/healthz is 503; "
            "retries go on), else 0.")
        unrecoverable.add_metric([], 1 if sup.unrecoverable()[0] else 0)
        yield up
        yield age
        yield inflight
        yield restarts
        yield start_failures
        yield in_a_row
        yield state
        yield unrecoverable


class NodeCollector(Collector):
    """The node service's figures per namespace (label `namespace`: the engines' storage
    namespace, never request data): host quota, bytes in use, engines attached, and per
    namespace the engines' lookups, hits by tier and stores."""

    def __init__(self, node: NodeServer) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        st = self.node.status()
        quota = GaugeMetricFamily("kvtier_node_namespace_quota_bytes",
                                  "Host bytes the namespace may hold (all ranks).",
                                  labels=["namespace"])
        used = GaugeMetricFamily("kvtier_node_namespace_used_bytes",
                                 "Host bytes the namespace holds now (all ranks).",
                                 labels=["namespace"])
        engines = GaugeMetricFamily("kvtier_node_namespace_engines",
                                    "Engines attached to the namespace now.",
                                    labels=["namespace"])
        blocks = CounterMetricFamily(
            "kvtier_node_engine_blocks",
            "Blocks the attached engines of the namespace looked up, loaded from the host "
            "tier (by where the copy came from: host or storage) and stored, since the "
            "service started (engines that left included).", labels=["namespace", "kind"])
        restart = GaugeMetricFamily(
            "kvtier_node_restart_blocks",
            "Blocks of the namespace's host tier the previous service handed over, and of "
            "them those this service adopted and those it discarded (issue 37).",
            labels=["namespace", "kind"])
        dropped = CounterMetricFamily(
            "kvtier_node_connections_dropped",
            "Engine connections refused or dropped (bad credentials, bad frames, not reading "
            "replies).")
        dropped.add_metric([], st["dropped"])
        for ns in st["namespaces"]:
            label = [ns["namespace"]]
            quota.add_metric(label, ns["quota_bytes"])
            used.add_metric(label, ns["used_bytes"])
            engines.add_metric(label, ns["engines"])
            for kind, n in ns["blocks"].items():
                blocks.add_metric([*label, kind], n)
            for kind, n in ns["restart"].items():
                restart.add_metric([*label, kind], n)
        yield quota
        yield used
        yield engines
        yield blocks
        yield restart
        yield dropped


class TenantCollector(Collector):
    """Per tenant of each steered namespace (issue 36; the node's namespaces, or an embedded
    kvtier's one): host blocks by state, quota, hit tokens, stores, evictions, refused
    stores. Label cardinality is bounded by TOP_TENANTS named tenants per namespace (most
    host blocks first), the rest summed under tenant="(other)" (whose counters may step
    down when a tenant ranks into the named ones)."""

    def __init__(self, source: NamespaceSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        t_blocks = GaugeMetricFamily("kvtier_node_tenant_host_blocks",
                                     "Host blocks a tenant holds in the namespace, by state "
                                     "(all, pinned, held by a retention).",
                                     labels=["namespace", "tenant", "state"])
        t_quota = GaugeMetricFamily("kvtier_node_tenant_quota_blocks",
                                    "A tenant's host quota in blocks.",
                                    labels=["namespace", "tenant"])
        t_events = CounterMetricFamily(
            "kvtier_node_tenant_events",
            "A tenant's hit tokens (host tier), stores, evictions and refused stores.",
            labels=["namespace", "tenant", "kind"])
        for nso in self.source.all():
            for tenant, f in nso.tenant_figures(TOP_TENANTS).items():
                lab = [nso.name, tenant or "(default)"]  # "" would read as no label
                t_blocks.add_metric([*lab, "all"], f.get("host_blocks", 0))
                t_blocks.add_metric([*lab, "pinned"], f.get("pinned_blocks", 0))
                t_blocks.add_metric([*lab, "held"], f.get("held_blocks", 0))
                if "quota_blocks" in f:
                    t_quota.add_metric(lab, f["quota_blocks"])
                for kind in ("hit_tokens", "stores", "evictions", "stores_refused"):
                    t_events.add_metric([*lab, kind], f.get(kind, 0))
        yield t_blocks
        yield t_quota
        yield t_events


def build_registry(stack: Stack, node: NodeServer | None = None,
                   steered: NamespaceSource | None = None) -> CollectorRegistry:
    """A registry of its own (not the process-global default, so two stacks in one process
    never mix) with the stack's collector, the transfer histogram fed by the stack's transfer
    observer, and the process collector (CPU, memory, open files of the manager process)."""
    registry = CollectorRegistry()
    seconds = Histogram(
        "kvtier_transfer_seconds",
        "Seconds from sending a transfer task to every rank having answered, by direction.",
        labelnames=["direction"], buckets=TRANSFER_BUCKETS_S, registry=registry)
    children = {d: seconds.labels(direction=d) for d in DIRECTIONS}

    def observe(kind: TaskKind, blocks: int, elapsed_s: float) -> None:
        direction = DIRECTION_OF_KIND.get(kind)
        if direction is not None:
            children[direction].observe(elapsed_s)

    stack.add_transfer_observer(observe)
    registry.register(StackCollector(stack))
    if node is not None:
        registry.register(NodeCollector(node))
    if steered is not None:
        registry.register(TenantCollector(steered))
    ProcessCollector(registry=registry)
    return registry
