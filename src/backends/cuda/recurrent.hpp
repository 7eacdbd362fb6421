// The cuda backend's recurrent units (host side): the checks its declaration cannot express and the
// launch of recurrent_forward.cu for GLA_UNIT_RECURRENT_FWD (gla_recurrent_forward and the state
// update). The backward is not implemented on CUDA (not declared: the `torch` backend serves CUDA
// tensors).
#pragma once

#include <string>
#include <vector>

#include "core/backend.hpp"

namespace gla::cuda {

// The state tiles' 16-byte loads, where cu_seqlens lives, the grid limits: every reason.
std::vector<std::string> recurrent_checks(const gla_problem& problem);
void run_recurrent(const gla_problem& problem);

}  // namespace gla::cuda
