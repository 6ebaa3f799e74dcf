"""kvtier inside vLLM as an operator meets it: the keys `kv_connector_extra_config` takes, the
defaults that fit the model and the machine, logging through vLLM's log, and no leftovers.

* Keys: `check_extra_config` refuses a key neither kvtier nor vLLM's offloading connector reads,
  in one line naming it and the known ones (a mistyped `host_block` once gave the default pool
  silently).
* Host tier (`cache.host_blocks` when nobody set it): `HOST_MEMORY_FRACTION` of MemAvailable and
  `HOST_SHM_FRACTION` of the free /dev/shm, whichever is smaller, in whole blocks of this
  model's page over all ranks; logged with the figures it came from. A fixed 8,192 blocks was
  6 GiB for a 200M-parameter model and about 16 GiB for a Llama-3-8B-shaped KV.
* File storage (`storage.path` when nobody set it): `<XDG_CACHE_HOME>/kvtier/vllm/storage`, one
  folder for every vLLM instance of the user; pages lie under their storage namespace (model,
  dtype, layout, parallelism, hash seed), so a restart and a second instance of the same model
  find the pages, and nothing piles up per start.
* Admin port (`admin.port` when nobody set it): 0, any free port, logged with the start line;
  two instances side by side never collide.
* Logging: vLLM configures only its own `vllm` logger, so `kvtier`'s records went nowhere; when
  no handler would take them, the `kvtier` logger gets vLLM's handlers (its format, its level).
  vLLM's two "This API is experimental" warnings about the connector and the out-of-tree spec
  are dropped for kvtier's connector: the operator cannot act on them (`quiet_vllm_warnings`).
* Leftovers: vLLM kills its engine process tree with SIGKILL on Ctrl-C/SIGTERM, so a watcher
  outside that tree removes the deployment's names when the engine process ends, and a start
  sweeps what dead deployments of earlier runs left (`kvtier.manager.janitor`).
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier.integrations.vllm.errors import VllmAdapterError
from kvtier.manager.config import (
    MAX_BLOCKS,
    KvtierConfig,
    mem_available_bytes,
    page_bytes,
    shm_free_bytes,
)
from kvtier.manager.private_state import cache_base

# A tenth of the memory free at start: vLLM's own KV, weights and the other instances of the
# machine come first (two instances side by side take 10% and then 9% of it), and the
# operator raises it with host_blocks. Half the free /dev/shm: a container's shm_size is often
# small (64 MiB by default), and kvtier's arena and control block live there too.
HOST_MEMORY_FRACTION = 0.1
HOST_SHM_FRACTION = 0.5
DEPLOYMENT_PATTERN = r"vllm-[0-9a-f]{12}"  # the ids `kvtier_config` derives (never a given one)

KVTIER_KEYS: dict[str, str] = {
    "kvtier_config": "kvtier's TOML file",
    "deployment_id": "kvtier's deployment id (default: derived from vLLM's engine id)",
    "host_blocks": "cache.host_blocks",
    "storage_backend": "storage.backend",
    "storage_path": "storage.path",
    "storage_url": "storage.url",
    "prefetch_threshold": "storage.prefetch_threshold",
    "admin": "false: no admin server",
    "admin_host": "admin.host",
    "admin_port": "admin.port",
    "admin_auth": "admin.auth",
    "admin_url_file": "a file the admin URL is written to",
}
"""The keys kvtier reads from `kv_connector_extra_config`, with what each sets."""

VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only"})
"""The keys vLLM's offloading connector itself reads for any spec (vLLM 0.32)."""


def check_extra_config(extra: Mapping[str, Any]) -> None:
    """Refuse a key that neither kvtier nor vLLM's offloading connector reads (one line)."""
    known = sorted(KVTIER_KEYS) + sorted(VLLM_KEYS)
    for key in extra:
        if key in KVTIER_KEYS or key in VLLM_KEYS:
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise VllmAdapterError(
            f"kv_connector_extra_config: unknown key {key!r}{hint}; kvtier reads "
            f"{', '.join(sorted(KVTIER_KEYS))}; vLLM's offloading connector reads "
            f"{', '.join(sorted(VLLM_KEYS))}")


def _explicit(cfg_fields: set[str], field: str, env_var: str, extra_key: str,
              extra: Mapping[str, Any]) -> bool:
    return field in cfg_fields or env_var in os.environ or extra_key in extra


def default_host_blocks(cfg: KvtierConfig) -> tuple[int, str]:
    """Host blocks per rank from this machine's free memory and /dev/shm, and how they were
    found (for the log). Raises VllmAdapterError when not one block fits."""
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
        raise VllmAdapterError(
            f"kvtier's host tier: {why} is {budget} bytes, less than one block of "
            f"{per_block} bytes over {cfg.workers.count} rank(s); free memory or /dev/shm, "
            "or set host_blocks in kv_connector_extra_config")
    return blocks, f"{why} / {per_block} bytes a block"


def apply_defaults(cfg: KvtierConfig, extra: Mapping[str, Any]) -> tuple[KvtierConfig, list[str]]:
    """`cfg` with the vLLM defaults (module docstring) put where nobody set a value, and one
    note per default applied (for the start line)."""
    notes: list[str] = []
    cache = cfg.cache
    if not _explicit(cache.model_fields_set, "host_blocks", "KVTIER_CACHE__HOST_BLOCKS",
                     "host_blocks", extra):
        blocks, why = default_host_blocks(cfg)
        cache = cache.model_copy(update={"host_blocks": blocks})
        notes.append(f"host tier {blocks} blocks per rank ({why})")
    storage = cfg.storage
    if storage.backend == "file" and not storage.path:
        path = str(cache_base() / "vllm" / "storage")
        storage = storage.model_copy(update={"path": path})
        notes.append(f"file storage {path}")
    admin = cfg.admin
    if not _explicit(admin.model_fields_set, "port", "KVTIER_ADMIN__PORT", "admin_port", extra):
        admin = admin.model_copy(update={"port": 0})
    return cfg.model_copy(update={"cache": cache, "storage": storage, "admin": admin}), notes


# ---------------------------------------------------------------------------- logging


def route_kvtier_logs() -> None:
    """Let kvtier's records reach vLLM's log: when neither the `kvtier` logger nor an
    ancestor has a handler (vLLM configures only `vllm`), give it vLLM's handlers and level."""
    ours = logging.getLogger("kvtier")
    if ours.hasHandlers():
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class _DropExperimental(logging.Filter):
    """Drops vLLM's "This API is experimental" warnings (module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "This API is experimental" not in str(record.msg)


_QUIET = _DropExperimental()
_NOISY_LOGGERS = ("vllm.distributed.kv_transfer.kv_connector.v1.base",
                  "vllm.v1.kv_offload.factory")


@contextmanager
def quiet_vllm_warnings() -> Iterator[None]:
    """While kvtier's connector and spec are built: vLLM's experimental-API warnings dropped."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    for lg in loggers:
        lg.addFilter(_QUIET)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(_QUIET)
