// Chunk kernel instantiations for 64 < K <= 128 (value tile 64 or 128).
#include "backends/cuda/chunk_forward_instances.cuh"

namespace gla::cuda::detail {

cudaError_t run_chunk_d128(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  if (plan.kernel == 3) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 8>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 8>(p, plan, workspace, stream);
  }
  if (plan.kernel == 6) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, true>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, true>(p, plan, workspace, stream);
  }
  if (plan.kernel == 2 && p.accumulate_o) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, false, true>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, false, true>(p, plan, workspace, stream);
  }
  if (plan.kernel == 2) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half>(p, plan, workspace, stream);
  }
  if (plan.kernel == 1) {
    if (p.dtype == kBF16) return run_chunk<128, 128, __nv_bfloat16, true>(p, plan, workspace, stream);
    return run_chunk<128, 128, __half, true>(p, plan, workspace, stream);
  }
  if (plan.value_tile == 128) {
    if (p.dtype == kBF16) return run_chunk<128, 128, __nv_bfloat16>(p, plan, workspace, stream);
    return run_chunk<128, 128, __half>(p, plan, workspace, stream);
  }
  if (p.dtype == kBF16) return run_chunk<128, 64, __nv_bfloat16>(p, plan, workspace, stream);
  return run_chunk<128, 64, __half>(p, plan, workspace, stream);
}

}  // namespace gla::cuda::detail
