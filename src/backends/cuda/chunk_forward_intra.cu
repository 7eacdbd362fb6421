// The intra-chunk matrix over all keys for the key split (128 < K <= 256, ForwardPlan::key_split):
// A[t, s] = sum_k q_tk k_sk 2^{b_tk - b_sk} of each 64-token chunk, accumulated in fp32 over every
// key and rounded to 16 bits once. Formed per key half and summed, A and o are each rounded twice,
// so their error scales with the halves' magnitudes: where q.k cancels between the halves the row
// was off by up to 14% (fla's GLA model at K 256, the first tokens), against 0.4% for one rounding.
//
// One CTA per (sequence, chunk, head), 256 threads. The keys are taken in slices of 64 (cp.async,
// kIntraStagesFor stages), each slice in two phases between barriers:
//   1. element-wise, one thread per (key pair, half sub-chunk): the factors e_u = 2^{g_u log2 e}, the
//      sub-chunk totals, and the pivoted copies qloc = q 2^{c}, kloc = k 2^{Tot - c} (c the inclusive
//      cumsum inside the sub-chunk) into buffers of their own; then, where every |c_r - c_7| of the
//      slice is at most kOnePivotRange (a CTA-wide vote), the diagonal's one-pivot copies
//      q 2^{c_t - c_7} and k 2^{c_7 - c_s} as high and low bf16 parts (high over the raw q and k,
//      low in e's space), else e for the element-wise form;
//   2. the slice's terms added to fp32 registers: the off-diagonal 16x16 blocks on tensor cores from
//      qloc/kloc as the chunk kernels form them (offdiag_accumulate; every row of such a block sums
//      16+ terms) on warps 0..5, and the 16x16 diagonal blocks either on tensor cores from the
//      one-pivot copies (hi·hi + hi·lo + lo·hi, an m16n8 fragment per warp) or element-wise in fp32
//      (SPEC.md 3.2): A[t, s] = sum_k q_tk (k_sk F_tk) with F the running product of e_u, u = s+1..t
//      (each <= 1, no exponent per pair), summed per slice into a shared fp32 tile. A diagonal from
//      copies rounded once to 16 bits (the chunk kernels' pivot levels) left the first rows of a
//      sequence (one to three terms each) 1-2% off where q.k nearly cancels; the high and low parts
//      keep ~2^-16 per term. The tensor-core form: B8 T2048 H4 K256 V512 forward 0.330 -> 0.317 ms,
//      B8 T4096 H16 K = V = 256 1.84 -> 1.73 ms (H100 harness).
#include "backends/cuda/chunk_forward_kernel.cuh"
#include "backends/cuda/chunk_forward.hpp"
#include "backends/cuda/kernel_attributes.cuh"

namespace gla::cuda::detail {
namespace {

constexpr int kIntraThreads = 256;
constexpr int kSlice = kIntraSliceKeys;
// A slice's diagonal blocks take one pivot (row 7 of each sub-chunk) when every |c_r - c_7| is at
// most this (c the sub-chunk's inclusive log2 cumsum): the copies' factors stay within 2^±32, far
// inside bf16's range; their products q_t k_s 2^{b_t - b_s} do not grow at all.
constexpr float kOnePivotRange = 32.0f;

// One stage for a 16-bit gate: three CTAs per SM (B8 T4096 H16 K = V = 256 forward 1.885 ms with two
// stages and two CTAs per SM, 1.838 ms; B8 T2048 H4 K256 V512 0.411 both, H200 harness).
template <int GATE_BYTES>
constexpr int kIntraStagesFor = GATE_BYTES == 2 ? 1 : 2;

// GATE_BYTES: the gate's element size (4 for fp32, 2 for 16-bit), a compile-time constant so that
// the 32 gate reads per thread and slice address shared memory by immediate offsets (as run-time
// values they cost ~10 predicated address instructions per read; H200, B8 T2048 H4 K256 V512: this
// kernel 148 -> 121 us under ncu).
template <typename E, int GATE_BYTES>
__global__ void __launch_bounds__(kIntraThreads, kIntraStagesFor<GATE_BYTES> == 1 ? 3 : 2)
chunk_intra_kernel(const __grid_constant__ ForwardParams p, uint16_t* __restrict__ intra, int64_t max_chunks,
                   const PreparedInputs prepared) {
  using X = Elem<E>;
  constexpr int STAGES = kIntraStagesFor<GATE_BYTES>;
  constexpr int gate_bytes = GATE_BYTES;
  constexpr int NT = kIntraThreads;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = blockIdx.x / max_chunks, c = blockIdx.x % max_chunks, h = blockIdx.y;
  const SeqSpan seq = forward_sequence(p, n);
  if (c * kChunk >= seq.len) return;
  const int rows = static_cast<int>(gla_min64(kChunk, seq.len - c * kChunk));
  const bool per_head = p.gate_per_head != 0;
  const IntraSmem L = intra_smem_layout(STAGES, gate_bytes);
  uint16_t* qloc = reinterpret_cast<uint16_t*>(smem + L.qloc);
  uint16_t* kloc = reinterpret_cast<uint16_t*>(smem + L.kloc);
  float* es = reinterpret_cast<float*>(smem + L.e);
  float* tot = reinterpret_cast<float*>(smem + L.tot);
  // The one-pivot diagonal's low parts, in e's space: [64][pq] each for q and k.
  uint16_t* q_low = reinterpret_cast<uint16_t*>(smem + L.e);
  uint16_t* k_low = q_low + kChunk * L.pq;

  // One slice of q, k, g into a stage; keys past K and rows past the sequence read 0 (gate 0: factor 1).
  const int64_t esz = 2;  // signed: time strides may be negative (the backward's reversed forward)
  const int64_t t0 = seq.bos + c * kChunk;
  const char* qb = static_cast<const char*>(p.q) + (seq.batch * p.q_stride[0] + t0 * p.q_stride[1] + h * p.q_stride[2]) * esz;
  const char* kb = static_cast<const char*>(p.k) + (seq.batch * p.k_stride[0] + t0 * p.k_stride[1] + h * p.k_stride[2]) * esz;
  // ForwardParams::gate_lag: token t's gate is row t - 1, the sequence's first token's is 0.
  const char* gb = static_cast<const char*>(p.g) + (seq.batch * p.g_stride[0] + (t0 - p.gate_lag) * p.g_stride[1] + h * p.g_stride[2]) * gate_bytes;
  const int lo = seq.first_row(c);                // rows below it read 0 (ForwardParams::pad_front)
  const int gate_row0 = lo + (c == 0 ? p.gate_lag : 0);  // rows below it read gate 0
  auto issue_slice = [&](int sl, int stage) {
    unsigned char* st = smem + stage * L.stage_bytes;
    const int key0 = sl * kSlice;
    if (p.vector_loads) {
      constexpr int CPR = kSlice / 8;
      for (int i = tid; i < kChunk * CPR; i += NT) {
        const int r = i / CPR, cc = i % CPR;
        const bool ok = r < rows && r >= lo && key0 + cc * 8 < p.K;
        const int64_t at = (r * p.q_stride[1] + key0 + cc * 8) * esz, kat = (r * p.k_stride[1] + key0 + cc * 8) * esz;
        cp_async16(st + L.q + (r * L.pq + cc * 8) * 2, ok ? qb + at : qb, ok);
        cp_async16(st + L.k + (r * L.pq + cc * 8) * 2, ok ? kb + kat : kb, ok);
      }
      if (!per_head) {
        const int gpr = kSlice * gate_bytes / 16, gper = 16 / gate_bytes;
        for (int i = tid; i < kChunk * gpr; i += NT) {
          const int r = i / gpr, cc = i % gpr;
          const bool ok = r < rows && r >= gate_row0 && key0 + cc * gper < p.K;
          cp_async16(st + L.g + (r * L.pg + cc * gper) * gate_bytes,
                     ok ? gb + (r * p.g_stride[1] + key0 + cc * gper) * gate_bytes : p.g, ok);
        }
      }
    } else {
      for (int i = tid; i < kChunk * kSlice; i += NT) {
        const int r = i / kSlice, cc = i % kSlice;
        const bool ok = r < rows && r >= lo && key0 + cc < p.K;
        reinterpret_cast<uint16_t*>(st + L.q)[r * L.pq + cc] =
            ok ? reinterpret_cast<const uint16_t*>(qb)[r * p.q_stride[1] + key0 + cc] : uint16_t(0);
        reinterpret_cast<uint16_t*>(st + L.k)[r * L.pq + cc] =
            ok ? reinterpret_cast<const uint16_t*>(kb)[r * p.k_stride[1] + key0 + cc] : uint16_t(0);
        if (!per_head) {
          const bool gate_ok = ok && r >= gate_row0;
          if (gate_bytes == 4) {
            reinterpret_cast<float*>(st + L.g)[r * L.pg + cc] =
                gate_ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1] + key0 + cc] : 0.f;
          } else {
            reinterpret_cast<uint16_t*>(st + L.g)[r * L.pg + cc] =
                gate_ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1] + key0 + cc] : uint16_t(0);
          }
        }
      }
    }
    if (per_head) {
      // Each row's gate written to every column of the slice: the element-wise phase then reads one
      // layout whatever the gate's form.
      for (int i = tid; i < kChunk * kSlice; i += NT) {
        const int r = i / kSlice, cc = i % kSlice;
        const bool ok = r < rows && r >= gate_row0;
        if (gate_bytes == 4) {
          reinterpret_cast<float*>(st + L.g)[r * L.pg + cc] = ok ? reinterpret_cast<const float*>(gb)[r * p.g_stride[1]] : 0.f;
        } else {
          reinterpret_cast<uint16_t*>(st + L.g)[r * L.pg + cc] =
              ok ? reinterpret_cast<const uint16_t*>(gb)[r * p.g_stride[1]] : uint16_t(0);
        }
      }
    }
    cp_async_commit();
  };

  // The prepared inputs' factor items: key column ecol of the slice, sub-chunk esub (a warp: 32
  // consecutive keys).
  const int ecol = tid & (kSlice - 1), esub = tid / kSlice;
  // Diagonal items: (sub-chunk dsub, key row pair sp, column group cg) adds, per slice, its keys'
  // terms of A[t, s] for s = sp (rows t = sp..15), then s = 15 - sp (rows 15-sp..15): 17 rows on
  // every thread, reduced over the 8 column groups at the end. Group cg holds the key pairs at
  // columns 2 cg + 16 m (m = 0..3), so the 8 groups of a row read 16 consecutive factors at a
  // time: with the factors' pitch of 80 floats a half-warp's 64-bit reads hit 32 distinct banks
  // (8 consecutive keys per group were 8-way conflicts: 4.7 wavefronts per shared load in this
  // kernel, 134 us at B8 T2048 H4 K256 V512).
  const int dsub = tid >> 6, sp = (tid >> 3) & 7, cg = tid & 7, col = cg * 2;
  auto key_col = [&](int j) { return col + 8 * j; };  // j = 0, 2, 4, 6: the pair's first key
  const int first_rows = 16 - sp;
  // The element-wise slices' sums of the pairs t >= s, per diagonal block [4][16][16] (each pair
  // owned by one lane: no race, a fixed order).
  float* diagonal = reinterpret_cast<float*>(smem + L.diagonal);
  for (int i = tid; i < 4 * 16 * 16; i += NT) diagonal[i] = 0.f;  // ordered by the loop's first barrier
  // Off-diagonal blocks (i, j) on warps 0..5: (1,0) (2,1) (3,2) (2,0) (3,1) (3,0), as nibbles.
  const int bi = (0x332321 >> (4 * (warp % 6))) & 15, bj = (0x010210 >> (4 * (warp % 6))) & 15;
  float oacc[2][2][4] = {};
  // One-pivot diagonal on tensor cores: warp w forms rows 16 (w & 3) .. + 15, columns 8 (w >> 2) .. + 7
  // of its sub-chunk's diagonal block (an m16n8 C fragment, over every slice that takes this form).
  const int tblk = warp & 3, tcol = 8 * (warp >> 2);
  float tacc[4] = {0.f, 0.f, 0.f, 0.f};

  float* factors = reinterpret_cast<float*>(smem + L.factors);
  const int slices = static_cast<int>((p.K + kSlice - 1) / kSlice);
  issue_slice(0, 0);
  for (int sl = 0; sl < slices; ++sl) {
    const int stage = STAGES == 1 ? 0 : (sl & 1);
    unsigned char* st = smem + stage * L.stage_bytes;
    uint16_t* qs = reinterpret_cast<uint16_t*>(st + L.q);
    uint16_t* ks = reinterpret_cast<uint16_t*>(st + L.k);
    const unsigned char* gs = st + L.g;
    cp_async_wait_all();
    __syncthreads();  // slice sl landed; the previous slice's readers of qloc, kloc, e, tot (and its stage) are done
    if (STAGES == 2 && sl + 1 < slices) issue_slice(sl + 1, (sl + 1) & 1);

    // ---- phase 1: e, the sub-chunk totals, qloc and kloc; a thread per (key pair, half sub-chunk) ----
    // Warp w takes rows 8w .. 8w + 7 (sub-chunk w / 2, its upper half for odd w), lane l keys 2l and
    // 2l + 1: every shared access moves a 32-bit pair and a warp's row is 128 contiguous bytes
    // (against one key of 16 rows per thread: 2-byte accesses, twice the instructions; H200, B8 T2048
    // H4 K256 V512: this kernel 121 -> 106 us under ncu, fwd+bwd b2b 1.005 -> 0.987 ms). The halves
    // exchange their totals through the factors' space (free until phase 2) at the vote's barrier.
    bool one_pivot;
    {
      const int pk = 2 * lane, row0 = 8 * warp;
      const bool upper = (warp & 1) != 0;
      float* half_total = factors;  // [8 half sub-chunks][kSlice]
      // cum: the inclusive cumsum inside the half (log2 units), the copies' exponents too.
      float e0[8], e1[8], cum0[8], cum1[8], t0 = 0.f, t1 = 0.f, hi0 = 0.f, lo0 = 0.f, hi1 = 0.f, lo1 = 0.f;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        float g0, g1;
        gate_pair_log2<X>(gs, row0 + r, pk, L.pg, false, gate_bytes, g0, g1);
        t0 += g0;
        t1 += g1;
        cum0[r] = t0;
        cum1[r] = t1;
        hi0 = r == 0 ? t0 : fmaxf(hi0, t0);
        lo0 = r == 0 ? t0 : fminf(lo0, t0);
        hi1 = r == 0 ? t1 : fmaxf(hi1, t1);
        lo1 = r == 0 ? t1 : fminf(lo1, t1);
        e0[r] = fast_exp2(g0);
        e1[r] = fast_exp2(g1);
      }
      *reinterpret_cast<float2*>(half_total + warp * kSlice + pk) = make_float2(t0, t1);
      // c_r - c_7 (row 7 is the lower half's last): cum - t in the lower half, cum in the upper.
      const float p0 = upper ? 0.f : t0, p1 = upper ? 0.f : t1;
      const bool in_range = hi0 - p0 <= kOnePivotRange && p0 - lo0 <= kOnePivotRange &&
                            hi1 - p1 <= kOnePivotRange && p1 - lo1 <= kOnePivotRange;
      // The whole CTA takes one form of this slice's diagonal (false for a NaN or infinite gate).
      one_pivot = __syncthreads_and(in_range);
      const float2 other = *reinterpret_cast<const float2*>(half_total + (warp ^ 1) * kSlice + pk);
      if (!upper) *reinterpret_cast<float2*>(tot + (warp >> 1) * kSlice + pk) = make_float2(t0 + other.x, t1 + other.y);
      // qloc = q 2^{c_t}: the upper half starts from the lower half's decay; kloc = k 2^{Tot - c_s}:
      // the lower half starts from the upper half's.
      float fq0 = upper ? fast_exp2(other.x) : 1.f, fq1 = upper ? fast_exp2(other.y) : 1.f;
      float fk0 = upper ? 1.f : fast_exp2(other.x), fk1 = upper ? 1.f : fast_exp2(other.y);
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int at = (row0 + r) * L.pq + pk;
        fq0 *= e0[r];
        fq1 *= e1[r];
        const float2 x = X::to_float2(*reinterpret_cast<const uint32_t*>(qs + at));
        *reinterpret_cast<uint32_t*>(qloc + at) = X::pack(x.x * fq0, x.y * fq1);
      }
#pragma unroll
      for (int r = 7; r >= 0; --r) {
        const int at = (row0 + r) * L.pq + pk;
        const float2 x = X::to_float2(*reinterpret_cast<const uint32_t*>(ks + at));
        *reinterpret_cast<uint32_t*>(kloc + at) = X::pack(x.x * fk0, x.y * fk1);
        fk0 *= e0[r];
        fk1 *= e1[r];
      }
      if (one_pivot) {
        // In place, each thread its own entries (after its qloc and kloc read them): q 2^{c_t - c_7}
        // and k 2^{c_7 - c_s} as bf16 high parts over the raw q and k, the low parts in e's space
        // (unused by this form).
        using B16 = Elem<__nv_bfloat16>;
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          const int at = (row0 + r) * L.pq + pk;
          const float d0 = cum0[r] - p0, d1 = cum1[r] - p1;
          const float2 q = X::to_float2(*reinterpret_cast<const uint32_t*>(qs + at));
          const float2 k = X::to_float2(*reinterpret_cast<const uint32_t*>(ks + at));
          const float xq0 = q.x * fast_exp2(d0), xq1 = q.y * fast_exp2(d1);
          const float xk0 = k.x * fast_exp2(-d0), xk1 = k.y * fast_exp2(-d1);
          const uint32_t hq = B16::pack(xq0, xq1), hk = B16::pack(xk0, xk1);
          const float2 rq = B16::to_float2(hq), rk = B16::to_float2(hk);
          *reinterpret_cast<uint32_t*>(qs + at) = hq;
          *reinterpret_cast<uint32_t*>(ks + at) = hk;
          *reinterpret_cast<uint32_t*>(q_low + at) = B16::pack(xq0 - rq.x, xq1 - rq.y);
          *reinterpret_cast<uint32_t*>(k_low + at) = B16::pack(xk0 - rk.x, xk1 - rk.y);
        }
      } else {
#pragma unroll
        for (int r = 0; r < 8; ++r) *reinterpret_cast<float2*>(es + (row0 + r) * L.pe + pk) = make_float2(e0[r], e1[r]);
      }
    }
    __syncthreads();  // e or the copies, the totals, qloc and kloc are written

    // ---- phase 2: the off-diagonal blocks from qloc/kloc, the diagonal blocks from raw q, k ----
    if (warp < 6) offdiag_accumulate<kSlice, X>(oacc, qloc, kloc, L.pq, tot, bi, bj, lane);
    if (prepared.qg != nullptr) {
      // This (key, sub-chunk)'s factors 2^{earlier sub-chunks' totals} and 2^{later ones'}; the
      // first sub-chunk's thread writes the chunk's decay b_last and 2^{b_last}.
      float pre = 0.f, post = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float tj = tot[j * kSlice + ecol];
        if (j < esub) pre += tj;
        if (j > esub) post += tj;
      }
      factors[esub * kSlice + ecol] = fast_exp2(pre);
      factors[(4 + esub) * kSlice + ecol] = fast_exp2(post);
      const int key = sl * kSlice + ecol;
      if (esub == 0 && key < p.K) {
        const float total = pre + post + tot[ecol];
        const int64_t at = (prepared_chunk_slot(p, seq, n, c) * p.H + h) * p.K + key;
        prepared.decay[at] = fast_exp2(total);
        prepared.decay_log2[at] = total;
      }
    }
    if (one_pivot) {
      // A_ii += Q'_i K'_iᵀ over the slice's keys, Q' = q 2^{c_t - c_7} and K' = k 2^{c_7 - c_s} as
      // high + low bf16 parts (hi·hi + hi·lo + lo·hi: ~2^-16 relative per term, like the fp32 form
      // below to within the one rounding of A to 16 bits).
      using B16 = Elem<__nv_bfloat16>;
      const int mi = lane >> 3;
      const int a_at = (16 * tblk + (lane & 7) + (mi & 1) * 8) * L.pq + (mi >> 1) * 8;
      const int b_at = (16 * tblk + tcol + (lane & 7)) * L.pq + mi * 8;
#pragma unroll
      for (int kp = 0; kp < kSlice / 32; ++kp) {
        uint32_t bh[4], bl[4];
        ldsm_x4(bh, ks + b_at + 32 * kp);
        ldsm_x4(bl, k_low + b_at + 32 * kp);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          uint32_t ah[4], al[4];
          ldsm_x4(ah, qs + a_at + 32 * kp + 16 * half);
          ldsm_x4(al, q_low + a_at + 32 * kp + 16 * half);
          B16::mma(tacc, ah, bh[2 * half], bh[2 * half + 1]);
          B16::mma(tacc, ah, bl[2 * half], bl[2 * half + 1]);
          B16::mma(tacc, al, bh[2 * half], bh[2 * half + 1]);
        }
      }
    } else {
      // kf: k_s times the running product of the factors (one multiply per key and row, and the
      // product with q_t is the FMA itself).
      float kf[8];
      int s = sp;
#pragma unroll
      for (int i = 0; i < 17; ++i) {
        if (i == 0 || i == first_rows) {
          s = i == 0 ? sp : 15 - sp;
#pragma unroll
          for (int j = 0; j < 8; j += 2) {
            const float2 kk = X::to_float2(*reinterpret_cast<const uint32_t*>(ks + (dsub * 16 + s) * L.pq + key_col(j)));
            kf[j] = kk.x;
            kf[j + 1] = kk.y;
          }
        }
        const int t = i < first_rows ? sp + i : s + (i - first_rows);
        const int trow = dsub * 16 + t;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          if (t > s) {
            const float2 ee = *reinterpret_cast<const float2*>(es + trow * L.pe + key_col(j));
            kf[j] *= ee.x;
            kf[j + 1] *= ee.y;
          }
          const float2 qq = X::to_float2(*reinterpret_cast<const uint32_t*>(qs + trow * L.pq + key_col(j)));
          sum = fmaf(qq.x, kf[j], sum);
          sum = fmaf(qq.y, kf[j + 1], sum);
        }
#pragma unroll
        for (int o = 4; o >= 1; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (cg == 0) diagonal[trow * 16 + s] += sum;
      }
    }
    if (prepared.qg != nullptr) {
      // qg = qloc 2^{pre}, kg = kloc 2^{post} (the warp-specialised kernel's two roundings), row by
      // row in 16-byte pieces: qg and kg have q's layout, with rows counted like `intra`'s.
      __syncthreads();  // the factors are written, and every read of the stage is done
      // The next slice's loads fly under this pass (it reads qloc, kloc and the factors only).
      if (STAGES == 1 && sl + 1 < slices) issue_slice(sl + 1, 0);
      const int64_t row0 = (seq.batch * p.T + seq.bos + c * kChunk) * p.H + h;
      for (int i = tid; i < 2 * kChunk * (kSlice / 8); i += NT) {
        const bool is_k = i >= kChunk * (kSlice / 8);
        const int piece = is_k ? i - kChunk * (kSlice / 8) : i;
        const int r = piece / (kSlice / 8), col = (piece % (kSlice / 8)) * 8, key = sl * kSlice + col;
        if (r < lo || r >= rows || key >= p.K) continue;
        const uint4 x = *reinterpret_cast<const uint4*>((is_k ? kloc : qloc) + r * L.pq + col);
        const float* f = factors + ((is_k ? 4 : 0) + (r >> 4)) * kSlice + col;
        const uint32_t w[4] = {x.x, x.y, x.z, x.w};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 v = X::to_float2(w[j]);
          o[j] = X::pack(v.x * f[2 * j], v.y * f[2 * j + 1]);
        }
        uint16_t* dst = (is_k ? prepared.kg : prepared.qg) + (row0 + int64_t(r) * p.H) * p.K + key;
        *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
      }
    }
    if (STAGES == 1 && sl + 1 < slices && prepared.qg == nullptr) {
      __syncthreads();  // every read of the stage is done
      issue_slice(sl + 1, 0);
    }
  }
  __syncthreads();  // every read of the factors is done: A goes over them

  // ---- A: zero above the diagonal, the diagonal sums (over the 8 column groups), the off-diagonal blocks ----
  uint16_t* As = reinterpret_cast<uint16_t*>(smem + L.a);
  for (int i = tid; i < kChunk * L.pa / 2; i += NT) {
    const int r = i / (L.pa / 2), cc = (i % (L.pa / 2)) * 2;
    if (cc >= (r & ~15)) reinterpret_cast<uint32_t*>(As)[i] = 0u;  // the diagonal blocks and right of them
  }
  __syncthreads();
  if (warp < 6) offdiag_store<X>(As, L.pa, oacc, bi, bj, lane);
  __syncthreads();
  // Plus the tensor-core part, rounded to 16 bits once.
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = (lane >> 2) + 8 * (e >> 1), s = tcol + 2 * (lane & 3) + (e & 1);
    if (t >= s) {
      As[(16 * tblk + t) * L.pa + 16 * tblk + s] = X::from_float(tacc[e] + diagonal[(16 * tblk + t) * 16 + s]);
    }
  }
  __syncthreads();

  // Rows of A (64 values, 8 pieces of 16 bytes) to global memory.
  for (int i = tid + lo * 8; i < rows * 8; i += NT) {
    const int r = i >> 3, piece = i & 7;
    uint16_t* dst = intra + ((seq.batch * p.T + seq.bos + c * kChunk + r) * p.H + h) * kChunk + piece * 8;
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(As + r * L.pa + piece * 8);
  }
}

template <typename E, int GATE_BYTES>
cudaError_t run_intra(const ForwardParams& p, int64_t max_chunks, uint16_t* intra, const PreparedInputs& prepared,
                      cudaStream_t stream) {
  const IntraSmem L = intra_smem_layout(kIntraStagesFor<GATE_BYTES>, GATE_BYTES);
  if (const cudaError_t err = allow_dynamic_shared_memory<chunk_intra_kernel<E, GATE_BYTES>>(L.total); err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(p.N * max_chunks), static_cast<unsigned>(p.H));
  chunk_intra_kernel<E, GATE_BYTES><<<grid, kIntraThreads, L.total, stream>>>(p, intra, max_chunks, prepared);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_intra_matrix(const ForwardParams& p, int64_t max_chunks, uint16_t* intra,
                                const PreparedInputs& prepared, cudaStream_t stream) {
  if (p.N == 0 || p.H == 0 || max_chunks == 0) return cudaSuccess;
  const bool f32_gate = p.gate_dtype == kF32;
  if (p.dtype == kBF16) {
    return f32_gate ? run_intra<__nv_bfloat16, 4>(p, max_chunks, intra, prepared, stream)
                    : run_intra<__nv_bfloat16, 2>(p, max_chunks, intra, prepared, stream);
  }
  return f32_gate ? run_intra<__half, 4>(p, max_chunks, intra, prepared, stream)
                  : run_intra<__half, 2>(p, max_chunks, intra, prepared, stream);
}

}  // namespace gla::cuda::detail
