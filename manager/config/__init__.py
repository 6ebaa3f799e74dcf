"""kvtier's configuration: one TOML file plus `KVTIER_<SECTION>__<KEY>` environment variables.

Why it looks the way it does:

* Every key is declared once, in the section models (`sections`), with its default, its bounds
  and a description; `defaults_toml()` renders the documented reference from those
  declarations, so the documentation cannot drift from the code.
* Section models are strict (a TOML string is not an integer) and forbid unknown keys, because a
  misspelt key silently falling back to its default is the worst kind of configuration bug.
* Environment values are strings; `EnvironmentSource` converts each one to the declared type of
  the key it names *before* validation, so file and environment go through the same strict
  check and every error names the key, the value and (for the environment) the variable.
* `load_config` is pure: it reads, merges, validates and returns a new object or raises
  `ConfigError`; it creates no directory, segment or connection, so a bad configuration leaves
  nothing behind. Checks that depend on the machine (memory, `/dev/shm`, CUDA) run inside it
  too; whether the storage backend answers is `check_storage_reachable`, which the CLI calls.
* `ConfigError`'s text is one line meant for the operator; the CLI prints it and exits 2.

Its parts, bottom to top (import-linter contract `manager-config`): `base` (`ConfigError`,
shared bounds), `values` (one value's problems: paths, Redis URLs, endpoints), `sections` (the
section models), `model` (`KvtierConfig`, `SECTIONS`), `checks` (sizes, machine and storage
checks), then `loading` (sources, one-line errors, `load_config`) and `render` (`summary`,
`to_toml`). Everything public is re-exported here: `from kvtier.manager.config import
load_config` is the way to import it.
"""

from kvtier.manager.config.base import (
    DEPLOYMENT_ID_PATTERN,
    DTYPE_BYTES,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    MAX_BLOCKS,
    MAX_TIMEOUT_S,
    MAX_TTL_S,
    MEMINFO,
    NAME_MAX_BYTES,
    PATH_MAX_BYTES,
    SHM_DIR,
    TOKEN_ENV_ALIAS,
    ConfigError,
)
from kvtier.manager.config.checks import (
    check_memory,
    check_storage_reachable,
    check_storage_secret,
    device_pool_bytes,
    host_pool_bytes,
    mem_available_bytes,
    page_bytes,
    rank_device,
    resolve_device,
    shm_free_bytes,
    stale_segment_bytes,
    torch_gpu_build,
)
from kvtier.manager.config.loading import (
    NON_CONFIG_ENV,
    EnvironmentSource,
    Override,
    TomlFileSource,
    load_config,
    node_only,
    with_pool_sizes,
    with_sections,
)
from kvtier.manager.config.model import (
    SECTIONS,
    KvtierConfig,
)
from kvtier.manager.config.render import (
    defaults_toml,
    summary,
    to_toml,
)
from kvtier.manager.config.sections import (
    AdminConfig,
    AuditConfig,
    CacheConfig,
    ModelConfig,
    NodeConfig,
    StorageConfig,
    WorkersConfig,
)
from kvtier.manager.config.values import (
    local_endpoint_problem,
    parse_sample,
    path_problem,
    redact_url,
    redis_url_problem,
)

__all__ = [
    "DEPLOYMENT_ID_PATTERN",
    "DTYPE_BYTES",
    "ENV_NESTED_DELIMITER",
    "ENV_PREFIX",
    "MAX_BLOCKS",
    "MAX_TIMEOUT_S",
    "MAX_TTL_S",
    "MEMINFO",
    "NAME_MAX_BYTES",
    "NON_CONFIG_ENV",
    "PATH_MAX_BYTES",
    "SECTIONS",
    "SHM_DIR",
    "TOKEN_ENV_ALIAS",
    "AdminConfig",
    "AuditConfig",
    "CacheConfig",
    "ConfigError",
    "EnvironmentSource",
    "KvtierConfig",
    "ModelConfig",
    "NodeConfig",
    "Override",
    "StorageConfig",
    "TomlFileSource",
    "WorkersConfig",
    "check_memory",
    "check_storage_reachable",
    "check_storage_secret",
    "defaults_toml",
    "device_pool_bytes",
    "host_pool_bytes",
    "load_config",
    "local_endpoint_problem",
    "mem_available_bytes",
    "node_only",
    "page_bytes",
    "parse_sample",
    "path_problem",
    "rank_device",
    "redact_url",
    "redis_url_problem",
    "resolve_device",
    "shm_free_bytes",
    "stale_segment_bytes",
    "summary",
    "to_toml",
    "torch_gpu_build",
    "with_pool_sizes",
    "with_sections",
]
