// The reference backend's pieces shared between its files.
#pragma once

#include "core/backend.hpp"

namespace gla {

// Runs one stage unit of the chunked algorithm (SPEC.md §2) with fp64 accumulation on the
// intermediates described in gla.h (gla_problem's gcum, h, A, dh, dA, dq_intra, dk_intra).
void run_reference_stage(const gla_problem& problem);

// Runs GLA_UNIT_RECURRENT_FWD or _BWD (reference_recurrent.cpp): the fp64 token loop with gk, gv,
// reverse, varlen and the state pool.
void run_reference_recurrent(const gla_problem& problem);

}  // namespace gla
