"""The `torch` backend's stage units: each stage of the stage pipeline (SPEC.md §2) on its own, so
that a backend implementing some stages natively mixes with PyTorch ops for the rest.

Each function reads and writes the gla_problem's tensors (turned into torch tensors by `w`) in the
layouts of include/gla/gla.h: gcum [B, T, H, Kg], A and dA [B, T, H, C] (token-major), h and dh
[NC, H, K, V] (sequence-major, chunk_offsets), dq_intra / dk_intra [B, T, H, K]. Inside, they pack
into `_chunked`'s chunk layout and run the same code as the whole operation.

Decays come from g itself (direct sums of the gates, -inf clamped; see _chunked), never from
differences of gcum: the difference of two fp32 cumulative gates carries the rounding of their
magnitude, and -inf - (-inf) is NaN. gcum is written for the stages of other backends. For the same
reason bwd_dqkg forms the intra-chunk part of dg from dA pair by pair rather than from q*dq_intra -
k*dk_intra (the cancelling form).
"""
from __future__ import annotations

import torch

from . import _chunked

# gla_unit codes of include/gla/gla.h
UNIT_CUMSUM, UNIT_FWD_H, UNIT_FWD_INTRA, UNIT_FWD_O = 2, 3, 4, 5
UNIT_BWD_DH, UNIT_BWD_DV, UNIT_BWD_DA, UNIT_BWD_DQK_INTRA, UNIT_BWD_DQKG = 6, 7, 8, 9, 10


class _Stage:
    """A problem's tensors and its chunk layout, packed on demand."""

    def __init__(self, p, w):
        self.p, self.w = p, w
        self.q, self.k, self.v = w(p.q), w(p.k), w(p.v)
        g = w(p.g)
        self.per_head = bool(p.gate_per_head)
        self.g = g.unsqueeze(-1) if self.per_head else g  # [B, T, H, Kg]
        self.cd = torch.float32
        B, T = self.q.shape[0], self.q.shape[1]
        offsets = [int(p.seq_offsets[i]) for i in range(p.N + 1)] if p.varlen else None
        self.layout = _chunked.layout_for(B, T, offsets, int(p.chunk_size), self.q.device)
        self.chunk_offsets = [int(p.chunk_offsets[i]) for i in range(p.N + 1)]
        self.scale = p.scale

    def pack(self, t):
        return self.layout.pack(t, self.cd)

    def gate(self):
        """Packed clamped gate (natural log), per key."""
        K = self.q.shape[-1]
        return _chunked.clamped_gate(self.pack(self.g.expand(*self.g.shape[:3], K)))

    def states_in(self, t):
        """A stage state tensor [NC, H, K, V] in packed chunk order."""
        return t.index_select(0, self.layout.stage_index(self.chunk_offsets))

    def states_out(self, packed, t):
        t.index_copy_(0, self.layout.stage_index(self.chunk_offsets), packed)

    def state(self, t):
        """initial_state / dht as [N, H, K, V] fp32, or None."""
        x = self.w(t)
        if x is None:
            return None
        return x.transpose(-1, -2) if self.p.state_v_first else x

    def do(self):
        d = self.w(self.p.do_)
        return self.pack(d) if d is not None else None


def cumsum(s: _Stage) -> None:
    gl = s.pack(s.g).mul_(_chunked.RCP_LN2)
    s.layout.unpack_into(gl.cumsum(-2), s.w(s.p.gcum))


def fwd_h(s: _Stage) -> None:
    kc, vc = s.pack(s.k), s.pack(s.v)
    dec = _chunked.decays(s.gate())
    h = kc.new_empty(kc.shape[0], kc.shape[1], kc.shape[-1], vc.shape[-1])
    final = _chunked.state_scan(s.layout, kc.mul_(dec.to_end), vc, dec.whole, s.state(s.p.initial_state), False, h)
    s.states_out(h, s.w(s.p.h))
    out = s.state(s.p.final_state)
    if out is not None:
        out.copy_(final)


def fwd_intra(s: _Stage) -> None:
    A = _chunked.attention(s.pack(s.q), s.pack(s.k), s.gate(), s.scale)
    s.layout.unpack_into(A, s.w(s.p.A))


def fwd_o(s: _Stage) -> None:
    qc = s.pack(s.q)
    dec = _chunked.decays(s.gate())
    o = qc.mul_(dec.from_start).mul_(s.scale) @ s.states_in(s.w(s.p.h))
    o.add_(s.pack(s.w(s.p.A)) @ s.pack(s.v))
    s.layout.unpack_into(o, s.w(s.p.o))


def bwd_dh(s: _Stage) -> None:
    qc = s.pack(s.q)
    dec = _chunked.decays(s.gate())
    doc = s.do()
    if doc is None:
        doc = qc.new_zeros(qc.shape[:-1] + (s.v.shape[-1],))
    dh = qc.new_empty(qc.shape[0], qc.shape[1], qc.shape[-1], doc.shape[-1])
    dh0 = _chunked.state_scan(s.layout, qc.mul_(dec.from_start).mul_(s.scale), doc, dec.whole, s.state(s.p.dht),
                              True, dh)
    s.states_out(dh, s.w(s.p.dh))
    out = s.state(s.p.dh0)
    if out is not None:
        out.copy_(dh0)


def bwd_dA(s: _Stage) -> None:
    vc = s.pack(s.v)
    doc = s.do()
    C = s.layout.C
    if doc is None:
        dA = vc.new_zeros(vc.shape[:-1] + (C,))
    else:
        dA = torch.tril(doc @ vc.transpose(-1, -2)).mul_(s.scale)  # tril: a select, zeros above
    s.layout.unpack_into(dA, s.w(s.p.dA))


def bwd_dv(s: _Stage) -> None:
    out = s.w(s.p.dv)
    if out is None:
        return
    kc = s.pack(s.k)
    dec = _chunked.decays(s.gate())
    dv = kc.mul_(dec.to_end) @ s.states_in(s.w(s.p.dh))
    doc = s.do()
    if doc is not None:
        dv.add_(s.pack(s.w(s.p.A)).transpose(-1, -2) @ doc)
    s.layout.unpack_into(dv, out)


def _intra(s: _Stage, qc, kc, gl):
    dA = s.pack(s.w(s.p.dA))
    dq, dk, dg = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(qc)
    _chunked.intra_gradients(qc, kc, gl, dA, dq, dk, dg)
    return dq, dk, dg


def bwd_dqk_intra(s: _Stage) -> None:
    dq, dk, _ = _intra(s, s.pack(s.q), s.pack(s.k), s.gate())
    s.layout.unpack_into(dq, s.w(s.p.dq_intra))
    s.layout.unpack_into(dk, s.w(s.p.dk_intra))


def bwd_dqkg(s: _Stage) -> None:
    qc, kc, vc = s.pack(s.q), s.pack(s.k), s.pack(s.v)
    gl = s.gate()
    _, _, dg = _intra(s, qc, kc, gl)  # the intra-chunk dg, pair by pair
    dec = _chunked.decays(gl)
    del gl
    h, dh = s.states_in(s.w(s.p.h)), s.states_in(s.w(s.p.dh))
    doc = s.do()
    dq = s.pack(s.w(s.p.dq_intra))
    dk = s.pack(s.w(s.p.dk_intra))
    _chunked.add_inter_gradients(qc, kc, vc, doc, h, dh, dec, s.scale, dq, dk, dg)
    for packed, t in ((dq, s.p.dq), (dk, s.p.dk)):
        out = s.w(t)
        if out is not None:
            s.layout.unpack_into(packed, out)
    out = s.w(s.p.dg)
    if out is not None:
        _chunked.unpack_gate_gradient(s.layout, dg, out)


RUN = {UNIT_CUMSUM: cumsum, UNIT_FWD_H: fwd_h, UNIT_FWD_INTRA: fwd_intra, UNIT_FWD_O: fwd_o, UNIT_BWD_DH: bwd_dh,
       UNIT_BWD_DA: bwd_dA, UNIT_BWD_DV: bwd_dv, UNIT_BWD_DQK_INTRA: bwd_dqk_intra, UNIT_BWD_DQKG: bwd_dqkg}


def run(p, w) -> None:
    """Runs the stage p.unit of problem p."""
    RUN[p.unit](_Stage(p, w))
