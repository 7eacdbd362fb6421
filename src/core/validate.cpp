#include "core/validate.hpp"

#include <cmath>
#include <cstring>
#include <sstream>
#include <string>

namespace gla {

namespace {

std::string device_string(int32_t type, int32_t index) {
  return std::string(device_type_name(type)) + ":" + std::to_string(index);
}

[[noreturn]] void invalid(const std::string& message) { fail(GLA_STATUS_INVALID_ARGUMENT, message); }

bool is_float_dtype(int32_t d) { return d == GLA_DTYPE_F32 || d == GLA_DTYPE_F16 || d == GLA_DTYPE_BF16; }

std::string sizes_string(std::initializer_list<int64_t> sizes) {
  std::ostringstream s;
  s << '[';
  bool first = true;
  for (int64_t x : sizes) {
    s << (first ? "" : ", ") << x;
    first = false;
  }
  s << ']';
  return s.str();
}

// Checks that the descriptor is well formed: rank in range, non-negative sizes and strides, a data
// pointer when it has elements (unless metadata_only), a known dtype.
void check_descriptor(const char* name, const gla_tensor& t, bool metadata_only) {
  if (t.rank < 0 || t.rank > GLA_MAX_RANK) {
    invalid(std::string(name) + ": expected rank between 0 and " + std::to_string(GLA_MAX_RANK) +
            ", got " + std::to_string(t.rank));
  }
  for (int i = 0; i < t.rank; ++i) {
    if (t.sizes[i] < 0) {
      invalid(std::string(name) + ": expected non-negative sizes, got " + shape_string(t));
    }
    if (t.strides[i] < 0) {
      invalid(std::string(name) + ": expected non-negative strides, got stride " +
              std::to_string(t.strides[i]) + " in dim " + std::to_string(i));
    }
  }
  if (dtype_size(t.dtype) == 0) {
    invalid(std::string(name) + ": unknown dtype code " + std::to_string(t.dtype));
  }
  if (!metadata_only && t.data == nullptr && numel(t) > 0) {
    invalid(std::string(name) + ": data pointer is NULL for a tensor of " + std::to_string(numel(t)) +
            " elements");
  }
}

const gla_tensor& required(const char* name, const gla_tensor* t) {
  if (t == nullptr) invalid(std::string(name) + ": required tensor is missing (got NULL)");
  return *t;
}

void check_dtype(const char* name, const gla_tensor& t, int32_t expected, const char* why) {
  if (t.dtype != expected) {
    invalid(std::string(name) + ": expected dtype " + dtype_name(expected) + why + ", got " +
            dtype_name(t.dtype));
  }
}

void check_shape(const char* name, const gla_tensor& t, std::initializer_list<int64_t> expected,
                 const char* layout) {
  bool ok = t.rank == static_cast<int32_t>(expected.size());
  if (ok) {
    int i = 0;
    for (int64_t s : expected) ok = ok && t.sizes[i++] == s;
  }
  if (!ok) {
    invalid(std::string(name) + ": expected shape " + sizes_string(expected) + " (" + layout + "), got " +
            shape_string(t));
  }
}

void check_same_device(const char* name, const gla_tensor& t, const gla_tensor& q) {
  if (t.device_type != q.device_type || t.device_index != q.device_index) {
    invalid(std::string(name) + ": expected device " + device_string(q.device_type, q.device_index) +
            " (same as q), got " + device_string(t.device_type, t.device_index));
  }
}

// Shared by forward and backward: q, k, v, g, initial_state, cu_seqlens, cu_seqlens_host.
struct CommonInputs {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* g;
  const gla_tensor* initial_state;
  const gla_tensor* cu_seqlens;
  const gla_tensor* cu_seqlens_host;
};

void prepare_common(PreparedProblem& out, const CommonInputs& in, const gla_options& options,
                    bool metadata_only) {
  gla_problem& p = out.problem;
  const gla_tensor& q = required("q", in.q);
  const gla_tensor& k = required("k", in.k);
  const gla_tensor& v = required("v", in.v);
  const gla_tensor& g = required("g", in.g);
  check_descriptor("q", q, metadata_only);
  check_descriptor("k", k, metadata_only);
  check_descriptor("v", v, metadata_only);
  check_descriptor("g", g, metadata_only);

  if (q.rank != 4) invalid("q: expected rank 4 [B, T, H, K], got rank " + std::to_string(q.rank) + " " + shape_string(q));
  if (!is_float_dtype(q.dtype)) {
    invalid(std::string("q: expected dtype float32, float16 or bfloat16, got ") + dtype_name(q.dtype));
  }
  const int64_t B = q.sizes[0], T = q.sizes[1], H = q.sizes[2], K = q.sizes[3];
  if (K == 0) invalid("q: expected K (dim 3) > 0, got K = 0 in shape " + shape_string(q));
  check_dtype("k", k, q.dtype, " (same as q)");
  check_dtype("v", v, q.dtype, " (same as q)");
  check_shape("k", k, {B, T, H, K}, "[B, T, H, K] as q");
  if (v.rank != 4 || v.sizes[0] != B || v.sizes[1] != T || v.sizes[2] != H) {
    invalid("v: expected shape [" + std::to_string(B) + ", " + std::to_string(T) + ", " + std::to_string(H) +
            ", V] ([B, T, H, V] matching q), got " + shape_string(v));
  }
  const int64_t V = v.sizes[3];
  if (V == 0) invalid("v: expected V (dim 3) > 0, got V = 0 in shape " + shape_string(v));
  if (g.dtype != q.dtype && g.dtype != GLA_DTYPE_F32) {
    invalid(std::string("g: expected dtype ") + dtype_name(q.dtype) + " (same as q) or float32, got " +
            dtype_name(g.dtype));
  }
  bool per_head = false;
  if (g.rank == 3) {
    per_head = true;
    check_shape("g", g, {B, T, H}, "[B, T, H] per-head gate");
  } else {
    check_shape("g", g, {B, T, H, K}, "[B, T, H, K] per-key gate, or [B, T, H] per-head gate");
  }
  check_same_device("k", k, q);
  check_same_device("v", v, q);
  check_same_device("g", g, q);

  p.B = B;
  p.T = T;
  p.H = H;
  p.K = K;
  p.V = V;
  p.gate_per_head = per_head;
  p.dtype = q.dtype;
  p.gate_dtype = g.dtype;
  p.device_type = q.device_type;
  p.device_index = q.device_index;
  p.q = q;
  p.k = k;
  p.v = v;
  p.g = g;
  p.state_v_first = options.state_v_first ? 1 : 0;
  if (options.has_scale) {
    if (!std::isfinite(options.scale)) invalid("scale: expected a finite number, got " + std::to_string(options.scale));
    p.scale = options.scale;
  } else {
    p.scale = 1.0 / std::sqrt(static_cast<double>(K));
  }
  p.stream = options.stream;

  // Sequences.
  int64_t N = B;
  if (in.cu_seqlens) {
    const gla_tensor& cu = *in.cu_seqlens;
    check_descriptor("cu_seqlens", cu, metadata_only);
    if (cu.dtype != GLA_DTYPE_I32 && cu.dtype != GLA_DTYPE_I64) {
      invalid(std::string("cu_seqlens: expected dtype int32 or int64, got ") + dtype_name(cu.dtype));
    }
    if (cu.rank != 1 || cu.sizes[0] < 1) {
      invalid("cu_seqlens: expected shape [N + 1] with N >= 0, got " + shape_string(cu));
    }
    if (B != 1) invalid("cu_seqlens: requires B == 1 (sequences packed along T), got B = " + std::to_string(B));
    check_same_device("cu_seqlens", cu, q);
    N = cu.sizes[0] - 1;
    p.varlen = 1;
    p.cu_seqlens = cu;
    if (in.cu_seqlens_host) {
      const gla_tensor& hc = *in.cu_seqlens_host;
      check_descriptor("cu_seqlens_host", hc, metadata_only);
      if (!host_accessible(hc.device_type)) {
        invalid(std::string("cu_seqlens_host: expected host memory, got device ") +
                device_string(hc.device_type, hc.device_index));
      }
      if (hc.rank != 1 || hc.sizes[0] != cu.sizes[0] || (hc.dtype != GLA_DTYPE_I32 && hc.dtype != GLA_DTYPE_I64)) {
        invalid("cu_seqlens_host: expected an int32/int64 host copy of shape " + shape_string(cu) + ", got " +
                std::string(dtype_name(hc.dtype)) + " " + shape_string(hc));
      }
      // Host memory is readable even for metadata-only queries (workspace sizing, explain), so
      // backends that plan from the offsets see the real ones there too.
      if (hc.data) load_sequence_offsets(out, hc.data);
    } else if (host_accessible(cu.device_type) && cu.data) {
      load_sequence_offsets(out, cu.data);
    }
    if (out.seq_offsets.empty() && !metadata_only) {
      if (!host_accessible(cu.device_type)) {
        out.offsets_need_copy = true;
      } else {
        load_sequence_offsets(out, cu.data);  // NULL data was rejected above unless N + 1 == 0
      }
    }
  } else if (in.cu_seqlens_host) {
    invalid("cu_seqlens_host: given without cu_seqlens");
  }
  p.N = N;
  if (!p.varlen || (metadata_only && out.seq_offsets.empty())) {
    out.seq_offsets.resize(static_cast<size_t>(N + 1));
    // Without cu_seqlens each sequence is its own batch row, starting at token 0 of that row; for a
    // metadata-only query of a varlen problem whose offsets live on a device they are unknown and
    // only the count matters.
    for (int64_t n = 0; n <= N; ++n) out.seq_offsets[n] = p.varlen ? 0 : n * T;
  }

  // initial_state
  if (in.initial_state) {
    const gla_tensor& h0 = *in.initial_state;
    check_descriptor("initial_state", h0, metadata_only);
    check_dtype("initial_state", h0, GLA_DTYPE_F32, " (states are always fp32)");
    if (p.state_v_first) {
      check_shape("initial_state", h0, {N, H, V, K}, "[N, H, V, K] with state_v_first");
    } else {
      check_shape("initial_state", h0, {N, H, K, V}, "[N, H, K, V]");
    }
    check_same_device("initial_state", h0, q);
    p.initial_state = h0;
  }
  out.bind();
}

void check_state_like(const char* name, const gla_tensor& t, const gla_problem& p, bool metadata_only) {
  check_descriptor(name, t, metadata_only);
  check_dtype(name, t, GLA_DTYPE_F32, " (states are always fp32)");
  if (p.state_v_first) {
    check_shape(name, t, {p.N, p.H, p.V, p.K}, "[N, H, V, K] with state_v_first");
  } else {
    check_shape(name, t, {p.N, p.H, p.K, p.V}, "[N, H, K, V]");
  }
  check_same_device(name, t, p.q);
}

// The saved chunk states (gla_chunk_forward_saving_states / gla_chunk_backward_from_states in gla.h):
// [NC, H, K, V] f32, contiguous, q's device; stored in problem.h of the whole operation.
// NC depends on the sequence lengths: checked here when they are on the host, else by
// check_chunk_states_count once execute() has loaded them.
constexpr int64_t kSavedStateChunk = 64;
void check_chunk_states(const gla_tensor& t, PreparedProblem& out, bool metadata_only) {
  const gla_problem& p = out.problem;
  check_descriptor("chunk_states", t, metadata_only);
  check_dtype("chunk_states", t, GLA_DTYPE_F32, " (saved chunk states are fp32)");
  const bool lengths_known = !out.offsets_need_copy && !out.seq_offsets.empty();
  const int64_t nc = lengths_known ? saved_state_chunks(p) : (t.rank == 4 ? t.sizes[0] : 0);
  check_shape("chunk_states", t, {nc, p.H, p.K, p.V}, "[NC, H, K, V], NC = sum over sequences of ceil(T_n / 64)");
  const int64_t contiguous[4] = {p.H * p.K * p.V, p.K * p.V, p.V, 1};
  for (int i = 0; i < 4; ++i) {
    if (t.sizes[i] > 1 && t.strides[i] != contiguous[i]) {
      invalid("chunk_states: expected contiguous strides [" + std::to_string(contiguous[0]) + ", " + std::to_string(contiguous[1]) +
              ", " + std::to_string(contiguous[2]) + ", 1], got stride " + std::to_string(t.strides[i]) + " in dim " +
              std::to_string(i));
    }
  }
  check_same_device("chunk_states", t, p.q);
}

void check_like(const char* name, const gla_tensor& t, const gla_tensor& like, const char* like_name,
                const gla_problem& p, bool metadata_only) {
  check_descriptor(name, t, metadata_only);
  if (t.dtype != like.dtype) {
    invalid(std::string(name) + ": expected dtype " + dtype_name(like.dtype) + " (same as " + like_name + "), got " +
            dtype_name(t.dtype));
  }
  bool same = t.rank == like.rank;
  for (int i = 0; same && i < t.rank; ++i) same = t.sizes[i] == like.sizes[i];
  if (!same) {
    invalid(std::string(name) + ": expected shape " + shape_string(like) + " (same as " + like_name + "), got " +
            shape_string(t));
  }
  check_same_device(name, t, p.q);
}

// o and do: v's dtype and shape [B, T, H, V], on q's device.
void check_like_v(const char* name, const gla_tensor& t, const gla_problem& p, const char* shape_text,
                  bool metadata_only) {
  check_descriptor(name, t, metadata_only);
  check_dtype(name, t, p.dtype, " (same as v)");
  check_shape(name, t, {p.B, p.T, p.H, p.V}, shape_text);
  check_same_device(name, t, p.q);
}

}  // namespace

gla_options read_options(const gla_options* options) {
  gla_options out;
  gla_options_init(&out);
  if (options == nullptr) return out;
  // Older callers pass a smaller struct (fields appended later keep their defaults); a size of 0
  // or one larger than ours means the struct was never initialised.
  if (options->struct_size == 0 || options->struct_size > sizeof(gla_options)) {
    invalid("options: expected struct_size between 1 and " + std::to_string(sizeof(gla_options)) +
            " (call gla_options_init first), got " + std::to_string(options->struct_size));
  }
  std::memcpy(&out, options, options->struct_size);
  if (out.policy < GLA_POLICY_DEFAULT || out.policy > GLA_POLICY_FASTEST) {
    invalid("options.policy: expected 0..3 (gla_policy), got " + std::to_string(out.policy));
  }
  return out;
}

void load_sequence_offsets(PreparedProblem& prepared, const void* host_values) {
  gla_problem& p = prepared.problem;
  const gla_tensor& cu = p.cu_seqlens;
  const int64_t count = cu.sizes[0];
  prepared.seq_offsets.resize(static_cast<size_t>(count));
  // The host copy may be the device tensor's own memory (strided) or a separate contiguous copy;
  // read it with cu's stride only when it is cu's memory.
  const bool own = host_values == cu.data;
  const int64_t stride = own ? cu.strides[0] : 1;
  for (int64_t i = 0; i < count; ++i) {
    int64_t x;
    if (cu.dtype == GLA_DTYPE_I32) {
      int32_t y;
      std::memcpy(&y, static_cast<const char*>(host_values) + i * stride * 4, 4);
      x = y;
    } else {
      std::memcpy(&x, static_cast<const char*>(host_values) + i * stride * 8, 8);
    }
    prepared.seq_offsets[i] = x;
  }
  const auto& o = prepared.seq_offsets;
  if (o[0] != 0) invalid("cu_seqlens: expected first entry 0, got " + std::to_string(o[0]));
  for (int64_t i = 1; i < count; ++i) {
    if (o[i] < o[i - 1]) {
      invalid("cu_seqlens: expected non-decreasing offsets, got " + std::to_string(o[i - 1]) + " then " +
              std::to_string(o[i]) + " at index " + std::to_string(i));
    }
  }
  if (o[count - 1] != p.T) {
    invalid("cu_seqlens: expected last entry T = " + std::to_string(p.T) + ", got " + std::to_string(o[count - 1]));
  }
  prepared.offsets_need_copy = false;
  prepared.bind();
}

int64_t saved_state_chunks(const gla_problem& p) {
  int64_t chunks = 0;
  for (int64_t n = 0; n < p.N; ++n) chunks += (sequence_span(p, n).length + kSavedStateChunk - 1) / kSavedStateChunk;
  return chunks;
}

void check_chunk_states_count(const gla_problem& p) {
  if (!present(p.h)) return;
  const int64_t nc = saved_state_chunks(p);
  if (p.h.sizes[0] != nc) {
    invalid("chunk_states: expected shape " + sizes_string({nc, p.H, p.K, p.V}) +
            " ([NC, H, K, V], NC = sum over sequences of ceil(T_n / 64)), got " + shape_string(p.h));
  }
}

void compute_chunk_offsets(PreparedProblem& prepared, int64_t chunk_size) {
  gla_problem& p = prepared.problem;
  prepared.chunk_offsets.assign(static_cast<size_t>(p.N + 1), 0);
  for (int64_t n = 0; n < p.N; ++n) {
    const int64_t length = sequence_span(p, n).length;
    prepared.chunk_offsets[n + 1] = prepared.chunk_offsets[n] + (length + chunk_size - 1) / chunk_size;
  }
  p.chunk_size = chunk_size;
  p.num_chunks = prepared.chunk_offsets[p.N];
  prepared.bind();
}

PreparedProblem prepare_forward(const gla_chunk_forward_args* args, const gla_options& options, bool metadata_only,
                                const gla_tensor* chunk_states) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_common(out, {args->q, args->k, args->v, args->g, args->initial_state, args->cu_seqlens, args->cu_seqlens_host},
                 options, metadata_only);
  gla_problem& p = out.problem;
  p.unit = GLA_UNIT_CHUNK_FWD;
  p.backward = 0;
  if (args->o) {
    check_like_v("o", *args->o, p, "[B, T, H, V]", metadata_only);
    p.o = *args->o;
  } else if (!metadata_only) {
    invalid("o: required output tensor is missing (got NULL)");
  } else {
    // explain() without an output: describe the one the operator would be given (contiguous), so
    // verifiers that check output strides give the verdict of a real call.
    p.o = make_tensor(nullptr, p.dtype, p.device_type, p.device_index, {p.B, p.T, p.H, p.V});
  }
  if (args->final_state) {
    check_state_like("final_state", *args->final_state, p, metadata_only);
    p.final_state = *args->final_state;
  }
  if (chunk_states) {
    check_chunk_states(*chunk_states, out, metadata_only);
    p.h = *chunk_states;
  }
  out.bind();
  return out;
}

PreparedProblem prepare_backward(const gla_chunk_backward_args* args, const gla_options& options, bool metadata_only,
                                 const gla_tensor* chunk_states) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_common(out, {args->q, args->k, args->v, args->g, args->initial_state, args->cu_seqlens, args->cu_seqlens_host},
                 options, metadata_only);
  gla_problem& p = out.problem;
  p.unit = GLA_UNIT_CHUNK_BWD;
  p.backward = 1;
  if (args->do_) {
    check_like_v("do", *args->do_, p, "[B, T, H, V] like o", metadata_only);
    p.do_ = *args->do_;
  }
  if (args->dht) {
    check_state_like("dht", *args->dht, p, metadata_only);
    p.dht = *args->dht;
  }
  if (args->dq) { check_like("dq", *args->dq, p.q, "q", p, metadata_only); p.dq = *args->dq; }
  if (args->dk) { check_like("dk", *args->dk, p.k, "k", p, metadata_only); p.dk = *args->dk; }
  if (args->dv) { check_like("dv", *args->dv, p.v, "v", p, metadata_only); p.dv = *args->dv; }
  if (args->dg) {
    const gla_tensor& dg = *args->dg;
    check_descriptor("dg", dg, metadata_only);
    if (dg.dtype != GLA_DTYPE_F32 && dg.dtype != p.gate_dtype) {
      invalid(std::string("dg: expected dtype float32 or ") + dtype_name(p.gate_dtype) + " (g's dtype), got " +
              dtype_name(dg.dtype));
    }
    bool same = dg.rank == p.g.rank;
    for (int i = 0; same && i < dg.rank; ++i) same = dg.sizes[i] == p.g.sizes[i];
    if (!same) invalid("dg: expected shape " + shape_string(p.g) + " (same as g), got " + shape_string(dg));
    check_same_device("dg", dg, p.q);
    p.dg = dg;
  }
  if (args->dh0) {
    check_state_like("dh0", *args->dh0, p, metadata_only);
    p.dh0 = *args->dh0;
  }
  if (!metadata_only && !args->dq && !args->dk && !args->dv && !args->dg && !args->dh0) {
    invalid("backward: expected at least one gradient output, got none (dq, dk, dv, dg and dh0 are all NULL)");
  }
  if (chunk_states) {
    check_chunk_states(*chunk_states, out, metadata_only);
    p.h = *chunk_states;
  }
  out.bind();
  return out;
}

void check_input_values(const gla_problem& p, HostReader read, void* context) {
  struct Named {
    const char* name;
    const gla_tensor* t;
    bool is_gate;
  };
  const Named inputs[] = {{"q", &p.q, false}, {"k", &p.k, false}, {"v", &p.v, false}, {"g", &p.g, true},
                          {"initial_state", &p.initial_state, false}, {"do", &p.do_, false}, {"dht", &p.dht, false}};
  std::vector<char> bytes;
  for (const auto& in : inputs) {
    const gla_tensor& t = *in.t;
    if (!present(t) || numel(t) == 0) continue;
    read(context, t, bytes);
    gla_tensor view = t;
    view.data = bytes.data();
    int64_t index[GLA_MAX_RANK] = {0};
    const int64_t total = numel(t);
    for (int64_t flat = 0; flat < total; ++flat) {
      int64_t off = 0;
      for (int d = 0; d < t.rank; ++d) off += index[d] * t.strides[d];
      const double x = load_as_double(view, off);
      if (!std::isfinite(x) || (in.is_gate && x > 0)) {
        std::ostringstream pos;
        pos << '[';
        for (int d = 0; d < t.rank; ++d) pos << (d ? ", " : "") << index[d];
        pos << ']';
        invalid(std::string(in.name) + ": input check found " +
                (std::isnan(x) ? "NaN" : std::isinf(x) ? "Inf" : "a positive gate value " + std::to_string(x) +
                                                                      " (expected g <= 0)") +
                " at " + pos.str());
      }
      for (int d = t.rank - 1; d >= 0; --d) {
        if (++index[d] < t.sizes[d]) break;
        index[d] = 0;
      }
    }
  }
}

}  // namespace gla
