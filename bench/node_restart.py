"""Restart to first hit of `kvtier serve` with a large host tier (issue 37).

A `kvtier serve` child with `node.handover = true` and one namespace of `--gib` GiB of host
tier (512 KiB pages: 8 layers x 8 KV heads x 128 x 16 tokens, float16); an engine (a
`NodeClient` in this process, writing the pages itself as vLLM's attached adapter does)
fills every block, then the service is stopped (`--mode planned`: SIGTERM, a hand-over;
`--mode crash`: SIGKILL of its process group, the page journal) and started again. Timed:
the stop, and from the new service's launch to the engine's first host hit (the client
reattaches by itself), and the service's own figures (blocks adopted). Every page the
engine then loads is compared with what it wrote (a sample of `--check` pages, whole).

`--mode takeover`: `kvtier serve --takeover` is launched beside the running service while
the engine looks a block up every 2 ms; timed, the gap from the old service's last hit to
the new one's first (`gap_s`), and the launch to that first hit. `phases` is where the
time went, read from both services' logs (seconds from the new service's launch).

    python bench/node_restart.py [--gib 4] [--mode planned|crash|takeover] [--check 256]
                                 [--json]
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


def launch_serve(toml: Path, env: dict[str, str], log: Path,
                 *extra: str) -> subprocess.Popen[bytes]:
    f = log.open("ab")
    return subprocess.Popen([sys.executable, "-m", "kvtier.admin.cli", "serve", "--config",
                             str(toml), *extra], stdout=f, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_admin(proc: subprocess.Popen[bytes], log: Path, before: int) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.findall(r"admin listening on (http://\S+)", log.read_text())
        if len(found) > before and proc.poll() is None:
            return str(found[-1])
        time.sleep(0.05)
    raise SystemExit(f"kvtier serve did not start:\n{log.read_text()[-2000:]}")


# log line -> the phase it ends (the first match after the launch)
PHASES = {"config loaded (imports, config)": r"config: deployment",
          "takeover asked": r"taking over kvtier serve",
          "old: asked": r"taken over by kvtier serve",
          "old: hand-over written": r"hand-over written",
          "hand-over read (old's lock released)": r"hand-over read",
          "node socket bound": r"node socket listening",
          "namespace worker spawned": r"worker rank 0 starting \(pid \d+, log \S+-n",
          "namespace worker ready": r"worker rank 0 ready",
          "blocks adopted": r"handed-over block\(s\) adopted",
          "engine attached": r"engine pid \d+ attached",
          "old: exited": r"stopped: workers gone",
          "admin listening": r"admin listening on"}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def phases(logs: list[Path], since: float) -> dict[str, float]:
    """Seconds from `since` (epoch) to each phase's first log line at or after it."""
    lines: list[tuple[float, str]] = []
    for path in logs:
        for ln in path.read_text(errors="replace").splitlines():
            m = STAMP.match(ln)
            if m:
                t = time.mktime(time.strptime(m.group(1)[:19], "%Y-%m-%d %H:%M:%S"))
                t += int(m.group(1)[20:]) / 1e3
                if t >= since - 0.001:
                    lines.append((t, ln))
    lines.sort()
    out = {}
    patterns = dict(PHASES)
    for name in PHASES:
        for t, ln in lines:
            if re.search(patterns[name], ln):
                out[name] = round(t - since, 3)
                if name == "namespace worker spawned":  # its ready line, not the stack's
                    pid = re.search(r"pid (\d+)", ln)
                    if pid:
                        patterns["namespace worker ready"] = rf"ready \(pid {pid.group(1)}\)"
                break
    return dict(sorted(out.items(), key=lambda kv: kv[1]))


def start_serve(toml: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes],
                                                                      str]:
    before = len(re.findall(r"admin listening on", log.read_text())) if log.exists() else 0
    proc = launch_serve(toml, env, log)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = re.findall(r"admin listening on (http://\S+)", log.read_text())
        if len(found) > before and proc.poll() is None:
            return proc, found[-1]
        time.sleep(0.05)
    raise SystemExit(f"kvtier serve did not start:\n{log.read_text()[-2000:]}")


def take_over(client: NodeClient, old: subprocess.Popen[bytes], toml: Path,
              env: dict[str, str], work: Path,
              out: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str]:
    """`kvtier serve --takeover` launched while the engine looks up every 2 ms: the gap
    between the old service's last hit and the new one's first."""
    attaches = client.attaches
    log2 = work / "serve2.log"
    since = time.time()
    t = time.perf_counter()
    proc = launch_serve(toml, env, log2, "--takeover")
    last_old = first_new = reattached = None
    while first_new is None:
        now = time.perf_counter()
        if now - t > 120 or proc.poll() is not None:
            raise SystemExit(f"no hit from the new service:\n{log2.read_text()[-2000:]}")
        hit = client.lookup(key(0)) is Lookup.HIT
        now = time.perf_counter()
        if reattached is None and client.attaches != attaches:
            reattached = now
            out["reattached_s"] = round(now - t, 3)
        if hit and client.attaches == attaches:
            last_old = now
        elif hit:
            first_new = now
        time.sleep(0.002)
    assert last_old is not None, "no hit from the old service after the launch"
    out["gap_s"] = round(first_new - last_old, 3)
    out["launch_to_first_new_hit_s"] = round(first_new - t, 2)
    old.wait(60)
    url = wait_admin(proc, log2, 0)
    out["phases"] = phases([work / "serve.log", log2], since)
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--mode", choices=("planned", "crash", "takeover"), default="planned")
    ap.add_argument("--check", type=int, default=256, help="pages compared whole")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--logs", default="", help="a folder to copy the services' logs to")
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
        if args.mode == "takeover":
            proc, url = take_over(client, proc, toml, env, work, out)
        else:
            t = time.perf_counter()
            if args.mode == "planned":
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            out["stop_s"] = round(time.perf_counter() - t, 2)
            t = time.perf_counter()
            since = time.time()
            log2 = work / "serve2.log"
            proc = launch_serve(toml, env, log2)
            attaches = client.attaches
            while client.lookup(key(0)) is not Lookup.HIT:
                if time.perf_counter() - t > 120 or proc.poll() is not None:
                    raise SystemExit(f"no hit after the restart:\n{log2.read_text()[-2000:]}")
                if "reattached_s" not in out and client.attaches != attaches:
                    out["reattached_s"] = round(time.perf_counter() - t, 3)
                time.sleep(0.002)
            out["restart_to_first_hit_s"] = round(time.perf_counter() - t, 2)
            url = wait_admin(proc, log2, 0)
            out["serve_up_s"] = round(time.perf_counter() - t, 2)
            out["phases"] = phases([log2], since)

        with urllib.request.urlopen(url + "/status", timeout=10) as r:
            ns = json.loads(r.read())["node"]["namespaces"][0]
        out["restart"] = ns["restart"]
        out["kept_share"] = round(ns["restart"]["adopted"] / blocks, 4)
        sample = random.Random(2).sample(range(blocks), min(args.check, blocks))
        planned = client.prepare_load([key(i) for i in sample])
        ids = planned.host_ids
        fd = os.open("/dev/shm" + planned.pools.segments[0].name, os.O_RDONLY)
        pool = mmap.mmap(fd, blocks * PAGE, prot=mmap.PROT_READ)
        os.close(fd)
        out["checked_pages"] = len(sample)
        out["wrong_pages"] = sum(pool[h * PAGE:(h + 1) * PAGE] != page_bytes(i, base)
                                 for i, h in zip(sample, ids, strict=True))
        pool.close()
        client.complete_load([key(i) for i in sample])
        client.end_step()
        adopted = re.findall(r"(.*starting its stack.*|.*adopted.*)",
                             (work / "serve2.log").read_text())
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
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            for f in work.glob("serve*.log"):
                shutil.copy(f, Path(args.logs) / f.name)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
