/*
 * libgla — gated linear attention with pluggable backends. The stable C ABI.
 *
 * Everything crosses this boundary as plain C: tensor descriptors (DLPack's shape), status codes,
 * and a thread-local last-error message. No CUDA or framework headers are included here.
 *
 * The operator (see SPEC.md §1), per sequence n and head h, state S in R^{K x V} (fp32):
 *     S_t = Diag(exp(g_t)) S_{t-1} + k_t v_t^T ;   o_t = scale * q_t^T S_t
 * with S_{-1} = initial_state (zeros when absent) and final_state = S_{T_n - 1}.
 *
 * Ownership: libgla never takes ownership of caller memory. Every tensor passed in is owned by the
 * caller and must stay alive until the call returns (for asynchronous devices: until the work queued
 * on the given stream has finished). Outputs are written in place into caller-allocated tensors.
 * An output must not overlap itself (no stride-0 or interleaved dims), another output or an input:
 * such calls are rejected (GLA_STATUS_INVALID_ARGUMENT). Inputs may share memory with each other.
 * Sizes, strides and offsets whose int64 arithmetic would overflow are rejected too.
 */
#ifndef GLA_GLA_H
#define GLA_GLA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define GLA_API __declspec(dllexport)
#else
#define GLA_API __attribute__((visibility("default")))
#endif

/* Version of this header's structs and callback tables. Bumped when a table grows or changes;
 * libgla accepts every version from GLA_ABI_VERSION_MIN (a table of an older version is read up to
 * the fields that version had). */
#define GLA_ABI_VERSION 2
#define GLA_ABI_VERSION_MIN 1
#define GLA_MAX_RANK 6

/* ------------------------------------------------------------------------------------------ */
/* Status codes                                                                                 */
/* ------------------------------------------------------------------------------------------ */
typedef enum gla_status {
  GLA_STATUS_OK = 0,
  GLA_STATUS_INVALID_ARGUMENT = 1, /* bad shape, dtype, layout, value, null pointer, ... */
  GLA_STATUS_NOT_SUPPORTED = 2,    /* valid input that no available backend accepts */
  GLA_STATUS_BACKEND_ERROR = 3,    /* a backend failed while running (driver error, ...) */
  GLA_STATUS_OUT_OF_MEMORY = 4,
  GLA_STATUS_INTERNAL_ERROR = 5
} gla_status;

/* Message of the last failing call on this thread ("" when the last call succeeded). The pointer
 * stays valid until the next libgla call on the same thread. */
GLA_API const char* gla_last_error(void);
GLA_API const char* gla_status_name(gla_status status);
GLA_API const char* gla_version(void);

/* ------------------------------------------------------------------------------------------ */
/* Tensor descriptors                                                                           */
/* ------------------------------------------------------------------------------------------ */
typedef enum gla_dtype {
  GLA_DTYPE_F32 = 0,
  GLA_DTYPE_F16 = 1,
  GLA_DTYPE_BF16 = 2,
  GLA_DTYPE_F64 = 3,
  GLA_DTYPE_I32 = 4,
  GLA_DTYPE_I64 = 5
} gla_dtype;

/* Device types use DLPack's codes so a DLTensor's device converts without a table. */
typedef enum gla_device_type {
  GLA_DEVICE_CPU = 1,
  GLA_DEVICE_CUDA = 2,
  GLA_DEVICE_CUDA_HOST = 3, /* pinned host memory: readable by host backends */
  GLA_DEVICE_OPENCL = 4,
  GLA_DEVICE_VULKAN = 7,
  GLA_DEVICE_METAL = 8,
  GLA_DEVICE_ROCM = 10,
  GLA_DEVICE_EXT = 12, /* anything else (Ascend NPU, ...): served by plugins */
  GLA_DEVICE_ONEAPI = 14
} gla_device_type;

/* A strided view of caller memory. sizes and strides are in elements (not bytes); strides may be
 * any non-negative values (0 broadcasts). Entries past `rank` are ignored. */
typedef struct gla_tensor {
  void* data;
  int32_t dtype;        /* gla_dtype */
  int32_t device_type;  /* gla_device_type */
  int32_t device_index; /* ordinal of the device (0 for host memory) */
  int32_t rank;
  int64_t sizes[GLA_MAX_RANK];
  int64_t strides[GLA_MAX_RANK];
} gla_tensor;

/* ------------------------------------------------------------------------------------------ */
/* Options                                                                                      */
/* ------------------------------------------------------------------------------------------ */
typedef enum gla_policy {
  GLA_POLICY_DEFAULT = 0,  /* the process default: GLA_POLICY from the environment, else priority */
  GLA_POLICY_PRIORITY = 1, /* first available, enabled, accepting backend in priority order */
  GLA_POLICY_FORCED = 2,   /* only the backend named in gla_options.backend */
  GLA_POLICY_FASTEST = 3   /* measured choice per problem signature: the first call of a signature
                              times every accepting backend (or gla_tune does, ahead of time;
                              GLA_TUNE_FILE keeps the winners across processes). At most 1024
                              signatures are kept, in the process and in the file: the least
                              recently used is dropped (and measured again if met again), said
                              once on stderr when it leaves the file. docs/dispatch.md */
} gla_policy;

typedef struct gla_options {
  /* sizeof(gla_options) as the caller was compiled; lets later versions append fields. Set by
   * gla_options_init. Must not end inside a field (it is rejected then), and has_scale = 1 needs
   * scale within it. */
  uint32_t struct_size;
  /* 1: use `scale`; 0: use the default K^-0.5. */
  int32_t has_scale;
  double scale;
  /* 1: initial_state / final_state / dht / dh0 are [N, H, V, K]; 0: [N, H, K, V]. */
  int32_t state_v_first;
  /* Backend name to use for this call ("" or NULL: dispatcher's choice). With policy PRIORITY or
   * DEFAULT a name here acts as FORCED. */
  const char* backend;
  int32_t policy; /* gla_policy */
  /* 1: always run the stage pipeline (each stage dispatched on its own), even when a backend
   * accepts the whole operation. For testing and for mixing backends on purpose. */
  int32_t force_stage_pipeline;
  /* 1: scan the inputs first and reject NaN/Inf values, and NaN or positive gates (g = -inf, a hard
   * reset, is legal), naming the first position.
   * Costs one pass over the data (and a device-to-host copy for device tensors). */
  int32_t check_inputs;
  /* Opaque stream for asynchronous devices (a cudaStream_t for CUDA; NULL = the default stream). */
  void* stream;
  /* Optional caller-supplied scratch memory on the tensors' device. When workspace_bytes is at
   * least what gla_*_workspace_size reports, no allocation happens inside the call. */
  void* workspace;
  size_t workspace_bytes;
} gla_options;

/* Fills defaults: no scale (K^-0.5), [N,H,K,V] states, dispatcher's choice, no checks. */
GLA_API void gla_options_init(gla_options* options);

/* ------------------------------------------------------------------------------------------ */
/* The chunked operator                                                                         */
/* ------------------------------------------------------------------------------------------ */
/* Shapes (SPEC.md §1). B batch, T tokens, H heads, K key width, V value width, N sequences.
 *   q, k        [B, T, H, K]    f32, f16 or bf16 (the same dtype)
 *   g           [B, T, H, K]    per-key forget gate, natural log, expected <= 0; or
 *               [B, T, H]       per-head scalar gate broadcast over K.
 *                               dtype of q, or f32.
 *   v           [B, T, H, V]    q's dtype
 *   initial_state [N, H, K, V] (or [N, H, V, K] with state_v_first), f32; NULL = zeros
 *   cu_seqlens  [N + 1] i32 or i64, non-decreasing, first 0, last T; then B must be 1. NULL: N = B.
 *   cu_seqlens_host  optional host copy of cu_seqlens. When cu_seqlens lives on a device and no
 *               host copy is given, the dispatcher copies it (a host synchronisation).
 * Outputs:
 *   o           [B, T, H, V]    v's dtype
 *   final_state like initial_state, f32; NULL = not computed.
 */
typedef struct gla_chunk_forward_args {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* g;
  const gla_tensor* initial_state;   /* optional */
  const gla_tensor* cu_seqlens;      /* optional */
  const gla_tensor* cu_seqlens_host; /* optional */
  const gla_tensor* o;               /* output */
  const gla_tensor* final_state;     /* optional output */
} gla_chunk_forward_args;

/* Backward: gradients of a scalar loss L given dL/do and dL/dfinal_state.
 *   do_         like o; NULL = zero
 *   dht         like final_state; NULL = zero
 * Outputs (each NULL = not wanted, except that at least one must be given):
 *   dq, dk      like q;  dv like v;  dg like g (f32 or g's dtype);  dh0 like initial_state, f32.
 */
typedef struct gla_chunk_backward_args {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* g;
  const gla_tensor* initial_state;
  const gla_tensor* cu_seqlens;
  const gla_tensor* cu_seqlens_host;
  const gla_tensor* do_;
  const gla_tensor* dht;
  const gla_tensor* dq;
  const gla_tensor* dk;
  const gla_tensor* dv;
  const gla_tensor* dg;
  const gla_tensor* dh0;
} gla_chunk_backward_args;

/* Forward. options may be NULL (defaults). Validates everything before writing anything. */
GLA_API gla_status gla_chunk_forward(const gla_chunk_forward_args* args, const gla_options* options);
GLA_API gla_status gla_chunk_backward(const gla_chunk_backward_args* args, const gla_options* options);

/* Forward and backward with saved chunk-start states: the forward leaves the state at the start of
 * every 64-token chunk (it computes them anyway) and the backward reads them instead of recomputing
 * them (the backward's first pass).
 *   chunk_states  [NC, H, K, V] f32 or bf16, contiguous, on q's device; the layout of the fwd_h stage's `h`
 *                 (gla_problem below) at chunk size 64: NC = sum over sequences n of ceil(T_n / 64),
 *                 sequence n's chunk c (tokens [64c, min(64(c+1), T_n)) of that sequence) at index
 *                 (chunks of sequences 0..n-1) + c; without cu_seqlens sequence n is batch row n.
 *                 Entry [i, h, a, b] is the state S[a, b] (key a, value b) of head h before the
 *                 chunk's first token: key-major whatever options->state_v_first (which applies to
 *                 initial_state / final_state / dht / dh0 only). Empty sequences have no chunks.
 * gla_chunk_forward_saving_states writes o, final_state (when given) and chunk_states;
 * gla_chunk_backward_from_states reads chunk_states, which must be what the forward wrote for the
 * same q, k, v, g, initial_state, cu_seqlens and options (not checked: other states give the
 * gradients of other states). chunk_states NULL: exactly gla_chunk_forward / gla_chunk_backward.
 * Validation as for the other arguments (dtype, device, shape with NC, contiguity), before anything
 * is written. Only backends that declare the dtype (GLA_FEATURE_CHUNK_STATES for f32,
 * GLA_FEATURE_CHUNK_STATES_BF16 for bf16) run these with chunk_states: the built-in `cpu` saves
 * f32 states, the built-in `cuda` bf16 states (16-bit q, k, v, without cu_seqlens, K <= 256: half
 * the bytes, and its backward rounds the states it recomputes to bf16 as well). The others, and
 * the stage pipeline, decline with that reason, so with a forced backend that does not handle them
 * the call fails with GLA_STATUS_NOT_SUPPORTED. The args structs are those above, so callers of the
 * older entry points are unaffected. */
GLA_API gla_status gla_chunk_forward_saving_states(const gla_chunk_forward_args* args, const gla_tensor* chunk_states,
                                                   const gla_options* options);
GLA_API gla_status gla_chunk_backward_from_states(const gla_chunk_backward_args* args,
                                                  const gla_tensor* chunk_states, const gla_options* options);

/* Bytes of scratch the call would need on the tensors' device with these options (0 if none). */
GLA_API gla_status gla_chunk_forward_workspace_size(const gla_chunk_forward_args* args,
                                                    const gla_options* options, size_t* bytes);
GLA_API gla_status gla_chunk_backward_workspace_size(const gla_chunk_backward_args* args,
                                                     const gla_options* options, size_t* bytes);

/* The caller's allocator for the scratch memory of one call: allocate(context, bytes) returns at
 * least `bytes` bytes on the tensors' device (as options->workspace would be), or NULL when it
 * cannot. */
typedef struct gla_allocator {
  void* (*allocate)(void* context, size_t bytes);
  void* context;
} gla_allocator;

/* gla_chunk_forward / gla_chunk_backward, with scratch memory from the caller's allocator: one call
 * instead of gla_*_workspace_size followed by the call, so the problem is validated and planned
 * once. allocator->allocate is called at most once, on the calling thread, after validation and
 * planning, when the call needs scratch that options->workspace does not cover; the memory must
 * stay valid until the call returns (for stream-ordered devices: for the work it enqueues on
 * options->stream), and the caller frees it afterwards. NULL from it fails the call with
 * GLA_STATUS_OUT_OF_MEMORY before anything is written. allocator NULL: exactly gla_chunk_forward /
 * gla_chunk_backward (scratch from the backend's own allocator). */
GLA_API gla_status gla_chunk_forward_with_allocator(const gla_chunk_forward_args* args, const gla_options* options,
                                                    const gla_allocator* allocator);
GLA_API gla_status gla_chunk_backward_with_allocator(const gla_chunk_backward_args* args, const gla_options* options,
                                                     const gla_allocator* allocator);
/* The same for the saved-states entry points (chunk_states NULL: the two above). */
GLA_API gla_status gla_chunk_forward_saving_states_with_allocator(const gla_chunk_forward_args* args,
                                                                  const gla_tensor* chunk_states,
                                                                  const gla_options* options,
                                                                  const gla_allocator* allocator);
GLA_API gla_status gla_chunk_backward_from_states_with_allocator(const gla_chunk_backward_args* args,
                                                                 const gla_tensor* chunk_states,
                                                                 const gla_options* options,
                                                                 const gla_allocator* allocator);

/* ------------------------------------------------------------------------------------------ */
/* The recurrent operator (the token loop; SPEC.md §6)                                          */
/* ------------------------------------------------------------------------------------------ */
/* fla's fused_recurrent_gla. Per sequence n and head h, a = exp(gk_t), b = exp(gv_t):
 *     S_t = Diag(a) S_{t-1} Diag(b) + k_t v_t^T ;   o_t = scale * q_t^T S_t
 * over the tokens in order, or from the last token to the first with `reverse`.
 *   q, k        [B, T, H, K]    f32, f16 or bf16 (the same dtype)
 *   gk          [B, T, H, K]    optional key gate, natural log, expected <= 0; q's dtype or f32
 *   gv          [B, T, H, V]    optional value gate, likewise; NULL = no value gate
 *   v           [B, T, H, V]    q's dtype
 *   initial_state, cu_seqlens, cu_seqlens_host, o, final_state: as for gla_chunk_forward_args
 *               (options->state_v_first and options->scale apply as there).
 *   reverse     0: tokens first to last; 1: last to first (final_state is the state after token 0).
 * Units GLA_UNIT_RECURRENT_FWD / GLA_UNIT_RECURRENT_BWD; in gla_problem `g` carries gk (absent when
 * gk is NULL) and `gv`, `reverse` are set. */
typedef struct gla_recurrent_forward_args {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* gk;              /* optional */
  const gla_tensor* gv;              /* optional */
  const gla_tensor* initial_state;   /* optional */
  const gla_tensor* cu_seqlens;      /* optional */
  const gla_tensor* cu_seqlens_host; /* optional */
  const gla_tensor* o;               /* output */
  const gla_tensor* final_state;     /* optional output */
  int32_t reverse;
} gla_recurrent_forward_args;

/* Backward of the recurrent operator: gradients given do_ and dht (either NULL = zero).
 * Outputs (each NULL = not wanted; at least one): dq, dk like q; dv like v; dgk like gk (only with
 * gk), dgv like gv (only with gv), f32 or the gate's dtype; dh0 like initial_state. */
typedef struct gla_recurrent_backward_args {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* gk;
  const gla_tensor* gv;
  const gla_tensor* initial_state;
  const gla_tensor* cu_seqlens;
  const gla_tensor* cu_seqlens_host;
  const gla_tensor* do_;
  const gla_tensor* dht;
  const gla_tensor* dq;
  const gla_tensor* dk;
  const gla_tensor* dv;
  const gla_tensor* dgk;
  const gla_tensor* dgv;
  const gla_tensor* dh0;
  int32_t reverse;
} gla_recurrent_backward_args;

GLA_API gla_status gla_recurrent_forward(const gla_recurrent_forward_args* args, const gla_options* options);
GLA_API gla_status gla_recurrent_backward(const gla_recurrent_backward_args* args, const gla_options* options);

/* The serving step: B sequences, T new tokens each (T >= 1, usually 1 or a few), their states in a
 * pool addressed by slot, updated in place.
 *   q, k, gk, v, gv   as for gla_recurrent_forward_args ([B, T, H, *]); no cu_seqlens, no reverse
 *   state_pool    [P, H, K, V] (or [P, H, V, K] with options->state_v_first) f32, on q's device.
 *                 Sequence b reads state_pool[state_slots[b]] and, without token_states, writes
 *                 the state after its last token back there.
 *   state_slots   [B] int32 on q's device (device memory on CUDA: read by the kernel, never by the
 *                 host unless check_slots).
 *   slot_error    [1] int32 on q's device, required. A sequence whose slot is negative or >= P is
 *                 skipped and bit 1 is ORed into slot_error[0]; a sequence whose slot an earlier
 *                 sequence (lower b) of the same call already uses is skipped and bit 2 is ORed in.
 *                 A skipped sequence's o (and token_states) are written as zeros and nothing of
 *                 the pool is touched for it. slot_error is never cleared by libgla.
 *   o             [B, T, H, V] output, v's dtype
 *   token_states  optional [B, T, H, K, V] (or [B, T, H, V, K]) f32 output: the state after each
 *                 token (speculative decoding). When given, the pool is read, not written.
 *   check_slots   1: copy state_slots to the host first (a synchronisation) and fail with
 *                 GLA_STATUS_INVALID_ARGUMENT naming the first bad or repeated slot, before anything
 *                 is written. 0: no host synchronisation anywhere in the call (CUDA-graph capturable).
 * The problem is GLA_UNIT_RECURRENT_FWD with initial_state = the pool, final_state = the pool (or
 * absent with token_states) and state_slots / slot_error / token_states set in gla_problem. */
typedef struct gla_recurrent_state_update_args {
  const gla_tensor* q;
  const gla_tensor* k;
  const gla_tensor* v;
  const gla_tensor* gk; /* optional */
  const gla_tensor* gv; /* optional */
  const gla_tensor* state_pool;
  const gla_tensor* state_slots;
  const gla_tensor* slot_error;
  const gla_tensor* o;
  const gla_tensor* token_states; /* optional output */
  int32_t check_slots;
} gla_recurrent_state_update_args;

/* Bits ORed into slot_error[0]. */
#define GLA_SLOT_ERROR_OUT_OF_RANGE 1
#define GLA_SLOT_ERROR_REPEATED 2

GLA_API gla_status gla_recurrent_state_update(const gla_recurrent_state_update_args* args,
                                              const gla_options* options);

/* The verdict table for a recurrent call (exactly one of the three non-NULL), as gla_explain. */
GLA_API gla_status gla_recurrent_explain(const gla_recurrent_forward_args* fwd, const gla_recurrent_backward_args* bwd,
                                         const gla_recurrent_state_update_args* update, const gla_options* options,
                                         const char** text);

/* ------------------------------------------------------------------------------------------ */
/* Registry: listing, explaining, enabling                                                      */
/* ------------------------------------------------------------------------------------------ */
/* Dispatchable units: whole operations and the stages of SPEC.md §2. */
typedef enum gla_unit {
  GLA_UNIT_CHUNK_FWD = 0,
  GLA_UNIT_CHUNK_BWD = 1,
  GLA_UNIT_CUMSUM = 2,        /* F1: chunk-local cumulative gate in log2 units */
  GLA_UNIT_FWD_H = 3,         /* F2: chunk-start states and the final state */
  GLA_UNIT_FWD_INTRA = 4,     /* F3: intra-chunk attention matrix A */
  GLA_UNIT_FWD_O = 5,         /* F4: output */
  GLA_UNIT_BWD_DH = 6,        /* B1: reverse state-gradient scan, dh0 */
  GLA_UNIT_BWD_DV = 7,        /* B2 */
  GLA_UNIT_BWD_DA = 8,        /* B3 */
  GLA_UNIT_BWD_DQK_INTRA = 9, /* B4 */
  GLA_UNIT_BWD_DQKG = 10,     /* B5: inter-chunk dq, dk and dg */
  GLA_UNIT_RECURRENT_FWD = 11,
  GLA_UNIT_RECURRENT_BWD = 12,
  GLA_UNIT_COUNT = 13
} gla_unit;

GLA_API const char* gla_unit_name(int32_t unit);

/* Number of registered backends, and the name / priority / availability of the i-th (in
 * priority order). reason receives why an unavailable backend is unavailable. */
GLA_API int32_t gla_backend_count(void);
GLA_API gla_status gla_backend_info(int32_t index, const char** name, int32_t* priority,
                                    int32_t* available, const char** reason);

/* Switch a backend off or on for this process (like GLA_DISABLE). */
GLA_API gla_status gla_backend_set_enabled(const char* name, int32_t enabled);

/* libgla reads its environment variables (GLA_BACKEND, GLA_POLICY, GLA_LOG, GLA_DISABLE,
 * GLA_TUNE_FILE, GLA_NUM_THREADS, GLA_CPU_ISA, GLA_CPU_POISON_SCRATCH) once, at the first call that
 * needs one. After changing them in a running process, call this: calls that start afterwards see
 * the new values. (GLA_PLUGINS is read once when the registry is built; gla_load_plugin loads more.) */
GLA_API gla_status gla_reload_environment(void);

/* Writes into *text a human-readable verdict table for these arguments: every backend, unit by
 * unit (available, enabled, verdict and reason) and which backend would run each unit. The text
 * is owned by libgla and valid until the next call on this thread. Exactly one of fwd / bwd is
 * non-NULL. Output tensors may be absent: only metadata is read, never data. */
GLA_API gla_status gla_explain(const gla_chunk_forward_args* fwd, const gla_chunk_backward_args* bwd,
                               const gla_options* options, const char** text);

/* The `fastest` policy's measurement, ahead of time. Times every available, enabled backend that
 * accepts this problem (whole operation, and the stage pipeline where a stage-only backend takes
 * part) on these inputs, writing to scratch outputs (the given outputs are never written; their
 * metadata chooses the signature), replaces the cached winner for the problem's signature (unit,
 * device, dtypes, shape bucket, flags) and, when GLA_TUNE_FILE is set, writes the file. *text gets
 * the explain() text with the measured times (owned by libgla, valid until the next call on this
 * thread). Exactly one of fwd / bwd is non-NULL; options->backend must be unset. */
GLA_API gla_status gla_tune(const gla_chunk_forward_args* fwd, const gla_chunk_backward_args* bwd,
                            const gla_options* options, const char** text);

/* ------------------------------------------------------------------------------------------ */
/* Backends from outside: plugins and language bindings                                         */
/* ------------------------------------------------------------------------------------------ */
/* What a backend sees for one unit: validated, shape-inferred metadata plus every tensor.
 * Absent tensors have data == NULL and rank == 0. */
typedef struct gla_problem {
  int32_t unit;      /* gla_unit being verified or run */
  int32_t backward;  /* 1 for the backward operation and its stages */
  int64_t B, T, H, K, V, N;
  int32_t gate_per_head; /* 1: g is [B, T, H] */
  int32_t dtype;         /* of q, k, v, o */
  int32_t gate_dtype;
  int32_t device_type;
  int32_t device_index;
  double scale;
  int32_t state_v_first;
  /* Host copy of the N + 1 sequence offsets (always present, also without cu_seqlens, where it is
   * 0, T, 2T, ... in each batch row's own coordinates; see `varlen`). */
  const int64_t* seq_offsets;
  int32_t varlen;       /* 1 when cu_seqlens was given: sequence n is tokens [seq_offsets[n],
                           seq_offsets[n+1]) of batch row 0; 0: sequence n is batch row n */
  gla_tensor q, k, v, g, initial_state, cu_seqlens;
  gla_tensor o, final_state;                       /* forward outputs */
  gla_tensor do_, dht, dq, dk, dv, dg, dh0;        /* backward */
  /* Stage-pipeline intermediates (for stage units; fp32, contiguous, on the tensors' device).
   * For the whole operations (chunk_fwd, chunk_bwd) `h` is instead the caller's chunk_states of
   * gla_chunk_forward_saving_states / gla_chunk_backward_from_states (same layout, C = 64), absent
   * otherwise; a backend that does not declare it handles them (callback backends never do) is
   * never given a whole operation with `h` present.
   * C = chunk_size; NC = total chunks over all sequences; chunk_offsets (host, N + 1)
   * gives the first global chunk of each sequence.
   *   gcum     [B, T, H, Kg] (Kg = K, or 1 for a per-head gate) chunk-local inclusive cumsum of g
   *            divided by ln 2
   *   h        [NC, H, K, V] state at the start of each chunk
   *   A        [B, T, H, C]  A[t, s - chunk start], scale included, zero above the diagonal
   *   dh       [NC, H, K, V] dL/d(state at the end of each chunk)
   *   dA       [B, T, H, C]  scale * do_t . v_s for s <= t, zero above
   *   dq_intra, dk_intra [B, T, H, K] */
  int64_t chunk_size;
  int64_t num_chunks;
  const int64_t* chunk_offsets;
  gla_tensor gcum, h, A, dh, dA, dq_intra, dk_intra;
  void* stream;
  void* workspace; /* scratch for a whole-operation run, workspace_bytes long */
  size_t workspace_bytes;
  /* Recurrent units only (absent / 0 otherwise; appended so older plugins read a valid prefix).
   * `g` holds gk there and may be absent; dg is dgk.
   *   gv, dgv       [B, T, H, V] value gate and its gradient (optional)
   *   reverse       1: tokens last to first
   *   state_slots   [N] int32: sequence n's state is initial_state[state_slots[n]] (the pool) and
   *                 goes back to final_state[state_slots[n]] (the same pool); absent: index n
   *   slot_error    [1] int32 (with state_slots): bits GLA_SLOT_ERROR_* ORed in for skipped sequences
   *   token_states  [B, T, H, K, V] (or V, K): the state after each token (with state_slots) */
  gla_tensor gv, dgv;
  int32_t reverse;
  gla_tensor state_slots, slot_error, token_states;
} gla_problem;

/* What a backend serves, declared as data: one record per set of units with the same conditions (a
 * backend may have several, e.g. a forward and a backward with different dtypes). The default verifier
 * accepts a problem when one record covering its unit and device accepts all of it, and otherwise
 * returns every reason the records decline it; a backend adds imperative checks (its verify callback)
 * only for what these fields cannot say. explain() prints the records. */
#define GLA_FEATURE_VARLEN (1u << 0)         /* cu_seqlens */
#define GLA_FEATURE_INITIAL_STATE (1u << 1)  /* initial_state (and dh0) */
#define GLA_FEATURE_FINAL_STATE (1u << 2)    /* final_state (and dht) */
#define GLA_FEATURE_STATE_V_FIRST (1u << 3)  /* states [N, H, V, K] */
#define GLA_FEATURE_PER_KEY_GATE (1u << 4)   /* g [B, T, H, K] (the recurrent gk) */
#define GLA_FEATURE_PER_HEAD_GATE (1u << 5)  /* g [B, T, H] */
#define GLA_FEATURE_CHUNK_STATES (1u << 6)   /* the whole operations' saved chunk states (problem.h), f32 */
#define GLA_FEATURE_VALUE_GATE (1u << 7)     /* recurrent gv */
#define GLA_FEATURE_REVERSE (1u << 8)        /* recurrent, last token first */
#define GLA_FEATURE_STATE_POOL (1u << 9)     /* recurrent state update (state_slots) */
#define GLA_FEATURE_TOKEN_STATES (1u << 10)  /* recurrent state update's token_states */
#define GLA_FEATURE_CHUNK_STATES_BF16 (1u << 11) /* the same saved chunk states in bf16 */
#define GLA_FEATURE_ALL 0xfffu
/* Layout needs (gla_capability.layout). */
#define GLA_LAYOUT_LAST_DIM_CONTIGUOUS (1u << 0) /* stride 1 in the last dimension of q, k, v, o, the
                                                    per-key gate and their gradients */
#define GLA_LAYOUT_CONTIGUOUS (1u << 1)          /* every tensor row-major contiguous */

typedef struct gla_capability {
  uint64_t unit_mask;   /* bit (1 << gla_unit) per unit this record covers */
  uint64_t device_mask; /* bit (1 << gla_device_type) per device type */
  int32_t min_compute_capability; /* CUDA: 10 * major + minor (80 = sm_80); 0 = none */
  uint32_t dtype_mask;      /* bit (1 << gla_dtype) per dtype of q, k, v (o, do and their gradients) */
  uint32_t gate_dtype_mask; /* bit (1 << gla_dtype) per dtype of the gates (and dg) */
  int64_t k_min, k_max;     /* key width K within [k_min, k_max]; k_max 0 = no upper limit */
  int64_t v_min, v_max;     /* value width V, likewise */
  uint32_t features;        /* GLA_FEATURE_* the record serves; a problem using another is declined */
  uint32_t layout;          /* GLA_LAYOUT_* needs */
  uint32_t alignment;       /* bytes every tensor's data pointer must be a multiple of; 0 = none */
  int32_t deterministic;    /* 1: the same inputs give bitwise the same outputs on every run */
} gla_capability;

/* The declaration of a registered backend: *records points at *count records owned by libgla,
 * valid until the backend is unregistered or replaced. */
GLA_API gla_status gla_backend_capabilities(const char* name, const gla_capability** records, int32_t* count);

/* A backend described by callbacks. Every callback gets `user_data` back. Strings written into
 * `message` (capacity `message_capacity`) explain a decline or an error. */
typedef struct gla_backend_desc {
  uint32_t abi_version; /* GLA_ABI_VERSION */
  const char* name;     /* copied at registration */
  int32_t priority;     /* lower runs first */
  /* bit (1 << gla_device_type) per device type served */
  uint64_t device_mask;
  /* bit (1 << gla_unit) per unit implemented */
  uint64_t unit_mask;
  void* user_data;
  /* 1 if usable on this machine; else 0 and a reason. NULL: always available. */
  int32_t (*available)(void* user_data, char* message, size_t message_capacity);
  /* 1 to accept the problem; 0 and a reason to decline. Reads metadata only. */
  int32_t (*verify)(void* user_data, const gla_problem* problem, char* message,
                    size_t message_capacity);
  /* Runs the unit. Returns a gla_status; on failure writes a message. */
  int32_t (*run)(void* user_data, const gla_problem* problem, char* message,
                 size_t message_capacity);
  /* Optional: scratch bytes `run` wants for a whole-operation unit (0 if NULL). */
  size_t (*workspace_size)(void* user_data, const gla_problem* problem);
  /* ---- abi_version >= 2 ---- */
  /* Optional memory on the problem's device (for devices the host cannot read: workspaces, the
   * stage pipeline's intermediates, the `fastest` policy's scratch outputs). NULL: host memory
   * (aligned_alloc) for host-readable devices, none otherwise. allocate returns NULL on failure. */
  void* (*allocate)(void* user_data, const gla_problem* problem, size_t bytes);
  void (*deallocate)(void* user_data, const gla_problem* problem, void* pointer);
  /* Optional: copies device memory to the host, waiting for it (cu_seqlens without a host copy,
   * check_inputs). Returns a gla_status. NULL: memcpy for host-readable devices. */
  int32_t (*copy_to_host)(void* user_data, const gla_problem* problem, const void* src, void* dst, size_t bytes);
  /* Optional: waits until the work queued on problem->stream has finished. With it the `fastest`
   * policy times this backend's device with the host clock around run + synchronize. */
  int32_t (*synchronize)(void* user_data, const gla_problem* problem);
  /* Optional: times one run with the device's own clock (events): calls run(context) between two
   * device timestamps, waits for the second and stores the milliseconds in *ms. Returns a
   * gla_status. Preferred over synchronize; the first backend serving a device with either times
   * every candidate there. */
  int32_t (*time_run)(void* user_data, const gla_problem* problem, void (*run)(void* context), void* context,
                      double* ms);
  /* Optional: 1 while problem->stream is being captured into a graph (no measuring then). */
  int32_t (*stream_capturing)(void* user_data, const gla_problem* problem);
  /* The declaration (copied at registration). capability_count 0: one record made of device_mask and
   * unit_mask that allows every dtype, size, feature but chunk states, and any layout (what a
   * version-1 table gets). With records, device_mask and unit_mask must be their union. */
  const gla_capability* capabilities;
  int32_t capability_count;
} gla_backend_desc;

/* Adds a backend to the registry (or replaces one of the same name). */
GLA_API gla_status gla_register_backend(const gla_backend_desc* desc);
/* Removes a backend registered through gla_register_backend. */
GLA_API gla_status gla_unregister_backend(const char* name);

/* Plugins: a shared library that exports two functions,
 *     uint32_t gla_plugin_abi_version(void);   the GLA_ABI_VERSION it was built against
 *     gla_status gla_plugin_register(void);    calls gla_register_backend for each backend it brings
 * (GLA_PLUGIN_DEFINE_ABI_VERSION() defines the first). gla_load_plugin loads one and refuses it with
 * a message naming the reason when a symbol is missing, when its version is outside
 * GLA_ABI_VERSION_MIN..GLA_ABI_VERSION, or when its registration fails (then the backends it
 * registered before failing are removed again); the library stays loaded for the life of the
 * process (the registry keeps its callbacks) and the process carries on. The environment variable
 * GLA_PLUGINS=path:path:... loads plugins when the registry is first used; a plugin that fails to
 * load there is reported on stderr and skipped. docs/writing-a-backend.md is the guide. */
#define GLA_PLUGIN_ENTRY_POINT "gla_plugin_register"
#define GLA_PLUGIN_ABI_ENTRY_POINT "gla_plugin_abi_version"
#if defined(_WIN32)
#define GLA_PLUGIN_EXPORT __declspec(dllexport)
#else
#define GLA_PLUGIN_EXPORT __attribute__((visibility("default")))
#endif
#define GLA_PLUGIN_DEFINE_ABI_VERSION() \
  GLA_PLUGIN_EXPORT uint32_t gla_plugin_abi_version(void) { return GLA_ABI_VERSION; }
GLA_API gla_status gla_load_plugin(const char* path);

#ifdef __cplusplus
}
#endif
#endif /* GLA_GLA_H */
