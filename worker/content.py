"""Diagnostic block content: bytes derived from a block's content key, for verification.

`kvtier replay --verify` and the tests act as the model runner: they `fill` every newly
computed block with bytes derived from (content key, rank, layer, K/V) and later `check` that a
block served from any tier still holds exactly those bytes. So the bytes must

* differ between keys, ranks, layers and K vs V, at every position of the block (every byte of
  K and V is compared, so a block copied only in part, or a layer or a half swapped, shows);
* be cheap enough to write and compare for every block of a replay (> 1 GB/s).

Construction: a row (one block of one layer's K or V) of key `k` on rank `r`, layer `l`, half
`h` (K or V) is `base(k, r) XOR mask(l, h)`. `base` is one SHAKE-128 stream per key as long as
a row; `mask` is a fixed SHAKE stream per pool shape (cached), different for every (layer,
half) and position. So one hash call per block, then a single broadcast XOR per chunk with long
contiguous inner loops, on the pool's own device. SHAKE (not a torch RNG) keeps the bytes
identical across processes, machines and library versions.

Scales (`shape.kv_scales`): a block's scales (float32 `[layers * 2, num_kv_heads]`) are one
more SHAKE-128 stream of (rank, key) under another domain, as long as all of them, written as
raw 32-bit words (so every bit pattern, NaN payloads included, must come back) and compared
word for word with the K and V: a block whose scales were lost, swapped or left stale fails.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from kvtier.worker.kv_pools import (
    BlockIdError,
    DevicePool,
    HostPool,
    KVShape,
    PlanePool,
    as_block_ids,
)

CHUNK_BYTES = 8 << 20  # bound on the temporary tensors of one step (stays in cache)
_WORDS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)
_masks: dict[tuple[KVShape, torch.dtype, torch.device], torch.Tensor] = {}

Pool = DevicePool | HostPool | PlanePool


def _word_dtype(row_bytes: int) -> torch.dtype:
    """Widest integer dtype dividing a row: fewer, wider elements per XOR and compare."""
    for size, dtype in _WORDS:
        if row_bytes % size == 0:
            return dtype
    raise AssertionError("unreachable: every size is a multiple of 1")


def _mask(shape: KVShape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[layers * 2, row_words]`: the fixed per-(layer, K/V, position) mask of a shape."""
    key = (shape, dtype, device)
    mask = _masks.get(key)
    if mask is None:
        seed = f"kvtier-mask:{shape.total_layers}:{shape.k_bytes}".encode()
        raw = bytearray(hashlib.shake_128(seed).digest(shape.total_layers * 2 * shape.k_bytes))
        mask = torch.frombuffer(raw, dtype=torch.uint8).view(dtype)
        mask = mask.view(shape.total_layers * 2, -1).to(device)
        _masks[key] = mask
    return mask


def _bases(keys: Sequence[bytes], rank: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """`[n, row_words]`: one SHAKE-128 stream of (rank, key) per key, a row long."""
    prefix = b"kvtier-content\0" + rank.to_bytes(4, "little")
    buf = bytearray()
    for key in keys:
        h = hashlib.shake_128(prefix)
        h.update(len(key).to_bytes(4, "little"))
        h.update(key)
        buf += h.digest(row_bytes)
    if not buf:
        return torch.empty(0, row_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(len(keys), -1)


class _PlaneRows:
    """A `PlanePool` (an engine's KV) seen as rows of words: one view `[blocks, words]` per
    plane, read and written plane by plane. Same interface as `_Rows`."""

    def __init__(self, pool: PlanePool) -> None:
        self.dtype, self.planes = _plane_words(pool)
        self.device = pool.device
        self.words = pool.shape.k_bytes // torch.empty((), dtype=self.dtype).element_size()

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        view = out.view(len(self.planes), ids.numel(), -1)
        for p, plane in enumerate(self.planes):
            torch.index_select(plane, 0, ids, out=view[p])
        return view

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        for p, plane in enumerate(self.planes):
            plane.index_copy_(0, ids, rows[p])

    def scratch(self, step: int) -> torch.Tensor:
        return torch.empty(len(self.planes) * self.words * step, dtype=self.dtype,
                           device=self.device)


def _plane_words(pool: PlanePool) -> tuple[torch.dtype, list[torch.Tensor]]:
    """The widest word dtype dividing a row that every plane can be viewed as."""
    for size, dtype in _WORDS:
        if pool.shape.k_bytes % size:
            continue
        try:
            return dtype, [p.view(dtype) for p in pool.planes]
        except RuntimeError:
            continue
    raise AssertionError("unreachable: every plane can be viewed as bytes")


class _Rows:
    """A pool seen as rows of words, in its own layout: the device pool as
    `[layers * 2, blocks, words]` (blocks on dim 1), the host pool as `[blocks, layers * 2,
    words]` (blocks on dim 0). Both are views: writes land in the pool."""

    def __init__(self, pool: DevicePool | HostPool) -> None:
        shape = pool.shape
        self.dtype = _word_dtype(shape.k_bytes)
        rows = shape.total_layers * 2
        if isinstance(pool, DevicePool):
            flat = pool.data.view(rows, pool.num_blocks, -1)
            self.dim = 1
        else:
            flat = pool.kv.view(pool.num_blocks, rows, -1)
            self.dim = 0
        self.t = flat.view(self.dtype)
        self.device = self.t.device

    def read(self, ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rows of blocks `ids`, copied into `out` (contiguous, `c * layers * 2 * words`
        elements), returned as `[layers * 2, c, words]`."""
        if self.dim == 1:
            view = out.view(self.t.shape[0], ids.numel(), -1)
            return torch.index_select(self.t, 1, ids, out=view)
        view = out.view(ids.numel(), self.t.shape[1], -1)
        return torch.index_select(self.t, 0, ids, out=view).transpose(0, 1)

    def write(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Store `[layers * 2, c, words]` into blocks `ids`."""
        self.t.index_copy_(self.dim, ids, rows if self.dim == 1 else rows.transpose(0, 1))

    def scratch(self, step: int) -> torch.Tensor:
        """One reusable buffer for a call: a fresh large tensor per chunk would pay its page
        faults every time, which costs more than the XOR itself."""
        return torch.empty(self.t.numel() // self.t.shape[self.dim] * step, dtype=self.dtype,
                           device=self.device)


def _rows(pool: Pool) -> _Rows | _PlaneRows:
    return _PlaneRows(pool) if isinstance(pool, PlanePool) else _Rows(pool)


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


def _step(pool: Pool) -> int:
    return max(1, CHUNK_BYTES // pool.shape.page_bytes)


def _scale_words(keys: Sequence[bytes], rank: int, shape: KVShape) -> torch.Tensor:
    """`[n, layers * 2, num_kv_heads]` int32: the scales content of every key."""
    prefix = b"kvtier-scales\0" + rank.to_bytes(4, "little")
    planes, heads = shape.scale_planes, shape.num_kv_heads
    buf = bytearray()
    for key in keys:
        h = hashlib.shake_128(prefix)
        h.update(len(key).to_bytes(4, "little"))
        h.update(key)
        buf += h.digest(planes * heads * 4)
    if not buf:
        return torch.empty(0, planes, heads, dtype=torch.int32)
    return torch.frombuffer(buf, dtype=torch.int32).view(len(keys), planes, heads)


def _scale_planes(pool: Pool) -> list[torch.Tensor]:
    """The pool's scale planes as int32 words: `[blocks, num_kv_heads]` per plane."""
    if isinstance(pool, HostPool):
        assert pool.scales is not None
        host = pool.scales.view(torch.int32)
        return [host[:, p] for p in range(host.shape[1])]
    return [p.view(torch.int32) for p in pool.scale_planes]


def _fill_scales(pool: Pool, ids: torch.Tensor, keys: Sequence[bytes], rank: int) -> None:
    planes = _scale_planes(pool)
    words = _scale_words(keys, rank, pool.shape).to(_pool_device(pool))
    ids = ids.to(words.device)
    for p, plane in enumerate(planes):
        plane.index_copy_(0, ids, words[:, p])


def _check_scales(pool: Pool, ids: torch.Tensor, keys: Sequence[bytes], rank: int
                  ) -> torch.Tensor:
    """`[n]` bool: block `ids[i]`'s scales differ from those of `keys[i]`."""
    planes = _scale_planes(pool)
    words = _scale_words(keys, rank, pool.shape).to(_pool_device(pool))
    ids = ids.to(words.device)
    bad = torch.zeros(len(keys), dtype=torch.bool, device=words.device)
    for p, plane in enumerate(planes):
        bad |= (torch.index_select(plane, 0, ids) != words[:, p]).any(1)
    return bad.cpu()


def _pool_device(pool: Pool) -> torch.device:
    return pool.data.device if isinstance(pool, HostPool) else pool.device


def fill(
    pool: Pool, dev_ids: Sequence[int] | torch.Tensor, keys: Sequence[bytes], rank: int
) -> None:
    """Write the content derived from `keys[i]` (and `rank`) into block `dev_ids[i]`, every
    layer, K and V (and its scales, when the shape has them). Ids are validated (range, no
    duplicates) before anything is written. Works on a `DevicePool`, a `HostPool` or a
    `PlanePool` (an engine's KV)."""
    ids = _validate("fill", pool, dev_ids, keys, rank)
    rows = _rows(pool)
    mask = _mask(pool.shape, rows.dtype, rows.device)
    bases = _bases(keys, rank, pool.shape.k_bytes, rows.dtype).to(rows.device)
    ids = ids.to(rows.device)
    step = _step(pool)
    scratch = rows.scratch(min(step, max(1, len(keys))))
    for i in range(0, len(keys), step):
        base = bases[i : i + step]
        expected = scratch[: mask.numel() * base.shape[0]].view(mask.shape[0], base.shape[0], -1)
        torch.bitwise_xor(mask.unsqueeze(1), base.unsqueeze(0), out=expected)
        rows.write(ids[i : i + step], expected)
    if pool.shape.kv_scales:
        _fill_scales(pool, ids, keys, rank)


def check(
    pool: Pool, dev_ids: Sequence[int] | torch.Tensor, keys: Sequence[bytes], rank: int
) -> list[int]:
    """Indices `i` for which block `dev_ids[i]` does not hold exactly the content of
    `keys[i]` (on this `rank`); empty when everything matches."""
    ids = _validate("check", pool, dev_ids, keys, rank)
    rows = _rows(pool)
    mask = _mask(pool.shape, rows.dtype, rows.device)
    bases = _bases(keys, rank, pool.shape.k_bytes, rows.dtype).to(rows.device)
    ids = ids.to(rows.device)
    bad: list[torch.Tensor] = []
    step = _step(pool)
    scratch = rows.scratch(min(step, max(1, len(keys))))
    for i in range(0, len(keys), step):
        base = bases[i : i + step]
        actual = rows.read(ids[i : i + step], scratch[: mask.numel() * base.shape[0]])
        actual ^= mask.unsqueeze(1)
        actual ^= base.unsqueeze(0)  # now all zero in every row where the block is intact
        differs = torch.count_nonzero(actual, dim=2).any(0)
        bad.append(differs.nonzero().flatten().cpu() + i)
    if pool.shape.kv_scales and len(keys):
        bad.append(_check_scales(pool, ids, keys, rank).nonzero().flatten())
        return sorted(set(torch.cat(bad).tolist()))
    return torch.cat(bad).tolist() if bad else []
