"""Helpers for tests that run a real Stack: a context manager that checks a stopped deployment
left nothing behind, synchronous diagnostics and the workers' host pools seen from the test.
Tiny configurations, bounded waits and leftover checks come from `support`.

Worker processes import torch, so starting a Stack costs seconds: tests share stacks where
they do not break them, and everything here is bounded so a stuck worker fails a test
instead of hanging it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.manager.config import KvtierConfig
from kvtier.manager.keys import key_bytes
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.stack import Stack
from kvtier.worker.kv_pools import HostPool, KVShape
from kvtier.worker.process import host_segment_name
from kvtier.worker.wire import Completion, TaskKind
from support import leftovers


def kv_shape(cfg: KvtierConfig) -> KVShape:
    m = cfg.model
    return KVShape(m.num_layers, m.num_kv_heads, m.head_dim, cfg.cache.block_size, m.dtype)


def worker_pids(stack: Stack) -> list[int]:
    """Current worker pid of every rank."""
    assert stack.supervisor is not None
    return [w.proc.pid for w in stack.supervisor.workers if w.proc is not None]


@contextlib.contextmanager
def running_stack(cfg: KvtierConfig, *, log_dir: str | os.PathLike[str] | None = None,
                  transfer_timeout_s: float = 20.0,
                  keyed_namespace: bytes | None = None) -> Iterator[Stack]:
    """A started Stack; on exit it is closed and the deployment must have left nothing: no
    /dev/shm entry, no queue, no worker process (the pids of the first workers and of the
    last ones, replacements included; tests that kill a worker check that one themselves),
    and every worker must have exited cleanly (status 0) on the SIGTERM `close` sends.
    On an error inside the block the stack is closed too, and what was left is added as a
    note to the error instead of hiding it."""
    stack = Stack(cfg, log_dir=None if log_dir is None else str(log_dir),
                  transfer_timeout_s=transfer_timeout_s, keyed_namespace=keyed_namespace)
    seen: list[int] = []
    try:
        stack.start()
        seen.extend(worker_pids(stack))
        yield stack
    except BaseException as e:
        with contextlib.suppress(Exception):
            seen.extend(worker_pids(stack))
        stack.close()
        left = leftovers(cfg.deployment_id, cfg.workers.count, seen)
        if left:
            e.add_note(f"after close, deployment {cfg.deployment_id} left {left}")
        raise
    seen.extend(worker_pids(stack))
    stack.close()
    left = leftovers(cfg.deployment_id, cfg.workers.count, seen)
    assert not left, f"after close, deployment {cfg.deployment_id} left {left}"
    assert_clean_exits(stack)


def assert_clean_exits(stack: Stack) -> None:
    """Every worker the closed stack stopped (with SIGTERM) exited with status 0."""
    assert stack.supervisor is not None
    bad = {w.rank: w.proc.returncode for w in stack.supervisor.workers
           if w.proc is not None and w.proc.returncode != 0}
    assert not bad, (
        f"workers did not exit cleanly on SIGTERM (rank: status) {bad}; last log lines:\n"
        + "\n".join(stack.supervisor.last_log_lines(r, 8) for r in bad))


@contextlib.contextmanager
def attached_host_pools(cfg: KvtierConfig) -> Iterator[list[HostPool]]:
    """Every rank's host pool segment, mapped into this process (read the pages the
    workers wrote). Attached pools never unlink the segments."""
    shape = kv_shape(cfg)
    pools: list[HostPool] = []
    try:
        for r in range(cfg.workers.count):
            pools.append(HostPool.attach(host_segment_name(cfg.deployment_id, r), shape))
        yield pools
    finally:
        for p in pools:
            p.close()


# --------------------------------------------------------------------------- diagnostics


@dataclass
class Outcome:
    """The merged outcome of a diagnostic task over every rank."""

    ok: bool
    result: int
    detail: list[int]
    error: str


def submit(m: KVCacheManager, kind: TaskKind, ids: Sequence[int], keys: Sequence[int],
           ) -> tuple[int, list[Outcome]]:
    """Submit a FILL or CHECK of device blocks `ids` with the content of tree keys `keys`;
    returns the task's seq and a list the outcome is appended to when every rank answered."""
    got: list[Outcome] = []

    def done(ok: bool, comp: Completion) -> None:
        got.append(Outcome(ok, comp.result, list(comp.detail), comp.error))

    seq = m.submit_diagnostic(kind, list(ids), [key_bytes(k) for k in keys], done)
    return seq, got


def diagnose(m: KVCacheManager, kind: TaskKind, ids: Sequence[int], keys: Sequence[int],
             timeout: float = 20.0) -> Outcome:
    """Run a FILL or CHECK and wait (bounded) until every rank answered."""
    seq, got = submit(m, kind, ids, keys)
    m.dispatcher.wait([seq], timeout)
    assert len(got) == 1, f"diagnostic task {seq} reported {len(got)} times"
    return got[0]


def fill(m: KVCacheManager, ids: Sequence[int], keys: Sequence[int], timeout: float = 20.0,
         ) -> None:
    """Write the content of `keys` into device blocks `ids` on every rank (as the model
    runner writes computed KV)."""
    out = diagnose(m, TaskKind.FILL, ids, keys, timeout)
    assert out.ok, f"FILL of {len(ids)} blocks failed: {out.error}"


def check(m: KVCacheManager, ids: Sequence[int], keys: Sequence[int], timeout: float = 20.0,
          ) -> list[int]:
    """Indices `i` whose device block `ids[i]` does not hold the content of `keys[i]` on
    some rank (every byte of K and V of every layer compared)."""
    out = diagnose(m, TaskKind.CHECK, ids, keys, timeout)
    assert out.ok, f"CHECK of {len(ids)} blocks failed: {out.error}"
    assert out.result == len(out.detail), out
    return out.detail
