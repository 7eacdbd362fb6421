// gla::chunk_fwd and gla::chunk_bwd: schemas and their CPU and CUDA kernels, which call libgla's C
// ABI directly. Outputs and the workspace come from PyTorch's allocator; GPU work goes on PyTorch's
// current stream. The fake (shape) kernels and autograd are registered from Python (gla/_ops.py):
// they must handle symbolic shapes and build autograd nodes, which the stable ABI cannot.
//
// Custom operators cannot return None, so absent optional outputs are empty fp32 tensors (numel 0);
// the Python wrapper turns them back into None.
#include <array>
#include <cmath>
#include <string>
#include <tuple>

#include "torch_bridge.hpp"

namespace gla_torch {
namespace {

// Sequences: N = len(cu_seqlens) - 1 with cu_seqlens, else B (0 for shapes libgla rejects anyway).
int64_t num_sequences(const Tensor& q, const std::optional<Tensor>& cu_seqlens) {
  if (cu_seqlens.has_value()) return cu_seqlens->dim() == 1 && cu_seqlens->size(0) > 0 ? cu_seqlens->size(0) - 1 : 0;
  return q.dim() >= 1 ? q.size(0) : 0;
}

// initial_state / final_state shape: [N, H, K, V], or [N, H, V, K] with state_v_first.
std::array<int64_t, 4> state_shape(const Tensor& q, const Tensor& v, int64_t N, bool state_v_first) {
  if (q.dim() != 4 || v.dim() != 4) return {0, 0, 0, 0};  // libgla rejects q / v first, naming them
  const int64_t H = q.size(2), K = q.size(3), V = v.size(3);
  return state_v_first ? std::array<int64_t, 4>{N, H, V, K} : std::array<int64_t, 4>{N, H, K, V};
}

// The default scale, K ** -0.5 as Python computes it (pow of a double: bitwise the same), 1 for a
// q libgla rejects anyway.
double default_scale(const Tensor& q) {
  const int64_t K = q.dim() > 0 ? q.size(q.dim() - 1) : 0;
  return K > 0 ? std::pow(static_cast<double>(K), -0.5) : 1.0;
}

// Saved chunk states (gla.h, gla_chunk_forward_saving_states) in bf16 [NC, H, K, V] where a backend
// may save them: CUDA tensors, 16-bit q, K <= 256 (the cuda backend's conditions; anything else gets
// none, and the backward recomputes them).
bool may_save_states(const gla_tensor& q) {
  return q.device_type == GLA_DEVICE_CUDA && (q.dtype == GLA_DTYPE_BF16 || q.dtype == GLA_DTYPE_F16) &&
         q.rank == 4 && q.sizes[3] <= 256;
}

// NC with cu_seqlens: the sum of ceil(T_n / 64) over the host copy of the offsets; -1 where they cannot
// be read as offsets (the call then runs without states, and libgla names what is wrong with them).
int64_t varlen_chunks(const gla_tensor& host) {
  if (host.data == nullptr || host.device_type != GLA_DEVICE_CPU || host.rank != 1 || host.sizes[0] < 1 ||
      (host.dtype != GLA_DTYPE_I32 && host.dtype != GLA_DTYPE_I64)) {
    return -1;
  }
  auto offset = [&](int64_t i) {
    const int64_t at = i * host.strides[0];
    return host.dtype == GLA_DTYPE_I64 ? static_cast<const int64_t*>(host.data)[at]
                                       : int64_t{static_cast<const int32_t*>(host.data)[at]};
  };
  int64_t chunks = 0;
  for (int64_t n = 0; n + 1 < host.sizes[0]; ++n) {
    const int64_t len = offset(n + 1) - offset(n);
    if (len < 0) return -1;
    chunks += (len + 63) / 64;
  }
  return chunks;
}

// The forward, saving chunk states when save_states and may_save_states: (o, final state, states),
// states numel 0 where none were saved (not asked, not possible, or the chosen backend declined).
std::tuple<Tensor, Tensor, Tensor> forward(Tensor q, Tensor k, Tensor v, Tensor g, std::optional<Tensor> initial_state,
                                           std::optional<Tensor> cu_seqlens, std::optional<Tensor> cu_seqlens_cpu,
                                           std::optional<double> scale, bool state_v_first, bool output_final_state,
                                           const std::string& backend, int64_t policy, bool check_inputs,
                                           bool save_states) {
  gla_tensor dq = describe("q", q), dk = describe("k", k), dv = describe("v", v), dg = describe("g", g);
  gla_tensor dh0, dcu, dhost, dfinal;
  const std::optional<Tensor> host = host_offsets(cu_seqlens, cu_seqlens_cpu);
  Tensor o = empty_like(v);
  gla_tensor d_o = describe("o", o);
  std::optional<Tensor> final;
  if (output_final_state) {
    const auto shape = state_shape(q, v, num_sequences(q, cu_seqlens), state_v_first);
    final = empty(shape.data(), 4, float32_dtype(), q);
  }
  const gla_chunk_forward_args args{&dq,
                                    &dk,
                                    &dv,
                                    &dg,
                                    describe("initial_state", initial_state, dh0),
                                    describe("cu_seqlens", cu_seqlens, dcu),
                                    describe("cu_seqlens_host", host, dhost),
                                    &d_o,
                                    describe("final_state", final, dfinal)};
  gla_options options =
      make_options(scale.has_value() ? *scale : default_scale(q), state_v_first, backend, policy, q);
  options.check_inputs = check_inputs ? 1 : 0;
  const int64_t chunks = !save_states || !may_save_states(dq) ? -1
                       : cu_seqlens.has_value()          ? varlen_chunks(dhost)
                                                         : dq.sizes[0] * ((dq.sizes[1] + 63) / 64);
  if (chunks >= 0) {
    const int64_t sizes[4] = {chunks, dq.sizes[2], dq.sizes[3], dv.rank == 4 ? dv.sizes[3] : 0};
    Tensor states = empty(sizes, 4, bfloat16_dtype(), q);
    const gla_tensor dstates = describe("chunk_states", states);
    if (run_with_states(gla_chunk_forward_saving_states_with_allocator, args, dstates, options, q) == GLA_STATUS_OK) {
      return {o, final.has_value() ? *final : empty_state(q), states};
    }
  }
  run(gla_chunk_forward_with_allocator, args, options, q);
  return {o, final.has_value() ? *final : empty_state(q), empty_state(q)};
}

std::tuple<Tensor, Tensor> chunk_fwd(Tensor q, Tensor k, Tensor v, Tensor g, std::optional<Tensor> initial_state,
                                     std::optional<Tensor> cu_seqlens, std::optional<Tensor> cu_seqlens_cpu,
                                     std::optional<double> scale, bool state_v_first, bool output_final_state,
                                     std::string backend, int64_t policy, bool check_inputs) {
  auto [o, final, states] = forward(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first,
                                    output_final_state, backend, policy, check_inputs, false);
  return {o, final};
}

std::tuple<Tensor, Tensor, Tensor> chunk_fwd_saving_states(
    Tensor q, Tensor k, Tensor v, Tensor g, std::optional<Tensor> initial_state, std::optional<Tensor> cu_seqlens,
    std::optional<Tensor> cu_seqlens_cpu, std::optional<double> scale, bool state_v_first, bool output_final_state,
    std::string backend, int64_t policy, bool check_inputs) {
  return forward(q, k, v, g, initial_state, cu_seqlens, cu_seqlens_cpu, scale, state_v_first, output_final_state,
                 backend, policy, check_inputs, true);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> chunk_bwd(
    Tensor q, Tensor k, Tensor v, Tensor g, std::optional<Tensor> initial_state, std::optional<Tensor> cu_seqlens,
    std::optional<Tensor> cu_seqlens_cpu, std::optional<Tensor> do_, std::optional<Tensor> dht, double scale,
    bool state_v_first, std::string backend, int64_t policy, bool check_inputs, std::optional<Tensor> chunk_states) {
  gla_tensor tq = describe("q", q), tk = describe("k", k), tv = describe("v", v), tg = describe("g", g);
  gla_tensor th0, tcu, thost, tdo, tdht, tdh0;
  const std::optional<Tensor> host = host_offsets(cu_seqlens, cu_seqlens_cpu);
  Tensor dq = empty_like(q), dk = empty_like(k), dv = empty_like(v), dg = empty_like(g);
  std::optional<Tensor> dh0;
  if (initial_state.has_value()) {
    const auto shape = state_shape(q, v, num_sequences(q, cu_seqlens), state_v_first);
    dh0 = initial_state->dim() == 4 ? empty(initial_state->sizes().data(), 4, float32_dtype(), q)
                                    : empty(shape.data(), 4, float32_dtype(), q);
  }
  gla_tensor tdq = describe("dq", dq), tdk = describe("dk", dk), tdv = describe("dv", dv), tdg = describe("dg", dg);
  const gla_chunk_backward_args args{&tq,
                                     &tk,
                                     &tv,
                                     &tg,
                                     describe("initial_state", initial_state, th0),
                                     describe("cu_seqlens", cu_seqlens, tcu),
                                     describe("cu_seqlens_host", host, thost),
                                     describe("do", do_, tdo),
                                     describe("dht", dht, tdht),
                                     &tdq,
                                     &tdk,
                                     &tdv,
                                     &tdg,
                                     describe("dh0", dh0, tdh0)};
  gla_options options = make_options(scale, state_v_first, backend, policy, q);
  options.check_inputs = check_inputs ? 1 : 0;
  // The forward's saved states when it saved some (numel 0: none), else the backward recomputes them.
  gla_tensor tstates;
  const gla_tensor* states = chunk_states.has_value() && chunk_states->numel() > 0
                                 ? describe("chunk_states", chunk_states, tstates) : nullptr;
  if (states == nullptr ||
      run_with_states(gla_chunk_backward_from_states_with_allocator, args, *states, options, q) != GLA_STATUS_OK) {
    run(gla_chunk_backward_with_allocator, args, options, q);
  }
  return {dq, dk, dv, dg, dh0.has_value() ? *dh0 : empty_state(q)};
}

}  // namespace
}  // namespace gla_torch

// The schemas, shared with the Python fallback (gla/_ops.py defines the same strings when this
// library cannot load).
// chunk_fwd_no_autograd is chunk_fwd without an autograd kernel: the eager route of a call that builds
// no graph calls it directly, where chunk_fwd (whose autograd formula is registered from Python)
// needs a below-autograd guard around it (~9k instructions, ~1.5 us per call).
// chunk_fwd_saving_states (no autograd kernel either: _ChunkFwd's forward) also returns the saved
// chunk states, numel 0 where none were saved; chunk_bwd reads them (chunk_states).
#define GLA_CHUNK_FWD_ARGUMENTS                                                                   \
  "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? initial_state=None, Tensor? cu_seqlens=None, "  \
  "Tensor? cu_seqlens_cpu=None, float? scale=None, bool state_v_first=False, "                      \
  "bool output_final_state=False, str backend=\"\", int policy=0, bool check_inputs=False)"
STABLE_TORCH_LIBRARY_FRAGMENT(gla, m) {
  m.def("chunk_fwd" GLA_CHUNK_FWD_ARGUMENTS " -> (Tensor, Tensor)");
  m.def("chunk_fwd_no_autograd" GLA_CHUNK_FWD_ARGUMENTS " -> (Tensor, Tensor)");
  m.def("chunk_fwd_saving_states" GLA_CHUNK_FWD_ARGUMENTS " -> (Tensor, Tensor, Tensor)");
  m.def(
      "chunk_bwd(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? initial_state, Tensor? cu_seqlens, "
      "Tensor? cu_seqlens_cpu, Tensor? do, Tensor? dht, float scale, bool state_v_first, str backend, "
      "int policy, bool check_inputs=False, Tensor? chunk_states=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(gla, CPU, m) {
  m.impl("chunk_fwd", TORCH_BOX(&gla_torch::chunk_fwd));
  m.impl("chunk_fwd_no_autograd", TORCH_BOX(&gla_torch::chunk_fwd));
  m.impl("chunk_fwd_saving_states", TORCH_BOX(&gla_torch::chunk_fwd_saving_states));
  m.impl("chunk_bwd", TORCH_BOX(&gla_torch::chunk_bwd));
}

// The CUDA kernels are the same functions: libgla dispatches on the descriptors' device, and the
// stream comes from PyTorch's C shim, so nothing here needs CUDA headers.
STABLE_TORCH_LIBRARY_IMPL(gla, CUDA, m) {
  m.impl("chunk_fwd", TORCH_BOX(&gla_torch::chunk_fwd));
  m.impl("chunk_fwd_no_autograd", TORCH_BOX(&gla_torch::chunk_fwd));
  m.impl("chunk_fwd_saving_states", TORCH_BOX(&gla_torch::chunk_fwd_saving_states));
  m.impl("chunk_bwd", TORCH_BOX(&gla_torch::chunk_bwd));
}
