"""`kvtier serve` as a child process, for the black-box, Prometheus and compose tests.

The server is started exactly as an operator starts it (a command line and a TOML file), its
admin URL is read from its log (admin port 0: the real port is logged), and it is stopped with
a signal. Its state directory (XDG_STATE_HOME, where a generated admin token is written) is a
folder of the test's, never the user's; `token()` reads the token POSTs need. Every wait is
bounded; whatever a failed test leaves behind (the server, its workers, the deployment's
shared-memory segments and queues) is removed in `close()`.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

import httpx
from support import clean_env, pid_exists, remove_leftovers, wait_until

URL_LINE = re.compile(r"admin listening on (http://\S+)")
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def tiny_toml(path: Path, deployment_id: str, *, workers: int = 1, storage: str = "file",
              storage_dir: Path | None = None, extra: str = "") -> Path:
    """A TOML file, as an operator writes one, for a small deployment: 2 layers x 2 heads x
    8, 4-token blocks, 64 device and 64 host blocks per rank, admin on a free loopback port.
    (`support.tiny_config` is the in-process counterpart: a loaded KvtierConfig.)"""
    storage_lines = f'backend = "{storage}"\n'
    if storage == "file":
        storage_lines += f'path = "{storage_dir or path.parent / "storage"}"\n'
    path.write_text(
        f'deployment_id = "{deployment_id}"\n'
        "[model]\nnum_layers = 2\nnum_kv_heads = 2\nhead_dim = 8\n"
        '[cache]\nblock_size = 4\ndevice_blocks = 64\nhost_blocks = 64\n'
        'write_policy = "write_through"\n'
        f"[storage]\n{storage_lines}"
        f'[workers]\ncount = {workers}\ndevice = "cpu"\n'
        '[admin]\nhost = "127.0.0.1"\nport = 0\n' + extra)
    return path


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


class ServeProcess:
    """One `kvtier serve` child. `command` is the program part (`support.kvtier_script()` or
    `support.module_command()`); `args` follow it (`serve --config FILE`)."""

    def __init__(self, command: Sequence[str], args: Sequence[str], *, deployment_id: str,
                 log_path: Path, env: dict[str, str] | None = None) -> None:
        self.argv = [*command, *args]
        self.deployment_id = deployment_id
        self.log_path = log_path
        self.env = dict(clean_env() if env is None else env)
        # Worker logs go to a temporary directory of the stack's: keep it in the test's.
        self.env["TMPDIR"] = str(log_path.parent)
        # A generated admin token is written under XDG_STATE_HOME: keep it in the test's too
        # (over the suite's own state folder, unless the caller's env names one).
        if env is None or "XDG_STATE_HOME" not in env:
            self.env["XDG_STATE_HOME"] = str(log_path.parent / "state")
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.seen_pids: set[int] = set()

    def start(self, timeout: float = START_TIMEOUT_S) -> ServeProcess:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.log_path.parent)

        def started() -> str | None:
            if self.proc.poll() is not None:  # type: ignore[union-attr]
                raise AssertionError(
                    f"kvtier serve exited with {self.proc.returncode} while starting:\n"  # type: ignore[union-attr]
                    f"{self.log()}")
            found = URL_LINE.search(self.log())
            return found.group(1) if found else None

        try:
            self.url = wait_until(started, timeout, "the admin URL in the serve log")
        except BaseException:
            self.close()
            raise
        self.remember_children()
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def remember_children(self) -> None:
        if self.proc is not None:
            self.seen_pids.update(child_pids(self.proc.pid))

    def token_file(self) -> Path:
        """Where `kvtier serve` writes the token it generates (admin.token empty)."""
        return (Path(self.env["XDG_STATE_HOME"]) / "kvtier" / self.deployment_id
                / "admin-token")

    def token(self) -> str:
        """The bearer token POSTs need: KVTIER_ADMIN_TOKEN when the test set one, else the
        generated one from the state file."""
        return self.env.get("KVTIER_ADMIN_TOKEN") or self.token_file().read_text().strip()

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10.0)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` and wait for the exit status (AssertionError if it does not exit)."""
        assert self.proc is not None
        self.remember_children()
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"kvtier serve did not exit within {timeout:g} s of {signal.Signals(sig).name}"
                f":\n{self.log()}") from None

    def close(self) -> None:
        """Kill whatever is left (server, workers) and remove the deployment's IPC names."""
        if self.proc is not None and self.proc.poll() is None:
            self.remember_children()
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
        for pid in self.seen_pids:
            if pid_exists(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        remove_leftovers(self.deployment_id)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
