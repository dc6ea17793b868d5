#pragma once
// hpsim memory: the device caching allocator, authorized access to device memory, and the
// pinned host allocator (test-only; see Runtime.h).
//
// Device allocator, with the caching-allocator semantics that swap correctness rests on
// (those of CUDA's caching allocator):
//  * A block belongs to the stream current at allocation. A freed block goes straight to
//    that stream's free list and is handed to the next allocation of its size class on
//    that stream, last freed first (LIFO, so a use-after-free across streams shows up
//    at once as overwritten data).
//  * recordDataPtrOnStream(block, s) for another stream s: when the block is freed, a
//    marker is recorded on s and the block is not reused until s has passed it.
//  * Counters: allocated (bytes in live blocks, size-class rounded), peak, reserved
//    (bytes ever mapped), allocations, cache hits.
//  * With `poison`, a new allocation is filled with 0xFF bytes by a task on the allocating
//    stream (stream ordered, as cudaMemsetAsync), so reading it before it is written
//    gives NaN.
//
// Pinned host memory: page-aligned host blocks, registered so isPinnedPtr() knows them;
// counted (allocations, bytes in use).
//
// Thread-safety: all functions are thread-safe.

#include <c10/core/Allocator.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace hpsim {

struct MemoryStats {
  int64_t allocated_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t allocations = 0;     // allocate() calls with nbytes > 0
  int64_t cache_hits = 0;      // served from a free list
  int64_t deferred_reuses = 0; // frees held back by recordDataPtrOnStream
};

c10::Allocator* device_allocator();
MemoryStats memory_stats(int device);
void reset_peak(int device);
// Records that `stream_id` of the block's device uses the block of `data_ptr`.
void record_stream(const c10::DataPtr& data_ptr, int64_t stream_id);
// Device of the block holding `ptr`, or -1 when `ptr` is not device memory.
int device_of(const void* ptr);

// While alive, the device blocks holding `ptrs` are readable and writable (protect mode).
// Null pointers and host pointers are ignored.
class Access {
 public:
  Access(std::initializer_list<const void*> ptrs);
  ~Access();
  Access(const Access&) = delete;
  Access& operator=(const Access&) = delete;

 private:
  std::vector<void*> blocks_;
};

c10::Allocator* pinned_allocator();
bool is_pinned(const void* ptr);
struct PinnedStats {
  int64_t allocations = 0;
  int64_t bytes_in_use = 0;
};
PinnedStats pinned_stats();

}  // namespace hpsim
