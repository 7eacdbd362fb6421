// The cuda backend's recurrent units (host side): the checks its declaration cannot express, the
// launch of recurrent_forward.cu for GLA_UNIT_RECURRENT_FWD (gla_recurrent_forward and the state
// update) and of recurrent_backward.cu for GLA_UNIT_RECURRENT_BWD (gla_recurrent_backward).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace gla::cuda {

// The state tiles' 16-byte loads (forward), where cu_seqlens lives, the grid limits: every reason.
std::vector<std::string> recurrent_checks(const gla_problem& problem);
// The forward (GLA_UNIT_RECURRENT_FWD); throws gla::Error when the launch fails.
void run_recurrent(const gla_problem& problem);

// Workspace bytes of GLA_UNIT_RECURRENT_BWD (the backward's checkpoints and per-value-tile partial
// sums); 0 for the forward.
size_t recurrent_workspace(const gla_problem& problem);
// The backward with `workspace` (recurrent_workspace bytes, 16-byte aligned); throws gla::Error when
// the launch fails.
void run_recurrent_backward(const gla_problem& problem, void* workspace);
// explain()'s line for either unit.
std::string recurrent_plan_note(const gla_problem& problem);

}  // namespace gla::cuda
