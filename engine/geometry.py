"""kvtier's configuration for an engine, from the engine's KV geometry.

An engine allocates its KV cache itself; the shape of kvtier's host pages must match it
byte for byte, so the geometry is the engine's to say and never the operator's: `KVGeometry`
is what an adapter reads from its engine (layers per page, KV heads, head size, dtype, tokens
per block, ranks), `engine_config` turns it into a `KvtierConfig` over the operator's TOML
file and `KVTIER_*` variables, with the adapter's settings (`SETTINGS`, what an engine's
connector configuration may set) on top: typed `Override`s of `load_config`, no `KVTIER_*`
strings in between (the variables are the operator's alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.manager.config import KvtierConfig, Override, load_config
from kvtier.worker.kv_pools import KVShape, parse_dtype

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
"""Bytes per element of the KV dtypes kvtier stores (kvtier's dtype names)."""

SETTINGS: dict[str, tuple[str, ...]] = {
    "host_blocks": ("cache", "host_blocks"),
    "host_eviction_policy": ("cache", "host_eviction_policy"),
    "storage_backend": ("storage", "backend"),
    "storage_path": ("storage", "path"),
    "storage_url": ("storage", "url"),
    "prefetch_threshold": ("storage", "prefetch_threshold"),
    "admin_host": ("admin", "host"),
    "admin_port": ("admin", "port"),
    "admin_auth": ("admin", "auth"),
}
"""Adapter setting -> the kvtier key it sets (an engine's connector config may name these)."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """One host page's geometry as the engine lays out its KV: `layers` per page (the widest
    KV cache group's), `kv_heads` x `head_dim` of `dtype` (kvtier's name, `ITEMSIZE`) per
    token, `block_size` tokens per block, `ranks` engine ranks (one host pool each)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    ranks: int


def engine_config(geometry: KVGeometry, deployment_id: str,
                  settings: Mapping[str, object],
                  config_path: str | None = None, *, attached: bool = False) -> KvtierConfig:
    """kvtier's configuration for an engine of this geometry: the TOML file (if given) and
    `KVTIER_*` variables of this process as for `kvtier serve`, `settings` (keys of
    `SETTINGS`) over them, and
    the geometry, rank count and deployment id over everything. Raises ConfigError naming the
    setting at fault. `attached` (the engine uses a node's `kvtier serve`): the host tier is
    the service's, sized by its namespace quota, so this engine's pools (`cache.host_blocks`
    and its default) are not checked against this machine's memory: it creates none."""
    g = geometry
    engine: dict[tuple[str, ...], object] = {
        ("deployment_id",): deployment_id,
        ("model", "num_layers"): g.layers,
        ("model", "num_kv_heads"): g.kv_heads,
        ("model", "head_dim"): g.head_dim,
        ("model", "dtype"): g.dtype,
        # the engine's KV cache has no per-block scales and no layers beyond the ones it
        # registers
        ("model", "kv_scales"): "none",
        ("model", "num_extra_layers"): 0,
        ("cache", "block_size"): g.block_size,
        # the engine owns the device tier; a kvtier worker keeps a one-block device pool it
        # never uses (its host pool and storage I/O are what it is there for)
        ("cache", "device_blocks"): 1,
        ("cache", "decode_reserve_blocks"): 0,
        ("workers", "count"): g.ranks,
        ("workers", "device"): "cpu",
    }
    overrides = [Override(path, settings[key], f"the engine's setting {key!r}")
                 for key, path in SETTINGS.items() if key in settings]
    overrides += [Override(path, value, "the engine's KV geometry")
                  for path, value in engine.items()]
    return load_config(config_path, overrides=overrides, check_resources=not attached)


def kv_shape(cfg: KvtierConfig) -> KVShape:
    """The host page shape of a configuration (what the engine-side copier maps)."""
    m = cfg.model
    return KVShape(m.num_layers, m.num_kv_heads, m.head_dim, cfg.cache.block_size,
                   parse_dtype(m.dtype))
