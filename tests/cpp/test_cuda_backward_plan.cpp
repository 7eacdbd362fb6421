// The cuda backend's backward planner (src/backends/cuda/plan_backward.cpp, host code): tile counts,
// the workspace layout, the state walks' segment split and the reversed forward's problem for dv.
// Runs without a GPU (the planner needs only the SM count), so CI checks it; the kernels themselves
// are tested on the GPU (test_cuda_backward.cpp).
#include <gtest/gtest.h>

#ifdef GLA_TESTS_WITH_CUDA

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "backends/cuda/chunk_backward.hpp"

namespace gla::test {
namespace {

using cuda::BackwardParams;
using cuda::BackwardPlan;

constexpr int kSms = 132;  // an H200

// Stand-in device addresses: the planner only tests them for null and offsets them (never reads).
const void* fake(uintptr_t a) { return reinterpret_cast<const void*>(a); }

struct Shape {
  int64_t B = 2, T = 256, H = 2, K = 128, V = 128;
  bool dv = true, dout = true, dht = false, per_head = false, dh0 = false, dq = true;
  float scale = 0.125f;
};

BackwardParams params(const Shape& s, const std::vector<int64_t>& offsets) {
  BackwardParams p{};
  p.B = s.B;
  p.T = s.T;
  p.H = s.H;
  p.K = s.K;
  p.V = s.V;
  p.N = offsets.empty() ? s.B : static_cast<int64_t>(offsets.size()) - 1;
  p.varlen = offsets.empty() ? 0 : 1;
  const int64_t Kg = s.per_head ? 1 : s.K;
  p.q = fake(0x10000000);
  p.k = fake(0x20000000);
  p.v = fake(0x30000000);
  p.g = fake(0x40000000);
  p.do_ = s.dout ? fake(0x50000000) : nullptr;
  p.dht = s.dht ? static_cast<const float*>(fake(0x60000000)) : nullptr;
  p.dv = s.dv ? const_cast<void*>(fake(0x70000000)) : nullptr;
  p.dq = s.dq ? const_cast<void*>(fake(0x80000000)) : nullptr;
  p.dh0 = s.dh0 ? static_cast<float*>(const_cast<void*>(fake(0x90000000))) : nullptr;
  for (int64_t* st : {p.q_stride, p.k_stride, p.dq_stride, p.dk_stride}) {
    st[0] = s.T * s.H * s.K, st[1] = s.H * s.K, st[2] = s.K;
  }
  for (int64_t* st : {p.v_stride, p.do_stride, p.dv_stride}) st[0] = s.T * s.H * s.V, st[1] = s.H * s.V, st[2] = s.V;
  for (int64_t* st : {p.g_stride, p.dg_stride}) st[0] = s.T * s.H * Kg, st[1] = s.H * Kg, st[2] = Kg;
  p.scale = s.scale;
  p.dtype = cuda::kBF16;
  p.gate_dtype = cuda::kBF16;
  p.dg_dtype = cuda::kBF16;
  p.gate_per_head = s.per_head ? 1 : 0;
  p.vector_loads = p.vector_gate = p.vector_dv = p.vector_dqk = 1;
  int64_t chunks = 0;
  if (offsets.empty()) {
    chunks = s.B * ((s.T + 63) / 64);
  } else {
    for (size_t n = 0; n + 1 < offsets.size(); ++n) chunks += (offsets[n + 1] - offsets[n] + 63) / 64;
  }
  p.num_chunks = chunks;
  return p;
}

struct Planned {
  BackwardParams p;
  BackwardPlan plan;
};

Planned plan_for(const Shape& s, const std::vector<int64_t>& offsets = {}) {
  std::vector<int64_t> so = offsets;
  if (so.empty()) {
    for (int64_t n = 0; n <= s.B; ++n) so.push_back(n * s.T);
  }
  Planned r{params(s, offsets), {}};
  r.plan = cuda::plan_backward(r.p, so.data(), kSms);
  return r;
}

// (offset, bytes) of every region the plan places, for the layout checks.
std::vector<std::pair<size_t, size_t>> regions(const Planned& r) {
  const BackwardParams& p = r.p;
  const BackwardPlan& plan = r.plan;
  const size_t states = static_cast<size_t>(p.num_chunks) * p.H * p.K * p.V * 2;
  std::vector<std::pair<size_t, size_t>> out = {{plan.chunk_offsets, (p.N + 1) * sizeof(int64_t)},
                                                {plan.states, states},
                                                {plan.state_grads, states}};
  if (p.gate_per_head && plan.key_tiles > 1) {
    out.push_back({plan.gate_partials, static_cast<size_t>(plan.key_tiles) * p.B * p.T * p.H * 4});
  }
  if (plan.scan_segment_chunks > 0) {
    const size_t blocks = static_cast<size_t>(p.N) * plan.scan_segments * p.H * 2 * plan.key_tiles * plan.scan_value_groups;
    out.push_back({plan.segment_states, blocks * 64 * 128 * 4});
    out.push_back({plan.segment_decay, blocks * 64 * 4});
  }
  if (p.dv != nullptr) {
    if (p.varlen) out.push_back({plan.reversed_offsets, (p.N + 1) * sizeof(int64_t)});
    if (p.varlen && plan.state_grads_by_values) out.push_back({plan.reversed_chunk_first, (p.N + 1) * sizeof(int64_t)});
    if (p.dht != nullptr) out.push_back({plan.reversed_dht, static_cast<size_t>(p.N) * p.H * p.K * p.V * 4});
    if (!cuda::backward::values_from_do(p)) out.push_back({plan.zero_values, static_cast<size_t>(p.B) * p.T * p.H * p.V * 2});
    if (plan.values.workspace_bytes > 0) out.push_back({plan.values_workspace, plan.values.workspace_bytes});
    if (plan.reversed_final) out.push_back({plan.reversed_final, static_cast<size_t>(p.N) * p.H * p.K * p.V * 4});
  }
  return out;
}

// Every region 256-byte aligned, inside the workspace, and no two overlapping.
void expect_layout(const Planned& r) {
  auto rs = regions(r);
  std::sort(rs.begin(), rs.end());
  for (size_t i = 0; i < rs.size(); ++i) {
    EXPECT_EQ(rs[i].first % 256, 0u) << "region " << i;
    EXPECT_LE(rs[i].first + rs[i].second, r.plan.workspace_bytes) << "region " << i;
    if (i > 0) {
      EXPECT_LE(rs[i - 1].first + rs[i - 1].second, rs[i].first) << "regions " << i - 1 << ", " << i;
    }
  }
}

// The most shared memory any of the call's kernels needs: the walks always, dq/dk/dg when one of
// them is wanted, the reversed forward's kernel when dv is.
TEST(CudaBackwardPlan, SharedMemoryOfTheCallsKernels) {
  const Planned all = plan_for({});
  EXPECT_EQ(all.plan.shared_bytes, std::max({cuda::backward::kScanSharedBytes, cuda::backward::kDqkSharedBytes,
                                             all.plan.values.shared_bytes}));
  EXPECT_GT(all.plan.values.shared_bytes, cuda::backward::kDqkSharedBytes);  // the K = 128 forward's
  EXPECT_EQ(plan_for({.dv = false}).plan.shared_bytes, cuda::backward::kDqkSharedBytes);
  const Planned narrow = plan_for({.K = 64, .V = 64});
  EXPECT_EQ(narrow.plan.shared_bytes, std::max(cuda::backward::kDqkSharedBytes, narrow.plan.values.shared_bytes));
}

TEST(CudaBackwardPlan, TilesAndWalkBlocksByShape) {
  struct Row {
    int64_t K, V;
    int key_tiles, value_tiles, walk_groups;
  };
  for (const Row& row : std::vector<Row>{{128, 128, 2, 2, 1}, {64, 128, 1, 2, 1}, {256, 512, 4, 8, 4}, {128, 256, 2, 4, 2},
                                         {100, 36, 2, 1, 1}, {32, 200, 1, 4, 2}, {1, 1, 1, 1, 1}, {128, 129, 2, 3, 2}}) {
    const Planned r = plan_for({.K = row.K, .V = row.V});
    EXPECT_EQ(r.plan.key_tiles, row.key_tiles) << row.K << "/" << row.V;
    EXPECT_EQ(r.plan.value_tiles, row.value_tiles) << row.K << "/" << row.V;
    EXPECT_EQ(r.plan.scan_value_groups, row.walk_groups) << row.K << "/" << row.V;
    expect_layout(r);
  }
}

// The walks (N x H x 2 x blocks) split into segments of >= 8 chunks only when they fill less than
// one wave of 2 CTAs per SM and a sequence has >= 16 chunks; the segments then cover the longest
// sequence and fill about two waves (or are 8 chunks long).
TEST(CudaBackwardPlan, SegmentSplitOnlyForFewLongWalks) {
  const Planned wide = plan_for({.B = 8, .T = 4096, .H = 16});  // 512 walks: 1.9 waves
  EXPECT_EQ(wide.plan.scan_segment_chunks, 0);
  EXPECT_EQ(wide.plan.scan_segments, 1);
  const Planned short_seqs = plan_for({.B = 1, .T = 960, .H = 1});  // 15 chunks
  EXPECT_EQ(short_seqs.plan.scan_segment_chunks, 0);
  for (const Shape& s : {Shape{.B = 1, .T = 32768, .H = 16}, Shape{.B = 1, .T = 65573, .H = 1, .K = 64, .V = 36},
                         Shape{.B = 2, .T = 2048, .H = 4, .K = 256, .V = 512}}) {
    const Planned r = plan_for(s);
    const int64_t chunks = (s.T + 63) / 64;
    const int64_t walks = s.B * s.H * 2 * r.plan.key_tiles * r.plan.scan_value_groups;
    SCOPED_TRACE(testing::Message() << "B" << s.B << " T" << s.T << " H" << s.H << " K" << s.K << " V" << s.V);
    ASSERT_LT(walks, 2 * kSms);
    EXPECT_GE(r.plan.scan_segment_chunks, 8);
    EXPECT_GT(r.plan.scan_segments, 1);
    EXPECT_GE(r.plan.scan_segments * r.plan.scan_segment_chunks, chunks);
    EXPECT_LT((r.plan.scan_segments - 1) * r.plan.scan_segment_chunks, chunks);
    // About two waves, unless the 8-chunk floor of a segment gives fewer.
    EXPECT_TRUE(walks * r.plan.scan_segments >= 2 * kSms * 2 - walks || r.plan.scan_segment_chunks == 8);
    expect_layout(r);
  }
  // B1 T32768 H16 D128: 64 walks of 512 chunks -> 9 segments of 57.
  const Planned one = plan_for({.B = 1, .T = 32768, .H = 16});
  EXPECT_EQ(one.plan.scan_segment_chunks, 57);
  EXPECT_EQ(one.plan.scan_segments, 9);
}

// The workspace holds what the call needs and no more: the states always; the per-head gate's
// key-tile partials only with K > 64; dv's reversed problem only when dv is wanted, with zeros for
// the values where do is absent or scale is 0, and the reversed dht only with dht.
TEST(CudaBackwardPlan, WorkspaceRegionsFollowTheCall) {
  const Planned base = plan_for({});
  EXPECT_EQ(base.plan.gate_partials, 0u);
  EXPECT_EQ(base.plan.zero_values, 0u);
  EXPECT_EQ(base.plan.reversed_dht, 0u);
  expect_layout(base);
  const Planned no_dv = plan_for({.dv = false});
  EXPECT_EQ(no_dv.plan.values_workspace, 0u);
  // dv's reversed forward reads the caller's tensors in place: nothing of its own here.
  EXPECT_EQ(no_dv.plan.workspace_bytes, base.plan.workspace_bytes);
  expect_layout(no_dv);
  for (const Shape& s : {Shape{.dout = false}, Shape{.scale = 0.0f}}) {
    const Planned r = plan_for(s);
    EXPECT_FALSE(cuda::backward::values_from_do(r.p));
    EXPECT_GT(r.plan.zero_values, 0u);
    expect_layout(r);
  }
  const Planned with_dht = plan_for({.dht = true});
  EXPECT_GT(with_dht.plan.reversed_dht, 0u);
  expect_layout(with_dht);
  const Planned per_head = plan_for({.per_head = true});
  EXPECT_GT(per_head.plan.gate_partials, 0u);
  expect_layout(per_head);
  const Planned per_head_one_tile = plan_for({.K = 64, .per_head = true});
  EXPECT_EQ(per_head_one_tile.plan.gate_partials, 0u);
  const Planned varlen = plan_for({.B = 1, .T = 1000, .dht = true}, {0, 0, 1, 300, 301, 1000});
  EXPECT_EQ(varlen.p.num_chunks, 0 + 1 + 5 + 1 + 11);
  EXPECT_GT(varlen.plan.reversed_offsets, 0u);
  expect_layout(varlen);
}

// dv's problem: q' = k, k' = q, v' = do, o' = dv, each reversed in time (the last token first,
// negative time stride); the gate read one token late; dht / scale the initial state.
TEST(CudaBackwardPlan, ReversedForwardSwapsAndReversesTheInputs) {
  const Planned r = plan_for({.B = 2, .T = 100, .H = 3, .K = 64, .V = 32, .dht = true});
  std::vector<char> workspace(1);  // only its address is used
  char* ws = workspace.data();
  const cuda::ForwardParams f = cuda::backward::reversed_forward(r.p, r.plan, ws);
  const int64_t last = r.p.T - 1;
  EXPECT_EQ(f.q, static_cast<const char*>(r.p.k) + last * r.p.k_stride[1] * 2);
  EXPECT_EQ(f.k, static_cast<const char*>(r.p.q) + last * r.p.q_stride[1] * 2);
  EXPECT_EQ(f.v, static_cast<const char*>(r.p.do_) + last * r.p.do_stride[1] * 2);
  EXPECT_EQ(f.o, static_cast<const char*>(r.p.dv) + last * r.p.dv_stride[1] * 2);
  EXPECT_EQ(f.q_stride[1], -r.p.k_stride[1]);
  EXPECT_EQ(f.k_stride[1], -r.p.q_stride[1]);
  EXPECT_EQ(f.v_stride[1], -r.p.do_stride[1]);
  EXPECT_EQ(f.o_stride[1], -r.p.dv_stride[1]);
  EXPECT_EQ(f.q_stride[0], r.p.k_stride[0]);
  // The gate is read in place, from the last token back, one token late (ForwardParams::gate_lag).
  EXPECT_EQ(f.g, static_cast<const char*>(r.p.g) + last * r.p.g_stride[1] * 2);
  EXPECT_EQ(f.g_stride[1], -r.p.g_stride[1]);
  EXPECT_EQ(f.g_stride[0], r.p.g_stride[0]);
  EXPECT_EQ(f.gate_lag, 1);
  EXPECT_EQ(static_cast<const void*>(f.initial_state), static_cast<const void*>(ws + r.plan.reversed_dht));
  EXPECT_EQ(f.scale, r.p.scale);
  EXPECT_EQ(f.K, r.p.K);
  EXPECT_EQ(f.V, r.p.V);
  // Without do the values are the workspace's zeros and the scale 1 (dht alone drives dS).
  const Planned no_do = plan_for({.B = 2, .T = 100, .H = 3, .K = 64, .V = 32, .dout = false, .dht = true});
  const cuda::ForwardParams z = cuda::backward::reversed_forward(no_do.p, no_do.plan, ws);
  EXPECT_EQ(z.v, ws + no_do.plan.zero_values + last * no_do.p.H * no_do.p.V * 2);
  EXPECT_EQ(z.scale, 1.0f);
}

// The state gradients come from the reversed forward exactly when do drives it (present, scale not
// tiny), a gradient needs them, and the chunks of both directions line up: every sequence length a
// multiple of 64 with a chunk kernel, or any lengths with a warp-specialised kernel, which pads each
// reversed sequence at its start (reversed_pad_front); dh0 then needs its final state.
TEST(CudaBackwardPlan, StateGradientsFromTheReversedForwardWhenChunksLineUp) {
  EXPECT_EQ(plan_for({}).plan.state_grads_by_values, 1);
  EXPECT_EQ(plan_for({}).plan.reversed_pad_front, 0);
  EXPECT_EQ(plan_for({.B = 1, .T = 1024}, {0, 64, 64, 320, 1024}).plan.state_grads_by_values, 1);
  EXPECT_EQ(plan_for({.K = 256, .V = 512}).plan.state_grads_by_values, 1);  // the key split
  for (const Shape& s : {Shape{.dv = false}, Shape{.dout = false}, Shape{.scale = 0.0f}, Shape{.scale = 1e-7f},
                         Shape{.dq = false}, Shape{.T = 300, .dout = false}}) {
    const Planned r = plan_for(s);
    EXPECT_EQ(r.plan.state_grads_by_values, 0) << "T" << s.T << " dv " << s.dv << " do " << s.dout << " scale " << s.scale;
    EXPECT_EQ(r.plan.reversed_pad_front, 0);
    EXPECT_EQ(r.plan.reversed_final, 0u);
  }
  // Lengths that are not multiples of 64: padded, on the warp-specialised kernels only.
  for (const Shape& s : {Shape{.T = 300}, Shape{.T = 65}, Shape{.T = 1000, .K = 256, .V = 512}, Shape{.T = 100, .K = 64, .V = 64}}) {
    const Planned r = plan_for(s);
    ASSERT_TRUE(cuda::is_warp_specialised(r.plan.values.kernel)) << "T" << s.T << " K" << s.K;
    EXPECT_EQ(r.plan.state_grads_by_values, 1) << "T" << s.T << " K" << s.K;
    EXPECT_EQ(r.plan.reversed_pad_front, 1) << "T" << s.T << " K" << s.K;
    EXPECT_EQ(cuda::backward::reversed_forward(r.p, r.plan, nullptr).pad_front, 1);
  }
  const Planned varlen = plan_for({.B = 1, .T = 1000}, {0, 64, 1000});
  EXPECT_EQ(varlen.plan.state_grads_by_values, 1);
  EXPECT_EQ(varlen.plan.reversed_pad_front, 1);
  EXPECT_GT(varlen.plan.reversed_chunk_first, 0u);
  expect_layout(varlen);
  // Rows that cp.async cannot move run the single-role kernel, which does not pad: the reverse
  // walks stay where the lengths are not multiples of 64.
  for (const int64_t T : {300, 256}) {
    const Shape s{.T = T, .K = 100, .V = 36};
    std::vector<int64_t> offsets;
    for (int64_t n = 0; n <= s.B; ++n) offsets.push_back(n * s.T);
    BackwardParams p = params(s, {});
    p.vector_loads = 0;
    const BackwardPlan single_role = cuda::plan_backward(p, offsets.data(), kSms);
    EXPECT_EQ(single_role.values.kernel, cuda::ForwardKernel::kChunk);
    EXPECT_EQ(single_role.state_grads_by_values, T % 64 == 0 ? 1 : 0) << "T" << T;  // aligned: any chunk kernel
    EXPECT_EQ(single_role.reversed_pad_front, 0);
  }
  // Only dh0 wanted still needs them.
  EXPECT_EQ(plan_for({.dh0 = true, .dq = false}).plan.state_grads_by_values, 1);
  // K = 384: the reversed forward is the recurrent kernel, which stores no chunk states.
  const Planned wide = plan_for({.K = 384, .V = 64});
  EXPECT_FALSE(cuda::is_chunk(wide.plan.values.kernel));
  EXPECT_EQ(wide.plan.state_grads_by_values, 0);
  const Planned with_dh0 = plan_for({.dht = true, .dh0 = true});
  EXPECT_GT(with_dh0.plan.reversed_final, 0u);
  expect_layout(with_dh0);
  EXPECT_EQ(plan_for({.dht = true}).plan.reversed_final, 0u);
}

// Reversed chunk r of the reversed forward's sequence n' lands on the state gradient of original
// chunk NC - 1 - r of its sequence, by ForwardParams::chunk_states' formula (P = n' ceil(T / 64)
// without varlen; with varlen P = chunk_first[n'], the chunks of the reversed sequences before n',
// which launch_chunk_first writes on the device and this test counts on the host).
TEST(CudaBackwardPlan, ReversedForwardStoresEachChunkInTheOriginalsSlot) {
  struct Layout {
    Shape s;
    std::vector<int64_t> cu;
  };
  for (const Layout& l : {Layout{{.B = 3, .T = 256, .H = 2, .K = 64, .V = 32, .dh0 = true}, {}},
                          Layout{{.B = 1, .T = 640, .H = 2, .K = 64, .V = 32}, {0, 0, 128, 128, 192, 640}},
                          Layout{{.B = 3, .T = 300, .H = 2, .K = 64, .V = 32, .dh0 = true}, {}},
                          Layout{{.B = 1, .T = 700, .H = 2, .K = 64, .V = 32}, {0, 0, 1, 130, 130, 192, 700}}}) {
    const Planned r = plan_for(l.s, l.cu);
    ASSERT_EQ(r.plan.state_grads_by_values, 1);
    std::vector<char> workspace(1);
    char* ws = workspace.data();
    const cuda::ForwardParams f = cuda::backward::reversed_forward(r.p, r.plan, ws);
    ASSERT_NE(f.chunk_states, nullptr);
    EXPECT_EQ(f.chunk_states_stride[2], r.p.K * r.p.V);
    EXPECT_EQ(f.chunk_states_stride[3], r.p.V);
    if (l.s.dh0) {
      EXPECT_EQ(static_cast<void*>(f.final_state), static_cast<void*>(ws + r.plan.reversed_final));
    }
    const int64_t chunk = r.p.H * r.p.K * r.p.V;
    const uint16_t* grads = reinterpret_cast<const uint16_t*>(ws + r.plan.state_grads);
    std::vector<int64_t> offsets = l.cu, first_chunk = {0};
    if (offsets.empty()) {
      for (int64_t n = 0; n <= r.p.N; ++n) offsets.push_back(n * r.p.T);
    }
    auto chunks_of = [&](int64_t n) { return (offsets[n + 1] - offsets[n] + 63) / 64; };
    for (int64_t n = 0; n < r.p.N; ++n) first_chunk.push_back(first_chunk.back() + chunks_of(n));
    std::vector<int> hits(static_cast<size_t>(r.p.num_chunks), 0);
    int64_t reversed_first = 0;  // the chunks of the reversed sequences before rn
    for (int64_t rn = 0; rn < r.p.N; ++rn) {  // the reversed forward's sequence rn
      const int64_t n = l.cu.empty() ? rn : r.p.N - 1 - rn;  // the original sequence
      const int64_t nc = chunks_of(n);
      const int64_t slot0 = l.cu.empty() ? rn * ((f.T + 63) / 64) : reversed_first;
      EXPECT_EQ(f.chunk_first != nullptr, !l.cu.empty());
      for (int64_t rc = 0; rc < nc; ++rc) {
        const uint16_t* at = f.chunk_states + slot0 * f.chunk_states_stride[0] + rc * f.chunk_states_stride[1];
        const int64_t c = nc - 1 - rc;
        EXPECT_EQ(at, grads + (first_chunk[n] + c) * chunk) << "sequence " << n << " chunk " << c;
        ++hits[static_cast<size_t>(first_chunk[n] + c)];
      }
      reversed_first += nc;
    }
    for (int h : hits) EXPECT_EQ(h, 1);
  }
}

// A prepared key split in the reversed forward (K 256, V 512: four value tiles) writes its qg and kg
// into dq and dk when both are [B, T, H, K] contiguous and 16-byte aligned (the dq/dk kernel writes
// them last): the workspace then holds only the decays. Otherwise the workspace holds them too.
TEST(CudaBackwardPlan, ReversedForwardPreparesItsInputsInDqDk) {
  const Shape s{.B = 2, .T = 256, .H = 2, .K = 256, .V = 512};
  std::vector<int64_t> so;
  for (int64_t n = 0; n <= s.B; ++n) so.push_back(n * s.T);
  BackwardParams p = params(s, {});
  p.dk = const_cast<void*>(fake(0xa0000000));
  ASSERT_TRUE(cuda::backward::gradients_hold_prepared(p));
  const BackwardPlan placed = cuda::plan_backward(p, so.data(), kSms);
  ASSERT_EQ(placed.values.prepared, 1);
  const cuda::ForwardParams f = cuda::backward::reversed_forward(p, placed, nullptr);
  EXPECT_EQ(static_cast<void*>(f.prepared_qg), p.dq);
  EXPECT_EQ(static_cast<void*>(f.prepared_kg), p.dk);
  const size_t inputs = size_t(s.B * s.T * s.H * s.K) * 2 * 2;
  BackwardParams no_dk = p;
  no_dk.dk = nullptr;
  BackwardParams strided = p;
  strided.dk_stride[1] = 2 * s.H * s.K;
  BackwardParams unaligned = p;
  unaligned.dq = static_cast<char*>(unaligned.dq) + 2;
  for (const BackwardParams& other : {no_dk, strided, unaligned}) {
    EXPECT_FALSE(cuda::backward::gradients_hold_prepared(other));
    EXPECT_EQ(cuda::backward::reversed_forward(other, placed, nullptr).prepared_qg, nullptr);
    const BackwardPlan own = cuda::plan_backward(other, so.data(), kSms);
    EXPECT_EQ(own.values.workspace_bytes, placed.values.workspace_bytes + inputs);
  }
}

}  // namespace
}  // namespace gla::test

#endif  // GLA_TESTS_WITH_CUDA
