// Tests generated from the declarations: for every registered backend (the built-in ones, a declared
// callback backend registered here, and the example plug-ins when built), every capability record
// and every unit it covers on host memory, problems inside the declared ranges must run and match
// `reference`, and problems just outside them (a dtype, K or V past the range, an undeclared feature
// or layout) must be declined with a reason naming what is outside. Plus: every reason is reported,
// not only the first, and malformed declarations are refused at registration.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/backend.hpp"  // header-only: unit_is_stage
#include "recurrent_support.hpp"
#include "test_support.hpp"

using namespace gla::test;

namespace {

// ---- a declared callback backend: the whole forward, narrow ranges, delegating to `reference` ----
int32_t narrow_run(void*, const gla_problem* p, char* message, size_t capacity) {
  return forward_on(*p, "reference", message, capacity);
}

gla_capability narrow_record() {
  gla_capability c{};
  c.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  c.device_mask = 1ull << GLA_DEVICE_CPU;
  c.dtype_mask = (1u << GLA_DTYPE_F32) | (1u << GLA_DTYPE_BF16);
  c.gate_dtype_mask = 1u << GLA_DTYPE_F32;
  c.k_min = 8;
  c.k_max = 32;
  c.v_min = 4;
  c.v_max = 16;
  c.features = GLA_FEATURE_INITIAL_STATE | GLA_FEATURE_FINAL_STATE | GLA_FEATURE_PER_KEY_GATE;
  c.layout = GLA_LAYOUT_LAST_DIM_CONTIGUOUS;
  c.deterministic = 1;
  return c;
}

gla_backend_desc narrow_desc(const gla_capability* records, int32_t count) {
  gla_backend_desc d{};
  d.abi_version = GLA_ABI_VERSION;
  d.name = "declared_narrow";
  d.priority = 3000;
  d.device_mask = 1ull << GLA_DEVICE_CPU;
  d.unit_mask = 1ull << GLA_UNIT_CHUNK_FWD;
  d.run = narrow_run;
  d.capabilities = records;
  d.capability_count = count;
  return d;
}

// ---- probes: one problem for one unit ----
enum class Kind { kForward, kBackward, kRecurrentForward, kRecurrentBackward };
Kind kind_of(int32_t unit) {
  switch (unit) {
    case GLA_UNIT_CHUNK_FWD: case GLA_UNIT_CUMSUM: case GLA_UNIT_FWD_H: case GLA_UNIT_FWD_INTRA: case GLA_UNIT_FWD_O:
      return Kind::kForward;
    case GLA_UNIT_RECURRENT_FWD: return Kind::kRecurrentForward;
    case GLA_UNIT_RECURRENT_BWD: return Kind::kRecurrentBackward;
    default: return Kind::kBackward;
  }
}
bool recurrent(int32_t unit) { return unit == GLA_UNIT_RECURRENT_FWD || unit == GLA_UNIT_RECURRENT_BWD; }

struct Probe {
  RecurrentCase rc;  // rc.base is the chunked case too
  bool strided = false;
  std::string label;
  std::string expect;  // declined: a phrase the reason must contain ("" = accepted)
};

struct Result {
  gla_status status;
  std::string error;
  Outputs out;
  HostTensor dgv;
};

// Whole operations are forced by name, stages by "unit=name" (the rest of the pipeline by priority).
Result run_probe(const Probe& probe, int32_t unit, const std::string& backend) {
  Result r;
  const std::string spec = gla::unit_is_stage(unit) ? std::string(gla_unit_name(unit)) + "=" + backend : backend;
  RecurrentInputs in = make_recurrent_inputs(probe.rc);
  if (probe.strided) in.in.q = strided_copy(in.in.q);
  switch (kind_of(unit)) {
    case Kind::kForward: r.status = run_forward(in.in, r.out, {spec}); break;
    case Kind::kBackward: r.status = run_backward(in.in, r.out, {spec}); break;
    case Kind::kRecurrentForward: r.status = run_recurrent_forward(in, r.out, spec); break;
    case Kind::kRecurrentBackward: r.status = run_recurrent_backward(in, r.out, r.dgv, spec); break;
  }
  r.error = gla_last_error();
  return r;
}

bool gate_dtype_fits(const gla_capability& c, Case& base) {
  if (c.gate_dtype_mask & (1u << base.dtype)) {
    base.gate_f32 = false;
    return true;
  }
  if (c.gate_dtype_mask & (1u << GLA_DTYPE_F32)) {
    base.gate_f32 = true;
    return true;
  }
  return false;
}

Case base_case(const gla_capability& c, int32_t unit, int32_t dtype, uint64_t seed) {
  Case b;
  b.B = 2; b.T = 40; b.H = 2; b.K = c.k_min; b.V = c.v_min; b.dtype = dtype; b.seed = seed;
  b.initial_state = c.features & GLA_FEATURE_INITIAL_STATE;
  b.final_state = c.features & GLA_FEATURE_FINAL_STATE;
  b.per_head_gate = !recurrent(unit) && !(c.features & GLA_FEATURE_PER_KEY_GATE);
  return b;
}

RecurrentCase wrap(const Case& b, const gla_capability& c, int32_t unit) {
  RecurrentCase rc;
  rc.base = b;
  rc.gk = recurrent(unit) && (c.features & GLA_FEATURE_PER_KEY_GATE);
  return rc;
}

std::vector<Probe> accepted_probes(const gla_capability& c, int32_t unit) {
  std::vector<Probe> out;
  int32_t first = -1;
  for (int32_t dt : {GLA_DTYPE_F32, GLA_DTYPE_F16, GLA_DTYPE_BF16}) {
    if (!(c.dtype_mask & (1u << dt))) continue;
    Case b = base_case(c, unit, dt, 11 + static_cast<uint64_t>(dt));
    if (!gate_dtype_fits(c, b)) continue;
    if (first < 0) first = dt;
    out.push_back({wrap(b, c, unit), false, std::string("declared dtype ") + gla::dtype_name(dt), ""});
  }
  if (first < 0) return out;
  Case b = base_case(c, unit, first, 5);
  gate_dtype_fits(c, b);
  auto add = [&](Case x, const std::string& label, bool strided = false) {
    out.push_back({wrap(x, c, unit), strided, label, ""});
  };
  Case top = b;
  top.K = c.k_max > 0 ? c.k_max : 24;
  top.V = c.v_max > 0 ? c.v_max : 20;
  add(top, "top of the declared K and V");
  if (c.features & GLA_FEATURE_VARLEN) {
    Case v = b;
    v.B = 1; v.cu_seqlens = {0, 13, 13, 40};
    add(v, "varlen");
  }
  if (!recurrent(unit) && (c.features & GLA_FEATURE_PER_HEAD_GATE) && (c.features & GLA_FEATURE_PER_KEY_GATE)) {
    Case h = b;
    h.per_head_gate = true;
    add(h, "per-head gate");
  }
  if ((c.features & GLA_FEATURE_STATE_V_FIRST) && (b.initial_state || b.final_state)) {
    Case s = b;
    s.state_v_first = true;
    add(s, "state_v_first");
  }
  if (!(c.layout & (GLA_LAYOUT_LAST_DIM_CONTIGUOUS | GLA_LAYOUT_CONTIGUOUS))) add(b, "strided q", true);
  if (recurrent(unit)) {
    if (c.features & GLA_FEATURE_VALUE_GATE) {
      out.push_back({wrap(b, c, unit), false, "value gate", ""});
      out.back().rc.gv = true;
    }
    if (c.features & GLA_FEATURE_REVERSE) {
      out.push_back({wrap(b, c, unit), false, "reverse", ""});
      out.back().rc.reverse = true;
    }
  }
  return out;
}

std::vector<Probe> declined_probes(const gla_capability& c, int32_t unit) {
  std::vector<Probe> out;
  int32_t first = -1;
  for (int32_t dt : {GLA_DTYPE_F32, GLA_DTYPE_F16, GLA_DTYPE_BF16}) {
    if (c.dtype_mask & (1u << dt)) {
      Case b = base_case(c, unit, dt, 3);
      if (gate_dtype_fits(c, b) && first < 0) first = dt;
    }
  }
  if (first < 0) return out;
  Case b = base_case(c, unit, first, 9);
  gate_dtype_fits(c, b);
  auto add = [&](Case x, const std::string& label, const std::string& expect, bool strided = false) {
    out.push_back({wrap(x, c, unit), strided, label, expect});
  };
  for (int32_t dt : {GLA_DTYPE_F32, GLA_DTYPE_F16, GLA_DTYPE_BF16}) {
    if (c.dtype_mask & (1u << dt)) continue;
    Case x = b;
    x.dtype = dt;
    x.gate_f32 = true;
    add(x, std::string("undeclared dtype ") + gla::dtype_name(dt), std::string("dtype ") + gla::dtype_name(dt) + " not declared");
  }
  if (!(c.gate_dtype_mask & (1u << GLA_DTYPE_F32))) {
    Case x = b;
    x.gate_f32 = true;
    if (x.dtype != GLA_DTYPE_F32) add(x, "undeclared gate dtype float32", "dtype float32 not declared");
  }
  // One past each end of the declared K and V ranges (an open end has nothing past it).
  auto past = [&](int64_t Case::*width, const char* name, int64_t lo, int64_t hi) {
    for (const int64_t w : {hi > 0 ? hi + 1 : 0, lo > 1 ? lo - 1 : 0}) {
      if (w == 0) continue;
      Case x = b;
      x.*width = w;
      add(x, std::string(name) + " outside the declared range",
          std::string(name) + "=" + std::to_string(w) + " outside the declared");
    }
  };
  past(&Case::K, "K", c.k_min, c.k_max);
  past(&Case::V, "V", c.v_min, c.v_max);
  if (!(c.features & GLA_FEATURE_VARLEN)) {
    Case x = b;
    x.B = 1; x.cu_seqlens = {0, 13, 40};
    add(x, "varlen", "varlen not declared");
  }
  if (!recurrent(unit) && !(c.features & GLA_FEATURE_PER_HEAD_GATE)) {
    Case x = b;
    x.per_head_gate = true;
    add(x, "per-head gate", "per-head gate not declared");
  }
  if (!(c.features & GLA_FEATURE_INITIAL_STATE)) {
    Case x = b;
    x.initial_state = true;
    add(x, "initial_state", "initial_state not declared");
  }
  if (!(c.features & GLA_FEATURE_FINAL_STATE) && kind_of(unit) != Kind::kBackward) {
    Case x = b;
    x.final_state = true;
    add(x, "final_state", "final_state not declared");
  }
  if (!(c.features & GLA_FEATURE_STATE_V_FIRST)) {
    Case x = b;
    x.state_v_first = true;
    x.initial_state = true;
    add(x, "state_v_first", "state_v_first not declared");
  }
  if (c.layout & GLA_LAYOUT_LAST_DIM_CONTIGUOUS) add(b, "strided q", "q needs a contiguous last dimension (stride 1)", true);
  if (recurrent(unit) && !(c.features & GLA_FEATURE_VALUE_GATE)) {
    out.push_back({wrap(b, c, unit), false, "value gate", "value gate (gv) not declared"});
    out.back().rc.gv = true;
  }
  if (recurrent(unit) && !(c.features & GLA_FEATURE_REVERSE)) {
    out.push_back({wrap(b, c, unit), false, "reverse", "reverse not declared"});
    out.back().rc.reverse = true;
  }
  return out;
}

double error_against(const Result& got, const Result& want, int32_t unit) {
  std::string report;
  const bool backward = kind_of(unit) == Kind::kBackward || kind_of(unit) == Kind::kRecurrentBackward;
  double e = max_error(got.out, want.out, backward, report);
  if (report.empty()) return INFINITY;  // nothing compared
  if (!want.dgv.empty()) e = std::max(e, rel_rms(got.dgv, want.dgv));
  return e;
}

bool same_bits(const Result& a, const Result& b) {
  for (auto m : {&Outputs::o, &Outputs::ht, &Outputs::dq, &Outputs::dk, &Outputs::dv, &Outputs::dg, &Outputs::dh0}) {
    if ((a.out.*m).bytes != (b.out.*m).bytes) return false;
  }
  return a.dgv.bytes == b.dgv.bytes;
}

std::vector<std::string> backend_names() {
  std::vector<std::string> names;
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char* name = nullptr;
    int32_t available = 0;
    if (gla_backend_info(i, &name, nullptr, &available, nullptr) == GLA_STATUS_OK && available) names.push_back(name);
  }
  return names;
}

class Capabilities : public ::testing::Test {
 protected:
  void SetUp() override {
    static const gla_capability record = narrow_record();
    const gla_backend_desc d = narrow_desc(&record, 1);
    ASSERT_EQ(gla_register_backend(&d), GLA_STATUS_OK) << gla_last_error();
    // The vendor example, when the CTest ExamplePlugin.SDK has built it against the installed package.
    if (const char* plugin = std::getenv("GLA_EXAMPLE_STAGE_PLUGIN")) {
      ASSERT_EQ(gla_load_plugin(plugin), GLA_STATUS_OK) << gla_last_error();
    }
  }
  void TearDown() override {
    gla_unregister_backend("declared_narrow");
    if (std::getenv("GLA_EXAMPLE_STAGE_PLUGIN")) gla_unregister_backend("example_stage");
  }
};

TEST_F(Capabilities, EveryBackendAndUnitAcceptsItsDeclaredRangesAndDeclinesOutside) {
  int accepted = 0, declined = 0, skipped_records = 0;
  for (const std::string& name : backend_names()) {
    const gla_capability* records = nullptr;
    int32_t count = 0;
    ASSERT_EQ(gla_backend_capabilities(name.c_str(), &records, &count), GLA_STATUS_OK) << gla_last_error();
    ASSERT_GT(count, 0) << name << " declares nothing";
    for (int32_t r = 0; r < count; ++r) {
      const gla_capability& c = records[r];
      if (!(c.device_mask & (1ull << GLA_DEVICE_CPU))) {
        std::printf("[ note     ] %s record %d serves no host memory (device mask %llu): its device tests cover it\n",
                    name.c_str(), r, static_cast<unsigned long long>(c.device_mask));
        ++skipped_records;
        continue;
      }
      for (int32_t unit = 0; unit < GLA_UNIT_COUNT; ++unit) {
        if (!(c.unit_mask & (1ull << unit))) continue;
        const std::string where = name + " record " + std::to_string(r) + " " + gla_unit_name(unit);
        for (const Probe& p : accepted_probes(c, unit)) {
          const Result got = run_probe(p, unit, name);
          ASSERT_EQ(got.status, GLA_STATUS_OK) << where << ", " << p.label << " (" << p.rc.label() << "): " << got.error;
          // The reference runs the whole operation the unit belongs to.
          const int32_t whole = !gla::unit_is_stage(unit)                ? unit
                                : kind_of(unit) == Kind::kForward ? GLA_UNIT_CHUNK_FWD
                                                                  : GLA_UNIT_CHUNK_BWD;
          const Result want = run_probe(p, whole, "reference");
          ASSERT_EQ(want.status, GLA_STATUS_OK) << want.error;
          // Host tolerance of SPEC.md §5; the stage pipeline's fp32 intermediates add little at T = 40.
          EXPECT_LT(error_against(got, want, unit), host_tolerance(p.rc.base.dtype)) << where << ", " << p.label;
          if (c.deterministic && p.label.rfind("declared dtype", 0) == 0) {
            EXPECT_TRUE(same_bits(got, run_probe(p, unit, name))) << where << " declares determinism, " << p.label;
          }
          ++accepted;
        }
        for (const Probe& p : declined_probes(c, unit)) {
          const Result got = run_probe(p, unit, name);
          EXPECT_EQ(got.status, GLA_STATUS_NOT_SUPPORTED) << where << ", " << p.label << ": " << got.error;
          EXPECT_NE(got.error.find(p.expect), std::string::npos) << where << ", " << p.label << ": " << got.error;
          ++declined;
        }
      }
    }
  }
  std::printf("[ note     ] %d accepted and %d declined problems from the declarations (%d records without host memory)\n",
              accepted, declined, skipped_records);
  EXPECT_GT(accepted, 0);
  EXPECT_GT(declined, 0);
}

TEST_F(Capabilities, EveryReasonIsReportedNotOnlyTheFirst) {
  Case c;
  c.B = 1; c.T = 40; c.H = 2; c.K = 64; c.V = 32; c.dtype = GLA_DTYPE_F16; c.per_head_gate = true;
  c.cu_seqlens = {0, 20, 40};
  c.state_v_first = true;
  Inputs in = make_inputs(c);
  in.q = strided_copy(in.q);
  Outputs out;
  ASSERT_EQ(run_forward(in, out, {"declared_narrow"}), GLA_STATUS_NOT_SUPPORTED);
  const std::string why = gla_last_error();
  for (const char* phrase : {"dtype float16 not declared (declares float32,bfloat16)", "g dtype float16 not declared",
                             "K=64 outside the declared 8..32", "V=32 outside the declared 4..16", "varlen not declared",
                             "state_v_first not declared", "per-head gate not declared",
                             "q needs a contiguous last dimension (stride 1)"}) {
    EXPECT_NE(why.find(phrase), std::string::npos) << phrase << "\n" << why;
  }
}

TEST_F(Capabilities, ExplainPrintsEachDeclaration) {
  Case c;
  c.K = 16; c.V = 8;
  Inputs in = make_inputs(c);
  Outputs out;
  const gla_chunk_forward_args a = forward_args(in, out);
  const char* text = nullptr;
  ASSERT_EQ(gla_explain(&a, nullptr, nullptr, &text), GLA_STATUS_OK) << gla_last_error();
  const std::string t = text;
  EXPECT_NE(t.find("declares chunk_fwd on cpu: dtypes float32,bfloat16; gates float32; K 8..32; V 4..16; features "
                   "initial_state,final_state,per-key gate; layout last dim stride 1; deterministic"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("backend 'reference' (priority 1000): available, enabled\n    declares chunk_fwd,chunk_bwd,stages,"),
            std::string::npos)
      << t;
}

TEST(CapabilityRegistration, MalformedDeclarationsAreRefusedWithTheField) {
  gla_capability bad = narrow_record();
  bad.k_max = 4;  // below k_min
  gla_backend_desc d = narrow_desc(&bad, 1);
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("desc.capabilities[0]: expected 1 <= k_min <= k_max"), std::string::npos)
      << gla_last_error();
  bad = narrow_record();
  bad.dtype_mask = 1u << GLA_DTYPE_I32;
  d = narrow_desc(&bad, 1);
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("dtype_mask"), std::string::npos) << gla_last_error();
  const gla_capability good = narrow_record();
  d = narrow_desc(&good, 1);
  d.unit_mask |= 1ull << GLA_UNIT_CHUNK_BWD;  // not the records' union
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("expected the union of the capability records"), std::string::npos)
      << gla_last_error();
  d = narrow_desc(nullptr, 2);
  EXPECT_EQ(gla_register_backend(&d), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_FALSE(gla_backend_capabilities("declared_narrow", nullptr, nullptr) == GLA_STATUS_OK);
  const gla_capability* records = nullptr;
  int32_t count = 0;
  EXPECT_EQ(gla_backend_capabilities("no_such_backend", &records, &count), GLA_STATUS_INVALID_ARGUMENT);
}

}  // namespace
