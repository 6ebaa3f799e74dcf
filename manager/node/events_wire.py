"""The KV-event wire format the node service publishes: the one module that encodes it.

Routers (Dynamo's KV indexer, vllm-router) read vLLM's KV events. `kvtier serve` speaks the
same bytes so they read a node's host tier and storage like one more vLLM instance:

    ZMQ PUB, one multipart message per batch:
        topic     UTF-8, `topic_for(tier, namespace)`: host/<namespace> or storage/<namespace>
                  under the configured prefix
        seq       8 bytes, big-endian, unsigned: one counter per publisher, every topic
        payload   msgpack of `EventBatch` = [ts, [event, ...]] (an array; the optional
                  data-parallel rank is left out), each event a map tagged with its type
                  name: {"type": "BlockStored", "block_hashes": [...], ...}
    ZMQ ROUTER (replay): a request [identity, b"", start_seq (8 bytes big-endian)] is answered
        with [identity, b"", topic, seq, payload] for every batch still buffered whose seq is
        >= start_seq, then the end marker [identity, b"", b"", END_SEQ (-1, 8 bytes), b""].

vLLM 0.32's classes (`vllm.distributed.kv_events`) are msgspec Structs; the ones below have
the same names (the tag), fields, order and options, so the encoder writes the bytes vLLM's
own encoder would (tests/test_node_events.py decodes them with vLLM's `KVEventBatch`
decoder). kvtier's own environment has no vLLM, hence the copies of the shapes only.

Media and locality (strings as vLLM defines them): the host tier is `CPU`, `LOCAL` (the
node's own memory); storage is `STORAGE`, `LOCAL` for files on this node and `REMOTE` for a
store other nodes share (Redis, Redis Cluster).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
HOST_TIER = "host"
STORAGE_TIER = "storage"


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One event; encoded as a map whose "type" is the class name."""


class BlockStored(KVCacheEvent):
    """Blocks (chained hashes, parent first) that became servable on `medium`. Fields without
    a default are always written (vLLM's decoder requires them)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks that stopped being servable on `medium`."""

    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher is gone (vLLM sends it on a prefix-cache reset)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A batch: wall-clock `ts` and the events in order."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


Event = BlockStored | BlockRemoved | AllBlocksCleared

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(type=EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """A payload back into a batch (msgspec.DecodeError / ValidationError when it is not one)."""
    return _DECODER.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """The sequence number an 8-byte frame carries (-1: the replay end marker)."""
    if len(frame) != 8:
        raise ValueError(f"a sequence frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)


def topic_for(prefix: str, tier: str, namespace: str) -> bytes:
    """The topic of one namespace's tier: `<prefix>/host/<namespace>` (the host tier its
    engines share on this node) or `<prefix>/storage/<namespace>` (its pages in storage)."""
    return f"{prefix}/{tier}/{namespace}".encode()
