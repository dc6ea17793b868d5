#include "hyper_parallel/planner/CostModel.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>

namespace hyper_parallel::planner {

namespace {

bool good_seconds(double s) { return std::isfinite(s) && s >= 0.0; }

}  // namespace

void StepProfile::validate() const {
  HP_CHECK_VALUE(!options.empty() && options.size() <= 64,
                 "a planner profile needs 1 to 64 options (strategies), got ", options.size());
  HP_CHECK_VALUE(!layers.empty(), "a planner profile needs at least one layer");
  for (size_t k = 0; k < layers.size(); ++k) {
    HP_CHECK_VALUE(layers[k].size() == options.size(), "layer ", k, " of the profile has ",
                   layers[k].size(), " option costs; expected one per option (",
                   options.size(), ")");
    for (size_t o = 0; o < options.size(); ++o) {
      const OptionCost& c = layers[k][o];
      HP_CHECK_VALUE(c.kept_bytes >= 0 && c.offload_bytes >= 0 && c.deferred_bytes >= 0 &&
                     c.shared_bytes >= 0 && c.held_bytes >= 0 && c.input_bytes >= 0 &&
                     c.output_bytes >= 0, "layer ", k, " option '",
                     options[o], "' has negative bytes");
      HP_CHECK_VALUE(good_seconds(c.forward_seconds) && good_seconds(c.backward_seconds),
                     "layer ", k, " option '", options[o],
                     "' has a negative or non-finite time");
    }
  }
  HP_CHECK_VALUE(base_bytes >= 0 && tail_bytes >= 0 && tail_held_bytes >= 0,
                 "profile base/tail bytes must be >= 0");
  // Every sum of bytes the cost model and the planner form is at most this total (per
  // layer its largest option's bytes of every kind): keeping it <= 2^60 keeps them all,
  // and the planner's sort keys, far from int64 overflow.
  long double total = static_cast<long double>(base_bytes) + tail_bytes + tail_held_bytes;
  for (const auto& layer : layers) {
    long double most = 0;
    for (const OptionCost& c : layer) {
      most = std::max(most, static_cast<long double>(c.kept_bytes) + c.offload_bytes +
                                c.deferred_bytes + c.shared_bytes + c.held_bytes +
                                c.input_bytes + c.output_bytes);
    }
    total += most;
  }
  HP_CHECK_VALUE(total <= static_cast<long double>(kMaxProfileBytes),
                 "the profile's bytes add up to ", static_cast<double>(total),
                 ", more than 2^60 (the planner's sums would overflow): byte counts are "
                 "bytes, not bits or elements; check how the profile was built");
  HP_CHECK_VALUE(prefetch_depth >= 0, "profile prefetch depth must be >= 0, got ",
                 prefetch_depth);
  HP_CHECK_VALUE(offload_window >= 0, "profile offload window must be >= 0, got ",
                 offload_window);
  HP_CHECK_VALUE(good_seconds(outside_seconds) && good_seconds(tail_seconds),
                 "profile outside/tail seconds must be finite and >= 0");
  for (const CopyLink* link : {&d2h, &h2d}) {
    HP_CHECK_VALUE(good_seconds(link->latency_seconds) && good_seconds(link->seconds_per_byte),
                   "copy link latency and seconds_per_byte must be finite and >= 0");
  }
}

int64_t boundary_charge(const StepProfile& p, size_t layer, int option, int previous) {
  const int64_t in = p.layers[layer][static_cast<size_t>(option)].input_bytes;
  if (in == 0 || layer == 0 || previous < 0) return in;
  return std::max<int64_t>(0, in - p.layers[layer - 1][static_cast<size_t>(previous)].output_bytes);
}

StepProfile with_least_boundary_charges(StepProfile p) {
  int64_t most_out = 0;  // of the layer before
  for (auto& layer : p.layers) {
    int64_t next_most = 0;
    for (OptionCost& c : layer) {
      next_most = std::max(next_most, c.output_bytes);
      const int64_t least = std::max<int64_t>(0, c.input_bytes - most_out);
      c.kept_bytes += least;
      c.input_bytes -= least;  // = min(input_bytes, most_out)
    }
    most_out = next_most;
  }
  return p;
}

OptionCost StepProfile::effective(size_t layer, size_t option) const {
  OptionCost c = layers[layer][option];
  if (layer + 1 == layers.size()) {
    c.kept_bytes += c.offload_bytes + c.deferred_bytes;
    c.offload_bytes = 0;
    c.deferred_bytes = 0;
  }
  return c;
}

Prediction evaluate(const StepProfile& p, const std::vector<int>& assignment) {
  const size_t n = p.num_layers();
  HP_CHECK_VALUE(assignment.size() == n, "the assignment has ", assignment.size(),
                 " entries for ", n, " layers");
  HP_CHECK_VALUE(p.num_options() <= 64, "a planner profile needs 1 to 64 options (strategies), "
                 "got ", p.num_options());
  std::vector<OptionCost> c(n);
  uint64_t seen = 0;  // bit o: option o is used by the prefix
  for (size_t k = 0; k < n; ++k) {
    HP_CHECK_VALUE(assignment[k] >= 0 && static_cast<size_t>(assignment[k]) < p.num_options(),
                   "assignment[", k, "] = ", assignment[k], " is not an option index (0..",
                   p.num_options() - 1, ")");
    c[k] = p.effective(k, static_cast<size_t>(assignment[k]));
    // The shared charge (CostModel.h): the first layer of an option new to the prefix.
    const uint64_t bit = uint64_t{1} << assignment[k];
    if (k > 0 && (seen & bit) == 0) c[k].kept_bytes += c[k].shared_bytes;
    seen |= bit;
    // The boundary charge (CostModel.h): the part of its input's storage it saves that the
    // previous layer's option does not.
    c[k].kept_bytes += boundary_charge(p, k, assignment[k], k > 0 ? assignment[k - 1] : -1);
  }
  Prediction out;
  auto consider = [&](int64_t bytes, int layer, bool backward) {
    if (bytes > out.peak_bytes || out.peak_layer == -2) {
      out.peak_bytes = bytes;
      out.peak_layer = layer;
      out.peak_in_backward = backward;
    }
  };
  out.peak_layer = -2;  // nothing considered yet

  // Forward, event by event: release points, the offload window, deferred bytes, the FIFO
  // D2H stream. sent[i]: bytes of Li that left the device (reloaded before its backward).
  HP_CHECK_VALUE(p.offload_window >= 0, "profile offload window must be >= 0, got ",
                 p.offload_window);
  const size_t w = static_cast<size_t>(p.offload_window);
  double t = 0.0;
  double d2h_free = 0.0;
  std::vector<double> d2h_done(n, 0.0);
  std::vector<int64_t> sent(n, 0);
  std::deque<size_t> waiting;      // released, offload not submitted yet (oldest first)
  std::vector<size_t> deferred;    // deferred bytes not offloaded yet (oldest first)
  std::deque<double> in_flight;    // completion times of submitted copies, in order
  int64_t resident = 0;            // bytes of the layers whose forward ended, on the device
  bool chained = false;            // some layer swaps: every layer has a release point
  for (size_t k = 0; k < n; ++k) {
    chained = chained || p.layers[k][static_cast<size_t>(assignment[k])].group_bytes() > 0;
  }
  double busy = 0.0;
  // `windowed`: a submission the offload window counts (a deferred retry is not one).
  auto copy = [&](size_t i, int64_t bytes, bool windowed) {
    if (bytes <= 0) return;
    d2h_done[i] = std::max(t, d2h_free) + p.d2h.seconds(bytes);
    d2h_free = d2h_done[i];
    if (windowed) in_flight.push_back(d2h_done[i]);
    sent[i] += bytes;
    resident -= bytes;
    out.offload_bytes += bytes;
  };
  for (size_t k = 0; k < n; ++k) {
    t += c[k].forward_seconds;
    busy += c[k].forward_seconds + c[k].backward_seconds;
    consider(p.base_bytes + resident + c[k].saved_bytes(), static_cast<int>(k), false);
    resident += c[k].saved_bytes();
    // A release point (every layer of a plan that swaps: CostModel.h).
    if (!chained) continue;
    if (c[k].offload_bytes > 0 || c[k].deferred_bytes > 0) waiting.push_back(k);
    const bool near_turn = k + 2 >= n;
    const bool hold = w > 0 && near_turn && !waiting.empty() && waiting.front() != k;
    while (!hold && !waiting.empty()) {
      while (!in_flight.empty() && in_flight.front() <= t) in_flight.pop_front();
      if (w > 0 && in_flight.size() >= w) break;
      const size_t i = waiting.front();
      waiting.pop_front();
      // Submitted at its own release point, a layer's deferred bytes are still held by
      // the caller; submitted later, they go with the rest.
      copy(i, c[i].offload_bytes + (i < k ? c[i].deferred_bytes : 0), true);
      if (i == k && c[k].deferred_bytes > 0) deferred.push_back(k);
    }
    // Deferred bytes of earlier layers leave now, whatever the window, and do not count
    // in it (SwapEngine::retry_deferred_locked).
    std::vector<size_t> still;
    for (size_t i : deferred) {
      if (i < k) copy(i, c[i].deferred_bytes, false);
      else still.push_back(i);
    }
    deferred.swap(still);
  }
  // Offloads still waiting at the turn never happen: those bytes stay (and reload nothing).
  waiting.clear();
  deferred.clear();
  consider(p.base_bytes + resident + p.tail_bytes, -1, false);
  // Reloads issued at the start of Lk's backward and still held: Lk-d .. Lk.
  const size_t depth = static_cast<size_t>(p.prefetch_depth);
  int64_t below = resident;  // bytes of L0..Lk on the device (not sent)
  int64_t window = 0;        // sent bytes of Lk-d .. Lk
  int64_t after = p.tail_held_bytes;  // held by the caller past their backward: Lk+1 .. tail
  for (size_t k = n; k-- > 0;) {
    if (k + 1 == n) {
      for (size_t i = k + 1 > depth ? k - depth : 0; i <= k; ++i) window += sent[i];
    } else {
      window -= sent[k + 1];
      if (k >= depth) window += sent[k - depth];
    }
    consider(p.base_bytes + below + window + after, static_cast<int>(k), true);
    // Lk's backward frees what it kept, except what the caller holds (never sent).
    const int64_t held = std::min(c[k].held_bytes, c[k].saved_bytes() - sent[k]);
    below -= c[k].saved_bytes() - sent[k];
    after += held;
  }
  out.host_peak_bytes = out.offload_bytes;
  t += p.tail_seconds;
  // Backward: at trig (Lk's output gradient arrives) reloads Lk .. Lk-d not issued yet
  // go on the FIFO H2D stream, nearest first; Lk computes once its reload is done.
  double h2d_free = 0.0;
  double trig = t;
  std::vector<double> h2d_done(n, 0.0);
  size_t issued = n;  // layers >= issued have had their reload issued
  for (size_t k = n; k-- > 0;) {
    const size_t lowest = k >= depth ? k - depth : 0;
    for (; issued > lowest;) {
      const size_t i = --issued;
      if (sent[i] == 0) continue;
      const double start = std::max({trig, d2h_done[i], h2d_free});
      h2d_free = start + p.h2d.seconds(sent[i]);
      h2d_done[i] = h2d_free;
    }
    const double begin = sent[k] > 0 ? std::max(trig, h2d_done[k]) : trig;
    trig = begin + c[k].backward_seconds;
  }
  const double begin = trig;
  out.step_seconds = begin + p.outside_seconds;
  out.stall_seconds = std::max(0.0, out.step_seconds - busy - p.tail_seconds - p.outside_seconds);
  return out;
}

}  // namespace hyper_parallel::planner
