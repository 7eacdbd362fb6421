// The backward's two state walks (SPEC.md §2 B0 and B1), one kernel template:
//   forward  S_{c+1}  = Diag(2^{b_last}) S_c      + (k ⊙ 2^{b_last - b})ᵀ v      from initial_state
//   reverse  dS_c     = Diag(2^{b_last}) dS_{c+1} + (scale q ⊙ 2^{b})ᵀ do       from dht; dh0 = dS_0
// Both have the form X ← Diag(decay) X + (keys ⊙ factor)ᵀ values, and the decay is diagonal in the
// keys, so a CTA owns one 64 x 64 (key tile, value tile) block of one (sequence, head) and walks the
// sequence's chunks, storing the block before each chunk's update: S_c (forward) or dS_{c+1}
// (reverse) for the gradient kernels, in bf16. With BackwardPlan::state_grads_by_values the grid
// holds no reverse walks (the reversed forward stores the state gradients), with saved states no
// forward walks.
//
// The block lives in fp32 registers as the transposed block Xᵀ [values x keys] in mma.sync C
// fragments, warp w owning value rows 16w..16w+15: the forward's state update (chunk_tile_ops.cuh,
// state_update) applies unchanged, the decay is one multiply per entry by a per-key factor, and the
// block goes to the workspace through a shared-memory stage as 16-byte rows. (The first version
// kept the block in shared memory and ran WMMA on it: 2.0 ms for both walks at B8 T4096 H16 D128.)
// A CTA walks 64 keys x 128 values (8 warps): the chunk's gate cumsum and key factors, the
// element-wise part of each step, are then made once per 128 values instead of once per 64.
//
// Few sequences and heads do not fill the GPU (B1 T32768 H16: 64 walks of 512 chunks), so the
// planner can split each walk into segments of scan_segment_chunks chunks, as the forward does: a
// local pass walks every segment but the last from a zero block and keeps its end block L_m and
// its total decay D_m (the sum of its chunks' b_last); the full pass starts segment m from the
// walk's start block folded through the earlier segments, X <- 2^{D_s} X + L_s, and stores.
#pragma once

#include "backends/cuda/chunk_backward_common.cuh"
#include "backends/cuda/chunk_tile_ops.cuh"

namespace gla::cuda::backward {

constexpr int kScanThreads = 256;  // 8 warps x 16 value rows
constexpr int kScanLd = kScanValues + 8;  // row pitch of the value tiles (elements): 272 B rows

struct ScanShared {
  alignas(128) float b[kChunk * kTile];            // chunk-local cumulative gate, log2 units
  alignas(128) uint16_t keys[kChunk * kLd16];      // [token][key]: k ⊙ 2^{b_last - b} or scale q ⊙ 2^{b}
  alignas(128) uint16_t values[kChunk * kScanLd];  // [token][value]: v or do
  alignas(128) uint16_t stage[kTile * kScanLd];    // [key][value]: the block before the update, bf16
  float decay[kTile];                              // 2^{b_last} per key
  float column_part[kScanThreads / kTile][kTile];  // the gate cumsum's row-group sums
};

// grid: (N * scan_segments, H, scan_directions * key_tiles * scan_value_groups); z < key_tiles *
// scan_value_groups walks forward (reverse with scan_reverse_only). LOCAL: the local pass of a
// segment split.
template <typename E, bool LOCAL>
__global__ void __launch_bounds__(kScanThreads, 2) state_scan_kernel(BackwardParams p, BackwardPlan plan,
                                                                  Workspace ws) {
  using X = detail::Elem<E>;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  ScanShared& sh = *reinterpret_cast<ScanShared*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int vrow = 16 * warp;
  const int64_t segments = plan.scan_segments, n = blockIdx.x / segments, m = blockIdx.x % segments;
  const int64_t h = blockIdx.y;
  const int tiles = plan.key_tiles * plan.scan_value_groups;  // blocks per direction
  const int z = static_cast<int>(blockIdx.z) + (plan.scan_reverse_only ? tiles : 0);  // direction, tile
  const bool reverse = z >= tiles;
  const int tile = z % tiles;
  const int64_t k0 = int64_t(tile / plan.scan_value_groups) * kTile;
  const int64_t v0 = int64_t(tile % plan.scan_value_groups) * kScanValues;
  const int64_t kv = p.K - k0 < kTile ? p.K - k0 : kTile, vv = p.V - v0 < kScanValues ? p.V - v0 : kScanValues;
  const bool warp_has_values = vrow < vv;  // warps past the last value skip the tensor-core update
  const Span seq = sequence(p, n);
  const int64_t chunks = (seq.len + kChunk - 1) / kChunk;
  const int64_t first_chunk = ws.chunk_offsets[n];
  // This CTA's steps [step0, step1) of the walk (step s is chunk s forward, chunks - 1 - s reversed).
  const int64_t seg = plan.scan_segment_chunks > 0 ? plan.scan_segment_chunks : (chunks > 0 ? chunks : 1);
  const int64_t own_segments = chunks > 0 ? (chunks + seg - 1) / seg : 1;
  if (m >= own_segments || (LOCAL && m == own_segments - 1)) return;
  const int64_t step0 = m * seg, step1 = step0 + seg < chunks ? step0 + seg : chunks;
  // The segment's local end block and decay: [(n * segments + m) * H + h][z][64 x 128 | 64].
  const int64_t local_index = ((n * segments + m) * p.H + h) * (2 * tiles) + z;

  // The walk's starting block: initial_state forward, dht in reverse (zeros when absent).
  const float* start = reverse ? p.dht : p.initial_state;
  const int64_t* start_stride = reverse ? p.dht_stride : p.h0_stride;
  float S[kTile / 8][4];  // Xᵀ: entry (value vrow + .., key ..)
  detail::for_each_state_entry<kTile>(vrow, lane, [&](int j, int e, int value, int key) {
    S[j][e] = !LOCAL && start != nullptr && key < kv && value < vv
                  ? start[state_at(start_stride, p.state_v_first, n, h, k0 + key, v0 + value)]
                  : 0.0f;
  });
  if (!LOCAL) {
    // Fold the earlier segments of the walk in.
    for (int64_t s = 0; s < m; ++s) {
      const int64_t at = local_index + (s - m) * p.H * (2 * tiles);
      const float* L = ws.segment_states + at * kTile * kScanValues;
      if (tid < kTile) sh.decay[tid] = detail::fast_exp2(ws.segment_decay[at * kTile + tid]);
      __syncthreads();
      detail::decay_state<kTile>(S, sh.decay, lane);
      detail::for_each_state_entry<kTile>(vrow, lane, [&](int j, int e, int value, int key) {
        S[j][e] += L[key * kScanValues + value];
      });
      __syncthreads();
    }
  }
  float total_decay = 0.0f;  // LOCAL: Σ b_last of this thread's key (tid < 64)

  StateElement* out = reverse ? ws.state_grads : ws.states;
  const void* key_src = reverse ? p.q : p.k;
  const int64_t* key_stride = reverse ? p.q_stride : p.k_stride;
  const void* value_src = reverse ? p.do_ : p.v;
  const int64_t* value_stride = reverse ? p.do_stride : p.v_stride;
  const bool store_vector = p.V % 8 == 0;
  // The next chunk's tiles are in flight while this chunk is computed.
  GateTile<kScanThreads> gate;
  Tile16<kScanThreads> keys, values_lo, values_hi;  // values v0.., v0 + 64..
  auto prefetch = [&](int64_t step) {  // the tiles of walk step `step`
    const int64_t c = reverse ? chunks - 1 - step : step;
    const int64_t t0 = seq.bos + c * kChunk;
    const int64_t rows = seq.len - c * kChunk < kChunk ? seq.len - c * kChunk : kChunk;
    load_gate_tile(gate, p, seq.batch, t0, h, rows, k0, p.vector_gate, tid);
    load_tile(keys, key_src, key_stride, seq.batch, t0, h, rows, k0, kv, p.vector_loads, tid);
    load_tile(values_lo, value_src, value_stride, seq.batch, t0, h, rows, v0, vv, p.vector_loads, tid);
    load_tile(values_hi, value_src, value_stride, seq.batch, t0, h, rows, v0 + kTile, vv - kTile, p.vector_loads, tid);
  };
  if (step0 < step1) prefetch(step0);
  for (int64_t step = step0; step < step1; ++step) {
    const int64_t c = reverse ? chunks - 1 - step : step;
    store_tile(sh.keys, keys, tid);
    store_tile(sh.values, values_lo, tid, kScanLd);
    store_tile(sh.values + kTile, values_hi, tid, kScanLd);
    // The block before this chunk's update, staged as [key][value] bf16.
    if (!LOCAL) {
      detail::for_each_state_entry<kTile>(vrow, lane, [&](int j, int e, int value, int key) {
        sh.stage[key * kScanLd + value] = detail::Elem<__nv_bfloat16>::from_float(S[j][e]);
      });
    }
    gate_cumsum(sh.b, gate, p, &sh.column_part[0][0], tid);  // synchronises: keys, values and the stage are visible after it
    if (step + 1 < step1) prefetch(step + 1);
    StateElement* dst = out + ((first_chunk + c) * p.H + h) * p.K * p.V + k0 * p.V + v0;
#pragma unroll
    for (int i = 0; i < kTile * kScanValues / 8 / kScanThreads; ++i) {
      if (LOCAL) break;
      const int e = tid + i * kScanThreads, r = e / (kScanValues / 8), col = (e % (kScanValues / 8)) * 8;
      if (r >= kv || col >= vv) continue;
      const uint16_t* src = sh.stage + r * kScanLd + col;
      if (store_vector && col + 8 <= vv) {
        *reinterpret_cast<uint4*>(dst + r * p.V + col) = *reinterpret_cast<const uint4*>(src);
      } else {
        for (int j = 0; j < 8 && col + j < vv; ++j) reinterpret_cast<uint16_t*>(dst)[r * p.V + col + j] = src[j];
      }
    }
    for (int e = tid; e < kChunk * kTile; e += kScanThreads) {
      const int t = e >> 6, col = e & 63;
      const float bt = sh.b[t * kTile + col], last = sh.b[(kChunk - 1) * kTile + col];
      const float factor = reverse ? p.scale * detail::fast_exp2(bt) : detail::fast_exp2(last - bt);
      uint16_t& x = sh.keys[t * kLd16 + col];
      x = X::from_float(X::to_float(x) * factor);
    }
    if (tid < kTile) {
      sh.decay[tid] = detail::fast_exp2(sh.b[(kChunk - 1) * kTile + tid]);
      total_decay += sh.b[(kChunk - 1) * kTile + tid];
    }
    __syncthreads();
    if (warp_has_values) {
      uint32_t vf[4][4];
      detail::load_v_fragments(vf, sh.values, kScanLd, vrow, lane);
      detail::state_update<kTile, X>(S, vf, sh.keys, kLd16, sh.decay, lane);
    }
    __syncthreads();
  }
  if (LOCAL) {
    float* L = ws.segment_states + local_index * kTile * kScanValues;
    detail::for_each_state_entry<kTile>(vrow, lane, [&](int j, int e, int value, int key) { L[key * kScanValues + value] = S[j][e]; });
    if (tid < kTile) ws.segment_decay[local_index * kTile + tid] = total_decay;
    return;
  }
  if (reverse && p.dh0 != nullptr && m == own_segments - 1) {
    detail::for_each_state_entry<kTile>(vrow, lane, [&](int j, int e, int value, int key) {
      if (key < kv && value < vv) p.dh0[state_at(p.dh0_stride, p.state_v_first, n, h, k0 + key, v0 + value)] = S[j][e];
    });
  }
}

}  // namespace gla::cuda::backward
