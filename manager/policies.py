"""Write policies: when a device block gets a host copy.

Each policy is a small strategy object the manager consults at three moments: a block is
committed, a block is hit, a block is evicted from the device. The device eviction order
(`cache.eviction_policy`, at the end of this module) is LRU over the intrusive lists in
`kvtier.manager.core.nodes` by default (O(1) per block, compiled, no strategy object); `lfuda`
and `hitboost` are `HeapEviction` strategies over the same list's evictable nodes (O(log n)).
The host tier's order is LRU only.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
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


# ------------------------------------------------------------------ device eviction order

EVICTION_POLICIES = ("lru", "lfuda", "hitboost")
"""`cache.eviction_policy` values. `lru` is the compiled intrusive list of
`kvtier.manager.core.nodes` (no strategy object: the hot path stays as it was); the others
are `HeapEviction` strategies."""


class EvictableNode(Protocol):
    """What an eviction strategy reads of a node (the core's `Node` or its compiled twin)."""

    key: int | None
    hits: int
    dprev: Any


class HeapEviction:
    """An eviction order given by a priority, the lowest evicted first: the base of every
    device eviction policy but `lru`.

    Data structures: `_heap`, a binary min-heap of entries (priority, -depth, seq, node) with
    lazy deletion; `_meta`, tree key -> (depth, stamp, seq) of the node's newest entry. An
    entry is live when its node is still in the device LRU list (the core's set of evictable
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

    def __init__(self) -> None:
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
        for depth, node in enumerate(nodes):
            if node is None or node.key is None:
                continue
            if node.dprev is not None:
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
        while heap:
            prio, _, seq, node = heapq.heappop(heap)
            key = node.key
            if key is None or node.dprev is None:
                continue
            m = meta.get(key)
            if m is None or m[2] != seq:
                continue
            del meta[key]
            self.on_evict(prio)
            return node
        return None

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

    def __init__(self, capacity: int, boost: float = 1.0) -> None:
        super().__init__()
        self.window = boost * capacity

    def on_release(self, blocks: int) -> None:
        self.clock += blocks

    def priority(self, stamp: float, hits: int, bonus: float) -> float:
        return stamp + (self.window if hits else 0.0)


def make_eviction_policy(name: str, capacity: int) -> HeapEviction | None:
    """The strategy for `cache.eviction_policy = name` on a tier of `capacity` blocks; None
    for `lru` (the core's compiled list order)."""
    if name == "lru":
        return None
    if name == "lfuda":
        return LfudaEviction()
    if name == "hitboost":
        return HitBoostEviction(capacity)
    raise ValueError(f"cache.eviction_policy = {name!r}: expected one of "
                     f"{', '.join(EVICTION_POLICIES)}")
