"""The chunked GLA algorithm (SPEC.md §2) written only with PyTorch tensor ops.

This is the body of the portable `torch` backend: matmul, cumsum, exp and selects, nothing
device-specific, so it runs wherever PyTorch runs (CPU, CUDA, Ascend NPU, Apple MPS, Intel XPU).

Layout. Every sequence (a batch row, or a cu_seqlens segment) is cut into chunks of C tokens, the
last one zero-padded (a zero gate keeps the cumulative gate flat past the end, so a padded row holds
b_last). Chunks are packed chunk-major, sequences sorted by chunk count: step c of the state scan
owns one contiguous block holding chunk c of every sequence that has one, so the only Python loop
over chunks is the sequential scan, one batched matmul per chunk over [sequences * H, K, V].
Packed tensors are [chunks, H, C, D]; the math below works on any leading dims.

Numerics (SPEC.md §3):
- everything accumulates in fp32 (fp64 when the inputs are fp64, for gradcheck);
- intra-chunk products are factorised around pivots with every exponent <= 0: the chunk is halved
  recursively (widths C, C/2, ..., 2); in each block the lower-left quadrant (query rows in the
  second half, key rows in the first) is one matmul of q_t e^(b_t - b_p) and k_s e^(b_p - b_s) with
  the pivot p the query half's first row (a sub-chunk boundary for widths >= 32, and inside the
  16-row diagonal blocks below that). Every pair s < t lies in exactly one quadrant, the diagonal
  t = s needs no decay. No [.., 16, 16, K] expansion exists: the largest intermediate is [.., C, C];
- every exponent is a direct sum of the gates it spans (never a difference of two cumulative sums:
  with g = -7 per step b reaches -650 within a chunk, where fp32's spacing 6e-5 would put ~4e-5
  relative error on every decay);
- the gate gradient is summed per quadrant (a pair s < t contributes to dg_u for s < u <= t)
  instead of as the reverse cumsum of q*dq - k*dk, whose large diagonal terms cancel (3e-5 error
  at n = 0.1, above SPEC's 1e-5);
- g = -inf is a hard reset: gates are clamped to a floor below which e^g underflows to 0 anyway
  (-104 in fp32, -746 in fp64), so no -inf - (-inf) arises;
- masks are selects (upper triangles are never computed, only left at zero), never products
  with a 0/1 mask.

Memory: the work is split into groups of heads so that one group's fp32 working set stays under
WORKSET_BYTES; each group's results are written into the caller's outputs before the next starts.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F

RCP_LN2 = 1.0 / math.log(2.0)  # gcum (a stage buffer) is in log2 units
CHUNK = 64  # fla's chunk size, and the stage pipeline's
# One head group's fp32 working set (inputs in chunk layout, states, gradients, temporaries).
# 2 GiB: the B8 T4096 H16 D128 backward (~288 MiB a head by this estimate) runs as 3 groups.
WORKSET_BYTES = 2 << 30


def gate_floor(dtype: torch.dtype) -> float:
    """The clamp for g (natural log): e^g underflows to 0 below it in this dtype."""
    return -746.0 if dtype == torch.float64 else -104.0


def chunk_size_for(T: int) -> int:
    """64 for sequences of 64 tokens or more (fla's choice), else T rounded up to a power of two
    (the recursive halving needs one)."""
    return CHUNK if T >= CHUNK else 1 << max(0, (T - 1).bit_length())


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------
# Packing
# ------------------------------------------------------------------------------------------------
class Layout:
    """Where every chunk of every sequence lives in the packed [chunks, H, C, D] tensors.

    Sequences: batch rows (seq_offsets None; every row has T tokens) or the segments of row 0
    given by seq_offsets. Chunk c of the sequence of sort rank i sits at step_start[c] + i."""

    def __init__(self, B: int, T: int, seq_offsets: Optional[Sequence[int]], C: int, device):
        self.B, self.T, self.C, self.device = B, T, C, device
        self.varlen = seq_offsets is not None
        if self.varlen:
            self.starts = [int(seq_offsets[n]) for n in range(len(seq_offsets) - 1)]
            self.lengths = [int(seq_offsets[n + 1]) - s for n, s in enumerate(self.starts)]
        else:
            self.starts = [n * T for n in range(B)]
            self.lengths = [T] * B
        self.N = N = len(self.lengths)
        self.chunks = [-(-L // C) for L in self.lengths]
        self.order = sorted(range(N), key=lambda n: -self.chunks[n])  # stable: ties keep their order
        self.rank = [0] * N
        for i, n in enumerate(self.order):
            self.rank[n] = i
        steps = self.chunks[self.order[0]] if N else 0
        self.step_count = [sum(1 for n in range(N) if self.chunks[n] > c) for c in range(steps)]
        self.step_start = [0] * steps
        for c in range(1, steps):
            self.step_start[c] = self.step_start[c - 1] + self.step_count[c - 1]
        self.total = sum(self.chunks)
        self.uniform = not self.varlen  # packed = [steps, B, ...]: a plain permute
        self._gather = self._scatter = self._stage = None
        self._order_t = None

    def slot(self, n: int, c: int) -> int:
        return self.step_start[c] + self.rank[n]

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the layout's device without a host synchronisation (pinned and
        asynchronous for CUDA: SPEC's no-host-sync path with cu_seqlens_cpu, CUDA-graph capture)."""
        device = torch.device(self.device)
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)

    def order_index(self) -> torch.Tensor:
        if self._order_t is None:
            self._order_t = self._on_device(torch.tensor(self.order, dtype=torch.long))
        return self._order_t

    def _token_maps(self):
        if self._gather is None:
            C = self.C
            gather = torch.full((self.total, C), self.B * self.T, dtype=torch.long)  # the zero row
            scatter = torch.empty(self.B * self.T, dtype=torch.long)
            r = torch.arange(C)
            for n in range(self.N):
                for c in range(self.chunks[n]):
                    s = self.slot(n, c)
                    first = c * C
                    valid = min(C, self.lengths[n] - first)
                    tok = self.starts[n] + first + r[:valid]
                    gather[s, :valid] = tok
                    scatter[tok] = s * C + r[:valid]
            self._gather = self._on_device(gather.reshape(-1))
            self._scatter = self._on_device(scatter)
        return self._gather, self._scatter

    def stage_index(self, chunk_offsets: Sequence[int]) -> torch.Tensor:
        """For each packed chunk, its index in a stage's [NC, H, K, V] (sequence-major) layout."""
        if self._stage is None:
            idx = torch.empty(self.total, dtype=torch.long)
            for n in range(self.N):
                for c in range(self.chunks[n]):
                    idx[self.slot(n, c)] = int(chunk_offsets[n]) + c
            self._stage = self._on_device(idx)
        return self._stage

    def pack(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[B, T, H, D] -> [chunks, H, C, D] in `dtype`, zeros past each sequence's end."""
        B, T, H, D = x.shape
        C = self.C
        if self.uniform:
            NT = -(-T // C)
            if NT * C != T:
                x = F.pad(x, (0, 0, 0, 0, 0, NT * C - T))
            out = torch.empty(NT, B, H, C, D, dtype=dtype, device=x.device)
            out.copy_(x.unflatten(1, (NT, C)).permute(1, 0, 3, 2, 4))
            return out.view(NT * B, H, C, D)
        gather, _ = self._token_maps()
        flat = torch.cat([x.reshape(B * T, H, D), x.new_zeros(1, H, D)])
        rows = flat.index_select(0, gather).view(self.total, C, H, D)
        out = torch.empty(self.total, H, C, D, dtype=dtype, device=x.device)
        out.copy_(rows.transpose(1, 2))
        return out

    def unpack_into(self, y: torch.Tensor, out: torch.Tensor) -> None:
        """Writes packed y [chunks, H, C, D] into out [B, T, H, D] (valid rows only)."""
        B, T, H, D = out.shape
        C = self.C
        if self.uniform:
            NT = self.total // B
            full = y.view(NT, B, H, C, D).permute(1, 0, 3, 2, 4)  # [B, NT, C, H, D]
            whole = T // C
            if whole:
                out[:, :whole * C].unflatten(1, (whole, C)).copy_(full[:, :whole])
            if whole * C < T:
                out[:, whole * C:].copy_(full[:, whole, :T - whole * C])
            return
        _, scatter = self._token_maps()
        rows = y.transpose(1, 2).reshape(self.total * C, H, D)
        out.copy_(rows.index_select(0, scatter).view(B, T, H, D))


@functools.lru_cache(maxsize=64)
def _cached_layout(B: int, T: int, offsets: Optional[tuple], C: int, device: str) -> Layout:
    return Layout(B, T, offsets, C, device)


def layout_for(B: int, T: int, seq_offsets: Optional[Sequence[int]], C: int, device) -> Layout:
    """The Layout of these sizes, cached: its index tensors are built (and copied to the device)
    once per shape, so repeated calls and CUDA-graph replays copy nothing from the host."""
    offsets = tuple(int(o) for o in seq_offsets) if seq_offsets is not None else None
    return _cached_layout(B, T, offsets, C, str(device))


# ------------------------------------------------------------------------------------------------
# Chunk-local math on packed tensors [..., C, D]
# ------------------------------------------------------------------------------------------------
def _rev_cumsum(x: torch.Tensor, dim: int = -2) -> torch.Tensor:
    """Inclusive reverse cumulative sum along dim: sum over rows >= r."""
    return x.flip(dim).cumsum(dim).flip(dim)


def clamped_gate(g: torch.Tensor) -> torch.Tensor:
    """The packed gate clamped to gate_floor (in place). Decays are formed in natural-log units
    with exp: one pass fewer than converting to log2 for exp2, the same rounding."""
    return g.clamp_(min=gate_floor(g.dtype))


@dataclass
class Decays:
    """Per-chunk decay factors from the clamped gate gl [..., C, K] (b: its chunk-local cumsum)."""
    from_start: torch.Tensor  # e^(b_t): decay from the chunk start to t (inclusive)
    to_end: torch.Tensor      # e^(b_last - b_s): decay from s (exclusive) to the chunk's last row
    whole: torch.Tensor       # e^(b_last) [..., K]


def decays(gl: torch.Tensor) -> Decays:
    b = gl.cumsum(-2)
    whole = torch.exp(b[..., -1, :])
    from_start = torch.exp(b)
    del b
    after = _rev_cumsum(gl)  # sum over [s, last]; the sum over (s, last] is its next row
    to_end = torch.empty_like(gl)
    to_end[..., -1, :] = 1
    torch.exp(after[..., 1:, :], out=to_end[..., :-1, :])
    return Decays(from_start, to_end, whole)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[chunks, H, R, D] -> [chunks * H, R, D] (a view), for baddbmm."""
    return x.flatten(0, -3)


def _levels(C: int) -> List[int]:
    out, w = [], C
    while w >= 2:
        out.append(w)
        w //= 2
    return out


def _level_operands(q, k, gl, w):
    """Pivoted operands of the quadrants at block width w, each [..., C/w, w/2, K]:
    eq = e^(b_t - b_p) for query rows t (second half), ek = e^(b_p - b_s) for key rows s (first
    half), with the pivot p the second half's first row; Qop = q * eq, Kop = k * ek."""
    C = gl.shape[-2]
    half = w // 2
    gb = gl.unflatten(-2, (C // w, w))  # [..., nb, w, K]
    if half == 1:
        eq = None
        Qop = q.unflatten(-2, (C // w, w))[..., 1:, :]
    else:
        qexp = gl.new_zeros(gb.shape[:-2] + (half, gb.shape[-1]))
        torch.cumsum(gb[..., half + 1:, :], -2, out=qexp[..., 1:, :])  # sum over (p, t]
        eq = torch.exp(qexp)
        del qexp
        Qop = q.unflatten(-2, (C // w, w))[..., half:, :] * eq
    # sum over (s, p]
    ek = torch.exp(gb[..., 1:2, :] if half == 1 else _rev_cumsum(gb[..., 1:half + 1, :]))
    Kop = k.unflatten(-2, (C // w, w))[..., :half, :] * ek
    return eq, ek, Qop, Kop


def _quadrants(M: torch.Tensor, w: int) -> torch.Tensor:
    """Writable view [..., C/w, w/2, w/2] of the lower-left quadrants of M's diagonal w-blocks."""
    C = M.shape[-1]
    nb, half = C // w, w // 2
    blocks = torch.diagonal(M.unflatten(-1, (nb, w)).unflatten(-3, (nb, w)), dim1=-4, dim2=-2)  # [.., w, w, nb]
    return blocks[..., half:, :half, :].movedim(-1, -3)


def _pair_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T over the last dim: [.., n, K] x [.., m, K] -> [.., n, m]."""
    if a.shape[-2] == 1:
        return (a * b).sum(-1, keepdim=True)
    return a @ b.transpose(-1, -2)


def attention(q, k, gl, scale):
    """F3: A [..., C, C], A[t, s] = scale * sum_i q_ti k_si e^(b_ti - b_si) for s <= t, 0 above."""
    C = q.shape[-2]
    A = q.new_zeros(q.shape[:-1] + (C,))
    for w in _levels(C):
        _, _, Qop, Kop = _level_operands(q, k, gl, w)
        _quadrants(A, w).copy_(_pair_products(Qop, Kop))
        del Qop, Kop
    torch.diagonal(A, dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    return A.mul_(scale)


def intra_gradients(q, k, gl, dA, dq, dk, dg):
    """B4 and the intra-chunk part of dg: adds into dq, dk, dg [..., C, K] the gradients through
    A given dA [..., C, C] (scale included). dg_u gains every pair s < u <= t."""
    C = q.shape[-2]
    for w in _levels(C):
        half = w // 2
        eq, ek, Qop, Kop = _level_operands(q, k, gl, w)
        dAq = _quadrants(dA, w)
        if half == 1:
            Mq = dAq * Kop  # [.., nb, 1, K]
            Mk = dAq * Qop
        else:
            Mq = dAq @ Kop
            Mk = dAq.transpose(-1, -2) @ Qop
        split = lambda x: x.unflatten(-2, (C // w, 2, half))  # noqa: E731
        dq_h, dk_h, dg_q, dg_k = split(dq)[..., 1, :, :], split(dk)[..., 0, :, :], split(dg)[..., 1, :, :], split(dg)[..., 0, :, :]
        # query rows: dg_u += sum over t >= u of q_t dq_t (this quadrant's part)
        yq = Qop * Mq  # (Qop is a view of q at width 2)
        dg_q.add_(_rev_cumsum(yq))
        del yq, Qop
        # key rows: dg_u += sum over s < u of k_s dk_s (this quadrant's part)
        yk = Kop.mul_(Mk)
        cum = yk.cumsum(-2)
        dg_k[..., 1:, :].add_(cum[..., :-1, :])
        del yk, Kop, cum
        dq_h.add_(Mq if eq is None else Mq.mul_(eq))
        dk_h.add_(Mk.mul_(ek))
        del Mq, Mk, eq, ek
    diag = torch.diagonal(dA, dim1=-2, dim2=-1).unsqueeze(-1)
    dq.addcmul_(diag, k)
    dk.addcmul_(diag, q)


# ------------------------------------------------------------------------------------------------
# The scans
# ------------------------------------------------------------------------------------------------
def state_scan(layout: Layout, weight, value, decay_whole, start, reverse: bool, out_per_chunk, alpha: float = 1.0):
    """The chunk scan of F2 (forward) and B1 (reverse) on packed tensors.

    weight [chunks, H, C, K], value [chunks, H, C, V], decay_whole [chunks, H, K]; start
    [N, H, K, V] in sequence order or None (zeros). Writes the state each chunk enters into
    out_per_chunk [chunks, H, K, V] and returns the state after the last chunk of every sequence
    [N, H, K, V] in sequence order. Step: S <- e^(b_last) S + alpha weight^T value, computed
    straight into the next chunk's slot (two ops a chunk: a multiply and a baddbmm)."""
    H, K, V = weight.shape[1], weight.shape[-1], value.shape[-1]
    N = layout.N
    if start is not None and not layout.uniform:
        start = start.index_select(0, layout.order_index())
    final = weight.new_empty(N, H, K, V)
    counts, firsts = layout.step_count, layout.step_start
    steps = len(counts)

    def fill(dst, lo, hi):  # sorted sequences lo..hi-1 start from `start` (zeros without one)
        if hi > lo:
            dst.copy_(start[lo:hi]) if start is not None else dst.zero_()

    def step(lo, hi, dst):  # dst <- the step of packed chunks lo..hi-1 applied to their entering states
        n = hi - lo
        torch.mul(out_per_chunk[lo:hi], decay_whole[lo:hi].unsqueeze(-1), out=dst)
        dst.view(n * H, K, V).baddbmm_(weight[lo:hi].reshape(n * H, -1, K).transpose(-1, -2),
                                       value[lo:hi].reshape(n * H, -1, V), alpha=alpha)

    if not reverse:
        fill(out_per_chunk[:counts[0]], 0, counts[0]) if steps else None
        for c in range(steps):
            a, n, nn = firsts[c], counts[c], counts[c + 1] if c + 1 < steps else 0
            if nn:
                step(a, a + nn, out_per_chunk[firsts[c + 1]:firsts[c + 1] + nn])
            if n > nn:  # sequences whose last chunk is c
                step(a + nn, a + n, final[nn:n])
    else:
        for c in reversed(range(steps)):
            a, n, nn = firsts[c], counts[c], counts[c + 1] if c + 1 < steps else 0
            fill(out_per_chunk[a + nn:a + n], nn, n)  # sequences whose last chunk is c
            if nn:
                step(firsts[c + 1], firsts[c + 1] + nn, out_per_chunk[a:a + nn])
        if steps:
            step(0, counts[0], final[:counts[0]])
    n0 = counts[0] if steps else 0
    fill(final[n0:], n0, N)  # sequences without chunks
    if not layout.uniform:
        final = final.index_select(0, torch.argsort(layout.order_index()))
    return final


# ------------------------------------------------------------------------------------------------
# One head group
# ------------------------------------------------------------------------------------------------
def _group_forward(layout: Layout, q, k, v, g, scale, h0, cd, o_out, final_out):
    qc, kc, vc = layout.pack(q, cd), layout.pack(k, cd), layout.pack(v, cd)
    gl = clamped_gate(layout.pack(g, cd))
    dec = decays(gl)
    h = qc.new_empty(qc.shape[0], qc.shape[1], qc.shape[-1], vc.shape[-1])
    kw = kc * dec.to_end
    final = state_scan(layout, kw, vc, dec.whole, h0, False, h)
    del kw
    A = attention(qc, kc, gl, scale)
    del gl, kc
    o = A @ vc
    del A, vc
    _flat(o).baddbmm_(_flat(qc.mul_(dec.from_start)), _flat(h), alpha=scale)
    del h, qc, dec
    layout.unpack_into(o, o_out)
    if final_out is not None:
        final_out.copy_(final)


def _group_backward(layout: Layout, q, k, v, g, scale, h0, do, dht, cd, outs):
    dq_out, dk_out, dv_out, dg_out, dh0_out = outs
    qc, kc, vc = layout.pack(q, cd), layout.pack(k, cd), layout.pack(v, cd)
    gl = clamped_gate(layout.pack(g, cd))
    doc = layout.pack(do, cd) if do is not None else torch.zeros_like(vc)
    dec = decays(gl)
    P, Hh, C, K = qc.shape
    V = vc.shape[-1]
    # B0: chunk-start states
    h = qc.new_empty(P, Hh, K, V)
    kw = kc * dec.to_end
    state_scan(layout, kw, vc, dec.whole, h0, False, h)
    # B1: dh[c] = dL/d(state at the end of chunk c)
    qw = qc * dec.from_start
    dh = qc.new_empty(P, Hh, K, V)
    dh0 = state_scan(layout, qw, doc, dec.whole, dht, True, dh, alpha=scale)
    del qw
    # B3
    dA = doc @ vc.transpose(-1, -2)
    dA.mul_(scale)
    # B4 with the intra-chunk dg; A along the way for B2
    dq = torch.zeros_like(qc)
    dk = torch.zeros_like(kc)
    dg = torch.zeros_like(qc)
    intra_gradients(qc, kc, gl, dA, dq, dk, dg)
    del dA
    A = attention(qc, kc, gl, scale)
    del gl
    # B2
    dv = A.transpose(-1, -2) @ doc
    del A
    _flat(dv).baddbmm_(_flat(kw), _flat(dh))
    del kw
    # B5: inter-chunk dq, dk, dg
    add_inter_gradients(qc, kc, vc, doc, h, dh, dec, scale, dq, dk, dg)
    del h, dh, dec, doc, vc
    for packed, out in ((dq, dq_out), (dk, dk_out), (dv, dv_out)):
        if out is not None:
            layout.unpack_into(packed, out)
    if dg_out is not None:
        unpack_gate_gradient(layout, dg, dg_out)
    if dh0_out is not None:
        dh0_out.copy_(dh0)


def add_inter_gradients(qc, kc, vc, doc, h, dh, dec: Decays, scale, dq, dk, dg):
    """B5: adds the inter-chunk parts into dq, dk, dg [..., C, K]: dq_t += scale e^(b_t) (S_c do_t),
    dk_s += e^(b_last - b_s) (dS_{c+1} v_s), and to dg_u the sums over t >= u of q_t dq_t^inter,
    over s < u of k_s dk_s^inter, and e^(b_last) rowsum(S_c * dS_{c+1}). doc None: do = 0."""
    if doc is not None:
        dq_inter = (doc @ h.transpose(-1, -2)).mul_(dec.from_start).mul_(scale)
        dq.add_(dq_inter)
        dg.add_(_rev_cumsum(dq_inter.mul_(qc)))
        del dq_inter
    dk_inter = (vc @ dh.transpose(-1, -2)).mul_(dec.to_end)
    dk.add_(dk_inter)
    kd = dk_inter.mul_(kc).cumsum(-2)
    del dk_inter
    dg[..., 1:, :].add_(kd[..., :-1, :])
    del kd
    dg.add_((h * dh).sum(-1).mul_(dec.whole).unsqueeze(-2))


def unpack_gate_gradient(layout: Layout, dg, out) -> None:
    """Packed per-key dg into out: [B, T, H, K], or [B, T, H] (the sum over K) for a per-head gate."""
    if out.dim() == 3:
        tmp = torch.empty(out.shape + (dg.shape[-1],), dtype=dg.dtype, device=dg.device)
        layout.unpack_into(dg, tmp)
        out.copy_(tmp.sum(-1))
    else:
        layout.unpack_into(dg, out)


def _head_groups(H: int, per_head_bytes: int) -> List[slice]:
    per = max(1, min(H, WORKSET_BYTES // max(per_head_bytes, 1)))
    groups = -(-H // per)
    per = -(-H // groups)  # even groups
    return [slice(i, min(H, i + per)) for i in range(0, H, per)]


def _working_set(layout: Layout, K: int, V: int, esize: int, backward: bool) -> int:
    """Bytes of one head's working set, roughly (inputs packed, states, gradients, temporaries)."""
    rows = layout.total * layout.C
    if backward:
        return esize * (rows * (9 * K + 4 * V + 2 * layout.C) + 2 * layout.total * K * V)
    return esize * (rows * (5 * K + 2 * V + layout.C) + layout.total * K * V)


def _gate_per_key(g: torch.Tensor, K: int) -> torch.Tensor:
    return g.unsqueeze(-1).expand(*g.shape, K) if g.dim() == 3 else g


def _state_in(state, state_v_first):
    if state is None:
        return None
    return state.transpose(-1, -2) if state_v_first else state


def chunk_forward(q, k, v, g, scale: float, initial_state=None, seq_offsets=None,
                  state_v_first: bool = False, want_final_state: bool = True, o_out=None, final_out=None,
                  chunk_size: Optional[int] = None):
    """o and final_state (or None). Written into o_out / final_out when given, else returned in the
    compute dtype.

    q, k [B, T, H, K]; g [B, T, H, K] or [B, T, H]; v [B, T, H, V]; initial_state [N, H, K, V]
    ([N, H, V, K] with state_v_first) or None. seq_offsets: host sequence offsets (N + 1 ints)
    for varlen (then B == 1), or None for one sequence per batch row."""
    cd = compute_dtype(q.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = len(seq_offsets) - 1 if seq_offsets is not None else B
    if o_out is None:
        o_out = q.new_empty(B, T, H, V, dtype=cd)
    if want_final_state and final_out is None:
        shape = (N, H, V, K) if state_v_first else (N, H, K, V)
        final_out = q.new_empty(shape, dtype=cd)
    if not want_final_state:
        final_out = None
    final_kv = _state_in(final_out, state_v_first)
    h0 = _state_in(initial_state, state_v_first)
    g = _gate_per_key(g, K)
    lengths_max = T if seq_offsets is None else max([int(seq_offsets[n + 1]) - int(seq_offsets[n]) for n in range(N)] + [0])
    if lengths_max == 0 or N == 0:  # only empty sequences (then T == 0)
        if final_kv is not None:
            final_kv.copy_(h0) if h0 is not None else final_kv.zero_()
        return o_out, final_out
    layout = layout_for(B, T, seq_offsets, chunk_size or chunk_size_for(lengths_max), q.device)
    for hs in _head_groups(H, _working_set(layout, K, V, torch.finfo(cd).bits // 8, False)):
        h0g = h0[:, hs].to(cd) if h0 is not None else None
        _group_forward(layout, q[:, :, hs], k[:, :, hs], v[:, :, hs], g[:, :, hs], scale, h0g, cd, o_out[:, :, hs],
                       final_kv[:, hs] if final_kv is not None else None)
    return o_out, final_out


def chunk_backward(q, k, v, g, scale: float, initial_state=None, seq_offsets=None,
                   state_v_first: bool = False, do=None, dht=None, outs=None, chunk_size: Optional[int] = None):
    """dq, dk, dv, dg (shaped like g), dh0 (like initial_state; [N, H, K, V] (or V-first) zeros-state
    gradient when there is none). Written into outs = (dq, dk, dv, dg, dh0) where given (an entry
    may be None: not wanted), else returned in the compute dtype."""
    cd = compute_dtype(q.dtype)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = len(seq_offsets) - 1 if seq_offsets is not None else B
    if outs is None:
        shape = (N, H, V, K) if state_v_first else (N, H, K, V)
        outs = (q.new_empty(q.shape, dtype=cd), q.new_empty(q.shape, dtype=cd), q.new_empty(v.shape, dtype=cd),
                q.new_empty(g.shape, dtype=cd), q.new_empty(shape, dtype=cd))
    dq_out, dk_out, dv_out, dg_out, dh0_out = outs
    dh0_kv = _state_in(dh0_out, state_v_first)
    h0 = _state_in(initial_state, state_v_first)
    dht = _state_in(dht, state_v_first)
    lengths_max = T if seq_offsets is None else max([int(seq_offsets[n + 1]) - int(seq_offsets[n]) for n in range(N)] + [0])
    if lengths_max == 0 or N == 0:
        for t in (dq_out, dk_out, dv_out, dg_out):
            if t is not None:
                t.zero_()
        if dh0_kv is not None:
            dh0_kv.copy_(dht) if dht is not None else dh0_kv.zero_()
        return tuple(outs)
    g = _gate_per_key(g, K)
    layout = layout_for(B, T, seq_offsets, chunk_size or chunk_size_for(lengths_max), q.device)
    for hs in _head_groups(H, _working_set(layout, K, V, torch.finfo(cd).bits // 8, True)):
        part = lambda t: t[:, :, hs] if t is not None else None  # noqa: E731
        state = lambda t: t[:, hs].to(cd) if t is not None else None  # noqa: E731
        group_outs = (part(dq_out), part(dk_out), part(dv_out),
                      (dg_out[:, :, hs] if dg_out is not None else None), dh0_kv[:, hs] if dh0_kv is not None else None)
        _group_backward(layout, part(q), part(k), part(v), part(g), scale, state(h0), part(do), state(dht), cd,
                        group_outs)
    return tuple(outs)
