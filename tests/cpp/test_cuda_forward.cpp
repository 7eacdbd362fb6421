// The cuda backend's chunk forward against the reference backend, through the public C API with
// tensors in CUDA memory: the SPEC.md §5 grid, varlen with empty and length-1 sequences, long
// sequences (segment split), strong decay, both state layouts, fp32 gates and per-head gates.
// Outputs are NaN-poisoned before every call, so an unwritten element fails the comparison.
// Skips with a message where no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "test_support.hpp"

#ifdef GLA_TESTS_WITH_CUDA
#include "cuda_test_support.hpp"
#endif

namespace gla::test {
namespace {

#ifdef GLA_TESTS_WITH_CUDA

struct CudaRun {
  gla_status status;
  std::string error;
  Outputs out;
};

// Runs the forward on the cuda backend (forced) with device tensors; copies outputs back.
CudaRun run_cuda(const Inputs& in, bool host_offsets = true) {
  const Case& c = in.c;
  CudaRun r;
  r.out.o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  if (c.final_state) {
    r.out.ht = HostTensor(GLA_DTYPE_F32, c.state_v_first ? std::vector<int64_t>{in.N, c.H, c.V, c.K}
                                                         : std::vector<int64_t>{in.N, c.H, c.K, c.V});
  }
  DeviceTensor q(in.q), k(in.k), v(in.v), g(in.g);
  DeviceTensor o(r.out.o, false);
  std::unique_ptr<DeviceTensor> h0, ht, cu;
  if (!in.h0.empty()) h0 = std::make_unique<DeviceTensor>(in.h0);
  if (c.final_state) ht = std::make_unique<DeviceTensor>(r.out.ht, false);
  if (!in.cu.empty()) cu = std::make_unique<DeviceTensor>(in.cu);
  gla_chunk_forward_args a{};
  a.q = &q.t;
  a.k = &k.t;
  a.v = &v.t;
  a.g = &g.t;
  a.initial_state = h0 ? &h0->t : nullptr;
  a.cu_seqlens = cu ? &cu->t : nullptr;
  a.cu_seqlens_host = (cu && host_offsets) ? in.cu.desc() : nullptr;
  a.o = &o.t;
  a.final_state = ht ? &ht->t : nullptr;
  gla_options opt;
  gla_options_init(&opt);
  opt.state_v_first = c.state_v_first;
  opt.backend = "cuda";
  r.status = gla_chunk_forward(&a, &opt);
  r.error = gla_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o.to_host(r.out.o);
  if (ht) ht->to_host(r.out.ht);
  return r;
}

double tolerance(int32_t dtype) { return dtype == GLA_DTYPE_F32 ? 1e-3 : 5e-3; }

void check_inputs(const Inputs& in, bool host_offsets = true) {
  SCOPED_TRACE(in.c.label());
  const Case& c = in.c;
  Outputs ref;
  ASSERT_EQ(run_forward(in, ref, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
  CudaRun got = run_cuda(in, host_offsets);
  ASSERT_EQ(got.status, GLA_STATUS_OK) << got.error;
  std::string report;
  const double err = max_error(got.out, ref, false, report);
  EXPECT_TRUE(all_finite(got.out.o)) << "unwritten or non-finite o";
  if (!got.out.ht.empty()) {
    EXPECT_TRUE(all_finite(got.out.ht)) << "unwritten or non-finite final state";
  }
  EXPECT_LT(err, tolerance(c.dtype)) << report;
}

void check_case(const Case& c, bool host_offsets = true) { check_inputs(make_inputs(c), host_offsets); }

class CudaForwardGrid : public ::testing::TestWithParam<int32_t> {};

TEST_P(CudaForwardGrid, SpecGridMatchesReference) {
  SKIP_WITHOUT_CUDA();
  for (Case c : spec_grid_cases(GetParam())) check_case(c);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaForwardGrid,
                         ::testing::Values(GLA_DTYPE_BF16, GLA_DTYPE_F16, GLA_DTYPE_F32),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaForward, FullLengthShapes) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (double n : {0.1, 1.0, 10.0}) {
      Case c = base_case(dt, 2, 1024, 2, 128);
      c.normaliser = n;
      check_case(c);
    }
    check_case(base_case(dt, 2, 2048, 2, 64));
    check_case(base_case(dt, 1, 128, 2, 256));
  }
}

TEST(CudaForward, StrongDecayAndRandn) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (const Case& c : decay_and_randn_cases(dt)) check_case(c);
  }
}

TEST(CudaForward, GateVariantsAndLayouts) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 2, 300, 2, 128);
  c.gate_f32 = true;
  check_case(c);
  c.per_head_gate = true;
  check_case(c);
  c.gate_f32 = false;
  check_case(c);
  c.per_head_gate = false;
  c.state_v_first = true;
  check_case(c);
  Case d = base_case(GLA_DTYPE_BF16, 2, 1024, 2, 128);
  d.state_v_first = true;
  check_case(d);
  Case e = base_case(GLA_DTYPE_F16, 2, 256, 2, 64);
  e.state_v_first = true;
  check_case(e);
}

TEST(CudaForward, KNotEqualV) {
  SKIP_WITHOUT_CUDA();
  for (auto kv : {std::pair<int64_t, int64_t>{64, 128}, {128, 64}, {100, 36}, {128, 256}, {32, 200}}) {
    Case c = base_case(GLA_DTYPE_BF16, 1, 333, 2, 64);
    c.K = kv.first;
    c.V = kv.second;
    check_case(c);
  }
  Case n = base_case(GLA_DTYPE_BF16, 1, 333, 2, 64);
  n.initial_state = false;
  n.final_state = false;
  check_case(n);
}

TEST(CudaForward, VarlenEmptyAndSingleTokenSequences) {
  SKIP_WITHOUT_CUDA();
  const std::vector<std::vector<int64_t>> cus = {
      {0, 15}, {0, 0, 16}, {0, 256, 500, 1000}, {0, 15, 100, 300, 1200, 2000},
      {0, 1, 1, 2, 3000, 3000, 3001, 9000}};
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (const auto& cu : cus) {
      for (int64_t D : {64, 100, 128}) {
        Case c = base_case(dt, 1, cu.back(), 2, D);
        c.cu_seqlens = cu;
        check_case(c);
      }
    }
  }
  // Without a host copy of cu_seqlens the dispatcher copies it (one host synchronisation).
  Case c = base_case(GLA_DTYPE_BF16, 1, 2000, 2, 64);
  c.cu_seqlens = {0, 15, 100, 300, 1200, 2000};
  check_case(c, /*host_offsets=*/false);
}

TEST(CudaForward, LongSequencesSplitIntoSegments) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 1, 65536 + 37, 1, 64);
  check_case(c);
  Case d = base_case(GLA_DTYPE_BF16, 1, 20000, 1, 128);
  d.state_v_first = true;
  check_case(d);
}

// Hard resets (g = -inf) in sequences long enough for the segment split, whose first pass forms the
// segment's local state: every kernel that runs that pass (the chunk kernel for unaligned rows and
// for an fp32 per-key gate, the warp-specialised kernel for aligned rows and a 16-bit gate). A
// reset hits every key of some tokens, single keys of others, and the chunks' first and last rows.
TEST(CudaForward, HardResetsInSegmentSplitSequences) {
  SKIP_WITHOUT_CUDA();
  Case unaligned = base_case(GLA_DTYPE_BF16, 1, 8192 + 37, 1, 4);
  Case fp32_gate = base_case(GLA_DTYPE_BF16, 1, 8192 + 37, 1, 64);
  fp32_gate.gate_f32 = true;
  Case aligned = base_case(GLA_DTYPE_BF16, 1, 8192 + 37, 1, 64);
  for (Case c : {unaligned, fp32_gate, aligned}) {
    c.normaliser = 100;  // weak decay: the state carries across segments
    Inputs in = make_inputs(c);
    const double inf = std::numeric_limits<double>::infinity();
    for (int64_t t = 0; t < c.T; ++t) {
      const bool all_keys = t % 1237 == 5 || t % 4096 == 0 || t % 4096 == 63;
      for (int64_t i = 0; i < c.K; ++i) {
        if (all_keys || (t % 301 == 17 && i % 3 == 0)) in.g.set(t * c.K + i, -inf);
      }
    }
    check_inputs(in);
  }
}

// 128 < K <= 256: A over all keys, then the chunk kernel once per key half (ForwardPlan::key_split).
// The state's key rows split too: both layouts, with and without states.
TEST(CudaForward, WideKeysRunAsTwoHalves) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    check_case(base_case(dt, 2, 1024, 2, 256));
    Case s = base_case(dt, 1, 700, 2, 256);
    s.normaliser = 0.1;
    s.gate_floor = -20;
    check_case(s);
  }
  for (auto kv : {std::pair<int64_t, int64_t>{192, 64}, {256, 128}, {136, 200}, {200, 100}, {256, 32}, {129, 65}}) {
    Case c = base_case(GLA_DTYPE_BF16, 1, 333, 2, 64);
    c.K = kv.first;
    c.V = kv.second;
    check_case(c);
  }
  Case v = base_case(GLA_DTYPE_BF16, 2, 300, 2, 256);
  v.state_v_first = true;
  check_case(v);
  v.gate_f32 = true;
  check_case(v);
  v.gate_f32 = false;
  v.per_head_gate = true;
  check_case(v);
  Case n = base_case(GLA_DTYPE_F16, 1, 333, 2, 256);
  n.initial_state = false;
  n.final_state = false;
  check_case(n);
  Case r = base_case(GLA_DTYPE_BF16, 1, 500, 2, 256);
  r.randn_inputs = true;
  check_case(r);
  Case var = base_case(GLA_DTYPE_BF16, 1, 3001, 2, 256);
  var.cu_seqlens = {0, 1, 1, 2, 3000, 3001};
  check_case(var);
  Case lng = base_case(GLA_DTYPE_BF16, 1, 20000, 1, 256);  // segments: both passes per half
  check_case(lng);
}

// The key split's rows where q . k cancels between the key halves: the first token of each
// sequence and head has q's second half equal to its first and k's second half the negative of
// its first plus a small same-signed part, so A[0,0] (o's row 0, with no initial state) is ~1/40
// of either half's. A formed per half and summed (each half rounded to 16 bits) is off there by
// several percent; A over all keys rounded once is within bf16 rounding. Every gate variant and
// both kernels of the split (bf16 gate: warp-specialised; fp32 or unaligned: single-role).
TEST(CudaForward, WideKeysRowsWhereHalvesCancel) {
  SKIP_WITHOUT_CUDA();
  for (int variant = 0; variant < 4; ++variant) {
    Case c = base_case(GLA_DTYPE_BF16, 2, 200, 2, 256);
    c.V = variant == 3 ? 100 : 128;  // V = 100: element-wise loads (no 16-byte rows)
    c.randn_inputs = true;
    c.initial_state = false;
    c.gate_f32 = variant == 1;
    c.per_head_gate = variant == 2;
    SCOPED_TRACE(c.label());
    Inputs in = make_inputs(c);
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t row = ((b * c.T + 0) * c.H + h) * c.K;  // token 0
        for (int64_t i = 0; i < 128; ++i) {
          const double q = in.q.get(row + i), k = in.k.get(row + i);
          in.q.set(row + 128 + i, q);
          in.k.set(row + 128 + i, -k + (q >= 0 ? 1.0 : -1.0) * std::abs(k) / 64.0);
        }
      }
    }
    Outputs ref;
    ASSERT_EQ(run_forward(in, ref, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
    CudaRun got = run_cuda(in);
    ASSERT_EQ(got.status, GLA_STATUS_OK) << got.error;
    double worst = 0.0;
    for (int64_t b = 0; b < c.B; ++b) {
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t row = ((b * c.T + 0) * c.H + h) * c.V;
        double err = 0.0, norm = 0.0;
        for (int64_t j = 0; j < c.V; ++j) {
          const double d = got.out.o.get(row + j) - ref.o.get(row + j);
          err += d * d;
          norm += ref.o.get(row + j) * ref.o.get(row + j);
        }
        worst = std::max(worst, std::sqrt(err / norm));
      }
    }
    std::printf("[ row 0 ] %s: worst relative error of o's first row %.3g\n", c.label().c_str(), worst);
    EXPECT_LT(worst, 1e-2);
    std::string report;
    EXPECT_LT(max_error(got.out, ref, false, report), tolerance(c.dtype)) << report;
  }
}

TEST(CudaForward, Deterministic) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 1, 9000, 2, 128);
  const Inputs in = make_inputs(c);
  CudaRun a = run_cuda(in), b = run_cuda(in);
  ASSERT_EQ(a.status, GLA_STATUS_OK) << a.error;
  EXPECT_EQ(a.out.o.bytes, b.out.o.bytes);
  EXPECT_EQ(a.out.ht.bytes, b.out.ht.bytes);
}

TEST(CudaForward, DeclinesStridedLastDim) {
  SKIP_WITHOUT_CUDA();
  const char* text = nullptr;
  Case c = base_case(GLA_DTYPE_BF16, 1, 64, 1, 64);
  const Inputs in = make_inputs(c);
  DeviceTensor q(in.q), k(in.k), v(in.v), g(in.g), o(HostTensor(c.dtype, {1, 64, 1, 64}), false);
  gla_tensor qs = q.t;  // same memory read with a non-unit last stride
  qs.sizes[3] = 32;
  qs.strides[3] = 2;
  gla_tensor ks = k.t, gs = g.t;
  ks.sizes[3] = 32;
  ks.strides[3] = 2;
  gs.sizes[3] = 32;
  gs.strides[3] = 2;
  gla_chunk_forward_args a{};
  a.q = &qs;
  a.k = &ks;
  a.v = &v.t;
  a.g = &gs;
  a.o = &o.t;
  gla_options opt;
  gla_options_init(&opt);
  ASSERT_EQ(gla_explain(&a, nullptr, &opt, &text), GLA_STATUS_OK) << gla_last_error();
  EXPECT_NE(std::string(text).find("contiguous last dimension"), std::string::npos) << text;
}

TEST(CudaForward, ExplainNamesTheKernel) {
  SKIP_WITHOUT_CUDA();
  const char* text = nullptr;
  // state_scales: the plan note says when the state group scales qg and kg (bf16 K = 128 whole,
  // no chunk states, one segment; docs/cuda_backend.md), and only then.
  for (const auto& [dtype, K, want, state_scales] :
       {std::tuple{GLA_DTYPE_BF16, int64_t(128), "warp-specialised chunk kernel (prep", true},
        std::tuple{GLA_DTYPE_F16, int64_t(128), "warp-specialised chunk kernel (prep", false},
        std::tuple{GLA_DTYPE_BF16, int64_t(64), "warp-specialised chunk kernel with element-wise items split two ways",
                   false},
        std::tuple{GLA_DTYPE_BF16, int64_t(256), "warp-specialised chunk kernel (prep", false},
        std::tuple{GLA_DTYPE_F32, int64_t(64), "recurrent kernel", false}}) {
    Case c = base_case(dtype, 1, 64, 1, K);
    const Inputs in = make_inputs(c);
    DeviceTensor q(in.q), k(in.k), v(in.v), g(in.g), o(HostTensor(c.dtype, {1, 64, 1, K}), false);
    gla_chunk_forward_args a{};
    a.q = &q.t;
    a.k = &k.t;
    a.v = &v.t;
    a.g = &g.t;
    a.o = &o.t;
    gla_options opt;
    gla_options_init(&opt);
    ASSERT_EQ(gla_explain(&a, nullptr, &opt, &text), GLA_STATUS_OK) << gla_last_error();
    const std::string s(text);
    EXPECT_NE(s.find("decision: cuda (whole operation)"), std::string::npos) << s;
    EXPECT_NE(s.find(std::string("plan in 'cuda': ") + want), std::string::npos) << s;
    EXPECT_EQ(s.find("K split into halves") != std::string::npos, K > 128) << s;
    EXPECT_EQ(s.find("the state group scales qg and kg") != std::string::npos, state_scales) << s;
  }
}

// The plan cache tells aligned from unaligned rows: after an aligned call of a shape, the same shape
// with q one element off a 16-byte boundary plans the single-role kernel (the warp-specialised one
// moves rows with cp.async), and the call matches the reference.
TEST(CudaForward, UnalignedRowsAfterAlignedShapeGetTheirOwnPlan) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 1, 192, 2, 128);
  c.initial_state = false;
  c.final_state = false;
  const Inputs in = make_inputs(c);
  Outputs ref;
  ASSERT_EQ(run_forward(in, ref, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
  DeviceTensor q(in.q), k(in.k), v(in.v), g(in.g);
  // q again, one bf16 element into a larger buffer: rows no longer 16-byte aligned.
  const size_t q_bytes = q.bytes;
  void* shifted = nullptr;
  ASSERT_EQ(cudaMalloc(&shifted, q_bytes + 16), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(static_cast<char*>(shifted) + 2, q.ptr, q_bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  gla_tensor q_unaligned = q.t;
  q_unaligned.data = static_cast<char*>(shifted) + 2;
  for (const auto& [qt, want] : {std::pair<const gla_tensor*, const char*>{&q.t, "warp-specialised chunk kernel (prep"},
                                 std::pair<const gla_tensor*, const char*>{&q_unaligned,
                                                                           "chunk kernel with tensor-core diagonal blocks"}}) {
    HostTensor o_host(c.dtype, {c.B, c.T, c.H, c.V});
    DeviceTensor o(o_host, false);
    gla_chunk_forward_args a{};
    a.q = qt;
    a.k = &k.t;
    a.v = &v.t;
    a.g = &g.t;
    a.o = &o.t;
    gla_options opt;
    gla_options_init(&opt);
    opt.backend = "cuda";
    const char* text = nullptr;
    ASSERT_EQ(gla_explain(&a, nullptr, &opt, &text), GLA_STATUS_OK) << gla_last_error();
    EXPECT_NE(std::string(text).find(std::string("plan in 'cuda': ") + want), std::string::npos) << text;
    ASSERT_EQ(gla_chunk_forward(&a, &opt), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    o.to_host(o_host);
    Outputs got;
    got.o = o_host;
    std::string report;
    EXPECT_LT(max_error(got, ref, false, report), 5e-3) << report;
  }
  cudaFree(shifted);
}

#else

TEST(CudaForward, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: GPU tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
