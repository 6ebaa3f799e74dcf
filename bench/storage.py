"""Prefetch throughput of the storage backends against a plain read of the same bytes.

A prefetch moves N stored pages into host memory. What kvtier adds on top of the raw store is
the page header check, the MAC (keyed BLAKE3) over every byte and the LRU bookkeeping, so
this measures `backend.get_into(keys, host page views)` against the plainest way to fetch the
same bytes in the same run:

* file:  `backend.get_into` vs `open(path, "rb", buffering=0).readinto(buffer)` of each page
         file (header included), both into a preallocated destination;
* redis: `backend.get_into` vs `client.mget(names)` of the same keys in the same batches (the
         plain side does not even copy the values out);
* redis-cluster (a 3-node Redis Cluster on loopback): `backend.get_into` vs redis-py's own
         cluster batch read, `RedisCluster.mget_nonatomic(names)`, in the same batches.

The destination is a real host pool (`kvtier.worker.kv_pools.HostPool`, POSIX shared memory) of the
right page size, or an anonymous shared `mmap` when the page size is not a KV shape; both
pre-faulted before timing. The page cache is warm for both sides: one untimed
pass of each runs first, so both read from memory. Repetitions alternate which side goes first;
GB/s are medians and 1e9 bytes of page payload per second; the ratio is the median of the
per-repetition ratios ours/plain.

    .venv/bin/python bench/storage.py [--page-kib 256,512,1024] [--total-mib 256] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import redis
from redis.cluster import RedisCluster

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from kvtier.worker.storage.file_backend import FileBackend  # noqa: E402
from kvtier.worker.storage.page_crypto import TAG_BYTES, PageKeys  # noqa: E402
from kvtier.worker.storage.page_format import HEADER_BYTES  # noqa: E402
from kvtier.worker.storage.redis_backend import RedisBackend  # noqa: E402

from tests.redis_server import RedisClusterServers, RedisServer  # noqa: E402

NAMESPACE = "bench/r0"
SECRET = b"kvtier-bench-storage-secret-0123"


class HostPages:
    """The destination of a prefetch: `count` pages of a real `HostPool` (POSIX shared memory,
    the host tier's own memory) when the page size is a whole KV shape (8 layers, block 64,
    head_dim 64, float16, 2..n KV heads), else an anonymous shared mmap. Pre-faulted."""

    def __init__(self, count: int, page: int, tag: str) -> None:
        self.kind = "mmap"
        self._pool = None
        unit = 8 * 2 * 64 * 64 * 2  # one KV head of the shape above
        try:
            from kvtier.worker.kv_pools import HostPool, KVShape
        except ImportError:
            HostPool = None
        if HostPool is not None and page % unit == 0:
            shape = KVShape(num_layers=8, num_kv_heads=page // unit, head_dim=64, block_size=64,
                            dtype="float16")
            self._pool = HostPool(shape, count, f"/kvtier_bench{os.getpid()}_{tag}_host")
            self.array = self._pool.data.numpy().reshape(-1)
            self.views = [self._pool.page_view(i) for i in range(count)]
            self.kind = "HostPool"
        else:
            self._mm = mmap.mmap(-1, count * page, flags=mmap.MAP_SHARED)
            self.array = np.frombuffer(self._mm, dtype=np.uint8)
            base = memoryview(self._mm)
            self.views = [base[i * page : (i + 1) * page] for i in range(count)]
        self.array[:] = 1

    def close(self) -> None:
        self.views = []
        if self._pool is not None:
            del self.array
            self._pool.close()


def plain_buffer(count: int, slot: int) -> list[memoryview]:
    """Pre-faulted destination slots for the plain read (a page file is header + payload)."""
    mm = mmap.mmap(-1, count * slot, flags=mmap.MAP_SHARED)
    np.frombuffer(mm, dtype=np.uint8)[:] = 1
    base = memoryview(mm)
    return [base[i * slot : (i + 1) * slot] for i in range(count)]


def interleaved(ours: Callable[[], None], plain: Callable[[], None], reps: int
                ) -> tuple[list[float], list[float]]:
    """Run both once untimed (warm-up), then `reps` timed rounds alternating the order."""
    ours()
    plain()
    t_ours: list[float] = []
    t_plain: list[float] = []
    for rep in range(reps):
        order = [(ours, t_ours), (plain, t_plain)]
        if rep % 2:
            order.reverse()
        for fn, times in order:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return t_ours, t_plain


def result(backend: str, page: int, count: int, t_ours: list[float], t_plain: list[float],
           **extra: object) -> dict[str, object]:
    """GB/s are medians over repetitions; the ratio is the median of the per-repetition
    ratios (each pair ran back to back), which cancels slow drifts of a shared machine."""
    payload = page * count
    gbps = payload / statistics.median(t_ours) / 1e9
    plain_gbps = payload / statistics.median(t_plain) / 1e9
    ratio = statistics.median(p / o for o, p in zip(t_ours, t_plain, strict=True))
    return {
        "backend": backend,
        "page_kib": page // 1024,
        "pages": count,
        "total_mib": payload // (1 << 20),
        "gbps": round(gbps, 3),
        "plain_gbps": round(plain_gbps, 3),
        "ratio": round(ratio, 3),
        **extra,
    }


def bench_file(root: Path, keys: list[bytes], src: np.ndarray, reps: int, io_threads: int,
               fmt: str = "clear") -> dict[str, object]:
    count, page = src.shape
    backend = FileBackend(root, NAMESPACE, secret=SECRET, page_bytes=page, io_threads=io_threads,
                          keys=page_keys(fmt))
    backend.clear()
    assert backend.set(keys, list(src)) == count
    host = HostPages(count, page, "file")
    dests = host.views
    plain_dests = plain_buffer(count, page + HEADER_BYTES + (TAG_BYTES if fmt != "clear" else 0))
    paths = [str(backend.root / k.hex()[:2] / k.hex()) for k in keys]

    def ours() -> None:
        if not all(backend.get_into(keys, dests)):
            raise RuntimeError("file backend missed a page during the benchmark")

    def plain() -> None:
        for path, dest in zip(paths, plain_dests, strict=True):
            with open(path, "rb", buffering=0) as f:
                f.readinto(dest)

    t_ours, t_plain = interleaved(ours, plain, reps)
    if not np.array_equal(host.array.reshape(count, page), src):
        raise RuntimeError("file backend returned wrong bytes")
    backend.clear()
    backend.close()
    dest_kind = host.kind
    host.close()  # unlinks now; unmaps when the last page view is gone
    return result("file", page, count, t_ours, t_plain, io_threads=io_threads, dest=dest_kind,
                  plain="open+readinto per page file", format=fmt)


def bench_redis(url: str, keys: list[bytes], src: np.ndarray, reps: int,
                fmt: str = "clear") -> dict[str, object]:
    count, page = src.shape
    backend = RedisBackend(url, NAMESPACE, secret=SECRET, page_bytes=page, timeout_s=5.0,
                           keys=page_keys(fmt))
    backend.clear()
    assert backend.set(keys, list(src)) == count
    host = HostPages(count, page, "redis")
    dests = host.views
    cluster = backend.cluster
    plain_client = (RedisCluster.from_url(url.replace("+cluster", ""), socket_timeout=5.0)
                    if cluster else redis.Redis.from_url(url, socket_timeout=5.0))
    read = plain_client.mget_nonatomic if cluster else plain_client.mget
    names = [backend.redis_key(k) for k in keys]
    batches = list(backend.batch_bounds(count, page))

    def ours() -> None:
        if not all(backend.get_into(keys, dests)):
            raise RuntimeError("redis backend missed a page during the benchmark")

    def plain() -> None:
        for lo, hi in batches:
            values = read(names[lo:hi])
            if any(v is None for v in values):
                raise RuntimeError("plain MGET missed a page")
            del values

    t_ours, t_plain = interleaved(ours, plain, reps)
    if not np.array_equal(host.array.reshape(count, page), src):
        raise RuntimeError("redis backend returned wrong bytes")
    backend.clear()
    backend.close()
    plain_client.close()
    dest_kind = host.kind
    host.close()
    if cluster:
        return result("cluster", page, count, t_ours, t_plain, dest=dest_kind,
                      plain=f"redis-py mget_nonatomic in the same {len(batches)} batches",
                      format=fmt)
    return result("redis", page, count, t_ours, t_plain, dest=dest_kind,
                  plain=f"MGET in the same {len(batches)} batches", format=fmt)


def page_keys(fmt: str) -> PageKeys | None:
    """Format 4 (AES-256-GCM) keys for "encrypted", None (format 3, MAC) for "clear"."""
    return PageKeys(SECRET) if fmt == "encrypted" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-kib", default="256,512,1024",
                        help="comma-separated page sizes in KiB (default 256,512,1024; 512 KiB "
                             "is one page of the default [model] and block_size)")
    parser.add_argument("--total-mib", type=int, default=256,
                        help="bytes prefetched per measurement, in MiB (default 256)")
    parser.add_argument("--reps", type=int, default=11, help="timed repetitions per side")
    parser.add_argument("--backends", default="file,redis,redis-cluster",
                        help="comma-separated subset of file, redis, redis-cluster")
    parser.add_argument("--file-threads", default="1,2",
                        help="comma-separated io_threads values for the file backend "
                             "(1 = calling thread only; default 1,2)")
    parser.add_argument("--dir", default=None, help="directory for the file backend")
    parser.add_argument("--formats", default="clear,encrypted",
                        help="page formats: clear (format 3, MAC) and/or encrypted (format 4)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    page_sizes = [int(x) * 1024 for x in args.page_kib.split(",") if x]
    backends = [b for b in args.backends.split(",") if b]
    threads = [int(x) for x in args.file_threads.split(",") if x]
    formats = [f for f in args.formats.split(",") if f]
    if any(f not in ("clear", "encrypted") for f in formats) or not formats:
        parser.error("--formats takes clear and/or encrypted")
    if (any(b not in ("file", "redis", "redis-cluster") for b in backends) or not page_sizes
            or args.reps < 1):
        parser.error("--backends takes file, redis and/or redis-cluster; --page-kib and --reps "
                     "must be set")
    if args.total_mib * 2 > 1536:
        parser.error("--total-mib above 768 would exceed the benchmark memory budget")

    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    server = RedisServer().start() if "redis" in backends else None
    cluster = RedisClusterServers().start() if "redis-cluster" in backends else None
    results: list[dict[str, object]] = []
    try:
        for page in page_sizes:
            count = max(1, (args.total_mib << 20) // page)
            keys = [hashlib.sha256(f"bench/{page}/{i}".encode()).digest() for i in range(count)]
            src = np.random.default_rng(page).integers(0, 256, (count, page), dtype=np.uint8)
            for fmt in formats:  # each format after the other, in the same invocation
                if "file" in backends:
                    for io_threads in threads:
                        results.append(bench_file(workdir, keys, src, args.reps, io_threads,
                                                  fmt))
                if server is not None:
                    results.append(bench_redis(server.url, keys, src, args.reps, fmt))
                if cluster is not None:
                    results.append(bench_redis(cluster.url, keys, src, args.reps, fmt))
            del src
    finally:
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)

    if args.json:
        print(json.dumps({
            "results": results,
            "page_cache": "warm for both sides",
            "cpu_count": os.cpu_count(),
        }))
    else:
        print("storage prefetch throughput (page cache warm for both sides; medians of "
              f"{args.reps} interleaved repetitions, GB/s = 1e9 payload bytes/s, ratio = "
              "median of per-repetition ours/plain)")
        print(f"{'backend':8} {'format':>9} {'threads':>7} {'page':>8} {'pages':>6} "
              f"{'ours GB/s':>10} "
              f"{'plain GB/s':>11} {'ratio':>6}  plain read")
        for r in results:
            print(f"{r['backend']:8} {r['format']!s:>9} {r.get('io_threads', '-')!s:>7} "
                  f"{r['page_kib']!s:>6}Ki "
                  f"{r['pages']!s:>6} {r['gbps']:>10.2f} {r['plain_gbps']:>11.2f} "
                  f"{r['ratio']:>6.2f}  {r['plain']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
