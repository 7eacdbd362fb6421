"""Experiment (not shipped): a GPU-oriented body for the `torch` backend, to A/B against the shipped
one (gla/_chunked.py) with `bench/torch_backend_bench.py --cuda --experiment`.

Two changes, each switchable, installed by patching gla._chunked for the duration of a `with
installed(...)` block:

1. batched_scan: a block's state updates k_w^T v (and the backward's q_w^T do) as one bmm over all
   its chunks, and each scan step one addcmul (S <- e^(b_last) S + U_c) plus a copy of the entering
   state; the forward's inter-chunk output (q e^b) S_c as one bmm over the block. The shipped body
   runs two small baddbmm and a multiply per scan step (~3 x 64 launches per scan at T4096, SIMT
   fp32 GEMMs of 128 x 64 x 128 per head).
2. operand_dtype (bf16/fp16 inputs): the matmuls on data operands (the level products, A v, the
   state products, dA, the intra gradients' products) take 16-bit operands with fp32 accumulation
   and output, as SPEC.md §3 rule 1 allows for 16-bit inputs: tensor cores through
   torch.bmm(..., out_dtype=torch.float32) on CUDA; elsewhere the same rounding emulated (operands
   rounded, fp32 matmul) so its accuracy can be checked on the CPU. The span sums of the gates stay
   fp32 (their exponents need it).

The H200 profile of the shipped body (B8 T4096 H16 D128 bf16 fwd+bwd, 56.2 ms): 42.6 ms of kernels
in 1 749 launches; bmm 14.7 ms, mostly cutlass_80_simt_sgemm; baddbmm_ 4.7 ms in 277 calls.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from gla import _chunked, _scratch
from gla._chunked import (Layout, _finish_attention, _flat3, _quadrants, _running_state, _sequence_order,
                          add_inter_gradients, decays, gate_floor, levels, span_sums)

_operand = {"dtype": None}


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _mm(a3: torch.Tensor, b3: torch.Tensor) -> torch.Tensor:
    """a3 @ b3 ([n, i, k] x [n, k, j]) in fp32 from 16-bit operands."""
    dtype = _operand["dtype"]
    if a3.device.type == "cuda":
        return torch.bmm(_round(a3, dtype), _round(b3, dtype), out_dtype=torch.float32)
    return torch.bmm(_round(a3, dtype).float(), _round(b3, dtype).float())


def _bmm(a, b, out, accumulate: bool = False, alpha: float = 1.0):
    """gla._chunked._bmm with 16-bit operands when operand_dtype is set."""
    if _operand["dtype"] is None or out.dtype != torch.float32:
        return _shipped["_bmm"](a, b, out, accumulate, alpha)
    a3 = a.reshape(-1, a.shape[-2], a.shape[-1])
    b3 = b.reshape(-1, b.shape[-2], b.shape[-1])
    o3 = out.view(-1, out.shape[-2], out.shape[-1])
    r = _mm(a3, b3)
    if accumulate:
        o3.add_(r, alpha=alpha)
    elif alpha != 1.0:
        torch.mul(r, alpha, out=o3)
    else:
        o3.copy_(r)
    return out


def intra_gradients(q, k, gl, dA, dq, dk, dg, ws=None, scale: Optional[float] = None):
    """gla._chunked.intra_gradients with its two quadrant products through _bmm (16-bit operands)."""
    C = q.shape[-2]
    ws = ws or _scratch.fresh(q)
    A = ws.zeros("attention", q.shape[:-1] + (C,)) if scale is not None else None
    for level in levels(q, k, gl, True, ws):
        w, h = level.w, level.w // 2
        kop, qop, ek, eq = level.kop, level.qop, level.ek, level.eq
        if A is not None:
            _chunked._add_quadrants(A, level, ws)
        dAq = _quadrants(dA, w)
        half = kop.shape
        mk, mq = ws.take("intra_mk", half), ws.take("intra_mq", half)
        if w == 2:
            torch.mul(dAq, qop, out=mk)
            torch.mul(dAq, kop, out=mq)
        else:
            dA3 = dAq.reshape(-1, h, h)
            _bmm(dA3.transpose(-1, -2), qop.reshape(-1, h, qop.shape[-1]), mk.view(-1, h, half[-1]))
            _bmm(dA3, kop.reshape(-1, h, kop.shape[-1]), mq.view(-1, h, half[-1]))
        split = lambda x: x.unflatten(-2, (C // w, 2, w // 2))  # noqa: E731
        dg_k, dg_q = split(dg)[..., 0, :, :], split(dg)[..., 1, :, :]
        yq = torch.mul(qop, mq, out=ws.take("intra_yq", half))
        if w == 2:
            dg_q.add_(yq)
        else:
            yk = torch.mul(kop, mk, out=ws.take("intra_yk", half))
            if w == 4:
                dg_k[..., 1, :].add_(yk[..., 0, :])
                dg_q[..., 0, :].add_(yq[..., 0, :]).add_(yq[..., 1, :])
                dg_q[..., 1, :].add_(yq[..., 1, :])
            else:
                dg_k.add_(span_sums("before", yk, h, ws.take("intra_sums", half)))
                dg_q.add_(span_sums("from", yq, h, ws.take("intra_sums", half)))
        if eq is None:
            split(dq)[..., 1, :, :].add_(mq)
        else:
            split(dq)[..., 1, :, :].addcmul_(eq, mq)
        split(dk)[..., 0, :, :].addcmul_(ek, mk)
    diag = torch.diagonal(dA, dim1=-2, dim2=-1).unsqueeze(-1)
    dq.addcmul_(diag, k)
    dk.addcmul_(diag, q)
    return _finish_attention(A, q, k, scale, ws) if A is not None else None


def _updates(weight, value, ws, name, alpha: float = 1.0):
    """alpha weight^T value per packed chunk and head: [rows, H, C, K] x [rows, H, C, V] -> [rows, H, K, V]."""
    rows, H, _, K = weight.shape
    out = ws.take(name, (rows, H, K, value.shape[-1]))
    return _chunked._bmm(weight.transpose(-1, -2), value, out, alpha=alpha)


def _scan_steps(layout, c_range, p0, whole, updates, running, entering):
    """For each step c: entering[chunk rows] <- the running state, then running <- e^(b_last) running + U."""
    counts, firsts = layout.step_count, layout.step_start
    for c in c_range:
        a, n = firsts[c] - p0, counts[c]
        Sn = running[:n]
        entering[a:a + n].copy_(Sn)
        torch.addcmul(updates[a:a + n], Sn, whole[a:a + n].unsqueeze(-1), out=Sn)


def _forward(layout: Layout, q, k, v, g, scale, h0, cd, o_out, final_out):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    S = _running_state(layout, h0, H, K, V, cd, q.device)
    ws = _scratch.for_call(cd, q.device)
    row_bytes = _chunked._row_bytes(layout, H, K, V, cd, False) + 2 * H * K * V * torch.finfo(cd).bits // 8
    for c0, c1 in layout.step_blocks(row_bytes, _chunked._block_budget(q.device)):
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        dec = decays(gl, ws)
        A = _chunked.attention(qb, kb, gl, scale, ws=ws)
        ob = _chunked._bmm(A, vb, ws.take("o", vb.shape))
        qb.mul_(dec.from_start)
        kb.mul_(dec.to_end)
        U = _updates(kb, vb, ws, "updates")
        entering = ws.take("entering", U.shape)
        _scan_steps(layout, range(c0, c1), p0, dec.whole, U, S, entering)
        _chunked._bmm(qb, entering, ob, accumulate=True, alpha=scale)
        layout.store(ob, p0, p1, o_out)
    ws.keep_at_most(_chunked.SCRATCH_KEPT_BYTES)
    if final_out is not None:
        final_out.copy_(_sequence_order(layout, S))


def _backward(layout: Layout, q, k, v, g, scale, h0, do, dht, cd, outs):
    dq_out, dk_out, dv_out, dg_out, dh0_out = outs
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    row_bytes = _chunked._row_bytes(layout, H, K, V, cd, True) + H * K * V * torch.finfo(cd).bits // 8
    blocks = layout.step_blocks(row_bytes, _chunked._block_budget(q.device))
    ws = _scratch.for_call(cd, q.device)
    S = _running_state(layout, h0, H, K, V, cd, q.device)
    h = q.new_empty(layout.total, H, K, V, dtype=cd)
    for c0, c1 in blocks:  # B0
        p0, p1 = layout.rows_of(c0, c1)
        kb, vb = layout.load(k, p0, p1, cd, ws, "k"), layout.load(v, p0, p1, cd, ws, "v")
        dec = decays(layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd)), ws, from_start=False)
        kb.mul_(dec.to_end)
        U = _updates(kb, vb, ws, "updates")
        _scan_steps(layout, range(c0, c1), p0, dec.whole, U, S, h[p0:p1])
    del S
    dS = _running_state(layout, dht, H, K, V, cd, q.device)
    for c0, c1 in reversed(blocks):  # B1 and, per block, B2-B5
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        dob = layout.load(do, p0, p1, cd, ws, "do") if do is not None else ws.zeros("do", vb.shape)
        dec = decays(gl, ws)
        qw = torch.mul(qb, dec.from_start, out=ws.take("qw", qb.shape))
        dU = _updates(qw, dob, ws, "updates", alpha=scale)
        dh = ws.take("dh", (p1 - p0, H, K, V))
        _scan_steps(layout, reversed(range(c0, c1)), p0, dec.whole, dU, dS, dh)
        dA = _chunked._bmm(dob, vb.transpose(-1, -2), ws.take("dA", qb.shape[:-1] + (qb.shape[-2],)), alpha=scale)
        dqb, dkb, dgb = ws.zeros("dq", qb.shape), ws.zeros("dk", kb.shape), ws.zeros("dg", qb.shape)
        A = _chunked.intra_gradients(qb, kb, gl, dA, dqb, dkb, dgb, ws, scale)
        dvb = _chunked._bmm(A.transpose(-1, -2), dob, ws.take("dv", vb.shape))
        kw = torch.mul(kb, dec.to_end, out=qw)
        _chunked._bmm(kw, dh, dvb, accumulate=True)
        add_inter_gradients(qb, kb, vb, dob, h[p0:p1], dh, dec, scale, dqb, dkb, dgb, ws)
        for packed, out in ((dqb, dq_out), (dkb, dk_out), (dvb, dv_out)):
            if out is not None:
                layout.store(packed, p0, p1, out)
        if dg_out is not None:
            layout.store(dgb.sum(-1, keepdim=True) if dg_out.dim() == 3 else dgb, p0, p1,
                         dg_out.unsqueeze(-1) if dg_out.dim() == 3 else dg_out)
    ws.keep_at_most(_chunked.SCRATCH_KEPT_BYTES)
    if dh0_out is not None:
        dh0_out.copy_(_sequence_order(layout, dS))


_shipped = {name: getattr(_chunked, name) for name in ("_forward", "_backward", "_bmm", "intra_gradients")}


@contextlib.contextmanager
def installed(batched_scan: bool = True, operand_dtype: Optional[torch.dtype] = None):
    """Inside: gla._chunked runs this body (batched_scan) and/or 16-bit matmul operands (operand_dtype)."""
    patch = {}
    if batched_scan:
        patch.update(_forward=_forward, _backward=_backward)
    if operand_dtype is not None:
        patch.update(_bmm=_bmm, intra_gradients=intra_gradients)
    _operand["dtype"] = operand_dtype
    for name, fn in patch.items():
        setattr(_chunked, name, fn)
    try:
        yield
    finally:
        for name in patch:
            setattr(_chunked, name, _shipped[name])
        _operand["dtype"] = None
