"""The error the vLLM adapter raises (its own module, so every part of the adapter can raise it
without importing the others)."""

from __future__ import annotations

from kvtier.engine.errors import KvtierError


class VllmAdapterError(KvtierError, ValueError):
    """vLLM was configured in a way kvtier cannot serve (the message names the setting)."""
