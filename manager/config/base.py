"""What every part of the configuration shares: `ConfigError` and the names and bounds more
than one part uses (the environment prefix, dtype sizes, block, path and time limits, where
memory is read)."""

from __future__ import annotations

import re
from pathlib import Path

from kvtier.manager.errors import KvtierError

ENV_PREFIX = "KVTIER_"
ENV_NESTED_DELIMITER = "__"
TOKEN_ENV_ALIAS = "KVTIER_ADMIN_TOKEN"
"""Accepted besides `KVTIER_ADMIN__TOKEN` because it is the name operators expect for a secret."""

DTYPE_BYTES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
}
"""Bytes per element of every KV dtype kvtier accepts (kept here so sizing needs no torch)."""

MAX_BLOCKS = 2**31 - 1
"""Block counts stay below 2**31 so that every block id fits an int32 array or index tensor."""

DEPLOYMENT_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,31}")
"""No `_` in the id: segment names are `/kvtier_<id>_<what>`, so the first `_` after the prefix
ends the id and the stale-segment sweep of deployment `a` can never match deployment `a_b`."""

SHM_DIR = Path("/dev/shm")
MEMINFO = Path("/proc/meminfo")

MAX_TIMEOUT_S = 3600.0
MAX_TTL_S = 10 * 365 * 86400.0
"""storage.ttl_s: ten years (Redis takes it in milliseconds, as a 64-bit integer)."""
"""Upper bound of every timeout key: an hour is far beyond any sensible wait, and a bound keeps
deadlines (monotonic time + timeout) finite and comparable."""

PATH_MAX_BYTES = 4095
NAME_MAX_BYTES = 255
"""Linux's limits on a path (PATH_MAX less the terminating NUL) and on one of its components."""


class ConfigError(KvtierError):
    """A configuration problem, as one line naming the key and the offending value."""
