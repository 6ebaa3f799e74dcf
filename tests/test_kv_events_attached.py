"""An attached vLLM's own KV events carry the node's tiers: `examples/kv_events.py
--attached` in vLLM's environment, one in-process vLLM attached to a real `kvtier serve`
(file storage, its own KV-event publisher on), vLLM's ZMQ publisher on, a real ZMQ
subscriber decoding with vLLM's `KVEventBatch`.

Runs once (module fixture, ~1-2 min). At each checkpoint the per-medium block sets rebuilt
from vLLM's own stream must equal what the service holds for the namespace: its own
stream's sets (CPU, STORAGE), the host blocks in use from its `/status`, the page files in
its storage folder; minus only what vLLM's stream holds back for want of tokens (blocks a
second engine of the namespace stored, announced once this vLLM serves that prompt).

Break check (by hand, not in CI: a second vLLM run): `--drop-removed-on-evict`, or the
client's `take_events` returning [] (see issue 20's attached note for the failing lines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import require_built
from test_kv_events import RUN_TIMEOUT_S, VLLM_PYTHON, checkpoint, run_example

pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S + 60)]


@pytest.fixture(scope="module", autouse=True)
def built_environments() -> None:
    require_built((VLLM_PYTHON, "make vllm-env"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_example(Path(tmp_path_factory.mktemp("vllm-model")) / "tiny-llama", "--attached")


def test_vllms_own_stream_rebuilds_what_the_service_holds(report: dict[str, Any]) -> None:
    r = report
    assert r["mode"] == "attached" and not r["break_check"], r
    assert r["events_match_state"], r["checkpoints"]
    assert r["media"] == ["CPU", "STORAGE"], r["by_medium"]
    assert r["stored"] > 0 and r["removed"] > 0, r
    assert r["usable_by_indexer"], r["problems"]  # tokens, block size, known parents


def test_evictions_are_removals_and_lost_pages_are_stored_again(report: dict[str, Any]) -> None:
    first = checkpoint(report, "after six prompts")
    assert 0 < first["CPU"]["kvtier"] <= 16 < first["STORAGE"]["kvtier"], first
    assert first["CPU"]["host_blocks_used"] == first["CPU"]["events"], first
    assert first["counts"]["CPU"]["removed"] > 0, first
    lost = checkpoint(report, "pages lost, second prompt again")
    assert lost["STORAGE"]["match"] and lost["STORAGE"]["files"] == lost["STORAGE"]["events"]


def test_another_engines_blocks_are_announced_once_this_vllm_knows_their_tokens(
        report: dict[str, Any]) -> None:
    other = checkpoint(report, "another engine stored a prompt")
    assert other["held_back"]["CPU"] == 6 and other["CPU"]["match"], other
    served = checkpoint(report, "this vLLM served the other engine's prompt")
    assert served["held_back"] == {"CPU": 0, "STORAGE": 0}, served
    assert served["CPU"]["events"] >= 6 and served["CPU"]["match"], served


def test_the_services_reset_removes_every_host_block(report: dict[str, Any]) -> None:
    reset = checkpoint(report, "after POST /reset")
    assert reset["CPU"]["events"] == 0 and reset["CPU"]["kvtier"] == 0, reset
    assert reset["CPU"]["host_blocks_used"] == 0, reset
    assert reset["STORAGE"]["events"] > 0 and reset["STORAGE"]["match"], reset


def test_an_audit_mismatch_is_removed_by_the_service(report: dict[str, Any]) -> None:
    """Issue 40, attached: the namespace's host pages overwritten, the audit (1 in 1) finds
    the first prompt's blocks mismatched and asks the service to remove them (the REMOVE
    op): their host copies and page files are gone, and vLLM's stream says so (CPU and
    STORAGE removals), still equal to what the service holds."""
    before = checkpoint(report, "vLLM's reset, first prompt again")
    after = checkpoint(report, "audit mismatch, first prompt again")
    mismatched = sum(after["audit"]["mismatch"].values())
    assert mismatched > 0, after
    assert after["CPU"]["match"] and after["STORAGE"]["match"], after
    assert after["STORAGE"]["files"] <= before["STORAGE"]["files"] - mismatched, (before, after)
    for medium in ("CPU", "STORAGE"):
        assert (after["counts"][medium]["removed"]
                >= before["counts"][medium]["removed"] + mismatched), (medium, before, after)
