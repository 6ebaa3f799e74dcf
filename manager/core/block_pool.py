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
      * `_free`: a stack (Python list) of free ids; allocation pops from its end, free pushes:
        O(1) per id. The int objects are created once and shared with their owners, so
        handing out ids allocates no memory.
      * `_used`: one byte per id, 1 while the id is out of the pool.

    Invariants: an id is in `_free` exactly when `_used[id] == 0`; `len(_free) + used ==
    capacity`. Allocation is all or nothing; a bad free raises before anything changes.
    """

    __slots__ = ("_free", "_used", "capacity", "tier")

    def __init__(self, tier: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"{tier} pool capacity must be >= 0, got {capacity}")
        self.tier = tier
        self.capacity = capacity
        # Reversed so that the lowest ids go out first (easier to read in logs and tests).
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` ids, or OutOfBlocksError with nothing taken."""
        free = self._free
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} {self.tier} blocks")
        if n > len(free):
            raise OutOfBlocksError(
                f"{self.tier} tier: {n} blocks requested, {len(free)} free "
                f"of {self.capacity}"
            )
        ids = free[-n:]
        del free[-n:]
        used = self._used
        for i in ids:
            used[i] = 1
        return ids

    def allocate_one(self) -> int:
        if not self._free:
            raise OutOfBlocksError(f"{self.tier} tier: no free block of {self.capacity}")
        i = self._free.pop()
        self._used[i] = 1
        return i

    def free(self, ids: Iterable[int]) -> None:
        """Return ids; raises BlockPoolError (changing nothing) on a double or foreign free."""
        ids = list(ids)
        # The compiled check-and-free (see manager.core.native) does the same in one call; it
        # declines (changing nothing) whenever an error is due, which is raised below.
        if native.pool_free is not None and native.pool_free(self._used, self._free, ids):
            return
        used = self._used
        cap = self.capacity
        seen: set[int] = set()
        for i in ids:
            if type(i) is not int or not 0 <= i < cap:
                raise BlockPoolError(f"{self.tier} tier: block id {i!r} is not in 0..{cap - 1}")
            if not used[i] or i in seen:
                raise BlockPoolError(f"{self.tier} tier: block {i} freed twice")
            seen.add(i)
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
        used = self._used
        cap = self.capacity
        seen: set[int] = set()
        for i in ids:
            if type(i) is not int or not 0 <= i < cap:
                raise BlockPoolError(f"{self.tier} tier: block id {i!r} is not in 0..{cap - 1}")
            if used[i] or i in seen:
                raise BlockPoolError(f"{self.tier} tier: block {i} is not free")
            seen.add(i)
        for i in ids:
            used[i] = 1
        self._free = [i for i in self._free if not used[i]]

    def is_free(self, i: int) -> bool:
        return not self._used[i]

    def free_ids(self) -> list[int]:
        """A copy of the free list (for invariant checks and tests)."""
        return list(self._free)

    def reset(self) -> None:
        """Everything free again (only when no owner holds an id any more)."""
        self._free = list(range(self.capacity - 1, -1, -1))
        self._used = bytearray(self.capacity)
