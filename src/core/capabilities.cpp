#include "core/capabilities.hpp"

#include <sstream>

#include "core/backend.hpp"

namespace gla {

namespace {

struct Feature {
  uint32_t bit;
  const char* name;
};
constexpr Feature kFeatures[] = {
    {GLA_FEATURE_VARLEN, "varlen"},           {GLA_FEATURE_INITIAL_STATE, "initial_state"},
    {GLA_FEATURE_FINAL_STATE, "final_state"}, {GLA_FEATURE_STATE_V_FIRST, "state_v_first"},
    {GLA_FEATURE_PER_KEY_GATE, "per-key gate"}, {GLA_FEATURE_PER_HEAD_GATE, "per-head gate"},
    {GLA_FEATURE_CHUNK_STATES, "chunk_states"}, {GLA_FEATURE_VALUE_GATE, "value gate (gv)"},
    {GLA_FEATURE_REVERSE, "reverse"},         {GLA_FEATURE_STATE_POOL, "state pool"},
    {GLA_FEATURE_TOKEN_STATES, "token_states"}, {GLA_FEATURE_CHUNK_STATES_BF16, "bf16 chunk_states"}};

// Appends `item` to a comma-separated list.
void join(std::string& list, const std::string& item) {
  if (!list.empty()) list += ',';
  list += item;
}

std::string dtype_list(uint32_t mask) {
  std::string s;
  for (int32_t d = 0; d < 32; ++d) {
    if (mask & dtype_bit(d)) join(s, dtype_name(d));
  }
  return s.empty() ? "none" : s;
}

std::string range(int64_t lo, int64_t hi) { return std::to_string(lo) + ".." + (hi > 0 ? std::to_string(hi) : "any"); }

bool is_recurrent(int32_t unit) { return unit == GLA_UNIT_RECURRENT_FWD || unit == GLA_UNIT_RECURRENT_BWD; }

struct Named {
  const char* name;
  const gla_tensor* t;
};

// The tensors whose last dimension a LAST_DIM_CONTIGUOUS record needs at stride 1.
std::vector<Named> row_tensors(const gla_problem& p) {
  std::vector<Named> out{{"q", &p.q}, {"k", &p.k}, {"v", &p.v}, {"o", &p.o}, {"do", &p.do_},
                         {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}, {"gv", &p.gv}, {"dgv", &p.dgv}};
  if (!p.gate_per_head) {
    out.push_back({is_recurrent(p.unit) ? "gk" : "g", &p.g});
    out.push_back({is_recurrent(p.unit) ? "dgk" : "dg", &p.dg});
  }
  return out;
}

std::vector<Named> all_tensors(const gla_problem& p) {
  return {{"q", &p.q},   {"k", &p.k},   {"v", &p.v},     {"g", &p.g},     {"initial_state", &p.initial_state},
          {"o", &p.o},   {"final_state", &p.final_state}, {"do", &p.do_}, {"dht", &p.dht},
          {"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv},   {"dg", &p.dg},   {"dh0", &p.dh0},
          {"gv", &p.gv}, {"dgv", &p.dgv}, {"token_states", &p.token_states}};
}

std::vector<std::string> record_reasons(const gla_capability& c, const gla_problem& p, int compute_capability) {
  std::vector<std::string> why;
  if (c.min_compute_capability > 0 && compute_capability >= 0 && compute_capability < c.min_compute_capability) {
    why.push_back("compute capability " + std::to_string(compute_capability / 10) + "." +
                  std::to_string(compute_capability % 10) + " below the declared " +
                  std::to_string(c.min_compute_capability / 10) + "." + std::to_string(c.min_compute_capability % 10));
  }
  if (!(c.dtype_mask & dtype_bit(p.dtype))) {
    why.push_back(std::string("dtype ") + dtype_name(p.dtype) + " not declared (declares " + dtype_list(c.dtype_mask) + ")");
  }
  const gla_tensor* gates[] = {&p.g, &p.gv, &p.dg, &p.dgv};
  const char* gate_names[] = {is_recurrent(p.unit) ? "gk" : "g", "gv", is_recurrent(p.unit) ? "dgk" : "dg", "dgv"};
  for (int i = 0; i < 4; ++i) {
    if (present(*gates[i]) && !(c.gate_dtype_mask & dtype_bit(gates[i]->dtype))) {
      why.push_back(std::string(gate_names[i]) + " dtype " + dtype_name(gates[i]->dtype) + " not declared (declares " +
                    dtype_list(c.gate_dtype_mask) + ")");
    }
  }
  if (p.K < c.k_min || (c.k_max > 0 && p.K > c.k_max)) {
    why.push_back("K=" + std::to_string(p.K) + " outside the declared " + range(c.k_min, c.k_max));
  }
  if (p.V < c.v_min || (c.v_max > 0 && p.V > c.v_max)) {
    why.push_back("V=" + std::to_string(p.V) + " outside the declared " + range(c.v_min, c.v_max));
  }
  const uint32_t missing = problem_features(p) & ~c.features;
  for (const Feature& f : kFeatures) {
    if (!(missing & f.bit)) continue;
    if (f.bit == GLA_FEATURE_CHUNK_STATES || f.bit == GLA_FEATURE_CHUNK_STATES_BF16) {
      const std::string in = f.bit == GLA_FEATURE_CHUNK_STATES ? "f32" : "bf16";
      why.push_back(p.unit == GLA_UNIT_CHUNK_FWD ? "does not write saved chunk states in " + in + " (chunk_states)"
                                                 : "does not read saved chunk states in " + in + " (chunk_states)");
    } else {
      why.push_back(std::string(f.name) + " not declared");
    }
  }
  if (c.layout & GLA_LAYOUT_CONTIGUOUS) {
    for (const Named& x : all_tensors(p)) {
      if (present(*x.t) && !is_contiguous(*x.t)) why.push_back(std::string(x.name) + " needs a contiguous layout, got strides " + [&] {
        std::string s;
        for (int d = 0; d < x.t->rank; ++d) join(s, std::to_string(x.t->strides[d]));
        return s;
      }());
    }
  } else if (c.layout & GLA_LAYOUT_LAST_DIM_CONTIGUOUS) {
    for (const Named& x : row_tensors(p)) {
      const gla_tensor& t = *x.t;
      if (present(t) && t.rank > 0 && t.strides[t.rank - 1] != 1 && t.sizes[t.rank - 1] != 1) {
        why.push_back(std::string(x.name) + " needs a contiguous last dimension (stride 1), got stride " +
                      std::to_string(t.strides[t.rank - 1]));
      }
    }
  }
  if (c.alignment > 1) {
    for (const Named& x : all_tensors(p)) {
      if (x.t->data && reinterpret_cast<uintptr_t>(x.t->data) % c.alignment != 0) {
        why.push_back(std::string(x.name) + "'s data is not " + std::to_string(c.alignment) + "-byte aligned");
      }
    }
  }
  return why;
}

}  // namespace

gla_capability open_capability(uint64_t units, uint64_t devices) {
  gla_capability c{};
  c.unit_mask = units;
  c.device_mask = devices;
  c.dtype_mask = kFloatDtypes;
  c.gate_dtype_mask = kFloatDtypes;
  c.k_min = 1;
  c.v_min = 1;
  c.features = GLA_FEATURE_ALL & ~(GLA_FEATURE_CHUNK_STATES | GLA_FEATURE_CHUNK_STATES_BF16);
  return c;
}

uint32_t problem_features(const gla_problem& p) {
  uint32_t f = 0;
  if (p.varlen) f |= GLA_FEATURE_VARLEN;
  if (present(p.initial_state) && !present(p.state_slots)) f |= GLA_FEATURE_INITIAL_STATE;
  if ((present(p.final_state) && !present(p.state_slots)) || present(p.dht)) f |= GLA_FEATURE_FINAL_STATE;
  if (p.state_v_first) f |= GLA_FEATURE_STATE_V_FIRST;
  if (present(p.g)) f |= p.gate_per_head ? GLA_FEATURE_PER_HEAD_GATE : GLA_FEATURE_PER_KEY_GATE;
  if (!unit_is_stage(p.unit) && !is_recurrent(p.unit) && present(p.h)) {
    f |= p.h.dtype == GLA_DTYPE_BF16 ? GLA_FEATURE_CHUNK_STATES_BF16 : GLA_FEATURE_CHUNK_STATES;
  }
  if (present(p.gv)) f |= GLA_FEATURE_VALUE_GATE;
  if (p.reverse) f |= GLA_FEATURE_REVERSE;
  if (present(p.state_slots)) f |= GLA_FEATURE_STATE_POOL;
  if (present(p.token_states)) f |= GLA_FEATURE_TOKEN_STATES;
  return f;
}

std::vector<std::string> declaration_reasons(const std::vector<gla_capability>& records, const gla_problem& p,
                                             int compute_capability) {
  std::vector<std::string> all;
  bool covered = false;
  for (const gla_capability& c : records) {
    if (!(c.unit_mask & unit_bit(p.unit)) || !(c.device_mask & device_bit(p.device_type))) continue;
    covered = true;
    auto why = record_reasons(c, p, compute_capability);
    if (why.empty()) return {};
    for (auto& w : why) {
      bool seen = false;
      for (const auto& a : all) seen = seen || a == w;
      if (!seen) all.push_back(std::move(w));
    }
  }
  if (!covered) {
    all.push_back(std::string("declares no record for ") + gla_unit_name(p.unit) + " on device " + device_type_name(p.device_type));
  }
  return all;
}

std::string describe(const gla_capability& c) {
  std::ostringstream s;
  std::string units;
  const bool all_stages = (c.unit_mask & kStageUnits) == kStageUnits;
  for (int32_t u = 0; u < GLA_UNIT_COUNT; ++u) {
    if (!(c.unit_mask & unit_bit(u))) continue;
    if (all_stages && unit_is_stage(u) && u != GLA_UNIT_CUMSUM) continue;
    join(units, all_stages && u == GLA_UNIT_CUMSUM ? "stages" : gla_unit_name(u));
  }
  std::string devices;
  for (int32_t d = 0; d < 64; ++d) {
    if (c.device_mask & device_bit(d)) join(devices, device_type_name(d));
  }
  s << units << " on " << devices;
  if (c.min_compute_capability > 0) s << " (compute capability " << c.min_compute_capability / 10 << '.' << c.min_compute_capability % 10 << "+)";
  s << ": dtypes " << dtype_list(c.dtype_mask) << "; gates " << dtype_list(c.gate_dtype_mask) << "; K "
    << range(c.k_min, c.k_max) << "; V " << range(c.v_min, c.v_max) << "; features ";
  std::string features;
  for (const Feature& f : kFeatures) {
    if (c.features & f.bit) join(features, f.name);
  }
  s << (features.empty() ? "none" : features) << "; layout "
    << ((c.layout & GLA_LAYOUT_CONTIGUOUS) ? "contiguous" : (c.layout & GLA_LAYOUT_LAST_DIM_CONTIGUOUS) ? "last dim stride 1" : "any strides");
  if (c.alignment > 1) s << ", " << c.alignment << "-byte aligned";
  s << "; " << (c.deterministic ? "deterministic" : "not deterministic");
  return s.str();
}

std::string declaration_error(const std::vector<gla_capability>& records) {
  for (size_t i = 0; i < records.size(); ++i) {
    const gla_capability& c = records[i];
    const std::string at = "capabilities[" + std::to_string(i) + "]";
    if (c.unit_mask == 0 || (c.unit_mask >> GLA_UNIT_COUNT) != 0) return at + ".unit_mask: expected units 0.." + std::to_string(GLA_UNIT_COUNT - 1) + ", got none or unknown bits";
    if (c.device_mask == 0) return at + ".device_mask: expected at least one device type, got none";
    if ((c.dtype_mask & ~kFloatDtypes) || !c.dtype_mask) return at + ".dtype_mask: expected float32/float16/bfloat16 bits, got " + std::to_string(c.dtype_mask);
    if ((c.gate_dtype_mask & ~kFloatDtypes) || !c.gate_dtype_mask) return at + ".gate_dtype_mask: expected float32/float16/bfloat16 bits, got " + std::to_string(c.gate_dtype_mask);
    if (c.k_min < 1 || (c.k_max > 0 && c.k_max < c.k_min)) return at + ": expected 1 <= k_min <= k_max (or k_max 0), got " + range(c.k_min, c.k_max);
    if (c.v_min < 1 || (c.v_max > 0 && c.v_max < c.v_min)) return at + ": expected 1 <= v_min <= v_max (or v_max 0), got " + range(c.v_min, c.v_max);
    if (c.features & ~GLA_FEATURE_ALL) return at + ".features: unknown bits " + std::to_string(c.features & ~GLA_FEATURE_ALL);
    if (c.layout & ~uint32_t{GLA_LAYOUT_LAST_DIM_CONTIGUOUS | GLA_LAYOUT_CONTIGUOUS}) return at + ".layout: unknown bits";
    if (c.alignment & (c.alignment - 1)) return at + ".alignment: expected a power of two or 0, got " + std::to_string(c.alignment);
  }
  return "";
}

}  // namespace gla
