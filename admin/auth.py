"""The admin's bearer token when the operator configured none: generated at start, kept in a
state file only its user can read.

Why: an admin that accepts every POST unless a token was configured is open by default, and
anyone on the machine (or the network, with `admin.host = "0.0.0.0"`) could pause every transfer
or wipe the shared storage namespace. Like Jupyter, `kvtier serve` therefore makes up a random
token when `admin.token` is empty and `admin.auth = "token"` (the default), writes it to

    $XDG_STATE_HOME/kvtier/<deployment_id>/admin-token    (else ~/.local/state/kvtier/...)

(directories 0700, file 0600, replaced atomically), logs the path and never the token, and the
`kvtier` command's admin client reads it from there. Running without authentication takes an
explicit `admin.auth = "none"`.

Beside it, `admin-token.pid` names the serve that wrote it (pid, start time and pid namespace;
the token file stays one line, for `$(cat admin-token)`). A serve killed with SIGKILL cannot
remove its file: a client (in the same pid namespace) that finds the serve gone removes both
and presents no token (issue 27).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from kvtier.manager.private_state import PrivateStateError, private_dir, state_base
from kvtier.worker.ipc import pid_alive, process_start_time

TOKEN_FILE_NAME = "admin-token"
OWNER_SUFFIX = ".pid"  # admin-token.pid: "<pid> <start time>" of the serve that wrote it
TOKEN_BYTES = 32
"""Random bytes of a generated token (URL-safe base64: 43 characters)."""


class TokenFileError(PrivateStateError):
    """The token file cannot be written safely; the message names the path and the reason."""


def state_dir(deployment_id: str, env: Mapping[str, str] | None = None) -> Path:
    """The deployment's state directory: `$XDG_STATE_HOME/kvtier/<deployment_id>`, or
    `~/.local/state/kvtier/<deployment_id>` when XDG_STATE_HOME is unset or not absolute (the
    XDG Base Directory rule)."""
    return state_base(env) / deployment_id


def token_path(deployment_id: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the generated admin token of `deployment_id` lives."""
    return state_dir(deployment_id, env) / TOKEN_FILE_NAME


def generate_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def _private_dir(path: Path) -> None:
    """`path` exists as a directory of ours, mode 0700 (see `private_state.private_dir`)."""
    private_dir(path, TokenFileError)


def prepare_token_dir(path: Path) -> None:
    """Make the directories `write_token` writes into (the two kvtier ones 0700, the base
    0700 if missing), so that a place the token cannot go is found before anything starts,
    without touching a token file a running deployment may own. TokenFileError naming the
    path otherwise."""
    try:
        path.parent.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _private_dir(path.parent.parent)
        _private_dir(path.parent)
    except TokenFileError:
        raise
    except OSError as e:
        raise TokenFileError(f"{e.filename or path}: {e.strerror or e}") from None


def _owner_path(path: Path) -> Path:
    return path.with_name(path.name + OWNER_SUFFIX)


def _write_private(path: Path, text: str) -> None:
    """`text` into `path` (0600), atomically (a temporary name, then renamed)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_token(path: Path, token: str) -> None:
    """Write `token` to `path` readable by this user only (0600), atomically: a reader sees
    the old file or the new one, never a partial token; and this process as its owner to
    `admin-token.pid` (first, so a token is never without its owner). The two kvtier
    directories above it are made 0700; the base directory is created 0700 if missing."""
    prepare_token_dir(path)
    try:
        pid = os.getpid()
        _write_private(_owner_path(path),
                       f"{pid} {process_start_time(pid) or 0} {_pid_namespace()}\n")
        _write_private(path, token + "\n")
    except OSError as e:
        raise TokenFileError(f"{e.filename or path}: {e.strerror or e}") from None


def _owner_gone(path: Path) -> bool:
    """Whether the serve that wrote `path` has exited (its `admin-token.pid` names a process
    that is gone, or another one under a reused pid). False without an owner file."""
    try:
        pid_text, start_text, ns_text = _owner_path(path).read_text().split()
        pid, start, namespace = int(pid_text), int(start_text), int(ns_text)
    except (OSError, ValueError):
        return False
    if namespace != _pid_namespace():  # e.g. a container's volume read on the host: its
        return False  # pids mean nothing here, so nothing can be told
    return not (pid_alive(pid) and process_start_time(pid) == start)


def _pid_namespace() -> int:
    """This process's pid namespace (the inode of /proc/self/ns/pid; 0 when unknown)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def read_token(path: Path) -> str | None:
    """The token in `path`, or None when there is no readable, non-empty file."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


def remove_token(path: Path, token: str) -> None:
    """Remove the token file if it still holds `token` (a later start may have replaced it)."""
    if read_token(path) == token:
        with contextlib.suppress(OSError):
            path.unlink()
        with contextlib.suppress(OSError):
            _owner_path(path).unlink()


def client_token(deployment_id: str, env: Mapping[str, str] | None = None) -> str | None:
    """The token an admin client should present: KVTIER_ADMIN_TOKEN (or
    KVTIER_ADMIN__TOKEN) when set, else the deployment's state file, else None."""
    environ = os.environ if env is None else env
    for name in ("KVTIER_ADMIN_TOKEN", "KVTIER_ADMIN__TOKEN"):
        if environ.get(name):
            return environ[name]
    path = token_path(deployment_id, environ)
    token = read_token(path)
    if token is not None and _owner_gone(path):  # its serve was killed (SIGKILL): stale
        remove_token(path, token)
        return None
    return token


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the admin reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
