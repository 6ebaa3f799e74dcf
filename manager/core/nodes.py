"""Nodes of the prefix tree, their state diagram, and the per-tier LRU lists of evictable nodes.

Keys are chained (a block's key covers its whole prefix), so the tree needs no child maps:
it is one flat dict from key to `Node`, and walking a prompt's keys in order walks its path.

Only the cache core (`kvtier.manager.core.cache.CacheCore`, and the per-block loops of
`kvtier.manager.core.native` / `_native.c` it calls) changes a node's state; its clients (the
scheduler API, the storage tier, the key-addressed surface) ask it for the named transitions
below (`tests/test_core_owns_flags.py` fails when Python code elsewhere writes `flags`).

The complete state diagram of one node (one block-sized prefix). A state is which copies it
holds (device `dev`, host `host`, storage: the STORED flag) plus the transfer flags; each
arrow names the core transition that takes it::

    (no node) --new_device_node (commit)--> ON_DEVICE (ref > 0 while requests hold it)
    (no node) --start_prefetch (S2H, PREFETCHING)--> ON_HOST* --finish_prefetch-->
                  ok: ON_HOST + FROM_STORAGE + STORED | failed: host freed, (gone)
    (no node) --start_engine_write (engine KV -> host, ENGINE_WRITE)--> ON_HOST* --
                  finish_engine_write--> ok: ON_HOST | failed: host freed, (gone)

    ON_DEVICE --backup_hot / commit backup (D2H, SAVING)--> ON_BOTH* --finish_d2h-->
                  ok: ON_BOTH | fail: ON_DEVICE
    ON_DEVICE --evict_device, write_back (D2H, EVICTING)--> ON_BOTH* --finish_d2h-->
                  ok: ON_HOST (device block freed) | fail: (gone)
                  hit meanwhile (hit_busy_device_copy: CANCEL_EVICT) or pinned: ON_BOTH
    ON_DEVICE --evict_device (no host copy wanted)--> (gone)
    ON_BOTH   --evict_device--> ON_HOST
    ON_BOTH   --take_host_block (LRU host eviction)--> ON_DEVICE
    ON_HOST   --hit_host_copy + load_host_copies, or pin_node: device block, H2D
                  (LOADING)--> ON_BOTH* --finish_load--> ok: ON_BOTH (exclusive policy:
                  ON_DEVICE) | fail: ON_HOST (a fresh node, with the storage backup that
                  reads its host copy, if any; the failed one stays with its requests,
                  detached)
    ON_HOST (hit, LOADING, no H2D sent) --unhit / unhit_match (a match cut short: a sleep or
                  timeout while it waited)--> ON_HOST (a detached one settles: blocks freed)
    ON_HOST   --attach_device_copy (commit of a host-only block)--> ON_BOTH (exclusive
                  policy: ON_DEVICE)
    ON_HOST   --take_host_block (LRU host eviction)--> (gone)
    ON_HOST / ON_BOTH --start_storage_backup (H2S, BACKING)--> same* --finish_storage_backup-->
                  same, + STORED when every page was written
    any       --forget_stored (storage cleared)--> STORED cleared
    ON_HOST / ON_BOTH --start_engine_read (host -> engine KV, ENGINE_READ, counted per
                  reader)--> same* --finish_engine_read (last reader)--> same
    ON_HOST*  --drop_engine_io (the engine abandoned its copy)--> same (a read) | (gone)
    any       --pin_node / unpin_node--> PINNED set / cleared
    ON_HOST   --hold_host_copy / release_host_hold (a tenant's pin, TTL or priority)-->
                  PINNED set / cleared, the host copy kept in place (no device load)
    ON_HOST   --evict_host_copy (a tenant over its quota evicts its own)--> (gone)
    any       --clear_all (reset, sleep, lost worker), lose_device_copies (lost device
                  memory), write_off--> detached (key None): blocks requests hold become
                  theirs; blocks a transfer in flight uses come back when it is answered
                  (written off, then `settle`)

    (* = a transfer flag is set: the copy it protects is neither evicted nor freed)

* Flags (`Node.flags`) mark what is in flight: LOADING, SAVING, EVICTING, PREFETCHING,
  BACKING, ENGINE_READ, ENGINE_WRITE (an engine that owns its device tier copies a host block
  in its own process, `kvtier.manager.keyed`), plus PINNED, STORED (storage has a copy) and
  FROM_STORAGE (the host copy came from storage and has not been hit yet). A node with
  LOADING/SAVING/EVICTING is never evicted from the device (DEVICE_BUSY); one with any
  transfer flag never loses its host block (HOST_BUSY). A node being written
  (ENGINE_WRITE) or prefetched (PREFETCHING) is never served.
* A node whose device copy is being demoted (EVICTING) and is hit meanwhile is served from
  the device: the hit sets CANCEL_EVICT and the completion keeps the device block.
* A node is *detached* (`key is None`) when it left the tree while requests still hold it
  (reset, or a failed load). Its device block then belongs to those requests and returns to
  the free list with the last release.

The classes here are the pure-Python nodes. With the compiled extension a manager uses their
twins, `kvtier.manager._native.DeviceNode` / `Node` (same attributes and states, 80 / 104
bytes instead of 96 / 128 plus a 48-byte key int, not tracked by the garbage collector: the
LRU rings, their only cycles, are broken when a list is freed); see kvtier.manager.core.native.

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
# An engine that owns the device tier itself (vLLM, `kvtier.manager.keyed`) copies between its
# KV and the host pool in its own process: these mark a host copy it is reading or writing.
ENGINE_READ = 512  # the engine is loading this host copy into its KV: keep it
ENGINE_WRITE = 1024  # the engine is storing its KV into this host block: not readable yet

DEVICE_BUSY = LOADING | SAVING | EVICTING | PINNED
HOST_BUSY = (LOADING | SAVING | EVICTING | PREFETCHING | BACKING | PINNED | ENGINE_READ
             | ENGINE_WRITE)
IN_FLIGHT = LOADING | SAVING | EVICTING | PREFETCHING | BACKING | ENGINE_READ | ENGINE_WRITE


class DeviceNode:
    """One cached block-sized prefix, as a deployment with only a device tier stores it.

    Fields: `key` (tree key, None once detached), `dev` (device block id or None), `ref`
    (requests holding it), `flags` (see module doc), `hits` (times matched), `last`
    (monotonic time of the last match or commit), and the device LRU links. The host-side
    fields are class constants here (always None); `Node` adds them as real fields. Eight
    slots instead of twelve: about a fifth less memory per cached block where no host or
    storage tier exists.
    """

    __slots__ = ("dev", "dnext", "dprev", "flags", "hits", "key", "last", "ref")

    host: int | None = None
    hprev: Node | None = None
    hnext: Node | None = None
    skey: bytes | None = None

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

    def __repr__(self) -> str:
        k = "detached" if self.key is None else f"{self.key & 0xFFFFFFFF:08x}"
        return (f"Node({k}, dev={self.dev}, host={self.host}, ref={self.ref}, "
                f"flags={self.flags:#x})")


class Node(DeviceNode):
    """A node of a deployment with a host tier: adds `host` (host block id or None), the host
    LRU links and `skey` (the SHA-256 storage key, when a storage tier exists)."""

    __slots__ = ("hnext", "host", "hprev", "skey")

    def __init__(self, key: int | None, dev: int | None, host: int | None, last: float) -> None:
        self.key = key
        self.dev = dev
        self.host = host
        self.ref = 0
        self.flags = 0
        self.hits = 0
        self.last = last
        self.dprev = None
        self.dnext = None
        self.hprev = None
        self.hnext = None
        self.skey = None


class IntrusiveLRU:
    """Evictable nodes of one tier, oldest first: a circular doubly-linked list through a
    sentinel, whose links live in the nodes (`dprev`/`dnext` for the device list,
    `hprev`/`hnext` for the host list), so a node costs the list no allocation.

    Invariant: a node is linked exactly when its prev link is not None. The scheduler inlines
    the device list's links on its hottest paths; everything else goes through here.
    """

    __slots__ = ("_get_next", "_get_prev", "_set_next", "_set_prev", "head", "size")

    def __init__(self, prev: str, nxt: str, node_class: type[Node] = Node) -> None:
        # `node_class`: the nodes' class with the host fields (tree.Node, or the compiled one
        # of kvtier.manager.core.native); the sentinel is one of them.
        prev_slot = getattr(node_class, prev)  # slot (member) descriptors
        next_slot = getattr(node_class, nxt)
        self._get_prev, self._set_prev = prev_slot.__get__, prev_slot.__set__
        self._get_next, self._set_next = next_slot.__get__, next_slot.__set__
        self.head = head = node_class(None, None, None, 0.0)
        self._set_prev(head, head)
        self._set_next(head, head)
        self.size = 0

    def append(self, node: Node) -> None:
        """Make `node` the most recently used."""
        head = self.head
        last = self._get_prev(head)
        self._set_prev(node, last)
        self._set_next(node, head)
        self._set_next(last, node)
        self._set_prev(head, node)
        self.size += 1

    def prepend(self, node: Node) -> None:
        """Make `node` the least recently used (the next to be evicted)."""
        head = self.head
        first = self._get_next(head)
        self._set_prev(node, head)
        self._set_next(node, first)
        self._set_prev(first, node)
        self._set_next(head, node)
        self.size += 1

    def unlink(self, node: Node) -> None:
        prev, nxt = self._get_prev(node), self._get_next(node)
        self._set_next(prev, nxt)
        self._set_prev(nxt, prev)
        self._set_prev(node, None)
        self._set_next(node, None)
        self.size -= 1

    def clear(self) -> None:
        """Empty the list (every node unlinked), one pass."""
        head = self.head
        get_next, set_prev, set_next = self._get_next, self._set_prev, self._set_next
        n = get_next(head)
        while n is not None and n is not head:
            nxt = get_next(n)
            set_prev(n, None)
            set_next(n, None)
            n = nxt
        set_prev(head, head)
        set_next(head, head)
        self.size = 0

    def __del__(self) -> None:
        # Break the ring (sentinel included) one node at a time: the compiled nodes are not
        # tracked by the garbage collector, so a ring left closed would never be freed; and
        # letting go of a long chain at once would free it recursively.
        self.clear()
        self._set_prev(self.head, None)
        self._set_next(self.head, None)

    def oldest(self) -> Node | None:
        n = self._get_next(self.head)
        return None if n is self.head else n

    def __iter__(self) -> Iterator[Node]:
        n = self._get_next(self.head)
        while n is not self.head:
            yield n
            n = self._get_next(n)


def DeviceLRU(node_class: type[Node] = Node) -> IntrusiveLRU:
    """The device tier's list (links `dprev`/`dnext`)."""
    return IntrusiveLRU("dprev", "dnext", node_class)


def HostLRU(node_class: type[Node] = Node) -> IntrusiveLRU:
    """The host tier's list (links `hprev`/`hnext`)."""
    return IntrusiveLRU("hprev", "hnext", node_class)
