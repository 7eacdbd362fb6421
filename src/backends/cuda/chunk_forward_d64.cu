// Chunk kernel instantiations for K <= 64 (value tile 64): the warp-specialised kernel with two
// prep threads per element-wise item, and the single-role kernel.
#include "backends/cuda/chunk_forward_instances.cuh"

namespace gla::cuda::detail {

cudaError_t run_chunk_d64(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  if (plan.kernel == ForwardKernel::kChunkWsSplit) {
    if (p.dtype == kBF16) return run_chunk_ws<64, __nv_bfloat16, 8>(p, plan, workspace, stream);
    return run_chunk_ws<64, __half, 8>(p, plan, workspace, stream);
  }
  if (p.dtype == kBF16) return run_chunk<64, __nv_bfloat16>(p, plan, workspace, stream);
  return run_chunk<64, __half>(p, plan, workspace, stream);
}

}  // namespace gla::cuda::detail
