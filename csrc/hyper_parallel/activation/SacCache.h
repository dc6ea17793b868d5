#pragma once
// SacCache: the state of ONE selective-checkpoint region invocation (SPEC 2).
//
// A checkpoint region with a per-op policy runs its forward under a caching dispatch
// mode and its recompute (in backward) under a cached mode; both are thin Python shells
// around one SacCache. Forward appends, for every call of an op, an entry keyed by
// (op key, call index):
//   * recompute   - a marker: the op runs again during recompute;
//   * saved       - aliases of the op's output tensors (Tensor::tensor_data(): same
//                   storage and version counter, no autograd history, so no reference
//                   cycle), each with the version seen when it was cached;
//   * swapped     - MUST_SWAP: a SavedHandle of each output tensor, packed into the
//                   region's swap group, so the layer schedule offloads it after the
//                   forward and prefetches it before the backward. The cache holds only
//                   the handle (counted in the record's alias_refs), never another strong
//                   tensor reference, so the engine may free the device storage.
// Recompute walks the same sequence: replay(op) returns "run it" or the cached outputs
// (swapped ones are made resident through SwapEngine::unpack, reloading on demand). Only
// cached outputs must line up: an op none of whose forward calls was cached may run any
// number of times in recompute (e.g. autocast's weight cast, which forward skipped on a
// cache hit in a sibling region and recompute runs again; docs/design.md, "Selective
// checkpoint"). A cached tensor modified in place after the region's forward is an error,
// never a stale value, unless the cache allows cache-entry mutation (torch's
// allow_cache_entry_mutation=True: the tensor is handed back as it is now). One modified in place WITHIN the forward (e.g. empty_like filled by bernoulli_,
// or `h = x @ w; h.mul_(2)`) is demoted to "recompute" by end_forward(): the recompute
// then replays the op and the writes after it, which rebuilds the right value.
//
// Lifetime and retain_graph: the cache lives as long as the region's autograd graph (its
// modes are owned by torch's checkpoint frame). After a replay the entry is dropped, so
// its memory goes as soon as backward no longer needs it, unless the caller says the
// graph is retained (retain_graph=True), in which case the entry stays for the next
// backward. Replaying a dropped entry raises a clear error.
//
// Non-tensor outputs (None, int, double, bool) are cached as values.
//
// Thread-safety: thread-safe; one mutex per cache. Forward and recompute of one region
// may run on different threads (the autograd engine's); replay may block on a reload
// while holding this cache's mutex (never the engine's).

#include "hyper_parallel/activation/CheckpointPolicy.h"
#include "hyper_parallel/activation/OpPolicyTable.h"
#include "hyper_parallel/activation/RngStep.h"
#include "hyper_parallel/activation/SavedHandle.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/util/FunctionRef.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>
#include <vector>

namespace hyper_parallel::activation {

class SwapEngine;
class SwapGroup;

// How an op returned its outputs (so the cached mode returns the same Python shape).
enum class OutputKind : uint8_t {
  kSingle = 0,  // one value (a tensor, a scalar or None)
  kTuple = 1,   // a tuple of values
  kList = 2,    // a list of values (e.g. Tensor[])
};

struct SacCacheStats {
  int64_t recompute_entries = 0;  // calls marked "run again"
  int64_t saved_entries = 0;      // calls whose outputs are cached on device
  int64_t swapped_entries = 0;    // calls with at least one swapped output
  int64_t dropped_entries = 0;    // cached calls already replayed and released
  int64_t saved_tensors = 0;      // live cached tensors kept on device
  int64_t swapped_tensors = 0;    // live swap handles
  int64_t replays = 0;            // cached outputs handed back in recompute
};

class SacCache {
 public:
  // `table`: the declarative policy used by table_policy() (may be null). `engine`: the
  // engine that packs and unpacks MUST_SWAP outputs (null: SwapEngine::global()).
  // `allow_mutation`: hand back saved tensors modified in place after the forward instead
  // of raising (torch.utils.checkpoint's allow_cache_entry_mutation=True). Swapped
  // (MUST_SWAP) tensors are always checked: their host copy predates the write.
  explicit SacCache(std::shared_ptr<const OpPolicyTable> table = nullptr,
                    SwapEngine* engine = nullptr, bool allow_mutation = false);
  ~SacCache();
  SacCache(const SacCache&) = delete;
  SacCache& operator=(const SacCache&) = delete;

  const std::shared_ptr<const OpPolicyTable>& table() const { return table_; }
  // The table's policy for `op_key`. Throws c10::Error when the cache has no table.
  CheckpointPolicy table_policy(int64_t op_key) const;

  // --- forward (caching mode) ---------------------------------------------------------
  // Records the next call of `op_key` with `policy`; returns its call index.
  //  * MUST_SAVE / PREFER_SAVE: keeps aliases of the tensors in `outputs`;
  //  * MUST_SWAP: packs each tensor into `group` (SwapEngine::pack, kSwapAll); a tensor the
  //    engine does not swap (ineligible, excluded, or no group) is kept as saved;
  //  * MUST_RECOMPUTE / PREFER_RECOMPUTE: records the marker only (`outputs` unused).
  // Cached tensors are reported to the active SavedBytesMeter (they are saved activations).
  // `rng`: for a random op, what it did to its generator (RngStep::after() already called);
  // kept only when the outputs are cached and the op moved the generator, and replayed by
  // replay() when it hands those outputs back.
  // `inputs`: input_signature() of the call's arguments (0: not checked), compared with the
  // recompute's by replay() for a cached entry.
  int64_t record(int64_t op_key, CheckpointPolicy policy, const std::vector<c10::IValue>& outputs,
                 OutputKind kind, const std::shared_ptr<SwapGroup>& group,
                 std::optional<RngStep> rng = std::nullopt, uint64_t inputs = 0);

  // A hash of the dtypes and shapes of the tensors among an op call's arguments (tensor
  // lists and lists of optional tensors included, in order; other arguments ignored, so the
  // C++ stack with its defaults and Python's args and kwargs give the same value). Never 0.
  static uint64_t input_signature(c10::ArrayRef<c10::IValue> args);
  // The same hash, accumulated one tensor at a time (start from kSignatureSeed).
  static uint64_t mix_signature(uint64_t h, const at::Tensor& t);
  static constexpr uint64_t kSignatureSeed = 0x9e3779b97f4a7c15ULL;

  struct Demoted {
    int64_t op_key;
    int64_t call;
    CheckpointPolicy policy;  // what the policy asked for
  };
  // The region's forward is over: every cached entry with a tensor modified in place since
  // it was cached becomes "recompute" and releases its tensors. Returns those entries.
  // Call it before the region's swap group is released.
  std::vector<Demoted> end_forward();

  // --- writes through another version counter -------------------------------------------
  // A tensor can share a cached output's storage without sharing its version counter:
  // torch.matmul returns aten::mm's (3-D @ 2-D) and aten::bmm's (4-D @ 4-D) output through
  // aten::_unsafe_view, a new tensor with a counter of its own, so `h = x @ w; h += 1`
  // (T5's `scores += position_bias`) writes the cached mm output and its version stays.
  // The region's forward calls these for every op it intercepts (docs/design.md,
  // "Selective checkpoint"):
  //   before_write(t): an op is about to write `t` (an argument its schema marks written);
  //     an entry caching an output whose storage `t` shares is demoted by end_forward().
  //   watch(outputs): an op returned `outputs`; each one sharing a cached output's storage
  //     is watched (its version counter and version), so that a write through it after
  //     the forward is a write to the cached output for replay() (and one within it for
  //     end_forward()).
  // Both are no-ops once end_forward() ran, and cost a hash lookup per tensor while some
  // output is cached.
  void before_write(const at::Tensor& t);
  void watch(c10::ArrayRef<c10::IValue> outputs);

  // --- recompute (cached mode) ----------------------------------------------------------
  // Starts a recompute pass: call indices restart at 0.
  void begin_recompute();

  struct Replay {
    bool recompute = true;  // true: run the op; false: `outputs` are the cached values
    OutputKind kind = OutputKind::kSingle;
    std::vector<c10::IValue> outputs;  // fresh aliases (no autograd history)
  };
  // The next call of `op_key` in this pass. `retain`: keep the entry for another backward
  // (retain_graph=True); otherwise it is released after this replay. Cached outputs of a
  // random op that moved its generator in forward move it again (RngStep::replay).
  // Throws c10::Error ("hyper_parallel: ...") when forward did not run this call of an op
  // it cached some call of (the recomputed op sequence differs), when the entry was released by an earlier backward,
  // when its inputs' dtypes or shapes differ from the forward call's (`inputs`), or when a
  // cached tensor was modified in place after it was cached.
  // `inputs`: gives the recompute call's input_signature() (empty, or 0: not checked);
  // called only when the entry is cached, so a call that runs again pays nothing. A cached
  // entry whose forward call had other input dtypes or shapes raises: the recompute runs
  // another sequence of ops than the forward did, and the cached outputs belong to another
  // call.
  Replay replay(int64_t op_key, bool retain, c10::function_ref<uint64_t()> inputs = {});
  // Whether the next replay(op_key) of this pass would hand back cached outputs (or raise
  // for a released entry) rather than say "run it".
  bool next_is_cached(int64_t op_key) const;

  // --- introspection (tests, debugging) -------------------------------------------------
  SacCacheStats stats() const;
  // Fresh aliases of the live cached tensors: swapped ones (`swapped`) or saved ones.
  // Holding them keeps their storages referenced; drop them before the engine frees.
  std::vector<at::Tensor> cached_tensors(bool swapped) const;
  // Releases every entry (the cache stays usable; later replays raise).
  void clear();

 private:
  struct Slot {
    c10::IValue value;                    // saved tensor alias, or a non-tensor value
    std::shared_ptr<SavedHandle> handle;  // swapped tensor
    uint32_t version = 0;                 // saved tensor: version when cached
    Slot() = default;
    Slot(Slot&&) noexcept = default;
    Slot& operator=(Slot&&) noexcept = default;
    // Names a cached tensor's storage to the active meter, which counted it at record():
    // it may die now (SavedBytesMeter.h); the meter had counted it until its next full
    // recount (a fuzzer, session 26: a user's saved_activation_memory() read 488 016 B
    // where the planner's sampled measurement read 479 304 B, the plan over its budget).
    ~Slot();
  };
  enum class State : uint8_t { kRecompute, kCached, kDropped };
  struct Watch {
    c10::VariableVersion counter;  // of a tensor sharing a cached output's storage
    uint32_t version = 0;          // its version when watched
  };
  struct Entry {
    State state = State::kRecompute;
    CheckpointPolicy policy = CheckpointPolicy::PREFER_RECOMPUTE;
    OutputKind kind = OutputKind::kSingle;
    std::vector<Slot> slots;
    std::optional<RngStep> rng;  // a random op's generator step (cached entries only)
    bool written = false;        // before_write() hit one of its storages in forward
    uint64_t inputs = 0;         // input_signature() of the forward call (0: unknown)
    std::vector<Watch> watches;  // aliases through other version counters (watch())
  };

  SwapEngine& engine() const;
  // Whether a watched alias of `e` was written since it was watched (mu_ held).
  static bool watched_write(const Entry& e);
  // The cached entries (op key, call) holding each storage, while the forward runs.
  template <class F>
  void for_entries_of(const at::Tensor& t, F&& f);

  mutable std::mutex mu_;
  std::shared_ptr<const OpPolicyTable> table_;
  SwapEngine* engine_;
  bool allow_mutation_;
  // entries_[op_key][call index], as recorded by forward. op keys are small and dense.
  std::vector<std::vector<Entry>> entries_;
  // cached_calls_[op_key]: forward calls of the op whose outputs were cached and not
  // demoted by end_forward(); 0 means recompute may call the op freely.
  std::vector<int64_t> cached_calls_;
  // replay_calls_[op_key]: calls replayed in the current recompute pass.
  std::vector<int64_t> replay_calls_;
  // storages_[storage]: the cached entries (op key, call index) with an output in it;
  // filled by record(), emptied by end_forward() (forward_over_).
  std::unordered_map<const c10::StorageImpl*, std::vector<std::pair<int64_t, int64_t>>> storages_;
  bool forward_over_ = false;
  // !storages_.empty(), readable without mu_: before_write() and watch() run for every op
  // of the forward, and most regions' ops come before anything is cached, or cache nothing.
  std::atomic<bool> watching_{false};
  int64_t replays_ = 0;
};

}  // namespace hyper_parallel::activation
