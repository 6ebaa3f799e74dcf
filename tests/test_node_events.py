"""The node service's KV events (`node.events`): two engines (`node_engine.py` children, a
NodeClient each over the real socket and host pool) attached to one service in two
namespaces, a real ZMQ subscriber on the publisher's PUB socket and replay ROUTER.

What is checked, at checkpoints (after stores, after evictions, after `POST /reset`'s
`NodeServer.reset`): the block sets per topic rebuilt from the events equal what the
service holds (host: the namespace's keyed cache answers HIT; storage: the page file is
there); each engine's stores appear under its own namespace's host topic and its backups
under its storage topic; a late subscriber catches up through the replay socket; a gap
(batches deliberately dropped) is recovered through it; every payload decodes with vLLM's
own `KVEventBatch` decoder (in `.venv-vllm`, a subprocess) to the same events. The service
runs in this test's process (so its stacks can be read), its stacks' workers in their own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtier.engine.node_client import NodeClient
from kvtier.manager.config import ConfigError, KvtierConfig, with_sections
from kvtier.manager.keyed_events import HOST, STORAGE
from kvtier.manager.node import events_wire as ew
from kvtier.manager.node.namespaces import Namespace, namespace_deployment_id
from kvtier.manager.node.server import NodeServer, NodeSocketError
from node_engine import hello, key
from support import examples, new_deployment_id, remove_leftovers, tiny_config, wait_until
from test_node_service import EngineProc

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / os.environ.get("KVTIER_VLLM_VENV", ".venv-vllm") / "bin" / "python"
NS_A, NS_B = "events-a", "events-b"
PAGE = 512
HOST_BLOCKS = 8
PREFIX = "kvt"


# ------------------------------------------------------------------------------ subscriber


class Subscriber:
    """A router's view: a SUB socket on every topic, batches applied in seq order (a gap is
    filled through the replay socket first), per topic the set of blocks stored and not
    removed since. `drop`: seqs this subscriber pretends it never received (a gap)."""

    def __init__(self, ctx: zmq.Context[Any], endpoint: str, replay: str,
                 drop: range = range(0)) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.ctx, self.replay_ep, self.drop = ctx, replay, drop
        self.next = 0
        self.sets: dict[str, set[bytes]] = {}
        self.payloads: list[bytes] = []
        self.events: list[tuple[str, ew.Event]] = []
        self.replayed = 0

    def _apply(self, topic: bytes, seq: int, payload: bytes) -> None:
        assert seq == self.next, f"batch {seq} applied while expecting {self.next}"
        self.next += 1
        self.payloads.append(payload)
        t = topic.decode()
        s = self.sets.setdefault(t, set())
        for e in ew.decode_batch(payload).events:
            self.events.append((t, e))
            if isinstance(e, ew.BlockStored):
                s.update(h for h in e.block_hashes if isinstance(h, bytes))
            elif isinstance(e, ew.BlockRemoved):
                s.difference_update(e.block_hashes)
            else:
                s.clear()

    def _replay(self, start: int) -> None:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.replay_ep)
        try:
            d.send_multipart([b"", ew.seq_bytes(start)])
            while True:
                assert d.poll(5000), "no replay answer within 5 s"
                _, topic, seq_b, payload = d.recv_multipart()
                seq = ew.seq_of(seq_b)
                if seq == -1:
                    return
                if seq >= self.next:
                    self._apply(topic, seq, payload)
                    self.replayed += 1
        finally:
            d.close()

    def poll(self) -> None:
        while self.sub.poll(0):
            topic, seq_b, payload = self.sub.recv_multipart()
            seq = ew.seq_of(seq_b)
            if seq in self.drop or seq < self.next:
                continue
            if seq > self.next:
                self._replay(self.next)  # the gap: seqs next .. seq-1
            if seq == self.next:
                self._apply(topic, seq, payload)

    def close(self) -> None:
        self.sub.close()


# ------------------------------------------------------------------------------ the service


def _config(d: Path, storage_dir: Path, **node: Any) -> KvtierConfig:
    cfg = tiny_config(deployment_id=new_deployment_id("ev"), workers=1, storage="file",
                      storage_dir=storage_dir, write_policy="write_through")
    return with_sections(cfg, {}, {"node": {
        "socket": str(d / "node.sock"), "namespace_quota_bytes": HOST_BLOCKS * PAGE,
        "abandon_grace_s": 0.0, "events": True, "events_interval_s": 0.02,
        "events_topic_prefix": PREFIX, **node}})


@pytest.fixture
def service(tmp_path: Path) -> Iterator[tuple[NodeServer, Path]]:
    d = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))
    pages = tmp_path / "pages"
    cfg = _config(d, pages)
    srv = NodeServer(cfg).start()
    try:
        yield srv, pages
    finally:
        srv.stop()
        for ns in (NS_A, NS_B):
            remove_leftovers(namespace_deployment_id(cfg.deployment_id, ns))
        assert not list(d.glob("events.*")), "the ipc files outlived the service"
        shutil.rmtree(d, ignore_errors=True)


def _held(srv: NodeServer, pages: Path, keys: dict[str, list[int]]) -> dict[str, set[bytes]]:
    """Per topic, the blocks the service holds now (host: a HIT in the namespace's keyed
    cache; storage: the block's page file exists), among the keys the engines stored."""
    out: dict[str, set[bytes]] = {}
    files = {p.name for p in pages.rglob("*") if p.is_file()}
    by_name: dict[str, Namespace] = {ns.name: ns for ns in srv.namespaces.all()}
    for name, ks in keys.items():
        ns = by_name[name]
        hs = [key(i) for i in ks]
        out[f"{PREFIX}/host/{name}"] = {h for h in hs if ns.keyed.count_hits([h]) == 1}
        out[f"{PREFIX}/storage/{name}"] = {h for h in hs
                                           if ns.keyed.storage_key(h).hex() in files}
    return out


def _nonempty(sets: dict[str, set[bytes]]) -> dict[str, set[bytes]]:
    return {t: s for t, s in sets.items() if s}


def _settled(srv: NodeServer, pages: Path, subs: list[Subscriber],
             keys: dict[str, list[int]], what: str) -> dict[str, set[bytes]]:
    """Wait (bounded) until every subscriber's rebuilt sets equal what the service holds."""
    last: list[Any] = []

    def same() -> bool:
        held = _nonempty(_held(srv, pages, keys))
        for s in subs:
            s.poll()
        last[:] = [held, [_nonempty(s.sets) for s in subs]]
        return all(_nonempty(s.sets) == held for s in subs)

    try:
        wait_until(same, 10.0, what)
    except AssertionError:
        held, got = last
        diff = {t: (len(held.get(t, ())), [len(g.get(t, ())) for g in got])
                for t in set(held) | {t for g in got for t in g}}
        raise AssertionError(f"{what}: per topic (held, rebuilt per subscriber) {diff}") \
            from None
    held: dict[str, set[bytes]] = last[0]
    return held


# ------------------------------------------------------------------------------ tests


@pytest.mark.engines  # vLLM's own decoder, in a process of vLLM's environment
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_engines_events_rebuild_what_the_service_holds(
        service: tuple[NodeServer, Path]) -> None:
    srv, pages = service
    assert srv.events is not None
    ctx: zmq.Context[Any] = zmq.Context()
    engines: list[EngineProc] = []
    subs: list[Subscriber] = []
    try:
        live = Subscriber(ctx, srv.events.endpoint, srv.events.replay_endpoint)
        subs.append(live)
        a = EngineProc(srv.path, NS_A)
        b = EngineProc(srv.path, NS_B)
        engines += [a, b]
        keys: dict[str, list[int]] = {NS_A: [], NS_B: []}

        for e, lo, n in ((a, 0, 6), (b, 100, 4)):  # bounded retries: a loaded machine
            wait_until(lambda e=e, lo=lo, n=n: e.call(op="store", keys=list(range(lo, lo + n)))
                       ["stored"] is not None, 20.0, f"the first store of keys {lo}..")
        keys[NS_A] += range(6)
        keys[NS_B] += range(100, 104)
        held = _settled(srv, pages, subs, keys, "after the first stores")
        assert held[f"{PREFIX}/host/{NS_A}"] == {key(i) for i in range(6)}
        assert held[f"{PREFIX}/host/{NS_B}"] == {key(i) for i in range(100, 104)}
        assert held[f"{PREFIX}/storage/{NS_A}"]  # write-through backups landed

        # past the 8-block quota of namespace A: evictions (removed on its host topic)
        for lo in (6, 12):
            # refused while the write-through backups of the blocks to evict are in flight
            wait_until(lambda lo=lo: a.call(op="store", keys=list(range(lo, lo + 6)))["stored"],
                       10.0, f"a store of keys {lo}..{lo + 5}")
            keys[NS_A] += range(lo, lo + 6)
        held = _settled(srv, pages, subs, keys, "after the evictions")
        assert len(held[f"{PREFIX}/host/{NS_A}"]) <= HOST_BLOCKS
        removed = [e for t, e in live.events
                   if t == f"{PREFIX}/host/{NS_A}" and isinstance(e, ew.BlockRemoved)]
        assert removed, "no removal on namespace A's host topic after its evictions"

        # a late subscriber: nothing live yet, the replay socket gives it everything
        late = Subscriber(ctx, srv.events.endpoint, srv.events.replay_endpoint)
        subs.append(late)
        time.sleep(0.2)  # its subscription reaches the PUB socket
        late._replay(0)
        _settled(srv, pages, subs, keys, "late subscriber after replay")
        assert late.replayed > 0

        # the operator's reset empties every host tier: removed events, storage stays
        srv.reset()
        held = _settled(srv, pages, subs, keys, "after POST /reset")
        assert not held.get(f"{PREFIX}/host/{NS_A}") and not held.get(f"{PREFIX}/host/{NS_B}")
        assert held[f"{PREFIX}/storage/{NS_A}"]

        for t, e in live.events:
            assert e.medium == (ew.MEDIUM_CPU if "/host/" in t else ew.MEDIUM_STORAGE)
            assert e.locality == ew.LOCAL and e.ownership is None
            if isinstance(e, ew.BlockStored):
                assert e.block_size == 4
        _decoded_by_vllm_equal(live.payloads)
    finally:
        for s in subs:
            s.close()
        ctx.term()
        for e in engines:
            e.close()


def _decoded_by_vllm_equal(payloads: list[bytes]) -> None:
    """vLLM's own decoder reads every payload to the same events as ours."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("CI"):
            raise AssertionError(f"{VLLM_PYTHON} is missing (make vllm-env)")
        return
    script = (
        "import sys, json, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "dec = msgspec.msgpack.Decoder(type=KVEventBatch)\n"
        "enc = msgspec.msgpack.Encoder()\n"
        "out = []\n"
        "for line in sys.stdin:\n"
        "    raw = bytes.fromhex(line.strip())\n"
        "    b = dec.decode(raw)\n"
        "    assert enc.encode(b) == raw, 'vLLM encodes this batch to other bytes'\n"
        "    out.append([[type(e).__name__, [h.hex() for h in getattr(e, 'block_hashes', [])],\n"
        "                 getattr(e, 'medium', None), getattr(e, 'locality', None),\n"
        "                 getattr(e, 'block_size', None)] for e in b.events])\n"
        "print(json.dumps(out))\n")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", script], input="\n".join(
        p.hex() for p in payloads), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [[[type(e).__name__, [h.hex() for h in e.block_hashes if isinstance(h, bytes)]
              if not isinstance(e, ew.AllBlocksCleared) else [],
              getattr(e, "medium", None), getattr(e, "locality", None),
              getattr(e, "block_size", None)] for e in ew.decode_batch(p).events]
            for p in payloads]
    assert theirs == ours


@pytest.mark.fast
def test_a_gap_is_recovered_through_replay(service: tuple[NodeServer, Path]) -> None:
    """Batches 1 and 2 lost on the way: the next batch received triggers a replay from 1
    and the rebuilt sets equal the service's."""
    srv, pages = service
    assert srv.events is not None
    ctx: zmq.Context[Any] = zmq.Context()
    a: EngineProc | None = None
    sub = Subscriber(ctx, srv.events.endpoint, srv.events.replay_endpoint, drop=range(1, 3))
    try:
        time.sleep(0.2)
        a = EngineProc(srv.path, NS_A)
        keys: dict[str, list[int]] = {NS_A: []}
        for lo in range(0, 12, 3):
            wait_until(lambda lo=lo: a.call(op="store", keys=list(range(lo, lo + 3)))["stored"],
                       10.0, f"a store of keys {lo}..{lo + 2}")
            keys[NS_A] += range(lo, lo + 3)
            time.sleep(0.05)  # a batch per store
        _settled(srv, pages, [sub], keys, "gap subscriber")
        assert sub.replayed >= 2
    finally:
        sub.close()
        ctx.term()
        if a is not None:
            a.close()


@pytest.mark.fast
def test_a_host_only_clear_announces_no_storage_removal(
        service: tuple[NodeServer, Path]) -> None:
    """An operator's clear without `storage` takes blocks off the host only: the stream
    removes them from the host topic and keeps them on the storage topic (their pages stay
    and still serve); a clear with `storage` then removes them there too."""
    srv, pages = service
    assert srv.events is not None
    ctx: zmq.Context[Any] = zmq.Context()
    a: EngineProc | None = None
    sub = Subscriber(ctx, srv.events.endpoint, srv.events.replay_endpoint)
    try:
        a = EngineProc(srv.path, NS_A)
        wait_until(lambda: a.call(op="store", keys=list(range(4)))["stored"], 10.0,
                   "a store of keys 0..3")
        keys = {NS_A: list(range(4))}
        host, disk = f"{PREFIX}/host/{NS_A}", f"{PREFIX}/storage/{NS_A}"
        wait_until(lambda: len(_held(srv, pages, keys)[disk]) == 4, 10.0, "the backups")
        _settled(srv, pages, [sub], keys, "after the stores")
        [ns] = [n for n in srv.namespaces.all() if n.name == NS_A]
        gone = [key(0), key(1)]
        assert ns.keyed.clear(hashes=gone)["host_blocks_removed"] == 2
        held = _settled(srv, pages, [sub], keys, "after a host-only clear")
        assert not set(gone) & held[host] and set(gone) <= held[disk] == sub.sets[disk]
        storage_removed = [h for t, e in sub.events if t == disk
                           and isinstance(e, ew.BlockRemoved) for h in e.block_hashes]
        assert not storage_removed, "a host-only clear announced storage removals"
        ns.keyed.clear(hashes=gone, storage=True, wait_s=5.0)
        held = _settled(srv, pages, [sub], keys, "after a clear with storage")
        assert not set(gone) & (held.get(disk, set()) | sub.sets.get(disk, set()))
    finally:
        sub.close()
        ctx.term()
        if a is not None:
            a.close()


class OwnStream:
    """An attached engine's own stream as vLLM's connector gets it: `NodeClient.take_events`
    of a client in this process (the real socket), applied per tier; a removal must name a
    block announced before."""

    def __init__(self, srv: NodeServer, namespace: str) -> None:
        self.client = NodeClient(srv.path, hello(namespace))
        assert self.client.enable_events()
        self.sets: dict[str, set[bytes]] = {HOST: set(), STORAGE: set()}
        self.removed = 0

    def pull(self) -> None:
        for e in self.client.take_events():
            if e.removed:
                stray = set(e.hashes) - self.sets[e.tier]
                assert not stray, f"{e.tier}: removal of {len(stray)} block(s) never announced"
                self.sets[e.tier].difference_update(e.hashes)
                self.removed += len(e.hashes)
            else:
                self.sets[e.tier].update(e.hashes)


def _own_settled(srv: NodeServer, pages: Path, streams: list[OwnStream], keys: list[int],
                 what: str, stored: bool = False) -> dict[str, set[bytes]]:
    """Wait (bounded) until every stream's sets equal what the service holds in NS_A (and,
    with `stored`, until storage holds some of it: backups land after the stores return, and
    two empty storage sets are equal too)."""
    last: list[Any] = []

    def same() -> bool:
        held = _held(srv, pages, {NS_A: keys})
        want = {HOST: held[f"{PREFIX}/host/{NS_A}"], STORAGE: held[f"{PREFIX}/storage/{NS_A}"]}
        for s in streams:
            s.pull()
        last[:] = [want, [{t: len(v) for t, v in s.sets.items()} for s in streams]]
        return all(s.sets == want for s in streams) and (not stored or bool(want[STORAGE]))

    try:
        wait_until(same, 10.0, what)
    except AssertionError:
        want, got = last
        raise AssertionError(f"{what}: held {({t: len(v) for t, v in want.items()})}, "
                             f"rebuilt {got}") from None
    out: dict[str, set[bytes]] = last[0]
    return out


@pytest.mark.fast
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_attached_engines_own_events_are_its_namespaces_tiers(
        service: tuple[NodeServer, Path]) -> None:
    """What vLLM's connector of an attached engine is given (`NodeClient.take_events`):
    its namespace's host tier and storage as the service holds them, blocks another engine
    stored included, nothing of another namespace; through evictions, a reader that fell
    behind the log's bound (RESYNC), `POST /reset`, a late reader; everything withdrawn
    when the service goes away."""
    srv, pages = service
    a: EngineProc | None = None
    b: EngineProc | None = None
    streams: list[OwnStream] = []
    try:
        watcher = OwnStream(srv, NS_A)
        streams.append(watcher)
        a = EngineProc(srv.path, NS_A)
        b = EngineProc(srv.path, NS_B)
        keys: list[int] = []
        for e, lo, n in ((a, 0, 6), (b, 100, 4)):
            wait_until(lambda e=e, lo=lo, n=n: e.call(op="store", keys=list(range(lo, lo + n)))
                       ["stored"] is not None, 20.0, f"the first store of keys {lo}..")
        keys += range(6)
        held = _own_settled(srv, pages, streams, keys, "after the first stores", stored=True)
        assert held[HOST] == {key(i) for i in range(6)} and held[STORAGE]
        assert not any(key(i) in watcher.sets[t] for i in range(100, 104) for t in (HOST,
                                                                                  STORAGE))
        for lo in (6, 12):  # past namespace A's 8-block quota: evictions
            wait_until(lambda lo=lo: a.call(op="store", keys=list(range(lo, lo + 6)))["stored"],
                       10.0, f"a store of keys {lo}..{lo + 5}")
            keys += range(lo, lo + 6)
        _own_settled(srv, pages, streams, keys, "after the evictions")
        assert watcher.removed > 0

        # the watcher falls behind: a log bound of 1 hash, and it does not read meanwhile
        [ns_a] = [ns for ns in srv.namespaces.all() if ns.name == NS_A]
        ns_a.fanout.bound_hashes = 1
        resyncs = ns_a.fanout.resyncs
        wait_until(lambda: a.call(op="store", keys=list(range(18, 24)))["stored"], 10.0,
                   "a store of keys 18..23")
        keys += range(18, 24)
        time.sleep(0.3)  # drains (the publisher's ticks) trim the log past the watcher
        _own_settled(srv, pages, streams, keys, "after a resync")
        assert ns_a.fanout.resyncs > resyncs
        ns_a.fanout.bound_hashes = 1 << 17

        srv.reset()  # the operator's POST /reset
        held = _own_settled(srv, pages, streams, keys, "after POST /reset")
        assert not held[HOST] and held[STORAGE]
        wait_until(lambda: a.call(op="store", keys=[30, 31])["stored"], 10.0, "keys 30, 31")
        keys += [30, 31]
        streams.append(OwnStream(srv, NS_A))  # a late reader starts from the state
        _own_settled(srv, pages, streams, keys, "a late reader")
        assert streams[1].sets[HOST] == {key(30), key(31)}

        srv.stop()  # nothing of the node is servable to the engines now: all withdrawn
        wait_until(lambda: [s.pull() for s in streams] and not any(
            v for s in streams for v in s.sets.values()), 10.0, "withdrawn on DOWN")
    finally:
        for s in streams:
            s.client.close()
        for e in (a, b):
            if e is not None:
                e.close()


# ------------------------------------------------------------------------------ no service


@pytest.mark.fast
@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.binary(min_size=1, max_size=40),
                                                  min_size=1, max_size=5),
                          st.sampled_from([ew.MEDIUM_CPU, ew.MEDIUM_STORAGE]),
                          st.sampled_from([ew.LOCAL, ew.REMOTE])), max_size=6),
       st.floats(min_value=0, max_value=2e9))
def test_batches_round_trip(events: list[tuple[bool, list[bytes], str, str]],
                            ts: float) -> None:
    batch = ew.EventBatch(ts, [ew.BlockRemoved(list(hs), m, locality=loc) if rm else
                               ew.BlockStored(list(hs), None, [], 16, None, m, None,
                                              locality=loc)
                               for rm, hs, m, loc in events])
    raw = ew.encode_batch(batch)
    assert ew.decode_batch(raw) == batch
    # vLLM's layout: the batch an array, each event a map tagged with its class name
    top = msgspec.msgpack.decode(raw)
    assert isinstance(top, list) and top[:2] == [ts, top[1]] and top[2:] in ([], [None])
    for e, (rm, *_rest) in zip(top[1], events, strict=True):
        assert e["type"] == ("BlockRemoved" if rm else "BlockStored")
        assert "ownership" not in e


@pytest.mark.fast
@pytest.mark.parametrize(("key_", "value", "needle"), [
    ("events_endpoint", "tcp://0.0.0.0:5557", "node.events_endpoint"),
    ("events_endpoint", "ipc://relative/path", "absolute path"),
    ("events_replay_endpoint", "tcp://127.0.0.1:99999", "not 0-65535"),
    ("events_endpoint", "inproc://x", "expected ipc://"),
    ("events_buffer_batches", 0, "node.events_buffer_batches"),
])
def test_bad_endpoints_are_one_line_errors(key_: str, value: Any, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        with_sections(tiny_config(), {}, {"node": {key_: value}})
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg


@pytest.mark.fast
def test_tcp_on_loopback_binds_and_a_taken_port_is_one_line(tmp_path: Path) -> None:
    d = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))
    d2 = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))
    try:
        cfg = _config(d, tmp_path / "pages", events_endpoint="tcp://127.0.0.1:0",
                      events_replay_endpoint="tcp://127.0.0.1:0")
        srv = NodeServer(cfg).start()
        try:
            assert srv.events is not None
            assert srv.events.endpoint.startswith("tcp://127.0.0.1:")
            taken = srv.events.endpoint
            with pytest.raises(NodeSocketError, match=r"node\.events_endpoint") as err:
                NodeServer(_config(d2, tmp_path / "p2", events_endpoint=taken)).start()
            assert "\n" not in str(err.value)
            assert not (d2 / "node.sock").exists(), "a failed start left its socket"
        finally:
            srv.stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d2, ignore_errors=True)
