// The reference backend's recurrent operator (gla.h: gla_recurrent_*): the token loop of SPEC.md §6
// in fp64, any gates (gk, gv, both, none), either order, varlen, the state pool. Forward and
// backward; the backward recomputes the states from checkpoints.
#include <cmath>
#include <vector>

#include "backends/reference/reference_backend.hpp"
#include "core/recurrent.hpp"

namespace gla {

namespace {

// States kept every kCheckpointEvery steps in the backward: K*V*(L/64 + 64) doubles per head.
constexpr int64_t kCheckpointEvery = 64;

struct RecurrentHead {
  const gla_problem& p;
  SequenceSpan span;
  int64_t head;
  int64_t state_index;  // into initial_state / final_state / dh0 / dht
  int64_t token(int64_t step) const { return span.start + recurrent_token(p, span.length, step); }
  double in(const gla_tensor& t, int64_t tok, int64_t i) const {
    return load_as_double(t, offset4(t, span.batch, tok, head, i));
  }
  double key_decay(int64_t tok, int64_t i) const { return present(p.g) ? std::exp(in(p.g, tok, i)) : 1.0; }
  double value_decay(int64_t tok, int64_t j) const { return present(p.gv) ? std::exp(in(p.gv, tok, j)) : 1.0; }
};

// S <- Diag(a) S Diag(b) + k v^T for token tok.
void step(const RecurrentHead& r, int64_t tok, std::vector<double>& S, std::vector<double>& a, std::vector<double>& b) {
  const int64_t K = r.p.K, V = r.p.V;
  for (int64_t i = 0; i < K; ++i) a[i] = r.key_decay(tok, i);
  for (int64_t j = 0; j < V; ++j) b[j] = r.value_decay(tok, j);
  for (int64_t i = 0; i < K; ++i) {
    const double ki = r.in(r.p.k, tok, i);
    for (int64_t j = 0; j < V; ++j) S[i * V + j] = a[i] * b[j] * S[i * V + j] + ki * r.in(r.p.v, tok, j);
  }
}

void load_state(const RecurrentHead& r, const gla_tensor& t, std::vector<double>& S) {
  std::fill(S.begin(), S.end(), 0.0);
  if (!present(t)) return;
  for (int64_t i = 0; i < r.p.K; ++i)
    for (int64_t j = 0; j < r.p.V; ++j) S[i * r.p.V + j] = load_as_double(t, state_offset(r.p, t, r.state_index, r.head, i, j));
}

void store_state(const RecurrentHead& r, const gla_tensor& t, const std::vector<double>& S) {
  for (int64_t i = 0; i < r.p.K; ++i)
    for (int64_t j = 0; j < r.p.V; ++j) store_from_double(t, state_offset(r.p, t, r.state_index, r.head, i, j), S[i * r.p.V + j]);
}

void forward_head(const RecurrentHead& r) {
  const gla_problem& p = r.p;
  const int64_t K = p.K, V = p.V;
  if (r.state_index < 0) {  // a skipped pool entry: zeros out, the pool untouched
    for (int64_t s = 0; s < r.span.length; ++s) {
      const int64_t tok = r.token(s);
      for (int64_t j = 0; j < V; ++j) store_from_double(p.o, offset4(p.o, r.span.batch, tok, r.head, j), 0.0);
      if (present(p.token_states))
        for (int64_t i = 0; i < K; ++i)
          for (int64_t j = 0; j < V; ++j) store_from_double(p.token_states, token_state_offset(p, r.span.batch, tok, r.head, i, j), 0.0);
    }
    return;
  }
  std::vector<double> S(static_cast<size_t>(K * V)), a(static_cast<size_t>(K)), b(static_cast<size_t>(V));
  load_state(r, p.initial_state, S);
  for (int64_t s = 0; s < r.span.length; ++s) {
    const int64_t tok = r.token(s);
    step(r, tok, S, a, b);
    for (int64_t j = 0; j < V; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < K; ++i) acc += r.in(p.q, tok, i) * S[i * V + j];
      store_from_double(p.o, offset4(p.o, r.span.batch, tok, r.head, j), p.scale * acc);
    }
    if (present(p.token_states))
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) store_from_double(p.token_states, token_state_offset(p, r.span.batch, tok, r.head, i, j), S[i * V + j]);
  }
  if (present(p.final_state)) store_state(r, p.final_state, S);
}

void backward_head(const RecurrentHead& r) {
  const gla_problem& p = r.p;
  const int64_t K = p.K, V = p.V, L = r.span.length, bt = r.span.batch, h = r.head;
  const size_t KV = static_cast<size_t>(K * V);
  std::vector<double> a(static_cast<size_t>(K)), b(static_cast<size_t>(V));
  const int64_t blocks = (L + kCheckpointEvery - 1) / kCheckpointEvery;
  std::vector<double> checkpoints(static_cast<size_t>(blocks) * KV), S(KV);
  load_state(r, p.initial_state, S);
  for (int64_t s = 0; s < L; ++s) {
    if (s % kCheckpointEvery == 0) std::copy(S.begin(), S.end(), checkpoints.begin() + (s / kCheckpointEvery) * KV);
    step(r, r.token(s), S, a, b);
  }
  std::vector<double> dS(KV, 0.0);
  load_state(r, p.dht, dS);
  std::vector<double> states(static_cast<size_t>(std::min(L, kCheckpointEvery) + 1) * KV);
  std::vector<double> dgk(static_cast<size_t>(K)), dgv(static_cast<size_t>(V));
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t s0 = blk * kCheckpointEvery, s1 = std::min(L, s0 + kCheckpointEvery);
    std::copy(checkpoints.begin() + blk * KV, checkpoints.begin() + (blk + 1) * KV, states.begin());
    for (int64_t s = s0; s < s1; ++s) {
      std::copy(states.begin() + (s - s0) * KV, states.begin() + (s - s0 + 1) * KV, S.begin());
      step(r, r.token(s), S, a, b);
      std::copy(S.begin(), S.end(), states.begin() + (s - s0 + 1) * KV);
    }
    for (int64_t s = s1 - 1; s >= s0; --s) {
      const int64_t tok = r.token(s);
      const double* S_t = &states[(s - s0 + 1) * KV];
      const double* S_prev = &states[(s - s0) * KV];
      for (int64_t i = 0; i < K; ++i) a[i] = r.key_decay(tok, i);
      for (int64_t j = 0; j < V; ++j) b[j] = r.value_decay(tok, j);
      auto dout = [&](int64_t j) { return present(p.do_) ? r.in(p.do_, tok, j) : 0.0; };
      if (present(p.dq)) {
        for (int64_t i = 0; i < K; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < V; ++j) acc += S_t[i * V + j] * dout(j);
          store_from_double(p.dq, offset4(p.dq, bt, tok, h, i), p.scale * acc);
        }
      }
      for (int64_t i = 0; i < K; ++i) {
        const double qi = p.scale * r.in(p.q, tok, i);
        for (int64_t j = 0; j < V; ++j) dS[i * V + j] += qi * dout(j);
      }
      if (present(p.dk)) {
        for (int64_t i = 0; i < K; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * r.in(p.v, tok, j);
          store_from_double(p.dk, offset4(p.dk, bt, tok, h, i), acc);
        }
      }
      if (present(p.dv)) {
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += dS[i * V + j] * r.in(p.k, tok, i);
          store_from_double(p.dv, offset4(p.dv, bt, tok, h, j), acc);
        }
      }
      // d(gk_i) = sum_j dS_ij a_i b_j S_prev_ij; d(gv_j) = sum_i of the same.
      std::fill(dgk.begin(), dgk.end(), 0.0);
      std::fill(dgv.begin(), dgv.end(), 0.0);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) {
          const double x = dS[i * V + j] * a[i] * b[j] * S_prev[i * V + j];
          dgk[i] += x;
          dgv[j] += x;
        }
      if (present(p.dg))
        for (int64_t i = 0; i < K; ++i) store_from_double(p.dg, offset4(p.dg, bt, tok, h, i), dgk[i]);
      if (present(p.dgv))
        for (int64_t j = 0; j < V; ++j) store_from_double(p.dgv, offset4(p.dgv, bt, tok, h, j), dgv[j]);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) dS[i * V + j] *= a[i] * b[j];
    }
  }
  if (present(p.dh0)) store_state(r, p.dh0, dS);
}

}  // namespace

void run_reference_recurrent(const gla_problem& p) {
  for_each_recurrent_head(p, [&](int64_t n, int64_t h, int64_t state_index) {
    const RecurrentHead r{p, sequence_span(p, n), h, state_index};
    if (p.unit == GLA_UNIT_RECURRENT_BWD) {
      backward_head(r);
    } else {
      forward_head(r);
    }
  });
}

}  // namespace gla
