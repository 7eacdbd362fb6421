// Helpers over the C tensor descriptor (gla_tensor): sizes, strides, element access on the host
// (the dtype functions and 16-bit conversions are public: gla/dtype.hpp). Header-only so backends
// share it.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "gla/dtype.hpp"
#include "gla/gla.h"

namespace gla {

inline bool present(const gla_tensor& t) { return t.data != nullptr || t.rank != 0; }

const char* device_type_name(int32_t device_type);

// Whether host code may dereference this tensor's memory.
inline bool host_accessible(int32_t device_type) {
  return device_type == GLA_DEVICE_CPU || device_type == GLA_DEVICE_CUDA_HOST;
}

inline int64_t numel(const gla_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.rank; ++i) n *= t.sizes[i];
  return n;
}

// Row-major contiguous strides for t's sizes.
inline bool is_contiguous(const gla_tensor& t) {
  int64_t expect = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    if (t.sizes[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.sizes[i];
  }
  return true;
}

// "[2, 1024, 4, 64]"
std::string shape_string(const gla_tensor& t);

// A contiguous descriptor over `data`.
inline gla_tensor make_tensor(void* data, int32_t dtype, int32_t device_type, int32_t device_index,
                              std::initializer_list<int64_t> sizes) {
  gla_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device_type = device_type;
  t.device_index = device_index;
  t.rank = static_cast<int32_t>(sizes.size());
  int i = 0;
  for (int64_t s : sizes) t.sizes[i++] = s;
  int64_t stride = 1;
  for (int j = t.rank - 1; j >= 0; --j) {
    t.strides[j] = stride;
    stride *= t.sizes[j];
  }
  return t;
}

// Element `offset_elements` of a host tensor, read as double / written from a double.
inline double load_as_double(const gla_tensor& t, int64_t offset_elements) {
  return load_element(t.data, t.dtype, offset_elements);
}
inline void store_from_double(const gla_tensor& t, int64_t offset_elements, double value) {
  store_element(t.data, t.dtype, offset_elements, value);
}

// Offset in elements of index (a, b, c, d) in a rank-4 tensor (or (a, b, c) in rank 3).
inline int64_t offset4(const gla_tensor& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3];
}
inline int64_t offset3(const gla_tensor& t, int64_t a, int64_t b, int64_t c) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2];
}

}  // namespace gla
