"""Readers of the deployment files (compose.yaml, docker/), shared by the tests that check them.

The deployment cannot be run here (no Docker engine), so its promises are checked by reading
the files: which command each built service runs, which metric names the Grafana dashboard
queries, what the Prometheus scrape target is. Tests of the CLI and of the admin import these
helpers to tie the deployment to what they run and expose.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "compose.yaml"
DOCKERFILE = REPO / "docker" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
KVTIER_TOML = REPO / "docker" / "kvtier.toml"
PROMETHEUS_YML = REPO / "docker" / "prometheus.yml"
GRAFANA_DIR = REPO / "docker" / "grafana"
DASHBOARD_JSON = GRAFANA_DIR / "dashboards" / "kvtier.json"
DATASOURCE_YML = GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDER_YML = GRAFANA_DIR / "provisioning" / "dashboards" / "kvtier.yml"

SHM_MARGIN_BYTES = 256 * 1024**2
"""/dev/shm beyond the host pools: flag segments, queues and torch's own shared memory."""

_BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_BYTE_UNITS |= {"g": 1024**3, "gb": 1024**3}

_METRIC = re.compile(r"\bkvtier_[a-zA-Z0-9_]+")
_GRAFANA_VARIABLE = re.compile(r"\$__[a-z_]+|\$\{__[a-z_]+\}")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def compose() -> dict[str, Any]:
    """compose.yaml as written (no interpolation, no defaults filled in)."""
    return load_yaml(COMPOSE_FILE)


def compose_commands() -> dict[str, list[str]]:
    """The command of every service built from docker/Dockerfile, as an argv list appended to
    the image's ENTRYPOINT (`dockerfile_exec_form("ENTRYPOINT")`, i.e. `kvtier`). The vLLM
    service's image (docker/Dockerfile.vllm) has its own entrypoint."""
    commands: dict[str, list[str]] = {}
    for name, service in compose()["services"].items():
        build = service.get("build")
        if not isinstance(build, dict) or build.get("dockerfile") != "docker/Dockerfile":
            continue
        command = service.get("command")
        if command is None:
            command = dockerfile_exec_form("CMD")
        commands[name] = shlex.split(command) if isinstance(command, str) else list(command)
    return commands


def parse_bytes(value: int | str) -> int:
    """A Compose byte value ('2304m', '1gb', 1024) in bytes; Docker's units are binary."""
    if isinstance(value, int):
        return value
    found = re.fullmatch(r"\s*([0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not found or found.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"not a Compose byte value: {value!r}")
    return int(found.group(1)) * _BYTE_UNITS[found.group(2).lower()]


def bind_mounts(service: str) -> dict[str, Path]:
    """Container path -> repository path of every bind mount of `service` (long or short
    syntax; named volumes are left out)."""
    mounts: dict[str, Path] = {}
    for volume in compose()["services"][service].get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts[volume["target"]] = (REPO / volume["source"]).resolve()
            continue
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (REPO / source).resolve()
    return mounts


def dockerfile_instructions(path: Path | None = None) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile (or `path`), continuation lines joined,
    comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (path or DOCKERFILE).read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, rest = whole.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile_exec_form(keyword: str) -> list[str]:
    """The JSON (exec form) argument list of the last `keyword` instruction (CMD, ENTRYPOINT,
    or the CMD of HEALTHCHECK when keyword is 'HEALTHCHECK')."""
    found = [rest for kw, rest in dockerfile_instructions() if kw == keyword]
    if not found:
        raise LookupError(f"docker/Dockerfile has no {keyword}")
    text = found[-1]
    if keyword == "HEALTHCHECK":
        text = text[text.index("CMD") + len("CMD") :]
    return json.loads(text)


def dockerfile_args(path: Path | None = None) -> dict[str, str]:
    """Build arguments and their defaults."""
    args: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
    return args


def kvtier_toml() -> dict[str, Any]:
    """docker/kvtier.toml as raw TOML (keys the file does not set are absent)."""
    return tomllib.loads(KVTIER_TOML.read_text())


def prometheus_targets(job: str = "kvtier") -> list[str]:
    """host:port targets of a scrape job in docker/prometheus.yml."""
    config = load_yaml(PROMETHEUS_YML)
    for scrape in config["scrape_configs"]:
        if scrape["job_name"] == job:
            return [t for static in scrape["static_configs"] for t in static["targets"]]
    raise LookupError(f"docker/prometheus.yml has no job {job!r}")


def prometheus_job(job: str = "kvtier") -> dict[str, Any]:
    for scrape in load_yaml(PROMETHEUS_YML)["scrape_configs"]:
        if scrape["job_name"] == job:
            return scrape
    raise LookupError(f"docker/prometheus.yml has no job {job!r}")


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_JSON.read_text())


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel of the dashboard, rows' nested panels included, rows themselves excluded."""
    found: list[dict[str, Any]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            if panel.get("type") == "row":
                walk(panel.get("panels", []))
            else:
                found.append(panel)

    walk(dashboard()["panels"])
    return found


def dashboard_queries() -> list[str]:
    """The PromQL expression of every dashboard target, as Grafana stores it."""
    return [
        target["expr"]
        for panel in dashboard_panels()
        for target in panel.get("targets", [])
        if target.get("expr")
    ]


def promql_without_grafana_variables(expr: str, interval: str = "1m") -> str:
    """`expr` with Grafana's range variables ($__rate_interval, $__range, ...) replaced by a
    fixed duration, so that plain PromQL tools can parse it."""
    return _GRAFANA_VARIABLE.sub(interval, expr)


def dashboard_metric_names() -> list[str]:
    """Every metric name the dashboard queries, sorted, as sample names appear in the
    Prometheus text exposition: counters with `_total`, histograms as `_bucket`. Each must be a
    sample name in the admin's /metrics."""
    names: set[str] = set()
    for expr in dashboard_queries():
        names.update(_METRIC.findall(expr))
    return sorted(names)


def datasource() -> dict[str, Any]:
    """The one provisioned Grafana data source."""
    sources = load_yaml(DATASOURCE_YML)["datasources"]
    if len(sources) != 1:
        raise LookupError(f"expected one provisioned data source, found {len(sources)}")
    return sources[0]


def datasource_host_port() -> tuple[str, int]:
    url = urlsplit(datasource()["url"])
    return url.hostname or "", url.port or 80
