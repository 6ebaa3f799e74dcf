"""Tier events of the key-addressed surface: which engine blocks became or stopped being
servable in the host tier and in storage, for cache-aware routers.

A router (vLLM's KV-event publisher feeding Dynamo's indexer, vllm-router) keeps, per
instance, the set of blocks each tier can serve. kvtier reports that set as a stream of
stored / removed events per tier, by the engine's own block hashes::

    host     stored   a copy became a HIT (engine store completed, storage prefetch landed)
             removed  it stopped being one (LRU eviction, failed page, lost worker, reset,
                      written off by a registration change)
    storage  stored   a backup of it landed (or a prefetch read it back from storage)
             removed  storage was emptied (`POST /reset?storage=true`), or the block was
                      removed from the node (`removed`, below)

Where the events come from: evictions by `prepare_store` are logged at the transition
(`evicted`: the engine's `PrepareStoreOutput.evicted_keys` is the same list); everything
else by reconciling (`sweep`): the blocks reported servable are compared with what the
tree holds now. A reconciliation is exact whatever the path a copy took out of the tree
(the manager's core has a dozen, several of them whole-tree), at a cost of one pass over
the tree per `take` (measured: see the engine README). A block is reported removed only
after it was reported stored, and each key's events alternate stored / removed per tier.

A block removed from every tier of the node (`KeyedHostCache.remove`: an audit found its copy
wrong, an operator cleared it) is logged at the transition (`removed`): removed from the host
and from storage at once, each where it was reported, without waiting for the next sweep or
for storage to confirm the deletion (the page is deleted after; a router must stop routing to
the block now).

Pages a storage backend drops by itself (a Redis TTL or eviction, a lost file) are learned
when kvtier asks for them: a storage query answered without a block reported stored
(`storage_lacks`; storage counts leading pages, so the first one it lacks) removes it from
storage; a node that still says STORED is not announced there again (`gone`: a new node of
the key, backed up again, is). Pages nobody asks for again stay reported until storage is cleared:
nothing tells kvtier of them sooner.

Data structures: `names`, tree key -> engine hash (only blocks the engine named: stored or
asked of storage); `named_at`, tree key -> the sweep count when it was named (a name out of
the tree and reported nowhere is forgotten `KEEP_SWEEPS` sweeps later: a storage query may
start its prefetch several engine steps after it was asked); `host` / `storage`, tree
key -> hash of the blocks reported servable there; `gone`, tree key -> its node that said
STORED when storage was found to lack the page; `pending`, events not taken yet.
Invariant: `host` and `storage` keys are in `names` until reported removed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtier.manager.core.nodes import ENGINE_WRITE, PREFETCHING, STORED, Node

HOST = "host"
KEEP_SWEEPS = 256
STORAGE = "storage"


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Blocks (engine hashes, in the order they changed) that became servable in `tier`
    (`removed` False) or stopped being servable there (True)."""

    tier: str
    removed: bool
    hashes: tuple[bytes, ...]


class TierEventLog:
    """The reported state per tier and the events not taken yet (see the module
    docstring). Callers hold the manager's lock."""

    def __init__(self) -> None:
        self.names: dict[int, bytes] = {}
        self.named_at: dict[int, int] = {}
        self.sweeps = 0
        self.host: dict[int, bytes] = {}
        self.storage: dict[int, bytes] = {}
        self.pending: list[TierEvent] = []
        self.gone: dict[int, Node] = {}
        self._storage_forgotten = 0

    def name(self, key: int, block_hash: bytes) -> None:
        self.names[key] = block_hash
        self.named_at[key] = self.sweeps

    def _log(self, tier: str, removed: bool, hashes: list[bytes]) -> None:
        if hashes:
            self.pending.append(TierEvent(tier, removed, tuple(hashes)))

    def evicted(self, keys: Iterable[int], stored: Iterable[int] = ()) -> list[bytes]:
        """Host copies `prepare_store` evicted: removed now. Returns their hashes (those
        reported stored; a copy evicted before it was reported was never announced).
        `stored`: those of them with a storage copy, announced in storage first if not yet
        (vLLM's connector forgets a block's tokens once no medium holds it)."""
        new = [(k, h) for k in stored if k not in self.storage and k not in self.gone
               for h in (self.names.get(k),) if h is not None]
        self.storage.update(new)
        self._log(STORAGE, False, [h for _, h in new])
        out = [h for h in (self.host.pop(k, None) for k in keys) if h is not None]
        self._log(HOST, True, out)
        return out

    def removed(self, named: Iterable[tuple[int, bytes]]) -> None:
        """Blocks (tree key, engine hash) taken out of every tier of the node now: removed
        from the host and from storage where they were reported (one event per tier). The
        hashes are named, so a sweep that meets a new copy of the key announces it again."""
        host: list[bytes] = []
        storage: list[bytes] = []
        for key, h in named:
            if self.host.pop(key, None) is not None:
                host.append(h)
            self.gone.pop(key, None)
            if self.storage.pop(key, None) is not None:
                storage.append(h)
            self.name(key, h)
        self._log(HOST, True, host)
        self._log(STORAGE, True, storage)

    def storage_lacks(self, key: int, node: Node | None) -> None:
        """A storage query found no page of `key` (`node`: its node in the tree, if any):
        removed from storage if reported there."""
        h = self.storage.pop(key, None)
        if h is not None:
            if node is not None and node.flags & STORED:
                self.gone[key] = node
            self._log(STORAGE, True, [h])

    def sweep(self, nodes: Iterable[Node], storage_forgotten: int) -> None:
        """Reconcile the reported state with the tree (`nodes`: every node in it) and log
        the differences. `storage_forgotten`: the manager's count of storage clears (a clear
        removes every page, including those of blocks no longer in the tree)."""
        names = self.names
        if storage_forgotten != self._storage_forgotten:
            self._storage_forgotten = storage_forgotten
            self._log(STORAGE, True, list(self.storage.values()))
            self.storage.clear()
            self.gone.clear()
        host_now: dict[int, bytes] = {}
        new_stored: list[bytes] = []
        in_tree: set[int] = set()
        gone, still_gone = self.gone, dict[int, Node]()
        for node in nodes:
            key = node.key
            if key is None:
                continue
            h = names.get(key)
            if h is None:
                continue
            in_tree.add(key)
            flags = node.flags
            if node.host is not None and not flags & (ENGINE_WRITE | PREFETCHING):
                host_now[key] = h
            if key in gone and gone[key] is node:
                still_gone[key] = node
                continue
            if flags & STORED and key not in self.storage:
                self.storage[key] = h
                new_stored.append(h)
        host = self.host
        self._log(HOST, True, [h for k, h in host.items() if k not in host_now])
        self._log(HOST, False, [h for k, h in host_now.items() if k not in host])
        self._log(STORAGE, False, new_stored)
        self.host = host_now
        self.gone = still_gone
        # names of blocks neither in the tree nor reported anywhere are forgotten (after
        # KEEP_SWEEPS sweeps)
        self.sweeps += 1
        old = self.sweeps - KEEP_SWEEPS
        storage, named_at = self.storage, self.named_at
        for key in [k for k, at in named_at.items()
                    if at < old and k not in in_tree and k not in storage]:
            del names[key], named_at[key]

    def take(self) -> list[TierEvent]:
        out, self.pending = self.pending, []
        return out
