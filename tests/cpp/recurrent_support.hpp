// Helpers for the recurrent operator's tests (test_recurrent*.cpp): inputs with optional gk and gv,
// and forward / backward / state-update calls through the public C API on host tensors.
#pragma once

#include <string>
#include <vector>

#include "test_support.hpp"

namespace gla::test {

struct RecurrentCase {
  Case base;               // B, T, H, K, V, dtype, initial/final state, layout, varlen, seed
  bool gk = true;          // key gate (in Inputs::g)
  bool gv = false;         // value gate
  bool reverse = false;
  double scale = 0.0;      // 0: the default K^-0.5
  std::string label() const {
    return base.label() + (gk ? " gk" : " no-gk") + (gv ? " gv" : "") + (reverse ? " reverse" : "") +
           (scale != 0.0 ? " scale=" + std::to_string(scale) : "");
  }
};

struct RecurrentInputs {
  RecurrentCase c;
  Inputs in;  // q, k, v, g (= gk), h0, cu, dout, dht
  HostTensor gv;
};

inline RecurrentInputs make_recurrent_inputs(const RecurrentCase& c) {
  RecurrentInputs r;
  r.c = c;
  r.in = make_inputs(c.base);
  if (c.gv) {
    std::mt19937_64 rng(c.base.seed * 104729 + 5);
    r.gv = HostTensor(c.base.gate_f32 ? GLA_DTYPE_F32 : c.base.dtype, {c.base.B, c.base.T, c.base.H, c.base.V});
    fill_gate(r.gv, rng, c.base.normaliser);
  }
  return r;
}

inline gla_options recurrent_options(const RecurrentInputs& r, const std::string& backend) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = r.c.base.state_v_first;
  o.backend = backend.empty() ? nullptr : backend.c_str();
  if (r.c.scale != 0.0) {
    o.has_scale = 1;
    o.scale = r.c.scale;
  }
  return o;
}

// The inputs every recurrent call struct shares (forward and backward args).
template <class Args>
void set_recurrent_inputs(const RecurrentInputs& r, Args& a) {
  a.q = &r.in.q.t;
  a.k = &r.in.k.t;
  a.v = &r.in.v.t;
  a.gk = r.c.gk ? &r.in.g.t : nullptr;
  a.gv = r.c.gv ? &r.gv.t : nullptr;
  a.initial_state = r.in.h0.desc();
  a.cu_seqlens = r.in.cu.desc();
  a.reverse = r.c.reverse;
}

// Forward on fresh NaN-poisoned o (and ht when the case has a final state).
inline gla_status run_recurrent_forward(const RecurrentInputs& r, Outputs& out, const std::string& backend) {
  const Case& c = r.c.base;
  out.o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  poison(out.o);
  if (c.final_state) {
    out.ht = HostTensor(GLA_DTYPE_F32, state_sizes(r.in));
    poison(out.ht);
  }
  gla_recurrent_forward_args a{};
  set_recurrent_inputs(r, a);
  a.o = &out.o.t;
  a.final_state = out.ht.desc();
  const gla_options o = recurrent_options(r, backend);
  return gla_recurrent_forward(&a, &o);
}

// Fresh NaN-poisoned gradients of the case: dq, dk, dv; dg (= dgk) with gk, `dgv` with gv, dh0 with
// an initial state. dgk, dgv in `gate_dtype` (-1: float32).
inline void make_recurrent_gradients(const RecurrentInputs& r, Outputs& out, HostTensor& dgv, int32_t gate_dtype = -1) {
  const Case& c = r.c.base;
  const int32_t gd = gate_dtype < 0 ? GLA_DTYPE_F32 : gate_dtype;
  out.dq = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  out.dk = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  out.dv = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  for (HostTensor* t : {&out.dq, &out.dk, &out.dv}) poison(*t);
  out.dg = r.c.gk ? HostTensor(gd, {c.B, c.T, c.H, c.K}) : HostTensor();
  dgv = r.c.gv ? HostTensor(gd, {c.B, c.T, c.H, c.V}) : HostTensor();
  out.dh0 = r.in.h0.empty() ? HostTensor() : HostTensor(GLA_DTYPE_F32, state_sizes(r.in));
  for (HostTensor* t : {&out.dg, &dgv, &out.dh0})
    if (!t->empty()) poison(*t);
}

// Backward on fresh NaN-poisoned gradients; dg holds dgk (with gk), dgv goes to `dgv`.
inline gla_status run_recurrent_backward(const RecurrentInputs& r, Outputs& out, HostTensor& dgv,
                                         const std::string& backend) {
  const Case& c = r.c.base;
  make_recurrent_gradients(r, out, dgv);
  gla_recurrent_backward_args a{};
  set_recurrent_inputs(r, a);
  a.do_ = &r.in.dout.t;
  a.dht = c.final_state ? &r.in.dht.t : nullptr;
  a.dq = &out.dq.t;
  a.dk = &out.dk.t;
  a.dv = &out.dv.t;
  a.dgk = out.dg.desc();
  a.dgv = dgv.desc();
  a.dh0 = out.dh0.desc();
  const gla_options o = recurrent_options(r, backend);
  return gla_recurrent_backward(&a, &o);
}

// Forward and backward of one case on the reference and on `backend` (asserting success).
struct BothRuns {
  Outputs ref, got;
  HostTensor ref_dgv, got_dgv;
};
inline void run_against_reference(const RecurrentInputs& r, const std::string& backend, BothRuns& b) {
  ASSERT_EQ(run_recurrent_forward(r, b.ref, "reference"), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_recurrent_forward(r, b.got, backend), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_recurrent_backward(r, b.ref, b.ref_dgv, "reference"), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(run_recurrent_backward(r, b.got, b.got_dgv, backend), GLA_STATUS_OK) << gla_last_error();
}

// The recurrent grid (SPEC.md §5 style, trimmed to a CPU test budget): every gate combination,
// both orders, varlen with empty and length-1 sequences, both state layouts, with and without an
// initial state, K != V.
inline std::vector<RecurrentCase> recurrent_grid(int32_t dtype) {
  std::vector<RecurrentCase> cases;
  auto add = [&](Case b) {
    b.dtype = dtype;
    for (int gates = 0; gates < 4; ++gates) {
      for (bool reverse : {false, true}) {
        RecurrentCase c;
        c.base = b;
        c.base.seed = b.seed * 16 + static_cast<uint64_t>(gates * 2 + reverse);
        c.gk = gates & 1;
        c.gv = gates & 2;
        c.reverse = reverse;
        cases.push_back(c);
      }
    }
  };
  Case a;
  a.B = 2; a.T = 37; a.H = 2; a.K = 32; a.V = 48; a.seed = 1;
  add(a);
  Case b = a;
  b.state_v_first = true; b.initial_state = false; b.seed = 2;
  add(b);
  Case v;
  v.B = 1; v.T = 40; v.H = 2; v.K = 16; v.V = 24; v.cu_seqlens = {0, 0, 1, 17, 17, 40}; v.seed = 3;
  add(v);
  Case s = a;
  s.T = 130; s.K = 64; s.V = 32; s.normaliser = 0.1; s.randn_inputs = true; s.seed = 4;  // crosses checkpoints
  add(s);
  return cases;
}

}  // namespace gla::test
