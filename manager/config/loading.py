"""Reading a configuration: the TOML file and the environment as sources, their merge, strict
validation with every error turned into one line naming the key, the value and where it came
from (`load_config`), and the validated copies a running deployment makes (`with_sections`,
`with_pool_sizes`)."""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvtier.manager.config.base import (
    ENV_NESTED_DELIMITER,
    ENV_PREFIX,
    TOKEN_ENV_ALIAS,
    ConfigError,
)
from kvtier.manager.config.checks import check_memory
from kvtier.manager.config.model import KvtierConfig, _field, _unknown_key
from kvtier.manager.config.values import _short_repr, redact_url
from kvtier.worker.delays import DELAY_ENVS
from pydantic import SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

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
            _set_path(values, path, value)
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


@dataclass(frozen=True, slots=True)
class Override:
    """One value a caller sets over the file and the environment, typed (no `KVTIER_*`
    string in between): an engine's KV geometry, an adapter's setting. `path` is the key
    (("cache", "host_blocks"), or ("deployment_id",)); `value` is validated as the file's
    would be (a str for a key that is not one is read as a variable's would be: "8192" for
    an integer); `origin` is named in an error ("the engine's setting 'host_blocks'")."""

    path: tuple[str, ...]
    value: object
    origin: str


def _override_values(overrides: Sequence[Override]
                     ) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """The overrides as nested values, with each key's origin. ConfigError naming every
    unknown key and unreadable value (with its origin)."""
    values: dict[str, Any] = {}
    origins: dict[tuple[str, ...], str] = {}
    errors: list[str] = []
    for o in overrides:
        path, dotted = o.path, ".".join(o.path)
        info = _field(path)
        if info is None:
            errors.append(_unknown_key(dotted, o.origin))
            continue
        value = o.value
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            try:
                value = _convert_env(value, _scalar_type(info.annotation))
            except ValueError as exc:
                errors.append(f"{dotted} = {_shown(path, value)}: {exc} (from {o.origin})")
                continue
        origins[path] = o.origin
        _set_path(values, path, value)
    if errors:
        raise ConfigError("; ".join(errors))
    return values, origins


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
# Loading
# --------------------------------------------------------------------------------------------


# The sections a scheduler-API stack of `kvtier serve` needs (its model, pools, workers)
SCHEDULER_SECTIONS = frozenset({"model", "cache", "workers"})


def given_sections(path: str | os.PathLike[str] | None,
                   env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The top-level names the TOML file and the environment set (sections such as "node",
    or "deployment_id"): what the operator wrote, before defaults. ConfigError as
    `load_config`."""
    environ = os.environ if env is None else env
    file_values = TomlFileSource(KvtierConfig, path)()
    return frozenset(file_values) | frozenset(EnvironmentSource(KvtierConfig, environ)())


def node_only(path: str | os.PathLike[str] | None,
              env: Mapping[str, str] | None = None) -> bool:
    """Whether `kvtier serve` runs the node service alone: a `[node]` section given and none
    of the scheduler API's (`SCHEDULER_SECTIONS`), so no stack of its own (no pools, no
    workers: only the attached engines' namespaces)."""
    given = given_sections(path, env)
    return "node" in given and not given & SCHEDULER_SECTIONS


def load_config(
    path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    *,
    overrides: Sequence[Override] = (),
    check_resources: bool = True,
) -> KvtierConfig:
    """Read the TOML file (if any), apply `KVTIER_*` variables from `env` (default: the process
    environment) over it and `overrides` over both, validate everything and check the pools
    fit this machine.

    `check_resources=False` skips the machine checks (memory, /dev/shm, CUDA): for validating a
    file meant for another machine or container. Raises ConfigError: one line, every problem
    found joined by '; '.
    """
    environ = os.environ if env is None else env
    file_values = TomlFileSource(KvtierConfig, path)()
    env_source = EnvironmentSource(KvtierConfig, environ)
    env_values = env_source()
    set_values, set_origins = _override_values(overrides)
    cfg = _validate(_merge(_merge(file_values, env_values), set_values),
                    {**env_source.origins, **set_origins})
    if check_resources:
        check_memory(cfg)
    return cfg


def _set_path(values: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    """`values[path[0]][path[1]]... = value`, making the nested sections on the way."""
    target = values
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value
