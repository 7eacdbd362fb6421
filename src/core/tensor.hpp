// Helpers over the C tensor descriptor (gla_tensor): sizes, strides, element access on the host,
// and the 16-bit float conversions every host backend needs. Header-only so backends share it.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "gla/gla.h"

namespace gla {

inline bool present(const gla_tensor& t) { return t.data != nullptr || t.rank != 0; }

inline int64_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case GLA_DTYPE_F32: return 4;
    case GLA_DTYPE_F16: return 2;
    case GLA_DTYPE_BF16: return 2;
    case GLA_DTYPE_F64: return 8;
    case GLA_DTYPE_I32: return 4;
    case GLA_DTYPE_I64: return 8;
    default: return 0;
  }
}

inline const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case GLA_DTYPE_F32: return "float32";
    case GLA_DTYPE_F16: return "float16";
    case GLA_DTYPE_BF16: return "bfloat16";
    case GLA_DTYPE_F64: return "float64";
    case GLA_DTYPE_I32: return "int32";
    case GLA_DTYPE_I64: return "int64";
    default: return "unknown dtype";
  }
}

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

// ---- 16-bit floats (bit-exact round-to-nearest-even conversions) ----
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float f16_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) { man <<= 1; --exp; }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (absu >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absu < 0x38800000u) {  // subnormal or zero in half
    if (absu < 0x33000000u) return static_cast<uint16_t>(sign);
    uint32_t exp = absu >> 23, man = (absu & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp;  // 14 + (113 - exp) ... total shift into 10-bit mantissa
    uint32_t half_man = man >> (shift);
    uint32_t rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_man & 1u))) ++half_man;
    return static_cast<uint16_t>(sign | half_man);
  }
  uint32_t r = absu + 0xfffu + ((absu >> 13) & 1u);  // round mantissa to 10 bits
  r -= (127u - 15u) << 23;
  return static_cast<uint16_t>(sign | (r >> 13));
}

// Element (i0, i1, ...) of a host tensor, read as double. Index arithmetic is 64-bit.
inline double load_as_double(const gla_tensor& t, int64_t offset_elements) {
  const char* base = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case GLA_DTYPE_F32: { float x; std::memcpy(&x, base + offset_elements * 4, 4); return x; }
    case GLA_DTYPE_F64: { double x; std::memcpy(&x, base + offset_elements * 8, 8); return x; }
    case GLA_DTYPE_F16: { uint16_t x; std::memcpy(&x, base + offset_elements * 2, 2); return f16_to_float(x); }
    case GLA_DTYPE_BF16: { uint16_t x; std::memcpy(&x, base + offset_elements * 2, 2); return bf16_to_float(x); }
    case GLA_DTYPE_I32: { int32_t x; std::memcpy(&x, base + offset_elements * 4, 4); return x; }
    case GLA_DTYPE_I64: { int64_t x; std::memcpy(&x, base + offset_elements * 8, 8); return static_cast<double>(x); }
    default: return 0;
  }
}

inline void store_from_double(const gla_tensor& t, int64_t offset_elements, double value) {
  char* base = static_cast<char*>(t.data);
  switch (t.dtype) {
    case GLA_DTYPE_F32: { float x = static_cast<float>(value); std::memcpy(base + offset_elements * 4, &x, 4); break; }
    case GLA_DTYPE_F64: { std::memcpy(base + offset_elements * 8, &value, 8); break; }
    case GLA_DTYPE_F16: { uint16_t x = float_to_f16(static_cast<float>(value)); std::memcpy(base + offset_elements * 2, &x, 2); break; }
    case GLA_DTYPE_BF16: { uint16_t x = float_to_bf16(static_cast<float>(value)); std::memcpy(base + offset_elements * 2, &x, 2); break; }
    default: break;
  }
}

// Offset in elements of index (a, b, c, d) in a rank-4 tensor (or (a, b, c) in rank 3).
inline int64_t offset4(const gla_tensor& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3];
}
inline int64_t offset3(const gla_tensor& t, int64_t a, int64_t b, int64_t c) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2];
}

}  // namespace gla
