// The chunk backward's workspace plan (chunk_backward.hpp): plain C++, so the tests check it without
// a GPU (tests/cpp/test_cuda_backward_plan.cpp); and the reversed forward's problem, which the plan
// and the launcher (chunk_backward.cu) both build.
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <vector>

#include "backends/cuda/chunk_backward.hpp"

namespace gla::cuda {
namespace backward {

// Whether the reversed forward takes do as its values (else zeros: do absent, or scale = 0 where
// dht / scale cannot carry the state gradient).
bool values_from_do(const BackwardParams& p) { return p.do_ != nullptr && p.scale != 0.0f; }

bool gradients_hold_prepared(const BackwardParams& p) {
  auto packed = [&](const void* t, const int64_t* s) {
    return t != nullptr && s[2] == p.K && s[1] == p.H * p.K && s[0] == p.T * p.H * p.K &&
           reinterpret_cast<uintptr_t>(t) % 16 == 0;
  };
  return packed(p.dq, p.dq_stride) && packed(p.dk, p.dk_stride);
}

// The forward problem whose output is dv: q' = k, k' = q, v' = do, all reversed in time (negative
// time strides from the last token), o' = dv reversed, and g' = g reversed and read one token late
// (ForwardParams::gate_lag: g' at reversed token u is g of token T - u, 0 at a sequence's first).
ForwardParams reversed_forward(const BackwardParams& p, const BackwardPlan& plan, char* workspace) {
  ForwardParams f{};
  const int64_t last = p.T > 0 ? p.T - 1 : 0;
  auto reversed = [&](const void* base, const int64_t* s, int64_t* out, int64_t element_bytes = 2) -> const char* {
    out[0] = s[0];
    out[1] = -s[1];
    out[2] = s[2];
    return base == nullptr ? nullptr : static_cast<const char*>(base) + last * s[1] * element_bytes;
  };
  f.q = reversed(p.k, p.k_stride, f.q_stride);
  f.k = reversed(p.q, p.q_stride, f.k_stride);
  const int64_t zero_stride[3] = {p.T * p.H * p.V, p.H * p.V, p.V};
  f.v = values_from_do(p) ? reversed(p.do_, p.do_stride, f.v_stride)
                          : reversed(workspace ? workspace + plan.zero_values : nullptr, zero_stride, f.v_stride);
  f.o = const_cast<char*>(reversed(p.dv, p.dv_stride, f.o_stride));
  f.g = reversed(p.g, p.g_stride, f.g_stride, p.gate_dtype == kF32 ? 4 : 2);
  f.gate_lag = 1;
  if (p.dht != nullptr) {
    f.initial_state = workspace ? reinterpret_cast<const float*>(workspace + plan.reversed_dht) : nullptr;
    f.h0_stride[0] = p.H * p.K * p.V;
    f.h0_stride[1] = p.K * p.V;
    f.h0_stride[2] = p.V;
    f.h0_stride[3] = 1;
  }
  f.state_v_first = 0;
  f.varlen = p.varlen;
  f.cu_seqlens = p.varlen && workspace ? workspace + plan.reversed_offsets : nullptr;
  f.cu_seqlens_int64 = 1;
  f.B = p.B;
  f.T = p.T;
  f.H = p.H;
  f.K = p.K;
  f.V = p.V;
  f.N = p.N;
  f.scale = values_from_do(p) ? p.scale : 1.0f;
  f.dtype = p.dtype;
  f.gate_dtype = p.gate_dtype;
  f.gate_per_head = p.gate_per_head;
  // The gate's rows are read in place: the cp.async path needs them 16-byte aligned too.
  f.vector_loads = p.vector_loads && p.vector_dv && (p.gate_per_head || p.vector_gate);
  f.pad_front = plan.reversed_pad_front;
  if (gradients_hold_prepared(p)) {  // a prepared key split's qg and kg (dq and dk are written last)
    f.prepared_qg = static_cast<uint16_t*>(p.dq);
    f.prepared_kg = static_cast<uint16_t*>(p.dk);
  }
  if (plan.state_grads_by_values && workspace != nullptr) {
    // Reversed chunk r of (reversed) sequence n' is original chunk NC_n - 1 - r of its sequence
    // (with pad_front the reversed chunks end where the original ones start), at
    // state_grads[first_n + NC_n - 1 - r]. Without varlen sequence n' is row n' (first_n = n' NC,
    // P = n' NC): slot NC - 1 + P - r. With varlen it is sequence n = N - 1 - n', and
    // P = reversed_chunk_first[n'] counts the chunks of the sequences after n: slot
    // num_chunks - 1 - P - r.
    const int64_t chunk = p.H * p.K * p.V;
    const int64_t last = p.varlen ? p.num_chunks - 1 : (p.T + kChunk - 1) / kChunk - 1;
    f.chunk_states = reinterpret_cast<uint16_t*>(workspace + plan.state_grads) + last * chunk;
    if (p.varlen) f.chunk_first = reinterpret_cast<const int64_t*>(workspace + plan.reversed_chunk_first);
    f.chunk_states_stride[0] = p.varlen ? -chunk : chunk;
    f.chunk_states_stride[1] = -chunk;
    f.chunk_states_stride[2] = p.K * p.V;
    f.chunk_states_stride[3] = p.V;
    if (plan.reversed_final) {
      f.final_state = reinterpret_cast<float*>(workspace + plan.reversed_final);
      f.ht_stride[0] = p.H * p.K * p.V;
      f.ht_stride[1] = p.K * p.V;
      f.ht_stride[2] = p.V;
      f.ht_stride[3] = 1;
    }
  }
  return f;
}

}  // namespace backward

namespace {
size_t align256(size_t x) { return (x + 255) & ~size_t(255); }
}  // namespace

BackwardPlan plan_backward(const BackwardParams& p, const int64_t* seq_offsets, int sm_count) {
  BackwardPlan plan;
  plan.key_tiles = static_cast<int32_t>((p.K + backward::kTile - 1) / backward::kTile);
  plan.value_tiles = static_cast<int32_t>((p.V + backward::kTile - 1) / backward::kTile);
  plan.scan_value_groups = static_cast<int32_t>((p.V + backward::kScanValues - 1) / backward::kScanValues);
  // Whether the state gradients can come from the reversed forward (BackwardPlan::state_grads_by_values):
  // decided before the walks' segment split, which counts the walks.
  const bool wants_state_grads = p.dq != nullptr || p.dk != nullptr || p.dg != nullptr || p.dh0 != nullptr;
  bool aligned = p.N > 0;
  for (int64_t n = 0; n < p.N && aligned; ++n) aligned = (seq_offsets[n + 1] - seq_offsets[n]) % backward::kChunk == 0;
  if (!p.varlen) aligned = aligned && p.T % backward::kChunk == 0;
  std::vector<int64_t> reversed_offsets(seq_offsets, seq_offsets + p.N + 1);
  if (p.varlen) {
    for (int64_t i = 0; i <= p.N; ++i) reversed_offsets[i] = p.T - seq_offsets[p.N - i];
  }
  if (p.dv != nullptr && p.num_chunks > 0 && wants_state_grads && backward::values_from_do(p) &&
      std::fabs(p.scale) >= backward::kMinStateGradScale) {
    const ForwardPlan values = plan_forward(backward::reversed_forward(p, plan, nullptr), reversed_offsets.data(), sm_count);
    plan.state_grads_by_values = aligned ? is_chunk(values.kernel) : is_warp_specialised(values.kernel);
    plan.reversed_pad_front = plan.state_grads_by_values && !aligned ? 1 : 0;
  }
  const bool forward_walks = p.saved_states == nullptr, reverse_walks = !plan.state_grads_by_values;
  plan.scan_directions = int32_t(forward_walks) + int32_t(reverse_walks);
  plan.scan_reverse_only = !forward_walks && reverse_walks ? 1 : 0;
  const size_t state_bytes = static_cast<size_t>(p.num_chunks) * p.H * p.K * p.V * backward::kStateBytes;
  size_t at = 0;
  plan.chunk_offsets = at;
  at = align256(at + static_cast<size_t>(p.N + 1) * sizeof(int64_t));
  plan.states = at;
  if (forward_walks) at = align256(at + state_bytes);
  plan.state_grads = at;
  at = align256(at + state_bytes);
  if (p.gate_per_head && plan.key_tiles > 1) {
    plan.gate_partials = at;
    at = align256(at + static_cast<size_t>(plan.key_tiles) * p.B * p.T * p.H * sizeof(float));
  }
  // Segment split of the state walks: when the walks (sequences x heads x blocks x 2) fill less
  // than one wave of the GPU (2 CTAs per SM), cut them into segments of at least 8 chunks that fill
  // two. A split walk costs about twice the chunk updates (the local pass): at B8 T4096 H16 D128
  // (1.9 waves) a split into 2 segments made fwd+bwd slower, 5.32 -> 6.01 ms; at B1 T32768 H16
  // D128 (a quarter of a wave) a split into 8 made it faster, 8.91 -> 7.16 ms.
  {
    int64_t max_chunks = 0;
    for (int64_t n = 0; n < p.N; ++n) {
      const int64_t c = (seq_offsets[n + 1] - seq_offsets[n] + backward::kChunk - 1) / backward::kChunk;
      max_chunks = c > max_chunks ? c : max_chunks;
    }
    // Both directions counted, as measured; with state_grads_by_values the grid has half of them
    // (the split then aims at about one wave).
    const int64_t walks = p.N * p.H * 2 * plan.key_tiles * plan.scan_value_groups;
    const int64_t slots = int64_t(sm_count > 0 ? sm_count : 1) * 2;
    if (plan.scan_directions > 0 && walks > 0 && walks < slots && max_chunks >= 16) {
      const int64_t want = (2 * slots + walks - 1) / walks;
      int64_t seg = (max_chunks + want - 1) / want;
      seg = seg < 8 ? 8 : seg;
      const int64_t segments = (max_chunks + seg - 1) / seg;
      if (segments > 1) {
        plan.scan_segment_chunks = seg;
        plan.scan_segments = segments;
        const size_t blocks = static_cast<size_t>(p.N) * segments * p.H * 2 * plan.key_tiles * plan.scan_value_groups;
        plan.segment_states = at;
        at = align256(at + blocks * backward::kTile * backward::kScanValues * sizeof(float));
        plan.segment_decay = at;
        at = align256(at + blocks * backward::kTile * sizeof(float));
      }
    }
  }
  if (p.dv != nullptr && p.num_chunks > 0) {
    // The reversed varlen batch has the same lengths in reverse order (the segment planner and the
    // longest-first block order see the reversed offsets).
    plan.values = plan_forward(backward::reversed_forward(p, plan, nullptr), reversed_offsets.data(), sm_count);
    if (p.varlen) {
      plan.reversed_offsets = at;
      at = align256(at + static_cast<size_t>(p.N + 1) * sizeof(int64_t));
      if (plan.state_grads_by_values) {
        plan.reversed_chunk_first = at;
        at = align256(at + static_cast<size_t>(p.N + 1) * sizeof(int64_t));
      }
    }
    if (p.dht != nullptr) {
      plan.reversed_dht = at;
      at = align256(at + static_cast<size_t>(p.N) * p.H * p.K * p.V * sizeof(float));
    }
    if (!backward::values_from_do(p)) {
      plan.zero_values = at;
      at = align256(at + static_cast<size_t>(p.B) * p.T * p.H * p.V * 2);
    }
    if (plan.state_grads_by_values && p.dh0 != nullptr) {
      plan.reversed_final = at;
      at = align256(at + static_cast<size_t>(p.N) * p.H * p.K * p.V * sizeof(float));
    }
    if (plan.values.workspace_bytes > 0) {
      plan.values_workspace = at;
      at = align256(at + plan.values.workspace_bytes);
    }
  }
  plan.workspace_bytes = at;
  plan.shared_bytes = backward_shared_bytes(p);
  return plan;
}

size_t backward_shared_bytes(const BackwardParams& p) {
  size_t bytes = p.N > 0 ? backward::kScanSharedBytes : 0;  // the walks
  if (p.num_chunks > 0 && (p.dq != nullptr || p.dk != nullptr || p.dg != nullptr)) {
    bytes = std::max(bytes, backward::kDqkSharedBytes);
  }
  if (p.dv != nullptr && p.num_chunks > 0) {  // the reversed forward's kernel
    bytes = std::max(bytes, forward_shared_bytes(backward::reversed_forward(p, BackwardPlan{}, nullptr)));
  }
  return bytes;
}

}  // namespace gla::cuda
