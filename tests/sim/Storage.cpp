#include "Storage.h"

#include "Allocator.h"
#include "Runtime.h"

#include <ATen/ops/from_blob.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstring>
#include <vector>

namespace hpsim {

namespace {

struct Counters {
  std::atomic<int64_t> h2d{0}, d2h{0}, d2d{0}, async{0}, pinned_bytes{0}, resizes{0};
};
Counters& counters() {
  static Counters* c = new Counters();
  return *c;
}

// What a task needs to rebuild one side of a copy as a CPU tensor, captured at enqueue
// time (the device storage may be freed in place before the task runs).
struct Side {
  void* ptr;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
  at::Tensor keep_alive;  // host tensors only

  static Side of(const at::Tensor& t, bool host) {
    return Side{t.data_ptr(), t.sizes().vec(), t.strides().vec(), t.scalar_type(),
                host ? t : at::Tensor()};
  }
  at::Tensor as_cpu() const {
    return at::from_blob(ptr, sizes, strides, at::TensorOptions().dtype(dtype).device(at::kCPU));
  }
};

bool on_sim(const at::Tensor& t) { return t.device().type() == c10::DeviceType::PrivateUse1; }

}  // namespace

CopyStats copy_stats() {
  Counters& c = counters();
  return CopyStats{c.h2d.load(), c.d2h.load(), c.d2d.load(), c.async.load(), c.pinned_bytes.load(),
                   c.resizes.load()};
}

void copy(const at::Tensor& src, const at::Tensor& dst, bool non_blocking) {
  if (dst.numel() == 0) return;
  const bool src_dev = on_sim(src);
  const bool dst_dev = on_sim(dst);
  TORCH_CHECK(src_dev || src.is_cpu(), "hpsim: cannot copy from ", src.device());
  TORCH_CHECK(dst_dev || dst.is_cpu(), "hpsim: cannot copy to ", dst.device());
  Counters& c = counters();
  const int device = dst_dev ? dst.device().index() : src.device().index();
  Stream& s = stream(device, current_stream(device));
  if (src_dev && dst_dev && src.device() != dst.device()) {
    // Cross-device: the destination stream first waits for the source's current stream.
    const int sd = src.device().index();
    s.wait(stream(sd, current_stream(sd)).record());
  }
  Side from = Side::of(src, !src_dev);
  Side to = Side::of(dst, !dst_dev);
  const at::Tensor& host = src_dev ? dst : src;
  const bool pinned = !(src_dev && dst_dev) && is_pinned(host.data_ptr());
  const size_t bytes = static_cast<size_t>(dst.numel()) * dst.element_size();
  if (src_dev && dst_dev) {
    c.d2d += 1;
  } else if (dst_dev) {
    c.h2d += 1;
  } else {
    c.d2h += 1;
  }
  if (pinned) c.pinned_bytes += static_cast<int64_t>(bytes);
  auto task = [from = std::move(from), to = std::move(to), pinned, bytes] {
    if (pinned) link_delay(bytes);
    Access access({from.ptr, to.ptr});
    at::Tensor d = to.as_cpu();
    d.copy_(from.as_cpu());
  };
  const bool async = (src_dev && dst_dev) || (non_blocking && pinned);
  if (async) {
    c.async += 1;
    s.enqueue(std::move(task));
    return;
  }
  s.enqueue(std::move(task));
  s.synchronize();
}

void resize_storage_bytes(const c10::Storage& storage, size_t nbytes) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "hpsim: trying to resize a storage that is not resizable");
  const int device = impl->device().index();
  const int previous = current_device();
  set_current_device(device);
  c10::Allocator* allocator = impl->allocator() ? impl->allocator() : device_allocator();
  c10::DataPtr fresh = allocator->allocate(nbytes);
  set_current_device(previous);
  const size_t keep = std::min(nbytes, impl->nbytes());
  if (keep > 0) {
    void* to = fresh.get();
    const void* from = impl->data();
    stream(device, current_stream(device)).enqueue([to, from, keep] {
      Access access({to, from});
      std::memcpy(to, from, keep);
    });
  }
  // The old block is freed after the copy was queued: reused on its stream only after it.
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(nbytes);
  counters().resizes += 1;
}

}  // namespace hpsim
