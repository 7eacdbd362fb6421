// The cuda backend's recurrent forward, backward and state-pool update against the host backends,
// with tensors in CUDA memory: the recurrent grid, fla's decode shapes, every gradient against the
// reference (NaN-poisoned, each key tile, strong decay and hard resets, determinism), bad pool
// slots (skipped, flagged, nothing outside the pool written), and a decode step captured in a CUDA
// graph and replayed with new inputs. Skips with a message where no CUDA device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <memory>
#include <string>
#include <vector>

#include "recurrent_support.hpp"

#ifdef GLA_TESTS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace gla::test {
namespace {

#ifdef GLA_TESTS_WITH_CUDA

#define SKIP_WITHOUT_CUDA_BACKEND()                                                                     \
  do {                                                                                                  \
    if (!backend_available("cuda")) GTEST_SKIP() << "no CUDA backend/device available: recurrent CUDA test skipped"; \
  } while (0)

// Device memory mirroring a host tensor's bytes; `desc` is the host descriptor re-pointed.
class OnDevice {
 public:
  explicit OnDevice(const HostTensor& h) : bytes_(h.bytes.size()) {
    EXPECT_EQ(cudaMalloc(&ptr_, bytes_ ? bytes_ : 16), cudaSuccess);
    upload(h);
    desc = h.t;
    desc.data = ptr_;
    desc.device_type = GLA_DEVICE_CUDA;
  }
  ~OnDevice() { cudaFree(ptr_); }
  OnDevice(const OnDevice&) = delete;
  OnDevice& operator=(const OnDevice&) = delete;
  void upload(const HostTensor& h) {
    if (bytes_) {
      EXPECT_EQ(cudaMemcpy(ptr_, h.bytes.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  void download(HostTensor& h) const {
    if (bytes_) {
      EXPECT_EQ(cudaMemcpy(h.bytes.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
  }
  gla_tensor desc{};

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<OnDevice> maybe(const HostTensor& h) { return h.empty() ? nullptr : std::make_unique<OnDevice>(h); }
const gla_tensor* d(const std::unique_ptr<OnDevice>& x) { return x ? &x->desc : nullptr; }

double tolerance(int32_t dtype) { return dtype == GLA_DTYPE_F32 ? 1e-5 : 5e-3; }

void check_forward(const RecurrentCase& c) {
  SCOPED_TRACE(c.label());
  const RecurrentInputs r = make_recurrent_inputs(c);
  Outputs ref;
  ASSERT_EQ(run_recurrent_forward(r, ref, "reference"), GLA_STATUS_OK) << gla_last_error();
  Outputs got;
  got.o = HostTensor(c.base.dtype, {c.base.B, c.base.T, c.base.H, c.base.V});
  poison(got.o);
  if (c.base.final_state) {
    got.ht = HostTensor(GLA_DTYPE_F32, state_sizes(r.in));
    poison(got.ht);
  }
  auto q = maybe(r.in.q), k = maybe(r.in.k), v = maybe(r.in.v), gk = c.gk ? maybe(r.in.g) : nullptr,
       gv = c.gv ? maybe(r.gv) : nullptr, h0 = maybe(r.in.h0), cu = maybe(r.in.cu), o = maybe(got.o), ht = maybe(got.ht);
  gla_recurrent_forward_args a{};
  a.q = d(q);
  a.k = d(k);
  a.v = d(v);
  a.gk = d(gk);
  a.gv = d(gv);
  a.initial_state = d(h0);
  a.cu_seqlens = d(cu);
  a.cu_seqlens_host = r.in.cu.desc();
  a.o = d(o);
  a.final_state = d(ht);
  a.reverse = c.reverse;
  const gla_options opt = recurrent_options(r, "cuda");
  ASSERT_EQ(gla_recurrent_forward(&a, &opt), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  o->download(got.o);
  if (ht) ht->download(got.ht);
  EXPECT_TRUE(all_finite(got.o)) << "unwritten o";
  EXPECT_LT(rel_rms(got.o, ref.o), tolerance(c.base.dtype));
  if (ht) {
    EXPECT_TRUE(all_finite(got.ht)) << "unwritten final state";
    EXPECT_LT(rel_rms(got.ht, ref.ht), tolerance(GLA_DTYPE_F32));
  }
}

TEST(RecurrentCuda, ForwardMatchesReferenceOnGrid) {
  SKIP_WITHOUT_CUDA_BACKEND();
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (RecurrentCase c : recurrent_grid(dtype)) {
      c.base.V = (c.base.V + 3) / 4 * 4;  // 16-byte state rows (the verifier declines others)
      c.base.K = (c.base.K + 3) / 4 * 4;
      check_forward(c);
    }
  }
}

TEST(RecurrentCuda, DecodeShapesMatchReference) {
  SKIP_WITHOUT_CUDA_BACKEND();
  struct Shape { int64_t B, H, K, V; };
  for (const Shape s : {Shape{4, 4, 128, 128}, Shape{2, 2, 256, 512}, Shape{3, 2, 64, 100}, Shape{2, 2, 200, 36}}) {
    for (bool v_first : {true, false}) {
      RecurrentCase c;
      c.base.B = s.B; c.base.T = 1; c.base.H = s.H; c.base.K = s.K; c.base.V = s.V;
      c.base.state_v_first = v_first;
      c.base.dtype = GLA_DTYPE_BF16;
      c.base.seed = 5;
      check_forward(c);
      c.base.T = 3;
      c.gv = true;
      check_forward(c);
    }
  }
}

// The cuda backward of r on device copies of its inputs; every gradient NaN-poisoned on the
// device before the call and downloaded into `got` after it. dht only with the case's final state.
void cuda_backward(const RecurrentInputs& r, Outputs& got, HostTensor& got_dgv, int32_t gate_dtype = -1,
                   std::string* explained = nullptr) {
  const Case& c = r.c.base;
  make_recurrent_gradients(r, got, got_dgv, gate_dtype);
  auto q = maybe(r.in.q), k = maybe(r.in.k), v = maybe(r.in.v), gk = r.c.gk ? maybe(r.in.g) : nullptr,
       gv = r.c.gv ? maybe(r.gv) : nullptr, h0 = maybe(r.in.h0), cu = maybe(r.in.cu), dout = maybe(r.in.dout),
       dht = c.final_state ? maybe(r.in.dht) : nullptr;
  auto dq = maybe(got.dq), dk = maybe(got.dk), dv = maybe(got.dv), dgk = maybe(got.dg), dgv = maybe(got_dgv),
       dh0 = maybe(got.dh0);
  gla_recurrent_backward_args a{};
  a.q = d(q); a.k = d(k); a.v = d(v); a.gk = d(gk); a.gv = d(gv); a.initial_state = d(h0);
  a.cu_seqlens = d(cu); a.cu_seqlens_host = r.in.cu.desc();
  a.do_ = d(dout); a.dht = d(dht);
  a.dq = d(dq); a.dk = d(dk); a.dv = d(dv); a.dgk = d(dgk); a.dgv = d(dgv); a.dh0 = d(dh0);
  a.reverse = r.c.reverse;
  const gla_options opt = recurrent_options(r, "cuda");
  if (explained) {
    const char* text = nullptr;
    ASSERT_EQ(gla_recurrent_explain(nullptr, &a, nullptr, &opt, &text), GLA_STATUS_OK) << gla_last_error();
    *explained = text;
  }
  ASSERT_EQ(gla_recurrent_backward(&a, &opt), GLA_STATUS_OK) << gla_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  dq->download(got.dq);
  dk->download(got.dk);
  dv->download(got.dv);
  if (dgk) dgk->download(got.dg);
  if (dgv) dgv->download(got_dgv);
  if (dh0) dh0->download(got.dh0);
}

// Every gradient of the cuda backward against the reference's (relative RMS, SPEC.md §5): written
// everywhere (finite where the reference is) and within the bar of the input dtype.
void check_backward(const RecurrentCase& c, int32_t gate_dtype = -1) {
  SCOPED_TRACE(c.label());
  const RecurrentInputs r = make_recurrent_inputs(c);
  Outputs ref, got;
  HostTensor ref_dgv, got_dgv;
  ASSERT_EQ(run_recurrent_backward(r, ref, ref_dgv, "reference"), GLA_STATUS_OK) << gla_last_error();
  cuda_backward(r, got, got_dgv, gate_dtype);
  if (::testing::Test::HasFatalFailure()) return;
  // A 16-bit gate gradient is rounded like the 16-bit inputs.
  const double gate_tol = tolerance(gate_dtype < 0 ? GLA_DTYPE_F32 : gate_dtype);
  const double tol = tolerance(c.base.dtype);
  struct Named {
    const char* name;
    const HostTensor& got;
    const HostTensor& want;
    double tol;
  };
  for (const Named& x : {Named{"dq", got.dq, ref.dq, tol}, Named{"dk", got.dk, ref.dk, tol}, Named{"dv", got.dv, ref.dv, tol},
                         Named{"dgk", got.dg, ref.dg, std::max(tol, gate_tol)},
                         Named{"dgv", got_dgv, ref_dgv, std::max(tol, gate_tol)},
                         Named{"dh0", got.dh0, ref.dh0, tol}}) {
    if (x.want.empty()) continue;
    ASSERT_TRUE(all_finite(x.want)) << x.name << " of the reference";
    EXPECT_TRUE(all_finite(x.got)) << x.name << ": unwritten (NaN left) or non-finite";
    EXPECT_LT(rel_rms(x.got, x.want), x.tol) << x.name;
  }
}

TEST(RecurrentCuda, BackwardMatchesReferenceOnGrid) {
  SKIP_WITHOUT_CUDA_BACKEND();
  // Every gate combination, both orders, varlen with empty and length-1 sequences, both layouts,
  // with and without initial state; K, V not multiples of 32 (partial tiles) and V > 32 (the
  // per-tile partial sums); T = 130 crosses eight checkpoints.
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16, GLA_DTYPE_F16}) {
    for (const RecurrentCase& c : recurrent_grid(dtype)) check_backward(c);
  }
}

TEST(RecurrentCuda, BackwardWithoutFinalStateGradientOrInitialState) {
  SKIP_WITHOUT_CUDA_BACKEND();
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16}) {
    for (bool h0 : {false, true}) {
      for (bool v_first : {false, true}) {
        RecurrentCase c;
        c.base.B = 2; c.base.T = 45; c.base.H = 3; c.base.K = 40; c.base.V = 72;
        c.base.dtype = dtype;
        c.base.initial_state = h0;
        c.base.final_state = false;  // no dht
        c.base.state_v_first = v_first;
        c.base.seed = 31;
        c.gv = true;
        check_backward(c);
      }
    }
  }
}

TEST(RecurrentCuda, BackwardAtEveryKeyTileAndLongSequences) {
  SKIP_WITHOUT_CUDA_BACKEND();
  struct Shape { int64_t B, T, H, K, V; };
  // K in each key tile (32, 64, 128, 256, and 100 / 200 padded), V from one to 16 value tiles.
  for (const Shape s : {Shape{2, 70, 2, 16, 32}, Shape{1, 300, 2, 64, 64}, Shape{2, 100, 2, 100, 128},
                        Shape{1, 90, 2, 128, 128}, Shape{1, 50, 2, 200, 36}, Shape{1, 40, 1, 256, 512}}) {
    for (bool v_first : {false, true}) {
      RecurrentCase c;
      c.base.B = s.B; c.base.T = s.T; c.base.H = s.H; c.base.K = s.K; c.base.V = s.V;
      c.base.state_v_first = v_first;
      c.base.dtype = GLA_DTYPE_BF16;
      c.base.seed = 41;
      c.gv = true;
      check_backward(c);
      c.base.dtype = GLA_DTYPE_F32;
      c.gv = false;
      c.reverse = true;
      check_backward(c);
    }
  }
}

TEST(RecurrentCuda, BackwardStrongDecayHardResetsAndRandn) {
  SKIP_WITHOUT_CUDA_BACKEND();
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16}) {
    Case strong;  // g = logsigmoid(U)/0.1, every 7th gate at -20
    strong.B = 1; strong.T = 200; strong.H = 2; strong.K = 128; strong.V = 128; strong.dtype = dtype;
    strong.normaliser = 0.1;
    strong.gate_floor = -20;
    strong.seed = 52;
    Case randn = strong;  // q, k, v from randn
    randn.K = 64; randn.V = 64; randn.normaliser = 1; randn.gate_floor = 0; randn.randn_inputs = true;
    randn.seed = 53;
    for (const Case& base : {strong, randn}) {
      for (int gates = 1; gates < 4; ++gates) {
        RecurrentCase c;
        c.base = base;
        c.gk = gates & 1;
        c.gv = gates & 2;
        check_backward(c);
      }
    }
    // g = -inf (a hard reset, SPEC.md §3.8) in both gates.
    RecurrentCase c;
    c.base.B = 1; c.base.T = 50; c.base.H = 2; c.base.K = 64; c.base.V = 64; c.base.dtype = dtype;
    c.base.gate_floor = -INFINITY;
    c.base.seed = 51;
    c.gv = true;
    check_backward(c);
  }
}

TEST(RecurrentCuda, BackwardGateGradientsInTheGateDtypeAndAGivenScale) {
  SKIP_WITHOUT_CUDA_BACKEND();
  RecurrentCase c;
  c.base.B = 2; c.base.T = 33; c.base.H = 2; c.base.K = 64; c.base.V = 96;
  c.base.dtype = GLA_DTYPE_BF16;
  c.gv = true;
  c.base.seed = 61;
  check_backward(c, GLA_DTYPE_BF16);
  c.scale = 0.37;
  c.base.dtype = GLA_DTYPE_F32;
  check_backward(c);
}

// Same inputs, same outputs bit for bit (SPEC.md §3.7: the value tiles' sums are added in a fixed
// order, no atomics); explain() names the cuda backward.
TEST(RecurrentCuda, BackwardIsDeterministicAndExplained) {
  SKIP_WITHOUT_CUDA_BACKEND();
  RecurrentCase c;
  c.base.B = 1; c.base.T = 100; c.base.H = 2; c.base.K = 128; c.base.V = 160;
  c.base.dtype = GLA_DTYPE_BF16;
  c.gv = true;
  c.base.seed = 71;
  const RecurrentInputs r = make_recurrent_inputs(c);
  Outputs a, b;
  HostTensor a_dgv, b_dgv;
  std::string explained;
  cuda_backward(r, a, a_dgv, -1, &explained);
  cuda_backward(r, b, b_dgv);
  if (HasFatalFailure()) return;
  const std::pair<const HostTensor*, const HostTensor*> pairs[] = {{&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv},
                                                                    {&a.dg, &b.dg}, {&a_dgv, &b_dgv}, {&a.dh0, &b.dh0}};
  for (const auto& [x, y] : pairs) {
    EXPECT_FALSE(x->empty());
    EXPECT_EQ(x->bytes, y->bytes);
  }
  EXPECT_NE(explained.find("recurrent backward"), std::string::npos) << explained;
  EXPECT_NE(explained.find("5 value tiles"), std::string::npos) << explained;
}

// The declaration (readable without a device): a recurrent backward record on CUDA with the
// forward's key limit, every recurrent feature but the serving step's pool and token states.
TEST(RecurrentCuda, DeclaresTheBackward) {
  const gla_capability* records = nullptr;
  int32_t count = 0;
  ASSERT_EQ(gla_backend_capabilities("cuda", &records, &count), GLA_STATUS_OK) << gla_last_error();
  const gla_capability* bwd = nullptr;
  for (int32_t i = 0; i < count; ++i)
    if (records[i].unit_mask & (uint64_t{1} << GLA_UNIT_RECURRENT_BWD)) bwd = &records[i];
  ASSERT_NE(bwd, nullptr) << "no record declares recurrent_bwd";
  EXPECT_EQ(bwd->device_mask, uint64_t{1} << GLA_DEVICE_CUDA);
  EXPECT_EQ(bwd->k_max, 256);
  EXPECT_EQ(bwd->deterministic, 1);
  for (int32_t dtype : {GLA_DTYPE_F32, GLA_DTYPE_BF16, GLA_DTYPE_F16}) EXPECT_TRUE(bwd->dtype_mask & (1u << dtype));
  const uint32_t wanted = GLA_FEATURE_VARLEN | GLA_FEATURE_INITIAL_STATE | GLA_FEATURE_FINAL_STATE |
                          GLA_FEATURE_STATE_V_FIRST | GLA_FEATURE_PER_KEY_GATE | GLA_FEATURE_VALUE_GATE |
                          GLA_FEATURE_REVERSE;
  EXPECT_EQ(bwd->features & wanted, wanted);
  EXPECT_EQ(bwd->features & (GLA_FEATURE_STATE_POOL | GLA_FEATURE_TOKEN_STATES | GLA_FEATURE_PER_HEAD_GATE), 0u);
}

// Outside its limits the cuda backward declines with the reason, outputs untouched: K past the
// register tile, and a do broadcast along V (stride 0, as `o.sum()` gives) that the row loads
// cannot read.
TEST(RecurrentCuda, BackwardDeclinesOutsideItsLimitsWithReasons) {
  SKIP_WITHOUT_CUDA_BACKEND();
  struct Probe {
    int64_t K;
    bool broadcast_do;
    const char* reason;
  };
  for (const Probe x : {Probe{272, false, "K=272 outside the declared 1..256"},
                        Probe{32, true, "do needs a contiguous last dimension (stride 1), got stride 0"}}) {
    RecurrentCase c;
    c.base.B = 1; c.base.T = 8; c.base.H = 1; c.base.K = x.K; c.base.V = 16;
    const RecurrentInputs r = make_recurrent_inputs(c);
    HostTensor dq(GLA_DTYPE_F32, {1, 8, 1, x.K});
    poison(dq);
    auto q = maybe(r.in.q), k = maybe(r.in.k), v = maybe(r.in.v), g = maybe(r.in.g), dout = maybe(r.in.dout),
         ddq = maybe(dq);
    gla_tensor do_desc = dout->desc;
    if (x.broadcast_do) do_desc.strides[3] = 0;
    gla_recurrent_backward_args a{};
    a.q = d(q); a.k = d(k); a.v = d(v); a.gk = d(g); a.do_ = &do_desc; a.dq = d(ddq);
    const gla_options opt = recurrent_options(r, "cuda");
    EXPECT_EQ(gla_recurrent_backward(&a, &opt), GLA_STATUS_NOT_SUPPORTED) << x.reason;
    EXPECT_NE(std::string(gla_last_error()).find(x.reason), std::string::npos) << gla_last_error();
    HostTensor after = dq;
    ddq->download(after);
    EXPECT_EQ(after.bytes, dq.bytes) << "dq written by a declined call";
  }
}

// The state pool on the device: B sequences, pool of P states between guard states.
struct DevicePool {
  static constexpr int64_t kGuard = 2;
  HostTensor storage, slots, error, o;
  std::unique_ptr<OnDevice> d_storage, d_slots, d_error, d_o;
  gla_tensor pool{};
  DevicePool(const RecurrentInputs& r, int64_t P, const std::vector<int32_t>& s) {
    const Case& c = r.c.base;
    const int64_t R = c.state_v_first ? c.V : c.K, C = c.state_v_first ? c.K : c.V;
    storage = HostTensor(GLA_DTYPE_F32, {P + 2 * kGuard, c.H, R, C});
    std::mt19937_64 rng(7);
    fill_normal(storage, rng);
    slots = HostTensor(GLA_DTYPE_I32, {static_cast<int64_t>(s.size())});
    std::memcpy(slots.bytes.data(), s.data(), s.size() * 4);
    error = HostTensor(GLA_DTYPE_I32, {1});
    o = HostTensor(c.dtype, {c.B, c.T, c.H, c.V});
    poison(o);
    d_storage = std::make_unique<OnDevice>(storage);
    d_slots = std::make_unique<OnDevice>(slots);
    d_error = std::make_unique<OnDevice>(error);
    d_o = std::make_unique<OnDevice>(o);
    pool = d_storage->desc;
    pool.sizes[0] = P;
    pool.data = static_cast<float*>(pool.data) + kGuard * c.H * R * C;
  }
};

// The same update on the cpu backend, on host copies of the same pool.
void host_update(const RecurrentInputs& r, HostTensor& storage, int64_t P, const HostTensor& slots, HostTensor& error,
                 HostTensor& o) {
  const Case& c = r.c.base;
  gla_tensor pool = storage.t;
  pool.sizes[0] = P;
  pool.data = static_cast<float*>(storage.t.data) + DevicePool::kGuard * c.H * c.K * c.V;
  gla_recurrent_state_update_args u{};
  u.q = &r.in.q.t; u.k = &r.in.k.t; u.v = &r.in.v.t;
  u.gk = r.c.gk ? &r.in.g.t : nullptr;
  u.gv = r.c.gv ? &r.gv.t : nullptr;
  u.state_pool = &pool; u.state_slots = &slots.t; u.slot_error = &error.t; u.o = &o.t;
  const gla_options opt = recurrent_options(r, "cpu");
  ASSERT_EQ(gla_recurrent_state_update(&u, &opt), GLA_STATUS_OK) << gla_last_error();
}

TEST(RecurrentCuda, PoolUpdateSkipsBadSlots) {
  SKIP_WITHOUT_CUDA_BACKEND();
  for (bool v_first : {false, true}) {
    RecurrentCase c;
    c.base.B = 6; c.base.T = 2; c.base.H = 3; c.base.K = 64; c.base.V = 128;
    c.base.state_v_first = v_first;
    c.base.dtype = GLA_DTYPE_BF16;
    c.gv = true;
    SCOPED_TRACE(c.label());
    const RecurrentInputs r = make_recurrent_inputs(c);
    const std::vector<int32_t> slots{3, -2, 0, 3, 9, 5};
    DevicePool dev(r, 8, slots);
    auto q = maybe(r.in.q), k = maybe(r.in.k), v = maybe(r.in.v), gk = maybe(r.in.g), gv = maybe(r.gv);
    gla_recurrent_state_update_args u{};
    u.q = d(q); u.k = d(k); u.v = d(v); u.gk = d(gk); u.gv = d(gv);
    u.state_pool = &dev.pool; u.state_slots = &dev.d_slots->desc; u.slot_error = &dev.d_error->desc; u.o = &dev.d_o->desc;
    const gla_options opt = recurrent_options(r, "cuda");
    ASSERT_EQ(gla_recurrent_state_update(&u, &opt), GLA_STATUS_OK) << gla_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    HostTensor got_storage = dev.storage, got_error = dev.error, got_o = dev.o;
    dev.d_storage->download(got_storage);
    dev.d_error->download(got_error);
    dev.d_o->download(got_o);
    HostTensor want_storage = dev.storage, want_error = dev.error, want_o = dev.o;
    host_update(r, want_storage, 8, dev.slots, want_error, want_o);
    EXPECT_EQ(got_error.get(0), GLA_SLOT_ERROR_OUT_OF_RANGE | GLA_SLOT_ERROR_REPEATED);
    EXPECT_EQ(got_error.get(0), want_error.get(0));
    EXPECT_TRUE(all_finite(got_o));
    EXPECT_LT(rel_rms(got_o, want_o), 5e-3);
    EXPECT_LT(rel_rms(got_storage, want_storage), 1e-5);
    // Guards and untouched slots bit-identical to the start.
    const int64_t per = c.base.H * c.base.K * c.base.V;
    for (int64_t s : {-2, -1, 1, 2, 4, 6, 7, 8, 9}) {
      for (int64_t i = 0; i < per; ++i) {
        const int64_t at = (DevicePool::kGuard + s) * per + i;
        ASSERT_EQ(got_storage.get(at), dev.storage.get(at)) << "state " << s << " changed";
      }
    }
  }
}

TEST(RecurrentCuda, GraphReplayOfDecodeStepWithNewInputs) {
  SKIP_WITHOUT_CUDA_BACKEND();
  RecurrentCase c;
  c.base.B = 8; c.base.T = 1; c.base.H = 4; c.base.K = 128; c.base.V = 128;
  c.base.state_v_first = true;
  c.base.dtype = GLA_DTYPE_BF16;
  c.base.seed = 21;
  const RecurrentInputs first = make_recurrent_inputs(c);
  DevicePool dev(first, 16, {0, 2, 4, 6, 8, 10, 12, 14});
  auto q = maybe(first.in.q), k = maybe(first.in.k), v = maybe(first.in.v), gk = maybe(first.in.g);
  gla_recurrent_state_update_args u{};
  u.q = d(q); u.k = d(k); u.v = d(v); u.gk = d(gk);
  u.state_pool = &dev.pool; u.state_slots = &dev.d_slots->desc; u.slot_error = &dev.d_error->desc; u.o = &dev.d_o->desc;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  gla_options opt = recurrent_options(first, "cuda");
  opt.stream = stream;
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const gla_status captured = gla_recurrent_state_update(&u, &opt);
  const std::string message = gla_last_error();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(captured, GLA_STATUS_OK) << message;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

  // New tokens and new slots in the same buffers, then replay twice: two decode steps.
  RecurrentCase c2 = c;
  c2.base.seed = 22;
  const RecurrentInputs second = make_recurrent_inputs(c2);
  q->upload(second.in.q);
  k->upload(second.in.k);
  v->upload(second.in.v);
  gk->upload(second.in.g);
  HostTensor slots2 = dev.slots;
  const std::vector<int32_t> s2{15, 13, 11, 9, 7, 5, 3, 1};
  std::memcpy(slots2.bytes.data(), s2.data(), 32);
  dev.d_slots->upload(slots2);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);

  HostTensor got_storage = dev.storage, got_o = dev.o;
  dev.d_storage->download(got_storage);
  dev.d_o->download(got_o);
  HostTensor want_storage = dev.storage, want_error = dev.error, want_o = dev.o;
  host_update(second, want_storage, 16, slots2, want_error, want_o);
  host_update(second, want_storage, 16, slots2, want_error, want_o);
  EXPECT_LT(rel_rms(got_o, want_o), 5e-3);
  EXPECT_LT(rel_rms(got_storage, want_storage), 1e-5);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

#else

TEST(RecurrentCuda, SkippedWithoutCuda) { GTEST_SKIP() << "libgla tests built without CUDA: recurrent CUDA tests skipped"; }

#endif

}  // namespace
}  // namespace gla::test
