"""The manager's side of the storage tier (L3): hit queries, prefetch into the host tier, and
backup from the host tier.

Pages are named by SHA-256 storage keys (`kvtier.manager.keys.storage_keys`), so any manager
instance serving the same model finds the pages another one wrote. Nothing here touches bytes:
it emits QUERY, PREFETCH, BACKUP, CLEAR, DELETE and RETAIN tasks and applies their outcomes
under the manager's lock.

The tier is a client of the cache core (`kvtier.manager.core.cache.CacheCore`): it asks the
core for the prefetch and storage-backup transitions of a node (it never writes node state
itself), host blocks and task tracking; the core and the scheduler call it through
`StorageHooks`. This module does not import the scheduler or the keyed surface, nor they this
one; `kvtier.manager.stack.assemble` builds them all.

Prefetch life cycle::

    match/prefetch misses >= prefetch_threshold tokens after the device and host tiers
      -> storage's index is complete and does not list the first missed block: a miss at
         once, nothing asked (`index_misses`; the keyed surface does the same)
      -> QUERY (how many leading pages does storage hold? minimum over ranks)
      -> enough, and host blocks free within `prefetch_host_blocks_limit`:
         nodes created on the host with PREFETCHING, one PREFETCH task
      -> lands: the first `result` pages (read and verified on every rank) become host
         copies (FROM_STORAGE: their first hit counts as a storage hit); the rest, or
         everything of a failed prefetch, is freed -- a miss, never data

Revoke (`revoke`, the scheduler's `revoke_prefetch`: a queued request was aborted, or was
scheduled and takes what has landed)::

    QUERY in flight     -> marked; its answer starts no prefetch
    PREFETCH in flight  -> marked, and one REVOKE task names it to the workers: each rank
                           stops after the page batch it is reading (one not started reads
                           nothing) and answers with the pages it read
      -> lands as above: the pages read on every rank stay host copies, the rest is freed;
         until then its blocks are PREFETCHING, so no match serves them

Prefetch policies decide what `match` does when the next block is being prefetched:
`best_effort` takes what has landed and never waits; `wait_complete` waits for the prefetch;
`timeout` waits at most `timeout_base_s + timeout_per_1k_tokens_s * tokens / 1000`.

Index of what storage holds (`holds`, `index_complete`): the 64-bit tags (`key_tag`) of the
storage keys storage is known to hold, at most `HELD_INDEX_MAX`. With worker processes and a
keyed surface (`Stack.start`, `storage.index_refresh_s` > 0) it is filled from the backend's
own listing (a LIST task: every page of the namespace, another process's or instance's
included) before the first lookup when the answer comes within `INDEX_START_WAIT_S`, and
refreshed every `index_refresh_s` on a thread of its own; a refresh replaces it (a page
deleted, evicted or expired leaves it). Between refreshes the pages this manager writes (a
fully written backup batch) or a query finds are added::

    incomplete --(a listing answered whole)--> complete (listed_at = when the LIST was sent)
    complete --(a listing failed, was too big or too slow; or listed_at older than
                3 x index_refresh_s)--> incomplete (what was listed stays, as hints)
    complete --(storage cleared)--> complete, empty

Complete, it lists every page storage held at the last listing plus those written or found
since: the keyed surface answers MISS at once for a block it does not list (a page another
instance wrote since the last refresh costs a recompute, never a wrong block). Incomplete
(no listing yet, listing off, a store too big to list, an outage), a block it does not list
waits at most `UNLISTED_WAIT_S` for its query. Either way the index never decides whether a
block is served: a query's answer and the page checks do.

Backup: which host copies are written to storage, and when, is `storage.write_policy`
(`kvtier.manager.policies.StorageWritePolicy`): every copy when it lands on the host
(write_through, the default), a copy once its block was hit `storage.write_threshold` times
(write_through_selective: `backup` when it lands, `on_hits` when a match or an engine load hits
it), or only when the host tier evicts it (write_back: the cache core's `take_host_block`
calls `write_back`). Each copy is written at most once, asynchronously, in one BACKUP task per
batch; BACKING keeps its host copy alive meanwhile. `storage.max_backup_mb_s` bounds the bytes
written per second with a token bucket holding one second's worth: a batch the bucket cannot
pay for is written as far as it can and the rest skipped (`backup_skipped_pages`), so backups
never queue up behind the engine under load (a skipped copy is written if it is hit again
under write_through_selective, or when evicted under write_back; otherwise storage misses it).

Back-pressure (`storage.slow_write_ms`): `write_latency` is an exponential moving average
(weight `EMA_WEIGHT` per answer) of the seconds from sending a BACKUP task to its answer,
queueing in the worker's storage-write lane included: that is what a slow backend costs (its
batches pile up in the lane, holding their host copies in BACKING and the lane's thread
busy). While it is above the threshold, writes are slow and `_write` skips every batch
(`backup_slow_skipped_pages`; the nodes never enter BACKING, so no page is announced to the
index or in events), except one probe batch at most every `PROBE_INTERVAL_S` and only once
the last probe answered (or `PROBE_STALE_S` passed), whose answer moves the average (without
probes a skipping tier would never learn that the backend recovered; without the wait, a
store slower than the interval piles probes up in its lane). `read_latency` is the same
average over QUERY tasks (a lookup's first round trip to storage): while it is above
`storage.slow_read_ms`, a lookup that would ask storage (`on_miss`, the scheduler's
`prefetch`, the keyed surface's queries) is a miss at once instead (`query_slow_skips`: the
request recomputes rather than waits on a slow store), except one probe query a second.
`prefetch_latency` (PREFETCH tasks) is reported only. Loads never wait on writes in any case:
the worker runs storage reads and storage writes on lanes of their own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.manager.core.cache import CacheCore
from kvtier.manager.core.hooks import RequestState
from kvtier.manager.core.nodes import PREFETCHING, Node
from kvtier.manager.errors import TransferTimeoutError
from kvtier.manager.keys import storage_keys
from kvtier.manager.policies import make_storage_write_policy
from kvtier.worker.wire import (
    RETAIN_SET,
    RETAIN_UNPIN,
    Completion,
    Priority,
    Task,
    TaskKind,
    key_tag,
)

if TYPE_CHECKING:
    from kvtier.manager.config import KvtierConfig

log = logging.getLogger(__name__)

EMA_WEIGHT = 0.2
"""Weight of the newest answer in the latency averages: five slow batches in a row (about a
second of a backend that takes 200 ms a batch) lift a healthy average past a threshold twice
the healthy figure, and one fast probe answer does not end a slow spell by itself."""

PROBE_INTERVAL_S = 1.0
"""While writes are slow, at most one probe batch a second measures whether the backend
recovered, and only once the previous probe answered or PROBE_STALE_S passed (a task dropped
without an answer must not stop the probes for good)."""

PROBE_STALE_S = 30.0
"""A probe batch unanswered this long no longer holds the next one back. Without the wait for
the answer, a store slower than a batch a second piled probes up in its write lane (one a
second in, one per batch time out), each holding its host copies in BACKING: measured on
vLLM with 3 s per batch, the 48-block host tier filled with waiting probes."""

HELD_INDEX_MAX = 1 << 18
"""Storage keys the index of held pages keeps (64-bit tags, ~90 B each with the dict: 24 MB
at most; the oldest go first). A backend holding more is not listed (the index stays
incomplete): 2**18 pages of 64-token blocks are 16.7M tokens."""

INDEX_START_WAIT_S = 2.0
"""How long `Stack.start` waits for the first listing (a healthy store of 10k pages lists in
tens of milliseconds); a later answer completes the index when it comes."""


class StorageTier:
    """Prefetch and backup decisions of one manager (implements `StorageHooks`).

    Data structures: `_prefetch_of` node -> seq of the PREFETCH task filling it;
    `_prefetches` seq -> tree key of the last block of each PREFETCH in flight, `_queries`
    the same for QUERY tasks; `_revoked` seqs of the queries and prefetches revoked and not
    answered yet; `prefetching_blocks` host blocks currently held by prefetches (bounded by
    `limit`); `_held` the index of storage keys known held, as `key_tag`s (insertion order =
    age, at most `HELD_INDEX_MAX`; see the module docstring), `_listing` the seq of the LIST in
    flight and `_noted_since` the tags noted since it was sent. Invariants: `_noted_since` is
    empty while no LIST is in flight; `_revoked` holds only seqs of `_queries` or `_prefetches`;
    a node is PREFETCHING exactly while it is in `_prefetch_of`.
    """

    def __init__(self, manager: CacheCore, cfg: KvtierConfig) -> None:
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
        self.write_policy = make_storage_write_policy(s.write_policy, s.write_threshold)
        # the backup rate limit: bytes one page costs over the ranks that write it, the
        # bucket's rate and size (one second's worth), its level and when it was filled
        self._page_cost = max(1, manager.page_bytes * (1 if s.backup_one_rank else self.ranks))
        self._rate = s.max_backup_mb_s * 1e6
        self._bucket = self._rate
        self._filled_at = time.monotonic()
        # back-pressure: the latency averages (None until the first answer), the threshold
        # (0: off) and when the last probe was sent
        self.slow_write_s = s.slow_write_ms / 1000
        self.slow_read_s = s.slow_read_ms / 1000
        self.write_latency: float | None = None
        self.read_latency: float | None = None
        self.prefetch_latency: float | None = None
        self._read_probed_at = float("-inf")
        self._probed_at = float("-inf")
        self._probe_sent: float | None = None  # the write probe in flight, sent then
        self.prefetching_blocks = 0
        self.clears_running = 0  # CLEAR tasks sent and not answered (a slow clear goes on)
        self._prefetch_of: dict[Node, int] = {}
        self._prefetches: dict[int, int] = {}
        self._queries: dict[int, int] = {}
        self._revoked: set[int] = set()
        # told the storage keys of pages a prefetch found gone (`StorageHooks.on_pages_gone`)
        self.on_pages_gone: Callable[[list[bytes]], None] | None = None
        self._held: dict[int, None] = {}
        # the listing: LIST in flight (seq), tags noted since it was sent (kept through the
        # refresh it answers), when the last whole listing was asked for, a generation that a
        # clear bumps (a listing asked before a clear must not bring back what it deleted)
        self.index_refresh_s = s.index_refresh_s
        self._listing: int | None = None
        self._noted_since: dict[int, None] = {}
        self._listed_at: float | None = None
        self._index_gen = 0
        self._refresher: threading.Thread | None = None
        self._stop_refresh = threading.Event()
        # prefetch_pages_revoked: pages of a prefetch that did not land, whatever the reason
        # (revoked, failed, missing or damaged in storage). revoked_*: what `revoke` did.
        self.counters: dict[str, int] = dict.fromkeys((
            "queries", "query_hit_pages", "prefetch_tasks", "prefetch_pages_issued",
            "prefetch_pages_completed", "prefetch_pages_revoked", "backup_tasks",
            "backup_pages", "backup_failed_pages", "errors_query", "errors_prefetch",
            "errors_backup", "errors_clear", "revoked_queries", "revoked_prefetches",
            "revoked_pages_kept", "revoked_pages_dropped", "index_listings",
            "errors_list", "index_misses", "backup_skipped_pages",
            "backup_slow_skipped_pages", "backup_probes", "query_slow_skips",
            "query_probes", "delete_tasks", "delete_pages_asked", "delete_pages",
            "errors_delete", "retain_tasks", "retain_pages_asked", "retain_pages",
            "errors_retain"), 0)

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

    # ------------------------------------------------------------------ index

    def holds(self, skey: bytes) -> bool:
        """Does the index list this storage key (listed, written or found here)? A hint
        only."""
        return key_tag(skey) in self._held

    def index_complete(self) -> bool:
        """Whether the index lists every page storage held at its last listing (one at most
        3 x `index_refresh_s` old): a key it does not list is then not worth a query."""
        at = self._listed_at
        return at is not None and time.monotonic() - at < 3 * self.index_refresh_s

    def _note_held(self, skeys: Iterable[bytes]) -> None:
        held = self._held
        since = self._noted_since if self._listing is not None else None
        for k in skeys:
            tag = key_tag(k)
            if since is not None:
                since[tag] = None
            if tag in held:
                continue
            if len(held) >= HELD_INDEX_MAX:
                del held[next(iter(held))]
            held[tag] = None

    def refresh_index(self, timeout: float | None = None) -> bool:
        """Ask storage for its listing (a LIST task, unless one is in flight) and, with a
        `timeout`, wait at most that long for it. Returns whether the index is complete."""
        m = self.m
        with m.lock:
            seq = self._listing
            if seq is None:
                seq = self._listing = m.next_seq()
                gen = self._index_gen
                sent = time.monotonic()
                task = Task(seq, TaskKind.LIST, [HELD_INDEX_MAX], [], [], Priority.BACKUP)
                self.counters["index_listings"] += 1
                m.track(task, [], on_done=lambda ok, comp: self._on_list(
                    seq, gen, sent, ok, comp))
                m.flush()
            if timeout:
                with contextlib.suppress(TransferTimeoutError):  # it completes the index later
                    m.wait_unlocked([seq], timeout)
            return self.index_complete()

    def _on_list(self, seq: int, gen: int, sent: float, ok: bool, comp: Completion) -> None:
        """A listing answered (lock held): the index becomes the listing plus what was noted
        since it was sent, or incomplete when the listing is not whole."""
        if self._listing == seq:
            self._listing = None
        since, self._noted_since = self._noted_since, {}
        if gen != self._index_gen:
            return  # storage was cleared after this listing was asked for
        if not ok:
            self.counters["errors_list"] += 1
            if self._listed_at is not None:  # logged once per outage (or sleep), then counted
                log.warning("listing storage failed: %s; a block the index does not list "
                            "waits for its storage query again (briefly) until a listing "
                            "succeeds", comp.error)
        if not ok or comp.result != 1:
            self._listed_at = None
            return
        held = dict.fromkeys(comp.detail)
        held.update(since)
        self._held = held
        self._listed_at = sent

    def start_index(self, wait_s: float = INDEX_START_WAIT_S) -> bool:
        """Fill the index from storage's listing (waiting at most `wait_s` for it) and refresh
        it every `index_refresh_s` on a thread of its own until `stop_index`; nothing when
        `index_refresh_s` is 0. Returns whether the index is complete now."""
        if self.index_refresh_s <= 0 or self._refresher is not None:
            return self.index_complete()
        complete = self.refresh_index(wait_s)

        def refresh() -> None:
            while not self._stop_refresh.wait(self.index_refresh_s):
                try:
                    self.refresh_index()
                except Exception:  # the next period tries again; lookups fall back meanwhile
                    log.exception("refreshing the index of what storage holds failed")

        self._refresher = threading.Thread(target=refresh, daemon=True,
                                           name="kvtier-storage-index")
        self._refresher.start()
        return complete

    def stop_index(self) -> None:
        """Stop refreshing the index (the stack closes); idempotent."""
        self._stop_refresh.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)
            self._refresher = None

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
            if self.index_misses(req, token_ids, start):
                return False
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

    def reads_slow(self) -> bool:
        """Whether the query latency average is above `storage.slow_read_ms` (never when that
        is 0)."""
        ema = self.read_latency
        return bool(self.slow_read_s) and ema is not None and ema > self.slow_read_s

    def reads_skipped(self) -> bool:
        """Whether this lookup must not ask storage because reads are slow (counted in
        `query_slow_skips`); one lookup a second asks anyway, as the probe that tells when the
        store recovered (`query_probes`)."""
        if not self.reads_slow():
            return False
        now = time.monotonic()
        if now - self._read_probed_at >= PROBE_INTERVAL_S:
            self._read_probed_at = now
            self.counters["query_probes"] += 1
            return False
        self.counters["query_slow_skips"] += 1
        return True

    def _read_answered(self, sent: float) -> None:
        """A QUERY answered: the read latency average moves (lock held)."""
        was_slow = self.reads_slow()
        now = time.monotonic()
        self.read_latency = _ema(self.read_latency, now - sent)
        if not was_slow and self.reads_slow():
            self._read_probed_at = now  # slow from now: the first probe one interval later

    def index_misses(self, req: RequestState, token_ids: Any, start: int) -> bool:
        """Whether storage's complete index does not list block `start` (then counted): storage
        counts leading pages, so a query could only answer 0. The scheduler API's twin of the
        keyed surface's check (`KeyedHostCache._query`). Also True, without a look at the
        index, while reads are slow (`reads_skipped`): not asking is then the point."""
        if self.reads_skipped():
            return True
        if not self.index_complete():
            return False
        if self.holds(self.request_skeys(req, token_ids, start + 1)[start]):
            return False
        self.counters["index_misses"] += 1
        return True

    def _wait_budget(self, blocks: int) -> float:
        if self.policy == "timeout":
            return self.timeout_base_s + self.timeout_per_1k_s * blocks * self.bs / 1000
        return self.m.transfer_timeout_s

    # ------------------------------------------------------------------ query and prefetch

    def query(self, req: RequestState, token_ids: Any, start: int, cap: int,
              on_answer: Callable[[int], None] | None = None,
              threshold_tokens: int | None = None,
              on_lacking: Callable[[int], None] | None = None) -> int:
        """Ask storage how many of blocks start..cap it holds; the answer starts a prefetch
        when it is worth one (`threshold_tokens`, default `storage.prefetch_threshold`).
        `on_answer(found)` runs then, lock held, with how many leading blocks storage holds
        (0 when the query failed or was revoked); `on_lacking(i)` before it when storage
        answered and lacks block i (the first past those it holds: its page is gone on some
        rank). Returns the query's seq."""
        skeys = self.request_skeys(req, token_ids, cap)[start:cap]
        keys = req.keys[start:cap]
        m = self.m
        seq = m.next_seq()
        task = Task(seq, TaskKind.QUERY, [], [], list(skeys), Priority.PREFETCH)
        self.counters["queries"] += 1
        sent = time.monotonic()

        def done(ok: bool, comp: Completion) -> None:
            self._read_answered(sent)
            found = 0
            revoked = seq in self._revoked
            try:
                found = self._on_query(seq, ok, comp, keys, skeys, threshold_tokens)
                if on_lacking is not None and ok and not revoked and found < len(keys):
                    on_lacking(found)
            finally:
                if on_answer is not None:
                    on_answer(found)

        if keys:
            self._queries[seq] = keys[-1]
        m.track(task, [], on_done=done)
        return seq

    def _on_query(self, seq: int, ok: bool, comp: Completion, keys: list[int],
                  skeys: list[bytes], threshold_tokens: int | None = None) -> int:
        """Start the prefetch the answer is worth; returns how many leading blocks storage
        holds."""
        self._queries.pop(seq, None)
        if seq in self._revoked:
            self._revoked.discard(seq)
            return 0  # revoked: the scheduler no longer wants these pages
        if not ok:
            self.counters["errors_query"] += 1
            return 0
        found = n = min(comp.result, len(keys))
        self.counters["query_hit_pages"] += n
        self._note_held(skeys[:found])
        room = self.limit - self.prefetching_blocks
        n = min(n, room)
        threshold = self.threshold_tokens if threshold_tokens is None else threshold_tokens
        if n * self.bs < threshold or n <= 0:
            return found
        m = self.m
        now = time.monotonic()
        nodes: list[Node] = []
        dst: list[int] = []
        fetch_keys: list[bytes] = []
        last_key = 0
        for key, skey in zip(keys[:n], skeys[:n], strict=True):
            if m.lookup(key) is not None:
                continue  # cached meanwhile
            hb = m.take_host_block()
            if hb is None:
                break
            node = m.start_prefetch(key, skey, hb, now)
            nodes.append(node)
            dst.append(hb)
            fetch_keys.append(skey)
            last_key = key
        if not nodes:
            return found
        pseq = m.next_seq()
        task = Task(pseq, TaskKind.PREFETCH, [], dst, fetch_keys, Priority.PREFETCH)
        for node in nodes:
            self._prefetch_of[node] = pseq
        self._prefetches[pseq] = last_key
        self.prefetching_blocks += len(nodes)
        self.counters["prefetch_tasks"] += 1
        self.counters["prefetch_pages_issued"] += len(nodes)
        sent = time.monotonic()
        m.track(task, nodes, on_done=lambda ok, comp: self._on_prefetch(
            pseq, nodes, ok, comp, sent))
        return found

    def _on_prefetch(self, seq: int, nodes: list[Node], ok: bool, comp: Completion,
                     sent: float | None = None) -> None:
        m = self.m
        if sent is not None:
            self.prefetch_latency = _ema(self.prefetch_latency, time.monotonic() - sent)
        # A revoked prefetch answers with the pages every rank read before it stopped: they
        # landed, so they stay (as SGLang's terminate_prefetch keeps completed pages).
        good = min(comp.result, len(nodes)) if ok else 0
        self._prefetches.pop(seq, None)
        revoked = seq in self._revoked
        # answered, not revoked, short: the first page not read is gone (missing, or damaged
        # and deleted by the worker; the next ones were not tried). An I/O error reads the
        # same and may leave the page: its retention record is then lost, never the page
        if ok and not revoked and good < len(nodes) and self.on_pages_gone is not None:
            skey = nodes[good].skey
            if skey is not None:
                self.on_pages_gone([skey])
        if revoked:
            self._revoked.discard(seq)
            self.counters["revoked_pages_kept"] += good
            self.counters["revoked_pages_dropped"] += len(nodes) - good
        if not ok:
            self.counters["errors_prefetch"] += 1
        self.prefetching_blocks -= len(nodes)
        self.counters["prefetch_pages_completed"] += good
        self.counters["prefetch_pages_revoked"] += len(nodes) - good
        for i, node in enumerate(nodes):
            self._prefetch_of.pop(node, None)
            m.finish_prefetch(node, i < good)

    def resize(self, cfg: KvtierConfig) -> None:
        """The host tier was re-created (a wake, nothing in flight): take its new size."""
        with self.m.lock:
            self.limit = cfg.effective_prefetch_host_blocks_limit()
            self.prefetching_blocks = 0
            self._prefetch_of.clear()
            self._revoked.clear()
            self._queries.clear()
            self._prefetches.clear()

    def revoke(self, keys: Iterable[int] | None = None) -> int:
        """Cancel the storage queries and prefetches in flight whose every block is one of
        the tree keys `keys` (a prompt's chained keys: a task reaching past them fills a
        longer prompt and goes on); None: every one. A revoked query starts no prefetch; a
        revoked prefetch stops on every rank after the page batch it is reading, what it
        read stays (host copies), the rest is freed when it lands. Returns how many queries
        and prefetches were revoked."""
        with self.m.lock:
            wanted = None if keys is None else set(keys)
            queries = [seq for seq, last in self._queries.items()
                       if seq not in self._revoked and (wanted is None or last in wanted)]
            prefetches = [seq for seq, last in self._prefetches.items()
                          if seq not in self._revoked and (wanted is None or last in wanted)]
            self._revoked.update(queries)
            self._revoked.update(prefetches)
            self.counters["revoked_queries"] += len(queries)
            self.counters["revoked_prefetches"] += len(prefetches)
            if prefetches:
                m = self.m
                task = Task(m.next_seq(), TaskKind.REVOKE, prefetches, [], [],
                            Priority.CONTROL)
                m.track(task, [])  # sent when the scheduler call ends
            return len(queries) + len(prefetches)

    # ------------------------------------------------------------------ backup

    def backup(self, nodes: list[Node]) -> None:
        """Host copies landed (lock held): write those the write policy wants now and storage
        does not have yet."""
        policy = self.write_policy
        if policy.on_land:
            self._write(nodes)
        elif policy.hit_threshold:
            self._write([n for n in nodes if n.hits >= policy.hit_threshold])

    def on_hits(self, nodes: Sequence[Node | None]) -> None:
        """`nodes` were hit (a match, an engine load; lock held): under
        write_through_selective, write the host copies whose blocks reached the threshold."""
        threshold = self.write_policy.hit_threshold
        if threshold:
            self._write([n for n in nodes
                         if n is not None and n.hits >= threshold and n.host is not None])

    def write_back(self, nodes: list[Node]) -> int:
        """The host tier evicts these unwritten copies, oldest first (write_back, lock held):
        write them first. Returns how many of the leading ones are being written (the rest:
        the rate limit refused them)."""
        return self._write(nodes)

    def _take_budget(self, pages: int) -> int:
        """How many of `pages` pages the backup rate limit lets through now (all without one)."""
        if not self._rate or not pages:
            return pages
        now = time.monotonic()
        self._bucket = min(self._rate, self._bucket + (now - self._filled_at) * self._rate)
        self._filled_at = now
        n = min(pages, int(self._bucket // self._page_cost))
        self._bucket -= n * self._page_cost
        return n

    def _write(self, nodes: list[Node]) -> int:
        """One BACKUP task for the copies among `nodes` that need one, as far as the rate
        limit allows (in order); returns how many it writes."""
        src: list[int] = []
        keys: list[bytes] = []
        batch: list[Node] = []
        wanted = [n for n in nodes if self.m.needs_storage_backup(n)]
        probe = False
        if wanted and self.writes_slow():
            now = time.monotonic()
            if now - self._probed_at < PROBE_INTERVAL_S or (
                    self._probe_sent is not None and now - self._probe_sent < PROBE_STALE_S):
                self.counters["backup_slow_skipped_pages"] += len(wanted)
                return 0
            self._probed_at = now  # this batch probes whether the backend recovered
            probe = True
            self.counters["backup_probes"] += 1
        allowed = self._take_budget(len(wanted))
        self.counters["backup_skipped_pages"] += len(wanted) - allowed
        for node in wanted[:allowed]:
            self.m.start_storage_backup(node)
            src.append(node.host)  # type: ignore[arg-type]
            keys.append(node.skey)  # type: ignore[arg-type]
            batch.append(node)
        if not batch:
            return 0
        m = self.m
        seq = m.next_seq()
        task = Task(seq, TaskKind.BACKUP, src, [], keys, Priority.BACKUP)
        self.counters["backup_tasks"] += 1
        sent = time.monotonic()
        if probe:
            self._probe_sent = sent
        m.track(task, batch,
                on_done=lambda ok, comp: self._on_backup(batch, ok, comp, sent, probe))
        return len(batch)

    def writes_slow(self) -> bool:
        """Whether the backup latency average is above `storage.slow_write_ms` (never when
        that is 0)."""
        ema = self.write_latency
        return bool(self.slow_write_s) and ema is not None and ema > self.slow_write_s

    def _on_backup(self, nodes: list[Node], ok: bool, comp: Completion,
                   sent: float | None = None, probe: bool = False) -> None:
        if probe and self._probe_sent == sent:
            self._probe_sent = None  # answered: the next probe may go after the interval
        if sent is not None:
            was_slow = self.writes_slow()
            now = time.monotonic()
            self.write_latency = _ema(self.write_latency, now - sent)
            if not was_slow and self.writes_slow():
                self._probed_at = now  # slow from now: the first probe one interval later
        # A backend that cannot write (Redis down, disk full) still answers the task, with
        # the number of pages it wrote (the minimum over ranks): only those count as backed
        # up, and only a fully written batch marks its nodes STORED.
        written = min(comp.result, len(nodes)) if ok else 0
        if not ok:
            self.counters["errors_backup"] += 1
        self.counters["backup_pages"] += written
        self.counters["backup_failed_pages"] += len(nodes) - written
        stored = written == len(nodes)
        if stored:
            self._note_held(n.skey for n in nodes if n.skey is not None)
        for node in nodes:
            self.m.finish_storage_backup(node, stored)

    # ------------------------------------------------------------------ admin

    def clear(self, timeout: float) -> int | None:
        """Delete this model shape's pages from storage on every rank; returns pages
        deleted (summed over ranks), or None when the clear did not finish within `timeout`:
        it goes on in the background (`clears_running` in `status`), and its outcome lands
        in the counters (issue 27: a slow clear is not an error). RuntimeError when a rank
        failed it."""
        m = self.m
        out: list[int] = []
        failed: list[str] = []

        def done(ok: bool, comp: Completion) -> None:  # lock held (the completion thread)
            self.clears_running -= 1
            if not ok:
                self.counters["errors_clear"] += 1
                failed.append(comp.error)
                log.warning("clearing storage failed: %s", comp.error)
                return
            out.append(comp.result)
            self._held.clear()  # storage is empty now: a complete index stays complete
            self._noted_since.clear()
            self._index_gen += 1
            m.forget_stored()  # every node's storage copy is gone now

        with m.lock:
            seq = m.next_seq()
            task = Task(seq, TaskKind.CLEAR, [], [], [], Priority.CONTROL)
            self.clears_running += 1
            m.track(task, [], on_done=done)
            try:
                m.wait_unlocked([seq], timeout)  # sends it; the lock is free while it runs
            except TransferTimeoutError:
                return None
            if failed:
                raise RuntimeError(f"clearing storage failed: {failed[0]}")
        return out[0] if out else 0

    def delete(self, skeys: Sequence[bytes], timeout: float = 0.0) -> int | None:
        """Delete these pages (storage keys) from storage on every rank: one DELETE task, on
        the workers' storage-write lane behind every backup sent before it (a page being
        written now is deleted after it lands). The index stops listing them at once.
        Returns the pages every rank deleted when the task is answered within `timeout`
        (0: do not wait, None is returned), None when it is not (it goes on; its outcome
        lands in the counters). A rank's failure is counted (`errors_delete`) and logged.
        Caller may hold the manager's lock (the wait releases it)."""
        keys = list(dict.fromkeys(skeys))
        if not keys:
            return 0
        m = self.m
        out: list[int] = []

        def done(ok: bool, comp: Completion) -> None:  # lock held (the completion thread)
            if not ok:
                self.counters["errors_delete"] += 1
                log.warning("deleting %d storage pages failed: %s", len(keys), comp.error)
                return
            self.counters["delete_pages"] += comp.result
            out.append(comp.result)

        with m.lock:
            for k in keys:
                tag = key_tag(k)
                self._held.pop(tag, None)
                self._noted_since.pop(tag, None)
            seq = m.next_seq()
            self.counters["delete_tasks"] += 1
            self.counters["delete_pages_asked"] += len(keys)
            m.track(Task(seq, TaskKind.DELETE, [], [], keys, Priority.BACKUP), [],
                    on_done=done)
            if timeout <= 0:
                m.flush()
                return None
            try:
                m.wait_unlocked([seq], timeout)
            except TransferTimeoutError:
                return None
        return out[0] if out else None

    def retain(self, skeys: Sequence[bytes], *, pin: bool, ttl_s: float,
               priority: int) -> None:
        """Send this retention for these pages to every rank (one RETAIN task on the
        storage-write lane, not waited for): each backend keeps what it is told
        (`kvtier.worker.storage.retention`) and applies it to the pages stored now and to
        those written later. The retention's owner is the keyed surface's `TenantBook`;
        this only carries it down. Lock may be held."""
        self._send_retain(skeys, [RETAIN_SET, int(pin), round(ttl_s * 1000), priority])

    def unpin(self, skeys: Sequence[bytes]) -> None:
        """Take the pin off these pages on every rank (a RETAIN task, not waited for): they
        get their ordinary expiry back."""
        self._send_retain(skeys, [RETAIN_UNPIN, 0, 0, 0])

    def _send_retain(self, skeys: Sequence[bytes], args: list[int]) -> None:
        keys = list(dict.fromkeys(skeys))
        if not keys:
            return

        def done(ok: bool, comp: Completion) -> None:  # lock held (the completion thread)
            if not ok:
                self.counters["errors_retain"] += 1
                log.warning("retaining %d storage pages failed: %s", len(keys), comp.error)
                return
            self.counters["retain_pages"] += comp.result

        m = self.m
        with m.lock:
            self.counters["retain_tasks"] += 1
            self.counters["retain_pages_asked"] += len(keys)
            m.track(Task(m.next_seq(), TaskKind.RETAIN, args, [], keys, Priority.BACKUP), [],
                    on_done=done)
            m.flush()

    def status(self) -> dict[str, Any]:
        c = dict(self.counters)
        return {"backend": self.backend, "prefetch_policy": self.policy,
                "write_policy": self.write_policy.name,
                "clears_running": self.clears_running,
                "prefetch_threshold_tokens": self.threshold_tokens,
                "prefetch_host_blocks_limit": self.limit,
                "prefetching_blocks": self.prefetching_blocks,
                "index": {"pages": len(self._held), "complete": self.index_complete(),
                          "refresh_s": self.index_refresh_s},
                "back_pressure": {"writes_slow": self.writes_slow(),
                                  "reads_slow": self.reads_slow(),
                                  "slow_write_ms": self.slow_write_s * 1000,
                                  "slow_read_ms": self.slow_read_s * 1000,
                                  "write_latency_ms": _ms(self.write_latency),
                                  "read_latency_ms": _ms(self.read_latency),
                                  "prefetch_latency_ms": _ms(self.prefetch_latency)},
                "counters": c,
                "backup_bytes": c["backup_pages"] * self.page_bytes * self.ranks,
                "prefetch_bytes": c["prefetch_pages_completed"] * self.page_bytes * self.ranks}


def _ema(average: float | None, sample: float) -> float:
    """The latency average after one more answer (the first answer starts it)."""
    return sample if average is None else average + EMA_WEIGHT * (sample - average)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
