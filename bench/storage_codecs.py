"""What encrypting and compressing a storage page costs, on real KV bytes.

The KV is what a Hugging Face `LlamaForCausalLM` (seeded random weights, built from a config:
no hub access, like `examples/real_model.py`) computes for a prompt of random token ids, cut
into pages the way kvtier stores them: one block of `--block` tokens, K and V of every layer.
Three page kinds: the model run in bfloat16 and in float16 (its KV in that dtype), and the
float32 KV cast to float8_e4m3fn with one scale per block and KV head (amax / 448), as
`model.kv_scales = "per_block_head"` stores it (scales not included in the bytes measured).

Per page kind, the same pages go through every mode, interleaved round by round (mode order
rotates each round) so that a noisy neighbour hurts every mode alike:

* clear:      format 3 (`PageCodec`: keyed BLAKE3 MAC), seal and open;
* encrypted:  format 4 (`AeadPageCodec`: AES-256-GCM), seal and open;
* lz4, zstd1, zstd3: the compressor alone (lz4.frame, zstandard levels 1 and 3), compress and
              decompress (byte-exact check after each round);
* zstd1+enc / lz4+enc: compress, then seal the compressed bytes (what a compressing encrypted
              page would cost), and back.

Printed per kind and mode: stored bytes over raw bytes (ratio; header and tag included where
the mode has them) and MB/s of raw page bytes per core (one thread) to write (seal /
compress) and to read (open / decompress), medians over `--rounds`. Random-weight KV is not
trained KV: its values are closer to noise, so the ratios are a floor for compressibility
only in the sense that trained activations have more structure (outlier channels, smoother
heads); say so next to any figure taken from here.

    .venv/bin/python bench/storage_codecs.py [--layers 4] [--hidden 512] [--kv-heads 4]
        [--tokens 2048] [--block 16] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import lz4.frame
import torch
import zstandard
from kvtier.worker.storage.page_crypto import AeadPageCodec, PageKeys
from kvtier.worker.storage.page_format import PageCodec
from transformers import LlamaConfig, LlamaForCausalLM

SECRET = b"bench-storage-codecs-secret-0001"
NS = "bench/r0"


def kv_pages(args: argparse.Namespace) -> dict[str, list[bytes]]:
    """Pages of each kind: per block, K then V of every layer, `[tokens, kv_heads, head_dim]`
    each, as contiguous bytes."""
    torch.manual_seed(0)
    heads = args.hidden // args.head_dim
    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden,
                      intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                      num_attention_heads=heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=args.tokens)
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    out: dict[str, list[bytes]] = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                        ("float32", torch.float32)):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        layers = []  # per layer (K, V) as [tokens, kv_heads, head_dim]
        for layer in range(args.layers):
            k, v = cache.layers[layer].keys, cache.layers[layer].values
            layers.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
        if name == "float32":
            out["float8_e4m3fn"] = _pages(layers, args.block, fp8=True)
        else:
            out[name] = _pages(layers, args.block, fp8=False)
    return out


def _pages(layers: list[tuple[torch.Tensor, torch.Tensor]], block: int,
           fp8: bool) -> list[bytes]:
    tokens = layers[0][0].shape[0]
    pages = []
    for start in range(0, tokens - block + 1, block):
        parts = []
        for k, v in layers:
            for t in (k[start:start + block], v[start:start + block]):
                if fp8:  # one scale per KV head over the block (per_block_head)
                    amax = t.abs().amax(dim=(0, 2), keepdim=True).clamp(min=1e-12)
                    t = (t / amax * 448.0).to(torch.float8_e4m3fn)
                parts.append(t.contiguous().view(torch.uint8).reshape(-1))
        pages.append(bytes(torch.cat(parts).numpy()))
    return pages


Mode = tuple[Callable[[bytes, bytes], Any], Callable[[bytes, Any, int], bytes]]


def modes() -> dict[str, Mode]:
    clear = PageCodec(SECRET, NS)
    sealed = AeadPageCodec(PageKeys(SECRET), NS)
    z1 = zstandard.ZstdCompressor(level=1)
    z3 = zstandard.ZstdCompressor(level=3)
    zd = zstandard.ZstdDecompressor()

    def open_with(codec: PageCodec | AeadPageCodec) -> Callable[[bytes, Any, int], bytes]:
        def read(key: bytes, stored: Any, size: int) -> bytes:
            dest = bytearray(size)
            status = codec.decode_into(key, stored, memoryview(dest))
            assert status.value == "ok", status
            return bytes(dest)
        return read

    def seal_compressed(compress: Callable[[bytes], bytes]) -> Callable[[bytes, bytes], Any]:
        def write(key: bytes, page: bytes) -> Any:
            packed = compress(page)
            return len(packed), sealed.encode_page(key, packed)
        return write

    def open_compressed(decompress: Callable[[bytes, int], bytes],
                        ) -> Callable[[bytes, Any, int], bytes]:
        def read(key: bytes, stored: Any, size: int) -> bytes:
            n, page = stored
            packed = bytearray(n)
            assert sealed.decode_into(key, page, memoryview(packed)).value == "ok"
            return decompress(bytes(packed), size)
        return read

    def zstd_d(b: bytes, size: int) -> bytes:
        return zd.decompress(b, max_output_size=size)

    def lz4_d(b: bytes, size: int) -> bytes:
        return bytes(lz4.frame.decompress(b))

    return {
        "clear": (lambda k, p: clear.encode_page(k, p), open_with(clear)),
        "encrypted": (lambda k, p: sealed.encode_page(k, p), open_with(sealed)),
        "lz4": (lambda k, p: lz4.frame.compress(p), lambda k, s, n: lz4_d(s, n)),
        "zstd1": (lambda k, p: z1.compress(p), lambda k, s, n: zstd_d(s, n)),
        "zstd3": (lambda k, p: z3.compress(p), lambda k, s, n: zstd_d(s, n)),
        "lz4+enc": (seal_compressed(lz4.frame.compress), open_compressed(lz4_d)),
        "zstd1+enc": (seal_compressed(z1.compress), open_compressed(zstd_d)),
    }


def stored_len(stored: Any) -> int:
    if isinstance(stored, tuple):
        stored = stored[1]
    return memoryview(stored).nbytes


def measure(pages: list[bytes], rounds: int) -> dict[str, dict[str, float]]:
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(len(pages))]
    table = modes()
    raw = sum(len(p) for p in pages)
    writes: dict[str, list[float]] = {m: [] for m in table}
    reads: dict[str, list[float]] = {m: [] for m in table}
    ratio: dict[str, float] = {}
    names = list(table)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            write, read = table[name]
            t0 = time.perf_counter()
            stored = [write(k, p) for k, p in zip(keys, pages, strict=True)]
            t1 = time.perf_counter()
            back = [read(k, s, len(p)) for k, s, p in zip(keys, stored, pages, strict=True)]
            t2 = time.perf_counter()
            assert back == pages, f"{name}: not byte-exact"
            writes[name].append(raw / (t1 - t0) / 1e6)
            reads[name].append(raw / (t2 - t1) / 1e6)
            ratio[name] = sum(stored_len(s) for s in stored) / raw
    return {m: {"ratio": ratio[m], "write_mb_s": statistics.median(writes[m]),
                "read_mb_s": statistics.median(reads[m])} for m in table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {kind: measure(pages, args.rounds) for kind, pages in kv_pages(args).items()}
    if args.json:
        print(json.dumps(results, indent=1))
        return
    page = args.layers * 2 * args.block * args.kv_heads * args.head_dim
    print(f"pages of {args.block} tokens, {args.layers} layers x {args.kv_heads} KV heads x "
          f"{args.head_dim}: {page * 2} B (16-bit), {page} B (fp8); "
          f"{args.tokens // args.block} pages per kind; medians of {args.rounds} rounds, "
          "one thread")
    print(f"{'kind':<14}{'mode':<11}{'stored/raw':>11}{'write MB/s':>12}{'read MB/s':>11}")
    for kind, by_mode in results.items():
        for mode, r in by_mode.items():
            print(f"{kind:<14}{mode:<11}{r['ratio']:>11.3f}{r['write_mb_s']:>12.0f}"
                  f"{r['read_mb_s']:>11.0f}")


if __name__ == "__main__":
    main()
