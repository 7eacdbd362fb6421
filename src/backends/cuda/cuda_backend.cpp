// The `cuda` backend: NVIDIA GPUs, compute capability 8.0 and up. Implements the whole chunk
// forward (GLA_UNIT_CHUNK_FWD, chunk_forward.hpp) and backward (GLA_UNIT_CHUNK_BWD, 16-bit inputs,
// chunk_backward.hpp), and the recurrent operator's forward and backward (GLA_UNIT_RECURRENT_FWD /
// BWD, recurrent.hpp); what it declines falls through to other backends.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda/chunk_backward.hpp"
#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/recurrent.hpp"
#include "backends/cuda/recurrent_forward.hpp"
#include "core/backend.hpp"
#include "core/capabilities.hpp"

namespace gla {
namespace {

struct DeviceInfo {
  int major = 0, minor = 0, sm_count = 0;
  int shared_per_block = -1;  // opt-in maximum of dynamic shared memory per block (bytes); -1 unknown
  bool ok = false;
};

// Properties of each device, read once.
const DeviceInfo& device_info(int index) {
  static std::mutex mutex;
  static std::vector<DeviceInfo> cache;
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.empty()) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    cache.resize(static_cast<size_t>(count));
    for (int i = 0; i < count; ++i) {
      DeviceInfo& d = cache[static_cast<size_t>(i)];
      d.ok = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, i) == cudaSuccess &&
             cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, i) == cudaSuccess &&
             cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, i) == cudaSuccess;
      if (cudaDeviceGetAttribute(&d.shared_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, i) != cudaSuccess) {
        cudaGetLastError();
        d.shared_per_block = -1;  // unknown: nothing is declined for it
      }
    }
  }
  static const DeviceInfo none;
  if (index < 0 || static_cast<size_t>(index) >= cache.size()) return none;
  return cache[static_cast<size_t>(index)];
}

int32_t element_type(int32_t dtype) {
  switch (dtype) {
    case GLA_DTYPE_F32: return cuda::kF32;
    case GLA_DTYPE_F16: return cuda::kF16;
    case GLA_DTYPE_BF16: return cuda::kBF16;
    default: return -1;
  }
}

// Makes the problem's device current for the scope of a call.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != index) {
      if (cudaSetDevice(index) == cudaSuccess) restore_ = true;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

void copy_strides(const gla_tensor& t, int64_t* out, int n) {
  for (int i = 0; i < n; ++i) out[i] = t.strides[i];
}

// A stream-ordered memory pool per device for workspaces, which keeps what it has mapped (release
// threshold: unlimited): with the default threshold of 0 every synchronisation unmaps the pool and
// the next call maps its workspace again (measured: 1.9 ms -> 3.5 ms on a 68 MB varlen workspace).
cudaMemPool_t workspace_pool(int device) {
  static std::mutex mutex;
  static std::map<int, cudaMemPool_t> pools;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = pools.find(device);
  if (it != pools.end()) return it->second;
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  cudaMemPool_t pool = nullptr;
  if (cudaMemPoolCreate(&pool, &props) == cudaSuccess) {
    uint64_t threshold = UINT64_MAX;
    cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
  } else {
    cudaGetLastError();
    pool = nullptr;  // fall back to the device's default pool
  }
  pools[device] = pool;
  return pool;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether every present tensor's rows can be moved in 16-byte pieces: data 16-byte aligned and the
// b, t, h strides multiples of 8 elements (the widths are checked by the caller).
bool rows_in_16_byte_pieces(std::initializer_list<const gla_tensor*> tensors) {
  for (const gla_tensor* t : tensors) {
    if (!present(*t)) continue;
    if (!aligned16(t->data)) return false;
    for (int i = 0; i < 3; ++i) {
      if (t->strides[i] % 8 != 0) return false;
    }
  }
  return true;
}

// The sequence layout and sizes both chunk parameter structs carry.
template <typename Params>
void set_sequences_and_sizes(Params& x, const gla_problem& p) {
  x.varlen = p.varlen;
  x.cu_seqlens = p.varlen ? p.cu_seqlens.data : nullptr;
  x.cu_seqlens_int64 = p.varlen && p.cu_seqlens.dtype == GLA_DTYPE_I64;
  x.B = p.B;
  x.T = p.T;
  x.H = p.H;
  x.K = p.K;
  x.V = p.V;
  x.N = p.N;
}

cuda::ForwardParams make_params(const gla_problem& p) {
  cuda::ForwardParams f{};
  f.q = p.q.data;
  f.k = p.k.data;
  f.v = p.v.data;
  f.g = p.g.data;
  f.o = p.o.data;
  copy_strides(p.q, f.q_stride, 3);
  copy_strides(p.k, f.k_stride, 3);
  copy_strides(p.v, f.v_stride, 3);
  copy_strides(p.g, f.g_stride, 3);
  copy_strides(p.o, f.o_stride, 3);
  f.initial_state = present(p.initial_state) ? static_cast<const float*>(p.initial_state.data) : nullptr;
  f.final_state = present(p.final_state) ? static_cast<float*>(p.final_state.data) : nullptr;
  if (f.initial_state) copy_strides(p.initial_state, f.h0_stride, 4);
  if (f.final_state) copy_strides(p.final_state, f.ht_stride, 4);
  f.state_v_first = p.state_v_first;
  set_sequences_and_sizes(f, p);
  f.scale = static_cast<float>(p.scale);
  f.dtype = element_type(p.dtype);
  f.gate_dtype = element_type(p.gate_dtype);
  f.gate_per_head = p.gate_per_head;
  // cp.async moves 16-byte pieces: rows must start 16-byte aligned and K, V be multiples of 8.
  const bool vec = p.K % 8 == 0 && p.V % 8 == 0 && rows_in_16_byte_pieces({&p.q, &p.k, &p.v, &p.o}) &&
                   (p.gate_per_head || rows_in_16_byte_pieces({&p.g}));
  f.vector_loads = vec ? 1 : 0;
  if (present(p.h)) {  // bf16 [NC, H, K, V], chunk-major (check_more declines the rest)
    f.chunk_states = static_cast<uint16_t*>(p.h.data);
    f.chunk_states_stride[0] = p.H * p.K * p.V;
    f.chunk_states_stride[1] = p.H * p.K * p.V;
    f.chunk_states_stride[2] = p.K * p.V;
    f.chunk_states_stride[3] = p.V;
  }
  return f;
}

const float* state_or_null(const gla_tensor& t) {
  return present(t) ? static_cast<const float*>(t.data) : nullptr;
}

cuda::BackwardParams make_backward_params(const gla_problem& p) {
  cuda::BackwardParams b{};
  b.q = p.q.data;
  b.k = p.k.data;
  b.v = p.v.data;
  b.g = p.g.data;
  b.do_ = present(p.do_) ? p.do_.data : nullptr;
  copy_strides(p.q, b.q_stride, 3);
  copy_strides(p.k, b.k_stride, 3);
  copy_strides(p.v, b.v_stride, 3);
  copy_strides(p.g, b.g_stride, 3);
  if (b.do_) copy_strides(p.do_, b.do_stride, 3);
  b.initial_state = state_or_null(p.initial_state);
  b.dht = state_or_null(p.dht);
  b.dh0 = present(p.dh0) ? static_cast<float*>(p.dh0.data) : nullptr;
  if (b.initial_state) copy_strides(p.initial_state, b.h0_stride, 4);
  if (b.dht) copy_strides(p.dht, b.dht_stride, 4);
  if (b.dh0) copy_strides(p.dh0, b.dh0_stride, 4);
  b.state_v_first = p.state_v_first;
  b.dq = present(p.dq) ? p.dq.data : nullptr;
  b.dk = present(p.dk) ? p.dk.data : nullptr;
  b.dv = present(p.dv) ? p.dv.data : nullptr;
  b.dg = present(p.dg) ? p.dg.data : nullptr;
  if (b.dq) copy_strides(p.dq, b.dq_stride, 3);
  if (b.dk) copy_strides(p.dk, b.dk_stride, 3);
  if (b.dv) copy_strides(p.dv, b.dv_stride, 3);
  if (b.dg) copy_strides(p.dg, b.dg_stride, 3);
  set_sequences_and_sizes(b, p);
  int64_t chunks = 0;
  if (p.seq_offsets != nullptr) {
    for (int64_t n = 0; n < p.N; ++n) chunks += (p.seq_offsets[n + 1] - p.seq_offsets[n] + 63) / 64;
  } else {
    // Offsets not copied from the device yet (check_more runs before that): at most one chunk
    // more per sequence than the tokens make; only its being nonzero is used then.
    chunks = p.B * ((p.T + 63) / 64) + (p.varlen ? p.N : 0);
  }
  b.num_chunks = chunks;
  b.scale = static_cast<float>(p.scale);
  b.dtype = element_type(p.dtype);
  b.gate_dtype = element_type(p.gate_dtype);
  b.dg_dtype = b.dg ? element_type(p.dg.dtype) : cuda::kF32;
  b.gate_per_head = p.gate_per_head;
  b.vector_loads = p.K % 8 == 0 && p.V % 8 == 0 && rows_in_16_byte_pieces({&p.q, &p.k, &p.v, &p.do_}) ? 1 : 0;
  b.vector_gate = !p.gate_per_head && p.K % 8 == 0 && rows_in_16_byte_pieces({&p.g}) ? 1 : 0;
  b.vector_dv = rows_in_16_byte_pieces({&p.dv}) ? 1 : 0;
  b.vector_dqk = p.K % 8 == 0 && rows_in_16_byte_pieces({&p.dq, &p.dk}) ? 1 : 0;
  b.saved_states = present(p.h) ? static_cast<const uint16_t*>(p.h.data) : nullptr;
  return b;
}

// Plans are cached per problem signature: the segment planner simulates the block schedule
// (up to ~1 ms of host time for many heads), which must not sit in front of every launch (the
// backward plans the reversed forward for dv the same way, and is asked for its workspace size and
// then run). One cache per call site (Make is the caller's lambda type).
template <typename Plan, typename Key, typename Make>
Plan cached(const Key& key, Make&& make) {
  static std::mutex mutex;
  static std::map<Key, Plan> cache;
  {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  const Plan plan = make();
  std::lock_guard<std::mutex> lock(mutex);
  if (cache.size() > 1024) cache.clear();
  cache.emplace(key, plan);
  return plan;
}

uint64_t offsets_hash(const gla_problem& p) {
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over the sequence offsets
  for (int64_t n = 0; n <= p.N; ++n) {
    hash ^= static_cast<uint64_t>(p.seq_offsets[n]);
    hash *= 1099511628211ull;
  }
  return hash;
}

cuda::ForwardPlan cached_plan(const cuda::ForwardParams& f, const gla_problem& p) {
  // vector_loads picks the kernel (the warp-specialised one needs cp.async rows).
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t, int32_t, uint64_t>;
  const Key key{p.device_index, f.N, f.H, f.K, f.V, f.T, f.dtype, f.gate_dtype, f.gate_per_head, f.vector_loads,
                offsets_hash(p)};
  return cached<cuda::ForwardPlan>(
      key, [&] { return cuda::plan_forward(f, p.seq_offsets, device_info(p.device_index).sm_count); });
}

cuda::BackwardPlan backward_plan(const cuda::BackwardParams& b, const gla_problem& p) {
  // Which inputs and outputs are present, and whether do feeds the reversed forward (scale != 0).
  const int32_t present_mask = (b.dq != nullptr) | (b.dk != nullptr) << 1 | (b.dv != nullptr) << 2 |
                               (b.dg != nullptr) << 3 | (b.dh0 != nullptr) << 4 | (b.dht != nullptr) << 5 |
                               (b.do_ != nullptr) << 6 | (b.scale != 0.0f) << 7 | (b.saved_states != nullptr) << 8 |
                               int32_t(cuda::backward::gradients_hold_prepared(b)) << 9;
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int32_t, int32_t, int32_t, int32_t,
                         int32_t, int32_t, int32_t, int32_t, uint64_t>;
  const Key key{p.device_index, b.B,           b.N,           b.H,          b.K,         b.V,
                b.T,            b.dtype,       b.gate_dtype,  b.gate_per_head, b.varlen, b.vector_loads,
                b.vector_gate,  b.vector_dv,   present_mask,  offsets_hash(p)};
  return cached<cuda::BackwardPlan>(
      key, [&] { return cuda::plan_backward(b, p.seq_offsets, device_info(p.device_index).sm_count); });
}

cuda::BackwardPlan backward_plan(const gla_problem& p) { return backward_plan(make_backward_params(p), p); }

// The dispatcher's workspace when it is large enough and aligned, else memory of our own for the
// scope (returned stream-ordered, so also after a failed launch).
class Workspace {
 public:
  Workspace(Backend& backend, const gla_problem& p, size_t bytes, uintptr_t alignment)
      : backend_(backend), p_(p), data_(p.workspace) {
    if (bytes > 0 && (data_ == nullptr || p.workspace_bytes < bytes || reinterpret_cast<uintptr_t>(data_) % alignment != 0)) {
      data_ = backend_.allocate(p_, bytes);
      owned_ = true;
    }
  }
  ~Workspace() {
    if (owned_) backend_.deallocate(p_, data_);
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* data() const { return data_; }

 private:
  Backend& backend_;
  const gla_problem& p_;
  void* data_;
  bool owned_ = false;
};

bool recurrent(const gla_problem& p) { return p.unit == GLA_UNIT_RECURRENT_FWD || p.unit == GLA_UNIT_RECURRENT_BWD; }

// A forward storing chunk states with cu_seqlens finds each sequence's first slot in a chunk table
// (ForwardParams::chunk_first, N + 1 int64) built on the device after the plan's own workspace.
bool needs_chunk_table(const gla_problem& p) { return present(p.h) && p.varlen; }
size_t chunk_first_offset(const cuda::ForwardPlan& plan) { return (plan.workspace_bytes + 255) / 256 * 256; }
size_t forward_workspace(const gla_problem& p, const cuda::ForwardPlan& plan) {
  if (!needs_chunk_table(p)) return plan.workspace_bytes;
  return chunk_first_offset(plan) + size_t(p.N + 1) * sizeof(int64_t);
}

class CudaBackend final : public Backend {
 public:
  std::string name() const override { return "cuda"; }
  int priority() const override { return 10; }
  // Compute capability 8.0 and up. The forward: the float dtypes, K up to 512 (two passes of
  // 128-wide key halves past 128), any V; the backward: 16-bit q, k, v (tensor-core operands), K and
  // V up to 512; the recurrent forward and backward: K up to kRecurrentMaxK (the state tile in
  // registers), the backward without the state pool (a serving step has no gradient). Rows
  // at stride 1 (vector loads); saved chunk states in bf16; no atomics anywhere, so deterministic.
  const std::vector<gla_capability>& capabilities() const override {
    static const std::vector<gla_capability> records = [] {
      const uint32_t chunk_features = GLA_FEATURE_VARLEN | GLA_FEATURE_INITIAL_STATE | GLA_FEATURE_FINAL_STATE |
                                      GLA_FEATURE_STATE_V_FIRST | GLA_FEATURE_PER_KEY_GATE | GLA_FEATURE_PER_HEAD_GATE;
      gla_capability forward = open_capability(unit_bit(GLA_UNIT_CHUNK_FWD), device_bit(GLA_DEVICE_CUDA));
      forward.min_compute_capability = 80;
      forward.k_max = 512;
      // Saved chunk states in bf16 (16-bit inputs, no cu_seqlens in the forward: check_more).
      forward.features = chunk_features | GLA_FEATURE_CHUNK_STATES_BF16;
      forward.layout = GLA_LAYOUT_LAST_DIM_CONTIGUOUS;
      forward.deterministic = 1;
      gla_capability backward = forward;
      backward.unit_mask = unit_bit(GLA_UNIT_CHUNK_BWD);
      backward.dtype_mask = dtype_bit(GLA_DTYPE_F16) | dtype_bit(GLA_DTYPE_BF16);
      backward.v_max = 512;
      gla_capability recurrent = forward;
      recurrent.unit_mask = unit_bit(GLA_UNIT_RECURRENT_FWD);
      recurrent.k_max = cuda::kRecurrentMaxK;
      recurrent.features = GLA_FEATURE_ALL & ~(GLA_FEATURE_CHUNK_STATES | GLA_FEATURE_CHUNK_STATES_BF16 | GLA_FEATURE_PER_HEAD_GATE);
      gla_capability recurrent_backward = recurrent;
      recurrent_backward.unit_mask = unit_bit(GLA_UNIT_RECURRENT_BWD);
      recurrent_backward.features &= ~(GLA_FEATURE_STATE_POOL | GLA_FEATURE_TOKEN_STATES);
      return std::vector<gla_capability>{forward, backward, recurrent, recurrent_backward};
    }();
    return records;
  }

  int compute_capability(const gla_problem& p) const override {
    const DeviceInfo& d = device_info(p.device_index);
    return d.ok ? 10 * d.major + d.minor : -1;
  }

  // What the declaration cannot say: the device's visibility, where cu_seqlens lives, grid limits,
  // and whether the device gives the planned kernels their shared memory (sm_90: 227 KB per block;
  // an A100 163 KB, below the K = 128 forward kernels' 200-230 KB; sm_86/sm_89 99 KB, below every
  // chunk kernel's).
  std::vector<std::string> check_more(const gla_problem& p) const override {
    std::vector<std::string> why;
    const DeviceInfo& device = device_info(p.device_index);
    if (!device.ok) why.push_back("CUDA device " + std::to_string(p.device_index) + " is not visible to this process");
    if (recurrent(p)) {
      for (auto& w : cuda::recurrent_checks(p)) why.push_back(std::move(w));
      return why;
    }
    if (p.varlen && p.cu_seqlens.device_type != GLA_DEVICE_CUDA) why.push_back("cu_seqlens must be in CUDA device memory");
    if (present(p.h)) {
      // The chunk kernels store the states (16-bit inputs, K <= 256: not the recurrent kernel), at
      // the C API's per-sequence slots (with cu_seqlens from a chunk table built on the device).
      if (p.dtype != GLA_DTYPE_BF16 && p.dtype != GLA_DTYPE_F16) why.push_back("saved chunk states need 16-bit q, k, v");
      if (!p.backward && p.K > 256) why.push_back("saved chunk states need K <= 256 (the chunk kernels)");
    }
    if (p.backward) {
      if (p.H > 65535) why.push_back("H > 65535 (grid limit)");
      // dv runs the forward's kernels (the forward's grid limits apply).
      if (present(p.dv) && p.H * ((p.V + 31) / 32) > 65535) why.push_back("H * ceil(V/32) > 65535 (grid limit)");
      if (p.N > (int64_t(1) << 24)) why.push_back("more than 2^24 sequences");
    } else {
      const int64_t value_tiles = (p.V + 31) / 32;
      if (p.H * value_tiles > 65535) why.push_back("H * ceil(V/32) > 65535 (grid limit)");
      if (p.N > (int64_t(1) << 24)) why.push_back("more than 2^24 sequences");
    }
    if (device.ok && why.empty()) {
      const size_t need = p.backward ? cuda::backward_shared_bytes(make_backward_params(p))
                                     : cuda::forward_shared_bytes(make_params(p));
      if (auto reason = cuda::shared_memory_shortfall(need, device.shared_per_block, p.backward != 0)) {
        why.push_back(*reason + " on CUDA device " + std::to_string(p.device_index));
      }
    }
    return why;
  }

  Verdict available() const override {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return Verdict::no(std::string("CUDA runtime reports no usable driver or device: ") + cudaGetErrorString(err));
    }
    if (count == 0) return Verdict::no("no CUDA device present");
    return Verdict::yes();
  }

  size_t workspace_size(const gla_problem& p) const override {
    if (recurrent(p)) return cuda::recurrent_workspace(p);
    if (p.backward) return backward_plan(p).workspace_bytes;
    const cuda::ForwardParams f = make_params(p);
    return forward_workspace(p, cached_plan(f, p));
  }

  std::string plan_note(const gla_problem& p) const override {
    if (recurrent(p)) return cuda::recurrent_plan_note(p);
    if (p.backward) {
      const cuda::BackwardPlan plan = backward_plan(p);
      const char* walks = plan.scan_directions == 0 ? "no state walks (saved chunk states; state gradients by the reversed forward)"
                          : plan.scan_reverse_only ? "reverse state walks per (sequence, head, block of 64 keys x 128 values; saved chunk states)"
                          : plan.scan_directions == 1 ? "forward state walks per (sequence, head, block of 64 keys x 128 values)"
                                                      : "state walks per (sequence, head, block of 64 keys x 128 values)";
      std::string s = "chunk backward: " + std::string(walks) +
                      ", then dq/dk/dg per (chunk, head, key tile of 64) on tensor cores; " +
          std::to_string(plan.key_tiles) + " key tile(s), " + std::to_string(plan.workspace_bytes) +
          " workspace bytes (bf16 chunk states and state gradients, the reversed gate)";
      if (present(p.dv)) s += "; dv by the forward run in reverse time: " + std::string(cuda::kernel_name(plan.values.kernel).description);
      return s;
    }
    const cuda::ForwardParams f = make_params(p);
    const cuda::ForwardPlan plan = cached_plan(f, p);
    std::string s = cuda::kernel_name(plan.kernel).description;
    if (!cuda::is_chunk(plan.kernel)) return s;
    s += ", K padded to " + std::to_string(plan.head_dim_k) + ", " + std::to_string(plan.value_tiles) +
         " value tile(s) of " + std::to_string(plan.value_tile);
    if (plan.key_split) {
      s += ", K split into halves of 128 and " + std::to_string(p.K - 128) +
           (plan.key_split == 2 ? " (A over all keys by a first kernel, then one pass per half, the second adding "
                                  "its o into the first's as it stores it)"
                                : " (A over all keys by a first kernel, then one pass per half, the second half's o "
                                  "summed into the first's by a third kernel)");
      if (plan.prepared) {
        s += "; the first kernel also forms qg, kg and the chunk decays once for all " +
             std::to_string(plan.value_tiles) + " value tiles, which the halves copy (state products on wgmma on sm_90a)";
      }
    }
    if (plan.max_segments > 1) {
      s += ", sequences " +
           (plan.whole_chunks > 0 ? "over " + std::to_string(plan.whole_chunks) + " chunks " : std::string()) +
           "split into segments of " + std::to_string(plan.segment_chunks) + " chunks (up to " +
           std::to_string(plan.max_segments) + "; two passes, " +
           std::to_string(plan.workspace_bytes) + " workspace bytes)";
    } else {
      s += ", one CTA walks each whole sequence";
    }
    if (cuda::ws_state_group_scales(f, plan)) s += "; the state group scales qg and kg (bf16, no chunk states)";
    return s;
  }

  void run(const gla_problem& p) override {
    if (p.unit == GLA_UNIT_RECURRENT_FWD) {
      DeviceGuard guard(p.device_index);
      cuda::run_recurrent(p);
      return;
    }
    if (p.unit == GLA_UNIT_RECURRENT_BWD) {
      DeviceGuard guard(p.device_index);
      const Workspace workspace(*this, p, cuda::recurrent_workspace(p), 16);
      cuda::run_recurrent_backward(p, workspace.data());
      return;
    }
    if (p.backward) {
      run_backward(p);
      return;
    }
    DeviceGuard guard(p.device_index);
    cuda::ForwardParams f = make_params(p);
    const cuda::ForwardPlan plan = cached_plan(f, p);
    const size_t bytes = forward_workspace(p, plan);
    void* workspace = p.workspace;
    bool owned = false;
    auto stream = static_cast<cudaStream_t>(p.stream);
    // The key split's partial o or A is written with 16-byte stores at a 256-byte offset (and the
    // chunk table sits at one): a caller's workspace that is not 256-byte aligned is not used.
    const bool misaligned = (plan.key_split != 0 || needs_chunk_table(p)) &&
                            reinterpret_cast<uintptr_t>(workspace) % 256 != 0;
    if (bytes > 0 && (workspace == nullptr || p.workspace_bytes < bytes || misaligned)) {
      workspace = allocate(p, bytes);
      owned = true;
    }
    cudaError_t err = cudaSuccess;
    if (needs_chunk_table(p)) {
      int64_t* first = reinterpret_cast<int64_t*>(static_cast<char*>(workspace) + chunk_first_offset(plan));
      err = cuda::launch_chunk_first(f, first, stream);
      f.chunk_first = first;
    }
    if (err == cudaSuccess) err = cuda::launch_forward(f, plan, workspace, stream);
    if (owned) deallocate(p, workspace);
    if (err != cudaSuccess) {
      fail(GLA_STATUS_BACKEND_ERROR, std::string("cuda forward launch failed: ") + cudaGetErrorString(err));
    }
  }

  void run_backward(const gla_problem& p) {
    DeviceGuard guard(p.device_index);
    const cuda::BackwardParams b = make_backward_params(p);
    const cuda::BackwardPlan plan = backward_plan(b, p);
    void* workspace = p.workspace;
    bool owned = false;
    if (workspace == nullptr || p.workspace_bytes < plan.workspace_bytes ||
        reinterpret_cast<uintptr_t>(workspace) % 256 != 0) {
      workspace = allocate(p, plan.workspace_bytes);
      owned = true;
    }
    const cudaError_t err = cuda::launch_backward(b, plan, workspace, static_cast<cudaStream_t>(p.stream));
    if (owned) deallocate(p, workspace);
    if (err != cudaSuccess) {
      fail(GLA_STATUS_BACKEND_ERROR, std::string("cuda backward launch failed: ") + cudaGetErrorString(err));
    }
  }

  // The `fastest` policy's clock on CUDA devices: events on the call's stream around one run.
  bool can_time(const gla_problem& p) const override { return p.device_type == GLA_DEVICE_CUDA; }
  double time_run_ms(const gla_problem& p, const std::function<void()>& run) override {
    DeviceGuard guard(p.device_index);
    auto stream = static_cast<cudaStream_t>(p.stream);
    cudaEvent_t start = nullptr, stop = nullptr;
    cudaError_t err = cudaEventCreate(&start);
    if (err == cudaSuccess) err = cudaEventCreate(&stop);
    if (err == cudaSuccess) err = cudaEventRecord(start, stream);
    if (err == cudaSuccess) {
      try {
        run();
      } catch (...) {
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        throw;
      }
      err = cudaEventRecord(stop, stream);
    }
    if (err == cudaSuccess) err = cudaEventSynchronize(stop);
    float ms = -1;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, start, stop);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (err != cudaSuccess) {
      cudaGetLastError();
      fail(GLA_STATUS_BACKEND_ERROR, std::string("timing with CUDA events failed: ") + cudaGetErrorString(err));
    }
    return ms;
  }
  bool stream_capturing(const gla_problem& p) const override {
    if (p.device_type != GLA_DEVICE_CUDA) return false;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(static_cast<cudaStream_t>(p.stream), &status) != cudaSuccess) {
      cudaGetLastError();
      return true;  // cannot tell: do not measure
    }
    return status != cudaStreamCaptureStatusNone;
  }

  void* allocate(const gla_problem& p, size_t bytes) override {
    if (bytes == 0) return nullptr;
    DeviceGuard guard(p.device_index);
    void* ptr = nullptr;
    const cudaMemPool_t pool = workspace_pool(p.device_index);
    auto stream = static_cast<cudaStream_t>(p.stream);
    const cudaError_t err =
        pool ? cudaMallocFromPoolAsync(&ptr, bytes, pool, stream) : cudaMallocAsync(&ptr, bytes, stream);
    if (err != cudaSuccess) {
      cudaGetLastError();
      fail(GLA_STATUS_OUT_OF_MEMORY, "cudaMallocAsync of " + std::to_string(bytes) + " bytes failed: " +
                                         cudaGetErrorString(err));
    }
    return ptr;
  }

  void deallocate(const gla_problem& p, void* pointer) override {
    if (!pointer) return;
    DeviceGuard guard(p.device_index);
    cudaFreeAsync(pointer, static_cast<cudaStream_t>(p.stream));
  }

  void copy_to_host(const gla_problem& p, const void* device_src, void* host_dst, size_t bytes) override {
    DeviceGuard guard(p.device_index);
    auto stream = static_cast<cudaStream_t>(p.stream);
    cudaError_t err = cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) {
      fail(GLA_STATUS_BACKEND_ERROR, std::string("device-to-host copy failed: ") + cudaGetErrorString(err));
    }
  }
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<CudaBackend>(); }

}  // namespace gla
