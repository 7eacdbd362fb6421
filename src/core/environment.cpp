#include "core/environment.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <sstream>

namespace gla {

namespace {

std::string variable(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

Environment read_environment() {
  Environment e;
  e.backend = variable("GLA_BACKEND");
  e.policy = variable("GLA_POLICY");
  e.log_dispatch = variable("GLA_LOG").find("dispatch") != std::string::npos;
  e.disabled = split_list(variable("GLA_DISABLE"), ',');
  e.num_threads = std::max(0, std::atoi(variable("GLA_NUM_THREADS").c_str()));
  e.cpu_isa = variable("GLA_CPU_ISA");
  const std::string poison = variable("GLA_CPU_POISON_SCRATCH");
  e.poison_scratch = !poison.empty() && poison[0] == '1';
  e.tune_file = variable("GLA_TUNE_FILE");
  return e;
}

// Every snapshot published stays alive (a reader may hold one across a reload): a reload that
// changed something keeps one more, the cost of lock-free reads.
std::mutex g_mutex;
std::vector<std::unique_ptr<const Environment>> g_snapshots;
std::atomic<const Environment*> g_current{nullptr};

void publish(Environment e) {
  std::lock_guard lock(g_mutex);
  if (const Environment* now = g_current.load(std::memory_order_relaxed); now && *now == e) return;
  g_snapshots.push_back(std::make_unique<const Environment>(std::move(e)));
  g_current.store(g_snapshots.back().get(), std::memory_order_release);
}

}  // namespace

const Environment& environment() {
  if (const Environment* e = g_current.load(std::memory_order_acquire)) return *e;
  static std::once_flag first;
  std::call_once(first, [] { publish(read_environment()); });
  return *g_current.load(std::memory_order_acquire);
}

void reload_environment() { publish(read_environment()); }

std::vector<std::string> split_list(const std::string& text, char separator) {
  std::vector<std::string> items;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, separator)) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) items.push_back(item);
  }
  return items;
}

}  // namespace gla
