// The recurrent forward kernel (recurrent_forward.hpp).
//
// Thread layout (128 threads): lane group cg = tid % 8 owns 4 consecutive floats of the contiguous
// state dimension (one float4), row group rg = tid / 8 owns every 16th row. Key-major states
// ([K, V]): rows are keys i = rg + 16 r, columns the tile's values 4 cg .. 4 cg + 3, so a warp's
// float4 loads cover four 128-byte rows. V-first states ([V, K]): rows are the tile's values
// rg + 16 r (r = 0, 1), columns keys 32 b + 4 cg .. + 3, likewise 128-byte runs. Either way a
// thread holds KT / 4 floats, and per token reads the token's q, k, gk, v, gv from shared memory.
// The output's sum over keys is a shuffle over the row groups of a warp and a shared-memory sum over
// the 4 warps (key-major), or a shuffle over the 8 lanes of a lane group (V-first).
#include <cuda_runtime.h>

#include "backends/cuda/device_utils.cuh"
#include "backends/cuda/recurrent_forward.hpp"

namespace gla::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kTile = static_cast<int>(kRecurrentValueTile);

__device__ __forceinline__ float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void store4(float* p, float4 x) { *reinterpret_cast<float4*>(p) = x; }
__device__ __forceinline__ float& at(float4& x, int c) { return reinterpret_cast<float*>(&x)[c]; }

// CTAs per SM the register budget is held to: a decode step is a read and a write of the state, so
// its speed is the bytes in flight, i.e. resident CTAs. Unbounded, ptxas took 128 registers at
// KT = 128 (4 CTAs per SM) and 178-246 at KT = 256 (2); these bounds give 80 at KT = 128 (6 CTAs,
// 20 bytes spilled in the V-first layout), 64 at KT = 64 (8) and 152-162 at KT = 256 (3). H200 pool
// update, graph replay: 0.205 -> 0.177 ms at B256 H16 K=V=128, 0.130 -> 0.112 ms at B64 H4 K256 V512.
template <int KT>
constexpr int kMinBlocksPerSm = KT <= 64 ? 8 : (KT <= 128 ? 6 : 3);

template <int KT, bool kVFirst>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<KT>) recurrent_forward_kernel(const RecurrentParams p) {
  constexpr int kRegs = KT / 16;  // float4 per thread
  constexpr int kKeyBlocks = KT / 32;
  __shared__ float sq[KT], sk[KT], sa[KT];
  __shared__ float sv[kTile], sb[kTile];
  __shared__ float so[4][kTile];

  const int tid = threadIdx.x, cg = tid & 7, rg = tid >> 3, lane = tid & 31, warp = tid >> 5;
  const int64_t value_tiles = (p.V + kTile - 1) / kTile;
  const int64_t n = blockIdx.x / value_tiles;
  const int64_t v0 = (blockIdx.x % value_tiles) * kTile;
  const int64_t h = blockIdx.y;

  int64_t batch = n, bos = 0, length = p.T;
  if (p.cu_seqlens) {
    const int64_t a = p.cu_seqlens_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n] : static_cast<const int32_t*>(p.cu_seqlens)[n];
    const int64_t e = p.cu_seqlens_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[n + 1] : static_cast<const int32_t*>(p.cu_seqlens)[n + 1];
    batch = 0;
    bos = a;
    length = e - a;
  }

  // Element offset of the float4 of register r in a state tensor with strides s (dims 0..2).
  auto state_offset = [&](const int64_t* s, int r, int64_t index) -> int64_t {
    if constexpr (kVFirst) {
      const int64_t j = v0 + rg + 16 * (r / kKeyBlocks), i = 32 * (r % kKeyBlocks) + 4 * cg;
      return index * s[0] + h * s[1] + j * s[2] + i;
    } else {
      const int64_t i = rg + 16 * r, j = v0 + 4 * cg;
      return index * s[0] + h * s[1] + i * s[2] + j;
    }
  };
  auto valid = [&](int r) -> bool {
    if constexpr (kVFirst) {
      return v0 + rg + 16 * (r / kKeyBlocks) < p.V && 32 * (r % kKeyBlocks) + 4 * cg < p.K;
    } else {
      return rg + 16 * r < p.K && v0 + 4 * cg < p.V;
    }
  };
  auto store_o = [&](int64_t tok, int64_t j, float x) {
    detail::store_any(p.o, batch * p.o_stride[0] + tok * p.o_stride[1] + h * p.o_stride[2] + j, p.dtype, x);
  };

  // The state index; a pool slot out of range, or one an earlier sequence uses, skips the sequence.
  // The state tile's loads are issued before the scan for repeats, so the two latencies overlap.
  int64_t state = n;
  bool in_range = true;
  if (p.slots) {
    state = p.slots[n * p.slot_stride];
    in_range = state >= 0 && state < p.pool_size;
  }
  float4 S[kRegs];
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int r = 0; r < kRegs; ++r) {
    S[r] = p.initial_state && in_range && valid(r) ? load4(p.initial_state + state_offset(p.h0_stride, r, state)) : zero;
  }
  int error = 0;
  if (p.slots) {
    bool repeated = false;
    for (int64_t m = tid; m < n; m += kThreads) repeated |= p.slots[m * p.slot_stride] == state;
    repeated = __syncthreads_or(repeated);
    if (!in_range) {
      error = 1;  // GLA_SLOT_ERROR_OUT_OF_RANGE
    } else if (repeated) {
      error = 2;  // GLA_SLOT_ERROR_REPEATED
    }
  }

  if (error) {
    for (int64_t step = 0; step < length; ++step) {
      const int64_t tok = bos + step;
      if (tid < kTile && v0 + tid < p.V) store_o(tok, v0 + tid, 0.f);
      if (p.token_states) {
#pragma unroll
        for (int r = 0; r < kRegs; ++r) {
          if (!valid(r)) continue;
          store4(p.token_states + batch * p.ts_stride[0] + tok * p.ts_stride[1] + state_offset(p.ts_stride + 1, r, 0), zero);
        }
      }
    }
    if (tid == 0 && blockIdx.x % value_tiles == 0 && h == 0) atomicOr(p.slot_error, error);
    return;
  }

  for (int64_t step = 0; step < length; ++step) {
    const int64_t tok = bos + (p.reverse ? length - 1 - step : step);
    __syncthreads();  // the previous token's shared vectors are no longer read
    for (int i = tid; i < KT; i += kThreads) {
      float qi = 0.f, ki = 0.f, ai = 1.f;
      if (i < p.K) {
        qi = detail::load_any(p.q, batch * p.q_stride[0] + tok * p.q_stride[1] + h * p.q_stride[2] + i, p.dtype);
        ki = detail::load_any(p.k, batch * p.k_stride[0] + tok * p.k_stride[1] + h * p.k_stride[2] + i, p.dtype);
        if (p.gk) ai = expf(detail::load_any(p.gk, batch * p.gk_stride[0] + tok * p.gk_stride[1] + h * p.gk_stride[2] + i, p.gk_dtype));
      }
      sq[i] = qi;
      sk[i] = ki;
      sa[i] = ai;
    }
    if (tid < kTile) {
      const int64_t j = v0 + tid;
      float vj = 0.f, bj = 1.f;
      if (j < p.V) {
        vj = detail::load_any(p.v, batch * p.v_stride[0] + tok * p.v_stride[1] + h * p.v_stride[2] + j, p.dtype);
        if (p.gv) bj = expf(detail::load_any(p.gv, batch * p.gv_stride[0] + tok * p.gv_stride[1] + h * p.gv_stride[2] + j, p.gv_dtype));
      }
      sv[tid] = vj;
      sb[tid] = bj;
    }
    __syncthreads();

    if constexpr (kVFirst) {
      float o[2] = {0.f, 0.f};
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int jl = rg + 16 * (r / kKeyBlocks), i0 = 32 * (r % kKeyBlocks) + 4 * cg;
        const float vj = sv[jl], bj = sb[jl];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float& s = at(S[r], c);
          s = fmaf(sa[i0 + c] * bj, s, sk[i0 + c] * vj);
          o[r / kKeyBlocks] = fmaf(sq[i0 + c], s, o[r / kKeyBlocks]);
        }
      }
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        o[x] += __shfl_xor_sync(0xffffffffu, o[x], 1);
        o[x] += __shfl_xor_sync(0xffffffffu, o[x], 2);
        o[x] += __shfl_xor_sync(0xffffffffu, o[x], 4);
        const int64_t j = v0 + rg + 16 * x;
        if (cg == 0 && j < p.V) store_o(tok, j, p.scale * o[x]);
      }
    } else {
      float4 o = zero;
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        const int i = rg + 16 * r;
        const float ai = sa[i], ki = sk[i], qi = sq[i];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float& s = at(S[r], c);
          s = fmaf(ai * sb[4 * cg + c], s, ki * sv[4 * cg + c]);
          at(o, c) = fmaf(qi, s, at(o, c));
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        at(o, c) += __shfl_xor_sync(0xffffffffu, at(o, c), 8);
        at(o, c) += __shfl_xor_sync(0xffffffffu, at(o, c), 16);
      }
      if (lane < 8) {
#pragma unroll
        for (int c = 0; c < 4; ++c) so[warp][4 * cg + c] = at(o, c);
      }
      __syncthreads();
      if (tid < kTile && v0 + tid < p.V) store_o(tok, v0 + tid, p.scale * (so[0][tid] + so[1][tid] + so[2][tid] + so[3][tid]));
    }

    if (p.token_states) {
      const int64_t base = batch * p.ts_stride[0] + tok * p.ts_stride[1];
#pragma unroll
      for (int r = 0; r < kRegs; ++r) {
        if (valid(r)) store4(p.token_states + base + state_offset(p.ts_stride + 1, r, 0), S[r]);
      }
    }
  }

  if (p.final_state) {
#pragma unroll
    for (int r = 0; r < kRegs; ++r) {
      if (valid(r)) store4(p.final_state + state_offset(p.ht_stride, r, state), S[r]);
    }
  }
}

template <int KT, bool kVFirst>
cudaError_t launch(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t value_tiles = (p.V + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(p.N * value_tiles), static_cast<unsigned>(p.H));
  recurrent_forward_kernel<KT, kVFirst><<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <bool kVFirst>
cudaError_t launch_for_width(const RecurrentParams& p, cudaStream_t stream) {
  if (p.K <= 64) return launch<64, kVFirst>(p, stream);
  if (p.K <= 128) return launch<128, kVFirst>(p, stream);
  return launch<256, kVFirst>(p, stream);
}

}  // namespace

int launch_recurrent_forward(const RecurrentParams& p, void* stream) {
  if (p.N == 0 || p.H == 0) return cudaSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  return p.state_v_first ? launch_for_width<true>(p, s) : launch_for_width<false>(p, s);
}

}  // namespace gla::cuda
