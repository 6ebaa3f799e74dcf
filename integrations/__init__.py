"""Adapters that plug kvtier into inference engines (`kvtier.integrations.vllm` first).

They sit on top of the layers (integrations -> admin -> manager -> worker) and import the
engine they adapt, so each lives in its own subpackage and is imported only by that engine.
"""
