// Host-side reading of a validated recurrent problem (GLA_UNIT_RECURRENT_FWD / BWD): the token order
// and, for the state update, which pool entry each sequence uses. Shared by the host backends.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/backend.hpp"
#include "core/parallel.hpp"

namespace gla {

// Token of step s (0-based) of a sequence of `length` tokens: reverse walks last to first.
inline int64_t recurrent_token(const gla_problem& p, int64_t length, int64_t step) {
  return p.reverse ? length - 1 - step : step;
}

// The state index of every sequence: n without state_slots; with them the slot, or -1 for a
// sequence that is skipped (slot outside [0, P), or a slot an earlier sequence already uses).
// `error_bits` receives the GLA_SLOT_ERROR_* bits of the skipped ones. Host memory only.
inline std::vector<int64_t> recurrent_state_indices(const gla_problem& p, int32_t* error_bits) {
  std::vector<int64_t> index(static_cast<size_t>(p.N));
  *error_bits = 0;
  if (!present(p.state_slots)) {
    for (int64_t n = 0; n < p.N; ++n) index[static_cast<size_t>(n)] = n;
    return index;
  }
  const int64_t P = p.initial_state.sizes[0];
  std::vector<char> used(static_cast<size_t>(P), 0);
  for (int64_t n = 0; n < p.N; ++n) {
    int32_t slot;
    std::memcpy(&slot, static_cast<const char*>(p.state_slots.data) + n * p.state_slots.strides[0] * 4, 4);
    int64_t chosen = -1;
    if (slot < 0 || slot >= P) {
      *error_bits |= GLA_SLOT_ERROR_OUT_OF_RANGE;
    } else if (used[static_cast<size_t>(slot)]) {
      *error_bits |= GLA_SLOT_ERROR_REPEATED;
    } else {
      used[static_cast<size_t>(slot)] = 1;
      chosen = slot;
    }
    index[static_cast<size_t>(n)] = chosen;
  }
  return index;
}

// ORs bits into the state update's slot_error[0] (host memory).
inline void report_slot_error(const gla_problem& p, int32_t bits) {
  if (bits == 0 || !present(p.slot_error)) return;
  int32_t flag;
  std::memcpy(&flag, p.slot_error.data, 4);
  flag |= bits;
  std::memcpy(p.slot_error.data, &flag, 4);
}

// Runs body(n, h, state_index) for every (sequence, head) of p on the host threads
// (parallel_for), with the state indices resolved first and the skipped slots reported after.
template <class Body>
void for_each_recurrent_head(const gla_problem& p, Body&& body) {
  int32_t error_bits = 0;
  const std::vector<int64_t> index = recurrent_state_indices(p, &error_bits);
  parallel_for(p.N * p.H, [&](int64_t item) { body(item / p.H, item % p.H, index[static_cast<size_t>(item / p.H)]); });
  report_slot_error(p, error_bits);
}

// Element offset of token_states entry (batch b, token t, head h, key i, value j).
inline int64_t token_state_offset(const gla_problem& p, int64_t b, int64_t t, int64_t h, int64_t i, int64_t j) {
  const gla_tensor& s = p.token_states;
  const int64_t r3 = p.state_v_first ? j : i, r4 = p.state_v_first ? i : j;
  return b * s.strides[0] + t * s.strides[1] + h * s.strides[2] + r3 * s.strides[3] + r4 * s.strides[4];
}

}  // namespace gla
