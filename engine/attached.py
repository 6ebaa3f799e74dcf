"""Attached mode: an engine instance uses the node's kvtier (`kvtier serve`) over its socket.

`attach` builds who the engine is (`kvtier.manager.node.wire.Hello`: the storage namespace,
the host page geometry the engine lays its KV out in, block size, hash algorithm and seed,
ranks, pid) from kvtier's configuration for the engine (`geometry.engine_config`), and returns
the node client (`kvtier.engine.node_client.NodeClient`), the attached home of
`kvtier.engine.cache_api.EngineCache`. The client attaches now if the service answers, and
otherwise keeps trying in the background: until then lookups miss and nothing is stored, so
an engine starts and serves with or without its node service.

The worker side needs no connection of its own: every copy the scheduler side plans names the
host pool segment of each rank (name and inode) it was planned against, and the engine's
worker maps that (`host_copier.HostCopier`), refusing a segment replaced since.
"""

from __future__ import annotations

import os

from kvtier.engine.node_client import NodeClient
from kvtier.manager.config import KvtierConfig
from kvtier.manager.node import wire

__all__ = ["NodeClient", "attach"]


def attach(socket_path: str, namespace: str, cfg: KvtierConfig, *, hash_algo: str,
           hash_seed: str, hash_block_size: int = 0, kv_groups: int = 1,
           call_timeout_s: float = 1.0) -> NodeClient:
    """The node client of an engine of this configuration (its geometry, block size, ranks)
    and storage namespace, attached to the service at `socket_path` (or attaching in the
    background while it does not answer). `hash_block_size`: the engine's tokens per block
    hash (0: not known); `kv_groups`: its KV cache groups. `call_timeout_s` bounds every
    wait on the service."""
    m = cfg.model
    hello = wire.Hello(
        namespace=namespace,
        shape={"num_layers": m.num_layers, "num_kv_heads": m.num_kv_heads,
               "head_dim": m.head_dim, "dtype": m.dtype,
               "num_extra_layers": m.num_extra_layers, "kv_scales": m.kv_scales},
        block_size=cfg.cache.block_size, hash_algo=hash_algo, hash_seed=hash_seed,
        ranks=cfg.workers.count, pid=os.getpid(), hash_block_size=hash_block_size,
        kv_groups=kv_groups)
    return NodeClient(socket_path, hello, call_timeout_s=call_timeout_s)
