// wgmma (sm_90a) building blocks for the prepared key split's state group (ForwardParams::prepared
// on sm_90a; chunk_forward_ws_kernel.cuh): descriptors of tiles in the 128-byte-swizzled layout
// (sw128_off, chunk_layout.hpp), fences, and the two product shapes the state group needs, with
// the A operand from registers:
//   m64n64k16,  B K-major (imm-trans-b 0): o^T += S^T qg^T and o^T += V^T A^T
//   m64n128k16, B N-major (imm-trans-b 1): S^T += V^T kg
// and the backward dq/dk/dg kernel's value loop, both operands from shared memory:
//   m64n32k16,  A and B K-major: do S_cᵀ, v dS_{c+1}ᵀ and do vᵀ
// Off sm_90a these compile to a trap and the kernel never calls them (kArchWgmma false there).
#pragma once

#include <cstdint>

#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::detail {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kArchWgmma = true;
#else
constexpr bool kArchWgmma = false;
#endif
// N-major B (kg: rows t = K, keys = N contiguous): the next 64-key block of N is 8 KB on (leading
// byte offset), the next 8-row group of K 1 KB (stride byte offset).
constexpr uint32_t kKgLeadingBytes = 8192, kKgStrideBytes = 1024;

// Shared-memory matrix descriptor: start address, leading and stride byte offsets (16-byte units),
// layout type 1 = 128-byte swizzle (bits 62-63).
__device__ __forceinline__ uint64_t wg_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr >> 4) & 0x3fff) | (uint64_t((lbo >> 4) & 0x3fff) << 16) |
         (uint64_t((sbo >> 4) & 0x3fff) << 32) | (uint64_t(1) << 62);
}

// A statement on sm_90a only (elsewhere the kernels never reach these wrappers).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GLA_ON_SM90A(...) __VA_ARGS__
#else
#define GLA_ON_SM90A(...)
#endif
__device__ __forceinline__ void wg_fence() { GLA_ON_SM90A(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");) }
__device__ __forceinline__ void wg_commit() { GLA_ON_SM90A(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");) }
__device__ __forceinline__ void wg_wait_all() { GLA_ON_SM90A(asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");) }
// Generic-proxy shared-memory writes made visible to wgmma's async-proxy reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  GLA_ON_SM90A(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");)
}
#undef GLA_ON_SM90A

// Register operands of an in-flight wgmma: the compiler must neither move reads of the
// accumulators above the wait nor reuse the A registers before it (it does not know the
// instruction is asynchronous); an empty asm that "modifies" them after the wait pins both.
template <int N>
__device__ __forceinline__ void wg_pin(float* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void wg_pin(uint32_t* r) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The wrappers, one body per shape for both 16-bit types (the type only changes the mnemonic).
// scale-d is a predicate (1: accumulate into d).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GLA_WGMMA_N64_KMAJOR(FN, TY) \
  __device__ __forceinline__ void FN(float* d, const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
  }
#define GLA_WGMMA_N128_NMAJOR(FN, TY) \
  __device__ __forceinline__ void FN(float* d, const uint32_t (&a)[4], uint64_t desc) { \
    asm volatile( \
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY "." TY " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1)); \
  }
// Both operands from shared memory, both K-major: m64n32k16 (the backward's dq/dk/dg kernel).
#define GLA_WGMMA_N32_SS(FN, TY) \
  __device__ __forceinline__ void FN(float* d, uint64_t desc_a, uint64_t desc_b) { \
    asm volatile( \
        "{\n .reg .pred p;\n setp.ne.b32 p, %18, 0;\n" \
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." TY "." TY " {" \
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
        "}, %16, %17, p, 1, 1, 0, 0;\n}\n" \
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]) \
        : "l"(desc_a), "l"(desc_b), "r"(1)); \
  }
#else
#define GLA_WGMMA_N32_SS(FN, TY) \
  __device__ __forceinline__ void FN(float*, uint64_t, uint64_t) { __trap(); }
#define GLA_WGMMA_N64_KMAJOR(FN, TY) \
  __device__ __forceinline__ void FN(float*, const uint32_t (&)[4], uint64_t) { __trap(); }
#define GLA_WGMMA_N128_NMAJOR(FN, TY) \
  __device__ __forceinline__ void FN(float*, const uint32_t (&)[4], uint64_t) { __trap(); }
#endif
GLA_WGMMA_N64_KMAJOR(wgmma_n64_kmajor_bf16, "bf16")
GLA_WGMMA_N64_KMAJOR(wgmma_n64_kmajor_f16, "f16")
GLA_WGMMA_N128_NMAJOR(wgmma_n128_nmajor_bf16, "bf16")
GLA_WGMMA_N128_NMAJOR(wgmma_n128_nmajor_f16, "f16")
GLA_WGMMA_N32_SS(wgmma_n32_ss_bf16, "bf16")
GLA_WGMMA_N32_SS(wgmma_n32_ss_f16, "f16")
#undef GLA_WGMMA_N64_KMAJOR
#undef GLA_WGMMA_N128_NMAJOR
#undef GLA_WGMMA_N32_SS

// Element-type dispatch (E: __nv_bfloat16 or __half).
template <typename X>
__device__ __forceinline__ void wgmma_n64_kmajor(float* d, const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (X::kType == kBF16) {
    wgmma_n64_kmajor_bf16(d, a, desc);
  } else {
    wgmma_n64_kmajor_f16(d, a, desc);
  }
}
template <typename X>
__device__ __forceinline__ void wgmma_n128_nmajor(float* d, const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (X::kType == kBF16) {
    wgmma_n128_nmajor_bf16(d, a, desc);
  } else {
    wgmma_n128_nmajor_f16(d, a, desc);
  }
}

template <typename X>
__device__ __forceinline__ void wgmma_n32_ss(float* d, uint64_t desc_a, uint64_t desc_b) {
  if constexpr (X::kType == kBF16) {
    wgmma_n32_ss_bf16(d, desc_a, desc_b);
  } else {
    wgmma_n32_ss_f16(d, desc_a, desc_b);
  }
}

}  // namespace gla::cuda::detail
