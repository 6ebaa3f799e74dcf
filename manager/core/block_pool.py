"""Free lists of one tier's block ids.

The manager only hands out ids; the bytes live in the workers. A pool must never give an id to
two owners, so every free is checked (double free, foreign id) before it touches the list.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.manager.core import native
from kvtier.manager.errors import BlockPoolError, OutOfBlocksError


class BlockPool:
    """Block ids 0..capacity-1 of one tier.

    Data structures:
      * `_free`: a stack (Python list) of the free ids handed out before and given back;
        allocation pops from its end, free pushes: O(1) per id.
      * `_next`: the ids `_next`..capacity-1 have never been handed out: free, and not listed
        (they go out in ascending order once `_free` is empty, as if they lay below it in
        descending order, so the pool hands out ids exactly as a full list would).
      * `_used`: one byte per id, 1 while the id is out of the pool.

    Invariants: an id is free (`_used[id] == 0`) exactly when it is in `_free` or
    `>= _next`, never both; `len(_free) + capacity - _next + used == capacity`. Allocation is
    all or nothing; a bad free raises before anything changes.

    Why the never-used ids are not listed: a list of every id is one container of
    `capacity` items that each full pass of Python's cyclic garbage collector walks. A
    2,097,152-block host tier (a node namespace) made every full collection 0.30 s longer
    (0.48 s against 0.18 s on the loaded 2-core box): the first `prepare_store` of such a
    namespace triggered one and held the namespace lock (and the GIL) that long (issue 34).
    The list now holds only ids given back, so a fresh tier costs nothing to build or walk.
    """

    __slots__ = ("_free", "_next", "_used", "capacity", "tier")

    def __init__(self, tier: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{tier} pool capacity must be >= 0, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        # The lowest ids go out first (easier to read in logs and tests).
        self._free: list[int] = []
        self._next = 0
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free) + self.capacity - self._next

    def allocate(self, n: int) -> list[int]:
        """`n` ids, or OutOfBlocksError with nothing taken."""
        free = self._free
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} {self.tier} blocks")
        fresh = n - len(free)  # from the never-used ids (as if below the list: taken first)
        if fresh > self.capacity - self._next:
            raise OutOfBlocksError(
                f"{self.tier} tier: {n} blocks requested, {self.num_free} free "
                f"of {self.capacity}"
            )
        if fresh > 0:
            at = self._next
            self._next = at + fresh
            ids = list(range(at + fresh - 1, at - 1, -1))
            ids += free
            free.clear()
        else:
            ids = free[-n:]
            del free[-n:]
        used = self._used
        for i in ids:
            used[i] = 1
        return ids

    def allocate_one(self) -> int:
        if self._free:
            i = self._free.pop()
        elif self._next < self.capacity:
            i = self._next
            self._next = i + 1
        else:
            raise OutOfBlocksError(f"{self.tier} tier: no free block of {self.capacity}")
        self._used[i] = 1
        return i

    def free(self, ids: Iterable[int]) -> None:
        """Return ids; raises BlockPoolError (changing nothing) on a double or foreign free."""
        ids = list(ids)
        # The compiled check-and-free (see manager.core.native) does the same in one call; it
        # declines (changing nothing) whenever an error is due, which is raised below.
        if native.pool_free is not None and native.pool_free(self._used, self._free, ids):
            return
        self._check(ids, out=True, what="freed twice")
        used = self._used
        for i in ids:
            used[i] = 0
        self._free.extend(ids)

    def free_one(self, i: int) -> None:
        if not (type(i) is int and 0 <= i < self.capacity and self._used[i]):
            raise BlockPoolError(
                f"{self.tier} tier: block id {i!r} is not allocated (double or foreign free)"
            )
        self._used[i] = 0
        self._free.append(i)

    def take(self, ids: Iterable[int]) -> None:
        """Take these particular ids out of the pool (a node service adopting the host
        copies its predecessor handed over, issue 37). All or nothing: an id out of range,
        repeated or not free raises BlockPoolError and nothing is taken. O(capacity)."""
        ids = list(ids)
        self._check(ids, out=False, what="is not free")
        used = self._used
        cap = self.capacity
        for i in ids:
            used[i] = 1
        if self._next < cap:  # the never-used ids are free unlisted: list them first (in
            # the order they would go out), or a taken one would be handed out again
            self._free = [*range(cap - 1, self._next - 1, -1), *self._free]
            self._next = cap
        self._free = [i for i in self._free if not used[i]]

    def _check(self, ids: list[int], *, out: bool, what: str) -> None:
        """Raise BlockPoolError (before anything changes) unless every id is in range, named
        once, and out of the pool (`out`, a free) or in it (a take)."""
        used = self._used
        cap = self.capacity
        seen: set[int] = set()
        for i in ids:
            if type(i) is not int or not 0 <= i < cap:
                raise BlockPoolError(f"{self.tier} tier: block id {i!r} is not in 0..{cap - 1}")
            if bool(used[i]) is not out or i in seen:
                raise BlockPoolError(f"{self.tier} tier: block {i} {what}")
            seen.add(i)

    def is_free(self, i: int) -> bool:
        return not self._used[i]

    def free_ids(self) -> list[int]:
        """Every free id, in the order a full free list would hold them (the next one out
        last): for invariant checks and tests. O(free)."""
        return [*range(self.capacity - 1, self._next - 1, -1), *self._free]

    def reset(self) -> None:
        """Everything free again (only when no owner holds an id any more)."""
        self._free = []
        self._next = 0
        self._used = bytearray(self.capacity)
