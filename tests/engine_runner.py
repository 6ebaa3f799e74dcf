"""A stand-in model runner that owns its KV memory, for tests/test_engine_kv.py: the KV of
every rank in one layout on one device, registered with `kvtier.worker.engine_kv`, written
with seeded random bytes and read back as per-plane digests.

Used in the test process (`RunnerKV`) and as a child process (CUDA IPC needs the exporter and
the importer to be different processes, and a child can be killed like a crashed engine):

    python tests/engine_runner.py --deployment ID --ranks 2 --layout vllm --device cuda:0 \\
        --layers 3 --blocks 16 --block-size 4 --heads 2 --head-dim 8

The child prints one JSON line `{"ready": pid}` once every rank is registered, then answers
one JSON line per command line on stdin:

    {"op": "write", "rank": r, "ids": [...], "seed": s}  -> {"ok": true}
    {"op": "digest", "rank": r, "ids": [...]}            -> {"digests": [[hex per plane] per id]}
    {"op": "close"}                                      -> {"ok": true}   (unregister all)
    {"op": "exit"}                                       -> exits 0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import torch
from kvtier.worker.engine_kv import KVRegistration, shared_kv_tensor

LAYOUTS = ("kvtier", "vllm", "fastdeploy")


def make_kv(deployment_id: str, rank: int, layout: str, device: str, *, layers: int,
            blocks: int, block_size: int, heads: int, head_dim: int,
            dtype: torch.dtype = torch.float16) -> Any:
    """The KV of one rank in `layout`: in shared memory on the CPU, plain tensors on CUDA."""
    def alloc(shape: tuple[int, ...], tag: str) -> torch.Tensor:
        if device == "cpu":
            return shared_kv_tensor(deployment_id, rank, shape, dtype, tag=tag)
        return torch.zeros(shape, dtype=dtype, device=device)

    if layout == "kvtier":
        return alloc((layers, 2, blocks, block_size, heads, head_dim), "kv")
    if layout == "vllm":
        return [alloc((2, blocks, block_size, heads, head_dim), f"l{i}") for i in range(layers)]
    if layout == "fastdeploy":
        return [(alloc((blocks, heads, block_size, head_dim), f"k{i}"),
                 alloc((blocks, heads, block_size, head_dim), f"v{i}")) for i in range(layers)]
    raise ValueError(f"unknown layout {layout!r}")


class RunnerKV:
    """Every rank's KV in one layout, registered (`regs[rank]`)."""

    def __init__(self, deployment_id: str, ranks: int, layout: str, device: str = "cpu", *,
                 layers: int = 3, blocks: int = 16, block_size: int = 4, heads: int = 2,
                 head_dim: int = 8) -> None:
        self.deployment_id, self.layout, self.device = deployment_id, layout, device
        self.geometry = {"layers": layers, "blocks": blocks, "block_size": block_size,
                         "heads": heads, "head_dim": head_dim}
        self.regs: list[KVRegistration] = []
        self.kvs: list[Any] = []  # each rank's tensors, in the layout's own structure
        try:
            for rank in range(ranks):
                self.regs.append(self.register(rank))
        except BaseException:
            self.close()
            raise

    def register(self, rank: int) -> KVRegistration:
        """Fresh (zeroed) KV for `rank`, registered."""
        g = self.geometry
        kv = make_kv(self.deployment_id, rank, self.layout, self.device, **g)
        if rank < len(self.kvs):
            self.kvs[rank] = kv
        else:
            self.kvs.append(kv)
        return KVRegistration(self.deployment_id, rank, kv, self.layout,  # type: ignore[arg-type]
                              block_size=g["block_size"], num_kv_heads=g["heads"],
                              head_dim=g["head_dim"])

    def reregister(self, rank: int) -> None:
        self.regs[rank].close()
        self.regs[rank] = self.register(rank)

    def write(self, rank: int, ids: list[int], seed: int) -> None:
        """Seeded random bytes into blocks `ids` of every plane (each plane differently)."""
        gen = torch.Generator().manual_seed(seed)
        for plane in self.regs[rank].planes:
            raw = plane.view(torch.uint8)
            data = torch.randint(0, 256, (len(ids), raw.shape[1]), generator=gen,
                                 dtype=torch.uint8)
            raw[torch.tensor(ids, device=raw.device)] = data.to(raw.device)
        if raw.device.type == "cuda":
            torch.cuda.synchronize(raw.device)  # the worker reads it from another process

    def digests(self, rank: int, ids: list[int]) -> list[list[str]]:
        """Per block of `ids`, per plane (layer 0 K, layer 0 V, ...), a digest of its bytes."""
        planes = [p.view(torch.uint8)[torch.tensor(ids, device=p.device)].cpu()
                  for p in self.regs[rank].planes]
        return [[hashlib.sha256(p[i].numpy().tobytes()).hexdigest()[:16] for p in planes]
                for i in range(len(ids))]

    def close(self) -> None:
        for reg in self.regs:
            reg.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deployment", required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layout", choices=LAYOUTS, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=8)
    a = ap.parse_args()
    runner = RunnerKV(a.deployment, a.ranks, a.layout, a.device, layers=a.layers,
                      blocks=a.blocks, block_size=a.block_size, heads=a.heads,
                      head_dim=a.head_dim)

    def reply(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "write":
                runner.write(cmd["rank"], cmd["ids"], cmd["seed"])
                reply({"ok": True})
            elif cmd["op"] == "digest":
                reply({"digests": runner.digests(cmd["rank"], cmd["ids"])})
            elif cmd["op"] == "close":
                runner.close()
                reply({"ok": True})
            elif cmd["op"] == "exit":
                break
            else:
                reply({"error": f"unknown op {cmd['op']!r}"})
        except Exception as e:  # the test sees the error instead of a dead pipe
            reply({"error": f"{type(e).__name__}: {e}"})
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
