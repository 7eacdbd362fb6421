// The intra-chunk matrix over all keys for the key split (128 < K <= 256 on the warp-specialised
// kernel, ForwardPlan::key_split == 2): A[t, s] = sum_k q_tk k_sk 2^{b_tk - b_sk} of each 64-token
// chunk, accumulated in fp32 over every key and rounded to 16 bits once. Formed per key half and
// summed, A and o are each rounded twice, so their error scales with the halves' magnitudes: where
// q.k cancels between the halves the row was off by up to 14% (fla's GLA model at K 256, the first
// tokens), against 0.4% for one rounding. It costs the K 256 forward ~9% (H200, B8 T2048 H4 K256
// V512: 0.565 against 0.518 ms with A per half).
//
// One CTA per (sequence, chunk, head), 512 threads, one chunk in shared memory (intra_smem_layout):
//   off-diagonal 16x16 blocks on tensor cores from the pivoted copies, as the chunk kernels form
//     them (offdiag_block at DK = 256; each row of such a block sums 16+ terms);
//   the 16x16 diagonal blocks element-wise in fp32 (SPEC.md 3.2): A[t, s] = sum_k q_tk k_sk F_tk
//     with F the running product of the factors e_u = 2^{g_u log2 e}, u = s+1..t (each <= 1, no
//     exponent per pair). The pivot-level copies the chunk kernels use there are rounded to 16
//     bits, which left the first rows of a sequence (one to three terms each) 1-2% off where q.k
//     nearly cancels.
#include "backends/cuda/chunk_forward_kernel.cuh"
#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/kernel_attributes.cuh"

namespace gla::cuda::detail {
namespace {

constexpr int kIntraThreads = 2 * kIntraDK;

template <typename E>
__global__ void __launch_bounds__(kIntraThreads, 1)
chunk_intra_kernel(const __grid_constant__ ForwardParams p, uint16_t* __restrict__ intra, int64_t max_chunks) {
  using X = Elem<E>;
  constexpr int DK = kIntraDK, NT = kIntraThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = blockIdx.x / max_chunks, c = blockIdx.x % max_chunks, h = blockIdx.y;
  const SeqSpan seq = sequence_span(p, n);
  if (c * kChunk >= seq.len) return;
  const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk));
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;
  const bool per_head = p.gate_per_head != 0;
  const ChunkSmem L = intra_smem_layout();
  uint16_t* qs = reinterpret_cast<uint16_t*>(smem + L.q);
  uint16_t* ks = reinterpret_cast<uint16_t*>(smem + L.k);
  unsigned char* gs = smem + L.g;
  uint16_t* qw = reinterpret_cast<uint16_t*>(smem + L.qw);
  uint16_t* kw = reinterpret_cast<uint16_t*>(smem + L.kw);
  uint16_t* As = reinterpret_cast<uint16_t*>(smem + L.a);
  float* tot = reinterpret_cast<float*>(smem + L.tot);

  // A is zero above the diagonal and in the diagonal blocks' strict upper parts.
  for (int i = tid; i < kChunk * L.pa / 2; i += NT) reinterpret_cast<uint32_t*>(As)[i] = 0u;

  // q, k, g of the chunk; keys past K and rows past the sequence read 0 (gate 0: factor 1).
  const int64_t esz = 2;  // signed: time strides may be negative (the backward's reversed forward)
  const int64_t t0 = seq.bos + c * kChunk;
  const char* qb = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + t0 * p.q_stride[1] + h * p.q_stride[2]) * esz;
  const char* kb = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + t0 * p.k_stride[1] + h * p.k_stride[2]) * esz;
  const char* gb = static_cast<const char*>(p.g) + (seq.batch * p.g_stride[0] + t0 * p.g_stride[1] + h * p.g_stride[2]) * gate_bytes;
  if (p.vector_loads) {
    constexpr int CPR = DK / 8;
    for (int i = tid; i < kChunk * CPR; i += NT) {
      const int r = i / CPR, cc = i % CPR;
      const bool ok = r < rows && cc * 8 < p.K;
      cp_async16(smem + L.q + (r * L.pq + cc * 8) * 2, ok ? qb + (r * p.q_stride[1] + cc * 8) * esz : qb, ok);
      cp_async16(smem + L.k + (r * L.pq + cc * 8) * 2, ok ? kb + (r * p.k_stride[1] + cc * 8) * esz : kb, ok);
    }
    if (!per_head) {
      const int gpr = DK * gate_bytes / 16, gper = 16 / gate_bytes;
      for (int i = tid; i < kChunk * gpr; i += NT) {
        const int r = i / gpr, cc = i % gpr;
        const bool ok = r < rows && cc * gper < p.K;
        cp_async16(gs + (r * L.pg + cc * gper) * gate_bytes, ok ? gb + (r * p.g_stride[1] + cc * gper) * gate_bytes : gb, ok);
      }
    }
    cp_async_commit();
  } else {
    for (int i = tid; i < kChunk * DK; i += NT) {
      const int r = i / DK, cc = i % DK;
      const bool ok = r < rows && cc < p.K;
      qs[r * L.pq + cc] = ok ? reinterpret_cast<const uint16_t*>(qb)[r * p.q_stride[1] + cc] : uint16_t(0);
      ks[r * L.pq + cc] = ok ? reinterpret_cast<const uint16_t*>(kb)[r * p.k_stride[1] + cc] : uint16_t(0);
      if (!per_head) {
        if (gate_bytes == 4) {
          reinterpret_cast<float*>(gs)[r * L.pg + cc] = ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1] + cc] : 0.f;
        } else {
          reinterpret_cast<uint16_t*>(gs)[r * L.pg + cc] = ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1] + cc] : uint16_t(0);
        }
      }
    }
  }
  if (per_head) {
    for (int r = tid; r < kChunk; r += NT) {
      const bool ok = r < rows;
      if (gate_bytes == 4) {
        reinterpret_cast<float*>(gs)[r] = ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1]] : 0.f;
      } else {
        reinterpret_cast<uint16_t*>(gs)[r] = ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1]] : uint16_t(0);
      }
    }
  }
  cp_async_wait_all();
  __syncthreads();

  // Element-wise, one thread per (column pair, sub-chunk): the factors e, the sub-chunk totals,
  // qloc and kloc; then e in fp32 over the raw gate (after every raw gate read).
  float* es = reinterpret_cast<float*>(gs);
  {
    const int cp = tid % (DK / 2), sub = tid / (DK / 2), k0 = cp * 2;
    float e0[16], e1[16];
    local_copies_item<DK, X>(L, tid, qs, ks, gs, qw, kw, tot, per_head, gate_bytes, e0, e1);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 16; ++r) *reinterpret_cast<float2*>(es + (sub * 16 + r) * L.pg + k0) = make_float2(e0[r], e1[r]);
  }
  __syncthreads();

  if (warp < 6) {
    // Off-diagonal blocks (i, j): (1,0) (2,1) (3,2) (2,0) (3,1) (3,0), packed as nibbles.
    offdiag_block<DK, X>(As, L.pa, qw, kw, L.pq, tot, (0x332321 >> (4 * warp)) & 15, (0x010210 >> (4 * warp)) & 15,
                         lane);
  }
  // Diagonal blocks: thread (sub-chunk, key row pair sp, column group cg of 16 keys) forms the
  // partial sums over its keys of A[t, s] for s = sp (rows t = sp..15), then s = 15 - sp (rows
  // 15-sp..15): 17 rows on every thread, so the reduction over the 16 column groups (a half warp)
  // runs in step across the warp.
  {
    const int sub = tid >> 7, sp = (tid >> 4) & 7, cg = tid & 15, col = cg * 16;
    const int first_rows = 16 - sp;
    float kf[16], f[16];
    int s = sp;
    for (int i = 0; i < 17; ++i) {
      if (i == 0 || i == first_rows) {
        s = i == 0 ? sp : 15 - sp;
#pragma unroll
        for (int j = 0; j < 16; j += 2) {
          const float2 kk = X::to_float2(*reinterpret_cast<const uint32_t*>(ks + (sub * 16 + s) * L.pq + col + j));
          kf[j] = kk.x;
          kf[j + 1] = kk.y;
          f[j] = f[j + 1] = 1.f;
        }
      }
      const int t = i < first_rows ? sp + i : s + (i - first_rows);
      const int trow = sub * 16 + t;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        if (t > s) {
          const float2 e = *reinterpret_cast<const float2*>(es + trow * L.pg + col + j);
          f[j] *= e.x;
          f[j + 1] *= e.y;
        }
        const float2 qq = X::to_float2(*reinterpret_cast<const uint32_t*>(qs + trow * L.pq + col + j));
        sum = fmaf(qq.x * kf[j], f[j], sum);
        sum = fmaf(qq.y * kf[j + 1], f[j + 1], sum);
      }
#pragma unroll
      for (int o = 8; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      if (cg == 0) As[trow * L.pa + sub * 16 + s] = X::from_float(sum);
    }
  }
  __syncthreads();

  // Rows of A (64 values, 8 pieces of 16 bytes) to global memory.
  for (int i = tid; i < rows * 8; i += NT) {
    const int r = i >> 3, piece = i & 7;
    uint16_t* dst = intra + ((seq.batch * p.T + seq.bos + c * kChunk + r) * p.H + h) * kChunk + piece * 8;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(As + r * L.pa + piece * 8);
  }
}

template <typename E>
cudaError_t run_intra(const ForwardParams& p, int64_t max_chunks, uint16_t* intra, cudaStream_t stream) {
  const ChunkSmem L = intra_smem_layout();
  if (const cudaError_t err = allow_dynamic_shared_memory<chunk_intra_kernel<E>>(L.total); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.N * max_chunks), static_cast<unsigned>(p.H));
  chunk_intra_kernel<E><<<grid, kIntraThreads, L.total, stream>>>(p, intra, max_chunks);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_intra_matrix(const ForwardParams& p, int64_t max_chunks, uint16_t* intra, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0 || max_chunks == 0) return cudaSuccess;
  if (p.dtype == kBF16) return run_intra<__nv_bfloat16>(p, max_chunks, intra, stream);
  return run_intra<__half>(p, max_chunks, intra, stream);
}

}  // namespace gla::cuda::detail
