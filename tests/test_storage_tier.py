"""The storage tier end to end: real worker processes, real shared memory, a real file
directory and a real `redis-server`, with every served block checked byte for byte.

Each test plays the model runner (`storage_support.ModelRunner`): it FILLs newly computed
blocks on both ranks with bytes derived from the block's key and the rank, and CHECKs every
hit on the device of both ranks before trusting it. A block that went device -> host ->
storage -> host -> device and comes back with one wrong byte, or with the other rank's bytes,
fails the CHECK. A storage hit is always a *restored* block: the device and host tiers are
emptied with `Stack.reset()` (storage keeps its pages) or belong to another instance.

The KV shape is tiny (2 layers, 2 KV heads, head dim 8, block size 4: 512-byte pages), so
the time goes into process start-up and the storage round trips under test, not into bytes.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from kvtier.admin.metrics import StackCollector
from kvtier.manager.config import summary
from kvtier.manager.private_state import storage_secret
from kvtier.manager.replay import ReplayReport
from kvtier.manager.stack import Stack
from kvtier.worker.delays import PREFETCH_PAGE_DELAY_ENV, STORAGE_DELAY_ENV
from kvtier.worker.storage import HEADER_BYTES
from kvtier.worker.storage.page_crypto import TAG_BYTES
from kvtier.worker.storage.redis_backend import RedisBackend
from redis_server import RedisServer, ping
from storage_support import (
    BS,
    NUM_KV_HEADS,
    NUM_LAYERS,
    RANKS,
    THRESHOLD_TOKENS,
    WAIT_S,
    ModelRunner,
    RequestOutcome,
    namespaces,
    page_file,
    page_keys,
    prompt,
    redis_key,
    replay_in_thread,
    small_chat,
    stack_config,
    storage_counters,
    wait_backups,
)
from support import clean_env, leftovers, module_command, new_deployment_id, wait_until

# real worker processes, redis-server and a Redis Cluster
pytestmark = [pytest.mark.fast, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
BLOCKS = 16  # blocks of a test prompt
PAGE_BYTES = NUM_LAYERS * 2 * NUM_KV_HEADS * 8 * BS * 2  # layers x K/V x heads x dim x bs x fp16

StackFactory = Callable[..., Stack]


# ---------------------------------------------------------------------- fixtures


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The module's Redis, emptied: pages of one test never serve another (every instance
    of this model shape shares one namespace, on purpose)."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(params=["redis", "redis-cluster"])
def shared_url(request: pytest.FixtureRequest) -> str:
    """One Redis server, or a 3-node Redis Cluster, emptied: what several nodes share."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_url"))
    cluster = request.getfixturevalue("redis_cluster")
    flusher = RedisBackend(cluster.url, "flush", secret=b"flush-only-no-pages-read")
    flusher.client.flushall()  # every primary
    return str(cluster.url)


@pytest.fixture
def make_stack(tmp_path: Path) -> Iterator[StackFactory]:
    """Starts stacks (tiny shape, 2 ranks, storage under tmp_path unless given); closes them
    all at the end and checks that none left anything in /dev/shm or the queue namespace."""
    made: list[tuple[Stack, str]] = []

    def factory(tag: str, *, storage_dir: Path | None = None, **kw: object) -> Stack:
        dep = new_deployment_id(tag)
        cfg = stack_config(dep, storage_dir or tmp_path / "storage", **kw)  # type: ignore[arg-type]
        stack = Stack(cfg, log_dir=str(tmp_path / f"logs-{dep}"), transfer_timeout_s=20.0)
        made.append((stack, dep))
        return stack.start()

    yield factory
    for stack, _ in made:
        stack.close()
    for _, dep in made:
        assert leftovers(dep, RANKS) == [], f"deployment {dep} left IPC objects behind"


@dataclass
class OneInstance:
    """A running stack on one backend, shared by the single-instance tests of that backend
    (starting worker processes is most of a test's time); each test starts it empty."""

    backend: str
    stack: Stack
    url: str | None  # the Redis URL (redis backend)
    log_dir: Path


@pytest.fixture(scope="module", params=["file", "redis"])
def one_instance_stack(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[OneInstance]:
    backend: str = request.param
    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    root = tmp_path_factory.mktemp(f"one-{backend}")
    dep = new_deployment_id(f"one-{backend}")
    stack = Stack(stack_config(dep, root / "storage", backend=backend, url=url),
                  log_dir=str(root / "logs"), transfer_timeout_s=20.0)
    try:
        yield OneInstance(backend, stack.start(), url, root / "logs")
    finally:
        stack.close()
    assert leftovers(dep, RANKS) == [], f"deployment {dep} left IPC objects behind"


@pytest.fixture
def one(one_instance_stack: OneInstance) -> OneInstance:
    """The backend's shared stack, emptied: no cached block, no stored page (the admin's
    `POST /reset?storage=true`), nothing in flight."""
    stack = one_instance_stack.stack
    stack.reset(storage=True)
    assert stack.status()["tiers"]["device"]["cached"] == 0
    return one_instance_stack


def _close_and_check(stack: Stack) -> None:
    dep = stack.cfg.deployment_id
    stack.close()
    assert leftovers(dep, RANKS) == []


def _assert_restored(outcome: RequestOutcome, blocks: int) -> None:
    """Every one of `blocks` blocks came from storage and held exactly its bytes."""
    mr = outcome.match
    assert (mr.device_tokens, mr.host_tokens, mr.storage_tokens) == (0, 0, blocks * BS), mr
    assert outcome.checked_blocks == blocks
    assert outcome.corrupt_blocks == []


# ---------------------------------------------------------------------- 1. round trip


def test_round_trip_device_host_storage_and_back_is_byte_exact(one: OneInstance) -> None:
    backend, stack, url = one.backend, one.stack, one.url
    m = stack.require_manager()
    runner = ModelRunner(stack)
    c0 = storage_counters(stack)
    hits0 = m.stats()["counters"]["hit_storage_tokens"]  # type: ignore[index]
    prompts = [prompt(100 + i, BLOCKS) for i in range(3)]

    for p in prompts:  # computed: FILLed on both ranks, committed, written through
        first = runner.run(p)
        assert first.match.num_tokens == 0
    wait_backups(stack, c0["backup_pages"] + len(prompts) * BLOCKS)
    m.check_invariants()

    # Both ranks wrote their own page of every block.
    keys = [k for p in prompts for k in page_keys(p)]
    assert len(set(namespaces(stack))) == RANKS
    if backend == "file":
        for rank in range(RANKS):
            sizes = {page_file(stack, rank, k).stat().st_size for k in keys}
            assert sizes == {HEADER_BYTES + PAGE_BYTES + TAG_BYTES}  # encrypted: + GCM tag
        assert (page_file(stack, 0, keys[0]).read_bytes()[HEADER_BYTES:]
                != page_file(stack, 1, keys[0]).read_bytes()[HEADER_BYTES:])
    else:
        r = redis.Redis.from_url(url)  # type: ignore[arg-type]
        for rank in range(RANKS):
            assert all(r.strlen(redis_key(stack, rank, k))
                       == HEADER_BYTES + PAGE_BYTES + TAG_BYTES for k in keys)

    cleared = stack.reset()
    assert cleared["device_blocks"] == cleared["host_blocks"] == len(prompts) * BLOCKS
    st = stack.status()["tiers"]
    assert st["device"]["cached"] == st["host"]["cached"] == 0

    for p in prompts:
        _assert_restored(runner.run(p), BLOCKS)
    c = {k: v - c0[k] for k, v in storage_counters(stack).items()}
    assert c["prefetch_pages_completed"] == c["prefetch_pages_issued"] == len(prompts) * BLOCKS
    assert c["prefetch_pages_revoked"] == 0
    hits = m.stats()["counters"]["hit_storage_tokens"] - hits0  # type: ignore[index]
    assert hits == len(prompts) * BLOCKS * BS

    # The CHECK can fail: the restored blocks do not hold another prompt's bytes.
    last = runner.run(prompts[0], compute=False)
    assert last.match.device_tokens == BLOCKS * BS
    assert runner.check(prompt(999, BLOCKS), last.match.block_ids) == list(range(BLOCKS))

    # Clearing storage (with the tiers) leaves nothing to restore.
    cleared = stack.reset(storage=True)
    assert cleared["storage_pages"] == RANKS * len(prompts) * BLOCKS
    assert runner.run(prompts[1], compute=False).match.num_tokens == 0
    m.check_invariants()


# ---------------------------------------------------------------------- 2. two instances


def test_second_instance_hits_prefixes_the_first_computed(
        make_stack: StackFactory, shared_url: str, tmp_path: Path) -> None:
    a = make_stack("share-a", backend="redis", url=shared_url, storage_dir=tmp_path / "a")
    b = make_stack("share-b", backend="redis", url=shared_url, storage_dir=tmp_path / "b")
    run_a, run_b = ModelRunner(a), ModelRunner(b)
    shared = [prompt(200 + i, BLOCKS) for i in range(2)]
    for p in shared:
        assert run_a.run(p).match.num_tokens == 0
    wait_backups(a, len(shared) * BLOCKS)

    # B never computed these prompts: every block is a storage hit with A's bytes.
    for p in shared:
        _assert_restored(run_b.run(p), BLOCKS)
    # A longer prompt: A's prefix from storage, B computes (and backs up) the rest.
    longer = shared[0][:-1] + prompt(250, 8)
    assert longer[:BLOCKS * BS] == shared[0][:BLOCKS * BS]
    out = run_b.run(longer)
    assert out.corrupt_blocks == []
    assert out.match.device_tokens == BLOCKS * BS  # B's own device copy from the first run
    # A prompt nobody computed is a miss everywhere.
    assert run_b.run(prompt(299, BLOCKS)).match.num_tokens == 0

    # And back: A gets the tail B computed, from storage, byte for byte. (B backed up what
    # it computed: the 8 new blocks of `longer` and the 16 of the missed prompt.)
    wait_backups(b, 8 + BLOCKS)
    a.reset()
    _assert_restored(run_a.run(longer, compute=False), BLOCKS + 8)
    assert storage_counters(b)["prefetch_pages_completed"] == len(shared) * BLOCKS
    a.require_manager().check_invariants()
    b.require_manager().check_invariants()


def test_models_of_one_shape_share_pages_only_under_one_name(
        make_stack: StackFactory, redis_url: str, tmp_path: Path) -> None:
    """`model.name` is part of the namespace: a second model with the same KV shape misses
    what the first stored (same tokens, other weights: other bytes), while the same name on
    another instance, or no name on either, shares pages."""
    a = make_stack("name-a", backend="redis", url=redis_url, storage_dir=tmp_path / "a",
                   extra={"KVTIER_MODEL__NAME": "model-a@rev1"})
    b = make_stack("name-b", backend="redis", url=redis_url, storage_dir=tmp_path / "b",
                   extra={"KVTIER_MODEL__NAME": "model-b@rev1"})
    p = prompt(260, BLOCKS)
    assert ModelRunner(a).run(p).match.num_tokens == 0
    wait_backups(a, BLOCKS)
    out = ModelRunner(b).run(p)
    assert out.match.num_tokens == 0 and out.corrupt_blocks == []
    assert storage_counters(b)["prefetch_pages_completed"] == 0

    def namespaces(name: str) -> list[str]:
        cfg = stack_config("name-x", tmp_path / "x", backend="redis", url=redis_url,
                           extra={"KVTIER_MODEL__NAME": name} if name else None)
        return [Stack(cfg).worker_spec(r).storage_namespace() for r in range(RANKS)]

    assert namespaces("model-a@rev1") == [a.worker_spec(r).storage_namespace()
                                          for r in range(RANKS)]
    assert len({*namespaces("model-a@rev1"), *namespaces("model-b@rev1"),
                *namespaces("")}) == 3 * RANKS


# ---------------------------------------------------------------------- 3. corrupt pages


def test_storage_secret_is_not_in_status_logs_or_worker_command_line(one: OneInstance) -> None:
    """The workers hold the storage secret (their pages verify), but it is in no /status
    answer, no summary, no worker command line, no spec repr and no log line."""
    stack = one.stack
    s = stack.cfg.storage
    secret = storage_secret(s.secret.get_secret_value(), s.secret_file)
    hexed = secret.hex()
    spec = stack.worker_spec(0)
    assert spec.storage_secret == hexed and hexed not in repr(spec)
    status = json.dumps(stack.status(), default=str)
    assert hexed not in status and "storage_secret" not in status
    assert json.loads(status)["config"]["storage"]["secret_set"] is False  # the file's secret
    assert hexed not in json.dumps(summary(stack.cfg), default=str)
    assert stack.supervisor is not None
    pids = [w["pid"] for w in stack.supervisor.status()]
    assert len(pids) == RANKS and all(pids)
    for pid in pids:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert b"kvtier.worker.process" in cmdline
        assert hexed.encode() not in cmdline and secret not in cmdline
    for log in one.log_dir.glob("*"):
        if log.is_file():
            data = log.read_bytes()
            assert hexed.encode() not in data and secret not in data, log


def _flip_byte(stack: Stack, backend: str, url: str | None, rank: int, key: bytes) -> None:
    offset = HEADER_BYTES + PAGE_BYTES // 2  # inside the payload: only the GCM tag sees it
    if backend == "file":
        path = page_file(stack, rank, key)
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x5A
        path.write_bytes(bytes(data))
    else:
        r = redis.Redis.from_url(url)  # type: ignore[arg-type]
        name = redis_key(stack, rank, key)
        old = r.getrange(name, offset, offset)
        assert len(old) == 1
        r.setrange(name, offset, bytes([old[0] ^ 0x5A]))


def _truncate(stack: Stack, backend: str, url: str | None, rank: int, key: bytes) -> None:
    keep = HEADER_BYTES + PAGE_BYTES - 100
    if backend == "file":
        path = page_file(stack, rank, key)
        os.truncate(path, keep)
    else:
        r = redis.Redis.from_url(url)  # type: ignore[arg-type]
        name = redis_key(stack, rank, key)
        value = r.get(name)
        assert value is not None
        r.set(name, value[:keep])


def test_corrupt_or_truncated_page_is_a_counted_miss_never_data(one: OneInstance) -> None:
    backend, stack, url = one.backend, one.stack, one.url
    m = stack.require_manager()
    runner = ModelRunner(stack)
    c0 = storage_counters(stack)
    flipped, truncated, intact = (prompt(300 + i, BLOCKS) for i in range(3))
    for p in (flipped, truncated, intact):
        runner.run(p)
    wait_backups(stack, c0["backup_pages"] + 3 * BLOCKS)
    stack.reset()

    flip_at, cut_at = 5, 9
    sup = stack.supervisor
    assert sup is not None
    corrupt_before = [f["corrupt_pages"] for f in sup.storage_figures()]
    _flip_byte(stack, backend, url, 1, page_keys(flipped)[flip_at])
    _truncate(stack, backend, url, 0, page_keys(truncated)[cut_at])

    # A flipped payload byte: storage still lists the page, the read rejects it on rank 1,
    # so only the blocks before it are served (the minimum over ranks).
    before = storage_counters(stack)
    out = runner.run(flipped)
    assert out.match.storage_tokens == flip_at * BS
    assert out.checked_blocks == flip_at and out.corrupt_blocks == []
    c = storage_counters(stack)
    assert c["prefetch_pages_issued"] - before["prefetch_pages_issued"] == BLOCKS
    assert c["prefetch_pages_completed"] - before["prefetch_pages_completed"] == flip_at
    assert c["prefetch_pages_revoked"] - before["prefetch_pages_revoked"] == BLOCKS - flip_at

    # A truncated page: a miss at that block as well, refused on read (encrypted pages may
    # be shorter when compressed, so a short page file is no longer refused by the query:
    # its tag is what decides).
    before = storage_counters(stack)
    out = runner.run(truncated)
    assert out.match.storage_tokens == cut_at * BS
    assert out.checked_blocks == cut_at and out.corrupt_blocks == []
    c = storage_counters(stack)
    issued = c["prefetch_pages_issued"] - before["prefetch_pages_issued"]
    assert issued == BLOCKS
    assert c["prefetch_pages_completed"] - before["prefetch_pages_completed"] == cut_at

    # Damage is local: an intact prompt is served whole.
    _assert_restored(runner.run(intact), BLOCKS)

    # Counted by the backend of the rank that met it, published to the admin's metrics...
    corrupt = [f["corrupt_pages"] - b for f, b in zip(sup.storage_figures(), corrupt_before,
                                                      strict=True)]
    assert corrupt == [1, 1]  # the truncated page on rank 0, the flipped one on rank 1
    samples = {s.labels["rank"]: s.value for fam in StackCollector(stack).collect()
               if fam.name == "kvtier_storage_backend_corrupt_pages" for s in fam.samples
               if s.name.endswith("_total")}
    assert [samples["0"] - corrupt_before[0], samples["1"] - corrupt_before[1]] == [1, 1]
    # ...and dropped from storage (a page the backend deleted because it failed
    # verification, named in its log).
    log_dir = one.log_dir
    verb = "deleted" if backend == "file" else "dropped"
    rank1 = (log_dir / "worker-r1.log").read_text()
    assert (f"1 corrupt page(s) {verb} (first: key {page_keys(flipped)[flip_at].hex()[:16]}..., "
            "bad_tag)") in rank1, rank1
    rank0 = (log_dir / "worker-r0.log").read_text()
    cut_key = page_keys(truncated)[cut_at].hex()[:16]
    assert (f"1 corrupt page(s) {verb} (first: key {cut_key}..., truncated)") in rank0, rank0

    # The recomputed blocks were backed up again: storage heals and serves every block.
    wait_backups(stack, c0["backup_pages"] + 3 * BLOCKS + (BLOCKS - flip_at) + (BLOCKS - cut_at))
    stack.reset()
    for p in (flipped, truncated):
        _assert_restored(runner.run(p), BLOCKS)
    m.check_invariants()


# ---------------------------------------------------------------------- 4. Redis outage

OUTAGE_SIZES = {"KVTIER_CACHE__DEVICE_BLOCKS": "192", "KVTIER_CACHE__HOST_BLOCKS": "256"}
"""Small enough that the chat stream's history falls out of device and host, so storage
serves hits within one pass."""
RESUME_BOUND_S = 4.0 + 3.0  # the Redis backend's longest fail-fast window, plus margin
REQUEST_BOUND_S = 3.0  # a storage round trip times out after 0.5 s; nothing may wait longer
PASS_BOUND_S = 60.0


def _replay_bounded(stack: Stack, on_request: Callable[[int], None]) -> tuple[ReplayReport,
                                                                              list[float]]:
    """A verified replay of the small chat stream in a thread, bounded in wall time; returns
    the report and the seconds each request took."""
    stamps = [time.monotonic()]

    def progress(done: int, _total: int, _report: ReplayReport) -> None:
        stamps.append(time.monotonic())
        on_request(done)

    report = replay_in_thread(
        stack, progress, PASS_BOUND_S,
        lambda: f"replay hung: {len(stamps) - 1} requests done in {PASS_BOUND_S} s")
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return report, gaps


def test_redis_outage_during_replay_degrades_to_misses_and_recovers(
        make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVTIER_LOG_LEVEL", raising=False)  # the workers log at INFO
    server = RedisServer().start()  # its own server: this test stops and kills it
    try:
        stack = make_stack("outage", backend="redis", url=server.url, extra=OUTAGE_SIZES)
        sup = stack.supervisor
        assert sup is not None
        assert [f["outages"] for f in sup.storage_figures()] == [0] * RANKS
        pause_at, kill_at, settle = 90, 150, 8
        seen: dict[str, dict[str, int]] = {}

        def chaos(done: int) -> None:
            if done == pause_at:
                server.pause()  # accepts connections, answers nothing
            elif done == pause_at + settle:
                seen["paused"] = storage_counters(stack)
                seen["paused_figures"] = dict(enumerate(sup.storage_figures()))
            elif done == kill_at:
                seen["before_kill"] = storage_counters(stack)
                server.kill()  # connections refused
            elif done == kill_at + settle:
                seen["killed"] = storage_counters(stack)

        t0 = time.monotonic()
        first, first_gaps = _replay_bounded(stack, chaos)
        n = len(small_chat())
        assert first.requests == n
        assert first.corrupt_blocks == 0 and first.failed_loads == 0
        assert first.verified_blocks > 0
        assert max(first_gaps) < REQUEST_BOUND_S, f"slowest request {max(first_gaps):.2f} s"
        # Storage served hits before the outage and none could be read during it.
        assert seen["paused"]["prefetch_pages_completed"] > 0
        assert seen["before_kill"]["prefetch_pages_completed"] == \
            seen["paused"]["prefetch_pages_completed"]
        end = storage_counters(stack)
        assert end["prefetch_pages_completed"] == seen["killed"]["prefetch_pages_completed"]
        # Writes that could not land are counted as failed, not as backed up.
        assert end["backup_failed_pages"] > seen["paused"]["backup_failed_pages"]
        # The manager counts the backend's errors by operation (they feed /metrics).
        assert end["errors_query"] > seen["paused"]["errors_query"]
        assert end["errors_backup"] > seen["paused"]["errors_backup"]
        stack.require_manager().check_invariants()
        # Each rank's backend saw the outage, and the metrics show it per rank.
        assert all(f["available"] == 0 and f["outages"] >= 1
                   for f in seen["paused_figures"].values()), seen["paused_figures"]
        assert all(f["outages"] >= 1 for f in sup.storage_figures())

        server.restart()  # same port, empty
        assert ping(server.port)  # type: ignore[arg-type]
        # The tier resumes by itself once the backend's fail-fast window ends: new blocks
        # reach the new Redis without anyone touching the stack.
        probe, tags = ModelRunner(stack), itertools.count(600)
        raw = redis.Redis.from_url(server.url)

        def resumed() -> bool:  # every rank wrote a page again
            probe.run(prompt(next(tags), 4))
            return all(next(raw.scan_iter(match=f"kvtier:{ns}:*", count=1000), None)
                       for ns in namespaces(stack))

        restarted = time.monotonic()
        wait_until(resumed, RESUME_BOUND_S, "backups reaching the restarted Redis", interval=0.01)
        resume_s = time.monotonic() - restarted
        second, gaps = _replay_bounded(stack, lambda _done: None)
        assert second.requests == n
        assert second.corrupt_blocks == 0 and second.failed_loads == 0
        assert max(gaps) < REQUEST_BOUND_S
        assert second.hit_tokens["storage"] > 0, second.to_json()
        again = storage_counters(stack)
        assert again["backup_pages"] > end["backup_pages"]
        assert again["prefetch_pages_completed"] > end["prefetch_pages_completed"]
        assert redis.Redis.from_url(server.url).dbsize() > 0
        assert [f["available"] for f in sup.storage_figures()] == [1] * RANKS
        stack.require_manager().check_invariants()
        # Every rank noticed the outage and the recovery, in a few log lines, not hundreds.
        log_dir = tmp_path / f"logs-{stack.cfg.deployment_id}"
        for rank in range(RANKS):
            text = (log_dir / f"worker-r{rank}.log").read_text()
            assert 1 <= text.count("unavailable during") <= 3, text
            assert "reachable again" in text, text
        print(f"\n[outage] pass 1 {first.elapsed_s:.1f} s (slowest request "
              f"{max(first_gaps):.2f} s), "
              f"resumed {resume_s:.1f} s after the restart, pass 2 {second.elapsed_s:.1f} s, "
              f"storage hit tokens {first.hit_tokens['storage']} / "
              f"{second.hit_tokens['storage']}, total {time.monotonic() - t0:.1f} s")
        _close_and_check(stack)
    finally:
        server.stop()


# ---------------------------------------------------------------------- 5. prefetch policies

DELAY_S = 0.5  # KVTIER_TEST_STORAGE_DELAY_MS: every QUERY and every PREFETCH takes this long
SLACK_S = 0.3  # scheduling noise allowed on top of a documented wait


def _populate(stack: Stack, runner: ModelRunner, prompts: list[list[int]]) -> None:
    for p in prompts:
        runner.run(p)
    wait_backups(stack, sum((len(p) - 1) // BS for p in prompts))
    stack.reset()


def _wait_prefetched(stack: Stack, pages: int) -> None:
    wait_until(lambda: storage_counters(stack)["prefetch_pages_completed"] >= pages, WAIT_S,
               f"{pages} pages prefetched", interval=0.01)


@pytest.mark.parametrize("policy", ["wait_complete", "best_effort", "timeout"])
def test_prefetch_policy_with_a_slow_store(policy: str, make_stack: StackFactory,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_STORAGE_DELAY_MS", str(int(DELAY_S * 1000)))
    extra = {"KVTIER_STORAGE__TIMEOUT_BASE_S": "0.05",
             "KVTIER_STORAGE__TIMEOUT_PER_1K_TOKENS_S": "10.0"}
    stack = make_stack(f"pol-{policy[:4]}", policy=policy, extra=extra)
    runner = ModelRunner(stack)
    # A query and then a prefetch, each DELAY_S: a storage hit is 2 * DELAY_S away.
    hit_s = 2 * DELAY_S

    if policy == "wait_complete":
        p = prompt(500, BLOCKS)
        _populate(stack, runner, [p])
        out = runner.run(p)
        _assert_restored(out, BLOCKS)
        assert hit_s - 0.05 <= out.elapsed_match_s < hit_s + 2.0

    elif policy == "best_effort":
        p = prompt(510, BLOCKS)
        _populate(stack, runner, [p])
        miss = runner.run(p, compute=False)  # the scheduler does not wait for storage
        assert miss.match.num_tokens == 0
        assert miss.elapsed_match_s < DELAY_S / 2
        waited = time.monotonic()
        _wait_prefetched(stack, BLOCKS)  # the prefetch it started lands in the background
        assert time.monotonic() - waited > DELAY_S / 2
        out = runner.run(p)
        _assert_restored(out, BLOCKS)
        assert out.elapsed_match_s < DELAY_S / 2

    else:
        def budget(blocks: int) -> float:  # timeout_base_s + per 1k tokens to fetch
            return 0.05 + 10.0 * blocks * BS / 1000

        short, medium, long = 4, 18, 60  # blocks; budgets 0.21, 0.77 and 2.45 s
        assert budget(short) < DELAY_S < budget(medium) < hit_s < budget(long) - 1.0
        prompts = {n: prompt(520 + n, n) for n in (short, medium, long)}
        _populate(stack, runner, list(prompts.values()))
        # Budget below the query's delay: back without the hit, after about the budget.
        done = storage_counters(stack)["prefetch_pages_completed"]
        out = runner.run(prompts[short], compute=False)
        assert out.match.num_tokens == 0
        assert budget(short) - 0.01 <= out.elapsed_match_s < budget(short) + SLACK_S
        _wait_prefetched(stack, done + short)  # the prefetch was not thrown away
        _assert_restored(runner.run(prompts[short]), short)
        # Budget between the query and the prefetch: it covers both waits together.
        done = storage_counters(stack)["prefetch_pages_completed"]
        out = runner.run(prompts[medium], compute=False)
        assert out.match.num_tokens == 0
        assert budget(medium) - 0.01 <= out.elapsed_match_s < budget(medium) + SLACK_S
        _wait_prefetched(stack, done + medium)
        # A generous budget: the match waits for the hit, and not for the whole budget.
        out = runner.run(prompts[long])
        _assert_restored(out, long)
        assert hit_s - 0.05 <= out.elapsed_match_s < budget(long)
    stack.require_manager().check_invariants()


# ---------------------------------------------------------------------- 5b. revoke

QUERY_DELAY_S = 0.3  # KVTIER_TEST_STORAGE_DELAY_MS: before every QUERY and every PREFETCH
PAGE_DELAY_S = 0.1  # KVTIER_TEST_PREFETCH_PAGE_DELAY_MS: after every page a PREFETCH reads


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_revoke_cancels_a_prefetch_and_keeps_the_pages_it_read(
        policy: str, make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler's prefetch for a queued request, revoked: while its query is in flight
    (the request was aborted) no prefetch follows; half-way through its pages (the request
    was scheduled) every rank stops within a page, the pages read stay on the host and are
    served byte-exact, the rest are freed, never served. Then the request's match does what
    its policy says with what landed."""
    monkeypatch.setenv(STORAGE_DELAY_ENV, str(int(QUERY_DELAY_S * 1000)))
    monkeypatch.setenv(PREFETCH_PAGE_DELAY_ENV, str(int(PAGE_DELAY_S * 1000)))
    extra = {"KVTIER_STORAGE__TIMEOUT_BASE_S": "0.05",
             "KVTIER_STORAGE__TIMEOUT_PER_1K_TOKENS_S": "0.5"}  # 16 blocks: 0.08 s
    stack = make_stack(f"rev-{policy[:4]}", policy=policy, extra=extra)
    runner = ModelRunner(stack)
    m = stack.require_manager()
    tier = stack.storage
    assert tier is not None
    p = prompt(600, BLOCKS)
    _populate(stack, runner, [p])
    host_free = m.stats()["host"]["free"]

    # Aborted while its query is in flight: the answer starts no prefetch.
    before = storage_counters(stack)
    assert m.prefetch(p)
    assert m.revoke_prefetch(p) == 1
    assert m.dispatcher.drain(WAIT_S)
    c = storage_counters(stack)
    assert c["revoked_queries"] - before["revoked_queries"] == 1
    assert c["prefetch_tasks"] == before["prefetch_tasks"]
    assert m.stats()["host"]["free"] == host_free

    # Scheduled half-way through its prefetch: 16 pages take 1.6 s; revoked after ~5.
    assert m.prefetch(p)
    wait_until(lambda: storage_counters(stack)["prefetch_tasks"] > before["prefetch_tasks"],
               WAIT_S, "the prefetch was issued", interval=0.005)
    time.sleep(QUERY_DELAY_S + 5.5 * PAGE_DELAY_S)
    assert m.revoke_prefetch(p[: 4 * BS + 1]) == 0  # reaches past that shorter prompt
    revoked_at = time.monotonic()
    assert m.revoke_prefetch(p) == 1
    wait_until(lambda: tier.prefetching_blocks == 0, WAIT_S, "the revoked prefetch answered",
               interval=0.005)
    stopped_s = time.monotonic() - revoked_at
    c = storage_counters(stack)
    kept = c["revoked_pages_kept"] - before["revoked_pages_kept"]
    dropped = c["revoked_pages_dropped"] - before["revoked_pages_dropped"]
    assert kept + dropped == BLOCKS and 1 <= kept <= BLOCKS - 3, (kept, dropped)
    # Every rank stopped after the page it was reading (the rest would take >= 0.3 s more).
    assert stopped_s < 3 * PAGE_DELAY_S, f"the revoked prefetch ran on for {stopped_s:.2f} s"
    assert c["prefetch_pages_completed"] - before["prefetch_pages_completed"] == kept
    st = m.stats()
    assert (st["host"]["cached"], st["host"]["free"]) == (kept, host_free - kept)
    m.check_invariants()

    # The request runs: the pages kept are storage hits, byte for byte.
    out = runner.run(p, compute=False)
    assert out.corrupt_blocks == [] and out.checked_blocks == out.match.num_tokens // BS
    if policy == "wait_complete":  # it waits for a prefetch of the rest
        _assert_restored(out, BLOCKS)
    else:  # it takes what landed and does not wait for the rest
        assert out.match.storage_tokens == out.match.num_tokens == kept * BS, out.match
        assert out.elapsed_match_s < QUERY_DELAY_S
    wait_until(lambda: tier.prefetching_blocks == 0, WAIT_S, "background prefetches landed")
    assert m.dispatcher.drain(WAIT_S)
    m.check_invariants()
    assert storage_counters(stack)["errors_prefetch"] == 0


# ---------------------------------------------------------------------- 6. kvtier replay twice

CLI_LIMIT = 12


def _cli_config(path: Path, dep: str, storage: Path) -> None:
    path.write_text(f"""\
deployment_id = "{dep}"

[model]
num_layers = {NUM_LAYERS}
num_kv_heads = {NUM_KV_HEADS}
head_dim = 8
dtype = "float16"

[cache]
block_size = {BS}
device_blocks = 2048
host_blocks = 4096
write_policy = "write_through"

[storage]
backend = "file"
path = {json.dumps(str(storage))}
prefetch_policy = "wait_complete"
prefetch_threshold = {THRESHOLD_TOKENS}

[workers]
count = {RANKS}
device = "cpu"
""")


def test_replay_command_twice_second_run_restores_from_file_storage(tmp_path: Path) -> None:
    dep = new_deployment_id("cli")
    config = tmp_path / "kvtier.toml"
    _cli_config(config, dep, tmp_path / "storage")
    env = clean_env()
    cmd = [*module_command(), "replay", "--workload", "chat",
           "--limit", str(CLI_LIMIT), "--verify", "--json", "--config", str(config)]
    reports = []
    for _ in range(2):  # each run is a fresh process: empty device and host tiers
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        report = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
        reports.append(report)
        assert leftovers(dep, RANKS) == []
        assert report["elapsed_s"] < 30
    first, second = reports
    for r in reports:
        assert r["requests"] == CLI_LIMIT
        assert r["corrupt_blocks"] == 0
        assert r["verified_blocks"] > 0
    assert first["hit_tokens"]["storage"] == 0  # nothing stored before the first run
    assert second["hit_tokens"]["storage"] > 0
    assert second["hit_rate"] > first["hit_rate"]
    assert second["transfer_bytes"]["storage_read"] > 0
