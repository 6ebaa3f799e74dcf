"""The cache core's state, declared once for every family of its transitions.

`CacheCore` (`kvtier.manager.core.cache`) is the one owner of this state; its constructor sets
every attribute `CoreState` declares, and its transitions are written by family in the
modules that subclass `CoreState` (see cache.py's module docstring for which lives where).
`CoreState` itself holds what every family uses: the lock and `wait_unlocked`, LRU
membership (a node is in exactly the LRU lists its state calls for, after any change), and
the host-copy primitives. Nothing here is a client API of its own: clients hold a
`CacheCore`.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from kvtier.manager.core import native
from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.core.hooks import StorageHooks
from kvtier.manager.core.ledger import TaskLedger
from kvtier.manager.core.nodes import DEVICE_BUSY, HOST_BUSY, IN_FLIGHT, IntrusiveLRU, Node
from kvtier.manager.errors import RequestCancelledError
from kvtier.manager.policies import EvictionStrategy, WritePolicy
from kvtier.manager.transfers import Dispatcher

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


class CoreState:
    """The attributes `CacheCore.__init__` sets (annotations only, so that each
    transition family type-checks on its own) and the primitives every family calls.

    Data structures: those of `CacheCore` (its docstring names each). Invariant kept here:
    after `relist(node)` the node is linked in the device LRU list exactly when it is in the
    tree, holds a device block, no request references it and no device transfer uses it,
    and in the host LRU list exactly when it is in the tree, holds a host block and no host
    transfer or hold uses it.
    """

    block_size: int
    eviction_policy: str
    _evict: EvictionStrategy | None
    host_eviction_policy: str
    _host_evict: EvictionStrategy | None
    page_bytes: int
    transfer_timeout_s: float
    policy: WritePolicy
    _dev_pool: BlockPool
    _host_pool: BlockPool
    _loops: native.Loops
    _dev_lru: IntrusiveLRU
    _node_cls: type[Node]
    _host_lru: IntrusiveLRU
    _map: native.TreeMap
    _pins: dict[Node, int]
    _written_off: set[Node]
    track_device_copies: bool
    _unconfirmed: deque[tuple[int, Node, int]]
    _d2h_done: int
    _lock: threading.RLock
    dispatcher: Dispatcher
    ledger: TaskLedger
    counters: Counters
    tree_status: int
    _dev_in_tree: int
    _host_in_tree: int
    storage: StorageHooks | None

    @property
    def lock(self) -> threading.RLock:
        """The core's (reentrant) lock; every other call here expects it held."""
        return self._lock

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


    # ------------------------------------------------------------------ host copies

    def _host_touched(self, node: Node) -> None:
        strategy = self._host_evict
        if strategy is not None:
            strategy.touched(node)
            lru = self._host_lru
            strategy.compact(iter(lru), lru.size,
                             lambda k: (nd := self._map.get(k)) is not None
                             and nd.host is not None)

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

    def _new_host_node(self, key: int, host: int, now: float, flags: int) -> Node:
        node = self._loops.node_class(key, None, host, now)
        node.flags = flags
        self._map[key] = node
        self._host_in_tree += 1
        return node

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
