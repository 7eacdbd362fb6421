// The `cpu` backend: the chunked algorithm (SPEC.md section 2) on host memory, fp32 accumulation,
// multithreaded over (sequence, head, value tile) and vectorised with kernels compiled per
// instruction set (cpu_kernels.hpp). Implements the whole forward and backward operations and every
// stage unit with the intermediate layouts of gla.h, so the dispatcher can mix its stages with other
// backends.
//
// Determinism: a work item's result depends only on its inputs (the decomposition into items is a
// function of the problem, never of the thread count), so outputs are bitwise identical for any
// GLA_NUM_THREADS. They can differ between instruction sets (GLA_CPU_ISA).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "backends/cpu/cpu_kernels.hpp"
#include "backends/cpu/recurrent.hpp"
#include "core/backend.hpp"
#include "core/capabilities.hpp"
#include "core/environment.hpp"
#include "core/parallel.hpp"

namespace gla {
namespace cpu {
namespace {

bool cpu_has_avx512() {
#if defined(GLA_CPU_X86_KERNELS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
bool cpu_has_avx2() {
#if defined(GLA_CPU_X86_KERNELS)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// The best kernels this CPU runs; GLA_CPU_ISA=avx512|avx2|portable asks for a lower one (tests use
// it to cover every path on one machine). Unknown or unsupported requests fall back to the best.
const KernelTable& select_kernels() {
  static const bool avx512 = cpu_has_avx512();
  static const bool avx2 = cpu_has_avx2();
  [[maybe_unused]] const std::string& w = environment().cpu_isa;
#if defined(GLA_CPU_X86_KERNELS)
  if (w == "portable") return portable::kernels();
  if (w == "avx2" && avx2) return avx2::kernels();
  if (avx512) return avx512::kernels();
  if (avx2) return avx2::kernels();
#endif
  return portable::kernels();
}

// Flush denormal results to zero while the kernels run: strong decay drives many products below
// FLT_MIN, and denormal arithmetic is ~100x slower on x86. The values lost are < 1.2e-38 relative
// to their operands. Inputs are not treated as zero (DAZ stays off), so 16-bit subnormals convert
// exactly. The caller's floating-point mode is restored afterwards.
class FlushDenormals {
 public:
  FlushDenormals() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ | 0x8000u);  // FTZ
#endif
  }
  ~FlushDenormals() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(saved_);
#endif
  }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned saved_ = 0;
};

// GLA_CPU_POISON_SCRATCH=1 fills the kernels' scratch with NaN before each call (tests use it to
// show that no kernel reads scratch it did not write).
bool poison_scratch() { return environment().poison_scratch; }

// Scratch memory: 2 MiB aligned and, on Linux, marked for transparent huge pages (where the
// system allows them on request), so a thread's tiles and the backward's chunk states sit in a few
// TLB entries instead of hundreds.
struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
float* allocate_scratch(size_t floats) {
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (floats * sizeof(float) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  if (!p) throw std::bad_alloc();
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: ignored where huge pages are off
#endif
  return static_cast<float*>(p);
}
struct Buffer {
  size_t floats = 0;
  std::unique_ptr<float, FreeDeleter> data;
};

// Scratch kept between calls: fresh pages cost a fault and a kernel memset each (~10% of a
// backward at B1 T4096 H16 D128 before this cache). Buffers above kKeepBytes are freed after the
// call, so a very long sequence does not pin its chunk states for the life of the process, and at
// most kKeepTotalBytes stay cached in all.
class ScratchCache {
 public:
  Buffer take(size_t floats) {
    {
      std::lock_guard lock(mutex_);
      for (size_t i = 0; i < free_.size(); ++i) {
        if (free_[i].floats >= floats) {
          kept_ -= free_[i].floats * sizeof(float);
          Buffer b = std::move(free_[i]);
          free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
          return b;
        }
      }
    }
    Buffer b;
    b.floats = std::max<size_t>(floats, 1);
    b.data.reset(allocate_scratch(b.floats));  // uninitialised: kernels write before they read
    return b;
  }
  void give(Buffer b) {
    if (!b.data || b.floats * sizeof(float) > kKeepBytes) return;
    std::lock_guard lock(mutex_);
    kept_ += b.floats * sizeof(float);
    free_.push_back(std::move(b));
    while (free_.size() > kKeepBuffers || kept_ > kKeepTotalBytes) {  // oldest first
      kept_ -= free_.front().floats * sizeof(float);
      free_.erase(free_.begin());
    }
  }

 private:
  static constexpr size_t kKeepBytes = size_t{64} << 20;
  static constexpr size_t kKeepTotalBytes = size_t{256} << 20;
  static constexpr size_t kKeepBuffers = 16;
  size_t kept_ = 0;
  std::mutex mutex_;
  std::vector<Buffer> free_;
};

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  int priority() const override { return 50; }
  // Host memory, every unit, the float dtypes, every size and feature. The forward writes the
  // chunk-start states it computes anyway; the backward then skips its pass 1 (kernels.inl:
  // run_forward, run_backward). Deterministic: work items are claimed dynamically, but each is
  // computed whole by one thread.
  const std::vector<gla_capability>& capabilities() const override {
    static const std::vector<gla_capability> records = [] {
      gla_capability c = open_capability(unit_bit(GLA_UNIT_CHUNK_FWD) | unit_bit(GLA_UNIT_CHUNK_BWD) | kStageUnits |
                                             unit_bit(GLA_UNIT_RECURRENT_FWD) | unit_bit(GLA_UNIT_RECURRENT_BWD),
                                         device_bit(GLA_DEVICE_CPU) | device_bit(GLA_DEVICE_CUDA_HOST));
      c.features = GLA_FEATURE_ALL & ~GLA_FEATURE_CHUNK_STATES_BF16;  // saved chunk states in f32
      c.deterministic = 1;
      return std::vector<gla_capability>{c};
    }();
    return records;
  }
  // The stage kernels' chunk-size range (the pipeline's is 64).
  std::vector<std::string> check_more(const gla_problem& p) const override {
    if (unit_is_stage(p.unit) && (p.chunk_size < 1 || p.chunk_size > 1024)) {
      return {"cpu stages support chunk sizes 1..1024, got " + std::to_string(p.chunk_size)};
    }
    return {};
  }

  // The kernels and the threads `run` would use.
  std::string plan_note(const gla_problem& p) const override {
    const int budget = host_thread_count();
    const bool recurrent = p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD;
    const int64_t items = recurrent ? p.N * p.H : select_kernels().item_count(p, budget);
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(budget, items));
    return (recurrent ? std::string("token loop") : std::string(select_kernels().isa) + " kernels") + ", " +
           std::to_string(items) +
           " work items on " + std::to_string(threads) + " of " + std::to_string(budget) +
           " threads (GLA_NUM_THREADS, else the CPUs this process may run on)";
  }

  void run(const gla_problem& p) override {
    if (p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD) return run_recurrent(p);
    const KernelTable& kernels = select_kernels();
    const int budget = host_thread_count();  // GLA_NUM_THREADS, else the CPUs this process may run on
    const int64_t items = kernels.item_count(p, budget);
    if (items <= 0) return;
    const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(budget, items));
    const size_t floats = kernels.scratch_floats(p, budget);

    std::vector<Buffer> scratch;
    try {
      for (int64_t t = 0; t < threads; ++t) scratch.push_back(cache_.take(floats));
    } catch (const std::bad_alloc&) {
      for (auto& b : scratch) cache_.give(std::move(b));
      fail(GLA_STATUS_OUT_OF_MEMORY, "cpu: cannot allocate " + std::to_string(floats * 4 * threads) +
                                         " bytes of scratch for " + std::to_string(threads) + " threads");
    }
    if (poison_scratch()) {
      for (auto& b : scratch) std::fill(b.data.get(), b.data.get() + floats, std::numeric_limits<float>::quiet_NaN());
    }

    // Items are claimed dynamically (long sequences next to short ones balance), which cannot
    // change results: every item is computed whole by one thread.
    std::atomic<int64_t> next{0};
    std::exception_ptr error;
    std::mutex error_mutex;
    auto worker = [&](int64_t id) {
      try {
        FlushDenormals ftz;
        float* s = scratch[static_cast<size_t>(id)].data.get();
        for (int64_t i = next.fetch_add(1); i < items; i = next.fetch_add(1)) kernels.run_item(p, budget, i, s);
      } catch (...) {
        std::lock_guard lock(error_mutex);
        if (!error) error = std::current_exception();
      }
    };
    std::vector<std::thread> pool;
    pool.reserve(static_cast<size_t>(threads - 1));
    for (int64_t t = 1; t < threads; ++t) pool.emplace_back(worker, t);
    worker(0);
    for (auto& th : pool) th.join();
    for (auto& b : scratch) cache_.give(std::move(b));
    if (error) std::rethrow_exception(error);
  }

 private:
  ScratchCache cache_;
};

}  // namespace
}  // namespace cpu

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<cpu::CpuBackend>(); }

}  // namespace gla
