"""A plain block-level LRU cache simulation: the yardstick the manager's hit rates are held to.

It knows nothing of block ids, transfers or reference counts: each tier is an `OrderedDict`
of block identities, oldest first. A request hits the longest prefix of its blocks that some
tier holds (at most `(n_tokens - 1) // block_size` blocks: the model computes at least one
token), then all its full blocks are touched tail first, so that its leaves are older than
its root and leave first. With a host tier the tiers are exclusive: a host hit is promoted to
the device and a block evicted from the device is demoted to the host (as its most recent
entry); a block evicted from the host is gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass
class LRUResult:
    """Tokens looked up and hit per tier over a whole run."""

    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0

    @property
    def device_rate(self) -> float:
        return self.device_hit_tokens / self.lookup_tokens

    @property
    def total_rate(self) -> float:
        return (self.device_hit_tokens + self.host_hit_tokens) / self.lookup_tokens


def simulate(requests: Iterable[tuple[Sequence[Hashable], int]], block_size: int,
             device_blocks: int, host_blocks: int = 0) -> LRUResult:
    """Replay `(full block identities, prompt tokens)` pairs through LRU tiers."""
    dev: OrderedDict[Hashable, None] = OrderedDict()
    host: OrderedDict[Hashable, None] = OrderedDict()
    out = LRUResult()
    for blocks, n_tokens in requests:
        out.lookup_tokens += n_tokens
        n_dev = n_host = 0
        for b in blocks[: max(0, n_tokens - 1) // block_size]:
            if b in dev:
                n_dev += 1
            elif b in host:
                n_host += 1
            else:
                break
        out.device_hit_tokens += n_dev * block_size
        out.host_hit_tokens += n_host * block_size
        for b in reversed(blocks):
            host.pop(b, None)
            dev[b] = None
            dev.move_to_end(b)
        while len(dev) > device_blocks:
            b = dev.popitem(last=False)[0]
            if host_blocks:
                host[b] = None
                if len(host) > host_blocks:
                    host.popitem(last=False)
    return out
