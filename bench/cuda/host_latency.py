"""How much of a synchronised gla.chunk_gla call is host latency, per case of bench_training.py
(comma-separated labels as the first argument): the call timed as bench_training.py times it (a
synchronise, the start event, the call, the end event; the GPU idles until the first kernel), the
same with a GPU spin queued before the start event so that the host is ahead (kernel time and the
gaps between kernels only), and the host wall time of the forward call and of o.backward(do) with
the GPU kept busy. Results: bench/results/cuda_backward.md.

    PYTHONPATH=python GLA_LIBRARY=build-cuda/libgla.so python3 bench/cuda/host_latency.py "B8 T4096 H16 D128"
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from bench_training import CASES, make_inputs, run_gla, clear_grads  # noqa: E402
import gla  # noqa: E402


def timed(fn, leaves, spin, reps=30):
    ts = []
    for i in range(reps + 5):
        clear_grads(leaves)
        torch.cuda.synchronize()
        if spin:
            torch.cuda._sleep(spin)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        if i >= 5:
            ts.append(s.elapsed_time(e))
    return statistics.median(ts)

for label, B, T, H, K, V, cu in CASES:
    if label not in sys.argv[1].split(","): continue
    leaves, do, cu_t, cu_cpu = make_inputs(B, T, H, K, V, cu, True)
    fb = lambda: run_gla(leaves, do, cu_t, cu_cpu, True)
    def fo():
        with torch.no_grad(): run_gla(leaves, do, cu_t, cu_cpu, False)
    for _ in range(200): fb()
    torch.cuda.synchronize()
    r = {}
    for name, fn in (("fwd+bwd", fb), ("fwd", fo)):
        r[name] = (timed(fn, leaves, 0), timed(fn, leaves, 2_000_000))
    # host wall of the pieces (GPU kept busy by a spin so nothing waits)
    hw = {"fwd": [], "bwd": []}
    # cudaMalloc calls of the caching allocator during these calls (a new segment per call would be
    # ~100 us of host time each)
    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
    for i in range(30):
        clear_grads(leaves); torch.cuda.synchronize(); torch.cuda._sleep(4_000_000)
        t0 = time.perf_counter(); o, _ = gla.chunk_gla(*leaves, cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu)
        t1 = time.perf_counter(); o.backward(do); t2 = time.perf_counter()
        torch.cuda.synchronize()
        hw["fwd"].append((t1 - t0) * 1e6); hw["bwd"].append((t2 - t1) * 1e6)
    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
    print(f"{label:36s} fwd+bwd sync {r['fwd+bwd'][0]:.3f} host-ahead {r['fwd+bwd'][1]:.3f} | "
          f"fwd sync {r['fwd'][0]:.3f} host-ahead {r['fwd'][1]:.3f} | "
          f"host us: fwd {statistics.median(hw['fwd']):.0f} bwd {statistics.median(hw['bwd']):.0f} | "
          f"cudaMalloc calls in 30 fwd+bwd: {mallocs}", flush=True)
