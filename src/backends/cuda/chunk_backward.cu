// Host side of the chunk backward (chunk_backward.hpp): the workspace plan, the two small kernels
// (chunk offsets, the per-head gate's key-tile sum) and the launch sequence.
#include "backends/cuda/chunk_backward.hpp"

#include "backends/cuda/chunk_backward_dv_kernel.cuh"
#include "backends/cuda/chunk_backward_scan.cuh"
#include "backends/cuda/chunk_forward.hpp"

namespace gla::cuda {
namespace backward {
namespace {

constexpr int kOffsetThreads = 1024;

// chunk_offsets[n] = Σ_{m<n} ceil(T_m / 64), from device cu_seqlens: one CTA, a block scan.
__global__ void __launch_bounds__(kOffsetThreads) chunk_offsets_kernel(BackwardParams p, int64_t* offsets) {
  __shared__ int64_t partial[kOffsetThreads];
  const int tid = threadIdx.x;
  const int64_t per = (p.N + kOffsetThreads - 1) / kOffsetThreads;
  const int64_t n0 = tid * per < p.N ? tid * per : p.N;
  const int64_t n1 = n0 + per < p.N ? n0 + per : p.N;
  int64_t count = 0;
  for (int64_t n = n0; n < n1; ++n) count += (sequence(p, n).len + kChunk - 1) / kChunk;
  partial[tid] = count;
  __syncthreads();
  for (int stride = 1; stride < kOffsetThreads; stride <<= 1) {
    const int64_t add = tid >= stride ? partial[tid - stride] : 0;
    __syncthreads();
    partial[tid] += add;
    __syncthreads();
  }
  int64_t running = partial[tid] - count;  // exclusive prefix
  if (tid == 0) offsets[0] = 0;
  for (int64_t n = n0; n < n1; ++n) {
    running += (sequence(p, n).len + kChunk - 1) / kChunk;
    offsets[n + 1] = running;
  }
}

// A per-head gate's dg: the sum of the key tiles' partial sums, in tile order.
__global__ void gate_sum_kernel(BackwardParams p, int key_tiles, const float* partials) {
  const int64_t total = p.B * p.T * p.H;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t h = e % p.H, row = e / p.H, b = row / p.T, t = row % p.T;
    float x = 0.0f;
    for (int kt = 0; kt < key_tiles; ++kt) x += partials[kt * total + e];
    detail::store_any(p.dg, b * p.dg_stride[0] + t * p.dg_stride[1] + h * p.dg_stride[2], p.dg_dtype, x);
  }
}

template <typename Kernel>
cudaError_t allow_shared(Kernel kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

template <typename E>
cudaError_t launch_typed(const BackwardParams& p, const BackwardPlan& plan, const Workspace& ws, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  const int tiles = plan.key_tiles * plan.value_tiles;
  if (p.N > 0) {
    const size_t scan_bytes = sizeof(ScanShared<E>);
    if ((err = allow_shared(state_scan_kernel<E>, scan_bytes)) != cudaSuccess) return err;
    state_scan_kernel<E><<<dim3(static_cast<unsigned>(p.N), static_cast<unsigned>(p.H), 2 * tiles), kScanThreads,
                           scan_bytes, stream>>>(p, plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.num_chunks == 0) return cudaSuccess;
  if (p.dq != nullptr || p.dk != nullptr || p.dg != nullptr) {
    const size_t bytes = sizeof(DqkShared<E>);
    if ((err = allow_shared(dqk_kernel<E>, bytes)) != cudaSuccess) return err;
    dqk_kernel<E><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.H), plan.key_tiles),
                    kGradThreads, bytes, stream>>>(p, plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.dv != nullptr) {
    const size_t bytes = sizeof(DvShared<E>);
    if ((err = allow_shared(dv_kernel<E>, bytes)) != cudaSuccess) return err;
    dv_kernel<E><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.H), plan.value_tiles),
                   kGradThreads, bytes, stream>>>(p, plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.dg != nullptr && p.gate_per_head && plan.key_tiles > 1) {
    gate_sum_kernel<<<1024, 256, 0, stream>>>(p, plan.key_tiles, ws.gate_partials);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace backward

namespace {
size_t align256(size_t x) { return (x + 255) & ~size_t(255); }
}  // namespace

BackwardPlan plan_backward(const BackwardParams& p) {
  BackwardPlan plan;
  plan.key_tiles = static_cast<int32_t>((p.K + backward::kTile - 1) / backward::kTile);
  plan.value_tiles = static_cast<int32_t>((p.V + backward::kTile - 1) / backward::kTile);
  const size_t state_bytes = static_cast<size_t>(p.num_chunks) * p.H * p.K * p.V * sizeof(float);
  size_t at = 0;
  plan.chunk_offsets = at;
  at = align256(at + static_cast<size_t>(p.N + 1) * sizeof(int64_t));
  plan.states = at;
  at = align256(at + state_bytes);
  plan.state_grads = at;
  at = align256(at + state_bytes);
  if (p.gate_per_head && plan.key_tiles > 1) {
    plan.gate_partials = at;
    at = align256(at + static_cast<size_t>(plan.key_tiles) * p.B * p.T * p.H * sizeof(float));
  }
  plan.workspace_bytes = at;
  return plan;
}

cudaError_t launch_backward(const BackwardParams& p, const BackwardPlan& plan, void* workspace, cudaStream_t stream) {
  const backward::Workspace ws = backward::workspace_views(plan, workspace);
  backward::chunk_offsets_kernel<<<1, backward::kOffsetThreads, 0, stream>>>(p, ws.chunk_offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return p.dtype == kBF16 ? backward::launch_typed<__nv_bfloat16>(p, plan, ws, stream)
                          : backward::launch_typed<__half>(p, plan, ws, stream);
}

}  // namespace gla::cuda
