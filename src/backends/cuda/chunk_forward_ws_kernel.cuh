// The warp-specialised chunk kernel: two warp groups in one CTA work on consecutive chunks at
// once, so the element-wise and intra-chunk work of chunk c+1 overlaps the state work of chunk c.
//
// Same mathematics and numerics as the single-role kernel (chunk_forward_kernel.cuh: tensor-core
// diagonal blocks by binary pivot levels); read that file's header first. What changes is who does
// what:
//
//   prep group  (warps 0 .. NP/32-1, one element-wise item (column pair, sub-chunk) per thread, or
//               two threads per item with RS = 8): cp.async of q, k, g into one raw stage; cumsum,
//               e, qloc/kloc, the level copies; A (off-diagonal blocks and levels on tensor cores,
//               diagonal and the h = 1 pairs from shuffle reductions); qg/kg and the chunk decay. It
//               publishes them in one of two slots {qg, kg, A, decay} and moves on to the next chunk
//               (with STATE_SCALES qloc/kloc and the sub-chunk totals: the state group scales them).
//   state group (BV/16 warps; warp w owns value rows 16w..16w+15 of S^T in fp32 registers):
//               cp.async of v (two stages); o^T = S^T qg^T + V^T A^T, S^T update, o through its own
//               columns of the v stage (private to the warp) to global memory.
//
// Hand-off by mbarriers: READY[s] (every prep thread arrives, the state group waits) and FREE[s]
// (every state thread arrives, the prep group waits) for slot s = chunk & 1; each group also has
// its own named barrier for its internal phases. Raw q/k/g are read into registers at the start of
// the prep's element-wise phase, so the next chunk's loads are issued right after and have the rest
// of the chunk to land. The smallest pivot level (pairs 2i+1, 2i) is a reduction, not a level copy:
// that keeps the CTA within 227 KB of shared memory at DK = 128.
//
// Scope: DK = BV (64 or 128), 16-bit q/k/v, 16-bit per-key gate or per-head gate, vector loads;
// both passes of a segment split (pass 1: k, g, v and the state update only); both parts of a key
// split (KEYHALF below), also with prepared inputs (PREP: the prep group only copies what the intra
// kernel formed, and on sm_90a the state group's products run on wgmma). Everything else runs the
// single-role kernel (the planner decides).
#pragma once

#include <type_traits>

#include "backends/cuda/chunk_layout.hpp"
#include "backends/cuda/chunk_tile_ops.cuh"
#include "backends/cuda/device_utils.cuh"
#include "backends/cuda/mbarrier.cuh"
#include "backends/cuda/wgmma.cuh"

namespace gla::cuda::detail {

// WsSmem, ws_smem_layout: chunk_layout.hpp (the planner sizes the kernel's shared memory too).

__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// The READY/FREE hand-off between the two warp groups is on mbarriers: compute-sanitizer's
// racecheck models them, so the hand-off is checked on the shipped kernel (it does not model
// bar.arrive's release; named barriers measured within 1% at B8 T4096 H16 D128 on the H200). One
// arrival per thread: arriving once per warp after __syncwarp is as fast, but racecheck does not
// carry the warp's accesses through lane 0's arrival.
// mbarrier hand-off (mbarrier.cuh): every thread of a group arrives, the other group waits on the
// phase parity. Use k of slot s (chunk c, k = (c - c_begin) / 2) completes phase k.

// The h = 8 level copy of a two-thread split item (8 rows at an 8-aligned row, `base` = its first
// row and column pair): the 8 rows are the block's key members (first half, pivot its last row) or
// its query members (second half, factors from its first row on). Levels h <= 4 lie inside the 8
// rows and use write_level_block.
template <typename X>
__device__ __forceinline__ void write_level_rows_h8(uint16_t* base, int pq, bool key_half, const uint32_t (&qv)[8],
                                                    const uint32_t (&kv)[8], const float (&e0)[8], const float (&e1)[8]) {
  float f0 = 1.f, f1 = 1.f;
  if (key_half) {
#pragma unroll
    for (int r = 7; r >= 0; --r) {
      const float2 k = X::to_float2(kv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(k.x * f0, k.y * f1);
      f0 *= e0[r];
      f1 *= e1[r];
    }
  } else {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
      f0 *= e0[r];
      f1 *= e1[r];
      const float2 q = X::to_float2(qv[r]);
      *reinterpret_cast<uint32_t*>(base + r * pq) = X::pack(q.x * f0, q.y * f1);
    }
  }
}

// Register split of the 512-thread kernel at DK = 128 (launched with 128 per thread; setmaxnreg
// below). Measured on the H200 (B8 T4096 H16 D128 / B32 T1024): 112/144 0.381/0.453 ms, 120/136
// 0.393/0.465, 128/128 0.402/0.471 -- the state group spills below 144.
// Barrier ids (0 is __syncthreads).
constexpr int kBarPrep = 1, kBarState = 2;

// Two packed 16-bit values plus two, in fp32, packed again (the key split's o accumulation).
template <typename X>
__device__ __forceinline__ uint32_t add_pair(uint32_t a, uint32_t b) {
  const float2 x = X::to_float2(a), y = X::to_float2(b);
  return X::pack(x.x + y.x, x.y + y.y);
}

// qg = qloc 2^{Pre}, kg = kloc 2^{Post} in place: rows row0 .. row0 + RS - 1 of sub-chunk `sub` at
// column pair k0 of a slot's qw and kw tiles (qw only in a full pass; sub-chunk 0's qw and 3's kw
// are final already, their Pre / Post being zero).
template <int RS, typename X>
__device__ __forceinline__ void scale_slot_rows(uint16_t* qw, uint16_t* kw, int pq, int sub, int row0, int k0,
                                                bool full, float pre0, float pre1, float post0, float post1) {
  const float fq0 = fast_exp2(pre0), fq1 = fast_exp2(pre1);
  const float fk0 = fast_exp2(post0), fk1 = fast_exp2(post1);
  auto scale_row = [&](uint16_t* tile, int t, float f0, float f1) {
    uint32_t* xp = reinterpret_cast<uint32_t*>(tile + t * pq + k0);
    const float2 x = X::to_float2(*xp);
    *xp = X::pack(x.x * f0, x.y * f1);
  };
#pragma unroll
  for (int r = 0; r < RS; ++r) {
    const int t = sub * 16 + row0 + r;
    if (full && sub > 0) scale_row(qw, t, fq0, fq1);
    if (sub < 3) scale_row(kw, t, fk0, fk1);
  }
}

// A slot's sub-chunk totals for the state group (the state group scales qg / kg): the 16-byte pads
// past column DK of the slot's qw and kw rows, which no product reads, four floats a row. Total
// (sub, k) is entry (sub % 2) DK + k of qw's pads (sub-chunks 0, 1) or kw's (2, 3); the pair at an
// even k lies in one row.
template <int DK>
__device__ __forceinline__ float2* slot_total_pair(unsigned char* smem, const WsSmem& L, int slot, int sub, int k0) {
  static_assert(2 * DK / 4 <= kChunk, "the totals fit the pads of a tile's rows");
  const int j = (sub & 1) * DK + k0;
  unsigned char* tile = smem + (sub < 2 ? L.qw(slot) : L.kw(slot));
  return reinterpret_cast<float2*>(tile + (j >> 2) * L.pq * 2 + DK * 2 + (j & 3) * 4);
}

// o^T (scaled) -> this warp's own columns of the v stage, as o rows (t) of 16 values.
template <typename X>
__device__ __forceinline__ void stage_o_tile(const float (&acc)[8][4], uint16_t* vs, int pv, int vrow, int lane, float sc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // stmatrix .trans: the accumulator pairs (t, t+1) of value row v are an 8x8 b16 fragment of
  // o^T; stored transposed, each 8x8 lands as 8 o rows (t) of 8 consecutive values. Four such
  // matrices per instruction (nt, value half 0/1; nt + 1, half 0/1); lane l gives the address
  // of row l % 8 of matrix l / 8. 4 instructions instead of 32 two-byte stores, bitwise the
  // same values (the same round-to-nearest conversion, packed in pairs).
  const int mi = lane >> 3, j = lane & 7;
#pragma unroll
  for (int np = 0; np < 4; ++np) {
    const int nt = 2 * np + (mi >> 1), half = mi & 1;
    const uint32_t r0 = X::pack(acc[2 * np][0] * sc, acc[2 * np][1] * sc);
    const uint32_t r1 = X::pack(acc[2 * np][2] * sc, acc[2 * np][3] * sc);
    const uint32_t r2 = X::pack(acc[2 * np + 1][0] * sc, acc[2 * np + 1][1] * sc);
    const uint32_t r3 = X::pack(acc[2 * np + 1][2] * sc, acc[2 * np + 1][3] * sc);
    stsm_x4_trans(vs + (nt * 8 + j) * pv + vrow + half * 8, r0, r1, r2, r3);
  }
#else
  const int fr = lane >> 2, fc = fc_of(lane);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int t = nt * 8 + fc;
    const int vv = vrow + fr;
    vs[t * pv + vv] = X::from_float(acc[nt][0] * sc);
    vs[(t + 1) * pv + vv] = X::from_float(acc[nt][1] * sc);
    vs[t * pv + vv + 8] = X::from_float(acc[nt][2] * sc);
    vs[(t + 1) * pv + vv + 8] = X::from_float(acc[nt][3] * sc);
  }
#endif
}

// ForwardParams::chunk_states through this warp's own 64 x 16 columns of a staging tile (`stage`,
// pitch `pitch`, columns vrow .. vrow + 15; the caller's are free): 64 keys at a time, S^T rounded
// to bf16 and transposed by stage_o_tile into key rows of 16 values, then one 16-byte store per
// (key, value half), so each key's 32-byte sector is written whole by one instruction. The paired
// 32-bit stores write half sectors and are a quarter as wide. Bitwise the same entries. Needs
// chunk_states 16-byte aligned (the caller checks) and V a multiple of 8.
template <int DK>
__device__ __forceinline__ void store_chunk_state_staged(const float (&S)[DK / 8][4], const ForwardParams& p, int64_t n,
                                                         int64_t bos, int64_t c, int64_t h, int64_t v0, int vrow,
                                                         int lane, uint16_t* stage, int pitch) {
  static_assert(DK % 64 == 0, "64 keys per pass");
  const int64_t* st = p.chunk_states_stride;
  uint16_t* block = p.chunk_states + chunk_state_first(p, n, bos) * st[0] + c * st[1] + h * st[2] + v0 + vrow;
  const bool values_lo = v0 + vrow < p.V, values_hi = v0 + vrow + 8 < p.V;
#pragma unroll
  for (int pass = 0; pass < DK / 64; ++pass) {
    if (pass > 0) __syncwarp();  // the previous pass's rows are read
    stage_o_tile<Elem<__nv_bfloat16>>(*reinterpret_cast<const float(*)[8][4]>(&S[8 * pass][0]), stage, pitch, vrow,
                                      lane, 1.0f);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = i * 32 + lane, r = piece >> 1, half = piece & 1, key = 64 * pass + r;
      if (key < p.K && (half ? values_hi : values_lo)) {
        *reinterpret_cast<uint4*>(block + key * st[3] + half * 8) =
            *reinterpret_cast<const uint4*>(stage + r * pitch + vrow + half * 8);
      }
    }
  }
  __syncwarp();  // the rows are read before the caller writes the columns again
}

// The state group's products on wgmma (the prepared key split's full pass on sm_90a): o^T = V^T A^T
// (A_TERM) + S^T qg^T, then S^T = S^T diag(2^{b_last}) + V^T kg, for this warp group's 64 value
// rows. The registers are the mma.sync path's (acc: o^T's eight n8 tiles, S: S^T's DK/8), which
// are also wgmma's m64nN accumulator fragments; the A operands are S^T rounded to 16 bits (two
// batches of four k-steps, so that 16 packed registers are live) and the V^T fragments. qg (rows t,
// K = k) and A (rows t, K = s) are K-major B operands, kg (rows s = K, k contiguous) N-major, all
// in the sw128_off layout. o^T is staged into this warp's columns of the v stage before the S^T
// product, so its 32 registers are free there.
template <int DK, typename X, bool A_TERM>
__device__ __forceinline__ void wg_state_products(float (&acc)[8][4], float (&S)[DK / 8][4], uint32_t (&vf)[4][4],
                                                  uint32_t qw_addr, uint32_t a_addr, uint32_t kw_addr,
                                                  const float* dfac, uint16_t* vs, int pv, int vrow, int lane, float sc) {
  static_assert(DK == 128, "wgmma state group: DK = 128");
  float* o = &acc[0][0];
  float* st = &S[0][0];
  // o^T: the A term and the eight k-steps of S^T qg^T in one group (one wait per chunk for o).
  uint32_t P[8][4];
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    P[kk][0] = X::pack(S[2 * kk][0], S[2 * kk][1]);
    P[kk][1] = X::pack(S[2 * kk][2], S[2 * kk][3]);
    P[kk][2] = X::pack(S[2 * kk + 1][0], S[2 * kk + 1][1]);
    P[kk][3] = X::pack(S[2 * kk + 1][2], S[2 * kk + 1][3]);
  }
  wg_pin<32>(o);
  wg_fence();
  if constexpr (A_TERM) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_n64_kmajor<X>(o, vf[kk], wg_desc(a_addr + kk * 32, 16, 1024));
  }
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    wgmma_n64_kmajor<X>(o, P[kk], wg_desc(qw_addr + (kk >> 2) * 8192 + (kk & 3) * 32, 16, 1024));
  }
  wg_commit();
  decay_state<DK>(S, dfac, lane);  // S itself is not an operand of this group (P is)
  wg_wait_all();
  wg_pin<32>(o);
  wg_pin<32>(&P[0][0]);
  wg_pin<16>(&vf[0][0]);
  // o^T into this warp's columns of the v stage (V^T reloaded first: the columns are the warp's
  // own V^T rows); __syncwarp orders the other lanes' ldmatrix reads of them before the writes.
  load_v_fragments(vf, vs, pv, vrow, lane);
  __syncwarp();
  stage_o_tile<X>(acc, vs, pv, vrow, lane, sc);
  // S^T += V^T kg, left in flight: the caller stores o meanwhile and waits (wg_finish_update)
  // before it frees the slot.
  wg_pin<DK / 2>(st);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    wgmma_n128_nmajor<X>(st, vf[kk], wg_desc(kw_addr + kk * 2048, kKgLeadingBytes, kKgStrideBytes));
  }
  wg_commit();
}
// The end of wg_state_products' S^T update.
template <int DK>
__device__ __forceinline__ void wg_finish_update(float (&S)[DK / 8][4], uint32_t (&vf)[4][4]) {
  wg_wait_all();
  wg_pin<DK / 2>(&S[0][0]);
  wg_pin<16>(&vf[0][0]);
}

// The prep group of a prepared key split (ForwardParams::prepared): per chunk, once the slot is free,
// cp.async of qg, kg (rows as issue_loads copies them), the second half's A rows and the chunk decay
// 2^{b_last} into the slot, one commit group per chunk; a thread arrives on the previous chunk's
// READY once that chunk's group has landed (wait_group 1), so the copies of the next chunk are in
// flight meanwhile, and on the last chunk's after its loop. Plain arrivals after the thread's own
// waits: the hand-off is the one racecheck and synccheck model. Pass 1 of a segment split (FULL
// false) sums the segment's log2 decay per key.
// SWZ: into the swizzled slots that the wgmma state group reads (kSwizzledSlotBytes).
template <int DK, int NP, bool FULL, int KEYHALF, bool SWZ>
__device__ __forceinline__ void copy_prepared(const ForwardParams& p, const SegmentArgs& sa, const WsSmem& L,
                                              unsigned char* smem, unsigned char* mbars, const SeqSpan& seq, int64_t n,
                                              int64_t h, int64_t c_begin, int64_t c_end, int64_t seg_index, int vt,
                                              int tid) {
  constexpr int CPR = DK / 8, kRowStep = NP / CPR, kLoadIters = kChunk / kRowStep;
  static_assert(NP % CPR == 0 && kChunk % kRowStep == 0 && kChunk * 8 % NP == 0 && DK / 4 <= NP, "copy tiling");
  const int lc = tid % CPR, lr0 = tid / CPR;
  const bool col_ok = lc * 8 < p.K;
  const int64_t esz = 2;
  const int64_t q_rs = p.q_stride[1] * esz, k_rs = p.k_stride[1] * esz;
  const char* q_seq = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + seq.bos * p.q_stride[1] + h * p.q_stride[2] + lc * 8) * esz;
  const char* k_seq = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + seq.bos * p.k_stride[1] + h * p.k_stride[2] + lc * 8) * esz;
  float dsum = 0.f;  // pass 1: the segment's log2 decay of key tid
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int slot = static_cast<int>(c & 1);
    if (c >= c_begin + 2) mbar_wait(mbars + 16 + 8 * slot, static_cast<uint32_t>(((c - 2 - c_begin) >> 1) & 1));
    const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk)), lo = seq.first_row(c);
    const char* qr = q_seq + (c * kChunk + lr0) * q_rs;
    const char* kr = k_seq + (c * kChunk + lr0) * k_rs;
#pragma unroll
    for (int j = 0; j < kLoadIters; ++j) {
      const int r = lr0 + j * kRowStep;
      const bool ok = col_ok && r < rows && r >= lo;
      if constexpr (SWZ) {
        unsigned char* base = smem + slot * kSwizzledSlotBytes;
        const int so = sw128_off(r, lc * 8) * 2;
        if (FULL) cp_async16(base + so, ok ? qr : p.q, ok);
        cp_async16(base + kSwizzledKg + so, ok ? kr : p.k, ok);
      } else {
        const int so = (r * L.pq + lc * 8) * 2;
        if (FULL) cp_async16(smem + L.qw(slot) + so, ok ? qr : p.q, ok);
        cp_async16(smem + L.kw(slot) + so, ok ? kr : p.k, ok);
      }
      qr += kRowStep * q_rs;
      kr += kRowStep * k_rs;
    }
    if constexpr (FULL && KEYHALF == 2) {
      const uint16_t* src = p.intra + ((seq.batch * p.T + seq.bos + c * kChunk) * p.H + h) * kChunk;
#pragma unroll
      for (int j = 0; j < kChunk * 8 / NP; ++j) {
        const int i = tid + j * NP, r = i >> 3;
        const bool ok = r < rows && r >= lo;
        unsigned char* dst = SWZ ? smem + slot * kSwizzledSlotBytes + kSwizzledA + sw128_off(r, (i & 7) * 8) * 2
                                 : smem + L.a(slot) + (r * L.pa + (i & 7) * 8) * 2;
        cp_async16(dst, ok ? src + int64_t(r) * p.H * kChunk + (i & 7) * 8 : p.intra, ok);
      }
    }
    const int64_t decay_at = (prepared_chunk_slot(p, seq, n, c) * p.H + h) * p.chunk_decay_stride;
    if (tid < DK / 4) {
      const bool ok = tid * 4 < p.K;
      cp_async16(smem + L.dfac(slot) + tid * 16, ok ? p.chunk_decay + decay_at + tid * 4 : p.chunk_decay, ok);
    }
    cp_async_commit();
    if (c > c_begin) {
      cp_async_wait_one();                     // chunk c - 1's copies have landed
      mbar_arrive(mbars + 8 * ((c - 1) & 1));  // releases them to the state group
    }
    // After the arrival: this load's latency would otherwise hold it back (B1 T32768 H4 K256 V512).
    if (!FULL && tid < DK && tid < p.K) dsum += p.chunk_decay_log2[decay_at + tid];
  }
  if (c_begin < c_end) {
    cp_async_wait_all();
    mbar_arrive(mbars + 8 * ((c_end - 1) & 1));
  }
  if (!FULL && vt == 0 && tid < DK) sa.seg_decay[seg_index * DK + tid] = dsum;
}

// RS: rows per element-wise item. 16: one prep thread per (column pair, sub-chunk). 8 (split
// items, DK = 64): two prep threads per item, each with 8 rows, exchanging their row totals through
// shared memory; twice the prep warps for the same work, to cut the prep group's serial latency,
// which bounds the kernel (1.50x faster at B4 T8192 H32 D64).
// LOCAL: 0 the full pass; 1 pass 1 of a segment split, a separate instance so that the full pass's
// code is exactly the one without it (a run-time flag cost the full pass 2-6%).
// KEYHALF (ForwardParams::key_half): 0 the whole K; 1 the key split's first half, o = q S of its
// keys (no A: the slots' A stays zero); 2 the second half, A over all keys read from p.intra in
// place of the A phase, and o added into what o holds as it is stored.
// PREP (ForwardParams::prepared, key split only): the prep group copies the prepared qg, kg, A and
// decay (copy_prepared) instead of forming them.
// STATE_SCALES (DK = 128, the whole K, full pass; the planner's choice, run_chunk_d128): the state
// group turns qloc, kloc into qg, kg once the slot is published, not the prep group after its A
// phase, which takes a barrier and that phase (~270 SASS instructions) off the prep group's path.
// That pays where the state group has time to spare: the forward storing no chunk states over
// whole sequences (H100, B8 T4096 H16 D128 without states: the kernel 439.8 -> 420.0 us under
// ncu); with chunk states the state group bounds the kernel instead (503.0 -> 526.9 us).
template <int DK, typename E, int RS = 16, int LOCAL = 0, int KEYHALF = 0, int PREP = 0, int STATE_SCALES = 0>
__global__ void __launch_bounds__(2 * DK * (16 / RS) + 2 * DK, 1)
chunk_forward_ws_kernel(const __grid_constant__ ForwardParams p, const __grid_constant__ SegmentArgs sa) {
  using X = Elem<E>;
  static_assert(RS == 16 || RS == 8, "rows per item: 16 or 8");
  constexpr int HALVES = 16 / RS;
  constexpr int BV = DK;
  constexpr int NP = 2 * DK * HALVES;  // prep threads
  constexpr int NS = 2 * BV;        // state threads
  constexpr int NT = NP + NS;
  constexpr int NKT = DK / 8;
  constexpr int kWarpsPerItemRow = DK / 64;  // warps per (sub-chunk, half): DK/2 column pairs
  constexpr int DPS = ws_dpart_stride(HALVES);
  constexpr bool kFarTable = ws_far_factor_table(DK, HALVES);
  // The state group's products under a run-time branch that always holds: for the bf16 instances
  // at DK = 128 without a key split, ptxas otherwise spreads their register use over the loop and
  // the full pass spills 120 B (about 20 local loads per chunk, most in the prep group); with the
  // branch 8 B. H200, same call: B8 T4096 H16 D128 0.377 against 0.489 ms, B1 T32768 0.533
  // against 0.630. Elsewhere it measured slower (fp16 D128 0.388 / 0.375, the key split's halves
  // at K = V = 256 2.76 / 2.24, D64 0.360 / 0.348 ms), so those instances keep the plain code.
  constexpr bool kProductsBranch = DK == 128 && KEYHALF == 0 && std::is_same_v<E, __nv_bfloat16>;
  // The chunk states stored tile by tile inside state_update (ChunkStateStore): at DK = 64 the
  // forward with states measured 0.3674 against 0.3900 ms stored at once (B4 T8192 H32 D64); at
  // DK = 128 the full pass then spills 112 B and took 0.515 against 0.460 ms.
  constexpr bool kStoresInUpdate = DK == 64;
  // The prepared key split's full pass on sm_90a: the state group's products on wgmma from swizzled
  // slots (wg_state_products).
  constexpr bool kSwz = PREP != 0 && kArchWgmma && DK == 128 && RS == 16 && LOCAL == 0;
  // STATE_SCALES: the slot carries its chunk's sub-chunk totals (slot_total_pair) for the state group.
  constexpr bool kStateScales = STATE_SCALES != 0;
  static_assert(!kStateScales || (DK == 128 && RS == 16 && LOCAL == 0 && KEYHALF == 0 && PREP == 0),
                "STATE_SCALES: the whole-K full pass at DK = 128");
  extern __shared__ __align__(16) unsigned char smem[];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Natural grid (n * max_segments + m, head tile), or with a launch order (head tile, order
  // index): SegmentArgs::order.
  const bool ordered = sa.order_count > 0;
  const int64_t blk = ordered ? sa.order[blockIdx.y] : blockIdx.x;
  const int64_t hv = ordered ? blockIdx.x : blockIdx.y;
  const int64_t n = blk / sa.max_segments;
  const int64_t m = blk % sa.max_segments;
  const int64_t h = hv / sa.value_tiles;
  const int vt = static_cast<int>(hv % sa.value_tiles);
  const int64_t v0 = int64_t(vt) * BV;

  const SeqSpan seq = forward_sequence(p, n);
  const int64_t nchunks = (seq.len + kChunk - 1) / kChunk;
  const int64_t seg_len = sequence_segment_chunks(sa.segment_chunks, sa.whole_chunks, nchunks);
  const int64_t nseg = sequence_segments(sa.segment_chunks, sa.whole_chunks, nchunks);
  if (m >= nseg) return;
  // Pass 1 of a segment split: only the segment's local state (from zero) and its total log2
  // decay -- no q, A, o. The last segment's is never needed.
  constexpr bool full = LOCAL == 0;
  constexpr bool own_a = full && KEYHALF == 0;  // this pass forms A itself
  if (!full && m >= nseg - 1) return;
  const int64_t seg_index = (n * sa.max_segments + m) * p.H + h;
  const int64_t c_begin = m * seg_len;
  const int64_t c_end = gla_min64(nchunks, c_begin + seg_len);

  const bool per_head = p.gate_per_head != 0;
  const int gate_bytes = p.gate_dtype == kF32 ? 4 : 2;  // 4 only with per_head here
  const WsSmem L = ws_smem_layout(DK, HALVES);
  if constexpr (kSwz) {
    // the swizzle needs 1024-byte aligned tiles, and the two slots must end before the v stages
    if ((smem_addr(smem) & 1023u) != 0 || 2 * kSwizzledSlotBytes > L.v0) __trap();
  }

  // READY[s] / FREE[s] as mbarriers: READY counts the prep group's threads, FREE the state group's.
  unsigned char* mbars = smem + L.mbar;  // READY[0], READY[1], FREE[0], FREE[1]
  if (tid == 0) {
    mbar_init(mbars + 0, NP);
    mbar_init(mbars + 8, NP);
    mbar_init(mbars + 16, NS);
    mbar_init(mbars + 24, NS);
  }
  // Zero both A slots once: the strict upper triangle is never written again.
  for (int s = 0; s < 2; ++s) {
    uint32_t* a = reinterpret_cast<uint32_t*>(smem + L.a(s));
    for (int i = tid; i < kChunk * L.pa / 2; i += NT) a[i] = 0u;
  }
  __syncthreads();

  const int64_t esz = 2;  // signed: time strides may be negative (the backward runs the forward reversed)
  if (warp < NP / 32) {
    // =============================== prep group ===============================
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // A prepared pass's prep group only copies: its registers go to the wgmma state group.
    if constexpr (NT == 512 && kSwz) asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::);
    if constexpr (NT == 512 && !kSwz) asm volatile("setmaxnreg.dec.sync.aligned.u32 112;\n" ::);
#endif
    if constexpr (PREP != 0) {
      static_assert(KEYHALF != 0, "prepared inputs: key split only");
      copy_prepared<DK, NP, full, KEYHALF, kSwz>(p, sa, L, smem, mbars, seq, n, h, c_begin, c_end, seg_index, vt, tid);
    } else {
      uint16_t* qs = reinterpret_cast<uint16_t*>(smem + L.q);
      const uint16_t* ks = reinterpret_cast<const uint16_t*>(smem + L.k);
      const unsigned char* gs = smem + L.g;
      float* tot = reinterpret_cast<float*>(smem + L.tot);
      float* dpart = reinterpret_cast<float*>(smem + L.dpart);
      // Item: column pair cp, sub-chunk sub, half hf (rows row0 .. row0 + RS - 1 of the sub-chunk).
      const int cp = tid % (DK / 2), q2 = tid / (DK / 2), k0 = cp * 2;
      const int sub = q2 / HALVES, hf = q2 % HALVES, row0 = hf * RS;
      float* htot = reinterpret_cast<float*>(smem + L.htot);

      // Loads: each thread always copies the same 16-byte column group lc of rows lr0 + j kRowStep,
      // so its addresses are set up once here and only advance by a chunk of rows per call (the
      // per-element index arithmetic was ~13% of the prep group's instructions).
      constexpr int CPR = DK / 8, kRowStep = NP / CPR, kLoadIters = kChunk / kRowStep;
      static_assert(NP % CPR == 0 && kChunk % kRowStep == 0, "load tiling");
      const int lc = tid % CPR, lr0 = tid / CPR;
      const bool col_ok = lc * 8 < p.K;
      const int64_t q_rs = p.q_stride[1] * esz, k_rs = p.k_stride[1] * esz, g_rs = p.g_stride[1] * gate_bytes;
      const char* q_seq = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + seq.bos * p.q_stride[1] + h * p.q_stride[2] + lc * 8) * esz;
      const char* k_seq = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + seq.bos * p.k_stride[1] + h * p.k_stride[2] + lc * 8) * esz;
      // ForwardParams::gate_lag: token t's gate is row t - 1, the sequence's first token's is 0.
      const int lag = p.gate_lag;
      const char* g_seq = static_cast<const char*>(p.g) + (seq.batch * p.g_stride[0] + (seq.bos - lag) * p.g_stride[1] + h * p.g_stride[2]) * gate_bytes;
      auto issue_loads = [&](int64_t chunk) {
        const int rows = static_cast<int>(gla_min64(kChunk, seq.len - chunk * kChunk)), lo = seq.first_row(chunk);
        const int64_t r0 = chunk * kChunk + lr0;
        // Row pointers advance by kRowStep rows per copy: one 64-bit add each (written as
        // base + j * step, every copy cost a 64-bit multiply).
        const char* qr = q_seq + r0 * q_rs;
        const char* kr = k_seq + r0 * k_rs;
        const char* gr = g_seq + r0 * g_rs + lc * 16;
        const int64_t q_step = kRowStep * q_rs, k_step = kRowStep * k_rs, g_step = kRowStep * g_rs;
  #pragma unroll
        for (int j = 0; j < kLoadIters; ++j) {
          const int r = lr0 + j * kRowStep;
          const bool ok = col_ok && r < rows && r >= lo;
          const bool gate_ok = ok && !(lag && chunk == 0 && r == lo);
          const int so = (r * L.pr + lc * 8) * 2;
          if (full) cp_async16(smem + L.q + so, ok ? qr : p.q, ok);
          cp_async16(smem + L.k + so, ok ? kr : p.k, ok);
          if (!per_head) cp_async16(smem + L.g + so, gate_ok ? gr : p.g, gate_ok);
          qr += q_step;
          kr += k_step;
          gr += g_step;
        }
        const char* gb = g_seq + chunk * kChunk * g_rs;
        unsigned char* gst = smem + L.g;
        if (per_head) {
          for (int r = tid; r < kChunk; r += NP) {
            const bool ok = r < rows && r >= lo && !(lag && chunk == 0 && r == lo);
            if (gate_bytes == 4) {
              reinterpret_cast<float*>(gst)[r] = ok ? *reinterpret_cast<const float*>(gb + r * g_rs) : 0.f;
            } else {
              reinterpret_cast<uint16_t*>(gst)[r] = ok ? *reinterpret_cast<const uint16_t*>(gb + r * g_rs) : uint16_t(0);
            }
          }
        }
        cp_async_commit();
      };

      float dsum0 = 0.f, dsum1 = 0.f;  // pass 1: the segment's total log2 decay (columns k0, k0 + 1)
      if (c_begin < c_end) issue_loads(c_begin);
      for (int64_t c = c_begin; c < c_end; ++c) {
        const int slot = static_cast<int>(c & 1);
        uint16_t* qw = reinterpret_cast<uint16_t*>(smem + L.qw(slot));
        uint16_t* kw = reinterpret_cast<uint16_t*>(smem + L.kw(slot));
        uint16_t* As = reinterpret_cast<uint16_t*>(smem + L.a(slot));
        float* dfac = reinterpret_cast<float*>(smem + L.dfac(slot));
        cp_async_wait_all();
        named_sync(kBarPrep, NP);  // raw stage complete; the last chunk's tot/dpart readers are done

        // ---- element-wise, read phase: raw q, k, g -> registers ----
        uint32_t qv[RS], kv[RS];
        float e0[RS], e1[RS];
        float a0 = 0.f, a1 = 0.f;
        // The gate's form is tested once per chunk, not per row (per row it cost a branch and both
        // forms' conversions in each of the RS reads).
        auto read_rows = [&](auto per_head_form) {
          constexpr bool kPerHead = decltype(per_head_form)::value;
  #pragma unroll
          for (int r = 0; r < RS; ++r) {
            const int t = sub * 16 + row0 + r;
            float g0, g1;
            gate_pair_log2<X, false>(gs, t, k0, L.pr, kPerHead, gate_bytes, g0, g1);
            a0 += g0;
            a1 += g1;
            e0[r] = fast_exp2(g0);
            e1[r] = fast_exp2(g1);
            qv[r] = full ? *reinterpret_cast<const uint32_t*>(qs + t * L.pr + k0) : 0u;
            kv[r] = *reinterpret_cast<const uint32_t*>(ks + t * L.pr + k0);
          }
        };
        if (per_head) {
          read_rows(std::true_type{});
        } else {
          read_rows(std::false_type{});
        }
        if constexpr (HALVES == 1) {
          tot[sub * DK + k0] = a0;
          tot[sub * DK + k0 + 1] = a1;
        } else {
          htot[q2 * DK + k0] = a0;
          htot[q2 * DK + k0 + 1] = a1;
        }
        // Partials over this column pair: q_t . k_t (diagonal) and q_{2i+1} e_{2i+1} . k_{2i} (the
        // h = 1 level: pivot at row 2i, so the query factor is e_{2i+1} <= 1 and the key factor 1).
        float dg[RS], pr[RS / 2];
  #pragma unroll
        for (int r = 0; r < RS; ++r) {
          const float2 q = X::to_float2(qv[r]), k = X::to_float2(kv[r]);
          dg[r] = q.x * k.x + q.y * k.y;
        }
  #pragma unroll
        for (int i = 0; i < RS / 2; ++i) {
          const float2 q = X::to_float2(qv[2 * i + 1]), k = X::to_float2(kv[2 * i]);
          pr[i] = q.x * e0[2 * i + 1] * k.x + q.y * e1[2 * i + 1] * k.y;
        }
        // Reduce dg (RS rows) and pr (RS/2 pairs) over the warp: half-exchange, then butterflies;
        // dpart per warp (stride DPS): RS row sums, then RS/2 pair sums. At RS = 16 this runs before
        // the write phase, so that dg and pr are dead while that phase holds q, k and the factors (the
        // prep group spilled 148 B there; dpart's readers of the last chunk passed the first barrier).
        // At RS < 16 nothing spills and running it first only delays the next chunk's loads (B4 T8192
        // H32 D64: 0.365 -> 0.375 ms on the H200), so it stays after the write phase.
        auto reduce_partials = [&]() {
          constexpr int HV = RS / 2, HP = RS / 4;
          const bool upper = (lane & 16) != 0;
          float hv[HV], hp[HP];
  #pragma unroll
          for (int i = 0; i < HV; ++i) {
            const float send = upper ? dg[i] : dg[i + HV];
            const float keep = upper ? dg[i + HV] : dg[i];
            hv[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
          }
  #pragma unroll
          for (int i = 0; i < HP; ++i) {
            const float send = upper ? pr[i] : pr[i + HP];
            const float keep = upper ? pr[i + HP] : pr[i];
            hp[i] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
          }
  #pragma unroll
          for (int o = 8; o >= 1; o >>= 1) {
  #pragma unroll
            for (int i = 0; i < HV; ++i) hv[i] += __shfl_xor_sync(0xffffffffu, hv[i], o);
  #pragma unroll
            for (int i = 0; i < HP; ++i) hp[i] += __shfl_xor_sync(0xffffffffu, hp[i], o);
          }
          if ((lane & 15) == 0) {
  #pragma unroll
            for (int i = 0; i < HV; ++i) dpart[warp * DPS + (upper ? HV : 0) + i] = hv[i];
  #pragma unroll
            for (int i = 0; i < HP; ++i) dpart[warp * DPS + RS + (upper ? HP : 0) + i] = hp[i];
          }
        };
        if constexpr (RS == 16) {
          if (own_a) reduce_partials();
        }
        named_sync(kBarPrep, NP);  // every raw read is done: the next chunk may load
        if (c + 1 < c_end) issue_loads(c + 1);
        // The second key half's A rows of this chunk into registers now, stored into the slot once
        // it is free (the loads land during the write phase). Rows past the sequence are zero.
        constexpr int kIntraPieces = KEYHALF == 2 ? kChunk * 8 / NP : 1;  // 16-byte pieces per thread
        uint4 intra_rows[kIntraPieces];
        if constexpr (KEYHALF == 2) {
          const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk)), lo = seq.first_row(c);
          const uint16_t* src = p.intra + ((seq.batch * p.T + seq.bos + c * kChunk) * p.H + h) * kChunk;
  #pragma unroll
          for (int j = 0; j < kIntraPieces; ++j) {
            const int i = tid + j * NP, r = i >> 3;
            intra_rows[j] = r < rows && r >= lo ? *reinterpret_cast<const uint4*>(src + int64_t(r) * p.H * kChunk + (i & 7) * 8)
                                     : make_uint4(0u, 0u, 0u, 0u);
          }
        }
        // The far off-diagonal blocks' factors 2^{Tot_1}, 2^{Tot_2}, 2^{Tot_1 + Tot_2} for this
        // thread's two columns, once per chunk (the A phase read them per k-step as exp2 of sums,
        // which made the far blocks the slowest A tasks). Sub-chunk totals in exactly the
        // expressions that tot[] gets, so the factors are bitwise those of the per-k-step form. The
        // last chunk's A phase read the table before the barrier that preceded this chunk's loads.
        if constexpr (kFarTable) {
          if (own_a && hf == 0 && (sub == 1 || sub == 2)) {
            float* ofac = reinterpret_cast<float*>(smem + L.ofac);
            auto sub_total = [&](int s, int col) {
              if constexpr (HALVES == 1) {
                return tot[s * DK + col];
              } else {
                float t = htot[(s * HALVES) * DK + col];
  #pragma unroll
                for (int i = 1; i < HALVES; ++i) t += htot[(s * HALVES + i) * DK + col];
                return t;
              }
            };
  #pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float t1 = sub_total(1, k0 + e);
              if (sub == 1) {
                ofac[k0 + e] = fast_exp2(t1);
              } else {
                const float t2 = sub_total(2, k0 + e);
                ofac[DK + k0 + e] = fast_exp2(t2);
                ofac[2 * DK + k0 + e] = fast_exp2(t1 + t2);
              }
            }
          }
        }
        // The slot was last used by chunk c-2: wait until the state group is done with it.
        if (c >= c_begin + 2) {
          mbar_wait(mbars + 16 + 8 * slot, static_cast<uint32_t>(((c - 2 - c_begin) >> 1) & 1));
        }

        if constexpr (kStateScales) {
          // The chunk's totals for the state group's scaling (a0, a1: this item's whole sub-chunk
          // at RS = 16, the values tot holds), and the chunk decay 2^{b_last} (sub-chunk 0's items:
          // Post of sub-chunk 0 plus its own total).
          *slot_total_pair<DK>(smem, L, slot, sub, k0) = make_float2(a0, a1);
          if (sub == 0) {
            float pre0, pre1, post0, post1;
            sub_chunk_pre_post<DK>(tot, 0, k0, pre0, pre1, post0, post1);
            const float d0 = post0 + tot[k0], d1 = post1 + tot[k0 + 1];
            dfac[k0] = fast_exp2(d0);
            dfac[k0 + 1] = fast_exp2(d1);
            dsum0 += d0;
            dsum1 += d1;
          }
        }

        // ---- element-wise, write phase: qloc, kloc, level copies; reductions ----
        {
          // qloc_t = q_t 2^{c_t} (c from the sub-chunk start), kloc_t = k_t 2^{Tot - c_t}. A second
          // half starts its query product at 2^{total of the first half}; a first half starts its key
          // product at 2^{total of the second half}. Exponents <= 0.
          float fq0 = 1.f, fq1 = 1.f, fk0 = 1.f, fk1 = 1.f;
          if constexpr (HALVES == 2) {
            const float h00 = htot[(sub * 2) * DK + k0], h01 = htot[(sub * 2) * DK + k0 + 1];
            const float h10 = htot[(sub * 2 + 1) * DK + k0], h11 = htot[(sub * 2 + 1) * DK + k0 + 1];
            if (hf == 1) {
              fq0 = fast_exp2(h00);
              fq1 = fast_exp2(h01);
            } else {
              fk0 = fast_exp2(h10);
              fk1 = fast_exp2(h11);
              tot[sub * DK + k0] = h00 + h10;
              tot[sub * DK + k0 + 1] = h01 + h11;
            }
          }
          float f0 = fq0, f1 = fq1;
  #pragma unroll
          for (int r = 0; r < RS && full; ++r) {
            f0 *= e0[r];
            f1 *= e1[r];
            const float2 q = X::to_float2(qv[r]);
            *reinterpret_cast<uint32_t*>(qw + (sub * 16 + row0 + r) * L.pq + k0) = X::pack(q.x * f0, q.y * f1);
          }
          f0 = fk0;
          f1 = fk1;
  #pragma unroll
          for (int r = RS - 1; r >= 0; --r) {
            const float2 k = X::to_float2(kv[r]);
            *reinterpret_cast<uint32_t*>(kw + (sub * 16 + row0 + r) * L.pq + k0) = X::pack(k.x * f0, k.y * f1);
            f0 *= e0[r];
            f1 *= e1[r];
          }
        }
        if (own_a) {
          if constexpr (HALVES == 1) {
            const int at = sub * 16 * L.pq + k0;
            write_level_block<8, 16, X>(reinterpret_cast<uint16_t*>(smem + L.lvl(0)) + at, L.pq, qv, kv, e0, e1);
            write_level_block<4, 16, X>(reinterpret_cast<uint16_t*>(smem + L.lvl(1)) + at, L.pq, qv, kv, e0, e1);
            write_level_block<2, 16, X>(reinterpret_cast<uint16_t*>(smem + L.lvl(2)) + at, L.pq, qv, kv, e0, e1);
          } else {
            const int at = (sub * 16 + row0) * L.pq + k0;
            write_level_rows_h8<X>(reinterpret_cast<uint16_t*>(smem + L.lvl(0)) + at, L.pq, hf == 0, qv, kv, e0, e1);
            write_level_block<4, 8, X>(reinterpret_cast<uint16_t*>(smem + L.lvl(1)) + at, L.pq, qv, kv, e0, e1);
            write_level_block<2, 8, X>(reinterpret_cast<uint16_t*>(smem + L.lvl(2)) + at, L.pq, qv, kv, e0, e1);
          }
        }
        if constexpr (RS != 16) {
          if (own_a) reduce_partials();
        }
        named_sync(kBarPrep, NP);

        // ---- A: off-diagonal blocks, the three level products, diagonal and h = 1 entries ----
        {
          // 6 off-diagonal blocks (DK/16 mma pairs each) and 12 level products (sub-chunk x level,
          // DK/32 pairs each): 24 units, spread evenly over the prep warps -- 8 warps: an
          // off-diagonal block and a level each, or three levels; 16: one block or two levels; 4: two
          // blocks and two levels, or six levels. (Round-robin gave two of 8 warps 4 units.)
          auto offdiag = [&](int task) {
            // Blocks (i, j): (1,0) (2,1) (3,2) (2,0) (3,1) (3,0), packed as nibbles (no local array).
            offdiag_block<DK, X, kFarTable>(As, L.pa, qw, kw, L.pq, tot, (0x332321 >> (4 * task)) & 15,
                                            (0x010210 >> (4 * task)) & 15, lane,
                                            reinterpret_cast<const float*>(smem + L.ofac));
          };
          auto level = [&](int task) {
            level_block_at<DK, X>(As, L.pa, reinterpret_cast<const uint16_t*>(smem + L.lvl(task % 3)), L.pq, task / 3,
                                  task % 3, lane);
          };
          constexpr int NW = NP / 32;
          static_assert(NW == 4 || NW == 8 || NW == 16, "A task split");
          if constexpr (KEYHALF == 2) {
  #pragma unroll
            for (int j = 0; j < kIntraPieces; ++j) {
              const int i = tid + j * NP;
              *reinterpret_cast<uint4*>(As + (i >> 3) * L.pa + (i & 7) * 8) = intra_rows[j];
            }
          }
          if (own_a) {
            if constexpr (NW == 16) {
              if (warp < 6) {
                offdiag(warp);
              } else if (warp < 12) {
                level(2 * (warp - 6));
                level(2 * (warp - 6) + 1);
              }
            } else if constexpr (NW == 8 && !kFarTable) {
              if (warp < 6) {
                offdiag(warp);
                level(warp);
              } else {
                for (int i = 0; i < 3; ++i) level(6 + 3 * (warp - 6) + i);
              }
            } else if constexpr (NW == 8) {
              // The three far blocks (2,0) (3,1) (3,0) -- the heaviest tasks, with their fragment
              // scaling -- alone on warps 0..2; the near blocks and the 12 levels three to a warp
              // on warps 3..7.
              if (warp < 3) {
                offdiag(3 + warp);
              } else if (warp < 6) {
                offdiag(warp - 3);
                level(2 * (warp - 3));
                level(2 * (warp - 3) + 1);
              } else {
                for (int i = 0; i < 3; ++i) level(6 + 3 * (warp - 6) + i);
              }
            } else {
              if (warp < 3) {
                offdiag(2 * warp);
                offdiag(2 * warp + 1);
                level(2 * warp);
                level(2 * warp + 1);
              } else {
                for (int i = 6; i < 12; ++i) level(i);
              }
            }
          }
          if (own_a && tid < kChunk) {
            // Row t = 16 tsub + RS thf + lr: its warps are those of item row q2 = HALVES tsub + thf.
            const int t = tid, tsub = t >> 4, thf = (t & 15) / RS, lr = (t & 15) % RS, r = t & 15;
            const int wq = (tsub * HALVES + thf) * kWarpsPerItemRow;
            float sd = 0.f, sp = 0.f;
  #pragma unroll
            for (int w = 0; w < kWarpsPerItemRow; ++w) {
              sd += dpart[(wq + w) * DPS + lr];
              sp += dpart[(wq + w) * DPS + RS + (lr >> 1)];
            }
            As[t * L.pa + t] = X::from_float(sd);
            if (r & 1) As[t * L.pa + t - 1] = X::from_float(sp);
          }
        }
        if constexpr (!kStateScales) {
          named_sync(kBarPrep, NP);  // A done; qloc/kloc no longer read as such
          // ---- qg = qloc 2^{Pre}, kg = kloc 2^{Post}; the chunk's decay 2^{b_last} ----
          float pre0, pre1, post0, post1;
          sub_chunk_pre_post<DK>(tot, sub, k0, pre0, pre1, post0, post1);
          if (sub == 0 && hf == 0) {
            const float d0 = post0 + tot[k0], d1 = post1 + tot[k0 + 1];
            dfac[k0] = fast_exp2(d0);
            dfac[k0 + 1] = fast_exp2(d1);
            dsum0 += d0;
            dsum1 += d1;
          }
          scale_slot_rows<RS, X>(qw, kw, L.pq, sub, row0, k0, full, pre0, pre1, post0, post1);
        }
        // Publish the slot: each thread's arrival releases its own writes to the state group's wait
        // (PTX ISA, mbarrier).
        mbar_arrive(mbars + 8 * slot);
      }
      if (!full && vt == 0 && tid < DK / 2) {
        sa.seg_decay[seg_index * DK + k0] = dsum0;
        sa.seg_decay[seg_index * DK + k0 + 1] = dsum1;
      }
    }
  } else {
    // =============================== state group ===============================
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (NT == 512 && kSwz) asm volatile("setmaxnreg.inc.sync.aligned.u32 200;\n" ::);
    if constexpr (NT == 512 && !kSwz) asm volatile("setmaxnreg.inc.sync.aligned.u32 144;\n" ::);
#endif
    const int stid = tid - NP, swarp = warp - NP / 32;
    const int vrow = swarp * 16;

    // v loads, set up once per thread like the prep group's (column group lc, rows lr0 + j kRowStep).
    constexpr int VPR = BV / 8, kRowStep = NS / VPR, kLoadIters = kChunk / kRowStep;
    static_assert(NS % VPR == 0 && kChunk % kRowStep == 0, "load tiling");
    const int lc = stid % VPR, lr0 = stid / VPR;
    const bool col_ok = v0 + lc * 8 < p.V;
    const int64_t v_rs = p.v_stride[1] * esz;
    const char* v_seq = static_cast<const char*>(p.v) + (seq.batch * p.v_stride[0] + seq.bos * p.v_stride[1] + h * p.v_stride[2] + v0 + lc * 8) * esz;
    auto issue_v = [&](int64_t chunk, int stage) {
      const int rows = static_cast<int>(gla_min64(kChunk, seq.len - chunk * kChunk)), lo = seq.first_row(chunk);
      const char* vr = v_seq + (chunk * kChunk + lr0) * v_rs;
      const int64_t v_step = kRowStep * v_rs;
#pragma unroll
      for (int j = 0; j < kLoadIters; ++j) {
        const int r = lr0 + j * kRowStep;
        const bool ok = col_ok && r < rows && r >= lo;
        cp_async16(smem + L.v(stage) + (r * L.pv + lc * 8) * 2, ok ? vr : p.v, ok);
        vr += v_step;
      }
      cp_async_commit();
    };
    if (c_begin < c_end) issue_v(c_begin, static_cast<int>(c_begin & 1));

    // This warp's o rows of chunk c (its 16 value columns), and the pieces a lane stores: piece
    // i * 32 + lane is row piece / 2, value half piece % 2 (16 bytes).
    auto o_rows = [&](int64_t c) {
      return static_cast<char*>(p.o) +
             (seq.batch * p.o_stride[0] + (seq.bos + c * kChunk) * p.o_stride[1] + h * p.o_stride[2] + v0 + vrow) * esz;
    };
    // The second key half adds into the first half's o. That o of chunk c is copied into this
    // warp's 2 KB of the level copies' region (unused: this pass forms no A) when chunk c - 1 has
    // been stored (before the loop for the first chunk), so its latency passes under chunk c's
    // products instead of stalling the store; each lane copies exactly the pieces it adds, so no
    // lane reads another's. Commit order per chunk: v of c + 1, then prev_o of c + 1.
    // (the swizzled slots take the level copies' region: there the unused qw of the plain slot 0)
    uint16_t* prev_o = reinterpret_cast<uint16_t*>(smem + (kSwz ? L.qw(0) : L.lvl(0))) + swarp * (kChunk * 16);
    static_assert(KEYHALF != 2 || NS / 32 * kChunk * 16 * 2 <= kChunk * (DK + 8) * 2, "prev_o fits one level tile");
    auto issue_prev_o = [&](int64_t c, int rows) {
      const char* ob = o_rows(c);
      const int lo = seq.first_row(c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int piece = i * 32 + lane, r = piece >> 1, half = piece & 1;
        const bool ok = r < rows && r >= lo && v0 + vrow + half * 8 < p.V;
        cp_async16(prev_o + piece * 8, ok ? ob + (r * p.o_stride[1] + half * 8) * esz : p.o, ok);
      }
      cp_async_commit();
    };

    if constexpr (KEYHALF == 2 && full) {
      if (c_begin < c_end) issue_prev_o(c_begin, static_cast<int>(gla_min64(kChunk, seq.len - c_begin * kChunk)));
    }

    float S[NKT][4];
    load_initial_state<DK, BV>(S, p, sa, full, n, m, h, v0, vrow, lane);
    // The chunk-start states: staged through shared memory into whole-sector 16-byte stores where
    // chunk_states allows them, else paired 32-bit stores from the fragments. The stage is this
    // warp's columns of the v stage (dead from load_v_fragments to stage_o_tile), or with the
    // swizzled slots the plain layout's unused kw(0) tile.
    const int64_t* cst = p.chunk_states_stride;
    const bool staged_states = (reinterpret_cast<uintptr_t>(p.chunk_states) & 15) == 0 && p.V % 8 == 0 &&
                               (cst[0] | cst[1] | cst[2] | cst[3]) % 8 == 0;
    uint16_t* state_stage = reinterpret_cast<uint16_t*>(smem + L.kw(0));
    auto store_state_block = [&](int64_t chunk, uint16_t* stage, int pitch) {
      if (staged_states) {
        store_chunk_state_staged<DK>(S, p, n, seq.bos, chunk, h, v0, vrow, lane, stage, pitch);
      } else {
        store_chunk_state_paired<DK>(S, p, n, seq.bos, chunk, h, v0, vrow, lane);
      }
    };

    for (int64_t c = c_begin; c < c_end; ++c) {
      const int slot = static_cast<int>(c & 1);
      uint16_t* vs = reinterpret_cast<uint16_t*>(smem + L.v(slot));
      const uint16_t* qw = reinterpret_cast<const uint16_t*>(smem + L.qw(slot));
      const uint16_t* kw = reinterpret_cast<const uint16_t*>(smem + L.kw(slot));
      const uint16_t* As = reinterpret_cast<const uint16_t*>(smem + L.a(slot));
      const float* dfac = reinterpret_cast<const float*>(smem + L.dfac(slot));
      const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk));
      // v of chunk c; with KEYHALF 2 the prev_o copy of chunk c, committed after it, may still fly
      if constexpr (KEYHALF == 2 && full) cp_async_wait_one(); else cp_async_wait_all();
      uint32_t vf[4][4];
      if constexpr (kStateScales) {
        // qloc, kloc, A, decay and the totals of chunk c are published: qg, kg in place, this
        // thread's item as the prep group's mapping has it (column pair cp, sub-chunk sub).
        static_assert(NS == NP, "one state thread per element-wise item");
        mbar_wait(mbars + 8 * slot, static_cast<uint32_t>(((c - c_begin) >> 1) & 1));
        const int cp = stid % (DK / 2), sub = stid / (DK / 2), k0 = 2 * cp;
        float pre0, pre1, post0, post1;
        sub_chunk_pre_post_of([&](int l) { return *slot_total_pair<DK>(smem, L, slot, l, k0); }, sub, pre0, pre1,
                              post0, post1);
        uint16_t* qloc = reinterpret_cast<uint16_t*>(smem + L.qw(slot));
        uint16_t* kloc = reinterpret_cast<uint16_t*>(smem + L.kw(slot));
        scale_slot_rows<16, X>(qloc, kloc, L.pq, sub, 0, k0, full, pre0, pre1, post0, post1);
        // qg, kg complete and v of chunk c landed before any warp reads them; the stage refilled
        // next was last read at c-1
        named_sync(kBarState, NS);
        if (c + 1 < c_end) issue_v(c + 1, slot ^ 1);
        load_v_fragments(vf, vs, L.pv, vrow, lane);
      } else {
        named_sync(kBarState, NS);  // v of chunk c landed; the stage refilled next was last read at c-1
        if (c + 1 < c_end) issue_v(c + 1, slot ^ 1);
        load_v_fragments(vf, vs, L.pv, vrow, lane);
        // qg, kg, A, decay of chunk c are published
        mbar_wait(mbars + 8 * slot, static_cast<uint32_t>(((c - c_begin) >> 1) & 1));
      }
      float acc[8][4] = {};
      const bool store_state = full && p.chunk_states != nullptr;
      // The first key half has no intra-chunk term (its A slots stay zero): its 20 A v mmas skipped.
      if constexpr (kSwz) {
        fence_proxy_async_smem();  // the slot's copies (generic proxy) before wgmma's reads (async proxy)
        if (store_state) store_state_block(c, state_stage, L.pq);
        const uint32_t slot_addr = smem_addr(smem) + slot * kSwizzledSlotBytes;
        wg_state_products<DK, X, KEYHALF == 2>(acc, S, vf, slot_addr, slot_addr + kSwizzledA, slot_addr + kSwizzledKg,
                                               dfac, vs, L.pv, vrow, lane, p.scale);
      } else if constexpr (kProductsBranch) {
        if (store_state) store_state_block(c, vs, L.pv);
        if (rows > 0) {  // always: kProductsBranch says why
          if (full) o_tile<DK, X, true>(acc, S, vf, qw, L.pq, As, L.pa, lane);
          state_update<DK, X>(S, vf, kw, L.pq, dfac, lane);
        }
      } else if constexpr (kStoresInUpdate) {
        const ChunkStateStore store =
            store_state ? ChunkStateStore(p, n, seq.bos, c, h, v0, vrow, lane) : ChunkStateStore();
        if (full) o_tile<DK, X, KEYHALF != 1>(acc, S, vf, qw, L.pq, As, L.pa, lane);
        state_update<DK, X, true>(S, vf, kw, L.pq, dfac, lane, store);
      } else {
        if (store_state) store_state_block(c, vs, L.pv);
        if (full) o_tile<DK, X, KEYHALF != 1>(acc, S, vf, qw, L.pq, As, L.pa, lane);
        state_update<DK, X>(S, vf, kw, L.pq, dfac, lane);
      }
      // Done with the slot (the wgmma state group: after its S^T update, below).
      if constexpr (!kSwz) mbar_arrive(mbars + 16 + 8 * slot);

      if (!full) continue;
      // o^T -> this warp's own columns of the v stage (only this warp read them) -> global.
      const float sc = p.scale;
      if constexpr (!kSwz) stage_o_tile<X>(acc, vs, L.pv, vrow, lane, sc);  // (wg_state_products staged it)
      __syncwarp();
      if constexpr (KEYHALF == 2) {  // this lane's prev_o pieces (v of chunk c + 1, committed later, may fly)
        if (c + 1 < c_end) cp_async_wait_one(); else cp_async_wait_all();
      }
      char* ob = o_rows(c);
      const int lo = seq.first_row(c);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int piece = i * 32 + lane, r = piece >> 1, half = piece & 1;
        if (r < rows && r >= lo && v0 + vrow + half * 8 < p.V) {
          uint4* dst = reinterpret_cast<uint4*>(ob + (r * p.o_stride[1] + half * 8) * esz);
          const uint4 mine = *reinterpret_cast<const uint4*>(vs + r * L.pv + vrow + half * 8);
          if constexpr (KEYHALF == 2) {
            // 16-bit o of the first key half + this half's, summed in fp32 and rounded once more
            const uint4 prev = *reinterpret_cast<const uint4*>(prev_o + piece * 8);
            *dst = make_uint4(add_pair<X>(prev.x, mine.x), add_pair<X>(prev.y, mine.y), add_pair<X>(prev.z, mine.z),
                              add_pair<X>(prev.w, mine.w));
          } else {
            *dst = mine;
          }
        }
      }
      if constexpr (KEYHALF == 2) {
        if (c + 1 < c_end) issue_prev_o(c + 1, static_cast<int>(gla_min64(kChunk, seq.len - (c + 1) * kChunk)));
      }
      if constexpr (kSwz) {
        wg_finish_update<DK>(S, vf);
        mbar_arrive(mbars + 16 + 8 * slot);
      }
    }

    if (full) {
      if (m == nseg - 1 && p.final_state != nullptr) store_final_state<DK>(S, p, n, h, v0, vrow, lane);
    } else {
      store_segment_state<DK, BV>(S, sa, seg_index, v0, vrow, lane);
    }
  }
}

}  // namespace gla::cuda::detail
