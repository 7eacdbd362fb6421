// Forward planning and launch, and the generic recurrent kernel (fp32 FMA token loop).
#include <algorithm>
#include <functional>
#include <queue>
#include <vector>

#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/chunk_forward_instances.cuh"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda {
namespace detail {

constexpr int kRecTokens = 8;  // tokens staged per block step
constexpr int kRecThreads = 256;

// One CTA per (sequence, value tile of 32, head). Thread (group, j) owns value column j and key
// rows group + 8 r. IEEE fp32 arithmetic throughout.
template <int KR>
__global__ void __launch_bounds__(kRecThreads)
recurrent_forward_kernel(const __grid_constant__ ForwardParams p, int value_tiles) {
  extern __shared__ __align__(16) float rs[];
  const int K = static_cast<int>(p.K);
  float* sq = rs;
  float* sk = sq + kRecTokens * K;
  float* sg = sk + kRecTokens * K;
  float* sv = sg + kRecTokens * K;
  float* red = sv + kRecTokens * 32;
  const int tid = threadIdx.x, j = tid & 31, grp = tid >> 5;
  const int64_t n = blockIdx.x / value_tiles;
  const int64_t v0 = int64_t(blockIdx.x % value_tiles) * 32;
  const int64_t h = blockIdx.y;
  const SeqSpan seq = sequence_span(p, n);
  const int64_t vcol = v0 + j;
  const bool vok = vcol < p.V;

  float S[KR];
#pragma unroll
  for (int r = 0; r < KR; ++r) {
    const int kk = grp + 8 * r;
    S[r] = (p.initial_state && kk < K && vok)
               ? p.initial_state[state_index(p.h0_stride, p.state_v_first, n, h, kk, vcol)]
               : 0.f;
  }
  for (int64_t t0 = 0; t0 < seq.len; t0 += kRecTokens) {
    const int nt = static_cast<int>(gla_min64(kRecTokens, seq.len - t0));
    __syncthreads();
    for (int i = tid; i < nt * K; i += kRecThreads) {
      const int tt = i / K, kk = i % K;
      const int64_t t = seq.bos + t0 + tt;
      sq[tt * K + kk] = load_any(p.q, seq.batch * p.q_stride[0] + t * p.q_stride[1] + h * p.q_stride[2] + kk, p.dtype);
      sk[tt * K + kk] = load_any(p.k, seq.batch * p.k_stride[0] + t * p.k_stride[1] + h * p.k_stride[2] + kk, p.dtype);
      const int64_t gi = seq.batch * p.g_stride[0] + t * p.g_stride[1] + h * p.g_stride[2] + (p.gate_per_head ? 0 : kk);
      sg[tt * K + kk] = exp2f(kLog2e * load_any(p.g, gi, p.gate_dtype));
    }
    if (tid < nt * 32) {
      const int tt = tid >> 5;
      const int64_t t = seq.bos + t0 + tt;
      sv[tt * 32 + j] = vok ? load_any(p.v, seq.batch * p.v_stride[0] + t * p.v_stride[1] + h * p.v_stride[2] + vcol, p.dtype) : 0.f;
    }
    __syncthreads();
    for (int tt = 0; tt < nt; ++tt) {
      const float vj = sv[tt * 32 + j];
      float part = 0.f;
#pragma unroll
      for (int r = 0; r < KR; ++r) {
        const int kk = grp + 8 * r;
        if (kk < K) {
          S[r] = fmaf(sg[tt * K + kk], S[r], sk[tt * K + kk] * vj);
          part = fmaf(sq[tt * K + kk], S[r], part);
        }
      }
      red[(tt * 8 + grp) * 32 + j] = part;
    }
    __syncthreads();
    if (tid < nt * 32) {
      const int tt = tid >> 5;
      float sum = 0.f;
#pragma unroll
      for (int g2 = 0; g2 < 8; ++g2) sum += red[(tt * 8 + g2) * 32 + j];
      const int64_t t = seq.bos + t0 + tt;
      if (vok) store_any(p.o, seq.batch * p.o_stride[0] + t * p.o_stride[1] + h * p.o_stride[2] + vcol, p.dtype, sum * p.scale);
    }
  }
  if (p.final_state) {
#pragma unroll
    for (int r = 0; r < KR; ++r) {
      const int kk = grp + 8 * r;
      if (kk < K && vok) p.final_state[state_index(p.ht_stride, p.state_v_first, n, h, kk, vcol)] = S[r];
    }
  }
}

template <int KR>
cudaError_t run_recurrent(const ForwardParams& p, cudaStream_t stream) {
  const int value_tiles = static_cast<int>((p.V + 31) / 32);
  const size_t smem = (size_t(kRecTokens) * p.K * 3 + kRecTokens * 32 + kRecTokens * 8 * 32) * sizeof(float);
  auto kernel = recurrent_forward_kernel<KR>;
  static size_t raised = 0;
  if (smem > 48 * 1024 && raised < smem) {
    cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    raised = smem;
  }
  const dim3 grid(static_cast<unsigned>(p.N * value_tiles), static_cast<unsigned>(p.H));
  kernel<<<grid, kRecThreads, smem, stream>>>(p, value_tiles);
  return cudaGetLastError();
}

}  // namespace detail

cudaError_t launch_recurrent_forward(const ForwardParams& p, int64_t /*max_len*/, cudaStream_t stream) {
  if (p.K <= 64) return detail::run_recurrent<8>(p, stream);
  if (p.K <= 128) return detail::run_recurrent<16>(p, stream);
  if (p.K <= 256) return detail::run_recurrent<32>(p, stream);
  return detail::run_recurrent<64>(p, stream);
}

cudaError_t launch_chunk_forward(const ForwardParams& p, const ForwardPlan& plan, void* workspace,
                                 cudaStream_t stream) {
  if (plan.head_dim_k == 64) return detail::run_chunk_d64(p, plan, workspace, stream);
  return detail::run_chunk_d128(p, plan, workspace, stream);
}

namespace {

// Makespan (in chunk units) of blocks dispatched in launch order onto `slots` resident CTAs.
double simulate(const std::vector<double>& costs, int slots) {
  std::priority_queue<double, std::vector<double>, std::greater<double>> free_at;
  for (int i = 0; i < slots; ++i) free_at.push(0.0);
  double end = 0.0;
  for (double c : costs) {
    double t = free_at.top();
    free_at.pop();
    t += c;
    end = std::max(end, t);
    free_at.push(t);
  }
  return end;
}

}  // namespace

ForwardPlan plan_forward(const ForwardParams& p, const int64_t* seq_offsets, int sm_count) {
  ForwardPlan plan;
  const bool tensor_core = (p.dtype == kBF16 || p.dtype == kF16) && p.K <= 128 && p.K >= 1 && p.V >= 1;
  if (!tensor_core) return plan;
  plan.use_chunk_kernel = 1;
  plan.head_dim_k = p.K <= 64 ? 64 : 128;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  // Kernel choice: the warp-specialised kernel needs cp.async rows and a 16-bit per-key gate or a
  // per-head gate (an fp32 per-key gate does not fit its shared memory); the others take anything.
  const bool ws_ok = p.vector_loads && (p.gate_per_head || gate_bytes == 2);
  // Variants: 0 auto, 1 mma-diag, 2 plain, 3 ws-split, 4 ws, 5 ws-split4, 6 ws-deep1 (see
  // ForwardParams::kernel_variant).
  plan.local_deep = p.kernel_variant == 6 ? 1 : 0;
  const int v = p.kernel_variant == 6 ? 0 : p.kernel_variant;
  plan.kernel = v == 2 ? 0 : ((v == 0 || v >= 3) && ws_ok ? 2 : 1);
  // Split element-wise items: measured 1.50x faster than unsplit at K <= 64 (B4 T8192 H32 D64,
  // bench/results/cuda_forward.md); at K = 128 opt-in until measured.
  if (plan.kernel == 2 && (v == 3 || (v == 0 && plan.head_dim_k == 64))) plan.kernel = 3;
  // Kernel 5: four threads per element-wise item at K <= 64 (opt-in, not yet run on a GPU).
  if (plan.kernel == 2 && v == 5 && plan.head_dim_k == 64) plan.kernel = 5;
  plan.value_tile = plan.kernel != 0 ? plan.head_dim_k : (plan.head_dim_k == 128 && p.V > 64 ? 128 : 64);
  plan.value_tiles = static_cast<int32_t>((p.V + plan.value_tile - 1) / plan.value_tile);
  const detail::ChunkSmem L =
      detail::chunk_smem_layout(plan.head_dim_k, plan.value_tile, gate_bytes, p.gate_per_head != 0,
                                plan.kernel == 1);
  const int per_sm = plan.kernel < 2 && L.total * 2 + 2048 <= 228 * 1024 ? 2 : 1;
  const int slots = std::max(1, sm_count) * per_sm;

  std::vector<int64_t> chunks(static_cast<size_t>(p.N));
  int64_t max_chunks = 0;
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t len = seq_offsets[n + 1] - seq_offsets[n];
    chunks[n] = (len + 63) / 64;
    max_chunks = std::max(max_chunks, chunks[n]);
  }
  const int64_t copies = p.H * plan.value_tiles;
  plan.segment_chunks = std::max<int64_t>(1, max_chunks);
  plan.max_segments = 1;
  // Candidate segment lengths; cost = pass-2 makespan + pass-1 makespan (state-only chunks cost
  // about half) + one chunk of overhead per segment for folding the earlier states.
  if (p.N * copies * std::max<int64_t>(1, max_chunks / 8) <= 400000 && max_chunks > 8) {
    double best = -1.0;
    for (int64_t seg : {max_chunks, int64_t(96), int64_t(64), int64_t(48), int64_t(32), int64_t(24),
                        int64_t(16), int64_t(12), int64_t(8)}) {
      if (seg > max_chunks) continue;
      const int64_t max_seg = (max_chunks + seg - 1) / seg;
      std::vector<double> pass2, pass1;
      for (int64_t y = 0; y < copies; ++y) {
        for (int64_t n = 0; n < p.N; ++n) {
          const int64_t ns = chunks[n] == 0 ? 1 : (chunks[n] + seg - 1) / seg;
          for (int64_t m = 0; m < max_seg; ++m) {
            if (m >= ns) {
              pass2.push_back(0.02);
              continue;
            }
            const int64_t len = std::min(seg, chunks[n] - m * seg);
            pass2.push_back(double(len) + 0.3 + 0.15 * double(m));
            if (m < ns - 1) pass1.push_back(0.5 * double(len) + 0.3);
          }
        }
      }
      double cost = simulate(pass2, slots);
      if (!pass1.empty()) cost += simulate(pass1, slots) + 1.0;
      if (best < 0 || cost < best * 0.97) {
        best = cost;
        plan.segment_chunks = seg;
        plan.max_segments = max_seg;
      }
    }
  }
  if (plan.max_segments > 1) {
    const size_t per = size_t(plan.value_tiles) * plan.value_tile * plan.head_dim_k + plan.head_dim_k;
    plan.workspace_bytes = size_t(p.N) * plan.max_segments * p.H * per * sizeof(float);
  }
  return plan;
}

cudaError_t launch_forward(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) return cudaSuccess;
  if (plan.use_chunk_kernel) return launch_chunk_forward(p, plan, workspace, stream);
  return launch_recurrent_forward(p, 0, stream);
}

}  // namespace gla::cuda
