"""The cache core's device eviction: making room for `n` device blocks.

A family of `CacheCore`'s transitions (`kvtier.manager.core.cache`), inherited by it: the
device LRU list's own order (device-only runs in one compiled call, `native.evict_drop`) or
a `cache.eviction_policy` strategy's victims; victims with a host copy or a host block to
demote to keep their content on the host (a D2H task, EVICTING), the others are dropped.
"""

from __future__ import annotations

import time

from kvtier.manager.core.host_tier import HostTier
from kvtier.manager.core.nodes import EVICTING, Node
from kvtier.manager.errors import OutOfBlocksError, TransferTimeoutError
from kvtier.manager.policies import EvictionStrategy
from kvtier.worker.wire import Priority, TaskKind

_monotonic = time.monotonic


class DeviceEviction(HostTier):
    """Device room for the match, pin and allocate paths (`_room_for`,
    `_make_room`, `_await_room`, `_evict_device`) and the device strategy's feed
    (`policy_released`).

    Data structures: `_dev_pool`, `_dev_lru`, `_evict` (`CoreState`). Invariants: only
    listed (evictable) nodes are evicted; `_make_room` either frees `n` blocks or raises
    OutOfBlocksError having evicted nothing.
    """

    def _room_for(self, n: int) -> bool:
        return self._dev_pool.num_free + self._dev_lru.size >= n

    def _make_room(self, n: int, who: str) -> None:
        """Evict until `n` device blocks are free. When free and evictable blocks are too
        few but transfers in flight will free or release enough, first wait for them
        (bounded by `transfer_timeout_s`, lock released). Raises OutOfBlocksError (having
        evicted nothing) if even evicting every evictable block would not be enough."""
        pool = self._dev_pool
        if pool.num_free >= n:
            return
        if pool.num_free + self._dev_lru.size < n:
            busy = self._await_room(n)
            if pool.num_free + self._dev_lru.size < n:
                more = f"; {busy} more busy in transfers in flight" if busy else ""
                raise OutOfBlocksError(
                    f"{who}: {n} device blocks needed, {pool.num_free} free and "
                    f"{self._dev_lru.size} evictable of {pool.capacity}{more}")
        while pool.num_free < n:
            if not self._dev_lru.size:  # a demotion waited for was cancelled by a hit
                raise OutOfBlocksError(
                    f"{who}: {n} device blocks needed, {pool.num_free} free and nothing "
                    f"left to evict of {pool.capacity}")
            demoting = self._evict_device(n - pool.num_free)
            if demoting:
                self.ledger.flush()
                self.wait_unlocked(demoting)

    def _await_room(self, n: int) -> int:
        """Wait (lock released, at most `transfer_timeout_s` in all) for the transfers in
        flight that will make free + evictable reach `n` device blocks, as long as they
        can. Returns the device blocks still busy in transfers."""
        pool, lru = self._dev_pool, self._dev_lru
        deadline = _monotonic() + self.transfer_timeout_s
        while True:
            busy = self.ledger.busy_device_blocks()
            total = sum(b for _, b in busy)
            short = n - pool.num_free - lru.size
            if short <= 0 or total < short:
                return total
            left = deadline - _monotonic()
            if left <= 0:
                return total
            seqs: list[int] = []
            got = 0
            for seq, b in busy:  # the oldest tasks that together free enough
                seqs.append(seq)
                got += b
                if got >= short:
                    break
            try:
                self.wait_unlocked(seqs, left)
            except TransferTimeoutError:
                return sum(b for _, b in self.ledger.busy_device_blocks())

    def _evict_device(self, n: int) -> list[int]:
        """Evict up to `n` LRU device blocks; returns the seqs of demotions to wait for."""
        lru = self._dev_lru
        pool = self._dev_pool
        policy = self.policy
        host_tier = self._host_pool.capacity > 0
        c = self.counters
        strategy = self._evict
        if strategy is not None:
            victims = self._policy_victims(strategy, n)
            if not host_tier:
                for victim in victims:
                    freed_one = victim.dev
                    victim.dev = None
                    self._forget(victim)
                    pool.free_one(freed_one)  # type: ignore[arg-type]
                self._dev_in_tree -= len(victims)
                c.evicted_device_drop += len(victims)
                return []
        else:
            victims = []
        if strategy is None and not host_tier:
            # Device only: every victim is dropped. Unlink a run of victims from the head of
            # the list in one pass (compiled or not, see manager.core.native) and free their
            # blocks in one call.
            freed = self._loops.evict_drop(self._map, lru.head, n)
            lru.size -= len(freed)
            self._dev_in_tree -= len(freed)
            c.evicted_device_drop += len(freed)
            pool.free(freed)
            return []
        demote_src: list[int] = []
        demote_dst: list[int] = []
        demote_nodes: list[Node] = []
        for i in range(n):
            if strategy is not None:
                if i == len(victims):
                    break
                victim = victims[i]
            else:
                oldest = lru.oldest()
                if oldest is None:
                    break
                victim = oldest
                lru.unlink(victim)
            if victim.host is not None:
                c.evicted_device_demote += 1
                pool.free_one(victim.dev)  # type: ignore[arg-type]
                victim.dev = None
                self._dev_in_tree -= 1
                continue
            if policy.demote_on_evict and host_tier:
                hb = self.take_host_block()
                if hb is not None:
                    victim.host = hb
                    self._host_in_tree += 1
                    victim.flags |= EVICTING
                    demote_src.append(victim.dev)  # type: ignore[arg-type]
                    demote_dst.append(hb)
                    demote_nodes.append(victim)
                    continue
            c.evicted_device_drop += 1
            pool.free_one(victim.dev)  # type: ignore[arg-type]
            victim.dev = None
            self._dev_in_tree -= 1
            self._forget(victim)
        if not demote_nodes:
            return []
        c.evicted_device_demote += len(demote_nodes)
        c.d2h_blocks += len(demote_nodes)
        return [self.ledger.submit(TaskKind.D2H, demote_src, demote_dst, demote_nodes,
                                   Priority.EVICT)]

    def _policy_victims(self, strategy: EvictionStrategy, n: int) -> list[Node]:
        """Up to `n` victims in the strategy's order, unlinked from the device LRU list (its
        oldest when the strategy has no live entry left: cannot happen while every listing
        goes through `relist` or `release`, kept so eviction never stalls)."""
        lru = self._dev_lru
        out: list[Node] = []
        while len(out) < n and lru.size:
            victim: Node | None = strategy.victim()
            if victim is None:
                victim = lru.oldest()
                self.counters.eviction_policy_fallbacks += 1
                if victim is None:
                    break
            lru.unlink(victim)
            out.append(victim)
        return out

    def policy_released(self, nodes: list[Node | None]) -> None:
        """A request's nodes were released (the scheduler's `release`): the eviction strategy
        learns which became evictable, at which depth."""
        strategy = self._evict
        if strategy is not None:
            strategy.released(nodes)
            lru = self._dev_lru
            tree = self._map
            strategy.compact(iter(lru), lru.size,
                             lambda k: (nd := tree.get(k)) is not None and nd.dev is not None)
