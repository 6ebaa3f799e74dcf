"""The node service against clients that try to stall it or lock others out (issue 34, 2-5):
a real `kvtier serve` child, raw sockets speaking the wire, and stand-in engines.

What is checked: a HELLO nested too deep is one ERROR frame (no RecursionError traceback);
a HELLO or a frame trickled a byte at a time is dropped at its deadline (deadlines, not idle
timeouts); connections that never say HELLO neither count against node.max_engines nor keep a
real engine out, however many; a frame over MAX_FRAME_KEYS is refused at once, and a frame at
the cap keeps another engine's lookups within milliseconds; an engine reattaching to a
started namespace never waits for another namespace's stack to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtier.manager.node import wire
from kvtier.manager.node.namespaces import namespace_deployment_id
from kvtier.worker.spec import host_segment_name
from node_engine import hello, key
from support import kvtier_script, wait_until
from test_node_service import NS_A, NS_B, Node, _raw, _read_error, load_once_stored

pytestmark = pytest.mark.fast

FAST_DEADLINES = "hello_deadline_s = 1.0\nframe_deadline_s = 1.0\n"


def _recv_frame(s: socket.socket, timeout: float = 10.0) -> tuple[wire.FrameType, bytes]:
    """One frame from the service (every read bounded)."""
    s.settimeout(timeout)
    buf = b""
    while len(buf) < 4:
        chunk = s.recv(4 - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    n = struct.unpack("<I", buf)[0]
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    ftype, _, rest = wire.decode_head(body)
    return ftype, rest


def _attached(sock_path: Path, namespace: str = NS_A) -> socket.socket:
    s = _raw(sock_path)
    s.sendall(wire.encode_hello(hello(namespace)))
    ftype, body = _recv_frame(s)
    assert ftype is wire.FrameType.WELCOME, body
    return s


def _ask(s: socket.socket, record: wire.OpRecord, seq: int = 1) -> wire.Reply:
    s.sendall(wire.encode_ops([record], seq))
    ftype, body = _recv_frame(s, 30.0)
    assert ftype is wire.FrameType.REPLY, body
    return wire.decode_reply(body)


def _closed_within(s: socket.socket, limit: float) -> float:
    """Seconds until the service closes `s` (its ERROR frame read and dropped)."""
    t0 = time.monotonic()
    s.settimeout(limit)
    with contextlib.suppress(OSError):
        while s.recv(65536):
            pass
    return time.monotonic() - t0


@pytest.fixture
def fast_node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path, node_toml=FAST_DEADLINES + "max_engines = 4\nmax_connecting = 16\n")
    try:
        yield n.start()
    finally:
        n.close()


# ------------------------------------------------------------------------------ 3: HELLO JSON


def test_a_hello_nested_too_deep_is_one_error_frame(fast_node: Node) -> None:
    """Issue 34, 3: a HELLO of 2,000 nested arrays (4 KB) raised RecursionError in the
    service: a traceback in its log and no ERROR frame."""
    deep = b"[" * 2000 + b"]" * 2000
    s = _raw(fast_node.sock)
    s.sendall(wire._frame(wire.FrameType.HELLO, 0, deep))
    err = _read_error(s)
    s.close()
    assert err == "HELLO: JSON nested 2000 deep, at most 8", err
    # inside an object, and brackets in strings do not count
    s = _raw(fast_node.sock)
    body = json.dumps({"namespace": "[[[[[[[[[[", "shape": [[[[[[[[[[1]]]]]]]]]]}).encode()
    s.sendall(wire._frame(wire.FrameType.HELLO, 0, body))
    assert _read_error(s) == "HELLO: JSON nested 11 deep, at most 8"
    s.close()
    # a HELLO announced bigger than MAX_HELLO is refused before its body is read
    s = _raw(fast_node.sock)
    s.sendall(struct.pack("<I", wire.HEAD_BYTES + wire.MAX_HELLO + 1))
    assert "a HELLO has at most" in _read_error(s)
    s.close()
    log = wait_until(lambda: fast_node.log() if fast_node.log().count("sent a bad frame") >= 3
                     else None, 10, "the refusals logged")
    assert "Traceback" not in log and "RecursionError" not in log
    assert wire.json_depth(b'{"a": "\\"[[[", "b": [{}]}') == 3
    s = _attached(fast_node.sock)  # and the service goes on
    s.close()


# ------------------------------------------------------------------------------ 4: deadlines


def test_a_trickled_hello_or_frame_is_dropped_at_its_deadline(fast_node: Node) -> None:
    """Issue 34, 4: one byte every 3 s kept a connection open for ever (the HELLO and frame
    timeouts restarted on every byte). Now the whole HELLO is due within hello_deadline_s of
    the accept and a whole frame within frame_deadline_s of its first byte (1 s here)."""
    dropped_at = _trickle(_raw(fast_node.sock), wire.encode_hello(hello(NS_A)))
    assert dropped_at is not None and dropped_at < 2.5, dropped_at
    wait_until(lambda: "HELLO: not complete within 1 s" in fast_node.log(), 10, "logged")
    # after HELLO: an engine may idle as long as it likes, but a frame begun is due whole
    s = _attached(fast_node.sock)
    time.sleep(1.5)  # idle, longer than the deadline: still attached
    assert _ask(s, wire.OpRecord(wire.Op.PENDING)).ok
    took = _trickle(s, wire.encode_ops([wire.OpRecord(wire.Op.PENDING)], 2))
    assert took is not None and took < 2.5, took
    wait_until(lambda: "frame: not complete within 1 s" in fast_node.log(), 10, "logged")


def _trickle(s: socket.socket, data: bytes, every: float = 0.25,
             limit: float = 10.0) -> float | None:
    """Send `data` one byte every `every` s; the seconds until the service dropped the
    connection (its ERROR frame came, or it closed), None if it had not within `limit`."""
    t0 = time.monotonic()
    try:
        for b in data:
            if select.select([s], [], [], 0)[0]:
                return time.monotonic() - t0
            try:
                s.sendall(bytes([b]))
            except OSError:
                return time.monotonic() - t0
            if time.monotonic() - t0 > limit:
                return None
            time.sleep(every)
        return None
    finally:
        s.close()


def test_silent_connections_never_lock_an_engine_out(fast_node: Node) -> None:
    """Issue 34, 4: connections that never said HELLO counted against node.max_engines, so
    64 of them locked every real engine out for as long as the client liked; 200 half-sent
    headers filled the listen backlog. Here max_engines = 4 and max_connecting = 16: 300
    connections that send half a length prefix and stop, then a real engine attaches at
    once and works; the silent ones are dropped (the oldest first, the rest at their
    deadline)."""
    t0 = time.monotonic()
    _attached(fast_node.sock).close()  # the namespace's stack started (seconds)
    quiet_s = time.monotonic() - t0
    silent = []
    try:
        for _ in range(300):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.settimeout(5)
            c.connect(str(fast_node.sock))
            c.sendall(b"\x10\x00")
            silent.append(c)
        t0 = time.monotonic()
        _attached(fast_node.sock).close()  # connect, HELLO, WELCOME
        attach_s = time.monotonic() - t0
        e = fast_node.engine()
        assert e.first["attached"], e.first
        assert e.call(op="store", keys=list(range(4)))["stored"] == 4
        got = e.call(op="load", keys=list(range(4)))
        assert got["hits"] == 4 and got["identical"] is True
        # max_engines counts engines, not connections: three more attach
        more = [_attached(fast_node.sock) for _ in range(3)]
        wait_until(lambda: len(fast_node.status()["node"]["engines"]) == 4, 10, "4 attached")
        s = _raw(fast_node.sock)  # a fifth is refused, by name
        s.sendall(wire.encode_hello(hello(NS_A)))
        assert "node.max_engines = 4" in _read_error(s)
        s.close()
        for m in more:
            m.close()
        e.close()
        print(f"attached in {attach_s:.3f} s behind 300 silent connections (the first "
              f"attach, starting the namespace: {quiet_s:.3f} s)")
        # 0.17-0.20 s on a quiet machine; the bound leaves room for a loaded CI box (two
        # xdist workers on 2 cores: one run took over 1 s). The defect itself shows as a
        # refusal ("node.max_engines"), not as slowness, so the bound need not be tight.
        assert attach_s < 3.0, attach_s
        st = fast_node.status()["node"]
        assert len(st["engines"]) <= 4
    finally:
        for c in silent:
            c.close()


# ------------------------------------------------------------------------------ 2: frame size


def _lookup_latencies(sock_path: Path, stop: threading.Event, out: list[float]) -> None:
    s = _attached(sock_path)
    try:
        seq = 1
        while not stop.is_set():
            seq += 1
            t0 = time.perf_counter()
            _ask(s, wire.OpRecord(wire.Op.LOOKUP, [key(1)]), seq)
            out.append(time.perf_counter() - t0)
            time.sleep(0.002)
    finally:
        s.close()


def test_a_frame_over_the_key_cap_is_refused_at_once_and_others_go_on(
        fast_node: Node) -> None:
    """Issue 34, 2: one 8 MiB PREPARE_STORE frame (2.8 M keys) took 8.6 s to refuse while
    holding the namespace; another engine's lookup waited 7.4 s. A frame over MAX_FRAME_KEYS
    is refused by its record head (no key built), and a frame at the cap is worked in slices,
    so another engine's lookups stay short meanwhile."""
    stop = threading.Event()
    lat: list[float] = []
    t = threading.Thread(target=_lookup_latencies, args=(fast_node.sock, stop, lat))
    t.start()
    try:
        wait_until(lambda: len(lat) > 20, 30, "the other engine's lookups")
        # 8 MiB of one-byte keys (2 length bytes each): ~2.8 M keys, as in the issue
        n = (wire.MAX_FRAME - 64) // 3
        head = struct.pack("<I", 1) + struct.pack("<BBHiIHxxI", wire.Op.PREPARE_STORE, 0, 0,
                                                  0, n, 0, 0)
        body = head + b"\x01\x00" * n + b"k" * n
        big = wire._frame(wire.FrameType.OPS, 7, body)
        s = _attached(fast_node.sock)
        base = len(lat)
        t0 = time.monotonic()
        s.sendall(big)
        err = _read_error(s)
        refused_s = time.monotonic() - t0
        s.close()
        assert f"at most {wire.MAX_FRAME_KEYS} (MAX_FRAME_KEYS)" in err, err
        during_big = lat[base:]
        # a frame at the cap: 65,536 new blocks prepared in slices (after a first store: the
        # first of a namespace builds its free list, 0.3 s for 2 M blocks, once)
        s = _attached(fast_node.sock)
        assert _ask(s, wire.OpRecord(wire.Op.PREPARE_STORE, [key(9_999)]), 2).ok
        keys = [key(10_000 + i) for i in range(wire.MAX_FRAME_KEYS)]
        base = len(lat)
        t0 = time.monotonic()
        r = _ask(s, wire.OpRecord(wire.Op.PREPARE_STORE, keys), 3)
        at_cap_s = time.monotonic() - t0
        time.sleep(0.05)
        during_cap = lat[base:]
        assert r.ok and sum(r.flags) == wire.MAX_FRAME_KEYS, (r.ok, r.error)
        s.close()  # its open stores abandoned
    finally:
        stop.set()
        t.join(30)
    worst_big = max(during_big, default=0.0)
    worst_cap = max(during_cap, default=0.0)
    median_cap = sorted(during_cap)[len(during_cap) // 2] if during_cap else 0.0
    print(f"over the cap: refused in {refused_s:.3f} s, other lookups at most "
          f"{worst_big * 1000:.1f} ms; at the cap: prepared in {at_cap_s:.3f} s, "
          f"{len(during_cap)} other lookups, median {median_cap * 1000:.1f} ms, at most "
          f"{worst_cap * 1000:.1f} ms")
    assert refused_s < 2.0, refused_s
    # not one hold of the whole frame (0.4-0.9 s on a loaded 2-core box): slices, and no
    # other lookup waits for half the frame's work (a GC pause or a busy box at worst)
    assert len(during_cap) >= 5 and worst_big < 0.4 and worst_cap < min(0.4, at_cap_s / 2), (
        len(during_cap), worst_big, worst_cap, at_cap_s)
    assert "Traceback" not in fast_node.log()


# ------------------------------------------------------------------------------ 5: attach lock


def test_a_reattach_never_waits_for_another_namespaces_start(fast_node: Node) -> None:
    """Issue 34, 5: `Namespaces.attach` held its lock through `Stack.start()` of a new
    namespace (worker processes, host pools: seconds), so a reattach to a namespace already
    started waited 3.3 and 4.3 s."""
    _attached(fast_node.sock, NS_A).close()  # A started
    new = _raw(fast_node.sock)
    t0 = time.monotonic()
    new.sendall(wire.encode_hello(hello(NS_B)))  # B's stack starts now
    time.sleep(0.05)
    again = _raw(fast_node.sock)
    t1 = time.monotonic()
    again.sendall(wire.encode_hello(hello(NS_A)))
    ftype, _ = _recv_frame(again, 30)
    reattach_s = time.monotonic() - t1
    ftype_b, _ = _recv_frame(new, 60)
    start_b_s = time.monotonic() - t0
    again.close()
    new.close()
    assert ftype is wire.FrameType.WELCOME and ftype_b is wire.FrameType.WELCOME
    print(f"reattach to A: {reattach_s:.3f} s while B's stack started in {start_b_s:.3f} s")
    assert reattach_s < 0.5 and reattach_s < start_b_s / 2, (reattach_s, start_b_s)


# ------------------------------------------------------------------------------ 7: node only


def _shm_bytes(deployment_id: str) -> dict[str, int]:
    prefix = f"kvtier_{deployment_id}_"
    return {n: os.stat(f"/dev/shm/{n}").st_size for n in os.listdir("/dev/shm")
            if n.startswith(prefix)}


def test_a_node_only_serve_allocates_nothing_it_does_not_use(tmp_path: Path) -> None:
    """Issue 34, 7: `kvtier serve` with only a `[node]` section built its own scheduler-API
    stack on default pools (4.1 GiB in /dev/shm that attached engines never use). Now it
    runs the node service alone: /dev/shm holds only the namespaces engines attach."""
    n = Node(tmp_path)
    n.toml.write_text(f'deployment_id = "{n.did}"\n[admin]\nhost = "127.0.0.1"\nport = 0\n'
                      f'[node]\nsocket = "{n.sock}"\nabandon_grace_s = 0.5\n')
    try:
        n.start()
        assert "node service only" in n.log(), _shm_bytes(n.did)
        assert _shm_bytes(n.did) == {}, _shm_bytes(n.did)
        assert n.serve is not None
        with n.serve.client() as http:
            assert http.get("/readyz").status_code == 200
            assert http.get("/healthz").status_code == 200
        st = n.status()
        assert st["node_only"] is True and st["node"]["engines"] == []
        out = subprocess.run([str(kvtier_script()), "status", "--url", n.serve.url],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        e = n.engine()
        assert e.call(op="store", keys=list(range(4)))["stored"] == 4
        got = e.call(op="load", keys=list(range(4)))
        assert got["hits"] == 4 and got["identical"] is True
        assert _shm_bytes(n.did) == {}  # the namespace's segments only, under its own id
        assert _shm_bytes(namespace_deployment_id(n.did, NS_A))
        with n.serve.client(n.serve.token()) as http:
            r = http.post("/reset")
        assert r.status_code == 200 and NS_A in r.json()["namespaces"], r.text
        assert e.call(op="load", keys=list(range(4)))["hits"] == 0
    finally:
        n.close()


# ------------------------------------------------------------------------------ 6: allowed_gid


def test_an_engine_of_the_allowed_group_uses_its_pools(tmp_path: Path) -> None:
    """Issue 34, 6: with node.allowed_gid an engine of that group attached, then could not
    open its namespace's host pool (always created 0600): every store and load failed. The
    pools of a service with allowed_gid are group-accessible (0660, that group), and still
    closed to everyone else."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        pytest.skip("needs root and setpriv to run an engine as another user")
    n = Node(tmp_path, node_toml="allowed_gid = 65534\n")
    try:
        n.start()
        os.chmod(n.dir, 0o755)  # the test's temp folder; the service's own is 0710 + group
        a = n.engine()
        assert a.call(op="store", keys=list(range(4)))["stored"] == 4
        g = n.engine(user=[setpriv, "--reuid", "65534", "--regid", "65534",
                           "--clear-groups"])
        assert g.first["attached"], g.first
        got = g.call(op="load", keys=list(range(4)))
        assert got["hits"] == 4 and got["identical"] is True, got
        assert g.call(op="store", keys=list(range(10, 14)))["stored"] == 4
        got = load_once_stored(a, list(range(10, 14)))
        assert got["hits"] == 4 and got["identical"] is True, got
        seg = "/dev/shm" + host_segment_name(namespace_deployment_id(n.did, NS_A), 0)
        st = os.stat(seg)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == 65534, oct(st.st_mode)
        # anyone else (another uid, another group) still cannot open it
        code = "import os, sys; os.open(sys.argv[1], os.O_RDONLY)"
        other = subprocess.run([setpriv, "--reuid", "65533", "--regid", "65533",
                                "--clear-groups", sys.executable, "-c", code, seg],
                               capture_output=True, text=True, timeout=30)
        assert other.returncode != 0 and "PermissionError" in other.stderr, other.stderr
    finally:
        n.close()


def test_the_client_never_sends_a_frame_over_the_key_cap() -> None:
    """The engine side of MAX_FRAME_KEYS: queued one-way records are cut into frames under
    the cap (a record bigger than it into several of its op); an asking op over it is the
    caller's to shorten (`NodeClient` truncates a lookup's following blocks, plans a store's
    leading blocks, refuses such a load)."""
    cap = wire.MAX_FRAME_KEYS
    keys = [key(i) for i in range(cap + 10)]
    batches = wire.frame_batches([
        wire.OpRecord(wire.Op.COMPLETE_STORE, keys, flag=1),
        wire.OpRecord(wire.Op.TOUCH, keys[:20]),
        wire.OpRecord(wire.Op.LOOKUP, keys[:cap - 5], "r"),
    ])
    assert [sum(len(r.keys) for r in b) for b in batches] == [cap, 30, cap - 5]
    assert [[r.op for r in b] for b in batches] == [
        [wire.Op.COMPLETE_STORE], [wire.Op.COMPLETE_STORE, wire.Op.TOUCH], [wire.Op.LOOKUP]]
    for b in batches:  # every frame decodes on the service's side
        assert len(wire.decode_ops(wire.encode_ops(b, 1)[4 + wire.HEAD_BYTES:])) == len(b)
    with pytest.raises(wire.WireError, match="MAX_FRAME_KEYS"):
        wire.frame_batches([wire.OpRecord(wire.Op.PREPARE_STORE, keys)])
