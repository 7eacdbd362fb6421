// Declared capabilities (gla_capability, gla.h): the data every backend publishes about what it
// serves, the default verifier that checks a problem against it (every reason, not only the
// first), and the one-line description explain() prints.
#pragma once

#include <string>
#include <vector>

#include "gla/gla.h"

namespace gla {

inline constexpr uint32_t dtype_bit(int32_t dtype) { return 1u << dtype; }
inline constexpr uint32_t kFloatDtypes = dtype_bit(GLA_DTYPE_F32) | dtype_bit(GLA_DTYPE_F16) | dtype_bit(GLA_DTYPE_BF16);
inline constexpr uint64_t unit_bit(int32_t unit) { return uint64_t{1} << unit; }
inline constexpr uint64_t device_bit(int32_t device) { return uint64_t{1} << device; }
// The stages of SPEC.md §2, as a unit mask.
inline constexpr uint64_t kStageUnits = ((uint64_t{1} << (GLA_UNIT_BWD_DQKG + 1)) - 1) & ~((uint64_t{1} << GLA_UNIT_CUMSUM) - 1);

// A record serving `units` on `devices` with no limits (every float dtype, size and feature but
// chunk states, any layout); fields are then narrowed by the backend.
gla_capability open_capability(uint64_t units, uint64_t devices);

// The GLA_FEATURE_* bits a problem uses.
uint32_t problem_features(const gla_problem& problem);

// Every reason the records decline the problem (empty = a record covering its unit and device
// accepts it). compute_capability: the problem's device's (10 * major + minor), or -1 when unknown
// (then min_compute_capability is the backend's own check).
std::vector<std::string> declaration_reasons(const std::vector<gla_capability>& records, const gla_problem& problem,
                                             int compute_capability);

// "chunk_fwd,chunk_bwd on cuda (sm_80+): dtypes float16,bfloat16; gates ...; K 1..512; ..."
std::string describe(const gla_capability& record);

// Why a declaration is malformed ("" = it is well formed): ranges, masks, unknown bits.
std::string declaration_error(const std::vector<gla_capability>& records);

}  // namespace gla
