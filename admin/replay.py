"""`kvtier replay`: the command around the replay driver (`kvtier.manager.replay.replay`):
its arguments, the request source (a trace or a built-in workload), a progress bar on a
terminal, the report (a table or one JSON object), the hit-rate plot, signals and exit codes
(0; 1 when a corrupt block was seen; 2 on bad input; 3 when the run could not go on).

Imported only when that subcommand runs (`kvtier.admin.cli`), so `serve` and `status` never
load rich or matplotlib.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.admin.inputs import add_source_arguments, requests_from_args
from kvtier.manager.config import ConfigError, check_storage_reachable, load_config, summary
from kvtier.manager.errors import KvtierError
from kvtier.manager.replay import ProgressCallback, ReplayReport, replay
from kvtier.manager.stack import Stack
from kvtier.manager.workloads import (
    TraceError,
    check_requests_fit,
)

if TYPE_CHECKING:
    from rich.progress import Progress


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--limit", type=int, metavar="N", help="replay only the first N requests")
    p.add_argument("--verify", action="store_true",
                   help="fill computed blocks with key-derived bytes and check every hit "
                        "byte for byte on every rank")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--config", metavar="FILE", help="TOML configuration (env overrides it)")
    p.add_argument("--plot", metavar="PNG", help="write the cumulative hit rate per tier")
    p.add_argument("--lookahead", type=int, default=4, metavar="N",
                   help="requests ahead to prefetch from storage (default 4)")


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
        requests = requests_from_args(args)
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
