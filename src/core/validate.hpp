// Validation and shape inference (SPEC.md §4): turns the public arguments into a gla_problem, or
// throws gla::Error naming the argument, what was expected and what was given. Nothing is written.
#pragma once

#include <vector>

#include "core/backend.hpp"

namespace gla {

// A validated problem plus the host memory its pointers refer to.
struct PreparedProblem {
  gla_problem problem{};
  std::vector<int64_t> seq_offsets;
  std::vector<int64_t> chunk_offsets;
  // cu_seqlens lives on a device and no host copy was given: offsets must be copied before use.
  bool offsets_need_copy = false;
  // gla_recurrent_state_update's check_slots: the dispatcher copies state_slots and checks them.
  bool check_slots = false;

  PreparedProblem() = default;
  PreparedProblem(const PreparedProblem&) = delete;
  PreparedProblem& operator=(const PreparedProblem&) = delete;
  PreparedProblem(PreparedProblem&& other) noexcept { *this = std::move(other); }
  PreparedProblem& operator=(PreparedProblem&& other) noexcept {
    problem = other.problem;
    seq_offsets = std::move(other.seq_offsets);
    chunk_offsets = std::move(other.chunk_offsets);
    offsets_need_copy = other.offsets_need_copy;
    check_slots = other.check_slots;
    bind();
    return *this;
  }
  // Points problem.seq_offsets / chunk_offsets at the vectors.
  void bind() {
    problem.seq_offsets = seq_offsets.empty() ? nullptr : seq_offsets.data();
    problem.chunk_offsets = chunk_offsets.empty() ? nullptr : chunk_offsets.data();
  }
};

// Reads the options struct (NULL = defaults), checking its size field.
gla_options read_options(const gla_options* options);

// A caller's allocator (gla_chunk_*_with_allocator): NULL, or one with a function.
void check_allocator(const gla_allocator* allocator);

// metadata_only: for explain(); output tensors may be absent and data pointers are not required.
// chunk_states (optional): the saved chunk-start states of gla_chunk_forward_saving_states /
// gla_chunk_backward_from_states, validated and put in problem.h of the whole operation.
PreparedProblem prepare_forward(const gla_chunk_forward_args* args, const gla_options& options,
                                bool metadata_only, const gla_tensor* chunk_states = nullptr);
PreparedProblem prepare_backward(const gla_chunk_backward_args* args, const gla_options& options,
                                 bool metadata_only, const gla_tensor* chunk_states = nullptr);

// The recurrent operator's calls (gla.h: gla_recurrent_forward / _backward / _state_update). The
// state update's problem is GLA_UNIT_RECURRENT_FWD with the pool as initial_state (and final_state
// without token_states) and state_slots / slot_error set.
PreparedProblem prepare_recurrent_forward(const gla_recurrent_forward_args* args, const gla_options& options,
                                          bool metadata_only);
PreparedProblem prepare_recurrent_backward(const gla_recurrent_backward_args* args, const gla_options& options,
                                           bool metadata_only);
PreparedProblem prepare_recurrent_state_update(const gla_recurrent_state_update_args* args, const gla_options& options,
                                               bool metadata_only);
// The state update's debug check (check_slots): every slot in [0, P) and none repeated, else an
// INVALID_ARGUMENT naming the first offender. `slots` is a host copy of the B slots.
void check_state_slots(const gla_problem& problem, const int32_t* slots);

// Reads cu_seqlens values from `host_values` (N + 1 entries of cu_seqlens' dtype) and checks them:
// first 0, non-decreasing, last T.
void load_sequence_offsets(PreparedProblem& prepared, const void* host_values);

// Number of 64-token chunks over all sequences: the first size of the saved chunk states (problem.h
// of a whole operation; needs the sequence offsets loaded), and the check of that size once they are.
int64_t saved_state_chunks(const gla_problem& p);
void check_chunk_states_count(const gla_problem& p);

// Chunk bookkeeping for the stage pipeline: chunk_size C and the first global chunk per sequence.
void compute_chunk_offsets(PreparedProblem& prepared, int64_t chunk_size);

// The optional input check: NaN/Inf in any input and g > 0, reported by position. `read` copies a
// tensor's bytes to the host (identity for host memory).
using HostReader = void (*)(void* context, const gla_tensor& tensor, std::vector<char>& bytes);
void check_input_values(const gla_problem& problem, HostReader read, void* context);

}  // namespace gla
