"""kvtier inside vLLM as an operator meets it: the keys `kv_connector_extra_config` takes, the
defaults that fit the model and the machine, logging through vLLM's log, and no leftovers.

* Keys: `check_extra_config` refuses a key neither kvtier nor vLLM's offloading connector reads,
  in one line naming it and the known ones (a mistyped `host_block` once gave the default pool
  silently).
* Host tier, file storage folder, admin port when nobody set them: `kvtier.engine.defaults`
  (the same for every engine; 10% of free memory / half the free /dev/shm, one storage folder
  for every instance, any free port).
* Logging: vLLM configures only its own `vllm` logger, so `kvtier`'s records went nowhere; when
  no handler would take them, the `kvtier` logger gets vLLM's handlers (its format, its level).
  vLLM's two "This API is experimental" warnings about the connector and the out-of-tree spec
  are dropped for kvtier's connector: the operator cannot act on them (`quiet_vllm_warnings`).
* Leftovers: vLLM kills its engine process tree with SIGKILL on Ctrl-C/SIGTERM, so a watcher
  outside that tree removes the deployment's names when the engine process ends, and a start
  sweeps what dead deployments of earlier runs left (`kvtier.engine.embedded`, with
  `DEPLOYMENT_PATTERN`).
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier.integrations.vllm.errors import VllmAdapterError

DEPLOYMENT_PATTERN = r"vllm-[0-9a-f]{12}"  # the ids `kvtier_config` derives (never a given one)

KVTIER_KEYS: dict[str, str] = {
    "kvtier_serve": "attached mode: the socket path of the node's `kvtier serve` (unset: "
                    "embedded, this instance's own kvtier)",
    "kvtier_config": "kvtier's TOML file",
    "deployment_id": "kvtier's deployment id (default: derived from vLLM's engine id)",
    "host_blocks": "cache.host_blocks",
    # vLLM owns the device tier (kvtier's own is one unused block): no `eviction_policy` key
    "host_eviction_policy": "cache.host_eviction_policy",
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

EMBEDDED_ONLY = frozenset({
    "deployment_id", "host_blocks", "host_eviction_policy", "storage_backend", "storage_path",
    "storage_url", "admin", "admin_host", "admin_port", "admin_auth", "admin_url_file"})
"""Keys of this instance's own kvtier: the node service's configuration decides them when the
instance is attached (`kvtier_serve`)."""

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
    serve = extra.get("kvtier_serve")
    if serve is not None and (not isinstance(serve, str) or not serve):
        raise VllmAdapterError(
            f"kv_connector_extra_config: kvtier_serve = {serve!r}: expected the path of the "
            "node service's socket (a non-empty string), or leave it unset for embedded mode")
    clash = sorted(EMBEDDED_ONLY & set(extra)) if serve else []
    if clash:
        raise VllmAdapterError(
            f"kv_connector_extra_config: {', '.join(clash)} configure this instance's own "
            f"kvtier, which an attached instance (kvtier_serve = {serve!r}) does not run: "
            "set them on the node service (kvtier serve's TOML file) instead")


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
