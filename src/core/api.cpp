// The C entry points: every one catches everything, turning it into a status code and the thread's
// last-error message. Library code never aborts on a caller's bad input.
#include <cstring>
#include <new>
#include <string>

#include "core/dispatcher.hpp"
#include "core/environment.hpp"

namespace gla {
std::unique_ptr<Backend> make_callback_backend(const gla_backend_desc& desc);
}

namespace {

thread_local std::string t_last_error;
thread_local std::string t_text;  // explain() output
thread_local std::string t_info_name, t_info_reason;

template <class F>
gla_status guarded(F&& body) {
  try {
    t_last_error.clear();
    body();
    return GLA_STATUS_OK;
  } catch (const gla::Error& e) {
    t_last_error = e.what();
    return e.status();
  } catch (const std::bad_alloc&) {
    t_last_error = "out of host memory";
    return GLA_STATUS_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    t_last_error = std::string("internal error: ") + e.what();
    return GLA_STATUS_INTERNAL_ERROR;
  } catch (...) {
    t_last_error = "internal error: unknown exception";
    return GLA_STATUS_INTERNAL_ERROR;
  }
}

}  // namespace

extern "C" {

const char* gla_last_error(void) { return t_last_error.c_str(); }

const char* gla_status_name(gla_status status) {
  switch (status) {
    case GLA_STATUS_OK: return "ok";
    case GLA_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case GLA_STATUS_NOT_SUPPORTED: return "not supported";
    case GLA_STATUS_BACKEND_ERROR: return "backend error";
    case GLA_STATUS_OUT_OF_MEMORY: return "out of memory";
    case GLA_STATUS_INTERNAL_ERROR: return "internal error";
  }
  return "unknown status";
}

// GLA_VERSION_STRING: the project() version in CMakeLists.txt (src/core/CMakeLists.txt).
const char* gla_version(void) { return GLA_VERSION_STRING; }

void gla_options_init(gla_options* options) {
  if (!options) return;
  std::memset(options, 0, sizeof *options);
  options->struct_size = sizeof *options;
  options->policy = GLA_POLICY_DEFAULT;
}

const char* gla_unit_name(int32_t unit) {
  static const char* const names[] = {"chunk_fwd", "chunk_bwd", "cumsum",        "fwd_h",    "fwd_intra",
                                      "fwd_o",     "bwd_dh",    "bwd_dv",        "bwd_dA",   "bwd_dqk_intra",
                                      "bwd_dqkg",  "recurrent_fwd", "recurrent_bwd"};
  return unit >= 0 && unit < GLA_UNIT_COUNT ? names[unit] : "unknown unit";
}

gla_status gla_chunk_forward(const gla_chunk_forward_args* args, const gla_options* options) {
  return gla_chunk_forward_saving_states(args, nullptr, options);
}

gla_status gla_chunk_backward(const gla_chunk_backward_args* args, const gla_options* options) {
  return gla_chunk_backward_from_states(args, nullptr, options);
}

gla_status gla_chunk_forward_saving_states(const gla_chunk_forward_args* args, const gla_tensor* chunk_states,
                                           const gla_options* options) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_forward(args, opts, false, chunk_states);
    gla::execute(prepared, opts);
  });
}

gla_status gla_chunk_backward_from_states(const gla_chunk_backward_args* args, const gla_tensor* chunk_states,
                                          const gla_options* options) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_backward(args, opts, false, chunk_states);
    gla::execute(prepared, opts);
  });
}

gla_status gla_chunk_forward_with_allocator(const gla_chunk_forward_args* args, const gla_options* options,
                                            const gla_allocator* allocator) {
  return gla_chunk_forward_saving_states_with_allocator(args, nullptr, options, allocator);
}

gla_status gla_chunk_backward_with_allocator(const gla_chunk_backward_args* args, const gla_options* options,
                                             const gla_allocator* allocator) {
  return gla_chunk_backward_from_states_with_allocator(args, nullptr, options, allocator);
}

gla_status gla_chunk_forward_saving_states_with_allocator(const gla_chunk_forward_args* args,
                                                          const gla_tensor* chunk_states, const gla_options* options,
                                                          const gla_allocator* allocator) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::check_allocator(allocator);
    gla::PreparedProblem prepared = gla::prepare_forward(args, opts, false, chunk_states);
    gla::execute(prepared, opts, allocator);
  });
}

gla_status gla_chunk_backward_from_states_with_allocator(const gla_chunk_backward_args* args,
                                                         const gla_tensor* chunk_states, const gla_options* options,
                                                         const gla_allocator* allocator) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::check_allocator(allocator);
    gla::PreparedProblem prepared = gla::prepare_backward(args, opts, false, chunk_states);
    gla::execute(prepared, opts, allocator);
  });
}

gla_status gla_chunk_forward_workspace_size(const gla_chunk_forward_args* args, const gla_options* options,
                                            size_t* bytes) {
  return guarded([&] {
    if (!bytes) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "bytes: required output pointer is missing (got NULL)");
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_forward(args, opts, true);
    *bytes = gla::workspace_size(prepared, opts);
  });
}

gla_status gla_chunk_backward_workspace_size(const gla_chunk_backward_args* args, const gla_options* options,
                                             size_t* bytes) {
  return guarded([&] {
    if (!bytes) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "bytes: required output pointer is missing (got NULL)");
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_backward(args, opts, true);
    *bytes = gla::workspace_size(prepared, opts);
  });
}

gla_status gla_recurrent_forward(const gla_recurrent_forward_args* args, const gla_options* options) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_recurrent_forward(args, opts, false);
    gla::execute(prepared, opts);
  });
}

gla_status gla_recurrent_backward(const gla_recurrent_backward_args* args, const gla_options* options) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_recurrent_backward(args, opts, false);
    gla::execute(prepared, opts);
  });
}

gla_status gla_recurrent_state_update(const gla_recurrent_state_update_args* args, const gla_options* options) {
  return guarded([&] {
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = gla::prepare_recurrent_state_update(args, opts, false);
    gla::execute(prepared, opts);
  });
}

gla_status gla_recurrent_explain(const gla_recurrent_forward_args* fwd, const gla_recurrent_backward_args* bwd,
                                 const gla_recurrent_state_update_args* update, const gla_options* options,
                                 const char** text) {
  return guarded([&] {
    if (!text) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "text: required output pointer is missing (got NULL)");
    const int given = (fwd != nullptr) + (bwd != nullptr) + (update != nullptr);
    if (given != 1) {
      gla::fail(GLA_STATUS_INVALID_ARGUMENT,
                "explain: expected exactly one of fwd, bwd and update, got " + std::to_string(given));
    }
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared = fwd   ? gla::prepare_recurrent_forward(fwd, opts, true)
                                    : bwd ? gla::prepare_recurrent_backward(bwd, opts, true)
                                          : gla::prepare_recurrent_state_update(update, opts, true);
    t_text = gla::explain(prepared, gla::make_control(opts));
    *text = t_text.c_str();
  });
}

int32_t gla_backend_count(void) {
  try {
    return static_cast<int32_t>(gla::Registry::instance().snapshot()->size());
  } catch (...) {
    return 0;
  }
}

gla_status gla_backend_info(int32_t index, const char** name, int32_t* priority, int32_t* available,
                            const char** reason) {
  return guarded([&] {
    const auto snapshot = gla::Registry::instance().snapshot();
    const auto& entries = *snapshot;
    if (index < 0 || index >= static_cast<int32_t>(entries.size())) {
      gla::fail(GLA_STATUS_INVALID_ARGUMENT, "index: expected 0 <= index < " + std::to_string(entries.size()) +
                                                 ", got " + std::to_string(index));
    }
    const auto& e = entries[static_cast<size_t>(index)];
    t_info_name = e.backend->name();
    t_info_reason = e.availability.ok ? (e.enabled ? "" : "disabled by " + e.disabled_by) : e.availability.reason;
    if (name) *name = t_info_name.c_str();
    if (priority) *priority = e.backend->priority();
    if (available) *available = e.availability.ok && e.enabled;
    if (reason) *reason = t_info_reason.c_str();
  });
}

gla_status gla_reload_environment(void) {
  return guarded([] { gla::reload_environment(); });
}

gla_status gla_backend_set_enabled(const char* name, int32_t enabled) {
  return guarded([&] {
    if (!name || !gla::Registry::instance().set_enabled(name, enabled != 0)) {
      gla::fail(GLA_STATUS_INVALID_ARGUMENT, std::string("name: no backend named '") + (name ? name : "(null)") + "'");
    }
  });
}

}  // extern "C"

namespace {
// gla_explain and gla_tune: exactly one of fwd / bwd, validated (metadata only for explain), and
// the text they return.
template <class Body>
gla_status text_call(const char* what, const gla_chunk_forward_args* fwd, const gla_chunk_backward_args* bwd,
                     const gla_options* options, const char** text, bool metadata_only, Body&& body) {
  return guarded([&] {
    if (!text) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "text: required output pointer is missing (got NULL)");
    if ((fwd == nullptr) == (bwd == nullptr)) {
      gla::fail(GLA_STATUS_INVALID_ARGUMENT, std::string(what) + ": expected exactly one of fwd and bwd, got " +
                                                 std::string(fwd ? "both" : "neither"));
    }
    const gla_options opts = gla::read_options(options);
    gla::PreparedProblem prepared =
        fwd ? gla::prepare_forward(fwd, opts, metadata_only) : gla::prepare_backward(bwd, opts, metadata_only);
    t_text = body(prepared, opts);
    *text = t_text.c_str();
  });
}
}  // namespace

extern "C" {

gla_status gla_explain(const gla_chunk_forward_args* fwd, const gla_chunk_backward_args* bwd,
                       const gla_options* options, const char** text) {
  return text_call("explain", fwd, bwd, options, text, true, [](gla::PreparedProblem& prepared, const gla_options& opts) {
    return gla::explain(prepared, gla::make_control(opts));
  });
}

gla_status gla_tune(const gla_chunk_forward_args* fwd, const gla_chunk_backward_args* bwd, const gla_options* options,
                    const char** text) {
  return text_call("tune", fwd, bwd, options, text, false,
                   [](gla::PreparedProblem& prepared, const gla_options& opts) { return gla::tune(prepared, opts); });
}

gla_status gla_backend_capabilities(const char* name, const gla_capability** records, int32_t* count) {
  return guarded([&] {
    if (!records || !count) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "records, count: required output pointers are missing (got NULL)");
    for (const auto& e : *gla::Registry::instance().snapshot()) {
      if (name && e.backend->name() == name) {
        // The registry keeps the backend (and so its records) alive until it is removed or replaced.
        const auto& all = e.backend->capabilities();
        *records = all.data();
        *count = static_cast<int32_t>(all.size());
        return;
      }
    }
    gla::fail(GLA_STATUS_INVALID_ARGUMENT, std::string("name: no backend named '") + (name ? name : "(null)") + "'");
  });
}

gla_status gla_register_backend(const gla_backend_desc* desc) {
  return guarded([&] {
    if (!desc) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "desc: required backend description is missing (got NULL)");
    auto backend = gla::make_callback_backend(*desc);
    const std::string name = backend->name();
    gla::Registry::instance().add(std::move(backend));
    gla::note_registration(name);
  });
}

gla_status gla_load_plugin(const char* path) {
  return guarded([&] {
    if (!path || !*path) gla::fail(GLA_STATUS_INVALID_ARGUMENT, "path: expected a shared library path, got none");
    gla::Registry::instance();  // built-in backends and GLA_PLUGINS first
    gla::load_plugin(path);
  });
}

gla_status gla_unregister_backend(const char* name) {
  return guarded([&] {
    if (!name || !gla::Registry::instance().remove(name)) {
      gla::fail(GLA_STATUS_INVALID_ARGUMENT, std::string("name: no backend named '") + (name ? name : "(null)") + "'");
    }
  });
}

}  // extern "C"
