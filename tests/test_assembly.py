"""`kvtier.manager.stack.assemble`: the one place a configuration becomes a manager, its
storage tier and (on request) the key-addressed surface, wired at construction."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.stack import assemble
from kvtier.manager.storage_tier import StorageTier
from kvtier.manager.transfers import ImmediateDispatcher
from support import tiny_config

pytestmark = pytest.mark.fast


def test_assemble_hands_the_storage_tier_to_the_manager(tmp_path: Path) -> None:
    cfg = tiny_config(workers=1, device_blocks=4, host_blocks=8, storage="file",
                      storage_dir=tmp_path)
    parts = assemble(cfg, ImmediateDispatcher(), keyed_namespace=b"ns",
                     host_ready=lambda: False, track_device_copies=True)
    m = parts.manager
    assert isinstance(m, KVCacheManager) and isinstance(parts.storage, StorageTier)
    assert m.storage is parts.storage and parts.storage.m is m
    assert m.track_device_copies and m.block_size == cfg.cache.block_size
    assert isinstance(parts.keyed, KeyedHostCache)
    assert parts.keyed.m is m and parts.keyed.storage is parts.storage
    assert parts.keyed.namespace == b"ns" and not parts.keyed.host_ready()
    m.check_invariants()


def test_assemble_without_storage_or_keyed() -> None:
    cfg = tiny_config(workers=1, device_blocks=4, host_blocks=0)
    parts = assemble(cfg, ImmediateDispatcher())
    assert parts.storage is None and parts.keyed is None
    assert parts.manager.storage is None and not parts.manager.track_device_copies
