// gla::recurrent_fwd, gla::recurrent_bwd and gla::recurrent_state_update: schemas and their CPU and
// CUDA kernels over libgla's C ABI (gla_recurrent_*), built like chunk_ops.cpp. The fake kernels and
// the forward's autograd are registered from Python (gla/_recurrent.py).
//
// The state update mutates state_pool and slot_error in place (declared in the schema, so
// torch.compile functionalises it) and allocates only its outputs: no host synchronisation unless
// check_slots, so a decode step can be captured in a CUDA graph.
#include <array>
#include <string>
#include <tuple>

#include "torch_bridge.hpp"

namespace gla_torch {
namespace {

bool rank4(const Tensor& q, const Tensor& v) { return q.dim() == 4 && v.dim() == 4; }

std::tuple<Tensor, Tensor> recurrent_fwd(Tensor q, Tensor k, Tensor v, std::optional<Tensor> gk,
                                         std::optional<Tensor> gv, std::optional<Tensor> initial_state,
                                         std::optional<Tensor> cu_seqlens, double scale, bool reverse,
                                         bool state_v_first, bool output_final_state, std::string backend,
                                         int64_t policy, std::optional<Tensor> cu_seqlens_cpu) {
  gla_tensor dq = describe("q", q), dk = describe("k", k), dv = describe("v", v);
  gla_tensor dgk, dgv, dh0, dcu, dhost, dfinal;
  const std::optional<Tensor> host = host_offsets(cu_seqlens, cu_seqlens_cpu);
  Tensor o = empty_like(v);
  gla_tensor d_o = describe("o", o);
  std::optional<Tensor> final;
  if (output_final_state && rank4(q, v)) {  // otherwise libgla rejects q / v, naming them
    const int64_t N = cu_seqlens.has_value() ? (cu_seqlens->dim() == 1 && cu_seqlens->size(0) > 0
                                                    ? cu_seqlens->size(0) - 1 : 0)
                                             : q.size(0);
    const int64_t H = q.size(2), K = q.size(3), V = v.size(3);
    const std::array<int64_t, 4> shape = state_v_first ? std::array<int64_t, 4>{N, H, V, K}
                                                       : std::array<int64_t, 4>{N, H, K, V};
    final = empty(shape.data(), 4, float32_dtype(), q);
  }
  const gla_recurrent_forward_args args{&dq,
                                        &dk,
                                        &dv,
                                        describe("gk", gk, dgk),
                                        describe("gv", gv, dgv),
                                        describe("initial_state", initial_state, dh0),
                                        describe("cu_seqlens", cu_seqlens, dcu),
                                        describe("cu_seqlens_host", host, dhost),
                                        &d_o,
                                        describe("final_state", final, dfinal),
                                        reverse ? 1 : 0};
  const gla_options options = make_options(scale, state_v_first, backend, policy, q);
  check(gla_recurrent_forward(&args, &options));
  return {o, final.has_value() ? *final : empty_state(q)};
}

// An output shaped like an optional input (absent: none).
std::optional<Tensor> like(const std::optional<Tensor>& t) {
  return t.has_value() ? std::optional<Tensor>(empty_like(*t)) : std::nullopt;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> recurrent_bwd(
    Tensor q, Tensor k, Tensor v, std::optional<Tensor> gk, std::optional<Tensor> gv,
    std::optional<Tensor> initial_state, std::optional<Tensor> cu_seqlens, std::optional<Tensor> do_,
    std::optional<Tensor> dht, double scale, bool reverse, bool state_v_first, std::string backend, int64_t policy,
    std::optional<Tensor> cu_seqlens_cpu) {
  gla_tensor tq = describe("q", q), tk = describe("k", k), tv = describe("v", v);
  gla_tensor tgk, tgv, th0, tcu, thost, tdo, tdht, tdgk, tdgv, tdh0;
  // Inputs described first: describe rejects a rank above GLA_MAX_RANK before any output shaped
  // like an input is allocated.
  const gla_tensor* pgk = describe("gk", gk, tgk);
  const gla_tensor* pgv = describe("gv", gv, tgv);
  const gla_tensor* ph0 = describe("initial_state", initial_state, th0);
  const std::optional<Tensor> host = host_offsets(cu_seqlens, cu_seqlens_cpu);
  Tensor dq = empty_like(q), dk = empty_like(k), dv = empty_like(v);
  const std::optional<Tensor> dgk = like(gk), dgv = like(gv);
  std::optional<Tensor> dh0;
  if (initial_state.has_value()) {
    dh0 = empty(initial_state->sizes().data(), initial_state->dim(), float32_dtype(), q);
  }
  gla_tensor tdq = describe("dq", dq), tdk = describe("dk", dk), tdv = describe("dv", dv);
  const gla_recurrent_backward_args args{&tq,
                                         &tk,
                                         &tv,
                                         pgk,
                                         pgv,
                                         ph0,
                                         describe("cu_seqlens", cu_seqlens, tcu),
                                         describe("cu_seqlens_host", host, thost),
                                         describe("do", do_, tdo),
                                         describe("dht", dht, tdht),
                                         &tdq,
                                         &tdk,
                                         &tdv,
                                         describe("dgk", dgk, tdgk),
                                         describe("dgv", dgv, tdgv),
                                         describe("dh0", dh0, tdh0),
                                         reverse ? 1 : 0};
  const gla_options options = make_options(scale, state_v_first, backend, policy, q);
  check(gla_recurrent_backward(&args, &options));
  const auto or_empty = [&q](const std::optional<Tensor>& t) { return t.has_value() ? *t : empty_state(q); };
  return {dq, dk, dv, or_empty(dgk), or_empty(dgv), or_empty(dh0)};
}

std::tuple<Tensor, Tensor> recurrent_state_update(Tensor q, Tensor k, Tensor v, std::optional<Tensor> gk,
                                                  std::optional<Tensor> gv, Tensor state_pool, Tensor state_slots,
                                                  Tensor slot_error, double scale, bool state_v_first,
                                                  bool output_token_states, bool check_slots, std::string backend,
                                                  int64_t policy) {
  gla_tensor dq = describe("q", q), dk = describe("k", k), dv = describe("v", v);
  gla_tensor dpool = describe("state_pool", state_pool), dslots = describe("state_slots", state_slots);
  gla_tensor derror = describe("slot_error", slot_error);
  gla_tensor dgk, dgv, dstates;
  Tensor o = empty_like(v);
  gla_tensor d_o = describe("o", o);
  std::optional<Tensor> token_states;
  if (output_token_states && rank4(q, v)) {
    const int64_t B = q.size(0), T = q.size(1), H = q.size(2), K = q.size(3), V = v.size(3);
    const std::array<int64_t, 5> shape = state_v_first ? std::array<int64_t, 5>{B, T, H, V, K}
                                                       : std::array<int64_t, 5>{B, T, H, K, V};
    token_states = empty(shape.data(), 5, float32_dtype(), q);
  }
  const gla_recurrent_state_update_args args{&dq,
                                             &dk,
                                             &dv,
                                             describe("gk", gk, dgk),
                                             describe("gv", gv, dgv),
                                             &dpool,
                                             &dslots,
                                             &derror,
                                             &d_o,
                                             describe("token_states", token_states, dstates),
                                             check_slots ? 1 : 0};
  const gla_options options = make_options(scale, state_v_first, backend, policy, q);
  check(gla_recurrent_state_update(&args, &options));
  return {o, token_states.has_value() ? *token_states : empty_state(q)};
}

}  // namespace
}  // namespace gla_torch

// The schemas, shared with the Python fallback (gla/_recurrent.py defines the same strings when this
// library cannot load).
STABLE_TORCH_LIBRARY_FRAGMENT(gla, m) {
  m.def(
      "recurrent_fwd(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, Tensor? initial_state, "
      "Tensor? cu_seqlens, float scale, bool reverse, bool state_v_first, bool output_final_state, str backend, "
      "int policy, Tensor? cu_seqlens_cpu=None) -> (Tensor, Tensor)");
  m.def(
      "recurrent_bwd(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, Tensor? initial_state, "
      "Tensor? cu_seqlens, Tensor? do, Tensor? dht, float scale, bool reverse, bool state_v_first, str backend, "
      "int policy, Tensor? cu_seqlens_cpu=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def(
      "recurrent_state_update(Tensor q, Tensor k, Tensor v, Tensor? gk, Tensor? gv, Tensor(a!) state_pool, "
      "Tensor state_slots, Tensor(b!) slot_error, float scale, bool state_v_first, bool output_token_states, "
      "bool check_slots, str backend, int policy) -> (Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(gla, CPU, m) {
  m.impl("recurrent_fwd", TORCH_BOX(&gla_torch::recurrent_fwd));
  m.impl("recurrent_bwd", TORCH_BOX(&gla_torch::recurrent_bwd));
  m.impl("recurrent_state_update", TORCH_BOX(&gla_torch::recurrent_state_update));
}

// The same functions: libgla dispatches on the descriptors' device (see chunk_ops.cpp).
STABLE_TORCH_LIBRARY_IMPL(gla, CUDA, m) {
  m.impl("recurrent_fwd", TORCH_BOX(&gla_torch::recurrent_fwd));
  m.impl("recurrent_bwd", TORCH_BOX(&gla_torch::recurrent_bwd));
  m.impl("recurrent_state_update", TORCH_BOX(&gla_torch::recurrent_state_update));
}
