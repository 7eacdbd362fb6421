"""The recurrent operator in PyTorch tensor ops: the `torch` backend's recurrent_fwd / recurrent_bwd.

The token loop of SPEC.md §6 with states [N, H, K, V] batched over (sequence, head): any gates,
either order, varlen (a loop over sequences), the state pool (slots resolved on the device: no host
synchronisation). The backward recomputes the states from checkpoints and walks them in reverse.

Also the float64 path of gla.fused_recurrent_gla (float64 is outside libgla's C ABI).
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import _lib, _tensors

UNIT_RECURRENT_FWD, UNIT_RECURRENT_BWD = 11, 12
UNITS = (UNIT_RECURRENT_FWD, UNIT_RECURRENT_BWD)
SLOT_ERROR_OUT_OF_RANGE, SLOT_ERROR_REPEATED = 1, 2


class RecurrentProblem(_lib.Problem):
    """gla_problem with the recurrent units' fields appended (gla.h)."""
    _fields_ = [("gv", _lib.Tensor), ("dgv", _lib.Tensor), ("reverse", ctypes.c_int32),
                ("state_slots", _lib.Tensor), ("slot_error", _lib.Tensor), ("token_states", _lib.Tensor)]


def _to_key_major(state: Optional[Tensor], state_v_first: bool) -> Optional[Tensor]:
    if state is None:
        return None
    return state.transpose(-1, -2) if state_v_first else state


def _loop(q, k, v, gk, gv, scale, S, reverse, keep_states=False):
    """One batch of sequences of equal length: q, k, gk [N, L, H, K], v, gv [N, L, H, V], S [N, H, K, V]
    (float). Returns o [N, L, H, V] (S's dtype), the final S, and the state after each token if asked."""
    L = q.shape[1]
    outs: List[Optional[Tensor]] = [None] * L
    states: List[Optional[Tensor]] = [None] * L
    order = range(L - 1, -1, -1) if reverse else range(L)
    for t in order:
        S = _step(S, k, v, gk, gv, t)
        outs[t] = scale * torch.einsum("nhk,nhkv->nhv", q[:, t].to(S.dtype), S)
        if keep_states:
            states[t] = S
    o = torch.stack(outs, dim=1) if L else q.new_zeros((q.shape[0], 0, q.shape[2], v.shape[3]), dtype=S.dtype)
    token_states = torch.stack(states, dim=1) if keep_states and L else None
    return o, S, token_states


def recurrent_forward(q: Tensor, k: Tensor, v: Tensor, gk: Optional[Tensor], gv: Optional[Tensor], scale: float,
                      initial_state: Optional[Tensor], offsets: Optional[List[int]], reverse: bool,
                      state_v_first: bool, want_final_state: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """o [B, T, H, V] (float32, or float64 for float64 inputs) and the final state (states' layout)."""
    B, T, H, K = q.shape
    V = v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    h0 = _to_key_major(initial_state, state_v_first)
    if offsets is None:
        S = h0.to(acc) if h0 is not None else q.new_zeros((B, H, K, V), dtype=acc)
        o, S, _ = _loop(q, k, v, gk, gv, scale, S, reverse)
        finals = S
    else:
        pieces, ends = [], []
        for n in range(len(offsets) - 1):
            a, e = offsets[n], offsets[n + 1]
            S = h0[n:n + 1].to(acc) if h0 is not None else q.new_zeros((1, H, K, V), dtype=acc)
            sl = slice(a, e)
            o_n, S, _ = _loop(q[:, sl], k[:, sl], v[:, sl], gk[:, sl] if gk is not None else None,
                              gv[:, sl] if gv is not None else None, scale, S, reverse)
            pieces.append(o_n)
            ends.append(S)
        o = torch.cat(pieces, dim=1) if pieces else q.new_zeros((1, 0, H, V), dtype=acc)
        finals = torch.cat(ends, dim=0) if ends else q.new_zeros((0, H, K, V), dtype=acc)
    final = None
    if want_final_state:
        final = finals.transpose(-1, -2) if state_v_first else finals
    return o, final


# States kept every _CHECKPOINT steps in the backward (the rest recomputed per block).
_CHECKPOINT = 64


def _decay(gk, gv, t, dtype):
    decay = None
    if gk is not None:
        decay = torch.exp(gk[:, t].to(dtype)).unsqueeze(-1)
    if gv is not None:
        b = torch.exp(gv[:, t].to(dtype)).unsqueeze(-2)
        decay = b if decay is None else decay * b
    return decay


def _step(S, k, v, gk, gv, t):
    decay = _decay(gk, gv, t, S.dtype)
    if decay is not None:
        S = S * decay
    return S + k[:, t].to(S.dtype).unsqueeze(-1) * v[:, t].to(S.dtype).unsqueeze(-2)


def _loop_backward(q, k, v, gk, gv, scale, S, reverse, do, dS):
    """Gradients for one batch of equal-length sequences (see _loop): dq, dk, dv, dgk, dgv and dS of
    the initial state. Written out (SPEC.md §6 differentiated), as the operator runs below autograd."""
    L = q.shape[1]
    order = list(range(L - 1, -1, -1)) if reverse else list(range(L))
    acc = S.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = torch.zeros_like(dq), torch.zeros(v.shape, dtype=acc, device=q.device)
    dgk = torch.zeros_like(dq) if gk is not None else None
    dgv = torch.zeros_like(dv) if gv is not None else None
    checkpoints = []
    for s, t in enumerate(order):
        if s % _CHECKPOINT == 0:
            checkpoints.append(S)
        S = _step(S, k, v, gk, gv, t)
    for block in range(len(checkpoints) - 1, -1, -1):
        s0, s1 = block * _CHECKPOINT, min(L, (block + 1) * _CHECKPOINT)
        states = [checkpoints[block]]
        for s in range(s0, s1):
            states.append(_step(states[-1], k, v, gk, gv, order[s]))
        for s in range(s1 - 1, s0 - 1, -1):
            t = order[s]
            S_t, S_prev = states[s - s0 + 1], states[s - s0]
            d_o = do[:, t].to(acc) if do is not None else torch.zeros_like(dv[:, t])
            dq[:, t] = scale * torch.einsum("nhkv,nhv->nhk", S_t, d_o)
            dS = dS + scale * q[:, t].to(acc).unsqueeze(-1) * d_o.unsqueeze(-2)
            dk[:, t] = torch.einsum("nhkv,nhv->nhk", dS, v[:, t].to(acc))
            dv[:, t] = torch.einsum("nhkv,nhk->nhv", dS, k[:, t].to(acc))
            decay = _decay(gk, gv, t, acc)
            if decay is not None:
                x = dS * decay * S_prev
                if dgk is not None:
                    dgk[:, t] = x.sum(-1)
                if dgv is not None:
                    dgv[:, t] = x.sum(-2)
                dS = dS * decay
    return dq, dk, dv, dgk, dgv, dS


def recurrent_backward(q, k, v, gk, gv, scale, initial_state, offsets, reverse, state_v_first, do, dht):
    """dq, dk, dv, dgk, dgv, dh0 (None where the input is absent)."""
    B, T, H, K = q.shape
    V = v.shape[3]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    h0 = _to_key_major(initial_state, state_v_first)
    ht = _to_key_major(dht, state_v_first)
    if offsets is None:
        spans = [(slice(None), slice(None), slice(None))]
    else:
        spans = [(slice(0, 1), slice(offsets[n], offsets[n + 1]), slice(n, n + 1)) for n in range(len(offsets) - 1)]
    grads = [torch.zeros(x.shape, dtype=acc, device=q.device) if x is not None else None for x in (q, k, v, gk, gv)]
    dh0 = torch.zeros((h0.shape if h0 is not None else (0,)), dtype=acc, device=q.device)
    for rows, time, seq in spans:
        n_seq = B if offsets is None else 1
        S = h0[seq].to(acc) if h0 is not None else q.new_zeros((n_seq, H, K, V), dtype=acc)
        dS = ht[seq].to(acc) if ht is not None else q.new_zeros((n_seq, H, K, V), dtype=acc)
        part = lambda x: x[rows, time] if x is not None else None  # noqa: E731
        got = _loop_backward(part(q), part(k), part(v), part(gk), part(gv), scale, S, reverse, part(do), dS)
        for g, d in zip(grads, got[:5]):
            if g is not None:
                g[rows, time] = d
        if h0 is not None:
            dh0[seq] = got[5]
    out = [g.to(x.dtype) if g is not None else None for g, x in zip(grads, (q, k, v, gk, gv))]
    if initial_state is None:
        out.append(None)
    else:
        out.append(dh0.transpose(-1, -2) if state_v_first else dh0)
    return tuple(out)


def state_update(q, k, v, gk, gv, scale, pool, slots, slot_error, token_states, state_v_first) -> Tensor:
    """The serving step on a pool (gla.h: gla_recurrent_state_update), without host synchronisation:
    writes o, the pool (or token_states) and ORs the slot error bits; returns o (float)."""
    B, T, H, K = q.shape
    V = v.shape[3]
    P = pool.shape[0]
    s = slots.to(torch.int64)
    in_range = (s >= 0) & (s < P)
    earlier = torch.ones((B, B), dtype=torch.bool, device=s.device).tril(-1)
    repeated = ((s.unsqueeze(1) == s.unsqueeze(0)) & earlier & in_range.unsqueeze(0)).any(dim=1) & in_range
    valid = in_range & ~repeated
    bits = (~in_range).any().to(torch.int32) * SLOT_ERROR_OUT_OF_RANGE + repeated.any().to(torch.int32) * SLOT_ERROR_REPEATED
    slot_error.bitwise_or_(bits.reshape(1))
    key_major = _to_key_major(pool, state_v_first)
    if P > 0:
        S0 = key_major[torch.where(valid, s, torch.zeros_like(s))].to(torch.float32)
        S0 = torch.where(valid.view(B, 1, 1, 1), S0, torch.zeros_like(S0))
    else:
        S0 = q.new_zeros((B, H, K, V), dtype=torch.float32)
    o, S, states = _loop(q, k, v, gk, gv, scale, S0, False, keep_states=token_states is not None)
    o = torch.where(valid.view(B, 1, 1, 1), o, torch.zeros_like(o))
    if token_states is not None:
        states = torch.where(valid.view(B, 1, 1, 1, 1), states, torch.zeros_like(states))
        token_states.copy_(states.transpose(-1, -2) if state_v_first else states)
    elif P > 0:
        # Rows that are skipped write exactly what the first valid row writes, to the same slot (or
        # slot 0's own value back when no row is valid): index_copy_ then has one value per slot.
        has_valid = valid.any()
        first = torch.argmax(valid.to(torch.int32))
        target = torch.where(has_valid, s[first], torch.zeros_like(s[first]))
        fallback = torch.where(has_valid, S[first], key_major[0].to(torch.float32))
        index = torch.where(valid, s, target.expand(B))
        values = torch.where(valid.view(B, 1, 1, 1), S, fallback.unsqueeze(0))
        pool.index_copy_(0, index, (values.transpose(-1, -2) if state_v_first else values).to(pool.dtype))
    return o


def _offsets(p) -> Optional[List[int]]:
    if not p.varlen:
        return None
    return [int(p.seq_offsets[i]) for i in range(p.N + 1)]


def run_problem(p) -> None:
    """Runs a recurrent unit for the `torch` backend's run callback (p: the gla_problem)."""
    r = ctypes.cast(ctypes.pointer(p), ctypes.POINTER(RecurrentProblem)).contents
    w = _tensors.to_torch
    q, k, v, gk, gv = w(r.q), w(r.k), w(r.v), w(r.g), w(r.gv)
    v_first = bool(r.state_v_first)
    if r.unit == UNIT_RECURRENT_BWD:
        grads = recurrent_backward(q, k, v, gk, gv, r.scale, w(r.initial_state), _offsets(r), bool(r.reverse),
                                   v_first, w(r.do_), w(r.dht))
        for out, value in zip((r.dq, r.dk, r.dv, r.dg, r.dgv, r.dh0), grads):
            target = w(out)
            if target is not None and value is not None:
                target.copy_(value)
        return
    if r.state_slots.rank:
        o = state_update(q, k, v, gk, gv, r.scale, w(r.initial_state), w(r.state_slots), w(r.slot_error),
                         w(r.token_states), v_first)
        w(r.o).copy_(o)
        return
    final = w(r.final_state)
    o, ht = recurrent_forward(q, k, v, gk, gv, r.scale, w(r.initial_state), _offsets(r), bool(r.reverse), v_first,
                              want_final_state=final is not None)
    w(r.o).copy_(o)
    if final is not None:
        final.copy_(ht)
