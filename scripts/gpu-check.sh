#!/usr/bin/env bash
# kvtier on a CUDA GPU, from a fresh copy of the repository: install, the CUDA tests, the
# worker-process tests with their device pools on the GPU, and the transfer benchmark; one
# JSON summary at the end ($GPU_CHECK_OUT/gpu-check.json, also printed as the last line).
#
#   bash scripts/gpu-check.sh                       # a GPU machine with a package index
#   KVTIER_WHEELS=dir bash scripts/gpu-check.sh     # offline: kvtier's dependencies as wheels
#                                                   # (made beforehand by scripts/gpu-wheels.sh)
#
# A short lease: KVTIER_GPU_STEPS picks steps (default "bench cuda workers"),
# KVTIER_GPU_BENCH_ARGS adds arguments to the benchmark (e.g. "--fused-orders page
# --fused-jit"), KVTIER_GPU_CUDA_K selects the cuda tests by keyword (pytest -k).
#
# The machine's own torch (any CUDA build) is used: kvtier is installed without dependencies
# into a private folder, so the pinned torch==2.13.0 never replaces a working CUDA build.
# Exit status: 0 when every step passed, 1 when a step failed, 2 when there is no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-${OUT:-.gpu-check}}
SITE=${KVTIER_GPU_SITE:-$(mktemp -d -t kvtier-gpu-site.XXXXXX)}
mkdir -p "$OUT_DIR" "$SITE"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log() { printf '== %s\n' "$*" >&2; }

# redis-server and redis-cli bundled by scripts/gpu-wheels.sh (the GPU image has neither)
if [ -n "${KVTIER_WHEELS:-}" ] && [ -x "$KVTIER_WHEELS/redis/bin/redis-server" ]; then
  PATH="$(cd "$KVTIER_WHEELS/redis/bin" && pwd):$PATH"; export PATH
fi
log "install into $SITE"
if [ -n "${KVTIER_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$KVTIER_WHEELS"/*.whl \
    || exit 1
else
  # every runtime and test dependency except torch, from the package index
  deps=$("$PY" - <<'EOF'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = p["dependencies"] + p["optional-dependencies"]["dev"]
print(" ".join(r for r in reqs if not r.replace(" ", "").startswith("torch")))
EOF
)
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --target "$SITE" $deps || exit 1
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation --target "$SITE" .; then
  # no build backend usable offline: map the three folders into the namespace by hand,
  # exactly as pyproject.toml's package-dir does
  log "pip could not build kvtier; linking manager/, worker/, admin/, engine/, integrations/ as kvtier.*"
  mkdir -p "$SITE/kvtier"
  for p in manager worker admin engine integrations; do ln -sfn "$PWD/$p" "$SITE/kvtier/$p"; done
fi
"$PY" - <<'EOF' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu-check: torch sees no CUDA GPU")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name(0)}")
EOF

status=0
STEPS=" ${KVTIER_GPU_STEPS:-bench cuda workers} "
run_pytest() {  # name, then pytest arguments
  local name=$1; shift
  log "pytest: $name"
  "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT_DIR/$name.xml" "$@" \
    2>&1 | tee "$OUT_DIR/$name.log" | tail -n 25
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
}

# 1. the transfer benchmark on the GPU against one pinned copy of the same bytes: the fused
#    path (Triton), the eager zero-copy path and the staged one, interleaved in one run
#    (first: its figures are what a short lease must bring back)
if [[ $STEPS == *" bench "* ]]; then
  log "bench/transfer.py on cuda"
  # shellcheck disable=SC2086
  if ! "$PY" bench/transfer.py --device cuda --json --max-working-set-gib 12 \
      ${KVTIER_GPU_BENCH_ARGS:---fused-block-bytes 0 4096 16384} \
      >"$OUT_DIR/transfer.json" 2>"$OUT_DIR/transfer.log"; then
    status=1; tail -n 20 "$OUT_DIR/transfer.log"
  fi
fi

# 2. every test marked cuda (pools, copy paths, rank placement, two ranks on one GPU)
mapfile -t cuda_files < <(grep -l "mark.cuda" tests/test_*.py)
cuda_k=(); [ -z "${KVTIER_GPU_CUDA_K:-}" ] || cuda_k=(-k "$KVTIER_GPU_CUDA_K")
[[ $STEPS != *" cuda "* ]] || run_pytest cuda -m cuda "${cuda_files[@]}" "${cuda_k[@]}"
# 3. the worker-process tests with every device pool on the GPU: round trips device -> host
#    -> storage -> device byte for byte on every rank and layer, layer-by-layer loads, kill -9
#    of a worker mid-load (the Redis cases run only where redis-server and redis-cli are)
skip_redis=()
{ command -v redis-server && command -v redis-cli; } >/dev/null || skip_redis=(-k "not redis and not cluster and not share_pages")
[[ $STEPS != *" workers "* ]] || KVTIER_TEST_DEVICE=cuda run_pytest workers_on_cuda \
  tests/test_worker_processes.py tests/test_storage_tier.py "${skip_redis[@]}"
have_redis=0; { command -v redis-server && command -v redis-cli; } >/dev/null && have_redis=1
"$PY" - "$OUT_DIR" "$status" "$have_redis" <<'EOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
import torch
out, status, have_redis = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
summary = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "passed": status == 0, "steps": {},
           # what this script does not check, so a green summary is not read as more
           "redis_server": have_redis,
           "not_covered": ["several GPUs (ranks on distinct devices): one GPU here",
                           # tests/vllm_worker_check.py imports vLLM: a CUDA build of vLLM is
                           # not on the lent machines' image and is over what travels there
                           "the vLLM adapter's CUDA copy path (needs a CUDA build of vLLM)"]
                          + ([] if have_redis else
                             ["Redis-backed storage: no redis-server and redis-cli on this machine"])}
for name in ("cuda", "workers_on_cuda"):
    try:
        suite = ET.parse(out / f"{name}.xml").getroot().find("testsuite")
        summary["steps"][name] = {k: int(suite.get(k, 0)) for k in
                                  ("tests", "failures", "errors", "skipped")}
        summary["steps"][name]["failed"] = [
            f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None]
    except (OSError, ET.ParseError, AttributeError) as e:
        summary["steps"][name] = {"error": repr(e)}
try:
    summary["transfer"] = json.loads((out / "transfer.json").read_text())["results"]
except (OSError, ValueError, KeyError) as e:
    summary["transfer"] = {"error": repr(e)}
(out / "gpu-check.json").write_text(json.dumps(summary, indent=1))
# The ratio table (stderr, before the JSON line): each path against one pinned
# cudaMemcpyAsync of the same bytes, same run; layer 0 on the GPU's clock, in layer times.
rows = summary["transfer"] if isinstance(summary["transfer"], list) else []
print(f"{'block_kib':>9} {'blocks':>6} {'dir':>4} {'path':>9} {'ratio':>6} {'eager':>6} "
      f"{'staged GB/s':>11} {'layer0 gpu':>10}", file=sys.stderr)
for r in rows:
    l0 = r.get("layer0_gpu_in_layer_times", "-")
    print(f"{r['block_kib']:>9} {r['blocks']:>6} {r['direction']:>4} {r['path']:>9} "
          f"{r['ratio_vs_contiguous']:>6} {r.get('eager_ratio', '-'):>6} "
          f"{r.get('staged_gbps', '-'):>11} {l0:>10} "
          + " ".join(f"{k[:-6]}={v}" for k, v in r.items()
                     if k.endswith("_ratio") and k != "eager_ratio"), file=sys.stderr)
print(json.dumps(summary))
EOF
exit "$status"
