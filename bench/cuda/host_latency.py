"""How much of a synchronised gla.chunk_gla call is host latency, per case of bench_training.py
(comma-separated labels as the first argument), and where the host time of a forward+backward goes.

Per case, two lines:
1. The call timed as bench_training.py times it (a synchronise, the start event, the call, the end
   event; the GPU idles until the first kernel), and the same with a GPU spin queued before the start
   event so that the host is ahead (kernel time and the gaps between kernels only); fwd+bwd and the
   forward alone.
2. The host time of one fwd+bwd in training order (gradients cleared, a synchronise, a spin that
   keeps the GPU busy, the forward, o.backward(do)), median over 30, split at instants taken inside
   libgla's Python layer: before the forward's autograd.Function, its body (the operator, launches
   included), after it; from o.backward's call to libgla's backward (PyTorch's autograd engine: its
   device thread picks the node up), libgla's Python before the operator, the operator, after it,
   and o.backward's return after it (the engine's gradient accumulation). Then the same engine hop
   for a no-op autograd.Function with the same inputs (PyTorch's own cost), and the caching
   allocator's cudaMalloc calls over the 30 calls (a new segment per call would be ~100 us each).
Results: bench/results/cuda_backward.md.

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
from gla import _ops  # noqa: E402

SPIN = 4_000_000  # GPU cycles (~2 ms): longer than any case's forward+backward host time


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


# Instants inside libgla's Python layer (the functions wrapped, not changed).
marks = {}
_gradients, _forward = _ops._gradients, _ops._ChunkFwd.forward


def _marked_gradients(ctx, do, dht, chunk_bwd):
    marks["bwd entry"] = time.perf_counter()

    def op(*args):
        marks["op start"] = time.perf_counter()
        out = chunk_bwd(*args)
        marks["op end"] = time.perf_counter()
        return out
    out = _gradients(ctx, do, dht, op)
    marks["bwd exit"] = time.perf_counter()
    return out


def _marked_forward(ctx, *args):
    marks["fwd entry"] = time.perf_counter()
    out = _forward(ctx, *args)
    marks["fwd exit"] = time.perf_counter()
    return out


class _Noop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g):
        ctx.save_for_backward(q, k, v, g)
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, do):
        marks["bwd entry"] = time.perf_counter()
        return tuple(torch.empty_like(x) for x in ctx.saved_tensors)


def host_parts(leaves, do, cu_t, cu_cpu, reps=30):
    parts = {k: [] for k in ("before fwd", "fwd body", "after fwd", "engine to bwd", "bwd before op", "bwd op",
                             "bwd after op", "engine after bwd", "noop engine to bwd")}
    _ops._gradients, _ops._ChunkFwd.forward = _marked_gradients, staticmethod(_marked_forward)
    try:
        for _ in range(reps):
            clear_grads(leaves); torch.cuda.synchronize(); torch.cuda._sleep(SPIN)
            t0 = time.perf_counter()
            o, _ = gla.chunk_gla(*leaves, cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu)
            t1 = time.perf_counter()
            o.backward(do)
            t2 = time.perf_counter()
            del o
            torch.cuda.synchronize()
            m = marks
            for name, a, b in (("before fwd", t0, m["fwd entry"]), ("fwd body", m["fwd entry"], m["fwd exit"]),
                               ("after fwd", m["fwd exit"], t1), ("engine to bwd", t1, m["bwd entry"]),
                               ("bwd before op", m["bwd entry"], m["op start"]), ("bwd op", m["op start"], m["op end"]),
                               ("bwd after op", m["op end"], m["bwd exit"]), ("engine after bwd", m["bwd exit"], t2)):
                parts[name].append((b - a) * 1e6)
    finally:
        _ops._gradients, _ops._ChunkFwd.forward = _gradients, staticmethod(_forward)
    for _ in range(reps):
        clear_grads(leaves); torch.cuda.synchronize(); torch.cuda._sleep(SPIN)
        o = _Noop.apply(*leaves)
        t1 = time.perf_counter()
        o.backward(do)
        parts["noop engine to bwd"].append((marks["bwd entry"] - t1) * 1e6)
        del o
        torch.cuda.synchronize()
    return {k: statistics.median(v) for k, v in parts.items() if v}


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
        r[name] = (timed(fn, leaves, 0), timed(fn, leaves, SPIN // 2))
    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0)
    parts = host_parts(leaves, do, cu_t, cu_cpu)
    mallocs = torch.cuda.memory_stats().get("num_device_alloc", 0) - mallocs
    print(f"{label:36s} fwd+bwd sync {r['fwd+bwd'][0]:.3f} host-ahead {r['fwd+bwd'][1]:.3f} | "
          f"fwd sync {r['fwd'][0]:.3f} host-ahead {r['fwd'][1]:.3f} ms", flush=True)
    print(f"{'':36s} host us: " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()) +
          f"; cudaMalloc calls: {mallocs}", flush=True)
