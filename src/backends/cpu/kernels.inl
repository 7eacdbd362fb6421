// The cpu backend's kernels: the chunked algorithm of SPEC.md section 2 on fp32 tiles, for the whole
// forward and backward operations and for every stage unit. Compiled once per instruction set:
// kernels_<isa>.cpp includes simd.inl and this file inside namespace gla::cpu::<isa>; this file
// includes the parts in dependency order.
//
// Conventions: a "tile" is a row-major fp32 array; L is the number of valid rows of a chunk (the
// last chunk of a sequence may be partial); b is the chunk-local cumulative gate in log2 units;
// every exp2 argument is <= 0 for g <= 0 (pivots at sub-chunk boundaries, element-wise diagonal
// blocks), and masked entries are written with stores, never multiplied by a 0/1 mask.

inline constexpr float kRcpLn2 = 1.4426950408889634f;

#include "backends/cpu/tensor_io.inl"
#include "backends/cpu/tile_products.inl"
#include "backends/cpu/diagonal_blocks.inl"
#include "backends/cpu/chunk_steps.inl"
#include "backends/cpu/chunk_gradients.inl"
#include "backends/cpu/scratch_layout.inl"
#include "backends/cpu/whole_ops.inl"
#include "backends/cpu/stage_units.inl"
#include "backends/cpu/kernel_table.inl"
