// What every libgla operator registered with PyTorch shares: torch tensors as gla_tensor
// descriptors, outputs and workspaces from PyTorch's allocator, PyTorch's current CUDA stream, the
// per-call options and libgla's failures as exceptions.
//
// Only PyTorch's stable C ABI is used (torch/csrc/stable and the AOTI shim): no libtorch C++ types
// and no Python C-API, so one build serves every Python and every torch >= TORCH_TARGET_VERSION.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "gla/gla.h"

namespace gla_torch {

using torch::stable::Tensor;

// A descriptor over t's memory; throws the tagged TypeError/ValueError (see fail) for a dtype libgla
// does not know or more than GLA_MAX_RANK dimensions. Empty tensors get data == NULL.
gla_tensor describe(const char* name, const Tensor& t);

// Descriptors of optional tensors: `storage` holds the descriptor, the result points at it (or is
// NULL for an absent tensor), which is what the args structs of gla.h take.
const gla_tensor* describe(const char* name, const std::optional<Tensor>& t, gla_tensor& storage);

// A contiguous tensor from PyTorch's allocator on `like`'s device.
Tensor empty(const int64_t* sizes, int64_t rank, int32_t torch_dtype, const Tensor& like);
Tensor empty_like(const Tensor& like);
Tensor empty_state(const Tensor& like);  // the placeholder for an absent optional output: fp32, numel 0
int32_t float32_dtype();
int32_t bfloat16_dtype();

// The host copy of cu_seqlens handed to libgla: cu_seqlens_cpu when given; else, for device
// cu_seqlens, a copy made here (a host synchronisation on the current stream). libgla validates the
// offsets and gives every backend host offsets (the cuda backend plans its grid from them), so
// device-only offsets cost one copy whoever makes it; made here it is also available to callback
// backends such as `torch`, which cannot copy device memory themselves.
std::optional<Tensor> host_offsets(const std::optional<Tensor>& cu_seqlens, const std::optional<Tensor>& cu_seqlens_cpu);

// PyTorch's current stream on t's device (a cudaStream_t for CUDA tensors; NULL for host memory).
void* current_stream(const Tensor& t);

// gla_options for one call (the schema's scale, state_v_first, backend and policy).
gla_options make_options(double scale, bool state_v_first, const std::string& backend, int64_t policy,
                         const Tensor& like);

// Throws for a failing status, with libgla's last error. The message carries the Python exception
// class as a prefix ("[gla:ValueError] q: expected ...") that gla._errors turns back into that
// class: PyTorch's stable ABI turns every C++ exception into RuntimeError.
void check(gla_status status);
[[noreturn]] void fail(const char* python_class, const std::string& message);

// The scratch memory of one libgla call, from PyTorch's allocator on like's device when libgla asks
// for it (gla_allocator); the tensor owns it until the call is over. A failed allocation's own
// error is kept in `error` (libgla sees NULL) and rethrown by run.
struct Workspace {
  const Tensor& like;
  std::optional<Tensor> tensor;
  std::string error;
  gla_allocator allocator();
};

// call(&allocator) with the workspace allocator of one libgla call: the scratch memory from PyTorch's
// allocator on like's device, owned until the call is over; a failed allocation's own error is
// rethrown here. Returns call's status.
template <class Call>
gla_status call_with_workspace(const Tensor& like, Call&& call) {
  Workspace workspace{like, std::nullopt, {}};
  const gla_allocator allocator = workspace.allocator();
  const gla_status status = call(&allocator);
  if (!workspace.error.empty()) throw std::runtime_error(workspace.error);
  return status;
}

// One libgla operation through its *_with_allocator entry point: validated and planned once, the
// workspace allocated by PyTorch; throws (check) on failure. The chunked operators' kernels end
// with this. (Asking gla_*_workspace_size first, then calling, validated and planned twice: the
// query was 9.6k of the 19.5k instructions libgla spent per call outside the kernel, callgrind.)
template <class Args>
void run(gla_status (*entry)(const Args*, const gla_options*, const gla_allocator*), const Args& args,
         const gla_options& options, const Tensor& like) {
  check(call_with_workspace(like, [&](const gla_allocator* allocator) { return entry(&args, &options, allocator); }));
}

// run for the saved-states entry points (one more argument, the chunk states): returns
// GLA_STATUS_NOT_SUPPORTED (nothing written) instead of throwing it, so that the caller can make
// the plain call instead; throws for every other failure.
template <class Args>
gla_status run_with_states(gla_status (*entry)(const Args*, const gla_tensor*, const gla_options*, const gla_allocator*),
                           const Args& args, const gla_tensor& states, const gla_options& options, const Tensor& like) {
  const gla_status status = call_with_workspace(
      like, [&](const gla_allocator* allocator) { return entry(&args, &states, &options, allocator); });
  if (status != GLA_STATUS_NOT_SUPPORTED) check(status);
  return status;
}

}  // namespace gla_torch
