"""A configuration as others see it: `summary` (/status and the start log line: secrets
never shown, the Redis password redacted) and `to_toml` (a commented TOML file `load_config`
reads back; `defaults_toml()` is the configuration reference)."""

from __future__ import annotations

import json
import math
import textwrap
from typing import Any

from kvtier.manager.config.base import ENV_NESTED_DELIMITER, ENV_PREFIX
from kvtier.manager.config.checks import device_pool_bytes, host_pool_bytes, page_bytes
from kvtier.manager.config.model import SECTIONS, KvtierConfig
from kvtier.manager.config.values import redact_url
from pydantic import SecretStr


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
