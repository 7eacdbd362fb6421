"""libgla's cuda chunk forward against fla's chunk_gla, same inputs, same process, same GPU.

Calls libgla through its C ABI with ctypes (no Python package needed): torch tensors are passed as
gla_tensor descriptors, on torch's current stream, with a torch-allocated workspace. fla comes from
its wheel (fla-core 0.6.0) installed on the GPU machine:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 bench/cuda/bench_vs_fla.py --lib build-cuda/libgla.so
Prints one line per case: libgla ms, fla ms, ratio, rel-RMS difference of o, peak memory of each.
bf16, g = logsigmoid(randn), K = V = D, no initial state, no final state (fla's defaults).
--first: only measure the first call in this fresh process (library load + first launch).
"""
import argparse
import ctypes as C
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

MAX_RANK = 6
DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int32: 4, torch.int64: 5}


class Tensor(C.Structure):
    _fields_ = [("data", C.c_void_p), ("dtype", C.c_int32), ("device_type", C.c_int32),
                ("device_index", C.c_int32), ("rank", C.c_int32),
                ("sizes", C.c_int64 * MAX_RANK), ("strides", C.c_int64 * MAX_RANK)]


class ForwardArgs(C.Structure):
    _fields_ = [(n, C.POINTER(Tensor)) for n in
                ("q", "k", "v", "g", "initial_state", "cu_seqlens", "cu_seqlens_host", "o", "final_state")]


class Options(C.Structure):
    _fields_ = [("struct_size", C.c_uint32), ("has_scale", C.c_int32), ("scale", C.c_double),
                ("state_v_first", C.c_int32), ("backend", C.c_char_p), ("policy", C.c_int32),
                ("force_stage_pipeline", C.c_int32), ("check_inputs", C.c_int32), ("stream", C.c_void_p),
                ("workspace", C.c_void_p), ("workspace_bytes", C.c_size_t)]


def desc(t):
    d = Tensor()
    d.data = t.data_ptr()
    d.dtype = DT[t.dtype]
    d.device_type = 2 if t.is_cuda else 1
    d.device_index = t.device.index or 0 if t.is_cuda else 0
    d.rank = t.dim()
    for i in range(t.dim()):
        d.sizes[i] = t.shape[i]
        d.strides[i] = t.stride(i)
    return d


class Gla:
    def __init__(self, path):
        self.lib = C.CDLL(path)
        self.lib.gla_last_error.restype = C.c_char_p
        self.lib.gla_chunk_forward.argtypes = [C.POINTER(ForwardArgs), C.POINTER(Options)]
        self.lib.gla_chunk_forward_workspace_size.argtypes = [C.POINTER(ForwardArgs), C.POINTER(Options),
                                                              C.POINTER(C.c_size_t)]

    def prepare(self, q, k, v, g, o, cu=None, cu_host=None, backend=b"cuda"):
        keep = [desc(x) for x in (q, k, v, g, o)]
        a = ForwardArgs()
        a.q, a.k, a.v, a.g, a.o = [C.pointer(d) for d in keep]
        if cu is not None:
            dc, dh = desc(cu), desc(cu_host)
            keep += [dc, dh]
            a.cu_seqlens, a.cu_seqlens_host = C.pointer(dc), C.pointer(dh)
        opt = Options()
        self.lib.gla_options_init(C.byref(opt))
        opt.backend = backend
        opt.stream = torch.cuda.current_stream().cuda_stream
        n = C.c_size_t(0)
        if self.lib.gla_chunk_forward_workspace_size(C.byref(a), C.byref(opt), C.byref(n)) != 0:
            raise RuntimeError(self.lib.gla_last_error().decode())
        ws = torch.empty(max(n.value, 1), dtype=torch.uint8, device=q.device)
        opt.workspace, opt.workspace_bytes = ws.data_ptr(), n.value
        keep.append(ws)
        lib = self.lib

        def call():
            if lib.gla_chunk_forward(C.byref(a), C.byref(opt)) != 0:
                raise RuntimeError(lib.gla_last_error().decode())
        call.keep = (keep, a, opt)
        call.workspace_bytes = n.value
        return call


def bench(fn, warmup=5, rep=30, warmup_seconds=0.25):
    # at least warmup_seconds of the contender's own calls first: the GPU's clock takes ~100 ms of
    # work to ramp up from idle
    start, calls = time.perf_counter(), 0
    while calls < warmup or time.perf_counter() - start < warmup_seconds:
        fn()
        torch.cuda.synchronize()
        calls += 1
    ts = []
    for _ in range(rep):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


VARLEN = [4096, 512, 3000, 1, 2048, 7000, 64, 65, 1024, 4000, 333, 2500, 1500, 3000, 2000, 1626]


def inputs(case, dtype=torch.bfloat16):
    torch.manual_seed(0)
    if case == "varlen":
        B, T, H, D = 1, sum(VARLEN), 16, 128
    else:
        B, T, H, D = map(int, case.split("x"))
    q = torch.randn(B, T, H, D, dtype=dtype, device="cuda")
    k = torch.randn(B, T, H, D, dtype=dtype, device="cuda")
    v = torch.randn(B, T, H, D, dtype=dtype, device="cuda")
    g = F.logsigmoid(torch.randn(B, T, H, D, dtype=torch.float32, device="cuda")).to(dtype)
    cu = cu_host = None
    if case == "varlen":
        cu_host = torch.tensor([0] + list(torch.tensor(VARLEN).cumsum(0)), dtype=torch.int64)
        cu = cu_host.cuda()
    return q, k, v, g, cu, cu_host


def first_call(lib_path):
    q, k, v, g, _, _ = inputs("8x4096x16x128")
    o = torch.empty_like(v)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    gla = Gla(lib_path)
    call = gla.prepare(q, k, v, g, o)
    call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", default="build-cuda/libgla.so")
    ap.add_argument("--cases", default="8x4096x16x128,4x8192x32x64,1x32768x16x128,32x1024x16x128,varlen")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-cases", default="", help="comma list: run fla only on these (default: all)")
    ap.add_argument("--first", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench_vs_fla.json"))
    args = ap.parse_args()
    if args.first:
        print(json.dumps({"first_call_ms": first_call(args.lib)}))
        return
    gla = Gla(args.lib)
    chunk_gla = None
    if not args.no_fla:
        from fla.ops.gla import chunk_gla
    rows = []
    print(f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for case in args.cases.split(","):
        q, k, v, g, cu, cu_host = inputs(case)
        o = torch.empty_like(v)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call = gla.prepare(q, k, v, g, o, cu, cu_host)
        call()
        torch.cuda.synchronize()
        ours_peak = (torch.cuda.max_memory_allocated() - base) / 2**20  # workspace + descriptors, MiB
        ours = bench(call)
        row = dict(case=case, libgla_ms=ours, libgla_extra_MiB=ours_peak, workspace_MiB=call.workspace_bytes / 2**20)
        if chunk_gla is not None and (not args.fla_cases or case in args.fla_cases.split(",")):
            with torch.no_grad():
                t0 = time.perf_counter()
                ref, _ = chunk_gla(q, k, v, g, cu_seqlens=cu)
                torch.cuda.synchronize()
                row["fla_first_s"] = time.perf_counter() - t0
                del ref
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                ref, _ = chunk_gla(q, k, v, g, cu_seqlens=cu)
                torch.cuda.synchronize()
                # fla's peak above its inputs, output included; ours: o is preallocated (its size below).
                row["fla_extra_MiB"] = (torch.cuda.max_memory_allocated() - base) / 2**20
                row["o_MiB"] = o.numel() * o.element_size() / 2**20
                fla = bench(lambda: chunk_gla(q, k, v, g, cu_seqlens=cu))
            call()
            torch.cuda.synchronize()
            err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
            row.update(fla_ms=fla, speedup=fla / ours, rel_rms_vs_fla=err)
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del q, k, v, g, o, call
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print("\ncase               libgla ms   fla ms   fla/libgla")
    for r in rows:
        print(f"{r['case']:<18} {r['libgla_ms']:9.4f} {r.get('fla_ms', float('nan')):8.4f} {r.get('speedup', float('nan')):8.2f}x")


if __name__ == "__main__":
    sys.exit(main())
