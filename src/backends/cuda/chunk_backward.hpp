// The CUDA backend's chunk backward: parameter struct, workspace plan and host launcher.
//
// Framework-free: raw device pointers, element strides, sizes and a stream in; a cudaError_t out.
// The backward (SPEC.md §2, stages B0-B5) runs over 64-token chunks, with 64 x 64 tiles of the key
// and value dimensions (any K and V):
//   chunk offsets  one CTA: each sequence's first global chunk, from device cu_seqlens (no host copy,
//                  so the backward captures into CUDA graphs).
//   state scans    one CTA per (sequence, head, 64 keys, 128 values) and direction: the forward walk
//                  recomputes every chunk-start state S_c, the reverse walk every end-of-chunk state
//                  gradient dS_{c+1} and dh0; both bf16 in the workspace. The transition is
//                  diagonal in the keys, so key tiles are independent walks.
//   dq/dk/dg       one CTA per (chunk, head, key tile): dA = scale * do v^T over all values, then the
//                  inter-chunk terms from S_c and dS_{c+1}, the pivoted off-diagonal blocks on tensor
//                  cores, the 16 x 16 diagonal blocks element-wise, and dg by a reverse cumsum.
//   dv             the chunk forward run backwards in time (docs/cuda_backward.md, "dv by the reversed forward"):
//                  dv_t = dS_t^T k_t, and dS_t follows the forward's recurrence on the reversed sequence
//                  with q and k swapped, do as the values and the gate shifted by one token, so the
//                  forward's kernels (tensor-core diagonal blocks, segment split) compute dv.
// bf16 / fp16 tensor-core operands, fp32 accumulation, fp32 gate cumsum and state walks.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "backends/cuda/chunk_forward.hpp"

namespace gla::cuda {

// Strides are in elements; every tensor's last dimension is contiguous (checked by verify()).
struct BackwardParams {
  // Inputs: q, k [B, T, H, K]; v, do [B, T, H, V]; g [B, T, H, K] or [B, T, H] (gate_per_head).
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* do_;  // null: dL/do = 0
  int64_t q_stride[3], k_stride[3], v_stride[3], g_stride[3], do_stride[3];  // b, t, h
  // States [N, H, K, V] (or [N, H, V, K] with state_v_first), fp32; null when absent.
  const float* initial_state;
  const float* dht;
  float* dh0;
  int64_t h0_stride[4], dht_stride[4], dh0_stride[4];
  int32_t state_v_first;
  // Outputs (null when not wanted): dq, dk like q; dv like v; dg like g in dg_dtype.
  void* dq;
  void* dk;
  void* dv;
  void* dg;
  int64_t dq_stride[3], dk_stride[3], dv_stride[3], dg_stride[3];
  // Sequences: cu_seqlens (device, [N+1], int32 or int64) when varlen, else sequence n = row n.
  const void* cu_seqlens;
  int32_t cu_seqlens_int64;
  int32_t varlen;
  int64_t B, T, H, K, V, N;
  int64_t num_chunks;  // total 64-token chunks over all sequences (grid size)
  float scale;
  int32_t dtype;       // ElementType (chunk_forward.hpp) of q, k, v, do, dq, dk, dv: kF16 or kBF16
  int32_t gate_dtype;  // of g
  int32_t dg_dtype;    // of dg
  int32_t gate_per_head;
  int32_t vector_loads;  // 1: q, k, v, do rows 16-byte aligned, K and V multiples of 8
  int32_t vector_gate;   // 1: a per-key gate with 16-byte aligned rows and K a multiple of 8
  int32_t vector_dv;     // 1: dv rows 16-byte aligned (with vector_loads: the reversed forward's cp.async path)
  int32_t vector_dqk;    // 1: dq and dk rows 16-byte aligned and K a multiple of 8 (16-byte stores)
  // The forward's saved chunk-start states (gla_chunk_backward_from_states): bf16 [num_chunks, H, K,
  // V], the layout of BackwardPlan::states; null: the forward walks recompute them.
  const uint16_t* saved_states;
};

// Tile geometry the planner and the kernels share (chunk_backward_common.cuh uses these).
namespace backward {
constexpr int kChunk = detail::kChunk;  // tokens per chunk (SPEC.md §2)
constexpr int kTile = 64;               // key / value columns per tile
constexpr int kScanValues = 128;        // value columns per state walk (two tiles)
constexpr int kStateBytes = 2;          // bf16 chunk states and state gradients in the workspace
// Dynamic shared memory per block of the state walks and of the dq/dk/dg kernel
// (sizeof(ScanShared), sizeof(DqkShared): chunk_backward.cu checks them).
constexpr size_t kScanSharedBytes = 61696;
constexpr size_t kDqkSharedBytes = 113664;
}  // namespace backward

// Where each intermediate lives in the workspace (byte offsets, 256-byte aligned).
struct BackwardPlan {
  int32_t key_tiles = 0;    // ceil(K / 64)
  int32_t value_tiles = 0;  // ceil(V / 64)
  int32_t scan_value_groups = 0;  // ceil(V / 128): the state walks' value blocks
  size_t chunk_offsets = 0;  // int64 [N + 1]: first global chunk of each sequence
  size_t states = 0;         // bf16 [num_chunks, H, K, V]: S_c, the state before chunk c (none with saved_states)
  size_t state_grads = 0;    // bf16 [num_chunks, H, K, V]: dS_{c+1}, dL/d(state after chunk c)
  size_t gate_partials = 0;  // fp32 [key_tiles, B * T, H]: per-head gate only, dg per key tile
  // The state walks' segment split (scan_segment_chunks 0: one CTA walks each whole sequence).
  int64_t scan_segment_chunks = 0;
  int64_t scan_segments = 1;  // per sequence (grid)
  size_t segment_states = 0;  // fp32 [N, scan_segments, H, 2 * key_tiles * scan_value_groups, 64, 128]
  size_t segment_decay = 0;   // fp32 [N, scan_segments, H, 2 * key_tiles * scan_value_groups, 64]
  // dv by the reversed forward (dv wanted only; else values.kernel is unused and the sizes are 0):
  ForwardPlan values;              // the forward's plan for the reversed problem
  size_t values_workspace = 0;     // the forward's own workspace (values.workspace_bytes)
  size_t reversed_offsets = 0;     // int64 [N + 1]: cu_seqlens of the reversed varlen batch
  size_t reversed_dht = 0;         // fp32 [N, H, K, V]: dht / scale, sequences reversed with varlen
  size_t zero_values = 0;          // 16-bit [B, T, H, V] zeros: do absent or scale = 0
  // 1: the state gradients come from the reversed forward instead of the reverse state walk. Its
  // state at the start of each reversed chunk is dS_{c+1} / (scale · Diag(e^{g_{64(c+1)}})) of the
  // original chunk c, stored into state_grads; the dq/dk/dg kernel applies that factor, and dh0 is
  // scale · Diag(e^{g_0}) times its final state (reversed_final). Taken when the reversed forward
  // runs a chunk kernel with do as its values, 1 / scale is in range, and the chunks of both
  // directions line up: every sequence length a multiple of 64, or a warp-specialised kernel that
  // pads each reversed sequence at its start (reversed_pad_front); the walks then run forward only
  // (half the CTAs: one wave instead of two at B8 T4096 H16 D128), or none with saved states.
  int32_t state_grads_by_values = 0;
  // 1: the reversed forward walks with ForwardParams::pad_front (some length is not a multiple of 64).
  int32_t reversed_pad_front = 0;
  // int64 [N + 1]: with varlen and state_grads_by_values, the first chunk of each reversed sequence
  // (its chunk-state slots).
  size_t reversed_chunk_first = 0;
  size_t reversed_final = 0;       // fp32 [N, H, K, V]: the reversed forward's final state (dh0 wanted)
  // The state walks the grid holds: forward (the states; not with saved_states) and reverse (the
  // state gradients; not with state_grads_by_values). The grid's z runs over the forward walks'
  // tiles first; scan_reverse_only shifts it to the reverse ones.
  int32_t scan_directions = 2;
  int32_t scan_reverse_only = 0;
  size_t workspace_bytes = 0;
  size_t shared_bytes = 0;         // the most dynamic shared memory per block of the call's kernels
};

// seq_offsets: host copy of the N + 1 offsets (per-row 0, T, 2T... without varlen); sm_count of the
// device (the reversed forward's segment planner).
BackwardPlan plan_backward(const BackwardParams& p, const int64_t* seq_offsets, int sm_count);
// BackwardPlan::shared_bytes, without the sequence lengths (num_chunks > 0 stands for "some chunk").
size_t backward_shared_bytes(const BackwardParams& p);

namespace backward {
// dv is the chunk forward run backwards in time (docs/cuda_backward.md): the forward problem whose
// output is dv, over the caller's tensors and the workspace's reversed gate, offsets and dht (with
// workspace null: the same problem for planning, without those pointers).
ForwardParams reversed_forward(const BackwardParams& p, const BackwardPlan& plan, char* workspace);
// Whether the reversed forward takes do as its values (else zeros: do absent, or scale = 0 where
// dht / scale cannot carry the state gradient).
bool values_from_do(const BackwardParams& p);
// Whether dq and dk can hold the reversed forward's prepared qg and kg (ForwardParams::prepared_qg):
// both present, [B, T, H, K] contiguous and 16-byte aligned (the dq/dk kernel writes them last).
bool gradients_hold_prepared(const BackwardParams& p);
// The scale of the reversed forward's states (dS_{c+1} = it · Diag(e^{g_{64(c+1)}}) · S'):
// chunk_backward.cu's dh0 and the dq/dk/dg kernel use it.
constexpr float kMinStateGradScale = 1e-6f;  // |scale| below it: the reverse walk (dht / scale could overflow)
}  // namespace backward

// Queues the backward on `stream`. workspace must hold plan.workspace_bytes, 256-byte aligned.
cudaError_t launch_backward(const BackwardParams& p, const BackwardPlan& plan, void* workspace,
                            cudaStream_t stream);

}  // namespace gla::cuda
