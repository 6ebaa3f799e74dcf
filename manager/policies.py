"""Write policies: when a device block gets a host copy.

Each policy is a small strategy object the manager consults at three moments: a block is
committed, a block is hit, a block is evicted from the device. The device eviction order
(`cache.eviction_policy`, at the end of this module) is LRU over the intrusive lists in
`kvtier.manager.core.nodes` by default (O(1) per block, compiled, no strategy object); `lfuda`
and `hitboost` are `HeapEviction` strategies over the same list's evictable nodes, `arc` and
`s3fifo` `SplitEviction` ones, `duel` a `HeapEviction` that admits a drawn share of new
prompts (O(log n)). The host tier's order (`cache.host_eviction_policy`)
is the same choice over the host LRU list's nodes.

| policy                  | on commit | on hit                | device eviction   | after a load |
|-------------------------|-----------|-----------------------|-------------------|--------------|
| write_through           | back up   | back up if no copy    | drop (host keeps) | host kept    |
| write_through_selective | -         | back up at N hits     | drop cold blocks  | host kept    |
| write_back              | -         | -                     | demote, then free | host freed   |

"After a load": write_back keeps the tiers exclusive (a block lives on one of them), the
others keep the host copy as the backup it was made to be.

Storage write policies (`storage.write_policy`): when a host copy is written to storage. The
storage tier asks at two moments (a host copy lands: a device backup, a demotion, an engine
store, a confirmed engine copy; a host copy is hit), the cache core at a third (the host tier
evicts a copy storage lacks):

| policy                  | copy lands         | copy hit          | host evicts an unwritten copy |
|-------------------------|--------------------|-------------------|-------------------------------|
| write_through           | write              | -                 | dropped (counted)             |
| write_through_selective | write if hits >= N | write at N hits   | dropped (counted)             |
| write_back              | -                  | -                 | written first (a batch)       |

N is `storage.write_threshold`; hits are the block's hits on any tier (a match's reference,
an engine's load). write_back writes the oldest unwritten copies in one BACKUP task (up to
`WRITE_BACK_BATCH`; BACKING keeps them) and evicts the oldest written one instead; when none
is within reach, or storage refuses the batch (`storage.max_backup_mb_s`), the oldest copy is
evicted unwritten and counted (`evicted_host_unstored`). Every decision is O(1) per block.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Protocol

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """Decisions of one write policy (see the module table)."""

    name: str
    backup_on_commit: bool
    hit_threshold: int  # 0: never back up on hit
    demote_on_evict: bool
    exclusive: bool  # a host copy is freed once its block is loaded to the device

    def backup_on_hit(self, hits: int) -> bool:
        return self.hit_threshold > 0 and hits >= self.hit_threshold


def make_write_policy(name: str, hit_threshold: int = 2) -> WritePolicy:
    """The policy called `name`; `hit_threshold` applies to write_through_selective."""
    if name == "write_through":
        return WritePolicy(name, True, 1, True, False)
    if name == "write_through_selective":
        if hit_threshold < 1:
            raise ValueError(f"cache.hit_threshold must be >= 1, got {hit_threshold}")
        return WritePolicy(name, False, hit_threshold, False, False)
    if name == "write_back":
        return WritePolicy(name, False, 0, True, True)
    raise ValueError(
        f"cache.write_policy = {name!r}: expected one of {', '.join(WRITE_POLICIES)}"
    )


STORAGE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

WRITE_BACK_BATCH = 32
"""Unwritten host copies one write_back eviction sends to storage at most (one BACKUP task): a
file or Redis write of a few pages costs about as much as one of 32 (one round trip, one
fsync-free batch), and a bound keeps an eviction's scan O(1)."""


@dataclass(frozen=True, slots=True)
class StorageWritePolicy:
    """Decisions of one storage write policy (see the second table of the module docstring)."""

    name: str
    on_land: bool  # every host copy is written when it lands
    hit_threshold: int  # 0: hits never decide; N: written once its block was hit N times
    on_host_evict: bool  # written when the host tier evicts it (write_back)

    def writes(self, hits: int) -> bool:
        """Whether a host copy whose block was hit `hits` times is written now (it landed or
        was hit)."""
        return self.on_land or 0 < self.hit_threshold <= hits


def make_storage_write_policy(name: str, write_threshold: int = 1) -> StorageWritePolicy:
    """The storage write policy called `name`; `write_threshold` applies to
    write_through_selective."""
    if name == "write_through":
        return StorageWritePolicy(name, True, 0, False)
    if name == "write_through_selective":
        if write_threshold < 1:
            raise ValueError(f"storage.write_threshold must be >= 1, got {write_threshold}")
        return StorageWritePolicy(name, False, write_threshold, False)
    if name == "write_back":
        return StorageWritePolicy(name, False, 0, True)
    raise ValueError(f"storage.write_policy = {name!r}: expected one of "
                     f"{', '.join(STORAGE_WRITE_POLICIES)}")


# ------------------------------------------------------------------ eviction order

EVICTION_POLICIES = ("lru", "lfuda", "hitboost", "arc", "s3fifo", "duel")
"""`cache.eviction_policy` and `cache.host_eviction_policy` values. `lru` is the compiled
intrusive list of `kvtier.manager.core.nodes` (no strategy object: the hot path stays as it
was); `lfuda` / `hitboost` are `HeapEviction` strategies, `arc` / `s3fifo` `SplitEviction`
ones."""


class EvictableNode(Protocol):
    """What an eviction strategy reads of a node (the core's `Node` or its compiled twin)."""

    key: int | None
    hits: int
    dprev: Any


class EvictionStrategy:
    """What the core asks of an eviction order, on the device tier (`tier="device"`: fed by
    `released` and `listed`, live while in the device LRU list, `dprev` set) or the host
    tier (`tier="host"`: fed by `touched` each time a host copy joins the host LRU list or
    is used, live while in that list, `hprev` set)."""

    name = "strategy"

    def __init__(self, tier: str = "device") -> None:
        self.tier = tier
        self._link = attrgetter("dprev" if tier == "device" else "hprev")

    def released(self, nodes: Sequence[EvictableNode | None]) -> None:
        raise NotImplementedError

    def listed(self, node: EvictableNode) -> None:
        raise NotImplementedError

    def touched(self, node: EvictableNode) -> None:
        raise NotImplementedError

    def victim(self) -> Any:
        raise NotImplementedError

    def demoted(self, node: EvictableNode) -> None:
        """Host tier, storage write_back: `node`'s copy was just written because it was
        among the next victims; it is listed again as the next victim (of its class), as
        the host list puts it at its oldest end."""
        raise NotImplementedError

    def upcoming(self, n: int) -> list[Any]:
        """The next `n` victims, in order, without evicting them (state unchanged)."""
        raise NotImplementedError

    def forget(self, key: int) -> None:
        """The copy of `key` left the tier by another way than eviction (a host copy freed
        after a load, dropped): its entry dies, its class is no longer counted."""
        raise NotImplementedError

    def compact(self, evictable: Iterable[EvictableNode], size: int,
                alive: Callable[[int], bool]) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError


class HeapEviction(EvictionStrategy):
    """An eviction order given by a priority, the lowest evicted first: the base of every
    device eviction policy but `lru`.

    Data structures: `_heap`, a binary min-heap of entries (priority, -depth, seq, node) with
    lazy deletion; `_meta`, tree key -> (depth, stamp, seq) of the node's newest entry. An
    entry is live when its node is still in its tier's LRU list (device, or host for
    `cache.host_eviction_policy`) (the core's set of evictable
    nodes: no reference, no pin, no transfer) and its seq is the newest; anything else is
    skipped when it surfaces. `push` is O(log n), `victim` amortized O(log n), and the heap is
    rebuilt from the evictable nodes when dead entries outnumber live ones (`compact`).

    Leaves first, without child links: a policy's priority is nondecreasing in the node's
    hits and in its stamp (the policy's clock when its last request released it). A request
    that matches a child matches its parent too (so parent hits >= child hits) and releases
    them together (same stamp; a parent released while pinned or still held by another
    request gets the stamp too, kept for when it is listed later), so a parent's priority is
    never below its child's; ties go to the deeper node.
    Hence the lowest live entry is a node none of whose children is cached on the device.
    Pinned nodes are never in the LRU list, so never live.
    """

    name = "heap"

    def __init__(self, tier: str = "device") -> None:
        super().__init__(tier)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._meta: dict[int, tuple[int, float, int, float]] = {}
        self._seq = 0
        self.clock = 0.0

    # What each policy defines.
    def priority(self, stamp: float, hits: int, bonus: float) -> float:
        raise NotImplementedError

    def request_bonus(self, nodes: Sequence[EvictableNode | None]) -> float:
        """What a policy learns from the released request as a whole, stored with each of
        its nodes (nondecreasing toward the root, or leaves-first breaks). None uses it yet:
        giving first turns' tails a longer life than continuations' measured no gain (6.06%
        against 6.18% at 5% of the shared trace's distinct blocks)."""
        return 0.0

    def on_release(self, blocks: int) -> None:
        """A request released `blocks` blocks (before they are pushed)."""

    def on_evict(self, priority: float) -> None:
        """A node of this priority was chosen as a victim."""

    # The mechanism.
    def released(self, nodes: Sequence[EvictableNode | None]) -> None:
        """A request's nodes (index = depth) were released: push those now evictable."""
        self.on_release(len(nodes))
        stamp = self.clock
        bonus = self.request_bonus(nodes)
        meta = self._meta
        live = self._link
        for depth, node in enumerate(nodes):
            if node is None or node.key is None:
                continue
            if live(node) is not None:
                self._push(node, node.key, depth, stamp, bonus)
            else:
                # Still held (pinned, another request, a transfer): not evictable now, but
                # its stamp moves with its children's, so when `listed` pushes it later it
                # still ranks above every child released meanwhile (leaves first).
                meta[node.key] = (depth, stamp, -1, bonus)

    def listed(self, node: EvictableNode) -> None:
        """`node` joined the device LRU list outside a release (a transfer answered, an
        unpin): its last depth and stamp, or depth 0 and now when it has none."""
        key = node.key
        if key is None:
            return
        meta = self._meta.get(key)
        if meta is None:
            self._push(node, key, 0, self.clock, 0.0)
        else:
            self._push(node, key, meta[0], meta[1], meta[3])

    def touched(self, node: EvictableNode) -> None:
        """Host tier: `node`'s copy joined the host LRU list or was used: one more step of
        the clock, and the node ranks as of now."""
        key = node.key
        if key is None:
            return
        self.on_release(1)
        self._push(node, key, 0, self.clock, 0.0)

    def demoted(self, node: EvictableNode) -> None:
        key = node.key
        if key is not None:
            meta = self._meta.get(key)
            self._push(node, key, 0, -math.inf, 0.0 if meta is None else meta[3])

    def _push(self, node: EvictableNode, key: int, depth: int, stamp: float,
              bonus: float) -> None:
        self._seq = seq = self._seq + 1
        self._meta[key] = (depth, stamp, seq, bonus)
        heapq.heappush(self._heap, (self.priority(stamp, node.hits, bonus), -depth, seq, node))

    def victim(self) -> Any:
        """The evictable node of lowest priority, removed from the heap (None when no live
        entry is left; the caller unlinks and evicts it)."""
        heap = self._heap
        meta = self._meta
        live = self._link
        while heap:
            prio, _, seq, node = heapq.heappop(heap)
            key = node.key
            if key is None or live(node) is None:
                continue
            m = meta.get(key)
            if m is None or m[2] != seq:
                continue
            del meta[key]
            self.on_evict(prio)
            return node
        return None

    def forget(self, key: int) -> None:
        self._meta.pop(key, None)

    def upcoming(self, n: int) -> list[Any]:
        heap = self._heap
        meta = self._meta
        live = self._link
        taken: list[tuple[float, int, int, Any]] = []
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            node = entry[3]
            key = node.key
            if key is None or live(node) is None:
                continue
            m = meta.get(key)
            if m is None or m[2] != entry[2]:
                continue
            taken.append(entry)
        for entry in taken:  # same seqs: live again, in the same order
            heapq.heappush(heap, entry)
        return [e[3] for e in taken]

    def compact(self, evictable: Iterable[EvictableNode], size: int,
                alive: Callable[[int], bool]) -> None:
        """Rebuild the heap from the `size` evictable nodes once dead entries dominate
        (amortized O(1) per push), and forget the meta of keys `alive` rejects (nodes that
        left the device by another path: a reset, a lost worker)."""
        if len(self._heap) <= 2 * size + 4096:
            return
        self._meta = {k: m for k, m in self._meta.items() if alive(k)}
        self._heap = []
        for node in evictable:
            self.listed(node)

    def clear(self) -> None:
        self._heap = []
        self._meta = {}


class LfudaEviction(HeapEviction):
    """LFU with dynamic aging (Arlitt et al., 2000): priority = L + hits + 1, where L (the
    clock) rises to each victim's priority, so blocks hit often long ago age out."""

    name = "lfuda"

    def priority(self, stamp: float, hits: int, bonus: float) -> float:
        return stamp + hits + 1

    def on_evict(self, priority: float) -> None:
        if priority > self.clock:
            self.clock = priority


class HitBoostEviction(HeapEviction):
    """LRU in which a block that was ever hit counts as `boost` times the cache's size
    more recent: the policy designed for prefix trees (figures: README, "Sizing the tiers";
    bench/eviction.py).

    Data: the clock counts released blocks; a node's priority is its release stamp, plus
    `window` once it was hit. Why: a prefix is reused only when a later prompt extends it. On
    the shared conversation trace (first 3,000 requests, 64-token blocks) 23% of new blocks
    are ever reused, a block already hit once 41%; nothing else an online cache sees told
    them apart (hit depth, new-block count). So a one-shot tail leaves `boost * capacity`
    released blocks earlier than LRU would let it, while a hit prefix that stops being used
    still ages out (no frequency ever pins it). boost 1 is the largest measured that stays
    within a point of LRU everywhere: 2 and 4 gain at 5% of the trace (6.29%, 6.61% against
    6.18%) but fall 1.2 and 4.9 points below LRU on the chat workload at 20%; 8 falls below
    LRU on the trace at 10% (12.46% against 12.87%)."""

    name = "hitboost"

    def __init__(self, capacity: int, boost: float = 1.0, tier: str = "device") -> None:
        super().__init__(tier)
        self.window = boost * capacity

    def on_release(self, blocks: int) -> None:
        self.clock += blocks

    def priority(self, stamp: float, hits: int, bonus: float) -> float:
        return stamp + (self.window if hits else 0.0)


_MASK64 = (1 << 64) - 1


def _hash24(key: int, mult: int) -> int:
    """A 24-bit hash of a tree key (Fibonacci hashing: the top bits of key * mult)."""
    return ((key * mult) & _MASK64) >> 40


class _MiniCache:
    """A miniature of `DuelEviction` at one admission share `eps`, over the sampled keys only
    (Waldspurger et al., 2017: a cache of C * R blocks fed the keys whose hash falls below R
    behaves like the full cache of C): how many of the sampled blocks it would have held.

    Data: `cached`, key -> seq of its newest entry; `heap`, (priority, -depth, seq, key) with
    lazy deletion, rebuilt when dead entries outnumber live ones 4 to 1; `clock` counts the
    sampled blocks released. O(log n) per sampled block."""

    __slots__ = ("cached", "capacity", "clock", "eps", "heap", "hits", "seq")

    def __init__(self, eps: float, capacity: int) -> None:
        self.eps = eps
        self.capacity = max(1, capacity)
        self.cached: dict[int, int] = {}
        self.heap: list[tuple[float, int, int, int]] = []
        self.clock = 0.0
        self.seq = 0
        self.hits = 0.0

    def feed(self, blocks: list[tuple[int, int, bool]], admit_draw: int) -> None:
        """One request's sampled blocks (key, depth, hit before), tail first."""
        self.clock += len(blocks)
        admitted = admit_draw < self.eps * _DRAWS
        cached = self.cached
        heap = self.heap
        for key, depth, hit in blocks:
            if key in cached:
                self.hits += 1
            self.seq += 1
            cached[key] = self.seq
            prio = _priority(self.clock, hit, admitted, self.capacity)
            heapq.heappush(heap, (prio, -depth, self.seq, key))
        while len(cached) > self.capacity and heap:
            _, _, seq, key = heapq.heappop(heap)
            if cached.get(key) == seq:
                del cached[key]
        if len(heap) > 4 * self.capacity + 64:
            self.heap = [e for e in heap if cached.get(e[3]) == e[2]]
            heapq.heapify(self.heap)


REFUSED, ADMITTED, HIT = 0.0, 1.0, 2.0
"""`DuelEviction`'s classes of a block (its `bonus` in `HeapEviction`'s meta)."""
_DRAWS = 1 << 24
_ADMIT_MULT = 0x9E3779B97F4A7C15
_SAMPLE_MULT = 0xC2B2AE3D27D4EB4F
_SHUT = 1e15
"""What a block of a refused request loses in priority: more than any clock reaches, so
refused blocks leave before every admitted one (oldest first among themselves)."""


def _priority(stamp: float, hit: bool, admitted: bool, window: float) -> float:
    if hit:
        return stamp + window
    return stamp if admitted else stamp - _SHUT


class DuelEviction(HeapEviction):
    """Sampled admission for prefix trees, its admission share chosen by a duel of
    miniature caches: the policy designed for this trace's reuse (README, "Sizing the
    tiers"; bench/eviction.py).

    Why: on the shared conversation trace (first 3,000 requests) a prefix is reused when its
    conversation's next turn arrives (the next prompt repeats all of this one but its last
    512-token trace block), and that is late: the median follow-up comes 325 requests after
    the last request that shared its prefix (about 70,000 64-token blocks of traffic), the
    first tenth after 117, while LRU at 5% of the distinct blocks keeps a block for about 100
    requests. Only a third of turns are ever followed up (first turns 0.33, second 0.43, third
    0.56), and nothing else the cache sees tells which. So while the cache's residence time
    is short of the reuse distances, keeping a drawn share `eps` of new prompts 1 / eps times
    longer serves more: the share of follow-ups that come within a residence time grows
    faster than linearly at first (under 0.1 within 100 requests, about 0.26 within 200,
    about 0.55 within 400). Once the cache is large enough the trade loses (20%: 16.8% hit at
    eps 1/4 against LRU's 21.9%, simulated), hence the duel that picks eps per cache.

    Classes (`bonus` in the heap's meta): HIT (the block was hit, or was hit before an
    eviction: `_hit_ghost`), ADMITTED (new, its request's draw < eps), REFUSED (new, the draw
    >= eps). Priority = the release stamp (the clock counts released blocks, as `hitboost`'s),
    plus the cache's size for HIT (`hitboost`'s protection), minus `_SHUT` for REFUSED, so
    refused blocks leave first (oldest first among them). The draw is a hash of the key of
    the request's first new block: replays are deterministic.

    Data: the `HeapEviction` heap and meta; `_hit_ghost`, keys evicted after a hit, oldest
    first, at most `capacity` (`OrderedDict`: O(1)); `_minis`, one `_MiniCache` per share in
    `SHARES`, each fed the released blocks whose key hashes below the sample rate (at least
    1/16, all keys below 2,048 blocks), with `capacity * rate` blocks. Every `PERIOD` miniature
    sizes of sampled blocks the miniatures' hit counts halve and `eps` becomes the share whose
    miniature served the most (ties to the larger share: the LRU-like side). PERIOD 4 is what
    measured best of 4 and 16 (16: 7.8% at 5% of the trace against 9.3%; the same at 10%).

    Leaves first: a block's class is carried up from the tail of its release (a parent is
    HIT when a child is), and a request's new blocks are deeper than its hit ones, so a
    parent's class is never below its child's; with the same stamp priority stays
    nondecreasing toward the root, as `HeapEviction` needs. O(log n) per block (and per
    sampled block in each of the 4 miniatures)."""

    name = "duel"
    SHARES = (1.0, 0.5, 0.25, 0.125)
    PERIOD = 4
    MIN_RATE = 1 / 16

    def __init__(self, capacity: int, tier: str = "device") -> None:
        super().__init__(tier)
        self.window = float(max(1, capacity))
        # The sample: all keys for small caches (too few blocks to sample), at least 1/16,
        # and a miniature of at least about 2,048 blocks.
        self.rate = min(1.0, max(self.MIN_RATE, 2048 / max(1, capacity)))
        mini = max(1, round(capacity * self.rate))
        self._minis = [_MiniCache(e, mini) for e in self.SHARES]
        self._sampled = 0
        self._period = self.PERIOD * mini
        self.eps = 1.0
        # keys evicted after a hit, oldest first, at most `capacity` (the blocks of a
        # conversation that came back once: recommitted, they rank as hit)
        self._hit_ghost: OrderedDict[int, None] = OrderedDict()

    def on_release(self, blocks: int) -> None:
        self.clock += blocks

    def released(self, nodes: Sequence[EvictableNode | None]) -> None:
        """Each node's class (HIT: hit, or hit before it was evicted; ADMITTED; REFUSED),
        carried up from the tail so that a parent's is never below its child's; the
        miniatures fed and `eps` moved; then pushed as `HeapEviction.released` pushes."""
        self.on_release(len(nodes))
        stamp = self.clock
        ghost = self._hit_ghost
        flags: list[bool] = [False] * len(nodes)
        up = False
        for depth in range(len(nodes) - 1, -1, -1):
            node = nodes[depth]
            if node is None or node.key is None:
                continue
            up = up or node.hits > 0 or node.key in ghost
            flags[depth] = up
        draw = 0
        for depth, node in enumerate(nodes):
            if node is not None and node.key is not None and not flags[depth]:
                draw = _hash24(node.key, _ADMIT_MULT)
                break
        self._duel(nodes, flags, draw)
        new = ADMITTED if draw < self.eps * _DRAWS else REFUSED
        meta = self._meta
        live = self._link
        for depth, node in enumerate(nodes):
            if node is None or node.key is None:
                continue
            cls = HIT if flags[depth] else new
            if live(node) is not None:
                self._push(node, node.key, depth, stamp, cls)
            else:  # held: kept for `listed`, as HeapEviction keeps it
                meta[node.key] = (depth, stamp, -1, cls)

    def _duel(self, nodes: Sequence[EvictableNode | None], flags: list[bool],
              draw: int) -> None:
        cut = self.rate * _DRAWS
        sample = [(key, depth, flags[depth]) for depth in range(len(nodes) - 1, -1, -1)
                  if (node := nodes[depth]) is not None and (key := node.key) is not None
                  and _hash24(key, _SAMPLE_MULT) < cut]
        if not sample:
            return
        for m in self._minis:
            m.feed(sample, draw)
        self._sampled += len(sample)
        if self._sampled >= self._period:
            self._sampled = 0
            best = max(self._minis, key=lambda m: (m.hits, m.eps))
            self.eps = best.eps
            for m in self._minis:
                m.hits *= 0.5

    def clear(self) -> None:
        super().clear()
        self._hit_ghost.clear()

    def victim(self) -> Any:
        node = super().victim()
        if node is not None and node.key is not None and node.hits:
            ghost = self._hit_ghost
            ghost[node.key] = None
            ghost.move_to_end(node.key)
            if len(ghost) > self.window:
                ghost.popitem(last=False)
        return node

    def priority(self, stamp: float, hits: int, bonus: float) -> float:
        return _priority(stamp, bonus >= HIT, bonus >= ADMITTED, self.window)

    def listed(self, node: EvictableNode) -> None:
        """As `HeapEviction.listed`, but a node with no release behind it is admitted."""
        key = node.key
        if key is None:
            return
        meta = self._meta.get(key)
        if meta is None:
            self._push(node, key, 0, self.clock, ADMITTED)
        else:
            self._push(node, key, meta[0], meta[1], meta[3])

    def touched(self, node: EvictableNode) -> None:
        """Host tier: a copy joined or was used: admitted (a host copy has no request to
        draw from), so the host order is `hitboost`'s."""
        key = node.key
        if key is None:
            return
        self.on_release(1)
        self._push(node, key, 0, self.clock, HIT if node.hits else ADMITTED)


class SplitEviction(EvictionStrategy):
    """Two queues, a probation one (class 0: blocks never hit) and a protected one (class 1:
    hit at least once, or readmitted from a ghost list), each ordered by (stamp, -depth,
    seq), the stamp being the clock of the node's last release (device: one step per
    released request; host: one per touch). Each policy decides which queue loses a block
    (`evict_probation`) and what a ghost hit teaches it (`ghost_hit`); the mechanism keeps
    the rest.

    Data: `_heaps`, two binary min-heaps with lazy deletion, as `HeapEviction`'s; `_meta`,
    key -> (depth, stamp, seq, class); `sizes`, the cached keys of each class (held ones
    included, as ARC counts them); `ghosts`, the keys evicted from each class, oldest first,
    each bounded by the tier's capacity (`OrderedDict`: O(1) insert, hit, trim). Every
    operation O(log n) amortized.

    Leaves first, without child links: a class never decreases while a node is cached, a
    node counts as hit when any deeper node of the same release is (a release runs from the
    tail up, carrying the class), and a parent is released whenever its child is, so a
    parent's class is >= its child's and its (stamp, -depth) > its child's. Within a queue
    the lowest entry is thus no parent of a queued node of that queue; across queues a
    protected block leaves only when its (stamp, -depth) is below the probation queue's
    lowest one, which no ancestor of a probation block can be. When the policy wants the
    protected queue and this guard refuses, the probation queue's lowest goes instead (the
    one place the policies differ from their papers: a guard, not a change of what a queue
    holds)."""

    name = "split"

    def __init__(self, capacity: int, tier: str = "device") -> None:
        super().__init__(tier)
        self.capacity = max(1, capacity)
        self._heaps: tuple[list[tuple[float, int, int, Any]], ...] = ([], [])
        self._meta: dict[int, tuple[int, float, int, int]] = {}
        self.sizes = [0, 0]
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (
            OrderedDict(), OrderedDict())
        self._seq = 0
        self.clock = 0.0

    # What each policy defines.
    def evict_probation(self) -> bool:
        raise NotImplementedError

    def ghost_hit(self, cls: int) -> None:
        """A block evicted from class `cls` came back (it joins the protected class)."""

    def keeps_ghost(self, cls: int) -> bool:
        return True

    # The mechanism.
    def _class(self, node: EvictableNode, key: int) -> int:
        m = self._meta.get(key)
        if m is not None and m[3]:
            return 1
        if node.hits:
            return 1
        if m is None:
            for cls, ghost in enumerate(self.ghosts):
                if key in ghost:
                    del ghost[key]
                    self.ghost_hit(cls)
                    return 1
        return 0

    def _set(self, key: int, depth: int, stamp: float, seq: int, cls: int) -> None:
        old = self._meta.get(key)
        if old is not None:
            self.sizes[old[3]] -= 1
        self._meta[key] = (depth, stamp, seq, cls)
        self.sizes[cls] += 1

    def _push(self, node: EvictableNode, key: int, depth: int, stamp: float, cls: int) -> None:
        self._seq = seq = self._seq + 1
        self._set(key, depth, stamp, seq, cls)
        heapq.heappush(self._heaps[cls], (stamp, -depth, seq, node))

    def released(self, nodes: Sequence[EvictableNode | None]) -> None:
        self.clock += 1
        stamp = self.clock
        live = self._link
        up = 0
        for depth in range(len(nodes) - 1, -1, -1):  # tail first: the class carried up
            node = nodes[depth]
            if node is None or node.key is None:
                continue
            key = node.key
            cls = max(up, self._class(node, key))
            up = cls
            if live(node) is not None:
                self._push(node, key, depth, stamp, cls)
            else:  # held: its depth, stamp and class kept for `listed`
                self._set(key, depth, stamp, -1, cls)

    def listed(self, node: EvictableNode) -> None:
        key = node.key
        if key is None:
            return
        m = self._meta.get(key)
        if m is None:
            self._push(node, key, 0, self.clock, self._class(node, key))
        else:
            self._push(node, key, m[0], m[1], m[3])

    def touched(self, node: EvictableNode) -> None:
        key = node.key
        if key is None:
            return
        self.clock += 1
        self._push(node, key, 0, self.clock, self._class(node, key))

    def demoted(self, node: EvictableNode) -> None:
        key = node.key
        if key is not None:
            meta = self._meta.get(key)
            cls = self._class(node, key) if meta is None else meta[3]
            self._push(node, key, 0, -math.inf, cls)

    def _top(self, cls: int) -> tuple[float, int, int, Any] | None:
        heap = self._heaps[cls]
        meta = self._meta
        live = self._link
        while heap:
            entry = heap[0]
            node = entry[3]
            key = node.key
            if key is not None and live(node) is not None:
                m = meta.get(key)
                if m is not None and m[2] == entry[2]:
                    return entry
            heapq.heappop(heap)
        return None

    def _choose(self) -> int:
        """The class that loses its lowest entry next (-1: none evictable)."""
        t0, t1 = self._top(0), self._top(1)
        if t0 is None:
            return -1 if t1 is None else 1
        if t1 is None or self.evict_probation():
            return 0
        return 1 if (t1[0], t1[1]) < (t0[0], t0[1]) else 0  # the leaves-first guard

    def _evict(self, cls: int, ghost_too: bool = True) -> Any:
        node = heapq.heappop(self._heaps[cls])[3]
        key = node.key
        del self._meta[key]
        self.sizes[cls] -= 1
        if ghost_too and self.keeps_ghost(cls):
            ghost = self.ghosts[cls]
            ghost[key] = None
            if len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return node

    def forget(self, key: int) -> None:
        m = self._meta.pop(key, None)
        if m is not None:
            self.sizes[m[3]] -= 1

    def victim(self) -> Any:
        cls = self._choose()
        return None if cls < 0 else self._evict(cls)

    def upcoming(self, n: int) -> list[Any]:
        """The next `n` victims without evicting them: taken off the heaps as eviction
        would (the ghosts untouched: they decide nothing about the next victim), then put
        back with their seqs and the sizes restored. O(n log n)."""
        saved_sizes = list(self.sizes)
        out: list[tuple[int, tuple[float, int, int, Any], tuple[int, float, int, int]]] = []
        while len(out) < n:
            cls = self._choose()
            if cls < 0:
                break
            entry = self._heaps[cls][0]
            meta = self._meta[entry[3].key]
            self._evict(cls, ghost_too=False)
            out.append((cls, entry, meta))
        for cls, entry, meta in out:
            heapq.heappush(self._heaps[cls], entry)
            self._meta[entry[3].key] = meta
        self.sizes = saved_sizes
        return [e[3] for _, e, _ in out]

    def compact(self, evictable: Iterable[EvictableNode], size: int,
                alive: Callable[[int], bool]) -> None:
        if len(self._heaps[0]) + len(self._heaps[1]) <= 2 * size + 4096:
            return
        self._meta = {k: m for k, m in self._meta.items() if alive(k)}
        self.sizes = [0, 0]
        for m in self._meta.values():
            self.sizes[m[3]] += 1
        self._heaps = ([], [])
        for node in evictable:
            self.listed(node)

    def clear(self) -> None:
        self._heaps = ([], [])
        self._meta = {}
        self.sizes = [0, 0]


class ArcEviction(SplitEviction):
    """ARC (Megiddo and Modha, 2003) over a prefix tree: T1 = the probation queue (cached,
    never hit), T2 = the protected one, B1 / B2 = the ghosts of each; the target `p` for
    T1's size grows on a B1 hit by max(1, |B2| / |B1|) and shrinks on a B2 hit by max(1,
    |B1| / |B2|), within [0, capacity]; T1 loses a block while it holds more than `p`."""

    name = "arc"

    def __init__(self, capacity: int, tier: str = "device") -> None:
        super().__init__(capacity, tier)
        self.p = 0.0

    def evict_probation(self) -> bool:
        return self.sizes[0] > self.p

    def ghost_hit(self, cls: int) -> None:
        b1, b2 = len(self.ghosts[0]) + (cls == 0), len(self.ghosts[1]) + (cls == 1)
        if cls == 0:
            self.p = min(float(self.capacity), self.p + max(1.0, b2 / b1))
        else:
            self.p = max(0.0, self.p - max(1.0, b1 / b2))


class S3FifoEviction(SplitEviction):
    """S3-FIFO (Yang et al., 2023) over a prefix tree: S = the probation queue (a tenth of
    the capacity: new blocks, FIFO by insertion since a never-hit block is released once),
    M = the protected one (hit blocks, by last release: the paper's FIFO with reinsertion
    approximates it), G = the ghost of S only; S loses a block while it holds a tenth of the
    capacity or more, a block back from G joins M."""

    name = "s3fifo"
    small = 0.1

    def evict_probation(self) -> bool:
        return self.sizes[0] >= self.small * self.capacity

    def keeps_ghost(self, cls: int) -> bool:
        return cls == 0


def make_eviction_policy(name: str, capacity: int, tier: str = "device",
                         key: str = "cache.eviction_policy") -> EvictionStrategy | None:
    """The strategy for `key = name` on a tier of `capacity` blocks; None for `lru` (the
    core's compiled list order)."""
    if name == "lru":
        return None
    if name == "lfuda":
        return LfudaEviction(tier)
    if name == "hitboost":
        return HitBoostEviction(capacity, tier=tier)
    if name == "arc":
        return ArcEviction(capacity, tier)
    if name == "s3fifo":
        return S3FifoEviction(capacity, tier)
    if name == "duel":
        return DuelEviction(capacity, tier)
    raise ValueError(f"{key} = {name!r}: expected one of {', '.join(EVICTION_POLICIES)}")
