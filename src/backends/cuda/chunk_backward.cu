// Host side of the chunk backward (chunk_backward.hpp): the workspace plan, the small kernels (chunk
// offsets, the per-head gate's key-tile sum, the reversed forward's inputs) and the launch sequence.
#include "backends/cuda/chunk_backward.hpp"

#include <vector>

#include "backends/cuda/chunk_backward_dqk_kernel.cuh"
#include "backends/cuda/chunk_backward_scan.cuh"
#include "backends/cuda/kernel_attributes.cuh"
#include "backends/cuda/tensor_map.hpp"

namespace gla::cuda {
namespace backward {
static_assert(sizeof(ScanShared) == kScanSharedBytes, "update kScanSharedBytes (chunk_backward.hpp): the planner reports it");
static_assert(sizeof(DqkShared) == kDqkSharedBytes, "update kDqkSharedBytes (chunk_backward.hpp): the planner reports it");
namespace {

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

// ---- dv by the reversed forward ----
// Time u of the reversed problem is token T - 1 - u. The forward's decay between a key at u_k and a
// query at u_q >= u_k is the product of the gates at u_k + 1 .. u_q; the backward needs the gates of
// tokens t + 1 .. t_k for a key at t_k >= t (its query), so the reversed gate at u is the gate of
// token T - u (one token later), and 0 (no decay) at a sequence's first reversed token: the reversed
// forward reads g in place that way (ForwardParams::gate_lag), with no copy.

// The reversed varlen batch: sequence N - 1 - n first; offsets'[i] = T - cu[N - i].
__global__ void reversed_offsets_kernel(BackwardParams p, int64_t* out) {
  for (int64_t i = threadIdx.x; i <= p.N; i += blockDim.x) {
    const int64_t at = p.N - i;
    const int64_t cu = p.cu_seqlens_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[at]
                                          : static_cast<const int32_t*>(p.cu_seqlens)[at];
    out[i] = p.T - cu;
  }
}

// The reversed forward's initial state: dht * factor as contiguous [N, H, K, V], sequences reversed
// with varlen.
__global__ void reversed_dht_kernel(BackwardParams p, float factor, float* out) {
  const int64_t total = p.N * p.H * p.K * p.V;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % p.V, i = (e / p.V) % p.K, h = (e / (p.V * p.K)) % p.H, n = e / (p.V * p.K * p.H);
    const int64_t src_n = p.varlen ? p.N - 1 - n : n;
    out[e] = p.dht[state_at(p.dht_stride, p.state_v_first, src_n, h, i, j)] * factor;
  }
}

cudaError_t launch_values(const BackwardParams& p, const BackwardPlan& plan, char* workspace, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  if (p.varlen) {
    reversed_offsets_kernel<<<1, 1024, 0, stream>>>(p, reinterpret_cast<int64_t*>(workspace + plan.reversed_offsets));
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.dht != nullptr) {
    const float factor = values_from_do(p) ? 1.0f / p.scale : 1.0f;
    reversed_dht_kernel<<<1024, 256, 0, stream>>>(p, factor, reinterpret_cast<float*>(workspace + plan.reversed_dht));
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (!values_from_do(p)) {
    err = cudaMemsetAsync(workspace + plan.zero_values, 0, static_cast<size_t>(p.B) * p.T * p.H * p.V * 2, stream);
    if (err != cudaSuccess) return err;
  }
  const ForwardParams f = reversed_forward(p, plan, workspace);
  if (p.varlen && plan.state_grads_by_values) {  // the reversed sequences' chunk-state slots
    if ((err = launch_chunk_first(f, reinterpret_cast<int64_t*>(workspace + plan.reversed_chunk_first), stream)) != cudaSuccess) return err;
  }
  return launch_forward(f, plan.values, plan.values_workspace ? workspace + plan.values_workspace : nullptr, stream);
}

// dh0 with BackwardPlan::state_grads_by_values: scale · 2^{g of the sequence's first token} times the
// reversed forward's final state (sequence N - 1 - n with varlen); an empty sequence's is dht.
__global__ void state_grad_start_kernel(BackwardParams p, const float* reversed_final) {
  const int64_t total = p.N * p.H * p.K * p.V;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = e % p.V, i = (e / p.V) % p.K, h = (e / (p.V * p.K)) % p.H, n = e / (p.V * p.K * p.H);
    const int64_t src_n = p.varlen ? p.N - 1 - n : n;
    const Span s = sequence(p, n);
    float factor = p.scale;
    if (s.len > 0) {
      const int64_t at = s.batch * p.g_stride[0] + s.bos * p.g_stride[1] + h * p.g_stride[2] + (p.gate_per_head ? 0 : i);
      factor *= detail::fast_exp2(fmaxf(detail::load_any(p.g, at, p.gate_dtype) * kLog2e, kGateFloor));
    }
    p.dh0[state_at(p.dh0_stride, p.state_v_first, n, h, i, j)] =
        factor * reversed_final[((src_n * p.H + h) * p.K + i) * p.V + j];
  }
}

// dqk's tensor maps (DqkTensorMaps): boxes of 64 values x 64 rows (tokens of do and v, keys of the
// states). A dimension of extent 1 is never stepped over: its stride is set to a legal one. False
// where a map cannot be encoded (strides not multiples of 16 bytes, no encoder); dqk then copies by
// cp.async.
bool dqk_tensor_maps(const BackwardParams& p, const Workspace& ws, DqkTensorMaps& maps) {
  if (!p.vector_loads || p.do_ == nullptr || p.V % 8 != 0 || p.num_chunks * p.H > (int64_t(1) << 31) ||
      p.T > (int64_t(1) << 31)) {
    return false;
  }
  const uint32_t token_box[4] = {kTile, 1, kChunk, 1}, state_box[3] = {kTile, kTile, 1};
  auto token_map = [&](CUtensorMap* map, const void* base, const int64_t* stride) {
    const uint64_t dims[4] = {uint64_t(p.V), uint64_t(p.H), uint64_t(p.T), uint64_t(p.B)};
    const int64_t row_bytes = p.V * 2;
    const int64_t h_bytes = p.H > 1 ? stride[2] * 2 : row_bytes;
    const int64_t t_bytes = p.T > 1 ? stride[1] * 2 : h_bytes * p.H;
    const int64_t b_bytes = p.B > 1 ? stride[0] * 2 : t_bytes * p.T;
    if (h_bytes <= 0 || t_bytes <= 0 || b_bytes <= 0) return false;
    const uint64_t strides[3] = {uint64_t(h_bytes), uint64_t(t_bytes), uint64_t(b_bytes)};
    return encode_swizzled_map(map, base, 4, dims, strides, token_box);
  };
  auto state_map = [&](CUtensorMap* map, const void* base) {
    const uint64_t dims[3] = {uint64_t(p.V), uint64_t(p.K), uint64_t(p.num_chunks * p.H)};
    const uint64_t strides[2] = {uint64_t(p.V) * 2, uint64_t(p.K * p.V) * 2};
    return encode_swizzled_map(map, base, 3, dims, strides, state_box);
  };
  return token_map(&maps.dO, p.do_, p.do_stride) && token_map(&maps.v, p.v, p.v_stride) &&
         state_map(&maps.states, ws.states) && state_map(&maps.state_grads, ws.state_grads);
}

template <typename E>
cudaError_t launch_typed(const BackwardParams& p, const BackwardPlan& plan, const Workspace& ws, void* base,
                         cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  const int tiles = plan.key_tiles * plan.scan_value_groups;
  if (p.N > 0 && plan.scan_directions > 0) {
    const size_t scan_bytes = sizeof(ScanShared);
    // Forward walks unless the states are saved, reverse walks unless the reversed forward gives
    // the state gradients.
    const dim3 grid(static_cast<unsigned>(p.N * plan.scan_segments), static_cast<unsigned>(p.H),
                    plan.scan_directions * tiles);
    if (plan.scan_segment_chunks > 0) {
      if ((err = detail::allow_dynamic_shared_memory<state_scan_kernel<E, true>>(scan_bytes, detail::Carveout::kMaxShared)) != cudaSuccess) return err;
      state_scan_kernel<E, true><<<grid, kScanThreads, scan_bytes, stream>>>(p, plan, ws);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
    if ((err = detail::allow_dynamic_shared_memory<state_scan_kernel<E, false>>(scan_bytes, detail::Carveout::kMaxShared)) != cudaSuccess) return err;
    state_scan_kernel<E, false><<<grid, kScanThreads, scan_bytes, stream>>>(p, plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.num_chunks == 0) return cudaSuccess;
  // dv (and with state_grads_by_values the state gradients dq/dk/dg read) by the reversed forward.
  if (p.dv != nullptr) {
    if ((err = launch_values(p, plan, static_cast<char*>(base), stream)) != cudaSuccess) return err;
  }
  if (plan.state_grads_by_values && p.dh0 != nullptr) {
    state_grad_start_kernel<<<1024, 256, 0, stream>>>(p, reinterpret_cast<const float*>(static_cast<char*>(base) + plan.reversed_final));
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.dq != nullptr || p.dk != nullptr || p.dg != nullptr) {
    const size_t bytes = sizeof(DqkShared);
    if ((err = detail::allow_dynamic_shared_memory<dqk_kernel<E>>(bytes, detail::Carveout::kMaxShared)) != cudaSuccess) return err;
    DqkTensorMaps maps{};
    maps.enabled = dqk_tensor_maps(p, ws, maps) ? 1 : 0;
    dqk_kernel<E><<<dim3(static_cast<unsigned>(p.num_chunks * plan.key_tiles), static_cast<unsigned>(p.H)),
                    kGradThreads, bytes, stream>>>(p, plan, ws, maps);
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

cudaError_t launch_backward(const BackwardParams& p, const BackwardPlan& plan, void* workspace, cudaStream_t stream) {
  backward::Workspace ws = backward::workspace_views(plan, workspace);
  if (p.saved_states != nullptr) {  // read only (no forward walks run)
    ws.states = const_cast<backward::StateElement*>(reinterpret_cast<const backward::StateElement*>(p.saved_states));
  }
  detail::chunk_offsets_kernel<<<1, detail::kChunkOffsetThreads, 0, stream>>>(p, ws.chunk_offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return p.dtype == kBF16 ? backward::launch_typed<__nv_bfloat16>(p, plan, ws, workspace, stream)
                          : backward::launch_typed<__half>(p, plan, ws, workspace, stream);
}

}  // namespace gla::cuda
