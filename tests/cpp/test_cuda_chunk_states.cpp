// The cuda backend's saved chunk states (gla_chunk_forward_saving_states / _backward_from_states
// with bf16 chunk_states): the forward's o and final state bitwise those of the plain forward, its
// states against the cpu backend's fp32 ones (themselves checked against the reference's fwd_h
// stage in test_chunk_states.cpp), every state written (NaN-poisoned before the call); the backward
// from them against the reference, on both paths of the state gradients (T a multiple of 64: no
// state walks at all; else the reverse walks only) and with varlen (the forward's states, and the
// cpu's uploaded);
// bitwise reruns; and the declines with their reasons. Skips with a message without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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

gla_options options_for(const Inputs& in, const char* backend) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = in.c.state_v_first;
  o.backend = backend;
  return o;
}

bool same_bits(const HostTensor& a, const HostTensor& b) {
  return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

std::unique_ptr<DeviceTensor> device_copy(const HostTensor& h, bool copy = true) {
  if (h.empty()) return nullptr;
  return std::make_unique<DeviceTensor>(h, copy);
}

// The inputs on the device, and the argument structs over them.
struct DeviceInputs {
  std::unique_ptr<DeviceTensor> q, k, v, g, h0, cu, dout, dht;
  explicit DeviceInputs(const Inputs& in)
      : q(device_copy(in.q)), k(device_copy(in.k)), v(device_copy(in.v)), g(device_copy(in.g)),
        h0(device_copy(in.h0)), cu(device_copy(in.cu)), dout(device_copy(in.dout)), dht(device_copy(in.dht)) {}
};

struct ForwardRun {
  gla_status status;
  std::string error;
  Outputs out;
  HostTensor states;  // bf16 [NC, H, K, V]
};

// The cuda forward, saving bf16 states when `save` (into NaN-poisoned device memory).
ForwardRun cuda_forward(const Inputs& in, bool save, int32_t states_dtype = GLA_DTYPE_BF16) {
  ForwardRun r;
  gla_chunk_forward_args host = forward_args(in, r.out);
  DeviceInputs d(in);
  auto o = device_copy(r.out.o, false), ht = device_copy(r.out.ht, false);
  r.states = HostTensor(states_dtype, {saved_state_chunks(in), in.c.H, in.c.K, in.c.V});
  auto states = device_copy(r.states, false);
  gla_chunk_forward_args a{};
  a.q = &d.q->t;
  a.k = &d.k->t;
  a.v = &d.v->t;
  a.g = &d.g->t;
  a.initial_state = d.h0 ? &d.h0->t : nullptr;
  a.cu_seqlens = d.cu ? &d.cu->t : nullptr;
  a.cu_seqlens_host = d.cu ? in.cu.desc() : nullptr;
  a.o = &o->t;
  a.final_state = host.final_state ? &ht->t : nullptr;
  const gla_options opt = options_for(in, "cuda");
  r.status = save ? gla_chunk_forward_saving_states(&a, &states->t, &opt) : gla_chunk_forward(&a, &opt);
  r.error = gla_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o->to_host(r.out.o);
  if (ht) ht->to_host(r.out.ht);
  states->to_host(r.states);
  return r;
}

struct BackwardRun {
  gla_status status;
  std::string error;
  Outputs out;
};

// The cuda backward from the given saved states (host copy, uploaded).
BackwardRun cuda_backward_from(const Inputs& in, const HostTensor& states) {
  BackwardRun r;
  gla_chunk_backward_args host = backward_args(in, r.out);
  DeviceInputs d(in);
  auto saved = device_copy(states);
  auto dq = device_copy(r.out.dq, false), dk = device_copy(r.out.dk, false), dv = device_copy(r.out.dv, false);
  auto dg = device_copy(r.out.dg, false), dh0 = device_copy(r.out.dh0, false);
  gla_chunk_backward_args a{};
  a.q = &d.q->t;
  a.k = &d.k->t;
  a.v = &d.v->t;
  a.g = &d.g->t;
  a.initial_state = d.h0 ? &d.h0->t : nullptr;
  a.cu_seqlens = d.cu ? &d.cu->t : nullptr;
  a.cu_seqlens_host = d.cu ? in.cu.desc() : nullptr;
  a.do_ = &d.dout->t;
  a.dht = host.dht ? &d.dht->t : nullptr;
  a.dq = &dq->t;
  a.dk = &dk->t;
  a.dv = &dv->t;
  a.dg = &dg->t;
  a.dh0 = dh0 ? &dh0->t : nullptr;
  const gla_options opt = options_for(in, "cuda");
  r.status = gla_chunk_backward_from_states(&a, &saved->t, &opt);
  r.error = gla_last_error();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dq->to_host(r.out.dq);
  dk->to_host(r.out.dk);
  dv->to_host(r.out.dv);
  dg->to_host(r.out.dg);
  if (dh0) dh0->to_host(r.out.dh0);
  return r;
}

// The cpu backend's fp32 saved states for `in`.
HostTensor cpu_states(const Inputs& in) {
  Outputs scratch;
  gla_chunk_forward_args a = forward_args(in, scratch);
  HostTensor h(GLA_DTYPE_F32, {saved_state_chunks(in), in.c.H, in.c.K, in.c.V});
  poison(h);
  const gla_options o = options_for(in, "cpu");
  EXPECT_EQ(gla_chunk_forward_saving_states(&a, &h.t, &o), GLA_STATUS_OK) << gla_last_error();
  return h;
}

HostTensor to_bf16(const HostTensor& x) {
  std::vector<int64_t> sizes(x.t.sizes, x.t.sizes + x.t.rank);
  HostTensor y(GLA_DTYPE_BF16, sizes);
  for (int64_t i = 0; i < x.size(); ++i) y.set(i, x.get(i));
  return y;
}

HostTensor to_f32(const HostTensor& x) {
  std::vector<int64_t> sizes(x.t.sizes, x.t.sizes + x.t.rank);
  HostTensor y(GLA_DTYPE_F32, sizes);
  for (int64_t i = 0; i < x.size(); ++i) y.set(i, x.get(i));
  return y;
}

Outputs reference_backward(const Inputs& in) {
  Outputs ref;
  EXPECT_EQ(run_backward(in, ref, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
  return ref;
}

void expect_matches_reference(const Inputs& in, const BackwardRun& got) {
  ASSERT_EQ(got.status, GLA_STATUS_OK) << got.error;
  for (const HostTensor* t : {&got.out.dq, &got.out.dk, &got.out.dv, &got.out.dg, &got.out.dh0}) {
    if (!t->empty()) {
      EXPECT_TRUE(all_finite(*t)) << "unwritten or non-finite gradient";
    }
  }
  std::string report;
  EXPECT_LT(max_error(got.out, reference_backward(in), true, report), 5e-3) << report;
}

// Forward saving states, then the backward from them, for one case.
void check_round_trip(const Case& c) {
  SCOPED_TRACE(c.label());
  const Inputs in = make_inputs(c);
  const ForwardRun plain = cuda_forward(in, false);
  const ForwardRun saving = cuda_forward(in, true);
  ASSERT_EQ(plain.status, GLA_STATUS_OK) << plain.error;
  ASSERT_EQ(saving.status, GLA_STATUS_OK) << saving.error;
  EXPECT_TRUE(same_bits(plain.out.o, saving.out.o)) << "saving states changed o";
  EXPECT_TRUE(same_bits(plain.out.ht, saving.out.ht)) << "saving states changed the final state";
  EXPECT_TRUE(all_finite(saving.states)) << "a chunk state was not written";
  // bf16 rounding of each entry: relative RMS about 2^-9 / sqrt(3).
  EXPECT_LT(rel_rms(to_f32(saving.states), cpu_states(in)), 3e-3) << "saved states vs the cpu backend's";
  expect_matches_reference(in, cuda_backward_from(in, saving.states));
}

TEST(CudaChunkStates, ForwardSavesAndBackwardReads) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dt : {GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    check_round_trip(base_case(dt, 2, 256, 2, 128));  // T % 64 = 0: no state walks
    check_round_trip(base_case(dt, 2, 300, 2, 64));   // partial last chunk: reverse walks only
  }
  for (auto kv : {std::pair<int64_t, int64_t>{256, 512}, {64, 128}, {128, 256}, {200, 72}, {100, 36}}) {
    for (int64_t T : {192, 130}) {
      Case c = base_case(GLA_DTYPE_BF16, 1, T, 2, 64);
      c.K = kv.first;
      c.V = kv.second;
      check_round_trip(c);
    }
    // fla's GLA layer: state_v_first with K != V, in training without initial or final state
    Case m = base_case(GLA_DTYPE_BF16, 2, 256, 2, 64);
    m.K = kv.first;
    m.V = kv.second;
    m.state_v_first = true;
    check_round_trip(m);
    m.initial_state = false;
    m.final_state = false;
    check_round_trip(m);
  }
  Case v = base_case(GLA_DTYPE_BF16, 2, 256, 2, 64);
  v.state_v_first = true;
  check_round_trip(v);
  v.initial_state = false;
  v.final_state = false;
  check_round_trip(v);
  Case f = base_case(GLA_DTYPE_BF16, 2, 192, 2, 128);
  f.gate_f32 = true;  // the single-role forward kernel
  check_round_trip(f);
  f.per_head_gate = true;
  check_round_trip(f);
  Case strong = base_case(GLA_DTYPE_BF16, 1, 512, 2, 64);
  strong.gate_floor = -30.0;
  strong.randn_inputs = true;
  check_round_trip(strong);
  check_round_trip(base_case(GLA_DTYPE_BF16, 1, 65536, 1, 64));  // segment splits of both
  check_round_trip(base_case(GLA_DTYPE_BF16, 1, 65536 - 17, 1, 64));
}

// With cu_seqlens the states are in the C API's per-sequence layout (slot: the sequence's first chunk,
// from a chunk table the forward builds on the device): the forward saves them (every slot written,
// matching the cpu backend's), and the backward reads them, the forward's and the cpu's rounded to
// bf16. Empty, one-token and partial-chunk sequences; both forward kernels (the fp32 gate takes the
// single-role one); K != V with the key split; a sequence long enough for the segment splits.
TEST(CudaChunkStates, VarlenForwardSavesAndBackwardReads) {
  SKIP_WITHOUT_CUDA();
  for (const std::vector<int64_t>& cu : {std::vector<int64_t>{0, 0, 1, 65, 200, 200, 330}, {0, 128, 128, 320}}) {
    for (int64_t D : {64, 100, 128}) {
      Case c = base_case(GLA_DTYPE_BF16, 1, cu.back(), 2, D);
      c.cu_seqlens = cu;
      check_round_trip(c);
      SCOPED_TRACE(c.label());
      const Inputs in = make_inputs(c);
      expect_matches_reference(in, cuda_backward_from(in, to_bf16(cpu_states(in))));
    }
  }
  for (auto kv : {std::pair<int64_t, int64_t>{256, 512}, {64, 128}, {128, 256}, {200, 72}}) {
    Case c = base_case(GLA_DTYPE_BF16, 1, 330, 2, 64);
    c.cu_seqlens = {0, 0, 1, 65, 200, 200, 330};
    c.K = kv.first;
    c.V = kv.second;
    check_round_trip(c);
    c.state_v_first = true;
    check_round_trip(c);
  }
  Case f = base_case(GLA_DTYPE_F16, 1, 330, 2, 128);
  f.cu_seqlens = {0, 130, 130, 330};
  f.gate_f32 = true;
  check_round_trip(f);
  Case longer = base_case(GLA_DTYPE_BF16, 1, 20100, 1, 64);
  longer.cu_seqlens = {0, 100, 20100};
  check_round_trip(longer);
}

TEST(CudaChunkStates, BitwiseReruns) {
  SKIP_WITHOUT_CUDA();
  for (int64_t T : {1024, 1000}) {
    const Inputs in = make_inputs(base_case(GLA_DTYPE_BF16, 2, T, 2, 128));
    const ForwardRun a = cuda_forward(in, true), b = cuda_forward(in, true);
    ASSERT_EQ(a.status, GLA_STATUS_OK) << a.error;
    EXPECT_TRUE(same_bits(a.states, b.states));
    const BackwardRun x = cuda_backward_from(in, a.states), y = cuda_backward_from(in, a.states);
    ASSERT_EQ(x.status, GLA_STATUS_OK) << x.error;
    EXPECT_TRUE(same_bits(x.out.dq, y.out.dq) && same_bits(x.out.dk, y.out.dk) && same_bits(x.out.dv, y.out.dv) &&
                same_bits(x.out.dg, y.out.dg) && same_bits(x.out.dh0, y.out.dh0));
  }
}

// What the cuda backend does not save, declined with the reason, nothing written.
TEST(CudaChunkStates, DeclinesWithReasons) {
  SKIP_WITHOUT_CUDA();
  struct Decline {
    Case c;
    int32_t states_dtype;
    const char* reason;
  };
  std::vector<Decline> declines;
  declines.push_back({base_case(GLA_DTYPE_BF16, 1, 128, 1, 64), GLA_DTYPE_F32,
                      "does not write saved chunk states in f32 (chunk_states)"});
  declines.push_back({base_case(GLA_DTYPE_F32, 1, 128, 1, 64), GLA_DTYPE_BF16, "saved chunk states need 16-bit q, k, v"});
  declines.push_back({base_case(GLA_DTYPE_BF16, 1, 128, 1, 300), GLA_DTYPE_BF16,
                      "saved chunk states need K <= 256 (the chunk kernels)"});
  for (const Decline& d : declines) {
    SCOPED_TRACE(d.c.label());
    const Inputs in = make_inputs(d.c);
    const ForwardRun r = cuda_forward(in, true, d.states_dtype);
    EXPECT_EQ(r.status, GLA_STATUS_NOT_SUPPORTED);
    EXPECT_NE(r.error.find(d.reason), std::string::npos) << r.error;
    for (int64_t i = 0; i < r.out.o.size(); ++i) {
      if (!std::isnan(r.out.o.get(i))) {
        ADD_FAILURE() << "o[" << i << "] written on a declined call";
        break;
      }
    }
  }
}

#else

TEST(CudaChunkStates, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: GPU tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
