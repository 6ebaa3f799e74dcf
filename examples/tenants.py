"""Tenants by vLLM's cache_salt on one `kvtier serve` (issue 36), two vLLM processes: B pins
its system prompt through a kv_hints `kvtier.retain` v1 action, A floods the namespace, B
loads its prompt from the node's host tier exactly, and /lookup by token ids said so first.

Runs in the vLLM environment (`make vllm-env`): `.venv-vllm/bin/python examples/tenants.py
--json`. It is `examples/node_service.py --tenants` (the same engines and service) with only
the tenant figures printed, one JSON line last:

    b_pinned_tokens_after_flood   B's system prompt tokens vLLM loaded from kvtier after the flood
    b_identical_after_flood       B's tokens and logprobs equal its first (cold) run
    lookup_equals_load            /lookup's host tokens == what vLLM then loaded
    a_evicted_only_a              A evicted its own blocks (> 0), B none
    tenants                       the service's per-tenant figures (GET /tenants)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import node_service

KEYS = ("b_pinned_tokens_after_flood", "b_identical_after_flood", "lookup_host_tokens",
        "lookup_equals_load", "lookup_us", "lookup_hash_us", "a_evicted_only_a", "tenants")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    ap.add_argument("--model-dir", default="", help="where the random model is built")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    run_args = argparse.Namespace(model_dir=args.model_dir, seed=args.seed, tenants=True,
                                  kill_a=False, kill_serve=False)
    with tempfile.TemporaryDirectory(prefix="kvtier-tenants-") as tmp:
        report = node_service.run(run_args, Path(tmp))
    out = {k: report[k] for k in KEYS}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
