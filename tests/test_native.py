"""The compiled hot path (`kvtier.manager._native`) against its pure-Python twin.

`kvtier.manager.core.native` picks the compiled loops when the extension imports, else pure Python
(KVTIER_NATIVE=0 forces that). Both must give identical tree keys, identical hits and
identical manager states: here both run on the same randomized inputs, and the stateful
machines of test_manager_stateful run again with the pure-Python loops (the file itself runs
them with whatever is selected, i.e. the compiled ones on a built tree).
"""

from __future__ import annotations

import ast
import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import hypothesis.strategies as st
import pytest
import xxhash
from hypothesis import given, settings
from kvtier.manager.core import native
from kvtier.manager.keys import chain_keys
from kvtier.manager.scheduler import KVCacheManager
from kvtier.manager.transfers import ManualDispatcher
from support import examples
from test_manager_stateful import SETTINGS, ManagerMachine

pytestmark = pytest.mark.fast

needs_native = pytest.mark.skipif(not native.available(),
                                  reason=f"native extension not in use: {native.UNAVAILABLE}")


@pytest.fixture(autouse=True)
def _restore_selection() -> Iterator[None]:
    before = native.active()
    yield
    native.use(before)


def test_extension_is_built_unless_turned_off() -> None:
    """`make install` builds the extension; only KVTIER_NATIVE=0 may leave it out."""
    if os.environ.get("KVTIER_NATIVE") == "0":
        assert not native.available() and not native.active()
    else:
        assert native.available(), native.UNAVAILABLE
        assert native.active()


_FALLBACK = """
import sys, warnings
sys.modules["kvtier.manager._native"] = None  # as if the build had failed
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from kvtier.manager.core import native
print(native.active(), [f"{w.category.__name__}: {w.message}" for w in caught])
"""


@pytest.mark.parametrize("setting", ["", "0"])
def test_a_fallback_to_pure_python_is_loud(setting: str) -> None:
    """Without the extension kvtier still runs, but says so at import with a warning
    (unless KVTIER_NATIVE=0 chose pure Python)."""
    env = {k: v for k, v in os.environ.items() if k != "KVTIER_NATIVE"}
    if setting:
        env["KVTIER_NATIVE"] = setting
    out = subprocess.run([sys.executable, "-c", _FALLBACK], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.startswith("False"), out
    if setting == "0":
        assert "NativeFallbackWarning" not in out, out
    else:
        assert "NativeFallbackWarning: kvtier runs its hot loops in pure Python" in out, out
        assert "does not import" in out, out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None, reason="no C compiler")
def test_extension_compiles_warning_free(tmp_path: Path) -> None:
    """manager/_native.c compiles with setup.py's flags and every warning an error, against
    this Python's headers: 3.11 in `make test`, 3.12 and 3.13 in `make test-pythons` (every
    version `requires-python` admits)."""
    root = Path(__file__).resolve().parents[1]
    setup_src = (root / "setup.py").read_text()
    flags = ast.literal_eval(setup_src.split("extra_compile_args=", 1)[1].split("]", 1)[0] + "]")
    include = sysconfig.get_paths()["include"]
    proc = subprocess.run(
        ["gcc", *flags, "-Werror", "-fPIC", "-shared", f"-I{include}",
         str(root / "manager" / "_native.c"), "-ldl", "-o", str(tmp_path / "_native.so")],
        capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-4000:]


def test_use_refuses_a_missing_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_ext", None)
    with pytest.raises(RuntimeError, match="not available"):
        native.use(True)


def both(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """`fn` run with the compiled loops and with the pure-Python ones."""
    native.use(True)
    a = fn(*args, **kwargs)
    native.use(False)
    b = fn(*args, **kwargs)
    return a, b


# ---------------------------------------------------------------------- keys

int32 = st.integers(-(2**31), 2**31 - 1)


@needs_native
@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(int32 | st.integers(0, 40), max_size=300),
       block_size=st.integers(1, 70), parent=st.integers(0, 2**128 - 1),
       start=st.integers(0, 8), count=st.none() | st.integers(0, 12))
def test_tree_keys_are_identical(tokens: list[int], block_size: int, parent: int, start: int,
                                 count: int | None) -> None:
    kw = {"parent": parent, "start_block": start, "num_blocks": count}
    a, b = both(chain_keys, tokens, block_size, **kw)
    assert a == b
    assert both(chain_keys, tuple(tokens), block_size, **kw) == (a, a)
    end = len(tokens) // block_size if count is None else min(len(tokens) // block_size,
                                                               start + count)
    want, p = [], parent
    for blk in range(start, end):  # the documented formula, straight from xxhash
        data = struct.pack(f"<{block_size}i", *tokens[blk * block_size:(blk + 1) * block_size])
        p = xxhash.xxh3_128_intdigest(data, p & (2**64 - 1)) ^ (p >> 64)
        want.append(p)
    assert a == want


@needs_native
@settings(max_examples=examples(300), deadline=None)
@given(data=st.binary(max_size=1500), seed=st.integers(0, 2**64 - 1))
def test_resolved_xxh3_is_the_packages(data: bytes, seed: int) -> None:
    from kvtier.manager import _native
    assert _native.xxh3_128_intdigest(data, seed) == xxhash.xxh3_128_intdigest(data, seed)


@needs_native
@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**70, 2.0, "7", None, True])
def test_inputs_the_compiled_path_does_not_take_behave_as_in_python(bad: object) -> None:
    """Anything but exact int32 ints goes to the Python path: the same keys (bool) or the
    same error, naming the token."""
    tokens: list[object] = [1, 2, 3, 4, 5, 6, 7, 8]
    tokens[5] = bad

    def run() -> object:
        try:
            return chain_keys(tokens, 4)  # type: ignore[arg-type]
        except Exception as e:
            return type(e), str(e)

    a, b = both(run)
    assert a == b


@needs_native
def test_parent_outside_128_bits_behaves_as_in_python() -> None:
    tokens = list(range(16))
    for parent in (2**128, 2**130 + 5):
        a, b = both(chain_keys, tokens, 4, parent=parent)
        assert a == b


@needs_native
def test_extra_keys_and_sequences_take_the_python_path() -> None:
    tokens = list(range(32))
    extra = [(3, 9, b"img")]
    assert both(chain_keys, tokens, 8, extra_keys=extra)[0] == both(
        chain_keys, tokens, 8, extra_keys=extra)[1]
    a, b = both(chain_keys, range(32), 8)
    assert a == b == chain_keys(tokens, 8)


# ---------------------------------------------------------------------- managers


def _drive(seed: int, host_blocks: int, policy: str) -> list[object]:
    """A random multi-turn workload through a fresh manager: every observable result, then
    the final tree, LRU orders and free lists."""
    rng = random.Random(seed)
    disp = ManualDispatcher()
    m = KVCacheManager(block_size=4, device_blocks=40, host_blocks=host_blocks,
                       write_policy=policy, hit_threshold=2, dispatcher=disp)
    prefixes = [[rng.randrange(0, 50) for _ in range(rng.randrange(0, 24))] for _ in range(4)]
    trace: list[object] = []
    live: list[str] = []
    for i in range(200):
        action = rng.random()
        if action < 0.6 or not live:
            rid = f"r{i}"
            toks = rng.choice(prefixes) + [rng.randrange(0, 5) for _ in range(rng.randrange(30))]
            r = m.match(rid, toks)
            trace.append(("match", r.block_ids, r.device_tokens, r.host_tokens))
            try:
                trace.append(("alloc", m.allocate(rid, len(toks) - r.num_tokens, 0)))
                trace.append(("commit", m.commit(rid, toks, rng.randrange(len(toks) + 1))))
            except Exception as e:
                trace.append(("error", type(e).__name__))
            live.append(rid)
        elif action < 0.9:
            m.release(live.pop(rng.randrange(len(live))))
        elif action < 0.92:
            trace.append(("lost", m.lose_all()))  # clears the tree: free-list order must agree
        else:
            for seq in sorted(disp.tasks)[: rng.randrange(4)]:
                disp.complete(seq, rng.random() < 0.8)
        m.check_invariants()
        trace.append(m.stats())
    trace.append(sorted((k, n.dev, n.host, n.ref, n.hits, n.flags) for k, n in m._map.items()))
    trace.append([n.key for n in m._dev_lru])
    trace.append([n.key for n in m._host_lru])
    trace.append(m._dev_pool.free_ids())
    trace.append(m._host_pool.free_ids())
    return trace


@needs_native
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("host_blocks", "policy"),
                         [(0, "write_through_selective"), (20, "write_through_selective"),
                          (20, "write_through"), (20, "write_back")])
def test_managers_reach_identical_states(seed: int, host_blocks: int, policy: str) -> None:
    a, b = both(_drive, seed, host_blocks, policy)
    assert a == b


def _pool_run(seed: int) -> list[object]:
    """Random allocations and frees (bad ones included) through a block pool."""
    from kvtier.manager.core.block_pool import BlockPool
    rng = random.Random(seed)
    pool = BlockPool("device", 24)
    out: list[object] = []
    held: list[int] = []
    for _ in range(300):
        if rng.random() < 0.4 and pool.num_free:
            held += pool.allocate(rng.randrange(1, pool.num_free + 1))
            continue
        rng.shuffle(held)
        ids: list[object] = held[: rng.randrange(len(held) + 1)]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1),
                       rng.choice([-1, 24, 2**70, True, 3.0, "1", *(ids or [0])]))
        try:
            pool.free(ids)  # type: ignore[arg-type]
            held = [i for i in held if i not in ids]
            out.append("ok")
        except Exception as e:
            out.append(str(e))
        out.append(pool.free_ids())
    return out


@needs_native
@pytest.mark.parametrize("seed", range(8))
def test_block_pool_frees_identically(seed: int) -> None:
    """The compiled check-and-free declines whatever Python rejects: same errors, same
    free lists."""
    a, b = both(_pool_run, seed)
    assert a == b
    assert any(x != "ok" and isinstance(x, str) for x in a)


# ---------------------------------------------------------------------- tree map and nodes


@needs_native
@settings(max_examples=examples(60), deadline=None)
@given(bits=st.sampled_from([3, 6, 12, 128]), seed=st.integers(0, 2**32 - 1),
       capacity=st.integers(0, 50))
def test_keymap_behaves_as_a_dict(bits: int, seed: int, capacity: int) -> None:
    """The compiled tree map against a dict: few key bits give long probe runs, so deletions
    (backward shifts) and growth are exercised."""
    from kvtier.manager import _native
    rng = random.Random(seed)
    km, d = _native.KeyMap(capacity), {}
    for i in range(600):
        k = rng.getrandbits(bits)
        op = rng.random()
        if op < 0.5:
            km[k] = d[k] = i  # type: ignore[assignment]
        elif op < 0.7:
            if k in d:
                del km[k], d[k]
            else:
                with pytest.raises(KeyError):
                    del km[k]
        elif op < 0.8:
            assert km.pop(k, None) == d.pop(k, None)
        else:
            assert km.get(k) == d.get(k)
            assert (k in km) == (k in d)
        assert len(km) == len(d)
    assert sorted(km.items()) == sorted(d.items())
    assert sorted(km.keys()) == sorted(d) and sorted(km.values()) == sorted(d.values())
    for k, v in d.items():
        assert km[k] == v
    for bad in (-1, 2**128, "x", 1.0):
        assert km.get(bad, "dflt") == "dflt" and bad not in km
    with pytest.raises(ValueError):
        km[2**128] = 1  # type: ignore[assignment]
    km.clear()
    assert len(km) == 0 and km.items() == []


@needs_native
@pytest.mark.parametrize("host", [False, True])
def test_compiled_nodes_read_and_write_as_python_nodes(host: bool) -> None:
    from kvtier.manager import _native
    from kvtier.manager.core import nodes as tree
    py_cls, c_cls = (tree.Node, _native.Node) if host else (tree.DeviceNode, _native.DeviceNode)
    key = 2**127 + 2**64 + 12345
    nodes = [cls(key, 7, 3 if host else None, 1.25) for cls in (py_cls, c_cls)]
    fields = ["key", "dev", "host", "ref", "flags", "hits", "last", "dprev", "dnext", "hprev",
              "hnext", "skey"]
    snap = [[getattr(n, f) for f in fields] for n in nodes]
    assert snap[0] == snap[1]
    writes: list[tuple[str, object]] = [("ref", 3), ("flags", 0x1FF), ("hits", 2**31 - 1),
                                        ("last", 9.5), ("dev", None), ("dev", 2**31 - 1),
                                        ("key", None), ("key", 2**128 - 1), ("key", 0)]
    if host:
        writes += [("host", None), ("host", 12), ("skey", b"k" * 32), ("hprev", nodes[0])]
    for f, v in writes:
        for n in nodes:
            setattr(n, f, v)
        assert getattr(nodes[0], f) == getattr(nodes[1], f), f
    assert repr(nodes[0]) == repr(nodes[1])
    for n in nodes:  # both forms of "not linked" read the same
        n.dprev = None
        assert n.dprev is None
    with pytest.raises(ValueError, match="device-only node cannot hold a host block"):
        _native.DeviceNode(1, 2, 3, 0.0)
    if not host:
        with pytest.raises(AttributeError):
            nodes[1].host = 4


@needs_native
def test_compiled_tree_holds_a_cached_block_in_under_150_bytes() -> None:
    """The whole manager heap (free lists, tree map and nodes) per cached block, device only,
    as bench/hotpath.py counts it: 229 bytes with the pure-Python nodes and dict, about 120
    compiled."""
    import tracemalloc

    def per_block() -> float:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            m = KVCacheManager(block_size=4, device_blocks=20_000, host_blocks=0)
            rng = random.Random(5)
            for i in range(20_000 // 50):
                toks = [i] + [rng.randrange(32000) for _ in range(50 * 4 - 1)]
                m.match(f"r{i}", toks)
                m.allocate(f"r{i}", len(toks), 0)
                m.commit(f"r{i}", toks, len(toks))
                m.release(f"r{i}")
            cached = m.stats()["device"]["cached"]
            return (tracemalloc.get_traced_memory()[0] - base) / cached
        finally:
            tracemalloc.stop()

    native.use(True)
    compiled = per_block()
    native.use(False)
    python = per_block()
    assert compiled <= 150 < python, (compiled, python)


@needs_native
@pytest.mark.parametrize("host_blocks", [0, 300])
def test_a_dropped_manager_frees_its_compiled_nodes(host_blocks: int) -> None:
    """Compiled nodes are not tracked by the garbage collector: the LRU rings are broken when
    the lists are freed, so a manager let go leaves nothing behind."""
    import gc
    import tracemalloc
    native.use(True)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        m = KVCacheManager(block_size=4, device_blocks=3000, host_blocks=host_blocks,
                           dispatcher=ManualDispatcher())
        for i in range(40):
            toks = [i] * 4 + list(range(4 * 100))
            m.match(f"r{i}", toks)
            m.allocate(f"r{i}", len(toks), 0)
            m.commit(f"r{i}", toks, len(toks))
            m.release(f"r{i}")
        assert m.stats()["device"]["cached"] >= 2900
        del m
        gc.collect()
        left = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert left < 20_000, left  # bytes; the tree alone held about 300 KB


# ---------------------------------------------------------------------- stateful, pure Python


class PurePythonMachine(ManagerMachine):
    """test_manager_stateful's machine with the pure-Python loops."""

    def __init__(self) -> None:
        native.use(False)
        super().__init__()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            native.use(native.available())


def _pure(policy: str, host_blocks: int) -> type[ManagerMachine]:
    return type(f"Pure_{policy}_{host_blocks}", (PurePythonMachine,),
                {"policy": policy, "host_blocks": host_blocks})


TestPureWriteThroughSelective = _pure("write_through_selective", 10).TestCase
TestPureWriteThroughSelective.settings = SETTINGS
TestPureWriteBack = _pure("write_back", 10).TestCase
TestPureWriteBack.settings = SETTINGS
TestPureNoHostTier = _pure("write_through_selective", 0).TestCase
TestPureNoHostTier.settings = settings(SETTINGS, max_examples=examples(15))


@needs_native
@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_keyed_hits_is_the_python_walk(seed: int) -> None:
    """The compiled batch lookup of an engine's hashes (`kvtier.manager.keyed.count_hits`)
    against its pure-Python twin on the same nodes: misses, device-only nodes, busy flags,
    hashes too short or not bytes, anywhere in the run."""
    from kvtier.manager import _native
    rng = random.Random(seed)
    km: object = _native.KeyMap(64)
    d: dict[int, object] = {}
    hashes: list[object] = []
    for _ in range(rng.randrange(0, 40)):
        h = rng.randbytes(rng.choice([32, 32, 32, 16, 20, 8]))
        key = int.from_bytes(h[:16], "little")
        kind = rng.random()
        if kind < 0.8 and len(h) >= 16:
            host = None if rng.random() < 0.1 else rng.randrange(1000)
            node = _native.Node(key, None, host, 0.0)
            node.flags = rng.choice([0, 0, 0, 512, 1024, 16, 64])
            km[key] = d[key] = node  # type: ignore[index]
        hashes.append(h if rng.random() < 0.97 else "not bytes")
    busy = 1024 | 16
    want = native.py_keyed_hits(d, hashes, busy)  # type: ignore[arg-type]
    assert native.keyed_hits(km, hashes, busy) == want  # type: ignore[arg-type]
    assert _native.keyed_hits(km, hashes, busy) == want  # type: ignore[arg-type]
