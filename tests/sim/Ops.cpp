// hpsim operators: the aten kernels the simulated device implements itself (allocation,
// views, copies, resize), a boxed CPU fallback for every other operator, and the
// hpsim:: control operators the Python loader (tests/sim/hpsim.py) calls.
//
// Views must alias, so the view kernels are registered natively; everything that computes
// goes through the fallback, which moves its inputs to the host with stream-ordered
// copies on the current stream, runs the CPU kernel, and copies the outputs back: compute
// happens in stream order, after every wait queued on the stream.

#include "Allocator.h"
#include "Runtime.h"
#include "Storage.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_conj.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/_neg_view.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

namespace hpsim {

namespace {

constexpr c10::DispatchKeySet kKeys(c10::DispatchKey::PrivateUse1);

void check_options(std::optional<c10::Device> device, std::optional<c10::Layout> layout,
                   std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "hpsim: only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory),
              "hpsim: pin_memory applies to host tensors only");
  TORCH_CHECK(c10::device_or_default(device).type() == c10::DeviceType::PrivateUse1,
              "hpsim: expected an hpsim device");
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  check_options(device, layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_generic(size, device_allocator(), kKeys, c10::dtype_or_default(dtype),
                                   memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  check_options(device, layout, pin_memory);
  const c10::DeviceGuard guard(c10::device_or_default(device));
  return at::detail::empty_strided_generic(size, stride, device_allocator(), kKeys,
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  std::optional<int64_t> off;
  if (offset) off = offset->expect_int();
  return at::native::as_strided_tensorimpl(self, C10_AS_INTARRAYREF_SLOW(size),
                                           C10_AS_INTARRAYREF_SLOW(stride), off);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size,
                         c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size),
                                    C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dim, int64_t size, int64_t step) {
  return at::native::unfold(self, dim, size, step);
}

// Resizes through resize_storage_bytes (stream ordered), never a host memcpy of device
// memory as the CPU resize would do.
const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size_sym,
                          std::optional<c10::MemoryFormat> memory_format) {
  const auto size = C10_AS_INTARRAYREF_SLOW(size_sym);
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  const bool restride = memory_format && *memory_format != c10::MemoryFormat::Preserve;
  if (self.sizes() == size && !restride) return self;
  impl->set_sizes_contiguous(size);
  if (restride) impl->empty_tensor_restride(*memory_format);
  const size_t need = at::detail::computeStorageNbytes(
      impl->sizes(), impl->strides(), self.dtype().itemsize(), impl->storage_offset());
  if (need > self.storage().nbytes()) resize_storage_bytes(self.storage(), need);
  return self;
}

// A source with a conjugate or negative bit (x.conj(), a lazy view): the math-bit
// fallbacks would materialize it with clone, which copies with copy_, which comes back
// here through the same fallback (infinite recursion, a stack overflow). _copy_from falls
// through those keys (below) and the copy applies the bits itself: the raw bytes first
// (the bits are metadata), then the math on the destination, in order after the copy.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const bool conj = self.is_conj() != dst.is_conj();
  const bool neg = self.is_neg() != dst.is_neg();
  if (!self.is_conj() && !self.is_neg() && !conj && !neg) {
    copy(self, dst, non_blocking);
    return dst;
  }
  TORCH_CHECK(!dst.is_conj() && !dst.is_neg(),
              "hpsim: a copy into a tensor with a conjugate or negative bit is not supported; "
              "resolve the destination first (resolve_conj() / resolve_neg())");
  at::Tensor raw = self;
  if (raw.is_conj()) raw = at::_conj(raw);  // views with the bits cleared: the raw values
  if (raw.is_neg()) raw = at::_neg_view(raw);
  // The math runs on the host (the device has no kernels of its own for it): the raw
  // values there, the source's bits set again, resolved by the CPU's copy.
  at::Tensor host = raw;
  if (!raw.is_cpu()) {
    host = at::empty(raw.sizes(), raw.options().device(at::kCPU));
    copy(raw, host, /*non_blocking=*/false);
  }
  if (self.is_conj()) host = at::_conj(host);
  if (self.is_neg()) host = at::_neg_view(host);
  if (dst.is_cpu()) {
    const_cast<at::Tensor&>(dst).copy_(host);
  } else {
    copy(host.resolve_conj().resolve_neg(), dst, /*non_blocking=*/false);
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  resize_(dst, c10::fromIntArrayRefSlow(self.sizes()), std::nullopt);
  return copy_from(self, dst, false);
}

at::Tensor& set_storage_offset(at::Tensor& self, c10::Storage source, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack, /*error_on_views=*/true);
}

// ----------------------------------------------------------------- control operators

std::vector<int64_t> memory_stats_op(int64_t device) {
  const MemoryStats s = memory_stats(static_cast<int>(device));
  return {s.allocated_bytes, s.peak_allocated_bytes, s.reserved_bytes,
          s.allocations,     s.cache_hits,           s.deferred_reuses};
}

std::vector<int64_t> copy_stats_op() {
  const CopyStats c = copy_stats();
  const PinnedStats p = pinned_stats();
  return {c.host_to_device, c.device_to_host, c.device_to_device, c.asynchronous,
          c.pinned_bytes,   c.storage_resizes, p.allocations,      p.bytes_in_use};
}

double stream_wait_seconds(int64_t device, int64_t stream_id) {
  return stream(static_cast<int>(device), stream_id).wait_seconds();
}

void configure(double link_ns_per_byte, bool protect, bool poison, bool honor_record_stream,
               bool honor_default_stream_waits) {
  TORCH_CHECK(link_ns_per_byte >= 0.0, "hpsim: link delay must be >= 0 ns per byte");
  Config& c = config();
  c.link_ns_per_byte = link_ns_per_byte;
  c.protect = protect;
  c.poison = poison;
  c.honor_record_stream = honor_record_stream;
  c.honor_default_stream_waits = honor_default_stream_waits;
}

int64_t unsafe_host_read(const at::Tensor& t) {
  // Reads device memory from the host thread, outside any Access: crashes under protect.
  return static_cast<const volatile uint8_t*>(t.data_ptr())[0];
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
  m.impl("resize_", resize_);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("set_.source_Storage_storage_offset", set_storage_offset);
  m.impl("set_.source_Storage", set_storage);
  m.impl("set_.source_Tensor", set_tensor);
}

// (see copy_from: the copy applies conjugate and negative bits itself)
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY(hpsim, m) {
  m.def("device_count() -> int", [] { return static_cast<int64_t>(kDevices); });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(current_device()); });
  m.def("set_device(int device) -> ()", [](int64_t d) { set_current_device(static_cast<int>(d)); });
  m.def("synchronize(int device) -> ()", [](int64_t d) { synchronize_device(static_cast<int>(d)); });
  m.def("memory_stats(int device) -> int[]", memory_stats_op);
  m.def("reset_peak_memory_stats(int device) -> ()", [](int64_t d) { reset_peak(static_cast<int>(d)); });
  m.def("copy_stats() -> int[]", copy_stats_op);
  m.def("stream_wait_seconds(int device, int stream) -> float", stream_wait_seconds);
  m.def("configure(float link_ns_per_byte, bool protect, bool poison, bool honor_record_stream, "
        "bool honor_default_stream_waits) -> ()",
        configure);
  m.def("unsafe_host_read(Tensor t) -> int", unsafe_host_read);
}

}  // namespace hpsim
