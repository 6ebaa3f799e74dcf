"""Block keys: chaining, extension, multimodal boundaries, stability and input errors.

Keys name cached blocks inside one manager (tree keys) and across managers and machines
(storage keys), so they must depend on exactly the whole prefix of a block, its tokens and
the multimodal items overlapping it, and on nothing a process chooses for itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash
from kvtier.manager.keys import ExtraKey, TokenKeyError, chain_keys, key_bytes, storage_keys

pytestmark = pytest.mark.fast

BS = 4
REPO = Path(__file__).resolve().parents[1]


def toks(n_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n_blocks * BS)]


# ---------------------------------------------------------------------- chaining


@pytest.mark.parametrize("family", ["tree", "storage"])
@pytest.mark.parametrize("changed", [0, 3, 7])
def test_changing_a_token_changes_that_block_and_every_later_one(family: str,
                                                                 changed: int) -> None:
    fn = chain_keys if family == "tree" else storage_keys
    base = toks(8)
    other = list(base)
    other[changed * BS + 2] += 1
    a, b = fn(base, BS), fn(other, BS)
    assert len(a) == len(b) == 8
    assert a[:changed] == b[:changed]
    assert all(x != y for x, y in zip(a[changed:], b[changed:], strict=True))


@pytest.mark.parametrize("family", ["tree", "storage"])
def test_same_tokens_after_different_parents_differ(family: str) -> None:
    fn = chain_keys if family == "tree" else storage_keys
    tail = toks(3, seed=1)
    a = fn(toks(2, seed=2) + tail, BS)
    b = fn(toks(2, seed=3) + tail, BS)
    assert all(x != y for x, y in zip(a, b, strict=True))
    # The same block at the root and after a parent differs too.
    assert fn(tail, BS)[0] != a[2]


def test_tree_parent_high_bits_count() -> None:
    """Two parents equal in their low 64 bits still give different children."""
    block = toks(1)
    p = chain_keys(toks(1, seed=5), BS)[0]
    q = p ^ (1 << 100)
    assert chain_keys(block, BS, parent=p) != chain_keys(block, BS, parent=q)


def test_only_full_blocks_get_keys() -> None:
    t = toks(3)
    assert len(chain_keys([*t, 1, 2, 3], BS)) == 3
    assert chain_keys(t[: BS - 1], BS) == []
    assert chain_keys([], BS) == []
    assert len(storage_keys([*t, 1], BS)) == 3
    assert chain_keys(t, BS, num_blocks=2) == chain_keys(t, BS)[:2]


@pytest.mark.parametrize("split", [1, 2, 5])
def test_extension_from_a_parent_equals_hashing_at_once(split: int) -> None:
    t = toks(6, seed=7)
    extra = [(3, 6, b"picture"), (17, 2, b"clip")]
    for kw in ({}, {"extra_keys": extra}):
        whole = chain_keys(t, BS, **kw)
        head = chain_keys(t, BS, num_blocks=split, **kw)
        rest = chain_keys(t, BS, parent=head[-1], start_block=split, **kw)
        assert head + rest == whole
        # One block at a time, as a request grows by chunked prefill.
        grown: list[int] = []
        for b in range(6):
            grown += chain_keys(t[: (b + 1) * BS], BS, parent=grown[-1] if grown else 0,
                                start_block=b, **kw)
        assert grown == whole

        s_whole = storage_keys(t, BS, **kw)
        s_head = storage_keys(t, BS, num_blocks=split, **kw)
        s_rest = storage_keys(t, BS, parent=s_head[-1], start_block=split, **kw)
        assert s_head + s_rest == s_whole


def _reference_tree_keys(tokens: list[int], block_size: int, parent: int,
                         start_block: int, end_block: int) -> list[int]:
    """The documented tree-key formula, one block at a time: xxh3-128 of the block's int32
    little-endian tokens, seeded with the parent's low 64 bits, xor the parent's high 64."""
    out = []
    for b in range(start_block, end_block):
        data = struct.pack(f"<{block_size}i", *tokens[b * block_size:(b + 1) * block_size])
        parent = xxhash.xxh3_128_intdigest(data, parent & (2**64 - 1)) ^ (parent >> 64)
        out.append(parent)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16, 64])
def test_tree_keys_follow_the_formula_for_short_and_long_runs(block_size: int) -> None:
    """Long runs of blocks are cut with one struct call, short ones by slicing: both must give
    the formula's keys, from the root and from any parent."""
    t = [random.Random(block_size).randrange(-2**31, 2**31) for _ in range(40 * block_size)]
    for start in (0, 1, 5, 13):
        for count in (1, 2, 7, 8, 9, 27):
            parent = 0 if start == 0 else chain_keys(t, block_size, num_blocks=start)[-1]
            got = chain_keys(t, block_size, parent=parent, start_block=start, num_blocks=count)
            assert got == _reference_tree_keys(t, block_size, parent, start, start + count)


# ---------------------------------------------------------------------- extra keys


def block_key(t: list[int], plain: list[int], b: int, extra: list) -> int:  # type: ignore[type-arg]
    """Key of block `b` alone with `extra`, chained from the *plain* key of its parent, so
    a block's own membership is seen apart from the chaining."""
    return chain_keys(t, BS, parent=plain[b - 1] if b else 0, start_block=b, num_blocks=1,
                      extra_keys=extra)[0]


def members(t: list[int], extra: list) -> list[int]:  # type: ignore[type-arg]
    plain = chain_keys(t, BS)
    return [b for b in range(len(plain)) if block_key(t, plain, b, extra) != plain[b]]


def test_item_ending_at_block_start_does_not_belong_to_it() -> None:
    t = toks(4)
    # Tokens 2..3: ends exactly where block 1 starts.
    assert members(t, [(2, 2, b"img")]) == [0]
    # Tokens 4..7 fill block 1 exactly.
    assert members(t, [(4, 4, b"img")]) == [1]


def test_item_starting_at_last_token_of_a_block_belongs_to_it() -> None:
    t = toks(4)
    assert members(t, [(7, 1, b"img")]) == [1]
    assert members(t, [(7, 2, b"img")]) == [1, 2]
    # Starting at a block's first token: not the block before.
    assert members(t, [(8, 1, b"img")]) == [2]


def test_item_spanning_three_blocks_changes_those_and_later_keys() -> None:
    t = toks(6)
    item = [(5, 8, b"video")]  # tokens 5..12: blocks 1, 2, 3
    assert members(t, item) == [1, 2, 3]
    plain = chain_keys(t, BS)
    with_item = chain_keys(t, BS, extra_keys=item)
    assert with_item[0] == plain[0]
    assert all(x != y for x, y in zip(with_item[1:], plain[1:], strict=True))
    s_plain, s_item = storage_keys(t, BS), storage_keys(t, BS, extra_keys=item)
    assert s_item[0] == s_plain[0]
    assert all(x != y for x, y in zip(s_item[1:], s_plain[1:], strict=True))


def test_item_order_does_not_matter() -> None:
    t = toks(6)
    items = [(0, 3, b"a"), (5, 8, b"b"), (5, 2, b"c"), (5, 2, b"b"), (9, 1, "d"),
             (20, 4, 0xBEEF), ExtraKey(14, 3, b"e")]
    want = chain_keys(t, BS, extra_keys=items)
    s_want = storage_keys(t, BS, extra_keys=items)
    rng = random.Random(3)
    for _ in range(10):
        shuffled = list(items)
        rng.shuffle(shuffled)
        assert chain_keys(t, BS, extra_keys=shuffled) == want
        assert storage_keys(t, BS, extra_keys=shuffled) == s_want


def test_different_content_hashes_give_different_keys() -> None:
    t = toks(2)
    a = chain_keys(t, BS, extra_keys=[(1, 2, b"cat")])
    b = chain_keys(t, BS, extra_keys=[(1, 2, b"dog")])
    assert a[0] != b[0] and a[1] != b[1]
    # Hash given as bytes or as the same text: one canonical form.
    assert chain_keys(t, BS, extra_keys=[(1, 2, "cat")]) == a


# ---------------------------------------------------------------------- stability

# Golden values computed once from the canonical encoding. Changing any of them means block
# keys changed: every page already in a shared store (storage keys) becomes unreachable and
# any persisted tree state is invalid. Do not update them without a migration plan.
GOLDEN_TOKENS = list(range(32))
GOLDEN_TREE = [84992927405021722189563368742202849221,
               196568336024627090088244358248128510441]
GOLDEN_STORAGE = ["5d85718ec594b982c252d0279e5966ffca33a5eaf2a455038d3ab331fde70cea",
                  "4681c0107c38f402cd1bc30b0b09a65202dba31f98269d9d7f63f5e0dea6901a"]
GOLDEN_EXTRA = [(10, 8, b"img-0")]
GOLDEN_TREE_EXTRA = [228132779878365262363337103008037690548,
                     264926478208863418703989167227414917431]
GOLDEN_STORAGE_EXTRA = ["fa9b716cabe141d87c4bbde5c8ceaba564d42541b5f4e21896cbdd71a391e124",
                        "5c8c7e4237af26c2156f9857073e76f8814c1dd9b3d10b06fa935157f3ec338b"]


def test_golden_keys() -> None:
    assert chain_keys(GOLDEN_TOKENS, 16) == GOLDEN_TREE
    assert [k.hex() for k in storage_keys(GOLDEN_TOKENS, 16)] == GOLDEN_STORAGE
    assert chain_keys(GOLDEN_TOKENS, 16, extra_keys=GOLDEN_EXTRA) == GOLDEN_TREE_EXTRA
    assert ([k.hex() for k in storage_keys(GOLDEN_TOKENS, 16, extra_keys=GOLDEN_EXTRA)]
            == GOLDEN_STORAGE_EXTRA)


def test_storage_key_is_sha256_of_the_canonical_encoding() -> None:
    """Recomputed from the encoding alone (what another implementation would do): parent
    digest, tokens as little-endian int32, and for blocks with multimodal content the
    marker b"\\x00mm" followed by each item's 2-byte length and hash."""
    t = GOLDEN_TOKENS
    b0 = struct.pack("<16i", *t[:16])
    b1 = struct.pack("<16i", *t[16:])
    k0 = hashlib.sha256(b0).digest()
    k1 = hashlib.sha256(k0 + b1).digest()
    assert storage_keys(t, 16) == [k0, k1]
    item = len(b"img-0").to_bytes(2, "little") + b"img-0"  # tokens 10..17: both blocks
    e0 = hashlib.sha256(b0 + b"\x00mm" + item).digest()
    e1 = hashlib.sha256(e0 + b1 + b"\x00mm" + item).digest()
    assert storage_keys(t, 16, extra_keys=GOLDEN_EXTRA) == [e0, e1]


def test_storage_keys_are_a_different_family() -> None:
    t = toks(3)
    tree = chain_keys(t, BS)
    store = storage_keys(t, BS)
    assert all(isinstance(k, int) and 0 <= k < 2**128 for k in tree)
    assert all(isinstance(k, bytes) and len(k) == 32 for k in store)
    assert {int.from_bytes(k[:16], "little") for k in store}.isdisjoint(tree)
    assert {int.from_bytes(k[:16], "big") for k in store}.isdisjoint(tree)
    assert [int.from_bytes(key_bytes(k), "little") for k in tree] == tree


_CHILD = """
import json, sys
from kvtier.manager.keys import chain_keys, storage_keys
t = list(range(1000, 1000 + 40))
extra = [(3, 9, b"img"), (30, 2, "clip")]
print(json.dumps({
    "hash_of_str": hash("make sure the seed differs"),
    "tree": [str(k) for k in chain_keys(t, 8)],
    "tree_extra": [str(k) for k in chain_keys(t, 8, extra_keys=extra)],
    "storage": [k.hex() for k in storage_keys(t, 8)],
    "storage_extra": [k.hex() for k in storage_keys(t, 8, extra_keys=extra)],
}))
"""


def _child_keys(seed: str) -> dict[str, object]:
    env = dict(os.environ, PYTHONHASHSEED=seed)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_keys_are_stable_across_processes_and_hash_seeds() -> None:
    a = _child_keys("1")
    b = _child_keys("4242")
    assert a["hash_of_str"] != b["hash_of_str"], "PYTHONHASHSEED did not take effect"
    t = list(range(1000, 1040))
    extra = [(3, 9, b"img"), (30, 2, "clip")]
    here = {
        "tree": [str(k) for k in chain_keys(t, 8)],
        "tree_extra": [str(k) for k in chain_keys(t, 8, extra_keys=extra)],
        "storage": [k.hex() for k in storage_keys(t, 8)],
        "storage_extra": [k.hex() for k in storage_keys(t, 8, extra_keys=extra)],
    }
    for name, keys in here.items():
        assert len(keys) == 5
        assert a[name] == b[name] == keys, name


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("bad", [2**31, 2**40, -(2**31) - 1])
def test_token_id_outside_int32_is_a_clear_error(bad: int) -> None:
    t = toks(2)
    t[5] = bad
    for fn in (chain_keys, storage_keys):
        with pytest.raises(TokenKeyError, match=rf"token id {bad}\b.*int32"):
            fn(t, BS)


def test_int32_extremes_are_valid_tokens() -> None:
    t = [0, 2**31 - 1, -(2**31), 7]
    assert len(chain_keys(t, BS)) == 1
    assert len(storage_keys(t, BS)) == 1


@pytest.mark.parametrize(
    ("item", "needle"),
    [
        ((-1, 4, b"h"), "offset must be >= 0"),
        ((0, 0, b"h"), "length > 0"),
        ((2, -3, b"h"), "length > 0"),
        ((0, 4, b""), "content_hash must be non-empty"),
        ((0, 4, ""), "content_hash must be non-empty"),
        ((0, 4, None), "content_hash must be non-empty"),
        ((0, 4), "expected \\(offset, length, content_hash\\)"),
        ("ab", "expected \\(offset, length, content_hash\\)"),
        (42, "expected \\(offset, length, content_hash\\)"),
        ((0.5, 4, b"h"), "offset must be >= 0"),
    ],
)
def test_bad_extra_key_item_is_a_clear_error(item: object, needle: str) -> None:
    t = toks(2)
    for fn in (chain_keys, storage_keys):
        with pytest.raises(TokenKeyError, match=needle) as info:
            fn(t, BS, extra_keys=[(0, 1, b"ok"), item])
        assert "extra_keys item" in str(info.value)


@pytest.mark.parametrize("fields", [(-1, 4, b"h"), (0, 0, b"h"), (0, 4, b"")])
def test_bad_extra_key_instance_is_a_clear_error(fields: tuple[int, int, bytes]) -> None:
    with pytest.raises(TokenKeyError, match="extra_keys item"):
        ExtraKey(*fields)


@pytest.mark.parametrize("bad", [2.5, "5", None])
def test_non_integer_token_id_is_named_in_the_error(bad: object) -> None:
    t = [0, 1, bad, 3]
    with pytest.raises(TokenKeyError, match=rf"token id {bad!r}"):
        chain_keys(t, BS)


def test_negative_int_content_hash_is_a_clear_error() -> None:
    with pytest.raises(TokenKeyError, match="extra_keys item"):
        chain_keys(toks(2), BS, extra_keys=[(0, 4, -5)])


def test_a_content_hash_too_long_for_its_2_byte_length_is_a_clear_error() -> None:
    """Issue 11 item 12: a hash over 65,535 bytes raised OverflowError from the encoding (a
    500 from the admin's /pin); it is a TokenKeyError, for both key families, and 65,535
    bytes still work."""
    tokens = list(range(8))
    for family in (chain_keys, storage_keys):
        for digest in (b"h" * 65536, "h" * 70000):
            with pytest.raises(TokenKeyError, match=r"content_hash is [0-9]+ bytes; at most "
                               r"65535"):
                family(tokens, 4, extra_keys=[(0, 2, digest)])
        assert len(family(tokens, 4, extra_keys=[(0, 2, b"h" * 65535)])) == 2
