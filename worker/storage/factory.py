"""Open the storage backend named by the `[storage]` config section.

This module sits above the backends: it imports `file_backend` and `redis_backend`, which
import `backend` (the interface); `backend` imports neither, so no module imports its
importer. Each backend module is imported only when its kind is opened, so a deployment
without Redis never pays for loading the Redis client.
"""

from __future__ import annotations

from kvtier.worker.storage.backend import StorageBackend
from kvtier.worker.storage.page_crypto import PageKeys

BACKEND_KINDS = ("none", "file", "redis")


def make_backend(
    kind: str,
    *,
    namespace: str,
    secret: bytes,
    path: str = "",
    url: str = "redis://127.0.0.1:6379/0",
    capacity_bytes: int = 0,
    ttl_s: int = 0,
    page_bytes: int | None = None,
    timeout_s: float = 0.5,
    io_threads: int = 2,
    keys: PageKeys | None = None,
    compression: str = "none",
) -> StorageBackend | None:
    """Open the storage tier named by `[storage] backend`, its pages authenticated with
    `secret` (the deployment's storage secret: instances sharing a store must share it), and
    encrypted under `keys` (format version 4, see `page_crypto`) unless `keys` is None, and
    compressed before that as `compression` says ("none" | "zstd").

    * "none" returns None: there is no storage tier, and callers skip every storage step
      (queries, prefetches, backups) instead of talking to a store that always misses.
    * "file": `FileBackend` under `path`, at most `capacity_bytes` (0 = unlimited), each
      batch spread over `io_threads` threads, the calling one included (1 = no pool).
    * "redis": `RedisBackend` on `url`, values expiring after `ttl_s` seconds (0 = never),
      every network call bounded by `timeout_s`.
    """
    if kind == "none":
        return None
    if kind == "file":
        if not path:
            raise ValueError("the file storage backend needs a path (storage.path)")
        from kvtier.worker.storage.file_backend import FileBackend

        return FileBackend(
            path,
            namespace,
            secret=secret,
            capacity_bytes=capacity_bytes,
            page_bytes=page_bytes,
            io_threads=io_threads,
            keys=keys,
            compression=compression,
        )
    if kind == "redis":
        from kvtier.worker.storage.redis_backend import RedisBackend

        return RedisBackend(
            url, namespace, secret=secret, ttl_s=ttl_s, page_bytes=page_bytes,
            timeout_s=timeout_s, keys=keys, compression=compression)
    raise ValueError(
        f"storage backend {kind!r} is unknown; choose one of {', '.join(BACKEND_KINDS)}"
    )
