"""Tenants and retention inside one keyed namespace (issue 36): who owns which host copy,
how many each may hold, and what keeps a copy in place.

A tenant is vLLM's `cache_salt` of the request that stored a block (part of vLLM's block
hash, so two tenants never share a block), or the tenant id a `kvtier.retain` action names;
"" is the default pool (requests without one). Every host copy the engines store through
the keyed surface is booked to one tenant. The book never changes a node itself: it asks
the cache core's named transitions (`hold_host_copy`, `release_host_hold`,
`evict_host_copy`).

Quotas (host blocks, per tenant): a tenant's own quota, else the namespace's default quota
for tenants without one, else the namespace's capacity. A store by tenant T that would take
T past its quota first evicts T's own copies (`own_victims`: lowest priority first, oldest
first within a priority), never another tenant's. Room the free list still lacks after
that comes from the namespace's host eviction order (`cache.host_eviction_policy`), except
that a copy of a tenant with an explicit quota that it is within (`protects`) is never taken
for another tenant: the store is refused instead (`stores_refused` in the tenant's
figures). So when explicit quotas add up to at most the capacity, no tenant within its quota
ever loses a block to another's traffic.

Retention (per block; `Retention`, the `kvtier.retain` v1 payload):

    pin          held (PINNED in the core: out of every eviction order) until unpinned;
                 counted in the tenant's quota; a pin the quota cannot hold is refused whole
    ttl_s        held at least that long, then back in ordinary eviction (`expire`, run
                 before every store and every status read: a heap of deadlines)
    priority     -8..8, default 0. Within a tenant's own eviction, lower goes first. A copy
                 with priority > 0 is held out of the namespace's eviction order (only its
                 own tenant's quota evicts it, after every lower one); a copy with
                 priority < 0 is evicted before the namespace's order is asked for room

    retain(node being written) -> pending until the store lands (`landed`), then applied
    retain(node on the host)   -> applied now: hold taken once per block (`_holds`)
    unpin / TTL passed         -> hold released unless pin, TTL or priority > 0 still ask it

Data structures (the keyed surface's lock guards them all): `tenants`: name -> `Tenant`;
`Tenant.order`: priority -> OrderedDict key -> Node (oldest first; `move_to_end` on every
hit or touch: O(1)); `_where`: key -> (tenant, priority); `_holds`: key -> `_Hold` (the
node, pin flag, TTL deadline); `_deadlines`: heap of (deadline, key); `_pending`: key ->
(tenant, Retention) for copies still being written; `storage_marks`: the retention sent
to storage pages, by page key (`StorageMarks`: a replaced worker is told it again);
`stored_pages`: the tenant that stored each recent block with a storage page (`StoredPages`:
a clear by tenant reaches pages whose host copy is gone). Copies
that leave the tree without the book (a prefetch's eviction, a reset) are found stale
(`m.lookup(key) is not node`) and purged when met: `Tenant.count` may over-count them until
then, which can only make a tenant evict its own copies early, never another's.

Invariants: a key is in at most one tenant's order, in the bucket of its priority; a held
key's node carries exactly one hold of the book's; `Tenant.count` equals the entries of its
order.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.manager.core.cache import CacheCore
from kvtier.manager.core.nodes import (
    ENGINE_WRITE,
    HOST_BUSY,
    PINNED,
    PREFETCHING,
    STORED,
    Node,
)
from kvtier.manager.errors import InvalidRequestError

RETAIN_ACTION = "kvtier.retain"
RETAIN_VERSION = 1
PRIORITY_MIN, PRIORITY_MAX = -8, 8
MAX_TTL_S = 30 * 86_400.0
MAX_TENANT_BYTES = 256
DEFAULT_TENANT = ""


class SteeringError(InvalidRequestError):
    """A steering request refused whole (a pin over quota, a bad retention): one line."""


@dataclass(frozen=True, slots=True)
class Retention:
    """What keeps a block in the host tier: the `kvtier.retain` v1 payload."""

    pin: bool = False
    ttl_s: float = 0.0
    priority: int = 0

    @classmethod
    def parse(cls, payload: object) -> Retention:
        """A payload `{ttl_s, priority, pin}` (each optional); one-line `SteeringError`
        naming the bad field (unknown field, wrong type, negative or too long TTL, priority
        out of range)."""
        if not isinstance(payload, Mapping):
            raise SteeringError(f"{RETAIN_ACTION} v{RETAIN_VERSION}: payload must be an object")
        unknown = sorted(set(payload) - {"pin", "ttl_s", "priority"})
        if unknown:
            raise SteeringError(f"{RETAIN_ACTION} v{RETAIN_VERSION}: unknown field(s) {unknown} "
                                "(pin, ttl_s, priority)")
        pin = payload.get("pin", False)
        ttl = payload.get("ttl_s", 0.0)
        prio = payload.get("priority", 0)
        if not isinstance(pin, bool):
            raise SteeringError(f"{RETAIN_ACTION}: pin = {pin!r}, must be true or false")
        if (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not math.isfinite(ttl)
                or not 0 <= ttl <= MAX_TTL_S):
            raise SteeringError(f"{RETAIN_ACTION}: ttl_s = {ttl!r}, must be seconds in "
                                f"[0, {MAX_TTL_S:.0f}]")
        if isinstance(prio, bool) or not isinstance(prio, int) or not (
                PRIORITY_MIN <= prio <= PRIORITY_MAX):
            raise SteeringError(f"{RETAIN_ACTION}: priority = {prio!r}, must be an integer in "
                                f"[{PRIORITY_MIN}, {PRIORITY_MAX}]")
        return cls(pin, float(ttl), prio)

    def as_dict(self) -> dict[str, Any]:
        return {"pin": self.pin, "ttl_s": self.ttl_s, "priority": self.priority}


def retention_from_hints(actions: Iterable[Any]) -> tuple[Retention, str | None] | None:
    """The `kvtier.retain` action of a request's kv_hints (vLLM's `KvHintsEnvelope.actions`:
    objects with `action_type`, `action_version`, `payload`), as (retention, tenant): the
    payload's `tenant` (optional; vLLM's ReqContext does not carry the cache_salt, so an
    orchestrator that wants the quota of a salt names it here) and the `Retention` fields.
    None when no action is kvtier's; SteeringError (one line) for a kvtier.retain of another
    version or a bad payload. Other actions are not kvtier's: ignored."""
    for a in actions:
        if getattr(a, "action_type", None) != RETAIN_ACTION:
            continue
        version = str(getattr(a, "action_version", ""))
        if version != str(RETAIN_VERSION):
            raise SteeringError(f"{RETAIN_ACTION} version {version[:20]!r}: this kvtier "
                                f"understands version {RETAIN_VERSION}")
        payload = getattr(a, "payload", None)
        if not isinstance(payload, Mapping):
            raise SteeringError(f"{RETAIN_ACTION} v{RETAIN_VERSION}: payload must be an object")
        fields = dict(payload)
        tenant = fields.pop("tenant", None)
        if tenant is not None:
            check_tenant(tenant)
        return Retention.parse(fields), tenant
    return None


def check_tenant(name: object) -> str:
    """A tenant name: a string of at most MAX_TENANT_BYTES UTF-8 bytes ("" = default)."""
    if not isinstance(name, str) or len(name.encode()) > MAX_TENANT_BYTES:
        raise SteeringError(f"tenant {str(name)[:40]!r}: must be a string of at most "
                            f"{MAX_TENANT_BYTES} bytes")
    return name


def top_tenants(figs: Mapping[str, Any], top: int) -> dict[str, Any]:
    """Per-tenant figures (`KeyedHostCache.tenant_figures`) with bounded cardinality: the
    `top` tenants with the most host blocks by name, the others summed as "(other)" (with
    their count in `tenants`; quotas are not summed)."""
    if len(figs) <= top:
        return dict(figs)
    ranked = sorted(figs.items(), key=lambda kv: (-int(kv[1]["host_blocks"]), kv[0]))
    out: dict[str, Any] = dict(ranked[:top])
    other: dict[str, Any] = {"tenants": len(ranked) - top}
    for _, f in ranked[top:]:
        for k, v in f.items():
            if isinstance(v, int) and not isinstance(v, bool) and k != "quota_blocks":
                other[k] = other.get(k, 0) + v
    out["(other)"] = other
    return out


class Tenant:
    """One tenant's copies and figures. `order`: priority -> key -> node, oldest first;
    `count`: entries over every bucket; `quota`: host blocks, None = the default."""

    __slots__ = ("count", "evictions", "hit_tokens", "name", "order", "pinned", "quota",
                 "stores", "stores_refused")

    def __init__(self, name: str) -> None:
        self.name = name
        self.quota: int | None = None
        self.order: dict[int, OrderedDict[int, Node]] = {}
        self.count = 0
        self.pinned = 0
        self.stores = self.evictions = self.hit_tokens = self.stores_refused = 0


class _Hold:
    __slots__ = ("node", "pin", "until")

    def __init__(self, node: Node) -> None:
        self.node = node
        self.pin = False
        self.until = 0.0


MAX_STORAGE_MARKS = 1 << 17  # as many pages as a worker's own table holds per rank


class StorageMarks:
    """The retention the book sent to storage, by page key, so that a replaced worker (whose
    marks died with it) is told again: `resend` gives the RETAIN tasks of what still holds.

    Data structures: `_marks`: storage key -> [pin, TTL deadline (monotonic), priority],
    merged as the worker merges them (`worker/storage/retention.py`): a pin sticks until
    unpinned, a deadline is never moved earlier, a priority is replaced; an unpin keeps the
    rest. Invariant: at most `limit` keys (what the worker holds per rank); past it a new
    key is not recorded (`unrecorded`), as the worker refuses it. A mark that holds nothing
    any more (no pin, TTL passed, priority 0) is dropped when met; a page deleted (clear
    with storage, a storage reset) or found gone by a prefetch (missing, or damaged and
    deleted by the worker itself: the storage tier's `on_pages_gone`) is forgotten."""

    def __init__(self, limit: int = MAX_STORAGE_MARKS) -> None:
        self.limit = limit
        self._marks: dict[bytes, list[Any]] = {}
        self.unrecorded = 0  # keys not recorded: the table was full
        self.resent = 0  # pages re-sent to replaced workers

    def __len__(self) -> int:
        return len(self._marks)

    def retain(self, keys: Iterable[bytes], r: Retention, now: float) -> None:
        until = now + r.ttl_s if r.ttl_s > 0 else 0.0
        for k in keys:
            m = self._marks.get(k)
            if m is None:
                if len(self._marks) >= self.limit:
                    self.unrecorded += 1
                    continue
                m = self._marks[k] = [False, 0.0, 0]
            m[0] = m[0] or r.pin
            m[1] = max(m[1], until)
            m[2] = r.priority

    def unpin(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            m = self._marks.get(k)
            if m is not None:
                m[0] = False

    def forget(self, keys: Iterable[bytes] | None = None) -> None:
        """These pages were deleted (None: every page, a storage reset)."""
        if keys is None:
            self._marks.clear()
            return
        for k in keys:
            self._marks.pop(k, None)

    def held(self, now: float) -> list[tuple[bytes, bool, float, int]]:
        """What still holds, per page: (key, pin, seconds of TTL left, priority): a
        planned restart hands it to the next service (`node.handover`)."""
        return [(k, pin, max(0.0, until - now), prio)
                for k, (pin, until, prio) in self._marks.items()
                if pin or until > now or prio != 0]

    def resend(self, now: float) -> list[tuple[list[bytes], Retention]]:
        """What still holds, as retentions to send again, grouped (pin, whole seconds of TTL
        left rounded up, priority): one RETAIN task per group, not per page."""
        groups: dict[tuple[bool, int, int], list[bytes]] = {}
        for k, (pin, until, prio) in list(self._marks.items()):
            left = math.ceil(until - now) if until > now else 0
            if not pin and left == 0 and prio == 0:
                del self._marks[k]
                continue
            groups.setdefault((pin, left, prio), []).append(k)
        self.resent += sum(len(v) for v in groups.values())
        return [(keys, Retention(pin, float(left), prio))
                for (pin, left, prio), keys in groups.items()]


MAX_STORED_PAGES = 1 << 16  # blocks whose storing tenant is remembered: 10 MB at most


class StoredPages:
    """Which tenant stored each recent block of a namespace with a storage tier, by engine
    hash, so that a clear by tenant with `storage` reaches the pages of blocks no longer on
    the host (storage pages carry no tenant).

    Data structures: `_by_hash`: OrderedDict engine hash -> tenant, oldest store first (a
    store moves its block to the young end). Invariant: at most `limit` entries: past it the
    oldest is forgotten (`forgotten`), and a clear by tenant no longer reaches its page (the
    backend's own capacity or TTL still ends it). A block stored by another tenant later
    belongs to that tenant only. 65,536 entries measured 10.0 MB (tracemalloc)."""

    def __init__(self, limit: int = MAX_STORED_PAGES) -> None:
        self.limit = limit
        self._by_hash: OrderedDict[bytes, str] = OrderedDict()
        self.forgotten = 0

    def __len__(self) -> int:
        return len(self._by_hash)

    def add(self, block_hash: bytes, tenant: str) -> None:
        d = self._by_hash
        d.pop(block_hash, None)
        d[block_hash] = tenant
        if len(d) > self.limit:
            d.popitem(last=False)
            self.forgotten += 1

    def hashes(self, tenant: str | None) -> list[bytes]:
        """The blocks `tenant` stored (None: every block remembered)."""
        return [h for h, t in self._by_hash.items() if tenant is None or t == tenant]

    def forget(self, hashes: Iterable[bytes] | None = None) -> None:
        """These blocks' pages were deleted (None: every page, a storage reset)."""
        if hashes is None:
            self._by_hash.clear()
            return
        for h in hashes:
            self._by_hash.pop(h, None)


class TenantBook:
    """The tenants of one keyed namespace (see the module docstring). The caller holds the
    keyed surface's lock around every call."""

    def __init__(self, m: CacheCore) -> None:
        self.m = m
        self.tenants: dict[str, Tenant] = {}
        self.default_quota: int | None = None
        self._where: dict[int, tuple[Tenant, int]] = {}
        self._holds: dict[int, _Hold] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._pending: dict[int, tuple[str, Retention]] = {}
        # the retention sent to storage pages (re-sent to a replaced worker)
        self.storage_marks = StorageMarks()
        # who stored which block with a storage page (clear by tenant in storage)
        self.stored_pages = StoredPages()

    # ------------------------------------------------------------------ tenants

    def tenant(self, name: str) -> Tenant:
        t = self.tenants.get(name)
        if t is None:
            t = self.tenants[name] = Tenant(name)
        return t

    def quota_of(self, t: Tenant) -> int:
        q = t.quota if t.quota is not None else self.default_quota
        return self.m.host_capacity if q is None else q

    def set_quota(self, name: str | None, blocks: int | None) -> None:
        """A tenant's quota in host blocks (None: the default's); `name` None sets the
        default quota for tenants without one (None: the namespace's capacity)."""
        if blocks is not None and not 0 <= blocks <= self.m.host_capacity:
            raise SteeringError(f"quota of {blocks} blocks: must be in [0, "
                                f"{self.m.host_capacity}] (the namespace's host blocks)")
        if name is None:
            self.default_quota = blocks
        else:
            self.tenant(check_tenant(name)).quota = blocks

    def _live(self, key: int, node: Node) -> bool:
        return self.m.lookup(key) is node and node.host is not None

    def _drop(self, key: int) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            t, prio = where
            bucket = t.order[prio]
            bucket.pop(key, None)
            t.count -= 1
        hold = self._holds.pop(key, None)
        if hold is not None:
            if hold.pin and where is not None:
                where[0].pinned -= 1
            self.m.release_host_hold(hold.node)
        self._pending.pop(key, None)

    # ------------------------------------------------------------------ stores

    def own_victims(self, t: Tenant, k: int) -> list[Node] | None:
        """The copies of `t` to evict so that `k` more fit its quota (lowest priority first,
        oldest first); None when its evictable copies are too few (pinned, in a TTL, being
        copied). Stale entries met are purged."""
        quota = self.quota_of(t)
        over = t.count + k - quota
        if over <= 0 or quota >= self.m.host_capacity:  # no own quota: the namespace's order
            return []
        out: list[Node] = []
        for prio in sorted(t.order):
            bucket = t.order[prio]
            for key, node in list(bucket.items()):
                if over <= len(out):
                    return out
                if not self._live(key, node):
                    self._drop(key)
                    over -= 1
                    continue
                hold = self._holds.get(key)
                if hold is not None and (hold.pin or hold.until > self._now
                                         or node.flags & HOST_BUSY & ~PINNED):
                    continue  # pinned, in its TTL, or busy besides its hold (a load)
                if hold is None and node.hprev is None:
                    continue  # busy: being loaded or backed up
                out.append(node)
        return out if over <= len(out) else None

    _now = 0.0

    def low_priority_victims(self, n: int, storing: Tenant) -> list[Node]:
        """Up to `n` evictable copies of priority < 0 of tenants `protects` does not keep from
        `storing`, lowest priority first: evicted before the namespace's order is asked."""
        out: list[Node] = []
        for t in self.tenants.values():
            for prio in sorted(p for p in t.order if p < 0):
                for key, node in list(t.order[prio].items()):
                    if len(out) >= n:
                        return out
                    if not self._live(key, node):
                        self._drop(key)
                    elif node.hprev is not None and not self.protects(key, storing):
                        out.append(node)
        return out

    def protects(self, key: int, storing: Tenant) -> bool:
        """Whether the copy `key` is kept from a store of `storing`: another tenant's, one
        with an explicit quota it is within."""
        where = self._where.get(key)
        if where is None:
            return False
        t = where[0]
        return t is not storing and t.quota is not None and t.count <= t.quota

    def evict(self, nodes: Iterable[Node]) -> list[int]:
        """Evict these copies now (the core's `evict_host_copy`), each counted to its
        tenant; returns the keys evicted."""
        out: list[int] = []
        for node in nodes:
            key = node.key
            if key is None:
                continue
            where = self._where.get(key)
            hold = self._holds.get(key)
            if hold is not None:
                self.m.release_host_hold(node)
            if not self.m.evict_host_copy(node):
                if hold is not None:  # busy now (a load): kept, held again, still booked
                    self.m.hold_host_copy(node)
                continue
            self._holds.pop(key, None)
            out.append(key)
            if where is not None:
                where[0].evictions += 1
            self._drop(key)
        return out

    def stored(self, key: int, node: Node, tenant: str, now: float) -> None:
        """A store of `tenant` was prepared for `key` (its copy is being written)."""
        self._drop(key)
        t = self.tenant(tenant)
        t.order.setdefault(0, OrderedDict())[key] = node
        self._where[key] = (t, 0)
        t.count += 1
        t.stores += 1

    def landed(self, key: int, now: float) -> None:
        """A store completed: a retention asked while it was written applies now."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            self._now = now
            node = self.m.lookup(key)
            if node is not None:
                self._apply(key, node, self.tenant(pending[0]), pending[1], now)

    def forget(self, key: int) -> None:
        """The copy of `key` is gone (a failed store, a write-off)."""
        self._drop(key)

    def victims_of_others(self, keys: Iterable[int], storing: Tenant) -> bool:
        """Whether any of the namespace order's victims `keys` is protected from `storing`."""
        return any(self.protects(k, storing) for k in keys)

    def evicted_by_order(self, keys: Iterable[int]) -> None:
        """The namespace's eviction order took these copies (a store's room)."""
        for k in keys:
            where = self._where.get(k)
            if where is not None:
                where[0].evictions += 1
            self._drop(k)

    # ------------------------------------------------------------------ hits

    def hit(self, key: int, tokens: int) -> None:
        where = self._where.get(key)
        if where is not None:
            t, prio = where
            t.hit_tokens += tokens
            bucket = t.order[prio]
            if key in bucket:
                bucket.move_to_end(key)

    # ------------------------------------------------------------------ retention

    def retain(self, items: list[tuple[int, Node | None]], tenant: str | None,
               r: Retention, now: float) -> dict[str, int]:
        """Apply `r` to these blocks (key, node or None when not cached). A pin the tenant's
        quota cannot hold is refused whole (SteeringError, nothing changed). Blocks being
        written get it when they land; blocks not cached are counted `absent`."""
        self.expire(now)
        live = [(k, n) for k, n in items if n is not None and n.key is not None]
        if r.pin:
            by_tenant: dict[str, int] = {}
            for k, _n in live:
                hold = self._holds.get(k)
                if hold is not None and hold.pin:
                    continue
                where = self._where.get(k)
                name = where[0].name if where is not None else (tenant or DEFAULT_TENANT)
                by_tenant[name] = by_tenant.get(name, 0) + 1
            for name, n in by_tenant.items():
                t = self.tenant(name)
                q = self.quota_of(t)
                if t.pinned + n > q:
                    raise SteeringError(
                        f"pin of {n} blocks refused: tenant {name!r} has {t.pinned} pinned, "
                        f"quota {q} blocks")
        out = {"applied": 0, "pending": 0, "absent": len(items) - len(live)}
        for k, node in live:
            where = self._where.get(k)
            t = where[0] if where is not None else self.tenant(tenant or DEFAULT_TENANT)
            if node.flags & (ENGINE_WRITE | PREFETCHING):
                self._pending[k] = (t.name, r)
                out["pending"] += 1
                continue
            self._apply(k, node, t, r, now)
            out["applied"] += 1
        return out

    def _apply(self, key: int, node: Node, t: Tenant, r: Retention, now: float) -> None:
        where = self._where.get(key)
        if where is None:  # a copy nobody booked (a prefetch): it becomes t's
            t.order.setdefault(r.priority, OrderedDict())[key] = node
            self._where[key] = (t, r.priority)
            t.count += 1
        elif where[1] != r.priority:
            t = where[0]
            t.order[where[1]].pop(key, None)
            t.order.setdefault(r.priority, OrderedDict())[key] = node
            self._where[key] = (t, r.priority)
        hold = self._holds.get(key)
        if hold is None:
            if not (r.pin or r.ttl_s > 0 or r.priority > 0):
                return
            if not self.m.hold_host_copy(node):
                return
            hold = self._holds[key] = _Hold(node)
        if r.pin and not hold.pin:
            hold.pin = True
            t.pinned += 1
        if r.ttl_s > 0:
            until = now + r.ttl_s
            if until > hold.until:
                hold.until = until
                heapq.heappush(self._deadlines, (until, key))
        self._release_if_free(key, hold)

    def _release_if_free(self, key: int, hold: _Hold) -> None:
        where = self._where.get(key)
        prio = where[1] if where is not None else 0
        if not hold.pin and hold.until <= self._now and prio <= 0:
            del self._holds[key]
            self.m.release_host_hold(hold.node)

    def unpin(self, keys: Iterable[int]) -> int:
        n = 0
        for k in keys:
            hold = self._holds.get(k)
            if hold is not None and hold.pin:
                hold.pin = False
                where = self._where.get(k)
                if where is not None:
                    where[0].pinned -= 1
                n += 1
                self._release_if_free(k, hold)
        return n

    def expire(self, now: float) -> None:
        """Release the holds whose TTL passed (and nothing else asks them)."""
        self._now = now
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            hold = self._holds.get(key)
            if hold is not None and hold.until <= now:
                self._release_if_free(key, hold)

    def retention_of(self, key: int) -> dict[str, Any] | None:
        hold = self._holds.get(key)
        where = self._where.get(key)
        if hold is None and (where is None or where[1] == 0):
            return None
        return {"pin": bool(hold and hold.pin),
                "ttl_left_s": max(0.0, hold.until - self._now) if hold else 0.0,
                "priority": where[1] if where else 0}

    # ------------------------------------------------------------------ clear and figures

    def keys_of(self, name: str) -> list[int]:
        t = self.tenants.get(name)
        if t is None:
            return []
        return [k for bucket in t.order.values() for k in bucket]

    def tenant_of(self, key: int) -> str | None:
        where = self._where.get(key)
        return None if where is None else where[0].name

    def figures(self, now: float) -> dict[str, dict[str, Any]]:
        """Per tenant: host blocks (stale entries purged first), of them pinned, held and
        with a storage copy; hit tokens, stores, evictions, refused stores, quota."""
        self.expire(now)
        out: dict[str, dict[str, Any]] = {}
        for t in list(self.tenants.values()):
            stored = held = 0
            for bucket in list(t.order.values()):
                for key, node in list(bucket.items()):
                    if not self._live(key, node):
                        self._drop(key)
                        continue
                    stored += bool(node.flags & STORED)
                    held += key in self._holds
            out[t.name] = {
                "host_blocks": t.count, "storage_blocks": stored, "pinned_blocks": t.pinned,
                "held_blocks": held, "hit_tokens": t.hit_tokens, "stores": t.stores,
                "evictions": t.evictions, "stores_refused": t.stores_refused,
                "quota_blocks": self.quota_of(t), "quota_explicit": t.quota is not None}
        return out

    def check_invariants(self) -> None:
        for t in self.tenants.values():
            assert t.count == sum(len(b) for b in t.order.values()), f"tenant {t.name} count"
            for prio, bucket in t.order.items():
                for key in bucket:
                    assert self._where[key] == (t, prio), f"key {key:x} booked twice"
        for key, hold in self._holds.items():
            if self._live(key, hold.node):
                assert self.m.is_pinned(hold.node), f"held {key:x} not pinned in the core"
