"""Nodes of the prefix tree and the per-tier LRU lists of evictable nodes.

Keys are chained (a block's key covers its whole prefix), so the tree needs no child maps:
it is one flat dict from key to `Node`, and walking a prompt's keys in order walks its path.

Node residency and transfer state machine (one node = one block-sized prefix):

                        commit (new block)
                              |
                              v
     +----- evict/drop --- ON_DEVICE ----- backup D2H ------> SAVING (dev -> host)
     |                      ^    |                              |   ok: ON_BOTH
     |        load H2D done |    | write_back eviction          |   fail: ON_DEVICE
     v                      |    v                              |   (an eviction drops
  (gone)               LOADING  EVICTING (D2H, dev freed        |    the device copy)
     ^                 (host->  on success, kept if the node    |
     |                  dev)    was hit meanwhile)              v
     |                      ^                              ON_BOTH (dev + host)
     |    host hit: alloc   |                               |         |
     +---- drop ------- ON_HOST <--- device eviction -------+         | host eviction
                         ^   |                                        v
            prefetch S2H |   | backup H2S (BACKING: host           ON_DEVICE
            (PREFETCHING)|   |  copy must not be freed)
                      (storage)

* Flags (`Node.flags`) mark what is in flight: LOADING, SAVING, EVICTING, PREFETCHING,
  BACKING, plus PINNED, STORED (storage has a copy) and FROM_STORAGE (the host copy came
  from storage and has not been hit yet). A node with LOADING/SAVING/EVICTING is never
  evicted from the device; one with SAVING/LOADING/PREFETCHING/BACKING never loses its host
  block.
* A node whose device copy is being demoted (EVICTING) and is hit meanwhile is served from
  the device: the hit sets CANCEL_EVICT and the completion keeps the device block.
* A node is *detached* (`key is None`) when it left the tree while requests still hold it
  (reset, or a failed load). Its device block then belongs to those requests and returns to
  the free list with the last release.

Evictable = in the LRU list of its tier. Device list: has a device block, no references, not
pinned, no device-side transfer. Host list: has a host block, not pinned, no host-side
transfer. Lists are intrusive doubly-linked lists (links live in the node): append, unlink
and pop-oldest are O(1) and cost no allocation.
"""

from __future__ import annotations

from collections.abc import Iterator

LOADING = 1  # H2D in flight: device block allocated, content arriving
SAVING = 2  # D2H backup in flight: host block allocated, content arriving
EVICTING = 4  # D2H demotion in flight: device block freed when it lands
CANCEL_EVICT = 8  # hit while EVICTING: keep the device copy
PREFETCHING = 16  # S2H in flight: host block allocated, content arriving
BACKING = 32  # H2S in flight: host copy is being read
PINNED = 64  # never evicted from the device
STORED = 128  # a copy is in the storage tier (no backup needed)
FROM_STORAGE = 256  # host copy prefetched from storage and not hit yet (counts a storage hit)

DEVICE_BUSY = LOADING | SAVING | EVICTING | PINNED
HOST_BUSY = LOADING | SAVING | EVICTING | PREFETCHING | BACKING | PINNED


class Node:
    """One cached block-sized prefix.

    Fields: `key` (tree key, None once detached), `dev`/`host` (block id on that tier or None),
    `ref` (requests holding it), `flags` (see module doc), `hits` (times matched), `last`
    (monotonic time of the last match or commit), the intrusive links of the device and host
    LRU lists, and `skey` (the SHA-256 storage key, when a storage tier exists).
    """

    __slots__ = ("dev", "dnext", "dprev", "flags", "hits", "hnext", "host", "hprev", "key",
                 "last", "ref", "skey")

    def __init__(self, key: int | None, dev: int | None, host: int | None, last: float) -> None:
        self.key = key
        self.dev = dev
        self.host = host
        self.ref = 0
        self.flags = 0
        self.hits = 0
        self.last = last
        self.dprev: Node | None = None
        self.dnext: Node | None = None
        self.hprev: Node | None = None
        self.hnext: Node | None = None
        self.skey: bytes | None = None  # storage key, only while a storage tier exists

    def __repr__(self) -> str:
        k = "detached" if self.key is None else f"{self.key & 0xFFFFFFFF:08x}"
        return (f"Node({k}, dev={self.dev}, host={self.host}, ref={self.ref}, "
                f"flags={self.flags:#x})")


class DeviceNode:
    """A Node for deployments with only a device tier: the host-side fields are class
    constants (always None), so each node costs 8 slots instead of 12 — about a fifth less
    memory per cached block where no host or storage tier exists."""

    __slots__ = ("dev", "dnext", "dprev", "flags", "hits", "key", "last", "ref")

    host = None
    hprev = None
    hnext = None
    skey = None

    def __init__(self, key: int | None, dev: int | None, host: int | None, last: float) -> None:
        if host is not None:
            raise ValueError("a device-only node cannot hold a host block")
        self.key = key
        self.dev = dev
        self.ref = 0
        self.flags = 0
        self.hits = 0
        self.last = last
        self.dprev: Node | None = None
        self.dnext: Node | None = None

    __repr__ = Node.__repr__


class DeviceLRU:
    """Evictable nodes on the device, oldest first (a circular list through a sentinel).

    Invariant: a node is linked exactly when `node.dprev is not None`.
    """

    __slots__ = ("head", "size")

    def __init__(self) -> None:
        self.head = Node(None, None, None, 0.0)
        self.head.dprev = self.head.dnext = self.head
        self.size = 0

    def append(self, node: Node) -> None:
        """Make `node` the most recently used."""
        head = self.head
        last = head.dprev
        node.dprev = last
        node.dnext = head
        last.dnext = node  # type: ignore[union-attr]
        head.dprev = node
        self.size += 1

    def unlink(self, node: Node) -> None:
        prev, nxt = node.dprev, node.dnext
        prev.dnext = nxt  # type: ignore[union-attr]
        nxt.dprev = prev  # type: ignore[union-attr]
        node.dprev = node.dnext = None
        self.size -= 1

    def oldest(self) -> Node | None:
        n = self.head.dnext
        return None if n is self.head else n

    def __iter__(self) -> Iterator[Node]:
        n = self.head.dnext
        while n is not self.head:
            assert n is not None
            yield n
            n = n.dnext


class HostLRU:
    """Evictable nodes on the host, oldest first. Same shape as DeviceLRU over the host links.

    Invariant: a node is linked exactly when `node.hprev is not None`.
    """

    __slots__ = ("head", "size")

    def __init__(self) -> None:
        self.head = Node(None, None, None, 0.0)
        self.head.hprev = self.head.hnext = self.head
        self.size = 0

    def append(self, node: Node) -> None:
        head = self.head
        last = head.hprev
        node.hprev = last
        node.hnext = head
        last.hnext = node  # type: ignore[union-attr]
        head.hprev = node
        self.size += 1

    def unlink(self, node: Node) -> None:
        prev, nxt = node.hprev, node.hnext
        prev.hnext = nxt  # type: ignore[union-attr]
        nxt.hprev = prev  # type: ignore[union-attr]
        node.hprev = node.hnext = None
        self.size -= 1

    def oldest(self) -> Node | None:
        n = self.head.hnext
        return None if n is self.head else n

    def __iter__(self) -> Iterator[Node]:
        n = self.head.hnext
        while n is not self.head:
            assert n is not None
            yield n
            n = n.hnext
