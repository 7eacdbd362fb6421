// Shared test helpers: host tensors, the SPEC.md §5 input recipe, NaN poisoning, relative RMS error,
// and running forward/backward through the public C API on a named backend.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.hpp"
#include "gla/gla.h"

namespace gla::test {

// A host tensor that owns its bytes. Copying copies the bytes and re-points the descriptor.
struct HostTensor {
  std::vector<unsigned char> bytes;
  gla_tensor t{};

  HostTensor() = default;
  HostTensor(int32_t dtype, std::vector<int64_t> sizes);
  HostTensor(const HostTensor& other);
  HostTensor& operator=(const HostTensor& other);
  HostTensor(HostTensor&&) noexcept = default;
  HostTensor& operator=(HostTensor&&) noexcept = default;

  bool empty() const { return t.rank == 0 && t.data == nullptr; }
  int64_t size() const { return numel(t); }
  // Flat element i in row-major order of the sizes (honours strides).
  double get(int64_t i) const;
  void set(int64_t i, double value);
  const gla_tensor* desc() const { return empty() ? nullptr : &t; }
};

void fill_uniform(HostTensor& x, std::mt19937_64& rng, double lo = 0.0, double hi = 1.0);
void fill_normal(HostTensor& x, std::mt19937_64& rng);
// g = logsigmoid(U[0,1)) / normaliser  (SPEC.md §5)
void fill_gate(HostTensor& x, std::mt19937_64& rng, double normaliser);
void poison(HostTensor& x);  // every element NaN
// ||a - b|| / ||b||; infinity when a has a non-finite value where b is finite.
double rel_rms(const HostTensor& a, const HostTensor& b);
bool all_finite(const HostTensor& x);
// Copy of x with a different layout: the last two dims of a rank-4 tensor stored transposed
// (still the same logical tensor), to test strided inputs.
HostTensor strided_copy(const HostTensor& x);

struct Case {
  int64_t B = 1, T = 64, H = 1, K = 16, V = 16;
  int32_t dtype = GLA_DTYPE_F32;
  bool gate_f32 = false;      // fp32 gate with 16-bit q/k/v
  bool per_head_gate = false; // g [B, T, H]
  double normaliser = 1.0;    // gate = logsigmoid(U)/normaliser
  bool randn_inputs = false;  // q, k, v from randn instead of U[0,1)
  double gate_floor = 0.0;    // if < 0: some gates set to this value (strong decay)
  bool initial_state = true;
  bool final_state = true;
  bool state_v_first = false;
  std::vector<int64_t> cu_seqlens;  // varlen when non-empty (B must be 1)
  uint64_t seed = 0;
  std::string label() const;
};

struct Inputs {
  Case c;
  int64_t N = 0;
  HostTensor q, k, v, g, h0, cu, dout, dht;
};
Inputs make_inputs(const Case& c);

struct Outputs {
  HostTensor o, ht;                 // forward
  HostTensor dq, dk, dv, dg, dh0;   // backward
};

struct RunOptions {
  std::string backend;          // "" = dispatcher's choice
  bool stage_pipeline = false;
  bool check_inputs = false;
};

// The C-API arguments for `in`, with fresh NaN-poisoned outputs allocated in `out` (forward: o, and
// ht when the case has a final state; backward: dq, dk, dv, dg, dh0).
gla_chunk_forward_args forward_args(const Inputs& in, Outputs& out);
gla_chunk_backward_args backward_args(const Inputs& in, Outputs& out);
// NC of saved chunk states (gla.h): the sum over sequences of ceil(T_n / 64).
int64_t saved_state_chunks(const Inputs& in);
// [N, H, K, V], or [N, H, V, K] with the case's state_v_first.
std::vector<int64_t> state_sizes(const Inputs& in);
// Whether the named backend is registered and available on this machine.
bool backend_available(const std::string& name);

// Runs forward (o, ht) and backward (dq..dh0) on fresh NaN-poisoned outputs; returns the statuses.
gla_status run_forward(const Inputs& in, Outputs& out, const RunOptions& options = {});
gla_status run_backward(const Inputs& in, Outputs& out, const RunOptions& options = {});

// Tolerance of SPEC.md §5 for a host (CPU) backend on this dtype.
double host_tolerance(int32_t dtype);

// Compares every output present in both; fills `report` with "name: err" lines, returns the max.
double max_error(const Outputs& a, const Outputs& b, bool backward, std::string& report);

// SPEC.md §5 grid cases that fit a CPU test budget (T trimmed where noted in the .cpp).
std::vector<Case> spec_grid_cases(int32_t dtype);

// For test backends that delegate: runs the whole forward of a backend's problem on `backend`
// (scale, state layout and stream kept; tensors on `device_type` when it is >= 0, e.g. host memory
// described as another device); on failure writes gla_last_error() into message.
gla_status forward_on(const gla_problem& problem, const char* backend, char* message, size_t capacity,
                      int32_t device_type = -1);

// stdout and stderr of a shell command (fresh processes: GLA_PLUGINS, the CLI).
std::string run_command(const std::string& command);

// Sets an environment variable (value NULL: unsets it) and has libgla read its environment again
// (gla_reload_environment: libgla reads it once otherwise).
void set_env(const char* name, const char* value);

// An environment variable set (set_env) for one scope, restored after (tests run serially).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

}  // namespace gla::test
