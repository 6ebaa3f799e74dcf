"""The cache core's host tier: handing out host blocks, evicting host copies for them.

A family of `CacheCore`'s transitions (`kvtier.manager.core.cache`), inherited by it: the
host list's or the `cache.host_eviction_policy` strategy's victims, the storage write_back
batches that write unwritten victims first, and `host_victims`, which predicts exactly what
`take_host_block` will evict.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.manager.core.hooks import StorageHooks
from kvtier.manager.core.nodes import STORED, Node
from kvtier.manager.core.state import CoreState
from kvtier.manager.policies import WRITE_BACK_BATCH


class HostTier(CoreState):
    """Host blocks for the other families and the core's clients (`take_host_block`,
    `give_host_blocks`, `host_victims`, `write_back_for_room`).

    Data structures: `_host_pool`, `_host_lru`, `_host_evict` (`CoreState`). Invariant: a
    host block is handed out either from the free list or by evicting one listed (so idle)
    host copy, never one a transfer or a hold uses; `host_victims(n)` names the copies the
    next `n` calls evict, in order.
    """

    def take_host_block(self) -> int | None:
        """A free host block, evicting a host copy if needed (the host list's oldest, or the
        `cache.host_eviction_policy` strategy's victim); None when every host block is busy.
        A copy evicted with a storage key that storage lacks is counted
        (`evicted_host_unstored`); under write_back such copies are written first and a
        written one goes instead (`_write_back_oldest`, in the same order)."""
        pool = self._host_pool
        if pool.num_free:
            return pool.allocate_one()
        strategy = self._host_evict
        storage = self.storage
        write_back = storage is not None and storage.write_policy.on_host_evict
        victim: Node | None
        if strategy is not None:
            if write_back:
                # The strategy's next victims stand in for the list's oldest: unwritten ones
                # go to storage as a batch (BACKING unlists them, so their heap entries die),
                # and the strategy's lowest live entry is then the copy to evict.
                head = strategy.upcoming(1)
                if (head and head[0].skey is not None and not head[0].flags & STORED
                        and self._write_back_oldest(storage) is None):  # type: ignore[arg-type]
                    return None
            victim = strategy.victim()
            if victim is None:  # not reached while every listing reaches the strategy
                victim = self._host_lru.oldest()
                if victim is None:
                    return None
                self.counters.eviction_policy_fallbacks += 1
        else:
            victim = self._host_lru.oldest()
            if victim is None:
                return None
            if write_back and victim.skey is not None and not victim.flags & STORED:
                victim = self._write_back_oldest(storage)  # type: ignore[arg-type]
                if victim is None:
                    return None
        if victim.skey is not None and not victim.flags & STORED:
            self.counters.evicted_host_unstored += 1
        self._host_lru.unlink(victim)
        hb = victim.host
        victim.host = None
        self._host_in_tree -= 1
        self.counters.evicted_host_drop += 1
        if victim.dev is None:
            self._forget(victim)
        return hb  # handed over without passing through the free list

    def _host_order(self, n: int) -> Iterable[Node]:
        """The host copies in eviction order: the list's, oldest first, or the next `n`
        victims of the host strategy (read only)."""
        strategy = self._host_evict
        if strategy is None:
            return iter(self._host_lru)
        out: list[Node] = strategy.upcoming(n)
        return out

    def _write_back_oldest(self, storage: StorageHooks) -> Node | None:
        """write_back: the next host copy to evict (the oldest, or the host strategy's next
        victim) is one storage lacks. Send the next unwritten copies in eviction order (up
        to `WRITE_BACK_BATCH`, in one BACKUP task: BACKING takes them out of the LRU) and
        return the copy to evict instead: the next written one within reach; else (none
        within reach, or the rate limit refused part of the batch) the next unwritten copy
        left, evicted unwritten; None when every host copy is busy now."""
        batch: list[Node] = []
        victim: Node | None = None
        for node in self._host_order(WRITE_BACK_BATCH + 1):  # at most that many steps
            if (node.skey is None or node.flags & STORED
                    or len(batch) >= WRITE_BACK_BATCH):
                victim = node
                break
            batch.append(node)
        started = storage.write_back(batch)
        return batch[started] if started < len(batch) else victim

    def write_back_for_room(self) -> None:
        """write_back: a store was refused for room (too few evictable host copies: the
        oldest are unwritten). Send the oldest unwritten copies to storage (one batch, as
        an eviction would) so that, once written, they can make room; nothing is evicted."""
        storage = self.storage
        if storage is not None and storage.write_policy.on_host_evict:
            self._write_back_oldest(storage)

    def host_victims(self, n: int) -> list[int]:
        """The keys of the host copies the next `n` calls of `take_host_block` would evict
        (once the free list is empty), oldest first (read only; under write_back, with
        every write-back batch accepted: each call passes over up to `WRITE_BACK_BATCH`
        unwritten copies, which it sends to storage instead)."""
        keys: list[int] = []
        if n <= 0:
            return keys
        storage = self.storage
        write_back = storage is not None and storage.write_policy.on_host_evict
        passed = 0
        order = self._host_order(n * (WRITE_BACK_BATCH + 1) if write_back else n)
        for node in order:
            if (write_back and node.skey is not None and not node.flags & STORED
                    and passed < WRITE_BACK_BATCH):
                passed += 1
                continue
            passed = 0
            if node.key is not None:
                keys.append(node.key)
            if len(keys) >= n:
                break
        return keys

    def give_host_blocks(self, ids: list[int]) -> None:
        """Return host blocks taken with `take_host_block` and never used."""
        if ids:
            self._host_pool.free(ids)
