// The `gla` command: run (the main job), backends, explain. Uses only the public C API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gla/dtype.hpp"
#include "gla/gla.h"
#include "gla/gla.hpp"

namespace {

const char* const kUsage =
    "usage: gla <command> [options]\n"
    "\n"
    "commands:\n"
    "  run        run a problem forward and backward on the backend the dispatcher picks, check it\n"
    "             against the reference backend, print the decision, errors and times\n"
    "  backends   list the registered backends with their availability\n"
    "  explain    print the dispatcher's verdict table for a problem\n"
    "\n"
    "problem options (run, explain):\n"
    "  --B N --T N --H N --K N --V N     sizes (default B=2 T=1000 H=4 K=64 V=64)\n"
    "  --dtype float32|float16|bfloat16  q/k/v dtype (default float32)\n"
    "  --gate-dtype same|float32         gate dtype (default same)\n"
    "  --per-head-gate                   g is [B, T, H]\n"
    "  --cu-seqlens 0,15,100             varlen offsets (then B must be 1; T defaults to the last)\n"
    "  --no-initial-state / --no-final-state\n"
    "  --state-v-first                   states are [N, H, V, K]\n"
    "  --backend NAME                    force a backend (or unit=name,... per unit)\n"
    "  --stage-pipeline                  run the stage pipeline even if a backend takes the whole op\n"
    "  --backward                        (explain) explain the backward instead of the forward\n"
    "  --device cpu                      (explain) device type to explain for: cpu or cuda\n"
    "  --repeat N                        (run) timed repetitions (default 3)\n"
    "  --seed N                          (run) random seed (default 0)\n";

struct Config {
  int64_t B = 2, T = 1000, H = 4, K = 64, V = 64;
  int32_t dtype = GLA_DTYPE_F32;
  bool gate_f32 = false, per_head = false, h0 = true, ht = true, v_first = false, pipeline = false;
  bool backward = false;
  int32_t device = GLA_DEVICE_CPU;
  std::vector<int64_t> cu;
  std::string backend;
  int repeat = 3;
  unsigned seed = 0;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "gla: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

int32_t parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32" || s == "f32") return GLA_DTYPE_F32;
  if (s == "float16" || s == "fp16" || s == "f16") return GLA_DTYPE_F16;
  if (s == "bfloat16" || s == "bf16") return GLA_DTYPE_BF16;
  usage_error("--dtype: expected float32, float16 or bfloat16, got '" + s + "'");
}

Config parse(int argc, char** argv, int first) {
  Config c;
  bool t_given = false;
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + ": expected a value");
      return argv[++i];
    };
    auto integer = [&]() -> int64_t {
      const std::string v = value();
      char* end = nullptr;
      const long long x = std::strtoll(v.c_str(), &end, 10);
      if (!end || *end || x < 0) usage_error(a + ": expected a non-negative integer, got '" + v + "'");
      return x;
    };
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--B") c.B = integer();
    else if (a == "--T") { c.T = integer(); t_given = true; }
    else if (a == "--H") c.H = integer();
    else if (a == "--K") c.K = integer();
    else if (a == "--V") c.V = integer();
    else if (a == "--dtype") c.dtype = parse_dtype(value());
    else if (a == "--gate-dtype") {
      const std::string v = value();
      if (v != "same" && parse_dtype(v) != GLA_DTYPE_F32) usage_error("--gate-dtype: expected same or float32");
      c.gate_f32 = v != "same";
    } else if (a == "--per-head-gate") c.per_head = true;
    else if (a == "--no-initial-state") c.h0 = false;
    else if (a == "--no-final-state") c.ht = false;
    else if (a == "--state-v-first") c.v_first = true;
    else if (a == "--stage-pipeline") c.pipeline = true;
    else if (a == "--backward") c.backward = true;
    else if (a == "--backend") c.backend = value();
    else if (a == "--repeat") c.repeat = static_cast<int>(std::max<int64_t>(1, integer()));
    else if (a == "--seed") c.seed = static_cast<unsigned>(integer());
    else if (a == "--device") {
      const std::string v = value();
      if (v == "cpu") c.device = GLA_DEVICE_CPU;
      else if (v == "cuda") c.device = GLA_DEVICE_CUDA;
      else usage_error("--device: expected cpu or cuda, got '" + v + "'");
    } else if (a == "--cu-seqlens") {
      const std::string v = value();
      size_t pos = 0;
      while (pos <= v.size()) {
        const size_t comma = v.find(',', pos);
        const std::string item = v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        if (item.empty()) usage_error("--cu-seqlens: expected comma-separated integers, got '" + v + "'");
        c.cu.push_back(std::strtoll(item.c_str(), nullptr, 10));
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else {
      usage_error("unknown option '" + a + "'");
    }
  }
  if (!c.cu.empty()) {
    if (!t_given) c.T = c.cu.back();
    c.B = 1;
  }
  return c;
}

// A host tensor owning its bytes.
struct Buffer {
  std::vector<unsigned char> bytes;
  gla_tensor t{};
  int64_t count = 0;
  Buffer() = default;
  Buffer(int32_t dtype, std::initializer_list<int64_t> sizes, int32_t device = GLA_DEVICE_CPU) {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    bytes.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * gla::dtype_size(dtype)));
    t = gla::tensor(bytes.data(), static_cast<gla_dtype>(dtype), sizes, static_cast<gla_device_type>(device));
    count = n;
  }
  int64_t size() const { return count; }
  double get(int64_t i) const { return gla::load_element(t.data, t.dtype, i); }
  void set(int64_t i, double x) { gla::store_element(t.data, t.dtype, i, x); }
  // Re-point the descriptor after a copy or move.
  void rebind() { t.data = bytes.data(); }
};

struct Problem {
  Config c;
  int64_t N;
  Buffer q, k, v, g, h0, dht, dout, cu;
  Buffer o, ht, dq, dk, dv, dg, dh0;
};

void fill(Buffer& b, std::mt19937_64& rng, int kind) {
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::normal_distribution<double> nrm(0.0, 1.0);
  for (int64_t i = 0; i < b.size(); ++i) {
    double x = kind == 0 ? uni(rng) : nrm(rng);
    if (kind == 2) x = -std::log1p(std::exp(-uni(rng)));  // logsigmoid(U[0,1))
    b.set(i, x);
  }
}

void make_problem(Problem& p, bool with_data) {
  const Config& c = p.c;
  p.N = c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1;
  const int32_t dev = with_data ? GLA_DEVICE_CPU : c.device;
  const int32_t gdt = c.gate_f32 ? GLA_DTYPE_F32 : c.dtype;
  p.q = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev);
  p.k = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev);
  p.v = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev);
  p.g = c.per_head ? Buffer(gdt, {c.B, c.T, c.H}, dev) : Buffer(gdt, {c.B, c.T, c.H, c.K}, dev);
  const auto state = [&] {
    return c.v_first ? Buffer(GLA_DTYPE_F32, {p.N, c.H, c.V, c.K}, dev) : Buffer(GLA_DTYPE_F32, {p.N, c.H, c.K, c.V}, dev);
  };
  p.h0 = state();
  p.dht = state();
  p.dout = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev);
  if (!c.cu.empty()) {
    p.cu = Buffer(GLA_DTYPE_I64, {static_cast<int64_t>(c.cu.size())}, dev);
    for (size_t i = 0; i < c.cu.size(); ++i) std::memcpy(p.cu.bytes.data() + i * 8, &c.cu[i], 8);
  }
  p.o = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev);
  p.ht = state();
  p.dq = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev);
  p.dk = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev);
  p.dv = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev);
  p.dg = c.per_head ? Buffer(gdt, {c.B, c.T, c.H}, dev) : Buffer(gdt, {c.B, c.T, c.H, c.K}, dev);
  p.dh0 = state();
  if (!with_data) {
    for (Buffer* b : {&p.q, &p.k, &p.v, &p.g, &p.h0, &p.dht, &p.dout, &p.cu, &p.o, &p.ht, &p.dq, &p.dk, &p.dv,
                      &p.dg, &p.dh0}) {
      b->t.data = nullptr;  // explain reads metadata only
    }
    return;
  }
  std::mt19937_64 rng(c.seed);
  fill(p.q, rng, 0);
  fill(p.k, rng, 0);
  fill(p.v, rng, 0);
  fill(p.g, rng, 2);
  fill(p.h0, rng, 1);
  fill(p.dht, rng, 1);
  fill(p.dout, rng, 1);
}

gla_chunk_forward_args forward_args(Problem& p) {
  gla_chunk_forward_args a{};
  a.q = &p.q.t;
  a.k = &p.k.t;
  a.v = &p.v.t;
  a.g = &p.g.t;
  a.initial_state = p.c.h0 ? &p.h0.t : nullptr;
  a.cu_seqlens = p.c.cu.empty() ? nullptr : &p.cu.t;
  a.o = &p.o.t;
  a.final_state = p.c.ht ? &p.ht.t : nullptr;
  return a;
}

gla_chunk_backward_args backward_args(Problem& p) {
  gla_chunk_backward_args a{};
  a.q = &p.q.t;
  a.k = &p.k.t;
  a.v = &p.v.t;
  a.g = &p.g.t;
  a.initial_state = p.c.h0 ? &p.h0.t : nullptr;
  a.cu_seqlens = p.c.cu.empty() ? nullptr : &p.cu.t;
  a.do_ = &p.dout.t;
  a.dht = p.c.ht ? &p.dht.t : nullptr;
  a.dq = &p.dq.t;
  a.dk = &p.dk.t;
  a.dv = &p.dv.t;
  a.dg = &p.dg.t;
  a.dh0 = p.c.h0 ? &p.dh0.t : nullptr;
  return a;
}

gla_options options_for(const Config& c, const char* backend) {
  gla_options o;
  gla_options_init(&o);
  o.state_v_first = c.v_first;
  o.backend = backend;
  o.force_stage_pipeline = c.pipeline;
  return o;
}

void check(gla_status s, const char* what) {
  if (s != GLA_STATUS_OK) {
    std::fprintf(stderr, "gla: %s failed (%s): %s\n", what, gla_status_name(s), gla_last_error());
    std::exit(1);
  }
}

std::string decision_line(const char* text) {
  const char* d = std::strstr(text, "decision: ");
  if (!d) return "?";
  std::string s(d + 10);
  return s.substr(0, s.find('\n'));
}

double rel_rms(const Buffer& out, const Buffer& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < ref.size(); ++i) {
    const double a = out.get(i), b = ref.get(i);
    if (!std::isfinite(a)) return INFINITY;
    num += (a - b) * (a - b);
    den += b * b;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

void poison(Buffer& b) {
  for (int64_t i = 0; i < b.size(); ++i) b.set(i, NAN);
}

int cmd_backends() {
  const int32_t n = gla_backend_count();
  std::printf("%-12s %-9s %-10s %s\n", "backend", "priority", "status", "reason");
  for (int32_t i = 0; i < n; ++i) {
    const char *name = nullptr, *reason = nullptr;
    int32_t priority = 0, available = 0;
    check(gla_backend_info(i, &name, &priority, &available, &reason), "gla_backend_info");
    std::printf("%-12s %-9d %-10s %s\n", name, priority, available ? "available" : "no", reason);
  }
  return 0;
}

int cmd_explain(const Config& c) {
  Problem p{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(p, false);
  const gla_options opts = options_for(c, c.backend.empty() ? nullptr : c.backend.c_str());
  const char* text = nullptr;
  gla_chunk_forward_args fa = forward_args(p);
  gla_chunk_backward_args ba = backward_args(p);
  check(gla_explain(c.backward ? nullptr : &fa, c.backward ? &ba : nullptr, &opts, &text), "explain");
  std::fputs(text, stdout);
  return 0;
}

int cmd_run(const Config& c) {
  if (c.device != GLA_DEVICE_CPU) usage_error("run: only --device cpu is supported by the command line");
  Problem p{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(p, true);
  const char* forced = c.backend.empty() ? nullptr : c.backend.c_str();
  gla_options opts = options_for(c, forced);
  gla_chunk_forward_args fa = forward_args(p);
  gla_chunk_backward_args ba = backward_args(p);
  const char* text = nullptr;
  check(gla_explain(&fa, nullptr, &opts, &text), "explain forward");
  const std::string fwd_decision = decision_line(text);
  check(gla_explain(nullptr, &ba, &opts, &text), "explain backward");
  const std::string bwd_decision = decision_line(text);

  std::printf("problem: B=%lld T=%lld H=%lld K=%lld V=%lld N=%lld dtype=%s%s%s%s\n", (long long)c.B, (long long)c.T,
              (long long)c.H, (long long)c.K, (long long)c.V, (long long)p.N, gla::dtype_name(c.dtype),
              c.cu.empty() ? "" : " varlen", c.h0 ? " +initial_state" : "", c.ht ? " +final_state" : "");
  std::printf("forward  -> %s\nbackward -> %s\n", fwd_decision.c_str(), bwd_decision.c_str());

  using clock = std::chrono::steady_clock;
  auto timed = [&](auto&& fn) {
    std::vector<double> ms;
    for (int r = 0; r < c.repeat; ++r) {
      const auto t0 = clock::now();
      fn();
      ms.push_back(std::chrono::duration<double, std::milli>(clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  for (Buffer* b : {&p.o, &p.ht, &p.dq, &p.dk, &p.dv, &p.dg, &p.dh0}) poison(*b);
  const double fwd_ms = timed([&] { check(gla_chunk_forward(&fa, &opts), "forward"); });
  const double bwd_ms = timed([&] { check(gla_chunk_backward(&ba, &opts), "backward"); });

  // Reference outputs on fresh buffers.
  Problem r{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(r, true);
  gla_options ropts = options_for(c, "reference");
  ropts.force_stage_pipeline = 0;
  gla_chunk_forward_args rfa = forward_args(r);
  gla_chunk_backward_args rba = backward_args(r);
  const bool reference_ran = fwd_decision.rfind("reference", 0) == 0 && bwd_decision.rfind("reference", 0) == 0;
  double ref_fwd_ms = 0, ref_bwd_ms = 0;
  ref_fwd_ms = timed([&] { check(gla_chunk_forward(&rfa, &ropts), "reference forward"); });
  ref_bwd_ms = timed([&] { check(gla_chunk_backward(&rba, &ropts), "reference backward"); });

  // SPEC.md §5: fp32 < 1e-5 for CPU backends, 16-bit < 5e-3.
  const double bar = c.dtype == GLA_DTYPE_F32 ? 1e-5 : 5e-3;
  struct Out { const char* name; Buffer* a; Buffer* b; bool on; };
  const Out outs[] = {{"o", &p.o, &r.o, true},       {"final_state", &p.ht, &r.ht, c.ht}, {"dq", &p.dq, &r.dq, true},
                      {"dk", &p.dk, &r.dk, true},    {"dv", &p.dv, &r.dv, true},           {"dg", &p.dg, &r.dg, true},
                      {"dh0", &p.dh0, &r.dh0, c.h0}};
  bool ok = true;
  std::printf("%s against reference (bar %.0e):\n", reference_ran ? "reference ran itself; repeat check" : "check", bar);
  for (const auto& o : outs) {
    if (!o.on) continue;
    const double e = rel_rms(*o.a, *o.b);
    const bool pass = e < bar;
    ok = ok && pass;
    std::printf("  %-12s rel RMS %.3e  %s\n", o.name, e, pass ? "ok" : "MISMATCH");
  }
  std::printf("time: forward %.3f ms, backward %.3f ms (median of %d); reference forward %.3f ms, backward %.3f ms\n",
              fwd_ms, bwd_ms, c.repeat, ref_fwd_ms, ref_bwd_ms);
  if (!reference_ran) {
    std::printf("speed-up over reference: forward %.1fx, backward %.1fx\n", ref_fwd_ms / fwd_ms, ref_bwd_ms / bwd_ms);
  }
  std::printf("%s\n", ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) usage_error("expected a command");
  const std::string cmd = argv[1];
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (cmd == "backends") {
    if (argc > 2 && (std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0)) {
      std::puts("usage: gla backends\n  lists every registered backend, its priority and availability");
      return 0;
    }
    return cmd_backends();
  }
  if (cmd == "explain") return cmd_explain(parse(argc, argv, 2));
  if (cmd == "run") return cmd_run(parse(argc, argv, 2));
  usage_error("unknown command '" + cmd + "'");
}
