"""kvtier as vLLM's KV offloading tier: host memory and storage behind vLLM's own device cache.

vLLM owns the device tier (its block pool, its prefix cache, its attention layout). Its
`OffloadingConnector` asks an *offloading spec* for two things: a scheduler-side manager that
tracks offloaded blocks by vLLM's block hashes, and a worker-side object that copies blocks
between vLLM's KV tensors and the offloaded medium. `KvtierOffloadingSpec` provides both:

* scheduler side (`KvtierOffloadingManager`): vLLM's block hashes translated to kvtier's
  key-addressed surface (lookups, prepared and completed loads and stores, touches) of an
  `EngineCache` (`kvtier.engine.cache_api`). Embedded (the default): `EmbeddedDeployment`
  (`kvtier.engine.embedded`), a kvtier `Stack` of manager plus worker processes, one per rank,
  each owning its rank's host pool in shared memory and doing every storage read and write;
  the policies, prefetch and backup to storage; kvtier's admin REST with its Prometheus
  metrics on a thread;
* worker side (`KvtierOffloadingWorker`, in vLLM's worker process, where its KV is reachable):
  vLLM's KV tensors registered as per-group layer views and handed to kvtier's host-pool copier
  (`kvtier.engine.host_copier`), which maps the host pool segment each transfer names and copies
  blocks between vLLM's KV and the host pages (CPU: `index_select`/`index_copy_`; CUDA: the same
  kernels on a stream of their own through the pinned pool's device view).

Modules: `adapter.py` (this one: the spec and the connector vLLM loads), `manager.py` (the
scheduler side), `worker.py` (the worker side and the load/store spec), `config.py` (vLLM's
configuration read for kvtier: geometry, groups, storage namespace, hash seed).

The adapter is vLLM translation only: what is kvtier's own on the engine side (config from the
KV geometry, defaults, the embedded stack, the copier) lives in `kvtier.engine`, the one part
of kvtier it imports (a forbidden import contract in pyproject.toml).

`KvtierConnector` is vLLM's `OffloadingConnector` plus one thing it lacks: a load that cannot be
served (the host pool of that rank was replaced by a restarted kvtier worker since the load was
planned) is reported through `get_block_ids_with_load_errors` (one KV cache group) or as a
failed request (`failed_recving`, several groups: vLLM cannot map a block id back to requests
then), so vLLM (with `kv_load_failure_policy="recompute"`) recomputes instead of reading
garbage. Models with several KV cache groups (hybrid attention) are described in
`kv_groups.py`.

The sampled recompute audit (embedded, `audit.sample` in kvtier's config; README "Auditing
kvtier's hits on live traffic"): a drawn request's kvtier hits are answered as misses, so vLLM
recomputes them with its bookkeeping exact (nothing was promised, nothing fails); when vLLM
offers the recomputed blocks for storing, each block kvtier holds goes to a scratch host page
instead (its held copy kept from eviction by a load that counts no hit), and at the store's
completion the two pages are compared (`kvtier.engine.audit`), the scratch page dropped, and
a mismatch evicted and logged once.

Why an offloading spec and not a whole `KVConnectorBase_V1`: vLLM's offloading connector
already does the scheduler bookkeeping (which blocks to store after each step, deferred
lookups, preemption fences, load/store job ids); a spec plugs into it with a small surface, and
an engine upgrade keeps that bookkeeping right. The one gap (load failures) is the subclass
above.

Storage keys are SHA-256 over a namespace and vLLM's block hash. The namespace names what makes
the same hash mean the same bytes: the model, KV dtype, cache layout, block size, parallelism,
vLLM's hash algorithm and the seed of its first block hash (`NONE_HASH`, from `PYTHONHASHSEED`
or vLLM's fixed default for cryptographic hashes). Two instances share pages exactly when all of
that is equal; an instance whose hash seed is random (a non-cryptographic hash without
`PYTHONHASHSEED`) is told so at start, because it can never share.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from kvtier.integrations.vllm import defaults
from kvtier.integrations.vllm.config import (
    KV_CACHE_CONFIG,
    kv_groups,
    kvtier_config,
    storage_namespace,
)
from kvtier.integrations.vllm.errors import VllmAdapterError
from kvtier.integrations.vllm.manager import METRICS, KvtierOffloadingManager
from kvtier.integrations.vllm.worker import KvtierLoadStoreSpec, KvtierOffloadingWorker
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingKVEventsConfig,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

__all__ = ["MODULE_PATH", "SPEC_NAME", "KvtierConnector", "KvtierLoadStoreSpec",
           "KvtierOffloadingManager", "KvtierOffloadingSpec", "KvtierOffloadingWorker",
           "kv_groups", "kvtier_config", "storage_namespace"]

log = logging.getLogger("kvtier.vllm")

SPEC_NAME = "KvtierOffloadingSpec"
MODULE_PATH = "kvtier.integrations.vllm"

# ---------------------------------------------------------------------------- the spec


class KvtierOffloadingSpec(OffloadingSpec):  # type: ignore[misc,unused-ignore]
    """The offloading spec vLLM loads by name (`spec_name = "KvtierOffloadingSpec"`,
    `spec_module_path = "kvtier.integrations.vllm"`). kvtier's own configuration comes from
    `kvtier_config` (a TOML file) and `KVTIER_*` variables, the KV shape from vLLM."""

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return dict(METRICS)

    def __init__(self, config: OffloadingConfig) -> None:
        defaults.route_kvtier_logs()
        super().__init__(config)
        # routers need each stored block's tokens, parent and block size (vLLM's
        # "self-describing" events): on unless the operator turned them off
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=bool(config.enable_kv_cache_events),
            self_describing_kv_events=bool(
                self.extra_config.get("self_describing_kv_events", True)))
        self.groups = kv_groups(config)
        self.kvtier = kvtier_config(config, self.extra_config, self.groups)
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvtierOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierOffloadingWorker(kv_caches, self.kvtier,
                                                  self.config.parallel.rank)
        return self._worker


class KvtierConnector(OffloadingConnector):  # type: ignore[misc,unused-ignore]
    """vLLM's OffloadingConnector, reporting loads kvtier could not serve (see the module
    docstring). Load it with `kv_connector="KvtierConnector"`,
    `kv_connector_module_path="kvtier.integrations.vllm"`.

    It also makes vLLM's configuration current while the spec is built, so the spec reads the
    model's KV heads and the block hash algorithm and seed (the storage namespace). With the
    plain OffloadingConnector those are unknown: the namespace then gets a random part, so
    the instance never shares storage (never wrongly)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        from vllm.config import set_current_vllm_config

        defaults.route_kvtier_logs()
        self._refused = 0  # refused loads not logged yet, and when they last were
        self._refused_logged = -1e9
        token = KV_CACHE_CONFIG.set(kv_cache_config)
        try:
            with set_current_vllm_config(vllm_config), defaults.quiet_vllm_warnings():
                super().__init__(vllm_config, role, kv_cache_config)
        finally:
            KV_CACHE_CONFIG.reset(token)

    def _kvtier_worker(self) -> KvtierOffloadingWorker | None:
        worker = getattr(self.connector_worker, "worker", None)
        return worker if isinstance(worker, KvtierOffloadingWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self._kvtier_worker()
        if worker is None or len(worker.groups) > 1:
            return set()  # several groups: reported by request (get_transfer_results)
        return worker.take_load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's transfer results, plus the requests whose load kvtier refused when the model
        has several KV cache groups: vLLM maps a failed block id back to requests only with
        one group (a block id is unique only within its group) and stops with a RuntimeError
        otherwise, so such failures are reported by request (`failed_recving`; vLLM then
        recomputes the request's prompt)."""
        worker = self._kvtier_worker()
        several = worker is not None and len(worker.groups) > 1
        # job id -> request of the loads in flight (vLLM's worker side forgets them as it
        # reports them finished, below)
        loads = dict(getattr(self.connector_worker, "_load_jobs", {})) if several else {}
        results = super().get_transfer_results(finished_req_ids)
        if several and worker is not None:
            jobs = worker.take_failed_load_jobs()
            if jobs - loads.keys():  # never serve a load that copied nothing: fail closed
                raise VllmAdapterError(
                    f"loads {sorted(jobs - loads.keys())} were refused and cannot be traced "
                    "to their requests (this vLLM's offloading worker keeps no _load_jobs)")
            failed = {loads[j] for j in jobs}
            if failed:
                self._refused += len(failed)
                now = time.monotonic()
                if now - self._refused_logged >= 10.0:  # at most one line per 10 s
                    log.warning("kvtier: loads refused for %d request(s) since the last "
                                "report; vLLM recomputes them", self._refused)
                    self._refused, self._refused_logged = 0, now
                results.failed_recving |= failed
        return results


def _register_spec() -> None:
    """Make kvtier's spec one vLLM knows by name, so loading it is not the out-of-tree path
    (which warns that its API is experimental on every start, in every vLLM process)."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    with contextlib.suppress(ValueError):  # registered already (the module reloaded)
        OffloadingSpecFactory.register_spec(SPEC_NAME, MODULE_PATH, SPEC_NAME)


_register_spec()
