// Scratch layouts of the cpu kernels: one carve-up per unit, used both to size and to run. Part
// of kernels.inl.

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
