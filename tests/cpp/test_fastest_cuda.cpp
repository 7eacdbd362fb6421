// The `fastest` policy on a GPU: the cuda backend's clock (CUDA events on the call's stream) times
// the candidates for a CUDA input. Besides `cuda` the candidate is a callback backend that runs the
// same work on `cuda` and then holds the stream's host thread for 5 ms before the end event is
// recorded, so its event-timed run is the cuda time + ~5 ms: cuda must win, the times must show it,
// and the call must match the reference.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "test_support.hpp"

#ifdef GLA_TESTS_WITH_CUDA
#include "cuda_test_support.hpp"
#endif

namespace gla::test {
namespace {

#ifdef GLA_TESTS_WITH_CUDA

int32_t cuda_plus_5ms(void*, const gla_problem* p, char* message, size_t capacity) {
  const gla_status s = forward_on(*p, "cuda", message, capacity);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  return s;
}

TEST(FastestCuda, CudaEventsTimeTheCandidatesAndTheFasterWins) {
  SKIP_WITHOUT_CUDA();
  gla_backend_desc d{};
  d.abi_version = GLA_ABI_VERSION;
  d.name = "cuda_plus_5ms";
  d.priority = 5;  // ahead of cuda: priority alone would pick it
  d.device_mask = 1ull << GLA_DEVICE_CUDA;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.run = cuda_plus_5ms;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK) << gla_last_error();

  Case c = base_case(GLA_DTYPE_BF16, 2, 2048, 8, 128);
  c.gate_f32 = true;
  const Inputs in = make_inputs(c);
  Outputs want;
  ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
  DeviceTensor q(in.q), k(in.k), v(in.v), g(in.g), h0(in.h0);
  HostTensor o_host(c.dtype, {c.B, c.T, c.H, c.V}), ht_host(GLA_DTYPE_F32, state_sizes(in));
  DeviceTensor o(o_host, false), ht(ht_host, false);
  gla_chunk_forward_args a{&q.t, &k.t, &v.t, &g.t, &h0.t, nullptr, nullptr, &o.t, &ht.t};
  gla_options opts;
  gla_options_init(&opts);
  opts.policy = GLA_POLICY_FASTEST;
  const char* text = nullptr;
  ASSERT_EQ(gla_tune(&a, nullptr, &opts, &text), GLA_STATUS_OK) << gla_last_error();
  const std::string report = text;
  std::printf("%s", report.c_str());
  EXPECT_NE(report.find("decision: cuda (whole operation)"), std::string::npos) << report;
  double cuda_ms = 0, slow_ms = 0;
  ASSERT_NE(report.find("    cuda: "), std::string::npos) << report;
  std::sscanf(report.substr(report.find("    cuda: ")).c_str(), "    cuda: %lf", &cuda_ms);
  std::sscanf(report.substr(report.find("cuda_plus_5ms: ")).c_str(), "cuda_plus_5ms: %lf", &slow_ms);
  EXPECT_GT(cuda_ms, 0.0);
  EXPECT_GE(slow_ms, cuda_ms + 4.5) << "the events did not see the 5 ms";

  ASSERT_EQ(gla_chunk_forward(&a, &opts), GLA_STATUS_OK) << gla_last_error();
  o.to_host(o_host);
  ht.to_host(ht_host);
  EXPECT_LT(rel_rms(o_host, want.o), 5e-3);
  EXPECT_LT(rel_rms(ht_host, want.ht), 5e-3);
  gla_unregister_backend("cuda_plus_5ms");
}

#else

TEST(FastestCuda, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: GPU tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
