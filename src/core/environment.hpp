// libgla's environment variables, read once per process into an immutable snapshot: at the first
// call that needs one, and again only by gla_reload_environment() (gla.h). Read per call they cost
// ~11 getenv scans of the whole environment per PyTorch call (4.8k instructions with 37 variables).
#pragma once

#include <string>
#include <vector>

namespace gla {

struct Environment {
  std::string backend;        // GLA_BACKEND: "name" or "unit=name,..." ("" = unset)
  std::string policy;         // GLA_POLICY: priority | forced | fastest ("" = unset)
  bool log_dispatch = false;  // GLA_LOG contains "dispatch"
  std::vector<std::string> disabled;  // GLA_DISABLE=a,b (trimmed, empty items dropped)
  int num_threads = 0;        // GLA_NUM_THREADS when a positive number, else 0 (the hardware's)
  std::string cpu_isa;        // GLA_CPU_ISA: avx512 | avx2 | portable ("" = the best)
  bool poison_scratch = false;  // GLA_CPU_POISON_SCRATCH=1
  std::string tune_file;      // GLA_TUNE_FILE ("" = none)

  bool operator==(const Environment&) const = default;
};

// The current snapshot (read on first use). The reference stays valid for the process's lifetime,
// a reload included: it sees the values of the snapshot it was taken from.
const Environment& environment();

// Reads the variables again; calls that start afterwards see the new values. (An unchanged
// environment keeps the current snapshot.)
void reload_environment();

// "a, b,,c" -> {"a", "b", "c"}: items trimmed of spaces and tabs, empty ones dropped.
std::vector<std::string> split_list(const std::string& text, char separator);

}  // namespace gla
