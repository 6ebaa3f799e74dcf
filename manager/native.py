"""Which code runs the scheduler thread's per-block loops: compiled or pure Python.

Three loops run once per block of every request: turning token ids into chained tree keys,
match's walk over cached device blocks, and release's reference drops. The compiled module
`kvtier.manager._native` (manager/_native.c, built by `pip install` / `make install` from
setup.py) runs them in C; the functions below are their pure-Python twins, with the same
arguments, results and effects on nodes, so keys and manager states are identical either way
(tests/test_native.py runs both on the same randomized inputs and the stateful machines with
each).

Selection, at import: `KVTIER_NATIVE=0` means pure Python; `KVTIER_NATIVE=1` requires the
extension (the import fails without it); unset, the extension is used when it imports.
`UNAVAILABLE` says why it is not in use. `use(False)` / `use(True)` switch at run time (tests).

Keys: the extension hashes with the xxhash package's own xxh3-128 (resolved from its loaded
extension module and checked against `xxhash.xxh3_128_intdigest` at import), so a tree key is
the package's key whichever path computes it. Multimodal blocks (`extra_keys`) and token ids
that are not plain ints always take keys.py's Python path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from types import ModuleType

from kvtier.manager.tree import DeviceNode, Node

ChainKeys = Callable[[Sequence[int], int, int, int, int], "list[int] | None"]


def py_walk_hits(tree: dict[int, Node], keys: list[int], nodes: list[Node | None],
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


def _load() -> tuple[ModuleType | None, str]:
    setting = os.environ.get("KVTIER_NATIVE", "")
    if setting == "0":
        return None, "KVTIER_NATIVE=0"
    try:
        from kvtier.manager import _native
    except ImportError as e:
        if setting == "1":
            raise ImportError(f"KVTIER_NATIVE=1 but the extension does not import: {e}") from e
        return None, f"kvtier.manager._native does not import: {e}"
    _native.bind(DeviceNode, Node)
    return _native, ""


def py_keyed_hits(get: Callable[[int], Node | None], hashes: Sequence[bytes], busy: int) -> int:
    """Leading blocks of an engine's `hashes` held on the host and ready (no `busy` flag):
    the key is the hash's first 16 bytes, little-endian (`kvtier.manager.keyed.engine_key`)."""
    n = 0
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
walk_hits = py_walk_hits
release_walk = py_release_walk
keyed_hits = py_keyed_hits


def available() -> bool:
    """Whether the compiled extension imported (and was not turned off by KVTIER_NATIVE=0)."""
    return _ext is not None


def active() -> bool:
    """Whether the compiled loops are the ones in use."""
    return chain_keys is not None


def use(native: bool) -> None:
    """Switch between the compiled loops and the pure-Python ones (takes effect for the next
    call of any manager). Raises RuntimeError when asked for an extension that is not there."""
    global chain_keys, walk_hits, release_walk
    if native:
        if _ext is None:
            raise RuntimeError(f"the native extension is not available: {UNAVAILABLE}")
        chain_keys, walk_hits, release_walk = (_ext.chain_keys, _ext.walk_hits,
                                               _ext.release_walk)
    else:
        chain_keys, walk_hits, release_walk = None, py_walk_hits, py_release_walk


use(_ext is not None)

