// Registry and dispatcher behaviour with test-only backends registered through the public C table
// (gla_backend_desc), exactly as a plugin would: priority order, declines with reasons and
// fall-through, forced backends, GLA_DISABLE, explain(), errors from a backend, the stage pipeline
// mixing backends within one call (a call log proves who ran what), GLA_LOG, thread safety.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/backend.hpp"  // header-only helpers: sequence_span, gate_offset, offset4
#include "test_support.hpp"

using namespace gla::test;

namespace {

std::mutex g_log_mutex;
std::vector<std::string> g_calls;  // "backend:unit"

void record(const char* backend, int32_t unit) {
  std::lock_guard lock(g_log_mutex);
  g_calls.push_back(std::string(backend) + ":" + gla_unit_name(unit));
}
std::vector<std::string> calls() {
  std::lock_guard lock(g_log_mutex);
  return g_calls;
}
bool ran(const std::string& entry) {
  const auto c = calls();
  return std::find(c.begin(), c.end(), entry) != c.end();
}

void write_message(char* message, size_t capacity, const std::string& text) {
  std::snprintf(message, capacity, "%s", text.c_str());
}

// "picky": whole forward only, K must be a multiple of 16; runs by delegating to `reference`.
int32_t picky_verify(void*, const gla_problem* p, char* message, size_t capacity) {
  if (p->K % 16 != 0) {
    write_message(message, capacity, "K=" + std::to_string(p->K) + " is not a multiple of 16");
    return 0;
  }
  return 1;
}
int32_t picky_run(void*, const gla_problem* p, char* message, size_t capacity) {
  record("picky", p->unit);
  gla_chunk_forward_args a{&p->q, &p->k, &p->v, &p->g,
                           gla::present(p->initial_state) ? &p->initial_state : nullptr,
                           gla::present(p->cu_seqlens) ? &p->cu_seqlens : nullptr, nullptr, &p->o,
                           gla::present(p->final_state) ? &p->final_state : nullptr};
  gla_options o;
  gla_options_init(&o);
  o.backend = "reference";
  o.state_v_first = p->state_v_first;
  o.has_scale = 1;
  o.scale = p->scale;
  const gla_status s = gla_chunk_forward(&a, &o);
  if (s != GLA_STATUS_OK) write_message(message, capacity, gla_last_error());
  return s;
}

// "stage_cumsum": implements only the cumsum stage, computing it itself.
int32_t cumsum_run(void*, const gla_problem* p, char*, size_t) {
  record("stage_cumsum", p->unit);
  const int64_t kg = p->gate_per_head ? 1 : p->K;
  for (int64_t n = 0; n < p->N; ++n) {
    const auto span = gla::sequence_span(*p, n);
    for (int64_t h = 0; h < p->H; ++h) {
      for (int64_t i = 0; i < kg; ++i) {
        double acc = 0;
        for (int64_t t = 0; t < span.length; ++t) {
          if (t % p->chunk_size == 0) acc = 0;
          acc += gla::load_as_double(p->g, gla::gate_offset(*p, span.batch, span.start + t, h, i));
          gla::store_from_double(p->gcum, gla::offset4(p->gcum, span.batch, span.start + t, h, i), acc / std::log(2.0));
        }
      }
    }
  }
  return GLA_STATUS_OK;
}

int32_t failing_run(void*, const gla_problem* p, char* message, size_t capacity) {
  record("failing", p->unit);
  write_message(message, capacity, "boom: device lost");
  return GLA_STATUS_BACKEND_ERROR;
}

int32_t unavailable(void*, char* message, size_t capacity) {
  write_message(message, capacity, "no such accelerator on this machine");
  return 0;
}

gla_backend_desc describe(const char* name, int32_t priority, uint64_t units,
                          int32_t (*run)(void*, const gla_problem*, char*, size_t)) {
  gla_backend_desc d{};
  d.abi_version = GLA_ABI_VERSION;
  d.name = name;
  d.priority = priority;
  d.device_mask = (1ull << GLA_DEVICE_CPU);
  d.unit_mask = units;
  d.run = run;
  return d;
}

class Registry : public ::testing::Test {
 protected:
  void SetUp() override {
    std::lock_guard lock(g_log_mutex);
    g_calls.clear();
  }
  void TearDown() override {
    for (const char* name : {"picky", "stage_cumsum", "failing", "absent"}) gla_unregister_backend(name);
    set_env("GLA_DISABLE", nullptr);
    set_env("GLA_LOG", nullptr);
  }
  static Inputs inputs(int64_t K) {
    Case c;
    c.B = 2; c.T = 70; c.H = 2; c.K = K; c.V = 8; c.seed = 12;
    return make_inputs(c);
  }
  static std::string explain_forward(const Inputs& in, const char* backend = nullptr, bool pipeline = false) {
    Outputs out;
    out.o = HostTensor(in.q.t.dtype, {in.c.B, in.c.T, in.c.H, in.c.V});
    gla_chunk_forward_args a{in.q.desc(), in.k.desc(), in.v.desc(), in.g.desc(), in.h0.desc(), nullptr, nullptr,
                             out.o.desc(), nullptr};
    gla_options o;
    gla_options_init(&o);
    o.backend = backend;
    o.force_stage_pipeline = pipeline;
    const char* text = nullptr;
    EXPECT_EQ(gla_explain(&a, nullptr, &o, &text), GLA_STATUS_OK) << gla_last_error();
    return text ? text : "";
  }
};

TEST_F(Registry, HigherPriorityBackendRunsWhenItAccepts) {
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  d.verify = picky_verify;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK) << gla_last_error();
  Inputs in = inputs(16);
  Outputs out, ref;
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK);
  EXPECT_TRUE(ran("picky:chunk_fwd"));
  EXPECT_EQ(rel_rms(out.o, ref.o), 0.0);
  EXPECT_NE(explain_forward(in).find("decision: picky (whole operation)"), std::string::npos);
}

TEST_F(Registry, ExplainSaysHowTheChosenBackendRunsIt) {
  Inputs in = inputs(16);
  const std::string text = explain_forward(in, "reference");
  EXPECT_NE(text.find("decision: reference (whole operation)"), std::string::npos) << text;
  // B=2 sequences x H=2 heads.
  EXPECT_NE(text.find("plan in 'reference': fp64 token loop (SPEC.md recurrence), one task per (sequence, head): 4 tasks"),
            std::string::npos)
      << text;
  // A callback backend has nothing to add: no plan line.
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  d.verify = picky_verify;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  const std::string picky = explain_forward(in);
  EXPECT_NE(picky.find("decision: picky (whole operation)"), std::string::npos) << picky;
  EXPECT_EQ(picky.find("plan in"), std::string::npos) << picky;
}

TEST_F(Registry, DeclineWithReasonFallsThrough) {
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  d.verify = picky_verify;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(8);
  Outputs out;
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  EXPECT_FALSE(ran("picky:chunk_fwd"));
  const std::string text = explain_forward(in);
  EXPECT_NE(text.find("backend 'picky' (priority 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("declines: K=8 is not a multiple of 16"), std::string::npos) << text;
  EXPECT_EQ(text.find("decision: picky"), std::string::npos) << text;
}

TEST_F(Registry, ForcedBackendThatDeclinesIsAnErrorWithItsReason) {
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  d.verify = picky_verify;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(8);
  Outputs out;
  EXPECT_EQ(run_forward(in, out, {"picky"}), GLA_STATUS_NOT_SUPPORTED);
  const std::string message = gla_last_error();
  EXPECT_NE(message.find("forced backend 'picky' declines chunk_fwd: K=8 is not a multiple of 16"), std::string::npos)
      << message;
  EXPECT_FALSE(ran("picky:chunk_fwd"));
  // Outputs untouched: still the NaN poison.
  for (int64_t i = 0; i < out.o.size(); ++i) ASSERT_TRUE(std::isnan(out.o.get(i)));
}

TEST_F(Registry, ForcedThroughEnvironment) {
  auto d = describe("picky", 500, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  set_env("GLA_BACKEND", "picky");
  Inputs in = inputs(8);
  Outputs out;
  const gla_status s = run_forward(in, out);
  set_env("GLA_BACKEND", nullptr);
  ASSERT_EQ(s, GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(ran("picky:chunk_fwd"));
}

TEST_F(Registry, DisabledByEnvironmentAndByApi) {
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(16);
  Outputs out;
  set_env("GLA_DISABLE", "picky,other");
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK);
  EXPECT_FALSE(ran("picky:chunk_fwd"));
  EXPECT_NE(explain_forward(in).find("disabled by GLA_DISABLE"), std::string::npos);
  set_env("GLA_DISABLE", nullptr);
  ASSERT_EQ(gla_backend_set_enabled("picky", 0), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK);
  EXPECT_FALSE(ran("picky:chunk_fwd"));
  EXPECT_NE(explain_forward(in).find("disabled by gla_backend_set_enabled"), std::string::npos);
  ASSERT_EQ(gla_backend_set_enabled("picky", 1), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK);
  EXPECT_TRUE(ran("picky:chunk_fwd"));
  EXPECT_EQ(gla_backend_set_enabled("nobody", 0), GLA_STATUS_INVALID_ARGUMENT);
}

// libgla reads its environment once: a variable changed afterwards applies from the next
// gla_reload_environment() on, and an unchanged environment re-read changes nothing.
TEST_F(Registry, EnvironmentIsReadOnceUntilReloaded) {
  auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(16);
  Outputs out;
  ASSERT_EQ(gla_reload_environment(), GLA_STATUS_OK);
  setenv("GLA_DISABLE", "picky", 1);
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(ran("picky:chunk_fwd"));  // not re-read yet
  ASSERT_EQ(gla_reload_environment(), GLA_STATUS_OK);
  {
    std::lock_guard lock(g_log_mutex);
    g_calls.clear();
  }
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  EXPECT_FALSE(ran("picky:chunk_fwd"));
  EXPECT_NE(explain_forward(in).find("disabled by GLA_DISABLE"), std::string::npos);
  ASSERT_EQ(gla_reload_environment(), GLA_STATUS_OK);  // unchanged: still disabled
  EXPECT_NE(explain_forward(in).find("disabled by GLA_DISABLE"), std::string::npos);
  set_env("GLA_DISABLE", nullptr);
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(ran("picky:chunk_fwd"));
}

TEST_F(Registry, UnavailableBackendIsSkippedWithItsReason) {
  auto d = describe("absent", 0, (1ull << GLA_UNIT_CHUNK_FWD), failing_run);
  d.available = unavailable;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(16);
  Outputs out;
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  EXPECT_TRUE(calls().empty());
  EXPECT_NE(explain_forward(in).find("unavailable (no such accelerator on this machine)"), std::string::npos);
  bool listed = false;
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char *name = nullptr, *reason = nullptr;
    int32_t priority = 0, available = 1;
    ASSERT_EQ(gla_backend_info(i, &name, &priority, &available, &reason), GLA_STATUS_OK);
    if (std::string(name) == "absent") {
      listed = true;
      EXPECT_EQ(available, 0);
      EXPECT_STREQ(reason, "no such accelerator on this machine");
    }
  }
  EXPECT_TRUE(listed);
}

TEST_F(Registry, BackendFailureBecomesStatusAndMessage) {
  auto d = describe("failing", 0, 1ull << GLA_UNIT_CHUNK_FWD, failing_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(16);
  Outputs out;
  EXPECT_EQ(run_forward(in, out), GLA_STATUS_BACKEND_ERROR);
  EXPECT_NE(std::string(gla_last_error()).find("backend 'failing' failed: boom: device lost"), std::string::npos);
}

TEST_F(Registry, OneStageBackendMixesWithOthersInOneCall) {
  // A backend offering only the cumsum stage, ahead of everything in priority: the dispatcher runs
  // the stage pipeline, cumsum on it and every other stage on the next backend that offers it.
  auto d = describe("stage_cumsum", 0, 1ull << GLA_UNIT_CUMSUM, cumsum_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(8);
  Outputs out, ref;
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_backward(in, out), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK);
  ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK);
  EXPECT_EQ(calls(), (std::vector<std::string>{"stage_cumsum:cumsum", "stage_cumsum:cumsum"}));
  std::string report;
  EXPECT_LT(max_error(out, ref, false, report), 1e-5) << report;
  EXPECT_LT(max_error(out, ref, true, report), 1e-5) << report;
  const std::string text = explain_forward(in);
  EXPECT_NE(text.find("decision: stage pipeline: cumsum->stage_cumsum fwd_h->"), std::string::npos) << text;
}

TEST_F(Registry, StageForcedPerUnit) {
  auto d = describe("stage_cumsum", 900, 1ull << GLA_UNIT_CUMSUM, cumsum_run);
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK);
  Inputs in = inputs(8);
  Outputs out, ref;
  // Low priority, so only the per-unit choice brings it in.
  ASSERT_EQ(run_forward(in, out, {"cumsum=stage_cumsum"}), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK);
  EXPECT_TRUE(ran("stage_cumsum:cumsum"));
  std::string report;
  EXPECT_LT(max_error(out, ref, false, report), 1e-5) << report;
  EXPECT_EQ(run_forward(in, out, {"fwd_h=stage_cumsum"}), GLA_STATUS_NOT_SUPPORTED);
  EXPECT_NE(std::string(gla_last_error()).find("forced backend 'stage_cumsum' declines fwd_h"), std::string::npos)
      << gla_last_error();
  EXPECT_EQ(run_forward(in, out, {"nonsense=reference"}), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("unknown unit 'nonsense'"), std::string::npos);
}

TEST_F(Registry, ExplainListsEveryBackendAndUnit) {
  Inputs in = inputs(8);
  const std::string text = explain_forward(in);
  for (const char* phrase : {"problem: chunk_fwd B=2 T=70 H=2 K=8 V=8", "policy: priority", "backend 'reference'",
                             "chunk_fwd", "cumsum", "fwd_h", "fwd_intra", "fwd_o", "decision: "}) {
    EXPECT_NE(text.find(phrase), std::string::npos) << phrase << "\n" << text;
  }
  const std::string forced = explain_forward(in, "reference", true);
  EXPECT_NE(forced.find("stage pipeline forced"), std::string::npos) << forced;
  EXPECT_NE(forced.find("decision: stage pipeline: cumsum->reference"), std::string::npos) << forced;
}

TEST_F(Registry, DispatchLogOncePerSignature) {
  set_env("GLA_LOG", "dispatch");
  Case c;
  c.B = 1; c.T = 33; c.H = 1; c.K = 12; c.V = 5;  // a signature no other test uses
  Inputs in = make_inputs(c);
  Outputs out;
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(in, out), GLA_STATUS_OK);
  const std::string log = ::testing::internal::GetCapturedStderr();
  const std::string head = "[gla] dispatch chunk_fwd B=1 T=33 H=1 K=12 V=5";
  const auto first = log.find(head);
  ASSERT_NE(first, std::string::npos) << log;
  EXPECT_EQ(log.find(head, first + 1), std::string::npos) << "logged twice:\n" << log;
  EXPECT_NE(log.find("decision: "), std::string::npos);
}

TEST_F(Registry, ConcurrentCallsWhileRegistering) {
  Inputs in = inputs(16);
  Outputs ref;
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK);
  std::atomic<bool> stop{false};
  std::atomic<int> failures{0};
  std::thread churn([&] {
    auto d = describe("picky", 1, 1ull << GLA_UNIT_CHUNK_FWD, picky_run);
    while (!stop) {
      gla_register_backend(&d);
      gla_unregister_backend("picky");
    }
  });
  std::vector<std::thread> workers;
  for (int w = 0; w < 4; ++w) {
    workers.emplace_back([&] {
      for (int r = 0; r < 10; ++r) {
        Outputs out;
        if (run_forward(in, out) != GLA_STATUS_OK || !(rel_rms(out.o, ref.o) < 1e-5)) ++failures;
      }
    });
  }
  for (auto& w : workers) w.join();
  stop = true;
  churn.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST_F(Registry, RegistrationIsValidated) {
  auto d = describe("picky", 1, 1, picky_run);
  d.abi_version = 99;
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("abi_version"), std::string::npos);
  d = describe("", 1, 1, picky_run);
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  d = describe("picky", 1, 1, nullptr);
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(gla_register_backend(nullptr), GLA_STATUS_INVALID_ARGUMENT);
}

}  // namespace
