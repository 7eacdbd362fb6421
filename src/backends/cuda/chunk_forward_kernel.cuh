// The single-role chunk kernel (sm_80+: mma.sync m16n8k16, ldmatrix, cp.async): the chunk forward
// for any 16-bit input with K <= 128 (fp32 per-key gate, K or V not a multiple of 8, unaligned
// rows); the warp-specialised kernel (chunk_forward_ws_kernel.cuh) takes the rest.
//
// One CTA owns (sequence segment, head, value tile [v0, v0 + BV), BV = DK) and walks its 64-token
// chunks in order with the transposed state S^T [BV x DK] in fp32 registers (warp w owns value rows
// 16w..16w+15). Per chunk, everything stays in shared memory:
//   1. cp.async brings q, k, v, g of the NEXT chunk into the other stage (double buffer).
//   2. Element-wise, one thread per (column pair, 16-row sub-chunk): local inclusive cumsum c of
//      g*log2(e) inside the sub-chunk, its total Tot_i, e = 2^{g log2 e}, qloc = q 2^{c},
//      kloc = k 2^{Tot - c}, and the pivot-level copies of the diagonal blocks (below). Every
//      exponent is <= 0.
//   3. A (64x64, bf16, zero above the diagonal), on tensor cores:
//        off-diagonal 16x16 blocks (i > j), pivoted at the last row of sub-chunk i-1:
//        A_ij = (qloc_i * 2^{sum_{j<l<i} Tot_l}) kloc_j^T -- factors all <= 1;
//        diagonal blocks by binary pivot levels (below), the diagonal itself from a reduction.
//   4. qg = qloc * 2^{sum_{l<i} Tot_l} (= q 2^{b}), kg = kloc * 2^{sum_{l>i} Tot_l} (= k 2^{b_last-b}).
//   5. o^T = S^T qg^T + V^T A^T (tensor cores), then S^T = S^T 2^{b_last} + V^T kg.
// Pass 1 (segment split) runs steps 1, 2 and 4 on the k side only and the state update from a zero
// state, and stores the segment's local state and total decay; pass 2 starts from the folded state.
#pragma once

#include "backends/cuda/chunk_layout.hpp"
#include "backends/cuda/chunk_tile_ops.cuh"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::detail {

// ---- the 16x16 diagonal blocks on tensor cores ----
//
// Within a sub-chunk, level L (half size h = 8, 4, 2, 1) cuts the 16 rows into blocks of 2h. Rows
// in a block's upper half are query members, scaled q_t * 2^{c_t - c_p}; rows in its lower half are
// key members, scaled k_s * 2^{c_p - c_s}; the pivot p is the lower half's last row, so every
// exponent is <= 0. Each pair s < t of a sub-chunk is split by exactly one level (the highest bit
// in which t and s differ), where A[t,s] = copy_t . copy_s. The factors are running products of
// e = 2^{g log2 e} (no exp per element beyond e). Pairs t = s are q_t . k_t, summed exactly.

template <typename X>
__device__ __forceinline__ uint16_t* level_copy(int level, uint16_t* qs, uint16_t* ks, unsigned char* gs,
                                                unsigned char* smem, const ChunkSmem& L, bool per_head,
                                                int gate_bytes) {
  if (level == 0) return qs;
  if (level == 1) return ks;
  if (level == 2) return per_head ? reinterpret_cast<uint16_t*>(smem + L.extra0) : reinterpret_cast<uint16_t*>(gs);
  if (per_head) return reinterpret_cast<uint16_t*>(smem + L.extra1);
  if (gate_bytes == 4) return reinterpret_cast<uint16_t*>(gs + kChunk * L.pq * 2);
  return reinterpret_cast<uint16_t*>(smem + L.extra0);
}

// qloc_t = q_t prod_{u<=t} e_u = q_t 2^{c_t};  kloc_t = k_t prod_{u>t} e_u = k_t 2^{Tot - c_t}: one
// column pair of sub-chunk `sub` (its 16 rows of q, k and e in registers).
template <typename X>
__device__ __forceinline__ void write_local_copies(uint16_t* qw, uint16_t* kw, int pq, int sub, int k0,
                                                   const uint32_t (&qv)[16], const uint32_t (&kv)[16],
                                                   const float (&e0)[16], const float (&e1)[16]) {
  float f0 = 1.f, f1 = 1.f;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    f0 *= e0[r];
    f1 *= e1[r];
    const float2 q = X::to_float2(qv[r]);
    *reinterpret_cast<uint32_t*>(qw + (sub * 16 + r) * pq + k0) = X::pack(q.x * f0, q.y * f1);
  }
  f0 = f1 = 1.f;
#pragma unroll
  for (int r = 15; r >= 0; --r) {
    const float2 k = X::to_float2(kv[r]);
    *reinterpret_cast<uint32_t*>(kw + (sub * 16 + r) * pq + k0) = X::pack(k.x * f0, k.y * f1);
    f0 *= e0[r];
    f1 *= e1[r];
  }
}

// One element-wise item without the level copies (thread tid: column pair, sub-chunk): the factors
// e (returned), the sub-chunk totals, qloc and kloc (the key split's passes, the intra kernel).
template <int DK, typename X>
__device__ __forceinline__ void local_copies_item(const ChunkSmem& L, int tid, const uint16_t* qs, const uint16_t* ks,
                                                  const unsigned char* gs, uint16_t* qw, uint16_t* kw, float* tot,
                                                  bool per_head, int gate_bytes, float (&e0)[16], float (&e1)[16]) {
  const int cp = tid % (DK / 2), sub = tid / (DK / 2), k0 = cp * 2;
  uint32_t qv[16], kv[16];
  float a0, a1;
  sub_chunk_gates<X>(gs, sub, k0, L.pg, per_head, gate_bytes, e0, e1, a0, a1, [&](int r, int t) {
    qv[r] = *reinterpret_cast<const uint32_t*>(qs + t * L.pq + k0);
    kv[r] = *reinterpret_cast<const uint32_t*>(ks + t * L.pq + k0);
  });
  tot[sub * DK + k0] = a0;
  tot[sub * DK + k0 + 1] = a1;
  write_local_copies<X>(qw, kw, L.pq, sub, k0, qv, kv, e0, e1);
}

// One item per thread: (column pair cp, sub-chunk sub). Reads q, k, g first, then (after a barrier,
// since the level copies overwrite the raw buffers) writes qloc, kloc, the four level copies and
// the q_t . k_t partials.
template <int DK, typename X>
__device__ __forceinline__ void mma_diag_elementwise(const ForwardParams& p, const ChunkSmem& L, int tid, int lane,
                                                     int warp, uint16_t* qs, uint16_t* ks, unsigned char* gs,
                                                     uint16_t* qw, uint16_t* kw, float* tot, unsigned char* smem) {
  const bool per_head = p.gate_per_head != 0;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const int cp = tid % (DK / 2), sub = tid / (DK / 2), k0 = cp * 2;
  uint32_t qv[16], kv[16];
  float e0[16], e1[16];
  float a0, a1;
  const int pq = L.pq;
  sub_chunk_gates<X>(gs, sub, k0, L.pg, per_head, gate_bytes, e0, e1, a0, a1, [&](int r, int t) {
    qv[r] = *reinterpret_cast<const uint32_t*>(qs + t * pq + k0);
    kv[r] = *reinterpret_cast<const uint32_t*>(ks + t * pq + k0);
  });
  tot[sub * DK + k0] = a0;
  tot[sub * DK + k0 + 1] = a1;
  // q_t . k_t over this column pair, reduced over the sub-chunk's DK/2 threads below.
  float dg[16];
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const float2 q = X::to_float2(qv[r]), k = X::to_float2(kv[r]);
    dg[r] = q.x * k.x + q.y * k.y;
  }
  __syncthreads();  // every raw read is done: the copies may overwrite q, k, g now

  write_local_copies<X>(qw, kw, L.pq, sub, k0, qv, kv, e0, e1);
  // Level copies (half sizes 8, 4, 2, 1 as template arguments, so every index is a constant).
  write_level_block<8, 16, X>(level_copy<X>(0, qs, ks, gs, smem, L, per_head, gate_bytes) + sub * 16 * L.pq + k0, L.pq, qv, kv, e0, e1);
  write_level_block<4, 16, X>(level_copy<X>(1, qs, ks, gs, smem, L, per_head, gate_bytes) + sub * 16 * L.pq + k0, L.pq, qv, kv, e0, e1);
  write_level_block<2, 16, X>(level_copy<X>(2, qs, ks, gs, smem, L, per_head, gate_bytes) + sub * 16 * L.pq + k0, L.pq, qv, kv, e0, e1);
  write_level_block<1, 16, X>(level_copy<X>(3, qs, ks, gs, smem, L, per_head, gate_bytes) + sub * 16 * L.pq + k0, L.pq, qv, kv, e0, e1);
  // Reduce dg over the warp: half-exchange (lanes 0-15 keep rows 0-7, 16-31 rows 8-15), then a
  // butterfly over 16 lanes. Fixed order: deterministic.
  const bool upper = (lane & 16) != 0;
  float hv[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float send = upper ? dg[i] : dg[i + 8];
    const float keep = upper ? dg[i + 8] : dg[i];
    hv[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
#pragma unroll
    for (int o = 8; o >= 1; o >>= 1) hv[i] += __shfl_xor_sync(0xffffffffu, hv[i], o);
  }
  float* dpart = reinterpret_cast<float*>(smem + L.dpart);
  if ((lane & 15) == 0) {
#pragma unroll
    for (int i = 0; i < 8; ++i) dpart[warp * 16 + (upper ? 8 : 0) + i] = hv[i];
  }
}

// The level products on tensor cores (16 tasks: sub-chunk x level) and the diagonal entries.
template <int DK, int NW, typename X>
__device__ __forceinline__ void mma_diag_levels(const ChunkSmem& L, int tid, int lane, int warp, uint16_t* qs,
                                                uint16_t* ks, unsigned char* gs, uint16_t* As, unsigned char* smem,
                                                bool per_head, int gate_bytes) {
  for (int task = warp; task < 16; task += NW) {
    const int sub = task >> 2, level = task & 3;
    level_block_at<DK, X>(As, L.pa, level_copy<X>(level, qs, ks, gs, smem, L, per_head, gate_bytes), L.pq, sub,
                          level, lane);
  }
  // A[t,t] = q_t . k_t: the partials of the sub-chunk's warps (DK/2 threads: one or two warps).
  const float* dpart = reinterpret_cast<const float*>(smem + L.dpart);
  if (tid < kChunk) {
    const int t = tid, sub = t >> 4, r = t & 15;
    constexpr int kWarpsPerSub = DK / 64;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerSub; ++w) sum += dpart[(sub * kWarpsPerSub + w) * 16 + r];
    As[t * L.pa + t] = X::from_float(sum);
  }
}

template <int DK, typename E>
__global__ void __launch_bounds__(DK * 2, 1)
chunk_forward_kernel(const __grid_constant__ ForwardParams p, const __grid_constant__ SegmentArgs sa) {
  using X = Elem<E>;
  constexpr int BV = DK;  // one element-wise item (column pair, sub-chunk) per thread
  constexpr int NW = BV / 16;
  constexpr int NT = NW * 32;
  constexpr int NKT = DK / 8;  // n8 tiles of the state along K
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = blockIdx.x / sa.max_segments;
  const int64_t m = blockIdx.x % sa.max_segments;
  const int64_t h = blockIdx.y / sa.value_tiles;
  const int vt = blockIdx.y % sa.value_tiles;
  const int64_t v0 = int64_t(vt) * BV;
  const bool full = sa.pass == 2;
  // The full pass forms A itself, except in a key split (ForwardParams::key_half): the first half
  // leaves A zero (o = q S of its keys), the second reads A over all keys from p.intra.
  const bool own_a = full && p.key_half == 0;

  const SeqSpan seq = sequence_span(p, n);
  const int64_t nchunks = (seq.len + kChunk - 1) / kChunk;
  const int64_t seg_len = sequence_segment_chunks(sa.segment_chunks, sa.whole_chunks, nchunks);
  const int64_t nseg = sequence_segments(sa.segment_chunks, sa.whole_chunks, nchunks);
  if (m >= nseg) return;
  if (!full && m >= nseg - 1) return;  // pass 1: the last segment needs no local state
  const int64_t c_begin = m * seg_len;
  const int64_t c_end = gla_min64(nchunks, c_begin + seg_len);
  const int64_t seg_index = (n * sa.max_segments + m) * p.H + h;

  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const bool per_head = p.gate_per_head != 0;
  const ChunkSmem L = chunk_smem_layout(DK, BV, gate_bytes, per_head);
  uint16_t* qw = reinterpret_cast<uint16_t*>(smem + L.qw);
  uint16_t* kw = reinterpret_cast<uint16_t*>(smem + L.kw);
  uint16_t* As = reinterpret_cast<uint16_t*>(smem + L.a);
  float* tot = reinterpret_cast<float*>(smem + L.tot);
  float* dfac = reinterpret_cast<float*>(smem + L.dfac);
  float* dsum = reinterpret_cast<float*>(smem + L.dsum);

  // Zero A once: blocks above the diagonal and the strict upper part of the diagonal blocks beyond
  // each warp's row group are never written again. dsum starts at 0.
  for (int i = tid; i < kChunk * L.pa / 2; i += NT) reinterpret_cast<uint32_t*>(As)[i] = 0u;
  for (int i = tid; i < DK; i += NT) dsum[i] = 0.f;

  // ---- loads of one chunk into a stage ----
  const int64_t esz = 2;  // signed: time strides may be negative (the backward runs the forward reversed)
  auto issue_loads = [&](int64_t chunk, int stage) {
    unsigned char* st = smem + stage * L.stage_bytes;
    const int64_t t0 = seq.bos + chunk * kChunk;
    const int rows = static_cast<int>(gla_min64(kChunk, seq.len - chunk * kChunk));
    const char* qb = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + t0 * p.q_stride[1] + h * p.q_stride[2]) * esz;
    const char* kb = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + t0 * p.k_stride[1] + h * p.k_stride[2]) * esz;
    const char* vb = static_cast<const char*>(p.v) + (seq.batch * p.v_stride[0] + t0 * p.v_stride[1] + h * p.v_stride[2] + v0) * esz;
    // ForwardParams::gate_lag: token t's gate is row t - 1, the sequence's first token's is 0.
    const char* gb = static_cast<const char*>(p.g) + (seq.batch * p.g_stride[0] + (t0 - p.gate_lag) * p.g_stride[1] + h * p.g_stride[2]) * gate_bytes;
    const int gate_row0 = p.gate_lag && chunk == 0 ? 1 : 0;  // rows below it read gate 0
    if (p.vector_loads) {
      constexpr int CPR = DK / 8;  // 16-byte pieces per q/k row
      for (int i = tid; i < kChunk * CPR; i += NT) {
        const int r = i / CPR, c = i % CPR;
        const bool ok = r < rows && c * 8 < p.K;
        if (full) cp_async16(st + L.q + (r * L.pq + c * 8) * 2, ok ? qb + (r * p.q_stride[1] + c * 8) * esz : qb, ok);
        cp_async16(st + L.k + (r * L.pq + c * 8) * 2, ok ? kb + (r * p.k_stride[1] + c * 8) * esz : kb, ok);
      }
      constexpr int VPR = BV / 8;
      for (int i = tid; i < kChunk * VPR; i += NT) {
        const int r = i / VPR, c = i % VPR;
        const bool ok = r < rows && v0 + c * 8 < p.V;
        cp_async16(st + L.v + (r * L.pv + c * 8) * 2, ok ? vb + (r * p.v_stride[1] + c * 8) * esz : vb, ok);
      }
      if (!per_head) {
        const int gpr = DK * gate_bytes / 16;
        const int gper = 16 / gate_bytes;
        for (int i = tid; i < kChunk * gpr; i += NT) {
          const int r = i / gpr, c = i % gpr;
          const bool ok = r < rows && r >= gate_row0 && c * gper < p.K;
          cp_async16(st + L.g + (r * L.pg + c * gper) * gate_bytes,
                     ok ? gb + (r * p.g_stride[1] + c * gper) * gate_bytes : p.g, ok);
        }
      }
    } else {
      // Element-wise path for K or V that are not multiples of 8 or unaligned rows: synchronous.
      for (int i = tid; i < kChunk * DK; i += NT) {
        const int r = i / DK, c = i % DK;
        const bool ok = r < rows && c < p.K;
        uint16_t* qd = reinterpret_cast<uint16_t*>(st + L.q) + r * L.pq + c;
        uint16_t* kd = reinterpret_cast<uint16_t*>(st + L.k) + r * L.pq + c;
        if (full) *qd = ok ? reinterpret_cast<const uint16_t*>(qb)[r * p.q_stride[1] + c] : uint16_t(0);
        *kd = ok ? reinterpret_cast<const uint16_t*>(kb)[r * p.k_stride[1] + c] : uint16_t(0);
        if (!per_head) {
          const bool gate_ok = ok && r >= gate_row0;
          if (gate_bytes == 4) {
            reinterpret_cast<float*>(st + L.g)[r * L.pg + c] = gate_ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1] + c] : 0.f;
          } else {
            reinterpret_cast<uint16_t*>(st + L.g)[r * L.pg + c] = gate_ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1] + c] : uint16_t(0);
          }
        }
      }
      for (int i = tid; i < kChunk * BV; i += NT) {
        const int r = i / BV, c = i % BV;
        const bool ok = r < rows && v0 + c < p.V;
        reinterpret_cast<uint16_t*>(st + L.v)[r * L.pv + c] = ok ? reinterpret_cast<const uint16_t*>(vb)[r * p.v_stride[1] + c] : uint16_t(0);
      }
    }
    if (per_head) {
      for (int r = tid; r < kChunk; r += NT) {
        const bool ok = r < rows && r >= gate_row0;
        if (gate_bytes == 4) {
          reinterpret_cast<float*>(st + L.g)[r] = ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1]] : 0.f;
        } else {
          reinterpret_cast<uint16_t*>(st + L.g)[r] = ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1]] : uint16_t(0);
        }
      }
    }
    cp_async_commit();
  };

  // ---- initial state into registers: S[j][0..3] = C fragment of n8 tile j of S^T ----
  const int fr = lane >> 2, fc = (lane & 3) * 2;  // fragment row / column
  const int vrow = warp * 16;                      // this warp's value rows inside the tile
  float S[NKT][4];
  load_initial_state<DK, BV>(S, p, sa, full, n, m, h, v0, vrow, lane);

  if (c_begin < c_end) issue_loads(c_begin, 0);

  for (int64_t c = c_begin; c < c_end; ++c) {
    const int stage = static_cast<int>((c - c_begin) & 1);
    unsigned char* st = smem + stage * L.stage_bytes;
    uint16_t* qs = reinterpret_cast<uint16_t*>(st + L.q);
    uint16_t* ks = reinterpret_cast<uint16_t*>(st + L.k);
    uint16_t* vs = reinterpret_cast<uint16_t*>(st + L.v);
    unsigned char* gs = st + L.g;
    const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk));

    cp_async_wait_all();
    __syncthreads();
    if (c + 1 < c_end) issue_loads(c + 1, stage ^ 1);

    // ---- 2. element-wise: cumsum, e, qloc, kloc (the full pass also writes the level copies;
    // pass 1 needs kloc and the totals only) ----
    if (own_a) mma_diag_elementwise<DK, X>(p, L, tid, lane, warp, qs, ks, gs, qw, kw, tot, smem);
    if (full && !own_a) {
      float e0[16], e1[16];
      local_copies_item<DK, X>(L, tid, qs, ks, gs, qw, kw, tot, per_head, gate_bytes, e0, e1);
    }
    // kloc_t = k_t prod_{u>t} e_u as a running product from the sub-chunk's end, as the full pass
    // forms it: a difference of cumulative gates (Tot - c_t) is -inf - (-inf) = NaN after a hard
    // reset (g = -inf), a product of factors e_u = 2^{g_u} is 0 there.
    for (int item = tid; item < (DK / 2) * 4 && !full; item += NT) {
      const int cp = item % (DK / 2), sub = item / (DK / 2);
      const int k0 = cp * 2;
      float e0[16], e1[16];
      float a0, a1;
      sub_chunk_gates<X>(gs, sub, k0, L.pg, per_head, gate_bytes, e0, e1, a0, a1, [](int, int) {});
      tot[sub * DK + k0] = a0;
      tot[sub * DK + k0 + 1] = a1;
      float f0 = 1.f, f1 = 1.f;
#pragma unroll
      for (int r = 15; r >= 0; --r) {
        const int t = sub * 16 + r;
        const float2 kv = X::to_float2(*reinterpret_cast<uint32_t*>(ks + t * L.pq + k0));
        *reinterpret_cast<uint32_t*>(kw + t * L.pq + k0) = X::pack(kv.x * f0, kv.y * f1);
        f0 *= e0[r];
        f1 *= e1[r];
      }
    }
    __syncthreads();

    // ---- 3. the intra-chunk matrix A ----
    if (full && p.key_half == 2) {
      const uint16_t* src = p.intra + ((seq.batch * p.T + seq.bos + c * kChunk) * p.H + h) * kChunk;
      for (int i = tid; i < kChunk * 8; i += NT) {
        const int r = i >> 3;
        *reinterpret_cast<uint4*>(As + r * L.pa + (i & 7) * 8) =
            r < rows ? *reinterpret_cast<const uint4*>(src + int64_t(r) * p.H * kChunk + (i & 7) * 8) : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (own_a) {
      // Off-diagonal blocks (i, j), i > j, on tensor cores.
      constexpr int kBlocks = 6;
      for (int blk = warp; blk < kBlocks; blk += NW) {
        // Blocks (i, j): (1,0) (2,1) (3,2) (2,0) (3,1) (3,0), packed as nibbles (no local array).
        offdiag_block<DK, X>(As, L.pa, qw, kw, L.pq, tot, (0x332321 >> (4 * blk)) & 15, (0x010210 >> (4 * blk)) & 15,
                             lane);
      }

      mma_diag_levels<DK, NW, X>(L, tid, lane, warp, qs, ks, gs, As, smem, p.gate_per_head != 0, gate_bytes);
    }
    __syncthreads();

    // ---- 4. qg = qloc 2^{Pre_i}, kg = kloc 2^{Post_i}; the chunk's decay 2^{b_last} ----
    for (int item = tid; item < (DK / 2) * 4; item += NT) {
      const int cp = item % (DK / 2), sub = item / (DK / 2);
      const int k0 = cp * 2;
      float pre0, pre1, post0, post1;
      sub_chunk_pre_post<DK>(tot, sub, k0, pre0, pre1, post0, post1);
      if (sub == 0) {
        const float d0 = post0 + tot[k0], d1 = post1 + tot[k0 + 1];
        dfac[k0] = fast_exp2(d0);
        dfac[k0 + 1] = fast_exp2(d1);
        if (!full) {
          dsum[k0] += d0;
          dsum[k0 + 1] += d1;
        }
      }
      const float fq0 = fast_exp2(pre0), fq1 = fast_exp2(pre1);
      const float fk0 = fast_exp2(post0), fk1 = fast_exp2(post1);
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int t = sub * 16 + r;
        if (full && sub > 0) {
          uint32_t* qp = reinterpret_cast<uint32_t*>(qw + t * L.pq + k0);
          float2 x = X::to_float2(*qp);
          *qp = X::pack(x.x * fq0, x.y * fq1);
        }
        if (sub < 3) {
          uint32_t* kp = reinterpret_cast<uint32_t*>(kw + t * L.pq + k0);
          float2 x = X::to_float2(*kp);
          *kp = X::pack(x.x * fk0, x.y * fk1);
        }
      }
    }
    __syncthreads();

    // ---- 5. tensor-core phase: o^T = S^T qg^T + V^T A^T ; S^T = S^T 2^{b_last} + V^T kg ----
    uint32_t vf[4][4];
    load_v_fragments(vf, vs, L.pv, vrow, lane);
    if (full) {
      float acc[8][4] = {};
      o_tile<DK, X>(acc, S, vf, qw, L.pq, As, L.pa, lane);
      // o^T -> shared (over this stage's q, dead now) as [t][v].
      const float sc = p.scale;
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int t = nt * 8 + fc;
        const int vv = vrow + fr;
        qs[t * L.pq + vv] = X::from_float(acc[nt][0] * sc);
        qs[(t + 1) * L.pq + vv] = X::from_float(acc[nt][1] * sc);
        qs[t * L.pq + vv + 8] = X::from_float(acc[nt][2] * sc);
        qs[(t + 1) * L.pq + vv + 8] = X::from_float(acc[nt][3] * sc);
      }
    }
    if (full && p.chunk_states != nullptr) store_chunk_state<DK>(S, p, n, seq.bos, c, h, v0, vrow, lane);
    state_update<DK, X>(S, vf, kw, L.pq, dfac, lane);
    if (full) {
      __syncthreads();
      // o rows of this chunk: shared -> global.
      const int64_t t0 = seq.bos + c * kChunk;
      char* ob = static_cast<char*>(p.o) + (seq.batch * p.o_stride[0] + t0 * p.o_stride[1] + h * p.o_stride[2] + v0) * esz;
      if (p.vector_loads) {
        constexpr int VPR = BV / 8;
        for (int i = tid; i < kChunk * VPR; i += NT) {
          const int r = i / VPR, cc = i % VPR;
          if (r < rows && v0 + cc * 8 < p.V) {
            *reinterpret_cast<uint4*>(ob + (r * p.o_stride[1] + cc * 8) * esz) =
                *reinterpret_cast<const uint4*>(qs + r * L.pq + cc * 8);
          }
        }
      } else {
        for (int i = tid; i < kChunk * BV; i += NT) {
          const int r = i / BV, cc = i % BV;
          if (r < rows && v0 + cc < p.V) {
            reinterpret_cast<uint16_t*>(ob)[r * p.o_stride[1] + cc] = qs[r * L.pq + cc];
          }
        }
      }
    }
  }

  // ---- the state out ----
  if (full) {
    if (m == nseg - 1 && p.final_state != nullptr) store_final_state<DK>(S, p, n, h, v0, vrow, lane);
  } else {
    store_segment_state<DK, BV>(S, sa, seg_index, v0, vrow, lane);
    if (vt == 0) {
      __syncthreads();
      for (int i = tid; i < DK; i += NT) sa.seg_decay[seg_index * DK + i] = dsum[i];
    }
  }
}

}  // namespace gla::cuda::detail
