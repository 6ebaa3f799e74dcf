"""`cache.host_eviction_policy` (kvtier.manager.policies' strategies over the host LRU list,
the core's `take_host_block` / `host_victims`): on the keyed surface the policy changes which
host copy a store evicts, `lru` keeps the list's order; `host_victims` predicts every
strategy's victims exactly; unknown names are one-line errors, and storage write_back is
accepted beside any policy (its batches follow the policy's order: tests/test_keyed.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kvtier.manager.config import ConfigError, load_config
from kvtier.manager.keyed import KeyedHostCache, engine_key
from kvtier.manager.policies import EVICTION_POLICIES, make_eviction_policy
from kvtier.manager.scheduler import KVCacheManager

pytestmark = pytest.mark.fast

HOST = 4


def keyed(policy: str, host: int = HOST) -> tuple[KVCacheManager, KeyedHostCache]:
    m = KVCacheManager(block_size=4, device_blocks=4, host_blocks=host,
                       host_eviction_policy=policy)
    return m, KeyedHostCache(m, None, namespace=b"i38b")


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(c: KeyedHostCache, hashes: list[bytes]) -> None:
    plan = c.prepare_store(hashes)
    assert plan is not None
    c.complete_store(hashes)


def load(c: KeyedHostCache, hashes: list[bytes]) -> None:
    assert len(c.prepare_load(hashes)) == len(hashes)
    c.complete_load(hashes)


def cached(m: KVCacheManager) -> set[int]:
    return {k for k in (engine_key(h(i)) for i in range(100))
            if (n := m.lookup(k)) is not None and n.host is not None}


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_policy_picks_which_host_copy_a_store_evicts(policy: str) -> None:
    """A copy loaded once, then three newer copies never used: LRU evicts the loaded one
    (the least recently used), every other policy a never-used one (the oldest of them)."""
    m, c = keyed(policy)
    store(c, [h(0)])
    load(c, [h(0)])
    for i in (1, 2, 3):
        store(c, [h(i)])
    predicted = m.host_victims(1)
    store(c, [h(4)])
    gone = {engine_key(h(i)) for i in range(4)} - cached(m)
    want = h(0) if policy == "lru" else h(1)
    assert gone == {engine_key(want)}, policy
    assert predicted == [engine_key(want)]
    assert m.counters.eviction_policy_fallbacks == 0
    m.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_host_victims_predicts_every_eviction(policy: str) -> None:
    """Random stores, loads and touches: before each store that must evict, `host_victims`
    names exactly the copies the store evicts (and changes nothing: the next prediction is
    made after the real evictions)."""
    rng = random.Random(38)
    m, c = keyed(policy, host=6)
    for _ in range(300):
        op = rng.random()
        live = [i for i in range(12) if engine_key(h(i)) in cached(m)]
        if op < 0.5:
            new = [i for i in rng.sample(range(12), 2) if i not in live]
            hashes = [h(i) for i in new]
            short = len(hashes) - m.host_free
            before = cached(m)
            predicted = m.host_victims(short) if short > 0 else []
            if hashes:
                store(c, hashes)
            assert before - cached(m) == set(predicted), policy
        elif op < 0.8 and live:
            load(c, [h(rng.choice(live))])
        elif live:
            c.touch([h(rng.choice(live))])
        m.check_invariants()
    assert m.counters.eviction_policy_fallbacks == 0


def test_lru_is_the_list_order_unchanged() -> None:
    """`lru` builds no strategy: the host tier is today's list, the hot path untouched."""
    m, _ = keyed("lru")
    assert m._host_evict is None and make_eviction_policy("lru", 8, "host") is None


def test_unknown_is_one_line_and_write_back_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^cache\.host_eviction_policy = 'lfu': expected "
                                         r"one of lru, lfuda, hitboost, arc, s3fifo, duel$"):
        make_eviction_policy("lfu", 8, "host", "cache.host_eviction_policy")
    bad = tmp_path / "bad.toml"
    bad.write_text('[cache]\nhost_eviction_policy = "lfu"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(bad, {}, check_resources=False)
    assert "cache.host_eviction_policy" in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1
    wb = tmp_path / "wb.toml"
    wb.write_text('[cache]\nhost_eviction_policy = "arc"\n'
                  '[storage]\nbackend = "file"\nwrite_policy = "write_back"\n')
    assert load_config(wb, {}, check_resources=False).cache.host_eviction_policy == "arc"
    ok = tmp_path / "ok.toml"
    ok.write_text('[cache]\nhost_eviction_policy = "s3fifo"\n')
    assert load_config(ok, {}, check_resources=False).cache.host_eviction_policy == "s3fifo"


def test_scheduler_api_host_tier_under_each_policy() -> None:
    """The scheduler API's host tier (write_through: every committed block backed up, the
    host tier evicting as it fills): random conversations under each policy keep the core's
    invariants after every request, never fall back to the list's oldest, and the policies
    change the host hits (so the strategy, not the list, chose)."""
    host_hits = {}
    for policy in EVICTION_POLICIES:
        m = KVCacheManager(block_size=4, device_blocks=24, host_blocks=40,
                           write_policy="write_through", host_eviction_policy=policy)
        rng = random.Random(7)
        convs: list[list[int]] = []
        for i in range(400):
            if convs and rng.random() < 0.7:
                j = rng.randrange(len(convs))
                convs[j] = convs[j] + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
                prompt = convs[j][:80]
            else:
                prompt = [rng.randrange(50) for _ in range(rng.randint(4, 24))]
                convs.append(prompt)
            rid = f"r{i}"
            mr = m.match(rid, prompt)
            m.allocate(rid, len(prompt) - mr.num_tokens, reserve_blocks=0)
            m.commit(rid, prompt, len(prompt))
            m.release(rid)
            m.check_invariants()
        assert m.counters.eviction_policy_fallbacks == 0, policy
        assert m.counters.evicted_host_drop > 0, policy
        host_hits[policy] = m.counters.hit_host_tokens
    assert all(h > 0 for h in host_hits.values()), host_hits
    assert len(set(host_hits.values())) > 1, host_hits


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_config_reaches_the_keyed_surface(tmp_path: Path, policy: str) -> None:
    """`assemble` (every home: `Stack`, the node's namespaces, the vLLM adapter) hands the
    key to the core under a keyed surface: its host tier runs the configured strategy."""
    from kvtier.manager.stack import assemble
    from kvtier.manager.transfers import ImmediateDispatcher

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cache]\nhost_eviction_policy = "{policy}"\nhost_blocks = 4\n'
                   '[storage]\nbackend = "none"\n')
    parts = assemble(load_config(cfg, {}, check_resources=False), ImmediateDispatcher(),
                     keyed_namespace=b"i38b")
    assert parts.keyed is not None
    strategy = parts.manager._host_evict
    assert (strategy is None) if policy == "lru" else (strategy.name == policy
                                                       and strategy.tier == "host")
