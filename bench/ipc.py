"""Round trip manager -> 2 workers -> manager: kvtier's IPC against two baselines, one run.

Measured systems (each with its own 2 worker processes, started once):
  * kvtier           `kvtier.worker.ipc.ManagerIPC` / `WorkerIPC` (POSIX queues + id arena); the
                     manager's completion callback wakes the waiting thread, as in the
                     manager; workers decode ids as int64 arrays (what a copy engine uses).
  * kvtier_list_ids  the same, workers decoding ids into Python lists (the default).
  * raw_posix_mq     the floor: the same topology on bare POSIX queues (bytes of the same
                     size, no encoding, no flags), to show what the machine itself costs.
  * managers_queue   a `multiprocessing.managers` server over TCP serving queue.Queue objects:
                     one task queue per worker, one result queue.
  * enginecachequeue the "EngineCacheQueue pattern": a manager-served task list + per-rank
                     read flags + lock, workers polling every 1 ms; results through a served
                     list the manager polls every 1 ms.

Phases are interleaved (round after round, every system for every task size) so drift on a
noisy machine hits all systems alike. While one system is measured, the other systems'
workers are stopped with SIGSTOP (a polling baseline would otherwise eat a core under the
others) and resumed with SIGCONT for their own phase.

CPU per round trip: on-CPU time of every process involved (all threads: the bench process,
which hosts the manager side and the kvtier threads, the workers, and the baseline's server),
read from the scheduler's per-thread runtime in /proc (the source getrusage reports, readable
for live processes), over the phase, divided by its round trips. Idle CPU: the same for the
system's two workers over `--idle-seconds` with no task, as % of one core.

Reading the baselines at 4,096 ids: a pickled 4,096-id task is over 16 KiB, and
multiprocessing's connection then writes the length header and the payload in two send()
calls; over TCP (Nagle + delayed ACK) each such message stalls ~40 ms on Linux. That is how
those transports behave with tasks of this size, so it is measured, not worked around.

Usage:  .venv/bin/python bench/ipc.py [--json] [--rounds 5] [--round-trips 2000]
                                      [--phase-seconds 0.5] [--idle-seconds 3]
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.managers import SyncManager
from typing import Any

import posix_ipc
from kvtier.worker.ipc import ManagerGone, ManagerIPC, WorkerIPC, cleanup_stale
from kvtier.worker.wire import Completion, Task, TaskKind

SIZES = (64, 4096)
TARGET_MEDIAN_US = 50.0
TARGET_VS_MANAGERS = 5.0
TARGET_VS_ECQ = 30.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- CPU accounting


def cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every live thread of `pid`."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) * 1_000_000_000 // _CLK_TCK
            except (OSError, ValueError, IndexError):
                pass
    return total


def cpu_of(pids: list[int]) -> int:
    return sum(cpu_ns(p) for p in pids)


# --------------------------------------------------------------------------- worker loops


def kvtier_worker(deployment_id: str, rank: int, arrays: bool) -> None:
    """Echo loop on WorkerIPC: answer every task at once; CLEAR ends it."""
    with WorkerIPC(deployment_id, rank, ids_as_arrays=arrays) as ipc:
        ipc.set_ready()
        while True:
            try:
                task = ipc.recv_task(0.5)
            except ManagerGone:
                return
            if task is None:
                continue
            if task.kind == TaskKind.CLEAR:
                return
            ipc.post_completion(Completion(task.seq, rank, True, result=len(task.src)))


def raw_queue_worker(task_queue: str, done_queue: str) -> None:
    """Echo loop on bare POSIX queues: no encoding, no flags; an empty message ends it."""
    tasks = posix_ipc.MessageQueue(task_queue)
    done = posix_ipc.MessageQueue(done_queue)
    try:
        while True:
            try:
                msg, _ = tasks.receive(0.5)
            except posix_ipc.BusyError:
                continue
            if not msg:
                return
            done.send(msg[:32])
    finally:
        tasks.close()
        done.close()


def managers_queue_worker(tasks: Any, done: Any, rank: int) -> None:
    """Echo loop on served queue.Queue proxies; None ends it."""
    while True:
        task = tasks.get()
        if task is None:
            return
        done.put(Completion(task.seq, rank, True, result=len(task.src)))


def ecq_worker(tasks: Any, flags: Any, lock: Any, results: Any, rank: int) -> None:
    """EngineCacheQueue-pattern consumer: poll the served list every 1 ms."""
    while True:
        if len(tasks) and not flags[rank]:
            with lock:
                batch = tasks[:]
                flags[rank] = 1
                if all(flags[:]):
                    del tasks[:]
            for task in batch:
                if task is None:
                    return
                with lock:
                    results.append(Completion(task.seq, rank, True, result=len(task.src)))
        else:
            time.sleep(0.001)


# --------------------------------------------------------------------------- systems


class System(abc.ABC):
    """One measured transport: its worker processes, a round trip, a stop."""

    name = ""

    def __init__(self) -> None:
        self.procs: list[mp.process.BaseProcess] = []
        self.extra_pids: list[int] = []

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def pids(self) -> list[int]:
        return [os.getpid(), *self.worker_pids(), *self.extra_pids]

    def pause(self) -> None:
        for pid in self.worker_pids():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.worker_pids():
            os.kill(pid, signal.SIGCONT)

    @abc.abstractmethod
    def round_trip(self, task: Task) -> None:
        """Send `task` to both workers and return once both have answered."""

    @abc.abstractmethod
    def stop(self) -> None:
        """End the workers (and the system's server)."""

    def _join(self) -> None:
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Kvtier(System):
    def __init__(self, ctx: Any, arrays: bool) -> None:
        super().__init__()
        self.name = "kvtier" if arrays else "kvtier_list_ids"
        dep = f"bench{os.getpid()}{'a' if arrays else 'l'}"
        cleanup_stale(dep, 2)
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0
        self._errors: list[Completion] = []
        self.ipc = ManagerIPC(dep, 2, on_completion=self._on_completion)
        self.procs = [
            ctx.Process(target=kvtier_worker, args=(dep, r, arrays), daemon=True) for r in range(2)
        ]
        for p in self.procs:
            p.start()
        self.ipc.wait_ready(30)

    def _on_completion(self, completion: Completion) -> None:
        if not completion.ok:
            self._errors.append(completion)
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._event.set()

    def round_trip(self, task: Task) -> None:
        self._pending = 2
        self._event.clear()
        self.ipc.send_task(task)
        if not self._event.wait(10) or self._errors:
            raise RuntimeError(f"kvtier round trip failed: {self._errors or 'timeout'}")

    def stop(self) -> None:
        self.resume()
        try:
            self.ipc.send_task(Task(0, TaskKind.CLEAR), timeout=2)
        finally:
            self._join()
            self.ipc.close()


class RawQueues(System):
    """The floor under kvtier's transport on this machine: the same processes, queues,
    reader thread and wake-up, with bare bytes of the same size and nothing else."""

    name = "raw_posix_mq"

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        prefix = f"/kvtier_bench{os.getpid()}r_"
        self.names = [f"{prefix}task0", f"{prefix}task1", f"{prefix}done"]
        for n in self.names:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_message_queue(n)
        self.queues = [
            posix_ipc.MessageQueue(
                n, posix_ipc.O_CREX, mode=0o600, max_messages=10, max_message_size=4096
            )
            for n in self.names
        ]
        self._event = threading.Event()
        self._pending = 0
        self._lock = threading.Lock()
        self._stopping = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.procs = [
            ctx.Process(target=raw_queue_worker, args=(self.names[r], self.names[2]), daemon=True)
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def _read(self) -> None:
        while not self._stopping:
            try:
                self.queues[2].receive(0.5)
            except posix_ipc.BusyError:
                continue
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._event.set()

    def round_trip(self, task: Task) -> None:
        payload = b"\0" * (32 + 16 * len(task.src))  # what kvtier sends inline or by ref
        msg = payload if len(payload) <= 4096 else payload[:40]
        self._pending = 2
        self._event.clear()
        for q in self.queues[:2]:
            q.send(msg, 5)
        if not self._event.wait(10):
            raise RuntimeError("raw queue round trip timed out")

    def stop(self) -> None:
        self.resume()
        for q in self.queues[:2]:
            q.send(b"", 2)
        self._join()
        self._stopping = True
        self._reader.join(timeout=5)
        for q, n in zip(self.queues, self.names, strict=True):
            q.close()
            posix_ipc.unlink_message_queue(n)


class ManagersQueue(System):
    name = "managers_queue"

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        self.server = SyncManager(address=("127.0.0.1", 0), ctx=ctx)
        self.server.start()
        self.extra_pids = [self.server._process.pid]
        self.tasks = [self.server.Queue() for _ in range(2)]
        self.done = self.server.Queue()
        self.procs = [
            ctx.Process(target=managers_queue_worker, args=(self.tasks[r], self.done, r))
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def round_trip(self, task: Task) -> None:
        for q in self.tasks:
            q.put(task)
        for _ in range(2):
            c = self.done.get(timeout=10)
            if not c.ok:
                raise RuntimeError(f"managers queue round trip failed: {c}")

    def stop(self) -> None:
        self.resume()
        for q in self.tasks:
            q.put(None)
        self._join()
        self.server.shutdown()


class EngineCacheQueue(System):
    name = "enginecachequeue"

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        self.server = SyncManager(address=("127.0.0.1", 0), ctx=ctx)
        self.server.start()
        self.extra_pids = [self.server._process.pid]
        self.tasks = self.server.list()
        self.flags = self.server.list([1, 1])
        self.lock = self.server.Lock()
        self.results = self.server.list()
        self.procs = [
            ctx.Process(
                target=ecq_worker, args=(self.tasks, self.flags, self.lock, self.results, r)
            )
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def _put(self, task: Task | None) -> None:
        with self.lock:
            self.tasks.append(task)
            self.flags[0] = 0
            self.flags[1] = 0

    def round_trip(self, task: Task) -> None:
        self._put(task)
        deadline = time.monotonic() + 10
        while len(self.results) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("EngineCacheQueue pattern round trip timed out")
            time.sleep(0.001)
        with self.lock:
            del self.results[:]

    def stop(self) -> None:
        self.resume()
        self._put(None)
        self._join()
        self.server.shutdown()


# --------------------------------------------------------------------------- measurement


def make_task(seq: int, ids: int) -> Task:
    return Task(seq, TaskKind.H2D, src=list(range(ids)), dst=list(range(ids, 2 * ids)))


def measure(
    system: System, ids: int, n: int, budget_s: float, seq: Callable[[], int]
) -> tuple[list[float], int]:
    """Up to `n` round trips (at least 10, and no more once `budget_s` has passed) after a
    short warm-up; returns (latencies in us, CPU ns spent by all the system's processes)."""
    system.resume()
    time.sleep(0.02)
    task = make_task(0, ids)
    for _ in range(3):
        task.seq = seq()
        system.round_trip(task)
    pids = system.pids()
    lat: list[float] = []
    cpu0 = cpu_of(pids)
    stop_at = time.monotonic() + budget_s
    while len(lat) < n and (len(lat) < 10 or time.monotonic() < stop_at):
        task.seq = seq()
        t0 = time.perf_counter_ns()
        system.round_trip(task)
        lat.append((time.perf_counter_ns() - t0) / 1000)
    cpu = cpu_of(pids) - cpu0
    system.pause()
    return lat, cpu


def idle_cpu_pct(system: System, seconds: float) -> tuple[float, float]:
    """(% of one core used by the system's idle workers, by the bench process meanwhile)."""
    system.resume()
    time.sleep(0.2)
    workers = system.worker_pids()
    w0, m0, t0 = cpu_of(workers), cpu_ns(os.getpid()), time.monotonic_ns()
    time.sleep(seconds)
    wall = time.monotonic_ns() - t0
    w1, m1 = cpu_of(workers), cpu_ns(os.getpid())
    system.pause()
    return 100 * (w1 - w0) / wall, 100 * (m1 - m0) / wall


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(rounds: int, round_trips: int, budget_s: float, idle_seconds: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    counter = iter(range(1, 1 << 40))
    systems: list[System] = []
    try:
        systems = [Kvtier(ctx, arrays=True), Kvtier(ctx, arrays=False), RawQueues(ctx)]
        systems += [ManagersQueue(ctx), EngineCacheQueue(ctx)]
        for s in systems:
            s.pause()
        lat: dict[tuple[str, int], list[float]] = {}
        cpu: dict[tuple[str, int], int] = {}
        for _ in range(rounds):
            for ids in SIZES:
                for s in systems:
                    values, spent = measure(s, ids, round_trips, budget_s, lambda: next(counter))
                    lat.setdefault((s.name, ids), []).extend(values)
                    cpu[(s.name, ids)] = cpu.get((s.name, ids), 0) + spent
        idle = {s.name: idle_cpu_pct(s, idle_seconds) for s in systems}
    finally:
        for s in systems:
            try:
                s.stop()
            except Exception as e:  # keep stopping the others; report what failed
                print(f"stopping {s.name}: {e!r}", file=sys.stderr)

    def figures(name: str, ids: int) -> dict[str, float]:
        values = lat[(name, ids)]
        return {
            "median_us": round(statistics.median(values), 1),
            "p99_us": round(percentile(values, 0.99), 1),
            "cpu_us_per_rt": round(cpu[(name, ids)] / 1000 / len(values), 1),
            "idle_cpu_pct": round(idle[name][0], 3),
            "round_trips": len(values),
        }

    results = []
    for ids in SIZES:
        ours = figures("kvtier", ids)
        mq = figures("managers_queue", ids)
        ecq = figures("enginecachequeue", ids)
        results.append(
            {
                "ids": ids,
                **ours,
                "idle_cpu_pct_manager": round(idle["kvtier"][1], 3),
                "ratio_vs_managers_queue": round(mq["median_us"] / ours["median_us"], 1),
                "ratio_vs_enginecachequeue": round(ecq["median_us"] / ours["median_us"], 1),
                "kvtier_list_ids": figures("kvtier_list_ids", ids),
                "raw_posix_mq": figures("raw_posix_mq", ids),
                "managers_queue": mq,
                "enginecachequeue": ecq,
            }
        )
    return {
        "results": results,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "targets": {
            "median_us_at_64_ids": TARGET_MEDIAN_US,
            "ratio_vs_managers_queue": TARGET_VS_MANAGERS,
            "ratio_vs_enginecachequeue": TARGET_VS_ECQ,
            "idle_cpu_pct": 2.0,
        },
    }


def print_table(report: dict[str, Any]) -> None:
    print(
        f"manager -> 2 workers -> manager round trips, {report['cpus']} CPUs, "
        f"{report['rounds']} interleaved rounds"
    )
    head = (
        f"{'ids':>5}  {'system':<17} {'median us':>10} {'p99 us':>9} {'cpu us/rt':>10} "
        f"{'idle cpu %':>10}"
    )
    print(head)
    for r in report["results"]:
        rows = [("kvtier", r)] + [
            (k, r[k])
            for k in ("kvtier_list_ids", "raw_posix_mq", "managers_queue", "enginecachequeue")
        ]
        for name, f in rows:
            print(
                f"{r['ids']:>5}  {name:<17} {f['median_us']:>10.1f} {f['p99_us']:>9.1f} "
                f"{f['cpu_us_per_rt']:>10.1f} {f['idle_cpu_pct']:>10.3f}"
            )
        print(
            f"       kvtier is {r['ratio_vs_managers_queue']:.1f}x faster than the managers "
            f"queue (target >= {TARGET_VS_MANAGERS:.0f}x) and "
            f"{r['ratio_vs_enginecachequeue']:.1f}x faster than the EngineCacheQueue pattern "
            f"(target >= {TARGET_VS_ECQ:.0f}x)"
        )
    first = report["results"][0]
    print(
        f"median at 64 ids {first['median_us']:.1f} us (target <= {TARGET_MEDIAN_US:.0f}); "
        f"idle CPU of the 2 kvtier workers {first['idle_cpu_pct']:.3f}% of a core, of the "
        f"manager process {first['idle_cpu_pct_manager']:.3f}% (target < 2%)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--round-trips", type=int, default=2000, help="round trips per phase, at most (2000)"
    )
    parser.add_argument(
        "--phase-seconds",
        type=float,
        default=0.5,
        help="a phase stops early after this long (at least 10 round trips; default 0.5)",
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=3.0, help="idle CPU window per system (default 3)"
    )
    args = parser.parse_args(argv)
    if min(args.rounds, args.round_trips) < 1 or min(args.idle_seconds, args.phase_seconds) <= 0:
        parser.error("--rounds, --round-trips, --phase-seconds, --idle-seconds must be > 0")
    report = run(args.rounds, args.round_trips, args.phase_seconds, args.idle_seconds)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
