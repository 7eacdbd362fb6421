// The recurrent backward kernels (recurrent_backward.hpp).
//
// Thread layout (KT threads, KT = K rounded up to 32, 64, 128 or 256): lane group cg = tid % 8
// owns the tile's values 4 cg .. 4 cg + 3, row group rg = tid / 8 owns the keys rg + (KT/8) r,
// r = 0..7. A thread holds 32 floats of each of three [KT, 32] tiles: the block's checkpoint, the
// working state and the state gradient. Whatever the state layout, h0, dht and dh0 are read and
// written element by element (once per CTA); the checkpoints are the threads' registers as they are
// (float4 r of thread tid at (slot * 8 + r) * KT + tid: coalesced).
//
// Per CTA: a forward pass over all blocks but the last stores the state at the start of each block
// (block = kRecurrentBackwardBlock steps); then from the last block to the first, the block's k, gk,
// v, gv are staged in shared memory, and for each of its steps from last to first the state before
// the step is recomputed from the block's checkpoint, giving
//   S_t = a b * S_{t-1} + k v^T,    dq_t[i] = scale sum_j S_t[i,j] do_t[j],
//   dS += scale q_t do_t^T,          dk_t[i] = sum_j dS[i,j] v_t[j],  dv_t[j] = sum_i dS[i,j] k_t[i],
//   x = dS * a b * S_{t-1},          dgk_t[i] = sum_j x,  dgv_t[j] = sum_i x,   dS *= a b.
// Sums over j are shuffles within a lane group; sums over i shuffles across the row groups of a
// warp and shared memory across warps. dv, dgv and dh0 are complete per tile; dq, dk and dgk are
// sums over the value tiles: with one tile they are stored directly, with more each tile stores its
// fp32 partial sums and recurrent_tile_sum adds them in tile order (no atomics: deterministic).
#include <cuda_runtime.h>

#include "backends/cuda/device_utils.cuh"
#include "backends/cuda/recurrent_backward.hpp"
#include "backends/cuda/recurrent_forward.hpp"

namespace gla::cuda {
namespace {

constexpr int kTile = static_cast<int>(kRecurrentValueTile);
constexpr int kBlock = static_cast<int>(kRecurrentBackwardBlock);
constexpr int kRows = 8;  // keys per thread
constexpr int kSumThreads = 256;

__device__ __forceinline__ float& at(float4& x, int c) { return reinterpret_cast<float*>(&x)[c]; }
__device__ __forceinline__ float at(const float4& x, int c) { return reinterpret_cast<const float*>(&x)[c]; }

int64_t key_tile(int64_t K) { return K <= 32 ? 32 : K <= 64 ? 64 : K <= 128 ? 128 : 256; }
int64_t value_tiles(int64_t V) { return (V + kTile - 1) / kTile; }
int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

// Checkpoint slots per (head, value tile): sequence n's block b >= 1 uses slot
// batch * floor(T / kBlock) + floor(bos / kBlock) + b - 1. The ranges of consecutive varlen
// sequences never overlap: floor(bos / C) + ceil(L / C) - 1 <= floor((bos + L) / C).
int64_t checkpoint_slots(const RecurrentBackwardParams& p) { return p.B * (p.T / kBlock); }
int64_t checkpoint_bytes(const RecurrentBackwardParams& p) {
  return align256(p.H * value_tiles(p.V) * checkpoint_slots(p) * key_tile(p.K) * kTile * 4);
}
// Bytes of one of dq / dk / dgk's per-tile partial sums (none with a single tile).
int64_t partial_bytes(const RecurrentBackwardParams& p) {
  const int64_t tiles = value_tiles(p.V);
  return tiles > 1 ? align256(tiles * p.B * p.T * p.H * p.K * 4) : 0;
}

struct Workspace {
  float4* checkpoints;
  float* partial[3];  // dq, dk, dgk (nullptr: absent or a single tile)
};

Workspace carve(const RecurrentBackwardParams& p, void* base) {
  char* at_byte = static_cast<char*>(base);
  Workspace w{};
  w.checkpoints = reinterpret_cast<float4*>(at_byte);
  at_byte += checkpoint_bytes(p);
  const int64_t part = partial_bytes(p);
  void* outputs[3] = {p.dq, p.dk, p.dgk};
  for (int x = 0; x < 3; ++x) {
    if (part == 0 || outputs[x] == nullptr) continue;
    w.partial[x] = reinterpret_cast<float*>(at_byte);
    at_byte += part;
  }
  return w;
}

template <int KT>
__global__ void __launch_bounds__(KT) recurrent_backward_kernel(const RecurrentBackwardParams p, const Workspace w) {
  constexpr int kGroupRows = KT / kRows;  // row groups
  constexpr int kWarps = KT / 32;
  __shared__ float sk[kBlock][KT], sa[kBlock][KT];
  __shared__ __align__(16) float sv[kBlock][kTile];
  __shared__ __align__(16) float sb[kBlock][kTile];
  __shared__ float sq[KT];
  __shared__ __align__(16) float sdo[kTile];
  __shared__ float srow[3][KT];
  __shared__ float scol[2][kWarps][kTile];

  const int tid = threadIdx.x, cg = tid & 7, rg = tid >> 3, lane = tid & 31, warp = tid >> 5;
  const int64_t tiles = (p.V + kTile - 1) / kTile;
  const int64_t n = blockIdx.x / tiles, tile = blockIdx.x % tiles;
  const int64_t v0 = tile * kTile;
  const int64_t h = blockIdx.y;
  const detail::SeqSpan span = detail::sequence_span(p, n);
  const int64_t L = span.len;
  const int64_t blocks = (L + kBlock - 1) / kBlock;

  // Element offset of the state entry (key i, value j) of sequence n, head h; -1 outside K x V.
  auto state_entry = [&](const int64_t* s, int r, int c) -> int64_t {
    const int64_t i = rg + kGroupRows * r, j = v0 + 4 * cg + c;
    return i < p.K && j < p.V ? detail::state_index(s, p.state_v_first, n, h, i, j) : -1;
  };
  auto load_state = [&](const float* base, const int64_t* s, float4* out) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t e = base ? state_entry(s, r, c) : -1;
        at(out[r], c) = e >= 0 ? base[e] : 0.f;
      }
    }
  };
  const int64_t slot0 = (h * tiles + tile) * (p.B * (p.T / kBlock)) + span.batch * (p.T / kBlock) + span.bos / kBlock;
  auto checkpoint = [&](int64_t b) -> float4* { return w.checkpoints + (slot0 + b - 1) * kRows * KT + tid; };
  auto token = [&](int64_t step) { return span.bos + (p.reverse ? L - 1 - step : step); };
  auto row = [&](const int64_t* s, int64_t tok) { return span.batch * s[0] + tok * s[1] + h * s[2]; };

  // k, a = e^gk, v, b = e^gv of block b's steps into shared memory (k = 0, a = 1 past K; v = 0,
  // b = 1 past V: the padding stays zero in S and dS).
  auto stage_block = [&](int64_t b) {
    const int64_t s0 = b * kBlock;
    const int count = static_cast<int>(detail::gla_min64(kBlock, L - s0));
    __syncthreads();  // the previous block's values are no longer read
    for (int m = 0; m < count; ++m) {
      const int64_t tok = token(s0 + m);
      float ki = 0.f, ai = 1.f;
      if (tid < p.K) {
        ki = detail::load_any(p.k, row(p.k_stride, tok) + tid, p.dtype);
        if (p.gk) ai = expf(detail::load_any(p.gk, row(p.gk_stride, tok) + tid, p.gk_dtype));
      }
      sk[m][tid] = ki;
      sa[m][tid] = ai;
    }
    for (int e = tid; e < count * kTile; e += KT) {
      const int m = e / kTile, jl = e % kTile;
      const int64_t tok = token(s0 + m), j = v0 + jl;
      float vj = 0.f, bj = 1.f;
      if (j < p.V) {
        vj = detail::load_any(p.v, row(p.v_stride, tok) + j, p.dtype);
        if (p.gv) bj = expf(detail::load_any(p.gv, row(p.gv_stride, tok) + j, p.gv_dtype));
      }
      sv[m][jl] = vj;
      sb[m][jl] = bj;
    }
    __syncthreads();
  };
  // S <- Diag(a) S Diag(b) + k v^T with step m of the staged block (the forward kernel's arithmetic).
  auto advance = [&](float4* S, int m) {
    const float4 vm = reinterpret_cast<const float4*>(sv[m])[cg], bm = reinterpret_cast<const float4*>(sb[m])[cg];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int i = rg + kGroupRows * r;
      const float ai = sa[m][i], ki = sk[m][i];
#pragma unroll
      for (int c = 0; c < 4; ++c) at(S[r], c) = fmaf(ai * at(bm, c), at(S[r], c), ki * at(vm, c));
    }
  };

  float4 S[kRows], dS[kRows];
  load_state(p.initial_state, p.h0_stride, S);

  // Forward: the state at the start of blocks 1 .. blocks - 1.
  for (int64_t b = 0; b + 1 < blocks; ++b) {
    stage_block(b);
    for (int m = 0; m < kBlock; ++m) advance(S, m);
    float4* out = checkpoint(b + 1);
#pragma unroll
    for (int r = 0; r < kRows; ++r) out[r * KT] = S[r];
  }

  load_state(p.dht, p.dht_stride, dS);
  const bool any_row = p.dq || p.dk || p.dgk;
  for (int64_t b = blocks - 1; b >= 0; --b) {
    float4 C[kRows];  // the state at the start of block b
    if (b == 0) {
      load_state(p.initial_state, p.h0_stride, C);
    } else {
      const float4* in = checkpoint(b);
#pragma unroll
      for (int r = 0; r < kRows; ++r) C[r] = in[r * KT];
    }
    stage_block(b);
    const int count = static_cast<int>(detail::gla_min64(kBlock, L - b * kBlock));
    for (int m = count - 1; m >= 0; --m) {
      const int64_t tok = token(b * kBlock + m);
      // The step's q and do are loaded first: their latency hides behind the recomputation.
      const float qi = tid < p.K ? p.scale * detail::load_any(p.q, row(p.q_stride, tok) + tid, p.dtype) : 0.f;
      const float doi = tid < kTile && p.do_ && v0 + tid < p.V
                            ? detail::load_any(p.do_, row(p.do_stride, tok) + v0 + tid, p.dtype)
                            : 0.f;
#pragma unroll
      for (int r = 0; r < kRows; ++r) S[r] = C[r];
      for (int u = 0; u < m; ++u) advance(S, u);  // S = the state before step m

      __syncthreads();  // the previous step's q, do, row and column sums are no longer read
      sq[tid] = qi;
      if (tid < kTile) sdo[tid] = doi;
      __syncthreads();

      const float4 vm = reinterpret_cast<const float4*>(sv[m])[cg], bm = reinterpret_cast<const float4*>(sb[m])[cg];
      const float4 dom = reinterpret_cast<const float4*>(sdo)[cg];
      float4 dv_part = make_float4(0.f, 0.f, 0.f, 0.f), dgv_part = dv_part;
      float dq_part[kRows], dk_part[kRows], dgk_part[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int i = rg + kGroupRows * r;
        const float ai = sa[m][i], ki = sk[m][i], qs = sq[i];
        float aq = 0.f, ak = 0.f, ag = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float ab = ai * at(bm, c), sp = at(S[r], c), dj = at(dom, c), vj = at(vm, c);
          const float st = fmaf(ab, sp, ki * vj);  // S_t
          aq = fmaf(st, dj, aq);
          const float ds = fmaf(qs, dj, at(dS[r], c));
          ak = fmaf(ds, vj, ak);
          at(dv_part, c) = fmaf(ds, ki, at(dv_part, c));
          const float x = ds * ab * sp;
          ag += x;
          at(dgv_part, c) += x;
          at(dS[r], c) = ds * ab;
        }
        dq_part[r] = aq;
        dk_part[r] = ak;
        dgk_part[r] = ag;
      }

      // Sums over the tile's values: the 8 lanes of a lane group.
      if (any_row) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
#pragma unroll
          for (int o = 1; o < 8; o <<= 1) {
            dq_part[r] += __shfl_xor_sync(0xffffffffu, dq_part[r], o);
            dk_part[r] += __shfl_xor_sync(0xffffffffu, dk_part[r], o);
            dgk_part[r] += __shfl_xor_sync(0xffffffffu, dgk_part[r], o);
          }
          if (cg == 0) {
            const int i = rg + kGroupRows * r;
            srow[0][i] = p.scale * dq_part[r];
            srow[1][i] = dk_part[r];
            srow[2][i] = dgk_part[r];
          }
        }
      }
      // Sums over the keys: the 4 row groups of a warp, then the warps.
      if (p.dv || p.dgv) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
#pragma unroll
          for (int o = 8; o < 32; o <<= 1) {
            at(dv_part, c) += __shfl_xor_sync(0xffffffffu, at(dv_part, c), o);
            at(dgv_part, c) += __shfl_xor_sync(0xffffffffu, at(dgv_part, c), o);
          }
          if (lane < 8) {
            scol[0][warp][4 * cg + c] = at(dv_part, c);
            scol[1][warp][4 * cg + c] = at(dgv_part, c);
          }
        }
      }
      __syncthreads();

      if (tid < p.K && any_row) {
        void* const outputs[3] = {p.dq, p.dk, p.dgk};
        const int64_t* const strides[3] = {p.dq_stride, p.dk_stride, p.dgk_stride};
        const int32_t types[3] = {p.dtype, p.dtype, p.dgk_dtype};
#pragma unroll
        for (int x = 0; x < 3; ++x) {
          if (!outputs[x]) continue;
          if (w.partial[x]) {
            w.partial[x][((tile * p.B + span.batch) * p.T + tok) * p.H * p.K + h * p.K + tid] = srow[x][tid];
          } else {
            detail::store_any(outputs[x], row(strides[x], tok) + tid, types[x], srow[x][tid]);
          }
        }
      }
      if ((p.dv || p.dgv) && tid < kTile && v0 + tid < p.V) {
        float dv = 0.f, dgv = 0.f;
#pragma unroll
        for (int wi = 0; wi < kWarps; ++wi) {
          dv += scol[0][wi][tid];
          dgv += scol[1][wi][tid];
        }
        if (p.dv) detail::store_any(p.dv, row(p.dv_stride, tok) + v0 + tid, p.dtype, dv);
        if (p.dgv) detail::store_any(p.dgv, row(p.dgv_stride, tok) + v0 + tid, p.dgv_dtype, dgv);
      }
    }
  }

  if (p.dh0) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int64_t e = state_entry(p.dh0_stride, r, c);
        if (e >= 0) p.dh0[e] = at(dS[r], c);
      }
    }
  }
}

// dq, dk, dgk = the sums of the value tiles' partial sums, in tile order; one thread per element.
__global__ void __launch_bounds__(kSumThreads) recurrent_tile_sum(const RecurrentBackwardParams p, const Workspace w) {
  const int64_t total = p.B * p.T * p.H * p.K, tiles = (p.V + kTile - 1) / kTile;
  void* const outputs[3] = {p.dq, p.dk, p.dgk};
  const int64_t* const strides[3] = {p.dq_stride, p.dk_stride, p.dgk_stride};
  const int32_t types[3] = {p.dtype, p.dtype, p.dgk_dtype};
  for (int64_t e = blockIdx.x * int64_t{kSumThreads} + threadIdx.x; e < total; e += int64_t{gridDim.x} * kSumThreads) {
    const int64_t i = e % p.K, h = e / p.K % p.H, t = e / (p.K * p.H) % p.T, b = e / (p.K * p.H * p.T);
#pragma unroll
    for (int x = 0; x < 3; ++x) {
      if (!w.partial[x]) continue;
      float sum = 0.f;
      for (int64_t tile = 0; tile < tiles; ++tile) sum += w.partial[x][tile * total + e];
      detail::store_any(outputs[x], b * strides[x][0] + t * strides[x][1] + h * strides[x][2] + i, types[x], sum);
    }
  }
}

template <int KT>
cudaError_t launch(const RecurrentBackwardParams& p, const Workspace& w, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.N * value_tiles(p.V)), static_cast<unsigned>(p.H));
  recurrent_backward_kernel<KT><<<grid, KT, 0, stream>>>(p, w);
  return cudaGetLastError();
}

}  // namespace

size_t recurrent_backward_workspace(const RecurrentBackwardParams& p, int row_gradients) {
  return static_cast<size_t>(checkpoint_bytes(p) + row_gradients * partial_bytes(p));
}

int launch_recurrent_backward(const RecurrentBackwardParams& p, void* workspace, void* stream) {
  if (p.N == 0 || p.H == 0) return cudaSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  const Workspace w = carve(p, workspace);
  const int64_t kt = key_tile(p.K);
  cudaError_t err = kt == 32 ? launch<32>(p, w, s) : kt == 64 ? launch<64>(p, w, s) : kt == 128 ? launch<128>(p, w, s) : launch<256>(p, w, s);
  if (err != cudaSuccess || !(w.partial[0] || w.partial[1] || w.partial[2])) return err;
  const int64_t total = p.B * p.T * p.H * p.K;
  const int64_t blocks = detail::gla_min64((total + kSumThreads - 1) / kSumThreads, int64_t{1} << 16);
  if (blocks == 0) return cudaSuccess;
  recurrent_tile_sum<<<static_cast<unsigned>(blocks), kSumThreads, 0, s>>>(p, w);
  return cudaGetLastError();
}

}  // namespace gla::cuda
