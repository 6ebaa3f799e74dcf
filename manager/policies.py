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

Storage write policies (`storage.write_policy`): when a host copy is written to storage. The
storage tier asks at two moments (a host copy lands: a device backup, a demotion, an engine
store, a confirmed engine copy; a host copy is hit), the cache core at a third (the host tier
evicts a copy storage lacks):

| policy                  | copy lands         | copy hit          | host evicts an unwritten copy |
|-------------------------|--------------------|-------------------|-------------------------------|
| write_through           | write              | -                 | dropped (counted)             |
| write_through_selective | write if hits >= N | write at N hits   | dropped (counted)             |
| write_back              | -                  | -                 | written first (a batch)       |

N is `storage.write_threshold`; hits are the block's hits on any tier (a match's reference,
an engine's load). write_back writes the oldest unwritten copies in one BACKUP task (up to
`WRITE_BACK_BATCH`; BACKING keeps them) and evicts the oldest written one instead; when none
is within reach, or storage refuses the batch (`storage.max_backup_mb_s`), the oldest copy is
evicted unwritten and counted (`evicted_host_unstored`). Every decision is O(1) per block.
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


STORAGE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

WRITE_BACK_BATCH = 32
"""Unwritten host copies one write_back eviction sends to storage at most (one BACKUP task): a
file or Redis write of a few pages costs about as much as one of 32 (one round trip, one
fsync-free batch), and a bound keeps an eviction's scan O(1)."""


@dataclass(frozen=True, slots=True)
class StorageWritePolicy:
    """Decisions of one storage write policy (see the second table of the module docstring)."""

    name: str
    on_land: bool  # every host copy is written when it lands
    hit_threshold: int  # 0: hits never decide; N: written once its block was hit N times
    on_host_evict: bool  # written when the host tier evicts it (write_back)

    def writes(self, hits: int) -> bool:
        """Whether a host copy whose block was hit `hits` times is written now (it landed or
        was hit)."""
        return self.on_land or 0 < self.hit_threshold <= hits


def make_storage_write_policy(name: str, write_threshold: int = 1) -> StorageWritePolicy:
    """The storage write policy called `name`; `write_threshold` applies to
    write_through_selective."""
    if name == "write_through":
        return StorageWritePolicy(name, True, 0, False)
    if name == "write_through_selective":
        if write_threshold < 1:
            raise ValueError(f"storage.write_threshold must be >= 1, got {write_threshold}")
        return StorageWritePolicy(name, False, write_threshold, False)
    if name == "write_back":
        return StorageWritePolicy(name, False, 0, True)
    raise ValueError(f"storage.write_policy = {name!r}: expected one of "
                     f"{', '.join(STORAGE_WRITE_POLICIES)}")
