// Per-chunk steps of the forward and the stages: the intra-chunk matrix A, the whole forward of
// one chunk, the chunk output and the state steps. Part of kernels.inl.
// Tiles: q, k, b [L x K]; v, do [L x V] (ld = their width); A, dA [L x C] with ld C. Scratch
// pointers are sized by the callers' layouts (scratch_layout.inl).

struct IntraScratch {
  float* qp;    // kSub x K: query rows scaled to the pivot
  float* kpt;   // K x C: keys scaled to the pivot, transposed (ld C)
  float* krow;  // kSub x K
  float* fac;   // K
  float* kht;   // K x kSub/2
};

// A[t][s] = scale * sum_k q_tk k_sk 2^(b_tk - b_sk) for s <= t < L; 0 for t < s < zero_to.
// Off-diagonal sub-chunk blocks: one product per query sub-chunk i, pivoted at its first row p_i:
// (q_t 2^(b_t - p_i)) . (k_s 2^(p_i - b_s)); the keys' factor for pivot i is the one for pivot i-1
// times 2^(p_i - p_(i-1)). Diagonal blocks by diagonal_block_pivoted, each before the
// off-diagonal product of its rows. With `wd` ([nsub][kDiagRows][K], kept for the caller) the
// pivot-scaled key rows of sub-chunk i - 1 and query rows of sub-chunk i come from the diagonal
// blocks' factors (one exp2 row per level instead of one per row); without it (the stage unit)
// every row is exponentiated. `qkeep` (optional, L x K, needs `wd`) receives the pivot-scaled query
// rows of every sub-chunk (see forward_chunk).
inline void intra_attention(int64_t L, int64_t K, int64_t C, float scale, const float* q, const float* k, const Gates& g,
                            float* A, int64_t zero_to, float* wd, const IntraScratch& s, float* qkeep = nullptr) {
  const int64_t nsub = (L + kSub - 1) / kSub;
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    float* fi = wd ? wd + i * kDiagRows * K : nullptr;
    // Diagonal block first: with `wd`, its factors serve the off-diagonal pivots too.
      if (fi) {
        diagonal_block_bridged(ni, K, C, scale, q + r0 * K, k + r0 * K, g, r0, A + r0 * C + r0, s.qp, s.krow, fi);
      } else {
        diagonal_block_pivoted(ni, K, C, scale, q + r0 * K, k + r0 * K, g, r0, A + r0 * C + r0, s.qp, s.krow, fi);
      }
    float* qp = qkeep ? qkeep + r0 * K : s.qp;
    if (fi && (qkeep || i > 0)) derive_query_rows(ni, K, g, r0, fi, q + r0 * K, scale, qp, s.fac);
    if (i > 0) {
      const int64_t old = r0 - kSub;  // key columns already in kpt (pivot i - 1)
      if (old > 0) {
        exp2_rows(g, r0, old, s.fac);
        for (int64_t kk = 0; kk < K; ++kk) {
          float* row = s.kpt + kk * C;
          const vf f = vset(s.fac[kk]);
          for_vectors(old, [&](int64_t c, int lanes) { vstore_k(row + c, vmul(vload_k(row + c, lanes), f), lanes); });
        }
      }
      if (fi) {
        derive_key_rows(kSub, K, g, old, fi - kDiagRows * K, k + old * K, r0, s.krow, s.fac);
      } else {
        for (int64_t r = 0; r < kSub; ++r) scale_exp2_rows(g, k + (old + r) * K, r0, old + r, 1.0f, s.krow + r * K);
        for (int64_t t = 0; t < ni; ++t) scale_exp2_rows(g, q + (r0 + t) * K, r0 + t, r0, scale, qp + t * K);
      }
      transpose(kSub, K, s.krow, K, s.kpt + old, C);
      gemm(ni, r0, K, qp, K, 1, s.kpt, C, A + r0 * C, C, false);
    }
    // Above the diagonal: with `wd` (the whole operations) only inside the diagonal block, the only
    // entries above the diagonal that their products read (A v causal by sub-chunk, dv's A^T do
    // from each sub-chunk's first row); the stage unit writes whole rows.
    const int64_t zero_end = fi ? std::min(zero_to, r0 + kSub) : zero_to;
    for (int64_t t = 0; t < ni; ++t) {
      for (int64_t u = r0 + t + 1; u < zero_end; ++u) A[(r0 + t) * C + u] = 0.0f;
    }
  }
}

// The whole forward of one chunk: A, o and the state update, sharing exponentials between them.
// Query rows of sub-chunk i are q_t 2^(b_t - p_i) scale from A's pivot, so q_t 2^b_t scale is
// that times 2^(p_i) (<= 0); keys s < p_last are in kpt as k_s 2^(p_last - b_s), so
// k_s 2^(b_last - b_s) is that times 2^(b_last - p_last) (<= 0); the last sub-chunk's keys come
// from its diagonal block's factors. qe: L x K, fac: K scratch, dfac: nsub x kDiagRows x K.
inline void forward_chunk(int64_t L, int64_t K, int64_t bv, int64_t C, float scale, const float* q, const float* k,
                          const Gates& g, const float* v, int64_t ldv, float* S, int64_t lds, float* o, float* A,
                          const IntraScratch& s, float* qe, float* fac, float* dfac) {
  const int64_t nsub = (L + kSub - 1) / kSub;
  intra_attention(L, K, C, scale, q, k, g, A, std::min(C, nsub * kSub), dfac, s, qe);
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    exp2_rows(g, r0, -1, fac);
    for (int64_t t = 0; t < ni; ++t) mul_inplace(K, qe + (r0 + t) * K, fac);
  }
  // o = (scale q ⊙ 2^b) S + A v in one product, A v causal by row tile (o stored once): a tile's
  // rows read keys up to its last row only (A is zero above the diagonal there, inside the
  // diagonal block), not to the end of their sub-chunk.
  static_assert(kSub % kTileRows == 0, "row tiles within sub-chunks");
  {  // (its own scope: seg's stack slot is reused by the state step below)
    const Seg seg[2] = {{K, qe, K, 1, S, lds}, {L, A, C, 1, v, ldv}};
    gemm_segs(L, bv, seg, 2, o, bv, false, nullptr, kTileRows);
  }
  // state: kpt becomes (k ⊙ 2^(b_last - b))^T
  const int64_t last0 = (nsub - 1) * kSub;
  if (last0 > 0) {
    exp2_rows(g, L - 1, last0, fac);
    for (int64_t kk = 0; kk < K; ++kk) {
      float* row = s.kpt + kk * C;
      const vf f = vset(fac[kk]);
      for_vectors(last0, [&](int64_t c, int lanes) { vstore_k(row + c, vmul(vload_k(row + c, lanes), f), lanes); });
    }
  }
  derive_key_rows(L - last0, K, g, last0, dfac + (nsub - 1) * kDiagRows * K, k + last0 * K, L - 1, s.krow, s.fac);
  transpose(L - last0, K, s.krow, K, s.kpt + last0, C);
  exp2_rows(g, L - 1, -1, fac);
  gemm(K, bv, L, s.kpt, C, 1, v, ldv, S, lds, true, fac);  // S = Diag(2^b_last) S + kl^T v
}

// dA[t][s] = scale * do_t . v_s for s <= t < L; 0 for t < s < zero_to. vt: V x C scratch.
inline void intra_dA(int64_t L, int64_t V, int64_t C, float scale, const float* dout, const float* v, float* dA,
                     int64_t zero_to, float* vt) {
  transpose(L, V, v, V, vt, C);
  const int64_t nsub = (L + kSub - 1) / kSub;
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    gemm(ni, r0 + ni, V, dout + r0 * V, V, 1, vt, C, dA + r0 * C, C, false);
    for (int64_t t = 0; t < ni; ++t) {
      float* row = dA + (r0 + t) * C;
      for (int64_t u = 0; u <= r0 + t; ++u) row[u] *= scale;
      for (int64_t u = r0 + t + 1; u < zero_to; ++u) row[u] = 0.0f;
    }
  }
}

// o (L x bv) = scale (q ⊙ 2^b) S + A v.  qe: L x K scratch.
inline void chunk_output(int64_t L, int64_t K, int64_t bv, int64_t C, float scale, const float* q, const Gates& g,
                         const float* S, const float* A, const float* v, float* o, float* qe) {
  for (int64_t r = 0; r < L; ++r) scale_exp2_rows(g, q + r * K, r, -1, scale, qe + r * K);
  gemm(L, bv, K, qe, K, 1, S, bv, o, bv, false);
  const int64_t nsub = (L + kSub - 1) / kSub;
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    gemm(ni, bv, r0 + ni, A + r0 * C, C, 1, v, bv, o + r0 * bv, bv, true);
  }
}

// S_out (K x bv) = Diag(2^b_last) S_in + (k ⊙ 2^(b_last - b))^T v; S_out may be S_in.
// kl: L x K, fac: K scratch.
inline void state_step(int64_t L, int64_t K, int64_t bv, const float* k, const Gates& g, const float* v,
                       const float* S_in, float* S_out, float* kl, float* fac) {
  for (int64_t r = 0; r < L; ++r) scale_exp2_rows(g, k + r * K, L - 1, r, 1.0f, kl + r * K);
  exp2_rows(g, L - 1, -1, fac);
  for (int64_t kk = 0; kk < K; ++kk) {
    const float* src = S_in + kk * bv;
    float* dst = S_out + kk * bv;
    const vf f = vset(fac[kk]);
    for_vectors(bv, [&](int64_t c, int lanes) { vstore_k(dst + c, vmul(vload_k(src + c, lanes), f), lanes); });
  }
  gemm(K, bv, L, kl, 1, K, v, bv, S_out, bv, true);
}

// The same step on the transposed state (V x K): St_out = St_in Diag(2^b_last) + v^T (k ⊙ 2^(b_last - b)).
// The backward keeps its chunk-start states this way: its only use of them, do S_c^T in dq and
// rowsum(S_c ⊙ dS) in dg, reads them transposed, so no 128 x 128 transpose per chunk.
inline void state_step_transposed(int64_t L, int64_t K, int64_t V, const float* k, const Gates& g, const float* v,
                                  const float* St_in, float* St_out, float* kl, float* fac) {
  for (int64_t r = 0; r < L; ++r) scale_exp2_rows(g, k + r * K, L - 1, r, 1.0f, kl + r * K);
  exp2_rows(g, L - 1, -1, fac);
  for (int64_t vv = 0; vv < V; ++vv) {
    const float* src = St_in + vv * K;
    float* dst = St_out + vv * K;
    for_vectors(K, [&](int64_t c, int lanes) { vstore_k(dst + c, vmul(vload_k(src + c, lanes), vload_k(fac + c, lanes)), lanes); });
  }
  gemm(V, K, L, v, 1, V, kl, K, St_out, K, true);
}
