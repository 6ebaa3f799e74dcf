"""An attached engine's kvtier configuration (issue 34, 8): the host tier is the node
service's (sized by its namespace quota), so the engine side checks nothing of the embedded
host tier it never creates. An attached vLLM with a 12-layer fp32 model (1.5 MiB pages) on a
machine with 8.3 GiB free died at start: `cache.host_blocks = 8192 ... needs 12.0 GiB but
only 8.3 GiB are available in MemAvailable`.
"""

from __future__ import annotations

import pytest
from kvtier.engine.geometry import KVGeometry, engine_config
from kvtier.manager.config import ConfigError, KvtierConfig, mem_available_bytes, page_bytes

pytestmark = pytest.mark.fast


def _geometry_too_big_for_this_machine() -> KVGeometry:
    """12 layers x 8 heads x 128 of fp32 (the issue's model), blocks long enough that the
    default host tier needs more than twice this machine's free memory."""
    mem = mem_available_bytes()
    assert mem is not None
    blocks = KvtierConfig().cache.host_blocks
    block_size = 16
    while True:
        g = KVGeometry(layers=12, kv_heads=8, head_dim=128, dtype="float32",
                       block_size=block_size, ranks=1)
        if 2 * 12 * 8 * 128 * 4 * block_size * blocks > 2 * mem:
            return g
        block_size *= 2


def test_an_attached_engine_checks_no_host_tier_it_does_not_own() -> None:
    g = _geometry_too_big_for_this_machine()
    # embedded: the engine's own host tier, checked against this machine (refused here)
    with pytest.raises(ConfigError, match=r"cache\.host_blocks"):
        engine_config(g, "attached-cfg", {})
    # attached: nothing of it checked, nothing sized; the geometry is the engine's
    cfg = engine_config(g, "attached-cfg", {}, attached=True)
    assert cfg.cache.host_blocks == KvtierConfig().cache.host_blocks
    assert page_bytes(cfg) == 2 * 12 * 8 * 128 * 4 * g.block_size
    # a setting the operator got wrong is still refused, attached or not
    with pytest.raises(ConfigError):
        engine_config(g, "attached-cfg", {"host_blocks": -1}, attached=True)
