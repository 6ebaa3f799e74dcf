"""What attaching to the node service adds to an engine's scheduler, per request.

The scheduler-side calls an engine adapter makes for one request of a 4,096-token prompt in
16-token blocks (256 blocks), against the same key-addressed surface in two homes:

* embedded: `EmbeddedCache` over a keyed `Stack` in this process (one worker process);
* attached: `NodeClient` over the node socket of a `kvtier serve` child process;
* attached_events: the same in a namespace of its own with tier events on (`enable_events`,
  as vLLM's KV events make the adapter do): every reply carries the namespace's events
  (issue 20), the service reconciles the namespace each `node.events_interval_s`.

Every home's step ends with `take_events()`, as vLLM's scheduler calls it each step (a
home with events off answers []); `ratio_events_*` is attached_events / attached.

A request pair is timed: a cold request (count_asked, the lookup of its first block, which
misses, prepare_store of its 256 blocks, complete_store, forget_request, end_step) and then
the same prompt warm (256 lookups that hit, prepare_load of 256 blocks, complete_load,
forget_request, end_step). No KV bytes move (they are the engine's own copies in both homes).
Attached, the one-way calls (completions, forget) return once queued and the service applies
them in its own process: that work leaves the engine's scheduler thread, which is what is
measured here (the scheduler-side time), and the embedded stack's threads share this
process's interpreter lock.
Between steps the engine computes (`--gap-ms`, default 2 ms, untimed): attached, that is when
the service applies the one-way calls of the step; back to back (`--gap-ms 0`) the next
question waits behind them, which no engine's scheduler does. Rounds alternate the two homes
(embedded first on even rounds), each round a batch of requests with fresh prompts; the
medians per request and the ratio attached / embedded are printed with the added
microseconds per request against the 100 us budget.

    python bench/node_overhead.py [--rounds 10] [--requests 20] [--gap-ms 2] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.engine.cache_api import EngineCache
from kvtier.engine.embedded_cache import EmbeddedCache
from kvtier.engine.node_client import NodeClient
from kvtier.manager.config import load_config
from kvtier.manager.node import wire
from kvtier.manager.stack import Stack

BLOCKS = 256  # 4,096 tokens in 16-token blocks
BLOCK = 16
SHAPE: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16",
         "num_extra_layers": 0, "kv_scales": "none"}
HOST_BLOCKS = 16384
NAMESPACE = "bench-node-overhead"
BUDGET_US = 100.0


def prompt(tag: str, i: int) -> list[bytes]:
    return [hashlib.sha256(f"{tag}-{i}-{b}".encode()).digest() for b in range(BLOCKS)]


def one_request(cache: EngineCache, keys: list[bytes], rid: str,
                gap_s: float) -> tuple[float, float]:
    """(cold seconds, warm seconds) of one prompt's scheduler-side calls; `gap_s` untimed
    after each (the engine's forward pass between scheduler steps)."""
    t0 = time.perf_counter()
    cache.count_asked(rid, BLOCKS)
    cold = cache.lookup(keys[0], rid, keys[1:])
    plan = cache.prepare_store(keys)
    assert plan is not None and len(plan.keys) == BLOCKS, (cold, plan)
    cache.complete_store(plan.keys)
    cache.forget_request(rid)
    cache.end_step()
    cache.take_events()
    cold_s = time.perf_counter() - t0
    time.sleep(gap_s)
    t1 = time.perf_counter()
    rid2 = rid + "w"
    cache.count_asked(rid2, BLOCKS)
    hits = 0
    for j, k in enumerate(keys):
        if cache.lookup(k, rid2, keys[j + 1:]).value != "hit":
            break
        hits += 1
    assert hits == BLOCKS, hits
    cache.prepare_load(keys)
    cache.complete_load(keys)
    cache.forget_request(rid2)
    cache.end_step()
    cache.take_events()
    warm_s = time.perf_counter() - t1
    time.sleep(gap_s)
    return cold_s, warm_s


def run_round(cache: EngineCache, tag: str, n: int,
              gap_s: float = 0.0) -> list[tuple[float, float]]:
    return [one_request(cache, prompt(tag, i), f"{tag}-{i}", gap_s) for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=2.0,
                    help="untimed pause after each request's calls, as the engine's forward "
                    "pass between scheduler steps (0: back to back)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
    sock = work / "s" / "node.sock"
    did = f"bno{os.getpid()}"
    geometry = (f'[model]\nnum_layers = {SHAPE["num_layers"]}\nnum_kv_heads = '
                f'{SHAPE["num_kv_heads"]}\nhead_dim = {SHAPE["head_dim"]}\n'
                f'[cache]\nblock_size = {BLOCK}\ndevice_blocks = 1\nhost_blocks = '
                f'{HOST_BLOCKS}\ndecode_reserve_blocks = 0\n'
                '[storage]\nbackend = "none"\n[workers]\ncount = 1\ndevice = "cpu"\n')
    toml = work / "kvtier.toml"
    page = 2 * SHAPE["num_layers"] * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * BLOCK * 2
    toml.write_text(f'deployment_id = "{did}s"\n' + geometry
                    + '[admin]\nport = 0\nauth = "none"\n'
                    + f'[node]\nsocket = "{sock}"\nnamespace_quota_bytes = '
                    f'{HOST_BLOCKS * page}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["XDG_STATE_HOME"] = str(work / "state")
    serve = subprocess.Popen([sys.executable, "-m", "kvtier.admin.cli", "serve", "--config",
                              str(toml)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             env=env, text=True)
    stack = None
    client = None
    watched = None
    try:
        assert serve.stdout is not None
        deadline = time.monotonic() + 60
        for line in serve.stdout:
            if re.search(r"admin listening on", line):
                break
            if time.monotonic() > deadline:
                raise SystemExit("kvtier serve did not start within 60 s")
        cfg = load_config(None, {"KVTIER_DEPLOYMENT_ID": f"{did}e",
                                 "KVTIER_MODEL__NUM_LAYERS": str(SHAPE["num_layers"]),
                                 "KVTIER_MODEL__NUM_KV_HEADS": str(SHAPE["num_kv_heads"]),
                                 "KVTIER_MODEL__HEAD_DIM": str(SHAPE["head_dim"]),
                                 "KVTIER_CACHE__BLOCK_SIZE": str(BLOCK),
                                 "KVTIER_CACHE__DEVICE_BLOCKS": "1",
                                 "KVTIER_CACHE__DECODE_RESERVE_BLOCKS": "0",
                                 "KVTIER_CACHE__HOST_BLOCKS": str(HOST_BLOCKS),
                                 "KVTIER_STORAGE__BACKEND": "none",
                                 "KVTIER_WORKERS__COUNT": "1",
                                 "KVTIER_WORKERS__DEVICE": "cpu"})
        stack = Stack(cfg, keyed_namespace=NAMESPACE.encode()).start()
        embedded = EmbeddedCache(stack)
        client = NodeClient(sock, wire.Hello(NAMESPACE, SHAPE, BLOCK, "sha256", "0", 1,
                                             os.getpid()), call_timeout_s=5.0)
        watched = NodeClient(sock, wire.Hello(NAMESPACE + "-ev", SHAPE, BLOCK, "sha256", "0", 1,
                                              os.getpid()), call_timeout_s=5.0)
        if not client.connected or not watched.connected:
            raise SystemExit(f"not attached: {client.last_error or watched.last_error}")
        watched.enable_events()
        homes: dict[str, EngineCache] = {"embedded": embedded, "attached": client,
                                         "attached_events": watched}
        for name, home in homes.items():
            run_round(home, f"warmup-{name}", 3)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in homes}
        for r in range(args.rounds):
            order = list(homes) if r % 2 == 0 else list(reversed(homes))
            for name in order:
                times[name] += run_round(homes[name], f"{name}-{r}", args.requests,
                                         args.gap_ms / 1e3)
        rtt = []
        for _ in range(500):  # one empty question: the socket round trip itself
            t0 = time.perf_counter()
            client._ask(wire.OpRecord(wire.Op.PENDING))
            rtt.append(time.perf_counter() - t0)
        out: dict[str, Any] = {"blocks": BLOCKS, "block_tokens": BLOCK,
                               "requests": args.rounds * args.requests,
                               "gap_ms": args.gap_ms,
                               "round_trip_us": statistics.median(rtt) * 1e6,
                               "loadavg": os.getloadavg()}
        for name, ts in times.items():
            out[f"{name}_cold_us"] = statistics.median(c for c, _ in ts) * 1e6
            out[f"{name}_warm_us"] = statistics.median(w for _, w in ts) * 1e6
        for kind in ("cold", "warm"):
            e, a = out[f"embedded_{kind}_us"], out[f"attached_{kind}_us"]
            out[f"added_{kind}_us"] = a - e
            out[f"ratio_{kind}"] = a / e
            out[f"ratio_events_{kind}"] = out[f"attached_events_{kind}_us"] / a
        out["added_per_request_us"] = (out["added_cold_us"] + out["added_warm_us"]) / 2
        out["within_budget"] = out["added_per_request_us"] <= BUDGET_US
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{BLOCKS} blocks of {BLOCK} tokens, {out['requests']} requests per home, "
                  f"interleaved, {args.gap_ms:g} ms between steps; load average "
                  f"{out['loadavg'][0]:.2f}")
            for kind in ("cold", "warm"):
                print(f"  {kind:5s} request: embedded {out[f'embedded_{kind}_us']:8.1f} us, "
                      f"attached {out[f'attached_{kind}_us']:8.1f} us, ratio "
                      f"{out[f'ratio_{kind}']:.2f}, added {out[f'added_{kind}_us']:+.1f} us; "
                      f"attached with events {out[f'attached_events_{kind}_us']:8.1f} us, "
                      f"ratio to attached {out[f'ratio_events_{kind}']:.2f}")
            print(f"  one empty round trip over the socket: {out['round_trip_us']:.1f} us")
            print(f"  added per request (mean of cold and warm): "
                  f"{out['added_per_request_us']:+.1f} us, budget {BUDGET_US:.0f} us: "
                  f"{'met' if out['within_budget'] else 'NOT met'}")
        return 0
    finally:
        for c in (client, watched):
            if c is not None:
                c.close()
        if stack is not None:
            stack.close()
        serve.terminate()
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
