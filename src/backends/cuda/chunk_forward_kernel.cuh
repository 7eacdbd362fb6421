// The chunked forward on tensor cores (sm_80+: mma.sync m16n8k16, ldmatrix, cp.async).
//
// One CTA owns (sequence segment, head, value tile [v0, v0 + BV)) and walks its 64-token chunks in
// order with the transposed state S^T [BV x DK] in fp32 registers (warp w owns value rows 16w..16w+15).
// Per chunk, everything stays in shared memory:
//   1. cp.async brings q, k, v, g of the NEXT chunk into the other stage (double buffer).
//   2. Element-wise, one thread per (column pair, 16-row sub-chunk): local inclusive cumsum c of
//      g*log2(e) inside the sub-chunk, its total Tot_i, e = 2^{g log2 e} (in place of g, for the
//      diagonal blocks), qloc = q 2^{c}, kloc = k 2^{Tot - c}. Every exponent is <= 0.
//   3. A (64x64, bf16, zero above the diagonal):
//        off-diagonal 16x16 blocks (i > j) on tensor cores, pivoted at the last row of sub-chunk
//        i-1: A_ij = (qloc_i * 2^{sum_{j<l<i} Tot_l}) kloc_j^T -- factors all <= 1;
//        diagonal blocks element-wise with running products of e (no exp per pair, no 0*inf).
//   4. qg = qloc * 2^{sum_{l<i} Tot_l} (= q 2^{b}), kg = kloc * 2^{sum_{l>i} Tot_l} (= k 2^{b_last-b}).
//   5. o^T = S^T qg^T + V^T A^T (tensor cores), then S^T = S^T 2^{b_last} + V^T kg.
// Pass 1 (segment split) runs steps 1, 2, 4 (k side) and the state update from a zero state and
// stores the segment's local state and total decay; pass 2 starts from the folded state.
#pragma once

#include "backends/cuda/chunk_layout.hpp"
#include "backends/cuda/device_utils.cuh"
#include "backends/cuda/wgmma.cuh"

namespace gla::cuda::detail {

// ---- MMA-diagonal variant (MMA_DIAG): the 16x16 diagonal blocks on tensor cores ----
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

// Level copies of N rows (a 16-row sub-chunk, or 8 rows of a split item), `base` = the first row
// at this thread's column pair: blocks of 2H rows starting at multiples of 2H; key members
// k_r prod_{u=r+1..piv} e_u, query members q_r prod_{u=piv+1..r} e_u.
template <int H, int N, typename X>
__device__ __forceinline__ void write_level_block(uint16_t* base, int pq, const uint32_t (&qv)[N],
                                                  const uint32_t (&kv)[N], const float (&e0)[N], const float (&e1)[N]) {
#pragma unroll
  for (int b0 = 0; b0 < N; b0 += 2 * H) {
    const int piv = b0 + H - 1;
    float f0 = 1.f, f1 = 1.f;
#pragma unroll
    for (int r = piv; r >= b0; --r) {
      const float2 k = X::to_float2(kv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(k.x * f0, k.y * f1);
      f0 *= e0[r];
      f1 *= e1[r];
    }
    f0 = f1 = 1.f;
#pragma unroll
    for (int r = piv + 1; r < b0 + 2 * H; ++r) {
      f0 *= e0[r];
      f1 *= e1[r];
      const float2 q = X::to_float2(qv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(q.x * f0, q.y * f1);
    }
  }
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
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int t = sub * 16 + r;
    float g0, g1;
    if (per_head) {
      g0 = g1 = gate_bytes == 4 ? reinterpret_cast<const float*>(gs)[t]
                                : X::to_float(reinterpret_cast<const uint16_t*>(gs)[t]);
    } else if (gate_bytes == 4) {
      const float2 gv = *reinterpret_cast<const float2*>(gs + (t * L.pg + k0) * 4);
      g0 = gv.x;
      g1 = gv.y;
    } else {
      const float2 gv = X::to_float2(*reinterpret_cast<const uint32_t*>(gs + (t * L.pg + k0) * 2));
      g0 = gv.x;
      g1 = gv.y;
    }
    g0 *= kLog2e;
    g1 *= kLog2e;
    a0 += g0;
    a1 += g1;
    e0[r] = fast_exp2(g0);
    e1[r] = fast_exp2(g1);
    qv[r] = *reinterpret_cast<const uint32_t*>(qs + t * L.pq + k0);
    kv[r] = *reinterpret_cast<const uint32_t*>(ks + t * L.pq + k0);
  }
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

  // qloc_t = q_t prod_{u<=t} e_u = q_t 2^{c_t};  kloc_t = k_t prod_{u>t} e_u = k_t 2^{Tot - c_t}.
  {
    float f0 = 1.f, f1 = 1.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      f0 *= e0[r];
      f1 *= e1[r];
      const float2 q = X::to_float2(qv[r]);
      *reinterpret_cast<uint32_t*>(qw + (sub * 16 + r) * L.pq + k0) = X::pack(q.x * f0, q.y * f1);
    }
    f0 = f1 = 1.f;
#pragma unroll
    for (int r = 15; r >= 0; --r) {
      const float2 k = X::to_float2(kv[r]);
      *reinterpret_cast<uint32_t*>(kw + (sub * 16 + r) * L.pq + k0) = X::pack(k.x * f0, k.y * f1);
      f0 *= e0[r];
      f1 *= e1[r];
    }
  }
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

// ---- pieces shared by the single-role and the warp-specialised kernel ----

// Calls f(j, e, vv, kk) for each entry S[j][e] of this warp's S^T fragments (C fragments of n8
// tiles j): value row vv of the tile (vrow..vrow+15) and key kk.
template <int DK, typename F>
__device__ __forceinline__ void for_each_state_entry(int vrow, int lane, F&& f) {
  const int fr = lane >> 2, fc = fc_of(lane);
#pragma unroll
  for (int j = 0; j < DK / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, vrow + fr + (e >> 1) * 8, j * 8 + fc + (e & 1));
  }
}

// Initial S^T fragments of this warp's value rows vrow..vrow+15 (C fragment of n8 tile j: S[j][e]):
// the caller's initial state (full pass only) with the local states of the earlier segments folded
// in (S = 2^{d_s} S + S_loc_s, written by pass 1).
template <int DK, int BV>
__device__ __forceinline__ void load_initial_state(float (&S)[DK / 8][4], const ForwardParams& p, const SegmentArgs& sa,
                                                   bool full, int64_t n, int64_t m, int64_t h, int64_t v0, int vrow,
                                                   int lane) {
  const bool have_h0 = full && p.initial_state != nullptr;
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    float x = 0.f;
    if (have_h0 && kk < p.K && v0 + vv < p.V) {
      x = p.initial_state[state_index(p.h0_stride, p.state_v_first, n, h, kk, v0 + vv)];
    }
    S[j][e] = x;
  });
  if (!full) return;
  // Segments outer, entries inner: the other nesting put a run-time loop inside each of the
  // DK/2 unrolled entries, ~20 k SASS instructions that every CTA's state group walked through at
  // its start (12% of the B32 T1024 kernel's samples were instruction-fetch stalls there). Each
  // entry sees the same operations in the same order either way.
#pragma unroll 1
  for (int64_t s = 0; s < m; ++s) {
    const int64_t si = (n * sa.max_segments + s) * p.H + h;
    const float* dec = sa.seg_decay + si * DK;
    const float* loc = sa.seg_states + (si * (int64_t(sa.value_tiles) * BV) + v0) * DK;
    for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
      S[j][e] = fast_exp2(dec[kk]) * S[j][e] + loc[int64_t(vv) * DK + kk];
    });
  }
}

// The caller's final state from this warp's S^T fragments (entries beyond K or V skipped).
template <int DK>
__device__ __forceinline__ void store_final_state(const float (&S)[DK / 8][4], const ForwardParams& p, int64_t n,
                                                  int64_t h, int64_t v0, int vrow, int lane) {
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    if (kk < p.K && v0 + vv < p.V) {
      p.final_state[state_index(p.ht_stride, p.state_v_first, n, h, kk, v0 + vv)] = S[j][e];
    }
  });
}

// Pass 1's output: this warp's S^T fragments as the segment's local state (seg_index = (sequence,
// segment, head)), every entry of the padded tile (pass 2 reads them all).
template <int DK, int BV>
__device__ __forceinline__ void store_segment_state(const float (&S)[DK / 8][4], const SegmentArgs& sa,
                                                    int64_t seg_index, int64_t v0, int vrow, int lane) {
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    sa.seg_states[(seg_index * (int64_t(sa.value_tiles) * BV) + v0 + vv) * DK + kk] = S[j][e];
  });
}

// A's off-diagonal 16x16 block (i, j), i > j, on tensor cores, pivoted at the last row of
// sub-chunk i-1: A_ij = (qloc_i 2^{sum_{j<l<i} Tot_l}) kloc_j^T, every factor <= 1.
// TABLE: the factors of the far blocks come from ofac (three rows of DK: 2^{Tot_1}, 2^{Tot_2},
// 2^{Tot_1 + Tot_2}, written once per chunk by the warp-specialised kernel's write phase) instead
// of exp2 per k-step here.
// SWZ: qw, kw and A in the 128-byte-swizzled layout (sw128_off; the ws-wgmma variant) instead of
// padded rows of pitch pq / pa.
template <int DK, typename X, bool TABLE = false, bool SWZ = false>
__device__ __forceinline__ void offdiag_block(uint16_t* As, int pa, const uint16_t* qw, const uint16_t* kw, int pq,
                                              const float* tot, int i, int j, int lane, const float* ofac = nullptr) {
  auto qo = [&](int r, int c) { return SWZ ? sw128_off(r, c) : r * pq + c; };
  auto ao = [&](int r, int c) { return SWZ ? sw128_off(r, c) : r * pa + c; };
  const int mi = lane >> 3, fr = lane >> 2, fc = fc_of(lane);
  // Even and odd k-steps accumulate separately: four independent mma chains instead of two.
  float acc[2][2][4] = {};
  const int arow = i * 16 + (lane & 7) + (mi & 1) * 8, acol = (mi >> 1) * 8;
  const int brow = j * 16 + (lane & 7) + (mi >> 1) * 8, bcol = (mi & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    uint32_t a[4], b[4];
    ldsm_x4(a, qw + qo(arow, kk * 16 + acol));
    ldsm_x4(b, kw + qo(brow, kk * 16 + bcol));
    if (i - j > 1) {
      // Fold 2^{sum_{j<l<i} Tot_l} (<= 1) into the query fragment. i - j is 2 or 3: one or two
      // totals, written out (a run-time loop here unrolled into ~3 k SASS instructions of branchy code).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int kcol = kk * 16 + half * 8 + fc;
        float f0, f1;
        if constexpr (TABLE) {
          const float2 f = *reinterpret_cast<const float2*>(ofac + (i - j > 2 ? 2 : j) * DK + kcol);
          f0 = f.x;
          f1 = f.y;
        } else {
          f0 = tot[(j + 1) * DK + kcol];
          f1 = tot[(j + 1) * DK + kcol + 1];
          if (i - j > 2) {
            f0 += tot[(j + 2) * DK + kcol];
            f1 += tot[(j + 2) * DK + kcol + 1];
          }
          f0 = fast_exp2(f0);
          f1 = fast_exp2(f1);
        }
        const float2 x0 = X::to_float2(a[half * 2]), x1 = X::to_float2(a[half * 2 + 1]);
        a[half * 2] = X::pack(x0.x * f0, x0.y * f1);
        a[half * 2 + 1] = X::pack(x1.x * f0, x1.y * f1);
      }
    }
    X::mma(acc[kk & 1][0], a, b[0], b[1]);
    X::mma(acc[kk & 1][1], a, b[2], b[3]);
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int row = i * 16 + fr, col = j * 16 + nt * 8 + fc;
    float r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = acc[0][nt][e] + acc[1][nt][e];
    *reinterpret_cast<uint32_t*>(As + ao(row, col)) = X::pack(r[0], r[1]);
    *reinterpret_cast<uint32_t*>(As + ao(row + 8, col)) = X::pack(r[2], r[3]);
  }
}

// One pivot level's products inside sub-chunk `sub` (level copy `src`, half size H): one m16n8 tile
// per k-step pair with the 8 key members gathered by per-lane ldmatrix addresses; the entries whose
// pair this level splits go to A, the cross terms (finite) are dropped by the select. H is a
// template parameter: with a run-time H every index below was an integer division.
template <int DK, int H, typename X, bool SWZ = false>
__device__ __forceinline__ void level_block(uint16_t* As, int pa, const uint16_t* src, int pq, int sub, int lane) {
  const int mi = lane >> 3, fr = lane >> 2, fc = fc_of(lane);
  const int jb = lane & 7;
  const int key_row = sub * 16 + (jb / H) * 2 * H + (jb % H);  // gathered key member
  const int arow = sub * 16 + (lane & 7) + (mi & 1) * 8, acol = (mi >> 1) * 8;
  // Two independent mma chains (even and odd k-steps), summed at the end.
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < DK / 16; kk += 2) {
    uint32_t a0[4], a1[4], b[4];
    ldsm_x4(a0, src + arow * pq + kk * 16 + acol);
    ldsm_x4(a1, src + arow * pq + (kk + 1) * 16 + acol);
    ldsm_x4(b, src + key_row * pq + kk * 16 + mi * 8);
    X::mma(acc, a0, b[0], b[1]);
    X::mma(acc1, a1, b[2], b[3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += acc1[e];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = fr + (e >> 1) * 8, j = fc + (e & 1);
    const int s = (j / H) * 2 * H + (j % H);
    if (t / (2 * H) == j / H && (t % (2 * H)) >= H) {
      As[SWZ ? sw128_off(sub * 16 + t, sub * 16 + s) : (sub * 16 + t) * pa + sub * 16 + s] = X::from_float(acc[e]);
    }
  }
}

// level_block for a run-time level (0..3: H = 8, 4, 2, 1), one compiled body per level.
template <int DK, typename X, bool SWZ = false>
__device__ __forceinline__ void level_block_at(uint16_t* As, int pa, const uint16_t* src, int pq, int sub, int level,
                                               int lane) {
  switch (level) {
    case 0: level_block<DK, 8, X, SWZ>(As, pa, src, pq, sub, lane); break;
    case 1: level_block<DK, 4, X, SWZ>(As, pa, src, pq, sub, lane); break;
    case 2: level_block<DK, 2, X, SWZ>(As, pa, src, pq, sub, lane); break;
    default: level_block<DK, 1, X, SWZ>(As, pa, src, pq, sub, lane); break;
  }
}

// V^T fragments of this warp's value columns vrow..vrow+15 (M = value rows, K = the 64 tokens).
__device__ __forceinline__ void load_v_fragments(uint32_t (&vf)[4][4], const uint16_t* vs, int pv, int vrow, int lane) {
  const int mi = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    ldsm_x4_trans(vf[kk], vs + (kk * 16 + (lane & 7) + (mi >> 1) * 8) * pv + vrow + (mi & 1) * 8);
  }
}

// o^T (this warp's 16 value rows x 64 tokens) = S^T qg^T + V^T A^T. S^T is the A operand straight
// from the accumulator registers (rounded to 16 bits); A is zero above the diagonal, so its upper
// k-blocks are skipped.
template <int DK, typename X>
__device__ __forceinline__ void o_tile(float (&acc)[8][4], const float (&S)[DK / 8][4], const uint32_t (&vf)[4][4],
                                       const uint16_t* qw, int pq, const uint16_t* As, int pa, int lane) {
  const int mi = lane >> 3;
  const int nrow = (lane & 7) + (mi >> 1) * 8, ncol = (mi & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    uint32_t a[4];
    a[0] = X::pack(S[2 * kk][0], S[2 * kk][1]);
    a[1] = X::pack(S[2 * kk][2], S[2 * kk][3]);
    a[2] = X::pack(S[2 * kk + 1][0], S[2 * kk + 1][1]);
    a[3] = X::pack(S[2 * kk + 1][2], S[2 * kk + 1][3]);
#pragma unroll
    for (int nt2 = 0; nt2 < 4; ++nt2) {
      uint32_t b[4];
      ldsm_x4(b, qw + (nt2 * 16 + nrow) * pq + kk * 16 + ncol);
      X::mma(acc[2 * nt2], a, b[0], b[1]);
      X::mma(acc[2 * nt2 + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int nt2 = 0; nt2 < 4; ++nt2) {
      if (kk > nt2) continue;  // A is zero above the diagonal
      uint32_t b[4];
      ldsm_x4(b, As + (nt2 * 16 + nrow) * pa + kk * 16 + ncol);
      X::mma(acc[2 * nt2], vf[kk], b[0], b[1]);
      X::mma(acc[2 * nt2 + 1], vf[kk], b[2], b[3]);
    }
  }
}

// S^T = S^T diag(2^{b_last}): the chunk's decay, per key column, on the accumulator fragments.
template <int DK>
__device__ __forceinline__ void decay_state(float (&S)[DK / 8][4], const float* dfac, int lane) {
  const int fc = fc_of(lane);
#pragma unroll
  for (int j = 0; j < DK / 8; ++j) {
    const float d0 = dfac[j * 8 + fc], d1 = dfac[j * 8 + fc + 1];
    S[j][0] *= d0;
    S[j][1] *= d1;
    S[j][2] *= d0;
    S[j][3] *= d1;
  }
}

// S^T = S^T diag(2^{b_last}) + V^T kg.
template <int DK, typename X>
__device__ __forceinline__ void state_update(float (&S)[DK / 8][4], const uint32_t (&vf)[4][4], const uint16_t* kw,
                                             int pq, const float* dfac, int lane) {
  const int mi = lane >> 3;
  decay_state<DK>(S, dfac, lane);
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int nt2 = 0; nt2 < DK / 16; ++nt2) {
      uint32_t b[4];
      ldsm_x4_trans(b, kw + (kk * 16 + (lane & 7) + (mi & 1) * 8) * pq + nt2 * 16 + (mi >> 1) * 8);
      X::mma(S[2 * nt2], vf[kk], b[0], b[1]);
      X::mma(S[2 * nt2 + 1], vf[kk], b[2], b[3]);
    }
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

template <int DK, int BV, typename E, bool MMA_DIAG = false>
__global__ void __launch_bounds__(BV * 2, 1)
chunk_forward_kernel(const __grid_constant__ ForwardParams p, const __grid_constant__ SegmentArgs sa) {
  using X = Elem<E>;
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

  const SeqSpan seq = sequence_span(p, n);
  const int64_t nchunks = (seq.len + kChunk - 1) / kChunk;
  const int64_t nseg = nchunks == 0 ? 1 : (nchunks + sa.segment_chunks - 1) / sa.segment_chunks;
  if (m >= nseg) return;
  if (!full && m >= nseg - 1) return;  // pass 1: the last segment needs no local state
  const int64_t c_begin = m * sa.segment_chunks;
  const int64_t c_end = gla_min64(nchunks, c_begin + sa.segment_chunks);
  const int64_t seg_index = (n * sa.max_segments + m) * p.H + h;

  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const bool per_head = p.gate_per_head != 0;
  const ChunkSmem L = chunk_smem_layout(DK, BV, gate_bytes, per_head, MMA_DIAG);
  static_assert(!MMA_DIAG || BV * 2 == DK * 2, "MMA-diagonal variant: one element-wise item per thread");
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
  const size_t esz = 2;
  auto issue_loads = [&](int64_t chunk, int stage) {
    unsigned char* st = smem + stage * L.stage_bytes;
    const int64_t t0 = seq.bos + chunk * kChunk;
    const int rows = static_cast<int>(gla_min64(kChunk, seq.len - chunk * kChunk));
    const char* qb = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + t0 * p.q_stride[1] + h * p.q_stride[2]) * esz;
    const char* kb = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + t0 * p.k_stride[1] + h * p.k_stride[2]) * esz;
    const char* vb = static_cast<const char*>(p.v) + (seq.batch * p.v_stride[0] + t0 * p.v_stride[1] + h * p.v_stride[2] + v0) * esz;
    const char* gb = static_cast<const char*>(p.g) + (seq.batch * p.g_stride[0] + t0 * p.g_stride[1] + h * p.g_stride[2]) * gate_bytes;
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
          const bool ok = r < rows && c * gper < p.K;
          cp_async16(st + L.g + (r * L.pg + c * gper) * gate_bytes,
                     ok ? gb + (r * p.g_stride[1] + c * gper) * gate_bytes : gb, ok);
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
          if (gate_bytes == 4) {
            reinterpret_cast<float*>(st + L.g)[r * L.pg + c] = ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1] + c] : 0.f;
          } else {
            reinterpret_cast<uint16_t*>(st + L.g)[r * L.pg + c] = ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1] + c] : uint16_t(0);
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
        const bool ok = r < rows;
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

    // ---- 2. element-wise: cumsum, e, qloc, kloc ----
    if constexpr (MMA_DIAG) {
      if (full) mma_diag_elementwise<DK, X>(p, L, tid, lane, warp, qs, ks, gs, qw, kw, tot, smem);
    }
    for (int item = tid; item < (DK / 2) * 4 && !(MMA_DIAG && full) && !(p.debug_skip & 4); item += NT) {
      const int cp = item % (DK / 2), sub = item / (DK / 2);
      const int k0 = cp * 2;
      float cs0[16], cs1[16];
      float a0 = 0.f, a1 = 0.f;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int t = sub * 16 + r;
        float g0, g1;
        if (per_head) {
          g0 = g1 = gate_bytes == 4 ? reinterpret_cast<float*>(gs)[t]
                                    : X::to_float(reinterpret_cast<uint16_t*>(gs)[t]);
        } else if (gate_bytes == 4) {
          float2 gv = *reinterpret_cast<float2*>(gs + (t * L.pg + k0) * 4);
          g0 = gv.x;
          g1 = gv.y;
        } else {
          float2 gv = X::to_float2(*reinterpret_cast<uint32_t*>(gs + (t * L.pg + k0) * 2));
          g0 = gv.x;
          g1 = gv.y;
        }
        g0 *= kLog2e;
        g1 *= kLog2e;
        a0 += g0;
        a1 += g1;
        cs0[r] = a0;
        cs1[r] = a1;
        if (full) {
          // e = 2^{g log2 e} for the diagonal blocks, stored over the gate (16-bit gate: fp16).
          const float e0 = fast_exp2(g0), e1 = fast_exp2(g1);
          if (per_head) {
            if (cp == 0) reinterpret_cast<float*>(gs + kChunk * 4)[t] = e0;
          } else if (gate_bytes == 4) {
            *reinterpret_cast<float2*>(gs + (t * L.pg + k0) * 4) = make_float2(e0, e1);
          } else {
            __half2 eh = __floats2half2_rn(e0, e1);
            *reinterpret_cast<__half2*>(gs + (t * L.pg + k0) * 2) = eh;
          }
        }
      }
      tot[sub * DK + k0] = a0;
      tot[sub * DK + k0 + 1] = a1;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const int t = sub * 16 + r;
        if (full) {
          float2 qv = X::to_float2(*reinterpret_cast<uint32_t*>(qs + t * L.pq + k0));
          *reinterpret_cast<uint32_t*>(qw + t * L.pq + k0) =
              X::pack(qv.x * fast_exp2(cs0[r]), qv.y * fast_exp2(cs1[r]));
        }
        float2 kv = X::to_float2(*reinterpret_cast<uint32_t*>(ks + t * L.pq + k0));
        *reinterpret_cast<uint32_t*>(kw + t * L.pq + k0) =
            X::pack(kv.x * fast_exp2(a0 - cs0[r]), kv.y * fast_exp2(a1 - cs1[r]));
      }
    }
    __syncthreads();

    // ---- 3. the intra-chunk matrix A ----
    if (full) {
      // Off-diagonal blocks (i, j), i > j, on tensor cores.
      constexpr int kBlocks = 6;
      for (int blk = warp; blk < kBlocks && !(p.debug_skip & 2); blk += NW) {
        // Blocks (i, j): (1,0) (2,1) (3,2) (2,0) (3,1) (3,0), packed as nibbles (no local array).
        offdiag_block<DK, X>(As, L.pa, qw, kw, L.pq, tot, (0x332321 >> (4 * blk)) & 15, (0x010210 >> (4 * blk)) & 15,
                             lane);
      }

      if constexpr (MMA_DIAG) {
        mma_diag_levels<DK, NW, X>(L, tid, lane, warp, qs, ks, gs, As, smem, p.gate_per_head != 0, gate_bytes);
      }
      // Diagonal blocks, element-wise: lanes (rr, ks) = (row in a group of 4, K slice of DK/8).
      constexpr int SL = DK / 8;
      constexpr int RPW = kChunk / NW;  // rows per warp
      const int rr = lane >> 3, ksl = (lane & 7) * SL;
      for (int pass = 0; pass < RPW / 4 && !MMA_DIAG && !(p.debug_skip & 1); ++pass) {
        const int tgroup = warp * RPW + pass * 4;
        const int t = tgroup + rr;
        const int sub0 = (t >> 4) * 16;
        float qwv[SL];
#pragma unroll
        for (int x = 0; x < SL; x += 8) {
          uint4 raw = *reinterpret_cast<const uint4*>(qs + t * L.pq + ksl + x);
          const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
          for (int y = 0; y < 4; ++y) {
            float2 f = X::to_float2(w[y]);
            qwv[x + 2 * y] = f.x;
            qwv[x + 2 * y + 1] = f.y;
          }
        }
        for (int s = tgroup + 3; s >= sub0; --s) {
          if (s < t) {
            // qwv *= e_{s+1}: extends the decay product 2^{b_t - b_s} by one step.
            const int u = s + 1;
            if (per_head) {
              const float ev = reinterpret_cast<const float*>(gs + kChunk * 4)[u];
#pragma unroll
              for (int x = 0; x < SL; ++x) qwv[x] *= ev;
            } else if (gate_bytes == 4) {
#pragma unroll
              for (int x = 0; x < SL; x += 4) {
                float4 ev = *reinterpret_cast<const float4*>(gs + (u * L.pg + ksl + x) * 4);
                qwv[x] *= ev.x;
                qwv[x + 1] *= ev.y;
                qwv[x + 2] *= ev.z;
                qwv[x + 3] *= ev.w;
              }
            } else {
#pragma unroll
              for (int x = 0; x < SL; x += 8) {
                uint4 raw = *reinterpret_cast<const uint4*>(gs + (u * L.pg + ksl + x) * 2);
                const __half2* hv = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
                for (int y = 0; y < 4; ++y) {
                  float2 f = __half22float2(hv[y]);
                  qwv[x + 2 * y] *= f.x;
                  qwv[x + 2 * y + 1] *= f.y;
                }
              }
            }
          }
          float part = 0.f;
#pragma unroll
          for (int x = 0; x < SL; x += 8) {
            uint4 raw = *reinterpret_cast<const uint4*>(ks + s * L.pq + ksl + x);
            const uint32_t* w = reinterpret_cast<const uint32_t*>(&raw);
#pragma unroll
            for (int y = 0; y < 4; ++y) {
              float2 f = X::to_float2(w[y]);
              part = fmaf(qwv[x + 2 * y], f.x, part);
              part = fmaf(qwv[x + 2 * y + 1], f.y, part);
            }
          }
          part += __shfl_xor_sync(0xffffffffu, part, 1);
          part += __shfl_xor_sync(0xffffffffu, part, 2);
          part += __shfl_xor_sync(0xffffffffu, part, 4);
          if ((lane & 7) == 0) As[t * L.pa + s] = X::from_float(s <= t ? part : 0.f);
        }
      }
    }
    __syncthreads();

    // ---- 4. qg = qloc 2^{Pre_i}, kg = kloc 2^{Post_i}; the chunk's decay 2^{b_last} ----
    for (int item = tid; item < (DK / 2) * 4 && !(p.debug_skip & 8); item += NT) {
      const int cp = item % (DK / 2), sub = item / (DK / 2);
      const int k0 = cp * 2;
      float pre0 = 0.f, pre1 = 0.f, post0 = 0.f, post1 = 0.f;
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const float t0 = tot[l * DK + k0], t1 = tot[l * DK + k0 + 1];
        if (l < sub) { pre0 += t0; pre1 += t1; }
        if (l > sub) { post0 += t0; post1 += t1; }
      }
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
    if (full && !(p.debug_skip & 16)) {
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
