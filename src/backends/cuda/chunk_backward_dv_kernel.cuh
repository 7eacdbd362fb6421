// dv of one (chunk, head, value tile) (SPEC.md §2 B2):
//   dv_s = Σ_{t>=s} A[t,s] do_t + (k_s ⊙ 2^{b_last - b_s})ᵀ dS_{c+1}
// with A rebuilt over every key tile: the off-diagonal 16 x 16 blocks on tensor cores, pivoted at the
// last row before the query block, A_ij = (q_i ⊙ 2^{b_t - b_{e_{i-1}}}) (k_j ⊙ 2^{b_{e_{i-1}} - b_s})ᵀ;
// the diagonal blocks element-wise, one warp per (t, s) pair reducing over the keys.
#pragma once

#include "backends/cuda/chunk_backward_dqk_kernel.cuh"

namespace gla::cuda::backward {

constexpr int kDiagPairs = 4 * 136;  // (t, s), s <= t, in the four 16 x 16 diagonal blocks

template <typename E>
struct DvShared {
  alignas(128) float b[kChunk * kTile];
  alignas(128) E q[kChunk * kLd16];
  alignas(128) E k[kChunk * kLd16];
  // The key-tile loop's operands, then (aliased: 98 KB in all, two CTAs per SM) A and do.
  union {
    struct {
      alignas(128) E key_stack[kStackRows * kLd16];  // as in dqk_kernel: keys of query block i pivoted at 16i - 1
      alignas(128) E query_hat[48 * kLd16];          // rows 16..63: q_t ⊙ 2^{b_t - b_{16i - 1}}
      alignas(128) E key_gated[kChunk * kLd16];      // k_s ⊙ 2^{b_last - b_s}
      alignas(128) E dS[kTile * kLd16];              // [key][value] of dS_{c+1}
    } loop;
    struct {
      alignas(128) E A[kChunk * kLd16];  // [t][s], scale included, zero above the diagonal
      alignas(128) E dO[kChunk * kLd16];
    } post;
  } u;
  alignas(128) float tmp[kChunk * kLd32];
  float diag[kDiagPairs];
  float diag_half[2 * kDiagPairs];  // this key tile's pair sums of each of a block's two warps
};

// Off-diagonal blocks (i, j), j < i, one per warp 0..5.
__device__ __forceinline__ void off_diagonal_block(int index, int& i, int& j) {
  i = index < 1 ? 1 : (index < 3 ? 2 : 3);
  j = index - i * (i - 1) / 2;
}

// grid: (num_chunks, H, value_tiles)
template <typename E>
__global__ void __launch_bounds__(kGradThreads, 2) dv_kernel(BackwardParams p, BackwardPlan plan, Workspace ws) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  DvShared<E>& sh = *reinterpret_cast<DvShared<E>*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t chunk = blockIdx.x, h = blockIdx.y;
  const int64_t v0 = int64_t(blockIdx.z) * kTile;
  const int64_t vv = p.V - v0 < kTile ? p.V - v0 : kTile;
  const ChunkRef ch = locate_chunk(p, ws.chunk_offsets, chunk);
  const int64_t rows = ch.len;
  const float* dS_c = ws.state_grads + (chunk * p.H + h) * p.K * p.V;

  for (int e = tid; e < kDiagPairs; e += kGradThreads) sh.diag[e] = 0.0f;
  FragC acc_A, acc_dv[2];
  wmma::fill_fragment(acc_A, 0.0f);
  wmma::fill_fragment(acc_dv[0], 0.0f);
  wmma::fill_fragment(acc_dv[1], 0.0f);
  for (int kt = 0; kt < plan.key_tiles; ++kt) {
    const int64_t k0 = int64_t(kt) * kTile;
    const int64_t kv = p.K - k0 < kTile ? p.K - k0 : kTile;
    {
      GateTile<kGradThreads> gate;
      Tile16<kGradThreads> q, k;
      Tile32<kGradThreads> dS;
      load_gate_tile(gate, p, ch.batch, ch.t0, h, rows, k0, p.vector_gate, tid);
      load_tile(q, p.q, p.q_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
      load_tile(k, p.k, p.k_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
      load_state_tile(dS, dS_c + k0 * p.V, p.V, kv, v0, vv, tid);
      store_tile(sh.q, q, tid);
      store_tile(sh.k, k, tid);
#pragma unroll
      for (int i = 0; i < Tile32<kGradThreads>::kGroups; ++i) {
        const int e = tid + i * kGradThreads, r = e >> 4, c = (e & 15) * 4;
        E* row = sh.u.loop.dS + r * kLd16 + c;
        row[0] = from_float<E>(dS.r[i].x); row[1] = from_float<E>(dS.r[i].y);
        row[2] = from_float<E>(dS.r[i].z); row[3] = from_float<E>(dS.r[i].w);
      }
      gate_cumsum(sh.b, gate, tid);
    }
    for (int e = tid; e < kStackRows * kTile; e += kGradThreads) {
      const int r = e >> 6, c = e & 63;
      const int i = r < 16 ? 1 : (r < 48 ? 2 : 3);
      const int s = r - key_stack_row(i);
      const float pivot = sh.b[(16 * i - 1) * kTile + c];
      sh.u.loop.key_stack[r * kLd16 + c] = from_float<E>(to_float(sh.k[s * kLd16 + c]) * detail::fast_exp2(pivot - sh.b[s * kTile + c]));
    }
    for (int e = tid; e < kChunk * kTile; e += kGradThreads) {
      const int t = e >> 6, c = e & 63;
      const float bt = sh.b[t * kTile + c];
      sh.u.loop.key_gated[t * kLd16 + c] =
          from_float<E>(to_float(sh.k[t * kLd16 + c]) * detail::fast_exp2(sh.b[(kChunk - 1) * kTile + c] - bt));
      if (t >= 16) {
        const float pivot = sh.b[((t & ~15) - 1) * kTile + c];
        sh.u.loop.query_hat[(t - 16) * kLd16 + c] = from_float<E>(to_float(sh.q[t * kLd16 + c]) * detail::fast_exp2(bt - pivot));
      }
    }
    __syncthreads();
    if (warp < 6) {
      int i, j;
      off_diagonal_block(warp, i, j);
      for (int kk = 0; kk < 4; ++kk) {
        FragA<E> a;
        FragBT<E> bf;
        wmma::load_matrix_sync(a, sh.u.loop.query_hat + 16 * (i - 1) * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(bf, sh.u.loop.key_stack + (key_stack_row(i) + 16 * j) * kLd16 + 16 * kk, kLd16);
        wmma::mma_sync(acc_A, a, bf, acc_A);
      }
    }
    for (int i = 0; i < 2; ++i) {
      const int tile = 2 * warp + i, ti = tile >> 2, tj = tile & 3;
      for (int kk = 0; kk < 4; ++kk) {
        FragA<E> a;
        FragB<E> bf;
        wmma::load_matrix_sync(a, sh.u.loop.key_gated + 16 * ti * kLd16 + 16 * kk, kLd16);
        wmma::load_matrix_sync(bf, sh.u.loop.dS + 16 * kk * kLd16 + 16 * tj, kLd16);
        wmma::mma_sync(acc_dv[i], a, bf, acc_dv[i]);
      }
    }
    // Diagonal blocks: warps 2i and 2i+1 hold block i's 64 key columns, a lane one column; each
    // pair's column terms are summed over the warp by shuffles, then over the two warps in diag.
    {
      const int c = tid & 63, blk = tid >> 6, r0 = 16 * blk;
      const int pair0 = 136 * blk;
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const float qt = to_float(sh.q[(r0 + t) * kLd16 + c]);
        const float bt = sh.b[(r0 + t) * kTile + c];
#pragma unroll
        for (int s = 0; s <= t; ++s) {
          float x = qt * to_float(sh.k[(r0 + s) * kLd16 + c]) * detail::fast_exp2(bt - sh.b[(r0 + s) * kTile + c]);
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
          if (lane == 0) sh.diag_half[(warp & 1) * kDiagPairs + pair0 + t * (t + 1) / 2 + s] = x;
        }
      }
    }
    __syncthreads();
    for (int e = tid; e < kDiagPairs; e += kGradThreads) sh.diag[e] += sh.diag_half[e] + sh.diag_half[kDiagPairs + e];
    __syncthreads();
  }

  // ---- A in 16 bits, then dv = Aᵀ do + the inter term ----
  if (warp < 6) {
    int i, j;
    off_diagonal_block(warp, i, j);
    wmma::store_matrix_sync(sh.tmp + 16 * i * kLd32 + 16 * j, acc_A, kLd32, wmma::mem_row_major);
  }
  {
    Tile16<kGradThreads> dO;
    load_tile(dO, p.do_, p.do_stride, ch.batch, ch.t0, h, rows, v0, vv, p.vector_loads, tid);
    store_tile(sh.u.post.dO, dO, tid);
  }
  __syncthreads();
  for (int e = tid; e < kChunk * kChunk; e += kGradThreads) {
    const int t = e >> 6, s = e & 63, bt = t >> 4, bs = s >> 4;
    float a = 0.0f;
    if (bs < bt) {
      a = sh.tmp[t * kLd32 + s];
    } else if (bs == bt && s <= t) {
      const int tt = t & 15, ss = s & 15;
      a = sh.diag[136 * bt + tt * (tt + 1) / 2 + ss];
    }
    sh.u.post.A[t * kLd16 + s] = from_float<E>(p.scale * a);
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i) {
    const int tile = 2 * warp + i, ti = tile >> 2, tj = tile & 3;
    for (int kk = ti; kk < 4; ++kk) {  // A[t, s] = 0 for t-blocks before s-block ti
      FragAT<E> a;  // Aᵀ
      FragB<E> bf;
      wmma::load_matrix_sync(a, sh.u.post.A + 16 * kk * kLd16 + 16 * ti, kLd16);
      wmma::load_matrix_sync(bf, sh.u.post.dO + 16 * kk * kLd16 + 16 * tj, kLd16);
      wmma::mma_sync(acc_dv[i], a, bf, acc_dv[i]);
    }
  }
  __syncthreads();
  for (int i = 0; i < 2; ++i) {
    const int tile = 2 * warp + i, ti = tile >> 2, tj = tile & 3;
    wmma::store_matrix_sync(sh.tmp + 16 * ti * kLd32 + 16 * tj, acc_dv[i], kLd32, wmma::mem_row_major);
  }
  __syncthreads();
  for (int e = tid; e < kChunk * kTile; e += kGradThreads) {
    const int t = e >> 6, c = e & 63;
    if (t < rows && c < vv) {
      static_cast<E*>(p.dv)[ch.batch * p.dv_stride[0] + (ch.t0 + t) * p.dv_stride[1] + h * p.dv_stride[2] + v0 + c] =
          from_float<E>(sh.tmp[t * kLd32 + c]);
    }
  }
}

}  // namespace gla::cuda::backward
