#include "hyper_parallel/activation/Schedule.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <unordered_set>

namespace hyper_parallel::activation {

void Schedule::link(int64_t prev, int64_t next) {
  HP_CHECK_VALUE(prev >= 0 && next >= 0, "set_forward_prefetch_layer got an unregistered layer id");
  HP_CHECK_VALUE(prev != next, "set_forward_prefetch_layer(a, b) needs two different layers; "
                 "got the same layer twice");
  for (int64_t at = next; at >= 0; at = successor(at)) {
    HP_CHECK_VALUE(at != prev, "set_forward_prefetch_layer(a, b) would close a cycle: a already "
                   "runs after b in the chain. The chain is the forward order of the layers; "
                   "link each layer to the one that runs next (layers[i], layers[i + 1]) only.");
  }
  // Replace earlier links so that each layer has at most one predecessor and successor.
  if (auto it = next_of_.find(prev); it != next_of_.end()) prev_of_.erase(it->second);
  if (auto it = prev_of_.find(next); it != prev_of_.end()) next_of_.erase(it->second);
  next_of_[prev] = next;
  prev_of_[next] = prev;
}

void Schedule::remove_layer(int64_t layer) {
  if (auto it = next_of_.find(layer); it != next_of_.end()) {
    prev_of_.erase(it->second);
    next_of_.erase(it);
  }
  if (auto it = prev_of_.find(layer); it != prev_of_.end()) {
    next_of_.erase(it->second);
    prev_of_.erase(it);
  }
  for (auto it = unlinked_.begin(); it != unlinked_.end();) {
    it = it->first.layer == layer ? unlinked_.erase(it) : std::next(it);
  }
}

int64_t Schedule::successor(int64_t layer) const {
  auto it = next_of_.find(layer);
  return it == next_of_.end() ? -1 : it->second;
}

int64_t Schedule::predecessor(int64_t layer) const {
  auto it = prev_of_.find(layer);
  return it == prev_of_.end() ? -1 : it->second;
}

void Schedule::on_begin(const std::shared_ptr<SwapGroup>& group) {
  const int64_t layer = group->layer();
  if (layer < 0) return;
  const auto thread = std::this_thread::get_id();
  if (auto it = prev_of_.find(layer); it != prev_of_.end()) {
    if (auto it2 = unlinked_.find(Key{it->second, thread}); it2 != unlinked_.end()) {
      auto& queue = it2->second;
      while (!queue.empty()) {
        auto pred = queue.front().lock();
        queue.pop_front();
        if (pred && !pred->aborted && pred->next.expired()) {
          group->prev = pred;
          pred->next = group;
          break;
        }
      }
      // An emptied queue stays in the map: the next invocation of the predecessor on this
      // thread reuses it (no map node or deque block per layer invocation). Queues of
      // layers or threads that are gone are swept below once the map has grown.
    }
  }
  if (has_predecessor(layer) && group->prev.expired()) group->orphan = true;
  if (scheduled(layer)) {
    auto& state = last_begun_[thread];
    // Against the chain: this layer begins while an orphan invocation of a layer after it
    // in the chain, whose predecessor layer had not run, is alive (that layer ran before
    // this one: a reversed link, or layers given out of order). An orphan alone says
    // nothing: the first layer run with grad (a frozen prefix run without grad, a pipeline
    // stage's suffix, every micro-batch of those) has no predecessor invocation either; it
    // is when a layer before it in the chain runs next that the order is shown wrong.
    bool misordered = false;
    if (group->orphan) {
      auto it = state.latest.find(predecessor(layer));
      misordered = it == state.latest.end() || it->second.expired();
    }
    bool against = false;
    auto& orphans = state.orphans;
    if (!orphans.empty()) {
      orphans.erase(std::remove_if(orphans.begin(), orphans.end(),
                                   [](const std::weak_ptr<SwapGroup>& w) { return w.expired(); }),
                    orphans.end());
      for (const auto& w : orphans) {
        auto o = w.lock();
        if (o && o->layer() != layer && runs_after(layer, o->layer())) against = true;
      }
    }
    group->order_reversed = against;
    if (misordered && orphans.size() < 64) orphans.push_back(group);
    state.latest[layer] = group;
  }
  if (unlinked_.size() > sweep_at_) sweep_unlinked();
  auto& mine = unlinked_[Key{layer, thread}];
  // Invocations of a layer without successor invocations (the last layer, a layer whose
  // backward already ran) die with their graphs; drop them so the queue stays short.
  if (mine.size() >= 8) {
    mine.erase(std::remove_if(mine.begin(), mine.end(),
                              [](const std::weak_ptr<SwapGroup>& w) { return w.expired(); }),
               mine.end());
  }
  mine.push_back(group);
}

void Schedule::on_abort(const std::shared_ptr<SwapGroup>& group) {
  group->aborted = true;
  if (auto pred = group->prev.lock()) {
    if (pred->next.lock() == group) {
      // The predecessor invocation may be linked again (a retried forward).
      pred->next.reset();
      unlinked_[Key{pred->layer(), std::this_thread::get_id()}].push_front(pred);
    }
  }
  group->prev.reset();
  if (group->layer() >= 0) {
    auto it = unlinked_.find(Key{group->layer(), std::this_thread::get_id()});
    if (it != unlinked_.end()) {
      auto& q = it->second;
      q.erase(std::remove_if(q.begin(), q.end(),
                             [&](const std::weak_ptr<SwapGroup>& w) { return w.lock() == group; }),
              q.end());
    }
  }
}

bool Schedule::releases_at_forward_end(const SwapGroup& group) const {
  if (group.manual()) return false;
  // The last layer of a chain keeps its activations: backward needs them first.
  if (has_predecessor(group.layer()) && !has_successor(group.layer())) return false;
  return true;
}

std::vector<std::shared_ptr<SwapGroup>> Schedule::prefetch_targets(
    const std::shared_ptr<SwapGroup>& group, int depth) const {
  std::vector<std::shared_ptr<SwapGroup>> out;
  out.reserve(static_cast<size_t>(std::max(depth, 0)) + 1);
  out.push_back(group);
  auto cur = group;
  for (int i = 0; i < depth; ++i) {
    cur = cur->prev.lock();
    if (!cur) break;
    out.push_back(cur);
  }
  return out;
}

bool Schedule::runs_after(int64_t layer, int64_t later) const {
  int64_t steps = 0;
  for (int64_t at = successor(layer); at >= 0; at = successor(at)) {
    if (at == later) return true;
    if (++steps > static_cast<int64_t>(next_of_.size())) break;  // (links never cycle)
  }
  return false;
}

void Schedule::sweep_unlinked() {
  for (auto it = unlinked_.begin(); it != unlinked_.end();) {
    const bool live = std::any_of(it->second.begin(), it->second.end(),
                                  [](const std::weak_ptr<SwapGroup>& w) { return !w.expired(); });
    it = live ? std::next(it) : unlinked_.erase(it);
  }
  sweep_at_ = std::max<size_t>(kMinSweepAt, 2 * unlinked_.size());
}

size_t Schedule::layer_count() const {
  std::unordered_set<int64_t> layers;
  for (const auto& kv : next_of_) layers.insert(kv.first);
  for (const auto& kv : prev_of_) layers.insert(kv.first);
  for (const auto& kv : unlinked_) {
    for (const auto& w : kv.second) {
      if (!w.expired()) {
        layers.insert(kv.first.layer);
        break;
      }
    }
  }
  return layers.size();
}

void Schedule::clear() {
  next_of_.clear();
  prev_of_.clear();
  unlinked_.clear();
  sweep_at_ = kMinSweepAt;
  last_begun_.clear();
}

}  // namespace hyper_parallel::activation
