// Chunk kernel instantiations for 64 < K <= 128 (value tile 128): the warp-specialised kernel (and
// its two key-split instances, ForwardParams::key_half), and the single-role kernel.
#include "backends/cuda/chunk_forward_instances.cuh"

namespace gla::cuda::detail {

cudaError_t run_chunk_d128(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  if (plan.kernel == ForwardKernel::kChunkWs && p.prepared && p.key_half == 1) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, 1, 1>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, 1, 1>(p, plan, workspace, stream);
  }
  if (plan.kernel == ForwardKernel::kChunkWs && p.prepared && p.key_half == 2) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, 2, 1>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, 2, 1>(p, plan, workspace, stream);
  }
  if (plan.kernel == ForwardKernel::kChunkWs && p.key_half == 1) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, 1>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, 1>(p, plan, workspace, stream);
  }
  if (plan.kernel == ForwardKernel::kChunkWs && p.key_half == 2) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16, 16, 2>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half, 16, 2>(p, plan, workspace, stream);
  }
  if (ws_state_group_scales(p, plan)) {
    // The state group has time to spare here and scales qg, kg itself (STATE_SCALES; bf16 only: the
    // fp16 instance measured slower, H100 B8 T4096 H16 D128 forward b2b 0.347 -> 0.354 ms).
    return run_chunk_ws<128, __nv_bfloat16, 16, 0, 0, 1>(p, plan, workspace, stream);
  }
  if (plan.kernel == ForwardKernel::kChunkWs) {
    if (p.dtype == kBF16) return run_chunk_ws<128, __nv_bfloat16>(p, plan, workspace, stream);
    return run_chunk_ws<128, __half>(p, plan, workspace, stream);
  }
  if (p.dtype == kBF16) return run_chunk<128, __nv_bfloat16>(p, plan, workspace, stream);
  return run_chunk<128, __half>(p, plan, workspace, stream);
}

}  // namespace gla::cuda::detail
