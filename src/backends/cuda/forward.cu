// Forward launch (the plan comes from plan.cpp), and the generic recurrent kernel (fp32 FMA token
// loop).
#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/chunk_forward_instances.cuh"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda {
namespace detail {

constexpr int kRecTokens = kRecurrentTokens;  // tokens staged per block step (chunk_layout.hpp)
constexpr int kRecThreads = kRecurrentThreads;

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
      // ForwardParams::gate_lag: token t's gate is row t - 1, the sequence's first token's is 0.
      const int64_t gi = seq.batch * p.g_stride[0] + (t - p.gate_lag) * p.g_stride[1] + h * p.g_stride[2] + (p.gate_per_head ? 0 : kk);
      sg[tt * K + kk] = p.gate_lag && t0 + tt == 0 ? 1.f : exp2f(kLog2e * load_any(p.g, gi, p.gate_dtype));
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
  const size_t smem = recurrent_smem_bytes(p.K);
  auto kernel = recurrent_forward_kernel<KR>;
  if (smem > 48 * 1024) {
    const cudaError_t err = allow_dynamic_shared_memory<recurrent_forward_kernel<KR>>(smem);
    if (err != cudaSuccess) return err;
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

namespace detail {

// o += partial (the key split's second half), in fp32, rounded once to o's type. Rows r = (b, t, h)
// of B*T*H; partial is contiguous [B*T*H, V].
template <typename E>
__global__ void add_partial_kernel(const ForwardParams p, const uint16_t* __restrict__ partial) {
  using X = Elem<E>;
  const int64_t rows = p.B * p.T * p.H;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const int64_t h = r % p.H, bt = r / p.H, t = bt % p.T, b = bt / p.T;
    uint16_t* o = static_cast<uint16_t*>(p.o) + b * p.o_stride[0] + t * p.o_stride[1] + h * p.o_stride[2];
    const uint16_t* s = partial + r * p.V;
    for (int64_t j = threadIdx.x; j < p.V; j += blockDim.x) o[j] = X::from_float(X::to_float(o[j]) + X::to_float(s[j]));
  }
}

cudaError_t launch_key_split(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  const size_t esz = 2;
  ForwardParams lo = p, hi = p;
  lo.K = 128;
  hi.K = p.K - 128;
  hi.q = static_cast<const char*>(p.q) + 128 * esz;
  hi.k = static_cast<const char*>(p.k) + 128 * esz;
  if (!p.gate_per_head) hi.g = static_cast<const char*>(p.g) + 128 * (p.gate_dtype == kF32 ? 4 : 2);
  // The state's key rows 128.. (key stride: dimension 2, or 3 with state_v_first).
  const int kd = p.state_v_first ? 3 : 2;
  if (p.initial_state) hi.initial_state = p.initial_state + 128 * p.h0_stride[kd];
  if (p.final_state) hi.final_state = p.final_state + 128 * p.ht_stride[kd];
  if (p.chunk_states) hi.chunk_states = p.chunk_states + 128 * p.chunk_states_stride[3];
  // A over all keys first (chunk_forward_intra.cu says why), then o = q S of the first half's
  // keys, then the second half's q S and A v: added into o as it is stored (key_split 2), or
  // stored apart and added by a third kernel (key_split 1).
  uint16_t* intra = reinterpret_cast<uint16_t*>(static_cast<char*>(workspace) + plan.intra_offset);
  PreparedInputs prepared{};
  if (plan.prepared) {
    const PreparedLayout layout = prepared_layout(p);
    char* base = static_cast<char*>(workspace) + plan.prepared_offset;
    prepared.decay = reinterpret_cast<float*>(base);
    prepared.decay_log2 = prepared.decay + layout.decays;
    uint16_t* inputs = reinterpret_cast<uint16_t*>(base + layout.inputs);
    const bool placed = p.prepared_qg != nullptr && p.prepared_kg != nullptr;
    prepared.qg = placed ? p.prepared_qg : inputs;
    prepared.kg = placed ? p.prepared_kg : inputs + size_t(p.B) * p.T * p.H * p.K;
  }
  cudaError_t err = launch_intra_matrix(p, plan.segment_chunks * plan.max_segments, intra, prepared, stream);
  if (err != cudaSuccess) return err;
  lo.key_half = 1;
  hi.key_half = 2;
  hi.intra = intra;
  if (plan.prepared) {
    // Both halves read the prepared qg, kg and decays (their keys 0..127 and 128..K-1) in place of q, k, g.
    for (ForwardParams* half : {&lo, &hi}) {
      const int64_t key0 = half == &hi ? 128 : 0;
      half->prepared = 1;
      half->q = prepared.qg + key0;
      half->k = prepared.kg + key0;
      half->q_stride[0] = half->k_stride[0] = p.T * p.H * p.K;
      half->q_stride[1] = half->k_stride[1] = p.H * p.K;
      half->q_stride[2] = half->k_stride[2] = p.K;
      half->chunk_decay = prepared.decay + key0;
      half->chunk_decay_log2 = prepared.decay_log2 + key0;
      half->chunk_decay_stride = p.K;
    }
  }
  err = launch_chunk_forward(lo, plan, workspace, stream);
  if (err != cudaSuccess) return err;
  if (plan.key_split == 2) return launch_chunk_forward(hi, plan, workspace, stream);
  void* partial = static_cast<char*>(workspace) + plan.partial_offset;
  hi.o = partial;
  hi.o_stride[2] = p.V;
  hi.o_stride[1] = p.H * p.V;
  hi.o_stride[0] = p.T * p.H * p.V;
  err = launch_chunk_forward(hi, plan, workspace, stream);
  if (err != cudaSuccess) return err;
  const int64_t rows = p.B * p.T * p.H;
  if (rows == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(gla_min64(rows, 65535 * 8));
  const int threads = p.V >= 256 ? 256 : 128;
  if (p.dtype == kBF16) {
    add_partial_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(p, static_cast<const uint16_t*>(partial));
  } else {
    add_partial_kernel<__half><<<blocks, threads, 0, stream>>>(p, static_cast<const uint16_t*>(partial));
  }
  return cudaGetLastError();
}

}  // namespace detail

cudaError_t launch_chunk_first(const ForwardParams& p, int64_t* first, cudaStream_t stream) {
  detail::chunk_offsets_kernel<<<1, detail::kChunkOffsetThreads, 0, stream>>>(p, first);
  return cudaGetLastError();
}

cudaError_t launch_forward(const ForwardParams& p, const ForwardPlan& plan, void* workspace, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0) return cudaSuccess;
  if (p.pad_front && !is_warp_specialised(plan.kernel)) return cudaErrorInvalidValue;  // ForwardParams::pad_front
  if (is_chunk(plan.kernel) && plan.key_split) return detail::launch_key_split(p, plan, workspace, stream);
  if (is_chunk(plan.kernel)) return launch_chunk_forward(p, plan, workspace, stream);
  return launch_recurrent_forward(p, 0, stream);
}

}  // namespace gla::cuda
