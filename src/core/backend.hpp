// The contract between the dispatcher and every backend (built-in or plugin).
//
// A backend declares a name, a priority (lower wins), the devices it serves, the units it
// implements, whether it is available on this machine, and per unit a verifier that reads only
// metadata and gives a specific reason when it declines. `run` executes one unit on a problem the
// core has already validated (shapes consistent, dtypes legal, sequence offsets checked), so a
// backend checks only its own limits in `verify`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gla/gla.h"
#include "core/tensor.hpp"

namespace gla {

// Error carried from deep inside the library to the C boundary, where it becomes a status code and
// the thread's last-error message.
class Error : public std::runtime_error {
 public:
  Error(gla_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  gla_status status() const { return status_; }

 private:
  gla_status status_;
};

[[noreturn]] inline void fail(gla_status status, const std::string& message) { throw Error(status, message); }

// Empty reason means yes.
struct Verdict {
  bool ok = true;
  std::string reason;
  static Verdict yes() { return {}; }
  static Verdict no(std::string why) { return {false, std::move(why)}; }
};

inline bool unit_is_stage(int32_t unit) {
  return unit >= GLA_UNIT_CUMSUM && unit <= GLA_UNIT_BWD_DQKG;
}

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int priority() const = 0;
  // What it serves, as data (gla_capability in gla.h, core/capabilities.hpp): devices and minimum
  // compute capability, units, dtypes, K and V ranges, features (saved chunk states among them),
  // layout and alignment, determinism. The same object on every call.
  virtual const std::vector<gla_capability>& capabilities() const = 0;
  // The checks the declaration cannot express (grid limits, device visibility, where cu_seqlens
  // lives): every reason, empty when none. Cheap, metadata only.
  virtual std::vector<std::string> check_more(const gla_problem& /*problem*/) const { return {}; }
  // 10 * major + minor of the problem's device, -1 when unknown (the declaration's minimum is then
  // not checked by the core).
  virtual int compute_capability(const gla_problem& /*problem*/) const { return -1; }
  // Built in, driver present, device present. Checked once per process and cached by the registry.
  virtual Verdict available() const { return Verdict::yes(); }
  // From the declaration: some record covers the device type / the unit.
  bool serves_device(int32_t device_type) const;
  bool implements(int32_t unit) const;
  // The declaration's verdict and check_more's, every reason joined by "; ".
  Verdict verify(const gla_problem& problem) const;
  // Throws gla::Error on failure.
  virtual void run(const gla_problem& problem) = 0;
  // Scratch bytes `run` wants for a whole-operation unit; the dispatcher passes it in
  // problem.workspace (caller's buffer when large enough, else from allocate()).
  virtual size_t workspace_size(const gla_problem& /*problem*/) const { return 0; }
  // How this backend would run an accepted whole-operation problem (kernel family, tiling), one
  // line for explain(); empty if there is nothing more to say than its name. Metadata only (the
  // sequence offsets are loaded).
  virtual std::string plan_note(const gla_problem& /*problem*/) const { return {}; }

  // Timing for the `fastest` policy (src/core/tuner.hpp). can_time: whether time_run_ms measures
  // work on the problem's device; the default times host memory with the host clock. time_run_ms
  // runs `run` once and returns the milliseconds it took on the device (device backends: events on
  // problem.stream). stream_capturing: work queued on problem.stream is being recorded into a graph
  // (nothing may be measured then).
  virtual bool can_time(const gla_problem& problem) const { return host_accessible(problem.device_type); }
  virtual double time_run_ms(const gla_problem& problem, const std::function<void()>& run);
  virtual bool stream_capturing(const gla_problem& /*problem*/) const { return false; }

  // Memory on the problem's device for workspaces and stage-pipeline intermediates. The default
  // serves host memory; device backends override.
  virtual void* allocate(const gla_problem& problem, size_t bytes);
  virtual void deallocate(const gla_problem& problem, void* pointer);
  // Copies `bytes` from device memory to host memory (used for cu_seqlens without a host copy and
  // for check_inputs). Synchronises. The default handles host memory.
  virtual void copy_to_host(const gla_problem& problem, const void* device_src, void* host_dst,
                            size_t bytes);
};

// ---- Reading a validated problem ----

// Sequence n: batch row, first token within that row, length.
struct SequenceSpan {
  int64_t batch;
  int64_t start;
  int64_t length;
};
inline SequenceSpan sequence_span(const gla_problem& p, int64_t n) {
  if (p.varlen) return {0, p.seq_offsets[n], p.seq_offsets[n + 1] - p.seq_offsets[n]};
  return {n, 0, p.T};
}

// Element offset of state entry (n, h, key i, value j), honouring state_v_first and strides.
inline int64_t state_offset(const gla_problem& p, const gla_tensor& state, int64_t n, int64_t h,
                            int64_t i, int64_t j) {
  return p.state_v_first ? offset4(state, n, h, j, i) : offset4(state, n, h, i, j);
}

// Element offset of gate entry (b, t, h, key i): a per-head gate ignores i.
inline int64_t gate_offset(const gla_problem& p, int64_t b, int64_t t, int64_t h, int64_t i) {
  return p.gate_per_head ? offset3(p.g, b, t, h) : offset4(p.g, b, t, h, i);
}

// Registration of the built-in backends (src/core/builtin_backends.cpp).
std::unique_ptr<Backend> make_reference_backend();
#ifdef GLA_WITH_CPU_BACKEND
std::unique_ptr<Backend> make_cpu_backend();
#endif
#ifdef GLA_WITH_CUDA_BACKEND
std::unique_ptr<Backend> make_cuda_backend();
#endif

}  // namespace gla
