// Overflow-checked int64 arithmetic for sizes, strides and offsets (SPEC.md §3.9). Validation, the
// workspace-size query and the command line size everything through these before anything is
// computed, so a problem whose addressing would wrap is rejected instead of run. Header-only and public
// so the command line and the fuzz targets share it.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>

#include "gla/gla.h"

namespace gla {

// nullopt when the exact result does not fit in int64.
inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}
inline std::optional<int64_t> checked_add(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_add(*a, *b) : std::nullopt;
}
inline std::optional<int64_t> checked_mul(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_mul(*a, *b) : std::nullopt;
}
inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  std::optional<int64_t> r = 1;
  for (int64_t f : factors) r = checked_mul(r, f);
  return r;
}

// Number of elements of a descriptor (product of its sizes).
inline std::optional<int64_t> checked_numel(const gla_tensor& t) {
  std::optional<int64_t> r = 1;
  for (int i = 0; i < t.rank; ++i) r = checked_mul(r, t.sizes[i]);
  return r;
}

// Largest element offset any index of the descriptor reaches: sum over dims of
// (size - 1) * stride, dims of size 0 counting as size 1 (backends may form a base offset from the
// other dims before looping over an empty one). Sizes and strides must be non-negative. Every
// partial sum of index * stride a backend forms is at most this, so it bounds all of them.
inline std::optional<int64_t> checked_max_offset(const gla_tensor& t) {
  std::optional<int64_t> r = 0;
  for (int i = 0; i < t.rank; ++i) {
    const int64_t last = t.sizes[i] > 0 ? t.sizes[i] - 1 : 0;
    r = checked_add(r, checked_mul(last, t.strides[i]));
  }
  return r;
}

// Bytes from the first to one past the last addressed element: (max offset + 1) * element size;
// 0 for a tensor without elements.
inline std::optional<int64_t> checked_extent_bytes(const gla_tensor& t, int64_t element_size) {
  const auto n = checked_numel(t);
  if (!n) return std::nullopt;
  const auto last = checked_max_offset(t);
  if (*n == 0) return last ? std::optional<int64_t>(0) : std::nullopt;
  return checked_mul(checked_add(last, int64_t{1}), element_size);
}

}  // namespace gla
