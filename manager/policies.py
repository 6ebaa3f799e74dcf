"""Write policies: when a device block gets a host copy.

Each policy is a small strategy object the manager consults at three moments: a block is
committed, a block is hit, a block is evicted from the device. Eviction order itself is LRU
over the intrusive lists in `kvtier.manager.core.nodes` (O(1) per block), not a policy object,
because no other order has earned its place yet.

| policy                  | on commit | on hit                | device eviction   | after a load |
|-------------------------|-----------|-----------------------|-------------------|--------------|
| write_through           | back up   | back up if no copy    | drop (host keeps) | host kept    |
| write_through_selective | -         | back up at N hits     | drop cold blocks  | host kept    |
| write_back              | -         | -                     | demote, then free | host freed   |

"After a load": write_back keeps the tiers exclusive (a block lives on one of them), the
others keep the host copy as the backup it was made to be.
"""

from __future__ import annotations

from dataclasses import dataclass

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True, slots=True)
class WritePolicy:
    """Decisions of one write policy (see the module table)."""

    name: str
    backup_on_commit: bool
    hit_threshold: int  # 0: never back up on hit
    demote_on_evict: bool
    exclusive: bool  # a host copy is freed once its block is loaded to the device

    def backup_on_hit(self, hits: int) -> bool:
        return self.hit_threshold > 0 and hits >= self.hit_threshold


def make_write_policy(name: str, hit_threshold: int = 2) -> WritePolicy:
    """The policy called `name`; `hit_threshold` applies to write_through_selective."""
    if name == "write_through":
        return WritePolicy(name, True, 1, True, False)
    if name == "write_through_selective":
        if hit_threshold < 1:
            raise ValueError(f"cache.hit_threshold must be >= 1, got {hit_threshold}")
        return WritePolicy(name, False, hit_threshold, False, False)
    if name == "write_back":
        return WritePolicy(name, False, 0, True, True)
    raise ValueError(
        f"cache.write_policy = {name!r}: expected one of {', '.join(WRITE_POLICIES)}"
    )
