// The recurrent operator (gla.h: gla_recurrent_*) on host memory: the cpu backend against the
// reference on the recurrent grid (forward and backward), the recurrent and chunked operators on the
// same inputs, the state pool (repeated, negative and out-of-range slots: skipped, flagged, nothing
// outside the pool written), token states, the slot check, validation, explain() and the CLI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gla/gla.hpp"
#include "recurrent_support.hpp"

namespace gla::test {
namespace {

double compare(const HostTensor& a, const HostTensor& b, const char* name, std::string& report) {
  if (a.empty() && b.empty()) return 0;
  EXPECT_FALSE(a.empty() || b.empty()) << name << " present in one run only";
  if (a.empty() || b.empty()) return 1;
  const double e = rel_rms(a, b);
  report += std::string(name) + ": " + std::to_string(e) + "\n";
  return e;
}

TEST(Recurrent, CpuMatchesReferenceOnGrid) {
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16}) {
    for (const RecurrentCase& c : recurrent_grid(dtype)) {
      SCOPED_TRACE(c.label());
      const RecurrentInputs r = make_recurrent_inputs(c);
      BothRuns b;
      run_against_reference(r, "cpu", b);
      if (HasFatalFailure()) return;
      const Outputs &ref = b.ref, &got = b.got;
      const HostTensor &ref_dgv = b.ref_dgv, &got_dgv = b.got_dgv;
      std::string report;
      double err = 0;
      err = std::max(err, compare(got.o, ref.o, "o", report));
      err = std::max(err, compare(got.ht, ref.ht, "final_state", report));
      err = std::max(err, compare(got.dq, ref.dq, "dq", report));
      err = std::max(err, compare(got.dk, ref.dk, "dk", report));
      err = std::max(err, compare(got.dv, ref.dv, "dv", report));
      err = std::max(err, compare(got.dg, ref.dg, "dgk", report));
      err = std::max(err, compare(got_dgv, ref_dgv, "dgv", report));
      err = std::max(err, compare(got.dh0, ref.dh0, "dh0", report));
      EXPECT_LT(err, host_tolerance(dtype)) << report;
      EXPECT_TRUE(all_finite(got.o) && all_finite(ref.o)) << "unwritten o";
    }
  }
}

// g = -inf is a hard reset (SPEC.md §3 rule 8): finite results, equal on cpu and reference.
TEST(Recurrent, InfiniteGatesResetTheState) {
  RecurrentCase c;
  c.base.B = 2; c.base.T = 20; c.base.H = 2; c.base.K = 16; c.base.V = 8; c.base.seed = 31;
  c.gv = true;
  RecurrentInputs r = make_recurrent_inputs(c);
  for (int64_t i = 0; i < r.in.g.size(); i += 5) r.in.g.set(i, -INFINITY);
  for (int64_t i = 0; i < r.gv.size(); i += 7) r.gv.set(i, -INFINITY);
  BothRuns b;
  run_against_reference(r, "cpu", b);
  if (HasFatalFailure()) return;
  for (const HostTensor* t : {&b.ref.o, &b.ref.ht, &b.ref.dq, &b.ref.dk, &b.ref.dv, &b.ref.dg, &b.ref_dgv, &b.ref.dh0}) {
    EXPECT_TRUE(all_finite(*t));
  }
  std::string report;
  EXPECT_LT(max_error(b.got, b.ref, true, report), host_tolerance(GLA_DTYPE_F32)) << report;
  EXPECT_LT(rel_rms(b.got_dgv, b.ref_dgv), host_tolerance(GLA_DTYPE_F32));
}

// gk only, in order: the recurrent operator is the chunked one (SPEC.md §1 and §6), for the
// reference and the cpu backend, forward and backward.
TEST(Recurrent, AgreesWithChunkedOperator) {
  std::vector<RecurrentCase> cases;
  for (const RecurrentCase& c : recurrent_grid(GLA_DTYPE_F32))
    if (c.gk && !c.gv && !c.reverse) cases.push_back(c);
  ASSERT_FALSE(cases.empty());
  for (const RecurrentCase& c : cases) {
    for (const char* backend : {"reference", "cpu"}) {
      SCOPED_TRACE(c.label() + " on " + backend);
      const RecurrentInputs r = make_recurrent_inputs(c);
      Outputs chunk, rec;
      HostTensor dgv;
      ASSERT_EQ(run_forward(r.in, chunk, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
      ASSERT_EQ(run_backward(r.in, chunk, RunOptions{"reference"}), GLA_STATUS_OK) << gla_last_error();
      ASSERT_EQ(run_recurrent_forward(r, rec, backend), GLA_STATUS_OK) << gla_last_error();
      ASSERT_EQ(run_recurrent_backward(r, rec, dgv, backend), GLA_STATUS_OK) << gla_last_error();
      std::string report;
      const double err = max_error(rec, chunk, true, report);
      EXPECT_LT(err, host_tolerance(GLA_DTYPE_F32)) << report;
    }
  }
}

// ---- the state pool ----
struct PoolRun {
  HostTensor storage;  // guard rows, the pool, guard rows
  gla_tensor pool{};
  HostTensor slots, error, o, token_states;
};

constexpr int64_t kGuard = 2;

// B sequences of T tokens on a pool of P states with kGuard guard states before and after it.
PoolRun make_pool(const RecurrentInputs& r, int64_t P, const std::vector<int32_t>& slots, bool token_states) {
  const Case& c = r.c.base;
  PoolRun p;
  const int64_t R = c.state_v_first ? c.V : c.K, C = c.state_v_first ? c.K : c.V;
  p.storage = HostTensor(GLA_DTYPE_F32, {P + 2 * kGuard, c.H, R, C});
  std::mt19937_64 rng(99);
  fill_normal(p.storage, rng);
  p.pool = p.storage.t;
  p.pool.sizes[0] = P;
  p.pool.data = static_cast<float*>(p.storage.t.data) + kGuard * c.H * R * C;
  p.slots = HostTensor(GLA_DTYPE_I32, {static_cast<int64_t>(slots.size())});
  std::memcpy(p.slots.t.data, slots.data(), slots.size() * 4);
  p.error = HostTensor(GLA_DTYPE_I32, {1});  // zero-filled
  p.o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  poison(p.o);
  if (token_states) {
    p.token_states = HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, R, C});
    poison(p.token_states);
  }
  return p;
}

gla_status run_update(const RecurrentInputs& r, PoolRun& p, const std::string& backend, bool check_slots = false) {
  gla_recurrent_state_update_args a{};
  a.q = &r.in.q.t;
  a.k = &r.in.k.t;
  a.v = &r.in.v.t;
  a.gk = r.c.gk ? &r.in.g.t : nullptr;
  a.gv = r.c.gv ? &r.gv.t : nullptr;
  a.state_pool = &p.pool;
  a.state_slots = &p.slots.t;
  a.slot_error = &p.error.t;
  a.o = &p.o.t;
  a.token_states = p.token_states.desc();
  a.check_slots = check_slots;
  const gla_options o = recurrent_options(r, backend);
  return gla_recurrent_state_update(&a, &o);
}

// What the pool update must give: for each sequence b with a usable slot, the recurrent forward
// from pool[slot] (state after its last token written back); skipped sequences o = 0.
void check_pool_update(const RecurrentCase& c, int64_t P, const std::vector<int32_t>& slots, int32_t expected_error,
                       bool token_states, const std::string& backend) {
  SCOPED_TRACE(c.label() + " on " + backend + (token_states ? " with token states" : ""));
  const RecurrentInputs r = make_recurrent_inputs(c);
  PoolRun p = make_pool(r, P, slots, token_states);
  const HostTensor before = p.storage;
  ASSERT_EQ(run_update(r, p, backend), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(static_cast<int32_t>(p.error.get(0)), expected_error);

  const Case& b = c.base;
  const int64_t state_elems = b.H * b.K * b.V;
  std::vector<bool> used(static_cast<size_t>(P), false);
  std::vector<int64_t> owner(static_cast<size_t>(P), -1);
  for (int64_t n = 0; n < b.B; ++n) {
    const int32_t s = slots[static_cast<size_t>(n)];
    const bool ok = s >= 0 && s < P && !used[static_cast<size_t>(s)];
    if (ok) {
      used[static_cast<size_t>(s)] = true;
      owner[static_cast<size_t>(s)] = n;
    }
    // The expected result of sequence n: a one-sequence recurrent forward from its slot's state.
    RecurrentCase one = c;
    one.base.B = 1;
    RecurrentInputs single = make_recurrent_inputs(one);
    auto slice = [&](const HostTensor& from, HostTensor& to) {
      const int64_t per = from.size() / b.B;
      for (int64_t i = 0; i < per; ++i) to.set(i, from.get(n * per + i));
    };
    slice(r.in.q, single.in.q);
    slice(r.in.k, single.in.k);
    slice(r.in.v, single.in.v);
    if (c.gk) slice(r.in.g, single.in.g);
    if (c.gv) slice(r.gv, single.gv);
    single.in.h0 = HostTensor(GLA_DTYPE_F32, state_sizes(single.in));
    if (ok) {
      for (int64_t i = 0; i < state_elems; ++i) single.in.h0.set(i, before.get((kGuard + s) * state_elems + i));
    }
    Outputs want;
    ASSERT_EQ(run_recurrent_forward(single, want, "reference"), GLA_STATUS_OK) << gla_last_error();
    const int64_t per_o = b.T * b.H * b.V;
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < per_o; ++i) {
      const double g = p.o.get(n * per_o + i), w = ok ? want.o.get(i) : 0.0;
      ASSERT_TRUE(std::isfinite(g)) << "o of sequence " << n << " not written at " << i;
      diff += (g - w) * (g - w);
      norm += w * w;
    }
    if (ok) {
      EXPECT_LT(std::sqrt(diff / norm), host_tolerance(b.dtype)) << "o of sequence " << n;
    } else {
      EXPECT_EQ(diff, 0.0) << "skipped sequence " << n << " must have o = 0";
    }
    if (ok && !token_states) {
      double d = 0, nn = 0;
      for (int64_t i = 0; i < state_elems; ++i) {
        const double g = p.storage.get((kGuard + s) * state_elems + i), w = want.ht.get(i);
        d += (g - w) * (g - w);
        nn += w * w;
      }
      EXPECT_LT(std::sqrt(d / nn), host_tolerance(GLA_DTYPE_F32)) << "pool slot " << s;
    }
    if (token_states) {
      const int64_t per_ts = b.T * state_elems;
      const int64_t last = (b.T - 1) * state_elems;  // token T-1: the state after the last token
      double d = 0, nn = 0;
      for (int64_t i = 0; i < state_elems; ++i) {
        const int64_t hh = i / (b.K * b.V), rest = i % (b.K * b.V);
        const double g = p.token_states.get(n * per_ts + last + hh * b.K * b.V + rest);
        const double w = ok ? want.ht.get(i) : 0.0;
        ASSERT_TRUE(std::isfinite(g)) << "token state not written";
        d += (g - w) * (g - w);
        nn += w * w;
      }
      if (ok) {
        EXPECT_LT(std::sqrt(d / nn), host_tolerance(GLA_DTYPE_F32));
      } else {
        EXPECT_EQ(d, 0.0);
      }
    }
  }
  // Nothing outside the pool changes; pool entries nobody (validly) owns are untouched; with token
  // states the pool is read only.
  for (int64_t s = -kGuard; s < P + kGuard; ++s) {
    const bool written = s >= 0 && s < P && owner[static_cast<size_t>(s)] >= 0 && !token_states;
    if (written) continue;
    for (int64_t i = 0; i < state_elems; ++i) {
      const int64_t at = (kGuard + s) * state_elems + i;
      ASSERT_EQ(p.storage.get(at), before.get(at)) << "state " << s << " changed at " << i;
    }
  }
}

RecurrentCase pool_case(bool gk, bool gv, bool v_first, int64_t T, int32_t dtype = GLA_DTYPE_F32) {
  RecurrentCase c;
  c.base.B = 6;
  c.base.T = T;
  c.base.H = 2;
  c.base.K = 16;
  c.base.V = 24;
  c.base.dtype = dtype;
  c.base.state_v_first = v_first;
  c.base.seed = 11 + static_cast<uint64_t>(T);
  c.gk = gk;
  c.gv = gv;
  return c;
}

TEST(RecurrentStatePool, UpdatesInPlaceAndSkipsBadSlots) {
  const int64_t P = 8;
  for (const char* backend : {"reference", "cpu"}) {
    for (bool v_first : {false, true}) {
      for (int64_t T : {1, 3}) {
        // slots: ok, ok, negative, repeated (of 5), out of range, ok
        check_pool_update(pool_case(true, true, v_first, T), P, {5, 0, -1, 5, 8, 7},
                          GLA_SLOT_ERROR_OUT_OF_RANGE | GLA_SLOT_ERROR_REPEATED, false, backend);
        check_pool_update(pool_case(true, false, v_first, T), P, {3, 1, 4, 0, 6, 2}, 0, false, backend);
        check_pool_update(pool_case(false, true, v_first, T), P, {2, 2, 2, 1, 0, 7}, GLA_SLOT_ERROR_REPEATED, false, backend);
        check_pool_update(pool_case(true, true, v_first, T, GLA_DTYPE_BF16), P, {7, 6, 5, 4, 100000, 3},
                          GLA_SLOT_ERROR_OUT_OF_RANGE, false, backend);
      }
    }
  }
}

TEST(RecurrentStatePool, TokenStatesLeaveThePoolUnchanged) {
  for (const char* backend : {"reference", "cpu"}) {
    for (bool v_first : {false, true}) {
      check_pool_update(pool_case(true, true, v_first, 4), 8, {1, 0, 3, -4, 5, 6}, GLA_SLOT_ERROR_OUT_OF_RANGE, true, backend);
    }
  }
}

TEST(RecurrentStatePool, FlagAccumulatesAndIsNeverCleared) {
  const RecurrentInputs r = make_recurrent_inputs(pool_case(true, false, false, 1));
  PoolRun p = make_pool(r, 8, {0, 1, 2, 3, 4, 5}, false);
  const int32_t earlier = GLA_SLOT_ERROR_REPEATED;  // left by an earlier step
  std::memcpy(p.error.t.data, &earlier, 4);
  ASSERT_EQ(run_update(r, p, "cpu"), GLA_STATUS_OK) << gla_last_error();
  EXPECT_EQ(static_cast<int32_t>(p.error.get(0)), GLA_SLOT_ERROR_REPEATED);
}

TEST(RecurrentStatePool, CheckSlotsRaisesBeforeWriting) {
  const RecurrentInputs r = make_recurrent_inputs(pool_case(true, true, false, 1));
  for (const auto& [slots, needle] : std::vector<std::pair<std::vector<int32_t>, std::string>>{
           {{0, 1, 2, -1, 4, 5}, "got -1 at index 3"},
           {{0, 1, 2, 3, 4, 8}, "got 8 at index 5"},
           {{0, 1, 2, 1, 4, 5}, "slot 1 at indices 1 and 3"}}) {
    PoolRun p = make_pool(r, 8, slots, false);
    const HostTensor before = p.storage;
    EXPECT_EQ(run_update(r, p, "cpu", true), GLA_STATUS_INVALID_ARGUMENT);
    const std::string message = gla_last_error();
    EXPECT_NE(message.find("state_slots"), std::string::npos) << message;
    EXPECT_NE(message.find(needle), std::string::npos) << message;
    EXPECT_EQ(std::memcmp(before.t.data, p.storage.t.data, before.bytes.size()), 0) << "pool written";
    EXPECT_FALSE(all_finite(p.o)) << "o written (expected still NaN-poisoned)";
    EXPECT_EQ(p.error.get(0), 0.0);
  }
  PoolRun good = make_pool(r, 8, {0, 1, 2, 3, 4, 5}, false);
  EXPECT_EQ(run_update(r, good, "cpu", true), GLA_STATUS_OK) << gla_last_error();
}

// ---- validation (SPEC.md §4): the argument, what was expected, what was given; nothing written ----
TEST(RecurrentValidation, BadInputsAreNamed) {
  RecurrentCase c = pool_case(true, true, false, 3);
  c.base.B = 2;
  const RecurrentInputs r = make_recurrent_inputs(c);
  Outputs out;
  out.o = HostTensor(c.base.dtype, {2, 3, 2, 24});
  poison(out.o);
  auto forward = [&](auto mutate) {
    gla_recurrent_forward_args a{};
    a.q = &r.in.q.t;
    a.k = &r.in.k.t;
    a.v = &r.in.v.t;
    a.gk = &r.in.g.t;
    a.gv = &r.gv.t;
    a.o = &out.o.t;
    mutate(a);
    const gla_status s = gla_recurrent_forward(&a, nullptr);
    EXPECT_FALSE(all_finite(out.o)) << "o written on bad input";
    return std::make_pair(s, std::string(gla_last_error()));
  };
  HostTensor wrong_gv(GLA_DTYPE_F32, {2, 3, 2, 16});
  auto [s1, m1] = forward([&](gla_recurrent_forward_args& a) { a.gv = &wrong_gv.t; });
  EXPECT_EQ(s1, GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(m1.find("gv: expected shape [2, 3, 2, 24]"), std::string::npos) << m1;
  EXPECT_NE(m1.find("got [2, 3, 2, 16]"), std::string::npos) << m1;
  HostTensor wrong_gk(GLA_DTYPE_F32, {2, 3, 2});
  auto [s2, m2] = forward([&](gla_recurrent_forward_args& a) { a.gk = &wrong_gk.t; });
  EXPECT_EQ(s2, GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(m2.find("gk: expected shape [2, 3, 2, 16]"), std::string::npos) << m2;
  auto [s3, m3] = forward([&](gla_recurrent_forward_args& a) { a.reverse = 2; });
  EXPECT_EQ(s3, GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(m3.find("reverse: expected 0 or 1, got 2"), std::string::npos) << m3;
  HostTensor h0_wrong(GLA_DTYPE_F32, {3, 2, 16, 24});
  auto [s4, m4] = forward([&](gla_recurrent_forward_args& a) { a.initial_state = &h0_wrong.t; });
  EXPECT_EQ(s4, GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(m4.find("initial_state: expected shape [2, 2, 16, 24]"), std::string::npos) << m4;

  // Backward: a gate gradient without its gate.
  HostTensor dq(c.base.dtype, {2, 3, 2, 16}), dgv(GLA_DTYPE_F32, {2, 3, 2, 24});
  poison(dq);
  gla_recurrent_backward_args b{};
  b.q = &r.in.q.t;
  b.k = &r.in.k.t;
  b.v = &r.in.v.t;
  b.gk = &r.in.g.t;
  b.dq = &dq.t;
  b.dgv = &dgv.t;
  EXPECT_EQ(gla_recurrent_backward(&b, nullptr), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("dgv: given without gv"), std::string::npos) << gla_last_error();
  EXPECT_FALSE(all_finite(dq));

  // State update: slot dtype, a missing flag, token states of the wrong shape.
  PoolRun p = make_pool(r, 4, {0, 1}, false);
  HostTensor slots64(GLA_DTYPE_I64, {2});
  gla_recurrent_state_update_args u{};
  u.q = &r.in.q.t;
  u.k = &r.in.k.t;
  u.v = &r.in.v.t;
  u.state_pool = &p.pool;
  u.state_slots = &slots64.t;
  u.slot_error = &p.error.t;
  u.o = &p.o.t;
  EXPECT_EQ(gla_recurrent_state_update(&u, nullptr), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("state_slots: expected dtype int32, got int64"), std::string::npos)
      << gla_last_error();
  u.state_slots = &p.slots.t;
  u.slot_error = nullptr;
  EXPECT_EQ(gla_recurrent_state_update(&u, nullptr), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("slot_error: required tensor is missing"), std::string::npos);
  u.slot_error = &p.error.t;
  HostTensor ts(GLA_DTYPE_F32, {2, 3, 2, 24, 16});
  u.token_states = &ts.t;
  EXPECT_EQ(gla_recurrent_state_update(&u, nullptr), GLA_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(gla_last_error()).find("token_states: expected shape [2, 3, 2, 16, 24]"), std::string::npos)
      << gla_last_error();
  EXPECT_FALSE(all_finite(p.o));
}

TEST(RecurrentExplain, ShowsUnitsAndDecision) {
  const RecurrentInputs r = make_recurrent_inputs(pool_case(true, true, true, 1));
  gla_recurrent_forward_args a{};
  a.q = &r.in.q.t;
  a.k = &r.in.k.t;
  a.v = &r.in.v.t;
  a.gk = &r.in.g.t;
  a.gv = &r.gv.t;
  a.reverse = 1;
  const std::string text = gla::explain(a, gla::Options().state_v_first());
  EXPECT_NE(text.find("recurrent_fwd"), std::string::npos) << text;
  EXPECT_NE(text.find("gv=float32 reverse"), std::string::npos) << text;
  EXPECT_NE(text.find("decision: cpu"), std::string::npos) << text;

  PoolRun p = make_pool(r, 8, {0, 1, 2, 3, 4, 5}, false);
  gla_recurrent_state_update_args u{};
  u.q = &r.in.q.t;
  u.k = &r.in.k.t;
  u.v = &r.in.v.t;
  u.state_pool = &p.pool;
  u.state_slots = &p.slots.t;
  u.slot_error = &p.error.t;
  const std::string pool_text = gla::explain(u, gla::Options().state_v_first().backend("reference"));
  EXPECT_NE(pool_text.find("state_pool P=8 [P,H,V,K] (updated in place)"), std::string::npos) << pool_text;
  EXPECT_NE(pool_text.find("decision: reference"), std::string::npos) << pool_text;
}

}  // namespace
}  // namespace gla::test

namespace gla::test {
namespace {

std::string run_cli(const std::string& arguments) {
  std::string out;
  FILE* pipe = popen((std::string(GLA_CLI) + " " + arguments + " 2>&1").c_str(), "r");
  if (!pipe) return out;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe)) out += buffer;
  pclose(pipe);
  return out;
}

TEST(RecurrentCli, RunAndExplainTheRecurrentOperator) {
  const std::string run = run_cli("run --op recurrent --B 1 --T 9 --H 2 --K 8 --V 12 --gv --reverse --repeat 1");
  EXPECT_NE(run.find("problem: recurrent"), std::string::npos) << run;
  EXPECT_NE(run.find("dgv"), std::string::npos) << run;
  EXPECT_NE(run.find("PASS"), std::string::npos) << run;
  const std::string explain = run_cli("explain --op recurrent --backward --no-gk --gv --B 1 --T 3 --H 1 --K 8 --V 8");
  EXPECT_NE(explain.find("recurrent_bwd B=1 T=3 H=1 K=8 V=8 N=1 dtype=float32 gk=none gv=float32"), std::string::npos)
      << explain;
  EXPECT_NE(explain.find("decision: cpu"), std::string::npos) << explain;
  EXPECT_NE(run_cli("run --gv").find("need --op recurrent"), std::string::npos);
}

}  // namespace
}  // namespace gla::test
