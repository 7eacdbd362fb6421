// The diagonal 16 x 16 blocks of the intra-chunk matrix A and the pivot factors they share with
// the off-diagonal blocks. Part of kernels.inl.
// Tiles: q, k, b [L x K]; v, do [L x V] (ld = their width); A, dA [L x C] with ld C. Scratch
// pointers are sized by the callers' layouts (scratch_layout.inl).

// Diagonal 16 x 16 blocks, pivoted recursively with every exponent <= 0 (SPEC section 3):
//   rows [8, 16) x keys [0, 8) through row 8: (q_t 2^(b_t - b_8)) . (k_u 2^(b_8 - b_u));
//   in each half [h, h + 8), rows [h + 4, h + 8) x keys [h, h + 4) through row h + 4;
//   the four 4 x 4 triangles left: their 24 pairs u < t element-wise (a K-vector of exp2 each), the
//   diagonal u = t without exp2 (its weight 2^0 is 1).
// 53 exp2 rows per block instead of the 136 (element-wise) or 88 (one pivot level) before. The
// whole operations keep the factors (kDiagRows rows of K per block, layout below): the
// off-diagonal pivots are derived from them (derive_key_rows, derive_query_rows), and the backward's
// dq and dk go through the same pivots: dq_t += 2^(b_t - p) ⊙ sum_u dA[t][u] (k_u 2^(p - b_u)),
// dk_u += 2^(p - b_u) ⊙ sum_t dA[t][u] (q_t 2^(b_t - p)).
inline constexpr int64_t kHalf = kSub / 2, kQuarter = kSub / 4;
// Factor rows of one block: [0, 8) 2^(b_t - b_8), t = 8..15; [8, 16) 2^(b_8 - b_u), u = 0..7;
// per half h (0, 1) at 16 + 8h: [0, 4) 2^(b_t - b_(8h+4)), t = 8h+4..8h+7; [4, 8) 2^(b_(8h+4) - b_u),
// u = 8h..8h+3; at 32: the pairs u < t of each 4 x 4 triangle, 6 per triangle, (t%4)(t%4-1)/2 + u%4.
inline constexpr int64_t kQuarterPairs = kQuarter * (kQuarter - 1) / 2;  // pairs u < t of a triangle
inline constexpr int64_t kDiagPairs = 4 * kHalf;                          // first pair row
inline constexpr int64_t kDiagRows = kDiagPairs + 4 * kQuarterPairs;

// out = x * s over K floats (the pivot row of a pivoted block: its factor 2^0 is exactly 1).
inline void scale_row(int64_t K, const float* x, float s, float* out) {
  for_vectors(K, [&](int64_t c, int lanes) { vstore_k(out + c, vmul(vload_k(x + c, lanes), vset(s)), lanes); });
}
inline void fill_ones(int64_t K, float* out) {
  for (int64_t i = 0; i < K; ++i) out[i] = 1.0f;
}
// out[m] = mul * vsum(x[m]) for m < n <= 4.
inline void sums_of_4(const vf* x, int n, float mul, float* out) {
#ifdef GLA_CPU_HAVE_VSUM4
  vsum4(x[0], n > 1 ? x[1] : vzero(), n > 2 ? x[2] : vzero(), n > 3 ? x[3] : vzero(), mul, out, n);
#else
  for (int m = 0; m < n; ++m) out[m] = mul * vsum(x[m]);
#endif
}
// Dot products of rows qs[t] (t < nq) with the 4 rows ks[u] over K:
// a[t * lda + u] = mul * (qs[t] . ks[u]). The 4 is a compile-time count: with a run-time one the
// accumulators lived on the stack and every vector step tested it.
inline void dot_rows(int64_t nq, int64_t K, const float* qs, const float* ks, float mul, float* a, int64_t lda) {
  constexpr int kKeys = static_cast<int>(kQuarter);
  for (int64_t t = 0; t < nq; ++t) {
    vf acc[kKeys];
    for (int m = 0; m < kKeys; ++m) acc[m] = vzero();
    for_vectors(K, [&](int64_t c, int lanes) {
      const vf qv = vload_k(qs + t * K + c, lanes);
      for (int m = 0; m < kKeys; ++m) acc[m] = vfma(qv, vload_k(ks + m * K + c, lanes), acc[m]);
    });
    sums_of_4(acc, kKeys, mul, a + t * lda);
  }
}
// One row t of a 4 x 4 triangle of a diagonal block, NK = t % 4 pairs u < t element-wise (their
// weights 2^(b_t - b_u) stored at w when StoreW), then the diagonal u = t (weight 1):
// arow[m] = scale * sum_k q_t k_(u0+m) 2^(b_t - b_(u0+m)), m <= NK. k0, rb: the triangle's first
// key row and its row in the chunk (for g). NK is a template argument for the same reason as
// dot_rows's 4.
// With StoreW (the whole operations, which keep the weights), only the pair with the row above,
// 2^(b_t - b_(t-1)), is exponentiated; the others are it times the row above's weights,
// 2^(b_t - b_u) = 2^(b_t - b_(t-1)) 2^(b_(t-1) - b_u), both exponents <= 0: 12 exp2 rows per block
// instead of 24, the weights within ~3 ulp (grid errors unchanged).
template <int NK, bool StoreW>
inline void triangle_row(int64_t K, const float* qt, const Gates& g, int64_t rt, int64_t rb, const float* k0, float* w,
                         float scale, float* arow) {
  const float* bth = g.hi + rt * K;
  const float* btl = g.lo + rt * K;
  const float* above = StoreW ? w - (NK - 1) * K : nullptr;  // row t - 1's NK - 1 weights
  vf acc[NK + 1];
  for (int m = 0; m <= NK; ++m) acc[m] = vzero();
  for_vectors(K, [&](int64_t c, int lanes) {
    const vf qv = vload_k(qt + c, lanes), bh = vload_k(bth + c, lanes), bl = vload_k(btl + c, lanes);
    if constexpr (StoreW && NK > 0) {
      constexpr int m1 = NK - 1;
      const vf x = vadd(vsub(bh, vload_k(g.hi + (rb + m1) * K + c, lanes)), vsub(bl, vload_k(g.lo + (rb + m1) * K + c, lanes)));
      const vf d = vexp2(x);
      for (int m = 0; m < NK; ++m) {
        const vf e = m == m1 ? d : vmul(d, vload_k(above + m * K + c, lanes));
        vstore_k(w + m * K + c, e, lanes);
        acc[m] = vfma(vmul(qv, vload_k(k0 + m * K + c, lanes)), e, acc[m]);
      }
    }
    for (int m = 0; m < NK && !StoreW; ++m) {
      const vf x = vadd(vsub(bh, vload_k(g.hi + (rb + m) * K + c, lanes)), vsub(bl, vload_k(g.lo + (rb + m) * K + c, lanes)));
      const vf e = vexp2(x);
      acc[m] = vfma(vmul(qv, vload_k(k0 + m * K + c, lanes)), e, acc[m]);
    }
    acc[NK] = vfma(qv, vload_k(k0 + NK * K + c, lanes), acc[NK]);
  });
  sums_of_4(acc, NK + 1, scale, arow);
}
// The four 4 x 4 triangles of a diagonal block (rows and keys [0, n)), pair weights into wp when
// given (layout: kDiagPairs below).
template <bool StoreW>
inline void diagonal_triangles(int64_t n, int64_t K, int64_t C, float scale, const float* q, const float* k,
                               const Gates& g, int64_t r0, float* a, float* wp) {
  static_assert(kQuarter == 4, "triangle rows are written out for 4 x 4 triangles");
  for (int64_t t = 0; t < n; ++t) {
    const int64_t u0 = t & ~(kQuarter - 1);
    const int64_t nk = t - u0;  // pairs with exp2; then the diagonal
    float* w = StoreW ? wp + ((u0 / kQuarter) * kQuarterPairs + nk * (nk - 1) / 2) * K : nullptr;
    const float* qt = q + t * K;
    float* arow = a + t * C + u0;
    switch (nk) {
      case 0: triangle_row<0, StoreW>(K, qt, g, r0 + t, r0 + u0, k + u0 * K, w, scale, arow); break;
      case 1: triangle_row<1, StoreW>(K, qt, g, r0 + t, r0 + u0, k + u0 * K, w, scale, arow); break;
      case 2: triangle_row<2, StoreW>(K, qt, g, r0 + t, r0 + u0, k + u0 * K, w, scale, arow); break;
      default: triangle_row<3, StoreW>(K, qt, g, r0 + t, r0 + u0, k + u0 * K, w, scale, arow); break;
    }
  }
}
// x rows scaled by factor rows (and s): out[r] = x[r] * f[r] * s, r < n.
inline void scaled_rows(int64_t n, int64_t K, const float* x, const float* f, float s, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    for_vectors(K, [&](int64_t c, int lanes) {
      vstore_k(out + r * K + c, vmul(vmul(vload_k(x + r * K + c, lanes), vload_k(f + r * K + c, lanes)), vset(s)), lanes);
    });
  }
}
// A pivot product of the gradients (nj <= kHalf): out[i] += f[i] ⊙ sum_{j < nj}
// coef[i * rsc + j * csc] x[j], i < ni.
inline void pivot_accumulate(int64_t ni, int64_t nj, int64_t K, const float* coef, int64_t rsc, int64_t csc,
                             const float* x, const float* f, float* out) {
  for (int64_t i = 0; i < ni; ++i) {
    vf cj[kHalf];
    for (int64_t j = 0; j < nj; ++j) cj[j] = vset(coef[i * rsc + j * csc]);
    for_vectors(K, [&](int64_t c, int lanes) {
      vf acc = vmul(cj[0], vload_k(x + c, lanes));
      for (int64_t j = 1; j < nj; ++j) acc = vfma(cj[j], vload_k(x + j * K + c, lanes), acc);
      vstore_k(out + i * K + c, vfma(vload_k(f + i * K + c, lanes), acc, vload_k(out + i * K + c, lanes)), lanes);
    });
  }
}

// The lower triangle (keys u <= t < n <= kSub) of one diagonal block of A; q, k: the block's first
// row; r0: its row within the chunk (for g); a: A at the block's corner. `fac` (optional,
// kDiagRows x K) receives the factors for the backward. qs, ks: kSub x K scratch each.
inline void diagonal_block_pivoted(int64_t n, int64_t K, int64_t C, float scale, const float* q, const float* k,
                                   const Gates& g, int64_t r0, float* a, float* qs, float* ks, float* fac) {
  // rows [8, n) x keys [0, 8)
  if (n > kHalf) {
    const int64_t pivot = r0 + kHalf;
    if (fac) {
      fill_ones(K, fac);
      for (int64_t t = kHalf + 1; t < n; ++t) exp2_rows(g, r0 + t, pivot, fac + (t - kHalf) * K);
      for (int64_t u = 0; u < kHalf; ++u) exp2_rows(g, pivot, r0 + u, fac + (kHalf + u) * K);
      scaled_rows(n - kHalf, K, q + kHalf * K, fac, scale, qs);
      scaled_rows(kHalf, K, k, fac + kHalf * K, 1.0f, ks);
    } else {
      scale_row(K, q + kHalf * K, scale, qs);
      for (int64_t t = kHalf + 1; t < n; ++t) scale_exp2_rows(g, q + t * K, r0 + t, pivot, scale, qs + (t - kHalf) * K);
      for (int64_t u = 0; u < kHalf; ++u) scale_exp2_rows(g, k + u * K, pivot, r0 + u, 1.0f, ks + u * K);
    }
    dot_rows(n - kHalf, K, qs, ks, 1.0f, a + kHalf * C, C);
    dot_rows(n - kHalf, K, qs, ks + kQuarter * K, 1.0f, a + kHalf * C + kQuarter, C);
  }
  // in each half h: rows [h + 4, min(h + 8, n)) x keys [h, h + 4)
  for (int64_t h = 0; h + kQuarter < n; h += kHalf) {
    const int64_t m = h + kQuarter, nq = std::min(h + kHalf, n) - m, pivot = r0 + m;
    if (fac) {
      float* f = fac + (2 * kHalf + h) * K;
      fill_ones(K, f);
      for (int64_t t = 1; t < nq; ++t) exp2_rows(g, pivot + t, pivot, f + t * K);
      for (int64_t u = 0; u < kQuarter; ++u) exp2_rows(g, pivot, r0 + h + u, f + (kQuarter + u) * K);
      scaled_rows(nq, K, q + m * K, f, scale, qs);
      scaled_rows(kQuarter, K, k + h * K, f + kQuarter * K, 1.0f, ks);
    } else {
      scale_row(K, q + m * K, scale, qs);
      for (int64_t t = 1; t < nq; ++t) scale_exp2_rows(g, q + (m + t) * K, pivot + t, pivot, scale, qs + t * K);
      for (int64_t u = 0; u < kQuarter; ++u) scale_exp2_rows(g, k + (h + u) * K, pivot, r0 + h + u, 1.0f, ks + u * K);
    }
    dot_rows(nq, K, qs, ks, 1.0f, a + m * C + h, C);
  }
  // the 4 x 4 triangles, element-wise
  if (fac) {
    diagonal_triangles<true>(n, K, C, scale, q, k, g, r0, a, fac + kDiagPairs * K);
  } else {
    diagonal_triangles<false>(n, K, C, scale, q, k, g, r0, a, nullptr);
  }
}

// diagonal_block_pivoted with `fac`, the pivot levels' factors derived from the triangles' pair
// weights instead of exponentiated: 2^(x - y) = 2^(x - z) 2^(z - y) with y <= z <= x, all factors
// <= 0. Triangles first; then in each half h the queries' factors 2^(b_t - b_(h+4)) are the pairs
// (t, h+4) of the triangle at h+4, and the keys' 2^(b_(h+4) - b_u) are one exp2 row
// 2^(b_(h+4) - b_(h+3)) times the pairs (h+3, u); at the 8-level, queries t < 12 are the pairs
// (t, 8), t >= 12 the pairs (t, 12) times 2^(b_12 - b_8) (a 4-level key factor), keys u >= 4 one
// exp2 row 2^(b_8 - b_7) times the pairs (7, u), keys u < 4 2^(b_8 - b_4) times the 4-level key
// factors. 27 exp2 rows per block instead of 53; factors within ~3 ulp instead of 1.
inline const float* triangle_weight(const float* wp, int64_t K, int64_t t, int64_t u) {  // 2^(b_t - b_u)
  const int64_t q0 = t & ~(kQuarter - 1), tl = t - q0;
  return wp + ((q0 / kQuarter) * kQuarterPairs + tl * (tl - 1) / 2 + (u - q0)) * K;
}
inline void diagonal_block_bridged(int64_t n, int64_t K, int64_t C, float scale, const float* q, const float* k,
                                   const Gates& g, int64_t r0, float* a, float* qs, float* ks, float* fac) {
  const auto mul_row = [K](const float* x, const float* y, float* out) { scaled_rows(1, K, x, y, 1.0f, out); };
  const auto copy_row = [K](const float* x, float* out) { std::memcpy(out, x, static_cast<size_t>(K) * 4); };
  // the 4 x 4 triangles, element-wise (as diagonal_block_pivoted)
  float* wp = fac + kDiagPairs * K;
  diagonal_triangles<true>(n, K, C, scale, q, k, g, r0, a, wp);
  // in each half h: rows [h + 4, min(h + 8, n)) x keys [h, h + 4)
  for (int64_t h = 0; h + kQuarter < n; h += kHalf) {
    const int64_t m = h + kQuarter, nq = std::min(h + kHalf, n) - m;
    float* f = fac + (2 * kHalf + h) * K;
    fill_ones(K, f);
    for (int64_t t = 1; t < nq; ++t) copy_row(triangle_weight(wp, K, m + t, m), f + t * K);
    exp2_rows(g, r0 + m, r0 + m - 1, f + (kQuarter + kQuarter - 1) * K);
    for (int64_t u = 0; u + 1 < kQuarter; ++u) {
      mul_row(f + (2 * kQuarter - 1) * K, triangle_weight(wp, K, m - 1, h + u), f + (kQuarter + u) * K);
    }
    scaled_rows(nq, K, q + m * K, f, scale, qs);
    scaled_rows(kQuarter, K, k + h * K, f + kQuarter * K, 1.0f, ks);
    dot_rows(nq, K, qs, ks, 1.0f, a + m * C + h, C);
  }
  // rows [8, n) x keys [0, 8)
  if (n > kHalf) {
    fill_ones(K, fac);
    for (int64_t t = kHalf + 1; t < std::min(n, kHalf + kQuarter); ++t) copy_row(triangle_weight(wp, K, t, kHalf), fac + (t - kHalf) * K);
    if (n > kHalf + kQuarter) {
      copy_row(fac + (2 * kHalf + kHalf + kQuarter) * K, fac + kQuarter * K);  // 2^(b_12 - b_8)
      for (int64_t t = kHalf + kQuarter + 1; t < n; ++t) {
        mul_row(triangle_weight(wp, K, t, kHalf + kQuarter), fac + kQuarter * K, fac + (t - kHalf) * K);
      }
    }
    float* fk = fac + kHalf * K;  // keys: 2^(b_8 - b_u)
    exp2_rows(g, r0 + kHalf, r0 + kHalf - 1, fk + (kHalf - 1) * K);
    for (int64_t u = kQuarter; u + 1 < kHalf; ++u) mul_row(fk + (kHalf - 1) * K, triangle_weight(wp, K, kHalf - 1, u), fk + u * K);
    const float* f4 = fac + (2 * kHalf + kQuarter) * K;  // 2^(b_4 - b_u), u < 4
    for (int64_t u = 0; u < kQuarter; ++u) mul_row(fk + kQuarter * K, f4 + u * K, fk + u * K);
    scaled_rows(n - kHalf, K, q + kHalf * K, fac, scale, qs);
    scaled_rows(kHalf, K, k, fk, 1.0f, ks);
    dot_rows(n - kHalf, K, qs, ks, 1.0f, a + kHalf * C, C);
    dot_rows(n - kHalf, K, qs, ks + kQuarter * K, 1.0f, a + kHalf * C + kQuarter, C);
  }
}

// The diagonal blocks' part of dq and dk (pairs u < t, the self terms left out as in intra_dqk),
// from the factors diagonal_block_pivoted kept. qs, ks: kSub x K scratch each.
inline void diagonal_dqk_pivoted(int64_t n, int64_t K, int64_t C, const float* q, const float* k, const float* dA,
                                 const float* fac, float* dq, float* dk, float* qs, float* ks) {
  if (n > kHalf) {
    scaled_rows(n - kHalf, K, q + kHalf * K, fac, 1.0f, qs);
    scaled_rows(kHalf, K, k, fac + kHalf * K, 1.0f, ks);
    const float* d = dA + kHalf * C;
    pivot_accumulate(n - kHalf, kHalf, K, d, C, 1, ks, fac, dq + kHalf * K);
    pivot_accumulate(kHalf, n - kHalf, K, d, 1, C, qs, fac + kHalf * K, dk);
  }
  for (int64_t h = 0; h + kQuarter < n; h += kHalf) {
    const int64_t m = h + kQuarter, nq = std::min(h + kHalf, n) - m;
    const float* f = fac + (2 * kHalf + h) * K;
    scaled_rows(nq, K, q + m * K, f, 1.0f, qs);
    scaled_rows(kQuarter, K, k + h * K, f + kQuarter * K, 1.0f, ks);
    const float* d = dA + m * C + h;
    pivot_accumulate(nq, kQuarter, K, d, C, 1, ks, f, dq + m * K);
    pivot_accumulate(kQuarter, nq, K, d, 1, C, qs, f + kQuarter * K, dk + h * K);
  }
  const float* wp = fac + kDiagPairs * K;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t u0 = t & ~(kQuarter - 1);
    const int64_t nk = t - u0;
    const float* w = wp + ((u0 / kQuarter) * kQuarterPairs + nk * (nk - 1) / 2) * K;
    const float* qt = q + t * K;
    float* dqt = dq + t * K;
    for (int64_t m = 0; m < nk; ++m) {
      const int64_t u = u0 + m;
      const float* ku = k + u * K;
      float* dku = dk + u * K;
      const vf av = vset(dA[t * C + u]);
      for_vectors(K, [&](int64_t c, int lanes) {
        const vf ae = vmul(av, vload_k(w + m * K + c, lanes));
        vstore_k(dqt + c, vfma(ae, vload_k(ku + c, lanes), vload_k(dqt + c, lanes)), lanes);
        vstore_k(dku + c, vfma(ae, vload_k(qt + c, lanes), vload_k(dku + c, lanes)), lanes);
      });
    }
  }
}

// Rows scaled to a farther pivot from a diagonal block's factors (diagonal_block_pivoted), with
// one exp2 row per factor level instead of one per row: 2^(x - y) = 2^(x - m) 2^(m - y), both
// exponents <= 0 for y <= m <= x.
// Key rows: out[u] = k[u] 2^(b_target - b_(rb + u)), u < n, target >= rb + n - 1 (the next
// sub-chunk's pivot, or the chunk's last row). Each key goes through the largest stored pivot m
// above it (8-level, 4-level, or the last valid row of its 4 x 4 triangle), then 2^(b_target - b_m),
// computed once per distinct m (m never decreases with u). x: K scratch.
inline void derive_key_rows(int64_t n, int64_t K, const Gates& g, int64_t rb, const float* fac, const float* k,
                            int64_t target, float* out, float* x) {
  const float* wp = fac + kDiagPairs * K;
  int64_t have = -1;
  for (int64_t u = 0; u < n; ++u) {
    int64_t m = u;
    const float* f = nullptr;
    const int64_t h = u & ~(kHalf - 1), q0 = u & ~(kQuarter - 1);
    const int64_t tmax = std::min(q0 + kQuarter, n) - 1;
    if (n > kHalf && u < kHalf) {
      m = kHalf, f = fac + (kHalf + u) * K;
    } else if (u - h < kQuarter && n > h + kQuarter) {
      m = h + kQuarter, f = fac + (2 * kHalf + h + kQuarter + (u - h)) * K;
    } else if (tmax > u) {
      const int64_t tl = tmax - q0;
      m = tmax, f = wp + ((q0 / kQuarter) * kQuarterPairs + tl * (tl - 1) / 2 + (u - q0)) * K;
    }
    if (m != have) exp2_rows(g, target, rb + m, x), have = m;
    const float* ku = k + u * K;
    float* o = out + u * K;
    // one pass: (k f) x, or k x (the same products as scaling by f, then by x)
    if (f) {
      for_vectors(K, [&](int64_t c, int lanes) {
        vstore_k(o + c, vmul(vmul(vload_k(ku + c, lanes), vload_k(f + c, lanes)), vload_k(x + c, lanes)), lanes);
      });
    } else {
      for_vectors(K, [&](int64_t c, int lanes) { vstore_k(o + c, vmul(vload_k(ku + c, lanes), vload_k(x + c, lanes)), lanes); });
    }
  }
}
// Query rows of a block scaled to its first row: out[t] = q[t] 2^(b_(rb + t) - b_rb) scale, t < n.
// Row t goes through the stored pivot m below it (row 0 for t < 4 via the triangle's pairs, the
// 4-level pivot 4, the 8-level pivot 8), then 2^(b_m - b_rb). x: K scratch.
inline void derive_query_rows(int64_t n, int64_t K, const Gates& g, int64_t rb, const float* fac, const float* q,
                              float scale, float* out, float* x) {
  const float* wp = fac + kDiagPairs * K;
  int64_t have = 0;  // m = 0: factor 1
  for (int64_t t = 0; t < n; ++t) {
    int64_t m = 0;
    const float* f = nullptr;
    if (t >= kHalf) {
      m = kHalf, f = fac + (t - kHalf) * K;
    } else if (t >= kQuarter) {
      m = kQuarter, f = fac + (2 * kHalf + (t - kQuarter)) * K;
    } else if (t > 0) {
      f = wp + (t * (t - 1) / 2) * K;
    }
    if (m != have) exp2_rows(g, rb + m, rb, x), have = m;
    float* o = out + t * K;
    const float* qt = q + t * K;
    // one pass: q scale, (q f) scale, or ((q f) scale) x, in that order
    if (!f) {
      scale_row(K, qt, scale, o);
    } else if (m == 0) {
      for_vectors(K, [&](int64_t c, int lanes) {
        vstore_k(o + c, vmul(vmul(vload_k(qt + c, lanes), vload_k(f + c, lanes)), vset(scale)), lanes);
      });
    } else {
      for_vectors(K, [&](int64_t c, int lanes) {
        const vf y = vmul(vmul(vload_k(qt + c, lanes), vload_k(f + c, lanes)), vset(scale));
        vstore_k(o + c, vmul(y, vload_k(x + c, lanes)), lanes);
      });
    }
  }
}

// The factor rows themselves (no key or query rows multiplied in), for the backward's dq and dk:
// key factors out[u] = 2^(b_target - b_(rb + u)), query factors out[t] = 2^(b_(rb + t) - b_rb), through
// the same stored pivots as derive_key_rows / derive_query_rows. x: K scratch.
inline void derive_key_factors(int64_t n, int64_t K, const Gates& g, int64_t rb, const float* fac, int64_t target,
                               float* out, float* x) {
  const float* wp = fac + kDiagPairs * K;
  int64_t have = -1;
  for (int64_t u = 0; u < n; ++u) {
    int64_t m = u;
    const float* f = nullptr;
    const int64_t h = u & ~(kHalf - 1), q0 = u & ~(kQuarter - 1);
    const int64_t tmax = std::min(q0 + kQuarter, n) - 1;
    if (n > kHalf && u < kHalf) {
      m = kHalf, f = fac + (kHalf + u) * K;
    } else if (u - h < kQuarter && n > h + kQuarter) {
      m = h + kQuarter, f = fac + (2 * kHalf + h + kQuarter + (u - h)) * K;
    } else if (tmax > u) {
      const int64_t tl = tmax - q0;
      m = tmax, f = wp + ((q0 / kQuarter) * kQuarterPairs + tl * (tl - 1) / 2 + (u - q0)) * K;
    }
    if (m != have) exp2_rows(g, target, rb + m, x), have = m;
    if (f) {
      scaled_rows(1, K, f, x, 1.0f, out + u * K);
    } else {
      std::memcpy(out + u * K, x, static_cast<size_t>(K) * 4);
    }
  }
}
inline void derive_query_factors(int64_t n, int64_t K, const Gates& g, int64_t rb, const float* fac, float* out,
                                 float* x) {
  const float* wp = fac + kDiagPairs * K;
  int64_t have = 0;
  for (int64_t t = 0; t < n; ++t) {
    int64_t m = 0;
    const float* f = nullptr;
    if (t >= kHalf) {
      m = kHalf, f = fac + (t - kHalf) * K;
    } else if (t >= kQuarter) {
      m = kQuarter, f = fac + (2 * kHalf + (t - kQuarter)) * K;
    } else if (t > 0) {
      f = wp + (t * (t - 1) / 2) * K;
    }
    if (m != have) exp2_rows(g, rb + m, rb, x), have = m;
    float* o = out + t * K;
    if (!f) {
      fill_ones(K, o);
    } else if (m > 0) {
      scaled_rows(1, K, f, x, 1.0f, o);
    } else {
      std::memcpy(o, f, static_cast<size_t>(K) * 4);
    }
  }
}
