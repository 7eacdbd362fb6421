"""The chunked GLA algorithm (SPEC.md §2) written only with PyTorch tensor ops.

This is the body of the portable `torch` backend: matmul, cumsum, exp2 and select masks, nothing
device-specific, so it runs wherever PyTorch runs (CPU, CUDA, Ascend NPU, Apple MPS, Intel XPU).
Numerics follow SPEC.md §3:

- everything accumulates in fp32 (fp64 when the inputs are fp64, for gradcheck);
- every exponent evaluated is <= 0 when g <= 0: off-diagonal 16x16 blocks of the intra-chunk
  matrices are factorised around a pivot (the first row of the query sub-chunk for A and dq, the
  last row of the key sub-chunk for dk) and the diagonal blocks are computed element-wise in log
  space;
- masks are selects (masked_fill to -inf before exp2, or to 0), never multiplications by 0/1.

Layout inside: [B, T, H, D] inputs are padded to whole chunks with zeros (a zero gate keeps the
cumulative gate flat past the end, so the last row of a padded chunk holds b_last) and viewed as
[B, H, NT, C, D]. Sequences of a varlen batch are processed one at a time by the caller.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

RCP_LN2 = 1.0 / math.log(2.0)
SUB = 16  # sub-chunk rows: the pivot granularity of SPEC.md §3 rule 2


def chunk_size_for(T: int) -> int:
    """64 for T >= 64 (fla's choice), else T rounded up to a whole number of 16-row sub-chunks."""
    return 64 if T >= 64 else max(SUB, -(-T // SUB) * SUB)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [B, H, NT, C, D], zero-padded past T."""
    B, T, H, D = x.shape
    NT = -(-T // C)
    if NT * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, NT * C - T))
    return x.reshape(B, NT, C, H, D).permute(0, 3, 1, 2, 4)


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, NT, C, D] -> [B, T, H, D]."""
    B, H, NT, C, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, NT * C, H, D)[:, :T]


class _Chunked:
    """Chunk-local quantities shared by forward and backward for one batch of equal-length rows."""

    def __init__(self, q, k, v, g, scale: float):
        T = q.shape[1]
        self.T = T
        self.C = C = chunk_size_for(T)
        self.ns = C // SUB
        self.scale = scale
        self.q = _to_chunks(q, C)
        self.k = _to_chunks(k, C)
        self.v = _to_chunks(v, C)
        # F1: inclusive chunk-local cumulative gate in log2 units.
        self.g = _to_chunks(g, C) * RCP_LN2
        self.b = self.g.cumsum(-2)
        self.b_last = self.b[..., -1, :]  # [B, H, NT, K]; padding rows carry the last valid value
        # b_last - b_s as its own sum over u > s, not a difference of two large cumsums.
        self.to_last = self.g.flip(-2).cumsum(-2).flip(-2) - self.g
        dev = q.device
        rows = torch.arange(C, device=dev)
        self.sub_of = rows // SUB
        r = torch.arange(SUB, device=dev)
        self.tril = r[None, :] <= r[:, None]  # [16 (t), 16 (s)]: s <= t
        self.causal = rows[None, :] <= rows[:, None]  # [C, C]
        self._intra_weights()

    def _sub(self, x):
        """[..., C, D] -> [..., ns, 16, D]."""
        return x.unflatten(-2, (self.ns, SUB))

    def _intra_weights(self):
        """Decay-weighted operands for the off-diagonal blocks and the diagonal block weights.

        Every exponent is formed as a direct sum of the gates it spans (never as the difference of
        two chunk-level cumulative sums): with g = -7 per step b reaches ~-650 within a chunk,
        where fp32's spacing is 6e-5, which would put ~4e-5 relative error on every decay factor."""
        ns = self.ns
        g_sub = self._sub(self.g)  # [B, H, NT, ns, 16, K]
        first_row = (torch.arange(SUB, device=g_sub.device) == 0)[:, None]
        inclusive = g_sub.cumsum(-2)  # sum over the sub-chunk up to and including the row
        after_first = g_sub.masked_fill(first_row, 0).cumsum(-2)  # sum over (first row, t]
        to_end = g_sub.flip(-2).cumsum(-2).flip(-2) - g_sub  # sum over (s, last row]
        total = inclusive[..., -1, :]  # [.., ns, K]
        ids = torch.arange(ns, device=g_sub.device)
        # between[i, j] = sum of the totals of sub-chunks m with j < m < i  [.., ns, ns, K]
        strictly_between = (ids[None, :, None] < ids[None, None, :]) & (ids[None, None, :] < ids[:, None, None])
        between = torch.einsum("ijm,...mk->...ijk", strictly_between.to(total.dtype), total)
        later = ids[:, None] > ids[None, :]  # [i, j]: i after j

        def per_row(x):  # [.., ns, ns, K] indexed [i, j] -> [.., ns, C, K] indexed [i, s in j]
            return x.repeat_interleave(SUB, dim=-2)

        # A and dq, pivot at the first row P_i of query sub-chunk i:
        #   q_t 2^(b_t - P_i) for t in i;  k_s 2^(P_i - b_s) for s in sub-chunks j < i.
        self.q_decay_first = torch.exp2(after_first)  # [.., ns, 16, K]
        self.q_pivot = self._sub(self.q) * self.q_decay_first
        expo = per_row(between) + to_end.flatten(-3, -2)[..., None, :, :] + g_sub[..., :, 0:1, :]
        mask = per_row(later[..., None].expand(ns, ns, 1))  # [ns, C, 1]
        self.k_pivot = self.k[..., None, :, :] * torch.exp2(expo.masked_fill(~mask, -math.inf))
        # dk, pivot at the last row L_j of key sub-chunk j:
        #   k_s 2^(L_j - b_s) for s in j;  q_t 2^(b_t - L_j) for t in sub-chunks i > j.
        self.k_decay_last = torch.exp2(to_end)  # [.., ns, 16, K]
        expo = per_row(between.transpose(-3, -2)) + inclusive.flatten(-3, -2)[..., None, :, :]
        mask = per_row(later.t()[..., None].expand(ns, ns, 1))
        self.q_pivot_last = self.q[..., None, :, :] * torch.exp2(expo.masked_fill(~mask, -math.inf))
        # Diagonal blocks, element-wise: W[t, s] = 2^(sum of g over (s, t]) for s <= t.
        r = torch.arange(SUB, device=g_sub.device)
        spans = g_sub[..., :, None, :].masked_fill((r[:, None] <= r[None, :])[..., None], 0)  # [u, s]: u > s
        expo = spans.cumsum(-3)  # [.., ns, 16 (t), 16 (s), K]
        self.w_diag = torch.exp2(expo.masked_fill(~self.tril[..., None], -math.inf))

    def _diag_blocks(self, M):
        """View of the ns diagonal 16x16 blocks of [.., C, C] as [.., 16, 16, ns] (writable)."""
        M5 = M.unflatten(-1, (self.ns, SUB)).unflatten(-3, (self.ns, SUB))  # [.., ns, 16, ns, 16]
        return torch.diagonal(M5, dim1=-4, dim2=-2)

    def attention(self):
        """F3: A[t, s] = scale * sum_k q_tk k_sk 2^(b_tk - b_sk) for s <= t, zero above."""
        q_sub, k_sub = self._sub(self.q), self._sub(self.k)
        A = (self.q_pivot @ self.k_pivot.transpose(-1, -2)).flatten(-3, -2)  # [.., C, C]
        diag = (q_sub[..., :, None, :] * k_sub[..., None, :, :] * self.w_diag).sum(-1)  # [.., ns, 16, 16]
        self._diag_blocks(A).copy_(diag.permute(*range(diag.dim() - 3), -2, -1, -3))
        return A * self.scale

    def states(self, h0: Optional[torch.Tensor]):
        """F2: chunk-start states [B, H, NT, K, V] and the final state [B, H, K, V]."""
        k_decay = self.k * torch.exp2(self.to_last)
        update = k_decay.transpose(-1, -2) @ self.v  # [B, H, NT, K, V]
        decay = torch.exp2(self.b_last)[..., None]  # [B, H, NT, K, 1]
        B, H, NT, K, V = update.shape
        S = h0 if h0 is not None else update.new_zeros(B, H, K, V)
        starts = []
        for c in range(NT):
            starts.append(S)
            S = decay[:, :, c] * S + update[:, :, c]
        return torch.stack(starts, 2), S, k_decay


def _rows_forward(q, k, v, g, scale, h0):
    """Equal-length rows: q, k, g [B, T, H, K], v [B, T, H, V], h0 [B, H, K, V] or None (compute
    dtype). Returns o [B, T, H, V] and the final state [B, H, K, V]."""
    ch = _Chunked(q, k, v, g, scale)
    starts, final, _ = ch.states(h0)
    A = ch.attention()
    o = scale * (ch.q * torch.exp2(ch.b)) @ starts + A @ ch.v  # F4
    return _from_chunks(o, ch.T), final


def _rows_backward(q, k, v, g, scale, h0, do, dht):
    """Gradients for equal-length rows; do [B, T, H, V], dht [B, H, K, V] (either may be None).
    Returns dq, dk, dv, dg (per key) and dh0, in the compute dtype."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    ch = _Chunked(q, k, v, g, scale)
    starts, _, k_decay = ch.states(h0)  # B0
    do_c = _to_chunks(do, ch.C) if do is not None else ch.v.new_zeros(ch.v.shape)
    # B1: dh[c] = dL/d(state at the end of chunk c); dh0 = dL/d(initial state).
    q_decay = ch.q * torch.exp2(ch.b)
    into_state = (scale * q_decay).transpose(-1, -2) @ do_c  # [B, H, NT, K, V]
    decay = torch.exp2(ch.b_last)[..., None]
    dS = dht if dht is not None else q.new_zeros(B, H, K, V)
    dh = [None] * into_state.shape[2]
    for c in reversed(range(len(dh))):
        dh[c] = dS
        dS = decay[:, :, c] * dS + into_state[:, :, c]
    dh0 = dS
    dh = torch.stack(dh, 2)
    A = ch.attention()
    # B2, B3
    dv = A.transpose(-1, -2) @ do_c + k_decay @ dh
    dA = (do_c @ ch.v.transpose(-1, -2)).masked_fill(~ch.causal, 0) * scale
    # B4: off-diagonal blocks through the pivoted operands, diagonal blocks element-wise.
    ns = ch.ns
    q_sub, k_sub = ch._sub(ch.q), ch._sub(ch.k)
    # M[i, t, j] = sum over s in key sub-chunk j of dA[t, s] k_s 2^(P_i - b_s)  [.., ns, 16, ns, K]
    dA_blocks = dA.unflatten(-1, (ns, SUB)).unflatten(-3, (ns, SUB))  # [.., ns(i), 16, ns(j), 16]
    M = torch.einsum("...itjs,...ijsk->...itjk", dA_blocks, ch.k_pivot.unflatten(-2, (ns, SUB)))
    q_scaled = ch.q_decay_first  # 2^(b_t - P_i)
    dq = q_scaled * M.sum(-2)
    dA_cols = dA.transpose(-1, -2).unflatten(-2, (ns, SUB))  # [.., ns, 16 (s), C (t)]
    dk = ch.k_decay_last * (dA_cols @ ch.q_pivot_last)
    dA_diag = ch._diag_blocks(dA).permute(*range(dA.dim() - 2), -1, -3, -2)  # [.., ns, 16, 16]
    weighted = dA_diag[..., None] * ch.w_diag  # [.., ns, 16 (t), 16 (s), K]
    dq_diag = (weighted * k_sub[..., None, :, :]).sum(-2)
    dk_diag = (weighted * q_sub[..., :, None, :]).sum(-3)
    # B5: inter-chunk terms.
    dq_inter = scale * torch.exp2(ch.b) * (do_c @ starts.transpose(-1, -2))
    dk_inter = torch.exp2(ch.to_last) * (ch.v @ dh.transpose(-1, -2))
    # dg_u = sum over pairs (t >= u > s) of dA[t,s] q_t k_s 2^(b_t - b_s), plus the inter-chunk
    # terms. Summed pair by pair instead of as the reverse cumsum of q*dq - k*dk, whose large
    # near-diagonal terms cancel: that cancellation costs ~3e-5 relative error in fp32 for strong
    # decay (n = 0.1), above SPEC's 1e-5.
    pair = weighted * (q_sub[..., :, None, :] * k_sub[..., None, :, :])  # [.., ns, 16 t, 16 s, K]
    before_u = pair.cumsum(-2) - pair  # sum over s < u of pair[t, s], indexed [t, u]
    dg = before_u.masked_fill(~ch.tril[..., None], 0).sum(-3)  # keep t >= u: [.., ns, 16 (u), K]
    q_off = q_sub * dq  # dq holds only the off-diagonal part here
    k_off = k_sub * dk
    dg = dg + q_off.flip(-2).cumsum(-2).flip(-2) + (k_off.cumsum(-2) - k_off)
    # Pairs with t after sub-chunk m and s before it: constant over u in m.
    block = (q_sub * q_scaled).unsqueeze(-2).mul(M).sum(-3)  # [.., ns (i), ns (j), K]
    ids = torch.arange(ns, device=q.device)
    straddle = (ids[None, :, None] > ids[:, None, None]) & (ids[None, None, :] < ids[:, None, None])
    dg = dg + torch.einsum("mij,...ijk->...mk", straddle.to(block.dtype), block)[..., None, :]
    dq = (dq + dq_diag).flatten(-3, -2) + dq_inter
    dk = (dk + dk_diag).flatten(-3, -2) + dk_inter
    qi, ki = ch.q * dq_inter, ch.k * dk_inter
    dg = dg.flatten(-3, -2) + qi.flip(-2).cumsum(-2).flip(-2) + (ki.cumsum(-2) - ki)
    dg = dg + (torch.exp2(ch.b_last) * (starts * dh).sum(-1))[..., None, :]
    T_ = ch.T
    return (_from_chunks(dq, T_), _from_chunks(dk, T_), _from_chunks(dv, T_), _from_chunks(dg, T_), dh0)


def _state_in(state, state_v_first, dtype):
    if state is None:
        return None
    state = state.to(dtype)
    return state.transpose(-1, -2) if state_v_first else state


def _state_out(state, state_v_first):
    return state.transpose(-1, -2) if state_v_first else state


def _segments(B: int, T: int, seq_offsets: Optional[Sequence[int]]):
    """(batch row or None, start, end, state index) per group of rows computed together."""
    if seq_offsets is None:
        return [(None, 0, T, None)]
    return [(0, int(seq_offsets[n]), int(seq_offsets[n + 1]), n) for n in range(len(seq_offsets) - 1)]


def chunk_forward(q, k, v, g, scale: float, initial_state=None, seq_offsets=None,
                  state_v_first: bool = False, want_final_state: bool = True):
    """o (compute dtype) and final_state (compute dtype, or None).

    q, k [B, T, H, K]; g [B, T, H, K] or [B, T, H]; v [B, T, H, V]; initial_state [N, H, K, V]
    ([N, H, V, K] with state_v_first) or None. seq_offsets: host sequence offsets (N + 1 ints)
    for varlen (then B == 1), or None for one sequence per batch row."""
    cd = compute_dtype(q.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    q, k, v, g = q.to(cd), k.to(cd), v.to(cd), g.to(cd)
    if g.dim() == 3:
        g = g[..., None].expand(B, T, H, K)
    h0 = _state_in(initial_state, state_v_first, cd)
    if seq_offsets is None:
        if T == 0:
            o = q.new_zeros(B, T, H, V)
            final = h0.clone() if h0 is not None else q.new_zeros(B, H, K, V)
        else:
            o, final = _rows_forward(q, k, v, g, scale, h0)
    else:
        N = len(seq_offsets) - 1
        o = q.new_zeros(B, T, H, V)
        finals = []
        for n in range(N):
            s, e = int(seq_offsets[n]), int(seq_offsets[n + 1])
            h0n = h0[n:n + 1] if h0 is not None else None
            if e == s:
                finals.append(h0n if h0n is not None else q.new_zeros(1, H, K, V))
                continue
            on, fn = _rows_forward(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0n)
            o[:, s:e] = on
            finals.append(fn)
        final = torch.cat(finals, 0) if finals else q.new_zeros(0, H, K, V)
    return o, (_state_out(final, state_v_first) if want_final_state else None)


def chunk_backward(q, k, v, g, scale: float, initial_state=None, seq_offsets=None,
                   state_v_first: bool = False, do=None, dht=None):
    """dq, dk, dv, dg (shaped like g), dh0 (like initial_state, or [N, H, K, V] zeros-state
    gradient when there is none), all in the compute dtype."""
    cd = compute_dtype(q.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    per_head = g.dim() == 3
    q, k, v, g = q.to(cd), k.to(cd), v.to(cd), g.to(cd)
    if per_head:
        g = g[..., None].expand(B, T, H, K)
    h0 = _state_in(initial_state, state_v_first, cd)
    do = do.to(cd) if do is not None else None
    dht = _state_in(dht, state_v_first, cd)
    if seq_offsets is None:
        if T == 0:
            grads = [q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, V),
                     q.new_zeros(B, T, H, K), dht.clone() if dht is not None else q.new_zeros(B, H, K, V)]
        else:
            grads = list(_rows_backward(q, k, v, g, scale, h0, do, dht))
    else:
        N = len(seq_offsets) - 1
        grads = [q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, K), q.new_zeros(B, T, H, V), q.new_zeros(B, T, H, K)]
        dh0s = []
        for n in range(N):
            s, e = int(seq_offsets[n]), int(seq_offsets[n + 1])
            dhtn = dht[n:n + 1] if dht is not None else None
            if e == s:
                dh0s.append(dhtn if dhtn is not None else q.new_zeros(1, H, K, V))
                continue
            h0n = h0[n:n + 1] if h0 is not None else None
            don = do[:, s:e] if do is not None else None
            part = _rows_backward(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0n, don, dhtn)
            for i in range(4):
                grads[i][:, s:e] = part[i]
            dh0s.append(part[4])
        grads.append(torch.cat(dh0s, 0) if dh0s else q.new_zeros(0, H, K, V))
    if per_head:
        grads[3] = grads[3].sum(-1)
    grads[4] = _state_out(grads[4], state_v_first)
    return tuple(grads)
