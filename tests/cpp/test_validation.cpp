// SPEC.md §4: every bad input is rejected before anything is written, with a message naming the
// argument, what was expected and what was given. Each case asserts the status, a key phrase of the
// message, and that every output buffer is still bitwise what it was before the call.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>

#include "test_support.hpp"

using namespace gla::test;

namespace {

struct Call {
  Inputs in;
  Outputs out;
  gla_tensor q, k, v, g, h0, cu, o, ht, dout, dht, dq, dk, dv, dg, dh0;
  bool use_h0 = true, use_ht = true, use_cu = false;
  gla_options options;

  explicit Call(Case c = default_case()) : in(make_inputs(c)) {
    use_cu = !c.cu_seqlens.empty();
    run_forward(in, out, {"reference"});  // allocates outputs of the right shapes
    run_backward(in, out, {"reference"});
    for (HostTensor* t : {&out.o, &out.ht, &out.dq, &out.dk, &out.dv, &out.dg, &out.dh0}) {
      for (size_t i = 0; i < t->bytes.size(); ++i) t->bytes[i] = static_cast<unsigned char>(0xA5 ^ i);
    }
    q = in.q.t; k = in.k.t; v = in.v.t; g = in.g.t; h0 = in.h0.t; cu = in.cu.t; dout = in.dout.t; dht = in.dht.t;
    o = out.o.t; ht = out.ht.t; dq = out.dq.t; dk = out.dk.t; dv = out.dv.t; dg = out.dg.t; dh0 = out.dh0.t;
    gla_options_init(&options);
  }
  static Case default_case() {
    Case c;
    c.B = 2; c.T = 20; c.H = 2; c.K = 8; c.V = 4;
    return c;
  }
  gla_status forward() {
    gla_chunk_forward_args a{&q, &k, &v, &g, use_h0 ? &h0 : nullptr, use_cu ? &cu : nullptr, nullptr, &o,
                             use_ht ? &ht : nullptr};
    return gla_chunk_forward(&a, &options);
  }
  gla_status backward() {
    gla_chunk_backward_args a{&q, &k, &v, &g, use_h0 ? &h0 : nullptr, use_cu ? &cu : nullptr, nullptr, &dout,
                              &dht, &dq, &dk, &dv, &dg, use_h0 ? &dh0 : nullptr};
    return gla_chunk_backward(&a, &options);
  }
  bool outputs_untouched() const {
    for (const HostTensor* t : {&out.o, &out.ht, &out.dq, &out.dk, &out.dv, &out.dg, &out.dh0}) {
      for (size_t i = 0; i < t->bytes.size(); ++i) {
        if (t->bytes[i] != static_cast<unsigned char>(0xA5 ^ i)) return false;
      }
    }
    return true;
  }
};

void expect_rejected(Call& call, bool backward, gla_status status, const std::vector<std::string>& phrases) {
  const gla_status got = backward ? call.backward() : call.forward();
  EXPECT_EQ(got, status) << gla_last_error();
  const std::string message = gla_last_error();
  for (const auto& phrase : phrases) EXPECT_NE(message.find(phrase), std::string::npos) << "message: " << message;
  EXPECT_TRUE(call.outputs_untouched()) << "outputs were written for a rejected call";
}

TEST(Validation, ValidCallSucceedsAndWrites) {
  Call call;
  EXPECT_EQ(call.forward(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_FALSE(call.outputs_untouched());
  EXPECT_STREQ(gla_last_error(), "");
}

TEST(Validation, QWrongRank) {
  Call c; c.q.rank = 3;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "rank 4", "got rank 3"});
}
TEST(Validation, KShapeMismatch) {
  Call c; c.k.sizes[3] = 7;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"k:", "expected shape [2, 20, 2, 8]", "got [2, 20, 2, 7]"});
}
TEST(Validation, VShapeMismatch) {
  Call c; c.v.sizes[1] = 19;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"v:", "[B, T, H, V]", "got [2, 19, 2, 4]"});
}
TEST(Validation, GateShapeMismatch) {
  Call c; c.g.sizes[3] = 4;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"g:", "per-key gate", "got [2, 20, 2, 4]"});
}
TEST(Validation, KDtypeMismatch) {
  Call c; c.k.dtype = GLA_DTYPE_BF16;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"k:", "float32 (same as q)", "got bfloat16"});
}
TEST(Validation, QIntegerDtype) {
  Call c; c.q.dtype = GLA_DTYPE_I32;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "float32, float16 or bfloat16", "got int32"});
}
TEST(Validation, GateDtypeNeitherQsNorFp32) {
  Case cs = Call::default_case();
  cs.dtype = GLA_DTYPE_BF16;
  Call c(cs); c.g.dtype = GLA_DTYPE_F16;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"g:", "bfloat16 (same as q) or float32", "got float16"});
}
TEST(Validation, OutputDtypeMismatch) {
  Call c; c.o.dtype = GLA_DTYPE_F16;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"o:", "float32", "got float16"});
}
TEST(Validation, NonFp32InitialState) {
  Call c; c.h0.dtype = GLA_DTYPE_BF16;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"initial_state:", "fp32", "got bfloat16"});
}
TEST(Validation, NonFp32FinalState) {
  Call c; c.ht.dtype = GLA_DTYPE_F64;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"final_state:", "fp32", "got float64"});
}
TEST(Validation, StateCountNotN) {
  Call c; c.h0.sizes[0] = 3;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"initial_state:", "[2, 2, 8, 4]", "got [3, 2, 8, 4]"});
}
TEST(Validation, StateLayoutMismatch) {
  Call c; c.options.state_v_first = 1;  // the states are [N, H, K, V]
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"initial_state:", "[N, H, V, K]", "got [2, 2, 8, 4]"});
}
TEST(Validation, CuSeqlensWithBatchAboveOne) {
  Call c; c.use_cu = true;
  int64_t offsets[3] = {0, 5, 20};
  c.cu = gla::make_tensor(offsets, GLA_DTYPE_I64, GLA_DEVICE_CPU, 0, {3});
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "B == 1", "got B = 2"});
}

Case varlen_case() {
  Case c;
  c.B = 1; c.T = 20; c.H = 2; c.K = 8; c.V = 4; c.cu_seqlens = {0, 5, 20};
  return c;
}
TEST(Validation, CuSeqlensNotStartingAtZero) {
  Call c(varlen_case());
  int64_t offsets[3] = {1, 5, 20};
  c.cu.data = offsets;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "first entry 0", "got 1"});
}
TEST(Validation, CuSeqlensDecreasing) {
  Call c(varlen_case());
  int64_t offsets[3] = {0, 12, 5};
  c.cu.data = offsets;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "non-decreasing", "12 then 5"});
}
TEST(Validation, CuSeqlensNotEndingAtT) {
  Call c(varlen_case());
  int64_t offsets[3] = {0, 5, 19};
  c.cu.data = offsets;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "last entry T = 20", "got 19"});
}
TEST(Validation, CuSeqlensWrongDtype) {
  Call c(varlen_case());
  c.cu.dtype = GLA_DTYPE_F32;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "int32 or int64", "got float32"});
}
TEST(Validation, KeyWidthZero) {
  Call c; c.q.sizes[3] = 0; c.k.sizes[3] = 0; c.g.sizes[3] = 0;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "K (dim 3) > 0", "got K = 0"});
}
TEST(Validation, ValueWidthZero) {
  Call c; c.v.sizes[3] = 0;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"v:", "V (dim 3) > 0", "got V = 0"});
}
TEST(Validation, NullDataPointer) {
  Call c; c.k.data = nullptr;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"k:", "data pointer is NULL", "640 elements"});
}
TEST(Validation, MissingRequiredTensor) {
  Call c;
  gla_chunk_forward_args a{&c.q, nullptr, &c.v, &c.g, nullptr, nullptr, nullptr, &c.o, nullptr};
  EXPECT_EQ(gla_chunk_forward(&a, &c.options), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("k: required tensor is missing"), std::string::npos) << gla_last_error();
  EXPECT_TRUE(c.outputs_untouched());
}
TEST(Validation, TensorsOnDifferentDevices) {
  Call c; c.v.device_type = GLA_DEVICE_CUDA;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"v:", "device cpu:0 (same as q)", "got cuda:0"});
}
TEST(Validation, NegativeStride) {
  Call c; c.q.strides[1] = -1;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "non-negative strides", "dim 1"});
}
TEST(Validation, NonFiniteScale) {
  Call c; c.options.has_scale = 1; c.options.scale = NAN;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"scale:", "finite"});
}
TEST(Validation, UninitialisedOptions) {
  Call c; c.options.struct_size = 0;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"options:", "struct_size", "gla_options_init"});
}
TEST(Validation, UnknownBackendName) {
  Call c; c.options.backend = "no_such_backend";
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"backend:", "reference", "got 'no_such_backend'"});
}
TEST(Validation, DeviceNoBackendServes) {
  // A device type nothing registered serves: NOT_SUPPORTED, and the message lists every backend with
  // its reason.
  Call c;
  for (gla_tensor* t : {&c.q, &c.k, &c.v, &c.g, &c.h0, &c.o, &c.ht}) t->device_type = GLA_DEVICE_VULKAN;
  expect_rejected(c, false, GLA_STATUS_NOT_SUPPORTED,
                  {"no available backend accepts", "device=vulkan", "backend 'reference'", "does not serve device vulkan"});
}
TEST(Validation, BackwardGradientShapeMismatch) {
  Call c; c.dq.sizes[2] = 3;
  expect_rejected(c, true, GLA_STATUS_INVALID_ARGUMENT, {"dq:", "(same as q)", "got [2, 20, 3, 8]"});
}
TEST(Validation, BackwardGateGradientDtype) {
  Call c; c.dg.dtype = GLA_DTYPE_I64;
  expect_rejected(c, true, GLA_STATUS_INVALID_ARGUMENT, {"dg:", "float32", "got int64"});
}
TEST(Validation, BackwardDhtShape) {
  Call c; c.dht.sizes[2] = 4; c.dht.sizes[3] = 8;
  expect_rejected(c, true, GLA_STATUS_INVALID_ARGUMENT, {"dht:", "[2, 2, 8, 4]", "got [2, 2, 4, 8]"});
}
TEST(Validation, BackwardWithoutAnyOutput) {
  Call c;
  gla_chunk_backward_args a{&c.q, &c.k, &c.v, &c.g, nullptr, nullptr, nullptr, &c.dout, nullptr,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  EXPECT_EQ(gla_chunk_backward(&a, &c.options), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("at least one gradient output"), std::string::npos);
}

// The optional input check (off by default) reports bad values by position.
TEST(InputCheck, ReportsNaNByPosition) {
  Call c;
  c.options.check_inputs = 1;
  c.in.k.set(1 * 20 * 2 * 8 + 3 * 2 * 8 + 1 * 8 + 5, NAN);  // k[1, 3, 1, 5]
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"k:", "NaN", "[1, 3, 1, 5]"});
}
TEST(InputCheck, ReportsPositiveGate) {
  Call c;
  c.options.check_inputs = 1;
  c.in.g.set(7, 0.25);  // g[0, 0, 0, 7]
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"g:", "positive gate value", "[0, 0, 0, 7]"});
}
TEST(InputCheck, OffByDefault) {
  Call c;
  c.in.g.set(7, 0.25);
  EXPECT_EQ(c.forward(), GLA_STATUS_OK) << gla_last_error();
}

}  // namespace
