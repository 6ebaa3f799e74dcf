"""The key-addressed surface's state, declared once for every family of its operations.

`KeyedHostCache` (`kvtier.manager.keyed`) is one object: its constructor sets every attribute
`KeyedState` declares, and its operations are methods of it, written by family in the modules
it inherits (plain methods, no delegate objects):

* here, `KeyedState`: the attributes (annotations only, so that each family type-checks on its
  own under strict mypy), the types they name (`Owner`, `Lookup`, `_Query`), an engine hash's
  tree key (`engine_key`) and a block's storage page name (`storage_key`), `generation`;
* `keyed_steering.py`, `KeyedSteering`: the steering of issue 36 (tier lookups, retention,
  quotas, tenant figures, operators' clears, warming);
* `keyed.py`, `KeyedHostCache`: the constructor and the engine's own traffic (lookups and
  storage queries, loads, stores, tier events, `remove`, engine resets, `check_invariants`);
  its module docstring draws the copies' life cycle and names every data structure and
  invariant.

Callers import every name from `kvtier.manager.keyed`, which re-exports those defined here.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Hashable, Sequence
from enum import Enum
from typing import TYPE_CHECKING

from kvtier.manager.core.cache import CacheCore
from kvtier.manager.core.hooks import StorageHooks
from kvtier.manager.core.nodes import Node
from kvtier.manager.keyed_events import TierEventLog
from kvtier.manager.keys import keyed_storage_key
from kvtier.manager.tenants import TenantBook

# Who prepared an open copy: None for the one engine of an embedded cache, a session id for
# an engine attached to the node service (any hashable value: equal owners are one engine).
Owner = Hashable | None


class Lookup(Enum):
    """What `KeyedHostCache.lookup` found for one key."""

    HIT = "hit"  # on the host, ready to load
    PENDING = "pending"  # being written by the engine or prefetched from storage
    MISS = "miss"  # in no tier kvtier can reach
    RETRY = "retry"  # a storage query is out: ask again later

class _Query:
    """One storage query of a request: the keys it covered (in the order asked), whether it
    was answered and, once answered, how many leading keys storage held (`found`); until
    when a lookup waits for its answer (`wait_until`: `UNLISTED_WAIT_S` after asking when
    storage's index does not list the first key, the transfer timeout when it does)."""

    __slots__ = ("done", "found", "keys", "seq", "wait_until")

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.seq = 0
        self.done = False
        self.found = 0
        self.wait_until = 0.0

    def answer(self, found: int) -> None:
        self.found = found
        self.done = True


def engine_key(block_hash: bytes) -> int:
    """kvtier's tree key for an engine block hash: its first 16 bytes as an int (the hash is
    already a digest of the whole prefix; 0.07 us per block), or a 16-byte BLAKE2b of a
    shorter one."""
    if len(block_hash) >= 16:
        return int.from_bytes(block_hash[:16], "little")
    return int.from_bytes(hashlib.blake2b(block_hash, digest_size=16).digest(), "little")


class KeyedState:
    """The attributes `KeyedHostCache.__init__` sets (annotations only) and the primitives
    every family of its operations calls.

    Data structures and invariants: those of `KeyedHostCache` (keyed.py's module docstring
    names each; `check_invariants` asserts them). `lookup` and `count_hits`, written in
    keyed.py, are declared here for the type checker only, for the families that call them.
    """

    m: CacheCore
    storage: StorageHooks | None
    block_size: int
    namespace: bytes
    host_ready: Callable[[], bool]
    _lock: threading.RLock
    _writers: dict[tuple[Owner, bytes], Node]
    _readers: dict[tuple[Owner, bytes], list[Node]]
    _done_unmatched: dict[tuple[Owner, bytes], int]
    _reads: dict[Node, int]
    _abandoned: list[Node]
    _queries: dict[str, dict[bytes, tuple[_Query, int]]]
    _open_queries: int
    _asked: set[str]
    counters: dict[str, int]
    removals: dict[str, list[int]]
    events: TierEventLog | None
    tenants: TenantBook

    if TYPE_CHECKING:
        def lookup(self, block_hash: bytes, request_id: str = "",
                   following: Sequence[bytes] = (), *,
                   threshold_tokens: int | None = None) -> Lookup: ...

        def count_hits(self, hashes: Sequence[bytes]) -> int: ...

    # ------------------------------------------------------------------ keys

    def storage_key(self, block_hash: bytes) -> bytes:
        """The page name of a block in storage (`keys.keyed_storage_key`)."""
        return keyed_storage_key(self.namespace, block_hash)

    @property
    def generation(self) -> int:
        """Changes whenever every cached host copy was dropped at once (a lost worker): an
        engine copy prepared under another generation must not touch the new pools."""
        return self.m.counters.lost_all
