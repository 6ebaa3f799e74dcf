"""The key-addressed surface's lookups (`kvtier.manager.keyed`, what vLLM's offloading manager
calls): us per block of `count_hits` (the batch form: one lock, the compiled walk over the
compiled tree map) and of `lookup` (one call per block, as vLLM's connector asks), with the
compiled extension and with the pure-Python path, interleaved in one run, with ratios.

    .venv/bin/python bench/keyed_lookup.py [--blocks 100000] [--reps 5]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

from kvtier.manager.core import native
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.transfers import ImmediateDispatcher


def build(blocks: int, compiled: bool) -> tuple[KeyedHostCache, list[bytes]]:
    native.use(compiled)
    m = KVCacheManager(block_size=16, device_blocks=4, host_blocks=blocks,
                       write_policy="write_back",
                       dispatcher=ImmediateDispatcher(executor=lambda t: None),
                       page_bytes=1, num_layers=1)
    cache = KeyedHostCache(m, None, namespace=b"bench")
    hashes: list[bytes] = []
    parent = b""
    for i in range(blocks):  # one request's chained hashes, like vLLM's sha256 block hashes
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        hashes.append(parent)
    for i in range(0, blocks, 1024):
        plan = cache.prepare_store(hashes[i:i + 1024])
        assert plan is not None
        cache.complete_store(plan.keys)
    return cache, hashes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"the compiled extension is not built: {native.UNAVAILABLE}")
    caches = {"compiled": build(args.blocks, True), "python": build(args.blocks, False)}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        for name, (cache, hashes) in caches.items():  # interleaved
            t = time.perf_counter()
            n = cache.count_hits(hashes)
            times.setdefault((name, "count_hits"), []).append(time.perf_counter() - t)
            assert n == len(hashes), n
            t = time.perf_counter()
            for h in hashes:
                cache.lookup(h)
            times.setdefault((name, "lookup"), []).append(time.perf_counter() - t)
    print(f"{args.blocks} cached blocks, median of {args.reps} interleaved runs")
    print(f"{'path':<10}{'call':<12}{'us/block':>10}{'python/compiled':>17}")
    for call in ("count_hits", "lookup"):
        base = statistics.median(times["python", call])
        for name in ("compiled", "python"):
            t = statistics.median(times[name, call])
            print(f"{name:<10}{call:<12}{t / args.blocks * 1e6:>10.3f}{base / t:>16.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
