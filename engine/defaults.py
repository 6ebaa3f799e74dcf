"""Defaults that fit an engine's model and machine, for values nobody set.

* Host tier (`cache.host_blocks`): `HOST_MEMORY_FRACTION` of MemAvailable and
  `HOST_SHM_FRACTION` of the free /dev/shm, whichever is smaller, in whole blocks of this
  model's page over all ranks; noted with the figures it came from. A fixed 8,192 blocks was
  6 GiB for a 200M-parameter model and about 16 GiB for a Llama-3-8B-shaped KV.
* File storage (`storage.path`): `<XDG_CACHE_HOME>/kvtier/vllm/storage`, one folder for every
  engine instance of the user; pages lie under their storage namespace (model, dtype, layout,
  parallelism, hash seed), so a restart and a second instance of the same model find them,
  and nothing piles up per start.
* Admin port (`admin.port`): 0, any free port, logged with the start line; two instances
  side by side never collide.

A value set anywhere (the TOML file, a `KVTIER_*` variable, the adapter's settings) is kept.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtier.engine.errors import EngineSetupError
from kvtier.manager.config import (
    MAX_BLOCKS,
    KvtierConfig,
    mem_available_bytes,
    page_bytes,
    shm_free_bytes,
)
from kvtier.manager.private_state import cache_base

# A tenth of the memory free at start: the engine's own KV, weights and the other instances of
# the machine come first (two instances side by side take 10% and then 9% of it), and the
# operator raises it with host_blocks. Half the free /dev/shm: a container's shm_size is often
# small (64 MiB by default), and kvtier's arena and control block live there too.
HOST_MEMORY_FRACTION = 0.1
HOST_SHM_FRACTION = 0.5


def _explicit(cfg_fields: set[str], field: str, setting: str,
              settings: Mapping[str, object]) -> bool:
    """Set by someone: the file, a variable or an adapter's setting (each puts the key in
    the section's fields set, `geometry.engine_config`), or `setting` given here."""
    return field in cfg_fields or setting in settings


def default_host_blocks(cfg: KvtierConfig) -> tuple[int, str]:
    """Host blocks per rank from this machine's free memory and /dev/shm, and how they were
    found (for the log). Raises EngineSetupError when not one block fits."""
    per_block = page_bytes(cfg) * cfg.workers.count
    budgets: list[tuple[int, str]] = []
    mem = mem_available_bytes()
    if mem is not None:
        budgets.append((int(mem * HOST_MEMORY_FRACTION),
                        f"{HOST_MEMORY_FRACTION:.0%} of MemAvailable {mem / 2**30:.1f} GiB"))
    shm = shm_free_bytes(cfg.deployment_id)
    if shm is not None:
        budgets.append((int(shm * HOST_SHM_FRACTION),
                        f"{HOST_SHM_FRACTION:.0%} of free /dev/shm {shm / 2**30:.1f} GiB"))
    if not budgets:
        return cfg.cache.host_blocks, "no memory figures on this machine: the default"
    budget, why = min(budgets)
    blocks = min(MAX_BLOCKS, budget // per_block)
    if blocks < 1:
        raise EngineSetupError(
            f"kvtier's host tier: {why} is {budget} bytes, less than one block of "
            f"{per_block} bytes over {cfg.workers.count} rank(s); free memory or /dev/shm, "
            "or set host_blocks in kv_connector_extra_config")
    return blocks, f"{why} / {per_block} bytes a block"


def apply_defaults(cfg: KvtierConfig,
                   settings: Mapping[str, object]) -> tuple[KvtierConfig, list[str]]:
    """`cfg` with the defaults (module docstring) put where nobody set a value (`settings`:
    the adapter's, as for `geometry.engine_config`), and one note per default applied (for
    the start line)."""
    notes: list[str] = []
    cache = cfg.cache
    if not _explicit(cache.model_fields_set, "host_blocks", "host_blocks", settings):
        blocks, why = default_host_blocks(cfg)
        cache = cache.model_copy(update={"host_blocks": blocks})
        notes.append(f"host tier {blocks} blocks per rank ({why})")
    storage = cfg.storage
    if storage.backend == "file" and not storage.path:
        path = str(cache_base() / "vllm" / "storage")
        storage = storage.model_copy(update={"path": path})
        notes.append(f"file storage {path}")
    admin = cfg.admin
    if not _explicit(admin.model_fields_set, "port", "admin_port", settings):
        admin = admin.model_copy(update={"port": 0})
    return cfg.model_copy(update={"cache": cache, "storage": storage, "admin": admin}), notes
