"""`kvtier replay`: drive a request stream through a running stack and report what each tier
served.

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

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.manager.config import ConfigError, check_storage_reachable, load_config, summary
from kvtier.manager.errors import (
    KvtierError,
    OutOfBlocksError,
    TransferFailedError,
    TransferTimeoutError,
)
from kvtier.manager.keys import key_bytes
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.stack import Stack
from kvtier.manager.workloads import (
    WORKLOADS,
    TraceError,
    WorkRequest,
    chat_requests,
    check_requests_fit,
    read_trace,
)
from kvtier.worker.wire import Completion, TaskKind

if TYPE_CHECKING:
    from rich.progress import Progress

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


# ---------------------------------------------------------------------- command line


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE",
                     help="a Mooncake-format trace (JSON lines: timestamp, input_length, "
                          "output_length, hash_ids)")
    src.add_argument("--workload", metavar="NAME", choices=WORKLOADS,
                     help=f"a built-in workload ({', '.join(WORKLOADS)}; the default)")
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--verify", action="store_true",
                   help="fill computed blocks with key-derived bytes and check every hit "
                        "byte for byte on every rank")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", metavar="FILE", help="TOML configuration (env overrides it)")
    p.add_argument("--plot", metavar="PNG", help="write the cumulative hit rate per tier")
    p.add_argument("--lookahead", type=int, default=4, metavar="N",
                   help="requests ahead to prefetch from storage (default 4)")


def _requests(args: argparse.Namespace) -> list[WorkRequest]:
    if args.limit is not None and args.limit < 0:
        raise TraceError(f"--limit must be >= 0, got {args.limit}")
    if args.trace:
        return list(read_trace(args.trace, args.limit))
    return chat_requests(args.limit)


def _progress_printer(enabled: bool) -> tuple[Progress | None, ProgressCallback | None]:
    """A rich progress bar on a terminal; nothing otherwise."""
    if not enabled:
        return None, None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    prog = Progress("[progress.description]{task.description}", BarColumn(),
                    MofNCompleteColumn(), TimeRemainingColumn(), transient=True)
    task_id = prog.add_task("replay", total=None)

    def update(done: int, total: int, report: ReplayReport) -> None:
        prog.update(task_id, completed=done, total=total,
                    description=f"replay  hit rate {report.hit_rate:6.1%}")

    return prog, update


def plot_hit_rates(report: ReplayReport, path: str) -> None:
    """Cumulative hit rate per tier over the replay, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(1, len(report.history) + 1))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    cum = [0.0] * len(xs)
    for idx, tier in ((1, "device"), (2, "host"), (3, "storage")):
        ys = [h[idx] / h[0] if h[0] else 0.0 for h in report.history]
        top = [c + y for c, y in zip(cum, ys, strict=True)]
        ax.fill_between(xs, cum, top, label=tier, alpha=0.8)
        cum = top
    ax.set_xlabel("requests")
    ax.set_ylabel("cumulative hit rate (tokens)")
    ax.set_ylim(0, max(0.05, max(cum, default=0) * 1.15))
    ax.set_title("kvtier replay: cumulative hit rate per tier")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        # `make run` plots to .kvtier/replay.png; the folder used to exist because the file
        # storage tier defaulted to .kvtier/storage, which it no longer does.
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)


def _print_report(report: ReplayReport, stack: Stack) -> None:
    d = report.to_json()
    lt = d["lookup_tokens"] or 1
    print(f"requests {d['requests']}   prompt tokens {d['lookup_tokens']:,}   "
          f"elapsed {d['elapsed_s']:.1f} s   ({d['requests_per_s']} req/s, "
          f"{d['lookup_tokens'] / max(d['elapsed_s'], 1e-9):,.0f} tokens/s)")
    print(f"{'tier':<9}{'hit tokens':>14}{'hit rate':>10}")
    for tier, v in d["hit_tokens"].items():
        print(f"{tier:<9}{v:>14,}{v / lt:>10.1%}")
    print(f"{'total':<9}{sum(d['hit_tokens'].values()):>14,}{d['hit_rate']:>10.1%}")
    print("transfers: " + ", ".join(f"{k} {v / 2**20:,.1f} MiB"
                                    for k, v in d["transfer_bytes"].items()))
    if d["verified_blocks"] or d["corrupt_blocks"]:
        print(f"verified blocks {d['verified_blocks']:,}, corrupt blocks {d['corrupt_blocks']}")
    if d["failed_loads"] or d["failed_transfers"] or d["failed_requests"]:
        print(f"failed loads {d['failed_loads']}, failed FILL/CHECK tasks "
              f"{d['failed_transfers']} (recomputed), requests skipped for lack of device "
              f"room {d['failed_requests']}")
    print(f"config: {json.dumps(summary(stack.cfg), default=str)}")


def _exit_on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def run_replay_command(args: argparse.Namespace) -> int:
    """`kvtier replay`: exit 0, 1 when a corrupt block was seen, 2 on bad input, 3 when the
    run could not go on (the workers did not start, ...: one message, no traceback)."""
    try:
        return _run_replay_command(args)
    except KvtierError as e:
        print(f"kvtier replay: {e}", file=sys.stderr)
        return 3


def _run_replay_command(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config)
        check_storage_reachable(cfg)
        requests = _requests(args)
        check_requests_fit(requests, cfg.cache.block_size, cfg.cache.device_blocks, args.trace)
    except (ConfigError, TraceError) as e:
        print(f"kvtier replay: {e}", file=sys.stderr)
        return 2
    prog, update = _progress_printer(not args.json and sys.stderr.isatty())
    # SIGTERM unwinds like Ctrl-C does, so the stack stops its workers and unlinks its names.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    # Verified runs keep their pages apart: an unverified run's pages hold whatever bytes
    # its blocks held, which a verified run would report as corrupt.
    with Stack(cfg, storage_tag="verify" if args.verify else "") as stack:
        if prog is not None:
            with prog:
                report = replay(stack, requests, verify=args.verify,
                                lookahead=args.lookahead, progress=update)
        else:
            report = replay(stack, requests, verify=args.verify, lookahead=args.lookahead)
        if args.json:
            print(json.dumps(report.to_json()))
        else:
            _print_report(report, stack)
    if args.plot:
        try:
            plot_hit_rates(report, args.plot)
        except OSError as e:  # one line, never a traceback; the report is already printed
            print(f"kvtier replay: --plot {args.plot!r}: {e.strerror or e}", file=sys.stderr)
            return 1 if report.corrupt_blocks else 3
        if not args.json:
            print(f"plot written to {Path(args.plot).resolve()}")
    return 1 if report.corrupt_blocks else 0
