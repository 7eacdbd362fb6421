// Host-side facts about the chunk kernels that the planner needs without compiling device code:
// the chunk length, the segment-split arguments and the single-role kernel's shared-memory layout
// (computed identically on host and device).
#pragma once

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

struct SegmentArgs {
  int64_t segment_chunks;  // chunks per segment
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

}  // namespace gla::cuda::detail
