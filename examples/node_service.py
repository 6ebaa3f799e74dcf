"""One `kvtier serve` as the node's KV cache, two vLLM processes attached to it, checked exactly.

Runs in the vLLM environment (`make vllm-env` builds `.venv-vllm`). It starts `kvtier serve`
(storage off unless `--tenants`: every hit below comes from the node's host tier) with its
engine socket in a private folder, then two vLLM engine processes, A and B, each with
`kv_connector_extra_config = {"kvtier_serve": "<socket>", ...}` (attached mode) and the tiny
random Llama of `examples/vllm_offload.py` (12 device blocks of 32 tokens, so nothing is
shared through vLLM itself). Each engine's KVTIER_CACHE__HOST_BLOCKS asks for a host tier
twice this machine's free memory: attached, the host tier is the service's, so nothing of it
is checked or made on the engine side and they start all the same (`unowned_host_tiers`):

* A serves prompt P cold; B (another process, its device cache empty) then serves P: vLLM
  reports P's full blocks as cached (`instance_b_tokens_from_host`), they came from the node's
  host tier (the service's per-engine counters say so), and B's tokens and logprobs equal A's
  cold run exactly (`identical`). The admin of the service lists both engines.
* Negative control: A serves Q cold, every page of the namespace's host pool is overwritten
  behind the service's back, B serves Q: B loads Q's blocks (the same count) and its output
  must differ (`negative_control_identical: false`), else the comparison could not fail.
* `--kill-a`: A serves R cold, then a store-heavy batch, and is killed (SIGKILL) while
  serving it (right after the batch's first prompt); a new A' serves R and the batch's first
  prompt: it hits what A stored, exactly (`after_kill_a_*`), and the service lists only the
  engines alive.
* `--tenants` (issue 36): the service with file storage and its event stream on; tenants by
  cache_salt with host quotas of 12 blocks each (POST /tenants/quota). B serves its system
  prompt with salt "b" and a kv_hints `kvtier.retain` v1 {pin, tenant "b"} (no REST call for
  the pin), then two documents of its own: the second takes B past its quota, and B's
  oldest unpinned blocks go (without the pin, the system prompt's). A floods the namespace
  with salt "a" (2.5x its quota). B's device cache is flushed; /lookup by token ids says how
  much of B's prompt the host holds; B's next request must load exactly that from the host,
  identical to its first run (`b_pinned_tokens_after_flood`, `lookup_equals_load`); A's
  flood evicted A's blocks only (`a_evicted_only_a`). Then tenant A is cleared over REST:
  B's blocks stay (`clear_left_other_tenant`) and the event stream announces each of A's
  removals (`clear_removals_announced`); A's first document is warmed from storage and A's
  next request loads it from the host tier, exactly (`warm_first_request_host_tokens`:
  the service's count of its loads, at most what /lookup saw on the host before it).
  Then TTL and priority through kv_hints (`_retention_steps`), two more tenants with quotas
  of 12 blocks: a prompt kept with `ttl_s` survives its tenant's flood while the TTL runs
  (B then loads all of it from the host: `ttl_host_tokens_within`) and is evicted by the
  flood after it (`ttl_host_tokens_after`: none); of two prompts of one tenant, a flood
  evicts the lower priority one first although it is the younger
  (`priority_high_host_tokens`, `priority_low_host_tokens`).
* `--kill-serve`: `kvtier serve` is killed (SIGKILL) while B serves; B's requests complete
  (recomputed) within `SERVE_DOWN_BOUND_S` each; serve is started again on the same socket, B
  reconnects (backoff at most 5 s), stores anew and hits again (`after_restart_*`).
* `--restart-serve`: `kvtier serve` is stopped with SIGTERM (a planned restart) and started
  again on the same socket.
* `--takeover-serve`: last, `kvtier serve --takeover` starts beside the running service
  and takes its place (a planned upgrade): B serves T cold before it and from the new
  service's host tier after it (`takeover_tokens_from_host`, exact: `takeover_identical`;
  `takeover_kept_blocks`).
* The last planned restart (the take-over's, else `--restart-serve`'s): B serves
  `--repeat-prompts` N (50) prompts of two blocks and a token in one batch cold (it stores
  them), then again (from the host tier), and the same N after the restart
  (`same_prompts`): per request the host tokens before and after, the tokens the service
  loaded for B in each pass (they equal vLLM's cached tokens: all came from the host tier),
  and whether every output equals its cold run exactly.
* With either, the service runs with `node.handover = true` (issue 37): B serves K cold
  before the restart and pushes it out of its device cache; after it, B serves K from the
  new service's host tier
  (`kept_tokens_from_host`, exact: `kept_identical`), and the service's figures say how many
  blocks it kept (`kept_blocks`: handed over, or vouched for by the page journal after a
  kill -9; the pages the negative control overwrote do not check and are discarded).

The last line of output is one JSON object (with `--json`). Engine processes are this file
run with `--engine`: they read one JSON command a line on stdin and answer one line on stdout
prefixed with `@@ `.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# vLLM's block hashes are seeded from it: engines sharing the node must agree
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_offload

PROMPT_TOKENS = vllm_offload.PROMPT_TOKENS
VOCAB = vllm_offload.VOCAB
PREFIX_TOKENS = (PROMPT_TOKENS // vllm_offload.BLOCK) * vllm_offload.BLOCK
START_TIMEOUT_S = 300.0  # a vLLM engine process starting on a loaded 2-core machine
ANSWER_TIMEOUT_S = 120.0  # one generate command
SERVE_DOWN_BOUND_S = 30.0  # a request of an attached engine while its service is dead
# --tenants: host quotas in blocks. B's is two documents' worth: its pinned system prompt
# plus one document of its own; its second document evicts its oldest unpinned blocks
A_QUOTA_BLOCKS = 12
B_QUOTA_BLOCKS = 12
# --tenants, TTL and priority: two documents' worth per tenant; the TTL outlasts three
# requests on a loaded machine (0.15-0.63 s each measured) and the priority steps run
# meanwhile, so waiting for it costs little
RETAIN_QUOTA_BLOCKS = 12
TTL_S = 5.0
RETAIN_SEED = 36
# the planned restart's "hit rate after equals before" (issue 37): N prompts of two blocks
# and a token (each hits 64 tokens once stored), served in one batch
REPEAT_PROMPTS = 50
REPEAT_PROMPT_TOKENS = 2 * vllm_offload.BLOCK + 1
URL_LINE = re.compile(r"admin listening on (http://\S+)")
MARK = "@@ "


# ------------------------------------------------------------------------ engine process


# The tiny Llama's host page: 2 (K, V) x 2 layers x 32 tokens x 2 heads x 64 x 2 bytes (bf16)
TINY_PAGE_BYTES = 2 * 2 * vllm_offload.BLOCK * 2 * 64 * 2


def engine_main(socket_path: str, model_dir: str) -> int:
    """An attached vLLM engine driven over stdin/stdout (see the module docstring)."""
    from kvtier.manager.config import host_pool_bytes, mem_available_bytes

    model = vllm_offload.build_model(Path(model_dir))
    # Issue 34, defect 8: an attached engine checks nothing of a host tier it does not own
    # (the service's namespace quota sizes the node's). This process's KVTIER_CACHE__HOST_BLOCKS
    # (an operator's variable, e.g. left from an embedded deployment; the connector's own
    # `host_blocks` is refused when attached) asks for a host tier of twice this machine's
    # free memory, which an embedded engine refuses at start ("cache.host_blocks = ... needs
    # ... but only ... are available in MemAvailable").
    mem = mem_available_bytes() or 0
    os.environ["KVTIER_CACHE__HOST_BLOCKS"] = str(2 * mem // TINY_PAGE_BYTES + 1)
    llm = vllm_offload.make_llm(model, {"kvtier_serve": socket_path})
    manager = vllm_offload.kvtier_manager(llm)
    sized = {"host_blocks": manager.cfg.cache.host_blocks,
             "host_tier_bytes": host_pool_bytes(manager.cfg), "mem_available": mem}

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True, "pid": os.getpid(), "unowned_host_tier": sized})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "generate":
            t = time.monotonic()
            out = (steered_generate(llm, cmd["tokens"], cmd["salt"], cmd.get("retain"))
                   if "salt" in cmd else vllm_offload.generate(llm, cmd["tokens"]))
            out["seconds"] = round(time.monotonic() - t, 3)
            answer(out)
        elif cmd["op"] == "batch":
            t = time.monotonic()
            outs = vllm_offload.generate_many(llm, cmd["prompts"], max_tokens=2)
            answer({"outputs": outs, "seconds": round(time.monotonic() - t, 3)})
        elif cmd["op"] == "pools":
            pools = manager.cache.host_pools()
            answer({"segments": [] if pools is None else [s.name for s in pools.segments]})
        elif cmd["op"] == "quit":
            answer({"bye": True})
            break
    del llm
    return 0


def steered_generate(llm: Any, tokens: list[int], salt: str,
                     retain: dict[str, Any] | None) -> dict[str, Any]:
    """`vllm_offload.generate` with vLLM's cache_salt and, when given, a kv_hints envelope
    holding kvtier's `kvtier.retain` v1 action (`retain` is its payload), through the engine's
    add_request (vLLM 0.32's LLM.generate takes no kv_hints)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    sp = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)
    rid = f"steered-{next(_steered)}"
    hints = None if retain is None else KvHintsEnvelope(
        protocol_version="1", message_id=rid, actions=[KvHintAction(
            action_id=rid, action_type="kvtier.retain", action_version="1", payload=retain)])
    engine = llm.llm_engine
    engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens, cache_salt=salt), sp,
                       kv_hints=hints)
    out = None
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    if out is None:
        raise RuntimeError(f"{rid} did not finish within {ANSWER_TIMEOUT_S:g} s")
    comp = out.outputs[0]
    logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in comp.logprobs]
    return {"tokens": list(comp.token_ids), "logprobs": logprobs,
            "num_cached_tokens": int(out.num_cached_tokens or 0)}


_steered = iter(range(1, 1 << 62))


def admin_json(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """GET (no body) or POST (a JSON body) to the service's admin (auth none here)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="GET" if data is None else
                                 "POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def tenant_phase(serve: Serve, a: Engine, b: Engine, prompt: Any) -> dict[str, Any]:
    """The `--tenants` steps (see the module docstring)."""
    from kv_events import ServiceSubscriber

    ns = serve.status()["node"]["namespaces"][0]["namespace"]
    sub = ServiceSubscriber(f"ipc://{Path(serve.socket_path).parent / 'events.pub'}")
    try:
        return _tenant_steps(serve, ns, sub, a, b, prompt)
    finally:
        sub.close()


def _tenant_steps(serve: Serve, ns: str, sub: Any, a: Engine, b: Engine,
                  prompt: Any) -> dict[str, Any]:
    def lookup(tokens: list[int], salt: str) -> dict[str, int]:
        found: dict[str, int] = admin_json(serve.url, "/lookup", {
            "namespace": ns, "token_ids": tokens, "cache_salt": salt})["matched_tokens"]
        return found

    def figures() -> dict[str, Any]:
        out: dict[str, Any] = admin_json(serve.url, f"/tenants?namespace={ns}")[ns]
        return out

    def loads(e: Engine) -> int:
        [mine] = [s for s in engines(serve.status()) if s.get("pid") == e.pid]
        return int(mine["loads"])

    for tenant, blocks in (("a", A_QUOTA_BLOCKS), ("b", B_QUOTA_BLOCKS)):
        admin_json(serve.url, "/tenants/quota", {"namespace": ns, "tenant": tenant,
                                                 "quota_blocks": blocks})
    system = prompt()
    first = b.steer(system, "b", {"pin": True, "tenant": "b"})
    # B's own one-shot documents (salt b) fill B's quota twice over: its oldest unpinned
    # blocks go first, and without the pin those are the system prompt's (unused since)
    for _ in range(2):
        b.steer(prompt(), "b", {"tenant": "b"})
    before_flood = figures()
    flood = [prompt() for _ in range(5)]  # A's flood: 30 one-shot blocks, its quota 12
    cold_doc = a.steer(flood[0], "a", {"tenant": "a"})
    for doc in flood[1:]:
        a.steer(doc, "a", {"tenant": "a"})
    after_flood = figures()
    for _ in range(4):  # push the system prompt out of B's 12-block device cache
        b.generate(prompt())
    found = lookup(system, "b")
    again = b.steer(system, "b", {"pin": True, "tenant": "b"})
    figs = figures()
    out: dict[str, Any] = {
        "b_pinned_tokens_after_flood": again["num_cached_tokens"],
        "b_identical_after_flood": vllm_offload.compare(first, again)[0],
        "lookup_host_tokens": found["host"],
        "lookup_equals_load": found["host"] == again["num_cached_tokens"],
        # A's flood evicted A's own blocks and not one of B's (B is within its quota)
        "a_evicted_only_a": (after_flood["a"]["evictions"] > 0 and after_flood["b"]["evictions"]
                             == before_flood["b"]["evictions"]),
        "b_own_evictions": figs["b"]["evictions"],
        "tenants": figs,
    }

    # clear tenant A (host tier, over REST): B's blocks stay, the event stream announces
    # every one of A's removals
    topic = f"kvtier/host/{ns}"
    wait_for(lambda: len(sub.topics().get(topic, ())) >= figs["a"]["host_blocks"]
             + figs["b"]["host_blocks"], 20, "the event stream to show both tenants' blocks")
    held = sub.topics().get(topic, set())
    cleared = admin_json(serve.url, "/clear", {"namespace": ns, "tenant": "a"})
    removed = cleared["host_blocks_removed"]
    wait_for(lambda: len(held - sub.topics().get(topic, set())) >= removed, 20,
             "the event stream to announce the clear's removals")
    after = sub.topics().get(topic, set())
    out["clear_left_other_tenant"] = (
        removed == figs["a"]["host_blocks"] > 0 and lookup(system, "b")["host"] == PREFIX_TOKENS
        and lookup(flood[-1], "a")["host"] == 0)
    out["clear_removals_announced"] = len(held - after) == removed and after <= held

    # warm: A's first document (out of A's host share since the flood, still in storage)
    # brought back to the host tier ahead of traffic; A's next request loads it from there.
    # Every kvtier load is a copy out of the host pool; a block warmed from storage is
    # counted by the service as a storage hit on its first load, so the figure is the loads
    # of the request, bounded by what /lookup saw on the host before it was sent.
    doc = flood[0]
    wait_for(lambda: lookup(doc, "a")["storage"] == PREFIX_TOKENS, 20,
             "A's first document backed up to storage")
    admin_json(serve.url, "/warm", {"namespace": ns, "token_ids": doc, "cache_salt": "a"})
    wait_for(lambda: lookup(doc, "a")["host"] == PREFIX_TOKENS, 20, "the warm to land")
    on_host = lookup(doc, "a")["host"]
    before = loads(a)
    warmed = a.steer(doc, "a", {"tenant": "a"})
    out["warm_first_request_cached_tokens"] = warmed["num_cached_tokens"]
    out["warm_first_request_host_tokens"] = min(on_host,
                                                (loads(a) - before) * vllm_offload.BLOCK)
    out["warm_first_request_identical"] = vllm_offload.compare(cold_doc, warmed)[0]
    out.update(_retention_steps(serve, ns, a, b, figures))
    return out


def _retention_steps(serve: Serve, ns: str, a: Engine, b: Engine,
                     figures: Any) -> dict[str, Any]:
    """TTL and priority through kv_hints, each tenant with a quota of two documents (12
    blocks); what a request loads from the host is the service's count for B (vLLM's
    num_cached_tokens alone would include loads from storage). TTL: A stores X with
    {ttl_s: TTL_S}; B floods two documents of X's tenant (the second must evict one of the
    two oldest: X is held, so the first document goes) and then loads all of X from the host;
    once X's hold expired, two more documents evict what is oldest (the first of them, then
    X, whose hit made it the youngest) and B loads none of X from the host. Priority: A
    stores HI (priority 2) before LO (priority 1), then one document of their tenant: it
    evicts LO, younger but lower; B loads all of HI and none of LO from the host. The
    priority steps run while X's TTL does. Its prompts come from a generator of its own, so
    the later steps' prompts are those of a run without it."""
    own = random.Random(RETAIN_SEED)

    def prompt() -> list[int]:
        return [own.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]

    def host_tokens(e: Engine, tokens: list[int], salt: str) -> tuple[int, int]:
        """(host tokens the service counted for this request, vLLM's num_cached_tokens)."""
        [before] = [s for s in engines(serve.status()) if s.get("pid") == e.pid]
        got = e.steer(tokens, salt, None)  # no hint: a hit would refresh a retention
        [after] = [s for s in engines(serve.status()) if s.get("pid") == e.pid]
        host = (after["hit_host_blocks"] - before["hit_host_blocks"]) * vllm_offload.BLOCK
        return host, got["num_cached_tokens"]

    for tenant in ("t", "p"):
        admin_json(serve.url, "/tenants/quota", {"namespace": ns, "tenant": tenant,
                                                 "quota_blocks": RETAIN_QUOTA_BLOCKS})
    out: dict[str, Any] = {"ttl_s": TTL_S}
    x = prompt()
    t0 = time.monotonic()
    a.steer(x, "t", {"ttl_s": TTL_S, "tenant": "t"})
    for _ in range(2):
        b.steer(prompt(), "t", {"tenant": "t"})
    out["ttl_held_blocks_after_flood"] = figures()["t"]["held_blocks"]
    out["ttl_host_tokens_within"], out["ttl_cached_tokens_within"] = host_tokens(b, x, "t")
    out["ttl_flood_seconds"] = round(time.monotonic() - t0, 2)

    hi, lo = prompt(), prompt()
    a.steer(hi, "p", {"priority": 2, "tenant": "p"})
    a.steer(lo, "p", {"priority": 1, "tenant": "p"})
    a.steer(prompt(), "p", {"tenant": "p"})
    out["priority_high_host_tokens"] = host_tokens(b, hi, "p")[0]
    out["priority_low_host_tokens"] = host_tokens(b, lo, "p")[0]
    out["priority_evictions"] = figures()["p"]["evictions"]

    wait_for(lambda: figures()["t"]["held_blocks"] == 0, TTL_S + 20, "X's TTL to run out")
    out["ttl_released_after_s"] = round(time.monotonic() - t0, 2)
    for _ in range(2):
        b.steer(prompt(), "t", {"tenant": "t"})
    # B's device cache lost X to the six requests since (a device hit would count no host
    # tokens either): /lookup says the host holds none of it before B asks
    out["ttl_lookup_host_after"] = admin_json(serve.url, "/lookup", {
        "namespace": ns, "token_ids": x, "cache_salt": "t"})["matched_tokens"]["host"]
    out["ttl_host_tokens_after"] = host_tokens(b, x, "t")[0]
    out["retention_steps_seconds"] = round(time.monotonic() - t0, 2)
    return out


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when this example's process dies, however it dies (a
    test run interrupted with ^C or a SIGKILL of the example: seen leaving `kvtier serve` and
    an engine running after the example was gone)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Engine:
    """One engine child process (this file with --engine)."""

    def __init__(self, name: str, socket_path: str, model_dir: str, log_dir: Path) -> None:
        self.name = name
        self.log_path = log_dir / f"engine-{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--engine", socket_path, "--model-dir", model_dir],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=env, bufsize=1, preexec_fn=die_with_parent)
        self.pid = self.proc.pid
        # a thread reads the answers (a select() on a buffered pipe misses lines already
        # read into the buffer); None: the process closed its stdout
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._reader, daemon=True, name=f"engine-{name}").start()

    def _reader(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._lines.put(line[len(MARK):])
        self._lines.put(None)

    def read(self, timeout: float) -> dict[str, Any]:
        """The next answer, within `timeout` seconds (the process's log on failure)."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no answer in {timeout:g} s\n"
                               f"{self.tail()}") from None
        if line is None:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()}):\n"
                               f"{self.tail()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def generate(self, tokens: list[int], timeout: float = ANSWER_TIMEOUT_S) -> dict[str, Any]:
        self.send({"op": "generate", "tokens": tokens})
        return self.read(timeout)

    def batch(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        """The prompts served in one generate call (vLLM batches them), an output each."""
        self.send({"op": "batch", "prompts": prompts})
        outs: list[dict[str, Any]] = self.read(ANSWER_TIMEOUT_S)["outputs"]
        return outs

    def steer(self, tokens: list[int], salt: str, retain: dict[str, Any] | None
              ) -> dict[str, Any]:
        self.send({"op": "generate", "tokens": tokens, "salt": salt, "retain": retain})
        return self.read(ANSWER_TIMEOUT_S)

    def tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, RuntimeError):
                self.send({"op": "quit"})
                self.read(30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self.kill()


# ------------------------------------------------------------------------ the service


class Serve:
    """`kvtier serve` with its engine socket at `socket_path`, storage off (or file storage
    in `storage_path`), admin on a free loopback port without a token (a loopback-only
    demo); `events`: its KV-event publisher on (ipc, in the socket's folder)."""

    def __init__(self, workdir: Path, socket_path: str, deployment_id: str, *,
                 storage_path: str = "", quota_bytes: int = 64 << 20,
                 events: bool = False, handover: bool = False) -> None:
        storage = (f'[storage]\nbackend = "file"\npath = "{storage_path}"\n' if storage_path
                   else '[storage]\nbackend = "none"\n')
        self.workdir = workdir
        self.socket_path = socket_path
        self.toml = workdir / "kvtier.toml"
        self.toml.write_text(
            f'deployment_id = "{deployment_id}"\n'
            # the service's own stack (replay, benchmarks): the smallest there is; engines'
            # namespaces get stacks of their own geometry
            "[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 8\n"
            "[cache]\nblock_size = 4\ndevice_blocks = 4\nhost_blocks = 4\n"
            + storage
            + '[workers]\ncount = 1\ndevice = "cpu"\n'
            '[admin]\nhost = "127.0.0.1"\nport = 0\nauth = "none"\n'
            f'[node]\nsocket = "{socket_path}"\nnamespace_quota_bytes = {quota_bytes}\n'
            f'events = {"true" if events else "false"}\nevents_interval_s = 0.02\n'
            f'handover = {"true" if handover else "false"}\n')
        self.deployment_id = deployment_id
        self.handover = handover
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0

    def start(self, timeout: float = 90.0, *extra: str) -> None:
        self.starts += 1
        log_path = self.workdir / f"serve-{self.starts}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["XDG_STATE_HOME"] = str(self.workdir / "state")
        env["TMPDIR"] = str(self.workdir)
        kvtier = Path(sys.executable).parent / "kvtier"
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen([str(kvtier), "serve", "--config", str(self.toml),
                                          *extra],
                                         stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = URL_LINE.search(log_path.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"kvtier serve did not start:\n{log_path.read_text()[-3000:]}")

    def take_over(self) -> float:
        """`kvtier serve --takeover` beside the running service (a planned upgrade): the
        new one is up, the old one handed over and exited; the seconds it took."""
        old, t = self.proc, time.monotonic()
        self.start(90.0, "--takeover")
        if old is not None:
            old.wait(60)
        return round(time.monotonic() - t, 2)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/status", timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out

    def kill(self) -> None:
        """SIGKILL of the service's whole process group (its workers too, as a machine
        crash would): the restarted service reclaims their names."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self) -> None:
        """SIGTERM, and the exit waited for (with node.handover: a planned restart)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        with contextlib.suppress(ProcessLookupError):
            if self.proc is not None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def engines(status: dict[str, Any]) -> list[dict[str, Any]]:
    """The engines the service's /status lists as attached."""
    node = status.get("node") or {}
    found: list[dict[str, Any]] = list(node.get("engines", []))
    return found


def loaded_tokens(serve: Serve, e: Engine) -> int:
    """The tokens the service has loaded for engine `e` from its host tier (its session's
    block loads; a new session after a restart starts from 0)."""
    mine = [s for s in engines(serve.status()) if s.get("pid") == e.pid]
    return int(mine[0]["loads"]) * vllm_offload.BLOCK if mine else 0


def same_prompts_served(serve: Serve, e: Engine, prompts: list[list[int]]
                        ) -> dict[str, Any]:
    """`e` serves the prompts in one batch: per request vLLM's cached tokens, the tokens
    the service loaded for them meanwhile (all of the cached tokens came from the node's host
    tier when the two sums agree), the outputs and the seconds it took."""
    t, before = time.monotonic(), loaded_tokens(serve, e)
    outs = e.batch(prompts)
    return {"outputs": outs, "host_tokens": [o["num_cached_tokens"] for o in outs],
            "loaded_tokens": loaded_tokens(serve, e) - before,
            "seconds": round(time.monotonic() - t, 2)}


def first_step_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest difference between the first generated token's top-5 logprobs of two
    outputs (inf when the top-5 tokens differ): the prefill's logits, a function of the
    prompt's KV alone. Exact equality is not asked of a batch: which requests of a batch of
    50 are scheduled together depends on when their host loads land, and a CPU matmul over
    another number of rows may round differently (one run's bitwise comparison of 50 prompts
    failed with every hit count equal); a wrong block moves them by far more."""
    sa, sb = a["logprobs"][0], b["logprobs"][0]
    if sa.keys() != sb.keys():
        return float("inf")
    return max((abs(v - sb[t]) for t, v in sa.items()), default=0.0)


def same_prompts_report(step: str, cold: dict[str, Any], before: dict[str, Any],
                        after: dict[str, Any]) -> dict[str, Any]:
    """Issue 37's "the hit rate of the requests after a planned restart equals that of the
    same requests before it": per request the host tokens before and after; whether every
    output equals its cold run exactly (`identical`, for the record), and the largest
    first-token logprob difference from the cold run (`first_step_max_abs_diff`)."""
    same = all(vllm_offload.compare(c, x)[0] and vllm_offload.compare(c, y)[0]
               for c, x, y in zip(cold["outputs"], before["outputs"], after["outputs"],
                                  strict=True))
    first = max((max(first_step_diff(c, x), first_step_diff(c, y))
                 for c, x, y in zip(cold["outputs"], before["outputs"], after["outputs"],
                                    strict=True)), default=0.0)
    return {"step": step, "prompts": len(cold["outputs"]),
            "cold_host_tokens": sum(cold["host_tokens"]),
            "before_host_tokens": before["host_tokens"],
            "after_host_tokens": after["host_tokens"],
            "before_loaded_tokens": before["loaded_tokens"],
            "after_loaded_tokens": after["loaded_tokens"], "identical": same,
            "first_step_max_abs_diff": first,
            "seconds": [cold["seconds"], before["seconds"], after["seconds"]]}


def corrupt(segments: list[str]) -> int:
    """Overwrite every page of these host pool segments (the service is not told)."""
    import mmap

    total = 0
    pattern = bytes(random.Random(7).randrange(256) for _ in range(4096))
    for name in segments:
        fd = os.open("/dev/shm" + name, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
            for off in range(0, size, 4096):
                n = min(4096, size - off)
                mm[off:off + n] = pattern[:n]
            mm.close()
            total += size
        finally:
            os.close(fd)
    return total


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")


# ------------------------------------------------------------------------ the scenario


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "kvtier-vllm-tiny-llama")
    vllm_offload.build_model(Path(model_dir))
    sock_dir = work / "run"
    sock_dir.mkdir(mode=0o700)
    socket_path = str(sock_dir / "node.sock")
    # --tenants: file storage (the warm and the clear) and the service's event stream (the
    # clear's removals announced)
    serve = Serve(work, socket_path, f"nodeex{os.getpid()}",
                  handover=args.kill_serve or args.restart_serve,
                  storage_path=str(work / "storage") if args.tenants else "",
                  events=args.tenants)
    started: list[Engine] = []
    report: dict[str, Any] = {}
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]

    def same_prompts_before() -> dict[str, Any]:
        """Before the last planned restart: B serves the repeat prompts cold (it stores
        them), then again (from the host tier): the figures to equal after it."""
        prompts = [[rng.randrange(VOCAB) for _ in range(REPEAT_PROMPT_TOKENS)]
                   for _ in range(args.repeat_prompts)]
        cold = same_prompts_served(serve, b, prompts)
        return {"prompts": prompts, "cold": cold,
                "before": same_prompts_served(serve, b, prompts)}

    def start_engine(name: str) -> Engine:
        e = Engine(name, socket_path, model_dir, work)
        started.append(e)
        return e

    try:
        t0 = time.monotonic()
        serve.start()
        a, b = start_engine("a"), start_engine("b")  # both load vLLM at once
        # each started with a host tier setting larger than this machine (defect 8)
        report["unowned_host_tiers"] = [e.read(START_TIMEOUT_S)["unowned_host_tier"]
                                        for e in (a, b)]
        report["engines_started_seconds"] = round(time.monotonic() - t0, 1)
        report["engines_seen_by_admin"] = len(wait_for(
            lambda: len(engines(serve.status())) >= 2 and engines(serve.status()), 30,
            "both engines in the service's /status"))

        # A cold, then B from the node's host tier
        p = prompt()
        cold = a.generate(p)
        warm_b = b.generate(p)
        same, diff = vllm_offload.compare(cold, warm_b)
        report.update({
            "instance_b_tokens_from_host": warm_b["num_cached_tokens"],
            "identical": same, "max_abs_logprob_diff": diff,
            "instance_a_cold_cached_tokens": cold["num_cached_tokens"],
            "engines": engines(serve.status()),
        })

        # negative control: the namespace's host pages overwritten before B loads Q
        q = prompt()
        cold_q = a.generate(q)
        b.send({"op": "pools"})
        segments = b.read(30)["segments"]
        report["corrupted_bytes"] = corrupt(segments)
        bad = b.generate(q)
        report["negative_control_tokens_from_host"] = bad["num_cached_tokens"]
        report["negative_control_identical"] = vllm_offload.compare(cold_q, bad)[0]
        report["negative_control_first_step_diff"] = first_step_diff(cold_q, bad)

        if args.tenants:
            report.update(tenant_phase(serve, a, b, prompt))

        if args.kill_a:
            r = prompt()
            cold_r = a.generate(r)
            batch = [prompt() for _ in range(6)]
            for tokens in batch:  # queued: A stores each as it serves them
                a.send({"op": "generate", "tokens": tokens})
            served = a.read(ANSWER_TIMEOUT_S)  # the first is served, the next under way
            a.kill()
            report["killed_a_pid"] = a.pid
            a2 = start_engine("a2")
            a2.read(START_TIMEOUT_S)
            again = a2.generate(r)
            report["after_kill_a_tokens_from_host"] = again["num_cached_tokens"]
            report["after_kill_a_identical"] = vllm_offload.compare(cold_r, again)[0]
            # the batch's first prompt, which A served (cold) and stored just before it was
            # killed: A' hits it, exactly
            first_batch = a2.generate(batch[0])
            report["after_kill_a_batch_tokens_from_host"] = first_batch["num_cached_tokens"]
            report["after_kill_a_batch_identical"] = vllm_offload.compare(served,
                                                                          first_batch)[0]
            report["engines_after_kill_a"] = sorted(
                e.get("pid", 0) for e in engines(serve.status()))
            a2.close()

        kept: dict[str, Any] | None = None
        if args.kill_serve or args.restart_serve:
            # K, served cold by B before the restart, then pushed out of B's 12-block device
            # cache (its next requests also carry the completions of K's stores): after the
            # restart B can have K only from the new service's host tier
            k = prompt()
            kept = {"cold": b.generate(k), "tokens": k}
            for _ in range(4):
                b.generate(prompt())
            time.sleep(0.5)
        # the same prompts before and after the last planned restart (the take-over's
        # when there is one)
        repeat = (same_prompts_before() if args.repeat_prompts and args.restart_serve
                  and not args.kill_serve and not args.takeover_serve else None)
        if args.restart_serve and not args.kill_serve:
            t = time.monotonic()
            serve.terminate()
            report["serve_stop_seconds"] = round(time.monotonic() - t, 2)
            serve.start()
            alive = 1 if args.kill_a else 2  # A was killed (A' closed): B alone
            wait_for(lambda: len(engines(serve.status())) >= alive, 60,
                     "the engines attached to the restarted service")
            report["restart_to_attached_seconds"] = round(time.monotonic() - t, 2)
        if args.kill_serve:
            s = prompt()
            b.send({"op": "generate", "tokens": s})
            serve.kill()
            t = time.monotonic()
            down = b.read(SERVE_DOWN_BOUND_S + ANSWER_TIMEOUT_S)
            report["serve_killed_request_seconds"] = round(time.monotonic() - t, 2)
            times = [report["serve_killed_request_seconds"]]
            for _ in range(2):  # served while the service is gone: recomputed
                t = time.monotonic()
                b.generate(prompt())
                times.append(round(time.monotonic() - t, 2))
            report["serve_down_request_seconds"] = times
            report["serve_down_bound_s"] = SERVE_DOWN_BOUND_S
            report["serve_down_tokens"] = len(down["tokens"])
            serve.start()
            wait_for(lambda: len(engines(serve.status())) >= 1, 60,
                     "B attached to the restarted service")
            report["engines_after_restart"] = len(engines(serve.status()))
        if kept is not None:
            # B serves K from the new service's host tier: what the restart kept. A session
            # is listed from its HELLO on, its namespace once the stack is up (and adopted):
            # that is waited for, then a moment for B's client to take the WELCOME
            wait_for(lambda: any(e.get("namespace") for e in engines(serve.status())), 120,
                     "B's namespace started on the restarted service")
            time.sleep(1.0)
            got = b.generate(kept["tokens"])
            ns = (serve.status().get("node") or {}).get("namespaces", [])
            report["restart_figures"] = ns[0]["restart"] if ns else None
            report["kept_blocks"] = ns[0]["restart"]["adopted"] if ns else 0
            report["kept_tokens_from_host"] = got["num_cached_tokens"]
            report["kept_identical"] = vllm_offload.compare(kept["cold"], got)[0]
        if repeat is not None:
            report["same_prompts"] = same_prompts_report(
                "restart", repeat["cold"], repeat["before"],
                same_prompts_served(serve, b, repeat["prompts"]))
        if args.kill_serve:
            # A prompt stored after the reattach and pushed out of B's device cache comes
            # back from the new service's host tier. Up to three prompts: in one CI run under
            # load the first prompt's store after a restart was lost (0 of 192 tokens from
            # the host, not reproduced on a quiet machine); the attempts are reported, and a
            # reattached engine that never hits still fails.
            attempts: list[int] = []
            for _ in range(3):
                u = prompt()
                first = b.generate(u)
                for _ in range(4):  # push U out of B's 12-block device cache
                    b.generate(prompt())
                second = b.generate(u)
                attempts.append(second["num_cached_tokens"])
                if second["num_cached_tokens"]:
                    break
            report["after_restart_attempts"] = attempts
            report["after_restart_tokens_from_host"] = second["num_cached_tokens"]
            report["after_restart_identical"] = vllm_offload.compare(first, second)[0]
        if args.takeover_serve:
            # T, served cold by B and pushed out of its device cache; then a new service
            # takes this one over (`kvtier serve --takeover`): B reattaches by itself and
            # can have T only from the new service's host tier
            tt = prompt()
            cold = b.generate(tt)
            for _ in range(4):
                b.generate(prompt())
            repeat = same_prompts_before() if args.repeat_prompts else None
            time.sleep(0.5)  # the completions of T's stores ride with B's requests
            report["takeover_seconds"] = serve.take_over()
            wait_for(lambda: any(e.get("namespace") for e in engines(serve.status())), 120,
                     "B attached to the service that took over")
            time.sleep(1.0)
            got = b.generate(tt)
            ns = (serve.status().get("node") or {}).get("namespaces", [])
            report["takeover_kept_blocks"] = ns[0]["restart"]["adopted"] if ns else 0
            report["takeover_tokens_from_host"] = got["num_cached_tokens"]
            report["takeover_identical"] = vllm_offload.compare(cold, got)[0]
            if repeat is not None:
                report["same_prompts"] = same_prompts_report(
                    "takeover", repeat["cold"], repeat["before"],
                    same_prompts_served(serve, b, repeat["prompts"]))
        report["seconds"] = round(time.monotonic() - t0, 1)
        return report
    finally:
        for e in started:
            e.close()
        serve.stop()
        if serve.handover:  # the last stop handed over too: nobody will adopt it
            from kvtier.manager.node.handover import unlink_kept

            unlink_kept(serve.deployment_id)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model-dir", default="", help="where the random model is built")
    ap.add_argument("--kill-a", action="store_true",
                    help="kill -9 engine A while it stores, then a new A' must hit exactly")
    ap.add_argument("--kill-serve", action="store_true",
                    help="kill -9 kvtier serve while B serves, restart it, B must hit again")
    ap.add_argument("--restart-serve", action="store_true",
                    help="SIGTERM kvtier serve (a planned restart, node.handover) and start "
                    "it again: B must load what A stored before, from the host tier")
    ap.add_argument("--takeover-serve", action="store_true",
                    help="then start `kvtier serve --takeover` beside the running service: "
                    "B must load what it stored before, from the new one's host tier")
    ap.add_argument("--repeat-prompts", type=int, default=REPEAT_PROMPTS, metavar="N",
                    help="with --restart-serve or --takeover-serve: B serves N short prompts "
                    "before the (last) planned restart and the same N after it; 0: none")
    ap.add_argument("--tenants", action="store_true",
                    help="tenants by cache_salt: B's pinned prompt survives A's flood")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--engine", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args.engine, args.model_dir)

    def stop(signum: int, frame: Any) -> None:  # SIGTERM: clean up as on any error
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    with tempfile.TemporaryDirectory(prefix="kvtier-node-") as tmp:
        report = run(args, Path(tmp))
    first = {k: report.pop(k) for k in ("instance_b_tokens_from_host", "identical",
                                         "engines_seen_by_admin")}
    report = {**first, **report}
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
