// libFuzzer target over the C ABI: arbitrary descriptors (ranks, sizes, strides, dtypes, devices,
// null pointers), cu_seqlens contents, aliasing between tensors and options with any struct_size go
// to gla_chunk_forward / gla_chunk_backward / the workspace queries / gla_explain. Every data
// buffer is allocated to exactly the bytes its descriptor addresses (AddressSanitizer catches any
// access outside it); a descriptor whose addressing does not fit in int64 gets a dangling pointer
// and the call must reject it. Checked on every input: no crash, no sanitizer report, a failing
// call leaves every output byte as it was, and the last-error message is set exactly on failure.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gla/gla.h"

namespace {

// Problems above this many multiply-adds are not run: their cost is their size, not a defect.
constexpr unsigned __int128 kMaxWork = 1u << 18;
constexpr uint64_t kMaxBytes = 1u << 16;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_c_abi: %s (last error: %s)\n", what, gla_last_error());
  std::abort();
}

int64_t pick_size(FuzzedDataProvider& f) {
  static const int64_t extremes[] = {0, 1, 2, 63, 64, 65, int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 62,
                                     INT64_MAX, -1, INT64_MIN};
  switch (f.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: return extremes[f.ConsumeIntegralInRange<size_t>(0, std::size(extremes) - 1)];
    case 1: return f.ConsumeIntegral<int64_t>();
    default: return f.ConsumeIntegralInRange<int64_t>(0, 9);
  }
}

struct Slot {
  gla_tensor t{};
  bool present = false;
  bool overflows = false;   // the addressing does not fit in int64: the call must fail
  std::vector<unsigned char> owned;  // exactly the addressed bytes
};

int64_t element_size(int32_t dtype) {
  switch (dtype) {
    case GLA_DTYPE_F32: case GLA_DTYPE_I32: return 4;
    case GLA_DTYPE_F16: case GLA_DTYPE_BF16: return 2;
    case GLA_DTYPE_F64: case GLA_DTYPE_I64: return 8;
    default: return 1;
  }
}

// Bytes addressed by t computed in 128 bits (independently of the library's int64 helpers).
// Returns false when any size or stride is negative or the rank is out of range (the call must
// reject those too).
bool addressed_bytes(const gla_tensor& t, unsigned __int128& bytes, bool& empty) {
  if (t.rank < 0 || t.rank > GLA_MAX_RANK) return false;
  unsigned __int128 last = 0, count = 1;
  empty = false;
  for (int i = 0; i < t.rank; ++i) {
    if (t.sizes[i] < 0 || t.strides[i] < 0) return false;
    if (t.sizes[i] == 0) empty = true;
    const unsigned __int128 n = static_cast<uint64_t>(t.sizes[i]);
    count = count > (static_cast<unsigned __int128>(1) << 64) ? count : count * n;
    if (n > 0) last += (n - 1) * static_cast<uint64_t>(t.strides[i]);
  }
  bytes = empty ? 0 : (last + 1) * static_cast<uint64_t>(element_size(t.dtype));
  // An empty tensor addresses no bytes; its offsets (formed before an empty loop) must still fit.
  return count <= static_cast<uint64_t>(INT64_MAX) && last <= static_cast<uint64_t>(INT64_MAX) &&
         (empty || (last + 1) * static_cast<uint64_t>(element_size(t.dtype)) <= static_cast<uint64_t>(INT64_MAX));
}

// A descriptor shaped like `sizes` (mostly) with fuzzed deviations and real memory behind it.
void make_slot(FuzzedDataProvider& f, Slot& s, std::vector<int64_t> sizes, int32_t dtype, bool gate) {
  s.present = f.ConsumeIntegralInRange<int>(0, 15) != 0;
  if (!s.present) return;
  gla_tensor& t = s.t;
  t.dtype = f.ConsumeIntegralInRange<int>(0, 15) == 0 ? f.ConsumeIntegralInRange<int32_t>(-1, 7) : dtype;
  t.device_type = f.ConsumeIntegralInRange<int>(0, 31) == 0 ? f.ConsumeIntegralInRange<int32_t>(0, 15) : GLA_DEVICE_CPU;
  t.device_index = f.ConsumeIntegralInRange<int>(0, 31) == 0 ? f.ConsumeIntegral<int32_t>() : 0;
  if (f.ConsumeIntegralInRange<int>(0, 15) == 0) sizes.resize(f.ConsumeIntegralInRange<size_t>(0, 7));
  t.rank = static_cast<int32_t>(sizes.size());
  if (f.ConsumeIntegralInRange<int>(0, 31) == 0) t.rank = f.ConsumeIntegralInRange<int32_t>(-2, 8);
  for (size_t i = 0; i < sizes.size() && i < GLA_MAX_RANK; ++i) {
    t.sizes[i] = f.ConsumeIntegralInRange<int>(0, 15) == 0 ? pick_size(f) : sizes[i];
  }
  // Contiguous strides, then fuzzed ones (0 broadcasts, gaps, transposes, huge).
  int64_t stride = 1;
  for (int i = std::min<int>(t.rank, GLA_MAX_RANK) - 1; i >= 0; --i) {
    t.strides[i] = stride;
    if (t.sizes[i] > 0 && stride < (int64_t{1} << 40) && t.sizes[i] < (int64_t{1} << 20)) stride *= t.sizes[i];
  }
  const int edits = f.ConsumeIntegralInRange<int>(0, 3) == 0 ? f.ConsumeIntegralInRange<int>(1, 3) : 0;
  for (int e = 0; e < edits; ++e) t.strides[f.ConsumeIntegralInRange<int>(0, GLA_MAX_RANK - 1)] = pick_size(f);

  unsigned __int128 bytes = 0;
  bool empty = false;
  const bool fits = addressed_bytes(t, bytes, empty);
  const int pointer = f.ConsumeIntegralInRange<int>(0, 31);
  if (!fits) {
    s.overflows = true;
    t.data = reinterpret_cast<void*>(uintptr_t{64});  // never to be read
    return;
  }
  if (bytes > kMaxBytes) {
    s.present = false;  // a real buffer this large is not allocated: describe it as absent
    return;
  }
  if (pointer == 0) {
    t.data = nullptr;  // rejected when the tensor has elements
    return;
  }
  s.owned.resize(static_cast<size_t>(bytes));
  // Values: finite floats mostly (gates <= 0), with NaN, Inf, -Inf and huge values mixed in.
  for (size_t i = 0; i + 4 <= s.owned.size(); i += 4) {
    float x = f.ConsumeFloatingPointInRange<float>(-2.0f, 2.0f);
    switch (f.ConsumeIntegralInRange<int>(0, 31)) {
      case 0: x = NAN; break;
      case 1: x = -INFINITY; break;
      case 2: x = 1e30f; break;
      default: break;
    }
    if (gate && x > 0) x = -x;
    std::memcpy(&s.owned[i], &x, 4);
  }
  t.data = s.owned.empty() ? reinterpret_cast<void*>(uintptr_t{64}) : s.owned.data();
}

const char* pick_backend(FuzzedDataProvider& f) {
  static const char* const names[] = {nullptr, "", "reference", "cpu", "cuda", "no_such", "fwd_h=cpu,cumsum=reference",
                                      "cpu,", "=", "fwd_o=", "chunk_fwd=reference", " cpu "};
  return names[f.ConsumeIntegralInRange<size_t>(0, std::size(names) - 1)];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider f(data, size);
  const int entry = f.ConsumeIntegralInRange<int>(0, 5);  // fwd, bwd, fwd ws, bwd ws, explain fwd, explain bwd
  const bool backward = entry % 2 == 1;
  const int64_t B = f.ConsumeIntegralInRange<int64_t>(0, 3), T = f.ConsumeIntegralInRange<int64_t>(0, 80);
  const int64_t H = f.ConsumeIntegralInRange<int64_t>(0, 3), K = f.ConsumeIntegralInRange<int64_t>(0, 20);
  const int64_t V = f.ConsumeIntegralInRange<int64_t>(0, 20);
  const int32_t dtype = f.ConsumeIntegralInRange<int32_t>(0, 2);
  const bool per_head = f.ConsumeBool();
  const bool varlen = f.ConsumeIntegralInRange<int>(0, 3) == 0;
  const int64_t N = varlen ? f.ConsumeIntegralInRange<int64_t>(0, 5) : B;
  const bool v_first = f.ConsumeBool();

  // Fixed order: q k v g h0 cu cu_host | fwd: o ht | bwd: do dht dq dk dv dg dh0
  Slot q, k, v, g, h0, cu, cuh, o, ht, dout, dht, dq, dk, dv, dg, dh0;
  const int64_t bv = varlen ? 1 : B;
  const std::vector<int64_t> qs{bv, T, H, K}, vs{bv, T, H, V}, gs = per_head ? std::vector<int64_t>{bv, T, H} : qs;
  const std::vector<int64_t> ss = v_first ? std::vector<int64_t>{N, H, V, K} : std::vector<int64_t>{N, H, K, V};
  make_slot(f, q, qs, dtype, false);
  make_slot(f, k, qs, dtype, false);
  make_slot(f, v, vs, dtype, false);
  make_slot(f, g, gs, f.ConsumeBool() ? GLA_DTYPE_F32 : dtype, true);
  make_slot(f, h0, ss, GLA_DTYPE_F32, false);
  Slot* outs_f[] = {&o, &ht};
  Slot* outs_b[] = {&dq, &dk, &dv, &dg, &dh0};
  if (varlen) {
    make_slot(f, cu, {N + 1}, f.ConsumeBool() ? GLA_DTYPE_I32 : GLA_DTYPE_I64, false);
    // Offsets: sorted from 0 to T mostly, anything otherwise.
    const bool valid = f.ConsumeBool();
    const int64_t es = element_size(cu.t.dtype);
    for (size_t i = 0; (es == 4 || es == 8) && i + es <= cu.owned.size(); i += es) {
      const int64_t at = static_cast<int64_t>(i / es), last = static_cast<int64_t>(cu.owned.size() / es) - 1;
      int64_t x = valid ? (at == last ? T : std::min<int64_t>(T, at * (T / std::max<int64_t>(1, last)))) : pick_size(f);
      if (es == 4) {
        const int32_t y = static_cast<int32_t>(x);
        std::memcpy(&cu.owned[i], &y, 4);
      } else {
        std::memcpy(&cu.owned[i], &x, 8);
      }
    }
    if (f.ConsumeIntegralInRange<int>(0, 3) == 0) {
      cuh = cu;
      cuh.t.data = cuh.owned.empty() ? cu.t.data : cuh.owned.data();
    }
  }
  if (backward) {
    make_slot(f, dout, vs, dtype, false);
    make_slot(f, dht, ss, GLA_DTYPE_F32, false);
    make_slot(f, dq, qs, dtype, false);
    make_slot(f, dk, qs, dtype, false);
    make_slot(f, dv, vs, dtype, false);
    make_slot(f, dg, gs, GLA_DTYPE_F32, false);
    make_slot(f, dh0, ss, GLA_DTYPE_F32, false);
  } else {
    make_slot(f, o, vs, dtype, false);
    make_slot(f, ht, ss, GLA_DTYPE_F32, false);
  }
  // Aliasing: one output pointed into another tensor's memory where it fits there.
  Slot* all[] = {&q, &k, &v, &g, &h0, &o, &ht, &dout, &dht, &dq, &dk, &dv, &dg, &dh0};
  if (f.ConsumeIntegralInRange<int>(0, 7) == 0) {
    Slot* a = all[f.ConsumeIntegralInRange<size_t>(0, std::size(all) - 1)];
    Slot* b = all[f.ConsumeIntegralInRange<size_t>(0, std::size(all) - 1)];
    const size_t shift = f.ConsumeIntegralInRange<size_t>(0, 8) * 4;
    if (a != b && a->present && b->present && !a->owned.empty() && a->owned.size() + shift <= b->owned.size()) {
      a->t.data = b->owned.data() + shift;
      a->owned.clear();  // now lives in b
    }
  }

  gla_options opts;
  gla_options_init(&opts);
  const bool use_options = f.ConsumeIntegralInRange<int>(0, 7) != 0;
  if (f.ConsumeIntegralInRange<int>(0, 3) == 0) {
    opts.struct_size = f.ConsumeIntegralInRange<uint32_t>(0, sizeof(gla_options) + 8);
  }
  opts.has_scale = f.ConsumeIntegralInRange<int>(0, 3) == 0;
  opts.scale = f.ConsumeIntegralInRange<int>(0, 7) == 0 ? f.ConsumeFloatingPoint<double>() : 0.5;
  opts.state_v_first = v_first ? 1 : f.ConsumeIntegralInRange<int>(0, 15) == 0;
  opts.backend = pick_backend(f);
  opts.policy = f.ConsumeIntegralInRange<int>(0, 7) == 0 ? f.ConsumeIntegral<int32_t>() : f.ConsumeIntegralInRange<int32_t>(0, 3);
  opts.force_stage_pipeline = f.ConsumeBool();
  opts.check_inputs = f.ConsumeIntegralInRange<int>(0, 3) == 0;
  std::vector<unsigned char> workspace;
  if (f.ConsumeIntegralInRange<int>(0, 3) == 0) {
    workspace.resize(f.ConsumeIntegralInRange<size_t>(0, 1 << 16));
    opts.workspace = workspace.empty() ? nullptr : workspace.data();
    opts.workspace_bytes = workspace.size();
  }

  // Skip problems whose legitimate cost is large (not a robustness question).
  bool must_fail = false;
  for (Slot* s : all) must_fail = must_fail || (s->present && s->overflows);
  must_fail = must_fail || (cu.present && cu.overflows) || (cuh.present && cuh.overflows);
  auto dim = [](const Slot& s, int i) -> unsigned __int128 {
    return s.present && s.t.rank > i && s.t.rank <= GLA_MAX_RANK && s.t.sizes[i] > 0 ? static_cast<uint64_t>(s.t.sizes[i]) : 1;
  };
  const unsigned __int128 work = dim(q, 0) * dim(q, 1) * dim(q, 2) * (dim(q, 3) + dim(v, 3)) * (dim(q, 3) + 64) +
                                 (dim(h0, 0) + dim(ht, 0) + dim(q, 1)) * dim(q, 2) * dim(q, 3) * dim(v, 3);
  const bool heavy = work > kMaxWork || (varlen && cu.present && dim(cu, 0) > 64);
  if (heavy && !must_fail) return -1;

  std::vector<std::vector<unsigned char>> before;
  for (Slot* s : all) before.push_back(s->owned);

  auto desc = [](Slot& s) -> const gla_tensor* { return s.present ? &s.t : nullptr; };
  gla_chunk_forward_args fa{desc(q), desc(k), desc(v), desc(g), desc(h0), desc(cu), desc(cuh), desc(o), desc(ht)};
  gla_chunk_backward_args ba{desc(q), desc(k), desc(v), desc(g), desc(h0), desc(cu), desc(cuh), desc(dout), desc(dht),
                             desc(dq), desc(dk), desc(dv), desc(dg), desc(dh0)};
  const gla_options* op = use_options ? &opts : nullptr;
  gla_status status = GLA_STATUS_OK;
  size_t bytes = 0;
  const char* text = nullptr;
  switch (entry) {
    case 0: status = gla_chunk_forward(&fa, op); break;
    case 1: status = gla_chunk_backward(&ba, op); break;
    case 2: status = gla_chunk_forward_workspace_size(&fa, op, &bytes); break;
    case 3: status = gla_chunk_backward_workspace_size(&ba, op, &bytes); break;
    case 4: status = gla_explain(&fa, nullptr, op, &text); break;
    default: status = gla_explain(nullptr, &ba, op, &text); break;
  }
  const bool message = gla_last_error()[0] != '\0';
  if ((status == GLA_STATUS_OK) == message) fail("last-error message set on success or missing on failure");
  if (must_fail && status == GLA_STATUS_OK) {
    const char* names[] = {"q", "k", "v", "g", "initial_state", "o", "final_state", "do", "dht", "dq", "dk", "dv", "dg", "dh0"};
    for (size_t i = 0; i < std::size(all); ++i) {
      if (!all[i]->present || !all[i]->overflows) continue;
      const gla_tensor& t = all[i]->t;
      std::fprintf(stderr, "entry %d: %s rank %d dtype %d sizes", entry, names[i], t.rank, t.dtype);
      for (int d = 0; d < GLA_MAX_RANK; ++d) std::fprintf(stderr, " %lld", static_cast<long long>(t.sizes[d]));
      std::fprintf(stderr, " strides");
      for (int d = 0; d < GLA_MAX_RANK; ++d) std::fprintf(stderr, " %lld", static_cast<long long>(t.strides[d]));
      std::fprintf(stderr, "\n");
    }
    if (cu.overflows || cuh.overflows) std::fprintf(stderr, "cu_seqlens or its host copy overflows\n");
    fail("a descriptor whose addressing overflows int64 was accepted");
  }
  if (status != GLA_STATUS_OK) {
    (void)outs_f;
    (void)outs_b;
    for (size_t i = 0; i < std::size(all); ++i) {
      if (all[i]->owned != before[i]) fail("a rejected call wrote into a buffer");
    }
  }
  if (entry >= 4 && status == GLA_STATUS_OK && (text == nullptr || std::strstr(text, "decision: ") == nullptr)) {
    fail("explain succeeded without a decision line");
  }
  return 0;
}
