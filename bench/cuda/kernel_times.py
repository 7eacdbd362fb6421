"""Where gla.chunk_gla's GPU time goes: each kernel's time per call, forward and forward+backward.

Runs the public call (from PyTorch, autograd for the backward) under torch.profiler and sums the
GPU time of each kernel over --reps calls after warm-up, per call. bf16, g = logsigmoid(randn), the
cases of bench_training.py (--cases picks labels, comma-separated; default the three model shapes
and B8 T4096 H16 D128). --timeline prints one synchronised forward+backward call as a time line
instead: each kernel's GPU start and end from the call's first host instant, the idle gaps between
kernels, and the host instants (forward returned, backward returned), to tell host-bound gaps from
kernel time (with --forward-only: one no-grad forward). --once runs each pass once without the profiler (for ncu:
`ncu -k regex:chunk -c N python3 bench/cuda/kernel_times.py --once --cases ...`).

    PYTHONPATH=python GLA_LIBRARY=build-cuda/libgla.so python3 bench/cuda/kernel_times.py

Under torch.profiler the warp-specialised forward kernel reads ~25% longer than it runs alone (474
against 372 us at B8 T4096 H16 D128 on an H200, ncu and the public call agreeing on the latter):
the sums give each kernel's share; ncu on --once gives durations.
"""
import argparse
import collections
import os
import sys

import torch

import gla  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import CASES, make_inputs, run_gla  # noqa: E402

DEFAULT = "B8 T4096 H16 D128,B8 T2048 H4 K256 V512,B8 T2048 H8 K64 V128,B4 T4096 H16 K128 V256"


def profile_pass(leaves, do, cu_t, cu_cpu, backward, reps):
    for _ in range(50):  # the GPU's clock ramps up over the first ~100 ms of work
        run_gla(leaves, do, cu_t, cu_cpu, backward)
        for x in leaves:
            x.grad = None
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            run_gla(leaves, do, cu_t, cu_cpu, backward)
            for x in leaves:
                x.grad = None
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name][0] += e.device_time
            per[e.name][1] += 1
    return {name: (us / reps, n / reps) for name, (us, n) in per.items()}


def timeline(leaves, do, cu_t, cu_cpu, reps, backward=True):
    """The last of `reps` synchronised calls (forward+backward, or a no-grad forward) under the
    profiler, as a time line (us). 50 calls first: the GPU's clock ramps up over the first ~100 ms of
    work."""
    for _ in range(50):
        with torch.set_grad_enabled(backward):
            run_gla(leaves, do, cu_t, cu_cpu, backward)
        for x in leaves:
            x.grad = None
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(reps):
            with torch.profiler.record_function(f"call{i}"), torch.set_grad_enabled(backward):
                q, k, v, g = leaves
                with torch.profiler.record_function("forward"):
                    o, _ = gla.chunk_gla(q, k, v, g, cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu)
                if backward:
                    with torch.profiler.record_function("backward"):
                        o.backward(do)
            torch.cuda.synchronize()
            for x in leaves:
                x.grad = None
    events = prof.events()
    last = f"call{reps - 1}"
    call = [e for e in events if e.name == last and e.device_type == torch.autograd.DeviceType.CPU][0]
    t0, t1 = call.time_range.start, call.time_range.end
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.start >= t0 and e.time_range.start <= t1 + 5000),
                     key=lambda e: e.time_range.start)
    marks = [(e.time_range.end - t0, f"host: {e.name} returned") for e in events
             if e.device_type == torch.autograd.DeviceType.CPU and e.name in ("forward", "backward")
             and t0 <= e.time_range.start <= t1]
    marks += [(e.time_range.start - t0, f"host: {e.name} {e.time_range.end - e.time_range.start:.1f} us") for e in events
              if e.device_type == torch.autograd.DeviceType.CPU and t0 <= e.time_range.start <= t1
              and e.time_range.end - e.time_range.start >= 10 and e.name not in ("forward", "backward", last)]
    rows, end = [], None
    for e in kernels:
        s, f = e.time_range.start - t0, e.time_range.end - t0
        gap = s - end if end is not None else s
        rows.append((s, f"gpu {s:8.1f} .. {f:8.1f} us ({f - s:7.1f})  idle before {gap:6.1f}  {e.name[:80]}"))
        end = f if end is None else max(end, f)
    for at, text in sorted(rows + [(at, f"{'':4}{at:8.1f} us  {text}") for at, text in marks]):
        print("  " + text)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    print(f"  call: host {t1 - t0:.1f} us, last kernel ends {end:.1f} us, kernels busy {busy:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--timeline", action="store_true", help="one forward+backward call as a time line")
    ap.add_argument("--forward-only", action="store_true",
                    help="the forward alone: with --timeline one no-grad forward's time line, else the profiled "
                    "forward pass only (inputs requiring grad, as without this flag)")
    ap.add_argument("--once", action="store_true", help="one forward and one forward+backward per case, no profiler")
    args = ap.parse_args()
    by_label = {c[0]: c for c in CASES}
    for label in [s.strip() for s in args.cases.split(",") if s.strip()]:
        _, B, T, H, K, V, cu = by_label[label]
        leaves, do, cu_t, cu_cpu = make_inputs(B, T, H, K, V, cu, True)
        if args.timeline:
            print(f"\n{label} {'fwd (no grad)' if args.forward_only else 'fwd+bwd'} time line")
            timeline(leaves, do, cu_t, cu_cpu, 5, backward=not args.forward_only)
            continue
        if args.once:
            with torch.no_grad():
                run_gla(leaves, do, cu_t, cu_cpu, False)
            run_gla(leaves, do, cu_t, cu_cpu, True)
            torch.cuda.synchronize()
            continue
        for backward in (False,) if args.forward_only else (False, True):
            rows = profile_pass(leaves, do, cu_t, cu_cpu, backward, args.reps)
            total = sum(us for us, _ in rows.values())
            print(f"\n{label} {'fwd+bwd' if backward else 'fwd'}: GPU {total:.1f} us per call")
            for name, (us, n) in sorted(rows.items(), key=lambda r: -r[1][0]):
                if us >= 1.0:
                    print(f"  {us:8.1f} us  {n:4.1f}x  {name[:110]}")
        del leaves, do
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
