"""The steering of a keyed namespace (issue 36): what a router or an operator asks of it.

One family of `KeyedHostCache`'s operations (`kvtier.manager.keyed`; `keyed_state.py` says how
the object is split): per-tier counts of a prefix (`tier_lookup`), retention of host copies and
storage pages (`retain`, `unpin`, `resend_storage_retention`, `storage_emptied`), tenants'
quotas and figures (`set_quota`, `tenant_figures`), an operator's clear (`clear`) and warming
the host tier from storage (`warm`). The tenants, quotas and retention themselves are kept by
`kvtier.manager.tenants.TenantBook`; the host copies change only through the core's named
transitions (`write_off`), the pages through the storage tier's tasks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvtier.manager.core.nodes import STORED
from kvtier.manager.keyed_state import KeyedState, engine_key
from kvtier.manager.tenants import Retention

_monotonic = time.monotonic


class KeyedSteering(KeyedState):
    """Tier lookups, retention, quotas, clears and warming of a keyed namespace (issue 36).

    Data structures: none of its own; the tenant book (`tenants`), the tier event log
    (`events`), the storage tier's hooks and the core's tree, all held by `KeyedState`.
    Invariants: a change is made whole under the manager's lock or not at all (a pin over
    quota is refused whole); a clear announces each tier's removal only where it happened.
    """

    def tier_lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """How many leading blocks of `hashes` this namespace holds, per tier: `host` (ready
        on the host now), then `storage` (the blocks after those that storage's index lists:
        a router's estimate, asking storage nothing), `pending` (being written or prefetched,
        right after the host ones). Read only: no LRU touched, no query asked."""
        with self._lock:
            host = self.count_hits(hashes)
            pending = 0
            for h in hashes[host:]:
                node = self.m.lookup(engine_key(h))
                if node is None or node.host is None:
                    break
                pending += 1
            storage = 0
            if self.storage is not None:
                for h in hashes[host:]:
                    if not self.storage.holds(self.storage_key(h)):
                        break
                    storage += 1
            return {"host": host, "pending": pending, "storage": storage}

    def retain(self, hashes: Sequence[bytes], retention: Retention,
               tenant: str | None = None) -> dict[str, int]:
        """Pin / TTL / priority for these blocks (`TenantBook.retain`: a pin over quota is
        refused whole, nothing changed). With a storage tier the same retention goes to the
        blocks' storage pages, stored now or written later (`StorageTier.retain`), once the
        book accepted it."""
        with self._lock:
            items = [(k, self.m.lookup(k)) for k in map(engine_key, hashes)]
            now = _monotonic()
            out = self.tenants.retain(items, tenant, retention, now)
            if self.storage is not None and hashes:
                skeys = [self.storage_key(h) for h in hashes]
                self.storage.retain(skeys, pin=retention.pin, ttl_s=retention.ttl_s,
                                    priority=retention.priority)
                self.tenants.storage_marks.retain(skeys, retention, now)
            return out

    def unpin(self, hashes: Sequence[bytes]) -> int:
        """Unpin these blocks in the host tier and, with a storage tier, their pages."""
        with self._lock:
            n = self.tenants.unpin(map(engine_key, hashes))
            if self.storage is not None and hashes:
                skeys = [self.storage_key(h) for h in hashes]
                self.storage.unpin(skeys)
                self.tenants.storage_marks.unpin(skeys)
            return n

    def resend_storage_retention(self) -> int:
        """A worker was replaced: its storage marks died with it. Send again, to every rank,
        the retention the book sent and that still holds (`StorageMarks.resend`: one RETAIN
        task per kind of retention; the other ranks' marks merge it without change).
        Returns the pages named."""
        if self.storage is None:
            return 0
        with self._lock:
            groups = self.tenants.storage_marks.resend(_monotonic())
            for skeys, r in groups:
                self.storage.retain(skeys, pin=r.pin, ttl_s=r.ttl_s, priority=r.priority)
            return sum(len(k) for k, _ in groups)

    def storage_emptied(self) -> None:
        """Every storage page of the namespace was deleted (a storage reset): so were their
        marks, and no tenant's page is left to clear."""
        with self._lock:
            self.tenants.storage_marks.forget()
            self.tenants.stored_pages.forget()

    def set_quota(self, tenant: str | None, blocks: int | None) -> None:
        with self._lock:
            self.tenants.set_quota(tenant, blocks)

    def tenant_figures(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return self.tenants.figures(_monotonic())

    def clear(self, *, hashes: Sequence[bytes] | None = None, tenant: str | None = None,
              storage: bool = False, wait_s: float = 0.0) -> dict[str, int | None]:
        """An operator's clear (issue 36): these blocks, every block of `tenant`, or every
        block of the namespace leave the host tier now (the core's write-off: a copy in
        flight keeps its block until its transfer ends, never served again); with `storage`
        their pages are deleted too (`StorageTier.delete`: one DELETE task behind earlier
        backups; a clear by hashes deletes the pages of blocks not on the host as well, and
        so does a clear by tenant or of everything for the blocks the book remembers who
        stored, `StoredPages`: the newest 65,536). With tier events on, every removal is
        announced at once, each tier's only where it happened: with `storage`, host and
        storage (where reported), as `remove` does; without, the host only, as an eviction
        (the pages stay servable). Counted in `removals["clear"]`."""
        with self._lock:
            if hashes is not None:
                named = [(engine_key(h), h) for h in dict.fromkeys(hashes)]
            else:
                keys = (self.tenants.keys_of(tenant) if tenant is not None else
                        [n.key for n in self.m.cached_nodes() if n.key is not None])
                names = {} if self.events is None else self.events.names
                named = [(k, names.get(k, b"")) for k in keys]
                if storage and self.storage is not None:
                    # the pages of the tenant's (every) blocks no longer on the host
                    on_host = set(keys)
                    named += [(k, h) for h in self.tenants.stored_pages.hashes(tenant)
                              for k in (engine_key(h),) if k not in on_host]
            skeys: list[bytes] = []
            host = 0
            off: list[int] = []
            backed: list[int] = []  # of them, with a storage page
            for k, h in named:
                node = self.m.lookup(k)
                self.tenants.forget(k)
                if node is not None:
                    if node.skey is not None:
                        skeys.append(node.skey)
                    if node.flags & STORED:
                        backed.append(k)
                    self.m.write_off(node)
                    off.append(k)
                    host += 1
                elif h and storage and self.storage is not None:
                    skeys.append(self.storage_key(h))
            if self.events is not None:
                if storage and self.storage is not None:
                    self.events.removed([(k, h) for k, h in named if h])
                else:
                    # host only: the pages stay and still serve (a later request prefetches
                    # them), so storage is announced only where it was not yet, as for an
                    # eviction; announcing a storage removal here misled routers
                    self.events.evicted(off, backed)
            deleted: int | None = 0
            if storage and self.storage is not None and skeys:
                deleted = self.storage.delete(skeys, wait_s)
                self.tenants.storage_marks.forget(skeys)  # the worker drops their marks
                self.tenants.stored_pages.forget(h for _, h in named if h)
            counts = self.removals.setdefault("clear", [0, 0])
            counts[0] += host
            counts[1] += len(skeys) if storage else 0
            self.m.flush()
            return {"host_blocks_removed": host,
                    "storage_pages_asked": len(skeys) if storage and self.storage else 0,
                    "storage_pages_deleted": deleted}

    def warm(self, hashes: Sequence[bytes], warm_id: str) -> str:
        """Bring these blocks from storage into the host tier ahead of traffic: one storage
        query as a request `warm_id` whose answer prefetches every leading block storage
        holds (threshold 0). Returns what the lookup found ("hit": already on the host,
        "pending", "retry": asked, "miss")."""
        if not hashes:
            return "miss"
        with self._lock:
            self._queries.pop(warm_id, None)
            first = self.count_hits(hashes)
            if first == len(hashes):
                return "hit"
            found = self.lookup(hashes[first], warm_id, list(hashes[first + 1:]),
                                threshold_tokens=0)
            return found.value
