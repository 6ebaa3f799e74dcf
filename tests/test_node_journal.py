"""Issue 37: the node service's crash journal records every store it completes, including the
stores completed while the journal is still being made in the background.

In process, over a real stack (one worker process, its real host pool in /dev/shm) and the
real session code (`ops.apply_ops`): a namespace's journal is made in the background after a
restart (`Namespaces._journal_later`: create, then record the ready copies); a store whose
completion is applied between that scan and its session seeing the journal must still get
its slot, so that a crash then keeps it (`journal.recover` finds it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.manager.node import wire
from kvtier.manager.node.journal import Journal, recover
from kvtier.manager.node.namespaces import Namespace
from kvtier.manager.node.ops import Session, apply_ops
from kvtier.manager.sessions import EngineSession
from kvtier.manager.stack import Stack
from kvtier.worker.kv_pools import HostPool
from stack_support import attached_host_pools, running_stack
from support import tiny_config

pytestmark = pytest.mark.fast

NS = "journal-ns"
GEOMETRY: dict[str, Any] = {"test": "journal", "block_size": 4}
BLOCKS = 16


@pytest.fixture(scope="module")
def stack_and_pool(tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[tuple[Stack, HostPool]]:
    cfg = tiny_config(workers=1, device_blocks=2, host_blocks=BLOCKS)
    with (running_stack(cfg, keyed_namespace=NS.encode()) as stack,
          attached_host_pools(cfg) as pools):
        yield stack, pools[0]


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(n)]


def test_a_store_completed_while_the_journal_is_made_is_journaled(
        stack_and_pool: tuple[Stack, HostPool], tmp_path: Path) -> None:
    stack, pool = stack_and_pool
    cfg = stack.cfg
    ns = Namespace(NS, cfg, GEOMETRY, BLOCKS * pool.shape.page_bytes, stack)
    assert ns.journal is None  # as after a restart: the journal is still being made
    s = Session(1, None, 1, 0)  # type: ignore[arg-type]  # no connection: ops only
    s.ns, s.engine = ns, EngineSession(ns.keyed, s.sid)
    hashes = _hashes(3)
    plan = s.engine.prepare_store(hashes)
    assert plan is not None and len(plan.keys) == 3
    for i, hid in enumerate(plan.host_ids):
        pool.data[hid].fill_(i + 1)  # the engine's copies into the host pool

    journals: list[Journal] = []
    complete = s.engine.complete_store

    def journal_made_meanwhile(keys: Any, ok: bool = True) -> list[bytes]:
        # the background thread's steps, between this slice's read of `ns.journal` (None)
        # and its completion: the journal appears, its scan lists the ready copies (these
        # are not ready yet)
        j = Journal.create(cfg.deployment_id, 1, BLOCKS, pool.shape.page_bytes, GEOMETRY)
        journals.append(j)
        ns.journal = j
        j.record_ready(ns.keyed)
        return complete(keys, ok)

    s.engine.complete_store = journal_made_meanwhile  # type: ignore[method-assign]
    try:
        apply_ops(s, ns, [wire.OpRecord(wire.Op.COMPLETE_STORE, list(plan.keys), flag=1)],
                  lambda _e: None)
        [j] = journals
        assert s.figures["stores"] == 3
        j.close(keep=True)  # as a kill -9 leaves it
        slots = recover(cfg.deployment_id, 1, BLOCKS, pool.shape.page_bytes, GEOMETRY)
        found = {host for _, host, _, _, _ in slots}
        assert found == set(plan.host_ids), (
            f"stores completed while the journal was made are not journaled: slots for "
            f"blocks {sorted(found)}, stored {sorted(plan.host_ids)}")
    finally:
        for j in journals:
            j.close(keep=False)
        ns.journal = None
