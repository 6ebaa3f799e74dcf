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
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import compress

from kvtier.manager.core import native
from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.core.hooks import OnDone, RequestState, StorageHooks
from kvtier.manager.core.invariants import check_ownership
from kvtier.manager.core.ledger import Inflight, TaskLedger
from kvtier.manager.core.nodes import (
    BACKING,
    CANCEL_EVICT,
    DEVICE_BUSY,
    ENGINE_READ,
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
from kvtier.manager.errors import (
    InvalidRequestError,
    OutOfBlocksError,
    RequestCancelledError,
    TransferTimeoutError,
)
from kvtier.manager.policies import (
    WRITE_BACK_BATCH,
    EvictionStrategy,
    WritePolicy,
    make_eviction_policy,
)
from kvtier.manager.transfers import Dispatcher, ImmediateDispatcher
from kvtier.worker.wire import Completion, Priority, Task, TaskKind

_monotonic = time.monotonic

TREE_NORMAL, TREE_CLEARING, TREE_CLEARED = 0, 1, 2


@dataclass(slots=True)
class Counters:
    """Monotonic counters read by metrics without the lock."""

    requests: int = 0
    lookup_tokens: int = 0
    hit_device_tokens: int = 0
    hit_host_tokens: int = 0
    hit_storage_tokens: int = 0
    evicted_device_drop: int = 0
    evicted_device_demote: int = 0
    evicted_host_drop: int = 0
    d2h_blocks: int = 0
    h2d_blocks: int = 0
    failed_tasks: int = 0
    resets: int = 0
    lost_all: int = 0
    sleeps: int = 0
    lost_device: int = 0  # the device memory was replaced, host copies kept (`lose_device`)
    storage_forgotten: int = 0  # times storage was emptied (`forget_stored`)
    # host copies with a storage key evicted before storage held them (a backup skipped,
    # failed or still to come; under write_back, a batch refused or none within reach)
    evicted_host_unstored: int = 0
    # victims an eviction strategy could not name (the LRU list's oldest taken instead;
    # stays 0 while every listing reaches the strategy, which the stateful tests check)
    eviction_policy_fallbacks: int = 0


class CacheCore:
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
    """

    def __init__(self, *, block_size: int, device_blocks: int, host_blocks: int,
                 policy: WritePolicy, dispatcher: Dispatcher | None, page_bytes: int,
                 transfer_timeout_s: float, eviction_policy: str = "lru",
                 host_eviction_policy: str = "lru") -> None:
        self.block_size = block_size  # tokens per block
        # Device eviction order: None is LRU, the intrusive list's own order (compiled);
        # otherwise a strategy (manager.policies) that picks victims among that list's nodes.
        self.eviction_policy = eviction_policy
        self._evict: EvictionStrategy | None = make_eviction_policy(eviction_policy,
                                                                    device_blocks)
        # Host eviction order: None is LRU (the host list's own order), else a strategy over
        # that list's nodes (not consulted under storage write_back: its batches follow the
        # list; the configuration refuses the pair).
        self.host_eviction_policy = host_eviction_policy
        self._host_evict: EvictionStrategy | None = make_eviction_policy(
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
        self._map: native.TreeMap = loops.new_tree(device_blocks + host_blocks)
        self._pins: dict[Node, int] = {}
        # Nodes that left the tree (worker lost) while a transfer still used their blocks:
        # the blocks return to the free lists when the last rank has answered.
        self._written_off: set[Node] = set()
        # Engine KV (`track_device_copies`): host copies whose D2H completed after the last
        # registration check that confirmed the device memory they were read from, as
        # (completion number, node, host block); trusted, and backed up to storage, only
        # once `confirm_device_copies` covers them, dropped by `lose_device`.
        self.track_device_copies = False
        self._unconfirmed: deque[tuple[int, Node, int]] = deque()
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
        self.storage: StorageHooks | None = None

    # ------------------------------------------------------------------ reads (clients)

    @property
    def lock(self) -> threading.RLock:
        """The core's (reentrant) lock; every other call here expects it held."""
        return self._lock

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

    def wait_unlocked(self, seqs: list[int], timeout: float | None = None) -> None:
        """Send what is queued, then wait for tasks `seqs` with the lock released, so the
        completion thread can apply them (TransferTimeoutError after `timeout`, default
        `transfer_timeout_s`); the lock is held again on return. RequestCancelledError when a
        sleep began meanwhile."""
        self.ledger.flush()
        sleeps = self.counters.sleeps
        depth = 0
        while True:  # release however many times the calling thread holds the lock
            try:
                self._lock.release()
            except RuntimeError:
                break
            depth += 1
        try:
            self.dispatcher.wait(seqs, self.transfer_timeout_s if timeout is None else timeout)
        finally:
            for _ in range(depth):
                self._lock.acquire()
        if self.counters.sleeps != sleeps:
            # Everything this call held was reclaimed by the sleep: it must not go on.
            raise RequestCancelledError(
                "the deployment went to sleep while this call waited for a transfer; "
                "match again after the wake")


    # ------------------------------------------------------------------ host blocks

    def take_host_block(self) -> int | None:
        """A free host block, evicting a host copy if needed (the host list's oldest, or the
        `cache.host_eviction_policy` strategy's victim); None when every host block is busy.
        A copy evicted with a storage key that storage lacks is counted
        (`evicted_host_unstored`); under write_back such copies are written first and a
        written one goes instead (`_write_back_oldest`, in the same order)."""
        pool = self._host_pool
        if pool.num_free:
            return pool.allocate_one()
        strategy = self._host_evict
        storage = self.storage
        write_back = storage is not None and storage.write_policy.on_host_evict
        victim: Node | None
        if strategy is not None:
            if write_back:
                # The strategy's next victims stand in for the list's oldest: unwritten ones
                # go to storage as a batch (BACKING unlists them, so their heap entries die),
                # and the strategy's lowest live entry is then the copy to evict.
                head = strategy.upcoming(1)
                if (head and head[0].skey is not None and not head[0].flags & STORED
                        and self._write_back_oldest(storage) is None):  # type: ignore[arg-type]
                    return None
            victim = strategy.victim()
            if victim is None:  # not reached while every listing reaches the strategy
                victim = self._host_lru.oldest()
                if victim is None:
                    return None
                self.counters.eviction_policy_fallbacks += 1
        else:
            victim = self._host_lru.oldest()
            if victim is None:
                return None
            if write_back and victim.skey is not None and not victim.flags & STORED:
                victim = self._write_back_oldest(storage)  # type: ignore[arg-type]
                if victim is None:
                    return None
        if victim.skey is not None and not victim.flags & STORED:
            self.counters.evicted_host_unstored += 1
        self._host_lru.unlink(victim)
        hb = victim.host
        victim.host = None
        self._host_in_tree -= 1
        self.counters.evicted_host_drop += 1
        if victim.dev is None:
            self._forget(victim)
        return hb  # handed over without passing through the free list

    def _host_order(self, n: int) -> Iterable[Node]:
        """The host copies in eviction order: the list's, oldest first, or the next `n`
        victims of the host strategy (read only)."""
        strategy = self._host_evict
        if strategy is None:
            return iter(self._host_lru)
        out: list[Node] = strategy.upcoming(n)
        return out

    def _host_touched(self, node: Node) -> None:
        strategy = self._host_evict
        if strategy is not None:
            strategy.touched(node)
            lru = self._host_lru
            strategy.compact(iter(lru), lru.size,
                             lambda k: (nd := self._map.get(k)) is not None
                             and nd.host is not None)

    def _write_back_oldest(self, storage: StorageHooks) -> Node | None:
        """write_back: the next host copy to evict (the oldest, or the host strategy's next
        victim) is one storage lacks. Send the next unwritten copies in eviction order (up
        to `WRITE_BACK_BATCH`, in one BACKUP task: BACKING takes them out of the LRU) and
        return the copy to evict instead: the next written one within reach; else (none
        within reach, or the rate limit refused part of the batch) the next unwritten copy
        left, evicted unwritten; None when every host copy is busy now."""
        batch: list[Node] = []
        victim: Node | None = None
        for node in self._host_order(WRITE_BACK_BATCH + 1):  # at most that many steps
            if (node.skey is None or node.flags & STORED
                    or len(batch) >= WRITE_BACK_BATCH):
                victim = node
                break
            batch.append(node)
        started = storage.write_back(batch)
        return batch[started] if started < len(batch) else victim

    def write_back_for_room(self) -> None:
        """write_back: a store was refused for room (too few evictable host copies: the
        oldest are unwritten). Send the oldest unwritten copies to storage (one batch, as
        an eviction would) so that, once written, they can make room; nothing is evicted."""
        storage = self.storage
        if storage is not None and storage.write_policy.on_host_evict:
            self._write_back_oldest(storage)

    def host_victims(self, n: int) -> list[int]:
        """The keys of the host copies the next `n` calls of `take_host_block` would evict
        (once the free list is empty), oldest first (read only; under write_back, with
        every write-back batch accepted: each call passes over up to `WRITE_BACK_BATCH`
        unwritten copies, which it sends to storage instead)."""
        keys: list[int] = []
        if n <= 0:
            return keys
        storage = self.storage
        write_back = storage is not None and storage.write_policy.on_host_evict
        passed = 0
        order = self._host_order(n * (WRITE_BACK_BATCH + 1) if write_back else n)
        for node in order:
            if (write_back and node.skey is not None and not node.flags & STORED
                    and passed < WRITE_BACK_BATCH):
                passed += 1
                continue
            passed = 0
            if node.key is not None:
                keys.append(node.key)
            if len(keys) >= n:
                break
        return keys

    def give_host_blocks(self, ids: list[int]) -> None:
        """Return host blocks taken with `take_host_block` and never used."""
        if ids:
            self._host_pool.free(ids)

    def free_host_copy(self, node: Node) -> None:
        """Give `node`'s host block back to the free list (the node is in no LRU list)."""
        self._host_pool.free_one(node.host)  # type: ignore[arg-type]
        node.host = None
        self._host_in_tree -= node.key is not None
        if self._host_evict is not None and node.key is not None:
            self._host_evict.forget(node.key)

    def _drop_host_copy(self, node: Node) -> None:
        if node.hprev is not None:
            self._host_lru.unlink(node)
        self._host_pool.free_one(node.host)  # type: ignore[arg-type]
        node.host = None
        self._host_in_tree -= 1
        if self._host_evict is not None and node.key is not None:
            self._host_evict.forget(node.key)

    # ------------------------------------------------------------------ LRU membership

    def relist(self, node: Node) -> None:
        """Put `node` in exactly the LRU lists its state calls for (after any change)."""
        flags = node.flags
        attached = node.key is not None
        want_dev = (attached and node.dev is not None and node.ref == 0
                    and not flags & DEVICE_BUSY)
        if want_dev != (node.dprev is not None):
            if want_dev:
                self._dev_lru.append(node)
                if self._evict is not None:
                    self._evict.listed(node)
            else:
                self._dev_lru.unlink(node)
        want_host = attached and node.host is not None and not flags & HOST_BUSY
        if want_host != (node.hprev is not None):
            if want_host:
                self._host_lru.append(node)
                if self._host_evict is not None:
                    self._host_touched(node)
            else:
                self._host_lru.unlink(node)


    def relist_tail(self, node: Node) -> None:
        """Make an evictable host copy the most recently used."""
        if node.hprev is not None:
            self._host_lru.unlink(node)
            self._host_lru.append(node)
            if self._host_evict is not None:
                self._host_touched(node)

    def after_transfer(self, node: Node) -> None:
        """A transfer touching `node` was answered and its flags updated: relist it, drop it
        from the tree if it holds no block any more, and give a detached node's blocks
        back."""
        self.relist(node)
        self._forget(node)
        self._settle(node)

    def _forget(self, node: Node) -> None:
        """Remove a node that holds no block any more from the tree."""
        if node.key is not None and node.dev is None and node.host is None:
            if self._map.get(node.key) is node:
                del self._map[node.key]
            self._pins.pop(node, None)
            node.key = None

    def _settle(self, node: Node) -> None:
        """A detached node whose last transfer has been answered gives its blocks back (the
        device block only once no request holds it)."""
        if node.key is not None or node.flags & IN_FLIGHT:
            return
        self._written_off.discard(node)
        if node.host is not None:
            self._host_pool.free_one(node.host)
            node.host = None
        if node.ref == 0 and node.dev is not None:
            self._dev_pool.free_one(node.dev)
            node.dev = None

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

    # ------------------------------------------------------------------ backups (D2H)

    def _backup(self, nodes: list[Node]) -> None:
        """Copy device blocks to the host in one low-priority D2H task (SAVING), as far as
        host blocks can be had without evicting anything busy."""
        src: list[int] = []
        dst: list[int] = []
        saving: list[Node] = []
        for node in reversed(nodes):  # tail first, so their LRU order stays leaves-first
            if node.host is not None or node.dev is None:
                continue
            hb = self.take_host_block()
            if hb is None:
                break
            node.host = hb
            self._host_in_tree += 1
            node.flags |= SAVING
            if node.dprev is not None:
                self._dev_lru.unlink(node)
            src.append(node.dev)
            dst.append(hb)
            saving.append(node)
        if saving:
            self.counters.d2h_blocks += len(saving)
            self.ledger.submit(TaskKind.D2H, src, dst, saving, Priority.BACKUP)

    def backup_hot(self, nodes: list[Node]) -> None:
        """Back up the nodes a match made hot that have a device copy and no host copy."""
        self._backup([n for n in nodes if n.dev is not None and n.host is None
                      and not n.flags & (SAVING | LOADING | EVICTING)])

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

    # ------------------------------------------------------------------ storage transitions

    def start_prefetch(self, key: int, skey: bytes, host: int, now: float) -> Node:
        """A node in the tree for `key`, holding host block `host` (from `take_host_block`)
        that a PREFETCH task is filling from storage page `skey` (PREFETCHING: never served
        or freed meanwhile)."""
        node = self._new_host_node(key, host, now, PREFETCHING)
        node.skey = skey
        return node

    def finish_prefetch(self, node: Node, landed: bool) -> None:
        """The prefetch filling `node` was answered: its page landed (a host copy, counted as
        a storage hit at its first hit) or not (its host block is freed)."""
        node.flags &= ~PREFETCHING
        if landed:
            node.flags |= FROM_STORAGE | STORED
        elif node.host is not None:
            self.free_host_copy(node)
        self.after_transfer(node)

    @staticmethod
    def needs_storage_backup(node: Node) -> bool:
        """Whether `node` has a settled host copy storage lacks that nothing is writing yet:
        not detached, stored or backing, and not in transit (prefetched or written by the
        engine: bytes arriving; a D2H: bytes arriving; a load: a failed one moves the host
        copy to a fresh node, which must not be evicted under a BACKUP that reads it)."""
        return not (node.host is None or node.skey is None or node.key is None
                    or node.flags & (STORED | BACKING | PREFETCHING | ENGINE_WRITE
                                     | LOADING | SAVING | EVICTING))

    def start_storage_backup(self, node: Node) -> bool:
        """Mark `node`'s host copy as being written to storage (BACKING: kept meanwhile);
        False when it needs no backup (`needs_storage_backup`)."""
        if not self.needs_storage_backup(node):
            return False
        node.flags |= BACKING
        self.relist(node)
        return True

    def finish_storage_backup(self, node: Node, stored: bool) -> None:
        """The backup of `node` was answered; `stored`: every page of its batch was written.
        Under write_back the copy was written because the host tier was evicting it: a
        written one goes back to the oldest end of the host LRU, the next to be evicted."""
        node.flags &= ~BACKING
        if stored:
            node.flags |= STORED
        self.after_transfer(node)
        storage = self.storage
        if (stored and node.hprev is not None and storage is not None
                and storage.write_policy.on_host_evict):
            self._host_lru.unlink(node)
            self._host_lru.prepend(node)
            if self._host_evict is not None:  # the strategy's next victim, likewise
                self._host_evict.demoted(node)

    def forget_stored(self) -> None:
        """Storage was emptied: no node has a copy there any more."""
        for node in self._map.values():
            node.flags &= ~STORED
        self.counters.storage_forgotten += 1

    # ------------------------------------------------------------------ engine transitions

    def start_engine_write(self, key: int, host: int, skey: bytes | None, now: float) -> Node:
        """A node in the tree for `key` whose host block `host` (from `take_host_block`) the
        engine is writing (ENGINE_WRITE: never served or freed meanwhile)."""
        node = self._new_host_node(key, host, now, ENGINE_WRITE)
        if skey is not None:
            node.skey = skey
        return node

    def ready_host_copies(self) -> list[tuple[int, int, bytes | None, bool]]:
        """Every host copy whose bytes are whole, as (key, host block, storage key, stored),
        least recently used first: what a node service hands over (issue 37). Left out:
        copies being written by an engine or prefetched (their bytes may be partial)."""
        nodes = [n for n in self._map.values()
                 if n.host is not None and not n.flags & (ENGINE_WRITE | PREFETCHING)]
        nodes.sort(key=lambda n: n.last)
        return [(n.key, n.host, n.skey, bool(n.flags & STORED))  # type: ignore[misc]
                for n in nodes]

    def ready_host_copy(self, key: int) -> tuple[int, int, bytes | None, bool] | None:
        """`key`'s host copy as `ready_host_copies` lists it, or None while it has no whole
        one (not cached, not on the host, being written or prefetched)."""
        n = self._map.get(key)
        if n is None or n.host is None or n.flags & (ENGINE_WRITE | PREFETCHING):
            return None
        return (key, n.host, n.skey, bool(n.flags & STORED))

    def adopt_abandoned_writes(self, pages: Sequence[tuple[int, int]],
                               now: float) -> list[Node]:
        """Engine stores a node service's predecessor had abandoned and still held when it
        handed over (issue 37), as (key, host block): each a node marked ENGINE_WRITE (never
        served; its block out of the free list) for the caller to hold until their deadline
        and then drop (`drop_engine_io`): an engine's late copy may still land there. All or
        nothing, as `adopt_host_copies`."""
        keys = set()
        for key, _ in pages:
            if key in keys or self._map.get(key) is not None:
                raise InvalidRequestError(f"held key {key:x}: twice, or already cached")
            keys.add(key)
        self._host_pool.take([hb for _, hb in pages])
        return [self._new_host_node(key, hb, now, ENGINE_WRITE) for key, hb in pages]

    @staticmethod
    def host_copy_ready(node: Node) -> bool:
        """Whether `node`'s host copy is whole (not being written by an engine nor
        prefetched)."""
        return node.host is not None and not node.flags & (ENGINE_WRITE | PREFETCHING)

    def adopt_host_copies(self, pages: Sequence[tuple[int, int, bytes | None, bool]],
                          now: float) -> list[Node]:
        """Host copies a node service's predecessor handed over (issue 37), as (key, host
        block, storage key, stored), oldest first: each a ready node holding that block
        (taken out of the free list), appended to the host LRU in that order. All or
        nothing: a key already in the tree or a block not free raises before any change
        (BlockPoolError / InvalidRequestError)."""
        keys = set()
        for key, _, _, _ in pages:
            if key in keys or self._map.get(key) is not None:
                raise InvalidRequestError(f"adopted key {key:x}: twice, or already cached")
            keys.add(key)
        self._host_pool.take([hb for _, hb, _, _ in pages])
        nodes = []
        for key, hb, skey, stored in pages:
            node = self._new_host_node(key, hb, now, STORED if stored and skey else 0)
            if skey is not None:
                node.skey = skey
            self.relist(node)
            nodes.append(node)
        return nodes

    def finish_engine_write(self, node: Node, ok: bool) -> bool:
        """The engine's write of `node` ended; returns whether the copy is now readable
        (ok and still in the tree). A failed one frees the host block."""
        node.flags &= ~ENGINE_WRITE
        ready = ok and node.key is not None
        if not ready and node.host is not None and node.key is not None:
            self.free_host_copy(node)
        self.after_transfer(node)
        return ready

    def start_engine_read(self, node: Node, first: bool, tokens: int, now: float) -> bool:
        """The engine starts copying `node`'s host copy into its KV (`first`: no other read
        of it is in flight, ENGINE_READ is set): a host hit of `tokens` tokens (a storage
        hit the first time a prefetched copy is read). Returns whether it counted as a
        storage hit (FROM_STORAGE is cleared here)."""
        if first:
            node.flags |= ENGINE_READ
        stored = bool(node.flags & FROM_STORAGE)
        if stored:  # its first hit since it came from storage
            node.flags &= ~FROM_STORAGE
            self.counters.hit_storage_tokens += tokens
        else:
            self.counters.hit_host_tokens += tokens
        node.hits += 1
        node.last = now
        self.relist(node)
        return stored

    def finish_engine_read(self, node: Node) -> None:
        """The last engine read of `node` in flight ended."""
        node.flags &= ~ENGINE_READ
        self.after_transfer(node)

    def drop_engine_io(self, node: Node) -> None:
        """An engine copy of `node` abandoned for good: reads end; a write is dropped, never
        made readable."""
        writing = node.flags & ENGINE_WRITE
        node.flags &= ~(ENGINE_READ | ENGINE_WRITE)
        if writing and node.host is not None and node.key is not None:
            self.free_host_copy(node)
        self.after_transfer(node)

    def touch_host_copy(self, node: Node, now: float) -> None:
        """The engine hit `node` in its own device cache: its host copy is the most
        recently used."""
        node.last = now
        if node.hprev is not None:
            self.relist_tail(node)

    def _new_host_node(self, key: int, host: int, now: float, flags: int) -> Node:
        node = self._loops.node_class(key, None, host, now)
        node.flags = flags
        self._map[key] = node
        self._host_in_tree += 1
        return node

    # ------------------------------------------------------------------ eviction

    def _room_for(self, n: int) -> bool:
        return self._dev_pool.num_free + self._dev_lru.size >= n

    def _make_room(self, n: int, who: str) -> None:
        """Evict until `n` device blocks are free. When free and evictable blocks are too
        few but transfers in flight will free or release enough, first wait for them
        (bounded by `transfer_timeout_s`, lock released). Raises OutOfBlocksError (having
        evicted nothing) if even evicting every evictable block would not be enough."""
        pool = self._dev_pool
        if pool.num_free >= n:
            return
        if pool.num_free + self._dev_lru.size < n:
            busy = self._await_room(n)
            if pool.num_free + self._dev_lru.size < n:
                more = f"; {busy} more busy in transfers in flight" if busy else ""
                raise OutOfBlocksError(
                    f"{who}: {n} device blocks needed, {pool.num_free} free and "
                    f"{self._dev_lru.size} evictable of {pool.capacity}{more}")
        while pool.num_free < n:
            if not self._dev_lru.size:  # a demotion waited for was cancelled by a hit
                raise OutOfBlocksError(
                    f"{who}: {n} device blocks needed, {pool.num_free} free and nothing "
                    f"left to evict of {pool.capacity}")
            demoting = self._evict_device(n - pool.num_free)
            if demoting:
                self.ledger.flush()
                self.wait_unlocked(demoting)

    def _await_room(self, n: int) -> int:
        """Wait (lock released, at most `transfer_timeout_s` in all) for the transfers in
        flight that will make free + evictable reach `n` device blocks, as long as they
        can. Returns the device blocks still busy in transfers."""
        pool, lru = self._dev_pool, self._dev_lru
        deadline = _monotonic() + self.transfer_timeout_s
        while True:
            busy = self.ledger.busy_device_blocks()
            total = sum(b for _, b in busy)
            short = n - pool.num_free - lru.size
            if short <= 0 or total < short:
                return total
            left = deadline - _monotonic()
            if left <= 0:
                return total
            seqs: list[int] = []
            got = 0
            for seq, b in busy:  # the oldest tasks that together free enough
                seqs.append(seq)
                got += b
                if got >= short:
                    break
            try:
                self.wait_unlocked(seqs, left)
            except TransferTimeoutError:
                return sum(b for _, b in self.ledger.busy_device_blocks())

    def _evict_device(self, n: int) -> list[int]:
        """Evict up to `n` LRU device blocks; returns the seqs of demotions to wait for."""
        lru = self._dev_lru
        pool = self._dev_pool
        policy = self.policy
        host_tier = self._host_pool.capacity > 0
        c = self.counters
        strategy = self._evict
        if strategy is not None:
            victims = self._policy_victims(strategy, n)
            if not host_tier:
                for victim in victims:
                    freed_one = victim.dev
                    victim.dev = None
                    self._forget(victim)
                    pool.free_one(freed_one)  # type: ignore[arg-type]
                self._dev_in_tree -= len(victims)
                c.evicted_device_drop += len(victims)
                return []
        else:
            victims = []
        if strategy is None and not host_tier:
            # Device only: every victim is dropped. Unlink a run of victims from the head of
            # the list in one pass (compiled or not, see manager.core.native) and free their
            # blocks in one call.
            freed = self._loops.evict_drop(self._map, lru.head, n)
            lru.size -= len(freed)
            self._dev_in_tree -= len(freed)
            c.evicted_device_drop += len(freed)
            pool.free(freed)
            return []
        demote_src: list[int] = []
        demote_dst: list[int] = []
        demote_nodes: list[Node] = []
        for i in range(n):
            if strategy is not None:
                if i == len(victims):
                    break
                victim = victims[i]
            else:
                oldest = lru.oldest()
                if oldest is None:
                    break
                victim = oldest
                lru.unlink(victim)
            if victim.host is not None:
                c.evicted_device_demote += 1
                pool.free_one(victim.dev)  # type: ignore[arg-type]
                victim.dev = None
                self._dev_in_tree -= 1
                continue
            if policy.demote_on_evict and host_tier:
                hb = self.take_host_block()
                if hb is not None:
                    victim.host = hb
                    self._host_in_tree += 1
                    victim.flags |= EVICTING
                    demote_src.append(victim.dev)  # type: ignore[arg-type]
                    demote_dst.append(hb)
                    demote_nodes.append(victim)
                    continue
            c.evicted_device_drop += 1
            pool.free_one(victim.dev)  # type: ignore[arg-type]
            victim.dev = None
            self._dev_in_tree -= 1
            self._forget(victim)
        if not demote_nodes:
            return []
        c.evicted_device_demote += len(demote_nodes)
        c.d2h_blocks += len(demote_nodes)
        return [self.ledger.submit(TaskKind.D2H, demote_src, demote_dst, demote_nodes,
                                   Priority.EVICT)]

    # ------------------------------------------------------------------ whole-tree transitions

    def _policy_victims(self, strategy: EvictionStrategy, n: int) -> list[Node]:
        """Up to `n` victims in the strategy's order, unlinked from the device LRU list (its
        oldest when the strategy has no live entry left: cannot happen while every listing
        goes through `relist` or `release`, kept so eviction never stalls)."""
        lru = self._dev_lru
        out: list[Node] = []
        while len(out) < n and lru.size:
            victim: Node | None = strategy.victim()
            if victim is None:
                victim = lru.oldest()
                self.counters.eviction_policy_fallbacks += 1
                if victim is None:
                    break
            lru.unlink(victim)
            out.append(victim)
        return out

    def policy_released(self, nodes: list[Node | None]) -> None:
        """A request's nodes were released (the scheduler's `release`): the eviction strategy
        learns which became evictable, at which depth."""
        strategy = self._evict
        if strategy is not None:
            strategy.released(nodes)
            lru = self._dev_lru
            tree = self._map
            strategy.compact(iter(lru), lru.size,
                             lambda k: (nd := tree.get(k)) is not None and nd.dev is not None)

    def _clear_all(self) -> dict[str, int]:
        """Drop every node. Nodes held by requests become detached (their device blocks the
        requests' own); nodes a transfer still uses keep their blocks until it is answered
        (`_written_off`). Caller holds the lock."""
        # Freed ids go back in id order (marked here, listed in one pass below), so the free
        # lists come out the same whichever map (dict or compiled, iterated in different
        # orders) holds the tree.
        dev_ids = bytearray(self._dev_pool.capacity)
        host_ids = bytearray(self._host_pool.capacity)
        # Every node in the LRU lists is in the tree: both lists empty in one pass each.
        self._dev_lru.clear()
        self._host_lru.clear()
        if self._evict is not None:
            self._evict.clear()
        if self._host_evict is not None:
            self._host_evict.clear()
        # Nodes with no transfer in flight in one call (compiled or not, see manager.core.native).
        dev_freed, host_freed, detached, busy = self._loops.clear_walk(
            list(self._map.values()), dev_ids, host_ids, IN_FLIGHT)
        for node in busy:  # a transfer still uses its blocks
            node.flags &= IN_FLIGHT
            node.key = None
            self._written_off.add(node)
            if (node.dev is not None and node.ref == 0
                    and not node.flags & (LOADING | SAVING | EVICTING)):
                # Only its host copy is in use (a storage backup reads it): the device
                # block is free now, not when that slower task is answered.
                dev_ids[node.dev] = 1
                node.dev = None
                dev_freed += 1
        self._dev_pool.free(compress(range(len(dev_ids)), dev_ids))
        self._host_pool.free(compress(range(len(host_ids)), host_ids))
        nodes = len(self._map)
        pins = len(self._pins)
        self._unconfirmed.clear()
        self._map.clear()
        self._pins.clear()
        self._dev_in_tree = 0
        self._host_in_tree = 0
        return {"nodes": nodes, "device_blocks": dev_freed, "host_blocks": host_freed,
                "detached_in_use": detached, "pins": pins}

    def _rebuild_pools(self, device_blocks: int, host_blocks: int) -> None:
        """Empty free lists of new sizes (nothing in flight, the tree already cleared)."""
        self._dev_pool = BlockPool("device", device_blocks)
        self._host_pool = BlockPool("host", host_blocks)
        loops = self._loops
        self._dev_lru = DeviceLRU(loops.node_class)
        self._host_lru = HostLRU(loops.node_class)
        self._evict = make_eviction_policy(self.eviction_policy, device_blocks)
        self._host_evict = make_eviction_policy(self.host_eviction_policy, host_blocks, "host",
                                                "cache.host_eviction_policy")
        self._node_cls = loops.node_class if host_blocks else loops.device_node_class
        self._map.clear()
        self._pins.clear()
        self._written_off.clear()
        self._unconfirmed.clear()  # their nodes went with the tree
        self._dev_in_tree = self._host_in_tree = 0

    def write_off(self, node: Node) -> None:
        """A client decided this cached node's copies must not be served again (an engine's
        audit found its host copy wrong): out of the tree now, its blocks back once nothing
        in flight uses them."""
        with self.lock:
            if node.key is None or self._map.get(node.key) is not node:
                return  # already written off or replaced
            self._write_off(node)

    def _write_off(self, node: Node) -> None:
        """Take an attached node out of the tree now. Blocks a transfer in flight uses come
        back when it is answered (`_written_off`, `_settle`); a device block requests hold
        becomes theirs. Caller holds the lock."""
        if node.dprev is not None:
            self._dev_lru.unlink(node)
        if node.hprev is not None:
            self._host_lru.unlink(node)
        if node.dev is not None:
            self._dev_in_tree -= 1
        if node.host is not None:
            self._host_in_tree -= 1
        if node.key is not None and self._map.get(node.key) is node:
            del self._map[node.key]
            for strategy in (self._evict, self._host_evict):  # its entries die with it
                if strategy is not None:
                    strategy.forget(node.key)
        self._pins.pop(node, None)
        node.key = None
        node.flags &= ~PINNED
        if node.flags & IN_FLIGHT:
            self._written_off.add(node)
        else:
            self._settle(node)

    def confirmed_device_copies(self, mark: int) -> list[Node]:
        """Engine KV: the host copies completed before `mark`, still cached, now trusted."""
        confirmed: list[Node] = []
        queue = self._unconfirmed
        while queue and queue[0][0] < mark:
            _, node, host = queue.popleft()
            if node.key is not None and node.host == host:
                confirmed.append(node)
        return confirmed

    def _lose_device_copies(self) -> dict[str, int]:
        """The device tier's memory was replaced: forget every device copy, keep the host
        copies (but for unconfirmed ones) and what storage holds (see
        `KVCacheManager.lose_device`). Caller holds the lock."""
        host_dropped = written_off = dev_dropped = detached = 0
        while self._unconfirmed:
            _, node, host = self._unconfirmed.popleft()
            if node.key is None or node.host != host:
                continue
            if node.flags & (HOST_BUSY & ~PINNED):
                self._write_off(node)
                written_off += 1
                continue
            self._drop_host_copy(node)
            host_dropped += 1
            self.relist(node)
            self._forget(node)
        for node in list(self._map.values()):
            if node.dev is None:
                continue
            if node.flags & (LOADING | SAVING | EVICTING):
                self._write_off(node)
                written_off += 1
                continue
            if node.ref == 0:
                if node.dprev is not None:
                    self._dev_lru.unlink(node)
                self._dev_pool.free_one(node.dev)
                node.dev = None
                self._dev_in_tree -= 1
                dev_dropped += 1
                self.relist(node)
                self._forget(node)
                continue
            # Requests hold the block: it becomes theirs (a detached node); a host copy
            # stays cached under a fresh node, unless a host transfer uses it now.
            if node.host is not None and node.flags & (PREFETCHING | BACKING):
                self._write_off(node)
                written_off += 1
                continue
            detached += 1
            key = node.key
            assert key is not None
            if node.host is not None:
                fresh = self._node_cls(key, None, node.host, node.last)
                fresh.hits = node.hits
                fresh.skey = node.skey
                fresh.flags = node.flags & (STORED | FROM_STORAGE | PINNED)
                if node.hprev is not None:
                    self._host_lru.unlink(node)
                self._map[key] = fresh
                if node in self._pins:
                    self._pins[fresh] = self._pins.pop(node)
                node.host = None
                self.relist(fresh)
            else:
                del self._map[key]
                self._pins.pop(node, None)
            if node.dprev is not None:
                self._dev_lru.unlink(node)
            node.key = None
            node.flags &= ~(PINNED | STORED | FROM_STORAGE)
            self._dev_in_tree -= 1
        return {"device_blocks": dev_dropped, "detached_in_use": detached,
                "unconfirmed_host_blocks": host_dropped, "written_off": written_off,
                "nodes_kept": len(self._map)}

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
