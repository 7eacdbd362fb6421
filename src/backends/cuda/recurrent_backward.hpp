// The CUDA recurrent backward (gla_recurrent_backward): dq, dk, dv, dgk, dgv and dh0 of the token
// loop, fp32 throughout. One CTA per (sequence, head, 32-value tile), like the forward; the state
// tile and its gradient live in registers. The exact per-step gate gradient
//   dgk_t[i] = sum_j dS_t[i,j] a_t[i] b_t[j] S_{t-1}[i,j]   (dgv_t[j]: the same summed over i)
// needs S_{t-1} beside dS_t, walking backwards: a forward pass keeps the state every
// kRecurrentBackwardBlock steps (checkpoints in the workspace), and the reverse pass recomputes each
// block's states from its checkpoint. The reverse-cumulative-sum identity (dg = revcumsum(q dq - k dk)
// + final term) needs no states but cancels catastrophically under strong decay: in fp32 it gave a
// relative RMS of 4e-3 on dg for g = logsigmoid(U)/0.1, where this form gives the fp32 rounding.
// Host-safe header: no CUDA types.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gla::cuda {

struct RecurrentBackwardParams {
  // Inputs [B, T, H, *] and the gradients of the same shapes: strides of dims 0..2 (the last
  // dimension is contiguous, checked by the declaration).
  const void* q;
  const void* k;
  const void* v;
  const void* gk;   // nullptr: no key gate
  const void* gv;   // nullptr: no value gate
  const void* do_;  // nullptr: zero
  void* dq;         // each nullptr: not wanted
  void* dk;
  void* dv;
  void* dgk;
  void* dgv;
  int64_t q_stride[3], k_stride[3], v_stride[3], gk_stride[3], gv_stride[3], do_stride[3];
  int64_t dq_stride[3], dk_stride[3], dv_stride[3], dgk_stride[3], dgv_stride[3];
  int32_t dtype, gk_dtype, gv_dtype, dgk_dtype, dgv_dtype;  // ElementType (chunk_forward.hpp)

  // States [N, H, K, V] ([N, H, V, K] with state_v_first): all four strides, read and written
  // element by element (once per CTA), so any strides.
  const float* initial_state;  // nullptr: zeros
  const float* dht;            // nullptr: zero
  float* dh0;                  // nullptr: not wanted
  int64_t h0_stride[4], dht_stride[4], dh0_stride[4];

  int32_t varlen;
  const void* cu_seqlens;  // [N + 1] on the device (varlen)
  int32_t cu_seqlens_int64;

  int64_t B, N, T, H, K, V;
  float scale;
  int32_t state_v_first;
  int32_t reverse;
};

// Steps between checkpoints: the reverse pass recomputes up to this many steps per step (7.5 on
// average) and the checkpoints take 1/kRecurrentBackwardBlock of the per-token states' memory.
constexpr int64_t kRecurrentBackwardBlock = 16;

// Workspace bytes of a call: the checkpoints, and with more than one value tile the per-tile partial
// sums of `row_gradients` of dq, dk and dgk (summed over the tiles in a fixed order by a second
// kernel). The launch uses the non-null ones of params.dq, dk, dgk.
size_t recurrent_backward_workspace(const RecurrentBackwardParams& params, int row_gradients);

// Queues the kernels on `stream` (a cudaStream_t) with `workspace` (16-byte aligned, at least
// recurrent_backward_workspace bytes); returns a cudaError_t as int.
int launch_recurrent_backward(const RecurrentBackwardParams& params, void* workspace, void* stream);

}  // namespace gla::cuda
