// dq, dk and dg of one (chunk, head, key tile) (SPEC.md §2 B3-B5).
//
// With b the chunk-local cumulative gate (log2 units), e_j = 16j + 15 the last row of sub-chunk j
// and every exponent below <= 0 (SPEC §3.2):
//   dA      = scale · do vᵀ                                         (over all value tiles)
//   dq_t    = scale 2^{b_t} ⊙ (S_c do_t)                              inter
//           + 2^{b_t - b_{e_{i-1}}} ⊙ Σ_{j<i} dA_ij (k_j ⊙ 2^{b_{e_{i-1}} - b_s})   query block i, off-diagonal
//           + Σ_{s<=t, same block} dA[t,s] k_s ⊙ 2^{b_t - b_s}        diagonal block
//   dk_s    = 2^{b_last - b_s} ⊙ (dS_{c+1} v_s)                       inter (dS_{c+1}: see next_gate)
//           + 2^{b_{e_j} - b_s} ⊙ Σ_{i>j} dA_ijᵀ (q_i ⊙ 2^{b_t - b_{e_j}})          key block j, off-diagonal
//           + Σ_{t>=s, same block} dA[t,s] q_t ⊙ 2^{b_t - b_s}        diagonal block
//   dg_u    = Σ_{t=u..last} (q_t ⊙ dq_t - k_t ⊙ dk_t) + 2^{b_last} ⊙ rowsum(S_c ⊙ dS_{c+1})
//           + Σ_s k_s ⊙ dk_s^inter
// A per-head gate sums dg over the keys: per key tile into the workspace when K > 64.
//
// Work split: warp w owns rows 16 (w % 4) .. + 15 (sub-chunk i = w % 4) and key columns
// 32 (w / 4) .. + 31 of dq and dk, as mma.sync C fragments that stay in registers from the value
// loop to the stores. The value loop's products are wgmma on sm_90a (value_offset says how), every
// other product an mma.sync m16n8k16 over ldmatrix fragments:
//   value loop   S_c do, dS_{c+1} v and dA (with mma.sync: blocks on or below the diagonal only);
//   off-diagonal the warp's own pivoted copies (keys of blocks j < i for dq, queries of blocks
//                i' > i for dk: 48 rows for every i, so the warps are balanced);
//   diagonal     one pivot (row 7 of the block; bf16 only) where the gate's range inside the block is at most
//                kOnePivotRange: keys times 2^{b_P - b_s}, queries times 2^{b_t - b_P}, dA masked to
//                t >= s, one product each for dq and dk (B8 T4096 H16 D128 fwd+bwd 1.95 -> 1.83 ms,
//                H100). Otherwise pivot levels as in the forward: a pair (t > s) of a 16-row block belongs to the
//                level of the highest bit of t ^ s (H = 8, 4, 2, 1); pivoted at the last row of
//                the first half of its 2H-row group, both factors are <= 1. Per level the warp
//                writes one copy of its 16 rows (keys in first halves, queries in second halves,
//                each times its factor), and dA masked to the level's pairs (stored once per
//                level with dA; loaded row-major for dq, transposed for dk) multiplies it; the
//                outputs take the same factor back.
// With bf16 on sm_90a the intra-chunk part takes one pivot for the whole chunk instead, where the
// tile's gate range allows (kChunkPivotRange below): two wgmma products of the masked dA with one
// pivoted copy each of the keys and the queries replace the warps' off-diagonal copies, products and
// diagonal; the blocks and levels above serve fp16, sm_80 and stronger decays.
// An element-wise 16 x 16 diagonal (136 pairs per column, an exponent each) was ~1/5 of the
// instructions of a kernel that took 1.78 ms at B8 T4096 H16 D128, against 1.03 ms for this one.
#pragma once

#include <type_traits>

#include "backends/cuda/chunk_backward_common.cuh"
#include "backends/cuda/chunk_layout.hpp"
#include "backends/cuda/mbarrier.cuh"
#include "backends/cuda/tensor_copy.cuh"
#include "backends/cuda/wgmma.cuh"

namespace gla::cuda::backward {

// 8 warps, two CTAs per SM (<= 128 registers each): one CTA's loads and shared-memory passes
// overlap the other's.
constexpr int kGradThreads = 256;
constexpr int kGradWarps = kGradThreads / 32;
constexpr int kRowGroups = kGradThreads / kTile;  // a thread per (column, group of rows) in the column sums
constexpr int kGroupRows = kChunk / kRowGroups;
constexpr int kLdGate = 72;    // b pitch (floats): float2 reads at C-fragment positions are conflict-free
constexpr int kLdX = 72;       // pitch of dg's fp32 tile, same reason
constexpr int kLdCopy = 40;    // pitch of a warp's 32-column copies (16-bit): 80 B rows, conflict-free ldmatrix
constexpr int kCopyRows = 48;  // pivoted keys (16 i rows) + pivoted queries (48 - 16 i rows)
constexpr int kDiagonalCopyRows = 64;  // one pivot: keys and queries, each as high and low parts
constexpr int kLdLevel = 24;   // pitch of the level-masked 16 x 16 blocks of dA: 48 B rows, conflict-free ldmatrix
constexpr int kOnePivot = 4;   // level_dA's slot of the whole lower triangle (t >= s)
// The diagonal block takes one pivot (row 7 of the block) when every |b_r - b_pivot| of the warp's
// rows and columns is at most this (log2 units): factors within 2^±24, so the copies and products
// stay far from fp32's and bf16's range for any input whose true terms are in range.
constexpr float kOnePivotRange = 24.0f;

// The whole-chunk pivot (bf16 on sm_90a): the intra-chunk part of dq and dk as two 64 x 64 x 64
// products of dA masked to t >= s with one copy of the keys and of the queries, each pivoted at row
// kChunkPivotRow (dq_t += 2^{b_t - b_P} Σ_s dA[t,s] k_s 2^{b_P - b_s}, dk_s += 2^{b_P - b_s} Σ_t dA[t,s]
// q_t 2^{b_t - b_P}), on wgmma, where every |b_r - b_P| of the tile is at most kChunkPivotRange
// (a CTA-wide vote; else the blocks and levels below). Factors within 2^±64 keep copies, products
// and their fp32 sums inside bf16's and fp32's range (2^±126) for any input whose true terms are in
// range; their relative rounding is the same as the blocks' (high and low bf16 parts of the copies).
// g = logsigmoid(randn) moves b by ~37 over 32 rows, so nearly every tile takes it.
constexpr int kChunkPivotRow = 31;
constexpr float kChunkPivotRange = 64.0f;

// The pivot level of the pair (t, s) of a 16-row block, t > s: the highest bit of t ^ s (H = 2^level,
// pivot at the last row of the first half of its 2H-row group); 4 (none) for t <= s.
__device__ __forceinline__ int pivot_level(int t, int s) { return t > s ? 31 - __clz(t ^ s) : 4; }

// (x0, x1) packed to 16 bits, and what that rounding left in `low`, also packed: high + low keep
// ~16 bits of each value's mantissa (the bf16 copies below are split so).
template <typename X>
__device__ __forceinline__ uint32_t split_pair(float x0, float x1, uint32_t& low) {
  const uint32_t high = X::pack(x0, x1);
  const float2 h = X::to_float2(high);
  low = X::pack(x0 - h.x, x1 - h.y);
  return high;
}

// A diagonal block's two products over a warp's 32 columns: accq = M · (dq_copy rows 0..15) and
// acck = Mᵀ · (dk_copy rows 0..15), M the masked 16 x 16 block of dA (kLdLevel pitch), plus the
// copies' low parts 16 rows below each when SPLIT. The caller wrote the copies before; __syncwarp
// here orders them before the reads.
template <typename X, bool SPLIT>
__device__ __forceinline__ void masked_diagonal_products(float (&accq)[4][4], float (&acck)[4][4], const uint16_t* masked,
                                                         const uint16_t* dq_copy, const uint16_t* dk_copy, int lane) {
  const int mi = lane >> 3;
  const int a_row = (lane & 7) + (mi & 1) * 8, a_col = (mi >> 1) * 8;
  const int b_row = (lane & 7) + (mi >> 1) * 8, b_col = (mi & 1) * 8;
  uint32_t aq[4], ak[4];
  detail::ldsm_x4(aq, masked + a_row * kLdLevel + a_col);
  detail::ldsm_x4_trans(ak, masked + b_row * kLdLevel + b_col);
  __syncwarp();
#pragma unroll
  for (int np = 0; np < 2; ++np) {
    uint32_t bb[4];
    detail::ldsm_x4_trans(bb, dq_copy + a_row * kLdCopy + 16 * np + a_col);
    X::mma_first(accq[2 * np], aq, bb[0], bb[1]);
    X::mma_first(accq[2 * np + 1], aq, bb[2], bb[3]);
    detail::ldsm_x4_trans(bb, dk_copy + a_row * kLdCopy + 16 * np + a_col);
    X::mma_first(acck[2 * np], ak, bb[0], bb[1]);
    X::mma_first(acck[2 * np + 1], ak, bb[2], bb[3]);
    if constexpr (SPLIT) {
      detail::ldsm_x4_trans(bb, dq_copy + (16 + a_row) * kLdCopy + 16 * np + a_col);
      X::mma(accq[2 * np], aq, bb[0], bb[1]);
      X::mma(accq[2 * np + 1], aq, bb[2], bb[3]);
      detail::ldsm_x4_trans(bb, dk_copy + (16 + a_row) * kLdCopy + 16 * np + a_col);
      X::mma(acck[2 * np], ak, bb[0], bb[1]);
      X::mma(acck[2 * np + 1], ak, bb[2], bb[3]);
    }
  }
}

// The value loop's products: on sm_90a by wgmma, both operands read from shared memory in the
// 128-byte-swizzled layout (sw128_off; 8 KB of each tile's 9 KB), each warp group's 64 rows x 32
// columns into the same C fragments as mma.sync's (warp w % 4 of the group holds rows 16 (w % 4)..);
// elsewhere mma.sync over ldmatrix fragments from rows of kLd16. wgmma against mma.sync (H100, ncu
// base clocks): dqk at B8 T4096 H16 D128 1064 -> 1024 us, at B8 T2048 H4 K256 V512 501 -> 471 us.
constexpr bool kValueWgmma = detail::kArchWgmma;
__device__ __forceinline__ int value_offset(int r, int c) {
  if constexpr (kValueWgmma) {
    return detail::sw128_off(r, c);
  } else {
    return r * kLd16 + c;
  }
}

// The value tiles by tensor copies (sm_90a): one thread asks for a tile's four 64 x 64 boxes, an
// mbarrier per buffer counts their bytes, so the 256 threads form no addresses (16 instructions
// per cp.async, 8 cp.async per thread and value tile). Maps encoded by the host
// (chunk_backward.cu): do and v as [B, T, H, V], the chunk states and state gradients as
// [num_chunks · H, K, V]; enabled = 0 where they could not be (the cp.async path then serves).
struct DqkTensorMaps {
  CUtensorMap dO, v, states, state_grads;
  int32_t enabled;
};
constexpr uint32_t kValueTileBytes = 4 * kChunk * kTile * 2;  // do, v, S, dS boxes of one value tile

struct DqkValueTiles {
  alignas(1024) uint16_t dO[kChunk * kLd16];
  alignas(1024) uint16_t v[kChunk * kLd16];
  alignas(1024) uint16_t S[kTile * kLd16];   // [key][value] of S_c
  alignas(1024) uint16_t dS[kTile * kLd16];  // [key][value] of dS_{c+1}
};

// The whole-chunk pivot's operands, in the swizzled layout wgmma reads (A and B K-major).
struct DqkChunkPivotTiles {
  alignas(1024) uint16_t dA[kChunk * kChunk];            // [t][s], masked to t >= s, scale included
  alignas(1024) uint16_t dA_t[kChunk * kChunk];          // [s][t]: the same, transposed
  alignas(1024) uint16_t keys[2][kTile * kChunk];        // [key][s]: k_s 2^{b_P - b_s}, high and low parts
  alignas(1024) uint16_t queries[2][kTile * kChunk];     // [key][t]: q_t 2^{b_t - b_P}, high and low parts
};

struct DqkShared {
  alignas(128) float b[kChunk * kLdGate];
  alignas(128) uint16_t q[kChunk * kLd16];
  alignas(128) uint16_t k[kChunk * kLd16];
  union {
    DqkValueTiles loop[2];  // double buffer: value tile vt + 1 lands while tile vt is multiplied
    struct {
      alignas(128) uint16_t dA[kChunk * kLd16];  // [t][s], scale included; blocks above the diagonal unused
      // per warp: the off-diagonal pivoted copies, then the diagonal's copies
      alignas(128) uint16_t copies[kGradWarps][kDiagonalCopyRows * kLdCopy];
      // dA's diagonal block i masked to the pairs of pivot level l: [i][l][16 x kLdLevel]; l = kOnePivot:
      // every pair t >= s (the diagonal with one pivot).
      alignas(128) uint16_t level_dA[4][5][16 * kLdLevel];
    } after;
    DqkChunkPivotTiles pivot;  // instead of `after` when the whole-chunk pivot serves the tile
    alignas(128) float x[kChunk * kLdX];  // q ⊙ dq - k ⊙ dk, then dg (dA and the copies are done with)
  } u;
  float rowsum[kTile];
  // BackwardPlan::state_grads_by_values: the gate at the next chunk's first token, log2 units, per
  // key (0 for a sequence's last chunk, and without that plan): dS_{c+1} is the stored state times
  // scale 2^{this}.
  float next_gate[kTile];
  float inter_part[4][kTile];  // per sub-chunk: column sums of k ⊙ dk^inter
  float column_part[kRowGroups][kTile];  // per-column partial sums of row groups (gate cumsum, dg)
  alignas(8) uint64_t value_ready[2];    // per value buffer: its tensor copies have landed (phase per use)
};
// Two CTAs per SM on sm_90 (228 KiB of shared memory, 1 KiB reserved per CTA): the design's other
// half of the latency hiding (one CTA's loads and barriers overlap the other's work).
static_assert(sizeof(DqkShared) <= (228 * 1024 - 2 * 1024) / 2, "dqk_kernel must fit two CTAs per SM");

// A 64 x 64 tile of 16-bit elements into shared memory (pitch kLd16, or value_offset's layout with
// VALUES) with load_tile's element mapping (group e = tid + NT i: row e / 8, columns 8 (e % 8) ..):
// by cp.async when rows are 16-byte aligned (the caller waits for its own groups), else through
// registers. Past rows_valid, cols_valid, or with a null base: zeros.
template <int NT, bool VALUES = false>
__device__ __forceinline__ void stage_tile(uint16_t* dst, const void* base, const int64_t* stride, int64_t batch,
                                           int64_t t0, int64_t h, int64_t rows_valid, int64_t c0, int64_t cols_valid,
                                           bool vector, int tid) {
  auto at = [](int r, int c) { return VALUES ? value_offset(r, c) : r * kLd16 + c; };
  if (vector && base != nullptr) {
    static_assert(NT % 8 == 0, "a thread's groups share their columns");
    const int r0 = tid >> 3, c = (tid & 7) * 8;
    const uint16_t* row =
        static_cast<const uint16_t*>(base) + batch * stride[0] + (t0 + r0) * stride[1] + h * stride[2] + c0 + c;
    const int64_t step = int64_t(NT / 8) * stride[1];
#pragma unroll
    for (int i = 0; i < Tile16<NT>::kGroups; ++i, row += step) {
      const int r = r0 + (NT / 8) * i;
      const bool ok = r < rows_valid && c < cols_valid;
      detail::cp_async16(dst + at(r, c), ok ? row : static_cast<const uint16_t*>(base), ok);
    }
  } else {
    Tile16<NT> regs;
    load_tile(regs, base, stride, batch, t0, h, rows_valid, c0, cols_valid, vector, tid);
    store_tile_at(dst, regs, tid, at);
  }
}

// The fp32 pair at (row, column pair) of a pitched tile, and the 16-bit pair as floats.
__device__ __forceinline__ float2 pair_at(const float* tile, int pitch, int row, int col) {
  return *reinterpret_cast<const float2*>(tile + row * pitch + col);
}
template <typename X>
__device__ __forceinline__ float2 pair_at(const uint16_t* tile, int pitch, int row, int col) {
  return X::to_float2(*reinterpret_cast<const uint32_t*>(tile + row * pitch + col));
}

// grid: (num_chunks * key_tiles, H)
template <typename E>
__global__ void __launch_bounds__(kGradThreads, 2) dqk_kernel(BackwardParams p, BackwardPlan plan, Workspace ws,
                                                                  const __grid_constant__ DqkTensorMaps maps) {
  using X = detail::Elem<E>;
  using detail::fast_exp2;
  using detail::ldsm_x4;
  using detail::ldsm_x4_trans;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  DqkShared& sh = *reinterpret_cast<DqkShared*>(smem_raw);
  if constexpr (kValueWgmma) {
    if ((detail::smem_addr(smem_raw) & 1023u) != 0) __trap();  // the swizzled value tiles need 1024-byte alignment
  }
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int blk = warp & 3, row0 = 16 * blk, col0 = 32 * (warp >> 2);
  const int fr = lane >> 2, fc = detail::fc_of(lane), mi = lane >> 3;
  // Key tiles innermost (blockIdx.x = chunk * key_tiles + tile): the tiles of a chunk run side by
  // side, so do and v come from DRAM once and from L2 for the other tiles.
  const int64_t chunk = blockIdx.x / plan.key_tiles, h = blockIdx.y;
  const int key_tile = static_cast<int>(blockIdx.x % plan.key_tiles);
  const int64_t k0 = int64_t(key_tile) * kTile;
  const int64_t kv = p.K - k0 < kTile ? p.K - k0 : kTile;
  const ChunkRef ch = locate_chunk(p, ws.chunk_offsets, chunk);
  const int rows = ch.len;
  // C-fragment entry (n8 tile n, entry e) of this warp: row row0 + fr + 8 (e >> 1), column
  // col0 + 8 n + fc + (e & 1). `hr` below is e >> 1; pairs (e & 1) are handled together.
  auto col_of = [&](int n) { return col0 + 8 * n + fc; };

  // ---- loads: q and k by cp.async, the first two value tiles by tensor copies or cp.async, the gate
  // through registers ----
  const StateElement* S_c = ws.states + (chunk * p.H + h) * p.K * p.V;
  const StateElement* dS_c = ws.state_grads + (chunk * p.H + h) * p.K * p.V;
  const int64_t state_stride[3] = {0, p.V, 0};  // a state block as a tile: rows are keys
  const bool state_vector = p.V % 8 == 0;
  // Tensor copies read past a short chunk's last row only when a batch row ends there (zeros); a
  // packed sequence's last chunk takes the cp.async path (the boxes would read the next sequence).
  const bool tensor_copies = kValueWgmma && maps.enabled != 0 && (rows == kChunk || p.varlen == 0);
  if (tensor_copies && tid == 0) {
    detail::mbar_init(&sh.value_ready[0], 1);
    detail::mbar_init(&sh.value_ready[1], 1);
    detail::mbar_init_fence();
  }
  // ptxas issues the init from warp 0's uniform datapath, which racecheck counts as the whole warp's
  // write: without this, thread 0's first arrive below read as racing with it (a warning per CTA).
  __syncwarp();
  // Value tile vt (do, v and the states' 64 columns) into buffer `buf`: tensor copies completing
  // on value_ready[buf], or one cp.async commit group.
  auto stage_values = [&](int vt, int buf) {
    const int64_t v0 = int64_t(vt) * kTile;
    const int64_t vv = p.V - v0 < kTile ? p.V - v0 : kTile;
    DqkValueTiles& d = sh.u.loop[buf];
    if (tensor_copies) {
      if (tid == 0) {
        // The buffer's generic-proxy writes (fp16 conversions two tiles ago) before the copies'.
        detail::fence_proxy_async_smem();
        void* ready = &sh.value_ready[buf];
        detail::mbar_arrive_expect_bytes(ready, kValueTileBytes);
        const int32_t c0 = static_cast<int32_t>(v0), head = static_cast<int32_t>(h);
        const int32_t t0 = static_cast<int32_t>(ch.t0), batch = static_cast<int32_t>(ch.batch);
        const int32_t block = static_cast<int32_t>(chunk * p.H + h), key = static_cast<int32_t>(k0);
        detail::tensor_copy_4d(d.dO, &maps.dO, c0, head, t0, batch, ready);
        detail::tensor_copy_4d(d.v, &maps.v, c0, head, t0, batch, ready);
        detail::tensor_copy_3d(d.S, &maps.states, c0, key, block, ready);
        detail::tensor_copy_3d(d.dS, &maps.state_grads, c0, key, block, ready);
      }
      return;
    }
    stage_tile<kGradThreads, true>(d.dO, p.do_, p.do_stride, ch.batch, ch.t0, h, rows, v0, vv, p.vector_loads, tid);
    stage_tile<kGradThreads, true>(d.v, p.v, p.v_stride, ch.batch, ch.t0, h, rows, v0, vv, p.vector_loads, tid);
    stage_tile<kGradThreads, true>(d.S, S_c + k0 * p.V, state_stride, 0, 0, 0, kv, v0, vv, state_vector, tid);
    stage_tile<kGradThreads, true>(d.dS, dS_c + k0 * p.V, state_stride, 0, 0, 0, kv, v0, vv, state_vector, tid);
    detail::cp_async_commit();
  };
  {
    // The gate's loads first: their latency passes while the copies are issued.
    GateTile<kGradThreads> gate;
    load_gate_tile(gate, p, ch.batch, ch.t0, h, rows, k0, p.vector_gate, tid);
    stage_tile<kGradThreads>(sh.q, p.q, p.q_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
    stage_tile<kGradThreads>(sh.k, p.k, p.k_stride, ch.batch, ch.t0, h, rows, k0, kv, p.vector_loads, tid);
    detail::cp_async_commit();
    if (plan.value_tiles > 0) stage_values(0, 0);
    if (plan.value_tiles > 1) stage_values(1, 1);
    if (tid < kTile) {
      float x = 0.0f;
      const Span seq = sequence(p, ch.n);
      if (plan.state_grads_by_values && tid < kv && (ch.index_in_sequence + 1) * kChunk < seq.len) {
        const int64_t at = ch.batch * p.g_stride[0] + (ch.t0 + kChunk) * p.g_stride[1] + h * p.g_stride[2] +
                           (p.gate_per_head ? 0 : k0 + tid);
        x = fmaxf(detail::load_any(p.g, at, p.gate_dtype) * kLog2e, kGateFloor);
      }
      sh.next_gate[tid] = x;
    }
    gate_cumsum<kGradThreads, kLdGate>(sh.b, gate, p, &sh.column_part[0][0], tid);  // synchronises
  }
  const float state_grad_scale = plan.state_grads_by_values ? p.scale : 1.0f;
  // The whole-chunk pivot's range test, thread (column, 16 rows); voted at the value loop's first
  // barrier (false for a NaN gate).
  constexpr bool kChunkPivotPath = kValueWgmma && std::is_same_v<E, __nv_bfloat16>;
  bool pivot_in_range = false, chunk_pivot = false;
  if constexpr (kChunkPivotPath) {
    const int c = tid & 63, r0 = 16 * (tid >> 6);
    const float pivot = sh.b[kChunkPivotRow * kLdGate + c];
    pivot_in_range = true;
#pragma unroll
    for (int r = 0; r < 16; ++r) pivot_in_range &= fabsf(sh.b[(r0 + r) * kLdGate + c] - pivot) <= kChunkPivotRange;
  }
  auto barrier_and_vote = [&]() {
    if constexpr (kChunkPivotPath) {
      // Through a full-warp shuffle: ptxas then knows the branch around the pivot's wgmma is
      // warp-uniform (from the barrier's result it serialised every wgmma of the kernel, C7520).
      chunk_pivot = __shfl_sync(0xffffffffu, __syncthreads_and(pivot_in_range), 0) != 0;
    } else {
      __syncthreads();
    }
  };

  // ---- over the value tiles: Pq = do S_cᵀ (into dq), Pk = v dS_{c+1}ᵀ (into dk), dA = do vᵀ,
  // rowsum(S_c ⊙ dS_{c+1}) ----
  float dq[4][4], dk[4][4], da[4][4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = dk[n][e] = da[n][e] = 0.0f;
  }
  // rowsum(S_c ⊙ dS_{c+1}) partials: group i of this thread covers row (tid + kGradThreads i) / 8.
  constexpr int kStateGroups = Tile16<kGradThreads>::kGroups;
  float rowsum_part[kStateGroups];
#pragma unroll
  for (int i = 0; i < kStateGroups; ++i) rowsum_part[i] = 0.0f;
  const int a_row = (lane & 7) + (mi & 1) * 8, a_col = (mi >> 1) * 8;  // ldmatrix x4 of an A fragment
  const int b_row = (lane & 7) + (mi >> 1) * 8, b_col = (mi & 1) * 8;  // of two B n8 tiles, [n][k] storage
  for (int vt = 0; vt < plan.value_tiles; ++vt) {
    DqkValueTiles& d = sh.u.loop[vt & 1];
    if (tensor_copies) {
      if (vt == 0) detail::cp_async_wait_all();  // q and k
      detail::mbar_wait(&sh.value_ready[vt & 1], (vt >> 1) & 1);
    } else if (vt + 1 < plan.value_tiles) {
      detail::cp_async_wait_one();
    } else {
      detail::cp_async_wait_all();
    }
    // This thread's groups of the states (landed: its own copies, or the buffer's tensor copies):
    // the row sums, and fp16 operands converted in place (the states are bf16).
#pragma unroll
    for (int i = 0; i < kStateGroups; ++i) {
      const int e = tid + i * kGradThreads, r = e >> 3, c = (e & 7) * 8;
      uint4* s_at = reinterpret_cast<uint4*>(d.S + value_offset(r, c));
      uint4* ds_at = reinterpret_cast<uint4*>(d.dS + value_offset(r, c));
      const uint4 sv = *s_at, dv = *ds_at;
      const uint32_t sw[4] = {sv.x, sv.y, sv.z, sv.w};
      const uint32_t dw[4] = {dv.x, dv.y, dv.z, dv.w};
      uint32_t so[4], dso[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 s2 = detail::Elem<StateElement>::to_float2(sw[j]);
        const float2 d2 = detail::Elem<StateElement>::to_float2(dw[j]);
        rowsum_part[i] += s2.x * d2.x + s2.y * d2.y;
        so[j] = X::pack(s2.x, s2.y);
        dso[j] = X::pack(d2.x, d2.y);
      }
      if constexpr (!std::is_same_v<E, StateElement>) {
        *s_at = make_uint4(so[0], so[1], so[2], so[3]);
        *ds_at = make_uint4(dso[0], dso[1], dso[2], dso[3]);
      }
    }
    if constexpr (kValueWgmma) detail::fence_proxy_async_smem();  // this thread's copies and conversions before wgmma's reads
    if (vt == 0) {
      barrier_and_vote();
    } else {
      __syncthreads();
    }
    if constexpr (kValueWgmma) {
      // Each warp group: its 32 columns (keys for dq and dk, rows s of v for dA) of the three
      // products, four k-steps of 16 values (32 bytes along the swizzled rows) each; dA's blocks
      // above the diagonal come along unused. Descriptors of the k-step 0 operands; k-step kk
      // starts 32 bytes further (2 in the descriptor's 16-byte address units).
      const uint64_t do_desc = detail::wg_desc(detail::smem_addr(d.dO), 16, 1024);
      const uint64_t v_desc = detail::wg_desc(detail::smem_addr(d.v), 16, 1024);
      const uint64_t s_desc = detail::wg_desc(detail::smem_addr(d.S) + col0 * 128, 16, 1024);
      const uint64_t ds_desc = detail::wg_desc(detail::smem_addr(d.dS) + col0 * 128, 16, 1024);
      const uint64_t vs_desc = detail::wg_desc(detail::smem_addr(d.v) + col0 * 128, 16, 1024);
      detail::wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        detail::wgmma_n32_ss<X>(&dq[0][0], do_desc + 2 * kk, s_desc + 2 * kk);
        detail::wgmma_n32_ss<X>(&dk[0][0], v_desc + 2 * kk, ds_desc + 2 * kk);
        detail::wgmma_n32_ss<X>(&da[0][0], do_desc + 2 * kk, vs_desc + 2 * kk);
      }
      detail::wg_commit();
      detail::wg_wait_all();
      detail::wg_pin<16>(&dq[0][0]);
      detail::wg_pin<16>(&dk[0][0]);
      detail::wg_pin<16>(&da[0][0]);
    } else {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        uint32_t a_do[4], a_v[4];
        ldsm_x4(a_do, d.dO + (row0 + a_row) * kLd16 + 16 * kk + a_col);
        ldsm_x4(a_v, d.v + (row0 + a_row) * kLd16 + 16 * kk + a_col);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          const int n_row = col0 + 16 * np + b_row, k_col = 16 * kk + b_col;
          uint32_t bs[4], bds[4];
          ldsm_x4(bs, d.S + n_row * kLd16 + k_col);
          ldsm_x4(bds, d.dS + n_row * kLd16 + k_col);
          X::mma(dq[2 * np], a_do, bs[0], bs[1]);
          X::mma(dq[2 * np + 1], a_do, bs[2], bs[3]);
          X::mma(dk[2 * np], a_v, bds[0], bds[1]);
          X::mma(dk[2 * np + 1], a_v, bds[2], bds[3]);
          if (2 * (warp >> 2) + np <= blk) {  // dA block (blk, column block) on or below the diagonal
            uint32_t bv[4];
            ldsm_x4(bv, d.v + n_row * kLd16 + k_col);
            X::mma(da[2 * np], a_do, bv[0], bv[1]);
            X::mma(da[2 * np + 1], a_do, bv[2], bv[3]);
          }
        }
      }
    }
    __syncthreads();
    if (vt + 2 < plan.value_tiles) stage_values(vt + 2, vt & 1);
  }
  if (plan.value_tiles == 0) {
    detail::cp_async_wait_all();
    barrier_and_vote();
  }
  // rowsum: the 8 consecutive lanes sharing a row reduce by shuffles.
#pragma unroll
  for (int i = 0; i < kStateGroups; ++i) {
    float x = rowsum_part[i];
    for (int off = 4; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    const int row = (tid + i * kGradThreads) >> 3;
    if ((lane & 7) == 0) sh.rowsum[row] = x * (state_grad_scale * fast_exp2(sh.next_gate[row]));
  }

  // ---- inter-chunk factors on the fragments; dA in 16 bits; Σ_s k_s ⊙ dk_s^inter per column ----
  // This lane's q and k at its fragment positions, read from shared memory where they are used
  // (held in registers from here to dg, ptxas spilled them), and its b, kept.
  auto pair16 = [&](const uint16_t* tile, int n, int hr) {
    return *reinterpret_cast<const uint32_t*>(tile + (row0 + fr + 8 * hr) * kLd16 + col_of(n));
  };
  auto q_pair = [&](int n, int hr) { return pair16(sh.q, n, hr); };
  auto k_pair = [&](int n, int hr) { return pair16(sh.k, n, hr); };
  float2 b_frag[4][2];
  {
    float inter[4][2];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int c = col_of(n);
      const float2 last = pair_at(sh.b, kLdGate, kChunk - 1, c);
      const float2 next = *reinterpret_cast<const float2*>(sh.next_gate + c);
      inter[n][0] = inter[n][1] = 0.0f;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = row0 + fr + 8 * hr;
        const float2 bt = pair_at(sh.b, kLdGate, t, c);
        b_frag[n][hr] = bt;
        dq[n][2 * hr] *= p.scale * fast_exp2(bt.x);
        dq[n][2 * hr + 1] *= p.scale * fast_exp2(bt.y);
        dk[n][2 * hr] *= state_grad_scale * fast_exp2(last.x - bt.x + next.x);
        dk[n][2 * hr + 1] *= state_grad_scale * fast_exp2(last.y - bt.y + next.y);
        const float2 kt = X::to_float2(k_pair(n, hr));
        inter[n][0] += kt.x * dk[n][2 * hr];
        inter[n][1] += kt.y * dk[n][2 * hr + 1];
      }
    }
    // The blocks' and levels' dA (the whole-chunk pivot stores its own below), in a loop of its own:
    // inside the one above it raised the common path's register pressure (spills).
    if (!chunk_pivot) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int c = col_of(n);
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int t = row0 + fr + 8 * hr;
          if (2 * (warp >> 2) + n / 2 > blk) continue;
          const float d0 = p.scale * da[n][2 * hr], d1 = p.scale * da[n][2 * hr + 1];
          *reinterpret_cast<uint32_t*>(sh.u.after.dA + t * kLd16 + c) = X::pack(d0, d1);
          if (2 * (warp >> 2) + n / 2 == blk) {  // the diagonal block, once per level
            const int tl = fr + 8 * hr, sl = 8 * (n & 1) + fc;
            const int l0 = pivot_level(tl, sl), l1 = pivot_level(tl, sl + 1);
#pragma unroll
            for (int level = 0; level < 4; ++level) {
              *reinterpret_cast<uint32_t*>(sh.u.after.level_dA[blk][level] + tl * kLdLevel + sl) =
                  X::pack(l0 == level ? d0 : 0.0f, l1 == level ? d1 : 0.0f);
            }
            *reinterpret_cast<uint32_t*>(sh.u.after.level_dA[blk][kOnePivot] + tl * kLdLevel + sl) =
                X::pack(tl >= sl ? d0 : 0.0f, tl >= sl + 1 ? d1 : 0.0f);
          }
        }
      }
    }
    // The 8 lanes sharing columns (lane % 4) reduce over their rows by a butterfly (fixed order).
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float x = inter[n][j];
        x += __shfl_xor_sync(0xffffffffu, x, 4);
        x += __shfl_xor_sync(0xffffffffu, x, 8);
        x += __shfl_xor_sync(0xffffffffu, x, 16);
        if (fr == 0) sh.inter_part[blk][col_of(n) + j] = x;
      }
    }
  }
  if constexpr (kChunkPivotPath) {
    if (chunk_pivot) {
      DqkChunkPivotTiles& piv = sh.u.pivot;
      // dA masked to t >= s (scale included) from the fragments: [t][s] by stmatrix, [s][t] by
      // stmatrix .trans (matrix m of an instruction: n8 tile 2 np + m / 2, rows 8 (m % 2) ..).
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t w[4];
#pragma unroll
        for (int m = 0; m < 4; ++m) {
          const int n = 2 * np + (m >> 1), hr = m & 1;
          const int t = row0 + fr + 8 * hr, s = col_of(n);
          w[m] = X::pack(t >= s ? p.scale * da[n][2 * hr] : 0.0f, t >= s + 1 ? p.scale * da[n][2 * hr + 1] : 0.0f);
        }
        const int m = lane >> 3, c = col0 + 8 * (2 * np + (m >> 1)), r = row0 + 8 * (m & 1);
        detail::stsm_x4(piv.dA + detail::sw128_off(r + (lane & 7), c), w[0], w[1], w[2], w[3]);
        detail::stsm_x4_trans(piv.dA_t + detail::sw128_off(c + (lane & 7), r), w[0], w[1], w[2], w[3]);
      }
      // The pivoted copies, thread (key, 16 rows), 8 rows per 16-byte store: keys k_s 2^{b_P - b_s},
      // queries q_t 2^{b_t - b_P}, each as a high and a low bf16 part.
      const int key = tid & 63;
      const float pivot = sh.b[kChunkPivotRow * kLdGate + key];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r0 = 16 * (tid >> 6) + 8 * half;
        uint32_t kh[4], kl[4], qh[4], ql[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float kx[2], qx[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int r = r0 + 2 * j + e;
            const float d = sh.b[r * kLdGate + key] - pivot;
            kx[e] = X::to_float(sh.k[r * kLd16 + key]) * fast_exp2(-d);
            qx[e] = X::to_float(sh.q[r * kLd16 + key]) * fast_exp2(d);
          }
          kh[j] = split_pair<X>(kx[0], kx[1], kl[j]);
          qh[j] = split_pair<X>(qx[0], qx[1], ql[j]);
        }
        const int at = detail::sw128_off(key, r0);
        *reinterpret_cast<uint4*>(piv.keys[0] + at) = make_uint4(kh[0], kh[1], kh[2], kh[3]);
        *reinterpret_cast<uint4*>(piv.keys[1] + at) = make_uint4(kl[0], kl[1], kl[2], kl[3]);
        *reinterpret_cast<uint4*>(piv.queries[0] + at) = make_uint4(qh[0], qh[1], qh[2], qh[3]);
        *reinterpret_cast<uint4*>(piv.queries[1] + at) = make_uint4(ql[0], ql[1], ql[2], ql[3]);
      }
      detail::fence_proxy_async_smem();  // before wgmma's reads
    }
  }
  __syncthreads();  // dA complete; the value tiles are dead, the union holds the warps' copies (or the pivot's tiles)

  uint16_t* copy = sh.u.after.copies[warp];  // this warp's copies, then its staging of dq and dk
  if (chunk_pivot) {
    // The whole-chunk pivot: each warp group its 32 key columns of (masked dA) (pivoted keys) and
    // (masked dA)ᵀ (pivoted queries), high and low parts, four k-steps of 16 rows each.
    DqkChunkPivotTiles& piv = sh.u.pivot;
    float acc[4][4];
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
      for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      const uint64_t a_desc = detail::wg_desc(detail::smem_addr(pass == 0 ? piv.dA : piv.dA_t), 16, 1024);
      const uint16_t(&copies)[2][kTile * kChunk] = pass == 0 ? piv.keys : piv.queries;
      const uint64_t high_desc = detail::wg_desc(detail::smem_addr(copies[0]) + col0 * 128, 16, 1024);
      const uint64_t low_desc = detail::wg_desc(detail::smem_addr(copies[1]) + col0 * 128, 16, 1024);
      detail::wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        detail::wgmma_n32_ss<X>(&acc[0][0], a_desc + 2 * kk, high_desc + 2 * kk);
        detail::wgmma_n32_ss<X>(&acc[0][0], a_desc + 2 * kk, low_desc + 2 * kk);
      }
      detail::wg_commit();
      detail::wg_wait_all();
      detail::wg_pin<16>(&acc[0][0]);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float2 pivot = pair_at(sh.b, kLdGate, kChunkPivotRow, col_of(n));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float2 d = make_float2(b_frag[n][hr].x - pivot.x, b_frag[n][hr].y - pivot.y);
          if (pass == 0) {
            dq[n][2 * hr] += acc[n][2 * hr] * fast_exp2(d.x);
            dq[n][2 * hr + 1] += acc[n][2 * hr + 1] * fast_exp2(d.y);
          } else {
            dk[n][2 * hr] += acc[n][2 * hr] * fast_exp2(-d.x);
            dk[n][2 * hr + 1] += acc[n][2 * hr + 1] * fast_exp2(-d.y);
          }
        }
      }
    }
    __syncthreads();  // every warp group's reads of the tiles are done: `copy` overlaps them
  } else {
    uint32_t q_frag[4][2], k_frag[4][2];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        q_frag[n][hr] = q_pair(n, hr);
        k_frag[n][hr] = k_pair(n, hr);
      }
    }
    // ---- off-diagonal blocks: the warp's pivoted keys (rows s < 16 blk, pivot e_{blk-1}) and queries
    // (rows t >= 16 (blk + 1), pivot e_blk; stack row t - 16) over its 32 columns ----
    {
      const int pc = col0 + 2 * (lane & 15);  // this lane's column pair
      const float2 pivot_k = blk > 0 ? pair_at(sh.b, kLdGate, row0 - 1, pc) : make_float2(0.0f, 0.0f);
      const float2 pivot_q = pair_at(sh.b, kLdGate, row0 + 15, pc);
      const int half_row = lane >> 4, cw = 2 * (lane & 15);  // two rows per pass, 16 column pairs
#pragma unroll 4
      for (int r = half_row; r < row0; r += 2) {
        const float2 bs = pair_at(sh.b, kLdGate, r, pc);
        const float2 ks = pair_at<X>(sh.k, kLd16, r, pc);
        *reinterpret_cast<uint32_t*>(copy + r * kLdCopy + cw) =
            X::pack(ks.x * fast_exp2(pivot_k.x - bs.x), ks.y * fast_exp2(pivot_k.y - bs.y));
      }
#pragma unroll 4
      for (int r = row0 + half_row; r < kCopyRows; r += 2) {
        const float2 bt = pair_at(sh.b, kLdGate, r + 16, pc);
        const float2 qt = pair_at<X>(sh.q, kLd16, r + 16, pc);
        *reinterpret_cast<uint32_t*>(copy + r * kLdCopy + cw) =
            X::pack(qt.x * fast_exp2(bt.x - pivot_q.x), qt.y * fast_exp2(bt.y - pivot_q.y));
      }
    }
    __syncwarp();
    {
      // dq of query block blk: Σ_{j<blk} dA_{blk,j} (pivoted keys of block j).
      float acc[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      for (int j = 0; j < blk; ++j) {
        uint32_t a[4];
        ldsm_x4(a, sh.u.after.dA + (row0 + a_row) * kLd16 + 16 * j + a_col);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          ldsm_x4_trans(bb, copy + (16 * j + a_row) * kLdCopy + 16 * np + a_col);
          X::mma(acc[2 * np], a, bb[0], bb[1]);
          X::mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
      if (blk > 0) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float2 pivot = pair_at(sh.b, kLdGate, row0 - 1, col_of(n));
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            dq[n][2 * hr] += acc[n][2 * hr] * fast_exp2(b_frag[n][hr].x - pivot.x);
            dq[n][2 * hr + 1] += acc[n][2 * hr + 1] * fast_exp2(b_frag[n][hr].y - pivot.y);
          }
        }
      }
      // dk of key block blk: Σ_{i>blk} dA_{i,blk}ᵀ (pivoted queries of block i).
#pragma unroll
      for (int n = 0; n < 4; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
      for (int i = blk + 1; i < 4; ++i) {
        uint32_t a[4];
        ldsm_x4_trans(a, sh.u.after.dA + (16 * i + b_row) * kLd16 + row0 + b_col);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          ldsm_x4_trans(bb, copy + (16 * i - 16 + a_row) * kLdCopy + 16 * np + a_col);
          X::mma(acc[2 * np], a, bb[0], bb[1]);
          X::mma(acc[2 * np + 1], a, bb[2], bb[3]);
        }
      }
      if (blk < 3) {
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float2 pivot = pair_at(sh.b, kLdGate, row0 + 15, col_of(n));
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            dk[n][2 * hr] += acc[n][2 * hr] * fast_exp2(pivot.x - b_frag[n][hr].x);
            dk[n][2 * hr + 1] += acc[n][2 * hr + 1] * fast_exp2(pivot.y - b_frag[n][hr].y);
          }
        }
      }
    }
    __syncwarp();  // the pivoted copies are read: the level copies reuse the buffer

    // ---- diagonal block: one pivot where the gate's range allows it, else pivot levels ----
    // bf16 copies are split into a high and a low part, both multiplied: one bf16 rounding of the
    // copies put dg's error at 5-8e-3 against the reference on the SPEC grid (bar 5e-3), where the
    // element-wise diagonal it replaced was fp32. fp16's rounding is 8x finer and passes with one part.
    constexpr bool kSplitCopies = std::is_same_v<E, __nv_bfloat16>;
    // One pivot P = row 7 of the block: dq_t += 2^{b_t - b_P} Σ_{s<=t} dA[t,s] (k_s 2^{b_P - b_s}) and
    // dk_s += 2^{b_P - b_s} Σ_{t>=s} dA[t,s] (q_t 2^{b_t - b_P}), one masked product each instead of
    // four levels and the t = s pass. The factors exceed 1 on one side of P, so this needs the
    // block's gate range bounded (kOnePivotRange: g = logsigmoid(randn) stays well inside it, strong
    // decays take the levels). A warp-uniform choice from this warp's rows and columns; reruns are
    // bitwise (it depends on the inputs only).
    bool one_pivot;
    {
      float range = 0.0f;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float2 pv = pair_at(sh.b, kLdGate, row0 + 7, col_of(n));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          range = fmaxf(range, fmaxf(fabsf(b_frag[n][hr].x - pv.x), fabsf(b_frag[n][hr].y - pv.y)));
        }
      }
      // bf16 only: fp16's range (normal from 2^-14, at most 65504) cannot hold factors up to
      // 2^±24 (moderate decays overflowed the copies to inf); fp16 takes the levels (factors <= 1).
      // fmaxf drops NaN, so a NaN gate may take this form: its outputs are NaN in either form.
      one_pivot = kSplitCopies && __all_sync(0xffffffffu, range <= kOnePivotRange);
    }
    if (one_pivot) {
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const float2 pv = pair_at(sh.b, kLdGate, row0 + 7, col_of(n));
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          b_frag[n][hr] = make_float2(b_frag[n][hr].x - pv.x, b_frag[n][hr].y - pv.y);  // b_r - b_P from here on
        }
      }
      // Rows 0-15: keys times 2^{b_P - b_s}, 32-47: queries times 2^{b_t - b_P}; the low parts 16 rows
      // below each (this form is bf16 only, so always split).
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = fr + 8 * hr;
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float2 d = b_frag[n][hr];
          const float2 kt = X::to_float2(k_frag[n][hr]), qt = X::to_float2(q_frag[n][hr]);
          const float k0 = kt.x * fast_exp2(-d.x), k1 = kt.y * fast_exp2(-d.y);
          const float q0 = qt.x * fast_exp2(d.x), q1 = qt.y * fast_exp2(d.y);
          uint32_t kl, ql;
          *reinterpret_cast<uint32_t*>(copy + r * kLdCopy + 8 * n + fc) = split_pair<X>(k0, k1, kl);
          *reinterpret_cast<uint32_t*>(copy + (32 + r) * kLdCopy + 8 * n + fc) = split_pair<X>(q0, q1, ql);
          *reinterpret_cast<uint32_t*>(copy + (16 + r) * kLdCopy + 8 * n + fc) = kl;
          *reinterpret_cast<uint32_t*>(copy + (48 + r) * kLdCopy + 8 * n + fc) = ql;
        }
      }
      float accq[4][4], acck[4][4];
      masked_diagonal_products<X, true>(accq, acck, sh.u.after.level_dA[blk][kOnePivot], copy, copy + 32 * kLdCopy, lane);
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const float2 d = b_frag[n][hr];
          dq[n][2 * hr] += fast_exp2(d.x) * accq[n][2 * hr];
          dq[n][2 * hr + 1] += fast_exp2(d.y) * accq[n][2 * hr + 1];
          dk[n][2 * hr] += fast_exp2(-d.x) * acck[n][2 * hr];
          dk[n][2 * hr + 1] += fast_exp2(-d.y) * acck[n][2 * hr + 1];
        }
      }
    } else {
#pragma unroll 1
      for (int level = 3; level >= 0; --level) {  // H = 2^level
        const int H = 1 << level;
        // This lane's rows of the level copy: row r's group starts at (r / 2H) 2H, its pivot is the
        // group's row H - 1; keys (first half) times 2^{b_pivot - b_r}, queries times 2^{b_r - b_pivot}.
        float2 f[4][2];
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          const int r = fr + 8 * hr;
          const int pivot_row = row0 + (r & ~(2 * H - 1)) + H - 1;
          const bool key_half = (r & H) == 0;
          const float sign = key_half ? 1.0f : -1.0f;  // one exponent per entry, not both and a select
#pragma unroll
          for (int n = 0; n < 4; ++n) {
            const float2 pv = pair_at(sh.b, kLdGate, pivot_row, col_of(n));
            const float2 br = b_frag[n][hr];
            f[n][hr] = make_float2(fast_exp2(sign * (pv.x - br.x)), fast_exp2(sign * (pv.y - br.y)));
            const float2 m = X::to_float2(key_half ? k_frag[n][hr] : q_frag[n][hr]);
            const float x0 = m.x * f[n][hr].x, x1 = m.y * f[n][hr].y;
            if constexpr (kSplitCopies) {
              uint32_t low;
              *reinterpret_cast<uint32_t*>(copy + r * kLdCopy + 8 * n + fc) = split_pair<X>(x0, x1, low);
              *reinterpret_cast<uint32_t*>(copy + (16 + r) * kLdCopy + 8 * n + fc) = low;
            } else {
              *reinterpret_cast<uint32_t*>(copy + r * kLdCopy + 8 * n + fc) = X::pack(x0, x1);
            }
          }
        }
        // dA_{blk,blk} masked to the level's pairs (rows t, columns s) for dq, and its transpose for dk.
        float accq[4][4], acck[4][4];
        masked_diagonal_products<X, kSplitCopies>(accq, acck, sh.u.after.level_dA[blk][level], copy, copy, lane);
        // Rows outside the level's second (dq) or first (dk) halves got 0 from the masked dA.
#pragma unroll
        for (int n = 0; n < 4; ++n) {
#pragma unroll
          for (int hr = 0; hr < 2; ++hr) {
            dq[n][2 * hr] += f[n][hr].x * accq[n][2 * hr];
            dq[n][2 * hr + 1] += f[n][hr].y * accq[n][2 * hr + 1];
            dk[n][2 * hr] += f[n][hr].x * acck[n][2 * hr];
            dk[n][2 * hr + 1] += f[n][hr].y * acck[n][2 * hr + 1];
          }
        }
        __syncwarp();  // the copy is read before the next level overwrites it
      }
      // t = s: dq_t += dA[t,t] k_t, dk_t += dA[t,t] q_t.
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int t = row0 + fr + 8 * hr;
        const float d = X::to_float(sh.u.after.dA[t * kLd16 + t]);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
          const float2 kt = X::to_float2(k_frag[n][hr]), qt = X::to_float2(q_frag[n][hr]);
          dq[n][2 * hr] += d * kt.x;
          dq[n][2 * hr + 1] += d * kt.y;
          dk[n][2 * hr] += d * qt.x;
          dk[n][2 * hr + 1] += d * qt.y;
        }
      }
    }
  }

  // ---- dq and dk out ----
  if (p.vector_dqk) {
    // Through the warp's copy buffer (its products are done): rows 0-15 dq, 16-31 dk as 16 x 32
    // tiles, then 16-byte stores, each output row's 64 bytes by four lanes of one instruction.
    // From the fragments, 32-bit stores fill half of each 32-byte sector per instruction.
    __syncwarp();  // every lane's reads of the copies are done
#pragma unroll
    for (int out = 0; out < 2; ++out) {
      const float(&frag)[4][4] = out == 0 ? dq : dk;
      uint16_t* tile = copy + 16 * out * kLdCopy;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // stmatrix: matrix m of an instruction is the 8 x 8 fragment (n = 2 np + m / 2, rows 8 (m % 2) ..)
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        const int m = lane >> 3, n = 2 * np + (m >> 1);
        detail::stsm_x4(tile + (8 * (m & 1) + (lane & 7)) * kLdCopy + 8 * n, X::pack(frag[2 * np][0], frag[2 * np][1]),
                        X::pack(frag[2 * np][2], frag[2 * np][3]), X::pack(frag[2 * np + 1][0], frag[2 * np + 1][1]),
                        X::pack(frag[2 * np + 1][2], frag[2 * np + 1][3]));
      }
#else
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          *reinterpret_cast<uint32_t*>(tile + (fr + 8 * hr) * kLdCopy + 8 * n + fc) =
              X::pack(frag[n][2 * hr], frag[n][2 * hr + 1]);
        }
      }
#endif
    }
    __syncwarp();
#pragma unroll
    for (int out = 0; out < 2; ++out) {
      void* base = out == 0 ? p.dq : p.dk;
      if (base == nullptr) continue;
      const int64_t* stride = out == 0 ? p.dq_stride : p.dk_stride;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int piece = 32 * i + lane, r = piece >> 2, c = col0 + 8 * (piece & 3);
        if (row0 + r < rows && c < kv) {
          uint16_t* dst = static_cast<uint16_t*>(base) + ch.batch * stride[0] + (ch.t0 + row0 + r) * stride[1] +
                          h * stride[2] + k0 + c;
          *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(copy + (16 * out + r) * kLdCopy + c - col0);
        }
      }
    }
  } else {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int t = row0 + fr + 8 * hr;
      if (t >= rows) continue;
      const int64_t tok = ch.t0 + t;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int c = col_of(n);
        if (c >= kv) continue;
        const bool second = c + 1 < kv;
        if (p.dq != nullptr) {
          uint16_t* out = static_cast<uint16_t*>(p.dq) + ch.batch * p.dq_stride[0] + tok * p.dq_stride[1] +
                          h * p.dq_stride[2] + k0 + c;
          out[0] = X::from_float(dq[n][2 * hr]);
          if (second) out[1] = X::from_float(dq[n][2 * hr + 1]);
        }
        if (p.dk != nullptr) {
          uint16_t* out = static_cast<uint16_t*>(p.dk) + ch.batch * p.dk_stride[0] + tok * p.dk_stride[1] +
                          h * p.dk_stride[2] + k0 + c;
          out[0] = X::from_float(dk[n][2 * hr]);
          if (second) out[1] = X::from_float(dk[n][2 * hr + 1]);
        }
      }
    }
  }
  if (p.dg == nullptr) return;

  // ---- dg: reverse cumsum of x = q ⊙ dq - k ⊙ dk plus the chunk-end terms ----
  __syncthreads();  // every warp's level copies are read: the union becomes x
#pragma unroll
  for (int n = 0; n < 4; ++n) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const float2 qt = X::to_float2(q_pair(n, hr)), kt = X::to_float2(k_pair(n, hr));
      const int t = row0 + fr + 8 * hr;
      *reinterpret_cast<float2*>(sh.u.x + t * kLdX + col_of(n)) =
          make_float2(qt.x * dq[n][2 * hr] - kt.x * dk[n][2 * hr], qt.y * dq[n][2 * hr + 1] - kt.y * dk[n][2 * hr + 1]);
    }
  }
  __syncthreads();
  // Thread (column c, row group of kGroupRows rows): the group's sum, then the suffix of the later
  // groups and the chunk-end terms, then its own rows in reverse (a fixed order: reruns are bitwise).
  {
    const int c = tid & 63, group = tid >> 6, t0 = kGroupRows * group;
    const int last_row = static_cast<int>(rows) - 1;
    float x[kGroupRows];
    float part = 0.0f;
#pragma unroll
    for (int r = 0; r < kGroupRows; ++r) {
      x[r] = sh.u.x[(t0 + r) * kLdX + c];
      if (t0 + r <= last_row) part += x[r];
    }
    sh.column_part[group][c] = part;
    __syncthreads();
    const float inter_sum = sh.inter_part[0][c] + sh.inter_part[1][c] + sh.inter_part[2][c] + sh.inter_part[3][c];
    float acc = fast_exp2(sh.b[(kChunk - 1) * kLdGate + c]) * sh.rowsum[c] + inter_sum;
    for (int g = kRowGroups - 1; g > group; --g) acc += sh.column_part[g][c];
#pragma unroll
    for (int r = kGroupRows - 1; r >= 0; --r) {
      const int t = t0 + r;
      if (t <= last_row) {
        acc += x[r];
        sh.u.x[t * kLdX + c] = c < kv ? acc : 0.0f;
      }
    }
  }
  __syncthreads();
  if (p.gate_per_head) {
    if (tid < rows) {
      float total = 0.0f;
      for (int c = 0; c < kTile; ++c) total += sh.u.x[tid * kLdX + c];
      const int64_t token = ch.batch * p.T + ch.t0 + tid;
      if (plan.key_tiles == 1) {
        detail::store_any(p.dg, ch.batch * p.dg_stride[0] + (ch.t0 + tid) * p.dg_stride[1] + h * p.dg_stride[2],
                          p.dg_dtype, total);
      } else {
        ws.gate_partials[(int64_t(key_tile) * p.B * p.T + token) * p.H + h] = total;
      }
    }
  } else {
    // Thread (column c, rows tid / 64 + 4 i), the type chosen once. Its 16 shared reads go first, all
    // in flight together (a loop waited for each in turn), then one row pointer step per store.
    const int c = tid & 63;
    if (c >= kv) return;
    float column[kGroupRows];
#pragma unroll
    for (int i = 0; i < kGroupRows; ++i) column[i] = sh.u.x[((tid >> 6) + kRowGroups * i) * kLdX + c];
    const int64_t step = kRowGroups * p.dg_stride[1];
    const int64_t at = ch.batch * p.dg_stride[0] + (ch.t0 + (tid >> 6)) * p.dg_stride[1] + h * p.dg_stride[2] + k0 + c;
    auto store_rows = [&](auto* out, auto convert) {
      out += at;
#pragma unroll
      for (int i = 0; i < kGroupRows; ++i, out += step) {
        if ((tid >> 6) + kRowGroups * i < rows) *out = convert(column[i]);
      }
    };
    if (p.dg_dtype == kF32) {
      store_rows(static_cast<float*>(p.dg), [](float x) { return x; });
    } else if (p.dg_dtype == kF16) {
      store_rows(static_cast<uint16_t*>(p.dg), [](float x) { return detail::Elem<__half>::from_float(x); });
    } else {
      store_rows(static_cast<uint16_t*>(p.dg), [](float x) { return detail::Elem<__nv_bfloat16>::from_float(x); });
    }
  }
}

}  // namespace gla::cuda::backward
