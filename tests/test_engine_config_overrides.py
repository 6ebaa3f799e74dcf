"""An engine's configuration takes one typed path (issue 34, item 1): `engine_config` hands
the geometry and the adapter's settings to `load_config` as `Override`s (no `KVTIER_*`
strings in between; the variables are the operator's alone), and an error names the setting
at fault, not a variable nobody set.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvtier.engine.geometry import KVGeometry, engine_config
from kvtier.manager.config import ConfigError, Override, load_config

pytestmark = pytest.mark.fast

G = KVGeometry(layers=2, kv_heads=2, head_dim=8, dtype="float16", block_size=4, ranks=1)


def test_the_engine_config_path_holds_no_kvtier_variable_names() -> None:
    src = Path(__file__).resolve().parent.parent / "engine"
    for name in ("geometry.py", "defaults.py"):
        code = "\n".join(line for line in (src / name).read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        assert '"KVTIER_' not in code, name


def test_settings_and_geometry_are_typed_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    # the operator's variables stay under the adapter's settings and the engine's geometry
    monkeypatch.setenv("KVTIER_CACHE__HOST_BLOCKS", "32")
    monkeypatch.setenv("KVTIER_MODEL__NUM_LAYERS", "9")
    cfg = engine_config(G, "ovr-a", {}, attached=True)
    assert cfg.cache.host_blocks == 32 and "host_blocks" in cfg.cache.model_fields_set
    assert cfg.model.num_layers == 2 and cfg.deployment_id == "ovr-a"
    assert cfg.cache.device_blocks == 1 and cfg.workers.count == 1
    # a setting, typed or as text, wins over the variable
    assert engine_config(G, "ovr-b", {"host_blocks": 48}, attached=True).cache.host_blocks == 48
    assert engine_config(G, "ovr-c", {"host_blocks": "64", "admin_port": 0},
                         attached=True).cache.host_blocks == 64


def test_a_bad_setting_is_named_as_the_engines() -> None:
    with pytest.raises(ConfigError) as e:
        engine_config(G, "ovr-d", {"host_blocks": "lots"}, attached=True)
    assert str(e.value) == ("cache.host_blocks = 'lots': expected an integer "
                            "(from the engine's setting 'host_blocks')")
    with pytest.raises(ConfigError, match=r"cache\.host_blocks = 1\.5: .*setting 'host_blocks'"):
        engine_config(G, "ovr-e", {"host_blocks": 1.5}, attached=True)


def test_an_override_of_no_key_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cache\.host_block: unknown key \(from here; "
                                          r"did you mean cache\.host_blocks\?\)"):
        load_config(None, {}, overrides=[Override(("cache", "host_block"), 1, "here")],
                    check_resources=False)


def test_the_host_eviction_policy_is_an_engine_setting() -> None:
    # issue 38: vLLM's connector config chooses the host tier's eviction order
    # (`host_eviction_policy` in kv_connector_extra_config); an unknown name is one line
    assert engine_config(G, "ovr-f", {}, attached=True).cache.host_eviction_policy == "lru"
    for name in ("duel", "arc", "s3fifo"):
        cfg = engine_config(G, "ovr-g", {"host_eviction_policy": name}, attached=True)
        assert cfg.cache.host_eviction_policy == name
    with pytest.raises(ConfigError) as e:
        engine_config(G, "ovr-h", {"host_eviction_policy": "lfu"}, attached=True)
    assert "\n" not in str(e.value), str(e.value)
    assert str(e.value).startswith("cache.host_eviction_policy = 'lfu': "), str(e.value)
    assert "(from the engine's setting 'host_eviction_policy')" in str(e.value)
