"""kvtier's events read by real routers: `examples/kv_routing.py` in vLLM's environment
(`make vllm-env`), with NVIDIA Dynamo's standalone KV indexer and vllm-router from
`make consumers-env` (PyPI, no etcd, no NATS). Two `vllm serve` + kvtier (embedded)
instances publish with vLLM's own ZMQ publisher; the indexer's `/query` answers per instance
and tier must equal what each instance holds (kvtier's admin `/status`, its storage pages,
vLLM's and kvtier's own hit counters), a late registration's sequence gap must be recovered
through the replay socket, `POST /reset` must show as zero host, and `vllm-router --policy
kv_aware` must send a repeated prompt to the instance whose host tier holds it.

One run of the example (3 minutes on two quiet cores, 4.5 at a load average of 10; the start of
the two vLLM servers is most of it), several assertions on its report.
The break check (`--plain-events`: kvtier's events without token ids) is in the note of the
branch that added this file, not a second CI run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from support import require_built

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm") / "bin" / "python"
CONSUMERS = ROOT / os.environ.get("KVTIER_CONSUMERS_VENV", ".venv-consumers")
EXAMPLE = ROOT / "examples" / "kv_routing.py"
RUN_TIMEOUT_S = 480
BLOCK = 32
PROMPT_BLOCKS = 6


pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 120)]


@pytest.fixture(scope="module", autouse=True)
def built_environments() -> None:
    require_built((VLLM_PYTHON, "make vllm-env"),
                  (CONSUMERS / "bin" / "vllm-router", "make consumers-env"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The example's JSON report. On a timeout the example gets SIGTERM first (it stops the
    servers it started), SIGKILL only if it does not leave; its children die with it."""
    model_dir = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    logs = tmp_path_factory.mktemp("kv-routing-logs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(EXAMPLE), "--json", "--model-dir", str(model_dir),
         "--consumers-venv", str(CONSUMERS), "--keep-logs", str(logs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"the example ran past {RUN_TIMEOUT_S} s:\n{err[-3000:]}"
                             f"\nlogs in {logs}") from None
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"the example failed (status {proc.returncode}), logs in "
                             f"{logs}:\n{err[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_the_indexer_answers_per_instance_and_tier_what_each_instance_holds(
        report: dict[str, Any]) -> None:
    assert report["indexer_matches_kvtier"], (report["queries"], report["kvtier_holds"])
    holds = report["kvtier_holds"]
    # A served three 6-block prompts, B three and a 1-block one: kvtier kept every block on
    # its host tier and backed each up to storage
    assert holds["A"] == {"host_blocks": 3 * PROMPT_BLOCKS, "storage_pages": 3 * PROMPT_BLOCKS}
    assert holds["B"] == {"host_blocks": 3 * PROMPT_BLOCKS + 1,
                          "storage_pages": 3 * PROMPT_BLOCKS + 1}
    # A's first prompt left vLLM's device pool (12 blocks) and is still on kvtier's host tier
    first = report["queries"][0]
    assert first["A"] == {"gpu": 0, "cpu": PROMPT_BLOCKS * BLOCK,
                          "disk": PROMPT_BLOCKS * BLOCK}, first
    assert first["B"] == {"gpu": 0, "cpu": 0, "disk": 0}, first
    assert report["first_prompt_off_device"] and report["kvtier_host_kept"]


def test_a_late_registration_gap_is_recovered_through_the_replay_socket(
        report: dict[str, Any]) -> None:
    assert report["gap_detected"], report["replay_completed"]
    assert report["replayed_batches"] > 0, report["replay_completed"]
    # everything B published before it was registered is indexed
    assert report["late_instance_complete"], report["queries"]


def test_vllm_router_kv_aware_sends_a_repeated_prompt_to_its_host_tier(
        report: dict[str, Any]) -> None:
    for r in report["routed"]:
        assert r["served_by"] == [r["prompt_of"]], r
        # served from that instance's host tier: vLLM counts the prefix from kvtier's host,
        # none from its device, as the indexer said, and kvtier counts the same hit
        assert r["host_tokens"] == PROMPT_BLOCKS * BLOCK and r["device_tokens"] == 0, r
        assert r["as_indexed"], r
    assert report["router_to_host_holder"] and report["router_hits_as_indexed"]


def test_after_reset_the_indexer_sees_no_host_blocks(report: dict[str, Any]) -> None:
    after = report["after_reset"]
    assert after["kvtier_host_blocks_a"] == 0, after
    assert after["indexer_host_blocks_a"] == 0, after["queries"]
    assert after["indexer_matches_kvtier"], after["queries"]
    assert report["reset_zero_host"]
