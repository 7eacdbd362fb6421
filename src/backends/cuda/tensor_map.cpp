#include "backends/cuda/tensor_map.hpp"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace gla::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
    // The query's own failure is cleared (the caller falls back and must not see it as its own);
    // a "symbol not found" answer sets no error, so an error pending from before stays the caller's.
    if (err != cudaSuccess) cudaGetLastError();
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

bool encode_swizzled_map(CUtensorMap* map, const void* base, int rank, const uint64_t* dims,
                         const uint64_t* byte_strides, const uint32_t* box) {
  if (rank < 2 || rank > 5 || base == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0) return false;
  if (box[0] * 2 > 128) return false;
  for (int i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32) || box[i] == 0 || box[i] > 256) return false;
  }
  for (int i = 0; i + 1 < rank; ++i) {
    if (byte_strides[i] % 16 != 0 || byte_strides[i] >= (uint64_t(1) << 40)) return false;
  }
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return false;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], one[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    one[i] = 1;
    if (i + 1 < rank) s[i] = byte_strides[i];
  }
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, static_cast<cuuint32_t>(rank), const_cast<void*>(base), d, s, b, one,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace gla::cuda
