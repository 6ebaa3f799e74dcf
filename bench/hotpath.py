"""Hot-path benchmark: the scheduler API on a multi-turn chat workload, against peers.

Workload (the same generator semantics, seed, order and capacity as the peer harness in
`../shared/peers/workload.py`, so the figures compare like with like): 200 conversations x
6 turns, one shared 1,024-token system prompt, each turn appends 256 user and 256 output
tokens; token ids from random.Random(20240611) below 32,000; 64 conversations open at a time,
the next turn taken from a random open one (seed + 1). Each request is handed over whole:
match the cached prefix, allocate the rest, commit every full block, release. Capacity: 30% of
the distinct blocks. Timing skips the first 10% of requests; 3 repetitions on fresh managers.

kvtier runs with the device tier only and the in-process dispatcher, as the peers run
without transfers. `--peers` also runs the peer harness (vLLM's KVCacheManager, SGLang's
RadixCache) as subprocesses when its venv exists, interleaving repetitions with ours, and
prints kvtier/peer ratios from that one run.

    python bench/hotpath.py [--json] [--peers] [--reps N] [--block-sizes 16,64]
    python bench/hotpath.py --scale [--scale-blocks 100000,10000000] [--block-sizes 16] [--reps N]

`--scale` asks what a big tree costs instead: a manager of N device blocks is filled with N
distinct cached blocks (prompts of 256 blocks, each starting with its own token), its memory
read from the process's resident set (growth per cached block, and with the manager's
preallocated free list) and one full garbage collection timed, then the chat workload runs on
top of it (evicting filler) and its us/block is timed as above. 10M blocks of 16 tokens take
about 1.4 GiB compiled (the pure-Python nodes and dict: about 4 GiB).

The hot loops run compiled (`kvtier.manager._native`) when the extension is built;
KVTIER_NATIVE=0 runs the pure-Python ones (the first output line says which).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvtier.manager.core import native
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.workloads import WARMUP_FRAC, capacity_blocks, make_chat_workload

# `../shared/peers` beside the checkout; from a worktree under `../wt/<name>`, one level up.
PEERS_DIR = next((p / "shared" / "peers" for p in Path(__file__).resolve().parents[2:4]
                  if (p / "shared" / "peers").is_dir()),
                 Path(__file__).resolve().parents[2] / "shared" / "peers")


class Runner:
    """One fresh manager driven one whole request at a time."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.bs = block_size
        self.m = KVCacheManager(block_size=block_size, device_blocks=capacity, host_blocks=0,
                                write_policy="write_through_selective")
        self.n = 0

    def step(self, toks: list[int]) -> tuple[int, int]:
        m = self.m
        rid = self.n
        self.n += 1
        r = m.match(rid, toks)  # type: ignore[arg-type]
        hit = r.device_tokens
        m.allocate(rid, len(toks) - hit, 0)  # type: ignore[arg-type]
        m.commit(rid, toks, len(toks))  # type: ignore[arg-type]
        m.release(rid)  # type: ignore[arg-type]
        return hit // self.bs, len(toks) // self.bs

    def cached_blocks(self) -> int:
        return self.m.stats()["device"]["cached"]


def run_ours(block_size: int, reqs: list[list[int]]) -> dict[str, float]:
    cap = capacity_blocks(block_size)
    n_warm = int(len(reqs) * WARMUP_FRAC)
    runner = Runner(block_size, cap)
    gc.collect()
    gc.disable()
    times: list[tuple[int, int]] = []
    hits = blocks = 0
    try:
        for i, toks in enumerate(reqs):
            t0 = time.perf_counter_ns()
            h, b = runner.step(toks)
            dt = time.perf_counter_ns() - t0
            hits += h
            blocks += b
            if i >= n_warm:
                times.append((dt, b))
    finally:
        gc.enable()
    per_req = [dt / 1e3 for dt, _ in times]
    tot_ns = sum(dt for dt, _ in times)
    tot_blk = sum(b for _, b in times)
    return {"median_us": statistics.median(per_req),
            "p99_us": sorted(per_req)[int(0.99 * (len(per_req) - 1))],
            "us_per_block": tot_ns / 1e3 / tot_blk, "hit_rate": hits / blocks}


def memory_per_block(block_size: int, reqs: list[list[int]]) -> dict[str, float]:
    """Python heap (tracemalloc) per cached block at ~95% fill: growth only, and everything
    the manager holds (its preallocated free lists included)."""
    cap = capacity_blocks(block_size)
    gc.collect()
    tracemalloc.start()
    m0 = tracemalloc.get_traced_memory()[0]
    runner = Runner(block_size, cap)
    gc.collect()
    m1 = tracemalloc.get_traced_memory()[0]
    for toks in reqs:
        runner.step(toks)
        if runner.cached_blocks() >= 0.95 * cap:
            break
    gc.collect()
    m2 = tracemalloc.get_traced_memory()[0]
    nb = runner.cached_blocks()
    tracemalloc.stop()
    return {"growth_bytes_per_cached_block": (m2 - m1) / nb,
            "total_bytes_per_cached_block": (m2 - m0) / nb}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_scale(block_size: int, n_blocks: int, reqs: list[list[int]]) -> dict[str, float]:
    """Fill a manager of `n_blocks` device blocks with as many cached blocks, then time the
    chat workload on it (see the module doc)."""
    gc.collect()
    rss0 = _rss_bytes()
    runner = Runner(block_size, n_blocks)
    gc.collect()
    rss1 = _rss_bytes()
    per_prompt = 256
    tail = list(range(1, per_prompt * block_size))  # shared tail; the first token differs
    t0 = time.perf_counter()
    gc.disable()
    try:
        i = 0
        while runner.cached_blocks() + per_prompt <= n_blocks:
            runner.step([-1 - i, *tail])
            i += 1
        left = n_blocks - runner.cached_blocks()
        if left:
            runner.step([-1 - i, *tail[: left * block_size - 1]])
    finally:
        gc.enable()
    fill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    gc.collect()  # a full collection with the filled tree alive: what a gen-2 pass costs
    gc_ms = (time.perf_counter() - t1) * 1e3
    rss2 = _rss_bytes()
    cached = runner.cached_blocks()
    timed = Runner.__new__(Runner)  # the filled manager, timed on the chat workload
    timed.bs, timed.m, timed.n = block_size, runner.m, runner.n
    n_warm = int(len(reqs) * WARMUP_FRAC)
    tot_ns = tot_cpu_ns = tot_blk = 0
    gc.disable()
    try:
        for j, toks in enumerate(reqs):
            c = time.thread_time_ns()
            t = time.perf_counter_ns()
            _, b = timed.step(toks)
            dt = time.perf_counter_ns() - t
            dc = time.thread_time_ns() - c
            if j >= n_warm:
                tot_ns += dt
                tot_cpu_ns += dc
                tot_blk += b
    finally:
        gc.enable()
    return {"cached_blocks": cached, "fill_s": fill_s,
            "fill_us_per_block": fill_s * 1e6 / cached,
            "rss_growth_bytes_per_cached_block": (rss2 - rss1) / cached,
            "rss_total_bytes_per_cached_block": (rss2 - rss0) / cached,
            "full_gc_ms": gc_ms,
            # CPU time of this thread: what other tenants of a shared machine disturb least
            "cpu_us_per_block": tot_cpu_ns / 1e3 / tot_blk,
            "us_per_block": tot_ns / 1e3 / tot_blk}


def peers_venv() -> Path | None:
    env = os.environ.get("PEERS_VENV")
    candidates = [Path(env)] if env else []
    candidates += [PEERS_DIR / "venv",
                   Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                   / "kvtier-peers-venv"]
    for c in candidates:
        if (c / "bin" / "python").exists():
            return c
    return None


PEER_RUNS = [
    ("vllm-sha256", ["bench_vllm.py"], {}),
    ("vllm-xxhash", ["bench_vllm.py"], {"PB_VLLM_HASH": "xxhash"}),
    ("sglang", ["bench_sglang.py"], {}),
]


def run_peer(venv: Path, name: str, script: list[str], env_extra: dict[str, str],
             block_sizes: list[int]) -> dict[int, dict[str, float]]:
    """One harness invocation (its own 3 repetitions) for all block sizes."""
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        out = f.name
    try:
        args = [str(b) for b in block_sizes]
        if name == "sglang":  # page size 1 at 16-token accounting, page = block otherwise
            args = [("1:16" if b == 16 else f"{b}:{b}") for b in block_sizes]
        env = dict(os.environ, PB_OUT=out, **env_extra)
        proc = subprocess.run([str(venv / "bin" / "python"), *script, *args], cwd=PEERS_DIR,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=1800, check=False)
        if proc.returncode:
            raise RuntimeError(f"peer {name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        res: dict[int, dict[str, float]] = {}
        for line in Path(out).read_text().splitlines():
            d = json.loads(line)
            res[int(d["block_size"])] = {
                "us_per_block": d["us_per_block"], "median_us": d["median_us"],
                "p99_us": d["p99_us"], "hit_rate": d["hit_rate_harness"],
                "bytes_per_block": d.get("mem_growth_bytes_per_cached_block_tracemalloc", 0.0),
            }
        return res
    finally:
        os.unlink(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--peers", action="store_true", help="also run the peer harness")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--scale", action="store_true",
                    help="time and measure big trees instead (see --scale-blocks)")
    ap.add_argument("--scale-blocks", default="100000,10000000",
                    help="cached blocks per --scale run, comma-separated")
    args = ap.parse_args()
    sizes = [int(x) for x in args.block_sizes.split(",")]
    reqs = make_chat_workload()
    loops = "compiled" if native.active() else f"pure Python ({native.UNAVAILABLE})"
    if args.scale:
        # Repetitions interleave the sizes (100K, 10M, 100K, 10M, ...), each on a freshly
        # filled manager; a row is the median us/block of its repetitions (memory and fill
        # figures from the first).
        counts = [int(x) for x in args.scale_blocks.split(",")]
        runs: dict[tuple[int, int], list[dict[str, float]]] = {}
        for _ in range(max(1, args.reps)):
            for b in sizes:
                for n in counts:
                    runs.setdefault((b, n), []).append(run_scale(b, n, reqs))
        rows = []
        for (b, n), rs in runs.items():
            row = dict(rs[0])
            for k in ("us_per_block", "cpu_us_per_block"):
                row[k] = statistics.median(r[k] for r in rs)
            rows.append((b, n, row))
        if args.json:
            print(json.dumps({"loops": loops, "scale": [
                {"block_size": b, "blocks": n, **r} for b, n, r in rows]}))
            return 0
        print(f"hot loops: {loops}")
        print(f"{'block':>6}{'cached':>11}{'fill s':>8}{'fill us/blk':>12}{'us/block':>10}"
              f"{'cpu us/blk':>11}"
              f"{'RSS B/blk':>11}{'w/ pool':>9}{'gc ms':>8}")
        for b, _, r in rows:
            print(f"{b:>6}{int(r['cached_blocks']):>11}{r['fill_s']:>8.1f}"
                  f"{r['fill_us_per_block']:>12.3f}{r['us_per_block']:>10.3f}"
                  f"{r['cpu_us_per_block']:>11.3f}"
                  f"{r['rss_growth_bytes_per_cached_block']:>11.0f}"
                  f"{r['rss_total_bytes_per_cached_block']:>9.0f}{r['full_gc_ms']:>8.0f}")
        for b in sizes:
            lo, hi = min(counts), max(counts)
            if lo != hi:
                for k, what in (("us_per_block", "wall"), ("cpu_us_per_block", "cpu")):
                    each = [" ".join(f"{r[k]:.3f}" for r in runs[(b, n)]) for n in (lo, hi)]
                    ratio = (statistics.median(r[k] for r in runs[(b, hi)])
                             / statistics.median(r[k] for r in runs[(b, lo)]))
                    print(f"{b}-token blocks, {what}: us/block at {hi:,} / at {lo:,} = "
                          f"{ratio:.2f}x (medians of interleaved runs: {each[0]} vs {each[1]})")
        print("us/block: the chat workload on the filled manager (cpu: the thread's CPU time); "
              "RSS B/blk: resident growth "
              "per cached block while filling (w/ pool: including the manager's free list); "
              "gc ms: one full gc.collect() on the filled manager")
        return 0
    venv = peers_venv() if args.peers else None
    if args.peers and venv is None:
        print("peer venv not found: run `bash ../shared/peers/setup.sh` first", file=sys.stderr)
        return 2
    ours: dict[int, list[dict[str, float]]] = {b: [] for b in sizes}
    peers: dict[str, dict[int, list[dict[str, float]]]] = {}
    for rep in range(args.reps):
        for b in sizes:
            ours[b].append(run_ours(b, reqs))
        if venv is not None:
            # One peer harness call per round (each makes its own 3 repetitions), so the
            # peers and we alternate over the whole run.
            name, script, env_extra = PEER_RUNS[rep % len(PEER_RUNS)]
            for b, r in run_peer(venv, name, script, env_extra, sizes).items():
                peers.setdefault(name, {}).setdefault(b, []).append(r)
    if venv is not None:  # every peer at least once even with fewer reps than peers
        for name, script, env_extra in PEER_RUNS[args.reps:]:
            for b in sizes:
                ours[b].append(run_ours(b, reqs))
            for b, r in run_peer(venv, name, script, env_extra, sizes).items():
                peers.setdefault(name, {}).setdefault(b, []).append(r)
    mem = {b: memory_per_block(b, reqs) for b in sizes}
    result: dict[str, dict[str, float]] = {k: {} for k in (
        "us_per_block", "us_per_1k_tokens", "hit_rate", "bytes_per_block", "median_us",
        "p99_us")}
    for b in sizes:
        rs = ours[b]
        upb = statistics.median(r["us_per_block"] for r in rs)
        result["us_per_block"][str(b)] = upb
        result["us_per_1k_tokens"][str(b)] = upb * 1000 / b
        result["hit_rate"][str(b)] = rs[0]["hit_rate"]
        result["bytes_per_block"][str(b)] = mem[b]["total_bytes_per_cached_block"]
        result["median_us"][str(b)] = statistics.median(r["median_us"] for r in rs)
        result["p99_us"][str(b)] = statistics.median(r["p99_us"] for r in rs)
    out: dict[str, object] = dict(result)
    out["bytes_per_block_growth"] = {str(b): mem[b]["growth_bytes_per_cached_block"]
                                     for b in sizes}
    if peers:
        peer_out: dict[str, dict[str, dict[str, float]]] = {}
        for name, by_size in peers.items():
            peer_out[name] = {}
            for b, rs in by_size.items():
                upb = statistics.median(r["us_per_block"] for r in rs)
                peer_out[name][str(b)] = {
                    "us_per_block": upb, "hit_rate": rs[0]["hit_rate"],
                    "median_us": statistics.median(r["median_us"] for r in rs),
                    "bytes_per_block": rs[0]["bytes_per_block"],
                    "speedup_kvtier_vs_peer": upb / result["us_per_block"][str(b)],
                }
        out["peers"] = peer_out
    if args.json:
        print(json.dumps({"loops": loops, **out}))
        return 0
    print(f"hot loops: {loops}")
    print(f"{'impl':<14}{'block':>6}{'us/block':>10}{'us/1k tok':>11}{'median us':>11}"
          f"{'p99 us':>9}{'hit rate':>10}{'B/block':>9}{'speedup':>9}")
    for b in sizes:
        k = str(b)
        print(f"{'kvtier':<14}{b:>6}{result['us_per_block'][k]:>10.3f}"
              f"{result['us_per_1k_tokens'][k]:>11.1f}{result['median_us'][k]:>11.1f}"
              f"{result['p99_us'][k]:>9.1f}{result['hit_rate'][k]:>10.4f}"
              f"{result['bytes_per_block'][k]:>9.0f}{'':>9}")
        for name, by in out.get("peers", {}).items():  # type: ignore[union-attr]
            if k in by:
                p = by[k]
                print(f"{name:<14}{b:>6}{p['us_per_block']:>10.3f}"
                      f"{p['us_per_block'] * 1000 / b:>11.1f}{p['median_us']:>11.1f}"
                      f"{'':>9}{p['hit_rate']:>10.4f}{p['bytes_per_block']:>9.0f}"
                      f"{p['speedup_kvtier_vs_peer']:>8.2f}x")
    print("speedup = peer us/block / kvtier us/block, from this one run "
          "(B/block: kvtier counts its whole heap incl. free lists; peers their growth)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
