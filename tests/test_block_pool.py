"""Free lists: every id handed out once, all-or-nothing allocation, bad frees caught intact.

A block id given to two owners means two requests writing one block's KV: silent corruption.
So the pool must refuse a double or foreign free *before* touching its lists, and a failed
allocation must take nothing.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.manager.core.block_pool import BlockPool
from kvtier.manager.errors import BlockPoolError, OutOfBlocksError
from support import examples

pytestmark = pytest.mark.fast


def snapshot(pool: BlockPool) -> tuple[list[int], int, list[bool]]:
    return pool.free_ids(), pool.num_free, [pool.is_free(i) for i in range(pool.capacity)]


def test_allocate_all_then_free_all() -> None:
    pool = BlockPool("device", 1000)
    assert pool.num_free == 1000
    ids = pool.allocate(1000)
    assert sorted(ids) == list(range(1000))
    assert pool.num_free == 0 and pool.free_ids() == []
    assert not any(pool.is_free(i) for i in range(1000))
    pool.free(ids)
    assert pool.num_free == 1000
    assert sorted(pool.free_ids()) == list(range(1000))
    again = pool.allocate(1000)
    assert sorted(again) == list(range(1000))


def test_one_at_a_time_counts_and_reuse() -> None:
    pool = BlockPool("host", 8)
    got = [pool.allocate_one() for _ in range(8)]
    assert sorted(got) == list(range(8))
    assert got[:3] == [0, 1, 2], "lowest ids go out first"
    with pytest.raises(OutOfBlocksError, match="host tier: no free block of 8"):
        pool.allocate_one()
    pool.free_one(5)
    assert pool.num_free == 1 and pool.is_free(5)
    assert pool.allocate_one() == 5, "a freed id is the next one out (stack)"
    pool.free([3, 1])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == [1, 3]


def test_allocate_zero_and_negative() -> None:
    pool = BlockPool("device", 4)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError, match="cannot allocate -1 device blocks"):
        pool.allocate(-1)
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="device pool capacity must be >= 0, got -3"):
        BlockPool("device", -3)


def test_empty_pool() -> None:
    pool = BlockPool("host", 0)
    assert pool.num_free == 0 and pool.allocate(0) == []
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    with pytest.raises(BlockPoolError):
        pool.free([0])


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool("device", 10)
    held = pool.allocate(7)
    before = snapshot(pool)
    with pytest.raises(OutOfBlocksError, match="device tier: 4 blocks requested, 3 free of 10"):
        pool.allocate(4)
    assert snapshot(pool) == before
    assert sorted(pool.allocate(3) + held) == list(range(10))


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool("device", 6)
    ids = pool.allocate(4)
    pool.free([ids[0]])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=rf"device tier: block {ids[0]} freed twice"):
        pool.free([ids[0]])
    assert snapshot(pool) == before
    with pytest.raises(BlockPoolError, match=rf"block id {ids[0]} is not allocated"):
        pool.free_one(ids[0])
    assert snapshot(pool) == before
    # A never-allocated id is a double free too.
    with pytest.raises(BlockPoolError, match="freed twice"):
        pool.free([5])
    assert snapshot(pool) == before


@pytest.mark.parametrize("foreign", [-1, 6, 10**9, "1", 1.0, True, None])
def test_foreign_id_raises_and_changes_nothing(foreign: object) -> None:
    pool = BlockPool("host", 6)
    pool.allocate(6)
    pool.free([4])
    before = snapshot(pool)
    with pytest.raises(BlockPoolError, match=r"host tier: block id .* is not"):
        pool.free([foreign])  # type: ignore[list-item]
    assert snapshot(pool) == before
    with pytest.raises(BlockPoolError, match="host tier: block id"):
        pool.free_one(foreign)  # type: ignore[arg-type]
    assert snapshot(pool) == before


@pytest.mark.parametrize("last", ["double", "foreign", "repeat_in_batch"])
def test_batch_with_only_the_last_id_bad_changes_nothing(last: str) -> None:
    pool = BlockPool("device", 8)
    ids = pool.allocate(6)  # 0..5 out, 6 and 7 free
    pool.free([ids[0]])
    bad = {"double": ids[0], "foreign": 8, "repeat_in_batch": ids[1]}[last]
    before = snapshot(pool)
    with pytest.raises(BlockPoolError):
        pool.free([ids[1], ids[2], ids[3], bad])
    assert snapshot(pool) == before
    for i in (ids[1], ids[2], ids[3]):
        assert not pool.is_free(i), f"block {i} must still be allocated"
    # The good ids can still be freed normally afterwards.
    pool.free([ids[1], ids[2], ids[3]])
    assert pool.num_free == 6


def test_reset_frees_everything() -> None:
    pool = BlockPool("device", 5)
    pool.allocate(5)
    pool.reset()
    assert pool.num_free == 5
    assert sorted(pool.allocate(5)) == list(range(5))


class _ListPool:
    """The pool as it was: every free id in one list (the reference the pool must match)."""

    def __init__(self, capacity: int) -> None:
        self.free = list(range(capacity - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        ids = self.free[-n:] if n else []
        del self.free[len(self.free) - n:]
        return ids

    def allocate_one(self) -> int:
        return self.free.pop()


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["many", "one", "free", "reset"]),
                          st.integers(0, 12)), max_size=60))
def test_ids_go_out_exactly_as_from_one_full_list(ops: list[tuple[str, int]]) -> None:
    """Issue 34, item 4: ids never handed out are not listed (a list of every id made each
    full garbage collection walk 2 M items of a node namespace's host tier), and the pool
    still hands out exactly the ids, in exactly the order, that one full list did."""
    cap = 16
    pool, ref = BlockPool("host", cap), _ListPool(cap)
    out: list[int] = []
    for op, n in ops:
        if op == "many" and n <= len(ref.free):
            got = pool.allocate(n)
            assert got == ref.allocate(n)
            out += got
        elif op == "one" and ref.free:
            got1 = pool.allocate_one()
            assert got1 == ref.allocate_one()
            out.append(got1)
        elif op == "free" and out:
            back, out = out[-n:] if n else [], out[:len(out) - n] if n else out
            pool.free(back)
            ref.free += back
        elif op == "reset":
            pool.reset()
            ref, out = _ListPool(cap), []
        assert pool.free_ids() == ref.free
        assert pool.num_free == len(ref.free)
        assert [pool.is_free(i) for i in range(cap)] == [i in ref.free for i in range(cap)]


def test_a_fresh_tier_lists_no_id() -> None:
    pool = BlockPool("host", 2_097_152)
    assert pool.num_free == 2_097_152 and pool._free == []
    assert pool.allocate(3) == [2, 1, 0] and pool.allocate_one() == 3
    pool.free([1])
    assert pool._free == [1] and pool.num_free == 2_097_152 - 3
