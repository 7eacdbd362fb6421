// wgmma probe (sm_90a): checks, on the GPU, the shared-memory layouts and descriptor fields that a
// wgmma version of the warp-specialised kernel's state group would use, before any kernel is built
// on them. Standalone; not part of the library or the tests.
//
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -o build-cuda/wgmma_probe bench/cuda/wgmma_probe.cu
//   ./build-cuda/wgmma_probe          (device_run.sh step `wgmma`)
//
// The state group's three products, per warp group of 4 warps (64 value rows v):
//   o^T[v,t]  = S^T[v,k] qg[t,k]^T   M=v, N=t (64), K=k: A = S^T from registers, B = qg stored [t][k]  (K-major)
//   o^T[v,t] += V^T[v,s] A[t,s]^T    M=v, N=t (64), K=s: A = V^T from registers, B = A stored [t][s]   (K-major)
//   S^T[v,k] += V^T[v,s] kg[s,k]     M=v, N=k (128), K=s: A = V^T from registers, B = kg stored [s][k] (N-major,
//                                     imm-trans-b = 1)
// Case 1 is a K-major B with 128-byte swizzle; case 2 an N-major B with 128-byte swizzle, in two atom
// placements and both assignments of the leading/stride byte offsets (the PTX text for MN-major
// swizzled layouts is the uncertain part). Each case runs D = A B over K = 64 (four k16 steps) on
// random bf16 values and compares with a host fp64 product; it prints PASS/FAIL and the relative
// RMS error per variant. A variant that passes gives the descriptor to use.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__);      \
      std::exit(2);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int kM = 64, kK = 64;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// Descriptor: start address, LBO and SBO in 16-byte units (bits 0-13, 16-29, 32-45), layout type in
// bits 62-63 (1 = 128-byte swizzle).
__device__ __forceinline__ uint64_t make_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo, uint32_t layout) {
  uint64_t d = 0;
  d |= uint64_t((saddr >> 4) & 0x3fff);
  d |= uint64_t((lbo >> 4) & 0x3fff) << 16;
  d |= uint64_t((sbo >> 4) & 0x3fff) << 32;
  d |= uint64_t(layout & 3) << 62;
  return d;
}

__device__ __forceinline__ void wgmma_m64n64k16_rs_tb0(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}

__device__ __forceinline__ void wgmma_m64n128k16_rs_tb1(float (&d)[64], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
}


struct Variant {
  const char* name;
  int n;           // 64 or 128
  int trans_b;     // 0 K-major, 1 N-major
  uint32_t lbo, sbo;
  uint32_t kstep;  // start-address advance (bytes) per k16 step
  std::function<size_t(int k, int n)> byte_of;  // where B[k][n] lives in the 8 KB .. 16 KB image
};

// One warp group: A (M x K, row-major bf16) from registers, B image copied to shared memory.
template <int N, int TB>
__global__ void probe_kernel(const uint16_t* a, const unsigned char* bimg, int bbytes, float* d, uint32_t lbo, uint32_t sbo,
                             uint32_t kstep) {
  extern __shared__ __align__(1024) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid * 16; i < bbytes; i += 128 * 16) *reinterpret_cast<uint4*>(smem + i) = *reinterpret_cast<const uint4*>(bimg + i);
  // The generic-proxy stores must be visible to wgmma's async-proxy reads: fence, then barrier.
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  float acc[N / 2];
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const int r0 = warp * 16 + (lane >> 2), c0 = (lane & 3) * 2;
  for (int ks = 0; ks < kK / 16; ++ks) {
    // mma-style A fragment: (r0, c0..c0+1), (r0+8, ..), (r0, c0+8..), (r0+8, c0+8..)
    uint32_t af[4];
    auto pair = [&](int r, int c) {
      return uint32_t(a[r * kK + c]) | (uint32_t(a[r * kK + c + 1]) << 16);
    };
    const int kc = ks * 16 + c0;
    af[0] = pair(r0, kc);
    af[1] = pair(r0 + 8, kc);
    af[2] = pair(r0, kc + 8);
    af[3] = pair(r0 + 8, kc + 8);
    const uint64_t desc = make_desc(smem_u32(smem) + ks * kstep, lbo, sbo, 1);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if constexpr (N == 64) {
      wgmma_m64n64k16_rs_tb0(reinterpret_cast<float(&)[32]>(acc), af, desc, 1);
    } else {
      wgmma_m64n128k16_rs_tb1(reinterpret_cast<float(&)[64]>(acc), af, desc, 1);
    }
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  }
  // D fragment: for j < N/8: acc[4j], acc[4j+1] at (r0, 8j + c0 ..), acc[4j+2], acc[4j+3] at (r0 + 8, ..)
  for (int j = 0; j < N / 8; ++j) {
    d[r0 * N + 8 * j + c0] = acc[4 * j];
    d[r0 * N + 8 * j + c0 + 1] = acc[4 * j + 1];
    d[(r0 + 8) * N + 8 * j + c0] = acc[4 * j + 2];
    d[(r0 + 8) * N + 8 * j + c0 + 1] = acc[4 * j + 3];
  }
}

static uint16_t to_bf16(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
static float from_bf16(uint16_t u) {
  uint32_t w = uint32_t(u) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// 128-byte swizzle of a byte offset inside a 1024-byte-aligned atom: 16-byte chunk ^= row % 8.
static size_t swz128(size_t off) { return off ^ (((off >> 7) & 7) << 4); }

int main() {
  int major = 0;
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9) {
    std::printf("SKIP: needs sm_90 (found %d.x)\n", major);
    return 0;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<Variant> vs;
  // Case 1: B[k][n] stored as [n][k] rows of 64 k (128 B), 128-byte swizzle; SBO = 1024 (8 n-rows);
  // LBO unused for swizzled K-major; k16 step = +32 bytes inside the row.
  vs.push_back({"K-major B, N=64, SW128, SBO=1024", 64, 0, 16, 1024, 32,
                [](int k, int n) { return swz128(size_t(n) * 128 + size_t(k) * 2); }});
  // Case 2: B[k][n] stored with n contiguous: atoms of 8 k-rows x 64 n (128 B rows), 128-byte swizzle.
  // Placement P: atom (na, ka) at (na * 8 + ka) * 1024 (k-direction atoms adjacent);
  // placement Q: atom (na, ka) at (ka * 2 + na) * 1024 (n-direction atoms adjacent).
  auto P = [](int k, int n) { return size_t((n / 64) * 8 + k / 8) * 1024 + swz128(size_t(k % 8) * 128 + size_t(n % 64) * 2); };
  auto Q = [](int k, int n) { return size_t((k / 8) * 2 + n / 64) * 1024 + swz128(size_t(k % 8) * 128 + size_t(n % 64) * 2); };
  vs.push_back({"N-major B, N=128, SW128, P, LBO=n-atom 8192, SBO=k-atom 1024", 128, 1, 8192, 1024, 2048, P});
  vs.push_back({"N-major B, N=128, SW128, P, LBO=k-atom 1024, SBO=n-atom 8192", 128, 1, 1024, 8192, 2048, P});
  vs.push_back({"N-major B, N=128, SW128, Q, LBO=n-atom 1024, SBO=k-atom 2048", 128, 1, 1024, 2048, 4096, Q});
  vs.push_back({"N-major B, N=128, SW128, Q, LBO=k-atom 2048, SBO=n-atom 1024", 128, 1, 2048, 1024, 4096, Q});

  int fails = 0, passes = 0;
  for (const Variant& v : vs) {
    const int N = v.n;
    std::vector<uint16_t> a(kM * kK), b(kK * N);
    for (auto& x : a) x = to_bf16(U(rng));
    for (auto& x : b) x = to_bf16(U(rng));
    const int bbytes = 16384;
    std::vector<unsigned char> img(bbytes, 0);
    for (int k = 0; k < kK; ++k)
      for (int n = 0; n < N; ++n) {
        const size_t off = v.byte_of(k, n);
        if (off + 2 > size_t(bbytes)) {
          std::printf("layout out of range in %s\n", v.name);
          return 2;
        }
        std::memcpy(&img[off], &b[k * N + n], 2);
      }
    uint16_t* da;
    unsigned char* db;
    float* dd;
    CK(cudaMalloc(&da, a.size() * 2));
    CK(cudaMalloc(&db, bbytes));
    CK(cudaMalloc(&dd, kM * N * 4));
    CK(cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(db, img.data(), bbytes, cudaMemcpyHostToDevice));
    CK(cudaMemset(dd, 0xff, kM * N * 4));  // NaN poison
    if (N == 64) {
      CK(cudaFuncSetAttribute(probe_kernel<64, 0>, cudaFuncAttributeMaxDynamicSharedMemorySize, bbytes));
      probe_kernel<64, 0><<<1, 128, bbytes>>>(da, db, bbytes, dd, v.lbo, v.sbo, v.kstep);
    } else {
      CK(cudaFuncSetAttribute(probe_kernel<128, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, bbytes));
      probe_kernel<128, 1><<<1, 128, bbytes>>>(da, db, bbytes, dd, v.lbo, v.sbo, v.kstep);
    }
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> d(kM * N);
    CK(cudaMemcpy(d.data(), dd, d.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int m = 0; m < kM; ++m)
      for (int n = 0; n < N; ++n) {
        double r = 0;
        for (int k = 0; k < kK; ++k) r += double(from_bf16(a[m * kK + k])) * double(from_bf16(b[k * N + n]));
        const double e = double(d[m * N + n]) - r;
        num += std::isfinite(d[m * N + n]) ? e * e : 1e30;
        den += r * r;
      }
    const double rel = std::sqrt(num / den);
    const bool ok = rel < 1e-5;  // fp32 accumulation of exact bf16 products
    std::printf("%s  %-62s rel-RMS %.2e\n", ok ? "PASS" : "FAIL", v.name, rel);
    ok ? ++passes : ++fails;
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dd));
  }
  // Case 1 must pass; of the N-major variants, exactly the right one should.
  std::printf("wgmma probe: %d passed, %d failed of %zu variants\n", passes, fails, vs.size());
  return 0;
}
