"""Delays a test can inject into a worker through its environment, so the tests can watch
what a slow copy or a slow store does (layer-by-layer waits, prefetch policies). Read once,
when the object they slow down is built; unset means no delay."""

from __future__ import annotations

import os

LAYER_DELAY_ENV = "KVTIER_TEST_LAYER_DELAY_MS"  # sleep after each layer of an H2D load
STORAGE_DELAY_ENV = "KVTIER_TEST_STORAGE_DELAY_MS"  # sleep before each storage query/read


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
