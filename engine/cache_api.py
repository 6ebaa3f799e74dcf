"""The key-addressed surface an engine adapter calls: `EngineCache`, one contract, two homes.

An engine that owns its device tier (vLLM) asks kvtier for a host tier (and storage behind it)
addressed by its own block hashes. Two implementations answer the same calls:

* embedded (`EmbeddedCache`, in `kvtier.engine.embedded_cache`): a kvtier `Stack` inside the
  engine's process, over `kvtier.manager.keyed.KeyedHostCache`; one engine, no service.
* attached (`NodeClient`, in `kvtier.engine.node_client`): the same calls over a Unix socket
  to `kvtier serve`, the node's cache, which several engines share
  (wire format: `kvtier.manager.node.wire`).

An adapter is written once against this protocol and picks the home by configuration. The
life cycle of a block, as the engine sees it (both homes)::

    lookup(h, req, following)        HIT | PENDING | MISS | RETRY
    prepare_store(hashes)            -> PlannedStore (keys, host block ids, pools, evicted)
                                        | None (refused: nothing changed)
      -> engine copies KV -> host pages of `plan.pools` (per rank; refused if replaced)
    complete_store(hashes, ok)       ok: servable to every engine of the namespace
    prepare_load(hashes)             -> PlannedLoad (host block ids, pools, from storage)
                                        (pinned: never evicted meanwhile)
      -> engine copies host pages of `plan.pools` -> KV (refused if replaced)
    complete_load(hashes)            unpinned
    end_step()                       once per scheduler step: batched messages go out,
                                     copies abandoned by `reset` are released after 2 steps

A plan names the host pools it was made against (`HostPools`: generation, instance nonce, each
rank's segment name and inode), read in the same hold of the cache's lock as the plan (attached:
from the reply that carried it), so the engine copies against the plan and nothing else: no
generation to compare. When the generation moves (a kvtier worker was replaced, the service
restarted, the client reconnected to another service instance) every host block id handed
out before is void and the segments are new files (a new inode under the same name, or
another name): a copy of an old plan names the old inode, and the copier
(`kvtier.engine.host_copier`) refuses it rather than copy into the new pool. The cache side
wrote the old generation's blocks off, so that store's completion is ignored and the load's
blocks are recomputed.

Failure semantics (attached): while the service is unreachable every lookup answers MISS,
`prepare_store` None, `prepare_load` raises `InvalidRequestError` (the adapter reports a load
failure, the engine recomputes), completions are dropped; no call blocks longer than the
client's stated bound (`NodeClient.call_timeout_s`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtier.manager.errors import InvalidRequestError
from kvtier.manager.keyed import Lookup
from kvtier.manager.keyed_events import TierEvent
from kvtier.manager.tenants import Retention, SteeringError, retention_from_hints

__all__ = ["EngineCache", "HostPools", "InvalidRequestError", "Lookup", "PlannedLoad",
           "PlannedStore", "PoolSegment", "Retention", "SteeringError", "TierEvent",
           "retention_from_hints"]


@dataclass(frozen=True, slots=True)
class PoolSegment:
    """One rank's host pool: the POSIX shared-memory `name` (with its leading "/"), the
    `inode` it had when handed out (a segment re-created under the same name is another
    inode: never copy into it on an old plan) and its size in blocks."""

    rank: int
    name: str
    inode: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class HostPools:
    """Where host block ids point, per rank, for one `generation`; `nonce` names the cache
    instance that owns the segments (embedded: the stack's, attached: the service's)."""

    generation: int
    nonce: bytes
    segments: tuple[PoolSegment, ...]

    def inodes(self) -> tuple[int, ...]:
        return tuple(s.inode for s in self.segments)

    def names(self) -> tuple[tuple[str, int], ...]:
        """Each rank's (segment name, inode): what a copy checks before it touches a pool."""
        return tuple((s.name, s.inode) for s in self.segments)


@dataclass(frozen=True, slots=True)
class PlannedStore:
    """`prepare_store`'s answer in one value (as vLLM's `PrepareStoreOutput`: where to copy
    and what was evicted for it): copy the engine's KV of `keys[i]` into host block
    `host_ids[i]` of `pools` (per rank). Keys already cached or being stored are left out.
    `evicted` counts the host copies that made room; `evicted_hashes` names those that were
    reported servable (tier events on). `pools` is what the plan was made against; a copy
    into any other segment (or the same name with another inode) is refused."""

    keys: list[bytes]
    host_ids: list[int]
    pools: HostPools
    evicted: int = 0
    evicted_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PlannedLoad:
    """`prepare_load`'s answer in one value: block i of the asked hashes is host block
    `host_ids[i]` of `pools` (pinned until `complete_load`); `from_storage[i]`: it came from
    storage and was not loaded since (where a hit comes from, for the engine's metrics)."""

    host_ids: list[int]
    pools: HostPools
    from_storage: list[bool]

@runtime_checkable
class EngineCache(Protocol):
    """What an engine adapter may call. Hashes are the engine's chained block hashes (bytes,
    non-empty; a hash names its whole prefix). Calls come from the engine's scheduler
    thread; implementations are thread-safe anyway."""

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def generation(self) -> int:
        """Changes whenever host block ids handed out before became void (see the module
        docstring; a plan carries the `HostPools` of its generation: the engine needs no
        compare of its own)."""
        ...

    @property
    def wants_following(self) -> bool:
        """Whether `lookup` uses `following`: with a storage tier (both homes) and always
        attached (the service answers a request's whole lookup in one round trip from it).
        When False the adapter may pass `()` and save working the keys out."""
        ...

    def host_pools(self) -> HostPools | None:
        """The host pool segments per rank and the generation they belong to now; None while
        there are none (attached: the service is unreachable). A copy uses its plan's pools,
        not these (they may have moved since it was planned)."""
        ...

    def storage_key(self, block_hash: bytes) -> bytes:
        """The page name of a block in storage (SHA-256 over the namespace and the hash)."""
        ...

    @property
    def storage_backend(self) -> str:
        """The storage tier's backend ("none", "file", "redis", ...; attached: the
        service's, "" until it was reached): a router's locality of STORAGE events."""
        ...

    def lookup(self, block_hash: bytes, request_id: str = "",
               following: Sequence[bytes] = (), *,
               threshold_tokens: int | None = None) -> Lookup:
        """Is this block on the host and ready? `following`: the request's next hashes in
        the order a hit is worth most with (see `KeyedHostCache.lookup`)."""
        ...

    def count_asked(self, request_id: str, blocks: int | Callable[[], int]) -> None:
        """Count `blocks` looked-up blocks of a request once (the hit-rate denominator; a
        callable is called only the first time a request is counted)."""
        ...

    def forget_request(self, request_id: str) -> None:
        """The engine is done with a request."""
        ...

    def pending_work(self) -> bool:
        """True while a storage query or prefetch is in flight: keep stepping."""
        ...

    def from_storage(self, block_hash: bytes) -> bool:
        """Whether a cached block came from storage and has not been loaded since (where a
        hit comes from, for the engine's metrics; False when unknown)."""
        ...

    def prepare_load(self, hashes: Sequence[bytes],
                     count_tokens: Sequence[bool] | None = None) -> PlannedLoad:
        """Host block ids of these blocks and the pools they are in, pinned until
        `complete_load`; all or nothing. `count_tokens[i]` False: block i counts no hit.
        Raises InvalidRequestError when one is not a HIT any more, or there are no pools
        (the service is unreachable, a worker is being replaced): nothing is then pinned,
        and the engine recomputes them."""
        ...

    def complete_load(self, hashes: Sequence[bytes]) -> None:
        """The engine finished copying these blocks out of the host pool."""
        ...

    def touch(self, hashes: Sequence[bytes]) -> None:
        """The engine hit these blocks in its own device cache (recency only)."""
        ...

    def prepare_store(self, hashes: Sequence[bytes], tenant: str = "") -> PlannedStore | None:
        """Host blocks (and their pools) for the blocks not cached yet, booked to `tenant`
        (vLLM's cache_salt; "" the default pool). Atomic: None when the host tier cannot
        take them all now or there are no pools, and then nothing changed (no copy evicted,
        no block taken). Attached, a part may be planned (the leading `wire.MAX_FRAME_KEYS`
        keys)."""
        ...

    def retain(self, hashes: Sequence[bytes], retention: Retention, tenant: str = "") -> None:
        """Pin / TTL / priority for these blocks (the `kvtier.retain` v1 action of a
        request's kv_hints); a refusal (a pin over quota) changes nothing and is counted,
        never raised into the engine's step."""
        ...

    def complete_store(self, hashes: Sequence[bytes], ok: bool = True) -> None:
        """The engine finished (ok) or gave up copying these blocks into the host blocks
        `prepare_store` gave; a failed or abandoned store is never served."""
        ...

    def remove_loaded(self, hashes: Sequence[bytes], reason: str) -> int:
        """Remove blocks this engine holds a load of (it was served them and found them
        wrong: the sampled audit) from every tier of the node: host copy, storage page on
        every rank, removal events (`KeyedHostCache.remove`). Call it before completing the
        loads. Returns the host copies removed. Raises InvalidRequestError when refused (a
        block it holds no load of, an unknown reason, the service unreachable): nothing is
        removed then."""
        ...

    def end_step(self) -> None:
        """The engine's scheduler step ended (batched messages are flushed, copies abandoned
        by `reset` are released once no copy can still run)."""
        ...

    def enable_events(self) -> bool:
        """Start keeping tier events (`take_events`); False where this home has none to
        give. Embedded: the engine's own stack. Attached: the namespace's tiers on the node
        as this engine can be served from them (blocks other engines of the namespace stored
        included), relayed by the service per connection."""
        ...

    def take_events(self) -> list[TierEvent]:
        """Blocks that became or stopped being servable per tier since the last call
        (`kvtier.manager.keyed_events`); [] while events are off."""
        ...

    def reset(self) -> None:
        """The engine reset its own prefix cache: every copy it prepared and has not
        completed is abandoned (never served). Embedded: the host tier is emptied too.
        Attached: only this engine's copies are abandoned; the namespace's blocks stay (other
        engines use them; the operator's `POST /reset` empties the node's cache)."""
        ...

    def close(self) -> None:
        """Stop (embedded: the stack; attached: the connection). Idempotent."""
        ...
