// The CUDA recurrent forward (the decode kernel): one CTA per (sequence, head, 32-value tile) keeps
// its fp32 state tile in registers, reads it once with 16-byte loads, walks the sequence's tokens
// and writes it once. Serves gla_recurrent_forward and gla_recurrent_state_update (the pool by slot,
// skipped slots flagged on the device, no host synchronisation). Host-safe header: no CUDA types.
#pragma once

#include <cstdint>

namespace gla::cuda {

// One parameter struct for the kernel family. Element strides; every tensor's last dimension is
// contiguous (the host verifier checks it).
struct RecurrentParams {
  // Inputs [B, T, H, *] and the output o [B, T, H, V]: strides of dims 0..2.
  const void* q;
  const void* k;
  const void* v;
  const void* gk;  // nullptr: no key gate
  const void* gv;  // nullptr: no value gate
  void* o;
  int64_t q_stride[3], k_stride[3], v_stride[3], gk_stride[3], gv_stride[3], o_stride[3];
  int32_t dtype, gk_dtype, gv_dtype;  // ElementType (chunk_forward.hpp)

  // States [N or P, H, K, V] ([., H, V, K] with state_v_first): strides of dims 0..2. The tile is
  // read with float4 loads: 16-byte aligned pointers, strides multiples of 4.
  const float* initial_state;  // nullptr: zeros
  float* final_state;          // nullptr: not written
  int64_t h0_stride[3], ht_stride[3];
  float* token_states;  // [B, T, H, K, V] (or V, K): the state after each token; nullptr: none
  int64_t ts_stride[4];

  // The pool: sequence n's state index is slots[n] (nullptr: n). Bad or repeated slots are skipped
  // and flagged in *slot_error (GLA_SLOT_ERROR_* bits, atomicOr).
  const int32_t* slots;
  int64_t slot_stride;
  int64_t pool_size;
  int32_t* slot_error;

  const void* cu_seqlens;  // [N + 1] on the device, nullptr: sequence n is batch row n
  int32_t cu_seqlens_int64;

  int64_t N, T, H, K, V;
  float scale;
  int32_t state_v_first;
  int32_t reverse;
};

// Widest key dimension the kernels hold in registers.
constexpr int64_t kRecurrentMaxK = 256;
// Values per CTA.
constexpr int64_t kRecurrentValueTile = 32;

// Queues the kernel on `stream` (a cudaStream_t); returns a cudaError_t as int.
int launch_recurrent_forward(const RecurrentParams& params, void* stream);

}  // namespace gla::cuda
