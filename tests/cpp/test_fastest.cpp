// The `fastest` policy with backends of known cost: callback backends on a device no built-in backend
// serves (GLA_DEVICE_EXT, host memory underneath), each sleeping a set time and then delegating the
// work to `reference` on the host, so the measured order is known in advance. Checked: the faster one
// wins and serves from then on, ties follow priority, the measurement never writes the caller's
// outputs, GLA_TUNE_FILE round-trips and a corrupt or stale file is ignored with a warning,
// concurrent first calls measure once, nothing is measured while the stream is being captured,
// gla_tune measures ahead of time, and a stress of many threads over policies and signatures.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "test_support.hpp"

using namespace gla::test;

namespace {

struct Costed {
  std::string name;
  int cost_ms = 0;
  std::atomic<int> runs{0};
  std::atomic<int> caller_runs{0};  // runs that wrote the caller's o
  std::atomic<bool> capturing{false};
  bool simulated_clock = false;  // time runs by their nominal cost (time_run) instead of the host clock
};
// The simulated device clock: the nominal cost of the work run on this thread since time_run began.
thread_local double t_device_ms = 0;
std::atomic<void*> g_caller_o{nullptr};

int32_t costed_run(void* user_data, const gla_problem* p, char* message, size_t capacity) {
  auto* self = static_cast<Costed*>(user_data);
  ++self->runs;
  if (p->o.data == g_caller_o.load()) ++self->caller_runs;
  if (self->simulated_clock) {
    t_device_ms += self->cost_ms;
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(self->cost_ms));
  }
  // The EXT tensors are host memory in this test: the reference runs them as such.
  return forward_on(*p, "reference", message, capacity, GLA_DEVICE_CPU);
}
void* host_allocate(void*, const gla_problem*, size_t bytes) { return std::aligned_alloc(64, (bytes + 63) / 64 * 64); }
void host_free(void*, const gla_problem*, void* p) { std::free(p); }
int32_t synchronous(void*, const gla_problem*) { return GLA_STATUS_OK; }
int32_t simulated_time_run(void*, const gla_problem*, void (*run)(void*), void* context, double* ms) {
  t_device_ms = 0;
  run(context);
  *ms = t_device_ms;
  return GLA_STATUS_OK;
}
int32_t capturing(void* user_data, const gla_problem*) { return static_cast<Costed*>(user_data)->capturing.load(); }

void add(Costed& b, int32_t priority) {
  gla_backend_desc d{};
  d.abi_version = GLA_ABI_VERSION;
  d.name = b.name.c_str();
  d.priority = priority;
  d.device_mask = 1ull << GLA_DEVICE_EXT;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.user_data = &b;
  d.run = costed_run;
  d.allocate = host_allocate;
  d.deallocate = host_free;
  d.synchronize = synchronous;
  d.stream_capturing = capturing;
  if (b.simulated_clock) d.time_run = simulated_time_run;
  ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK) << gla_last_error();
}

// A forward problem on the EXT device (host memory), its outputs poisoned, and the reference answer.
struct ExtCall {
  Inputs in;
  Outputs out, want;
  gla_chunk_forward_args args{};
  explicit ExtCall(int64_t K, uint64_t seed = 7) : ExtCall(sized(K, seed)) {}
  explicit ExtCall(const Case& c) {
    in = make_inputs(c);
    EXPECT_EQ(run_forward(in, want, {"reference"}), GLA_STATUS_OK) << gla_last_error();
    for (HostTensor* t : {&in.q, &in.k, &in.v, &in.g, &in.h0}) t->t.device_type = GLA_DEVICE_EXT;
    reset();
  }
  static Case sized(int64_t K, uint64_t seed) {
    Case c;
    c.B = 2; c.T = 40; c.H = 2; c.K = K; c.V = 8; c.seed = seed;
    return c;
  }
  void reset() {
    args = forward_args(in, out);
    out.o.t.device_type = GLA_DEVICE_EXT;
    out.ht.t.device_type = GLA_DEVICE_EXT;
  }
  gla_status run(int32_t policy = GLA_POLICY_FASTEST) {
    reset();
    g_caller_o = out.o.t.data;
    gla_options o;
    gla_options_init(&o);
    o.policy = policy;
    return gla_chunk_forward(&args, &o);
  }
  // The answer is the reference's (the outputs were NaN before the call).
  double error() const { return std::max(rel_rms(out.o, want.o), rel_rms(out.ht, want.ht)); }
  std::string explain(int32_t policy = GLA_POLICY_FASTEST) {
    gla_options o;
    gla_options_init(&o);
    o.policy = policy;
    const char* text = nullptr;
    EXPECT_EQ(gla_explain(&args, nullptr, &o, &text), GLA_STATUS_OK) << gla_last_error();
    return text ? text : "";
  }
};

// Warm-up plus three timed runs for a candidate whose warm-up is under 100 ms.
constexpr int kMeasureRuns = 4;

class Fastest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (auto& b : made_) gla_unregister_backend(b->name.c_str());
    set_env("GLA_TUNE_FILE", nullptr);
  }
  Costed& backend(const std::string& name, int cost_ms, int32_t priority, bool simulated_clock = false) {
    made_.push_back(std::make_unique<Costed>());
    Costed& b = *made_.back();
    b.name = name;
    b.cost_ms = cost_ms;
    b.simulated_clock = simulated_clock;
    add(b, priority);
    return b;
  }
  std::vector<std::unique_ptr<Costed>> made_;
};

TEST_F(Fastest, FasterBackendWinsAndServesFromThenOn) {
  Costed& slow = backend("fw_slow", 12, 1);
  Costed& fast = backend("fw_fast", 2, 2);
  ExtCall call(8);
  EXPECT_NE(call.explain().find("not measured yet"), std::string::npos) << call.explain();
  EXPECT_NE(call.explain().find("decision: fw_slow (whole operation)"), std::string::npos) << "priority serves until measured";

  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_LT(call.error(), 1e-12);
  EXPECT_EQ(slow.runs, kMeasureRuns);
  EXPECT_EQ(fast.runs, kMeasureRuns + 1);
  EXPECT_EQ(slow.caller_runs + fast.caller_runs, 1) << "the measurement wrote the caller's output";

  const std::string text = call.explain();
  EXPECT_NE(text.find("fw_fast: "), std::string::npos) << text;
  EXPECT_NE(text.find("<- winner"), std::string::npos) << text;
  EXPECT_NE(text.find("decision: fw_fast (whole operation)"), std::string::npos) << text;
  // The times are the sleeps (and a little reference work): fw_fast ~2 ms, fw_slow ~12 ms.
  double fast_ms = 0, slow_ms = 0;
  std::sscanf(text.substr(text.find("fw_fast: ")).c_str(), "fw_fast: %lf", &fast_ms);
  std::sscanf(text.substr(text.find("fw_slow: ")).c_str(), "fw_slow: %lf", &slow_ms);
  EXPECT_GE(fast_ms, 2.0);
  EXPECT_GE(slow_ms, 12.0);
  EXPECT_LT(fast_ms, slow_ms);

  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_LT(call.error(), 1e-12);
  EXPECT_EQ(slow.runs, kMeasureRuns) << "measured once";
  EXPECT_EQ(fast.runs, kMeasureRuns + 2);
  // Priority is still priority.
  ASSERT_EQ(call.run(GLA_POLICY_PRIORITY), GLA_STATUS_OK);
  EXPECT_EQ(slow.runs, kMeasureRuns + 1);
}

// Equal costs on the simulated device clock (a host clock on a loaded machine cannot make a tie).
TEST_F(Fastest, TiesFollowPriority) {
  Costed& a = backend("tie_a", 20, 1, true);
  Costed& b = backend("tie_b", 20, 2, true);
  ExtCall call(16);
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(a.runs, kMeasureRuns + 1) << call.explain();
  EXPECT_EQ(b.runs, kMeasureRuns);
  EXPECT_NE(call.explain().find("tie_b: 20.0000 ms"), std::string::npos) << call.explain();
  // The same two in the other priority order are other candidates: measured again, and b wins.
  gla_unregister_backend("tie_a");
  add(a, 3);
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(b.runs, 2 * kMeasureRuns + 1) << call.explain();
  EXPECT_EQ(a.runs, 2 * kMeasureRuns + 1);
  EXPECT_LT(call.error(), 1e-12);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST_F(Fastest, TuneFileRoundTrip) {
  const std::string path = ::testing::TempDir() + "gla_tune_roundtrip.txt";
  std::remove(path.c_str());
  set_env("GLA_TUNE_FILE", path.c_str());
  Costed& slow = backend("rt_slow", 10, 1);
  Costed& fast = backend("rt_fast", 1, 2);
  ExtCall call(24);
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(slow.runs + fast.runs, 2 * kMeasureRuns + 1);
  const std::string file = read_file(path);
  EXPECT_NE(file.find(std::string("libgla-tune 1 ") + gla_version()), std::string::npos) << file;
  EXPECT_NE(file.find("\trt_fast\t2\trt_slow\t"), std::string::npos) << file;

  // Another file (none yet): its records replace the process's, so nothing is known.
  const std::string other = ::testing::TempDir() + "gla_tune_other.txt";
  std::remove(other.c_str());
  set_env("GLA_TUNE_FILE", other.c_str());
  EXPECT_NE(call.explain().find("not measured yet"), std::string::npos) << call.explain();
  // Back to the first: read from the file, served without measuring.
  set_env("GLA_TUNE_FILE", path.c_str());
  EXPECT_NE(call.explain().find("read from GLA_TUNE_FILE"), std::string::npos) << call.explain();
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(slow.runs, kMeasureRuns);
  EXPECT_EQ(fast.runs, kMeasureRuns + 2);
  EXPECT_LT(call.error(), 1e-12);
  std::remove(path.c_str());
}

// Tiny problems, a distinct signature each (H, K and V are exact in the signature).
Case tiny(int64_t H, int64_t K, int64_t V) {
  Case c;
  c.B = 1; c.T = 1; c.H = H; c.K = K; c.V = V; c.seed = static_cast<uint64_t>(100 * H + 10 * K + V);
  return c;
}

// The explain text's "<key><rest of the line>".
std::string line_after(const std::string& text, const std::string& key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return "";
  const size_t from = at + key.size();
  return text.substr(from, text.find('\n', from) - from);
}

// The bound on the records explain() reports ("records kept: n of at most N").
size_t record_bound(ExtCall& call) {
  size_t kept = 0, bound = 0;
  const std::string text = call.explain();
  if (std::sscanf(line_after(text, "records kept: ").c_str(), "%zu of at most %zu", &kept, &bound) != 2) return 0;
  return bound;
}

// The records are bounded (kMaxTuneRecords, src/core/tuner.hpp): past the bound the least recently
// used signature is dropped and measured again when met again, while one in use stays. Fails without
// the bound (the first signature is not measured again) and with clearing all at the bound (the one
// in use is measured again).
TEST_F(Fastest, RecordsAreBoundedLeastRecentlyUsedFirst) {
  Costed& slow = backend("lru_slow", 2, 1, true);
  backend("lru_fast", 1, 2, true);
  ExtCall used_once(tiny(1, 13, 1)), in_use(tiny(1, 14, 1));
  ASSERT_EQ(used_once.run(), GLA_STATUS_OK) << gla_last_error();
  int64_t measured = kMeasureRuns;
  ASSERT_EQ(used_once.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(slow.runs, measured) << "measured again while cached";
  const size_t bound = record_bound(used_once);
  ASSERT_GE(bound, 2u) << used_once.explain();
  ASSERT_LE(bound, 4096u) << "this test measures `bound` signatures";
  ASSERT_EQ(in_use.run(), GLA_STATUS_OK) << gla_last_error();
  measured += kMeasureRuns;

  // Records of earlier tests, if any, are older still: dropped before these.
  for (size_t i = 0; i < bound; ++i) {
    const int64_t n = static_cast<int64_t>(i);
    ExtCall other(tiny(1 + n / 144, 1 + n % 12, 1 + n / 12 % 12));
    ASSERT_EQ(other.run(), GLA_STATUS_OK) << gla_last_error();
    if (i % 64 == 0) {
      ASSERT_EQ(in_use.run(), GLA_STATUS_OK) << gla_last_error();  // never the least recent
    }
  }
  measured += static_cast<int64_t>(bound) * kMeasureRuns;
  EXPECT_EQ(slow.runs, measured) << "the signature in use was measured again";
  EXPECT_NE(in_use.explain().find("measured (in this process"), std::string::npos);

  // The least recently used signature was dropped: met again, it is measured again.
  ASSERT_EQ(used_once.run(), GLA_STATUS_OK) << gla_last_error();
  measured += kMeasureRuns;
  EXPECT_EQ(slow.runs, measured) << "not measured again after " << bound << " other signatures";
  EXPECT_LT(used_once.error(), 1e-12);
  EXPECT_NE(used_once.explain().find("records kept: " + std::to_string(bound) + " of at most"), std::string::npos)
      << used_once.explain();
}

// GLA_TUNE_FILE holds the same bounded records, least recently used first: a file of one record more
// than the bound is read without its first line; the next measurement drops the least recent record
// (from the file too, said once on stderr) and the file keeps the rest.
TEST_F(Fastest, TuneFileIsBoundedLeastRecentlyUsedFirst) {
  Costed& slow = backend("lruf_slow", 2, 1, true);
  backend("lruf_fast", 1, 2, true);
  ExtCall oldest(tiny(1, 15, 1)), fresh(tiny(1, 16, 1));
  const std::string path = ::testing::TempDir() + "gla_tune_bounded.txt";
  const std::string full = ::testing::TempDir() + "gla_tune_bounded_full.txt";
  std::remove(path.c_str());
  set_env("GLA_TUNE_FILE", path.c_str());
  ASSERT_EQ(oldest.run(), GLA_STATUS_OK) << gla_last_error();
  const size_t bound = record_bound(oldest);
  ASSERT_GE(bound, 2u) << oldest.explain();

  // The library's own line for `oldest`, and copies of it under made-up signatures.
  std::string header, record, line;
  {
    std::ifstream in(path);
    while (std::getline(in, line)) {
      const bool is_header = line.empty() || line[0] == '#' || line.rfind("libgla-tune ", 0) == 0;
      (is_header ? header : record) += line + "\n";
    }
  }
  const std::string signature = record.substr(0, record.find('\t'));
  const std::string rest = record.substr(record.find('\t'));
  ASSERT_FALSE(signature.empty()) << read_file(path);
  {
    std::ofstream out(full, std::ios::trunc);
    out << header << "made-up 0" << rest << record;
    for (size_t i = 1; i < bound; ++i) out << "made-up " << i << rest;
  }
  set_env("GLA_TUNE_FILE", full.c_str());
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(fresh.run(), GLA_STATUS_OK) << gla_last_error();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(slow.runs, 2 * kMeasureRuns);
  const std::string over = "'" + full + "' holds more than " + std::to_string(bound) + " records: the 1 first";
  EXPECT_NE(err.find(over), std::string::npos) << err;
  const std::string dropped = "least recently used records are dropped, from GLA_TUNE_FILE '" + full + "' too";
  EXPECT_NE(err.find(dropped), std::string::npos) << err;

  size_t records = 0;
  bool has_first = false, has_oldest = false, has_second = false, has_fresh = false;
  const std::string fresh_signature = line_after(fresh.explain(), "signature: ");
  ASSERT_FALSE(fresh_signature.empty());
  std::ifstream in(full);
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line.rfind("libgla-tune ", 0) == 0) continue;
    ++records;
    has_first = has_first || line.rfind("made-up 0\t", 0) == 0;
    has_second = has_second || line.rfind("made-up 1\t", 0) == 0;
    has_oldest = has_oldest || line.rfind(signature + "\t", 0) == 0;
    has_fresh = has_fresh || line.rfind(fresh_signature + "\t", 0) == 0;
  }
  EXPECT_EQ(records, bound);
  EXPECT_FALSE(has_first) << "the line beyond the bound was kept";
  EXPECT_FALSE(has_oldest) << "the least recently used record was kept";
  EXPECT_TRUE(has_second);
  EXPECT_TRUE(has_fresh);

  // Dropped from the file: measured again.
  ::testing::internal::CaptureStderr();
  ASSERT_EQ(oldest.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find(dropped), std::string::npos) << "reported more than once";
  EXPECT_EQ(slow.runs, 3 * kMeasureRuns);
  EXPECT_LT(oldest.error(), 1e-12);
  std::remove(path.c_str());
  std::remove(full.c_str());
}

TEST_F(Fastest, CorruptOrStaleFileIsIgnoredWithAWarning) {
  Costed& slow = backend("cf_slow", 10, 1);
  Costed& fast = backend("cf_fast", 1, 2);
  const std::string bodies[] = {
      "libgla-tune 1 " + std::string(gla_version()) + "\nsignature-without-fields\n",
      "libgla-tune 1 0.0.0-other\n",  // stale: another library version
      "\x7f" "ELF garbage\n",
  };
  const char* says[] = {"malformed record", "stale", "not a libgla tuning file"};
  int expected_runs = 0;
  for (int i = 0; i < 3; ++i) {
    // A file of its own per case: the records are read when GLA_TUNE_FILE names another file.
    const std::string path = ::testing::TempDir() + "gla_tune_corrupt" + std::to_string(i) + ".txt";
    {
      std::ofstream out(path, std::ios::trunc);
      out << bodies[i];
    }
    // A different K per case: a new signature, so each case measures.
    ExtCall call(32 + 8 * i);
    set_env("GLA_TUNE_FILE", path.c_str());
    ::testing::internal::CaptureStderr();
    const gla_status s = call.run();
    const std::string err = ::testing::internal::GetCapturedStderr();
    ASSERT_EQ(s, GLA_STATUS_OK) << gla_last_error();
    EXPECT_NE(err.find("GLA_TUNE_FILE '" + path + "' ignored"), std::string::npos) << err;
    EXPECT_NE(err.find(says[i]), std::string::npos) << err;
    expected_runs += kMeasureRuns;
    EXPECT_EQ(slow.runs, expected_runs);
    EXPECT_LT(call.error(), 1e-12);
    // Rewritten as a valid file.
    EXPECT_NE(read_file(path).find("\tcf_fast\t2\t"), std::string::npos) << read_file(path);
    std::remove(path.c_str());
  }
  EXPECT_EQ(fast.runs, 3 * (kMeasureRuns + 1));
}

TEST_F(Fastest, ConcurrentFirstCallsMeasureOnce) {
  Costed& slow = backend("cc_slow", 8, 1);
  Costed& fast = backend("cc_fast", 1, 2);
  constexpr int kThreads = 8;
  std::vector<std::unique_ptr<ExtCall>> calls;
  for (int t = 0; t < kThreads; ++t) calls.push_back(std::make_unique<ExtCall>(48, 100 + t));
  std::atomic<int> ready{0}, failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ExtCall& c = *calls[static_cast<size_t>(t)];
      c.reset();
      gla_options o;
      gla_options_init(&o);
      o.policy = GLA_POLICY_FASTEST;
      ++ready;
      while (ready < kThreads) std::this_thread::yield();
      if (gla_chunk_forward(&c.args, &o) != GLA_STATUS_OK || !(c.error() < 1e-12)) ++failures;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures, 0);
  EXPECT_EQ(slow.runs, kMeasureRuns) << "measured more than once";
  EXPECT_EQ(fast.runs, kMeasureRuns + kThreads) << "every call after the measurement runs the winner";
}

TEST_F(Fastest, NothingIsMeasuredWhileTheStreamIsCaptured) {
  Costed& first = backend("cap_first", 6, 1);
  Costed& second = backend("cap_second", 1, 2);
  first.capturing = true;
  ExtCall call(56);
  EXPECT_NE(call.explain().find("not measured: the stream is being captured into a graph"), std::string::npos)
      << call.explain();
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(first.runs, 1) << "priority serves during capture";
  EXPECT_EQ(second.runs, 0);
  first.capturing = false;
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(first.runs, 1 + kMeasureRuns);
  EXPECT_EQ(second.runs, kMeasureRuns + 1);
  // Captured again: the cached winner serves, nothing is measured.
  first.capturing = true;
  ASSERT_EQ(call.run(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(second.runs, kMeasureRuns + 2);
  EXPECT_LT(call.error(), 1e-12);
}

TEST_F(Fastest, TuneMeasuresAheadOfTimeAndReports) {
  Costed& slow = backend("tu_slow", 9, 1);
  Costed& fast = backend("tu_fast", 1, 2);
  ExtCall call(64);
  call.reset();
  g_caller_o = call.out.o.t.data;
  gla_options o;
  gla_options_init(&o);
  const char* text = nullptr;
  ASSERT_EQ(gla_tune(&call.args, nullptr, &o, &text), GLA_STATUS_OK) << gla_last_error();
  const std::string report = text;
  EXPECT_NE(report.find("tu_fast: "), std::string::npos) << report;
  EXPECT_NE(report.find("decision: tu_fast (whole operation)"), std::string::npos) << report;
  EXPECT_EQ(slow.runs, kMeasureRuns);
  EXPECT_EQ(fast.runs, kMeasureRuns);
  EXPECT_EQ(slow.caller_runs + fast.caller_runs, 0) << "tune wrote the given outputs";
  EXPECT_FALSE(all_finite(call.out.o)) << "tune wrote the given outputs";
  // Production: served at once.
  ASSERT_EQ(call.run(), GLA_STATUS_OK);
  EXPECT_EQ(fast.runs, kMeasureRuns + 1);
  EXPECT_EQ(slow.runs, kMeasureRuns);
  // Tuning again measures again.
  ASSERT_EQ(gla_tune(&call.args, nullptr, &o, &text), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(slow.runs, 2 * kMeasureRuns);
  // A forced backend is not something to tune.
  o.backend = "tu_fast";
  EXPECT_EQ(gla_tune(&call.args, nullptr, &o, &text), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("tune: expected no forced backend"), std::string::npos) << gla_last_error();
}

// Many threads at once over the built-in backends with every policy and several signatures (forward
// and backward, the stage pipeline), while backends come and go: every result equals the reference
// within the host tolerance. Run under ThreadSanitizer in CI (scripts/sanitize.sh).
TEST(FastestStress, ManyThreadsPoliciesAndSignatures) {
  const int32_t policies[] = {GLA_POLICY_FASTEST, GLA_POLICY_PRIORITY, GLA_POLICY_DEFAULT, GLA_POLICY_FASTEST};
  std::vector<Inputs> inputs;
  std::vector<Outputs> want;
  for (int i = 0; i < 6; ++i) {
    Case c;
    c.B = 1 + i % 2; c.T = 30 + 25 * i; c.H = 1 + i % 2; c.K = 8 * (1 + i % 3); c.V = 8; c.seed = 300 + i;
    c.per_head_gate = i == 4;
    inputs.push_back(make_inputs(c));
    want.emplace_back();
    ASSERT_EQ(run_forward(inputs.back(), want.back(), {"reference"}), GLA_STATUS_OK);
    ASSERT_EQ(run_backward(inputs.back(), want.back(), {"reference"}), GLA_STATUS_OK);
  }
  std::atomic<int> bad{0}, errors{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < 12; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < 4; ++r) {
        for (size_t k = 0; k < inputs.size(); ++k) {
          const size_t i = (k + static_cast<size_t>(t)) % inputs.size();
          Outputs out;
          const gla_chunk_forward_args fa = forward_args(inputs[i], out);
          const gla_chunk_backward_args ba = backward_args(inputs[i], out);
          gla_options o;
          gla_options_init(&o);
          o.policy = policies[(static_cast<size_t>(t) + r) % 4];
          o.force_stage_pipeline = (t + r) % 5 == 4;
          if (gla_chunk_forward(&fa, &o) != GLA_STATUS_OK || gla_chunk_backward(&ba, &o) != GLA_STATUS_OK) {
            ++errors;
            continue;
          }
          std::string report;
          if (!(max_error(out, want[i], true, report) < 1e-5)) ++bad;
          const char* text = nullptr;
          if (gla_explain(&fa, nullptr, &o, &text) != GLA_STATUS_OK) ++errors;
        }
      }
    });
  }
  // Backends registered and removed meanwhile (never accepting: they serve EXT only), which changes
  // nothing for host problems but churns the registry under the dispatchers' feet.
  Costed churn;
  churn.name = "stress_churn";
  threads.emplace_back([&] {
    while (!stop) {
      add(churn, 5);
      gla_backend_count();
      gla_unregister_backend("stress_churn");
    }
  });
  for (size_t t = 0; t + 1 < threads.size(); ++t) threads[t].join();
  stop = true;
  threads.back().join();
  EXPECT_EQ(errors, 0) << gla_last_error();
  EXPECT_EQ(bad, 0);
}

}  // namespace
