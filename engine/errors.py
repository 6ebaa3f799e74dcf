"""The errors an engine adapter sees from kvtier's engine side, re-exported here so an adapter
imports `kvtier.engine` only (the `adapter-imports-engine-only` contract in pyproject.toml).

* `KvtierError`: the base of every kvtier error (an adapter's own error subclasses it).
* `EngineSetupError`: the engine's setup cannot be served (no host block fits, ...); the
  message names the setting.
* `InvalidRequestError`: a key-addressed call kvtier refused (a load of a block that is no
  longer on the host and ready, a malformed block hash); the adapter turns it into a load
  error so the engine recomputes.
"""

from __future__ import annotations

from kvtier.manager.errors import InvalidRequestError
from kvtier.worker.errors import KvtierError

__all__ = ["EngineSetupError", "InvalidRequestError", "KvtierError"]


class EngineSetupError(KvtierError, ValueError):
    """The engine's setup cannot be served as configured (the message names the setting)."""
