"""The planner's clairvoyant offline curve (`kvtier.manager.plan.offline_hit_blocks`): held to
an exhaustive search over every schedule a prefix-tree cache of the same size could follow
(hypothesis, small streams), to LRU's exact curve, the scheduler and every eviction policy's
replay (never below any), and to the planner's JSON.
"""

from __future__ import annotations

import random
from itertools import combinations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier.manager.plan import (
    PlanInputs,
    build_plan,
    device_hit_blocks,
    offline_hit_blocks,
    policy_hit_blocks,
    stack_profile,
)
from kvtier.manager.policies import EVICTION_POLICIES
from support import examples

pytestmark = pytest.mark.fast


@st.composite
def prompt_streams(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Short prompts that share prefixes over a 2-token vocabulary (each extends a random
    earlier one, or nothing, by a few tokens; some repeat an earlier prefix exactly)."""
    bs = draw(st.integers(1, 3))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(1, 9))):
        base = rng.choice(prompts) if prompts and rng.random() < 0.8 else []
        cut = rng.randint(0, len(base))
        if rng.random() < 0.2 and base:
            prompts.append(list(base[:max(1, cut)]))
            continue
        prompts.append(base[:cut] + [rng.randrange(2) for _ in range(rng.randint(1, 3 * bs))])
    return prompts, bs


def exhaustive(reqs: list[list[int]], limits: list[int], capacity: int) -> int:
    """The most blocks any cache of `capacity` blocks serves: every schedule of caches, each
    the previous one plus the request's blocks cut to a prefix-closed set of at most
    `capacity` blocks (what a tree cache can keep), hits the leading run of cached looked-up
    blocks. Dynamic programming over cache contents (the best hit count per content)."""
    parent: dict[int, int | None] = {}
    for blocks in reqs:
        for j, b in enumerate(blocks):
            parent[b] = blocks[j - 1] if j else None
    states: dict[frozenset[int], int] = {frozenset(): 0}
    for blocks, lim in zip(reqs, limits, strict=True):
        nxt: dict[frozenset[int], int] = {}
        for cache, got in states.items():
            run = 0
            for b in blocks[:lim]:
                if b not in cache:
                    break
                run += 1
            pool = sorted(cache | set(blocks))
            for k in range(min(capacity, len(pool)) + 1):
                for keep in combinations(pool, k):
                    s = frozenset(keep)
                    closed = all(parent[b] is None or parent[b] in s for b in s)
                    if closed and nxt.get(s, -1) < got + run:
                        nxt[s] = got + run
        states = nxt
    return max(states.values())


@given(prompt_streams())
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_offline_curve_equals_exhaustive_search(case: tuple[list[list[int]], int]) -> None:
    prompts, bs = case
    prof = stack_profile(prompts, bs)
    if prof.distinct_blocks > 11:  # keep the search small (2^11 subsets per state at most)
        return
    reqs = [b.tolist() for b in prof.blocks]
    limits = prof.limit.tolist()
    sizes = list(range(0, prof.distinct_blocks + 2))
    got = offline_hit_blocks(prof, sizes).tolist()
    want = [exhaustive(reqs, limits, c) for c in sizes]
    assert got == want, (sizes, got, want)


@given(prompt_streams())
@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_offline_curve_is_never_below_lru_the_scheduler_or_any_policy(
        case: tuple[list[list[int]], int]) -> None:
    prompts, bs = case
    prof = stack_profile(prompts, bs)
    top = prof.distinct_blocks + 2
    off = offline_hit_blocks(prof, range(top + 1))
    lru = device_hit_blocks(prof, top)
    assert (off >= lru).all(), (off.tolist(), lru.tolist())
    assert (np.diff(off) >= 0).all()  # more room never serves less
    # ... nor below the scheduler's replay at the same size under any eviction policy (lru
    # included: the scheduler as `kvtier replay` drives it)
    lo = max(prof.min_device_blocks, 1)
    for policy in EVICTION_POLICIES:
        got = policy_hit_blocks(prompts, bs, range(lo, top + 1), policy)
        assert all(g <= o for g, o in zip(got, off[lo:].tolist(), strict=True)), policy
    # Unbounded, it serves every reuse, as LRU does.
    assert off[-1] == lru[-1]


def test_offline_curve_in_the_plan() -> None:
    """A stream where LRU thrashes: three prompts of 4 blocks in a loop, 8 blocks of room.
    LRU keeps the two most recent prompts and the next one is always the third; Belady keeps
    one prompt for good and serves it every third request."""
    bs = 2
    prompts = [[p] * 9 for p in (1, 2, 3)] * 6  # 4 full blocks + 1 token each
    prof = stack_profile(prompts, bs)
    lru = device_hit_blocks(prof, 12)
    off = offline_hit_blocks(prof, [8])
    assert lru[8] == 0 and off[0] > 0
    plan = build_plan(prof, PlanInputs(bs, 1, 8, 0, "write_back"), offline_points=50)
    curve = dict((s, r) for s, r in plan["offline_curve"])
    assert curve[8] == pytest.approx(int(off[0]) * bs / prof.lookup_tokens)
    assert all(r >= dict(plan["device_curve"])[s] - 1e-12 for s, r in plan["offline_curve"])
    assert plan["offline"]["bounds"]
