// The `cpu` backend against the `reference` backend (both forced, through the public C API) on the
// SPEC.md §5 grid, plus what the grid does not cover: strided inputs, determinism across thread
// counts, every instruction-set path, scratch that was never written, and stage-by-stage mixing
// with the reference stages.
//
// Sizes: fp32 runs the grid's shapes at full size (the reference, a token loop, sets the cost: about
// a minute on 2 cores). The 16-bit dtypes share every code path but the loads and stores, so they
// run the same shape classes with T trimmed to <= 320 (and B, H trimmed on the biggest shapes).
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "test_support.hpp"

using namespace gla::test;

namespace {

bool cpu_available() { return backend_available("cpu"); }

Case make_case(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, double n, int32_t dtype, uint64_t seed) {
  Case c;
  c.B = B, c.T = T, c.H = H, c.K = K, c.V = V, c.normaliser = n, c.dtype = dtype, c.seed = seed;
  return c;
}

// The grid of SPEC.md §5 for one dtype (see the header comment for the 16-bit trimming).
std::vector<Case> cpu_grid(int32_t dtype) {
  const bool full = dtype == GLA_DTYPE_F32;
  const auto T = [&](int64_t t) { return full ? t : std::min<int64_t>(t, 320); };
  std::vector<Case> cases;
  uint64_t seed = 1000 + 100 * static_cast<uint64_t>(dtype);
  const auto add = [&](Case c) {
    c.seed = seed++;
    cases.push_back(c);
  };
  add(make_case(1, 63, 1, 64, 64, 1, dtype, 0));
  add(make_case(2, T(1024), 4, 60, 60, 1, dtype, 0));
  for (double n : {0.1, 1.0, 10.0}) add(make_case(2, T(1024), full ? 8 : 2, 128, 128, n, dtype, 0));
  add(make_case(full ? 4 : 2, T(2048), full ? 8 : 2, 64, 64, 1, dtype, 0));
  add(make_case(1, 128, 4, 256, 256, 1, dtype, 0));
  add(make_case(1, 64, 2, 320, 320, 1, dtype, 0));
  add(make_case(1, 128, full ? 4 : 1, 512, 512, 1, dtype, 0));
  for (const auto& cu : {std::vector<int64_t>{0, 15}, {0, 0, 16}, {0, 256, 500, 1000}, {0, 15, 100, 300, 1200, 2000},
                         {0, 0, 1, 1, 65, 130, 130, 131}}) {
    for (int64_t D : {64, 100}) {
      Case c = make_case(1, cu.back(), 2, D, D, 1, dtype, 0);
      c.cu_seqlens = cu;
      add(c);
    }
  }
  {
    Case c = make_case(2, 256, 4, 64, 64, 1, dtype, 0);
    c.state_v_first = true;
    add(c);
    c = make_case(2, T(1024), full ? 4 : 2, 128, 128, 1, dtype, 0);
    c.state_v_first = true;
    add(c);
  }
  add(make_case(1, 300, 2, 32, 96, 1, dtype, 0));   // K < V
  add(make_case(1, 200, 2, 200, 48, 1, dtype, 0));  // K > V, K not a multiple of 16
  add(make_case(1, 100, 3, 1, 1, 1, dtype, 0));     // K = V = 1
  add(make_case(1, 70, 1, 3, 130, 1, dtype, 0));    // V > one value tile, odd widths
  add(make_case(1, 90, 2, 24, 300, 1, dtype, 0));   // three value tiles
  {
    Case c = make_case(2, 150, 2, 80, 48, 1, dtype, 0);
    c.initial_state = false;
    c.final_state = false;
    add(c);
    c.initial_state = true;
    add(c);
    c.initial_state = false;
    c.final_state = true;
    add(c);
  }
  {
    Case c = make_case(2, T(512), 2, 64, 64, 1, dtype, 0);
    c.randn_inputs = true;
    add(c);
    c = make_case(2, T(512), 2, 128, 128, 0.1, dtype, 0);
    c.gate_floor = -20;  // strong decay: n = 0.1 and every 7th gate at -20
    add(c);
    c.randn_inputs = true;
    add(c);
  }
  {
    Case c = make_case(2, 300, 2, 64, 48, 1, dtype, 0);
    c.per_head_gate = true;
    add(c);
    c.cu_seqlens = {0, 0, 1, 77, 300};
    c.B = 1;
    add(c);
    c = make_case(1, 200, 2, 96, 96, 0.1, dtype, 0);
    c.per_head_gate = true;
    c.gate_floor = -20;
    add(c);
  }
  if (!full) {
    for (Case c : {make_case(2, 200, 2, 64, 64, 1, dtype, 0), make_case(1, 150, 2, 128, 100, 0.1, dtype, 0)}) {
      c.gate_f32 = true;
      add(c);
    }
  }
  return cases;
}

struct Result {
  Outputs out;
  gla_status fwd = GLA_STATUS_INTERNAL_ERROR, bwd = GLA_STATUS_INTERNAL_ERROR;
};

Result run_both(const Inputs& in, const RunOptions& options) {
  Result r;
  r.fwd = run_forward(in, r.out, options);
  r.bwd = run_backward(in, r.out, options);
  return r;
}

// Every output the call should have written is finite (outputs start as NaN).
void expect_all_written(const Outputs& out, const std::string& label) {
  for (const HostTensor* t : {&out.o, &out.ht, &out.dq, &out.dk, &out.dv, &out.dg, &out.dh0}) {
    if (!t->empty()) {
      EXPECT_TRUE(all_finite(*t)) << label << ": an output element was not written (or is not finite)";
    }
  }
}

void compare(const Result& got, const Result& want, int32_t dtype, const std::string& label, bool print) {
  ASSERT_EQ(got.fwd, GLA_STATUS_OK) << label << ": " << gla_last_error();
  ASSERT_EQ(got.bwd, GLA_STATUS_OK) << label << ": " << gla_last_error();
  ASSERT_EQ(want.fwd, GLA_STATUS_OK) << label;
  ASSERT_EQ(want.bwd, GLA_STATUS_OK) << label;
  expect_all_written(got.out, label);
  std::string fwd_report, bwd_report;
  const double fwd = max_error(got.out, want.out, false, fwd_report);
  const double bwd = max_error(got.out, want.out, true, bwd_report);
  const double tol = host_tolerance(dtype);
  EXPECT_LT(fwd, tol) << label << " forward: " << fwd_report;
  EXPECT_LT(bwd, tol) << label << " backward: " << bwd_report;
  if (print) std::cout << "[cpu vs reference] " << label << " | " << fwd_report << bwd_report << "\n";
}

class CpuGrid : public ::testing::TestWithParam<int32_t> {};

TEST_P(CpuGrid, MatchesReference) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  ScopedEnv poison("GLA_CPU_POISON_SCRATCH", "1");
  const int32_t dtype = GetParam();
  for (const Case& c : cpu_grid(dtype)) {
    const Inputs in = make_inputs(c);
    const Result want = run_both(in, {"reference"});
    const Result got = run_both(in, {"cpu"});
    compare(got, want, dtype, c.label(), true);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuGrid, ::testing::Values(GLA_DTYPE_F32, GLA_DTYPE_F16, GLA_DTYPE_BF16),
                         [](const ::testing::TestParamInfo<int32_t>& info) {
                           return std::string(gla::dtype_name(info.param));
                         });

TEST(CpuBackend, StridedInputsAndStates) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  for (bool per_head : {false, true}) {
    Case c = make_case(2, 150, 3, 40, 24, 1, GLA_DTYPE_F32, 7);
    c.per_head_gate = per_head;
    const Inputs in = make_inputs(c);
    Inputs strided = in;
    for (HostTensor* t : {&strided.q, &strided.k, &strided.v, &strided.dout, &strided.h0, &strided.dht}) *t = strided_copy(*t);
    if (!per_head) strided.g = strided_copy(strided.g);
    const Result want = run_both(in, {"reference"});
    const Result got = run_both(strided, {"cpu"});
    compare(got, want, GLA_DTYPE_F32, "strided " + c.label(), false);
  }
}

TEST(CpuBackend, DeterministicAcrossThreadCounts) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  for (Case c : {make_case(2, 300, 3, 64, 200, 1, GLA_DTYPE_F32, 11), make_case(1, 700, 2, 48, 40, 0.1, GLA_DTYPE_BF16, 12)}) {
    if (c.dtype == GLA_DTYPE_BF16) c.cu_seqlens = {0, 5, 5, 200, 201, 700};
    const Inputs in = make_inputs(c);
    std::vector<Result> results;
    for (const char* threads : {"1", "2", "3", "7"}) {
      ScopedEnv env("GLA_NUM_THREADS", threads);
      results.push_back(run_both(in, {"cpu"}));
      ASSERT_EQ(results.back().fwd, GLA_STATUS_OK) << gla_last_error();
      ASSERT_EQ(results.back().bwd, GLA_STATUS_OK) << gla_last_error();
    }
    for (size_t i = 1; i < results.size(); ++i) {
      const Outputs& a = results[0].out;
      const Outputs& b = results[i].out;
      const std::pair<const HostTensor*, const HostTensor*> pairs[] = {{&a.o, &b.o},   {&a.ht, &b.ht}, {&a.dq, &b.dq},
                                                                       {&a.dk, &b.dk}, {&a.dv, &b.dv}, {&a.dg, &b.dg},
                                                                       {&a.dh0, &b.dh0}};
      for (const auto& [x, y] : pairs) {
        ASSERT_EQ(x->bytes.size(), y->bytes.size());
        EXPECT_EQ(0, std::memcmp(x->bytes.data(), y->bytes.data(), x->bytes.size()))
            << c.label() << ": outputs differ between thread counts";
      }
    }
  }
}

// The AVX2 and portable kernels (chosen automatically on CPUs without AVX-512) on this machine.
TEST(CpuBackend, EveryInstructionSetPath) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  ScopedEnv poison("GLA_CPU_POISON_SCRATCH", "1");
  for (const char* isa : {"avx2", "portable"}) {
    ScopedEnv env("GLA_CPU_ISA", isa);
    for (Case c : {make_case(2, 150, 2, 40, 24, 1, GLA_DTYPE_F32, 21), make_case(1, 200, 2, 100, 130, 0.1, GLA_DTYPE_F32, 22),
                   make_case(1, 130, 2, 64, 64, 1, GLA_DTYPE_F16, 23)}) {
      if (c.K == 100) {
        c.gate_floor = -20;
        c.cu_seqlens = {0, 1, 1, 64, 200};
      }
      if (c.dtype == GLA_DTYPE_F16) c.per_head_gate = true;
      const Inputs in = make_inputs(c);
      compare(run_both(in, {"cpu"}), run_both(in, {"reference"}), c.dtype, std::string(isa) + " " + c.label(), false);
    }
  }
}

// One thread: whole operations walk groups of up to 4 heads together (the grouping depends on the
// thread count); every case here has N * H >= 8 so groups form, with the options that interact
// with them.
TEST(CpuBackend, HeadGroupsAtOneThread) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  ScopedEnv threads("GLA_NUM_THREADS", "1");
  ScopedEnv poison("GLA_CPU_POISON_SCRATCH", "1");
  std::vector<Case> cases;
  Case c = make_case(1, 200, 6, 48, 40, 1, GLA_DTYPE_F32, 61);
  c.per_head_gate = true;
  cases.push_back(c);
  c = make_case(1, 300, 5, 64, 160, 0.1, GLA_DTYPE_BF16, 62);  // two value tiles, 5 heads: groups of 4 + 1
  c.cu_seqlens = {0, 0, 1, 100, 300};
  c.gate_floor = -20;
  cases.push_back(c);
  c = make_case(2, 130, 4, 32, 32, 1, GLA_DTYPE_F16, 63);
  c.state_v_first = true;
  c.gate_f32 = true;
  cases.push_back(c);
  for (const Case& x : cases) {
    const Inputs in = make_inputs(x);
    compare(run_both(in, {"cpu"}), run_both(in, {"reference"}), x.dtype, "one thread " + x.label(), false);
  }
}

// Stage mixing: each stage unit once on cpu inside an otherwise-reference pipeline, and once on the
// reference inside an otherwise-cpu pipeline; both must match the reference whole operation.
TEST(CpuBackend, StagesMixWithReferenceStages) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  ScopedEnv poison("GLA_CPU_POISON_SCRATCH", "1");
  const char* stages[] = {"cumsum", "fwd_h", "fwd_intra", "fwd_o", "bwd_dh", "bwd_dv", "bwd_dA", "bwd_dqk_intra", "bwd_dqkg"};
  std::vector<Case> cases;
  cases.push_back(make_case(2, 150, 2, 40, 24, 1, GLA_DTYPE_F32, 31));
  Case varlen = make_case(1, 300, 2, 72, 20, 0.1, GLA_DTYPE_F32, 32);
  varlen.per_head_gate = true;
  varlen.cu_seqlens = {0, 0, 1, 64, 65, 300};
  varlen.gate_floor = -20;
  cases.push_back(varlen);
  Case vfirst = make_case(1, 100, 1, 32, 48, 1, GLA_DTYPE_BF16, 33);
  vfirst.state_v_first = true;
  vfirst.gate_f32 = true;
  cases.push_back(vfirst);
  for (const Case& c : cases) {
    const Inputs in = make_inputs(c);
    const Result want = run_both(in, {"reference"});
    // every stage on cpu
    RunOptions all_cpu{"cpu", true};
    compare(run_both(in, all_cpu), want, c.dtype, "cpu stage pipeline " + c.label(), false);
    for (const char* stage : stages) {
      RunOptions one_cpu{std::string("reference,") + stage + "=cpu", true};
      compare(run_both(in, one_cpu), want, c.dtype, std::string(stage) + "=cpu in reference pipeline " + c.label(), false);
      RunOptions one_ref{std::string("cpu,") + stage + "=reference", true};
      compare(run_both(in, one_ref), want, c.dtype, std::string(stage) + "=reference in cpu pipeline " + c.label(), false);
    }
  }
}

// Gradients asked for one at a time: the backward computes what it needs internally.
TEST(CpuBackend, PartialGradientRequests) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  Case c = make_case(1, 200, 2, 48, 32, 1, GLA_DTYPE_F32, 41);
  const Inputs in = make_inputs(c);
  Outputs full;
  ASSERT_EQ(run_backward(in, full, {"reference"}), GLA_STATUS_OK);
  const char* names[] = {"dq", "dk", "dv", "dg", "dh0"};
  for (int which = 0; which < 5; ++which) {
    Outputs out;
    out.dq = HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, c.K});
    out.dk = HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, c.K});
    out.dv = HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, c.V});
    out.dg = HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, c.K});
    out.dh0 = HostTensor(GLA_DTYPE_F32, {in.N, c.H, c.K, c.V});
    HostTensor* all[] = {&out.dq, &out.dk, &out.dv, &out.dg, &out.dh0};
    const HostTensor* ref[] = {&full.dq, &full.dk, &full.dv, &full.dg, &full.dh0};
    poison(*all[which]);
    gla_chunk_backward_args a{};
    a.q = in.q.desc(), a.k = in.k.desc(), a.v = in.v.desc(), a.g = in.g.desc(), a.initial_state = in.h0.desc();
    a.do_ = in.dout.desc(), a.dht = in.dht.desc();
    const gla_tensor* target = all[which]->desc();
    a.dq = which == 0 ? target : nullptr;
    a.dk = which == 1 ? target : nullptr;
    a.dv = which == 2 ? target : nullptr;
    a.dg = which == 3 ? target : nullptr;
    a.dh0 = which == 4 ? target : nullptr;
    gla_options o;
    gla_options_init(&o);
    o.backend = "cpu";
    ASSERT_EQ(gla_chunk_backward(&a, &o), GLA_STATUS_OK) << gla_last_error();
    EXPECT_LT(rel_rms(*all[which], *ref[which]), 1e-5) << names[which] << " alone";
  }
}

TEST(CpuBackend, IsTheDefaultOnHostMemory) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not built";
  const Inputs in = make_inputs(make_case(1, 64, 1, 16, 16, 1, GLA_DTYPE_F32, 51));
  gla_chunk_forward_args a{};
  a.q = in.q.desc(), a.k = in.k.desc(), a.v = in.v.desc(), a.g = in.g.desc();
  Outputs out;
  out.o = HostTensor(GLA_DTYPE_F32, {1, 64, 1, 16});
  a.o = out.o.desc();
  const char* text = nullptr;
  ASSERT_EQ(gla_explain(&a, nullptr, nullptr, &text), GLA_STATUS_OK) << gla_last_error();
  EXPECT_NE(std::string(text).find("cpu"), std::string::npos) << text;
}

}  // namespace
