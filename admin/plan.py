"""`kvtier plan`: how big each tier must be for a workload's reuse, from one pass over it.

Reads the same inputs as `kvtier replay` (a Mooncake trace or a built-in workload, the
configuration's block size, KV shape and tier sizes), runs `kvtier.manager.plan` (the stack
distance pass and the curves: see there what is exact) and prints a summary, one JSON
object (`--json`, on the last line) and a plot (`--plot PNG`: the device curve, LRU's exact
one beside the clairvoyant offline (Belady) curve, and the device + host curve at the
configured device size, the configured sizes marked).

Exit statuses: 0 done, 2 bad input (a configuration key, a trace line, an option), 1 the plot
could not be written (the report is printed first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.admin.inputs import add_source_arguments, requests_from_args
from kvtier.manager.workloads import TraceError


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    add_source_arguments(p)
    p.add_argument("--limit", type=int, metavar="N", help="plan for the first N requests only")
    p.add_argument("--config", metavar="FILE",
                   help="TOML configuration (block size, KV shape, tier sizes, write policy)")
    p.add_argument("--json", action="store_true",
                   help="print everything as one JSON object (the last line)")
    p.add_argument("--plot", metavar="PNG", help="write the hit-rate curves as a PNG")
    p.add_argument("--points", type=int, default=80, metavar="N",
                   help="points per curve (at least 50; default 80)")
    p.add_argument("--offline-points", type=int, default=24, metavar="N",
                   help="about 1.5x N sizes of the clairvoyant offline (Belady) curve, one "
                        "pass each (0: none; default 24)")
    p.add_argument("--policies", metavar="A,B,...", default="",
                   help="eviction policies (cache.eviction_policy values) whose device curves "
                        "to add, each by replay at about 1.5x --policy-points sizes")
    p.add_argument("--policy-points", type=int, default=8, metavar="N",
                   help="sizes per --policies curve, about 1.5x N (default 8)")


def run_plan_command(args: argparse.Namespace) -> int:
    """`kvtier plan`: 0, 1 when the plot cannot be written, 2 on bad input."""
    # The configuration (pydantic), numpy and the pass load only for this subcommand: cli
    # builds every parser at start, so `kvtier --help` and `kvtier status` import this module.
    from kvtier.manager.config import ConfigError, load_config, page_bytes
    from kvtier.manager.plan import PlanInputs, build_plan, stack_profile
    from kvtier.manager.policies import EVICTION_POLICIES

    try:
        if args.points < 50:
            raise ConfigError(f"--points must be >= 50, got {args.points}")
        if args.offline_points < 0:
            raise ConfigError(f"--offline-points must be >= 0, got {args.offline_points}")
        policies = [p for p in args.policies.split(",") if p]
        bad = [p for p in policies if p not in EVICTION_POLICIES]
        if bad:
            raise ConfigError(f"--policies: unknown {', '.join(map(repr, bad))}; expected "
                              f"names from {', '.join(EVICTION_POLICIES)}")
        if args.policy_points < 1:
            raise ConfigError(f"--policy-points must be >= 1, got {args.policy_points}")
        # Planning sizes pools for the machine that will run them, not this one.
        cfg = load_config(args.config, check_resources=False)
        requests = requests_from_args(args)
    except (ConfigError, TraceError) as e:
        print(f"kvtier plan: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    profile = stack_profile(requests, cfg.cache.block_size)
    pass_s = time.perf_counter() - t0
    inputs = PlanInputs(
        block_size=cfg.cache.block_size,
        block_bytes=page_bytes(cfg) * cfg.workers.count,
        device_blocks=cfg.cache.device_blocks,
        host_blocks=cfg.cache.host_blocks,
        write_policy=cfg.cache.write_policy,
        storage=cfg.storage.backend != "none",
    )
    plan = build_plan(profile, inputs, args.points, args.offline_points, policies, requests,
                      args.policy_points)
    plan["elapsed_s"] = round(time.perf_counter() - t0, 3)
    plan["stack_pass_s"] = round(pass_s, 3)
    plan["accesses_per_s"] = round(profile.accesses / pass_s) if pass_s else 0
    if args.json:
        print(json.dumps(plan))
    else:
        print_plan(plan)
    if args.plot:
        try:
            plot_plan(plan, args.plot)
        except OSError as e:
            print(f"kvtier plan: --plot {args.plot!r}: {e.strerror or e}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"plot written to {Path(args.plot).resolve()}")
    return 0


def _size(blocks: int, block_bytes: int) -> str:
    b = blocks * block_bytes
    return f"{blocks:,} blocks ({b / 2**30:,.2f} GiB)" if b >= 2**30 else (
        f"{blocks:,} blocks ({b / 2**20:,.1f} MiB)")


def print_plan(p: dict[str, Any]) -> None:
    bb = p["block_bytes"]
    cfg = p["configured"]
    print(f"requests {p['requests']:,}   prompt tokens {p['lookup_tokens']:,}   block "
          f"{p['block_size']} tokens = {bb:,} bytes   {p['block_accesses']:,} block accesses, "
          f"{p['distinct_blocks']:,} distinct   ({p['accesses_per_s']:,} accesses/s)")
    print(f"achievable hit rate (unbounded cache): {p['achievable_hit_rate']:.1%}, reached "
          f"with {_size(p['saturation_device_blocks'], bb)}; cold-miss floor "
          f"{p['storage']['cold_miss_floor']:.1%}")
    print("device tier alone, sizes for a share of the achievable hit rate:")
    for k, v in p["device_targets"].items():
        print(f"  {k:>4}: {_size(v['device_blocks'], bb):<32} hit rate {v['token_hit_rate']:.1%}")
    d = p["device_only"]
    print(f"configured device_blocks = {cfg['device_blocks']:,}: hit rate "
          f"{d['token_hit_rate']:.1%}, {d['prefill_tokens_saved_per_request']:,.0f} prefill "
          f"tokens saved per request{'' if d['exact'] else ' (not exact: capped repeats)'}")
    if "offline" in p:
        o = p["offline"]["configured"]
        print(f"clairvoyant offline (Belady) at device_blocks = {cfg['device_blocks']:,}: hit "
              f"rate {o['token_hit_rate']:.1%} (LRU {o['lru_token_hit_rate']:.1%}): what any "
              "eviction policy could at most reach at that size")
    for name, curve in p.get("policy_curves", {}).items():
        at = {int(s): r for s, r in curve}
        print(f"eviction_policy = {name} (by replay): " + ", ".join(
            f"{s:,} blocks {at[s]:.1%}" for s in sorted(at)[::max(1, len(at) // 6)])
            + (f"; configured {at[cfg['device_blocks']]:.1%}"
               if cfg["device_blocks"] in at else ""))
    t = p["two_tier"]
    tc = t["configured"]
    print(f"device {cfg['device_blocks']:,} + host blocks ({t['write_policy']}"
          f"{', exact' if t['exact'] else ', estimate'}), host sizes for a share of the "
          "achievable hit rate:")
    for k, v in t["host_targets"].items():
        print(f"  {k:>4}: " + ("not reachable" if v is None else _size(v["host_blocks"], bb)))
    print(f"configured host_blocks = {tc['host_blocks']:,}: hit rate {tc['token_hit_rate']:.1%} "
          f"(device {tc['device_token_hit_rate']:.1%}, host {tc['host_token_hit_rate']:.1%}), "
          f"{tc['prefill_tokens_saved_per_request']:,.0f} prefill tokens saved per request")
    if "note" in t:
        print(f"  note: {t['note']}")
    s = p["storage"]
    print(f"storage (every block kept, shared across instances) adds "
          f"{s['adds_over_tiers']:.1%} over the configured tiers"
          f"{'' if s['configured'] else ' (no storage tier configured)'}")
    if p["capped_repeats"]:
        print(f"{p['capped_repeats']} capped repeat(s): device curve exact from "
              f"{p['exact_from_device_blocks']:,} blocks up")


def plot_plan(p: dict[str, Any], path: str) -> None:
    """The device curve and the two-tier curve, configured sizes marked, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bb = p["block_bytes"]
    gib = 2.0**30
    cfg = p["configured"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=100)
    xs = [s * bb / gib for s, _ in p["device_curve"]]
    ys = [r for _, r in p["device_curve"]]
    ax1.plot(xs, ys, color="tab:blue", label="LRU (exact)")
    if "offline_curve" in p:
        ax1.plot([s * bb / gib for s, _ in p["offline_curve"]],
                 [r for _, r in p["offline_curve"]], color="black", ls="--", marker=".",
                 ms=3, label="offline (Belady), a bound")
    for name, curve in p.get("policy_curves", {}).items():
        ax1.plot([s * bb / gib for s, _ in curve], [r for _, r in curve], marker="x", ms=4,
                 lw=1, label=f"{name} (replay)")
    ax1.axvline(cfg["device_blocks"] * bb / gib, color="tab:red", ls="--",
                label=f"device_blocks = {cfg['device_blocks']:,}")
    ax1.axhline(p["achievable_hit_rate"], color="grey", ls=":", label="achievable")
    for name, v in p["device_targets"].items():
        x, y = v["device_blocks"] * bb / gib, v["token_hit_rate"]
        ax1.plot([x], [y], "o", color="tab:blue", ms=4)
        ax1.annotate(name, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax1.set_xlabel("device pool (GiB over all ranks)")
    ax1.set_ylabel("token hit rate")
    ax1.set_title("device tier alone")
    t = p["two_tier"]
    hx = [h * bb / gib for h, _ in t["curve"]]
    hy = [r for _, r in t["curve"]]
    ax2.plot(hx, hy, color="tab:green",
             label="write_back" + (" (exact)" if t["exact"] else
                                   f" (estimate for {t['write_policy']})"
                                   if t["write_policy"] != "write_back" else ""))
    ax2.axvline(cfg["host_blocks"] * bb / gib, color="tab:red", ls="--",
                label=f"host_blocks = {cfg['host_blocks']:,}")
    ax2.axhline(p["achievable_hit_rate"], color="grey", ls=":", label="achievable")
    ax2.set_xlabel(f"host pool (GiB), device at {cfg['device_blocks']:,} blocks")
    ax2.set_title("device + host")
    top = min(1.0, p["achievable_hit_rate"] * 1.25 + 0.02)
    for ax in (ax1, ax2):
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"kvtier plan: {p['requests']:,} requests, block {p['block_size']} tokens")
    fig.tight_layout()
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
