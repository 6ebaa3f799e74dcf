"""Helpers for the storage-tier tests: tiny stacks, a model runner that fills and checks
block bytes, and the on-storage location of a page.

A stack here is the real thing (worker processes, shared memory, a file directory or a real
Redis) with a KV shape small enough that a page is 512 bytes, so a test can commit, back up,
corrupt and restore dozens of blocks in well under a second. The model runner (`run_request`)
does what `kvtier.manager.replay` does per request, but returns the figures of that one request,
so a test can assert on the tier each hit came from.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvtier.manager.config import KvtierConfig
from kvtier.manager.keys import chain_keys, storage_keys
from kvtier.manager.replay import ReplayReport, _Diagnostics, replay
from kvtier.manager.scheduler import MatchResult
from kvtier.manager.stack import Stack
from kvtier.manager.workloads import WorkRequest
from kvtier.worker.wire import TaskKind
from support import tiny_config, wait_until

BS = 4
NUM_LAYERS = 2
NUM_KV_HEADS = 2
HEAD_DIM = 8
RANKS = 2
THRESHOLD_TOKENS = 8
WAIT_S = 20.0  # bound on every wait for a background task (backups, prefetches)


def stack_config(dep_id: str, storage_dir: Path, *, backend: str = "file",
                 url: str | None = None, policy: str = "wait_complete",
                 extra: Mapping[str, str] | None = None) -> KvtierConfig:
    """A 2-rank `support.tiny_config` (its KV shape is the one above) with room for a few
    hundred prompts, write_through (every committed block goes to host and then to storage)
    and the given storage backend and prefetch policy."""
    env = {
        "KVTIER_STORAGE__PREFETCH_POLICY": policy,
        "KVTIER_STORAGE__PREFETCH_THRESHOLD": str(THRESHOLD_TOKENS),
    }
    if url is not None:
        env["KVTIER_STORAGE__URL"] = url
    env.update(extra or {})
    return tiny_config(deployment_id=dep_id, workers=RANKS, num_layers=NUM_LAYERS,
                       device_blocks=512, host_blocks=1024, write_policy="write_through",
                       storage=backend, storage_dir=storage_dir, extra=env)


def prompt(tag: int, blocks: int, tail: int = 1) -> list[int]:
    """`blocks` full blocks no other tag shares, plus `tail` more tokens (a match covers at
    most len-1 tokens, so one extra token lets every full block be a hit)."""
    return [tag * 10_000 + i for i in range(blocks * BS + tail)]


def storage_counters(stack: Stack) -> dict[str, int]:
    """A copy of the manager's storage counters (queries, prefetch and backup pages)."""
    assert stack.storage is not None
    return dict(stack.storage.counters)


def wait_backups(stack: Stack, pages: int) -> None:
    """Wait until at least `pages` pages were written to storage by this manager and nothing
    is in flight (a BACKUP task counts its pages when every rank has written them)."""
    m = stack.require_manager()
    wait_until(lambda: storage_counters(stack)["backup_pages"] >= pages, WAIT_S,
               f"{pages} pages backed up (counters {storage_counters(stack)})", interval=0.01)
    assert m.dispatcher.drain(WAIT_S), "transfers still in flight"
    assert storage_counters(stack)["errors_backup"] == 0


@dataclass
class RequestOutcome:
    """What one request found, and what the device check said about it."""

    match: MatchResult
    checked_blocks: int
    corrupt_blocks: list[int]
    elapsed_match_s: float


class ModelRunner:
    """Plays the model runner against a stack: match, wait for the loads, CHECK every hit on
    every rank, allocate the rest, FILL the newly computed blocks with key-derived bytes,
    commit, release. Data: `diag` (runs FILL/CHECK and waits for every rank's answer)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.m = stack.require_manager()
        self.diag = _Diagnostics(self.m)
        self._n = itertools.count()

    def run(self, tokens: list[int], *, compute: bool = True) -> RequestOutcome:
        m = self.m
        rid = f"req-{next(self._n)}"
        t0 = time.monotonic()
        mr = m.match(rid, tokens)
        elapsed = time.monotonic() - t0
        mr.handle.wait()
        keys = m.request_keys(rid)
        n_hit = mr.num_tokens // BS
        bad: list[int] = []
        if n_hit:
            comp = self.diag.run(TaskKind.CHECK, mr.block_ids[:n_hit], keys[:n_hit])
            bad = list(comp.detail)
        n_valid = min(bad) if bad else n_hit
        if compute:
            m.allocate(rid, len(tokens) - mr.num_tokens, reserve_blocks=0)
            n_full = len(tokens) // BS
            if n_full > n_valid:
                blocks = m.request_blocks(rid)
                self.diag.run(TaskKind.FILL, blocks[n_valid:n_full], keys[n_valid:n_full])
            m.commit(rid, tokens, len(tokens))
        m.release(rid)
        return RequestOutcome(mr, n_hit, bad, elapsed)

    def check(self, tokens: list[int], block_ids: list[int]) -> list[int]:
        """CHECK arbitrary device blocks against the content of `tokens`' blocks."""
        keys = chain_keys(tokens, BS)[:len(block_ids)]
        return list(self.diag.run(TaskKind.CHECK, block_ids, keys).detail)


def page_keys(tokens: list[int]) -> list[bytes]:
    """The storage keys of `tokens`' full blocks (what names their pages in every backend)."""
    return storage_keys(tokens, BS)


def namespaces(stack: Stack) -> list[str]:
    """The storage namespace of each rank (the directory under storage.path, the middle part
    of a Redis key)."""
    return [stack.worker_spec(r).storage_namespace() for r in range(stack.cfg.workers.count)]


def page_file(stack: Stack, rank: int, key: bytes) -> Path:
    hexkey = key.hex()
    return Path(stack.cfg.storage_dir()) / namespaces(stack)[rank] / hexkey[:2] / hexkey


def redis_key(stack: Stack, rank: int, key: bytes) -> bytes:
    return f"kvtier:{namespaces(stack)[rank]}:{key.hex()}".encode()


def small_chat(conversations: int = 48, turns: int = 6, system_len: int = 32,
               turn_len: int = 32, concurrency: int = 12, seed: int = 7) -> list[WorkRequest]:
    """A multi-turn chat stream with the chat workload's structure (a shared system prompt,
    each turn's prompt = the whole history, `concurrency` chats open at once, the next turn
    from a random open chat) at a size a test replays in seconds: the default is 288
    requests of 12 to 52 blocks."""
    rng = random.Random(seed)
    system = [rng.randrange(32000) for _ in range(system_len)]
    history = {c: list(system) for c in range(conversations)}
    done_turns = dict.fromkeys(range(conversations), 0)
    open_convs = list(range(min(concurrency, conversations)))
    next_conv = len(open_convs)
    out: list[WorkRequest] = []
    while open_convs:
        k = rng.randrange(len(open_convs))
        c = open_convs[k]
        history[c].extend(rng.randrange(32000) for _ in range(turn_len))
        out.append(WorkRequest(list(history[c]), turn_len // 2))
        done_turns[c] += 1
        if done_turns[c] == turns:
            if next_conv < conversations:
                open_convs[k] = next_conv
                next_conv += 1
            else:
                open_convs.pop(k)
    return out


def replay_in_thread(stack: Stack, progress: Callable[[int, int, ReplayReport], None],
                     timeout: float, what: Callable[[], str] = lambda: "replay hung"
                     ) -> ReplayReport:
    """A verified replay of `small_chat()` on a thread of its own, bounded in wall time (a
    test that kills workers or stops Redis must never wait forever); an error of the replay
    is raised here; `what()` names the hang."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["report"] = replay(stack, small_chat(), verify=True, progress=progress)
        except BaseException as e:  # reported by the test thread
            out["error"] = e

    t = threading.Thread(target=run, name="replay", daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), what()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["report"]  # type: ignore[return-value]
