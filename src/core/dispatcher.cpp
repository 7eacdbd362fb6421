#include "core/dispatcher.hpp"

#include "core/capabilities.hpp"
#include "core/environment.hpp"
#include "core/tuner.hpp"

#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

namespace gla {

namespace {

std::string trim(std::string s) {
  s.erase(0, s.find_first_not_of(" \t"));
  s.erase(s.find_last_not_of(" \t") + 1);
  return s;
}

// "cpu" or "fwd_h=vendor,bwd_dqkg=cpu" into control.
void parse_backend_spec(const std::string& spec, DispatchControl& control, const char* source) {
  std::stringstream stream(spec);
  std::string item;
  while (std::getline(stream, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    const auto eq = item.find('=');
    if (eq == std::string::npos) {
      control.forced = item;
      continue;
    }
    const std::string unit_name = trim(item.substr(0, eq));
    const int32_t unit = unit_from_name(unit_name);
    if (unit < 0) {
      fail(GLA_STATUS_INVALID_ARGUMENT, std::string(source) + ": unknown unit '" + unit_name +
                                            "' in '" + spec + "' (expected e.g. chunk_fwd, fwd_h, bwd_dqkg)");
    }
    control.forced_units[unit] = trim(item.substr(eq + 1));
  }
}

int32_t parse_policy(const std::string& text) {
  if (text == "priority") return GLA_POLICY_PRIORITY;
  if (text == "forced") return GLA_POLICY_FORCED;
  if (text == "fastest") return GLA_POLICY_FASTEST;
  fail(GLA_STATUS_INVALID_ARGUMENT, "GLA_POLICY: expected priority, forced or fastest, got '" + text + "'");
}

const char* policy_name(int32_t policy) {
  switch (policy) {
    case GLA_POLICY_FORCED: return "forced";
    case GLA_POLICY_FASTEST: return "fastest";
    default: return "priority";
  }
}

// The problem as a backend sees it for `unit`: stage buffers described (shapes only; data is set
// when the pipeline runs).
gla_problem problem_for_unit(const gla_problem& whole, int32_t unit) {
  gla_problem p = whole;
  p.unit = unit;
  if (unit_is_stage(unit)) {
    p.chunk_size = kPipelineChunkSize;
    int64_t chunks = 0;
    for (int64_t n = 0; n < p.N && p.seq_offsets; ++n) {
      chunks += (sequence_span(p, n).length + kPipelineChunkSize - 1) / kPipelineChunkSize;
    }
    p.num_chunks = chunks;
    const int64_t kg = p.gate_per_head ? 1 : p.K;
    const int32_t dev = p.device_type, idx = p.device_index;
    p.gcum = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {p.B, p.T, p.H, kg});
    p.h = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {chunks, p.H, p.K, p.V});
    p.A = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {p.B, p.T, p.H, kPipelineChunkSize});
    if (p.backward) {
      p.dh = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {chunks, p.H, p.K, p.V});
      p.dA = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {p.B, p.T, p.H, kPipelineChunkSize});
      p.dq_intra = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {p.B, p.T, p.H, p.K});
      p.dk_intra = make_tensor(nullptr, GLA_DTYPE_F32, dev, idx, {p.B, p.T, p.H, p.K});
    }
    // In the backward pipeline fwd_h only recomputes the chunk-start states.
    if (p.backward) p.final_state = gla_tensor{};
  }
  return p;
}
gla_problem problem_for_unit(const PreparedProblem& prepared, int32_t unit) { return problem_for_unit(prepared.problem, unit); }

// Why `entry` cannot run `unit` on this problem ("" = it can).
std::string decline_reason(const RegistryEntry& entry, const gla_problem& problem, int32_t unit) {
  const Backend& b = *entry.backend;
  if (!entry.availability.ok) return "unavailable: " + entry.availability.reason;
  if (!entry.enabled) return "disabled by " + entry.disabled_by;
  if (!b.serves_device(problem.device_type)) {
    return std::string("does not serve device ") + device_type_name(problem.device_type);
  }
  if (!b.implements(unit)) return "does not implement " + std::string(gla_unit_name(unit));
  Verdict v = b.verify(problem);
  if (!v.ok) return v.reason.empty() ? std::string("declined (no reason given)") : v.reason;
  return "";
}

bool stage_forced(const DispatchControl& control, int32_t operation) {
  for (int32_t s : pipeline_stages(operation)) {
    if (control.forced_units.count(s)) return true;
  }
  return false;
}

// The backend that must run `unit` ("" = free choice).
std::string forced_for(const DispatchControl& control, int32_t unit) {
  auto it = control.forced_units.find(unit);
  if (it != control.forced_units.end()) return it->second;
  return control.forced;
}

std::string problem_line(const gla_problem& p) {
  std::ostringstream s;
  s << gla_unit_name(p.unit) << " B=" << p.B << " T=" << p.T << " H=" << p.H << " K=" << p.K << " V=" << p.V
    << " N=" << p.N << (p.varlen ? " varlen" : "") << " dtype=" << dtype_name(p.dtype);
  if (p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD) {
    s << " gk=" << (present(p.g) ? dtype_name(p.g.dtype) : "none") << " gv=" << (present(p.gv) ? dtype_name(p.gv.dtype) : "none")
      << (p.reverse ? " reverse" : "");
    if (present(p.state_slots)) {
      s << " state_pool P=" << p.initial_state.sizes[0] << (p.state_v_first ? " [P,H,V,K]" : " [P,H,K,V]")
        << (present(p.token_states) ? " +token_states" : " (updated in place)");
    }
  } else {
    s << " gate=" << (p.gate_per_head ? "per-head " : "per-key ") << dtype_name(p.gate_dtype);
  }
  s << (p.state_v_first ? " state=[N,H,V,K]" : "") << (present(p.initial_state) && !present(p.state_slots) ? " +initial_state" : "")
    << (present(p.final_state) && !present(p.state_slots) ? " +final_state" : "") << (!unit_is_stage(p.unit) && present(p.h) ? " +chunk_states" : "")
    << " device=" << device_type_name(p.device_type) << ':'
    << p.device_index;
  return s.str();
}

std::mutex g_log_mutex;
std::set<std::string> g_logged;

std::shared_ptr<Backend> choose_for_unit(const std::vector<RegistryEntry>& entries, const PreparedProblem& prepared,
                                         const DispatchControl& control, int32_t unit, std::string* why_none) {
  const gla_problem p = problem_for_unit(prepared, unit);
  const std::string forced = forced_for(control, unit);
  std::ostringstream reasons;
  for (const auto& e : entries) {
    if (!forced.empty() && e.backend->name() != forced) continue;
    std::string reason = decline_reason(e, p, unit);
    if (reason.empty()) return e.backend;
    reasons << "\n  " << e.backend->name() << ": " << reason;
  }
  if (why_none) {
    *why_none = forced.empty() ? std::string("no backend accepts ") + gla_unit_name(unit) + ":" + reasons.str()
                               : "forced backend '" + forced + "' declines " + gla_unit_name(unit) + ":" + reasons.str();
  }
  return nullptr;
}

// Pipeline with every stage chosen; nullopt-like (empty stages) with a reason when a stage has none.
bool try_pipeline(const std::vector<RegistryEntry>& entries, const PreparedProblem& prepared,
                  const DispatchControl& control, int32_t operation, Plan& plan, std::string& why) {
  plan = Plan{};
  plan.pipeline = true;
  if (present(prepared.problem.h)) {
    why = "the stage pipeline does not " + std::string(operation == GLA_UNIT_CHUNK_FWD ? "write" : "read") +
          " saved chunk states (chunk_states)";
    return false;
  }
  if (pipeline_stages(operation).empty()) {
    why = std::string(gla_unit_name(operation)) + " has no stage pipeline (it runs as a whole operation only)";
    return false;
  }
  for (int32_t s : pipeline_stages(operation)) {
    auto b = choose_for_unit(entries, prepared, control, s, &why);
    if (!b) return false;
    plan.stages.emplace_back(s, b);
  }
  return true;
}

void check_forced_names(const std::vector<RegistryEntry>& entries, const DispatchControl& control) {
  auto known = [&](const std::string& name) {
    for (const auto& e : entries) {
      if (e.backend->name() == name) return true;
    }
    return false;
  };
  auto names = [&] {
    std::string s;
    for (const auto& e : entries) s += (s.empty() ? "" : ", ") + e.backend->name();
    return s;
  };
  if (!control.forced.empty() && !known(control.forced)) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "backend: expected one of " + names() + ", got '" + control.forced + "'");
  }
  for (const auto& [unit, name] : control.forced_units) {
    if (!known(name)) {
      fail(GLA_STATUS_INVALID_ARGUMENT, std::string("backend for ") + gla_unit_name(unit) + ": expected one of " +
                                            names() + ", got '" + name + "'");
    }
  }
}

Plan priority_plan(const std::vector<RegistryEntry>& entries, const PreparedProblem& prepared,
                   const DispatchControl& control, std::string& failure) {
  const int32_t op = prepared.problem.unit;
  Plan plan;
  std::string why;
  const gla_problem whole_problem = problem_for_unit(prepared, op);

  if (control.force_pipeline || stage_forced(control, op)) {
    if (try_pipeline(entries, prepared, control, op, plan, why)) return plan;
    failure = "stage pipeline for " + std::string(gla_unit_name(op)) + " cannot run: " + why;
    return Plan{};
  }
  const std::string forced = forced_for(control, op);
  if (!forced.empty()) {
    for (const auto& e : entries) {
      if (e.backend->name() != forced) continue;
      std::string reason = decline_reason(e, whole_problem, op);
      if (reason.empty()) {
        plan.whole = e.backend;
        return plan;
      }
      // A forced backend that offers every stage but not the whole operation runs the pipeline.
      Plan staged;
      std::string stage_why;
      if (try_pipeline(entries, prepared, control, op, staged, stage_why)) return staged;
      failure = "forced backend '" + forced + "' declines " + gla_unit_name(op) + ": " + reason;
      return Plan{};
    }
  }
  // Priority: the first backend that takes part decides between the whole operation and stages.
  for (const auto& e : entries) {
    if (decline_reason(e, whole_problem, op).empty()) {
      plan.whole = e.backend;
      return plan;
    }
    bool offers_stage = false;
    for (int32_t s : pipeline_stages(op)) {
      if (decline_reason(e, problem_for_unit(prepared, s), s).empty()) offers_stage = true;
    }
    if (offers_stage && try_pipeline(entries, prepared, control, op, plan, why)) return plan;
  }
  failure = "no available backend accepts " + problem_line(whole_problem);
  if (present(prepared.problem.h)) {
    failure += std::string(" (with chunk_states: the stage pipeline does not ") + (op == GLA_UNIT_CHUNK_FWD ? "write" : "read") +
               " saved chunk states, so only a backend that handles them for the whole operation can run it)";
  }
  return Plan{};
}

// ---- the `fastest` policy ----

// The calls the policy chooses for: no backend, unit or pipeline forced.
bool fastest_applies(const DispatchControl& control) {
  return control.policy == GLA_POLICY_FASTEST && control.forced.empty() && control.forced_units.empty() &&
         !control.force_pipeline;
}

// One way to run the whole operation: a backend, or the stage pipeline (labelled by its stages).
struct Candidate {
  std::string label;
  Plan plan;
};

// Every available, enabled backend that accepts the whole operation, in priority order, and the stage
// pipeline priority would assemble when a stage-only backend takes part in it (first when priority
// itself chooses the pipeline).
std::vector<Candidate> fastest_candidates(const std::vector<RegistryEntry>& entries, const PreparedProblem& prepared,
                                          const DispatchControl& control, const Plan& by_priority) {
  std::vector<Candidate> out;
  const int32_t op = prepared.problem.unit;
  const gla_problem whole = problem_for_unit(prepared, op);
  for (const auto& e : entries) {
    if (decline_reason(e, whole, op).empty()) {
      Plan plan;
      plan.whole = e.backend;
      out.push_back({e.backend->name(), plan});
    }
  }
  Plan staged = by_priority;
  std::string why;
  if (!staged.pipeline && !try_pipeline(entries, prepared, control, op, staged, why)) return out;
  bool adds_a_backend = by_priority.pipeline;
  for (const auto& [unit, backend] : staged.stages) {
    bool known = false;
    for (const auto& c : out) known = known || c.plan.whole == backend;
    adds_a_backend = adds_a_backend || !known;
  }
  if (!adds_a_backend) return out;
  Candidate pipeline{staged.summary(), staged};
  if (by_priority.pipeline) {
    out.insert(out.begin(), pipeline);
  } else {
    out.push_back(pipeline);
  }
  return out;
}

std::vector<std::string> labels(const std::vector<Candidate>& candidates) {
  std::vector<std::string> out;
  for (const auto& c : candidates) out.push_back(c.label);
  return out;
}

// Set while this thread measures: a backend calling back into libgla with `fastest` gets priority
// instead of waiting on its own measurement.
thread_local bool t_measuring = false;

// The plan `fastest` gives from what is known (no measuring): the cached winner, else priority.
Plan fastest_known(const std::vector<RegistryEntry>& entries, const PreparedProblem& prepared,
                   const DispatchControl& control, const Plan& by_priority, TuneRecord* record, bool* found) {
  const auto candidates = fastest_candidates(entries, prepared, control, by_priority);
  TuneRecord r;
  const bool hit = candidates.size() > 1 &&
                   Tuner::instance().lookup(tune_signature(problem_for_unit(prepared, prepared.problem.unit)),
                                            labels(candidates), r);
  if (found) *found = hit;
  if (record) *record = r;
  if (hit) {
    for (const auto& c : candidates) {
      if (c.label == r.winner) return c.plan;
    }
  }
  return by_priority;
}

Plan plan_with_reasons(const PreparedProblem& prepared, const DispatchControl& control, std::string& failure) {
  const auto snapshot = Registry::instance().snapshot();
  const auto& entries = *snapshot;
  check_forced_names(entries, control);
  Plan plan = priority_plan(entries, prepared, control, failure);
  if (!fastest_applies(control) || (!plan.pipeline && !plan.whole)) return plan;
  return fastest_known(entries, prepared, control, plan, nullptr, nullptr);
}

std::string verdict_table(const PreparedProblem& prepared, const DispatchControl& control) {
  const auto snapshot = Registry::instance().snapshot();
  const auto& entries = *snapshot;
  const int32_t op = prepared.problem.unit;
  std::vector<int32_t> units{op};
  for (int32_t s : pipeline_stages(op)) units.push_back(s);
  std::ostringstream out;
  for (const auto& e : entries) {
    const Backend& b = *e.backend;
    out << "backend '" << b.name() << "' (priority " << b.priority() << "): "
        << (e.availability.ok ? "available" : "unavailable (" + e.availability.reason + ")") << ", "
        << (e.enabled ? "enabled" : "disabled by " + e.disabled_by) << "\n";
    for (const gla_capability& c : b.capabilities()) out << "    declares " << describe(c) << "\n";
    for (int32_t u : units) {
      const gla_problem p = problem_for_unit(prepared, u);
      std::string reason = decline_reason(e, p, u);
      char name[32];
      std::snprintf(name, sizeof name, "%-14s", gla_unit_name(u));
      out << "    " << name << (reason.empty() ? "accepts" : "declines: " + reason) << "\n";
    }
  }
  (void)control;
  return out.str();
}

void log_decision(const PreparedProblem& prepared, const DispatchControl& control, const Plan& plan) {
  if (!control.log) return;
  const std::string key = problem_line(prepared.problem) + "|" + policy_name(control.policy) + "|" + control.forced +
                          "|" + (control.force_pipeline ? "P" : "");
  {
    std::lock_guard lock(g_log_mutex);
    if (!g_logged.insert(key).second) return;
  }
  std::string text = "[gla] dispatch " + problem_line(prepared.problem) + "\n[gla]   decision: " + plan.summary() +
                     "\n" + verdict_table(prepared, control);
  std::fputs(text.c_str(), stderr);
}

// Memory borrowed for one call: from the caller's workspace when it is large enough, else from the
// caller's allocator when given (the caller frees it), else from the backend's allocator, returned
// at the end.
class Scratch {
 public:
  Scratch(Backend& backend, const gla_problem& problem, size_t bytes, const gla_options& options,
          const gla_allocator* allocator)
      : backend_(backend), problem_(problem) {
    if (bytes == 0) return;
    if (options.workspace && options.workspace_bytes >= bytes) {
      base_ = static_cast<char*>(options.workspace);
    } else if (allocator) {
      base_ = static_cast<char*>(allocator->allocate(allocator->context, bytes));
      if (!base_) {
        fail(GLA_STATUS_OUT_OF_MEMORY, "workspace: the caller's allocator returned NULL for " + std::to_string(bytes) +
                                           " bytes");
      }
    } else {
      base_ = static_cast<char*>(backend.allocate(problem, bytes));
      owned_ = true;
    }
  }
  ~Scratch() {
    if (owned_) backend_.deallocate(problem_, base_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* base() const { return base_; }

 private:
  Backend& backend_;
  gla_problem problem_;
  char* base_ = nullptr;
  bool owned_ = false;
};

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Byte sizes of the stage buffers, in the order gcum, h, A, dh, dA, dq_intra, dk_intra.
std::vector<size_t> pipeline_buffer_bytes(const gla_problem& p) {
  auto bytes = [](const gla_tensor& t) { return present(t) ? aligned(static_cast<size_t>(numel(t)) * 4) : 0; };
  return {bytes(p.gcum), bytes(p.h), bytes(p.A), bytes(p.dh), bytes(p.dA), bytes(p.dq_intra), bytes(p.dk_intra)};
}

size_t plan_workspace(const PreparedProblem& prepared, const Plan& plan) {
  if (!plan.pipeline) return plan.whole->workspace_size(problem_for_unit(prepared, prepared.problem.unit));
  size_t total = 0;
  for (size_t b : pipeline_buffer_bytes(problem_for_unit(prepared, GLA_UNIT_CUMSUM))) total += b;
  return total;
}

void host_reader(void* context, const gla_tensor& t, std::vector<char>& bytes) {
  auto* args = static_cast<std::pair<Backend*, const gla_problem*>*>(context);
  int64_t extent = 1;
  for (int d = 0; d < t.rank; ++d) extent += (t.sizes[d] - 1) * t.strides[d];
  bytes.resize(static_cast<size_t>(extent * dtype_size(t.dtype)));
  args->first->copy_to_host(*args->second, t.data, bytes.data(), bytes.size());
}

}  // namespace

const std::vector<int32_t>& pipeline_stages(int32_t operation) {
  static const std::vector<int32_t> forward{GLA_UNIT_CUMSUM, GLA_UNIT_FWD_H, GLA_UNIT_FWD_INTRA, GLA_UNIT_FWD_O};
  static const std::vector<int32_t> backward{GLA_UNIT_CUMSUM, GLA_UNIT_FWD_H,  GLA_UNIT_FWD_INTRA,
                                             GLA_UNIT_BWD_DH, GLA_UNIT_BWD_DA, GLA_UNIT_BWD_DV,
                                             GLA_UNIT_BWD_DQK_INTRA, GLA_UNIT_BWD_DQKG};
  static const std::vector<int32_t> none;
  if (operation == GLA_UNIT_CHUNK_FWD) return forward;
  if (operation == GLA_UNIT_CHUNK_BWD) return backward;
  return none;
}

int32_t unit_from_name(const std::string& name) {
  for (int32_t u = 0; u < GLA_UNIT_COUNT; ++u) {
    if (name == gla_unit_name(u)) return u;
  }
  return -1;
}

std::string Plan::summary() const {
  if (!pipeline) return whole ? whole->name() + " (whole operation)" : "none";
  std::string s = "stage pipeline:";
  for (const auto& [unit, backend] : stages) s += std::string(" ") + gla_unit_name(unit) + "->" + backend->name();
  return s;
}

DispatchControl make_control(const gla_options& options) {
  DispatchControl control;
  const Environment& env = environment();
  if (!env.policy.empty()) control.policy = parse_policy(env.policy);
  if (!env.backend.empty()) parse_backend_spec(env.backend, control, "GLA_BACKEND");
  control.log = env.log_dispatch;
  if (options.policy != GLA_POLICY_DEFAULT) control.policy = options.policy;
  if (options.backend && *options.backend) {
    // A per-call choice replaces the environment's.
    control.forced.clear();
    control.forced_units.clear();
    parse_backend_spec(options.backend, control, "options.backend");
  }
  if (control.policy == GLA_POLICY_FORCED && control.forced.empty() && control.forced_units.empty()) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "policy: 'forced' needs a backend name (options.backend or GLA_BACKEND), got none");
  }
  control.force_pipeline = options.force_stage_pipeline != 0;
  return control;
}

Plan make_plan(const PreparedProblem& prepared, const DispatchControl& control) {
  std::string failure;
  Plan plan = plan_with_reasons(prepared, control, failure);
  if (!plan.pipeline && !plan.whole) {
    fail(GLA_STATUS_NOT_SUPPORTED, failure + "\n" + verdict_table(prepared, control));
  }
  return plan;
}

namespace {

// The backend that times work on the problem's device: the first available one serving it that can
// (the host clock for host memory; events for CUDA). Every candidate is timed by the same clock.
Backend* timekeeper(const std::vector<RegistryEntry>& entries, const gla_problem& p) {
  for (const auto& e : entries) {
    if (e.availability.ok && e.backend->serves_device(p.device_type) && e.backend->can_time(p)) return e.backend.get();
  }
  return nullptr;
}

// Why `fastest` cannot measure this call now ("" = it can).
std::string no_measure_reason(const std::vector<RegistryEntry>& entries, const gla_problem& whole, size_t candidates) {
  if (candidates < 2) return candidates == 1 ? "one candidate only" : "no candidate";
  if (present(whole.state_slots)) return "the state update writes the caller's state pool in place";
  if (!timekeeper(entries, whole)) return std::string("no backend can time device ") + device_type_name(whole.device_type);
  for (const auto& e : entries) {
    if (e.availability.ok && e.backend->serves_device(whole.device_type) && e.backend->stream_capturing(whole)) {
      return "the stream is being captured into a graph";
    }
  }
  return "";
}

// Outputs of the whole operation, which the measurement points at scratch memory instead.
std::vector<gla_tensor*> output_fields(gla_problem& p) {
  std::vector<gla_tensor*> out{&p.o, &p.final_state, &p.dq, &p.dk, &p.dv, &p.dg, &p.dh0, &p.dgv, &p.token_states};
  if (p.unit == GLA_UNIT_CHUNK_FWD) out.push_back(&p.h);  // the saved chunk states the forward writes
  return out;
}

void run_plan(const gla_problem& whole, const Plan& plan, const gla_options& options, const gla_allocator* allocator);

// Times every candidate on the call's inputs with outputs to scratch: one warm-up run, then three
// timed runs (one when the warm-up took 100 ms or more: the noise is small against it), keeping the
// minimum (load on the machine only ever adds time).
TuneRecord measure(const std::vector<Candidate>& candidates, Backend& clock, const gla_problem& whole,
                   const gla_options& options) {
  struct Flag {
    Flag() { t_measuring = true; }
    ~Flag() { t_measuring = false; }
  } flag;
  gla_problem p = whole;
  std::vector<std::pair<gla_tensor*, void*>> owned;
  struct Release {
    Backend& b;
    const gla_problem& p;
    std::vector<std::pair<gla_tensor*, void*>>& owned;
    ~Release() {
      for (auto& [t, ptr] : owned) b.deallocate(p, ptr);
    }
  } release{clock, whole, owned};
  for (gla_tensor* t : output_fields(p)) {
    if (!present(*t)) continue;
    const size_t bytes = static_cast<size_t>(numel(*t) * dtype_size(t->dtype));
    void* ptr = clock.allocate(whole, bytes);
    owned.emplace_back(t, ptr);
    gla_tensor scratch = make_tensor(ptr, t->dtype, t->device_type, t->device_index, {});
    scratch.rank = t->rank;
    int64_t stride = 1;
    for (int d = t->rank - 1; d >= 0; --d) {
      scratch.sizes[d] = t->sizes[d];
      scratch.strides[d] = stride;
      stride *= t->sizes[d];
    }
    *t = scratch;
  }
  gla_options own = options;  // the caller's workspace is the caller's memory too
  own.workspace = nullptr;
  own.workspace_bytes = 0;
  TuneRecord record;
  for (const Candidate& c : candidates) {
    double best = -1;
    try {
      auto once = [&] { run_plan(p, c.plan, own, nullptr); };
      const double warm = clock.time_run_ms(p, once);
      const int runs = warm < 100 ? 3 : 1;
      for (int r = 0; r < runs; ++r) {
        const double ms = clock.time_run_ms(p, once);
        if (best < 0 || ms < best) best = ms;
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[gla] fastest: %s failed while being measured (left out): %s\n", c.label.c_str(), e.what());
      best = -1;
    }
    record.candidates.push_back(c.label);
    record.ms.push_back(best);
  }
  const int w = tune_winner(record.ms);
  record.winner = record.candidates[w < 0 ? 0 : static_cast<size_t>(w)];
  return record;
}

// `fastest` for a call about to run: the cached winner, or a measurement now (once per signature),
// or — when it cannot measure — what is known.
Plan fastest_plan(const PreparedProblem& prepared, const DispatchControl& control, const Plan& known,
                  const gla_options& options, bool remeasure, TuneRecord* out) {
  const auto snapshot = Registry::instance().snapshot();
  const auto& entries = *snapshot;
  std::string failure;
  const Plan by_priority = priority_plan(entries, prepared, control, failure);
  if (!by_priority.pipeline && !by_priority.whole) return known;
  const auto candidates = fastest_candidates(entries, prepared, control, by_priority);
  const gla_problem whole = problem_for_unit(prepared, prepared.problem.unit);
  const std::string why = no_measure_reason(entries, whole, candidates.size());
  if (!why.empty() || (t_measuring && !remeasure)) {
    if (remeasure) fail(GLA_STATUS_NOT_SUPPORTED, "tune: cannot measure this problem: " + why);
    return known;
  }
  Backend& clock = *timekeeper(entries, whole);
  const TuneRecord record = Tuner::instance().get_or_measure(
      tune_signature(whole), labels(candidates), [&] { return measure(candidates, clock, whole, options); }, remeasure);
  if (out) *out = record;
  for (const auto& c : candidates) {
    if (c.label == record.winner) return c.plan;
  }
  return known;
}

// What explain() says about `fastest` for this problem.
std::string fastest_note(const PreparedProblem& prepared, const DispatchControl& control) {
  const auto snapshot = Registry::instance().snapshot();
  const auto& entries = *snapshot;
  std::string failure;
  const Plan by_priority = priority_plan(entries, prepared, control, failure);
  if (!by_priority.pipeline && !by_priority.whole) return "";
  const auto candidates = fastest_candidates(entries, prepared, control, by_priority);
  const gla_problem whole = problem_for_unit(prepared, prepared.problem.unit);
  std::ostringstream out;
  out << "fastest: candidates";
  for (const auto& c : candidates) out << " '" << c.label << "'";
  TuneRecord r;
  bool found = false;
  fastest_known(entries, prepared, control, by_priority, &r, &found);
  if (found) {
    out << "\n  measured (" << (r.from_file ? "read from GLA_TUNE_FILE" : "in this process") << ", minimum of the timed runs):";
    for (size_t i = 0; i < r.candidates.size(); ++i) {
      char ms[48];
      if (r.ms[i] < 0) {
        std::snprintf(ms, sizeof ms, "failed");
      } else {
        std::snprintf(ms, sizeof ms, "%.4f ms", r.ms[i]);
      }
      out << "\n    " << r.candidates[i] << ": " << ms << (r.candidates[i] == r.winner ? "  <- winner" : "");
    }
    out << "\n  signature: " << tune_signature(whole);
  } else {
    const std::string why = no_measure_reason(entries, whole, candidates.size());
    if (why.empty()) {
      out << "\n  not measured yet (priority serves until the first call measures it, or gla_tune)";
    } else {
      out << "\n  not measured: " << why << " (priority serves)";
    }
  }
  out << "\n  records kept: " << Tuner::instance().size() << " of at most " << kMaxTuneRecords
      << " (the least recently used is dropped first)";
  return out.str();
}

}  // namespace

std::string explain(const PreparedProblem& prepared, const DispatchControl& control) {
  std::ostringstream out;
  out << "problem: " << problem_line(prepared.problem) << "\n";
  out << "policy: " << policy_name(control.policy);
  if (!control.forced.empty()) out << ", forced backend '" << control.forced << "'";
  for (const auto& [unit, name] : control.forced_units) out << ", " << gla_unit_name(unit) << " forced to '" << name << "'";
  if (control.force_pipeline) out << ", stage pipeline forced";
  out << "\n";
  if (fastest_applies(control)) {
    const std::string note = fastest_note(prepared, control);
    if (!note.empty()) out << note << "\n";
  }
  out << verdict_table(prepared, control);
  std::string failure;
  Plan plan = plan_with_reasons(prepared, control, failure);
  out << "decision: " << (plan.pipeline || plan.whole ? plan.summary() : "none — " + failure) << "\n";
  if (plan.whole && !plan.pipeline) {
    if (prepared.offsets_need_copy) {
      out << "plan in '" << plan.whole->name()
          << "': depends on the sequence lengths, which are in device memory only (pass cu_seqlens_host to see it)\n";
    } else {
      const std::string note = plan.whole->plan_note(problem_for_unit(prepared, prepared.problem.unit));
      if (!note.empty()) out << "plan in '" << plan.whole->name() << "': " << note << "\n";
    }
  }
  return out.str();
}

size_t workspace_size(PreparedProblem& prepared, const gla_options& options) {
  const DispatchControl control = make_control(options);
  const Plan plan = make_plan(prepared, control);
  return plan_workspace(prepared, plan);
}

namespace {

// Offsets copied from the device, the checks that need them or the data; nothing written yet.
void load_and_check(PreparedProblem& prepared, const gla_options& options, Backend& lead) {
  if (prepared.offsets_need_copy) {
    const gla_tensor& cu = prepared.problem.cu_seqlens;
    std::vector<char> host(static_cast<size_t>(((cu.sizes[0] - 1) * cu.strides[0] + 1) * dtype_size(cu.dtype)));
    lead.copy_to_host(prepared.problem, cu.data, host.data(), host.size());
    std::vector<char> packed(static_cast<size_t>(cu.sizes[0] * dtype_size(cu.dtype)));
    for (int64_t i = 0; i < cu.sizes[0]; ++i) {
      std::memcpy(packed.data() + i * dtype_size(cu.dtype), host.data() + i * cu.strides[0] * dtype_size(cu.dtype),
                  static_cast<size_t>(dtype_size(cu.dtype)));
    }
    load_sequence_offsets(prepared, packed.data());
  }
  check_chunk_states_count(prepared.problem);  // chunk_states' NC needs the offsets; still before any write
  if (prepared.check_slots) {
    const gla_tensor& slots = prepared.problem.state_slots;
    std::vector<int32_t> host(static_cast<size_t>(slots.sizes[0]));
    std::vector<int32_t> strided(static_cast<size_t>(slots.sizes[0] > 0 ? (slots.sizes[0] - 1) * slots.strides[0] + 1 : 0));
    if (!strided.empty()) lead.copy_to_host(prepared.problem, slots.data, strided.data(), strided.size() * 4);
    for (size_t i = 0; i < host.size(); ++i) host[i] = strided[i * static_cast<size_t>(slots.strides[0])];
    check_state_slots(prepared.problem, host.data());
  }
  if (options.check_inputs) {
    std::pair<Backend*, const gla_problem*> context{&lead, &prepared.problem};
    check_input_values(prepared.problem, host_reader, &context);
  }
}

// Runs a plan on a whole-operation problem whose sequence offsets are loaded.
void run_plan(const gla_problem& whole, const Plan& plan, const gla_options& options, const gla_allocator* allocator) {
  if (!plan.pipeline) {
    gla_problem p = problem_for_unit(whole, whole.unit);
    const size_t bytes = plan.whole->workspace_size(p);
    Scratch scratch(*plan.whole, p, bytes, options, allocator);
    p.workspace = scratch.base();
    p.workspace_bytes = bytes;
    plan.whole->run(p);
    return;
  }
  gla_problem base = problem_for_unit(whole, GLA_UNIT_CUMSUM);
  std::vector<int64_t> chunk_offsets(static_cast<size_t>(base.N + 1), 0);
  for (int64_t n = 0; n < base.N; ++n) {
    chunk_offsets[n + 1] = chunk_offsets[n] + (sequence_span(base, n).length + kPipelineChunkSize - 1) / kPipelineChunkSize;
  }
  base.chunk_offsets = chunk_offsets.data();
  Backend& lead = *plan.stages.front().second;
  const auto sizes = pipeline_buffer_bytes(base);
  size_t total = 0;
  for (size_t s : sizes) total += s;
  Scratch scratch(lead, base, total, options, allocator);
  char* cursor = scratch.base();
  gla_tensor* buffers[] = {&base.gcum, &base.h, &base.A, &base.dh, &base.dA, &base.dq_intra, &base.dk_intra};
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    buffers[i]->data = cursor;
    cursor += sizes[i];
  }
  for (const auto& [unit, backend] : plan.stages) {
    gla_problem p = base;
    p.unit = unit;
    backend->run(p);
  }
}

}  // namespace

void execute(PreparedProblem& prepared, const gla_options& options, const gla_allocator* allocator) {
  const DispatchControl control = make_control(options);
  Plan plan = make_plan(prepared, control);
  load_and_check(prepared, options, plan.pipeline ? *plan.stages.front().second : *plan.whole);
  if (fastest_applies(control)) plan = fastest_plan(prepared, control, plan, options, false, nullptr);
  log_decision(prepared, control, plan);
  run_plan(prepared.problem, plan, options, allocator);
}

std::string tune(PreparedProblem& prepared, const gla_options& options) {
  DispatchControl control = make_control(options);
  if (!control.forced.empty() || !control.forced_units.empty() || control.force_pipeline) {
    fail(GLA_STATUS_INVALID_ARGUMENT, "tune: expected no forced backend or stage pipeline (it times them all), got " +
                                          std::string(control.force_pipeline ? "a forced stage pipeline" : "a forced backend"));
  }
  control.policy = GLA_POLICY_FASTEST;
  Plan plan = make_plan(prepared, control);
  load_and_check(prepared, options, plan.pipeline ? *plan.stages.front().second : *plan.whole);
  fastest_plan(prepared, control, plan, options, true, nullptr);
  return explain(prepared, control);
}

}  // namespace gla
