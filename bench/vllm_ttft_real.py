"""Time to first token that users feel: vLLM's CPU build with a model whose prefill costs like a
real one, vLLM alone against vLLM + kvtier, on a low-reuse and a high-reuse workload.

The model: a random-weight Llama (12 layers, hidden 1024, 16 heads, 4 KV heads, bf16; built
once in the temp dir). Blocks of 64 tokens. vLLM's device pool (`--device-blocks`, 12 blocks)
is >= 8x smaller than each workload's working set, except in the bound configuration whose
pool holds everything. Every configuration is its own vLLM process (`CONFIGS`, one entry
each); the driver sends every request to all of them in a fresh shuffled order, so a slow
moment of the machine (other jobs share these 2 cores) hits them alike. Both workloads run
through the same processes, low reuse first.

Workloads (ours, seeded):
* low reuse: independent documents behind one 64-token system prompt (ideal reuse ~10%, all
  of it the system prompt vLLM keeps on its own device);
* high reuse: multi-turn chats round-robin, each turn the whole history again (ideal reuse
  65% with the defaults): by the time a chat comes back its history has left vLLM's device pool;
* hot set (`--workload hot`, alone): one-shot documents passing over a few hot documents, for
  the host tier's eviction order (issue 38, the "kvtier host <policy>" configurations).

TTFT is the wall time of a 1-token greedy generate. Reported per configuration: mean, p50, p90
TTFT, the mean ratio vLLM alone / it, paired per-request ratios (median, p10), prompt tokens
computed per request, tokens per tier (vLLM's device hits, kvtier host, kvtier storage), first
generated token identical to vLLM alone, and the largest |logprob| difference of that token
against vLLM alone. The bound's drift is vLLM's own prefix-cache drift on the same prompts
(cached there, computed by vLLM alone). The load average is sampled around every request.

    make vllm-env && .venv-vllm/bin/python bench/vllm_ttft_real.py            # ~15 min
    .venv-vllm/bin/python bench/vllm_ttft_real.py --quick                     # ~4 min
    .venv-vllm/bin/python bench/vllm_ttft_real.py --workload hot \
        --only "vllm,kvtier host lru,kvtier host duel"                        # ~6 min

Storage back-pressure (issue 39): the configurations' kvtier counters also give the backups
skipped by back-pressure (`kvtier_storage_backup_slow_skipped_pages_total`), printed under a
workload's table when any were.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BLOCK = 64
VOCAB = 8192
SYSTEM = 64  # tokens of the system prompt both workloads share

SLOW_WRITE_MS = 3000  # the slow store's delay per BACKUP batch (a store failing its job)
SLOW_READ_MS = 300  # ... and before each storage query and read (the r+w configurations)
HOT_PROMPTS, HOT_BLOCKS, HOT_HOST_BLOCKS = 4, 4, 24  # hot workload: 4 x 4 blocks, host 24

# One entry per configuration: None is vLLM alone; {"device_blocks": n} changes vLLM's pool;
# "toml": kvtier's TOML file's text; "env": variables for this configuration's process only;
# any other key goes to kvtier's connector config. Add a configuration by adding an entry.
CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm": None,
    "vllm bound": {"device_blocks": 512},
    "kvtier host": {"host_blocks": 512, "storage_backend": "none"},
    "kvtier host+file": {"host_blocks": 48, "storage_backend": "file",
                         "prefetch_threshold": 2 * BLOCK},
    # the same, writing to storage only blocks vLLM loaded back from the host tier once
    # (storage.write_policy; "toml" is written to a file handed over as `kvtier_config`)
    "kvtier host+file selective": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "toml": '[storage]\nwrite_policy = "write_through_selective"\nwrite_threshold = 1\n'},
    # attached to the node's `kvtier serve` (issue 19): the same 512-block host tier, as the
    # namespace's quota there (`attached_host_blocks`), storage off
    "kvtier attached": {"attached_host_blocks": 512},
    # issue 39: host+file with its pages in clear (format 3, a MAC) instead of encrypted
    "kvtier host+file clear": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "toml": "[storage]\nencrypt = false\n"},
    # issue 39, back-pressure: host+file's 48-block host tier without storage, and with a
    # store made slow ("env": this configuration's process only; every BACKUP batch sleeps
    # SLOW_WRITE_MS in the worker's write lane) with back-pressure at 200 ms, and the same
    # slow store with back-pressure off (0: off), the negative control
    "kvtier host 48": {"host_blocks": 48, "storage_backend": "none"},
    "kvtier host+file slow": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "env": {"KVTIER_TEST_STORAGE_WRITE_DELAY_MS": str(SLOW_WRITE_MS)},
        "toml": "[storage]\nslow_write_ms = 200.0\n"},
    "kvtier host+file slow no back-pressure": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "env": {"KVTIER_TEST_STORAGE_WRITE_DELAY_MS": str(SLOW_WRITE_MS)},
        "toml": "[storage]\nslow_write_ms = 0.0\nslow_read_ms = 0.0\n"},
    # ... and a store slow both ways: also SLOW_READ_MS before every storage query and read,
    # reads' back-pressure at 100 ms; then the same with back-pressure off
    "kvtier host+file slow r+w": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "env": {"KVTIER_TEST_STORAGE_WRITE_DELAY_MS": str(SLOW_WRITE_MS),
                "KVTIER_TEST_STORAGE_DELAY_MS": str(SLOW_READ_MS)},
        "toml": "[storage]\nslow_write_ms = 200.0\nslow_read_ms = 100.0\n"},
    "kvtier host+file slow r+w no back-pressure": {
        "host_blocks": 48, "storage_backend": "file", "prefetch_threshold": 2 * BLOCK,
        "env": {"KVTIER_TEST_STORAGE_WRITE_DELAY_MS": str(SLOW_WRITE_MS),
                "KVTIER_TEST_STORAGE_DELAY_MS": str(SLOW_READ_MS)},
        "toml": "[storage]\nslow_write_ms = 0.0\nslow_read_ms = 0.0\n"},
    # issue 38: the host tier's eviction order (`host_eviction_policy`) under one-shot
    # documents passing over a hot set (`--workload hot`): a host tier of HOT_HOST_BLOCKS,
    # more than the hot set's blocks and less than the hot set plus the stream between reuses
    **{f"kvtier host {policy}": {"host_blocks": HOT_HOST_BLOCKS, "storage_backend": "none",
                                 "host_eviction_policy": policy}
       for policy in ("lru", "duel", "hitboost", "arc", "s3fifo", "lfuda")},
}


def build_model(path: Path, layers: int) -> Path:
    """The random Llama (transformers, no hub access), built once per path."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=2816,
                      num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, max_position_embeddings=2048)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp)
    tmp.rename(path)
    return path


def child(extra_json: str, device_blocks: int, model_dir: str,
          profile_to: str | None = None) -> None:
    """One vLLM process: read {"tokens": [...]} lines, answer one JSON line per request.
    `profile_to`: cProfile the generate calls (this process: vLLM's scheduler and its
    in-process worker, kvtier's connector and, embedded, its manager) into that file."""
    # the small pool's (vLLM keeps one block back): every configuration takes the same
    max_len = (device_blocks - 1) * BLOCK
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = json.loads(extra_json)
    serve_pid: int | None = None
    url_file = Path(tempfile.gettempdir()) / f"kvtier-ttft-admin-{os.getpid()}"
    if extra is not None and "device_blocks" in extra:
        device_blocks = extra.pop("device_blocks")
        extra = extra or None
    kw: dict[str, Any] = {"model": model_dir, "skip_tokenizer_init": True,
                          "enforce_eager": True, "dtype": "bfloat16", "block_size": BLOCK,
                          "num_gpu_blocks_override": device_blocks,
                          "max_model_len": max_len, "seed": 0,
                          "max_num_batched_tokens": max_len}
    if extra is not None:
        from vllm.config import KVTransferConfig

        spec = {"spec_name": "KvtierOffloadingSpec",
                "spec_module_path": "kvtier.integrations.vllm"}
        if "kvtier_serve" in extra:  # attached: the service's admin is the driver's
            url_file = Path(extra.pop("serve_url_file"))
            serve_pid = int(extra.pop("serve_pid"))
            spec |= {"kvtier_serve": extra.pop("kvtier_serve")}
        else:
            spec |= {"admin_port": 0, "admin_auth": "none", "admin_url_file": str(url_file),
                     **extra}
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec)
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), flush=True)
    prof = cProfile.Profile() if profile_to else None
    for line in sys.stdin:
        req = json.loads(line)
        if "tokens" not in req:  # the driver's ask for the tier counters (between workloads)
            print(json.dumps({"hits": tier_hits(url_file) if extra is not None
                              else (0, 0, 0, 0)}),
                  flush=True)
            continue
        cpu = cpu_seconds(serve_pid)  # before the request: the deltas include its background
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["tokens"])], sp,
                           use_tqdm=False)[0]
        if prof is not None:
            prof.disable()
        dt = time.perf_counter() - t
        tok = int(out.outputs[0].token_ids[0])
        lp = out.outputs[0].logprobs
        logprob = float(lp[0][tok].logprob) if lp else float("nan")
        print(json.dumps({"ttft_s": dt, "cached": int(out.num_cached_tokens or 0),
                          "next": tok, "logprob": logprob, "cpu": cpu}), flush=True)
    url_file.unlink(missing_ok=True)
    if prof is not None and profile_to is not None:
        prof.dump_stats(profile_to)
        Path(profile_to + ".threads.json").write_text(json.dumps(thread_cpu()))


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by name (cProfile sees only the thread that
    calls generate; kvtier's embedded manager, its admin and vLLM's own threads are others).
    Threads Python does not know (torch's OpenMP pool) are summed as "native"."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for t in psutil.Process().threads():
        name = names.get(t.id, "native")
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cpu_seconds(extra_pid: int | None) -> tuple[float, float]:
    """CPU seconds so far (user + system) of this vLLM process (all its threads) and of the
    processes kvtier runs for it: its descendants (worker processes) and, attached, the node
    service (`extra_pid`, with its own descendants). Read before every request, so the
    difference between two reads is one request's whole cost, background copies included
    (the configurations are separate processes: nothing else is counted)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    own = t.user + t.system
    procs = me.children(recursive=True)
    if extra_pid is not None:
        root = psutil.Process(extra_pid)
        procs += [root, *root.children(recursive=True)]
    helpers = 0.0
    for p in procs:
        try:
            c = p.cpu_times()
        except psutil.NoSuchProcess:  # a worker that just ended
            continue
        helpers += c.user + c.system
    return own, helpers


def tier_hits(url_file: Path) -> tuple[float, float, float, float]:
    """kvtier's host and storage hit tokens so far, the storage backups back-pressure skipped
    (pages) and the lookups it answered as misses without asking storage, from its admin's
    Prometheus endpoint (the admin starts with the connector's first lookup: zeros before)."""
    if not url_file.exists():
        return 0.0, 0.0, 0.0, 0.0
    url = url_file.read_text().strip()
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    tiers = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^kvtier_hit_tokens_total\{tier="(\w+)"\} ([0-9.e+]+)$', text, re.M)}
    # attached: the node service's per-namespace blocks loaded by its engines (one engine
    # per namespace in this benchmark), by the tier the copy came from
    node = {m.group(1): float(m.group(2)) * BLOCK for m in re.finditer(
        r'^kvtier_node_engine_blocks_total\{[^}]*kind="loaded_(host|storage)"[^}]*\} '
        r'([0-9.e+]+)$', text, re.M)}
    def counter(name: str) -> float:
        m = re.search(rf'^{name}_total(?:\{{[^}}]*\}})? ([0-9.e+]+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    return (tiers.get("host", 0.0) + node.get("host", 0.0),
            tiers.get("storage", 0.0) + node.get("storage", 0.0),
            counter("kvtier_storage_backup_slow_skipped_pages"),
            counter("kvtier_storage_query_slow_skips"))


def low_reuse(n: int, rng: random.Random) -> list[list[int]]:
    """Independent documents of 8-10 blocks behind the shared system prompt."""
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randrange(7, 10) * BLOCK)]
            for _ in range(n)]


def high_reuse(chats: int, turns: int, rng: random.Random) -> list[list[int]]:
    """Chats round-robin, each request the chat's whole history (user 64 tokens, answer 48)."""
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    hist = [list(system) for _ in range(chats)]
    out: list[list[int]] = []
    for _ in range(turns):
        for h in hist:
            h.extend(rng.randrange(VOCAB) for _ in range(64))
            out.append(list(h))
            h.extend(rng.randrange(VOCAB) for _ in range(48))
    return out


def hot_set(n: int, rng: random.Random) -> list[list[int]]:
    """One-shot documents passing over a hot set (issue 38): HOT_PROMPTS documents of
    HOT_BLOCKS blocks behind the system prompt, each asked again and again with a fresh
    32-token question (a hot document: its blocks are worth keeping), drawn for half the
    requests; the other half are one-shot documents of 8 blocks behind the same system prompt
    (never seen again: they only pass through). Between two uses of a hot document come a
    median 5 requests, 26 new blocks (seed 0, 100 requests: 42 repeats, a quarter past 48
    blocks): about the host tier (HOT_HOST_BLOCKS), which holds the hot set (HOT_PROMPTS x
    HOT_BLOCKS) with 8 blocks to spare, so LRU keeps a hot document only through its shorter
    gaps, and a policy that protects what was hit can keep it through most."""
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    hot = [system + [rng.randrange(VOCAB) for _ in range(HOT_BLOCKS * BLOCK)]
           for _ in range(HOT_PROMPTS)]
    out: list[list[int]] = []
    for _ in range(n):
        if rng.random() < 0.5:
            out.append(rng.choice(hot) + [rng.randrange(VOCAB) for _ in range(32)])
        else:
            out.append(system + [rng.randrange(VOCAB) for _ in range(8 * BLOCK)])
    return out


def ideal_reuse(requests: list[list[int]]) -> tuple[float, int]:
    """Share of prompt tokens in full blocks some earlier request had (an unbounded prefix
    cache), and the working set in blocks."""
    seen: set[tuple[int, ...]] = set()
    reused = total = 0
    for r in requests:
        total += len(r)
        for b in range(len(r) // BLOCK):
            key = tuple(r[:(b + 1) * BLOCK])
            if key in seen:
                reused += BLOCK
            seen.add(key)
    return reused / total, len(seen)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def same_as_bound(rs: list[dict[str, Any]], bound: list[dict[str, Any]] | None) -> str:
    """On the requests where this configuration and the bound (vLLM's own prefix cache) had
    the same number of tokens cached, how many gave the bound's token with a bitwise-equal
    logprob: kvtier's blocks then stand in for vLLM's own, so any difference would be a
    wrong block, not the compute path of another cached count."""
    if bound is None:
        return "-"
    alike = [(a, b) for a, b in zip(rs, bound, strict=True) if a["cached"] == b["cached"]]
    same = sum(a["next"] == b["next"] and a["logprob"] == b["logprob"] for a, b in alike)
    return f"{same}/{len(alike)}"


def cpu_per_request(rs: list[dict[str, Any]]) -> str:
    """CPU per request between the first and the last request's reads (each read is taken
    before its request, so the span holds n - 1 requests with their background work)."""
    if len(rs) < 2:
        return "-"
    own = (rs[-1]["cpu"][0] - rs[0]["cpu"][0]) / (len(rs) - 1) * 1e3
    helpers = (rs[-1]["cpu"][1] - rs[0]["cpu"][1]) / (len(rs) - 1) * 1e3
    return f"{own:.0f} + {helpers:.0f}"


def profile_summary(name: str, path: Path, requests: int, top: int = 12) -> str:
    """kvtier's share of a configuration's generate calls: the inclusive time of kvtier
    functions entered from outside kvtier (vLLM calling the connector; kvtier's callees, torch
    copies included, count as kvtier's), and the entry points that take most of it."""
    st = pstats.Stats(str(path))
    raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    root = str(Path(__file__).resolve().parent.parent)

    def ours(func: tuple[str, int, str]) -> bool:
        return (func[0].startswith(root) and "/bench/" not in func[0]
                and "/.venv" not in func[0])

    total = st.total_tt  # type: ignore[attr-defined]
    entries: list[tuple[float, int, str]] = []
    for func, (_cc, _nc, _tt, _ct, callers) in raw.items():
        if not ours(func):
            continue
        ct = sum(c[3] for caller, c in callers.items() if not ours(caller))
        calls = sum(c[1] for caller, c in callers.items() if not ours(caller))
        if ct > 0:
            rel = os.path.relpath(func[0], root)
            entries.append((ct, calls, f"{rel}:{func[1]} {func[2]}"))
    entries.sort(reverse=True)
    inside = sum(e[0] for e in entries)
    lines = [f"profile {name}: generate {total:.2f} s over {requests} requests "
             f"({total / requests * 1e3:.1f} ms/req); inside kvtier {inside:.3f} s "
             f"({inside / requests * 1e3:.2f} ms/req, {inside / total:.1%})"]
    lines += [f"  {ct / requests * 1e3:7.3f} ms/req {calls:7d} calls  {where}"
              for ct, calls, where in entries[:top]]
    return "\n".join(lines)


def report(name: str, requests: list[list[int]], res: dict[str, list[dict[str, Any]]],
           tiers: dict[str, tuple[float, float, float, float]], loads: list[float],
           device_blocks: int) -> str:
    reuse, blocks = ideal_reuse(requests)
    lines = [f"### {name}: {len(requests)} requests, prompts "
             f"{min(map(len, requests))}..{max(map(len, requests))} tokens, ideal reuse "
             f"{reuse:.0%}, working set {blocks} blocks of {BLOCK} tokens (vLLM's pool "
             f"{device_blocks}: {blocks / device_blocks:.1f}x smaller); load average during "
             f"the run {statistics.mean(loads):.2f} (min {min(loads):.2f}, max "
             f"{max(loads):.2f})", "",
             "| config | TTFT mean ms | p50 ms | p90 ms | vs vLLM mean | vs vLLM p90 "
             "| paired ratio p50 (p10) | computed tok/req | device / host / storage tok/req "
             "| same first token | max logprob drift | = bound where cached alike "
             "| CPU ms/req engine + kvtier procs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = res["vllm"]
    bt = [r["ttft_s"] for r in base]
    for cfg, rs in res.items():
        t = [r["ttft_s"] for r in rs]
        paired = [a / b for a, b in zip(bt, t, strict=True)]
        n = len(rs)
        computed = statistics.mean(len(q) - r["cached"] for q, r in zip(requests, rs,
                                                                         strict=True))
        host, storage = tiers[cfg][0] / n, tiers[cfg][1] / n
        device = sum(r["cached"] for r in rs) / n - host - storage
        same = sum(a["next"] == b["next"] for a, b in zip(rs, base, strict=True))
        drift = max(abs(a["logprob"] - b["logprob"]) for a, b in zip(rs, base, strict=True))
        lines.append(
            f"| {cfg} | {statistics.mean(t) * 1e3:.0f} | {pct(t, .5) * 1e3:.0f} | "
            f"{pct(t, .9) * 1e3:.0f} | {statistics.mean(bt) / statistics.mean(t):.2f}x | "
            f"{pct(bt, .9) / pct(t, .9):.2f}x | {pct(paired, .5):.2f}x ({pct(paired, .1):.2f}x)"
            f" | {computed:.0f} | {device:.0f} / {host:.0f} / {storage:.0f} | {same}/{n} | "
            f"{drift:.4f} | {same_as_bound(rs, res.get('vllm bound'))} | "
            f"{cpu_per_request(rs)} |")
    skipped = {cfg: t[2] for cfg, t in tiers.items() if t[2]}
    if skipped:
        lines += ["", "storage backups skipped by back-pressure "
                  "(kvtier_storage_backup_slow_skipped_pages_total, pages): " + ", ".join(
                      f"{cfg} {n:.0f}" for cfg, n in skipped.items())]
    missed = {cfg: t[3] for cfg, t in tiers.items() if t[3]}
    if missed:
        lines += ["", "lookups answered as misses by back-pressure, storage not asked "
                  "(kvtier_storage_query_slow_skips_total): " + ", ".join(
                      f"{cfg} {n:.0f}" for cfg, n in missed.items())]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer requests and a 4-layer model (iteration, not figures)")
    ap.add_argument("--low", type=int, default=20, help="low-reuse requests")
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--device-blocks", type=int, default=12)
    ap.add_argument("--workload", choices=("both", "low", "high", "hot"), default="both",
                    help="both: low then high reuse; hot: one-shot documents over a hot set")
    ap.add_argument("--hot", type=int, default=100, help="hot-set workload requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=None, help="comma-separated configurations (vllm first)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="cProfile every configuration's generate calls into DIR/<config>.prof "
                         "and print kvtier's share (slows every configuration alike)")
    ap.add_argument("--profile-to", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.device_blocks, args.model_dir, args.profile_to)
        return 0
    layers = 4 if args.quick else 12
    if args.quick:
        args.low, args.chats, args.turns = 8, 12, 2
    rng = random.Random(args.seed)
    workloads = {"low reuse": low_reuse(args.low, rng),
                 "high reuse": high_reuse(args.chats, args.turns, rng)}
    if args.workload == "hot":
        workloads = {"hot set": hot_set(args.hot, rng)}
    elif args.workload != "both":
        workloads = {k: v for k, v in workloads.items() if k.startswith(args.workload)}
    model = build_model(Path(tempfile.gettempdir()) / f"kvtier-llama-{layers}x1024", layers)
    configs = CONFIGS if args.only is None else {
        k: CONFIGS[k] for k in args.only.split(",")}
    tmp = tempfile.mkdtemp(prefix="kvtier-ttft-real-")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_LOGGING_LEVEL="ERROR")
    procs: dict[str, subprocess.Popen[str]] = {}
    # the children's log outlives the run (storage goes with `tmp`)
    log = open(tmp + ".log", "w")  # noqa: SIM115 (open for the children)
    out: list[str] = []
    serve = None
    try:
        for name, extra in configs.items():
            child_env = env
            if extra is not None and "env" in extra:
                child_env = dict(env, **extra["env"])
                extra = {k: v for k, v in extra.items() if k != "env"}
            if extra is not None and extra.get("storage_backend") == "file":
                extra = dict(extra, storage_path=os.path.join(tmp, name.replace(" ", "_")))
            if extra is not None and "toml" in extra:
                toml_path = os.path.join(tmp, name.replace(" ", "_") + ".toml")
                Path(toml_path).write_text(extra["toml"])
                extra = {k: v for k, v in extra.items() if k != "toml"}
                extra["kvtier_config"] = toml_path
            if extra is not None and "attached_host_blocks" in extra:
                serve = start_serve(Path(tmp), extra["attached_host_blocks"], layers)
                extra = {"kvtier_serve": serve.socket_path, "serve_url_file": serve.url_file,
                         "serve_pid": serve.pid}
            prof_args = [] if args.profile is None else [
                "--profile-to", str(Path(args.profile) / (name.replace(" ", "_") + ".prof"))]
            procs[name] = subprocess.Popen(
                [sys.executable, __file__, "--child", json.dumps(extra), "--model-dir",
                 str(model), "--device-blocks", str(args.device_blocks), *prof_args],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                env=child_env)
            assert procs[name].stdout is not None
            if not procs[name].stdout.readline():  # one at a time: starts do not overlap
                raise SystemExit(f"{name}: the vLLM process did not start (log: {log.name})")

        def ask(name: str, msg: dict[str, Any]) -> dict[str, Any]:
            """One line to a configuration's process, its one-line answer."""
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()
            line = p.stdout.readline()
            if not line:
                raise SystemExit(f"{name}: the vLLM process died (log: {log.name})")
            answer: dict[str, Any] = json.loads(line)
            return answer

        def hits() -> dict[str, tuple[float, float, float, float]]:
            """Every configuration's host and storage hit tokens so far. Asked between
            workloads only: a scrape of kvtier's /metrics costs the vLLM process 10-15 ms of
            Python (embedded: its admin runs there), and two per request put 20-30 ms of
            CPU on kvtier's clock that no deployment pays (Prometheus scrapes every 15 s)."""
            got: dict[str, tuple[float, float, float, float]] = {}
            for name in procs:
                host, storage, skipped, missed = ask(name, {"stats": True})["hits"]
                got[name] = (float(host), float(storage), float(skipped), float(missed))
            return got

        for wname, requests in workloads.items():
            res: dict[str, list[dict[str, Any]]] = {n: [] for n in procs}
            loads: list[float] = []
            before = hits()
            for i, req in enumerate(requests):
                order = list(procs)
                random.Random(f"{wname}{i}").shuffle(order)
                for name in order:
                    loads.append(os.getloadavg()[0])
                    res[name].append(ask(name, {"tokens": req}))
                print(f"{wname}: {i + 1}/{len(requests)}", file=sys.stderr, flush=True)
            after = hits()
            tiers = {n: (after[n][0] - before[n][0], after[n][1] - before[n][1],
                         after[n][2] - before[n][2], after[n][3] - before[n][3])
                     for n in procs}
            out.append(report(wname, requests, res, tiers, loads, args.device_blocks))
            print(out[-1] + "\n", flush=True)
    finally:
        stop_children(procs)
        if serve is not None:
            serve.stop()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    if args.profile is not None:
        n = sum(len(r) for r in workloads.values())
        for name in configs:
            path = Path(args.profile) / (name.replace(" ", "_") + ".prof")
            if path.exists():
                print(profile_summary(name, path, n), flush=True)
                threads = json.loads(Path(str(path) + ".threads.json").read_text())
                print("  threads (CPU s since start): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in list(threads.items())[:8]) + "\n", flush=True)
    return 0


def stop_children(procs: dict[str, subprocess.Popen[str]]) -> None:
    """End every configuration's vLLM process: stdin closed (its loop ends), 60 s to exit,
    then killed."""
    for p in procs.values():
        if p.stdin is not None:
            p.stdin.close()
    for p in procs.values():
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Serve:
    """The node's `kvtier serve` for the attached configuration (examples/node_service.py's
    `Serve`: storage off, admin on a loopback port without a token)."""

    def __init__(self, serve: Any, socket_path: str, url_file: str) -> None:
        self.serve, self.socket_path, self.url_file = serve, socket_path, url_file
        self.pid: int = serve.proc.pid

    def stop(self) -> None:
        self.serve.stop()


def start_serve(tmp: Path, host_blocks: int, layers: int) -> _Serve:
    """Start `kvtier serve` with a namespace quota of `host_blocks` of this model's pages
    (layers x K and V x 4 KV heads x 64 head size x 64 tokens x 2 bytes)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import node_service

    work = tmp / "node"
    (work / "run").mkdir(parents=True, mode=0o700)
    sock = str(work / "run" / "node.sock")
    serve = node_service.Serve(work, sock, f"ttftreal{os.getpid()}")
    page = layers * 2 * 4 * 64 * BLOCK * 2
    serve.toml.write_text(serve.toml.read_text().replace(
        f"namespace_quota_bytes = {64 << 20}", f"namespace_quota_bytes = {host_blocks * page}"))
    serve.start()
    url_file = work / "serve-url"
    url_file.write_text(serve.url)
    return _Serve(serve, sock, str(url_file))


if __name__ == "__main__":
    sys.exit(main())
