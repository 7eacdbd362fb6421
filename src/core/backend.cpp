#include "core/backend.hpp"

#include "core/capabilities.hpp"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace gla {

const char* device_type_name(int32_t device_type) {
  switch (device_type) {
    case GLA_DEVICE_CPU: return "cpu";
    case GLA_DEVICE_CUDA: return "cuda";
    case GLA_DEVICE_CUDA_HOST: return "cuda_host";
    case GLA_DEVICE_OPENCL: return "opencl";
    case GLA_DEVICE_VULKAN: return "vulkan";
    case GLA_DEVICE_METAL: return "metal";
    case GLA_DEVICE_ROCM: return "rocm";
    case GLA_DEVICE_EXT: return "ext";
    case GLA_DEVICE_ONEAPI: return "oneapi";
    default: return "unknown device";
  }
}

std::string shape_string(const gla_tensor& t) {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < t.rank; ++i) s << (i ? ", " : "") << t.sizes[i];
  s << ']';
  return s.str();
}

bool Backend::serves_device(int32_t device_type) const {
  if (device_type < 0 || device_type >= 64) return false;
  for (const auto& c : capabilities()) {
    if (c.device_mask & device_bit(device_type)) return true;
  }
  return false;
}

bool Backend::implements(int32_t unit) const {
  if (unit < 0 || unit >= 64) return false;
  for (const auto& c : capabilities()) {
    if (c.unit_mask & unit_bit(unit)) return true;
  }
  return false;
}

Verdict Backend::verify(const gla_problem& problem) const {
  std::vector<std::string> why = declaration_reasons(capabilities(), problem, compute_capability(problem));
  for (auto& w : check_more(problem)) why.push_back(std::move(w));
  if (why.empty()) return Verdict::yes();
  std::string joined;
  for (const auto& w : why) {
    if (!joined.empty()) joined += "; ";
    joined += w;
  }
  return Verdict::no(joined);
}

double Backend::time_run_ms(const gla_problem& /*problem*/, const std::function<void()>& run) {
  const auto start = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

void* Backend::allocate(const gla_problem& problem, size_t bytes) {
  if (!host_accessible(problem.device_type)) {
    fail(GLA_STATUS_NOT_SUPPORTED, "backend '" + name() + "' cannot allocate memory on device " +
                                       device_type_name(problem.device_type));
  }
  if (bytes == 0) return nullptr;
  // 64-byte alignment: whole cache lines for the vector loops of host backends.
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (!p) fail(GLA_STATUS_OUT_OF_MEMORY, "host allocation of " + std::to_string(bytes) + " bytes failed");
  return p;
}

void Backend::deallocate(const gla_problem& /*problem*/, void* pointer) { std::free(pointer); }

void Backend::copy_to_host(const gla_problem& problem, const void* device_src, void* host_dst, size_t bytes) {
  if (!host_accessible(problem.device_type)) {
    fail(GLA_STATUS_NOT_SUPPORTED, "backend '" + name() + "' cannot copy from device " +
                                       device_type_name(problem.device_type));
  }
  std::memcpy(host_dst, device_src, bytes);
}

}  // namespace gla
