#include "hyper_parallel/activation/Eligibility.h"

#include "hyper_parallel/activation/AcceleratorCopyEngine.h"

#include <c10/core/impl/COW.h>

namespace hyper_parallel::activation {

const char* to_string(Ineligible reason) {
  switch (reason) {
    case Ineligible::kNone: return "eligible";
    case Ineligible::kUndefined: return "undefined tensor";
    case Ineligible::kNoStorage: return "tensor without storage";
    case Ineligible::kMetaOrFake: return "meta or fake tensor";
    case Ineligible::kSubclassOrFunctional: return "tensor subclass or functional tensor";
    case Ineligible::kHostTensor: return "host tensor (CPU swap disabled)";
    case Ineligible::kUnsupportedDevice: return "device without a registered backend";
    case Ineligible::kForeignStorage: return "non-resizable or foreign storage";
    case Ineligible::kCopyOnWrite: return "copy-on-write storage";
    case Ineligible::kEmpty: return "empty storage";
    case Ineligible::kParameter: return "parameter or view of a parameter";
  }
  return "unknown";
}

std::optional<SkipReason> skip_reason(Ineligible reason) {
  switch (reason) {
    case Ineligible::kNone:
    case Ineligible::kUndefined: return std::nullopt;
    case Ineligible::kNoStorage: return SkipReason::kNoStorage;
    case Ineligible::kMetaOrFake: return SkipReason::kMetaOrFake;
    case Ineligible::kSubclassOrFunctional: return SkipReason::kSubclassOrFunctional;
    case Ineligible::kHostTensor: return SkipReason::kHostTensor;
    case Ineligible::kUnsupportedDevice: return SkipReason::kUnsupportedDevice;
    case Ineligible::kForeignStorage: return SkipReason::kForeignStorage;
    case Ineligible::kCopyOnWrite: return SkipReason::kCopyOnWrite;
    case Ineligible::kEmpty: return SkipReason::kEmptyStorage;
    case Ineligible::kParameter: return SkipReason::kParameter;
  }
  return std::nullopt;
}

namespace {

// Whether t.storage() returns instead of throwing (wrapper tensors set their storage access
// to throw; TensorImpl has no public query for that flag).
bool storage_readable(const at::Tensor& t) {
  try {
    (void)t.storage();
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

size_t storage_bytes(const at::Tensor& part) {
  if (!part.defined() || !part.has_storage() || !storage_readable(part)) return 0;
  return part.storage().nbytes();
}

}  // namespace

bool has_plain_storage(const at::Tensor& t) {
  return t.defined() && t.layout() == c10::kStrided && !t.is_nested() && t.has_storage() &&
         storage_readable(t);
}

SkipFootprint skip_footprint(const at::Tensor& t) {
  SkipFootprint f;
  if (!t.defined()) return f;
  const c10::Layout layout = t.layout();
  if (has_plain_storage(t)) {
    f.key = t.storage().unsafeGetStorageImpl();
    f.nbytes = t.storage().nbytes();
    return f;
  }
  f.key = t.unsafeGetTensorImpl();
  try {
    if (layout == c10::kSparse) {
      f.nbytes = storage_bytes(t._indices()) + storage_bytes(t._values());
    } else if (layout == c10::kSparseCsr || layout == c10::kSparseBsr) {
      f.nbytes = storage_bytes(t.crow_indices()) + storage_bytes(t.col_indices()) +
                 storage_bytes(t.values());
    } else if (layout == c10::kSparseCsc || layout == c10::kSparseBsc) {
      f.nbytes = storage_bytes(t.ccol_indices()) + storage_bytes(t.row_indices()) +
                 storage_bytes(t.values());
    } else if (layout == c10::kMkldnn) {
      f.nbytes = static_cast<size_t>(t.numel()) * t.element_size();
    }
  } catch (const c10::Error&) {
    f.nbytes = 0;  // a layout whose parts cannot be read: counted, without bytes
  }
  return f;
}

Ineligible check_eligible(const at::Tensor& t, bool cpu_swap) {
  if (!t.defined()) return Ineligible::kUndefined;
  const auto keys = t.key_set();
  if (keys.has(c10::DispatchKey::Python) || keys.has(c10::DispatchKey::Functionalize) ||
      keys.has(c10::DispatchKey::PythonTLSSnapshot)) {
    return Ineligible::kSubclassOrFunctional;
  }
  if (t.is_meta()) return Ineligible::kMetaOrFake;
  if (!has_plain_storage(t)) return Ineligible::kNoStorage;
  const c10::Device device = t.device();
  if (device.is_cpu()) {
    if (!cpu_swap) return Ineligible::kHostTensor;
  } else if (!is_accelerator(device)) {
    return Ineligible::kUnsupportedDevice;
  }
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  if (!storage->resizable() || storage->allocator() == nullptr || storage->received_cuda()) {
    return Ineligible::kForeignStorage;
  }
  if (storage->data_ptr().get() == nullptr || storage->nbytes() == 0) return Ineligible::kEmpty;
  if (c10::impl::cow::is_cow_data_ptr(storage->data_ptr())) return Ineligible::kCopyOnWrite;
  if (t.requires_grad() && t.is_leaf()) return Ineligible::kParameter;
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    if (base.defined() && base.requires_grad() && base.is_leaf()) return Ineligible::kParameter;
  }
  return Ineligible::kNone;
}

}  // namespace hyper_parallel::activation
