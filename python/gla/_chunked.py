"""The chunked GLA algorithm (SPEC.md §2) written only with PyTorch tensor ops.

This is the body of the portable `torch` backend: matmul, exp, adds and selects, nothing
device-specific, so it runs wherever PyTorch runs (CPU, CUDA, Ascend NPU, Apple MPS, Intel XPU, any
PrivateUse1 device).

Layout. Every sequence (a batch row, or a cu_seqlens segment) is cut into chunks of C tokens, the
last one zero-padded (a zero gate keeps the cumulative gate flat past the end, so a padded row holds
b_last). Chunks are packed chunk-major, sequences sorted by chunk count: step c of the state scan
owns one contiguous range of packed rows, chunk c of every sequence that has one, and the running
state of those sequences is a prefix of one [N, H, K, V] tensor. Packed tensors are [rows, H, C, D];
the chunk-local math below works on any leading dims.

Blocks. The whole operations walk consecutive scan steps in blocks (Layout.step_blocks): a block's
chunks are gathered from the caller's [B, T, H, D] tensors (Layout.load), all its chunk-local work
runs as batched ops over the block, the scan steps of the block update the running state (one op a
step for equal-length sequences, whose per-chunk products are formed for the whole block at once;
two or three otherwise), and its results go straight into the caller's outputs (Layout.store). A block's
temporaries are named scratch buffers (_scratch.py) that every block of the call reuses. On
accelerators a block is as large as BLOCK_BYTES allows (few, large kernels); on the CPU it is
CPU_BLOCK_BYTES and the heads are split over single-threaded worker threads (_by_heads). The
forward keeps no per-chunk state; the backward keeps the chunk-start states h [chunks, H, K, V]
(the one full-size intermediate, 2x q at C = 64, K = V = 128) and per block the gradient states
of its chunks.

Numerics (SPEC.md §3):
- everything accumulates in fp32 (fp64 when the inputs are fp64, for gradcheck);
- intra-chunk products are factorised around pivots with every exponent <= 0: the chunk is halved
  recursively (widths C, C/2, ..., 2); in each block the lower-left quadrant (query rows in the
  second half, key rows in the first) is one matmul of q_t e^(b_t - b_p) and k_s e^(b_p - b_s) with
  the pivot p the query half's first row (a sub-chunk boundary for widths >= 32, and inside the
  16-row diagonal blocks below that). Every pair s < t lies in exactly one quadrant, the diagonal
  t = s needs no decay. No [.., 16, 16, K] expansion exists: a level's operands are the size of q;
- with fp32 and fp64 inputs every exponent is a direct sum of the gates it spans (never a difference
  of two cumulative sums: with g = -7 per step b reaches -650 within a chunk, where fp32's spacing
  6e-5 would put ~4e-5 relative error on every decay, against the 1e-5 bar), formed by span_sums;
  with 16-bit inputs on an accelerator (bar 5e-3) it is a difference of the chunk's cumulative gate
  b (one cumsum a block, gate_cumsum), as in the CUDA kernels: there the span sums are fp32 matmuls
  on CUDA cores, 76 of the 264 GFLOP of a B8 T4096 H16 D128 forward+backward
  (bench/torch_backend_census.py);
- the gate gradient is summed per quadrant (a pair s < t contributes to dg_u for s < u <= t)
  instead of as the reverse cumsum of q*dq - k*dk, whose large diagonal terms cancel (3e-5 error
  at n = 0.1, above SPEC's 1e-5);
- g = -inf is a hard reset: gates are clamped to a floor below which e^g underflows to 0 anyway
  (-104 in fp32, -746 in fp64), so no -inf - (-inf) arises;
- masks are selects (upper triangles are never computed, only left at zero), never products
  with a 0/1 mask.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import _scratch
from ._scratch import Scratch

RCP_LN2 = 1.0 / math.log(2.0)  # gcum (a stage buffer) is in log2 units
CHUNK = 64  # fla's chunk size, and the stage pipeline's
# One block's working set (its chunks' inputs in chunk layout, temporaries, gradients), by
# _row_bytes's count of its scratch buffers: on accelerators up to 1 GiB (few, large kernels); on
# the CPU 64 MiB a worker (B1 T4096 H16 K=V=128, 2 workers of 8 heads: 25 chunks a forward block,
# 10 a backward block): each of a block's ~60 (forward) or ~150 (backward) ops costs ~10 us of
# dispatch whatever its size, and a block's tensors exceed the 2 MiB L2 at any useful size
# (1-chunk blocks: +7-17% CPU time; 32 MiB: +5% forward, +8% backward; 16 MiB: +9% backward).
BLOCK_BYTES = 1 << 30
CPU_BLOCK_BYTES = 64 << 20
# A CPU thread keeps its scratch buffers (_scratch.py) between calls up to this size (the forward's
# and the backward's blocks together: ~100 MiB a worker at 64 MiB blocks).
SCRATCH_KEPT_BYTES = 128 << 20


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
        self._gather = self._scatter = self._stage = self._gather_host = None
        self._order_t = None
        self._blocks, self._maps = {}, {}

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
            self._gather_host = gather.reshape(-1)
            self._gather = self._on_device(self._gather_host)
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

    def step_blocks(self, row_bytes: int, budget: int) -> List[tuple]:
        """Consecutive scan steps [c0, c1) grouped so that each block's rows fit `budget` bytes
        (at least one step a block)."""
        key = (row_bytes, budget)
        if key not in self._blocks:
            out, c0, used = [], 0, 0
            for c, n in enumerate(self.step_count):
                if c > c0 and used + n * row_bytes > budget:
                    out.append((c0, c))
                    c0, used = c, 0
                used += n * row_bytes
            if self.step_count:
                out.append((c0, len(self.step_count)))
            self._blocks[key] = out
        return self._blocks[key]

    def rows_of(self, c0: int, c1: int) -> tuple:
        """The packed rows of steps [c0, c1)."""
        return self.step_start[c0], (self.step_start[c1] if c1 < len(self.step_start) else self.total)

    def _block_maps(self, p0: int, p1: int):
        """(rows, tokens): the packed rows p0 * C .. p1 * C that hold tokens (relative to p0 * C)
        and those tokens of row 0 (varlen)."""
        key = (p0, p1)
        if key not in self._maps:
            self._token_maps()
            part = self._gather_host[p0 * self.C:p1 * self.C]
            valid = part != self.B * self.T
            rows = torch.nonzero(valid).flatten()
            self._maps[key] = (self._on_device(rows), self._on_device(part[rows]))
        return self._maps[key]

    def load(self, x: torch.Tensor, p0: int, p1: int, dtype: torch.dtype, ws: Optional[Scratch] = None,
             name: str = "load", floor: Optional[float] = None) -> torch.Tensor:
        """Packed rows p0..p1-1 of x [B, T, H, D] as [p1 - p0, H, C, D] in `dtype` (ws's buffer
        `name`, else new), zeros past each sequence's end; clamped below at `floor` if given (in the
        same pass where the layout allows)."""
        B, T, H, D = x.shape
        C, n = self.C, p1 - p0
        out = ws.take(name, (n, H, C, D)) if ws is not None else torch.empty(n, H, C, D, dtype=dtype, device=x.device)
        if self.uniform:
            c0, c1 = p0 // B, p1 // B
            self._uniform_rows(out, c0, c1, T, x, load=True, floor=floor)
            return out
        rows, tokens = self._block_maps(p0, p1)
        flat = torch.zeros(n * C, H, D, dtype=dtype, device=x.device)
        flat.index_copy_(0, rows, x[0].index_select(0, tokens).to(dtype))
        out.copy_(flat.view(n, C, H, D).transpose(1, 2))
        return out.clamp_(min=floor) if floor is not None else out

    def _uniform_rows(self, packed: torch.Tensor, c0: int, c1: int, T: int, x: torch.Tensor, load: bool,
                      floor: Optional[float] = None) -> None:
        """Copies between the packed chunks c0..c1-1 (uniform layout: [(c1 - c0) * B, H, C, D]) and
        their tokens of x [B, T, H, D], one strided copy for the whole chunks and one for a partial
        last chunk (whose padding rows are zeroed on load); a load clamps below at `floor` if given."""
        B, _, H, D = x.shape
        C = self.C
        chunks = packed.view(c1 - c0, B, H, C, D).permute(1, 0, 3, 2, 4)  # [B, chunks, C, H, D], a view
        valid = min(T, c1 * C) - c0 * C
        full, rest = divmod(valid, C)
        pairs = [(chunks[:, :full], x[:, c0 * C:c0 * C + full * C].unflatten(1, (full, C)))] if full else []
        if rest:
            pairs.append((chunks[:, full, :rest], x[:, c0 * C + full * C:c0 * C + valid]))
        for p, t in pairs:
            if not load:
                t.copy_(p)
            elif floor is not None and t.dtype == p.dtype:
                torch.clamp(t, min=floor, out=p)
            else:
                p.copy_(t)
                if floor is not None:  # a 16-bit gate: clamp's out= takes only its input's dtype
                    p.clamp_(min=floor)
        if load and rest:
            chunks[:, full, rest:].zero_()

    def store(self, y: torch.Tensor, p0: int, p1: int, out: torch.Tensor) -> None:
        """Writes packed rows p0..p1-1, y [p1 - p0, H, C, D], into out [B, T, H, D] (valid rows)."""
        B, T, H, D = out.shape
        C, n = self.C, p1 - p0
        if self.uniform:
            self._uniform_rows(y, p0 // B, p1 // B, T, out, load=False)
            return
        rows, tokens = self._block_maps(p0, p1)
        flat = y.transpose(1, 2).reshape(n * C, H, D)
        out[0].index_copy_(0, tokens, flat.index_select(0, rows).to(out.dtype))

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
def clamped_gate(g: torch.Tensor) -> torch.Tensor:
    """The packed gate clamped to gate_floor (in place). Decays are formed in natural-log units
    with exp: one pass fewer than converting to log2 for exp2, the same rounding."""
    return g.clamp_(min=gate_floor(g.dtype))


def by_difference(x: torch.Tensor) -> bool:
    """Exponents as differences of the chunk cumsum: 16-bit inputs off the CPU, where the span sums'
    fp32 matmuls run on CUDA cores; on the CPU a row cumsum is the slower op (bf16 B1 T4096 H16 D128,
    2 threads: forward 1.06x, backward 1.04x the span sums' CPU time)."""
    return x.dtype in (torch.bfloat16, torch.float16) and x.device.type != "cpu"


def gate_cumsum(gl: torch.Tensor, ws: Optional[Scratch] = None) -> torch.Tensor:
    """b [..., C, K]: the clamped gate's cumulative sum over each chunk's rows."""
    ws = ws or _scratch.fresh(gl)
    return torch.cumsum(gl, -2, out=ws.take("gate_cumsum", gl.shape))


# Span sums. With fp32 and fp64 inputs every exponent is the sum of the gates of one span of rows,
# formed as a product with a constant 0/1 matrix over the chunk's rows (span_sums): a direct sum,
# never a difference of two cumulative sums, and one matmul instead of a cumsum (a strided loop,
# 3-5x slower here) plus the flips a reverse one needs (16-bit inputs on accelerators: differences
# of gate_cumsum, module docstring). The gate gradient's sums over rows are span sums for every
# dtype. Where the device's fp32 matmul may round its operands (TF32), g is split into a part exact
# in 10 mantissa bits and the remainder, so the sums keep fp32 accuracy.
@functools.lru_cache(maxsize=256)
def _constant(kind: str, w: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    r = torch.arange(w)
    i, j = r[:, None], r[None, :]
    h = w // 2
    if kind == "pivot":  # rows s < h: the span (s, h]; rows t >= h: the span (h, t]
        m = torch.where(i < h, (j > i) & (j <= h), (j > h) & (j <= i))
    elif kind == "decay":  # [2w, w]: rows t: the span [0, t]; rows w + s: the span (s, w - 1]
        m = torch.cat([j <= i, j > i])
    elif kind == "decay_to_end":  # [w + 1, w]: rows s: the span (s, w - 1]; row w: the whole [0, w - 1]
        m = torch.cat([j > i, torch.ones(1, w, dtype=torch.bool)])
    elif kind == "from":  # sum over rows >= u
        m = j >= i
    elif kind == "before":  # sum over rows < u
        m = j < i
    else:
        raise ValueError(kind)
    return m.to(dtype).to(device)


def _matmul_may_round(device: torch.device) -> bool:
    if torch.get_float32_matmul_precision() != "highest":
        return True
    if device.type == "cpu":
        return False
    if device.type == "cuda":
        return bool(torch.backends.cuda.matmul.allow_tf32)
    return True  # an unknown device's fp32 matmul: assume it may


def span_sums(kind: str, x: torch.Tensor, w: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """M @ x over blocks of w rows: x [..., R, K] (R a multiple of w) -> [..., R * (rows of M) / w, K],
    with M the constant `kind` matrix; into `out` (contiguous) when given."""
    device = x.device
    m = _constant(kind, w, x.dtype, device)
    blocks = x.reshape(-1, w, x.shape[-1])
    mb = m.expand(blocks.shape[0], m.shape[0], w)
    shape = (*x.shape[:-2], x.shape[-2] // w * m.shape[0], x.shape[-1])
    if out is None:
        out = x.new_empty(shape)
    flat = out.view(blocks.shape[0], m.shape[0], x.shape[-1])
    if x.dtype == torch.float32 and (device.type != "cpu" or _precision_reduced()) and _matmul_may_round(device):
        hi = blocks.to(torch.bfloat16).to(torch.float32)  # 8 mantissa bits: exact in TF32
        torch.bmm(mb, hi, out=flat)
        flat.baddbmm_(mb, blocks - hi)
    else:
        torch.bmm(mb, blocks, out=flat)
    return out.view(shape)


def _precision_reduced() -> bool:
    return torch.get_float32_matmul_precision() != "highest"


@dataclass
class Decays:
    """Per-chunk decay factors from the clamped gate gl [..., C, K] (b: its chunk-local cumsum)."""
    from_start: Optional[torch.Tensor]  # e^(b_t): decay from the chunk start to t (inclusive)
    to_end: torch.Tensor      # e^(b_last - b_s): decay from s (exclusive) to the chunk's last row
    whole: torch.Tensor       # e^(b_last) [..., K]


def decays(gl: torch.Tensor, ws: Optional[Scratch] = None, name: str = "decays", from_start: bool = True,
           cum: Optional[torch.Tensor] = None) -> Decays:
    """The decays of the clamped gate; without from_start only to_end and whole (Decays.from_start
    None: half the span sums and exps). cum: gate_cumsum's b, the exponents then differences of it."""
    C = gl.shape[-2]
    ws = ws or _scratch.fresh(gl)
    if cum is not None:
        last = cum[..., C - 1:, :]
        if not from_start:
            part = ws.take(name, (*gl.shape[:-2], C + 1, gl.shape[-1]))
            torch.sub(last, cum, out=part[..., :C, :])
            part[..., C:, :].copy_(last)
            part.exp_()
            return Decays(None, part[..., :C, :], part[..., C, :])
        both = ws.take(name, (*gl.shape[:-2], 2 * C, gl.shape[-1]))
        torch.exp(cum, out=both[..., :C, :])
        torch.sub(last, cum, out=both[..., C:, :]).exp_()
        return Decays(both[..., :C, :], both[..., C:, :], both[..., C - 1, :])
    if not from_start:
        part = span_sums("decay_to_end", gl, C, ws.take(name, (*gl.shape[:-2], C + 1, gl.shape[-1]))).exp_()
        return Decays(None, part[..., :C, :], part[..., C, :])
    both = span_sums("decay", gl, C, ws.take(name, (*gl.shape[:-2], 2 * C, gl.shape[-1]))).exp_()
    return Decays(both[..., :C, :], both[..., C:, :], both[..., C - 1, :])


def _levels(C: int) -> List[int]:
    out, w = [], C
    while w >= 2:
        out.append(w)
        w //= 2
    return out


@dataclass
class Level:
    """The pivoted quadrants of block width w (SPEC.md §3 rule 2): in each diagonal w-block, key
    rows s of the first half and query rows t of the second, through the pivot p = the second
    half's first row. ek [..., C/w, w/2, K] = e^(sum over (s, p]) on the key rows, eq (the same
    shape) = e^(sum over (p, t]) on the query rows (every exponent <= 0; None at w = 2, where the
    span is empty); kop = k ek, qop = q eq."""
    w: int
    ek: Optional[torch.Tensor]
    eq: Optional[torch.Tensor]
    kop: torch.Tensor
    qop: torch.Tensor


def levels(q, k, gl, keep_factors: bool, ws: Scratch, cum: Optional[torch.Tensor] = None) -> Iterator[Level]:
    """Each level's factors (ek, eq kept only with keep_factors) and operands for the block q, k,
    gl [..., C, K], one level at a time: a level's tensors are scratch buffers that the next level
    overwrites (one level's working set instead of six, and each level's consumers read it while
    it is in cache). cum: gate_cumsum's b, the exponents then differences of it (b_p - b_s on key
    rows, b_t - b_p on query rows)."""
    C = gl.shape[-2]
    for w in _levels(C):
        h = w // 2
        blocks = (C // w, w)
        f = ws.take("level_factors", gl.shape).unflatten(-2, blocks)
        ops = ws.take("level_operands", gl.shape).unflatten(-2, blocks) if keep_factors else f
        k_rows, q_rows = k.unflatten(-2, blocks)[..., :h, :], q.unflatten(-2, blocks)[..., h:, :]
        if w == 2:  # (s, p] is row 1 alone, (p, t] is empty: q's rows themselves, no matmul of 2 x 2 blocks
            torch.exp(gl.unflatten(-2, blocks)[..., 1:, :], out=f[..., :1, :])
            torch.mul(k_rows, f[..., :1, :], out=ops[..., :1, :])
            yield Level(w, f[..., :1, :] if keep_factors else None, None, ops[..., :1, :], q_rows)
            continue
        if cum is not None:
            b = cum.unflatten(-2, blocks)
            pivot = b[..., h:h + 1, :]
            torch.sub(pivot, b[..., :h, :], out=f[..., :h, :])
            torch.sub(b[..., h:, :], pivot, out=f[..., h:, :])
            f.exp_()
        else:
            span_sums("pivot", gl, w, f.flatten(-3, -2)).exp_()
        torch.mul(k_rows, f[..., :h, :], out=ops[..., :h, :])
        torch.mul(q_rows, f[..., h:, :], out=ops[..., h:, :])
        yield Level(w, f[..., :h, :] if keep_factors else None, f[..., h:, :] if keep_factors else None,
                    ops[..., :h, :], ops[..., h:, :])


def _quadrants(M: torch.Tensor, w: int) -> torch.Tensor:
    """Writable view [..., C/w, w/2, w/2] of the lower-left quadrants of M's diagonal w-blocks."""
    C = M.shape[-1]
    nb, half = C // w, w // 2
    blocks = torch.diagonal(M.unflatten(-1, (nb, w)).unflatten(-3, (nb, w)), dim1=-4, dim2=-2)  # [.., w, w, nb]
    return blocks[..., half:, :half, :].movedim(-1, -3)


def _products(a: torch.Tensor, b: torch.Tensor, ws: Scratch, name: str) -> torch.Tensor:
    """a @ b^T over the last dim, [.., n, K] x [.., m, K] -> [.., n, m] (1 x 1: a product and a sum)."""
    n, m, K = a.shape[-2], b.shape[-2], a.shape[-1]
    if n == 1:
        prod = torch.mul(a, b, out=ws.take(name, a.shape))
        return torch.sum(prod, -1, keepdim=True, out=ws.take(name + "_sum", (*a.shape[:-1], 1)))
    return _bmm(a, b.transpose(-1, -2), ws.take(name, (*a.shape[:-1], m)))


def _bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False, alpha: float = 1.0):
    """out (contiguous) = (or +=) alpha a @ b over matching leading dims, as one bmm on views (matmul's
    out= copies through a temporary for more than 3 dims)."""
    a3 = a.reshape(-1, a.shape[-2], a.shape[-1])
    b3 = b.reshape(-1, b.shape[-2], b.shape[-1])
    o3 = out.view(-1, out.shape[-2], out.shape[-1])
    if accumulate or alpha != 1.0:
        o3.baddbmm_(a3, b3, beta=1 if accumulate else 0, alpha=alpha)  # beta 0: old contents ignored
    else:
        torch.bmm(a3, b3, out=o3)
    return out


def _row_dot(a: torch.Tensor, b: torch.Tensor, ws: Scratch, name: str) -> torch.Tensor:
    """sum over the last dim of a * b, [..., R, K] -> [..., R]."""
    prod = torch.mul(a, b, out=ws.take(name, a.shape))
    return torch.sum(prod, -1, out=ws.take(name + "_sum", a.shape[:-1]))


def attention(q, k, gl, scale, ws: Optional[Scratch] = None, cum: Optional[torch.Tensor] = None):
    """F3: A [..., C, C], A[t, s] = scale * sum_i q_ti k_si e^(b_ti - b_si) for s <= t, 0 above
    (the upper triangle is never computed: a select, not a mask product). cum: see levels."""
    ws = ws or _scratch.fresh(q)
    A = ws.zeros("attention", q.shape[:-1] + (q.shape[-2],))
    for level in levels(q, k, gl, False, ws, cum):
        _add_quadrants(A, level, ws)
    return _finish_attention(A, q, k, scale, ws)


def _add_quadrants(A, level: Level, ws: Scratch) -> None:
    _quadrants(A, level.w).copy_(_products(level.qop, level.kop, ws, "attention_products"))


def _finish_attention(A, q, k, scale, ws: Scratch):
    torch.diagonal(A, dim1=-2, dim2=-1).copy_(_row_dot(q, k, ws, "attention_diagonal"))
    return A.mul_(scale)


def intra_gradients(q, k, gl, dA, dq, dk, dg, ws: Optional[Scratch] = None, scale: Optional[float] = None,
                    cum: Optional[torch.Tensor] = None):
    """B4 and the intra-chunk part of dg: adds into dq, dk, dg [..., C, K] the gradients through
    A given dA [..., C, C] (scale included). Per quadrant, mk = dA^T (q ops), mq = dA (k ops):
    dk gains ek mk and dq eq mq, and dg_u every pair s < u <= t: on key rows the sum over s < u of
    k ops * mk, on query rows the sum over t >= u of q ops * mq. With `scale` given, also forms
    and returns F3's A from the same level operands (attention(), without a second pass of levels).
    cum: see levels."""
    C = q.shape[-2]
    ws = ws or _scratch.fresh(q)
    A = ws.zeros("attention", q.shape[:-1] + (C,)) if scale is not None else None
    for level in levels(q, k, gl, True, ws, cum):
        w, h = level.w, level.w // 2
        kop, qop, ek, eq = level.kop, level.qop, level.ek, level.eq
        if A is not None:
            _add_quadrants(A, level, ws)
        dAq = _quadrants(dA, w)
        half = kop.shape  # [..., C/w, w/2, K]
        mk, mq = ws.take("intra_mk", half), ws.take("intra_mq", half)
        if w == 2:  # 1 x 1 quadrants: products, not matmuls
            torch.mul(dAq, qop, out=mk)
            torch.mul(dAq, kop, out=mq)
        else:
            dA3 = dAq.reshape(-1, h, h)
            torch.bmm(dA3.transpose(-1, -2), qop.reshape(-1, h, qop.shape[-1]), out=mk.view(-1, h, half[-1]))
            torch.bmm(dA3, kop.reshape(-1, h, kop.shape[-1]), out=mq.view(-1, h, half[-1]))
        split = lambda x: x.unflatten(-2, (C // w, 2, w // 2))  # noqa: E731
        dg_k, dg_q = split(dg)[..., 0, :, :], split(dg)[..., 1, :, :]
        yq = torch.mul(qop, mq, out=ws.take("intra_yq", half))
        if w == 2:  # the key row has no s < u in its block; the query row's sum is its own term
            dg_q.add_(yq)
        else:
            yk = torch.mul(kop, mk, out=ws.take("intra_yk", half))
            if w == 4:  # halves of 2 rows: the sums are single adds, not matmuls of 2 x 2 blocks
                dg_k[..., 1, :].add_(yk[..., 0, :])
                dg_q[..., 0, :].add_(yq[..., 0, :]).add_(yq[..., 1, :])
                dg_q[..., 1, :].add_(yq[..., 1, :])
            else:
                dg_k.add_(span_sums("before", yk, h, ws.take("intra_sums", half)))
                dg_q.add_(span_sums("from", yq, h, ws.take("intra_sums", half)))
        if eq is None:  # w = 2: the query row's factor is 1
            split(dq)[..., 1, :, :].add_(mq)
        else:
            split(dq)[..., 1, :, :].addcmul_(eq, mq)
        split(dk)[..., 0, :, :].addcmul_(ek, mk)
    diag = torch.diagonal(dA, dim1=-2, dim2=-1).unsqueeze(-1)
    dq.addcmul_(diag, k)
    dk.addcmul_(diag, q)
    return _finish_attention(A, q, k, scale, ws) if A is not None else None


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
# The whole operations: blocks of scan steps
# ------------------------------------------------------------------------------------------------
def _running_state(layout: Layout, start, H, K, V, dtype, device) -> torch.Tensor:
    """[N, H, K, V] in sort order: `start` (sequence order) or zeros; the scans update its prefixes."""
    state = torch.empty(layout.N, H, K, V, dtype=dtype, device=device)  # contiguous: its prefixes are views
    if start is None:
        return state.zero_()
    return state.copy_(start if layout.uniform else start.index_select(0, layout.order_index()))


def _sequence_order(layout: Layout, state: torch.Tensor) -> torch.Tensor:
    if layout.uniform:
        return state
    return state.index_select(0, torch.argsort(layout.order_index()))


def _flat3(x: torch.Tensor, lo: int, n: int) -> torch.Tensor:
    """Packed rows lo..lo+n-1 of a block [rows, H, R, D] as [n * H, R, D] (a view)."""
    return x[lo:lo + n].flatten(0, 1)


# Equal-length sequences (Layout.uniform: the N rows of every scan step) take the scans of a block
# with one op a step instead of two or three: the products kw^T v (q w^T do) of all the block's chunks
# in one batched matmul, each step one addcmul forming the next state in place of its product, and
# the forward's inter-chunk o of all chunks in one more. The per-op cost is what bounds the body on
# accelerators (B8 T4096 H16 D128 on an H200: 1797 ops in 53 ms), and the scans were 510 of them.
def uniform_scans(layout: Layout) -> bool:
    """Whether the blocks' scans take the equal-length forms below (a test forces the general ones)."""
    return layout.uniform


def _walk(states, kw, v, whole, entering) -> None:
    """The states of consecutive scan steps of equal-length sequences (N = entering.shape[0] rows a
    step), each formed in place of its chunk's product: states[step j] = kw_j^T v_j first, then
    e^(b_last) (the state before) + kw_j^T v_j, starting from `entering`."""
    N = entering.shape[0]
    torch.bmm(kw.flatten(0, 1).transpose(-1, -2), v.flatten(0, 1), out=states.flatten(0, 1))
    for a in range(0, states.shape[0], N):
        states[a:a + N].addcmul_(whole[a:a + N].unsqueeze(-1), entering)
        entering = states[a:a + N]


def _uniform_forward_scan(S, qb, kb, vb, whole, ob, scale, ws: Scratch) -> None:
    """One forward block's scan: o += scale (q e^b) S_c for every chunk c, and S (the running state
    [N, H, K, V]) from the block's entering state to its leaving one."""
    N, H, K, V = S.shape
    rows = kb.shape[0]
    states = ws.take("scan_states", (rows, H, K, V))  # chunk c's row: S_{c+1}
    _walk(states, kb, vb, whole, S)
    _flat3(ob, 0, N).baddbmm_(_flat3(qb, 0, N), S.flatten(0, 1), alpha=scale)
    if rows > N:  # chunk c > first: its entering state is the previous chunk's row of `states`
        _flat3(ob, N, rows - N).baddbmm_(_flat3(qb, N, rows - N), states[:rows - N].flatten(0, 1), alpha=scale)
    S.copy_(states[rows - N:])


def _uniform_gradient_walk(dS, dh, qw, dob, whole, scale: float) -> None:
    """B1 for one block of equal-length sequences: dh[chunk row] = dL/d(state after the chunk), and
    dS (running, [N, H, K, V]) from the gradient after the block's last chunk to the one after the
    chunk before its first: dS_{c-1} = e^(b_last of c) dS_c + scale qw_c^T do_c."""
    N = dS.shape[0]
    rows = qw.shape[0]
    if rows > N:  # chunk c > first: its term scale qw_c^T do_c, in the row of chunk c - 1
        dh[:rows - N].flatten(0, 1).baddbmm_(_flat3(qw, N, rows - N).transpose(-1, -2), _flat3(dob, N, rows - N),
                                              beta=0.0, alpha=scale)
    dh[rows - N:].copy_(dS)
    for a in range(rows - N, 0, -N):
        dh[a - N:a].addcmul_(whole[a:a + N].unsqueeze(-1), dh[a:a + N])
    torch.mul(dh[:N], whole[:N].unsqueeze(-1), out=dS)
    dS.flatten(0, 1).baddbmm_(_flat3(qw, 0, N).transpose(-1, -2), _flat3(dob, 0, N), alpha=scale)


def _forward(layout: Layout, q, k, v, g, scale, h0, cd, o_out, final_out):
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    S = _running_state(layout, h0, H, K, V, cd, q.device)
    counts, firsts = layout.step_count, layout.step_start
    ws = _scratch.for_call(cd, q.device)
    for c0, c1 in layout.step_blocks(_row_bytes(layout, H, K, V, cd, False), _block_budget(q.device)):
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        cum = gate_cumsum(gl, ws) if by_difference(q) else None
        dec = decays(gl, ws, cum=cum)
        A = attention(qb, kb, gl, scale, ws=ws, cum=cum)
        ob = _bmm(A, vb, ws.take("o", vb.shape))
        qb.mul_(dec.from_start)
        kb.mul_(dec.to_end)
        if uniform_scans(layout):
            _uniform_forward_scan(S, qb, kb, vb, dec.whole, ob, scale, ws)
        else:
            for c in range(c0, c1):  # the scan: o += scale (q e^b) S_c, S_c+1 = e^(b_last) S_c + kw^T v
                a, n = firsts[c] - p0, counts[c]
                Sn = S[:n].flatten(0, 1)
                _flat3(ob, a, n).baddbmm_(_flat3(qb, a, n), Sn, alpha=scale)
                Sn.mul_(_flat3(dec.whole, a, n).unsqueeze(-1))
                Sn.baddbmm_(_flat3(kb, a, n).transpose(-1, -2), _flat3(vb, a, n))
        layout.store(ob, p0, p1, o_out)
    ws.keep_at_most(SCRATCH_KEPT_BYTES)
    if final_out is not None:
        final_out.copy_(_sequence_order(layout, S))


def _backward(layout: Layout, q, k, v, g, scale, h0, do, dht, cd, outs):
    dq_out, dk_out, dv_out, dg_out, dh0_out = outs
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    counts, firsts = layout.step_count, layout.step_start
    blocks = layout.step_blocks(_row_bytes(layout, H, K, V, cd, True), _block_budget(q.device))
    # B0: the state each chunk enters, h [chunks, H, K, V] (the one full-size intermediate). Step c
    # writes chunk c + 1's entry straight from chunk c's (the sequences with a chunk c + 1 are a
    # prefix of those with a chunk c), so no running state is copied, and no sequence's state after
    # its last chunk is formed.
    ws = _scratch.for_call(cd, q.device)
    h = q.new_empty(layout.total, H, K, V, dtype=cd)
    if counts:
        h[:counts[0]].copy_(_running_state(layout, h0, H, K, V, cd, q.device)[:counts[0]])
    for c0, c1 in blocks:
        p0, p1 = layout.rows_of(c0, c1)
        kb, vb = layout.load(k, p0, p1, cd, ws, "k"), layout.load(v, p0, p1, cd, ws, "v")
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        dec = decays(gl, ws, from_start=False, cum=gate_cumsum(gl, ws) if by_difference(q) else None)
        kb.mul_(dec.to_end)
        if uniform_scans(layout):
            # B0: the states entering the block's chunks after its first, from h's rows at p0
            n = (min(c1, len(counts) - 1) - c0) * layout.N
            if n:
                _walk(h[p0 + layout.N:p0 + layout.N + n], kb[:n], vb[:n], dec.whole[:n], h[p0:p0 + layout.N])
            continue
        for c in range(c0, min(c1, len(counts) - 1)):
            a, n = firsts[c] - p0, counts[c + 1]
            entry = h[firsts[c + 1]:firsts[c + 1] + n].flatten(0, 1)
            torch.mul(h[firsts[c]:firsts[c] + n].flatten(0, 1), _flat3(dec.whole, a, n).unsqueeze(-1), out=entry)
            entry.baddbmm_(_flat3(kb, a, n).transpose(-1, -2), _flat3(vb, a, n))
    # B1 (reverse scan, blocks in reverse) and, per block, B2-B5
    # A sequence's entry is untouched (dht) until the step of its last chunk: steps only update
    # the prefix of sequences that have that chunk.
    dS = _running_state(layout, dht, H, K, V, cd, q.device)
    for c0, c1 in reversed(blocks):
        p0, p1 = layout.rows_of(c0, c1)
        qb, kb, vb = (layout.load(x, p0, p1, cd, ws, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
        gl = layout.load(g, p0, p1, cd, ws, "g", gate_floor(cd))
        dob = layout.load(do, p0, p1, cd, ws, "do") if do is not None else ws.zeros("do", vb.shape)
        cum = gate_cumsum(gl, ws) if by_difference(q) else None
        dec = decays(gl, ws, cum=cum)
        qw = torch.mul(qb, dec.from_start, out=ws.take("qw", qb.shape))
        dh = ws.take("dh", (p1 - p0, H, K, V))
        if uniform_scans(layout):
            _uniform_gradient_walk(dS, dh, qw, dob, dec.whole, scale)
        else:
            for c in reversed(range(c0, c1)):
                a, n = firsts[c] - p0, counts[c]
                dh[a:a + n].copy_(dS[:n])  # dL/d(state at the end of chunk c)
                Sn = dS[:n].flatten(0, 1)
                Sn.mul_(_flat3(dec.whole, a, n).unsqueeze(-1))
                Sn.baddbmm_(_flat3(qw, a, n).transpose(-1, -2), _flat3(dob, a, n), alpha=scale)
        dA = _bmm(dob, vb.transpose(-1, -2), ws.take("dA", qb.shape[:-1] + (qb.shape[-2],)), alpha=scale)  # B3
        dqb, dkb, dgb = ws.zeros("dq", qb.shape), ws.zeros("dk", kb.shape), ws.zeros("dg", qb.shape)
        A = intra_gradients(qb, kb, gl, dA, dqb, dkb, dgb, ws, scale, cum)  # B4 and the intra-chunk dg; F3's A
        dvb = _bmm(A.transpose(-1, -2), dob, ws.take("dv", vb.shape))  # B2
        kw = torch.mul(kb, dec.to_end, out=qw)  # qw is dead
        _bmm(kw, dh, dvb, accumulate=True)
        add_inter_gradients(qb, kb, vb, dob, h[p0:p1], dh, dec, scale, dqb, dkb, dgb, ws)  # B5
        for packed, out in ((dqb, dq_out), (dkb, dk_out), (dvb, dv_out)):
            if out is not None:
                layout.store(packed, p0, p1, out)
        if dg_out is not None:
            layout.store(dgb.sum(-1, keepdim=True) if dg_out.dim() == 3 else dgb, p0, p1,
                         dg_out.unsqueeze(-1) if dg_out.dim() == 3 else dg_out)
    ws.keep_at_most(SCRATCH_KEPT_BYTES)
    if dh0_out is not None:
        dh0_out.copy_(_sequence_order(layout, dS))


def add_inter_gradients(qc, kc, vc, doc, h, dh, dec: Decays, scale, dq, dk, dg, ws: Optional[Scratch] = None):
    """B5: adds the inter-chunk parts into dq, dk, dg [..., C, K]: dq_t += scale e^(b_t) (S_c do_t),
    dk_s += e^(b_last - b_s) (dS_{c+1} v_s), and to dg_u the sums over t >= u of q_t dq_t^inter,
    over s < u of k_s dk_s^inter, and e^(b_last) rowsum(S_c * dS_{c+1}). doc None: do = 0."""
    C = qc.shape[-2]
    ws = ws or _scratch.fresh(qc)
    inter = ws.take("inter", qc.shape)
    sums = ws.take("inter_sums", qc.shape)
    if doc is not None:
        _bmm(doc, h.transpose(-1, -2), inter, alpha=scale).mul_(dec.from_start)
        dq.add_(inter)
        dg.add_(span_sums("from", inter.mul_(qc), C, sums))
    _bmm(vc, dh.transpose(-1, -2), inter).mul_(dec.to_end)
    dk.add_(inter)
    dg.add_(span_sums("before", inter.mul_(kc), C, sums))
    dg.add_(_row_dot(h, dh, ws, "inter_states").mul_(dec.whole).unsqueeze(-2))


def unpack_gate_gradient(layout: Layout, dg, out) -> None:
    """Packed per-key dg into out: [B, T, H, K], or [B, T, H] (the sum over K) for a per-head gate."""
    if out.dim() == 3:
        tmp = torch.empty(out.shape + (dg.shape[-1],), dtype=dg.dtype, device=dg.device)
        layout.unpack_into(dg, tmp)
        out.copy_(tmp.sum(-1))
    else:
        layout.unpack_into(dg, out)


def _row_bytes(layout: Layout, H: int, K: int, V: int, dtype: torch.dtype, backward: bool) -> int:
    """Bytes of one packed chunk row's (H heads') scratch buffers inside a block: the forward's
    q, k, g, decays (2), one level's factors, products and diagonal (1.5) in [C, K], v and o in
    [C, V], A in [C, C]; the backward's q, k, g, decays (2), qw, dq, dk, dg, one level's factors
    and operands (2), intra temporaries (2.5), products, attention diagonal, dq/dk inter and their
    sums (3.5) in [C, K], v, do, dv in [C, V], A and dA in [C, C], dh and the state products in
    [K, V]."""
    C, esize = layout.C, torch.finfo(dtype).bits // 8
    if backward:
        return esize * H * (C * (17 * K + 3 * V + 2 * C) + 2 * K * V)
    # equal-length sequences: the scan's per-chunk states [K, V] too (_uniform_forward_scan)
    return esize * H * (C * (15 * K // 2 + 2 * V + C) + (K * V if uniform_scans(layout) else 0))


def _block_budget(device) -> int:
    """A block's working set: CPU_BLOCK_BYTES on the CPU, BLOCK_BYTES elsewhere."""
    return CPU_BLOCK_BYTES if torch.device(device).type == "cpu" else BLOCK_BYTES


_pools = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child has none of the parent's worker threads: it makes its own pools."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools_in_child)


def _single_threaded(barrier: threading.Barrier) -> None:
    # get_num_threads first: it runs the thread's one-time OpenMP setup, which otherwise runs at the
    # thread's first parallel op and re-applies the process-wide count (2 OpenMP threads per worker
    # on 2 cores: 1.6x the forward's process CPU time at T4096).
    torch.get_num_threads()
    torch.set_num_threads(1)
    barrier.wait()


def _cpu_workers(n: int) -> ThreadPoolExecutor:
    """n threads whose PyTorch ops run single-threaded (created once per n)."""
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            before = torch.get_num_threads()
            pool = ThreadPoolExecutor(n, thread_name_prefix="gla-torch")
            barrier = threading.Barrier(n)
            list(pool.map(lambda _: _single_threaded(barrier), range(n)))  # n threads start, each set to 1
            torch.set_num_threads(before)  # what threads created later inherit
            _pools[n] = pool
        return pool


def _by_heads(H: int, device, run) -> None:
    """run(heads) over slices of the H heads. On the CPU the slices go to torch.get_num_threads()
    worker threads whose ops are single-threaded: heads are independent, and one intra-op
    parallel region per small op cost ~4 ms of barrier wait on a loaded 2-core machine (400 ops on
    2 MiB tensors: 1.6 s with 2 intra-op threads, 82 ms as 2 single-threaded workers)."""
    n = min(H, torch.get_num_threads()) if torch.device(device).type == "cpu" else 1
    if n <= 1:
        run(slice(None))
        return

    def work(hs):
        with torch.no_grad():  # grad mode is per thread
            run(hs)

    per = -(-H // n)
    futures = [_cpu_workers(n).submit(work, slice(i, min(H, i + per))) for i in range(0, H, per)]
    for f in futures:
        f.result()


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
    _by_heads(H, q.device, lambda hs: _forward(
        layout, q[:, :, hs], k[:, :, hs], v[:, :, hs], g[:, :, hs], scale, h0[:, hs] if h0 is not None else None, cd,
        o_out[:, :, hs], final_kv[:, hs] if final_kv is not None else None))
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
    def part(hs):
        heads = lambda t: t[:, :, hs] if t is not None else None  # noqa: E731
        state = lambda t: t[:, hs] if t is not None else None  # noqa: E731
        _backward(layout, heads(q), heads(k), heads(v), heads(g), scale, state(h0), heads(do), state(dht), cd,
                  (heads(dq_out), heads(dk_out), heads(dv_out), heads(dg_out), state(dh0_kv)))
    _by_heads(H, q.device, part)
    return tuple(outs)
