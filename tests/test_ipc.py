"""The wire format and the manager <-> worker transport, with real worker processes.

Workers are this file run as a script (`python tests/test_ipc.py worker DEPLOYMENT RANK
MODE`), so every test crosses real process boundaries, real POSIX queues under the kernel's
default limits, and real shared memory. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.worker.ipc import (
    DeploymentInUse,
    IPCError,
    LayerWaitTimeout,
    ManagerGone,
    ManagerIPC,
    SendTimeout,
    TaskAborted,
    TreeStatus,
    WorkerIPC,
    cleanup_stale,
    existing_names,
    ipc_names,
    validate_deployment_id,
)
from kvtier.worker.wire import (
    SEQ_LIMIT,
    WIRE_VERSION,
    ArenaRef,
    Completion,
    MessageType,
    Reassembler,
    Task,
    TaskKind,
    decode_arena_ref,
    decode_completion,
    decode_fragment,
    decode_task,
    encode_arena_ref,
    encode_completion,
    encode_fragments,
    encode_task,
    message_type,
)
from support import examples, new_deployment_id

pytestmark = pytest.mark.fast

HERE = os.path.abspath(__file__)
I64 = st.integers(-(2**63), 2**63 - 1)


# --------------------------------------------------------------------------- worker processes


def _answer(ipc: WorkerIPC, task: Task, mode: str) -> Completion:
    """What the test worker does with one task (see the modes in _worker_main)."""
    if task.kind == TaskKind.H2D and mode.startswith(("layers", "fail")):
        _, layers, delay = mode.split(":")
        for layer in range(int(layers)):
            time.sleep(float(delay))
            if mode.startswith("fail"):
                return Completion(task.seq, ipc.rank, False, error="copy failed on purpose")
            ipc.publish_layers_done(task.seq, layer + 1)
        return Completion(task.seq, ipc.rank, True)
    if task.kind == TaskKind.CHECK:
        ipc.set_inflight(7)
        flags = [int(ipc.paused), int(ipc.tree_status)]
        return Completion(task.seq, ipc.rank, True, result=1, detail=flags + list(task.src))
    digest = zlib.crc32(b"".join(task.keys))
    detail = [int(sum(task.src)) % (1 << 61), int(sum(task.dst)) % (1 << 61), len(task.keys)]
    return Completion(task.seq, ipc.rank, True, result=len(task.src), detail=[*detail, digest])


def _worker_main(deployment_id: str, rank: int, mode: str, manager_timeout: float) -> int:
    """Worker loop. Modes: `echo` (answer with checksums of the ids and keys), `layers:N:S`
    (H2D tasks publish N layers, one every S seconds), `fail:N:S` (H2D fails after S s).
    CHECK tasks answer the shared flags followed by the src ids. CLEAR ends the loop;
    exit code 3 means the worker noticed the manager was gone."""
    ipc = WorkerIPC(deployment_id, rank, manager_timeout=manager_timeout)
    ipc.set_ready()
    try:
        while True:
            task = ipc.recv_task(0.2)
            if task is None:
                continue
            if task.kind == TaskKind.CLEAR:
                return 0
            ipc.post_completion(_answer(ipc, task, mode))
    except ManagerGone as e:
        print(e, file=sys.stderr)
        return 3
    finally:
        ipc.close()


def _manager_main(deployment_id: str, num_ranks: int) -> int:
    """A manager that only lives (its heartbeat threads run) until it is killed; prints
    `ready` once created and `workers-ready` once every rank has attached."""
    ipc = ManagerIPC(deployment_id, num_ranks)
    print("ready", flush=True)
    try:
        ipc.wait_ready(30)
        print("workers-ready", flush=True)
        time.sleep(60)
    finally:
        ipc.close()
    return 0


def spawn_workers(
    deployment_id: str, ranks: range | list[int], mode: str = "echo", manager_timeout: float = 3.0
) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(
            [sys.executable, HERE, "worker", deployment_id, str(r), mode, str(manager_timeout)]
        )
        for r in ranks
    ]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


@pytest.fixture
def dep() -> Iterator[str]:
    """A fresh deployment id; nothing of it may be left afterwards."""
    deployment_id = new_deployment_id("ipc")
    yield deployment_id
    left = existing_names(deployment_id, 8)
    cleanup_stale(deployment_id, 8)
    assert left == [], f"IPC names left behind: {left}"


def collect(mgr: ManagerIPC, count: int, timeout: float = 10.0) -> list[Completion]:
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        c = mgr.recv_completion(max(0.0, deadline - time.monotonic()))
        assert c is not None, f"only {len(out)} of {count} completions within {timeout}s"
        out.append(c)
    return sorted(out, key=lambda c: (c.seq, c.rank))


# --------------------------------------------------------------------------- wire format


tasks = st.builds(
    Task,
    seq=st.integers(0, SEQ_LIMIT - 1),
    kind=st.sampled_from(TaskKind),
    src=st.lists(I64, max_size=40),
    dst=st.lists(I64, max_size=40),
    keys=st.one_of(
        st.lists(st.binary(min_size=32, max_size=32), max_size=20),
        st.lists(st.binary(max_size=70), max_size=20),
    ),
    priority=st.integers(-(2**31), 2**31 - 1),
)
completions = st.builds(
    Completion,
    seq=st.integers(0, SEQ_LIMIT - 1),
    rank=st.integers(0, 2**32 - 1),
    ok=st.booleans(),
    result=I64,
    detail=st.lists(I64, max_size=40),
    error=st.text(max_size=60),
)


@given(tasks)
def test_task_round_trip(task: Task) -> None:
    msg = encode_task(task)
    assert message_type(msg) == MessageType.TASK
    back = decode_task(msg)
    assert back == task
    assert back.src == task.src and back.dst == task.dst and back.keys == task.keys
    arrays = decode_task(memoryview(msg), ids_as_arrays=True)
    assert arrays == task
    assert arrays.src.dtype == np.int64 and not arrays.src.flags.writeable


@given(completions)
def test_completion_round_trip(completion: Completion) -> None:
    assert decode_completion(encode_completion(completion)) == completion


def test_numpy_ids_encode_like_lists() -> None:
    ids = np.arange(100, dtype=np.uint32)
    assert encode_task(Task(3, TaskKind.D2H, ids, ids)) == encode_task(
        Task(3, TaskKind.D2H, list(range(100)), list(range(100)))
    )


@given(st.binary(max_size=20000), st.integers(0, 2**32 - 1), st.integers(0, 2**40))
@settings(max_examples=examples(50))
def test_fragments_round_trip(message: bytes, sender: int, seq: int) -> None:
    parts = encode_fragments(message, sender=sender, seq=seq, max_size=1000)
    assert all(len(p) <= 1000 for p in parts)
    r = Reassembler()
    out = [r.add(decode_fragment(p)) for p in parts]
    assert out[:-1] == [None] * (len(parts) - 1) and out[-1] == message
    assert r.pending() == 0


def test_reassembler_rejects_out_of_order_parts() -> None:
    parts = encode_fragments(b"x" * 5000, sender=1, seq=9, max_size=1000)
    r = Reassembler()
    r.add(decode_fragment(parts[0]))
    with pytest.raises(ValueError, match="sender=1 seq=9: got part 2 of 6, expected part 1"):
        r.add(decode_fragment(parts[2]))
    assert r.pending() == 0
    r.add(decode_fragment(parts[0]))
    assert r.discard(1) == 1


def test_arena_ref_round_trip() -> None:
    ref = ArenaRef(seq=7, offset=4096, length=123456, end=1 << 40)
    assert decode_arena_ref(encode_arena_ref(ref)) == ref


def _valid_messages() -> list[tuple[bytes, object]]:
    task = Task(5, TaskKind.BACKUP, [1, 2, 3], [4, 5], [b"a" * 32, b"b" * 32], priority=3)
    varkeys = Task(6, TaskKind.QUERY, keys=[b"k", b"longer key", b""])
    return [
        (encode_task(task), decode_task),
        (encode_task(varkeys), decode_task),
        (encode_completion(Completion(5, 1, False, 3, [9, 8], "disk full")), decode_completion),
        (encode_arena_ref(ArenaRef(5, 0, 100, 100)), decode_arena_ref),
        (encode_fragments(b"payload" * 10, sender=0, seq=5, max_size=64)[0], decode_fragment),
    ]


def test_truncated_or_padded_messages_raise_value_error() -> None:
    for msg, decode in _valid_messages():
        decode(msg)
        for cut in range(len(msg)):
            with pytest.raises(ValueError):
                decode(msg[:cut])
        with pytest.raises(ValueError):
            decode(msg + b"\0")


def test_malformed_heads_are_named() -> None:
    msg = bytearray(encode_task(Task(5, TaskKind.H2D, [1], [2])))
    with pytest.raises(ValueError, match=f"wire version 9, expected {WIRE_VERSION}"):
        decode_task(bytes([9]) + bytes(msg[1:]))
    with pytest.raises(ValueError, match="type byte 2, expected 1"):
        decode_task(bytes(msg[:1]) + bytes([2]) + bytes(msg[2:]))
    msg[2] = 99
    with pytest.raises(ValueError, match="unknown task kind 99"):
        decode_task(bytes(msg))
    with pytest.raises(ValueError, match="unknown type byte 77"):
        message_type(bytes([WIRE_VERSION, 77]))
    with pytest.raises(ValueError, match="0 bytes: too short"):
        message_type(b"")
    bad_ok = bytearray(encode_completion(Completion(1, 0, True)))
    bad_ok[2] = 5
    with pytest.raises(ValueError, match="ok byte is 5"):
        decode_completion(bytes(bad_ok))


@given(st.binary(max_size=200))
@settings(max_examples=examples(300))
def test_random_bytes_never_crash_decoders(data: bytes) -> None:
    for decode in (decode_task, decode_completion, decode_arena_ref, decode_fragment):
        with contextlib.suppress(ValueError):
            decode(data)


@pytest.mark.parametrize(
    ("task", "match"),
    [
        (Task(-1, TaskKind.D2H), r"seq -1 out of range"),
        (Task(SEQ_LIMIT, TaskKind.D2H), r"out of range \[0, 2\*\*47\)"),
        (Task(1, 42), r"task seq=1: unknown task kind 42"),  # type: ignore[arg-type]
        (Task(1, TaskKind.D2H, priority=1 << 40), r"priority \d+ does not fit in int32"),
        (Task(1, TaskKind.D2H, src=[1, 2.5]), r"task seq=1 src: id 1 must be an integer"),
        (Task(1, TaskKind.D2H, dst=[1 << 63]), r"task seq=1 dst: id 0 = \d+ does not fit"),
        (Task(1, TaskKind.D2H, src=np.zeros((2, 2), np.int64)), r"one-dimensional"),
        (Task(1, TaskKind.D2H, src=np.zeros(2)), r"must be integers, got dtype float64"),
        (Task(1, TaskKind.FILL, keys=[b"ok", "str"]), r"keys: key 1 must be bytes"),  # type: ignore[list-item]
        (Task(1, TaskKind.FILL, keys=[b"x" * 70000]), r"key 0 is 70000 bytes"),
    ],
)
def test_bad_tasks_are_refused_with_the_field_named(task: Task, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_task(task)


def test_bad_completions_are_refused() -> None:
    with pytest.raises(ValueError, match="rank must be a non-negative int"):
        encode_completion(Completion(1, -1, True))
    with pytest.raises(ValueError, match=r"result \d+ does not fit in int64"):
        encode_completion(Completion(1, 0, True, result=1 << 64))
    with pytest.raises(ValueError, match="detail: id 0 must be an integer"):
        encode_completion(Completion(1, 0, True, detail=["x"]))  # type: ignore[list-item]


# --------------------------------------------------------------------------- names and modes


def test_deployment_ids_are_validated() -> None:
    assert validate_deployment_id("prod-A_1") == "prod-A_1"
    for bad in ("", "x" * 33, "a/b", "a b", "ü", None):
        with pytest.raises(ValueError, match=r"deployment_id .* is invalid"):
            validate_deployment_id(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_ranks 0 out of range"):
        ipc_names("ok", 0)


def test_names_are_0600_and_unlink_leaves_nothing(dep: str) -> None:
    mgr = ManagerIPC(dep, 2)
    names = mgr.names
    assert sorted(existing_names(dep, 8)) == sorted(names.all())
    for seg in names.segments:
        assert os.stat(f"/dev/shm{seg}").st_mode & 0o777 == 0o600
    for sem in names.semaphores:
        assert os.stat(f"/dev/shm/sem.{sem[1:]}").st_mode & 0o777 == 0o600
    for qname in names.queues:
        q = posix_ipc.MessageQueue(qname)
        try:
            assert os.fstat(q.mqd).st_mode & 0o777 == 0o600
            assert q.max_messages <= 10 and q.max_message_size <= 8192  # kernel defaults
        finally:
            q.close()
    assert mgr.unlink_all() == names.all()
    assert mgr.unlink_all() == []  # idempotent
    mgr.close()
    mgr.close()
    assert existing_names(dep, 8) == []
    assert not [f for f in os.listdir("/dev/shm") if f"kvtier_{dep}_" in f]
    for qname in names.queues:
        with pytest.raises(posix_ipc.ExistentialError):
            posix_ipc.MessageQueue(qname)


def test_stale_names_of_the_same_id_are_removed(dep: str) -> None:
    stale = ipc_names(dep, 5)
    posix_ipc.SharedMemory(stale.control, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    posix_ipc.Semaphore(stale.notify, posix_ipc.O_CREX, mode=0o600).close()
    posix_ipc.MessageQueue(stale.tasks[4], posix_ipc.O_CREX, max_messages=2,
                           max_message_size=64).close()  # fmt: skip
    assert sorted(existing_names(dep, 8)) == sorted([stale.control, stale.notify, stale.tasks[4]])
    with ManagerIPC(dep, 2) as mgr:  # a 2-rank deployment also removes the old rank 4 queue
        assert stale.tasks[4] not in existing_names(dep, 8)
        assert mgr.num_ranks == 2
    assert existing_names(dep, 8) == []
    posix_ipc.Semaphore(stale.notify, posix_ipc.O_CREX, mode=0o600).close()
    assert cleanup_stale(dep) == [stale.notify]


def test_a_live_deployment_is_not_taken_over(dep: str) -> None:
    with ManagerIPC(dep, 1), pytest.raises(DeploymentInUse, match="already open in this"):
        ManagerIPC(dep, 1)
    other = subprocess.Popen(
        [sys.executable, HERE, "manager", dep, "1"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
        with pytest.raises(DeploymentInUse, match=f"in use by manager pid {other.pid}"):
            ManagerIPC(dep, 1)
    finally:
        other.terminate()
        other.wait(timeout=10)
        cleanup_stale(dep, 8)


def test_worker_attach_errors_are_clear(dep: str) -> None:
    with pytest.raises(IPCError, match=f"deployment '{dep}': no manager is running"):
        WorkerIPC(dep, 0)
    with ManagerIPC(dep, 2), pytest.raises(ValueError, match="rank 2 out of range"):
        WorkerIPC(dep, 2)


# --------------------------------------------------------------------------- real processes


def test_flags_and_large_completions_cross_processes(dep: str) -> None:
    with ManagerIPC(dep, 2) as mgr:
        procs = spawn_workers(dep, range(2))
        try:
            mgr.wait_ready(20)
            assert [s.pid for s in mgr.ranks()] == [p.pid for p in procs]
            mgr.paused = True
            mgr.tree_status = TreeStatus.CLEARING
            ids = list(range(10_000))  # 80 KB of detail: split into fragments
            mgr.send_task(Task(1, TaskKind.CHECK, src=ids))
            for c in collect(mgr, 2):
                assert c.ok and c.detail[:2] == [1, int(TreeStatus.CLEARING)]
                assert c.detail[2:] == ids
            assert [s.tasks_inflight for s in mgr.ranks()] == [7, 7]
            assert all(s.ready and s.alive and s.tasks_received == 1 for s in mgr.ranks())
            mgr.send_task(Task(2, TaskKind.CLEAR))
            assert [p.wait(timeout=10) for p in procs] == [0, 0]
            assert not any(s.ready for s in mgr.ranks())
        finally:
            stop(procs)


@pytest.mark.slow  # 24 tasks of 10,000 ids and keys each, through two worker processes
def test_ten_thousand_ids_and_keys_under_default_queue_limits(dep: str) -> None:
    rng = np.random.default_rng(7)
    # a 1 MiB arena holds two 480 KB tasks: 12 of them in a row wrap it and reuse it
    with ManagerIPC(dep, 2, arena_bytes=1 << 20) as mgr:
        procs = spawn_workers(dep, range(2))
        try:
            mgr.wait_ready(20)
            expected = {}
            for seq in range(1, 13):
                src = rng.integers(0, 1 << 40, 10_000).tolist()
                dst = rng.integers(0, 1 << 40, 10_000).tolist()
                keys = [rng.bytes(32) for _ in range(10_000)]
                mgr.send_task(Task(seq, TaskKind.BACKUP, src, dst, keys), timeout=10)
                expected[seq] = [
                    sum(src) % (1 << 61),
                    sum(dst) % (1 << 61),
                    10_000,
                    zlib.crc32(b"".join(keys)),
                ]
            for c in collect(mgr, 24, timeout=30):
                assert c.ok and c.result == 10_000 and c.detail == expected[c.seq], c
            assert mgr.stats()["tasks_via_arena"] == 12
            assert mgr.arena_bytes_in_use() == 0
            with pytest.raises(ValueError, match="more than the id arena"):
                mgr.send_task(Task(99, TaskKind.D2H, list(range(70_000)), list(range(70_000))))
            mgr.send_task(Task(100, TaskKind.CLEAR))
            assert [p.wait(timeout=10) for p in procs] == [0, 0]
        finally:
            stop(procs)


@pytest.mark.slow  # four 0.3 s layers, waited out on purpose
def test_layer_waiter_is_released_layer_by_layer(dep: str) -> None:
    with ManagerIPC(dep, 2) as mgr:
        procs = spawn_workers(dep, range(2), mode="layers:4:0.3")
        try:
            mgr.wait_ready(20)
            t0 = time.monotonic()
            mgr.send_task(Task(11, TaskKind.H2D, [1, 2], [3, 4]))
            mgr.wait_layer(11, 0, timeout=10)
            first = time.monotonic() - t0
            progress = mgr.layers_done(11)
            assert all(n is not None and 1 <= n < 4 for n in progress), progress
            mgr.wait_layer(11, 3, timeout=10)
            last = time.monotonic() - t0
            assert mgr.layers_done(11) == [4, 4]
            assert 0.25 < first < 0.6, first  # released right after layer 0, not at the end
            assert last > first + 0.6, (first, last)
            assert [c.ok for c in collect(mgr, 2)] == [True, True]
            mgr.wait_layer(11, 2, timeout=0)  # done layers return at once, even at timeout 0
            mgr.send_task(Task(12, TaskKind.CLEAR))
        finally:
            stop(procs)


@pytest.mark.slow  # waits out a layer timeout and a full queue's send timeout
def test_layer_wait_and_send_name_a_killed_rank(dep: str) -> None:
    with ManagerIPC(dep, 2, send_timeout=0.5) as mgr:
        procs = spawn_workers(dep, range(2), mode="layers:2:0")
        try:
            mgr.wait_ready(20)
            procs[1].kill()
            procs[1].wait(timeout=10)
            mgr.send_task(Task(21, TaskKind.H2D, [1], [2]))
            t0 = time.monotonic()
            with pytest.raises(LayerWaitTimeout) as info:
                mgr.wait_layer(21, 1, timeout=1.0)
            assert 0.9 < time.monotonic() - t0 < 3.0
            assert info.value.ranks == [1]
            assert f"rank 1: worker pid {procs[1].pid} is not running" in str(info.value)
            assert mgr.layers_done(21)[0] == 2
            # the dead rank's queue fills up; the send gives up and names it
            for seq in range(22, 31):
                mgr.send_task(Task(seq, TaskKind.D2H, [1], [2]))
            with pytest.raises(SendTimeout, match="task queue of rank 1 stayed full") as sent:
                mgr.send_task(Task(31, TaskKind.D2H, [1], [2]))
            assert sent.value.rank == 1 and sent.value.delivered == [0]
            # a replacement worker starts clean: nothing stale queued for it
            assert mgr.reset_rank(1) == 10
            procs.append(*spawn_workers(dep, [1], mode="layers:2:0"))
            mgr.wait_ready(20)
            mgr.send_task(Task(40, TaskKind.H2D, [1], [2]))
            mgr.wait_layer(40, 1, timeout=10)
            mgr.send_task(Task(41, TaskKind.CLEAR))
        finally:
            stop(procs)


def test_a_failed_load_aborts_its_layer_waiters(dep: str) -> None:
    with ManagerIPC(dep, 1) as mgr:
        procs = spawn_workers(dep, [0], mode="fail:4:0.2")
        try:
            mgr.wait_ready(20)
            mgr.send_task(Task(50, TaskKind.H2D, [1], [2]))
            t0 = time.monotonic()
            with pytest.raises(TaskAborted, match="rank 0: copy failed on purpose"):
                mgr.wait_layer(50, 0, timeout=10)
            assert time.monotonic() - t0 < 2.0
            mgr.send_task(Task(51, TaskKind.CLEAR))
        finally:
            stop(procs)


def test_wait_ready_names_missing_ranks(dep: str) -> None:
    with ManagerIPC(dep, 2) as mgr:
        with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] not ready after 0.2s"):
            mgr.wait_ready(0.2)
        assert "no worker attached" in mgr.rank_state(0).describe()


def _start_manager(dep: str, ranks: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, HERE, "manager", dep, str(ranks)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def _await_workers(manager: subprocess.Popen) -> None:
    assert manager.stdout is not None and manager.stdout.readline().strip() == "workers-ready"


@pytest.mark.slow  # waits out two heartbeat timeouts
def test_workers_exit_when_the_manager_heartbeat_stops(dep: str) -> None:
    manager = _start_manager(dep, 2)
    procs = spawn_workers(dep, range(2), manager_timeout=1.5)
    try:
        _await_workers(manager)
        time.sleep(2.0)  # longer than manager_timeout: a beating manager keeps its workers
        assert [p.poll() for p in procs] == [None, None]
        os.kill(manager.pid, signal.SIGSTOP)  # alive but silent
        t0 = time.monotonic()
        codes = [p.wait(timeout=10) for p in procs]
        assert codes == [3, 3]
        assert time.monotonic() - t0 < 3.5
        assert existing_names(dep, 8) != []  # a stalled manager's names are not pulled away
    finally:
        os.kill(manager.pid, signal.SIGCONT)
        manager.kill()
        manager.wait(timeout=10)
        stop(procs)
        cleanup_stale(dep, 8)


@pytest.mark.slow  # a manager process and two workers, waited out until they notice
def test_workers_exit_and_clean_up_when_the_manager_is_killed(dep: str) -> None:
    manager = _start_manager(dep, 2)
    procs = spawn_workers(dep, range(2))
    try:
        _await_workers(manager)
        manager.kill()
        manager.wait(timeout=10)
        t0 = time.monotonic()
        assert [p.wait(timeout=10) for p in procs] == [3, 3]
        assert time.monotonic() - t0 < 2.0
        assert existing_names(dep, 8) == []  # the orphaned deployment removed itself
    finally:
        manager.kill()
        manager.wait(timeout=10)
        stop(procs)


if __name__ == "__main__":
    role, deployment_id, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    if role == "manager":
        sys.exit(_manager_main(deployment_id, int(arg)))
    sys.exit(_worker_main(deployment_id, int(arg), sys.argv[4], float(sys.argv[5])))


def test_storage_figures_are_published_per_rank(dep: str) -> None:
    """A rank's backend figures cross the control segment; a figure its backend does not
    report (or a rank that never published) reads as absent, never as zero."""
    with ManagerIPC(dep, 2) as mgr:
        assert [mgr.storage_figures(r) for r in range(2)] == [{}, {}]
        worker = WorkerIPC(dep, 1)
        try:
            worker.publish_storage_figures({"corrupt_pages": 3, "misses": 5.0, "outages": 1,
                                            "available": 0, "pages_read": 99})
            assert mgr.storage_figures(1) == {"corrupt_pages": 3, "misses": 5, "outages": 1,
                                              "available": 0}
            assert mgr.storage_figures(0) == {}
            worker.publish_storage_figures({"used_bytes": 1 << 40})
            assert mgr.storage_figures(1) == {"used_bytes": 1 << 40}
        finally:
            worker.close()
        with pytest.raises(ValueError, match="rank 2 out of range"):
            mgr.storage_figures(2)
