// The cpu backend's kernels: the chunked algorithm of SPEC.md section 2 on fp32 tiles, for the whole
// forward and backward operations and for every stage unit. Compiled once per instruction set:
// kernels_<isa>.cpp includes simd.inl and this file inside namespace gla::cpu::<isa>.
//
// Conventions: a "tile" is a row-major fp32 array; L is the number of valid rows of a chunk (the
// last chunk of a sequence may be partial); b is the chunk-local cumulative gate in log2 units;
// every exp2 argument is <= 0 for g <= 0 (pivots at sub-chunk boundaries, element-wise diagonal
// blocks), and masked entries are written with stores, never multiplied by a 0/1 mask.


// ---- optional phase timers (build with -DGLA_CPU_PROF; off in every normal build) ----
#ifdef GLA_CPU_PROF
struct ProfTable {
  std::atomic<unsigned long long> t[32] = {};
  const char* name[32] = {};
  ~ProfTable() {
    unsigned long long tot = 0;
    for (int i = 0; i < 32; ++i) tot += t[i];
    for (int i = 0; i < 32; ++i)
      if (t[i]) std::fprintf(stderr, "prof %-14s %6.1f%% %8.1f Mcyc\n", name[i], 100.0 * double(t[i]) / double(tot), double(t[i]) * 1e-6);
  }
};
inline ProfTable g_prof;
struct ProfScope {
  int i; unsigned long long s;
  ProfScope(int i_, const char* n) : i(i_), s(__rdtsc()) { g_prof.name[i] = n; }
  ~ProfScope() { g_prof.t[i].fetch_add(__rdtsc() - s, std::memory_order_relaxed); }
};
#define GLA_PROF(i, n) ProfScope prof_scope_##i(i, n)
#else
#define GLA_PROF(i, n) (void)0
#endif

inline constexpr float kRcpLn2 = 1.4426950408889634f;

// ---------------------------------------------------------------------------------------------
// Tensor access: strided, any float dtype, converted to/from fp32 tiles.
// ---------------------------------------------------------------------------------------------
struct Span {
  int64_t batch, start, length;
};
inline Span span_of(const gla_problem& p, int64_t n) {
  if (p.varlen) return {0, p.seq_offsets[n], p.seq_offsets[n + 1] - p.seq_offsets[n]};
  return {n, 0, p.T};
}
inline bool has(const gla_tensor& t) { return t.data != nullptr; }

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu;
  uint32_t m = h & 0x3ffu, u;
  if (e == 0x1f) {
    u = sign | 0x7f800000u | (m << 13);
  } else if (e != 0) {
    u = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    u = sign;
  } else {  // subnormal half: normalise the mantissa (integer only, independent of MXCSR)
    const int shift = __builtin_clz(m) - 21;
    m <<= shift;
    u = sign | (static_cast<uint32_t>(113 - shift) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_half(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  if (a >= 0x38800000u) {
    uint32_t r = a - 0x38000000u;
    r += 0xfffu + ((r >> 13) & 1u);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);
  const uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, shift = 126u - e;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}
inline float bfloat_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t float_to_bfloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// dst[i] = x[off + i * stride] for i < n, as fp32.
inline void load_row(const gla_tensor& x, int64_t off, int64_t stride, int64_t n, float* dst) {
  switch (x.dtype) {
    case GLA_DTYPE_F32: {
      const float* s = static_cast<const float*>(x.data) + off;
      if (stride == 1) {
#if defined(__AVX2__) || defined(__AVX512F__)
        // inline vector copy: rows are 128-512 floats and there are ~256 per chunk and head; the
        // library call's dispatch was a fixed cost on each
        for_vectors(n, [&](int64_t c, int lanes) { vstore_k(dst + c, vload_k(s + c, lanes), lanes); });
#else
        std::memcpy(dst, s, static_cast<size_t>(n) * 4);
#endif
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = s[i * stride];
      }
      break;
    }
    case GLA_DTYPE_F16:
    case GLA_DTYPE_BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(x.data) + off;
      const bool half = x.dtype == GLA_DTYPE_F16;
#ifdef GLA_CPU_HAVE_VECTOR_16BIT
      if (stride == 1) {
        for_vectors(n, [&](int64_t c, int lanes) {
          if (half) {
            load_f16(s + c, dst + c, lanes);
          } else {
            load_bf16(s + c, dst + c, lanes);
          }
        });
        break;
      }
#endif
      for (int64_t i = 0; i < n; ++i) dst[i] = half ? half_to_float(s[i * stride]) : bfloat_to_float(s[i * stride]);
      break;
    }
    default:
      break;
  }
}
inline void store_row(const gla_tensor& x, int64_t off, int64_t stride, int64_t n, const float* src) {
  switch (x.dtype) {
    case GLA_DTYPE_F32: {
      float* d = static_cast<float*>(x.data) + off;
      if (stride == 1) {
        std::memcpy(d, src, static_cast<size_t>(n) * 4);
      } else {
        for (int64_t i = 0; i < n; ++i) d[i * stride] = src[i];
      }
      break;
    }
    case GLA_DTYPE_F16: {
      uint16_t* d = static_cast<uint16_t*>(x.data) + off;
      for (int64_t i = 0; i < n; ++i) d[i * stride] = float_to_half(src[i]);
      break;
    }
    case GLA_DTYPE_BF16: {
      uint16_t* d = static_cast<uint16_t*>(x.data) + off;
      for (int64_t i = 0; i < n; ++i) d[i * stride] = float_to_bfloat(src[i]);
      break;
    }
    default:
      break;
  }
}

inline int64_t off4(const gla_tensor& t, int64_t a, int64_t b, int64_t c, int64_t d) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2] + d * t.strides[3];
}

// Rows [t0, t0 + rows) of a [B, T, H, D] tensor at (batch, head), columns [d0, d0 + cols).
inline void load_tile(const gla_tensor& x, int64_t batch, int64_t t0, int64_t rows, int64_t head, int64_t d0,
                      int64_t cols, float* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) load_row(x, off4(x, batch, t0 + r, head, d0), x.strides[3], cols, dst + r * ld);
}
inline void store_tile(const gla_tensor& x, int64_t batch, int64_t t0, int64_t rows, int64_t head, int64_t d0,
                       int64_t cols, const float* src, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) store_row(x, off4(x, batch, t0 + r, head, d0), x.strides[3], cols, src + r * ld);
}

// State (sequence n, head h) restricted to value columns [v0, v0 + bv) as a K x bv tile, in either
// layout ([K, V] or [V, K] with state_v_first).
inline void load_state(const gla_problem& p, const gla_tensor& s, int64_t n, int64_t h, int64_t v0, int64_t bv,
                       float* dst, int64_t ld = -1) {
  if (ld < 0) ld = bv;
  const int64_t sk = p.state_v_first ? s.strides[3] : s.strides[2];
  const int64_t sv = p.state_v_first ? s.strides[2] : s.strides[3];
  for (int64_t i = 0; i < p.K; ++i) load_row(s, n * s.strides[0] + h * s.strides[1] + i * sk + v0 * sv, sv, bv, dst + i * ld);
}
inline void store_state(const gla_problem& p, const gla_tensor& s, int64_t n, int64_t h, int64_t v0, int64_t bv,
                        const float* src, int64_t ld = -1) {
  if (ld < 0) ld = bv;
  const int64_t sk = p.state_v_first ? s.strides[3] : s.strides[2];
  const int64_t sv = p.state_v_first ? s.strides[2] : s.strides[3];
  for (int64_t i = 0; i < p.K; ++i) store_row(s, n * s.strides[0] + h * s.strides[1] + i * sk + v0 * sv, sv, bv, src + i * ld);
}
// Stage buffers h / dh: [NC, H, K, V] fp32 (always key-major).
inline float* chunk_state(const gla_tensor& s, int64_t chunk, int64_t h) {
  return static_cast<float*>(s.data) + chunk * s.strides[0] + h * s.strides[1];
}
inline void copy_from_chunk_state(const gla_problem& p, const gla_tensor& s, int64_t chunk, int64_t h, float* dst) {
  const float* src = chunk_state(s, chunk, h);
  for (int64_t i = 0; i < p.K; ++i) load_row(s, (src - static_cast<const float*>(s.data)) + i * s.strides[2], s.strides[3], p.V, dst + i * p.V);
}
inline void copy_to_chunk_state(const gla_problem& p, const gla_tensor& s, int64_t chunk, int64_t h, const float* src) {
  float* dst = chunk_state(s, chunk, h);
  for (int64_t i = 0; i < p.K; ++i) store_row(s, (dst - static_cast<float*>(s.data)) + i * s.strides[2], s.strides[3], p.V, src + i * p.V);
}

// The caller's saved chunk states of the whole operations (gla_chunk_forward_args.h): contiguous
// [NC, H, K, V] fp32 with chunks of kChunk; sequence n's first chunk there.
inline int64_t first_saved_chunk(const gla_problem& p, int64_t n, int64_t C) {
  int64_t first = 0;
  for (int64_t m = 0; m < n; ++m) first += (span_of(p, m).length + C - 1) / C;
  return first;
}

inline int64_t element_offset(const gla_tensor& x, int64_t batch, int64_t t, int64_t head, int64_t d) {
  return batch * x.strides[0] + t * x.strides[1] + head * x.strides[2] + (x.rank == 4 ? d * x.strides[3] : 0);
}
// Rows [t0, t0 + L) of heads [h0, h0 + G) of a [B, T, H, D] (or [B, T, H]) tensor, columns
// [d0, d0 + cols): head j's tile at dst + j * tile, row r at + r * ld. Rows outer, heads inner:
// neighbouring heads are neighbours in memory, so the source is read in address order and the
// hardware prefetchers follow it (one head alone jumps a page per row). Software prefetching of the
// next chunk on top of this measured 5-8% slower (B1 T4096 H16 D128, one thread).
inline void load_tiles(const gla_tensor& x, int64_t batch, int64_t t0, int64_t L, int64_t h0, int64_t G, int64_t d0,
                       int64_t cols, float* dst, int64_t tile, int64_t ld) {
  const int64_t stride = x.rank == 4 ? x.strides[3] : 0;
  for (int64_t r = 0; r < L; ++r) {
    for (int64_t j = 0; j < G; ++j) load_row(x, element_offset(x, batch, t0 + r, h0 + j, d0), stride, cols, dst + j * tile + r * ld);
  }
}
// dst[0, n) = src[0, n): streaming stores where there are (a buffer written now, read much later).
inline void copy_out(const float* src, int64_t n, float* dst) {
#ifdef GLA_CPU_HAVE_STREAM_STORE
  stream_row(dst, src, n);
  _mm_sfence();
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * 4);
#endif
}
// dst[0, n) = src[0, n) with streaming stores where there are; end_copy_out() after a batch of them.
inline void copy_out_rows(const float* src, int64_t n, float* dst) {
#ifdef GLA_CPU_HAVE_STREAM_STORE
  stream_row(dst, src, n);
#else
  std::memcpy(dst, src, static_cast<size_t>(n) * 4);
#endif
}
inline void end_copy_out() {
#ifdef GLA_CPU_HAVE_STREAM_STORE
  _mm_sfence();
#endif
}
inline void store_tiles(const gla_tensor& x, int64_t batch, int64_t t0, int64_t L, int64_t h0, int64_t G, int64_t d0,
                        int64_t cols, const float* src, int64_t tile, int64_t ld) {
#ifdef GLA_CPU_HAVE_STREAM_STORE
  // fp32 rows go out with streaming stores (2-4% on B1 T4096 H16 D128, forward and backward;
  // plain stores in the backward measured 2-7% slower again on 2026-11-30).
  if (x.dtype == GLA_DTYPE_F32 && x.rank == 4 && x.strides[3] == 1 && cols >= 32) {
    // Neighbouring heads' rows that are neighbours in memory go out as one run: a destination not
    // 64-byte aligned (malloc'ed buffers start 16 bytes into a page) then has two partial lines
    // per run, written with plain stores (a read for ownership each), instead of two per head.
    constexpr int64_t kRun = 2048;
    if (G > 1 && x.strides[2] == cols && G * cols <= kRun) {
      alignas(64) float run[kRun];
      for (int64_t r = 0; r < L; ++r) {
        for (int64_t j = 0; j < G; ++j) std::memcpy(run + j * cols, src + j * tile + r * ld, static_cast<size_t>(cols) * 4);
        stream_row(static_cast<float*>(x.data) + element_offset(x, batch, t0 + r, h0, d0), run, G * cols);
      }
      _mm_sfence();
      return;
    }
    for (int64_t r = 0; r < L; ++r) {
      for (int64_t j = 0; j < G; ++j) {
        stream_row(static_cast<float*>(x.data) + element_offset(x, batch, t0 + r, h0 + j, d0), src + j * tile + r * ld, cols);
      }
    }
    _mm_sfence();
    return;
  }
#endif
  for (int64_t r = 0; r < L; ++r) {
    for (int64_t j = 0; j < G; ++j) store_row(x, element_offset(x, batch, t0 + r, h0 + j, d0), x.strides[3], cols, src + j * tile + r * ld);
  }
}

// b (L x K): chunk-local inclusive cumulative gate in log2 units, accumulated in fp64 and returned
// as hi + lo (see Gates). On entry b holds the raw gate rows (a per-head gate: g at b[r * K]).
// run: K doubles.
inline void cumsum_gate_rows(bool per_head, int64_t L, int64_t K, float* b, float* blo, double* run) {
  constexpr double kRcpLn2d = 1.4426950408889634;
  if (per_head) {
    double acc = 0.0;
    for (int64_t r = 0; r < L; ++r) {
      acc += b[r * K];
      const double x = acc * kRcpLn2d;
      const float hi = static_cast<float>(x), lo = static_cast<float>(x - hi);
      for (int64_t i = 0; i < K; ++i) b[r * K + i] = hi, blo[r * K + i] = lo;
    }
    return;
  }
#if defined(__AVX2__) || defined(__AVX512F__)
  // Per-key gate, vector ISAs: the same sum in double-float arithmetic (an unevaluated pair of
  // floats, ~48 significant bits: the fp32 differences b_t - b_s the kernels take come out the
  // same as from fp64), kColumns vectors of columns at a time with their running sums in
  // registers, so the row-to-row dependency chains of the columns overlap. ~20 vector operations
  // per 16 columns and row instead of ~30 with fp64 conversions.
  (void)run;
  constexpr int kColumns = 4;
  const vf ch = vset(kRcpLn2), cl = vset(static_cast<float>(kRcpLn2d - static_cast<double>(kRcpLn2)));
  for (int64_t c0 = 0; c0 < K; c0 += int64_t{kColumns} * W) {
    int lanes[kColumns];
    for (int j = 0; j < kColumns; ++j) lanes[j] = static_cast<int>(std::clamp<int64_t>(K - c0 - j * W, 0, W));
    vf hi[kColumns], lo[kColumns];
    for (int j = 0; j < kColumns; ++j) hi[j] = vzero(), lo[j] = vzero();
    for (int64_t r = 0; r < L; ++r) {
      for (int j = 0; j < kColumns; ++j) {
        if (lanes[j] == 0) continue;
        float* at = b + r * K + c0 + j * W;
        const vf x = vload_k(at, lanes[j]);
        const vf sm = vadd(hi[j], x), bb = vsub(sm, hi[j]);  // TwoSum: sm + e = hi + x exactly
        const vf e = vadd(vsub(hi[j], vsub(sm, bb)), vsub(x, bb));
        const vf l = vadd(lo[j], e);
        hi[j] = vadd(sm, l);  // renormalise (|l| <= ulp(sm))
        lo[j] = vsub(l, vsub(hi[j], sm));
        vf p = vmul(hi[j], ch);
        __asm__("" : "+x"(p));  // p = round(hi ch) as such: no contraction into the sums below
        vf pe = vfma(hi[j], ch, vsub(vzero(), p));  // hi ch - p, exactly
        pe = vfma(lo[j], ch, vfma(hi[j], cl, pe));
        const vf rh = vadd(p, pe);
        vstore_k(at, rh, lanes[j]);
        vstore_k(blo + (at - b), vsub(pe, vsub(rh, p)), lanes[j]);
      }
    }
  }
  return;
#endif
  double* __restrict acc = run;
  for (int64_t i = 0; i < K; ++i) acc[i] = 0.0;
  for (int64_t r = 0; r < L; ++r) {
    float* __restrict row = b + r * K;
    float* __restrict lo = blo + r * K;
    for (int64_t i = 0; i < K; ++i) {
      acc[i] += static_cast<double>(row[i]);
      const double x = acc[i] * kRcpLn2d;
      const float hi = static_cast<float>(x);
      row[i] = hi;
      lo[i] = static_cast<float>(x - static_cast<double>(hi));
    }
  }
}
inline void gate_cumsum(const gla_problem& p, int64_t batch, int64_t t0, int64_t L, int64_t h, float* b, float* blo,
                        double* run) {
  load_tiles(p.g, batch, t0, L, h, 1, 0, p.gate_per_head ? 1 : p.K, b, 0, p.K);
  cumsum_gate_rows(p.gate_per_head, L, p.K, b, blo, run);
}
// b from the gcum stage buffer ([B, T, H, Kg], Kg = 1 broadcast for a per-head gate); lo = 0.
inline void load_gcum(const gla_problem& p, int64_t batch, int64_t t0, int64_t L, int64_t h, float* b, float* blo) {
  const int64_t K = p.K;
  std::memset(blo, 0, static_cast<size_t>(L * K) * 4);
  const gla_tensor& gc = p.gcum;
  const int64_t kg = gc.sizes[3];
  for (int64_t r = 0; r < L; ++r) {
    const float* src = static_cast<const float*>(gc.data) + off4(gc, batch, t0 + r, h, 0);
    if (kg == 1) {
      for (int64_t i = 0; i < K; ++i) b[r * K + i] = src[0];
    } else {
      for (int64_t i = 0; i < K; ++i) b[r * K + i] = src[i * gc.strides[3]];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Dense tile products: C[M x N] (+)= A[M x D] * B[D x N], A element (i, d) at a[i*rsa + d*csa]
// (so A may be read transposed), B and C row-major. Register-tiled micro-kernel; the last vector
// of a row is masked.
// ---------------------------------------------------------------------------------------------
// One operand pair of a product: A element (i, d) at a[i*rsa + d*csa], B row d at b + d*ldb.
struct Seg {
  int64_t D;
  const float* a;
  int64_t rsa, csa;
  const float* b;
  int64_t ldb;
};

template <int MR, int NV, bool Full>
inline void gemm_tile(const Seg* seg, int nseg, int64_t last_d, int64_t i0, int64_t j0, float* c, int64_t ldc, int nlast,
                      bool accumulate, const float* row_scale) {
  vf acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      if (!accumulate) {
        acc[i][j] = vzero();
      } else if (Full || j < NV - 1) {
        acc[i][j] = vload(c + i * ldc + j * W);
      } else {
        acc[i][j] = vload_n(c + i * ldc + j * W, nlast);
      }
      if (accumulate && row_scale) acc[i][j] = vmul(acc[i][j], vset(row_scale[i]));
    }
  }
  // Segments one after the other into the same accumulators: C (+)= A1 B1 + A2 B2, with the same
  // operation order as two calls (the second accumulating), so results are bitwise the same.
  for (int sgi = 0; sgi < nseg; ++sgi) {
    const Seg& sg = seg[sgi];
    const float* a = sg.a + i0 * sg.rsa;
    const float* b = sg.b + j0;
    const int64_t rsa = sg.rsa, csa = sg.csa, ldb = sg.ldb;
    const int64_t D = sgi == nseg - 1 ? last_d : sg.D;
    for (int64_t d = 0; d < D; ++d) {
      const float* brow = b + d * ldb;
      vf bv[NV];
      for (int j = 0; j < NV; ++j) bv[j] = (Full || j < NV - 1) ? vload(brow + j * W) : vload_n(brow + j * W, nlast);
      const float* ap = a + d * csa;
      for (int i = 0; i < MR; ++i) {
        const vf av = vset(ap[i * rsa]);
        for (int j = 0; j < NV; ++j) acc[i][j] = vfma(av, bv[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NV; ++j) {
      if (Full || j < NV - 1) {
        vstore(c + i * ldc + j * W, acc[i][j]);
      } else {
        vstore_n(c + i * ldc + j * W, acc[i][j], nlast);
      }
    }
  }
}

template <int MR, int NV>
inline void gemm_tile_dispatch_full(bool full, const Seg* seg, int nseg, int64_t last_d, int64_t i0, int64_t j0,
                                    float* c, int64_t ldc, int nlast, bool accumulate, const float* row_scale) {
  if (full) {
    gemm_tile<MR, NV, true>(seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale);
  } else {
    gemm_tile<MR, NV, false>(seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale);
  }
}

template <int MR>
inline void gemm_tile_dispatch_vecs(int nv, bool full, const Seg* seg, int nseg, int64_t last_d, int64_t i0,
                                    int64_t j0, float* c, int64_t ldc, int nlast, bool accumulate,
                                    const float* row_scale) {
  static_assert(kTileVecs >= 1 && kTileVecs <= 4, "tile width");
  switch (nv) {
    case 1: gemm_tile_dispatch_full<MR, 1>(full, seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale); break;
    case 2: if constexpr (kTileVecs >= 2) gemm_tile_dispatch_full<MR, 2>(full, seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale); break;
    case 3: if constexpr (kTileVecs >= 3) gemm_tile_dispatch_full<MR, 3>(full, seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale); break;
    default: if constexpr (kTileVecs >= 4) gemm_tile_dispatch_full<MR, 4>(full, seg, nseg, last_d, i0, j0, c, ldc, nlast, accumulate, row_scale); break;
  }
}

// C[M x N] (+)= sum over the segments of A_s[M x D_s] B_s[D_s x N]. With accumulate and row_scale
// (M floats), C is first scaled by row: C = Diag(row_scale) C + ... With causal > 0 (a multiple of
// kTileRows), rows of block r = i / causal use only the first min(D, (r + 1) causal) terms of the
// last segment (A v with A lower block-triangular): every panel of B is then read by all row
// tiles in turn while it is in L1, where one call per row block re-read it from L2.
inline void gemm_segs(int64_t M, int64_t N, const Seg* seg, int nseg, float* c, int64_t ldc, bool accumulate,
                      const float* row_scale = nullptr, int64_t causal = 0) {
  if (M <= 0 || N <= 0) return;
  int64_t Dsum = 0;
  for (int i = 0; i < nseg; ++i) Dsum += std::max<int64_t>(seg[i].D, 0);
  if (Dsum <= 0) {
    for (int64_t i = 0; i < M; ++i) {
      if (!accumulate) {
        std::memset(c + i * ldc, 0, static_cast<size_t>(N) * 4);
      } else if (row_scale) {
        for (int64_t j = 0; j < N; ++j) c[i * ldc + j] *= row_scale[i];
      }
    }
    return;
  }
  constexpr int64_t kPanel = int64_t{kTileVecs} * W;
  for (int64_t j0 = 0; j0 < N; j0 += kPanel) {
    const int64_t cols = std::min<int64_t>(kPanel, N - j0);
    const int nv = static_cast<int>((cols + W - 1) / W);
    const int nlast = static_cast<int>(cols - int64_t{nv - 1} * W);
    const bool full = nlast == W;
    for (int64_t i0 = 0; i0 < M; i0 += kTileRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kTileRows, M - i0));
      float* ci = c + i0 * ldc + j0;
      const float* rs = row_scale ? row_scale + i0 : nullptr;
      const int64_t dl = causal > 0 ? std::min(seg[nseg - 1].D, (i0 / causal + 1) * causal) : seg[nseg - 1].D;
      switch (mr) {
        case 8: if constexpr (kTileRows >= 8) gemm_tile_dispatch_vecs<8>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 7: if constexpr (kTileRows >= 7) gemm_tile_dispatch_vecs<7>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 6: if constexpr (kTileRows >= 6) gemm_tile_dispatch_vecs<6>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 5: if constexpr (kTileRows >= 5) gemm_tile_dispatch_vecs<5>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 4: gemm_tile_dispatch_vecs<4>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 3: gemm_tile_dispatch_vecs<3>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        case 2: gemm_tile_dispatch_vecs<2>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
        default: gemm_tile_dispatch_vecs<1>(nv, full, seg, nseg, dl, i0, j0, ci, ldc, nlast, accumulate, rs); break;
      }
    }
  }
}

// C[M x N] (+)= A[M x D] * B[D x N], A element (i, d) at a[i*rsa + d*csa].
inline void gemm(int64_t M, int64_t N, int64_t D, const float* a, int64_t rsa, int64_t csa, const float* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate, const float* row_scale = nullptr) {
  const Seg seg{D, a, rsa, csa, b, ldb};
  gemm_segs(M, N, &seg, 1, c, ldc, accumulate, row_scale);
}

// dst[c * ldd + r] = src[r * lds + c]
inline void transpose(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst, int64_t ldd) {
  constexpr int64_t kBlock = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t r1 = std::min(rows, r0 + kBlock);
    for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
      const int64_t c1 = std::min(cols, c0 + kBlock);
#ifdef GLA_CPU_HAVE_TRANSPOSE16
      if (r1 - r0 == kBlock && c1 - c0 == kBlock) {
        transpose16(src + r0 * lds + c0, lds, dst + c0 * ldd + r0, ldd);
        continue;
      }
#endif
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) dst[c * ldd + r] = src[r * lds + c];
      }
    }
  }
}

// The chunk-local cumulative gate b (log2 units) of L rows, as an unevaluated sum hi + lo of two
// floats. b reaches hundreds under strong decay (64 steps of g = -5: b = -460), where one fp32 ulp
// is 3e-5; every exponent used is a difference b_t - b_s of nearby rows, and taking it from fp32
// cumulative sums alone put 2e-5 relative error into dg (SPEC's bar is 1e-5). The whole operations
// accumulate in fp64 and keep the rounding remainder in lo; the stage units read the fp32 gcum
// buffer and have lo = 0.
struct Gates {
  const float* hi;
  const float* lo;
  int64_t K;
};
// b[r1] - b[r0] (r0 < 0: b[r1]) for the vector at column c.
inline vf gate_diff(const Gates& g, int64_t r1, int64_t r0, int64_t c, int lanes) {
  vf h = vload_k(g.hi + r1 * g.K + c, lanes), l = vload_k(g.lo + r1 * g.K + c, lanes);
  if (r0 >= 0) {
    h = vsub(h, vload_k(g.hi + r0 * g.K + c, lanes));
    l = vsub(l, vload_k(g.lo + r0 * g.K + c, lanes));
  }
  return vadd(h, l);
}
// out[i] = x[i] * 2^(b[r1][i] - b[r0][i]) * s over K floats.
inline void scale_exp2_rows(const Gates& g, const float* x, int64_t r1, int64_t r0, float s, float* out) {
  if (s == 1.0f) {  // x * e * 1 == x * e exactly
    for_vectors(g.K, [&](int64_t c, int lanes) {
      vstore_k(out + c, vmul(vload_k(x + c, lanes), vexp2(gate_diff(g, r1, r0, c, lanes))), lanes);
    });
    return;
  }
  for_vectors(g.K, [&](int64_t c, int lanes) {
    vstore_k(out + c, vmul(vmul(vload_k(x + c, lanes), vexp2(gate_diff(g, r1, r0, c, lanes))), vset(s)), lanes);
  });
}
// out[i] = 2^(b[r1][i] - b[r0][i]) over K floats.
inline void exp2_rows(const Gates& g, int64_t r1, int64_t r0, float* out) {
  for_vectors(g.K, [&](int64_t c, int lanes) { vstore_k(out + c, vexp2(gate_diff(g, r1, r0, c, lanes)), lanes); });
}
// x[i] *= f[i] over n floats.
inline void mul_inplace(int64_t n, float* x, const float* f) {
  for_vectors(n, [&](int64_t c, int lanes) { vstore_k(x + c, vmul(vload_k(x + c, lanes), vload_k(f + c, lanes)), lanes); });
}
// x[i] += y[i] * f[i]
inline void fma_inplace(int64_t n, float* x, const float* y, const float* f) {
  for_vectors(n, [&](int64_t c, int lanes) {
    vstore_k(x + c, vfma(vload_k(y + c, lanes), vload_k(f + c, lanes), vload_k(x + c, lanes)), lanes);
  });
}
// ---------------------------------------------------------------------------------------------
// Chunk building blocks. Tiles: q, k, b [L x K]; v, do [L x V] (ld = their width); A, dA [L x C]
// with ld C. Scratch pointers are sized by the callers' layouts.
// ---------------------------------------------------------------------------------------------
struct IntraScratch {
  float* qp;    // kSub x K: query rows scaled to the pivot
  float* kpt;   // K x C: keys scaled to the pivot, transposed (ld C)
  float* krow;  // kSub x K
  float* fac;   // K
  float* kht;   // K x kSub/2
};


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
    {
      GLA_PROF(5, "A diag");
      if (fi) {
        diagonal_block_bridged(ni, K, C, scale, q + r0 * K, k + r0 * K, g, r0, A + r0 * C + r0, s.qp, s.krow, fi);
      } else {
        diagonal_block_pivoted(ni, K, C, scale, q + r0 * K, k + r0 * K, g, r0, A + r0 * C + r0, s.qp, s.krow, fi);
      }
    }
    GLA_PROF(4, "A offdiag");
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
  {
  GLA_PROF(7, "F qe scale");
  for (int64_t i = 0; i < nsub; ++i) {
    const int64_t r0 = i * kSub, ni = std::min(kSub, L - r0);
    exp2_rows(g, r0, -1, fac);
    for (int64_t t = 0; t < ni; ++t) mul_inplace(K, qe + (r0 + t) * K, fac);
  }
  }
  // o = (scale q ⊙ 2^b) S + A v in one product, A v causal by row tile (o stored once): a tile's
  // rows read keys up to its last row only (A is zero above the diagonal there, inside the
  // diagonal block), not to the end of their sub-chunk.
  static_assert(kSub % kTileRows == 0, "row tiles within sub-chunks");
  {GLA_PROF(8, "F o");
  const Seg seg[2] = {{K, qe, K, 1, S, lds}, {L, A, C, 1, v, ldv}};
  gemm_segs(L, bv, seg, 2, o, bv, false, nullptr, kTileRows);
  }
  // state: kpt becomes (k ⊙ 2^(b_last - b))^T
  const int64_t last0 = (nsub - 1) * kSub;
  {GLA_PROF(10, "F state prep");
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
  }
  GLA_PROF(11, "F state gemm");
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

// ---------------------------------------------------------------------------------------------
// Scratch layout: one carve-up per unit, used both to size (base == nullptr) and to run.
// ---------------------------------------------------------------------------------------------
class Arena {
 public:
  explicit Arena(float* base) : base_(base) {}
  float* take(int64_t floats) {
    float* at = base_ ? base_ + used_ : nullptr;
    used_ += (floats + 15) / 16 * 16;  // 64-byte granules
    return at;
  }
  size_t used() const { return static_cast<size_t>(used_); }

 private:
  float* base_;
  int64_t used_ = 0;
};

inline int64_t value_tiles(const gla_problem& p) { return (p.V + kMaxValueTile - 1) / kMaxValueTile; }
inline int64_t value_tile_width(const gla_problem& p) {
  const int64_t n = value_tiles(p);
  return (p.V + n - 1) / n;
}
// Heads one forward item walks together, chunk by chunk (see load_tiles). Only the order of work
// depends on it (and so on the thread count), never a result. 4 heads of K = V = 128 keep their
// states and tiles (~0.8 MB) in L2.
inline constexpr int64_t kMaxHeadGroup = 4;
inline int64_t max_chunks_per_sequence(const gla_problem& p, int64_t C);
inline int64_t value_tiles(const gla_problem& p);
// The backward also keeps every chunk-start state of its heads: at most kMaxStateBytes for a group.
inline constexpr int64_t kMaxStateBytes = int64_t{64} << 20;
inline int64_t head_group(const gla_problem& p, int threads) {
  if (p.unit != GLA_UNIT_CHUNK_FWD && p.unit != GLA_UNIT_CHUNK_BWD) return 1;
  const int64_t tiles = p.unit == GLA_UNIT_CHUNK_FWD ? value_tiles(p) : 1;
  const int64_t per_thread = p.N * p.H * tiles / (2 * std::max(threads, 1));
  int64_t g = std::max<int64_t>(1, std::min({kMaxHeadGroup, p.H, per_thread}));
  if (p.unit == GLA_UNIT_CHUNK_BWD) {
    const int64_t per_head = max_chunks_per_sequence(p, kChunk) * p.K * p.V * 4;
    while (g > 1 && g * per_head > kMaxStateBytes) --g;
  }
  return g;
}
inline bool is_stage(int32_t unit) { return unit >= GLA_UNIT_CUMSUM && unit <= GLA_UNIT_BWD_DQKG; }
inline int64_t chunk_of(const gla_problem& p) { return is_stage(p.unit) ? p.chunk_size : kChunk; }
inline int64_t max_chunks_per_sequence(const gla_problem& p, int64_t C) {
  int64_t m = 0;
  for (int64_t n = 0; n < p.N; ++n) m = std::max(m, (span_of(p, n).length + C - 1) / C);
  return m;
}

// Leading dimension of a tile read by the products as their B operand over many rows: rows 512 B
// apart (128 floats) map onto 1/8 of the L1 sets, and a 128 x 48 panel (24 KiB) no longer fits a
// 12-way 48 KiB L1. One extra 64-byte line per row spreads the rows over all sets.
inline int64_t padded_ld(int64_t n) {
  const int64_t r = (n + 15) / 16 * 16;
  return r % 64 == 0 ? r + 16 : r;
}

struct Tiles {
  double* rund;
  float *es, *ee;
  float *q, *k, *b, *blo, *v, *dout, *A, *dA, *o, *S, *dS, *wd, *dq, *dk, *dg, *dv, *kl, *run, *states;
  IntraScratch intra;
  DqkScratch dqk;
  InterScratch inter;
  float* vt;
};

// Per-head tiles (q, k, b, blo, v, o, S) are `group` heads long, head j at + j * (their size).
inline Tiles carve(const gla_problem& p, int64_t group, float* base, size_t* total) {
  Arena a(base);
  Tiles t{};
  const int64_t K = p.K, V = p.V, C = chunk_of(p), G = group;
  const int64_t nsub = (C + kSub - 1) / kSub;
  const int64_t bv = p.unit == GLA_UNIT_CHUNK_FWD ? value_tile_width(p) : V;
  t.q = a.take(G * C * K);
  t.k = a.take(G * C * K);
  t.b = a.take(G * C * K);
  t.es = a.take(C * K);
  t.ee = a.take(C * K);
  t.blo = a.take(G * C * K);
  t.rund = reinterpret_cast<double*>(a.take(2 * K));  // used only as doubles
  t.v = a.take(G * C * padded_ld(bv));
  const int64_t Gb = p.unit == GLA_UNIT_CHUNK_BWD ? G : 1;  // per-head backward tiles
  t.dout = a.take(Gb * C * V);
  t.A = a.take(C * C);
  t.dA = a.take(C * C);
  t.o = a.take(G * C * bv);
  t.S = a.take(G * K * padded_ld(bv));
  t.dS = a.take(Gb * K * V);
  t.wd = a.take(nsub * kDiagRows * K);
  t.dq = a.take(Gb * C * K);
  t.dk = a.take(Gb * C * K);
  t.dg = a.take(Gb * C * K);
  t.dv = a.take(Gb * C * V);
  t.kl = a.take(C * K);
  t.run = a.take(K);
  t.vt = a.take(V * C);
  t.intra = {a.take(kSub * K), a.take(K * C), a.take(kSub * K), a.take(K), a.take(K * kSub / 2)};
  t.dqk = {a.take(C * K), a.take(C * K), a.take(C * K), a.take(K), a.take(K)};
  t.inter = {a.take(V * K), a.take(V * K), a.take(C * K), a.take(C * K), a.take(K),
             reinterpret_cast<double*>(a.take(2 * K))};  // acc: used only as doubles
  t.states = p.unit == GLA_UNIT_CHUNK_BWD && !has(p.h) ? a.take(Gb * max_chunks_per_sequence(p, C) * K * V) : nullptr;
  *total = a.used();
  return t;
}

// ---------------------------------------------------------------------------------------------
// Work items
// ---------------------------------------------------------------------------------------------
inline void load_initial_state(const gla_problem& p, int64_t n, int64_t h, int64_t v0, int64_t bv, float* S,
                               int64_t ld = -1) {
  if (ld < 0) ld = bv;
  if (has(p.initial_state)) {
    load_state(p, p.initial_state, n, h, v0, bv, S, ld);
  } else {
    std::memset(S, 0, static_cast<size_t>(p.K * ld) * 4);
  }
}

// Whole forward: item = (sequence, group of heads, value tile); the group walks its chunks together.
inline void run_forward(const gla_problem& p, int64_t item, int64_t group, const Tiles& t) {
  const int64_t nt = value_tiles(p), bw = value_tile_width(p), ngroups = (p.H + group - 1) / group;
  const int64_t vt = item % nt, hg = (item / nt) % ngroups, n = item / nt / ngroups;
  const int64_t h0 = hg * group, G = std::min(group, p.H - h0);
  const int64_t v0 = vt * bw, bv = std::min(bw, p.V - v0);
  const Span sp = span_of(p, n);
  const int64_t K = p.K, C = kChunk;
  const int64_t lds = padded_ld(bv);
  const int64_t ldv = lds;  // v rows padded like S's (they are the B operand of A v and of the state update)
  const int64_t ck = C * K, cv = C * bv, cvp = C * ldv, kv = K * lds;
  const float scale = static_cast<float>(p.scale);
  for (int64_t j = 0; j < G; ++j) load_initial_state(p, n, h0 + j, v0, bv, t.S + j * kv, lds);
  const int64_t first_chunk = has(p.h) ? first_saved_chunk(p, n, C) : 0;
  for (int64_t c0 = 0; c0 < sp.length; c0 += C) {
    const int64_t L = std::min(C, sp.length - c0), t0 = sp.start + c0;
    {GLA_PROF(0, "F loads");
    load_tiles(p.q, sp.batch, t0, L, h0, G, 0, K, t.q, ck, K);
    load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
    load_tiles(p.v, sp.batch, t0, L, h0, G, v0, bv, t.v, cvp, ldv);
    load_tiles(p.g, sp.batch, t0, L, h0, G, 0, p.gate_per_head ? 1 : K, t.b, ck, K);
    }
    if (has(p.h)) {  // the state at this chunk's start, for a later backward (streamed: read much later)
      GLA_PROF(3, "F save h");
      for (int64_t j = 0; j < G; ++j) {
        float* dst = static_cast<float*>(p.h.data) + ((first_chunk + c0 / C) * p.H + h0 + j) * K * p.V + v0;
        for (int64_t i = 0; i < K; ++i) copy_out_rows(t.S + j * kv + i * lds, bv, dst + i * p.V);
      }
      end_copy_out();
    }
    for (int64_t j = 0; j < G; ++j) {
      float *q = t.q + j * ck, *k = t.k + j * ck, *b = t.b + j * ck, *blo = t.blo + j * ck;
      float *v = t.v + j * cvp, *o = t.o + j * cv, *S = t.S + j * kv;
      {GLA_PROF(1, "F cumsum");
      cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);}
      const Gates gates{b, blo, K};
      forward_chunk(L, K, bv, C, scale, q, k, gates, v, ldv, S, lds, o, t.A, t.intra, t.kl, t.run, t.wd);
    }
    GLA_PROF(2, "F store");
    store_tiles(p.o, sp.batch, t0, L, h0, G, v0, bv, t.o, cv, bv);
  }
  if (has(p.final_state)) {
    for (int64_t j = 0; j < G; ++j) store_state(p, p.final_state, n, h0 + j, v0, bv, t.S + j * kv, lds);
  }
}

// Whole backward: item = (sequence, head). A forward pass recomputes the chunk-start states, then a
// reverse pass carries dS and finishes each chunk's dq, dk, dv, dg while its tiles are in cache.
inline void run_backward(const gla_problem& p, int64_t item, int64_t group, const Tiles& t) {
  const int64_t ngroups = (p.H + group - 1) / group;
  const int64_t hg = item % ngroups, n = item / ngroups;
  const int64_t h0 = hg * group, G = std::min(group, p.H - h0);
  const Span sp = span_of(p, n);
  const int64_t K = p.K, V = p.V, C = kChunk;
  const int64_t ck = C * K, cv = C * V, kv = K * V;
  const int64_t gk = p.gate_per_head ? 1 : K;
  const float scale = static_cast<float>(p.scale);
  const bool want_dqk = has(p.dq) || has(p.dk) || has(p.dg);
  const int64_t nchunks = (sp.length + C - 1) / C;
  const int64_t states_per_head = max_chunks_per_sequence(p, C) * kv;
  // Pass 1: the chunk-start states of every head in the group, kept transposed (V x K): see
  // state_step_transposed. Each head's running state stays in a cache-resident tile (t.S) and is
  // copied out to `states` with streaming stores: stepping it in place in `states` read every
  // 64 KiB destination from memory first (read for ownership). The last state is read from the
  // tile in pass 2.
  const auto hot = [&](int64_t j) { return t.S + j * kv; };
  // With the caller's saved states (p.h, written by the forward) there is no pass 1: pass 2
  // transposes each chunk's state from there into the hot tile.
  const bool saved = has(p.h);
  const int64_t first_chunk = saved ? first_saved_chunk(p, n, C) : 0;
  if ((want_dqk || has(p.dv)) && !saved) {
    if (nchunks > 0) {
      for (int64_t j = 0; j < G; ++j) {
        load_initial_state(p, n, h0 + j, 0, V, t.dS);  // dS is free until pass 2
        transpose(K, V, t.dS, V, hot(j), K);
        if (nchunks > 1) copy_out(hot(j), kv, t.states + j * states_per_head);
      }
    }
    for (int64_t c = 0; c + 1 < nchunks; ++c) {
      const int64_t c0 = c * C, L = std::min(C, sp.length - c0), t0 = sp.start + c0;
      {GLA_PROF(12, "B1 loads");
      load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
      load_tiles(p.v, sp.batch, t0, L, h0, G, 0, V, t.v, cv, V);
      load_tiles(p.g, sp.batch, t0, L, h0, G, 0, gk, t.b, ck, K);
      }
      GLA_PROF(13, "B1 state");
      for (int64_t j = 0; j < G; ++j) {
        float *b = t.b + j * ck, *blo = t.blo + j * ck;
        cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);
        state_step_transposed(L, K, V, t.k + j * ck, Gates{b, blo, K}, t.v + j * cv, hot(j), hot(j), t.kl, t.run);
        if (c + 2 < nchunks) copy_out(hot(j), kv, t.states + j * states_per_head + (c + 1) * kv);
      }
    }
  }
  // Pass 2, in reverse: carry dS and finish each chunk's gradients.
  for (int64_t j = 0; j < G; ++j) {
    if (has(p.dht)) {
      load_state(p, p.dht, n, h0 + j, 0, V, t.dS + j * kv);
    } else {
      std::memset(t.dS + j * kv, 0, static_cast<size_t>(kv) * 4);
    }
  }
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t c0 = c * C, L = std::min(C, sp.length - c0), t0 = sp.start + c0;
    {GLA_PROF(14, "B2 loads");
    load_tiles(p.q, sp.batch, t0, L, h0, G, 0, K, t.q, ck, K);
    load_tiles(p.g, sp.batch, t0, L, h0, G, 0, gk, t.b, ck, K);
    if (has(p.do_)) {
      load_tiles(p.do_, sp.batch, t0, L, h0, G, 0, V, t.dout, cv, V);
    } else {
      for (int64_t j = 0; j < G; ++j) std::memset(t.dout + j * cv, 0, static_cast<size_t>(L * V) * 4);
    }
    if (want_dqk || has(p.dv)) {
      load_tiles(p.k, sp.batch, t0, L, h0, G, 0, K, t.k, ck, K);
      load_tiles(p.v, sp.batch, t0, L, h0, G, 0, V, t.v, cv, V);
    }
    }
    for (int64_t j = 0; j < G; ++j) {
      const float *q = t.q + j * ck, *kt = t.k + j * ck, *v = t.v + j * cv, *dout = t.dout + j * cv;
      float *b = t.b + j * ck, *blo = t.blo + j * ck, *dS = t.dS + j * kv;
      float *dq = t.dq + j * ck, *dk = t.dk + j * ck, *dg = t.dg + j * ck, *dv = t.dv + j * cv;
      {GLA_PROF(15, "B2 cumsum");
      cumsum_gate_rows(p.gate_per_head, L, K, b, blo, t.rund);}
      const Gates gates{b, blo, K};
      // 2^(b_t) and 2^(b_last - b_t) once for dv, dq, dk and the dS step
      {GLA_PROF(16, "B2 decay");
      for (int64_t r = 0; r < L; ++r) {
        exp2_rows(gates, r, -1, t.es + r * K);
        exp2_rows(gates, L - 1, r, t.ee + r * K);
      }}
      const DecayRows decay{t.es, t.ee};
      if (want_dqk || has(p.dv)) {
        intra_attention(L, K, C, scale, q, kt, gates, t.A, L, want_dqk ? t.wd : nullptr, t.intra);
        if (has(p.dv)) {GLA_PROF(17, "B2 dv"); chunk_dv(L, K, V, C, kt, gates, t.A, dout, dS, dv, t.kl, decay);}
        if (want_dqk) {
          {GLA_PROF(18, "B2 dA");
          intra_dA(L, V, C, scale, dout, v, t.dA, L, t.vt);}
          {GLA_PROF(19, "B2 dqk intra");
          std::memset(dq, 0, static_cast<size_t>(L * K) * 4);
          std::memset(dk, 0, static_cast<size_t>(L * K) * 4);
          intra_dqk(L, K, C, q, kt, gates, t.dA, t.wd, dq, dk, t.dqk);}
          GLA_PROF(20, "B2 inter");
          if (saved) {
            transpose(K, V, static_cast<const float*>(p.h.data) + ((first_chunk + c) * p.H + h0 + j) * kv, V, hot(j), K);
          }
          const float* St = saved || c == nchunks - 1 ? hot(j) : t.states + j * states_per_head + c * kv;
          inter_dqkg(L, K, V, scale, q, kt, v, gates, dout, St, dS, dq, dk,
                     has(p.dg) ? dg : nullptr, t.inter, decay);
          add_self_terms(L, K, C, q, kt, t.dA, dq, dk);
          if (has(p.dg) && p.gate_per_head) {  // dg of a per-head gate: the sum over K, into column 0
            for (int64_t r = 0; r < L; ++r) {
              float acc = 0.0f;
              for (int64_t i = 0; i < K; ++i) acc += dg[r * K + i];
              dg[r * K] = acc;
            }
          }
        }
      }
      GLA_PROF(22, "B2 dstate");
      dstate_step(L, K, V, scale, q, gates, dout, dS, t.kl, t.run, decay);
    }
    GLA_PROF(23, "B2 stores");
    if (has(p.dv)) store_tiles(p.dv, sp.batch, t0, L, h0, G, 0, V, t.dv, cv, V);
    if (has(p.dq)) store_tiles(p.dq, sp.batch, t0, L, h0, G, 0, K, t.dq, ck, K);
    if (has(p.dk)) store_tiles(p.dk, sp.batch, t0, L, h0, G, 0, K, t.dk, ck, K);
    if (has(p.dg)) store_tiles(p.dg, sp.batch, t0, L, h0, G, 0, gk, t.dg, ck, K);
  }
  if (has(p.dh0)) {
    for (int64_t j = 0; j < G; ++j) store_state(p, p.dh0, n, h0 + j, 0, V, t.dS + j * kv);
  }
}

// ---- stage units: item = (sequence, head); chunks per problem.chunk_size ----
inline void run_stage(const gla_problem& p, int64_t item, const Tiles& t) {
  const int64_t h = item % p.H, n = item / p.H;
  const Span sp = span_of(p, n);
  const int64_t K = p.K, V = p.V, C = p.chunk_size;
  const float scale = static_cast<float>(p.scale);
  const Gates gates{t.b, t.blo, K};
  const int64_t nchunks = (sp.length + C - 1) / C;
  const int64_t first_chunk = p.chunk_offsets ? p.chunk_offsets[n] : 0;
  const auto rows = [&](int64_t c) { return std::min(C, sp.length - c * C); };
  switch (p.unit) {
    case GLA_UNIT_CUMSUM: {
      const int64_t kg = p.gcum.sizes[3];
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        gate_cumsum(p, sp.batch, t0, L, h, t.b, t.blo, t.rund);
        for (int64_t r = 0; r < L; ++r) {
          float* dst = static_cast<float*>(p.gcum.data) + off4(p.gcum, sp.batch, t0 + r, h, 0);
          for (int64_t i = 0; i < kg; ++i) dst[i * p.gcum.strides[3]] = t.b[r * K + i];
        }
      }
      break;
    }
    case GLA_UNIT_FWD_H: {
      load_initial_state(p, n, h, 0, V, t.S);
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        copy_to_chunk_state(p, p.h, first_chunk + c, h, t.S);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        state_step(L, K, V, t.k, gates, t.v, t.S, t.S, t.kl, t.run);
      }
      if (has(p.final_state)) store_state(p, p.final_state, n, h, 0, V, t.S);
      break;
    }
    case GLA_UNIT_FWD_INTRA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        intra_attention(L, K, C, scale, t.q, t.k, gates, t.A, C, nullptr, t.intra);
        store_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
      }
      break;
    }
    case GLA_UNIT_FWD_O: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        copy_from_chunk_state(p, p.h, first_chunk + c, h, t.S);
        chunk_output(L, K, V, C, scale, t.q, gates, t.S, t.A, t.v, t.o, t.kl);
        store_tile(p.o, sp.batch, t0, L, h, 0, V, t.o, V);
      }
      break;
    }
    case GLA_UNIT_BWD_DH: {
      if (has(p.dht)) {
        load_state(p, p.dht, n, h, 0, V, t.dS);
      } else {
        std::memset(t.dS, 0, static_cast<size_t>(K * V) * 4);
      }
      for (int64_t c = nchunks - 1; c >= 0; --c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        copy_to_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        dstate_step(L, K, V, scale, t.q, gates, t.dout, t.dS, t.kl, t.run);
      }
      if (has(p.dh0)) store_state(p, p.dh0, n, h, 0, V, t.dS);
      break;
    }
    case GLA_UNIT_BWD_DA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        intra_dA(L, V, C, scale, t.dout, t.v, t.dA, C, t.vt);
        store_tile(p.dA, sp.batch, t0, L, h, 0, C, t.dA, C);
      }
      break;
    }
    case GLA_UNIT_BWD_DV: {
      if (!has(p.dv)) break;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        load_tile(p.A, sp.batch, t0, L, h, 0, C, t.A, C);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        copy_from_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        chunk_dv(L, K, V, C, t.k, gates, t.A, t.dout, t.dS, t.dv, t.kl);
        store_tile(p.dv, sp.batch, t0, L, h, 0, V, t.dv, V);
      }
      break;
    }
    case GLA_UNIT_BWD_DQK_INTRA: {
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        load_tile(p.dA, sp.batch, t0, L, h, 0, C, t.dA, C);
        std::memset(t.dq, 0, static_cast<size_t>(L * K) * 4);
        std::memset(t.dk, 0, static_cast<size_t>(L * K) * 4);
        intra_dqk(L, K, C, t.q, t.k, gates, t.dA, nullptr, t.dq, t.dk, t.dqk);
        add_self_terms(L, K, C, t.q, t.k, t.dA, t.dq, t.dk);
        store_tile(p.dq_intra, sp.batch, t0, L, h, 0, K, t.dq, K);
        store_tile(p.dk_intra, sp.batch, t0, L, h, 0, K, t.dk, K);
      }
      break;
    }
    case GLA_UNIT_BWD_DQKG: {
      if (!has(p.dq) && !has(p.dk) && !has(p.dg)) break;
      for (int64_t c = 0; c < nchunks; ++c) {
        const int64_t L = rows(c), t0 = sp.start + c * C;
        load_tile(p.q, sp.batch, t0, L, h, 0, K, t.q, K);
        load_tile(p.k, sp.batch, t0, L, h, 0, K, t.k, K);
        load_tile(p.v, sp.batch, t0, L, h, 0, V, t.v, V);
        load_gcum(p, sp.batch, t0, L, h, t.b, t.blo);
        if (has(p.do_)) {
          load_tile(p.do_, sp.batch, t0, L, h, 0, V, t.dout, V);
        } else {
          std::memset(t.dout, 0, static_cast<size_t>(L * V) * 4);
        }
        copy_from_chunk_state(p, p.h, first_chunk + c, h, t.S);
        copy_from_chunk_state(p, p.dh, first_chunk + c, h, t.dS);
        load_tile(p.dq_intra, sp.batch, t0, L, h, 0, K, t.dq, K);
        load_tile(p.dk_intra, sp.batch, t0, L, h, 0, K, t.dk, K);
        transpose(K, V, t.S, V, t.inter.st, K);
        inter_dqkg(L, K, V, scale, t.q, t.k, t.v, gates, t.dout, t.inter.st, t.dS, t.dq, t.dk, has(p.dg) ? t.dg : nullptr,
                   t.inter);
        if (has(p.dq)) store_tile(p.dq, sp.batch, t0, L, h, 0, K, t.dq, K);
        if (has(p.dk)) store_tile(p.dk, sp.batch, t0, L, h, 0, K, t.dk, K);
        if (has(p.dg)) store_dg(p, sp.batch, t0, L, h, t.dg);
      }
      break;
    }
    default:
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------------
inline int64_t item_count(const gla_problem& p, int threads) {
  const int64_t group = head_group(p, threads);
  if (p.unit == GLA_UNIT_CHUNK_FWD) return p.N * ((p.H + group - 1) / group) * value_tiles(p);
  if (p.unit == GLA_UNIT_CHUNK_BWD) return p.N * ((p.H + group - 1) / group);
  return p.N * p.H;
}
inline size_t scratch_floats(const gla_problem& p, int threads) {
  size_t total = 0;
  carve(p, head_group(p, threads), nullptr, &total);
  return total;
}
inline void run_item(const gla_problem& p, int threads, int64_t item, float* scratch) {
  size_t total = 0;
  const int64_t group = head_group(p, threads);
  const Tiles t = carve(p, group, scratch, &total);
  if (p.unit == GLA_UNIT_CHUNK_FWD) {
    run_forward(p, item, group, t);
  } else if (p.unit == GLA_UNIT_CHUNK_BWD) {
    run_backward(p, item, group, t);
  } else {
    run_stage(p, item, t);
  }
}

const KernelTable& kernels() {
  static const KernelTable table{GLA_CPU_ISA_NAME, &item_count, &scratch_floats, &run_item};
  return table;
}
