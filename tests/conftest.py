"""Fixtures and hooks every test module gets (helpers to import are in support.py).

- `redis_server`, `redis_cluster`: a real redis-server / 3-node Redis Cluster, one per module
  that asks for it (defined in redis_server.py, which bench/ imports too).
- `shm_name`: a fresh host-pool segment name; the test fails if the segment is left behind.
- Tests marked `cuda` are skipped, with the reason shown, where torch sees no CUDA GPU.
- Every test is in exactly one tier (`fast`, `engines`, `live`: tiers.py); collection fails,
  naming each test, when one has none or two. Every run writes .kvtier/test-durations.json.
- At the session's end (`leaks`): a `kvtier serve` or worker process a test left running, or
  a /dev/shm name of one of the run's deployments, is killed or removed, listed loudly, and
  fails the session.
- Hypothesis profiles: `ci` (CI=true: the budgets written in the tests) and `dev` (the rest:
  a third of them), both without deadlines; `KVTIER_HYPOTHESIS_PROFILE` picks one. Tests scale
  their `max_examples` with `support.examples(n)`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import leaks
import posix_ipc
import pytest
from hypothesis import settings
from redis_server import redis_cluster, redis_server
from support import HYPOTHESIS_PROFILE, new_segment_name
from tiers import (
    DurationLog,
    bind_vllm_to_one_cpu,
    dump_tiers,
    module_order,
    record_tiers,
    tag_report,
    tier_problems,
)

__all__ = ["redis_cluster", "redis_server"]  # module-scoped fixtures, shared by every module

NO_CUDA = "needs a CUDA GPU: torch.cuda.is_available() is false"

# Tests that state no budget: CI's 100 examples (hypothesis' default), a contributor's 40.
# Deadlines: 2 s on CI's loaded machine, 1 s elsewhere, for the pure-function tests; every test
# that starts processes or threads turns them off in its own settings (deadline=None).
settings.register_profile("ci", max_examples=100, deadline=2000, print_blob=True)
settings.register_profile("dev", max_examples=40, deadline=1000)
settings.load_profile(HYPOTHESIS_PROFILE)


_DURATIONS: list[DurationLog] = []  # the controller's log (none in a pytest-xdist worker)
_STARTED: list[float] = []  # the controller's start (wall clock), for `leaks.vllm_segments`


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller, or a run without pytest-xdist
        _DURATIONS[:] = [DurationLog()]
        _STARTED[:] = [time.time()]
    else:
        bind_vllm_to_one_cpu(str(config.workerinput.get("workerid", "")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for log in _DURATIONS:
        log.report(report)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for log in _DURATIONS:
        log.write(exitstatus)
    root = Path(str(session.config.rootpath))
    leaks.sweep(root)  # this process's (an xdist worker's, or the one process's)
    if hasattr(session.config, "workerinput"):
        return
    found = leaks.report(root)  # the workers' too: they finished before the controller
    vllm_left = leaks.vllm_segments(_STARTED[0]) if _STARTED else ""
    if vllm_left:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.ensure_newline()
            tr.write_line(f"kvtier tests: {vllm_left}")
    if found:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        text = (f"LEAKED by this run's tests ({len(found)}; killed and removed now):\n  "
                + "\n  ".join(found))
        if tr is not None:
            tr.write_sep("!", "kvtier leaks", red=True, bold=True)
            tr.write_line(text)
        else:
            print(text, file=sys.stderr)
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[pytest.TestReport]:
    rep: pytest.TestReport = yield
    tag_report(item, rep)
    return rep


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a test in no tier or in two; skip the `cuda` tests on a machine without a GPU.
    torch is imported only when such a test was collected (it costs seconds, and most runs
    select none)."""
    problems = tier_problems(items)
    dump_tiers(items)
    record_tiers(config, items)
    if problems:
        raise pytest.UsageError(
            f"{len(problems)} test(s) not in exactly one tier:\n" + "\n".join(problems))
    module_order(items)
    cuda_items = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not cuda_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in cuda_items:
        item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session", autouse=True)
def private_state_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """kvtier keeps generated secrets (the admin token, the storage secret) under
    $XDG_STATE_HOME/kvtier and, by default, file storage pages under $XDG_CACHE_HOME/kvtier;
    the suite and every process it starts use folders of its own, never the user's home.
    Tests about those files point them elsewhere themselves."""
    import os

    saved = {name: os.environ.get(name) for name in ("XDG_STATE_HOME", "XDG_CACHE_HOME")}
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    yield
    for name, old in saved.items():
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@pytest.fixture
def shm_name() -> Iterator[str]:
    """A fresh name for a host pool's shared-memory segment (`/kvtier_<id>_host_r0`); the
    test must leave no segment of that name behind."""
    name = new_segment_name()
    yield name
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass
    else:
        pytest.fail(f"segment {name} was left behind")
