"""Latency of a host->device load on an idle worker and on one busy with 512-block
device->host backups, alternated load by load in one run.

What is measured: one real worker process (a `Stack`, its manager in this process) with its
own device pool; an H2D load of `--load-blocks` random host pages into random device blocks
is submitted through the manager's dispatcher and timed until its completion has been applied
(what `LoadHandle.wait` sees: IPC both ways included). Two cases, alternated sample by sample
so drift on a shared machine hits both alike:

  * idle         no backup is in flight on the worker;
  * under_backup a thread keeps D2H tasks of `--backup-blocks` random blocks (512 by default,
                 Priority.BACKUP: what write-through backups and write-back demotions are)
                 back to back on the same worker, and the load is submitted once the current
                 backup has run for `--into-backup-ms`.

Backups use the first 512 ids of both pools; loads read pages from the rest (256 MiB, more
than the caches hold), so an idle load is as cold as one under a backup.

The figure is the median of the paired ratios (each load under backup over the idle load just
before it: robust to the drift of a shared machine), with the ratio of the medians beside it;
the target is <= 1.2. For scale,
the run also prints how long one backup task takes: with one task loop per rank (kvtier before
the lanes) a load submitted behind a running backup waited for the rest of it.

The KV shape is 8 layers x 4 KV heads x 128 head_dim, float16, 16-token blocks: a 256 KiB
page, so a 512-block backup moves 128 MiB and the pools hold 2 x `--pool-blocks` pages
(768 MiB by default). The worker runs on the CPU unless `--device cuda` (then the load and the
backup use two CUDA streams, the load's at the higher priority).

    .venv/bin/python bench/load_under_backup.py [--samples 60] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.manager.config import KvtierConfig, load_config
from kvtier.manager.stack import Stack
from kvtier.manager.transfers import Dispatcher
from kvtier.worker.wire import Priority, Task, TaskKind

TARGET_RATIO = 1.2
PAGE_KIB = 256  # 8 layers x K and V x 4 heads x 128 x 16 tokens x 2 bytes


def make_config(args: argparse.Namespace, dep: str) -> KvtierConfig:
    env = {
        "KVTIER_DEPLOYMENT_ID": dep,
        "KVTIER_MODEL__NUM_LAYERS": "8",
        "KVTIER_MODEL__NUM_KV_HEADS": "4",
        "KVTIER_MODEL__HEAD_DIM": "128",
        "KVTIER_MODEL__DTYPE": "float16",
        "KVTIER_CACHE__BLOCK_SIZE": "16",
        "KVTIER_CACHE__DEVICE_BLOCKS": str(args.pool_blocks),
        "KVTIER_CACHE__HOST_BLOCKS": str(args.pool_blocks),
        "KVTIER_STORAGE__BACKEND": "none",
        "KVTIER_WORKERS__COUNT": "1",
        "KVTIER_WORKERS__DEVICE": args.device,
    }
    return load_config(None, env)


class BackupStream:
    """D2H tasks of `blocks` random blocks, back to back on a thread while `go` is set.
    Backups use device/host ids below `limit`, loads the ids above it."""

    def __init__(self, d: Dispatcher, next_seq: Callable[[], int], blocks: int, limit: int,
                 rng: random.Random) -> None:
        self.d, self.next_seq, self.blocks, self.limit = d, next_seq, blocks, limit
        self.rng = rng
        self.go = threading.Event()
        self.quit = threading.Event()
        self.durations: list[float] = []
        self.started_at = 0.0  # of the backup in flight; 0.0 when none is
        self.thread = threading.Thread(target=self._run, name="backup-stream", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.quit.is_set():
            if not self.go.wait(0.1):
                continue
            src = self.rng.sample(range(self.limit), self.blocks)
            dst = self.rng.sample(range(self.limit), self.blocks)
            task = Task(self.next_seq(), TaskKind.D2H, src, dst, [], Priority.BACKUP)
            t0 = time.perf_counter()
            self.started_at = t0
            self.d.submit(task)
            self.d.wait([task.seq], 60)
            self.started_at = 0.0
            self.durations.append(time.perf_counter() - t0)

    def idle(self) -> None:
        """Return once no backup is in flight (and none will start)."""
        self.go.clear()
        while self.started_at:
            time.sleep(0.0005)

    def busy(self, into_s: float) -> None:
        """Return once a backup has been running for at least `into_s` seconds."""
        self.go.set()
        while not self.started_at or time.perf_counter() - self.started_at < into_s:
            time.sleep(0.0005)

    def close(self) -> None:
        self.go.clear()
        self.quit.set()
        self.thread.join(60)


def time_load(d: Dispatcher, next_seq: Callable[[], int], blocks: int, lo: int, hi: int,
              rng: random.Random) -> float:
    """One load of `blocks` random host pages into random device blocks (ids in [lo, hi));
    seconds from submit until its completion was applied."""
    src = rng.sample(range(lo, hi), blocks)
    dst = rng.sample(range(lo, hi), blocks)
    task = Task(next_seq(), TaskKind.H2D, src, dst, [], Priority.LOAD)
    t0 = time.perf_counter()
    d.submit(task)
    d.wait([task.seq], 30)
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict[str, Any]:
    dep = f"bench-lub-{os.getpid()}"
    cfg = make_config(args, dep)
    rng = random.Random(args.seed)
    idle: list[float] = []
    busy: list[float] = []
    dirty: list[float] = []
    overlapped = 0
    with tempfile.TemporaryDirectory() as logs, Stack(cfg, log_dir=logs) as stack:
        m = stack.require_manager()
        d = m.dispatcher
        lock = threading.Lock()

        def next_seq() -> int:
            with lock, m.lock:
                return m.next_seq()

        # Backups use the first `backup_blocks` ids; loads read from the rest of the pools,
        # a region larger than the caches, so an idle load is as cold as a busy one.
        limit = args.backup_blocks
        if args.pool_blocks - limit < 4 * args.load_blocks:
            raise SystemExit("--pool-blocks too small for the backups and the loads")
        stream = BackupStream(d, next_seq, args.backup_blocks, limit, rng)
        try:
            # Warm-up: every page of both pools touched once (no page fault is timed), then
            # both lanes and copy paths.
            for lo in range(0, args.pool_blocks, 256):
                ids = list(range(lo, min(lo + 256, args.pool_blocks)))
                for kind in (TaskKind.D2H, TaskKind.H2D):
                    task = Task(next_seq(), kind, ids, ids, [], Priority.LOAD)
                    d.submit(task)
                    d.wait([task.seq], 60)
            for _ in range(3):
                time_load(d, next_seq, args.load_blocks, limit, args.pool_blocks, rng)
                stream.busy(0.0)
                stream.idle()
            stream.durations.clear()
            scratch = bytearray(args.dirty_mib << 20)
            for _ in range(args.samples):  # one idle load, one under a backup, alternated
                stream.idle()
                idle.append(time_load(d, next_seq, args.load_blocks, limit,
                                      args.pool_blocks, rng))
                if args.dirty_mib:
                    # Control: an idle worker, but the shared cache just filled with dirty
                    # lines (what a backup leaves behind), written from this process.
                    scratch[:] = bytes(len(scratch)) if len(dirty) % 2 else b"\1" * len(scratch)
                    dirty.append(time_load(d, next_seq, args.load_blocks, limit,
                                           args.pool_blocks, rng))
                stream.busy(args.into_backup_ms / 1000)
                busy.append(time_load(d, next_seq, args.load_blocks, limit,
                                      args.pool_blocks, rng))
                overlapped += bool(stream.started_at)  # still running when the load ended
        finally:
            stream.close()
        device = stack.worker_spec(0).device
        backups = list(stream.durations)

    def fig(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"median_ms": statistics.median(xs) * 1e3,
                "p90_ms": xs[int(0.9 * (len(xs) - 1))] * 1e3,
                "mean_ms": statistics.fmean(xs) * 1e3}

    return {
        "device": device,
        "load_blocks": args.load_blocks,
        "backup_blocks": args.backup_blocks,
        "page_kib": PAGE_KIB,
        "samples": len(idle),
        "idle": fig(idle),
        "under_backup": fig(busy),
        "idle_dirty_cache": fig(dirty) if dirty else {},
        "loads_ending_during_a_backup": overlapped,
        "backup_task": fig(backups) if backups else {},
        "ratio_median": statistics.median(busy) / statistics.median(idle),
        "ratio_paired_median": statistics.median(b / i for b, i in zip(busy, idle, strict=True)),
        "ratio_p90": fig(busy)["p90_ms"] / fig(idle)["p90_ms"],
        "target_ratio": TARGET_RATIO,
        "load_avg": os.getloadavg(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "worker_threads": os.environ.get("OMP_NUM_THREADS", ""),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=100,
                   help="loads timed per case (idle and under backup, alternated)")
    p.add_argument("--load-blocks", type=int, default=32, help="blocks of one load")
    p.add_argument("--backup-blocks", type=int, default=512, help="blocks of one backup")
    p.add_argument("--pool-blocks", type=int, default=1536, help="device and host blocks")
    p.add_argument("--into-backup-ms", type=float, default=3.0,
                   help="how long a backup has run when the load is submitted")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--worker-threads", type=int, default=0,
                   help="OMP_NUM_THREADS of the worker (0: torch's default, one per core)")
    p.add_argument("--dirty-mib", type=int, default=0,
                   help="control case: before an idle load, write this many MiB in the bench "
                        "process (dirty lines in the shared cache, as a backup leaves them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.worker_threads:  # the worker process inherits it
        os.environ["OMP_NUM_THREADS"] = str(args.worker_threads)
    r = run(args)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"device {r['device']}; load {r['load_blocks']} blocks "
          f"({r['load_blocks'] * PAGE_KIB} KiB), backup {r['backup_blocks']} blocks "
          f"({r['backup_blocks'] * PAGE_KIB // 1024} MiB) per task; {r['samples']} loads per "
          f"case, alternated; load average {r['load_avg'][0]:.2f}; worker OMP_NUM_THREADS="
          f"{r['worker_threads'] or '(unset)'}, OMP_WAIT_POLICY="
          f"{r['omp_wait_policy'] or '(unset)'}")
    print(f"{'case':<14}{'median ms':>11}{'p90 ms':>9}{'mean ms':>9}")
    for case in ("idle", "idle_dirty_cache", "under_backup"):
        f = r[case]
        if not f:
            continue
        print(f"{case:<14}{f['median_ms']:>11.2f}{f['p90_ms']:>9.2f}{f['mean_ms']:>9.2f}")
    print(f"loads under backup that ended with the backup still running: "
          f"{r['loads_ending_during_a_backup']} of {r['samples']}")
    if r["backup_task"]:
        print(f"one {r['backup_blocks']}-block backup task: median "
              f"{r['backup_task']['median_ms']:.1f} ms (what a load queued behind it waited "
              f"for with one task loop per rank)")
    verdict = "meets" if r["ratio_paired_median"] <= TARGET_RATIO else "misses"
    print(f"ratio under_backup / idle: of the medians {r['ratio_median']:.2f}, of the p90s "
          f"{r['ratio_p90']:.2f}, median of the {r['samples']} paired ratios "
          f"{r['ratio_paired_median']:.2f} ({verdict} the {TARGET_RATIO}x target)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
