"""The errors an engine adapter sees from kvtier's engine side, re-exported here so an adapter
imports `kvtier.engine` only (the `adapter-imports-engine-only` contract in pyproject.toml).

* `KvtierError`: the base of every kvtier error (an adapter's own error subclasses it).
* `EngineSetupError`: the engine's setup cannot be served (no host block fits, ...); the
  message names the setting.

(`InvalidRequestError`, a key-addressed call refused, comes with the contract it belongs to:
`kvtier.engine.cache_api`.)
"""

from __future__ import annotations

from kvtier.worker.errors import KvtierError

__all__ = ["EngineSetupError", "KvtierError"]


class EngineSetupError(KvtierError, ValueError):
    """The engine's setup cannot be served as configured (the message names the setting)."""
