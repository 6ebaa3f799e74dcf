"""D2H and H2D throughput of kvtier's copy engine against a contiguous copy of the same bytes.

What is measured: one task of `blocks` random block ids (random device ids and random host
ids, drawn afresh for every repetition) copied device -> host (`d2h`, all layers at once) and
host -> device (`h2d`, layer by layer, as loads run), through `kvtier.worker.copy_engine.CopyEngine`
with a real `HostPool` in /dev/shm. The baseline, in the same run and interleaved with it, is
one contiguous `copy_` of exactly as many bytes between the same two pools. The ratio of the
two is what the copy strategy costs over the memory-bandwidth limit of the machine.

Block-size convention: `block_kib` is the size of one block of ONE layer with K and V counted
together (a 64 KiB block is 32 KiB of K plus 32 KiB of V per layer), so with 32 layers one
block moves 32 x 64 KiB = 2 MiB. The KV shape used is 8 KV heads x 128 head_dim in float16
(4 KiB of K+V per token), so block_size = block_kib / 4 tokens.

Threads: the copies are torch ops parallelised with OpenMP over all cores, and so is the
baseline. OpenMP threads spin-wait between parallel regions, which is fastest on an idle machine
but collapses when another process wants the same cores (a worker shares the machine with its
manager and, here, with whatever else runs). The run prints OMP_WAIT_POLICY and the load
average; run with OMP_WAIT_POLICY=PASSIVE to see behaviour under contention.

Working set: both pools are sized between `blocks` and `2 x blocks` blocks to stay under
`--max-working-set-gib` (default 3). A configuration whose task alone does not fit (256 KiB x
512 blocks x 32 layers is 4 GiB per pool) is reported as skipped rather than shrunk, because
shrinking the blocks would measure something else.

    python bench/transfer.py            # table
    python bench/transfer.py --json     # {"results": [{"block_kib": 64, "blocks": 512, ...}]}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvtier.worker.copy_engine import CopyEngine
from kvtier.worker.kv_pools import DevicePool, HostPool, KVShape

KV_HEADS, HEAD_DIM, DTYPE = 8, 128, "float16"
TOKEN_KV_BYTES = 2 * KV_HEADS * HEAD_DIM * 2  # K and V, float16


@dataclass
class Case:
    block_kib: int
    blocks: int
    pool_blocks: int
    shape: KVShape


def plan_cases(
    block_kibs: list[int], block_counts: list[int], layers: int, budget: int
) -> tuple[list[Case], list[dict[str, object]]]:
    cases: list[Case] = []
    skipped: list[dict[str, object]] = []
    for kib in block_kibs:
        if (kib * 1024) % TOKEN_KV_BYTES:
            raise SystemExit(f"--block-kib: {kib} is not a multiple of {TOKEN_KV_BYTES // 1024}")
        shape = KVShape(layers, KV_HEADS, HEAD_DIM, kib * 1024 // TOKEN_KV_BYTES, DTYPE)
        for n in block_counts:
            pool = min(2 * n, budget // (2 * shape.page_bytes))
            if pool < n:
                need = 2 * n * shape.page_bytes
                skipped.append(
                    {
                        "block_kib": kib,
                        "blocks": n,
                        "reason": f"needs {need / 2**30:.1f} GiB for two pools of {n} blocks, "
                        f"over --max-working-set-gib {budget / 2**30:g}",
                    }
                )
                continue
            cases.append(Case(kib, n, pool, shape))
    return cases, skipped


def _ignore_layer(layer: int) -> None:
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(case: Case, args: argparse.Namespace, gen: torch.Generator) -> list[dict[str, object]]:
    shape, n, pool_n = case.shape, case.blocks, case.pool_blocks
    dev = DevicePool(shape, pool_n, args.device)
    name = f"/kvtier_bench_{os.getpid()}_host"
    results: list[dict[str, object]] = []
    with HostPool(shape, pool_n, name) as host:
        dev_bytes = dev.data.view(-1).view(torch.uint8)
        host_bytes = host.data.view(-1)
        dev_bytes.fill_(0x5A)  # fault every page in before timing anything
        host_bytes.fill_(0xA5)
        engine = CopyEngine(dev, host, strategy=args.strategy,
                            fused_block_bytes=args.fused_block_bytes[0])
        cuda = dev.device.type == "cuda"
        # On CUDA the staged path (CPU gather into pinned buffers) runs beside the default
        # one, and so does the eager zero-copy path (PyTorch kernels through the mapped
        # pool) when the default is the fused one (a Triton kernel), so the choice between
        # them is measured in the same run, interleaved; further fused program sizes
        # (`--fused-block-bytes`) too.
        staged = CopyEngine(dev, host, cuda_path="staged") if cuda else None
        eager = (CopyEngine(dev, host, cuda_path="zero_copy")
                 if engine.cuda_path == "fused" else None)
        # the other fused variants, by name: program sizes and grid orders
        variants = {f"fused{bb}": CopyEngine(dev, host, cuda_path="fused", fused_block_bytes=bb)
                    for bb in args.fused_block_bytes[1:]} if eager is not None else {}
        if eager is not None:
            # the same engine with its small-task CUDA graphs off (Triton's dispatch and the
            # id ring for every task)
            variants["nograph"] = CopyEngine(dev, host, cuda_path="fused",
                                             fused_block_bytes=args.fused_block_bytes[0],
                                             fused_graph_max_ids=0)
            for order in args.fused_orders:
                variants[f"fused_{order}"] = CopyEngine(
                    dev, host, cuda_path="fused", fused_block_bytes=args.fused_block_bytes[0],
                    fused_order=order)
        layer0: list[float] = []
        page = shape.page_bytes
        nbytes = n * page

        def ids() -> tuple[torch.Tensor, torch.Tensor]:
            return (
                torch.randperm(pool_n, generator=gen)[:n],
                torch.randperm(pool_n, generator=gen)[:n],
            )

        def offset() -> tuple[int, int]:
            span = pool_n - n + 1
            a = int(torch.randint(span, (1,), generator=gen)) * page
            b = int(torch.randint(span, (1,), generator=gen)) * page
            return a, b

        # A worker checks a task's ids when it receives it (`TaskExecutor.precheck`), so
        # the measured engine's copies get checked ids, drawn and checked before the clock
        # starts; every other op draws its ids outside the clock too (`prep`). The
        # `checking` rows time the same engine with the check inside the call.
        def checked(op: str) -> Callable[[], tuple[object, ...]]:
            def prep() -> tuple[object, ...]:
                d, h = ids()
                return (engine.check("d2h", d, h),) if op == "d2h" else \
                    (engine.check("h2d", h, d),)
            return prep

        def engine_d2h(c: object) -> None:
            engine.d2h_checked(c)  # type: ignore[arg-type]

        # CUDA only: GPU-side marks of each load, in ms from an event recorded on the compute
        # stream just before the call (the copy stream waits on it): layer 0's copies done, a
        # kernel on the compute stream that waited for layer 0 (a GPU-side wait, enqueued from
        # the layer callback while the load is still being enqueued), the whole load done; and
        # the host time that wait + launch took.
        marks: list[dict[str, float]] = []
        probe = torch.zeros(1024, device=dev.device)
        last_layer = shape.total_layers - 1

        def engine_h2d(c: object) -> None:
            # the load as a runner issues it; layer 0's host-side readiness from its callback
            t0 = time.perf_counter()

            def on_layer(layer: int) -> None:
                if layer == 0:
                    layer0.append(time.perf_counter() - t0)

            engine.h2d_checked(c, on_layer)  # type: ignore[arg-type]

        def engine_h2d_marks(c: object) -> None:
            # the same load with GPU-side probes (events, a kernel on the compute stream):
            # timed apart, so the probes' host cost stays out of the ratio
            compute = torch.cuda.current_stream(dev.device)
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            events: dict[str, torch.cuda.Event] = {}
            host_us: list[float] = []

            def enqueued(layer: int, stream: torch.cuda.Stream) -> None:
                if layer not in (0, last_layer):
                    return
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(stream)
                if layer == last_layer:
                    events["end"] = ev
                if layer == 0:
                    t = time.perf_counter()
                    compute.wait_event(ev)  # no host sync: the GPU holds the kernel back
                    probe.add_(1)
                    done = torch.cuda.Event(enable_timing=True)
                    done.record(compute)
                    host_us.append((time.perf_counter() - t) * 1e6)
                    events["layer0"], events["compute"] = ev, done

            engine.h2d_checked(c, _ignore_layer, enqueued)  # type: ignore[arg-type]
            events["end"].synchronize()
            events["compute"].synchronize()
            marks.append({k: start.elapsed_time(e) for k, e in events.items()}
                         | {"wait_host_us": host_us[0]})

        def contig_d2h(a: int, b: int) -> None:
            host_bytes[b : b + nbytes].copy_(dev_bytes[a : a + nbytes])

        def contig_h2d(a: int, b: int) -> None:
            dev_bytes[a : a + nbytes].copy_(host_bytes[b : b + nbytes])

        def h2d_ids() -> tuple[object, ...]:
            d, h = ids()
            return h, d

        # name -> (prep: draws the op's arguments, untimed; run: the timed call)
        Op = tuple[Callable[[], tuple[object, ...]], Callable[..., None]]
        ops: dict[str, Op] = {
            "d2h": (checked("d2h"), engine_d2h),
            "d2h_contig": (offset, contig_d2h),
            "h2d": (checked("h2d"), engine_h2d),
            "h2d_contig": (offset, contig_h2d),
        }
        if cuda:
            ops["h2d_marks"] = (checked("h2d"), engine_h2d_marks)
            ops["d2h_checking"] = (ids, engine.d2h)
            ops["h2d_checking"] = (h2d_ids, engine.h2d)
        if staged is not None:
            ops["d2h_staged"] = (ids, staged.d2h)
            ops["h2d_staged"] = (h2d_ids, staged.h2d)
        if eager is not None:
            ops["d2h_eager"] = (ids, eager.d2h)
            ops["h2d_eager"] = (h2d_ids, eager.h2d)
        for name, other in variants.items():
            ops[f"d2h_{name}"] = (ids, other.d2h)
            ops[f"h2d_{name}"] = (h2d_ids, other.h2d)
        times: dict[str, list[float]] = {k: [] for k in ops}
        for prep, fn in ops.values():  # warm-up: staging buffers, graphs, first-touch
            fn(*prep())
        layer0.clear()
        marks.clear()
        order = list(ops)
        for rep in range(args.reps):
            for key in order if rep % 2 == 0 else reversed(order):
                prep, fn = ops[key]
                call_args = prep()
                _sync(dev.device)
                t0 = time.perf_counter()
                fn(*call_args)
                _sync(dev.device)
                times[key].append(time.perf_counter() - t0)
        for direction in ("d2h", "h2d"):
            ours = nbytes / statistics.median(times[direction]) / 1e9
            base = nbytes / statistics.median(times[direction + "_contig"]) / 1e9
            row: dict[str, object] = {
                "block_kib": case.block_kib,
                "blocks": n,
                "direction": direction,
                "path": engine.cuda_path,
                "gbps": round(ours, 2),
                "contiguous_gbps": round(base, 2),
                "ratio_vs_contiguous": round(ours / base, 3),
            }
            if staged is not None:
                other = nbytes / statistics.median(times[direction + "_staged"]) / 1e9
                row["staged_gbps"] = round(other, 2)
            if eager is not None:
                other = nbytes / statistics.median(times[direction + "_eager"]) / 1e9
                row["eager_gbps"] = round(other, 2)
                row["eager_ratio"] = round(other / base, 3)
            for name in [*variants, *(["checking"] if cuda else [])]:
                other = nbytes / statistics.median(times[f"{direction}_{name}"]) / 1e9
                row[f"{name}_ratio"] = round(other / base, 3)
            if direction == "h2d":
                # layer 0 ready, in units of one layer's share of the whole load: 1.0 means
                # layer 0 was usable after exactly its own copy time
                per_layer = statistics.median(times["h2d"]) / shape.num_layers
                row["layer0_ms"] = round(statistics.median(layer0) * 1e3, 3)
                row["layer0_in_layer_times"] = round(statistics.median(layer0) / per_layer, 2)
                if marks:
                    # The same in the GPU's own time: from the compute stream's mark to layer
                    # 0's event, in units of (the whole load on the GPU) / layers.
                    gpu_layer = statistics.median(m["end"] for m in marks) / shape.num_layers
                    gpu0 = statistics.median(m["layer0"] for m in marks)
                    row["layer0_gpu_ms"] = round(gpu0, 3)
                    row["layer0_gpu_in_layer_times"] = round(gpu0 / gpu_layer, 2)
                    # The compute stream's kernel ran after layer 0 and before the load
                    # ended, with no host wait (its enqueue cost `wait_host_us`).
                    row["compute_waited_on_gpu"] = all(
                        m["layer0"] <= m["compute"] < m["end"] for m in marks)
                    for key, name, digits in (("compute", "compute_done_ms", 3),
                                              ("end", "load_done_ms", 3),
                                              ("wait_host_us", "wait_host_us", 1)):
                        row[name] = round(statistics.median(m[key] for m in marks), digits)
            results.append(row)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per operation")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--block-kib", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 512])
    p.add_argument("--max-working-set-gib", type=float, default=3.0)
    p.add_argument("--strategy", choices=["auto", "runs", "gather"], default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fused-block-bytes", type=int, nargs="+", default=[0],
                   help="bytes per program of the fused kernel (CUDA): the first is the "
                   "measured engine's (0: the default), the others run beside it")
    p.add_argument("--fused-orders", nargs="*", default=[], choices=["pair", "page"],
                   help="grid orders of the fused kernel (CUDA) measured beside the engine's "
                   "(KVTIER_FUSED_ORDER, default auto), with the first program size")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    gen = torch.Generator().manual_seed(args.seed)
    budget = int(args.max_working_set_gib * 2**30)
    cases, skipped = plan_cases(args.block_kib, args.blocks, args.layers, budget)
    results: list[dict[str, object]] = []
    for case in cases:
        results.extend(run_case(case, args, gen))
    cuda = args.device != "cpu" and torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if args.json:
        out = {
            "results": results,
            "skipped": skipped,
            "layers": args.layers,
            "strategy": args.strategy,
            "device": device,
            "torch_threads": torch.get_num_threads(),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
            "load_average": os.getloadavg()[0],
        }
        print(json.dumps(out))
        return 0
    print(f"{args.layers} layers, random block ids, device={device}, strategy={args.strategy}, "
          f"{args.reps} interleaved repetitions (medians), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'block_kib':>9} {'blocks':>6} {'dir':>4} {'path':>9} {'GB/s':>7} "
          f"{'contig GB/s':>11} {'ratio_vs_contiguous':>19} {'staged GB/s':>11} "
          f"{'layer0 (layer times)':>20}")
    for r in results:
        staged_col = f"{r['staged_gbps']:>11.2f}" if "staged_gbps" in r else f"{'-':>11}"
        if "eager_gbps" in r:
            staged_col += f" eager {r['eager_gbps']:.2f} ({r['eager_ratio']:.3f})"
        l0 = f"{r['layer0_in_layer_times']:>20.2f}" if "layer0_ms" in r else f"{'-':>20}"
        if "layer0_gpu_in_layer_times" in r:  # CUDA: the same on the GPU's clock, and overlap
            l0 += (f"  gpu {r['layer0_gpu_in_layer_times']:.2f}, compute waited on GPU: "
                   f"{r['compute_waited_on_gpu']} ({r['wait_host_us']} us on the host)")
        print(f"{r['block_kib']:>9} {r['blocks']:>6} {r['direction']:>4} {r['path']:>9} "
              f"{r['gbps']:>7.2f} {r['contiguous_gbps']:>11.2f} "
              f"{r['ratio_vs_contiguous']:>19.3f} {staged_col} {l0}")
    for s in skipped:
        print(f"skipped block_kib={s['block_kib']} blocks={s['blocks']}: {s['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
