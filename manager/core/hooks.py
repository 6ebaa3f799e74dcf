"""What the core's clients know of each other, and nothing more.

The cache core (`kvtier.manager.core.cache.CacheCore`) owns the prefix tree, the free lists,
the task ledger and the lock; its clients are the scheduler API (`kvtier.manager.scheduler`),
the storage tier (`kvtier.manager.storage_tier`) and the key-addressed surface
(`kvtier.manager.keyed`). None of them imports another: each imports the core.

* `RequestState`: one request's per-block state, built by the scheduler and read by the
  storage tier (its keys, its matched nodes, its storage keys).
* `StorageHooks`: the calls the core, the scheduler and the keyed surface make into a storage
  tier (`StorageTier` implements them); the core holds one in `CacheCore.storage`, or None.
* `OnDone`: a tracked task's completion callback.

The one place that builds them all and hands the storage tier to the core is
`kvtier.manager.stack.assemble`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvtier.manager.core.nodes import Node
from kvtier.manager.policies import StorageWritePolicy
from kvtier.manager.transfers import LoadHandle
from kvtier.worker.wire import Completion

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


class StorageHooks(Protocol):
    """The storage tier as the core, the scheduler and the keyed surface see it (called with
    the core's lock held)."""

    write_policy: StorageWritePolicy
    """When host copies are written to storage (`storage.write_policy`)."""
    threshold_tokens: int
    """Misses shorter than this many tokens are not worth a storage query."""
    prefetching_blocks: int
    """Host blocks that prefetches in flight hold."""
    on_pages_gone: Callable[[list[bytes]], None] | None
    """Told (lock held) the storage keys of pages a prefetch found gone: missing, or damaged
    and deleted by the worker itself (the keyed surface drops their retention record)."""

    def request_skeys(self, req: RequestState, token_ids: Sequence[int],
                      upto: int) -> list[bytes]:
        """The request's storage keys for its first `upto` blocks."""
        ...

    def on_miss(self, req: RequestState, token_ids: Sequence[int], start: int,
                cap: int) -> bool:
        """`match` found nothing cached from block `start` of `cap` matchable blocks on:
        query or prefetch, and wait per policy. True when the walk should look again."""
        ...

    def query(self, req: RequestState, token_ids: Sequence[int] | None, start: int,
              cap: int, on_answer: Callable[[int], None] | None = None,
              threshold_tokens: int | None = None,
              on_lacking: Callable[[int], None] | None = None) -> int:
        """Ask storage for blocks `start..cap` without waiting (`on_answer(found)` runs when
        it is answered, lock held, with how many leading blocks storage holds; a prefetch
        starts when the hit reaches `threshold_tokens`, default `storage.prefetch_threshold`;
        `on_lacking(i)` first when storage answered and lacks block i); returns the task's
        seq."""
        ...

    def holds(self, skey: bytes) -> bool:
        """Whether the index of what storage holds lists this storage key (a hint for how
        long a lookup may wait for a query, never a decision to serve)."""
        ...

    def index_complete(self) -> bool:
        """Whether that index lists every page storage held at its last listing (recent
        enough): a key it does not list is then not worth a query."""
        ...

    def index_misses(self, req: RequestState, token_ids: Sequence[int], start: int) -> bool:
        """Whether the complete index does not list block `start` of the request (counted):
        a query could only answer 0, so none is sent."""
        ...

    def reads_skipped(self) -> bool:
        """Whether storage reads are slow (back-pressure, `storage.slow_read_ms`) and this
        lookup must not ask storage (counted; True except for one probe a second)."""
        ...

    def reads_slow(self) -> bool:
        """Whether storage reads are slow (back-pressure): a lookup that asks anyway is the
        probe, which the keyed surface sends without waiting on it."""
        ...

    def backup(self, nodes: list[Node]) -> None:
        """Host copies landed: write those among `nodes` that the write policy wants now and
        storage does not hold yet."""
        ...

    def on_hits(self, nodes: Sequence[Node | None]) -> None:
        """`nodes` were hit: write the host copies the write policy wants now."""
        ...

    def write_back(self, nodes: list[Node]) -> int:
        """The host tier evicts these unwritten copies (write_back): write them first;
        returns how many of the leading ones are being written."""
        ...

    def delete(self, skeys: Sequence[bytes], timeout: float = 0.0) -> int | None:
        """Delete these pages from storage on every rank (after the backups sent before);
        the pages every rank deleted when answered within `timeout`, else None."""
        ...

    def retain(self, skeys: Sequence[bytes], *, pin: bool, ttl_s: float,
               priority: int) -> None:
        """Carry a retention down to these pages on every rank (stored now or later)."""
        ...

    def unpin(self, skeys: Sequence[bytes]) -> None:
        """Take the pin off these pages on every rank."""
        ...

    def revoke(self, keys: Iterable[int] | None = None) -> int:
        """Cancel the queries and prefetches in flight that fill only blocks of `keys` (every
        one when None), keeping the pages already read; returns how many."""
        ...
