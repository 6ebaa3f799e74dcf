"""kvtier's configuration: one TOML file plus `KVTIER_<SECTION>__<KEY>` environment variables.

Why it looks the way it does:

* Every key is declared once, in the section models below, with its default, its bounds and a
  description; `defaults_toml()` renders the documented reference from those declarations, so
  the documentation cannot drift from the code.
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
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
import tempfile
import textwrap
import threading
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl, urlsplit

from kvtier.manager.errors import KvtierError
from kvtier.manager.private_state import MIN_SECRET_BYTES, default_storage_path
from kvtier.worker import numa
from kvtier.worker.delays import DELAY_ENVS
from kvtier.worker.ipc import MAX_RANKS
from kvtier.worker.page_layout import PageLayout
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

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


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------

_SECTION = ConfigDict(extra="forbid", strict=True, frozen=True)


class ModelConfig(BaseModel):
    """The KV shape of one tensor-parallel rank: it fixes the bytes of one cached block."""

    model_config = _SECTION

    name: str = Field(
        "",
        max_length=200,
        description="the model's identity (name and revision or weights hash); part of the "
        "storage namespace, so two models of the same KV shape never read each other's pages. "
        "Empty: the shape alone names the namespace",
    )
    num_layers: int = Field(8, ge=1, le=4096, description="transformer layers holding KV")
    num_kv_heads: int = Field(4, ge=1, le=4096, description="KV heads on one rank")
    head_dim: int = Field(64, ge=1, le=65536, description="elements per head")
    dtype: Literal["float16", "bfloat16", "float32", "float8_e4m3fn"] = Field(
        "float16", description="element type of K and V"
    )
    num_extra_layers: int = Field(
        0, ge=0, le=4096, description="KV layers beyond num_layers (the MTP draft layers of "
        "speculative decoding); stored after them in every tier and part of the storage "
        "namespace")
    kv_scales: Literal["none", "per_block_head"] = Field(
        "none", description="per_block_head: every block carries float32 dequantization "
        "scales per layer, K and V and KV head, moved and checked with it in every tier "
        "(needs dtype float8_e4m3fn)")

    @field_validator("kv_scales")
    @classmethod
    def _scales_need_fp8(cls, kv_scales: str, info: ValidationInfo) -> str:
        # Scales only mean something for quantized KV; on a float16 cache they would be dead
        # bytes in every page that no reader uses.
        dtype = info.data.get("dtype")
        if kv_scales != "none" and dtype is not None and dtype != "float8_e4m3fn":
            raise ValueError(f"scales need a quantized KV dtype, but model.dtype = {dtype!r}; "
                             "set model.dtype = 'float8_e4m3fn' or model.kv_scales = 'none'")
        return kv_scales


class CacheConfig(BaseModel):
    """Sizes of the device and host tiers and the policy that copies blocks down to host.

    Invariant (checked on `KvtierConfig`): `decode_reserve_blocks < device_blocks`.
    """

    model_config = _SECTION

    block_size: int = Field(
        64,
        ge=1,
        le=1 << 20,
        description="tokens per block; any positive integer (powers of two are typical; the "
        "512-token blocks of a trace need not be a multiple of it)",
    )
    device_blocks: int = Field(2048, ge=1, le=MAX_BLOCKS, description="blocks in the device pool")
    host_blocks: int = Field(
        8192, ge=0, le=MAX_BLOCKS, description="blocks in the host pool (shared memory); 0: none"
    )
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field(
        "write_through_selective",
        description="when a device block is copied to host: at commit (write_through), once "
        "hit hit_threshold times (write_through_selective), or on eviction (write_back); "
        "ignored when host_blocks = 0",
    )
    hit_threshold: int = Field(
        2, ge=1, description="hits before write_through_selective backs a block up to host"
    )
    decode_reserve_blocks: int = Field(
        1, ge=0, description="extra device blocks allocate() reserves per request for decoding"
    )


class StorageConfig(BaseModel):
    """The storage tier (files or Redis) behind the host tier, and its prefetch policy.

    `prefetch_host_blocks_limit` is None when not configured; `KvtierConfig` then reads it as a
    quarter of `cache.host_blocks` (see `effective_prefetch_host_blocks_limit`).
    """

    model_config = _SECTION

    backend: Literal["none", "file", "redis"] = Field(
        "file", description="where the storage tier lives"
    )
    path: str = Field(
        "",
        description="directory of the file backend; empty: $XDG_CACHE_HOME/kvtier/"
        "<deployment_id>/storage (else ~/.cache/kvtier/<deployment_id>/storage); a relative "
        "path is taken from the folder kvtier is started in",
    )
    url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis URL of the redis backend: redis:// or rediss:// (TLS) for one server, "
        "redis+cluster:// or rediss+cluster:// and any one node for a Redis Cluster; an ACL user "
        "and password as redis://user:password@host:port/0; TLS options as a query, e.g. "
        "rediss://host:6380/0?ssl_ca_certs=/path/ca.pem (also ssl_cert_reqs, "
        "ssl_check_hostname, ssl_certfile, ssl_keyfile, ssl_ca_path)",
    )
    prefetch_policy: Literal["best_effort", "wait_complete", "timeout"] = Field(
        "best_effort",
        description="what match() waits for when prefetching from storage: nothing "
        "(best_effort), the whole prefetch (wait_complete), or at most the timeout (timeout)",
    )
    prefetch_threshold: int = Field(
        256, ge=0, description="tokens a storage hit must reach before it is prefetched"
    )
    capacity_bytes: int = Field(
        8 * 1024**3,
        ge=1,
        description="size limit of the file backend in bytes (Redis has its own maxmemory)",
    )
    ttl_s: float = Field(
        0.0,
        ge=0,
        le=MAX_TTL_S,
        allow_inf_nan=False,
        description="seconds a stored page lives; 0: forever",
    )
    timeout_base_s: float = Field(
        0.01,
        ge=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="prefetch_policy = timeout: the fixed part of the longest wait",
    )
    timeout_per_1k_tokens_s: float = Field(
        0.005,
        ge=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="prefetch_policy = timeout: the wait added per 1000 tokens prefetched",
    )
    prefetch_host_blocks_limit: int | None = Field(
        None,
        ge=0,
        le=MAX_BLOCKS,
        description="host blocks that prefetches in flight may hold; default: a quarter of "
        "cache.host_blocks",
    )
    index_refresh_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        allow_inf_nan=False,
        description="seconds between two listings of what storage holds (the key-addressed "
        "surface answers a miss at once for a block the last listing lacks: a page another "
        "instance wrote since costs a recompute); 0: never list (a block this process did not "
        "write or find waits up to 0.25 s for its storage query)",
    )
    backup_one_rank: bool = Field(
        False,
        description="only rank 0 writes to storage (the KV is identical on every rank, as with "
        "MLA); otherwise every rank writes its own pages",
    )
    # When host copies are written to storage (manager/policies.py, the second table).
    write_policy: Literal["write_through", "write_through_selective", "write_back"] = Field(
        "write_through",
        description="when a host copy is written to storage: when it lands on the host "
        "(write_through), once its block was hit write_threshold times "
        "(write_through_selective), or when the host tier evicts it (write_back)",
    )
    write_threshold: int = Field(
        1, ge=1, le=1 << 20,
        description="hits before write_through_selective writes a block to storage",
    )
    max_backup_mb_s: float = Field(
        0.0, ge=0, le=1 << 20, allow_inf_nan=False,
        description="MB/s that backups may write to storage (a token bucket holding one "
        "second's worth; a batch over it is not written, counted as backup_skipped_pages); "
        "0: no limit",
    )
    secret: SecretStr = Field(
        SecretStr(""),
        description="the storage secret that authenticates every stored page, at least 16 "
        "characters (prefer KVTIER_STORAGE__SECRET); instances sharing a store must share it; "
        "empty: the bytes of secret_file",
    )
    secret_file: str = Field(
        "",
        description="file holding the storage secret when secret is empty, generated (32 random "
        "bytes, mode 0600) on first use; refused if another user owns it or others can read it; "
        "empty: $XDG_STATE_HOME/kvtier/storage-secret (else ~/.local/state/kvtier/...)",
    )

    @field_validator("secret")
    @classmethod
    def _secret_is_long_enough(cls, secret: SecretStr) -> SecretStr:
        """A short secret is guessable: whoever guesses it can forge pages."""
        value = secret.get_secret_value()
        if value and len(value.encode("utf-8")) < MIN_SECRET_BYTES:
            raise ValueError(
                f"must be at least {MIN_SECRET_BYTES} bytes (e.g. openssl rand -hex 32)")
        return secret

    @field_validator("index_refresh_s")
    @classmethod
    def _refresh_is_off_or_sane(cls, seconds: float) -> float:
        """A listing walks the whole namespace: more often than twice a second would keep a
        worker lane busy listing."""
        if 0 < seconds < 0.5:
            raise ValueError("must be 0 (no listing) or at least 0.5 seconds")
        return seconds

    @field_validator("secret_file")
    @classmethod
    def _secret_file_is_a_path(cls, path: str) -> str:
        problem = path_problem(path) if path else None
        if problem:
            raise ValueError(problem)
        return path

    @field_validator("path")
    @classmethod
    def _path_is_a_path(cls, path: str) -> str:
        """Refuse what no file system call accepts, before a worker trips over it."""
        problem = path_problem(path) if path else None
        if problem:
            raise ValueError(problem)
        return path

    @field_validator("url")
    @classmethod
    def _url_is_redis(cls, url: str) -> str:
        """Parse the URL now so a typo is reported at start, not at the first backup."""
        problem = redis_url_problem(url)
        if problem:
            raise ValueError(problem)
        return url


class WorkersConfig(BaseModel):
    """The worker processes: one per tensor-parallel rank, and how long to wait for them."""

    model_config = _SECTION

    count: int = Field(
        1, ge=1, le=MAX_RANKS, description="tensor-parallel ranks, one process each"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where the device pool lives; auto: cuda when available, else cpu"
    )
    cuda_devices: str = Field(
        "",
        description="CUDA device index of each rank, comma-separated ('0,0': two ranks on one "
        "GPU); empty: rank r uses cuda:r",
    )
    ready_timeout_s: float = Field(
        60.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="seconds a starting worker has to get ready",
    )
    engine_kv: bool = Field(
        False,
        description="the engine's model runner owns the device KV and registers it "
        "(kvtier.worker.engine_kv); workers attach to it instead of allocating a device pool",
    )
    host_numa: Literal["auto", "off"] | int = Field(
        "auto",
        description="NUMA node each rank's host pool is bound to (mbind): auto: the node of "
        "the rank's GPU (none for a CPU device or on a one-node machine); a node number: that "
        "node, which must be online; off: never bound",
    )

    @field_validator("host_numa", mode="before")
    @classmethod
    def _numa(cls, value: object) -> str | int:
        return numa.check_setting(value)  # a node's presence is a machine check (check_memory)

    @field_validator("cuda_devices")
    @classmethod
    def _indices(cls, value: str) -> str:
        if value and not all(p.strip().isdigit() for p in value.split(",")):
            raise ValueError("expected CUDA device indices separated by commas, such as '0,1'")
        return ",".join(p.strip() for p in value.split(",")) if value else value

    def rank_cuda_index(self, rank: int) -> int:
        """The CUDA device index rank `rank` uses: `cuda_devices[rank]`, else `rank`."""
        return int(self.cuda_devices.split(",")[rank]) if self.cuda_devices else rank
    heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        le=MAX_TIMEOUT_S,
        allow_inf_nan=False,
        description="heartbeat age after which a worker is dead",
    )


class AdminConfig(BaseModel):
    """The admin HTTP endpoint and the limits it enforces. The token is a SecretStr so it never
    shows up in a repr/log.

    `auth = "token"` (the default) with an empty `token`: `kvtier serve` generates a token at
    start and writes it, readable by its user only, to the state file
    (`kvtier.admin.auth.token_path`). The limits bound what one request may cost: its body,
    its token ids and multimodal items, how long its bytes may take to arrive."""

    model_config = _SECTION

    host: str = Field("127.0.0.1", description="address the admin binds")
    port: int = Field(8080, ge=0, le=65535, description="admin port; 0: any free port")
    auth: Literal["token", "none"] = Field(
        "token",
        description="token: every POST must carry 'Authorization: Bearer <token>'; none: POSTs "
        "need no token (anyone who reaches the port can reset, pause or pin)",
    )
    token: SecretStr = Field(
        SecretStr(""),
        description="the bearer token (prefer KVTIER_ADMIN_TOKEN); empty with auth = token: "
        "generated at start and written to $XDG_STATE_HOME/kvtier/<deployment_id>/admin-token",
    )
    max_body_bytes: int = Field(
        4 * 1024**2, ge=1024, le=1024**3,
        description="largest POST body accepted; larger ones get 413",
    )
    max_pin_tokens: int = Field(
        262144, ge=1, le=1 << 24, description="most token ids one /pin or /unpin may name"
    )
    max_extra_keys: int = Field(
        1024, ge=0, le=1 << 20, description="most multimodal items one /pin or /unpin may name"
    )
    request_timeout_s: float = Field(
        10.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="seconds a client has to send a request's headers and body; then 408 and "
        "the connection is closed",
    )
    keep_alive_s: int = Field(
        5, ge=1, le=int(MAX_TIMEOUT_S),
        description="seconds an idle keep-alive connection stays open between requests",
    )
    max_connections: int = Field(
        64, ge=1, le=65535,
        description="connections (and requests in progress) beyond which requests get 503",
    )

    @field_validator("host")
    @classmethod
    def _host_is_one_word(cls, host: str) -> str:
        if not host or any(ch.isspace() for ch in host) or "/" in host:
            raise ValueError("expected an address or host name such as 127.0.0.1 or 0.0.0.0")
        return host


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


class NodeConfig(BaseModel):
    """The node service of `kvtier serve`: a Unix socket engines attach to (no TCP), and what
    each namespace (one model's KV, as the storage namespace names it) may hold in host
    memory. See `kvtier.manager.node`."""

    model_config = _SECTION

    enabled: bool = Field(True, description="open the engine socket (false: REST only)")
    socket: str = Field(
        "",
        description="the engine socket's path; empty: $XDG_RUNTIME_DIR/kvtier/<deployment_id>/"
        "node.sock, else the state dir's node.sock. Its directory is made private (0700)",
    )
    allowed_gid: int = Field(
        -1, ge=-1, le=(1 << 32) - 2,
        description="engines of this primary group may attach besides the service's own user "
        "(-1: the service's user only)",
    )
    namespace_quota_bytes: int = Field(
        1 << 30, ge=1, le=1 << 50,
        description="host memory of one namespace over all its ranks, unless `quotas` names it",
    )
    quotas: dict[str, int] = Field(
        default_factory=dict,
        description="namespace -> host bytes over all its ranks, overriding "
        "namespace_quota_bytes",
    )
    host_budget_bytes: int = Field(
        0, ge=0, le=1 << 50,
        description="host memory of all namespaces together; an attach of a new namespace "
        "beyond it is refused (0: no node-wide limit)",
    )
    max_engines: int = Field(64, ge=1, le=4096, description="engine connections at once")
    send_timeout_s: float = Field(
        2.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="an engine that does not read its replies for this long is dropped",
    )
    abandon_grace_s: float = Field(
        5.0, ge=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="host blocks of stores a dead engine left open stay out of use this long "
        "(a copy it had started may still land) before they are freed, never served",
    )

    events: bool = Field(
        False,
        description="publish the host tier and storage of every namespace as vLLM KV events "
        "(ZMQ PUB and a replay ROUTER; see README 'Routing on kvtier's events')",
    )
    events_endpoint: str = Field(
        "",
        description="the events' PUB endpoint: ipc://<absolute path> or tcp://127.0.0.1:<port> "
        "(also [::1] or localhost; port 0: any free port); empty: ipc://events.pub in the "
        "engine socket's private directory",
    )
    events_replay_endpoint: str = Field(
        "",
        description="the replay ROUTER endpoint (same forms); empty: ipc://events.replay in the "
        "engine socket's private directory",
    )
    events_topic_prefix: str = Field(
        "kvtier", min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$",
        description="topics are <prefix>/host/<namespace> and <prefix>/storage/<namespace>",
    )
    events_buffer_batches: int = Field(
        10_000, ge=1, le=1_000_000,
        description="batches kept for replay (the oldest are dropped first)",
    )
    events_interval_s: float = Field(
        0.05, ge=0.005, le=10.0, allow_inf_nan=False,
        description="how often the publisher reconciles each namespace's tiers and sends a batch",
    )

    @field_validator("events_endpoint", "events_replay_endpoint")
    @classmethod
    def _local_endpoint(cls, value: str) -> str:
        if value:
            why = local_endpoint_problem(value)
            if why:
                raise ValueError(why)
        return value

    @field_validator("events_replay_endpoint")
    @classmethod
    def _endpoints_differ(cls, value: str, info: ValidationInfo) -> str:
        pub = info.data.get("events_endpoint")
        if value and value == pub and not value.endswith(":0"):
            raise ValueError(f"{value!r} is node.events_endpoint too; they must differ")
        return value

    @field_validator("quotas")
    @classmethod
    def _quotas_are_sizes(cls, value: dict[str, int]) -> dict[str, int]:
        for ns, n in value.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"quota of namespace {ns!r}: expected bytes > 0, got {n!r}")
        return value

    def quota(self, namespace: str) -> int:
        """Host bytes namespace `namespace` may hold, over all its ranks."""
        return self.quotas.get(namespace, self.namespace_quota_bytes)


class KvtierConfig(BaseSettings):
    """The whole configuration: a top-level `deployment_id` and one model per TOML section.

    Invariants: every section is immutable after validation; `decode_reserve_blocks` is below
    `device_blocks`; a prefetch limit never exceeds the host pool; a storage backend requires a
    host tier (backups and prefetches go through host blocks). `KvtierConfig()` gives the
    embedded defaults; it does not read the environment itself (`load_config` does, so that the
    source of every value is known when reporting an error).
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=ENV_NESTED_DELIMITER,
        extra="forbid",
        strict=True,
        frozen=True,
    )

    deployment_id: str = Field(
        "default",
        description="names every shared-memory segment and queue (/kvtier_<id>_...); two "
        "deployments on one machine need different ids. 1-32 letters, digits or '-'",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig, description="The KV shape of one tensor-parallel rank."
    )
    cache: CacheConfig = Field(
        default_factory=CacheConfig,
        description="The device and host tiers, and when blocks are copied from one to the other.",
    )
    storage: StorageConfig = Field(
        default_factory=StorageConfig,
        description="The storage tier behind the host tier (local files or a shared Redis), and "
        "when it is read back.",
    )
    workers: WorkersConfig = Field(
        default_factory=WorkersConfig,
        description="Worker processes: one per tensor-parallel rank, each owning the KV bytes of "
        "its rank.",
    )
    admin: AdminConfig = Field(
        default_factory=AdminConfig, description="The admin HTTP API (REST, /metrics)."
    )
    node: NodeConfig = Field(
        default_factory=NodeConfig,
        description="The node service: engines attach over a Unix socket and share the host "
        "tier by namespace.",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Only explicit values: file and environment are merged by `load_config`."""
        return (init_settings,)

    @field_validator("deployment_id")
    @classmethod
    def _deployment_id_is_a_name(cls, value: str) -> str:
        if not DEPLOYMENT_ID_PATTERN.fullmatch(value):
            raise ValueError(
                "expected 1-32 letters, digits or '-', starting with a letter or digit "
                "(it names shared-memory segments /kvtier_<id>_...)"
            )
        return value

    @model_validator(mode="after")
    def _sections_agree(self) -> KvtierConfig:
        cache, storage = self.cache, self.storage
        if cache.decode_reserve_blocks >= cache.device_blocks:
            raise ValueError(
                f"cache.decode_reserve_blocks = {cache.decode_reserve_blocks}: must be less "
                f"than cache.device_blocks ({cache.device_blocks})"
            )
        limit = storage.prefetch_host_blocks_limit
        if limit is not None and limit > cache.host_blocks:
            raise ValueError(
                f"storage.prefetch_host_blocks_limit = {limit}: must be at most "
                f"cache.host_blocks ({cache.host_blocks})"
            )
        devices = self.workers.cuda_devices
        if devices and len(devices.split(",")) != self.workers.count:
            raise ValueError(
                f"workers.cuda_devices = {devices!r}: names {len(devices.split(','))} "
                f"device(s) but workers.count = {self.workers.count}; give one index per rank"
            )
        if self.admin.auth == "none" and self.admin.token.get_secret_value():
            raise ValueError(
                "admin.auth = 'none' but admin.token is set: a token would be ignored; set "
                "admin.auth = 'token' to require it, or unset the token"
            )
        if storage.backend != "none" and cache.host_blocks == 0:
            raise ValueError(
                f"storage.backend = {storage.backend!r}: the storage tier moves pages through "
                "host blocks, but cache.host_blocks = 0; set storage.backend = 'none' or give "
                "the host tier blocks"
            )
        return self

    def storage_dir(self, env: Mapping[str, str] | None = None) -> str:
        """The absolute directory of the file backend: `storage.path` made absolute against
        the current folder, or, when empty, the default under the user's cache directory
        (`default_storage_path`, read from `env`, default os.environ, at call time: the
        manager resolves it once and hands the result to its workers)."""
        if self.storage.path:
            return os.path.abspath(self.storage.path)
        return str(default_storage_path(self.deployment_id, env))

    def effective_prefetch_host_blocks_limit(self) -> int:
        """The prefetch limit in host blocks: the configured one, else host_blocks // 4."""
        limit = self.storage.prefetch_host_blocks_limit
        return self.cache.host_blocks // 4 if limit is None else limit


SECTIONS: dict[str, type[BaseModel]] = {
    name: info.annotation
    for name, info in KvtierConfig.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
}
"""TOML section name -> its model, in declaration (and documentation) order."""


def _field(path: tuple[str, ...]) -> FieldInfo | None:
    """The declaration of `section.key` or of a top-level key, or None if there is none."""
    if len(path) == 1:
        info = KvtierConfig.model_fields.get(path[0])
        return None if info is None or path[0] in SECTIONS else info
    if len(path) == 2 and path[0] in SECTIONS:
        return SECTIONS[path[0]].model_fields.get(path[1])
    return None


def _all_keys() -> list[str]:
    keys = [name for name in KvtierConfig.model_fields if name not in SECTIONS]
    for section, model in SECTIONS.items():
        keys.extend(f"{section}.{name}" for name in model.model_fields)
    return keys


def _unknown_key(dotted: str, origin: str | None = None) -> str:
    """`section.key: unknown key`, with where it came from and the closest real key."""
    notes = [f"from {origin}"] if origin else []
    if dotted in SECTIONS:
        notes.append(f"[{dotted}] is a section; name one of its keys")
    else:
        candidates = [*_all_keys(), *SECTIONS]
        close = difflib.get_close_matches(dotted, candidates, n=1, cutoff=0.75)
        notes += [f"did you mean {close[0]}?"] if close else []
    return f"{dotted}: unknown key" + (f" ({'; '.join(notes)})" if notes else "")


# --------------------------------------------------------------------------------------------
# Sources: the TOML file and the environment
# --------------------------------------------------------------------------------------------


def _scalar_type(annotation: Any) -> type:
    """The Python type an environment string must become for a field of this annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return type(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _scalar_type(members[0])
    if annotation is SecretStr:
        return str
    return typing.cast(type, annotation)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _convert_env(raw: str, target: type) -> Any:
    """Convert one environment string; raises ValueError with the 'expected ...' phrase."""
    text = raw.strip()
    if target is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError("expected true or false")
    if target is int:
        if not re.fullmatch(r"[+-]?[0-9][0-9_]*", text):
            raise ValueError("expected an integer")
        return int(text)
    if target is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("expected a number") from None
    return raw


class TomlFileSource(PydanticBaseSettingsSource):
    """The values of one TOML file, as read by tomllib; no file means no values."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | os.PathLike[str] | None):
        super().__init__(settings_cls)
        self.path = None if path is None else Path(path)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            with self.path.open("rb") as handle:
                return tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(self.path)!r}: not found") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {str(self.path)!r}: is a directory") from None
        except PermissionError:
            raise ConfigError(f"config file {str(self.path)!r}: permission denied") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(self.path)!r}: invalid TOML: {exc}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(self.path)!r}: not UTF-8 text") from None


# Variables with the prefix that are not configuration keys: the log level and the test hooks
# the launcher passes through to workers.
NON_CONFIG_ENV = frozenset({"KVTIER_LOG_LEVEL", *DELAY_ENVS})


class EnvironmentSource(PydanticBaseSettingsSource):
    """`KVTIER_<SECTION>__<KEY>` (and `KVTIER_DEPLOYMENT_ID`, `KVTIER_ADMIN_TOKEN`) from a mapping.

    Data: `origins` maps each (section, key) path it produced to the variable that set it, for
    error messages. Every variable with the prefix must name a key: a misspelt variable is an
    error, never silently ignored. Values are converted to the key's declared type here, so the
    model can validate file and environment values with the same strict rules.
    """

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]):
        super().__init__(settings_cls)
        self.environ = environ
        self.origins: dict[tuple[str, ...], str] = {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self().get(field_name), field_name, False

    def _path_of(self, name: str) -> tuple[str, ...] | None:
        if name.upper() == TOKEN_ENV_ALIAS:
            return ("admin", "token")
        rest = name[len(ENV_PREFIX) :].lower()
        path = tuple(rest.split(ENV_NESTED_DELIMITER))
        if any(not part for part in path) or len(path) > 2:
            return None
        return path

    def __call__(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        errors: list[str] = []
        self.origins = {}
        for name in sorted(self.environ):
            if not name.upper().startswith(ENV_PREFIX) or name.upper() in NON_CONFIG_ENV:
                continue
            raw = self.environ[name]
            path = self._path_of(name)
            if path is None:
                errors.append(
                    f"{name}: not a kvtier setting (expected {ENV_PREFIX}<SECTION>"
                    f"{ENV_NESTED_DELIMITER}<KEY> or {ENV_PREFIX}DEPLOYMENT_ID)"
                )
                continue
            info = _field(path)
            if info is None:
                errors.append(_unknown_key(".".join(path), name))
                continue
            if path in self.origins:
                if self.environ[self.origins[path]] != raw:
                    first, second = sorted((name, self.origins[path]), key=len)
                    errors.append(
                        f"{first} and {second} both set {'.'.join(path)} to "
                        "different values; set only one"
                    )
                continue
            try:
                value = _convert_env(raw, _scalar_type(info.annotation))
            except ValueError as exc:
                errors.append(f"{'.'.join(path)} = {_shown(path, raw)}: {exc} (from {name})")
                continue
            self.origins[path] = name
            target = values
            for part in path[:-1]:
                target = target.setdefault(part, {})
            target[path[-1]] = value
        if errors:
            raise ConfigError("; ".join(errors))
        return values


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`override` wins key by key; a section that is not a table in `base` stays as it is so
    that validation reports it instead of the environment silently replacing it."""
    merged = dict(base)
    for key, value in override.items():
        current = merged.get(key)
        if isinstance(value, dict):
            if key not in merged:
                merged[key] = value
            elif isinstance(current, dict):
                merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged


# --------------------------------------------------------------------------------------------
# Turning validation errors into one line each
# --------------------------------------------------------------------------------------------

_EXPECTED = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "string_too_short": "must not be empty",
}
_BOUNDS = {
    "greater_than_equal": (">=", "ge"),
    "greater_than": (">", "gt"),
    "less_than_equal": ("<=", "le"),
    "less_than": ("<", "lt"),
}


def _shown(path: tuple[str, ...], value: Any) -> str:
    """A value as an error message may show it: never the token, never a Redis password."""
    if path in (("admin", "token"), ("storage", "secret")):
        return "'***'"
    if path == ("storage", "url") and isinstance(value, str):
        return repr(redact_url(value))
    return _short_repr(value)


def _short_repr(value: Any, limit: int = 120) -> str:
    """repr(value), cut in the middle when longer than `limit` characters (a 5,000-character
    path stays a readable line)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" ({len(value)} characters)" if isinstance(value, str) else ""
    return f"{text[:limit // 2]}...{text[-limit // 4:]}{size}"


def _describe(error: Mapping[str, Any], origins: Mapping[tuple[str, ...], str]) -> str:
    path = tuple(str(part) for part in error["loc"])
    kind = error["type"]
    if not path:  # a cross-section rule: its message already names the keys
        return str(error.get("ctx", {}).get("error", error["msg"]))
    dotted = ".".join(path)
    origin = origins.get(path)
    suffix = f" (from {origin})" if origin else ""
    if kind == "extra_forbidden":
        return _unknown_key(dotted, origin)
    if kind in ("model_type", "dict_type", "model_attributes_type"):
        return f"{dotted} = {error['input']!r}: expected a table ([{dotted}])"
    shown = _shown(path, error["input"])
    if kind in _EXPECTED:
        problem = _EXPECTED[kind]
    elif kind in _BOUNDS:
        symbol, name = _BOUNDS[kind]
        bound = error["ctx"][name]
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        problem = f"must be {symbol} {bound}"
    elif kind == "literal_error":
        problem = f"expected one of {error['ctx']['expected']}"
    elif kind == "value_error":
        problem = str(error["ctx"]["error"])
    else:
        problem = str(error["msg"])
    return f"{dotted} = {shown}: {problem}{suffix}"


def _validate(data: Mapping[str, Any], origins: Mapping[tuple[str, ...], str]) -> KvtierConfig:
    try:
        return KvtierConfig.model_validate(dict(data))
    except ValidationError as exc:
        raise ConfigError("; ".join(_describe(err, origins) for err in exc.errors())) from None


def with_sections(cfg: KvtierConfig, updates: Mapping[str, Any],
                  sections: Mapping[str, Mapping[str, Any]]) -> KvtierConfig:
    """`cfg` with top-level `updates` and keys of `sections` replaced (a namespace's stack of
    the node service: its geometry is the engine's), validated as at start. ConfigError
    naming the key otherwise."""
    data = cfg.model_dump(mode="python")
    data |= dict(updates)
    for name, keys in sections.items():
        data[name] = dict(data[name]) | dict(keys)
    return _validate(data, {})


def with_pool_sizes(cfg: KvtierConfig, device_blocks: int, host_blocks: int) -> KvtierConfig:
    """`cfg` with other pool sizes (a wake after a sleep), validated as at start and checked
    against this machine's memory now. ConfigError naming the key otherwise."""
    data = cfg.model_dump(mode="python")
    data["cache"] |= {"device_blocks": device_blocks, "host_blocks": host_blocks}
    new = _validate(data, {})
    check_memory(new)
    return new


# --------------------------------------------------------------------------------------------
# Sizes and machine checks
# --------------------------------------------------------------------------------------------


def page_bytes(cfg: KvtierConfig) -> int:
    """Bytes of one block on one rank: K and V of every layer (extra layers included) and
    the block's scales, laid out as the workers lay it out (`kvtier.worker.page_layout`)."""
    m = cfg.model
    return PageLayout(m.num_layers, m.num_extra_layers, m.num_kv_heads, m.head_dim,
                      cfg.cache.block_size, DTYPE_BYTES[m.dtype],
                      m.kv_scales != "none").page_bytes


def device_pool_bytes(cfg: KvtierConfig) -> int:
    """Bytes of the device pools of all ranks together."""
    return cfg.cache.device_blocks * page_bytes(cfg) * cfg.workers.count


def host_pool_bytes(cfg: KvtierConfig) -> int:
    """Bytes of the host pools (shared memory) of all ranks together."""
    return cfg.cache.host_blocks * page_bytes(cfg) * cfg.workers.count


def torch_gpu_build(version_file: Path | None = None) -> bool:
    """Whether the installed torch was built for a GPU (CUDA or ROCm), read from its
    `version.py` without importing torch (2-3 s of a manager's start-up): a CPU build never
    sees a GPU. True when it cannot tell, so the caller asks torch itself."""
    if version_file is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return True
        version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return True
    builds = re.findall(r"^(cuda|hip)\b[^=\n]*=\s*(\S+)", text, re.MULTILINE)
    if {name for name, _ in builds} != {"cuda", "hip"}:
        return True
    return any(value != "None" for _, value in builds)


def resolve_device(cfg: KvtierConfig) -> Literal["cpu", "cuda"]:
    """Where the device pools live. torch is imported only when CUDA is a possibility."""
    if cfg.workers.device == "cpu":
        return "cpu"
    if not torch_gpu_build():
        if cfg.workers.device == "cuda":
            raise ConfigError("workers.device = 'cuda': CUDA is not available on this machine "
                              "(the installed torch is a CPU build)")
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if cfg.workers.device == "cuda" and not available:
        raise ConfigError("workers.device = 'cuda': CUDA is not available on this machine")
    return "cuda" if available else "cpu"


def rank_device(cfg: KvtierConfig, rank: int) -> str:
    """The device string rank `rank`'s worker builds its device pool on: "cpu", or
    "cuda:<index>" from `workers.cuda_devices` (default: rank r on cuda:r). Explicit, so a
    worker never lands on whatever CUDA device happens to be current in its process."""
    if resolve_device(cfg) == "cpu":
        return "cpu"
    return f"cuda:{cfg.workers.rank_cuda_index(rank)}"


def _human(n: int) -> str:
    """Bytes in binary units, for a reader comparing sizes at a glance."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    for unit in units:
        value /= 1024
        if value < 1024 or unit == units[-1]:
            break
    return f"{value:.1f} {unit}"


def mem_available_bytes(meminfo: Path = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo, or None where there is no such file."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(found.group(1)) * 1024 if found else None


def stale_segment_bytes(deployment_id: str, shm_dir: Path = SHM_DIR) -> int:
    """Bytes held in `shm_dir` by segments of this deployment: stale ones are removed at
    start, so the memory check counts them as free."""
    held = 0
    prefix = f"kvtier_{deployment_id}_"
    try:
        with os.scandir(shm_dir) as entries:
            for entry in entries:
                if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                    held += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    return held


def shm_free_bytes(deployment_id: str, shm_dir: Path = SHM_DIR) -> int | None:
    """Free bytes in /dev/shm, counting this deployment's stale segments as free, or None
    where there is no such directory."""
    try:
        stat = os.statvfs(shm_dir)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize + stale_segment_bytes(deployment_id, shm_dir)


def _too_big(key: str, value: int, what: str, need: int, where: str, have: int) -> ConfigError:
    return ConfigError(
        f"{key} = {value}: {what} needs {need} bytes ({_human(need)}) but only {have} bytes "
        f"({_human(have)}) are available in {where}"
    )


def check_memory(
    cfg: KvtierConfig,
    *,
    meminfo: Path = MEMINFO,
    shm_dir: Path = SHM_DIR,
) -> None:
    """Refuse block counts whose pools cannot be allocated on this machine (and a
    `workers.host_numa` node it does not have).

    A pool that does not fit would otherwise fail deep inside a worker (SIGBUS on a shared-memory
    page, or the OOM killer), long after start and far from the key that caused it.
    """
    node = cfg.workers.host_numa
    if isinstance(node, int):
        try:
            numa.check_online(node)
        except numa.NumaError as e:
            raise ConfigError(str(e)) from None
    page = page_bytes(cfg)
    count = cfg.workers.count
    mem = mem_available_bytes(meminfo)
    # With engine_kv the device KV is the engine's, allocated (and counted) already.
    device = 0 if cfg.workers.engine_kv else device_pool_bytes(cfg)
    host = host_pool_bytes(cfg)
    per_ranks = f"x {page} bytes per block x {count} worker{'s' if count != 1 else ''}"
    on_cpu = resolve_device(cfg) == "cpu"
    if on_cpu and mem is not None and device > mem:
        what = f"the device pool on cpu ({cfg.cache.device_blocks} blocks {per_ranks})"
        raise _too_big(
            "cache.device_blocks", cfg.cache.device_blocks, what, device, "MemAvailable", mem
        )
    if host:
        shm = shm_free_bytes(cfg.deployment_id, shm_dir)
        what = f"the host pool ({cfg.cache.host_blocks} blocks {per_ranks})"
        if shm is not None and host > shm:
            raise _too_big(
                "cache.host_blocks", cfg.cache.host_blocks, what, host, str(shm_dir), shm
            )
        if mem is not None and host > mem:
            raise _too_big(
                "cache.host_blocks", cfg.cache.host_blocks, what, host, "MemAvailable", mem
            )
    if on_cpu and mem is not None and device + host > mem:
        raise ConfigError(
            f"cache.device_blocks = {cfg.cache.device_blocks}, cache.host_blocks = "
            f"{cfg.cache.host_blocks}: device and host pools on cpu need {device + host} bytes "
            f"({_human(device + host)}) together but MemAvailable is {mem} bytes ({_human(mem)})"
        )
    if not on_cpu:
        _check_cuda_memory(cfg, device // count)  # with engine_kv: only that the GPUs exist


def _check_cuda_memory(cfg: KvtierConfig, per_rank: int) -> None:
    """Each rank's device pool must fit on its GPU (`rank_device`); ranks sharing a GPU
    need their pools there together."""
    import torch

    gpus = torch.cuda.device_count()
    need: dict[int, list[int]] = {}
    for rank in range(cfg.workers.count):
        need.setdefault(cfg.workers.rank_cuda_index(rank), []).append(rank)
    for index, ranks in sorted(need.items()):
        if index >= gpus:
            key = ("workers.cuda_devices = " + repr(cfg.workers.cuda_devices)
                   if cfg.workers.cuda_devices else f"workers.count = {cfg.workers.count}")
            raise ConfigError(
                f"{key}: rank {ranks[0]} would use cuda:{index} but {gpus} CUDA device(s) are "
                "visible (set workers.cuda_devices to place several ranks on one GPU)"
            )
        free, _total = torch.cuda.mem_get_info(index)
        if per_rank * len(ranks) > free:
            what = "the device pool" + (f"s of ranks {ranks}" if len(ranks) > 1
                                        else f" of rank {ranks[0]}")
            raise _too_big("cache.device_blocks", cfg.cache.device_blocks, what,
                           per_rank * len(ranks), f"cuda:{index}", free)


# --------------------------------------------------------------------------------------------
# Storage URL and reachability
# --------------------------------------------------------------------------------------------


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


def _foreign_directory_problem(path: Path) -> str | None:
    """What every worker's file backend would refuse in `path` (issue 27: a 17-line
    traceback per worker): a folder not owned by this user or writable by group or others."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # not there yet: kvtier creates it 0700
    if st.st_uid != os.geteuid():
        return (f"{str(path)!r} is owned by uid {st.st_uid}, not by this user (uid "
                f"{os.geteuid()}): refusing to read pages anybody else may write")
    if st.st_mode & 0o022:
        return (f"{str(path)!r} is writable by group or others (mode {st.st_mode & 0o7777:o}): "
                f"refusing it (chmod go-w {str(path)!r})")
    return None


def _writable_directory_problem(path: Path, need_bytes: int = 1) -> str | None:
    """Why the file backend could not create or write `path`, leaving nothing behind: the
    nearest existing ancestor must be a directory in which a file can be created (a file
    without a name, or one removed at once), on a file system with `need_bytes` free."""
    probe = path.absolute()
    try:
        while not probe.exists():
            if probe.parent == probe:
                break
            probe = probe.parent
    except OSError as e:  # too long a path, a loop of links
        return f"cannot be looked up: {e.strerror or e}"
    if not probe.is_dir():
        return f"{str(probe)!r} exists and is not a directory"
    try:
        stat = os.statvfs(probe)
    except OSError as e:
        return f"cannot read the free space of {str(probe)!r}: {e.strerror or e}"
    if stat.f_flag & os.ST_RDONLY:
        return f"{str(probe)!r} is on a read-only file system"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    free = stat.f_bavail * stat.f_frsize
    sized = stat.f_blocks > 0  # 0: no size to speak of (procfs, sysfs, tmpfs size=0)
    if sized and (free < need_bytes or (stat.f_files and stat.f_favail == 0)):
        what = "no inodes left" if free >= need_bytes else (
            f"{free} bytes free, one page needs {need_bytes}")
        return f"the file system holding {str(probe)!r} is full ({what})"
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".kvtier-probe-"):
            pass
    except OSError as e:
        return f"cannot create files in {str(probe)!r}: {e.strerror or e}"
    return None


def check_storage_secret(cfg: KvtierConfig) -> None:
    """The storage secret can be had (issue 27: a bad `storage.secret_file` was found only
    once the workers started, exit 1 in three lines): `storage.secret` set, or a safe
    `storage.secret_file` (this user's regular file, mode 0600, 16 to 4096 bytes), generated
    now on first use. ConfigError naming the key otherwise."""
    s = cfg.storage
    if s.backend == "none" or s.secret.get_secret_value():
        return
    from kvtier.manager.private_state import (
        StorageSecretError,
        default_secret_file,
        storage_secret,
    )

    path = os.path.expanduser(s.secret_file) if s.secret_file else str(default_secret_file())
    try:
        storage_secret("", s.secret_file)
    except StorageSecretError as e:
        key = (f"storage.secret_file = {_short_repr(s.secret_file)}" if s.secret_file
               else f"storage.secret_file (default {_short_repr(path)})")
        problem = str(e).removeprefix(f"storage secret file {path} ")  # the key names it
        raise ConfigError(f"{key}: {problem}") from None


def check_storage_reachable(cfg: KvtierConfig, timeout: float = 2.0) -> None:
    """Fail early, in one line naming the key, when the storage tier cannot be used.

    redis: connect and PING within `timeout` seconds overall (name resolution included, which
    socket timeouts alone do not bound). file: the directory exists or can be created and is
    writable (a nameless file can be created in it) on a file system with room for a page.
    Nothing is left behind or open.
    """
    backend = cfg.storage.backend
    if backend == "none":
        return
    check_storage_secret(cfg)
    if backend == "file":
        path = cfg.storage_dir()
        problem = (_writable_directory_problem(Path(path), page_bytes(cfg))
                   or _foreign_directory_problem(Path(path)))
        if problem:
            key = (f"storage.path = {_short_repr(cfg.storage.path)}" if cfg.storage.path
                   else f"storage.path (default {_short_repr(path)})")
            raise ConfigError(f"{key}: {problem}")
        return
    shown = redact_url(cfg.storage.url)
    outcome: list[BaseException | None] = []

    def ping() -> None:
        from kvtier.worker.storage.redis_backend import open_client

        try:  # a cluster client connects (and learns the slot map) when it is opened
            client = open_client(cfg.storage.url, timeout_s=timeout, connect_timeout_s=timeout)
        except BaseException as exc:
            outcome.append(exc)
            return
        try:
            client.ping()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
        finally:
            client.close()

    thread = threading.Thread(target=ping, name="kvtier-storage-check", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise ConfigError(f"storage.url = {shown!r}: no answer from Redis within {timeout:g} s")
    error = outcome[0]
    if error is not None:
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ConfigError(f"storage.url = {shown!r}: cannot reach Redis: {reason}")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    *,
    check_resources: bool = True,
) -> KvtierConfig:
    """Read the TOML file (if any), apply `KVTIER_*` variables from `env` (default: the process
    environment) over it, validate everything and check the pools fit this machine.

    `check_resources=False` skips the machine checks (memory, /dev/shm, CUDA): for validating a
    file meant for another machine or container. Raises ConfigError: one line, every problem
    found joined by '; '.
    """
    environ = os.environ if env is None else env
    file_values = TomlFileSource(KvtierConfig, path)()
    env_source = EnvironmentSource(KvtierConfig, environ)
    env_values = env_source()
    cfg = _validate(_merge(file_values, env_values), env_source.origins)
    if check_resources:
        check_memory(cfg)
    return cfg


# --------------------------------------------------------------------------------------------
# Summary and TOML rendering
# --------------------------------------------------------------------------------------------


def summary(cfg: KvtierConfig) -> dict[str, Any]:
    """What /status and the start log line show: every key (the admin token and the storage
    secret only as `token_set` / `secret_set`, the Redis password redacted), the effective
    prefetch limit, and the pool sizes."""
    data = cfg.model_dump(mode="python")
    admin = data["admin"]
    admin["token_set"] = bool(cfg.admin.token.get_secret_value())
    del admin["token"]
    data["storage"]["secret_set"] = bool(cfg.storage.secret.get_secret_value())
    del data["storage"]["secret"]
    data["storage"]["url"] = redact_url(cfg.storage.url)
    data["storage"]["prefetch_host_blocks_limit"] = cfg.effective_prefetch_host_blocks_limit()
    data["sizes"] = {
        "page_bytes": page_bytes(cfg),
        "device_pool_bytes": device_pool_bytes(cfg),
        "host_pool_bytes": host_pool_bytes(cfg),
    }
    return data


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"cannot write {value!r} to TOML")
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes.
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, dict):  # an inline table (node.quotas)
        return "{" + ", ".join(f"{json.dumps(str(k), ensure_ascii=False)} = {_toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def _comment(text: str | None, indent: str = "# ") -> list[str]:
    """A description as TOML comment lines wrapped to the project's line length."""
    return textwrap.wrap(text or "", width=99, initial_indent=indent, subsequent_indent=indent)


def to_toml(cfg: KvtierConfig) -> str:
    """`cfg` as a commented TOML file that `load_config` reads back to an equal configuration,
    except the admin token and the storage secret, which are never written (set
    KVTIER_ADMIN_TOKEN and KVTIER_STORAGE__SECRET instead)."""
    lines = _comment(
        "kvtier configuration. Every key can also be set with an environment variable "
        f"{ENV_PREFIX}<SECTION>{ENV_NESTED_DELIMITER}<KEY> (for example "
        f"{ENV_PREFIX}CACHE{ENV_NESTED_DELIMITER}DEVICE_BLOCKS=4096; top-level keys: "
        f"{ENV_PREFIX}DEPLOYMENT_ID), which wins over this file."
    )
    for name, info in KvtierConfig.model_fields.items():
        if name not in SECTIONS:
            lines += ["", *_comment(info.description)]
            lines.append(f"{name} = {_toml_value(getattr(cfg, name))}")
    for section, model in SECTIONS.items():
        values = getattr(cfg, section)
        lines += ["", f"[{section}]", *_comment(KvtierConfig.model_fields[section].description)]
        for key, info in model.model_fields.items():
            value = getattr(values, key)
            lines += _comment(info.description)
            if isinstance(value, SecretStr):
                lines.append(f'{key} = ""' + ("  # set, not written" if value else ""))
            elif value is None and (section, key) == ("storage", "prefetch_host_blocks_limit"):
                effective = cfg.effective_prefetch_host_blocks_limit()
                lines.append(f"# {key} = {effective}  (unset: follows cache.host_blocks)")
            else:
                lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def defaults_toml() -> str:
    """The embedded defaults as a documented TOML file (the configuration reference)."""
    return to_toml(KvtierConfig())
