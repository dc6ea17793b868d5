#include "hyper_parallel/activation/Schedule.h"

#include "hyper_parallel/common/Macros.h"

namespace hyper_parallel::activation {

void Schedule::link(int64_t prev, int64_t next) {
  HP_CHECK_VALUE(prev >= 0 && next >= 0, "set_forward_prefetch_layer got an unregistered layer id");
  HP_CHECK_VALUE(prev != next, "set_forward_prefetch_layer(a, b) needs two different layers; "
                 "got the same layer twice");
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
  for (auto it = latest_.begin(); it != latest_.end();) {
    it = it->first.layer == layer ? latest_.erase(it) : std::next(it);
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
    if (auto it2 = latest_.find(Key{it->second, thread}); it2 != latest_.end()) {
      auto pred = it2->second.lock();
      if (pred && !pred->aborted && pred->next.expired()) {
        group->prev = pred;
        pred->next = group;
      }
    }
  }
  latest_[Key{layer, thread}] = group;
}

void Schedule::on_abort(const std::shared_ptr<SwapGroup>& group) {
  group->aborted = true;
  if (auto pred = group->prev.lock()) {
    if (pred->next.lock() == group) pred->next.reset();
  }
  group->prev.reset();
  if (group->layer() >= 0) {
    auto it = latest_.find(Key{group->layer(), std::this_thread::get_id()});
    if (it != latest_.end() && it->second.lock() == group) latest_.erase(it);
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
  out.push_back(group);
  auto cur = group;
  for (int i = 0; i < depth; ++i) {
    cur = cur->prev.lock();
    if (!cur) break;
    out.push_back(cur);
  }
  return out;
}

void Schedule::clear() {
  next_of_.clear();
  prev_of_.clear();
  latest_.clear();
}

}  // namespace hyper_parallel::activation
