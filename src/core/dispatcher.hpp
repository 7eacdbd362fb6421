// The dispatcher: for a validated problem, picks which backend runs the whole operation, or, when
// the first backend in priority order that takes part offers only stages (or a stage is forced),
// runs the stage pipeline of SPEC.md §2 with each stage dispatched on its own.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/registry.hpp"
#include "core/validate.hpp"

namespace gla {

// Chunk size of the stage pipeline's intermediates (SPEC.md §2).
inline constexpr int64_t kPipelineChunkSize = 64;

// What the caller and the environment ask of the dispatcher. Options win over the environment.
struct DispatchControl {
  int32_t policy = GLA_POLICY_PRIORITY;
  std::string forced;                   // one backend for every unit ("" = none)
  std::map<int32_t, std::string> forced_units;  // unit -> backend ("fwd_h=vendor")
  bool force_pipeline = false;
  bool log = false;  // GLA_LOG=dispatch
};

// Reads GLA_BACKEND ("name" or "unit=name,unit=name"), GLA_POLICY and GLA_LOG, then the options.
DispatchControl make_control(const gla_options& options);

struct Plan {
  bool pipeline = false;
  std::shared_ptr<Backend> whole;
  std::vector<std::pair<int32_t, std::shared_ptr<Backend>>> stages;
  std::string summary() const;  // "chunk_fwd -> cpu" or "pipeline: cumsum -> a, ..."
};

// The units of an operation's stage pipeline, in execution order.
const std::vector<int32_t>& pipeline_stages(int32_t operation);

// Chooses; throws gla::Error(NOT_SUPPORTED) carrying the verdict table when nothing fits.
Plan make_plan(const PreparedProblem& prepared, const DispatchControl& control);

// The full verdict table for the problem (every backend, unit by unit) and the decision.
std::string explain(const PreparedProblem& prepared, const DispatchControl& control);

// Validated problem in, outputs written. The problem's offsets are loaded here when they live on a
// device. Scratch beyond options.workspace comes from `allocator` when given, else from the backend.
void execute(PreparedProblem& prepared, const gla_options& options, const gla_allocator* allocator = nullptr);
size_t workspace_size(PreparedProblem& prepared, const gla_options& options);

// gla_tune: measures the `fastest` candidates for this problem anew (replacing the cached record)
// and returns explain()'s text with the times.
std::string tune(PreparedProblem& prepared, const gla_options& options);

// Parses a unit name ("chunk_fwd", "fwd_h", ...); -1 if unknown.
int32_t unit_from_name(const std::string& name);

}  // namespace gla
