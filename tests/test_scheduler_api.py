"""The scheduler API, one behaviour per test: hits, caps, all-or-nothing, errors, eviction
order, pins, write policies, transfers that fail, and reset.

Every manager a test builds is checked with `check_invariants()` when the test ends (and the
helpers check after each request): every block id of a tier is exactly one of free / tree /
request, the counts add up, the LRU lists hold exactly the evictable nodes.

`ManualDispatcher` keeps transfer tasks pending until the test completes them; the manager
itself blocks only on write-back demotions, which the dispatcher's resolver completes. The
resolver runs while the manager waits with its lock released, i.e. exactly where a completion
thread or the admin would get in, so tests use it to act in the middle of an eviction.

`where()` reads the prefix tree directly: the public API has no read-only lookup (a match
references blocks and refreshes their LRU position, which would change what is tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvtier.manager.core.hooks import RequestState
from kvtier.manager.core.nodes import BACKING, EVICTING, SAVING, STORED, Node
from kvtier.manager.errors import (
    InvalidRequestError,
    OutOfBlocksError,
    ResetBusyError,
    TransferFailedError,
    UnknownRequestError,
)
from kvtier.manager.keys import chain_keys
from kvtier.manager.scheduler import KVCacheManager, MatchResult
from kvtier.manager.storage_tier import PROBE_STALE_S, StorageTier
from kvtier.manager.transfers import ImmediateDispatcher, ManualDispatcher
from kvtier.worker.wire import Priority, Task, TaskKind, key_tag
from support import tiny_config

pytestmark = pytest.mark.fast

BS = 4
Factory = Callable[..., KVCacheManager]


@pytest.fixture
def make() -> Iterator[Factory]:
    """Builds managers (block size 4) and checks each one's invariants after the test."""
    made: list[KVCacheManager] = []

    def factory(**kw: object) -> KVCacheManager:
        kw.setdefault("block_size", BS)
        kw.setdefault("transfer_timeout_s", 5.0)
        m = KVCacheManager(**kw)  # type: ignore[arg-type]
        made.append(m)
        return m

    yield factory
    for m in made:
        m.check_invariants()


def prompt(tag: int, n: int) -> list[int]:
    """`n` tokens no other tag shares."""
    return [tag * 1000 + i for i in range(n)]


def node(m: KVCacheManager, tokens: list[int], block: int) -> Node | None:
    return m._map.get(chain_keys(tokens, BS)[block])


def where(m: KVCacheManager, tokens: list[int]) -> list[str]:
    """Per full block of `tokens`: "dev", "host", "both", or "-" when not in the tree."""
    out = []
    for key in chain_keys(tokens, BS):
        n = m._map.get(key)
        if n is None:
            out.append("-")
        elif n.dev is not None and n.host is not None:
            out.append("both")
        else:
            out.append("dev" if n.dev is not None else "host")
    return out


def serve(m: KVCacheManager, rid: str, tokens: list[int], *,
          release: bool = True) -> MatchResult:
    """One whole request: match, allocate the rest, wait for loads, commit, release."""
    res = m.match(rid, tokens)
    m.allocate(rid, len(tokens) - res.num_tokens)
    res.handle.wait()
    m.commit(rid, tokens, len(tokens))
    if release:
        m.release(rid)
    m.check_invariants()
    return res


def tasks_of(d: ManualDispatcher, kind: TaskKind) -> list[Task]:
    return [t for t in d.tasks.values() if t.kind == kind]


def assert_no_leak(m: KVCacheManager) -> None:
    m.check_invariants()
    dev = m.stats()["device"]
    assert dev["owned_by_requests"] == 0  # type: ignore[index]
    assert dev["free"] + dev["cached"] == dev["capacity"]  # type: ignore[index]


# ---------------------------------------------------------------------- match


def test_match_on_an_empty_cache(make: Factory) -> None:
    m = make(device_blocks=8)
    res = m.match("r", prompt(1, 10))
    assert res.block_ids == [] and res.num_tokens == 0
    assert (res.device_tokens, res.host_tokens, res.storage_tokens) == (0, 0, 0)
    assert res.handle.done and not res.handle.has_loads
    res.handle.wait(0)
    res.handle.wait_layer(0, 0)
    empty = m.match("e", [])
    assert empty.num_tokens == 0
    c = m.stats()["counters"]
    assert c["requests"] == 2 and c["lookup_tokens"] == 10  # type: ignore[index]
    m.release("r")
    m.release("e")


def test_committed_prefix_is_a_device_hit(make: Factory) -> None:
    m = make(device_blocks=16)
    a = prompt(1, 14)  # 3 full blocks + 2 tokens
    serve(m, "a", a, release=False)
    blocks = m.request_blocks("a")
    m.release("a")
    assert where(m, a) == ["dev"] * 3
    longer = [*a[:12], 7, 7, 7, 7, 7]
    res = m.match("b", longer)
    assert res.device_tokens == 12 and res.host_tokens == 0
    assert res.block_ids == blocks[:3]
    assert m.request_blocks("b") == blocks[:3]
    assert res.handle.done
    # A prompt that diverges inside block 1 hits block 0 only.
    other = list(a)
    other[5] += 1
    assert m.match("c", other).block_ids == blocks[:1]
    c = m.stats()["counters"]
    assert c["hit_device_tokens"] == 16  # type: ignore[index]
    m.release("b")
    m.release("c")


@pytest.mark.parametrize(("length", "hit"), [(12, 8), (13, 12), (15, 12), (16, 12), (1, 0),
                                              (4, 0), (5, 4)])
def test_hit_is_capped_at_len_minus_one(make: Factory, length: int, hit: int) -> None:
    m = make(device_blocks=16)
    full = prompt(1, 16)
    serve(m, "a", [*full, 99])  # all 4 blocks cached
    res = m.match("b", full[:length])
    assert res.num_tokens == hit, "at least one token must be left to compute"
    assert length - res.num_tokens >= 1
    new = m.allocate("b", length - res.num_tokens)
    assert len(res.block_ids) + len(new) == -(-length // BS)
    m.release("b")


def test_only_full_blocks_are_cached(make: Factory) -> None:
    m = make(device_blocks=16)
    a = prompt(1, 10)  # 2 full blocks + 2 tokens
    m.match("a", a)
    m.allocate("a", 10)
    assert m.commit("a", a, 7) == 1  # chunked prefill: 7 tokens, 1 full block
    assert m.commit("a", a, 7) == 0
    assert m.commit("a", a, 10) == 1
    grown = [*a, 55, 56]  # decode filled block 2
    m.allocate("a", 2)
    assert m.commit("a", grown, 12) == 1
    m.release("a")
    assert m.stats()["device"]["cached"] == 3  # type: ignore[index]
    assert where(m, grown) == ["dev"] * 3
    res = m.match("b", [*a, 55, 77, 1])
    assert res.num_tokens == 8, "the partial block 2 of another prompt must not hit"
    m.release("b")


def test_duplicate_blocks_stay_the_requests_own(make: Factory) -> None:
    """Two requests computing the same prompt at once: the second's blocks are duplicates,
    kept out of the tree and freed at release."""
    m = make(device_blocks=16)
    a = prompt(1, 9)
    m.match("x", a)
    m.match("y", a)
    m.allocate("x", 9)
    m.allocate("y", 9)
    assert m.commit("x", a, 9) == 2
    assert m.commit("y", a, 9) == 0
    assert m.stats()["device"]["cached"] == 2  # type: ignore[index]
    m.check_invariants()
    m.release("y")
    m.release("x")
    assert_no_leak(m)
    assert m.stats()["device"]["free"] == 14  # type: ignore[index]


# ---------------------------------------------------------------------- allocate


def test_allocate_is_all_or_nothing(make: Factory) -> None:
    m = make(device_blocks=6)
    a = prompt(1, 13)
    serve(m, "a", a)  # 3 cached and evictable, 3 free
    m.match("b", prompt(2, 8))
    m.allocate("b", 8)  # 2 blocks held: 1 free, 3 evictable
    m.match("c", prompt(3, 20))
    before = m.stats()
    blocks_before = m.request_blocks("c")
    with pytest.raises(OutOfBlocksError,
                       match=r"^request .c.: 5 device blocks needed, 1 free and 3 evictable of 6"):
        m.allocate("c", 17)
    assert m.stats() == before
    assert m.request_blocks("c") == blocks_before
    assert where(m, a) == ["dev"] * 3, "nothing may be evicted by a failed allocation"
    m.check_invariants()
    got = m.allocate("c", 16)  # exactly what free + evictable can give
    assert len(got) == 4 and len(set(got) | set(m.request_blocks("b"))) == 6
    assert where(m, a) == ["-"] * 3
    m.release("b")
    m.release("c")
    assert_no_leak(m)


def test_allocate_waits_for_backups_that_free_enough_room(make: Factory) -> None:
    """write_through: committed blocks are busy (their D2H backup in flight) until the
    backup lands. An allocation that only fits once they land waits for them instead of
    failing (issue 11 item 4); one that cannot fit even then fails at once, naming the
    busy blocks."""
    d = ManualDispatcher()  # a wait answers the tasks waited for (they finish in ms)
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 9)
    m.match("a", a)
    m.allocate("a", 9, 0)
    m.commit("a", a, 9)
    m.release("a")  # 2 blocks busy backing up, 2 free, nothing evictable yet
    (save,) = tasks_of(d, TaskKind.D2H)
    assert m.stats()["device"]["evictable"] == 0  # type: ignore[index]
    m.match("big", prompt(2, 20))
    with pytest.raises(OutOfBlocksError, match=r"5 device blocks needed, 2 free and 0 "
                                                r"evictable of 4; 2 more busy in transfers"):
        m.allocate("big", 20, 0)
    assert save.seq in d.tasks, "a hopeless allocation must not wait"
    got = m.allocate("big", 16, 0)  # 4 blocks: fits once the backup has landed
    assert len(got) == 4 and save.seq not in d.tasks
    assert where(m, a) == ["host", "host"]  # evicted after the backup: host copies stay
    m.release("big")


def test_decode_reservation(make: Factory) -> None:
    m = make(device_blocks=12, decode_reserve_blocks=2)
    a = prompt(1, 10)
    m.match("a", a)
    assert len(m.allocate("a", 10)) == 3 + 2
    assert m.allocate("a", 1) == []  # 11 tokens: 3 blocks + 2 reserved already held
    assert m.allocate("a", 1) == []
    assert len(m.allocate("a", 1)) == 1  # 13 tokens: 4 blocks + 2 reserved
    assert len(m.request_blocks("a")) == 6
    # Decode tokens land in reserved blocks and may be committed.
    grown = [*a, 1, 2, 3]
    assert m.commit("a", grown, 13) == 3
    m.match("b", prompt(2, 10))
    assert len(m.allocate("b", 10, reserve_blocks=0)) == 3
    m.match("c", prompt(3, 4))
    # The reservation counts toward all-or-nothing: 1 block + 2 reserved > 3 free + 0.
    m.match("d", prompt(4, 4))
    assert len(m.allocate("d", 4, reserve_blocks=1)) == 2
    with pytest.raises(OutOfBlocksError):
        m.allocate("c", 4)
    assert m.request_blocks("c") == []
    for rid in "abcd":
        m.release(rid)
    assert_no_leak(m)


# ---------------------------------------------------------------------- errors


def test_errors_name_the_request_and_field(make: Factory) -> None:
    m = make(device_blocks=8)
    a = prompt(1, 9)
    m.match("r1", a)
    m.allocate("r1", 4)
    before = m.stats()
    blocks = m.request_blocks("r1")
    with pytest.raises(InvalidRequestError, match=r"'r1': num_tokens must be an int >= 0, got -1"):
        m.allocate("r1", -1)
    with pytest.raises(InvalidRequestError, match=r"'r1': num_tokens .* got 2.5"):
        m.allocate("r1", 2.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"'r1': reserve_blocks must be >= 0, got -2"):
        m.allocate("r1", 1, reserve_blocks=-2)
    with pytest.raises(InvalidRequestError, match=r"'r1' is already active"):
        m.match("r1", prompt(2, 9))
    with pytest.raises(InvalidRequestError,
                       match=r"'r1': num_computed_tokens=12 exceeds the 9 token ids given"):
        m.commit("r1", a, 12)
    with pytest.raises(InvalidRequestError,
                       match=r"'r1': 2 full blocks computed but only 1 device blocks allocated"):
        m.commit("r1", a, 8)
    with pytest.raises(InvalidRequestError, match=r"'r1': num_computed_tokens must be an int"):
        m.commit("r1", a, -4)
    assert m.stats() == before
    assert m.request_blocks("r1") == blocks
    for call in (lambda: m.allocate("nope", 1), lambda: m.commit("nope", a, 4),
                 lambda: m.release("nope"), lambda: m.request_blocks("nope")):
        with pytest.raises(UnknownRequestError, match=r"request 'nope' is not active"):
            call()
    m.release("r1")
    with pytest.raises(UnknownRequestError, match=r"'r1' is not active .*already released"):
        m.release("r1")
    assert_no_leak(m)


def test_bad_token_ids_are_a_clear_error_and_register_nothing(make: Factory) -> None:
    m = make(device_blocks=8)
    bad = prompt(1, 9)
    bad[2] = 2**31
    with pytest.raises(InvalidRequestError, match=r"'r': token id 2147483648\b.*int32"):
        m.match("r", bad)
    with pytest.raises(InvalidRequestError, match=r"'r': token_ids must be a sequence"):
        m.match("r", None)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"'r': extra_keys item .* offset must be"):
        m.match("r", prompt(1, 9), extra_keys=[(-1, 3, b"img")])
    with pytest.raises(InvalidRequestError, match=r"token_ids: token id 2147483648"):
        m.pin(bad)
    assert m.stats()["requests_active"] == 0
    m.match("r", prompt(1, 9))  # the id was never taken
    # A chunk extending the request with a bad token fails at commit, naming the request.
    m.allocate("r", 16)
    grown = [*prompt(1, 9), 1, 2, 3, 2**33, 5, 6, 7]
    with pytest.raises(InvalidRequestError, match=r"'r': token id 8589934592"):
        m.commit("r", grown, 16)
    assert m.stats()["device"]["cached"] == 0  # type: ignore[index]
    m.release("r")
    assert_no_leak(m)


def test_bad_extra_keys_rejected_even_for_a_prompt_shorter_than_a_block(make: Factory) -> None:
    m = make(device_blocks=4)
    with pytest.raises(InvalidRequestError, match=r"'r': extra_keys item"):
        m.match("r", [1, 2], extra_keys=[(-1, 1, b"img")])
    assert m.stats()["requests_active"] == 0


def test_release_returns_every_block(make: Factory) -> None:
    m = make(device_blocks=20, decode_reserve_blocks=1)
    shared = prompt(1, 8)
    for i in range(4):
        serve(m, f"r{i}", [*shared, *prompt(10 + i, 6)])
    m.match("held", [*shared, 1])
    m.allocate("held", 1)
    m.match("bare", prompt(3, 6))
    m.allocate("bare", 6)
    m.release("held")
    m.release("bare")
    assert_no_leak(m)
    assert m.stats()["device"]["cached"] == 2 + 4  # type: ignore[index]
    cleared = m.reset()
    assert cleared["nodes"] == 6 and cleared["device_blocks"] == 6
    s = m.stats()
    assert s["device"]["free"] == 20 and s["nodes"] == 0  # type: ignore[index]


# ---------------------------------------------------------------------- eviction order


def test_lru_evicts_leaves_before_parents_and_oldest_first(make: Factory) -> None:
    m = make(device_blocks=6)
    a, b = prompt(1, 13), prompt(2, 5)
    serve(m, "a", a)  # 3 blocks
    serve(m, "b", b)  # 1 block, more recent
    assert m.stats()["device"]["free"] == 2  # type: ignore[index]
    states = []
    for need in range(3, 7):  # each step needs one more block than is free
        rid = f"p{need}"
        m.match(rid, prompt(50 + need, 4 * need))
        m.allocate(rid, 4 * need)
        states.append(where(m, a) + where(m, b))
        m.release(rid)
        m.check_invariants()
    assert states == [
        ["dev", "dev", "-", "dev"],
        ["dev", "-", "-", "dev"],
        ["-", "-", "-", "dev"],
        ["-", "-", "-", "-"],
    ]


def test_lru_touch_makes_a_prefix_recent(make: Factory) -> None:
    m = make(device_blocks=4)
    a, b = prompt(1, 5), prompt(2, 5)
    serve(m, "a", a)
    serve(m, "b", b)
    res = m.match("again", [*a[:4], 9])  # touch a: b is now the least recently used
    assert res.num_tokens == 4
    m.release("again")
    m.match("p", prompt(3, 12))
    m.allocate("p", 12)  # needs 3 of 2 free: one eviction
    assert where(m, a) == ["dev"] and where(m, b) == ["-"]
    m.release("p")


def test_pinned_prefix_is_never_evicted(make: Factory) -> None:
    m = make(device_blocks=4)
    a = prompt(1, 9)
    serve(m, "a", a)  # 2 cached, 2 free
    assert m.pin(a) == 2
    assert m.pin(a[:4]) == 1  # a second pin on block 0
    assert m.pin(prompt(7, 8)) == 0, "nothing cached: nothing pinned"
    s = m.stats()
    assert s["pinned_blocks"] == 2 and s["device"]["evictable"] == 0  # type: ignore[index]
    m.match("p", prompt(2, 12))
    with pytest.raises(OutOfBlocksError,
                       match=r"^request .p.: 3 device blocks needed, 2 free and 0 evictable"):
        m.allocate("p", 12)
    m.allocate("p", 8)
    assert where(m, a) == ["dev", "dev"]
    m.release("p")
    # Pinned blocks can still be hit (and are not unpinned by release).
    serve(m, "hit", [*a, 3])
    assert where(m, a) == ["dev", "dev"]
    assert m.unpin(a) == 2
    assert m.stats()["device"]["evictable"] == 1, "block 0 is still pinned once"  # type: ignore[index]
    assert m.unpin(a) == 1
    assert m.unpin(a) == 0
    s = m.stats()
    assert s["pinned_blocks"] == 0 and s["device"]["evictable"] == 2  # type: ignore[index]
    m.match("q", prompt(3, 16))
    m.allocate("q", 16)
    assert where(m, a) == ["-", "-"]
    m.release("q")


def test_unpinned_prefix_leaves_leaf_first(make: Factory) -> None:
    m = make(device_blocks=4)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.pin(a)
    m.unpin(a)
    m.match("p", prompt(2, 12))
    m.allocate("p", 12)  # one eviction
    assert where(m, a) == ["dev", "-"], "the leaf must go before its parent"
    m.release("p")


def test_backup_completed_after_release_keeps_leaf_first_order(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)  # backup still pending at release
    for t in tasks_of(d, TaskKind.D2H):
        d.complete(t.seq)
    m.match("p", prompt(2, 12))
    m.allocate("p", 12)
    assert where(m, a) == ["both", "host"], "the leaf's device copy must go first"
    m.release("p")


# ---------------------------------------------------------------------- host tier


def test_write_back_demotes_on_eviction_and_loads_host_hits(make: Factory) -> None:
    seen: list[Task] = []

    def resolver(task: Task) -> tuple[bool, int]:
        seen.append(task)
        return True, 0

    d = ManualDispatcher(resolver)
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    m.match("a", a)
    m.allocate("a", 9)
    a_blocks = m.request_blocks("a")
    m.commit("a", a, 9)
    m.release("a")
    assert not d.tasks, "write_back backs up nothing at commit"
    m.match("b", prompt(2, 8))
    m.allocate("b", 8)  # needs 2, 1 free: the leaf is demoted and the eviction waits
    assert [(t.kind, t.priority, list(t.src)) for t in seen] == [
        (TaskKind.D2H, Priority.EVICT, [a_blocks[1]])]
    leaf_host = seen[0].dst[0]
    assert where(m, a) == ["dev", "host"]
    assert node(m, a, 1).host == leaf_host  # type: ignore[union-attr]
    c = m.stats()["counters"]
    assert c["evicted_device_demote"] == 1 and c["d2h_blocks"] == 1  # type: ignore[index]
    m.release("b")
    m.check_invariants()

    res = m.match("c", a)
    assert (res.device_tokens, res.host_tokens) == (4, 4)
    assert res.block_ids[0] == a_blocks[0]
    loads = tasks_of(d, TaskKind.H2D)
    assert len(loads) == 1
    assert loads[0].priority == Priority.LOAD
    assert list(loads[0].src) == [leaf_host] and list(loads[0].dst) == [res.block_ids[1]]
    assert res.handle.has_loads and not res.handle.done
    m.check_invariants()
    res.handle.wait_layer(0)  # the dispatcher resolves the load
    assert res.handle.done
    res.handle.wait()
    # write_back keeps the tiers exclusive: the host copy is freed once loaded.
    assert where(m, a) == ["dev", "dev"]
    assert m.stats()["host"]["free"] == 8  # type: ignore[index]
    m.allocate("c", 1)
    m.commit("c", a, 9)
    m.release("c")
    assert_no_leak(m)


def test_write_through_backs_up_every_committed_block(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 9)
    m.match("a", a)
    m.allocate("a", 9)
    blocks = m.request_blocks("a")
    m.commit("a", a, 9)
    saves = tasks_of(d, TaskKind.D2H)
    assert len(saves) == 1
    assert saves[0].priority == Priority.BACKUP
    nodes = [node(m, a, i) for i in range(2)]
    assert sorted(saves[0].src) == sorted(blocks[:2])
    assert dict(zip(saves[0].src, saves[0].dst, strict=True)) == {
        n.dev: n.host for n in nodes}  # type: ignore[union-attr]
    assert all(n.flags & SAVING for n in nodes)  # type: ignore[union-attr]
    d.complete(saves[0].seq)
    m.release("a")
    assert where(m, a) == ["both", "both"]
    # Evicting a backed-up block drops its device copy only: no new task.
    m.match("b", prompt(2, 16))
    m.allocate("b", 16)
    assert not d.tasks
    assert where(m, a) == ["host", "host"]
    m.release("b")
    res = m.match("c", a)
    assert (res.device_tokens, res.host_tokens) == (0, 8)
    (load,) = tasks_of(d, TaskKind.H2D)
    assert list(load.dst) == res.block_ids
    d.complete(load.seq)
    res.handle.wait(0)
    assert where(m, a) == ["both", "both"], "write_through keeps the host copy after a load"
    m.release("c")
    assert_no_leak(m)


@pytest.mark.parametrize("threshold", [2, 3])
def test_write_through_selective_backs_up_at_the_hit_threshold(make: Factory,
                                                               threshold: int) -> None:
    d = ManualDispatcher()
    kw = {} if threshold == 2 else {"hit_threshold": threshold}  # 2 is the default
    m = make(device_blocks=8, host_blocks=8, write_policy="write_through_selective",
             dispatcher=d, **kw)
    a = prompt(1, 13)  # 3 blocks
    serve(m, "a", a)
    assert not d.tasks, "no backup at commit"
    for hit in range(1, threshold + 1):
        assert not d.tasks, f"backup before hit {hit}"
        serve(m, f"h{hit}", a[:9])  # hits blocks 0 and 1
    (save,) = tasks_of(d, TaskKind.D2H)
    assert save.priority == Priority.BACKUP
    assert len(save.src) == 2
    d.complete(save.seq)
    assert where(m, a) == ["both", "both", "dev"]
    serve(m, "more", a[:9])
    assert not d.tasks, "a block with a host copy is not backed up again"


def test_hit_during_write_back_demotion_is_served_from_device(make: Factory) -> None:
    """The demotion of a's leaf is in flight when another request hits it: the hit gets the
    device block, the demotion's result is kept as a host copy, and the eviction takes the
    next victim instead."""
    a, other = prompt(1, 9), prompt(2, 5)
    during: list[tuple[MatchResult, int, int]] = []
    box: list[KVCacheManager] = []

    def resolver(task: Task) -> tuple[bool, int]:
        if task.kind == TaskKind.D2H and not during:
            m = box[0]
            leaf = node(m, a, 1)
            assert leaf is not None and leaf.flags & EVICTING
            during.append((m.match("c", a), task.src[0], leaf.dev))  # type: ignore[arg-type]
        return True, 0

    d = ManualDispatcher(resolver)
    m = make(device_blocks=5, host_blocks=8, write_policy="write_back", dispatcher=d)
    box.append(m)
    serve(m, "a", a)  # LRU: a1, a0
    serve(m, "o", other)  # LRU: a1, a0, o0; 2 free
    m.match("b", prompt(3, 12))
    m.allocate("b", 12)  # needs 3: demotes a1 (hit meanwhile), then o0
    assert during, "the demotion never ran"
    res, demoted_src, leaf_dev = during[0]
    assert demoted_src == leaf_dev
    assert (res.device_tokens, res.host_tokens) == (8, 0)
    assert res.block_ids[1] == leaf_dev and res.handle.done
    assert leaf_dev not in m.request_blocks("b")
    assert where(m, a) == ["dev", "both"]
    assert where(m, other) == ["host"]
    assert node(m, a, 1).flags == 0  # type: ignore[union-attr]
    m.check_invariants()
    m.release("c")
    m.release("b")
    assert_no_leak(m)


def test_cancelled_demotion_with_nothing_else_to_evict_fails_cleanly(make: Factory) -> None:
    a = prompt(1, 9)
    box: list[KVCacheManager] = []

    def resolver(task: Task) -> tuple[bool, int]:
        if task.kind == TaskKind.D2H and box:
            box.pop().match("c", a)  # hits the node being demoted
        return True, 0

    d = ManualDispatcher(resolver)
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    serve(m, "a", a)  # 2 cached, 1 free
    box.append(m)
    m.match("b", prompt(2, 8))
    real_evict = m._evict_device
    calls = [0]

    def bounded_evict(n: int) -> list[int]:  # turns the endless loop into an error
        calls[0] += 1
        if calls[0] > 1000:
            raise RuntimeError("_make_room is spinning without progress")
        return real_evict(n)

    m._evict_device = bounded_evict  # type: ignore[method-assign]
    with pytest.raises(OutOfBlocksError, match=r"^request .b.: "):
        m.allocate("b", 8)
    assert m.request_blocks("b") == []
    m.release("c")
    m.release("b")


def test_pin_during_demotion_keeps_the_prefix_on_device(make: Factory) -> None:
    a, other = prompt(1, 9), prompt(2, 5)
    box: list[KVCacheManager] = []

    def resolver(task: Task) -> tuple[bool, int]:
        if task.kind == TaskKind.D2H and box:
            assert box.pop().pin(a) == 2  # the admin pins while the demotion is in flight
        return True, 0

    d = ManualDispatcher(resolver)
    m = make(device_blocks=5, host_blocks=8, write_policy="write_back", dispatcher=d)
    serve(m, "a", a)
    serve(m, "o", other)
    box.append(m)
    m.match("b", prompt(3, 12))
    m.allocate("b", 12)
    assert not box, "the demotion never ran: nothing was pinned during it"
    assert where(m, a)[1] in ("dev", "both"), "a pinned block lost its device copy"
    m.release("b")


def test_pin_loads_a_host_only_prefix(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.match("b", prompt(2, 12))
    m.allocate("b", 12)  # demotes both of a's blocks (resolved by the default resolver)
    m.release("b")
    assert where(m, a) == ["host", "host"]
    assert m.pin(a) == 2
    loads = tasks_of(d, TaskKind.H2D)
    assert len(loads) == 2
    m.check_invariants()
    for t in loads:
        d.complete(t.seq)
    assert where(m, a) == ["dev", "dev"]
    m.match("c", prompt(3, 4))
    with pytest.raises(OutOfBlocksError):
        m.allocate("c", 8)
    m.release("c")
    assert m.unpin(a) == 2


def test_host_hits_beyond_device_room_are_cut(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.match("full", prompt(2, 12))
    m.allocate("full", 12)  # holds all 3 device blocks; a is on the host
    assert where(m, a) == ["host", "host"]
    res = m.match("c", a)
    assert res.num_tokens == 0 and res.block_ids == [] and not d.tasks
    m.check_invariants()
    m.release("c")
    m.release("full")
    res = m.match("c2", a)
    assert res.host_tokens == 8
    res.handle.wait()
    m.release("c2")


def test_failed_load_is_a_miss_from_the_failed_block(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.match("b", prompt(2, 8))
    m.allocate("b", 8)  # demotes a's leaf
    m.release("b")
    assert where(m, a) == ["dev", "host"]
    res = m.match("c", a)
    assert (res.device_tokens, res.host_tokens) == (4, 4)
    (load,) = tasks_of(d, TaskKind.H2D)
    d.complete(load.seq, ok=False)
    assert res.handle.done
    with pytest.raises(TransferFailedError, match="4 of 8 matched tokens are valid") as info:
        res.handle.wait()
    assert info.value.valid_tokens == 4
    with pytest.raises(TransferFailedError):
        res.handle.wait_layer(0)
    m.check_invariants()
    # The host copy is still cached; the request recomputes into the block it was given.
    assert where(m, a) == ["dev", "host"]
    assert m.stats()["counters"]["failed_tasks"] == 1  # type: ignore[index]
    m.allocate("c", 1)
    m.commit("c", a, 9)
    m.release("c")
    assert_no_leak(m)
    res = m.match("again", a)
    assert (res.device_tokens, res.host_tokens) == (4, 4)
    res.handle.wait()
    m.release("again")
    assert_no_leak(m)


def test_failed_load_after_release_frees_the_device_block(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=3, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.match("b", prompt(2, 12))
    m.allocate("b", 12)
    m.release("b")
    m.match("c", a)
    m.release("c")  # gone before its load finished
    (load,) = tasks_of(d, TaskKind.H2D)
    d.complete(load.seq, ok=False)
    assert where(m, a) == ["host", "host"]
    assert_no_leak(m)
    assert m.stats()["device"]["free"] == 3  # type: ignore[index]


def test_two_requests_waiting_on_one_failed_load(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    m.match("b", prompt(2, 16))
    m.allocate("b", 16)
    m.release("b")
    r1 = m.match("r1", a)
    r2 = m.match("r2", a)  # the blocks are still loading: r2 waits on r1's load
    assert r1.block_ids == r2.block_ids and r2.handle.has_loads and not r2.handle.done
    (load,) = tasks_of(d, TaskKind.H2D)
    d.complete(load.seq, ok=False)
    for res in (r1, r2):
        with pytest.raises(TransferFailedError) as info:
            res.handle.wait()
        assert info.value.valid_tokens == 0
    m.check_invariants()
    m.release("r1")
    m.check_invariants()
    m.release("r2")
    assert_no_leak(m)
    assert where(m, a) == ["host", "host"]


def test_failed_backup_leaves_the_node_on_device(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    (save,) = tasks_of(d, TaskKind.D2H)
    d.complete(save.seq, ok=False)
    assert where(m, a) == ["dev", "dev"]
    s = m.stats()
    assert s["host"]["free"] == 8 and s["device"]["evictable"] == 2  # type: ignore[index]
    res = m.match("c", [*a, 1])
    assert res.device_tokens == 8
    # write_through retries the backup of a block without a host copy when it is hit.
    (retry,) = tasks_of(d, TaskKind.D2H)
    d.complete(retry.seq)
    m.release("c")
    assert where(m, a) == ["both", "both"]


# ---------------------------------------------------------------------- reset


def test_reset_with_a_pending_task_clears_nothing(make: Factory) -> None:
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    assert d.tasks
    before = m.stats()
    with pytest.raises(ResetBusyError, match=r"still in flight .* nothing was cleared"):
        m.reset(timeout=0.05)
    assert m.stats() == before
    assert where(m, a) == ["both", "both"]
    assert all(node(m, a, i).flags & SAVING for i in range(2))  # type: ignore[union-attr]
    m.check_invariants()
    for seq in list(d.tasks):
        d.complete(seq)
    cleared = m.reset(timeout=1)
    assert cleared["nodes"] == 2 and cleared["host_blocks"] == 2
    s = m.stats()
    assert s["nodes"] == 0 and s["device"]["free"] == 4 and s["host"]["free"] == 8  # type: ignore[index]


def test_reset_keeps_an_active_requests_blocks_until_release(make: Factory) -> None:
    m = make(device_blocks=12, host_blocks=8, write_policy="write_through",
             dispatcher=ImmediateDispatcher())
    a = prompt(1, 9)
    serve(m, "a", a)
    long = [*a[:8], *prompt(2, 9)]
    res = m.match("b", long)
    assert res.device_tokens == 8
    m.allocate("b", len(long) - 8)
    m.commit("b", long, 12)  # one more block joins the tree
    b_blocks = m.request_blocks("b")
    cleared = m.reset()
    assert cleared["detached_in_use"] == 3 and cleared["nodes"] == 3
    m.check_invariants()
    s = m.stats()
    assert s["nodes"] == 0 and s["host"]["free"] == 8  # type: ignore[index]
    assert s["device"]["free"] == 12 - len(b_blocks)  # type: ignore[index]
    assert m.request_blocks("b") == b_blocks
    # The request goes on: more blocks join the new tree; another request computes the same
    # prefix into other blocks.
    assert m.commit("b", long, 16) == 1
    c = serve(m, "c", a, release=False)
    assert c.num_tokens == 0
    assert not set(m.request_blocks("c")) & set(b_blocks)
    m.release("b")  # each block back exactly once (a double free would raise)
    m.check_invariants()
    m.release("c")
    assert_no_leak(m)
    # Blocks 0-1 of `long` are a's (recommitted by c); block 2 left with the reset.
    assert where(m, long) == ["both", "both", "-", "both"]
    m.reset()
    assert m.stats()["device"]["free"] == 12  # type: ignore[index]


def test_lost_worker_keeps_in_flight_blocks_until_every_rank_answers(make: Factory) -> None:
    """After `lose_all` (a worker died), a load still pending on the other ranks writes into
    its device blocks: those must not be handed to another request before it is answered,
    even when the request that matched them is released at once. An allocation that needs
    them waits for that answer (here: the load fails, as on the lost rank) and only then
    gets them."""
    d = ManualDispatcher(lambda task: (task.kind != TaskKind.H2D, 0))
    m = make(device_blocks=4, host_blocks=8, write_policy="write_back", dispatcher=d)
    a = prompt(1, 9)
    serve(m, "a", a)
    for seq in list(d.tasks):
        d.complete(seq)
    serve(m, "b", prompt(2, 9))  # demotes a's two blocks to the host
    for seq in list(d.tasks):
        d.complete(seq)
    res = m.match("c", a)
    assert res.host_tokens > 0 and len(d.tasks) == 1  # one H2D in flight
    (load,) = d.tasks.values()
    loading = set(load.dst)
    m.lose_all()
    m.release("c")
    m.check_invariants()
    free = m.stats()["device"]["free"]
    assert free == 4 - len(loading)
    m.match("d", prompt(3, 1))
    got = set(m.allocate("d", free * BS, 0))
    assert not got & loading, f"blocks {sorted(got & loading)} reused while still loading"
    assert load.seq in d.tasks  # the loading blocks stay out until it answers ...
    got = set(m.allocate("d", BS, 0))  # ... which this allocation waits for
    assert load.seq not in d.tasks and got <= loading, (got, loading)
    m.release("d")
    m.check_invariants()
    assert m.stats()["device"]["free"] == 4 and m.stats()["host"]["free"] == 8


def test_lost_worker_frees_device_blocks_whose_nodes_only_back_up_to_storage(
        make: Factory) -> None:
    """After `lose_all`, a node whose only transfer in flight is a storage backup (it reads
    the host copy) gives its device block back at once: a slow store must not starve the
    allocations of the requests that follow the loss."""
    d = ManualDispatcher()
    m = make(device_blocks=4, host_blocks=8, write_policy="write_through", dispatcher=d)
    a = prompt(1, 16)
    serve(m, "a", a)
    for seq in list(d.tasks):
        d.complete(seq)  # the D2H backups landed: 4 blocks on device and host
    nodes = [node(m, a, i) for i in range(4)]
    done: list[bool] = []

    def on_done(ok: bool, _comp: object) -> None:  # what the storage tier does
        for n in nodes:
            assert n is not None
            n.flags &= ~BACKING
            m.after_transfer(n)
        done.append(ok)

    with m.lock:
        for n in nodes:
            assert n is not None
            n.flags |= BACKING
            m.relist(n)
        seq = m.next_seq()
        m.track(Task(seq, TaskKind.BACKUP, [n.host for n in nodes if n], [], [b"k" * 32] * 4,
                     Priority.BACKUP), [n for n in nodes if n], on_done=on_done)
        m._flush()
    m.lose_all()
    assert m.stats()["device"]["free"] == 4  # type: ignore[index]
    m.match("b", prompt(2, 16))
    assert len(m.allocate("b", 16, 0)) == 4 and seq in d.tasks
    d.complete(seq)
    assert done == [True]
    m.release("b")
    m.check_invariants()
    assert m.stats()["host"]["free"] == 8  # type: ignore[index]


# ---------------------------------------------------------------------- revoke


def storage_manager(make: Factory, tmp_path: Path, host_blocks: int = 64,
                    **storage: str) -> tuple[KVCacheManager, ManualDispatcher, StorageTier]:
    """A manager with a storage tier on a ManualDispatcher (a test answers every QUERY and
    PREFETCH), best_effort, prefetch threshold 4 tokens, 64 host blocks (limit 16);
    `storage`: more [storage] keys."""
    d = ManualDispatcher()
    m = make(device_blocks=16, host_blocks=host_blocks, write_policy="write_through",
             dispatcher=d, page_bytes=4096)
    cfg = tiny_config(workers=1, host_blocks=host_blocks, device_blocks=16, storage="file",
                      storage_dir=tmp_path, extra={
                          "KVTIER_STORAGE__PREFETCH_POLICY": "best_effort",
                          "KVTIER_STORAGE__PREFETCH_THRESHOLD": "4",
                          **{f"KVTIER_STORAGE__{k.upper()}": v for k, v in storage.items()}})
    tier = StorageTier(m, cfg)
    m.storage = tier
    return m, d, tier


def test_revoked_prefetch_keeps_the_pages_read_and_frees_the_rest(
        make: Factory, tmp_path: Path) -> None:
    m, d, tier = storage_manager(make, tmp_path)
    p = prompt(1, 8 * BS + 1)
    assert m.prefetch(p)
    [query] = tasks_of(d, TaskKind.QUERY)
    d.complete(query.seq, result=8)
    [pf] = tasks_of(d, TaskKind.PREFETCH)
    assert len(pf.dst) == 8 and m.stats()["host"]["free"] == 64 - 8  # type: ignore[index]
    # A shorter prompt does not own this prefetch: it reaches past its blocks.
    assert m.revoke_prefetch(p[: 4 * BS + 1]) == 0 and not tasks_of(d, TaskKind.REVOKE)
    assert m.revoke_prefetch(p) == 1
    [revoke] = tasks_of(d, TaskKind.REVOKE)
    assert list(revoke.src) == [pf.seq] and revoke.priority == Priority.CONTROL
    assert m.revoke_prefetch(p) == 0  # revoked once
    # Until it answers, its blocks are served to nobody.
    assert m.match("a", p).num_tokens == 0
    m.release("a")
    d.complete(revoke.seq, result=1)
    d.complete(pf.seq, result=3)  # every rank read 3 pages before it stopped
    assert where(m, p) == ["host"] * 3 + ["-"] * 5
    assert m.stats()["host"]["free"] == 64 - 3  # type: ignore[index]
    c = tier.counters
    assert (c["revoked_prefetches"], c["revoked_pages_kept"], c["revoked_pages_dropped"]) == (
        1, 3, 5)
    assert tier.prefetching_blocks == 0 and not tier._revoked
    # The pages kept are storage hits.
    res = m.match("b", p)
    assert (res.storage_tokens, res.device_tokens) == (3 * BS, 0)
    for seq in list(d.tasks):
        d.complete(seq)
    m.release("b")


def test_revoked_query_starts_no_prefetch(make: Factory, tmp_path: Path) -> None:
    m, d, tier = storage_manager(make, tmp_path)
    p = prompt(2, 8 * BS + 1)
    assert m.prefetch(p)
    [query] = tasks_of(d, TaskKind.QUERY)
    assert m.revoke_prefetch(p) == 1
    assert not tasks_of(d, TaskKind.REVOKE)  # a query is only marked, the workers finish it
    d.complete(query.seq, result=8)
    assert not tasks_of(d, TaskKind.PREFETCH)
    assert m.stats()["host"]["free"] == 64  # type: ignore[index]
    assert tier.counters["revoked_queries"] == 1 and not tier._revoked
    # Without a storage tier there is nothing to revoke.
    plain = make(device_blocks=4)
    assert plain.revoke_prefetch(p) == 0


def test_a_block_the_complete_index_lacks_is_a_miss_without_a_query(
        make: Factory, tmp_path: Path) -> None:
    """Issue 25, the scheduler API's twin of the keyed surface's check: once storage's listing
    is complete, a cold prompt whose first block it does not list is a miss at once (match
    and prefetch send no QUERY); a listed one is asked; before any listing, every miss is."""
    m, d, tier = storage_manager(make, tmp_path)
    cold, listed = prompt(3, 8 * BS + 1), prompt(4, 8 * BS + 1)
    # No listing yet: the index is incomplete, so a miss asks storage (the control).
    m.match("a", cold)
    assert len(tasks_of(d, TaskKind.QUERY)) == 1 and tier.counters["index_misses"] == 0
    m.release("a")
    for t in tasks_of(d, TaskKind.QUERY):
        d.complete(t.seq, result=0)
    # Storage lists one page: the first block of `listed`.
    first = tier.request_skeys(RequestState(chain_keys(listed, BS), None), listed, 1)[0]
    tier.refresh_index()
    [listing] = tasks_of(d, TaskKind.LIST)
    d.complete(listing.seq, result=1, detail=[key_tag(first)])
    assert tier.index_complete() and tier.holds(first)
    m.match("b", cold)
    assert not m.prefetch(cold)
    assert not tasks_of(d, TaskKind.QUERY) and tier.counters["index_misses"] == 2
    assert tier.counters["queries"] == 1
    m.release("b")
    assert m.prefetch(listed)
    [query] = tasks_of(d, TaskKind.QUERY)
    d.complete(query.seq, result=0)
    assert tier.counters["queries"] == 2 and tier.counters["index_misses"] == 2
    assert_no_leak(m)


def land(d: ManualDispatcher) -> None:
    """Answer the device -> host copies in flight: their host copies land."""
    for t in tasks_of(d, TaskKind.D2H):
        d.complete(t.seq)


def backed_up(d: ManualDispatcher) -> int:
    """Answer every BACKUP in flight in full; returns the pages they wrote."""
    pages = 0
    for t in tasks_of(d, TaskKind.BACKUP):
        d.complete(t.seq, result=len(t.keys))
        pages += len(t.keys)
    return pages


def test_write_through_writes_every_copy_that_lands(make: Factory, tmp_path: Path) -> None:
    m, d, tier = storage_manager(make, tmp_path)
    serve(m, "a", prompt(5, 4 * BS))
    land(d)
    assert backed_up(d) == 4 and tier.counters["backup_pages"] == 4


def test_selective_writes_a_copy_once_its_block_was_hit_enough(make: Factory,
                                                               tmp_path: Path) -> None:
    """storage.write_threshold = 2: nothing is written when the copies land, nor at the
    first reuse; the second reuse writes the blocks it hit (device hits with host copies;
    a host hit once its load has landed), and only those."""
    m, d, tier = storage_manager(make, tmp_path, write_policy="write_through_selective",
                                 write_threshold="2")
    p = prompt(6, 4 * BS + 1)
    serve(m, "a", p)
    land(d)
    assert not tasks_of(d, TaskKind.BACKUP)
    serve(m, "b", p)  # 1 hit each
    land(d)
    assert not tasks_of(d, TaskKind.BACKUP)
    serve(m, "c", p[: 2 * BS + 1])  # blocks 0 and 1 reach 2 hits
    assert backed_up(d) == 2
    # a host hit: written once its load landed (a load in flight may still move the copy)
    evict = m.stats()["device"]["capacity"]
    for i in range(evict // 4):
        serve(m, f"x{i}", prompt(100 + i, 4 * BS + 1))
    land(d)
    backed_up(d)
    assert where(m, p)[2] == "host"
    res = m.match("e", p[: 3 * BS + 1])
    assert res.host_tokens >= BS and not tasks_of(d, TaskKind.BACKUP)
    res.handle.wait()  # the H2D lands
    assert backed_up(d) >= 1
    m.release("e")
    assert tier.counters["backup_pages"] >= 3


def test_write_back_writes_only_what_the_host_tier_evicts(make: Factory,
                                                          tmp_path: Path) -> None:
    """Nothing is written when copies land; a full host tier writes its oldest unwritten
    copies (one BACKUP) and evicts a written one instead; with storage refusing (a rate
    limit of nothing left), the oldest copy goes unwritten and is counted."""
    m, d, tier = storage_manager(make, tmp_path, host_blocks=4, write_policy="write_back")
    a, b = prompt(7, 4 * BS), prompt(8, 4 * BS)
    serve(m, "a", a)
    land(d)
    assert m.stats()["host"]["free"] == 0 and not tasks_of(d, TaskKind.BACKUP)
    serve(m, "b", b)  # its D2H needs host blocks: a's copies are written first
    [backup] = tasks_of(d, TaskKind.BACKUP)
    assert len(backup.keys) == 4 and m.counters.evicted_host_unstored == 0
    assert not tasks_of(d, TaskKind.D2H)  # every host copy is being written: none taken
    d.complete(backup.seq, result=4)
    assert all(n is not None and n.flags & STORED for n in (node(m, a, i) for i in range(4)))
    serve(m, "b2", prompt(9, 4 * BS))  # written copies go first now, nothing lost
    land(d)
    assert m.counters.evicted_host_unstored == 0 and m.counters.evicted_host_drop == 4
    # storage refuses (no budget): the oldest unwritten copy is evicted unwritten, counted
    tier._rate = tier._bucket = 1e-9
    serve(m, "c", prompt(10, 2 * BS))
    land(d)
    assert m.counters.evicted_host_unstored == 2
    assert tier.counters["backup_skipped_pages"] >= 2


def test_write_back_demotion_writes_the_unwritten_host_copies_first(make: Factory,
                                                                    tmp_path: Path) -> None:
    """The scheduler's own demotion (cache write_back: a device victim moves to the host)
    under storage write_back: when the host tier is full of unwritten copies, a demotion
    writes them (one BACKUP, BACKING keeps them) instead of evicting one unwritten, and
    drops its own victim; once written, the next demotion evicts written copies."""
    d = ManualDispatcher()  # a demotion's D2H is waited for: the resolver lands it
    m = make(device_blocks=5, host_blocks=4, write_policy="write_back", dispatcher=d,
             page_bytes=4096)
    cfg = tiny_config(workers=1, host_blocks=4, device_blocks=5, storage="file",
                      storage_dir=tmp_path,
                      extra={"KVTIER_STORAGE__WRITE_POLICY": "write_back"})
    m.storage = StorageTier(m, cfg)
    a, b = prompt(21, 4 * BS), prompt(22, 4 * BS)
    serve(m, "a", a)
    serve(m, "b", b)  # a's blocks leave the device for the host's 4 free blocks
    assert where(m, a).count("host") >= 3 and not tasks_of(d, TaskKind.BACKUP)
    demoted = m.counters.evicted_device_demote
    serve(m, "c", prompt(23, 4 * BS))  # b's demotion finds the host full and unwritten
    [backup] = tasks_of(d, TaskKind.BACKUP)  # a's copies, oldest first, all still held
    backing = [n for n in (node(m, a, i) for i in range(4)) if n and n.flags & BACKING]
    assert where(m, a) == ["host"] * 4 and len(backup.keys) == len(backing) >= 3
    assert m.counters.evicted_host_unstored == 0 and m.counters.evicted_host_drop == 0
    d.complete(backup.seq, result=len(backup.keys))
    serve(m, "e", prompt(24, 4 * BS))  # written copies make room for c's demotion
    assert m.counters.evicted_host_drop > 0 and m.counters.evicted_host_unstored == 0
    assert m.counters.evicted_device_demote > demoted


def test_backup_rate_limit_writes_what_the_budget_allows(make: Factory,
                                                         tmp_path: Path) -> None:
    """storage.max_backup_mb_s: a token bucket of one second's worth. A burst beyond it is
    written as far as the bucket pays and the rest skipped (counted); the bucket refills."""
    page = 4096  # storage_manager's page
    m, d, tier = storage_manager(make, tmp_path, max_backup_mb_s=str(2.5 * page / 1e6))
    serve(m, "a", prompt(11, 4 * BS))
    land(d)
    assert backed_up(d) == 2 and tier.counters["backup_skipped_pages"] == 2
    tier._filled_at -= 1.0  # a second passes: the bucket is full again (2.5 pages)
    serve(m, "b", prompt(12, 4 * BS))
    land(d)
    assert backed_up(d) == 2 and tier.counters["backup_skipped_pages"] == 4


def test_slow_writes_send_one_probe_at_a_time(make: Factory, tmp_path: Path) -> None:
    """Back-pressure (storage.slow_write_ms): while writes are slow, one probe batch a
    second goes through, and not while the last probe is unanswered (a store slower than a
    batch a second would pile probes up in its lane, each holding its host copies), unless
    that probe is PROBE_STALE_S old (an answer that never comes must not end the probes)."""
    m, d, tier = storage_manager(make, tmp_path, slow_write_ms="100")
    tier.write_latency = 10.0  # the store takes 10 s a batch: slow
    serve(m, "a", prompt(31, 4 * BS))
    land(d)
    [probe] = tasks_of(d, TaskKind.BACKUP)  # the first batch probes
    tier._probed_at -= 2.0  # the interval passed, the probe still unanswered
    serve(m, "b", prompt(32, 4 * BS))
    land(d)
    assert tasks_of(d, TaskKind.BACKUP) == [probe], "a second probe while one is waiting"
    assert tier.counters["backup_slow_skipped_pages"] == 4
    d.complete(probe.seq, result=len(probe.keys))  # answered (10 s by the average's count)
    tier._probed_at -= 2.0
    serve(m, "c", prompt(33, 4 * BS))
    land(d)
    assert len(tasks_of(d, TaskKind.BACKUP)) == 1  # answered: the next probe went
    tier._probed_at -= 2.0
    tier._probe_sent -= PROBE_STALE_S  # type: ignore[operator]
    serve(m, "e", prompt(34, 4 * BS))  # a probe never answered: stale, the next one goes
    land(d)
    assert len(tasks_of(d, TaskKind.BACKUP)) == 2 and tier.counters["backup_probes"] == 3
    assert tier.counters["backup_slow_skipped_pages"] == 4 and tier.writes_slow()
    backed_up(d)


# ---------------------------------------------------------------------- lose_device (engine KV)


def _confirmed_host_and_device(make: Factory) -> tuple[KVCacheManager, ManualDispatcher,
                                                        list[int], list[int]]:
    """Engine-KV tracking on; `a` (3 blocks) cached on device and host with its D2H copies
    confirmed; `b` (2 blocks) cached on the device with its D2H backup still in flight."""
    d = ManualDispatcher()
    m = make(device_blocks=8, host_blocks=8, write_policy="write_through", dispatcher=d)
    m.track_device_copies = True
    a = prompt(1, 3 * BS)
    serve(m, "a", a)
    for seq in list(d.tasks):
        d.complete(seq)
    m.confirm_device_copies(m.device_copy_mark())
    b = prompt(2, 2 * BS)
    serve(m, "b", b)  # its D2H stays pending in `d`
    return m, d, a, b


def test_lose_device_keeps_confirmed_host_copies(make: Factory) -> None:
    """Issue 9: a model-runner restart costs the device tier only: a's confirmed host copies
    are still a host hit (loaded into new device blocks), b (device only, its backup in
    flight) is a miss and never served, and the counters tell lose_device from lose_all."""
    m, d, a, b = _confirmed_host_and_device(make)
    assert where(m, a) == ["both"] * 3
    saving = [n for n in (node(m, b, i) for i in range(2)) if n is not None]
    assert all(n.flags & SAVING for n in saving)
    out = m.lose_device()
    assert out["written_off"] == 2 and out["device_blocks"] == 3, out
    m.check_invariants()
    assert where(m, a) == ["host"] * 3 and where(m, b) == ["-", "-"]
    assert m.stats()["counters"]["lost_device"] == 1  # type: ignore[index]
    assert m.stats()["counters"]["lost_all"] == 0  # type: ignore[index]
    res = m.match("a2", [*a, 1])
    assert (res.device_tokens, res.host_tokens) == (0, 3 * BS)
    assert tasks_of(d, TaskKind.H2D)
    m.release("a2")
    assert m.match("b2", [*b, 1]).num_tokens == 0
    m.release("b2")
    for seq in list(d.tasks):  # b's backup answers after the loss (read from old memory)
        d.complete(seq)
    assert where(m, b) == ["-", "-"]  # written off: never served
    assert_no_leak(m)


def test_lose_device_drops_host_copies_not_yet_confirmed(make: Factory) -> None:
    """A D2H copy that completed after the last registration check may have been read from
    the new memory: until a check confirms it, a change drops it too, and it is not backed up
    to storage meanwhile (confirm_device_copies is what hands it on)."""
    d = ManualDispatcher()
    m = make(device_blocks=8, host_blocks=8, write_policy="write_through", dispatcher=d)
    m.track_device_copies = True
    a = prompt(1, 2 * BS)
    serve(m, "a", a)
    mark = m.device_copy_mark()
    for seq in list(d.tasks):
        d.complete(seq)  # completed after the mark: not covered by a check begun at `mark`
    assert m.confirm_device_copies(mark) == 0
    assert where(m, a) == ["both", "both"]
    m.lose_device()
    m.check_invariants()
    assert where(m, a) == ["-", "-"]
    assert m.match("a2", a).num_tokens == 0
    m.release("a2")
    # the same copies confirmed by a later check survive a later change
    serve(m, "c", a)
    for seq in list(d.tasks):
        d.complete(seq)
    assert m.confirm_device_copies(m.device_copy_mark()) == 2
    m.lose_device()
    assert where(m, a) == ["host", "host"]
    m.check_invariants()


def test_lose_device_hands_blocks_held_by_requests_to_them(make: Factory) -> None:
    """A request holding a cached block when the device memory is replaced keeps the block
    (detached, returned at its release); the host copy stays cached under a fresh node and
    the request's later commit joins nothing."""
    m, d, a, _ = _confirmed_host_and_device(make)
    res = m.match("h", [*a, 1])
    assert res.device_tokens == 3 * BS
    m.lose_device()
    m.check_invariants()
    assert where(m, a) == ["host"] * 3
    assert m.request_lost("h")
    m.release("h")
    for seq in list(d.tasks):
        d.complete(seq, ok=False)
    assert_no_leak(m)
