#include "cli_args.hpp"

#include <optional>

#include "gla/checked.hpp"
#include "gla/dtype.hpp"

namespace gla::cli {

namespace {

// Decimal digits only (no sign, space or exponent), at most `max`.
std::optional<int64_t> parse_integer(const std::string& text, int64_t max) {
  if (text.empty()) return std::nullopt;
  std::optional<int64_t> value = 0;
  for (char ch : text) {
    if (ch < '0' || ch > '9') return std::nullopt;
    value = checked_add(checked_mul(value, int64_t{10}), int64_t{ch - '0'});
    if (!value || *value > max) return std::nullopt;
  }
  return value;
}

std::optional<int32_t> parse_dtype(const std::string& s) {
  if (s == "float32" || s == "fp32" || s == "f32") return GLA_DTYPE_F32;
  if (s == "float16" || s == "fp16" || s == "f16") return GLA_DTYPE_F16;
  if (s == "bfloat16" || s == "bf16") return GLA_DTYPE_BF16;
  return std::nullopt;
}

}  // namespace

ParseResult parse_args(const std::vector<std::string>& args) {
  ParseResult r;
  Config& c = r.config;
  auto error = [&](const std::string& message) {
    r.kind = ParseResult::kError;
    r.error = message;
    return r;
  };
  bool t_given = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const bool has_value = i + 1 < args.size();
    const std::string v = has_value ? args[i + 1] : std::string();
    auto takes_value = [&] {
      if (has_value) ++i;
      return has_value;
    };
    // A number option: its value, or an error result.
    auto number = [&](int64_t min, int64_t max, int64_t& out) -> bool {
      if (!takes_value()) {
        error(a + ": expected a value");
        return false;
      }
      const auto x = parse_integer(v, max);
      if (!x || *x < min) {
        error(a + ": expected an integer from " + std::to_string(min) + " to " + std::to_string(max) + ", got '" + v +
              "'");
        return false;
      }
      out = *x;
      return true;
    };
    int64_t x = 0;
    if (a == "--help" || a == "-h") {
      r.kind = ParseResult::kHelp;
      return r;
    } else if (a == "--B" || a == "--T" || a == "--H" || a == "--K" || a == "--V") {
      if (!number(0, INT64_MAX, x)) return r;
      (a == "--B" ? c.B : a == "--T" ? c.T : a == "--H" ? c.H : a == "--K" ? c.K : c.V) = x;
      t_given = t_given || a == "--T";
    } else if (a == "--dtype" || a == "--gate-dtype") {
      if (!takes_value()) return error(a + ": expected a value");
      if (a == "--gate-dtype") {
        if (v != "same" && parse_dtype(v) != GLA_DTYPE_F32) {
          return error("--gate-dtype: expected same or float32, got '" + v + "'");
        }
        c.gate_f32 = v != "same";
      } else {
        const auto d = parse_dtype(v);
        if (!d) return error("--dtype: expected float32, float16 or bfloat16, got '" + v + "'");
        c.dtype = *d;
      }
    } else if (a == "--per-head-gate") c.per_head = true;
    else if (a == "--no-initial-state") c.h0 = false;
    else if (a == "--no-final-state") c.ht = false;
    else if (a == "--state-v-first") c.v_first = true;
    else if (a == "--stage-pipeline") c.pipeline = true;
    else if (a == "--backward") c.backward = true;
    else if (a == "--no-gk") c.gk = false;
    else if (a == "--gv") c.gv = true;
    else if (a == "--reverse") c.reverse = true;
    else if (a == "--op") {
      if (!takes_value()) return error(a + ": expected a value");
      if (v != "chunk" && v != "recurrent") return error("--op: expected chunk or recurrent, got '" + v + "'");
      c.recurrent = v == "recurrent";
    } else if (a == "--backend") {
      if (!takes_value()) return error(a + ": expected a value");
      c.backend = v;
    } else if (a == "--repeat") {
      if (!number(1, 1000000, x)) return r;
      c.repeat = static_cast<int>(x);
    } else if (a == "--seed") {
      if (!number(0, UINT32_MAX, x)) return r;
      c.seed = static_cast<unsigned>(x);
    } else if (a == "--device") {
      if (!takes_value()) return error(a + ": expected a value");
      if (v == "cpu") c.device = GLA_DEVICE_CPU;
      else if (v == "cuda") c.device = GLA_DEVICE_CUDA;
      else return error("--device: expected cpu or cuda, got '" + v + "'");
    } else if (a == "--cu-seqlens") {
      if (!takes_value()) return error(a + ": expected a value");
      c.cu.clear();
      size_t pos = 0;
      while (true) {
        const size_t comma = v.find(',', pos);
        const std::string item = v.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        const auto offset = parse_integer(item, INT64_MAX);
        if (!offset) {
          return error("--cu-seqlens: expected comma-separated non-negative integers, got '" + item + "' in '" + v +
                       "'");
        }
        c.cu.push_back(*offset);
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else {
      return error("unknown option '" + a + "'");
    }
  }
  if (!c.cu.empty()) {
    if (!t_given) c.T = c.cu.back();
    c.B = 1;
  }
  if (!c.recurrent && (!c.gk || c.gv || c.reverse)) return error("--no-gk, --gv and --reverse need --op recurrent");
  if (c.recurrent && (c.per_head || c.pipeline)) return error("--op recurrent: no --per-head-gate or --stage-pipeline");
  return r;
}

int64_t sequence_count(const Config& c) { return c.cu.empty() ? c.B : static_cast<int64_t>(c.cu.size()) - 1; }

ProblemBytes problem_bytes(const Config& c) {
  ProblemBytes r;
  const int64_t ds = dtype_size(c.dtype), gs = c.gate_f32 ? 4 : ds;
  const auto rows = checked_product({c.B, c.T, c.H});
  const auto qk = checked_mul(rows, c.K), v = checked_mul(rows, c.V), g = c.per_head ? rows : qk;
  const auto state = checked_product({sequence_count(c), c.H, c.K, c.V});
  // Per problem: q, k, dq, dk; v, do, o, dv; g, dg; initial, final, dht, dh0; cu_seqlens. `run`
  // holds two (its own and the reference's).
  std::optional<int64_t> one = checked_add(checked_mul(checked_mul(qk, ds), int64_t{4}), checked_mul(checked_mul(v, ds), int64_t{4}));
  one = checked_add(one, checked_mul(checked_mul(g, gs), int64_t{2}));
  if (c.gv) one = checked_add(one, checked_mul(checked_mul(v, gs), int64_t{2}));  // gv, dgv
  one = checked_add(one, checked_mul(state, int64_t{16}));
  one = checked_add(one, checked_mul(static_cast<int64_t>(c.cu.size()), int64_t{8}));
  const auto total = checked_mul(one, int64_t{2});
  if (!total) {
    r.error = "problem too large: B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) +
              " K=" + std::to_string(c.K) + " V=" + std::to_string(c.V) + " N=" + std::to_string(sequence_count(c)) +
              ": the buffers' sizes (B·T·H·K, B·T·H·V, N·H·K·V elements) overflow int64";
    return r;
  }
  r.ok = true;
  r.bytes = *total;
  return r;
}

}  // namespace gla::cli
