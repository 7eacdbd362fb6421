"""What the `torch` backend's body moves on an accelerator: an op census on the CPU.

Runs python/gla/_chunked.py's forward and backward with the accelerator's block size (BLOCK_BYTES,
no worker threads) and its exponent rule (_chunked.by_difference) on CPU tensors under a TorchDispatchMode that records every aten op that moves
data: its count, the bytes of its distinct input and output tensors, and the flops of the matmuls.
From those it prints a first-order H200 estimate: per op kind max(count x launch, bytes / bandwidth
+ flops / fp32 matmul rate). The bytes alone are a floor the body cannot beat on any device with
that bandwidth, whatever the launch overhead.

    PYTHONPATH=python python3 bench/torch_backend_census.py --shape 8,4096,16,128,128

bf16 inputs (the body computes in fp32), g = logsigmoid(U[0, 1)). ~10 s at the default shape on a
2-core machine (no autograd: the body is called directly).
"""
import argparse
import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gla import _chunked

# Ops that move no data (views, allocations).
VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "expand", "as_strided", "slice", "select", "alias",
         "permute", "flatten", "squeeze", "reshape", "detach", "empty", "empty_strided", "new_empty", "unbind",
         "diagonal"}
MATMULS = {"bmm", "baddbmm", "baddbmm_", "mm", "addmm", "matmul"}


class Census(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.defaultdict(lambda: [0, 0, 0.0])  # kind: [count, bytes, flops]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = func.__name__.split(".")[0]
        if kind in VIEWS:
            return out
        ins = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        outs = [out] if isinstance(out, torch.Tensor) else [o for o in out if isinstance(o, torch.Tensor)] \
            if isinstance(out, (tuple, list)) else []
        seen, moved = set(), 0
        for t in ins + outs:  # an in-place op's output is its input: counted once
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                moved += t.numel() * t.element_size()
        flops = 0.0
        if kind in MATMULS:  # the operands are the last two positional matrices (not an out= tensor)
            a, b = [x for x in args if isinstance(x, torch.Tensor) and x.dim() >= 2][-2:]
            flops = 2.0 * (a.numel() // (a.shape[-1] * a.shape[-2])) * a.shape[-2] * a.shape[-1] * b.shape[-1]
        entry = self.ops[kind]
        entry[0] += 1
        entry[1] += moved
        entry[2] += flops
        return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,4096,16,128,128", help="B,T,H,K,V")
    ap.add_argument("--bandwidth", type=float, default=3.3e12, help="bytes/s (H200 HBM3e, achievable)")
    ap.add_argument("--launch", type=float, default=4e-6, help="s per op launch")
    ap.add_argument("--matmul-rate", type=float, default=50e12, help="fp32 matmul flop/s (no TF32)")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args()
    B, T, H, K, V = (int(x) for x in args.shape.split(","))
    _chunked._block_budget = lambda device: _chunked.BLOCK_BYTES
    _chunked._by_heads = lambda heads, device, run: run(slice(None))
    _chunked.by_difference = lambda x: x.dtype in (torch.bfloat16, torch.float16)  # the accelerators' rule
    torch.manual_seed(0)
    q, k = (torch.rand(B, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    v, do = (torch.rand(B, T, H, V, dtype=torch.bfloat16) for _ in range(2))
    g = torch.nn.functional.logsigmoid(torch.rand(B, T, H, K)).to(torch.bfloat16)
    scale = K ** -0.5
    q_fp32 = B * T * H * K * 4
    passes = (("forward", lambda: _chunked.chunk_forward(q, k, v, g, scale, want_final_state=False)),
              ("backward", lambda: _chunked.chunk_backward(q, k, v, g, scale, do=do)))
    for label, run in passes:
        census = Census()
        start = time.perf_counter()
        with torch.no_grad(), census:
            run()
        rows = sorted(census.ops.items(), key=lambda r: -r[1][1])
        count = sum(n for _, (n, _, _) in rows)
        moved = sum(b for _, (_, b, _) in rows)
        flops = sum(f for _, (_, _, f) in rows)
        estimate = sum(max(n * args.launch, b / args.bandwidth + f / args.matmul_rate) for _, (n, b, f) in rows)
        print(f"{label} B{B} T{T} H{H} K{K} V{V}: {count} ops, {moved / 1e9:.2f} GB moved "
              f"({moved / q_fp32:.0f} passes over q in fp32), {flops / 1e9:.0f} GFLOP of matmuls; estimate "
              f"{estimate * 1e3:.1f} ms (bytes alone {moved / args.bandwidth * 1e3:.1f} ms, matmuls alone "
              f"{flops / args.matmul_rate * 1e3:.1f} ms, launches alone {count * args.launch * 1e3:.1f} ms); "
              f"census {time.perf_counter() - start:.1f} s")
        for kind, (n, b, f) in rows[:args.top]:
            print(f"  {kind:14s} {n:6d} ops {b / 1e9:8.2f} GB {f / 1e9:8.1f} GFLOP")


if __name__ == "__main__":
    main()
