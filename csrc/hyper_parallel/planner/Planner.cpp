#include "hyper_parallel/planner/Planner.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <iterator>
#include <limits>
#include <numeric>

namespace hyper_parallel::planner {

namespace {

// Phases of the search (see Planner.h).
enum Phase : int8_t {
  kNoOffload = 0,    // no layer offloaded yet
  kMoreToCome = 1,   // offloads happened; the last one is still ahead
  kLastChosen = 2,   // the previous layer is the last one that offloads
  kDraining = 3,     // after that layer's successor: the backlog drains
};

constexpr int64_t kNoSlack = std::numeric_limits<int64_t>::max() / 4;

struct Label {
  int64_t kept;    // kept bytes of the layers so far (rounded up to the quantum)
  int64_t host;    // offload bytes so far (rounded up to the quantum)
  double time;     // predicted seconds so far + kTrafficSecondsPerByte * offload bytes
  double backlog;  // D2H queue (kNoOffload..kLastChosen) or remaining wait (kDraining)
  uint64_t code;   // offload classes of the last `depth` layers, most recent lowest
  int32_t parent;  // index among the previous layer's labels
  int16_t option;
  int8_t phase;
  // Deferred bytes of the layer just decided: on the device until the next layer's release
  // point, so they read only in its forward sample point (kept + pending + its bytes).
  int64_t pending = 0;
  // Where options hold unlike held bytes (search()): the least room left at the backward
  // sample points of the layers so far for the held bytes of the layers after them; the
  // same constant (kNoSlack) in every label otherwise.
  int64_t slack = kNoSlack;
  // The options used so far that a later layer still charges for (shared charge,
  // CostModel.h): bit o set when some layer so far ran option o and a later layer's o has
  // shared bytes. Labels are compared only within one such set.
  uint64_t used = 0;
  // The bytes of its output's storage the layer just decided saves, as far as a next
  // layer's option would save them too (boundary charge, CostModel.h): the next layer is
  // charged its input_bytes less these. A label with more credit pays no more later.
  int64_t credit = 0;
};

struct Back {
  int32_t parent;
  int16_t option;
};

constexpr double kInf = std::numeric_limits<double>::infinity();

int64_t round_up(int64_t bytes, int64_t quantum) {
  return quantum <= 1 ? bytes : (bytes + quantum - 1) / quantum * quantum;
}

int64_t round_down(int64_t bytes, int64_t quantum) {
  return quantum <= 1 ? bytes : bytes / quantum * quantum;
}

// The bytes of option `c` (effective) that stay on the device past its backward because
// the caller holds them: evaluate() counts at most what the layer did not send, which at
// offload window 0 is its kept bytes (its offload and deferred bytes always leave).
int64_t held_of(const OptionCost& c) { return std::min(c.held_bytes, c.kept_bytes); }

// The relaxation's seconds of option `c` (relaxed_bound(), rest_bound(): no D2H backlog):
// its forward and backward, the traffic term plus `host_price` per offloaded byte, and at
// prefetch depth 0 its whole reload.
double relaxed_work(const StepProfile& p, const OptionCost& c, double host_price) {
  const int64_t off = c.group_bytes();
  return c.forward_seconds + c.backward_seconds +
         (kTrafficSecondsPerByte + host_price) * static_cast<double>(off) +
         (p.prefetch_depth == 0 ? p.h2d.seconds(off) : 0.0);
}

// At depth >= 1, the stall of the reload of the layer before (`prev_off` bytes) that the
// backward of `c` does not hide.
double reload_stall(const StepProfile& p, int64_t prev_off, const OptionCost& c) {
  return p.prefetch_depth != 0 && prev_off > 0
             ? std::max(0.0, p.h2d.seconds(prev_off) - c.backward_seconds)
             : 0.0;
}

// The optimizer's objective of a predicted plan: its step time plus the traffic tie-break.
double objective_of(const Prediction& e) {
  return e.step_seconds + kTrafficSecondsPerByte * static_cast<double>(e.offload_bytes);
}

// The backward relaxations (rest_bound(), add_linear_bound()) index kept bytes before a
// layer by bins of bin_bytes (rounded down); option `c` of layer k fits the sample points
// of search() that involve it (the end of its forward, the start of its backward with the
// previous layer's `prev_off` bytes reloaded and `after` held bytes, and for the last
// layer the end of the forward) exactly in the bins i < the count returned (at most
// `bins`). The first point is implied by the second (prev_off, after >= 0).
size_t fitting_bins(const StepProfile& p, const OptionCost& c, int64_t prev_off, int64_t after,
                    bool last, int64_t budget, int64_t bin_bytes, size_t bins) {
  int64_t room = budget - p.base_bytes - c.kept_bytes - c.group_bytes() - prev_off - after;
  if (last) room = std::min(room, budget - p.base_bytes - c.kept_bytes - p.tail_bytes);
  if (room < 0) return 0;
  return std::min(bins, static_cast<size_t>(room / bin_bytes) + 1);
}

// Bins of kept bytes for rest_bound(): `budget / bins`, unless every kept figure the
// search adds is a multiple of a larger common quantum whose bins are not many more (at
// most 2 x `bins`): bins of that quantum lose nothing to rounding (the kept bytes of each
// layer, rounded down at every layer, add up to as much as a bin per layer of slack). On
// PlannerTest's whole-MiB saturated 100-layer profiles (seeds 11-13, copies 1-3x a forward,
// budgets 25/40/60 %) 12 of 27 solves are proven optimal instead of 9, in 85 ms on average
// instead of 94.
int64_t relaxation_bin(const StepProfile& p, const std::vector<uint64_t>& allowed, int64_t budget,
                       int64_t bins) {
  const int64_t room = std::max<int64_t>(0, budget - p.base_bytes);
  const int64_t coarse = std::max<int64_t>(1, room / bins);
  int64_t g = 0;
  for (size_t k = 0; k < p.num_layers(); ++k) {
    for (size_t o = 0; o < p.num_options(); ++o) {
      if (allowed[k] >> o & 1) g = std::gcd(g, p.effective(k, o).kept_bytes);
    }
  }
  if (g <= 0 || g >= coarse) return std::max(g, coarse);
  return room / g + 1 <= 2 * bins ? g : coarse;
}

// Sorts labels by (phase, code when `by_code`, kept, time, backlog, host, then their order
// of creation), the order prune() sweeps. Without codes the first two fit one 64-bit key
// (phase in the top bits; kept bytes stay below 2^61: a profile adds up to at most 2^60
// bytes, StepProfile::validate(), and the byte quantum is at most 2^60), so the sort moves
// 16-byte keys instead of labels and gathers once (a third of a 100-layer solve's time
// went to sorting the labels themselves).
void sort_labels(std::vector<Label>& labels, bool by_code) {
  if (by_code) {
    std::stable_sort(labels.begin(), labels.end(), [](const Label& a, const Label& b) {
      if (a.phase != b.phase) return a.phase < b.phase;
      if (a.code != b.code) return a.code < b.code;
      if (a.kept != b.kept) return a.kept < b.kept;
      if (a.time != b.time) return a.time < b.time;
      if (a.backlog != b.backlog) return a.backlog < b.backlog;
      return a.host < b.host;
    });
    return;
  }
  struct Key {
    uint64_t order;  // phase << 61 | kept
    double time;
    uint32_t index;
  };
  std::vector<Key> keys(labels.size());
  for (size_t i = 0; i < labels.size(); ++i) {
    const Label& l = labels[i];
    keys[i] = Key{static_cast<uint64_t>(l.phase) << 61 | static_cast<uint64_t>(l.kept), l.time,
                  static_cast<uint32_t>(i)};
  }
  std::sort(keys.begin(), keys.end(), [&labels](const Key& a, const Key& b) {
    if (a.order != b.order) return a.order < b.order;
    if (a.time != b.time) return a.time < b.time;
    const Label& x = labels[a.index];
    const Label& y = labels[b.index];
    if (x.backlog != y.backlog) return x.backlog < y.backlog;
    if (x.host != y.host) return x.host < y.host;
    return a.index < b.index;
  });
  std::vector<Label> sorted(labels.size());
  for (size_t i = 0; i < keys.size(); ++i) sorted[i] = labels[keys[i].index];
  labels.swap(sorted);
}

// Keeps the labels no other label of their (phase, code) dominates (Planner.h), in place.
// `linear`: a backlog at least this large passes through every later max(0, .) of the
// model, so two such labels compare by time + backlog alone (exact).
// `per_kept` > 0: at most that many labels (the fastest) per (phase, code, kept bytes).
// `code_bytes` (depth 1 only; else null): the offload bytes of each class of the layer
// just decided; labels of different codes are then compared too, the one with fewer
// offload bytes in its last layer being no worse in that respect (every later term that
// reads the code, the backward sample point and the reload stall of the next layer, is
// non-decreasing in those bytes).
// `used` sets (Label::used): a label whose set holds another's can dominate it (its later
// layers pay no charge the other's do not, so they keep no more bytes); one whose set does
// not cannot. Likewise a label of less credit (Label::credit) cannot dominate one of more:
// groups are (used set, credit) pairs, ordered by both.
void prune(std::vector<Label>& labels, double eps, double linear, int per_kept,
           const std::vector<int64_t>* code_bytes, int64_t& visited) {
  const bool by_code = code_bytes == nullptr;
  sort_labels(labels, by_code);
  struct Front {
    int64_t kept, host, held;  // held: kept + pending (the next forward sample point's)
    int64_t pending;           // its deferred copy joins the next release point's queue
    int64_t slack;             // Label::slack
    double time, backlog;
    int16_t option;
  };
  // One front per group, a (used set, offload class of the last layer) pair (one class in
  // all when by_code): a label is judged only against the groups whose set holds its own
  // and whose class has no more offload bytes (`below`), and may remove entries only of
  // the groups whose set its own holds and whose class has no fewer (`above`). A label
  // that survives is usually faster than every entry of those groups, which each group's
  // bounds see without a scan; one shared front scanned every entry of the classes that
  // cannot dominate it (80 % of a 100-layer solve's time). Labels of unlike sets were not
  // compared at all before: on a decoder profile, where every strategy charges for the
  // mask and rotary tables, 18-23 sets split the fronts of a 128-layer solve.
  const size_t classes = by_code ? 1 : code_bytes->size();
  // The distinct values of a label field, ascending.
  auto distinct = [&labels](auto field) {
    std::vector<decltype(field(labels.front()))> out;
    out.reserve(16);
    for (const Label& l : labels) out.push_back(field(l));
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  };
  using SetKey = std::pair<uint64_t, int64_t>;  // (used set, credit)
  const std::vector<SetKey> sets =
      distinct([](const Label& l) { return SetKey{l.used, l.credit}; });
  auto set_of = [&](const Label& l) {
    const SetKey key{l.used, l.credit};
    return static_cast<size_t>(std::lower_bound(sets.begin(), sets.end(), key) - sets.begin());
  };
  // Whether key a "holds" key b: a label of a can dominate one of b.
  auto holds_key = [](const SetKey& a, const SetKey& b) {
    return (a.first & b.first) == b.first && a.second >= b.second;
  };
  const size_t groups = sets.size() * classes;
  std::vector<std::vector<Front>> fronts(groups);
  std::vector<std::vector<size_t>> below(groups), above(groups);
  for (size_t u = 0; u < sets.size(); ++u) {
    for (size_t c = 0; c < classes; ++c) {
      const size_t g = u * classes + c;
      for (size_t v = 0; v < sets.size(); ++v) {
        const bool holds = holds_key(sets[v], sets[u]);  // sets[v] holds sets[u]
        const bool held = holds_key(sets[u], sets[v]);   // sets[u] holds sets[v]
        for (size_t d = 0; d < classes; ++d) {
          if (holds && (by_code || (*code_bytes)[d] <= (*code_bytes)[c])) {
            below[g].push_back(v * classes + d);
          }
          if (held && (by_code || (*code_bytes)[d] >= (*code_bytes)[c])) {
            above[g].push_back(v * classes + d);
          }
        }
      }
    }
  }
  // Bounds over each front that spare most scans, the results unchanged (labels come in
  // kept order, so a new one usually holds more than every front entry and is faster
  // than all of them): when a front's least time (time + backlog for entries past
  // `linear`) is above what could dominate the label, no entry does; when the label holds
  // more than `most_held`, it dominates no entry. Entries leave the fronts without
  // updating them, so they are bounds: a scan they allow may find nothing. Entries enter
  // a front in kept order, and each holds at most `most_pending` more than it keeps, so
  // the entries l can dominate (f.held >= l's) lie in the suffix whose kept bytes are at
  // least l's held bytes less that: only that suffix is searched for them (the whole
  // front was, 47 million entries in a 100-layer solve, mostly to find none).
  std::vector<double> least_time(groups), least_time_backlog(groups);
  std::vector<int64_t> most_held(groups), most_pending(groups);
  // Simple entries (no backlog, no pending bytes, unconstrained slack) dominate a later
  // label by host bytes and time alone: they hold no more (kept order), and their extra
  // is known. They are kept apart, per group, as a staircase (host ascending, time
  // descending, each no slower than any of fewer host bytes), so one binary search judges
  // a label against all of them: the least time among those of no more host bytes. Under
  // a host budget the host bytes make a second dimension, and scanning every entry made
  // a 30-layer solve take minutes.
  struct Step {
    int64_t host;
    double time;
  };
  std::vector<std::vector<Step>> stairs(groups);
  // Entries without host bytes (every label, without a host budget) whose backlog is below
  // `linear` and slack unconstrained dominate a later label l of no fewer pending bytes
  // when f.time <= l.time and f.time + f.backlog <= l.time + l.backlog (the extra is
  // max(0, f.backlog - l.backlog)): per group and pending figure they are kept as a
  // staircase of (time ascending, time + backlog descending), so a binary search finds
  // the least time + backlog among those no slower than l. Scanned in the fronts, the
  // labels with a backlog of a saturated profile cost up to 10^4 visits each (2 us a
  // label; 1 s for the exact searches of a 100-layer solve).
  const std::vector<int64_t> pendings = distinct([](const Label& l) { return l.pending; });
  const size_t npend = pendings.size();
  struct Lane {
    double time, total;  // total: time + backlog
  };
  std::vector<std::vector<Lane>> lanes(groups * npend);
  auto reset = [&] {
    for (auto& lane : lanes) lane.clear();
    for (size_t g = 0; g < groups; ++g) {
      fronts[g].clear();
      stairs[g].clear();
      least_time[g] = least_time_backlog[g] = kInf;
      most_held[g] = std::numeric_limits<int64_t>::min();
      most_pending[g] = 0;
    }
  };
  size_t out = 0;
  int same_kept = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    const Label l = labels[i];
    const size_t grp = set_of(l) * classes + (by_code ? 0 : static_cast<size_t>(l.code));
    if (i == 0 || l.phase != labels[i - 1].phase || (by_code && l.code != labels[i - 1].code)) {
      reset();
      same_kept = 0;
    } else if (l.kept != labels[i - 1].kept) {
      same_kept = 0;
    }
    if (per_kept > 0 && same_kept >= per_kept) continue;
    const int64_t l_held = l.kept + l.pending;
    bool dominated = false;
    // A simple entry's extra: -l.backlog where both backlogs are past `linear`, else 0.
    const double stairs_reach =
        l.time + eps + (0.0 >= linear && l.backlog >= linear ? l.backlog : 0.0);
    const size_t pend = static_cast<size_t>(
        std::lower_bound(pendings.begin(), pendings.end(), l.pending) - pendings.begin());
    for (size_t d : below[grp]) {
      for (size_t pi = 0; pi <= pend && !dominated; ++pi) {
        const std::vector<Lane>& lane = lanes[d * npend + pi];
        auto it = std::upper_bound(lane.begin(), lane.end(), l.time + eps,
                                   [](double t, const Lane& x) { return t < x.time; });
        dominated = it != lane.begin() && std::prev(it)->total <= l.time + l.backlog + eps;
      }
      if (dominated) break;
      const std::vector<Step>& st = stairs[d];
      auto it = std::upper_bound(st.begin(), st.end(), l.host,
                                 [](int64_t h, const Step& x) { return h < x.host; });
      if (it != st.begin() && std::prev(it)->time <= stairs_reach) {
        dominated = true;
        break;
      }
      // The least f.time + extra over front d (extra >= 0 unless both backlogs are past
      // `linear`, where it is f.backlog - l.backlog).
      const double reach = l.backlog >= linear
                               ? std::min(least_time[d], least_time_backlog[d] - l.backlog)
                               : least_time[d];
      if (reach > l.time + eps) continue;
      // Newest entries first: they hold the most (kept order), so a dominator, which must
      // be about as fast as l, is most often among them.
      const std::vector<Front>& front = fronts[d];
      for (size_t j = front.size(); !dominated && j-- > 0;) {
        const Front& f = front[j];
        ++visited;
        const double extra = f.backlog >= linear && l.backlog >= linear
                                 ? f.backlog - l.backlog
                                 : std::max(0.0, f.backlog - l.backlog);
        dominated = f.host <= l.host && f.held <= l_held &&
                    f.pending <= l.pending && f.slack >= l.slack && f.time + extra <= l.time + eps;
      }
      if (dominated) break;
    }
    if (dominated) continue;
    // A front entry that l dominates is no longer needed to judge later labels (they
    // have at least l's kept bytes, and dominance is transitive).
    for (size_t d : above[grp]) {
      if (l_held > most_held[d]) continue;
      std::vector<Front>& front = fronts[d];
      auto from = front.end();
      while (from != front.begin() && std::prev(from)->kept >= l_held - most_pending[d]) --from;
      visited += front.end() - from;
      front.erase(std::remove_if(from, front.end(),
                                 [&](const Front& f) {
                                   const double extra =
                                       f.backlog >= linear && l.backlog >= linear
                                           ? l.backlog - f.backlog
                                           : std::max(0.0, l.backlog - f.backlog);
                                   return l.host <= f.host &&
                                          l_held <= f.held &&
                                          l.pending <= f.pending && l.slack >= f.slack &&
                                          l.time + extra <= f.time;
                                 }),
                  front.end());
    }
    ++same_kept;
    labels[out++] = l;
    if (l.host == 0 && l.slack == kNoSlack && l.backlog < linear) {
      // Those after l's place (no faster) whose time + backlog is no less leave.
      std::vector<Lane>& lane = lanes[grp * npend + pend];
      const double total = l.time + l.backlog;
      auto at = std::lower_bound(lane.begin(), lane.end(), l.time,
                                 [](const Lane& x, double t) { return x.time < t; });
      auto end = at;
      while (end != lane.end() && end->total >= total) ++end;
      at = lane.erase(at, end);
      lane.insert(at, Lane{l.time, total});
      continue;
    }
    if (l.backlog == 0.0 && l.pending == 0 && l.slack == kNoSlack) {
      // No entry of no more host bytes is as fast (l would be dominated): those after l's
      // place that are no faster leave, and l goes in.
      std::vector<Step>& st = stairs[grp];
      auto at = std::lower_bound(st.begin(), st.end(), l.host,
                                 [](const Step& x, int64_t h) { return x.host < h; });
      auto end = at;
      while (end != st.end() && end->time >= l.time) ++end;
      at = st.erase(at, end);
      st.insert(at, Step{l.host, l.time});
      continue;
    }
    fronts[grp].push_back(
        Front{l.kept, l.host, l_held, l.pending, l.slack, l.time, l.backlog, l.option});
    most_pending[grp] = std::max(most_pending[grp], l.pending);
    least_time[grp] = std::min(least_time[grp], l.time);
    if (l.backlog >= linear) {
      least_time_backlog[grp] = std::min(least_time_backlog[grp], l.time + l.backlog);
    }
    most_held[grp] = std::max(most_held[grp], l_held);
  }
  labels.resize(out);
}


// The fallback's pruning (a heuristic): labels are binned by (phase, kept bytes / bucket)
// and each bin keeps at most `per_bin` labels that no other label of the bin dominates
// (the dominance of prune(), the last layer's offload bytes `off_of` included), the
// fastest when more survive. Bytes stay exact, so every plan found meets its budgets.
// Sort-free: one pass over the labels, O(labels x per_bin).
// Returns whether it dropped a label that no other dominates (a bin overflowed): when no
// layer's pruning did, the search kept every label the exact one keeps and is exact.
// Under a host budget the bins are also split by host bytes (`host_bucket` > 0, each bin
// of kept bytes into `host_bins`): the fastest labels of a bin tend to be those that
// offload the most, and keeping only them lost every plan within the host budget (solve()
// found none at a budget above one min_peak() met; tester, session 22).
bool prune_capped(std::vector<Label>& labels, double linear, int64_t bucket, int64_t bins,
                  int64_t host_bucket, int64_t host_bins, int per_bin,
                  const std::vector<int64_t>* code_bytes, std::vector<int32_t>& slots,
                  std::vector<int32_t>& counts) {
  bool truncated = false;
  const size_t cells = static_cast<size_t>(4 * bins * host_bins);
  slots.assign(cells * static_cast<size_t>(per_bin), -1);
  counts.assign(cells, 0);
  auto off_of = [&](const Label& l) -> int64_t {
    return code_bytes == nullptr ? 0 : (*code_bytes)[l.code];
  };
  auto dominates = [&](const Label& a, const Label& b) {
    if (a.kept > b.kept || a.host > b.host || off_of(a) > off_of(b) || a.pending > b.pending ||
        a.slack < b.slack || a.used != b.used || a.credit < b.credit) {
      return false;
    }
    if (code_bytes == nullptr && a.code != b.code) return false;
    const double extra = a.backlog >= linear && b.backlog >= linear
                             ? a.backlog - b.backlog
                             : std::max(0.0, a.backlog - b.backlog);
    return a.time + extra <= b.time;
  };
  for (size_t i = 0; i < labels.size(); ++i) {
    const Label& l = labels[i];
    const int64_t bin = std::min<int64_t>(l.kept / bucket, bins - 1);
    const int64_t host_bin = host_bucket > 0 ? std::min<int64_t>(l.host / host_bucket, host_bins - 1) : 0;
    const size_t cell = (static_cast<size_t>(l.phase) * static_cast<size_t>(bins) +
                         static_cast<size_t>(bin)) * static_cast<size_t>(host_bins) +
                        static_cast<size_t>(host_bin);
    int32_t* slot = &slots[cell * static_cast<size_t>(per_bin)];
    int32_t& count = counts[cell];
    bool dominated = false;
    for (int j = 0; j < count && !dominated; ++j) dominated = dominates(labels[slot[j]], l);
    if (dominated) continue;
    int kept_entries = 0;
    for (int j = 0; j < count; ++j) {
      if (!dominates(l, labels[slot[j]])) slot[kept_entries++] = slot[j];
    }
    count = kept_entries;
    if (count < per_bin) {
      slot[count++] = static_cast<int32_t>(i);
      continue;
    }
    truncated = true;
    int slowest = 0;
    for (int j = 1; j < count; ++j) {
      if (labels[slot[j]].time > labels[slot[slowest]].time) slowest = j;
    }
    if (labels[slot[slowest]].time > l.time) slot[slowest] = static_cast<int32_t>(i);
  }
  std::vector<Label> out;
  out.reserve(labels.size());
  for (size_t cell = 0; cell < cells; ++cell) {
    for (int j = 0; j < counts[cell]; ++j) {
      out.push_back(labels[slots[cell * static_cast<size_t>(per_bin) + j]]);
    }
  }
  labels.swap(out);
  return truncated;
}

}  // namespace

Planner::Planner(StepProfile profile, int64_t byte_quantum, double time_tolerance)
    : profile_(std::move(profile)), quantum_(byte_quantum), tolerance_(time_tolerance) {
  profile_.validate();
  // The bounds read kept_bytes as the least a layer's option keeps (CostModel.h).
  profile_ = with_least_boundary_charges(std::move(profile_));
  // The search's costs are those of every release submitting at once; the plans it makes
  // run that way (ActivationPlan.offload_window = 0).
  HP_CHECK_VALUE(profile_.offload_window == 0, "the planner solves for offload window 0 (its "
                 "plans set it when applied); got a profile with offload window ",
                 profile_.offload_window, ". Set PlannerProfile.offload_window = 0");
  HP_CHECK_VALUE(byte_quantum >= 1 && byte_quantum <= kMaxProfileBytes,
                 "planner byte quantum must be in [1, 2^60], got ", byte_quantum);
  HP_CHECK_VALUE(std::isfinite(time_tolerance) && time_tolerance >= 0.0 && time_tolerance < 1.0,
                 "planner time tolerance must be in [0, 1), got ", time_tolerance);
  const size_t n = profile_.num_layers(), s = profile_.num_options();
  class_of_.assign(n, std::vector<int>(s, 0));
  class_bytes_.assign(n, std::vector<int64_t>{0});
  for (size_t k = 0; k < n; ++k) {
    for (size_t o = 0; o < s; ++o) {
      const int64_t off = profile_.effective(k, o).group_bytes();
      auto& bytes = class_bytes_[k];
      auto it = std::find(bytes.begin(), bytes.end(), off);
      if (it == bytes.end()) it = bytes.insert(bytes.end(), off);
      class_of_[k][o] = static_cast<int>(it - bytes.begin());
    }
    radix_ = std::max<uint64_t>(radix_, class_bytes_[k].size());
  }
  depth_ = static_cast<int>(std::min<int64_t>(profile_.prefetch_depth,
                                              static_cast<int64_t>(n) - 1));
  double codes = 1.0;
  for (int i = 0; i < depth_; ++i) codes *= static_cast<double>(radix_);
  HP_CHECK_VALUE(codes < 4.0e18, "the planner models prefetch depths whose ", radix_,
                 "^depth offload classes fit in 62 bits; depth ", profile_.prefetch_depth,
                 " does not (plan for a smaller depth, or with fewer swapping candidates)");
}

std::vector<uint64_t> Planner::masks(const std::vector<uint64_t>& allowed) const {
  const size_t n = profile_.num_layers(), s = profile_.num_options();
  const uint64_t all = s == 64 ? ~uint64_t{0} : ((uint64_t{1} << s) - 1);
  if (allowed.empty()) return std::vector<uint64_t>(n, all);
  HP_CHECK_VALUE(allowed.size() == n, "allowed has ", allowed.size(), " masks for ", n,
                 " layers");
  std::vector<uint64_t> out(n);
  for (size_t k = 0; k < n; ++k) {
    out[k] = allowed[k] & all;
    HP_CHECK_VALUE(out[k] != 0, "layer ", k, " allows no option");
  }
  return out;
}

bool Planner::uneven_held(const std::vector<uint64_t>& m) const {
  for (size_t k = 1; k < profile_.num_layers(); ++k) {
    int64_t seen = -1;
    for (size_t o = 0; o < profile_.num_options(); ++o) {
      if (!(m[k] >> o & 1)) continue;
      const OptionCost c = profile_.effective(k, o);
      const int64_t h = held_of(c);
      if (seen >= 0 && h != seen) return true;
      // with its shared or boundary charge
      if ((c.shared_bytes > 0 || c.input_bytes > 0) && c.held_bytes > c.kept_bytes) return true;
      seen = h;
    }
  }
  return false;
}

PlanResult Planner::solve(int64_t budget, const std::vector<uint64_t>& allowed,
                          int64_t host_budget, int64_t deepening_labels) const {
  HP_CHECK_VALUE(deepening_labels >= 0, "planner deepening_labels must be >= 0 (0: no deepening), got ",
                 deepening_labels);
  return solve_known(budget, allowed, host_budget, nullptr, deepening_labels);
}

PlanResult Planner::solve_known(int64_t budget, const std::vector<uint64_t>& allowed,
                                int64_t host_budget, const PlanResult* known,
                                int64_t deepening_labels) const {
  PlanResult r = solve_unpolished(budget, allowed, host_budget, known, deepening_labels);
  // At depth >= 2 the searches minimise the depth-1 time, an upper bound (Planner.h): their
  // optimum is not evaluate()'s (a tester: 6 248 plans marked exact were not optimal). A
  // time tolerance prunes labels within it of dominating, and a byte quantum rounds bytes
  // up, so plans may be missed: neither search proves its plan optimal (a tester: plans
  // marked exact 5 % and 110 % slower than the optimum, and larger budgets giving slower
  // "exact" plans). With a byte quantum the relaxations still bound the optimum, and a
  // plan polish() brings to that bound is proven optimal by it (a tester: 330 such plans,
  // each the brute-force optimum).
  if (depth_ >= 2 || tolerance_ > 0.0 || quantum_ > 1) r.stats.exact = false;
  if (r.feasible && !r.stats.exact) polish(r, budget, masks(allowed), host_budget);
  return r;
}

void Planner::polish(PlanResult& r, int64_t budget, const std::vector<uint64_t>& allowed,
                     int64_t host_budget) const {
  // First-improvement hill climbing over one layer's option at a time, each candidate
  // judged by evaluate() (peak, host peak and step time as the cost model predicts them,
  // every charge included), layers in order, until a pass changes nothing (at most
  // kPolishPasses). A heuristic's plan was not even locally optimal: on a tester's random
  // 100-layer profile (copies 2.4x a forward) one change at a time took 9.7 % off its step
  // time; with 4 passes at most, another's stopped 0.5 % above its local optimum (10
  // passes).
  const size_t n = profile_.num_layers(), s = profile_.num_options();
  auto fits = [&](const Prediction& e) {
    return e.peak_bytes <= budget && (host_budget < 0 || e.host_peak_bytes <= host_budget);
  };
  if (!fits(r.prediction)) return;
  std::vector<int> a = r.assignment;
  double best = objective_of(r.prediction);
  bool moved = false;
  for (int pass = 0; pass < kPolishPasses; ++pass) {
    bool improved = false;
    for (size_t k = 0; k < n; ++k) {
      for (size_t o = 0; o < s; ++o) {
        if (static_cast<int>(o) == a[k] || !(allowed[k] >> o & 1)) continue;
        const int was = a[k];
        a[k] = static_cast<int>(o);
        const Prediction e = evaluate(profile_, a);
        if (fits(e) && objective_of(e) < best * (1.0 - 1e-12)) {
          best = objective_of(e);
          improved = moved = true;
        } else {
          a[k] = was;
        }
      }
    }
    if (!improved) break;
  }
  if (!moved) return;
  r.assignment = std::move(a);
  r.prediction = evaluate(profile_, r.assignment);
  r.stats.objective = best;
  if (std::isfinite(r.stats.lower_bound)) {
    if (best <= r.stats.lower_bound * (1.0 + 1e-12)) r.stats.exact = true;
    r.stats.lower_bound = std::min(r.stats.lower_bound, best);
  }
}

PlanResult Planner::solve_unpolished(int64_t budget, const std::vector<uint64_t>& allowed,
                                     int64_t host_budget, const PlanResult* known,
                                     int64_t deepening_labels) const {
  const std::vector<uint64_t> m = masks(allowed);
  // The time found is the optimum (a lower bound of itself) only where the search is
  // exact: depth <= 1, no tolerance, no byte rounding.
  const bool bounded = depth_ <= 1 && tolerance_ == 0.0;
  // Branch and bound (without a time tolerance): the exact search with a cut-off drops
  // the labels whose time plus a lower bound of the rest (rest_bound(): the relaxation,
  // solved backwards) exceeds it. Every label on the optimum's path stays while the
  // optimum is within the cut-off, so a plan found within it is the optimum. The first
  // cut-off lies kCutoffFirst above the relaxation's optimum (the relaxation is within
  // 0.1 % of the optimum on most unsaturated profiles: fronts 5-8x smaller, 100 layers in
  // tens of milliseconds); when no plan is found within it, the second is the objective of
  // the best plan known to fit (that search's or the fallback's), so the search cannot
  // come back empty. Each search is given up once a front outgrows kMaxExactLabels, or
  // kExactLabelsPerLayer x (layers decided): fronts that grow that fast are the saturated
  // case, whose fronts reach 10^5-10^6 labels without a cut-off (Planner.h).
  RestBound rest;  // empty with a tolerance (or a budget below the base bytes)
  if (tolerance_ == 0.0 && budget >= profile_.base_bytes) {
    rest = rest_bound(budget, m);
    if (!std::isfinite(rest.root)) return PlanResult{};  // not even the relaxation fits
  }
  const double root = rest.root;
  int64_t spent_created = 0, spent_kept = 0;  // labels of the searches given up
  // Labels of the searches run for a plan that `into` replaces.
  auto take_counts = [](PlanResult& into, const PlanResult& from) {
    into.stats.labels_created = from.stats.labels_created;
    into.stats.labels_kept = from.stats.labels_kept;
    into.stats.widest_layer = std::max(into.stats.widest_layer, from.stats.widest_layer);
  };
  auto exact = [&](PlanResult x) {
    x.stats.labels_created += spent_created;
    x.stats.labels_kept += spent_kept;
    x.stats.lower_bound = bounded && quantum_ == 1 && x.feasible
                              ? x.stats.objective
                              : std::numeric_limits<double>::quiet_NaN();
    return x;
  };
  auto cut_search = [&](double seconds) {
    const Cutoff cut{&rest, seconds};
    return search(budget, host_budget, m, false, quantum_, tolerance_, kMaxExactLabels, 0,
                  false, 0, kExactLabelsPerLayer, &cut);
  };
  PlanResult known_plan;  // a plan the first cut-off search found beyond its cut-off
  double proven = root;  // a lower bound of the optimum
  if (!rest.seconds.empty()) {
    const double first = root * (1.0 + kCutoffFirst);
    PlanResult r = cut_search(first);
    if (!r.stats.overflowed && r.feasible && r.stats.objective <= first) return exact(r);
    if (!r.stats.overflowed && r.feasible) known_plan = r;
    // A search that ran to its end without a plan within the cut-off proves none exists
    // (not with bytes rounded up: it may have missed plans that fit).
    if (quantum_ == 1 && !r.stats.overflowed && (!r.feasible || r.stats.objective > first)) {
      proven = first;
    }
    spent_created += r.stats.labels_created;
    spent_kept += r.stats.labels_kept;
  } else {
    PlanResult r = search(budget, host_budget, m, false, quantum_, tolerance_, kMaxExactLabels, 0,
                          false, 0, kExactLabelsPerLayer);
    if (!r.stats.overflowed) return exact(r);
    spent_created += r.stats.labels_created;
    spent_kept += r.stats.labels_kept;
  }
  // The cut-offs below also bound what the D2H backlog adds (add_linear_bound()).
  if (!rest.seconds.empty()) {
    add_linear_bound(rest, budget, m);
    proven = std::max(proven, rest.linear_root);
  }
  // The fallback (a heuristic): exact bytes, labels binned by kept bytes (budget / bins),
  // the fastest undominated few per bin and phase.
  const int64_t bucket = std::max<int64_t>(1, (budget - profile_.base_bytes) / kFallbackBins);
  PlanResult a = search(budget, host_budget, m, false, quantum_, tolerance_, -1, kFallbackPerBin,
                        false, bucket, 0);
  if (known_plan.feasible &&
      (!a.feasible || known_plan.stats.objective < a.stats.objective)) {
    take_counts(known_plan, a);
    a = std::move(known_plan);
  }
  if (!rest.seconds.empty() && a.feasible) {
    // A plan within it fits: the exact search within its objective cannot come back empty.
    double upper = a.stats.objective;
    // The capped search again with kWideBins bins and that plan's objective as the
    // cut-off, which drops most labels at birth (the wider bins cost about what the first
    // pass did). When no bin overflowed, it kept every label the exact search keeps: its
    // plan is the optimum. Otherwise it is a heuristic's still, usually the better one
    // (saturated 100-layer profiles: 0.49 % and 0.20 % above the optimum -> 0.03 % and
    // 0.05 %; PlannerTest).
    const Cutoff wide_cut{&rest, upper * (1.0 + 1e-12)};
    PlanResult w = search(budget, host_budget, m, false, quantum_, tolerance_, -1,
                          kFallbackPerBin, false,
                          std::max<int64_t>(1, (budget - profile_.base_bytes) / kWideBins), 0,
                          &wide_cut);
    if (w.feasible && !w.stats.truncated) {
      w.stats.labels_created += a.stats.labels_created;
      w.stats.labels_kept += a.stats.labels_kept;
      return exact(w);
    }
    a.stats.labels_created += w.stats.labels_created;
    a.stats.labels_kept += w.stats.labels_kept;
    if (w.feasible && w.stats.objective < a.stats.objective) {
      take_counts(w, a);
      a = std::move(w);
      upper = a.stats.objective;
    }
    // Deepening (branch and bound with rising cut-offs): exact searches whose cut-offs
    // rise from the best lower bound towards that plan's objective, the first
    // (upper - bound) / kDeepeningFirst above the bound, each next step kDeepeningGrowth
    // times the last, together allowed deepening_labels labels. A search that ends without
    // a plan within its cut-off proves the optimum above it (the next starts there); the
    // first that finds one has found the optimum. The labels a search keeps grow steeply
    // with its cut-off's distance above the bound (a saturated 100-layer solve: 0.33, 0.45,
    // 0.77, 1.6 million at 0.01, 0.03, 0.06, 0.12 % above it), so cut-offs near the optimum
    // are cheap where the plan's own objective, 0.03-0.4 % above it, is not: a 128-layer
    // decoder profile is solved exactly (the search within the plan's objective would
    // have kept 3.4 million labels). Deepening stops early when the next search, guessed
    // from the growth between the last two, would outgrow what is left.
    // Only where the plan lies within kDeepeningGap of the bound: where the relaxations are
    // far off (random profiles whose options all offload a lot: 12 %) the first search,
    // (plan - bound) / kDeepeningFirst above the bound, alone outgrew the labels allowed
    // (0.5 s spent for nothing). There the exact search within the plan's objective runs
    // once, with the first search's limits (it proves small profiles' plans optimal).
    double floor_bound = std::max(proven, rest.linear_root);
    if (upper - floor_bound > kDeepeningGap * floor_bound) {
      PlanResult r = cut_search(upper * (1.0 + 1e-12));
      if (!r.stats.overflowed && r.feasible) {
        r.stats.labels_created += a.stats.labels_created;
        r.stats.labels_kept += a.stats.labels_kept;
        return exact(r);
      }
      spent_created += r.stats.labels_created;
      spent_kept += r.stats.labels_kept;
      floor_bound = upper;  // (no deepening)
    }
    double step = (upper - floor_bound) / kDeepeningFirst;
    int64_t left = deepening_labels, last_created = 0, guess = 0;
    while (step > 0.0 && left > 0 && guess <= left) {
      const double c = std::min(upper, floor_bound + step);
      // (With the scan limit: under a host budget labels carry host bytes, which the
      // staircases of prune() leave to the scanned fronts; unlimited, a tester's 100-layer
      // search scanned for 15 s.)
      const Cutoff cut{&rest, c * (1.0 + 1e-12), left};
      PlanResult r = search(budget, host_budget, m, false, quantum_, tolerance_,
                            kDeepeningWidest, 0, false, 0, 0, &cut);
      left -= r.stats.labels_created;
      if (!r.stats.overflowed && r.feasible && r.stats.objective <= c * (1.0 + 1e-12)) {
        if (quantum_ == 1) {
          r.stats.labels_created += a.stats.labels_created;
          r.stats.labels_kept += a.stats.labels_kept;
          return exact(r);
        }
        // With bytes rounded up the search may have missed plans: the plan is not proven
        // optimal (its bound comes below).
        spent_created += r.stats.labels_created;
        spent_kept += r.stats.labels_kept;
        if (r.stats.objective < a.stats.objective) {
          take_counts(r, a);
          a = std::move(r);
        }
        break;
      }
      spent_created += r.stats.labels_created;
      spent_kept += r.stats.labels_kept;
      if (r.stats.overflowed || c >= upper) break;
      if (quantum_ == 1) proven = std::max(proven, c);
      floor_bound = c;
      step *= kDeepeningGrowth;
      // The next search's labels, guessed from the growth between the last two (after the
      // first search, from kDeepeningGuessGrowth).
      guess = last_created > 0 ? r.stats.labels_created * r.stats.labels_created / last_created
                               : r.stats.labels_created * kDeepeningGuessGrowth;
      last_created = r.stats.labels_created;
    }
  }
  a.stats.labels_created += spent_created;
  a.stats.labels_kept += spent_kept;
  a.stats.exact = false;
  a.stats.lower_bound = std::numeric_limits<double>::quiet_NaN();
  if (!bounded || !a.feasible) {
    // The capped searches found no plan: is there one at all? The memory-only search keeps
    // every label no other holds less than, so it finds one wherever one exists (in a few
    // milliseconds; the exact search below spent 2 s on 100 layers to find none). Under a
    // host budget its fronts hold up to every distinct sum of host bytes (a knapsack; a
    // tester's 100-layer profile: 3 million labels, 75 s, near the least peak): after
    // kFallbackMemoryLabels labels it gives up, and the least-peak plan of
    // least_peak_plan() decides (the budget is met iff that plan's peak is within it; a
    // budget within its proven gap, 0.08 % on that profile, is refused). min_peak() passes
    // the plan it found (`known`).
    PlanResult f;
    if (!a.feasible) {
      if (known != nullptr) {
        f = *known;
        f.stats = SearchStats{};
      } else {
        const Cutoff count{nullptr, 0.0, kFallbackMemoryLabels};
        f = search(budget, host_budget, m, true, quantum_, 0.0, -1, 0, false, 0, 0,
                   host_budget >= 0 ? &count : nullptr);
        if (f.stats.overflowed) {
          a.stats.labels_created += f.stats.labels_created;
          a.stats.labels_kept += f.stats.labels_kept;
          f = least_peak_plan(m, host_budget, nullptr);
        }
      }
      a.stats.labels_created += f.stats.labels_created;
      a.stats.labels_kept += f.stats.labels_kept;
      if (!f.feasible || f.prediction.peak_bytes > budget ||
          (host_budget >= 0 && f.prediction.host_peak_bytes > host_budget)) {
        return a;
      }
    }
    // No bound to judge the heuristic by: the exact search up to the full limit; after the
    // memory-only plan, with its objective as the cut-off and the usual limits (the full
    // limit took 2 s on 100 layers to give up).
    const double f_objective = f.feasible ? objective_of(f.prediction) : kInf;
    PlanResult e = f.feasible && !rest.seconds.empty()
                       ? cut_search(f_objective * (1.0 + 1e-9))
                       : search(budget, host_budget, m, false, quantum_, tolerance_,
                                kMaxExactLabels, 0, false, 0, 0);
    if (!e.stats.overflowed && e.feasible) {
      // (a's counts hold the searches given up already; exact() adds those.)
      e.stats.labels_created += a.stats.labels_created - spent_created;
      e.stats.labels_kept += a.stats.labels_kept - spent_kept;
      return exact(e);  // its own bound where it is exact (it had been left NaN)
    }
    if (!a.feasible) {
      // The exact search outgrew its limit: the memory-only search's plan (within the
      // budgets, not optimised for time; solve() polishes it) rather than none, or a
      // budget could be refused while a smaller one was met.
      f.stats.labels_created = a.stats.labels_created + e.stats.labels_created + spent_created;
      f.stats.labels_kept = a.stats.labels_kept + e.stats.labels_kept + spent_kept;
      f.stats.exact = false;
      f.stats.objective = f_objective;
      f.stats.lower_bound = std::numeric_limits<double>::quiet_NaN();
      if (bounded) {
        // Its bound, as below without the grid search: the relaxation (host-priced under a
        // host budget) or what the cut-off searches proved, the larger (it had been left
        // NaN at depth <= 1 too; tester).
        double low = host_budget < 0 ? relaxed_bound(budget, m)
                                     : host_priced_bound(budget, m, host_budget);
        if (std::isfinite(proven)) low = std::isfinite(low) ? std::max(low, proven) : proven;
        if (std::isfinite(low)) f.stats.lower_bound = std::min(low, f_objective);
      }
      return f;
    }
    return a;
  }
  // Its bound: the relaxation without D2H backlog, in exact bytes (relaxed_bound(); a
  // relaxation of the search with bytes rounded up too, whose plans hold no less). With a
  // host budget, the host-priced (Lagrangian) bound, and with either a host budget or a
  // byte quantum also the relaxation on a byte grid rounded down when its search stays
  // within kMaxExactLabels per layer (its fronts grow with the host dimension: unbounded,
  // it took minutes for 30 layers); the larger bound.
  double low = host_budget < 0 ? relaxed_bound(budget, m) : host_priced_bound(budget, m, host_budget);
  if (host_budget >= 0 || quantum_ > 1) {
    const int64_t q = std::max<int64_t>(quantum_, (budget - profile_.base_bytes) / 512);
    const PlanResult l = search(budget, host_budget, m, false, q, 0.0, kMaxExactLabels, 0, true);
    a.stats.labels_created += l.stats.labels_created;
    a.stats.labels_kept += l.stats.labels_kept;
    if (l.feasible && !l.stats.overflowed) low = std::max(low, l.stats.objective);
  }
  if (std::isfinite(proven)) low = std::isfinite(low) ? std::max(low, proven) : proven;
  const double got = a.stats.objective;
  if (std::isfinite(low)) a.stats.lower_bound = std::min(low, got);
  // The relaxation's optimum is the plan's: the plan is optimal (the bound proves it).
  if (got <= low * (1.0 + 1e-12)) a.stats.exact = true;
  return a;
}

std::vector<int64_t> Planner::held_after(const std::vector<uint64_t>& allowed,
                                         bool least) const {
  // out[k]: bytes of Lk+1 .. Ln-1 that the caller holds past their backward (Planner.h),
  // the most (or the least) of each layer's allowed options, plus the head's.
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  std::vector<int64_t> out(n, p.tail_held_bytes);
  for (size_t k = n; k-- > 1;) {
    int64_t pick = -1;
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k] >> o & 1)) continue;
      const int64_t h = held_of(p.effective(k, o));
      pick = pick < 0 ? h : (least ? std::min(pick, h) : std::max(pick, h));
    }
    out[k - 1] = out[k] + std::max<int64_t>(0, pick);
  }
  return out;
}

double Planner::relaxed_bound(int64_t budget, const std::vector<uint64_t>& allowed,
                              double host_price) const {
  // Labels (kept, time, class of the last layer), one phase: without backlog the phases of
  // search() price every layer alike. Kept in increasing kept bytes; a label is dropped
  // when an earlier one (no more kept bytes) has no more offload bytes in its last layer
  // and no more time (exact for the relaxation). Children of one option keep their
  // parents' order, so a merge of the per-option lists keeps the order (no sort).
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  if (budget < p.base_bytes) return kInf;
  struct R {
    int64_t kept;
    double time;
    int32_t cls;
  };
  std::vector<R> cur{R{0, 0.0, 0}}, next;
  std::vector<std::vector<R>> lists(s);
  std::vector<size_t> head(s);
  std::vector<double> best;
  std::vector<std::vector<int>> no_more;  // per class: the classes with no more bytes
  constexpr size_t kNone = ~size_t{0};
  std::vector<size_t> last_of;  // per class: its latest label in next
  const int64_t bin_bytes = std::max<int64_t>(1, (budget - p.base_bytes) / kBoundBins);
  const std::vector<int64_t> after = held_after(allowed, true);  // a relaxation: the least
  for (size_t k = 0; k < n; ++k) {
    const bool last = k + 1 == n;
    for (auto& l : lists) l.clear();
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k] >> o & 1)) continue;
      const OptionCost c = p.effective(k, o);
      const int64_t off = c.group_bytes();
      const double work = relaxed_work(p, c, host_price);
      const int32_t cls = depth_ > 0 ? class_of_[k][o] : 0;
      std::vector<R>& out = lists[o];
      for (const R& b : cur) {
        const int64_t prev_off = depth_ > 0 && k > 0 ? class_bytes_[k - 1][b.cls] : 0;
        const int64_t held = p.base_bytes + b.kept + c.kept_bytes + off;
        if (held > budget || held + prev_off + after[k] > budget) continue;
        if (last && p.base_bytes + b.kept + c.kept_bytes + p.tail_bytes > budget) continue;
        out.push_back(R{b.kept + c.kept_bytes, b.time + work + reload_stall(p, prev_off, c), cls});
      }
    }
    const std::vector<int64_t>& bytes = class_bytes_[k];
    const size_t classes = depth_ > 0 ? bytes.size() : 1;
    no_more.assign(classes, {});
    for (size_t c = 0; c < classes; ++c) {
      for (size_t d = 0; d < classes; ++d) {
        if (depth_ == 0 || bytes[d] <= bytes[c]) no_more[c].push_back(static_cast<int>(d));
      }
    }
    best.assign(classes, kInf);
    last_of.assign(classes, kNone);
    next.clear();
    std::fill(head.begin(), head.end(), 0);
    while (true) {
      size_t pick = s;
      for (size_t o = 0; o < s; ++o) {
        if (head[o] < lists[o].size() &&
            (pick == s || lists[o][head[o]].kept < lists[pick][head[pick]].kept)) {
          pick = o;
        }
      }
      if (pick == s) break;
      const R l = lists[pick][head[pick]++];
      bool dominated = false;
      for (int d : no_more[static_cast<size_t>(l.cls)]) {
        if (best[static_cast<size_t>(d)] <= l.time) {
          dominated = true;
          break;
        }
      }
      if (dominated) continue;
      best[static_cast<size_t>(l.cls)] = l.time;  // l.time < every survivor's of no more off
      // Within one bin of kept bytes, the labels of a class merge into the first one (the
      // least kept bytes) with the least time: a label no worse than each it replaces.
      const int64_t bin = l.kept / bin_bytes;
      size_t& at = last_of[static_cast<size_t>(l.cls)];
      if (at != kNone && next[at].kept / bin_bytes == bin) {
        next[at].time = l.time;
        continue;
      }
      at = next.size();
      next.push_back(l);
    }
    std::swap(cur, next);
    if (cur.empty()) return kInf;
  }
  double t = kInf;
  for (const R& l : cur) t = std::min(t, l.time);
  return t + p.tail_seconds + p.outside_seconds;
}

Planner::RestBound Planner::rest_bound(int64_t budget, const std::vector<uint64_t>& allowed) const {
  // Backwards over the layers: rest[k][i, c] = min over the options o of layer k that fit
  // with i x bin_bytes kept before it (the sample points of search(), kept bytes rounded
  // down: every plan that fits there fits here) of its work and reload stall plus
  // rest[k + 1][(i x bin_bytes + kept_o) / bin_bytes, class of o]. Rounding down at each
  // layer only lowers the bound (the table is non-decreasing in i).
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  const size_t radix = static_cast<size_t>(radix_);
  RestBound out;
  out.bin_bytes = relaxation_bin(p, allowed, budget, kRestBins);
  const int64_t bin_bytes = out.bin_bytes;
  const size_t bins = static_cast<size_t>(std::max<int64_t>(0, budget - p.base_bytes) / bin_bytes) + 1;
  const std::vector<int64_t> after = held_after(allowed, true);
  // Two tables: `seconds` over every completion, `resident` over those that offload
  // nothing more (search()'s labels past the last offload).
  for (std::vector<std::vector<double>>* table : {&out.seconds, &out.resident}) {
    const bool resident = table == &out.resident;
    std::vector<std::vector<double>>& rest = *table;
    rest.resize(n + 1);
    rest[n].assign(bins * radix, 0.0);
    for (size_t k = n; k-- > 0;) {
      std::vector<double>& row = rest[k];
      row.assign(bins * radix, kInf);
      const std::vector<double>& later = rest[k + 1];
      const bool last = k + 1 == n;
      const size_t prev_classes = depth_ > 0 && k > 0 ? class_bytes_[k - 1].size() : 1;
      for (size_t o = 0; o < s; ++o) {
        if (!(allowed[k] >> o & 1)) continue;
        const OptionCost c = p.effective(k, o);
        if (resident && c.group_bytes() > 0) continue;
        const double work = relaxed_work(p, c, 0.0);
        const size_t cls = depth_ > 0 ? static_cast<size_t>(class_of_[k][o]) : 0;
        for (size_t pc = 0; pc < prev_classes; ++pc) {
          const int64_t prev_off = depth_ > 0 && k > 0 ? class_bytes_[k - 1][pc] : 0;
          const double t = work + reload_stall(p, prev_off, c);
          const size_t fit =
              fitting_bins(p, c, prev_off, after[k], last, budget, bin_bytes, bins);
          for (size_t i = 0; i < fit; ++i) {
            const int64_t kept = static_cast<int64_t>(i) * bin_bytes;
            const size_t j = static_cast<size_t>((kept + c.kept_bytes) / bin_bytes);
            const double v = t + later[j * radix + cls];
            double& slot = row[i * radix + pc];
            if (v < slot) slot = v;
          }
        }
      }
    }
  }
  out.root = out.seconds[0][0] + p.tail_seconds + p.outside_seconds;
  return out;
}

void Planner::add_linear_bound(RestBound& out, int64_t budget,
                               const std::vector<uint64_t>& allowed) const {
  // Backwards over the layers like rest_bound(), per phase of search(): the least time
  // of the layers left plus the increments of the D2H backlog they add, each as if no
  // queue ever emptied (Planner.h). Increments, as search() moves the backlog: none
  // before any offload (the queue is exactly empty), the whole copy at the first offload,
  // copy less forward while offloads go on; at the layer after the last offload, its
  // forward less what its backward leaves of the last reload's window (depth 1; forward
  // and backward at depth 0); forward and backward while draining; the tail at the end.
  // Rounding kept bytes down only lowers the table (non-decreasing in them).
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  const size_t radix = static_cast<size_t>(radix_);
  const bool exposed = p.prefetch_depth == 0;
  constexpr size_t kPhases = 4;
  out.linear_bin_bytes = std::max<int64_t>(1, (budget - p.base_bytes) / kLinearBins);
  const int64_t bin_bytes = out.linear_bin_bytes;
  const size_t bins =
      static_cast<size_t>(std::max<int64_t>(0, budget - p.base_bytes) / bin_bytes) + 1;
  const std::vector<int64_t> after = held_after(allowed, true);
  std::vector<std::vector<double>>& rest = out.linear;
  rest.assign(n + 1, {});
  rest[n].assign(bins * radix * kPhases, kInf);
  for (size_t i = 0; i < bins * radix; ++i) {
    rest[n][i * kPhases + kNoOffload] = 0.0;
    rest[n][i * kPhases + kDraining] = -p.tail_seconds;
  }
  for (size_t k = n; k-- > 0;) {
    std::vector<double>& row = rest[k];
    row.assign(bins * radix * kPhases, kInf);
    const std::vector<double>& later = rest[k + 1];
    const bool last = k + 1 == n;
    const size_t prev_classes = depth_ > 0 && k > 0 ? class_bytes_[k - 1].size() : 1;
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k] >> o & 1)) continue;
      const OptionCost c = p.effective(k, o);
      const int64_t off = c.group_bytes();
      const double work = relaxed_work(p, c, 0.0);
      // Its own offload only: deferred copies may be partly hidden (search()), so they
      // are left out of the increments, a lower bound still.
      const double copy = p.d2h.seconds(c.offload_bytes);
      const size_t cls = depth_ > 0 ? static_cast<size_t>(class_of_[k][o]) : 0;
      for (size_t pc = 0; pc < prev_classes; ++pc) {
        const int64_t prev_off = depth_ > 0 && k > 0 ? class_bytes_[k - 1][pc] : 0;
        const double t = work + reload_stall(p, prev_off, c);
        const double slack = p.h2d.seconds(prev_off) - c.backward_seconds;
        const double first_t = exposed ? work : c.forward_seconds + c.backward_seconds +
                                                    std::max(0.0, slack);
        const double first_inc = exposed ? -c.forward_seconds - c.backward_seconds
                                         : -c.forward_seconds + std::min(0.0, slack);
        const size_t fit = fitting_bins(p, c, prev_off, after[k], last, budget, bin_bytes, bins);
        for (size_t i = 0; i < fit; ++i) {
          const int64_t kept = static_cast<int64_t>(i) * bin_bytes;
          const size_t j = static_cast<size_t>((kept + c.kept_bytes) / bin_bytes);
          const double* to = &later[(j * radix + cls) * kPhases];
          double* slot = &row[(i * radix + pc) * kPhases];
          if (off > 0) {
            const double go_on = std::min(to[kMoreToCome], to[kLastChosen]);
            slot[kNoOffload] = std::min(slot[kNoOffload], t + copy + go_on);
            slot[kMoreToCome] =
                std::min(slot[kMoreToCome], t + copy - c.forward_seconds + go_on);
            continue;
          }
          slot[kNoOffload] = std::min(slot[kNoOffload], t + to[kNoOffload]);
          slot[kMoreToCome] =
              std::min(slot[kMoreToCome], t - c.forward_seconds + to[kMoreToCome]);
          slot[kLastChosen] = std::min(slot[kLastChosen], first_t + first_inc + to[kDraining]);
          slot[kDraining] = std::min(slot[kDraining], work - c.forward_seconds -
                                                          c.backward_seconds + to[kDraining]);
        }
      }
    }
  }
  out.linear_root = rest[0][kNoOffload] + p.tail_seconds + p.outside_seconds;
}

double Planner::linear_lower_bound(int64_t budget, const std::vector<uint64_t>& allowed) const {
  if (depth_ > 1) return std::numeric_limits<double>::quiet_NaN();
  if (budget < profile_.base_bytes) return kInf;
  RestBound rest;
  add_linear_bound(rest, budget, masks(allowed));
  return rest.linear_root;
}

double Planner::relaxed_lower_bound(int64_t budget, const std::vector<uint64_t>& allowed,
                                    int64_t host_budget) const {
  if (depth_ > 1) return std::numeric_limits<double>::quiet_NaN();
  const std::vector<uint64_t> m = masks(allowed);
  return host_budget < 0 ? relaxed_bound(budget, m) : host_priced_bound(budget, m, host_budget);
}

double Planner::host_priced_bound(int64_t budget, const std::vector<uint64_t>& allowed,
                                  int64_t host_budget) const {
  // Lagrangian relaxation of the host budget: for any price y >= 0 per host byte, every
  // plan within both budgets has time >= time + y * (host - host_budget), so
  // relaxed_bound(budget, y) - y * host_budget bounds the optimum from below (host bytes
  // priced into the time instead of kept as a dimension). The best y is searched on a
  // log scale (golden section; the dual is concave in y for an exact inner minimum, and
  // each y evaluated gives a valid bound whatever the search finds).
  const double h = static_cast<double>(std::max<int64_t>(host_budget, 1));
  const double free = relaxed_bound(budget, allowed, 0.0);
  if (!std::isfinite(free)) return kInf;
  double best = free;
  auto dual = [&](double u) {
    const double y = std::exp(u);
    const double v = relaxed_bound(budget, allowed, y) - y * h;
    best = std::max(best, v);
    return v;
  };
  // Prices from 1e-6 to 1e2 step times per host budget.
  double lo = std::log(1e-6 * free / h), hi = std::log(1e2 * free / h);
  constexpr double kGolden = 0.6180339887498949;
  double a = hi - kGolden * (hi - lo), b = lo + kGolden * (hi - lo);
  double fa = dual(a), fb = dual(b);
  for (int i = 0; i < kHostPriceSteps; ++i) {
    if (fa < fb) {
      lo = a;
      a = b;
      fa = fb;
      b = lo + kGolden * (hi - lo);
      fb = dual(b);
    } else {
      hi = b;
      b = a;
      fb = fa;
      a = hi - kGolden * (hi - lo);
      fa = dual(a);
    }
  }
  return best;
}

PlanResult Planner::min_peak(const std::vector<uint64_t>& allowed, int64_t host_budget) const {
  int64_t proven = -1;
  const PlanResult least = least_peak_plan(masks(allowed), host_budget, &proven);
  if (!least.feasible) return {};
  PlanResult r = solve_known(least.prediction.peak_bytes, allowed, host_budget, &least,
                             kDeepeningLabels);
  if (!r.feasible) return r;
  r.stats.least_peak_bound = std::min(proven, r.prediction.peak_bytes);
  r.stats.labels_created += least.stats.labels_created;
  r.stats.labels_kept += least.stats.labels_kept;
  return r;
}

PlanResult Planner::least_peak_plan(const std::vector<uint64_t>& m, int64_t host_budget,
                                    int64_t* proven) const {
  const StepProfile& p = profile_;
  // An upper bound of every plan's peak: each sample point is at most this.
  int64_t hi = p.base_bytes + p.tail_bytes + p.tail_held_bytes;
  for (size_t k = 0; k < p.num_layers(); ++k) {
    int64_t most = 0;
    for (size_t o = 0; o < p.num_options(); ++o) {
      const OptionCost c = p.effective(k, o);
      most = std::max(most, c.saved_bytes() + c.shared_bytes + c.input_bytes);
    }
    hi += round_up(2 * most, quantum_) + quantum_;
  }
  PlanResult at_hi;  // a plan of peak hi within the host budget (once one is known)
  int64_t created = 0, kept = 0;  // labels of every search run
  auto count = [&](const PlanResult& r) {
    created += r.stats.labels_created;
    kept += r.stats.labels_kept;
  };
  auto lower_hi = [&](PlanResult r) {
    if (!r.feasible || (at_hi.feasible && r.prediction.peak_bytes >= hi)) return;
    hi = std::min(hi, r.prediction.peak_bytes);
    at_hi = std::move(r);
  };
  // The memory-only search is exact in bytes (held bytes and shared charges included), so
  // whether it meets a budget is monotone in the budget: a binary search finds the least.
  // `limit` (< 0: none): the labels it may create before it gives up (overflowed).
  auto probe = [&](int64_t b, int64_t limit = -1) {
    const Cutoff cap{nullptr, 0.0, limit};
    PlanResult r = search(b, host_budget, m, true, quantum_, 0.0, -1, 0, false, 0, 0,
                          limit >= 0 ? &cap : nullptr);
    count(r);
    return r;
  };
  int64_t lo = p.base_bytes - 1;  // infeasible: every plan holds at least base
  auto done = [&]() {
    if (proven != nullptr) *proven = lo + 1;
    at_hi.stats.labels_created = created;
    at_hi.stats.labels_kept = kept;
    return at_hi;
  };
  // Under a host budget, the plan of least offload meets it where any plan does: its peak
  // is a budget met (with a byte quantum the searches may miss every plan: host bytes are
  // rounded up per layer).
  if (host_budget >= 0) {
    int64_t least_host = 0;
    std::vector<int> least_offload(p.num_layers(), 0);
    for (size_t k = 0; k < p.num_layers(); ++k) {
      int64_t least = -1;
      for (size_t o = 0; o < p.num_options(); ++o) {
        if (!(m[k] >> o & 1)) continue;
        const int64_t off = p.effective(k, o).group_bytes();
        if (least < 0 || off < least) {
          least = off;
          least_offload[k] = static_cast<int>(o);
        }
      }
      if (k + 1 < p.num_layers()) least_host += least;
    }
    if (least_host > host_budget) return {};
    PlanResult r;
    r.assignment = std::move(least_offload);
    r.prediction = evaluate(p, r.assignment);
    r.feasible = r.prediction.host_peak_bytes <= host_budget;
    lower_hi(std::move(r));
  }
  if (host_budget < 0 || quantum_ > 1) {
    lower_hi(probe(hi));
    if (!at_hi.feasible) return {};
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      PlanResult r = probe(mid);
      if (r.feasible) lower_hi(std::move(r));
      else lo = mid;
    }
    if (quantum_ > 1) {
      // Bytes rounded up, a probe that fails proves nothing: the bound is the largest
      // budget a relaxation (bytes rounded down) misses, by bisection.
      int64_t none_below = p.base_bytes - 1;
      for (int64_t top = hi; top - none_below > 1;) {  // (a plan meets hi)
        const int64_t mid = none_below + (top - none_below) / 2;
        const PlanResult relaxed =
            search(mid, host_budget, m, true, quantum_, 0.0, -1, 0, true, 0, 0);
        count(relaxed);
        if (relaxed.feasible) top = mid;
        else none_below = mid;
      }
      lo = none_below;
    }
    return done();
  }
  // Under a host budget the least peak is a knapsack problem (which saved bytes go to the
  // host, at most the host budget of them), and each exact search keeps a (kept, host)
  // front per layer: up to every distinct sum of offloaded bytes (a tester's 100-layer
  // profile with odd byte counts: 2.9 million labels, 75 s a search). So the exact searches
  // are spent only where nothing cheaper decides:
  //  * at the top: every plan meets `hi`, so some plan fits iff the least host bytes do;
  //  * below: the least peak without the host budget (searches without the host
  //    dimension, milliseconds each);
  //  * rounds on a grid (below) of searches with bytes rounded up (their plans' peaks are
  //    budgets met) or down (relaxations: a budget they miss no plan meets), whose fronts
  //    the grid bounds;
  //  * exact searches last, alternating a probe one byte below the least budget met with
  //    bisection, kMinPeakExactLabels labels in all; each search's plan is the least-peak
  //    one of its first final labels, so its peak, a budget met, is often well below the
  //    probe. Where they run out, the plan of the least peak found stands, and `proven`
  //    says how far below it the least may lie (0.03 % on that profile).
  // The search's lookahead (search()) drops labels that cannot meet both budgets; the
  // grids and the exact probes far from the least peak are cheap with it.
  if (!at_hi.feasible) lower_hi(probe(hi));
  if (!at_hi.feasible) return {};
  {
    int64_t free_proven = -1;
    const PlanResult free = least_peak_plan(m, -1, &free_proven);
    count(free);
    if (free.feasible) lo = std::max(lo, free_proven - 1);
  }
  // Rounds on grids of (hi - lo) / kMinPeakGrid bytes: at each midpoint, a search with
  // bytes rounded up (its plans meet both budgets: hi drops to its plan's peak, a budget
  // met) or else one rounded down (relaxed: a budget it cannot meet no plan meets); a
  // midpoint where neither decides (within the rounding, a grid per layer) ends the round,
  // and the next runs on a finer grid, until one search outgrows kMaxExactLabels.
  for (bool refining = true; refining && hi - lo > 1;) {
    const int64_t grid = (hi - lo) / kMinPeakGrid;
    if (grid <= 1) break;
    const int64_t width = hi - lo;
    while (hi - lo > 1) {
      const int64_t mid = lo + (hi - lo) / 2;
      PlanResult up = search(mid, host_budget, m, true, grid, 0.0, kMaxExactLabels, 0, false, 0, 0);
      count(up);
      const bool up_overflowed = up.stats.overflowed;
      if (up.feasible) {
        lower_hi(std::move(up));
        continue;
      }
      const PlanResult down =
          search(mid, host_budget, m, true, grid, 0.0, kMaxExactLabels, 0, true, 0, 0);
      count(down);
      if (!down.feasible && !down.stats.overflowed && !up_overflowed) {
        lo = mid;
        continue;
      }
      refining = !down.stats.overflowed && !up_overflowed && hi - lo < width / 4;
      break;
    }
  }
  // Exact searches last, the probe one byte below hi (a budget met) alternating with
  // bisection: where hi is already the least, the first probe ends the search, and at
  // most twice the bisection's probes are spent.
  int64_t left = kMinPeakExactLabels;
  for (bool below = true; hi - lo > 1 && left > 0; below = !below) {
    const int64_t mid = below ? hi - 1 : lo + (hi - lo) / 2;
    PlanResult r = probe(mid, left);
    left -= r.stats.labels_created;
    if (r.stats.overflowed) break;
    if (r.feasible) lower_hi(std::move(r));
    else lo = mid;
  }
  return done();
}

PlanResult Planner::search(int64_t budget, int64_t host_budget,
                           const std::vector<uint64_t>& allowed, bool memory_only,
                           int64_t quantum, double tolerance, int64_t max_labels,
                           int per_kept, bool relaxed, int64_t bucket,
                           int64_t labels_per_layer, const Cutoff* cutoff) const {
  const StepProfile& p = profile_;
  PlanResult result;
  const size_t n = p.num_layers(), s = p.num_options();
  const int depth = depth_;
  const bool exposed = p.prefetch_depth == 0;  // every reload waits in full
  const int64_t host_cap = host_budget < 0 ? std::numeric_limits<int64_t>::max() : host_budget;
  if (budget < p.base_bytes) return result;
  uint64_t keep_mod = 1;  // radix^(depth - 1): the digits that survive one shift
  for (int i = 1; i < depth; ++i) keep_mod *= radix_;
  // Bytes the caller holds past their backward, of the layers after each (Planner.h):
  // the most any allowed option holds (the least for the relaxation, a lower bound).
  const std::vector<int64_t> after = held_after(allowed, relaxed);
  // Held bytes exactly where options hold unlike ones (Planner.h): a label's slack is the
  // least room its backward sample points leave for the held bytes of the layers after
  // them; each layer's own held bytes come out of it, and it must cover the least the
  // layers left can hold.
  const bool track_held = !relaxed && uneven_held(allowed);
  // Least and most held bytes of L(k+1) .. L(n-1). A slack of at least the most is
  // unconstrained: it becomes kNoSlack, so such labels compare as without held bytes (and
  // enter prune()'s staircase).
  std::vector<int64_t> least_later(n, 0), most_later(n, 0);
  if (track_held) {
    for (size_t k = n - 1; k-- > 0;) {
      int64_t least = -1, most = 0;
      for (size_t o = 0; o < s; ++o) {
        if (allowed[k + 1] >> o & 1) {
          const OptionCost c = p.effective(k + 1, o);
          least = least < 0 ? held_of(c) : std::min(least, held_of(c));
          // (charged, it may hold some of its shared bytes too)
          most = std::max(most, std::min(c.held_bytes,
                                         c.kept_bytes + c.shared_bytes + c.input_bytes));
        }
      }
      least_later[k] = least_later[k + 1] + std::max<int64_t>(0, least);
      most_later[k] = most_later[k + 1] + most;
    }
  }

  // most_input[k]: the most input_bytes of layer k's allowed options (a label's credit
  // beyond those of the layer after it buys nothing: it is capped there, so labels that
  // differ only beyond it compare).
  std::vector<int64_t> most_input(n + 1, 0);
  for (size_t k = 0; k < n; ++k) {
    for (size_t o = 0; o < s; ++o) {
      if (allowed[k] >> o & 1) most_input[k] = std::max(most_input[k], p.layers[k][o].input_bytes);
    }
  }
  // charged_later[k]: the options that some layer after k charges shared bytes for (the
  // only ones a label's `used` set keeps).
  std::vector<uint64_t> charged_later(n, 0);
  for (size_t k = n - 1; k-- > 0;) {
    charged_later[k] = charged_later[k + 1];
    for (size_t o = 0; o < s; ++o) {
      if ((allowed[k + 1] >> o & 1) && p.layers[k + 1][o].shared_bytes > 0) {
        charged_later[k] |= uint64_t{1} << o;
      }
    }
  }
  // Lookahead (necessary conditions, so every search may drop a label failing them): the
  // layers after k add at least need[k] kept bytes before some sample point (each later
  // layer keeps at least its least kept bytes, and one of them also holds its own offload
  // at the end of its forward; or the tail at the end of the forward) and at least
  // host_need[k] host bytes; and for a price l of host bytes in kept bytes, at least
  // priced[k][i] = sum over the later layers of min(kept + l_i x offload) of the two,
  // priced, against the end of the forward's room plus l_i x the host budget (Lagrangian
  // relaxation of the two budgets). Without them, memory-only searches under a binding
  // host budget kept (kept, host) fronts of 3 million labels (a tester's 100-layer
  // profile: 270 s a search).
  // (In integers: the prices are eighths, so 8 x each side is exact in 128 bits; in
  // doubles, byte counts above 2^53 lost the plans that meet a budget to the byte.)
  using Wide = __int128;
  std::vector<int64_t> need(n, p.tail_bytes), host_need(n, 0);
  std::vector<std::array<Wide, kLookaheadPrices>> priced(n);
  priced[n - 1].fill(0);
  for (size_t k = n - 1; k-- > 0;) {
    int64_t least_kept = -1, least_local = -1, least_off = -1;
    std::array<Wide, kLookaheadPrices> least_priced;
    least_priced.fill(-1);
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k + 1] >> o & 1)) continue;
      const OptionCost c = p.effective(k + 1, o);
      const int64_t off = c.group_bytes();
      least_kept = least_kept < 0 ? c.kept_bytes : std::min(least_kept, c.kept_bytes);
      least_local = least_local < 0 ? c.kept_bytes + off : std::min(least_local, c.kept_bytes + off);
      least_off = least_off < 0 ? off : std::min(least_off, off);
      for (int i = 0; i < kLookaheadPrices; ++i) {
        const Wide v = Wide{8} * c.kept_bytes + Wide{kLookaheadEighths[i]} * off;
        if (least_priced[i] < 0 || v < least_priced[i]) least_priced[i] = v;
      }
    }
    need[k] = std::max(least_local, least_kept + need[k + 1]);
    host_need[k] = host_need[k + 1] + least_off;
    for (int i = 0; i < kLookaheadPrices; ++i) priced[k][i] = priced[k + 1][i] + least_priced[i];
  }
  // The room of the end of the forward for kept bytes (the last layer's sample point).
  const Wide forward_room = Wide{8} * (budget - p.base_bytes - p.tail_bytes);
  auto completes = [&](size_t k, int64_t kept, int64_t host) {
    if (p.base_bytes + kept + need[k] > budget) return false;
    if (host_budget < 0) return true;
    if (host + host_need[k] > host_cap) return false;
    for (int i = 0; i < kLookaheadPrices; ++i) {
      const Wide price = kLookaheadEighths[i];
      if (Wide{8} * kept + price * host + priced[k][i] > forward_room + price * host_cap) {
        return false;
      }
    }
    return true;
  };
  // Per layer: the least forward time and the least work (forward + backward) left from
  // it on, over its allowed options; a backlog that these surely drain is as good as none.
  std::vector<double> min_fwd(n + 1, 0.0), rest(n + 1, p.tail_seconds);
  // most[k]: the most work (forward + backward) from layer k on, plus the tail.
  std::vector<double> most(n + 1, p.tail_seconds);
  for (size_t k = n; k-- > 0;) {
    double f = kInf, w = kInf;
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k] >> o & 1)) continue;
      f = std::min(f, p.layers[k][o].forward_seconds);
      w = std::min(w, p.layers[k][o].forward_seconds + p.layers[k][o].backward_seconds);
    }
    min_fwd[k] = f;
    rest[k] = rest[k + 1] + w;
    double m = 0.0;
    for (size_t o = 0; o < s; ++o) {
      if (allowed[k] >> o & 1) m = std::max(m, p.layers[k][o].forward_seconds);
    }
    double mb = 0.0;
    for (size_t o = 0; o < s; ++o) {
      if (allowed[k] >> o & 1) mb = std::max(mb, p.layers[k][o].backward_seconds);
    }
    most[k] = most[k + 1] + m + mb;
  }
  // irrelevant[k]: a backlog after layer k's release point at most this large never
  // delays the first reload, whatever the later layers choose: it is drained by the work
  // that runs before that reload (forwards after it, net of the copies they queue, the
  // tail, the backwards above the last offload + 1), whichever layer m >= k offloads last.
  std::vector<double> irrelevant(n + 1, 0.0);
  {
    // The most a layer's deferred bytes add to the queue at the next release point.
    std::vector<double> most_deferred(n + 1, 0.0);
    for (size_t j = 0; j < n; ++j) {
      for (size_t o = 0; o < s; ++o) {
        if (allowed[j] >> o & 1) {
          most_deferred[j] =
              std::max(most_deferred[j], p.d2h.seconds(p.effective(j, o).deferred_bytes));
        }
      }
    }
    // Least forward less the copies queued at its release point, per layer.
    std::vector<double> net(n, 0.0);
    for (size_t j = 0; j < n; ++j) {
      double v = kInf;
      for (size_t o = 0; o < s; ++o) {
        if (!(allowed[j] >> o & 1)) continue;
        const OptionCost c = p.effective(j, o);
        v = std::min(v, c.forward_seconds - p.d2h.seconds(c.offload_bytes));
      }
      net[j] = v - (j > 0 ? most_deferred[j - 1] : 0.0);
    }
    for (size_t k = 0; k + 1 < n; ++k) {
      double best = kInf, along = 0.0;
      for (size_t m = k; m + 1 < n; ++m) {
        if (m > k) along += net[m];
        best = std::min(best, along + min_fwd[m + 1] - most_deferred[m] + rest[m + 2]);
      }
      irrelevant[k] = best;
    }
  }

  // The slack of each pruning: over the n layers at most tolerance x a lower bound of
  // every plan's step time (Planner.h).
  const double eps = tolerance * (rest[0] + p.outside_seconds) / static_cast<double>(n);
  const double tail_and_outside = p.tail_seconds + p.outside_seconds;
  int64_t visited = 0;  // front entries prune() visited
  std::vector<std::vector<Back>> history(n);
  std::vector<Label> cur{Label{0, 0, 0.0, 0.0, 0, -1, -1, kNoOffload}}, next;
  std::vector<OptionCost> cost(s);
  std::vector<int32_t> slots, counts;  // prune_capped's bins
  for (size_t k = 0; k < n; ++k) {
    for (size_t o = 0; o < s; ++o) cost[o] = p.effective(k, o);
    const bool last = k + 1 == n;
    const double free_draining = rest[k + 1];
    const double free_other = std::max(min_fwd[k + 1], irrelevant[k]);
    next.clear();
    for (size_t li = 0; li < cur.size(); ++li) {
      const Label& base = cur[li];
      // Offload bytes of layers k-1 .. k-depth (prefetched when Lk's backward starts).
      int64_t window = 0, prev_off = 0;
      uint64_t code = base.code;
      for (int i = 0; i < depth && static_cast<int64_t>(k) - 1 - i >= 0; ++i, code /= radix_) {
        const int64_t off = class_bytes_[k - 1 - i][code % radix_];
        window += off;
        if (i == 0) prev_off = off;
      }
      // The previous layer's deferred bytes are on the device until Lk's release point
      // (Planner.h, deferred bytes).
      const int64_t pending =
          k > 0 && base.option >= 0
              ? p.layers[k - 1][static_cast<size_t>(base.option)].deferred_bytes
              : 0;
      // Their copy queues at Lk's release point, behind Lk's own offload (Planner.h).
      const double pending_copy = p.d2h.seconds(pending);
      for (size_t o = 0; o < s; ++o) {
        if (!(allowed[k] >> o & 1)) continue;
        const OptionCost& c = cost[o];
        const int64_t off = c.group_bytes();
        const int64_t held = p.base_bytes + base.kept;
        // The sample points of CostModel.h that involve layer k. The shared charge: the
        // first layer (>= 1) of an option no earlier layer ran keeps its shared bytes.
        // The boundary charge: what it saves of its input's storage that the layer before
        // did not (base.credit: what that one saved of it, CostModel.h).
        const int64_t in = p.layers[k][o].input_bytes;
        const int64_t kept =
            c.kept_bytes + (k > 0 && !(base.used >> o & 1) ? p.layers[k][o].shared_bytes : 0) +
            (in > 0 ? std::max<int64_t>(0, in - base.credit) : 0);
        if (held + pending + kept + off > budget) continue;              // end of its forward
        int64_t slack = kNoSlack;
        if (track_held) {  // start of its backward
          slack = std::min(base.slack - std::min(c.held_bytes, kept),
                           budget - (held + kept + off + window + p.tail_held_bytes));
          if (slack < least_later[k]) continue;
          if (slack >= most_later[k]) slack = kNoSlack;
        } else if (held + kept + off + window + after[k] > budget) {
          continue;  // start of its backward
        }
        if (last && held + kept + p.tail_bytes > budget) continue;       // end of forward
        if (base.host + off > host_cap) continue;
        if (!last && !completes(k, base.kept + kept, base.host + off)) continue;
        // Host bytes matter only under a host budget (otherwise they would split fronts).
        // Relaxed: bytes rounded down and no D2H backlog (a lower bound, Planner.h).
        const auto round = relaxed ? round_down : round_up;
        Label l{round(base.kept + kept, quantum),
                host_budget < 0 ? 0 : round(base.host + off, quantum),
                0.0, 0.0,
                depth > 0 ? class_of_[k][o] + radix_ * (base.code % keep_mod) : 0,
                static_cast<int32_t>(li), static_cast<int16_t>(o), kNoOffload,
                c.deferred_bytes, slack, (base.used | uint64_t{1} << o) & charged_later[k],
                std::min(c.output_bytes, most_input[k + 1])};
        if (memory_only) {
          next.push_back(l);
          continue;
        }
        const bool offloads = off > 0;
        l.time = base.time + c.forward_seconds + c.backward_seconds +
                 kTrafficSecondsPerByte * static_cast<double>(off);
        const double prev_h2d = p.h2d.seconds(prev_off);
        auto add = [&](Label x, int8_t phase) {
          const double free = phase == kDraining ? free_draining : free_other;
          if (relaxed || x.backlog <= free) x.backlog = 0.0;
          x.phase = phase;
          if (cutoff != nullptr) {
            // The least time any completion of x can take: beyond the cut-off, x leads to no
            // plan within it.
            const int64_t bin = x.kept / cutoff->rest->bin_bytes;
            // Past the last offload (kLastChosen: Lk was it), no later layer offloads.
            const bool resident = phase == kLastChosen || phase == kDraining;
            const double left =
                (resident ? cutoff->rest->resident : cutoff->rest->seconds)[k + 1]
                    [static_cast<size_t>(bin) * radix_ + (depth > 0 ? x.code % radix_ : 0)];
            // Draining, the wait of the first reload is at least the backlog less the most
            // work left before it (rest_bound() counts no wait).
            const double wait =
                phase == kDraining ? std::max(0.0, x.backlog - most[k + 1]) : 0.0;
            double bound = left + wait;
            if (!cutoff->rest->linear.empty()) {
              const int64_t lbin = x.kept / cutoff->rest->linear_bin_bytes;
              bound = std::max(
                  bound, x.backlog + cutoff->rest->linear[k + 1][(static_cast<size_t>(lbin) * radix_ +
                                                                 (depth > 0 ? x.code % radix_ : 0)) * 4 +
                                                                static_cast<size_t>(phase)]);
            }
            if (x.time + bound + tail_and_outside > cutoff->seconds) return;
          }
          next.push_back(x);
        };
        if (base.phase == kNoOffload || base.phase == kMoreToCome) {
          // A reload other than the first of the backward: only its own window counts.
          if (exposed) l.time += p.h2d.seconds(off);
          else if (prev_off > 0) l.time += std::max(0.0, prev_h2d - c.backward_seconds);
          // Lk's own offload, then the previous layer's deferred bytes (two copies).
          l.backlog = std::max(0.0, base.backlog - c.forward_seconds) +
                      p.d2h.seconds(c.offload_bytes) + pending_copy;
          if (offloads) {
            add(l, kMoreToCome);
            if (c.deferred_bytes == 0 && pending_copy > 0) {
              // Lk offloads last and defers nothing: its reload waits for its own copy
              // only, and the previous layer's deferred copy, last in the queue, delays
              // only that layer's reload, which runs after Lk's reload and (depth 1) Lk's
              // backward beyond it: up to that much of the copy is hidden (Planner.h).
              const double hidden =
                  p.h2d.seconds(off) + (exposed ? c.backward_seconds
                                                : std::max(0.0, c.backward_seconds - prev_h2d));
              Label first = l;
              first.backlog = std::max(0.0, l.backlog - std::min(pending_copy, hidden));
              add(first, kLastChosen);
            } else {
              add(l, kLastChosen);
            }
          } else {
            add(l, base.phase);
          }
        } else if (offloads) {
          continue;  // the last offload was already chosen
        } else if (base.phase == kLastChosen) {
          // The first reload of the backward: it waits for the D2H backlog left after
          // the forwards, tail and backwards that run before it is needed; the last
          // offloading layer's deferred bytes join the queue at this release point.
          const double queue = pending_copy > 0
                                   ? std::max(0.0, base.backlog - c.forward_seconds) + pending_copy
                                   : base.backlog - c.forward_seconds;
          if (exposed) {
            l.backlog = std::max(0.0, queue - c.backward_seconds);
          } else {
            const double slack = prev_h2d - c.backward_seconds;
            const double now = std::max(0.0, slack);
            l.time += now;
            l.backlog = std::max(0.0, queue + slack - now);
          }
          add(l, kDraining);
        } else {  // kDraining
          l.backlog = std::max(0.0, base.backlog - c.forward_seconds - c.backward_seconds);
          add(l, kDraining);
        }
      }
    }
    result.stats.labels_created += static_cast<int64_t>(next.size());
    if (bucket > 0) {
      const int64_t host_bucket =
          host_budget < 0 ? 0 : std::max<int64_t>(1, host_budget / kFallbackHostBins);
      const int64_t host_bins = host_budget < 0 ? 1 : host_budget / host_bucket + 1;
      if (prune_capped(next, most[k + 1], bucket, (budget - p.base_bytes) / bucket + 1,
                       host_bucket, host_bins, per_kept,
                       depth == 1 ? &class_bytes_[k] : nullptr, slots, counts)) {
        result.stats.truncated = true;
      }
    } else {
      prune(next, memory_only ? 0.0 : eps, memory_only ? kInf : most[k + 1], per_kept,
            depth == 1 ? &class_bytes_[k] : nullptr, visited);
    }
    result.stats.labels_kept += static_cast<int64_t>(next.size());
    result.stats.widest_layer = std::max<int64_t>(result.stats.widest_layer,
                                                  static_cast<int64_t>(next.size()));
    const int64_t limit =
        labels_per_layer > 0
            ? std::min<int64_t>(max_labels, labels_per_layer * static_cast<int64_t>(k + 1))
            : max_labels;
    if (max_labels >= 0 && static_cast<int64_t>(next.size()) > limit) {
      result.stats.overflowed = true;
      return result;
    }
    // A search with a cut-off also gives up once its fronts hold mostly labels with a D2H
    // backlog (scanned, not in the staircase): the backlog is what the cut-off's bound
    // leaves out, so such a search rarely finds a plan within it (copies slower than the
    // forwards: measured 240-440 entries visited per label created, against 0-71 where
    // the cut-off search succeeds; 0.4 s spent for nothing on 100 such layers).
    if (cutoff != nullptr && cutoff->created_limit >= 0 &&
        result.stats.labels_created > cutoff->created_limit) {
      result.stats.overflowed = true;
      return result;
    }
    if (cutoff != nullptr && cutoff->rest != nullptr && result.stats.labels_created > kCutScanFloor &&
        visited > kCutScanPerLabel * result.stats.labels_created) {
      result.stats.overflowed = true;
      return result;
    }
    history[k].resize(next.size());
    for (size_t i = 0; i < next.size(); ++i) history[k][i] = Back{next[i].parent, next[i].option};
    std::swap(cur, next);
    if (cur.empty()) return result;
  }

  int32_t best = -1;
  double best_time = 0.0;
  for (size_t i = 0; i < cur.size(); ++i) {
    const Label& l = cur[i];
    if (l.phase == kMoreToCome || l.phase == kLastChosen) continue;
    const double t = l.time + (l.phase == kDraining ? std::max(0.0, l.backlog - p.tail_seconds)
                                                    : 0.0);
    if (best < 0 || t < best_time) {
      best = static_cast<int32_t>(i);
      best_time = t;
    }
  }
  if (best < 0) return result;
  result.feasible = true;
  result.stats.objective = best_time + p.tail_seconds + p.outside_seconds;
  auto plan_of = [&](size_t label) {
    std::vector<int> a(n, 0);
    for (size_t k = n, at = label; k-- > 0;) {
      a[k] = history[k][at].option;
      at = static_cast<size_t>(history[k][at].parent);
    }
    return a;
  };
  result.assignment = plan_of(static_cast<size_t>(best));
  result.prediction = evaluate(p, result.assignment);
  if (memory_only) {
    // Every final label meets the budgets (no time to choose by): the plan of least peak
    // among the first kPeakCandidates, whose peak min_peak() takes as a budget met (the
    // first label's alone left its bisection 15 exact probes on a tester's profile).
    size_t tried = 0;
    for (size_t i = 0; i < cur.size() && tried < kPeakCandidates; ++i) {
      if (cur[i].phase == kMoreToCome || cur[i].phase == kLastChosen ||
          static_cast<int32_t>(i) == best) {
        continue;
      }
      ++tried;
      std::vector<int> a = plan_of(i);
      const Prediction e = evaluate(p, a);
      if (e.peak_bytes < result.prediction.peak_bytes) {
        result.assignment = std::move(a);
        result.prediction = e;
      }
    }
  }
  return result;
}

}  // namespace hyper_parallel::planner
