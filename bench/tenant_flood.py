"""A flood between two tenants of one node (issue 36, "Measure"): tenant B's hit rate and time
to first token with host quotas and a pinned system prompt, against without, in one run.

vLLM's CPU build, each configuration one vLLM process attached to its own real `kvtier
serve` (storage off: a hit is from the node's host tier), with the random-weight Llama of
bench/vllm_ttft_real.py (12 layers, hidden 1024, bf16: its prefill costs like a real one;
blocks of 64 tokens, vLLM's device pool 12 blocks). Each namespace holds `--host-blocks`
(32) host blocks. Tenants are vLLM's cache_salt ("a", "b").

Workload (ours, seeded): B sends its system prompt once (8 blocks), then per round
(`--rounds`, 30) A scans `--docs` (4) one-shot documents of 8 blocks and B asks one short
question behind the system prompt (1 block + 16 tokens). A round's documents (32 blocks)
fill the namespace and vLLM's device pool alike, so B's system prompt is gone from both
unless something keeps it.

    none     no quotas, no kv_hints: the namespace's own eviction order (LRU)
    steered  quotas A 20, B 12 blocks (POST /tenants/quota), every request carries a
             `kvtier.retain` v1 kv_hints action naming its tenant, and B's first request
             (the system prompt alone) pins it ({"pin": true, "tenant": "b"})

Every request goes to both configurations in a fresh shuffled order, so a slow moment of
the shared machine hits both alike. TTFT is the wall time of a 1-token greedy generate.
B's hit rate is the host tokens the service loaded (its `loaded_host` counter: A's
documents are one-shot, so every load is B's) over B's question tokens.

    make vllm-env && .venv-vllm/bin/python bench/tenant_flood.py          # ~3 min
    .venv-vllm/bin/python bench/tenant_flood.py --quick                   # 4 layers, ~2 min

Measured (2-core shared box, through /work/notes/s4/quiet, 10 rounds): B's hit rate 0.0%
without, 86.5% with quotas and the pin (the whole system prompt, each question); B's mean
TTFT 176.9 ms without, 48.0 ms with: 3.69x. 30 rounds at a busier moment: the same hit
rates, mean 683.0 against 409.9 ms (1.67x, outliers), p50 372.8 against 70.7 ms (README,
"Steering the cache").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_ttft_real import BLOCK, VOCAB, build_model, stop_children, tier_hits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import node_service

SYSTEM_BLOCKS = 8
DOC_BLOCKS = 8
QUESTION_TOKENS = BLOCK + 16
QUOTAS = {"a": 20, "b": 12}  # host blocks; they add up to the namespace's 32


def child(model_dir: str, device_blocks: int, socket_path: str) -> None:
    """One vLLM process attached to `socket_path`: read {"tokens", "salt", "retain"} lines
    (`retain`: a kvtier.retain v1 payload or null), answer one JSON line per request."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    max_len = (device_blocks - 1) * BLOCK
    spec = {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.integrations.vllm",
            "kvtier_serve": socket_path}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              block_size=BLOCK, num_gpu_blocks_override=device_blocks, max_model_len=max_len,
              max_num_batched_tokens=max_len, seed=0, kv_transfer_config=KVTransferConfig(
                  kv_connector="KvtierConnector",
                  kv_connector_module_path="kvtier.integrations.vllm", kv_role="kv_both",
                  kv_load_failure_policy="recompute", kv_connector_extra_config=spec))
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    engine = llm.llm_engine
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for n, line in enumerate(sys.stdin):
        req = json.loads(line)
        rid = f"r{n}"
        hints = None if req["retain"] is None else KvHintsEnvelope(
            protocol_version="1", message_id=rid, actions=[KvHintAction(
                action_id=rid, action_type="kvtier.retain", action_version="1",
                payload=req["retain"])])
        t = time.perf_counter()
        engine.add_request(rid, TokensPrompt(prompt_token_ids=req["tokens"],
                                             cache_salt=req["salt"]), sp, kv_hints=hints)
        cached = -1
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    cached = int(o.num_cached_tokens or 0)
        dt = time.perf_counter() - t
        print(json.dumps({"ttft_s": dt, "cached": cached}), flush=True)


class Served:
    """One configuration's `kvtier serve` (examples/node_service.py's `Serve`: storage off,
    admin on a loopback port without a token), its namespace quota `host_blocks` pages of
    this model (layers x K and V x 4 KV heads x 64 x BLOCK tokens x 2 bytes)."""

    def __init__(self, work: Path, name: str, host_blocks: int, layers: int) -> None:
        (work / "run").mkdir(parents=True, mode=0o700)
        self.socket_path = str(work / "run" / "node.sock")
        self.serve = node_service.Serve(work, self.socket_path,
                                        f"flood{name}{os.getpid()}",
                                        quota_bytes=host_blocks * layers * 2 * 4 * 64 * BLOCK * 2)
        self.serve.start()
        self.url = self.serve.url
        self.url_file = work / "serve-url"
        self.url_file.write_text(self.url)

    def stop(self) -> None:
        self.serve.stop()


def workload(rounds: int, docs: int, rng: random.Random) -> list[tuple[str, list[int]]]:
    """(tenant, tokens): B's system prompt, then per round A's documents and B's question."""
    def toks(n: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(n)]

    system = toks(SYSTEM_BLOCKS * BLOCK)
    out: list[tuple[str, list[int]]] = [("b", system)]
    for _ in range(rounds):
        out += [("a", toks(DOC_BLOCKS * BLOCK)) for _ in range(docs)]
        out.append(("b", system + toks(QUESTION_TOKENS)))
    return out


def post(url: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, 4 rounds")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--docs", type=int, default=4, help="A's documents per round")
    ap.add_argument("--host-blocks", type=int, default=32, help="each namespace's host blocks")
    ap.add_argument("--device-blocks", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(str(args.model_dir), args.device_blocks, args.child)
        return 0
    layers = 4 if args.quick else 12
    if args.quick:
        args.rounds = 4
    if sum(QUOTAS.values()) > args.host_blocks:
        raise SystemExit(f"--host-blocks {args.host_blocks}: the quotas need {QUOTAS}")
    requests = workload(args.rounds, args.docs, random.Random(args.seed))
    model = build_model(Path(tempfile.gettempdir()) / f"kvtier-llama-{layers}x1024", layers)
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-flood-"))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="ERROR")
    env = {k: v for k, v in env.items() if not k.startswith("KVTIER_")}
    log = open(tmp.with_suffix(".log"), "w")  # noqa: SIM115 (open for the children)
    serves: dict[str, Any] = {}
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        for name in ("none", "steered"):
            serves[name] = Served(tmp / name, name, args.host_blocks, layers)
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--child", serves[name].socket_path, "--model-dir",
                 str(model), "--device-blocks", str(args.device_blocks)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
            assert procs[name].stdout is not None
            if not procs[name].stdout.readline():
                raise SystemExit(f"{name}: the vLLM process did not start (log: {log.name})")
        url = serves["steered"].url
        [ns] = [n["namespace"] for n in get(url, "/status")["node"]["namespaces"]]
        for tenant, blocks in QUOTAS.items():
            post(url, "/tenants/quota", {"namespace": ns, "tenant": tenant,
                                         "quota_blocks": blocks})

        def ask(name: str, tenant: str, tokens: list[int], first: bool) -> dict[str, Any]:
            retain = None
            if name == "steered":
                retain = {"tenant": tenant, **({"pin": True} if first else {})}
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(json.dumps({"tokens": tokens, "salt": tenant, "retain": retain})
                          + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{name}: the vLLM process died (log: {log.name})")
            out: dict[str, Any] = json.loads(line)
            return out

        before = {n: tier_hits(s.url_file)[0] for n, s in serves.items()}
        res: dict[str, list[tuple[str, int, dict[str, Any]]]] = {n: [] for n in procs}
        loads: list[float] = []
        t0 = time.monotonic()
        for i, (tenant, tokens) in enumerate(requests):
            order = list(procs)
            random.Random(f"flood{i}").shuffle(order)
            for name in order:
                loads.append(os.getloadavg()[0])
                res[name].append((tenant, len(tokens), ask(name, tenant, tokens, i == 0)))
            if tenant == "b":
                print(f"round {i // (args.docs + 1)}/{args.rounds}", file=sys.stderr,
                      flush=True)
        host = {n: tier_hits(s.url_file)[0] - before[n] for n, s in serves.items()}
        figs = get(url, f"/tenants?namespace={ns}")[ns]
        print(report(args, res, host, figs, loads, time.monotonic() - t0), flush=True)
    finally:
        stop_children(procs)
        for s in serves.values():
            s.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(args: argparse.Namespace, res: dict[str, list[tuple[str, int, dict[str, Any]]]],
           host: dict[str, float], figs: dict[str, Any], loads: list[float],
           seconds: float) -> str:
    lines = [f"tenant flood: {args.rounds} rounds of {args.docs} one-shot documents of tenant A "
             f"({DOC_BLOCKS} blocks) and one question of tenant B ({SYSTEM_BLOCKS}-block "
             f"system prompt + {QUESTION_TOKENS} tokens); blocks of {BLOCK} tokens, "
             f"{args.host_blocks} host blocks per namespace, {args.device_blocks} device "
             f"blocks; {seconds:.0f} s, load average {statistics.mean(loads):.1f} "
             f"(max {max(loads):.1f})"]
    mean_b: dict[str, float] = {}
    for name, rows in res.items():
        qs = [r for r in rows[1:] if r[0] == "b"]  # B's questions (its first request: cold)
        docs = [r for r in rows if r[0] == "a"]
        b_tokens = sum(n for _, n, _ in qs)
        mean_b[name] = statistics.mean(r[2]["ttft_s"] for r in qs)
        lines.append(
            f"  {name:8s} B: hit rate {host[name] / b_tokens:6.1%} (host tokens "
            f"{host[name]:.0f} of {b_tokens}; vLLM's cached tokens "
            f"{sum(r[2]['cached'] for r in qs)}), mean TTFT {mean_b[name] * 1e3:7.1f} ms, "
            f"p50 {statistics.median(r[2]['ttft_s'] for r in qs) * 1e3:7.1f} ms | A: mean TTFT "
            f"{statistics.mean(r[2]['ttft_s'] for r in docs) * 1e3:7.1f} ms, cached tokens "
            f"{sum(r[2]['cached'] for r in docs)}")
    lines.append(f"  B's mean TTFT none / steered: {mean_b['none'] / mean_b['steered']:.2f}x")
    lines.append("  steered tenants: " + ", ".join(
        f"{t or '(default)'}: {f['host_blocks']} host blocks, {f['pinned_blocks']} pinned, "
        f"{f['evictions']} evictions, {f['stores_refused']} stores refused"
        for t, f in sorted(figs.items())))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
