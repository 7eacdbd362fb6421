// Per-chunk steps of the backward: dS, dv, the intra- and inter-chunk parts of dq, dk and dg.
// Part of kernels.inl.
// Tiles: q, k, b [L x K]; v, do [L x V] (ld = their width); A, dA [L x C] with ld C. Scratch
// pointers are sized by the callers' layouts (scratch_layout.inl).

// Rows 2^(b_t) and 2^(b_last - b_t) (L x K each), when a caller has them for several stages.
struct DecayRows {
  const float* from_start = nullptr;
  const float* to_end = nullptr;
};
// x[i] * f[i] * s over K floats.
inline void scale_rows_by(int64_t K, const float* x, const float* f, float s, float* out) {
  for_vectors(K, [&](int64_t c, int lanes) {
    vstore_k(out + c, vmul(vmul(vload_k(x + c, lanes), vload_k(f + c, lanes)), vset(s)), lanes);
  });
}

// dS (K x V) <- Diag(2^b_last) dS + (scale q ⊙ 2^b)^T do.  qs: L x K, fac: K scratch.
inline void dstate_step(int64_t L, int64_t K, int64_t V, float scale, const float* q, const Gates& g, const float* dout,
                        float* dS, float* qs, float* fac, const DecayRows& d = {}) {
  for (int64_t r = 0; r < L; ++r) {
    if (d.from_start) {
      scale_rows_by(K, q + r * K, d.from_start + r * K, scale, qs + r * K);
    } else {
      scale_exp2_rows(g, q + r * K, r, -1, scale, qs + r * K);
    }
  }
  exp2_rows(g, L - 1, -1, fac);
  gemm(K, V, L, qs, 1, K, dout, V, dS, V, true, fac);  // dS = Diag(2^b_last) dS + qs^T do
}

// dv (L x V) = A^T do + (k ⊙ 2^(b_last - b)) dS_end.  kl: L x K scratch.
inline void chunk_dv(int64_t L, int64_t K, int64_t V, int64_t C, const float* k, const Gates& g, const float* A,
                     const float* dout, const float* dS, float* dv, float* kl, const DecayRows& d = {}) {
  for (int64_t r = 0; r < L; ++r) {
    if (d.to_end) {
      scale_rows_by(K, k + r * K, d.to_end + r * K, 1.0f, kl + r * K);
    } else {
      scale_exp2_rows(g, k + r * K, L - 1, r, 1.0f, kl + r * K);
    }
  }
  gemm(L, V, K, kl, K, 1, dS, V, dv, V, false);
  const int64_t nsub = (L + kSub - 1) / kSub;
  for (int64_t j = 0; j < nsub; ++j) {
    const int64_t r0 = j * kSub, nj = std::min(kSub, L - r0);
    // rows s of sub-chunk j: sum over t >= r0 of A[t][s] do_t (A is zero above the diagonal)
    gemm(nj, V, L - r0, A + r0 * C + r0, 1, C, dout + r0 * V, V, dv + r0 * V, V, true);
  }
}

struct DqkScratch {
  float* kp;   // C x K: keys scaled to the query pivot (row-major)
  float* qr;   // C x K: queries scaled to the key pivot (row-major)
  float* tmp;  // C x K
  float* fac;  // K
  float* w;    // K (diagonal weights when not precomputed)
};

// Intra-chunk parts of dq and dk, added into dq, dk (L x K), without the self terms s = t:
//   dq_t += sum_{s < t} dA[t][s] k_s 2^(b_t - b_s),  dk_s += sum_{t > s} dA[t][s] q_t 2^(b_t - b_s).
// The self terms (add_self_terms) cancel exactly in dg's q⊙dq - k⊙dk, and under strong decay they
// are most of dq and dk: leaving them out until dg is formed keeps dg's relative error at fp32
// rounding (with them, 2.6e-5 at g down to -20; without, ~1e-6).
// dq pivots at the first row of the query sub-chunk, dk at the last row of the key sub-chunk; the
// diagonal blocks use `wd` from intra_attention when given, else recompute the weights.
inline void intra_dqk(int64_t L, int64_t K, int64_t C, const float* q, const float* k, const Gates& g, const float* dA,
                      const float* wd, float* dq, float* dk, const DqkScratch& s) {
  const int64_t nsub = (L + kSub - 1) / kSub;
  if (wd) {
    // The same products with the pivot factors derived from the diagonal blocks' factors (one exp2
    // row per pivot level instead of one per row; see derive_key_rows): ~45 exp2 rows per chunk
    // instead of ~200. f: kSub x K of factor rows (tmp's rows past the products' kSub).
    float* f = s.tmp + kSub * K;
    for (int64_t i = 1; i < nsub; ++i) {
      const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0), old = r0 - kSub;
      if (old > 0) {
        exp2_rows(g, r0, old, s.fac);
        for (int64_t r = 0; r < old; ++r) mul_inplace(K, s.kp + r * K, s.fac);
      }
      derive_key_rows(kSub, K, g, old, wd + (i - 1) * kDiagRows * K, k + old * K, r0, s.kp + old * K, s.fac);
      gemm(ni, K, r0, dA + r0 * C, C, 1, s.kp, K, s.tmp, K, false);
      derive_query_factors(ni, K, g, r0, wd + i * kDiagRows * K, f, s.fac);
      for (int64_t t = 0; t < ni; ++t) fma_inplace(K, dq + (r0 + t) * K, s.tmp + t * K, f + t * K);
    }
    for (int64_t j = nsub - 2; j >= 0; --j) {
      const int64_t r0 = j * kSub, e = r0 + kSub, pivot = e - 1, next_e = e + kSub;
      if (next_e < L) {
        exp2_rows(g, next_e - 1, pivot, s.fac);
        for (int64_t r = next_e; r < L; ++r) mul_inplace(K, s.qr + r * K, s.fac);
      }
      // new rows: q_r 2^(b_r - b_e) 2^(b_e - b_(e-1)), both factors <= 0
      const int64_t nn = std::min(next_e, L) - e;
      derive_query_factors(nn, K, g, e, wd + (j + 1) * kDiagRows * K, f, s.fac);
      exp2_rows(g, e, pivot, s.w);
      for (int64_t r = 0; r < nn; ++r) {
        scaled_rows(1, K, q + (e + r) * K, f + r * K, 1.0f, s.qr + (e + r) * K);
        mul_inplace(K, s.qr + (e + r) * K, s.w);
      }
      gemm(kSub, K, L - e, dA + e * C + r0, 1, C, s.qr + e * K, K, s.tmp, K, false);
      derive_key_factors(kSub, K, g, r0, wd + j * kDiagRows * K, pivot, f, s.fac);
      for (int64_t u = 0; u < kSub; ++u) fma_inplace(K, dk + (r0 + u) * K, s.tmp + u * K, f + u * K);
    }
  }
  // dq, off-diagonal: kp holds k_s 2^(p_i - b_s) for s < r0, updated incrementally.
  for (int64_t i = 1; i < nsub && !wd; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0), old = r0 - kSub;
    const int64_t pivot = r0;
    if (old > 0) {
      exp2_rows(g, pivot, old, s.fac);
      for (int64_t r = 0; r < old; ++r) mul_inplace(K, s.kp + r * K, s.fac);
    }
    for (int64_t r = old; r < r0; ++r) scale_exp2_rows(g, k + r * K, pivot, r, 1.0f, s.kp + r * K);
    gemm(ni, K, r0, dA + r0 * C, C, 1, s.kp, K, s.tmp, K, false);
    for (int64_t t = 0; t < ni; ++t) {
      exp2_rows(g, r0 + t, pivot, s.fac);
      fma_inplace(K, dq + (r0 + t) * K, s.tmp + t * K, s.fac);
    }
  }
  // dk, off-diagonal: for key sub-chunk j, queries t >= e_j = (j+1) kSub, pivot r_j = b at the last
  // row of sub-chunk j; qr holds q_t 2^(b_t - r_j), updated incrementally going down in j.
  for (int64_t j = nsub - 2; j >= 0 && !wd; --j) {
    const int64_t r0 = j * kSub, e = r0 + kSub;
    const int64_t pivot = e - 1;
    const int64_t next_e = e + kSub;  // rows already in qr (from pivot j + 1) start at next_e
    if (next_e < L) {
      exp2_rows(g, next_e - 1, pivot, s.fac);
      for (int64_t r = next_e; r < L; ++r) mul_inplace(K, s.qr + r * K, s.fac);
    }
    for (int64_t r = e; r < std::min(next_e, L); ++r) scale_exp2_rows(g, q + r * K, r, pivot, 1.0f, s.qr + r * K);
    // tmp[s] = sum_{t >= e} dA[t][s] qr_t, s in sub-chunk j
    gemm(kSub, K, L - e, dA + e * C + r0, 1, C, s.qr + e * K, K, s.tmp, K, false);
    for (int64_t u = 0; u < kSub; ++u) {
      exp2_rows(g, pivot, r0 + u, s.fac);
      fma_inplace(K, dk + (r0 + u) * K, s.tmp + u * K, s.fac);
    }
  }
  // diagonal blocks: through the pivots of diagonal_block_pivoted when its factors are given
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    if (wd) {
      diagonal_dqk_pivoted(ni, K, C, q + r0 * K, k + r0 * K, dA + r0 * C + r0, wd + i * kDiagRows * K, dq + r0 * K,
                           dk + r0 * K, s.tmp, s.tmp + kSub * K);
      continue;
    }
    for (int64_t t = 0; t < ni; ++t) {
      const float* qt = q + (r0 + t) * K;
      float* dqt = dq + (r0 + t) * K;
      for (int64_t u = 0; u < t; ++u) {
        const float* ks = k + (r0 + u) * K;
        float* dks = dk + (r0 + u) * K;
        const vf a = vset(dA[(r0 + t) * C + r0 + u]);
        for_vectors(K, [&](int64_t c, int lanes) {
          const vf ae = vmul(a, vexp2(gate_diff(g, r0 + t, r0 + u, c, lanes)));
          vstore_k(dqt + c, vfma(ae, vload_k(ks + c, lanes), vload_k(dqt + c, lanes)), lanes);
          vstore_k(dks + c, vfma(ae, vload_k(qt + c, lanes), vload_k(dks + c, lanes)), lanes);
        });
      }
    }
  }
}

// dq_t += dA[t][t] k_t, dk_t += dA[t][t] q_t (the terms intra_dqk leaves out).
inline void add_self_terms(int64_t L, int64_t K, int64_t C, const float* q, const float* k, const float* dA, float* dq,
                           float* dk) {
  for (int64_t t = 0; t < L; ++t) {
    const vf a = vset(dA[t * C + t]);
    for_vectors(K, [&](int64_t c, int lanes) {
      vstore_k(dq + t * K + c, vfma(a, vload_k(k + t * K + c, lanes), vload_k(dq + t * K + c, lanes)), lanes);
      vstore_k(dk + t * K + c, vfma(a, vload_k(q + t * K + c, lanes), vload_k(dk + t * K + c, lanes)), lanes);
    });
  }
}

struct InterScratch {
  float* st;    // V x K: S_c transposed
  float* dst;   // V x K: dS_end transposed
  float* tmp;   // L x K
  float* e;     // L x K
  float* base;  // K
  double* acc;  // K
};

// St: the chunk-start state transposed (V x K).
// Inter-chunk parts: dq += scale 2^b ⊙ (do S_c^T), dk += dk_inter = 2^(b_last - b) ⊙ (v dS^T); and
// dg (L x K, when non-null). SPEC's form is
//   dg_u = sum_{t >= u} (q_t⊙dq_t - k_t⊙dk_t) + 2^b_last ⊙ rowsum(S_c ⊙ dS) + sum_s k_s⊙dk_inter_s,
// where the k⊙dk_inter terms of the first sum cancel those of the last for s >= u: under strong
// decay they are ~1000x dg and cancelling them in fp32 cost ~1e-5 relative error. So dg is formed
// as the equal sum_{t >= u} (q_t⊙dq_t - k_t⊙dk_intra_t) + sum_{s < u} k_s⊙dk_inter_s
// + 2^b_last ⊙ rowsum(S_c ⊙ dS), both running sums in fp64. On entry dq and dk hold the intra parts.
inline void inter_dqkg(int64_t L, int64_t K, int64_t V, float scale, const float* q, const float* k, const float* v,
                       const Gates& g, const float* dout, const float* St, const float* dS, float* dq, float* dk,
                       float* dg, const InterScratch& s, const DecayRows& d = {}) {
  transpose(K, V, dS, V, s.dst, K);
  // rowsum(S_c ⊙ dS) for dg, from the transposed tiles: column sums of St ⊙ dS^T, into s.e's first
  // row. With the decay rows given (s.e otherwise unused) it goes first: St, written in pass 1 and
  // out of cache since, is then read front to back once (prefetcher-friendly) before the dq
  // product reads it in panels.
  float* rs = s.e;
  const bool rs_first = dg && d.from_start && d.to_end;
  const auto rowsum = [&] {
    std::memset(rs, 0, static_cast<size_t>(K) * 4);
    for (int64_t vv = 0; vv < V; ++vv) fma_inplace(K, rs, St + vv * K, s.dst + vv * K);
  };
  if (rs_first) rowsum();
  // dq
  gemm(L, K, V, dout, V, 1, St, K, s.tmp, K, false);
  for (int64_t r = 0; r < L; ++r) {
    const float* e = d.from_start ? d.from_start + r * K : s.e + r * K;
    if (!d.from_start) exp2_rows(g, r, -1, s.e + r * K);
    for_vectors(K, [&](int64_t c, int lanes) {
      const vf x = vmul(vmul(vload_k(s.tmp + r * K + c, lanes), vload_k(e + c, lanes)), vset(scale));
      vstore_k(dq + r * K + c, vadd(vload_k(dq + r * K + c, lanes), x), lanes);
    });
  }
  // dk_inter into tmp
  gemm(L, K, V, v, V, 1, s.dst, K, s.tmp, K, false);
  for (int64_t r = 0; r < L; ++r) {
    if (d.to_end) {
      mul_inplace(K, s.tmp + r * K, d.to_end + r * K);
    } else {
      exp2_rows(g, L - 1, r, s.e + r * K);
      mul_inplace(K, s.tmp + r * K, s.e + r * K);
    }
  }
  if (dg) {
    if (!rs_first) rowsum();
    exp2_rows(g, L - 1, -1, s.base);
    mul_inplace(K, s.base, rs);
    double* __restrict acc = s.acc;
    const float* __restrict base = s.base;
    for (int64_t kk = 0; kk < K; ++kk) acc[kk] = 0.0;
    for (int64_t r = L - 1; r >= 0; --r) {
      const float *__restrict qr = q + r * K, *__restrict dqr = dq + r * K;
      const float *__restrict kr = k + r * K, *__restrict dkr = dk + r * K;
      float* __restrict out = dg + r * K;
      for (int64_t kk = 0; kk < K; ++kk) {
        acc[kk] += static_cast<double>(qr[kk]) * dqr[kk] - static_cast<double>(kr[kk]) * dkr[kk];
        out[kk] = static_cast<float>(acc[kk]);
      }
    }
    for (int64_t kk = 0; kk < K; ++kk) acc[kk] = 0.0;
    for (int64_t r = 0; r < L; ++r) {
      const float *__restrict kr = k + r * K, *__restrict ir = s.tmp + r * K;
      float* __restrict out = dg + r * K;
      for (int64_t kk = 0; kk < K; ++kk) {
        out[kk] = static_cast<float>(static_cast<double>(out[kk]) + acc[kk] + base[kk]);
        acc[kk] += static_cast<double>(kr[kk]) * ir[kk];
      }
    }
  }
  for (int64_t r = 0; r < L; ++r) {
    for_vectors(K, [&](int64_t c, int lanes) {
      vstore_k(dk + r * K + c, vadd(vload_k(dk + r * K + c, lanes), vload_k(s.tmp + r * K + c, lanes)), lanes);
    });
  }
}

// dg tile (L x K) into the dg tensor: per-key as is, per-head summed over K.
inline void store_dg(const gla_problem& p, int64_t batch, int64_t t0, int64_t L, int64_t h, const float* dg) {
  if (p.gate_per_head) {
    for (int64_t r = 0; r < L; ++r) {
      float acc = 0.0f;
      for (int64_t i = 0; i < p.K; ++i) acc += dg[r * p.K + i];
      store_row(p.dg, batch * p.dg.strides[0] + (t0 + r) * p.dg.strides[1] + h * p.dg.strides[2], 1, 1, &acc);
    }
    return;
  }
  store_tile(p.dg, batch, t0, L, h, 0, p.K, dg, p.K);
}
