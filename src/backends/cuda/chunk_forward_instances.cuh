// Host launcher of the chunk kernel for one (DK, BV, element type); instantiated in
// chunk_forward_d64.cu and chunk_forward_d128.cu so the two compile in parallel.
#pragma once

#include "backends/cuda/chunk_forward_kernel.cuh"
#include "backends/cuda/chunk_forward_ws_kernel.cuh"
#include "backends/cuda/kernel_attributes.cuh"

namespace gla::cuda::detail {

// Kernel parameters (ForwardParams and SegmentArgs with its block order) within the classic 4 KB.
static_assert(sizeof(ForwardParams) + sizeof(SegmentArgs) <= 4096, "kernel parameters over 4 KB");

// The single-role kernel (value tile BV = DK; both passes of a segment split).
template <int DK, typename E>
cudaError_t run_chunk(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  constexpr int BV = DK;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const ChunkSmem L = chunk_smem_layout(DK, BV, gate_bytes, p.gate_per_head != 0);
  auto kernel = chunk_forward_kernel<DK, E>;
  if (const cudaError_t err = allow_dynamic_shared_memory<chunk_forward_kernel<DK, E>>(L.total); err != cudaSuccess) {
    return err;
  }
  const int64_t max_segments = plan.max_segments;
  SegmentArgs sa{};
  sa.segment_chunks = plan.segment_chunks;
  sa.whole_chunks = plan.whole_chunks;
  sa.max_segments = max_segments;
  sa.value_tiles = plan.value_tiles;
  if (max_segments > 1) {
    sa.seg_states = static_cast<float*>(workspace);
    const size_t states = size_t(p.N) * max_segments * p.H * size_t(plan.value_tiles) * BV * DK;
    sa.seg_decay = sa.seg_states + states;
  }
  const dim3 grid(static_cast<unsigned>(p.N * max_segments), static_cast<unsigned>(p.H * plan.value_tiles));
  if (max_segments > 1) {
    sa.pass = 1;
    kernel<<<grid, BV * 2, L.total, stream>>>(p, sa);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  sa.pass = 2;
  kernel<<<grid, BV * 2, L.total, stream>>>(p, sa);
  return cudaGetLastError();
}

// The warp-specialised kernel (both passes of a segment split). RS: rows per element-wise item
// (16, or 8 with two prep threads per item). KEYHALF: the full pass's part in a key split
// (ForwardParams::key_half; the segments' local-state pass is the same for every part).
// PREP: the prepared key split's instances (ForwardParams::prepared). STATE_SCALES: the full pass's
// state group scales qg and kg (chunk_forward_ws_kernel).
template <int DK, typename E, int RS = 16, int KEYHALF = 0, int PREP = 0, int STATE_SCALES = 0>
cudaError_t run_chunk_ws(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  constexpr int kThreads = 2 * DK * (16 / RS) + 2 * DK;
  const int smem_bytes = ws_smem_layout(DK, 16 / RS).total;
  auto kernel = chunk_forward_ws_kernel<DK, E, RS, 0, KEYHALF, PREP, STATE_SCALES>;
  // pass 1 of a segment split (the same for both key halves)
  auto local_kernel = chunk_forward_ws_kernel<DK, E, RS, 1, PREP ? 1 : 0, PREP>;
  {
    cudaError_t err =
        allow_dynamic_shared_memory<chunk_forward_ws_kernel<DK, E, RS, 0, KEYHALF, PREP, STATE_SCALES>>(smem_bytes);
    if (err == cudaSuccess) {
      err = allow_dynamic_shared_memory<chunk_forward_ws_kernel<DK, E, RS, 1, PREP ? 1 : 0, PREP>>(smem_bytes);
    }
    if (err != cudaSuccess) return err;
  }
  SegmentArgs sa{};
  sa.segment_chunks = plan.segment_chunks;
  sa.whole_chunks = plan.whole_chunks;
  sa.max_segments = plan.max_segments;
  sa.value_tiles = plan.value_tiles;
  const dim3 grid(static_cast<unsigned>(p.N * plan.max_segments), static_cast<unsigned>(p.H * plan.value_tiles));
  if (plan.max_segments > 1) {
    sa.seg_states = static_cast<float*>(workspace);
    const size_t states = size_t(p.N) * plan.max_segments * p.H * size_t(plan.value_tiles) * DK * DK;
    sa.seg_decay = sa.seg_states + states;
    // Pass 1 (the segments' local states) on the same kernel: k, g, v and the state update only.
    sa.pass = 1;
    local_kernel<<<grid, kThreads, smem_bytes, stream>>>(p, sa);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  sa.pass = 2;
  // The full pass longest block first (plan.block_order; pass 1's blocks are whole segments of
  // segment_chunks each and keep the natural grid).
  if (plan.block_order_count > 0) {
    sa.order_count = plan.block_order_count;
    for (int i = 0; i < plan.block_order_count; ++i) sa.order[i] = plan.block_order[i];
    const dim3 ordered_grid(static_cast<unsigned>(p.H * plan.value_tiles), static_cast<unsigned>(plan.block_order_count));
    kernel<<<ordered_grid, kThreads, smem_bytes, stream>>>(p, sa);
    return cudaGetLastError();
  }
  kernel<<<grid, kThreads, smem_bytes, stream>>>(p, sa);
  return cudaGetLastError();
}

cudaError_t run_chunk_d64(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream);
cudaError_t run_chunk_d128(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream);

}  // namespace gla::cuda::detail
