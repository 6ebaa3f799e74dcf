"""The root of every error kvtier raises on purpose.

It lives here, in the bottom layer, so that the worker's own errors (pool, block id, storage
and IPC errors) can derive from it without importing the manager; `kvtier.manager.errors`
re-exports it next to the scheduler API's errors. An engine can catch everything kvtier
raises deliberately with one `except KvtierError`; each concrete error also keeps the
built-in base it always had (`ValueError`, `TimeoutError`, `OSError`, `RuntimeError`, ...),
so existing `except` clauses still catch it.
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises on purpose."""


__all__ = ["KvtierError"]
