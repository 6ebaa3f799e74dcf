"""vLLM's KV cache groups as kvtier serves them: a kind, a geometry and a key space per group.

vLLM puts layers with different attention specs in different KV cache groups (Gemma 2 / 3,
gpt-oss and Mistral-style models interleave sliding-window and full attention: a group of each;
hybrid Mamba / linear-attention models add state groups). Its offloading connector asks the
spec about every group's blocks separately: an `OffloadKey` is a block hash and a group id.

What vLLM's own offloading (0.32, `kv_connector/v1/offloading/scheduler.py`) does per kind,
which kvtier follows rather than second-guesses:

* **full attention**: a prefix lookup from the first block not on the device;
* **sliding window** (and chunked local attention): a lookup backwards from the hit boundary
  that needs only the last `window` blocks before it (`get_sliding_window_size_in_chunks`,
  one more when the window's edge falls inside a block). The hit is the minimum over the
  groups, looked up again until every group agrees, so a hit never comes from half a block set;
  a hit of a model with a sliding-window group stops one token short of the prompt. Only the
  window's blocks are loaded, and vLLM never asks to store a block outside every reachable
  window (its sliding-window blocks behind the window are freed: null blocks,
  `reachable_block_mask`);
* **Mamba (state) groups**: one state block at the hit boundary, which kvtier does not carry
  (`describe_groups` refuses the model, naming the group).

kvtier's part is here: each group's geometry from vLLM's KV cache spec, one key space per group
(`KVGroup.key`: the block hash under a BLAKE2b keyed by the group's tag, so one group's host
copies and storage pages never answer for another's), the `following` blocks a storage query
should count (the next blocks of a prefix; the window's earlier blocks, backwards), and the one
group whose blocks count hit tokens (every group loads a block for the same tokens).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.integrations.vllm.errors import VllmAdapterError

FULL = "full"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group vLLM offloads: `index` is its place in `OffloadingConfig.groups`,
    `group_id` vLLM's group id (the one in its `OffloadKey`s); `window_blocks` (sliding-window
    and chunked-local groups only) the most blocks before a hit boundary vLLM loads for it;
    `tag` the 16 bytes that make its keys its own."""

    index: int
    group_id: int
    kind: str
    spec_name: str
    layer_names: tuple[str, ...]
    tokens_per_block: int
    layer_bytes: int
    num_kv_heads: int
    head_dim: int
    window_tokens: int | None
    window_blocks: int | None
    tag: bytes

    @property
    def windowed(self) -> bool:
        return self.window_blocks is not None

    def key(self, block_hash: bytes) -> bytes:
        """This group's key for a vLLM block hash (about 2 us a key on this machine)."""
        return hashlib.blake2b(block_hash, digest_size=32, key=self.tag).digest()

    def identity(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "kind": self.kind, "spec": self.spec_name,
                "layers": list(self.layer_names), "tokens_per_block": self.tokens_per_block,
                "layer_bytes": self.layer_bytes, "window_tokens": self.window_tokens}


def _heads_and_dim(spec: Any, layer_bytes: int, block: int, itemsize: int) -> tuple[int, int]:
    heads, dim = int(spec.num_kv_heads), int(spec.head_size)
    if 2 * block * heads * dim * itemsize == layer_bytes:
        return heads, dim
    per_elem = 2 * block * itemsize  # K and V of other sizes, or packed: bytes, one "head"
    if layer_bytes % per_elem:
        raise VllmAdapterError(
            f"KV cache group layout: a page of {layer_bytes} bytes per layer is not K and V of "
            f"{block} tokens of {itemsize}-byte elements: a layout kvtier cannot copy")
    return 1, layer_bytes // per_elem


def _classify(group_id: int, spec: Any, names: Sequence[str]) -> tuple[str, Any]:
    """(kind, the per-layer attention spec) of a group, or a one-line refusal naming it."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    where = f"KV cache group {group_id} ({type(spec).__name__}, layers {shown})"
    if isinstance(spec, UniformTypeKVCacheSpecs):
        members = list(spec.kv_cache_specs.values())
        sizes = {int(m.page_size_bytes) for m in members}
        if members and all(isinstance(m, FullAttentionSpec) for m in members) and len(sizes) == 1:
            return FULL, members[0]
        raise VllmAdapterError(
            f"{where}: layers of different KV specs or page sizes in one group; kvtier copies "
            "one page geometry per group")
    if isinstance(spec, MambaSpec):
        raise VllmAdapterError(
            f"{where} holds recurrent state (Mamba / linear attention): kvtier offloads "
            "attention KV only, and vLLM serves an offloaded hit only when every group has "
            "one, so this model cannot use kvtier (run it without kv_transfer_config)")
    if isinstance(spec, SlidingWindowSpec):
        return SLIDING_WINDOW, spec
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return CHUNKED_LOCAL, spec
    if isinstance(spec, FullAttentionSpec):
        return FULL, spec
    what = "attention KV of a kind" if isinstance(spec, AttentionSpec) else "a cache"
    raise VllmAdapterError(f"{where}: {what} kvtier does not offload")


def _window_blocks(spec: Any, tokens_per_block: int) -> tuple[int | None, int | None]:
    """(window in tokens, the most blocks vLLM loads for it) of a windowed spec; None, None
    for full attention."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        get_sliding_window_size_in_chunks,
    )

    blocks = get_sliding_window_size_in_chunks(spec, tokens_per_block)
    if blocks is None:
        return None, None
    tokens: int = getattr(spec, "sliding_window", 0) or getattr(spec, "attention_chunk_size", 0)
    # vLLM looks for one block more when the hit boundary is not block-aligned
    # (GroupOffloadConfig.load_window_size_in_chunks)
    return int(tokens), int(blocks) + 1


def describe_groups(offloading: Any, kv_cache_config: Any, itemsize: int) -> list[KVGroup]:
    """kvtier's view of every group vLLM offloads (`offloading`: vLLM's `OffloadingConfig`,
    `kv_cache_config`: its `KVCacheConfig`). Raises VllmAdapterError naming the group when
    one cannot be served (a state group, another cache kind) or when the groups do not share
    one page geometry (kvtier's host pool has one page size)."""
    groups: list[KVGroup] = []
    for index, g in enumerate(offloading.groups):
        spec = kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec
        names = tuple(g.layer_names)
        kind, layer_spec = _classify(g.group_id, spec, names)
        block = int(g.tokens_per_block)
        layer_bytes = int(layer_spec.unpadded_page_size_bytes)
        heads, dim = _heads_and_dim(layer_spec, layer_bytes, block, itemsize)
        window_tokens, window_blocks = _window_blocks(layer_spec, block)
        ident = {"group_id": g.group_id, "kind": kind, "spec": type(spec).__name__,
                 "layers": list(names), "window_tokens": window_tokens}
        tag = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).digest()[:16]
        groups.append(KVGroup(index, int(g.group_id), kind, type(spec).__name__, names, block,
                              layer_bytes, heads, dim, window_tokens, window_blocks, tag))
    if not groups:
        raise VllmAdapterError("vLLM offloads no KV cache group")
    first = groups[0]
    for g in groups[1:]:
        for what, a, b in (("tokens per block", first.tokens_per_block, g.tokens_per_block),
                           ("bytes per layer and block", first.layer_bytes, g.layer_bytes)):
            if a != b:
                raise VllmAdapterError(
                    f"KV cache groups {first.group_id} and {g.group_id} differ in {what} "
                    f"({a} vs {b}): kvtier's host pool has one page geometry")
    return groups


def primary_group(groups: Sequence[KVGroup]) -> KVGroup:
    """The group whose loaded blocks count hit tokens: the first full-attention group (its
    blocks cover a hit from its first token), else the widest window."""
    for g in groups:
        if not g.windowed:
            return g
    return max(groups, key=lambda g: g.window_blocks or 0)
