// The vendor example (examples/plugin/example_stage.c), built against the installed package by the
// CTest ExamplePlugin.SDK, which passes its path in GLA_EXAMPLE_STAGE_PLUGIN (these tests skip
// without it): loaded by the API and by GLA_PLUGINS, its one stage mixed with the built-in backends'
// in one call (the dispatch log shows it), declined where its declaration says, forced by name.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "test_support.hpp"

using namespace gla::test;

namespace {

const char* plugin_path() { return std::getenv("GLA_EXAMPLE_STAGE_PLUGIN"); }

class ExamplePlugin : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!plugin_path()) GTEST_SKIP() << "GLA_EXAMPLE_STAGE_PLUGIN unset: run by the CTest ExamplePlugin.SDK";
    ASSERT_EQ(gla_load_plugin(plugin_path()), GLA_STATUS_OK) << gla_last_error();
  }
  void TearDown() override {
    if (plugin_path()) gla_unregister_backend("example_stage");
    set_env("GLA_LOG", nullptr);
  }
  static std::string explain(const Inputs& in, const char* backend = nullptr) {
    Outputs out;
    const gla_chunk_forward_args a = forward_args(in, out);
    gla_options o;
    gla_options_init(&o);
    o.backend = backend;
    const char* text = nullptr;
    EXPECT_EQ(gla_explain(&a, nullptr, &o, &text), GLA_STATUS_OK) << gla_last_error();
    return text ? text : "";
  }
  // The built-in backend that fills the other stages: cpu where it is built, else reference.
  static std::string host() { return backend_available("cpu") ? "cpu" : "reference"; }
};

Case base() {
  Case c;
  c.B = 2; c.T = 150; c.H = 2; c.K = 32; c.V = 16; c.gate_f32 = true; c.seed = 41;
  return c;
}

TEST_F(ExamplePlugin, RunsItsStageMixedWithBuiltInBackendsInOneCall) {
  const Inputs in = make_inputs(base());
  const std::string text = explain(in);
  EXPECT_NE(text.find("declares cumsum on cpu: dtypes float32,float16,bfloat16; gates float32; K 1..256"), std::string::npos)
      << text;
  const std::string h = host();
  EXPECT_NE(text.find("decision: stage pipeline: cumsum->example_stage fwd_h->" + h + " fwd_intra->" + h + " fwd_o->" + h),
            std::string::npos)
      << text;
  set_env("GLA_LOG", "dispatch");
  Outputs got, want;
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(run_forward(in, got), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_backward(in, got), GLA_STATUS_OK) << gla_last_error();
  const std::string log = ::testing::internal::GetCapturedStderr();
  set_env("GLA_LOG", nullptr);
  EXPECT_NE(log.find("decision: stage pipeline: cumsum->example_stage fwd_h->" + h), std::string::npos) << log;
  EXPECT_NE(log.find("chunk_bwd"), std::string::npos) << log;
  ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
  ASSERT_EQ(run_backward(in, want, {"reference"}), GLA_STATUS_OK);
  std::string report;
  // fp32 pipeline intermediates at moderate gates (docs/dispatch.md): well inside 1e-5.
  EXPECT_LT(max_error(got, want, false, report), 1e-5) << report;
  EXPECT_LT(max_error(got, want, true, report), 1e-5) << report;
}

TEST_F(ExamplePlugin, DeclinedWhereItsDeclarationSays) {
  struct Declined {
    Case c;
    const char* reason;
  };
  Case per_head = base();
  per_head.per_head_gate = true;
  Case f16_gate = base();
  f16_gate.dtype = GLA_DTYPE_F16;
  f16_gate.gate_f32 = false;
  Case wide = base();
  wide.K = 300;
  wide.T = 40;
  for (const Declined& d : {Declined{per_head, "per-head gate not declared"}, Declined{f16_gate, "g dtype float16 not declared"},
                            Declined{wide, "K=300 outside the declared 1..256"}}) {
    const Inputs in = make_inputs(d.c);
    const std::string text = explain(in);
    EXPECT_NE(text.find(d.reason), std::string::npos) << text;
    EXPECT_NE(text.find("decision: " + host() + " (whole operation)"), std::string::npos) << text;
    Outputs got, want;
    ASSERT_EQ(run_forward(in, got), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
    EXPECT_LT(rel_rms(got.o, want.o), host_tolerance(d.c.dtype));
    // Forced onto it anyway: the call fails with that reason, outputs untouched.
    EXPECT_EQ(run_forward(in, got, {"cumsum=example_stage"}), GLA_STATUS_NOT_SUPPORTED);
    EXPECT_NE(std::string(gla_last_error()).find(d.reason), std::string::npos) << gla_last_error();
    EXPECT_FALSE(all_finite(got.o)) << "a declined call wrote its output";
  }
}

TEST_F(ExamplePlugin, ForcedByName) {
  const Inputs in = make_inputs(base());
  // Its stage, forced per unit, even below a backend that would take the whole operation.
  EXPECT_NE(explain(in, "cumsum=example_stage").find("decision: stage pipeline: cumsum->example_stage"), std::string::npos);
  Outputs got, want;
  ASSERT_EQ(run_forward(in, got, {"cumsum=example_stage"}), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK);
  EXPECT_LT(rel_rms(got.o, want.o), 1e-5);
  // Forced as the whole operation: it implements one stage only, and says so.
  EXPECT_EQ(run_forward(in, got, {"example_stage"}), GLA_STATUS_NOT_SUPPORTED);
  EXPECT_NE(std::string(gla_last_error()).find("forced backend 'example_stage' declines chunk_fwd: does not implement chunk_fwd"),
            std::string::npos)
      << gla_last_error();
}

TEST_F(ExamplePlugin, LoadedByTheEnvironmentInAFreshProcess) {
  const std::string out = run_command("GLA_PLUGINS=" + std::string(plugin_path()) + " GLA_LOG=dispatch " + GLA_CLI +
                                      " run --B 1 --T 130 --H 2 --K 16 --V 16 --gate-dtype float32 2>&1");
  EXPECT_NE(out.find("cumsum->example_stage"), std::string::npos) << out;
  EXPECT_NE(out.find("PASS"), std::string::npos) << out;
}

}  // namespace
