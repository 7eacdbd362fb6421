// The boundary between the cpu backend's dispatch code (built for the baseline ISA) and its kernels,
// which are compiled once per instruction set (AVX-512, AVX2+FMA, portable C++) and chosen at run
// time. Only plain C data crosses it: a gla_problem and raw float scratch.
//
// Why a table of function pointers and not templates or `target` attributes: each kernel translation
// unit wraps all of its code in its own namespace, so no inline function or template compiled with
// AVX-512 can be merged by the linker into code that runs on a machine without it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gla/gla.h"

namespace gla::cpu {

// Chunk length of the whole operations (the stage units use problem.chunk_size). 64 keeps a chunk's
// q, k, v, gates and the K x V state of one head in L2 at K = V = 128, and matches fla.
inline constexpr int64_t kChunk = 64;
// Sub-chunk (pivot) length of SPEC.md section 3.
inline constexpr int64_t kSub = 16;
// Widest value tile of one forward work item. V above it is split into equal tiles (a function of V
// only, so the decomposition - and the result - never depends on the thread count).
inline constexpr int64_t kMaxValueTile = 128;

struct KernelTable {
  const char* isa;
  // `threads` (the pool size) may change how work is grouped into items, never a result.
  // Independent work items of the unit (each writes only its own outputs).
  int64_t (*item_count)(const gla_problem& problem, int threads);
  // Floats of private scratch one item needs.
  size_t (*scratch_floats)(const gla_problem& problem, int threads);
  void (*run_item)(const gla_problem& problem, int threads, int64_t item, float* scratch);
};

namespace avx512 {
const KernelTable& kernels();
}
namespace avx2 {
const KernelTable& kernels();
}
namespace portable {
const KernelTable& kernels();
}

}  // namespace gla::cpu
