"""The cache core's engine transitions: the key-addressed surface's host copies that an
engine itself reads and writes (`kvtier.manager.keyed`), and the host copies a node service
hands to its successor (issue 37).

A family of `CacheCore`'s transitions (`kvtier.manager.core.cache`), inherited by it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.manager.core.nodes import (
    ENGINE_READ,
    ENGINE_WRITE,
    FROM_STORAGE,
    PREFETCHING,
    STORED,
    Node,
)
from kvtier.manager.core.state import CoreState
from kvtier.manager.errors import InvalidRequestError


class EngineTransitions(CoreState):
    """Engine writes (`start_engine_write` / `finish_engine_write`; ENGINE_WRITE),
    engine reads (`start_engine_read` / `finish_engine_read`; ENGINE_READ), abandoned copies
    (`drop_engine_io`), `touch_host_copy`, and the hand-over (`ready_host_copies`,
    `adopt_host_copies`, `adopt_abandoned_writes`).

    Data structures: the tree map, the host pool and list (`CoreState`). Invariants: a
    copy being written (ENGINE_WRITE) or prefetched is never served nor listed as ready; an
    adoption is all or nothing.
    """

    def start_engine_write(self, key: int, host: int, skey: bytes | None, now: float) -> Node:
        """A node in the tree for `key` whose host block `host` (from `take_host_block`) the
        engine is writing (ENGINE_WRITE: never served or freed meanwhile)."""
        node = self._new_host_node(key, host, now, ENGINE_WRITE)
        if skey is not None:
            node.skey = skey
        return node

    def ready_host_copies(self) -> list[tuple[int, int, bytes | None, bool]]:
        """Every host copy whose bytes are whole, as (key, host block, storage key, stored),
        least recently used first: what a node service hands over (issue 37). Left out:
        copies being written by an engine or prefetched (their bytes may be partial)."""
        nodes = [n for n in self._map.values()
                 if n.host is not None and not n.flags & (ENGINE_WRITE | PREFETCHING)]
        nodes.sort(key=lambda n: n.last)
        return [(n.key, n.host, n.skey, bool(n.flags & STORED))  # type: ignore[misc]
                for n in nodes]

    def ready_host_copy(self, key: int) -> tuple[int, int, bytes | None, bool] | None:
        """`key`'s host copy as `ready_host_copies` lists it, or None while it has no whole
        one (not cached, not on the host, being written or prefetched)."""
        n = self._map.get(key)
        if n is None or n.host is None or n.flags & (ENGINE_WRITE | PREFETCHING):
            return None
        return (key, n.host, n.skey, bool(n.flags & STORED))

    def adopt_abandoned_writes(self, pages: Sequence[tuple[int, int]],
                               now: float) -> list[Node]:
        """Engine stores a node service's predecessor had abandoned and still held when it
        handed over (issue 37), as (key, host block): each a node marked ENGINE_WRITE (never
        served; its block out of the free list) for the caller to hold until their deadline
        and then drop (`drop_engine_io`): an engine's late copy may still land there. All or
        nothing, as `adopt_host_copies`."""
        keys = set()
        for key, _ in pages:
            if key in keys or self._map.get(key) is not None:
                raise InvalidRequestError(f"held key {key:x}: twice, or already cached")
            keys.add(key)
        self._host_pool.take([hb for _, hb in pages])
        return [self._new_host_node(key, hb, now, ENGINE_WRITE) for key, hb in pages]

    @staticmethod
    def host_copy_ready(node: Node) -> bool:
        """Whether `node`'s host copy is whole (not being written by an engine nor
        prefetched)."""
        return node.host is not None and not node.flags & (ENGINE_WRITE | PREFETCHING)

    def adopt_host_copies(self, pages: Sequence[tuple[int, int, bytes | None, bool]],
                          now: float) -> list[Node]:
        """Host copies a node service's predecessor handed over (issue 37), as (key, host
        block, storage key, stored), oldest first: each a ready node holding that block
        (taken out of the free list), appended to the host LRU in that order. All or
        nothing: a key already in the tree or a block not free raises before any change
        (BlockPoolError / InvalidRequestError)."""
        keys = set()
        for key, _, _, _ in pages:
            if key in keys or self._map.get(key) is not None:
                raise InvalidRequestError(f"adopted key {key:x}: twice, or already cached")
            keys.add(key)
        self._host_pool.take([hb for _, hb, _, _ in pages])
        nodes = []
        for key, hb, skey, stored in pages:
            node = self._new_host_node(key, hb, now, STORED if stored and skey else 0)
            if skey is not None:
                node.skey = skey
            self.relist(node)
            nodes.append(node)
        return nodes

    def finish_engine_write(self, node: Node, ok: bool) -> bool:
        """The engine's write of `node` ended; returns whether the copy is now readable
        (ok and still in the tree). A failed one frees the host block."""
        node.flags &= ~ENGINE_WRITE
        ready = ok and node.key is not None
        if not ready and node.host is not None and node.key is not None:
            self.free_host_copy(node)
        self.after_transfer(node)
        return ready

    def start_engine_read(self, node: Node, first: bool, tokens: int, now: float) -> bool:
        """The engine starts copying `node`'s host copy into its KV (`first`: no other read
        of it is in flight, ENGINE_READ is set): a host hit of `tokens` tokens (a storage
        hit the first time a prefetched copy is read). Returns whether it counted as a
        storage hit (FROM_STORAGE is cleared here)."""
        if first:
            node.flags |= ENGINE_READ
        stored = bool(node.flags & FROM_STORAGE)
        if stored:  # its first hit since it came from storage
            node.flags &= ~FROM_STORAGE
            self.counters.hit_storage_tokens += tokens
        else:
            self.counters.hit_host_tokens += tokens
        node.hits += 1
        node.last = now
        self.relist(node)
        return stored

    def finish_engine_read(self, node: Node) -> None:
        """The last engine read of `node` in flight ended."""
        node.flags &= ~ENGINE_READ
        self.after_transfer(node)

    def drop_engine_io(self, node: Node) -> None:
        """An engine copy of `node` abandoned for good: reads end; a write is dropped, never
        made readable."""
        writing = node.flags & ENGINE_WRITE
        node.flags &= ~(ENGINE_READ | ENGINE_WRITE)
        if writing and node.host is not None and node.key is not None:
            self.free_host_copy(node)
        self.after_transfer(node)

    def touch_host_copy(self, node: Node, now: float) -> None:
        """The engine hit `node` in its own device cache: its host copy is the most
        recently used."""
        node.last = now
        if node.hprev is not None:
            self.relist_tail(node)
