#include "backends/cpu/recurrent.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/recurrent.hpp"

namespace gla::cpu {

namespace {

// States kept every kCheckpointEvery steps in the backward: K*V*(L/64 + 65) floats per head.
constexpr int64_t kCheckpointEvery = 64;

// count elements of t from element `offset` on, `stride` apart, as float (one dtype switch per row).
void load_row(const gla_tensor& t, int64_t offset, int64_t stride, int64_t count, float* out) {
  const char* base = static_cast<const char*>(t.data);
  switch (t.dtype) {
    case GLA_DTYPE_F32: {
      const float* x = reinterpret_cast<const float*>(base) + offset;
      if (stride == 1) {
        std::copy(x, x + count, out);
      } else {
        for (int64_t i = 0; i < count; ++i) out[i] = x[i * stride];
      }
      return;
    }
    case GLA_DTYPE_BF16: {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = bf16_to_float(x[i * stride]);
      return;
    }
    case GLA_DTYPE_F16: {
      const uint16_t* x = reinterpret_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < count; ++i) out[i] = f16_to_float(x[i * stride]);
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) out[i] = static_cast<float>(load_as_double(t, offset + i * stride));
  }
}

void store_row(const gla_tensor& t, int64_t offset, int64_t stride, int64_t count, const float* values, float factor) {
  char* base = static_cast<char*>(t.data);
  switch (t.dtype) {
    case GLA_DTYPE_F32: {
      float* x = reinterpret_cast<float*>(base) + offset;
      for (int64_t i = 0; i < count; ++i) x[i * stride] = factor * values[i];
      return;
    }
    case GLA_DTYPE_BF16: {
      uint16_t* x = reinterpret_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < count; ++i) x[i * stride] = float_to_bf16(factor * values[i]);
      return;
    }
    case GLA_DTYPE_F16: {
      uint16_t* x = reinterpret_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < count; ++i) x[i * stride] = float_to_f16(factor * values[i]);
      return;
    }
    default:
      for (int64_t i = 0; i < count; ++i) store_from_double(t, offset + i * stride, static_cast<double>(factor * values[i]));
  }
}

// One (sequence, head): the token's vectors converted to fp32 once, the state's rows updated
// with loops over the contiguous value index that the compiler vectorises.
struct Head {
  const gla_problem& p;
  SequenceSpan span;
  int64_t head;
  int64_t state_index;
  std::vector<float> q, k, v, a, b, dout;

  Head(const gla_problem& problem, int64_t n, int64_t h, int64_t index)
      : p(problem), span(sequence_span(problem, n)), head(h), state_index(index),
        q(static_cast<size_t>(problem.K)), k(q.size()), v(static_cast<size_t>(problem.V)), a(q.size(), 1.0f),
        b(v.size(), 1.0f), dout(v.size()) {}

  int64_t token(int64_t step) const { return span.start + recurrent_token(p, span.length, step); }
  void read(const gla_tensor& t, int64_t tok, std::vector<float>& out) const {
    load_row(t, offset4(t, span.batch, tok, head, 0), t.strides[3], static_cast<int64_t>(out.size()), out.data());
  }
  void read_decay(const gla_tensor& gate, int64_t tok, std::vector<float>& out) const {
    if (!present(gate)) return;  // stays 1
    read(gate, tok, out);
    for (float& x : out) x = std::exp(x);
  }
  void write(const gla_tensor& t, int64_t tok, const float* values, int64_t count, float factor = 1.0f) const {
    store_row(t, offset4(t, span.batch, tok, head, 0), t.strides[3], count, values, factor);
  }
  // The token's inputs for the state step: k, v and the decays.
  void load_step(int64_t tok) {
    read(p.k, tok, k);
    read(p.v, tok, v);
    read_decay(p.g, tok, a);
    read_decay(p.gv, tok, b);
  }
  // The backward's scratch states are [K, V] whatever the layout: a state at element `base` with
  // row / column strides (rs, cs) of its last two dims, transposed on the way with state_v_first.
  void load_tile(const gla_tensor& t, int64_t base, int64_t rs, int64_t cs, float* S) const {
    const int64_t K = p.K, V = p.V;
    if (!p.state_v_first) {
      for (int64_t i = 0; i < K; ++i) load_row(t, base + i * rs, cs, V, S + i * V);
      return;
    }
    const float* x = static_cast<const float*>(t.data) + base;  // x[j * rs + i * cs] = S[i, j]
    for (int64_t j = 0; j < V; ++j)
      for (int64_t i = 0; i < K; ++i) S[i * V + j] = x[j * rs + i * cs];
  }
  void store_tile(const gla_tensor& t, int64_t base, int64_t rs, int64_t cs, const float* S) const {
    const int64_t K = p.K, V = p.V;
    float* x = static_cast<float*>(t.data) + base;
    if (!p.state_v_first) {
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < V; ++j) x[i * rs + j * cs] = S[i * V + j];
      return;
    }
    for (int64_t j = 0; j < V; ++j)
      for (int64_t i = 0; i < K; ++i) x[j * rs + i * cs] = S[i * V + j];
  }
  // The forward works in the state's own layout ([K, V], or [V, K] with state_v_first): rows are
  // copied as they are, and the step walks them contiguously (step / step_value_major).
  void load_native(const gla_tensor& t, float* S) const {
    const int64_t R = p.state_v_first ? p.V : p.K, C = p.state_v_first ? p.K : p.V;
    if (!present(t)) {
      std::fill(S, S + R * C, 0.0f);
      return;
    }
    const int64_t base = state_index * t.strides[0] + head * t.strides[1];
    for (int64_t r = 0; r < R; ++r) load_row(t, base + r * t.strides[2], t.strides[3], C, S + r * C);
  }
  // S == nullptr stores zeros (a skipped pool entry's token states).
  void store_native(const gla_tensor& t, int64_t base, int64_t rs, int64_t cs, const float* S) const {
    const int64_t R = p.state_v_first ? p.V : p.K, C = p.state_v_first ? p.K : p.V;
    float* x = static_cast<float*>(t.data) + base;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) x[r * rs + c * cs] = S ? S[r * C + c] : 0.0f;
  }
  void load_state(const gla_tensor& t, float* S) const {
    if (!present(t)) {
      std::fill(S, S + p.K * p.V, 0.0f);
      return;
    }
    load_tile(t, state_index * t.strides[0] + head * t.strides[1], t.strides[2], t.strides[3], S);
  }
  void store_state(const gla_tensor& t, const float* S) const {
    store_tile(t, state_index * t.strides[0] + head * t.strides[1], t.strides[2], t.strides[3], S);
  }
};

// S <- Diag(a) S Diag(b) + k v^T, and (o != nullptr) o = q^T S, in one pass over the rows.
void step(Head& r, float* S, float* o) {
  const int64_t K = r.p.K, V = r.p.V;
  const float* __restrict__ b = r.b.data();
  const float* __restrict__ v = r.v.data();
  float* __restrict__ out = o;
  if (out) std::fill(out, out + V, 0.0f);
  for (int64_t i = 0; i < K; ++i) {
    float* __restrict__ row = S + i * V;
    const float ai = r.a[static_cast<size_t>(i)], ki = r.k[static_cast<size_t>(i)];
    if (out) {
      const float qi = r.q[static_cast<size_t>(i)];
      for (int64_t j = 0; j < V; ++j) {
        const float x = ai * b[j] * row[j] + ki * v[j];
        row[j] = x;
        out[j] += qi * x;
      }
    } else {
      for (int64_t j = 0; j < V; ++j) row[j] = ai * b[j] * row[j] + ki * v[j];
    }
  }
}

// The same step on a [V, K] state (state_v_first): row j is S[:, j]; o_j is the row's dot product
// with q, summed in kLanes partial sums so the loop vectorises without reassociation flags.
void step_value_major(Head& r, float* S, float* o) {
  constexpr int64_t kLanes = 16;
  const int64_t K = r.p.K, V = r.p.V;
  const float* __restrict__ a = r.a.data();
  const float* __restrict__ k = r.k.data();
  const float* __restrict__ q = r.q.data();
  for (int64_t j = 0; j < V; ++j) {
    float* __restrict__ row = S + j * K;
    const float bj = r.b[static_cast<size_t>(j)], vj = r.v[static_cast<size_t>(j)];
    float acc[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= K; i += kLanes) {
      for (int64_t l = 0; l < kLanes; ++l) {
        const float x = a[i + l] * bj * row[i + l] + k[i + l] * vj;
        row[i + l] = x;
        acc[l] += q[i + l] * x;
      }
    }
    for (; i < K; ++i) {
      row[i] = a[i] * bj * row[i] + k[i] * vj;
      acc[0] += q[i] * row[i];
    }
    float sum = 0;
    for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
    o[j] = sum;
  }
}

void forward_head(Head& r) {
  const gla_problem& p = r.p;
  const int64_t K = p.K, V = p.V;
  std::vector<float> o(static_cast<size_t>(V), 0.0f);
  if (r.state_index < 0) {  // a skipped pool entry: zeros out, the pool untouched
    for (int64_t s = 0; s < r.span.length; ++s) {
      r.write(p.o, r.token(s), o.data(), V);
      const gla_tensor& ts = p.token_states;
      if (present(ts)) {
        r.store_native(ts, r.span.batch * ts.strides[0] + r.token(s) * ts.strides[1] + r.head * ts.strides[2],
                       ts.strides[3], ts.strides[4], nullptr);
      }
    }
    return;
  }
  // Kept per thread: a fresh 512 KiB state (K256 V512) per item costs an mmap and its page faults.
  thread_local std::vector<float> S;
  S.resize(static_cast<size_t>(K * V));
  r.load_native(p.initial_state, S.data());
  const gla_tensor& ts = p.token_states;
  for (int64_t s = 0; s < r.span.length; ++s) {
    const int64_t tok = r.token(s);
    r.load_step(tok);
    r.read(p.q, tok, r.q);
    if (p.state_v_first) {
      step_value_major(r, S.data(), o.data());
    } else {
      step(r, S.data(), o.data());
    }
    r.write(p.o, tok, o.data(), V, static_cast<float>(p.scale));
    if (present(ts)) {
      r.store_native(ts, r.span.batch * ts.strides[0] + tok * ts.strides[1] + r.head * ts.strides[2], ts.strides[3],
                     ts.strides[4], S.data());
    }
  }
  if (present(p.final_state)) {
    const gla_tensor& t = p.final_state;
    r.store_native(t, r.state_index * t.strides[0] + r.head * t.strides[1], t.strides[2], t.strides[3], S.data());
  }
}

void backward_head(Head& r) {
  const gla_problem& p = r.p;
  const int64_t K = p.K, V = p.V, L = r.span.length;
  const size_t KV = static_cast<size_t>(K * V);
  const float scale = static_cast<float>(p.scale);
  const int64_t blocks = (L + kCheckpointEvery - 1) / kCheckpointEvery;
  std::vector<float> checkpoints(static_cast<size_t>(blocks) * KV), S(KV);
  r.load_state(p.initial_state, S.data());
  for (int64_t s = 0; s < L; ++s) {
    if (s % kCheckpointEvery == 0) std::copy(S.begin(), S.end(), checkpoints.begin() + (s / kCheckpointEvery) * KV);
    r.load_step(r.token(s));
    step(r, S.data(), nullptr);
  }
  std::vector<float> dS(KV);
  r.load_state(p.dht, dS.data());
  std::vector<float> states(static_cast<size_t>(std::min(L, kCheckpointEvery) + 1) * KV);
  std::vector<float> dq(static_cast<size_t>(K)), dk(dq.size()), dgk(dq.size()), dv(static_cast<size_t>(V)), dgv(dv.size());
  for (int64_t blk = blocks - 1; blk >= 0; --blk) {
    const int64_t s0 = blk * kCheckpointEvery, s1 = std::min(L, s0 + kCheckpointEvery);
    std::copy(checkpoints.begin() + blk * KV, checkpoints.begin() + (blk + 1) * KV, states.begin());
    for (int64_t s = s0; s < s1; ++s) {
      float* next = &states[(s - s0 + 1) * KV];
      std::copy(next - KV, next, next);
      r.load_step(r.token(s));
      step(r, next, nullptr);
    }
    for (int64_t s = s1 - 1; s >= s0; --s) {
      const int64_t tok = r.token(s);
      const float* S_t = &states[(s - s0 + 1) * KV];
      const float* S_prev = &states[(s - s0) * KV];
      r.load_step(tok);
      r.read(p.q, tok, r.q);
      if (present(p.do_)) {
        r.read(p.do_, tok, r.dout);
      } else {
        std::fill(r.dout.begin(), r.dout.end(), 0.0f);
      }
      const float* dout = r.dout.data();
      const float* v = r.v.data();
      const float* b = r.b.data();
      std::fill(dv.begin(), dv.end(), 0.0f);
      std::fill(dgv.begin(), dgv.end(), 0.0f);
      for (int64_t i = 0; i < K; ++i) {
        const float* st = S_t + i * V;
        const float* sp = S_prev + i * V;
        float* ds = &dS[static_cast<size_t>(i) * V];
        const float qi = scale * r.q[static_cast<size_t>(i)], ki = r.k[static_cast<size_t>(i)], ai = r.a[static_cast<size_t>(i)];
        float acc_q = 0, acc_k = 0, acc_g = 0;
        for (int64_t j = 0; j < V; ++j) {
          acc_q += st[j] * dout[j];
          ds[j] += qi * dout[j];
          acc_k += ds[j] * v[j];
          dv[static_cast<size_t>(j)] += ds[j] * ki;
          const float x = ds[j] * ai * b[j] * sp[j];
          acc_g += x;
          dgv[static_cast<size_t>(j)] += x;
          ds[j] *= ai * b[j];
        }
        dq[static_cast<size_t>(i)] = scale * acc_q;
        dk[static_cast<size_t>(i)] = acc_k;
        dgk[static_cast<size_t>(i)] = acc_g;
      }
      if (present(p.dq)) r.write(p.dq, tok, dq.data(), K);
      if (present(p.dk)) r.write(p.dk, tok, dk.data(), K);
      if (present(p.dv)) r.write(p.dv, tok, dv.data(), V);
      if (present(p.dg)) r.write(p.dg, tok, dgk.data(), K);
      if (present(p.dgv)) r.write(p.dgv, tok, dgv.data(), V);
    }
  }
  if (present(p.dh0)) r.store_state(p.dh0, dS.data());
}

}  // namespace

void run_recurrent(const gla_problem& p) {
  for_each_recurrent_head(p, [&](int64_t n, int64_t h, int64_t state_index) {
    Head r(p, n, h, state_index);
    if (p.unit == GLA_UNIT_RECURRENT_BWD) {
      backward_head(r);
    } else {
      forward_head(r);
    }
  });
}

}  // namespace gla::cpu
