// Host-side facts about the chunk kernels that the planner needs without compiling device code:
// the chunk length, the segment-split arguments and the forward kernels' shared-memory layouts
// (computed identically on host and device).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define GLA_HD __host__ __device__
#else
#define GLA_HD
#endif

namespace gla::cuda::detail {

constexpr int kChunk = 64;
// Most (sequence, segment) blocks a launch can take in an explicit order (kernel parameter space:
// with ForwardParams the parameters stay under the classic 4 KB).
constexpr int kMaxBlockOrder = 480;

// Chunks per segment of a sequence of `chunks` chunks: a sequence of at most whole_chunks chunks
// is one segment, a longer one splits into segments of segment_chunks (the last one shorter).
GLA_HD inline int64_t sequence_segment_chunks(int64_t segment_chunks, int64_t whole_chunks, int64_t chunks) {
  return chunks <= whole_chunks ? (chunks > 0 ? chunks : 1) : segment_chunks;
}
// Segments of a sequence of `chunks` chunks (an empty sequence has one: it writes its final state).
GLA_HD inline int64_t sequence_segments(int64_t segment_chunks, int64_t whole_chunks, int64_t chunks) {
  const int64_t seg = sequence_segment_chunks(segment_chunks, whole_chunks, chunks);
  return chunks == 0 ? 1 : (chunks + seg - 1) / seg;
}

struct SegmentArgs {
  int64_t segment_chunks;  // chunks per segment of the sequences that split
  int64_t whole_chunks;    // sequences of at most this many chunks do not split (0: all split)
  int64_t max_segments;
  int32_t value_tiles;
  int32_t pass;            // 1: local states only; 2: full forward
  float* seg_states;       // [N, max_segments, H, value_tiles * BV, DK]
  float* seg_decay;        // [N, max_segments, H, DK] total log2 decay of each segment
  // Launch order of the warp-specialised kernel's full pass (0: natural). With an order the grid
  // is (H * value_tiles, order_count): block (x, y) runs block n * max_segments + m = order[y] of
  // head tile x, so the longest blocks start first (heads innermost).
  int32_t order_count;
  int32_t order[kMaxBlockOrder];
};

// Shared-memory layout (bytes), computed identically on host and device.
struct ChunkSmem {
  int pq, pv, pa, pg;  // pitches in elements
  int q, k, v, g;      // offsets inside one stage
  int stage_bytes;
  int qw, kw, a, tot, dfac, dsum;  // offsets after the two stages
  int extra0, extra1, dpart;       // level copies 2/3 where they need their own buffer, diagonal partials
  int total;
};
GLA_HD inline ChunkSmem chunk_smem_layout(int dk, int bv, int gate_bytes, bool per_head) {
  ChunkSmem s{};
  s.pq = dk + 8;
  s.pv = bv + 8;
  s.pa = kChunk + 8;
  s.pg = dk + 8;
  s.q = 0;
  s.k = s.q + kChunk * s.pq * 2;
  s.v = s.k + kChunk * s.pq * 2;
  s.g = s.v + kChunk * s.pv * 2;
  // Per-head gate: 64 raw gates, then 64 fp32 e values.
  int gbytes = per_head ? kChunk * 4 * 2 : kChunk * s.pg * gate_bytes;
  s.stage_bytes = s.g + gbytes;
  s.qw = 2 * s.stage_bytes;
  s.kw = s.qw + kChunk * s.pq * 2;
  s.a = s.kw + kChunk * s.pq * 2;
  s.tot = s.a + kChunk * s.pa * 2;
  s.dfac = s.tot + 4 * dk * 4;
  s.dsum = s.dfac + dk * 4;
  s.total = s.dsum + dk * 4;
  s.extra0 = s.extra1 = -1;
  // Level copies 0 and 1 go over the stage's raw q and k, 2 (and 3 for an fp32 gate) over its
  // raw g; the rest need their own buffers.
  const int copy_bytes = kChunk * s.pq * 2;
  const int extras = per_head ? 2 : (gate_bytes == 2 ? 1 : 0);
  if (extras >= 1) { s.extra0 = s.total; s.total += copy_bytes; }
  if (extras >= 2) { s.extra1 = s.total; s.total += copy_bytes; }
  s.dpart = s.total;
  s.total += (bv / 16) * 16 * 4;
  return s;
}

// Shared-memory layout (bytes) of the intra-chunk matrix kernel (chunk_forward_intra.cu): STAGES
// stages of one 64-key slice of raw q, k and gate (the gate in its own width, gate_bytes), and one
// slice of qloc, kloc, the fp32 factors e = 2^{g log2 e} and the sub-chunk totals. A goes over the
// factors once the last slice is done.
struct IntraSmem {
  int pq, pg, pe, pa;  // pitches (elements): raw q/k and qloc/kloc, raw gate, factors, A
  int q, k, g;         // offsets inside one stage
  int stage_bytes;
  int qloc, kloc, e, tot, a;  // after the stages (a == e)
  int factors;                // the prepared inputs' sub-chunk factors 2^{pre}, 2^{post} [2][4][64] fp32
  int diagonal;               // the element-wise diagonal blocks' sums [4][16][16] fp32
  int total;
};
constexpr int kIntraSliceKeys = 64;
GLA_HD inline IntraSmem intra_smem_layout(int stages, int gate_bytes) {
  IntraSmem s{};
  s.pq = kIntraSliceKeys + 8;  // 144-byte rows: ldmatrix without bank conflicts
  s.pg = kIntraSliceKeys + 8;
  // fp32 rows of 320 bytes (16 banks apart): the diagonal items' 64-bit reads of two rows hit 32
  // distinct banks (chunk_forward_intra.cu)
  s.pe = kIntraSliceKeys + 16;
  s.pa = kChunk + 8;
  s.q = 0;
  s.k = s.q + kChunk * s.pq * 2;
  s.g = s.k + kChunk * s.pq * 2;
  s.stage_bytes = s.g + kChunk * s.pg * gate_bytes;
  s.qloc = stages * s.stage_bytes;
  s.kloc = s.qloc + kChunk * s.pq * 2;
  s.e = s.kloc + kChunk * s.pq * 2;
  s.a = s.e;
  s.tot = s.e + kChunk * s.pe * 4;
  s.factors = s.tot + 4 * kIntraSliceKeys * 4;
  s.diagonal = s.factors + 2 * 4 * kIntraSliceKeys * 4;
  s.total = s.diagonal + 4 * 16 * 16 * 4;
  return s;
}

// Element offset of (row r, column c) of a 64-row 16-bit tile in the 128-byte-swizzled layout that
// wgmma reads: columns in blocks of 64 (128-byte rows), blocks 64 rows x 128 B = 8 KB apart; inside
// a block the 16-byte chunk index of row r is XORed with r % 8 (the tile base must be 1024-byte
// aligned). 8 consecutive columns from a multiple of 8 stay one contiguous 16-byte chunk.
GLA_HD inline int sw128_off(int r, int c) {
  const int b = r * 128 + (c & 63) * 2;
  return ((c >> 6) * 8192 + (b ^ (((b >> 7) & 7) << 4))) >> 1;
}
// The prepared key split's slots on sm_90a, in that layout: slot s at s * kSwizzledSlotBytes from
// the start of shared memory (the raw stage and the level copies, which a prepared pass leaves
// unused), qg [64 t][128 k] at 0, kg at kSwizzledKg, A [64 t][64 s] at kSwizzledA.
constexpr int kSwizzledSlotBytes = 40960, kSwizzledKg = 16384, kSwizzledA = 32768;

// Shared-memory layout (bytes) of the warp-specialised kernel. Indexed buffers are base + i * step
// (no arrays: a struct indexed at run time would live in local memory).
struct WsSmem {
  int pq, pv, pa, pr;       // pitches (elements): tiles read by ldmatrix (padded), v, A, raw stage
  int q, k, g;              // raw stage
  int lvl0, lvl_step;       // level copies h = 8, 4, 2
  int v0, v_step;           // two v stages
  int slot0, slot_step;     // two slots, each {qw, kw, A, decay} at the offsets below
  int s_qw, s_kw, s_a, s_dfac;
  int tot, htot, dpart;     // htot: per-half sub-chunk totals (split items only)
  int ofac;                 // the far off-diagonal blocks' factors: 2^{Tot_1}, 2^{Tot_2}, 2^{Tot_1 + Tot_2}
  int mbar;                 // 4 mbarriers (READY[2], FREE[2]) for the mbarrier hand-off
  int total;
  GLA_HD int lvl(int i) const { return lvl0 + i * lvl_step; }
  GLA_HD int v(int i) const { return v0 + i * v_step; }
  GLA_HD int qw(int i) const { return slot0 + i * slot_step + s_qw; }
  GLA_HD int kw(int i) const { return slot0 + i * slot_step + s_kw; }
  GLA_HD int a(int i) const { return slot0 + i * slot_step + s_a; }
  GLA_HD int dfac(int i) const { return slot0 + i * slot_step + s_dfac; }
};
// Per prep warp: RS row sums of q.k, then RS/2 pair sums (RS = 16 / halves rows per item).
GLA_HD constexpr int ws_dpart_stride(int halves) { return (16 / halves) * 3 / 2; }
// The far blocks' factor table (and the A-phase split that gives the far blocks warps of their
// own) only where it measured faster: DK = 128 with one prep thread per item (H200, B8 T4096 H16
// D128 0.388 -> 0.380 ms; with split items at D64 0.365 -> 0.377 ms, so not there).
GLA_HD constexpr bool ws_far_factor_table(int dk, int halves) { return dk == 128 && halves == 1; }
// halves = 2: split items (two prep threads per element-wise item, 8 rows each).
// The gate's stage is a per-key tile's size whatever the gate's form (a per-head gate uses its first
// 64 values): one layout, so every offset is a compile-time constant in the kernel, where a layout
// that depended on the run-time per-head flag made every later region's address a run-time value
// (the D128 bf16 kernel ~600 SASS instructions longer; one layout: H100 B8 T4096 H16 D128 kernel
// 459 -> 440 us). The per-key layout is the one that must fit.
GLA_HD inline WsSmem ws_smem_layout(int dk, int halves = 1) {
  WsSmem s{};
  s.pq = dk + 8;
  s.pv = dk + 8;
  s.pa = kChunk + 8;
  // The raw stage is only read row-wise (a warp reads 32 column pairs of one row, conflict-free at
  // any pitch), never by ldmatrix: no padding.
  s.pr = dk;
  const int tile = kChunk * s.pq * 2;
  const int raw = kChunk * s.pr * 2;
  int off = 0;
  s.q = off; off += raw;
  s.k = off; off += raw;
  s.g = off; off += raw;
  s.lvl0 = off; s.lvl_step = tile; off += 3 * tile;
  s.v0 = off; s.v_step = kChunk * s.pv * 2; off += 2 * s.v_step;
  s.s_qw = 0;
  s.s_kw = tile;
  s.s_a = 2 * tile;
  s.s_dfac = s.s_a + kChunk * s.pa * 2;
  s.slot0 = off; s.slot_step = s.s_dfac + dk * 4; off += 2 * s.slot_step;
  s.tot = off; off += 4 * dk * 4;
  s.htot = off; off += halves > 1 ? 4 * halves * dk * 4 : 0;
  s.dpart = off; off += (2 * dk * halves / 32) * ws_dpart_stride(halves) * 4;
  off = (off + 15) & ~15;
  s.ofac = -1;
  if (ws_far_factor_table(dk, halves)) {
    s.ofac = off;
    off += 3 * dk * 4;
  }
  off = (off + 7) & ~7;
  s.mbar = off; off += 4 * 8;
  s.total = off;
  return s;
}

// The recurrent forward kernel (forward.cu): tokens staged per block step, and its dynamic shared
// memory (q, k, g rows of the staged tokens, their values of a 32-wide value tile, the reductions).
constexpr int kRecurrentTokens = 8;
constexpr int kRecurrentThreads = 256;
GLA_HD inline size_t recurrent_smem_bytes(int64_t K) {
  return (size_t(kRecurrentTokens) * K * 3 + kRecurrentTokens * 32 + kRecurrentTokens * 8 * 32) * sizeof(float);
}

}  // namespace gla::cuda::detail
