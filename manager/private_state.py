"""kvtier's private state files: the storage secret, and the folder helpers the admin token
file (`kvtier.admin.auth`) shares.

State lives under `$XDG_STATE_HOME/kvtier` (else `~/.local/state/kvtier`, the XDG Base
Directory rule), in folders of mode 0700 that belong to this user, in files of mode 0600.

The storage secret authenticates every stored page (`kvtier.worker.storage.page_format`):
whoever can write the store but lacks the secret cannot make kvtier serve KV of their choosing.
It is `storage.secret` when set (prefer the variable KVTIER_STORAGE__SECRET), else the bytes of
`storage.secret_file`, by default `<state>/kvtier/storage-secret`, generated on first use with
32 random bytes. Every instance of one user on one machine thus shares one secret (and so the
pages of a shared folder or Redis) with no setup; instances on several machines that share a
Redis must be given the same secret. A secret file owned by another user, or readable or
writable by anybody else, is refused: whoever can read it can forge pages.

This module is in the manager because the manager resolves the secret (from the configuration,
before any worker starts) and hands it to the workers inside their spec, which travels in an
environment variable, never on a command line; the worker layer below never reads these files.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from kvtier.manager.errors import KvtierError

SECRET_FILE_NAME = "storage-secret"
SECRET_BYTES = 32
"""Random bytes of a generated storage secret."""
MIN_SECRET_BYTES = 16
"""The shortest secret accepted (from the configuration or a file)."""
_MAX_SECRET_FILE_BYTES = 4096


class PrivateStateError(KvtierError, OSError):
    """A private state file or folder cannot be used safely; the message names the path."""


class StorageSecretError(PrivateStateError):
    """The storage secret file is missing and cannot be made, or is not safe to use."""


def state_base(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_STATE_HOME/kvtier`, or `~/.local/state/kvtier` when XDG_STATE_HOME is unset or
    not absolute."""
    environ = os.environ if env is None else env
    base = environ.get("XDG_STATE_HOME", "")
    if not base or not os.path.isabs(base):
        home = environ.get("HOME") or str(Path.home())
        base = os.path.join(home, ".local", "state")
    return Path(base) / "kvtier"


def private_dir(path: Path, error: type[PrivateStateError] = PrivateStateError) -> None:
    """`path` exists as a directory of ours, mode 0700 (created so, or tightened); a symlink
    or another user's directory is refused (raises `error`), since whoever owns it could
    read or replace what is inside."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise error(f"{path} is not a directory")
    if info.st_uid != os.geteuid():
        raise error(f"{path} belongs to uid {info.st_uid}, not to this user")
    if stat.S_IMODE(info.st_mode) != 0o700:
        path.chmod(0o700)


def cache_base(env: Mapping[str, str] | None = None) -> Path:
    """`$XDG_CACHE_HOME/kvtier`, or `~/.cache/kvtier` when XDG_CACHE_HOME is unset or not
    absolute (the XDG rule: a relative value is ignored)."""
    environ = os.environ if env is None else env
    base = environ.get("XDG_CACHE_HOME", "")
    if not base or not os.path.isabs(base):
        home = environ.get("HOME") or str(Path.home())
        base = os.path.join(home, ".cache")
    return Path(base) / "kvtier"


def default_storage_path(deployment_id: str, env: Mapping[str, str] | None = None) -> Path:
    """Where the file storage tier lives when `storage.path` is empty:
    `<cache_base>/<deployment_id>/storage`. Stored pages can always be recomputed, so they
    are cache data (XDG_CACHE_HOME), not state; the path is absolute, so it does not depend
    on the folder kvtier was started from (the old default, `.kvtier/storage` under the
    current folder, gave one deployment a different store per working directory)."""
    return cache_base(env) / deployment_id / "storage"


def default_secret_file(env: Mapping[str, str] | None = None) -> Path:
    """Where the storage secret lives when `storage.secret_file` is empty."""
    return state_base(env) / SECRET_FILE_NAME


def _read_secret(path: Path) -> bytes | None:
    """The secret in `path`, None when there is no such file; refuses an unsafe file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:  # before fdopen, which refuses a directory with a bare fd number in its message
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
        raise StorageSecretError(f"storage secret file {path} is {kind}, not a regular file "
                                 "holding the secret")
    with os.fdopen(fd, "rb") as handle:
        if info.st_uid != os.geteuid():
            raise StorageSecretError(
                f"storage secret file {path} belongs to uid {info.st_uid}, not to this user "
                f"(uid {os.geteuid()}): refusing a secret somebody else controls")
        if info.st_mode & 0o077:
            raise StorageSecretError(
                f"storage secret file {path} has mode {stat.S_IMODE(info.st_mode):o}: others "
                f"may read or write it, and whoever reads it can forge pages; "
                f"chmod 600 {path} (and share it with other hosts by a safe channel)")
        data = handle.read(_MAX_SECRET_FILE_BYTES + 1)
    if not MIN_SECRET_BYTES <= len(data) <= _MAX_SECRET_FILE_BYTES:
        raise StorageSecretError(
            f"storage secret file {path} holds {len(data)} bytes; a storage secret is "
            f"{MIN_SECRET_BYTES} to {_MAX_SECRET_FILE_BYTES} bytes (delete the file to have "
            "kvtier generate one)")
    return data


def _create_secret(path: Path) -> None:
    """Write a fresh random secret to `path` (0600) unless a file is there already. The file
    appears whole (written to a temporary name, then hard-linked into place), and two
    instances starting at once end up with the same secret: the link fails for the second,
    which then reads the first one's."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(SECRET_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def load_secret_file(path: Path | None = None, env: Mapping[str, str] | None = None) -> bytes:
    """The storage secret in `path` (default: `default_secret_file(env)`), generated on
    first use. The default file's folders are made private (0700); a given file's missing
    folders are created 0700. Raises StorageSecretError naming the path."""
    default = path is None
    target = default_secret_file(env) if path is None else path
    try:
        if default:
            target.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            private_dir(target.parent, StorageSecretError)
        else:
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = _read_secret(target)
        if data is None:
            _create_secret(target)
            data = _read_secret(target)
    except StorageSecretError:
        raise
    except OSError as e:
        raise StorageSecretError(
            f"storage secret file {e.filename or target}: {e.strerror or e}") from None
    if data is None:
        raise StorageSecretError(f"storage secret file {target} vanished while it was made")
    return data


def storage_secret(secret: str, secret_file: str,
                   env: Mapping[str, str] | None = None) -> bytes:
    """The deployment's storage secret: `secret` (UTF-8) when set, else the bytes of
    `secret_file` (`~` expanded; empty: the default file), generated on first use."""
    if secret:
        return secret.encode("utf-8")
    path = Path(os.path.expanduser(secret_file)) if secret_file else None
    return load_secret_file(path, env)
