// The cpu backend's dense tile products (its own register-tiled AVX-512 kernel, cpu/kernels.inl)
// against Eigen 3 and OpenBLAS (Debian's libeigen3-dev, libopenblas-dev) on the shapes one chunk
// of the forward uses (C = 64, K = V = 128), single-threaded, operands hot in cache:
//   o       [64 x 128] = Qe [64 x 128] * S [128 x 128]
//   state   [128 x 128] += Kl^T [128 x 64] * v [64 x 128]   (A read transposed)
//   A block [16 x 48]  = Qp [16 x 128] * Kp^T [128 x 48]
//   A * v   [16 x 128] += A [16 x 64] * v [64 x 128]
// Run: build-cpu/bench/bench_tile_products   (skipped at configure time without Eigen and BLAS)
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <random>
#include <vector>

#include "backends/cpu/cpu_kernels.hpp"

namespace gla::cpu::bench_avx512 {
#define GLA_CPU_ISA_NAME "avx512"
#include "backends/cpu/simd.inl"
#include "backends/cpu/kernels.inl"
}  // namespace gla::cpu::bench_avx512

namespace {

struct Shape {
  int64_t M, N, D;
  bool a_transposed;
  bool accumulate;
};
const Shape kShapes[] = {{64, 128, 128, false, false}, {128, 128, 64, true, true}, {16, 48, 128, false, false},
                         {16, 128, 64, false, true}};

struct Operands {
  std::vector<float> a, b, c;
  explicit Operands(const Shape& s) : a(size_t(s.M * s.D)), b(size_t(s.D * s.N)), c(size_t(s.M * s.N)) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-1, 1);
    for (auto* v : {&a, &b, &c})
      for (float& x : *v) x = u(rng);
  }
};

void report(benchmark::State& state, const Shape& s) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(2.0 * s.M * s.N * s.D * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void Own(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  Operands op(s);
  const int64_t rsa = s.a_transposed ? 1 : s.D, csa = s.a_transposed ? s.M : 1;
  for (auto _ : state) {
    gla::cpu::bench_avx512::gemm(s.M, s.N, s.D, op.a.data(), rsa, csa, op.b.data(), s.N, op.c.data(), s.N, s.accumulate);
    benchmark::ClobberMemory();
  }
  report(state, s);
}

void EigenProduct(benchmark::State& state) {
  using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Shape s = kShapes[state.range(0)];
  Operands op(s);
  Eigen::Map<const Mat> b(op.b.data(), s.D, s.N);
  Eigen::Map<Mat> c(op.c.data(), s.M, s.N);
  for (auto _ : state) {
    if (s.a_transposed) {
      Eigen::Map<const Mat> at(op.a.data(), s.D, s.M);
      c.noalias() += at.transpose() * b;
    } else {
      Eigen::Map<const Mat> a(op.a.data(), s.M, s.D);
      if (s.accumulate) {
        c.noalias() += a * b;
      } else {
        c.noalias() = a * b;
      }
    }
    benchmark::ClobberMemory();
  }
  report(state, s);
}

void OpenBlas(benchmark::State& state) {
  const Shape s = kShapes[state.range(0)];
  Operands op(s);
  openblas_set_num_threads(1);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, s.a_transposed ? CblasTrans : CblasNoTrans, CblasNoTrans, int(s.M), int(s.N), int(s.D),
                1.0f, op.a.data(), s.a_transposed ? int(s.M) : int(s.D), op.b.data(), int(s.N),
                s.accumulate ? 1.0f : 0.0f, op.c.data(), int(s.N));
    benchmark::ClobberMemory();
  }
  report(state, s);
}

}  // namespace

BENCHMARK(Own)->DenseRange(0, 3);
BENCHMARK(EigenProduct)->DenseRange(0, 3);
BENCHMARK(OpenBlas)->DenseRange(0, 3);
BENCHMARK_MAIN();
