#include "core/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>

#include "gla/checked.hpp"

namespace gla {

namespace {

// Reads the N + 1 offsets from host memory holding them as `dtype` (int32 or int64) every `stride`
// elements, then checks them (first 0, non-decreasing, last T).
void load_offsets(PreparedProblem& prepared, const void* values, int32_t dtype, int64_t stride);

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

std::string strides_string(const gla_tensor& t) {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < t.rank; ++i) s << (i ? ", " : "") << t.strides[i];
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
  // SPEC.md §3.9: every element count, offset and byte extent a backend forms fits in int64.
  if (!checked_numel(t)) {
    invalid(std::string(name) + ": expected sizes whose product fits in int64, got " + shape_string(t));
  }
  const auto extent = checked_extent_bytes(t, dtype_size(t.dtype));
  if (!extent) {
    invalid(std::string(name) + ": expected sizes and strides whose largest offset fits in int64, got sizes " +
            shape_string(t) + " with strides " + strides_string(t) + " (sum of (size - 1) * stride overflows)");
  }
  if (t.data != nullptr && *extent > 0 &&
      reinterpret_cast<uintptr_t>(t.data) > UINTPTR_MAX - static_cast<uint64_t>(*extent)) {
    invalid(std::string(name) + ": expected memory inside the address space, got " + std::to_string(*extent) +
            " bytes from a data pointer that wraps past its end");
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

// SPEC.md §3.9 for what the problem's sizes imply beyond the caller's tensors: the stage pipeline's
// fp32 intermediates (gcum, A, dA, dq_intra, dk_intra over B·T·H rows; h and dh over at most
// B·ceil(T / 64) + N chunks of H·K·V) and the N·H·K·V states, in bytes, with room for the 256-byte
// alignment of each buffer. Every host and device backend sizes its scratch from these products, so
// when their sum fits in int64 none of those sizes can wrap; a problem whose sum does not is rejected
// before anything is allocated or computed (T = 2^62 with stride-0 inputs, T·H = 2^64, ...).
void check_problem_size(const gla_problem& p) {
  const int64_t C = 64;
  const auto rows = checked_product({p.B, p.T, p.H});
  const auto row_floats = checked_add(checked_add(checked_mul(int64_t{3}, int64_t{p.K}), int64_t{p.V}),
                                      int64_t{2 * C});  // gcum, dq_intra, dk_intra (K), o-like (V), A, dA
  const auto chunks = checked_add(checked_mul(p.B, checked_add(p.T, C - 1).value_or(INT64_MAX) / C), p.N);
  const auto state = checked_product({p.H, p.K, p.V});
  const auto state_floats = checked_mul(checked_add(checked_mul(int64_t{2}, chunks), checked_mul(int64_t{4}, p.N)), state);
  const auto floats = checked_add(checked_mul(rows, row_floats), state_floats);
  const auto bytes = checked_add(checked_mul(floats, int64_t{4}), int64_t{16 * 256});
  if (!bytes) {
    invalid("problem: expected sizes whose intermediates fit in int64 bytes, got B = " + std::to_string(p.B) +
            ", T = " + std::to_string(p.T) + ", H = " + std::to_string(p.H) + ", K = " + std::to_string(p.K) +
            ", V = " + std::to_string(p.V) + ", N = " + std::to_string(p.N) +
            " (B·T·H·(3K + V + 128) + (2·chunks + 4N)·H·K·V floats overflow int64)");
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
  // The recurrent operator's gates are optional (gk in `g`, then gv); the chunked one needs g.
  bool gate_optional = false;
  const char* gate_name = "g";
};

// Stride 0 repeats one entry: it can describe nothing but empty sequences at T = 0, and it lets
// 8 bytes name 2^60 offsets that would be copied and scanned before any other check.
void reject_repeated_offsets(const char* name, const gla_tensor& offsets) {
  if (offsets.sizes[0] > 2 && offsets.strides[0] == 0) {
    invalid(std::string(name) + ": expected a non-zero stride, got stride 0 with " + std::to_string(offsets.sizes[0]) +
            " entries");
  }
}

void prepare_common(PreparedProblem& out, const CommonInputs& in, const gla_options& options,
                    bool metadata_only) {
  gla_problem& p = out.problem;
  const gla_tensor& q = required("q", in.q);
  const gla_tensor& k = required("k", in.k);
  const gla_tensor& v = required("v", in.v);
  const gla_tensor no_gate{};
  const gla_tensor& g = in.gate_optional && in.g == nullptr ? no_gate : required(in.gate_name, in.g);
  const bool has_gate = in.g != nullptr;
  check_descriptor("q", q, metadata_only);
  check_descriptor("k", k, metadata_only);
  check_descriptor("v", v, metadata_only);
  if (has_gate) check_descriptor(in.gate_name, g, metadata_only);

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
  bool per_head = false;
  if (has_gate) {
    const std::string gn = in.gate_name;
    if (g.dtype != q.dtype && g.dtype != GLA_DTYPE_F32) {
      invalid(gn + ": expected dtype " + dtype_name(q.dtype) + " (same as q) or float32, got " + dtype_name(g.dtype));
    }
    if (in.gate_optional) {
      check_shape(in.gate_name, g, {B, T, H, K}, "[B, T, H, K] key gate");
    } else if (g.rank == 3) {
      per_head = true;
      check_shape("g", g, {B, T, H}, "[B, T, H] per-head gate");
    } else {
      check_shape("g", g, {B, T, H, K}, "[B, T, H, K] per-key gate, or [B, T, H] per-head gate");
    }
    check_same_device(in.gate_name, g, q);
  }
  check_same_device("k", k, q);
  check_same_device("v", v, q);

  p.B = B;
  p.T = T;
  p.H = H;
  p.K = K;
  p.V = V;
  p.gate_per_head = per_head;
  p.dtype = q.dtype;
  p.gate_dtype = has_gate ? g.dtype : q.dtype;
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
    reject_repeated_offsets("cu_seqlens", cu);
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
      reject_repeated_offsets("cu_seqlens_host", hc);
      // Host memory is readable even for metadata-only queries (workspace sizing, explain), so
      // backends that plan from the offsets see the real ones there too.
      if (hc.data) load_offsets(out, hc.data, hc.dtype, hc.strides[0]);
    } else if (host_accessible(cu.device_type) && cu.data) {
      load_offsets(out, cu.data, cu.dtype, cu.strides[0]);
    }
    if (out.seq_offsets.empty() && !metadata_only) {
      if (!host_accessible(cu.device_type)) {
        out.offsets_need_copy = true;
      } else {
        load_offsets(out, cu.data, cu.dtype, cu.strides[0]);  // NULL data was rejected above unless N + 1 == 0
      }
    }
  } else if (in.cu_seqlens_host) {
    invalid("cu_seqlens_host: given without cu_seqlens");
  }
  p.N = N;
  check_problem_size(p);
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
// [NC, H, K, V] f32 or bf16, contiguous, q's device; stored in problem.h of the whole operation.
// NC depends on the sequence lengths: checked here when they are on the host, else by
// check_chunk_states_count once execute() has loaded them.
constexpr int64_t kSavedStateChunk = 64;
void check_chunk_states(const gla_tensor& t, PreparedProblem& out, bool metadata_only) {
  const gla_problem& p = out.problem;
  check_descriptor("chunk_states", t, metadata_only);
  if (t.dtype != GLA_DTYPE_F32 && t.dtype != GLA_DTYPE_BF16) {
    invalid(std::string("chunk_states: expected dtype f32 or bf16 (saved chunk states), got ") + dtype_name(t.dtype));
  }
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

// o of a forward: required for a call; for explain() without one, the contiguous output the operator
// would be given, so verifiers that check output strides give the verdict of a real call.
void set_output(gla_problem& p, const gla_tensor* o, bool metadata_only) {
  if (o) {
    check_like_v("o", *o, p, "[B, T, H, V]", metadata_only);
    p.o = *o;
  } else if (!metadata_only) {
    invalid("o: required output tensor is missing (got NULL)");
  } else {
    p.o = make_tensor(nullptr, p.dtype, p.device_type, p.device_index, {p.B, p.T, p.H, p.V});
  }
}

// A backward's do, dht and dq, dk, dv (each optional).
void set_backward_tensors(gla_problem& p, const gla_tensor* dout, const gla_tensor* dht, const gla_tensor* dq,
                          const gla_tensor* dk, const gla_tensor* dv, bool metadata_only) {
  if (dout) {
    check_like_v("do", *dout, p, "[B, T, H, V] like o", metadata_only);
    p.do_ = *dout;
  }
  if (dht) {
    check_state_like("dht", *dht, p, metadata_only);
    p.dht = *dht;
  }
  if (dq) { check_like("dq", *dq, p.q, "q", p, metadata_only); p.dq = *dq; }
  if (dk) { check_like("dk", *dk, p.k, "k", p, metadata_only); p.dk = *dk; }
  if (dv) { check_like("dv", *dv, p.v, "v", p, metadata_only); p.dv = *dv; }
}

// The first dim (in stride order) through which two distinct indices of t reach the same element,
// or -1 when every index has its own element. Sufficient test: with the dims of size > 1 sorted by
// stride, each stride exceeds the largest offset the smaller-stride dims reach. Layouts it refuses
// that are still one-to-one (interleavings no framework produces) are refused with the rest.
int overlapping_dim(const gla_tensor& t) {
  struct Dim {
    int64_t size, stride;
    int index;
  };
  Dim dims[GLA_MAX_RANK];  // fixed storage and an insertion sort: no allocation per call
  int count = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (t.sizes[i] <= 1) continue;
    const Dim d{t.sizes[i], t.strides[i], i};
    int j = count++;
    for (; j > 0 && dims[j - 1].stride > d.stride; --j) dims[j] = dims[j - 1];  // stable: equal strides keep order
    dims[j] = d;
  }
  int64_t reach = 0;  // largest offset of the dims so far (bounded by the descriptor's checked extent)
  for (int i = 0; i < count; ++i) {
    if (dims[i].stride <= reach) return dims[i].index;
    reach += (dims[i].size - 1) * dims[i].stride;
  }
  return -1;
}

struct Region {
  const char* name;
  const gla_tensor* t;
  bool output;
};

// Outputs are written while inputs are still being read, and a backend writes each output element
// once from its own work item: an output that overlaps itself, another output or an input gives
// garbage, so every such call is rejected. Inputs may share memory with each other (q and k the
// same tensor is fine). Memory is compared only where both descriptors have data and elements.
template <size_t n>
void check_outputs_disjoint(const Region (&regions)[n]) {
  for (const Region& r : regions) {
    if (!r.output || !present(*r.t) || numel(*r.t) == 0) continue;
    const int dim = overlapping_dim(*r.t);
    if (dim >= 0) {
      invalid(std::string(r.name) + ": expected an output whose elements do not overlap, got sizes " +
              shape_string(*r.t) + " with strides " + strides_string(*r.t) + " (dim " + std::to_string(dim) +
              " revisits memory of the dims with smaller strides)");
    }
  }
  // Byte ranges, each computed once (hi == 0: no data or no elements).
  struct Span {
    uintptr_t lo = 0, hi = 0;
  };
  Span spans[n];
  for (size_t i = 0; i < n; ++i) {
    const gla_tensor& t = *regions[i].t;
    if (t.data == nullptr || numel(t) == 0) continue;
    if (const auto extent = checked_extent_bytes(t, dtype_size(t.dtype))) {
      spans[i].lo = reinterpret_cast<uintptr_t>(t.data);
      spans[i].hi = spans[i].lo + static_cast<uintptr_t>(*extent);
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Region& a = regions[i];
    const uintptr_t alo = spans[i].lo, ahi = spans[i].hi;
    if (!a.output || ahi == 0) continue;
    for (size_t j = 0; j < n; ++j) {
      const Region& b = regions[j];
      const uintptr_t blo = spans[j].lo, bhi = spans[j].hi;
      if (j == i || (b.output && j < i) || bhi == 0) continue;
      if (a.t->device_type != b.t->device_type || a.t->device_index != b.t->device_index) continue;
      if (alo < bhi && blo < ahi) {
        invalid(std::string(a.name) + ": expected output memory disjoint from " + (b.output ? "output " : "input ") +
                b.name + ", got overlapping byte ranges (" + a.name + " " + std::to_string(ahi - alo) + " bytes, " +
                b.name + " " + std::to_string(bhi - blo) + " bytes, sharing " +
                std::to_string(std::min(ahi, bhi) - std::max(alo, blo)) + ")");
      }
    }
  }
}

}  // namespace

namespace {

// The fields of gla_options in declaration order, for the struct_size check: an older caller's
// struct ends at a field boundary, and a size ending inside a field would copy part of it (half a
// pointer, half a double).
struct OptionsField {
  const char* name;
  size_t offset;
  size_t size;
};
#define GLA_OPTIONS_FIELD(f) OptionsField{#f, offsetof(gla_options, f), sizeof(gla_options::f)}
constexpr OptionsField kOptionsFields[] = {
    GLA_OPTIONS_FIELD(struct_size),          GLA_OPTIONS_FIELD(has_scale), GLA_OPTIONS_FIELD(scale),
    GLA_OPTIONS_FIELD(state_v_first),        GLA_OPTIONS_FIELD(backend),   GLA_OPTIONS_FIELD(policy),
    GLA_OPTIONS_FIELD(force_stage_pipeline), GLA_OPTIONS_FIELD(check_inputs), GLA_OPTIONS_FIELD(stream),
    GLA_OPTIONS_FIELD(workspace),            GLA_OPTIONS_FIELD(workspace_bytes)};
#undef GLA_OPTIONS_FIELD

std::string options_boundaries() {
  std::string s;
  for (const auto& f : kOptionsFields) s += (s.empty() ? "" : ", ") + std::to_string(f.offset + f.size);
  return s;
}

}  // namespace

gla_options read_options(const gla_options* options) {
  gla_options out;
  gla_options_init(&out);
  if (options == nullptr) return out;
  // Older callers pass a smaller struct (fields appended later keep their defaults); a size of 0
  // or one larger than ours means the struct was never initialised.
  const size_t size = options->struct_size;
  if (size < sizeof(uint32_t) || size > sizeof(gla_options)) {
    invalid("options: expected struct_size between " + std::to_string(sizeof(uint32_t)) + " and " +
            std::to_string(sizeof(gla_options)) + " (call gla_options_init first), got " + std::to_string(size));
  }
  for (const auto& f : kOptionsFields) {
    if (size > f.offset && size < f.offset + f.size) {
      invalid("options: expected struct_size at a field boundary (" + options_boundaries() + " or " +
              std::to_string(sizeof(gla_options)) + "), got " + std::to_string(size) + ", which ends inside options." +
              f.name + " (bytes " + std::to_string(f.offset) + ".." + std::to_string(f.offset + f.size) + ")");
    }
  }
  std::memcpy(&out, options, size);
  if (out.has_scale && size < offsetof(gla_options, scale) + sizeof out.scale) {
    invalid("options.has_scale: expected 0 when struct_size (" + std::to_string(size) +
            ") ends before options.scale, got " + std::to_string(out.has_scale));
  }
  if (out.policy < GLA_POLICY_DEFAULT || out.policy > GLA_POLICY_FASTEST) {
    invalid("options.policy: expected 0..3 (gla_policy), got " + std::to_string(out.policy));
  }
  return out;
}

void check_allocator(const gla_allocator* allocator) {
  if (allocator && !allocator->allocate) invalid("allocator.allocate: expected a function, got NULL");
}

void load_sequence_offsets(PreparedProblem& prepared, const void* host_values) {
  // The host copy may be the device tensor's own memory (strided) or a separate contiguous copy in
  // cu_seqlens' dtype.
  const gla_tensor& cu = prepared.problem.cu_seqlens;
  load_offsets(prepared, host_values, cu.dtype, host_values == cu.data ? cu.strides[0] : 1);
}

namespace {

void load_offsets(PreparedProblem& prepared, const void* values, int32_t dtype, int64_t stride) {
  gla_problem& p = prepared.problem;
  const int64_t count = p.cu_seqlens.sizes[0];
  prepared.seq_offsets.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    int64_t x;
    if (dtype == GLA_DTYPE_I32) {
      int32_t y;
      std::memcpy(&y, static_cast<const char*>(values) + i * stride * 4, 4);
      x = y;
    } else {
      std::memcpy(&x, static_cast<const char*>(values) + i * stride * 8, 8);
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

}  // namespace

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

namespace {

// The chunked operator's inputs, shared by its forward and backward argument structs.
template <typename Args>
PreparedProblem prepare_chunk_inputs(const Args* args, const gla_options& options, bool metadata_only, int32_t unit) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_common(out, {args->q, args->k, args->v, args->g, args->initial_state, args->cu_seqlens, args->cu_seqlens_host},
                 options, metadata_only);
  out.problem.unit = unit;
  out.problem.backward = unit == GLA_UNIT_CHUNK_BWD;
  return out;
}

void set_chunk_states(PreparedProblem& out, const gla_tensor* chunk_states, bool metadata_only) {
  if (!chunk_states) return;
  check_chunk_states(*chunk_states, out, metadata_only);
  out.problem.h = *chunk_states;
}

}  // namespace

PreparedProblem prepare_forward(const gla_chunk_forward_args* args, const gla_options& options, bool metadata_only,
                                const gla_tensor* chunk_states) {
  PreparedProblem out = prepare_chunk_inputs(args, options, metadata_only, GLA_UNIT_CHUNK_FWD);
  gla_problem& p = out.problem;
  set_output(p, args->o, metadata_only);
  if (args->final_state) {
    check_state_like("final_state", *args->final_state, p, metadata_only);
    p.final_state = *args->final_state;
  }
  set_chunk_states(out, chunk_states, metadata_only);
  check_outputs_disjoint({{"o", &p.o, true}, {"final_state", &p.final_state, true}, {"chunk_states", &p.h, true},
                          {"q", &p.q, false}, {"k", &p.k, false}, {"v", &p.v, false}, {"g", &p.g, false},
                          {"initial_state", &p.initial_state, false}, {"cu_seqlens", &p.cu_seqlens, false}});
  out.bind();
  return out;
}

PreparedProblem prepare_backward(const gla_chunk_backward_args* args, const gla_options& options, bool metadata_only,
                                 const gla_tensor* chunk_states) {
  PreparedProblem out = prepare_chunk_inputs(args, options, metadata_only, GLA_UNIT_CHUNK_BWD);
  gla_problem& p = out.problem;
  set_backward_tensors(p, args->do_, args->dht, args->dq, args->dk, args->dv, metadata_only);
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
  set_chunk_states(out, chunk_states, metadata_only);
  check_outputs_disjoint({{"dq", &p.dq, true}, {"dk", &p.dk, true}, {"dv", &p.dv, true}, {"dg", &p.dg, true},
                          {"dh0", &p.dh0, true}, {"q", &p.q, false}, {"k", &p.k, false}, {"v", &p.v, false},
                          {"g", &p.g, false}, {"initial_state", &p.initial_state, false},
                          {"cu_seqlens", &p.cu_seqlens, false}, {"do", &p.do_, false}, {"dht", &p.dht, false},
                          {"chunk_states", &p.h, false}});
  out.bind();
  return out;
}

void check_input_values(const gla_problem& p, HostReader read, void* context) {
  struct Named {
    const char* name;
    const gla_tensor* t;
    bool is_gate;
  };
  const bool recurrent = p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD;
  const Named inputs[] = {{"q", &p.q, false},          {"k", &p.k, false},
                          {"v", &p.v, false},          {recurrent ? "gk" : "g", &p.g, true},
                          {"gv", &p.gv, true},         {recurrent && present(p.state_slots) ? "state_pool" : "initial_state", &p.initial_state, false},
                          {"do", &p.do_, false},       {"dht", &p.dht, false}};
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
      // A gate may be -inf (a hard reset, SPEC.md §3.8); NaN and anything above 0 are not.
      if (in.is_gate ? (std::isnan(x) || x > 0) : !std::isfinite(x)) {
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

// ---- The recurrent operator (gla.h: gla_recurrent_*) ----
namespace {

void check_value_gate(const gla_tensor* gv, PreparedProblem& out, bool metadata_only) {
  if (!gv) return;
  gla_problem& p = out.problem;
  check_descriptor("gv", *gv, metadata_only);
  if (gv->dtype != p.dtype && gv->dtype != GLA_DTYPE_F32) {
    invalid(std::string("gv: expected dtype ") + dtype_name(p.dtype) + " (same as q) or float32, got " +
            dtype_name(gv->dtype));
  }
  check_shape("gv", *gv, {p.B, p.T, p.H, p.V}, "[B, T, H, V] value gate");
  check_same_device("gv", *gv, p.q);
  p.gv = *gv;
}

void check_gate_gradient(const char* name, const gla_tensor& d, const gla_tensor& gate, const char* gate_name,
                         const gla_problem& p, bool metadata_only) {
  if (!present(gate)) invalid(std::string(name) + ": given without " + gate_name + " (expected NULL)");
  check_descriptor(name, d, metadata_only);
  if (d.dtype != GLA_DTYPE_F32 && d.dtype != gate.dtype) {
    invalid(std::string(name) + ": expected dtype float32 or " + dtype_name(gate.dtype) + " (" + gate_name +
            "'s dtype), got " + dtype_name(d.dtype));
  }
  bool same = d.rank == gate.rank;
  for (int i = 0; same && i < d.rank; ++i) same = d.sizes[i] == gate.sizes[i];
  if (!same) invalid(std::string(name) + ": expected shape " + shape_string(gate) + " (same as " + gate_name + "), got " + shape_string(d));
  check_same_device(name, d, p.q);
}

// q, k, v, the optional gates (gk in `g`), initial state and sequences of a recurrent call.
void prepare_recurrent_common(PreparedProblem& out, CommonInputs in, const gla_tensor* gv, int32_t reverse, int32_t unit,
                              const gla_options& options, bool metadata_only) {
  in.gate_optional = true;
  in.gate_name = "gk";
  prepare_common(out, in, options, metadata_only);
  gla_problem& p = out.problem;
  p.unit = unit;
  p.backward = unit == GLA_UNIT_RECURRENT_BWD;
  if (reverse != 0 && reverse != 1) invalid("reverse: expected 0 or 1, got " + std::to_string(reverse));
  p.reverse = reverse;
  check_value_gate(gv, out, metadata_only);
}

}  // namespace

PreparedProblem prepare_recurrent_forward(const gla_recurrent_forward_args* args, const gla_options& options,
                                          bool metadata_only) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_recurrent_common(out, {args->q, args->k, args->v, args->gk, args->initial_state, args->cu_seqlens, args->cu_seqlens_host},
                           args->gv, args->reverse, GLA_UNIT_RECURRENT_FWD, options, metadata_only);
  gla_problem& p = out.problem;
  set_output(p, args->o, metadata_only);
  if (args->final_state) {
    check_state_like("final_state", *args->final_state, p, metadata_only);
    p.final_state = *args->final_state;
  }
  out.bind();
  return out;
}

PreparedProblem prepare_recurrent_backward(const gla_recurrent_backward_args* args, const gla_options& options,
                                           bool metadata_only) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_recurrent_common(out, {args->q, args->k, args->v, args->gk, args->initial_state, args->cu_seqlens, args->cu_seqlens_host},
                           args->gv, args->reverse, GLA_UNIT_RECURRENT_BWD, options, metadata_only);
  gla_problem& p = out.problem;
  set_backward_tensors(p, args->do_, args->dht, args->dq, args->dk, args->dv, metadata_only);
  if (args->dgk) { check_gate_gradient("dgk", *args->dgk, p.g, "gk", p, metadata_only); p.dg = *args->dgk; }
  if (args->dgv) { check_gate_gradient("dgv", *args->dgv, p.gv, "gv", p, metadata_only); p.dgv = *args->dgv; }
  if (args->dh0) {
    if (!present(p.initial_state)) invalid("dh0: given without initial_state (expected NULL)");
    check_state_like("dh0", *args->dh0, p, metadata_only);
    p.dh0 = *args->dh0;
  }
  if (!metadata_only && !args->dq && !args->dk && !args->dv && !args->dgk && !args->dgv && !args->dh0) {
    invalid("backward: expected at least one gradient output, got none (dq, dk, dv, dgk, dgv and dh0 are all NULL)");
  }
  out.bind();
  return out;
}

PreparedProblem prepare_recurrent_state_update(const gla_recurrent_state_update_args* args, const gla_options& options,
                                               bool metadata_only) {
  if (args == nullptr) invalid("args: required argument struct is missing (got NULL)");
  PreparedProblem out;
  prepare_recurrent_common(out, {args->q, args->k, args->v, args->gk, nullptr, nullptr, nullptr}, args->gv, 0,
                           GLA_UNIT_RECURRENT_FWD, options, metadata_only);
  gla_problem& p = out.problem;

  const gla_tensor& pool = required("state_pool", args->state_pool);
  check_descriptor("state_pool", pool, metadata_only);
  check_dtype("state_pool", pool, GLA_DTYPE_F32, " (states are always fp32)");
  const int64_t P = pool.rank == 4 ? pool.sizes[0] : 0;
  if (p.state_v_first) {
    check_shape("state_pool", pool, {P, p.H, p.V, p.K}, "[P, H, V, K] with state_v_first");
  } else {
    check_shape("state_pool", pool, {P, p.H, p.K, p.V}, "[P, H, K, V]");
  }
  check_same_device("state_pool", pool, p.q);

  const gla_tensor& slots = required("state_slots", args->state_slots);
  check_descriptor("state_slots", slots, metadata_only);
  check_dtype("state_slots", slots, GLA_DTYPE_I32, "");
  check_shape("state_slots", slots, {p.B}, "[B], one slot per sequence");
  check_same_device("state_slots", slots, p.q);

  const gla_tensor& error = required("slot_error", args->slot_error);
  check_descriptor("slot_error", error, metadata_only);
  check_dtype("slot_error", error, GLA_DTYPE_I32, "");
  check_shape("slot_error", error, {1}, "[1] error flag");
  check_same_device("slot_error", error, p.q);

  if (args->check_slots != 0 && args->check_slots != 1) {
    invalid("check_slots: expected 0 or 1, got " + std::to_string(args->check_slots));
  }
  out.check_slots = args->check_slots == 1;
  set_output(p, args->o, metadata_only);
  p.initial_state = pool;
  p.state_slots = slots;
  p.slot_error = error;
  if (args->token_states) {
    const gla_tensor& ts = *args->token_states;
    check_descriptor("token_states", ts, metadata_only);
    check_dtype("token_states", ts, GLA_DTYPE_F32, " (states are always fp32)");
    bool ok = ts.rank == 5 && ts.sizes[0] == p.B && ts.sizes[1] == p.T && ts.sizes[2] == p.H &&
              ts.sizes[3] == (p.state_v_first ? p.V : p.K) && ts.sizes[4] == (p.state_v_first ? p.K : p.V);
    if (!ok) {
      const std::string want = p.state_v_first ? sizes_string({p.B, p.T, p.H, p.V, p.K}) + " ([B, T, H, V, K] with state_v_first)"
                                               : sizes_string({p.B, p.T, p.H, p.K, p.V}) + " ([B, T, H, K, V])";
      invalid("token_states: expected shape " + want + ", got " + shape_string(ts));
    }
    check_same_device("token_states", ts, p.q);
    p.token_states = ts;
  } else {
    p.final_state = pool;  // written back in place
  }
  out.bind();
  return out;
}

void check_state_slots(const gla_problem& p, const int32_t* slots) {
  const int64_t P = p.initial_state.sizes[0];
  std::vector<int64_t> first_user(static_cast<size_t>(P), -1);
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t s = slots[b];
    if (s < 0 || s >= P) {
      invalid("state_slots: expected slots in [0, " + std::to_string(P) + ") (the pool's first size), got " +
              std::to_string(s) + " at index " + std::to_string(b));
    }
    if (first_user[static_cast<size_t>(s)] >= 0) {
      invalid("state_slots: expected each slot at most once, got slot " + std::to_string(s) + " at indices " +
              std::to_string(first_user[static_cast<size_t>(s)]) + " and " + std::to_string(b));
    }
    first_user[static_cast<size_t>(s)] = b;
  }
}

}  // namespace gla
