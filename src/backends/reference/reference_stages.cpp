// The stages of the chunked algorithm (SPEC.md §2) as plainly as they can be written: fp64
// accumulation, fp32 intermediates in the layouts of gla.h, one (sequence, head) per work item.
// Decays are formed from differences of cumulative gates clamped at 0 under the causal mask, the
// way the fp64 oracle does, so no exponent is ever positive.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/reference/reference_backend.hpp"
#include "core/parallel.hpp"

namespace gla {

namespace {

struct Chunk {
  int64_t batch;
  int64_t first;   // first token (row coordinate)
  int64_t length;  // tokens in this chunk
  int64_t global;  // index into h / dh
};

struct StageView {
  const gla_problem& p;
  int64_t n, head;
  SequenceSpan span;
  int64_t chunks;

  StageView(const gla_problem& problem, int64_t seq, int64_t h)
      : p(problem), n(seq), head(h), span(sequence_span(problem, seq)),
        chunks((span.length + problem.chunk_size - 1) / problem.chunk_size) {}

  Chunk chunk(int64_t c) const {
    const int64_t first = span.start + c * p.chunk_size;
    return {span.batch, first, std::min(p.chunk_size, span.length - c * p.chunk_size), p.chunk_offsets[n] + c};
  }
  double in(const gla_tensor& t, const Chunk& c, int64_t r, int64_t i) const {
    return load_as_double(t, offset4(t, c.batch, c.first + r, head, i));
  }
  double grad_out(const Chunk& c, int64_t r, int64_t j) const {
    return present(p.do_) ? in(p.do_, c, r, j) : 0.0;
  }
  // Cumulative gate b (log2 units) at row r, key i.
  double b(const Chunk& c, int64_t r, int64_t i) const {
    return load_as_double(p.gcum, offset4(p.gcum, c.batch, c.first + r, head, p.gate_per_head ? 0 : i));
  }
  int64_t state_index(const gla_tensor& t, const Chunk& c, int64_t i, int64_t j) const {
    return offset4(t, c.global, head, i, j);
  }
  int64_t matrix_index(const gla_tensor& t, const Chunk& c, int64_t r, int64_t col) const {
    return offset4(t, c.batch, c.first + r, head, col);
  }
};

constexpr double kGateFloor = -104.0;

void cumsum(const StageView& s) {
  const gla_problem& p = s.p;
  const int64_t kg = p.gate_per_head ? 1 : p.K;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    for (int64_t i = 0; i < kg; ++i) {
      double acc = 0;
      for (int64_t r = 0; r < ch.length; ++r) {
        // SPEC.md §3.8: g = -inf (a hard reset) enters the sum at a floor below which e^g is 0 in
        // fp32 (e^-104 < the smallest subnormal), so later stages never form -inf - (-inf); the floor
        // is no lower so the fp32 gcum buffer keeps the precision of the spans after a reset.
        acc += std::max(load_as_double(p.g, gate_offset(p, ch.batch, ch.first + r, s.head, i)), kGateFloor);
        store_from_double(p.gcum, offset4(p.gcum, ch.batch, ch.first + r, s.head, i), acc / std::log(2.0));
      }
    }
  }
}

// The two chunk scans of SPEC.md §2 share one shape: a K x V state starts from a per-sequence
// tensor (`start`, zeros when absent), is stored into `per_chunk` at each chunk it enters, then
// decays by 2^{b_last} and gains sum_r weight(r, i) * value(r, j) over the chunk's rows; it ends in
// `end` when present. F2 walks forward over k and v, B1 backward over q and do.
template <class Weight, class Value>
void chunk_scan(const StageView& s, const gla_tensor& start, const gla_tensor& per_chunk, const gla_tensor& end,
                bool reverse, Weight weight, Value value) {
  const gla_problem& p = s.p;
  const int64_t K = p.K, V = p.V;
  std::vector<double> S(static_cast<size_t>(K * V), 0.0);
  if (present(start)) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) S[i * V + j] = load_as_double(start, state_offset(p, start, s.n, s.head, i, j));
  }
  for (int64_t step = 0; step < s.chunks; ++step) {
    const Chunk ch = s.chunk(reverse ? s.chunks - 1 - step : step);
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) store_from_double(per_chunk, s.state_index(per_chunk, ch, i, j), S[i * V + j]);
    const int64_t last = ch.length - 1;
    for (int64_t i = 0; i < K; ++i) {
      const double bl = s.b(ch, last, i);
      for (int64_t j = 0; j < V; ++j) S[i * V + j] *= std::exp2(bl);
      for (int64_t r = 0; r < ch.length; ++r) {
        const double w = weight(ch, r, i, bl);
        for (int64_t j = 0; j < V; ++j) S[i * V + j] += w * value(ch, r, j);
      }
    }
  }
  if (present(end)) {
    for (int64_t i = 0; i < K; ++i)
      for (int64_t j = 0; j < V; ++j) store_from_double(end, state_offset(p, end, s.n, s.head, i, j), S[i * V + j]);
  }
}

// F2: h[c] = state at the start of chunk c; S <- 2^{b_last} S + (k 2^{b_last - b})^T v.
void forward_states(const StageView& s) {
  const gla_problem& p = s.p;
  chunk_scan(
      s, p.initial_state, p.h, p.final_state, false,
      [&](const Chunk& ch, int64_t r, int64_t i, double bl) { return s.in(p.k, ch, r, i) * std::exp2(bl - s.b(ch, r, i)); },
      [&](const Chunk& ch, int64_t r, int64_t j) { return s.in(p.v, ch, r, j); });
}

// B1: dh[c] = dL/d(state at the end of chunk c); dS <- 2^{b_last} dS + (scale q 2^{b})^T do.
void state_gradients(const StageView& s) {
  const gla_problem& p = s.p;
  chunk_scan(
      s, p.dht, p.dh, p.dh0, true,
      [&](const Chunk& ch, int64_t r, int64_t i, double) { return p.scale * s.in(p.q, ch, r, i) * std::exp2(s.b(ch, r, i)); },
      [&](const Chunk& ch, int64_t r, int64_t j) { return s.grad_out(ch, r, j); });
}

// Decay factor from key row sr to query row tr (sr <= tr): 2^(b_t - b_s), exponent <= 0 for g <= 0.
double decay(const StageView& s, const Chunk& ch, int64_t tr, int64_t sr, int64_t i) {
  return std::exp2(std::min(0.0, s.b(ch, tr, i) - s.b(ch, sr, i)));
}

// Fills a [B, T, H, C] chunk matrix (A or dA): scale * entry(t, s) on and below the diagonal,
// exact zeros above it and in the columns past a partial chunk's end.
template <class Entry>
void fill_causal_matrix(const StageView& s, const gla_tensor& out, Entry entry) {
  const gla_problem& p = s.p;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    for (int64_t t = 0; t < ch.length; ++t) {
      for (int64_t col = 0; col < p.chunk_size; ++col) {
        const double value = col <= t ? p.scale * entry(ch, t, col) : 0.0;
        store_from_double(out, s.matrix_index(out, ch, t, col), value);
      }
    }
  }
}

// F3: A[t, s] = scale * sum_i q_ti k_si 2^(b_ti - b_si).
void intra_attention(const StageView& s) {
  const gla_problem& p = s.p;
  fill_causal_matrix(s, p.A, [&](const Chunk& ch, int64_t t, int64_t col) {
    double acc = 0;
    for (int64_t i = 0; i < p.K; ++i) acc += s.in(p.q, ch, t, i) * s.in(p.k, ch, col, i) * decay(s, ch, t, col, i);
    return acc;
  });
}

void output(const StageView& s) {
  const gla_problem& p = s.p;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    for (int64_t t = 0; t < ch.length; ++t) {
      for (int64_t j = 0; j < p.V; ++j) {
        double inter = 0;
        for (int64_t i = 0; i < p.K; ++i) {
          inter += s.in(p.q, ch, t, i) * std::exp2(s.b(ch, t, i)) * load_as_double(p.h, s.state_index(p.h, ch, i, j));
        }
        double intra = 0;
        for (int64_t col = 0; col <= t; ++col) {
          intra += load_as_double(p.A, s.matrix_index(p.A, ch, t, col)) * s.in(p.v, ch, col, j);
        }
        store_from_double(p.o, offset4(p.o, ch.batch, ch.first + t, s.head, j), p.scale * inter + intra);
      }
    }
  }
}

// B3: dA[t, s] = scale * do_t . v_s.
void attention_gradient(const StageView& s) {
  const gla_problem& p = s.p;
  fill_causal_matrix(s, p.dA, [&](const Chunk& ch, int64_t t, int64_t col) {
    double acc = 0;
    for (int64_t j = 0; j < p.V; ++j) acc += s.grad_out(ch, t, j) * s.in(p.v, ch, col, j);
    return acc;
  });
}

void value_gradient(const StageView& s) {
  const gla_problem& p = s.p;
  if (!present(p.dv)) return;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    const int64_t last = ch.length - 1;
    for (int64_t r = 0; r < ch.length; ++r) {
      for (int64_t j = 0; j < p.V; ++j) {
        double acc = 0;
        for (int64_t t = r; t < ch.length; ++t) acc += load_as_double(p.A, s.matrix_index(p.A, ch, t, r)) * s.grad_out(ch, t, j);
        for (int64_t i = 0; i < p.K; ++i) {
          acc += s.in(p.k, ch, r, i) * std::exp2(s.b(ch, last, i) - s.b(ch, r, i)) *
                 load_as_double(p.dh, s.state_index(p.dh, ch, i, j));
        }
        store_from_double(p.dv, offset4(p.dv, ch.batch, ch.first + r, s.head, j), acc);
      }
    }
  }
}

void intra_key_query_gradients(const StageView& s) {
  const gla_problem& p = s.p;
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    for (int64_t r = 0; r < ch.length; ++r) {
      for (int64_t i = 0; i < p.K; ++i) {
        double dq = 0, dk = 0;
        for (int64_t col = 0; col <= r; ++col) {
          dq += load_as_double(p.dA, s.matrix_index(p.dA, ch, r, col)) * s.in(p.k, ch, col, i) * decay(s, ch, r, col, i);
        }
        for (int64_t t = r; t < ch.length; ++t) {
          dk += load_as_double(p.dA, s.matrix_index(p.dA, ch, t, r)) * s.in(p.q, ch, t, i) * decay(s, ch, t, r, i);
        }
        store_from_double(p.dq_intra, offset4(p.dq_intra, ch.batch, ch.first + r, s.head, i), dq);
        store_from_double(p.dk_intra, offset4(p.dk_intra, ch.batch, ch.first + r, s.head, i), dk);
      }
    }
  }
}

void inter_gradients(const StageView& s) {
  const gla_problem& p = s.p;
  const int64_t K = p.K, V = p.V;
  std::vector<double> dq, dk, dk_inter, dgate, last_term(static_cast<size_t>(K));
  for (int64_t c = 0; c < s.chunks; ++c) {
    const Chunk ch = s.chunk(c);
    const int64_t L = ch.length, last = L - 1;
    dq.assign(static_cast<size_t>(L * K), 0.0);
    dk.assign(static_cast<size_t>(L * K), 0.0);
    dk_inter.assign(static_cast<size_t>(L * K), 0.0);
    dgate.assign(static_cast<size_t>(L * K), 0.0);
    for (int64_t r = 0; r < L; ++r) {
      for (int64_t i = 0; i < K; ++i) {
        double hdo = 0, dhv = 0;
        for (int64_t j = 0; j < V; ++j) {
          hdo += load_as_double(p.h, s.state_index(p.h, ch, i, j)) * s.grad_out(ch, r, j);
          dhv += load_as_double(p.dh, s.state_index(p.dh, ch, i, j)) * s.in(p.v, ch, r, j);
        }
        const double inter_k = std::exp2(s.b(ch, last, i) - s.b(ch, r, i)) * dhv;
        dq[r * K + i] = load_as_double(p.dq_intra, offset4(p.dq_intra, ch.batch, ch.first + r, s.head, i)) +
                        p.scale * std::exp2(s.b(ch, r, i)) * hdo;
        dk_inter[r * K + i] = inter_k;
        dk[r * K + i] = load_as_double(p.dk_intra, offset4(p.dk_intra, ch.batch, ch.first + r, s.head, i)) + inter_k;
      }
    }
    // dg_u = sum_{t >= u} (q dq - k dk)_t + 2^{b_last} rowsum(h . dh) + sum_s k_s dk_inter_s
    for (int64_t i = 0; i < K; ++i) {
      double rowsum = 0;
      for (int64_t j = 0; j < V; ++j) {
        rowsum += load_as_double(p.h, s.state_index(p.h, ch, i, j)) * load_as_double(p.dh, s.state_index(p.dh, ch, i, j));
      }
      double carried = std::exp2(s.b(ch, last, i)) * rowsum;
      for (int64_t r = 0; r < L; ++r) carried += s.in(p.k, ch, r, i) * dk_inter[r * K + i];
      last_term[i] = carried;
      double suffix = 0;
      for (int64_t r = L - 1; r >= 0; --r) {
        suffix += s.in(p.q, ch, r, i) * dq[r * K + i] - s.in(p.k, ch, r, i) * dk[r * K + i];
        dgate[r * K + i] = suffix + last_term[i];
      }
    }
    for (int64_t r = 0; r < L; ++r) {
      const int64_t tok = ch.first + r;
      for (int64_t i = 0; i < K; ++i) {
        if (present(p.dq)) store_from_double(p.dq, offset4(p.dq, ch.batch, tok, s.head, i), dq[r * K + i]);
        if (present(p.dk)) store_from_double(p.dk, offset4(p.dk, ch.batch, tok, s.head, i), dk[r * K + i]);
        if (present(p.dg) && !p.gate_per_head) store_from_double(p.dg, offset4(p.dg, ch.batch, tok, s.head, i), dgate[r * K + i]);
      }
      if (present(p.dg) && p.gate_per_head) {
        double total = 0;
        for (int64_t i = 0; i < K; ++i) total += dgate[r * K + i];
        store_from_double(p.dg, offset3(p.dg, ch.batch, tok, s.head), total);
      }
    }
  }
}

}  // namespace

void run_reference_stage(const gla_problem& p) {
  parallel_for(p.N * p.H, [&](int64_t item) {
    const StageView s(p, item / p.H, item % p.H);
    switch (p.unit) {
      case GLA_UNIT_CUMSUM: cumsum(s); break;
      case GLA_UNIT_FWD_H: forward_states(s); break;
      case GLA_UNIT_FWD_INTRA: intra_attention(s); break;
      case GLA_UNIT_FWD_O: output(s); break;
      case GLA_UNIT_BWD_DH: state_gradients(s); break;
      case GLA_UNIT_BWD_DA: attention_gradient(s); break;
      case GLA_UNIT_BWD_DV: value_gradient(s); break;
      case GLA_UNIT_BWD_DQK_INTRA: intra_key_query_gradients(s); break;
      case GLA_UNIT_BWD_DQKG: inter_gradients(s); break;
      default: fail(GLA_STATUS_INTERNAL_ERROR, std::string("reference: not a stage unit: ") + gla_unit_name(p.unit));
    }
  });
}

}  // namespace gla
