// Per-(kernel, device) launch attributes. cudaFuncSetAttribute applies to the current device, so a
// limit raised once per process would leave a second GPU of the process at the default 48 KB; and
// setting it on every call costs host time (one driver call each).
#pragma once

#include <atomic>
#include <cstddef>

#include <cuda_runtime_api.h>

namespace gla::cuda::detail {

constexpr int kMaxCachedDevices = 64;  // devices past this are set on every call (correct, slower)

enum class Carveout { kDefault, kMaxShared };

// Raises Kernel's dynamic shared-memory limit on the current device to at least `bytes` once per
// (kernel, device); kMaxShared also asks for the largest shared-memory carveout, for kernels
// planned with several CTAs per SM whose shared memory together needs it. Afterwards a call costs
// one cudaGetDevice and an atomic load.
template <auto Kernel>
cudaError_t allow_dynamic_shared_memory(size_t bytes, Carveout carveout = Carveout::kDefault) {
  static std::atomic<size_t> raised[kMaxCachedDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached && raised[device].load(std::memory_order_acquire) >= bytes) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess && carveout == Carveout::kMaxShared) {
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
  }
  if (err != cudaSuccess) return err;
  if (cached) {
    size_t seen = raised[device].load(std::memory_order_relaxed);
    while (seen < bytes && !raised[device].compare_exchange_weak(seen, bytes, std::memory_order_release)) {
    }
  }
  return cudaSuccess;
}

}  // namespace gla::cuda::detail
