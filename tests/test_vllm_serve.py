"""kvtier inside the real `vllm serve` CLI (vLLM's CPU build in `.venv-vllm`), as an operator
meets it: started with default settings, driven over vLLM's OpenAI-compatible HTTP API with
token-id prompts (the tiny random Llama of examples/vllm_offload.py has no tokenizer), and
stopped the ways an operator stops it.

* Two instances side by side with default settings (no admin port, no sizes, no storage path
  given); each is stopped, one by Ctrl-C (SIGINT to its process group, as a terminal sends it),
  one by SIGTERM to its main process (as `docker stop` sends it). vLLM then kills its engine
  process tree with SIGKILL, so what this checks is kvtier's watcher: no name of either
  deployment is left in /dev/shm or among the message queues, no log folder in /tmp, no state
  folder.
* A crash (kill -9 of every process, kvtier's watcher and worker included) leaves the names;
  the next start removes them. That start finds the crashed instance's pages in the default
  file storage (the same model reuses one location), so its run hits storage and then host:
  kvtier's /status and /metrics, vLLM's `prompt_tokens_cached_by_source` and the Grafana
  dashboard's hit-rate queries (Prometheus scraping both) are read and checked against each
  other.
* A mistyped key in `kv_connector_extra_config` stops vLLM with one line naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compose_support import dashboard_queries, promql_without_grafana_variables
from support import (
    free_port,
    leftovers,
    pid_exists,
    remove_leftovers,
    require_built,
    require_tool,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm")
VLLM = VLLM_VENV / "bin" / "vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
BLOCK = 32
VOCAB = 512
PROMPT_TOKENS = 200  # 6 full blocks of 32 + 8
LONG_TOKENS = 300  # 9 full blocks + 12
LONG_PREFIX = 288
START_TIMEOUT_S = 420  # two vLLM servers starting at once on two shared cores
STOP_TIMEOUT_S = 60


pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(3 * START_TIMEOUT_S + 300)]


@pytest.fixture(scope="module", autouse=True)
def built_environments() -> None:
    require_built((VLLM_PYTHON, "make vllm-env"))


START_LINE = re.compile(r"kvtier offloading: deployment (vllm-[0-9a-f]{12}), (\d+) host blocks "
                        r".*?, admin (http://[0-9.]+:\d+)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-model") / "tiny-llama"
    subprocess.run([str(VLLM_PYTHON), "-c", "import sys; sys.path.insert(0, 'examples'); "
                    "from pathlib import Path; import vllm_offload; "
                    f"vllm_offload.build_model(Path({str(path)!r}))"],
                   cwd=ROOT, check=True, capture_output=True, timeout=300)
    return path


class Served:
    """One `vllm serve` process (its own process group) with kvtier, its log file, and what
    its log says of kvtier (deployment id, admin URL)."""

    def __init__(self, model: Path, home: Path, log: Path, extra: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self.model = str(model)
        kt = {"kv_connector": "KvtierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec",
                                            "spec_module_path": "kvtier.integrations.vllm",
                                            **extra}}
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVTIER_")}
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "XDG_CACHE_HOME": str(home / "cache"),
                    "XDG_STATE_HOME": str(home / "state")})
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [str(VLLM), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port),
             "--enforce-eager", "--skip-tokenizer-init", "--max-model-len", "320",
             "--block-size", str(BLOCK), "--dtype", "bfloat16", "--num-gpu-blocks-override",
             "12", "--seed", "0", "--kv-transfer-config", json.dumps(kt)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=home,
            start_new_session=True)
        self.deployment_id = ""
        self.admin_url = ""
        self.host_blocks = 0

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    return bool(r.status == 200)
            except (urllib.error.URLError, OSError):
                return False

        wait_until(ready, START_TIMEOUT_S, f"vllm serve on {self.url} healthy", 1.0)
        found = START_LINE.search(self.text())
        assert found, f"kvtier's start line is not in vLLM's log:\n{self.tail()}"
        self.deployment_id, blocks, self.admin_url = found.groups()
        self.host_blocks = int(blocks)

    def complete(self, tokens: list[int]) -> dict[str, Any]:
        body = {"model": self.model, "prompt": tokens, "max_tokens": 4, "temperature": 0.0}
        req = urllib.request.Request(self.url + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            out: dict[str, Any] = json.loads(r.read())
        return out

    def stop(self, sig: signal.Signals, *, group: bool) -> int:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self._log.close()


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def prompts(seed: int, n: int = PROMPT_TOKENS) -> tuple[list[int], list[list[int]]]:
    """Prompt A and four others of `n` tokens (the others push A out of vLLM's 12 blocks)."""
    rng = random.Random(seed)
    a = [rng.randrange(VOCAB) for _ in range(n)]
    return a, [[rng.randrange(VOCAB) for _ in range(n)] for _ in range(4)]


def left_of(deployment_id: str, home: Path) -> list[str]:
    """Everything of the deployment still there: IPC names, /tmp log folders, its state."""
    found = leftovers(deployment_id, 1)
    found += [str(p) for p in Path("/tmp").glob(f"kvtier-{deployment_id}-*")]
    state = home / "state" / "kvtier" / deployment_id
    if state.exists():
        found.append(str(state))
    return found


def watcher_pids(deployment_id: str) -> list[int]:
    """The pids of kvtier's watcher processes of the deployment (from /proc)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            if b"kvtier.manager.janitor" in cmd and deployment_id.encode() in cmd:
                pids.append(int(proc.name))
    return pids


@contextlib.contextmanager
def serving(model: Path, home: Path, name: str, **extra: Any) -> Iterator[Served]:
    s = Served(model, home, home / f"{name}.log", extra)
    try:
        yield s
    finally:
        s.close()
        if s.deployment_id:  # the watcher cleans up after a failed test too; else by hand
            with contextlib.suppress(AssertionError):
                wait_until(lambda: not watcher_pids(s.deployment_id), 30, "watcher done", 0.2)
            for pid in watcher_pids(s.deployment_id):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            remove_leftovers(s.deployment_id)
            for path in Path("/tmp").glob(f"kvtier-{s.deployment_id}-*"):
                shutil.rmtree(path, ignore_errors=True)


def test_two_instances_with_defaults_serve_and_stop_clean_on_ctrl_c_and_sigterm(
        model_dir: Path, tmp_path: Path) -> None:
    with serving(model_dir, tmp_path, "a") as a, serving(model_dir, tmp_path, "b") as b:
        a.wait_ready()
        b.wait_ready()
        assert a.deployment_id != b.deployment_id
        assert a.admin_url != b.admin_url, "two instances on one admin port"
        for s in (a, b):
            for text in ("This API is experimental", "out-of-tree offloading spec"):
                assert text not in s.text(), f"vLLM's log still says {text!r}"
            status = json.loads(get(s.admin_url + "/status"))
            assert status["deployment_id"] == s.deployment_id
            assert status["tiers"]["host"]["capacity"] == s.host_blocks > 0, status["tiers"]
            # sized from this machine, stored where every instance of the model looks
            assert re.search(r"defaults: host tier \d+ blocks per rank \((10% of MemAvailable|"
                             r"50% of free /dev/shm) ", s.text()), s.tail(5)
            storage = tmp_path / "cache" / "kvtier" / "vllm" / "storage"
            assert f"storage file {storage}," in s.text(), s.tail(5)
            prompt, _ = prompts(7)
            out = s.complete(prompt)
            assert out["usage"]["prompt_tokens"] == PROMPT_TOKENS, out
            assert out["usage"]["completion_tokens"] == 4, out
        assert a.stop(signal.SIGINT, group=True) is not None  # Ctrl-C
        assert b.stop(signal.SIGTERM, group=False) is not None  # docker stop
        for s in (a, b):
            left: list[str] = []

            def clean(s: Served = s) -> bool:
                nonlocal left
                left = left_of(s.deployment_id, tmp_path)
                return not left

            try:
                wait_until(clean, 30, "the deployment's names gone", 0.2)
            except AssertionError:
                raise AssertionError(
                    f"{s.deployment_id} left {left} after vllm serve stopped:\n"
                    f"{s.tail(20)}") from None
            wait_until(lambda s=s: not watcher_pids(s.deployment_id), 30, "the watcher exited",
                       0.2)


def test_unknown_key_stops_vllm_with_one_line_naming_it(model_dir: Path, tmp_path: Path) -> None:
    with serving(model_dir, tmp_path, "typo", host_block=16) as s:
        def ended() -> bool:
            with contextlib.suppress(OSError), urllib.request.urlopen(s.url + "/health",
                                                                        timeout=5):
                raise AssertionError(f"vLLM started with an unknown key:\n{s.tail()}")
            return s.proc.poll() is not None

        wait_until(ended, START_TIMEOUT_S, "vllm serve refused the key", 1.0)
        assert s.proc.returncode != 0
        line = ("kv_connector_extra_config: unknown key 'host_block' (did you mean "
                "'host_blocks'?); kvtier reads ")
        assert line in s.text(), s.tail()
        assert not pid_exists(s.proc.pid)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (Prometheus text)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: dict[str, str]) -> Iterator[str]:
    """A real Prometheus (Debian package `prometheus`) scraping `targets` (job -> host:port)
    every second on loopback; yields its URL."""
    binary = require_tool("prometheus", "prometheus")
    port = free_port()
    jobs = "".join(f"  - job_name: {job}\n    static_configs:\n      - targets: [\"{t}\"]\n"
                   for job, t in targets.items())
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                      f"scrape_configs:\n{jobs}")
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={config}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            with contextlib.suppress(OSError):
                return "Ready" in get(url + "/-/ready")
            return False

        wait_until(ready, 60, "prometheus ready", 0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def promql(url: str, expr: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": expr})
    body = json.loads(get(f"{url}/api/v1/query?{q}"))
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def test_a_crash_is_reclaimed_at_the_next_start_and_every_figure_is_right(
        model_dir: Path, tmp_path: Path) -> None:
    # 300 tokens: 9 full blocks, 288 tokens, past kvtier's default storage.prefetch_threshold
    # (256 tokens: a shorter storage hit is not worth a prefetch)
    prompt, others = prompts(11, LONG_TOKENS)
    with serving(model_dir, tmp_path, "crashed") as crashed:
        crashed.wait_ready()
        for p in (prompt, *others):
            crashed.complete(p)
        wait_until(lambda: not json.loads(get(crashed.admin_url + "/status"))["tasks_inflight"],
                   60, "kvtier's backups to storage landed", 0.2)
        status = json.loads(get(crashed.admin_url + "/status"))
        workers = [int(w["pid"]) for w in status["workers"] if w.get("pid")]
        watchers = watcher_pids(crashed.deployment_id)
        assert workers and watchers, (workers, watchers)
        for pid in (*workers, *watchers):  # everything dies at once: nothing cleans up
            os.kill(pid, signal.SIGKILL)
        os.killpg(crashed.proc.pid, signal.SIGKILL)
        crashed.proc.wait(timeout=STOP_TIMEOUT_S)
        wait_until(lambda: not any(pid_exists(p) for p in (*workers, *watchers)), 30,
                   "the crashed processes gone")
        stale = left_of(crashed.deployment_id, tmp_path)
        assert any("_ctl" in n for n in stale), f"a crash left nothing to reclaim: {stale}"

    with serving(model_dir, tmp_path, "restarted") as s:
        s.wait_ready()
        assert left_of(crashed.deployment_id, tmp_path) == [], "the crash was not reclaimed"
        assert f"names of dead deployment {crashed.deployment_id}" in s.text()
        admin = s.admin_url.removeprefix("http://")
        with prometheus(tmp_path, {"kvtier-vllm": admin, "vllm": f"127.0.0.1:{s.port}"}) as prom:
            wait_until(lambda: len(promql(prom, "up == 1")) == 2, 60, "both targets up", 0.5)
            s.complete(prompt)  # from the crashed run's pages in the default file storage
            for p in prompts(12, LONG_TOKENS)[1]:  # new ones (misses) push it out of vLLM
                s.complete(p)
            s.complete(prompt)  # from kvtier's host tier
            kvtier_metrics = get(s.admin_url + "/metrics")
            vllm_metrics = get(s.url + "/metrics")
            status = json.loads(get(s.admin_url + "/status"))
            time.sleep(3)  # two more scrapes of the final counters
            hit_expr = next(e for e in dashboard_queries() if "kvtier_lookup_tokens_total" in e)
            dashboard = {r["metric"]["tier"]: float(r["value"][1])
                         for r in promql(prom, promql_without_grafana_variables(hit_expr, "5m"))}

    hits = {t: metric(kvtier_metrics, "kvtier_hit_tokens_total", tier=t)
            for t in ("host", "storage")}
    lookup = metric(kvtier_metrics, "kvtier_lookup_tokens_total")
    assert hits == {"host": LONG_PREFIX, "storage": LONG_PREFIX}, hits
    # kvtier was asked about each of the 6 prompts' 9 full blocks (none on vLLM's device)
    assert lookup == 6 * LONG_PREFIX, lookup
    rate = status["hit_rate"]
    assert rate["host"] == rate["storage"] == pytest.approx(LONG_PREFIX / lookup), rate
    by_source = {src: metric(vllm_metrics, "vllm:prompt_tokens_cached_by_source_total",
                             source=src) for src in ("host", "disk", "device")}
    assert by_source == {"host": LONG_PREFIX, "disk": LONG_PREFIX, "device": 0}, by_source
    assert dashboard["host"] == pytest.approx(rate["host"], rel=1e-3), dashboard
    assert dashboard["storage"] == pytest.approx(rate["storage"], rel=1e-3), dashboard
    # vLLM's own /metrics (issue 20): its offload transfer series from kvtier's copies, and
    # kvtier's figures through the connector's get_stats, non-zero after this traffic
    offload = {name + "".join(labels.values()): metric(vllm_metrics, name + "_total", **labels)
               for name, labels in (
                   ("vllm:kv_offload_load_bytes", {}), ("vllm:kv_offload_store_bytes", {}),
                   ("vllm:kv_offload_kvtier_lookups", {}), ("vllm:kv_offload_kvtier_misses", {}),
                   ("vllm:kv_offload_kvtier_hits", {"tier": "host"}),
                   ("vllm:kv_offload_kvtier_hits", {"tier": "storage"}))}
    assert all(v > 0 for v in offload.values()), offload
    # whole blocks: the prompt's 9 from the host, 9 from storage
    assert offload["vllm:kv_offload_kvtier_hitshost"] == LONG_PREFIX // BLOCK, offload
    assert offload["vllm:kv_offload_kvtier_hitsstorage"] == LONG_PREFIX // BLOCK, offload
    assert "vllm:kv_offload_kvtier_evictions_total" in vllm_metrics
    assert metric(vllm_metrics, "vllm:kv_offload_kvtier_host_usage_perc") > 0, vllm_metrics
