#include "hyper_parallel/planner/CostModel.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <cmath>
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
      HP_CHECK_VALUE(c.kept_bytes >= 0 && c.offload_bytes >= 0, "layer ", k, " option '",
                     options[o], "' has negative bytes");
      HP_CHECK_VALUE(good_seconds(c.forward_seconds) && good_seconds(c.backward_seconds),
                     "layer ", k, " option '", options[o],
                     "' has a negative or non-finite time");
    }
  }
  HP_CHECK_VALUE(base_bytes >= 0 && tail_bytes >= 0, "profile base/tail bytes must be >= 0");
  HP_CHECK_VALUE(good_seconds(outside_seconds) && good_seconds(tail_seconds),
                 "profile outside/tail seconds must be finite and >= 0");
  for (const CopyLink* link : {&d2h, &h2d}) {
    HP_CHECK_VALUE(good_seconds(link->latency_seconds) && good_seconds(link->seconds_per_byte),
                   "copy link latency and seconds_per_byte must be finite and >= 0");
  }
}

OptionCost StepProfile::effective(size_t layer, size_t option) const {
  OptionCost c = layers[layer][option];
  if (layer + 1 == layers.size()) {
    c.kept_bytes += c.offload_bytes;
    c.offload_bytes = 0;
  }
  return c;
}

Prediction evaluate(const StepProfile& p, const std::vector<int>& assignment) {
  const size_t n = p.num_layers();
  HP_CHECK_VALUE(assignment.size() == n, "the assignment has ", assignment.size(),
                 " entries for ", n, " layers");
  std::vector<OptionCost> c(n);
  for (size_t k = 0; k < n; ++k) {
    HP_CHECK_VALUE(assignment[k] >= 0 && static_cast<size_t>(assignment[k]) < p.num_options(),
                   "assignment[", k, "] = ", assignment[k], " is not an option index (0..",
                   p.num_options() - 1, ")");
    c[k] = p.effective(k, static_cast<size_t>(assignment[k]));
  }
  Prediction out;
  // Memory: the sample points of the header comment.
  int64_t kept = 0;
  auto consider = [&](int64_t bytes, int layer, bool backward) {
    if (bytes > out.peak_bytes || out.peak_layer == -2) {
      out.peak_bytes = bytes;
      out.peak_layer = layer;
      out.peak_in_backward = backward;
    }
  };
  out.peak_layer = -2;  // nothing considered yet
  for (size_t k = 0; k < n; ++k) {
    consider(p.base_bytes + kept + c[k].kept_bytes + c[k].offload_bytes, static_cast<int>(k),
             false);
    kept += c[k].kept_bytes;
    out.offload_bytes += c[k].offload_bytes;
  }
  consider(p.base_bytes + kept + p.tail_bytes, -1, false);
  int64_t below = kept;  // kept bytes of L0..Lk
  for (size_t k = n; k-- > 0;) {
    const int64_t prefetched = k > 0 ? c[k - 1].offload_bytes : 0;
    consider(p.base_bytes + below + c[k].offload_bytes + prefetched, static_cast<int>(k), true);
    below -= c[k].kept_bytes;
  }
  out.host_peak_bytes = out.offload_bytes;

  // Time: forward with the FIFO D2H stream, then the backward recursion.
  double t = 0.0;
  double d2h_free = 0.0;
  std::vector<double> d2h_done(n, 0.0);
  double busy = 0.0;
  for (size_t k = 0; k < n; ++k) {
    t += c[k].forward_seconds;
    if (c[k].offload_bytes > 0) {
      d2h_done[k] = std::max(t, d2h_free) + p.d2h.seconds(c[k].offload_bytes);
      d2h_free = d2h_done[k];
    }
    busy += c[k].forward_seconds + c[k].backward_seconds;
  }
  t += p.tail_seconds;
  double h2d_free = 0.0;
  double begin = t;  // start of Lk's backward
  for (size_t k = n; k-- > 0;) {
    double next = begin + c[k].backward_seconds;
    if (k > 0 && c[k - 1].offload_bytes > 0) {
      const double start = std::max({begin, d2h_done[k - 1], h2d_free});
      h2d_free = start + p.h2d.seconds(c[k - 1].offload_bytes);
      next = std::max(next, h2d_free);
    }
    begin = next;
  }
  out.step_seconds = begin + p.outside_seconds;
  out.stall_seconds = std::max(0.0, out.step_seconds - busy - p.tail_seconds - p.outside_seconds);
  return out;
}

}  // namespace hyper_parallel::planner
