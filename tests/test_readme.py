"""The README is the newcomer's entry point: its first commands and its configuration
reference must stay true to the project."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from kvtier.manager.config import KvtierConfig
from support import clean_env, kvtier_script, leftovers, new_deployment_id

pytestmark = pytest.mark.fast

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_readme_opens_with_the_run_and_test_commands() -> None:
    first_block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first_block and README.index("```bash") < 20, "the README must open with commands"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["make run", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^run: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)


def test_ci_runs_the_readme_test_command() -> None:
    """.ci/run runs `make test-all`, whose first tier is the README's `make test`, then the
    other Pythons' check, the engine and live tiers: every tier's marker has a target and
    test-all runs them all."""
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test-all( |\|\||$)", ci, re.M), ci
    makefile = (REPO / "Makefile").read_text()
    test_all = re.search(r"^test-all: (.*)$", makefile, re.M)
    assert test_all and test_all.group(1).split() == [
        "test", "test-pythons", "test-engines", "test-live"]
    for target, tier in (("test", "fast"), ("test-engines", "engines"), ("test-live", "live")):
        recipe = re.search(rf"^{target}: .*\n((?:\t.*\n)+)", makefile, re.M)
        assert recipe and re.search(rf"\$\(PYTEST\) .*-m {tier}(;|$)", recipe.group(1),
                                    re.M), (target, recipe)


def test_first_screen_node_commands_are_the_compose_deployments() -> None:
    """The README's three node-deployment commands on its first screen are the ones the
    compose deployment runs (`make test-live`): compose.yaml's `kvtier serve`, the
    `--kv-transfer-config` docker/vllm-entrypoint.sh builds for an attached vLLM, and the
    `kvtier status` tests/test_compose_live.py runs in the kvtier container."""
    start = README.index("**With vLLM.**")
    assert start < README.index("kvtier is a hierarchical"), "not on the first screen"
    block = re.search(r"```bash\n(.*?)```", README[start:], re.S)
    assert block
    serve, vllm, status = (shlex.split(line, comments=True)
                           for line in block.group(1).splitlines())
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    assert serve == ["kvtier", *compose["kvtier"]["command"]], serve
    socket = compose["kvtier"]["environment"]["KVTIER_NODE__SOCKET"]
    attached = [name for name, svc in compose.items()
                if svc.get("environment", {}).get("KVTIER_SERVE") == socket]
    assert attached, "no vLLM service of compose.yaml attaches to kvtier serve's socket"
    entrypoint = (REPO / "docker" / "vllm-entrypoint.sh").read_text()
    code = re.search(r'KV_TRANSFER_CONFIG=\$\(python3 -c "(.*?)" "\$CONFIG" "\$SERVE"\)',
                     entrypoint, re.S)
    assert code, "docker/vllm-entrypoint.sh no longer builds the config as this test reads it"
    built = subprocess.run([sys.executable, "-c", code.group(1), "", socket],
                           capture_output=True, text=True, check=True).stdout
    assert vllm[:3] == ["vllm", "serve", "MODEL"] and vllm[3] == "--kv-transfer-config"
    assert json.loads(vllm[4]) == json.loads(built) and len(vllm) == 5, vllm
    assert re.search(r"^exec vllm serve .*--kv-transfer-config \"\$KV_TRANSFER_CONFIG\"",
                     entrypoint, re.M | re.S)
    live = (REPO / "tests" / "test_compose_live.py").read_text()
    assert status == ["kvtier", "status"]
    assert 'exec("kvtier", "kvtier", "status"' in live


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def test_python_versions_are_claimed_tested_and_tabled_alike() -> None:
    """pyproject.toml's `requires-python` and classifiers, the versions `make test-pythons`
    checks (every admitted one but the main venv's 3.11, which `make test` runs whole) and the
    README's table of versions name the same CPython versions."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    low, high = re.fullmatch(r">=(3\.\d+),<(3\.\d+)", project["requires-python"]).groups()
    admitted = [f"3.{m}" for m in range(_minor(low)[1], _minor(high)[1])]
    classified = [c.rsplit(" :: ", 1)[1] for c in project["classifiers"]
                  if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert classified == admitted, (classified, admitted)
    script = (REPO / "scripts" / "test_pythons.sh").read_text()
    checked = re.search(r'^VERSIONS=\$\{KVTIER_PYTHONS:-"(.*)"\}$', script, re.M)
    assert checked and checked.group(1).split() == admitted[1:], checked
    assert admitted[0] == "3.11" and "Python 3.11" in (REPO / "Makefile").read_text()
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^test-pythons:.*\n\t(.+)$", makefile, re.M)
    assert recipe and recipe.group(1) == "bash scripts/test_pythons.sh", recipe
    section = README[README.index("## Python versions"):]
    section = section[:section.index("\n## ", 1)]
    tabled = re.findall(r"^\| (3\.\d+) \|", section, re.M)
    assert tabled == admitted, tabled
    for test in re.search(r"^TESTS=\((.*?)\)", script, re.M | re.S).group(1).split():
        assert (REPO / test).is_file(), test
        assert f"`{Path(test).name}`" in section, f"the README's table omits {test}"


def test_every_configuration_key_is_documented() -> None:
    section = README[README.index("## Configuration"):README.index("## Admin API")]
    missing = []
    for name, field in KvtierConfig.model_fields.items():
        sub = getattr(field.annotation, "model_fields", None)
        if sub is None:
            if f"{name} =" not in section:
                missing.append(name)
            continue
        if f"[{name}]" not in section:
            missing.append(f"[{name}]")
        missing += [f"{name}.{key}" for key in sub if not re.search(rf"\b{key} =", section)]
    assert not missing, f"configuration keys missing from the README: {missing}"


def _run_recipe() -> list[str]:
    """The `make run` recipe as an argument list, with the venv's console script."""
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^run: .*\n\t(.+)$", makefile, re.M)
    assert recipe, "the Makefile's run target must be one command"
    argv = shlex.split(recipe.group(1))
    assert argv[0] == "$(VENV)/bin/kvtier", argv
    return [str(kvtier_script()), *argv[1:]]


@pytest.mark.slow  # `make run`'s replay, twice, as child processes
def test_run_command_works_on_embedded_defaults(tmp_path: Path) -> None:
    """`make run` in a fresh folder: no config file, no KVTIER_ variable but a private
    deployment id (so a live `default` deployment on this machine is not in the way), fewer
    requests. A second run in the same folder finds the first run's pages in storage."""
    argv = _run_recipe()
    assert argv[1:4] == ["replay", "--workload", "chat"] and "--config" not in argv
    argv[argv.index("--limit") + 1] = "60"
    dep = new_deployment_id("readme")
    cache = tmp_path / "cache"  # the default storage.path is under XDG_CACHE_HOME, not here
    env = clean_env(KVTIER_DEPLOYMENT_ID=dep, XDG_CACHE_HOME=str(cache))

    first = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    assert leftovers(dep, 1) == []
    assert "verified blocks" in first.stdout and "corrupt blocks 0" in first.stdout
    config = json.loads(first.stdout.split("config: ", 1)[1].splitlines()[0])
    defaults = KvtierConfig().model_dump(mode="json")
    for section in ("model", "cache"):
        assert config[section] == defaults[section], section
    assert config["storage"]["backend"] == "file" and config["workers"]["count"] == 1
    plot = tmp_path / ".kvtier" / "replay.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    storage = cache / "kvtier" / dep / "storage"
    pages = [p for p in storage.rglob("*") if p.is_file()]
    assert pages, "no page reached file storage"
    assert not (tmp_path / ".kvtier" / "storage").exists()  # not the current folder

    second = subprocess.run([*argv, "--json"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert leftovers(dep, 1) == []
    report = json.loads(second.stdout)
    assert report["requests"] == 60 and report["corrupt_blocks"] == 0
    assert report["verified_blocks"] > 0 and report["hit_tokens"]["storage"] > 0
