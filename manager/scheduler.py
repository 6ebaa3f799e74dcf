"""The scheduler API: match, allocate, commit, release (plus pin, reset, stats).

`KVCacheManager` is the metadata half of kvtier. It decides which block id of which tier
holds which prefix and emits transfer tasks; workers move the bytes. One scheduler thread
calls the API; completion callbacks (dispatcher thread) and the admin (stats, reset, pin)
may run concurrently: every state change happens under one lock, and `stats()` reads plain
counters without it.

Request life cycle::

    match(rid, tokens)         longest cached prefix over device and host; device hits are
                               referenced, host hits get device blocks and one H2D task
      -> MatchResult           device block ids, tokens per tier, LoadHandle (per layer)
    allocate(rid, n)           device blocks for n more tokens (+ reserve); evicts LRU
                               leaves as needed; all or nothing
    commit(rid, tokens, c)     full blocks among the first c tokens join the tree
    release(rid)               references dropped tail first (leaves age first); blocks
                               that never joined the tree go back to the free list

Sleep (weight updates; `kvtier.manager.stack.Stack.sleep` / `wake` drive it)::

    awake --sleep()--> asleep: tree cleared without waiting, active requests cancelled
      (RequestCancelledError; release() of one is a no-op), transfers in flight cancelled by
      the workers; their blocks come back as each is answered, never served
    asleep --(nothing in flight) rebuild(device, host)--> asleep, empty pools of new sizes
    asleep --wake()--> awake
    While asleep, match / prefetch / pin / unpin / reset raise AsleepError; a call that was
    waiting (lock released) when the sleep began raises RequestCancelledError.

Block ownership (the invariant the tests check after every operation): each block id of a
tier is exactly one of free (in the pool), held by the tree (a node in the map has it), or
owned by a request (allocated to it and not in the tree, or held by a detached node).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from kvtier.manager.core.cache import (
    TREE_CLEARED,
    TREE_CLEARING,
    TREE_NORMAL,
    CacheCore,
    Counters,
)
from kvtier.manager.core.hooks import OnDone, RequestState, StorageHooks
from kvtier.manager.core.nodes import DEVICE_BUSY, ENGINE_WRITE, LOADING, PREFETCHING, Node
from kvtier.manager.errors import (
    AsleepError,
    InvalidRequestError,
    RequestCancelledError,
    ResetBusyError,
    UnknownRequestError,
)
from kvtier.manager.keys import TokenKeyError, chain_keys
from kvtier.manager.policies import WritePolicy, make_write_policy
from kvtier.manager.transfers import Dispatcher, LoadHandle
from kvtier.worker.wire import Priority, Task, TaskKind

__all__ = ["TREE_CLEARED", "TREE_CLEARING", "TREE_NORMAL", "Counters", "KVCacheManager",
           "MatchResult", "SchedulerStats"]

_monotonic = time.monotonic


@dataclass(slots=True)
class MatchResult:
    """What a request found cached. `block_ids` are device blocks for the first
    `num_tokens` tokens; wait on `handle` before reading those that came from the host."""

    block_ids: list[int]
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    handle: LoadHandle

    @property
    def num_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens




class SchedulerStats(TypedDict):
    """`KVCacheManager.stats()`: per tier the block counts (capacity, free, cached,
    evictable, in_use, owned_by_requests), tree and request figures, and `Counters`."""

    device: dict[str, int]
    host: dict[str, int]
    nodes: int
    requests_active: int
    pinned_blocks: int
    tasks_inflight: int
    tree_status: int
    paused: bool
    counters: dict[str, int]



class KVCacheManager(CacheCore):
    """The scheduler API of one deployment's device and host tiers: requests, on top of the
    cache core (`kvtier.manager.core.cache.CacheCore`, which owns the tree, the pools, the LRU
    lists, the counters and the tasks, and alone changes node state).

    Data structures (beyond the core's):
      * `_requests`: request id -> RequestState (`kvtier.manager.core.hooks`).
      * `_lost_requests`: requests active when every cached byte (or the device memory) was
        lost: what they computed before is gone on some rank, so their commits join nothing.
      * `_cancelled`: requests a sleep cancelled, until they are released or matched again.
    Invariants: the core's, with the active requests' blocks as theirs (`check_invariants`).
    """

    def __init__(
        self,
        *,
        block_size: int,
        device_blocks: int,
        host_blocks: int = 0,
        write_policy: str | WritePolicy = "write_through_selective",
        hit_threshold: int = 2,
        decode_reserve_blocks: int = 0,
        dispatcher: Dispatcher | None = None,
        page_bytes: int = 0,
        num_layers: int = 1,
        transfer_timeout_s: float = 30.0,
        storage: Callable[[CacheCore], StorageHooks] | None = None,
        track_device_copies: bool = False,
        eviction_policy: str = "lru",
        host_eviction_policy: str = "lru",
    ) -> None:
        """`storage`: builds the storage tier over this manager's core (called once, here);
        `track_device_copies`: engine KV, host copies read from a model runner's memory wait
        for `confirm_device_copies` before they are trusted (see the core). The rest: the
        configuration's `cache.*` keys."""
        if block_size <= 0:
            raise ValueError(f"cache.block_size must be > 0, got {block_size}")
        if device_blocks <= 0:
            raise ValueError(f"cache.device_blocks must be > 0, got {device_blocks}")
        if host_blocks < 0:
            raise ValueError(f"cache.host_blocks must be >= 0, got {host_blocks}")
        if decode_reserve_blocks < 0:
            raise ValueError(
                f"cache.decode_reserve_blocks must be >= 0, got {decode_reserve_blocks}")
        super().__init__(
            block_size=block_size, device_blocks=device_blocks, host_blocks=host_blocks,
            policy=(write_policy if isinstance(write_policy, WritePolicy)
                    else make_write_policy(write_policy, hit_threshold)),
            dispatcher=dispatcher, page_bytes=page_bytes,
            transfer_timeout_s=transfer_timeout_s, eviction_policy=eviction_policy,
            host_eviction_policy=host_eviction_policy)
        self.num_layers = num_layers
        self.decode_reserve_blocks = decode_reserve_blocks
        self._requests: dict[str, RequestState] = {}
        self._lost_requests: set[str] = set()
        self.paused = False
        # Sleep (see the module docstring): `asleep` refuses scheduler calls; `_cancelled`
        # holds the requests a sleep cancelled until they are released or matched again.
        self.asleep = False
        self._cancelled: set[str] = set()
        self.track_device_copies = track_device_copies
        if storage is not None:
            self.storage = storage(self)

    # ------------------------------------------------------------------ scheduler API

    def match(self, request_id: str, token_ids: Sequence[int],
              extra_keys: Sequence[object] | None = None) -> MatchResult:
        """Find the longest cached prefix of `token_ids` (at most len-1 tokens: the model
        must compute at least one) and reserve it for `request_id`."""
        with self._lock:
            if self.asleep:
                self._refuse_asleep("match")
            if request_id in self._requests:
                raise InvalidRequestError(f"request {request_id!r} is already active")
            self._cancelled.discard(request_id)
            sleeps = self.counters.sleeps
            bs = self.block_size
            try:
                keys = chain_keys(token_ids, bs, extra_keys=extra_keys)
            except TokenKeyError as e:
                raise InvalidRequestError(f"request {request_id!r}: {e}") from None
            except TypeError:
                raise InvalidRequestError(
                    f"request {request_id!r}: token_ids must be a sequence of ints") from None
            req = RequestState(keys, extra_keys)
            lost_before = self.counters.lost_all + self.counters.lost_device
            n_tokens = len(token_ids)
            cap = (n_tokens - 1) // bs if n_tokens else 0
            now = _monotonic()
            nodes = req.nodes
            add = nodes.append
            host_hits: list[int] = []  # indexes into nodes
            waits: list[tuple[int, int]] = []
            backups: list[Node] = []
            hit_threshold = self.policy.hit_threshold if self._host_pool.capacity else 0
            unlinked = 0
            n_storage = 0
            limit = min(cap, len(keys))
            storage = self.storage
            tree = self._map
            walk_hits = self._loops.walk_hits
            while True:
                while True:
                    # Plain device hits in one call (compiled or not, see manager.core.native);
                    # it stops at a miss, at the limit, or at a node handled here.
                    stop, n_unlinked = walk_hits(tree, keys, nodes, limit, now,
                                                 hit_threshold, backups)
                    unlinked += n_unlinked
                    if stop != 2:
                        break
                    node = tree[keys[len(nodes)]]
                    if node.dev is None:
                        # LOADING without a device block: another match that waits (lock
                        # released) claimed this host hit; its H2D is not sent yet (issue 27).
                        if node.host is None or node.flags & (PREFETCHING | ENGINE_WRITE
                                                              | LOADING):
                            break
                        host_hits.append(len(nodes))
                        n_storage += self.hit_host_copy(node)
                    elif node.flags:
                        seq = self.hit_busy_device_copy(node)
                        if seq is not None:
                            waits.append((seq, len(nodes)))
                    self.reference(node, now)
                    if hit_threshold and node.host is None and node.hits >= hit_threshold:
                        backups.append(node)
                    add(node)
                if storage is None or len(nodes) >= limit:
                    break
                self._dev_lru.size -= unlinked  # the wait below releases the lock
                unlinked = 0
                try:
                    again = storage.on_miss(req, token_ids, len(nodes), limit)
                except BaseException:
                    self._undo_match(nodes)  # issue 27: a sleep cancelled the wait
                    raise
                if not again:
                    break
            self._dev_lru.size -= unlinked
            if self.counters.sleeps != sleeps:
                self._undo_match(nodes)  # issue 27
                raise self._cancelled_during_wait(request_id)
            try:
                n_host = self._load_host_hits(req, host_hits, waits) if host_hits else 0
            except BaseException:
                self._undo_match(nodes)  # issue 27: a sleep (or timeout) while it waited
                raise
            n_storage = min(n_storage, n_host)
            req.blocks = self._loops.dev_ids(nodes)  # type: ignore[arg-type,assignment]
            n_hit = len(nodes)
            req.length = n_hit * bs
            self._requests[request_id] = req
            c = self.counters
            c.requests += 1
            c.lookup_tokens += n_tokens
            c.hit_device_tokens += (n_hit - n_host) * bs
            c.hit_host_tokens += (n_host - n_storage) * bs
            c.hit_storage_tokens += n_storage * bs
            if backups:
                self.backup_hot(backups)
            if storage is not None and storage.write_policy.hit_threshold:
                storage.on_hits(nodes)  # write_through_selective: hot host copies to storage
            handle = LoadHandle(self.dispatcher if waits else None, waits, n_hit * bs, bs,
                                self.transfer_timeout_s)
            req.handle = handle
            if self.counters.lost_all + self.counters.lost_device != lost_before:
                # A worker was lost while this match waited (lock released): what it found
                # is gone on that rank. Nothing of it is valid, and nothing it computes is
                # cached.
                handle.note_failure(0)
                self._lost_requests.add(request_id)
            ledger = self.ledger
            for seq, idx in waits:
                ledger.add_waiter(seq, handle, idx)
            if ledger.outbox:
                ledger.flush()
            return MatchResult(list(req.blocks), (n_hit - n_host) * bs,
                               (n_host - n_storage) * bs, n_storage * bs, handle)

    def allocate(self, request_id: str, num_tokens: int,
                 reserve_blocks: int | None = None) -> list[int]:
        """Device blocks so the request can hold `num_tokens` more tokens, keeping
        `reserve_blocks` spare blocks (default `decode_reserve_blocks`) for decoding. Returns
        the newly allocated ids (append them to the request's block table). All or nothing:
        OutOfBlocksError changes nothing."""
        with self._lock:
            req = self._get(request_id)
            if type(num_tokens) is not int or num_tokens < 0:
                raise InvalidRequestError(
                    f"request {request_id!r}: num_tokens must be an int >= 0, got "
                    f"{num_tokens!r}")
            reserve = self.decode_reserve_blocks if reserve_blocks is None else reserve_blocks
            if type(reserve) is not int or reserve < 0:
                raise InvalidRequestError(
                    f"request {request_id!r}: reserve_blocks must be >= 0, got {reserve!r}")
            bs = self.block_size
            length = req.length + num_tokens
            need = -(-length // bs) + reserve - len(req.blocks)
            if need <= 0:
                req.length = length
                return []
            self._make_room(need, f"request {request_id!r}")
            ids = self._dev_pool.allocate(need)
            req.blocks.extend(ids)
            req.length = length
            # making room can evict a host copy under write_back, which queues its BACKUP:
            # sent now, like every call's tasks (left queued, it waited for the next call,
            # and a reset waited on it until its timeout: test_manager_stateful's outbox
            # invariant found it)
            if self.ledger.outbox:
                self.ledger.flush()
            return ids

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
               extra_keys: Sequence[object] | None = None) -> int:
        """The request's KV for its first `num_computed_tokens` tokens is written: their full
        blocks join the tree (and may be backed up, per the write policy). Returns how many
        blocks joined. `token_ids` must start with the tokens the request was matched with."""
        with self._lock:
            req = self._get(request_id)
            bs = self.block_size
            if type(num_computed_tokens) is not int or num_computed_tokens < 0:
                raise InvalidRequestError(
                    f"request {request_id!r}: num_computed_tokens must be an int >= 0, got "
                    f"{num_computed_tokens!r}")
            if num_computed_tokens > len(token_ids):
                raise InvalidRequestError(
                    f"request {request_id!r}: num_computed_tokens={num_computed_tokens} "
                    f"exceeds the {len(token_ids)} token ids given")
            n_full = num_computed_tokens // bs
            if n_full > len(req.blocks):
                raise InvalidRequestError(
                    f"request {request_id!r}: {n_full} full blocks computed but only "
                    f"{len(req.blocks)} device blocks allocated")
            nodes = req.nodes
            start = len(nodes)
            if n_full <= start:
                return 0
            if self._lost_requests and request_id in self._lost_requests:
                return 0  # its KV went with a lost worker: it must not be cached
            if extra_keys is not None:
                req.extra_keys = extra_keys
            keys = req.keys
            if len(keys) < n_full:
                try:
                    keys.extend(chain_keys(
                        token_ids, bs, parent=keys[-1] if keys else 0, start_block=len(keys),
                        num_blocks=n_full - len(keys), extra_keys=req.extra_keys))
                except TokenKeyError as e:
                    raise InvalidRequestError(f"request {request_id!r}: {e}") from None
            now = _monotonic()
            m = self._map
            blocks = req.blocks
            new_nodes: list[Node] = []
            new_node = self._node_cls
            commit_walk = self._loops.commit_walk
            joined = 0
            while True:
                # New nodes and duplicates in one call (compiled or not, see manager.core.native);
                # it stops at a node cached on the host only, handled here.
                i = commit_walk(m, keys, blocks, nodes, n_full, now, new_node, new_nodes)
                if i >= n_full:
                    break
                key = keys[i]
                node = m.get(key)
                if node is None:
                    node = self.new_device_node(key, blocks[i], now)
                    new_nodes.append(node)
                elif node.dev is None:
                    # Cached on the host only: our freshly computed block becomes its
                    # device copy.
                    self.attach_device_copy(node, blocks[i], now)
                    joined += 1
                else:
                    node = None  # a duplicate: the request keeps its own block
                nodes.append(node)
            joined += len(new_nodes)
            self._dev_in_tree += len(new_nodes)
            if self.storage is not None and new_nodes:
                skeys = self.storage.request_skeys(req, token_ids, n_full)
                self.name_storage_pages(nodes, skeys, start, n_full)
            if new_nodes and self.policy.backup_on_commit and self._host_pool.capacity:
                self._backup(new_nodes)
            ledger = self.ledger
            if ledger.outbox:
                ledger.flush()
            return joined

    def release(self, request_id: str) -> None:
        """The request is done: its cached blocks become evictable (tail first, so leaves
        age first) and the blocks it owned go back to the free list."""
        with self._lock:
            req = self._requests.pop(request_id, None)
            if req is None:
                if request_id in self._cancelled:  # a sleep reclaimed its blocks already
                    self._cancelled.discard(request_id)
                    return
                raise UnknownRequestError(
                    f"request {request_id!r} is not active (never matched or already "
                    f"released)")
            if self._lost_requests:
                self._lost_requests.discard(request_id)
            blocks = req.blocks
            nodes = req.nodes
            pool = self._dev_pool
            now = _monotonic()
            n = len(nodes)
            if len(blocks) > n:
                pool.free(blocks[n:])
            # Tail first, so a request's leaves are older than its inner blocks: evictable
            # nodes join the device LRU's tail in one pass (compiled or not, see
            # manager.core.native), which leaves the request's own blocks to free here.
            lru = self._dev_lru
            rest, appended = self._loops.release_walk(nodes, lru.head, now, DEVICE_BUSY)
            lru.size += appended
            if self._evict is not None:  # a strategy other than LRU orders the victims
                self.policy_released(nodes)
            for i in rest:
                node = nodes[i]
                if node is None:
                    pool.free_one(blocks[i])
                else:  # detached: the block was the requests' own
                    self.free_detached_device(node)

    def prefetch(self, token_ids: Sequence[int],
                 extra_keys: Sequence[object] | None = None) -> bool:
        """Ask the storage tier for the blocks of this prompt that no tier holds, without
        waiting (schedulers call it for queued requests, so best-effort prefetches have time
        to land before `match`). Returns True when a storage query was issued."""
        if self.storage is None:
            return False
        with self._lock:
            if self.asleep:
                self._refuse_asleep("prefetch")
            keys = self._keys_or_error(token_ids, extra_keys)
            req = RequestState(keys, extra_keys)
            n = len(token_ids)
            cap = min((n - 1) // self.block_size if n else 0, len(keys))
            get = self._map.get
            for key in keys[:cap]:
                node = get(key)
                if node is None:
                    break
                req.nodes.append(node)
            start = len(req.nodes)
            if (cap - start) * self.block_size < self.storage.threshold_tokens:
                return False
            if self.storage.index_misses(req, token_ids, start):
                return False  # storage's complete index lacks the first block: nothing to ask
            self.storage.query(req, token_ids, start, cap)
            self._flush()
            return True

    def revoke_prefetch(self, token_ids: Sequence[int],
                        extra_keys: Sequence[object] | None = None) -> int:
        """Cancel the storage work under way for this prompt (what `prefetch`, or a `match`
        that missed, started for it): the scheduler calls it with the prompt it gave
        `prefetch` when that queued request is aborted, or when it is scheduled and should
        take what has landed rather than wait. Queries not answered yet start no prefetch;
        prefetches stop on every worker after the page batch they are reading. Pages already
        read stay on the host and are served as storage hits; blocks not read are freed when
        their task answers, never served. Only work filling blocks of this prompt alone is
        revoked (a prefetch reaching past it fills a longer prompt and goes on). Returns how
        many queries and prefetches were revoked (0 without a storage tier)."""
        if self.storage is None:
            return 0
        with self._lock:
            keys = self._keys_or_error(token_ids, extra_keys)
            n = self.storage.revoke(keys)
            self._flush()
            return n

    # ------------------------------------------------------------------ admin API

    def pin(self, token_ids: Sequence[int], extra_keys: Sequence[object] | None = None) -> int:
        """Keep the cached full blocks of this prefix on the device until unpinned; host-only
        blocks are loaded. Returns the number of blocks pinned (the prefix stops at the first
        block that is not cached)."""
        with self._lock:
            if self.asleep:
                self._refuse_asleep("pin")
            keys = self._keys_or_error(token_ids, extra_keys)
            pinned: list[Node] = []
            for key in keys:
                node = self._map.get(key)
                if node is None or not self.pin_node(node):
                    break
                pinned.append(node)
            self._flush()
            return len(pinned)

    def unpin(self, token_ids: Sequence[int], extra_keys: Sequence[object] | None = None) -> int:
        """Undo one `pin` of this prefix. Returns the number of blocks unpinned."""
        with self._lock:
            if self.asleep:
                self._refuse_asleep("unpin")
            keys = self._keys_or_error(token_ids, extra_keys)
            count = 0
            freed: list[Node] = []
            for key in keys:
                node = self._map.get(key)
                if node is None or not self.is_pinned(node):
                    break
                if self.unpin_node(node):
                    freed.append(node)
                count += 1
            for node in reversed(freed):  # tail first: leaves age first
                self.relist(node)
            return count

    def reset(self, timeout: float = 10.0) -> dict[str, int]:
        """Empty the tree and both tiers' caches once in-flight transfers have finished.
        Requests in flight keep their blocks (they become the requests' own). Raises
        ResetBusyError, with nothing cleared, if transfers do not finish in `timeout`."""
        with self._lock:
            if self.asleep:
                self._refuse_asleep("reset")
            sleeps = self.counters.sleeps
            self.tree_status = TREE_CLEARING
        try:
            deadline = _monotonic() + timeout
            while True:
                if not self.dispatcher.drain(max(0.0, deadline - _monotonic())):
                    self._refuse_if_slept(sleeps)
                    raise ResetBusyError(
                        f"reset: {self.dispatcher.pending()} transfer task(s) still in "
                        f"flight after {timeout:.3g} s; nothing was cleared")
                with self._lock:
                    self._refuse_if_slept(sleeps)
                    if not self._inflight:
                        cleared = self._clear_all()
                        self.counters.resets += 1
                        self.tree_status = TREE_CLEARED
                        return cleared
                    busy = len(self._inflight)
                if _monotonic() >= deadline:
                    raise ResetBusyError(
                        f"reset: {busy} transfer task(s) still in flight after "
                        f"{timeout:.3g} s; nothing was cleared")
                time.sleep(0.001)
        finally:
            with self._lock:  # issue 27: a sleep that overtook the reset owns the status
                if self.counters.sleeps == sleeps:
                    self.tree_status = TREE_NORMAL

    def _refuse_if_slept(self, sleeps: int) -> None:
        """A reset that a sleep overtook while it waited for transfers (issue 27): a conflict
        (AsleepError, a 409), never a clear of the sleeping tree."""
        if self.counters.sleeps != sleeps:
            raise AsleepError("reset: the deployment went to sleep while the reset waited for "
                              "transfers (the sleep emptied the caches; the reset did "
                              "nothing); wake it first")

    def lose_all(self) -> dict[str, int]:
        """Every cached byte is gone (a worker died with its pools): forget the tree now,
        without waiting. Blocks that transfers still in flight on other ranks use stay out of
        the free lists until those transfers are answered. Requests active now commit
        nothing more (their blocks' bytes are gone on the lost rank)."""
        with self._lock:
            cleared = self._clear_all()
            # What active requests computed is gone on the lost rank too: keep it out of
            # the tree (their commits join nothing; they recompute next time).
            self._lost_requests.update(self._requests)
            self.counters.lost_all += 1
            return cleared

    # ------------------------------------------------------------------ sleep

    def sleep(self) -> dict[str, int]:
        """Go to sleep at once (see the module docstring): every scheduler call is refused
        from now on, the tree is emptied without waiting, active requests are cancelled and
        transfers in flight are left to the workers to cancel; their blocks come back as
        they are answered and are never served. Returns what was cleared and cancelled."""
        with self._lock:
            if self.asleep:
                raise AsleepError("sleep: the deployment is already asleep (wake it first)")
            self.asleep = True
            self.paused = True
            self.tree_status = TREE_CLEARING
            self.counters.sleeps += 1
            tasks = len(self._inflight)
            cleared = self._clear_all()
            cleared["requests_cancelled"] = len(self._requests)
            cleared["tasks_cancelled"] = tasks
            self._cancelled.update(self._requests)
            self._requests.clear()
            self._lost_requests.clear()
            return cleared

    def settled(self) -> bool:
        """Asleep, whether every task of before the sleep has been answered and every block
        written off has come back (an engine's own host copies, `manager.keyed`, included)."""
        with self._lock:
            return not self._inflight and not self._written_off

    def rebuild(self, device_blocks: int, host_blocks: int) -> None:
        """Asleep, with nothing in flight: empty free lists of these sizes (the workers'
        pools are re-created to match). ResetBusyError while tasks are still in flight."""
        if device_blocks <= 0 or host_blocks < 0:
            raise ValueError(f"rebuild: {device_blocks} device / {host_blocks} host blocks")
        with self._lock:
            if not self.asleep:
                raise AsleepError("rebuild: the deployment is awake (sleep first)")
            if self._inflight or self._written_off:
                raise ResetBusyError(
                    f"rebuild: {len(self._inflight)} task(s) and {len(self._written_off)} "
                    "written-off block(s) of before the sleep are still in flight (an engine's "
                    "own copies must complete first)")
            self._rebuild_pools(device_blocks, host_blocks)
            self.tree_status = TREE_CLEARED

    def wake(self) -> None:
        """Serve again (after `rebuild` and the workers' pools are back)."""
        with self._lock:
            self.asleep = False
            self.paused = False
            self.tree_status = TREE_NORMAL

    def _refuse_asleep(self, what: str) -> None:
        raise AsleepError(f"{what}: the deployment is asleep (its KV pools are freed for a "
                          "weight update); wake it first")

    def _cancelled_during_wait(self, request_id: str) -> RequestCancelledError:
        self._cancelled.add(request_id)
        return RequestCancelledError(
            f"request {request_id!r} was cancelled: the deployment went to sleep while it "
            "waited for a transfer; match it again after the wake")

    def device_copy_mark(self) -> int:
        """Taken before a registration check reads the records: every host copy completed so
        far was read from the device memory that check will see (or an older one)."""
        return self._d2h_done

    def unconfirmed_device_copies(self) -> int:
        """Host copies waiting for a registration check to confirm them (engine KV)."""
        return len(self._unconfirmed)

    def confirm_device_copies(self, mark: int) -> int:
        """A registration check that started at `mark` found every rank's device memory
        unchanged: the host copies completed before `mark` were read from live, current
        memory. They become trusted and go on to storage. Returns how many were confirmed."""
        with self._lock:
            confirmed = self.confirmed_device_copies(mark)
            if confirmed and self.storage is not None:
                self.storage.backup(confirmed)
                self._flush()  # the backup tasks go out now, not with the next API call
            return len(confirmed)

    def lose_device(self) -> dict[str, int]:
        """The device tier's memory was replaced (the model runner restarted, or closed and
        registered its KV again) while kvtier's own host pools live on: forget every device
        copy, keep the host copies and what storage holds. Not kept, since their bytes may
        come from the new memory or be garbage: host copies not yet confirmed
        (`confirm_device_copies`), and nodes with a device transfer in flight (written off:
        their blocks return when the transfer is answered; they are never matched again).
        Requests active now commit nothing more (what they computed is in the old memory)."""
        with self._lock:
            lost = self._lose_device_copies()
            self._lost_requests.update(self._requests)
            self.counters.lost_device += 1
            return lost

    # ------------------------------------------------------------------ diagnostics

    def submit_diagnostic(self, kind: TaskKind, dev_ids: list[int], keys: list[bytes],
                          on_done: OnDone | None = None) -> int:
        """FILL or CHECK device blocks with content derived from `keys` (for --verify and
        tests). `on_done(ok, completion)` runs when every rank has answered."""
        if kind not in (TaskKind.FILL, TaskKind.CHECK):
            raise ValueError(f"not a diagnostic task kind: {kind!r}")
        with self._lock:
            seq = self.next_seq()
            if kind == TaskKind.FILL:
                task = Task(seq, kind, [], list(dev_ids), list(keys), Priority.CONTROL)
            else:
                task = Task(seq, kind, list(dev_ids), [], list(keys), Priority.CONTROL)
            self.track(task, [], on_done=on_done)
            self._flush()
            return seq

    def request_lost(self, request_id: str) -> bool:
        """Whether a worker was lost (`lose_all`) while the request was active: its blocks'
        bytes are gone on that rank (a CHECK there reads another worker's memory), and its
        commits join nothing."""
        with self._lock:
            self._get(request_id)
            return request_id in self._lost_requests

    def request_blocks(self, request_id: str) -> list[int]:
        """The request's block table (device ids, in token order)."""
        with self._lock:
            return list(self._get(request_id).blocks)

    def request_keys(self, request_id: str) -> list[int]:
        with self._lock:
            return list(self._get(request_id).keys)

    # ------------------------------------------------------------------ stats

    def stats(self) -> SchedulerStats:
        """A lock-free snapshot of tier occupancy and counters (values may be a few
        operations apart from each other, never torn)."""
        dev_free = self._dev_pool.num_free
        host_free = self._host_pool.num_free
        dev_cap = self._dev_pool.capacity
        host_cap = self._host_pool.capacity
        dev_tree = self._dev_in_tree
        host_tree = self._host_in_tree
        dev_evictable = self._dev_lru.size
        host_evictable = self._host_lru.size
        c = self.counters
        return {
            "device": {
                "capacity": dev_cap, "free": dev_free, "cached": dev_tree,
                "evictable": dev_evictable,
                "in_use": dev_cap - dev_free - dev_evictable,
                "owned_by_requests": dev_cap - dev_free - dev_tree,
            },
            "host": {
                "capacity": host_cap, "free": host_free, "cached": host_tree,
                "evictable": host_evictable,
                "in_use": host_cap - host_free - host_evictable,
                "owned_by_requests": host_cap - host_free - host_tree,
            },
            "nodes": len(self._map),
            "requests_active": len(self._requests),
            "pinned_blocks": len(self._pins),
            "tasks_inflight": len(self._inflight),
            "tree_status": self.tree_status,
            "paused": self.paused,
            "counters": {k: getattr(c, k) for k in c.__slots__},
        }

    def check_invariants(self) -> None:  # type: ignore[override]
        """Assert every ownership invariant with a full scan (tests call it after every
        step), the active requests' blocks counted as theirs."""
        with self._lock:
            super().check_invariants(list(self._requests.values()))

    # ------------------------------------------------------------------ internals

    def _get(self, request_id: str) -> RequestState:
        req = self._requests.get(request_id)
        if req is None:
            if request_id in self._cancelled:
                raise RequestCancelledError(
                    f"request {request_id!r} was cancelled: the deployment went to sleep "
                    "(weight update); its blocks were reclaimed, match it again after the wake")
            raise UnknownRequestError(
                f"request {request_id!r} is not active (never matched or already released)")
        return req

    def _keys_or_error(self, token_ids: Sequence[int],
                       extra_keys: Sequence[object] | None) -> list[int]:
        try:
            return chain_keys(token_ids, self.block_size, extra_keys=extra_keys)
        except (TokenKeyError, TypeError) as e:
            raise InvalidRequestError(f"token_ids: {e}") from None

    def _load_host_hits(self, req: RequestState, host_hits: list[int],
                        waits: list[tuple[int, int]]) -> int:
        """Give the host-only nodes of a match device blocks and one H2D task; truncate the
        match where the device cannot hold more. Returns the number of host hits kept."""
        nodes = req.nodes
        room = self._dev_pool.num_free + self._dev_lru.size
        if room < len(host_hits):
            self._await_room(len(host_hits))  # transfers in flight may free enough
            room = self._dev_pool.num_free + self._dev_lru.size
        if room < len(host_hits):
            # Keep the prefix up to the first host hit that cannot get a device block.
            cut = host_hits[room]
            for node in nodes[cut:]:
                self.unhit(node)  # type: ignore[arg-type]
            del nodes[cut:]
            host_hits = host_hits[:room]
        if not host_hits:
            return 0
        self._make_room(len(host_hits), "match")
        ids = self._dev_pool.allocate(len(host_hits))
        loaded: list[Node] = [nodes[i] for i in host_hits]  # type: ignore[misc]
        seq = self.load_host_copies(loaded, ids, host_hits[0])
        waits.append((seq, host_hits[0]))
        return len(loaded)

    def _undo_match(self, nodes: list[Node | None]) -> None:
        """A match that raises after its walk (a sleep, or a timeout, while it waited with
        the lock released) gives back what it took (issue 27, item 1): the core's
        `unhit_match`."""
        self.unhit_match([n for n in nodes if n is not None])
