"""Issue 34, defects 0 and 1, against a real `kvtier serve` with engines in child processes
(`node_engine.py`: a NodeClient over the real socket, writing and reading the real host pool).

* Defect 0: engine A writes a store; `POST /reset`; engine B stores the same blocks, writes
  half of them and is killed (kill -9); A completes. Every engine's completion and abandonment
  reach only its own copies: no engine is ever served B's half-written blocks, during the
  abandon grace or after it. (Was: one FIFO per hash shared by every engine, so B's end took
  A's node and A's completion published B's.)
* Defect 1: a store of quota + 1 blocks is refused and changes nothing: the namespace's
  cached blocks still hit. (Was: evicted as the refused store went.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import wait_until
from test_node_service import NS_A, PAGE, Node

pytestmark = pytest.mark.fast

QUOTA_BLOCKS = 16


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, node_toml=f'quotas = {{"{NS_A}" = {QUOTA_BLOCKS * PAGE}}}\n')
    try:
        yield n.start()
    finally:
        n.close()


def test_a_dead_engines_half_written_store_is_never_served_after_a_reset(node: Node) -> None:
    keys = list(range(4))
    a = node.engine()
    held = a.call(op="store", keys=keys, hold=True)  # written, completion not sent yet
    assert held["prepared"] == 4 and held["written"] == 4, held
    with node.serve.client(node.serve.token()) as http:  # type: ignore[union-attr]
        assert http.post("/reset").status_code == 200
    b = node.engine()
    half = b.call(op="store", keys=keys, hang_after=2)  # B's own blocks: A's were written off
    assert half["prepared"] == 4 and half["written"] == 2, half
    b.kill()
    wait_until(lambda: "open store(s) abandoned" in node.log(), 10, "B's end")
    assert a.call(op="complete", ok=True)["completed"] == 4
    c = node.engine()
    for who in (a, c):
        got = who.call(op="load", keys=keys)
        assert got["hits"] == 0, f"served B's half-written blocks: {got}"
    # past node.abandon_grace_s (0.5 s): B's blocks freed, and still never a hit
    time.sleep(0.5)
    wait_until(lambda: c.call(op="load", keys=keys)["codes"] == ["miss"], 10,
               "B's abandoned blocks freed after the grace")
    got = a.call(op="load", keys=keys)
    assert got["codes"] == ["miss"], got
    # the blocks are stored again, by anyone, and served byte for byte
    assert c.call(op="store", keys=keys)["stored"] == 4
    got = a.call(op="load", keys=keys)
    assert got["hits"] == 4 and got["identical"] is True, got


def test_a_store_refused_for_size_evicts_nothing(node: Node) -> None:
    a = node.engine()
    b = node.engine()
    assert a.call(op="store", keys=list(range(8)))["stored"] == 8
    big = list(range(100, 100 + QUOTA_BLOCKS + 1))
    assert b.call(op="store", keys=big)["stored"] is None  # quota + 1 blocks: refused
    for who in (a, b):
        got = who.call(op="load", keys=list(range(8)))
        assert got["hits"] == 8 and got["identical"] is True, f"evicted by a refusal: {got}"
    ns = {n["namespace"]: n for n in node.status()["node"]["namespaces"]}[NS_A]
    assert ns["used_bytes"] == 8 * PAGE, ns
