// How a kernel's parameter size and dynamic shared memory move its launch latency: (a) host time per
// launch, back to back; (b) GPU time from an event recorded right after a synchronise to the end of
// an (almost) empty 128 x 512 kernel launched next, which is how bench_training.py's synchronised
// column times a call. The ws kernel's parameters are 2 432 bytes (ForwardParams 456, SegmentArgs
// 1 976, most of it the 480-entry block order that only uneven varlen launches use) with 230 KB of
// dynamic shared memory: if (b) grows with the size, a smaller SegmentArgs saves that per call.
//   nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cuda/experiments/launch_params.cu \
//     -o build-cuda/launch_params      # then on the device: ./build-cuda/launch_params
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>
template <int BYTES> struct P { int v[BYTES / 4]; };
template <int BYTES> __global__ void k(const __grid_constant__ P<BYTES> p, int* out) {
  extern __shared__ int sm[];
  if (threadIdx.x == 0 && p.v[0] == 12345) out[blockIdx.x] = sm[0] + p.v[BYTES / 4 - 1];
}
template <int BYTES> void run(int smem, int threads) {
  P<BYTES> p{}; p.v[0] = 1; int* out; cudaMalloc(&out, 4096);
  cudaFuncSetAttribute(k<BYTES>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  for (int i = 0; i < 100; ++i) k<BYTES><<<128, threads, smem>>>(p, out);
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 2000; ++i) k<BYTES><<<128, threads, smem>>>(p, out);
  auto t1 = std::chrono::steady_clock::now();
  cudaDeviceSynchronize();
  double host_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / 2000;
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  std::vector<float> ts;
  for (int i = 0; i < 300; ++i) {
    cudaDeviceSynchronize();
    cudaEventRecord(a); k<BYTES><<<128, threads, smem>>>(p, out); cudaEventRecord(b);
    cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms * 1000);
  }
  std::sort(ts.begin(), ts.end());
  printf("params %5d B  smem %6d  threads %d: host %.2f us/launch, sync->record->launch->record median %.2f us (p10 %.2f, p90 %.2f)\n",
         BYTES, smem, threads, host_us, ts[150], ts[30], ts[270]);
  cudaFree(out);
}
int main() {
  for (int round = 0; round < 2; ++round) {
    run<64>(0, 512); run<512>(0, 512); run<2432>(0, 512); run<4096>(0, 512);
    run<64>(229664, 512); run<512>(229664, 512); run<2432>(229664, 512);
  }
}
