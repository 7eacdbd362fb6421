#include "core/registry.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "core/environment.hpp"

namespace gla {

Registry::Registry() = default;

namespace {
// GLA_PLUGINS, once per process. A plugin registers its backends by calling back into the registry,
// so the loading thread must not wait on its own initialisation: `loading` lets it through.
void load_environment_plugins() {
  const char* list = std::getenv("GLA_PLUGINS");
  if (!list) return;
  std::stringstream stream(list);
  std::string path;
  while (std::getline(stream, path, ':')) {
    if (path.empty()) continue;
    try {
      load_plugin(path);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[gla] GLA_PLUGINS: %s (skipped)\n", e.what());
    }
  }
}
}  // namespace

Registry& Registry::instance() {
  // Built on first use, so the built-in backends' availability probes run lazily and once.
  static Registry* registry = [] {
    auto* r = new Registry();
    register_builtin_backends(*r);
    return r;
  }();
  static std::once_flag plugins_loaded;
  static thread_local bool loading = false;
  if (!loading) {
    loading = true;
    std::call_once(plugins_loaded, load_environment_plugins);
    loading = false;
  }
  return *registry;
}

void Registry::add(std::unique_ptr<Backend> backend) {
  RegistryEntry entry;
  entry.availability = backend->available();
  entry.backend = std::move(backend);
  std::unique_lock lock(mutex_);
  const std::string name = entry.backend->name();
  auto same = std::find_if(entries_.begin(), entries_.end(),
                           [&](const RegistryEntry& e) { return e.backend->name() == name; });
  if (same != entries_.end()) {
    entry.api_enabled = same->api_enabled;
    *same = std::move(entry);
  } else {
    entries_.push_back(std::move(entry));
  }
  snapshot_.reset();
  std::stable_sort(entries_.begin(), entries_.end(), [](const RegistryEntry& a, const RegistryEntry& b) {
    if (a.backend->priority() != b.backend->priority()) return a.backend->priority() < b.backend->priority();
    return a.backend->name() < b.backend->name();
  });
}

bool Registry::remove(const std::string& name) {
  std::unique_lock lock(mutex_);
  auto it = std::find_if(entries_.begin(), entries_.end(),
                         [&](const RegistryEntry& e) { return e.backend->name() == name; });
  if (it == entries_.end()) return false;
  entries_.erase(it);
  snapshot_.reset();
  return true;
}

bool Registry::set_enabled(const std::string& name, bool enabled) {
  std::unique_lock lock(mutex_);
  for (auto& e : entries_) {
    if (e.backend->name() == name) {
      e.api_enabled = enabled;
      snapshot_.reset();
      return true;
    }
  }
  return false;
}

Registry::Snapshot Registry::snapshot() const {
  const Environment* env = &environment();
  {
    std::shared_lock lock(mutex_);
    if (snapshot_ && snapshot_env_ == env) return snapshot_;
  }
  std::unique_lock lock(mutex_);
  if (snapshot_ && snapshot_env_ == env) return snapshot_;
  auto out = std::make_shared<std::vector<RegistryEntry>>(entries_);
  for (auto& e : *out) {
    e.enabled = e.api_enabled;
    e.disabled_by = e.api_enabled ? "" : "gla_backend_set_enabled";
    if (std::find(env->disabled.begin(), env->disabled.end(), e.backend->name()) != env->disabled.end()) {
      e.enabled = false;
      e.disabled_by = "GLA_DISABLE";
    }
  }
  snapshot_ = std::move(out);
  snapshot_env_ = env;
  return snapshot_;
}

std::vector<std::string> Registry::names() const {
  std::shared_lock lock(mutex_);
  std::vector<std::string> out;
  for (const auto& e : entries_) out.push_back(e.backend->name());
  return out;
}

bool Registry::contains(const std::string& name) const {
  std::shared_lock lock(mutex_);
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const RegistryEntry& e) { return e.backend->name() == name; });
}

}  // namespace gla
