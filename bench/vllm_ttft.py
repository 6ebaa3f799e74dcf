"""Time to first token of a multi-turn chat on vLLM's CPU build: vLLM alone, vLLM + kvtier's host
tier, vLLM + kvtier's host tier (small) + file storage, in one run, interleaved.

The workload: `--conversations` chats share a system prompt; every turn appends a user message
and the model's answer to the chat's history and sends the whole history again. Chats take
turns round-robin, so by the time a chat comes back its history has long left vLLM's small
device pool (16 blocks of 32 tokens): vLLM alone recomputes it, kvtier serves it from host
memory or storage. Each configuration is one vLLM process (the tiny random Llama of
examples/vllm_offload.py); the driver sends each request to the three of them in turn, so a
slow moment of the machine hits all three alike. TTFT is the time of a 1-token generate;
"computed" is prompt tokens vLLM had to prefill (prompt - cached).

    make vllm-env && .venv-vllm/bin/python bench/vllm_ttft.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "vllm+kvtier host": {"host_blocks": 256, "storage_backend": "none"},
    "vllm+kvtier host+file": {"host_blocks": 32, "storage_backend": "file",
                              "prefetch_threshold": 32},
}


def child(extra_json: str) -> None:
    """One vLLM process: read {"tokens": [...]} lines, answer {"ttft_s", "cached"} lines."""
    import vllm_offload as ex
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = json.loads(extra_json)
    model = ex.build_model(Path(os.environ["TINY_LLAMA_DIR"]))
    kw: dict[str, Any] = {"model": str(model), "skip_tokenizer_init": True,
                          "enforce_eager": True, "dtype": "bfloat16", "block_size": 32,
                          "num_gpu_blocks_override": 16, "max_model_len": 480, "seed": 0}
    if extra is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                       "spec_module_path": "kvtier.integrations.vllm",
                                       "admin": False, **extra})
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["tokens"])], sp,
                           use_tqdm=False)[0]
        dt = time.perf_counter() - t
        print(json.dumps({"ttft_s": dt, "cached": int(out.num_cached_tokens or 0),
                          "next": int(out.outputs[0].token_ids[0])}), flush=True)


def workload(conversations: int, turns: int, seed: int) -> list[list[int]]:
    """Requests in arrival order (round-robin over chats), each the chat's whole history."""
    rng = random.Random(seed)
    system = [rng.randrange(512) for _ in range(96)]
    chats = [list(system) for _ in range(conversations)]
    out: list[list[int]] = []
    for _ in range(turns):
        for c in chats:
            c.extend(rng.randrange(512) for _ in range(40))  # the user's message
            out.append(list(c))
            c.extend(rng.randrange(512) for _ in range(24))  # the model's answer
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return 0
    requests = workload(args.conversations, args.turns, args.seed)
    tmp = tempfile.mkdtemp(prefix="kvtier-ttft-")
    env = dict(os.environ, TINY_LLAMA_DIR=os.path.join(tempfile.gettempdir(),
                                                           "kvtier-vllm-tiny-llama"),
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="ERROR")
    procs: dict[str, subprocess.Popen[str]] = {}
    log = open(os.path.join(tmp, "vllm.log"), "w")  # noqa: SIM115 (open for the children)
    for name, extra in CONFIGS.items():
        if extra is not None and extra.get("storage_backend") == "file":
            extra = dict(extra, storage_path=os.path.join(tmp, "storage"))
        procs[name] = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(extra)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert procs[name].stdout is not None
        ready = procs[name].stdout.readline()  # one at a time: starts do not overlap
        if not ready:
            raise SystemExit(f"{name}: the vLLM process did not start (log: {log.name})")
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in procs}
    try:
        for i, req in enumerate(requests):
            order = list(procs)
            random.Random(i).shuffle(order)  # interleaved, in a different order each time
            for name in order:
                p = procs[name]
                assert p.stdin is not None and p.stdout is not None
                p.stdin.write(json.dumps({"tokens": req}) + "\n")
                p.stdin.flush()
                r = json.loads(p.stdout.readline())
                r["prompt"] = len(req)
                results[name].append(r)
    finally:
        for p in procs.values():
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=60)
    base = results["vllm"]
    # the first turn of every chat is cold everywhere: report turns 2.. (the reuse)
    skip = args.conversations
    print(f"{len(requests)} requests ({args.conversations} chats x {args.turns} turns, "
          f"prompts {min(len(r) for r in requests)}..{max(len(r) for r in requests)} "
          f"tokens); vLLM device pool 16 x 32 tokens; turns 2.. reported")
    print(f"{'config':<24}{'TTFT mean ms':>14}{'p50 ms':>9}{'computed tok/req':>18}"
          f"{'TTFT vs vLLM':>14}{'same next token':>17}")
    base_mean = statistics.mean(r["ttft_s"] for r in base[skip:])
    for name, rs in results.items():
        rs = rs[skip:]
        mean = statistics.mean(r["ttft_s"] for r in rs)
        p50 = statistics.median(r["ttft_s"] for r in rs)
        computed = statistics.mean(r["prompt"] - r["cached"] for r in rs)
        same = sum(a["next"] == b["next"] for a, b in zip(rs, base[skip:], strict=True))
        print(f"{name:<24}{mean * 1e3:>14.2f}{p50 * 1e3:>9.2f}{computed:>18.1f}"
              f"{base_mean / mean:>13.2f}x{same:>12}/{len(rs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
