#include "backends/cuda/recurrent.hpp"

#include <cuda_runtime_api.h>

#include <string>

#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/recurrent_backward.hpp"
#include "backends/cuda/recurrent_forward.hpp"

namespace gla::cuda {

namespace {

int32_t element_type_of(int32_t dtype) {
  switch (dtype) {
    case GLA_DTYPE_F32: return kF32;
    case GLA_DTYPE_F16: return kF16;
    case GLA_DTYPE_BF16: return kBF16;
    default: return -1;
  }
}

// Why the state tensor cannot be read as float4 tiles ("" = it can): 16-byte aligned, last dim
// contiguous, the other strides multiples of 4, the contiguous size a multiple of 4.
std::string state_tile_reason(const char* name, const gla_tensor& t) {
  if (!present(t)) return "";
  const int last = t.rank - 1;
  if (t.sizes[last] % 4 != 0) {
    return std::string(name) + ": its last dimension (" + std::to_string(t.sizes[last]) +
           ") must be a multiple of 4 for the 16-byte state loads";
  }
  if (t.strides[last] != 1) return std::string(name) + " needs a contiguous last dimension, got stride " + std::to_string(t.strides[last]);
  for (int d = 0; d < last; ++d) {
    if (t.strides[d] % 4 != 0 && t.sizes[d] > 1) {
      return std::string(name) + ": stride " + std::to_string(t.strides[d]) + " of dim " + std::to_string(d) +
             " is not a multiple of 4 (16-byte state loads)";
    }
  }
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return std::string(name) + ": data is not 16-byte aligned";
  return "";
}

void copy3(const gla_tensor& t, int64_t* out) {
  for (int i = 0; i < 3; ++i) out[i] = t.strides[i];
}
void copy4(const gla_tensor& t, int64_t* out) {
  for (int i = 0; i < 4; ++i) out[i] = t.strides[i];
}

void* data_or_null(const gla_tensor& t) { return present(t) ? t.data : nullptr; }

// What the forward's and the backward's parameter structs share: the inputs q, k, v, gk, gv with
// their strides and dtypes, the sequences, sizes, scale, state layout and order.
template <class Params>
void set_inputs_and_sizes(Params& r, const gla_problem& p) {
  r.q = p.q.data;
  r.k = p.k.data;
  r.v = p.v.data;
  r.gk = data_or_null(p.g);
  r.gv = data_or_null(p.gv);
  copy3(p.q, r.q_stride);
  copy3(p.k, r.k_stride);
  copy3(p.v, r.v_stride);
  if (r.gk) copy3(p.g, r.gk_stride);
  if (r.gv) copy3(p.gv, r.gv_stride);
  r.dtype = element_type_of(p.dtype);
  r.gk_dtype = r.gk ? element_type_of(p.g.dtype) : kF32;
  r.gv_dtype = r.gv ? element_type_of(p.gv.dtype) : kF32;
  r.cu_seqlens = p.varlen ? p.cu_seqlens.data : nullptr;
  r.cu_seqlens_int64 = p.varlen && p.cu_seqlens.dtype == GLA_DTYPE_I64;
  r.N = p.N;
  r.T = p.T;
  r.H = p.H;
  r.K = p.K;
  r.V = p.V;
  r.scale = static_cast<float>(p.scale);
  r.state_v_first = p.state_v_first;
  r.reverse = p.reverse;
}

RecurrentBackwardParams backward_params(const gla_problem& p) {
  RecurrentBackwardParams r{};
  set_inputs_and_sizes(r, p);
  r.varlen = p.varlen;
  r.B = p.B;
  r.do_ = data_or_null(p.do_);
  r.dq = data_or_null(p.dq);
  r.dk = data_or_null(p.dk);
  r.dv = data_or_null(p.dv);
  r.dgk = data_or_null(p.dg);
  r.dgv = data_or_null(p.dgv);
  if (r.do_) copy3(p.do_, r.do_stride);
  if (r.dq) copy3(p.dq, r.dq_stride);
  if (r.dk) copy3(p.dk, r.dk_stride);
  if (r.dv) copy3(p.dv, r.dv_stride);
  if (r.dgk) copy3(p.dg, r.dgk_stride);
  if (r.dgv) copy3(p.dgv, r.dgv_stride);
  r.dgk_dtype = r.dgk ? element_type_of(p.dg.dtype) : kF32;
  r.dgv_dtype = r.dgv ? element_type_of(p.dgv.dtype) : kF32;
  r.initial_state = static_cast<const float*>(data_or_null(p.initial_state));
  r.dht = static_cast<const float*>(data_or_null(p.dht));
  r.dh0 = static_cast<float*>(data_or_null(p.dh0));
  if (r.initial_state) copy4(p.initial_state, r.h0_stride);
  if (r.dht) copy4(p.dht, r.dht_stride);
  if (r.dh0) copy4(p.dh0, r.dh0_stride);
  return r;
}

int64_t value_tiles(const gla_problem& p) { return (p.V + kRecurrentValueTile - 1) / kRecurrentValueTile; }

}  // namespace

std::vector<std::string> recurrent_checks(const gla_problem& p) {
  std::vector<std::string> why;
  if (p.varlen && p.cu_seqlens.device_type != GLA_DEVICE_CUDA) why.push_back("cu_seqlens must be in CUDA device memory");
  if (p.N * value_tiles(p) > 0x7fffffff) why.push_back("N * ceil(V/32) > 2^31 - 1 (grid limit)");
  if (p.H > 65535) why.push_back("H > 65535 (grid limit)");
  if (p.unit == GLA_UNIT_RECURRENT_BWD) return why;  // the backward moves states element by element
  const bool pool = present(p.state_slots);
  struct Named {
    const char* name;
    const gla_tensor* t;
  };
  for (const Named& x : {Named{pool ? "state_pool" : "initial_state", &p.initial_state},
                         Named{"final_state", &p.final_state}, Named{"token_states", &p.token_states}}) {
    if (pool && x.t == &p.final_state) continue;  // the same pool, already checked
    std::string reason = state_tile_reason(x.name, *x.t);
    if (!reason.empty()) why.push_back(std::move(reason));
  }
  return why;
}

void run_recurrent(const gla_problem& p) {
  RecurrentParams r{};
  set_inputs_and_sizes(r, p);
  r.o = p.o.data;
  copy3(p.o, r.o_stride);
  r.initial_state = present(p.initial_state) ? static_cast<const float*>(p.initial_state.data) : nullptr;
  r.final_state = present(p.final_state) ? static_cast<float*>(p.final_state.data) : nullptr;
  if (r.initial_state) copy3(p.initial_state, r.h0_stride);
  if (r.final_state) copy3(p.final_state, r.ht_stride);
  if (present(p.token_states)) {
    r.token_states = static_cast<float*>(p.token_states.data);
    for (int i = 0; i < 4; ++i) r.ts_stride[i] = p.token_states.strides[i];
  }
  if (present(p.state_slots)) {
    r.slots = static_cast<const int32_t*>(p.state_slots.data);
    r.slot_stride = p.state_slots.strides[0];
    r.pool_size = p.initial_state.sizes[0];
    r.slot_error = static_cast<int32_t*>(p.slot_error.data);
  }
  const int err = launch_recurrent_forward(r, p.stream);
  if (err != cudaSuccess) {
    fail(GLA_STATUS_BACKEND_ERROR, std::string("cuda recurrent forward launch failed: ") +
                                       cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
}

size_t recurrent_workspace(const gla_problem& p) {
  if (p.unit != GLA_UNIT_RECURRENT_BWD) return 0;
  // By presence: explain() describes outputs without data.
  return recurrent_backward_workspace(backward_params(p), present(p.dq) + present(p.dk) + present(p.dg));
}

void run_recurrent_backward(const gla_problem& p, void* workspace) {
  const int err = launch_recurrent_backward(backward_params(p), workspace, p.stream);
  if (err != cudaSuccess) {
    fail(GLA_STATUS_BACKEND_ERROR, std::string("cuda recurrent backward launch failed: ") +
                                       cudaGetErrorString(static_cast<cudaError_t>(err)));
  }
}

std::string recurrent_plan_note(const gla_problem& p) {
  const std::string ctas = std::to_string(p.N * p.H * value_tiles(p)) + " CTAs";
  if (p.unit != GLA_UNIT_RECURRENT_BWD) {
    return "recurrent decode kernel: one CTA per (sequence, head, 32-value tile), " + ctas +
           ", fp32 state tile in registers";
  }
  std::string s = "recurrent backward: one CTA per (sequence, head, 32-value tile), " + ctas +
                  "; fp32 state and state gradient in registers, the state kept every " +
                  std::to_string(kRecurrentBackwardBlock) + " steps and each block's states recomputed walking back; " +
                  std::to_string(recurrent_workspace(p)) + " workspace bytes";
  if (value_tiles(p) > 1 && (present(p.dq) || present(p.dk) || present(p.dg))) {
    s += "; dq/dk/dgk summed over the " + std::to_string(value_tiles(p)) + " value tiles by a second kernel";
  }
  return s;
}

}  // namespace gla::cuda
