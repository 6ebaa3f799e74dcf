"""The scheduler side: vLLM's `OffloadingManager` over kvtier's `EngineCache` (see `adapter.py`
for how it fits), with kvtier's series in vLLM's /metrics and the sampled recompute audit's
state."""

from __future__ import annotations

import atexit
import functools
import json
import logging
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload

from kvtier.engine import audit as kv_audit
from kvtier.engine.attached import attach
from kvtier.engine.cache_api import (
    EngineCache,
    HostPools,
    InvalidRequestError,
    Lookup,
    Retention,
    SteeringError,
    retention_from_hints,
)
from kvtier.engine.defaults import apply_defaults
from kvtier.engine.embedded import EmbeddedDeployment, KvtierConfig
from kvtier.engine.errors import KvtierError
from kvtier.engine.geometry import kv_shape
from kvtier.integrations.vllm import defaults
from kvtier.integrations.vllm.config import (
    block_naming,
    hash_block_size,
    hash_seed,
    storage_namespace,
)
from kvtier.integrations.vllm.errors import VllmAdapterError
from kvtier.integrations.vllm.kv_events import EventRelay
from kvtier.integrations.vllm.kv_groups import KVGroup, primary_group
from kvtier.integrations.vllm.worker import KvtierLoadStoreSpec
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingKVEventsConfig,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource


class SpecView(Protocol):
    """What the manager reads of its spec (`adapter.KvtierOffloadingSpec`, which builds the
    manager: a protocol rather than an import, so the two modules do not import each other)."""

    @property
    def kvtier(self) -> KvtierConfig: ...
    @property
    def groups(self) -> list[KVGroup] | None: ...
    @property
    def config(self) -> OffloadingConfig: ...
    @property
    def extra_config(self) -> Mapping[str, Any]: ...
    @property
    def kv_events_config(self) -> OffloadingKVEventsConfig: ...

log = logging.getLogger("kvtier.vllm")


# kvtier's series in vLLM's /metrics (next to vLLM's own kv_offload transfer series, which
# vLLM fills from the worker side's transfer results): name -> definition
METRIC_LOOKUPS = "vllm:kv_offload_kvtier_lookups"
METRIC_HITS = "vllm:kv_offload_kvtier_hits"
METRIC_MISSES = "vllm:kv_offload_kvtier_misses"
METRIC_EVICTIONS = "vllm:kv_offload_kvtier_evictions"
METRIC_HOST_USAGE = "vllm:kv_offload_kvtier_host_usage_perc"
METRIC_AUDIT = "vllm:kv_offload_kvtier_audit_blocks"
METRIC_AUDIT_MAX_ABS = "vllm:kv_offload_kvtier_audit_max_abs_diff"
METRIC_AUDIT_MAX_REL = "vllm:kv_offload_kvtier_audit_max_rel_diff"
METRICS: dict[str, OffloadingMetricMetadata] = {
    METRIC_LOOKUPS: OffloadingCounterMetadata(
        documentation="Blocks vLLM looked up in kvtier (answered hit or miss)."),
    METRIC_HITS: OffloadingCounterMetadata(
        documentation="Blocks vLLM loaded from kvtier, by the tier they were served from "
                      "(host, or storage for a block prefetched from storage).",
        labelnames=("tier",)),
    METRIC_MISSES: OffloadingCounterMetadata(
        documentation="Blocks vLLM looked up in kvtier that no tier of kvtier held."),
    METRIC_EVICTIONS: OffloadingCounterMetadata(
        documentation="Host copies kvtier evicted to make room for vLLM's stores."),
    METRIC_HOST_USAGE: OffloadingGaugeMetadata(
        documentation="Fraction of kvtier's host blocks in use (embedded instances)."),
    METRIC_AUDIT: OffloadingCounterMetadata(
        documentation="Blocks of kvtier's sampled recompute audit, by result (equal, "
                      "within_tolerance, mismatch) and the tier the held copy was served from.",
        labelnames=("result", "tier")),
    METRIC_AUDIT_MAX_ABS: OffloadingGaugeMetadata(
        documentation="Largest absolute element difference the audit has seen between a "
                      "recomputed block and kvtier's copy (0: every audited block equal)."),
    METRIC_AUDIT_MAX_REL: OffloadingGaugeMetadata(
        documentation="Largest relative element difference the audit has seen, "
                      "|a - b| / (|b| + mean|b|) (kvtier.engine.audit)."),
}



# ---------------------------------------------------------------------------- scheduler side


class _LazyKeys(Sequence[bytes]):
    """A sequence of keys worked out on first use (a storage query's `following`)."""

    def __init__(self, make: Callable[[], list[bytes]]) -> None:
        self._make: Callable[[], list[bytes]] | None = make
        self._keys: list[bytes] = []

    def _get(self) -> list[bytes]:
        if self._make is not None:
            self._keys, self._make = self._make(), None
        return self._keys

    def __len__(self) -> int:
        return len(self._get())

    @overload
    def __getitem__(self, i: int) -> bytes: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[bytes]: ...

    def __getitem__(self, i: int | slice) -> bytes | Sequence[bytes]:
        return self._get()[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._get())


class _Pending:
    """One open audit: the scratch page's key and host block, the held copy's host block
    (held from eviction by a load), the tier it was served from, the layers its group uses
    (None: all) and each rank's segment (name, inode) both pages were planned in."""

    __slots__ = ("held", "layers", "scratch", "scratch_key", "segments", "tier")

    def __init__(self, scratch_key: bytes, held: int, scratch: int, tier: str,
                 layers: int | None, segments: tuple[tuple[str, int], ...]) -> None:
        self.scratch_key, self.held, self.scratch = scratch_key, held, scratch
        self.tier, self.layers, self.segments = tier, layers, segments


class _Audit:
    """The audit's state on the scheduler side: `sampler`; `requests`, req id -> drawn or
    not (decided at its first hit, forgotten when it finishes); `pending`, hash -> its open
    audit; `figures`, blocks by result and tier and the largest differences; `logged`, blocks
    whose mismatch was logged (once per block)."""

    def __init__(self, cfg: KvtierConfig) -> None:
        self.sampler = kv_audit.AuditSampler(cfg.audit.rate, cfg.audit.max_blocks_per_s)
        self.dtype = cfg.model.dtype
        self.reader = kv_audit.PageReader(kv_shape(cfg))
        self.requests: dict[str, bool] = {}
        self.pending: dict[bytes, _Pending] = {}
        self.figures = kv_audit.AuditFigures()
        self.skipped = 0  # drawn blocks not audited (no scratch page free)
        self.logged: set[bytes] = set()
        self.last_digests = ("", "")

    def compare(self, segments: tuple[tuple[str, int], ...], p: _Pending) -> kv_audit.Verdict:
        """Both copies compared on every rank; the worst rank's verdict."""
        worst: kv_audit.Verdict | None = None
        for rank, (name, inode) in enumerate(segments):
            held = self.reader.page(rank, name, inode, p.held, p.layers)
            fresh = self.reader.page(rank, name, inode, p.scratch, p.layers)
            v = kv_audit.compare_pages(fresh, held, self.dtype)
            if worst is None or (kv_audit.RESULTS.index(v.result), v.max_rel) > (
                    kv_audit.RESULTS.index(worst.result), worst.max_rel):
                worst = v
                self.last_digests = (kv_audit.digest(held), kv_audit.digest(fresh))
        assert worst is not None
        return worst



class _Steer:
    """A request's `kvtier.retain` (its kv_hints), kept in its ReqContext state."""

    __slots__ = ("retention", "tenant")

    def __init__(self, retention: Retention, tenant: str | None) -> None:
        self.retention = retention
        self.tenant = tenant


class KvtierOffloadingManager(OffloadingManager):  # type: ignore[misc,unused-ignore]
    """vLLM's scheduler-side offloading manager over kvtier's `EngineCache`, in one of two
    modes chosen by `kvtier_serve` in kv_connector_extra_config:

    * embedded (no `kvtier_serve`): this instance's own kvtier (`EmbeddedDeployment`: stack,
      watcher, admin REST); one instance, no service needed;
    * attached (`kvtier_serve = "<socket path>"`): the node's `kvtier serve`, shared with the
      node's other instances of the same namespace, over its socket (`NodeClient`); while the
      service is unreachable lookups miss, stores are skipped and loads that cannot be served
      are reported failed (vLLM recomputes), and the client reconnects with backoff.

    Data structures: `cache`, the `EngineCache` of either mode; `node`, the embedded
    deployment (None attached); `_groups`: vLLM's group id ->
    `KVGroup` (its kind, window and key space). Invariant: with several groups every key
    kvtier holds is a group's own (`KVGroup.key`), so no group's copy ever answers for
    another's; with one group the key is vLLM's block hash, as it always was."""

    def __init__(self, spec: SpecView) -> None:
        cfg = spec.kvtier
        groups = spec.groups
        self._groups: dict[int, KVGroup] = {g.group_id: g for g in groups or ()}
        self._keyed_groups = len(self._groups) > 1
        self._single_group_id = groups[0].group_id if groups else 0
        self._primary = primary_group(groups).group_id if groups else self._single_group_id
        # vLLM group id -> blocks vLLM loaded from / stored into kvtier (for tests and tools:
        # a sliding-window group loads its window, never the whole prefix)
        self.blocks_by_group: dict[int, dict[str, int]] = {
            gid: {"loaded": 0, "stored": 0} for gid in (self._groups or [self._primary])}
        namespace, identity = storage_namespace(spec.config, groups)
        shares = cfg.storage.backend != "none" or bool(spec.extra_config.get("kvtier_serve"))
        if identity.get("seed_from_env") is False and str(identity.get("hash")).startswith(
                "xxhash") and shares:
            log.warning("kvtier: vLLM hashes blocks with %s and PYTHONHASHSEED is not set, so "
                        "its block hashes are random per process: this instance will never "
                        "share KV with another (stored, or on the node's host tier). Set "
                        "PYTHONHASHSEED (the same in every instance) to share.",
                        identity["hash"])
        extra = spec.extra_config
        self.node: EmbeddedDeployment | None = None
        self.admin_url = ""
        # req id -> block hash -> whether its last load was its first hit from storage
        self._sources: dict[str, dict[bytes, bool]] = {}
        self._closed = False
        # vLLM's /metrics: counts since the last `get_stats` (name, labels) -> blocks
        self._stats: dict[tuple[str, tuple[str, ...]], int] = {}
        self.socket_path = str(extra.get("kvtier_serve") or "")
        if self.socket_path:
            self.cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
                update={"name": namespace})})
            self.cache: EngineCache = attach(
                self.socket_path, namespace, self.cfg, hash_algo=str(identity.get("hash")),
                hash_seed=hash_seed(identity), hash_block_size=hash_block_size(),
                kv_groups=max(1, len(self._groups)))
            log.info("kvtier offloading: attached to kvtier serve at %s (%s), namespace %s "
                     "(%s)", self.socket_path,
                     "connected" if self.cache.host_pools() is not None
                     else "not answering yet: lookups miss until it does",
                     namespace, json.dumps(identity, sort_keys=True))
        else:
            cfg, notes = apply_defaults(cfg, extra)
            self.cfg = cfg.model_copy(update={"model": cfg.model.model_copy(
                update={"name": namespace})})
            self.node = EmbeddedDeployment(
                self.cfg, namespace.encode(), sweep_pattern=defaults.DEPLOYMENT_PATTERN,
                admin=bool(extra.get("admin", True)),
                admin_url_file=str(extra.get("admin_url_file") or ""),
                naming=functools.partial(block_naming, identity, hash_block_size()),
                kv_groups=max(1, len(self._groups)))
            self.cache = self.node.cache
            self.admin_url = self.node.admin_url
            token_file = self.node.token_file
            log.info("kvtier offloading: deployment %s, %d host blocks of %d bytes per rank, "
                     "storage %s%s, admin %s; defaults: %s; namespace %s (%s)",
                     self.cfg.deployment_id, self.cfg.cache.host_blocks, self.node.page_bytes,
                     self.cfg.storage.backend,
                     f" {self.cfg.storage.path}" if self.cfg.storage.backend == "file" else "",
                     self.admin_url + (f" (token in {token_file})" if token_file else "")
                     if self.admin_url else "off",
                     "; ".join(notes) or "none", namespace,
                     json.dumps(identity, sort_keys=True))
        # tier events for vLLM's KV-event publisher (one-group models): host = vLLM's CPU
        # medium, storage = STORAGE (local for files, remote for Redis); attached, the
        # node's tiers as this engine is served from them (other engines' blocks included)
        self._events: EventRelay | None = None
        self.hints_refused = 0  # kv_hints whose kvtier.retain was refused (logged)
        if spec.config.enable_kv_cache_events:
            windowed = any(g.window_blocks is not None for g in self._groups.values())
            if self._keyed_groups or windowed:
                # vLLM's connector describes full-attention blocks only
                log.warning("kvtier: KV events are on, but this model has several KV cache "
                            "groups or a sliding window: kvtier publishes its tiers' events "
                            "for one full-attention group only")
            elif self.cache.enable_events():
                self._events = EventRelay(self._storage_locality(),
                                          spec.kv_events_config.self_describing_kv_events)
        # the sampled recompute audit (`audit` in kvtier's config; attached, a mismatch is
        # removed by the service: the REMOVE op)
        self.audit: _Audit = _Audit(self.cfg)
        if self.node is not None:  # kvtier's /metrics and /status (attached: vLLM's only)
            self.node.register_metrics(self.audit.figures, self._audit_status, "audit")
        if self.audit.sampler.rate > 0:
            log.info("kvtier: auditing %s of the requests that hit kvtier (at most %s "
                     "blocks/s): their hits are recomputed and compared",
                     self.cfg.audit.sample, self.cfg.audit.max_blocks_per_s or "any")
        atexit.register(self.shutdown)

    # -- keys

    def _hash(self, key: OffloadKey) -> bytes:
        """kvtier's key of an offloaded block: vLLM's block hash (one group), or the group's
        own key of it (several)."""
        gid = get_offload_group_idx(key)
        if self._keyed_groups:
            group = self._groups.get(gid)
            if group is None:
                raise VllmAdapterError(f"vLLM asked about KV cache group {gid}, which it did "
                                       f"not offload (groups {sorted(self._groups)})")
            return group.key(bytes(get_offload_block_hash(key)))
        if gid != self._single_group_id:
            raise VllmAdapterError(
                f"vLLM asked about KV cache group {gid}; it offloads group "
                f"{self._single_group_id} only")
        return bytes(get_offload_block_hash(key))

    def _hashes(self, keys: Iterable[OffloadKey]) -> list[bytes]:
        return [self._hash(k) for k in keys]

    @property
    def groups(self) -> list[KVGroup]:
        """The KV cache groups kvtier serves (empty: one group whose kind vLLM did not say)."""
        return list(self._groups.values())

    def _count(self, keys: Iterable[OffloadKey], what: str) -> None:
        for k in keys:
            counts = self.blocks_by_group.get(get_offload_group_idx(k))
            if counts is not None:
                counts[what] += 1

    def storage_key(self, key: OffloadKey) -> bytes:
        """The name of this block's page in storage (tests and tools find a group's pages
        by it)."""
        return self.cache.storage_key(self._hash(key))

    # -- OffloadingManager

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        # kvtier's own kv_hints action (`kvtier.retain` v1): read once per request, kept in
        # the request's state for its stores and loads; a bad one is counted and logged in
        # one line, never raised into vLLM's scheduler (the request runs unsteered)
        hints = getattr(req_context, "kv_hints", None)
        if hints is not None:
            try:
                found = retention_from_hints(getattr(hints, "actions", ()))
            except SteeringError as e:
                self.hints_refused += 1
                log.warning("kvtier: kv_hints of %s ignored: %s", req_context.req_id, e)
                found = None
            if found is not None:
                req_context.set_state(_Steer(*found))
        return RequestOffloadingContext()

    def _steer(self, req_context: ReqContext) -> _Steer | None:
        get = getattr(req_context, "get_state", None)
        return None if get is None else get(_Steer)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        h = self._hash(key)
        following, threshold = self._following(key, req_context)
        self.cache.count_asked(req_context.req_id, lambda: self._asked_blocks(key, req_context))
        found = self.cache.lookup(h, req_context.req_id, following,
                                  threshold_tokens=threshold)
        if found is Lookup.HIT or found is Lookup.MISS:
            self._add(METRIC_LOOKUPS)
        if found is Lookup.HIT and self._audited(key, req_context):
            return LookupResult.MISS  # recomputed, then compared (prepare_store)
        if found is Lookup.HIT:
            if self._events is not None:  # vLLM snapshots the block's tokens on a HIT
                self._events.described(key, stored=False)
            return LookupResult.HIT
        if found is Lookup.PENDING:
            return LookupResult.HIT_PENDING
        if found is Lookup.RETRY:
            return LookupResult.RETRY
        self._add(METRIC_MISSES)
        return LookupResult.MISS

    def _audit_status(self) -> dict[str, Any]:
        """The audit in kvtier's /status: its settings, requests drawn and capped, and its
        figures."""
        audit = self.audit
        return {"sample": audit.sampler.rate, "max_blocks_per_s": audit.sampler.max_blocks_per_s,
                "requests_offered": audit.sampler.offered,
                "requests_drawn": audit.sampler.drawn, "requests_capped": audit.sampler.capped,
                "blocks_skipped": audit.skipped, **audit.figures.status()}

    def _audited(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """Whether this request's hits are audited (drawn at its first hit, then kept)."""
        audit = self.audit
        if audit.sampler.rate <= 0:
            return False
        rid = req_context.req_id
        drawn = audit.requests.get(rid)
        if drawn is None:
            drawn = audit.requests[rid] = audit.sampler.draw(
                self._asked_blocks(key, req_context))
        return drawn

    def _asked_blocks(self, key: OffloadKey, req_context: ReqContext) -> int:
        """How many blocks of the request vLLM asks kvtier about, from `key` on (those past its
        own device hits), in one group's count: kvtier's lookup tokens count each token once
        whatever the number of KV cache groups."""
        positions: dict[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
        at = positions.get(key)
        if at is None:
            return 1
        return 1 + sum(1 for k, p in positions.items()
                       if p > at and get_offload_group_idx(k) == self._primary)

    def _following(self, key: OffloadKey,
                   req_context: ReqContext) -> tuple[Sequence[bytes], int | None]:
        """What a storage query from `key` should cover, in the order storage counts held
        blocks, and the prefetch threshold for it (None: the configured one). A prefix
        (full-attention) group: the request's later blocks. A windowed group: the blocks
        before `key` back to its window's length, nearest first (vLLM looks such a group up
        backwards from the hit boundary and loads only the window), prefetched when the
        prefix they end reaches the threshold. vLLM records each key's end position on the
        request context before it looks up. The keys are worked out only when a query is
        made (`_LazyKeys`): most lookups are answered from the host or an earlier answer, and
        working them out for every lookup is quadratic in the prompt's blocks."""
        positions: dict[OffloadKey, int] = getattr(req_context, "_offload_key_positions", {})
        at = positions.get(key)
        if at is None or not self.cache.wants_following:
            return (), None
        gid = get_offload_group_idx(key)
        group = self._groups.get(gid)
        window = group.window_blocks if group is not None else None

        def keys() -> list[bytes]:
            mine = ((p, k) for k, p in positions.items() if get_offload_group_idx(k) == gid)
            if window is None:
                return self._hashes(k for _, k in sorted((p, k) for p, k in mine if p > at))
            earlier = sorted(((p, k) for p, k in mine if p < at), reverse=True)
            return self._hashes(k for _, k in earlier[:window - 1])

        threshold = None
        if window is not None and at >= self.cfg.storage.prefetch_threshold:
            threshold = 0
        return _LazyKeys(keys), threshold

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """Where a block of this request's load came from. vLLM asks after `prepare_load`
        (which counts the block and clears its came-from-storage mark), so the answer is the
        one `prepare_load` recorded for the request."""
        h = self._hash(key)
        stored = self._sources.get(req_context.req_id, {}).get(h)
        if stored is None:  # not loaded by this request: where it would come from now
            stored = self.cache.from_storage(h)
        return CacheHitSource.DISK if stored else CacheHitSource.HOST

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        hashes = self._hashes(keys)
        # every group loads a block for the same tokens: the hit counters count one group's
        counted = ([get_offload_group_idx(k) == self._primary for k in keys]
                   if self._keyed_groups else None)
        try:
            # the plan names the pools its ids mean: the worker copies from them or not at all
            plan = self.cache.prepare_load(hashes, counted)
            self._sources[req_context.req_id] = dict(zip(hashes, plan.from_storage,
                                                         strict=True))
            steer = self._steer(req_context)
            if steer is not None:  # a hit of a retained request keeps its retention fresh
                self.cache.retain(hashes, steer.retention, steer.tenant or "")
            stored = sum(plan.from_storage)
            self._add(METRIC_HITS, len(hashes) - stored, ("host",))
            self._add(METRIC_HITS, stored, ("storage",))
            self._count(keys, "loaded")
            return KvtierLoadStoreSpec(plan.host_ids, plan.pools.names())
        except InvalidRequestError as e:
            # A block vLLM saw as a HIT is gone since (evicted for a prefetch that landed
            # meanwhile, or lost with a worker): a spec no worker accepts, so the load is
            # reported failed and vLLM recomputes the blocks.
            log.warning("kvtier: load of %d blocks for %s refused: %s", len(hashes),
                        req_context.req_id, e)
            return KvtierLoadStoreSpec([-1] * len(hashes), ())

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cache.touch(self._hashes(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.cache.complete_load(self._hashes(keys))

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        hashes = self._hashes(keys)
        steer = self._steer(req_context)
        tenant = "" if steer is None or steer.tenant is None else steer.tenant
        plan = self.cache.prepare_store(hashes, tenant)
        if plan is None:  # refused: nothing changed
            return None
        if steer is not None:  # blocks being written get it when they land
            self.cache.retain(hashes, steer.retention, tenant)
        # an audited request's blocks kvtier holds: copied into scratch pages, compared
        evicted = list(plan.evicted_hashes)
        audits = (self._prepare_audits(keys, hashes, set(plan.keys), evicted, plan.pools)
                  if self.audit.requests.get(req_context.req_id) else {})
        # one spec, one set of pools: the plan's (the worker refuses them if replaced since)
        segments = plan.pools.names() if plan.keys or audits else ()
        # kvtier's keys back to vLLM's (a group's key is not vLLM's block hash), in vLLM's
        # order: the keys to store and the audited ones, each with its host block
        offload_key = dict(zip(hashes, keys, strict=True))
        new = dict(zip(plan.keys, plan.host_ids, strict=True))
        targets: dict[bytes, int] = {}
        for h in hashes:
            if h in new:
                targets[h] = new[h]
            elif h in audits:
                targets[h] = audits[h]
        stored = [offload_key[h] for h in plan.keys]
        self._count(stored, "stored")
        if self._events is not None:  # vLLM snapshots the tokens of each key it stores
            # (the audited keys too: vLLM keeps their tokens while the host holds them, so a
            # mismatch's removal events withdraw exactly what the router was told)
            for k in stored + [offload_key[h] for h in audits]:
                self._events.described(k, stored=True)
        self._add(METRIC_EVICTIONS, plan.evicted)
        return PrepareStoreOutput(
            keys_to_store=[offload_key[h] for h in targets],
            store_spec=KvtierLoadStoreSpec(list(targets.values()), segments),
            evicted_keys=[self._offload_key(h) for h in evicted])

    def _prepare_audits(self, keys: list[OffloadKey], hashes: list[bytes], new: set[bytes],
                        evicted: list[bytes], pools: HostPools) -> dict[bytes, int]:
        """For each block of an audited request that kvtier holds on the host and that no
        other audit has open: its host copy held from eviction (a load that counts no hit) and
        a scratch host page for vLLM's recomputed copy (the copies evicted for it are added to
        `evicted`), all planned against `pools` (the store's: one spec names one set; a hold
        or scratch page of other pools is given back, that block not audited). Returns
        hash -> scratch host block."""
        audit = self.audit
        # first every held copy kept from eviction (so that a scratch page never evicts a
        # block audited next), then the scratch pages, all or none
        held: dict[bytes, tuple[OffloadKey, int, str]] = {}
        for k, h in zip(keys, hashes, strict=True):
            if h in new or h in audit.pending or h in held:
                continue
            tier = "storage" if self.cache.from_storage(h) else "host"
            try:
                load = self.cache.prepare_load([h], [False])
            except InvalidRequestError:
                continue  # not on the host and ready (evicted, being written): not audited
            if load.pools != pools:  # the pools moved since the store was planned
                self.cache.complete_load([h])
                continue
            held[h] = (k, load.host_ids[0], tier)
        if not held:
            return {}
        scratch_keys = [kv_audit.scratch_key(h) for h in held]
        scratch = self.cache.prepare_store(scratch_keys)
        if scratch is None or scratch.keys != scratch_keys or scratch.pools != pools:
            if scratch is not None:
                self.cache.complete_store(scratch.keys, ok=False)
            self.cache.complete_load(list(held))
            audit.skipped += len(held)
            return {}
        self._add(METRIC_EVICTIONS, scratch.evicted)
        evicted += scratch.evicted_hashes
        out: dict[bytes, int] = {}
        for (h, (k, at, tier)), skey, sid in zip(held.items(), scratch_keys, scratch.host_ids,
                                                 strict=True):
            group = self._groups.get(get_offload_group_idx(k))
            audit.pending[h] = _Pending(skey, at, sid, tier,
                                        len(group.layer_names) if group else None,
                                        pools.names())
            out[h] = sid
        return out

    def _finish_audit(self, h: bytes, *, compare: bool) -> None:
        """Compare the recomputed copy of `h` with kvtier's (when `compare`), give the scratch
        page and the hold back, count the result; a mismatch evicts the block."""
        audit = self.audit
        p = audit.pending.pop(h)
        verdict: kv_audit.Verdict | None = None
        removed: int | str = 0
        try:
            try:
                if compare:  # read from the pools it was planned against (refused if replaced)
                    verdict = audit.compare(p.segments, p)
            except Exception as e:  # an unreadable page proves nothing: not counted
                log.warning("kvtier: audit of block %s… could not compare: %s", h[:8].hex(), e)
            if verdict is not None and verdict.result == kv_audit.MISMATCH:
                # removed while this engine still holds its load (the node service removes
                # only blocks an engine holds a load of): host copy, storage page, events
                try:
                    removed = self.cache.remove_loaded([h], kv_audit.REMOVE_REASON)
                except KvtierError as e:
                    removed = str(e)
        finally:
            self.cache.complete_store([p.scratch_key], ok=False)
            self.cache.complete_load([h])
        if verdict is None:
            return
        self._add(METRIC_AUDIT, 1, (verdict.result, p.tier))
        audit.figures.record(verdict, p.tier)
        if verdict.result == kv_audit.MISMATCH and h not in audit.logged:
            audit.logged.add(h)
            log.error("kvtier audit: block %s (tier %s, namespace %s) differs from vLLM's "
                      "recomputation beyond tolerance: max abs %.6g, max rel %.6g; digests "
                      "held %s, recomputed %s; %s", h.hex(), p.tier, self.cfg.model.name,
                      verdict.max_abs, verdict.max_rel, audit.last_digests[0],
                      audit.last_digests[1],
                      f"not removed: {removed}" if isinstance(removed, str) else
                      "removed from this node's host tier and storage" if removed else
                      "no longer held on the host; its storage page deleted")

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext,
                       success: bool = True) -> None:
        hashes = self._hashes(keys)
        audit = self.audit
        if audit.pending:
            audited = {h for h in hashes if h in audit.pending}
            for h in audited:
                self._finish_audit(h, compare=success)
            hashes = [h for h in hashes if h not in audited]
        self.cache.complete_store(hashes, ok=success)

    def _add(self, name: str, n: int = 1, labels: tuple[str, ...] = ()) -> None:
        if n:
            key = (name, labels)
            self._stats[key] = self._stats.get(key, 0) + n

    def get_stats(self) -> OffloadingConnectorStats | None:
        """kvtier's figures since the last call for vLLM's /metrics (`METRICS`); vLLM adds
        its own transfer bytes and time per direction from the worker side."""
        stats = OffloadingConnectorStats()
        counts, self._stats = self._stats, {}
        for (name, labels), n in counts.items():
            stats.increase_counter(name, n, labels)
        for name in (METRIC_LOOKUPS, METRIC_MISSES, METRIC_EVICTIONS):
            stats.increase_counter(name, 0)  # present from the first scrape
        if self.audit.sampler.rate > 0:
            stats.set_gauge(METRIC_AUDIT_MAX_ABS, self.audit.figures.max_abs)
            stats.set_gauge(METRIC_AUDIT_MAX_REL, self.audit.figures.max_rel)
        if self.node is not None:
            m = self.node.stack.manager
            if m is not None and m.host_capacity:
                stats.set_gauge(METRIC_HOST_USAGE, 1.0 - m.host_free / m.host_capacity)
        return stats

    def _offload_key(self, block_hash: bytes) -> OffloadKey:
        """vLLM's key of a block kvtier holds by its hash (events are kept for one-group
        models only, whose kvtier key is vLLM's block hash)."""
        return make_offload_key(block_hash, self._single_group_id)

    def _storage_locality(self) -> Locality:
        """STORAGE events: local for files, remote for a store other nodes share (Redis)."""
        backend = self.cache.storage_backend or self.cfg.storage.backend
        return Locality.LOCAL if backend == "file" else Locality.REMOTE

    def take_events(self) -> Iterable[OffloadingEvent]:
        """kvtier's tier events since the last call as vLLM's offloading events (vLLM's
        connector adds each block's tokens, parent and block size, and publishes them):
        host = CPU, storage = STORAGE; a stored event waits for the block's tokens
        (`kv_events.EventRelay`)."""
        if self._events is None:
            return
        # attached: the service's backend, known once it was reached
        self._events.storage_locality = self._storage_locality()
        yield from self._events.relay(
            (Medium.CPU if e.tier == "host" else Medium.STORAGE, e.removed,
             [self._offload_key(h) for h in e.hashes])
            for e in self.cache.take_events())

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.cache.forget_request(req_context.req_id)
        self._sources.pop(req_context.req_id, None)
        self.audit.requests.pop(req_context.req_id, None)

    def has_pending_work(self) -> bool:
        return self.cache.pending_work()

    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache: the copies vLLM prepared and never completes are
        abandoned (held two more scheduler steps, a deferred store may still run, then given
        back, never served); embedded, kvtier's host tier is emptied too (storage is kept;
        `POST /reset?storage=true` on kvtier's admin empties it). Attached, the node's blocks
        stay: other engines use them (the operator's `POST /reset` on the service empties
        them)."""
        if self._events is not None:  # vLLM's tracker forgets every block's tokens now
            self._events.reset()
        if self.audit.pending:  # their copies are abandoned below, never completed
            self.audit.pending.clear()
        try:
            self.cache.reset()
        except KvtierError as e:  # transfers did not drain: the host tier stays as it was
            log.warning("kvtier: vLLM's cache reset could not empty kvtier's host tier: %s", e)

    def on_schedule_end(self, context: Any) -> None:
        self.cache.end_step()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.audit.reader.close()
        if self.node is not None:
            self.node.close()
        else:
            self.cache.close()


