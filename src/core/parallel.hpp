// A minimal fork-join loop for host backends: items [0, count) split into contiguous ranges over
// std::threads. Each item writes only its own outputs, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace gla {

// GLA_NUM_THREADS, else the CPUs this process may run on (parallel.cpp).
int host_thread_count();

template <class F>
void parallel_for(int64_t count, F&& body) {
  const int64_t threads = std::min<int64_t>(host_thread_count(), count);
  if (threads <= 1) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::exception_ptr error;
  std::mutex error_mutex;
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int64_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        for (int64_t i = t; i < count; i += threads) body(i);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    });
  }
  for (auto& th : pool) th.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace gla
