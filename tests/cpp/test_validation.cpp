// SPEC.md §4: every bad input is rejected before anything is written, with a message naming the
// argument, what was expected and what was given. Each case asserts the status, a key phrase of the
// message, and that every output buffer is still bitwise what it was before the call.
#include <gtest/gtest.h>

#include <cstddef>
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
// Stride 0 names any number of offsets in one entry: 2^29 of them would be copied and scanned (4 GB)
// before the other arguments were checked. Rejected up front, for cu_seqlens and its host copy.
TEST(Validation, CuSeqlensWithStrideZeroRejectedBeforeItIsRead) {
  Call c(varlen_case());
  int64_t zero = 0;
  c.cu = gla::make_tensor(&zero, GLA_DTYPE_I64, GLA_DEVICE_CPU, 0, {int64_t{1} << 29});
  c.cu.strides[0] = 0;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "non-zero stride", "got stride 0"});
}

TEST(Validation, CuSeqlensWrongDtype) {
  Call c(varlen_case());
  c.cu.dtype = GLA_DTYPE_F32;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"cu_seqlens:", "int32 or int64", "got float32"});
}
TEST(Validation, CuSeqlensHostCopyReadWithItsOwnDtypeAndStride) {
  // An int32 host copy every 2nd element of an int64 cu_seqlens: read with the copy's dtype and
  // stride (it was read as cu_seqlens' int64, contiguous: past the end of the copy). The device
  // copy is never read.
  Call plain(varlen_case());
  ASSERT_EQ(plain.forward(), GLA_STATUS_OK) << gla_last_error();
  Call c(varlen_case());
  int32_t host[6] = {0, -7, 5, -7, 20, -7};
  gla_tensor hc = gla::make_tensor(host, GLA_DTYPE_I32, GLA_DEVICE_CPU, 0, {3});
  hc.strides[0] = 2;
  gla_tensor device_cu = c.cu;
  device_cu.device_type = GLA_DEVICE_CUDA_HOST;  // pinned: host readable, so no copy is needed either
  for (gla_tensor* t : {&c.q, &c.k, &c.v, &c.g, &c.h0, &c.o, &c.ht}) t->device_type = GLA_DEVICE_CUDA_HOST;
  int64_t wrong[3] = {0, 19, 20};  // what the device copy holds: must not be what is used
  device_cu.data = wrong;
  gla_chunk_forward_args a{&c.q, &c.k, &c.v, &c.g, &c.h0, &device_cu, &hc, &c.o, &c.ht};
  ASSERT_EQ(gla_chunk_forward(&a, &c.options), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(rel_rms(c.out.o, plain.out.o), 0.0);
  EXPECT_EQ(rel_rms(c.out.ht, plain.out.ht), 0.0);
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

// ---- SPEC.md §3.9: sizes, strides and offsets whose int64 arithmetic would overflow ----
TEST(Overflow, StrideWhoseOffsetWraps) {
  // (T - 1) * 2^62 wraps: token 19 would alias token 0.
  Call c; c.q.strides[1] = int64_t{1} << 62;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "largest offset fits in int64", "4611686018427387904"});
}
TEST(Overflow, SizeProductWraps) {
  // T·H = 2^64 with stride-0 tensors: numel wraps to 0.
  Call c;
  for (gla_tensor* t : {&c.q, &c.k, &c.v, &c.g, &c.o}) {
    t->sizes[1] = int64_t{1} << 32;
    t->sizes[2] = int64_t{1} << 32;
    for (int d = 0; d < 4; ++d) t->strides[d] = 0;
  }
  c.use_h0 = c.use_ht = false;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"q:", "product fits in int64", "[2, 4294967296, 4294967296, 8]"});
}
// T = 2^62 on stride-0 tensors: every tensor's own extent fits, but the chunk intermediates
// (B·T·H·(3K + V + 128) floats) do not; crashed the cpu stage runner and hung the whole-op path.
Call huge_t_call() {
  Call c;
  for (gla_tensor* t : {&c.q, &c.k, &c.v, &c.g, &c.o}) {
    t->sizes[0] = 1;
    t->sizes[1] = int64_t{1} << 62;
    t->sizes[2] = 1;
    for (int d = 0; d < 4; ++d) t->strides[d] = 0;
  }
  c.q.sizes[3] = c.k.sizes[3] = c.g.sizes[3] = 1;
  c.v.sizes[3] = c.o.sizes[3] = 1;
  c.o.strides[1] = 1;
  c.use_h0 = c.use_ht = false;
  return c;
}
TEST(Overflow, IntermediatesOfTheProblemWrap) {
  for (int pipeline : {0, 1}) {
    Call c = huge_t_call();
    c.options.force_stage_pipeline = pipeline;
    expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"problem:", "T = 4611686018427387904", "overflow int64"});
  }
}
TEST(Overflow, WorkspaceQueryRejectsInsteadOfWrapping) {
  Call c = huge_t_call();
  c.options.backend = "reference";
  c.options.force_stage_pipeline = 1;
  gla_chunk_forward_args a{&c.q, &c.k, &c.v, &c.g, nullptr, nullptr, nullptr, &c.o, nullptr};
  size_t bytes = 12345;
  EXPECT_EQ(gla_chunk_forward_workspace_size(&a, &c.options, &bytes), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("overflow int64"), std::string::npos) << gla_last_error();
  EXPECT_EQ(bytes, 12345u);
}
TEST(Overflow, DataPointerThatWrapsTheAddressSpace) {
  Call c;
  c.v.data = reinterpret_cast<void*>(~uintptr_t{0} - 15);  // 16 bytes below the top; v spans 640
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"v:", "wraps past its end"});
}

// ---- gla_options.struct_size: only sizes that end at a field boundary ----
TEST(OptionsSize, EndingInsideThePointerIsRejected) {
  // Half of `backend` copied used to be dereferenced (SIGSEGV in the dispatcher).
  Call c; c.options.backend = "reference"; c.options.struct_size = offsetof(gla_options, backend) + 4;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"options:", "field boundary", "inside options.backend"});
}
TEST(OptionsSize, EndingInsideTheScaleIsRejected) {
  // Half of `scale` copied used to run with a scale of ~0 (o all zeros, status OK).
  Call c; c.options.has_scale = 1; c.options.scale = 0.5; c.options.struct_size = offsetof(gla_options, scale) + 4;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"options:", "inside options.scale"});
}
TEST(OptionsSize, HasScaleWithoutTheScaleIsRejected) {
  Call c; c.options.has_scale = 1; c.options.scale = 0.5; c.options.struct_size = offsetof(gla_options, scale);
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"options.has_scale:", "ends before options.scale"});
}
TEST(OptionsSize, OlderStructsAtBoundariesServe) {
  // A struct that ends after `scale` (an older caller) gives the same result as the full struct.
  Call full; full.options.has_scale = 1; full.options.scale = 0.5;
  ASSERT_EQ(full.forward(), GLA_STATUS_OK) << gla_last_error();
  Call old; old.options.has_scale = 1; old.options.scale = 0.5; old.options.struct_size = offsetof(gla_options, state_v_first);
  ASSERT_EQ(old.forward(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(rel_rms(old.out.o, full.out.o), 0.0);
  Call tiny; tiny.options.struct_size = sizeof(uint32_t);
  EXPECT_EQ(tiny.forward(), GLA_STATUS_OK) << gla_last_error();
  Call too_small; too_small.options.struct_size = 3;
  expect_rejected(too_small, false, GLA_STATUS_INVALID_ARGUMENT, {"options:", "struct_size between 4 and", "got 3"});
}

// ---- outputs that overlap themselves, each other or an input ----
TEST(Overlap, OutputWithStrideZeroInT) {
  Call c; c.o.strides[1] = 0;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"o:", "elements do not overlap", "dim 1"});
}
TEST(Overlap, OutputWhoseDimsInterleave) {
  Call c; c.o.strides[2] = 2;  // H stride 2 < V extent 4: heads share values
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"o:", "elements do not overlap"});
}
TEST(Overlap, FinalStateAliasingTheOutput) {
  Call c; c.ht.data = c.o.data;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"o:", "disjoint from output final_state", "sharing 512"});
}
TEST(Overlap, OutputAliasingAnInput) {
  Call c; c.o.data = c.v.data;
  expect_rejected(c, false, GLA_STATUS_INVALID_ARGUMENT, {"o:", "disjoint from input v"});
}
TEST(Overlap, GradientsAliasingEachOther) {
  Call c; c.dk.data = c.dq.data;
  expect_rejected(c, true, GLA_STATUS_INVALID_ARGUMENT, {"dq:", "disjoint from output dk"});
  Call d; d.dv.data = static_cast<char*>(d.dq.data) + 4;  // partial overlap
  expect_rejected(d, true, GLA_STATUS_INVALID_ARGUMENT, {"dq:", "disjoint from output dv"});
}
TEST(Overlap, InputsMayShareMemory) {
  // q and k the same tensor: read-only sharing is fine, and gives what two copies give.
  Call shared; shared.k = shared.q;
  ASSERT_EQ(shared.forward(), GLA_STATUS_OK) << gla_last_error();
  Call copies; copies.in.k = copies.in.q; copies.k = copies.in.k.t;
  ASSERT_EQ(copies.forward(), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(rel_rms(shared.out.o, copies.out.o), 0.0);
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
