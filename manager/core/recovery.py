"""The cache core's whole-tree transitions: clearing the tree (reset, sleep), new pool
sizes, writing nodes off, the engine-KV registration check and the loss of the device memory.

A family of `CacheCore`'s transitions (`kvtier.manager.core.cache`), inherited by it; the
scheduler API's reset / sleep / wake / lose_device and the keyed surface's audit call them.
"""

from __future__ import annotations

from itertools import compress

from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.core.nodes import (
    BACKING,
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
from kvtier.manager.core.state import CoreState
from kvtier.manager.policies import make_eviction_policy


class Recovery(CoreState):
    """`_clear_all`, `_rebuild_pools`, `write_off` / `_write_off`,
    `confirmed_device_copies`, `_lose_device_copies`.

    Data structures: every one of `CoreState`'s. Invariant: a node a transfer in flight
    still uses leaves the tree at once but keeps its blocks (`_written_off`) until the
    transfer is answered; no block is ever freed twice or lost.
    """

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
