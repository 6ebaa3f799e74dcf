"""The request source `kvtier replay` and `kvtier plan` share: a Mooncake trace or a built-in
workload, and `--limit`."""

from __future__ import annotations

import argparse

from kvtier.manager.workloads import WORKLOADS, TraceError, WorkRequest, chat_requests, read_trace


def add_source_arguments(p: argparse.ArgumentParser) -> None:
    """`--trace FILE` or `--workload NAME` (one of them; the chat workload by default)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE",
                     help="a Mooncake-format trace (JSON lines: timestamp, input_length, "
                          "output_length, hash_ids)")
    src.add_argument("--workload", metavar="NAME", choices=WORKLOADS,
                     help=f"a built-in workload ({', '.join(WORKLOADS)}; the default)")


def requests_from_args(args: argparse.Namespace) -> list[WorkRequest]:
    """The requests `add_source_arguments`' options name, the first `--limit` of them."""
    if args.limit is not None and args.limit < 0:
        raise TraceError(f"--limit must be >= 0, got {args.limit}")
    if args.trace:
        return list(read_trace(args.trace, args.limit))
    return chat_requests(args.limit)
