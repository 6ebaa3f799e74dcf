"""kvtier's tier events handed to vLLM's offloading connector so that every event it publishes
is one a router can index.

vLLM's connector (`OffloadingEventsTracker`, vllm/distributed/kv_transfer/kv_connector/v1/
offloading/events.py) turns an `OffloadingEvent` (keys and a medium only) into a
`BlockStored` with the block's tokens, parent hash and block size from a payload it
snapshots from the request in two places: when the manager lets it store a key
(`PrepareStoreOutput.keys_to_store`) and when a lookup answers HIT. It keeps that payload
while the key has an *active residency*: the host medium from the snapshot on, plus each
medium of a stored event flagged `removal_expected`; at the end of a batch in which the
last residency was removed it drops the payload. A stored event for a key it has no
payload for comes out as a placeholder (`block_size` 0, no tokens, no parent), which
Dynamo's indexer cannot place in its tree. Two ways kvtier used to produce those:

* storage stored events without `removal_expected`: when the host copy was evicted the
  payload went, and the block brought back from storage later was announced bare (the
  4 placeholder CPU stores of the first e2e run);
* blocks vLLM has no payload for at all: after vLLM's `reset_prefix_cache` (its tracker
  forgets every payload) a block still in kvtier's storage and prefetched back; a block
  another instance stored in shared storage.

`EventRelay` mirrors the tracker's residencies (`residency`: key -> media, exactly the
tracker's set for kvtier's keys) and holds back a stored event whose key has no payload
(`held`: key -> media announced to nobody yet) until vLLM snapshots one (a HIT on it, a
store of it); a removal of a held medium cancels it (the router never heard of it). Every
stored event passed on carries `removal_expected`, so the payload lives as long as some
medium holds the block. Removals need no payload (a `BlockRemoved` is hashes, medium and
locality; kvtier stores one vLLM block per key, so the tracker's hash-only form is the
same event), so they are always passed on.

States of one (key, medium), kvtier's side::

    absent --stored, payload known--> announced --removed--> absent
    absent --stored, no payload----> held --payload snapshot--> announced
                                     held --removed----------> absent (nothing published)

Invariant: a published stored event always finds its payload in vLLM's tracker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey


class EventRelay:
    """The tracker's residencies mirrored and the stored events held back (module
    docstring). `residency`: key -> the media vLLM's tracker counts for its payload (a key
    is present exactly while the tracker holds its payload); `held`: key -> media kvtier
    reported stored that were not published for want of a payload; `ready`: held keys
    described since the last relay, in description order. Called from vLLM's scheduler
    thread only."""

    def __init__(self, storage_locality: Locality, describing: bool) -> None:
        self.storage_locality = storage_locality
        # False: the operator turned vLLM's self-describing events off (every stored event
        # is a placeholder by their choice): events pass through unchanged
        self.describing = describing
        self.residency: dict[OffloadKey, set[Medium]] = {}
        self.held: dict[OffloadKey, set[Medium]] = {}
        # held keys vLLM described since the last relay, in the order it described them (a
        # request's blocks, parent first: an indexer places a block only under a parent it
        # knows, and the held order is the node's, e.g. another engine's blocks in tree order)
        self.ready: list[OffloadKey] = []

    def described(self, key: OffloadKey, stored: bool) -> None:
        """vLLM snapshotted a payload for `key`: a store of it (`stored`: the tracker adds
        the host residency to an existing payload) or a HIT (it keeps an existing one)."""
        media = self.residency.get(key)
        if media is None:
            self.residency[key] = {Medium.CPU}
        elif stored:
            media.add(Medium.CPU)
        if key in self.held:
            self.ready.append(key)

    def reset(self) -> None:
        """vLLM's connector reset: its tracker drops every payload right after."""
        self.residency.clear()
        self.ready.clear()

    def relay(self, events: Iterable[tuple[Medium, bool, list[OffloadKey]]]
              ) -> Iterator[OffloadingEvent]:
        """vLLM's offloading events for kvtier's (medium, removed, keys) in order: first the
        held stores whose payload vLLM now has, then the new events (stores without a
        payload held, removals of held stores dropped)."""
        if not self.describing:
            for medium, removed, keys in events:
                yield self._event(medium, removed, keys)
            return
        released: dict[Medium, list[OffloadKey]] = {}
        for key in self.ready:
            held = self.held.pop(key, None) if key in self.residency else None
            for medium in sorted(held or (), key=lambda m: m.value):
                released.setdefault(medium, []).append(key)
        self.ready.clear()
        for medium, keys in released.items():
            yield self._stored(medium, keys)
        removed_keys: set[OffloadKey] = set()
        for medium, removed, keys in events:
            if removed:
                out = []
                for key in keys:
                    held = self.held.get(key)
                    if held is not None and medium in held:
                        held.discard(medium)
                        if not held:
                            del self.held[key]
                        continue
                    media = self.residency.get(key)
                    if media is not None:
                        media.discard(medium)
                        removed_keys.add(key)
                    out.append(key)
                if out:
                    yield self._event(medium, True, out)
            else:
                ready = [k for k in keys if k in self.residency]
                for key in keys:
                    if key not in self.residency:
                        self.held.setdefault(key, set()).add(medium)
                if ready:
                    yield self._stored(medium, ready)
        # the tracker drops a payload at the end of the batch its last residency went in
        for key in removed_keys:
            if not self.residency.get(key, True):
                del self.residency[key]

    def _stored(self, medium: Medium, keys: list[OffloadKey]) -> OffloadingEvent:
        for key in keys:
            self.residency[key].add(medium)
        return OffloadingEvent(keys=keys, medium=medium, removed=False,
                               locality=self._locality(medium), removal_expected=True)

    def _event(self, medium: Medium, removed: bool, keys: list[OffloadKey]) -> OffloadingEvent:
        return OffloadingEvent(keys=keys, medium=medium, removed=removed,
                               locality=self._locality(medium),
                               removal_expected=not removed)

    def _locality(self, medium: Medium) -> Locality:
        return Locality.LOCAL if medium is Medium.CPU else self.storage_locality
