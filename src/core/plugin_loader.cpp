// Loading out-of-tree backends from shared libraries (DESIGN.md, "Plugins").
#include <dlfcn.h>

#include <string>

#include "core/registry.hpp"

namespace gla {

void load_plugin(const std::string& path) {
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    const char* why = dlerror();
    fail(GLA_STATUS_INVALID_ARGUMENT, "path: cannot load plugin '" + path + "': " + (why ? why : "unknown reason"));
  }
  using Entry = gla_status (*)(void);
  auto entry = reinterpret_cast<Entry>(dlsym(handle, GLA_PLUGIN_ENTRY_POINT));
  if (!entry) {
    dlclose(handle);
    fail(GLA_STATUS_INVALID_ARGUMENT,
         "path: plugin '" + path + "' does not export " + GLA_PLUGIN_ENTRY_POINT + "()");
  }
  // The library stays loaded: the registry keeps pointers to its callbacks.
  const gla_status status = entry();
  if (status != GLA_STATUS_OK) {
    fail(GLA_STATUS_BACKEND_ERROR, "plugin '" + path + "' failed to register: " + gla_status_name(status) + ": " +
                                       gla_last_error());
  }
}

}  // namespace gla
