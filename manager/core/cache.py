"""`CacheCore`: the one owner of the cache's state, and every transition that changes it.

The core holds the tree map, both tiers' free lists, the LRU lists of evictable nodes, the
pins, the written-off nodes, the counters and the task ledger, and offers the named
transitions of the node state diagram (`kvtier.manager.core.nodes`). Its clients, none of
which imports another, only ask for those transitions:

* the scheduler API (`kvtier.manager.scheduler.KVCacheManager`, a subclass that adds the
  request table and the match / allocate / commit / release calls: its hot paths read the
  core's attributes flat, `self._map`, `self._dev_lru`, as they always did);
* the storage tier (`kvtier.manager.storage_tier.StorageTier`): prefetch and storage-backup
  transitions, host blocks, task tracking;
* the key-addressed surface (`kvtier.manager.keyed.KeyedHostCache`): engine read and write
  transitions.

Every call expects the lock held (`lock`), except `lock`, `check_invariants` and the
read-only properties. Block ownership (the invariant `check_invariants` asserts): each block
id of a tier is exactly one of free (in the pool), held by the tree (a node in the map has
it), or owned by a request (allocated to it and not in the tree, held by a detached node, or
by a written-off node until its transfer is answered).

One owner, several files: `CacheCore` is one object, and its transitions are methods of it,
written by family in the modules of this package it inherits (plain methods, no delegate
objects: a hot path's `self.relist(node)` costs what it did when all lived here):

* `state.py`, `CoreState`: the attributes `CacheCore.__init__` sets (declared there for every
  family), `Counters`, the lock and `wait_unlocked`, and the primitives every family uses:
  LRU membership (`relist`, `relist_tail`, `after_transfer`, `_forget`, `_settle`), host
  copies freed or dropped, `_new_host_node`;
* `host_tier.py`, `HostTier`: taking a host block (host eviction, its strategy, the
  write_back batches), `host_victims`, `give_host_blocks`;
* `eviction.py`, `DeviceEviction`: making device room (`_room_for`, `_make_room`,
  `_await_room`, `_evict_device`, the device strategy's victims, `policy_released`);
* `storage_io.py`, `StorageTransitions`: D2H backups (`_backup`, `backup_hot`), prefetch,
  storage backup, `forget_stored`;
* `engine_io.py`, `EngineTransitions`: the key-addressed surface's engine reads and writes,
  host copies touched, listed and adopted across a node service's hand-over;
* `recovery.py`, `Recovery`: clearing the tree (`_clear_all`, `_rebuild_pools`), writing
  nodes off, engine-KV confirmation and the loss of the device memory;
* here: the constructor, reads and task tracking for clients, the match, pin, host-retention
  and commit transitions, the ledger's completions, `check_invariants`.

The state machine these transitions implement is drawn in `kvtier.manager.core.nodes`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable

from kvtier.manager.core import native
from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.core.engine_io import EngineTransitions
from kvtier.manager.core.eviction import DeviceEviction
from kvtier.manager.core.hooks import OnDone, RequestState
from kvtier.manager.core.invariants import check_ownership
from kvtier.manager.core.ledger import Inflight, TaskLedger
from kvtier.manager.core.nodes import (
    BACKING,
    CANCEL_EVICT,
    ENGINE_WRITE,
    EVICTING,
    FROM_STORAGE,
    HOST_BUSY,
    IN_FLIGHT,
    LOADING,
    PINNED,
    PREFETCHING,
    SAVING,
    STORED,
    DeviceLRU,
    HostLRU,
    Node,
)
from kvtier.manager.core.recovery import Recovery
from kvtier.manager.core.state import TREE_CLEARED, TREE_CLEARING, TREE_NORMAL, Counters
from kvtier.manager.core.storage_io import StorageTransitions
from kvtier.manager.policies import WritePolicy, make_eviction_policy
from kvtier.manager.transfers import Dispatcher, ImmediateDispatcher
from kvtier.worker.wire import Completion, Priority, Task, TaskKind

# Re-exported: the scheduler API and the stack read them from here.
__all__ = ["TREE_CLEARED", "TREE_CLEARING", "TREE_NORMAL", "CacheCore", "Counters"]


class CacheCore(EngineTransitions, StorageTransitions, DeviceEviction, Recovery):
    """The prefix tree, free lists, LRU lists, counters and tasks of one deployment's device
    and host tiers (see the module docstring).

    Data structures:
      * `_map`: tree key (int) -> Node, the whole prefix tree (keys are chained): a dict, or
        the compiled `KeyMap` with compiled nodes (see manager.core.native).
      * `_dev_pool` / `_host_pool`: BlockPool free lists of each tier.
      * `_dev_lru` / `_host_lru`: intrusive LRU lists of evictable nodes (manager.core.nodes).
      * `_dev_in_tree` / `_host_in_tree`: blocks of each tier the tree holds.
      * `_pins`: node -> pin count (admin pins; a pinned node is never evicted).
      * `_written_off`: nodes out of the tree whose blocks a transfer in flight still uses.
      * `_unconfirmed`: engine-KV host copies waiting for a registration check.
      * `ledger`: the tasks in flight (`TaskLedger`), answered through `_on_complete`.

    Invariants: see `check_invariants` (block ownership, LRU membership = evictable, the
    in-tree counters, pins, every in-flight flag backed by a task in the ledger).

    Its transitions come by family from the classes it inherits (`EngineTransitions`,
    `StorageTransitions`, `DeviceEviction` over `HostTier`, `Recovery`, all over `CoreState`,
    which declares the attributes set here): see the module docstring for which lives where.
    """

    def __init__(self, *, block_size: int, device_blocks: int, host_blocks: int,
                 policy: WritePolicy, dispatcher: Dispatcher | None, page_bytes: int,
                 transfer_timeout_s: float, eviction_policy: str = "lru",
                 host_eviction_policy: str = "lru") -> None:
        self.block_size = block_size  # tokens per block
        # Device eviction order: None is LRU, the intrusive list's own order (compiled);
        # otherwise a strategy (manager.policies) that picks victims among that list's nodes.
        self.eviction_policy = eviction_policy
        self._evict = make_eviction_policy(eviction_policy, device_blocks)
        # Host eviction order: None is LRU (the host list's own order), else a strategy over
        # that list's nodes (not consulted under storage write_back: its batches follow the
        # list; the configuration refuses the pair).
        self.host_eviction_policy = host_eviction_policy
        self._host_evict = make_eviction_policy(
            host_eviction_policy, host_blocks, "host", "cache.host_eviction_policy")
        self.page_bytes = page_bytes  # bytes of one block on one rank
        self.transfer_timeout_s = transfer_timeout_s
        self.policy = policy
        self._dev_pool = BlockPool("device", device_blocks)
        self._host_pool = BlockPool("host", host_blocks)
        # The tree map, node classes and per-block loops, compiled or pure Python, fixed for
        # this core's lifetime (see manager.core.native): nodes and maps of one kind only ever
        # meet loops of the same kind.
        self._loops = loops = native.bound()
        self._dev_lru = DeviceLRU(loops.node_class)
        # Device-only deployments use the leaner node (no host links, no storage key). The
        # core handles it as a Node (same attributes, host ones class constants). The narrow
        # ignores on the hot paths stand for what the types cannot say without a per-block
        # check: a node linked in an LRU list has its `dev` (or `host`) and links.
        self._node_cls = loops.node_class if host_blocks else loops.device_node_class
        self._host_lru = HostLRU(loops.node_class)
        # Sized for the most nodes the tree can hold (each holds a block of its own), so the
        # compiled map never grows while serving: no resize pause at 10M blocks.
        self._map = loops.new_tree(device_blocks + host_blocks)
        self._pins = {}
        # Nodes that left the tree (worker lost) while a transfer still used their blocks:
        # the blocks return to the free lists when the last rank has answered.
        self._written_off = set()
        # Engine KV (`track_device_copies`): host copies whose D2H completed after the last
        # registration check that confirmed the device memory they were read from, as
        # (completion number, node, host block); trusted, and backed up to storage, only
        # once `confirm_device_copies` covers them, dropped by `lose_device`.
        self.track_device_copies = False
        self._unconfirmed = deque()
        self._d2h_done = 0
        self._lock = threading.RLock()
        self.dispatcher = dispatcher or ImmediateDispatcher()
        self.ledger = TaskLedger(self.dispatcher, {TaskKind.H2D: self._finish_load,
                                                   TaskKind.D2H: self._finish_d2h})
        self.dispatcher.bind(self._on_complete)
        self.counters = Counters()
        self.tree_status = TREE_NORMAL
        self._dev_in_tree = 0
        self._host_in_tree = 0
        # The storage tier, when storage is configured (handed to the constructor of the
        # scheduler API); it sees this core as its `CacheCore`.
        self.storage = None

    # ------------------------------------------------------------------ reads (clients)

    def lookup(self, key: int) -> Node | None:
        """The tree's node for `key`, or None."""
        return self._map.get(key)

    def cached_nodes(self) -> Iterable[Node]:
        """Every node of the tree (do not add or remove nodes while iterating)."""
        return self._map.values()

    @property
    def tree_map(self) -> native.TreeMap:
        """The tree map itself (key -> node; the object lives as long as the core), for the
        compiled batch lookups of `kvtier.manager.keyed` (read only)."""
        return self._map

    @property
    def host_capacity(self) -> int:
        return self._host_pool.capacity

    @property
    def host_free(self) -> int:
        return self._host_pool.num_free

    @property
    def host_evictable(self) -> int:
        """Host copies in the host LRU: at most this many can be evicted now (under
        write_back the unwritten ones are written first: `host_victims` counts exactly)."""
        return self._host_lru.size

    def host_block_is_free(self, host_id: int) -> bool:
        return self._host_pool.is_free(host_id)

    # ------------------------------------------------------------------ tasks (clients)

    def next_seq(self) -> int:
        """A fresh task sequence number."""
        return self.ledger.next_seq()

    def track(self, task: Task, nodes: list[Node], on_done: OnDone | None = None) -> None:
        """Queue a task built by a client (sent when the API call ends, or by `flush` /
        `wait_unlocked`); `on_done(ok, completion)` runs once every rank answered."""
        self.ledger.track(task, nodes, on_done)

    def flush(self) -> None:
        """Send the tasks queued so far (the scheduler API calls do it when they end)."""
        self.ledger.flush()

    def _flush(self) -> None:  # the scheduler API's spelling (its calls end with it)
        self.ledger.flush()

    @property
    def _inflight(self) -> dict[int, Inflight]:
        """The tasks in flight, seq -> record (the ledger's; read only here)."""
        return self.ledger.inflight

    # ------------------------------------------------------------------ match and pin transitions

    def hit_host_copy(self, node: Node) -> bool:
        """A match hit `node` on the host only: it starts loading (LOADING; its H2D task is
        `load_host_copies`). Returns whether its host copy came from storage (a storage hit)."""
        fl = node.flags
        node.flags = (fl | LOADING) & ~FROM_STORAGE
        if node.hprev is not None:
            self._host_lru.unlink(node)
        return bool(fl & FROM_STORAGE)

    def hit_busy_device_copy(self, node: Node) -> int | None:
        """A match hit `node` on the device while a transfer uses it: a demotion keeps the
        device copy (CANCEL_EVICT); returns the seq of the load filling it to wait for."""
        fl = node.flags
        if fl & EVICTING:
            node.flags = fl | CANCEL_EVICT
        if fl & LOADING:
            return self.ledger.loading_seq(node)
        return None

    def reference(self, node: Node, now: float) -> None:
        """A match holds `node` (the walk of plain device hits does this in one call for
        nodes with no flags, `native.walk_hits`)."""
        if node.dprev is not None:
            self._dev_lru.unlink(node)
        node.ref += 1
        node.hits += 1
        node.last = now

    def unhit(self, node: Node) -> None:
        """Undo a match's reference to `node` (the match was cut short)."""
        node.ref -= 1
        node.hits -= 1
        if node.dev is None:
            node.flags &= ~LOADING
        self.relist(node)

    def unhit_match(self, nodes: list[Node]) -> None:
        """Undo a whole match that raised after its walk (a sleep, or a timeout, while it
        waited with the lock released): each node's reference, and the LOADING flag of its
        host hits, whose H2D was never sent (`unhit`). A node a sleep (or a lost worker) wrote
        off meanwhile settles here: no answer will ever come for it, and before issue 27 it
        kept every wake refused as 'still in flight'."""
        for node in reversed(nodes):  # tail first: leaves age first
            self.unhit(node)
            if node.key is None:
                self._settle(node)

    def load_host_copies(self, nodes: list[Node], ids: list[int], first_block: int) -> int:
        """Give the host-only `nodes` (hit, LOADING) device blocks `ids` and one H2D task;
        returns its seq."""
        src: list[int] = []
        for node, dev in zip(nodes, ids, strict=True):
            node.dev = dev
            src.append(node.host)  # type: ignore[arg-type]
        self._dev_in_tree += len(nodes)
        self.counters.h2d_blocks += len(nodes)
        return self.ledger.submit(TaskKind.H2D, src, ids, nodes, Priority.LOAD, first_block)

    def pin_node(self, node: Node) -> bool:
        """Pin one cached node (a host-only one is loaded first). False when it cannot be:
        its host copy is busy, or the device has no room."""
        if node.dev is None:
            if node.host is None or node.flags & HOST_BUSY:
                return False
            if not self._room_for(1):
                return False
            node.flags |= LOADING  # keeps the host copy while room is made
            if node.hprev is not None:
                self._host_lru.unlink(node)
            self._make_room(1, "pin")
            node.dev = self._dev_pool.allocate_one()
            self._dev_in_tree += 1
            self.ledger.submit(TaskKind.H2D, [node.host], [node.dev], [node], Priority.LOAD)
            self.counters.h2d_blocks += 1
        if node.flags & EVICTING:  # a demotion in flight must keep the device copy
            node.flags |= CANCEL_EVICT
        node.flags |= PINNED
        self.relist(node)
        self._pins[node] = self._pins.get(node, 0) + 1
        return True

    def unpin_node(self, node: Node) -> bool:
        """Undo one pin of `node`; True when that was its last (relist it afterwards)."""
        left = self._pins[node] - 1
        if left:
            self._pins[node] = left
            return False
        del self._pins[node]
        node.flags &= ~PINNED
        return True

    def is_pinned(self, node: Node) -> bool:
        return node in self._pins

    # ------------------------------------------------------------------ host retention (issue 36)

    def hold_host_copy(self, node: Node) -> bool:
        """Keep `node`'s host copy in place (a tenant's pin, a TTL, a high priority:
        `kvtier.manager.tenants`): PINNED, counted in `_pins` like an admin pin, so it leaves
        the host LRU and is never evicted until `release_host_hold`. A host copy is never
        loaded to the device for it (the keyed surface has no device tier). False when the
        node holds no servable host copy."""
        if (node.key is None or node.host is None or self._map.get(node.key) is not node
                or node.flags & (ENGINE_WRITE | PREFETCHING)):
            return False
        node.flags |= PINNED
        self._pins[node] = self._pins.get(node, 0) + 1
        self.relist(node)
        return True

    def release_host_hold(self, node: Node) -> None:
        """Undo one `hold_host_copy`; at the last, the copy is evictable again (ordinary
        eviction). A node written off or cleared since lost its holds already."""
        if node in self._pins and self.unpin_node(node):
            self.relist(node)

    def evict_host_copy(self, node: Node) -> bool:
        """Evict this evictable host copy now (a tenant over its quota evicts its own blocks
        first: `kvtier.manager.tenants`), as `take_host_block` would have evicted it, its
        block back on the free list. False when it is not evictable now (held, busy, gone)."""
        if node.hprev is None or node.key is None or self._map.get(node.key) is not node:
            return False
        if node.skey is not None and not node.flags & STORED:
            self.counters.evicted_host_unstored += 1
        self._drop_host_copy(node)
        self.counters.evicted_host_drop += 1
        if node.dev is None:
            self._forget(node)
        return True

    # ------------------------------------------------------------------ commit transitions

    def attach_device_copy(self, node: Node, block: int, now: float) -> None:
        """A request computed block `block` of `node`, cached on the host only: it becomes
        the node's device copy (held by the request)."""
        node.dev = block
        node.ref += 1
        node.last = now
        self._dev_in_tree += 1
        if (self.policy.exclusive and node.host is not None
                and not node.flags & HOST_BUSY):
            self._drop_host_copy(node)

    def new_device_node(self, key: int, block: int, now: float) -> Node:
        """A new node in the tree holding device block `block`, held by one request."""
        node = self._node_cls(key, block, None, now)
        node.ref = 1
        self._map[key] = node
        return node

    def name_storage_pages(self, nodes: list[Node | None], skeys: list[bytes], start: int,
                           end: int) -> None:
        """Give the committed `nodes[start:end]` their storage keys (where they have none)."""
        for i in range(start, end):
            node = nodes[i]
            if node is not None and node.skey is None:
                node.skey = skeys[i]

    def free_detached_device(self, node: Node) -> None:
        """The last request holding detached `node` released it: its device block is free,
        unless a transfer still uses it (then `settle` frees it)."""
        if node.dev is not None and not node.flags & IN_FLIGHT:
            self._dev_pool.free_one(node.dev)
            node.dev = None

    # ------------------------------------------------------------------ completions

    def _on_complete(self, comp: Completion) -> None:
        with self._lock:
            ledger = self.ledger
            if not comp.ok and comp.seq in ledger.inflight:
                self.counters.failed_tasks += 1
            ledger.complete(comp)
            ledger.flush()

    def _finish_load(self, rec: Inflight, ok: bool, error: str = "") -> None:
        exclusive = self.policy.exclusive
        storage = self.storage
        # host hits are written once settled (write_through_selective)
        hit = (rec.nodes if ok and storage is not None and storage.write_policy.hit_threshold
               else [])
        for node in reversed(rec.nodes):  # tail first: leaves age first
            node.flags &= ~LOADING
            if ok:
                if exclusive and node.host is not None and node.key is not None:
                    self._host_pool.free_one(node.host)
                    node.host = None
                    self._host_in_tree -= 1
                self.relist(node)
                self._settle(node)
                continue
            # The device copy is garbage. Requests holding the node keep the block (they
            # recompute into it); the host copy stays cached under a fresh node.
            dev = node.dev
            node.dev = None
            if node.key is not None:
                self._dev_in_tree -= 1
            if node.ref > 0:
                if node.key is not None:
                    fresh = self._node_cls(node.key, None, node.host, node.last)
                    fresh.hits = node.hits
                    # the host copy keeps its storage name and copy (else never written)
                    fresh.skey = node.skey
                    fresh.flags = node.flags & (STORED | BACKING)
                    if node.flags & BACKING:
                        # A storage backup still reads the host copy: it goes on under the
                        # fresh node, which keeps the copy (BACKING) and is the node the task
                        # names. Left on the detached node, the flag kept its device block
                        # from the requests' release (lost to every tier) while the fresh
                        # node's copy was evictable mid-write.
                        node.flags &= ~BACKING
                        self.ledger.hand_over(node, fresh)
                    self._map[node.key] = fresh
                    if node in self._pins:
                        self._pins[fresh] = self._pins.pop(node)
                        fresh.flags |= PINNED
                    node.host = None
                    node.key = None
                    self.relist(fresh)
                node.dev = dev  # detached: owned by its requests now
                node.flags &= ~PINNED
                self.relist(node)
            else:
                self._dev_pool.free_one(dev)  # type: ignore[arg-type]
                self.relist(node)
                self._forget(node)
            self._settle(node)
        if not ok:
            for h, idx in rec.handles:
                h.note_failure(idx, error)
        rec.handles.clear()
        if hit and storage is not None:
            storage.on_hits(hit)

    def _finish_d2h(self, rec: Inflight, ok: bool, error: str = "") -> None:
        for node in rec.nodes:
            flags = node.flags
            evicting = flags & EVICTING
            node.flags = flags & ~(SAVING | EVICTING | CANCEL_EVICT)
            attached = node.key is not None
            if not ok and node.host is not None:
                self._host_pool.free_one(node.host)
                node.host = None
                self._host_in_tree -= attached
            if (evicting and not flags & (CANCEL_EVICT | PINNED) and node.ref == 0
                    and node.dev is not None):
                # The demotion landed (or failed: the block was being evicted anyway).
                self._dev_pool.free_one(node.dev)
                node.dev = None
                self._dev_in_tree -= attached
            self.relist(node)
            self._forget(node)
            self._settle(node)
        if ok and self.track_device_copies:
            # Read from the model runner's memory, which may have been replaced under the
            # task: trusted (and backed up) once a registration check confirms it.
            done = self._d2h_done
            self._d2h_done = done + 1
            for node in rec.nodes:
                if node.key is not None and node.host is not None:
                    self._unconfirmed.append((done, node, node.host))
        elif ok and self.storage is not None:
            self.storage.backup(rec.nodes)

    # ------------------------------------------------------------------ invariants

    def check_invariants(self, requests: Iterable[RequestState] = ()) -> None:
        """Assert every ownership invariant with a full scan (tests call it after every
        step); `requests`: the active requests, whose blocks are theirs."""
        with self._lock:
            check_ownership(
                self._map, ((self._dev_pool, self._dev_lru), (self._host_pool, self._host_lru)),
                requests, self._written_off, self._pins, (self._dev_in_tree, self._host_in_tree))
            self.ledger.check()
            inflight_nodes = {id(n) for r in self.ledger.inflight.values() for n in r.nodes}
            for n in self._map.values():
                if n.flags & (LOADING | SAVING | EVICTING | PREFETCHING | BACKING):
                    assert id(n) in inflight_nodes, f"{n} flagged in flight but no task"
