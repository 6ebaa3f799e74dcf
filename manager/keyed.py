"""The key-addressed surface: the host and storage tiers of an engine that owns its device tier.

An engine such as vLLM allocates its KV cache itself and keeps its own prefix cache on the
device; what it wants from kvtier is a host tier (and storage behind it) addressed by *its* block
hashes. `KeyedHostCache` is that surface, over the same manager (`KVCacheManager`): the same
tree, host free list, host LRU, storage tier, lock, counters, reset and metrics. The engine's
chained block hashes stand in for kvtier's token keys (a hash covers its whole prefix, so the
order of a request's hashes gives each block's parent, as kvtier's own keys do).

The engine moves the bytes itself, in its own process, between its KV tensors and kvtier's host
pool (a shared-memory segment owned by kvtier's worker process of the rank); kvtier's worker
processes still do every storage read and write. A host copy the engine is copying is marked on
its node, so nothing evicts, frees or serves it meanwhile::

    prepare_store(keys)              new node, host block taken (LRU eviction), ENGINE_WRITE
      -> engine copies KV -> host
    complete_store(keys, ok)         ok: ready (host LRU; backed up to storage if configured)
                                     failed: host block freed, node gone
    lookup(key)                      HIT (ready) | PENDING (being written or prefetched) |
                                     MISS | RETRY (a storage query for the request is out)

A storage miss costs a cold request at most one engine step (issue 25: with a RETRY until
every answer came, cold requests waited 37.8 steps on average behind backups). Storage's
index (`StorageTier.holds`) is filled from the backend's own listing, refreshed every
`storage.index_refresh_s`, and lists what this process wrote or found since::

    host miss -> query would cover < prefetch threshold tokens   MISS, nothing asked
              -> the index is complete (a recent listing) and
                 does not list the block                         MISS, nothing asked
              -> query sent                                      RETRY
    asked again, query still out:
        the index lists the block                                RETRY until the answer or
                                                                 the transfer timeout, then MISS
        not listed, the index incomplete (no listing yet,        RETRY for UNLISTED_WAIT_S
        listing off, a store too big to list, an outage)         (0.25 s), then MISS (the answer
                                                                 may still start a prefetch)
    asked again, answered                                        as before (HIT/PENDING/MISS)
    prepare_load(keys)               ENGINE_READ (counted per node): never evicted meanwhile
      -> engine copies host -> KV
    complete_load(keys)              the count drops; at 0 the copy is evictable again
    remove(keys, reason)             the block leaves every tier of the node: host copy out of
                                     the tree (write_off), storage page deleted on every rank,
                                     removal events; a later lookup misses (`Removal` counts)

Data structures: the manager's flat map `key -> Node` (keys are the first 16 bytes of the
engine's hash, an int like kvtier's own 128-bit keys). Every open copy is recorded with its
*owner* (`Owner`: the engine that prepared it; None for the one engine of an embedded cache,
a node-service session's id for an attached one): an engine's completions and abandonment
only ever reach its own copies, never another engine's of the same hash (issue 34: one
FIFO of nodes per hash, shared by every engine, let engine A's completion publish the
half-written block of a dead engine B after a reset). `_writers[(owner, key)]`: the node of
that owner's open store of that key, so a completion finds the node its preparation marked
even after a reset replaced the tree; `_readers[(owner, key)]`: FIFO list of the nodes an
owner's loads of that key hold (a list that holds two nodes after a reset is released
whole, once every load in it completed: `_done_unmatched[(owner, key)]` counts those
completions); `_reads[node]`: loads in flight per node, of every owner; `_abandoned`:
nodes of copies an engine gave up on (it reset itself, or died), still marked until
released.

Invariants (checked by `check_invariants`, and by the manager's own check): an owner has at
most one open store of a key (`prepare_store` leaves out a key whose store of the same
owner, detached by a reset, is still open: completions name only hashes, so two would be
told apart by completion order, which an engine does not keep across stores); a key has at
most one open store in the tree (the others, of other owners, were detached by a reset); a
node marked ENGINE_WRITE is in exactly one `_writers` entry and never readable; a node
marked ENGINE_READ has `_reads[node] > 0` and is in that many places of the `_readers`
lists; neither is in the host LRU. A reset or a lost worker detaches such nodes (the manager
writes them off); their host blocks return to the free list only when the owner's completion
arrives (or its copies are abandoned and released).

One object, several files: `KeyedHostCache` inherits the steering of issue 36 (tier lookups,
retention, quotas, clears, warming) from `keyed_steering.KeyedSteering`, and the declared
attributes, `Owner`, `Lookup`, `engine_key` and `storage_key` from `keyed_state.KeyedState`
(re-exported here: callers import from this module only).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtier.manager.core import native
from kvtier.manager.core.cache import CacheCore
from kvtier.manager.core.hooks import RequestState, StorageHooks
from kvtier.manager.core.nodes import (
    ENGINE_READ,
    ENGINE_WRITE,
    FROM_STORAGE,
    PREFETCHING,
    STORED,
    Node,
)
from kvtier.manager.errors import InvalidRequestError, KvtierError
from kvtier.manager.keyed_events import TierEvent, TierEventLog
from kvtier.manager.keyed_state import Lookup as Lookup
from kvtier.manager.keyed_state import Owner as Owner
from kvtier.manager.keyed_state import _Query
from kvtier.manager.keyed_state import engine_key as engine_key
from kvtier.manager.keyed_steering import KeyedSteering
from kvtier.manager.tenants import DEFAULT_TENANT, TenantBook

_monotonic = time.monotonic
# How long a lookup waits for a storage answer about a block storage's index does not list,
# while that index is incomplete (see the module docstring).
UNLISTED_WAIT_S = 0.25


@dataclass(slots=True)
class StorePlan:
    """`prepare_store`'s answer: which keys to copy into which host blocks. Keys already
    cached (or being stored) are left out; `evicted` counts host copies made room for."""

    keys: list[bytes]
    host_ids: list[int]
    evicted: int
    # the hashes of the evicted copies that were reported servable (tier events on)
    evicted_hashes: list[bytes] = field(default_factory=list)


_REASON_RE = re.compile(r"[a-z0-9_]{1,32}")


@dataclass(frozen=True, slots=True)
class Removal:
    """`KeyedHostCache.remove`'s answer: the reason, the distinct blocks named, the host
    copies taken out of the tree, the storage pages whose deletion was sent to every rank
    (0 without a storage tier) and, when it was waited for and answered, the pages every
    rank deleted (None: not waited for, or not answered in time: it goes on)."""

    reason: str
    blocks: int
    host: int
    storage_asked: int
    storage_deleted: int | None


def _check_hash(block_hash: object) -> None:
    if not isinstance(block_hash, bytes) or not block_hash:
        raise InvalidRequestError(
            f"block hash {block_hash!r}: must be non-empty bytes (the engine's block hash)")


class KeyedHostCache(KeyedSteering):
    """Host and storage tiers addressed by an engine's chained block hashes (see the module
    docstring for the life cycle, data structures and invariants).

    `namespace` is mixed into every storage key: two engines share stored pages exactly when
    their namespaces (model, dtype, layout, parallelism, hash seed) are equal. `host_ready`
    says whether the host pools can be used now (every rank's worker is up); while it is
    False every lookup misses and nothing is stored.
    """

    def __init__(self, manager: CacheCore, storage: StorageHooks | None, *,
                 namespace: bytes, host_ready: Callable[[], bool] = lambda: True) -> None:
        if manager.host_capacity == 0:
            raise InvalidRequestError(
                "cache.host_blocks: the key-addressed surface needs a host tier (> 0 blocks)")
        self.m = manager
        self.storage = storage
        self.block_size = manager.block_size
        self.namespace = namespace
        self.host_ready = host_ready
        self._lock: threading.RLock = manager.lock
        self._writers: dict[tuple[Owner, bytes], Node] = {}
        self._readers: dict[tuple[Owner, bytes], list[Node]] = {}
        # (owner, hash) -> loads completed while its open loads read more than one node
        self._done_unmatched: dict[tuple[Owner, bytes], int] = {}
        self._reads: dict[Node, int] = {}
        self._abandoned: list[Node] = []
        # request -> block hash -> (the latest query that covered it, its index there)
        self._queries: dict[str, dict[bytes, tuple[_Query, int]]] = {}
        self._open_queries = 0  # queries asked and not answered yet
        self._asked: set[str] = set()  # requests counted in lookup_tokens (`count_asked`)
        self.counters = dict.fromkeys((
            "stores_prepared", "stores_completed", "stores_failed",
            "stores_refused", "loads_prepared", "loads_completed", "storage_queries",
            "storage_index_misses", "evicted_by_engine"), 0)
        # reason -> [host copies removed, storage pages asked to delete] (`remove`)
        self.removals: dict[str, list[int]] = {}
        # tier events for routers (`enable_events`): None while nobody takes them
        self.events: TierEventLog | None = None
        # tenants, quotas and retention of the host copies (issue 36)
        self.tenants = TenantBook(manager)
        if storage is not None:  # a page the worker deleted by itself keeps no mark here
            storage.on_pages_gone = self.tenants.storage_marks.forget

    # ------------------------------------------------------------------ lookups

    def lookup(self, block_hash: bytes, request_id: str = "",
               following: Sequence[bytes] = (), *,
               threshold_tokens: int | None = None) -> Lookup:
        """Is this block on the host and ready? On a miss with a storage tier, the block and
        `following` (the hashes a hit on this block is worth most with, in the order storage
        should count them: the request's next blocks for a prefix, the window's earlier ones
        for a sliding window) are asked of storage once per request; the answer may start a
        prefetch (then the block is PENDING). `threshold_tokens` overrides the storage tier's
        prefetch threshold for that query."""
        if type(block_hash) is not bytes or not block_hash:
            _check_hash(block_hash)
        with self._lock:
            if not self.host_ready():
                return Lookup.MISS
            node = self.m.lookup(engine_key(block_hash))
            if node is not None and node.host is not None:
                if node.flags & (ENGINE_WRITE | PREFETCHING):
                    return Lookup.PENDING
                return Lookup.HIT
            if self.storage is None or not request_id:
                return Lookup.MISS
            asked = self._queries.get(request_id)
            if asked is None:
                asked = self._queries[request_id] = {}
            seen = asked.get(block_hash)
            alone = False
            if seen is not None:
                q, i = seen
                if not q.done:
                    # listed in storage's index: worth waiting for; otherwise this request
                    # had its one step and is computed (the answer may serve later ones)
                    return Lookup.RETRY if _monotonic() < q.wait_until else Lookup.MISS
                # Answered. From this block (a prefetch that was not worth it, or landed and
                # was consumed), or the first block storage lacked: a miss. Held but not on
                # the host (the prefetch was capped by prefetch_host_blocks_limit): asked
                # again from this block, with the blocks after it. Past the first block
                # storage lacked (storage counts leading blocks, so unknown): asked again,
                # alone, so that every such block of a pass is settled by the next answer
                # (a window looked up backwards over blocks storage lacks settles in two
                # answers, not one answer per block). A block asked from itself is answered
                # for good, so this ends.
                if i == 0 or i == q.found:
                    return Lookup.MISS
                alone = i > q.found
            # `following` is read only here: an engine may hand a lazy sequence
            q = _Query([block_hash] if alone else [block_hash, *following])
            for i, h in enumerate(q.keys):
                asked[h] = (q, i)
            threshold = (self.storage.threshold_tokens if threshold_tokens is None
                         else threshold_tokens)
            if len(q.keys) * self.block_size < threshold:
                q.answer(0)  # no answer could start a prefetch: nothing to ask
                return Lookup.MISS
            return Lookup.RETRY if self._query(q, threshold_tokens) else Lookup.MISS

    def from_storage(self, block_hash: bytes) -> bool:
        """Whether this block's host copy came from storage and was not loaded since."""
        with self._lock:
            node = self.m.lookup(engine_key(block_hash))
            return node is not None and bool(node.flags & FROM_STORAGE)

    def count_hits(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` are on the host and ready (one lock for all:
        the batch form of `lookup`, without storage queries)."""
        with self._lock:
            if not self.host_ready():
                return 0
            return native.keyed_hits(self.m.tree_map, hashes, ENGINE_WRITE | PREFETCHING)

    def _query(self, q: _Query, threshold_tokens: int | None = None) -> bool:
        """Ask storage about `q`'s blocks (True), or answer it at once, not held (False),
        when storage's complete index does not list its first block (storage counts leading
        blocks, so the answer could only be 0) or storage reads are slow (back-pressure:
        `StorageTier.reads_skipped`, a recompute rather than a wait). The one lookup a second
        that probes a slow store asks it in the background and is answered not held at once
        (False): its answer moves the latency average and may still prefetch the pages for
        later requests, but this request does not wait on the store it found slow (it did:
        measured on vLLM with 300 ms per storage read, below)."""
        assert self.storage is not None
        probe = self.storage.reads_slow()
        if self.storage.reads_skipped():
            q.answer(0)
            return False
        first = self.storage_key(q.keys[0])
        listed = self.storage.holds(first)
        if not listed and self.storage.index_complete():
            q.answer(0)
            self.counters["storage_index_misses"] += 1
            return False
        req = RequestState([engine_key(h) for h in q.keys], None)
        req.skeys = [first, *(self.storage_key(h) for h in q.keys[1:])]
        # Listed in storage's index (listed, written or found here): worth waiting for, up to
        # the transfer timeout. Not listed while the index is incomplete: pages another
        # instance or an earlier process wrote are found only by asking, and a healthy file
        # or Redis store answers in milliseconds, so a short grace lets a restarted engine
        # find them at once, while a slow or backed-up store costs a request it cannot serve
        # at most the grace (was: unbounded RETRY, 37.8 engine steps on average in issue 25's
        # measurement).
        wait = self.m.transfer_timeout_s if listed else UNLISTED_WAIT_S
        q.wait_until = _monotonic() + wait
        if self.events is not None:
            for k, h in zip(req.keys, q.keys, strict=True):
                self.events.name(k, h)
        self.counters["storage_queries"] += 1
        self._open_queries += 1

        def answered(found: int) -> None:
            self._open_queries -= 1
            if not probe:
                q.answer(found)

        events, keys = self.events, req.keys

        def lacking(i: int) -> None:  # a page reported stored is gone (a TTL, lost)
            if events is not None:
                events.storage_lacks(keys[i], self.m.lookup(keys[i]))

        q.seq = self.storage.query(req, None, 0, len(q.keys), on_answer=answered,
                                   threshold_tokens=threshold_tokens, on_lacking=lacking)
        self.m.flush()
        if probe:
            q.answer(0)  # a probe: this request recomputes, the answer serves later ones
            return False
        return True

    def count_asked(self, request_id: str, blocks: int | Callable[[], int]) -> None:
        """The engine asks about `blocks` blocks of a request, those past its own device hits:
        counted once per request as the manager's lookup tokens (the denominator of kvtier's
        hit rates, in /status and for `kvtier_lookup_tokens_total`; the engine's device hits
        are not kvtier's to see, so they are in neither part of the rate)."""
        with self._lock:
            if request_id in self._asked:
                return
            self._asked.add(request_id)
            n = blocks() if callable(blocks) else blocks  # worked out once per request
            self.m.counters.requests += 1
            self.m.counters.lookup_tokens += n * self.block_size

    def forget_request(self, request_id: str) -> None:
        """The engine is done with a request: drop its storage query record."""
        with self._lock:
            self._queries.pop(request_id, None)
            self._asked.discard(request_id)

    def pending_work(self) -> bool:
        """True while a storage query or prefetch is in flight (the engine should keep
        stepping so a deferred lookup is asked again)."""
        with self._lock:
            if self._open_queries > 0:
                return True
            return self.storage is not None and self.storage.prefetching_blocks > 0

    # ------------------------------------------------------------------ loads

    def prepare_load(self, hashes: Sequence[bytes],
                     count_tokens: Sequence[bool] | None = None,
                     from_storage: list[bool] | None = None, *,
                     owner: Owner = None) -> list[int]:
        """Host block ids of these blocks, protected from eviction until `complete_load`.
        Every block must be a HIT now; all or nothing. `count_tokens[i]` says whether block i
        adds its tokens to the hit counters (default: every block). An engine with several
        KV cache groups loads one block per group for the same tokens and counts one group.
        `from_storage`, when given, gets one flag per block: whether this load is its first
        hit since it came from storage (what the hit counters count it as; the flag on the
        node is cleared here). The loads are `owner`'s: only its `complete_load` ends them."""
        if count_tokens is not None and len(count_tokens) != len(hashes):
            raise InvalidRequestError(
                f"prepare_load: {len(count_tokens)} count_tokens flags for {len(hashes)} "
                "blocks")
        with self._lock:
            nodes: list[Node] = []
            for h in hashes:
                node = self.m.lookup(engine_key(h))
                if (node is None or node.host is None
                        or node.flags & (ENGINE_WRITE | PREFETCHING)):
                    raise InvalidRequestError(
                        f"prepare_load: block {h[:8].hex()}… is not on the host and ready "
                        f"({len(nodes)} of {len(hashes)} blocks were)")
                nodes.append(node)
            now = _monotonic()
            ids: list[int] = []
            for j, (h, node) in enumerate(zip(hashes, nodes, strict=True)):
                n = self._reads.get(node, 0)
                self._reads[node] = n + 1
                self._readers.setdefault((owner, h), []).append(node)
                tokens = self.block_size if count_tokens is None or count_tokens[j] else 0
                stored = self.m.start_engine_read(node, not n, tokens, now)
                self.tenants.hit(node.key, tokens)  # type: ignore[arg-type]
                if from_storage is not None:
                    from_storage.append(stored)
                ids.append(node.host)  # type: ignore[arg-type]
            self.counters["loads_prepared"] += len(ids)
            if self.storage is not None and self.storage.write_policy.hit_threshold:
                self.storage.on_hits(nodes)  # write_through_selective: now hot enough
                self.m.flush()
            return ids

    def complete_load(self, hashes: Sequence[bytes], *, owner: Owner = None) -> None:
        """The engine `owner` finished copying these blocks (prepared by its `prepare_load`;
        another owner's loads of the same hashes are not touched).

        A completion names a hash, not a load. While every open load of the hash (of this
        owner) reads one node, which load finished does not matter. After a kvtier reset the
        open loads of a hash may read two nodes (the detached one of a load prepared before
        the reset, and the node stored since): then no completion can be told apart, and
        releasing either node early would free or make evictable a block a copy still reads.
        So all of them are held until every open load of that hash has completed
        (`_done_unmatched`), then released together; a hash loaded without pause after such
        a reset keeps its old block until the loads pause (a held block, never a wrong one)."""
        with self._lock:
            for h in hashes:
                rk = (owner, h)
                fifo = self._readers.get(rk)
                if not fifo:
                    continue  # not ours (another engine's, or prepared before our reset)
                first = fifo[0]
                if all(n is first for n in fifo) and rk not in self._done_unmatched:
                    self._finish_read(rk, fifo, 1)
                    continue
                done = self._done_unmatched.get(rk, 0) + 1
                if done < len(fifo):
                    self._done_unmatched[rk] = done
                    continue
                self._done_unmatched.pop(rk, None)
                self._finish_read(rk, fifo, len(fifo))

    def _finish_read(self, rk: tuple[Owner, bytes], fifo: list[Node], k: int) -> None:
        """Take the first `k` loads of `rk` (owner, hash) off its readers list; a node none of them
        reads any more is readable and evictable again (the core's transition)."""
        for node in fifo[:k]:
            n = self._reads[node] - 1
            if n:
                self._reads[node] = n
                continue
            del self._reads[node]
            self.m.finish_engine_read(node)
            self.counters["loads_completed"] += 1
        del fifo[:k]
        if not fifo:
            del self._readers[rk]

    def touch(self, hashes: Sequence[bytes]) -> None:
        """Mark these blocks recently used (the engine hit them in its own device cache)."""
        with self._lock:
            now = _monotonic()
            for h in hashes:
                key = engine_key(h)
                node = self.m.lookup(key)
                if node is not None and node.host is not None:
                    self.m.touch_host_copy(node, now)
                    self.tenants.hit(key, 0)

    # ------------------------------------------------------------------ stores

    def prepare_store(self, hashes: Sequence[bytes], *, owner: Owner = None,
                      tenant: str = DEFAULT_TENANT) -> StorePlan | None:
        """Host blocks for the blocks not cached yet, taken from the free list or by evicting
        the least recently used host copies; the open stores are `owner`'s (only its
        `complete_store` / `abandon_stores` end them).

        Atomic: None is returned, and then nothing changed (no copy evicted, no block
        taken, nothing marked), when the host tier cannot take them all now (fewer free
        blocks plus evictable host copies than blocks to store: copies being copied,
        loaded, backed up or prefetched are not evictable) or the host pools are not up.
        Capacity is counted before anything is evicted (issue 34: a store of quota + 1
        blocks, refused, had evicted the namespace's copies as it went). Under the
        write_back policy a refusal may start writing the oldest unwritten copies to storage
        (they stay cached and servable; written, they can make room for a later store).

        The copies are `tenant`'s (`kvtier.manager.tenants`): past its quota it evicts its
        own copies first; a copy of another tenant within an explicit quota is never taken
        (the store is refused instead)."""
        with self._lock:
            if not self.host_ready():
                self.counters["stores_refused"] += 1
                return None
            m = self.m
            todo: list[bytes] = []
            seen: set[bytes] = set()
            writers = self._writers
            for h in hashes:
                _check_hash(h)
                # Left out too: a key whose store by this owner, prepared before a reset
                # detached its node, is still open. Completions name only hashes and an
                # engine may complete its stores in any order, so a second open store of the
                # key would let one store's outcome land on the other's node (a failure
                # freeing a block still being copied, a success publishing the failed copy's
                # bytes). Another owner's detached store does not stand in the way: its
                # completions are told apart by owner.
                if (h in seen or (owner, h) in writers
                        or m.lookup(engine_key(h)) is not None):
                    continue
                seen.add(h)
                todo.append(h)
            if not todo:
                return StorePlan([], [], 0)
            now = _monotonic()
            book = self.tenants
            book.expire(now)
            t = book.tenant(tenant)
            # the tenant's own copies past its quota, then copies of priority < 0, then the
            # namespace's order (read before anything is evicted: too few, nothing changes)
            own = book.own_victims(t, len(todo))
            if own is None:
                t.stores_refused += 1
                self.counters["stores_refused"] += 1
                return None
            free_before = m.host_free
            short = len(todo) - free_before - len(own)
            picked = {id(n) for n in own}
            if short > 0:
                low = [n for n in book.low_priority_victims(short + len(own), t)
                       if id(n) not in picked][:short]
                own += low
                picked.update(id(n) for n in low)
                short -= len(low)
            # (an O(1) bound first: a store larger than the tier is refused at once)
            victims = ([k for k in m.host_victims(short + len(own))
                        if id(m.lookup(k)) not in picked][:short]
                       if 0 < short <= m.host_evictable - len(own) else [])
            if len(victims) < short or book.victims_of_others(victims, t):
                if len(victims) < short:
                    m.write_back_for_room()  # write_back: unwritten copies written
                    m.flush()
                t.stores_refused += 1
                self.counters["stores_refused"] += 1
                return None
            chosen = [*victims, *(n.key for n in own if n.key is not None)]
            stored = ([] if self.events is None else
                      [k for k in chosen
                       for n in (m.lookup(k),) if n is not None and n.flags & STORED])
            own_evicted = book.evict(own)
            free_before = m.host_free
            taken: list[int] = []
            for _ in todo:
                hb = m.take_host_block()
                if hb is None:  # not reached: host_victims counted every block taken
                    m.give_host_blocks(taken)
                    self.counters["stores_refused"] += 1
                    return None
                taken.append(hb)
            evicted = max(0, len(taken) - free_before) + len(own_evicted)
            book.evicted_by_order(victims)
            storage = self.storage
            events = self.events
            evicted_hashes = ([] if events is None else
                              events.evicted([*victims, *own_evicted], stored))
            for h, hb in zip(todo, taken, strict=True):
                key = engine_key(h)
                node = m.start_engine_write(
                    key, hb, None if storage is None else self.storage_key(h), now)
                writers[(owner, h)] = node
                book.stored(key, node, tenant, now)
                if storage is not None:
                    book.stored_pages.add(h, tenant)
                if events is not None:
                    events.name(key, h)
            self.counters["stores_prepared"] += len(todo)
            return StorePlan(todo, taken, evicted, evicted_hashes)

    def complete_store(self, hashes: Sequence[bytes], ok: bool = True, *,
                       owner: Owner = None) -> None:
        """The engine `owner` finished (ok) or gave up copying these blocks into the host
        blocks that its `prepare_store` gave. A hash with no open store of `owner`'s is
        ignored (already complete, abandoned, or another engine's store: never ended by
        this one). Ready blocks are backed up to storage when one is configured."""
        with self._lock:
            landed: list[Node] = []
            writers = self._writers
            book = self.tenants
            now = _monotonic()
            for h in hashes:
                node = writers.pop((owner, h), None)
                if node is None:
                    continue
                key = node.key
                if self.m.finish_engine_write(node, ok):
                    landed.append(node)
                    self.counters["stores_completed"] += 1
                    if key is not None:
                        book.landed(key, now)
                else:
                    self.counters["stores_failed"] += 1
                    if key is not None:
                        book.forget(key)
            if landed and self.storage is not None:
                self.storage.backup(landed)
            self.m.flush()

    def open_store_pages(self, hashes: Sequence[bytes], *,
                         owner: Owner = None) -> list[tuple[bytes, int, bytes | None]]:
        """(hash, host block, storage key) of `owner`'s open stores among `hashes`: blocks
        nothing else writes, evicts or frees until their completion (the node service's
        crash journal checksums them before completing them, issue 37)."""
        with self._lock:
            out = []
            for h in hashes:
                node = self._writers.get((owner, h))
                if node is not None and node.host is not None:
                    out.append((h, node.host, node.skey))
            return out

    # ------------------------------------------------------------------ tier events

    def enable_events(self) -> None:
        """Keep the tier events (`kvtier.manager.keyed_events`) from now on; blocks cached
        before are announced by the first `take_events`, once named again."""
        with self._lock:
            if self.events is None:
                self.events = TierEventLog()

    def take_events(self) -> list[TierEvent]:
        """The tier events since the last call (reconciled with the tree now); [] when
        events are off."""
        with self._lock:
            events = self.events
            if events is None:
                return []
            events.sweep(self.m.cached_nodes(), self.m.counters.storage_forgotten)
            return events.take()

    def take_events_and_state(self, state: bool
                              ) -> tuple[list[TierEvent], tuple[list[bytes], list[bytes]] | None]:
        """`take_events()`, and with `state` the blocks reported servable in the host tier
        and in storage right after it (under one lock hold: the events taken so far add up
        to exactly that state). Events must be on."""
        with self._lock:
            events = self.events
            if events is None:
                raise KvtierError("tier events are off (enable_events first)")
            events.sweep(self.m.cached_nodes(), self.m.counters.storage_forgotten)
            taken = events.take()
            if not state:
                return taken, None
            return taken, (list(events.host.values()), list(events.storage.values()))

    def remove(self, hashes: Sequence[bytes], *, reason: str,
               wait_s: float = 0.0) -> Removal:
        """Remove these blocks from every tier of this node: the host copy leaves the tree
        now (the core's `write_off`: a copy a transfer or an engine copy still uses keeps
        its block until that ends, never served again), the storage page is deleted on every
        rank (a DELETE task behind the backups sent before it, so a page being written now
        is deleted after it lands), and, with tier events on, each removal is announced at
        once (host and storage, where the block was reported). The page is deleted whether
        or not a host copy is held (another process may have written it).

        The one named operation for "this block must not be served here again": the sampled
        audit's mismatch (`kvtier.engine.audit`), an operator's clear. `reason` (a short
        identifier, e.g. "audit_mismatch") is counted in `removals`. `wait_s` > 0 waits that
        long for the storage deletion (the lock is released meanwhile); 0 returns at once
        (an engine's scheduler thread must not wait on storage). Every hash is checked
        before anything changes: bad input raises InvalidRequestError and removes nothing."""
        if not isinstance(reason, str) or not _REASON_RE.fullmatch(reason):
            raise InvalidRequestError(
                f"removal reason {reason!r}: must be 1 to 32 characters of a-z, 0-9 and '_'")
        if isinstance(hashes, bytes | bytearray | str):
            raise InvalidRequestError("remove takes a list of block hashes, not one hash")
        todo = list(dict.fromkeys(hashes))
        for h in todo:
            _check_hash(h)
        with self._lock:
            host = 0
            named: list[tuple[int, bytes]] = []
            for h in todo:
                key = engine_key(h)
                node = self.m.lookup(key)
                if node is not None:
                    self.tenants.forget(key)
                    self.m.write_off(node)
                    host += 1
                named.append((key, h))
            if self.events is not None:
                self.events.removed(named)
            asked = 0
            deleted: int | None = 0
            storage = self.storage
            if storage is not None and todo:
                asked = len(todo)
                deleted = storage.delete([self.storage_key(h) for h in todo], wait_s)
            counts = self.removals.setdefault(reason, [0, 0])
            counts[0] += host
            counts[1] += asked
            self.counters["evicted_by_engine"] += host
            self.m.flush()
            return Removal(reason, len(todo), host, asked, deleted)

    # ------------------------------------------------------------------ engine resets

    def abandon_engine_io(self, owner: Owner = None) -> list[Node]:
        """The engine `owner` reset its own bookkeeping and will never complete the copies
        it has prepared (vLLM's `reset_prefix_cache`). Their records are dropped (another
        owner's are kept); the nodes stay marked (their host blocks stay out of the free
        list: a deferred copy may still run) until `release_abandoned` is given them, once
        the engine can no longer run one. A node another owner still reads stays marked
        read for it and is not returned."""
        with self._lock:
            writers = self._writers
            nodes = [writers.pop(wk) for wk in [wk for wk in writers if wk[0] == owner]]
            for rk in [rk for rk in self._readers if rk[0] == owner]:
                self._done_unmatched.pop(rk, None)
                for node in self._readers.pop(rk):
                    n = self._reads[node] - 1
                    if n:
                        self._reads[node] = n
                    else:
                        del self._reads[node]
                        nodes.append(node)
            self._abandoned.extend(nodes)
            return nodes

    def abandon_stores(self, hashes: Sequence[bytes], *, owner: Owner = None) -> list[Node]:
        """The engine `owner` died with these stores prepared and not completed: like
        `abandon_engine_io`, for those copies only (a hash with no open store of `owner`'s
        is left alone: another engine's store of it goes on). The nodes stay marked (never
        served) until `release_abandoned`."""
        with self._lock:
            nodes: list[Node] = []
            writers = self._writers
            for h in hashes:
                node = writers.pop((owner, h), None)
                if node is not None:
                    nodes.append(node)
            self._abandoned.extend(nodes)
            return nodes

    def adopt_abandoned(self, pages: Sequence[tuple[int, int]]) -> list[Node]:
        """A predecessor's abandoned stores still held at its hand-over (tree key, host
        block): nodes marked as written (never served, their blocks out of the free list)
        until `release_abandoned` is given them. All or nothing (KvtierError)."""
        with self._lock:
            nodes = self.m.adopt_abandoned_writes(pages, _monotonic())
            self._abandoned.extend(nodes)
            return nodes

    def abandoned_pages(self, nodes: Sequence[Node]) -> list[tuple[int, int]]:
        """(tree key, host block) of those abandoned nodes whose store is still marked
        written (its page may yet receive the engine's late copy): what a node service's
        hand-over carries (issue 37)."""
        with self._lock:
            return [(n.key, n.host) for n in nodes if n.key is not None
                    and n.host is not None and not self.m.host_copy_ready(n)]

    def release_abandoned(self, nodes: list[Node]) -> None:
        """Give back the host blocks of nodes `abandon_engine_io` returned (never served:
        a store that was abandoned is dropped, not made readable). A node an abandoned load
        read that another engine's load reads now (or read and ended since) is that load's:
        left as it is."""
        with self._lock:
            for node in nodes:
                self._abandoned.remove(node)
                if node in self._reads or not node.flags & (ENGINE_READ | ENGINE_WRITE):
                    continue
                self.m.drop_engine_io(node)

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert this surface's invariants (tests call it after every step), then the
        manager's."""
        with self._lock:
            writing = list(self._writers.values())
            assert len(writing) == len({id(n) for n in writing}), "a node written twice"
            for n in writing:
                assert n.flags & ENGINE_WRITE and n.hprev is None, f"writer {n} misflagged"
            count: dict[int, int] = {}
            for fifo in self._readers.values():
                for n in fifo:
                    count[id(n)] = count.get(id(n), 0) + 1
            for n, c in self._reads.items():
                assert c > 0 and count.get(id(n)) == c, f"reader count of {n} is off"
                assert n.flags & ENGINE_READ and n.hprev is None, f"reader {n} misflagged"
            assert len(count) == len(self._reads)
            for rk, done in self._done_unmatched.items():
                assert 0 < done < len(self._readers.get(rk, ())), (
                    f"{rk[1][:8].hex()}: {done} done")
            abandoned = {id(n) for n in self._abandoned}
            for n in self.m.cached_nodes():
                if n.flags & ENGINE_READ:
                    assert n in self._reads or id(n) in abandoned, f"{n} read with no load"
                if n.flags & ENGINE_WRITE:
                    assert any(n is w for w in writing) or id(n) in abandoned, (
                        f"{n} marked written with no store")
        self.m.check_invariants()
