"""Restart to first hit of `kvtier serve` with a large host tier (issue 37).

A `kvtier serve` child with `node.handover = true` and one namespace of `--gib` GiB of host
tier (512 KiB pages: 8 layers x 8 KV heads x 128 x 16 tokens, float16); an engine (a
`NodeClient` in this process, writing the pages itself as vLLM's attached adapter does)
fills every block, then the service is stopped (`--mode planned`: SIGTERM, a hand-over;
`--mode crash`: SIGKILL of its process group, the page journal) and started again. Timed:
the stop, and from the new service's launch to the engine's first host hit (the client
reattaches by itself), and the service's own figures (blocks adopted). Every page the
engine then loads is compared with what it wrote (a sample of `--check` pages, whole).

    python bench/node_restart.py [--gib 4] [--mode planned|crash] [--check 256] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.engine.node_client import NodeClient
from kvtier.manager.keyed import Lookup
from kvtier.manager.node import wire

SHAPE: dict[str, Any] = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128,
                         "dtype": "float16", "num_extra_layers": 0, "kv_scales": "none"}
BLOCK = 16
PAGE = 2 * 8 * 8 * 128 * BLOCK * 2  # 512 KiB
NAMESPACE = "bench-restart"


def key(i: int) -> bytes:
    return hashlib.sha256(f"restart-{i}".encode()).digest()


def page_bytes(i: int, base: bytes) -> bytes:
    return key(i) + base[32:]


def start_serve(toml: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes],
                                                                      str]:
    before = len(re.findall(r"admin listening on", log.read_text())) if log.exists() else 0
    f = log.open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.admin.cli", "serve", "--config",
                             str(toml)], stdout=f, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.findall(r"admin listening on (http://\S+)", log.read_text())
        if len(found) > before and proc.poll() is None:
            return proc, found[-1]
        time.sleep(0.05)
    raise SystemExit(f"kvtier serve did not start:\n{log.read_text()[-2000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--mode", choices=("planned", "crash"), default="planned")
    ap.add_argument("--check", type=int, default=256, help="pages compared whole")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    blocks = int(args.gib * (1 << 30)) // PAGE
    work = Path(tempfile.mkdtemp(prefix="kvr", dir="/tmp"))
    sock = work / "s" / "node.sock"
    did = f"bnr{os.getpid()}"
    toml = work / "kvtier.toml"
    toml.write_text(f'deployment_id = "{did}"\n'
                    "[model]\nnum_layers = 1\nnum_kv_heads = 1\nhead_dim = 8\n"
                    "[cache]\nblock_size = 4\ndevice_blocks = 4\nhost_blocks = 4\n"
                    '[storage]\nbackend = "none"\n[workers]\ncount = 1\ndevice = "cpu"\n'
                    '[admin]\nport = 0\nauth = "none"\n'
                    f'[node]\nsocket = "{sock}"\nhandover = true\n'
                    f"namespace_quota_bytes = {blocks * PAGE}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["XDG_STATE_HOME"] = str(work / "state")
    log = work / "serve.log"
    out: dict[str, Any] = {"mode": args.mode, "blocks": blocks, "page_bytes": PAGE,
                           "host_gib": round(blocks * PAGE / (1 << 30), 2)}
    proc, url = start_serve(toml, env, log)
    client = None
    try:
        client = NodeClient(sock, wire.Hello(NAMESPACE, SHAPE, BLOCK, "sha256", "0", 1,
                                             os.getpid()), call_timeout_s=5.0)
        if not client.connected:
            raise SystemExit(f"not attached: {client.last_error}")
        pools = client.host_pools()
        assert pools is not None
        seg = pools.segments[0]
        fd = os.open("/dev/shm" + seg.name, os.O_RDWR)
        pool = mmap.mmap(fd, blocks * PAGE)
        os.close(fd)
        base = random.Random(1).randbytes(PAGE)
        t0 = time.perf_counter()
        for start in range(0, blocks, 256):
            keys = [key(i) for i in range(start, min(blocks, start + 256))]
            plan = client.prepare_store(keys)
            assert plan is not None and len(plan.keys) == len(keys), "store refused"
            for k, hid in zip(plan.keys, plan.host_ids, strict=True):
                i = start + keys.index(k)
                pool[hid * PAGE:(hid + 1) * PAGE] = page_bytes(i, base)
            client.complete_store(plan.keys)
            client.end_step()
        client.lookup(key(0))  # a round trip: every completion applied
        out["fill_s"] = round(time.perf_counter() - t0, 2)
        pool.close()
        t = time.perf_counter()
        if args.mode == "planned":
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        out["stop_s"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        proc, url = start_serve(toml, env, log)
        out["serve_up_s"] = round(time.perf_counter() - t, 2)
        while client.lookup(key(0)) is not Lookup.HIT:
            if time.perf_counter() - t > 120:
                raise SystemExit("no hit within 120 s of the restart")
            time.sleep(0.01)
        out["restart_to_first_hit_s"] = round(time.perf_counter() - t, 2)
        with urllib.request.urlopen(url + "/status", timeout=10) as r:
            ns = json.loads(r.read())["node"]["namespaces"][0]
        out["restart"] = ns["restart"]
        out["kept_share"] = round(ns["restart"]["adopted"] / blocks, 4)
        sample = random.Random(2).sample(range(blocks), min(args.check, blocks))
        ids = client.prepare_load([key(i) for i in sample])
        pools = client.host_pools()
        assert pools is not None
        fd = os.open("/dev/shm" + pools.segments[0].name, os.O_RDONLY)
        pool = mmap.mmap(fd, blocks * PAGE, prot=mmap.PROT_READ)
        os.close(fd)
        out["checked_pages"] = len(sample)
        out["wrong_pages"] = sum(pool[h * PAGE:(h + 1) * PAGE] != page_bytes(i, base)
                                 for i, h in zip(sample, ids, strict=True))
        pool.close()
        client.complete_load([key(i) for i in sample])
        client.end_step()
        adopted = re.findall(r"(.*starting its stack.*|.*adopted.*)", log.read_text())
        out["log"] = [ln[:23] + ln[-90:] for ln in adopted][-2:]
    finally:
        if client is not None:
            client.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # no hand-over kept: node.handover is a stop's
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        for name in os.listdir("/dev/shm"):
            if did in name:
                os.unlink("/dev/shm/" + name)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
