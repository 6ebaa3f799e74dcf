"""The whole configuration (`KvtierConfig`: a top-level `deployment_id` and one section model
per TOML section, with the rules that tie sections together), its sections by name
(`SECTIONS`) and how a dotted key is looked up or reported as unknown."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from kvtier.manager.config.base import (
    DEPLOYMENT_ID_PATTERN,
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
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
from kvtier.manager.private_state import default_storage_path
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


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
    audit: AuditConfig = Field(
        default_factory=AuditConfig,
        description="The sampled recompute audit of an engine's kvtier hits (vLLM, embedded).",
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
