"""The node service end to end: `kvtier serve` in a child process, engines in child processes
(`node_engine.py`, a NodeClient over the real socket and the real host pool), hostile peers on
raw sockets.

What is checked: engines of one namespace share blocks byte for byte through the host pool;
namespaces never see each other's blocks and are held to their quota; an engine killed mid-store
leaves nothing half-written servable and nothing else disturbed; a killed service makes every
call answer within the client's bound, and the client reattaches to the new service and never
uses the old pool; another uid, bad frames and a client that never reads are refused or dropped
with one log line while the other engines go on; `cache.host_eviction_policy` reaches a
namespace's host tier.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier.manager.node import wire
from kvtier.manager.node.namespaces import namespace_deployment_id
from node_engine import SHAPE, hello
from serve_support import ServeProcess, tiny_toml
from support import kvtier_script, new_deployment_id, promtool, remove_leftovers, wait_until

pytestmark = pytest.mark.fast

ENGINE = Path(__file__).with_name("node_engine.py")
PAGE = 2 * 2 * 2 * 8 * 4 * 2  # layers x K,V x heads x head_dim x block x float16 = 512
NS_A, NS_B = "model-a", "model-b"


class EngineProc:
    """One `node_engine.py` child: commands in, JSON lines out (every read bounded)."""

    def __init__(self, sock: Path, namespace: str, shape: dict[str, Any] | None = None,
                 user: list[str] | None = None, hash_block_size: int = 0,
                 kv_groups: int = 1) -> None:
        argv = [sys.executable, str(ENGINE), str(sock), namespace]
        if shape is not None:
            argv.append(json.dumps(shape))
        env = dict(os.environ, PYTHONPATH=str(ENGINE.parent),
                   NODE_ENGINE_HASH_BLOCK_SIZE=str(hash_block_size),
                   NODE_ENGINE_KV_GROUPS=str(kv_groups))
        self.proc = subprocess.Popen([*(user or []), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     text=True)
        self.first = self._line(60.0)

    def _line(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"engine {self.proc.pid}: no answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"engine {self.proc.pid} exited: {err[-2000:]}")
        out: dict[str, Any] = json.loads(line)
        return out

    def call(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._line(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()


class Node:
    """A `kvtier serve` child with its node socket in a short private folder."""

    def __init__(self, tmp: Path, *, node_toml: str = "", storage: str = "none",
                 abandon_grace_s: float = 0.5) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvn", dir="/tmp"))
        self.sock = self.dir / "s" / "node.sock"
        self.did = new_deployment_id("nd")
        self.toml = tiny_toml(tmp / "kvtier.toml", self.did, storage=storage,
                              extra=f'[node]\nsocket = "{self.sock}"\n'
                              f"abandon_grace_s = {abandon_grace_s}\n" + node_toml)
        self.tmp = tmp
        self.serve: ServeProcess | None = None
        self.engines: list[EngineProc] = []
        self.logs = 0

    def start(self, *extra: str) -> Node:
        self.logs += 1
        self.serve = ServeProcess([str(kvtier_script())],
                                  ["serve", "--config", str(self.toml), *extra],
                                  deployment_id=self.did,
                                  log_path=self.tmp / f"serve{self.logs}.log").start()
        return self

    def engine(self, namespace: str = NS_A, **kw: Any) -> EngineProc:
        e = EngineProc(self.sock, namespace, **kw)
        self.engines.append(e)
        assert self.serve is not None
        self.serve.remember_children()  # the namespace's workers, to kill on failure
        return e

    def log(self) -> str:
        return self.serve.log() if self.serve else ""

    def status(self) -> dict[str, Any]:
        assert self.serve is not None
        with self.serve.client() as c:
            out: dict[str, Any] = c.get("/status").json()
            return out

    def close(self) -> None:
        for e in self.engines:
            e.close()
        if self.serve is not None:
            self.serve.close()
        for ns in (NS_A, NS_B):
            remove_leftovers(namespace_deployment_id(self.did, ns))
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    try:
        yield n.start()
    finally:
        n.close()


def load_once_stored(engine: Any, keys: list[int]) -> dict[str, Any]:
    """`engine` loads `keys` once the store another engine just made is visible: completions
    are one-way ops on the storing engine's own connection (they ride with its next question
    or its `end_step`), so a load on another connection may be served first and see PENDING
    for a moment (seen in CI at load 10). Bounded, like every wait here."""
    got: dict[str, Any] = {}

    def ready() -> bool:
        got.update(engine.call(op="load", keys=keys))
        return "pending" not in got["codes"]

    wait_until(ready, 10, "the other engine's completed store visible")
    return got


def test_engines_of_a_namespace_share_blocks_through_the_host_pool(node: Node) -> None:
    a = node.engine()
    b = node.engine()
    assert a.first["attached"] and b.first["attached"], (a.first, b.first)
    assert a.call(op="store", keys=list(range(8)))["stored"] == 8
    got = load_once_stored(b, list(range(8)))
    assert got["hits"] == 8 and got["identical"] is True, got
    # negative control: blocks nobody stored miss, in either engine
    assert b.call(op="load", keys=[100, 101])["codes"] == ["miss"]
    # an engine started after the first one left hits at once (the blocks outlive engines)
    a.close()
    c = node.engine()
    got = c.call(op="load", keys=list(range(8)))
    assert got["hits"] == 8 and got["identical"] is True, got
    st = node.status()["node"]
    pids = {e["pid"] for e in st["engines"]}
    assert pids == {b.proc.pid, c.proc.pid}, st
    ns = {n["namespace"]: n for n in st["namespaces"]}[NS_A]
    assert ns["engines"] == 2 and ns["blocks"]["stored"] == 8
    assert ns["blocks"]["loaded_host"] == 16
    rows = {e["pid"]: e for e in st["engines"]}
    assert rows[c.proc.pid]["hit_host_blocks"] == 8 and rows[b.proc.pid]["lookups"] >= 2
    # kvtier status prints them
    out = subprocess.run([str(kvtier_script()), "status", "--url", node.serve.url],  # type: ignore[union-attr]
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert str(c.proc.pid) in out.stdout and "attached engines" in out.stdout, out.stdout
    # /metrics, per namespace
    with node.serve.client() as http:  # type: ignore[union-attr]
        text = http.get("/metrics").text
    assert f'kvtier_node_namespace_engines{{namespace="{NS_A}"}} 2.0' in text
    assert f'kvtier_node_engine_blocks_total{{kind="stored",namespace="{NS_A}"}} 8.0' in text
    lint = promtool("check", "metrics", input=text)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    # POST /reset empties what every engine sees
    with node.serve.client(node.serve.token()) as http:  # type: ignore[union-attr]
        r = http.post("/reset")
    assert r.status_code == 200 and NS_A in r.json()["namespaces"], r.text
    assert b.call(op="load", keys=list(range(8)))["hits"] == 0


def test_namespaces_are_isolated_and_held_to_their_quota(tmp_path: Path) -> None:
    quota = 16 * PAGE
    n = Node(tmp_path, node_toml=f'quotas = {{"{NS_B}" = {quota}}}\n')
    try:
        n.start()
        a = n.engine(NS_A)
        # B's engine hashes blocks of 2 tokens (HELLO's hash_block_size; vLLM's can be finer
        # than the block in a hybrid model): token ids cannot name B's blocks (issue 36)
        b = n.engine(NS_B, hash_block_size=2)
        assert n.serve is not None
        with n.serve.client(n.serve.token()) as http:
            body = {"token_ids": list(range(16)), "cache_salt": "s"}
            r = http.post("/lookup", json={"namespace": NS_B, **body})
            assert r.status_code == 422 and r.json()["detail"] == (
                f"namespace '{NS_B}': its engine hashes blocks of 2 tokens, kvtier's blocks "
                "are 4: token ids cannot name them"), r.text
            assert http.post("/lookup", json={"namespace": NS_A, **body}).status_code == 200
            # two namespaces served: a request must name one (one line, 422)
            r = http.post("/lookup", json=body)
            assert r.status_code == 422 and r.json()["detail"].startswith(
                "give a namespace: 2 are served here"), r.text
        assert a.call(op="store", keys=list(range(8)))["stored"] == 8
        assert b.call(op="load", keys=list(range(8)))["hits"] == 0  # not B's namespace
        assert a.call(op="load", keys=list(range(8)))["hits"] == 8
        # B's quota: 16 blocks. 17 at once cannot fit; 24 one batch of 8 at a time evict
        # B's own oldest, never A's
        assert b.call(op="store", keys=list(range(100, 117)))["stored"] is None
        for start in (100, 108, 116):
            assert b.call(op="store", keys=list(range(start, start + 8)))["stored"] == 8
        assert b.call(op="load", keys=list(range(100, 108)))["hits"] == 0  # evicted
        assert b.call(op="load", keys=list(range(116, 124)))["hits"] == 8
        assert a.call(op="load", keys=list(range(8)))["hits"] == 8  # A untouched
        # an engine of A's namespace says it keeps 3 KV cache groups (a hybrid model keys
        # each block per group): token ids name none of A's blocks now, refused in one line
        n.engine(NS_A, kv_groups=3)
        with n.serve.client(n.serve.token()) as http:
            r = http.post("/lookup", json={"namespace": NS_A, **body})
            assert r.status_code == 422 and r.json()["detail"] == (
                f"namespace '{NS_A}': its engine keeps 3 KV cache groups (a hybrid model), "
                "each keyed per group: token ids cannot name its blocks"), r.text
        spaces = {s["namespace"]: s for s in n.status()["node"]["namespaces"]}
        assert spaces[NS_B]["quota_bytes"] == quota
        assert spaces[NS_B]["used_bytes"] <= quota and spaces[NS_B]["host_blocks"] == 16
        # a geometry unlike the namespace's is refused with one line
        other = dict(SHAPE, num_layers=4)
        c = n.engine(NS_A, shape=other)
        assert not c.first["attached"] and "another geometry" in c.first["error"], c.first
        assert "num_layers" not in c.first["error"] or "shape" in c.first["error"]
    finally:
        n.close()


def test_an_engine_killed_mid_store_leaves_nothing_half_written(node: Node) -> None:
    b = node.engine()
    assert b.call(op="store", keys=list(range(50, 54)))["stored"] == 4
    a = node.engine()
    held = a.call(op="store", keys=list(range(8)), hang_after=3)
    assert held == {"prepared": 8, "written": 3, "seconds": held["seconds"]}
    assert b.call(op="load", keys=list(range(8)))["codes"] == ["pending"]
    a.kill()
    wait_until(lambda: "open store(s) abandoned" in node.log(), 10, "the dead engine's end")
    assert "8 open store(s) abandoned" in node.log()
    # never served: pending during the grace, then gone; B's own blocks untouched
    wait_until(lambda: b.call(op="load", keys=[0])["codes"] == ["miss"], 10,
               "the abandoned blocks freed after the grace")
    got = b.call(op="load", keys=list(range(50, 54)))
    assert got["hits"] == 4 and got["identical"] is True
    # a new engine stores them again and they are served, byte for byte
    a2 = node.engine()
    assert a2.call(op="store", keys=list(range(8)))["stored"] == 8
    got = load_once_stored(b, list(range(8)))
    assert got["hits"] == 8 and got["identical"] is True, got


def test_a_killed_service_answers_misses_in_bound_and_a_new_one_is_reattached(
        node: Node) -> None:
    a = node.engine()
    assert a.call(op="store", keys=list(range(8)))["stored"] == 8
    before = a.call(op="status")
    assert node.serve is not None
    node.serve.proc.kill()  # type: ignore[union-attr]
    node.serve.proc.wait(10)  # type: ignore[union-attr]
    node.serve.close()
    got = a.call(op="load", keys=list(range(8)), timeout=10)
    assert got["hits"] == 0 and got["seconds"] < 1.5, got  # call_timeout_s = 1 s
    again = a.call(op="load", keys=list(range(8)), timeout=10)
    assert again["seconds"] < 0.05, again  # DOWN: answered at once
    st = a.call(op="status")
    assert not st["connected"] and st["inodes"] is None
    assert a.call(op="store", keys=[9])["stored"] is None
    node.start()
    wait_until(lambda: a.call(op="status")["connected"], 30, "the engine reattached")
    after = a.call(op="status")
    assert after["nonce"] != before["nonce"] and after["generation"] > before["generation"]
    assert a.call(op="load", keys=list(range(8)))["hits"] == 0  # a new host tier
    assert a.call(op="store", keys=list(range(8)))["stored"] == 8
    got = load_once_stored(node.engine(), list(range(8)))
    assert got["hits"] == 8 and got["identical"] is True


def kill_and_restart(node: Node, engine: Any) -> None:
    """SIGKILL the service, start a new one, and wait (bounded) until `engine` reattached."""
    assert node.serve is not None
    node.serve.proc.kill()  # type: ignore[union-attr]
    node.serve.proc.wait(10)  # type: ignore[union-attr]
    node.serve.close()
    node.start()
    wait_until(lambda: engine.call(op="status")["connected"], 30, "the engine reattached")


def test_a_store_planned_before_a_reattach_never_completes_a_plan_made_after_it(
        node: Node) -> None:
    """An engine's store in flight across a service restart: its completion names hashes
    only, so arriving after the reattach it must not complete a new plan of the same hashes,
    whose pages nobody wrote. The client leaves such hashes out of new plans until the old
    completion comes, and drops that completion; the blocks are then planned and stored anew."""
    a = node.engine()
    keys = list(range(40, 44))
    assert a.call(op="store", keys=keys, hold=True)["written"] == 4  # planned, written, open
    kill_and_restart(node, a)
    # a new plan of the same blocks, never written (an engine still copying, or one that died)
    got = a.call(op="store", keys=keys, hang_after=0)
    assert got.get("prepared", 0) == 0, got  # not planned while the old store is open
    assert a.call(op="complete", ok=True)["completed"] == 4  # the late completion: dropped
    served = node.engine().call(op="load", keys=keys)
    assert served["hits"] == 0, served  # nothing of it is servable: no page was written
    assert a.call(op="store", keys=keys)["stored"] == 4  # planned again once it completed
    again = node.engine().call(op="load", keys=keys)
    assert again["hits"] == 4 and again["identical"] is True, again


def test_a_load_open_across_a_reattach_never_unpins_a_load_made_after_it(node: Node) -> None:
    """The same for loads: a completion names the hash, so one of a load planned before the
    reattach, arriving after it, would end the new session's load of that hash while its copy
    still reads the page (evictable, overwritable). The client drops it."""
    a = node.engine()
    keys = list(range(60, 64))
    assert a.call(op="store", keys=keys)["stored"] == 4
    assert a.call(op="load", keys=keys, hold=True)["hits"] == 4  # copied, not completed
    kill_and_restart(node, a)
    assert a.call(op="store", keys=keys)["stored"] == 4
    got = a.call(op="load", keys=keys, hold=True)  # the new session's load, open
    assert got["hits"] == 4 and got["identical"] is True, got
    session = a.call(op="status")["session"]

    def loads_open() -> int:
        [mine] = [e for e in node.status()["node"]["engines"] if e["session"] == session]
        return int(mine["loads_open"])

    wait_until(lambda: loads_open() == 4, 10, "the new load open on the service")
    assert a.call(op="complete_load")["completed"] == 4  # the old load's late completion
    a.call(op="status")  # a question: anything queued has reached the service
    assert loads_open() == 4  # dropped: the new load still holds its blocks
    assert a.call(op="complete_load")["completed"] == 4
    wait_until(lambda: loads_open() == 0, 10, "the new load's own completion counted")


def test_an_idle_engine_notices_a_killed_service_and_reattaches_by_itself(node: Node) -> None:
    """No call after the kill: the client's own thread notices the closed socket and attaches
    to the restarted service (live compose: an engine with no traffic was never listed
    again)."""
    a = node.engine()
    assert a.call(op="store", keys=[1])["stored"] == 1
    assert node.serve is not None
    node.serve.proc.kill()  # type: ignore[union-attr]
    node.serve.proc.wait(10)  # type: ignore[union-attr]
    node.serve.close()
    wait_until(lambda: not a.call(op="status")["connected"], 10, "the idle engine noticed")
    node.start()
    wait_until(lambda: a.call(op="status")["connected"], 30, "reattached with no call made")


# ------------------------------------------------------------------------------ hostile peers


def _raw(sock_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock_path))
    return s


def _read_error(s: socket.socket) -> str:
    data = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            data += chunk
    if len(data) < 4 + wire.HEAD_BYTES:
        return ""
    ftype, _, body = wire.decode_head(data[4:4 + struct.unpack("<I", data[:4])[0]])
    return body.decode() if ftype is wire.FrameType.ERROR else ""


def test_bad_frames_are_refused_with_one_line_and_others_go_on(node: Node) -> None:
    a = node.engine()
    assert a.call(op="store", keys=list(range(4)))["stored"] == 4
    cases = {
        "garbage": b"\x10\x00\x00\x00" + b"\xff" * 16,
        "oversized": struct.pack("<I", wire.MAX_FRAME + 1),
        "not hello first": wire.encode_ops([wire.OpRecord(wire.Op.PENDING)], 1),
        "bad hello": wire._frame(wire.FrameType.HELLO, 0, b'{"namespace": 3}'),
    }
    for name, data in cases.items():
        s = _raw(node.sock)
        s.sendall(data)
        err = _read_error(s)
        s.close()
        assert err and "\n" not in err, (name, err)
    # truncated: a frame announced and cut off (the peer closes mid-frame)
    s = _raw(node.sock)
    s.sendall(wire.encode_hello(hello(NS_A))[:10])
    s.close()
    # a record that lies about its keys, after a good HELLO
    s = _raw(node.sock)
    s.sendall(wire.encode_hello(hello(NS_A)))
    welcome = s.recv(65536)
    assert welcome
    frame = bytearray(wire.encode_ops([wire.OpRecord(wire.Op.LOOKUP, [b"k" * 32])], 2))
    struct.pack_into("<I", frame, 4 + wire.HEAD_BYTES + 4 + 8, 1000)  # n_keys = 1000
    s.sendall(bytes(frame))
    assert "truncated keys" in _read_error(s)
    s.close()
    log = wait_until(lambda: node.log() if node.log().count("sent a bad frame") >= 4
                     and "truncated" in node.log() else None, 10, "the refusals logged")
    assert "MAX_FRAME" in log and "the first frame must be HELLO" in log
    assert "field 'namespace' must be str" in log
    assert "Traceback" not in log
    got = a.call(op="load", keys=list(range(4)))  # the engine goes on, unaffected
    assert got["hits"] == 4 and got["identical"] is True


def test_a_client_that_never_reads_is_dropped(tmp_path: Path) -> None:
    n = Node(tmp_path, node_toml="send_timeout_s = 0.5\n")
    try:
        n.start()
        a = n.engine()
        s = _raw(n.sock)
        s.sendall(wire.encode_hello(hello(NS_A)))
        # ask and ask, never read: the replies fill the socket's buffers, then the service's
        # send times out
        ask = wire.encode_ops([wire.OpRecord(wire.Op.PENDING)], 3)
        s.settimeout(0.2)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30 and "did not read its replies" not in n.log():
            try:
                s.sendall(ask * 256)
            except TimeoutError:
                continue
            except OSError:
                break  # dropped
        s.close()
        wait_until(lambda: "did not read its replies" in n.log(), 10, "the reader dropped")
        assert a.call(op="store", keys=list(range(4)))["stored"] == 4  # others unaffected
        assert a.call(op="load", keys=list(range(4)))["hits"] == 4
    finally:
        n.close()


def test_another_uid_is_refused(node: Node) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a client as another uid (setpriv)")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed")
    # the socket's folder is private (0700): another uid cannot even reach the socket
    os.chmod(node.dir, 0o755)
    os.chmod(node.sock.parent, 0o755)
    os.chmod(node.sock, 0o666)
    code = ("import socket,sys; s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "s.settimeout(10); print(s.recv(4096))")
    out = subprocess.run([setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups",
                          sys.executable, "-c", code, str(node.sock)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "refused" in out.stdout
    assert "uid 65534 gid 65534: refused" in node.log()
    a = node.engine()
    assert a.call(op="store", keys=[1])["stored"] == 1


def test_the_socket_folder_is_private_and_a_second_service_is_refused(node: Node,
                                                                     tmp_path: Path) -> None:
    st = node.sock.parent.stat()
    assert st.st_mode & 0o777 == 0o700 and node.sock.stat().st_mode & 0o777 == 0o600
    other = tmp_path / "two"
    other.mkdir()
    second = subprocess.run(
        [str(kvtier_script()), "serve", "--config", str(node.toml)], capture_output=True,
        text=True, timeout=60, env=dict(os.environ, XDG_STATE_HOME=str(other)))
    assert second.returncode == 2, second.stderr
    assert "another kvtier serve holds it" in second.stderr
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("kvtier serve: node.socket") and "Traceback" not in second.stderr


def test_a_dead_services_socket_is_reclaimed(node: Node) -> None:
    assert node.serve is not None
    node.serve.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
    node.serve.proc.wait(10)  # type: ignore[union-attr]
    node.serve.close()
    assert node.sock.exists()  # left behind by the killed service
    node.start()
    assert "removed the socket a stopped kvtier serve left" in node.log()
    assert node.engine().first["attached"]


def test_an_engine_removes_a_block_it_loaded_from_every_tier_of_the_node(
        tmp_path: Path) -> None:
    """Issue 40, attached: the REMOVE op (an engine's audit found a block it was served
    wrong). Engines in-process over the real socket (`node_engine.Engine`), file storage:
    the block leaves the service's host tier and its storage page is deleted, another
    engine of the namespace is told (removal events, host and storage) and then misses it.
    Hostile REMOVEs are refused in one line, nothing removed, the connection kept: a block
    the engine holds no load of (unknown, not loaded), another namespace's, more than
    MAX_REMOVE_KEYS keys, an unknown reason code."""
    from kvtier.engine.cache_api import InvalidRequestError
    from kvtier.engine.node_client import NodeClient
    from node_engine import Engine, key

    n = Node(tmp_path, storage="file")
    clients: list[NodeClient] = []
    try:
        n.start()

        def engine(ns: str) -> Engine:
            c = NodeClient(n.sock, hello(ns), call_timeout_s=5.0)
            clients.append(c)
            assert c.connected, c.last_error
            return Engine(c, SHAPE)

        a, b, c = engine(NS_A), engine(NS_B), engine(NS_A)
        assert c.client.enable_events()
        c.client.pending_work()  # EVENTS on at the service before the blocks are stored
        keys = [key(i) for i in range(4)]
        assert a.store(keys)["stored"] == 4
        storage = tmp_path / "storage"

        def pages(ks: list[bytes]) -> int:
            return sum(1 for k in ks if any(storage.rglob(a.client.storage_key(k).hex())))

        seen: dict[tuple[str, bool], set[bytes]] = {}

        def note_events() -> None:
            c.client.pending_work()  # a round trip: the reply carries the events
            for ev in c.client.take_events():
                seen.setdefault((ev.tier, ev.removed), set()).update(ev.hashes)

        def stored_everywhere() -> bool:
            note_events()
            return (pages(keys) == 4 and seen.get(("host", False), set()) >= set(keys)
                    and seen.get(("storage", False), set()) >= set(keys))

        wait_until(stored_everywhere, 20, "4 pages in storage and announced")
        loaded = keys[:2]
        assert len(a.client.prepare_load(loaded).host_ids) == 2
        # hostile REMOVEs: refused whole, one line each, nothing removed
        refusals = []
        for who, ks in ((a, [keys[2]]), (a, [loaded[0], key(999)]), (b, [loaded[0]])):
            with pytest.raises(InvalidRequestError) as e:
                who.client.remove_loaded(ks, "audit_mismatch")
            refusals.append(str(e.value))
        assert all("not a block this engine holds a load of" in r for r in refusals), refusals
        too_many = a.client._ask(wire.OpRecord(  # the client cuts long lists: a raw op
            wire.Op.REMOVE, [key(1000 + i) for i in range(wire.MAX_REMOVE_KEYS + 1)], flag=1))
        bad_reason = a.client._ask(wire.OpRecord(wire.Op.REMOVE, [loaded[0]], flag=9))
        assert not too_many.ok and "MAX_REMOVE_KEYS" in too_many.error, too_many.error
        assert not bad_reason.ok and "unknown reason code 9" in bad_reason.error
        with pytest.raises(InvalidRequestError, match="unknown reason"):
            a.client.remove_loaded(loaded, "because")
        for r in [*refusals, too_many.error, bad_reason.error]:
            assert "\n" not in r, r
        assert a.client.connected and b.client.connected
        assert pages(keys) == 4 and c.load(keys)["hits"] == 4
        # the engine's REMOVE, before it completes its loads
        assert a.client.remove_loaded([*loaded, loaded[0]], "audit_mismatch") == 2
        a.client.complete_load(loaded)
        a.client.end_step()
        wait_until(lambda: pages(loaded) == 0, 20, "the removed blocks' pages deleted")
        assert pages(keys[2:]) == 2

        def told() -> bool:
            note_events()
            return (seen.get(("host", True), set()) >= set(loaded)
                    and seen.get(("storage", True), set()) >= set(loaded))

        wait_until(told, 20, "removal events (host and storage) for the removed blocks")
        assert not seen.get(("host", True), set()) & set(keys[2:])
        # another engine of the namespace misses them now (host gone, storage lacks them)
        wait_until(lambda: c.client.lookup(keys[0], "after", keys[1:]).value == "miss", 20,
                   "a miss on the first removed block")
        c.client.forget_request("after")
        assert c.load(keys[2:])["hits"] == 2
        rows = {e["session"]: e for e in n.status()["node"]["engines"]}
        assert rows[a.client.session]["removed"] == 2, rows
        assert "removed 2 blocks of namespace model-a from the node (audit_mismatch)" in n.log()
    finally:
        for cl in clients:
            cl.close()
        n.close()  # the service and its workers (left running before: 2 GiB of pools)


def test_the_host_eviction_policy_reaches_a_namespace(tmp_path: Path) -> None:
    """`cache.host_eviction_policy` through `kvtier serve` to a namespace's host tier (the
    engine-side client over the real socket): a namespace of 4 blocks, a copy loaded once
    (0), three stored after it; the fifth store evicts a never-loaded copy under `duel` (a
    loaded copy ranks as hit), where the list's LRU order would evict the loaded one, the
    least recently used."""
    n = Node(tmp_path, node_toml=f'quotas = {{"{NS_A}" = {4 * PAGE}}}\n')
    text = n.toml.read_text()
    n.toml.write_text(text.replace('write_policy = "write_through"\n',
                                   'write_policy = "write_through"\n'
                                   'host_eviction_policy = "duel"\n', 1))
    try:
        n.start()
        a = n.engine(NS_A)
        assert a.call(op="store", keys=[0])["stored"] == 1
        assert a.call(op="load", keys=[0])["hits"] == 1
        for k in (1, 2, 3):
            assert a.call(op="store", keys=[k])["stored"] == 1
        assert a.call(op="store", keys=[4])["stored"] == 1  # evicts one of 0..3
        assert a.call(op="load", keys=[0])["hits"] == 1, "the loaded copy was evicted"
        assert a.call(op="load", keys=[1])["hits"] == 0, "the oldest never-loaded copy stayed"
        spaces = {s["namespace"]: s for s in n.status()["node"]["namespaces"]}
        assert spaces[NS_A]["host_blocks"] == 4
    finally:
        n.close()
