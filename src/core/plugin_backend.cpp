// Backends described by a C callback table (gla_backend_desc): out-of-tree plugins and language
// bindings (the Python `torch` backend) join the same registry as the built-in backends.
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "core/capabilities.hpp"
#include "core/registry.hpp"

namespace gla {

namespace {

constexpr size_t kMessageCapacity = 4096;

// A callback's message as a string: the library terminates the buffer itself, so a plugin that
// fills all of it without a NUL is read up to its capacity and no further.
std::string message_text(char (&message)[kMessageCapacity], const char* fallback) {
  message[kMessageCapacity - 1] = '\0';
  return message[0] ? std::string(message) : std::string(fallback);
}

class CallbackBackend final : public Backend {
 public:
  CallbackBackend(const gla_backend_desc& desc, std::vector<gla_capability> records)
      : desc_(desc), name_(desc.name), records_(std::move(records)) {
    desc_.capabilities = nullptr;  // copied into records_; the caller's array may go away
  }

  std::string name() const override { return name_; }
  int priority() const override { return desc_.priority; }
  const std::vector<gla_capability>& capabilities() const override { return records_; }
  Verdict available() const override {
    if (!desc_.available) return Verdict::yes();
    char message[kMessageCapacity] = {0};
    if (desc_.available(desc_.user_data, message, sizeof message)) return Verdict::yes();
    return Verdict::no(message_text(message, "the plugin reports it is unavailable (no reason given)"));
  }
  // The verify callback: the plug-in's imperative checks, after the declaration's.
  std::vector<std::string> check_more(const gla_problem& problem) const override {
    if (!desc_.verify) return {};
    char message[kMessageCapacity] = {0};
    if (desc_.verify(desc_.user_data, &problem, message, sizeof message)) return {};
    return {message_text(message, "declined (no reason given)")};
  }
  void run(const gla_problem& problem) override {
    char message[kMessageCapacity] = {0};
    const int32_t status = desc_.run(desc_.user_data, &problem, message, sizeof message);
    if (status != GLA_STATUS_OK) {
      const gla_status code = status > 0 && status <= GLA_STATUS_INTERNAL_ERROR ? static_cast<gla_status>(status)
                                                                               : GLA_STATUS_BACKEND_ERROR;
      fail(code, "backend '" + name_ + "' failed: " + message_text(message, "no message given"));
    }
  }
  size_t workspace_size(const gla_problem& problem) const override {
    return desc_.workspace_size ? desc_.workspace_size(desc_.user_data, &problem) : 0;
  }
  void* allocate(const gla_problem& problem, size_t bytes) override {
    if (!desc_.allocate) return Backend::allocate(problem, bytes);
    if (bytes == 0) return nullptr;
    void* p = desc_.allocate(desc_.user_data, &problem, bytes);
    if (!p) fail(GLA_STATUS_OUT_OF_MEMORY, "backend '" + name_ + "' could not allocate " + std::to_string(bytes) + " bytes");
    return p;
  }
  void deallocate(const gla_problem& problem, void* pointer) override {
    if (!desc_.allocate) return Backend::deallocate(problem, pointer);
    if (pointer && desc_.deallocate) desc_.deallocate(desc_.user_data, &problem, pointer);
  }
  void copy_to_host(const gla_problem& problem, const void* src, void* dst, size_t bytes) override {
    if (!desc_.copy_to_host) return Backend::copy_to_host(problem, src, dst, bytes);
    const int32_t status = desc_.copy_to_host(desc_.user_data, &problem, src, dst, bytes);
    if (status != GLA_STATUS_OK) fail(GLA_STATUS_BACKEND_ERROR, "backend '" + name_ + "' failed to copy to the host");
  }
  bool can_time(const gla_problem& problem) const override {
    return desc_.time_run != nullptr || desc_.synchronize != nullptr || Backend::can_time(problem);
  }
  double time_run_ms(const gla_problem& problem, const std::function<void()>& run) override {
    if (desc_.time_run) {
      // `run` may throw; it must not unwind through the plugin's frames, so the trampoline keeps the
      // exception and it is thrown again here.
      struct Context {
        const std::function<void()>* run;
        std::exception_ptr error;
      } context{&run, nullptr};
      auto trampoline = [](void* c) {
        auto* ctx = static_cast<Context*>(c);
        try {
          (*ctx->run)();
        } catch (...) {
          ctx->error = std::current_exception();
        }
      };
      double ms = -1;
      const int32_t status = desc_.time_run(desc_.user_data, &problem, trampoline, &context, &ms);
      if (context.error) std::rethrow_exception(context.error);
      if (status != GLA_STATUS_OK || !(ms >= 0)) fail(GLA_STATUS_BACKEND_ERROR, "backend '" + name_ + "' failed to time a run");
      return ms;
    }
    return Backend::time_run_ms(problem, [&] {
      run();
      if (desc_.synchronize && desc_.synchronize(desc_.user_data, &problem) != GLA_STATUS_OK) {
        fail(GLA_STATUS_BACKEND_ERROR, "backend '" + name_ + "' failed to synchronize");
      }
    });
  }
  bool stream_capturing(const gla_problem& problem) const override {
    return desc_.stream_capturing && desc_.stream_capturing(desc_.user_data, &problem) != 0;
  }

 private:
  gla_backend_desc desc_;
  std::string name_;
  std::vector<gla_capability> records_;
};

}  // namespace

// Bytes of gla_backend_desc that a table of `version` has: version 1 ends at workspace_size.
size_t desc_bytes(uint32_t version) {
  return version >= 2 ? sizeof(gla_backend_desc) : offsetof(gla_backend_desc, allocate);
}

std::unique_ptr<Backend> make_callback_backend(const gla_backend_desc& given) {
  if (given.abi_version < GLA_ABI_VERSION_MIN || given.abi_version > GLA_ABI_VERSION) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "desc.abi_version: expected " + std::to_string(GLA_ABI_VERSION_MIN) + " to " +
                                          std::to_string(GLA_ABI_VERSION) + " (the gla.h versions this libgla reads), got " +
                                          std::to_string(given.abi_version));
  }
  // Only the fields the caller's version has are read; the rest stay zero (NULL callbacks).
  gla_backend_desc desc{};
  std::memcpy(&desc, &given, desc_bytes(given.abi_version));
  if (desc.name == nullptr || desc.name[0] == '\0') {
    fail(GLA_STATUS_INVALID_ARGUMENT, "desc.name: expected a non-empty backend name, got none");
  }
  if (desc.run == nullptr) fail(GLA_STATUS_INVALID_ARGUMENT, "desc.run: expected a run callback, got NULL");
  if (desc.capability_count < 0 || (desc.capability_count > 0 && desc.capabilities == nullptr)) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "desc.capabilities: expected capability_count records, got " +
                                          std::string(desc.capability_count < 0 ? "a negative count" : "NULL"));
  }
  std::vector<gla_capability> records(desc.capabilities, desc.capabilities + desc.capability_count);
  if (records.empty()) {
    records.push_back(open_capability(desc.unit_mask, desc.device_mask));
  } else {
    uint64_t units = 0, devices = 0;
    for (const auto& c : records) {
      units |= c.unit_mask;
      devices |= c.device_mask;
    }
    if (units != desc.unit_mask || devices != desc.device_mask) {
      fail(GLA_STATUS_INVALID_ARGUMENT, "desc.unit_mask / desc.device_mask: expected the union of the capability records (" +
                                            std::to_string(units) + " / " + std::to_string(devices) + "), got " +
                                            std::to_string(desc.unit_mask) + " / " + std::to_string(desc.device_mask));
    }
  }
  const std::string malformed = declaration_error(records);
  if (!malformed.empty()) fail(GLA_STATUS_INVALID_ARGUMENT, "desc." + malformed);
  return std::make_unique<CallbackBackend>(desc, std::move(records));
}

}  // namespace gla
