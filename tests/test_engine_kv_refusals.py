"""`kvtier serve` with engine-KV registrations (`workers.engine_kv = true`) it must refuse
(issue 34, 9): a record that is truncated JSON, garbage, another user's, or names a live
process of another user. Each is refused (as before), and now named at once in the start
error, with why: the manager's start-up cleanup removed such records, so the worker waited
its whole timeout (16 s) and said none was registered.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_runner import RunnerKV
from kvtier.worker import kvreg
from kvtier.worker.ipc import process_start_time
from serve_support import tiny_toml
from support import kvtier_script, new_deployment_id, remove_leftovers

pytestmark = pytest.mark.fast


@pytest.fixture
def dep() -> Iterator[str]:
    d = new_deployment_id("ekr")
    yield d
    remove_leftovers(d)


def _serve(tmp: Path, dep: str) -> tuple[subprocess.CompletedProcess[str], float]:
    toml = tiny_toml(tmp / "kvtier.toml", dep, storage="none",
                     extra="[node]\nenabled = false\n")
    text = toml.read_text().replace('[workers]\n', '[workers]\nengine_kv = true\n')
    toml.write_text(text)
    t0 = time.monotonic()
    out = subprocess.run([str(kvtier_script()), "serve", "--config", str(toml)],
                         capture_output=True, text=True, timeout=90)
    return out, time.monotonic() - t0


def _other_user_process() -> subprocess.Popen[bytes] | None:
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    return subprocess.Popen([setpriv, "--reuid", "65534", "--regid", "65534",
                             "--clear-groups", "sleep", "60"])


@pytest.mark.parametrize("case", ["truncated", "garbage", "another uid", "another's pid"])
def test_a_refused_registration_is_named_at_once(tmp_path: Path, dep: str, case: str) -> None:
    name = kvreg.registration_name(dep, 0)
    runner = None
    other = None
    try:
        if case == "truncated":
            kvreg.create_segment(name, b'{"format": "kvtier-engine-kv", "vers').close()
            why = "not a JSON registration record"
        elif case == "garbage":
            kvreg.create_segment(name, b"\xff\xfe garbage \x00" * 8).close()
            why = "not a JSON registration record"
        else:
            other = _other_user_process()
            if other is None:
                pytest.skip("needs root and setpriv to make another user's name or process")
            runner = RunnerKV(dep, 1, "vllm", layers=2, blocks=64, block_size=4, heads=2,
                              head_dim=8)
            if case == "another uid":
                os.chown(f"/dev/shm/{name.lstrip('/')}", 65534, -1)
                why = "owned by uid 65534, not this user"
            else:
                rec = kvreg.read_record(dep, 0)
                assert rec is not None
                start = None
                while start is None:  # the process exists once setpriv exec'd sleep
                    start = process_start_time(other.pid)
                forged = dataclasses.replace(rec, owner_pid=other.pid, owner_start=start)
                kvreg.unlink(name)
                kvreg.create_segment(name, kvreg.encode_record(forged)).close()
                why = f"names model runner pid {other.pid}, a process of uid 65534"
        out, took = _serve(tmp_path, dep)
        assert out.returncode != 0, out.stderr[-2000:]
        last = out.stderr.strip().splitlines()[-1]
        print(f"{case}: refused in {took:.1f} s: {last}")
        assert name in last and why in last, out.stderr[-3000:]
        assert "none was registered" not in out.stderr
        assert took < 12.0, took  # not the 16 s wait
    finally:
        if other is not None:
            other.kill()
            other.wait(10)
        if runner is not None:
            runner.close()
        kvreg.unlink(name)
