"""Time to first token of a prefix that left vLLM's device cache: vLLM alone (recomputes it),
vLLM with its own kvtier (embedded) and vLLM attached to the node's `kvtier serve`, in one run,
interleaved. Runs in the vLLM environment (`.venv-vllm/bin/python bench/node_ttft.py`).

The model is a random-weight Llama whose prefill costs what a real one's does on these cores
(12 layers, hidden 1024, 16 heads, 8 KV heads, bf16; vLLM's CPU build). Three engine processes
(this file with `--engine ARM`) start side by side; each round, in a rotating order, every
engine serves a new 320-token prompt P cold, three other prompts (its 24-block device cache
loses P), then P again: the second P's first token is timed (max_tokens = 1, wall time of
vLLM's `generate` in the engine process) with the tokens vLLM reports cached. Storage is off:
a hit comes from the host tier (the engine's own or the node's). Prints one JSON object last
(medians per arm, ratios to vLLM alone, the load average).

This is the small comparison of issue 19; `bench/vllm_ttft.py` is the bigger vLLM benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PYTHONHASHSEED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import node_service

BLOCK = 32
PROMPT = 320  # 10 blocks
DEVICE_BLOCKS = 24
VOCAB = 512
ARMS = ("vllm", "embedded", "attached")


def build_model(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                      max_position_embeddings=1024)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def engine_main(arm: str, model_dir: str, socket_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kt = None
    if arm != "vllm":
        extra: dict[str, Any] = (
            {"kvtier_serve": socket_path} if arm == "attached" else
            {"host_blocks": 256, "storage_backend": "none", "admin": False})
        kt = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                       "spec_module_path": "kvtier.integrations.vllm",
                                       **extra})
    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              block_size=BLOCK, num_gpu_blocks_override=DEVICE_BLOCKS, max_model_len=512,
              kv_transfer_config=kt, seed=0)
    sp = SamplingParams(max_tokens=1, temperature=0.0)

    def answer(obj: dict[str, Any]) -> None:
        sys.stdout.write(node_service.MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] != "generate":
            break
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=cmd["tokens"])], sp, use_tqdm=False)
        seconds = time.perf_counter() - t
        answer({"seconds": seconds, "num_cached_tokens": int(out[0].num_cached_tokens or 0),
                "tokens": list(out[0].outputs[0].token_ids)})
    return 0


class BenchEngine(node_service.Engine):
    """node_service's engine child, running this file's engine instead."""

    def __init__(self, arm: str, model_dir: str, socket_path: str, log_dir: Path) -> None:
        import subprocess
        import threading

        self.name = arm
        self.log_path = log_dir / f"engine-{arm}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, "--engine", arm, "--model-dir", model_dir,
                 "--socket", socket_path],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                bufsize=1)
        self.pid = self.proc.pid
        self._lines = node_service.queue.Queue()
        threading.Thread(target=self._reader, daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                        "kvtier-bench-llama12"))
    ap.add_argument("--engine", default="", help=argparse.SUPPRESS)
    ap.add_argument("--socket", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine:
        return engine_main(args.engine, args.model_dir, args.socket)
    build_model(Path(args.model_dir))
    rng = random.Random(3)
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as tmp:
        work = Path(tmp)
        (work / "run").mkdir(mode=0o700)
        sock = str(work / "run" / "node.sock")
        serve = node_service.Serve(work, sock, f"ttft{os.getpid()}")
        serve.toml.write_text(serve.toml.read_text().replace(
            f"namespace_quota_bytes = {64 << 20}", f"namespace_quota_bytes = {256 << 20}"))
        engines: dict[str, BenchEngine] = {}
        try:
            serve.start()
            for arm in ARMS:
                engines[arm] = BenchEngine(arm, args.model_dir, sock, work)
            for e in engines.values():
                e.read(600)
            warm: dict[str, list[float]] = {a: [] for a in ARMS}
            cold: dict[str, list[float]] = {a: [] for a in ARMS}
            cached: dict[str, list[int]] = {a: [] for a in ARMS}
            same: dict[str, bool] = dict.fromkeys(ARMS, True)
            for r in range(args.rounds):
                order = ARMS[r % 3:] + ARMS[:r % 3]
                for arm in order:
                    e = engines[arm]
                    p = [rng.randrange(VOCAB) for _ in range(PROMPT)]
                    first = e.generate(p, timeout=600)
                    for _ in range(3):
                        e.generate([rng.randrange(VOCAB) for _ in range(PROMPT)], timeout=600)
                    again = e.generate(p, timeout=600)
                    cold[arm].append(first["seconds"])
                    warm[arm].append(again["seconds"])
                    cached[arm].append(again["num_cached_tokens"])
                    same[arm] = same[arm] and first["tokens"] == again["tokens"]
        finally:
            for e in engines.values():
                e.close()
            serve.stop()
    med = {a: statistics.median(warm[a]) for a in ARMS}
    report = {
        "warm_ttft_median_s": {a: round(med[a], 4) for a in ARMS},
        "cold_ttft_median_s": {a: round(statistics.median(cold[a]), 4) for a in ARMS},
        "warm_cached_tokens": cached, "first_token_same": same,
        "ratio_to_vllm_alone": {a: round(med[a] / med["vllm"], 3) for a in ARMS},
        "attached_over_embedded": round(med["attached"] / med["embedded"], 3),
        "rounds": args.rounds, "prompt_tokens": PROMPT,
        "model": "llama 12 layers, hidden 1024, 16 heads, 8 kv heads, bf16, random",
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
