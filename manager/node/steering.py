"""Steering a cache by token ids (issue 36): lookup, retain, unpin, quotas, warm, clear,
per-tenant figures, for the admin (`kvtier.admin.steering`) and the `kvtier` command.

What it steers is a set of `SteeredNamespace`s (a `NamespaceSource`): the node service's
`Namespaces` (one per model namespace its engines attached), or an embedded kvtier's one
keyed stack (`kvtier.engine.embedded`, the namespace of the vLLM instance it runs in). A
request names its namespace, or omits it where exactly one is served.

Token ids become the engine's own block hashes (`keys.engine_block_hashes`, with the
namespace's `BlockNaming`: the hash algorithm, seed and block size the node's first engine
announced in HELLO, or the embedded engine's own), so
every operation names exactly the blocks the engines stored; the request's `cache_salt`
(the tenant) is part of the first block's hash, as in vLLM. That holds only where the
engine hashes blocks of kvtier's block size: a namespace whose HELLO said otherwise (vLLM's
`hash_block_size`, finer in a hybrid model), or whose engine keeps several KV cache groups
(each block keyed per group: HELLO's `kv_groups`, the embedded adapter's naming), refuses
every operation by token ids in one line (422).
Each operation is one call into
the namespace's `KeyedHostCache` under its lock; refusals are one-line `SteeringError`s and
change nothing.

    lookup(ns, tokens, salt)   -> matched tokens per tier (host ready, pending, storage's
                                  index), the hashing and lookup time
    retain / unpin             -> TenantBook.retain (a pin over quota refused whole)
    quota(ns, tenant, blocks)  -> TenantBook.set_quota (tenant None: the default)
    warm(ns, tokens, salt)     -> one storage query + prefetch into the host tier; poll with
                                  lookup (its `host` grows to the prefix storage held)
    clear(ns, tenant | tokens | all, storage)
                               -> host copies written off, with `storage` their pages
                                  deleted (KeyedHostCache.clear), every removal announced
                                  in the tier events at once
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.manager.errors import KvtierError
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.keys import BlockNaming, TokenKeyError, engine_block_hashes
from kvtier.manager.tenants import Retention, SteeringError, check_tenant

MAX_STEER_TOKENS = 1 << 18  # 262,144 tokens: 16,384 blocks of 16
TOP_TENANTS = 8  # /metrics: the 8 tenants with the most host blocks, the rest as "(other)"
MAX_TENANTS_LISTED = 1024  # GET /tenants
_warm_ids = itertools.count(1)


class NamespaceUnknown(KvtierError):
    """A namespace not served here (the admin answers 404, one line)."""


class SteeredNamespace(Protocol):
    """What steering acts on: one namespace's keyed surface (its tenant book inside), how
    its engines name blocks, and its page size (quota bytes -> blocks). The node's
    `Namespace` is one; an embedded kvtier supplies its own."""

    @property
    def name(self) -> str: ...

    @property
    def keyed(self) -> KeyedHostCache: ...

    @property
    def page_bytes(self) -> int: ...

    @property
    def ranks(self) -> int: ...

    def block_naming(self) -> BlockNaming:
        """Read at each operation (an embedded engine may learn its seed after start)."""
        ...

    def tenant_figures(self, top: int) -> dict[str, Any]: ...


class NamespaceSource(Protocol):
    """The namespaces served now (`Namespaces.all`; an embedded kvtier: its one)."""

    def all(self) -> Sequence[SteeredNamespace]: ...


class OneNamespace:
    """A `NamespaceSource` of one namespace (an embedded kvtier's)."""

    def __init__(self, ns: SteeredNamespace) -> None:
        self.ns = ns

    def all(self) -> Sequence[SteeredNamespace]:
        return (self.ns,)


def _tokens(token_ids: Sequence[int]) -> list[int]:
    if len(token_ids) > MAX_STEER_TOKENS:
        raise SteeringError(f"{len(token_ids)} token ids, at most {MAX_STEER_TOKENS}")
    out = list(token_ids)
    for t in out:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 1 << 31:
            raise SteeringError(f"token id {t!r}: must be an integer in [0, 2**31)")
    return out


class Steering:
    """The steering operations over the namespaces of `source` (see the module docstring).
    Holds no state of its own: every figure and mark lives in a namespace's keyed surface."""

    def __init__(self, source: NamespaceSource) -> None:
        self.source = source

    def namespace(self, name: str | None) -> SteeredNamespace:
        """The namespace `name`; None: the one served (refused in one line when there are
        several or none)."""
        served = self.source.all()
        if name is None:
            if len(served) == 1:
                return served[0]
            if not served:
                raise NamespaceUnknown("no namespace is served here yet (no engine attached)")
            raise SteeringError(f"give a namespace: {len(served)} are served here "
                                f"({sorted(ns.name for ns in served)})")
        for ns in served:
            if ns.name == name:
                return ns
        known = sorted(ns.name for ns in served)
        raise NamespaceUnknown(f"namespace {name!r}: not served here (attached: {known})")

    def hashes(self, ns: SteeredNamespace, token_ids: Sequence[int],
               cache_salt: str | None) -> list[bytes]:
        naming = ns.block_naming()
        bs = ns.keyed.block_size
        if naming.kv_groups > 1:  # each group's keys are its own, not vLLM's block hash
            raise SteeringError(
                f"namespace {ns.name!r}: its engine keeps {naming.kv_groups} KV cache groups "
                "(a hybrid model), each keyed per group: token ids cannot name its blocks")
        if naming.hash_block_size != bs:
            raise SteeringError(
                f"namespace {ns.name!r}: its engine hashes blocks of "
                f"{naming.hash_block_size} tokens, kvtier's blocks are {bs}: token ids "
                "cannot name them")
        if cache_salt is not None:
            check_tenant(cache_salt)
        try:
            return engine_block_hashes(naming.algo, naming.seed, bs, _tokens(token_ids),
                                       cache_salt)
        except TokenKeyError as e:
            raise SteeringError(f"namespace {ns.name!r}: {e}") from None

    def lookup(self, namespace: str | None, token_ids: Sequence[int],
               cache_salt: str | None = None) -> dict[str, Any]:
        ns = self.namespace(namespace)
        t0 = time.perf_counter()
        hashes = self.hashes(ns, token_ids, cache_salt)
        t1 = time.perf_counter()
        found = ns.keyed.tier_lookup(hashes)
        t2 = time.perf_counter()
        bs = ns.keyed.block_size
        return {"namespace": ns.name, "tokens": len(token_ids), "blocks": len(hashes),
                "matched_tokens": {tier: n * bs for tier, n in found.items()},
                "hash_us": round((t1 - t0) * 1e6, 1), "lookup_us": round((t2 - t1) * 1e6, 1)}

    def retain(self, namespace: str | None, token_ids: Sequence[int], retention: Retention,
               cache_salt: str | None = None, tenant: str | None = None) -> dict[str, Any]:
        ns = self.namespace(namespace)
        hashes = self.hashes(ns, token_ids, cache_salt)
        who = tenant if tenant is not None else cache_salt
        return {"blocks": len(hashes), **ns.keyed.retain(hashes, retention, who),
                "retention": retention.as_dict()}

    def unpin(self, namespace: str | None, token_ids: Sequence[int],
              cache_salt: str | None = None) -> dict[str, Any]:
        ns = self.namespace(namespace)
        hashes = self.hashes(ns, token_ids, cache_salt)
        return {"blocks": len(hashes), "unpinned": ns.keyed.unpin(hashes)}

    def set_quota(self, namespace: str | None, tenant: str | None, *, blocks: int | None = None,
                  quota_bytes: int | None = None) -> dict[str, Any]:
        ns = self.namespace(namespace)
        if blocks is not None and quota_bytes is not None:
            raise SteeringError("give quota_blocks or quota_bytes, not both")
        if quota_bytes is not None:
            blocks = quota_bytes // (ns.page_bytes * ns.ranks)
        if tenant is not None:
            check_tenant(tenant)
        ns.keyed.set_quota(tenant, blocks)
        return {"namespace": ns.name, "tenant": tenant, "quota_blocks": blocks}

    def tenants(self, namespace: str | None = None) -> dict[str, Any]:
        nss = [self.namespace(namespace)] if namespace is not None else self.source.all()
        return {ns.name: ns.tenant_figures(MAX_TENANTS_LISTED) for ns in nss}

    def warm(self, namespace: str | None, token_ids: Sequence[int],
             cache_salt: str | None = None) -> dict[str, Any]:
        ns = self.namespace(namespace)
        hashes = self.hashes(ns, token_ids, cache_salt)
        if ns.keyed.storage is None:
            raise SteeringError(f"namespace {ns.name!r}: no storage tier to warm from")
        state = ns.keyed.warm(hashes, f"warm:{next(_warm_ids)}")
        bs = ns.keyed.block_size
        found = ns.keyed.tier_lookup(hashes)
        return {"namespace": ns.name, "blocks": len(hashes), "asked": state,
                "matched_tokens": {tier: n * bs for tier, n in found.items()},
                "poll": "POST /lookup with the same tokens: matched_tokens.host grows to "
                        "the prefix storage held"}

    def clear(self, namespace: str | None, *, tenant: str | None = None,
              token_ids: Sequence[int] | None = None, cache_salt: str | None = None,
              everything: bool = False, storage: bool = False) -> dict[str, Any]:
        ns = self.namespace(namespace)
        chosen = sum(x for x in (tenant is not None, token_ids is not None, everything))
        if chosen != 1:
            raise SteeringError("clear: give exactly one of tenant, token_ids, all")
        hashes = None if token_ids is None else self.hashes(ns, token_ids, cache_salt)
        if tenant is not None:
            check_tenant(tenant)
        # a storage deletion is waited for up to 5 s (the lock is released meanwhile)
        out = ns.keyed.clear(hashes=hashes, tenant=tenant, storage=storage,
                             wait_s=5.0 if storage else 0.0)
        return {"namespace": ns.name, **out}
