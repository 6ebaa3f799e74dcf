"""The sampled recompute audit of an engine's kvtier hits: which hits to audit, and how two
copies of one block compare.

An audited hit is not loaded: the engine recomputes the block, and when it offers the
recomputed block for storing, kvtier copies it into a scratch host page instead and compares
it with the page it holds for the same key (`compare_pages`). The integration (the vLLM
adapter) does the bookkeeping; this module holds what needs no engine:

* `AuditSampler`: which requests that hit kvtier are audited. Each is drawn with the
  configured probability (`audit.sample`), and only while a token bucket of
  `audit.max_blocks_per_s` has credit: the blocks an audited request recomputes are charged
  to it (it may go into debt by one request's blocks, so a request longer than a second's
  worth is still audited now and then, and the average stays under the cap).
* `compare_pages`: bitwise first; else element by element in the KV dtype, with a tolerance
  stated per dtype (`TOLERANCE`): a block is `within_tolerance` when every element's
  difference |a - b| is at most `rtol * (|b| + mean|b|)` (b: the copy kvtier holds; the mean
  over the block keeps near-zero elements from demanding exact equality), and a `mismatch`
  otherwise (or when either copy holds NaN or infinity where the other does not hold the same
  bits). Both figures are reported: the largest absolute difference and the largest relative
  one (|a - b| / (|b| + mean|b|)).
* `PageReader`: read-only views of each rank's host pool segment (the scheduler side reads
  both pages there; the worker side copied the recomputed one in).
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvtier.manager.config import parse_sample
from kvtier.worker.errors import KvtierError
from kvtier.worker.kv_pools import HostPool, KVShape
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

EQUAL = "equal"
WITHIN = "within_tolerance"
MISMATCH = "mismatch"
RESULTS = (EQUAL, WITHIN, MISMATCH)
# the reason a mismatch is removed from the node under (`KeyedHostCache.remove`: counted per
# reason; the node service's REMOVE op knows it by its code)
REMOVE_REASON = "audit_mismatch"
__all__ = ["AuditFigures", "AuditSampler", "PageReader", "Verdict", "compare_pages",
           "digest", "parse_sample", "scratch_key"]

# KV dtype -> relative tolerance: 4 units in the last place of the dtype's precision (what a
# different summation order in the engine's kernels moves a rounded value by, with margin);
# float32 is given 2^-16, since its products are accumulated in float32 as well
TOLERANCE: dict[str, float] = {
    "bfloat16": 4 * 2.0 ** -7,   # 8 bits of precision: 3.1 %
    "float16": 4 * 2.0 ** -10,   # 11 bits: 0.39 %
    "float32": 2.0 ** -16,       # 1.5e-5
    "float8_e4m3fn": 4 * 2.0 ** -3,  # 4 bits: 50 % (one step of fp8 is 12.5 %)
}


def scratch_key(block_hash: bytes) -> bytes:
    """The key of the scratch host page an audited block's recomputed copy is written to (a
    key no engine block has)."""
    return hashlib.sha256(b"kvtier-audit\0" + block_hash).digest()


def digest(page: np.ndarray) -> str:
    """A short digest of a page's bytes, for the log."""
    return hashlib.sha256(page.tobytes()).hexdigest()[:16]


class AuditSampler:
    """Which requests are audited: each drawn with probability `rate`, while the token bucket
    of `max_blocks_per_s` (0: no cap) has credit. `rate` 0 draws nothing and charges nothing.
    Thread-safe; `clock` and `seed` for tests."""

    def __init__(self, rate: float, max_blocks_per_s: float, *, seed: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.max_blocks_per_s = max_blocks_per_s
        self._rng = random.Random(seed)
        self._clock = clock
        self._credit = max_blocks_per_s  # one second's worth to start with
        self._at = clock()
        self._lock = threading.Lock()
        self.offered = 0  # requests offered to the draw (at their first hit, rate > 0)
        self.drawn = 0  # requests drawn for an audit
        self.capped = 0  # drawn, but the cap had no credit: served normally

    def draw(self, blocks: int) -> bool:
        """Whether a request whose hit would load `blocks` blocks is audited (its blocks are
        charged to the cap when it is)."""
        if self.rate <= 0.0:
            return False
        with self._lock:
            self.offered += 1
            if self.rate < 1.0 and self._rng.random() >= self.rate:
                return False
            self.drawn += 1
            cap = self.max_blocks_per_s
            if cap > 0:
                now = self._clock()
                self._credit = min(cap, self._credit + (now - self._at) * cap)
                self._at = now
                if self._credit <= 0:
                    self.capped += 1
                    return False
                self._credit -= blocks
            return True


@dataclass(frozen=True)
class Verdict:
    """How a recomputed block compares with the copy kvtier holds."""

    result: str  # EQUAL, WITHIN or MISMATCH
    max_abs: float  # largest |recomputed - held| over the block's elements (0 when equal)
    max_rel: float  # largest |recomputed - held| / (|held| + mean|held|)


def compare_pages(recomputed: np.ndarray, held: np.ndarray, dtype: str) -> Verdict:
    """Compare two copies of one block, as uint8 arrays of the same shape holding `dtype`
    elements (kvtier's model.dtype names)."""
    if recomputed.shape != held.shape:
        raise ValueError(f"pages of {recomputed.shape} and {held.shape} bytes")
    if np.array_equal(recomputed, held):
        return Verdict(EQUAL, 0.0, 0.0)
    if dtype not in TOLERANCE:
        raise ValueError(f"no tolerance for KV dtype {dtype!r}")
    tdtype = getattr(torch, dtype)
    a = torch.from_numpy(np.ascontiguousarray(recomputed).reshape(-1)).view(tdtype).double()
    b = torch.from_numpy(np.ascontiguousarray(held).reshape(-1)).view(tdtype).double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not bool(finite.all()):
        return Verdict(MISMATCH, math.inf, math.inf)
    diff = (a - b).abs()
    scale = b.abs() + b.abs().mean()
    rel = torch.where(scale > 0, diff / scale.clamp_min(1e-300),
                      torch.where(diff > 0, math.inf, 0.0))
    max_abs, max_rel = float(diff.max()), float(rel.max())
    result = WITHIN if max_rel <= TOLERANCE[dtype] else MISMATCH
    return Verdict(result, max_abs, max_rel)


class AuditFigures:
    """What the audit found: blocks by (result, tier) and the largest differences seen; a
    Prometheus collector for kvtier's /metrics (`kvtier_audit_blocks_total{result, tier}`,
    `kvtier_audit_max_abs_diff`, `kvtier_audit_max_rel_diff`)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}
        self.max_abs = 0.0
        self.max_rel = 0.0
        self._lock = threading.Lock()

    def record(self, v: Verdict, tier: str) -> None:
        with self._lock:
            key = (v.result, tier)
            self.counts[key] = self.counts.get(key, 0) + 1
            self.max_abs = max(self.max_abs, v.max_abs)
            self.max_rel = max(self.max_rel, v.max_rel)

    def total(self, result: str) -> int:
        with self._lock:
            return sum(n for (r, _), n in self.counts.items() if r == result)

    def status(self) -> dict[str, Any]:
        """The figures for kvtier's /status (`audit`): blocks by result and tier, the largest
        differences."""
        with self._lock:
            counts = dict(self.counts)
            return {"blocks": {r: {t: counts.get((r, t), 0) for t in ("host", "storage")}
                               for r in RESULTS},
                    "max_abs_diff": self.max_abs, "max_rel_diff": self.max_rel}

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self.counts)
            max_abs, max_rel = self.max_abs, self.max_rel
        blocks = CounterMetricFamily(
            "kvtier_audit_blocks", "Blocks the sampled recompute audit compared with the copy "
            "kvtier held, by result (equal, within_tolerance, mismatch) and the tier the copy "
            "was served from.", labels=["result", "tier"])
        for result in RESULTS:
            for tier in ("host", "storage"):
                blocks.add_metric([result, tier], counts.get((result, tier), 0))
        yield blocks
        yield GaugeMetricFamily(
            "kvtier_audit_max_abs_diff", "Largest absolute element difference between a "
            "recomputed block and kvtier's copy seen by the audit (0: all equal).", value=max_abs)
        yield GaugeMetricFamily(
            "kvtier_audit_max_rel_diff", "Largest relative element difference seen by the "
            "audit, |a - b| / (|b| + mean|b|) over a block.", value=max_rel)


class PageReader:
    """Read-only access to the host pages of each rank's segment (name, inode), mapped on
    first use and remapped when a segment is replaced."""

    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self._pools: dict[int, HostPool] = {}
        self._lock = threading.Lock()

    def page(self, rank: int, segment: str, inode: int, host_id: int,
             layers: int | None = None) -> np.ndarray:
        """A copy of the first `layers` KV layers (default all) of host page `host_id` as
        uint8. Raises KvtierError if the segment is not the one named."""
        with self._lock:
            pool = self._pools.get(rank)
            if pool is None or pool.name != segment or pool.inode != inode:
                if pool is not None:
                    pool.close()
                    del self._pools[rank]
                pool = HostPool.attach(segment, self.shape)
                if pool.inode != inode:
                    pool.close()
                    raise KvtierError(f"host pool {segment} was replaced")
                self._pools[rank] = pool
            n = self.shape.num_layers if layers is None else layers
            nbytes = n * self.shape.layer_bytes
            return pool.data[host_id, :nbytes].numpy().copy()

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
