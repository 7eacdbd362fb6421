// Helpers of the CUDA tests: whether the cuda backend can run here, and device copies of host
// tensors (NaN-poisoned when they are outputs).
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "test_support.hpp"

namespace gla::test {

inline bool cuda_backend_available(std::string& why) {
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char* name = nullptr;
    const char* reason = nullptr;
    int32_t priority = 0, available = 0;
    if (gla_backend_info(i, &name, &priority, &available, &reason) != GLA_STATUS_OK) continue;
    if (std::string(name) == "cuda") {
      why = reason ? reason : "";
      return available != 0;
    }
  }
  why = "the cuda backend is not built into this libgla";
  return false;
}

#define SKIP_WITHOUT_CUDA()                                                                  \
  do {                                                                                       \
    std::string why_;                                                                        \
    if (!::gla::test::cuda_backend_available(why_)) GTEST_SKIP() << "no CUDA backend/device: " << why_; \
  } while (0)

// A device copy of a host tensor (same sizes and contiguous strides); with copy = false the device
// memory is filled with NaN (all bits set) instead.
struct DeviceTensor {
  void* ptr = nullptr;
  gla_tensor t{};
  size_t bytes = 0;
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h, bool copy = true) {
    t = h.t;
    bytes = static_cast<size_t>(numel(h.t) * dtype_size(h.t.dtype));
    EXPECT_EQ(cudaMalloc(&ptr, bytes > 0 ? bytes : 16), cudaSuccess);
    if (copy && bytes) {
      EXPECT_EQ(cudaMemcpy(ptr, h.t.data, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    if (!copy) {
      EXPECT_EQ(cudaMemset(ptr, 0xff, bytes > 0 ? bytes : 16), cudaSuccess);
    }
    t.data = ptr;
    t.device_type = GLA_DEVICE_CUDA;
    t.device_index = 0;
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  ~DeviceTensor() {
    if (ptr) cudaFree(ptr);
  }
  void to_host(HostTensor& h) const {
    ASSERT_EQ(cudaMemcpy(h.t.data, ptr, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  }
};

// A K = V = D case of the given dtype.
inline Case base_case(int32_t dtype, int64_t B, int64_t T, int64_t H, int64_t D) {
  Case c;
  c.B = B; c.T = T; c.H = H; c.K = D; c.V = D; c.dtype = dtype;
  return c;
}

// Strong decay (n = 0.1, gates down to -20) at D = 128 and randn inputs at D = 64, T = 700.
inline std::vector<Case> decay_and_randn_cases(int32_t dtype) {
  Case s = base_case(dtype, 1, 700, 2, 128);
  s.normaliser = 0.1;
  s.gate_floor = -20;
  Case r = base_case(dtype, 1, 700, 2, 64);
  r.randn_inputs = true;
  return {s, r};
}

}  // namespace gla::test
