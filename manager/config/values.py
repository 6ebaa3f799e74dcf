"""One value's problems, before any configuration exists: a path no file system call takes, a
Redis URL (and its TLS options) redis-py would trip over, a ZMQ endpoint kvtier may not bind;
and how a value is shown in a message (a Redis password redacted, a long value cut)."""

from __future__ import annotations

import math
import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kvtier.manager.config.base import NAME_MAX_BYTES, PATH_MAX_BYTES


def path_problem(path: str) -> str | None:
    """Why no file system call could take `path` (a NUL byte, too long a path or component),
    or None if it is a possible path."""
    if "\x00" in path:
        return "contains a NUL character"
    encoded = os.fsencode(path)
    if len(encoded) > PATH_MAX_BYTES:
        return f"{len(encoded)} bytes long; a path may have at most {PATH_MAX_BYTES}"
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > NAME_MAX_BYTES:
        return (f"has a {len(longest)}-byte component; a file name may have at most "
                f"{NAME_MAX_BYTES} bytes")
    return None


def redis_url_problem(url: str) -> str | None:
    """Why `url` is not a usable Redis URL (redis://, rediss://, or a cluster node as
    redis+cluster:// or rediss+cluster://), or None if it is."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if parts.scheme not in ("redis", "rediss", "redis+cluster", "rediss+cluster"):
        return ("expected a redis:// or rediss:// URL (redis+cluster:// or rediss+cluster:// "
                "for a Redis Cluster)")
    if not parts.hostname:
        return "the URL names no host"
    if port == 0:
        return "port 0 is not a Redis port"
    database = parts.path.lstrip("/")
    if database and not database.isdigit():
        return f"the database {database!r} is not a number"
    if database not in ("", "0") and parts.scheme.endswith("+cluster"):
        return f"a Redis Cluster has only database 0, not {database}"
    return _redis_tls_problem(parts.scheme.startswith("rediss"), parts.query)


# The query options a Redis URL may carry: redis-py's TLS settings. redis-py passes any other
# query key to its connection class (a TypeError deep in the first connect) or lets it override
# the timeouts and retries kvtier sets, so everything else is refused here, by name.
_TLS_FILE_OPTIONS = {"ssl_ca_certs": "file", "ssl_certfile": "file", "ssl_keyfile": "file",
                     "ssl_ca_path": "directory"}
_TLS_CHOICES = {"ssl_cert_reqs": ("none", "optional", "required"),
                "ssl_check_hostname": ("true", "false")}


def _redis_tls_problem(tls: bool, query: str) -> str | None:
    """Why the query part of a Redis URL is not a usable set of TLS options, or None. Only a
    rediss:// URL takes them (a plain connection would ignore a CA silently); each file must
    be readable now, not at the first backup."""
    if not query:
        return None
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        return f"cannot parse the query {query!r} (expected name=value&...)"
    allowed = sorted([*_TLS_FILE_OPTIONS, *_TLS_CHOICES])
    seen: set[str] = set()
    for name, value in pairs:
        if name not in _TLS_FILE_OPTIONS and name not in _TLS_CHOICES:
            return (f"unknown URL option {name!r}; a Redis URL takes only the TLS options "
                    f"{', '.join(allowed)}")
        if name in seen:
            return f"the URL option {name!r} is given twice"
        seen.add(name)
        if not tls:
            return f"the TLS option {name!r} needs a rediss:// URL (this one is not TLS)"
        if name in _TLS_CHOICES:
            if value.lower() not in _TLS_CHOICES[name]:
                return (f"{name} = {value!r}: expected one of "
                        f"{', '.join(_TLS_CHOICES[name])}")
            continue
        kind = _TLS_FILE_OPTIONS[name]
        if not value:
            return f"{name} is empty: expected the path of a {kind}"
        if not os.path.isabs(value):
            return f"{name} = {value!r}: expected an absolute path"
        is_kind = os.path.isdir(value) if kind == "directory" else os.path.isfile(value)
        if not is_kind or not os.access(value, os.R_OK):
            return f"{name} = {value!r}: not a readable {kind}"
    return None


def redact_url(url: str) -> str:
    """The URL without its password, for logs, errors and /status (even when malformed)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    user_info, host = parts.netloc.rsplit("@", 1)
    if ":" not in user_info:
        return url
    user = user_info.split(":", 1)[0]
    return parts._replace(netloc=f"{user}:***@{host}").geturl()


_LOOPBACK = ("127.0.0.1", "[::1]", "localhost")


def local_endpoint_problem(endpoint: str) -> str:
    """Why `endpoint` is not a local ZMQ endpoint kvtier may bind ("" when it is one):
    ipc:// with an absolute path of at most 107 bytes, or tcp:// on a loopback address."""
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path.startswith("/"):
            return f"{endpoint!r}: an ipc endpoint needs an absolute path"
        if len(path.encode()) > 107:
            return f"{endpoint!r}: an ipc path has at most 107 bytes"
        return ""
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or host not in _LOOPBACK:
            return (f"{endpoint!r}: a tcp endpoint must be on loopback "
                    f"({', '.join(_LOOPBACK)}) with a port")
        if not port.isdigit() or not 0 <= int(port) <= 65535:
            return f"{endpoint!r}: port {port!r} is not 0-65535"
        return ""
    return f"{endpoint!r}: expected ipc://<absolute path> or tcp://127.0.0.1:<port>"


def _short_repr(value: Any, limit: int = 120) -> str:
    """repr(value), cut in the middle when longer than `limit` characters (a 5,000-character
    path stays a readable line)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit // 2]}...{text[-limit // 4:]}{size}"


def parse_sample(value: str | float) -> float:
    """`audit.sample` as a probability: a number in [0, 1], or "k/N" (0 <= k <= N, N >= 1).
    Raises ValueError with a one-line reason."""
    if isinstance(value, bool):
        raise ValueError(f"expected a probability in [0, 1] or '1/N', got {value!r}")
    text = str(value).strip()
    try:
        if "/" in text:
            num, _, den = text.partition("/")
            k, n = int(num), int(den)
            if n < 1 or not 0 <= k <= n:
                raise ValueError
            rate = k / n
        else:
            rate = float(text)
    except ValueError:
        raise ValueError(f"expected a probability in [0, 1] or 'k/N' (0 <= k <= N, N >= 1), "
                         f"got {value!r}") from None
    if not 0.0 <= rate <= 1.0 or math.isnan(rate):
        raise ValueError(f"expected a probability in [0, 1] or 'k/N', got {value!r}")
    return rate
