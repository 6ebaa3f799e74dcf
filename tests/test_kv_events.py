"""kvtier's tiers in vLLM's own KV events, read as a router reads them: `examples/kv_events.py`
in vLLM's environment (`make vllm-env`), one in-process vLLM with kvtier embedded and vLLM's
ZMQ publisher on, a real ZMQ subscriber decoding with vLLM's `KVEventBatch`.

The run evicts host copies, backs blocks up to file storage, serves a prompt from storage and
empties the host tier with `POST /reset`; at each checkpoint the per-medium block sets rebuilt
from the events must equal what kvtier holds (its tree for CPU, the page files for STORAGE),
and the example reports whether every stored event is indexable (tokens, block size, a known
parent, no ownership, not remote; not asserted yet, see the note of issue 20). The break
check drops the removed events of evicted host copies: the sets then differ, so the
comparison can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm") / "bin" / "python"
EXAMPLE = ROOT / "examples" / "kv_events.py"
RUN_TIMEOUT_S = 400

if not VLLM_PYTHON.exists():
    if os.environ.get("CI"):
        raise RuntimeError(f"{VLLM_PYTHON} is missing: `make test` builds it (make vllm-env)")
    pytest.skip(f"vLLM's environment {VLLM_PYTHON} is not built (make vllm-env)",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(RUN_TIMEOUT_S * 2 + 60)]


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
        raise AssertionError(f"the example failed (status {proc.returncode}):\n{tail}")
    report: dict[str, Any] = json.loads(lines[-1])
    return report


def test_the_blocks_rebuilt_from_vllms_events_are_what_kvtier_holds(model_dir: Path) -> None:
    r = run_example(model_dir)
    assert r["events_match_state"], r["checkpoints"]
    assert r["media"] == ["CPU", "STORAGE"], r["by_medium"]
    assert r["stored"] > 0 and r["removed"] > 0, r
    # not asserted (issue 20, open): `usable_by_indexer` (a few CPU stores of blocks brought
    # back from storage come out as vLLM's placeholder payload, without tokens)
    first, again, reset = r["checkpoints"]
    assert again["CPU"]["kvtier"] > 0, again  # the first prompt's blocks back on the host
    # evictions happened (36 blocks through a 16-block host tier), storage has every block
    assert 0 < first["CPU"]["kvtier"] <= 16 < first["STORAGE"]["kvtier"], first
    assert r["by_medium"]["CPU"]["removed"] >= r["blocks"] - 16, r["by_medium"]
    assert reset["CPU"]["kvtier"] == 0 and reset["STORAGE"]["kvtier"] > 0, reset


def test_break_check_dropping_eviction_removals_is_caught(model_dir: Path) -> None:
    r = run_example(model_dir, "--drop-removed-on-evict")
    assert r["break_check"] and not r["events_match_state"], r["checkpoints"]
