// Backends described by a C callback table (gla_backend_desc): out-of-tree plugins and language
// bindings (the Python `torch` backend) join the same registry as the built-in backends.
#include <cstring>
#include <string>

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
  explicit CallbackBackend(const gla_backend_desc& desc) : desc_(desc), name_(desc.name) {}

  std::string name() const override { return name_; }
  int priority() const override { return desc_.priority; }
  bool serves_device(int32_t device_type) const override {
    return device_type >= 0 && device_type < 64 && ((desc_.device_mask >> device_type) & 1u);
  }
  bool implements(int32_t unit) const override {
    return unit >= 0 && unit < 64 && ((desc_.unit_mask >> unit) & 1u);
  }
  Verdict available() const override {
    if (!desc_.available) return Verdict::yes();
    char message[kMessageCapacity] = {0};
    if (desc_.available(desc_.user_data, message, sizeof message)) return Verdict::yes();
    return Verdict::no(message_text(message, "the plugin reports it is unavailable (no reason given)"));
  }
  Verdict verify(const gla_problem& problem) const override {
    if (!desc_.verify) return Verdict::yes();
    char message[kMessageCapacity] = {0};
    if (desc_.verify(desc_.user_data, &problem, message, sizeof message)) return Verdict::yes();
    return Verdict::no(message_text(message, "declined (no reason given)"));
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

 private:
  gla_backend_desc desc_;
  std::string name_;
};

}  // namespace

std::unique_ptr<Backend> make_callback_backend(const gla_backend_desc& desc) {
  if (desc.abi_version != GLA_ABI_VERSION) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "desc.abi_version: expected " + std::to_string(GLA_ABI_VERSION) + ", got " +
                                          std::to_string(desc.abi_version));
  }
  if (desc.name == nullptr || desc.name[0] == '\0') {
    fail(GLA_STATUS_INVALID_ARGUMENT, "desc.name: expected a non-empty backend name, got none");
  }
  if (desc.run == nullptr) fail(GLA_STATUS_INVALID_ARGUMENT, "desc.run: expected a run callback, got NULL");
  return std::make_unique<CallbackBackend>(desc);
}

}  // namespace gla
