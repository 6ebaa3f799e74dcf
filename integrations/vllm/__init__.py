"""kvtier inside vLLM: the offloading spec and connector vLLM loads by module path.

    kv_transfer_config = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm",
                                   "kvtier_config": "/etc/kvtier.toml"})

See `adapter.py` for how the two sides work and README.md ("kvtier with vLLM").
"""

from kvtier.integrations.vllm.adapter import (
    MODULE_PATH,
    SPEC_NAME,
    KvtierConnector,
    KvtierLoadStoreSpec,
    KvtierOffloadingManager,
    KvtierOffloadingSpec,
    KvtierOffloadingWorker,
    kv_groups,
    kvtier_config,
    storage_namespace,
)
from kvtier.integrations.vllm.errors import VllmAdapterError
from kvtier.integrations.vllm.kv_groups import KVGroup

__all__ = ["MODULE_PATH", "SPEC_NAME", "KVGroup", "KvtierConnector", "KvtierLoadStoreSpec",
           "KvtierOffloadingManager", "KvtierOffloadingSpec", "KvtierOffloadingWorker",
           "VllmAdapterError", "kv_groups", "kvtier_config", "storage_namespace"]
