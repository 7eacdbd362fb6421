// The registry: every backend the process knows, in priority order, with its availability (probed
// once) and whether it is enabled. Thread-safe: readers take a snapshot under a shared lock.
#pragma once

#include <memory>
#include <shared_mutex>
#include <string>
#include <vector>

#include "core/backend.hpp"

namespace gla {

struct Environment;

struct RegistryEntry {
  std::shared_ptr<Backend> backend;
  Verdict availability;  // probed once when added
  bool enabled = true;       // effective: switched on by the API and not named in GLA_DISABLE
  std::string disabled_by;   // why not enabled ("" when enabled)
  bool api_enabled = true;   // gla_backend_set_enabled
};

class Registry {
 public:
  // The process-wide registry, holding the built-in backends, with GLA_DISABLE applied.
  static Registry& instance();

  // Adds a backend; one with the same name is replaced.
  void add(std::unique_ptr<Backend> backend);
  bool remove(const std::string& name);
  bool set_enabled(const std::string& name, bool enabled);
  // Entries sorted by priority (then name), with GLA_DISABLE (environment()) folded into `enabled`.
  // Built once and shared until a backend is added, removed, switched, or the environment is
  // re-read: copying the entries per call cost ~1k instructions of a tiny call.
  using Snapshot = std::shared_ptr<const std::vector<RegistryEntry>>;
  Snapshot snapshot() const;
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const;

 private:
  Registry();
  mutable std::shared_mutex mutex_;
  std::vector<RegistryEntry> entries_;
  mutable Snapshot snapshot_;                 // of entries_ under snapshot_env_; null = to build
  mutable const Environment* snapshot_env_ = nullptr;
};

void register_builtin_backends(Registry& registry);

// dlopen()s a plugin, checks its ABI version and calls its gla_plugin_register (throws gla::Error
// with the reason; a failed registration's backends are removed again).
void load_plugin(const std::string& path);
// gla_register_backend tells the plugin being loaded on this thread (if any) what it registered.
void note_registration(const std::string& name);

}  // namespace gla
