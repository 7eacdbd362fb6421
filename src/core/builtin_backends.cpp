// The candidate list of built-in backends, in one place (oneDNN-style): which backends this build
// contains. Priority (not this order) decides who runs first; `reference` closes the list.
#include "core/registry.hpp"

namespace gla {

void register_builtin_backends(Registry& registry) {
#ifdef GLA_WITH_CUDA_BACKEND
  registry.add(make_cuda_backend());
#endif
#ifdef GLA_WITH_CPU_BACKEND
  registry.add(make_cpu_backend());
#endif
  registry.add(make_reference_backend());
}

}  // namespace gla
