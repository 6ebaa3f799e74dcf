"""Delays a test can inject into a worker through its environment, so the tests can watch
what a slow copy or a slow store does (layer-by-layer waits, prefetch policies). Read once,
when the object they slow down is built; unset means no delay."""

from __future__ import annotations

import os

LAYER_DELAY_ENV = "KVTIER_TEST_LAYER_DELAY_MS"  # sleep after each layer of an H2D load
STORAGE_DELAY_ENV = "KVTIER_TEST_STORAGE_DELAY_MS"  # sleep before each storage query/read
STORAGE_WRITE_DELAY_ENV = "KVTIER_TEST_STORAGE_WRITE_DELAY_MS"  # ... each BACKUP write, CLEAR
PREFETCH_PAGE_DELAY_ENV = "KVTIER_TEST_PREFETCH_PAGE_DELAY_MS"  # after each page a PREFETCH reads
BACKUP_DELAY_ENV = "KVTIER_TEST_BACKUP_DELAY_MS"  # sleep before each D2H (backup) batch
DELAY_ENVS = (LAYER_DELAY_ENV, STORAGE_DELAY_ENV, STORAGE_WRITE_DELAY_ENV,
              PREFETCH_PAGE_DELAY_ENV, BACKUP_DELAY_ENV)
"""Every hook: the manager passes them on to its workers (they are not settings)."""


def delay_from_env(name: str) -> float:
    """Seconds of delay set by the environment variable `name` (in milliseconds)."""
    raw = os.environ.get(name, "")
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{name}: {raw!r} is not a number of milliseconds") from None
    if not ms >= 0:
        raise ValueError(f"{name}: must be >= 0, got {raw!r}")
    return ms / 1000.0
