#include "test_support.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace gla::test {

HostTensor::HostTensor(int32_t dtype, std::vector<int64_t> sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  bytes.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * dtype_size(dtype)));
  t.data = bytes.data();
  t.dtype = dtype;
  t.device_type = GLA_DEVICE_CPU;
  t.rank = static_cast<int32_t>(sizes.size());
  int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.sizes[i] = sizes[static_cast<size_t>(i)];
    t.strides[i] = stride;
    stride *= t.sizes[i];
  }
}

HostTensor::HostTensor(const HostTensor& other) : bytes(other.bytes), t(other.t) {
  if (other.t.data) t.data = bytes.data();
}

HostTensor& HostTensor::operator=(const HostTensor& other) {
  if (this != &other) {
    bytes = other.bytes;
    t = other.t;
    if (other.t.data) t.data = bytes.data();
  }
  return *this;
}

namespace {
int64_t strided_offset(const gla_tensor& t, int64_t flat) {
  int64_t off = 0;
  for (int d = t.rank - 1; d >= 0; --d) {
    off += (flat % t.sizes[d]) * t.strides[d];
    flat /= t.sizes[d];
  }
  return off;
}
}  // namespace

double HostTensor::get(int64_t i) const { return load_as_double(t, strided_offset(t, i)); }
void HostTensor::set(int64_t i, double value) { store_from_double(t, strided_offset(t, i), value); }

void fill_uniform(HostTensor& x, std::mt19937_64& rng, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, d(rng));
}
void fill_normal(HostTensor& x, std::mt19937_64& rng) {
  std::normal_distribution<double> d(0.0, 1.0);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, d(rng));
}
void fill_gate(HostTensor& x, std::mt19937_64& rng, double normaliser) {
  std::uniform_real_distribution<double> d(0.0, 1.0);
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, -std::log1p(std::exp(-d(rng))) / normaliser);
}
void poison(HostTensor& x) {
  for (int64_t i = 0; i < x.size(); ++i) x.set(i, NAN);
}

double rel_rms(const HostTensor& a, const HostTensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < b.size(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (!std::isfinite(x) && std::isfinite(y)) return INFINITY;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

bool all_finite(const HostTensor& x) {
  for (int64_t i = 0; i < x.size(); ++i) {
    if (!std::isfinite(x.get(i))) return false;
  }
  return true;
}

HostTensor strided_copy(const HostTensor& x) {
  // Allocate [.., d3, d2] contiguous and describe it as [.., d2, d3] with swapped strides.
  std::vector<int64_t> sizes(x.t.sizes, x.t.sizes + x.t.rank);
  std::swap(sizes[sizes.size() - 1], sizes[sizes.size() - 2]);
  HostTensor y(x.t.dtype, sizes);
  std::swap(y.t.sizes[y.t.rank - 1], y.t.sizes[y.t.rank - 2]);
  std::swap(y.t.strides[y.t.rank - 1], y.t.strides[y.t.rank - 2]);
  for (int64_t i = 0; i < x.size(); ++i) y.set(i, x.get(i));
  return y;
}

std::string Case::label() const {
  std::ostringstream s;
  s << "B" << B << " T" << T << " H" << H << " K" << K << " V" << V << " " << dtype_name(dtype)
    << (gate_f32 ? " gate=f32" : "") << (per_head_gate ? " per-head" : "") << " n=" << normaliser
    << (randn_inputs ? " randn" : "") << (gate_floor < 0 ? " floor=" + std::to_string(gate_floor) : "")
    << (initial_state ? "" : " no-h0") << (final_state ? "" : " no-ht") << (state_v_first ? " v-first" : "");
  if (!cu_seqlens.empty()) {
    s << " cu=[";
    for (size_t i = 0; i < cu_seqlens.size(); ++i) s << (i ? "," : "") << cu_seqlens[i];
    s << "]";
  }
  return s.str();
}

Inputs make_inputs(const Case& c) {
  Inputs in;
  in.c = c;
  in.N = c.cu_seqlens.empty() ? c.B : static_cast<int64_t>(c.cu_seqlens.size()) - 1;
  std::mt19937_64 rng(c.seed * 7919 + 17);
  const int32_t gdt = c.gate_f32 ? GLA_DTYPE_F32 : c.dtype;
  in.q = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  in.k = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  in.v = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  in.g = c.per_head_gate ? HostTensor(gdt, {c.B, c.T, c.H}) : HostTensor(gdt, {c.B, c.T, c.H, c.K});
  if (c.randn_inputs) {
    fill_normal(in.q, rng);
    fill_normal(in.k, rng);
    fill_normal(in.v, rng);
  } else {
    fill_uniform(in.q, rng);
    fill_uniform(in.k, rng);
    fill_uniform(in.v, rng);
  }
  fill_gate(in.g, rng, c.normaliser);
  if (c.gate_floor < 0) {
    // Every 7th gate entry at the floor: strong decay mixed with mild decay.
    for (int64_t i = 0; i < in.g.size(); i += 7) in.g.set(i, c.gate_floor);
  }
  const std::vector<int64_t> state = c.state_v_first ? std::vector<int64_t>{in.N, c.H, c.V, c.K}
                                                     : std::vector<int64_t>{in.N, c.H, c.K, c.V};
  if (c.initial_state) {
    in.h0 = HostTensor(GLA_DTYPE_F32, state);
    fill_normal(in.h0, rng);
  }
  in.dht = HostTensor(GLA_DTYPE_F32, state);
  fill_normal(in.dht, rng);
  in.dout = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  fill_normal(in.dout, rng);
  if (!c.cu_seqlens.empty()) {
    in.cu = HostTensor(GLA_DTYPE_I64, {static_cast<int64_t>(c.cu_seqlens.size())});
    std::memcpy(in.cu.bytes.data(), c.cu_seqlens.data(), c.cu_seqlens.size() * 8);
  }
  return in;
}

namespace {
gla_options make_options(const Inputs& in, const RunOptions& ro) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = in.c.state_v_first;
  o.backend = ro.backend.empty() ? nullptr : ro.backend.c_str();
  o.force_stage_pipeline = ro.stage_pipeline;
  o.check_inputs = ro.check_inputs;
  return o;
}
}  // namespace

int64_t saved_state_chunks(const Inputs& in) {
  const Case& c = in.c;
  if (c.cu_seqlens.empty()) return c.B * ((c.T + 63) / 64);
  int64_t nc = 0;
  for (size_t i = 0; i + 1 < c.cu_seqlens.size(); ++i) nc += (c.cu_seqlens[i + 1] - c.cu_seqlens[i] + 63) / 64;
  return nc;
}

std::vector<int64_t> state_sizes(const Inputs& in) {
  const Case& c = in.c;
  return c.state_v_first ? std::vector<int64_t>{in.N, c.H, c.V, c.K} : std::vector<int64_t>{in.N, c.H, c.K, c.V};
}

bool backend_available(const std::string& wanted) {
  for (int32_t i = 0; i < gla_backend_count(); ++i) {
    const char* name = nullptr;
    const char* reason = nullptr;
    int32_t priority = 0, available = 0;
    if (gla_backend_info(i, &name, &priority, &available, &reason) == GLA_STATUS_OK && wanted == name) {
      return available != 0;
    }
  }
  return false;
}

gla_chunk_forward_args forward_args(const Inputs& in, Outputs& out) {
  const Case& c = in.c;
  out.o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  poison(out.o);
  if (c.final_state) {
    out.ht = HostTensor(GLA_DTYPE_F32, state_sizes(in));
    poison(out.ht);
  }
  gla_chunk_forward_args a{};
  a.q = in.q.desc();
  a.k = in.k.desc();
  a.v = in.v.desc();
  a.g = in.g.desc();
  a.initial_state = in.h0.desc();
  a.cu_seqlens = in.cu.desc();
  a.o = out.o.desc();
  a.final_state = out.ht.desc();
  return a;
}

gla_status run_forward(const Inputs& in, Outputs& out, const RunOptions& ro) {
  const gla_chunk_forward_args a = forward_args(in, out);
  const gla_options o = make_options(in, ro);
  return gla_chunk_forward(&a, &o);
}

gla_chunk_backward_args backward_args(const Inputs& in, Outputs& out) {
  const Case& c = in.c;
  out.dq = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  out.dk = HostTensor(c.dtype, {c.B, c.T, c.H, c.K});
  out.dv = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
  out.dg = c.per_head_gate ? HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H}) : HostTensor(GLA_DTYPE_F32, {c.B, c.T, c.H, c.K});
  out.dh0 = HostTensor(GLA_DTYPE_F32, state_sizes(in));
  for (HostTensor* t : {&out.dq, &out.dk, &out.dv, &out.dg, &out.dh0}) poison(*t);
  gla_chunk_backward_args a{};
  a.q = in.q.desc();
  a.k = in.k.desc();
  a.v = in.v.desc();
  a.g = in.g.desc();
  a.initial_state = in.h0.desc();
  a.cu_seqlens = in.cu.desc();
  a.do_ = in.dout.desc();
  a.dht = c.final_state ? in.dht.desc() : nullptr;
  a.dq = out.dq.desc();
  a.dk = out.dk.desc();
  a.dv = out.dv.desc();
  a.dg = out.dg.desc();
  a.dh0 = out.dh0.desc();
  return a;
}

gla_status run_backward(const Inputs& in, Outputs& out, const RunOptions& ro) {
  const gla_chunk_backward_args a = backward_args(in, out);
  const gla_options o = make_options(in, ro);
  return gla_chunk_backward(&a, &o);
}

double host_tolerance(int32_t dtype) { return dtype == GLA_DTYPE_F32 ? 1e-5 : 5e-3; }

double max_error(const Outputs& a, const Outputs& b, bool backward, std::string& report) {
  double worst = 0;
  std::ostringstream s;
  auto one = [&](const char* name, const HostTensor& x, const HostTensor& y) {
    if (x.empty() || y.empty()) return;
    const double e = rel_rms(x, y);
    worst = std::max(worst, e);
    s << name << "=" << e << " ";
  };
  if (!backward) {
    one("o", a.o, b.o);
    one("final_state", a.ht, b.ht);
  } else {
    one("dq", a.dq, b.dq);
    one("dk", a.dk, b.dk);
    one("dv", a.dv, b.dv);
    one("dg", a.dg, b.dg);
    one("dh0", a.dh0, b.dh0);
  }
  report = s.str();
  return worst;
}

std::vector<Case> spec_grid_cases(int32_t dtype) {
  // SPEC.md §5 grid. T is trimmed on the big shapes (1024/2048 -> 160/200) to fit a CPU test
  // budget; every shape class (partial chunks, K != 64 multiples, K up to 512, many heads) stays.
  std::vector<Case> cases;
  auto add = [&](int64_t B, int64_t T, int64_t H, int64_t D, double n) {
    Case c;
    c.B = B; c.T = T; c.H = H; c.K = D; c.V = D; c.normaliser = n; c.dtype = dtype;
    c.seed = cases.size();
    cases.push_back(c);
  };
  add(1, 63, 1, 64, 1);
  add(2, 160, 4, 60, 1);
  add(2, 130, 2, 128, 0.1);
  add(2, 130, 2, 128, 1);
  add(2, 130, 2, 128, 10);
  add(2, 200, 2, 64, 1);
  add(1, 128, 1, 256, 1);
  add(1, 64, 1, 320, 1);
  add(1, 65, 1, 512, 1);
  for (auto cu : {std::vector<int64_t>{0, 15}, {0, 0, 16}, {0, 256, 500, 1000}, {0, 15, 100, 300, 1200, 2000}}) {
    for (int64_t D : {64, 100}) {
      Case c;
      c.B = 1; c.T = cu.back(); c.H = 1; c.K = D; c.V = D; c.dtype = dtype; c.cu_seqlens = cu;
      c.seed = cases.size();
      if (c.T > 600) c.H = 1;
      cases.push_back(c);
    }
  }
  Case vf;
  vf.B = 2; vf.T = 256; vf.H = 2; vf.K = 64; vf.V = 64; vf.state_v_first = true; vf.dtype = dtype; vf.seed = 90;
  cases.push_back(vf);
  Case kv;
  kv.B = 1; kv.T = 150; kv.H = 2; kv.K = 32; kv.V = 96; kv.dtype = dtype; kv.seed = 91;
  cases.push_back(kv);
  Case nostate = kv;
  nostate.K = 80; nostate.V = 48; nostate.initial_state = false; nostate.final_state = false; nostate.seed = 92;
  cases.push_back(nostate);
  Case rn;
  rn.B = 1; rn.T = 140; rn.H = 2; rn.K = 64; rn.V = 64; rn.randn_inputs = true; rn.dtype = dtype; rn.seed = 93;
  cases.push_back(rn);
  Case strong = rn;
  strong.randn_inputs = false; strong.normaliser = 0.1; strong.gate_floor = -20; strong.seed = 94;
  cases.push_back(strong);
  Case head = kv;
  head.per_head_gate = true; head.seed = 95;
  cases.push_back(head);
  return cases;
}

gla_status forward_on(const gla_problem& p, const char* backend, char* message, size_t capacity, int32_t device_type) {
  auto on = [&](gla_tensor t) {
    if (device_type >= 0 && (t.data || t.rank)) t.device_type = device_type;
    return t;
  };
  const gla_tensor q = on(p.q), k = on(p.k), v = on(p.v), g = on(p.g), h0 = on(p.initial_state), o = on(p.o),
                   ht = on(p.final_state);
  auto maybe = [](const gla_tensor& t) { return (t.data || t.rank) ? &t : nullptr; };
  gla_chunk_forward_args a{&q, &k, &v, &g, maybe(h0), nullptr, nullptr, &o, maybe(ht)};
  gla_options opts;
  gla_options_init(&opts);
  opts.backend = backend;
  opts.has_scale = 1;
  opts.scale = p.scale;
  opts.state_v_first = p.state_v_first;
  opts.stream = p.stream;
  const gla_status s = gla_chunk_forward(&a, &opts);
  if (s != GLA_STATUS_OK) std::snprintf(message, capacity, "%s", gla_last_error());
  return s;
}

std::string run_command(const std::string& command) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return out;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe)) out += buffer;
  pclose(pipe);
  return out;
}

void set_env(const char* name, const char* value) {
  if (value) {
    setenv(name, value, 1);
  } else {
    unsetenv(name);
  }
  gla_reload_environment();
}

ScopedEnv::ScopedEnv(const char* name, const char* value) : name_(name) {
  if (const char* old = std::getenv(name)) {
    had_ = true;
    old_ = old;
  }
  set_env(name, value);
}

ScopedEnv::~ScopedEnv() { set_env(name_.c_str(), had_ ? old_.c_str() : nullptr); }

}  // namespace gla::test
