"""kvtier's configuration for an engine, from the engine's KV geometry.

An engine allocates its KV cache itself; the shape of kvtier's host pages must match it
byte for byte, so the geometry is the engine's to say and never the operator's: `KVGeometry`
is what an adapter reads from its engine (layers per page, KV heads, head size, dtype, tokens
per block, ranks), `engine_config` turns it into a `KvtierConfig` over the operator's TOML
file and `KVTIER_*` variables, with the adapter's settings (`SETTINGS`, what an engine's
connector configuration may set) on top.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.manager.config import KvtierConfig, load_config
from kvtier.worker.kv_pools import KVShape, parse_dtype

ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8_e4m3fn": 1}
"""Bytes per element of the KV dtypes kvtier stores (kvtier's dtype names)."""

SETTINGS: dict[str, str] = {
    "host_blocks": "KVTIER_CACHE__HOST_BLOCKS",
    "storage_backend": "KVTIER_STORAGE__BACKEND",
    "storage_path": "KVTIER_STORAGE__PATH",
    "storage_url": "KVTIER_STORAGE__URL",
    "prefetch_threshold": "KVTIER_STORAGE__PREFETCH_THRESHOLD",
    "admin_host": "KVTIER_ADMIN__HOST",
    "admin_port": "KVTIER_ADMIN__PORT",
    "admin_auth": "KVTIER_ADMIN__AUTH",
}
"""Adapter setting -> the kvtier variable it sets (an engine's connector config may name these)."""


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
    `KVTIER_*` variables as for `kvtier serve`, `settings` (keys of `SETTINGS`) over them, and
    the geometry, rank count and deployment id over everything. Raises ConfigError naming the
    setting at fault. `attached` (the engine uses a node's `kvtier serve`): the host tier is
    the service's, sized by its namespace quota, so this engine's pools (`cache.host_blocks`
    and its default) are not checked against this machine's memory: it creates none."""
    g = geometry
    env = {k: v for k, v in os.environ.items() if k.startswith("KVTIER_")}
    env.update({
        "KVTIER_DEPLOYMENT_ID": deployment_id,
        "KVTIER_MODEL__NUM_LAYERS": str(g.layers),
        "KVTIER_MODEL__NUM_KV_HEADS": str(g.kv_heads),
        "KVTIER_MODEL__HEAD_DIM": str(g.head_dim),
        "KVTIER_MODEL__DTYPE": g.dtype,
        # the engine's KV cache has no per-block scales and no layers beyond the ones it
        # registers
        "KVTIER_MODEL__KV_SCALES": "none",
        "KVTIER_MODEL__NUM_EXTRA_LAYERS": "0",
        "KVTIER_CACHE__BLOCK_SIZE": str(g.block_size),
        # the engine owns the device tier; a kvtier worker keeps a one-block device pool it
        # never uses (its host pool and storage I/O are what it is there for)
        "KVTIER_CACHE__DEVICE_BLOCKS": "1",
        "KVTIER_CACHE__DECODE_RESERVE_BLOCKS": "0",
        "KVTIER_WORKERS__COUNT": str(g.ranks),
        "KVTIER_WORKERS__DEVICE": "cpu",
    })
    for key, var in SETTINGS.items():
        if key in settings:
            env[var] = str(settings[key])
    return load_config(config_path, env, check_resources=not attached)


def kv_shape(cfg: KvtierConfig) -> KVShape:
    """The host page shape of a configuration (what the engine-side copier maps)."""
    m = cfg.model
    return KVShape(m.num_layers, m.num_kv_heads, m.head_dim, cfg.cache.block_size,
                   parse_dtype(m.dtype))
