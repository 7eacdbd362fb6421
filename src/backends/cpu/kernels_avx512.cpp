// The cpu backend's kernels built for the avx512 instruction set (flags: src/backends/cpu/CMakeLists.txt).
// Everything lives in namespace gla::cpu::avx512 so nothing compiled here can be shared with code built
// for another instruction set.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "backends/cpu/cpu_kernels.hpp"

namespace gla::cpu::avx512 {
#define GLA_CPU_ISA_NAME "avx512"
#include "backends/cpu/simd.inl"
#include "backends/cpu/kernels.inl"
}  // namespace gla::cpu::avx512
