"""The node service's wire format (`kvtier.manager.node.wire`): what is encoded decodes to the
same records, and bytes from a hostile peer decode or raise WireError (one line), never
anything else."""

from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier.manager.keyed_events import HOST, STORAGE, TierEvent
from kvtier.manager.node import wire
from support import examples

pytestmark = pytest.mark.fast

_KEYED = [wire.Op.COMPLETE_STORE, wire.Op.COMPLETE_LOAD, wire.Op.TOUCH]


@st.composite
def records(draw: st.DrawFn) -> list[wire.OpRecord]:
    out = []
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from([*_KEYED, wire.Op.COUNT_ASKED, wire.Op.FORGET,
                                   wire.Op.RESET, wire.Op.EVENTS]))
        keys = (draw(st.lists(st.binary(min_size=1, max_size=40), max_size=6))
                if op in _KEYED else [])
        rid = draw(st.text(max_size=10)) if op in (wire.Op.COUNT_ASKED, wire.Op.FORGET) else ""
        out.append(wire.OpRecord(op, keys, rid, draw(st.integers(0, 1)),
                                 draw(st.integers(-5, 1000))))
    last = draw(st.sampled_from([None, wire.Op.LOOKUP, wire.Op.PREPARE_STORE,
                                 wire.Op.PREPARE_LOAD, wire.Op.PENDING]))
    if last is not None:
        keys = [] if last is wire.Op.PENDING else draw(
            st.lists(st.binary(min_size=32, max_size=32), max_size=8))
        extra = bytes(draw(st.lists(st.integers(0, 1), min_size=len(keys),
                                    max_size=len(keys)))) if last is wire.Op.PREPARE_LOAD \
            else b""
        out.append(wire.OpRecord(last, keys, "req" if last is wire.Op.LOOKUP else "",
                                 1 if extra else 0, -1, extra))
    return out


def _body(frame: bytes) -> bytes:
    n = wire.frame_length(frame[:4])
    assert n == len(frame) - 4
    return frame[4:]


# the machine these run on is shared: generation time is not what is tested
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RELAXED
@given(records(), st.integers(0, 2**32 - 1))
def test_ops_round_trip(recs: list[wire.OpRecord], seq: int) -> None:
    ftype, got_seq, body = wire.decode_head(_body(wire.encode_ops(recs, seq)))
    assert ftype is wire.FrameType.OPS and got_seq == seq
    assert wire.decode_ops(body) == recs


@given(st.binary(max_size=300))
@settings(RELAXED, max_examples=examples(500))
def test_hostile_bytes_raise_only_wire_errors(data: bytes) -> None:
    for decode in (wire.decode_ops, wire.decode_reply, wire.decode_hello,
                   wire.decode_welcome, wire.decode_head):
        try:
            decode(data)  # type: ignore[operator]
        except wire.WireError as e:
            assert "\n" not in str(e)


@RELAXED
@given(records(), st.data())
def test_every_truncation_is_refused(recs: list[wire.OpRecord], data: st.DataObject) -> None:
    body = _body(wire.encode_ops(recs, 1))[wire.HEAD_BYTES:]
    cut = data.draw(st.integers(0, max(0, len(body) - 1)))
    if cut == len(body):
        return
    with pytest.raises(wire.WireError):
        wire.decode_ops(body[:cut])


def test_limits_are_named() -> None:
    with pytest.raises(wire.WireError, match="MAX_FRAME"):
        wire.frame_length(struct.pack("<I", wire.MAX_FRAME + 1))
    with pytest.raises(wire.WireError, match="shorter than the 8-byte head"):
        wire.frame_length(struct.pack("<I", 3))
    bad_version = struct.pack("<BBHI", wire.WIRE_VERSION + 1, wire.FrameType.OPS, 0, 0)
    with pytest.raises(wire.WireError, match="wire version"):
        wire.decode_head(bad_version)
    asking_first = wire.encode_ops([wire.OpRecord(wire.Op.PENDING),
                                    wire.OpRecord(wire.Op.TOUCH, [b"k"])], 1)
    with pytest.raises(wire.WireError, match=r"record 0 \(PENDING\): an asking op must be"):
        wire.decode_ops(_body(asking_first)[wire.HEAD_BYTES:])
    with pytest.raises(wire.WireError, match="field 'ranks'"):
        wire.decode_hello(b'{"namespace": "m", "shape": {"num_layers": 1, "num_kv_heads": 1, '
                          b'"head_dim": 1, "dtype": "float16", "num_extra_layers": 0, '
                          b'"kv_scales": "none"}, "block_size": 4, "hash_algo": "x", '
                          b'"hash_seed": "0", "ranks": 0, "pid": 1}')


def test_reply_round_trip() -> None:
    r = wire.Reply(wire.Op.PREPARE_LOAD, True, 7, True, 3, [1, 2, 1 << 40], b"\x01\x00\x01",
                   "why")
    ftype, seq, body = wire.decode_head(_body(wire.encode_reply(r, 9)))
    assert ftype is wire.FrameType.REPLY and seq == 9 and wire.decode_reply(body) == r


@st.composite
def tier_events(draw: st.DrawFn) -> list[TierEvent]:
    return [TierEvent(draw(st.sampled_from([HOST, STORAGE])), draw(st.booleans()),
                      tuple(draw(st.lists(st.binary(min_size=1, max_size=40), min_size=1,
                                          max_size=5))))
            for _ in range(draw(st.integers(0, 4)))]


@RELAXED
@given(tier_events(), st.booleans(), st.sampled_from(list(wire.ASKING)))
def test_reply_events_round_trip(events: list[TierEvent], resync: bool, op: wire.Op) -> None:
    r = wire.Reply(op, True, 3, False, 0, [5], b"\x01", "", resync, events)
    ftype, _, body = wire.decode_head(_body(wire.encode_reply(r, 4)))
    assert ftype is wire.FrameType.REPLY and wire.decode_reply(body) == r
    cut = len(body) - 1
    if events:  # the last event's last key byte missing
        with pytest.raises(wire.WireError, match="truncated keys"):
            wire.decode_reply(body[:cut])


def _reply_with_event(tier: int = 1, removed: int = 0, width: int = 2, n: int = 1,
                      flags: int = 0, keys: bytes = b"ab") -> bytes:
    head = struct.pack("<BBBBQIIII", wire.Op.PENDING, 1, 0, flags, 0, 0, 0, 0, 1)
    return head + struct.pack("<BBHI", tier, removed, width, n) + keys


@pytest.mark.parametrize(("kw", "needle"), [
    ({"tier": 3}, r"event 0: field tier = 3"),
    ({"removed": 2}, r"event 0: field removed = 2"),
    ({"n": 0, "keys": b""}, r"event 0: field n_keys = 0"),
    ({"width": 2000}, r"event 0: field key_width = 2000"),
    ({"n": 5}, r"event 0: truncated keys"),
    ({"flags": 2}, r"field event_flags = 2"),
])
def test_bad_reply_events_name_the_field(kw: dict[str, int], needle: str) -> None:
    with pytest.raises(wire.WireError, match=needle) as e:
        wire.decode_reply(_reply_with_event(**kw))  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_events_op_takes_on_or_off_only() -> None:
    ok = wire.encode_ops([wire.OpRecord(wire.Op.EVENTS, flag=1)], 1)
    assert wire.decode_ops(_body(ok)[wire.HEAD_BYTES:]) == [wire.OpRecord(wire.Op.EVENTS,
                                                                          flag=1)]
    bad = wire.encode_ops([wire.OpRecord(wire.Op.EVENTS, flag=2)], 1)
    with pytest.raises(wire.WireError, match=r"record 0 \(EVENTS\): field flag = 2"):
        wire.decode_ops(_body(bad)[wire.HEAD_BYTES:])
    keyed = wire.encode_ops([wire.OpRecord(wire.Op.EVENTS, [b"k"], flag=1)], 1)
    with pytest.raises(wire.WireError, match=r"\(EVENTS\): field n_keys = 1"):
        wire.decode_ops(_body(keyed)[wire.HEAD_BYTES:])


def test_hello_carries_the_hash_block_size_and_an_older_one_reads_as_not_said() -> None:
    h = wire.Hello("m", {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float16",
                         "num_extra_layers": 0, "kv_scales": "none"}, 16, "sha256", "0", 1, 7,
                   hash_block_size=4)
    ftype, _, body = wire.decode_head(_body(wire.encode_hello(h)))
    assert ftype is wire.FrameType.HELLO and wire.decode_hello(body) == h
    older = body.replace(b', "hash_block_size": 4', b"")
    assert b"hash_block_size" not in older
    assert wire.decode_hello(older).hash_block_size == 0  # the namespace takes block_size
    with pytest.raises(wire.WireError, match="field 'hash_block_size'"):
        wire.decode_hello(body.replace(b'"hash_block_size": 4', b'"hash_block_size": -1'))
    # the KV cache groups: 1 when not said, several carried, 0 refused
    assert wire.decode_hello(body.replace(b', "kv_groups": 1', b"")).kv_groups == 1
    hybrid = wire.encode_hello(dataclasses.replace(h, kv_groups=3))
    assert wire.decode_hello(wire.decode_head(_body(hybrid))[2]).kv_groups == 3
    with pytest.raises(wire.WireError, match="field 'kv_groups'"):
        wire.decode_hello(body.replace(b'"kv_groups": 1', b'"kv_groups": 0'))
