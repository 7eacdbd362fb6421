// mbarriers in shared memory: the warp-specialised forward's hand-off between its warp groups, and
// the completion of tensor copies (tensor_copy.cuh). An arrival releases the arriving thread's
// earlier accesses, a completed phase acquires them for the waiting threads (PTX ISA, mbarrier);
// a tensor copy's bytes count as completed transactions of the phase they were expected in.
#pragma once

#include <cstdint>

#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::detail {

__device__ __forceinline__ void mbar_init(void* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(void* b) {
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_addr(b)) : "memory");
}
// Waits until the phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(void* b, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra WAIT_%=;\n}\n" ::"r"(
          smem_addr(b)),
      "r"(parity)
      : "memory");
#else
  asm volatile(
      "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.test_wait.parity.shared::cta.b64 done, [%0], %1;\n @!done bra WAIT_%=;\n}\n" ::"r"(
          smem_addr(b)),
      "r"(parity)
      : "memory");
#endif
}

// sm_90: one arrival that also expects `bytes` of tensor copies in the current phase (the phase
// completes when the arrivals and the bytes are all in).
__device__ __forceinline__ void mbar_arrive_expect_bytes(void* b, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(smem_addr(b)),
               "r"(bytes)
               : "memory");
#endif
}
// sm_90: makes this thread's mbarrier.init visible to the tensor-copy unit (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

}  // namespace gla::cuda::detail
