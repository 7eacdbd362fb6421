"""Context-parallel traffic per training step against the activations each rank holds, on the CPU.

Runs gla.distributed.simulate (every rank in this process, the exchange in memory) forward and
backward, reads the bytes each gather really sent, checks o and dq against one gla.chunk_gla call,
and prints one row per layout:

    GLA_LIBRARY=build/libgla.so PYTHONPATH=python python3 bench/cp_traffic.py

Activations = the rank's slices of q, k, v, g and o (what a scheme exchanging activations, such as
ring attention passing k and v, would move a share of); sent = the forward and backward gathers'
payload from one rank (each rank receives W times that).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import gla
import gla.distributed as gd

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(W, B, T, H, K, V, packed, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.rand(B, T, H, K, generator=gen).to(dtype), torch.rand(B, T, H, K, generator=gen).to(dtype)
    v = torch.rand(B, T, H, V, generator=gen).to(dtype)
    g = (F.logsigmoid(torch.rand(B, T, H, K, generator=gen)) / 16).to(dtype)
    cu = [0, T // 3, T] if packed else None  # two sequences, the second over most ranks
    bounds = [T * r // W for r in range(W + 1)]
    parts = [[x[:, bounds[r]:bounds[r + 1]].detach().clone().requires_grad_(True) for r in range(W)]
             for x in (q, k, v, g)]
    ex = gd._exchange.InMemory(W)
    outs, _ = gd.simulate(*parts, cu_seqlens=cu, exchange=ex)
    sum(o.float().sum() for o in outs).backward()
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g)]
    o_ref, _ = gla.chunk_gla(*leaves, cu_seqlens=torch.tensor(cu) if cu else None)
    o_ref.float().sum().backward()
    err = max(rel(torch.cat(outs, 1), o_ref), rel(torch.cat([p.grad for p in parts[0]], 1), leaves[0].grad))
    tokens = T // W
    activations = B * tokens * H * (3 * K + 2 * V) * DTYPE_BYTES[dtype]
    return dict(fwd=ex.sent_bytes[0], bwd=ex.sent_bytes[1], act=activations, err=err, tokens=tokens)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="total tokens (default 4096)")
    args = parser.parse_args()
    H, K, V = 4, 64, 64
    print(f"gla {gla.version()}, H={H} K={K} V={V}, {args.tokens} tokens in total, backend as dispatched")
    print("| layout | W | B | tokens/rank | dtype | activations/rank | sent fwd | sent bwd | sent/activations "
          "| received/rank | rel err vs one call |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for packed, B in ((True, 1), (False, 2)):
        for W in (2, 4, 8):
            for dtype in (torch.float32, torch.bfloat16):
                r = run(W, B, args.tokens, H, K, V, packed, dtype)
                sent = r["fwd"] + r["bwd"]
                name = "packed" if packed else "batched"
                print(f"| {name} | {W} | {B} | {r['tokens']} | {str(dtype)[6:]} | {r['act']:,} B | {r['fwd']:,} B "
                      f"| {r['bwd']:,} B | {sent / r['act']:.2e} | {W * sent:,} B | {r['err']:.1e} |")
    print("\nlarger shapes, from the payload formula the run above measured (M·H·K·(V+1) + M·H·K·V fp32 per step):")
    print("| H | K | V | tokens/rank | dtype | activations/rank | sent per step | sent/activations |")
    print("|---|---|---|---|---|---|---|---|")
    for H_, K_, V_, tokens, dt in ((16, 128, 128, 4096, torch.bfloat16), (16, 128, 128, 32768, torch.bfloat16),
                                   (32, 256, 256, 32768, torch.bfloat16)):
        act = tokens * H_ * (3 * K_ + 2 * V_) * DTYPE_BYTES[dt]
        sent = (H_ * K_ * (V_ + 1) + H_ * K_ * V_) * 4
        print(f"| {H_} | {K_} | {V_} | {tokens} | {str(dt)[6:]} | {act:,} B | {sent:,} B | {sent / act:.2e} |")


if __name__ == "__main__":
    main()
