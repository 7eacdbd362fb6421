// Tile operations of the chunk forward that both chunk kernels (chunk_forward_kernel.cuh, the
// single-role kernel; chunk_forward_ws_kernel.cuh, the warp-specialised one) run: the pivot-level
// copies, the state's fragments in and out, A's off-diagonal blocks and level products, the o tile
// and the state update. mma.sync m16n8k16 and ldmatrix on bf16/fp16 tiles in shared memory with
// fp32 accumulation (sm_80+); every operation is one warp's.
//
// Fragments: S^T [BV x DK] lives in registers as C fragments of n8 tiles (S[j][0..3] of tile j),
// warp w owning value rows 16w..16w+15; tiles in shared memory are padded rows of pitch pq / pa.
#pragma once

#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/chunk_layout.hpp"
#include "backends/cuda/device_utils.cuh"

namespace gla::cuda::detail {

// Level copies of N rows (a 16-row sub-chunk, or 8 rows of a split item), `base` = the first row
// at this thread's column pair: blocks of 2H rows starting at multiples of 2H; key members
// k_r prod_{u=r+1..piv} e_u, query members q_r prod_{u=piv+1..r} e_u.
template <int H, int N, typename X>
__device__ __forceinline__ void write_level_block(uint16_t* base, int pq, const uint32_t (&qv)[N],
                                                  const uint32_t (&kv)[N], const float (&e0)[N], const float (&e1)[N]) {
#pragma unroll
  for (int b0 = 0; b0 < N; b0 += 2 * H) {
    const int piv = b0 + H - 1;
    float f0 = 1.f, f1 = 1.f;
#pragma unroll
    for (int r = piv; r >= b0; --r) {
      const float2 k = X::to_float2(kv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(k.x * f0, k.y * f1);
      f0 *= e0[r];
      f1 *= e1[r];
    }
    f0 = f1 = 1.f;
#pragma unroll
    for (int r = piv + 1; r < b0 + 2 * H; ++r) {
      f0 *= e0[r];
      f1 *= e1[r];
      const float2 q = X::to_float2(qv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(q.x * f0, q.y * f1);
    }
  }
}

// Calls f(j, e, vv, kk) for each entry S[j][e] of this warp's S^T fragments (C fragments of n8
// tiles j): value row vv of the tile (vrow..vrow+15) and key kk.
template <int DK, typename F>
__device__ __forceinline__ void for_each_state_entry(int vrow, int lane, F&& f) {
  const int fr = lane >> 2, fc = fc_of(lane);
#pragma unroll
  for (int j = 0; j < DK / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) f(j, e, vrow + fr + (e >> 1) * 8, j * 8 + fc + (e & 1));
  }
}

// Initial S^T fragments of this warp's value rows vrow..vrow+15 (C fragment of n8 tile j: S[j][e]):
// the caller's initial state (full pass only) with the local states of the earlier segments folded
// in (S = 2^{d_s} S + S_loc_s, written by pass 1).
// The gate of row t at key columns k0, k0 + 1 of a chunk's gate tile in shared memory, in log2
// units: one value per row (per-head gate), fp32 pairs or 16-bit pairs at row pitch `pitch`.
// F32_KEYS false: the caller's kernel never holds an fp32 per-key gate (no branch for it).
template <typename X, bool F32_KEYS = true>
__device__ __forceinline__ void gate_pair_log2(const unsigned char* gs, int t, int k0, int pitch, bool per_head,
                                               int gate_bytes, float& g0, float& g1) {
  if (per_head) {
    g0 = g1 = gate_bytes == 4 ? reinterpret_cast<const float*>(gs)[t]
                              : X::to_float(reinterpret_cast<const uint16_t*>(gs)[t]);
  } else if (F32_KEYS && gate_bytes == 4) {
    const float2 gv = *reinterpret_cast<const float2*>(gs + (t * pitch + k0) * 4);
    g0 = gv.x;
    g1 = gv.y;
  } else {
    const float2 gv = X::to_float2(*reinterpret_cast<const uint32_t*>(gs + (t * pitch + k0) * 2));
    g0 = gv.x;
    g1 = gv.y;
  }
  g0 *= kLog2e;
  g1 *= kLog2e;
}

// One column pair's 16 gate rows of sub-chunk `sub`: the factors e_r = 2^{g_r} and the sub-chunk's
// totals a = sum_r g_r (log2 units); per_row(r, t) runs in the same loop (the callers' raw q, k reads).
template <typename X, bool F32_KEYS = true, typename PerRow>
__device__ __forceinline__ void sub_chunk_gates(const unsigned char* gs, int sub, int k0, int pitch, bool per_head,
                                                int gate_bytes, float (&e0)[16], float (&e1)[16], float& a0,
                                                float& a1, PerRow per_row) {
  a0 = a1 = 0.f;
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const int t = sub * 16 + r;
    float g0, g1;
    gate_pair_log2<X, F32_KEYS>(gs, t, k0, pitch, per_head, gate_bytes, g0, g1);
    a0 += g0;
    a1 += g1;
    e0[r] = fast_exp2(g0);
    e1[r] = fast_exp2(g1);
    per_row(r, t);
  }
}

// The sums of the other sub-chunks' totals around sub-chunk `sub` at key columns k0, k0 + 1:
// pre over the earlier ones (the query factor 2^{Pre}), post over the later ones (the key's 2^{Post}).
// total_pair(l) gives sub-chunk l's totals at k0, k0 + 1 wherever they are kept.
template <typename TotalPair>
__device__ __forceinline__ void sub_chunk_pre_post_of(TotalPair&& total_pair, int sub, float& pre0, float& pre1,
                                                      float& post0, float& post1) {
  pre0 = pre1 = post0 = post1 = 0.f;
#pragma unroll
  for (int l = 0; l < 4; ++l) {
    const float2 t = total_pair(l);
    if (l < sub) { pre0 += t.x; pre1 += t.y; }
    if (l > sub) { post0 += t.x; post1 += t.y; }
  }
}
// The same from the totals array tot[sub-chunk * DK + column].
template <int DK>
__device__ __forceinline__ void sub_chunk_pre_post(const float* tot, int sub, int k0, float& pre0, float& pre1,
                                                   float& post0, float& post1) {
  sub_chunk_pre_post_of([&](int l) { return make_float2(tot[l * DK + k0], tot[l * DK + k0 + 1]); }, sub, pre0, pre1,
                        post0, post1);
}

template <int DK, int BV>
__device__ __forceinline__ void load_initial_state(float (&S)[DK / 8][4], const ForwardParams& p, const SegmentArgs& sa,
                                                   bool full, int64_t n, int64_t m, int64_t h, int64_t v0, int vrow,
                                                   int lane) {
  const bool have_h0 = full && p.initial_state != nullptr;
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    float x = 0.f;
    if (have_h0 && kk < p.K && v0 + vv < p.V) {
      x = p.initial_state[state_index(p.h0_stride, p.state_v_first, n, h, kk, v0 + vv)];
    }
    S[j][e] = x;
  });
  if (!full) return;
  // Segments outer, entries inner: the other nesting put a run-time loop inside each of the
  // DK/2 unrolled entries, ~20 k SASS instructions that every CTA's state group walked through at
  // its start (12% of the B32 T1024 kernel's samples were instruction-fetch stalls there). Each
  // entry sees the same operations in the same order either way.
#pragma unroll 1
  for (int64_t s = 0; s < m; ++s) {
    const int64_t si = (n * sa.max_segments + s) * p.H + h;
    const float* dec = sa.seg_decay + si * DK;
    const float* loc = sa.seg_states + (si * (int64_t(sa.value_tiles) * BV) + v0) * DK;
    for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
      S[j][e] = fast_exp2(dec[kk]) * S[j][e] + loc[int64_t(vv) * DK + kk];
    });
  }
}

// The caller's final state from this warp's S^T fragments (entries beyond K or V skipped).
template <int DK>
__device__ __forceinline__ void store_final_state(const float (&S)[DK / 8][4], const ForwardParams& p, int64_t n,
                                                  int64_t h, int64_t v0, int vrow, int lane) {
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    if (kk < p.K && v0 + vv < p.V) {
      p.final_state[state_index(p.ht_stride, p.state_v_first, n, h, kk, v0 + vv)] = S[j][e];
    }
  });
}

// Sequence n as the chunk kernels walk it: with ForwardParams::pad_front, (-len mod 64) zero tokens
// first (SeqSpan::lead), bos and len counting them.
__device__ __forceinline__ SeqSpan forward_sequence(const ForwardParams& p, int64_t n) {
  SeqSpan s = sequence_span(p, n);
  if (p.pad_front) {
    s.lead = static_cast<int>((-s.len) & (kChunk - 1));
    s.bos -= s.lead;
    s.len += s.lead;
  }
  return s;
}

// The prepared decays' slot of chunk c of sequence n (prepared_chunk_slots says why it is distinct).
__device__ __forceinline__ int64_t prepared_chunk_slot(const ForwardParams& p, const SeqSpan& seq, int64_t n, int64_t c) {
  if (!p.varlen) return seq.batch * ((p.T + kChunk - 1) / kChunk) + c;
  return (seq.bos + seq.lead) / kChunk + n + c;
}

// The first chunk-state slot of sequence n (starting at token bos): ForwardParams::chunk_states.
__device__ __forceinline__ int64_t chunk_state_first(const ForwardParams& p, int64_t n, int64_t bos) {
  if (!p.varlen) return n * ((p.T + kChunk - 1) / kChunk);
  return p.chunk_first != nullptr ? __ldg(p.chunk_first + n) : bos / kChunk;
}

// The state block at the start of chunk c of sequence n (starting at token bos) into
// ForwardParams::chunk_states (bf16, only entries inside K and V).
template <int DK>
__device__ __forceinline__ void store_chunk_state(const float (&S)[DK / 8][4], const ForwardParams& p, int64_t n,
                                                  int64_t bos, int64_t c, int64_t h, int64_t v0, int vrow, int lane) {
  const int64_t* st = p.chunk_states_stride;
  const int64_t first = chunk_state_first(p, n, bos);
  uint16_t* dst = p.chunk_states + first * st[0] + c * st[1] + h * st[2] + v0;
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    if (kk < p.K && v0 + vv < p.V) dst[kk * st[3] + vv] = Elem<__nv_bfloat16>::from_float(S[j][e]);
  });
}

// ForwardParams::chunk_states from this warp's S^T fragments with 32-bit stores, for the kernels
// whose V is a multiple of 8 (16-byte rows): lanes l and l ^ 4 hold value rows fr and fr ^ 1 of the
// same keys, so each swaps one entry of every row pair with the other (paired_entries); the even
// lane then holds key fc at values (fr, fr + 1), the odd lane key fc + 1. Half the stores of
// store_chunk_state's 16-bit ones. H200 harness, forward with the states: B8 T4096 H16 D128 0.463 ->
// 0.446 ms (bf16), 0.456 -> 0.445 (fp16); K = V = 256 B8 T2048 H4 0.494 -> 0.480.
__device__ __forceinline__ uint32_t paired_entries(float mine_lo, float mine_hi, bool odd) {
  const float got = __shfl_xor_sync(0xffffffffu, odd ? mine_lo : mine_hi, 4);
  return Elem<__nv_bfloat16>::pack(odd ? got : mine_lo, odd ? mine_hi : got);
}

// This lane's first paired entry of the chunk-start state block: its key (fc, or fc + 1 on an odd
// lane), its first value row vv (even), and the address of entry (key, vv).
__device__ __forceinline__ uint16_t* paired_state_row(const ForwardParams& p, int64_t n, int64_t bos, int64_t c,
                                                      int64_t h, int64_t v0, int vrow, int lane, bool& odd, int& key,
                                                      int& vv) {
  const int64_t* st = p.chunk_states_stride;
  const int64_t first = chunk_state_first(p, n, bos);
  const int fr = lane >> 2;
  odd = fr & 1;
  key = fc_of(lane) + (odd ? 1 : 0);
  vv = vrow + (fr & ~1);
  return p.chunk_states + first * st[0] + c * st[1] + h * st[2] + v0 + key * st[3] + vv;
}

template <int DK>
__device__ __forceinline__ void store_chunk_state_paired(const float (&S)[DK / 8][4], const ForwardParams& p,
                                                         int64_t n, int64_t bos, int64_t c, int64_t h, int64_t v0,
                                                         int vrow, int lane) {
  const int64_t* st = p.chunk_states_stride;
  bool odd;
  int key, vv;
  uint16_t* row = paired_state_row(p, n, bos, c, h, v0, vrow, lane, odd, key, vv);
#pragma unroll
  for (int j = 0; j < DK / 8; ++j) {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const uint32_t pair = paired_entries(S[j][2 * hr], S[j][2 * hr + 1], odd);
      if (j * 8 + key < p.K && v0 + vv + 8 * hr < p.V) {
        *reinterpret_cast<uint32_t*>(row + (j * 8) * st[3] + 8 * hr) = pair;
      }
    }
  }
}

// store_chunk_state_paired tile by tile (tile(S[j], j)), for a caller that spreads the stores over
// its products (state_update's STORE): B4 T8192 H32 D64 forward with the states 0.392 -> 0.367 ms.
struct ChunkStateStore {
  uint16_t* row = nullptr;  // this lane's first entry; null: nothing to store
  int key_stride = 0;
  // bits 0-7: tiles j below this hold keys inside K; bits 8, 9: value rows +0, +8 inside V; bit 10: odd lane
  int flags = 0;
  __device__ __forceinline__ ChunkStateStore() {}
  __device__ __forceinline__ ChunkStateStore(const ForwardParams& p, int64_t n, int64_t bos, int64_t c, int64_t h,
                                             int64_t v0, int vrow, int lane) {
    bool odd;
    int key, vv;
    row = paired_state_row(p, n, bos, c, h, v0, vrow, lane, odd, key, vv);
    key_stride = static_cast<int>(p.chunk_states_stride[3]);
    const int64_t tiles = (p.K - key + 7) / 8;
    flags = static_cast<int>(tiles < 255 ? tiles : 255) | (v0 + vv < p.V ? 256 : 0) | (v0 + vv + 8 < p.V ? 512 : 0) |
            (odd ? 1024 : 0);
  }
  __device__ __forceinline__ void tile(const float (&s)[4], int j) const {
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const uint32_t pair = paired_entries(s[2 * hr], s[2 * hr + 1], flags & 1024);
      if (j < (flags & 255) && (flags & (256 << hr))) {
        *reinterpret_cast<uint32_t*>(row + j * 8 * key_stride + 8 * hr) = pair;
      }
    }
  }
};

// Pass 1's output: this warp's S^T fragments as the segment's local state (seg_index = (sequence,
// segment, head)), every entry of the padded tile (pass 2 reads them all).
template <int DK, int BV>
__device__ __forceinline__ void store_segment_state(const float (&S)[DK / 8][4], const SegmentArgs& sa,
                                                    int64_t seg_index, int64_t v0, int vrow, int lane) {
  for_each_state_entry<DK>(vrow, lane, [&](int j, int e, int vv, int kk) {
    sa.seg_states[(seg_index * (int64_t(sa.value_tiles) * BV) + v0 + vv) * DK + kk] = S[j][e];
  });
}

// A's off-diagonal 16x16 block (i, j), i > j, on tensor cores, pivoted at the last row of
// sub-chunk i-1: A_ij = (qloc_i 2^{sum_{j<l<i} Tot_l}) kloc_j^T, every factor <= 1.
// TABLE: the factors of the far blocks come from ofac (three rows of DK: 2^{Tot_1}, 2^{Tot_2},
// 2^{Tot_1 + Tot_2}, written once per chunk by the warp-specialised kernel's write phase) instead
// of exp2 per k-step here. offdiag_accumulate adds the DK keys of qw/kw (tot's pitch DK) to acc,
// even and odd k-steps apart (four independent mma chains instead of two); offdiag_store sums
// them and writes the block to A.
template <int DK, typename X, bool TABLE = false>
__device__ __forceinline__ void offdiag_accumulate(float (&acc)[2][2][4], const uint16_t* qw, const uint16_t* kw,
                                                   int pq, const float* tot, int i, int j, int lane,
                                                   const float* ofac = nullptr) {
  auto qo = [&](int r, int c) { return r * pq + c; };
  const int mi = lane >> 3, fc = fc_of(lane);
  const int arow = i * 16 + (lane & 7) + (mi & 1) * 8, acol = (mi >> 1) * 8;
  const int brow = j * 16 + (lane & 7) + (mi >> 1) * 8, bcol = (mi & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    uint32_t a[4], b[4];
    ldsm_x4(a, qw + qo(arow, kk * 16 + acol));
    ldsm_x4(b, kw + qo(brow, kk * 16 + bcol));
    if (i - j > 1) {
      // Fold 2^{sum_{j<l<i} Tot_l} (<= 1) into the query fragment. i - j is 2 or 3: one or two
      // totals, written out (a run-time loop here unrolled into ~3 k SASS instructions of branchy code).
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int kcol = kk * 16 + half * 8 + fc;
        float f0, f1;
        if constexpr (TABLE) {
          const float2 f = *reinterpret_cast<const float2*>(ofac + (i - j > 2 ? 2 : j) * DK + kcol);
          f0 = f.x;
          f1 = f.y;
        } else {
          f0 = tot[(j + 1) * DK + kcol];
          f1 = tot[(j + 1) * DK + kcol + 1];
          if (i - j > 2) {
            f0 += tot[(j + 2) * DK + kcol];
            f1 += tot[(j + 2) * DK + kcol + 1];
          }
          f0 = fast_exp2(f0);
          f1 = fast_exp2(f1);
        }
        const float2 x0 = X::to_float2(a[half * 2]), x1 = X::to_float2(a[half * 2 + 1]);
        a[half * 2] = X::pack(x0.x * f0, x0.y * f1);
        a[half * 2 + 1] = X::pack(x1.x * f0, x1.y * f1);
      }
    }
    X::mma(acc[kk & 1][0], a, b[0], b[1]);
    X::mma(acc[kk & 1][1], a, b[2], b[3]);
  }
}

template <typename X>
__device__ __forceinline__ void offdiag_store(uint16_t* As, int pa, const float (&acc)[2][2][4], int i, int j, int lane) {
  const int fr = lane >> 2, fc = fc_of(lane);
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int row = i * 16 + fr, col = j * 16 + nt * 8 + fc;
    float r[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) r[e] = acc[0][nt][e] + acc[1][nt][e];
    *reinterpret_cast<uint32_t*>(As + row * pa + col) = X::pack(r[0], r[1]);
    *reinterpret_cast<uint32_t*>(As + (row + 8) * pa + col) = X::pack(r[2], r[3]);
  }
}

template <int DK, typename X, bool TABLE = false>
__device__ __forceinline__ void offdiag_block(uint16_t* As, int pa, const uint16_t* qw, const uint16_t* kw, int pq,
                                              const float* tot, int i, int j, int lane, const float* ofac = nullptr) {
  float acc[2][2][4] = {};
  offdiag_accumulate<DK, X, TABLE>(acc, qw, kw, pq, tot, i, j, lane, ofac);
  offdiag_store<X>(As, pa, acc, i, j, lane);
}

// One pivot level's products inside sub-chunk `sub` (level copy `src`, half size H): one m16n8 tile
// per k-step pair with the 8 key members gathered by per-lane ldmatrix addresses; the entries whose
// pair this level splits go to A, the cross terms (finite) are dropped by the select. H is a
// template parameter: with a run-time H every index below was an integer division.
template <int DK, int H, typename X>
__device__ __forceinline__ void level_block(uint16_t* As, int pa, const uint16_t* src, int pq, int sub, int lane) {
  const int mi = lane >> 3, fr = lane >> 2, fc = fc_of(lane);
  const int jb = lane & 7;
  const int key_row = sub * 16 + (jb / H) * 2 * H + (jb % H);  // gathered key member
  const int arow = sub * 16 + (lane & 7) + (mi & 1) * 8, acol = (mi >> 1) * 8;
  // Two independent mma chains (even and odd k-steps), summed at the end.
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kk = 0; kk < DK / 16; kk += 2) {
    uint32_t a0[4], a1[4], b[4];
    ldsm_x4(a0, src + arow * pq + kk * 16 + acol);
    ldsm_x4(a1, src + arow * pq + (kk + 1) * 16 + acol);
    ldsm_x4(b, src + key_row * pq + kk * 16 + mi * 8);
    X::mma(acc, a0, b[0], b[1]);
    X::mma(acc1, a1, b[2], b[3]);
  }
#pragma unroll
  for (int e = 0; e < 4; ++e) acc[e] += acc1[e];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = fr + (e >> 1) * 8, j = fc + (e & 1);
    const int s = (j / H) * 2 * H + (j % H);
    if (t / (2 * H) == j / H && (t % (2 * H)) >= H) {
      As[(sub * 16 + t) * pa + sub * 16 + s] = X::from_float(acc[e]);
    }
  }
}

// level_block for a run-time level (0..3: H = 8, 4, 2, 1), one compiled body per level.
template <int DK, typename X>
__device__ __forceinline__ void level_block_at(uint16_t* As, int pa, const uint16_t* src, int pq, int sub, int level,
                                               int lane) {
  switch (level) {
    case 0: level_block<DK, 8, X>(As, pa, src, pq, sub, lane); break;
    case 1: level_block<DK, 4, X>(As, pa, src, pq, sub, lane); break;
    case 2: level_block<DK, 2, X>(As, pa, src, pq, sub, lane); break;
    default: level_block<DK, 1, X>(As, pa, src, pq, sub, lane); break;
  }
}

// V^T fragments of this warp's value columns vrow..vrow+15 (M = value rows, K = the 64 tokens).
__device__ __forceinline__ void load_v_fragments(uint32_t (&vf)[4][4], const uint16_t* vs, int pv, int vrow, int lane) {
  const int mi = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    ldsm_x4_trans(vf[kk], vs + (kk * 16 + (lane & 7) + (mi >> 1) * 8) * pv + vrow + (mi & 1) * 8);
  }
}

// o^T (this warp's 16 value rows x 64 tokens) = S^T qg^T + V^T A^T. S^T is the A operand straight
// from the accumulator registers (rounded to 16 bits); A is zero above the diagonal, so its upper
// k-blocks are skipped. INTRA false: S^T qg^T alone (the key split's first half).
template <int DK, typename X, bool INTRA = true>
__device__ __forceinline__ void o_tile(float (&acc)[8][4], const float (&S)[DK / 8][4], const uint32_t (&vf)[4][4],
                                       const uint16_t* qw, int pq, const uint16_t* As, int pa, int lane) {
  const int mi = lane >> 3;
  const int nrow = (lane & 7) + (mi >> 1) * 8, ncol = (mi & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < DK / 16; ++kk) {
    uint32_t a[4];
    a[0] = X::pack(S[2 * kk][0], S[2 * kk][1]);
    a[1] = X::pack(S[2 * kk][2], S[2 * kk][3]);
    a[2] = X::pack(S[2 * kk + 1][0], S[2 * kk + 1][1]);
    a[3] = X::pack(S[2 * kk + 1][2], S[2 * kk + 1][3]);
#pragma unroll
    for (int nt2 = 0; nt2 < 4; ++nt2) {
      uint32_t b[4];
      ldsm_x4(b, qw + (nt2 * 16 + nrow) * pq + kk * 16 + ncol);
      X::mma(acc[2 * nt2], a, b[0], b[1]);
      X::mma(acc[2 * nt2 + 1], a, b[2], b[3]);
    }
  }
#pragma unroll
  for (int kk = 0; kk < 4 && INTRA; ++kk) {
#pragma unroll
    for (int nt2 = 0; nt2 < 4; ++nt2) {
      if (kk > nt2) continue;  // A is zero above the diagonal
      uint32_t b[4];
      ldsm_x4(b, As + (nt2 * 16 + nrow) * pa + kk * 16 + ncol);
      X::mma(acc[2 * nt2], vf[kk], b[0], b[1]);
      X::mma(acc[2 * nt2 + 1], vf[kk], b[2], b[3]);
    }
  }
}

// S^T = S^T diag(2^{b_last}): the chunk's decay, per key column, on the accumulator fragments.
__device__ __forceinline__ void decay_tile(float (&s)[4], const float* dfac, int j, int fc) {
  const float d0 = dfac[j * 8 + fc], d1 = dfac[j * 8 + fc + 1];
  s[0] *= d0;
  s[1] *= d1;
  s[2] *= d0;
  s[3] *= d1;
}

template <int DK>
__device__ __forceinline__ void decay_state(float (&S)[DK / 8][4], const float* dfac, int lane) {
  const int fc = fc_of(lane);
#pragma unroll
  for (int j = 0; j < DK / 8; ++j) decay_tile(S[j], dfac, j, fc);
}

// S^T = S^T diag(2^{b_last}) + V^T kg. STORE: the chunk-start state goes out through `store` (when
// its row is set) tile by tile, each tile just before its decay, between the first k-step's mmas.
template <int DK, typename X, bool STORE = false>
__device__ __forceinline__ void state_update(float (&S)[DK / 8][4], const uint32_t (&vf)[4][4], const uint16_t* kw,
                                             int pq, const float* dfac, int lane,
                                             const ChunkStateStore& store = ChunkStateStore()) {
  const int mi = lane >> 3;
  int kk0 = 0;
  if constexpr (STORE) {
    const int fc = fc_of(lane);
#pragma unroll
    for (int nt2 = 0; nt2 < DK / 16; ++nt2) {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const int j = 2 * nt2 + t;
        if (store.row != nullptr) store.tile(S[j], j);
        decay_tile(S[j], dfac, j, fc);
      }
      uint32_t b[4];
      ldsm_x4_trans(b, kw + ((lane & 7) + (mi & 1) * 8) * pq + nt2 * 16 + (mi >> 1) * 8);
      X::mma(S[2 * nt2], vf[0], b[0], b[1]);
      X::mma(S[2 * nt2 + 1], vf[0], b[2], b[3]);
    }
    kk0 = 1;
  } else {
    decay_state<DK>(S, dfac, lane);
  }
#pragma unroll
  for (int kk = kk0; kk < 4; ++kk) {
#pragma unroll
    for (int nt2 = 0; nt2 < DK / 16; ++nt2) {
      uint32_t b[4];
      ldsm_x4_trans(b, kw + (kk * 16 + (lane & 7) + (mi & 1) * 8) * pq + nt2 * 16 + (mi >> 1) * 8);
      X::mma(S[2 * nt2], vf[kk], b[0], b[1]);
      X::mma(S[2 * nt2 + 1], vf[kk], b[2], b[3]);
    }
  }
}

}  // namespace gla::cuda::detail
