"""kvtier inside a real vLLM (the CPU build), end to end: `examples/vllm_offload.py` in vLLM's own
virtual environment (`make vllm-env`, pinned in integrations/vllm/requirements-*.txt).

Each test starts one vLLM process (a tiny random Llama, 12 device blocks of 32 tokens) and reads
the JSON line the example prints: how many of prompt A's tokens vLLM got back from kvtier
(kvtier's own hit counters over its admin's real HTTP /metrics) and whether A's tokens and
logprobs equal A's cold run exactly. The negative control (kvtier's host pages overwritten
behind its back) must come out different, which shows the comparison can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm") / "bin" / "python"
EXAMPLE = ROOT / "examples" / "vllm_offload.py"
PREFIX_TOKENS = 192  # prompt A: 200 tokens, 6 full blocks of 32
RUN_TIMEOUT_S = 400

if not VLLM_PYTHON.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `make test` builds it (make vllm-env)")
    pytest.skip(f"vLLM's environment {VLLM_PYTHON} is not built (make vllm-env)",
                allow_module_level=True)

pytestmark = pytest.mark.timeout(RUN_TIMEOUT_S * 2 + 60)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-model") / "tiny-llama"


def run_example(model_dir: Path, *args: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(EXAMPLE), "--json", "--model-dir", str(model_dir), *args],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.splitlines()[-40:])
        raise AssertionError(f"the vLLM example failed (status {proc.returncode}):\n{tail}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def test_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(model_dir: Path) -> None:
    r = run_example(model_dir)
    assert r["vllm_num_cached_tokens"] == PREFIX_TOKENS, r
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r
    assert any('tier="host"' in ln and not ln.endswith(" 0.0") for ln in r["metrics_lines"])


def test_negative_control_overwritten_host_pages_change_the_output(model_dir: Path) -> None:
    r = run_example(model_dir, "--corrupt-host")
    assert r["corrupted_bytes"] > 0 and r["tokens_loaded_from_kvtier"] == PREFIX_TOKENS, r
    assert r["identical"] is False, (
        "kvtier's host pages were overwritten, yet vLLM's output did not change: the "
        f"comparison cannot tell served KV from recomputed KV: {r}")


def test_a_new_vllm_process_finds_the_prefix_in_file_storage(model_dir: Path,
                                                               tmp_path: Path) -> None:
    storage = tmp_path / "storage"
    ref = tmp_path / "cold.json"
    first = run_example(model_dir, "--storage", "file", "--storage-path", str(storage),
                        "--reference", str(ref))
    assert first["identical"] is True and first["reference"] == "this run", first
    second = run_example(model_dir, "--storage", "file", "--storage-path", str(storage),
                         "--reference", str(ref))
    assert second["reference"] == "file", second
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


def test_two_vllm_instances_share_one_redis(model_dir: Path, tmp_path: Path) -> None:
    ref = tmp_path / "cold.json"
    with RedisServer() as redis:
        first = run_example(model_dir, "--storage", "redis", "--redis-url", redis.url,
                            "--reference", str(ref))
        assert first["identical"] is True, first
        second = run_example(model_dir, "--storage", "redis", "--redis-url", redis.url,
                             "--reference", str(ref))
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


def test_reset_with_storage_makes_the_next_repeat_a_recompute(model_dir: Path,
                                                               tmp_path: Path) -> None:
    r = run_example(model_dir, "--storage", "file", "--storage-path", str(tmp_path / "s"),
                    "--reset-storage")
    assert r["reset"]["cleared"]["host_blocks"] > 0, r
    assert r["tokens_loaded_from_kvtier"] == 0 and r["vllm_num_cached_tokens"] == 0, r
    assert r["identical"] is True, r


def test_the_worker_side_copies_exactly_and_never_touches_a_replaced_pool() -> None:
    """tests/vllm_worker_check.py in vLLM's environment: the adapter's copies against a real
    kvtier worker, and the inode checks that keep a replaced worker's pool safe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_worker_check.py")],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["jobs_done"] == [1, 2] and r["round_trip_exact"] and r["host_page_is_block_3"], r
    # a load planned against another segment: nothing copied, the blocks reported to vLLM
    assert r["stale_load_errors"] == [1, 2] and r["stale_load_copied_nothing"], r
    assert r["refused_load_errors"] == [4, 5] and r["failed_jobs_still_finish"] == [3, 4], r
    assert r["replaced_segment"] and r["stale_store_left_new_pool_alone"], r
    assert r["store_into_new_pool_exact"], r


def test_a_killed_kvtier_worker_never_stops_vllm(model_dir: Path) -> None:
    r = run_example(model_dir, "--kill-worker")
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


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-hybrid") / "tiny-gemma3"


def hybrid(model_dir: Path, *args: str, model: str = "hybrid") -> dict[str, Any]:
    r = run_example(model_dir, "--model", model, *args)
    assert [(g["group_id"], g["kind"]) for g in r["kv_cache_groups"]] == [
        (0, "sliding_window"), (1, "full")], r
    return r


def test_kv_cache_groups_are_told_apart_refused_in_one_line_and_copied_apart() -> None:
    """tests/vllm_groups_check.py in vLLM's environment, with vLLM's own KV cache spec
    classes and a real kvtier worker for the copies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_groups_check.py")],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["kinds"] == ["sliding_window", "full"] and r["window_blocks"] == [3, None], r
    assert r["keys_differ"] and r["page_layers"] == 2, r
    for what, words in (("mamba_refused", ("KV cache group 1", "MambaSpec", "mixer1")),
                        ("geometry_refused", ("groups 0 and 1", "tokens per block")),
                        ("no_kv_cache_config_refused", ("2 KV cache groups", "KvtierConnector"))):
        assert all(w in r[what] for w in words) and "\n" not in r[what], (what, r[what])
    assert r["group0_page_exact"] and r["group1_page_exact"] and r["group1_page_rest_zero"], r
    assert r["round_trip_exact"] and r["jobs_done"] == [1, 2], r
    assert "2 groups" in r["bad_group_sizes_refused"], r


@pytest.mark.slow
def test_a_model_with_a_state_group_is_refused_at_start_naming_it(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny Jamba (Mamba mixers + attention) in a real vLLM: vLLM makes a Mamba group and a
    full-attention group; kvtier refuses the model in one line naming the state group."""
    model = tmp_path_factory.mktemp("vllm-jamba") / "tiny-jamba"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_state_group_check.py"), str(model)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    msg = r["refused"]
    assert msg.startswith("KV cache group 0 (MambaSpec, layers model.layers.0.mixer"), r
    assert "recurrent state" in msg and "\n" not in msg, r


@pytest.mark.slow
def test_hybrid_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(
        hybrid_dir: Path) -> None:
    r = hybrid(hybrid_dir)
    assert r["vllm_num_cached_tokens"] == PREFIX_TOKENS, r
    # tokens count once (the full-attention group's blocks), not once per group
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    # the whole prefix for the full-attention layers, only the window for the others
    assert r["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS, "1": PREFIX_TOKENS // 32}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r


@pytest.mark.slow
def test_gemma2_a_prefix_evicted_from_vllm_comes_back_from_kvtier_exactly(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 2's architecture (every other layer a sliding window, logit soft-capping): the
    same two groups, the same exact return."""
    model_dir = tmp_path_factory.mktemp("vllm-gemma2") / "tiny-gemma2"
    r = hybrid(model_dir, model="gemma2")
    assert r["tokens_by_tier"] == {"host": PREFIX_TOKENS, "storage": 0}, r
    assert r["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS, "1": PREFIX_TOKENS // 32}, r
    assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r


@pytest.mark.slow
def test_hybrid_negative_control_overwritten_host_pages_change_the_output(
        hybrid_dir: Path) -> None:
    r = hybrid(hybrid_dir, "--corrupt-host")
    assert r["corrupted_bytes"] > 0 and r["tokens_loaded_from_kvtier"] == PREFIX_TOKENS, r
    assert r["identical"] is False, (
        f"kvtier's host pages were overwritten, yet the hybrid model's output did not change: {r}")


@pytest.mark.slow
def test_hybrid_a_new_vllm_process_finds_both_groups_in_file_storage(
        hybrid_dir: Path, tmp_path: Path) -> None:
    storage, ref = tmp_path / "storage", tmp_path / "cold.json"
    args = ("--storage", "file", "--storage-path", str(storage), "--reference", str(ref))
    first = hybrid(hybrid_dir, *args)
    assert first["identical"] is True and first["reference"] == "this run", first
    second = hybrid(hybrid_dir, *args)
    assert second["reference"] == "file", second
    assert second["tokens_by_tier"] == {"host": 0, "storage": PREFIX_TOKENS}, second
    assert second["blocks_loaded_by_group"] == {"0": SWA_WINDOW_BLOCKS,
                                                "1": PREFIX_TOKENS // 32}, second
    assert second["identical"] is True and second["max_abs_logprob_diff"] == 0.0, second


@pytest.mark.slow
def test_hybrid_one_groups_pages_missing_from_storage_means_a_recompute(
        hybrid_dir: Path, tmp_path: Path) -> None:
    """No hit from half a block set: with one group's pages of A deleted from storage and
    the other's present, A is recomputed (nothing loaded), and still exact."""
    storage, ref = tmp_path / "storage", tmp_path / "cold.json"
    args = ("--storage", "file", "--storage-path", str(storage), "--reference", str(ref))
    assert hybrid(hybrid_dir, *args)["identical"] is True
    for kind, pages in (("sliding_window", SWA_WINDOW_BLOCKS), ("full", PREFIX_TOKENS // 32)):
        # each run recomputes A and stores the missing pages again: the runs are independent
        r = hybrid(hybrid_dir, *args, "--drop-group-pages", kind)
        assert r["dropped_pages"] == pages, r  # that group's pages of A, and only those
        assert r["tokens_loaded_from_kvtier"] == 0 and r["vllm_num_cached_tokens"] == 0, r
        assert r["blocks_loaded_by_group"] == {"0": 0, "1": 0}, r
        assert r["identical"] is True and r["max_abs_logprob_diff"] == 0.0, r


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_attached_mode_is_one_key_and_refuses_an_embedded_setting_in_one_line() -> None:
    """`kvtier_serve` picks attached mode; with it, a setting of the instance's own kvtier
    (host_blocks, storage_*, admin*) is refused naming the key, as is an empty socket path."""
    code = (
        "import json\n"
        "from kvtier.integrations.vllm.defaults import check_extra_config\n"
        "from kvtier.integrations.vllm.errors import VllmAdapterError\n"
        "out = {}\n"
        "for name, extra in (('ok', {'kvtier_serve': '/run/kvtier/node.sock'}),\n"
        "                    ('clash', {'kvtier_serve': '/s', 'host_blocks': 8,\n"
        "                               'storage_backend': 'file'}),\n"
        "                    ('empty', {'kvtier_serve': ''}),\n"
        "                    ('embedded', {'host_blocks': 8})):\n"
        "    try:\n"
        "        check_extra_config(extra)\n"
        "        out[name] = 'accepted'\n"
        "    except VllmAdapterError as e:\n"
        "        out[name] = str(e)\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.run([str(VLLM_PYTHON), "-c", code], capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["ok"] == "accepted" and r["embedded"] == "accepted", r
    for word in ("host_blocks", "storage_backend", "kvtier_serve = '/s'", "kvtier serve"):
        assert word in r["clash"], r["clash"]
    assert "kvtier_serve = ''" in r["empty"] and "\n" not in r["clash"] + r["empty"], r
