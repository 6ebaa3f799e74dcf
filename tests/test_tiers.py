"""The tiers themselves (tests/tiers.py, the hooks in conftest.py): every test of the suite is
in exactly one tier, a test in none or in two stops collection naming it, and every run leaves
its tier's durations in the durations file that `make test-report` prints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiers import COLLECTED, TIERS

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
# main f61ab16, before the tiers: 979 tests ran and 81 were skipped for want of a GPU
TOTAL_BEFORE_TIERS = 1060

PLANTED = '''
import pytest

def test_untiered():
    pass

@pytest.mark.fast
@pytest.mark.engines
def test_two_tiers():
    pass

@pytest.mark.fast
def test_fast_one():
    pass

@pytest.mark.engines
def test_engines_one():
    pass
'''

# The suite's own hooks, loaded from tests/conftest.py under another name so that a folder of
# planted tests runs under exactly the collection and duration hooks the suite runs under.
CONFTEST = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)
for _name in dir(_mod):
    if _name.startswith("pytest_"):
        globals()[_name] = getattr(_mod, _name)
'''


def pytest_run(*args: str, env: dict[str, str] | None = None,
               rootdir: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
         str(rootdir), "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=240, cwd=REPO,
        env={**os.environ, **(env or {})})


def suite_tiers(config: pytest.Config, tmp_path: Path) -> tuple[dict[str, list[str]], set[str]]:
    """{nodeid: tiers} of every test of the suite, and the ids collected. From this session's
    own collection when it collected every module of tests/ (`make test` does: the tier hook
    runs before `-m fast` deselects; in each pytest-xdist worker too), which saves a second
    collection of the whole suite (16.5 s of CI's fast tier); else (this module run alone,
    or a few modules) from a `--collect-only` run of the suite, its ids from pytest's output
    and its tiers from the hook's dump (KVTIER_TIER_DUMP)."""
    seen = config.stash.get(COLLECTED, {})
    modules = {f"tests/{path.name}" for path in TESTS.glob("test_*.py")}
    if {nodeid.split("::")[0] for nodeid in seen} == modules:
        return seen, set(seen)
    dump = tmp_path / "tiers.json"
    proc = pytest_run("--collect-only", "-q", str(TESTS), env={"KVTIER_TIER_DUMP": str(dump)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = {line for line in proc.stdout.splitlines() if "::" in line}
    tiers: dict[str, list[str]] = json.loads(dump.read_text())
    return tiers, ids


def test_every_test_of_the_suite_is_in_exactly_one_tier(request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    tiers, ids = suite_tiers(request.config, tmp_path)
    assert set(tiers) == ids and len(ids) >= TOTAL_BEFORE_TIERS, len(ids)
    assert {nodeid: found for nodeid, found in tiers.items() if len(found) != 1} == {}
    per_tier = {tier: sum(found == [tier] for found in tiers.values()) for tier in TIERS}
    assert all(per_tier.values()), per_tier


def test_a_test_in_no_tier_or_two_stops_collection_naming_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = {"KVTIER_TEST_DURATIONS": str(tmp_path / "durations.json")}
    proc = pytest_run("-q", str(tmp_path / "test_planted.py"), "-m", "fast", env=env,
                      rootdir=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "2 test(s) not in exactly one tier" in out, out
    assert "test_planted.py::test_untiered: no tier marker" in out, out
    assert "test_planted.py::test_two_tiers: 2 tier markers ['fast', 'engines']" in out, out
    assert "test_fast_one" not in out and "test_engines_one" not in out, out
    assert not (tmp_path / "durations.json").exists()  # nothing ran

    # the two well-marked tests alone run, and each run keeps the other tier's durations
    for tier in ("fast", "engines"):
        proc = pytest_run("-q", f"{tmp_path / 'test_planted.py'}::test_{tier}_one", env=env,
                          rootdir=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((tmp_path / "durations.json").read_text())
    assert set(data["tiers"]) == {"fast", "engines"}, data
    for tier in ("fast", "engines"):
        [(nodeid, entry)] = data["tiers"][tier]["tests"].items()
        assert nodeid.endswith(f"test_planted.py::test_{tier}_one"), nodeid
        assert entry["outcome"] == "passed" and entry["call"] >= 0.0, entry
        assert set(entry) == {"setup", "call", "teardown", "outcome"}, entry
        assert data["tiers"][tier]["run_wall_s"] > 0 and data["tiers"][tier]["exitstatus"] == 0

    shown = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "test_report.py"), "--file",
         str(tmp_path / "durations.json")], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[1].startswith("fast ") and lines[2].startswith("engines "), shown.stdout
    assert "the 2 slowest tests" in shown.stdout and "test_engines_one" in shown.stdout

    missing = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "test_report.py"), "--file",
         str(tmp_path / "none.json")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and len(missing.stderr.strip().splitlines()) == 1
    assert "run a tier first" in missing.stderr
