#include "torch_bridge.hpp"

#include <dlfcn.h>

#include <stdexcept>

namespace gla_torch {
namespace {

// PyTorch's dtype codes are runtime values of the shim; read once.
struct DtypeCodes {
  int32_t f32 = aoti_torch_dtype_float32(), f16 = aoti_torch_dtype_float16(), bf16 = aoti_torch_dtype_bfloat16();
  int32_t f64 = aoti_torch_dtype_float64(), i32 = aoti_torch_dtype_int32(), i64 = aoti_torch_dtype_int64();
  int32_t u8 = aoti_torch_dtype_uint8(), i8 = aoti_torch_dtype_int8(), i16 = aoti_torch_dtype_int16();
  int32_t b = aoti_torch_dtype_bool(), c64 = aoti_torch_dtype_complex64(), c128 = aoti_torch_dtype_complex128();
  int32_t cpu = aoti_torch_device_type_cpu(), cuda = aoti_torch_device_type_cuda();
};
const DtypeCodes& codes() {
  static const DtypeCodes c;
  return c;
}

int32_t to_gla_dtype(int32_t d) {
  const DtypeCodes& c = codes();
  if (d == c.f32) return GLA_DTYPE_F32;
  if (d == c.f16) return GLA_DTYPE_F16;
  if (d == c.bf16) return GLA_DTYPE_BF16;
  if (d == c.f64) return GLA_DTYPE_F64;
  if (d == c.i32) return GLA_DTYPE_I32;
  if (d == c.i64) return GLA_DTYPE_I64;
  return -1;
}

std::string torch_dtype_name(int32_t d) {
  const DtypeCodes& c = codes();
  const std::pair<int32_t, const char*> names[] = {{c.u8, "uint8"}, {c.i8, "int8"},          {c.i16, "int16"},
                                                   {c.b, "bool"},   {c.c64, "complex64"}, {c.c128, "complex128"}};
  for (const auto& [code, name] : names) {
    if (d == code) return std::string("torch.") + name;
  }
  return "torch dtype code " + std::to_string(d);
}

void shim(AOTITorchError err, const char* what) {
  if (err != AOTI_TORCH_SUCCESS) fail("RuntimeError", std::string("PyTorch's C shim failed in ") + what);
}

// aoti_torch_get_current_cuda_stream lives in libtorch_cuda.so, which only CUDA builds of PyTorch
// have: looked up once in the loaded library instead of linked, so one build serves CPU-only
// PyTorch too.
using CurrentStreamFn = AOTITorchError (*)(int32_t, void**);
CurrentStreamFn current_cuda_stream_fn() {
  static const CurrentStreamFn fn = [] {
    void* sym = dlsym(RTLD_DEFAULT, "aoti_torch_get_current_cuda_stream");
    if (!sym) {
      if (void* lib = dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_NOLOAD)) {
        sym = dlsym(lib, "aoti_torch_get_current_cuda_stream");
      }
    }
    return reinterpret_cast<CurrentStreamFn>(sym);
  }();
  return fn;
}

}  // namespace

void fail(const char* python_class, const std::string& message) {
  throw std::runtime_error(std::string("[gla:") + python_class + "] " + message);
}

void check(gla_status status) {
  if (status == GLA_STATUS_OK) return;
  std::string message = gla_last_error();
  if (message.empty()) message = gla_status_name(status);
  if (status == GLA_STATUS_INVALID_ARGUMENT) {
    const std::string first_line = message.substr(0, message.find('\n'));
    fail(first_line.find("dtype") != std::string::npos ? "TypeError" : "ValueError", message);
  }
  fail(status == GLA_STATUS_OUT_OF_MEMORY ? "MemoryError" : "GlaError", message);
}

gla_tensor describe(const char* name, const Tensor& t) {
  AtenTensorHandle h = t.get();
  gla_tensor d{};
  int32_t dtype = 0, device_type = 0, device_index = 0;
  int64_t rank = 0, numel = 0;
  shim(aoti_torch_get_dtype(h, &dtype), "get_dtype");
  d.dtype = to_gla_dtype(dtype);
  if (d.dtype < 0) {
    fail("TypeError", std::string(name) + ": expected dtype float32, float16, bfloat16, int32 or int64, got " +
                          torch_dtype_name(dtype));
  }
  shim(aoti_torch_get_dim(h, &rank), "get_dim");
  if (rank > GLA_MAX_RANK) {
    fail("ValueError", std::string(name) + ": expected at most " + std::to_string(GLA_MAX_RANK) +
                           " dimensions, got " + std::to_string(rank));
  }
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  shim(aoti_torch_get_sizes(h, &sizes), "get_sizes");
  shim(aoti_torch_get_strides(h, &strides), "get_strides");
  shim(aoti_torch_get_numel(h, &numel), "get_numel");
  shim(aoti_torch_get_device_type(h, &device_type), "get_device_type");
  shim(aoti_torch_get_device_index(h, &device_index), "get_device_index");
  d.rank = static_cast<int32_t>(rank);
  for (int64_t i = 0; i < rank; ++i) {
    d.sizes[i] = sizes[i];
    d.strides[i] = strides[i];
  }
  if (numel > 0) shim(aoti_torch_get_data_ptr(h, &d.data), "get_data_ptr");
  // The operators are registered for the CPU and CUDA dispatch keys only (other devices run the
  // Python fallback kernel), so these are the two device types that arrive here.
  d.device_type = device_type == codes().cuda ? GLA_DEVICE_CUDA : GLA_DEVICE_CPU;
  d.device_index = device_type == codes().cuda ? device_index : 0;
  return d;
}

const gla_tensor* describe(const char* name, const std::optional<Tensor>& t, gla_tensor& storage) {
  if (!t.has_value()) return nullptr;
  storage = describe(name, *t);
  return &storage;
}

int32_t float32_dtype() { return codes().f32; }
int32_t bfloat16_dtype() { return codes().bf16; }

namespace {
Tensor empty_on(const int64_t* sizes, int64_t rank, int32_t torch_dtype, int32_t device_type, int32_t device_index) {
  int64_t strides[GLA_MAX_RANK];
  int64_t stride = 1;
  for (int64_t i = rank - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= sizes[i] > 0 ? sizes[i] : 1;
  }
  AtenTensorHandle out = nullptr;
  shim(aoti_torch_empty_strided(rank, sizes, strides, torch_dtype, device_type, device_index, &out), "empty_strided");
  return Tensor(out);
}
}  // namespace

Tensor empty(const int64_t* sizes, int64_t rank, int32_t torch_dtype, const Tensor& like) {
  int32_t device_type = 0, device_index = 0;
  AtenTensorHandle h = like.get();
  shim(aoti_torch_get_device_type(h, &device_type), "get_device_type");
  shim(aoti_torch_get_device_index(h, &device_index), "get_device_index");
  return empty_on(sizes, rank, torch_dtype, device_type, device_index);
}

std::optional<Tensor> host_offsets(const std::optional<Tensor>& cu_seqlens, const std::optional<Tensor>& cu_seqlens_cpu) {
  if (!cu_seqlens.has_value() || cu_seqlens_cpu.has_value()) return cu_seqlens_cpu;
  int32_t device_type = 0, dtype = 0;
  int64_t rank = 0;
  int64_t* sizes = nullptr;
  AtenTensorHandle h = cu_seqlens->get();
  shim(aoti_torch_get_device_type(h, &device_type), "get_device_type");
  if (device_type == codes().cpu) return std::nullopt;
  shim(aoti_torch_get_dtype(h, &dtype), "get_dtype");
  shim(aoti_torch_get_dim(h, &rank), "get_dim");
  if (rank > GLA_MAX_RANK || to_gla_dtype(dtype) < 0) return std::nullopt;  // libgla names the problem
  shim(aoti_torch_get_sizes(h, &sizes), "get_sizes");
  Tensor host = empty_on(sizes, rank, dtype, codes().cpu, 0);
  shim(aoti_torch_copy_(host.get(), h, 0), "copy_");
  return host;
}

Tensor empty_like(const Tensor& like) {
  int32_t dtype = 0;
  int64_t rank = 0;
  int64_t* sizes = nullptr;
  shim(aoti_torch_get_dtype(like.get(), &dtype), "get_dtype");
  shim(aoti_torch_get_dim(like.get(), &rank), "get_dim");
  shim(aoti_torch_get_sizes(like.get(), &sizes), "get_sizes");
  return empty(sizes, rank, dtype, like);
}

Tensor empty_state(const Tensor& like) {
  const int64_t zero = 0;
  return empty(&zero, 1, codes().f32, like);
}

void* current_stream(const Tensor& t) {
  int32_t device_type = 0, device_index = 0;
  shim(aoti_torch_get_device_type(t.get(), &device_type), "get_device_type");
  if (device_type != codes().cuda) return nullptr;
  shim(aoti_torch_get_device_index(t.get(), &device_index), "get_device_index");
  CurrentStreamFn fn = current_cuda_stream_fn();
  if (!fn) fail("RuntimeError", "a CUDA tensor, but this PyTorch has no aoti_torch_get_current_cuda_stream");
  void* stream = nullptr;
  shim(fn(device_index, &stream), "get_current_cuda_stream");
  return stream;
}

gla_options make_options(double scale, bool state_v_first, const std::string& backend, int64_t policy,
                         const Tensor& like) {
  gla_options o;
  gla_options_init(&o);
  o.has_scale = 1;
  o.scale = scale;
  o.state_v_first = state_v_first ? 1 : 0;
  o.backend = backend.empty() ? nullptr : backend.c_str();
  o.policy = static_cast<int32_t>(policy);
  o.stream = current_stream(like);
  return o;
}

gla_allocator Workspace::allocator() {
  return {[](void* context, size_t bytes) -> void* {
            auto& self = *static_cast<Workspace*>(context);
            try {
              const int64_t size = static_cast<int64_t>(bytes);
              self.tensor = empty(&size, 1, aoti_torch_dtype_uint8(), self.like);
              void* data = nullptr;
              shim(aoti_torch_get_data_ptr(self.tensor->get(), &data), "get_data_ptr");
              return data;
            } catch (const std::exception& e) {  // never through libgla's C frames
              self.error = e.what();
              return nullptr;
            }
          },
          this};
}

}  // namespace gla_torch
