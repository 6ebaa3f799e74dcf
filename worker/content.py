"""Diagnostic block content: bytes derived from a block's content key, for verification.

`kvtier replay --verify` and the tests act as the model runner: they `fill` every newly
computed block with bytes derived from (content key, rank, layer, K/V) and later `check` that a
block served from any tier still holds exactly those bytes. So the bytes must

* differ between keys, ranks, layers and K vs V, at every position of the block (every byte of
  K and V is compared, so a block copied only in part, or a layer or a half swapped, shows);
* be cheap enough to write and compare for every block of a replay (> 1 GB/s).

Construction: SHAKE-128 of (rank, key) gives 64 bytes per (layer, K/V). That short pattern is
tiled over the row with `repeat` and XORed with a fixed position word sequence, so a chunk of
the right pattern moved to the wrong offset inside a block does not match either. Everything
after the one hash per block is vectorised torch work on the pool's own device.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from worker.kv_pools import BlockIdError, DevicePool, HostPool, as_block_ids

PATTERN_BYTES = 512  # long enough that the XOR pass runs on whole vector registers
CHUNK_BYTES = 32 << 20  # bound on the temporary expected-content tensor per step
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)

# (bytes, torch word dtype, numpy dtype of the same bits)
_INT_DTYPES: tuple[tuple[int, torch.dtype, np.dtype], ...] = (
    (8, torch.int64, np.dtype(np.int64)),
    (4, torch.int32, np.dtype(np.int32)),
    (2, torch.int16, np.dtype(np.int16)),
    (1, torch.uint8, np.dtype(np.uint8)),
)
_positions: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

Pool = DevicePool | HostPool


def _word(row_bytes: int) -> tuple[int, torch.dtype, np.dtype]:
    for entry in _INT_DTYPES:
        if row_bytes % entry[0] == 0:
            return entry
    raise AssertionError("unreachable: every size is a multiple of 1")


def _layer_rows(pool: Pool) -> torch.Tensor:
    """The pool as `[layers, 2, blocks, row_words]` in the widest integer dtype dividing a
    row (one block of one layer's K or V). A view: writes go to the pool."""
    shape = pool.shape
    size, dtype, _ = _word(shape.k_bytes)
    words = shape.k_bytes // size
    if isinstance(pool, DevicePool):
        flat = pool.data.view(shape.num_layers, 2, pool.num_blocks, -1)
        return flat.view(dtype).view(shape.num_layers, 2, pool.num_blocks, words)
    flat = pool.kv.view(pool.num_blocks, shape.num_layers, 2, -1)
    return flat.view(dtype).view(pool.num_blocks, shape.num_layers, 2, words).permute(1, 2, 0, 3)


def _position_words(words: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Position words for a row, padded to a whole number of patterns."""
    per_pattern = PATTERN_BYTES // torch.empty((), dtype=dtype).element_size()
    words = -(-words // per_pattern) * per_pattern
    key = (words, dtype, device)
    pos = _positions.get(key)
    if pos is None:
        _, _, np_dtype = _word(torch.empty((), dtype=dtype).element_size())
        # Odd multiplier: distinct words per position; truncation keeps the low bits.
        full = np.arange(1, words + 1, dtype=np.uint64) * _GOLDEN
        narrow = full.astype(f"u{np_dtype.itemsize}").view(np_dtype)
        pos = torch.from_numpy(narrow).to(device)
        _positions[key] = pos
    return pos


def _patterns(keys: Sequence[bytes], rank: int, layers: int, dtype: torch.dtype) -> torch.Tensor:
    """`[layers, 2, n, PATTERN_BYTES / itemsize]` pattern words, one hash per key."""
    per_block = layers * 2 * PATTERN_BYTES
    prefix = b"kvtier-content\0" + rank.to_bytes(4, "little")
    buf = bytearray()
    for key in keys:
        h = hashlib.shake_128(prefix)
        h.update(len(key).to_bytes(4, "little"))
        h.update(key)
        buf += h.digest(per_block)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    words = PATTERN_BYTES // torch.empty((), dtype=dtype).element_size()
    return raw.view(dtype).view(len(keys), layers, 2, words).permute(1, 2, 0, 3).contiguous()


def _validate(
    op: str, pool: Pool, dev_ids: Sequence[int] | torch.Tensor, keys: Sequence[bytes], rank: int
) -> torch.Tensor:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**32:
        raise ValueError(f"{op}: rank must be an integer in [0, 2**32), got {rank!r}")
    try:
        n_ids = len(dev_ids)
    except TypeError:
        raise BlockIdError(f"{op}: block ids must be a sequence of integers") from None
    if n_ids != len(keys):
        raise BlockIdError(f"{op}: {n_ids} block ids but {len(keys)} keys")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray) or not key:
            raise ValueError(f"{op}: key {i} must be non-empty bytes, got {key!r:.40}")
    return as_block_ids(dev_ids, pool.num_blocks, f"{op}: block ids", unique=op == "fill")


def _expected(patterns: torch.Tensor, words: int, pos: torch.Tensor) -> torch.Tensor:
    """Expected rows `[L, 2, c, words]` from patterns `[L, 2, c, P]`: the pattern tiled over
    the row and XORed with the position words, in one broadcast pass (no repeat copy)."""
    p = patterns.shape[-1]
    reps = pos.numel() // p
    tiled = patterns.unsqueeze(3) ^ pos.view(reps, p)  # [L, 2, c, reps, P]
    tiled = tiled.view(*patterns.shape[:3], reps * p)
    return tiled if reps * p == words else tiled[..., :words]


def _step(pool: Pool) -> int:
    return max(1, CHUNK_BYTES // pool.shape.page_bytes)


def fill(
    pool: Pool, dev_ids: Sequence[int] | torch.Tensor, keys: Sequence[bytes], rank: int
) -> None:
    """Write the content derived from `keys[i]` (and `rank`) into block `dev_ids[i]`, every
    layer, K and V. Ids are validated (range, no duplicates) before anything is written."""
    ids = _validate("fill", pool, dev_ids, keys, rank)
    rows = _layer_rows(pool)
    words, dtype, device = rows.shape[-1], rows.dtype, rows.device
    pos = _position_words(words, dtype, device)
    pats = _patterns(keys, rank, pool.shape.num_layers, dtype).to(device)
    ids = ids.to(device)
    step = _step(pool)
    for i in range(0, len(keys), step):
        exp = _expected(pats[:, :, i : i + step], words, pos)
        rows.index_copy_(2, ids[i : i + step], exp)


def check(
    pool: Pool, dev_ids: Sequence[int] | torch.Tensor, keys: Sequence[bytes], rank: int
) -> list[int]:
    """Indices `i` for which block `dev_ids[i]` does not hold exactly the content of
    `keys[i]` (on this `rank`); empty when everything matches."""
    ids = _validate("check", pool, dev_ids, keys, rank)
    rows = _layer_rows(pool)
    words, dtype, device = rows.shape[-1], rows.dtype, rows.device
    pos = _position_words(words, dtype, device)
    pats = _patterns(keys, rank, pool.shape.num_layers, dtype).to(device)
    ids = ids.to(device)
    bad: list[torch.Tensor] = []
    step = _step(pool)
    for i in range(0, len(keys), step):
        exp = _expected(pats[:, :, i : i + step], words, pos)  # [L, 2, c, words]
        actual = torch.index_select(rows, 2, ids[i : i + step])
        differs = (actual != exp).any(3).any(1).any(0)
        bad.append(differs.nonzero().flatten().cpu() + i)
    return torch.cat(bad).tolist() if bad else []
