// Does compute-sanitizer's racecheck understand the warp-specialised kernel's hand-off?
//
// The same protocol as chunk_forward_ws_kernel.cuh, without the mathematics: a producer group
// (8 warps) fills slot s = i & 1 of a two-slot buffer (each thread its own elements), reads other
// threads' elements after a producer-only barrier, rescales its own elements in place (the kernel's
// qloc -> qg step), and publishes the slot on READY[s]; a consumer group (8 warps) waits on READY[s],
// reads the whole slot, and releases it on FREE[s]; the producer waits on FREE[s] before writing the
// slot again two iterations later.
//   mode 0: READY by bar.arrive (a named-barrier hand-off)
//   mode 1: READY by bar.sync on both sides
//   mode 2: mode 0 without FREE: a real race (slot rewritten while it may still be read), which
//           racecheck must report
//   mode 3: READY and FREE as mbarriers (arrive by every thread, try_wait.parity): the kernel's
//           hand-off
//   mode 4: mode 3 without the FREE wait: the racy control for mode 3
// Build: nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o handoff bench/cuda/handoff_racecheck.cu
// Run:   compute-sanitizer --tool racecheck ./handoff MODE   (prints the checksum; exit 1 if wrong)
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

namespace {

constexpr int kProducers = 256, kConsumers = 256, kThreads = kProducers + kConsumers;
constexpr int kSlotElems = 2048, kIters = 16;

__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }

__device__ __forceinline__ uint32_t saddr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(saddr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" ::"r"(saddr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{ .reg .pred done; WAIT_%=: mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1; @!done bra WAIT_%=; }" ::"r"(saddr(b)),
      "r"(parity)
      : "memory");
}

// Modes 3 and 4: the same protocol on mbarriers. Phase k of READY[s] / FREE[s] belongs to iteration
// 2k + s, so a waiter for iteration i waits for parity (i / 2) & 1.
__device__ void handoff_mbarrier(int mode, float* out, float (*slot)[kSlotElems], float* scratch, uint64_t* bars) {
  uint64_t* ready = bars;      // [2]
  uint64_t* freed = bars + 2;  // [2]
  const int tid = threadIdx.x;
  if (tid < kProducers) {
    for (int i = 0; i < kIters; ++i) {
      const int s = i & 1;
      if (i >= 2 && mode == 3) mbar_wait(&freed[s], ((i - 2) / 2) & 1);
      for (int e = tid; e < kSlotElems; e += kProducers) slot[s][e] = float(i * kSlotElems + e);
      scratch[tid] = float(i);
      bar_sync(1, kProducers);
      float other = scratch[(tid + 1) % kProducers];
      bar_sync(1, kProducers);
      for (int e = tid; e < kSlotElems; e += kProducers) slot[s][e] = slot[s][e] * 2.f + (other - float(i));
      mbar_arrive(&ready[s]);
    }
  } else {
    const int c = tid - kProducers;
    float sum = 0.f;
    for (int i = 0; i < kIters; ++i) {
      const int s = i & 1;
      mbar_wait(&ready[s], (i / 2) & 1);
      for (int e = c; e < kSlotElems; e += kConsumers) sum += slot[s][(e * 7) % kSlotElems];
      mbar_arrive(&freed[s]);
    }
    out[c] = sum;
  }
}

__global__ void __launch_bounds__(kThreads, 1) handoff(int mode, float* out) {
  __shared__ float slot[2][kSlotElems];
  __shared__ float scratch[kProducers];
  __shared__ uint64_t bars[4];
  const int tid = threadIdx.x;
  if (mode >= 3) {
    if (tid == 0) {
      mbar_init(&bars[0], kProducers);
      mbar_init(&bars[1], kProducers);
      mbar_init(&bars[2], kConsumers);
      mbar_init(&bars[3], kConsumers);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    handoff_mbarrier(mode, out, slot, scratch, bars);
    return;
  }
  if (tid < kProducers) {
    for (int i = 0; i < kIters; ++i) {
      const int s = i & 1;
      if (i >= 2 && mode != 2) bar_sync(3 + s, kThreads);  // FREE[s]
      for (int e = tid; e < kSlotElems; e += kProducers) slot[s][e] = float(i * kSlotElems + e);
      scratch[tid] = float(i);
      bar_sync(1, kProducers);
      float other = scratch[(tid + 1) % kProducers];  // read another producer's element
      bar_sync(1, kProducers);
      for (int e = tid; e < kSlotElems; e += kProducers) slot[s][e] = slot[s][e] * 2.f + (other - float(i));
      if (mode == 1) bar_sync(5 + s, kThreads); else bar_arrive(5 + s, kThreads);  // READY[s]
    }
    if (mode != 2) {
      for (int i = kIters - 2; i < kIters; ++i) bar_sync(3 + (i & 1), kThreads);
    }
  } else {
    const int c = tid - kProducers;
    float sum = 0.f;
    for (int i = 0; i < kIters; ++i) {
      const int s = i & 1;
      bar_sync(5 + s, kThreads);  // READY[s]
      for (int e = c; e < kSlotElems; e += kConsumers) sum += slot[s][(e * 7) % kSlotElems];
      if (mode != 2) bar_arrive(3 + s, kThreads);  // FREE[s]
    }
    out[c] = sum;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  float* d = nullptr;
  if (cudaMalloc(&d, kConsumers * sizeof(float)) != cudaSuccess) return 2;
  handoff<<<1, kThreads>>>(mode, d);
  if (cudaDeviceSynchronize() != cudaSuccess || cudaGetLastError() != cudaSuccess) {
    std::printf("launch failed\n");
    return 2;
  }
  float h[kConsumers];
  cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  // Expected: every consumer reads each element (i*N + e)*2 once per iteration (a permutation).
  double want = 0.0;
  for (int i = 0; i < kIters; ++i)
    for (int e = 0; e < kSlotElems; ++e) want += 2.0 * (double(i) * kSlotElems + e);
  double got = 0.0;
  for (int c = 0; c < kConsumers; ++c) got += h[c];
  const bool ok = std::abs(got - want) <= 1e-5 * want;
  std::printf("mode %d: checksum %.6e expected %.6e %s\n", mode, got, want, ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
