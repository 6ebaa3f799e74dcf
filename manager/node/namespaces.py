"""The namespaces a node service serves: one keyed stack per namespace, sized by its quota.

A namespace is what makes one engine block hash mean the same KV bytes in two engines (the
model, its KV layout, parallelism and hash seed: the vLLM adapter's storage namespace).
Engines of one namespace share its blocks; engines of two namespaces never see each other's,
because each namespace has a stack of its own (its own tree, host pools and LRU):

    first attach of namespace N      geometry fixed (the engine's KV shape, block size, hash
      -> Stack(cfg_N, keyed_namespace=N).start()   algorithm and seed, ranks), host pools of
                                     quota_N // (page bytes x ranks) blocks per rank, worker
                                     processes named after `deployment_id_N`; the storage
                                     tier is the service's (same backend, pages namespaced)
    later attach of N                must have the same geometry, else refused
    engines of N detach / die        the stack stays: its blocks outlive every engine
    kvtier serve stops               every stack closed, every segment unlinked (with
                                     node.handover: kept and handed over, `handover`)
    first attach after a restart     a hand-over's pages adopted (`handover.Adoption`), else
    (node.handover)                  a crashed service's journaled pages that check
                                     (`journal.recover`); then a fresh journal (`Journal`)

Refusals (`NamespaceRefused`, one line): a geometry unlike the namespace's, a quota under one
block, a new namespace beyond `node.host_budget_bytes`, a stack that does not start.

Data structures: `Namespaces._by_name`: namespace -> `Namespace` (its config, stack, keyed
surface, geometry, the sessions attached). Invariant: the sum of every namespace's host bytes
stays within `node.host_budget_bytes` when that is set (a namespace whose stack is starting
counts, `_starting`). A namespace's stack is started outside the registry lock: an attach of
an existing namespace, or of another new one, never waits for it; a second attach of the
namespace being started waits for that start (and is refused with it if it fails).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from kvtier.manager.config import ConfigError, KvtierConfig, page_bytes, with_sections
from kvtier.manager.errors import KvtierError
from kvtier.manager.keyed import KeyedHostCache
from kvtier.manager.keys import BlockNaming
from kvtier.manager.launcher import WarmWorkers
from kvtier.manager.node.fanout import EventFanout
from kvtier.manager.node.handover import Adoption, unlink_kept
from kvtier.manager.node.journal import Journal, adopt_recovered, recover
from kvtier.manager.node.wire import Hello, Segment
from kvtier.manager.sessions import Graves
from kvtier.manager.stack import Stack
from kvtier.manager.tenants import top_tenants
from kvtier.worker.spec import host_segments

log = logging.getLogger("kvtier.node")
STATUS_TENANTS = 32  # tenants named in /status (the rest summed as "(other)")


class NamespaceRefused(KvtierError):
    """An attach the node cannot serve; the message is the one line the engine is told."""


def namespace_deployment_id(base: str, namespace: str) -> str:
    """The deployment id of a namespace's stack: stable across restarts of the service (so a
    killed service's segments are found and removed when the namespace attaches again), at
    most 32 characters."""
    digest = hashlib.sha256(f"{base}\0{namespace}".encode()).hexdigest()[:10]
    return f"{base[:19].rstrip('-')}-n{digest}"


class Namespace:
    """One namespace's stack and who uses it.

    Data structures: `stack` (keyed, started), `keyed` (its `KeyedHostCache`), `geometry`
    (what every engine of it must match), `sessions` (ids of the engines attached now),
    `engines_seen` (attaches ever), `fanout` (its tier events, one log, a cursor per
    reader: the publisher and each engine connection that asked for them). Invariant:
    `host_blocks * page_bytes * ranks` is at most `quota_bytes`."""

    def __init__(self, name: str, cfg: KvtierConfig, geometry: dict[str, Any],
                 quota_bytes: int, stack: Stack) -> None:
        self.name = name
        self.cfg = cfg
        self.geometry = geometry
        self.quota_bytes = quota_bytes
        self.stack = stack
        self.keyed: KeyedHostCache = stack.require_keyed()
        self.ranks = cfg.workers.count
        self.host_blocks = cfg.cache.host_blocks
        self.page_bytes = page_bytes(cfg)
        # the first engine's tokens per block hash (HELLO): token-id steering needs it equal
        # to `geometry["block_size"]` (`Steering.hashes` refuses otherwise)
        self.hash_block_size = int(geometry["block_size"])
        # its engines' KV cache groups (HELLO): several refuse token-id steering too
        self.kv_groups = 1
        self.sessions: set[int] = set()
        self.engines_seen = 0
        self.created = time.time()
        self.fanout = EventFanout(self.keyed.take_events_and_state,
                                  cfg.node.events_interval_s)
        # blocks the engines of this namespace looked up / loaded (by where the host copy
        # came from) / stored, engines that left included
        self.blocks = dict.fromkeys(("looked_up", "loaded_host", "loaded_storage", "stored"),
                                    0)
        # a predecessor's hand-over or crash journal (issue 37): blocks handed over, found
        # in the journal (recovered), adopted, discarded
        # (and, of a hand-over, the abandoned stores still held for their grace)
        self.restart = dict.fromkeys(("handed_over", "recovered", "adopted", "discarded",
                                      "held"), 0)
        # the crash journal (node.handover): its kept pools and page checksums
        self.journal: Journal | None = None

    @property
    def host_bytes(self) -> int:
        return self.host_blocks * self.page_bytes * self.ranks

    def subscribe_events(self) -> int:
        """A new reader of this namespace's tier events (events switched on from now if
        they were not: blocks cached before are announced once named again)."""
        self.keyed.enable_events()
        return self.fanout.subscribe()

    def drain_events(self) -> None:
        """Housekeeping (the server's thread): the keyed cache's events taken into the
        fan-out when due."""
        if self.keyed.events is not None:
            self.fanout.drain_if_due()

    def segments(self) -> tuple[Segment, ...]:
        """The host pool of every rank, with its inode now (KvtierError while a rank's
        worker is being replaced)."""
        try:
            found = host_segments(self.cfg.deployment_id, self.ranks,
                                  self.cfg.node.allowed_gid)
        except OSError as e:
            raise KvtierError(f"namespace {self.name!r}: a rank's host pool is not there "
                              f"now ({e.filename}: {e.strerror})") from None
        return tuple(Segment(r, name, inode, self.host_blocks) for r, name, inode in found)

    def used_bytes(self) -> int:
        m = self.keyed.m
        return (m.host_capacity - m.host_free) * self.page_bytes * self.ranks

    def status(self) -> dict[str, Any]:
        return {"namespace": self.name, "deployment_id": self.cfg.deployment_id,
                "quota_bytes": self.quota_bytes, "host_bytes": self.host_bytes,
                "used_bytes": self.used_bytes(), "host_blocks": self.host_blocks,
                "ranks": self.ranks, "engines": len(self.sessions),
                "engines_seen": self.engines_seen, "generation": self.keyed.generation,
                "blocks": dict(self.blocks), "restart": dict(self.restart),
                "events": {"readers": self.fanout.consumers, "next_seq": self.fanout.next_seq,
                           "held_hashes": self.fanout.held, "resyncs": self.fanout.resyncs,
                           "trimmed": self.fanout.trimmed},
                "counters": dict(self.keyed.counters),
                # the namespace's storage tier: backups, deletions, retention sent to it
                "storage_counters": (None if self.stack.storage is None
                                     else dict(self.stack.storage.counters)),
                "tenants": self.tenant_figures(STATUS_TENANTS)}

    def tenant_figures(self, top: int) -> dict[str, Any]:
        """Per tenant figures (`KeyedHostCache.tenant_figures`): the `top` tenants with the
        most host blocks by name, the others summed as "(other)" (bounded cardinality)."""
        return top_tenants(self.keyed.tenant_figures(), top)

    def block_naming(self) -> BlockNaming:
        """How this namespace's engines name blocks from token ids (its first HELLO)."""
        g = self.geometry
        return BlockNaming(str(g["hash_algo"]), str(g["hash_seed"]), self.hash_block_size,
                           self.kv_groups)


class _Starting:
    """A namespace whose stack one attach is starting: its host bytes (held against the
    budget) and the outcome the others wait for."""

    def __init__(self, host_bytes: int) -> None:
        self.host_bytes = host_bytes
        self.done = threading.Event()
        self.error: str | None = None


class Namespaces:
    """Every namespace of the node (see the module docstring)."""

    def __init__(self, base: KvtierConfig) -> None:
        self.base = base
        self._by_name: dict[str, Namespace] = {}
        self._starting: dict[str, _Starting] = {}  # namespaces whose stack is starting
        self._lock = threading.Lock()
        self._closed = False
        self._stopped: list[Namespace] = []  # closed, their journals still mapped
        self.adoption: Adoption | None = None  # the node server's (a hand-over to adopt)
        # worker processes started warm for a take-over's namespaces (their imports done
        # while the old service still served), taken by the stacks started from it
        self.warm: WarmWorkers | None = None
        # the node server's abandoned copies (a hand-over's held pages are held there)
        self.graves: Graves | None = None

    def namespace_config(self, hello: Hello) -> tuple[KvtierConfig, int]:
        """The configuration of a namespace's stack and its quota in bytes."""
        base = self.base
        quota = base.node.quota(hello.namespace)
        model = {k: hello.shape[k] for k in ("num_layers", "num_kv_heads", "head_dim", "dtype",
                                              "num_extra_layers", "kv_scales")}
        model["name"] = hello.namespace[:200]
        sections: dict[str, dict[str, Any]] = {
            "model": model,
            # the engine owns the device tier: a one-block device pool nobody uses
            "cache": {"block_size": hello.block_size, "device_blocks": 1,
                      "decode_reserve_blocks": 0, "host_blocks": 1},
            "workers": {"count": hello.ranks, "device": "cpu", "engine_kv": False,
                        "cuda_devices": ""},
            "storage": {"prefetch_host_blocks_limit": None},
        }
        did = namespace_deployment_id(base.deployment_id, hello.namespace)
        try:
            probe = with_sections(base, {"deployment_id": did}, sections)
            per_block = page_bytes(probe) * hello.ranks
            blocks = quota // per_block
            if blocks < 1:
                raise NamespaceRefused(
                    f"namespace {hello.namespace!r}: its quota of {quota} bytes "
                    f"(node.namespace_quota_bytes / node.quotas) is less than one block "
                    f"({per_block} bytes over {hello.ranks} rank(s))")
            sections["cache"]["host_blocks"] = blocks
            return with_sections(base, {"deployment_id": did}, sections), quota
        except ConfigError as e:
            raise NamespaceRefused(f"namespace {hello.namespace!r}: the engine's geometry "
                                   f"is not one kvtier can hold: {e}") from None

    def attach(self, hello: Hello, session: int | None) -> Namespace:
        """The namespace of this engine, started on its first attach. NamespaceRefused.
        `session` None: only started (a hand-over's namespace, before its engines
        reattach), no engine joins."""
        geometry = hello.geometry()
        while True:
            with self._lock:
                if self._closed:
                    raise NamespaceRefused("the node service is stopping")
                ns = self._by_name.get(hello.namespace)
                starting = self._starting.get(hello.namespace)
                if ns is None and starting is None:
                    cfg, quota, host = self._reserve(hello)
                    starting = self._starting[hello.namespace] = _Starting(host)
                    break
                if ns is not None:
                    return self._join(ns, hello, geometry, session)
            assert starting is not None
            starting.done.wait()  # another engine is starting it: its outcome, then again
            if starting.error is not None:
                raise NamespaceRefused(starting.error)
        try:
            ns = self._start(hello, geometry, cfg, quota)
        except BaseException as e:
            with self._lock:
                del self._starting[hello.namespace]
            starting.error = (str(e) if isinstance(e, NamespaceRefused) else
                              f"namespace {hello.namespace!r}: its stack did not start")
            starting.done.set()
            raise
        with self._lock:
            del self._starting[hello.namespace]
            closed = self._closed
            if not closed:
                self._by_name[hello.namespace] = ns
        starting.done.set()
        if closed:  # the service stopped while it started
            ns.stack.close()
            raise NamespaceRefused("the node service is stopping")
        with self._lock:
            return self._join(ns, hello, geometry, session)

    def _join(self, ns: Namespace, hello: Hello, geometry: dict[str, Any],
              session: int | None) -> Namespace:
        """The engine joins a started namespace (under the lock)."""
        if ns.geometry != geometry:
            diff = sorted(k for k in geometry if geometry[k] != ns.geometry.get(k))
            raise NamespaceRefused(
                f"namespace {hello.namespace!r} is attached with another geometry "
                f"({', '.join(diff)} differ: {[ns.geometry[k] for k in diff]} there, "
                f"{[geometry[k] for k in diff]} here)")
        if session is not None:
            ns.sessions.add(session)
            ns.engines_seen += 1
            # an engine's own word (a namespace adopted from a hand-over had none): its
            # engines share one identity, groups included
            ns.kv_groups = max(ns.kv_groups, hello.kv_groups)
        return ns

    def _reserve(self, hello: Hello) -> tuple[KvtierConfig, int, int]:
        """A new namespace's config, quota and host bytes, held to the node's budget (under
        the lock: the namespaces started and starting count)."""
        cfg, quota = self.namespace_config(hello)
        budget = self.base.node.host_budget_bytes
        host = cfg.cache.host_blocks * page_bytes(cfg) * cfg.workers.count
        used = (sum(n.host_bytes for n in self._by_name.values())
                + sum(s.host_bytes for s in self._starting.values()))
        if budget and used + host > budget:
            raise NamespaceRefused(
                f"namespace {hello.namespace!r}: {host} more host bytes would exceed "
                f"node.host_budget_bytes = {budget} ({used} held by "
                f"{len(self._by_name) + len(self._starting)} namespace(s))")
        return cfg, quota, host

    def _start(self, hello: Hello, geometry: dict[str, Any], cfg: KvtierConfig,
               quota: int) -> Namespace:
        """Its stack started (outside the registry lock)."""
        log.info("namespace %r: starting its stack %s (%d host blocks of %d bytes x %d "
                 "rank(s), quota %d bytes)", hello.namespace, cfg.deployment_id,
                 cfg.cache.host_blocks, page_bytes(cfg), cfg.workers.count, quota)
        adoption = self.adoption
        keep = self.base.node.handover
        rec = None if adoption is None else adoption.take(
            hello.namespace, cfg.deployment_id, geometry, page_bytes(cfg),
            cfg.cache.host_blocks, cfg.workers.count)
        did, ranks, blocks, pbytes = (cfg.deployment_id, cfg.workers.count,
                                      cfg.cache.host_blocks, page_bytes(cfg))
        # no hand-over: what a dead service's journal vouches for (checked once adopted)
        slots = recover(did, ranks, blocks, pbytes, geometry) if keep and rec is None else []
        if not keep and rec is None:  # a crashed service's kept pools, not wanted now
            unlink_kept(self.base.deployment_id, did)
        stack = Stack(cfg, keyed_namespace=hello.namespace.encode())
        # its workers adopt the kept segments (a fresh pool where there is none)
        stack.adopt_host = rec is not None or bool(slots)
        stack.warm = self.warm
        try:
            stack.start()
        except KvtierError as e:
            if adoption is not None and rec is not None:
                adoption.discard(rec, "its stack did not start")
            raise NamespaceRefused(
                f"namespace {hello.namespace!r}: its stack did not start: {e}") from None
        finally:
            stack.adopt_host = False  # a worker restarted later creates a fresh pool
        ns = Namespace(hello.namespace, cfg, geometry, quota, stack)
        ns.hash_block_size = hello.hash_block_size or hello.block_size
        if ns.hash_block_size != hello.block_size:
            log.warning("namespace %r: the engine hashes blocks of %d tokens, kvtier's are %d: "
                        "token-id steering (lookup, retain, warm, clear by tokens) is refused "
                        "for it", hello.namespace, ns.hash_block_size, hello.block_size)
        if adoption is not None and rec is not None:
            try:
                inodes = [i for _, _, i in host_segments(did, ranks)]
            except OSError:
                inodes = []
            if adoption.adopt(rec, ns.keyed, inodes) and self.graves is not None:
                adoption.hold(rec, ns.keyed, self.graves)
        if adoption is not None and hello.namespace in adoption.figures:
            ns.restart.update(adoption.figures[hello.namespace])
        if keep:
            self._open_journal(ns, geometry, slots)
        if self.base.node.events:
            # from its first block on (the publisher's next tick reports it)
            ns.keyed.enable_events()
        return ns

    def _open_journal(self, ns: Namespace, geometry: dict[str, Any],
                      slots: list[tuple[bytes, int, bytes | None, bool, list[int]]]) -> None:
        """The namespace's crash journal (`journal`): the recovered pages that check
        adopted; otherwise it is made in the background (mapping a 4 GiB pool populated took
        0.2 s, on the path of the first engine's WELCOME after a restart): stores completed
        before it exists are ready copies by then, which `record_ready` records."""
        if slots:
            if self._create_journal(ns, geometry, populate=True):
                assert ns.journal is not None
                t0 = time.perf_counter()
                adopted, discarded = adopt_recovered(ns.journal, ns.keyed, slots)
                ns.restart.update(recovered=len(slots), adopted=adopted, discarded=discarded)
                log.info("namespace %r: after a crash, %d of %d journaled block(s) adopted "
                         "(%d did not check; %.0f ms)", ns.name, adopted, len(slots),
                         discarded, (time.perf_counter() - t0) * 1e3)
            return
        threading.Thread(target=self._journal_later, args=(ns, geometry), daemon=True,
                         name="kvtier-journal").start()

    def _create_journal(self, ns: Namespace, geometry: dict[str, Any],
                        populate: bool = False) -> bool:
        try:
            journal = Journal.create(ns.cfg.deployment_id, ns.ranks, ns.host_blocks,
                                     ns.page_bytes, geometry, populate)
        except OSError as e:
            log.warning("namespace %r: no crash journal (%s): a crash will lose its host "
                        "tier", ns.name, e.strerror or e)
            return False
        with self._lock:
            if self._closed:  # the service stopped meanwhile: `close` did not see it
                journal.close(keep=self.base.node.handover)
                return False
            ns.journal = journal
        return True

    def _journal_later(self, ns: Namespace, geometry: dict[str, Any]) -> None:
        if self._create_journal(ns, geometry) and ns.journal is not None:
            ns.journal.record_ready(ns.keyed)

    def refresh_journals(self) -> None:
        """Housekeeping: kept links and mappings of replaced workers' pools renewed."""
        for ns in self.all():
            if ns.journal is not None:
                ns.journal.refresh()

    def detach(self, ns: Namespace, session: int) -> None:
        with self._lock:
            ns.sessions.discard(session)

    def all(self) -> list[Namespace]:
        with self._lock:
            return list(self._by_name.values())

    def reset(self) -> dict[str, Any]:
        """Empty every namespace's host tier (storage kept); per namespace what was cleared
        (or the error that left it as it was)."""
        out: dict[str, Any] = {}
        for ns in self.all():
            try:
                out[ns.name] = ns.stack.reset()
            except KvtierError as e:
                out[ns.name] = {"error": str(e)}
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stacks = list(self._by_name.values())
            self._by_name.clear()
        if self.warm is not None:
            self.warm.close()

        def close(ns: Namespace) -> None:
            ns.stack.close()

        # side by side: each waits for its workers' exit, and a take-over waits for all
        closing = [threading.Thread(target=close, args=(ns,), name="kvtier-node-close")
                   for ns in stacks]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
        self._stopped = stacks

    def close_journals(self) -> None:
        """After `close`: the crash journals' mappings released, the journal and links kept
        for the next service (a journal exists only with node.handover). Called once this
        service's lock is released: unmapping 4 GiB of pool is tens of ms a take-over
        need not wait for."""
        for ns in self._stopped:
            if ns.journal is not None:
                ns.journal.close(keep=self.base.node.handover)
        self._stopped = []
