"""vLLM's configuration read for kvtier: KV dtype and geometry, kv cache groups, the kvtier
config of an engine, the storage namespace (what makes one vLLM block hash mean the same bytes
in two instances) and the hash seed and block size an attached engine says in its HELLO."""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from kvtier.engine.embedded import KvtierConfig
from kvtier.engine.geometry import ITEMSIZE, KVGeometry, engine_config
from kvtier.integrations.vllm import defaults
from kvtier.integrations.vllm.errors import VllmAdapterError
from kvtier.integrations.vllm.kv_groups import KVGroup, describe_groups
from vllm.v1.kv_offload.config import OffloadingConfig

log = logging.getLogger("kvtier.vllm")


# vLLM's names for KV dtypes -> kvtier's
_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
           "float32": "float32", "float": "float32", "fp8": "float8_e4m3fn",
           "fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn"}

# vLLM's KVCacheConfig while KvtierConnector builds the spec (the spec itself is handed only
# the OffloadingConfig, which lacks each group's attention kind and window)
KV_CACHE_CONFIG: contextvars.ContextVar[Any] = contextvars.ContextVar("kvtier_kv_cache_config")


# ---------------------------------------------------------------------------- configuration


def _kv_dtype(name: str) -> str:
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise VllmAdapterError(
            f"KV cache dtype {name!r}: kvtier stores float16, bfloat16, float32 or fp8 "
            f"(float8_e4m3fn) KV")
    return _DTYPES[key]


def _kv_heads_and_dim(per_layer_bytes: int, block: int, itemsize: int) -> tuple[int, int]:
    """kvtier's shape for one layer of one block. vLLM hands the spec bytes, not heads: the
    real head count and size are taken from vLLM's model config when it is reachable, and the
    bytes must agree (a layout with padding is refused rather than copied short)."""
    try:
        from vllm.config import get_current_vllm_config

        vc = get_current_vllm_config()
        heads = int(vc.model_config.get_num_kv_heads(vc.parallel_config))
        dim = int(vc.model_config.get_head_size())
        if 2 * block * heads * dim * itemsize == per_layer_bytes:
            return heads, dim
    except Exception:  # no current config (a unit test), or a model config without heads
        pass
    per_elem = 2 * block * itemsize
    if per_layer_bytes % per_elem:
        raise VllmAdapterError(
            f"vLLM's KV page of {per_layer_bytes} bytes per layer and block is not K and V of "
            f"{block} tokens of {itemsize}-byte elements: a padded layout kvtier cannot copy")
    return 1, per_layer_bytes // per_elem


def _deployment_id(offloading: OffloadingConfig, extra: Mapping[str, Any]) -> str:
    given = extra.get("deployment_id") or os.environ.get("KVTIER_DEPLOYMENT_ID")
    if given:
        return str(given)
    digest = hashlib.sha256(str(offloading.engine_id).encode()).hexdigest()[:12]
    return f"vllm-{digest}"


def kv_groups(offloading: OffloadingConfig,
              kv_cache_config: Any = None) -> list[KVGroup] | None:
    """kvtier's view of the KV cache groups vLLM offloads (kind, geometry, key space), or None
    for a one-group model whose KV cache config is unknown (vLLM's plain OffloadingConnector
    loaded the spec; such a group is served as full attention, as before groups were read).
    Raises VllmAdapterError naming a group kvtier cannot serve."""
    if kv_cache_config is None:
        kv_cache_config = KV_CACHE_CONFIG.get(None)
    if kv_cache_config is None:
        if len(offloading.groups) != 1:
            raise VllmAdapterError(
                f"this model has {len(offloading.groups)} KV cache groups: kvtier reads each "
                "group's attention kind from vLLM's KV cache config, which only "
                "kv_connector='KvtierConnector' hands it (not the plain OffloadingConnector)")
        return None
    return describe_groups(offloading, kv_cache_config,
                           ITEMSIZE[_kv_dtype(offloading.model.dtype)])


def kvtier_config(offloading: OffloadingConfig, extra: Mapping[str, Any],
                  groups: list[KVGroup] | None = None) -> KvtierConfig:
    """kvtier's configuration for this vLLM engine: the TOML file `kvtier_config` (if given)
    and `KVTIER_*` variables as for `kvtier serve`, with the KV shape, block size, rank count
    and deployment id taken from vLLM (they must match vLLM's, so they are not the operator's
    to set). `groups` (from `kv_groups`): one host page holds one group's layers of one block,
    so a page has as many layers as the largest group. Raises VllmAdapterError / ConfigError
    naming the setting at fault.

    Values nobody set here get the defaults of a vLLM deployment later, on the scheduler side
    (`defaults.apply_defaults`: host tier from free memory, shared file storage, any free
    admin port)."""
    defaults.check_extra_config(extra)
    if groups is None and len(offloading.groups) != 1:
        groups = kv_groups(offloading)
    if offloading.cache.blocks_per_chunk != 1:
        raise VllmAdapterError(
            "kv_connector_extra_config: kvtier offloads vLLM blocks one by one (leave "
            "'block_size' and 'blocks_per_chunk' unset)")
    dtype = _kv_dtype(offloading.model.dtype)
    if groups:
        widest = max(groups, key=lambda g: len(g.layer_names))
        layers, heads, dim = len(widest.layer_names), widest.num_kv_heads, widest.head_dim
        block = widest.tokens_per_block
    else:
        group = offloading.groups[0]
        layers = len(group.layer_names)
        per_block = offloading.worker_kv_bytes_per_block
        if layers == 0 or per_block % layers:
            raise VllmAdapterError(
                f"vLLM reports {per_block} KV bytes per block over {layers} layers: not an "
                "equal page per layer")
        block = group.tokens_per_block
        heads, dim = _kv_heads_and_dim(per_block // layers, block, ITEMSIZE[dtype])
    geometry = KVGeometry(layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype,
                          block_size=block, ranks=offloading.parallel.world_size)
    path = extra.get("kvtier_config")
    # attached (kvtier_serve): the host tier is the service's; nothing of the embedded one
    # is checked against this machine (issue 34, 8)
    return engine_config(geometry, _deployment_id(offloading, extra), extra,
                         str(path) if path else None, attached=bool(extra.get("kvtier_serve")))


def storage_namespace(offloading: OffloadingConfig,
                      groups: list[KVGroup] | None = None) -> tuple[str, dict[str, Any]]:
    """What makes one vLLM block hash mean the same KV bytes in two instances, and its digest
    (kvtier's `model.name`, hence part of every storage page's namespace). A model of several
    KV cache groups adds each group's kind, window and layers; each group's keys are its own
    besides (`KVGroup.key`)."""
    identity: dict[str, Any] = {
        "model": offloading.model.name, "dtype": offloading.model.dtype,
        "layout": offloading.kv_cache_layout, "tokens_per_block":
        offloading.groups[0].tokens_per_block if offloading.groups else 0,
        "layers": list(offloading.groups[0].layer_names) if offloading.groups else [],
        "tp": offloading.parallel.tp_size, "pp": offloading.parallel.pp_size,
        "pcp": offloading.parallel.pcp_size, "dcp": offloading.parallel.dcp_size,
        "bytes_per_block": offloading.worker_kv_bytes_per_block,
    }
    if groups is not None and len(groups) > 1:  # one group: the namespace as it always was
        identity["groups"] = [g.identity() for g in groups]
        identity["layers"] = [n for g in groups for n in g.layer_names]
    try:
        from vllm.config import get_current_vllm_config
        from vllm.v1.core import kv_cache_utils

        vc = get_current_vllm_config()
        identity["hash"] = str(vc.cache_config.prefix_caching_hash_algo)
        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
        identity["none_hash"] = bytes(none_hash).hex() if none_hash is not None else None
        identity["seed"] = kv_cache_utils.get_none_hash_seed()
        identity["seed_from_env"] = "PYTHONHASHSEED" in os.environ
    except Exception as e:  # a vLLM without these: no sharing rather than wrong sharing
        identity["hash"] = f"unknown ({type(e).__name__})"
        identity["instance"] = os.urandom(8).hex()
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:40]
    return f"vllm:{digest}", identity


def hash_block_size() -> int:
    """vLLM's tokens per block hash (`cache_config.hash_block_size`, resolved with the KV
    cache groups: a hybrid model's may be finer than kvtier's block), for HELLO: the service
    refuses token-id steering where it differs from kvtier's block size. 0 when vLLM has not
    said (the service then takes kvtier's)."""
    try:
        from vllm.config import get_current_vllm_config

        found = getattr(get_current_vllm_config().cache_config, "hash_block_size", None)
    except Exception:  # a vLLM without it
        return 0
    return int(found) if isinstance(found, int) and found > 0 else 0


def hash_seed(identity: Mapping[str, Any]) -> str:
    """The seed of the block hashes this engine will compute, for its HELLO (the service
    names blocks from token ids with it: lookup, retain, warm, clear). vLLM's NONE_HASH when
    it is set already; before vLLM set it, its seed is PYTHONHASHSEED for the cryptographic
    algorithms (what vLLM's `resolve_none_hash_seed` takes; `get_none_hash_seed` still
    answers the default then, which named the wrong blocks: /lookup found 0 of 192 tokens
    the engine then loaded)."""
    if identity.get("none_hash"):
        return str(identity["none_hash"])
    env_seed = os.environ.get("PYTHONHASHSEED")
    if env_seed is not None and str(identity.get("hash")) in ("sha256", "sha256_cbor"):
        return env_seed
    return str(identity.get("seed"))



def block_naming(identity: Mapping[str, Any], hash_block: int) -> tuple[str, str, int]:
    """How this engine names blocks now (hash algorithm, seed, tokens per block hash
    `hash_block`, read at start: `hash_block_size()` needs vLLM's config context), for the
    embedded admin's steering routes, asked at each request: vLLM's NONE_HASH is read again
    (it is set once the engine core starts, after the connector may have been made), so the
    seed is the one the engine's blocks were hashed with."""
    try:
        from vllm.v1.core import kv_cache_utils

        none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    except Exception:  # a vLLM without it: the seed read at start
        none_hash = None
    now = dict(identity)
    if none_hash is not None:
        now["none_hash"] = bytes(none_hash).hex()
    return str(identity.get("hash")), hash_seed(now), hash_block
