"""`kvtier replay --verify --json` on the first 500 requests of the shared Mooncake trace.

A black-box run of the main job: the console script, two worker processes, device and host
tiers (write_back, so the tiers are exclusive). Every hit from either tier is checked byte for
byte on both ranks before it counts; the run must report no corrupt block, hits from both
tiers, and a total hit rate within a point of the plain LRU simulation of the same blocks.

Why 500 requests and tiers of 8,000 and 32,000 blocks (3,000 requests until 2026-11-27, 85 s
on two quiet cores; then 1,000 with 16,000 and 64,000 blocks, 21.9 s in CI): the run time is in
proportion to the requests, and tiers scaled with them keep the regime. The first 500 fill the
8,000-block device tier many times over (7.1 M prompt tokens looked up, 111,000 blocks), so the
host tier serves hits (0.33 M tokens by the LRU simulation, 5,147 blocks each verified on both
ranks) beside the device tier's (0.26 M tokens, 3,992 blocks). test_fidelity keeps the 3,000
requests through the in-process manager.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from lru_reference import simulate
from support import clean_env, kvtier_script, leftovers, new_deployment_id
from test_fidelity import TRACE, block_identities, trace  # noqa: F401  (fixture)

# 500 trace requests through two worker processes
pytestmark = [pytest.mark.fast, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
LIMIT = 500
DEVICE_BLOCKS = 8000
HOST_BLOCKS = 32000

CONFIG = """\
deployment_id = "{dep}"
[model]
num_layers = 2
num_kv_heads = 2
head_dim = 8
dtype = "float16"
[cache]
block_size = 64
device_blocks = {device}
host_blocks = {host}
write_policy = "write_back"
[storage]
backend = "none"
[workers]
count = 2
device = "cpu"
[admin]
port = 0
"""


def test_replay_verify_first_500_trace_requests(tmp_path: Path, trace) -> None:  # noqa: F811
    cfg = tmp_path / "kvtier.toml"
    dep = new_deployment_id("trace")
    cfg.write_text(CONFIG.format(dep=dep, device=DEVICE_BLOCKS, host=HOST_BLOCKS))
    env = clean_env(TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [str(kvtier_script()), "replay", "--trace", str(TRACE), "--limit", str(LIMIT), "--verify",
         "--json", "--config", str(cfg)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"replay failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))

    assert report["requests"] == LIMIT
    assert report["corrupt_blocks"] == 0
    assert report["failed_loads"] == 0
    hits = report["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0, hits
    # Every hit block was checked on the device of both ranks before it was counted.
    assert report["verified_blocks"] * 64 == hits["device"] + hits["host"] + hits["storage"]
    assert report["transfer_bytes"]["d2h"] > 0 and report["transfer_bytes"]["h2d"] > 0

    sim = simulate(((block_identities(ids, n), n) for ids, n in trace[:LIMIT]), 64,
                   DEVICE_BLOCKS, HOST_BLOCKS)
    assert report["lookup_tokens"] == sim.lookup_tokens
    assert abs(report["hit_rate"] - sim.total_rate) < 0.01, (report["hit_rate"], sim.total_rate)

    left = leftovers(dep, 2)
    assert not left, f"deployment {dep} left behind: {left}"
