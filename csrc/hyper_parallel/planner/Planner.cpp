#include "hyper_parallel/planner/Planner.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hyper_parallel::planner {

namespace {

// Phases of the search (see Planner.h).
enum Phase : int {
  kNoOffload = 0,    // no layer offloaded yet
  kMoreToCome = 1,   // offloads happened; the last one is still ahead
  kLastChosen = 2,   // the previous layer is the last one that offloads
  kDraining = 3,     // after that layer's successor: the backlog drains
  kPhases = 4,
};

struct Label {
  double time;     // predicted seconds so far + kTrafficSecondsPerByte * traffic
  int64_t traffic;
  double backlog;  // D2H queue (kNoOffload..kLastChosen) or remaining wait (kDraining)
  int32_t parent;
  int32_t option;
};

int64_t ceil_div(int64_t a, int64_t b) { return a <= 0 ? 0 : (a + b - 1) / b; }


// Per-layer, per-option values the search uses.
struct Column {
  int64_t kept_q, off_q;
  double fwd, bwd, d2h, h2d;
  int64_t off;
};

}  // namespace

Planner::Planner(StepProfile profile, int grid, double time_quantum_seconds)
    : profile_(std::move(profile)), grid_(grid), time_quantum_(time_quantum_seconds) {
  profile_.validate();
  HP_CHECK_VALUE(grid >= 16 && grid <= (1 << 20), "planner grid must be in [16, 2**20], got ",
                 grid);
  HP_CHECK_VALUE(std::isfinite(time_quantum_) && time_quantum_ >= 0.0,
                 "planner time quantum must be finite and >= 0, got ", time_quantum_seconds);
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

bool Planner::fits(int64_t budget, int64_t quantum, const std::vector<uint64_t>& allowed) const {
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  if (budget < p.base_bytes) return false;
  const int64_t cap = (budget - p.base_bytes) / quantum;
  const int64_t tail_q = ceil_div(p.tail_bytes, quantum);
  const size_t width = s + 1;  // previous option, or s for "none before layer 0"
  std::vector<char> cur((cap + 1) * width, 0), nxt;
  cur[s] = 1;
  std::vector<int64_t> prev_off(width, 0);
  for (size_t k = 0; k < n; ++k) {
    nxt.assign(cur.size(), 0);
    std::vector<int64_t> kq(s), oq(s);
    for (size_t o = 0; o < s; ++o) {
      const OptionCost c = p.effective(k, o);
      kq[o] = ceil_div(c.kept_bytes, quantum);
      oq[o] = ceil_div(c.offload_bytes, quantum);
    }
    for (int64_t mem = 0; mem <= cap; ++mem) {
      for (size_t pr = 0; pr < width; ++pr) {
        if (!cur[mem * width + pr]) continue;
        for (size_t o = 0; o < s; ++o) {
          if (!(allowed[k] >> o & 1)) continue;
          const int64_t next = mem + kq[o];
          if (mem + kq[o] + oq[o] > cap || next + oq[o] + prev_off[pr] > cap) continue;
          if (k + 1 == n && next + tail_q > cap) continue;
          nxt[next * width + o] = 1;
        }
      }
    }
    std::swap(cur, nxt);
    for (size_t o = 0; o < s; ++o) prev_off[o] = oq[o];
    prev_off[s] = 0;
  }
  return std::any_of(cur.begin(), cur.end(), [](char c) { return c != 0; });
}

PlanResult Planner::solve(int64_t budget, const std::vector<uint64_t>& allowed) const {
  const std::vector<uint64_t> m = masks(allowed);
  if (budget <= profile_.base_bytes) return {};
  const int64_t quantum = std::max<int64_t>(1, ceil_div(budget - profile_.base_bytes, grid_));
  int64_t target = budget;
  for (int attempt = 0; attempt < 6 && target > profile_.base_bytes; ++attempt) {
    PlanResult r = solve_on_grid(target, quantum, m, /*conservative=*/false);
    if (!r.feasible || r.prediction.peak_bytes <= budget) {
      if (r.feasible || attempt == 0) return r.feasible ? r : solve_on_grid(budget, quantum, m);
      break;
    }
    target -= r.prediction.peak_bytes - budget + quantum;
  }
  return solve_on_grid(budget, quantum, m);
}

PlanResult Planner::min_peak(const std::vector<uint64_t>& allowed) const {
  const std::vector<uint64_t> m = masks(allowed);
  const StepProfile& p = profile_;
  // An upper bound of every plan's peak: each sample point is at most this.
  int64_t upper = p.base_bytes + p.tail_bytes;
  for (size_t k = 0; k < p.num_layers(); ++k) {
    int64_t most = 0;
    for (size_t o = 0; o < p.num_options(); ++o) {
      const OptionCost c = p.effective(k, o);
      most = std::max(most, c.kept_bytes + c.offload_bytes);
    }
    upper += 2 * most;
  }
  const int64_t quantum = std::max<int64_t>(1, ceil_div(upper - p.base_bytes, grid_));
  int64_t lo = 0, hi = ceil_div(upper - p.base_bytes, quantum);  // in quanta above base
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (fits(p.base_bytes + mid * quantum, quantum, m)) hi = mid;
    else lo = mid + 1;
  }
  return solve_on_grid(p.base_bytes + lo * quantum, quantum, m);
}

PlanResult Planner::solve_on_grid(int64_t budget, int64_t quantum,
                                  const std::vector<uint64_t>& allowed, bool conservative) const {
  auto q = [&](int64_t bytes) {
    return conservative ? ceil_div(bytes, quantum) : (bytes + quantum / 2) / quantum;
  };
  const StepProfile& p = profile_;
  const size_t n = p.num_layers(), s = p.num_options();
  PlanResult result;
  if (budget < p.base_bytes) return result;
  const int64_t cap = (budget - p.base_bytes) / quantum;
  const int64_t tail_q = q(p.tail_bytes);
  const size_t width = s + 1;
  auto cell = [&](int64_t mem, size_t prev, int phase) {
    return (static_cast<size_t>(mem) * width + prev) * kPhases + static_cast<size_t>(phase);
  };
  const size_t cells = static_cast<size_t>(cap + 1) * width * kPhases;

  std::vector<Label> labels;
  labels.push_back(Label{0.0, 0, 0.0, -1, -1});
  std::vector<std::vector<int32_t>> cur(cells), nxt(cells);
  std::vector<size_t> touched{cell(0, s, kNoOffload)}, next_touched;
  cur[touched[0]].push_back(0);

  // Per layer: the least forward time and the least work (forward + backward) left from
  // it on, over its allowed options; a backlog that these surely drain is as good as none.
  std::vector<double> min_fwd(n + 1, 0.0), rest(n + 1, p.tail_seconds);
  for (size_t k = n; k-- > 0;) {
    double f = std::numeric_limits<double>::infinity(), w = f;
    for (size_t o = 0; o < s; ++o) {
      if (!(allowed[k] >> o & 1)) continue;
      f = std::min(f, p.layers[k][o].forward_seconds);
      w = std::min(w, p.layers[k][o].forward_seconds + p.layers[k][o].backward_seconds);
    }
    min_fwd[k] = f;
    rest[k] = rest[k + 1] + w;
  }
  // irrelevant[k]: a backlog after layer k's release point at most this large never
  // delays the first reload, whatever the later layers choose: it is drained by the work
  // that runs before that reload (forwards after it, net of the copies they queue, the
  // tail, the backwards above the last offload + 1), whichever layer m >= k offloads last.
  std::vector<double> irrelevant(n + 1, 0.0);
  {
    std::vector<double> net(n, 0.0);  // least forward - copy per layer
    for (size_t j = 0; j < n; ++j) {
      double v = std::numeric_limits<double>::infinity();
      for (size_t o = 0; o < s; ++o) {
        if (!(allowed[j] >> o & 1)) continue;
        const OptionCost c = p.effective(j, o);
        v = std::min(v, c.forward_seconds - p.d2h.seconds(c.offload_bytes));
      }
      net[j] = v;
    }
    for (size_t k = 0; k + 1 < n; ++k) {
      double best = std::numeric_limits<double>::infinity(), along = 0.0;
      for (size_t m = k; m + 1 < n; ++m) {
        if (m > k) along += net[m];
        best = std::min(best, along + min_fwd[m + 1] + rest[m + 2]);
      }
      irrelevant[k] = best;
    }
  }
  size_t layer = 0;  // the layer whose labels are being created
  auto insert = [&](size_t at, Label l) {
    const int phase = static_cast<int>(at % kPhases);
    const double free = phase == kDraining ? rest[layer + 1]
                                           : std::max(min_fwd[layer + 1], irrelevant[layer]);
    if (l.backlog <= free) {
      l.backlog = 0.0;
    } else if (time_quantum_ > 0.0) {
      l.backlog = std::ceil(l.backlog / time_quantum_ - 1e-9) * time_quantum_;
    }
    std::vector<int32_t>& front = nxt[at];
    for (int32_t i : front) {
      const Label& o = labels[i];
      if (o.time <= l.time && o.backlog <= l.backlog) return;
    }
    if (front.empty()) next_touched.push_back(at);
    front.erase(std::remove_if(front.begin(), front.end(),
                               [&](int32_t i) {
                                 const Label& o = labels[i];
                                 return l.time <= o.time && l.backlog <= o.backlog;
                               }),
                front.end());
    front.push_back(static_cast<int32_t>(labels.size()));
    labels.push_back(l);
  };

  std::vector<Column> prev_col(width, Column{0, 0, 0.0, 0.0, 0.0, 0.0, 0});
  std::vector<Column> col(s);
  for (size_t k = 0; k < n; ++k) {
    layer = k;
    for (size_t o = 0; o < s; ++o) {
      const OptionCost c = p.effective(k, o);
      col[o] = Column{q(c.kept_bytes), q(c.offload_bytes),
                      c.forward_seconds, c.backward_seconds, p.d2h.seconds(c.offload_bytes),
                      p.h2d.seconds(c.offload_bytes), c.offload_bytes};
    }
    const bool last = k + 1 == n;
    for (size_t at : touched) {
      const int phase = static_cast<int>(at % kPhases);
      const size_t prev = (at / kPhases) % width;
      const int64_t mem = static_cast<int64_t>(at / kPhases / width);
      const Column& pc = prev_col[prev];
      for (int32_t li : cur[at]) {
        const Label base = labels[li];
        for (size_t o = 0; o < s; ++o) {
          if (!(allowed[k] >> o & 1)) continue;
          const Column& c = col[o];
          const int64_t next_mem = mem + c.kept_q;
          if (mem + c.kept_q + c.off_q > cap || next_mem + c.off_q + pc.off_q > cap) continue;
          if (last && next_mem + tail_q > cap) continue;
          Label l{base.time + c.fwd + c.bwd + kTrafficSecondsPerByte * static_cast<double>(c.off),
                  base.traffic + c.off, 0.0, li, static_cast<int32_t>(o)};
          const bool offloads = c.off > 0;
          if (phase == kNoOffload || phase == kMoreToCome) {
            // A reload other than the first of the backward: only its own window counts.
            if (pc.off > 0) l.time += std::max(0.0, pc.h2d - c.bwd);
            l.backlog = std::max(0.0, base.backlog - c.fwd) + c.d2h;
            if (offloads) {
              insert(cell(next_mem, o, kMoreToCome), l);
              insert(cell(next_mem, o, kLastChosen), l);
            } else {
              insert(cell(next_mem, o, phase), l);
            }
          } else if (offloads) {
            continue;  // the last offload was already chosen
          } else if (phase == kLastChosen) {
            // The first reload of the backward: it waits for the D2H backlog left after
            // the forwards, tail and backwards that run after the offload.
            const double slack = pc.h2d - c.bwd;
            const double now = std::max(0.0, slack);
            l.time += now;
            l.backlog = std::max(0.0, base.backlog - c.fwd + slack - now);
            insert(cell(next_mem, o, kDraining), l);
          } else {  // kDraining
            l.backlog = std::max(0.0, base.backlog - c.fwd - c.bwd);
            insert(cell(next_mem, o, kDraining), l);
          }
        }
      }
      cur[at].clear();
    }
    std::swap(cur, nxt);
    std::swap(touched, next_touched);
    next_touched.clear();
    for (size_t o = 0; o < s; ++o) prev_col[o] = col[o];
  }

  int32_t best = -1;
  double best_time = 0.0;
  for (size_t at : touched) {
    const int phase = static_cast<int>(at % kPhases);
    if (phase == kMoreToCome || phase == kLastChosen) continue;
    for (int32_t li : cur[at]) {
      const Label& l = labels[li];
      const double t =
          l.time + (phase == kDraining ? std::max(0.0, l.backlog - p.tail_seconds) : 0.0);
      if (best < 0 || t < best_time) {
        best = li;
        best_time = t;
      }
    }
  }
  if (best < 0) return result;
  result.feasible = true;
  std::vector<int> reversed;
  for (int32_t li = best; labels[li].parent >= 0; li = labels[li].parent) {
    reversed.push_back(labels[li].option);
  }
  HP_INTERNAL_ASSERT(reversed.size() == n, "planner backtrack found ", reversed.size(),
                     " layers for ", n);
  std::reverse(reversed.begin(), reversed.end());
  result.assignment = std::move(reversed);
  result.prediction = evaluate(p, result.assignment);
  return result;
}

}  // namespace hyper_parallel::planner
