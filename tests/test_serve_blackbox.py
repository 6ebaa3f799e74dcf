"""`kvtier serve` as a black box: a child process started from a command line and a TOML file,
talked to only over HTTP, stopped with a signal.

One run covers the operator's whole story: start with two workers (admin port 0, token from
KVTIER_ADMIN_TOKEN), every endpoint with and without the token and with good and bad bodies,
`kvtier status` through the console script, a worker killed with SIGKILL and replaced, and
SIGTERM leaving no process, shared-memory segment or queue behind. The compose command itself
(`kvtier serve --config FILE` through the console script, stopped with SIGINT) runs in
test_compose.py. Bad configurations must fail before anything starts: exit 2, one line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvtier.admin.auth import client_token
from prometheus_client.parser import text_string_to_metric_families
from serve_support import ServeProcess, tiny_toml
from support import (
    clean_env,
    fill,
    free_port,
    kvtier_script,
    leftovers,
    module_command,
    new_deployment_id,
    pid_exists,
    tmpfs_mount,
    wait_until,
)

# `kvtier serve` and `kvtier status` as child processes
pytestmark = [pytest.mark.fast, pytest.mark.slow]

TOKEN = "blackbox-token-1"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POSTS = ("/pause", "/resume", "/reset", "/pin", "/unpin")


def worker_samples(client: httpx.Client, name: str) -> dict[str, float]:
    """rank -> value of a per-rank metric, from a live scrape."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["rank"]] = sample.value
    return out


def test_serve_end_to_end(tmp_path: Path) -> None:
    dep = new_deployment_id("bb")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, workers=2)
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log",
                         env=clean_env(KVTIER_ADMIN_TOKEN=TOKEN))
    with serve:
        log = serve.log()
        for line in ("config: deployment", "worker rank 0 ready", "worker rank 1 ready",
                     "admin listening on http://127.0.0.1:"):
            assert line in log, log
        assert TOKEN not in log
        client = serve.client()

        # --- reads, no token needed
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").json() == {"ready": True,
                                                "reason": "every worker is ready"}
        status = client.get("/status").json()
        assert [w["rank"] for w in status["workers"]] == [0, 1]
        assert all(w["state"] == "ready" and pid_exists(w["pid"]) for w in status["workers"])
        assert status["config"]["admin"]["token_set"] is True
        assert status["tiers"]["device"]["capacity"] == 64
        assert worker_samples(client, "kvtier_worker_up") == {"0": 1.0, "1": 1.0}
        assert client.get("/docs").status_code == 200
        assert "/pin" in client.get("/openapi.json").json()["paths"]

        # --- every POST refuses a missing or wrong token, whatever the body
        for path in ("/pause", "/resume", "/reset", "/pin", "/unpin"):
            assert client.post(path, json={"token_ids": [1]}).status_code == 401, path
            wrong = client.post(path, json={"token_ids": [1]},
                                headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401, path
            assert client.post(path, content=b"][").status_code == 401, path
        assert client.get("/status").json()["paused"] is False

        # --- with the token
        assert client.post("/pause", headers=AUTH).json() == {"paused": True}
        assert client.get("/status").json()["paused"] is True
        assert client.post("/resume", headers=AUTH).json() == {"paused": False}
        body = {"token_ids": list(range(16))}
        assert client.post("/pin", json=body, headers=AUTH).json() == {
            "pinned_blocks": 0, "prefix_blocks": 4}
        assert client.post("/unpin", json=body, headers=AUTH).json()["unpinned_blocks"] == 0
        for bad in ({"token_ids": "1 2 3"}, {"token_ids": [1.5]}, {"ids": [1]}):
            answer = client.post("/pin", json=bad, headers=AUTH)
            assert answer.status_code == 422 and answer.json()["detail"], bad
        assert client.post("/unpin", content=b"{", headers={
            **AUTH, "content-type": "application/json"}).status_code == 422
        reset = client.post("/reset", headers=AUTH)
        assert reset.status_code == 200 and reset.json()["cleared"]["nodes"] == 0
        reset = client.post("/reset", params={"storage": "true"}, headers=AUTH)
        assert reset.status_code == 200 and "storage_pages" in reset.json()["cleared"]
        assert client.post("/reset", params={"timeout": "-1"}, headers=AUTH).status_code == 422

        # --- kvtier status, through the console script
        pids = [w["pid"] for w in status["workers"]]
        shown = subprocess.run([str(kvtier_script()), "status", "--url", serve.url],
                               capture_output=True, text=True, timeout=30)
        assert shown.returncode == 0, shown.stderr
        for text in (dep, "ready", "device", "host", "hit rate", *map(str, pids),
                     "rank 0: 0 damaged pages refused"):
            assert text in shown.stdout, (text, shown.stdout)
        as_json = subprocess.run([str(kvtier_script()), "status", "--url", serve.url, "--json"],
                                 capture_output=True, text=True, timeout=30)
        assert json.loads(as_json.stdout)["deployment_id"] == dep

        # --- a worker killed with SIGKILL is noticed and replaced
        victim = pids[0]
        os.kill(victim, signal.SIGKILL)

        def not_ready() -> dict[str, object] | None:
            answer = client.get("/readyz")
            return answer.json() if answer.status_code == 503 else None

        down = wait_until(not_ready, 10, "/readyz to turn 503", 0.01)
        assert down["ready"] is False and "rank 0 is" in str(down["reason"])
        wait_until(lambda: client.get("/readyz").status_code == 200, 60, "/readyz back to 200")
        after = client.get("/status").json()["workers"]
        assert after[0]["pid"] != victim and pid_exists(after[0]["pid"])
        assert after[0]["restarts"] == 1 and after[0]["state"] == "ready"
        assert after[1]["pid"] == pids[1] and after[1]["restarts"] == 0
        assert not pid_exists(victim)
        assert worker_samples(client, "kvtier_worker_restarts_total") == {"0": 1.0, "1": 0.0}
        assert worker_samples(client, "kvtier_worker_up") == {"0": 1.0, "1": 1.0}
        client.close()

        # --- SIGTERM: exit 0, nothing left
        serve.remember_children()
        all_pids = {serve.proc.pid, *serve.seen_pids}  # type: ignore[union-attr]
        assert after[0]["pid"] in all_pids and victim in all_pids
        assert serve.stop(signal.SIGTERM) == 0
        wait_until(lambda: not any(pid_exists(p) for p in all_pids), 10,
                 "every kvtier process to be gone")
        assert leftovers(dep, 2) == []
        assert "stopped: workers gone" in serve.log()


def test_serve_generates_a_private_token_when_none_is_configured(tmp_path: Path) -> None:
    """Issue 11 item 10: no admin.token and no explicit opt-out: a random token, written 0600
    (directories 0700) to $XDG_STATE_HOME/kvtier/<deployment_id>/admin-token, the path logged
    and never the token, every POST refused without it, the file removed at exit."""
    dep = new_deployment_id("tok")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log")
    with serve:
        path = serve.token_file()
        assert path == tmp_path / "state" / "kvtier" / dep / "admin-token"
        token = serve.token()
        assert len(token) >= 43
        log = serve.log()
        assert f"admin token generated and written to {path}" in log, log
        assert token not in log
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        with serve.client() as client:
            for post in POSTS:
                assert client.post(post, json={"token_ids": [1]}).status_code == 401, post
            assert client.post("/pause", headers={"Authorization": "Bearer nope"}
                               ).status_code == 401
            auth = {"Authorization": f"Bearer {token}"}
            assert client.post("/pause", headers=auth).json() == {"paused": True}
            assert client.post("/resume", headers=auth).json() == {"paused": False}
            admin = client.get("/status").json()["config"]["admin"]
            assert admin["auth"] == "token" and admin["token_set"] is False
        shown = subprocess.run([str(kvtier_script()), "status", "--url", serve.url, "--json",
                                "--deployment-id", dep], capture_output=True, text=True,
                               timeout=30, env=serve.env)
        assert shown.returncode == 0 and json.loads(shown.stdout)["deployment_id"] == dep
        assert serve.stop(signal.SIGTERM) == 0
    assert not path.exists()


def test_a_second_serve_of_a_live_deployment_changes_nothing_of_it(tmp_path: Path) -> None:
    """Issue 27, item 5: a second `kvtier serve` with the running deployment's id (another
    admin port) refuses to start, and on main it deleted the first one's generated token
    file on the way out, so every POST with the file's token got 401. Refusing must change
    nothing: the file still holds the first token, which still works."""
    dep = new_deployment_id("twice")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log")
    with serve:
        path, token = serve.token_file(), serve.token()
        # its own engine socket: the same one is refused before anything else (exit 2,
        # tests/test_node_service.py); this is about the stack and the token file
        other = dict(serve.env, KVTIER_NODE__SOCKET=str(tmp_path / "second" / "node.sock"))
        second = _serve_once(tmp_path, config, other)
        assert second.returncode == 1, second.stderr
        assert "cannot start" in second.stderr, second.stderr
        assert path.exists(), "the second serve removed the first one's token file"
        assert serve.token() == token
        with serve.client() as client:
            auth = {"Authorization": f"Bearer {token}"}
            assert client.post("/pause", headers=auth).status_code == 200
            assert client.post("/resume", headers=auth).status_code == 200
        assert serve.stop(signal.SIGTERM) == 0
    assert not path.exists()


def test_a_killed_serves_token_file_is_not_presented(tmp_path: Path) -> None:
    """Issue 27, item 9: `kill -9` of `kvtier serve` left its generated token file, which
    clients kept reading until the next start. The file names its serve (a sibling
    `admin-token.pid`: pid and start time); a client finding that serve gone removes both
    and presents no token."""
    dep = new_deployment_id("k9")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log")
    with serve:
        path, token = serve.token_file(), serve.token()
        assert client_token(dep, serve.env) == token  # its serve runs: presented
        assert serve.stop(signal.SIGKILL) == -signal.SIGKILL
        assert path.exists()  # nobody could remove it
        assert client_token(dep, serve.env) is None
        assert not path.exists() and not path.with_name("admin-token.pid").exists()


def test_auth_none_is_explicit_and_warned_about_off_loopback(tmp_path: Path) -> None:
    """admin.auth = "none" is the only way to an admin without a token; bound to 0.0.0.0 it
    says so in a warning."""
    dep = new_deployment_id("open")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    config.write_text(config.read_text().replace('host = "127.0.0.1"', 'host = "0.0.0.0"')
                      + 'auth = "none"\n')
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log")
    with serve:
        assert ("WARNING kvtier.serve: admin.auth = 'none' with admin.host = '0.0.0.0': anyone "
                "who can reach this address can reset, pause and pin without a token"
                ) in serve.log()
        assert not serve.token_file().exists()
        url = serve.url.replace("0.0.0.0", "127.0.0.1")
        with httpx.Client(base_url=url, timeout=10.0) as client:
            assert client.post("/pause").json() == {"paused": True}
            assert client.post("/resume").json() == {"paused": False}
        assert serve.stop(signal.SIGTERM) == 0


def _serve_once(tmp_path: Path, config: Path | None, env: dict[str, str],
                *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["serve"] if config is None else ["serve", "--config", str(config)]
    return subprocess.run([*module_command(), *args, *extra], capture_output=True, text=True,
                          timeout=60, env=env, cwd=tmp_path)


@pytest.mark.parametrize(("toml", "env", "expected"), [
    ("[cache]\ndevice_blokcs = 5\n", {},
     "cache.device_blokcs: unknown key (did you mean cache.device_blocks?)"),
    ('[workers]\ncount = "two"\n', {}, "workers.count = 'two': expected an integer"),
    ("", {"KVTIER_CACHE__HOST_BLOCKS": "lots"},
     "cache.host_blocks = 'lots': expected an integer (from KVTIER_CACHE__HOST_BLOCKS)"),
    ("[cache]\nhost_blocks = 0\n", {}, "storage.backend = 'file'"),
])
def test_bad_configuration_exits_2_with_one_line_naming_the_key(
        tmp_path: Path, toml: str, env: dict[str, str], expected: str) -> None:
    dep = new_deployment_id("bad")
    config = tmp_path / "bad.toml"
    config.write_text(f'deployment_id = "{dep}"\n{toml}')
    result = _serve_once(tmp_path, config, clean_env(**env))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("kvtier serve: ") and expected in lines[0], lines[0]
    assert result.stdout == ""
    assert leftovers(dep, 1) == []


@contextlib.contextmanager
def _no_place(tmp_path: Path, kind: str) -> Iterator[str]:
    """A storage.path that cannot hold storage: on a read-only or a full file system."""
    with tmpfs_mount(tmp_path / kind, *(["ro"] if kind == "ro" else [])) as mounted:
        if kind == "full":
            fill(mounted)
        yield str(mounted / "storage")


BAD_MACHINE_CONFIGS: list[tuple[str, str, str]] = [
    ("[workers]\ncount = 65\n", "", "workers.count = 65: must be <= 64"),
    ("[workers]\nready_timeout_s = 1e300\n", "", "workers.ready_timeout_s = 1e+300: must be <= "
     "3600"),
    ('[storage]\npath = "a\\u0000b"\n', "", "storage.path = 'a\\x00b': contains a NUL "
     "character"),
    (f'[storage]\npath = "{"p" * 5000}"\n', "", "(5000 characters): 5000 bytes long; a path "
     "may have at most 4095"),
    ('[storage]\npath = "/proc/kvtier-storage"\n', "", "storage.path = "
     "'/proc/kvtier-storage': cannot create files in '/proc': No such file or directory"),
    ("", "ro", "is on a read-only file system"),
    ("", "full", "is full (0 bytes free, one page needs 512)"),
]


@pytest.mark.parametrize("command", ["serve", "replay"])
@pytest.mark.parametrize(("toml", "place", "expected"), BAD_MACHINE_CONFIGS,
                         ids=["count", "timeout", "nul", "long", "proc", "ro", "full"])
def test_bad_storage_and_worker_settings_exit_2_in_one_line(
        tmp_path: Path, command: str, toml: str, place: str, expected: str) -> None:
    """Issue 11 item 14: each of these used to start workers (exit 1 and a worker's
    traceback) or print a traceback; now one line naming the key and the value, exit 2,
    before anything starts (`kvtier serve` and `kvtier replay` alike)."""
    dep = new_deployment_id("bad")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    with contextlib.ExitStack() as stack:
        text = config.read_text()
        if toml.startswith("[storage]"):
            text = text.replace('backend = "none"\n', 'backend = "file"\n' + toml[10:])
        elif place:
            where = stack.enter_context(_no_place(tmp_path, place))
            text = text.replace('backend = "none"\n', f'backend = "file"\npath = "{where}"\n')
        else:
            text = text.replace('[workers]\ncount = 1\ndevice = "cpu"\n',
                                '[workers]\ndevice = "cpu"\n' + toml[10:])
        config.write_text(text)
        result = subprocess.run([*module_command(), command, "--config", str(config)],
                                capture_output=True, text=True, timeout=120, env=clean_env(),
                                cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtier {command}: "), result.stderr
    assert expected in lines[0], lines[0]
    assert "worker rank" not in result.stderr
    assert leftovers(dep, 1) == []


@pytest.mark.parametrize("command", ["serve", "replay"])
@pytest.mark.parametrize(("kind", "expected"), [
    ("0644", "mode 644: others may read or write it"),
    ("short", "holds 8 bytes; a storage secret is 16 to"),
    ("directory", "is a directory, not a regular file"),
])
def test_a_bad_storage_secret_file_exits_2_in_one_line(
        tmp_path: Path, command: str, kind: str, expected: str) -> None:
    """Issue 27, item 8: a storage.secret_file of mode 0644, of 8 bytes or a directory used
    to skip the configuration check: `serve` exited 1 with 3 lines after starting, `replay`
    exited 3, a directory read "storage secret file 4: Is a directory". Now exit 2 and one
    line naming storage.secret_file and what is wrong, before anything starts."""
    dep = new_deployment_id("sec")
    secret = tmp_path / "secret"
    if kind == "directory":
        secret.mkdir(mode=0o700)
    else:
        secret.write_bytes(b"x" * (8 if kind == "short" else 32))
        secret.chmod(0o644 if kind == "0644" else 0o600)
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="file",
                       storage_dir=tmp_path / "storage")
    config.write_text(config.read_text().replace(
        "[storage]\n", f'[storage]\nsecret_file = "{secret}"\n').replace(
        "device_blocks = 64", "device_blocks = 400"))  # replay's workload fits
    result = subprocess.run([*module_command(), command, "--config", str(config),
                             *(["--limit", "2"] if command == "replay" else [])],
                            capture_output=True, text=True, timeout=120, env=clean_env(),
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtier {command}: "), result.stderr
    assert f"storage.secret_file = '{secret}'" in lines[0] and expected in lines[0], lines[0]
    assert leftovers(dep, 1) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a folder to another user")
@pytest.mark.parametrize("command", ["serve", "replay"])
def test_a_storage_folder_of_another_user_exits_2_in_one_line(tmp_path: Path,
                                                               command: str) -> None:
    """Issue 27, item 7: a storage.path owned by another user (or writable by others) was
    refused by each worker with a 17-line traceback (exit 1). The configuration check
    refuses it as the workers would, in one line naming storage.path, exit 2."""
    dep = new_deployment_id("own")
    storage = tmp_path / "theirs"
    storage.mkdir(mode=0o700)
    os.chown(storage, 12345, -1)
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="file", storage_dir=storage)
    config.write_text(config.read_text().replace("device_blocks = 64", "device_blocks = 400"))
    result = subprocess.run([*module_command(), command, "--config", str(config),
                             *(["--limit", "2"] if command == "replay" else [])],
                            capture_output=True, text=True, timeout=120, env=clean_env(),
                            cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvtier {command}: "), result.stderr
    assert f"storage.path = '{storage}'" in lines[0], lines[0]
    assert "is owned by uid 12345, not by this user" in lines[0], lines[0]
    assert leftovers(dep, 1) == []


def test_unreachable_redis_and_a_taken_port_exit_2_before_any_worker(tmp_path: Path) -> None:
    dep = new_deployment_id("bad")
    port = free_port()
    config = tiny_toml(tmp_path / "redis.toml", dep, storage="redis")
    config.write_text(config.read_text().replace(
        'backend = "redis"\n', f'backend = "redis"\nurl = "redis://127.0.0.1:{port}/0"\n'))
    result = _serve_once(tmp_path, config, clean_env())
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"storage.url = 'redis://127.0.0.1:{port}/0': cannot reach Redis" in line

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        config = tiny_toml(tmp_path / "port.toml", dep, storage="none")
        config.write_text(config.read_text().replace("port = 0", f"port = {busy}"))
        result = _serve_once(tmp_path, config, clean_env())
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"kvtier serve: admin.port = {busy}: cannot listen on "
                           f"127.0.0.1:{busy}"), line
    assert "worker rank" not in result.stderr
    assert leftovers(dep, 1) == []


def test_missing_config_file_and_no_command(tmp_path: Path) -> None:
    result = _serve_once(tmp_path, tmp_path / "nowhere.toml", clean_env())
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"kvtier serve: config file '{tmp_path / 'nowhere.toml'}': not found")
    bare = subprocess.run(module_command(), capture_output=True, text=True, timeout=30)
    assert bare.returncode == 2 and "serve" in bare.stderr and "status" in bare.stderr


def test_status_of_an_admin_nobody_runs_is_one_line_and_exit_1() -> None:
    port = free_port()
    result = subprocess.run([str(kvtier_script()), "status", "--url", f"http://127.0.0.1:{port}"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"kvtier status: cannot reach the admin at http://127.0.0.1:{port}: "
        "[Errno 111] Connection refused")


def test_a_steering_command_of_an_admin_nobody_runs_is_one_line_and_exit_1() -> None:
    """The steering commands call the admin through admin/client.py, as `kvtier status`."""
    port = free_port()
    result = subprocess.run([str(kvtier_script()), "lookup", "--url", f"http://127.0.0.1:{port}",
                             "--namespace", "m", "--tokens", "1,2,3"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1
    assert result.stdout.strip() == (
        f"kvtier lookup: cannot reach the admin at http://127.0.0.1:{port}: "
        "[Errno 111] Connection refused"), result.stdout + result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["status", "--help"], ["plan", "--help"],
                                  ["status", "--url", "http://127.0.0.1:9", "--timeout", "1"]])
def test_light_commands_load_neither_the_configuration_nor_numpy(argv: list[str]) -> None:
    # The fast tier starts `kvtier` hundreds of times: these commands took 0.6 s of CPU when
    # they imported the configuration (pydantic) and, through kvtier.worker.ipc, numpy; now
    # 0.1 s. A module-level import that brings either back fails here, not in a timing.
    code = ("import sys\nfrom kvtier.admin.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted({'pydantic', 'numpy', 'torch', 'fastapi'} & set(sys.modules))\n"
            "print('HEAVY', heavy, file=sys.stderr)\n")
    result = subprocess.run([module_command()[0], "-c", code, *argv], capture_output=True,
                            text=True, timeout=30, env=clean_env())
    assert "HEAVY []" in result.stderr, result.stderr


def test_sigterm_while_workers_start_stops_cleanly(tmp_path: Path) -> None:
    dep = new_deployment_id("bb")
    config = tiny_toml(tmp_path / "kvtier.toml", dep, storage="none")
    serve = ServeProcess(module_command(), ["serve", "--config", str(config)],
                         deployment_id=dep, log_path=tmp_path / "serve.log")
    try:
        with (tmp_path / "serve.log").open("wb") as log:
            serve.proc = subprocess.Popen(serve.argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=serve.env, cwd=tmp_path)
        wait_until(lambda: "worker rank 0 starting" in serve.log(), 30, "a worker to start")
        serve.remember_children()
        workers = set(serve.seen_pids)
        assert workers, serve.log()
        assert serve.stop(signal.SIGTERM) == 0, serve.log()
        assert "stopped while starting" in serve.log()
        wait_until(lambda: not any(pid_exists(p) for p in workers), 10, "the worker to be gone")
        assert leftovers(dep, 1) == []
    finally:
        serve.close()
