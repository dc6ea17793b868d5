#pragma once
// Schedule: the layer graph declared with set_forward_prefetch_layer(a, b) ("b runs
// after a in forward") and the links between layer invocations (SPEC 3).
//
// Pure bookkeeping, no tensors: testable on its own.
//  * A layer with a successor is released at the end of its forward (its activations may
//    leave the device); a layer with a predecessor but no successor is the last layer and
//    keeps its activations on device; a layer in no chain is "unscheduled".
//  * Invocation j of layer k links to the oldest invocation of k's predecessor that has
//    not been linked yet, on the same thread (L0a L0b L1a L1b links L1a-L0a, L1b-L0b), so micro-batches and repeated calls each get
//    their own chain, and two threads running forwards of different micro-batches do not
//    cross-link.
//  * A link that would close a cycle is refused; an invocation that begins while an
//    invocation of a layer after it in the chain, which found no predecessor invocation
//    and whose predecessor layer had not run, is alive on its thread (the forward runs
//    against the chain) is flagged `order_reversed`, for a warning.
//  * prefetch_targets(g, depth): the invocations whose reload starts when the backward
//    of g begins: g itself (if a hole left it offloaded) and up to `depth` predecessors.
//
// Thread-safety: guarded by the SwapEngine lock.

#include "hyper_parallel/activation/SwapGroup.h"

#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hyper_parallel::activation {

class Schedule {
 public:
  int64_t new_layer() { return next_layer_id_++; }
  // Declares that `next` runs after `prev` in forward. Replaces earlier links of either.
  // Throws c10::ValueError when the link would close a cycle (prev is reachable from next).
  void link(int64_t prev, int64_t next);
  // Forgets `layer` and its links.
  void remove_layer(int64_t layer);
  bool has_successor(int64_t layer) const { return layer >= 0 && next_of_.count(layer) != 0; }
  bool has_predecessor(int64_t layer) const { return layer >= 0 && prev_of_.count(layer) != 0; }
  bool scheduled(int64_t layer) const { return has_successor(layer) || has_predecessor(layer); }
  int64_t successor(int64_t layer) const;
  int64_t predecessor(int64_t layer) const;
  // Whether `layer` is one of the last two layers of a chain (the last layer, or the one
  // whose successor is the last): its release point is the last before the turn.
  bool near_end(int64_t layer) const {
    return has_predecessor(layer) &&
           (!has_successor(layer) || !has_successor(successor(layer)));
  }

  // Records a new invocation of group->layer() and links it to its predecessor's.
  void on_begin(const std::shared_ptr<SwapGroup>& group);
  // Unlinks an invocation whose forward raised.
  void on_abort(const std::shared_ptr<SwapGroup>& group);
  // Whether the invocation should release its records at the end of its forward.
  bool releases_at_forward_end(const SwapGroup& group) const;
  std::vector<std::shared_ptr<SwapGroup>> prefetch_targets(const std::shared_ptr<SwapGroup>& group,
                                                            int depth) const;
  void clear();
  // Layers with a link or with invocations waiting to be linked (bookkeeping size, tests).
  size_t layer_count() const;
  // Per-(layer, thread) queues held, empty ones included (bookkeeping size, tests).
  size_t queue_count() const { return unlinked_.size(); }

 private:
  int64_t next_layer_id_ = 0;
  std::unordered_map<int64_t, int64_t> next_of_;
  std::unordered_map<int64_t, int64_t> prev_of_;
  // (layer, thread) -> invocations not yet linked to a successor invocation, oldest first.
  struct Key {
    int64_t layer;
    std::thread::id thread;
    bool operator==(const Key& o) const { return layer == o.layer && thread == o.thread; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<int64_t>()(k.layer) * 31 + std::hash<std::thread::id>()(k.thread);
    }
  };
  // Emptied queues are kept for reuse; sweep_unlinked() drops those holding no live
  // invocation once the map outgrows sweep_at_ (threads and layers that are gone).
  std::unordered_map<Key, std::deque<std::weak_ptr<SwapGroup>>, KeyHash> unlinked_;
  static constexpr size_t kMinSweepAt = 256;
  size_t sweep_at_ = kMinSweepAt;
  void sweep_unlinked();
  // Per thread: the latest invocation of each chained layer, and the orphan invocations
  // (no predecessor invocation to link to) whose predecessor layer had not run: a layer
  // that begins while such an orphan of a layer after it in the chain is alive runs
  // against the chain (none in a forward that follows the chain, so nothing to scan
  // then). An orphan whose predecessor layer did run is a layer called again in the same
  // forward (weight sharing), not a misordering.
  struct ThreadState {
    std::unordered_map<int64_t, std::weak_ptr<SwapGroup>> latest;
    std::vector<std::weak_ptr<SwapGroup>> orphans;
  };
  std::unordered_map<std::thread::id, ThreadState> last_begun_;
  // Whether `later` is reached from `layer` by following successors.
  bool runs_after(int64_t layer, int64_t later) const;
};

}  // namespace hyper_parallel::activation
