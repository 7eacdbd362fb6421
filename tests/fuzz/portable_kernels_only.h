// Force-included (-include) into the clang sanitizer/fuzzing build of scripts/sanitize.sh: clang 14
// rejects __builtin_cpu_supports("f16c") (src/backends/cpu/cpu_backend.cpp), so this build reports no
// vector ISA and the cpu backend runs its portable kernels. The plain (gcc) build covers the others.
#pragma once
#define __builtin_cpu_supports(feature) 0
