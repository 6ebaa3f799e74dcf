"""Host time of each step of one small fused backup on CUDA, against the kernel's and one
pinned memcpy's time on the GPU's clock: where a small copy's time goes when it is bound by
the host rather than the bus (README "Transfers").

    python bench/fused_profile.py [--block-kib 16] [--blocks 64] [--iters 60]

Steps timed (host, medians after 10 warm-up iterations): the two id checks (`pairs`), the
wait for the compute stream, the ids' ring (pinned row + DMA), the launch, the wait for the
copy; the same backup through its CUDA graph (`g_`: ids into the graph's pinned row, the
wait, the replay, the wait for the copy); then the whole `d2h` and `h2d` calls (ids checked
inside, and `checked_`: checked beforehand, as a worker does), a contiguous copy of the
same bytes, and the kernel alone on the GPU's clock. CUDA with Triton only."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kvtier.worker.copy_engine import CopyEngine
from kvtier.worker.kv_pools import DevicePool, HostPool, KVShape


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block-kib", type=int, default=16)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--iters", type=int, default=60)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fused_profile: needs a CUDA GPU")
    shape = KVShape(32, 8, 128, args.block_kib * 1024 // 4096, "float16")
    n, pool = args.blocks, 2 * args.blocks
    dev = DevicePool(shape, pool, "cuda")
    with HostPool(shape, pool, "/kvtier_fused_profile") as host:
        e = CopyEngine(dev, host)
        if e.cuda_path != "fused":
            raise SystemExit(f"fused_profile: the engine took the {e.cuda_path} path")
        gen = torch.Generator().manual_seed(0)

        def ids() -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randperm(pool, generator=gen)[:n],
                    torch.randperm(pool, generator=gen)[:n])

        stream = e._d2h_stream
        (launch,) = e._fused_launches("d2h")
        nbytes = n * shape.page_bytes
        dev_bytes, host_bytes = dev.data.view(-1).view(torch.uint8), host.data.view(-1)
        steps = ("pairs", "wait_compute", "ring", "launch", "sync")
        gsteps = ("g_stage", "g_wait_compute", "g_replay", "g_sync")
        graphs = e._graph_sets[0]
        cap = graphs.cap_for(n)
        got = graphs.graphs("d2h", cap, [[launch]]) if cap else None
        t: dict[str, list[float]] = {k: [] for k in
                                     (*steps, *gsteps, "whole_d2h", "whole_h2d",
                                      "checked_d2h", "checked_h2d", "contig")}
        ring_ids = None
        for _ in range(args.iters):
            a, b = ids()
            torch.cuda.synchronize()
            marks = [time.perf_counter()]
            src, dst = e._pairs("d2h", a, b, "device")
            marks.append(time.perf_counter())
            e._after_compute(stream)
            marks.append(time.perf_counter())
            with torch.cuda.stream(stream):
                ring_ids = e._rings[0].put(src, dst, stream)
                marks.append(time.perf_counter())
                launch.run(ring_ids, n)
                marks.append(time.perf_counter())
            stream.synchronize()
            marks.append(time.perf_counter())
            for k, t0, t1 in zip(steps, marks[:-1], marks[1:], strict=True):
                t[k].append((t1 - t0) * 1e6)
            if got is not None:  # the same backup through its CUDA graph
                torch.cuda.synchronize()
                marks = [time.perf_counter()]
                graphs.stage(src, dst, cap)
                marks.append(time.perf_counter())
                e._after_compute(stream)
                marks.append(time.perf_counter())
                with torch.cuda.stream(stream):
                    got[0].replay()
                marks.append(time.perf_counter())
                stream.synchronize()
                marks.append(time.perf_counter())
                for k, t0, t1 in zip(gsteps, marks[:-1], marks[1:], strict=True):
                    t[k].append((t1 - t0) * 1e6)
            cd, ch = e.check("d2h", *ids()), e.check("h2d", *ids())
            for key, fn in (("whole_d2h", lambda: e.d2h(*ids())),
                            ("whole_h2d", lambda: e.h2d(*reversed(ids()))),
                            ("checked_d2h", lambda cd=cd: e.d2h_checked(cd)),
                            ("checked_h2d", lambda ch=ch: e.h2d_checked(ch)),
                            ("contig", lambda: host_bytes[:nbytes].copy_(dev_bytes[:nbytes]))):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                t[key].append((time.perf_counter() - t0) * 1e6)
        print(f"graphs: cap {cap}, {'captured' if got else graphs.broken or 'off'}")
        for k, v in t.items():
            if not v:
                continue
            print(f"{k:>14} {statistics.median(v[10:]):8.1f} us (host)")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu: list[float] = []
        assert ring_ids is not None
        with torch.cuda.stream(stream):
            for _ in range(20):
                start.record(stream)
                launch.run(ring_ids, n)
                end.record(stream)
                end.synchronize()
                gpu.append(start.elapsed_time(end) * 1e3)
        start.record()
        host_bytes[:nbytes].copy_(dev_bytes[:nbytes])
        end.record()
        end.synchronize()
        print(f"{'kernel':>14} {statistics.median(gpu):8.1f} us (GPU)")
        print(f"{'memcpy':>14} {start.elapsed_time(end) * 1e3:8.1f} us (GPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
