// Pieces the backward kernels share: tile geometry, locating a chunk, tile loads into shared memory,
// the chunk-local gate cumsum.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backends/cuda/chunk_backward.hpp"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::backward {

using detail::kLog2e;

// kChunk, kTile, kScanValues, kStateBytes: chunk_backward.hpp (the planner uses them too).
constexpr int kLd16 = 72;   // row pitch of 16-bit tiles in shared memory (elements): 144 B rows
// log2-unit floor of a gate: 2^-160 is 0 in fp32, so a hard reset (g = -inf, SPEC §3.8) stays a
// reset, and chunk-local sums stay finite (no -inf - -inf).
constexpr float kGateFloor = -160.0f;

// Tokens [bos, bos + len) of batch row `batch`.
using Span = detail::SeqSpan;
__device__ __forceinline__ Span sequence(const BackwardParams& p, int64_t n) { return detail::sequence_span(p, n); }

// The chunk at global index `chunk`: its sequence, the chunk's first token and valid length.
struct ChunkRef {
  int64_t n, batch, t0;
  int len;  // <= kChunk
  int64_t index_in_sequence;
};

__device__ __forceinline__ ChunkRef locate_chunk(const BackwardParams& p, const int64_t* chunk_offsets,
                                                 int64_t chunk) {
  if (!p.varlen) {
    // Equal sequences: a division, not the table's dependent loads (a chunk index fits the grid's
    // 32 bits). The search's three L2 round trips opened every dqk CTA at B8 T4096.
    const uint32_t per_sequence = static_cast<uint32_t>((p.T + kChunk - 1) / kChunk);
    const uint32_t n = static_cast<uint32_t>(chunk) / per_sequence;
    const int64_t c = static_cast<uint32_t>(chunk) - n * per_sequence;
    const int64_t left = p.T - c * kChunk;
    return {n, n, c * kChunk, static_cast<int>(left < kChunk ? left : kChunk), c};
  }
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
  const int64_t left = s.len - c * kChunk;
  return {lo, s.batch, t0, static_cast<int>(left < kChunk ? left : kChunk), c};
}

// Tile loads go through registers: every load of a tile is issued before any is stored, so a tile
// costs one memory latency rather than one per element (the scalar first version of the scans spent
// ~55 us per chunk waiting). `vector` selects 16-byte loads (rows 16-byte aligned, widths multiples
// of 8); otherwise eight independent scalar loads fill each 16-byte group.

// A [64 rows x 64 columns] tile of a [B, T, H, D] 16-bit tensor (rows t0.., columns c0..) as
// 16-byte groups; rows >= rows_valid, columns >= cols_valid and a null base read as zero.
template <int NT>
struct Tile16 {
  static constexpr int kGroups = kChunk * kTile / 8 / NT;
  uint4 r[kGroups];
};

// Thread tid's groups of a tile: rows tid / 8 + (NT / 8) i, columns 8 (tid % 8) .. + 7 for every i,
// so one row offset steps by NT / 8 rows (the per-group 64-bit index products were ~25 instructions
// a group).
template <int NT>
__device__ __forceinline__ void load_tile(Tile16<NT>& regs, const void* base, const int64_t* stride, int64_t batch,
                                          int64_t t0, int64_t h, int64_t rows_valid, int64_t c0, int64_t cols_valid,
                                          bool vector, int tid) {
  static_assert(NT % 8 == 0, "a thread's groups share their columns");
  const int r0 = tid >> 3, c = (tid & 7) * 8;
  const uint16_t* src = static_cast<const uint16_t*>(base);
  int64_t at = batch * stride[0] + (t0 + r0) * stride[1] + h * stride[2] + c0 + c;
  const int64_t step = int64_t(NT / 8) * stride[1];
#pragma unroll
  for (int i = 0; i < Tile16<NT>::kGroups; ++i, at += step) {
    const int r = r0 + (NT / 8) * i;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (src != nullptr && r < rows_valid) {
      const uint16_t* row = src + at;
      if (vector) {
        if (c < cols_valid) x = *reinterpret_cast<const uint4*>(row);
      } else {
        uint16_t v[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = c + j < cols_valid ? row[j] : uint16_t(0);
        x = make_uint4(v[0] | (uint32_t(v[1]) << 16), v[2] | (uint32_t(v[3]) << 16), v[4] | (uint32_t(v[5]) << 16),
                       v[6] | (uint32_t(v[7]) << 16));
      }
    }
    regs.r[i] = x;
  }
}

// Stores a loaded tile into shared memory: the 8 elements of row r from column c (a multiple of 8)
// at dst + offset(r, c).
template <typename E, int NT, typename Offset>
__device__ __forceinline__ void store_tile_at(E* dst, const Tile16<NT>& regs, int tid, Offset offset) {
#pragma unroll
  for (int i = 0; i < Tile16<NT>::kGroups; ++i) {
    const int e = tid + i * NT;
    *reinterpret_cast<uint4*>(dst + offset(e >> 3, (e & 7) * 8)) = regs.r[i];
  }
}

// The same with row pitch `pitch` (elements, a multiple of 8).
template <typename E, int NT>
__device__ __forceinline__ void store_tile(E* dst, const Tile16<NT>& regs, int tid, int pitch = kLd16) {
  store_tile_at(dst, regs, tid, [pitch](int r, int c) { return r * pitch + c; });
}

// The gate of a tile's 64 rows and 64 key columns (c0..), as loaded: raw words, converted by
// gate_group only when gate_cumsum needs them, so a prefetch's loads stay in flight while the current
// chunk is computed (converting at the load made every prefetch wait for its gate). Rows past the
// chunk and columns past K hold 0 (0.0 in every format). Per group of 8 columns:
//   16-bit per-key gate: 8 values in lo; fp32 per-key gate: 8 values in lo, hi; per-head gate: the
//   head's one value in lo.x (repeated over the columns by gate_group).
template <int NT>
struct GateTile {
  static constexpr int kGroups = kChunk * kTile / 8 / NT;
  uint4 lo[kGroups], hi[kGroups];
};

template <int NT>
__device__ __forceinline__ void load_gate_tile(GateTile<NT>& regs, const BackwardParams& p, int64_t batch, int64_t t0,
                                               int64_t h, int64_t rows_valid, int64_t c0, bool vector, int tid) {
  static_assert(NT % 8 == 0, "a thread's groups share their columns");
  const int64_t cols_valid = p.K - c0;
  const int r0 = tid >> 3, c = (tid & 7) * 8;
  int64_t at = batch * p.g_stride[0] + (t0 + r0) * p.g_stride[1] + h * p.g_stride[2] + (p.gate_per_head ? 0 : c0 + c);
  const int64_t step = int64_t(NT / 8) * p.g_stride[1];
  const bool wide = p.gate_dtype == kF32;
  const uint16_t* g16 = static_cast<const uint16_t*>(p.g);
  const uint32_t* g32 = static_cast<const uint32_t*>(p.g);
#pragma unroll
  for (int i = 0; i < GateTile<NT>::kGroups; ++i, at += step) {
    const int r = r0 + (NT / 8) * i;
    uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
    if (r < rows_valid) {
      if (p.gate_per_head) {
        lo.x = wide ? g32[at] : uint32_t(g16[at]);
      } else if (vector) {
        if (c < cols_valid) {  // K % 8 == 0 on this path: the whole group is inside
          if (wide) {
            lo = *reinterpret_cast<const uint4*>(g32 + at);
            hi = *reinterpret_cast<const uint4*>(g32 + at + 4);
          } else {
            lo = *reinterpret_cast<const uint4*>(g16 + at);
          }
        }
      } else if (wide) {
        uint32_t w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = c + j < cols_valid ? g32[at + j] : 0u;
        lo = make_uint4(w[0], w[1], w[2], w[3]);
        hi = make_uint4(w[4], w[5], w[6], w[7]);
      } else {
        uint32_t w[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = c + j < cols_valid ? uint32_t(g16[at + j]) : 0u;
        lo = make_uint4(w[0] | (w[1] << 16), w[2] | (w[3] << 16), w[4] | (w[5] << 16), w[6] | (w[7] << 16));
      }
    }
    regs.lo[i] = lo;
    regs.hi[i] = hi;
  }
}

// Group i of a loaded gate tile as fp32 in log2 units, floored at kGateFloor.
template <int NT>
__device__ __forceinline__ void gate_group(float (&x)[8], const GateTile<NT>& regs, int i, const BackwardParams& p) {
  const uint32_t lo[4] = {regs.lo[i].x, regs.lo[i].y, regs.lo[i].z, regs.lo[i].w};
  const uint32_t hi[4] = {regs.hi[i].x, regs.hi[i].y, regs.hi[i].z, regs.hi[i].w};
  if (p.gate_per_head) {
    const uint32_t w = lo[0];
    const float y = p.gate_dtype == kF32   ? __uint_as_float(w)
                    : p.gate_dtype == kF16 ? detail::Elem<__half>::to_float(uint16_t(w))
                                           : detail::Elem<__nv_bfloat16>::to_float(uint16_t(w));
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = y;
  } else if (p.gate_dtype == kF32) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[j] = __uint_as_float(lo[j]);
      x[4 + j] = __uint_as_float(hi[j]);
    }
  } else {
    auto unpack = [&](auto element) {  // element: detail::Elem<bf16 or fp16>
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = decltype(element)::to_float2(lo[j]);
        x[2 * j] = f.x;
        x[2 * j + 1] = f.y;
      }
    };
    if (p.gate_dtype == kBF16) unpack(detail::Elem<__nv_bfloat16>{});
    else unpack(detail::Elem<__half>{});
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = fmaxf(x[j] * kLog2e, kGateFloor);  // fmaxf(0, floor) is 0
}

// b[t][c] = chunk-local inclusive cumsum of the loaded gate (converted here by gate_group) (row pitch PITCH, fp32). Rows past the
// chunk read g = 0, so they hold b_last. Thread (column tid % 64, row group tid / 64) sums its
// 64 / (NT / 64) rows, then adds the earlier groups' sums (`group_sums`, [NT / 64][64] floats) in
// group order: a dependent chain of 64 / (NT / 64) + NT / 64 adds instead of 64 (a fixed order, so
// reruns are bitwise).
template <int NT, int PITCH = kTile>
__device__ __forceinline__ void gate_cumsum(float* b, const GateTile<NT>& regs, const BackwardParams& p,
                                            float* group_sums, int tid) {
  static_assert(NT % kTile == 0 && NT <= kChunk * kTile / 8, "whole row groups, at least one row each");
  constexpr int kGroupsOfRows = NT / kTile, kRows = kChunk / kGroupsOfRows;
#pragma unroll
  for (int i = 0; i < GateTile<NT>::kGroups; ++i) {
    const int e = tid + i * NT, r = e >> 3, c = (e & 7) * 8;
    float x[8];
    gate_group(x, regs, i, p);
    *reinterpret_cast<float4*>(b + r * PITCH + c) = make_float4(x[0], x[1], x[2], x[3]);
    *reinterpret_cast<float4*>(b + r * PITCH + c + 4) = make_float4(x[4], x[5], x[6], x[7]);
  }
  __syncthreads();
  const int c = tid % kTile, group = tid / kTile, r0 = group * kRows;
  float x[kRows];
  float sum = 0.0f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    x[r] = b[(r0 + r) * PITCH + c];
    sum += x[r];
  }
  group_sums[group * kTile + c] = sum;
  __syncthreads();
  float acc = 0.0f;
#pragma unroll
  for (int g = 0; g < kGroupsOfRows - 1; ++g) {
    if (g < group) acc += group_sums[g * kTile + c];
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    acc += x[r];
    b[(r0 + r) * PITCH + c] = acc;
  }
  __syncthreads();
}

// Offset of a state entry (n, h, key i, value j) with layout and strides.
__device__ __forceinline__ int64_t state_at(const int64_t* s, int32_t v_first, int64_t n, int64_t h, int64_t i,
                                            int64_t j) {
  return v_first ? n * s[0] + h * s[1] + j * s[2] + i * s[3] : n * s[0] + h * s[1] + i * s[2] + j * s[3];
}

// Chunk states S_c and state gradients dS_{c+1} are kept in bf16 in the workspace: they are only
// ever tensor-core operands (rounded to 16 bits there anyway) and the row sums of S_c ⊙ dS_{c+1};
// bf16 has fp32's range, so fp16 inputs cannot overflow them. Half the bytes of fp32 (0.5 GB less
// workspace at B8 T4096 H16 D128).
using StateElement = __nv_bfloat16;
static_assert(sizeof(StateElement) == kStateBytes, "the planner sizes the states with kStateBytes");

// Workspace views.
struct Workspace {
  int64_t* chunk_offsets;
  StateElement* states;
  StateElement* state_grads;
  float* gate_partials;
  float* segment_states;  // the state walks' segment split (null without one)
  float* segment_decay;
};

__host__ __device__ __forceinline__ Workspace workspace_views(const BackwardPlan& plan, void* base) {
  char* w = static_cast<char*>(base);
  return {reinterpret_cast<int64_t*>(w + plan.chunk_offsets), reinterpret_cast<StateElement*>(w + plan.states),
          reinterpret_cast<StateElement*>(w + plan.state_grads),
          plan.gate_partials ? reinterpret_cast<float*>(w + plan.gate_partials) : nullptr,
          plan.scan_segment_chunks ? reinterpret_cast<float*>(w + plan.segment_states) : nullptr,
          plan.scan_segment_chunks ? reinterpret_cast<float*>(w + plan.segment_decay) : nullptr};
}

}  // namespace gla::cuda::backward
