"""What `storage.write_policy` costs and saves: pages written to storage, and what storage
still serves, per policy, on two workloads of our own making, interleaved.

What is measured: the scheduler API (`KVCacheManager` + `StorageTier`, real config, real keys)
on an in-process dispatcher whose storage is a set of page names (QUERY and PREFETCH answer
from it truthfully, BACKUP adds to it, LIST lists it), so the figures are the manager's
decisions, not a backend's speed: pages (and bytes, at the KV shape below) each policy writes,
the prompt tokens storage served, the tokens the engine had to compute, host copies evicted
unwritten, and the manager's own CPU time per request. Device 64 and host 256 blocks of 16
tokens: both far smaller than either working set, so the host tier evicts and what storage
holds decides what comes back.

Workloads (seeded):
  * low_reuse   400 prompts of 24 blocks; 10% of them continue an earlier prompt (its whole
                24-block prefix plus 8 new blocks), the rest share nothing.
  * high_reuse  400 prompts: 64% start with one of 20 16-block documents (Zipf-ish choice)
                plus 8 blocks of their own; the rest are 24 fresh blocks.

Each round runs every (workload, policy) pair once, policies in a shuffled order; the table
shows medians over rounds and each policy's ratio to write_through (pages written, tokens
storage served, CPU per request).

    .venv/bin/python bench/storage_write_policy.py [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.manager.config import load_config
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.storage_tier import StorageTier
from kvtier.manager.transfers import ImmediateDispatcher
from kvtier.worker.wire import Completion, Task, TaskKind, key_tag

BS = 16
DEVICE, HOST = 64, 256
PAGE_BYTES = 2 * 8 * 4 * 128 * BS * 2  # K and V, 8 layers x 4 heads x 128 dims, fp16: 256 KiB
POLICIES = ("write_through", "write_through_selective", "write_back")


def low_reuse(rng: random.Random) -> list[list[int]]:
    prompts: list[list[int]] = []
    fresh = iter(range(10**9))
    for _ in range(400):
        if prompts and rng.random() < 0.10:
            base = rng.choice(prompts)[: 24 * BS]
            prompts.append(base + [next(fresh) for _ in range(8 * BS)])
        else:
            prompts.append([next(fresh) for _ in range(24 * BS)])
    return prompts


def high_reuse(rng: random.Random) -> list[list[int]]:
    fresh = iter(range(10**9))
    docs = [[next(fresh) for _ in range(16 * BS)] for _ in range(20)]
    weights = [1 / (i + 1) for i in range(len(docs))]
    prompts: list[list[int]] = []
    for _ in range(400):
        if rng.random() < 0.64:
            doc = rng.choices(docs, weights)[0]
            prompts.append(doc + [next(fresh) for _ in range(8 * BS)])
        else:
            prompts.append([next(fresh) for _ in range(24 * BS)])
    return prompts


WORKLOADS: dict[str, Callable[[random.Random], list[list[int]]]] = {
    "low_reuse": low_reuse, "high_reuse": high_reuse}


def storage_executor(held: set[bytes]) -> Callable[[Task], Completion]:
    """Answers tasks as a store holding `held` would (page names only)."""

    def run(task: Task) -> Completion:
        if task.kind in (TaskKind.QUERY, TaskKind.PREFETCH):
            n = 0
            for k in task.keys:
                if k not in held:
                    break
                n += 1
            return Completion(task.seq, -1, True, n)
        if task.kind == TaskKind.BACKUP:
            held.update(task.keys)
            return Completion(task.seq, -1, True, len(task.keys))
        if task.kind == TaskKind.LIST:
            return Completion(task.seq, -1, True, 1, [key_tag(k) for k in held])
        return Completion(task.seq, -1, True)

    return run


def run_one(prompts: list[list[int]], policy: str, storage_dir: str) -> dict[str, float]:
    cfg = load_config(None, {
        "KVTIER_CACHE__BLOCK_SIZE": str(BS), "KVTIER_CACHE__DEVICE_BLOCKS": str(DEVICE),
        "KVTIER_CACHE__HOST_BLOCKS": str(HOST), "KVTIER_CACHE__WRITE_POLICY": "write_through",
        "KVTIER_STORAGE__BACKEND": "file", "KVTIER_STORAGE__PATH": storage_dir,
        "KVTIER_STORAGE__SECRET": "bench-secret-0123456789",
        "KVTIER_STORAGE__PREFETCH_POLICY": "wait_complete",
        "KVTIER_STORAGE__PREFETCH_THRESHOLD": str(BS),
        "KVTIER_STORAGE__WRITE_POLICY": policy, "KVTIER_STORAGE__WRITE_THRESHOLD": "1"})
    held: set[bytes] = set()
    m = KVCacheManager(block_size=BS, device_blocks=DEVICE, host_blocks=HOST,
                       write_policy="write_through",
                       dispatcher=ImmediateDispatcher(storage_executor(held)),
                       page_bytes=PAGE_BYTES, transfer_timeout_s=5.0)
    tier = StorageTier(m, cfg)
    m.storage = tier
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        res = m.match(rid, p)
        m.allocate(rid, len(p) - res.num_tokens, reserve_blocks=0)
        res.handle.wait()
        m.commit(rid, p, len(p))
        m.release(rid)
    cpu = time.process_time() - t0
    c = m.counters
    hits = c.hit_device_tokens + c.hit_host_tokens + c.hit_storage_tokens
    return {"pages_written": tier.counters["backup_pages"],
            "gb_written": tier.counters["backup_pages"] * PAGE_BYTES / 1e9,
            "storage_tokens": c.hit_storage_tokens,
            "computed_tokens": c.lookup_tokens - hits,
            "evicted_unstored": c.evicted_host_unstored,
            "cpu_ms_per_request": cpu * 1000 / len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(25)
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        w: {p: [] for p in POLICIES} for w in WORKLOADS}
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as d:
        for _ in range(args.rounds):
            for wname, make in WORKLOADS.items():
                prompts = make(random.Random(rng.random()))
                order = list(POLICIES)
                rng.shuffle(order)
                for policy in order:
                    results[wname][policy].append(run_one(prompts, policy, str(Path(d))))
    table: dict[str, dict[str, dict[str, float]]] = {}
    for wname, per in results.items():
        table[wname] = {}
        for policy, runs in per.items():
            table[wname][policy] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    if args.json:
        print(json.dumps({"load_average": os.getloadavg(), "table": table}, indent=1))
        return
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds, medians; "
          "ratios to write_through")
    for wname, per in table.items():
        base = per["write_through"]
        print(f"\n{wname}")
        print(f"{'policy':<24} {'pages written':>14} {'ratio':>6} {'GB':>6} "
              f"{'storage tok':>11} {'ratio':>6} {'computed tok':>12} {'unstored':>8} "
              f"{'cpu ms/req':>10} {'ratio':>6}")
        for policy, r in per.items():
            def ratio(k: str, r: dict[str, float] = r,
                      base: dict[str, float] = base) -> str:
                return f"{r[k] / base[k]:.2f}" if base[k] else "-"
            print(f"{policy:<24} {r['pages_written']:>14.0f} {ratio('pages_written'):>6} "
                  f"{r['gb_written']:>6.2f} {r['storage_tokens']:>11.0f} "
                  f"{ratio('storage_tokens'):>6} {r['computed_tokens']:>12.0f} "
                  f"{r['evicted_unstored']:>8.0f} {r['cpu_ms_per_request']:>10.3f} "
                  f"{ratio('cpu_ms_per_request'):>6}")


if __name__ == "__main__":
    main()
