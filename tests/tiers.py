"""The suite's three tiers and its duration log (hooks called from conftest.py).

Tiers (a marker each, registered in pyproject.toml; `--strict-markers` refuses any other):

| tier | make target | what its tests start |
| --- | --- | --- |
| `fast` | `make test` | no vLLM, no Hugging Face model, no KV-event consumer, no Docker engine |
| `engines` | `make test-engines` | vLLM (`LLM`, `vllm serve`), the KV-event consumers, a HF model |
| `live` | `make test-live` | the docker-compose deployment on a real Docker engine |

Every collected test carries exactly one of them: `tier_problems` names each test with none or
with two, and conftest.py turns a non-empty answer into a collection error (`make test` fails
before it runs anything); `test_tiers.py` checks the whole suite (from the session's own
collection, `record_tiers`, when it collected every module) and a planted untiered test.

Durations: every run writes `.kvtier/test-durations.json`: per tier, the run's wall time and
per test its setup, call and teardown seconds. A run replaces the entries of the tiers it ran
and keeps the others, so `make test`, `make test-engines` and `make test-live` in turn leave
one file with all three (`make test-report` prints it: scripts/test_report.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

TIERS = ("fast", "engines", "live")
# KVTIER_TEST_DURATIONS moves it (test_tiers.py's runs of planted tests write elsewhere)
DURATIONS_FILE = Path(os.environ.get(
    "KVTIER_TEST_DURATIONS",
    Path(__file__).resolve().parent.parent / ".kvtier" / "test-durations.json"))
FORMAT = 1
TIER_PROPERTY = "kvtier_tier"


# The engines tier runs on ENGINES_WORKERS pytest-xdist workers, one module per worker at a time
# (--dist loadfile --no-loadscope-reorder): its modules are handed out in this order, the
# longest first, so that the longest (test_vllm.py) does not start last and hold the tier's end
# alone. Seconds: each module's tests summed in the serial clean-clone run of main 15bafaf.
ENGINES_ORDER = (
    "tests/test_vllm.py",              # 362
    "tests/test_vllm_serve.py",        # 226
    "tests/test_node_vllm.py",         # 95
    "tests/test_real_model.py",        # 80
    "tests/test_kv_routing.py",        # 60
    "tests/test_kv_events.py",         # 45
    "tests/test_kv_events_attached.py",  # 35
)


def module_order(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: the modules of ENGINES_ORDER first, in its order, the rest after
    in collection order; the tests of one module keep theirs. Every xdist worker computes the
    same order (the scheduler requires identical collections)."""
    rank = {path: i for i, path in enumerate(ENGINES_ORDER)}
    position = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        return rank.get(module, len(rank)), position[id(item)]

    items.sort(key=key)


def bind_vllm_to_one_cpu(workerid: str) -> None:
    """In pytest-xdist worker `gwN`, the vLLM processes its tests start run their OpenMP threads
    on one CPU of their own (the N-th allowed CPU, round robin), unless the caller chose:
    vLLM's CPU build otherwise binds one spinning OpenMP thread to every CPU, and two workers'
    vLLMs on the same 2 cores wait on each other's descheduled threads at every barrier (on a
    machine loaded by other jobs, unbound, a test that takes 34 s alone took 178 s beside
    another vLLM, and the two longest modules side by side took 14 min 43 s, as long as the
    whole tier one module at a time; bound, the whole tier took 12 min 30 s on that machine).
    The tiny models need no more than one thread."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or not workerid.startswith("gw"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[int(workerid[2:]) % len(cpus)])


def tiers_of(item: pytest.Item) -> list[str]:
    """The distinct tier markers on `item` (module, class and function marks together)."""
    names = {mark.name for mark in item.iter_markers()}
    return [tier for tier in TIERS if tier in names]


def tier_problems(items: list[pytest.Item]) -> list[str]:
    """One line per test that has no tier marker or more than one."""
    problems = []
    for item in items:
        found = tiers_of(item)
        if len(found) != 1:
            what = "no tier marker" if not found else f"{len(found)} tier markers {found}"
            problems.append(f"{item.nodeid}: {what} (mark it with exactly one of "
                            f"{', '.join(TIERS)})")
    return problems


COLLECTED = pytest.StashKey[dict[str, list[str]]]()
"""config.stash key: {nodeid: tiers} of every test this session collected, before `-m` or
`-k` deselect any (test_tiers.py reads it instead of collecting the suite a second time)."""


def record_tiers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep {nodeid: tiers} of every collected test in `config.stash[COLLECTED]`."""
    config.stash[COLLECTED] = {item.nodeid: tiers_of(item) for item in items}


def dump_tiers(items: list[pytest.Item]) -> None:
    """With KVTIER_TIER_DUMP set, write {nodeid: [tiers]} of every collected test there (for
    test_tiers.py: one collection of the suite answers both "which tests" and "which tier")."""
    path = os.environ.get("KVTIER_TIER_DUMP")
    if path:
        Path(path).write_text(json.dumps({item.nodeid: tiers_of(item) for item in items}))


class DurationLog:
    """Collects per-test phase durations during a run and merges them into DURATIONS_FILE.

    `tests`: nodeid -> {"tier", "setup", "call", "teardown", "outcome"}; `started`: the
    session's start on the monotonic clock. A test's tier comes from its report's
    user_properties (`TIER_PROPERTY`, added by `tag_report`). Only the controlling process
    writes: under pytest-xdist every worker's reports reach the controller too."""

    def __init__(self, path: Path = DURATIONS_FILE) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()

    def report(self, rep: pytest.TestReport) -> None:
        # the tier travels in the report (user_properties survive pytest-xdist's transport)
        tier = dict(rep.user_properties).get(TIER_PROPERTY, "none")
        entry = self.tests.setdefault(rep.nodeid, {
            "tier": tier,
            "setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed"})
        entry[rep.when] = round(entry[rep.when] + rep.duration, 3)
        if rep.failed:
            entry["outcome"] = "failed"
        elif rep.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"

    def write(self, exitstatus: int) -> None:
        if not self.tests:
            return
        wall = round(time.monotonic() - self.started, 3)
        try:
            old = json.loads(self.path.read_text())
            tiers: dict[str, Any] = old["tiers"] if old.get("format") == FORMAT else {}
        except (OSError, ValueError, KeyError, TypeError):
            tiers = {}
        ran: dict[str, dict[str, Any]] = {}
        for nodeid, entry in self.tests.items():
            tier = entry.pop("tier")
            ran.setdefault(tier, {})[nodeid] = entry
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for tier, tests in ran.items():
            tiers[tier] = {
                "finished_at": stamp,
                # the run's wall time; a run of several tiers at once gives each the whole
                "run_wall_s": wall,
                "tiers_in_run": sorted(ran),
                "exitstatus": int(exitstatus),
                "sum_s": round(sum(t["setup"] + t["call"] + t["teardown"]
                                   for t in tests.values()), 1),
                "tests": tests,
            }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"format": FORMAT, "tiers": tiers}, indent=1,
                                  sort_keys=True))
        tmp.replace(self.path)


def tag_report(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Carry the item's tier in its report, for DurationLog (called from makereport)."""
    found = tiers_of(item)
    if TIER_PROPERTY not in dict(rep.user_properties):
        rep.user_properties.append((TIER_PROPERTY, found[0] if len(found) == 1 else "none"))
