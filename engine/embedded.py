"""Embedded mode: kvtier's whole stack inside one engine instance (no node service).

`EmbeddedDeployment` starts what an engine instance needs when it runs kvtier itself: a sweep
of what dead deployments of the same id pattern left (kill -9 of everything), a `Stack`
(manager plus one kvtier worker process per rank, each owning its rank's host pool segment),
a watcher outside the engine's process tree (vLLM ends its tree with SIGKILL on Ctrl-C and
SIGTERM), and kvtier's admin REST with its Prometheus metrics on a thread. The adapter calls
its `cache` (`EmbeddedCache`, the embedded home of `kvtier.engine.cache_api.EngineCache`).
The admin serves the steering routes (lookup, retain, warm, clear, tenants by token ids) on
the stack's one namespace, `EmbeddedNamespace`: it names blocks as the engine does with the
`naming` the engine gives (read at each request: vLLM sets its hash seed after start).

    start: sweep dead ids -> Stack.start -> watcher -> admin (its URL written if asked)
    close: admin stop -> stack close (workers stopped, segments unlinked) -> token folder
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.engine.embedded_cache import EmbeddedCache
from kvtier.manager import janitor
from kvtier.manager.config import KvtierConfig
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.keys import BlockNaming
from kvtier.manager.stack import Stack
from kvtier.manager.tenants import top_tenants

__all__ = ["EmbeddedDeployment", "KvtierConfig"]

log = logging.getLogger("kvtier.engine")


# How the engine names blocks from token ids, asked at each steering request: (hash
# algorithm, seed, tokens per block hash); None: it has not said (token-id steering refused)
Naming = Callable[[], tuple[str, str, int]]


class EmbeddedNamespace:
    """The embedded stack as the one namespace the admin's steering acts on (the
    `SteeredNamespace` protocol of `kvtier.manager.node.steering`). Holds no state: the
    tenant book and the marks are the keyed surface's."""

    def __init__(self, stack: Stack, name: str, naming: Naming | None,
                 kv_groups: int = 1) -> None:
        self.name = name
        self.keyed: KeyedHostCache = stack.require_keyed()
        self.page_bytes = stack.page_bytes
        self.ranks = stack.cfg.workers.count
        self._naming = naming
        self.kv_groups = kv_groups  # several: token-id steering refused (`Steering.hashes`)

    def block_naming(self) -> BlockNaming:
        if self._naming is None:  # refused by `engine_block_hashes` in one line
            return BlockNaming("(not given by the engine)", "", self.keyed.block_size,
                               self.kv_groups)
        algo, seed, hash_block_size = self._naming()
        return BlockNaming(algo, seed, hash_block_size or self.keyed.block_size,
                           self.kv_groups)

    def tenant_figures(self, top: int) -> dict[str, Any]:
        return top_tenants(self.keyed.tenant_figures(), top)


class EmbeddedDeployment:
    """One engine instance's own kvtier: the stack, its watcher and its admin server.

    Data structures: `stack` (tree, host LRU, storage tier, worker processes); `cache`, its
    `EngineCache`; `admin`, the admin server (or None) and `token_file`, a token generated
    for this run; `steered`, the namespace its admin steers. Invariant: everything started
    is stopped by `close` (idempotent), and a failed start stops what it started.

    `naming`: how the engine names blocks from token ids (its hash algorithm, seed and
    tokens per block hash; 0: kvtier's block size), for the admin's steering routes;
    `kv_groups`: its KV cache groups (several: those routes refuse token ids in one line)."""

    def __init__(self, cfg: KvtierConfig, namespace: bytes, *, sweep_pattern: str = "",
                 admin: bool = True, admin_url_file: str = "",
                 naming: Naming | None = None, kv_groups: int = 1) -> None:
        self.cfg = cfg
        self._sweep_pattern = sweep_pattern
        if sweep_pattern:
            for dead, names in janitor.sweep_dead(sweep_pattern,
                                                  keep=cfg.deployment_id).items():
                log.info("kvtier: removed %d names of dead deployment %s: %s", len(names),
                         dead, " ".join(names))
        self.stack = Stack(cfg, keyed_namespace=namespace).start()
        self.admin: Any = None
        self.admin_url = ""
        self.token_file: Path | None = None
        self._closed = False
        try:
            janitor.spawn_watcher(cfg.deployment_id)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("kvtier: no watcher for deployment %s (%s): if the engine is killed, "
                        "the next start removes its names", cfg.deployment_id, e)
        self.cache = EmbeddedCache(self.stack)
        self.steered = EmbeddedNamespace(self.stack, namespace.decode(errors="replace"),
                                         naming, kv_groups)
        try:
            if admin:
                self._start_admin(admin_url_file)
        except BaseException:
            self.stack.close()
            raise

    def _start_admin(self, url_file: str) -> None:
        from kvtier.admin.app import create_app
        from kvtier.admin.auth import generate_token, token_path, write_token
        from kvtier.admin.server import AdminServer

        a = self.cfg.admin
        token: str | None = a.token.get_secret_value() or None
        if token is None and a.auth == "token":
            token = generate_token()
            self.token_file = token_path(self.cfg.deployment_id)
            write_token(self.token_file, token)
        self.admin = AdminServer(create_app(self.stack, token=token, steered=self.steered),
                                 a.host, a.port, limits=a).start()
        self.admin_url = self.admin.url
        if url_file:  # for scripts and tests that start the engine with admin.port = 0
            Path(url_file).write_text(self.admin_url + "\n")

    def register_metrics(self, collector: Any, status: Callable[[], Any] | None = None,
                         name: str = "") -> None:
        """Add a Prometheus collector (the engine integration's own figures, such as the
        audit's) to the admin's /metrics, and `status()` as section `name` of its /status;
        nothing without an admin."""
        if self.admin is not None:
            admin = self.admin.app.state.admin
            admin.registry.register(collector)
            if status is not None and name:
                admin.status_sections[name] = status

    @property
    def page_bytes(self) -> int:
        """Bytes of one block on one rank."""
        return self.stack.page_bytes

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.admin is not None:
            self.admin.stop()
        self.cache.close()
        if self.token_file is not None and self._sweep_pattern and re.fullmatch(
                self._sweep_pattern, self.cfg.deployment_id):
            # the id is this run's only: its token folder would never be read again
            shutil.rmtree(self.token_file.parent, ignore_errors=True)


if TYPE_CHECKING:  # mypy holds the embedded namespace to the steering protocol
    from kvtier.manager.node.steering import SteeredNamespace

    def _steerable(ns: EmbeddedNamespace) -> SteeredNamespace:
        return ns
