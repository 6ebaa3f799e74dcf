"""The cache core's copies that feed or read the slower tiers: D2H backups of device
blocks to the host, prefetches from storage into host blocks, and storage backups.

A family of `CacheCore`'s transitions (`kvtier.manager.core.cache`), inherited by it; the
storage tier (`kvtier.manager.storage_tier`) and the scheduler API call them.
"""

from __future__ import annotations

from kvtier.manager.core.host_tier import HostTier
from kvtier.manager.core.nodes import (
    BACKING,
    ENGINE_WRITE,
    EVICTING,
    FROM_STORAGE,
    LOADING,
    PREFETCHING,
    SAVING,
    STORED,
    Node,
)
from kvtier.worker.wire import Priority, TaskKind


class StorageTransitions(HostTier):
    """D2H backups (`_backup`, `backup_hot`; SAVING), prefetch
    (`start_prefetch` / `finish_prefetch`; PREFETCHING, then FROM_STORAGE | STORED), storage
    backup (`start_storage_backup` / `finish_storage_backup`; BACKING, then STORED) and
    `forget_stored`.

    Data structures: the nodes' flags and host blocks (`CoreState`). Invariant: a node
    flagged SAVING, PREFETCHING or BACKING is named by a task in flight and is in no LRU
    list that would let its block be evicted meanwhile.
    """

    # ------------------------------------------------------------------ backups (D2H)

    def _backup(self, nodes: list[Node]) -> None:
        """Copy device blocks to the host in one low-priority D2H task (SAVING), as far as
        host blocks can be had without evicting anything busy."""
        src: list[int] = []
        dst: list[int] = []
        saving: list[Node] = []
        for node in reversed(nodes):  # tail first, so their LRU order stays leaves-first
            if node.host is not None or node.dev is None:
                continue
            hb = self.take_host_block()
            if hb is None:
                break
            node.host = hb
            self._host_in_tree += 1
            node.flags |= SAVING
            if node.dprev is not None:
                self._dev_lru.unlink(node)
            src.append(node.dev)
            dst.append(hb)
            saving.append(node)
        if saving:
            self.counters.d2h_blocks += len(saving)
            self.ledger.submit(TaskKind.D2H, src, dst, saving, Priority.BACKUP)

    def backup_hot(self, nodes: list[Node]) -> None:
        """Back up the nodes a match made hot that have a device copy and no host copy."""
        self._backup([n for n in nodes if n.dev is not None and n.host is None
                      and not n.flags & (SAVING | LOADING | EVICTING)])

    # ------------------------------------------------------------------ storage transitions

    def start_prefetch(self, key: int, skey: bytes, host: int, now: float) -> Node:
        """A node in the tree for `key`, holding host block `host` (from `take_host_block`)
        that a PREFETCH task is filling from storage page `skey` (PREFETCHING: never served
        or freed meanwhile)."""
        node = self._new_host_node(key, host, now, PREFETCHING)
        node.skey = skey
        return node

    def finish_prefetch(self, node: Node, landed: bool) -> None:
        """The prefetch filling `node` was answered: its page landed (a host copy, counted as
        a storage hit at its first hit) or not (its host block is freed)."""
        node.flags &= ~PREFETCHING
        if landed:
            node.flags |= FROM_STORAGE | STORED
        elif node.host is not None:
            self.free_host_copy(node)
        self.after_transfer(node)

    @staticmethod
    def needs_storage_backup(node: Node) -> bool:
        """Whether `node` has a settled host copy storage lacks that nothing is writing yet:
        not detached, stored or backing, and not in transit (prefetched or written by the
        engine: bytes arriving; a D2H: bytes arriving; a load: a failed one moves the host
        copy to a fresh node, which must not be evicted under a BACKUP that reads it)."""
        return not (node.host is None or node.skey is None or node.key is None
                    or node.flags & (STORED | BACKING | PREFETCHING | ENGINE_WRITE
                                     | LOADING | SAVING | EVICTING))

    def start_storage_backup(self, node: Node) -> bool:
        """Mark `node`'s host copy as being written to storage (BACKING: kept meanwhile);
        False when it needs no backup (`needs_storage_backup`)."""
        if not self.needs_storage_backup(node):
            return False
        node.flags |= BACKING
        self.relist(node)
        return True

    def finish_storage_backup(self, node: Node, stored: bool) -> None:
        """The backup of `node` was answered; `stored`: every page of its batch was written.
        Under write_back the copy was written because the host tier was evicting it: a
        written one goes back to the oldest end of the host LRU, the next to be evicted."""
        node.flags &= ~BACKING
        if stored:
            node.flags |= STORED
        self.after_transfer(node)
        storage = self.storage
        if (stored and node.hprev is not None and storage is not None
                and storage.write_policy.on_host_evict):
            self._host_lru.unlink(node)
            self._host_lru.prepend(node)
            if self._host_evict is not None:  # the strategy's next victim, likewise
                self._host_evict.demoted(node)

    def forget_stored(self) -> None:
        """Storage was emptied: no node has a copy there any more."""
        for node in self._map.values():
            node.flags &= ~STORED
        self.counters.storage_forgotten += 1
