// The cpu backend's recurrent operator (GLA_UNIT_RECURRENT_FWD / BWD, gla.h: gla_recurrent_*): the
// token loop in fp32 on a contiguous [K, V] state per (sequence, head), threaded over
// (sequence, head). Any gates, either order, varlen, the state pool.
#pragma once

#include "core/backend.hpp"

namespace gla::cpu {

void run_recurrent(const gla_problem& problem);

}  // namespace gla::cpu
