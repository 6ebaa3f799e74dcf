"""What the scheduler and the storage tier know of each other, and nothing more.

`KVCacheManager` (`kvtier.manager.scheduler`) owns the prefix tree, the free lists and the
lock; `StorageTier` (`kvtier.manager.storage_tier`) decides what to prefetch from storage and
what to back up to it. Neither module imports the other: both import this one.

* `RequestState`: one request's per-block state, built by the scheduler and read by the
  storage tier (its keys, its matched nodes, its storage keys).
* `CacheState`: the operations the storage tier is handed (the manager implements them).
  Every one is called with the manager's lock held, except `lock` itself.
* `StorageHooks`: the calls the scheduler makes into a storage tier (`StorageTier`
  implements them); the manager holds one in `KVCacheManager.storage`, or None.

The one place that builds both and wires them together is `kvtier.manager.stack.Stack`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from kvtier.manager.transfers import LoadHandle
from kvtier.manager.tree import Node
from kvtier.worker.wire import Completion, Task

OnDone = Callable[[bool, Completion], None]
"""`on_done(ok, completion)`: called (lock held) once every rank answered a tracked task."""


class RequestState:
    """Per-request state. `nodes[i]` is the node block i is held through, or None when the
    block is the request's own (a duplicate of a cached block); `blocks[i]` is block i's
    device id; blocks past `len(nodes)` are owned by the request."""

    __slots__ = ("blocks", "extra_keys", "handle", "keys", "length", "nodes", "skeys")

    def __init__(self, keys: list[int], extra_keys: Sequence[object] | None) -> None:
        self.keys = keys
        self.extra_keys = extra_keys
        self.nodes: list[Node | None] = []
        self.blocks: list[int] = []
        self.length = 0  # tokens the request has device slots for (counted from 0)
        self.handle: LoadHandle | None = None
        self.skeys: list[bytes] = []  # storage keys, computed only with a storage tier


class CacheState(Protocol):
    """The manager as the storage tier sees it: lookups in the tree, host blocks, and tasks.

    A node the storage tier creates or changes stays consistent only through these calls:
    after changing a node's flags it calls `relist` (or `after_transfer` once a transfer
    touching the node was answered).
    """

    page_bytes: int
    """Bytes of one block on one rank."""
    transfer_timeout_s: float
    """How long a wait on a transfer lasts unless told otherwise."""

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """The manager's (reentrant) lock; every other call here expects it held."""
        ...

    def lookup(self, key: int) -> Node | None:
        """The tree's node for `key`, or None."""
        ...

    def cached_nodes(self) -> Iterable[Node]:
        """Every node of the tree (do not add or remove nodes while iterating)."""
        ...

    def next_seq(self) -> int:
        """A fresh task sequence number."""
        ...

    def track(self, task: Task, nodes: list[Node], on_done: OnDone | None = None) -> None:
        """Queue `task` (sent when the scheduler call ends, or by `wait_unlocked`); `on_done`
        runs when every rank has answered."""
        ...

    def wait_unlocked(self, seqs: list[int], timeout: float | None = None) -> None:
        """Flush, then wait for tasks `seqs` with the lock released (TransferTimeoutError
        after `timeout`, default `transfer_timeout_s`); the lock is held again on return."""
        ...

    def take_host_block(self) -> int | None:
        """A free host block, evicting the least recently used host copy if needed; None
        when every host block is busy."""
        ...

    def new_host_node(self, key: int, host: int, now: float) -> Node:
        """A fresh node of the tree's class holding host block `host` (not in the tree yet)."""
        ...

    def adopt_host_node(self, node: Node) -> None:
        """Put `node`, which holds only a host block (`node.host`), into the tree."""
        ...

    def free_host_copy(self, node: Node) -> None:
        """Give `node`'s host block back to the free list (the node is in no LRU list)."""
        ...

    def relist(self, node: Node) -> None:
        """Put `node` in exactly the LRU lists its state calls for."""
        ...

    def after_transfer(self, node: Node) -> None:
        """A transfer touching `node` was answered and its flags updated: relist it, drop it
        from the tree if it holds no block any more, and give a detached node's blocks
        back."""
        ...


class StorageHooks(Protocol):
    """The storage tier as the scheduler sees it (called with the manager's lock held)."""

    threshold_tokens: int
    """Misses shorter than this many tokens are not worth a storage query."""

    def request_skeys(self, req: RequestState, token_ids: Sequence[int],
                      upto: int) -> list[bytes]:
        """The request's storage keys for its first `upto` blocks."""
        ...

    def on_miss(self, req: RequestState, token_ids: Sequence[int], start: int,
                cap: int) -> bool:
        """`match` found nothing cached from block `start` of `cap` matchable blocks on:
        query or prefetch, and wait per policy. True when the walk should look again."""
        ...

    def query(self, req: RequestState, token_ids: Sequence[int], start: int,
              cap: int) -> int:
        """Ask storage for blocks `start..cap` without waiting; returns the task's seq."""
        ...

    def backup(self, nodes: list[Node]) -> None:
        """Write the host copies among `nodes` that storage does not hold yet."""
        ...

    def revoke(self, keys: Iterable[int] | None = None) -> int:
        """Cancel the queries and prefetches in flight that fill only blocks of `keys` (every
        one when None), keeping the pages already read; returns how many."""
        ...
