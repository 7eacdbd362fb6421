// Standalone harness for the CUDA forward kernels (no libgla core needed): correctness against an
// fp64 token loop on the host, and CUDA-event timings.
//   harness check              correctness grid (small shapes)
//   harness bench B T H D ...  timings (median of 30) for shapes given as BxTxHxD (suffix h: fp16; s: the
//                               chunk states stored too, as the training forward does), or "varlen"
//   harness first              first-call latency in this fresh process
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "backends/cuda/chunk_forward.hpp"

using namespace gla::cuda;

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                        \
    }                                                                                      \
  } while (0)

static uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
static float bf2f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
static float h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }

struct Case {
  int64_t B = 1, T = 64, H = 1, K = 64, V = 64;
  int dtype = kBF16;
  int gate_dtype = -1;  // -1: same as dtype
  bool per_head = false;
  double norm = 1.0;
  bool randn = false;
  double gate_floor = 0.0;
  bool h0 = true, ht = true, v_first = false;
  bool chunk_states = false;  // the forward also stores the bf16 chunk-start states (training's forward)
  std::vector<int64_t> cu;
  std::string name;
};

static int esize(int t) { return t == kF32 ? 4 : 2; }

// Host buffer of a dtype filled from doubles; returns the rounded values.
static std::vector<unsigned char> encode(const std::vector<double>& x, int type, std::vector<double>& rounded) {
  std::vector<unsigned char> b(x.size() * esize(type));
  rounded.resize(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    if (type == kF32) {
      float f = float(x[i]);
      std::memcpy(&b[i * 4], &f, 4);
      rounded[i] = f;
    } else if (type == kBF16) {
      uint16_t h = f2bf(float(x[i]));
      std::memcpy(&b[i * 2], &h, 2);
      rounded[i] = bf2f(h);
    } else {
      uint16_t h = f2h(float(x[i]));
      std::memcpy(&b[i * 2], &h, 2);
      rounded[i] = h2f(h);
    }
  }
  return b;
}
static std::vector<double> decode(const std::vector<unsigned char>& b, int type, size_t n) {
  std::vector<double> x(n);
  for (size_t i = 0; i < n; ++i) {
    if (type == kF32) {
      float f;
      std::memcpy(&f, &b[i * 4], 4);
      x[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &b[i * 2], 2);
      x[i] = type == kBF16 ? bf2f(h) : h2f(h);
    }
  }
  return x;
}

struct Dev {
  void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *o = nullptr, *cu = nullptr;
  float *h0 = nullptr, *ht = nullptr;
  void* ws = nullptr;
  uint16_t* states = nullptr;
};

struct Problem {
  Case c;
  int64_t N;
  std::vector<int64_t> offs;
  std::vector<double> q, k, v, g, h0;  // rounded values
  Dev d;
  ForwardParams p{};
  ForwardPlan plan{};
};

// Timing runs (need_host false) fill the inputs on the device: the host path (fp64 values for the
// reference, rounded copies) took ~12 s per B8 T4096 H16 D128 shape. Element i of a tensor is a
// function of (seed, i) through splitmix64: uniform [0, 1), normal by Box-Muller, or the gate
// logsigmoid(u) / norm with the gate_floor rule.
__device__ __host__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
enum FillKind { kUniform, kNormal, kGate };
__global__ void fill_kernel(void* dst, size_t n, int type, uint64_t seed, int kind, float norm, float floor_value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t r1 = splitmix64(seed * 0x100000001b3ull + 2 * i), r2 = splitmix64(seed * 0x100000001b3ull + 2 * i + 1);
    const float u1 = float(r1 >> 40) * (1.0f / 16777216.0f), u2 = float(r2 >> 40) * (1.0f / 16777216.0f);
    float x = u1;
    if (kind == kNormal) x = sqrtf(-2.0f * logf(fmaxf(u1, 1e-12f))) * cospif(2.0f * u2);
    if (kind == kGate) {
      x = -log1pf(expf(-u1)) / norm;
      if (floor_value < 0.0f && u2 < 0.1f) x = floor_value;
    }
    if (type == kF32) {
      static_cast<float*>(dst)[i] = x;
    } else if (type == kBF16) {
      static_cast<__nv_bfloat16*>(dst)[i] = __float2bfloat16_rn(x);
    } else {
      static_cast<__half*>(dst)[i] = __float2half_rn(x);
    }
  }
}
static void* device_filled(size_t n, int type, uint64_t seed, int kind, double norm = 1.0, double floor_value = 0.0) {
  void* d = nullptr;
  CK(cudaMalloc(&d, n * esize(type) + 16));
  if (n > 0) {
    fill_kernel<<<1024, 256>>>(d, n, type, seed, kind, float(norm), float(floor_value));
    CK(cudaGetLastError());
  }
  return d;
}

static void setup(Problem& P, uint64_t seed, bool need_host) {
  Case& c = P.c;
  if (c.gate_dtype < 0) c.gate_dtype = c.dtype;
  P.N = c.cu.empty() ? c.B : int64_t(c.cu.size()) - 1;
  P.offs.clear();
  if (c.cu.empty()) {
    for (int64_t n = 0; n <= c.B; ++n) P.offs.push_back(n == c.B ? c.T : 0);
    P.offs.assign(c.B + 1, 0);
    for (int64_t n = 0; n <= c.B; ++n) P.offs[n] = 0;
    for (int64_t n = 1; n <= c.B; ++n) P.offs[n] = c.T;  // per-row offsets (0, T) pattern
  } else {
    P.offs = c.cu;
  }
  const size_t nqk = size_t(c.B * c.T * c.H * c.K), nv = size_t(c.B * c.T * c.H * c.V);
  const size_t ng = c.per_head ? size_t(c.B * c.T * c.H) : nqk;
  const size_t nst = size_t(P.N * c.H * c.K * c.V);
  if (!need_host) {
    const int kind = c.randn ? kNormal : kUniform;
    P.d.q = device_filled(nqk, c.dtype, seed * 8 + 0, kind);
    P.d.k = device_filled(nqk, c.dtype, seed * 8 + 1, kind);
    P.d.v = device_filled(nv, c.dtype, seed * 8 + 2, kind);
    P.d.g = device_filled(ng, c.gate_dtype, seed * 8 + 3, kGate, c.norm, c.gate_floor);
    if (c.h0) P.d.h0 = static_cast<float*>(device_filled(nst, kF32, seed * 8 + 4, kind));
    CK(cudaDeviceSynchronize());
  }
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  std::normal_distribution<double> Nr(0.0, 1.0);
  std::vector<double> q(need_host ? nqk : 0), k(need_host ? nqk : 0), v(need_host ? nv : 0), g(need_host ? ng : 0);
  for (auto& x : q) x = c.randn ? Nr(rng) : U(rng);
  for (auto& x : k) x = c.randn ? Nr(rng) : U(rng);
  for (auto& x : v) x = c.randn ? Nr(rng) : U(rng);
  for (auto& x : g) {
    double u = U(rng);
    x = -std::log1p(std::exp(-u)) / c.norm;  // logsigmoid(u) / norm
    if (c.gate_floor < 0 && U(rng) < 0.1) x = c.gate_floor;
  }
  if (need_host) {
    auto bq = encode(q, c.dtype, P.q), bk = encode(k, c.dtype, P.k), bv = encode(v, c.dtype, P.v);
    auto bg = encode(g, c.gate_dtype, P.g);
    std::vector<float> h0(nst);
    P.h0.resize(nst);
    for (size_t i = 0; i < nst; ++i) {
      h0[i] = float(c.randn ? Nr(rng) : U(rng));
      P.h0[i] = h0[i];
    }
    CK(cudaMalloc(&P.d.q, bq.size()));
    CK(cudaMalloc(&P.d.k, bk.size()));
    CK(cudaMalloc(&P.d.v, bv.size()));
    CK(cudaMalloc(&P.d.g, bg.size()));
    CK(cudaMemcpy(P.d.q, bq.data(), bq.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(P.d.k, bk.data(), bk.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(P.d.v, bv.data(), bv.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(P.d.g, bg.data(), bg.size(), cudaMemcpyHostToDevice));
    if (c.h0) {
      CK(cudaMalloc(&P.d.h0, nst * 4));
      CK(cudaMemcpy(P.d.h0, h0.data(), nst * 4, cudaMemcpyHostToDevice));
    }
  }
  CK(cudaMalloc(&P.d.o, nv * esize(c.dtype)));
  if (c.ht) CK(cudaMalloc(&P.d.ht, nst * 4));
  if (!c.cu.empty()) {
    CK(cudaMalloc(&P.d.cu, c.cu.size() * 8));
    CK(cudaMemcpy(P.d.cu, c.cu.data(), c.cu.size() * 8, cudaMemcpyHostToDevice));
  }

  ForwardParams& p = P.p;
  p = ForwardParams{};
  p.q = P.d.q;
  p.k = P.d.k;
  p.v = P.d.v;
  p.g = P.d.g;
  p.o = P.d.o;
  auto strides = [&](int64_t* s, int64_t D) {
    s[0] = c.T * c.H * D;
    s[1] = c.H * D;
    s[2] = D;
  };
  strides(p.q_stride, c.K);
  strides(p.k_stride, c.K);
  strides(p.v_stride, c.V);
  strides(p.o_stride, c.V);
  strides(p.g_stride, c.per_head ? 1 : c.K);
  p.initial_state = P.d.h0;
  p.final_state = P.d.ht;
  auto sstr = [&](int64_t* s) {
    const int64_t a = c.v_first ? c.K : c.V, b = c.v_first ? c.V : c.K;
    s[3] = 1;
    s[2] = a;
    s[1] = a * b;
    s[0] = a * b * c.H;
  };
  sstr(p.h0_stride);
  sstr(p.ht_stride);
  p.state_v_first = c.v_first;
  p.cu_seqlens = P.d.cu;
  p.cu_seqlens_int64 = 1;
  p.varlen = !c.cu.empty();
  p.B = c.B;
  p.T = c.T;
  p.H = c.H;
  p.K = c.K;
  p.V = c.V;
  p.N = P.N;
  p.scale = float(1.0 / std::sqrt(double(c.K)));
  p.dtype = c.dtype;
  p.gate_dtype = c.gate_dtype;
  p.gate_per_head = c.per_head;
  p.vector_loads = (c.K % 8 == 0 && c.V % 8 == 0) ? 1 : 0;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::vector<int64_t> so(P.N + 1);
  if (c.cu.empty()) {
    for (int64_t n = 0; n <= P.N; ++n) so[n] = n * c.T;
  } else {
    so = c.cu;
  }
  P.plan = plan_forward(p, so.data(), sms);
  // GLA_SEGMENT=n (harness only, for calibrating the planner): force segments of n chunks
  // (0: no split). Workspace as plan_forward sizes it.
  if (const char* seg = std::getenv("GLA_SEGMENT"); seg != nullptr && is_chunk(P.plan.kernel) && !P.plan.key_split) {
    int64_t max_chunks = 0;
    for (int64_t n = 0; n < P.N; ++n) max_chunks = std::max<int64_t>(max_chunks, (so[n + 1] - so[n] + 63) / 64);
    const int64_t want = std::atoll(seg);
    P.plan.segment_chunks = want <= 0 || want >= max_chunks ? std::max<int64_t>(1, max_chunks) : want;
    P.plan.whole_chunks = 0;
    P.plan.max_segments = (max_chunks + P.plan.segment_chunks - 1) / P.plan.segment_chunks;
    if (P.plan.max_segments < 1) P.plan.max_segments = 1;
    const size_t per = size_t(P.plan.value_tiles) * P.plan.value_tile * P.plan.head_dim_k + P.plan.head_dim_k;
    P.plan.workspace_bytes = P.plan.max_segments > 1 ? size_t(P.N) * P.plan.max_segments * c.H * per * sizeof(float) : 0;
    order_blocks(P.plan, so.data(), P.N);
  }
  // GLA_ORDER=0 (harness only, A/B): the natural block order.
  if (const char* o = std::getenv("GLA_ORDER"); o != nullptr && std::atoi(o) == 0) P.plan.block_order_count = 0;
  if (P.plan.workspace_bytes) CK(cudaMalloc(&P.d.ws, P.plan.workspace_bytes));
  if (c.chunk_states) {  // [chunks, H, K, V] bf16, as the cuda backend passes them
    const int64_t chunks = c.cu.empty() ? c.B * ((c.T + 63) / 64) : (c.T + 63) / 64;
    CK(cudaMalloc(&P.d.states, size_t(chunks) * c.H * c.K * c.V * 2));
    P.p.chunk_states = P.d.states;
    P.p.chunk_states_stride[0] = P.p.chunk_states_stride[1] = c.H * c.K * c.V;
    P.p.chunk_states_stride[2] = c.K * c.V;
    P.p.chunk_states_stride[3] = c.V;
  }
}

static void release(Problem& P) {
  for (void* x : {P.d.q, P.d.k, P.d.v, P.d.g, P.d.o, P.d.cu, (void*)P.d.h0, (void*)P.d.ht, P.d.ws, (void*)P.d.states})
    if (x) cudaFree(x);
  P.d = Dev{};
}

static void poison(Problem& P) {
  const Case& c = P.c;
  CK(cudaMemset(P.d.o, 0xff, size_t(c.B * c.T * c.H * c.V) * esize(c.dtype)));
  if (P.d.ht) CK(cudaMemset(P.d.ht, 0xff, size_t(P.N * c.H * c.K * c.V) * 4));
  if (P.d.ws) CK(cudaMemset(P.d.ws, 0xff, P.plan.workspace_bytes));
}

// fp64 token loop; returns o [B,T,H,V] and ht [N,H,K,V] (v_first honoured).
static void reference(const Problem& P, std::vector<double>& o, std::vector<double>& ht) {
  const Case& c = P.c;
  o.assign(size_t(c.B * c.T * c.H * c.V), 0.0);
  ht.assign(size_t(P.N * c.H * c.K * c.V), 0.0);
  const double scale = 1.0 / std::sqrt(double(c.K));
  std::vector<double> S(size_t(c.K * c.V));
  for (int64_t n = 0; n < P.N; ++n) {
    const int64_t b = c.cu.empty() ? n : 0;
    const int64_t bos = c.cu.empty() ? 0 : c.cu[n], len = c.cu.empty() ? c.T : c.cu[n + 1] - c.cu[n];
    for (int64_t h = 0; h < c.H; ++h) {
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < c.V; ++j) {
          const size_t si = c.v_first ? size_t(((n * c.H + h) * c.V + j) * c.K + i) : size_t(((n * c.H + h) * c.K + i) * c.V + j);
          S[i * c.V + j] = c.h0 ? P.h0[si] : 0.0;
        }
      for (int64_t tt = 0; tt < len; ++tt) {
        const int64_t t = bos + tt;
        const size_t base = size_t(((b * c.T + t) * c.H + h));
        for (int64_t i = 0; i < c.K; ++i) {
          const double gi = c.per_head ? P.g[base] : P.g[base * c.K + i];
          const double e = std::exp(gi), ki = P.k[base * c.K + i];
          for (int64_t j = 0; j < c.V; ++j) S[i * c.V + j] = e * S[i * c.V + j] + ki * P.v[base * c.V + j];
        }
        for (int64_t j = 0; j < c.V; ++j) {
          double acc = 0;
          for (int64_t i = 0; i < c.K; ++i) acc += P.q[base * c.K + i] * S[i * c.V + j];
          o[base * c.V + j] = scale * acc;
        }
      }
      for (int64_t i = 0; i < c.K; ++i)
        for (int64_t j = 0; j < c.V; ++j) {
          const size_t si = c.v_first ? size_t(((n * c.H + h) * c.V + j) * c.K + i) : size_t(((n * c.H + h) * c.K + i) * c.V + j);
          ht[si] = S[i * c.V + j];
        }
    }
  }
}

static double rel_rms(const std::vector<double>& a, const std::vector<double>& r, int64_t* nonfinite) {
  double num = 0, den = 0;
  *nonfinite = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) {
      ++*nonfinite;
      continue;
    }
    num += (a[i] - r[i]) * (a[i] - r[i]);
    den += r[i] * r[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

static int run_check() {
  std::vector<Case> cases;
  auto add = [&](Case c, const char* name) {
    c.name = name;
    cases.push_back(c);
  };
  for (int dt : {kBF16, kF16, kF32}) {
    Case c;
    c.dtype = dt;
    c.B = 1; c.T = 63; c.H = 1; c.K = c.V = 64; add(c, "1x63x1x64");
    c.B = 2; c.T = 1024; c.H = 4; c.K = c.V = 60; add(c, "2x1024x4x60");
    c.T = 1024; c.H = 2; c.K = c.V = 128; c.norm = 0.1; add(c, "2x1024x2x128 n0.1");
    c.norm = 1; add(c, "2x1024x2x128 n1");
    c.norm = 10; add(c, "2x1024x2x128 n10");
    c.norm = 1; c.B = 2; c.T = 2048; c.H = 2; c.K = c.V = 64; add(c, "2x2048x2x64");
    c.B = 1; c.T = 128; c.H = 2; c.K = c.V = 256; add(c, "1x128x2x256");
    c.B = 1; c.T = 64; c.H = 2; c.K = c.V = 320; add(c, "1x64x2x320");
  }
  {
    Case c;
    c.K = 64; c.V = 128; c.B = 2; c.T = 300; c.H = 2; add(c, "K64 V128");
    c.K = 128; c.V = 64; add(c, "K128 V64");
    c.K = 100; c.V = 100; add(c, "K100 V100");
    c.K = 128; c.V = 256; add(c, "K128 V256");
    c.K = 256; c.V = 512; add(c, "K256 V512");  // the key split, several chunks, a partial last one
    c.K = 200; c.V = 72; add(c, "K200 V72");
    c.K = 256; c.V = 128; c.gate_dtype = kF32; add(c, "K256 fp32 gate");
    // V = 512: four value tiles, so the halves copy prepared inputs (ForwardPlan::prepared)
    c.V = 512; c.gate_dtype = -1; c.per_head = true; add(c, "K256 V512 per-head gate");
    c.per_head = false; c.randn = true; add(c, "K256 V512 randn");
    c.randn = false; c.norm = 0.1; c.gate_floor = -20; add(c, "K256 V512 strong decay g=-20");
    c.norm = 1; c.gate_floor = 0;
    c.K = 200; c.V = 480; c.v_first = true; add(c, "K200 V480 v_first");
    c.v_first = false; c.B = 1; c.T = 4000; c.H = 1; add(c, "K200 V480 1x4000x1 (split)");
    c.B = 2; c.T = 300; c.H = 2; c.V = 128;
    c.K = 128; c.V = 128; c.gate_dtype = kF32; add(c, "fp32 gate");
    c.gate_dtype = -1; c.per_head = true; add(c, "per-head gate");
    c.gate_dtype = kF32; add(c, "per-head fp32 gate");
    c.gate_dtype = -1; c.per_head = false; c.v_first = true; add(c, "v_first");
    c.v_first = false; c.h0 = false; add(c, "no h0");
    c.h0 = true; c.ht = false; add(c, "no ht");
    c.ht = true; c.randn = true; add(c, "randn");
    c.randn = false; c.norm = 0.1; c.gate_floor = -20; add(c, "strong decay g=-20");
    c.norm = 1; c.gate_floor = 0;
    c.B = 1; c.T = 15; c.cu = {0, 15}; add(c, "varlen [0,15]");
    c.T = 16; c.cu = {0, 0, 16}; add(c, "varlen [0,0,16]");
    c.T = 1000; c.cu = {0, 256, 500, 1000}; add(c, "varlen [0,256,500,1000]");
    c.T = 2000; c.cu = {0, 15, 100, 300, 1200, 2000}; add(c, "varlen 5 seqs");
    c.K = c.V = 64; add(c, "varlen 5 seqs K64");
    c.K = c.V = 100; add(c, "varlen 5 seqs K100");
    c.K = c.V = 256; add(c, "varlen 5 seqs K256");
    c.V = 512; add(c, "varlen 5 seqs K256 V512");
    c.V = 256;
    c.K = c.V = 128; c.T = 9000; c.cu = {0, 1, 4500, 4500, 4501, 9000}; add(c, "varlen long + 1 + empty");
    // Many heads, one long sequence: the plan keeps the others whole (ForwardPlan::whole_chunks 24,
    // the long one in segments of 8 on 132 SMs).
    c.H = 16; c.T = 11500; c.cu = {0, 4000, 5500, 7000, 8500, 10000, 11500}; add(c, "varlen H16 long + whole");
    c.cu.clear(); c.B = 1; c.T = 8192; c.H = 1; add(c, "1x8192x1x128 (split)");
    c.K = c.V = 64; c.T = 16384; add(c, "1x16384x1x64 (split)");
    c.v_first = true; add(c, "split v_first");
  }
  int fails = 0;
  uint64_t seed = 1;
  // GLA_CHECK_SMALL=1: only small cases (for compute-sanitizer).
  const bool small = std::getenv("GLA_CHECK_SMALL") != nullptr;
  for (Case& c : cases) {
    if (small && (c.B * c.T > 1100 || c.dtype != kBF16)) continue;  // the key split (K > 128) included
    Problem P;
    P.c = c;
    setup(P, seed++, true);
    poison(P);
    CK(launch_forward(P.p, P.plan, P.d.ws, 0));
    CK(cudaDeviceSynchronize());
    std::vector<double> ro, rh;
    reference(P, ro, rh);
    std::vector<unsigned char> ob(ro.size() * esize(c.dtype));
    CK(cudaMemcpy(ob.data(), P.d.o, ob.size(), cudaMemcpyDeviceToHost));
    auto o = decode(ob, c.dtype, ro.size());
    // varlen: tokens outside every sequence do not exist (cu covers all T), so compare all.
    int64_t nf_o = 0, nf_h = 0;
    const double eo = rel_rms(o, ro, &nf_o);
    double eh = 0;
    if (c.ht) {
      std::vector<float> hb(rh.size());
      CK(cudaMemcpy(hb.data(), P.d.ht, hb.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<double> hd(hb.begin(), hb.end());
      eh = rel_rms(hd, rh, &nf_h);
    }
    const double tol = c.dtype == kF32 ? 1e-3 : 5e-3;
    const bool ok = eo < tol && eh < tol && nf_o == 0 && nf_h == 0;
    fails += !ok;
    std::printf("%-4s %-6s %-28s o %.2e ht %.2e nonfinite %lld/%lld path %s seg %lld x %lld whole %lld order %d\n",
                ok ? "ok" : "FAIL", c.dtype == kBF16 ? "bf16" : c.dtype == kF16 ? "fp16" : "fp32", c.name.c_str(), eo, eh,
                (long long)nf_o, (long long)nf_h, kernel_name(P.plan.kernel).id, (long long)P.plan.max_segments,
                (long long)P.plan.segment_chunks, (long long)P.plan.whole_chunks, P.plan.block_order_count);
    // Determinism: a second run gives identical bytes.
    if (is_chunk(P.plan.kernel)) {
      CK(launch_forward(P.p, P.plan, P.d.ws, 0));
      CK(cudaDeviceSynchronize());
      std::vector<unsigned char> ob2(ob.size());
      CK(cudaMemcpy(ob2.data(), P.d.o, ob2.size(), cudaMemcpyDeviceToHost));
      if (ob2 != ob) {
        std::printf("FAIL nondeterministic output\n");
        ++fails;
      }
    }
    release(P);
  }
  std::printf("check: %d failures of %zu cases\n", fails, cases.size());
  return fails ? 1 : 0;
}

static float time_ms(Problem& P, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CK(launch_forward(P.p, P.plan, P.d.ws, 0));
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a));
    CK(launch_forward(P.p, P.plan, P.d.ws, 0));
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

static Case parse_shape(const std::string& s) {
  Case c;
  c.h0 = false;
  c.ht = true;
  if (s == "varlen") {
    std::vector<int64_t> lens = {4096, 512, 3000, 1, 2048, 7000, 64, 65, 1024, 4000, 333, 2500, 1500, 3000, 2000, 1626};
    c.cu = {0};
    for (auto l : lens) c.cu.push_back(c.cu.back() + l);
    c.B = 1; c.T = c.cu.back(); c.H = 16; c.K = c.V = 128;
  } else {
    long long B, T, H, D, V;  // BxTxHxD (K = V = D) or BxTxHxKxV
    const int fields = std::sscanf(s.c_str(), "%lldx%lldx%lldx%lldx%lld", &B, &T, &H, &D, &V);
    c.B = B; c.T = T; c.H = H; c.K = c.V = D;
    if (fields == 5) c.V = V;
  }
  // Suffixes: "h" fp16 inputs (default bf16), "s" the chunk states stored too ("BxTxHxDhs": both).
  for (size_t i = s.find_last_of("0123456789") + 1; i < s.size() && s != "varlen"; ++i) {
    if (s[i] == 'h') c.dtype = kF16;
    if (s[i] == 's') c.chunk_states = true;
  }
  c.name = s;
  return c;
}

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "check";
  if (mode == "first") {
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaFree(nullptr));
    auto t1 = std::chrono::steady_clock::now();
    Problem P;
    P.c = parse_shape("8x4096x16x128");
    setup(P, 7, false);
    CK(cudaDeviceSynchronize());
    auto t2 = std::chrono::steady_clock::now();
    CK(launch_forward(P.p, P.plan, P.d.ws, 0));
    CK(cudaDeviceSynchronize());
    auto t3 = std::chrono::steady_clock::now();
    CK(launch_forward(P.p, P.plan, P.d.ws, 0));
    CK(cudaDeviceSynchronize());
    auto t4 = std::chrono::steady_clock::now();
    auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
    std::printf("first: context init %.1f ms, first forward call %.2f ms, second %.2f ms\n", ms(t0, t1), ms(t2, t3), ms(t3, t4));
    return 0;
  }
  if (mode == "bench") {
    for (int i = 2; i < argc; ++i) {
      Problem P;
      P.c = parse_shape(argv[i]);
      setup(P, 11, false);
      const float ms = time_ms(P, 30);
      const Case& c = P.c;
      const double bytes = double(c.B * c.T * c.H) * (3 * c.K + 2 * c.V) * 2;
      std::printf("bench %-16s %.4f ms  (%.2f TB/s eff)  plan: %s dk %d bv %d seg %lld x %lld chunks ws %.1f MB order %d\n", argv[i], ms,
                  bytes / (ms * 1e-3) / 1e12, kernel_name(P.plan.kernel).id, P.plan.head_dim_k, P.plan.value_tile, (long long)P.plan.max_segments,
                  (long long)P.plan.segment_chunks, P.plan.workspace_bytes / 1e6, P.plan.block_order_count);
      release(P);
    }
    return 0;
  }
  return run_check();
}
