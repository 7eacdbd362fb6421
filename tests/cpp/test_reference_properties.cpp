// Properties of the reference backend that hold for any correct GLA: gradients equal central finite
// differences, varlen equals one call per sequence, empty sequences pass the state through, the two
// state layouts agree, strided inputs equal contiguous ones, and repeated calls are bitwise equal.
#include <gtest/gtest.h>

#include <cstring>

#include "test_support.hpp"

using namespace gla::test;

namespace {

const RunOptions kReference{"reference"};

// L = <o, do> + <final_state, dht>, accumulated in double.
double loss(const Inputs& in) {
  Outputs out;
  EXPECT_EQ(run_forward(in, out, kReference), GLA_STATUS_OK) << gla_last_error();
  double l = 0;
  for (int64_t i = 0; i < out.o.size(); ++i) l += out.o.get(i) * in.dout.get(i);
  for (int64_t i = 0; i < out.ht.size(); ++i) l += out.ht.get(i) * in.dht.get(i);
  return l;
}

TEST(ReferenceGradients, MatchCentralFiniteDifferences) {
  Case c;
  c.B = 1; c.T = 19; c.H = 2; c.K = 4; c.V = 3; c.seed = 5;
  Inputs base = make_inputs(c);
  Outputs grads;
  ASSERT_EQ(run_backward(base, grads, kReference), GLA_STATUS_OK) << gla_last_error();
  struct Target { const char* name; HostTensor Inputs::*input; HostTensor Outputs::*grad; };
  const Target targets[] = {{"q", &Inputs::q, &Outputs::dq},  {"k", &Inputs::k, &Outputs::dk},
                            {"v", &Inputs::v, &Outputs::dv},  {"g", &Inputs::g, &Outputs::dg},
                            {"initial_state", &Inputs::h0, &Outputs::dh0}};
  std::mt19937_64 rng(11);
  for (const auto& target : targets) {
    const int64_t size = (base.*target.input).size();
    for (int trial = 0; trial < 6; ++trial) {
      const int64_t idx = static_cast<int64_t>(rng() % static_cast<uint64_t>(size));
      const double x = (base.*target.input).get(idx), eps = 1e-2;
      Inputs plus = base, minus = base;
      (plus.*target.input).set(idx, x + eps);
      (minus.*target.input).set(idx, x - eps);
      // The step actually taken after rounding to fp32.
      const double step = (plus.*target.input).get(idx) - (minus.*target.input).get(idx);
      const double fd = (loss(plus) - loss(minus)) / step;
      const double analytic = (grads.*target.grad).get(idx);
      EXPECT_NEAR(analytic, fd, 2e-3 * std::max(1.0, std::abs(fd))) << target.name << "[" << idx << "]";
    }
  }
}

TEST(ReferenceVarlen, EqualsOneCallPerSequence) {
  Case c;
  c.B = 1; c.H = 2; c.K = 8; c.V = 6; c.cu_seqlens = {0, 5, 5, 70, 71, 140}; c.T = 140; c.seed = 3;
  Inputs packed = make_inputs(c);
  Outputs whole;
  ASSERT_EQ(run_forward(packed, whole, kReference), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_backward(packed, whole, kReference), GLA_STATUS_OK) << gla_last_error();

  for (size_t n = 0; n + 1 < c.cu_seqlens.size(); ++n) {
    const int64_t s = c.cu_seqlens[n], e = c.cu_seqlens[n + 1];
    Case one = c;
    one.cu_seqlens.clear();
    one.T = e - s;
    Inputs single = make_inputs(one);
    // Copy this sequence's slice of every input.
    auto slice_tokens = [&](const HostTensor& from, HostTensor& to) {
      const int64_t row = from.size() / c.T;
      for (int64_t i = 0; i < to.size(); ++i) to.set(i, from.get(s * row + i));
    };
    auto slice_state = [&](const HostTensor& from, HostTensor& to) {
      const int64_t per = from.size() / static_cast<int64_t>(c.cu_seqlens.size() - 1);
      for (int64_t i = 0; i < to.size(); ++i) to.set(i, from.get(static_cast<int64_t>(n) * per + i));
    };
    slice_tokens(packed.q, single.q);
    slice_tokens(packed.k, single.k);
    slice_tokens(packed.v, single.v);
    slice_tokens(packed.g, single.g);
    slice_tokens(packed.dout, single.dout);
    slice_state(packed.h0, single.h0);
    slice_state(packed.dht, single.dht);
    Outputs part;
    ASSERT_EQ(run_forward(single, part, kReference), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_backward(single, part, kReference), GLA_STATUS_OK) << gla_last_error();
    auto same_tokens = [&](const HostTensor& packed_out, const HostTensor& single_out, const char* name) {
      const int64_t row = packed_out.size() / c.T;
      for (int64_t i = 0; i < single_out.size(); ++i) {
        ASSERT_EQ(packed_out.get(s * row + i), single_out.get(i)) << name << " seq " << n << " elem " << i;
      }
    };
    auto same_state = [&](const HostTensor& packed_out, const HostTensor& single_out, const char* name) {
      const int64_t per = single_out.size();
      for (int64_t i = 0; i < per; ++i) {
        ASSERT_EQ(packed_out.get(static_cast<int64_t>(n) * per + i), single_out.get(i)) << name << " seq " << n;
      }
    };
    same_tokens(whole.o, part.o, "o");
    same_tokens(whole.dq, part.dq, "dq");
    same_tokens(whole.dk, part.dk, "dk");
    same_tokens(whole.dv, part.dv, "dv");
    same_tokens(whole.dg, part.dg, "dg");
    same_state(whole.ht, part.ht, "final_state");
    same_state(whole.dh0, part.dh0, "dh0");
  }
}

TEST(ReferenceVarlen, EmptySequencePassesStateThrough) {
  Case c;
  c.B = 1; c.H = 2; c.K = 4; c.V = 5; c.cu_seqlens = {0, 0, 16, 16}; c.T = 16;
  Inputs in = make_inputs(c);
  for (bool pipeline : {false, true}) {
    RunOptions options{"reference"};
    options.stage_pipeline = pipeline;
    Outputs out;
    ASSERT_EQ(run_forward(in, out, options), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_backward(in, out, options), GLA_STATUS_OK) << gla_last_error();
    const int64_t per = c.H * c.K * c.V;
    for (int64_t n : {0, 2}) {  // the empty ones
      for (int64_t i = 0; i < per; ++i) {
        ASSERT_EQ(out.ht.get(n * per + i), in.h0.get(n * per + i)) << "final_state = initial_state, seq " << n;
        ASSERT_EQ(out.dh0.get(n * per + i), in.dht.get(n * per + i)) << "dh0 = dht, seq " << n;
      }
    }
    EXPECT_TRUE(all_finite(out.o));
    EXPECT_TRUE(all_finite(out.dq));
  }
}

TEST(ReferenceLayouts, StateVFirstIsTheTranspose) {
  Case c;
  c.B = 2; c.T = 40; c.H = 2; c.K = 5; c.V = 3; c.seed = 8;
  Inputs kv = make_inputs(c);
  Case vf_case = c;
  vf_case.state_v_first = true;
  Inputs vf = make_inputs(vf_case);
  // Same logical states, stored [N, H, V, K].
  for (int64_t n = 0; n < c.B; ++n)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < c.V; ++j) {
          const int64_t a = ((n * c.H + h) * c.K + i) * c.V + j, b = ((n * c.H + h) * c.V + j) * c.K + i;
          vf.h0.set(b, kv.h0.get(a));
          vf.dht.set(b, kv.dht.get(a));
        }
  vf.q = kv.q; vf.k = kv.k; vf.v = kv.v; vf.g = kv.g; vf.dout = kv.dout;
  Outputs a, b;
  ASSERT_EQ(run_forward(kv, a, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_backward(kv, a, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(vf, b, kReference), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_backward(vf, b, kReference), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(rel_rms(b.o, a.o), 0.0);
  EXPECT_EQ(rel_rms(b.dq, a.dq), 0.0);
  for (int64_t n = 0; n < c.B; ++n)
    for (int64_t h = 0; h < c.H; ++h)
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < c.V; ++j) {
          const int64_t x = ((n * c.H + h) * c.K + i) * c.V + j, y = ((n * c.H + h) * c.V + j) * c.K + i;
          ASSERT_EQ(a.ht.get(x), b.ht.get(y));
          ASSERT_EQ(a.dh0.get(x), b.dh0.get(y));
        }
}

TEST(ReferenceLayouts, StridedInputsEqualContiguous) {
  Case c;
  c.B = 1; c.T = 30; c.H = 3; c.K = 4; c.V = 4; c.seed = 2;
  Inputs in = make_inputs(c);
  Inputs strided = in;
  strided.q = strided_copy(in.q);
  strided.v = strided_copy(in.v);
  strided.g = strided_copy(in.g);
  ASSERT_NE(strided.q.t.strides[3], 1);
  Outputs a, b;
  ASSERT_EQ(run_forward(in, a, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(strided, b, kReference), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(rel_rms(b.o, a.o), 0.0);
}

TEST(ReferenceDeterminism, RepeatedCallsAreBitwiseEqual) {
  Case c;
  c.B = 2; c.T = 100; c.H = 3; c.K = 8; c.V = 8; c.seed = 4;
  Inputs in = make_inputs(c);
  Outputs a, b;
  ASSERT_EQ(run_forward(in, a, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_backward(in, a, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_forward(in, b, kReference), GLA_STATUS_OK);
  ASSERT_EQ(run_backward(in, b, kReference), GLA_STATUS_OK);
  for (auto member : {&Outputs::o, &Outputs::ht, &Outputs::dq, &Outputs::dk, &Outputs::dv, &Outputs::dg, &Outputs::dh0}) {
    ASSERT_EQ((a.*member).bytes, (b.*member).bytes);
  }
}

TEST(ReferenceDtypes, SixteenBitInputsMatchTheirFp32Values) {
  // bf16/fp16 inputs are read exactly: the same values given as fp32 give the same answer up to
  // the output's own rounding.
  for (int32_t dtype : {GLA_DTYPE_F16, GLA_DTYPE_BF16}) {
    Case c;
    c.B = 1; c.T = 50; c.H = 2; c.K = 8; c.V = 8; c.dtype = dtype; c.seed = 6;
    Inputs half = make_inputs(c);
    Case c32 = c;
    c32.dtype = GLA_DTYPE_F32;
    Inputs full = make_inputs(c32);
    for (auto m : {&Inputs::q, &Inputs::k, &Inputs::v, &Inputs::g, &Inputs::dout}) {
      for (int64_t i = 0; i < (half.*m).size(); ++i) (full.*m).set(i, (half.*m).get(i));
    }
    full.h0 = half.h0;
    full.dht = half.dht;
    Outputs a, b;
    ASSERT_EQ(run_forward(half, a, kReference), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_forward(full, b, kReference), GLA_STATUS_OK);
    EXPECT_LT(rel_rms(a.o, b.o), dtype == GLA_DTYPE_BF16 ? 4e-3 : 5e-4);
    EXPECT_EQ(rel_rms(a.ht, b.ht), 0.0);  // states are fp32 and computed from identical values
  }
}

}  // namespace
