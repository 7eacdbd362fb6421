#include "core/parallel.hpp"

#include <cerrno>

#include "core/environment.hpp"

#if defined(__linux__)
#include <sched.h>
#endif

namespace gla {

namespace {

// CPUs in the affinity mask (taskset, cgroup cpusets) of the thread that first asks, which its
// process inherits; 0 where the platform has none. hardware_concurrency() counts every online CPU:
// a process pinned to 2 of 16 would start 16 threads on 2.
int affinity_cpu_count() {
#if defined(__linux__)
  for (int cpus = CPU_SETSIZE; cpus <= (1 << 20); cpus *= 2) {
    cpu_set_t* set = CPU_ALLOC(cpus);
    if (!set) return 0;
    const size_t bytes = CPU_ALLOC_SIZE(cpus);
    CPU_ZERO_S(bytes, set);
    const int got = sched_getaffinity(0, bytes, set);
    const int error = errno;
    const int count = got == 0 ? CPU_COUNT_S(bytes, set) : 0;
    CPU_FREE(set);
    if (got == 0) return count;
    if (error != EINVAL) return 0;  // EINVAL: the kernel's mask is wider than this set; try a wider one
  }
#endif
  return 0;
}

}  // namespace

int host_thread_count() {
  if (const int n = environment().num_threads; n > 0) return n;
  // Read once per process: hardware_concurrency() walks sysfs, ~14% of a tiny call's host time when
  // read per call. A later change of the affinity (sched_setaffinity) is therefore not seen.
  static const int cpus = [] {
    if (const int n = affinity_cpu_count(); n > 0) return n;
    const unsigned hw = std::thread::hardware_concurrency();
    return hw ? static_cast<int>(hw) : 1;
  }();
  return cpus;
}

}  // namespace gla
