"""The schema: one strict, frozen pydantic model per TOML section. Every key is declared once
here, with its default, its bounds and a description (`defaults_toml()` renders the
documented reference from these declarations). The whole configuration, `KvtierConfig`, is in
`model`."""

from __future__ import annotations

from typing import Literal

from kvtier.manager.config.base import MAX_BLOCKS, MAX_TIMEOUT_S, MAX_TTL_S
from kvtier.manager.config.values import (
    local_endpoint_problem,
    parse_sample,
    path_problem,
    redis_url_problem,
)
from kvtier.manager.private_state import MIN_SECRET_BYTES
from kvtier.worker import numa
from kvtier.worker.ipc import MAX_RANKS
from kvtier.worker.storage.page_crypto import parse_key_ids
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
)

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
    eviction_policy: Literal["lru", "lfuda", "hitboost", "arc", "s3fifo", "duel"] = Field(
        "lru",
        description="which evictable device block leaves first: lru (least recently used, the "
        "compiled list), lfuda (LFU with dynamic aging), hitboost (LRU in which a block "
        "that was ever hit counts as one cache size more recent), arc (adaptive replacement: "
        "never-hit and hit blocks in two queues, their split learned from ghost hits) or "
        "s3fifo (a small FIFO of new blocks in front of a main queue of hit ones) or duel "
        "(hitboost that admits only a share of new prompts, the share chosen by miniature "
        "caches: for traffic whose reuse comes later than LRU keeps a block); leaves "
        "always first, pinned blocks never",
    )
    host_eviction_policy: Literal["lru", "lfuda", "hitboost", "arc", "s3fifo", "duel"] = Field(
        "lru",
        description="which evictable host copy leaves first, the same choices as "
        "eviction_policy (lru: the host list's order, as before); with "
        "storage.write_policy = write_back the batch written before an eviction is "
        "this policy's next victims",
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

    encrypt: bool = Field(
        True,
        description="encrypt every stored page with AES-256-GCM under a key derived from the "
        "storage secret (page format 4); false: pages in clear, authenticated by a keyed "
        "BLAKE3 MAC (format 3). A reader reads one format: pages of the other are misses",
    )
    key_id: int = Field(
        1, ge=1, le=0xFFFFFFFF,
        description="the key id new pages are encrypted under (rotation: raise it and list "
        "the previous id in old_key_ids until its pages are gone)",
    )
    old_key_ids: str = Field(
        "",
        description="comma-separated key ids whose pages are still read (e.g. \"1\"); a page "
        "under any other id is refused, counted as kvtier_storage_backend_unknown_key_pages",
    )
    compression: Literal["none", "zstd"] = Field(
        "none",
        description="compress every page with zstd (level 1) before encrypting it, kept only "
        "when smaller; needs encrypt = true. Pays only on a store slower than about 150 MB/s "
        "per worker core (bench/storage_codecs.py); readers open both kinds whatever this says",
    )
    slow_write_ms: float = Field(
        1000.0, ge=0, le=600_000, allow_inf_nan=False,
        description="back-pressure: while the moving average of a storage backup's latency "
        "(sent to answered, queueing included) is above this, backups are skipped "
        "(kvtier_storage_backup_slow_skipped_pages_total), one probe batch a second; 0: off",
    )

    slow_read_ms: float = Field(
        2000.0, ge=0, le=600_000, allow_inf_nan=False,
        description="back-pressure: while the moving average of a storage query's latency "
        "(sent to answered) is above this, lookups do not ask storage (a miss at once, "
        "kvtier_storage_query_slow_skips_total), one probe query a second; 0: off",
    )

    @field_validator("compression")
    @classmethod
    def _compression_needs_encryption(cls, value: str, info: ValidationInfo) -> str:
        """Compressed pages are format 4: a clear deployment cannot write them."""
        if value != "none" and info.data.get("encrypt") is False:
            raise ValueError("needs storage.encrypt = true (compressed pages are encrypted "
                             "pages, format 4)")
        return value

    @field_validator("old_key_ids")
    @classmethod
    def _key_ids_parse(cls, text: str) -> str:
        """Ids a reader accepts: refuse a typo at start rather than refusing every page."""
        parse_key_ids(text)
        return text

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
    hello_deadline_s: float = Field(
        5.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="a connection's whole HELLO must arrive within this of its accept, "
        "else it is dropped (a deadline: bytes trickled in do not extend it)",
    )
    frame_deadline_s: float = Field(
        5.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False,
        description="a frame must arrive whole within this of its first byte, else the "
        "engine is dropped",
    )
    max_connecting: int = Field(
        256, ge=1, le=65536,
        description="connections that have not said HELLO yet, held apart from max_engines; "
        "one more drops the oldest of them",
    )
    handover: bool = Field(
        False,
        description="a stop (SIGTERM / SIGINT) keeps every namespace's host pools and "
        "writes their index (handover.msgpack, 0600, in the socket's private folder) for "
        "the next serve of this deployment, which adopts them: a planned restart keeps the "
        "host tier. False: the pools are removed at stop",
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


class AuditConfig(BaseModel):
    """The sampled recompute audit of an engine's kvtier hits (the vLLM integration,
    embedded): an audited hit is recomputed by the engine instead of loaded, and the
    recomputed block compared with the copy kvtier holds (`kvtier.engine.audit`)."""

    model_config = _SECTION

    sample: str | float = Field(
        "0",
        description="share of requests hitting kvtier that are audited: a probability in "
        "[0, 1] or 'k/N' (\"1/1000\"); 0: off (nothing changes)",
    )
    max_blocks_per_s: float = Field(
        100.0, ge=0, le=1e9, allow_inf_nan=False,
        description="audited blocks per second at most, on average (each one is recomputed "
        "instead of loaded); 0: no cap",
    )

    @field_validator("sample")
    @classmethod
    def _a_probability(cls, value: str | float) -> str | float:
        parse_sample(value)
        return value

    @property
    def rate(self) -> float:
        """`sample` as a probability."""
        return parse_sample(self.sample)
