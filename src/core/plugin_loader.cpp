// Loading out-of-tree backends from shared libraries (gla.h, "Plugins"; docs/writing-a-backend.md).
#include <dlfcn.h>

#include <string>
#include <vector>

#include "core/registry.hpp"

namespace gla {

namespace {
thread_local std::vector<std::string>* t_registered = nullptr;  // names registered by the plugin loading now
}  // namespace

void note_registration(const std::string& name) {
  if (t_registered) t_registered->push_back(name);
}

void load_plugin(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    fail(GLA_STATUS_INVALID_ARGUMENT, "path: cannot load plugin '" + path + "': " + (why ? why : "unknown reason"));
  }
  using Version = uint32_t (*)(void);
  using Entry = gla_status (*)(void);
  auto version = reinterpret_cast<Version>(dlsym(handle, GLA_PLUGIN_ABI_ENTRY_POINT));
  auto entry = reinterpret_cast<Entry>(dlsym(handle, GLA_PLUGIN_ENTRY_POINT));
  for (const auto& [symbol, found] : {std::pair<const char*, bool>{GLA_PLUGIN_ABI_ENTRY_POINT, version != nullptr},
                                      std::pair<const char*, bool>{GLA_PLUGIN_ENTRY_POINT, entry != nullptr}}) {
    if (!found) {
      dlclose(handle);
      fail(GLA_STATUS_INVALID_ARGUMENT, "path: plugin '" + path + "' does not export " + symbol +
                                            "() (a plug-in exports gla_plugin_abi_version and gla_plugin_register)");
    }
  }
  const uint32_t abi = version();
  if (abi < GLA_ABI_VERSION_MIN || abi > GLA_ABI_VERSION) {
    dlclose(handle);
    fail(GLA_STATUS_INVALID_ARGUMENT, "path: plugin '" + path + "' was built for ABI version " + std::to_string(abi) +
                                          "; this libgla reads versions " + std::to_string(GLA_ABI_VERSION_MIN) + " to " +
                                          std::to_string(GLA_ABI_VERSION) + " (rebuild it against this gla.h)");
  }
  // From here the library stays loaded: the registry keeps pointers to its callbacks (and a
  // failed registration's callbacks may still be on another thread's snapshot).
  std::vector<std::string> registered;
  t_registered = &registered;
  const gla_status status = entry();
  t_registered = nullptr;
  if (status != GLA_STATUS_OK) {
    const std::string why = gla_last_error();
    for (const auto& name : registered) Registry::instance().remove(name);
    std::string message = "plugin '" + path + "' failed to register: " + gla_status_name(status);
    if (!why.empty()) message += ": " + why;
    for (size_t i = 0; i < registered.size(); ++i) {
      message += i == 0 ? " (removed again: " : ", ";
      message += registered[i];
    }
    if (!registered.empty()) message += ")";
    fail(GLA_STATUS_BACKEND_ERROR, message);
  }
}

}  // namespace gla
