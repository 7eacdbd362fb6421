"""Context-parallel chunk_gla as one autograd Function over the ranks this process computes (one
rank under torch.distributed, all of them when simulated in memory).

Forward, per rank (S_in is the true state entering the rank's incoming segment):
  1. local call:  o0, F = chunk_gla(local slice, initial state h0 for sequences starting here and 0
     for the incoming one), every segment's final state in F;
  2. send, for the outgoing sequence, L = its local final state (from 0, or from h0 if it starts
     here) and D = exp(sum of g over its local tokens) (per key): one all-gather of [M, H, K, V + 1];
  3. fold the predecessors: S_in = L_p0, then S_in = D_p * S_in + L_p along the chain;
  4. complete the incoming segment, which is linear in its initial state:
     o_t += scale * (q_t * exp(G_t)) S_in, and its final state (if it ends here) += exp(G_last) * S_in,
     G_t the cumulative gate from the segment's start (64-token scans, fp64 carries).
Backward, per rank:
  1. local dS = the gradient of this rank's outputs with respect to S_in (the transpose of step 4);
  2. one all-gather of dS [M, H, K, V]; the gradient T of the outgoing sequence's state at the rank's
     end is folded from the successors: T = dS_qe, then T = dS_q + D_q * T backwards along the chain;
  3. one ordinary backward call on the local slice with the true initial states (h0, S_in) and
     dht = T for the outgoing segment (dL of the final-state rows for segments ending here): it gives
     dq, dk, dv, dg (the decay's share through D included) and dh0.
M is 1 for packed input (a rank has at most one outgoing and one incoming sequence) and B for
batched input. Steps 1 and 3 are the library's own operators (any backend); only the linear
completion (4) and its transpose are tensor ops here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import _ops
from ._distributed_plan import Plan, RankLayout

CUMSUM_BLOCK = 4096  # tokens per block of the cumulative gate: bounds its temporaries to a few H·K·4096 floats
SCAN = 64  # tokens per inner scan (6 doubling steps)


@dataclass
class Call:
    """Everything about one call that is not a tensor."""
    plan: Plan
    exchange: object  # _distributed_exchange.InMemory or TorchDistributed
    scale: float
    output_final_state: bool
    state_v_first: bool
    backend: str
    policy: int
    offsets: dict  # (rank, device) -> (cu_seqlens on the device, host copy); filled lazily


class _Rows:
    """Local state rows of one rank for a batch of B (batched input) or its segments (packed)."""

    def __init__(self, lay: RankLayout, varlen: bool, B: int):
        segs = lay.segments
        if varlen:
            self.count = len(segs)
            self.start = [i for i, s in enumerate(segs) if s.starts_here]
            self.start_seqs = [segs[i].seq for i in self.start]
            self.end = [i for i, s in enumerate(segs) if s.ends_here]
            self.end_seqs = [segs[i].seq for i in self.end]
            self.incoming = [0] if lay.incoming else []
            self.outgoing = [len(segs) - 1] if lay.outgoing else []
        else:
            every = list(range(B)) if segs else []
            self.count = B if segs else 0
            self.start = self.start_seqs = every if segs and segs[0].starts_here else []
            self.end = self.end_seqs = every if segs and segs[-1].ends_here else []
            self.incoming = every if lay.incoming else []
            self.outgoing = every if lay.outgoing else []
        # the incoming segment's tokens [0, in_len) and the outgoing one's [out_begin, tokens)
        self.in_len = segs[0].end if lay.incoming else 0
        self.out_begin = segs[-1].begin if lay.outgoing else lay.tokens
        self.in_ends_here = lay.incoming and segs[0].ends_here


def _per_key(g: Tensor, K: int) -> Tensor:
    return g.unsqueeze(-1).expand(*g.shape, K) if g.dim() == 3 else g


def _scan_decay(g: Tensor, offset: Tensor, acc: torch.dtype) -> Tensor:
    """exp(offset + G_t), G_t = sum_{u <= t} g_u along dim 1 (g per key): inclusive scans of 64 tokens
    by doubling in `acc`, their totals carried in fp64 (torch's cumsum along dim 1 took 28 ms for
    2048x4x64 fp64 on the CPU where this takes 2.6 ms; 3.5e-8 relative error against fp64)."""
    M, t = g.shape[:2]
    rest = tuple(g.shape[2:])
    nb = -(-t // SCAN)
    y = g.to(acc)
    if nb * SCAN != t:
        y = torch.cat([y, y.new_zeros((M, nb * SCAN - t) + rest)], dim=1)
    y = y.reshape((M, nb, SCAN) + rest)
    step = 1
    while step < SCAN:
        z = y.clone()
        z[:, :, step:] += y[:, :, :-step]
        y, step = z, 2 * step
    totals = torch.cumsum(y[:, :, -1].double(), dim=1)
    carry = torch.cat([offset.unsqueeze(1), offset.unsqueeze(1) + totals[:, :-1]], dim=1)  # never -inf - -inf
    e = torch.exp(y) * torch.exp(carry).to(acc).unsqueeze(2)
    return e.reshape((M, nb * SCAN) + rest)[:, :t]


def _decays(g: Tensor, K: int, acc: torch.dtype):
    """exp(G_t) for G_t = sum_{u <= t} g_u along dim 1, in blocks of CUMSUM_BLOCK tokens: yields
    (t0, t1, exp(G[t0:t1])) [M, t1 - t0, H, K]."""
    offset = None
    for t0 in range(0, g.shape[1], CUMSUM_BLOCK):
        t1 = min(g.shape[1], t0 + CUMSUM_BLOCK)
        block = _per_key(g[:, t0:t1], K)
        if offset is None:
            offset = torch.zeros((block.shape[0],) + tuple(block.shape[2:]), dtype=torch.float64, device=g.device)
        yield t0, t1, _scan_decay(block, offset, acc)
        offset = offset + block.double().sum(dim=1)


def _offsets(call: Call, lay: RankLayout, device: torch.device):
    key = (lay.rank, str(device))
    if key not in call.offsets:
        host = torch.tensor(lay.local_offsets(), dtype=torch.int64)
        call.offsets[key] = (host.to(device) if device.type != "cpu" else host, host)
    return call.offsets[key]


def _local_states(rows: _Rows, h0: Optional[Tensor], incoming: Optional[Tensor], shape, device) -> Optional[Tensor]:
    """[rows, H, K, V] fp32: h0 for sequences starting here, `incoming` for the incoming rows, 0 else."""
    if (h0 is None or not rows.start) and incoming is None:
        return None
    out = torch.zeros((rows.count,) + tuple(shape), dtype=torch.float32, device=device)
    if h0 is not None and rows.start:
        out[rows.start] = h0[rows.start_seqs]
    if incoming is not None:
        out[rows.incoming] = incoming
    return out


def _fold_forward(lay: RankLayout, L: Tensor, D: Tensor) -> Tensor:
    """The state entering the rank: L of the chain's first rank, decayed and added along the chain."""
    preds = lay.predecessors
    S = L[preds[0]].clone()
    for p in preds[1:]:
        S = D[p].unsqueeze(-1) * S + L[p]
    return S


def _fold_backward(lay: RankLayout, dS: Tensor, D: Tensor) -> Tensor:
    """Gradient of the outgoing sequence's state at the rank's end, from every successor's dS."""
    succ = lay.successors
    T = dS[succ[-1]].clone()
    for p in reversed(succ[:-1]):
        T = dS[p] + D[p].unsqueeze(-1) * T
    return T


class ContextParallel(torch.autograd.Function):
    """apply(call, h0, q_0, k_0, v_0, g_0, q_1, ...): the local ranks' inputs in order, h0 shared
    (fp32 [N, H, K, V], or None). Returns o_0, o_1, ... then (with output_final_state) each rank's
    final state [N, H, K, V] (rows of sequences ending elsewhere are 0)."""

    @staticmethod
    def forward(ctx, call: Call, h0: Optional[Tensor], *tensors: Tensor):
        plan, ex = call.plan, call.exchange
        groups = [tensors[i:i + 4] for i in range(0, len(tensors), 4)]
        q0, v0 = groups[0][0], groups[0][2]
        B, H, K, V = q0.shape[0], q0.shape[2], q0.shape[3], v0.shape[3]
        acc = torch.float64 if q0.dtype == torch.float64 else torch.float32
        h0k = h0.transpose(-1, -2) if (h0 is not None and call.state_v_first) else h0
        M = 1 if plan.varlen else B
        lays = [plan.ranks[r] for r in ex.local_ranks]
        rows = [_Rows(lay, plan.varlen, B) for lay in lays]

        # 1-2: local calls from a zero incoming state; payloads [M, H, K, V + 1] = (L | D)
        outs, finals, payloads = [], [], []
        for lay, rw, (q, k, v, g) in zip(lays, rows, groups):
            payload = torch.zeros(M, H, K, V + 1, dtype=acc, device=q.device)
            if rw.count == 0:
                outs.append(v.new_empty(v.shape))
                finals.append(q.new_zeros((0, H, K, V), dtype=acc))
                payloads.append(payload)
                continue
            cu, host = _offsets(call, lay, q.device) if plan.varlen else (None, None)
            init = _local_states(rw, h0k, None, (H, K, V), q.device)
            o, F = torch.ops.gla.chunk_fwd(q, k, v, g, init, cu, host, call.scale, False, True, call.backend,
                                           call.policy)
            F = F.to(acc)
            if rw.outgoing:
                payload[..., :V] = F[rw.outgoing]
                total = _per_key(g[:, rw.out_begin:], K).double().sum(dim=1)
                payload[..., V] = torch.exp(total).to(acc)
            outs.append(o)
            finals.append(F)
            payloads.append(payload)
        gathered = ex.all_gather(payloads)
        L_all, D_all = gathered[..., :V], gathered[..., V]

        # 3-4: fold the predecessors into the incoming state and complete the incoming segment
        incoming_states = []
        for lay, rw, (q, k, v, g), o, F in zip(lays, rows, groups, outs, finals):
            if not lay.incoming:
                incoming_states.append(None)
                continue
            S = _fold_forward(lay, L_all, D_all)  # [M, H, K, V]
            incoming_states.append(S)
            last = None
            for t0, t1, e in _decays(g[:, :rw.in_len], K, acc):
                corr = torch.einsum("bthk,bhkv->bthv", q[:, t0:t1].to(acc) * e, S) * call.scale
                o[:, t0:t1] = (o[:, t0:t1].to(acc) + corr).to(o.dtype)
                last = e[:, -1]
            if rw.in_ends_here:
                F[rw.incoming] = F[rw.incoming] + last.unsqueeze(-1) * S

        results = list(outs)
        if call.output_final_state:
            for rw, F, q in zip(rows, finals, (grp[0] for grp in groups)):
                fs = torch.zeros(plan.num_sequences if plan.varlen else B, H, K, V, dtype=torch.float32,
                                 device=q.device)
                if rw.end:
                    fs[rw.end_seqs] = F[rw.end].to(torch.float32)
                results.append(fs.transpose(-1, -2).contiguous() if call.state_v_first else fs)

        ctx.call, ctx.has_h0, ctx.shapes = call, h0 is not None, (B, H, K, V, M, acc)
        ctx.rows = rows
        ctx.save_for_backward(h0k, D_all, *tensors, *[S for S in incoming_states if S is not None])
        ctx.incoming_present = [S is not None for S in incoming_states]
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        plan, ex = call.plan, call.exchange
        B, H, K, V, M, acc = ctx.shapes
        saved = ctx.saved_tensors
        h0k, D_all = saved[0], saved[1]
        R = len(ex.local_ranks)
        tensors = saved[2:2 + 4 * R]
        groups = [tensors[i:i + 4] for i in range(0, len(tensors), 4)]
        extra = iter(saved[2 + 4 * R:])
        incoming_states = [next(extra) if present else None for present in ctx.incoming_present]
        lays = [plan.ranks[r] for r in ex.local_ranks]
        d_out = grads[:R]
        d_final = list(grads[R:2 * R]) if call.output_final_state else [None] * R
        d_final = [d.transpose(-1, -2) if (d is not None and call.state_v_first) else d for d in d_final]

        # 1: local gradient with respect to the incoming state
        payloads = []
        for lay, rw, (q, k, v, g), S, do, dfs in zip(lays, ctx.rows, groups, incoming_states, d_out, d_final):
            payload = torch.zeros(M, H, K, V, dtype=acc, device=q.device)
            if S is not None:
                last = None
                for t0, t1, e in _decays(g[:, :rw.in_len], K, acc):
                    payload += torch.einsum("bthk,bthv->bhkv", q[:, t0:t1].to(acc) * e,
                                            do[:, t0:t1].to(acc)) * call.scale
                    last = e[:, -1]
                if rw.in_ends_here and dfs is not None:
                    seqs = [lay.segments[0].seq] if plan.varlen else list(range(B))
                    payload += last.unsqueeze(-1) * dfs[seqs].to(acc)
            payloads.append(payload)
        dS_all = ex.all_gather(payloads)

        # 2-3: fold the successors' gradients, then one ordinary backward call per rank
        dh0 = torch.zeros_like(h0k) if ctx.has_h0 else None
        grads_in = []
        for lay, rw, (q, k, v, g), S, do, dfs in zip(lays, ctx.rows, groups, incoming_states, d_out, d_final):
            if rw.count == 0:
                grads_in += [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g)]
                continue
            cu, host = _offsets(call, lay, q.device) if plan.varlen else (None, None)
            init = _local_states(rw, h0k, S.to(torch.float32) if S is not None else None, (H, K, V), q.device)
            dht = None
            if (dfs is not None and rw.end) or rw.outgoing:
                dht = torch.zeros(rw.count, H, K, V, dtype=torch.float32, device=q.device)
                if dfs is not None and rw.end:
                    dht[rw.end] = dfs[rw.end_seqs].to(torch.float32)
                if rw.outgoing:
                    dht[rw.outgoing] = _fold_backward(lay, dS_all, D_all).to(torch.float32)
            dq, dk, dv, dg, dinit = torch.ops.gla.chunk_bwd(q, k, v, g, init, cu, host, do.contiguous(), dht,
                                                            call.scale, False, call.backend, call.policy)
            if dh0 is not None and rw.start:
                dh0[rw.start_seqs] += dinit[rw.start].to(dh0.dtype)
            grads_in += [dq, dk, dv, dg]
        if dh0 is not None and call.state_v_first:
            dh0 = dh0.transpose(-1, -2)
        return (None, dh0, *grads_in)


def run(call: Call, h0: Optional[Tensor], parts: Sequence[Sequence[Tensor]]) -> List[Tensor]:
    """Applies the Function to the local ranks' (q, k, v, g) parts; returns its outputs as a list."""
    flat = [t for part in parts for t in part]
    return list(ContextParallel.apply(call, h0, *flat))


def selection():
    """The thread's backend and policy, captured for the backward (as gla.chunk_gla does)."""
    return _ops.current_backend(), _ops.current_policy()
