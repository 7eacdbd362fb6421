// The cuda backend's forward planner (src/backends/cuda/plan.cpp, host code): which kernel a
// problem gets, the tiling, and the segment split of long sequences with its workspace. Runs without a GPU (the planner needs only the SM count), so CI
// checks it; the kernels themselves are tested on the GPU (test_cuda_forward.cpp).
#include <gtest/gtest.h>

#ifdef GLA_TESTS_WITH_CUDA

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/chunk_layout.hpp"

namespace gla::test {
namespace {

using cuda::ForwardKernel;
using cuda::ForwardParams;
using cuda::ForwardPlan;

struct Shape {
  int64_t B = 1, T = 256, H = 2, K = 128, V = 128;
  int32_t dtype = cuda::kBF16, gate_dtype = cuda::kBF16, per_head = 0, vector_loads = 1;
};

ForwardParams params(const Shape& s) {
  ForwardParams p{};
  p.B = s.B;
  p.T = s.T;
  p.H = s.H;
  p.K = s.K;
  p.V = s.V;
  p.N = s.B;
  p.dtype = s.dtype;
  p.gate_dtype = s.gate_dtype;
  p.gate_per_head = s.per_head;
  p.vector_loads = s.vector_loads;
  return p;
}

ForwardPlan plan_for(const Shape& s, const std::vector<int64_t>& offsets = {}) {
  std::vector<int64_t> so = offsets;
  if (so.empty()) {
    for (int64_t n = 0; n <= s.B; ++n) so.push_back(n * s.T);
  }
  ForwardParams p = params(s);
  if (!offsets.empty()) {
    p.varlen = 1;
    p.N = static_cast<int64_t>(offsets.size()) - 1;
  }
  return cuda::plan_forward(p, so.data(), 132);
}

// The warp-specialised kernel where it applies (two prep threads per item at K <= 64), the
// single-role kernel for what it cannot take (fp32 per-key gate, unaligned rows or K, V not
// multiples of 8); V tiled by the padded K.
TEST(CudaPlan, KernelChoiceByShape) {
  struct Row {
    Shape s;
    ForwardKernel kernel;
    int head_dim_k, value_tile, value_tiles;
  };
  const std::vector<Row> rows = {
      {{}, ForwardKernel::kChunkWs, 128, 128, 1},                                      // D128
      {{.K = 64, .V = 64}, ForwardKernel::kChunkWsSplit, 64, 64, 1},                   // D64
      {{.K = 32, .V = 32}, ForwardKernel::kChunkWsSplit, 64, 64, 1},
      {{.gate_dtype = cuda::kF32}, ForwardKernel::kChunk, 128, 128, 1},                // fp32 per-key gate
      {{.K = 64, .V = 64, .gate_dtype = cuda::kF32}, ForwardKernel::kChunk, 64, 64, 1},
      {{.gate_dtype = cuda::kF32, .per_head = 1}, ForwardKernel::kChunkWs, 128, 128, 1},  // fp32 per-head gate
      {{.vector_loads = 0}, ForwardKernel::kChunk, 128, 128, 1},                       // unaligned rows
      {{.K = 60, .V = 60, .vector_loads = 0}, ForwardKernel::kChunk, 64, 64, 1},
      {{.K = 64, .V = 128}, ForwardKernel::kChunkWsSplit, 64, 64, 2},                  // V tiled by the padded K
      {{.K = 100, .V = 200, .vector_loads = 1}, ForwardKernel::kChunkWs, 128, 128, 2},
      {{.K = 100, .V = 200, .vector_loads = 0}, ForwardKernel::kChunk, 128, 128, 2},
      {{.dtype = cuda::kF16}, ForwardKernel::kChunkWs, 128, 128, 1},
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    const ForwardPlan plan = plan_for(r.s);
    SCOPED_TRACE(testing::Message() << "row " << i);
    EXPECT_EQ(plan.kernel, r.kernel);
    EXPECT_EQ(plan.head_dim_k, r.head_dim_k);
    EXPECT_EQ(plan.value_tile, r.value_tile);
    EXPECT_EQ(plan.value_tiles, r.value_tiles);
  }
}

// Each plan reports its kernel's dynamic shared memory (check_more compares it with the device's
// per-block limit): the layout the launcher passes, for each kernel kind.
TEST(CudaPlan, SharedMemoryOfThePlannedKernel) {
  using cuda::detail::chunk_smem_layout;
  using cuda::detail::ws_smem_layout;
  EXPECT_EQ(plan_for({}).shared_bytes, size_t(ws_smem_layout(128, 1).total));
  // a per-head gate takes the per-key layout (its gate in the first values of the gate's stage)
  EXPECT_EQ(plan_for({.gate_dtype = cuda::kF32, .per_head = 1}).shared_bytes, size_t(ws_smem_layout(128, 1).total));
  EXPECT_EQ(plan_for({.K = 64, .V = 64}).shared_bytes, size_t(ws_smem_layout(64, 2).total));
  EXPECT_EQ(plan_for({.K = 64, .V = 64, .per_head = 1}).shared_bytes, size_t(ws_smem_layout(64, 2).total));
  EXPECT_EQ(plan_for({.gate_dtype = cuda::kF32}).shared_bytes, size_t(chunk_smem_layout(128, 128, 4, false).total));
  EXPECT_EQ(plan_for({.K = 60, .V = 60, .vector_loads = 0}).shared_bytes, size_t(chunk_smem_layout(64, 64, 2, false).total));
  EXPECT_EQ(plan_for({.K = 256, .V = 256}).shared_bytes, plan_for({}).shared_bytes);  // two K = 128 halves
  EXPECT_EQ(plan_for({.dtype = cuda::kF32, .gate_dtype = cuda::kF32}).shared_bytes, cuda::detail::recurrent_smem_bytes(128));
  // What that means on the GPUs of compute capability 8.x and 9.0 (opt-in per block): an H200 /
  // H100 (232 448 B) runs every plan, an A100 (166 912 B) the K <= 64 ones, sm_86 / sm_89
  // (101 376 B) none of the chunk kernels.
  for (const Shape& s : {Shape{}, Shape{.gate_dtype = cuda::kF32}, Shape{.vector_loads = 0}}) {
    EXPECT_LE(plan_for(s).shared_bytes, 232448u);
    EXPECT_GT(plan_for(s).shared_bytes, 166912u);
  }
  for (const Shape& s : {Shape{.K = 64, .V = 64}, Shape{.K = 64, .V = 64, .gate_dtype = cuda::kF32}}) {
    EXPECT_LE(plan_for(s).shared_bytes, 166912u);
    EXPECT_GT(plan_for(s).shared_bytes, 101376u);
  }
}

TEST(CudaPlan, SharedMemoryShortfallNamesBothFigures) {
  EXPECT_FALSE(cuda::shared_memory_shortfall(1000, 1000, false).has_value());
  EXPECT_FALSE(cuda::shared_memory_shortfall(0, 0, true).has_value());
  const auto forward = cuda::shared_memory_shortfall(229664, 166912, false);
  ASSERT_TRUE(forward.has_value());
  EXPECT_NE(forward->find("forward"), std::string::npos) << *forward;
  EXPECT_NE(forward->find("229664"), std::string::npos) << *forward;
  EXPECT_NE(forward->find("166912"), std::string::npos) << *forward;
  const auto backward = cuda::shared_memory_shortfall(112896, 101376, true);
  ASSERT_TRUE(backward.has_value());
  EXPECT_NE(backward->find("backward"), std::string::npos) << *backward;
}

TEST(CudaPlan, RecurrentKernelForFp32AndWideKeys) {
  EXPECT_EQ(plan_for({.dtype = cuda::kF32, .gate_dtype = cuda::kF32}).kernel, ForwardKernel::kRecurrent);
  EXPECT_EQ(plan_for({.K = 256, .V = 256, .dtype = cuda::kF32, .gate_dtype = cuda::kF32}).kernel, ForwardKernel::kRecurrent);
  EXPECT_EQ(plan_for({.K = 264, .V = 64}).kernel, ForwardKernel::kRecurrent);
  EXPECT_EQ(plan_for({.K = 320, .V = 320}).kernel, ForwardKernel::kRecurrent);
}

// 128 < K <= 256 with 16-bit inputs: two K = 128 halves on the chunk kernel, the tiling of one
// half, A over all keys ([B*T, H, 64] 16-bit) last in the workspace, 256-byte aligned. The
// warp-specialised kernel adds the second half into o as it stores it (key_split 2); the others put
// the second half's o ([B*T, H, V] 16-bit) after the segment workspace, 256-byte aligned
// (key_split 1).
TEST(CudaPlan, WideKeysRunAsTwoHalves) {
  struct Row {
    Shape s;
    ForwardKernel kernel;
  };
  const std::vector<Row> rows = {
      {{.K = 256, .V = 256}, ForwardKernel::kChunkWs},
      {{.K = 192, .V = 64}, ForwardKernel::kChunkWs},
      {{.K = 136, .V = 128, .dtype = cuda::kF16}, ForwardKernel::kChunkWs},
      {{.K = 129, .V = 64, .vector_loads = 0}, ForwardKernel::kChunk},          // unaligned: single-role halves
      {{.K = 256, .V = 256, .gate_dtype = cuda::kF32}, ForwardKernel::kChunk},  // fp32 per-key gate
      {{.B = 1, .T = 32768, .H = 16, .K = 256, .V = 256}, ForwardKernel::kChunkWs},  // long: segments too
      {{.K = 256, .V = 512}, ForwardKernel::kChunkWs},                               // prepared inputs
      {{.K = 200, .V = 500, .per_head = 1}, ForwardKernel::kChunkWs},
      {{.B = 1, .T = 32768, .H = 4, .K = 256, .V = 512}, ForwardKernel::kChunkWs},   // prepared, segments
  };
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    SCOPED_TRACE(testing::Message() << "row " << i);
    const ForwardPlan plan = plan_for(r.s);
    Shape half = r.s;
    half.K = 128;
    const ForwardPlan h = plan_for(half);
    EXPECT_EQ(plan.kernel, r.kernel);
    EXPECT_EQ(plan.head_dim_k, 128);
    EXPECT_EQ(plan.value_tiles, h.value_tiles);
    EXPECT_EQ(plan.max_segments, h.max_segments);
    if (r.kernel == ForwardKernel::kChunkWs) {
      EXPECT_EQ(plan.key_split, 2);
      EXPECT_GE(plan.intra_offset, h.workspace_bytes);
    } else {
      EXPECT_EQ(plan.key_split, 1);
      EXPECT_EQ(plan.partial_offset % 256, 0u);
      EXPECT_GE(plan.partial_offset, h.workspace_bytes);
      EXPECT_GE(plan.intra_offset, plan.partial_offset + size_t(r.s.B * r.s.T * r.s.H * r.s.V) * 2);
    }
    EXPECT_EQ(plan.intra_offset % 256, 0u);
    const size_t intra_end = plan.intra_offset + size_t(r.s.B * r.s.T * r.s.H * 64) * 2;
    // Prepared inputs where four or more value tiles would each redo the element-wise work.
    EXPECT_EQ(plan.prepared, plan.key_split == 2 && plan.value_tiles >= 4);
    if (plan.prepared) {
      EXPECT_EQ(plan.prepared_offset % 256, 0u);
      EXPECT_GE(plan.prepared_offset, intra_end);
      const size_t inputs = size_t(r.s.B * r.s.T * r.s.H * r.s.K) * 4;
      const size_t decays = (size_t(cuda::prepared_chunk_slots(r.s.B, r.s.T, r.s.B)) * r.s.H * r.s.K * 8 + 255) / 256 * 256;
      EXPECT_EQ(plan.workspace_bytes, plan.prepared_offset + decays + inputs);
      // qg and kg placed by the caller (the backward's dq and dk): only the decays
      ForwardParams placed = params(r.s);
      uint16_t qg = 0, kg = 0;
      placed.prepared_qg = &qg;
      placed.prepared_kg = &kg;
      std::vector<int64_t> offsets(size_t(r.s.B) + 1);
      for (size_t n = 0; n < offsets.size(); ++n) offsets[n] = int64_t(n) * r.s.T;
      EXPECT_EQ(cuda::plan_forward(placed, offsets.data(), 132).workspace_bytes, plan.prepared_offset + decays);
    } else {
      EXPECT_EQ(plan.workspace_bytes, intra_end);
    }
  }
  EXPECT_GT(plan_for(rows.back().s).max_segments, 1);
  EXPECT_GT(plan_for(rows[rows.size() - 4].s).max_segments, 1);
  EXPECT_EQ(plan_for({}).key_split, 0);
}

// Every chunk of every sequence lies in a segment, and the workspace holds one K x V state and one
// K-vector of decays per (sequence, segment, head, value tile) exactly when there are segments.
void expect_segments_cover(const ForwardPlan& plan, const Shape& s, const std::vector<int64_t>& so) {
  ASSERT_GE(plan.segment_chunks, 1);
  ASSERT_GE(plan.max_segments, 1);
  for (size_t n = 0; n + 1 < so.size(); ++n) {
    const int64_t chunks = (so[n + 1] - so[n] + 63) / 64;
    const int64_t seg = cuda::detail::sequence_segment_chunks(plan.segment_chunks, plan.whole_chunks, chunks);
    const int64_t segments = cuda::detail::sequence_segments(plan.segment_chunks, plan.whole_chunks, chunks);
    EXPECT_LE(segments, plan.max_segments) << "sequence " << n;
    EXPECT_LE(chunks, seg * segments) << "sequence " << n;
    if (chunks > 0) {
      EXPECT_GT(chunks, seg * (segments - 1)) << "sequence " << n << ": an empty segment";
    }
  }
  const int64_t N = static_cast<int64_t>(so.size()) - 1;
  const size_t per = size_t(plan.value_tiles) * plan.value_tile * plan.head_dim_k + plan.head_dim_k;
  EXPECT_EQ(plan.workspace_bytes, plan.max_segments > 1 ? size_t(N) * plan.max_segments * s.H * per * 4 : 0u);
}

// A block order, when the plan has one, lists every (sequence, segment) block of the full pass
// exactly once, by non-increasing length.
void expect_longest_first(const ForwardPlan& plan, const std::vector<int64_t>& so) {
  if (plan.block_order_count == 0) return;
  std::map<int64_t, int> seen;
  int64_t prev_len = std::numeric_limits<int64_t>::max();
  int64_t blocks = 0;
  for (size_t n = 0; n + 1 < so.size(); ++n) {
    const int64_t chunks = (so[n + 1] - so[n] + 63) / 64;
    blocks += cuda::detail::sequence_segments(plan.segment_chunks, plan.whole_chunks, chunks);
  }
  EXPECT_EQ(plan.block_order_count, blocks);
  for (int i = 0; i < plan.block_order_count; ++i) {
    const int64_t b = plan.block_order[i], n = b / plan.max_segments, m = b % plan.max_segments;
    ASSERT_LT(n + 1, static_cast<int64_t>(so.size()));
    const int64_t chunks = (so[n + 1] - so[n] + 63) / 64;
    const int64_t seg = cuda::detail::sequence_segment_chunks(plan.segment_chunks, plan.whole_chunks, chunks);
    const int64_t len = chunks == 0 ? 0 : std::min(seg, chunks - m * seg);
    EXPECT_GE(len, 0) << "block " << i;
    EXPECT_EQ(++seen[b], 1) << "block " << b << " listed twice";
    EXPECT_LE(len, prev_len) << "block " << i;
    prev_len = len;
  }
}

TEST(CudaPlan, LongSequencesAreSplitAndBatchesAreNot) {
  // B1 T32768 H16: 16 CTAs without a split on 132 SMs; the planner must split.
  const Shape few{.B = 1, .T = 32768, .H = 16};
  const ForwardPlan a = plan_for(few);
  EXPECT_GT(a.max_segments, 1);
  expect_segments_cover(a, few, {0, 32768});
  // B8 T4096 H16: 128 CTAs already fill the GPU; no split, no workspace.
  const Shape many{.B = 8, .T = 4096, .H = 16};
  const ForwardPlan b = plan_for(many);
  EXPECT_EQ(b.max_segments, 1);
  EXPECT_EQ(b.workspace_bytes, 0u);
}

TEST(CudaPlan, VarlenPlansCoverEverySequence) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int64_t> so = {0};
    const int n = 1 + static_cast<int>(rng() % 16);
    for (int i = 0; i < n; ++i) {
      const int64_t len = (rng() % 5 == 0) ? 0 : static_cast<int64_t>(rng() % 9000);  // empty ones too
      so.push_back(so.back() + len);
    }
    const Shape s{.B = 1, .T = so.back(), .H = 1 + static_cast<int64_t>(rng() % 16)};
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    const ForwardPlan plan = plan_for(s, so);
    expect_segments_cover(plan, s, so);
    expect_longest_first(plan, so);
  }
}

// Uneven sequences: the full pass's blocks are listed longest first, each block (sequence,
// segment) of the plan exactly once -- an empty sequence's one block too.
TEST(CudaPlan, UnevenSequencesLaunchLongestFirst) {
  const std::vector<int64_t> lens = {4096, 512, 3000, 1, 2048, 7000, 64, 65, 1024, 4000, 333, 2500, 1500, 3000, 2000, 1626};
  std::vector<int64_t> so = {0};
  for (int64_t l : lens) so.push_back(so.back() + l);
  const Shape s{.B = 1, .T = so.back(), .H = 16};
  const ForwardPlan plan = plan_for(s, so);
  EXPECT_GT(plan.block_order_count, 0);
  expect_longest_first(plan, so);
  // Equal lengths keep the natural order, and so does the single-role kernel.
  EXPECT_EQ(plan_for({.B = 8, .T = 4096, .H = 16}).block_order_count, 0);
  const ForwardPlan single = plan_for({.B = 1, .T = so.back(), .H = 16, .gate_dtype = cuda::kF32}, so);
  EXPECT_EQ(single.kernel, ForwardKernel::kChunk);
  EXPECT_EQ(single.block_order_count, 0);
}

// One long sequence among shorter ones (the benchmark's varlen case): the short ones run whole and
// only the long one splits, so its segments do not leave the GPU idle behind a split of the others.
TEST(CudaPlan, OnlyTheLongestSequencesSplit) {
  const std::vector<int64_t> so = {0,     1,     7000,  7001,  9000,  9100,  12000, 15000, 15001,
                                   18000, 21000, 24000, 26000, 28000, 30000, 31500, 32769};
  const Shape s{.B = 1, .T = so.back(), .H = 16};
  const ForwardPlan plan = plan_for(s, so);
  EXPECT_GE(plan.whole_chunks, 47);  // the 47-chunk sequences are one segment each
  EXPECT_LT(plan.whole_chunks, 110);
  EXPECT_LT(plan.segment_chunks, 47);
  EXPECT_EQ(plan.max_segments, (110 + plan.segment_chunks - 1) / plan.segment_chunks);
  expect_segments_cover(plan, s, so);
  expect_longest_first(plan, so);
  // Equal lengths: nothing to keep whole.
  EXPECT_EQ(plan_for({.B = 1, .T = 32768, .H = 16}).whole_chunks, 0);
}

// One name per kernel, distinct: the harness and plan_note print them.
TEST(CudaPlan, KernelNamesAreDistinct) {
  const ForwardKernel all[] = {ForwardKernel::kRecurrent, ForwardKernel::kChunk, ForwardKernel::kChunkWs,
                               ForwardKernel::kChunkWsSplit};
  for (ForwardKernel a : all) {
    for (ForwardKernel b : all) {
      if (a == b) continue;
      EXPECT_STRNE(cuda::kernel_name(a).id, cuda::kernel_name(b).id);
      EXPECT_STRNE(cuda::kernel_name(a).description, cuda::kernel_name(b).description);
    }
  }
  EXPECT_STREQ(cuda::kernel_name(ForwardKernel::kChunkWsSplit).id, "chunk-ws-split");
}

// The 128-byte-swizzled tile layout of the prepared key split's slots (cuda::detail::sw128_off; the
// hardware side is checked on a GPU by the harness check's K256 V512 cases). The kernel relies on: a
// bijection of a 64 x 128 tile onto its 8192 elements; eight columns from a multiple of 8 contiguous
// (one 16-byte cp.async piece, ldmatrix / stmatrix rows); the eight 16-byte chunks of a row in eight
// different chunk slots of its 128-byte line; column blocks of 64 8 KB apart; and, read as
// B[k = row][n = column], the N-major placement that kKgLeadingBytes / kKgStrideBytes describe
// (8-row atoms 1024 bytes apart along rows, column blocks 8192 apart). The two slots end before the
// v stages, in both gate layouts, and start on 1024-byte boundaries.
TEST(CudaLayout, Swizzled128ByteTile) {
  using cuda::detail::sw128_off;
  std::vector<int> seen(64 * 128, 0);
  for (int r = 0; r < 64; ++r) {
    std::vector<int> slots;
    for (int c = 0; c < 128; ++c) {
      const int e = sw128_off(r, c);
      ASSERT_GE(e, 0);
      ASSERT_LT(e, 64 * 128);
      ++seen[e];
      if (c % 8 != 0) {
        EXPECT_EQ(e, sw128_off(r, c - 1) + 1) << "row " << r << " col " << c;
      }
      if (c % 8 == 0 && c < 64) slots.push_back((e * 2 / 16) % 8);
      EXPECT_EQ(e * 2 / 8192, c / 64);  // column block
      EXPECT_EQ((e * 2 % 8192) / 128, r) << "row's 128-byte line";
      EXPECT_EQ((e * 2 % 8192) / 1024, r / 8) << "8-row atom";
    }
    std::sort(slots.begin(), slots.end());
    for (int i = 0; i < 8; ++i) EXPECT_EQ(slots[i], i) << "row " << r;
  }
  for (int e = 0; e < 64 * 128; ++e) ASSERT_EQ(seen[e], 1) << "element " << e;
  // A 16-byte chunk column of 8 consecutive rows lies in 8 different chunk slots.
  for (int r0 = 0; r0 < 64; r0 += 8) {
    for (int j = 0; j < 16; ++j) {
      std::vector<int> slots;
      for (int r = r0; r < r0 + 8; ++r) slots.push_back((sw128_off(r, 8 * j) * 2 / 16) % 8);
      std::sort(slots.begin(), slots.end());
      for (int i = 0; i < 8; ++i) EXPECT_EQ(slots[i], i) << "rows " << r0 << ".." << r0 + 7 << ", chunk " << j;
    }
  }
  EXPECT_EQ(cuda::detail::kSwizzledSlotBytes % 1024, 0);
  EXPECT_EQ(cuda::detail::kSwizzledKg % 1024, 0);
  EXPECT_EQ(cuda::detail::kSwizzledA % 1024, 0);
  EXPECT_GE(cuda::detail::kSwizzledKg, 64 * 128 * 2);                        // qg
  EXPECT_GE(cuda::detail::kSwizzledA - cuda::detail::kSwizzledKg, 64 * 128 * 2);  // kg
  EXPECT_GE(cuda::detail::kSwizzledSlotBytes - cuda::detail::kSwizzledA, 64 * 64 * 2);  // A
  const cuda::detail::WsSmem L = cuda::detail::ws_smem_layout(128, 1);
  EXPECT_LE(2 * cuda::detail::kSwizzledSlotBytes, L.v0);
  // the second key half's staged o (8 warps x 64 rows x 16 values) in the unused plain qw of slot 0
  EXPECT_LE(8 * 64 * 16 * 2, L.kw(0) - L.qw(0));
}

}  // namespace
}  // namespace gla::test

#else

TEST(CudaPlan, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: the cuda planner is not built"; }

#endif
