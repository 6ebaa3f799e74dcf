"""Embedded mode: kvtier's whole stack inside one engine instance (no node service).

`EmbeddedCache` starts what an engine instance needs when it runs kvtier itself: a sweep of
what dead deployments of the same id pattern left (kill -9 of everything), a `Stack` (manager
plus one kvtier worker process per rank, each owning its rank's host pool segment), a watcher
outside the engine's process tree (vLLM ends its tree with SIGKILL on Ctrl-C and SIGTERM), and
kvtier's admin REST with its Prometheus metrics on a thread. The adapter calls the stack's
key-addressed surface (`cache`, a `KeyedHostCache`), and reads here what lies outside it: each
rank's host segment (name and inode, read once per generation: a worker lost and replaced is a
new generation, with a new segment), whether a block came from storage, and the engine's own
reset of the host tier.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvtier.manager import janitor
from kvtier.manager.config import KvtierConfig
from kvtier.manager.core.nodes import FROM_STORAGE
from kvtier.manager.keyed import KeyedHostCache, Lookup, StorePlan, engine_key
from kvtier.manager.stack import Stack
from kvtier.worker.errors import KvtierError
from kvtier.worker.spec import host_segment_name

# the key-addressed surface's answers, for the adapter (which imports kvtier.engine only)
__all__ = ["EmbeddedCache", "KvtierConfig", "Lookup", "StorePlan"]

log = logging.getLogger("kvtier.engine")


class EmbeddedCache:
    """One engine instance's own kvtier: the stack, its watcher and its admin server.

    Data structures: `stack` (tree, host LRU, storage tier, worker processes); `cache`, its
    key-addressed surface; `_segments`, (generation, each rank's (segment name, inode)).
    Invariant: `host_segments()` names the segments of the current generation only."""

    def __init__(self, cfg: KvtierConfig, namespace: bytes, *, sweep_pattern: str = "",
                 admin: bool = True, admin_url_file: str = "") -> None:
        self.cfg = cfg
        if sweep_pattern:
            for dead, names in janitor.sweep_dead(sweep_pattern,
                                                  keep=cfg.deployment_id).items():
                log.info("kvtier: removed %d names of dead deployment %s: %s", len(names),
                         dead, " ".join(names))
        self._sweep_pattern = sweep_pattern
        self.stack = Stack(cfg, keyed_namespace=namespace).start()
        try:
            janitor.spawn_watcher(cfg.deployment_id)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("kvtier: no watcher for deployment %s (%s): if the engine is killed, "
                        "the next start removes its names", cfg.deployment_id, e)
        self.cache: KeyedHostCache = self.stack.require_keyed()
        self._segments: tuple[int, tuple[tuple[str, int], ...]] | None = None
        self.admin: Any = None
        self.admin_url = ""
        self.token_file: Path | None = None  # a token generated for this run
        self._closed = False
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
        self.admin = AdminServer(create_app(self.stack, token=token), a.host, a.port,
                                 limits=a).start()
        self.admin_url = self.admin.url
        if url_file:  # for scripts and tests that start the engine with admin.port = 0
            Path(url_file).write_text(self.admin_url + "\n")

    @property
    def page_bytes(self) -> int:
        return self.stack.page_bytes

    def host_segments(self) -> tuple[tuple[str, int], ...]:
        """Each rank's host pool segment (name, inode) of the current generation."""
        gen = self.cache.generation
        if self._segments is None or self._segments[0] != gen:
            names = [host_segment_name(self.cfg.deployment_id, r)
                     for r in range(self.cfg.workers.count)]
            self._segments = (gen, tuple((n, os.stat("/dev/shm" + n).st_ino) for n in names))
        return self._segments[1]

    def came_from_storage(self, block_hash: bytes) -> bool:
        """Whether this block's host copy came from storage and was not loaded since."""
        node = self.stack.require_manager().lookup(engine_key(block_hash))
        return node is not None and bool(node.flags & FROM_STORAGE)

    def reset_host(self) -> None:
        """Empty the host tier (storage is kept); logged, not raised, when transfers do not
        drain in time (the host tier then stays as it was)."""
        try:
            self.stack.reset()
        except KvtierError as e:
            log.warning("kvtier: the engine's cache reset could not empty kvtier's host "
                        "tier: %s", e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.admin is not None:
            self.admin.stop()
        self.stack.close()
        if self.token_file is not None and self._sweep_pattern and re.fullmatch(
                self._sweep_pattern, self.cfg.deployment_id):
            # the id is this run's only: its token folder would never be read again
            shutil.rmtree(self.token_file.parent, ignore_errors=True)
