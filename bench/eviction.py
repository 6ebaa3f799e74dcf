"""Device eviction policies against LRU and the clairvoyant offline reference, per cache size.

On the shared Mooncake conversation trace (first `--limit` requests, default 3,000) and the
built-in chat workload, at 64-token blocks, device tier only, each request driven through the
scheduler in process exactly as `kvtier replay` drives it (match, allocate, commit, release;
`kvtier.manager.plan.policy_hit_blocks`), at 2 / 5 / 10 / 20% of the stream's distinct blocks.
Prints the token hit rate of each policy, the offline (Belady) reference
(`kvtier.manager.plan.offline_hit_blocks`, what no policy can exceed at that size), and for
each policy the share of the LRU -> offline gap it closes.

    .venv/bin/python bench/eviction.py [--trace FILE] [--limit N] [--policies a,b,...]
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

from kvtier.manager.plan import (
    device_hit_blocks,
    offline_hit_blocks,
    policy_hit_blocks,
    stack_profile,
)
from kvtier.manager.policies import EVICTION_POLICIES
from kvtier.manager.workloads import WorkRequest, chat_requests, read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_conversation_trace.jsonl"
SHARES = (0.02, 0.05, 0.10, 0.20)


def report(name: str, reqs: list[WorkRequest], bs: int, policies: list[str]) -> None:
    prof = stack_profile(reqs, bs)
    sizes = [max(prof.min_device_blocks, round(s * prof.distinct_blocks)) for s in SHARES]
    lookup = prof.lookup_tokens

    def rate(h: int) -> float:
        return h * bs / lookup

    t0 = time.perf_counter()
    off = offline_hit_blocks(prof, sizes)
    t_off = time.perf_counter() - t0
    lru_curve = device_hit_blocks(prof, max(sizes))
    print(f"{name}: {prof.requests:,} requests, {prof.accesses:,} block accesses, "
          f"{prof.distinct_blocks:,} distinct blocks of {bs} tokens")
    print(f"{'size':>14} | " + " | ".join(f"{p:>9}" for p in [*policies, "offline"]) +
          " | gap closed (best policy)")
    per_policy: dict[str, list[int]] = {}
    times: dict[str, float] = {}
    for p in policies:
        t0 = time.perf_counter()
        per_policy[p] = policy_hit_blocks(reqs, bs, sizes, p)
        times[p] = time.perf_counter() - t0
        if p == "lru":  # the scheduler's LRU and the planner's exact curve agree
            assert per_policy[p] == [int(lru_curve[s]) for s in sizes], p
    for k, (share, size) in enumerate(zip(SHARES, sizes, strict=True)):
        lru = rate(int(lru_curve[size]))
        o = rate(int(off[k]))
        rates = {p: rate(per_policy[p][k]) for p in policies}
        best = max(rates, key=lambda p: rates[p])
        gap = (rates[best] - lru) / (o - lru) if o > lru else 0.0
        print(f"{share:>4.0%} {size:>9,} | " + " | ".join(f"{rates[p]:>9.2%}" for p in policies)
              + f" | {o:>9.2%} | {gap:>6.1%} ({best})")
    print("seconds per policy (4 sizes): " + ", ".join(f"{p} {t:.1f}" for p, t in times.items())
          + f", offline {t_off:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=3000)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    args = ap.parse_args()
    policies = args.policies.split(",")
    trace = list(itertools.islice(read_trace(args.trace, args.limit), args.limit))
    report(f"conversation trace ({Path(args.trace).name})", trace, args.block_size, policies)
    print()
    report("chat workload", chat_requests(), args.block_size, policies)


if __name__ == "__main__":
    main()
