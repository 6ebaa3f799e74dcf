"""The admin's generated token: where it lives, who can read it, and who presents it.

`kvtier serve` with an empty `admin.token` (and `admin.auth = "token"`, the default) makes up a
token and writes it to `$XDG_STATE_HOME/kvtier/<deployment_id>/admin-token`; the `kvtier`
command's admin client reads it back from there. These tests run the functions on real
directories and the command's client against a real HTTP server that records what it got;
test_serve_blackbox runs the whole story through `kvtier serve`.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.admin import cli
from kvtier.admin.auth import (
    TokenFileError,
    client_token,
    generate_token,
    is_loopback,
    read_token,
    remove_token,
    state_dir,
    token_path,
    write_token,
)

pytestmark = pytest.mark.fast


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_the_state_file_follows_xdg_state_home_else_the_home_directory() -> None:
    assert token_path("dep", {"XDG_STATE_HOME": "/srv/state", "HOME": "/home/op"}) == Path(
        "/srv/state/kvtier/dep/admin-token")
    # unset, empty or relative XDG_STATE_HOME: ~/.local/state (the XDG Base Directory rule)
    for env in ({"HOME": "/home/op"}, {"XDG_STATE_HOME": "", "HOME": "/home/op"},
                {"XDG_STATE_HOME": "rel/state", "HOME": "/home/op"}):
        assert state_dir("dep", env) == Path("/home/op/.local/state/kvtier/dep"), env


def test_a_written_token_is_readable_by_its_user_only(tmp_path: Path) -> None:
    path = token_path("dep", {"XDG_STATE_HOME": str(tmp_path / "state")})
    token = generate_token()
    assert len(token) >= 43 and token != generate_token()
    write_token(path, token)
    assert path.read_text() == token + "\n" and read_token(path) == token
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    assert _mode(tmp_path / "state") == 0o700  # created by us: private too
    # A second start replaces the file whole and leaves no temporary file behind.
    write_token(path, "second")
    assert read_token(path) == "second"
    assert sorted(os.listdir(path.parent)) == ["admin-token", "admin-token.pid"]
    assert path.with_name("admin-token.pid").read_text().split()[0] == str(os.getpid())
    assert _mode(path.with_name("admin-token.pid")) == 0o600
    remove_token(path, "not-this-one")  # a later start's token is never removed
    assert path.exists()
    remove_token(path, "second")
    assert not path.exists() and read_token(path) is None
    assert os.listdir(path.parent) == []


def test_loose_directories_are_tightened_and_foreign_ones_refused(tmp_path: Path) -> None:
    base = tmp_path / "state"
    (base / "kvtier" / "dep").mkdir(parents=True, mode=0o755)
    (base / "kvtier").chmod(0o755)
    (base / "kvtier" / "dep").chmod(0o777)
    path = token_path("dep", {"XDG_STATE_HOME": str(base)})
    write_token(path, "t")
    assert _mode(base / "kvtier") == 0o700 and _mode(base / "kvtier" / "dep") == 0o700
    assert _mode(path) == 0o600

    # A symlink where the deployment's directory should be: whoever made it could read the
    # token through it.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (base / "kvtier" / "linked").symlink_to(elsewhere)
    with pytest.raises(TokenFileError, match="is not a directory"):
        write_token(token_path("linked", {"XDG_STATE_HOME": str(base)}), "t")
    assert list(elsewhere.iterdir()) == []

    # A directory of another user.
    foreign = base / "kvtier" / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 4242, 4242)
    with pytest.raises(TokenFileError, match="belongs to uid 4242"):
        write_token(token_path("foreign", {"XDG_STATE_HOME": str(base)}), "t")


def test_an_unwritable_state_directory_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TokenFileError) as caught:
        write_token(token_path("dep", {"XDG_STATE_HOME": str(blocker)}), "t")
    assert str(blocker) in str(caught.value) and "\n" not in str(caught.value)


def test_the_client_presents_the_variable_else_the_state_file(tmp_path: Path) -> None:
    env = {"XDG_STATE_HOME": str(tmp_path)}
    assert client_token("dep", env) is None
    write_token(token_path("dep", env), "from-file")
    assert client_token("dep", env) == "from-file"
    assert client_token("other", env) is None
    assert client_token("dep", {**env, "KVTIER_ADMIN_TOKEN": "from-env"}) == "from-env"
    assert client_token("dep", {**env, "KVTIER_ADMIN__TOKEN": "from-env2"}) == "from-env2"


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "10.0.0.1", "example.com"):
        assert not is_loopback(host), host


# ----------------------------------------------------------------------- the command's client


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers GET /status with a minimal status object and records each request's headers."""

    seen: list[dict[str, str]] = []

    def do_GET(self) -> None:
        type(self).seen.append(dict(self.headers.items()))
        body = json.dumps({"deployment_id": "dep", "ready": {"ready": True}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[str]:
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_kvtier_status_presents_the_generated_token(
        recorder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.delenv("KVTIER_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KVTIER_ADMIN__TOKEN", raising=False)
    monkeypatch.setenv("KVTIER_DEPLOYMENT_ID", "dep")
    write_token(token_path("dep"), "generated-token")
    assert cli.main(["status", "--url", recorder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deployment_id"] == "dep"
    assert _Recorder.seen[-1]["Authorization"] == "Bearer generated-token"
    # Another deployment's file, named on the command line; then no token at all.
    write_token(token_path("other"), "other-token")
    assert cli.main(["status", "--url", recorder, "--json", "--deployment-id", "other"]) == 0
    assert _Recorder.seen[-1]["Authorization"] == "Bearer other-token"
    assert cli.main(["status", "--url", recorder, "--json", "--deployment-id", "none"]) == 0
    assert "Authorization" not in _Recorder.seen[-1]
