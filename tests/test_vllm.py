"""kvtier inside a real vLLM (the CPU build), end to end: `examples/vllm_offload.py` in vLLM's own
virtual environment (`make vllm-env`, pinned in integrations/vllm/requirements-*.txt).

Each run starts one vLLM process (a tiny random Llama, 12 device blocks of 32 tokens) and
reads the JSON line the example prints: how many of prompt A's tokens vLLM got back from kvtier
(kvtier's own hit counters over its admin's real HTTP /metrics) and whether A's tokens and
logprobs equal A's cold run exactly. The negative control (kvtier's host pages overwritten
behind its back) must come out different, which shows the comparison can fail.

The runs are processes of their own (own deployment ids, admin ports, storage folders, Redis),
so the `ahead` fixture starts the runs of every selected test of this module at the first one,
`RUNS_AT_ONCE` side by side, in file order; each test waits for its own runs and asserts on
their reports. A test's runs that depend on each other (a second process reading the first
one's storage) stay in order, in one chain.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer
from support import require_built

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm") / "bin" / "python"
EXAMPLE = ROOT / "examples" / "vllm_offload.py"
PREFIX_TOKENS = 192  # prompt A: 200 tokens, 6 full blocks of 32
RUN_TIMEOUT_S = 400
RUNS_AT_ONCE = 2
"""vLLM processes side by side. A run is one process (VLLM_ENABLE_V1_MULTIPROCESSING=0 in the
example) spending most of its time in imports and the engine's start, single-threaded Python:
a second run uses the other core (CI's machine has two)."""


# a test waits for its own chain of runs, at most four runs of RUN_TIMEOUT_S and a queue
pytestmark = [pytest.mark.engines, pytest.mark.timeout(RUN_TIMEOUT_S * 4 + 60)]


@pytest.fixture(scope="module", autouse=True)
def built_environments() -> None:
    require_built((VLLM_PYTHON, "make vllm-env"))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}


def run_example(model_dir: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(EXAMPLE), "--json", "--model-dir", str(model_dir), *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=_env(), cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise AssertionError(f"the vLLM example failed (status {proc.returncode}):\n{tail}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def run_check(*argv: str) -> dict[str, Any]:
    """A script (tests/vllm_*_check.py or `-c` code) in vLLM's environment: its last line of
    output, parsed."""
    proc = subprocess.run([str(VLLM_PYTHON), *argv], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report


class Models:
    """The random models of the runs, one folder per kind under `root`, each built once
    (`built`: kind -> folder, guarded by `lock`) before the first run that uses it, so that
    runs side by side never write one model folder at once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lock = threading.Lock()
        self.built: dict[str, Path] = {}

    def __call__(self, kind: str) -> Path:
        with self.lock:
            if kind not in self.built:
                path = self.root / {"llama": "tiny-llama", "hybrid": "tiny-gemma3",
                                    "gemma2": "tiny-gemma2"}[kind]
                subprocess.run(
                    [str(VLLM_PYTHON), "-c", "import sys; sys.path.insert(0, 'examples'); "
                     "from pathlib import Path; import vllm_offload; "
                     "vllm_offload.build_model(Path(sys.argv[1]), sys.argv[2])",
                     str(path), kind],
                    cwd=ROOT, check=True, capture_output=True, timeout=300)
                self.built[kind] = path
            return self.built[kind]


Chain = Callable[[Models, Path], Any]
CHAINS: dict[str, Chain] = {}
"""Test name -> the runs it asserts on (models, a fresh folder) -> what the test reads."""
SHARES: dict[str, str] = {}
"""Test name -> the test whose runs it reads too (no vLLM start of its own)."""


def runs(test: str) -> Callable[[Chain], Chain]:
    def register(chain: Chain) -> Chain:
        CHAINS[test] = chain
        return chain
    return register


class Ahead:
    """The chains of the selected tests, submitted in file order to a pool of RUNS_AT_ONCE
    threads (each thread waits on one process); `futures`: test name -> its chain's future."""

    def __init__(self, names: list[str], models: Models,
                 folder: Callable[[str], Path]) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(RUNS_AT_ONCE)
        owners = list(dict.fromkeys(SHARES.get(name, name) for name in names))
        self.futures = {name: self.pool.submit(CHAINS[name], models, folder(name))
                        for name in owners if name in CHAINS}

    def __getitem__(self, test: str) -> Any:
        return self.futures[SHARES.get(test, test)].result(timeout=RUN_TIMEOUT_S * 4)

    def close(self) -> None:
        # a stopped session (-x, a failure in setup) does not start what is still queued
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def ahead(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ahead]:
    names = [item.name for item in request.session.items
             if item.module is request.module]
    models = Models(tmp_path_factory.mktemp("vllm-models"))
    pool = Ahead(names, models, lambda name: tmp_path_factory.mktemp(name[:40]))
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def my_runs(request: pytest.FixtureRequest, ahead: Ahead) -> Callable[[], Any]:
    """What this test's chain returned (waited for in the test, so that a failed run fails
    the test that owns it)."""
    return lambda: ahead[request.node.name]


# ------------------------------------------------------------------------ one group (Llama)


@runs("test_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly")
def _plain(models: Models, tmp: Path) -> dict[str, Any]:
    return run_example(models("llama"))


def test_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(my_runs: Callable[[], Any]
                                                                   ) -> None:
    r = my_runs()
    assert r["vllm_num_cached_tokens"] == PREFIX_TOKENS, r
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    # the embedded admin's /lookup (vLLM's own block names) saw exactly what vLLM then loaded
    assert r["lookup_before_load"] == {"host": PREFIX_TOKENS, "pending": 0, "storage": 0}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r
    assert any('tier="host"' in ln and not ln.endswith(" 0.0") for ln in r["metrics_lines"])
    audit = [ln for ln in r["metrics_lines"] if ln.startswith("kvtier_audit_")]
    assert audit and all(ln.endswith(" 0.0") for ln in audit), r  # audit off: nothing audited


@runs("test_negative_control_overwritten_host_pages_change_the_output")
def _corrupt(models: Models, tmp: Path) -> dict[str, Any]:
    return run_example(models("llama"), "--corrupt-host")


def test_negative_control_overwritten_host_pages_change_the_output(my_runs: Callable[[], Any]
                                                                   ) -> None:
    r = my_runs()
    assert r["corrupted_bytes"] > 0 and r["tokens_loaded_from_kvtier"] == PREFIX_TOKENS, r
    assert r["identical"] is False, (
        "kvtier's host pages were overwritten, yet vLLM's output did not change: the "
        f"comparison cannot tell served KV from recomputed KV: {r}")


SAMPLED_REQUESTS = 200
"""One-block prompts of the audit's sampling pass (each run twice, 2 x 33 tokens): the whole
pass adds a few seconds to the audit run, no vLLM start of its own."""


@runs("test_audit_recomputes_each_hit_and_catches_overwritten_host_pages")
def _audit(models: Models, tmp: Path) -> dict[str, Any]:
    return run_example(models("llama"), "--audit", "1", "--corrupt-host", "--storage", "file",
                       "--storage-path", str(tmp / "storage"),
                       "--audit-sampling", str(SAMPLED_REQUESTS))


def test_audit_recomputes_each_hit_and_catches_overwritten_host_pages(
        my_runs: Callable[[], Any]) -> None:
    """kvtier's sampled recompute audit at 1 in 1 (examples/vllm_offload.py --audit 1): A's
    hits are recomputed by vLLM and compared with kvtier's copies, all alike, and the output is
    vLLM's alone; after kvtier's host pages are overwritten (the control above shows that this
    changes the output when the pages are served), the audited run finds every block of A
    mismatched and removes it from the node (host copy and file-storage page), its output is
    still vLLM's alone, and A after it, with the audit off, is recomputed (nothing left to
    load, not even from storage) and exact."""
    r = my_runs()
    blocks = PREFIX_TOKENS // 32
    clean = r["audit_clean"]
    assert clean["identical"] is True and clean["vllm_num_cached_tokens"] == 0, r
    assert clean["blocks"]["mismatch"] == 0, r
    assert clean["blocks"]["equal"] + clean["blocks"]["within_tolerance"] == blocks, r
    warm = r["audit_warm"]
    assert r["corrupted_bytes"] > 0 and warm["blocks"]["mismatch"] == blocks, r
    assert r["identical"] is True and r["tokens_loaded_from_kvtier"] == 0, r
    after = r["audit_after"]
    assert after["identical"] is True and after["tokens_loaded_from_kvtier"] == 0, r
    assert sum(after["audit_blocks"].values()) == 0, r  # the audit off: nothing audited
    assert f'kvtier_audit_blocks_total{{result="mismatch",tier="host"}} {blocks}.0' in r[
        "metrics_lines"], r
    status = r["status_audit"]  # kvtier's /status
    assert status["blocks"]["mismatch"]["host"] == blocks, r
    assert status["sample"] == 0.0, r  # turned off for A's last run
    assert status["requests_drawn"] >= 2 and status["max_rel_diff"] > 0, r
    vllm = r["vllm_audit_metrics"]  # the same figures in what kvtier hands vLLM's metrics
    assert vllm.get("mismatch/host") == blocks and vllm["max_rel_diff"] > 0, r
    sampled = r["audit_sampling"]["blocks"]  # the sampling pass (next test) ran after
    assert (vllm.get("equal/host", 0) + vllm.get("within_tolerance/host", 0)
            == blocks + sampled["equal"] + sampled["within_tolerance"]), r
    # the storage pages of A's mismatched blocks are gone (A's after-run loaded nothing)
    assert r["audit_storage"] == {"pages_before": blocks, "pages_after": 0}, r
    assert (f'kvtier_engine_removed_blocks_total{{reason="audit_mismatch",tier="storage"}} '
            f'{blocks}.0') in r["metrics_lines"], r


SHARES["test_the_audit_samples_its_share_of_the_requests_that_hit_kvtier"] = (
    "test_audit_recomputes_each_hit_and_catches_overwritten_host_pages")


def test_the_audit_samples_its_share_of_the_requests_that_hit_kvtier(
        my_runs: Callable[[], Any]) -> None:
    """Sampling on live traffic (the audit run above, last): 200 one-block prompts, then the
    same prompts again at 1 in 10 after vLLM's device cache lost them. Each second-pass
    request that hits kvtier is offered to the sampler once; the share drawn is within its
    binomial bound (4.5 standard deviations: a false failure about once in 150,000 runs), each
    drawn request's one block was recomputed (compared: all alike), and the others were
    loaded from kvtier (no extra recompute). Broken once (the sampler ignoring its rate): 200
    of 200 drawn, 180 from the expected 20 against a bound of 19.1: fails."""
    r = my_runs()["audit_sampling"]
    n, drawn, p = r["offered"], r["drawn"], r["rate"]
    assert n >= SAMPLED_REQUESTS * 3 // 4, r  # most second-pass requests hit kvtier
    bound = 4.5 * (n * p * (1 - p)) ** 0.5
    assert abs(drawn - n * p) <= bound, (r, bound)
    assert drawn > 0, r
    blocks = r["blocks"]
    # every drawn request recomputes its block; nearly all are compared (a broken sampler
    # drawing all 200 compared 195: a block vLLM does not offer back for storing, e.g. its
    # request preempted, is not compared), none differs
    assert 0 < blocks["equal"] + blocks["within_tolerance"] <= drawn, r
    assert blocks["mismatch"] == 0, r
    assert r["tokens_loaded_from_kvtier"] == (n - drawn) * 32, r


@runs("test_a_new_vllm_process_finds_the_prefix_in_file_storage")
def _file_storage(models: Models, tmp: Path) -> list[dict[str, Any]]:
    args = ("--storage", "file", "--storage-path", str(tmp / "storage"),
            "--reference", str(tmp / "cold.json"))
    # the third process audits every hit: A's blocks come from the first process's pages
    return [run_example(models("llama"), *args), run_example(models("llama"), *args),
            run_example(models("llama"), *args, "--audit", "1")]


def test_a_new_vllm_process_finds_the_prefix_in_file_storage(my_runs: Callable[[], Any]
                                                             ) -> None:
    first, second, _ = my_runs()
    assert first["identical"] is True and first["reference"] == "this run", first
    assert second["reference"] == "file", second
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


SHARES["test_a_storage_hit_in_a_new_vllm_process_is_audited_alike"] = (
    "test_a_new_vllm_process_finds_the_prefix_in_file_storage")


def test_a_storage_hit_in_a_new_vllm_process_is_audited_alike(my_runs: Callable[[], Any]
                                                              ) -> None:
    """The audit through a storage hit: a third vLLM process, audit at 1 in 1, finds A only
    in the first process's file pages; vLLM recomputes each block and kvtier compares it with
    the page it read from storage, under `tier="storage"`: all alike, the output exact.
    (A storage page that differs is the negative control of the audit test above, whose
    mismatches also delete the pages.)"""
    *_, audited = my_runs()
    blocks = PREFIX_TOKENS // 32
    clean = audited["audit_clean"]
    assert clean["identical"] is True and clean["vllm_num_cached_tokens"] == 0, audited
    assert clean["blocks"]["mismatch"] == 0, audited
    assert clean["blocks"]["equal"] + clean["blocks"]["within_tolerance"] == blocks, audited
    vllm = audited["vllm_audit_metrics"]
    assert (vllm.get("equal/storage", 0) + vllm.get("within_tolerance/storage", 0)
            == blocks), audited


@runs("test_two_vllm_instances_share_one_redis")
def _redis(models: Models, tmp: Path) -> list[dict[str, Any]]:
    ref = tmp / "cold.json"
    with RedisServer() as redis:
        args = ("--storage", "redis", "--redis-url", redis.url, "--reference", str(ref))
        return [run_example(models("llama"), *args), run_example(models("llama"), *args)]


def test_two_vllm_instances_share_one_redis(my_runs: Callable[[], Any]) -> None:
    first, second = my_runs()
    assert first["identical"] is True, first
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


@runs("test_reset_with_storage_makes_the_next_repeat_a_recompute")
def _reset(models: Models, tmp: Path) -> dict[str, Any]:
    return run_example(models("llama"), "--storage", "file", "--storage-path", str(tmp / "s"),
                       "--reset-storage")


def test_reset_with_storage_makes_the_next_repeat_a_recompute(my_runs: Callable[[], Any]
                                                              ) -> None:
    r = my_runs()
    assert r["reset"]["cleared"]["host_blocks"] > 0, r
    assert r["tokens_loaded_from_kvtier"] == 0 and r["vllm_num_cached_tokens"] == 0, r
    assert r["identical"] is True, r


@runs("test_the_worker_side_copies_exactly_and_never_touches_a_replaced_pool")
def _worker_check(models: Models, tmp: Path) -> dict[str, Any]:
    return run_check(str(ROOT / "tests" / "vllm_worker_check.py"))


def test_the_worker_side_copies_exactly_and_never_touches_a_replaced_pool(
        my_runs: Callable[[], Any]) -> None:
    """tests/vllm_worker_check.py in vLLM's environment: the adapter's copies against a real
    kvtier worker, and the inode checks that keep a replaced worker's pool safe."""
    r = my_runs()
    assert r["jobs_done"] == [1, 2] and r["round_trip_exact"] and r["host_page_is_block_3"], r
    # a load planned against another segment: nothing copied, the blocks reported to vLLM
    assert r["stale_load_errors"] == [1, 2] and r["stale_load_copied_nothing"], r
    assert r["refused_load_errors"] == [4, 5] and r["failed_jobs_still_finish"] == [3, 4], r
    assert r["replaced_segment"] and r["stale_store_left_new_pool_alone"], r
    assert r["store_into_new_pool_exact"], r


@runs("test_a_killed_kvtier_worker_never_stops_vllm")
def _kill_worker(models: Models, tmp: Path) -> dict[str, Any]:
    return run_example(models("llama"), "--kill-worker")


def test_a_killed_kvtier_worker_never_stops_vllm(my_runs: Callable[[], Any]) -> None:
    r = my_runs()
    assert r["killed_worker_pids"], r
    assert len(r["during_restart_tokens"]) == 8, r  # served while kvtier restarted
    assert r.get("replacement_worker_pids"), f"kvtier's worker was not replaced: {r}"
    # the host copies died with the old worker: A is recomputed, exactly
    assert r["tokens_loaded_from_kvtier"] == 0 and r["identical"] is True, r


# ---------------------------------------------------------------- hybrid attention (two groups)
#
# `--model hybrid`: Gemma 3's text architecture, random weights, layers alternating a 64-token
# sliding window (two blocks) and full attention: vLLM makes KV cache group 0 (sliding window)
# and group 1 (full). Prompt A is 200 tokens, longer than the window: vLLM's hit stops a token
# short of the prompt (192 tokens, 6 blocks) and needs only the window's last 2 blocks of the
# sliding-window group, so that group's early blocks are never loaded (nor stored).

SWA_WINDOW_BLOCKS = 2


def hybrid(model_dir: Path, *args: str, model: str = "hybrid") -> dict[str, Any]:
    r = run_example(model_dir, "--model", model, *args)
    assert [(g["group_id"], g["kind"]) for g in r["kv_cache_groups"]] == [
        (0, "sliding_window"), (1, "full")], r
    return r


@runs("test_kv_cache_groups_are_told_apart_refused_in_one_line_and_copied_apart")
def _groups_check(models: Models, tmp: Path) -> dict[str, Any]:
    return run_check(str(ROOT / "tests" / "vllm_groups_check.py"))


def test_kv_cache_groups_are_told_apart_refused_in_one_line_and_copied_apart(
        my_runs: Callable[[], Any]) -> None:
    """tests/vllm_groups_check.py in vLLM's environment, with vLLM's own KV cache spec
    classes and a real kvtier worker for the copies."""
    r = my_runs()
    assert r["kinds"] == ["sliding_window", "full"] and r["window_blocks"] == [3, None], r
    assert r["keys_differ"] and r["page_layers"] == 2, r
    for what, words in (("mamba_refused", ("KV cache group 1", "MambaSpec", "mixer1")),
                        ("geometry_refused", ("groups 0 and 1", "tokens per block")),
                        ("no_kv_cache_config_refused", ("2 KV cache groups", "KvtierConnector"))):
        assert all(w in r[what] for w in words) and "\n" not in r[what], (what, r[what])
    assert r["group0_page_exact"] and r["group1_page_exact"] and r["group1_page_rest_zero"], r
    assert r["round_trip_exact"] and r["jobs_done"] == [1, 2], r
    assert "2 groups" in r["bad_group_sizes_refused"], r


@runs("test_a_model_with_a_state_group_is_refused_at_start_naming_it")
def _state_group(models: Models, tmp: Path) -> dict[str, Any]:
    return run_check(str(ROOT / "tests" / "vllm_state_group_check.py"), str(tmp / "tiny-jamba"))


@pytest.mark.slow
def test_a_model_with_a_state_group_is_refused_at_start_naming_it(my_runs: Callable[[], Any]
                                                                  ) -> None:
    """A tiny Jamba (Mamba mixers + attention) in a real vLLM: vLLM makes a Mamba group and a
    full-attention group; kvtier refuses the model in one line naming the state group."""
    r = my_runs()
    msg = r["refused"]
    assert msg.startswith("KV cache group 0 (MambaSpec, layers model.layers.0.mixer"), r
    assert "recurrent state" in msg and "\n" not in msg, r


@runs("test_hybrid_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly")
def _hybrid_plain(models: Models, tmp: Path) -> dict[str, Any]:
    return hybrid(models("hybrid"))


@pytest.mark.slow
def test_hybrid_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(
        my_runs: Callable[[], Any]) -> None:
    r = my_runs()
    assert r["vllm_num_cached_tokens"] == PREFIX_TOKENS, r
    # tokens count once (the full-attention group's blocks), not once per group
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    # the whole prefix for the full-attention layers, only the window for the others
    assert r["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS, "1": PREFIX_TOKENS // 32}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r
    # the admin's /lookup by token ids is refused in one line (each block is keyed per
    # group), not answered with nothing: the adapter told the embedded kvtier its 2 groups
    assert "2 KV cache groups" in r["lookup_before_load"].get("refused", ""), r


@runs("test_gemma2_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly")
def _gemma2(models: Models, tmp: Path) -> dict[str, Any]:
    return hybrid(models("gemma2"), model="gemma2")


@pytest.mark.slow
def test_gemma2_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(
        my_runs: Callable[[], Any]) -> None:
    """Gemma 2's architecture (every other layer a sliding window, logit soft-capping): the
    same two groups, the same exact return."""
    r = my_runs()
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    assert r["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS, "1": PREFIX_TOKENS // 32}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r


@runs("test_hybrid_negative_control_overwritten_host_pages_change_the_output")
def _hybrid_corrupt(models: Models, tmp: Path) -> dict[str, Any]:
    return hybrid(models("hybrid"), "--corrupt-host")


@pytest.mark.slow
def test_hybrid_negative_control_overwritten_host_pages_change_the_output(
        my_runs: Callable[[], Any]) -> None:
    r = my_runs()
    assert r["corrupted_bytes"] > 0 and r["tokens_loaded_from_kvtier"] == PREFIX_TOKENS, r
    assert r["identical"] is False, (
        f"kvtier's host pages were overwritten, yet the hybrid model's output did not change: {r}")


@runs("test_hybrid_audit_compares_both_groups_and_catches_overwritten_host_pages")
def _hybrid_audit(models: Models, tmp: Path) -> dict[str, Any]:
    return hybrid(models("hybrid"), "--audit", "1", "--corrupt-host")


def test_hybrid_audit_compares_both_groups_and_catches_overwritten_host_pages(
        my_runs: Callable[[], Any]) -> None:
    """The audit on the Gemma 3 hybrid (a full-attention and a sliding-window KV cache group,
    a host page of each group's own layers): every block kvtier holds of A, in both groups, is
    recomputed and compared, all alike; after the overwrite every one mismatches and is
    evicted; the outputs are vLLM's alone throughout."""
    r = my_runs()
    clean, warm, after = r["audit_clean"], r["audit_warm"], r["audit_after"]
    held = clean["blocks"]["equal"] + clean["blocks"]["within_tolerance"]
    assert clean["identical"] is True and clean["blocks"]["mismatch"] == 0, r
    assert held > PREFIX_TOKENS // 32, r  # the full group's six blocks and the window's
    assert warm["blocks"]["mismatch"] == held and r["identical"] is True, r
    assert after["identical"] is True and after["tokens_loaded_from_kvtier"] == 0, r


def _file_args(tmp: Path) -> tuple[str, ...]:
    return ("--storage", "file", "--storage-path", str(tmp / "storage"),
            "--reference", str(tmp / "cold.json"))


@runs("test_hybrid_a_new_vllm_process_finds_both_groups_in_file_storage")
def _hybrid_file(models: Models, tmp: Path) -> list[dict[str, Any]]:
    return [hybrid(models("hybrid"), *_file_args(tmp)), hybrid(models("hybrid"), *_file_args(tmp))]


@pytest.mark.slow
def test_hybrid_a_new_vllm_process_finds_both_groups_in_file_storage(
        my_runs: Callable[[], Any]) -> None:
    first, second = my_runs()
    assert first["identical"] is True and first["reference"] == "this run", first
    assert second["reference"] == "file", second
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS,
                                                "1": PREFIX_TOKENS // 32}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


@runs("test_hybrid_one_groups_pages_missing_from_storage_means_a_recompute")
def _hybrid_drop(models: Models, tmp: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    first = hybrid(models("hybrid"), *_file_args(tmp))
    # each run recomputes A and stores the missing pages again: the runs are independent
    dropped = {kind: hybrid(models("hybrid"), *_file_args(tmp), "--drop-group-pages", kind)
               for kind in ("sliding_window", "full")}
    return first, dropped


@pytest.mark.slow
def test_hybrid_one_groups_pages_missing_from_storage_means_a_recompute(
        my_runs: Callable[[], Any]) -> None:
    """No hit from half a block set: with one group's pages of A deleted from storage and
    the other's present, A is recomputed (nothing loaded), and still exact."""
    first, dropped = my_runs()
    assert first["identical"] is True
    for kind, pages in (("sliding_window", SWA_WINDOW_BLOCKS), ("full", PREFIX_TOKENS // 32)):
        r = dropped[kind]
        assert r["dropped_pages"] == pages, r  # that group's pages of A, and only those
        assert r["tokens_loaded_from_kvtier"] == 0 and r["vllm_num_cached_tokens"] == 0, r
        assert r["blocks_loaded_by_group"] == {"0": 0, "1": 0}, r
        assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r


ATTACHED_CHECK = (
    "import json\n"
    "from kvtier.integrations.vllm.defaults import check_extra_config\n"
    "from kvtier.integrations.vllm.errors import VllmAdapterError\n"
    "out = {}\n"
    "for name, extra in (('ok', {'kvtier_serve': '/run/kvtier/node.sock'}),\n"
    "                    ('clash', {'kvtier_serve': '/s', 'host_blocks': 8,\n"
    "                               'storage_backend': 'file'}),\n"
    "                    ('empty', {'kvtier_serve': ''}),\n"
    "                    ('embedded', {'host_blocks': 8}),\n"
    "                    ('policy', {'host_eviction_policy': 'duel'}),\n"
    "                    ('policy_attached', {'kvtier_serve': '/s',\n"
    "                                         'host_eviction_policy': 'duel'})):\n"
    "    try:\n"
    "        check_extra_config(extra)\n"
    "        out[name] = 'accepted'\n"
    "    except VllmAdapterError as e:\n"
    "        out[name] = str(e)\n"
    "print(json.dumps(out))\n")


@runs("test_attached_mode_is_one_key_and_refuses_an_embedded_setting_in_one_line")
def _attached(models: Models, tmp: Path) -> dict[str, Any]:
    return run_check("-c", ATTACHED_CHECK)


def test_attached_mode_is_one_key_and_refuses_an_embedded_setting_in_one_line(
        my_runs: Callable[[], Any]) -> None:
    """`kvtier_serve` picks attached mode; with it, a setting of the instance's own kvtier
    (host_blocks, storage_*, admin*) is refused naming the key, as is an empty socket path."""
    r = my_runs()
    assert r["ok"] == "accepted" and r["embedded"] == "accepted", r
    # the host tier's eviction order (issue 38) is a key of the embedded kvtier's own
    assert r["policy"] == "accepted" and "host_eviction_policy" in r["policy_attached"], r
    for word in ("host_blocks", "storage_backend", "kvtier_serve = '/s'", "kvtier serve"):
        assert word in r["clash"], r["clash"]
    assert "kvtier_serve = ''" in r["empty"] and "\n" not in r["clash"] + r["empty"], r


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
