// Extreme but legal inputs shared by the host and CUDA extreme-input tests
// (test_extreme_inputs.cpp, test_cuda_extremes.cpp): gates in [-1e4, 0] with exact zeros and -inf,
// q/k/v up to 1e4, K or V of 1, T = 1, varlen batches full of empty sequences, and a 10^6-token
// sequence checked against the recurrent reference run slice by slice.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace gla::test {

struct ExtremeCase {
  std::string name;
  Inputs in;
  // Finite gates below -104 mixed with mild ones: the stage pipeline's fp32 cumulative-gate buffer
  // (gla.h's gcum) then holds sums of magnitude up to 64 * 104 / ln 2 ~ 9600, whose fp32 ulp (~1e-3)
  // shows in the spans b_t - b_s after them (measured: rel 1e-5 .. 3e-5 against the fp64 reference).
  bool below_floor = false;
};

// Gates drawn from a mixture: exact 0 (no decay), -1e4 and -1e4·U (e^g underflows to 0 in fp32),
// -inf (hard reset; every key of every 23rd token, and single entries), the rest logsigmoid(U).
inline void fill_extreme_gates(HostTensor& g, int64_t T, int64_t H, int64_t gate_width, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < g.size(); ++i) {
    const int64_t token = i / (H * gate_width) % T;
    const double x = u(rng);
    double value = -std::log1p(std::exp(-u(rng)));
    if (token % 23 == 3 || x < 0.05) value = -inf;
    else if (x < 0.3) value = 0.0;
    else if (x < 0.4) value = -1e4;
    else if (x < 0.5) value = -1e4 * u(rng);
    g.set(i, value);
  }
}

inline void fill_all(HostTensor& t, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (int64_t i = 0; i < t.size(); ++i) t.set(i, d(rng));
}

inline Case extreme_base(int64_t B, int64_t T, int64_t H, int64_t K, int64_t V, uint64_t seed) {
  Case c;
  c.B = B; c.T = T; c.H = H; c.K = K; c.V = V; c.seed = seed;
  return c;
}

// The cases in `dtype` (fp32 unless a caller asks for 16-bit inputs).
inline std::vector<ExtremeCase> extreme_cases(int32_t dtype = GLA_DTYPE_F32) {
  std::vector<ExtremeCase> out;
  auto add = [&](std::string name, Case c, auto&& edit, bool below_floor = false) {
    c.dtype = dtype;
    Inputs in = make_inputs(c);
    edit(in);
    out.push_back({name + " (" + c.label() + ")", std::move(in), below_floor});
  };
  auto none = [](Inputs&) {};
  for (bool per_head : {false, true}) {
    Case c = extreme_base(2, 150, 2, 16, 8, per_head ? 302 : 301);
    c.per_head_gate = per_head;
    add(std::string("gates in [-1e4, 0] with zeros and -inf, ") + (per_head ? "per head" : "per key"), c,
        [&](Inputs& in) { fill_extreme_gates(in.g, c.T, c.H, per_head ? 1 : c.K, c.seed); }, true);
  }
  add("every gate -1e4", extreme_base(1, 130, 2, 16, 16, 303), [](Inputs& in) {
    for (int64_t i = 0; i < in.g.size(); ++i) in.g.set(i, -1e4);
  });
  add("every gate 0 (no decay)", extreme_base(1, 200, 1, 16, 8, 304), [](Inputs& in) {
    for (int64_t i = 0; i < in.g.size(); ++i) in.g.set(i, 0.0);
  });
  add("q, k, v uniform in [-1e4, 1e4]", extreme_base(2, 150, 2, 32, 16, 305), [](Inputs& in) {
    std::mt19937_64 rng(305);
    for (HostTensor* t : {&in.q, &in.k, &in.v}) fill_all(*t, rng, -1e4, 1e4);
  });
  add("q, k, v at +-1e4, gates 0, state 1e4", extreme_base(1, 100, 2, 16, 16, 306), [](Inputs& in) {
    std::mt19937_64 rng(306);
    for (HostTensor* t : {&in.q, &in.k, &in.v, &in.h0}) {
      for (int64_t i = 0; i < t->size(); ++i) t->set(i, (rng() & 1) ? 1e4 : -1e4);
    }
    for (int64_t i = 0; i < in.g.size(); ++i) in.g.set(i, 0.0);
  });
  add("K = 1", extreme_base(2, 100, 3, 1, 16, 307), none);
  add("V = 1", extreme_base(2, 100, 3, 16, 1, 308), none);
  add("K = V = 1, extreme gates", extreme_base(2, 100, 3, 1, 1, 309), [](Inputs& in) {
    fill_extreme_gates(in.g, 100, 3, 1, 309);
  }, true);
  add("T = 1", extreme_base(3, 1, 2, 16, 8, 310), none);
  Case one = extreme_base(1, 1, 2, 16, 8, 311);
  one.cu_seqlens = {0, 1};
  add("T = 1 varlen", one, none);
  Case empties = extreme_base(1, 100, 2, 16, 8, 312);
  empties.cu_seqlens = {0, 0, 0, 1, 1, 40, 40, 40, 41, 100, 100, 100};
  add("empty sequences throughout a varlen batch", empties, none);
  Case no_tokens = extreme_base(1, 0, 2, 16, 8, 314);
  no_tokens.cu_seqlens = {0, 0, 0};
  add("T = 0, every sequence empty", no_tokens, none);
  Case gaps = empties;
  gaps.seed = 313;
  gaps.initial_state = false;
  add("empty sequences, no initial state, extreme gates", gaps, [](Inputs& in) {
    fill_extreme_gates(in.g, 100, 2, 16, 313);
  }, true);
  return out;
}

// A view of tokens [t0, t0 + len) of a [B, T, H, *] tensor (B = 1).
inline gla_tensor token_slice(const gla_tensor& t, int64_t t0, int64_t len) {
  gla_tensor s = t;
  s.data = static_cast<char*>(t.data) + t0 * t.strides[1] * dtype_size(t.dtype);
  s.sizes[1] = len;
  return s;
}
// Row n of an [N, ...] tensor as a [1, ...] view.
inline gla_tensor row(const gla_tensor& t, int64_t n) {
  gla_tensor s = t;
  s.data = static_cast<char*>(t.data) + n * t.strides[0] * dtype_size(t.dtype);
  s.sizes[0] = 1;
  return s;
}

// The forward (o, final state) by the recurrent reference backend, one call per slice of at most
// `slice` tokens, each slice starting from the state the previous one ended in (per sequence of
// in.cu, or of the whole T when there is none; B must be 1). Returns the first failing status.
inline gla_status recurrent_reference_in_slices(const Inputs& in, int64_t slice, Outputs& out) {
  const Case& c = in.c;
  out.o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  poison(out.o);
  out.ht = HostTensor(GLA_DTYPE_F32, state_sizes(in));
  poison(out.ht);
  std::vector<int64_t> offsets = c.cu_seqlens.empty() ? std::vector<int64_t>{0, c.T} : c.cu_seqlens;
  HostTensor state(GLA_DTYPE_F32, {1, c.H, c.state_v_first ? c.V : c.K, c.state_v_first ? c.K : c.V});
  HostTensor next = state;
  gla_options o;
  gla_options_init(&o);
  o.backend = "reference";
  o.state_v_first = c.state_v_first;
  for (size_t n = 0; n + 1 < offsets.size(); ++n) {
    if (in.h0.empty()) {
      std::memset(state.bytes.data(), 0, state.bytes.size());
    } else {
      std::memcpy(state.bytes.data(), static_cast<const char*>(row(in.h0.t, static_cast<int64_t>(n)).data),
                  state.bytes.size());
    }
    for (int64_t t0 = offsets[n]; t0 < offsets[n + 1]; t0 += slice) {
      const int64_t len = std::min(slice, offsets[n + 1] - t0);
      const gla_tensor q = token_slice(in.q.t, t0, len), k = token_slice(in.k.t, t0, len),
                       v = token_slice(in.v.t, t0, len), g = token_slice(in.g.t, t0, len),
                       os = token_slice(out.o.t, t0, len);
      gla_recurrent_forward_args a{};
      a.q = &q;
      a.k = &k;
      a.v = &v;
      a.gk = &g;
      a.initial_state = &state.t;
      a.o = &os;
      a.final_state = &next.t;
      const gla_status s = gla_recurrent_forward(&a, &o);
      if (s != GLA_STATUS_OK) return s;
      std::swap(state.bytes, next.bytes);
      state.t.data = state.bytes.data();
      next.t.data = next.bytes.data();
    }
    std::memcpy(row(out.ht.t, static_cast<int64_t>(n)).data, state.bytes.data(), state.bytes.size());
  }
  return GLA_STATUS_OK;
}

// 10^6 tokens (by default) in three int64-offset sequences, one of them empty, H = 1, K = V = 4;
// weak decay (n = 1000: about 2000 tokens of memory) with a hard reset every 100003 tokens and a
// run of 10^4 exact-zero gates, so the state carries far.
inline Inputs long_sequence_inputs(int32_t dtype = GLA_DTYPE_F32, int64_t T = 1000000) {
  Case c = extreme_base(1, T, 1, 4, 4, 320);
  c.dtype = dtype;
  c.normaliser = 1000;
  c.cu_seqlens = {0, T / 4, T / 4, T};
  Inputs in = make_inputs(c);
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < c.K; ++j) {
      const int64_t i = t * c.K + j;
      if (t % 100003 == 50000) in.g.set(i, -inf);
      else if (t >= T / 2 && t < T / 2 + 10000) in.g.set(i, 0.0);
    }
  }
  return in;
}

}  // namespace gla::test
