"""Block keys: what names a cached block, stable across processes and machines.

A block is `block_size` consecutive tokens. Its key chains three things: the parent block's
key, the block's own token ids, and the content hashes of multimodal items that overlap the
block. Equal keys therefore mean equal whole prefixes, which is what lets the prefix tree be a
flat map from key to node.

Two key families, because they serve different readers:

* **Tree keys** (`chain_keys`): 128-bit integers from xxh3-128, used only inside one manager.
  Speed matters (every prompt block of every request is hashed); 128 bits keep accidental
  collisions out of reach at any realistic cache size. Chaining: the parent key's low 64 bits
  seed the hash of the block's bytes and its high 64 bits are folded into the result, so two
  different parents never give the same child even if their low halves agree.
* **Storage keys** (`storage_keys`): SHA-256 digests, computed only where the storage tier is
  involved. Pages in a shared store are read by other manager instances, so their names must
  be collision-resistant against anyone who can choose prompts.

Both encode tokens canonically as little-endian int32, never Python `hash()` or pickle, so any
process on any machine computes the same keys. Token ids must fit in int32.

Tree keys of plain int token lists are computed by the compiled `kvtier.manager._native` when
it is built (`kvtier.manager.core.native`), with the xxhash package's own xxh3-128: the same keys as
the Python code below, which handles everything else (multimodal blocks, other sequences, and
the errors).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import xxhash
from kvtier.manager.core import native
from kvtier.manager.errors import KvtierError

_MASK64 = (1 << 64) - 1
_XXH128 = xxhash.xxh3_128_intdigest
_PACKERS: dict[int, struct.Struct] = {}
_SPLITTERS: dict[tuple[int, int, int], struct.Struct] = {}
_CACHE_LIMIT = 4096
_MIN_SPLIT_BLOCKS = 8
"""From this many blocks on, a request's bytes are cut into per-block `bytes` by one
`Struct.unpack` call (~20 ns a block) instead of a memoryview slice per block (~130 ns)."""


def _cached_struct(cache: dict[Any, struct.Struct], key: Any, fmt: str) -> struct.Struct:
    """A compiled Struct from a bounded cache (cleared when full: request lengths vary)."""
    compiled = cache.get(key)
    if compiled is None:
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        compiled = cache[key] = struct.Struct(fmt)
    return compiled


MAX_CONTENT_HASH_BYTES = 0xFFFF
"""A multimodal item's content hash is encoded after its length in 2 bytes (see storage_keys)."""


class TokenKeyError(KvtierError, ValueError):
    """Token ids or multimodal items that cannot be turned into keys."""


@dataclass(frozen=True, slots=True)
class ExtraKey:
    """Content hash of a multimodal item occupying tokens [offset, offset + length).

    The item belongs to every block it overlaps. An item that ends exactly where a block
    starts does not overlap it.
    """

    offset: int
    length: int
    content_hash: bytes

    def __post_init__(self) -> None:
        if (not isinstance(self.offset, int) or not isinstance(self.length, int)
                or self.offset < 0 or self.length <= 0):
            raise TokenKeyError(
                f"extra_keys item {self!r}: offset must be >= 0 and length > 0 (token counts)")
        if not isinstance(self.content_hash, bytes) or not self.content_hash:
            raise TokenKeyError(f"extra_keys item {self!r}: content_hash must be non-empty bytes")
        if len(self.content_hash) > MAX_CONTENT_HASH_BYTES:
            raise TokenKeyError(
                f"extra_keys item at offset {self.offset}: content_hash is "
                f"{len(self.content_hash)} bytes; at most {MAX_CONTENT_HASH_BYTES} (its length "
                "is encoded in 2 bytes)")

    @classmethod
    def coerce(cls, item: object) -> ExtraKey:
        """Accept an ExtraKey or an (offset, length, hash) tuple; hash as bytes, hex str or int."""
        if isinstance(item, ExtraKey):
            return item
        fields: Any = item  # any 3-item iterable; the fields are checked below and in __post_init__
        try:
            offset, length, digest = fields
        except (TypeError, ValueError):
            raise TokenKeyError(
                f"extra_keys item {item!r}: expected (offset, length, content_hash)"
            ) from None
        if isinstance(digest, str):
            digest = digest.encode()
        elif isinstance(digest, int) and not isinstance(digest, bool):
            if digest < 0:
                raise TokenKeyError(f"extra_keys item {item!r}: an int content_hash must be >= 0")
            digest = digest.to_bytes((max(digest.bit_length(), 1) + 7) // 8, "little")
        if not isinstance(digest, bytes | bytearray) or not digest:
            raise TokenKeyError(f"extra_keys item {item!r}: content_hash must be non-empty")
        return cls(offset, length, bytes(digest))


def pack_tokens(token_ids: Sequence[int], count: int) -> bytes:
    """The first `count` token ids as little-endian int32 bytes (one C call for the lot)."""
    packer = _cached_struct(_PACKERS, count, f"<{count}i")
    try:
        if isinstance(token_ids, list | tuple):
            return packer.pack(*token_ids[:count])
        return packer.pack(*(int(t) for t in token_ids[:count]))
    except (struct.error, TypeError, ValueError):
        for i, t in enumerate(token_ids[:count]):
            if isinstance(t, bool) or (not isinstance(t, int) and not hasattr(t, "__index__")):
                raise TokenKeyError(f"token id {t!r} at position {i} is not an integer") from None
            if not -(2**31) <= int(t) < 2**31:
                raise TokenKeyError(
                    f"token id {t!r} at position {i} does not fit in int32") from None
        raise


def _extra_bytes_per_block(
    extra_keys: Sequence[object], block_size: int, first: int, last: int
) -> dict[int, bytes]:
    """Concatenated content hashes of the items overlapping each block index in [first, last)."""
    out: dict[int, bytes] = {}
    items = sorted(
        (ExtraKey.coerce(e) for e in extra_keys), key=lambda e: (e.offset, e.content_hash)
    )
    for item in items:
        end = item.offset + item.length
        lo = max(first, item.offset // block_size)
        hi = min(last, (end - 1) // block_size + 1)
        for b in range(lo, hi):
            out[b] = out.get(b, b"") + len(item.content_hash).to_bytes(2, "little") + (
                item.content_hash
            )
    return out


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int = 0,
    start_block: int = 0,
    num_blocks: int | None = None,
    extra_keys: Sequence[object] | None = None,
) -> list[int]:
    """Tree keys of blocks `start_block ..` of `token_ids` (full blocks only).

    `parent` is the key of block `start_block - 1` (0 for the first block), so a request's
    keys can be extended as it grows without rehashing what it has.
    """
    full = len(token_ids) // block_size
    end = full if num_blocks is None else min(full, start_block + num_blocks)
    if extra_keys:  # validated even when no block is full yet
        extra_keys = [ExtraKey.coerce(e) for e in extra_keys]
    if end <= start_block:
        return []
    if native.chain_keys is not None and not extra_keys:
        keys = native.chain_keys(token_ids, block_size, parent, start_block, end)
        if keys is not None:  # None: input only the Python path below handles (or rejects)
            return keys
    step = block_size * 4
    buf = memoryview(pack_tokens(token_ids, end * block_size))
    out: list[int] = []
    append = out.append
    p = parent
    h = _XXH128
    if extra_keys:
        extra = _extra_bytes_per_block(extra_keys, block_size, start_block, end)
        for b in range(start_block, end):
            data: memoryview | bytes = buf[b * step : (b + 1) * step]
            if b in extra:
                data = bytes(data) + b"\x00mm" + extra[b]
            p = h(data, p & _MASK64) ^ (p >> 64)
            append(p)
        return out
    # One comprehension (no per-block method call): each key folds in the previous one. The
    # seed argument takes the low 64 bits of `p` by itself (xxhash parses it as an unsigned
    # long long without overflow check; the golden-key tests would catch a change).
    count = end - start_block
    if count >= _MIN_SPLIT_BLOCKS:
        skip = start_block * step
        split = _cached_struct(_SPLITTERS, (skip, count, step),
                               (f"{skip}x" if skip else "") + f"{step}s" * count)
        return [p := h(chunk, p) ^ (p >> 64) for chunk in split.unpack_from(buf)]
    return [p := h(buf[a : a + step], p) ^ (p >> 64)
            for a in range(start_block * step, end * step, step)]


def keyed_storage_key(namespace: bytes, block_hash: bytes) -> bytes:
    """The page name in storage of an engine's block `block_hash` (the key-addressed surface,
    `kvtier.manager.keyed`): SHA-256 over the namespace and the hash. The one formula: the
    keyed cache names its pages with it, and an attached engine's client answers
    `storage_key` with it (the same pages, whichever home asks)."""
    return hashlib.sha256(namespace + block_hash).digest()


def storage_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: bytes = b"",
    start_block: int = 0,
    num_blocks: int | None = None,
    extra_keys: Sequence[object] | None = None,
) -> list[bytes]:
    """SHA-256 storage keys of blocks `start_block ..`, chained from `parent` (b"" at the root).

    Canonical encoding of one block: parent digest (32 bytes, or empty at the root), the
    block's tokens as little-endian int32, then, when multimodal items overlap the block, the
    marker b"\x00mm" and for each item (sorted by offset, then hash) its hash length (2 bytes
    LE) and hash. Any instance on any machine computes the same digest.
    """
    full = len(token_ids) // block_size
    end = full if num_blocks is None else min(full, start_block + num_blocks)
    if end <= start_block:
        return []
    step = block_size * 4
    buf = memoryview(pack_tokens(token_ids, end * block_size))
    extra = (
        _extra_bytes_per_block(extra_keys, block_size, start_block, end) if extra_keys else {}
    )
    out: list[bytes] = []
    p = parent
    for b in range(start_block, end):
        h = hashlib.sha256(p)
        h.update(buf[b * step : (b + 1) * step])
        if b in extra:
            h.update(b"\x00mm")
            h.update(extra[b])
        p = h.digest()
        out.append(p)
    return out


def key_bytes(key: int) -> bytes:
    """A tree key as 16 bytes (for diagnostic fills that derive content from the key)."""
    return key.to_bytes(16, "little")


ENGINE_HASH_ALGOS = ("sha256",)


class BlockNaming(NamedTuple):
    """How an engine names its blocks from token ids: its hash algorithm (vLLM's
    `prefix_caching_hash_algo`), its seed (the 64 hex digits of its NONE_HASH, or the seed
    string NONE_HASH is the hash of), its tokens per block hash (vLLM's `hash_block_size`:
    token ids name kvtier's blocks only where it equals kvtier's block size) and its KV cache
    groups (a hybrid model keys each block per group: token ids name none of them)."""

    algo: str
    seed: str
    hash_block_size: int
    kv_groups: int = 1


def engine_block_hashes(algo: str, seed: str, block_size: int, token_ids: Sequence[int],
                        cache_salt: str | None = None) -> list[bytes]:
    """The block hashes a vLLM engine of the keyed surface gives the full blocks of a prompt
    (issue 36: lookup, retain, warm and clear by token ids name exactly the blocks the
    engines stored): vLLM's chained `hash_block_tokens` with its "sha256" algorithm, SHA-256
    of the pickled tuple (parent hash, block's token ids, extra keys), the request's
    `cache_salt` as the first block's one extra key. `seed` is the namespace's hash seed as
    the engine announced it: the 64 hex digits of its NONE_HASH, or the seed string NONE_HASH
    is the hash of. Pickling here encodes only bytes, ints, strings and tuples (never an
    unpickle). Another algorithm is refused in one line (a lookup must never answer with
    keys the engines do not use)."""
    import pickle

    if algo not in ENGINE_HASH_ALGOS:
        raise TokenKeyError(f"hash algorithm {algo!r}: token-id steering supports "
                            f"{list(ENGINE_HASH_ALGOS)} (the engine's prefix_caching_hash_algo)")
    if len(seed) == 64 and all(c in "0123456789abcdef" for c in seed):
        parent = bytes.fromhex(seed)
    else:
        parent = hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).digest()
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        toks = tuple(token_ids[i * block_size:(i + 1) * block_size])
        extra = (("cache_salt", cache_salt),) if i == 0 and cache_salt else None
        parent = hashlib.sha256(pickle.dumps((parent, toks, extra),
                                             protocol=pickle.HIGHEST_PROTOCOL)).digest()
        out.append(parent)
    return out
