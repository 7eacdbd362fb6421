// A test-only out-of-tree PyTorch device on the PrivateUse1 dispatch key, the mechanism torch_npu
// and other vendors' devices are built on. Its memory lives on the host (an allocator over
// aligned malloc that tags every allocation with the PrivateUse1 device), a device guard and the
// hooks PyTorch asks a PrivateUse1 backend for, the factory, view and copy kernels a device must
// provide itself, and every other aten op through PyTorch's CPU fallback (arguments copied to the
// CPU, the CPU kernel, results copied back). No native libgla backend serves this device type:
// it is what the portable `torch` backend is for. Built by tests/python/host_device.py.
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/set_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

std::atomic<int64_t> g_live_bytes{0};
std::atomic<int64_t> g_allocations{0};
std::atomic<int64_t> g_fallback_ops{0};

void release(void* ctx) {
  auto* header = static_cast<int64_t*>(ctx);
  g_live_bytes -= header[0];
  std::free(header);
}

// Host memory tagged as the PrivateUse1 device. A 64-byte header in front of each block holds its
// size (for the live-byte count the tests read).
struct HostDeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    constexpr size_t kHeader = 64;
    void* base = std::aligned_alloc(64, kHeader + ((n + 63) / 64) * 64);
    TORCH_CHECK(base != nullptr, "host_device: out of memory allocating ", n, " bytes");
    static_cast<int64_t*>(base)[0] = static_cast<int64_t>(n);
    g_live_bytes += static_cast<int64_t>(n);
    ++g_allocations;
    return {static_cast<char*>(base) + kHeader, base, &release, c10::Device(kType, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }  // the context is not the data
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

HostDeviceAllocator g_allocator;

// One device, index 0, one default stream.
struct HostDeviceGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device) const override { return {kType, 0}; }
  c10::Device getDevice() const override { return {kType, 0}; }
  void setDevice(c10::Device d) const override { TORCH_CHECK(d.index() <= 0, "host_device has one device, got ", d); }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override { return c10::Stream(c10::Stream::DEFAULT, d); }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override { return s; }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeDevice(c10::DeviceIndex) const override {}
};

struct HostDeviceHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
  at::Device getDeviceFromPtr(void*) const override { return {kType, 0}; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    c10::DataPtr fresh = g_allocator.allocate(newsize);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

// ---- kernels the device provides itself ----
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout> layout, std::optional<at::Device> device,
                               std::optional<bool> pin_memory, std::optional<at::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                         std::optional<at::Layout> layout, std::optional<at::Device> device,
                         std::optional<bool> pin_memory) {
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over the same bytes (host memory), for copies.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() == c10::DeviceType::CPU) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::DeviceType::CPU));
}

// Every copy that involves this device: the bytes are on the host either way.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.sizes() == dst.sizes(), "host_device: copy between different shapes ", self.sizes(), " and ",
              dst.sizes());
  if (dst.numel() > 0) host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  // resize_ through the generic path: sizes set, storage grown by resizePrivateUse1Bytes
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_source(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                      c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ++g_fallback_ops;
  at::native::cpu_fallback(op, stack);
}

int64_t live_bytes() { return g_live_bytes.load(); }
int64_t allocations() { return g_allocations.load(); }
int64_t fallback_ops() { return g_fallback_ops.load(); }

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, HostDeviceGuard);

namespace {
struct Startup {
  Startup() {
    c10::SetAllocator(kType, &g_allocator);
    static HostDeviceHooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
  }
} g_startup;
}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage_storage_offset", set_source);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY(gla_host_device, m) {
  m.def("live_bytes() -> int", live_bytes);
  m.def("allocations() -> int", allocations);
  m.def("fallback_ops() -> int", fallback_ops);
}
