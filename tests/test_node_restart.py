"""Issue 37: a restart of `kvtier serve` keeps the node's host tier when it can vouch for it.

Real `kvtier serve` processes and engines in child processes (`node_engine.py`: a NodeClient
over the real socket, writing and reading the real host pool):

* a planned restart (SIGTERM with `node.handover = true`): the engine reattaches by itself
  and every block it stored before loads from the new service's host tier, byte for byte;
  /status and /metrics count the blocks handed over and adopted; the blocks stored after the
  restart land beside them without disturbing them;
* hostile hand-over files (truncated, a version this service cannot read, another owner,
  huge counts): one log line each, a cold start (the kept segments unlinked), nothing
  served.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from kvtier.manager.node.handover import HANDOVER_NAME, HandOver
from kvtier.manager.node.namespaces import namespace_deployment_id
from kvtier.worker.spec import SHM_DIR, kept_segment_name
from support import wait_until
from test_node_service import NS_A, PAGE, EngineProc, Node

pytestmark = pytest.mark.fast

QUOTA_BLOCKS = 256
STORED = 200


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, node_toml=f'handover = true\nquotas = {{"{NS_A}" = '
                                 f'{QUOTA_BLOCKS * PAGE}}}\n')
    try:
        yield n.start()
    finally:
        n.close()
        for name in os.listdir(SHM_DIR):  # kept segments a failed test left
            if name.startswith(kept_segment_name(namespace_deployment_id(n.did, NS_A),
                                                 0)[1:-1]):
                os.unlink(os.path.join(SHM_DIR, name))


def _restart(node: Node, engine: EngineProc) -> None:
    """SIGTERM the service (a clean exit), start the next, wait for the engine to be
    attached to it."""
    assert node.serve is not None
    before = engine.call(op="status")["nonce"]
    assert node.serve.stop(signal.SIGTERM) == 0, node.log()
    assert "hand-over written" in node.log(), node.log()
    node.start()
    wait_until(lambda: (s := engine.call(op="status"))["connected"] and s["nonce"] != before,
               30, "the engine reattached to the new service")


def _namespace(node: Node) -> dict[str, object]:
    out: dict[str, object] = {n["namespace"]: n
                              for n in node.status()["node"]["namespaces"]}[NS_A]
    return out


def _kept(node: Node) -> Path:
    return Path(SHM_DIR + kept_segment_name(namespace_deployment_id(node.did, NS_A), 0))


def test_a_planned_restart_keeps_every_block_byte_for_byte(node: Node) -> None:
    a = node.engine()
    keys = list(range(STORED))
    for i in range(0, STORED, 50):
        assert a.call(op="store", keys=keys[i:i + 50])["stored"] == 50
    _restart(node, a)
    got = a.call(op="load", keys=keys)
    assert got["hits"] == STORED and got["identical"] is True, got
    ns = _namespace(node)
    assert ns["restart"] == {"handed_over": STORED, "adopted": STORED, "discarded": 0}, ns
    with node.serve.client() as http:  # type: ignore[union-attr]
        metrics = http.get("/metrics").text
    assert (f'kvtier_node_restart_blocks{{kind="adopted",namespace="{NS_A}"}} {STORED}.0'
            in metrics), [ln for ln in metrics.splitlines() if "restart" in ln]
    assert not _kept(node).exists()  # renamed back to the pool's name
    # new stores land in the free blocks: the adopted ones are left as they are
    more = list(range(1000, 1040))
    assert a.call(op="store", keys=more)["stored"] == 40
    got = a.call(op="load", keys=keys + more)
    assert got["hits"] == STORED + 40 and got["identical"] is True, got


def _truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _version(data: bytes) -> bytes:
    doc = msgspec.msgpack.decode(data, type=HandOver)
    doc.version = 99
    return msgspec.msgpack.encode(doc)


def _owner(data: bytes) -> bytes:
    doc = msgspec.msgpack.decode(data, type=HandOver)
    doc.owner_uid = os.geteuid() + 1
    return msgspec.msgpack.encode(doc)


def _huge(data: bytes) -> bytes:
    """More pages than the namespace's pool has blocks (each one otherwise well formed)."""
    doc = msgspec.msgpack.decode(data, type=HandOver)
    ns = doc.namespaces[0]
    ns.pages = ns.pages * (ns.host_blocks // max(1, len(ns.pages)) + 1)
    return msgspec.msgpack.encode(doc)


HOSTILE = {"truncated": _truncated, "version": _version, "owner": _owner, "huge": _huge}


def test_hostile_hand_overs_give_one_line_and_a_cold_start(node: Node) -> None:
    a = node.engine()
    keys = list(range(32))
    for what, spoil in HOSTILE.items():
        assert a.call(op="store", keys=keys)["stored"] == 32, what
        assert node.serve is not None
        before = a.call(op="status")["nonce"]
        assert node.serve.stop(signal.SIGTERM) == 0, node.log()
        path = node.sock.parent / HANDOVER_NAME
        assert path.stat().st_mode & 0o777 == 0o600
        assert _kept(node).exists(), what
        path.write_bytes(spoil(path.read_bytes()))
        node.start()
        wait_until(lambda old=before: (s := a.call(op="status"))["connected"]  # type: ignore[misc]
                   and s["nonce"] != old, 30, "the engine reattached")
        got = a.call(op="load", keys=keys)
        assert got["hits"] == 0, f"{what}: served from a refused hand-over: {got}"
        log = node.log()
        refused = [ln for ln in log.splitlines() if "hand-over refused" in ln]
        assert len(refused) == 1, f"{what}: {refused}"
        assert "Traceback" not in log, what
        assert not _kept(node).exists(), f"{what}: kept segment left"
        assert not path.exists()
        assert _namespace(node)["restart"] == {"handed_over": 0, "adopted": 0,
                                               "discarded": 0}, what
        print(f"{what}: {refused[0].split('hand-over refused')[1][:160]}")
