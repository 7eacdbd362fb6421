// The cuda backend on the extreme inputs of extreme_inputs.hpp, with tensors in CUDA memory and
// NaN-filled outputs: gates in [-1e4, 0] with zeros and -inf, q/k/v up to 1e4, K or V of 1, T = 1,
// empty sequences throughout a varlen batch (forward in fp32 and bf16, backward in bf16, the dtypes
// the backward serves), non-contiguous inputs served or declined with a reason, and 10^6 tokens
// with int64 offsets against the recurrent reference run in slices. Skips with a message where no
// CUDA device is present.
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "extreme_inputs.hpp"

#ifdef GLA_TESTS_WITH_CUDA
#include "cuda_test_support.hpp"
#endif

namespace gla::test {
namespace {

#ifdef GLA_TESTS_WITH_CUDA

// A device copy of every byte a host descriptor addresses (gaps included, so strided layouts keep
// their strides); copied back into the host tensor's memory by to_host.
struct Mirror {
  void* ptr = nullptr;
  gla_tensor t{};
  const gla_tensor* host = nullptr;
  size_t bytes = 0;
  explicit Mirror(const gla_tensor& h) : t(h), host(&h) {
    int64_t last = 0;
    for (int d = 0; d < h.rank; ++d) last += (h.sizes[d] - 1) * h.strides[d];
    bytes = numel(h) > 0 ? static_cast<size_t>((last + 1) * dtype_size(h.dtype)) : 0;
    EXPECT_EQ(cudaMalloc(&ptr, bytes > 0 ? bytes : 16), cudaSuccess);
    if (bytes) {
      EXPECT_EQ(cudaMemcpy(ptr, h.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    t.data = bytes ? ptr : nullptr;
    t.device_type = GLA_DEVICE_CUDA;
    t.device_index = 0;
  }
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  ~Mirror() { cudaFree(ptr); }
  void to_host() const {
    if (bytes) {
      ASSERT_EQ(cudaMemcpy(host->data, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  }
};

// Every tensor of an args struct moved to the device (cu_seqlens too, with its host copy kept as
// cu_seqlens_host); outputs (NaN-poisoned on the host) come back after the call.
class DeviceArgs {
 public:
  const gla_tensor* in(const gla_tensor* h) { return h ? &keep(*h).t : nullptr; }
  const gla_tensor* out(const gla_tensor* h) {
    if (!h) return nullptr;
    Mirror& m = keep(*h);
    outputs_.push_back(&m);
    return &m.t;
  }
  void copy_back() {
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (const Mirror* m : outputs_) m->to_host();
  }

 private:
  Mirror& keep(const gla_tensor& h) {
    mirrors_.push_back(std::make_unique<Mirror>(h));
    return *mirrors_.back();
  }
  std::vector<std::unique_ptr<Mirror>> mirrors_;
  std::vector<const Mirror*> outputs_;
};

gla_options cuda_options(const Inputs& in) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = in.c.state_v_first;
  o.backend = "cuda";
  return o;
}

// Forward (and, with backward, the backward) on the cuda backend; outputs land in `out` on the host.
gla_status run_cuda(const Inputs& in, Outputs& out, bool backward, std::string& error) {
  const gla_chunk_forward_args h = forward_args(in, out);
  DeviceArgs d;
  gla_chunk_forward_args a{d.in(h.q), d.in(h.k), d.in(h.v), d.in(h.g), d.in(h.initial_state), d.in(h.cu_seqlens),
                           h.cu_seqlens, d.out(h.o), d.out(h.final_state)};
  const gla_options o = cuda_options(in);
  gla_status s = gla_chunk_forward(&a, &o);
  error = s == GLA_STATUS_OK ? "" : gla_last_error();
  d.copy_back();
  if (s != GLA_STATUS_OK || !backward) return s;
  const gla_chunk_backward_args hb = backward_args(in, out);
  DeviceArgs db;
  gla_chunk_backward_args b{db.in(hb.q), db.in(hb.k), db.in(hb.v), db.in(hb.g), db.in(hb.initial_state),
                            db.in(hb.cu_seqlens), hb.cu_seqlens, db.in(hb.do_), db.in(hb.dht), db.out(hb.dq),
                            db.out(hb.dk), db.out(hb.dv), db.out(hb.dg), db.out(hb.dh0)};
  s = gla_chunk_backward(&b, &o);
  error = s == GLA_STATUS_OK ? "" : gla_last_error();
  db.copy_back();
  return s;
}

double cuda_tolerance(int32_t dtype) { return dtype == GLA_DTYPE_F32 ? 1e-3 : 5e-3; }

void expect_matches(const Inputs& in, const std::string& what, bool backward) {
  Outputs ref, got;
  ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
  if (backward) {
    ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
  }
  std::string error;
  ASSERT_EQ(run_cuda(in, got, backward, error), GLA_STATUS_OK) << what << ": " << error;
  std::string report;
  // rel_rms is infinite where the cuda output has a NaN/Inf (or an unwritten NaN) and the reference not.
  EXPECT_LT(max_error(got, ref, false, report), cuda_tolerance(in.c.dtype)) << what << " forward: " << report;
  if (backward) {
    EXPECT_LT(max_error(got, ref, true, report), cuda_tolerance(in.c.dtype)) << what << " backward: " << report;
  }
}

class CudaExtremes : public ::testing::TestWithParam<int32_t> {};

// Forward in every dtype; backward where the cuda backend serves it (16-bit inputs).
TEST_P(CudaExtremes, MatchReference) {
  SKIP_WITHOUT_CUDA();
  for (const ExtremeCase& x : extreme_cases(GetParam())) {
    SCOPED_TRACE(x.name);
    expect_matches(x.in, x.name, GetParam() != GLA_DTYPE_F32);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaExtremes, ::testing::Values(GLA_DTYPE_F32, GLA_DTYPE_BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(CudaExtremes, NonContiguousServedOrDeclinedWithAReason) {
  SKIP_WITHOUT_CUDA();
  Case c = extreme_base(2, 70, 2, 16, 8, 340);
  c.dtype = GLA_DTYPE_BF16;
  const Inputs base = make_inputs(c);
  Inputs transposed = base;  // the last two dims of q, k, v, g and the states stored transposed
  for (HostTensor* t : {&transposed.q, &transposed.k, &transposed.v, &transposed.g, &transposed.h0, &transposed.dout,
                        &transposed.dht}) {
    *t = strided_copy(*t);
  }
  Inputs broadcast = base;  // g the same for every key, stored once (stride 0 in K)
  {
    HostTensor per_head(base.g.t.dtype, {c.B, c.T, c.H});
    for (int64_t i = 0; i < per_head.size(); ++i) per_head.set(i, base.g.get(i * c.K));
    per_head.t.rank = 4;
    per_head.t.sizes[3] = c.K;
    per_head.t.strides[3] = 0;
    broadcast.g = per_head;
  }
  for (const auto& [name, in] : {std::pair<std::string, const Inputs&>{"last two dims transposed", transposed},
                                 std::pair<std::string, const Inputs&>{"g broadcast over the keys", broadcast}}) {
    Outputs ref, got;
    ASSERT_EQ(run_forward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
    std::string error;
    const gla_status s = run_cuda(in, got, true, error);
    if (s == GLA_STATUS_OK) {
      std::string report;
      EXPECT_LT(max_error(got, ref, false, report), 5e-3) << name << ": " << report;
      EXPECT_LT(max_error(got, ref, true, report), 5e-3) << name << ": " << report;
      std::printf("[ layout   ] %s: cuda served\n", name.c_str());
    } else {
      EXPECT_TRUE(error.find("stride") != std::string::npos || error.find("contiguous") != std::string::npos)
          << name << " declined without naming the layout: " << error;
      std::printf("[ layout   ] %s: cuda declined: %s\n", name.c_str(), error.substr(0, error.find('\n')).c_str());
    }
  }
}

// 10^6 tokens in int64-offset sequences (one empty), H = 1, K = V = 4: the cuda forward in fp32 and
// bf16 against the recurrent reference in 2^16-token slices; the bf16 backward against the reference.
TEST(CudaExtremes, MillionTokenSequence) {
  SKIP_WITHOUT_CUDA();
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16}) {
    const Inputs in = long_sequence_inputs(dtype);
    SCOPED_TRACE(dtype_name(dtype));
    Outputs loop, got;
    ASSERT_EQ(recurrent_reference_in_slices(in, int64_t{1} << 16, loop), GLA_STATUS_OK) << gla_last_error();
    std::string error;
    const bool backward = dtype != GLA_DTYPE_F32;
    ASSERT_EQ(run_cuda(in, got, backward, error), GLA_STATUS_OK) << error;
    std::string report;
    EXPECT_LT(max_error(got, loop, false, report), cuda_tolerance(dtype)) << report;
    std::printf("[ 10^6     ] %s forward against the recurrent reference: %s\n", dtype_name(dtype), report.c_str());
    if (backward) {
      Outputs ref;
      ASSERT_EQ(run_backward(in, ref, {"reference"}), GLA_STATUS_OK) << gla_last_error();
      EXPECT_LT(max_error(got, ref, true, report), cuda_tolerance(dtype)) << report;
      std::printf("[ 10^6     ] %s backward against the reference: %s\n", dtype_name(dtype), report.c_str());
    }
  }
}

#else

TEST(CudaExtremes, SkippedWithoutCuda) { GTEST_SKIP() << "libgla was built without CUDA: GPU tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
