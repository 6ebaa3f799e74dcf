"""`EngineCache` in the engine's own process: a kvtier `Stack` with its key-addressed surface.

The embedded home of the contract in `kvtier.engine.cache_api`: one engine, no service. The
stack's worker processes own one host pool segment per rank, named after the deployment id.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.engine.cache_api import (
    EngineCache,
    HostPools,
    InvalidRequestError,
    Lookup,
    PlannedLoad,
    PlannedStore,
    PoolSegment,
    TierEvent,
)
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.sessions import EngineSession, Graves
from kvtier.manager.stack import Stack
from kvtier.manager.tenants import Retention, SteeringError
from kvtier.worker.spec import host_segments

# vLLM may still run a store it deferred for a step after its prefix-cache reset: copies it
# abandoned keep their host blocks this many scheduler steps before they are given back
ABANDON_STEPS = 2


class EmbeddedCache:
    """`EngineCache` over a running `Stack(cfg, keyed_namespace=...)` this object owns.

    Data structures: `session`, the engine's one `EngineSession` (its open copies; the
    cache's only owner here); `graves`, the copies an engine reset abandoned, held
    `ABANDON_STEPS` steps, until no deferred copy can still touch them
    (`kvtier.manager.sessions`: the node service's rule, counted in steps); `_pools`, the
    segments read once per generation. Invariants: an abandoned copy is never served
    (`KeyedHostCache.release_abandoned` drops it); a plan's pools are read in the same hold
    of the cache's lock as the plan (a lost worker moves the generation under that lock), so
    they are the ones its host block ids mean."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.cache: KeyedHostCache = stack.require_keyed()
        self.session = EngineSession(self.cache)
        self.graves = Graves()
        self._pools: HostPools | None = None
        self._nonce = os.urandom(8)
        self._lock = threading.Lock()
        self.retain_refused = 0  # kv_hints retentions refused (a pin over quota)
        self.last_refusal = ""

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def generation(self) -> int:
        return self.cache.generation

    @property
    def wants_following(self) -> bool:
        return self.cache.storage is not None

    def host_pools(self) -> HostPools | None:
        # Read only while every worker is up: a lost worker's rank is marked dead before the
        # generation moves (`Supervisor._replace`), and its replacement makes a new segment
        # before it is ready, so pools read now are the generation's own (a dead worker's
        # segment, still in /dev/shm, is never cached under the new generation).
        if not self.cache.host_ready():
            return None
        gen = self.cache.generation
        pools = self._pools
        if pools is not None and pools.generation == gen:
            return pools
        cfg = self.stack.cfg
        try:
            segments = tuple(
                PoolSegment(r, name, inode, cfg.cache.host_blocks)
                for r, name, inode in host_segments(cfg.deployment_id, cfg.workers.count))
        except OSError:
            return None  # a worker is being replaced: no pool to copy into now
        self._pools = HostPools(gen, self._nonce, segments)
        return self._pools

    def storage_key(self, block_hash: bytes) -> bytes:
        return self.cache.storage_key(block_hash)

    @property
    def storage_backend(self) -> str:
        return self.stack.cfg.storage.backend

    def lookup(self, block_hash: bytes, request_id: str = "",
               following: Sequence[bytes] = (), *,
               threshold_tokens: int | None = None) -> Lookup:
        return self.cache.lookup(block_hash, request_id, following,
                                 threshold_tokens=threshold_tokens)

    def count_asked(self, request_id: str, blocks: int | Callable[[], int]) -> None:
        self.cache.count_asked(request_id, blocks)

    def forget_request(self, request_id: str) -> None:
        self.cache.forget_request(request_id)

    def pending_work(self) -> bool:
        return self.cache.pending_work()

    def from_storage(self, block_hash: bytes) -> bool:
        return self.cache.from_storage(block_hash)

    def prepare_load(self, hashes: Sequence[bytes],
                     count_tokens: Sequence[bool] | None = None) -> PlannedLoad:
        with self.cache.m.lock:
            pools = self.host_pools()
            if pools is None:
                raise InvalidRequestError("prepare_load: kvtier's host pools are not up (a "
                                          "worker is being replaced)")
            from_storage: list[bool] = []
            ids = self.session.prepare_load(hashes, count_tokens, from_storage)
            return PlannedLoad(ids, pools, from_storage)

    def complete_load(self, hashes: Sequence[bytes]) -> None:
        self.session.complete_load(hashes)

    def touch(self, hashes: Sequence[bytes]) -> None:
        self.cache.touch(hashes)

    def prepare_store(self, hashes: Sequence[bytes], tenant: str = "") -> PlannedStore | None:
        with self.cache.m.lock:
            pools = self.host_pools()
            if pools is None:  # nothing planned: nothing changed
                return None
            plan = self.session.prepare_store(hashes, tenant)
            if plan is None:
                return None
            return PlannedStore(plan.keys, plan.host_ids, pools, plan.evicted,
                                plan.evicted_hashes)

    def retain(self, hashes: Sequence[bytes], retention: Retention, tenant: str = "") -> None:
        try:
            self.session.cache.retain(hashes, retention, tenant)
        except SteeringError as e:
            self.retain_refused += 1
            self.last_refusal = str(e)

    def complete_store(self, hashes: Sequence[bytes], ok: bool = True) -> None:
        self.session.complete_store(hashes, ok)

    def remove_loaded(self, hashes: Sequence[bytes], reason: str) -> int:
        return self.session.remove_loaded(hashes, reason).host

    def end_step(self) -> None:
        if len(self.graves):
            self.graves.step()

    def enable_events(self) -> bool:
        self.cache.enable_events()
        return True

    def take_events(self) -> list[TierEvent]:
        return self.cache.take_events()

    def reset(self) -> None:
        """The engine's prefix-cache reset: its open copies are abandoned and the host tier
        emptied (storage kept). Raises KvtierError when in-flight transfers do not drain
        (the host tier then stays as it was)."""
        with self._lock:
            self.session.abandon(self.graves, steps=ABANDON_STEPS, unpin_loads=False)
        self.stack.reset()

    def close(self) -> None:
        self.stack.close()




if TYPE_CHECKING:  # mypy holds the embedded home to the contract
    def _conforms(c: EmbeddedCache) -> EngineCache:
        return c
