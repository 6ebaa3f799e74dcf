"""`kvtier plan`'s one pass against the way it replaces: replaying the stream through the
scheduler once per candidate size. Block accesses per second of each, interleaved, with the
ratio; both on one core (the process is pinned to one CPU where the OS allows).

* plan: `kvtier.manager.plan.profile_from_ids` (the stack-distance pass, every size at once)
  plus the device curve, over a generated prefix-sharing stream of `--accesses` block accesses
  (conversations over shared system prompts: each request extends an earlier one).
* scheduler: the same stream through `KVCacheManager` (in process, no workers: the cheapest
  a replay of one size can be), as `kvtier replay` drives it, at one device size.
* With `--trace FILE`: the whole command's pass on a Mooncake trace as well (tokens -> chained
  keys -> distances), the figure `kvtier plan` prints as accesses/s.

    .venv/bin/python bench/plan.py [--accesses 1000000] [--reps 3] [--trace FILE [--limit N]]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import numpy as np
from kvtier.manager.plan import device_hit_blocks, profile_from_ids, stack_profile
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.workloads import read_trace

BLOCK = 16


def stream(accesses: int, seed: int = 1) -> tuple[list[np.ndarray], list[int], int]:
    """Requests as dense block ids: 64 open conversations over 8 system prompts of 16
    blocks, each turn adding 4-12 blocks, a conversation ending after 8 turns."""
    rng = random.Random(seed)
    next_id = 0
    systems = []
    for _ in range(8):
        systems.append(list(range(next_id, next_id + 16)))
        next_id += 16
    open_convs: list[list[int]] = []
    turns: list[int] = []
    reqs: list[np.ndarray] = []
    lens: list[int] = []
    total = 0
    while total < accesses:
        if len(open_convs) < 64:
            open_convs.append(list(rng.choice(systems)))
            turns.append(0)
        k = rng.randrange(len(open_convs))
        conv = open_convs[k]
        add = rng.randint(4, 12)
        conv.extend(range(next_id, next_id + add))
        next_id += add
        reqs.append(np.array(conv, dtype=np.int64))
        lens.append(len(conv) * BLOCK + rng.randrange(BLOCK))
        total += len(conv)
        turns[k] += 1
        if turns[k] == 8:
            open_convs.pop(k)
            turns.pop(k)
    return reqs, lens, next_id


def scheduler_pass(reqs: list[np.ndarray], lens: list[int], device_blocks: int) -> int:
    """Hit blocks of one device size, the stream replayed through the scheduler. Token i of
    block b is b * BLOCK + i, so equal block ids give equal tokens (and keys)."""
    m = KVCacheManager(block_size=BLOCK, device_blocks=device_blocks, host_blocks=0)
    hits = 0
    offs = np.arange(BLOCK, dtype=np.int64)
    for i, (blocks, n) in enumerate(zip(reqs, lens, strict=True)):
        toks = (blocks[:, None] * BLOCK + offs).ravel().tolist()
        toks += [0] * (n - len(toks))  # the partial block's tokens
        rid = f"r{i}"
        mr = m.match(rid, toks)
        m.allocate(rid, n - mr.num_tokens, reserve_blocks=0)
        m.commit(rid, toks, n)
        m.release(rid)
        hits += mr.num_tokens // BLOCK
    return hits


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accesses", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace", metavar="FILE")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        print(f"pinned to CPU {cpu}")
    reqs, lens, ids = stream(args.accesses)
    n_acc = sum(a.size for a in reqs)
    print(f"{len(reqs):,} requests, {n_acc:,} block accesses, {ids:,} distinct blocks, "
          f"median of {args.reps} interleaved runs")
    plan_t: list[float] = []
    sched_t: list[float] = []
    for _ in range(args.reps):
        t = time.perf_counter()
        prof = profile_from_ids(reqs, lens, BLOCK, ids)
        curve = device_hit_blocks(prof)
        plan_t.append(time.perf_counter() - t)
        size = max(prof.min_device_blocks, len(curve) // 4)
        t = time.perf_counter()
        hits = scheduler_pass(reqs, lens, size)
        sched_t.append(time.perf_counter() - t)
        assert hits == curve[size], (hits, curve[size])  # the same answer at that size
    p, s = statistics.median(plan_t), statistics.median(sched_t)
    print(f"plan, every size ({len(curve) - 1:,} sizes): {p:6.2f} s  "
          f"{n_acc / p:>12,.0f} accesses/s")
    print(f"scheduler, one size:          {s:6.2f} s  {n_acc / s:>12,.0f} accesses/s")
    print(f"plan / one scheduler replay: {p / s:.2f}x the time")
    if args.trace:
        requests = list(read_trace(args.trace, args.limit))
        t = time.perf_counter()
        prof = stack_profile(requests, 64)
        dt = time.perf_counter() - t
        print(f"trace {args.trace}: {len(requests):,} requests, {prof.accesses:,} block accesses "
              f"(64-token blocks, keys included): {dt:.2f} s, {prof.accesses / dt:,.0f} "
              "accesses/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
