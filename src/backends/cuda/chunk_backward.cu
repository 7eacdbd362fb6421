// Host side of the chunk backward (chunk_backward.hpp): the workspace plan, the small kernels (chunk
// offsets, the per-head gate's key-tile sum, the reversed forward's inputs) and the launch sequence.
#include "backends/cuda/chunk_backward.hpp"

#include <vector>

#include "backends/cuda/chunk_backward_dqk_kernel.cuh"
#include "backends/cuda/chunk_backward_scan.cuh"
#include "backends/cuda/kernel_attributes.cuh"

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

// ---- dv by the reversed forward ----
// Time u of the reversed problem is token T - 1 - u. The forward's decay between a key at u_k and a
// query at u_q >= u_k is the product of the gates at u_k + 1 .. u_q; the backward needs the gates of
// tokens t + 1 .. t_k for a key at t_k >= t (its query), so the reversed gate at u is the gate of
// token T - u (one token later), and 0 (no decay) at a sequence's first reversed token.

// reversed_gate[b, u, h, :] = g[b, T - u, h, :] (raw bits), 0 where T - u = T; Kg = K (per-key) or 1.
// Each thread moves one group of W elements (W * sizeof(Bits) = 16 bytes on the vector path).
template <typename Bits, int W>
__global__ void reversed_gate_kernel(BackwardParams p, Bits* out) {
  const int64_t Kg = p.gate_per_head ? 1 : p.K;
  const int64_t groups_per_row = Kg / W, rows = p.B * p.T * p.H;
  const Bits* g = static_cast<const Bits*>(p.g);
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < rows * groups_per_row;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / groups_per_row, c = (e % groups_per_row) * W;
    const int64_t h = row % p.H, bu = row / p.H, u = bu % p.T, b = bu / p.T;
    const int64_t t = p.T - u;  // the source token
    Bits* dst = out + row * Kg + c;
    if constexpr (W == 1) {
      *dst = t < p.T ? g[b * p.g_stride[0] + t * p.g_stride[1] + h * p.g_stride[2] + c] : Bits(0);
    } else {
      *reinterpret_cast<uint4*>(dst) =
          t < p.T ? *reinterpret_cast<const uint4*>(g + b * p.g_stride[0] + t * p.g_stride[1] + h * p.g_stride[2] + c)
                  : make_uint4(0, 0, 0, 0);
    }
  }
}

// Varlen: the reversed gate is 0 at each non-empty sequence's first reversed token (the token after
// the sequence's last belongs to the next sequence). Block m handles the sequence ending at cu[m].
template <typename Bits>
__global__ void reversed_gate_boundaries_kernel(BackwardParams p, Bits* out) {
  const int64_t m = blockIdx.x + 1;
  const Span s = sequence(p, m - 1);
  const int64_t end = s.bos + s.len;
  if (s.len == 0 || end >= p.T) return;
  const int64_t Kg = p.gate_per_head ? 1 : p.K;
  Bits* row = out + (p.T - end) * p.H * Kg;
  for (int64_t e = threadIdx.x; e < p.H * Kg; e += blockDim.x) row[e] = Bits(0);
}

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

// Whether the reversed forward takes do as its values (else zeros: do absent, or scale = 0 where
// dht / scale cannot carry the state gradient).
bool values_from_do(const BackwardParams& p) { return p.do_ != nullptr && p.scale != 0.0f; }

// The forward problem whose output is dv: q' = k, k' = q, v' = do, all reversed in time (negative
// time strides from the last token), g' the reversed gate, o' = dv reversed.
ForwardParams reversed_forward(const BackwardParams& p, const BackwardPlan& plan, char* workspace) {
  ForwardParams f{};
  const int64_t last = p.T > 0 ? p.T - 1 : 0;
  auto reversed = [&](const void* base, const int64_t* s, int64_t* out) -> const char* {
    out[0] = s[0];
    out[1] = -s[1];
    out[2] = s[2];
    return base == nullptr ? nullptr : static_cast<const char*>(base) + last * s[1] * 2;
  };
  f.q = reversed(p.k, p.k_stride, f.q_stride);
  f.k = reversed(p.q, p.q_stride, f.k_stride);
  const int64_t zero_stride[3] = {p.T * p.H * p.V, p.H * p.V, p.V};
  f.v = values_from_do(p) ? reversed(p.do_, p.do_stride, f.v_stride)
                          : reversed(workspace ? workspace + plan.zero_values : nullptr, zero_stride, f.v_stride);
  f.o = const_cast<char*>(reversed(p.dv, p.dv_stride, f.o_stride));
  const int64_t Kg = p.gate_per_head ? 1 : p.K;
  f.g = workspace ? workspace + plan.reversed_gate : nullptr;
  f.g_stride[0] = p.T * p.H * Kg;
  f.g_stride[1] = p.H * Kg;
  f.g_stride[2] = Kg;
  if (p.dht != nullptr) {
    f.initial_state = workspace ? reinterpret_cast<const float*>(workspace + plan.reversed_dht) : nullptr;
    f.h0_stride[0] = p.H * p.K * p.V;
    f.h0_stride[1] = p.K * p.V;
    f.h0_stride[2] = p.V;
    f.h0_stride[3] = 1;
  }
  f.state_v_first = 0;
  f.varlen = p.varlen;
  f.cu_seqlens = p.varlen && workspace ? workspace + plan.reversed_offsets : nullptr;
  f.cu_seqlens_int64 = 1;
  f.B = p.B;
  f.T = p.T;
  f.H = p.H;
  f.K = p.K;
  f.V = p.V;
  f.N = p.N;
  f.scale = values_from_do(p) ? p.scale : 1.0f;
  f.dtype = p.dtype;
  f.gate_dtype = p.gate_dtype;
  f.gate_per_head = p.gate_per_head;
  f.vector_loads = p.vector_loads && p.vector_dv;
  return f;
}

cudaError_t launch_values(const BackwardParams& p, const BackwardPlan& plan, char* workspace, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const int64_t Kg = p.gate_per_head ? 1 : p.K;
  const int64_t rows = p.B * p.T * p.H;
  const bool vector = !p.gate_per_head && p.vector_gate;
  const int64_t groups = vector ? rows * (Kg * gate_bytes / 16) : rows * Kg;
  const unsigned blocks = static_cast<unsigned>(groups / 256 + 1 < 65535 * 4 ? groups / 256 + 1 : 65535 * 4);
  void* gate = workspace + plan.reversed_gate;
  if (gate_bytes == 4) {
    if (vector) reversed_gate_kernel<uint32_t, 4><<<blocks, 256, 0, stream>>>(p, static_cast<uint32_t*>(gate));
    else reversed_gate_kernel<uint32_t, 1><<<blocks, 256, 0, stream>>>(p, static_cast<uint32_t*>(gate));
    if (p.varlen && p.N > 0) reversed_gate_boundaries_kernel<uint32_t><<<static_cast<unsigned>(p.N), 256, 0, stream>>>(p, static_cast<uint32_t*>(gate));
  } else {
    if (vector) reversed_gate_kernel<uint16_t, 8><<<blocks, 256, 0, stream>>>(p, static_cast<uint16_t*>(gate));
    else reversed_gate_kernel<uint16_t, 1><<<blocks, 256, 0, stream>>>(p, static_cast<uint16_t*>(gate));
    if (p.varlen && p.N > 0) reversed_gate_boundaries_kernel<uint16_t><<<static_cast<unsigned>(p.N), 256, 0, stream>>>(p, static_cast<uint16_t*>(gate));
  }
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
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
  return launch_forward(f, plan.values, plan.values_workspace ? workspace + plan.values_workspace : nullptr, stream);
}

template <typename E>
cudaError_t launch_typed(const BackwardParams& p, const BackwardPlan& plan, const Workspace& ws, void* base,
                         cudaStream_t stream) {
  cudaError_t err = cudaSuccess;
  const int tiles = plan.key_tiles * plan.scan_value_groups;
  if (p.N > 0) {
    const size_t scan_bytes = sizeof(ScanShared);
    const dim3 grid(static_cast<unsigned>(p.N * plan.scan_segments), static_cast<unsigned>(p.H), 2 * tiles);
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
  if (p.dq != nullptr || p.dk != nullptr || p.dg != nullptr) {
    const size_t bytes = sizeof(DqkShared<E>);
    if ((err = detail::allow_dynamic_shared_memory<dqk_kernel<E>>(bytes, detail::Carveout::kMaxShared)) != cudaSuccess) return err;
    dqk_kernel<E><<<dim3(static_cast<unsigned>(p.num_chunks), static_cast<unsigned>(p.H), plan.key_tiles),
                    kGradThreads, bytes, stream>>>(p, plan, ws);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  if (p.dv != nullptr) {
    if ((err = launch_values(p, plan, static_cast<char*>(base), stream)) != cudaSuccess) return err;
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

BackwardPlan plan_backward(const BackwardParams& p, const int64_t* seq_offsets, int sm_count) {
  BackwardPlan plan;
  plan.key_tiles = static_cast<int32_t>((p.K + backward::kTile - 1) / backward::kTile);
  plan.value_tiles = static_cast<int32_t>((p.V + backward::kTile - 1) / backward::kTile);
  plan.scan_value_groups = static_cast<int32_t>((p.V + backward::kScanValues - 1) / backward::kScanValues);
  const size_t state_bytes = static_cast<size_t>(p.num_chunks) * p.H * p.K * p.V * sizeof(backward::StateElement);
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
  // Segment split of the state walks: when the walks (sequences x heads x blocks x 2) fill less
  // than one wave of the GPU (2 CTAs per SM), cut them into segments of at least 8 chunks that fill
  // two. A split walk costs about twice the chunk updates (the local pass): at B8 T4096 H16 D128
  // (1.9 waves) a split into 2 segments made fwd+bwd slower, 5.32 -> 6.01 ms; at B1 T32768 H16
  // D128 (a quarter of a wave) a split into 8 made it faster, 8.91 -> 7.16 ms.
  {
    int64_t max_chunks = 0;
    for (int64_t n = 0; n < p.N; ++n) {
      const int64_t c = (seq_offsets[n + 1] - seq_offsets[n] + backward::kChunk - 1) / backward::kChunk;
      max_chunks = c > max_chunks ? c : max_chunks;
    }
    const int64_t walks = p.N * p.H * 2 * plan.key_tiles * plan.scan_value_groups;
    const int64_t slots = int64_t(sm_count > 0 ? sm_count : 1) * 2;
    if (walks > 0 && walks < slots && max_chunks >= 16) {
      const int64_t want = (2 * slots + walks - 1) / walks;
      int64_t seg = (max_chunks + want - 1) / want;
      seg = seg < 8 ? 8 : seg;
      const int64_t segments = (max_chunks + seg - 1) / seg;
      if (segments > 1) {
        plan.scan_segment_chunks = seg;
        plan.scan_segments = segments;
        const size_t blocks = static_cast<size_t>(p.N) * segments * p.H * 2 * plan.key_tiles * plan.scan_value_groups;
        plan.segment_states = at;
        at = align256(at + blocks * backward::kTile * backward::kScanValues * sizeof(float));
        plan.segment_decay = at;
        at = align256(at + blocks * backward::kTile * sizeof(float));
      }
    }
  }
  if (p.dv != nullptr && p.num_chunks > 0) {
    // The reversed varlen batch has the same lengths in reverse order (the segment planner and the
    // longest-first block order see the reversed offsets).
    std::vector<int64_t> offsets(seq_offsets, seq_offsets + p.N + 1);
    if (p.varlen) {
      for (int64_t i = 0; i <= p.N; ++i) offsets[i] = p.T - seq_offsets[p.N - i];
    }
    plan.values = plan_forward(backward::reversed_forward(p, plan, nullptr), offsets.data(), sm_count);
    const int64_t Kg = p.gate_per_head ? 1 : p.K;
    plan.reversed_gate = at;
    at = align256(at + static_cast<size_t>(p.B) * p.T * p.H * Kg * (p.gate_dtype == kF32 ? 4 : 2));
    if (p.varlen) {
      plan.reversed_offsets = at;
      at = align256(at + static_cast<size_t>(p.N + 1) * sizeof(int64_t));
    }
    if (p.dht != nullptr) {
      plan.reversed_dht = at;
      at = align256(at + static_cast<size_t>(p.N) * p.H * p.K * p.V * sizeof(float));
    }
    if (!backward::values_from_do(p)) {
      plan.zero_values = at;
      at = align256(at + static_cast<size_t>(p.B) * p.T * p.H * p.V * 2);
    }
    if (plan.values.workspace_bytes > 0) {
      plan.values_workspace = at;
      at = align256(at + plan.values.workspace_bytes);
    }
  }
  plan.workspace_bytes = at;
  return plan;
}

cudaError_t launch_backward(const BackwardParams& p, const BackwardPlan& plan, void* workspace, cudaStream_t stream) {
  const backward::Workspace ws = backward::workspace_views(plan, workspace);
  backward::chunk_offsets_kernel<<<1, backward::kOffsetThreads, 0, stream>>>(p, ws.chunk_offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return p.dtype == kBF16 ? backward::launch_typed<__nv_bfloat16>(p, plan, ws, workspace, stream)
                          : backward::launch_typed<__half>(p, plan, ws, workspace, stream);
}

}  // namespace gla::cuda
