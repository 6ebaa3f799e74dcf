"""kvtier's tiers in vLLM's KV events: what a cache-aware router subscribed to vLLM sees.

Runs in the vLLM environment (`make vllm-env` builds `.venv-vllm`). One in-process vLLM (CPU
build, the tiny random Llama of examples/vllm_offload.py, 12 device blocks of 32 tokens) with
kvtier embedded (a host tier of 16 blocks, file storage) and vLLM's KV-event publisher on
(ZMQ PUB connecting to a loopback port the subscriber binds, its replay socket
on another). A subscriber in this process decodes
every batch with vLLM's own classes (`msgspec.msgpack.Decoder(type=KVEventBatch)`) and
rebuilds, per medium, the set of blocks the instance says it holds. The run:

1. six prompts of 6 full blocks each: 36 blocks for a 16-block host tier, so kvtier evicts
   host copies (`BlockRemoved`, medium CPU) and backs every block up to storage (`BlockStored`,
   medium STORAGE);
2. the first prompt again (served from storage: its blocks come back to the host tier);
3. a page lost by the backend (the second prompt's page files deleted behind kvtier's back,
   as a Redis TTL would): the second prompt again finds its first block gone (STORAGE
   removed), is computed and stored again;
4. vLLM's own `reset_prefix_cache(reset_connector=True)` (kvtier's host tier emptied; vLLM's
   connector forgets every block's tokens), then the first prompt again from storage (its
   CPU stores are published once vLLM knows their tokens again);
5. kvtier's sampled audit at 1 in 1 (issue 40) with the first prompt's host pages overwritten
   behind kvtier's back: vLLM's device cache reset (kvtier's kept), the prompt again is
   recomputed and compared, every block mismatches and is removed from the node: CPU and
   STORAGE removals, and kvtier holds none of its blocks on the host or in storage;
6. kvtier's worker killed (its host copies die with it: every CPU block removed);
7. `POST /reset` on kvtier's admin (the host tier emptied again).

At each checkpoint (the backups landed, one step run so kvtier's events are taken) the sets
rebuilt from the events are compared with what kvtier holds: the host tier's ready copies
(read from kvtier's tree) and the storage pages (files named by each block's storage key) of
every block the prompts made. Also checked on every CPU / STORAGE `BlockStored`: token ids for
each block, vLLM's block size, a parent already announced, no `ownership`, locality not
remote (what Dynamo's KV indexer needs to index a block), and on every CPU / STORAGE
`BlockRemoved` that the block was announced in that medium.

`--attached`: the same instance attached to a `kvtier serve` (its namespace's host tier of
16 blocks, file storage, the service's own KV-event publisher on) instead of embedding
kvtier: vLLM's own stream now carries the node's tiers as this engine is served from them.
The truth at each checkpoint is the service's: its own stream's sets for the namespace
(CPU and STORAGE, by block hash), the namespace's host blocks in use from its `/status`
(their count), and the page files in its storage folder. The run: the six prompts, the
first again, pages lost and the second again, vLLM's own reset and the first again, the
audit's mismatch (the namespace's whole host pool overwritten: the service removes the
audited blocks through the REMOVE op); then a
second engine of the namespace (a `NodeClient` in this process: it stores the blocks of a
seventh prompt, never writing their pages; only events are looked at) — those blocks are in
the node's host tier, but this vLLM has never seen their tokens, so its stream holds them back
(`held_back`) until it serves that prompt (a host hit: then they are announced, with tokens);
last `POST /reset` on the service. (A worker kill is left to the embedded run: the
namespace's workers are the service's own processes.)

`--drop-removed-on-evict` is the break check: removed events of evicted host copies are
dropped before vLLM sees them, and `events_match_state` must come out false.

The last line of output is one JSON object (with `--json`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_offload import BLOCK, VOCAB, build_model, kvtier_manager, worker_pids

HOST_BLOCKS = 16
PROMPT_TOKENS = 200  # 6 full blocks of 32 + 8
PROMPTS = 6
MEDIA = ("CPU", "STORAGE")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Subscriber:
    """A router's view of one instance: per medium, the blocks (vLLM's external block hashes)
    announced stored and not removed since, rebuilt from vLLM's ZMQ stream."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        # vLLM's publisher connects to a loopback endpoint (it binds only wildcard ones), so
        # the subscriber binds it: no port open beyond this machine
        self.sock.bind(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.held: dict[str, set[int]] = {m: set() for m in MEDIA}
        self.counts = {"stored": 0, "removed": 0, "cleared": 0, "batches": 0}
        self.by_medium: dict[str, dict[str, int]] = {}
        self.problems: list[str] = []
        self.known: set[int] = set()  # every hash announced in any medium (parents)
        self.last = time.monotonic()
        self.seq = -1
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while not self._stop:
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                try:
                    batch = self.decoder.decode(frames[-1])
                except Exception as e:  # a batch vLLM's own classes cannot read
                    self.problems.append(f"undecodable batch: {e}")
                    continue
                seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else -1
                if self.seq >= 0 and seq != self.seq + 1:
                    self.problems.append(f"sequence gap {self.seq} -> {seq}")
                self.seq = seq
                self.counts["batches"] += 1
                self.last = time.monotonic()
                for ev in batch.events:
                    try:
                        self._apply(ev)
                    except Exception as e:
                        self.problems.append(f"event {type(ev).__name__}: {e!r}")

    def _apply(self, ev: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

        if isinstance(ev, AllBlocksCleared):
            self.counts["cleared"] += 1
            return
        medium = ev.medium or "GPU"
        kind = "stored" if isinstance(ev, BlockStored) else "removed"
        self.by_medium.setdefault(medium, {"stored": 0, "removed": 0})[kind] += len(
            ev.block_hashes)
        if isinstance(ev, BlockStored):
            if medium in MEDIA:
                self.counts["stored"] += len(ev.block_hashes)
                self._check_stored(ev)
            self.known.update(ev.block_hashes)
            if medium in self.held:
                self.held[medium].update(ev.block_hashes)
        else:
            if medium in MEDIA:
                self.counts["removed"] += len(ev.block_hashes)
                unknown = set(ev.block_hashes) - self.held[medium]
                if unknown:
                    self.problems.append(f"{medium} removal of {len(unknown)} blocks never "
                                         "announced there")
            if medium in self.held:
                self.held[medium].difference_update(ev.block_hashes)

    def _check_stored(self, ev: Any) -> None:
        """What Dynamo's indexer needs of a stored event to index it."""
        n = len(ev.block_hashes)
        if ev.block_size != BLOCK:
            self.problems.append(f"{ev.medium} block_size {ev.block_size}")
        if len(ev.token_ids) != n * BLOCK:
            self.problems.append(f"{ev.medium} {len(ev.token_ids)} token ids for {n} blocks")
        if ev.parent_block_hash is not None and ev.parent_block_hash not in self.known:
            self.problems.append(f"{ev.medium} parent {ev.parent_block_hash} never announced")
        if ev.ownership is not None:
            self.problems.append(f"{ev.medium} ownership {ev.ownership!r}")
        if ev.locality == "REMOTE":
            self.problems.append(f"{ev.medium} locality REMOTE")

    def quiet(self, for_s: float = 0.6, timeout: float = 20.0) -> None:
        """Wait until no batch arrived for `for_s` seconds (the last step's batch is sent
        by vLLM's publisher thread after `generate` returns: wait that long first)."""
        time.sleep(for_s)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if time.monotonic() - self.last >= for_s:
                    return
            time.sleep(0.05)

    def snapshot(self) -> tuple[dict[str, set[int]], dict[str, dict[str, int]]]:
        with self._lock:
            return ({m: set(s) for m, s in self.held.items()},
                    {m: dict(c) for m, c in self.by_medium.items()})

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


def block_hashes(llm: Any, tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes of the full blocks of `tokens` (its configured algorithm)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    parent = None
    out: list[bytes] = []
    for i in range(len(tokens) // BLOCK):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        out.append(bytes(parent))
    return out


def external(h: bytes) -> int:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    v = maybe_convert_block_hash(h)  # type: ignore[arg-type]
    return v if isinstance(v, int) else int.from_bytes(v, "big")


def kvtier_holds(llm: Any, hashes: list[bytes], storage: Path) -> dict[str, set[int]]:
    """What kvtier holds per medium among `hashes`: host = a ready copy in its tree (HIT),
    storage = a page file named by the block's storage key."""
    from kvtier.manager.core.nodes import ENGINE_WRITE, PREFETCHING
    from kvtier.manager.keyed import engine_key
    from vllm.v1.kv_offload.base import make_offload_key

    manager = kvtier_manager(llm)
    keyed = manager.cache.cache
    pages = {p.name for p in storage.glob("**/*") if p.is_file()}
    host: set[int] = set()
    stored: set[int] = set()
    with keyed.m.lock:
        for h in hashes:
            node = keyed.m.lookup(engine_key(h))
            if (node is not None and node.host is not None
                    and not node.flags & (ENGINE_WRITE | PREFETCHING)):
                host.add(external(h))
    for h in hashes:
        if manager.storage_key(make_offload_key(h, 0)).hex() in pages:
            stored.add(external(h))
    return {"CPU": host, "STORAGE": stored}


def overwrite_host_pages(llm: Any, hashes: list[bytes] | None) -> int:
    """Overwrite host pages (rank 0) with other finite bf16 values (kvtier is not told):
    those of `hashes` (embedded: read from kvtier's tree), or every page of the pool (None:
    attached, the tree is the service's). Returns how many pages."""
    from kvtier.engine.geometry import kv_shape
    from kvtier.manager.keyed import engine_key
    from kvtier.worker.kv_pools import HostPool

    manager = kvtier_manager(llm)
    pools = manager.cache.host_pools()
    pool = HostPool.attach(pools.segments[0].name, kv_shape(manager.cfg))
    try:
        if hashes is None:
            ids = list(range(pool.data.shape[0]))
        else:
            keyed = manager.cache.cache
            with keyed.m.lock:
                ids = [n.host for h in hashes for n in (keyed.m.lookup(engine_key(h)),)
                       if n is not None and n.host is not None]
        for i in ids:
            pool.data[i].fill_(0x3C)  # bf16 0x3c3c: 0.0115, a valid-looking value
    finally:
        pool.close()
    return len(ids)


def audit_mismatch(llm: Any, manager: Any, prompt: list[int], run: Callable[[list[int]], None],
                   attached: bool) -> dict[str, Any]:
    """kvtier's audit at 1 in 1 over `prompt` after its host pages were overwritten (vLLM's
    device cache reset, kvtier's kept, so the prompt hits kvtier): every block it holds
    mismatches and is removed from the node. Returns the pages overwritten and the
    mismatches by tier."""
    overwritten = overwrite_host_pages(llm, None if attached else block_hashes(llm, prompt))
    if not llm.reset_prefix_cache():  # vLLM's device cache only
        raise SystemExit("vLLM's reset_prefix_cache failed")
    manager.audit.sampler.rate = 1.0
    run(prompt)
    manager.audit.sampler.rate = 0.0
    return {"overwritten_pages": overwritten,
            "mismatch": manager.audit.figures.status()["blocks"].get("mismatch", {})}


def start_llm(model: Path, connector: dict[str, Any], endpoint: str, replay: int,
              drop_removed_on_evict: bool) -> tuple[Any, Any]:
    """vLLM with kvtier (`connector`: the connector's own keys) and vLLM's ZMQ KV-event
    publisher on `endpoint` (replay on `replay`); returns it and kvtier's offloading manager.
    `drop_removed_on_evict`: the break check, host removals never reach vLLM."""
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kt = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm", **connector})
    ev = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                        replay_endpoint=f"tcp://127.0.0.1:{replay}")
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", block_size=BLOCK, num_gpu_blocks_override=12,
              max_model_len=320, kv_transfer_config=kt, kv_events_config=ev, seed=0)
    manager = kvtier_manager(llm)
    if drop_removed_on_evict:
        take = manager.take_events

        def without_evictions() -> Any:
            for e in take():
                if not (e.removed and e.medium.value == "CPU"):
                    yield e

        manager.take_events = without_evictions
    return llm, manager


def first_checkpoints(llm: Any, manager: Any, prompts: list[list[int]], storage: Path,
                      run: Callable[[list[int]], None], check: Callable[[str], None]) -> None:
    """The checkpoints both runs share: the prompts (host evictions, every block backed up),
    the first again, the second's page files lost behind kvtier's back and the prompt again,
    vLLM's own reset and the first prompt again."""
    from vllm.v1.kv_offload.base import make_offload_key

    for p in prompts:
        run(p)
    check("after six prompts")
    run(prompts[0])
    check("first prompt again")
    lost = {manager.storage_key(make_offload_key(h, 0)).hex()
            for h in block_hashes(llm, prompts[1])}
    for page in [p for p in storage.glob("**/*") if p.name in lost]:
        page.unlink()  # the backend lost them (as a Redis TTL drops a page)
    run(prompts[1])
    check("pages lost, second prompt again")
    if not llm.reset_prefix_cache(reset_connector=True):
        raise SystemExit("vLLM's reset_prefix_cache failed")
    run(prompts[0])
    check("vLLM's reset, first prompt again")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model-dir", default="", help="where the random model is built")
    ap.add_argument("--drop-removed-on-evict", action="store_true",
                    help="break check: drop the removed events of evicted host copies")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--attached", action="store_true",
                    help="attach to a kvtier serve (started here) instead of embedding kvtier")
    args = ap.parse_args(argv)
    if args.attached:
        return attached_main(args)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model = build_model(Path(args.model_dir or os.path.join(
        tempfile.gettempdir(), "kvtier-vllm-tiny-llama")))
    with tempfile.TemporaryDirectory(prefix="kvtier-events-") as tmp:
        url_file = Path(tmp) / "admin-url"
        storage = Path(tmp) / "storage"
        pub, replay = free_port(), free_port()
        endpoint = f"tcp://127.0.0.1:{pub}"
        sub = Subscriber(endpoint)
        llm, manager = start_llm(model, {
            "host_blocks": HOST_BLOCKS, "storage_backend": "file", "storage_path": str(storage),
            "prefetch_threshold": BLOCK, "admin_port": 0, "admin_auth": "none",
            "admin_url_file": str(url_file)}, endpoint, replay, args.drop_removed_on_evict)
        url = url_file.read_text().strip()
        rng = random.Random(args.seed)
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        seen: list[bytes] = []

        def run(tokens: list[int]) -> None:
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
            for h in block_hashes(llm, tokens + list(out.outputs[0].token_ids)):
                if h not in seen:
                    seen.append(h)

        def settle() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # backups to storage land
                with urllib.request.urlopen(url + "/status", timeout=10) as r:
                    if not json.loads(r.read()).get("tasks_inflight", 0):
                        break
                time.sleep(0.1)
            # one engine step with no full block, so kvtier's events are taken and published
            llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB)] * 3)],
                         SamplingParams(max_tokens=1), use_tqdm=False)
            sub.quiet()

        checkpoints: list[dict[str, Any]] = []

        def check(name: str) -> None:
            settle()
            rebuilt, counts = sub.snapshot()
            holds = kvtier_holds(llm, seen, storage)
            per = {m: {"events": len(rebuilt[m]), "kvtier": len(holds[m]),
                       "match": rebuilt[m] == holds[m]} for m in MEDIA}
            checkpoints.append({"at": name, **per, "counts": counts})

        prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
        first_checkpoints(llm, manager, prompts, storage, run, check)
        # the audit catches the first prompt's overwritten host pages and removes its blocks
        # from the node: removals for CPU and STORAGE reach the router
        audit = audit_mismatch(llm, manager, prompts[0], run, attached=False)
        check("audit mismatch, first prompt again")
        checkpoints[-1]["audit"] = audit
        pids = worker_pids(url)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # kvtier replaces its worker
            with urllib.request.urlopen(url + "/status", timeout=10) as r:
                workers = json.loads(r.read()).get("workers", [])
            if workers and all(w.get("state") == "ready" and int(w.get("pid") or 0) not in pids
                               for w in workers):
                break
            time.sleep(0.1)
        else:
            raise SystemExit("kvtier's worker was not replaced in 60 s")
        check("worker killed")
        run(prompts[2])
        req = urllib.request.Request(url + "/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        check("after POST /reset")
        sub.close()
        report: dict[str, Any] = {
            "events_match_state": all(c[m]["match"] for c in checkpoints for m in MEDIA),
            "media": sorted(m for m in sub.by_medium if m in MEDIA),
            "stored": sub.counts["stored"], "removed": sub.counts["removed"],
            "by_medium": sub.by_medium, "batches": sub.counts["batches"],
            "usable_by_indexer": not sub.problems, "problems": sub.problems[:10],
            "checkpoints": checkpoints, "blocks": len(seen),
            "break_check": args.drop_removed_on_evict,
        }
        llm.llm_engine.engine_core.shutdown()
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


def service_sets(sub: Any, namespace: str) -> dict[str, set[int]]:
    """The service's own stream (`node.events`) for one namespace, by vLLM's external hash."""
    got = sub.topics()
    return {"CPU": {external(h) for h in got.get(f"kvtier/host/{namespace}", ())},
            "STORAGE": {external(h) for h in got.get(f"kvtier/storage/{namespace}", ())}}


class ServiceSubscriber:
    """The service's own KV-event stream (`<prefix>/<tier>/<namespace>` topics, block hashes
    as bytes), per topic the blocks stored and not removed since."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.sets: dict[str, set[bytes]] = {}
        self.problems: list[str] = []
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq
        from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

        while not self._stop:
            try:
                topic, _, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            with self._lock:
                held = self.sets.setdefault(topic.decode(), set())
                for ev in self.decoder.decode(payload).events:
                    if isinstance(ev, AllBlocksCleared):
                        held.clear()
                    elif isinstance(ev, BlockStored):
                        held.update(ev.block_hashes)
                    else:
                        held.difference_update(ev.block_hashes)

    def topics(self) -> dict[str, set[bytes]]:
        with self._lock:
            return {t: set(s) for t, s in self.sets.items()}

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close(linger=0)


def attached_main(args: argparse.Namespace) -> int:
    """The `--attached` run (see the module docstring)."""
    import node_service
    from kvtier.engine.node_client import NodeClient
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_offload.base import make_offload_key

    model = build_model(Path(args.model_dir or os.path.join(
        tempfile.gettempdir(), "kvtier-vllm-tiny-llama")))
    work = Path(tempfile.mkdtemp(prefix="kve", dir="/tmp"))  # a short socket path
    serve: Any = None
    llm: Any = None
    other: Any = None
    sub: Subscriber | None = None
    ssub: ServiceSubscriber | None = None
    try:
        sock_dir = work / "run"
        sock_dir.mkdir(mode=0o700)
        storage = work / "storage"
        # the tiny Llama's page: 2 layers x (K, V) x 2 heads x 64 x 32 tokens x 2 bytes
        page = 2 * 2 * 2 * 64 * BLOCK * 2
        serve = node_service.Serve(work, str(sock_dir / "node.sock"), f"kvev{os.getpid()}",
                                   storage_path=str(storage), quota_bytes=HOST_BLOCKS * page,
                                   events=True)
        serve.start()
        ssub = ServiceSubscriber(f"ipc://{sock_dir / 'events.pub'}")
        pub, replay = free_port(), free_port()
        endpoint = f"tcp://127.0.0.1:{pub}"
        sub = Subscriber(endpoint)
        llm, manager = start_llm(model, {
            "kvtier_serve": str(sock_dir / "node.sock"), "prefetch_threshold": BLOCK},
            endpoint, replay, args.drop_removed_on_evict)
        client = manager.cache
        namespace = client.hello.namespace
        rng = random.Random(args.seed)
        sp = SamplingParams(max_tokens=4, temperature=0.0)
        seen: list[bytes] = []

        def run(tokens: list[int]) -> None:
            out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
            for h in block_hashes(llm, tokens + list(out.outputs[0].token_ids)):
                if h not in seen:
                    seen.append(h)

        def truth() -> dict[str, Any]:
            svc = service_sets(ssub, namespace)
            pages = {p.name for p in storage.glob("**/*") if p.is_file()}
            files = {external(h) for h in seen
                     if manager.storage_key(make_offload_key(h, 0)).hex() in pages}
            [ns] = [n for n in serve.status()["node"]["namespaces"]
                    if n["namespace"] == namespace]
            used = ns["used_bytes"] // (ns["host_bytes"] // ns["host_blocks"])
            return {"svc": svc, "files": files, "used": used}

        checkpoints: list[dict[str, Any]] = []

        def check(name: str, timeout: float = 20.0) -> None:
            """Bounded: one engine step (kvtier's events taken and published by vLLM) and a
            comparison, until vLLM's sets equal the service's or `timeout` passes."""
            deadline = time.monotonic() + timeout
            while True:
                llm.generate([TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB)] * 3)],
                             SamplingParams(max_tokens=1), use_tqdm=False)
                sub.quiet(0.3)
                rebuilt, counts = sub.snapshot()
                t = truth()
                held_back = held_hashes(manager)
                want = {m: t["svc"][m] - held_back[m] for m in MEDIA}
                per = {m: {"events": len(rebuilt[m]), "kvtier": len(t["svc"][m]),
                           "match": rebuilt[m] == want[m]} for m in MEDIA}
                per["CPU"]["host_blocks_used"] = t["used"]
                per["CPU"]["match"] &= len(t["svc"]["CPU"]) == t["used"]
                per["STORAGE"]["files"] = len(t["files"])
                per["STORAGE"]["match"] &= t["files"] == t["svc"]["STORAGE"] & {
                    external(h) for h in seen}
                if all(per[m]["match"] for m in MEDIA) or time.monotonic() > deadline:
                    checkpoints.append({"at": name, **per,
                                        "held_back": {m: len(held_back[m]) for m in MEDIA},
                                        "counts": counts})
                    return

        prompts = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
                   for _ in range(PROMPTS + 1)]
        first_checkpoints(llm, manager, prompts[:PROMPTS], storage, run, check)
        # the audit, attached: the service removes the mismatched blocks (the REMOVE op)
        audit = audit_mismatch(llm, manager, prompts[0], run, attached=True)
        check("audit mismatch, first prompt again")
        checkpoints[-1]["audit"] = audit
        # a second engine of the namespace stores the seventh prompt's blocks
        other = NodeClient(client.path, client.hello)
        theirs = block_hashes(llm, prompts[PROMPTS])
        deadline = time.monotonic() + 20
        while (plan := other.prepare_store(theirs)) is None or len(plan.keys) != len(theirs):
            if plan is not None:  # a part planned: given back as failed, asked again whole
                other.complete_store(plan.keys, ok=False)
            if time.monotonic() > deadline:  # (refused while backups are in flight)
                raise SystemExit(f"the second engine's store was refused: {plan}")
            time.sleep(0.1)
        other.complete_store(plan.keys)
        other.end_step()
        check("another engine stored a prompt")
        run(prompts[PROMPTS])
        check("this vLLM served the other engine's prompt")
        req = urllib.request.Request(serve.url + "/reset", method="POST", data=b"")
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        check("after POST /reset")
        report: dict[str, Any] = {
            "mode": "attached",
            "events_match_state": all(c[m]["match"] for c in checkpoints for m in MEDIA),
            "media": sorted(m for m in sub.by_medium if m in MEDIA),
            "stored": sub.counts["stored"], "removed": sub.counts["removed"],
            "by_medium": sub.by_medium, "batches": sub.counts["batches"],
            "usable_by_indexer": not sub.problems, "problems": sub.problems[:10],
            "checkpoints": checkpoints, "blocks": len(seen),
            "break_check": args.drop_removed_on_evict,
        }
    finally:
        if other is not None:
            other.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        for s in (sub, ssub):
            if s is not None:
                s.close()
        if serve is not None:
            serve.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2))
    return 0


def held_hashes(manager: Any) -> dict[str, set[int]]:
    """Per medium, the blocks kvtier reported stored that vLLM's stream holds back for want
    of their tokens (`kv_events.EventRelay.held`), by vLLM's external hash."""
    from vllm.v1.kv_offload.base import get_offload_block_hash

    out: dict[str, set[int]] = {m: set() for m in MEDIA}
    relay = manager._events
    for key, media in ({} if relay is None else relay.held).items():
        for medium in media:
            out[medium.value].add(external(get_offload_block_hash(key)))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
