// Tensor copies (sm_90 TMA): one thread asks the copy unit for a whole box of a tensor described
// by a CUtensorMap (tensor_map.hpp), which lands in shared memory in the map's layout (the 128-byte
// swizzle wgmma reads: sw128_off) and counts its bytes on an mbarrier (mbarrier.cuh). Boxes past the
// tensor's bounds are filled with zeros, and the full box counts. The map must be a __grid_constant__
// kernel parameter (its address is what the instruction takes).
#pragma once

#include <cstdint>

#include <cuda.h>

#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::detail {

// Box at coordinates (c0 innermost, c1, c2) of a rank-3 map into `dst` (1024-byte aligned).
__device__ __forceinline__ void tensor_copy_3d(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                               void* mbar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(mbar))
      : "memory");
#endif
}
// The same for a rank-4 map.
__device__ __forceinline__ void tensor_copy_4d(void* dst, const CUtensorMap* map, int32_t c0, int32_t c1, int32_t c2,
                                               int32_t c3, void* mbar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(mbar))
      : "memory");
#endif
}

}  // namespace gla::cuda::detail
