// Host side of the tensor copies (tensor_copy.cuh): describing a strided tensor of 2-byte elements
// as a CUtensorMap whose boxes land in the 128-byte-swizzled layout. The driver's encoder is reached
// through the runtime's entry-point query, so libgla links only cudart.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace gla::cuda {

// A map of `rank` (2..5) dimensions of 2-byte elements at `base`: dims[0] innermost and contiguous,
// byte_strides[i] the stride of dims[i + 1], box[i] the box's extent in dims[i] (box[0] * 2 <= 128
// bytes: the swizzle's row). Reads past a dimension's extent fill zeros. False, with `map` unusable,
// where the hardware's rules are not met (base or a stride not a multiple of 16 bytes, a stride of
// 2^40 bytes or more, a dimension past 2^32) or the driver has no encoder; the caller then copies
// another way.
bool encode_swizzled_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                         const uint64_t* byte_strides, const uint32_t* box);

}  // namespace gla::cuda
