"""Where gla.chunk_gla's GPU time goes: each kernel's time per call, forward and forward+backward.

Runs the public call (from PyTorch, autograd for the backward) under torch.profiler and sums the
GPU time of each kernel over --reps calls after warm-up, per call. bf16, g = logsigmoid(randn), the
cases of bench_training.py (--cases picks labels, comma-separated; default the three model shapes
and B8 T4096 H16 D128). --once runs each pass once without the profiler (for ncu:
`ncu -k regex:chunk -c N python3 bench/cuda/kernel_times.py --once --cases ...`).

    PYTHONPATH=python GLA_LIBRARY=build-cuda/libgla.so python3 bench/cuda/kernel_times.py
"""
import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_training import CASES, make_inputs, run_gla  # noqa: E402

DEFAULT = "B8 T4096 H16 D128,B8 T2048 H4 K256 V512,B8 T2048 H8 K64 V128,B4 T4096 H16 K128 V256"


def profile_pass(leaves, do, cu_t, cu_cpu, backward, reps):
    for _ in range(3):
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=DEFAULT)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--once", action="store_true", help="one forward and one forward+backward per case, no profiler")
    args = ap.parse_args()
    by_label = {c[0]: c for c in CASES}
    for label in [s.strip() for s in args.cases.split(",") if s.strip()]:
        _, B, T, H, K, V, cu = by_label[label]
        leaves, do, cu_t, cu_cpu = make_inputs(B, T, H, K, V, cu, True)
        if args.once:
            with torch.no_grad():
                run_gla(leaves, do, cu_t, cu_cpu, False)
            run_gla(leaves, do, cu_t, cu_cpu, True)
            torch.cuda.synchronize()
            continue
        for backward in (False, True):
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
