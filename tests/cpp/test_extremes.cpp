// Extreme but legal gates (SPEC.md §3.8): g = -inf is a hard reset (e^-inf = 0, the state before
// that token is forgotten). Cumulative gates then hold -inf, and a backend that subtracts two of
// them forms -inf - (-inf) = NaN; every backend must give the reference's finite answer.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "test_support.hpp"

using namespace gla::test;

namespace {

// Every 23rd token resets all keys; at every 17th token a third of the gate entries are -inf alone
// (those keys forgotten); some gates are exactly 0 (no decay).
Inputs hard_reset_inputs(bool per_head, int64_t T, uint64_t seed) {
  Case c;
  c.B = 2; c.T = T; c.H = 2; c.K = 16; c.V = 8; c.per_head_gate = per_head; c.seed = seed;
  Inputs in = make_inputs(c);
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t kg = per_head ? 1 : c.K;
  for (int64_t i = 0; i < in.g.size(); ++i) {
    const int64_t token = i / (c.H * kg) % c.T;
    if (token % 23 == 3 || (token % 17 == 5 && i % 3 == 0)) in.g.set(i, -inf);
    else if (i % 7 == 0) in.g.set(i, 0.0);
  }
  return in;
}

void expect_matches_reference(const std::string& backend, bool stage_pipeline) {
  for (bool per_head : {false, true}) {
    // T = 150: partial last chunk; the resets land inside chunks and on chunk boundaries.
    const Inputs in = hard_reset_inputs(per_head, 150, per_head ? 42 : 41);
    Outputs ref, got;
    ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
    for (const HostTensor* t : {&ref.o, &ref.ht, &ref.dq, &ref.dk, &ref.dv, &ref.dh0}) {
      ASSERT_TRUE(all_finite(*t)) << "the reference itself is not finite";
    }
    ASSERT_EQ(run_forward(in, got, {backend, stage_pipeline}), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_backward(in, got, {backend, stage_pipeline}), GLA_STATUS_OK) << gla_last_error();
    std::string report;
    EXPECT_LT(max_error(got, ref, false, report), host_tolerance(GLA_DTYPE_F32)) << (per_head ? "per-head " : "per-key ") << report;
    EXPECT_LT(max_error(got, ref, true, report), host_tolerance(GLA_DTYPE_F32)) << (per_head ? "per-head " : "per-key ") << report;
  }
}

TEST(HardResetGates, ReferenceStagePipelineIsFinite) { expect_matches_reference("reference", true); }

// The cpu kernels form the cumulative gate in cumsum_gate_rows (tensor_io.inl), which floors the raw
// gate at -104 for the whole operations and the cumsum stage alike.
TEST(HardResetGates, CpuMatchesReference) {
  if (!backend_available("cpu")) GTEST_SKIP() << "cpu backend not built";
  expect_matches_reference("cpu", false);
}

TEST(HardResetGates, CpuStagePipelineMatchesReference) {
  if (!backend_available("cpu")) GTEST_SKIP() << "cpu backend not built";
  expect_matches_reference("cpu", true);
}

}  // namespace
