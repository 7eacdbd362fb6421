// The `gla` command: run (the main job), backends, explain, tune. Uses only the public C API.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <random>
#include <string>
#include <vector>

#if defined(__linux__)
#include <unistd.h>
#endif

#include "cli_args.hpp"
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
    "  tune       measure the `fastest` policy's candidates for a problem (forward and backward) on\n"
    "             random host inputs and print the times and the winners; with GLA_TUNE_FILE set the\n"
    "             winners are written there for later processes (GLA_POLICY=fastest)\n"
    "\n"
    "problem options (run, explain, tune):\n"
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
    "  --op chunk|recurrent              the chunked operator (default) or the recurrent one\n"
    "                                    (gla_recurrent_*: the token loop of fused_recurrent_gla)\n"
    "  --no-gk / --gv / --reverse        (recurrent) no key gate / a value gate / last token first\n"
    "  --repeat N                        (run) timed repetitions (default 3)\n"
    "  --seed N                          (run) random seed (default 0)\n";

using gla::cli::Config;

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "gla: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

// for_run: the command allocates the problem on the host (explain reads metadata only).
Config parse(int argc, char** argv, int first, bool for_run) {
  const gla::cli::ParseResult r = gla::cli::parse_args(std::vector<std::string>(argv + first, argv + argc));
  if (r.kind == gla::cli::ParseResult::kHelp) {
    std::fputs(kUsage, stdout);
    std::exit(0);
  }
  if (r.kind == gla::cli::ParseResult::kError) usage_error(r.error);
  // Sizes whose buffers cannot even be described are an argument error, before any allocation.
  const gla::cli::ProblemBytes bytes = gla::cli::problem_bytes(r.config);
  if (!bytes.ok) usage_error(bytes.error);
#if defined(__linux__)
  // More than the machine has would be granted lazily and then killed while being filled.
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (for_run && pages > 0 && page > 0 && bytes.bytes / page > pages) {
    std::fprintf(stderr, "gla: the problem needs %lld bytes of host memory, more than this machine's %lld\n",
                 static_cast<long long>(bytes.bytes), static_cast<long long>(pages) * page);
    std::exit(1);
  }
#endif
  return r.config;
}

// A host tensor owning its bytes.
struct Buffer {
  std::vector<unsigned char> bytes;
  gla_tensor t{};
  int64_t count = 0;
  Buffer() = default;
  // Sizes already checked by gla::cli::problem_bytes. Without `allocate` only the descriptor is made
  // (explain reads metadata only).
  Buffer(int32_t dtype, std::initializer_list<int64_t> sizes, int32_t device, bool allocate) {
    int64_t n = 1;
    for (int64_t s : sizes) n *= s;
    if (allocate) bytes.resize(static_cast<size_t>(std::max<int64_t>(n, 1) * gla::dtype_size(dtype)));
    t = gla::tensor(allocate ? bytes.data() : nullptr, static_cast<gla_dtype>(dtype), sizes,
                    static_cast<gla_device_type>(device));
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
  Buffer gv, dgv;  // the recurrent operator's value gate
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
  p.N = gla::cli::sequence_count(c);
  const int32_t dev = with_data ? GLA_DEVICE_CPU : c.device;
  const int32_t gdt = c.gate_f32 ? GLA_DTYPE_F32 : c.dtype;
  p.q = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev, with_data);
  p.k = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev, with_data);
  p.v = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev, with_data);
  p.g = c.per_head ? Buffer(gdt, {c.B, c.T, c.H}, dev, with_data) : Buffer(gdt, {c.B, c.T, c.H, c.K}, dev, with_data);
  const auto state = [&] {
    return c.v_first ? Buffer(GLA_DTYPE_F32, {p.N, c.H, c.V, c.K}, dev, with_data) : Buffer(GLA_DTYPE_F32, {p.N, c.H, c.K, c.V}, dev, with_data);
  };
  p.h0 = state();
  p.dht = state();
  p.dout = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev, with_data);
  if (!c.cu.empty()) {
    p.cu = Buffer(GLA_DTYPE_I64, {static_cast<int64_t>(c.cu.size())}, dev, with_data);
    if (with_data) std::memcpy(p.cu.bytes.data(), c.cu.data(), c.cu.size() * 8);
  }
  p.o = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev, with_data);
  p.ht = state();
  p.dq = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev, with_data);
  p.dk = Buffer(c.dtype, {c.B, c.T, c.H, c.K}, dev, with_data);
  p.dv = Buffer(c.dtype, {c.B, c.T, c.H, c.V}, dev, with_data);
  p.dg = c.per_head ? Buffer(gdt, {c.B, c.T, c.H}, dev, with_data) : Buffer(gdt, {c.B, c.T, c.H, c.K}, dev, with_data);
  p.dh0 = state();
  p.gv = Buffer(gdt, {c.B, c.T, c.H, c.V}, dev, with_data && c.gv);
  p.dgv = Buffer(gdt, {c.B, c.T, c.H, c.V}, dev, with_data && c.gv);
  if (!with_data) return;
  std::mt19937_64 rng(c.seed);
  fill(p.q, rng, 0);
  fill(p.k, rng, 0);
  fill(p.v, rng, 0);
  fill(p.g, rng, 2);
  fill(p.h0, rng, 1);
  fill(p.dht, rng, 1);
  fill(p.dout, rng, 1);
  if (c.gv) fill(p.gv, rng, 2);
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

gla_recurrent_forward_args recurrent_forward_args(Problem& p) {
  const gla_chunk_forward_args f = forward_args(p);
  return {f.q, f.k, f.v, p.c.gk ? f.g : nullptr, p.c.gv ? &p.gv.t : nullptr, f.initial_state, f.cu_seqlens,
          nullptr, f.o, f.final_state, p.c.reverse};
}

gla_recurrent_backward_args recurrent_backward_args(Problem& p) {
  const gla_chunk_backward_args b = backward_args(p);
  return {b.q, b.k, b.v, p.c.gk ? b.g : nullptr, p.c.gv ? &p.gv.t : nullptr, b.initial_state, b.cu_seqlens, nullptr,
          b.do_, b.dht, b.dq, b.dk, b.dv, p.c.gk ? b.dg : nullptr, p.c.gv ? &p.dgv.t : nullptr, b.dh0, p.c.reverse};
}

// The operator the command runs: the chunked one or (--op recurrent) the recurrent one.
gla_status run_forward(Problem& p, const gla_options& o) {
  if (!p.c.recurrent) {
    const gla_chunk_forward_args a = forward_args(p);
    return gla_chunk_forward(&a, &o);
  }
  const gla_recurrent_forward_args a = recurrent_forward_args(p);
  return gla_recurrent_forward(&a, &o);
}
gla_status run_backward(Problem& p, const gla_options& o) {
  if (!p.c.recurrent) {
    const gla_chunk_backward_args a = backward_args(p);
    return gla_chunk_backward(&a, &o);
  }
  const gla_recurrent_backward_args a = recurrent_backward_args(p);
  return gla_recurrent_backward(&a, &o);
}
gla_status explain_problem(Problem& p, const gla_options& o, bool backward, const char** text) {
  if (!p.c.recurrent) {
    const gla_chunk_forward_args f = forward_args(p);
    const gla_chunk_backward_args b = backward_args(p);
    return gla_explain(backward ? nullptr : &f, backward ? &b : nullptr, &o, text);
  }
  const gla_recurrent_forward_args f = recurrent_forward_args(p);
  const gla_recurrent_backward_args b = recurrent_backward_args(p);
  return gla_recurrent_explain(backward ? nullptr : &f, backward ? &b : nullptr, nullptr, &o, text);
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
  Problem p{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(p, false);
  const gla_options opts = options_for(c, c.backend.empty() ? nullptr : c.backend.c_str());
  const char* text = nullptr;
  check(explain_problem(p, opts, c.backward, &text), "explain");
  std::fputs(text, stdout);
  return 0;
}

int cmd_tune(const Config& c) {
  if (c.device != GLA_DEVICE_CPU) usage_error("tune: only --device cpu is supported by the command line");
  if (c.recurrent) usage_error("tune: the chunked operator only (--op chunk)");
  if (!c.backend.empty() || c.pipeline) usage_error("tune: --backend and --stage-pipeline fix the choice it measures");
  Problem p{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(p, true);
  const gla_options opts = options_for(c, nullptr);
  const gla_chunk_forward_args f = forward_args(p);
  const gla_chunk_backward_args b = backward_args(p);
  const char* text = nullptr;
  check(gla_tune(&f, nullptr, &opts, &text), "tune forward");
  std::printf("== forward\n%s", text);
  check(gla_tune(nullptr, &b, &opts, &text), "tune backward");
  std::printf("== backward\n%s", text);
  return 0;
}

int cmd_run(const Config& c) {
  if (c.device != GLA_DEVICE_CPU) usage_error("run: only --device cpu is supported by the command line");
  Problem p{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(p, true);
  const char* forced = c.backend.empty() ? nullptr : c.backend.c_str();
  gla_options opts = options_for(c, forced);
  const char* text = nullptr;
  check(explain_problem(p, opts, false, &text), "explain forward");
  const std::string fwd_decision = decision_line(text);
  check(explain_problem(p, opts, true, &text), "explain backward");
  const std::string bwd_decision = decision_line(text);

  std::printf("problem: %s B=%lld T=%lld H=%lld K=%lld V=%lld N=%lld dtype=%s%s%s%s%s\n", c.recurrent ? "recurrent" : "chunk",
              (long long)c.B, (long long)c.T, (long long)c.H, (long long)c.K, (long long)c.V, (long long)p.N,
              gla::dtype_name(c.dtype), c.cu.empty() ? "" : " varlen", c.h0 ? " +initial_state" : "",
              c.ht ? " +final_state" : "",
              !c.recurrent ? "" : c.gk && c.gv ? " gk+gv" : c.gv ? " gv" : c.gk ? " gk" : " no gates");
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
  if (c.gv) poison(p.dgv);
  const double fwd_ms = timed([&] { check(run_forward(p, opts), "forward"); });
  const double bwd_ms = timed([&] { check(run_backward(p, opts), "backward"); });

  // Reference outputs on fresh buffers.
  Problem r{c, 0, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  make_problem(r, true);
  gla_options ropts = options_for(c, "reference");
  ropts.force_stage_pipeline = 0;
  const bool reference_ran = fwd_decision.rfind("reference", 0) == 0 && bwd_decision.rfind("reference", 0) == 0;
  double ref_fwd_ms = 0, ref_bwd_ms = 0;
  ref_fwd_ms = timed([&] { check(run_forward(r, ropts), "reference forward"); });
  ref_bwd_ms = timed([&] { check(run_backward(r, ropts), "reference backward"); });

  // SPEC.md §5: fp32 < 1e-5 for CPU backends, 16-bit < 5e-3.
  const double bar = c.dtype == GLA_DTYPE_F32 ? 1e-5 : 5e-3;
  struct Out { const char* name; Buffer* a; Buffer* b; bool on; };
  const Out outs[] = {{"o", &p.o, &r.o, true},       {"final_state", &p.ht, &r.ht, c.ht}, {"dq", &p.dq, &r.dq, true},
                      {"dk", &p.dk, &r.dk, true},    {"dv", &p.dv, &r.dv, true},
                      {c.recurrent ? "dgk" : "dg", &p.dg, &r.dg, c.gk},                   {"dgv", &p.dgv, &r.dgv, c.gv},
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
  // The buffers of a problem whose sizes fit in int64 may still exceed the machine's memory.
  try {
    if (cmd == "explain") return cmd_explain(parse(argc, argv, 2, false));
    if (cmd == "run") return cmd_run(parse(argc, argv, 2, true));
    if (cmd == "tune") return cmd_tune(parse(argc, argv, 2, true));
  } catch (const std::bad_alloc&) {
    const Config c = parse(argc, argv, 2, false);
    std::fprintf(stderr, "gla: cannot allocate the problem's buffers (%lld bytes on the host for B=%lld T=%lld H=%lld K=%lld V=%lld): out of memory\n",
                 static_cast<long long>(gla::cli::problem_bytes(c).bytes), static_cast<long long>(c.B),
                 static_cast<long long>(c.T), static_cast<long long>(c.H), static_cast<long long>(c.K),
                 static_cast<long long>(c.V));
    return 1;
  }
  usage_error("unknown command '" + cmd + "'");
}
