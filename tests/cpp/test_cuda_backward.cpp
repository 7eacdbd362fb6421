// The cuda backend's chunk backward against the reference backend, through the public C API with
// tensors in CUDA memory: the SPEC.md §5 grid for dq, dk, dv, dg and dh0, varlen with empty and
// length-1 sequences, K != V, strong and moderate decays, randn inputs, hard resets (g = -inf), both state layouts,
// both sources of the state gradients (the reverse walk; the reversed forward when lengths are
// multiples of 64), fp32 and per-head gates, absent do / dht / outputs, long sequences, bitwise reruns. Every output
// is NaN-poisoned before the call, so an unwritten element fails the comparison. Skips with a
// message where no CUDA device is present.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "test_support.hpp"

#ifdef GLA_TESTS_WITH_CUDA
#include "cuda_test_support.hpp"
#endif

namespace gla::test {
namespace {

#ifdef GLA_TESTS_WITH_CUDA

struct CudaBackwardRun {
  gla_status status;
  std::string error;
  Outputs out;
};

// Device copy of an optional host descriptor.
std::unique_ptr<DeviceTensor> device_copy(const HostTensor& h, bool copy = true) {
  if (h.empty()) return nullptr;
  return std::make_unique<DeviceTensor>(h, copy);
}

// What a call leaves out: do, dht, or some gradients.
struct Absent {
  bool dout = false, dht = false, dq = false, dk = false, dv = false, dg = false, dh0 = false;
};

CudaBackwardRun run_cuda_backward(const Inputs& in, const Absent& absent = {}) {
  CudaBackwardRun r;
  gla_chunk_backward_args host = backward_args(in, r.out);
  auto q = device_copy(in.q), k = device_copy(in.k), v = device_copy(in.v), g = device_copy(in.g);
  auto h0 = device_copy(in.h0), cu = device_copy(in.cu), dout = device_copy(in.dout), dht = device_copy(in.dht);
  auto dq = device_copy(r.out.dq, false), dk = device_copy(r.out.dk, false), dv = device_copy(r.out.dv, false);
  auto dg = device_copy(r.out.dg, false), dh0 = device_copy(r.out.dh0, false);
  gla_chunk_backward_args a{};
  a.q = &q->t;
  a.k = &k->t;
  a.v = &v->t;
  a.g = &g->t;
  a.initial_state = h0 ? &h0->t : nullptr;
  a.cu_seqlens = cu ? &cu->t : nullptr;
  a.cu_seqlens_host = cu ? in.cu.desc() : nullptr;
  a.do_ = absent.dout ? nullptr : &dout->t;
  a.dht = (host.dht && !absent.dht) ? &dht->t : nullptr;
  a.dq = absent.dq ? nullptr : &dq->t;
  a.dk = absent.dk ? nullptr : &dk->t;
  a.dv = absent.dv ? nullptr : &dv->t;
  a.dg = absent.dg ? nullptr : &dg->t;
  a.dh0 = absent.dh0 ? nullptr : &dh0->t;
  gla_options opt;
  gla_options_init(&opt);
  opt.state_v_first = in.c.state_v_first;
  opt.backend = "cuda";
  r.status = gla_chunk_backward(&a, &opt);
  r.error = gla_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dq->to_host(r.out.dq);
  dk->to_host(r.out.dk);
  dv->to_host(r.out.dv);
  dg->to_host(r.out.dg);
  dh0->to_host(r.out.dh0);
  return r;
}

// The reference with the same absent inputs (absent outputs are simply not compared).
Outputs reference_backward(Inputs in, const Absent& absent) {
  if (absent.dout) in.dout = HostTensor();
  if (absent.dht) in.dht = HostTensor();
  Outputs ref;
  EXPECT_EQ(run_backward(in, ref, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
  return ref;
}

void check_case(const Case& c, const Absent& absent = {}) {
  SCOPED_TRACE(c.label());
  const Inputs in = make_inputs(c);
  const Outputs ref = reference_backward(in, absent);
  CudaBackwardRun got = run_cuda_backward(in, absent);
  ASSERT_EQ(got.status, GLA_STATUS_OK) << got.error;
  // Absent outputs must stay untouched (NaN poison), present ones fully written and close.
  Outputs compare;
  const std::pair<const HostTensor*, bool> outs[] = {{&got.out.dq, absent.dq}, {&got.out.dk, absent.dk},
                                                     {&got.out.dv, absent.dv}, {&got.out.dg, absent.dg},
                                                     {&got.out.dh0, absent.dh0}};
  for (const auto& [t, skip] : outs) {
    if (skip) continue;
    EXPECT_TRUE(all_finite(*t)) << "unwritten or non-finite output";
  }
  if (!absent.dq) compare.dq = got.out.dq;
  if (!absent.dk) compare.dk = got.out.dk;
  if (!absent.dv) compare.dv = got.out.dv;
  if (!absent.dg) compare.dg = got.out.dg;
  if (!absent.dh0) compare.dh0 = got.out.dh0;
  std::string report;
  const double err = max_error(compare, ref, true, report);
  EXPECT_LT(err, 5e-3) << report;
}

class CudaBackwardGrid : public ::testing::TestWithParam<int32_t> {};

TEST_P(CudaBackwardGrid, SpecGridMatchesReference) {
  SKIP_WITHOUT_CUDA();
  for (Case c : spec_grid_cases(GetParam())) {
    if (c.K > 512 || c.V > 512) continue;
    check_case(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBackwardGrid, ::testing::Values(GLA_DTYPE_BF16, GLA_DTYPE_F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaBackward, FullLengthShapesAndDecays) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (double n : {0.1, 1.0, 10.0}) {
      Case c = base_case(dt, 2, 1024, 2, 128);
      c.normaliser = n;
      check_case(c);
    }
    for (const Case& c : decay_and_randn_cases(dt)) check_case(c);
  }
}

// Moderate decays, where the intra-chunk factors are large but finite. n = 0.35 moves b by ~2 log2
// units a token: a 16-row block's one pivot scaled fp16 copies by up to 2^17 (inf, before fp16 took
// the pivot levels), and the whole-chunk pivot's range (64 from row 31) is crossed by some bf16
// tiles and not others. n = 0.5 moves b by ~1.45 a token: every bf16 tile on the whole-chunk pivot,
// with factors up to 2^46.
TEST(CudaBackward, ModerateDecays) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (double n : {0.35, 0.5}) {
      Case c = base_case(dt, 2, 700, 2, 128);
      c.normaliser = n;
      c.randn_inputs = true;
      check_case(c);
      Case kv = base_case(dt, 1, 333, 2, 100);
      kv.V = 200;
      kv.normaliser = n;
      check_case(kv);
    }
  }
}

TEST(CudaBackward, KNotEqualVAndModelShapes) {
  SKIP_WITHOUT_CUDA();
  for (auto kv : {std::pair<int64_t, int64_t>{64, 128}, {128, 256}, {256, 512}, {128, 64}, {100, 36}, {32, 200},
                  {8, 8}, {1, 1}}) {
    Case c = base_case(GLA_DTYPE_BF16, 1, 333, 2, 64);
    c.K = kv.first;
    c.V = kv.second;
    check_case(c);
  }
}

TEST(CudaBackward, GateVariantsAndLayouts) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 2, 300, 2, 128);
  c.gate_f32 = true;
  check_case(c);
  c.per_head_gate = true;
  check_case(c);  // per-head gate with two key tiles: dg summed over them
  c.gate_f32 = false;
  check_case(c);
  Case h = base_case(GLA_DTYPE_F16, 1, 200, 2, 64);
  h.per_head_gate = true;
  check_case(h);
  c.per_head_gate = false;
  c.state_v_first = true;
  check_case(c);
  Case e = base_case(GLA_DTYPE_F16, 2, 256, 4, 64);
  e.state_v_first = true;
  check_case(e);
  Case n = base_case(GLA_DTYPE_BF16, 1, 333, 2, 64);
  n.initial_state = false;
  n.final_state = false;
  check_case(n);
}

TEST(CudaBackward, VarlenEmptyAndSingleTokenSequences) {
  SKIP_WITHOUT_CUDA();
  const std::vector<std::vector<int64_t>> cus = {
      {0, 15}, {0, 0, 16}, {0, 256, 500, 1000}, {0, 15, 100, 300, 1200, 2000}, {0, 1, 1, 2, 3000, 3000, 3001, 9000}};
  for (const auto& cu : cus) {
    for (int64_t D : {64, 100}) {
      Case c = base_case(GLA_DTYPE_BF16, 1, cu.back(), 2, D);
      c.cu_seqlens = cu;
      check_case(c);
    }
    // K 256 / V 512: the key split with prepared inputs (four value tiles), padded per sequence
    Case c = base_case(GLA_DTYPE_BF16, 1, cu.back(), 1, 64);
    c.K = 256;
    c.V = 512;
    c.cu_seqlens = cu;
    check_case(c);
  }
}

TEST(CudaBackward, AbsentInputsAndOutputs) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 2, 300, 2, 64);
  Absent no_do;
  no_do.dout = true;
  check_case(c, no_do);
  Absent no_dht;
  no_dht.dht = true;
  check_case(c, no_dht);
  Absent only_dv;
  only_dv.dq = only_dv.dk = only_dv.dg = only_dv.dh0 = true;
  check_case(c, only_dv);
  Absent no_dv;
  no_dv.dv = true;
  check_case(c, no_dv);
}

// Every 97th gate -inf (a hard reset, SPEC §3.8): finite outputs close to the reference.
void check_hard_resets(const Case& c) {
  Inputs in = make_inputs(c);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < in.g.size(); i += 97) in.g.set(i, -inf);
  const Outputs ref = reference_backward(in, {});
  CudaBackwardRun got = run_cuda_backward(in);
  ASSERT_EQ(got.status, GLA_STATUS_OK) << got.error;
  for (const HostTensor* t : {&got.out.dq, &got.out.dk, &got.out.dv, &got.out.dg, &got.out.dh0}) {
    EXPECT_TRUE(all_finite(*t));
  }
  std::string report;
  EXPECT_LT(max_error(got.out, ref, true, report), 5e-3) << report;
}

TEST(CudaBackward, HardResetGates) {
  SKIP_WITHOUT_CUDA();
  check_hard_resets(base_case(GLA_DTYPE_BF16, 1, 300, 2, 64));
}

// Two calls on the same inputs give bitwise-identical outputs.
void expect_bitwise_reruns(const Case& c) {
  const Inputs in = make_inputs(c);
  CudaBackwardRun a = run_cuda_backward(in), b = run_cuda_backward(in);
  ASSERT_EQ(a.status, GLA_STATUS_OK) << a.error;
  EXPECT_EQ(a.out.dq.bytes, b.out.dq.bytes);
  EXPECT_EQ(a.out.dk.bytes, b.out.dk.bytes);
  EXPECT_EQ(a.out.dv.bytes, b.out.dv.bytes);
  EXPECT_EQ(a.out.dg.bytes, b.out.dg.bytes);
  EXPECT_EQ(a.out.dh0.bytes, b.out.dh0.bytes);
}

TEST(CudaBackward, LongSequence) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 1, 65536 + 37, 1, 64);
  check_case(c);  // the reversed forward pads the sequence (pad_front) and splits it into segments
  c.gate_f32 = true;  // an fp32 per-key gate: the single-role reversed forward, so the reverse walk, split
  check_case(c);
}

TEST(CudaBackward, BitwiseReruns) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_BF16, 2, 3000, 2, 128);
  c.per_head_gate = true;
  expect_bitwise_reruns(c);
}

// Every sequence length a multiple of 64: the state gradients come from the reversed forward's
// chunk states (BackwardPlan::state_grads_by_values), not the reverse walk. The same grid of
// features over that path: gate kinds, layouts, K != V and the key split, varlen with empty
// sequences, hard resets, the segment splits of a long sequence, absent dht, fp16, bitwise reruns.
TEST(CudaBackward, StateGradientsFromTheReversedForward) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    check_case(base_case(dt, 2, 512, 2, 128));
    Case c = base_case(dt, 2, 256, 2, 64);
    c.per_head_gate = true;
    check_case(c);
  }
  Case f = base_case(GLA_DTYPE_BF16, 2, 192, 2, 128);
  f.gate_f32 = true;
  check_case(f);
  f.per_head_gate = true;
  check_case(f);
  Case v = base_case(GLA_DTYPE_BF16, 2, 256, 2, 128);
  v.state_v_first = true;
  check_case(v);
  for (auto kv : {std::pair<int64_t, int64_t>{256, 512}, {64, 128}, {128, 256}, {100, 36}, {1, 1}}) {
    Case c = base_case(GLA_DTYPE_BF16, 1, 256, 2, 64);
    c.K = kv.first;
    c.V = kv.second;
    check_case(c);
    c.state_v_first = true;  // fla's GLA layer passes state_v_first whatever K and V are
    check_case(c);
    c.initial_state = false;
    c.final_state = false;
    check_case(c);
  }
  for (const std::vector<int64_t>& cu : {std::vector<int64_t>{0, 0, 128, 128, 192, 704}, {0, 64}, {0, 640, 640}}) {
    for (int64_t D : {64, 100}) {
      Case c = base_case(GLA_DTYPE_BF16, 1, cu.back(), 2, D);
      c.cu_seqlens = cu;
      check_case(c);
    }
  }
  Case strong = base_case(GLA_DTYPE_BF16, 1, 512, 2, 64);
  strong.gate_floor = -30.0;
  strong.randn_inputs = true;
  check_case(strong);
  Absent no_dht;
  no_dht.dht = true;
  check_case(base_case(GLA_DTYPE_BF16, 2, 256, 2, 64), no_dht);
  Absent no_dh0;
  no_dh0.dh0 = true;
  check_case(base_case(GLA_DTYPE_BF16, 2, 256, 2, 64), no_dh0);
  check_case(base_case(GLA_DTYPE_BF16, 1, 65536, 1, 64));  // both segment splits
  check_hard_resets(base_case(GLA_DTYPE_BF16, 1, 256, 2, 64));
  expect_bitwise_reruns(base_case(GLA_DTYPE_BF16, 2, 3072, 2, 128));
}

TEST(CudaBackward, DeclinesFloat32WithReason) {
  SKIP_WITHOUT_CUDA();
  Case c = base_case(GLA_DTYPE_F32, 1, 64, 1, 64);
  const Inputs in = make_inputs(c);
  CudaBackwardRun r = run_cuda_backward(in);
  EXPECT_EQ(r.status, GLA_STATUS_NOT_SUPPORTED);
  EXPECT_NE(r.error.find("dtype float32 not declared (declares float16,bfloat16)"), std::string::npos) << r.error;
}

#else

TEST(CudaBackward, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: GPU tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
