#pragma once
// hpsim data movement: the copy kernel behind Tensor.copy_/to() for the simulated device,
// and storage resize (the PrivateUse1 hook the swap engine refills storages through).
//
// Copies run as tasks on a stream, in stream order:
//  * device <-> device: on the current stream of the destination device; asynchronous.
//  * host <-> device: on the current stream of the device; asynchronous when
//    `non_blocking` and the host memory is pinned (hpsim pinned allocator), otherwise the
//    host waits for the task (so a pageable copy is synchronous, as on CUDA).
//  * A copy touching pinned host memory also sleeps for the link time of its bytes
//    (Config::link_ns_per_byte) before it moves them: it models the DMA link, and data
//    lands at the end of the interval, the worst case for an early reader. Copies to and
//    from pageable memory (the CPU fallback's staging) model compute and are not delayed.
//
// Thread-safety: thread-safe.

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#include <cstdint>

namespace hpsim {

struct CopyStats {
  int64_t host_to_device = 0;
  int64_t device_to_host = 0;
  int64_t device_to_device = 0;
  int64_t asynchronous = 0;
  int64_t pinned_bytes = 0;   // bytes moved between device and pinned host memory
  int64_t storage_resizes = 0;
};
CopyStats copy_stats();

// dst.copy_(src) where at least one of them lives on hpsim (broadcasting and dtype
// conversion as Tensor.copy_).
void copy(const at::Tensor& src, const at::Tensor& dst, bool non_blocking);

// Re-allocates `storage` (on hpsim) to `nbytes` on the current stream of its device,
// keeping its first min(old, new) bytes (a device-to-device copy in stream order).
void resize_storage_bytes(const c10::Storage& storage, size_t nbytes);

}  // namespace hpsim
