// Small device helpers shared by the CUDA backend's kernels: element conversions, tensor-core
// fragments (mma.sync m16n8k16, ldmatrix, stmatrix), cp.async and fast exp2.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backends/cuda/chunk_forward.hpp"

namespace gla::cuda::detail {

constexpr float kLog2e = 1.4426950408889634f;

__host__ __device__ __forceinline__ int64_t gla_min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t gla_max64(int64_t a, int64_t b) { return a > b ? a : b; }
// Column of a lane's first element in an mma.sync C fragment (and in a B fragment's row pair).
__device__ __forceinline__ int fc_of(int lane) { return (lane & 3) * 2; }

// 2^x by the special-function unit (relative error ~2^-22); x <= 0 everywhere we call it.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- 16-bit element types as raw bits ----
template <typename E>
struct Elem;

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kType = kBF16;
  __device__ __forceinline__ static float to_float(uint16_t x) { return __uint_as_float(uint32_t(x) << 16); }
  __device__ __forceinline__ static float2 to_float2(uint32_t x) {
    return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    return *reinterpret_cast<uint16_t*>(&h);
  }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // c = a b (no accumulator to clear first: ptxas feeds zero as C).
  __device__ __forceinline__ static void mma_first(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
};

template <>
struct Elem<__half> {
  static constexpr int kType = kF16;
  __device__ __forceinline__ static float to_float(uint16_t x) { return __half2float(__ushort_as_half(x)); }
  __device__ __forceinline__ static float2 to_float2(uint32_t x) {
    return __half22float2(*reinterpret_cast<__half2*>(&x));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static uint16_t from_float(float x) { return __half_as_ushort(__float2half_rn(x)); }
  __device__ __forceinline__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // c = a b (no accumulator to clear first: ptxas feeds zero as C).
  __device__ __forceinline__ static void mma_first(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};\n"
        : "=f"(c[0]), "=f"(c[1]), "=f"(c[2]), "=f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f));
  }
};

// Any element type of the API read as float (fp32, fp16, bf16), from global memory.
__device__ __forceinline__ float load_any(const void* base, int64_t index, int32_t type) {
  if (type == kF32) return static_cast<const float*>(base)[index];
  uint16_t bits = static_cast<const uint16_t*>(base)[index];
  if (type == kF16) return __half2float(__ushort_as_half(bits));
  return __uint_as_float(uint32_t(bits) << 16);
}
__device__ __forceinline__ void store_any(void* base, int64_t index, int32_t type, float x) {
  if (type == kF32) {
    static_cast<float*>(base)[index] = x;
  } else if (type == kF16) {
    static_cast<uint16_t*>(base)[index] = __half_as_ushort(__float2half_rn(x));
  } else {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    static_cast<uint16_t*>(base)[index] = *reinterpret_cast<uint16_t*>(&h);
  }
}

// ---- ldmatrix / cp.async ----
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void ldsm_x4(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// Four 8x8 b16 matrices to shared memory (sm_90): lane l gives the address of row l % 8 of matrix
// l / 8; register i holds this lane's pair of matrix i (.trans: stored transposed).
__device__ __forceinline__ void stsm_x4(const void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stsm_x4_trans(const void* p, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(p)),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
// 16 bytes global -> shared; reads nothing and writes zeros when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// All but this thread's most recent group complete.
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

// Sequence bounds: [bos, bos + len) of batch row `batch`.
// A sequence's rows: batch row, first token, length. lead: the zero tokens a padded walk puts
// before the first one (ForwardParams::pad_front; bos and len then count them): the rows of chunk 0
// below it read zero and are not written.
struct SeqSpan {
  int64_t batch, bos, len;
  int lead = 0;
  __device__ __forceinline__ int first_row(int64_t chunk) const { return chunk == 0 ? lead : 0; }
};
// Params: any parameter struct with varlen, cu_seqlens, cu_seqlens_int64 and T (forward, backward).
template <typename Params>
__device__ __forceinline__ SeqSpan sequence_span(const Params& p, int64_t n) {
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

constexpr int kChunkOffsetThreads = 1024;

// offsets[n] = sum over m < n of ceil(T_m / 64) (n = 0..N), from device cu_seqlens: one CTA of
// kChunkOffsetThreads, a block scan. The backward's chunk table; the forward's varlen state slots.
template <typename Params>
__global__ void __launch_bounds__(kChunkOffsetThreads) chunk_offsets_kernel(Params p, int64_t* offsets) {
  __shared__ int64_t partial[kChunkOffsetThreads];
  const int tid = threadIdx.x;
  const int64_t per = (p.N + kChunkOffsetThreads - 1) / kChunkOffsetThreads;
  const int64_t n0 = tid * per < p.N ? tid * per : p.N;
  const int64_t n1 = n0 + per < p.N ? n0 + per : p.N;
  int64_t count = 0;
  for (int64_t n = n0; n < n1; ++n) count += (sequence_span(p, n).len + kChunk - 1) / kChunk;
  partial[tid] = count;
  __syncthreads();
  for (int stride = 1; stride < kChunkOffsetThreads; stride <<= 1) {
    const int64_t add = tid >= stride ? partial[tid - stride] : 0;
    __syncthreads();
    partial[tid] += add;
    __syncthreads();
  }
  int64_t running = partial[tid] - count;  // exclusive prefix
  if (tid == 0) offsets[0] = 0;
  for (int64_t n = n0; n < n1; ++n) {
    running += (sequence_span(p, n).len + kChunk - 1) / kChunk;
    offsets[n + 1] = running;
  }
}

// Offset of state entry (n, h, key i, value j) honouring layout and strides.
__device__ __forceinline__ int64_t state_index(const int64_t* s, int32_t v_first, int64_t n, int64_t h,
                                               int64_t i, int64_t j) {
  return v_first ? n * s[0] + h * s[1] + j * s[2] + i * s[3] : n * s[0] + h * s[1] + i * s[2] + j * s[3];
}

}  // namespace gla::cuda::detail
