"""The manager's side of the storage tier (L3): hit queries, prefetch into the host tier, and
backup from the host tier.

Pages are named by SHA-256 storage keys (`kvtier.manager.keys.storage_keys`), so any manager
instance serving the same model finds the pages another one wrote. Nothing here touches bytes:
it emits QUERY, PREFETCH, BACKUP and CLEAR tasks and applies their outcomes under the
manager's lock.

The tier never sees the manager's internals: it is handed a `CacheState`
(`kvtier.manager.cache_state`), the few operations it needs on the tree, the host free list
and the task queue, and the scheduler calls it through `StorageHooks`. This module does not
import the scheduler, nor the scheduler this one; `kvtier.manager.stack` wires the two.

Prefetch life cycle::

    match/prefetch misses >= prefetch_threshold tokens after the device and host tiers
      -> QUERY (how many leading pages does storage hold? minimum over ranks)
      -> enough, and host blocks free within `prefetch_host_blocks_limit`:
         nodes created on the host with PREFETCHING, one PREFETCH task
      -> lands: the first `result` pages (read and verified on every rank) become host
         copies (FROM_STORAGE: their first hit counts as a storage hit); the rest, or
         everything of a failed or revoked prefetch, is freed -- a miss, never data

Prefetch policies decide what `match` does when the next block is being prefetched:
`best_effort` takes what has landed and never waits; `wait_complete` waits for the prefetch;
`timeout` waits at most `timeout_base_s + timeout_per_1k_tokens_s * tokens / 1000`.

Backup: every block that lands on the host (a write-through backup, a hot block under
write_through_selective, a write-back demotion) is written to storage once, asynchronously,
in one BACKUP task per batch; BACKING keeps its host copy alive meanwhile.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvtier.manager.cache_state import CacheState, RequestState
from kvtier.manager.errors import TransferTimeoutError
from kvtier.manager.keys import storage_keys
from kvtier.manager.tree import BACKING, FROM_STORAGE, PREFETCHING, STORED, Node
from kvtier.worker.wire import Completion, Priority, Task, TaskKind

if TYPE_CHECKING:
    from kvtier.manager.config import KvtierConfig


class StorageTier:
    """Prefetch and backup decisions of one manager (implements `StorageHooks`).

    Data structures: `_prefetch_of` node -> seq of the PREFETCH task filling it;
    `_revoked` seqs of prefetches whose result must be thrown away; `prefetching_blocks`
    host blocks currently held by prefetches (bounded by `limit`).
    """

    def __init__(self, manager: CacheState, cfg: KvtierConfig) -> None:
        s = cfg.storage
        self.m = manager
        self.bs = cfg.cache.block_size
        self.page_bytes = manager.page_bytes
        self.ranks = cfg.workers.count
        self.threshold_tokens = s.prefetch_threshold
        self.policy = s.prefetch_policy
        self.limit = cfg.effective_prefetch_host_blocks_limit()
        self.timeout_base_s = s.timeout_base_s
        self.timeout_per_1k_s = s.timeout_per_1k_tokens_s
        self.backend = s.backend
        self.prefetching_blocks = 0
        self._prefetch_of: dict[Node, int] = {}
        self._revoked: set[int] = set()
        self.counters: dict[str, int] = dict.fromkeys((
            "queries", "query_hit_pages", "prefetch_tasks", "prefetch_pages_issued",
            "prefetch_pages_completed", "prefetch_pages_revoked", "backup_tasks",
            "backup_pages", "backup_failed_pages", "errors_query", "errors_prefetch",
            "errors_backup", "errors_clear"), 0)

    # ------------------------------------------------------------------ keys

    def request_skeys(self, req: RequestState, token_ids: Any, upto: int) -> list[bytes]:
        """The request's storage keys for its first `upto` blocks (computed once, chained
        from the matched nodes' keys where they have them)."""
        sk = req.skeys
        if not sk:
            for node in req.nodes:
                if node is None or node.skey is None:
                    break
                sk.append(node.skey)
        if len(sk) < upto:
            sk.extend(storage_keys(token_ids, self.bs, parent=sk[-1] if sk else b"",
                                   start_block=len(sk), num_blocks=upto - len(sk),
                                   extra_keys=req.extra_keys))
        return sk

    # ------------------------------------------------------------------ match hook

    def on_miss(self, req: RequestState, token_ids: Any, start: int, cap: int) -> bool:
        """Called by `match` (lock held) when the device and host tiers end at block
        `start` of `cap` matchable blocks. Issues a query/prefetch when none is under way
        and, per policy, waits for it. Returns True when the walk should look again."""
        if (cap - start) * self.bs < self.threshold_tokens:
            return False
        node = self.m.lookup(req.keys[start])
        # One budget for the query and the prefetch together: `timeout` bounds the whole wait.
        deadline = time.monotonic() + self._wait_budget(cap - start)
        if node is None:
            seq = self.query(req, token_ids, start, cap)
            if self.policy == "best_effort":
                return False  # it lands for later requests of the same prefix
            try:
                self.m.wait_unlocked([seq], max(0.0, deadline - time.monotonic()))
            except TransferTimeoutError:
                return False
            node = self.m.lookup(req.keys[start])
            if node is None:
                return False
            if not node.flags & PREFETCHING:
                return True  # the prefetch landed while we waited for the query: walk again
        if not node.flags & PREFETCHING or self.policy == "best_effort":
            return False
        prefetch = self._prefetch_of.get(node)
        if prefetch is None:
            return False
        try:
            self.m.wait_unlocked([prefetch], max(0.0, deadline - time.monotonic()))
        except TransferTimeoutError:
            return False
        return True

    def _wait_budget(self, blocks: int) -> float:
        if self.policy == "timeout":
            return self.timeout_base_s + self.timeout_per_1k_s * blocks * self.bs / 1000
        return self.m.transfer_timeout_s

    # ------------------------------------------------------------------ query and prefetch

    def query(self, req: RequestState, token_ids: Any, start: int, cap: int) -> int:
        """Ask storage how many of blocks start..cap it holds; the answer starts a prefetch
        when it is worth one. Returns the query's seq."""
        skeys = self.request_skeys(req, token_ids, cap)[start:cap]
        keys = req.keys[start:cap]
        m = self.m
        seq = m.next_seq()
        task = Task(seq, TaskKind.QUERY, [], [], list(skeys), Priority.PREFETCH)
        self.counters["queries"] += 1

        def done(ok: bool, comp: Completion) -> None:
            self._on_query(ok, comp, keys, skeys)

        m.track(task, [], on_done=done)
        return seq

    def _on_query(self, ok: bool, comp: Completion, keys: list[int],
                  skeys: list[bytes]) -> None:
        if not ok:
            self.counters["errors_query"] += 1
            return
        n = min(comp.result, len(keys))
        self.counters["query_hit_pages"] += n
        room = self.limit - self.prefetching_blocks
        n = min(n, room)
        if n * self.bs < self.threshold_tokens:
            return
        m = self.m
        now = time.monotonic()
        nodes: list[Node] = []
        dst: list[int] = []
        fetch_keys: list[bytes] = []
        for key, skey in zip(keys[:n], skeys[:n], strict=True):
            if m.lookup(key) is not None:
                continue  # cached meanwhile
            hb = m.take_host_block()
            if hb is None:
                break
            node = m.new_host_node(key, hb, now)
            node.flags = PREFETCHING
            node.skey = skey
            m.adopt_host_node(node)
            nodes.append(node)
            dst.append(hb)
            fetch_keys.append(skey)
        if not nodes:
            return
        seq = m.next_seq()
        task = Task(seq, TaskKind.PREFETCH, [], dst, fetch_keys, Priority.PREFETCH)
        for node in nodes:
            self._prefetch_of[node] = seq
        self.prefetching_blocks += len(nodes)
        self.counters["prefetch_tasks"] += 1
        self.counters["prefetch_pages_issued"] += len(nodes)
        m.track(task, nodes, on_done=lambda ok, comp: self._on_prefetch(seq, nodes, ok, comp))

    def _on_prefetch(self, seq: int, nodes: list[Node], ok: bool, comp: Completion) -> None:
        m = self.m
        good = 0 if (not ok or seq in self._revoked) else min(comp.result, len(nodes))
        self._revoked.discard(seq)
        if not ok:
            self.counters["errors_prefetch"] += 1
        self.prefetching_blocks -= len(nodes)
        self.counters["prefetch_pages_completed"] += good
        self.counters["prefetch_pages_revoked"] += len(nodes) - good
        for i, node in enumerate(nodes):
            self._prefetch_of.pop(node, None)
            node.flags &= ~PREFETCHING
            if i < good:
                node.flags |= FROM_STORAGE | STORED
            elif node.host is not None:
                m.free_host_copy(node)
            m.after_transfer(node)

    def revoke(self) -> int:
        """Throw away the result of every prefetch in flight (their blocks become misses and
        are freed when they land). Returns how many prefetches were revoked."""
        with self.m.lock:
            seqs = set(self._prefetch_of.values()) - self._revoked
            self._revoked |= seqs
            return len(seqs)

    # ------------------------------------------------------------------ backup

    def backup(self, nodes: list[Node]) -> None:
        """Write host copies that storage does not have yet (lock held)."""
        src: list[int] = []
        keys: list[bytes] = []
        batch: list[Node] = []
        for node in nodes:
            if (node.host is None or node.skey is None or node.key is None
                    or node.flags & (STORED | BACKING | PREFETCHING)):
                continue
            node.flags |= BACKING
            self.m.relist(node)
            src.append(node.host)
            keys.append(node.skey)
            batch.append(node)
        if not batch:
            return
        m = self.m
        seq = m.next_seq()
        task = Task(seq, TaskKind.BACKUP, src, [], keys, Priority.BACKUP)
        self.counters["backup_tasks"] += 1
        m.track(task, batch, on_done=lambda ok, comp: self._on_backup(batch, ok, comp))

    def _on_backup(self, nodes: list[Node], ok: bool, comp: Completion) -> None:
        # A backend that cannot write (Redis down, disk full) still answers the task, with
        # the number of pages it wrote (the minimum over ranks): only those count as backed
        # up, and only a fully written batch marks its nodes STORED.
        written = min(comp.result, len(nodes)) if ok else 0
        if not ok:
            self.counters["errors_backup"] += 1
        self.counters["backup_pages"] += written
        self.counters["backup_failed_pages"] += len(nodes) - written
        stored = written == len(nodes)
        for node in nodes:
            node.flags &= ~BACKING
            if stored:
                node.flags |= STORED
            self.m.after_transfer(node)

    # ------------------------------------------------------------------ admin

    def clear(self, timeout: float) -> int:
        """Delete this model shape's pages from storage on every rank; returns pages
        deleted (summed over ranks)."""
        m = self.m
        out: list[int] = []

        def done(ok: bool, comp: Completion) -> None:
            if not ok:
                self.counters["errors_clear"] += 1
                raise_later.append(comp.error)
            out.append(comp.result)

        raise_later: list[str] = []
        with m.lock:
            seq = m.next_seq()
            task = Task(seq, TaskKind.CLEAR, [], [], [], Priority.CONTROL)
            m.track(task, [], on_done=done)
            m.wait_unlocked([seq], timeout)  # sends it; the lock is free while it runs
            if raise_later:
                raise RuntimeError(f"clearing storage failed: {raise_later[0]}")
            for node in m.cached_nodes():  # every node's storage copy is gone now
                node.flags &= ~STORED
        return out[0] if out else 0

    def status(self) -> dict[str, Any]:
        c = dict(self.counters)
        return {"backend": self.backend, "prefetch_policy": self.policy,
                "prefetch_threshold_tokens": self.threshold_tokens,
                "prefetch_host_blocks_limit": self.limit,
                "prefetching_blocks": self.prefetching_blocks,
                "counters": c,
                "backup_bytes": c["backup_pages"] * self.page_bytes * self.ranks,
                "prefetch_bytes": c["prefetch_pages_completed"] * self.page_bytes * self.ranks}
