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

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress
from typing import TypedDict

from kvtier.manager import native
from kvtier.manager.block_pool import BlockPool
from kvtier.manager.cache_state import OnDone, RequestState, StorageHooks
from kvtier.manager.errors import (
    AsleepError,
    InvalidRequestError,
    OutOfBlocksError,
    RequestCancelledError,
    ResetBusyError,
    TransferTimeoutError,
    UnknownRequestError,
)
from kvtier.manager.keys import TokenKeyError, chain_keys
from kvtier.manager.policies import WritePolicy, make_write_policy
from kvtier.manager.transfers import Dispatcher, ImmediateDispatcher, LoadHandle
from kvtier.manager.tree import (
    BACKING,
    CANCEL_EVICT,
    DEVICE_BUSY,
    ENGINE_READ,
    ENGINE_WRITE,
    EVICTING,
    FROM_STORAGE,
    HOST_BUSY,
    LOADING,
    PINNED,
    PREFETCHING,
    SAVING,
    STORED,
    DeviceLRU,
    HostLRU,
    Node,
)
from kvtier.worker.wire import Completion, Priority, Task, TaskKind

_monotonic = time.monotonic
# ENGINE_READ / ENGINE_WRITE: host copies an engine's own process is copying (manager.keyed).
IN_FLIGHT = LOADING | SAVING | EVICTING | PREFETCHING | BACKING | ENGINE_READ | ENGINE_WRITE

TREE_NORMAL, TREE_CLEARING, TREE_CLEARED = 0, 1, 2


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


@dataclass(slots=True)
class Counters:
    """Monotonic counters read by metrics without the lock."""

    requests: int = 0
    lookup_tokens: int = 0
    hit_device_tokens: int = 0
    hit_host_tokens: int = 0
    hit_storage_tokens: int = 0
    evicted_device_drop: int = 0
    evicted_device_demote: int = 0
    evicted_host_drop: int = 0
    d2h_blocks: int = 0
    h2d_blocks: int = 0
    failed_tasks: int = 0
    resets: int = 0
    lost_all: int = 0
    sleeps: int = 0
    lost_device: int = 0  # the device memory was replaced, host copies kept (`lose_device`)


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


@dataclass(slots=True)
class _Inflight:
    """A submitted task the manager still waits to hear about."""

    task: Task
    nodes: list[Node]
    first_block: int = 0
    handles: list[tuple[LoadHandle, int]] = field(default_factory=list)  # (waiter, block idx)
    on_done: OnDone | None = None  # diagnostic and storage-tier tasks


class KVCacheManager:
    """Prefix tree, free lists and policies of the device and host tiers of one deployment.

    Data structures:
      * `_map`: tree key (int) -> Node, the whole prefix tree (keys are chained): a dict, or
        the compiled `KeyMap` with compiled nodes (see manager.native).
      * `_dev_pool` / `_host_pool`: BlockPool free lists of each tier.
      * `_dev_lru` / `_host_lru`: intrusive LRU lists of evictable nodes (see manager.tree).
      * `_requests`: request id -> RequestState (`kvtier.manager.cache_state`).
      * `_inflight`: task seq -> _Inflight for every task not yet reported.
      * `_pins`: node -> pin count (admin pins; a pinned node is never evicted).
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
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"cache.block_size must be > 0, got {block_size}")
        if device_blocks <= 0:
            raise ValueError(f"cache.device_blocks must be > 0, got {device_blocks}")
        if host_blocks < 0:
            raise ValueError(f"cache.host_blocks must be >= 0, got {host_blocks}")
        if decode_reserve_blocks < 0:
            raise ValueError(
                f"cache.decode_reserve_blocks must be >= 0, got {decode_reserve_blocks}")
        self.block_size = block_size
        self.num_layers = num_layers
        self.page_bytes = page_bytes
        self.decode_reserve_blocks = decode_reserve_blocks
        self.transfer_timeout_s = transfer_timeout_s
        self.policy = (write_policy if isinstance(write_policy, WritePolicy)
                       else make_write_policy(write_policy, hit_threshold))
        self._dev_pool = BlockPool("device", device_blocks)
        self._host_pool = BlockPool("host", host_blocks)
        # The tree map, node classes and per-block loops, compiled or pure Python, fixed for
        # this manager's lifetime (see manager.native): nodes and maps of one kind only ever
        # meet loops of the same kind.
        self._loops = loops = native.bound()
        self._dev_lru = DeviceLRU(loops.node_class)
        # Device-only deployments use the leaner node (no host links, no storage key). The
        # scheduler handles it as a Node (same attributes, host ones class constants). The
        # narrow ignores on the hot paths below stand for what the types cannot say without
        # a per-block check: a node linked in an LRU list has its `dev` (or `host`) and links.
        self._node_cls = loops.node_class if host_blocks else loops.device_node_class
        self._host_lru = HostLRU(loops.node_class)
        # Sized for the most nodes the tree can hold (each holds a block of its own), so the
        # compiled map never grows while serving: no resize pause at 10M blocks.
        self._map: native.TreeMap = loops.new_tree(device_blocks + host_blocks)
        self._requests: dict[str, RequestState] = {}
        self._inflight: dict[int, _Inflight] = {}
        self._pins: dict[Node, int] = {}
        # Nodes that left the tree (worker lost) while a transfer still used their blocks:
        # the blocks return to the free lists when the last rank has answered.
        self._written_off: set[Node] = set()
        # Requests active when every cached byte was lost (`lose_all`): what they computed
        # before is gone on some rank, so their commits join nothing.
        self._lost_requests: set[str] = set()
        # Engine KV (`track_device_copies`): host copies whose D2H completed after the last
        # registration check that confirmed the device memory they were read from, as
        # (completion number, node, host block); trusted, and backed up to storage, only
        # once `confirm_device_copies` covers them, dropped by `lose_device`.
        self.track_device_copies = False
        self._unconfirmed: deque[tuple[int, Node, int]] = deque()
        self._d2h_done = 0
        self._seq = 0
        self._outbox: list[Task] = []
        self._lock = threading.RLock()
        self.dispatcher = dispatcher or ImmediateDispatcher()
        self.dispatcher.bind(self._on_complete)
        self.counters = Counters()
        self.tree_status = TREE_NORMAL
        self.paused = False
        # Sleep (see the module docstring): `asleep` refuses scheduler calls; `_cancelled`
        # holds the requests a sleep cancelled until they are released or matched again.
        self.asleep = False
        self._cancelled: set[str] = set()
        self._dev_in_tree = 0
        self._host_in_tree = 0
        # The storage tier, handed in by whoever builds the manager (`kvtier.manager.stack`)
        # when storage is configured; it sees the manager as a `CacheState`.
        self.storage: StorageHooks | None = None

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
                    # Plain device hits in one call (compiled or not, see manager.native);
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
                        if node.flags & FROM_STORAGE:
                            n_storage += 1
                        node.flags = (node.flags | LOADING) & ~FROM_STORAGE
                        if node.hprev is not None:
                            self._host_lru.unlink(node)
                    elif node.flags:
                        fl = node.flags
                        if fl & EVICTING:
                            node.flags = fl | CANCEL_EVICT
                        if fl & LOADING:
                            seq = self._loading_seq(node)
                            if seq is not None:
                                waits.append((seq, len(nodes)))
                    prev = node.dprev
                    if prev is not None:  # leave the device LRU (inlined DeviceLRU.unlink)
                        nxt = node.dnext
                        prev.dnext = nxt
                        nxt.dprev = prev  # type: ignore[union-attr]
                        node.dprev = node.dnext = None
                        unlinked += 1
                    node.ref += 1
                    node.hits += 1
                    node.last = now
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
                self._backup([n for n in backups if n.dev is not None and n.host is None
                              and not n.flags & (SAVING | LOADING | EVICTING)])
            handle = LoadHandle(self.dispatcher if waits else None, waits, n_hit * bs, bs,
                                self.transfer_timeout_s)
            req.handle = handle
            if self.counters.lost_all + self.counters.lost_device != lost_before:
                # A worker was lost while this match waited (lock released): what it found
                # is gone on that rank. Nothing of it is valid, and nothing it computes is
                # cached.
                handle.note_failure(0)
                self._lost_requests.add(request_id)
            for seq, idx in waits:
                rec = self._inflight.get(seq)
                if rec is not None:
                    rec.handles.append((handle, idx))
            self._flush()
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
            exclusive = self.policy.exclusive
            new_node = self._node_cls
            commit_walk = self._loops.commit_walk
            joined = 0
            while True:
                # New nodes and duplicates in one call (compiled or not, see manager.native);
                # it stops at a node cached on the host only, handled here.
                i = commit_walk(m, keys, blocks, nodes, n_full, now, new_node, new_nodes)
                if i >= n_full:
                    break
                key = keys[i]
                node = m.get(key)
                if node is None:
                    node = new_node(key, blocks[i], None, now)
                    node.ref = 1
                    m[key] = node
                    new_nodes.append(node)
                elif node.dev is None:
                    # Cached on the host only: our freshly computed block becomes its
                    # device copy.
                    node.dev = blocks[i]
                    node.ref += 1
                    node.last = now
                    self._dev_in_tree += 1
                    if exclusive and node.host is not None and not node.flags & HOST_BUSY:
                        self._drop_host_copy(node)
                    joined += 1
                else:
                    node = None  # a duplicate: the request keeps its own block
                nodes.append(node)
            joined += len(new_nodes)
            self._dev_in_tree += len(new_nodes)
            if self.storage is not None and new_nodes:
                skeys = self.storage.request_skeys(req, token_ids, n_full)
                for i in range(start, n_full):
                    node = nodes[i]
                    if node is not None and node.skey is None:
                        node.skey = skeys[i]
            if new_nodes and self.policy.backup_on_commit and self._host_pool.capacity:
                self._backup(new_nodes)
            self._flush()
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
            # manager.native), which leaves the request's own blocks to free here.
            lru = self._dev_lru
            rest, appended = self._loops.release_walk(nodes, lru.head, now, DEVICE_BUSY)
            lru.size += appended
            for i in rest:
                node = nodes[i]
                if node is None:
                    pool.free_one(blocks[i])
                elif node.dev is not None and not node.flags & IN_FLIGHT:
                    pool.free_one(node.dev)  # detached: the block was the requests' own
                    node.dev = None

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
                if node is None:
                    break
                if node.dev is None:
                    if node.host is None or node.flags & HOST_BUSY:
                        break
                    if not self._room_for(1):
                        break
                    node.flags |= LOADING  # keeps the host copy while room is made
                    if node.hprev is not None:
                        self._host_lru.unlink(node)
                    self._make_room(1, "pin")
                    node.dev = self._dev_pool.allocate_one()
                    self._dev_in_tree += 1
                    self._submit(TaskKind.H2D, [node.host], [node.dev], [node], Priority.LOAD)
                    self.counters.h2d_blocks += 1
                if node.flags & EVICTING:  # a demotion in flight must keep the device copy
                    node.flags |= CANCEL_EVICT
                node.flags |= PINNED
                self._refresh(node)
                self._pins[node] = self._pins.get(node, 0) + 1
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
                if node is None or node not in self._pins:
                    break
                left = self._pins[node] - 1
                if left:
                    self._pins[node] = left
                else:
                    del self._pins[node]
                    node.flags &= ~PINNED
                    freed.append(node)
                count += 1
            for node in reversed(freed):  # tail first: leaves age first
                self._refresh(node)
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
            self._dev_pool = BlockPool("device", device_blocks)
            self._host_pool = BlockPool("host", host_blocks)
            loops = self._loops
            self._dev_lru = DeviceLRU(loops.node_class)
            self._host_lru = HostLRU(loops.node_class)
            self._node_cls = loops.node_class if host_blocks else loops.device_node_class
            self._map.clear()
            self._pins.clear()
            self._written_off.clear()
            self._unconfirmed.clear()  # their nodes went with the tree
            self._dev_in_tree = self._host_in_tree = 0
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
            confirmed: list[Node] = []
            queue = self._unconfirmed
            while queue and queue[0][0] < mark:
                _, node, host = queue.popleft()
                if node.key is not None and node.host == host:
                    confirmed.append(node)
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
            host_dropped = written_off = dev_dropped = detached = 0
            while self._unconfirmed:
                _, node, host = self._unconfirmed.popleft()
                if node.key is None or node.host != host:
                    continue
                if node.flags & (HOST_BUSY & ~PINNED):
                    self._write_off(node)
                    written_off += 1
                    continue
                self._drop_host_copy(node)
                host_dropped += 1
                self._refresh(node)
                self._forget(node)
            for node in list(self._map.values()):
                if node.dev is None:
                    continue
                if node.flags & (LOADING | SAVING | EVICTING):
                    self._write_off(node)
                    written_off += 1
                    continue
                if node.ref == 0:
                    if node.dprev is not None:
                        self._dev_lru.unlink(node)
                    self._dev_pool.free_one(node.dev)
                    node.dev = None
                    self._dev_in_tree -= 1
                    dev_dropped += 1
                    self._refresh(node)
                    self._forget(node)
                    continue
                # Requests hold the block: it becomes theirs (a detached node); a host copy
                # stays cached under a fresh node, unless a host transfer uses it now.
                if node.host is not None and node.flags & (PREFETCHING | BACKING):
                    self._write_off(node)
                    written_off += 1
                    continue
                detached += 1
                key = node.key
                assert key is not None
                if node.host is not None:
                    fresh = self._node_cls(key, None, node.host, node.last)
                    fresh.hits = node.hits
                    fresh.skey = node.skey
                    fresh.flags = node.flags & (STORED | FROM_STORAGE | PINNED)
                    if node.hprev is not None:
                        self._host_lru.unlink(node)
                    self._map[key] = fresh
                    if node in self._pins:
                        self._pins[fresh] = self._pins.pop(node)
                    node.host = None
                    self._refresh(fresh)
                else:
                    del self._map[key]
                    self._pins.pop(node, None)
                if node.dprev is not None:
                    self._dev_lru.unlink(node)
                node.key = None
                node.flags &= ~(PINNED | STORED | FROM_STORAGE)
                self._dev_in_tree -= 1
            self._lost_requests.update(self._requests)
            self.counters.lost_device += 1
            return {"device_blocks": dev_dropped, "detached_in_use": detached,
                    "unconfirmed_host_blocks": host_dropped, "written_off": written_off,
                    "nodes_kept": len(self._map)}

    def _write_off(self, node: Node) -> None:
        """Take an attached node out of the tree now. Blocks a transfer in flight uses come
        back when it is answered (`_written_off`, `_settle`); a device block requests hold
        becomes theirs. Caller holds the lock."""
        if node.dprev is not None:
            self._dev_lru.unlink(node)
        if node.hprev is not None:
            self._host_lru.unlink(node)
        if node.dev is not None:
            self._dev_in_tree -= 1
        if node.host is not None:
            self._host_in_tree -= 1
        if node.key is not None and self._map.get(node.key) is node:
            del self._map[node.key]
        self._pins.pop(node, None)
        node.key = None
        node.flags &= ~PINNED
        if node.flags & IN_FLIGHT:
            self._written_off.add(node)
        else:
            self._settle(node)

    # ------------------------------------------------------------------ diagnostics

    def submit_diagnostic(self, kind: TaskKind, dev_ids: list[int], keys: list[bytes],
                          on_done: OnDone | None = None) -> int:
        """FILL or CHECK device blocks with content derived from `keys` (for --verify and
        tests). `on_done(ok, completion)` runs when every rank has answered."""
        if kind not in (TaskKind.FILL, TaskKind.CHECK):
            raise ValueError(f"not a diagnostic task kind: {kind!r}")
        with self._lock:
            seq = self._next_seq()
            if kind == TaskKind.FILL:
                task = Task(seq, kind, [], list(dev_ids), list(keys), Priority.CONTROL)
            else:
                task = Task(seq, kind, list(dev_ids), [], list(keys), Priority.CONTROL)
            self._inflight[seq] = _Inflight(task, [], on_done=on_done)
            self._outbox.append(task)
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

    # ------------------------------------------------------------------ storage tier interface
    # `kvtier.manager.cache_state.CacheState`: what the storage tier is handed instead of the
    # manager's internals. Called with the lock held (except `lock`); none of it is on the
    # match / allocate / commit / release path.

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def lookup(self, key: int) -> Node | None:
        return self._map.get(key)

    def cached_nodes(self) -> Iterable[Node]:
        return self._map.values()

    def next_seq(self) -> int:
        return self._next_seq()

    def track(self, task: Task, nodes: list[Node], on_done: OnDone | None = None) -> None:
        """Queue a task built elsewhere (storage tier); sent at the end of the API call."""
        self._inflight[task.seq] = _Inflight(task, nodes, on_done=on_done)
        self._outbox.append(task)

    def wait_unlocked(self, seqs: list[int], timeout: float | None = None) -> None:
        self._wait_unlocked(seqs, timeout)

    def take_host_block(self) -> int | None:
        return self._host_block()

    def new_host_node(self, key: int, host: int, now: float) -> Node:
        return self._loops.node_class(key, None, host, now)

    def adopt_host_node(self, node: Node) -> None:
        assert node.key is not None and node.host is not None and node.dev is None
        self._map[node.key] = node
        self._host_in_tree += 1

    def free_host_copy(self, node: Node) -> None:
        self._host_pool.free_one(node.host)  # type: ignore[arg-type]
        node.host = None
        self._host_in_tree -= node.key is not None

    def relist(self, node: Node) -> None:
        self._refresh(node)

    def after_transfer(self, node: Node) -> None:
        self._refresh(node)
        self._forget(node)
        self._settle(node)

    # ------------------------------------------------------------------ key-addressed surface
    # What `kvtier.manager.keyed.KeyedHostCache` needs beyond `CacheState` (lock held).

    @property
    def tree_map(self) -> native.TreeMap:
        """The tree map itself (key -> node; the object lives as long as the manager), for
        the compiled batch lookups of `kvtier.manager.keyed`."""
        return self._map

    @property
    def host_capacity(self) -> int:
        return self._host_pool.capacity

    @property
    def host_free(self) -> int:
        return self._host_pool.num_free

    def host_block_is_free(self, host_id: int) -> bool:
        return self._host_pool.is_free(host_id)

    def give_host_blocks(self, ids: list[int]) -> None:
        """Return host blocks taken with `take_host_block` and never used."""
        if ids:
            self._host_pool.free(ids)

    def relist_tail(self, node: Node) -> None:
        """Make an evictable host copy the most recently used."""
        if node.hprev is not None:
            self._host_lru.unlink(node)
            self._host_lru.append(node)

    def flush(self) -> None:
        """Send the tasks queued so far (the scheduler API calls do it when they end)."""
        self._flush()

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

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _submit(self, kind: TaskKind, src: list[int], dst: list[int], nodes: list[Node],
                priority: int, first_block: int = 0) -> int:
        seq = self._next_seq()
        task = Task(seq, kind, src, dst, [], priority)
        self._inflight[seq] = _Inflight(task, nodes, first_block)
        self._outbox.append(task)
        return seq

    def _flush(self) -> None:
        """Hand queued tasks to the dispatcher once the state they describe is complete (an
        immediate dispatcher re-enters `_on_complete`)."""
        while self._outbox:
            tasks, self._outbox = self._outbox, []
            for t in tasks:
                self.dispatcher.submit(t)

    def _loading_seq(self, node: Node) -> int | None:
        for seq, rec in self._inflight.items():
            if rec.task.kind == TaskKind.H2D and node in rec.nodes:
                return seq
        return None

    def _room_for(self, n: int) -> bool:
        return self._dev_pool.num_free + self._dev_lru.size >= n

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
                self._unref_after_failed_match(node)  # type: ignore[arg-type]
            del nodes[cut:]
            host_hits = host_hits[:room]
        if not host_hits:
            return 0
        self._make_room(len(host_hits), "match")
        ids = self._dev_pool.allocate(len(host_hits))
        src: list[int] = []
        loaded: list[Node] = []
        for i, dev in zip(host_hits, ids, strict=True):
            node = nodes[i]
            assert node is not None
            node.dev = dev
            src.append(node.host)  # type: ignore[arg-type]
            loaded.append(node)
        self._dev_in_tree += len(loaded)
        seq = self._submit(TaskKind.H2D, src, ids, loaded, Priority.LOAD, host_hits[0])
        self.counters.h2d_blocks += len(loaded)
        waits.append((seq, host_hits[0]))
        return len(loaded)

    def _undo_match(self, nodes: list[Node | None]) -> None:
        """A match that raises after its walk (a sleep, or a timeout, while it waited with
        the lock released) gives back what it took: its references, and the LOADING flag of
        its host hits, whose H2D was never sent. A node a sleep (or a lost worker) wrote off
        meanwhile settles here: no answer will ever come for it, and on main it kept every
        wake refused as 'still in flight' (issue 27, item 1)."""
        for node in reversed(nodes):  # tail first: leaves age first
            if node is None:
                continue
            self._unref_after_failed_match(node)
            if node.key is None:
                self._settle(node)

    def _unref_after_failed_match(self, node: Node) -> None:
        node.ref -= 1
        node.hits -= 1
        if node.dev is None:
            node.flags &= ~LOADING
        self._refresh(node)

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
                self._flush()
                self._wait_unlocked(demoting)

    def _busy_device_blocks(self) -> list[tuple[int, int]]:
        """(seq, blocks) of the transfers in flight whose device blocks no request holds: each
        block becomes free or evictable when its task is answered. Oldest first. A scan of
        the tasks in flight: only for allocations that would otherwise fail."""
        out: list[tuple[int, int]] = []
        for seq, rec in self._inflight.items():
            if rec.task.kind not in (TaskKind.D2H, TaskKind.H2D):
                continue
            n = sum(1 for node in rec.nodes
                    if node.dev is not None and node.ref == 0 and not node.flags & PINNED)
            if n:
                out.append((seq, n))
        out.sort()
        return out

    def _await_room(self, n: int) -> int:
        """Wait (lock released, at most `transfer_timeout_s` in all) for the transfers in
        flight that will make free + evictable reach `n` device blocks, as long as they
        can. Returns the device blocks still busy in transfers."""
        pool, lru = self._dev_pool, self._dev_lru
        deadline = _monotonic() + self.transfer_timeout_s
        while True:
            busy = self._busy_device_blocks()
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
                self._wait_unlocked(seqs, left)
            except TransferTimeoutError:
                return sum(b for _, b in self._busy_device_blocks())

    def _evict_device(self, n: int) -> list[int]:
        """Evict up to `n` LRU device blocks; returns the seqs of demotions to wait for."""
        lru = self._dev_lru
        pool = self._dev_pool
        policy = self.policy
        host_tier = self._host_pool.capacity > 0
        c = self.counters
        if not host_tier:
            # Device only: every victim is dropped. Unlink a run of victims from the head of
            # the list in one pass (compiled or not, see manager.native) and free their
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
        for _ in range(n):
            victim = lru.oldest()
            if victim is None:
                break
            lru.unlink(victim)
            if victim.host is not None:
                c.evicted_device_demote += 1
                pool.free_one(victim.dev)  # type: ignore[arg-type]
                victim.dev = None
                self._dev_in_tree -= 1
                continue
            if policy.demote_on_evict and host_tier:
                hb = self._host_block()
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
        return [self._submit(TaskKind.D2H, demote_src, demote_dst, demote_nodes,
                             Priority.EVICT)]

    def _host_block(self) -> int | None:
        """One free host block, evicting the LRU host copy if needed; None if impossible."""
        pool = self._host_pool
        if pool.num_free:
            return pool.allocate_one()
        victim = self._host_lru.oldest()
        if victim is None:
            return None
        self._host_lru.unlink(victim)
        hb = victim.host
        victim.host = None
        self._host_in_tree -= 1
        self.counters.evicted_host_drop += 1
        if victim.dev is None:
            self._forget(victim)
        return hb  # handed over without passing through the free list

    def _forget(self, node: Node) -> None:
        """Remove a node that holds no block any more from the tree."""
        if node.key is not None and node.dev is None and node.host is None:
            if self._map.get(node.key) is node:
                del self._map[node.key]
            self._pins.pop(node, None)
            node.key = None

    def _drop_host_copy(self, node: Node) -> None:
        if node.hprev is not None:
            self._host_lru.unlink(node)
        self._host_pool.free_one(node.host)  # type: ignore[arg-type]
        node.host = None
        self._host_in_tree -= 1

    def _backup(self, nodes: list[Node]) -> None:
        """Copy device blocks to the host in one low-priority D2H task, as far as host
        blocks can be had without evicting anything busy."""
        src: list[int] = []
        dst: list[int] = []
        saving: list[Node] = []
        for node in reversed(nodes):  # tail first, so their LRU order stays leaves-first
            if node.host is not None or node.dev is None:
                continue
            hb = self._host_block()
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
            self._submit(TaskKind.D2H, src, dst, saving, Priority.BACKUP)

    def _refresh(self, node: Node) -> None:
        """Put `node` in exactly the LRU lists it belongs to (after any state change)."""
        flags = node.flags
        attached = node.key is not None
        want_dev = (attached and node.dev is not None and node.ref == 0
                    and not flags & DEVICE_BUSY)
        if want_dev != (node.dprev is not None):
            if want_dev:
                self._dev_lru.append(node)
            else:
                self._dev_lru.unlink(node)
        want_host = attached and node.host is not None and not flags & HOST_BUSY
        if want_host != (node.hprev is not None):
            if want_host:
                self._host_lru.append(node)
            else:
                self._host_lru.unlink(node)

    def _wait_unlocked(self, seqs: list[int], timeout: float | None = None) -> None:
        """Send what is queued, then wait for tasks with the lock released, so the completion
        thread can apply them."""
        self._flush()
        sleeps = self.counters.sleeps
        depth = 0
        while True:  # release however many times the calling thread holds the lock
            try:
                self._lock.release()
            except RuntimeError:
                break
            depth += 1
        try:
            self.dispatcher.wait(seqs, self.transfer_timeout_s if timeout is None else timeout)
        finally:
            for _ in range(depth):
                self._lock.acquire()
        if self.counters.sleeps != sleeps:
            # Everything this call held was reclaimed by the sleep: it must not go on.
            raise RequestCancelledError(
                "the deployment went to sleep while this call waited for a transfer; "
                "match again after the wake")

    # ------------------------------------------------------------------ completions

    def _on_complete(self, comp: Completion) -> None:
        with self._lock:
            rec = self._inflight.pop(comp.seq, None)
            if rec is None:
                return
            ok = comp.ok
            if not ok:
                self.counters.failed_tasks += 1
            kind = rec.task.kind
            if kind == TaskKind.H2D:
                self._finish_load(rec, ok, comp.error)
            elif kind == TaskKind.D2H:
                self._finish_d2h(rec, ok)
            if rec.on_done is not None:
                rec.on_done(ok, comp)
            self._flush()

    def _finish_load(self, rec: _Inflight, ok: bool, error: str = "") -> None:
        exclusive = self.policy.exclusive
        for node in reversed(rec.nodes):  # tail first: leaves age first
            node.flags &= ~LOADING
            if ok:
                if exclusive and node.host is not None and node.key is not None:
                    self._host_pool.free_one(node.host)
                    node.host = None
                    self._host_in_tree -= 1
                self._refresh(node)
                self._settle(node)
                continue
            # The device copy is garbage. Requests holding the node keep the block (they
            # recompute into it); the host copy stays cached under a fresh node.
            dev = node.dev
            node.dev = None
            if node.key is not None:
                self._dev_in_tree -= 1
            if node.ref > 0:
                if node.key is not None:
                    fresh = self._node_cls(node.key, None, node.host, node.last)
                    fresh.hits = node.hits
                    self._map[node.key] = fresh
                    if node in self._pins:
                        self._pins[fresh] = self._pins.pop(node)
                        fresh.flags |= PINNED
                    node.host = None
                    node.key = None
                    self._refresh(fresh)
                node.dev = dev  # detached: owned by its requests now
                node.flags &= ~PINNED
                self._refresh(node)
            else:
                self._dev_pool.free_one(dev)  # type: ignore[arg-type]
                self._refresh(node)
                self._forget(node)
            self._settle(node)
        if not ok:
            for h, idx in rec.handles:
                h.note_failure(idx, error)
        rec.handles.clear()

    def _finish_d2h(self, rec: _Inflight, ok: bool) -> None:
        for node in rec.nodes:
            flags = node.flags
            evicting = flags & EVICTING
            node.flags = flags & ~(SAVING | EVICTING | CANCEL_EVICT)
            attached = node.key is not None
            if not ok and node.host is not None:
                self._host_pool.free_one(node.host)
                node.host = None
                self._host_in_tree -= attached
            if (evicting and not flags & (CANCEL_EVICT | PINNED) and node.ref == 0
                    and node.dev is not None):
                # The demotion landed (or failed: the block was being evicted anyway).
                self._dev_pool.free_one(node.dev)
                node.dev = None
                self._dev_in_tree -= attached
            self._refresh(node)
            self._forget(node)
            self._settle(node)
        if ok and self.track_device_copies:
            # Read from the model runner's memory, which may have been replaced under the
            # task: trusted (and backed up) once a registration check confirms it.
            done = self._d2h_done
            self._d2h_done = done + 1
            for node in rec.nodes:
                if node.key is not None and node.host is not None:
                    self._unconfirmed.append((done, node, node.host))
        elif ok and self.storage is not None:
            self.storage.backup(rec.nodes)

    def _settle(self, node: Node) -> None:
        """A detached node whose last transfer has been answered gives its blocks back (the
        device block only once no request holds it)."""
        if node.key is not None or node.flags & IN_FLIGHT:
            return
        self._written_off.discard(node)
        if node.host is not None:
            self._host_pool.free_one(node.host)
            node.host = None
        if node.ref == 0 and node.dev is not None:
            self._dev_pool.free_one(node.dev)
            node.dev = None

    def _clear_all(self) -> dict[str, int]:
        """Drop every node. Nodes held by requests become detached (their device blocks the
        requests' own); nodes a transfer still uses keep their blocks until it is answered
        (`_written_off`). Caller holds the lock."""
        # Freed ids go back in id order (marked here, listed in one pass below), so the free
        # lists come out the same whichever map (dict or compiled, iterated in different
        # orders) holds the tree.
        dev_ids = bytearray(self._dev_pool.capacity)
        host_ids = bytearray(self._host_pool.capacity)
        # Every node in the LRU lists is in the tree: both lists empty in one pass each.
        self._dev_lru.clear()
        self._host_lru.clear()
        # Nodes with no transfer in flight in one call (compiled or not, see manager.native).
        dev_freed, host_freed, detached, busy = self._loops.clear_walk(
            list(self._map.values()), dev_ids, host_ids, IN_FLIGHT)
        for node in busy:  # a transfer still uses its blocks
            node.flags &= IN_FLIGHT
            node.key = None
            self._written_off.add(node)
            if (node.dev is not None and node.ref == 0
                    and not node.flags & (LOADING | SAVING | EVICTING)):
                # Only its host copy is in use (a storage backup reads it): the device
                # block is free now, not when that slower task is answered.
                dev_ids[node.dev] = 1
                node.dev = None
                dev_freed += 1
        self._dev_pool.free(compress(range(len(dev_ids)), dev_ids))
        self._host_pool.free(compress(range(len(host_ids)), host_ids))
        nodes = len(self._map)
        pins = len(self._pins)
        self._unconfirmed.clear()
        self._map.clear()
        self._pins.clear()
        self._dev_in_tree = 0
        self._host_in_tree = 0
        return {"nodes": nodes, "device_blocks": dev_freed, "host_blocks": host_freed,
                "detached_in_use": detached, "pins": pins}

    # ------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Assert the brief's invariants with a full scan (tests call it after every step)."""
        with self._lock:
            for tier, pool, attr, lru in (("device", self._dev_pool, "dev", self._dev_lru),
                                          ("host", self._host_pool, "host", self._host_lru)):
                free = pool.free_ids()
                assert len(free) == len(set(free)), f"{tier}: free list has duplicates"
                tree_ids = [getattr(n, attr) for n in self._map.values()
                            if getattr(n, attr) is not None]
                assert len(tree_ids) == len(set(tree_ids)), f"{tier}: id held by two nodes"
                owned: list[int] = []
                if tier == "device":
                    seen_detached: set[int] = set()
                    for req in self._requests.values():
                        for i, b in enumerate(req.blocks):
                            node = req.nodes[i] if i < len(req.nodes) else None
                            if i >= len(req.nodes) or node is None:
                                owned.append(b)
                            elif node.key is None and id(node) not in seen_detached:
                                seen_detached.add(id(node))
                                assert node.dev == b, f"device: detached node lost block {b}"
                                owned.append(b)
                            elif node.key is not None:
                                assert node.dev == b, (
                                    f"device: request block {b} differs from its node {node}")
                    assert len(owned) == len(set(owned)), f"{tier}: id owned twice"
                    owned += [n.dev for n in self._written_off
                              if n.dev is not None and id(n) not in seen_detached]
                else:
                    owned += [n.host for n in self._written_off if n.host is not None]
                everything = free + tree_ids + owned
                assert len(everything) == len(set(everything)), (
                    f"{tier}: an id is in two of free/tree/requests")
                assert len(everything) == pool.capacity, (
                    f"{tier}: {len(free)} free + {len(tree_ids)} tree + {len(owned)} owned "
                    f"!= capacity {pool.capacity}")
                for i in free:
                    assert pool.is_free(i)
                in_lru = list(lru)
                assert len(in_lru) == lru.size, f"{tier}: LRU size counter is off"
                busy = DEVICE_BUSY if tier == "device" else HOST_BUSY
                for n in in_lru:
                    assert n.key is not None and self._map.get(n.key) is n, f"{tier}: stale LRU"
                    assert getattr(n, attr) is not None
                    assert not n.flags & busy, f"{tier}: busy node {n} is evictable"
                    if tier == "device":
                        assert n.ref == 0, f"device: referenced node {n} is evictable"
                for n in self._map.values():
                    want = getattr(n, attr) is not None and not n.flags & busy and (
                        tier == "host" or n.ref == 0)
                    linked = (n.dprev if tier == "device" else n.hprev) is not None
                    assert want == linked, f"{tier}: node {n} LRU membership wrong"
            assert self._dev_in_tree == sum(1 for n in self._map.values() if n.dev is not None)
            assert self._host_in_tree == sum(1 for n in self._map.values()
                                             if n.host is not None)
            for node in self._pins:
                assert node.flags & PINNED and node.key is not None
            for key, node in self._map.items():
                assert node.key == key
                assert node.dev is not None or node.host is not None, f"empty node {node}"
                assert node.ref >= 0
                if node.flags & PINNED:
                    assert node in self._pins
            inflight_nodes = {id(n) for r in self._inflight.values() for n in r.nodes}
            for n in self._map.values():
                if n.flags & (LOADING | SAVING | EVICTING | PREFETCHING | BACKING):
                    assert id(n) in inflight_nodes, f"{n} flagged in flight but no task"
