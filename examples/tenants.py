"""Tenants by vLLM's cache_salt on one `kvtier serve` (issue 36), two vLLM processes: B pins
its system prompt through a kv_hints `kvtier.retain` v1 action, A floods the namespace, B
loads its prompt from the node's host tier exactly, and /lookup by token ids said so first.

Runs in the vLLM environment (`make vllm-env`): `.venv-vllm/bin/python examples/tenants.py
--json`. It is `examples/node_service.py --tenants` (the same engines and service) with only
the tenant figures printed, one JSON line last:

    b_pinned_tokens_after_flood   B's system prompt tokens vLLM loaded from kvtier after the flood
    b_identical_after_flood       B's tokens and logprobs equal its first (cold) run
    lookup_equals_load            /lookup's host tokens == what vLLM then loaded
    a_evicted_only_a              A's flood evicted A's own blocks (> 0), not one of B's
    clear_left_other_tenant       a clear of tenant A (REST) removed A's host blocks only
    clear_removals_announced      the service's event stream announced each removal
    warm_first_request_host_tokens  A's first request after a warm from storage: tokens
                                  it loaded out of the host tier (the service's count of
                                  its loads, at most what /lookup saw there before it)
    ttl_host_tokens_within        a prompt kept with a kv_hints ttl_s (5 s), its tenant
                                  flooded meanwhile: tokens B then loaded from the host (all)
    ttl_host_tokens_after         the same after the TTL ran out and a flood: none
    priority_high_host_tokens     of two prompts of one tenant (priority 2, then 1), a
    priority_low_host_tokens      flood evicted the lower one: host tokens of each after
    tenants                       the service's per-tenant figures (GET /tenants)

The last line is the figures the issue names, each computed by the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node_service

KEYS = ("b_identical_after_flood", "lookup_host_tokens", "b_own_evictions",
        "clear_removals_announced", "warm_first_request_cached_tokens",
        "warm_first_request_identical", "ttl_host_tokens_within", "ttl_host_tokens_after",
        "priority_high_host_tokens", "priority_low_host_tokens", "tenants")
# the figures: the last line of output
FIGURES = ("b_pinned_tokens_after_flood", "a_evicted_only_a", "warm_first_request_host_tokens",
           "lookup_equals_load", "clear_left_other_tenant")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model-dir", default="", help="where the random model is built")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    run_args = argparse.Namespace(model_dir=args.model_dir, seed=args.seed, tenants=True,
                                  kill_a=False, kill_serve=False, restart_serve=False,
                                  takeover_serve=False, repeat_prompts=0)
    with tempfile.TemporaryDirectory(prefix="kvtier-tenants-") as tmp:
        report = node_service.run(run_args, Path(tmp))
    out = {k: report[k] for k in KEYS}
    figures = {k: report[k] for k in FIGURES}
    if args.json:
        print(json.dumps(out), flush=True)
        print(json.dumps(figures), flush=True)
    else:
        print(json.dumps({**out, **figures}, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
