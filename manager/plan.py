"""Capacity planning: the hit rate of every cache size from one pass over a request stream.

`kvtier plan` answers "how many device and host blocks does this traffic need, and what do
they buy?" without running `kvtier replay` once per size. LRU has the inclusion property
(Mattson et al., 1970): one pass that records the *stack distance* of each block access (how
many distinct blocks were used since, itself included) gives the hits of an LRU cache of every
size at once.

What the pass reproduces, exactly as `kvtier replay` drives the scheduler (one request at a
time, `match` -> `allocate` -> `commit` -> `release`, see manager/scheduler.py):

* Blocks are the full `block_size`-token blocks of a prompt, named by the chained tree keys of
  `kvtier.manager.keys.chain_keys` (the scheduler's own keys).
* A request looks up its first `limit = min((n - 1) // bs, n // bs)` blocks (at most all but
  one token is matched) and hits the longest cached prefix.
* The recency order is the device LRU list's: `release` appends the request's blocks tail
  first, so the LRU *stack* after request i holds its blocks n//bs - 1 .. 0 on top (block 0
  the most recent), then the older blocks in their order. Block j's distance at lookup is its
  1-based position in that stack; a prefix hits through block j when the largest distance of
  blocks 0..j (`prefix max`) is within what the cache holds.
* Eviction happens in `allocate`, while the request holds its hits and its new blocks: a
  device pool of D blocks keeps, between requests, the D - f most recent blocks, where
  f = 1 when the previous request's last block was partial (its device block is freed at
  release) and 0 otherwise. So with these requests' hits counted against D - f_prev, the
  device curve is exact for every D (two histograms, one for f_prev = 0 and one for 1).

When the curve is exact (`exact_from_device_blocks`): a prompt of an exact multiple of
`block_size` tokens never matches its last block (the cap above); if that block is cached
and survives the request's eviction (its distance d < D), `commit` keeps the cached node
untouched (a duplicate) and frees the request's copy; if not, the block is committed anew and
moves to the top. The pass takes the first case ("not touched") for such a *capped repeat*,
so the curve is exact for every D > the largest distance of a capped repeat, and everywhere
when there is none (the report counts them; the shared Mooncake trace and the chat workload
have none at 64-token blocks).

Device + host (`two_tier`): with `write_back` the tiers are exclusive (a block lives on one),
a device victim is demoted to the host's most-recent end and the eviction waits for the copy,
a host hit is loaded (its host copy freed) and joins the request: the union of both tiers is
always the most recent K blocks of the same stack, and `two_tier_hits` replays the pools'
block counts request by request (per candidate size, vectorised over sizes) to find K: exact
(`starved` sizes excepted: a host pool so small that a demotion finds no host block drops
the victim instead). `write_through` and `write_through_selective` are *not* exact: their
backups (D2H) complete asynchronously, a block is not evictable from the device while its
backup is in flight, and the host LRU follows backup completions and host loads, not device
hits, so the tiers' contents depend on worker timing. For them the report gives the
exclusive union (write_back's curve) as an estimate: no replay we ran exceeded it (chat, 250
requests, 70 device blocks: write_through 0.500 / 0.537 / 0.719 measured against 0.513 /
0.565 / 0.737 at 40 / 200 / 1,000 host blocks), but nothing proves it a bound. The only
proven bound is the achievable hit rate (an unbounded cache). The device-only curve is *not*
a lower bound for them: backups in flight pin blocks on the device (write_through measured
0.500 where the device alone gives 0.504 at 70 device blocks).

The offline reference (`offline_hit_blocks`): beside LRU, what a clairvoyant cache of the
same size would serve, Belady's rule with bypass over the same stream (see its doc for what
it bounds and why). It has no one-pass form here: one O(N log N) pass per size (a heap with
lazy deletion over precomputed next-use keys; about 0.5-0.9 s per size for the shared
trace's first 3,000 requests, 632,169 accesses), so the plan computes it on a coarser grid.

Cost: O(N log N) for N block accesses (a Fenwick tree over access times, its updates and
queries vectorised with numpy per request), memory linear in distinct blocks plus accesses.
The module is engine-agnostic and imports no plotting or terminal library.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from kvtier.manager.keys import chain_keys
from kvtier.manager.workloads import WorkRequest

I64 = npt.NDArray[np.int64]
INF = np.iinfo(np.int64).max // 4
"""Distance of a block never seen before (a miss at every size)."""
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
"""Fractions of the achievable hit rate the report sizes the tiers for."""


# ------------------------------------------------------------------ stack distances


class Fenwick:
    """A binary indexed tree of counts over access times 1..n (`tree[0]` is always 0).

    Invariant: the prefix sum up to time t is the number of blocks whose last access is at
    or before t. `add` and `prefix` take whole numpy index arrays: each of the ~log2(n)
    rounds is one numpy operation over the batch, which is what makes a pure-Python pass
    over a million accesses take seconds rather than a minute.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = np.zeros(n + 1, dtype=np.int64)

    def add(self, idx: I64, values: I64) -> None:
        """tree[t] += values[k] for each time t = idx[k] (1-based; duplicates add up)."""
        n = self.n
        tree = self.tree
        while idx.size:
            np.add.at(tree, idx, values)
            idx = idx + (idx & -idx)
            keep = idx <= n
            if not keep.all():
                idx = idx[keep]
                values = values[keep]

    def prefix(self, idx: I64) -> I64:
        """The sums over times 1..idx[k] (0 for idx 0)."""
        out = np.zeros(idx.shape, dtype=np.int64)
        tree = self.tree
        idx = idx.copy()
        while True:
            out += tree[idx]
            idx &= idx - 1
            if not idx.any():
                return out


@dataclass
class StackProfile:
    """What one pass over a request stream records, per request i (arrays of length R):

    * `tokens[i]` prompt length, `limit[i]` blocks it may match, `full[i]` its full blocks,
      `owned[i]` device blocks it allocates (ceil(tokens / bs)), `frees[i]` the `f` the
      cache keeps fewer blocks by after it (1: partial last block, or a capped repeat; -1: an
      empty prompt, which changes nothing).
    * `dist[start[i]:start[i] + limit[i]]`: the prefix maxima of its looked-up blocks'
      stack distances (nondecreasing; INF for a block never seen).
    * `capped_repeats`: the distances of capped repeats (see the module doc).
    """

    block_size: int
    tokens: I64
    limit: I64
    full: I64
    owned: I64
    frees: I64
    start: I64
    dist: I64
    accesses: int
    distinct_blocks: int
    capped_repeats: list[int] = field(default_factory=list)
    blocks: list[I64] = field(default_factory=list)
    """Request i's full blocks as dense ids, in order (what `offline_hit_blocks` reads)."""

    @property
    def requests(self) -> int:
        return int(self.tokens.size)

    @property
    def lookup_tokens(self) -> int:
        return int(self.tokens.sum())

    @property
    def min_device_blocks(self) -> int:
        """The smallest device pool replay accepts (a request holds all its blocks)."""
        return int(self.owned.max()) if self.owned.size else 1

    @property
    def exact_from_device_blocks(self) -> int:
        """Every device size from this one up is exact (1 without capped repeats)."""
        return max(self.capped_repeats, default=0) + 1

    def prev_frees(self) -> I64:
        """For each request, the `f` of the last earlier non-empty request (0 for the first)."""
        f = self.frees
        prev = np.zeros_like(f)
        last = 0
        for i in range(f.size):  # tiny: one int per request
            prev[i] = last
            if f[i] >= 0:
                last = int(f[i])
        return prev


def stack_profile(requests: Iterable[WorkRequest] | Iterable[Sequence[int]],
                  block_size: int) -> StackProfile:
    """One pass over `requests` (token lists or WorkRequests) in replay's order."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    bs = block_size
    ids: dict[int, int] = {}
    per_req: list[I64] = []
    lens: list[int] = []
    for r in requests:
        toks = r.tokens if isinstance(r, WorkRequest) else r
        keys = chain_keys(toks, bs)
        setdefault = ids.setdefault
        per_req.append(np.fromiter((setdefault(k, len(ids)) for k in keys),
                                   dtype=np.int64, count=len(keys)))
        lens.append(len(toks))
    return profile_from_ids(per_req, lens, bs, len(ids))


def profile_from_ids(per_req: Sequence[I64], lens: Sequence[int], block_size: int,
                     num_ids: int | None = None) -> StackProfile:
    """The pass itself, over requests given as dense block ids (request i's full blocks, in
    order) and prompt lengths. Separate from key hashing so tests and the benchmark can feed
    it directly."""
    bs = block_size
    r = len(per_req)
    tokens = np.asarray(lens, dtype=np.int64)
    full = np.array([a.size for a in per_req], dtype=np.int64)
    if r and not np.array_equal(full, tokens // bs):
        raise ValueError("each request needs exactly tokens // block_size block ids")
    limit = np.minimum(np.maximum(tokens - 1, 0) // bs, full)
    owned = -(-tokens // bs)
    frees = np.where(tokens == 0, -1, (tokens % bs != 0).astype(np.int64))
    start = np.zeros(r, dtype=np.int64)
    if r:
        start[1:] = np.cumsum(limit)[:-1]
    dist = np.empty(int(limit.sum()), dtype=np.int64)
    if num_ids is None:
        num_ids = int(max((int(a.max()) for a in per_req if a.size), default=-1)) + 1
    total = int(full.sum())
    fen = Fenwick(total)
    last = np.zeros(num_ids, dtype=np.int64)  # time of the last access, 0: never
    t = 0
    distinct = 0
    capped: list[int] = []
    for i in range(r):
        blocks = per_req[i]
        nf = blocks.size
        if not nf:
            continue
        lim = int(limit[i])
        s = int(start[i])
        if lim:
            lq = last[blocks[:lim]]
            seen = lq > 0
            d = np.full(lim, INF, dtype=np.int64)
            if seen.any():
                d[seen] = distinct - fen.prefix(lq[seen] - 1)
            np.maximum.accumulate(d, out=dist[s:s + lim])
        touch = blocks[::-1]
        if lim < nf:  # n % bs == 0: the last block is never matched
            leaf = int(blocks[-1])
            if last[leaf]:
                # A capped repeat: cached and kept, commit keeps the cached node as it is.
                capped.append(int(distinct - fen.prefix(np.array([last[leaf] - 1]))[0]))
                frees[i] = 1
                touch = touch[1:]
        old = last[touch]
        was = old > 0
        k = touch.size
        new_t = np.arange(t + 1, t + k + 1, dtype=np.int64)
        fen.add(np.concatenate((old[was], new_t)),
                np.concatenate((np.full(int(was.sum()), -1, dtype=np.int64),
                                np.ones(k, dtype=np.int64))))
        last[touch] = new_t
        distinct += k - int(was.sum())
        t += k
    return StackProfile(bs, tokens, limit, full, owned, frees, start, dist, t, distinct,
                        capped, list(per_req))


# ------------------------------------------------------------------ curves


def device_hit_blocks(profile: StackProfile, max_size: int | None = None) -> I64:
    """hits[D] for D = 0..max_size: blocks the device tier alone serves with D device
    blocks (exact from `exact_from_device_blocks` up). Default max_size: the saturation
    size (the smallest D that serves every reuse)."""
    prev = profile.prev_frees()
    finite = profile.dist < INF
    reps = np.repeat(prev, profile.limit)
    sat = saturation_size(profile)
    top = sat if max_size is None else max_size
    n = max(top, sat) + 2
    h0 = np.bincount(profile.dist[finite & (reps == 0)], minlength=n)
    h1 = np.bincount(profile.dist[finite & (reps == 1)], minlength=n)
    c0 = np.cumsum(h0)
    c1 = np.cumsum(h1)
    sizes = np.arange(top + 1)
    out: I64 = c0[sizes] + np.where(sizes >= 1, c1[np.maximum(sizes - 1, 0)], 0)
    return out


def saturation_size(profile: StackProfile) -> int:
    """The smallest device size whose hit rate equals an unbounded cache's."""
    prev = np.repeat(profile.prev_frees(), profile.limit)
    finite = profile.dist < INF
    if not finite.any():
        return 1
    return int((profile.dist[finite] + prev[finite]).max())


@dataclass
class TwoTierResult:
    """Per candidate size: blocks served by the device and by the host, and whether the
    size is exact (False where a demotion found no host block)."""

    device_blocks: I64
    host_blocks: I64
    device_hits: I64
    host_hits: I64
    starved: npt.NDArray[np.bool_]


def two_tier_hits(profile: StackProfile, device_blocks: I64 | int,
                  host_blocks: I64 | int) -> TwoTierResult:
    """Blocks served per tier with `write_back` (exclusive tiers) for each (device, host)
    pair (broadcast): the pools' block counts replayed request by request, as the
    scheduler's match, allocate, commit and release change them. host_blocks 0 is the
    device-only case (victims dropped)."""
    dd, hh_ = np.broadcast_arrays(np.asarray(device_blocks, dtype=np.int64),
                                  np.asarray(host_blocks, dtype=np.int64))
    dev = dd.astype(np.int64).ravel()
    host = hh_.astype(np.int64).ravel()
    kd = np.zeros_like(dev)  # device blocks cached (the stack's top kd)
    kh = np.zeros_like(dev)  # host-only blocks cached (the next kh)
    dev_hits = np.zeros_like(dev)
    host_hits = np.zeros_like(dev)
    starved = np.zeros(dev.shape, dtype=np.bool_)
    has_host = host > 0
    dist = profile.dist
    zero = np.zeros_like(dev)
    for i in range(profile.requests):
        if profile.frees[i] < 0:
            continue
        s = int(profile.start[i])
        m = dist[s:s + int(profile.limit[i])]
        hd = np.searchsorted(m, kd, side="right")
        ht = np.searchsorted(m, kd + kh, side="right")
        hl = ht - hd
        dev_hits += hd
        host_hits += hl
        # match: host hits get device blocks; victims are demoted while the loading copies
        # still hold their host blocks (they are freed once loaded: exclusive tiers).
        fd = dev - kd
        e1 = np.maximum(hl - fd, zero)
        fh = host - kh
        dem1 = np.where(has_host, np.minimum(e1, fh + kh - hl), zero)
        starved |= has_host & (dem1 < e1)
        ev1 = np.maximum(dem1 - fh, zero)
        kd = kd - e1 + hl
        kh = kh - hl + dem1 - ev1
        # allocate: the rest of the request's blocks.
        need = int(profile.owned[i]) - ht
        e2 = np.maximum(need - (dev - kd), zero)
        fh = host - kh
        dem2 = np.where(has_host, np.minimum(e2, fh + kh), zero)
        starved |= has_host & (dem2 < e2)
        ev2 = np.maximum(dem2 - fh, zero)
        kh = kh + dem2 - ev2
        # commit + release: new full blocks join the device (a capped repeat's does not).
        kd = kd - e2 + (int(profile.full[i]) - ht - int(profile.limit[i] < profile.full[i]
                                                        and profile.frees[i] == 1))
    return TwoTierResult(dev, host, dev_hits, host_hits, starved)


def size_grid(top: int, points: int) -> I64:
    """Ascending sizes from 1 to `top`: about `points` of them, dense where curves bend
    (geometric) plus an even spread, `top` included."""
    top = max(1, top)
    if top <= points:
        return np.arange(1, top + 1, dtype=np.int64)
    geo = np.unique(np.round(np.geomspace(1, top, num=points)).astype(np.int64))
    lin = np.unique(np.round(np.linspace(1, top, num=points // 2 + 1)).astype(np.int64))
    out: I64 = np.unique(np.concatenate((geo, lin, [1, top])))
    return out


def smallest_host_blocks(profile: StackProfile, device_blocks: int, grid: I64,
                         grid_hits: I64, targets: Sequence[int],
                         probes: int = 64) -> list[int | None]:
    """For each target (blocks served by both tiers), the smallest host size on or between
    the points of `grid` (ascending, `grid_hits` their two-tier hits) that reaches it, or
    None: the bracket from the grid, then narrowed by evaluating `probes` sizes per target
    in one vectorised `two_tier_hits` pass at a time (about 3 passes from a million
    blocks)."""
    lo: list[int] = []
    hi: list[int] = []
    out: list[int | None] = []
    for t in targets:
        idx = int(np.argmax(grid_hits >= t)) if (grid_hits >= t).any() else -1
        out.append(None if idx < 0 else int(grid[idx]))
        hi.append(int(grid[idx]) if idx >= 0 else 0)
        lo.append(int(grid[idx - 1]) if idx > 0 else 0)
    while True:
        open_ = [k for k in range(len(targets)) if out[k] is not None and hi[k] - lo[k] > 1]
        if not open_:
            return out
        sizes: list[I64] = []
        for k in open_:
            step = np.unique(np.linspace(lo[k] + 1, hi[k] - 1, num=min(probes, hi[k] - lo[k]
                                                                       - 1)).astype(np.int64))
            sizes.append(step)
        res = two_tier_hits(profile, device_blocks, np.concatenate(sizes))
        got = res.device_hits + res.host_hits
        at = 0
        for k, step in zip(open_, sizes, strict=True):
            vals = got[at:at + step.size]
            at += step.size
            ok = vals >= targets[k]
            if ok.any():
                first = int(np.argmax(ok))
                hi[k] = int(step[first])
                lo[k] = int(step[first - 1]) if first > 0 else lo[k]
            else:
                lo[k] = int(step[-1])
            out[k] = hi[k]


# ------------------------------------------------------------------ the offline reference


@dataclass
class OfflineTrace:
    """A request stream serialized for the clairvoyant pass: one entry per full block of each
    request, in request order and, within a request, root first.

    * `block[k]`, `depth[k]` (its position in its request), `counted[k]` (position < the
      request's lookup `limit`: a hit there counts; the capped last block of an exact-multiple
      prompt is an insertion opportunity only), `key[k]`: the eviction priority after access k,
      `next counted use * (max depth + 1) + depth` where "never again" is the stream's length
      (larger keys leave first).
    * `starts[i]`: request i's first entry (`starts[R]` = the length).

    Invariant that makes Belady's rule leaves-first on its own: a block's next counted use is
    never later than any of its children's (a request that looks up a child looks up its
    parent first, one entry earlier), and ties (both never used again) go to the deeper one.
    """

    block: list[int]
    counted: list[bool]
    key: list[int]
    starts: list[int]


def offline_trace(profile: StackProfile) -> OfflineTrace:
    """Precompute next-use keys for `offline_hit_blocks`: one stable sort, O(N log N)."""
    if len(profile.blocks) != profile.requests:
        raise ValueError("the profile carries no block ids (built by profile_from_ids?)")
    sizes = np.array([b.size for b in profile.blocks], dtype=np.int64)
    n = int(sizes.sum())
    starts = np.zeros(sizes.size + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    block = (np.concatenate(profile.blocks) if n else np.zeros(0, dtype=np.int64))
    depth = np.arange(n, dtype=np.int64) - np.repeat(starts[:-1], sizes)
    counted = depth < np.repeat(profile.limit, sizes)
    # Next counted use of the same block, strictly later: sort by block (stable keeps time
    # order), then a reversed running minimum per block group. Each group's values are offset
    # by group * (n + 1), so the minimum never leaks in from a later (larger) group.
    order = np.argsort(block, kind="stable")
    sb = block[order]
    grp = np.zeros(n, dtype=np.int64)
    if n:
        grp[1:] = np.cumsum(sb[1:] != sb[:-1])
    never = n
    cand = np.where(counted[order], order, never) + grp * (n + 1)
    rmin = np.minimum.accumulate(cand[::-1])[::-1]
    nxt_sorted = np.full(n, never, dtype=np.int64)
    if n > 1:
        same = grp[1:] == grp[:-1]
        nxt_sorted[:-1] = np.where(same, rmin[1:] - grp[:-1] * (n + 1), never)
    nxt = np.empty(n, dtype=np.int64)
    nxt[order] = nxt_sorted
    width = int(depth.max()) + 1 if n else 1
    key = nxt * width + depth
    return OfflineTrace(block.tolist(), counted.tolist(), key.tolist(), starts.tolist())


def offline_hits_at(trace: OfflineTrace, capacity: int) -> int:
    """Blocks served with at most `capacity` cached blocks between requests, by Belady's
    rule with bypass: a block that misses is cached only if some cached block's next use is
    later than its own, and then that block (the farthest, deeper first on ties) leaves.

    Data structures: `cached` maps a block to its current key; `heap` is a max-heap (negated
    keys) with lazy deletion (an entry whose key is no longer the block's is skipped), rebuilt
    from `cached` when stale entries outnumber live ones 4 to 1 (memory stays O(capacity)).
    O(log n) per access. The cache stays prefix-closed (see `OfflineTrace`), so a request's
    hits are the leading run of its looked-up blocks, as in replay.
    """
    if capacity <= 0:
        return 0
    block, counted, keys, starts = trace.block, trace.counted, trace.key, trace.starts
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for i in range(len(starts) - 1):
        run = True
        for k in range(starts[i], starts[i + 1]):
            b = block[k]
            key = keys[k]
            if b in cached:
                if run and counted[k]:
                    hits += 1
                cached[b] = key
                push(heap, (-key, b))
                continue
            run = False
            if len(cached) < capacity:
                cached[b] = key
                push(heap, (-key, b))
                continue
            while True:
                nk, v = heap[0]
                if cached.get(v) == -nk:
                    break
                pop(heap)
            if -nk > key:  # the farthest cached block leaves; b takes its place
                pop(heap)
                del cached[v]
                cached[b] = key
                push(heap, (-key, b))
            # else: b's next use is the farthest of all: it is not cached (bypass)
        if len(heap) > 4 * len(cached) + 1024:
            heap = [(-kk, bb) for bb, kk in cached.items()]
            heapq.heapify(heap)
    return hits


def offline_hit_blocks(profile: StackProfile, sizes: Sequence[int] | I64) -> I64:
    """Blocks the clairvoyant offline cache serves at each size (see `offline_hits_at`).

    What it is: the most blocks any eviction policy can serve from a cache that holds at most
    `size` full blocks between requests, in replay's order, hits counted as the leading run
    of each request's looked-up blocks. Why: every such policy (LRU, ARC, ...) picks the next
    cache from the previous one plus the request's blocks, which is a schedule of paging with
    bypass over the serialized stream (a block enters the cache only when its request has it),
    where Belady's rule (farthest next use leaves) is optimal (Belady 1966; Mattson et al.
    1970), and Belady's own schedule keeps the cache prefix-closed, so its hits are prefix
    hits. So it bounds every online policy's device-only replay at device_blocks = size from
    above (replay's pool also holds the running request, so it keeps at most `size`, often
    fewer). tests/test_plan.py holds it equal to an exhaustive search over prefix-closed
    caches on small streams. One pass per size, O(N log N) each.
    """
    trace = offline_trace(profile)
    return np.array([offline_hits_at(trace, int(s)) for s in sizes], dtype=np.int64)


# ------------------------------------------------------------------ the plan


@dataclass
class PlanInputs:
    """What the plan reads from a configuration."""

    block_size: int
    block_bytes: int  # bytes of one block over every rank
    device_blocks: int
    host_blocks: int
    write_policy: str
    storage: bool = False


OFFLINE_BOUNDS = (
    "Belady's rule with bypass (the cached block whose next use is farthest leaves; deeper "
    "first on ties, so leaves first): the most blocks any eviction policy can serve from a "
    "device pool that holds at most that many blocks between requests, in replay's order "
    "(device only, hits as the leading run). An upper bound on every policy's replay at "
    "device_blocks = size; no online policy reaches it (it knows the future)")


def build_plan(profile: StackProfile, cfg: PlanInputs, points: int = 80,
               offline_points: int = 16, policies: Sequence[str] = (),
               requests: Sequence[WorkRequest] | Sequence[Sequence[int]] = (),
               policy_points: int = 8) -> dict[str, Any]:
    """Everything `kvtier plan --json` prints: the curves, the sizes for each target, the
    prefill saved at the configured sizes, and where the figures are exact. With
    `offline_points` > 0 also the clairvoyant offline curve (`offline_hit_blocks`) on a grid
    of about 1.5x that many sizes plus the configured one: one O(N log N) pass per size.
    With `policies` (eviction policy names) and the `requests` the profile was made of, each
    policy's device curve by replay (`policy_hit_blocks`) on a grid of about 1.5x
    `policy_points` sizes from the smallest replay accepts, plus the configured one."""
    bs = profile.block_size
    lookup = profile.lookup_tokens
    reqs = profile.requests

    def rate(blocks: float) -> float:
        return blocks * bs / lookup if lookup else 0.0

    sat = saturation_size(profile)
    top = max(sat, 50)  # at least 50 points, even where a tiny workload saturates sooner
    dense = device_hit_blocks(profile, top)  # index D: hits with D device blocks
    best = int(dense[-1])
    achievable = rate(best)
    grid = size_grid(top, max(points, 50))
    device_curve = [[int(s), rate(int(dense[s]))] for s in grid]
    targets: dict[str, Any] = {}
    for frac in TARGETS:
        need = math.ceil(frac * best - 1e-9)
        idx = int(np.searchsorted(dense, need, side="left")) if best else 0
        targets[f"{round(frac * 100)}%"] = {
            "device_blocks": max(idx, 1),
            "device_bytes": max(idx, 1) * cfg.block_bytes,
            "token_hit_rate": rate(int(dense[max(idx, 1)])) if best else 0.0,
        }
    d_cfg = cfg.device_blocks
    dev_cfg_hits = int(device_hit_blocks(profile, max(d_cfg, 1))[d_cfg])
    exact_from = profile.exact_from_device_blocks
    out: dict[str, Any] = {
        "block_size": bs,
        "block_bytes": cfg.block_bytes,
        "requests": reqs,
        "lookup_tokens": lookup,
        "block_accesses": profile.accesses,
        "distinct_blocks": profile.distinct_blocks,
        "achievable_hit_rate": achievable,
        "saturation_device_blocks": sat,
        "min_device_blocks": profile.min_device_blocks,
        "capped_repeats": len(profile.capped_repeats),
        "exact_from_device_blocks": exact_from,
        "configured": {"device_blocks": d_cfg, "host_blocks": cfg.host_blocks,
                       "write_policy": cfg.write_policy},
        "device_curve": device_curve,
        "device_curve_bytes": [[s * cfg.block_bytes, r] for s, r in device_curve],
        "device_targets": targets,
        "device_only": {
            "token_hit_rate": rate(dev_cfg_hits),
            "prefill_tokens_saved_per_request": dev_cfg_hits * bs / reqs if reqs else 0.0,
            "exact": d_cfg >= exact_from,
        },
    }
    # Two tiers at the configured device size, host size on the x axis.
    # The union saturates once device + host hold the deepest reuse (flat from 1 block when
    # the device alone does: at least 50 points either way).
    host_top = max(sat - d_cfg + 1, 50)
    hgrid = size_grid(host_top, max(points, 50))
    res = two_tier_hits(profile, d_cfg, np.concatenate((hgrid, [cfg.host_blocks])))
    tot = res.device_hits + res.host_hits
    ok = (~res.starved) & (d_cfg >= exact_from)
    exclusive_curve = [[int(h), rate(int(t))] for h, t in zip(hgrid, tot[:-1], strict=True)]
    policy = cfg.write_policy
    exact_policy = policy == "write_back"
    host_targets: dict[str, Any] = {}
    wanted = [math.ceil(frac * best - 1e-9) for frac in TARGETS]
    # Host size 0 (the device alone) first: a target the device reaches needs no host.
    found = smallest_host_blocks(profile, d_cfg, np.concatenate(([0], hgrid)),
                                 np.concatenate(([dev_cfg_hits], tot[:-1])), wanted)
    for frac, h in zip(TARGETS, found, strict=True):
        host_targets[f"{round(frac * 100)}%"] = (
            None if h is None else {"host_blocks": h, "host_bytes": h * cfg.block_bytes})
    cfg_total = int(tot[-1])
    two_tier: dict[str, Any] = {
        "write_policy": policy,
        "device_blocks": d_cfg,
        "exact": bool(exact_policy and cfg.host_blocks > 0 and ok[-1]),
        "curve": exclusive_curve,
        "curve_bytes": [[h * cfg.block_bytes, r] for h, r in exclusive_curve],
        "inexact_host_sizes": [int(h) for h, good in zip(hgrid, ok[:-1], strict=True)
                               if not good],
        "host_targets": host_targets,
        "configured": {
            "host_blocks": cfg.host_blocks,
            "token_hit_rate": rate(cfg_total),
            "device_token_hit_rate": rate(int(res.device_hits[-1])),
            "host_token_hit_rate": rate(int(res.host_hits[-1])),
            "prefill_tokens_saved_per_request": cfg_total * bs / reqs if reqs else 0.0,
        },
    }
    if not exact_policy:
        two_tier["note"] = (
            f"{policy} is not modelled exactly (its backups complete asynchronously): the "
            "curve is write_back's (exclusive tiers), an estimate no measured replay exceeded")
    out["two_tier"] = two_tier
    out["write_back_curve"] = exclusive_curve
    if offline_points > 0 and profile.blocks:
        t_off = time.perf_counter()
        ogrid = np.unique(np.concatenate((size_grid(top, offline_points), [max(d_cfg, 1)])))
        ohits = offline_hit_blocks(profile, ogrid)
        offline_curve = [[int(s), rate(int(h))] for s, h in zip(ogrid, ohits, strict=True)]
        at_cfg = int(ohits[int(np.searchsorted(ogrid, max(d_cfg, 1)))])
        out["offline_curve"] = offline_curve
        out["offline_curve_bytes"] = [[s * cfg.block_bytes, r] for s, r in offline_curve]
        out["offline"] = {
            "rule": "belady",
            "bounds": OFFLINE_BOUNDS,
            "configured": {"device_blocks": d_cfg, "token_hit_rate": rate(at_cfg),
                           "lru_token_hit_rate": rate(dev_cfg_hits)},
            "elapsed_s": round(time.perf_counter() - t_off, 3),
        }
    if policies:
        lo = max(profile.min_device_blocks, 1)
        pgrid = np.unique(np.concatenate((size_grid(top, policy_points), [d_cfg])))
        pgrid = pgrid[pgrid >= lo]
        curves: dict[str, list[list[float]]] = {}
        t_pol = time.perf_counter()
        for name in policies:
            hits = policy_hit_blocks(requests, bs, pgrid, name)
            curves[name] = [[int(s), rate(h)] for s, h in zip(pgrid, hits, strict=True)]
        out["policy_curves"] = curves
        out["policy_curves_elapsed_s"] = round(time.perf_counter() - t_pol, 3)
    cold = 1.0 - achievable
    out["storage"] = {
        "configured": cfg.storage,
        "cold_miss_floor": cold,
        "adds_over_tiers": max(0.0, achievable - rate(cfg_total)),
        "note": "a store that keeps every block (shared across instances) serves every "
                "reuse: the hit rate rises to the achievable one, the cold misses remain",
    }
    return out


# ------------------------------------------------------------------ other policies, by replay


def policy_hit_blocks(requests: Sequence[WorkRequest] | Sequence[Sequence[int]],
                      block_size: int, sizes: Sequence[int] | I64, policy: str) -> list[int]:
    """Device hit blocks of an eviction policy at each device size: no one-pass method
    exists for a policy without LRU's inclusion property, so each size is a replay: the
    stream through the scheduler (`KVCacheManager`, in process, device only, no workers),
    one request at a time, match -> allocate -> commit -> release, as `kvtier replay` drives
    it (so the figures equal `kvtier replay`'s hit_tokens.device / block_size). A size below
    the largest request's blocks is answered with -1 (replay refuses it)."""
    # The scheduler sits above this module's own layer only for this replay: imported here
    # so the one-pass curves keep the module engine-agnostic and light to import.
    from kvtier.manager.scheduler import KVCacheManager

    prompts = [r.tokens if isinstance(r, WorkRequest) else list(r) for r in requests]
    need = max((-(-len(t) // block_size) for t in prompts), default=1)
    out: list[int] = []
    for size in sizes:
        if int(size) < need:
            out.append(-1)
            continue
        m = KVCacheManager(block_size=block_size, device_blocks=int(size), host_blocks=0,
                           eviction_policy=policy)
        hits = 0
        for i, toks in enumerate(prompts):
            rid = f"r{i}"
            mr = m.match(rid, toks)
            m.allocate(rid, len(toks) - mr.num_tokens, reserve_blocks=0)
            m.commit(rid, toks, len(toks))
            m.release(rid)
            hits += mr.num_tokens // block_size
        out.append(hits)
    return out
