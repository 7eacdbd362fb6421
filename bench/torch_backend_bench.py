"""Times the portable `torch` backend against a reference point, through gla.chunk_gla.

CPU (default): against the native `cpu` backend, fp32 B1 T4096 H16 K=V=128, forward and
forward+backward, both at --threads threads (2 by default: torch.set_num_threads for the `torch`
backend, GLA_NUM_THREADS for the `cpu` backend, whose default is every CPU of the machine, not of
the process's affinity mask). On a machine with more cores, pin the process to as many:

    GLA_LIBRARY=build/libgla.so PYTHONPATH=python taskset -c 0,1 python3 bench/torch_backend_bench.py --repeat 5

CUDA (--cuda): against fla's chunk_gla (skipped with a note when fla is not importable), bf16
forward+backward at B8 T4096 H16 D128 and B8 T2048 H4 K256 V512; CUDA-event medians and the extra
peak memory of one forward+backward (peak allocated during it minus what was allocated before):

    GLA_LIBRARY=build/libgla.so PYTHONPATH=python python3 bench/torch_backend_bench.py --cuda

--block-gib 1,2,3 times the torch backend at each of those block budgets in turn (the accelerators'
_chunked.BLOCK_BYTES: a larger block launches fewer ops and holds more memory).

Each case prints one line per contender: the median and the spread (min-max) over --repeat timed
runs after one warm-up, and the ratio to the reference point. On the CPU both contenders run in the
same process, alternating run by run (a shared machine's load then weighs on both alike), and each
prints its wall time and its process CPU time (all threads; on a loaded machine the better measure
of the work done), with the load average before and after each case.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import gla
from gla import _chunked

shipped_block_bytes = _chunked.BLOCK_BYTES


def make(B, T, H, K, V, dtype, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.rand(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g = F.logsigmoid(torch.rand(B, T, H, K, generator=gen)).to(device=device, dtype=dtype)
    h0 = torch.randn(B, H, K, V, generator=gen).to(device)
    do = torch.randn(B, T, H, V, generator=gen).to(device=device, dtype=dtype)
    dht = torch.randn(B, H, K, V, generator=gen).to(device)
    return q, k, v, g, h0, do, dht


def gla_call(backend, backward):
    def run(q, k, v, g, h0, do, dht):
        with gla.backend(backend):
            if not backward:
                with torch.no_grad():
                    return gla.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
            leaves = [x.detach().requires_grad_() for x in (q, k, v, g, h0)]
            o, ht = gla.chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True)
            return torch.autograd.grad([o, ht], leaves, [do, dht])
    return run


def fla_call(backward):
    from fla.ops.gla import chunk_gla as fla_chunk_gla

    def run(q, k, v, g, h0, do, dht):
        if not backward:
            with torch.no_grad():
                return fla_chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        leaves = [x.detach().requires_grad_() for x in (q, k, v, g, h0)]
        o, ht = fla_chunk_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True)
        return torch.autograd.grad([o, ht], leaves, [do, dht])
    return run


def time_cpu(fns, args, repeat):
    """For each of fns, the wall-clock ms and the process CPU ms (all threads: what the run computed,
    less sensitive than wall time to other processes on a shared machine) of each run; the fns
    alternate run by run, after one warm-up each."""
    for fn in fns:
        fn(*args)
    times, cpu = [[] for _ in fns], [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn(*args)
            times[i].append((time.perf_counter() - t0) * 1e3)
            cpu[i].append((time.process_time() - c0) * 1e3)
    return times, cpu


def time_cuda(fn, args, repeat):
    fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def extra_peak_cuda(fn, args):
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*args)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def report(label, times, ref=None):
    med = statistics.median(times)
    ratio = f"  {med / ref:5.2f}x" if ref else ""
    print(f"  {label:<28} median {med:9.2f} ms  (min {min(times):9.2f}, max {max(times):9.2f}){ratio}", flush=True)
    return med


def load() -> str:
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def cpu_main(args):
    torch.set_num_threads(args.threads)
    os.environ["GLA_NUM_THREADS"] = str(args.threads)  # read by the cpu backend at each call
    x = make(1, args.T, 16, 128, 128, torch.float32, "cpu")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"CPU, fp32, B1 T{args.T} H16 K=V=128, {torch.get_num_threads()} threads (GLA_NUM_THREADS "
          f"{os.environ['GLA_NUM_THREADS']}), torch {torch.__version__}, repeat {args.repeat}, "
          f"{os.cpu_count()} CPUs ({usable} in this process's affinity), {load()}")
    if usable > args.threads:
        print(f"  note: {usable} CPUs usable for {args.threads} threads; pin with taskset -c to compare at "
              f"{args.threads} cores")
    for backward in (False, True):
        print("forward+backward" if backward else "forward")
        fns = [gla_call("cpu", backward), gla_call("torch", backward)]
        (ref_wall, wall), (ref_cpu, cpu) = time_cpu(fns, x, args.repeat)
        ref = report("cpu backend", ref_wall)
        report("torch backend", wall, ref)
        ref = report("cpu backend, CPU time", ref_cpu)
        report("torch backend, CPU time", cpu, ref)
        print(f"  ({load()})")


def profile_cuda(fn, args, top=25):
    """One call under torch.profiler: its wall time against the summed GPU kernel time (the gap is
    launch and host time), the kernel count, and the kernels with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        fn(*args)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.device_time for e in kernels) / 1e3
    print(f"  profile: wall {wall:.2f} ms, GPU kernel time {gpu:.2f} ms in {len(kernels)} kernels")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60))


def cuda_main(args):
    try:
        import fla  # noqa: F401
        have_fla = True
    except ImportError as e:
        have_fla = False
        print(f"fla not importable ({e}): timing the torch backend alone")
    cases = [[(8, 4096, 16, 128, 128), (8, 2048, 4, 256, 512)][int(i)] for i in args.cases.split(",")]
    print(f"CUDA {torch.cuda.get_device_name(0)}, bf16, forward+backward, torch {torch.__version__}, "
          f"repeat {args.repeat}")
    for B, T, H, K, V in cases:
        x = make(B, T, H, K, V, torch.bfloat16, "cuda")
        print(f"B{B} T{T} H{H} K{K} V{V}")
        ref = ref_mem = None
        if have_fla:
            fn = fla_call(True)
            ref = report("fla chunk_gla", time_cuda(fn, x, args.repeat))
            ref_mem = extra_peak_cuda(fn, x)
            print(f"  {'fla extra peak':<28} {ref_mem / 2**30:9.2f} GiB")
        fn = gla_call("torch", True)
        budgets = [float(b) for b in args.block_gib.split(",")] if args.block_gib else [None]
        for budget in budgets:
            if budget is not None:  # the accelerators' block budget (_chunked.BLOCK_BYTES) for this row
                _chunked.BLOCK_BYTES = int(budget * 2**30)
            what = "torch backend" if budget is None else f"torch backend, {budget:g} GiB blocks"
            report(what, time_cuda(fn, x, args.repeat), ref)
            mem = extra_peak_cuda(fn, x)
            ratio = f"  {mem / ref_mem:5.2f}x" if ref_mem else ""
            print(f"  {what + ' extra peak':<28} {mem / 2**30:9.2f} GiB{ratio}")
        _chunked.BLOCK_BYTES = shipped_block_bytes
        if args.profile:
            profile_cuda(fn, x)
        del x
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", action="store_true", help="the GPU comparison against fla")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each contender (CPU case)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="with --cuda: one call of the torch backend "
                    "under torch.profiler (kernel time, launches, top kernels)")
    ap.add_argument("--T", type=int, default=4096, help="CPU case length")
    ap.add_argument("--block-gib", default="", help="with --cuda: comma-separated block budgets in GiB, the torch "
                    "backend timed at each in turn (default: the shipped _chunked.BLOCK_BYTES)")
    ap.add_argument("--cases", default="0,1", help="with --cuda: which of the two GPU cases (0: B8 T4096 H16 D128, "
                    "1: B8 T2048 H4 K256 V512)")
    args = ap.parse_args()
    cuda_main(args) if args.cuda else cpu_main(args)


if __name__ == "__main__":
    main()
