"""One engine's session over a namespace's key-addressed cache, and the one rule by which the
copies an engine gives up on are held, then released (issue 34, item 1).

An engine that owns its device tier talks to kvtier through `KeyedHostCache` from one of two
homes: in its own process (`kvtier.engine.embedded_cache`), or attached to the node service
(`kvtier.manager.node.server`, several engines per namespace). Both need the same room: the
copies this engine prepared and has not completed, recorded with it as their owner, so that
its completions and its end reach only its own copies (never another engine's of the same
hash: issue 34, defect 0), and a rule for what it abandons. `EngineSession` is that room::

    prepare_store / prepare_load     the cache's, as this owner; what it was given recorded
    complete_store / complete_load   only this engine's open copies of those hashes (the keys
                                     it prepared, each completed once); returns them
    remove_loaded(hashes, reason)    blocks this engine holds a load of (it was served them and
                                     found them wrong: the audit) removed from every tier of
                                     the node (`KeyedHostCache.remove`); any other hash refuses
                                     the whole call, nothing removed
    abandon(graves, ...)             the engine completes none of its open copies any more
                                     (it reset itself, or died): its stores are abandoned
                                     (never served) and held in `graves` until a deadline;
                                     its loads unpinned now (a dead engine reads nothing) or
                                     held with the stores (a reset engine may still run a
                                     copy it deferred)

`Graves` is the abandon-and-release rule of both homes: each batch of abandoned copies keeps
its host blocks out of the free list until its deadline, counted in engine steps (the
embedded home: vLLM may run a store it deferred for a step after its prefix-cache reset) or
in seconds (the node service: a dead engine's copy that had started may still land), then
`KeyedHostCache.release_abandoned` gives them back.

Data structures: `EngineSession.stores` / `.loads`: hash -> copies prepared and not
completed; `Graves._held`: [deadline, cache, nodes] per abandonment. Invariant: a session's
records are exactly its open copies in the cache (`KeyedHostCache._writers` /
`_readers` under its owner).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvtier.manager.core.nodes import Node
from kvtier.manager.errors import InvalidRequestError, KvtierError
from kvtier.manager.keyed import KeyedHostCache, Owner, Removal, StorePlan


def take_counted(held: dict[bytes, int], keys: Sequence[bytes]) -> list[bytes]:
    """The keys of `keys` that `held` counts (each taken once), counts decremented."""
    out = []
    for k in keys:
        n = held.get(k)
        if n:
            out.append(k)
            if n == 1:
                del held[k]
            else:
                held[k] = n - 1
    return out


@dataclass(slots=True)
class _Grave:
    steps: int | None  # engine steps left (None: a deadline in seconds)
    until: float  # monotonic deadline (steps: unused)
    cache: KeyedHostCache
    nodes: list[Node]


class Graves:
    """Abandoned copies held until their deadline, then released (see the module docstring).
    Thread-safe: the node service buries from its own thread."""

    def __init__(self) -> None:
        self._held: list[_Grave] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, cache: KeyedHostCache, nodes: list[Node], *, steps: int | None = None,
             seconds: float | None = None) -> None:
        """Keep `nodes` (from `KeyedHostCache.abandon_*`) marked for `steps` engine steps
        (`step`) or `seconds` (`bury`), exactly one of them."""
        if (steps is None) == (seconds is None):
            raise ValueError("Graves.hold: a deadline in steps or in seconds, one of them")
        if not nodes:
            return
        until = 0.0 if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._held.append(_Grave(steps, until, cache, nodes))

    def held_in_seconds(self) -> list[tuple[KeyedHostCache, list[Node], float]]:
        """(cache, nodes, seconds left) of every batch held by a deadline in seconds: what a
        node service hands over before it releases them all (issue 37)."""
        now = time.monotonic()
        with self._lock:
            return [(g.cache, list(g.nodes), max(0.0, g.until - now)) for g in self._held
                    if g.steps is None]

    def step(self) -> int:
        """One engine step passed: batches held in steps lose one; those at 0 are released.
        Returns how many nodes were released."""
        due: list[_Grave] = []
        with self._lock:
            keep = []
            for g in self._held:
                if g.steps is not None:
                    g.steps -= 1
                    if g.steps <= 0:
                        due.append(g)
                        continue
                keep.append(g)
            self._held = keep
        return self._release(due)

    def bury(self, *, all_: bool = False) -> int:
        """Release the batches held in seconds whose deadline passed (`all_`: every batch,
        whatever its deadline: the home is closing). Returns how many nodes were released."""
        now = time.monotonic()
        with self._lock:
            due = [g for g in self._held
                   if all_ or (g.steps is None and g.until <= now)]
            if due:
                self._held = [g for g in self._held if not any(g is d for d in due)]
        return self._release(due)

    @staticmethod
    def _release(due: list[_Grave]) -> int:
        """Every batch of `due` released, even when one raises (the first error is raised
        after the others were released: a batch is out of `_held` once it is due)."""
        n = 0
        err: KvtierError | None = None
        for g in due:
            try:
                g.cache.release_abandoned(g.nodes)
            except KvtierError as e:
                err = err or e
                continue
            n += len(g.nodes)
        if err is not None:
            raise err
        return n


class EngineSession:
    """One engine's open copies over `cache`, as owner `owner` (see the module docstring).
    Every call holds the cache's lock (the manager's, reentrant) around the cache's call and
    the records both, so an engine may complete from another thread than it prepared on."""

    def __init__(self, cache: KeyedHostCache, owner: Owner = None) -> None:
        self.cache = cache
        self.owner = owner
        self._lock = cache.m.lock
        self.stores: dict[bytes, int] = {}
        self.loads: dict[bytes, int] = {}

    def prepare_store(self, hashes: Sequence[bytes], tenant: str = "") -> StorePlan | None:
        with self._lock:
            plan = self.cache.prepare_store(hashes, owner=self.owner, tenant=tenant)
            if plan is not None:
                stores = self.stores
                for k in plan.keys:
                    stores[k] = stores.get(k, 0) + 1
            return plan

    def complete_store(self, hashes: Sequence[bytes], ok: bool = True) -> list[bytes]:
        """Complete this engine's open stores of `hashes`; returns the hashes that were."""
        with self._lock:
            mine = take_counted(self.stores, hashes)
            if mine:
                self.cache.complete_store(mine, ok, owner=self.owner)
            return mine

    def prepare_load(self, hashes: Sequence[bytes],
                     count_tokens: Sequence[bool] | None = None,
                     from_storage: list[bool] | None = None) -> list[int]:
        with self._lock:
            ids = self.cache.prepare_load(hashes, count_tokens, from_storage,
                                          owner=self.owner)
            loads = self.loads
            for k in hashes:
                loads[k] = loads.get(k, 0) + 1
            return ids

    def complete_load(self, hashes: Sequence[bytes]) -> list[bytes]:
        """End this engine's open loads of `hashes`; returns the hashes that were."""
        with self._lock:
            mine = take_counted(self.loads, hashes)
            if mine:
                self.cache.complete_load(mine, owner=self.owner)
            return mine

    def remove_loaded(self, hashes: Sequence[bytes], reason: str) -> Removal:
        """Remove blocks this engine holds an open load of from every tier of the node
        (`KeyedHostCache.remove`, storage deletion not waited for). An engine removes only
        what it was served and still reads: a hash it holds no load of (unknown, another
        engine's, another namespace's) refuses the call whole (InvalidRequestError naming
        it), nothing removed. The loads stay open: the engine completes them as usual."""
        with self._lock:
            for i, h in enumerate(hashes):
                if not isinstance(h, bytes) or not self.loads.get(h):
                    shown = h[:8].hex() if isinstance(h, bytes) else repr(h)
                    raise InvalidRequestError(
                        f"key {i} ({shown}…) is not a block this engine holds a load of: an "
                        "engine removes only blocks it was served and still reads")
            return self.cache.remove(hashes, reason=reason)

    def open_copies(self) -> tuple[int, int]:
        """(open stores, open loads)."""
        return sum(self.stores.values()), sum(self.loads.values())

    def abandon(self, graves: Graves, *, steps: int | None = None,
                seconds: float | None = None, unpin_loads: bool,
                slice_keys: int = 0) -> tuple[int, int]:
        """The engine completes none of its open copies any more: its stores are abandoned
        (never served) and held in `graves` for `steps` engine steps or `seconds`; its loads
        are unpinned now (`unpin_loads`: it died, nothing reads them) or held with the stores
        (it reset itself and may still run a copy it deferred). Returns (stores, loads) it
        had open; its records are empty after.

        `slice_keys` (with `unpin_loads`): the loads unpinned and the stores abandoned that
        many keys per hold of the cache's lock, the GIL offered between holds (the node
        service: one engine's end never holds a namespace for long). The records are taken
        out first, so the caller must not use this session from another thread meanwhile
        (the node service ends a session on its own thread)."""
        cache = self.cache
        owner = self.owner
        nodes: list[Node] = []
        if unpin_loads:
            with self._lock:
                opened = self.open_copies()
                loads = [k for k, n in self.loads.items() for _ in range(n)]
                stores = [k for k, n in self.stores.items() for _ in range(n)]
                self.stores.clear()
                self.loads.clear()
                if not slice_keys:
                    if loads:
                        cache.complete_load(loads, owner=owner)
                    if stores:
                        nodes = cache.abandon_stores(stores, owner=owner)
            if slice_keys:
                for part in _slices(loads, slice_keys):
                    cache.complete_load(part, owner=owner)
                nodes = [n for part in _slices(stores, slice_keys)
                         for n in cache.abandon_stores(part, owner=owner)]
        else:
            with self._lock:
                opened = self.open_copies()
                nodes = cache.abandon_engine_io(owner)
                self.stores.clear()
                self.loads.clear()
        graves.hold(cache, nodes, steps=steps, seconds=seconds)
        return opened


def _slices(keys: list[bytes], step: int) -> Iterator[list[bytes]]:
    """`keys` in slices of `step`, the GIL offered between them (another thread's call gets
    the lock)."""
    for i in range(0, len(keys), step):
        if i:
            time.sleep(0)
        yield keys[i:i + step]
