// Tensor I/O of the cpu kernels: sequence spans, strided loads and stores of any float dtype
// converted to and from fp32 tiles, streamed copies of states. Part of kernels.inl.

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
  // plain stores measured 2-7% slower in the backward).
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
  // SPEC.md §3.8: g = -inf (a hard reset) enters the sum at -104, where e^g is already 0 in fp32
  // (below the smallest subnormal), so no span b_t - b_s is -inf - (-inf). NaN stays NaN.
  constexpr float kGateFloor = -104.0f;
  for (int64_t i = 0; i < L * K; i += per_head ? K : 1) b[i] = b[i] < kGateFloor ? kGateFloor : b[i];
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
