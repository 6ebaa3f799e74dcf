"""The vLLM adapter's one error type (its own module so the adapter's parts share it)."""

from __future__ import annotations

from kvtier.worker.errors import KvtierError


class VllmAdapterError(KvtierError, ValueError):
    """vLLM was configured in a way kvtier cannot serve (the message names the setting)."""
