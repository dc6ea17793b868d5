#include "Allocator.h"

#include "Runtime.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace hpsim {

namespace {

constexpr size_t kPage = 4096;
size_t round_up(size_t n) { return (n + kPage - 1) / kPage * kPage; }

struct Block {
  void* ptr = nullptr;
  size_t size = 0;
  int device = 0;
  int64_t stream = 0;             // the stream current at allocation
  std::vector<int64_t> used_on;   // other streams recorded with recordDataPtrOnStream
  bool protect = false;           // mapped PROT_NONE outside authorized accesses
  int accesses = 0;
};

struct Held {
  Block* block;
  std::vector<MarkerPtr> markers;
};

struct Heap {
  std::map<std::pair<int64_t, size_t>, std::vector<Block*>> free;  // (stream, size), LIFO
  std::vector<Held> held;
  MemoryStats stats;
};

struct State {
  std::mutex mu;
  std::map<uintptr_t, Block*> blocks;  // every block ever mapped, by start address
  std::array<Heap, kDevices> heaps;
  bool any_protected = false;
  std::map<uintptr_t, size_t> pinned;
  PinnedStats pinned_stats;
};

State& state() {
  static State* s = new State();  // leaked: deleters may run at exit
  return *s;
}

Block* find_locked(State& s, const void* ptr) {
  if (ptr == nullptr || s.blocks.empty()) return nullptr;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto it = s.blocks.upper_bound(p);
  if (it == s.blocks.begin()) return nullptr;
  --it;
  Block* b = it->second;
  return p < it->first + b->size ? b : nullptr;
}

void promote_locked(Heap& heap) {
  auto& held = heap.held;
  for (size_t i = 0; i < held.size();) {
    bool done = true;
    for (const auto& m : held[i].markers) done = done && m->done();
    if (done) {
      Block* b = held[i].block;
      heap.free[{b->stream, b->size}].push_back(b);
      held[i] = std::move(held.back());
      held.pop_back();
    } else {
      ++i;
    }
  }
}

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Heap& heap = s.heaps[b->device];
  heap.stats.allocated_bytes -= static_cast<int64_t>(b->size);
  if (b->used_on.empty()) {
    heap.free[{b->stream, b->size}].push_back(b);
    return;
  }
  Held h{b, {}};
  for (int64_t sid : b->used_on) h.markers.push_back(stream(b->device, sid).record());
  b->used_on.clear();
  heap.held.push_back(std::move(h));
  heap.stats.deferred_reuses += 1;
}

// A c10::DeviceAllocator, so torch.accelerator.memory_allocated() and friends read the
// counters below.
class DeviceAllocator final : public c10::DeviceAllocator {
 public:
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // blocks stay cached (never unmapped)
  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    record_stream(ptr, stream.id());
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const MemoryStats m = memory_stats(device);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto& allocated = out.allocated_bytes[0];  // StatType::AGGREGATE
    allocated.current = m.allocated_bytes;
    allocated.peak = m.peak_allocated_bytes;
    out.active_bytes[0] = allocated;
    out.requested_bytes[0] = allocated;
    out.reserved_bytes[0].current = m.reserved_bytes;
    out.reserved_bytes[0].peak = m.reserved_bytes;
    out.allocation[0].current = m.allocations;
    return out;
  }
  void resetAccumulatedStats(c10::DeviceIndex) override {}
  void resetPeakStats(c10::DeviceIndex device) override { reset_peak(device); }

  c10::DataPtr allocate(size_t nbytes) override {
    const int device = current_device();
    const c10::Device dev(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device));
    if (nbytes == 0) return c10::DataPtr(nullptr, dev);
    const int64_t sid = current_stream(device);
    const size_t size = round_up(nbytes);
    State& s = state();
    Block* b = nullptr;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      Heap& heap = s.heaps[device];
      promote_locked(heap);
      auto it = heap.free.find({sid, size});
      if (it != heap.free.end() && !it->second.empty()) {
        b = it->second.back();
        it->second.pop_back();
        heap.stats.cache_hits += 1;
      } else {
        const bool protect = config().protect.load();
        void* p = mmap(nullptr, size, protect ? PROT_NONE : (PROT_READ | PROT_WRITE),
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        TORCH_CHECK(p != MAP_FAILED, "hpsim: out of memory allocating ", size, " bytes");
        b = new Block();
        b->ptr = p;
        b->size = size;
        b->device = device;
        b->stream = sid;
        b->protect = protect;
        s.any_protected = s.any_protected || protect;
        s.blocks[reinterpret_cast<uintptr_t>(p)] = b;
        heap.stats.reserved_bytes += static_cast<int64_t>(size);
      }
      heap.stats.allocations += 1;
      heap.stats.allocated_bytes += static_cast<int64_t>(size);
      heap.stats.peak_allocated_bytes =
          std::max(heap.stats.peak_allocated_bytes, heap.stats.allocated_bytes);
    }
    if (config().poison.load()) {
      stream(device, sid).enqueue([b, nbytes] {
        Access access({b->ptr});
        std::memset(b->ptr, 0xFF, nbytes);
      });
    }
    return c10::DataPtr(b->ptr, b, &free_block, dev);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    Access access({dest, src});
    std::memcpy(dest, src, count);
  }
};

void free_pinned(void* ptr) {
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    auto it = s.pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != s.pinned.end()) {
      s.pinned_stats.bytes_in_use -= static_cast<int64_t>(it->second);
      s.pinned.erase(it);
    }
  }
  std::free(ptr);
}

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return c10::DataPtr(nullptr, c10::Device(c10::kCPU));
    const size_t size = round_up(nbytes);
    void* p = std::aligned_alloc(kPage, size);
    TORCH_CHECK(p != nullptr, "hpsim: out of pinned host memory allocating ", size, " bytes");
    State& s = state();
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.pinned[reinterpret_cast<uintptr_t>(p)] = size;
      s.pinned_stats.allocations += 1;
      s.pinned_stats.bytes_in_use += static_cast<int64_t>(size);
    }
    return c10::DataPtr(p, p, &free_pinned, c10::Device(c10::kCPU));
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

}  // namespace

c10::Allocator* device_allocator() {
  static DeviceAllocator* a = new DeviceAllocator();
  return a;
}

namespace {
// c10::GetAllocator(PrivateUse1): storages made without a tensor (UntypedStorage(n,
// device=...), deepcopy) allocate here.
struct RegisterAllocator {
  RegisterAllocator() { c10::SetAllocator(c10::DeviceType::PrivateUse1, device_allocator()); }
} register_allocator;
}  // namespace

c10::Allocator* pinned_allocator() {
  static PinnedAllocator* a = new PinnedAllocator();
  return a;
}

MemoryStats memory_stats(int device) {
  TORCH_CHECK(device >= 0 && device < kDevices, "hpsim: no device ", device);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.heaps[device].stats;
}

void reset_peak(int device) {
  TORCH_CHECK(device >= 0 && device < kDevices, "hpsim: no device ", device);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  auto& st = s.heaps[device].stats;
  st.peak_allocated_bytes = st.allocated_bytes;
}

void record_stream(const c10::DataPtr& data_ptr, int64_t stream_id) {
  if (data_ptr.get_deleter() != &free_block) return;
  if (!config().honor_record_stream.load()) return;
  auto* b = static_cast<Block*>(data_ptr.get_context());
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (stream_id == b->stream) return;
  for (int64_t id : b->used_on) {
    if (id == stream_id) return;
  }
  b->used_on.push_back(stream_id);
}

int device_of(const void* ptr) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  Block* b = find_locked(s, ptr);
  return b ? b->device : -1;
}

Access::Access(std::initializer_list<const void*> ptrs) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.any_protected) return;
  for (const void* p : ptrs) {
    Block* b = find_locked(s, p);
    if (b == nullptr || !b->protect) continue;
    if (b->accesses++ == 0) {
      TORCH_CHECK(mprotect(b->ptr, b->size, PROT_READ | PROT_WRITE) == 0, "hpsim: mprotect failed");
    }
    blocks_.push_back(b);
  }
}

Access::~Access() {
  if (blocks_.empty()) return;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (void* vb : blocks_) {
    auto* b = static_cast<Block*>(vb);
    if (--b->accesses == 0) mprotect(b->ptr, b->size, PROT_NONE);
  }
}

bool is_pinned(const void* ptr) {
  if (ptr == nullptr) return false;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  auto it = s.pinned.upper_bound(p);
  if (it == s.pinned.begin()) return false;
  --it;
  return p < it->first + it->second;
}

PinnedStats pinned_stats() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.pinned_stats;
}

}  // namespace hpsim
