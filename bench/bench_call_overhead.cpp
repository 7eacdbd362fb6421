// The host cost of one call through libgla's C ABI on a tiny problem (B=1 T=64 H=1 K=V=64 fp32,
// host memory), the per-call budget of issue 20 (<= 3 us plus the kernel):
//   WorkspaceSize   gla_chunk_forward_workspace_size: validation, shape inference, the dispatcher's
//                   plan; nothing runs. Every PyTorch call pays this once before the forward.
//   Forward         gla_chunk_forward with the dispatcher's choice: the same plus the kernel.
//   ForwardForced   the same with options.backend = "cpu" (the forced-backend path).
//   ForwardWithAllocator  gla_chunk_forward_with_allocator, the PyTorch operators' call: one
//                   validation and plan, scratch from the caller's allocator (a host buffer here).
//   Explain         gla_explain, for scale: the verdict table the error path formats.
// Forward minus WorkspaceSize is the kernel's own time (the cpu backend's one-head loop); the
// operators used to pay WorkspaceSize + Forward, now ForwardWithAllocator.
//
// Run: build/bench/bench_call_overhead (python bench/python_overhead.py: the same from PyTorch)
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <stdexcept>
#include <vector>

#include "gla/gla.h"

namespace {

constexpr int64_t kT = 64, kD = 64;

struct Tiny {
  std::vector<float> q, k, v, g, o;
  gla_tensor tq{}, tk{}, tv{}, tg{}, to{};
  gla_chunk_forward_args args{};

  Tiny() {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (auto* x : {&q, &k, &v, &g, &o}) x->resize(kT * kD);
    for (auto& x : q) x = u(rng);
    for (auto& x : k) x = u(rng);
    for (auto& x : v) x = u(rng);
    for (auto& x : g) x = -0.1f * u(rng);
    for (auto [t, data] : {std::pair{&tq, &q}, {&tk, &k}, {&tv, &v}, {&tg, &g}, {&to, &o}}) {
      *t = gla_tensor{};
      t->data = data->data();
      t->dtype = GLA_DTYPE_F32;
      t->device_type = GLA_DEVICE_CPU;
      t->rank = 4;
      const int64_t sizes[4] = {1, kT, 1, kD}, strides[4] = {kT * kD, kD, kD, 1};
      for (int d = 0; d < 4; ++d) t->sizes[d] = sizes[d], t->strides[d] = strides[d];
    }
    args = gla_chunk_forward_args{&tq, &tk, &tv, &tg, nullptr, nullptr, nullptr, &to, nullptr};
  }
};

void check(gla_status s) {
  if (s != GLA_STATUS_OK) throw std::runtime_error(gla_last_error());
}

void WorkspaceSize(benchmark::State& state) {
  Tiny x;
  gla_options o;
  gla_options_init(&o);
  size_t bytes = 0;
  for (auto _ : state) {
    check(gla_chunk_forward_workspace_size(&x.args, &o, &bytes));
    benchmark::DoNotOptimize(bytes);
  }
}

void Forward(benchmark::State& state, const char* backend) {
  Tiny x;
  gla_options o;
  gla_options_init(&o);
  o.backend = backend;
  for (auto _ : state) {
    check(gla_chunk_forward(&x.args, &o));
    benchmark::DoNotOptimize(x.o.data());
  }
}

void ForwardWithAllocator(benchmark::State& state) {
  Tiny x;
  gla_options o;
  gla_options_init(&o);
  static std::vector<unsigned char> memory;
  const gla_allocator allocator{[](void*, size_t bytes) -> void* {
                                  if (memory.size() < bytes) memory.resize(bytes);
                                  return memory.data();
                                },
                                nullptr};
  for (auto _ : state) {
    check(gla_chunk_forward_with_allocator(&x.args, &o, &allocator));
    benchmark::DoNotOptimize(x.o.data());
  }
}

void Explain(benchmark::State& state) {
  Tiny x;
  gla_options o;
  gla_options_init(&o);
  const char* text = nullptr;
  for (auto _ : state) {
    check(gla_explain(&x.args, nullptr, &o, &text));
    benchmark::DoNotOptimize(text);
  }
}

BENCHMARK(WorkspaceSize);
BENCHMARK_CAPTURE(Forward, Default, nullptr);
BENCHMARK_CAPTURE(Forward, ForcedCpu, "cpu");
BENCHMARK(ForwardWithAllocator);
BENCHMARK(Explain);

}  // namespace

BENCHMARK_MAIN();
