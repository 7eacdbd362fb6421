// The cuda backend's recurrent units (host side): the verifier and the launch of
// recurrent_forward.cu for GLA_UNIT_RECURRENT_FWD (gla_recurrent_forward and the state update).
// The backward is not implemented on CUDA: the verifier declines it with that reason, and the
// `torch` backend serves CUDA tensors.
#pragma once

#include "core/backend.hpp"

namespace gla::cuda {

Verdict verify_recurrent(const gla_problem& problem);
void run_recurrent(const gla_problem& problem);

}  // namespace gla::cuda
