"""Which code runs the scheduler thread's per-block work: compiled or pure Python.

Per block of every request the manager turns token ids into chained tree keys, walks match's
device hits, joins committed blocks to the tree, drops references on release and evicts LRU
victims; it keeps one node per cached block in one map. The compiled module
`kvtier.manager._native` (manager/_native.c, built by `pip install` / `make install` from
setup.py) provides all of it: the loops, and compact nodes (`DeviceNode` / `Node`, 80 / 104
bytes, no int key object, untracked by the garbage collector) in an open-addressing `KeyMap`.
The functions below are the pure-Python twins (with core/nodes.py's slots nodes in a dict), with
the same arguments, results and effects on nodes, so keys and manager states are identical
either way (tests/test_native.py runs both on the same randomized inputs and the stateful
machines with each).

Selection, at import: `KVTIER_NATIVE=0` means pure Python; `KVTIER_NATIVE=1` requires the
extension (the import fails without it); unset, the extension is used when it imports.
`UNAVAILABLE` says why it is not in use. `use(False)` / `use(True)` switch at run time
(tests): the key chain and the pool's free at once; the tree's map, node classes and loops
(`Loops`, from `bound()`) for managers built afterwards, since a manager keeps its own.

Keys: the extension hashes with the xxhash package's own xxh3-128 (resolved from its loaded
extension module and checked against `xxhash.xxh3_128_intdigest` at import), so a tree key is
the package's key whichever path computes it. Multimodal blocks (`extra_keys`) and token ids
that are not plain ints always take keys.py's Python path.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, MutableMapping, Sequence
from types import ModuleType
from typing import Any, NamedTuple, cast

from kvtier.manager.core.nodes import DeviceNode, Node

ChainKeys = Callable[[Sequence[int], int, int, int, int], "list[int] | None"]
TreeMap = MutableMapping[int, Node]
"""The tree's map, key -> node: a dict on the pure-Python path, a `_native.KeyMap` (an
open-addressing table of 24-byte slots holding the key's two halves, no int object per key)
on the compiled one."""
WalkHits = Callable[[TreeMap, list[int], list[Node | None], int, float, int, list[Node]],
                    tuple[int, int]]
ReleaseWalk = Callable[[list[Node | None], Node, float, int], tuple[list[int], int]]
CommitWalk = Callable[[TreeMap, list[int], list[int], list[Node | None], int, float, type[Node],
                       list[Node]], int]
EvictDrop = Callable[[TreeMap, Node, int], list[int]]
DevIds = Callable[[list[Node]], "list[int | None]"]
ClearWalk = Callable[[list[Node], bytearray, bytearray, int], tuple[int, int, int, list[Node]]]


def py_walk_hits(tree: TreeMap, keys: list[int], nodes: list[Node | None],
                 limit: int, now: float, hit_threshold: int,
                 backups: list[Node]) -> tuple[int, int]:
    """Walk `keys[len(nodes):limit]` while each node is a device hit with no flags set:
    unlink it from the device LRU, count a reference and a hit, stamp `now`, append it to
    `nodes` (and to `backups` once it reaches `hit_threshold` hits with no host copy, when
    the threshold is non-zero). Returns (stop, unlinked): stop 0 at `limit`, 1 at a key not
    in the tree, 2 at a node the caller handles itself (not appended)."""
    get = tree.get
    add = nodes.append
    unlinked = 0
    for key in keys[len(nodes):limit]:
        node = get(key)
        if node is None:
            return 1, unlinked
        if node.dev is None or node.flags:
            return 2, unlinked
        prev = node.dprev
        if prev is not None:  # leave the device LRU (inlined IntrusiveLRU.unlink)
            nxt = node.dnext
            prev.dnext = nxt
            nxt.dprev = prev  # type: ignore[union-attr]
            node.dprev = node.dnext = None
            unlinked += 1
        node.ref += 1
        node.hits += 1
        node.last = now
        if hit_threshold and node.host is None and node.hits >= hit_threshold:
            backups.append(node)
        add(node)
    return 0, unlinked


def py_release_walk(nodes: list[Node | None], head: Node, now: float,
                    busy: int) -> tuple[list[int], int]:
    """Drop one reference from each node, last first; an attached node reaching 0 references
    with no `busy` flag gets `last = now` and joins the device LRU's tail (through sentinel
    `head`; the caller adds the count returned to the list's size). Returns, last first, the
    indexes the caller finishes itself (None entries and detached nodes reaching 0
    references), and the number of nodes appended."""
    rest: list[int] = []
    tail = head.dprev
    appended = 0
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node is None:
            rest.append(i)
            continue
        ref = node.ref - 1
        node.ref = ref
        if ref == 0:
            if node.key is None:
                rest.append(i)
            elif not node.flags & busy:
                node.last = now
                node.dprev = tail
                tail.dnext = node  # type: ignore[union-attr]
                tail = node
                appended += 1
    tail.dnext = head  # type: ignore[union-attr]
    head.dprev = tail
    return rest, appended


def py_commit_walk(tree: TreeMap, keys: list[int], blocks: list[int], nodes: list[Node | None],
                   end: int, now: float, node_class: type[Node], new_nodes: list[Node]) -> int:
    """Join blocks `len(nodes)..end` of a request to the tree: a key not in `tree` gets a
    fresh `node_class` node (device block `blocks[i]`, one reference, `last = now`), put in
    the tree and appended to `nodes` and `new_nodes`; a key whose node holds a device block is
    a duplicate (None appended: the request keeps its block). Stops at a node holding no
    device block (the caller handles it) and returns its index; `end` when done."""
    get = tree.get
    add = nodes.append
    for i in range(len(nodes), end):
        key = keys[i]
        node = get(key)
        if node is None:
            node = node_class(key, blocks[i], None, now)
            node.ref = 1
            tree[key] = node
            add(node)
            new_nodes.append(node)
        elif node.dev is None:
            return i
        else:
            add(None)
    return end


def py_evict_drop(tree: TreeMap, head: Node, n: int) -> list[int]:
    """Drop up to `n` nodes from the head (oldest end) of the device LRU through sentinel
    `head`: each leaves the list and `tree` and is detached with no device block. Returns
    their device block ids, oldest first (the caller frees them and fixes the counts)."""
    freed: list[int] = []
    node = head.dnext
    while len(freed) < n and node is not head:
        nxt = node.dnext  # type: ignore[union-attr]
        freed.append(node.dev)  # type: ignore[union-attr,arg-type]
        node.dev = node.dprev = node.dnext = None  # type: ignore[union-attr]
        del tree[node.key]  # type: ignore[union-attr,arg-type]
        node.key = None  # type: ignore[union-attr]
        node = nxt
    head.dnext = node
    node.dprev = head  # type: ignore[union-attr]
    return freed


def py_clear_walk(nodes: list[Node], dev_free: bytearray, host_free: bytearray,
                  in_flight: int) -> tuple[int, int, int, list[Node]]:
    """Detach every node of `nodes` (the tree being cleared, out of both LRU lists already)
    that has no `in_flight` flag: its host block is marked in `host_free` (a bytearray by
    block id) and dropped; its device block too unless requests hold the node (then it
    stays, the requests' own); flags and key cleared. Returns (device blocks marked, host
    blocks marked, nodes left holding a device block for requests, the nodes with a
    transfer in flight, untouched)."""
    dev_freed = host_freed = detached = 0
    busy: list[Node] = []
    for node in nodes:
        if node.flags & in_flight:
            busy.append(node)
            continue
        if node.host is not None:
            host_free[node.host] = 1
            node.host = None
            host_freed += 1
        if node.dev is not None:
            if node.ref > 0:
                detached += 1
            else:
                dev_free[node.dev] = 1
                node.dev = None
                dev_freed += 1
        node.flags = 0
        node.key = None
    return dev_freed, host_freed, detached, busy


def py_dev_ids(nodes: list[Node]) -> list[int | None]:
    """The device block id (or None) of each node of `nodes`."""
    return [n.dev for n in nodes]


def py_new_tree(capacity: int) -> TreeMap:
    """An empty tree map (`capacity`: the most nodes it will hold, a hint)."""
    return {}


class Loops(NamedTuple):
    """What one manager uses, fixed when it is built (`bound()`): the tree map's factory, the
    node classes and the per-block loops. Nodes and maps of one kind are only ever handed to
    loops of the same kind."""

    new_tree: Callable[[int], TreeMap]
    device_node_class: type[Node]
    node_class: type[Node]
    walk_hits: WalkHits
    release_walk: ReleaseWalk
    commit_walk: CommitWalk
    evict_drop: EvictDrop
    clear_walk: ClearWalk
    dev_ids: DevIds


PY_LOOPS = Loops(py_new_tree, cast("type[Node]", DeviceNode), Node, py_walk_hits,
                 py_release_walk, py_commit_walk, py_evict_drop, py_clear_walk,
                 py_dev_ids)


class NativeFallbackWarning(RuntimeWarning):
    """The compiled extension did not import and nobody asked for pure Python."""


def _load() -> tuple[ModuleType | None, str]:
    setting = os.environ.get("KVTIER_NATIVE", "")
    if setting == "0":
        return None, "KVTIER_NATIVE=0"
    try:
        from kvtier.manager import _native
    except ImportError as e:
        if setting == "1":
            raise ImportError(f"KVTIER_NATIVE=1 but the extension does not import: {e}") from e
        why = f"kvtier.manager._native does not import: {e}"
        # Loud: an install whose compile step failed (no compiler, headers of a Python the
        # extension does not build on) otherwise "succeeds" and runs about 3x slower.
        warnings.warn(
            f"kvtier runs its hot loops in pure Python (about 3x slower): {why}. Reinstall "
            "with a C compiler and this Python's headers (`make install`), or set "
            "KVTIER_NATIVE=0 to choose the pure-Python path and silence this warning.",
            NativeFallbackWarning, stacklevel=2)
        logging.getLogger("kvtier.manager").warning("pure-Python hot path: %s", why)
        return None, why
    return _native, ""


def py_keyed_hits(tree: TreeMap, hashes: Sequence[bytes], busy: int) -> int:
    """Leading blocks of an engine's `hashes` held on the host and ready (no `busy` flag):
    the key is the hash's first 16 bytes, little-endian (`kvtier.manager.keyed.engine_key`)."""
    n = 0
    get = tree.get
    from_bytes = int.from_bytes
    for h in hashes:
        if len(h) < 16:
            break  # short hashes are keyed by a digest: the one-by-one lookup handles them
        node = get(from_bytes(h[:16], "little"))
        if node is None or node.host is None or node.flags & busy:
            break
        n += 1
    return n


_ext, UNAVAILABLE = _load()

chain_keys: ChainKeys | None = None
"""The compiled key chain (None on the pure-Python path: keys.py computes them itself)."""
pool_free: Callable[[bytearray, list[int], list[int]], bool] | None = None
"""The compiled check-and-free of a block pool (None on the pure-Python path: block_pool.py
checks and frees itself)."""
walk_hits: WalkHits = py_walk_hits
release_walk: ReleaseWalk = py_release_walk
_loops = PY_LOOPS


def keyed_hits(tree: TreeMap, hashes: Sequence[bytes], busy: int) -> int:
    """`py_keyed_hits`, compiled for a compiled tree map (0.03 us a block instead of 0.3:
    the key-addressed surface's batch lookup, `kvtier.manager.keyed.KeyedHostCache`)."""
    if _ext is not None and type(tree) is _ext.KeyMap:
        return int(_ext.keyed_hits(tree, hashes, busy))
    return py_keyed_hits(tree, hashes, busy)


def bound() -> Loops:
    """The tree map, node classes and loops a manager built now uses (for its lifetime)."""
    return _loops


def available() -> bool:
    """Whether the compiled extension imported (and was not turned off by KVTIER_NATIVE=0)."""
    return _ext is not None


def active() -> bool:
    """Whether the compiled loops are the ones in use."""
    return chain_keys is not None


def use(native: bool) -> None:
    """Switch between the compiled loops and the pure-Python ones (takes effect for the next
    call of any manager). Raises RuntimeError when asked for an extension that is not there."""
    global chain_keys, walk_hits, release_walk, _loops, pool_free
    if native:
        if _ext is None:
            raise RuntimeError(f"the native extension is not available: {UNAVAILABLE}")
        ext = _ext
        _loops = Loops(lambda capacity: cast(TreeMap, ext.KeyMap(capacity)),
                       cast("type[Node]", ext.DeviceNode), cast("type[Node]", ext.Node),
                       cast(Any, ext.walk_hits), cast(Any, ext.release_walk),
                       cast(Any, ext.commit_walk), cast(Any, ext.evict_drop),
                       cast(Any, ext.clear_walk), cast(Any, ext.dev_ids))
        chain_keys, walk_hits, release_walk = ext.chain_keys, _loops.walk_hits, _loops.release_walk
        pool_free = ext.pool_free
    else:
        chain_keys, walk_hits, release_walk = None, py_walk_hits, py_release_walk
        _loops = PY_LOOPS
        pool_free = None


use(_ext is not None)

