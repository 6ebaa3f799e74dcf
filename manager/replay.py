"""The replay driver: drive a request stream through a running stack and report what each
tier served (engine-agnostic; the `kvtier replay` command around it, with its arguments,
progress bar, plot and exit codes, is `kvtier.admin.replay`).

The replay plays the model runner: per request it matches the prompt, waits for the loads,
allocates the rest, "computes" the new blocks and commits them, then releases the request —
each request finished before the next, in stream order. With `--verify` the computing is
real as far as the cache can tell: every newly computed block is filled on every rank with
bytes derived from its key (a FILL task), and every hit from any tier is checked byte for byte
on the device of every rank (a CHECK task) before it is counted; a mismatch is a corrupt block
and makes the exit status 1.

With a storage tier, the replay looks a few requests ahead and asks the manager to prefetch
their prefixes (as a scheduler does for queued requests), so `best_effort` prefetching has
time to land.

A worker may die during a replay (it is replaced by the launcher): a request whose load,
CHECK or FILL failed is recomputed (its hit counts as a miss, its blocks are not cached), a
request that finds no device room is skipped, and the run goes on; the report counts both
(`failed_transfers`, `failed_requests`). Exit status 1 stays reserved for a corrupt block.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.manager.errors import (
    KvtierError,
    OutOfBlocksError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvtier.manager.keys import key_bytes
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.stack import Stack
from kvtier.manager.workloads import WorkRequest
from kvtier.worker.wire import Completion, TaskKind

DIAG_TIMEOUT_S = 60.0
log = logging.getLogger("kvtier.replay")


@dataclass
class ReplayReport:
    """Figures of one replay; `to_json()` holds the keys the brief names."""

    requests: int = 0
    lookup_tokens: int = 0
    hit_tokens: dict[str, int] = field(
        default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    verified_blocks: int = 0
    corrupt_blocks: int = 0
    failed_loads: int = 0
    failed_transfers: int = 0  # FILL / CHECK tasks that failed (a worker died): recomputed
    failed_requests: int = 0  # requests skipped: no device room even after waiting
    transfer_bytes: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0
    history: list[tuple[int, int, int, int]] = field(default_factory=list)  # cumulative

    @property
    def hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.lookup_tokens if self.lookup_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        lt = self.lookup_tokens
        return {
            "requests": self.requests,
            "lookup_tokens": lt,
            "hit_tokens": dict(self.hit_tokens),
            "hit_rate": self.hit_rate,
            "hit_rate_by_tier": {k: (v / lt if lt else 0.0) for k, v in self.hit_tokens.items()},
            "verified_blocks": self.verified_blocks,
            "corrupt_blocks": self.corrupt_blocks,
            "failed_loads": self.failed_loads,
            "failed_transfers": self.failed_transfers,
            "failed_requests": self.failed_requests,
            "transfer_bytes": dict(self.transfer_bytes),
            "elapsed_s": round(self.elapsed_s, 3),
            "requests_per_s": round(self.requests / self.elapsed_s, 2) if self.elapsed_s else 0,
        }


class _Diagnostics:
    """Runs FILL/CHECK tasks and waits for their merged answers."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.m = manager
        self.result: Completion | None = None

    def run(self, kind: TaskKind, block_ids: list[int], keys: list[int]) -> Completion:
        """The task's merged answer; KvtierError if it failed."""
        comp = self.attempt(kind, block_ids, keys)
        if not comp.ok:
            raise KvtierError(f"{kind.name} task {comp.seq} failed: {comp.error}")
        return comp

    def attempt(self, kind: TaskKind, block_ids: list[int], keys: list[int]) -> Completion:
        """The task's merged answer, failed (`ok` False) when a rank failed it or did not
        answer within DIAG_TIMEOUT_S."""
        self.result = None

        def done(_ok: bool, comp: Completion) -> None:
            self.result = comp

        seq = self.m.submit_diagnostic(kind, block_ids, [key_bytes(k) for k in keys], done)
        try:
            self.m.dispatcher.wait([seq], DIAG_TIMEOUT_S)
        except TransferTimeoutError as e:
            return Completion(seq, -1, False, error=str(e))
        assert self.result is not None
        return self.result


ProgressCallback = Callable[[int, int, ReplayReport], None]
"""`progress(done, total, report)`, called after each replayed request."""


def replay(stack: Stack, requests: Iterable[WorkRequest], *, verify: bool = False,
           lookahead: int = 4, progress: ProgressCallback | None = None) -> ReplayReport:
    """Run every request through `stack`; returns the figures."""
    m = stack.require_manager()
    bs = m.block_size
    diag = _Diagnostics(m)
    reqs: Sequence[WorkRequest] = list(requests)
    report = ReplayReport()
    t0 = time.perf_counter()
    for i, wr in enumerate(reqs):
        if m.storage is not None:
            for ahead in reqs[i + 1:i + 1 + lookahead]:
                m.prefetch(ahead.tokens)
        tokens = wr.tokens
        rid = f"replay-{i}"
        try:
            mr = m.match(rid, tokens)
        except OutOfBlocksError as e:
            log.warning("%s skipped: %s", rid, e)
            report.failed_requests += 1
            _count(report, len(tokens), {"device": 0, "host": 0, "storage": 0})
            if progress is not None:
                progress(i + 1, len(reqs), report)
            continue
        valid = mr.num_tokens
        try:
            mr.handle.wait()
        except TransferFailedError as e:
            valid = e.valid_tokens
            report.failed_loads += 1
        except TransferTimeoutError:
            valid = 0
            report.failed_loads += 1
        keys = m.request_keys(rid)
        n_valid = valid // bs
        if verify and n_valid:
            comp = diag.attempt(TaskKind.CHECK, mr.block_ids[:n_valid], keys[:n_valid])
            if not comp.ok or m.request_lost(rid):
                # Unverified: a rank died (the check failed, or ran on its replacement,
                # whose memory never held these blocks). Recomputed: a miss.
                report.failed_transfers += 1
                n_valid = 0
            else:
                report.verified_blocks += n_valid
                report.corrupt_blocks += len(comp.detail)
                if comp.detail:
                    # A corrupt block must never be counted as a hit: cut the hit before it.
                    n_valid = min(comp.detail)
        served = True
        try:
            m.allocate(rid, len(tokens) - mr.num_tokens, reserve_blocks=0)
        except OutOfBlocksError as e:  # busy room waited for in vain: skip the request
            log.warning("%s skipped: %s", rid, e)
            report.failed_requests += 1
            served = False
            n_valid = 0
        n_full = len(tokens) // bs
        computed = served
        if served and verify and n_full > n_valid:
            blocks = m.request_blocks(rid)
            comp = diag.attempt(TaskKind.FILL, blocks[n_valid:n_full], keys[n_valid:n_full])
            if not comp.ok:  # the blocks hold no known bytes on some rank: never cache them
                report.failed_transfers += 1
                computed = False
        if computed:
            m.commit(rid, tokens, len(tokens))
        m.release(rid)
        # Per-tier hits, scaled down to what was valid (a failed or corrupt tail is a miss).
        hits = {"device": mr.device_tokens, "host": mr.host_tokens,
                "storage": mr.storage_tokens}
        excess = mr.num_tokens - n_valid * bs
        for tier in ("storage", "host", "device"):
            cut = min(excess, hits[tier])
            hits[tier] -= cut
            excess -= cut
        _count(report, len(tokens), hits)
        if progress is not None:
            progress(i + 1, len(reqs), report)
    m.dispatcher.drain(DIAG_TIMEOUT_S)
    report.elapsed_s = time.perf_counter() - t0
    report.transfer_bytes = transfer_bytes(stack)
    return report


def _count(report: ReplayReport, tokens: int, hits: dict[str, int]) -> None:
    """One request replayed: its prompt tokens and the tokens each tier served."""
    report.requests += 1
    report.lookup_tokens += tokens
    for k, v in hits.items():
        report.hit_tokens[k] += v
    h = report.hit_tokens
    report.history.append((report.lookup_tokens, h["device"], h["host"], h["storage"]))


def transfer_bytes(stack: Stack) -> dict[str, int]:
    """Bytes moved so far, over every rank, by direction."""
    m = stack.require_manager()
    c = m.stats()["counters"]
    per_block = stack.page_bytes * stack.cfg.workers.count
    out = {"d2h": c["d2h_blocks"] * per_block, "h2d": c["h2d_blocks"] * per_block,
           "storage_read": 0, "storage_write": 0}
    if stack.storage is not None:
        sc = stack.storage.counters
        out["storage_read"] = sc["prefetch_pages_completed"] * per_block
        out["storage_write"] = sc["backup_pages"] * per_block
    return out
