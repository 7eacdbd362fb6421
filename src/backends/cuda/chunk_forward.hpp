// The CUDA backend's forward kernels: parameter struct and host launchers.
//
// Framework-free: raw device pointers, element strides, sizes and a stream in; a cudaError_t out.
// Two kernel families serve the forward (SPEC.md §1-3):
//   chunk kernel      tensor cores (mma.sync m16n8k16, bf16/fp16), one CTA per (sequence segment,
//                     head, value tile) walking 64-token chunks with the fp32 state on chip. A long
//                     sequence is split into segments: pass 1 computes each segment's local state and
//                     total decay, pass 2 folds the earlier segments into its initial state and runs
//                     the full chunk walk. K padded to 64/128, V tiled by 64/128.
//   recurrent kernel  the token loop in fp32 FMA: any dtype (fp32 inputs use it: IEEE fp32), any K up
//                     to 512. The generic slower path.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime_api.h>

#include "backends/cuda/chunk_layout.hpp"

namespace gla::cuda {

enum ElementType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Strides are in elements. Every tensor's last dimension must be contiguous (checked by verify()).
struct ForwardParams {
  // q, k: [B, T, H, K]; v, o: [B, T, H, V]; g: [B, T, H, K] or [B, T, H] (gate_per_head).
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  void* o;
  int64_t q_stride[3], k_stride[3], v_stride[3], g_stride[3], o_stride[3];  // b, t, h
  // States [N, H, K, V] (or [N, H, V, K] with state_v_first), fp32; null when absent.
  const float* initial_state;
  float* final_state;
  int64_t h0_stride[4], ht_stride[4];
  int32_t state_v_first;
  // Sequences: cu_seqlens (device, [N+1], int32 or int64) when varlen, else sequence n = row n.
  const void* cu_seqlens;
  int32_t cu_seqlens_int64;
  int32_t varlen;
  int64_t B, T, H, K, V, N;
  float scale;
  int32_t dtype;       // ElementType of q, k, v, o
  int32_t gate_dtype;  // ElementType of g
  int32_t gate_per_head;
  // 1: the gate of token t is row t - 1 of g, and each sequence's first token has gate 0 (its row is
  // not read). The backward's reversed forward reads the original gate in place this way: its gate
  // at reversed token u is the gate of original token T - u, one token later than its q and k.
  int32_t gate_lag;
  int32_t vector_loads;  // 1: 16-byte aligned rows, K and V multiples of 8 (cp.async path)
  // 1: every sequence is walked as if (-len mod 64) zero tokens with gate 0 came before its first
  // token, so its chunks end at its last token instead of starting at its first (the states and o
  // are unchanged: the pads add nothing and decay nothing). The backward's reversed forward uses it
  // to put its chunk boundaries where the original chunks' are. Only the warp-specialised kernels
  // (and the key split's intra kernel) honour it; launch_forward refuses it for the others.
  int32_t pad_front;
  // Chunk-start states for the backward (null: none stored): before each chunk's update the chunk
  // kernels store the state block, rounded to bf16, at chunk_states + P * chunk_states_stride[0]
  // + c * chunk_states_stride[1] + h * chunk_states_stride[2] + key * chunk_states_stride[3] + value,
  // c the chunk within its sequence and P its sequence's first chunk: n * ceil(T / 64), or with
  // varlen chunk_first[n] (launch_chunk_first), or bos / 64 where chunk_first is null (the
  // backward's reversed forward, whose sequence starts are multiples of 64). Strides in elements,
  // negative ones allowed: the backward's reversed forward stores its chunks in the original order.
  // The recurrent kernel does not store them (the planner's callers check plan.kernel).
  uint16_t* chunk_states;
  int64_t chunk_states_stride[4];
  const int64_t* chunk_first;  // device [N + 1], with varlen chunk_states: sum of ceil(T_m / 64) over m < n
  // The pass's part in a key split (ForwardPlan::key_split; the warp-specialised kernel picks an
  // instance by it, the single-role kernel reads it at run time). 0: the whole K. 1: the first key
  // half, o = q S without the intra-chunk term. 2: the second half, with the intra-chunk term from
  // `intra` (A over all keys, one rounding); on the warp-specialised kernel its o is added to what
  // o holds as it is stored.
  int32_t key_half;
  // A of every chunk over all keys (launch_intra_matrix): row (b * T + t) * H + h holds A[t, 0..63]
  // of t's chunk (t counted from the sequence's first token), 16-bit, zero above the diagonal.
  const uint16_t* intra;
  // 1: the key split's prepared inputs (ForwardPlan::prepared). q and k point at qg = q 2^{b} and
  // kg = k 2^{b_last - b} (PreparedInputs, written by the intra kernel), the gate is not read, and
  // chunk_decay[(slot * H + h) * chunk_decay_stride + key] holds 2^{b_last} of the chunk in that
  // slot (prepared_chunk_slot), chunk_decay_log2 b_last: the warp-specialised kernel copies them
  // into its slots instead of forming them.
  int32_t prepared;
  // Where a prepared key split writes qg and kg ([B * T, H, K] 16-bit, rows counted like `intra`'s;
  // null: the plan's workspace). The backward points them at dq and dk, which only its last kernel
  // writes, so the reversed forward's prepared inputs cost no memory (plan_backward).
  uint16_t* prepared_qg;
  uint16_t* prepared_kg;
  const float* chunk_decay;
  const float* chunk_decay_log2;
  int64_t chunk_decay_stride;
};

// What the intra kernel writes besides A for a prepared key split (null qg: nothing): qg and kg
// in the layout of q ([B * T, H, K] 16-bit, rows counted like ForwardParams::intra's), the chunks'
// decay 2^{b_last} and b_last ([prepared_chunk_slots, H, K] fp32).
struct PreparedInputs {
  uint16_t* qg;
  uint16_t* kg;
  float* decay;
  float* decay_log2;
};
// Slots of the prepared decays: chunk c of sequence n has slot n * ceil(T / 64) + c, or with varlen
// floor(bos_n / 64) + n + c (distinct for every chunk: a sequence of len tokens starts the next at
// bos_n + len, and floor((bos + len) / 64) + 1 >= floor(bos / 64) + ceil(len / 64)).
constexpr int64_t prepared_chunk_slots(int64_t B, int64_t T, int64_t N) { return B * ((T + 63) / 64) + N + 1; }
// The prepared inputs' part of a plan's workspace (from ForwardPlan::prepared_offset), in bytes: the
// decays 2^{b_last}, then b_last, each prepared_chunk_slots * H * K fp32; from `inputs`, qg then kg
// (B * T * H * K 16-bit each) unless ForwardParams::prepared_qg / prepared_kg place them.
struct PreparedLayout {
  size_t decays;   // fp32 values in each decay array
  size_t inputs;   // offset of qg (256-byte aligned)
  size_t bytes;    // the part's size
};
PreparedLayout prepared_layout(const ForwardParams& p);

// The kernel a plan runs. One name table (kernel_name, plan.cpp) serves the backend's plan note
// and the harness.
enum class ForwardKernel : int32_t {
  kRecurrent,     // the fp32 token loop (forward.cu)
  kChunk,         // single-role chunk kernel, tensor-core diagonal blocks (chunk_forward_kernel.cuh)
  kChunkWs,       // warp-specialised chunk kernel, one prep thread per element-wise item (K <= 128)
  kChunkWsSplit,  // the same with two prep threads per item (K <= 64)
};
struct KernelName {
  const char* id;           // short name, as the harness prints it
  const char* description;  // one phrase, as plan_note prints it
};
const KernelName& kernel_name(ForwardKernel kernel);
constexpr bool is_chunk(ForwardKernel k) { return k != ForwardKernel::kRecurrent; }
constexpr bool is_warp_specialised(ForwardKernel k) {
  return k == ForwardKernel::kChunkWs || k == ForwardKernel::kChunkWsSplit;
}

// How the chunk kernel splits sequences (host-side plan; see plan_forward).
struct ForwardPlan {
  ForwardKernel kernel = ForwardKernel::kRecurrent;
  int32_t head_dim_k = 0;        // 64 or 128 (padded K)
  int32_t value_tile = 0;        // 64 or 128
  int32_t value_tiles = 0;
  int64_t segment_chunks = 0;  // segment length in 64-token chunks
  // Sequences of at most whole_chunks chunks run as one segment (0: every sequence splits by
  // segment_chunks); see detail::sequence_segment_chunks.
  int64_t whole_chunks = 0;
  int64_t max_segments = 0;    // per sequence (grid size)
  size_t workspace_bytes = 0;  // segment states + decays (only when max_segments > 1), + the partial o
  size_t shared_bytes = 0;     // dynamic shared memory per block of the kernel (the device must allow it)
  // 128 < K <= 256 (16-bit inputs): the chunk kernel runs once per key half (keys 0..127, then
  // 128..K-1; the state's key rows split the same way, and A and o are sums over the keys). The
  // tiling above is the plan of one K = 128 half. A first kernel forms A over all keys into the
  // workspace at intra_offset ([B*T, H, 64], 16-bit); the first half's pass stores o = q S of its
  // keys, the second's computes q S of its keys + A v (ForwardParams::key_half). key_split 2 (the
  // warp-specialised kernel): the second pass adds its o into o as it stores it. key_split 1 (the
  // single-role kernel): the second half's o goes to a [B*T, H, V] buffer at partial_offset in the
  // workspace and a third kernel adds it to o.
  int32_t key_split = 0;
  size_t partial_offset = 0;
  size_t intra_offset = 0;
  // key_split 2: the intra kernel also forms qg, kg and the chunk decays (PreparedInputs, at
  // prepared_offset in the workspace) and both halves copy them instead of forming them: the
  // element-wise work runs once per chunk instead of once per (key half, value tile).
  int32_t prepared = 0;
  size_t prepared_offset = 0;
  // Full-pass blocks of the warp-specialised kernels longest first (n * max_segments + m each;
  // 0 = natural order): uneven sequences otherwise leave their longest segments for last.
  int32_t block_order_count = 0;
  int32_t block_order[detail::kMaxBlockOrder] = {};
};

// Whether the K = 128 warp-specialised full pass runs its STATE_SCALES instance, in which the state
// group scales qg and kg (docs/cuda_backend.md, "Who scales qg and kg"): bf16, the whole K in one
// pass, no chunk states stored, one segment per sequence. run_chunk_d128 and the plan note ask this.
inline bool ws_state_group_scales(const ForwardParams& p, const ForwardPlan& plan) {
  return plan.kernel == ForwardKernel::kChunkWs && plan.head_dim_k == 128 && plan.key_split == 0 &&
         p.dtype == kBF16 && p.chunk_states == nullptr && plan.max_segments == 1;
}

// Why a device cannot run a plan whose kernels need `need` bytes of dynamic shared memory per block
// when it allows `available` (cudaDevAttrMaxSharedMemoryPerBlockOptin); nullopt when it can.
std::optional<std::string> shared_memory_shortfall(size_t need, int available, bool backward);

// ForwardPlan::shared_bytes of the problem's plan, without the sequence lengths (the dispatcher
// checks it before device-only cu_seqlens are copied to the host).
size_t forward_shared_bytes(const ForwardParams& p);

// Plans a forward. seq_offsets: host copy of the N + 1 offsets (per-row 0, T, 2T... without varlen).
ForwardPlan plan_forward(const ForwardParams& p, const int64_t* seq_offsets, int sm_count);
// The longest-first block order for the plan's segment length (plan_forward calls it; the
// harness again after overriding the segment length). Leaves the natural order when the kernel
// is not a warp-specialised one, the lengths are all equal, or there are too many blocks.
void order_blocks(ForwardPlan& plan, const int64_t* seq_offsets, int64_t N);

// Queues the forward on `stream`. workspace must hold plan.workspace_bytes (may be null if 0) and be
// 256-byte aligned.
cudaError_t launch_forward(const ForwardParams& p, const ForwardPlan& plan, void* workspace,
                           cudaStream_t stream);

// first[n] = sum over m < n of ceil(T_m / 64), n = 0..N, from p's device cu_seqlens (one small
// kernel): ForwardParams::chunk_first for storing chunk states with varlen.
cudaError_t launch_chunk_first(const ForwardParams& p, int64_t* first, cudaStream_t stream);

// Individual families (used by launch_forward and the standalone harness).
cudaError_t launch_chunk_forward(const ForwardParams& p, const ForwardPlan& plan, void* workspace,
                                 cudaStream_t stream);
cudaError_t launch_recurrent_forward(const ForwardParams& p, int64_t max_len, cudaStream_t stream);

namespace detail {
// A over all keys of every chunk of sequences up to max_chunks chunks long into `intra`
// (ForwardParams::intra's layout, B*T*H*64 16-bit values), and the prepared inputs when
// prepared.qg is not null; chunk_forward_intra.cu.
cudaError_t launch_intra_matrix(const ForwardParams& p, int64_t max_chunks, uint16_t* intra,
                                const PreparedInputs& prepared, cudaStream_t stream);
}  // namespace detail

}  // namespace gla::cuda
