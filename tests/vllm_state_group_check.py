"""A model with a state (Mamba) KV cache group in a real vLLM with kvtier: refused at start, in
one line naming the group. Run in vLLM's environment by tests/test_vllm.py.

A tiny random Jamba (transformers, no hub access): Mamba mixers and attention layers
alternating, which vLLM's CPU build puts in a Mamba group and a full-attention group (it starts
the engine; its CPU Mamba mixer cannot run a forward pass, so only the start is checked).
Prefix caching is on, so vLLM offloads the Mamba group too. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def build(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import JambaConfig, JambaForCausalLM

    torch.manual_seed(0)
    cfg = JambaConfig(vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                      num_experts=1, num_experts_per_tok=1, attn_layer_period=2,
                      attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                      mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                      use_mamba_kernels=False, max_position_embeddings=512)
    JambaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def main() -> int:
    from kvtier.integrations.vllm import VllmAdapterError
    from vllm import LLM
    from vllm.config import KVTransferConfig

    model = build(Path(sys.argv[1]))
    kt = KVTransferConfig(
        kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"spec_name": "KvtierOffloadingSpec",
                                   "spec_module_path": "kvtier.integrations.vllm",
                                   "host_blocks": 16, "admin": False})
    out: dict[str, object] = {"refused": ""}
    try:
        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True,
                  dtype="bfloat16", block_size=32, max_model_len=320, seed=0,
                  enable_prefix_caching=True, kv_transfer_config=kt)
    except VllmAdapterError as e:
        out["refused"] = str(e)
    else:
        core = llm.llm_engine.engine_core.engine_core
        out["groups"] = [type(g.kv_cache_spec).__name__
                         for g in core.scheduler.kv_cache_config.kv_cache_groups]
        del llm
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
