// The kernel table of one instruction set (item count, scratch size, run): what cpu_backend.cpp
// calls through cpu_kernels.hpp. Part of kernels.inl.

inline int64_t item_count(const gla_problem& p, int threads) {
  const int64_t group = head_group(p, threads);
  if (p.unit == GLA_UNIT_CHUNK_FWD) return p.N * ((p.H + group - 1) / group) * value_tiles(p);
  if (p.unit == GLA_UNIT_CHUNK_BWD) return p.N * ((p.H + group - 1) / group);
  return p.N * p.H;
}
inline size_t scratch_floats(const gla_problem& p, int threads) {
  size_t total = 0;
  carve(p, head_group(p, threads), nullptr, &total);
  return total;
}
inline void run_item(const gla_problem& p, int threads, int64_t item, float* scratch) {
  size_t total = 0;
  const int64_t group = head_group(p, threads);
  const Tiles t = carve(p, group, scratch, &total);
  if (p.unit == GLA_UNIT_CHUNK_FWD) {
    run_forward(p, item, group, t);
  } else if (p.unit == GLA_UNIT_CHUNK_BWD) {
    run_backward(p, item, group, t);
  } else {
    run_stage(p, item, t);
  }
}

const KernelTable& kernels() {
  static const KernelTable table{GLA_CPU_ISA_NAME, &item_count, &scratch_floats, &run_item};
  return table;
}
