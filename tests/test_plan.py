"""`kvtier plan` (kvtier.manager.plan, kvtier.admin.plan): the stack-distance pass and its
curves, held to a brute-force LRU stack, to the scheduler itself, and to real `kvtier replay`
runs.

* The Fenwick pass against a list-based LRU stack (hypothesis): same distances, same capped
  repeats, for arbitrary block streams.
* The curves against the scheduler (`KVCacheManager`, in process, driven exactly as replay
  drives it) at every device size of small random prefix-sharing workloads: device only, and
  write_back at several host sizes (hypothesis).
* The command: its JSON (keys, >= 50 ascending points from 1 block), its plot, its one-line
  errors.
* Exactness against real `kvtier replay --json` runs (worker processes) at 3 sizes per mode,
  device only and write_back, on the shared trace, the chat workload and a generated trace
  with capped repeats (slow).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtier.manager.plan import (
    INF,
    device_hit_blocks,
    profile_from_ids,
    saturation_size,
    stack_profile,
    two_tier_hits,
)
from kvtier.manager.scheduler import KVCacheManager
from support import clean_env, examples, kvtier_script, leftovers, new_deployment_id

pytestmark = pytest.mark.fast

# The shared workspace's trace (beside the checkout); KVTIER_TEST_TRACE names another copy.
TRACE = Path(os.environ.get("KVTIER_TEST_TRACE") or (
    Path(__file__).resolve().parents[2] / "shared" / "traces"
    / "mooncake_conversation_trace.jsonl"))


# ------------------------------------------------------------------ the pass vs a plain stack


def brute_force(reqs: list[list[int]], lens: list[int], bs: int) -> tuple[list[int], list[int]]:
    """Prefix-max distances and capped-repeat distances from a Python list as the LRU stack
    (most recent first), touched tail first at each request's end."""
    stack: list[int] = []
    dist: list[int] = []
    capped: list[int] = []
    for blocks, n in zip(reqs, lens, strict=True):
        limit = min(max(n - 1, 0) // bs, len(blocks))
        run = 0
        for b in blocks[:limit]:
            d = stack.index(b) + 1 if b in stack else INF
            run = max(run, d)
            dist.append(run)
        touch = list(reversed(blocks))
        if limit < len(blocks) and blocks[-1] in stack:
            capped.append(stack.index(blocks[-1]) + 1)
            touch = touch[1:]
        for b in touch:
            if b in stack:
                stack.remove(b)
        stack[:0] = touch[::-1]  # block 0 ends on top
    return dist, capped


@st.composite
def block_streams(draw: st.DrawFn) -> tuple[list[list[int]], list[int], int]:
    bs = draw(st.integers(1, 4))
    n_req = draw(st.integers(1, 25))
    reqs: list[list[int]] = []
    lens: list[int] = []
    for _ in range(n_req):
        nf = draw(st.integers(0, 8))
        blocks = draw(st.lists(st.integers(0, 12), min_size=nf, max_size=nf, unique=True))
        reqs.append(blocks)
        lens.append(nf * bs + draw(st.integers(0, bs - 1)))
    return reqs, lens, bs


@given(block_streams())
@settings(max_examples=examples(200), deadline=None)
def test_stack_distances_match_a_plain_lru_stack(stream: tuple[list[list[int]], list[int],
                                                              int]) -> None:
    reqs, lens, bs = stream
    prof = profile_from_ids([np.array(r, dtype=np.int64) for r in reqs], lens, bs)
    dist, capped = brute_force(reqs, lens, bs)
    assert prof.dist.tolist() == dist
    assert prof.capped_repeats == capped
    assert prof.accesses == sum(len(r) for r in reqs) - len(capped)


# ------------------------------------------------------------------ the curves vs the scheduler


def run_scheduler(prompts: list[list[int]], bs: int, device: int, host: int,
                  policy: str = "write_back") -> tuple[int, int]:
    """Device and host hit tokens of `prompts` replayed as `kvtier replay` drives the
    scheduler (match, wait, allocate the rest, commit all, release; one at a time)."""
    m = KVCacheManager(block_size=bs, device_blocks=device, host_blocks=host,
                       write_policy=policy)
    dev = hst = 0
    for i, tokens in enumerate(prompts):
        rid = f"r{i}"
        mr = m.match(rid, tokens)
        mr.handle.wait()
        m.allocate(rid, len(tokens) - mr.num_tokens, reserve_blocks=0)
        m.commit(rid, tokens, len(tokens))
        m.release(rid)
        dev += mr.device_tokens
        hst += mr.host_tokens
    return dev, hst


@st.composite
def prompt_streams(draw: st.DrawFn) -> tuple[list[list[int]], int]:
    """Prompts that share prefixes (each extends a random earlier one, or an empty one, by
    a few tokens; some repeat one exactly), over a tiny vocabulary."""
    bs = draw(st.integers(2, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(draw(st.integers(2, 30))):
        base = rng.choice(prompts) if prompts and rng.random() < 0.8 else []
        cut = rng.randint(0, len(base))
        if rng.random() < 0.15 and base:
            prompts.append(list(base[:max(1, cut)]))
            continue
        prompts.append(base[:cut] + [rng.randrange(3) for _ in range(rng.randint(1, 3 * bs))])
    return prompts, bs


@given(prompt_streams())
@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_curves_equal_the_scheduler_at_every_size(case: tuple[list[list[int]], int]) -> None:
    prompts, bs = case
    prof = stack_profile(prompts, bs)
    lo = max(prof.min_device_blocks, prof.exact_from_device_blocks, 1)
    sat = saturation_size(prof)
    top = max(lo, sat) + 2
    curve = device_hit_blocks(prof, top)
    for d in range(lo, top + 1):
        dev, hst = run_scheduler(prompts, bs, d, 0)
        assert hst == 0
        assert dev == curve[d] * bs, (d, dev // bs, curve[d])
    hosts = np.array(sorted({1, 2, 3, 5, 8, max(1, sat // 2), sat + 1}))
    devs = sorted({lo, lo + 1, (lo + top) // 2})
    for d in devs:
        res = two_tier_hits(prof, d, hosts)
        for h, dh, hh, starved in zip(hosts, res.device_hits, res.host_hits, res.starved,
                                      strict=True):
            if starved:
                continue
            assert run_scheduler(prompts, bs, d, int(h)) == (dh * bs, hh * bs), (d, h)
    # host_blocks = 0 through the two-tier recurrence is the device curve.
    r0 = two_tier_hits(prof, np.arange(lo, top + 1), 0)
    assert r0.device_hits.tolist() == curve[lo:top + 1].tolist()


def test_capped_repeat_is_counted_and_bounds_exactness() -> None:
    """A prompt of exactly k blocks seen before never matches its last block: the pass
    counts it and says from which device size the curve is exact."""
    bs = 4
    a = list(range(8))  # 2 full blocks, exact multiple
    b = list(range(100, 120))
    prof = stack_profile([a, b, a], bs)
    assert len(prof.capped_repeats) == 1
    # Block 1 of `a` was 6 blocks deep (b's 5 blocks and block 0 of `a` above it).
    assert prof.capped_repeats == [7]
    assert prof.exact_from_device_blocks == 8
    curve = device_hit_blocks(prof, 12)
    for d in range(max(prof.min_device_blocks, 8), 13):
        assert run_scheduler([a, b, a], bs, d, 0)[0] == curve[d] * bs


# ------------------------------------------------------------------ the command


def plan_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kvtier_script()), "plan", *args], cwd=cwd,
                          env=clean_env(TMPDIR=str(cwd)), capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.slow  # two `kvtier plan` runs and a matplotlib figure: ~5-10 s
def test_plan_json_curves_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "docs" / "plan.png"
    proc = plan_cli("--workload", "chat", "--limit", "120", "--json", "--plot", str(png),
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["block_size"] == 64
    curve = out["device_curve"]
    sizes = [s for s, _ in curve]
    rates = [r for _, r in curve]
    assert len(curve) >= 50 and sizes[0] == 1 and sizes == sorted(set(sizes))
    assert sizes[-1] == max(out["saturation_device_blocks"], 50)
    assert rates == sorted(rates) and rates[-1] == out["achievable_hit_rate"] > 0
    assert rates[-2] < rates[-1]  # the last point is where the curve stops rising
    two = out["two_tier"]
    assert len(two["curve"]) >= 50 and two["curve"][0][0] == 1
    assert set(out["device_targets"]) == {"50%", "80%", "90%", "95%", "99%"}
    for v in out["device_targets"].values():
        assert v["token_hit_rate"] >= 0
    assert out["device_only"]["prefill_tokens_saved_per_request"] > 0
    assert 0 < out["storage"]["cold_miss_floor"] < 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = plan_cli("--workload", "chat", "--limit", "120", cwd=tmp_path)
    assert text.returncode == 0 and "99%" in text.stdout and "achievable" in text.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["--limit", "-1"], "--limit must be >= 0"),
    (["--points", "10"], "--points must be >= 50"),
    (["--trace", "no-such-file.jsonl"], "no-such-file.jsonl"),
    (["--config", "bad.toml"], "cache.block_size"),
])
def test_plan_bad_input_is_one_line(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "bad.toml").write_text("[cache]\nblock_size = 0\n")
    proc = plan_cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier plan: ") and needle in lines[0], (
        proc.stderr)


# ------------------------------------------------------------------ exact against replay

CONFIG = """\
deployment_id = "{dep}"
[model]
num_layers = 1
num_kv_heads = 1
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
count = 1
device = "cpu"
[admin]
port = 0
"""


def _config(tmp_path: Path, device: int, host: int) -> tuple[Path, str]:
    dep = new_deployment_id("plan")
    path = tmp_path / f"kvtier-{device}-{host}.toml"
    path.write_text(CONFIG.format(dep=dep, device=device, host=host))
    return path, dep


def _last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _replay(tmp_path: Path, source: list[str], device: int, host: int) -> dict[str, Any]:
    cfg, dep = _config(tmp_path, device, host)
    proc = subprocess.run(
        [str(kvtier_script()), "replay", *source, "--json", "--config", str(cfg)],
        cwd=tmp_path, env=clean_env(TMPDIR=str(tmp_path)), capture_output=True, text=True,
        timeout=600, check=False)
    report = _last_json(proc)
    assert not leftovers(dep, 1)
    return report


REPLAYS_AT_ONCE = 2
"""Replays side by side: each is a `kvtier replay` and one worker process, mostly waiting on
each other or starting up, so two of them on two cores take well under twice one's time."""


def _replays(tmp_path: Path, source: list[str], sizes: list[tuple[int, int]]
             ) -> list[dict[str, Any]]:
    """`_replay` at every (device, host) of `sizes`, REPLAYS_AT_ONCE at a time; reports in
    the order of `sizes`. Each run has its own config file and deployment id."""
    with concurrent.futures.ThreadPoolExecutor(REPLAYS_AT_ONCE) as pool:
        return list(pool.map(lambda dh: _replay(tmp_path, source, *dh), sizes))


SIZES_PER_MODE = 3
"""Replayed sizes per mode (five until 2026-11-27: 30 replays, 100 s of CI's fast tier, each
replay mostly its two process starts). Three knees: of the curve's points, the smallest
size of each of three different hit rates, the lowest and the highest rate among them; at a
knee a plan off by a little capacity is off in its rate, and no two replays check alike."""


def _knees(points: list[list[float]], low: int) -> list[list[float]]:
    """SIZES_PER_MODE curve points from `low` up, each the smallest size of its hit rate,
    spread over the distinct rates (the lowest and the highest included)."""
    knees: list[list[float]] = []
    for p in points:
        if p[0] >= low and (not knees or p[1] != knees[-1][1]):
            knees.append(p)
    assert len(knees) >= SIZES_PER_MODE, knees
    last = len(knees) - 1
    idx = sorted({round(k * last / (SIZES_PER_MODE - 1)) for k in range(SIZES_PER_MODE)})
    return [knees[i] for i in idx]


def _generated_trace(path: Path) -> None:
    """A Mooncake-format trace of conversations over a shared system prompt, some prompts
    repeated exactly, lengths often exact multiples of 64 (capped repeats)."""
    rng = random.Random(7)
    lines = []
    next_id = 1
    convs: list[list[int]] = []
    for _ in range(160):
        if convs and rng.random() < 0.7:
            ids = rng.choice(convs)
            if rng.random() < 0.8:  # the next turn; otherwise the same prompt again
                k = rng.randint(1, 3)
                ids.extend(range(next_id, next_id + k))
                next_id += k
        else:
            k = rng.randint(1, 4)
            ids = [0, *range(next_id, next_id + k)]
            next_id += k
            convs.append(ids)
        n = len(ids) * 512 - (rng.choice([0, 64, 128]) if rng.random() < 0.5
                              else rng.randint(1, 511))
        lines.append(json.dumps({"timestamp": 0, "input_length": n, "output_length": 1,
                                 "hash_ids": list(ids)}))
    path.write_text("\n".join(lines) + "\n")


SOURCES = {
    "shared-trace": lambda tmp: ["--trace", str(TRACE), "--limit", "400"],
    "chat": lambda tmp: ["--workload", "chat", "--limit", "250"],
    "generated-trace": lambda tmp: ["--trace", str(tmp / "gen.jsonl")],
}


@pytest.mark.slow  # 6 replays with a worker process each
@pytest.mark.parametrize("source", list(SOURCES))
def test_plan_equals_replay(tmp_path: Path, source: str) -> None:
    if source == "shared-trace" and not TRACE.is_file():
        pytest.skip(f"trace file {TRACE} is absent (it ships in the shared workspace)")
    _generated_trace(tmp_path / "gen.jsonl")
    src = SOURCES[source](tmp_path)
    # Both plans first, then their replays in one pool: each replay is mostly its two
    # process starts (0.3 s of a 6-12 s run replays the 400 shared-trace requests), so one
    # pool saves a round over two. `--offline-points 0`: the offline curve is not checked
    # here (the curves checked are the same with and without it).
    plan_args = [*src, "--json", "--offline-points", "0", "--config"]
    # Device only: three knees of the curve, from the smallest pool replay accepts up.
    cfg, _ = _config(tmp_path, 64, 0)  # the device curve does not depend on it
    plan = _last_json(plan_cli(*plan_args, str(cfg), cwd=tmp_path))
    if source == "generated-trace":
        assert plan["capped_repeats"] > 0  # the case the exactness bound is about
    low = max(plan["min_device_blocks"], plan["exact_from_device_blocks"])
    sizes = _knees(plan["device_curve"], low)
    # write_back: the configured device size, three knees of the two-tier host curve.
    device = low + 4
    cfg, _ = _config(tmp_path, device, 1)
    wb_plan = _last_json(plan_cli(*plan_args, str(cfg), cwd=tmp_path))
    two = wb_plan["two_tier"]
    assert two["write_policy"] == "write_back" and two["device_blocks"] == device
    bad = set(two["inexact_host_sizes"])
    points = [p for p in two["curve"] if p[0] not in bad]
    hosts = _knees(points, 1)
    runs = _replays(tmp_path, src, [(int(s), 0) for s, _ in sizes]
                    + [(device, int(h)) for h, _ in hosts])
    checked = []
    for (size, rate), got in zip(sizes, runs[:SIZES_PER_MODE], strict=True):
        assert got["requests"] == plan["requests"]
        assert got["lookup_tokens"] == plan["lookup_tokens"]
        assert got["hit_rate"] == rate, (size, got["hit_tokens"], rate)
        checked.append((size, rate))
    assert len({r for _, r in checked}) == SIZES_PER_MODE, checked  # no two serve alike
    checked = []
    for (host, rate), got in zip(hosts, runs[SIZES_PER_MODE:], strict=True):
        assert got["hit_rate"] == rate, (device, host, got["hit_tokens"], rate)
        checked.append((host, rate))
    assert len({r for _, r in checked}) == SIZES_PER_MODE, checked


def test_recommended_host_sizes_are_the_smallest() -> None:
    """Each recommended host size reaches its share of the achievable hit rate and one
    block less does not (or the device alone reaches it: host 0)."""
    from kvtier.manager.plan import PlanInputs, build_plan
    from kvtier.manager.workloads import chat_requests

    prof = stack_profile(chat_requests(200), 64)
    best = int(device_hit_blocks(prof)[-1])
    out = build_plan(prof, PlanInputs(64, 1, 100, 0, "write_back"))
    seen = []
    for key, v in out["two_tier"]["host_targets"].items():
        want = -(-int(key[:-1]) * best // 100)
        h = v["host_blocks"]
        seen.append(h)
        r = two_tier_hits(prof, 100, [max(h - 1, 0), h])
        total = (r.device_hits + r.host_hits).tolist()
        assert total[1] >= want
        assert h == 0 or total[0] < want, (key, h, total, want)
    assert seen == sorted(seen) and seen[-1] > 0
    d = out["device_targets"]
    curve = device_hit_blocks(prof)
    for key, v in d.items():
        want = -(-int(key[:-1]) * best // 100)
        s = v["device_blocks"]
        assert curve[s] >= want and (s == 1 or curve[s - 1] < want), (key, s)


@pytest.mark.slow  # matplotlib's import and a failed save: ~3 s
def test_plot_that_cannot_be_written_is_one_line_after_the_report(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    proc = plan_cli("--workload", "chat", "--limit", "20", "--json", "--plot",
                    str(tmp_path / "file" / "plan.png"), cwd=tmp_path)
    assert proc.returncode == 1
    assert json.loads(proc.stdout.strip().splitlines()[-1])["requests"] == 20
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier plan: --plot "), proc.stderr
