"""Context-parallel chunk_gla as one autograd Function over the ranks this process computes (one
rank under torch.distributed, all of them when simulated in memory).

Per rank, with S_in the true state entering its incoming segment (docs/distributed.md):
Forward
  1. local call on the segments after the incoming one (on the whole slice when the rank holds only
     one sequence's interior, from a zero state): their o, final states, and for the outgoing
     sequence L = its local final state;
  2. all-gather [M, H, K, V + 1] = (L | D), D = exp(sum of g over the outgoing segment) per key;
  3. fold the predecessors: S_in = L_p0, then S_in = D_p * S_in + L_p along the chain;
  4. local call on the incoming segment from S_in: its o and final state.
Backward
  1. dS = the gradient of the incoming segment's outputs with respect to S_in: the final state of a
     local call on the segment in reverse order (keys q, values do, gates shifted by one token);
  2. all-gather dS [M, H, K, V]; fold the successors backwards: T = dS_qe, then T = dS_q + D_q * T;
  3. one local backward call on the slice from the true initial states (h0, S_in), with dht = T
     for the outgoing segment: dq, dk, dv, dg (the decay's share through D included) and dh0.
Every step that touches activations is the library's own operator (any backend). M is 1 for packed
input (at most one incoming and one outgoing sequence per rank) and B for batched input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from . import _chunked, _ops
from ._distributed_plan import Plan, RankLayout


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
    offsets: dict  # (rank, first segment, device) -> (cu_seqlens on the device, host copy); filled lazily


class _Rows:
    """A rank's local state rows (one per segment for packed input, one per batch row for batched
    input) and the token ranges of its two forward calls."""

    def __init__(self, lay: RankLayout, varlen: bool, B: int):
        segs = lay.segments
        self.spans = lay.spans
        # the call from zero / h0 covers segments[first:]; the incoming segment is [0, in_len)
        self.first = 1 if (lay.incoming and not lay.spans) else 0
        self.in_len = segs[0].end if lay.incoming else 0
        self.rest_begin = segs[self.first].begin if self.first < len(segs) else lay.tokens
        if varlen:
            self.count = len(segs)
            self.start = [i for i, s in enumerate(segs) if s.starts_here]
            self.start_seqs = [segs[i].seq for i in self.start]
            self.end = [i for i, s in enumerate(segs) if s.ends_here]
            self.end_seqs = [segs[i].seq for i in self.end]
            self.incoming = [0] if lay.incoming else []
            self.outgoing = [len(segs) - 1] if lay.outgoing else []
            self.in_seqs = [segs[0].seq] if lay.incoming else []
        else:
            every = list(range(B)) if segs else []
            self.count = B if segs else 0
            self.start = self.start_seqs = every if segs and segs[0].starts_here else []
            self.end = self.end_seqs = every if segs and segs[-1].ends_here else []
            self.incoming = self.in_seqs = every if lay.incoming else []
            self.outgoing = every if lay.outgoing else []
        self.varlen = varlen
        self.in_ends_here = lay.incoming and segs[0].ends_here

    def rest_rows(self, rows: List[int]) -> List[int]:
        """`rows` (local rows) as rows of the call over segments[first:] (packed input only shifts)."""
        return [r - self.first for r in rows if r >= self.first] if self.varlen else rows

    @property
    def rest_count(self) -> int:
        return self.count - self.first if self.varlen else (self.count if self.first == 0 else 0)


def _per_key(g: Tensor, K: int) -> Tensor:
    return g.unsqueeze(-1).expand(*g.shape, K) if g.dim() == 3 else g


def _offsets(call: Call, lay: RankLayout, first: int, device: torch.device):
    key = (lay.rank, first, str(device))
    if key not in call.offsets:
        host = torch.tensor(lay.local_offsets(first), dtype=torch.int64)
        call.offsets[key] = (host.to(device) if device.type != "cpu" else host, host)
    return call.offsets[key]


def _states(count: int, rows: List[int], values: Optional[Tensor], shape, device, dtype,
            more_rows: List[int] = (), more: Optional[Tensor] = None) -> Optional[Tensor]:
    """[count, H, K, V] (fp32; fp64 for fp64 inputs) with `values` in `rows` and `more` in `more_rows`, 0 elsewhere; None when
    both are absent (a zero state)."""
    if (values is None or not rows) and (more is None or not more_rows):
        return None
    out = torch.zeros((count,) + tuple(shape), dtype=dtype, device=device)
    if values is not None and rows:
        out[list(rows)] = values.to(dtype)
    if more is not None and more_rows:
        out[list(more_rows)] = more.to(dtype)
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


def _fwd(call: Call, q, k, v, g, init, cu=None, host=None):
    if q.dtype == torch.float64:  # outside the C ABI: the torch backend's body, as gla.chunk_gla does
        o, ht = _chunked.chunk_forward(q, k, v, g, call.scale, init, _offset_list(cu, host), False, True)
        return o.to(v.dtype), ht
    return torch.ops.gla.chunk_fwd(q, k, v, g, init, cu, host, call.scale, False, True, call.backend, call.policy)


def _bwd(call: Call, q, k, v, g, init, cu, host, do, dht):
    if q.dtype == torch.float64:
        dq, dk, dv, dg, dh0 = _chunked.chunk_backward(q, k, v, g, call.scale, init, _offset_list(cu, host), False,
                                                      do=do, dht=dht)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), dh0
    return torch.ops.gla.chunk_bwd(q, k, v, g, init, cu, host, do, dht, call.scale, False, call.backend, call.policy)


def _offset_list(cu, host):
    if cu is None:
        return None
    return (host if host is not None else cu).tolist()


def _incoming_state_grad(call: Call, q: Tensor, g: Tensor, do: Tensor, dfinal: Optional[Tensor]) -> Tensor:
    """d(outputs of the segment)/d(its initial state), [M, H, K, V] fp32: with G_t = g_0 + .. + g_t,
    dS = scale * sum_t exp(G_t) q_t do_tᵀ + exp(G_last) dfinal. In reverse order this is the GLA
    recurrence Z = exp(g_{t+1}) Z + q_t do_tᵀ from Z = dfinal / scale, and dS = scale exp(g_0) Z:
    the final state of one forward call on the flipped segment with the gates shifted by one."""
    K = q.shape[-1]
    shifted = torch.cat([g[:, 1:], torch.zeros_like(g[:, :1])], dim=1)
    qr, gr, dor = q.flip(1), shifted.flip(1), do.flip(1)
    init = dfinal / call.scale if dfinal is not None else None
    _, Z = _fwd(call, qr, qr, dor.to(q.dtype), gr, init)
    first = torch.exp(_per_key(g[:, :1], K)[:, 0].to(Z.dtype))
    return call.scale * first.unsqueeze(-1) * Z


class ContextParallel(torch.autograd.Function):
    """apply(call, h0, q_0, k_0, v_0, g_0, q_1, ...): the local ranks' inputs in order, h0 shared
    (fp32 [N, H, K, V] in the caller's layout, or None). Returns o_0, o_1, ... then (with
    output_final_state) each rank's final state [N, H, K, V] (rows of sequences ending elsewhere are 0)."""

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

        # 1-2: the call from zero / h0 over segments[first:]; payloads [M, H, K, V + 1] = (L | D)
        rest, payloads = [], []
        for lay, rw, (q, k, v, g) in zip(lays, rows, groups):
            payload = torch.zeros(M, H, K, V + 1, dtype=acc, device=q.device)
            result = None
            if rw.rest_count:
                cu, host = _offsets(call, lay, rw.first, q.device) if plan.varlen else (None, None)
                sl = slice(rw.rest_begin, None)
                h0_rows = h0k[rw.start_seqs] if (h0k is not None and rw.start) else None
                init = _states(rw.rest_count, rw.rest_rows(rw.start), h0_rows, (H, K, V), q.device, acc)
                result = _fwd(call, q[:, sl], k[:, sl], v[:, sl], g[:, sl], init, cu, host)
                if rw.outgoing:
                    payload[..., :V] = result[1][rw.rest_rows(rw.outgoing)]
                    total = _per_key(g[:, lay.segments[-1].begin:], K).double().sum(dim=1)
                    payload[..., V] = torch.exp(total).to(acc)
            rest.append(result)
            payloads.append(payload)
        gathered = ex.all_gather(payloads)
        L_all, D_all = gathered[..., :V], gathered[..., V]

        # 3-4: fold the predecessors, then the incoming segment from its true state
        outs, finals, incoming_states = [], [], []
        for lay, rw, (q, k, v, g), result in zip(lays, rows, groups, rest):
            F = torch.zeros(rw.count, H, K, V, dtype=acc, device=q.device)
            if result is not None and not rw.spans:
                F[rw.first:] = result[1].to(acc)
            S = None
            parts = []
            if lay.incoming:
                S = _fold_forward(lay, L_all, D_all)
                sl = slice(0, rw.in_len)
                o_in, F_in = _fwd(call, q[:, sl], k[:, sl], v[:, sl], g[:, sl], S)
                parts.append(o_in)
                F[rw.incoming] = F_in.to(acc)
            if result is not None and not rw.spans:
                parts.append(result[0])
            o = torch.cat(parts, dim=1) if len(parts) > 1 else (parts[0] if parts else v.new_empty(v.shape))
            outs.append(o)
            finals.append(F)
            incoming_states.append(S)

        results = list(outs)
        if call.output_final_state:
            for rw, F, q in zip(rows, finals, (grp[0] for grp in groups)):
                fs = torch.zeros(plan.num_sequences if plan.varlen else B, H, K, V, dtype=acc, device=q.device)
                if rw.end:
                    fs[rw.end_seqs] = F[rw.end]
                results.append(fs.transpose(-1, -2).contiguous() if call.state_v_first else fs)

        ctx.call, ctx.has_h0, ctx.shapes, ctx.rows = call, h0 is not None, (B, H, K, V, M, acc), rows
        ctx.incoming_present = [S is not None for S in incoming_states]
        ctx.save_for_backward(h0k, D_all, *tensors, *[S for S in incoming_states if S is not None])
        return tuple(results)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        plan, ex = call.plan, call.exchange
        B, H, K, V, M, acc = ctx.shapes
        saved = ctx.saved_tensors
        h0k, D_all = saved[0], saved[1]
        R = len(ex.local_ranks)
        groups = [saved[2 + i:2 + i + 4] for i in range(0, 4 * R, 4)]
        extra = iter(saved[2 + 4 * R:])
        incoming_states = [next(extra) if present else None for present in ctx.incoming_present]
        lays = [plan.ranks[r] for r in ex.local_ranks]
        d_out = grads[:R]
        d_final = list(grads[R:2 * R]) if call.output_final_state else [None] * R
        d_final = [d.transpose(-1, -2) if (d is not None and call.state_v_first) else d for d in d_final]

        # 1: the gradient of each incoming segment's outputs with respect to its initial state
        payloads = []
        for rw, (q, k, v, g), S, do, dfs in zip(ctx.rows, groups, incoming_states, d_out, d_final):
            payload = torch.zeros(M, H, K, V, dtype=acc, device=q.device)
            if S is not None:
                dfin = dfs[rw.in_seqs].to(acc) if (rw.in_ends_here and dfs is not None) else None
                sl = slice(0, rw.in_len)
                payload += _incoming_state_grad(call, q[:, sl], g[:, sl], do[:, sl], dfin).to(acc)
            payloads.append(payload)
        dS_all = ex.all_gather(payloads)

        # 2-3: fold the successors' gradients, then one backward call per rank from the true states
        dh0 = torch.zeros_like(h0k) if ctx.has_h0 else None
        grads_in = []
        for lay, rw, (q, k, v, g), S, do, dfs in zip(lays, ctx.rows, groups, incoming_states, d_out, d_final):
            if rw.count == 0:
                grads_in += [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(g)]
                continue
            cu, host = _offsets(call, lay, 0, q.device) if plan.varlen else (None, None)
            h0_rows = h0k[rw.start_seqs] if (h0k is not None and rw.start) else None
            init = _states(rw.count, rw.start, h0_rows, (H, K, V), q.device, acc, rw.incoming, S)
            T = _fold_backward(lay, dS_all, D_all) if rw.outgoing else None
            dfs_rows = dfs[rw.end_seqs] if (dfs is not None and rw.end) else None
            dht = _states(rw.count, rw.end, dfs_rows, (H, K, V), q.device, acc, rw.outgoing, T)
            dq, dk, dv, dg, dinit = _bwd(call, q, k, v, g, init, cu, host, do.contiguous(), dht)
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
