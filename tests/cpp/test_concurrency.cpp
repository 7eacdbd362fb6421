// 16 threads at once calling the operators (different shapes, backends, policies, the stage
// pipeline), the registry (a callback backend registered, listed, disabled and removed over and over)
// and explain: every result bitwise equal to the same call made serially first. Run under
// ThreadSanitizer in CI (scripts/test.sh).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"

using namespace gla::test;

namespace {

// A backend that is never chosen (it declines every problem) but churns through the registry.
int32_t decline_all(void*, const gla_problem*, char* message, size_t capacity) {
  std::snprintf(message, capacity, "%s", "declines everything");
  return 0;
}
int32_t never_runs(void*, const gla_problem*, char*, size_t) { return GLA_STATUS_INTERNAL_ERROR; }

struct Job {
  Case c;
  RunOptions run;
  int32_t policy;
};

std::vector<Job> jobs() {
  std::vector<Job> out;
  const char* backends[] = {"reference", "cpu", ""};
  const int32_t policies[] = {GLA_POLICY_PRIORITY, GLA_POLICY_FASTEST, GLA_POLICY_DEFAULT};
  for (int i = 0; i < 8; ++i) {
    Job j;
    j.c.B = 1 + i % 2;
    j.c.T = 20 + 37 * i;
    j.c.H = 1 + i % 3;
    j.c.K = 8 + 8 * (i % 3);
    j.c.V = 4 + 4 * (i % 2);
    j.c.per_head_gate = i % 4 == 3;
    j.c.seed = 100 + i;
    if (i == 5) {
      j.c.B = 1;
      j.c.cu_seqlens = {0, 7, 7, 90, j.c.T};
    }
    j.run.backend = backends[i % 3];
    if (j.run.backend == "cpu" && !backend_available("cpu")) j.run.backend = "reference";
    j.run.stage_pipeline = i % 4 == 1;
    j.policy = policies[i % 3];
    out.push_back(j);
  }
  return out;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) { return a.bytes == b.bytes; }
bool same_outputs(const Outputs& a, const Outputs& b) {
  for (auto m : {&Outputs::o, &Outputs::ht, &Outputs::dq, &Outputs::dk, &Outputs::dv, &Outputs::dg, &Outputs::dh0}) {
    if (!same_bytes(a.*m, b.*m)) return false;
  }
  return true;
}

gla_status run_job(const Inputs& in, const Job& j, Outputs& out, std::string& explained) {
  const gla_chunk_forward_args fa = forward_args(in, out);
  const gla_chunk_backward_args ba = backward_args(in, out);
  gla_options o;
  gla_options_init(&o);
  o.backend = j.run.backend.empty() ? nullptr : j.run.backend.c_str();
  o.force_stage_pipeline = j.run.stage_pipeline;
  o.policy = j.policy;
  gla_status s = gla_chunk_forward(&fa, &o);
  if (s != GLA_STATUS_OK) return s;
  s = gla_chunk_backward(&ba, &o);
  if (s != GLA_STATUS_OK) return s;
  const char* text = nullptr;
  s = gla_explain(&fa, nullptr, &o, &text);
  if (s != GLA_STATUS_OK) return s;
  // The decision (the verdict table also lists the churning backend when it happens to be registered).
  const std::string all(text);
  const size_t at = all.find("decision: ");
  explained = at == std::string::npos ? all : all.substr(at, all.find('\n', at) - at);
  return s;
}

TEST(Concurrency, SixteenThreadsEqualSerial) {
  const std::vector<Job> all = jobs();
  std::vector<Inputs> inputs;
  std::vector<Outputs> serial(all.size());
  std::vector<std::string> serial_text(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    inputs.push_back(make_inputs(all[i].c));
    ASSERT_EQ(run_job(inputs[i], all[i], serial[i], serial_text[i]), GLA_STATUS_OK) << all[i].c.label() << ": " << gla_last_error();
  }

  std::atomic<int> mismatches{0}, decision_mismatches{0}, errors{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  // 14 operator threads, each cycling through every job from its own starting point.
  for (int t = 0; t < 14; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < 3; ++r) {
        for (size_t k = 0; k < all.size(); ++k) {
          const size_t i = (k + static_cast<size_t>(t)) % all.size();
          Outputs out;
          std::string text;
          if (run_job(inputs[i], all[i], out, text) != GLA_STATUS_OK) {
            ++errors;
          } else {
            if (!same_outputs(out, serial[i])) ++mismatches;
            if (text != serial_text[i]) ++decision_mismatches;
          }
        }
      }
    });
  }
  // The registry: a backend registered, listed, disabled, enabled and removed in a loop.
  threads.emplace_back([&] {
    gla_backend_desc d{};
    d.abi_version = GLA_ABI_VERSION;
    d.name = "concurrent_churn";
    d.priority = 1000;
    d.device_mask = 1ull << GLA_DEVICE_CPU;
    d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
    d.verify = decline_all;
    d.run = never_runs;
    while (!stop) {
      if (gla_register_backend(&d) != GLA_STATUS_OK) ++errors;
      gla_backend_set_enabled("concurrent_churn", 0);
      gla_backend_set_enabled("concurrent_churn", 1);
      gla_unregister_backend("concurrent_churn");
    }
  });
  // Listing while everything else runs.
  threads.emplace_back([&] {
    while (!stop) {
      for (int32_t i = 0; i < gla_backend_count(); ++i) {
        const char *name = nullptr, *reason = nullptr;
        int32_t priority = 0, available = 0;
        gla_backend_info(i, &name, &priority, &available, &reason);  // may race with removal: an error, never a crash
      }
    }
  });
  for (int t = 0; t < 14; ++t) threads[static_cast<size_t>(t)].join();
  stop = true;
  for (size_t t = 14; t < threads.size(); ++t) threads[t].join();
  gla_unregister_backend("concurrent_churn");
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(decision_mismatches.load(), 0);
}

}  // namespace
