// The vector layer of the cpu kernels: one type `vf` of W float lanes and the handful of operations
// the kernels use, selected by the translation unit's compile flags (AVX-512, AVX2+FMA, or portable
// scalar C++). Included inside a per-ISA namespace by kernels_<isa>.cpp; see cpu_kernels.hpp.

#if defined(__AVX512F__)

using vf = __m512;
inline constexpr int W = 16;
// Register tile of the GEMM micro-kernel: 8 rows x 3 vectors = 24 accumulators of 32 zmm registers
// (measured against 4x4, 6x4, 6x3 and 8x2 on the forward's shapes: 8x3 was 10-25% faster).
inline constexpr int kTileRows = 8, kTileVecs = 3;
inline __mmask16 lane_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(lane_mask(n), p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline void vstore_n(float* p, vf x, int n) { _mm512_mask_storeu_ps(p, lane_mask(n), x); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
// out[m] = mul * vsum(x_m) for m < n <= 4, bit for bit: the same additions in the same order as
// _mm512_reduce_add_ps (upper 256 + lower 256, upper 128 + lower 128, elements {2,3} + {0,1},
// then 1 + 0), done for four vectors at once: 7 shuffles and 5 additions instead of 16 and 16.
#define GLA_CPU_HAVE_VSUM4 1
inline void vsum4(vf a, vf b, vf c, vf d, float mul, float* out, int n) {
  const vf ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const vf cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  // 128-bit lane m: the 4 partial sums of vector m
  const vf w = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  const vf x = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4e));
  const vf y = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1));
  const __m128 sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), y));
  _mm_mask_storeu_ps(out, static_cast<__mmask8>((1u << n) - 1u), _mm_mul_ps(sums, _mm_set1_ps(mul)));
}
inline vf vclamp_exp_arg(vf x) {
  // max returns its second operand when one is NaN, so a NaN gate stays NaN. Only the lower bound:
  // it turns -inf (a -inf gate) into 0 instead of NaN; above, vscalef itself overflows to inf for
  // any finite x (every exponent is <= 0 for valid gates anyway), and this is on the hot path.
  return _mm512_max_ps(_mm512_set1_ps(-150.0f), x);
}
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vscale2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
// 16-bit loads of n <= W contiguous elements.
inline void load_f16(const uint16_t* s, float* d, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(lane_mask(n), s);
  vstore_n(d, _mm512_cvtph_ps(h), n);
}
inline void load_bf16(const uint16_t* s, float* d, int n) {
  __m256i h = _mm256_maskz_loadu_epi16(lane_mask(n), s);
  vstore_n(d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)), n);
}
#define GLA_CPU_HAVE_VECTOR_16BIT 1
// dst[c * ldd + r] = src[r * lds + c] for a full 16 x 16 block, in registers (the scalar loop it
// replaced was ~10% of the backward).
// n contiguous floats written with non-temporal stores where 64-byte aligned (outputs are written
// once and not read again by this call: no read-for-ownership, no eviction of the working tiles).
#define GLA_CPU_HAVE_STREAM_STORE 1
inline void stream_row(float* d, const float* s, int64_t n) {
  int64_t i = 0;
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(d) & 63u) / 4);
  if (mis) {
    const int64_t head = std::min<int64_t>(n, 16 - mis);
    std::memcpy(d, s, static_cast<size_t>(head) * 4);
    i = head;
  }
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(d + i, _mm512_loadu_ps(s + i));
  if (i < n) std::memcpy(d + i, s + i, static_cast<size_t>(n - i) * 4);
}
#define GLA_CPU_HAVE_TRANSPOSE16 1
inline void transpose16(const float* src, int64_t lds, float* dst, int64_t ldd) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4a + b] now holds, in 128-bit lane l, column 4l + (b: 0, 1, 2, 3) of rows 4a..4a+3.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);       // lanes 0, 2 of r[i], then of r[4+i]
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);   // lanes 1, 3
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);       // column lane 0
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);   // column lane 2
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);  // column lane 1
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd); // column lane 3
  }
  // r[4l + b] is column 4l + b.
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ldd, r[i]);
}


#elif defined(__AVX2__) && defined(__FMA__)

using vf = __m256;
inline constexpr int W = 8;
// 16 ymm registers: 4 x 2 accumulators + 2 B vectors + 1 broadcast.
inline constexpr int kTileRows = 4, kTileVecs = 2;
inline __m256i lane_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lane_mask(n)); }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline void vstore_n(float* p, vf x, int n) { _mm256_maskstore_ps(p, lane_mask(n), x); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vclamp_exp_arg(vf x) {
  x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
  return _mm256_min_ps(_mm256_set1_ps(127.0f), x);
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p * 2^n for integral n in [-127, 127]; n = -127 gives 0 (exponent field 0).
inline vf vscale2(vf p, vf n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline void load_f16(const uint16_t* s, float* d, int n) {
  if (n == W) {
    vstore(d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))));
    return;
  }
  alignas(16) uint16_t tmp[8] = {};
  for (int i = 0; i < n; ++i) tmp[i] = s[i];
  vstore_n(d, _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(tmp))), n);
}
inline void load_bf16(const uint16_t* s, float* d, int n) {
  if (n == W) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
    vstore(d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    return;
  }
  for (int i = 0; i < n; ++i) {
    uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &u, 4);
  }
}
#define GLA_CPU_HAVE_VECTOR_16BIT 1

#else  // portable scalar

using vf = float;
inline constexpr int W = 1;
inline constexpr int kTileRows = 4, kTileVecs = 4;
inline vf vzero() { return 0.0f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload_n(const float* p, int n) { return n > 0 ? *p : 0.0f; }
inline void vstore(float* p, vf x) { *p = x; }
inline void vstore_n(float* p, vf x, int n) {
  if (n > 0) *p = x;
}
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline float vsum(vf x) { return x; }
inline vf vclamp_exp_arg(vf x) { return x; }
inline vf vround(vf x) { return x; }
inline vf vscale2(vf p, vf) { return p; }

#endif

#if defined(__AVX2__) || defined(__AVX512F__)
// 2^x, x <= 0 in every use (SPEC.md section 3): 2^x = 2^n * 2^f with n the nearest integer and
// |f| <= 1/2, 2^f by a degree-6 polynomial fitted for relative error (9.6e-8 evaluated in fp32,
// as good as the degree-7 Taylor series it replaced, one FMA shorter).
inline vf vexp2(vf x) {
  x = vclamp_exp_arg(x);
  const vf n = vround(x);
  const vf f = vsub(x, n);
  vf p = vset(1.5345805961812907e-04f);
  p = vfma(p, f, vset(1.3399931169820417e-03f));
  p = vfma(p, f, vset(9.61848897954498e-03f));
  p = vfma(p, f, vset(5.550328777118035e-02f));
  p = vfma(p, f, vset(2.4022646890427046e-01f));
  p = vfma(p, f, vset(6.931472057371706e-01f));
  p = vfma(p, f, vset(1.0000000005541925f));
  return vscale2(p, n);
}
#else
inline vf vexp2(vf x) { return std::exp2(x); }
#endif

// Calls body(column, lanes) for the vectors covering [0, n), the last one possibly partial.
template <class Body>
inline void for_vectors(int64_t n, Body&& body) {
  int64_t c = 0;
  for (; c + W <= n; c += W) body(c, W);
  if (c < n) body(c, static_cast<int>(n - c));
}
inline vf vload_k(const float* p, int lanes) { return lanes == W ? vload(p) : vload_n(p, lanes); }
inline void vstore_k(float* p, vf x, int lanes) {
  if (lanes == W) {
    vstore(p, x);
  } else {
    vstore_n(p, x, lanes);
  }
}
