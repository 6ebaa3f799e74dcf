"""A tiny decoder whose KV cache lives in kvtier's pools, served from every tier.

The model plays an engine's model runner. For each request it asks kvtier's scheduler API
which prefix is cached (`match`), gets device blocks for the rest (`allocate`), computes only
the uncached tokens -- reading the cached prefix's K and V from the device pool blocks and
writing the new tokens' K and V into their blocks -- then publishes the result (`commit`)
and lets go (`release`). The worker side runs in this process: `Stack(cfg, embedded=True)`
builds the manager, its storage tier and every rank's pools (`kvtier.worker.embedded`) from
one configuration.

It checks that the logits computed with a prefix served from the device, the host and the
storage tier equal those computed from scratch. Run it from the repository root:

    python examples/tiny_attention.py
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from kvtier.manager.config import KvtierConfig
from kvtier.manager.errors import TransferFailedError
from kvtier.manager.scheduler import KVCacheManager, MatchResult
from kvtier.manager.stack import Stack
from kvtier.worker.embedded import EmbeddedWorkers

VOCAB, D_MODEL, HEADS, HEAD_DIM, LAYERS, MAX_LEN = 64, 32, 4, 8, 2, 64
BLOCK = 4  # tokens per KV block


class TinyDecoder:
    """Token + position embedding, LAYERS pre-norm causal self-attention layers, unembedding.
    Weights are fixed by a seed, so every run computes the same numbers."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, generator=g) / rows**0.5

        self.embed, self.pos = weight(VOCAB, D_MODEL), weight(MAX_LEN, D_MODEL)
        self.layers = [{p: weight(D_MODEL, D_MODEL) for p in "qkvo"} for _ in range(LAYERS)]
        self.unembed = weight(D_MODEL, VOCAB)

    @torch.no_grad()
    def forward(self, tokens: Sequence[int], start: int, k_caches: Sequence[torch.Tensor],
                v_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Logits of `tokens[start:]`. Token i's K and V live at row `slots[i]` of each layer's
        cache (viewed as [rows, HEADS, HEAD_DIM]): rows of tokens before `start` are read,
        rows of the others are written."""
        n = len(tokens)
        pos = torch.arange(start, n)
        x = self.embed[list(tokens[start:])] + self.pos[pos]
        causal = pos[:, None] >= torch.arange(n)[None, :]  # query i sees tokens 0..i
        for layer, w in enumerate(self.layers):
            h = F.layer_norm(x, (D_MODEL,))
            q, k, v = ((h @ w[p]).view(-1, HEADS, HEAD_DIM) for p in "qkv")
            k_rows = k_caches[layer].view(-1, HEADS, HEAD_DIM)
            v_rows = v_caches[layer].view(-1, HEADS, HEAD_DIM)
            k_rows[slots[start:]], v_rows[slots[start:]] = k, v
            keys, values = k_rows[slots], v_rows[slots]  # the whole sequence, [n, H, D]
            scores = torch.einsum("qhd,khd->hqk", q, keys) / HEAD_DIM**0.5
            attn = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", attn, values).reshape(-1, D_MODEL) @ w["o"]
        return F.layer_norm(x, (D_MODEL,)) @ self.unembed

    def from_scratch(self, tokens: Sequence[int]) -> torch.Tensor:
        """Every token's logits with private, unpaged K/V tensors: the reference."""
        caches = [torch.zeros(len(tokens), HEADS, HEAD_DIM) for _ in range(2 * LAYERS)]
        return self.forward(tokens, 0, caches[:LAYERS], caches[LAYERS:],
                            torch.arange(len(tokens)))


def serve(manager: KVCacheManager, workers: EmbeddedWorkers, model: TinyDecoder,
          request_id: str, tokens: list[int]) -> tuple[MatchResult, int, torch.Tensor]:
    """One request through the scheduler API; returns the match, the number of cached
    tokens used and the logits of the tokens computed."""
    match = manager.match(request_id, tokens)
    try:
        cached = match.num_tokens
        try:
            match.handle.wait()  # host/storage hits: their loads to the device pool
        except TransferFailedError as e:  # a load failed: recompute from the last good token
            cached = e.valid_tokens
        # A runner overlapping loads with compute calls match.handle.wait_layer(layer)
        # before each layer instead; here the loads are complete when match returns.
        blocks = match.block_ids + manager.allocate(request_id, len(tokens) - match.num_tokens)
        slots = torch.tensor([blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(tokens))])
        pool = workers.device_pool()
        logits = model.forward(tokens, cached, pool.k_caches, pool.v_caches, slots)
        manager.commit(request_id, tokens, len(tokens))
    finally:
        manager.release(request_id)
    return match, cached, logits


def config(storage_dir: str) -> KvtierConfig:
    """Pools with room for 8 blocks on the device and 32 on the host, file storage under
    `storage_dir`; write_through copies every committed block to host and storage."""
    return KvtierConfig(
        deployment_id=f"tinyattn-{os.getpid()}",
        model={"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": HEAD_DIM,
               "dtype": "float32"},
        cache={"block_size": BLOCK, "device_blocks": 8, "host_blocks": 32,
               "write_policy": "write_through", "decode_reserve_blocks": 0},
        storage={"backend": "file", "path": storage_dir, "prefetch_policy": "wait_complete",
                 "prefetch_threshold": BLOCK},
        workers={"device": "cpu"})


def report(label: str, tier: str | None, served: tuple[MatchResult, int, torch.Tensor],
           reference: torch.Tensor) -> int:
    """Check that `tier` served the prefix and the logits equal the reference; print a line.
    Returns the tokens `tier` served. Raises AssertionError (also under `python -O`)."""
    match, cached, logits = served
    hit = getattr(match, f"{tier}_tokens") if tier else 0
    if tier and hit <= 0:
        raise AssertionError(f"{label}: the {tier} tier served nothing ({match})")
    diff = (logits - reference[cached:]).abs().max().item()
    if not torch.allclose(logits, reference[cached:], atol=1e-5):
        raise AssertionError(f"{label}: logits differ from scratch by up to {diff:.3g}")
    print(f"{label:<12}: {len(reference) - cached} tokens computed, {cached} cached (device "
          f"{match.device_tokens}, host {match.host_tokens}, storage {match.storage_tokens}), "
          f"max |logit diff| {diff:.1e}")
    return hit


def main() -> int:
    model = TinyDecoder()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(VOCAB, (22,), generator=g).tolist()  # 5 full blocks + 2 tokens
    other = torch.randint(VOCAB, (30,), generator=g).tolist()  # needs all 8 device blocks
    reference = model.from_scratch(prompt)
    print(f"{'from scratch':<12}: {len(prompt)} tokens computed")
    with (tempfile.TemporaryDirectory(prefix="kvtier-example-") as tmp,
          Stack(config(tmp), embedded=True) as stack):  # manager + storage tier + pools
        manager, workers = stack.require_manager(), stack.require_workers()
        hits: dict[str, int] = {}
        report("cold", None, serve(manager, workers, model, "r1", prompt), reference)
        hits["device"] = report("device hit", "device",
                                serve(manager, workers, model, "r2", prompt), reference)
        # Another prompt takes every device block, so the prefix leaves the device; the
        # host keeps the copy write_through made at commit.
        serve(manager, workers, model, "other", other)
        hits["host"] = report("host hit", "host",
                              serve(manager, workers, model, "r3", prompt), reference)
        # Forget what the device and host tiers hold, and wipe their bytes too: only the
        # pages backed up to storage can serve the prefix now.
        manager.reset()
        workers.device_pool().data.zero_()
        host = workers.host_pool()
        if host is not None:
            host.data.zero_()
        hits["storage"] = report("storage hit", "storage",
                                 serve(manager, workers, model, "r4", prompt), reference)
    print(f"ok: prefix served from device ({hits['device']} tokens), host ({hits['host']}) "
          f"and storage ({hits['storage']}); every output equals the from-scratch one")
    return 0


if __name__ == "__main__":
    sys.exit(main())
