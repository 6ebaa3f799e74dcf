"""The admin's OpenAPI document describes the API it serves: schemathesis, with every check,
against a running `kvtier serve`.

Issue 11 item 13: the 401, 400, 409, 413 and 503 answers were undocumented and the 422 body
was not the documented one. schemathesis (a dev dependency) reads /openapi.json and sends
generated requests, valid and invalid, to every operation with the bearer token the server
generated; each check holds each answer to the document: no 5xx, every status documented,
every body matching its schema and content type, valid bodies accepted, invalid ones refused,
an operation that declares the token refused without it, unsupported methods answered 405.
Bounded: 20 examples an operation, a fixed seed, loopback only, tiny limits (so generated
lists stay small).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_support import ServeProcess, tiny_toml
from support import clean_env, module_command, new_deployment_id

# `kvtier serve` with a worker, and a schemathesis run
pytestmark = [pytest.mark.fast, pytest.mark.slow]

SEED = 20240611
MAX_EXAMPLES = 20


def schemathesis() -> str:
    path = Path(sys.executable).parent / "schemathesis"
    if not path.exists():
        pytest.fail(f"{path} not found: install the dev extra (pip install -e '.[dev]')")
    return str(path)


def test_schemathesis_finds_nothing_the_document_does_not_say(tmp_path: Path) -> None:
    dep = new_deployment_id("oas")
    config = tiny_toml(tmp_path / "kvtier.toml", dep,
                       extra="max_pin_tokens = 64\nmax_extra_keys = 4\n")
    with ServeProcess(module_command(), ["serve", "--config", str(config)], deployment_id=dep,
                      log_path=tmp_path / "serve.log") as serve:
        spec = httpx.get(f"{serve.url}/openapi.json", timeout=10).json()
        assert len(spec["paths"]) == 18  # 11 + the 7 steering routes of the node (issue 36)
        result = subprocess.run(
            [schemathesis(), "run", f"{serve.url}/openapi.json", "--checks", "all",
             "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--workers", "1",
             "--request-timeout", "30", "--no-color",
             "--header", f"Authorization: Bearer {serve.token()}"],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=clean_env())
        report = result.stdout + result.stderr
        assert result.returncode == 0, report[-8000:]
        assert "Tested: 18" in report and " failed" not in report.split("SUMMARY")[-1], report
        assert serve.stop(signal.SIGTERM) == 0, serve.log()[-4000:]
