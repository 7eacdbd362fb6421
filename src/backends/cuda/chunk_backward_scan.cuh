// The backward's two state walks (SPEC.md §2 B0 and B1), one kernel template:
//   forward  S_{c+1}  = Diag(2^{b_last}) S_c      + (k ⊙ 2^{b_last - b})ᵀ v      from initial_state
//   reverse  dS_c     = Diag(2^{b_last}) dS_{c+1} + (scale q ⊙ 2^{b})ᵀ do       from dht; dh0 = dS_0
// Both have the form X ← Diag(decay) X + (keys ⊙ factor)ᵀ values, and the decay is diagonal in the
// keys, so a CTA owns one 64 x 64 (key tile, value tile) block of one (sequence, head) and walks the
// sequence's chunks, storing the block before each chunk's update: S_c (forward) or dS_{c+1}
// (reverse) for the gradient kernels. The block is fp32 in shared memory; the update runs on tensor
// cores with 16-bit operands.
#pragma once

#include "backends/cuda/chunk_backward_common.cuh"

namespace gla::cuda::backward {

constexpr int kScanThreads = 128;

template <typename E>
struct ScanShared {
  alignas(128) float state[kTile * kLd32];  // [key][value] block
  alignas(128) float b[kChunk * kTile];     // chunk-local cumulative gate, log2 units
  alignas(128) E keys[kChunk * kLd16];      // [token][key]: k ⊙ 2^{b_last - b} or scale q ⊙ 2^{b}
  alignas(128) E values[kChunk * kLd16];    // [token][value]: v or do
};

// grid: (N, H, 2 * key_tiles * value_tiles); z < key_tiles * value_tiles walks forward.
template <typename E>
__global__ void __launch_bounds__(kScanThreads) state_scan_kernel(BackwardParams p, BackwardPlan plan,
                                                                  Workspace ws) {
  namespace wmma = nvcuda::wmma;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  ScanShared<E>& sh = *reinterpret_cast<ScanShared<E>*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5;
  const int64_t n = blockIdx.x, h = blockIdx.y;
  const int tiles = plan.key_tiles * plan.value_tiles;
  const bool reverse = static_cast<int>(blockIdx.z) >= tiles;
  const int tile = static_cast<int>(blockIdx.z) % tiles;
  const int64_t k0 = int64_t(tile / plan.value_tiles) * kTile, v0 = int64_t(tile % plan.value_tiles) * kTile;
  const int64_t kv = p.K - k0 < kTile ? p.K - k0 : kTile, vv = p.V - v0 < kTile ? p.V - v0 : kTile;
  const Span seq = sequence(p, n);
  const int64_t chunks = (seq.len + kChunk - 1) / kChunk;
  const int64_t first_chunk = ws.chunk_offsets[n];

  // The walk's starting block: initial_state forward, dht in reverse (zeros when absent).
  const float* start = reverse ? p.dht : p.initial_state;
  const int64_t* start_stride = reverse ? p.dht_stride : p.h0_stride;
  for (int e = tid; e < kTile * kTile; e += kScanThreads) {
    const int r = e >> 6, c = e & 63;
    float x = 0.0f;
    if (start != nullptr && r < kv && c < vv) x = start[state_at(start_stride, p.state_v_first, n, h, k0 + r, v0 + c)];
    sh.state[r * kLd32 + c] = x;
  }
  __syncthreads();

  float* out = reverse ? ws.state_grads : ws.states;
  const void* key_src = reverse ? p.q : p.k;
  const int64_t* key_stride = reverse ? p.q_stride : p.k_stride;
  const void* value_src = reverse ? p.do_ : p.v;
  const int64_t* value_stride = reverse ? p.do_stride : p.v_stride;
  // The next chunk's tiles are in flight while this chunk is computed.
  GateTile<kScanThreads> gate;
  Tile16<kScanThreads> keys, values;
  auto prefetch = [&](int64_t step) {
    const int64_t c = reverse ? chunks - 1 - step : step;
    const int64_t t0 = seq.bos + c * kChunk;
    const int64_t rows = seq.len - c * kChunk < kChunk ? seq.len - c * kChunk : kChunk;
    load_gate_tile(gate, p, seq.batch, t0, h, rows, k0, p.vector_gate, tid);
    load_tile(keys, key_src, key_stride, seq.batch, t0, h, rows, k0, kv, p.vector_loads, tid);
    load_tile(values, value_src, value_stride, seq.batch, t0, h, rows, v0, vv, p.vector_loads, tid);
  };
  if (chunks > 0) prefetch(0);
  for (int64_t step = 0; step < chunks; ++step) {
    const int64_t c = reverse ? chunks - 1 - step : step;
    // Store the block: S_c forward, dS_{c+1} in reverse.
    float* dst = out + ((first_chunk + c) * p.H + h) * p.K * p.V;
    for (int e = tid; e < kTile * kTile; e += kScanThreads) {
      const int r = e >> 6, col = e & 63;
      if (r < kv && col < vv) dst[(k0 + r) * p.V + v0 + col] = sh.state[r * kLd32 + col];
    }
    store_tile(sh.keys, keys, tid);
    store_tile(sh.values, values, tid);
    gate_cumsum(sh.b, gate, tid);
    if (step + 1 < chunks) prefetch(step + 1);
    for (int e = tid; e < kChunk * kTile; e += kScanThreads) {
      const int t = e >> 6, col = e & 63;
      const float bt = sh.b[t * kTile + col], last = sh.b[(kChunk - 1) * kTile + col];
      const float factor = reverse ? p.scale * detail::fast_exp2(bt) : detail::fast_exp2(last - bt);
      E& x = sh.keys[t * kLd16 + col];
      x = from_float<E>(to_float(x) * factor);
      // The block's row `t` is key t: decay it by the chunk's total.
      const float decay = detail::fast_exp2(sh.b[(kChunk - 1) * kTile + t]);
      sh.state[t * kLd32 + col] *= decay;
    }
    __syncthreads();
    // block[key][value] += keysᵀ · values: warp w owns key rows 16w..16w+15.
    for (int vt = 0; vt < 4; ++vt) {
      FragC acc;
      float* block = sh.state + (16 * warp) * kLd32 + 16 * vt;
      wmma::load_matrix_sync(acc, block, kLd32, wmma::mem_row_major);
      for (int kk = 0; kk < 4; ++kk) {
        FragAT<E> a;
        FragB<E> bf;
        wmma::load_matrix_sync(a, sh.keys + (16 * kk) * kLd16 + 16 * warp, kLd16);
        wmma::load_matrix_sync(bf, sh.values + (16 * kk) * kLd16 + 16 * vt, kLd16);
        wmma::mma_sync(acc, a, bf, acc);
      }
      wmma::store_matrix_sync(block, acc, kLd32, wmma::mem_row_major);
    }
    __syncthreads();
  }
  if (reverse && p.dh0 != nullptr) {
    for (int e = tid; e < kTile * kTile; e += kScanThreads) {
      const int r = e >> 6, c = e & 63;
      if (r < kv && c < vv) p.dh0[state_at(p.dh0_stride, p.state_v_first, n, h, k0 + r, v0 + c)] = sh.state[r * kLd32 + c];
    }
  }
}

}  // namespace gla::cuda::backward
