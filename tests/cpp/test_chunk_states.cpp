// gla_chunk_forward_saving_states / gla_chunk_backward_from_states (gla.h): the forward's saved
// chunk-start states against the fwd_h stage's (captured from a stage pipeline by a callback
// backend standing in for fwd_o), the backward from saved states against the ordinary backward on
// the cpu backend, validation of chunk_states (argument named, outputs untouched), and the decline
// of backends and of the stage pipeline that do not handle saved states.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "test_support.hpp"

using namespace gla::test;

namespace {

bool cpu_available() { return backend_available("cpu"); }

constexpr int64_t kChunk = 64;


gla_options options_for(const Inputs& in, const char* backend, bool pipeline = false) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = in.c.state_v_first;
  o.backend = backend;
  o.force_stage_pipeline = pipeline;
  return o;
}

HostTensor new_states(const Inputs& in) {
  HostTensor h(GLA_DTYPE_F32, {saved_state_chunks(in), in.c.H, in.c.K, in.c.V});
  poison(h);
  return h;
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

bool all_nan(const HostTensor& x) {
  for (int64_t i = 0; i < x.size(); ++i) {
    if (!std::isnan(x.get(i))) return false;
  }
  return true;
}

// ---- A callback backend that stands in for the last forward stage (fwd_o) and keeps a copy of
// the chunk-start states the fwd_h stage before it wrote (problem.h). It writes o with zeros. ----
std::vector<float> g_captured;
int64_t g_captured_chunks = -1;

int32_t capture_verify(void*, const gla_problem*, char*, size_t) { return 1; }
int32_t capture_run(void*, const gla_problem* p, char* message, size_t capacity) {
  if (p->h.data == nullptr || p->h.dtype != GLA_DTYPE_F32) {
    std::snprintf(message, capacity, "capture: no fp32 h");
    return GLA_STATUS_INTERNAL_ERROR;
  }
  int64_t n = 1;
  for (int i = 0; i < p->h.rank; ++i) n *= p->h.sizes[i];
  const float* h = static_cast<const float*>(p->h.data);
  g_captured.assign(h, h + n);
  g_captured_chunks = p->h.sizes[0];
  // o: zeros (not compared).
  for (int64_t b = 0; b < p->o.sizes[0]; ++b)
    for (int64_t t = 0; t < p->o.sizes[1]; ++t)
      for (int64_t hh = 0; hh < p->o.sizes[2]; ++hh)
        for (int64_t d = 0; d < p->o.sizes[3]; ++d) {
          const int64_t off = b * p->o.strides[0] + t * p->o.strides[1] + hh * p->o.strides[2] + d * p->o.strides[3];
          if (p->o.dtype == GLA_DTYPE_F32) {
            static_cast<float*>(p->o.data)[off] = 0.0f;
          } else {
            static_cast<uint16_t*>(p->o.data)[off] = 0;
          }
        }
  return GLA_STATUS_OK;
}

class CaptureBackend {
 public:
  CaptureBackend() {
    gla_backend_desc d{};
    d.abi_version = GLA_ABI_VERSION;
    d.name = "capture_h";
    d.priority = 3000;
    d.device_mask = 1ull << GLA_DEVICE_CPU;
    d.unit_mask = 1ull << GLA_UNIT_FWD_O;
    d.verify = capture_verify;
    d.run = capture_run;
    ok_ = gla_register_backend(&d) == GLA_STATUS_OK;
  }
  ~CaptureBackend() {
    if (ok_) gla_unregister_backend("capture_h");
  }
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
};

// The chunk-start states of the fwd_h stage of `backend`'s stage pipeline.
HostTensor stage_states(const Inputs& in, const char* backend) {
  Outputs scratch;
  gla_chunk_forward_args a = forward_args(in, scratch);
  const std::string spec = std::string(backend) + ",fwd_o=capture_h";
  gla_options o = options_for(in, spec.c_str(), true);
  g_captured.clear();
  g_captured_chunks = -1;
  HostTensor h(GLA_DTYPE_F32, {saved_state_chunks(in), in.c.H, in.c.K, in.c.V});
  poison(h);
  const gla_status s = gla_chunk_forward(&a, &o);
  EXPECT_EQ(s, GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(g_captured_chunks, saved_state_chunks(in));
  if (s == GLA_STATUS_OK && static_cast<int64_t>(g_captured.size()) == h.size()) {
    std::memcpy(h.bytes.data(), g_captured.data(), g_captured.size() * 4);
  }
  return h;
}

Case make_case(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, uint64_t seed) {
  Case c;
  c.B = B, c.T = T, c.H = H, c.K = K, c.V = V, c.seed = seed;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back(make_case(2, 300, 3, 48, 40, 11));  // partial last chunk, K != V
  Case c = make_case(2, 300, 3, 48, 40, 12);
  c.state_v_first = true;
  out.push_back(c);
  c = make_case(1, 256, 2, 128, 128, 13);  // wide values: the forward splits V into tiles
  out.push_back(c);
  c = make_case(1, 201, 2, 64, 32, 14);  // varlen with an empty and a 1-token sequence
  c.cu_seqlens = {0, 0, 1, 65, 200, 200, 201};
  out.push_back(c);
  c.seed = 15;
  c.state_v_first = true;
  c.initial_state = false;
  out.push_back(c);
  c = make_case(2, 130, 2, 32, 64, 16);  // per-head gate, strong decay, randn inputs
  c.per_head_gate = true;
  c.normaliser = 0.1;
  c.randn_inputs = true;
  out.push_back(c);
  c = make_case(1, 200, 2, 64, 64, 17);  // bf16 inputs
  c.dtype = GLA_DTYPE_BF16;
  c.cu_seqlens = {0, 1, 70, 200};
  out.push_back(c);
  c = make_case(1, 64, 1, 16, 16, 18);  // no final state
  c.final_state = false;
  out.push_back(c);
  return out;
}

TEST(ChunkStates, ForwardSavesTheStageStates) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not available";
  CaptureBackend capture;
  ASSERT_TRUE(capture.ok()) << gla_last_error();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label());
    const Inputs in = make_inputs(c);
    // The cpu forward with and without saving: o and final_state bitwise the same.
    Outputs plain, saving;
    gla_chunk_forward_args a = forward_args(in, plain);
    gla_options o = options_for(in, "cpu");
    ASSERT_EQ(gla_chunk_forward(&a, &o), GLA_STATUS_OK) << gla_last_error();
    a = forward_args(in, saving);
    HostTensor h = new_states(in);
    ASSERT_EQ(gla_chunk_forward_saving_states(&a, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
    EXPECT_TRUE(same_bits(plain.o, saving.o));
    if (c.final_state) {
      EXPECT_TRUE(same_bits(plain.ht, saving.ht));
    }
    EXPECT_TRUE(all_finite(h)) << "a chunk state was not written";
    // Against the reference's and the cpu's fwd_h stage.
    const HostTensor ref = stage_states(in, "reference");
    EXPECT_LT(rel_rms(h, ref), 1e-5) << "chunk_states vs reference fwd_h";
    const HostTensor cpu = stage_states(in, "cpu");
    EXPECT_LT(rel_rms(h, cpu), 1e-5) << "chunk_states vs cpu fwd_h";
    // Chunk 0 of each non-empty sequence is the initial state (key-major whatever state_v_first).
    int64_t first = 0;
    for (int64_t n = 0; n < in.N; ++n) {
      const int64_t len = c.cu_seqlens.empty() ? c.T : c.cu_seqlens[n + 1] - c.cu_seqlens[n];
      if (len == 0) continue;
      for (int64_t hh = 0; hh < c.H; ++hh)
        for (int64_t i = 0; i < c.K; ++i)
          for (int64_t j = 0; j < c.V; ++j) {
            const double want = !c.initial_state ? 0.0
                                : c.state_v_first ? in.h0.get(((n * c.H + hh) * c.V + j) * c.K + i)
                                                  : in.h0.get(((n * c.H + hh) * c.K + i) * c.V + j);
            ASSERT_EQ(h.get(((first * c.H + hh) * c.K + i) * c.V + j), want) << "n=" << n << " h=" << hh;
          }
      first += (len + kChunk - 1) / kChunk;
    }
  }
}

TEST(ChunkStates, BackwardFromStatesEqualsBackward) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not available";
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.label());
    const Inputs in = make_inputs(c);
    Outputs fwd;
    gla_chunk_forward_args fa = forward_args(in, fwd);
    gla_options o = options_for(in, "cpu");
    HostTensor h = new_states(in);
    ASSERT_EQ(gla_chunk_forward_saving_states(&fa, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
    Outputs want, got, ref;
    gla_chunk_backward_args ba = backward_args(in, want);
    ASSERT_EQ(gla_chunk_backward(&ba, &o), GLA_STATUS_OK) << gla_last_error();
    ba = backward_args(in, got);
    ASSERT_EQ(gla_chunk_backward_from_states(&ba, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
    // Not bitwise: the forward steps the state with its own product order, the backward's pass 1
    // with another (relative differences ~1e-8 in fp32). The bar is SPEC §5's against the plain
    // backward, and for fp32 also 1e-6 (two orders below the usual differences of a wrong state).
    std::string report;
    const double diff = max_error(got, want, true, report);
    EXPECT_LT(diff, host_tolerance(c.dtype)) << report;
    if (c.dtype == GLA_DTYPE_F32) {
      EXPECT_LT(diff, 1e-6) << report;
    }
    for (const HostTensor* t : {&got.dq, &got.dk, &got.dv, &got.dg, &got.dh0}) EXPECT_TRUE(all_finite(*t));
    EXPECT_TRUE(same_bits(got.dh0, want.dh0)) << "dh0 does not depend on the states";
    // And within SPEC §5 of the reference.
    gla_options r = options_for(in, "reference");
    ba = backward_args(in, ref);
    ASSERT_EQ(gla_chunk_backward(&ba, &r), GLA_STATUS_OK) << gla_last_error();
    report.clear();
    EXPECT_LT(max_error(got, ref, true, report), host_tolerance(c.dtype)) << report;
  }
}

TEST(ChunkStates, NullStatesAreThePlainCalls) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not available";
  Case c = make_case(1, 150, 2, 32, 32, 21);
  const Inputs in = make_inputs(c);
  for (const char* backend : {"cpu", "reference"}) {
    SCOPED_TRACE(backend);
    gla_options o = options_for(in, backend);
    Outputs a1, a2;
    gla_chunk_forward_args fa = forward_args(in, a1);
    ASSERT_EQ(gla_chunk_forward(&fa, &o), GLA_STATUS_OK) << gla_last_error();
    fa = forward_args(in, a2);
    ASSERT_EQ(gla_chunk_forward_saving_states(&fa, nullptr, &o), GLA_STATUS_OK) << gla_last_error();
    EXPECT_TRUE(same_bits(a1.o, a2.o));
    EXPECT_TRUE(same_bits(a1.ht, a2.ht));
    gla_chunk_backward_args ba = backward_args(in, a1);
    ASSERT_EQ(gla_chunk_backward(&ba, &o), GLA_STATUS_OK) << gla_last_error();
    ba = backward_args(in, a2);
    ASSERT_EQ(gla_chunk_backward_from_states(&ba, nullptr, &o), GLA_STATUS_OK) << gla_last_error();
    EXPECT_TRUE(same_bits(a1.dq, a2.dq) && same_bits(a1.dk, a2.dk) && same_bits(a1.dv, a2.dv) &&
                same_bits(a1.dg, a2.dg) && same_bits(a1.dh0, a2.dh0));
  }
}

// Every bad chunk_states: rejected with INVALID_ARGUMENT naming chunk_states, expected and got,
// outputs (and, for the forward, chunk_states itself) untouched.
TEST(ChunkStates, BadStatesRejected) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not available";
  Case c = make_case(1, 200, 2, 32, 16, 31);
  c.cu_seqlens = {0, 0, 1, 130, 200};  // NC = 0 + 1 + 3 + 2 = 6
  const Inputs in = make_inputs(c);
  ASSERT_EQ(saved_state_chunks(in), 6);
  struct Bad {
    const char* what;
    HostTensor h;
  };
  std::vector<Bad> bad;
  bad.push_back({"dtype f64", HostTensor(GLA_DTYPE_F64, {6, c.H, c.K, c.V})});
  bad.push_back({"dtype f16", HostTensor(GLA_DTYPE_F16, {6, c.H, c.K, c.V})});
  bad.push_back({"chunk count + 1", HostTensor(GLA_DTYPE_F32, {7, c.H, c.K, c.V})});
  bad.push_back({"chunk count of T / 64 rounded up", HostTensor(GLA_DTYPE_F32, {4, c.H, c.K, c.V})});
  bad.push_back({"K and V swapped", HostTensor(GLA_DTYPE_F32, {6, c.H, c.V, c.K})});
  bad.push_back({"rank 3", HostTensor(GLA_DTYPE_F32, {6, c.H, c.K * c.V})});
  bad.push_back({"batch-major [N, NT, H, K, V]", HostTensor(GLA_DTYPE_F32, {4, 2, c.H, c.K, c.V})});
  bad.push_back({"non-contiguous", strided_copy(HostTensor(GLA_DTYPE_F32, {6, c.H, c.K, c.V}))});
  HostTensor on_gpu(GLA_DTYPE_F32, {6, c.H, c.K, c.V});
  on_gpu.t.device_type = GLA_DEVICE_CUDA;
  bad.push_back({"device", on_gpu});
  bad.back().h.t.device_type = GLA_DEVICE_CUDA;
  HostTensor null_data(GLA_DTYPE_F32, {6, c.H, c.K, c.V});
  null_data.t.data = nullptr;
  bad.push_back({"null data", null_data});
  bad.back().h.t.data = nullptr;
  for (Bad& b : bad) {
    SCOPED_TRACE(b.what);
    if (b.h.t.data) poison(b.h);
    gla_options o = options_for(in, nullptr);
    Outputs f;
    gla_chunk_forward_args fa = forward_args(in, f);
    EXPECT_EQ(gla_chunk_forward_saving_states(&fa, &b.h.t, &o), GLA_STATUS_INVALID_ARGUMENT);
    std::string msg = gla_last_error();
    EXPECT_NE(msg.find("chunk_states"), std::string::npos) << msg;
    if (b.h.t.data) {  // (a NULL pointer's message names the argument and the element count)
      EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
      EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    }
    EXPECT_TRUE(all_nan(f.o)) << "o written on error";
    EXPECT_TRUE(all_nan(f.ht)) << "final_state written on error";
    if (b.h.t.data && b.h.t.dtype == GLA_DTYPE_F32) {
      EXPECT_TRUE(all_nan(b.h)) << "chunk_states written on error";
    }
    Outputs g;
    gla_chunk_backward_args ba = backward_args(in, g);
    EXPECT_EQ(gla_chunk_backward_from_states(&ba, &b.h.t, &o), GLA_STATUS_INVALID_ARGUMENT);
    msg = gla_last_error();
    EXPECT_NE(msg.find("chunk_states"), std::string::npos) << msg;
    for (const HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dh0}) EXPECT_TRUE(all_nan(*t)) << "gradient written on error";
  }
  // The right shape passes (the negative cases above are not failing for another reason).
  HostTensor h = new_states(in);
  gla_options o = options_for(in, nullptr);
  Outputs f;
  gla_chunk_forward_args fa = forward_args(in, f);
  EXPECT_EQ(gla_chunk_forward_saving_states(&fa, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
}

// Backends without saved-state support, and the stage pipeline, decline with a reason.
TEST(ChunkStates, OtherBackendsDecline) {
  Case c = make_case(1, 100, 1, 16, 16, 41);
  const Inputs in = make_inputs(c);
  HostTensor h = new_states(in);
  for (bool pipeline : {false, true}) {
    SCOPED_TRACE(pipeline ? "stage pipeline" : "reference");
    gla_options o = options_for(in, pipeline ? "cpu" : "reference", pipeline);
    if (pipeline && !cpu_available()) continue;
    Outputs f;
    gla_chunk_forward_args fa = forward_args(in, f);
    EXPECT_EQ(gla_chunk_forward_saving_states(&fa, &h.t, &o), GLA_STATUS_NOT_SUPPORTED);
    std::string msg = gla_last_error();
    EXPECT_NE(msg.find(pipeline ? "stage pipeline does not write saved chunk states"
                                : "does not write saved chunk states in f32 (chunk_states)"),
              std::string::npos)
        << msg;
    EXPECT_TRUE(all_nan(f.o));
    EXPECT_TRUE(all_nan(h));
    Outputs g;
    gla_chunk_backward_args ba = backward_args(in, g);
    EXPECT_EQ(gla_chunk_backward_from_states(&ba, &h.t, &o), GLA_STATUS_NOT_SUPPORTED);
    msg = gla_last_error();
    EXPECT_NE(msg.find(pipeline ? "stage pipeline does not read saved chunk states"
                                : "does not read saved chunk states in f32 (chunk_states)"),
              std::string::npos)
        << msg;
    EXPECT_TRUE(all_nan(g.dq));
  }
  // explain() is unchanged by the new entry points; the dispatcher's default choice takes them.
  if (cpu_available()) {
    gla_options o = options_for(in, nullptr);
    Outputs f;
    gla_chunk_forward_args fa = forward_args(in, f);
    EXPECT_EQ(gla_chunk_forward_saving_states(&fa, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
  }
}

// bf16 saved states are valid arguments (the `cuda` backend's), which the `cpu` backend, saving
// f32 states, declines with that reason: forced, NOT_SUPPORTED and nothing written; by default no
// backend on the host takes them.
TEST(ChunkStates, CpuDeclinesBf16States) {
  if (!cpu_available()) GTEST_SKIP() << "cpu backend not available";
  Case c = make_case(1, 100, 1, 16, 16, 43);
  const Inputs in = make_inputs(c);
  HostTensor h(GLA_DTYPE_BF16, {saved_state_chunks(in), c.H, c.K, c.V});
  poison(h);
  const std::vector<uint8_t> before = h.bytes;
  for (const char* backend : {"cpu", static_cast<const char*>(nullptr)}) {
    SCOPED_TRACE(backend ? backend : "default choice");
    gla_options o = options_for(in, backend);
    Outputs f;
    gla_chunk_forward_args fa = forward_args(in, f);
    EXPECT_EQ(gla_chunk_forward_saving_states(&fa, &h.t, &o), GLA_STATUS_NOT_SUPPORTED);
    std::string msg = gla_last_error();
    if (backend) {
      EXPECT_NE(msg.find("does not write saved chunk states in bf16 (chunk_states)"), std::string::npos) << msg;
    }
    EXPECT_TRUE(all_nan(f.o));
    EXPECT_TRUE(h.bytes == before) << "chunk_states written on a declined call";
    Outputs g;
    gla_chunk_backward_args ba = backward_args(in, g);
    EXPECT_EQ(gla_chunk_backward_from_states(&ba, &h.t, &o), GLA_STATUS_NOT_SUPPORTED);
    msg = gla_last_error();
    if (backend) {
      EXPECT_NE(msg.find("does not read saved chunk states in bf16 (chunk_states)"), std::string::npos) << msg;
    }
    for (const HostTensor* t : {&g.dq, &g.dk, &g.dv, &g.dg, &g.dh0}) EXPECT_TRUE(all_nan(*t)) << "gradient written";
  }
}

}  // namespace
