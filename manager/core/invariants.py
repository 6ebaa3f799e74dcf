"""The cache core's ownership invariants, checked with a full scan (`CacheCore.check_invariants`;
the tests call it after every step).

Block ownership: each block id of a tier is exactly one of free (in the pool), held by the
tree (a node in the map has it), or owned by a request (allocated to it and not in the tree,
held by a detached node, or by a written-off node until its transfer is answered). LRU
membership: a node is in its tier's list exactly when it is evictable there. The in-tree
counters match the map; every pinned node is flagged and in the tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.core.hooks import RequestState
from kvtier.manager.core.native import TreeMap
from kvtier.manager.core.nodes import DEVICE_BUSY, HOST_BUSY, PINNED, IntrusiveLRU, Node


def check_ownership(tree: TreeMap,
                    tiers: tuple[tuple[BlockPool, IntrusiveLRU], tuple[BlockPool, IntrusiveLRU]],
                    requests: Iterable[RequestState], written_off: Set[Node],
                    pins: dict[Node, int], in_tree: tuple[int, int]) -> None:
    """Assert block ownership, LRU membership, the in-tree counters (device, host) and the
    pins; `tiers`: (pool, LRU list) of the device tier, then of the host tier."""
    for tier, pool, lru, attr in (("device", *tiers[0], "dev"),
                                  ("host", *tiers[1], "host")):
        free = pool.free_ids()
        assert len(free) == len(set(free)), f"{tier}: free list has duplicates"
        tree_ids = [getattr(n, attr) for n in tree.values()
                    if getattr(n, attr) is not None]
        assert len(tree_ids) == len(set(tree_ids)), f"{tier}: id held by two nodes"
        owned: list[int] = []
        if tier == "device":
            seen_detached: set[int] = set()
            for req in requests:
                for i, b in enumerate(req.blocks):
                    node = req.nodes[i] if i < len(req.nodes) else None
                    if i >= len(req.nodes) or node is None:
                        owned.append(b)
                    elif node.key is None and id(node) not in seen_detached:
                        seen_detached.add(id(node))
                        assert node.dev == b, f"device: detached node lost block {b}"
                        owned.append(b)
                    elif node.key is not None:
                        assert node.dev == b, (
                            f"device: request block {b} differs from its node {node}")
            assert len(owned) == len(set(owned)), f"{tier}: id owned twice"
            owned += [n.dev for n in written_off
                      if n.dev is not None and id(n) not in seen_detached]
        else:
            owned += [n.host for n in written_off if n.host is not None]
        everything = free + tree_ids + owned
        assert len(everything) == len(set(everything)), (
            f"{tier}: an id is in two of free/tree/requests")
        assert len(everything) == pool.capacity, (
            f"{tier}: {len(free)} free + {len(tree_ids)} tree + {len(owned)} owned "
            f"!= capacity {pool.capacity}")
        for i in free:
            assert pool.is_free(i)
        in_lru = list(lru)
        assert len(in_lru) == lru.size, f"{tier}: LRU size counter is off"
        busy = DEVICE_BUSY if tier == "device" else HOST_BUSY
        for n in in_lru:
            assert n.key is not None and tree.get(n.key) is n, f"{tier}: stale LRU"
            assert getattr(n, attr) is not None
            assert not n.flags & busy, f"{tier}: busy node {n} is evictable"
            if tier == "device":
                assert n.ref == 0, f"device: referenced node {n} is evictable"
        for n in tree.values():
            want = getattr(n, attr) is not None and not n.flags & busy and (
                tier == "host" or n.ref == 0)
            linked = (n.dprev if tier == "device" else n.hprev) is not None
            assert want == linked, f"{tier}: node {n} LRU membership wrong"
    assert in_tree[0] == sum(1 for n in tree.values() if n.dev is not None)
    assert in_tree[1] == sum(1 for n in tree.values() if n.host is not None)
    for node in pins:
        assert node.flags & PINNED and node.key is not None
    for key, node in tree.items():
        assert node.key == key
        assert node.dev is not None or node.host is not None, f"empty node {node}"
        assert node.ref >= 0
        if node.flags & PINNED:
            assert node in pins
