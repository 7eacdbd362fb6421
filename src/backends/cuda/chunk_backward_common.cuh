// Pieces the backward kernels share: tile geometry, locating a chunk, tile loads into shared memory,
// the chunk-local gate cumsum and the WMMA fragment types.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include "backends/cuda/chunk_backward.hpp"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::backward {

using detail::kLog2e;

constexpr int kChunk = 64;  // tokens per chunk (SPEC.md §2)
constexpr int kTile = 64;   // key / value columns per tile
constexpr int kLd16 = 72;   // row pitch of 16-bit tiles in shared memory (elements): 144 B rows
constexpr int kLd32 = 68;   // row pitch of fp32 tiles (elements): 272 B rows
// log2-unit floor of a gate: 2^-160 is 0 in fp32, so a hard reset (g = -inf, SPEC §3.8) stays a
// reset, and chunk-local sums stay finite (no -inf - -inf).
constexpr float kGateFloor = -160.0f;

template <typename E>
using FragA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, E, nvcuda::wmma::row_major>;
template <typename E>
using FragAT = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, E, nvcuda::wmma::col_major>;
template <typename E>
using FragB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, E, nvcuda::wmma::row_major>;
template <typename E>
using FragBT = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, E, nvcuda::wmma::col_major>;
using FragC = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;

template <typename E>
__device__ __forceinline__ E from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Tokens [bos, bos + len) of batch row `batch`.
struct Span {
  int64_t batch, bos, len;
};

__device__ __forceinline__ Span sequence(const BackwardParams& p, int64_t n) {
  if (!p.varlen) return {n, 0, p.T};
  int64_t a, b;
  if (p.cu_seqlens_int64) {
    a = static_cast<const int64_t*>(p.cu_seqlens)[n];
    b = static_cast<const int64_t*>(p.cu_seqlens)[n + 1];
  } else {
    a = static_cast<const int32_t*>(p.cu_seqlens)[n];
    b = static_cast<const int32_t*>(p.cu_seqlens)[n + 1];
  }
  return {0, a, b - a};
}

// The chunk at global index `chunk`: its sequence, the chunk's first token and valid length.
struct ChunkRef {
  int64_t n, batch, t0, len, index_in_sequence;
};

__device__ __forceinline__ ChunkRef locate_chunk(const BackwardParams& p, const int64_t* chunk_offsets,
                                                 int64_t chunk) {
  // The last sequence whose first chunk is <= chunk (empty sequences share their successor's offset
  // and are skipped by taking the last).
  int64_t lo = 0, hi = p.N;  // chunk_offsets[lo] <= chunk < chunk_offsets[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= chunk) lo = mid; else hi = mid;
  }
  const Span s = sequence(p, lo);
  const int64_t c = chunk - chunk_offsets[lo];
  const int64_t t0 = s.bos + c * kChunk;
  const int64_t len = s.len - c * kChunk < kChunk ? s.len - c * kChunk : kChunk;
  return {lo, s.batch, t0, len, c};
}

// A [64 rows x 64 columns] tile of a [B, T, H, D] 16-bit tensor (rows t0.., columns c0..) into
// shared memory with row pitch kLd16; rows >= rows_valid, columns >= cols_valid and a null base read
// as zero.
template <typename E>
__device__ __forceinline__ void load_tile(E* dst, const void* base, const int64_t* stride, int64_t batch,
                                          int64_t t0, int64_t h, int64_t rows_valid, int64_t c0,
                                          int64_t cols_valid, int tid, int nthreads) {
  const uint16_t* src = static_cast<const uint16_t*>(base);
  const int64_t row0 = batch * stride[0] + t0 * stride[1] + h * stride[2] + c0;
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (int e = tid; e < kChunk * kTile; e += nthreads) {
    const int r = e >> 6, c = e & 63;
    uint16_t x = 0;
    if (src != nullptr && r < rows_valid && c < cols_valid) x = src[row0 + r * stride[1] + c];
    out[r * kLd16 + c] = x;
  }
}

// b[t][c] = chunk-local inclusive cumsum of g * log2(e) (floored at kGateFloor per step) for the
// tile's key columns c0.. (row pitch kTile, fp32). Rows past the chunk read g = 0, so they hold b_last.
// A per-head gate fills every column with the head's cumsum.
__device__ __forceinline__ void gate_cumsum(float* b, const BackwardParams& p, int64_t batch, int64_t t0,
                                            int64_t h, int64_t rows_valid, int64_t c0, int tid,
                                            int nthreads) {
  const int64_t cols_valid = p.gate_per_head ? kTile : p.K - c0;
  const int64_t row0 = batch * p.g_stride[0] + t0 * p.g_stride[1] + h * p.g_stride[2] +
                       (p.gate_per_head ? 0 : c0);
  for (int e = tid; e < kChunk * kTile; e += nthreads) {
    const int r = e >> 6, c = e & 63;
    float x = 0.0f;
    if (r < rows_valid && c < cols_valid) {
      const int64_t at = row0 + r * p.g_stride[1] + (p.gate_per_head ? 0 : c);
      x = fmaxf(detail::load_any(p.g, at, p.gate_dtype) * kLog2e, kGateFloor);
    }
    b[r * kTile + c] = x;
  }
  __syncthreads();
  if (tid < kTile) {
    float acc = 0.0f;
    for (int r = 0; r < kChunk; ++r) {
      acc += b[r * kTile + tid];
      b[r * kTile + tid] = acc;
    }
  }
  __syncthreads();
}

// Offset of a state entry (n, h, key i, value j) with layout and strides.
__device__ __forceinline__ int64_t state_at(const int64_t* s, int32_t v_first, int64_t n, int64_t h, int64_t i,
                                            int64_t j) {
  return v_first ? n * s[0] + h * s[1] + j * s[2] + i * s[3] : n * s[0] + h * s[1] + i * s[2] + j * s[3];
}

// Workspace views.
struct Workspace {
  int64_t* chunk_offsets;
  float* states;
  float* state_grads;
  float* gate_partials;
};

__host__ __device__ __forceinline__ Workspace workspace_views(const BackwardPlan& plan, void* base) {
  char* w = static_cast<char*>(base);
  return {reinterpret_cast<int64_t*>(w + plan.chunk_offsets), reinterpret_cast<float*>(w + plan.states),
          reinterpret_cast<float*>(w + plan.state_grads),
          plan.gate_partials ? reinterpret_cast<float*>(w + plan.gate_partials) : nullptr};
}

}  // namespace gla::cuda::backward
