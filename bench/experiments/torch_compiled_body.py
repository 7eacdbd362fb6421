"""Experiment (not shipped): the `torch` backend's chunk-local math written functionally and run
through torch.compile, to A/B against the shipped body with `bench/torch_backend_bench.py
--experiment` (issue 16: "a torch.compile'd variant where the device supports it").

The shipped body (gla/_chunked.py) writes into named scratch buffers through `out=` views, which
torch.compile cannot trace (a graph break at every `out=` into a non-contiguous view); here the same
algorithm (SPEC.md §2-3: pivoted quadrants at every level, exponents <= 0, span sums as products
with constant 0/1 matrices, select masks) returns new tensors and assembles A block by block, so
one compiled graph covers a block's forward work and one its backward work after the reverse scan.
The scans stay eager and batched (bench/experiments/torch_gpu_body.py's formulation).

Compiled per block shape (dynamic=False): a call's blocks have one or two shapes.
"""
from __future__ import annotations

import contextlib

import torch

from gla import _chunked, _scratch
from gla._chunked import Layout, _levels, _running_state, _sequence_order, gate_floor
from torch_gpu_body import _scan_steps


def _mask(kind: str, w: int, like: torch.Tensor) -> torch.Tensor:
    """gla._chunked._constant's 0/1 span matrices, built from arange (traceable)."""
    r = torch.arange(w, device=like.device)
    i, j = r[:, None], r[None, :]
    h = w // 2
    if kind == "pivot":
        m = torch.where(i < h, (j > i) & (j <= h), (j > h) & (j <= i))
    elif kind == "decay":
        m = torch.cat([j <= i, j > i])
    elif kind == "from":
        m = j >= i
    elif kind == "before":
        m = j < i
    else:
        raise ValueError(kind)
    return m.to(like.dtype)


def _span(kind: str, x: torch.Tensor, w: int) -> torch.Tensor:
    """M @ x over blocks of w rows (gla._chunked.span_sums): x [..., R, K] -> [..., R * rows(M) / w, K]."""
    m = _mask(kind, w, x)
    R, K = x.shape[-2], x.shape[-1]
    out = torch.matmul(m, x.reshape(-1, w, K))
    return out.reshape(*x.shape[:-2], R // w * m.shape[0], K)


def _dot(a, b):
    """a @ b on data operands: 16-bit operands with fp32 accumulation and output when
    installed(operand_dtype=...) (tensor cores through bmm's out_dtype on CUDA, the same rounding
    emulated elsewhere), else fp32."""
    dtype = _mode["operand_dtype"]
    if dtype is None:
        return a @ b
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a3 = a.expand(*lead, *a.shape[-2:]).reshape(-1, *a.shape[-2:]).to(dtype)
    b3 = b.expand(*lead, *b.shape[-2:]).reshape(-1, *b.shape[-2:]).to(dtype)
    out = torch.bmm(a3, b3, out_dtype=torch.float32) if a.device.type == "cuda" else torch.bmm(a3.float(), b3.float())
    return out.reshape(*lead, a.shape[-2], b.shape[-1])


def _level(q, k, gl, w):
    """(ek, eq, kop, qop) of level w: [..., C/w, w/2, K] each (eq None at w = 2)."""
    C = q.shape[-2]
    nb, h = C // w, w // 2
    k_rows = k.unflatten(-2, (nb, w))[..., :h, :]
    q_rows = q.unflatten(-2, (nb, w))[..., h:, :]
    if w == 2:
        ek = torch.exp(gl.unflatten(-2, (nb, w))[..., 1:, :])
        return ek, None, k_rows * ek, q_rows
    e = torch.exp(_span("pivot", gl, w)).unflatten(-2, (nb, w))
    ek, eq = e[..., :h, :], e[..., h:, :]
    return ek, eq, k_rows * ek, q_rows * eq


def _quadrant_products(qop, kop):
    if qop.shape[-2] == 1:
        return (qop * kop).sum(-1, keepdim=True)
    return _dot(qop, kop.transpose(-1, -2))


def _assemble(diag, products):
    """A [..., C, C] from its diagonal [..., C] and each level's lower-left quadrants (products[w]:
    [..., C/w, w/2, w/2]); zeros above the diagonal (built, never masked)."""
    C = diag.shape[-1]
    lead = diag.shape[:-1]
    blocks = diag[..., :, None, None]  # diagonal blocks of width 1
    for w in reversed(_levels(C)):  # 2, 4, ..., C
        h = w // 2
        prev = blocks.reshape(*lead, C // w, 2, h, h)
        top = torch.cat([prev[..., 0, :, :], torch.zeros_like(prev[..., 0, :, :])], -1)
        bottom = torch.cat([products[w], prev[..., 1, :, :]], -1)
        blocks = torch.cat([top, bottom], -2)
    return blocks.reshape(*lead, C, C)


def _quadrants_of(M, w):
    """Lower-left quadrants of M's diagonal w-blocks, [..., C/w, w/2, w/2] (a view)."""
    C = M.shape[-1]
    nb, h = C // w, w // 2
    d = torch.diagonal(M.reshape(*M.shape[:-2], nb, w, nb, w), dim1=-4, dim2=-2)  # [..., w, w, nb]
    return d[..., h:, :h, :].movedim(-1, -3)


def _halves(first, second):
    """[..., nb, h, K] of the first and the second half rows of every w-block -> [..., C, K]."""
    return torch.cat([first, second], -2).flatten(-3, -2)


def forward_block(q, k, v, gl, scale: float):
    """A block's chunk-local forward: (A v, q e^b, k e^(b_last - b), e^(b_last))."""
    C = q.shape[-2]
    dec = torch.exp(_span("decay", gl, C))
    from_start, to_end, whole = dec[..., :C, :], dec[..., C:, :], dec[..., C - 1, :]
    products = {}
    for w in _levels(C):
        _, _, kop, qop = _level(q, k, gl, w)
        products[w] = _quadrant_products(qop, kop)
    A = _assemble((q * k).sum(-1), products) * scale
    return _dot(A, v), q * from_start, k * to_end, whole


def prescan_block(q, gl):
    """The backward's operands of the reverse scan: (q e^b, e^(b_last))."""
    C = q.shape[-2]
    dec = torch.exp(_span("decay", gl, C))
    return q * dec[..., :C, :], dec[..., C - 1, :]


def backward_block(q, k, v, gl, do, h, dh, scale: float):
    """A block's dq, dk, dv, dg given the entering states h and the gradient states dh of its chunks."""
    C = q.shape[-2]
    dec = torch.exp(_span("decay", gl, C))
    from_start, to_end, whole = dec[..., :C, :], dec[..., C:, :], dec[..., C - 1, :]
    dA = _dot(do, v.transpose(-1, -2)) * scale
    diag = torch.diagonal(dA, dim1=-2, dim2=-1).unsqueeze(-1)
    dq, dk = diag * k, diag * q
    dg = torch.zeros_like(q)
    products = {}
    for w in _levels(C):
        h_ = w // 2
        ek, eq, kop, qop = _level(q, k, gl, w)
        products[w] = _quadrant_products(qop, kop)
        dAq = _quadrants_of(dA, w)
        if w == 2:
            mk, mq = dAq * qop, dAq * kop
        else:
            mk, mq = _dot(dAq.transpose(-1, -2), qop), _dot(dAq, kop)
        yq, yk = qop * mq, kop * mk
        zeros = torch.zeros_like(mk)
        dg_first = zeros if w == 2 else _span("before", yk, h_)
        dg_second = yq if w == 2 else _span("from", yq, h_)
        dg = dg + _halves(dg_first, dg_second)
        dq = dq + _halves(zeros, mq if eq is None else eq * mq)
        dk = dk + _halves(ek * mk, zeros)
    A = _assemble((q * k).sum(-1), products) * scale
    dv = _dot(A.transpose(-1, -2), do) + _dot(k * to_end, dh)
    inter_q = _dot(do, h.transpose(-1, -2)) * (scale * from_start)
    inter_k = _dot(v, dh.transpose(-1, -2)) * to_end
    dq = dq + inter_q
    dk = dk + inter_k
    dg = dg + _span("from", inter_q * q, C) + _span("before", inter_k * k, C)
    dg = dg + ((h * dh).sum(-1) * whole).unsqueeze(-2)
    return dq, dk, dv, dg


_compiled = {}


def _fn(name):
    if name not in _compiled:
        fn = {"forward": forward_block, "prescan": prescan_block, "backward": backward_block, "to_end": _to_end}[name]
        _compiled[name] = torch.compile(fn, fullgraph=True, dynamic=False) if _mode["compile"] else fn
    return _compiled[name]


def _updates(weight, value, alpha: float = 1.0):
    u = _dot(weight.transpose(-1, -2), value)
    return u * alpha if alpha != 1.0 else u


def _forward(layout: Layout, q, k, v, g, scale, h0, cd, o_out, final_out):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    S = _running_state(layout, h0, H, K, V, cd, q.device)
    ws = _scratch.for_call(cd, q.device)
    row_bytes = _chunked._row_bytes(layout, H, K, V, cd, False) + 2 * H * K * V * torch.finfo(cd).bits // 8
    for c0, c1 in layout.step_blocks(row_bytes, _chunked._block_budget(q.device)):
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        ob, qw, kw, whole = _fn("forward")(qb, kb, vb, gl, float(scale))
        U = _updates(kw, vb)
        entering = torch.empty_like(U)
        _scan_steps(layout, range(c0, c1), p0, whole, U, S, entering)
        ob = ob + _dot(qw, entering) * scale
        layout.store(ob, p0, p1, o_out)
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
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        kw, whole = _fn("to_end")(kb, gl)
        _scan_steps(layout, range(c0, c1), p0, whole, _updates(kw, vb), S, h[p0:p1])
    del S
    dS = _running_state(layout, dht, H, K, V, cd, q.device)
    for c0, c1 in reversed(blocks):
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        dob = layout.load(do, p0, p1, cd, ws, "do") if do is not None else ws.zeros("do", vb.shape)
        qw, whole = _fn("prescan")(qb, gl)
        dh = torch.empty(p1 - p0, H, K, V, dtype=cd, device=q.device)
        _scan_steps(layout, reversed(range(c0, c1)), p0, whole, _updates(qw, dob, scale), dS, dh)
        dqb, dkb, dvb, dgb = _fn("backward")(qb, kb, vb, gl, dob, h[p0:p1], dh, float(scale))
        for packed, out in ((dqb, dq_out), (dkb, dk_out), (dvb, dv_out)):
            if out is not None:
                layout.store(packed, p0, p1, out)
        if dg_out is not None:
            layout.store(dgb.sum(-1, keepdim=True) if dg_out.dim() == 3 else dgb, p0, p1,
                         dg_out.unsqueeze(-1) if dg_out.dim() == 3 else dg_out)
    if dh0_out is not None:
        dh0_out.copy_(_sequence_order(layout, dS))


def _to_end(k, gl):
    """(k e^(b_last - b), e^(b_last)) for B0's scan."""
    C = k.shape[-2]
    dec = torch.exp(_span("decay", gl, C))
    return k * dec[..., C:, :], dec[..., C - 1, :]


_shipped = {name: getattr(_chunked, name) for name in ("_forward", "_backward")}
_mode = {"compile": True, "operand_dtype": None}


@contextlib.contextmanager
def installed(compile: bool = True, operand_dtype=None):
    """Inside: gla._chunked runs this body (compiled, or eager with compile=False: the functional
    math alone), with 16-bit matmul operands when operand_dtype is given (for 16-bit inputs)."""
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError("the experiment's span sums need fp32 matmuls (float32 matmul precision 'highest')")
    if compile != _mode["compile"]:
        _compiled.clear()
    _mode["compile"], _mode["operand_dtype"] = compile, operand_dtype
    _chunked._forward, _chunked._backward = _forward, _backward
    try:
        yield
    finally:
        _chunked._forward, _chunked._backward = _shipped["_forward"], _shipped["_backward"]
        _mode["operand_dtype"] = None
