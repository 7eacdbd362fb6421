// The `reference` backend: the oracle. The token loop of SPEC.md §1 in fp64, forward and backward,
// for any valid host-memory input; slow on purpose, never wrong, never declines. The stages of the
// chunked algorithm live in reference_stages.cpp.
#include "backends/reference/reference_backend.hpp"

#include <cmath>
#include <vector>

#include "core/capabilities.hpp"
#include "core/parallel.hpp"

namespace gla {

namespace {

// Steps between stored states in the backward pass: memory K*V*(T/64 + 64) doubles per head
// instead of K*V*T.
constexpr int64_t kCheckpointEvery = 64;

struct HeadView {
  const gla_problem& p;
  SequenceSpan span;
  int64_t head;
  double in(const gla_tensor& t, int64_t step, int64_t i) const {
    return load_as_double(t, offset4(t, span.batch, span.start + step, head, i));
  }
  double gate(int64_t step, int64_t i) const {
    return load_as_double(p.g, gate_offset(p, span.batch, span.start + step, head, i));
  }
  double state_in(const gla_tensor& t, int64_t n, int64_t i, int64_t j) const {
    return load_as_double(t, state_offset(p, t, n, head, i, j));
  }
};

// S <- Diag(exp(g_t)) S + k_t v_t^T
void step_state(const HeadView& hv, int64_t t, std::vector<double>& S, std::vector<double>& decay) {
  const int64_t K = hv.p.K, V = hv.p.V;
  for (int64_t i = 0; i < K; ++i) decay[i] = std::exp(hv.gate(t, i));
  for (int64_t i = 0; i < K; ++i) {
    const double ki = hv.in(hv.p.k, t, i);
    double* row = &S[i * V];
    for (int64_t j = 0; j < V; ++j) row[j] = decay[i] * row[j] + ki * hv.in(hv.p.v, t, j);
  }
}

void load_initial(const HeadView& hv, int64_t n, std::vector<double>& S) {
  const int64_t K = hv.p.K, V = hv.p.V;
  std::fill(S.begin(), S.end(), 0.0);
  if (!present(hv.p.initial_state)) return;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) S[i * V + j] = hv.state_in(hv.p.initial_state, n, i, j);
}

void store_state(const HeadView& hv, const gla_tensor& out, int64_t n, const std::vector<double>& S) {
  const int64_t K = hv.p.K, V = hv.p.V;
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < V; ++j) store_from_double(out, state_offset(hv.p, out, n, hv.head, i, j), S[i * V + j]);
}

void forward_head(const gla_problem& p, int64_t n, int64_t h) {
  const HeadView hv{p, sequence_span(p, n), h};
  const int64_t K = p.K, V = p.V;
  std::vector<double> S(static_cast<size_t>(K * V)), decay(static_cast<size_t>(K)), q(static_cast<size_t>(K));
  load_initial(hv, n, S);
  for (int64_t t = 0; t < hv.span.length; ++t) {
    step_state(hv, t, S, decay);
    for (int64_t i = 0; i < K; ++i) q[i] = hv.in(p.q, t, i);
    for (int64_t j = 0; j < V; ++j) {
      double acc = 0;
      for (int64_t i = 0; i < K; ++i) acc += q[i] * S[i * V + j];
      store_from_double(p.o, offset4(p.o, hv.span.batch, hv.span.start + t, h, j), p.scale * acc);
    }
  }
  if (present(p.final_state)) store_state(hv, p.final_state, n, S);
}

void backward_head(const gla_problem& p, int64_t n, int64_t h) {
  const HeadView hv{p, sequence_span(p, n), h};
  const int64_t K = p.K, V = p.V, L = hv.span.length;
  const size_t KV = static_cast<size_t>(K * V);
  std::vector<double> decay(static_cast<size_t>(K));

  // Forward once, keeping the state before every kCheckpointEvery-th step.
  const int64_t blocks = (L + kCheckpointEvery - 1) / kCheckpointEvery;
  std::vector<double> checkpoints(static_cast<size_t>(blocks) * KV);
  std::vector<double> S(KV);
  load_initial(hv, n, S);
  for (int64_t t = 0; t < L; ++t) {
    if (t % kCheckpointEvery == 0) std::copy(S.begin(), S.end(), checkpoints.begin() + (t / kCheckpointEvery) * KV);
    step_state(hv, t, S, decay);
  }

  std::vector<double> dS(KV, 0.0);
  if (present(p.dht)) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) dS[i * V + j] = hv.state_in(p.dht, n, i, j);
  }
  std::vector<double> states(static_cast<size_t>(kCheckpointEvery + 1) * KV);
  std::vector<double> q(static_cast<size_t>(K)), k(static_cast<size_t>(K)), v(static_cast<size_t>(V)),
      dout(static_cast<size_t>(V)), dgate(static_cast<size_t>(K));
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t t0 = blk * kCheckpointEvery, t1 = std::min(L, t0 + kCheckpointEvery);
    std::copy(checkpoints.begin() + blk * KV, checkpoints.begin() + (blk + 1) * KV, states.begin());
    for (int64_t t = t0; t < t1; ++t) {
      std::copy(states.begin() + (t - t0) * KV, states.begin() + (t - t0 + 1) * KV, S.begin());
      step_state(hv, t, S, decay);
      std::copy(S.begin(), S.end(), states.begin() + (t - t0 + 1) * KV);
    }
    for (int64_t t = t1 - 1; t >= t0; --t) {
      const double* S_t = &states[(t - t0 + 1) * KV];
      const double* S_prev = &states[(t - t0) * KV];
      for (int64_t i = 0; i < K; ++i) {
        q[i] = hv.in(p.q, t, i);
        k[i] = hv.in(p.k, t, i);
        decay[i] = std::exp(hv.gate(t, i));
      }
      for (int64_t j = 0; j < V; ++j) {
        v[j] = hv.in(p.v, t, j);
        dout[j] = present(p.do_) ? hv.in(p.do_, t, j) : 0.0;
      }
      const int64_t b = hv.span.batch, tok = hv.span.start + t;
      if (present(p.dq)) {
        for (int64_t i = 0; i < K; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < V; ++j) acc += S_t[i * V + j] * dout[j];
          store_from_double(p.dq, offset4(p.dq, b, tok, h, i), p.scale * acc);
        }
      }
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) dS[i * V + j] += p.scale * q[i] * dout[j];
      if (present(p.dk)) {
        for (int64_t i = 0; i < K; ++i) {
          double acc = 0;
          for (int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * v[j];
          store_from_double(p.dk, offset4(p.dk, b, tok, h, i), acc);
        }
      }
      if (present(p.dv)) {
        for (int64_t j = 0; j < V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < K; ++i) acc += dS[i * V + j] * k[i];
          store_from_double(p.dv, offset4(p.dv, b, tok, h, j), acc);
        }
      }
      for (int64_t i = 0; i < K; ++i) {
        double acc = 0;
        for (int64_t j = 0; j < V; ++j) acc += dS[i * V + j] * S_prev[i * V + j];
        dgate[i] = decay[i] * acc;
      }
      if (present(p.dg)) {
        if (p.gate_per_head) {
          double total = 0;
          for (int64_t i = 0; i < K; ++i) total += dgate[i];
          store_from_double(p.dg, offset3(p.dg, b, tok, h), total);
        } else {
          for (int64_t i = 0; i < K; ++i) store_from_double(p.dg, offset4(p.dg, b, tok, h, i), dgate[i]);
        }
      }
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) dS[i * V + j] *= decay[i];
    }
  }
  if (present(p.dh0)) store_state(hv, p.dh0, n, dS);
}

class ReferenceBackend final : public Backend {
 public:
  std::string name() const override { return "reference"; }
  // Closes the candidate list: every other backend is tried first.
  int priority() const override { return 1000; }
  // Everything the core validates, on host memory: every unit, dtype, size, feature and layout;
  // deterministic (one task per (sequence, head), each computed whole in fp64).
  const std::vector<gla_capability>& capabilities() const override {
    static const std::vector<gla_capability> records = [] {
      gla_capability c = open_capability(unit_bit(GLA_UNIT_CHUNK_FWD) | unit_bit(GLA_UNIT_CHUNK_BWD) | kStageUnits |
                                             unit_bit(GLA_UNIT_RECURRENT_FWD) | unit_bit(GLA_UNIT_RECURRENT_BWD),
                                         device_bit(GLA_DEVICE_CPU) | device_bit(GLA_DEVICE_CUDA_HOST));
      c.features = GLA_FEATURE_ALL & ~(GLA_FEATURE_CHUNK_STATES | GLA_FEATURE_CHUNK_STATES_BF16);
      c.deterministic = 1;
      return std::vector<gla_capability>{c};
    }();
    return records;
  }
  std::string plan_note(const gla_problem& p) const override {
    return std::string("fp64 token loop (SPEC.md recurrence), one task per (sequence, head): ") +
           std::to_string(p.N * p.H) + " tasks";
  }
  void run(const gla_problem& p) override {
    if (p.unit == GLA_UNIT_CHUNK_FWD) {
      parallel_for(p.N * p.H, [&](int64_t item) { forward_head(p, item / p.H, item % p.H); });
    } else if (p.unit == GLA_UNIT_CHUNK_BWD) {
      parallel_for(p.N * p.H, [&](int64_t item) { backward_head(p, item / p.H, item % p.H); });
    } else if (p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD) {
      run_reference_recurrent(p);
    } else {
      run_reference_stage(p);
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_reference_backend() { return std::make_unique<ReferenceBackend>(); }

}  // namespace gla
