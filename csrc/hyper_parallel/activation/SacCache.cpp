#include "hyper_parallel/activation/SacCache.h"

#include "hyper_parallel/activation/Eligibility.h"
#include "hyper_parallel/activation/SavedBytesMeter.h"
#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

namespace hyper_parallel::activation {

SacCache::SacCache(std::shared_ptr<const OpPolicyTable> table, SwapEngine* engine,
                   bool allow_mutation)
    : table_(std::move(table)), engine_(engine), allow_mutation_(allow_mutation) {}

SacCache::~SacCache() = default;

SwapEngine& SacCache::engine() const { return engine_ ? *engine_ : SwapEngine::global(); }

CheckpointPolicy SacCache::table_policy(int64_t op_key) const {
  HP_CHECK(table_ != nullptr, "this selective-checkpoint cache has no policy table; pass the "
           "policy explicitly (internal use: SacCache(table) or record(..., policy))");
  return table_->policy_for(op_key);
}

uint64_t SacCache::mix_signature(uint64_t h, const at::Tensor& t) {
  // boost::hash_combine's mixing step, per field.
  auto mix = [&h](uint64_t v) { h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2); };
  mix(static_cast<uint64_t>(t.scalar_type()) + 1);
  mix(static_cast<uint64_t>(t.dim()));
  for (const int64_t size : t.sizes()) mix(static_cast<uint64_t>(size));
  return h;
}

namespace {
uint64_t mix_value(uint64_t h, const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return t.defined() ? SacCache::mix_signature(h, t) : h;
  }
  if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) h = mix_value(h, item);
  }
  return h;
}
}  // namespace

SacCache::Slot::~Slot() {
  if (value.isTensor()) SavedBytesMeter::note_release(value.toTensor());
}

uint64_t SacCache::input_signature(c10::ArrayRef<c10::IValue> args) {
  uint64_t h = kSignatureSeed;
  for (const c10::IValue& v : args) h = mix_value(h, v);
  return h == 0 ? 1 : h;
}

int64_t SacCache::record(int64_t op_key, CheckpointPolicy policy,
                         const std::vector<c10::IValue>& outputs, OutputKind kind,
                         const std::shared_ptr<SwapGroup>& group, std::optional<RngStep> rng,
                         uint64_t inputs) {
  HP_CHECK_VALUE(op_key >= 0, "invalid op key ", op_key);
  Entry entry;
  entry.kind = kind;
  entry.policy = policy;
  entry.inputs = inputs;
  if (!is_recompute(policy)) {
    entry.state = State::kCached;
    entry.slots.reserve(outputs.size());
    SavedBytesMeter* meter = SavedBytesMeter::active();
    for (const auto& v : outputs) {
      Slot slot;
      if (v.isTensor() && v.toTensor().defined()) {
        const at::Tensor& t = v.toTensor();
        if (is_swap(policy) && group) slot.handle = engine().pack(group, t, PackMode::kSwapAll);
        if (!slot.handle) {
          slot.value = t.tensor_data();
          slot.version = t._version();
        }
        if (meter) meter->observe(t);
      } else if (!v.isTensor()) {
        slot.value = v;  // None, int, double, bool (an undefined tensor stays None)
      }
      entry.slots.push_back(std::move(slot));
    }
    entry.rng = std::move(rng);
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(op_key) >= entries_.size()) {
    entries_.resize(op_key + 1);
    cached_calls_.resize(op_key + 1, 0);
  }
  if (entry.state == State::kCached) ++cached_calls_[op_key];
  auto& calls = entries_[op_key];
  calls.push_back(std::move(entry));
  const int64_t index = static_cast<int64_t>(calls.size()) - 1;
  if (!forward_over_ && calls.back().state == State::kCached) {
    for (const auto& slot : calls.back().slots) {
      const at::Tensor* t = slot.handle ? &slot.handle->alias()
                            : slot.value.isTensor() ? &slot.value.toTensor() : nullptr;
      if (t == nullptr || !t->defined() || !t->has_storage()) continue;
      auto& holders = storages_[t->storage().unsafeGetStorageImpl()];
      if (holders.empty() || holders.back() != std::make_pair(op_key, index)) {
        holders.emplace_back(op_key, index);
      }
    }
    watching_.store(!storages_.empty(), std::memory_order_release);
  }
  return index;
}

template <class F>
void SacCache::for_entries_of(const at::Tensor& t, F&& f) {
  if (forward_over_ || storages_.empty() || !t.defined() || !t.has_storage()) return;
  const auto it = storages_.find(t.storage().unsafeGetStorageImpl());
  if (it == storages_.end()) return;
  for (const auto& [op, call] : it->second) {
    Entry& e = entries_[static_cast<size_t>(op)][static_cast<size_t>(call)];
    if (e.state == State::kCached) f(e);
  }
}

void SacCache::before_write(const at::Tensor& t) {
  if (!watching_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(mu_);
  for_entries_of(t, [](Entry& e) { e.written = true; });
}

void SacCache::watch(c10::ArrayRef<c10::IValue> outputs) {
  if (!watching_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (forward_over_ || storages_.empty()) return;
  auto one = [this](const at::Tensor& t) {
    for_entries_of(t, [&t](Entry& e) {
      const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
      e.watches.push_back(Watch{counter, counter.current_version()});
    });
  };
  for (const auto& v : outputs) {
    if (v.isTensor()) {
      one(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) one(t);
    } else if (v.isList()) {
      for (const c10::IValue& u : v.toListRef()) {
        if (u.isTensor()) one(u.toTensor());
      }
    }
  }
}

bool SacCache::watched_write(const Entry& e) {
  for (const Watch& w : e.watches) {
    if (w.counter.current_version() != w.version) return true;
  }
  return false;
}

std::vector<SacCache::Demoted> SacCache::end_forward() {
  std::lock_guard<std::mutex> lock(mu_);
  forward_over_ = true;
  storages_.clear();
  watching_.store(false, std::memory_order_release);
  std::vector<Demoted> out;
  for (size_t op = 0; op < entries_.size(); ++op) {
    auto& calls = entries_[op];
    for (size_t i = 0; i < calls.size(); ++i) {
      Entry& e = calls[i];
      if (e.state != State::kCached) continue;
      bool mutated = e.written || watched_write(e);
      for (const auto& slot : e.slots) {
        if (slot.handle) {
          mutated |= slot.handle->alias()._version() != slot.handle->saved_version();
        } else if (slot.value.isTensor()) {
          mutated |= slot.value.toTensor()._version() != slot.version;
        }
      }
      if (!mutated) continue;
      e.slots.clear();
      e.watches.clear();
      e.rng.reset();  // replayed: the op draws again
      e.state = State::kRecompute;
      --cached_calls_[op];
      out.push_back(Demoted{static_cast<int64_t>(op), static_cast<int64_t>(i), e.policy});
    }
  }
  return out;
}

void SacCache::begin_recompute() {
  std::lock_guard<std::mutex> lock(mu_);
  replay_calls_.assign(entries_.size(), 0);
}

SacCache::Replay SacCache::replay(int64_t op_key, bool retain,
                                 c10::function_ref<uint64_t()> signature) {
  std::lock_guard<std::mutex> lock(mu_);
  HP_CHECK_VALUE(op_key >= 0, "invalid op key ", op_key);
  if (static_cast<size_t>(op_key) >= replay_calls_.size()) replay_calls_.resize(op_key + 1, 0);
  const int64_t index = replay_calls_[op_key]++;
  const bool known = static_cast<size_t>(op_key) < entries_.size();
  const size_t recorded = known ? entries_[op_key].size() : 0;
  Replay out;
  // An op forward never cached: its calls need not line up with forward's (only cached
  // outputs are matched by call index), so recompute just runs it.
  if (!known || cached_calls_[op_key] == 0) return out;
  HP_CHECK(static_cast<size_t>(index) < recorded, "the recompute of a selective checkpoint "
           "region ran ", OpNames::name(op_key), " (call #", index, ") but its forward ran it ",
           recorded, " time(s). A checkpointed function must run the same ops in the same order "
           "when it is recomputed: avoid data-dependent control flow and global state that "
           "changes between forward and backward, or use full recompute (policy_fn=None).");
  Entry& entry = entries_[op_key][index];
  out.kind = entry.kind;
  if (entry.state == State::kRecompute) return out;
  HP_CHECK(entry.state != State::kDropped, "the output of ", OpNames::name(op_key), " (call #",
           index, ") cached by selective checkpoint was already used and released by an earlier "
           "backward. To run backward twice through a selective checkpoint region, pass "
           "retain_graph=True to the first backward.");
  const uint64_t inputs = entry.inputs != 0 && signature ? signature() : 0;
  HP_CHECK(inputs == 0 || inputs == entry.inputs, "the recompute of a "
           "selective checkpoint region ran ", OpNames::name(op_key), " (call #", index, ") on "
           "inputs whose dtypes or shapes differ from those of the forward's call #", index,
           ", whose outputs the policy cached: the recompute ran another sequence of ops than "
           "the forward. A checkpointed function must run the same ops in the same order when "
           "it is recomputed: avoid control flow that depends on data or on state that changes "
           "between forward and backward, or let the policy recompute this op "
           "(PREFER_RECOMPUTE).");
  out.recompute = false;
  out.outputs.reserve(entry.slots.size());
  // A write after the forward through a tensor sharing the storage but not the version
  // counter (aten::_unsafe_view's output): the cached value is stale as much as if the
  // cached tensor itself had been written.
  bool swapped = false;
  for (const auto& slot : entry.slots) swapped |= slot.handle != nullptr;
  HP_CHECK((allow_mutation_ && !swapped) || !watched_write(entry), "the output of ",
           OpNames::name(op_key), " (call #", index, ") that selective checkpoint cached was "
           "modified in place after the region's forward through a tensor sharing its memory "
           "(made by aten::_unsafe_view or the like, e.g. the result of torch.matmul), so "
           "backward would read a stale value. Clone that tensor before the in-place op, or "
           "let the policy recompute this op (PREFER_RECOMPUTE)",
           swapped ? "." : ", or pass allow_cache_entry_mutation=True to use the modified value.");
  for (const auto& slot : entry.slots) {
    if (slot.handle) {
      const at::Tensor& alias = slot.handle->alias();
      HP_CHECK(alias._version() == slot.handle->saved_version(), "the output of ",
               OpNames::name(op_key), " (call #", index, ", shape ", alias.sizes(),
               ") that selective checkpoint swapped (MUST_SWAP) was modified in place after it "
               "was cached (version ", slot.handle->saved_version(), " -> ", alias._version(),
               "), so backward would read a stale value. Clone it before the in-place op, or "
               "let the policy recompute this op.");
      out.outputs.emplace_back(engine().unpack(*slot.handle).tensor_data());
    } else if (slot.value.isTensor()) {
      const at::Tensor& t = slot.value.toTensor();
      HP_CHECK(allow_mutation_ || t._version() == slot.version, "the output of ", OpNames::name(op_key), " (call #",
               index, ", shape ", t.sizes(), ") that selective checkpoint cached was modified in "
               "place after it was cached (version ", slot.version, " -> ", t._version(),
               "), so backward would read a stale value. Clone it before the in-place op, or "
               "let the policy recompute this op (PREFER_RECOMPUTE), or pass allow_cache_entry_mutation=True "
               "to use the modified value.");
      out.outputs.emplace_back(t.tensor_data());
    } else {
      out.outputs.push_back(slot.value);
    }
  }
  ++replays_;
  if (entry.rng) entry.rng->replay();
  if (!retain) {
    entry.slots.clear();
    entry.slots.shrink_to_fit();
    entry.watches.clear();
    entry.watches.shrink_to_fit();
    entry.rng.reset();
    entry.state = State::kDropped;
  }
  return out;
}

bool SacCache::next_is_cached(int64_t op_key) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (op_key < 0 || static_cast<size_t>(op_key) >= entries_.size() || cached_calls_[op_key] == 0) {
    return false;
  }
  const size_t index = static_cast<size_t>(op_key) < replay_calls_.size()
                           ? static_cast<size_t>(replay_calls_[op_key]) : 0;
  const auto& calls = entries_[op_key];
  return index >= calls.size() || calls[index].state != State::kRecompute;
}

SacCacheStats SacCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SacCacheStats s;
  for (const auto& calls : entries_) {
    for (const auto& e : calls) {
      switch (e.state) {
        case State::kRecompute: ++s.recompute_entries; continue;
        case State::kDropped: ++s.dropped_entries; continue;
        case State::kCached: break;
      }
      bool swapped = false;
      for (const auto& slot : e.slots) {
        if (slot.handle) {
          swapped = true;
          ++s.swapped_tensors;
        } else if (slot.value.isTensor()) {
          ++s.saved_tensors;
        }
      }
      ++(swapped ? s.swapped_entries : s.saved_entries);
    }
  }
  s.replays = replays_;
  return s;
}

std::vector<at::Tensor> SacCache::cached_tensors(bool swapped) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Tensor> out;
  for (const auto& calls : entries_) {
    for (const auto& e : calls) {
      for (const auto& slot : e.slots) {
        if (swapped && slot.handle) out.push_back(slot.handle->alias().tensor_data());
        if (!swapped && !slot.handle && slot.value.isTensor()) {
          out.push_back(slot.value.toTensor().tensor_data());
        }
      }
    }
  }
  return out;
}

void SacCache::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& calls : entries_) {
    for (auto& e : calls) {
      if (e.state == State::kCached) {
        e.slots.clear();
        e.watches.clear();
        e.rng.reset();
        e.state = State::kDropped;
      }
    }
  }
}

}  // namespace hyper_parallel::activation
