"""A stand-in engine process for the node service tests: a `NodeClient` driven over stdin.

Run as `python node_engine.py SOCKET NAMESPACE [GEOMETRY_JSON]`; it attaches, prints
`{"attached": ...}` and then answers one JSON command per stdin line with one JSON line:

    {"op": "store", "keys": [i, ...], "hang_after": n}
        prepare_store the keys' blocks, write each block's content (`content(key)`) into the
        host pool, complete the store. With `hang_after`: write only the first n blocks,
        say so, and never complete (the test kills the process). With `"hold": true`:
        write every block, complete nothing until a `complete` command.
    {"op": "complete", "ok": true}
        complete the stores held so far (ok or failed).
    {"op": "load", "keys": [i, ...]}
        look the keys up as an engine does (the first key with the rest as following), load
        the leading hits from the host pool, compare each block byte for byte with its
        content, complete the load. With `"hold": true`: complete nothing until a
        `complete_load` command.
    {"op": "complete_load"}
        complete the oldest load held so far.
    {"op": "status"}   connection, generation, pool nonce and inodes
    {"op": "retain", "keys": [...], "pin": true, "ttl_s": 0, "priority": 0, "tenant": "b"}
        a request's kvtier.retain (one-way RETAIN, sent with the next question)

Instead of "keys", a command may give "tokens" (token ids) and "salt" (the cache_salt): the
blocks are then named as vLLM names them (`keys.engine_block_hashes`, seed "0"), and a store
is booked to the tenant `salt` (or "tenant" when given).

Keys are small ints named by `key(i)` (32-byte hashes, as vLLM's); a block's content is
derived from its key, so any process can check any block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from typing import Any

from kvtier.engine.cache_api import HostPools
from kvtier.engine.node_client import NodeClient
from kvtier.manager.keys import engine_block_hashes
from kvtier.manager.node import wire
from kvtier.manager.tenants import Retention
from kvtier.worker.kv_pools import HostPool, KVShape

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
         "num_extra_layers": 0, "kv_scales": "none"}
BLOCK_SIZE = 4


def key(i: int) -> bytes:
    return hashlib.sha256(b"node-test-key-%d" % i).digest()


def content(k: bytes, nbytes: int) -> bytes:
    return hashlib.shake_256(k).digest(nbytes)


def hello(namespace: str, shape: dict[str, Any] | None = None,
          block_size: int = BLOCK_SIZE) -> wire.Hello:
    return wire.Hello(namespace, dict(shape or SHAPE), block_size, "sha256", "0", 1,
                      os.getpid())


class Engine:
    """A NodeClient and the host pool mapping of the last plan's pools (each copy against its
    own plan's pools, as an engine's copier does)."""

    def __init__(self, client: NodeClient, shape: dict[str, Any],
                 block_size: int = BLOCK_SIZE) -> None:
        self.client = client
        self.kv = KVShape(shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                          block_size, shape["dtype"])
        self.pool: HostPool | None = None
        self.pool_seg: tuple[str, int] | None = None
        self.held: list[bytes] = []  # keys of stores written and not completed yet
        self.held_loads: list[list[bytes]] = []  # loads copied and not completed, oldest first

    def host(self, pools: HostPools) -> HostPool | None:
        """Rank 0's segment of `pools` (a plan's), mapped; None when it was replaced since."""
        seg = pools.names()[0]
        if self.pool is None or self.pool_seg != seg:
            if self.pool is not None:
                self.pool.close()
                self.pool = None
            try:
                pool = HostPool.attach(seg[0], self.kv)
            except Exception:  # KvtierError: gone
                return None
            if pool.inode != seg[1]:  # never a pool other than the one planned against
                pool.close()
                return None
            self.pool, self.pool_seg = pool, seg
        return self.pool

    def store(self, keys: list[bytes], hang_after: int | None = None,
              hold: bool = False, tenant: str = "") -> dict[str, Any]:
        plan = self.client.prepare_store(keys, tenant)
        if plan is None:
            return {"stored": None}
        pool = self.host(plan.pools)
        if pool is None:
            self.client.complete_store(plan.keys, ok=False)
            return {"stored": None}
        nbytes = pool.data.shape[1]
        for n, (k, hid) in enumerate(zip(plan.keys, plan.host_ids, strict=True)):
            if hang_after is not None and n == hang_after:
                return {"prepared": len(plan.keys), "written": n}
            pool.data[hid].copy_(_tensor(content(k, nbytes)))
        if hold:
            self.held += plan.keys
            return {"prepared": len(plan.keys), "written": len(plan.keys)}
        self.client.complete_store(plan.keys)
        self.client.end_step()
        return {"stored": len(plan.keys), "evicted": plan.evicted}

    def complete(self, ok: bool) -> dict[str, Any]:
        keys, self.held = self.held, []
        self.client.complete_store(keys, ok=ok)
        self.client.end_step()
        return {"completed": len(keys)}

    def complete_load(self) -> dict[str, Any]:
        keys = self.held_loads.pop(0) if self.held_loads else []
        self.client.complete_load(keys)
        self.client.end_step()
        return {"completed": len(keys)}

    def load(self, keys: list[bytes], rid: str = "r", hold: bool = False) -> dict[str, Any]:
        codes = []
        for i, k in enumerate(keys):
            found = self.client.lookup(k, rid, keys[i + 1:])
            codes.append(found.value)
            if found.value != "hit":
                break
        self.client.forget_request(rid)
        hits = keys[:sum(c == "hit" for c in codes)]
        out: dict[str, Any] = {"codes": codes, "hits": len(hits), "identical": None}
        if not hits:
            return out
        try:
            plan = self.client.prepare_load(hits)
        except Exception as e:  # InvalidRequestError: the engine would recompute
            out["load_error"] = str(e)
            return out
        ids = plan.host_ids
        pool = self.host(plan.pools)
        if pool is None:
            out["load_error"] = "no host pool"
            return out
        nbytes = pool.data.shape[1]
        out["identical"] = all(bytes(pool.data[h].numpy().tobytes()) == content(k, nbytes)
                               for k, h in zip(hits, ids, strict=True))
        if hold:
            self.held_loads.append(hits)
            return out
        self.client.complete_load(hits)
        self.client.end_step()
        return out

    def status(self) -> dict[str, Any]:
        pools = self.client.host_pools()
        return {"connected": self.client.connected, "generation": self.client.generation,
                "nonce": pools.nonce.hex() if pools else None,
                "inodes": list(pools.inodes()) if pools else None,
                "session": self.client.session}


def _tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def main() -> int:
    path, namespace = sys.argv[1], sys.argv[2]
    shape = json.loads(sys.argv[3]) if len(sys.argv) > 3 else SHAPE
    # the engine's tokens per block hash and KV cache groups, when a test says (HELLO's
    # hash_block_size, kv_groups)
    said = dataclasses.replace(hello(namespace, shape), hash_block_size=int(
        os.environ.get("NODE_ENGINE_HASH_BLOCK_SIZE") or 0), kv_groups=int(
        os.environ.get("NODE_ENGINE_KV_GROUPS") or 1))
    client = NodeClient(path, said, call_timeout_s=1.0)
    engine = Engine(client, shape)
    print(json.dumps({"attached": client.connected, "error": client.last_error}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        keys = [key(i) for i in cmd.get("keys", [])]
        salt = cmd.get("salt")
        if "tokens" in cmd:
            keys = engine_block_hashes("sha256", "0", BLOCK_SIZE, cmd["tokens"], salt)
        tenant = cmd.get("tenant", salt or "")
        t0 = time.perf_counter()
        if cmd["op"] == "store":
            out = engine.store(keys, cmd.get("hang_after"), bool(cmd.get("hold")), tenant)
        elif cmd["op"] == "retain":
            client.retain(keys, Retention(bool(cmd.get("pin")), float(cmd.get("ttl_s", 0)),
                                          int(cmd.get("priority", 0))), tenant)
            out = {"queued": len(keys)}
        elif cmd["op"] == "complete":
            out = engine.complete(bool(cmd.get("ok", True)))
        elif cmd["op"] == "load":
            out = engine.load(keys, hold=bool(cmd.get("hold")))
        elif cmd["op"] == "complete_load":
            out = engine.complete_load()
        else:
            out = engine.status()
        out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
