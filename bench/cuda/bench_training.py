"""gla.chunk_gla against fla's chunk_gla through the public PyTorch call, forward and forward+backward.

Both are called the way a user calls them (from PyTorch, autograd for the backward), on the same
inputs in one process on one GPU. Per case it prints libgla ms, fla ms, their ratio, and the extra
peak memory of each (peak allocated during the call minus what the inputs already held), timed
two ways: CUDA events around each call with a synchronise between calls (median of --reps), and
back-to-back (--reps calls between two events, mean).

bf16 (--dtype), g = logsigmoid(randn) (fla's tests), no initial state, no final state. fla comes from its wheel
(fla-core 0.6.0) on the GPU machine:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:python GLA_LIBRARY=build-cuda/libgla.so python3 bench/cuda/bench_training.py
--json PATH writes the table as JSON too.

fla's Triton autotune costs 80-170 s per new shape on a fresh machine. Triton (3.6) keeps the
compiled kernels and, with TRITON_CACHE_AUTOTUNING=1, the autotune choices in TRITON_CACHE_DIR:
run once with both set to a folder, pack that folder into the run's output, and carry it into later
runs so fla starts warm. --fla-tune-ms WARMUP,REP shortens the autotune's timing of each candidate
configuration (Triton's default is 25 ms of warm-up and 100 ms of repetitions per configuration;
5,20 still times each candidate over tens to hundreds of calls and autotunes ~5x faster). The
timings in the table are this script's own, of the configuration fla chose.

Most of fla's first-call cost is compiling its candidate configurations, one after another.
--autotune-dir DIR seeds Triton's autotune cache with the choices of earlier runs (the small
*.autotune.json files under bench/cuda/fla_autotune/, see triton_autotune_cache.py): for those
shapes fla compiles only its chosen configurations and times none. --autotune-out DIR collects the
run's new choices for committing.

--fla-compile-only runs fla's forward and backward once per case in child processes, one per case
and all at once, with Triton's autotune results not kept (TRITON_CACHE_AUTOTUNING unset in them):
the compiled candidates land in TRITON_CACHE_DIR, and the measuring run that follows (same
TRITON_CACHE_DIR) autotunes on a quiet GPU from those binaries instead of compiling. The children's
own autotune timings overlap each other and are thrown away; with --fla-tune-ms they are shortened
too.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import gla

# (label, B, T, H, K, V, cu_seqlens or None)
VARLEN = [0, 1, 7000, 7001, 9000, 9100, 12000, 15000, 15001, 18000, 21000, 24000, 26000, 28000, 30000, 31500, 32769]
CASES = [
    ("B8 T4096 H16 D128", 8, 4096, 16, 128, 128, None),
    ("B4 T8192 H32 D64", 4, 8192, 32, 64, 64, None),
    ("B1 T32768 H16 D128", 1, 32768, 16, 128, 128, None),
    ("B32 T1024 H16 D128", 32, 1024, 16, 128, 128, None),
    ("varlen 16 seqs 32769 tok H16 D128", 1, 32769, 16, 128, 128, VARLEN),
    ("B8 T2048 H4 K256 V512", 8, 2048, 4, 256, 512, None),
    ("B8 T2048 H8 K64 V128", 8, 2048, 8, 64, 128, None),
    ("B4 T4096 H16 K128 V256", 4, 4096, 16, 128, 256, None),
]


def make_inputs(B, T, H, K, V, cu, requires_grad, dtype=torch.bfloat16):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    k = torch.randn(B, T, H, K, device=dev, dtype=dtype)
    v = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    g = F.logsigmoid(torch.randn(B, T, H, K, device=dev, dtype=torch.float32)).to(dtype)
    do = torch.randn(B, T, H, V, device=dev, dtype=dtype)
    leaves = [x.requires_grad_(requires_grad) for x in (q, k, v, g)]
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev) if cu else None
    cu_cpu = torch.tensor(cu, dtype=torch.int32) if cu else None
    return leaves, do, cu_t, cu_cpu


def run_gla(leaves, do, cu_t, cu_cpu, backward):
    q, k, v, g = leaves
    o, _ = gla.chunk_gla(q, k, v, g, cu_seqlens=cu_t, cu_seqlens_cpu=cu_cpu)
    if backward:
        o.backward(do)
    return o


def run_fla(fla_chunk_gla, leaves, do, cu_t, cu_cpu, backward):
    q, k, v, g = leaves
    kwargs = {"cu_seqlens": cu_t} if cu_t is not None else {}
    o, _ = fla_chunk_gla(q, k, v, g, **kwargs)
    if backward:
        o.backward(do)
    return o


def clear_grads(leaves):
    for x in leaves:
        x.grad = None


# Each contender is warmed up with at least this much wall time of its own calls (and 3 calls): the
# H200 idles at ~345 MHz and its clock takes ~100 ms of work to reach ~1980 MHz, and libgla's
# forward (0.1-0.5 ms a call) would otherwise spend its whole timed loop ramping.
WARMUP_SECONDS = 0.25


def time_calls(fn, leaves, reps, warmup=3, label=""):
    """(median ms with a synchronise between calls, mean ms back-to-back, extra peak MiB)."""
    start, calls = time.perf_counter(), 0
    while calls < warmup or time.perf_counter() - start < WARMUP_SECONDS:
        clear_grads(leaves)
        fn()
        torch.cuda.synchronize()
        calls += 1
    times = []
    for _ in range(reps):
        clear_grads(leaves)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    clear_grads(leaves)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        # Without this each backward after the first adds its gradients into the last call's: one
        # more elementwise pass over q, k, v, g per call, under which libgla's b2b fwd+bwd at B8
        # T4096 H16 D128 read 2.44 ms on an H100 against 2.00 ms synchronised. Host-only: nothing waits.
        clear_grads(leaves)
        fn()
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) / reps
    clear_grads(leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    clear_grads(leaves)
    # With the call's outputs and gradients released, what is allocated should be `base` again: less
    # means the call freed memory allocated before it (the extra peak is then a lower bound), more
    # that it kept some (a cache).
    change = (torch.cuda.memory_allocated() - base) / 2**20
    if abs(change) >= 1.0:
        print(f"  note ({label or 'call'}): {'freed' if change < 0 else 'kept'} {abs(change):.0f} MiB "
              f"{'allocated before it: its extra peak is a lower bound' if change < 0 else 'after it returned'}",
              flush=True)
    return statistics.median(times), back_to_back, peak


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30)).item()


def compile_fla(cases, tune_ms):
    """--fla-compile-only: one child per case runs fla's forward and backward once (autotune timing
    shortened to tune_ms when given); returns when all have finished (0 if every child succeeded)."""
    import os
    import subprocess
    env = dict(os.environ)
    env.pop("TRITON_CACHE_AUTOTUNING", None)
    extra = [tune_ms] if tune_ms else []
    children = [subprocess.Popen([sys.executable, __file__, "--fla-compile-child", label] + extra, env=env)
                for label, *_ in cases]
    codes = [c.wait() for c in children]
    for (label, *_), code in zip(cases, codes):
        print(f"fla compiled for {label}: exit {code}", flush=True)
    return 0 if all(c == 0 for c in codes) else 1


def compile_child(label, tune_ms):
    if tune_ms:
        import triton_autotune_cache
        triton_autotune_cache.shorten_autotune(tune_ms)
    from fla.ops.gla import chunk_gla as fla_chunk_gla
    (_, B, T, H, K, V, cu), = [c for c in CASES if c[0] == label]
    for backward in (False, True):
        leaves, do, cu_t, cu_cpu = make_inputs(B, T, H, K, V, cu, backward)
        run_fla(fla_chunk_gla, leaves, do, cu_t, cu_cpu, backward)
        torch.cuda.synchronize()
    return 0


def main():
    if len(sys.argv) in (3, 4) and sys.argv[1] == "--fla-compile-child":
        return compile_child(sys.argv[2], sys.argv[3] if len(sys.argv) == 4 else "")
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default="", help="comma-separated case labels, run in this order (default: all)")
    ap.add_argument("--forward-only", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="of q, k, v, g and do (fp32: the cuda backend declines the backward, which runs on `torch`)")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--fla-compile-only", action="store_true",
                    help="compile fla's candidates for every case in parallel child processes, then exit")
    ap.add_argument("--fla-tune-ms", default="", help="WARMUP,REP of Triton's autotune timing (default: Triton's 25,100)")
    ap.add_argument("--autotune-dir", default="",
                    help="seed Triton's autotune cache from this folder of *.autotune.json (triton_autotune_cache.py)")
    ap.add_argument("--autotune-out", default="",
                    help="after the run, copy the cache's new autotune files here (default: --autotune-dir)")
    args = ap.parse_args()
    if args.autotune_dir and not args.no_fla:
        import triton_autotune_cache
        print(f"autotune files seeded from {args.autotune_dir}: {triton_autotune_cache.seed(args.autotune_dir)}")
    fla_chunk_gla = None
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    cases = sorted((c for c in CASES if c[0] in wanted), key=lambda c: wanted.index(c[0])) if wanted else CASES
    if args.fla_compile_only:
        return compile_fla(cases, args.fla_tune_ms)
    if args.fla_tune_ms and not args.no_fla:
        import triton_autotune_cache
        triton_autotune_cache.shorten_autotune(args.fla_tune_ms)
    if not args.no_fla:
        try:
            from fla.ops.gla import chunk_gla as fla_chunk_gla
        except Exception as e:  # noqa: BLE001
            print(f"fla not importable ({type(e).__name__}: {e}); libgla only", file=sys.stderr)
    rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.version.__version__}  reps {args.reps}  {args.dtype}")
    print(f"{'case':36s} {'pass':8s} {'libgla ms':>10s} {'fla ms':>9s} {'ratio':>6s} {'b2b libgla':>10s} "
          f"{'b2b fla':>8s} {'b2b ratio':>9s} {'MiB libgla':>10s} {'MiB fla':>8s} {'grad diff':>9s}")
    for label, B, T, H, K, V, cu in cases:
        for backward in ((False,) if args.forward_only else (False, True)):
            leaves, do, cu_t, cu_cpu = make_inputs(B, T, H, K, V, cu, backward, getattr(torch, args.dtype))
            ours = time_calls(lambda: run_gla(leaves, do, cu_t, cu_cpu, backward), leaves, args.reps,
                              label=f"libgla {label}")
            theirs, diff = (float("nan"),) * 3, float("nan")
            if fla_chunk_gla is not None:
                theirs = time_calls(lambda: run_fla(fla_chunk_gla, leaves, do, cu_t, cu_cpu, backward), leaves,
                                    args.reps, label=f"fla {label}")
                o1 = run_gla(leaves, do, cu_t, cu_cpu, backward)
                grads1 = [x.grad.clone() for x in leaves] if backward else [o1]
                clear_grads(leaves)
                o2 = run_fla(fla_chunk_gla, leaves, do, cu_t, cu_cpu, backward)
                grads2 = [x.grad.clone() for x in leaves] if backward else [o2]
                clear_grads(leaves)
                diff = max(rel_rms(a, b) for a, b in zip(grads1, grads2))
            row = {"case": label, "pass": "fwd+bwd" if backward else "fwd", "libgla_ms": ours[0], "fla_ms": theirs[0],
                   "ratio": theirs[0] / ours[0], "b2b_libgla_ms": ours[1], "b2b_fla_ms": theirs[1],
                   "b2b_ratio": theirs[1] / ours[1], "extra_peak_mib_libgla": ours[2],
                   "extra_peak_mib_fla": theirs[2], "max_rel_rms_vs_fla": diff}
            rows.append(row)
            print(f"{label:36s} {row['pass']:8s} {ours[0]:10.3f} {theirs[0]:9.3f} {row['ratio']:6.2f} {ours[1]:10.3f} "
                  f"{theirs[1]:8.3f} {row['b2b_ratio']:9.2f} {ours[2]:10.1f} {theirs[2]:8.1f} {diff:9.2e}", flush=True)
            del leaves, do
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    out = args.autotune_out or args.autotune_dir
    if out and not args.no_fla:
        import triton_autotune_cache
        print(f"autotune files harvested into {out}: {triton_autotune_cache.harvest(out)}")


if __name__ == "__main__":
    sys.exit(main())
