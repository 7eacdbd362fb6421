// libgla's element types on the host: sizes and names of the gla_dtype values, bit-exact fp16 /
// bf16 <-> fp32 conversions (round to nearest even), and element reads and writes of host memory
// as double. Header-only; the core and the command line use the same functions.
#pragma once

#include <cstdint>
#include <cstring>

#include "gla/gla.h"

namespace gla {

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

// Element `offset_elements` of host memory `data` holding `dtype` values, read as double. Index
// arithmetic is 64-bit.
inline double load_element(const void* data, int32_t dtype, int64_t offset_elements) {
  const char* base = static_cast<const char*>(data);
  switch (dtype) {
    case GLA_DTYPE_F32: { float x; std::memcpy(&x, base + offset_elements * 4, 4); return x; }
    case GLA_DTYPE_F64: { double x; std::memcpy(&x, base + offset_elements * 8, 8); return x; }
    case GLA_DTYPE_F16: { uint16_t x; std::memcpy(&x, base + offset_elements * 2, 2); return f16_to_float(x); }
    case GLA_DTYPE_BF16: { uint16_t x; std::memcpy(&x, base + offset_elements * 2, 2); return bf16_to_float(x); }
    case GLA_DTYPE_I32: { int32_t x; std::memcpy(&x, base + offset_elements * 4, 4); return x; }
    case GLA_DTYPE_I64: { int64_t x; std::memcpy(&x, base + offset_elements * 8, 8); return static_cast<double>(x); }
    default: return 0;
  }
}

// The same element written from a double (rounded to nearest even for 16-bit floats; integer
// dtypes are not written).
inline void store_element(void* data, int32_t dtype, int64_t offset_elements, double value) {
  char* base = static_cast<char*>(data);
  switch (dtype) {
    case GLA_DTYPE_F32: { float x = static_cast<float>(value); std::memcpy(base + offset_elements * 4, &x, 4); break; }
    case GLA_DTYPE_F64: { std::memcpy(base + offset_elements * 8, &value, 8); break; }
    case GLA_DTYPE_F16: { uint16_t x = float_to_f16(static_cast<float>(value)); std::memcpy(base + offset_elements * 2, &x, 2); break; }
    case GLA_DTYPE_BF16: { uint16_t x = float_to_bf16(static_cast<float>(value)); std::memcpy(base + offset_elements * 2, &x, 2); break; }
    default: break;
  }
}

}  // namespace gla
