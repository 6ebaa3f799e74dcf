"""A Hugging Face Llama whose paged KV cache kvtier serves from every tier, bit for bit.

This process plays both sides of an engine. The model-runner side runs a `LlamaForCausalLM`
(built from a `LlamaConfig` with seeded random weights: no hub access); its paged KV lives in
tensors it allocates itself in vLLM's layout (per layer `[2, num_blocks, block_size, kv_heads,
head_dim]`, in shared memory: `kvtier.worker.engine_kv.shared_kv_tensor`) and registers
(`KVRegistration`). The scheduler side embeds kvtier's manager (`kvtier.manager.stack.Stack`
with `workers.engine_kv = true`): kvtier's worker process attaches to the registered KV and
does every copy (device <-> host, host <-> storage). For each request:

1. `match(request_id, tokens)`: the cached prefix's block ids (a host or storage hit is loaded
   onto those blocks by the worker), then `allocate` blocks for the rest;
2. per layer, wait until the layer is loaded (`LayerWaiter.wait(seq, layer, timeout)`, which
   reads the workers' progress, no manager needed), then gather its K and V from the block
   table into the model's own cache (`DynamicCache().update(k, v, layer)`): the keys were
   stored with RoPE applied, so they go back at the positions they were computed at;
3. run the model on the remaining tokens with that cache (`position_ids` / `cache_position`
   continue after the prefix), and write the K and V of the newly computed full blocks from
   the cache into their blocks;
4. `commit`, `release`.

The logits of every request served with a kvtier prefix must be bitwise equal to those of the
same request whose prefix KV is computed fresh in this process (a forward over the prefix,
then over the rest with that cache), in float32 and bfloat16.

`--dtypes float8_e4m3fn` runs the float32 model with a quantized paged KV: each block of each
layer's K and V is stored as float8 with one float32 scale per KV head (its absolute maximum
/ 448), in scale tensors of the runner's own (per layer a K and a V tensor `[num_blocks,
kv_heads]`) that it registers with the KV (`model.kv_scales = "per_block_head"`); the runner
dequantizes on read. The reference then quantizes and dequantizes the fresh prefix the same
way, so the logits are bitwise equal only if every fp8 byte and every scale came back from
the tier exactly as it went out. The prefix is served from the
device, from the host (evicted from the device by another request, loaded back), from file
storage after a restart of everything (new stack, new registration, fresh KV tensors, same
storage folder), and from Redis when a `redis-server` binary is on PATH (the example runs its
own on a free port). Everything lives under one temp folder and is stopped and removed at the
end. Run it from the repository root:

    python examples/real_model.py [--json] [--dtypes float32,bfloat16]
                                  [--negative-control wrong-block-table|foreign-block|
                                                      foreign-scales]

Exit status 0 when every difference is 0.0, 1 otherwise (what a negative control must give).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvtier.manager.config import KvtierConfig
from kvtier.manager.errors import TransferFailedError
from kvtier.manager.scheduler import KVCacheManager, MatchResult
from kvtier.manager.stack import Stack
from kvtier.worker.engine_kv import KVRegistration, LayerWaiter, shared_kv_tensor
from kvtier.worker.ipc import TaskAborted
from kvtier.worker.wire import TaskKind
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 128, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS
BLOCK = 8  # tokens per KV block
DEVICE_BLOCKS, HOST_BLOCKS = 16, 64
PREFIX = 4 * BLOCK  # the shared prompt prefix kvtier serves: 4 full blocks
SUFFIX = BLOCK + 4  # each request's own tail: one more full block and a partial one
LOAD_TIMEOUT_S = 30.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the model's and the KV's
FP8 = "float8_e4m3fn"  # a float32 model over a float8 paged KV with per-block scales
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
ALL_DTYPES = (*DTYPES, FP8)
COPY_KINDS = (TaskKind.D2H, TaskKind.H2D, TaskKind.BACKUP, TaskKind.PREFETCH)
# Where the model and its paged KV live (--device): "cpu" (the KV in POSIX shared memory the
# worker maps by name) or "cuda" (the KV allocated by torch on cuda:0; the worker process opens
# it through CUDA IPC handles).
DEVICE = torch.device("cpu")


# ------------------------------------------------------------------------------- the model


def build_model(dtype: torch.dtype) -> LlamaForCausalLM:
    """A 2-layer Llama (4 query heads, 2 KV heads) with weights drawn from a fixed seed."""
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=4 * DEVICE_BLOCKS * BLOCK, attn_implementation="sdpa")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.to(dtype).to(DEVICE).eval()


@torch.no_grad()
def forward(model: LlamaForCausalLM, tokens: list[int], start: int,
            cache: DynamicCache) -> torch.Tensor:
    """Logits of `tokens[start:]`, with `cache` holding the K/V of `tokens[:start]` (it is
    extended with the new tokens' K/V)."""
    positions = torch.arange(start, len(tokens), device=DEVICE)
    out = model(input_ids=torch.tensor([tokens[start:]], device=DEVICE), past_key_values=cache,
                position_ids=positions[None], cache_position=positions, use_cache=True)
    return out.logits[0].float().cpu()


def reference(model: LlamaForCausalLM, tokens: list[int], prefix: int,
              quantized: bool = False) -> torch.Tensor:
    """Logits of `tokens[prefix:]` with the prefix's KV computed fresh in this process
    (`quantized`: then stored as float8 blocks with scales and read back, as the runner
    stores and reads it)."""
    cache = DynamicCache()
    if prefix:
        forward(model, tokens[:prefix], 0, cache)
    if quantized and prefix:
        fresh, cache = cache, DynamicCache()
        for layer in range(LAYERS):
            kv = []
            for t in (fresh.layers[layer].keys, fresh.layers[layer].values):
                blocks = t[0].permute(1, 0, 2).reshape(-1, BLOCK, KV_HEADS, HEAD_DIM)
                back = dequantize(*quantize(blocks)).to(t.dtype)
                kv.append(back.flatten(0, 1).permute(1, 0, 2).unsqueeze(0).contiguous())
            cache.update(kv[0], kv[1], layer)
    return forward(model, tokens, prefix, cache)


# ------------------------------------------------------------------------------- paged KV


class PagedKV:
    """The model runner's paged KV memory: per layer, K and V blocks viewed as
    [num_blocks, block_size, kv_heads, head_dim]; with `k_scales` / `v_scales` (float8 KV),
    per layer a float32 [num_blocks, kv_heads] scale tensor for each, and blocks hold
    `round(x / scale)` in float8."""

    def __init__(self, k_blocks: list[torch.Tensor], v_blocks: list[torch.Tensor],
                 k_scales: list[torch.Tensor] | None = None,
                 v_scales: list[torch.Tensor] | None = None, dtype: torch.dtype = torch.float32,
                 ) -> None:
        self.k, self.v = k_blocks, v_blocks
        self.k_scales, self.v_scales = k_scales, v_scales
        self.dtype = dtype  # the model's

    def gather(self, layer: int, block_ids: list[int], num_tokens: int,
               scale_ids: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `num_tokens` tokens of the blocks, as the cache wants them:
        [1, kv_heads, num_tokens, head_dim] (dequantized with the scales of `scale_ids`,
        by default the same blocks)."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=DEVICE)
        sids = ids if scale_ids is None else torch.tensor(scale_ids, dtype=torch.long,
                                                          device=DEVICE)

        def one(blocks: torch.Tensor, scales: list[torch.Tensor] | None) -> torch.Tensor:
            got = blocks[ids]
            if scales is not None:
                got = dequantize(got, scales[layer][sids]).to(self.dtype)
            rows = got.flatten(0, 1)[:num_tokens]  # [T, kv_heads, head_dim]
            return rows.permute(1, 0, 2).unsqueeze(0).contiguous()

        return one(self.k[layer], self.k_scales), one(self.v[layer], self.v_scales)

    def scatter(self, layer: int, block_ids: list[int], first_block: int,
                keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write tokens [first_block * BLOCK, len(block_ids) * BLOCK) of a layer's cache
        tensors ([1, kv_heads, T, head_dim]) into their blocks (quantized, with scales)."""
        ids = torch.tensor(block_ids[first_block:], dtype=torch.long, device=DEVICE)
        if not len(ids):
            return
        a, b = first_block * BLOCK, len(block_ids) * BLOCK

        def blocks_of(t: torch.Tensor) -> torch.Tensor:
            return t[0, :, a:b].permute(1, 0, 2).reshape(len(ids), BLOCK, KV_HEADS, HEAD_DIM)

        for blocks, scales, t in ((self.k, self.k_scales, keys), (self.v, self.v_scales, values)):
            if scales is None:
                blocks[layer][ids] = blocks_of(t)
            else:
                q, scale = quantize(blocks_of(t))
                blocks[layer][ids] = q
                scales[layer][ids] = scale


def quantize(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [n, BLOCK, kv_heads, head_dim] as float8 and their float32 scales [n, kv_heads]:
    one scale per block and KV head, its absolute maximum over the block's tokens / 448."""
    x = blocks.float()
    scale = (x.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (x / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None, :, None]


@dataclass
class Runner:
    """The scheduler API, the paged KV memory and the model of one life of the deployment."""

    manager: KVCacheManager
    kv: PagedKV
    model: LlamaForCausalLM
    wait_layer: Callable[[MatchResult, int], None]
    settle: Callable[[], None]  # returns once no transfer is in flight
    control: str | None = None  # a negative control: how to read the prefix wrongly


@dataclass
class Served:
    hit: MatchResult
    prefix: int  # tokens served by kvtier and used
    logits: torch.Tensor  # of tokens[prefix:]


def serve(r: Runner, request_id: str, tokens: list[int]) -> Served:
    """One request through the scheduler API, the model computing only what is not cached."""
    m = r.manager
    hit = m.match(request_id, tokens)
    try:
        new_blocks = m.allocate(request_id, len(tokens) - hit.num_tokens)
        blocks = hit.block_ids + new_blocks  # the request's block table
        table = list(hit.block_ids)  # where the runner reads the served prefix from
        if r.control == "wrong-block-table" and len(table) >= 2:
            table[0], table[1] = table[1], table[0]
        elif r.control == "foreign-block" and table and new_blocks:
            table[-1] = new_blocks[0]  # a block that does not hold this prefix's KV
        scale_table = list(table)
        if r.control == "foreign-scales" and table and new_blocks:
            scale_table[-1] = new_blocks[0]  # the right fp8 bytes, another block's scales
        # Rebuild the model's cache from the blocks, layer by layer as each one lands.
        prefix, cache = hit.num_tokens, DynamicCache()
        for layer in range(LAYERS):
            if not prefix:
                break
            try:
                r.wait_layer(hit, layer)
            except TransferFailedError as e:  # keep what is still good, recompute the rest
                if layer and e.valid_tokens:
                    cache.crop(e.valid_tokens - prefix)  # negative: drops that many tokens
                prefix = e.valid_tokens
                if not prefix:
                    cache = DynamicCache()
                    break
            cache.update(*r.kv.gather(layer, table, prefix, scale_table), layer)
        logits = forward(r.model, tokens, prefix, cache)
        # The newly computed full blocks' K/V, from the cache into their blocks.
        full = len(tokens) // BLOCK
        for layer in range(LAYERS):
            lc = cache.layers[layer]
            r.kv.scatter(layer, blocks[:full], prefix // BLOCK, lc.keys, lc.values)
        m.commit(request_id, tokens, len(tokens))
    finally:
        m.release(request_id)
    return Served(hit, prefix, logits)


# ------------------------------------------------------------------------------- a deployment


def kvtier_config(tag: str, dtype: str, storage: dict[str, Any]) -> KvtierConfig:
    return KvtierConfig(
        deployment_id=f"realmodel-{os.getpid()}-{tag}",
        model={"name": "real-model-example", "num_layers": LAYERS, "num_kv_heads": KV_HEADS,
               "head_dim": HEAD_DIM, "dtype": dtype,
               "kv_scales": "per_block_head" if dtype == FP8 else "none"},
        cache={"block_size": BLOCK, "device_blocks": DEVICE_BLOCKS, "host_blocks": HOST_BLOCKS,
               "write_policy": "write_through", "decode_reserve_blocks": 0},
        storage={"prefetch_policy": "wait_complete", "prefetch_threshold": BLOCK, **storage},
        workers={"device": DEVICE.type, "count": 1, "engine_kv": True,
                 **({"cuda_devices": "0"} if DEVICE.type == "cuda" else {})})


@contextlib.contextmanager
def deployment(cfg: KvtierConfig, model: LlamaForCausalLM, control: str | None,
               report: Report) -> Iterator[Runner]:
    """One life of the deployment: the model runner's KV memory, allocated here in vLLM's
    layout and registered; the stack (manager + one worker process per rank, which attaches
    to that memory); a layer waiter reading the workers' per-layer progress."""
    dep, rank, ranks = cfg.deployment_id, 0, cfg.workers.count
    fp8 = cfg.model.dtype == FP8
    dtype = torch.float8_e4m3fn if fp8 else DTYPES[cfg.model.dtype]
    # Model-runner side: per layer one [2, num_blocks, block_size, kv_heads, head_dim]
    # tensor (K then V), in shared memory so the rank's worker process can map it.
    shape = (2, DEVICE_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    if DEVICE.type == "cuda":  # torch's own allocation; the worker opens it via CUDA IPC
        kv = [torch.zeros(shape, dtype=dtype, device=DEVICE) for _ in range(LAYERS)]
    else:
        kv = [shared_kv_tensor(dep, rank, shape, dtype, tag=f"l{layer}")
              for layer in range(LAYERS)]
    # float8: per layer a K and a V scale tensor [num_blocks, kv_heads], beside the caches.
    scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    if fp8:
        if DEVICE.type == "cuda":
            scales = [(torch.zeros((DEVICE_BLOCKS, KV_HEADS), device=DEVICE),
                       torch.zeros((DEVICE_BLOCKS, KV_HEADS), device=DEVICE))
                      for _ in range(LAYERS)]
        else:
            scales = [(shared_kv_tensor(dep, rank, (DEVICE_BLOCKS, KV_HEADS), torch.float32,
                                        tag=f"s{layer}k"),
                       shared_kv_tensor(dep, rank, (DEVICE_BLOCKS, KV_HEADS), torch.float32,
                                        tag=f"s{layer}v")) for layer in range(LAYERS)]
    with (KVRegistration(dep, rank, kv, "vllm", block_size=BLOCK, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, scales=scales),
          Stack(cfg) as stack,  # scheduler side: the manager, its workers attach to `kv`
          LayerWaiter(dep, ranks) as waiter):
        copies: list[TaskKind] = []  # copy tasks every rank's worker process finished

        def observe(kind: TaskKind, blocks: int, seconds: float) -> None:
            if kind in COPY_KINDS:
                copies.append(kind)

        stack.add_transfer_observer(observe)

        def wait_layer(hit: MatchResult, layer: int) -> None:
            try:
                for seq in hit.handle.seqs:  # the loads this prefix depends on
                    waiter.wait(seq, layer, LOAD_TIMEOUT_S)
                    report.layer_waits += 1
            except TaskAborted:  # a load failed: the scheduler side knows what is still good
                hit.handle.wait(LOAD_TIMEOUT_S)  # raises TransferFailedError(valid_tokens)
                raise

        paged = PagedKV([t[0] for t in kv], [t[1] for t in kv],
                        None if scales is None else [k for k, _ in scales],
                        None if scales is None else [v for _, v in scales])
        runner = Runner(stack.require_manager(), paged, model, wait_layer,
                        lambda: wait_backups(stack), control)
        yield runner
        wait_backups(stack)
        if copies:  # the worker processes (not this one) moved the blocks
            for kind in copies:
                report.copies[kind.name.lower()] = report.copies.get(kind.name.lower(), 0) + 1
            report.worker_pids.update(
                w["pid"] for w in stack.status()["workers"]
                if w["pid"] is not None and w["pid"] != os.getpid())


def wait_backups(stack: Stack, timeout: float = LOAD_TIMEOUT_S) -> None:
    """Bounded wait until no transfer is in flight: copies to the host, and the storage
    backups they start, are done. With the engine's KV a host copy is backed up only once a
    registration check has confirmed it, so that wait includes the confirmations (a fast
    scheduler otherwise finishes before the next check and nothing reaches storage)."""
    m = stack.require_manager()
    deadline = time.monotonic() + timeout
    while True:
        if not m.dispatcher.drain(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"transfers still in flight after {timeout:.0f} s")
        if not m.unconfirmed_device_copies():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"host copies still unconfirmed after {timeout:.0f} s")
        time.sleep(0.01)


# ------------------------------------------------------------------------------- redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def redis_server(binary: str, workdir: Path) -> Iterator[str]:
    """A throwaway redis-server on a free 127.0.0.1 port (nothing persisted); its URL."""
    port = free_port()
    with open(workdir / "redis.log", "wb") as log:
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not _pong(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port} (see "
                                   f"{workdir / 'redis.log'})")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _pong(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


# ------------------------------------------------------------------------------- the run


@dataclass
class Report:
    diffs: dict[str, dict[str, float]] = field(default_factory=dict)  # tier -> dtype -> diff
    served: dict[str, dict[str, int]] = field(default_factory=dict)  # tier -> dtype -> tokens
    worker_pids: set[int] = field(default_factory=set)
    copies: dict[str, int] = field(default_factory=dict)  # copy tasks done, by kind
    layer_waits: int = 0  # LayerWaiter.wait calls (loads of host and storage hits)

    def check(self, tier: str, dtype: str, model: LlamaForCausalLM, tokens: list[int],
              got: Served) -> None:
        """Compare a served request with its reference; note the difference and the tokens
        `tier` served."""
        tokens_from_tier = {"device": got.hit.device_tokens, "host": got.hit.host_tokens,
                            "storage_file": got.hit.storage_tokens,
                            "storage_redis": got.hit.storage_tokens}[tier]
        if tokens_from_tier < PREFIX or got.prefix != PREFIX:
            raise AssertionError(f"{dtype} {tier}: the prefix was not served by {tier} "
                                 f"({got.hit}, {got.prefix} tokens used)")
        want = reference(model, tokens, got.prefix, quantized=dtype == FP8)
        diff = (got.logits - want).abs().max().item()
        self.diffs.setdefault(tier, {})[dtype] = diff
        self.served.setdefault(tier, {})[dtype] = tokens_from_tier
        print(f"{dtype:<9} {tier:<14}: {got.prefix} tokens served, "
              f"{len(tokens) - got.prefix} computed, max |logit diff| {diff:.3g}")


def run_dtype(dtype: str, tmp: Path, redis_url: str | None, control: str | None,
              report: Report) -> None:
    model = build_model(DTYPES.get(dtype, torch.float32))
    g = torch.Generator().manual_seed(1)

    def draw(n: int) -> list[int]:
        return torch.randint(VOCAB, (n,), generator=g).tolist()

    prefix = draw(PREFIX)
    prompts = {name: prefix + draw(SUFFIX) for name in ("a", "b", "c", "d", "e")}
    filler = draw(DEVICE_BLOCKS * BLOCK)  # takes every device block
    file_storage = {"backend": "file", "path": str(tmp / f"storage-{dtype}")}
    tag = "fp8" if dtype == FP8 else dtype[:4]  # deployment ids: realmodel-<pid>-<tag><life>
    with deployment(kvtier_config(f"{tag}1", dtype, file_storage), model, control,
                    report) as r:
        cold = serve(r, "cold", prompts["a"])
        if cold.hit.num_tokens:
            raise AssertionError(f"{dtype}: a fresh deployment had a hit: {cold.hit}")
        report.check("device", dtype, model, prompts["b"], serve(r, "device", prompts["b"]))
        # Another prompt takes every device block, so the prefix leaves the device (the host
        # keeps the copy write_through made). A block is evictable once its copy to the host
        # is done: let the copies in flight finish before and after.
        r.settle()
        serve(r, "filler", filler)
        r.settle()
        report.check("host", dtype, model, prompts["c"], serve(r, "host", prompts["c"]))
    # A restart of everything: new stack, new KV memory, the same storage folder.
    with deployment(kvtier_config(f"{tag}2", dtype, file_storage), model, control,
                    report) as r:
        report.check("storage_file", dtype, model, prompts["d"],
                     serve(r, "storage", prompts["d"]))
    if redis_url is None:
        return
    redis_storage = {"backend": "redis", "url": redis_url}
    with deployment(kvtier_config(f"{tag}3", dtype, redis_storage), model, control,
                    report) as r:
        serve(r, "cold", prompts["a"])
    with deployment(kvtier_config(f"{tag}4", dtype, redis_storage), model, control,
                    report) as r:
        report.check("storage_redis", dtype, model, prompts["e"],
                     serve(r, "storage", prompts["e"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--negative-control",
                   choices=["wrong-block-table", "foreign-block", "foreign-scales"],
                   help="read every served prefix wrongly, so the logits must differ and the "
                   "exit status be 1: wrong-block-table swaps its first two block ids, "
                   "foreign-block reads its last block from a block that holds other KV, "
                   f"foreign-scales ({FP8} only) reads its last block's scales from such a "
                   "block")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model and its paged KV live (cuda: cuda:0, the KV reaches "
                   "kvtier's worker process through CUDA IPC)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help=f"comma-separated model dtypes, {FP8}: a float32 model over a float8 "
                   "KV with per-block scales (default: %(default)s)")
    args = p.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in ALL_DTYPES for d in dtypes):
        p.error(f"--dtypes {args.dtypes!r}: a comma-separated subset of {', '.join(ALL_DTYPES)}")
    if args.negative_control == "foreign-scales" and dtypes != [FP8]:
        p.error(f"--negative-control foreign-scales needs --dtypes {FP8} (only it has scales)")
    global DEVICE
    DEVICE = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    report = Report()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvtier-real-model-") as tmp_name:
        tmp = Path(tmp_name)
        with contextlib.ExitStack() as running:
            redis_url, binary = None, shutil.which("redis-server")
            if binary is not None:
                redis_url = running.enter_context(redis_server(binary, tmp))
            for dtype in dtypes:
                run_dtype(dtype, tmp, redis_url, args.negative_control, report)
    worst = {tier: max(by_dtype.values()) for tier, by_dtype in report.diffs.items()}
    exact = all(d == 0.0 for d in worst.values())
    result = {
        "max_abs_logit_diff": worst,
        "max_abs_logit_diff_by_dtype": report.diffs,
        "served_tokens": report.served,
        "worker_processes": len(report.worker_pids),
        "worker_pids": sorted(report.worker_pids),
        "worker_copy_tasks": report.copies,
        "layer_waits": report.layer_waits,
        "dtypes": dtypes,
        "device": args.device,
        "negative_control": args.negative_control,
        "exact": exact,
        "elapsed_s": round(time.monotonic() - started, 2),
    }
    if not args.json:
        print(("ok: " if exact else "MISMATCH: ") + ", ".join(
            f"{t} {d:.3g}" for t, d in worst.items()))
    else:
        print(json.dumps(result))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
