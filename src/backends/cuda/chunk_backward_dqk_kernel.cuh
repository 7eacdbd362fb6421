// dq, dk and dg of one (chunk, head, key tile) (SPEC.md §2 B3-B5).
//
// With b the chunk-local cumulative gate (log2 units), e_j = 16j + 15 the last row of sub-chunk j
// and every exponent below <= 0 (SPEC §3.2):
//   dA      = scale · do vᵀ                                         (over all value tiles)
//   dq_t    = scale 2^{b_t} ⊙ (S_c do_t)                              inter
//           + 2^{b_t - b_{e_{i-1}}} ⊙ Σ_{j<i} dA_ij (k_j ⊙ 2^{b_{e_{i-1}} - b_s})   query block i, off-diagonal
//           + Σ_{s<=t, same block} dA[t,s] k_s ⊙ 2^{b_t - b_s}        element-wise
//   dk_s    = 2^{b_last - b_s} ⊙ (dS_{c+1} v_s)                       inter
//           + 2^{b_{e_j} - b_s} ⊙ Σ_{i>j} dA_ijᵀ (q_i ⊙ 2^{b_t - b_{e_j}})          key block j, off-diagonal
//           + Σ_{t>=s, same block} dA[t,s] q_t ⊙ 2^{b_t - b_s}        element-wise
//   dg_u    = Σ_{t=u..last} (q_t ⊙ dq_t - k_t ⊙ dk_t) + 2^{b_last} ⊙ rowsum(S_c ⊙ dS_{c+1})
//           + Σ_s k_s ⊙ dk_s^inter
// A per-head gate sums dg over the keys: per key tile into the workspace when K > 64.
#pragma once

#include <type_traits>

#include "backends/cuda/chunk_backward_common.cuh"

namespace gla::cuda::backward {

// 8 warps, two CTAs per SM (113.7 KB of shared memory and <= 128 registers each): one CTA's loads
// and shared-memory passes overlap the other's, where one CTA of 16 warps waited at its barriers.
constexpr int kGradThreads = 256;
constexpr int kGradWarps = kGradThreads / 32;
constexpr int kTilesPerWarp = 16 / kGradWarps;  // of the 16 output tiles 16 x 16 of a 64 x 64 block
constexpr int kRowGroups = kGradThreads / kTile;  // a thread per (column, group of rows) in the column sums
constexpr int kGroupRows = kChunk / kRowGroups;
constexpr int kStackRows = 96;  // 16 + 32 + 48 rows of pivoted keys (or queries) for three blocks

// First row of query block i's pivoted keys (i = 1..3) and of key block j's pivoted queries (j = 0..2)
// in their stacks.
__device__ __forceinline__ int key_stack_row(int i) { return 8 * i * (i - 1); }
__device__ __forceinline__ int query_stack_row(int j) { return j == 0 ? 0 : (j == 1 ? 48 : 80); }

template <typename E>
struct DqkShared {
  alignas(128) float b[kChunk * kTile];
  alignas(128) E q[kChunk * kLd16];
  alignas(128) E k[kChunk * kLd16];
  alignas(128) E dA[kChunk * kLd16];  // [t][s], scale included
  union {
    struct {
      alignas(128) E dO[kChunk * kLd16];
      alignas(128) E v[kChunk * kLd16];
      alignas(128) E S[kTile * kLd16];   // [key][value] of S_c
      alignas(128) E dS[kTile * kLd16];  // [key][value] of dS_{c+1}
    } loop;
    struct {
      alignas(128) float dq[kChunk * kLd32];
      alignas(128) float dk[kChunk * kLd32];
    } grad;
  } u;
  // The pivoted keys of dq's off-diagonal blocks, then (once those are done) the pivoted queries of
  // dk's: one buffer, so that two CTAs fit on an SM.
  alignas(128) E stack[kStackRows * kLd16];
  alignas(128) float tmp[kChunk * kLd32];
  float rowsum[kTile];
  float dk_inter_sum[kTile];
  float column_part[kRowGroups][kTile];  // per-column partial sums of row groups (gate cumsum, dk_inter_sum, dg)
};

// Rows t of one row set (SET 0: t mod 4 in {0, 3}; SET 1: {1, 2}) of the diagonal block at r0, column
// c: dq[t] += Σ_{s<=t} dA[t,s] k_s 2^{b_t - b_s}, and dk_local[s] = Σ_{t>=s} dA[t,s] q_t 2^{b_t - b_s}.
template <int SET, typename E>
__device__ __forceinline__ void diagonal_rows(DqkShared<E>& sh, int c, int r0, float (&dk_local)[16]) {
#pragma unroll
  for (int s = 0; s < 16; ++s) dk_local[s] = 0.0f;
#pragma unroll
  for (int t = 0; t < 16; ++t) {
    const bool mine = SET == 0 ? (t % 4 == 0 || t % 4 == 3) : (t % 4 == 1 || t % 4 == 2);
    if (!mine) continue;
    const float bt = sh.b[(r0 + t) * kTile + c];
    const float qt = to_float(sh.q[(r0 + t) * kLd16 + c]);
    float dq_acc = 0.0f;
#pragma unroll
    for (int s = 0; s <= t; ++s) {
      const float f = detail::fast_exp2(bt - sh.b[(r0 + s) * kTile + c]);
      const float a = to_float(sh.dA[(r0 + t) * kLd16 + r0 + s]) * f;
      dq_acc += a * to_float(sh.k[(r0 + s) * kLd16 + c]);
      dk_local[s] += a * qt;
    }
    sh.u.grad.dq[(r0 + t) * kLd32 + c] += dq_acc;
  }
}

// grid: (num_chunks, H, key_tiles)
template <typename E>
__global__ void __launch_bounds__(kGradThreads, 2) dqk_kernel(BackwardParams p, BackwardPlan plan, Workspace ws) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  DqkShared<E>& sh = *reinterpret_cast<DqkShared<E>*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t chunk = blockIdx.x, h = blockIdx.y;
  const int64_t k0 = int64_t(blockIdx.z) * kTile;
  const int64_t kv = p.K - k0 < kTile ? p.K - k0 : kTile;
  const ChunkRef ch = locate_chunk(p, ws.chunk_offsets, chunk);
  const int64_t rows = ch.len;

  {
    GateTile<kGradThreads> gate;
    Tile16<kGradThreads> q, k;
    load_gate_tile(gate, p, ch.batch, ch.t0, h, rows, k0, p.vector_gate, tid);
    load_tile(q, p.q, p.q_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
    load_tile(k, p.k, p.k_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
    store_tile(sh.q, q, tid);
    store_tile(sh.k, k, tid);
    gate_cumsum(sh.b, gate, &sh.column_part[0][0], tid);
  }

  // ---- over the value tiles: dA = do vᵀ, Pq = do S_cᵀ, Pk = v dS_{c+1}ᵀ, rowsum(S_c ⊙ dS_{c+1}) ----
  FragC acc_dA[kTilesPerWarp], acc_q[kTilesPerWarp], acc_k[kTilesPerWarp];
  for (int i = 0; i < kTilesPerWarp; ++i) {
    wmma::fill_fragment(acc_dA[i], 0.0f);
    wmma::fill_fragment(acc_q[i], 0.0f);
    wmma::fill_fragment(acc_k[i], 0.0f);
  }
  // rowsum(S_c ⊙ dS_{c+1}) partials: group i of this thread covers row (tid + kGradThreads i) / 8.
  constexpr int kStateGroups = Tile16<kGradThreads>::kGroups;
  float rowsum_part[kStateGroups];
#pragma unroll
  for (int i = 0; i < kStateGroups; ++i) rowsum_part[i] = 0.0f;
  const StateElement* S_c = ws.states + (chunk * p.H + h) * p.K * p.V;
  const StateElement* dS_c = ws.state_grads + (chunk * p.H + h) * p.K * p.V;
  const int64_t state_stride[3] = {0, p.V, 0};  // a state block as a tile: rows are keys
  const bool state_vector = p.V % 8 == 0;
  for (int vt = 0; vt < plan.value_tiles; ++vt) {
    const int64_t v0 = int64_t(vt) * kTile;
    const int64_t vv = p.V - v0 < kTile ? p.V - v0 : kTile;
    {
      Tile16<kGradThreads> dO, v, S, dS;
      load_tile(dO, p.do_, p.do_stride, ch.batch, ch.t0, h, rows, v0, vv, p.vector_loads, tid);
      load_tile(v, p.v, p.v_stride, ch.batch, ch.t0, h, rows, v0, vv, p.vector_loads, tid);
      load_tile(S, S_c + k0 * p.V, state_stride, 0, 0, 0, kv, v0, vv, state_vector, tid);
      load_tile(dS, dS_c + k0 * p.V, state_stride, 0, 0, 0, kv, v0, vv, state_vector, tid);
      store_tile(sh.u.loop.dO, dO, tid);
      store_tile(sh.u.loop.v, v, tid);
#pragma unroll
      for (int i = 0; i < kStateGroups; ++i) {
        const int e = tid + i * kGradThreads, r = e >> 3, c = (e & 7) * 8;
        const uint32_t sw[4] = {S.r[i].x, S.r[i].y, S.r[i].z, S.r[i].w};
        const uint32_t dw[4] = {dS.r[i].x, dS.r[i].y, dS.r[i].z, dS.r[i].w};
        E* srow = sh.u.loop.S + r * kLd16 + c;
        E* drow = sh.u.loop.dS + r * kLd16 + c;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float s1 = __uint_as_float((sw[j / 2] >> (16 * (j % 2))) << 16);
          const float d1 = __uint_as_float((dw[j / 2] >> (16 * (j % 2))) << 16);
          rowsum_part[i] += s1 * d1;
          if constexpr (!std::is_same_v<E, StateElement>) {
            srow[j] = from_float<E>(s1);
            drow[j] = from_float<E>(d1);
          }
        }
        if constexpr (std::is_same_v<E, StateElement>) {  // already the operands' type: stored as loaded
          *reinterpret_cast<uint4*>(srow) = S.r[i];
          *reinterpret_cast<uint4*>(drow) = dS.r[i];
        }
      }
    }
    __syncthreads();
    for (int i = 0; i < kTilesPerWarp; ++i) {
      const int tile = kTilesPerWarp * warp + i, ti = tile >> 2, tj = tile & 3;
      for (int kk = 0; kk < 4; ++kk) {
        FragA<E> a_do, a_v;
        FragBT<E> b_v, b_S, b_dS;
        wmma::load_matrix_sync(a_do, sh.u.loop.dO + 16 * ti * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(a_v, sh.u.loop.v + 16 * ti * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(b_v, sh.u.loop.v + 16 * tj * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(b_S, sh.u.loop.S + 16 * tj * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(b_dS, sh.u.loop.dS + 16 * tj * kLd16 + 16 * kk, kLd16);
        wmma::mma_sync(acc_dA[i], a_do, b_v, acc_dA[i]);
        wmma::mma_sync(acc_q[i], a_do, b_S, acc_q[i]);
        wmma::mma_sync(acc_k[i], a_v, b_dS, acc_k[i]);
      }
    }
    __syncthreads();
  }
  // rowsum: the 8 consecutive lanes sharing a row reduce by shuffles.
#pragma unroll
  for (int i = 0; i < kStateGroups; ++i) {
    float x = rowsum_part[i];
    for (int off = 4; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    if ((lane & 7) == 0) sh.rowsum[(tid + i * kGradThreads) >> 3] = x;
  }
  for (int i = 0; i < kTilesPerWarp; ++i) {
    const int tile = kTilesPerWarp * warp + i, ti = tile >> 2, tj = tile & 3;
    wmma::store_matrix_sync(sh.u.grad.dq + 16 * ti * kLd32 + 16 * tj, acc_q[i], kLd32, wmma::mem_row_major);
    wmma::store_matrix_sync(sh.u.grad.dk + 16 * ti * kLd32 + 16 * tj, acc_k[i], kLd32, wmma::mem_row_major);
    wmma::store_matrix_sync(sh.tmp + 16 * ti * kLd32 + 16 * tj, acc_dA[i], kLd32, wmma::mem_row_major);
  }
  __syncthreads();
  // ---- inter-chunk terms, dA in 16 bits, the pivoted keys ----
  // Thread tid covers column tid % 64 at rows tid / 64 + kRowGroups i: its part of
  // Σ_s k_s ⊙ dk_s^inter goes to column_part, summed per column below in a fixed order.
  static_assert(kGradThreads % kTile == 0, "whole columns per thread set");
  {
    float inter_part = 0.0f;
    for (int e = tid; e < kChunk * kTile; e += kGradThreads) {
      const int t = e >> 6, c = e & 63;
      const float bt = sh.b[t * kTile + c], last = sh.b[(kChunk - 1) * kTile + c];
      sh.dA[t * kLd16 + c] = from_float<E>(p.scale * sh.tmp[t * kLd32 + c]);
      sh.u.grad.dq[t * kLd32 + c] *= p.scale * detail::fast_exp2(bt);
      const float dk_inter = sh.u.grad.dk[t * kLd32 + c] * detail::fast_exp2(last - bt);
      sh.u.grad.dk[t * kLd32 + c] = dk_inter;
      inter_part += to_float(sh.k[t * kLd16 + c]) * dk_inter;
    }
    sh.column_part[tid >> 6][tid & 63] = inter_part;
  }
  for (int e = tid; e < kStackRows * kTile; e += kGradThreads) {
    // Keys of query block i (rows s < 16i), pivoted at e_{i-1} = 16i - 1.
    const int r = e >> 6, c = e & 63;
    const int i = r < 16 ? 1 : (r < 48 ? 2 : 3);
    const int s = r - key_stack_row(i);
    const float pivot_k = sh.b[(16 * i - 1) * kTile + c];
    sh.stack[r * kLd16 + c] = from_float<E>(to_float(sh.k[s * kLd16 + c]) * detail::fast_exp2(pivot_k - sh.b[s * kTile + c]));
  }
  __syncthreads();
  if (tid < kTile) {
    float acc = 0.0f;
#pragma unroll
    for (int g = 0; g < kRowGroups; ++g) acc += sh.column_part[g][tid];
    sh.dk_inter_sum[tid] = acc;
  }

  // ---- off-diagonal blocks of dq: query block i = 1..3, key tile columns kt ----
  for (int task = warp; task < 12; task += kGradWarps) {
    const int i = 1 + task / 4, kt = task % 4;
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int j = 0; j < i; ++j) {
      FragA<E> a;
      FragB<E> bf;
      wmma::load_matrix_sync(a, sh.dA + 16 * i * kLd16 + 16 * j, kLd16);
      wmma::load_matrix_sync(bf, sh.stack + (key_stack_row(i) + 16 * j) * kLd16 + 16 * kt, kLd16);
      wmma::mma_sync(acc, a, bf, acc);
    }
    wmma::store_matrix_sync(sh.tmp + 16 * i * kLd32 + 16 * kt, acc, kLd32, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = tid; e < 48 * kTile; e += kGradThreads) {
    const int t = 16 + (e >> 6), c = e & 63, i = t >> 4;
    const float pivot = sh.b[(16 * i - 1) * kTile + c];
    sh.u.grad.dq[t * kLd32 + c] += sh.tmp[t * kLd32 + c] * detail::fast_exp2(sh.b[t * kTile + c] - pivot);
  }
  // The pivoted keys are done with: the stack takes the queries of key block j (rows t >= 16(j+1)),
  // pivoted at e_j = 16j + 15.
  for (int e = tid; e < kStackRows * kTile; e += kGradThreads) {
    const int r = e >> 6, c = e & 63;
    const int j = r < 48 ? 0 : (r < 80 ? 1 : 2);
    const int t = 16 * (j + 1) + r - query_stack_row(j);
    const float pivot_q = sh.b[(16 * j + 15) * kTile + c];
    sh.stack[r * kLd16 + c] = from_float<E>(to_float(sh.q[t * kLd16 + c]) * detail::fast_exp2(sh.b[t * kTile + c] - pivot_q));
  }
  __syncthreads();
  // ---- off-diagonal blocks of dk: key block j = 0..2 ----
  for (int task = warp; task < 12; task += kGradWarps) {
    const int j = task / 4, kt = task % 4;
    FragC acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int i = j + 1; i < 4; ++i) {
      FragAT<E> a;  // dA_ijᵀ
      FragB<E> bf;
      wmma::load_matrix_sync(a, sh.dA + 16 * i * kLd16 + 16 * j, kLd16);
      wmma::load_matrix_sync(bf, sh.stack + (query_stack_row(j) + 16 * (i - j - 1)) * kLd16 + 16 * kt, kLd16);
      wmma::mma_sync(acc, a, bf, acc);
    }
    wmma::store_matrix_sync(sh.tmp + 16 * j * kLd32 + 16 * kt, acc, kLd32, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = tid; e < 48 * kTile; e += kGradThreads) {
    const int s = e >> 6, c = e & 63, j = s >> 4;
    const float pivot = sh.b[(16 * j + 15) * kTile + c];
    sh.u.grad.dk[s * kLd32 + c] += sh.tmp[s * kLd32 + c] * detail::fast_exp2(pivot - sh.b[s * kTile + c]);
  }
  __syncthreads();

  // ---- diagonal blocks, element-wise: thread (column c, block i) ----
  // The two row sets {0,3,4,7,8,11,12,15} and {1,2,5,6,9,10,13,14} hold 68 of the block's 136
  // (t, s) pairs each; set 0 adds its dk terms first, then set 1 (a fixed order: reruns are bitwise).
  static_assert(kGradThreads == 4 * kTile, "one thread per (column, diagonal block)");
  {
    const int c = tid & 63, r0 = 16 * (tid >> 6);
    float dk_local[16];
    diagonal_rows<0, E>(sh, c, r0, dk_local);
#pragma unroll
    for (int s = 0; s < 16; ++s) sh.u.grad.dk[(r0 + s) * kLd32 + c] += dk_local[s];
    diagonal_rows<1, E>(sh, c, r0, dk_local);
#pragma unroll
    for (int s = 0; s < 16; ++s) sh.u.grad.dk[(r0 + s) * kLd32 + c] += dk_local[s];
  }
  __syncthreads();

  // ---- dg: reverse cumsum of x = q ⊙ dq - k ⊙ dk plus the chunk-end terms ----
  // Thread (column c, row group of kGroupRows rows): the group's sum, then the suffix of the later
  // groups and the chunk-end terms, then its own rows in reverse (a fixed order: reruns are bitwise).
  if (p.dg != nullptr) {
    const int c = tid & 63, group = tid >> 6, t0 = kGroupRows * group;
    const int last_row = static_cast<int>(rows) - 1;
    float x[kGroupRows];
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) {
      const int t = t0 + r;
      x[r] = to_float(sh.q[t * kLd16 + c]) * sh.u.grad.dq[t * kLd32 + c] -
             to_float(sh.k[t * kLd16 + c]) * sh.u.grad.dk[t * kLd32 + c];
      if (t <= last_row) part += x[r];
    }
    sh.column_part[group][c] = part;
    __syncthreads();
    float acc = detail::fast_exp2(sh.b[(kChunk - 1) * kTile + c]) * sh.rowsum[c] + sh.dk_inter_sum[c];
    for (int g = kRowGroups - 1; g > group; --g) acc += sh.column_part[g][c];
#pragma unroll
    for (int r = kGroupRows - 1; r >= 0; --r) {
      const int t = t0 + r;
      if (t <= last_row) {
        acc += x[r];
        sh.tmp[t * kLd32 + c] = c < kv ? acc : 0.0f;
      }
    }
  }
  __syncthreads();
  if (p.dg != nullptr) {
    if (p.gate_per_head) {
      if (tid < rows) {
        float total = 0.0f;
        for (int c = 0; c < kTile; ++c) total += sh.tmp[tid * kLd32 + c];
        const int64_t token = ch.batch * p.T + ch.t0 + tid;
        if (plan.key_tiles == 1) {
          detail::store_any(p.dg, ch.batch * p.dg_stride[0] + (ch.t0 + tid) * p.dg_stride[1] + h * p.dg_stride[2],
                            p.dg_dtype, total);
        } else {
          ws.gate_partials[(int64_t(blockIdx.z) * p.B * p.T + token) * p.H + h] = total;
        }
      }
    } else {
      for (int e = tid; e < kChunk * kTile; e += kGradThreads) {
        const int t = e >> 6, c = e & 63;
        if (t < rows && c < kv) {
          detail::store_any(p.dg, ch.batch * p.dg_stride[0] + (ch.t0 + t) * p.dg_stride[1] + h * p.dg_stride[2] + k0 + c,
                            p.dg_dtype, sh.tmp[t * kLd32 + c]);
        }
      }
    }
  }
  if (p.vector_dqk) {
    // 16-byte stores: group e is row e / 8, columns 8 (e % 8) .. + 7 (K % 8 == 0).
    for (int e = tid; e < kChunk * kTile / 8; e += kGradThreads) {
      const int t = e >> 3, c = (e & 7) * 8;
      if (t < rows && c < kv) {
        const int64_t tok = ch.t0 + t;
        auto pack = [&](const float* row) {
          uint32_t w[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const E lo = from_float<E>(row[2 * j]), hi = from_float<E>(row[2 * j + 1]);
            w[j] = uint32_t(reinterpret_cast<const uint16_t&>(lo)) | (uint32_t(reinterpret_cast<const uint16_t&>(hi)) << 16);
          }
          return make_uint4(w[0], w[1], w[2], w[3]);
        };
        if (p.dq != nullptr) {
          *reinterpret_cast<uint4*>(static_cast<E*>(p.dq) + ch.batch * p.dq_stride[0] + tok * p.dq_stride[1] +
                                    h * p.dq_stride[2] + k0 + c) = pack(sh.u.grad.dq + t * kLd32 + c);
        }
        if (p.dk != nullptr) {
          *reinterpret_cast<uint4*>(static_cast<E*>(p.dk) + ch.batch * p.dk_stride[0] + tok * p.dk_stride[1] +
                                    h * p.dk_stride[2] + k0 + c) = pack(sh.u.grad.dk + t * kLd32 + c);
        }
      }
    }
    return;
  }
  for (int e = tid; e < kChunk * kTile; e += kGradThreads) {
    const int t = e >> 6, c = e & 63;
    if (t < rows && c < kv) {
      const int64_t tok = ch.t0 + t;
      if (p.dq != nullptr) {
        static_cast<E*>(p.dq)[ch.batch * p.dq_stride[0] + tok * p.dq_stride[1] + h * p.dq_stride[2] + k0 + c] =
            from_float<E>(sh.u.grad.dq[t * kLd32 + c]);
      }
      if (p.dk != nullptr) {
        static_cast<E*>(p.dk)[ch.batch * p.dk_stride[0] + tok * p.dk_stride[1] + h * p.dk_stride[2] + k0 + c] =
            from_float<E>(sh.u.grad.dk[t * kLd32 + c]);
      }
    }
  }
}

}  // namespace gla::cuda::backward
