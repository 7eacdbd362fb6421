// The cpu backend against the machine and against the reference backend, in one run (PERF.md: CPU
// ratios in one run). Cases:
//   FmaPeak            fp32 FMA throughput of this machine: every hardware thread runs independent
//                      FMA chains on the widest vector unit the CPU has (chosen at run time).
//   Cpu/...            the cpu backend through the public C API, B=1 T=4096 H=16 K=V=128 fp32.
//   Reference/...      the reference backend on a proportional slice: all 16 heads (so it runs on
//                      as many threads as the full problem), T = 256 of 4096, its time multiplied
//                      by 16 to the full problem. The reference is a token loop, linear in T, so the
//                      scaling is exact up to cache effects (its working set per head is one K x V
//                      state, the same in both). Cpu/.../1 runs the cpu backend on the same slice.
//   CpuSavedStates     forward + backward on the full problem through gla_chunk_forward_saving_states
//                      and gla_chunk_backward_from_states (the backward reads the forward's chunk-start
//                      states instead of recomputing them).
// FLOPs: chunked forward = T*H*(4*K*V + 2*C*(K+V)), C = 64; forward+backward = 3 x forward
// (the backward differentiates each of the forward's four products with respect to both operands,
// 2 x forward; the recomputation of chunk states and A the implementation does is not counted).
//
// Run: build-cpu/bench/bench_cpu --benchmark_min_time=2
#include <benchmark/benchmark.h>

#include "gla/gla.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "gla/gla.h"

namespace {

constexpr int64_t kB = 1, kT = 4096, kH = 16, kK = 128, kV = 128, kC = 64;
constexpr int64_t kSliceT = 256, kSliceH = kH;

double forward_flops(int64_t T, int64_t H) { return double(T) * H * (4.0 * kK * kV + 2.0 * kC * (kK + kV)); }

// ---- fp32 FMA peak ----
// Twelve independent FMA chains per thread (enough for 2 FMA ports x 4-cycle latency, with margin),
// written in assembly so the compiler cannot spill or merge them: an intrinsics version measured
// ~2.7x lower on this machine (the optimiser serialised the chains through memory).
constexpr int kChains = 12;

#define GLA_FMA12(reg)                                                                                   \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "0\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "1\n"  \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "2\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "3\n"  \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "4\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "5\n"  \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "6\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "7\n"  \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "8\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "9\n"  \
  "vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "10\n vfmadd231ps %%" reg "12, %%" reg "13, %%" reg "11\n"

#if defined(__x86_64__)
__attribute__((target("avx512f"))) double fma_loop_avx512(int64_t iters) {
  __asm__ volatile(
      "vxorps %%zmm12, %%zmm12, %%zmm12\n vxorps %%zmm13, %%zmm13, %%zmm13\n"
      "1:\n" GLA_FMA12("zmm") "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "cc");
  return 0.0;
}
__attribute__((target("avx2,fma"))) double fma_loop_avx2(int64_t iters) {
  __asm__ volatile(
      "vxorps %%ymm12, %%ymm12, %%ymm12\n vxorps %%ymm13, %%ymm13, %%ymm13\n"
      "1:\n" GLA_FMA12("ymm") "dec %0\n jnz 1b\n"
      : "+r"(iters)
      :
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "cc");
  return 0.0;
}
#endif

int lanes_and_loop(double (**loop)(int64_t)) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    *loop = fma_loop_avx512;
    return 16;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    *loop = fma_loop_avx2;
    return 8;
  }
#endif
  *loop = nullptr;
  return 0;
}

int thread_count() {
  if (const char* env = std::getenv("GLA_NUM_THREADS")) {
    if (std::atoi(env) > 0) return std::atoi(env);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

void FmaPeak(benchmark::State& state) {
  double (*loop)(int64_t) = nullptr;
  const int lanes = lanes_and_loop(&loop);
  if (!loop) {
    state.SkipWithError("no AVX2/AVX-512 FMA on this CPU");
    return;
  }
  const int threads = thread_count();
  const int64_t iters = 50'000'000;
  std::atomic<double> sink{0};
  for (auto _ : state) {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&] { sink = sink + loop(iters); });
    for (auto& th : pool) th.join();
  }
  benchmark::DoNotOptimize(sink.load());
  const double flops = double(threads) * iters * kChains * lanes * 2.0;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
  state.counters["lanes"] = lanes;
}

// ---- the operator through the C API ----
struct Problem {
  int64_t T, H;
  std::vector<float> q, k, v, g, h0, o, ht, dout, dht, dq, dk, dv, dg, dh0;
  gla_tensor tq, tk, tv, tg, th0, to, tht, tdo, tdht, tdq, tdk, tdv, tdg, tdh0;
};

gla_tensor describe(std::vector<float>& data, std::initializer_list<int64_t> sizes) {
  return gla::tensor(data.data(), GLA_DTYPE_F32, sizes);
}

Problem make_problem(int64_t T, int64_t H) {
  Problem p;
  p.T = T;
  p.H = H;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  std::normal_distribution<float> n(0.0f, 1.0f);
  const auto fill = [&](std::vector<float>& x, int64_t count, int kind) {
    x.resize(static_cast<size_t>(count));
    for (float& e : x) {
      if (kind == 0) e = u(rng);
      if (kind == 1) e = n(rng);
      if (kind == 2) e = std::log(1.0f / (1.0f + std::exp(-u(rng))));  // logsigmoid(U[0,1)), SPEC §5
    }
  };
  const int64_t tk = kB * T * H * kK, tv = kB * T * H * kV, st = kB * H * kK * kV;
  fill(p.q, tk, 0), fill(p.k, tk, 0), fill(p.v, tv, 0), fill(p.g, tk, 2), fill(p.h0, st, 1);
  fill(p.dout, tv, 1), fill(p.dht, st, 1);
  p.o.assign(size_t(tv), 0), p.ht.assign(size_t(st), 0), p.dq.assign(size_t(tk), 0), p.dk.assign(size_t(tk), 0);
  p.dv.assign(size_t(tv), 0), p.dg.assign(size_t(tk), 0), p.dh0.assign(size_t(st), 0);
  p.tq = describe(p.q, {kB, T, H, kK}), p.tk = describe(p.k, {kB, T, H, kK}), p.tv = describe(p.v, {kB, T, H, kV});
  p.tg = describe(p.g, {kB, T, H, kK}), p.th0 = describe(p.h0, {kB, H, kK, kV}), p.to = describe(p.o, {kB, T, H, kV});
  p.tht = describe(p.ht, {kB, H, kK, kV}), p.tdo = describe(p.dout, {kB, T, H, kV}), p.tdht = describe(p.dht, {kB, H, kK, kV});
  p.tdq = describe(p.dq, {kB, T, H, kK}), p.tdk = describe(p.dk, {kB, T, H, kK}), p.tdv = describe(p.dv, {kB, T, H, kV});
  p.tdg = describe(p.dg, {kB, T, H, kK}), p.tdh0 = describe(p.dh0, {kB, H, kK, kV});
  return p;
}

void check(gla_status s) {
  if (s != GLA_STATUS_OK) throw std::runtime_error(std::string("libgla: ") + gla_last_error());
}

void run_forward(Problem& p, const char* backend) {
  gla_options opt;
  gla_options_init(&opt);
  opt.backend = backend;
  gla_chunk_forward_args a{};
  a.q = &p.tq, a.k = &p.tk, a.v = &p.tv, a.g = &p.tg, a.initial_state = &p.th0, a.o = &p.to, a.final_state = &p.tht;
  check(gla_chunk_forward(&a, &opt));
}
void run_backward(Problem& p, const char* backend) {
  gla_options opt;
  gla_options_init(&opt);
  opt.backend = backend;
  gla_chunk_backward_args a{};
  a.q = &p.tq, a.k = &p.tk, a.v = &p.tv, a.g = &p.tg, a.initial_state = &p.th0, a.do_ = &p.tdo, a.dht = &p.tdht;
  a.dq = &p.tdq, a.dk = &p.tdk, a.dv = &p.tdv, a.dg = &p.tdg, a.dh0 = &p.tdh0;
  check(gla_chunk_backward(&a, &opt));
}

// Arguments: 0 = forward, 1 = forward + backward; the slice flag selects the reference slice.
template <bool Reference>
void Operator(benchmark::State& state) {
  const bool backward = state.range(0) == 1;
  const bool slice = state.range(1) == 1;
  const int64_t T = slice ? kSliceT : kT, H = slice ? kSliceH : kH;
  const char* backend = Reference ? "reference" : "cpu";
  Problem p = make_problem(T, H);
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    run_forward(p, backend);
    if (backward) run_backward(p, backend);
    benchmark::ClobberMemory();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  // Scale a slice to the full problem: time x (full token-heads / slice token-heads).
  const double scale = double(kT * kH) / double(T * H);
  const double flops = forward_flops(T, H) * (backward ? 3.0 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["full_problem_ms"] = scale * 1e3 * seconds / double(state.iterations());
  state.SetLabel(std::string(backward ? "fwd+bwd" : "fwd") + (slice ? " slice T=256 H=16 (x16)" : " B1 T4096 H16 K=V=128"));
}

// Forward + backward with saved chunk states: gla_chunk_forward_saving_states leaves the state at
// the start of each 64-token chunk ([T/64, H, K, V] fp32, 64 MiB here), gla_chunk_backward_from_states
// reads them instead of recomputing them. Same problem and outputs as Cpu/1/0.
void CpuSavedStates(benchmark::State& state) {
  Problem p = make_problem(kT, kH);
  std::vector<float> states(static_cast<size_t>((kT + 63) / 64 * kH * kK * kV), 0.0f);
  const gla_tensor th = describe(states, {(kT + 63) / 64, kH, kK, kV});
  gla_options opt;
  gla_options_init(&opt);
  opt.backend = "cpu";
  gla_chunk_forward_args fa{};
  fa.q = &p.tq, fa.k = &p.tk, fa.v = &p.tv, fa.g = &p.tg, fa.initial_state = &p.th0, fa.o = &p.to, fa.final_state = &p.tht;
  gla_chunk_backward_args ba{};
  ba.q = &p.tq, ba.k = &p.tk, ba.v = &p.tv, ba.g = &p.tg, ba.initial_state = &p.th0, ba.do_ = &p.tdo, ba.dht = &p.tdht;
  ba.dq = &p.tdq, ba.dk = &p.tdk, ba.dv = &p.tdv, ba.dg = &p.tdg, ba.dh0 = &p.tdh0;
  double seconds = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    check(gla_chunk_forward_saving_states(&fa, &th, &opt));
    check(gla_chunk_backward_from_states(&ba, &th, &opt));
    benchmark::ClobberMemory();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(forward_flops(kT, kH) * 3.0 * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["full_problem_ms"] = 1e3 * seconds / double(state.iterations());
  state.SetLabel("fwd+bwd saved states B1 T4096 H16 K=V=128");
}

}  // namespace

BENCHMARK(FmaPeak)->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(5);
BENCHMARK(Operator<false>)->Name("Cpu")->Args({0, 0})->Args({1, 0})->Args({0, 1})->Args({1, 1})->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(CpuSavedStates)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK(Operator<true>)->Name("Reference")->Args({0, 1})->Args({1, 1})->UseRealTime()->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
