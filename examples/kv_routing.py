"""Routing on kvtier's events: NVIDIA Dynamo's KV indexer and vllm-router read two vLLM + kvtier.

Runs in the vLLM environment (`make vllm-env` builds `.venv-vllm`); the consumers run from
their own environment (`make consumers-env` builds `.venv-consumers`: `ai-dynamo-runtime`,
`vllm-router`, from PyPI, no etcd, no NATS). Everything is started here, on loopback, and
stopped on every exit path (a signal included):

* two `vllm serve` processes, A and B (the tiny random Llama of examples/vllm_offload.py, 12
  device blocks of 32 tokens), each with kvtier embedded (a host tier of 64 blocks, file
  storage of its own) and vLLM's KV-event publisher on (`--kv-events-config`: PUB and replay
  sockets bound on `tcp://*:P`, since vLLM's publisher connects to any other tcp address);
* Dynamo's standalone indexer (`python -m dynamo.indexer --port P --threads 1`), A registered
  before it serves, B only after it served its prompts: B's first live batch then opens a
  sequence gap, which the indexer recovers through B's replay socket (its log says so);
* `vllm-router --policy kv_aware` in front of both, fed by the same two event streams.

The run: A serves three 200-token prompts, B three others and then a 40-token one (6 full
blocks each, 1 for the last; three prompts overflow the 12-block device pool, so the first
leaves vLLM's device cache while kvtier's host tier keeps every block and storage backs each
up). Then:

1. `POST /query` for every prompt: per instance and tier (`gpu` = device, `cpu` = device +
   host, `disk` = every tier) the answer must be the full prefix for the instance that served
   it and nothing for the other; the blocks it puts on the host tier per instance must equal
   kvtier's own count (admin `/status`, host `cached`), on disk the page files of that
   instance's storage, and A's first prompt must be off the device (`gpu` 0);
2. through the router (started last: it catches up through the replay sockets at each
   instance's next batch), A's first prompt and B's first prompt again: each must go to the
   instance whose host tier holds it, read from the router's own decision line (`--log-level
   debug`) and the backends' counters (vLLM's `request_success`, and its
   `prompt_tokens_cached_by_source`: device tokens as the indexer's `gpu`, host tokens as
   `cpu - gpu`, and kvtier's host hit counter the same);
3. `POST /reset` on A's kvtier admin: A's host tier holds nothing (`/status`), and the indexer
   says so (`cpu` = `gpu` for every prompt of A), storage untouched (`disk`).

`--plain-events` is the break check: kvtier's events without tokens (`self_describing_kv_events
= false`), which the indexer cannot place: `indexer_matches_kvtier` must come out false.

The last line of output is one JSON object (with `--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_offload import BLOCK, VOCAB, build_model

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "kvtier-tiny-llama"
DEVICE_BLOCKS = 12
HOST_BLOCKS = 64  # every block of the run fits: no host eviction, so "kept by kvtier" is exact
PROMPT_TOKENS = 200  # 6 full blocks of 32 + 8 (4 generated tokens never complete a 7th)
TRIGGER_TOKENS = 40  # 1 full block: B's first batch after its late registration
START_TIMEOUT_S = 300.0  # two vLLM servers starting at once on two shared cores
REQUEST_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 30.0

T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_until(pred: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll `pred` until it returns something truthy; RuntimeError naming `what` after
    `timeout` seconds (every wait here is bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def http(url: str, body: Any = None, timeout: float = REQUEST_TIMEOUT_S) -> Any:
    """GET (no body) or POST JSON; the decoded JSON answer (text when it is not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when this example's process dies, however it dies
    (a SIGKILL of the example included), so no server outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Proc:
    """One started process in its own process group (vLLM's engine core and kvtier's worker
    are its children), its log file; `stop` ends the whole group, SIGTERM then SIGKILL."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str],
                 cwd: Path) -> None:
        self.name = name
        self.log_path = log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=cwd, start_new_session=True,
                                     preexec_fn=_die_with_parent)

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.text().splitlines()[-n:])

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):  # the group's stragglers too
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        self._log.close()


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus family's samples whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? ([0-9.eE+-]+)$", text, re.M):
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


class Instance:
    """One `vllm serve` with kvtier embedded and vLLM's KV-event publisher: its HTTP URL, its
    PUB and replay endpoints (bound on every interface, port chosen here), kvtier's admin URL
    (written by kvtier to a file) and its storage folder."""

    def __init__(self, name: str, iid: int, model: Path, work: Path, vllm: Path,
                 plain_events: bool) -> None:
        self.name = name
        self.iid = iid
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"tcp://127.0.0.1:{self.pub}"  # where a subscriber connects
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay}"
        home = work / name
        home.mkdir(mode=0o700)
        self.storage = home / "storage"
        self.url_file = home / "admin-url"
        self.admin_url = ""
        extra: dict[str, Any] = {
            "spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
            "host_blocks": HOST_BLOCKS, "storage_backend": "file",
            "storage_path": str(self.storage), "admin_port": 0, "admin_auth": "none",
            "admin_url_file": str(self.url_file)}
        if plain_events:
            extra["self_describing_kv_events"] = False
        kt = {"kv_connector": "KvtierConnector",
              "kv_connector_module_path": "kvtier.integrations.vllm",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": extra}
        # vLLM's publisher binds a wildcard address and connects to any other tcp one; the
        # consumers connect, so it binds
        ev = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{self.pub}", "replay_endpoint": f"tcp://*:{self.replay}"}
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KVTIER_")}
        # the engine in the API server's process: one process less per instance on 2 cores
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                    "VLLM_LOGGING_LEVEL": "INFO",
                    "XDG_CACHE_HOME": str(home / "cache"), "XDG_STATE_HOME": str(home / "state"),
                    "PYTHONHASHSEED": "0"})
        self.proc = Proc(f"vllm serve {name}", [
            str(vllm), "serve", str(model), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
            "--skip-tokenizer-init", "--max-model-len", "320", "--block-size", str(BLOCK),
            "--dtype", "bfloat16", "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
            "--seed", "0", "--kv-transfer-config", json.dumps(kt),
            "--kv-events-config", json.dumps(ev)], home / "vllm.log", env, home)

    def wait_ready(self, deadline: float) -> None:
        def ready() -> bool:
            self.proc.alive()
            return reachable(self.url + "/health")

        wait_until(ready, max(1.0, deadline - time.monotonic()), f"{self.proc.name} healthy", 1)
        self.admin_url = self.url_file.read_text().strip()

    def complete(self, tokens: list[int], url: str = "") -> dict[str, Any]:
        body = {"model": MODEL_NAME, "prompt": tokens, "max_tokens": 4, "temperature": 0.0}
        out: dict[str, Any] = http((url or self.url) + "/v1/completions", body)
        return out

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = http(self.admin_url + "/status")
        return out

    def host_cached(self) -> int:
        return int(self.status()["tiers"]["host"]["cached"])

    def pages(self) -> int:
        return sum(1 for p in self.storage.rglob("*") if p.is_file())

    def counters(self) -> dict[str, float]:
        """What this instance itself counts: requests served (vLLM), prompt tokens cached by
        source (vLLM: device / host / disk), host hit tokens (kvtier)."""
        vm = http(self.url + "/metrics")
        km = http(self.admin_url + "/metrics")
        out = {"served": metric_sum(vm, "vllm:request_success_total"),
               "kvtier_host_hit": metric_sum(km, "kvtier_hit_tokens_total", tier="host")}
        for src in ("device", "host", "disk"):
            out[src] = metric_sum(vm, "vllm:prompt_tokens_cached_by_source_total", source=src)
        return out

    def settle(self, rng: random.Random) -> None:
        """Backups to storage landed, then one engine step with no full block, so kvtier's
        last events are taken and published."""
        wait_until(lambda: not self.status().get("tasks_inflight", 0), SETTLE_TIMEOUT_S,
                   f"{self.name}'s transfers done")
        self.complete([rng.randrange(VOCAB) for _ in range(3)])


class Indexer:
    """Dynamo's standalone KV indexer (HTTP on its port; it connects to each registered
    instance's PUB and replay sockets)."""

    def __init__(self, python: Path, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["RUST_LOG"] = "info"
        self.proc = Proc("dynamo.indexer", [
            str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            work / "indexer.log", env, work)

    def wait_ready(self) -> None:
        def ready() -> bool:
            self.proc.alive()
            return reachable(self.url + "/health")

        wait_until(ready, 60, "dynamo.indexer healthy")

    def register(self, inst: Instance, block_size: int) -> None:
        http(self.url + "/register", {
            "instance_id": inst.iid, "endpoint": inst.endpoint, "model_name": MODEL_NAME,
            "block_size": block_size, "replay_endpoint": inst.replay_endpoint})

    def query(self, tokens: list[int]) -> dict[int, dict[str, int]]:
        """Per instance id: tokens matched on the device (`gpu`), device + host (`cpu`), every
        tier (`disk`); an instance holding none of the prefix is absent, read as zeros."""
        got = http(self.url + "/query", {"token_ids": tokens, "model_name": MODEL_NAME})
        return {int(i): {t: int(v.get(t, 0)) for t in ("gpu", "cpu", "disk")}
                for i, v in got.get("instances", {}).items()}

    def log_lines(self, pattern: str) -> list[str]:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", self.proc.text())
        return [ln for ln in plain.splitlines() if re.search(pattern, ln)]


class Router:
    """vllm-router with `--policy kv_aware` in front of the instances, fed by their events."""

    def __init__(self, exe: Path, work: Path, instances: list[Instance]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [str(exe), "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-port", str(free_port()), "--policy", "kv_aware",
                "--router-temperature", "0", "--kv-event-block-size", str(BLOCK),
                "--kv-event-model", MODEL_NAME, "--worker-startup-check-interval", "1",
                # its kv_aware decisions and replays are logged at debug level only
                "--log-level", "debug", "--worker-urls", *[i.url for i in instances]]
        for i in instances:
            argv += ["--kv-event-source", f"{i.url}={i.endpoint}",
                     "--kv-event-replay-source", f"{i.url}={i.replay_endpoint}"]
        self.proc = Proc("vllm-router", argv, work / "router.log", dict(os.environ), work)

    def wait_ready(self) -> None:
        def ready() -> bool:
            self.proc.alive()
            return reachable(self.url + "/health")

        wait_until(ready, 60, "vllm-router healthy", 0.5)

    def _log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", self.proc.text())

    def replayed(self, inst: Instance) -> bool:
        """Whether the router caught up `inst`'s stream through its replay socket."""
        return f"replay sequence advanced source={inst.url} " in self._log()

    def decisions(self) -> list[tuple[str, int]]:
        """Each kv_aware decision so far: the worker picked, the prefix tokens it credited
        (device blocks in full, host blocks at --kv-penalty-host, 0.8 by default)."""
        return [(m.group(1), int(m.group(2))) for m in re.finditer(
            r'KV prefix decision outcome="\w+" worker="([^"]+)".*?credited_prefix_tokens=(\d+)',
            self._log())]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@contextlib.contextmanager
def stopped_on_exit() -> Iterator[list[Proc]]:
    """Every process appended is stopped on the way out, whatever the way (SIGTERM and
    SIGINT become SystemExit here so the stops run)."""
    procs: list[Proc] = []

    def leave(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()
        for s, h in old.items():
            signal.signal(s, h)


Answer = dict[int, dict[str, int]]  # the indexer's /query: instance id -> tier -> tokens


def tier(ans: Answer, iid: int, t: str) -> int:
    return ans.get(iid, {}).get(t, 0)


def full(p: list[int]) -> int:
    return len(p) // BLOCK * BLOCK


class Run:
    """The two instances, the prompts each served (in order) and the indexer: what the
    checks compare."""

    def __init__(self, a: Instance, b: Instance, indexer: Indexer) -> None:
        self.a, self.b, self.indexer = a, b, indexer
        self.instances = (a, b)
        self.served: dict[int, list[list[int]]] = {a.iid: [], b.iid: []}

    def serve(self, inst: Instance, p: list[int]) -> None:
        inst.complete(p)
        self.served[inst.iid].append(p)

    def prompts(self) -> list[tuple[int, list[int]]]:
        return [(iid, p) for iid, ps in self.served.items() for p in ps]

    def agrees(self, ans: list[Answer], kv: dict[int, dict[str, int]],
               check: tuple[Instance, ...], host_full: bool) -> bool:
        """The indexer's answers against what the `check` instances hold: per prompt, the
        instance that served it has the whole prefix on disk and on its host tier (or,
        `host_full` false, nothing beyond its device), the other instance nothing; per
        instance, the host and disk blocks add up to kvtier's host count and page files."""
        prompts = self.prompts()
        for (iid, p), q in zip(prompts, ans, strict=True):
            for inst in check:
                mine = inst.iid == iid
                want_cpu = (full(p) if host_full else tier(q, inst.iid, "gpu")) if mine else 0
                if tier(q, inst.iid, "cpu") != want_cpu:
                    return False
                if tier(q, inst.iid, "disk") != (full(p) if mine else 0):
                    return False
        for inst in check:
            mine_q = [q for (iid, _), q in zip(prompts, ans, strict=True) if iid == inst.iid]
            host = sum(tier(q, inst.iid, "cpu") - tier(q, inst.iid, "gpu")
                       for q in mine_q) // BLOCK
            gpu = sum(tier(q, inst.iid, "gpu") for q in mine_q) // BLOCK
            # every block is on kvtier's host tier, or (after a reset) none is
            want_host = kv[inst.iid]["host_blocks"] - (gpu if host_full else 0)
            if host != want_host:
                return False
            disk = sum(tier(q, inst.iid, "disk") for q in mine_q) // BLOCK
            if disk != kv[inst.iid]["storage_pages"]:
                return False
        return True

    def converge(self, check: tuple[Instance, ...], host_full: bool
                 ) -> tuple[bool, list[Answer], dict[int, dict[str, int]]]:
        """Poll (bounded) until the indexer agrees with the instances; the last reading."""
        last: list[Any] = [[], {}]

        def once() -> bool:
            kv = {i.iid: {"host_blocks": i.host_cached(), "storage_pages": i.pages()}
                  for i in self.instances}
            ans = [self.indexer.query(p) for _, p in self.prompts()]
            last[:] = [ans, kv]
            return self.agrees(ans, kv, check, host_full)

        try:
            wait_until(once, SETTLE_TIMEOUT_S, "the indexer agrees", 0.5)
            ok = True
        except RuntimeError:
            ok = False
        return ok, last[0], last[1]

    def table(self, ans: list[Answer]) -> list[dict[str, Any]]:
        return [{"served_by": "AB"[iid - 1],
                 **{i.name: {t: tier(q, i.iid, t) for t in ("gpu", "cpu", "disk")}
                    for i in self.instances}}
                for (iid, _), q in zip(self.prompts(), ans, strict=True)]


def run(args: argparse.Namespace, work: Path, procs: list[Proc]) -> dict[str, Any]:
    consumers = Path(args.consumers_venv) / "bin"
    vllm = Path(sys.executable).parent / "vllm"
    model = build_model(Path(args.model_dir or os.path.join(
        tempfile.gettempdir(), "kvtier-vllm-tiny-llama")))
    t0 = time.monotonic()
    a = Instance("A", 1, model, work, vllm, args.plain_events)
    procs.append(a.proc)
    b = Instance("B", 2, model, work, vllm, args.plain_events)
    procs.append(b.proc)
    indexer = Indexer(consumers / "python", work)
    procs.append(indexer.proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    indexer.wait_ready()
    a.wait_ready(deadline)
    b.wait_ready(deadline)
    started_s = time.monotonic() - t0
    r = Run(a, b, indexer)
    rng = random.Random(args.seed)

    # ----- 1. the indexer: A registered before it serves, B after
    indexer.register(a, BLOCK)
    for inst in (a, b):
        for _ in range(3):
            r.serve(inst, prompt(rng, PROMPT_TOKENS))
    indexer.register(b, BLOCK)
    time.sleep(0.5)  # the indexer's SUB connects before B's next batch
    r.serve(b, prompt(rng, TRIGGER_TOKENS))  # B's first batch the indexer sees: a gap
    for inst in r.instances:
        inst.settle(rng)
    ok, ans, kv = r.converge(r.instances, host_full=True)
    first_a = ans[0]
    report: dict[str, Any] = {
        "indexer_matches_kvtier": ok,
        "queries": r.table(ans),
        "kvtier_holds": {i.name: kv[i.iid] for i in r.instances},
        "first_prompt_off_device": tier(first_a, a.iid, "gpu") == 0,
        "kvtier_host_kept": tier(first_a, a.iid, "cpu") == full(r.served[a.iid][0]),
        "gap_detected": bool(indexer.log_lines(r"Gap detected.*worker_id=2")),
        "replay_completed": indexer.log_lines(r"Replay complete.*worker_id=2")[-1:],
        "started_s": round(started_s, 1),
    }
    m = re.search(r"replayed=(\d+)", "".join(report["replay_completed"]))
    report["replayed_batches"] = int(m.group(1)) if m else 0
    report["late_instance_complete"] = all(
        tier(q, b.iid, "disk") == full(p)
        for (iid, p), q in zip(r.prompts(), ans, strict=True) if iid == b.iid)

    # ----- 2. vllm-router (kv_aware) in front of both, started now: it catches up through
    # the replay sockets at each instance's next batch
    router = Router(consumers / "vllm-router", work, [a, b])
    procs.append(router.proc)
    router.wait_ready()
    for inst in r.instances:
        # a new block makes a batch; the router, seeing its sequence number, asks the replay
        # socket for the batches before it. A batch published while its SUB socket was still
        # connecting is lost to it (ZMQ): then the next one does it
        for _ in range(5):
            r.serve(inst, prompt(rng, TRIGGER_TOKENS))
            with contextlib.suppress(RuntimeError):
                wait_until(functools.partial(router.replayed, inst), 5, "")
                break
        else:
            raise RuntimeError(f"vllm-router never replayed {inst.name}'s events")
    routed: list[dict[str, Any]] = []
    for inst in r.instances:
        other = b if inst is a else a
        p = r.served[inst.iid][0]
        expect = indexer.query(p)
        before = {i.iid: i.counters() for i in r.instances}
        decisions = len(router.decisions())
        inst.complete(p, url=router.url)
        after = {i.iid: i.counters() for i in r.instances}
        delta = {i.iid: {k: after[i.iid][k] - before[i.iid][k] for k in after[i.iid]}
                 for i in r.instances}
        d = delta[inst.iid]
        gpu, cpu = tier(expect, inst.iid, "gpu"), tier(expect, inst.iid, "cpu")
        picked = router.decisions()[decisions:]
        routed.append({
            "prompt_of": inst.name,
            "indexer": {i.name: expect.get(i.iid, {}) for i in r.instances},
            "router_picked": [next((i.name for i in r.instances if i.url == u), u)
                              for u, _ in picked],
            "router_credited_tokens": [c for _, c in picked],
            "served_by": [i.name for i in r.instances if delta[i.iid]["served"] >= 1],
            "to_holder": d["served"] == 1 and delta[other.iid]["served"] == 0,
            "device_tokens": d["device"], "host_tokens": d["host"],
            "kvtier_host_hit_tokens": d["kvtier_host_hit"],
            "as_indexed": d["device"] == gpu and d["host"] == cpu - gpu == d["kvtier_host_hit"]
            and cpu - gpu > 0,
        })
    report["routed"] = routed
    report["router_to_host_holder"] = all(
        x["to_holder"] and x["router_picked"] == [x["prompt_of"]] for x in routed)
    report["router_hits_as_indexed"] = all(x["as_indexed"] for x in routed)

    # ----- 3. POST /reset on A's kvtier admin: A's host tier empties, the indexer follows
    http(a.admin_url + "/reset", {})
    for inst in r.instances:
        inst.settle(rng)
    ok_reset, ans_reset, kv_reset = r.converge((a,), host_full=False)
    host_a = sum(tier(q, a.iid, "cpu") - tier(q, a.iid, "gpu")
                 for (iid, _), q in zip(r.prompts(), ans_reset, strict=True) if iid == a.iid)
    report["after_reset"] = {
        "kvtier_host_blocks_a": kv_reset[a.iid]["host_blocks"],
        "indexer_host_blocks_a": host_a // BLOCK,
        "storage_pages_a": kv_reset[a.iid]["storage_pages"],
        "indexer_matches_kvtier": ok_reset,
        "queries": r.table(ans_reset)}
    report["reset_zero_host"] = (ok_reset and host_a == 0
                                 and kv_reset[a.iid]["host_blocks"] == 0)
    report["plain_events"] = args.plain_events
    report["seconds"] = round(time.monotonic() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model-dir", default="", help="where the random model is built")
    ap.add_argument("--consumers-venv", default=str(ROOT / ".venv-consumers"),
                    help="the environment with dynamo.indexer and vllm-router "
                         "(make consumers-env)")
    ap.add_argument("--plain-events", action="store_true",
                    help="break check: kvtier's events without tokens "
                         "(self_describing_kv_events = false)")
    ap.add_argument("--keep-logs", default="", help="copy the processes' logs to this folder")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    for exe in ("python", "vllm-router"):
        if not (Path(args.consumers_venv) / "bin" / exe).exists():
            ap.error(f"{args.consumers_venv}/bin/{exe} is missing: make consumers-env")
    work = Path(tempfile.mkdtemp(prefix="kvtier-routing-"))  # 0700
    try:
        with stopped_on_exit() as procs:
            try:
                report = run(args, work, procs)
            except Exception:
                for log in sorted(work.rglob("*.log")):  # what each process said last
                    tail = log.read_text(errors="replace").splitlines()[-25:]
                    print(f"--- {log.relative_to(work)}", *tail, sep="\n", file=sys.stderr)
                raise
            finally:
                if args.keep_logs:
                    keep = Path(args.keep_logs)
                    keep.mkdir(parents=True, exist_ok=True)
                    for log in work.rglob("*.log"):
                        shutil.copy(log, keep / f"{log.parent.name}-{log.name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
