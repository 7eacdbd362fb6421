// libgla C++ API: a thin layer over the C ABI in gla.h. Errors become gla::Exception carrying the
// status and the library's message; descriptors are built from pointers and spans.
//
// Ownership is as in gla.h: the caller owns every buffer; the library never frees or keeps them.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gla/gla.h"

namespace gla {

class Exception : public std::runtime_error {
 public:
  Exception(gla_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  gla_status status() const noexcept { return status_; }

 private:
  gla_status status_;
};

// Throws gla::Exception with the thread's last-error message unless status is OK.
inline void check(gla_status status) {
  if (status != GLA_STATUS_OK) throw Exception(status, gla_last_error());
}

// A descriptor of a contiguous (row-major) tensor at `data` with the given sizes.
inline gla_tensor tensor(void* data, gla_dtype dtype, std::span<const int64_t> sizes,
                         gla_device_type device = GLA_DEVICE_CPU, int32_t device_index = 0) {
  if (sizes.size() > GLA_MAX_RANK) throw Exception(GLA_STATUS_INVALID_ARGUMENT, "tensor: rank above GLA_MAX_RANK");
  gla_tensor t{};
  t.data = data;
  t.dtype = dtype;
  t.device_type = device;
  t.device_index = device_index;
  t.rank = static_cast<int32_t>(sizes.size());
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.sizes[i] = sizes[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= t.sizes[i];
  }
  return t;
}
inline gla_tensor tensor(void* data, gla_dtype dtype, std::initializer_list<int64_t> sizes,
                         gla_device_type device = GLA_DEVICE_CPU, int32_t device_index = 0) {
  return tensor(data, dtype, std::span<const int64_t>(sizes.begin(), sizes.size()), device, device_index);
}

// Options with defaults (gla_options_init) and chainable setters.
struct Options {
  gla_options raw;
  std::string backend_name;
  Options() { gla_options_init(&raw); }
  Options& scale(double s) { raw.has_scale = 1; raw.scale = s; return *this; }
  Options& state_v_first(bool on = true) { raw.state_v_first = on; return *this; }
  Options& backend(std::string_view name) { backend_name = name; return *this; }
  Options& policy(gla_policy p) { raw.policy = p; return *this; }
  Options& stage_pipeline(bool on = true) { raw.force_stage_pipeline = on; return *this; }
  Options& check_inputs(bool on = true) { raw.check_inputs = on; return *this; }
  Options& stream(void* s) { raw.stream = s; return *this; }
  Options& workspace(void* p, size_t bytes) { raw.workspace = p; raw.workspace_bytes = bytes; return *this; }
  const gla_options* get() {
    raw.backend = backend_name.empty() ? nullptr : backend_name.c_str();
    return &raw;
  }
};

inline void chunk_forward(const gla_chunk_forward_args& args, Options options = {}) {
  check(gla_chunk_forward(&args, options.get()));
}
inline void chunk_backward(const gla_chunk_backward_args& args, Options options = {}) {
  check(gla_chunk_backward(&args, options.get()));
}
// With saved chunk-start states (gla.h: gla_chunk_forward_saving_states): the forward writes
// chunk_states, the backward reads them instead of recomputing them.
inline void chunk_forward_saving_states(const gla_chunk_forward_args& args, const gla_tensor& chunk_states,
                                        Options options = {}) {
  check(gla_chunk_forward_saving_states(&args, &chunk_states, options.get()));
}
inline void chunk_backward_from_states(const gla_chunk_backward_args& args, const gla_tensor& chunk_states,
                                       Options options = {}) {
  check(gla_chunk_backward_from_states(&args, &chunk_states, options.get()));
}
inline size_t chunk_forward_workspace_size(const gla_chunk_forward_args& args, Options options = {}) {
  size_t bytes = 0;
  check(gla_chunk_forward_workspace_size(&args, options.get(), &bytes));
  return bytes;
}
inline size_t chunk_backward_workspace_size(const gla_chunk_backward_args& args, Options options = {}) {
  size_t bytes = 0;
  check(gla_chunk_backward_workspace_size(&args, options.get(), &bytes));
  return bytes;
}

// The recurrent operator (gla.h: gla_recurrent_*): forward, backward, the serving step on a state
// pool, and their verdict tables.
inline void recurrent_forward(const gla_recurrent_forward_args& args, Options options = {}) {
  check(gla_recurrent_forward(&args, options.get()));
}
inline void recurrent_backward(const gla_recurrent_backward_args& args, Options options = {}) {
  check(gla_recurrent_backward(&args, options.get()));
}
inline void recurrent_state_update(const gla_recurrent_state_update_args& args, Options options = {}) {
  check(gla_recurrent_state_update(&args, options.get()));
}
inline std::string explain(const gla_recurrent_forward_args& args, Options options = {}) {
  const char* text = nullptr;
  check(gla_recurrent_explain(&args, nullptr, nullptr, options.get(), &text));
  return text;
}
inline std::string explain(const gla_recurrent_backward_args& args, Options options = {}) {
  const char* text = nullptr;
  check(gla_recurrent_explain(nullptr, &args, nullptr, options.get(), &text));
  return text;
}
inline std::string explain(const gla_recurrent_state_update_args& args, Options options = {}) {
  const char* text = nullptr;
  check(gla_recurrent_explain(nullptr, nullptr, &args, options.get(), &text));
  return text;
}

// The verdict table (every backend, unit by unit) and the decision for these arguments.
inline std::string explain(const gla_chunk_forward_args& args, Options options = {}) {
  const char* text = nullptr;
  check(gla_explain(&args, nullptr, options.get(), &text));
  return text;
}
inline std::string explain(const gla_chunk_backward_args& args, Options options = {}) {
  const char* text = nullptr;
  check(gla_explain(nullptr, &args, options.get(), &text));
  return text;
}

struct BackendInfo {
  std::string name;
  int32_t priority;
  bool available;
  std::string reason;
};

inline std::vector<BackendInfo> backends() {
  std::vector<BackendInfo> out;
  const int32_t n = gla_backend_count();
  for (int32_t i = 0; i < n; ++i) {
    const char *name = nullptr, *reason = nullptr;
    int32_t priority = 0, available = 0;
    check(gla_backend_info(i, &name, &priority, &available, &reason));
    out.push_back({name, priority, available != 0, reason});
  }
  return out;
}

inline void set_backend_enabled(std::string_view name, bool enabled) {
  check(gla_backend_set_enabled(std::string(name).c_str(), enabled));
}

// Scope guard: switches a backend off (or on) and restores the previous state on exit.
class BackendEnabledGuard {
 public:
  BackendEnabledGuard(std::string_view name, bool enabled) : name_(name) {
    for (const auto& b : backends()) {
      if (b.name == name_) previous_ = b.reason != "disabled by gla_backend_set_enabled";
    }
    set_backend_enabled(name_, enabled);
  }
  ~BackendEnabledGuard() { gla_backend_set_enabled(name_.c_str(), previous_); }
  BackendEnabledGuard(const BackendEnabledGuard&) = delete;
  BackendEnabledGuard& operator=(const BackendEnabledGuard&) = delete;

 private:
  std::string name_;
  bool previous_ = true;
};

}  // namespace gla
