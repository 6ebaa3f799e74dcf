"""vLLM with kvtier as its host (and storage) tier, checked token for token and logprob for logprob.

Runs in the vLLM environment (`make vllm-env` builds `.venv-vllm`; `make vllm-example` runs
this with `--json`). A tiny random Llama (2 layers, bf16) serves prompts through vLLM's CPU
build with a device pool of 12 blocks of 32 tokens, so a 200-token prompt A leaves vLLM's device
cache after a few other prompts; A again is then served from kvtier:

* `overwrite` (default): A cold, four other prompts, A again: vLLM reports A's full blocks as
  cached (`num_cached_tokens`), kvtier's admin says they came from its tiers, and the tokens and
  logprobs equal the cold run exactly. With `--corrupt-host`, every page of kvtier's host pool
  is overwritten behind kvtier's back before A comes again (a negative control: the run must
  then report `identical: false`, or the check could not fail).
* `--reference FILE`: write (or, when it exists, compare against) A's cold output, so a second
  process with the same storage (file or Redis) is compared with the first one's cold run.
* `--audit SAMPLE` (e.g. `1` or `1/1000`: kvtier's `audit.sample`): kvtier's sampled recompute
  audit. At `1`, A comes back once more before the checks above with every hit audited (vLLM
  recomputes A's blocks, kvtier compares them with its copies: `audit_clean`), then A's warm
  run is audited too; with `--corrupt-host` that run must find a `mismatch` for each of A's
  blocks and still be identical (it was recomputed), and A after it, with the audit off, is
  recomputed (the mismatched copies were removed from the node) and identical (`audit_after`).
  With `--storage file`, `audit_storage` counts A's pages before and after that run: a
  mismatch deletes its storage page too. `--audit-sampling N`: last, N one-block prompts run
  twice, the second pass audited at 1 in 10: `audit_sampling` says how many requests hit
  kvtier (`offered` to the sampler), how many were drawn and what their blocks compared as.
* `--reset-storage`: `POST /reset?storage=true` on kvtier's admin before A comes again: A is
  recomputed (0 tokens from kvtier) and still exact.
* `--kill-worker`: kill -9 kvtier's worker process before A comes again: vLLM goes on serving
  (from its own cache or recomputing), never hangs.
* `--model hybrid` (Gemma 3 text) or `--model gemma2`: random models whose layers alternate a
  64-token sliding window and full attention, so vLLM makes two KV cache groups (24 device
  blocks: a request holds blocks in both). A is longer than the window: the full-attention
  group loads A's whole prefix, the sliding-window group only the window's blocks
  (`blocks_loaded_by_group`). `--drop-group-pages full|sliding_window` (file storage) deletes
  one group's pages of A before A comes again: A is recomputed, still identical.

The last line of output is one JSON object (with `--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BLOCK = 32
PROMPT_TOKENS = 200  # 6 full blocks of 32 + 8
VOCAB = 512


# `hybrid`: Gemma 3's text architecture, sliding-window (64 tokens, two blocks) and full
# attention layers interleaved, so vLLM makes two KV cache groups; A (200 tokens) is longer than
# the window, so the sliding-window layers' early blocks lie outside it.
WINDOW = 64
DEVICE_BLOCKS = {"llama": 12, "hybrid": 24, "gemma2": 24}  # hybrid: blocks in both groups


def build_model(path: Path, kind: str = "llama") -> Path:
    """A random model saved with transformers (no hub access); built once per path."""
    if (path / "config.json").exists():
        return path
    import torch

    torch.manual_seed(0)
    if kind == "hybrid":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        gcfg = Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
            num_attention_heads=2, num_key_value_heads=2, head_dim=64, sliding_window=WINDOW,
            max_position_embeddings=512,
            layer_types=["sliding_attention", "full_attention"] * 2)
        Gemma3ForCausalLM(gcfg).to(torch.bfloat16).save_pretrained(path)
        return path
    if kind == "gemma2":  # Gemma 2: every other layer sliding-window, logit soft-capping
        from transformers import Gemma2Config, Gemma2ForCausalLM

        g2 = Gemma2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                          head_dim=64, sliding_window=WINDOW, max_position_embeddings=512)
        Gemma2ForCausalLM(g2).to(torch.bfloat16).save_pretrained(path)
        return path
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                      max_position_embeddings=512)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def kvtier_manager(llm: Any) -> Any:
    """kvtier's scheduler side inside this (in-process) vLLM engine."""
    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.get_kv_connector().connector_scheduler.manager


def group_pages(llm: Any, storage_path: str, tokens: list[int], kind: str) -> list[Path]:
    """The file-storage pages of the `kind` group ("full" or "sliding_window") of every full
    block of `tokens` (those present)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key

    manager = kvtier_manager(llm)
    gid = next((g.group_id for g in manager.groups if g.kind == kind), 0)
    fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    parent = None
    pages: list[Path] = []
    for i in range(len(tokens) // BLOCK):
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        hexkey = manager.storage_key(make_offload_key(parent, gid)).hex()
        pages += Path(storage_path).glob(f"**/{hexkey[:2]}/{hexkey}")
    return pages


def drop_group_pages(llm: Any, storage_path: str, tokens: list[int], kind: str) -> int:
    """Delete from file storage the pages of the `kind` group of every full block of
    `tokens` (the other group's pages stay). Returns how many."""
    pages = group_pages(llm, storage_path, tokens, kind)
    for page in pages:
        page.unlink()
    return len(pages)


def settle(url: str, timeout_s: float = 30.0) -> None:
    """Wait (bounded) until kvtier has no task in flight (backups, page deletions)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not json.loads(admin_get(url, "/status")).get("tasks_inflight", 0):
            return
        time.sleep(0.1)


def sample_audits(llm: Any, url: str, rng: random.Random, requests: int,
                  rate: float) -> dict[str, Any]:
    """The audit's sampling on live traffic: `requests` one-block prompts are run once
    (kvtier stores each block), then again, at audit rate `rate`, after the first pass pushed
    them out of vLLM's device pool: each second-pass request that hits kvtier is offered to
    the sampler. Returns how many were offered, drawn and audited (blocks by result)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(VOCAB) for _ in range(BLOCK + 1)])
               for _ in range(requests)]
    llm.generate(prompts, sp, use_tqdm=False)
    settle(url)
    sampler = kvtier_manager(llm).audit.sampler
    sampler.rate = rate
    offered, drawn, a0 = sampler.offered, sampler.drawn, audit_figures(llm)
    h0 = hit_tokens(url)
    llm.generate(prompts, sp, use_tqdm=False)
    h1 = hit_tokens(url)
    sampler.rate = 0.0
    # the last requests' stores (their audits) complete in later engine steps: a few steps
    audit = kvtier_manager(llm).audit
    for _ in range(20):
        if not audit.pending:
            break
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], sp, use_tqdm=False)
    return {"requests": requests, "rate": rate, "offered": sampler.offered - offered,
            "drawn": sampler.drawn - drawn, "blocks": audit_delta(a0, audit_figures(llm)),
            "tokens_loaded_from_kvtier": int(sum(h1.get(t, 0.0) - h0.get(t, 0.0)
                                                 for t in ("host", "storage")))}


def make_llm(model: Path, extra: dict[str, Any], kind: str = "llama") -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kt = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm", **extra})
    return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
               dtype="bfloat16", block_size=BLOCK, num_gpu_blocks_override=DEVICE_BLOCKS[kind],
               max_model_len=320, kv_transfer_config=kt, seed=0)


def generate(llm: Any, tokens: list[int]) -> dict[str, Any]:
    [out] = generate_many(llm, [tokens])
    return out


def generate_many(llm: Any, prompts: list[list[int]], max_tokens: int = 8
                  ) -> list[dict[str, Any]]:
    """Greedy outputs (tokens, top-5 logprobs, vLLM's `num_cached_tokens`) of the prompts,
    served in one generate call (vLLM batches them as its device cache allows)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5)
    outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in prompts], sp,
                        use_tqdm=False)
    found = []
    for out in outs:
        comp = out.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in step.items()} for step in comp.logprobs]
        found.append({"tokens": list(comp.token_ids), "logprobs": logprobs,
                      "num_cached_tokens": int(out.num_cached_tokens or 0)})
    return found


def admin_get(url: str, path: str) -> str:
    with urllib.request.urlopen(url + path, timeout=10) as r:
        return r.read().decode()


def admin_post(url: str, path: str) -> str:
    req = urllib.request.Request(url + path, method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()


def lookup(url: str, tokens: list[int]) -> dict[str, Any]:
    """The admin's POST /lookup (issue 36): the prompt's matched tokens per tier, as the
    embedded kvtier names vLLM's blocks; a refusal (a model whose blocks token ids cannot
    name) as {"refused": its one line}."""
    req = urllib.request.Request(url + "/lookup", method="POST",
                                 data=json.dumps({"token_ids": tokens}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            found: dict[str, Any] = json.loads(r.read())["matched_tokens"]
            return found
    except urllib.error.HTTPError as e:
        return {"refused": json.loads(e.read()).get("detail", str(e))}


def hit_tokens(url: str) -> dict[str, float]:
    """kvtier's hit counters by tier, read from its Prometheus endpoint."""
    text = admin_get(url, "/metrics")
    out: dict[str, float] = {}
    for m in re.finditer(r'^kvtier_hit_tokens_total\{tier="(\w+)"\} ([0-9.e+]+)$', text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def worker_pids(url: str) -> list[int]:
    status = json.loads(admin_get(url, "/status"))
    return [int(w["pid"]) for w in status.get("workers", []) if w.get("pid")]


def corrupt_host_pool(url: str) -> int:
    """Overwrite every page of kvtier's host pool of rank 0 (kvtier is not told)."""
    import mmap

    status = json.loads(admin_get(url, "/status"))
    name = f"/dev/shm/kvtier_{status['deployment_id']}_host_r0"
    fd = os.open(name, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
        pattern = bytes(random.Random(7).randrange(256) for _ in range(4096))
        for off in range(0, size, 4096):
            n = min(4096, size - off)
            mm[off:off + n] = pattern[:n]
        mm.close()
    finally:
        os.close(fd)
    return size


def audit_figures(llm: Any) -> dict[str, Any]:
    """kvtier's audit counts so far (result -> blocks, all tiers) and its largest
    differences."""
    figures = kvtier_manager(llm).audit.figures
    return {"counts": {r: figures.total(r) for r in ("equal", "within_tolerance", "mismatch")},
            "max_abs_diff": figures.max_abs, "max_rel_diff": figures.max_rel}


def spy_vllm_stats(llm: Any) -> dict[str, float]:
    """The audit's series in what kvtier hands vLLM's metrics (its connector stats, taken by
    vLLM's scheduler every step), added up here as vLLM's Prometheus logger would:
    "result/tier" -> blocks, and the largest-difference gauges' last values."""
    from kvtier.integrations.vllm import manager as adapter_manager

    manager = kvtier_manager(llm)
    seen: dict[str, float] = {}
    get_stats = manager.get_stats

    def spy() -> Any:
        stats = get_stats()
        values = stats._values if stats is not None else {}
        for labels, n in values.get(adapter_manager.METRIC_AUDIT, {}).items():
            key = "/".join(labels)
            seen[key] = seen.get(key, 0) + n
        for name in (adapter_manager.METRIC_AUDIT_MAX_ABS, adapter_manager.METRIC_AUDIT_MAX_REL):
            for v in values.get(name, {}).values():
                seen[name.rsplit("_audit_", 1)[1]] = v
        return stats

    manager.get_stats = spy
    return seen


def audit_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {r: after["counts"][r] - before["counts"][r] for r in after["counts"]}


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[bool, float]:
    """Exact equality of tokens and logprobs; also the largest logprob difference seen."""
    diff = 0.0
    for sa, sb in zip(a["logprobs"], b["logprobs"], strict=False):
        for t, v in sa.items():
            diff = max(diff, abs(v - sb[t])) if t in sb else float("inf")
    same = a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    return same, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model", choices=["llama", "hybrid", "gemma2"], default="llama",
                    help="llama: one KV cache group; hybrid: Gemma 3 text, sliding-window and "
                    "full attention (two groups); gemma2: Gemma 2, the same two groups")
    ap.add_argument("--model-dir", default="", help="where the random model is built "
                    "(default: a folder per --model under the temp dir)")
    ap.add_argument("--drop-group-pages", choices=["full", "sliding_window"], default="",
                    help="file storage: delete that KV cache group's pages of A before A "
                    "again (the other group's stay; A must be recomputed)")
    ap.add_argument("--storage", choices=["none", "file", "redis"], default="none")
    ap.add_argument("--storage-path", default="", help="file backend directory")
    ap.add_argument("--redis-url", default="", help="redis backend URL")
    ap.add_argument("--reference", default="", help="JSON file of A's cold output: written "
                    "when missing, compared against when present (A is then not run cold)")
    ap.add_argument("--corrupt-host", action="store_true",
                    help="negative control: overwrite kvtier's host pool before A again")
    ap.add_argument("--audit", default="", metavar="SAMPLE",
                    help="kvtier's audit.sample (1, 1/1000, 0.01): audited hits are "
                    "recomputed by vLLM and compared with kvtier's copies")
    ap.add_argument("--audit-sampling", type=int, default=0, metavar="N",
                    help="with --audit: last, N one-block prompts run twice, the second time "
                    "audited at 1 in 10 (the sampled share, `audit_sampling`)")
    ap.add_argument("--reset-storage", action="store_true",
                    help="POST /reset?storage=true before A again (A is recomputed)")
    ap.add_argument("--kill-worker", action="store_true",
                    help="kill -9 kvtier's worker before A again (vLLM must go on)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("kvtier").addHandler(handler)
    logging.getLogger("kvtier").setLevel(logging.INFO)

    model_dir = args.model_dir or os.path.join(
        tempfile.gettempdir(), {"llama": "kvtier-vllm-tiny-llama",
                                "hybrid": "kvtier-vllm-tiny-gemma3",
                                "gemma2": "kvtier-vllm-tiny-gemma2"}[args.model])
    model = build_model(Path(model_dir), args.model)
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-") as tmp:
        url_file = Path(tmp) / "admin-url"
        # the sampling pass stores one block per prompt on the host (and audits scratch pages)
        host_blocks = 64 + 2 * args.audit_sampling
        extra: dict[str, Any] = {"host_blocks": host_blocks, "storage_backend": args.storage,
                                 "prefetch_threshold": BLOCK, "admin_port": 0,
                                 "admin_auth": "none", "admin_url_file": str(url_file)}
        if args.storage == "file":
            extra["storage_path"] = args.storage_path or os.path.join(tmp, "storage")
        if args.storage == "redis":
            extra["storage_url"] = args.redis_url
        t0 = time.monotonic()
        if args.audit:
            os.environ["KVTIER_AUDIT__SAMPLE"] = args.audit
            os.environ["KVTIER_AUDIT__MAX_BLOCKS_PER_S"] = "0"  # no cap: every draw audited
        llm = make_llm(model, extra, args.model)
        url = url_file.read_text().strip()
        rng = random.Random(args.seed)
        prompt_a = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        others = [[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(4)]
        ref_path = Path(args.reference) if args.reference else None
        report: dict[str, Any] = {"storage": args.storage, "model": args.model,
                                  "kv_cache_groups": [
                                      {"group_id": g.group_id, "kind": g.kind,
                                       "layers": len(g.layer_names),
                                       "window_tokens": g.window_tokens}
                                      for g in kvtier_manager(llm).groups]}
        if ref_path is not None and ref_path.exists():
            cold = json.loads(ref_path.read_text())
            report["reference"] = "file"
        else:
            cold = generate(llm, prompt_a)
            report["reference"] = "this run"
            if ref_path is not None:
                ref_path.write_text(json.dumps(cold))
            for p in others:  # push A's blocks out of vLLM's 12-block device pool
                generate(llm, p)
        if args.storage != "none":
            # kvtier backs stored blocks up to storage asynchronously: let them land
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                st = json.loads(admin_get(url, "/status"))
                if not st.get("tasks_inflight", 0):
                    break
                time.sleep(0.1)
        before = hit_tokens(url)
        by_group = kvtier_manager(llm).blocks_by_group
        loaded_before = {g: c["loaded"] for g, c in by_group.items()}
        if args.drop_group_pages:
            if args.storage != "file":
                ap.error("--drop-group-pages needs --storage file")
            report["dropped_pages"] = drop_group_pages(llm, extra["storage_path"], prompt_a,
                                                       args.drop_group_pages)
        fresh = iter([[rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(8)])
        if args.audit:
            vllm_audit = spy_vllm_stats(llm)
            # A with every hit audited: recomputed, compared with kvtier's copies
            a0 = audit_figures(llm)
            clean = generate(llm, prompt_a)
            a1 = audit_figures(llm)
            report["audit_clean"] = {"blocks": audit_delta(a0, a1),
                                     "identical": compare(cold, clean)[0],
                                     "vllm_num_cached_tokens": clean["num_cached_tokens"],
                                     "max_abs_diff": a1["max_abs_diff"],
                                     "max_rel_diff": a1["max_rel_diff"]}
            for _ in range(4):  # A out of vLLM's device pool again
                generate(llm, next(fresh))
            before = hit_tokens(url)
            audit_before = a1
        # file storage: A's pages (a mismatch found by the audit deletes them)
        pages_of_a = str(extra["storage_path"]) if args.storage == "file" else ""
        if args.audit and pages_of_a:
            report["audit_storage"] = {
                "pages_before": len(group_pages(llm, pages_of_a, prompt_a, "full"))}
        if args.corrupt_host:
            report["corrupted_bytes"] = corrupt_host_pool(url)
        if args.reset_storage:
            report["reset"] = json.loads(admin_post(url, "/reset?storage=true"))
        if args.kill_worker:
            pids = worker_pids(url)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            report["killed_worker_pids"] = pids
            # vLLM goes on serving while kvtier replaces its worker (misses meanwhile) ...
            t = time.monotonic()
            report["during_restart_tokens"] = generate(llm, others[1])["tokens"]
            report["during_restart_seconds"] = round(time.monotonic() - t, 2)
            # ... and once the new worker is up, A (whose host copies died with the old one)
            # is recomputed, exactly
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                new = worker_pids(url)
                ready = json.loads(admin_get(url, "/status"))["workers"]
                if new and not set(new) & set(pids) and all(
                        w.get("state") == "ready" for w in ready):
                    report["replacement_worker_pids"] = new
                    break
                time.sleep(0.1)
            before = hit_tokens(url)
        # what the admin says the node holds of A, then what vLLM loads (equal, exactly)
        report["lookup_before_load"] = lookup(url, prompt_a)
        warm = generate(llm, prompt_a)
        after = hit_tokens(url)
        loaded = sum(after.get(t, 0.0) - before.get(t, 0.0) for t in ("host", "storage"))
        same, diff = compare(cold, warm)
        report.update({
            "tokens_loaded_from_kvtier": int(loaded),
            "tokens_by_tier": {t: int(after.get(t, 0.0) - before.get(t, 0.0))
                               for t in ("host", "storage")},
            "vllm_num_cached_tokens": warm["num_cached_tokens"],
            # blocks of A loaded per KV cache group (vLLM's group id)
            "blocks_loaded_by_group": {str(g): c["loaded"] - loaded_before.get(g, 0)
                                       for g, c in by_group.items()},
            "identical": same,
            "max_abs_logprob_diff": diff,
            "tokens": warm["tokens"],
            "admin_url": url,
            "seconds": round(time.monotonic() - t0, 2),
        })
        if args.audit:
            a2 = audit_figures(llm)
            report["audit_warm"] = {"blocks": audit_delta(audit_before, a2),
                                    "max_abs_diff": a2["max_abs_diff"],
                                    "max_rel_diff": a2["max_rel_diff"]}
            if pages_of_a:  # a mismatch's storage pages are deleted too
                settle(url)
                report["audit_storage"]["pages_after"] = len(
                    group_pages(llm, pages_of_a, prompt_a, "full"))
            # the audit off: A again, from kvtier where its copies are still held
            kvtier_manager(llm).audit.sampler.rate = 0.0
            for _ in range(4):
                generate(llm, next(fresh))
            h0 = hit_tokens(url)
            again = generate(llm, prompt_a)
            h1 = hit_tokens(url)
            report["audit_after"] = {
                "identical": compare(cold, again)[0],
                "tokens_loaded_from_kvtier": int(sum(h1.get(t, 0.0) - h0.get(t, 0.0)
                                                     for t in ("host", "storage"))),
                "audit_blocks": audit_delta(a2, audit_figures(llm))}
            if args.audit_sampling:
                report["audit_sampling"] = sample_audits(llm, url, rng, args.audit_sampling,
                                                         0.1)
            report["vllm_audit_metrics"] = vllm_audit
            report["status_audit"] = json.loads(admin_get(url, "/status")).get("audit")
        metrics = admin_get(url, "/metrics")
        report["metrics_lines"] = [ln for ln in metrics.splitlines()
                                   if ln.startswith(("kvtier_hit_tokens_total",
                                                     "kvtier_audit_",
                                                     "kvtier_engine_removed_blocks"))]
        del llm
    first = {k: report.pop(k) for k in ("tokens_loaded_from_kvtier", "identical")}
    report = {**first, **report}
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print(json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
