"""A real Prometheus server scrapes a running `kvtier serve`, and its query API sees every rank.

Prometheus (Debian package `prometheus`) is started on a free loopback port with the flags of
the compose file's prometheus service (paths moved into a temporary directory), a scrape
interval of 1 s and the serve process's admin as the only target. Passing means Prometheus
itself parsed the exposition (the target is up, no scrape error), `kvtier_worker_up` is 1 for
every rank, and every query of the Grafana dashboard evaluates against the live data.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from compose_support import compose, dashboard_queries, promql_without_grafana_variables
from serve_support import ServeProcess, tiny_toml
from support import (
    free_port,
    module_command,
    new_deployment_id,
    promtool,
    require_tool,
    wait_until,
)

# a prometheus server scraping `kvtier serve` with two workers
pytestmark = [pytest.mark.fast, pytest.mark.slow]

RANKS = 2


def prometheus_flags(config: Path, data: Path, port: int) -> list[str]:
    """The compose prometheus service's command with its paths moved to `config` and `data`,
    listening on 127.0.0.1:`port`."""
    flags = []
    for flag in compose()["services"]["prometheus"]["command"]:
        name, _, _ = flag.partition("=")
        if name == "--config.file":
            flag = f"{name}={config}"
        elif name == "--storage.tsdb.path":
            flag = f"{name}={data}"
        flags.append(flag)
    return [*flags, f"--web.listen-address=127.0.0.1:{port}"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[ServeProcess]:
    dep = new_deployment_id("prom")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, workers=RANKS)
    with ServeProcess(module_command(), ["serve", "--config", str(config)],
                      deployment_id=dep, log_path=tmp_path / "serve.log") as serve:
        yield serve
        assert serve.stop(signal.SIGTERM) == 0


@pytest.fixture
def prometheus(tmp_path: Path, served: ServeProcess) -> Iterator[httpx.Client]:
    binary = require_tool("prometheus", "prometheus")
    target = urlsplit(served.url).netloc
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "kvtier", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [target]}]}],
    }))
    port = free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, *prometheus_flags(config, tmp_path / "tsdb", port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError("prometheus exited:\n"
                                 + (tmp_path / "prometheus.log").read_text(errors="replace"))
        with contextlib.suppress(httpx.HTTPError):
            return client.get("/-/ready").status_code == 200
        return False

    try:
        wait_until(ready, 30, "prometheus to be ready", 0.1)
        yield client
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def query(client: httpx.Client, promql: str) -> list[dict[str, Any]]:
    answer = client.get("/api/v1/query", params={"query": promql})
    body = answer.json()
    assert answer.status_code == 200 and body["status"] == "success", (promql, body)
    return body["data"]["result"]


def test_prometheus_sees_every_rank_up(prometheus: httpx.Client) -> None:
    def every_rank_up() -> dict[str, str] | None:
        found = {r["metric"]["rank"]: r["value"][1] for r in query(prometheus, "kvtier_worker_up")}
        return found if found == {str(r): "1" for r in range(RANKS)} else None

    wait_until(every_rank_up, 30, "kvtier_worker_up == 1 for every rank", 0.25)
    targets = prometheus.get("/api/v1/targets").json()["data"]["activeTargets"]
    assert [(t["health"], t["lastError"]) for t in targets] == [("up", "")]
    (up,) = query(prometheus, 'up{job="kvtier"}')
    assert up["value"][1] == "1"
    for expr in dashboard_queries():
        query(prometheus, promql_without_grafana_variables(expr, "1m"))
    capacity = {r["metric"]["tier"]: r["value"][1]
                for r in query(prometheus, "kvtier_capacity_blocks")}
    assert capacity == {"device": "64", "host": "64"}
    # Issue 11 item 1: failed starts and each rank's state are series from the first scrape
    failures = {r["metric"]["rank"]: r["value"][1]
                for r in query(prometheus, "kvtier_worker_start_failures_total")}
    assert failures == {str(r): "0" for r in range(RANKS)}
    states = {(r["metric"]["rank"], r["metric"]["state"]): r["value"][1]
              for r in query(prometheus, "kvtier_worker_state")}
    assert {k for k, v in states.items() if v == "1"} == {(str(r), "ready") for r in range(RANKS)}
    assert {state for _, state in states} == {"starting", "ready", "dead", "start_failed",
                                               "stopped"}
    (unrecoverable,) = query(prometheus, "kvtier_workers_unrecoverable")
    assert unrecoverable["value"][1] == "0"


def test_worker_metrics_carry_help_text_and_pass_promtool(served: ServeProcess) -> None:
    """The worker families (state, failed starts) have HELP and TYPE lines and the whole
    exposition passes `promtool check metrics`."""
    text = httpx.get(f"{served.url}/metrics", timeout=10.0).text
    for name, kind in (("kvtier_worker_start_failures_total", "counter"),
                       ("kvtier_worker_consecutive_start_failures", "gauge"),
                       ("kvtier_worker_state", "gauge"),
                       ("kvtier_workers_unrecoverable", "gauge")):
        assert f"# TYPE {name} {kind}" in text, name
        help_line = next(line for line in text.splitlines()
                         if line.startswith(f"# HELP {name} "))
        assert len(help_line) > len(f"# HELP {name} ") + 20, help_line
    linted = promtool("check", "metrics", input=text)
    assert linted.returncode == 0, linted.stdout + linted.stderr
