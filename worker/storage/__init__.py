"""kvtier's storage tier (L3): pages of KV blocks in local files or a shared Redis.

`make_backend` opens the backend named by the `[storage]` config section on the namespace
`namespace_for` computes for one rank; every backend implements `StorageBackend`. The byte
layout of a stored page (header + MAC) is in `page_format`.
"""

from kvtier.worker.storage.backend import StorageBackend, namespace_for
from kvtier.worker.storage.factory import make_backend
from kvtier.worker.storage.page_format import HEADER_BYTES, KEY_BYTES, PageStatus

__all__ = [
    "HEADER_BYTES",
    "KEY_BYTES",
    "PageStatus",
    "StorageBackend",
    "make_backend",
    "namespace_for",
]
