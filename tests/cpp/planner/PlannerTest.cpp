#include "hyper_parallel/planner/Planner.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <initializer_list>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace hyper_parallel::planner {
namespace {

constexpr int64_t kMiB = 1 << 20;

// A synthetic profile of `n` layers with four options shaped like the real strategies:
// none (all kept), checkpoint (inputs kept, recompute), selective (inputs + matmul outputs
// kept, less recompute) and swap (all offloaded). Bytes are whole MiB so that a grid of
// 1 MiB is exact; times are random so optima are unique.
StepProfile synthetic(size_t n, uint32_t seed, double copy_ratio) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> mib(4, 40);
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  StepProfile p;
  p.options = {"none", "checkpoint", "selective", "swap"};
  p.base_bytes = 2 * kMiB;
  p.tail_bytes = 16 * kMiB;
  p.outside_seconds = 0.01;
  p.tail_seconds = 0.004 * jitter(rng);
  p.d2h = CopyLink{1e-4, 0.0};
  p.h2d = CopyLink{1e-4, 0.0};
  double per_byte = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const int64_t saved = mib(rng) * kMiB;
    const int64_t inputs = std::max<int64_t>(kMiB, (saved / 8) / kMiB * kMiB);
    const int64_t matmul = std::max<int64_t>(kMiB, (saved / 3) / kMiB * kMiB);
    const double f = 0.01 * jitter(rng), b = 2 * f * jitter(rng);
    p.layers.push_back({
        OptionCost{saved, 0, f, b},
        OptionCost{inputs, 0, f, b + f * jitter(rng)},
        OptionCost{inputs + matmul, 0, f, b + 0.4 * f * jitter(rng)},
        OptionCost{inputs, saved - inputs, f * 1.05, b * 1.02},
    });
    per_byte += copy_ratio * f / static_cast<double>(saved - inputs);
  }
  p.d2h.seconds_per_byte = p.h2d.seconds_per_byte = per_byte / static_cast<double>(n);
  return p;
}

struct Best {
  bool found = false;
  double time = 0.0;
  int64_t traffic = 0;
  std::vector<int> assignment;
};

// Every assignment, evaluated by the event simulation: peak and host bytes by `p`, time
// by `timed` (the same profile, or one at another prefetch depth).
Best brute_force(const StepProfile& p, int64_t budget, int64_t host_budget = -1,
                 const StepProfile* timed = nullptr) {
  const size_t n = p.num_layers(), s = p.num_options();
  std::vector<int> a(n, 0);
  Best best;
  while (true) {
    const Prediction pr = evaluate(p, a);
    if (pr.peak_bytes <= budget && (host_budget < 0 || pr.host_peak_bytes <= host_budget)) {
      const double step = timed ? evaluate(*timed, a).step_seconds : pr.step_seconds;
      const double objective =
          step + kTrafficSecondsPerByte * static_cast<double>(pr.offload_bytes);
      if (!best.found || objective < best.time) {
        best = Best{true, objective, pr.offload_bytes, a};
      }
    }
    size_t k = 0;
    while (k < n && ++a[k] == static_cast<int>(s)) a[k++] = 0;
    if (k == n) break;
  }
  return best;
}

double objective_of(const PlanResult& r, const StepProfile* timed = nullptr) {
  const double step = timed ? evaluate(*timed, r.assignment).step_seconds
                            : r.prediction.step_seconds;
  return step + kTrafficSecondsPerByte * static_cast<double>(r.prediction.offload_bytes);
}

// No single layer's change to r's plan that meets `budget` is faster (objective_of()).
void expect_locally_optimal(const StepProfile& p, const PlanResult& r, int64_t budget) {
  const double got = objective_of(r);
  std::vector<int> a = r.assignment;
  for (size_t k = 0; k < a.size(); ++k) {
    const int was = a[k];
    for (size_t o = 0; o < p.num_options(); ++o) {
      a[k] = static_cast<int>(o);
      const Prediction e = evaluate(p, a);
      if (e.peak_bytes > budget) continue;
      EXPECT_GE(e.step_seconds + kTrafficSecondsPerByte * static_cast<double>(e.offload_bytes),
                got * (1 - 1e-12))
          << "layer " << k << " option " << o;
    }
    a[k] = was;
  }
}

int64_t peak_of(const StepProfile& p, int option) {
  return evaluate(p, std::vector<int>(p.num_layers(), option)).peak_bytes;
}

// The least peak of the plans whose host bytes are within `host` (< 0: unbounded); -1: none.
int64_t brute_force_min_peak(const StepProfile& p, int64_t host = -1) {
  const size_t n = p.num_layers(), s = p.num_options();
  std::vector<int> a(n, 0);
  int64_t best = -1;
  while (true) {
    const Prediction e = evaluate(p, a);
    const int64_t peak = e.peak_bytes;
    if ((host < 0 || e.host_peak_bytes <= host) && (best < 0 || peak < best)) best = peak;
    size_t k = 0;
    while (k < n && ++a[k] == static_cast<int>(s)) a[k++] = 0;
    if (k == n) break;
  }
  return best;
}

// solve(budget) is feasible exactly when brute force finds a plan, proven optimal, and as
// fast as brute force's optimum.
void expect_brute_force_optimum(const Planner& planner, const StepProfile& p, int64_t budget) {
  const PlanResult r = planner.solve(budget);
  const Best want = brute_force(p, budget);
  SCOPED_TRACE("budget " + std::to_string(budget));
  ASSERT_EQ(r.feasible, want.found);
  if (!r.feasible) return;
  EXPECT_TRUE(r.stats.exact);
  EXPECT_NEAR(objective_of(r), want.time, 1e-12 * want.time);
}

// Calls check(planner, budget) for prefetch depths 1 and 0, each seed and copy ratio of
// make(seed, ratio) and each budget, a fraction of "none"'s peak above the base bytes.
template <typename Make, typename Check>
void for_each_budget(std::initializer_list<uint32_t> seeds, std::initializer_list<double> ratios,
                     std::initializer_list<double> fractions, Make make, Check check) {
  for (int depth : {1, 0}) {
    for (uint32_t seed : seeds) {
      for (double ratio : ratios) {
        StepProfile p = make(seed, ratio);
        p.prefetch_depth = depth;
        const int64_t none = peak_of(p, 0);
        const Planner planner(p);
        for (double fraction : fractions) {
          const int64_t budget = p.base_bytes + static_cast<int64_t>(
              fraction * static_cast<double>(none - p.base_bytes));
          SCOPED_TRACE("depth " + std::to_string(depth) + " seed " + std::to_string(seed) +
                       " ratio " + std::to_string(ratio) + " fraction " +
                       std::to_string(fraction));
          check(planner, p, budget);
        }
      }
    }
  }
}

TEST(PlannerTest, MatchesBruteForceOnSixLayersFourOptions) {
  // 6 seeds x 4 copy speeds x 6 budgets x prefetch depths 0 and 1: the exact optimum.
  int feasible = 0;
  for_each_budget(
      {1, 2, 3, 4, 5, 6}, {0.5, 1.0, 2.0, 4.0}, {0.15, 0.25, 0.4, 0.6, 0.8, 1.0},
      [](uint32_t seed, double ratio) { return synthetic(6, seed, ratio); },
      [&](const Planner& planner, const StepProfile& p, int64_t budget) {
        const PlanResult got = planner.solve(budget);
        const Best want = brute_force(p, budget);
        ASSERT_EQ(got.feasible, want.found);
        if (!want.found) return;
        ++feasible;
        EXPECT_LE(got.prediction.peak_bytes, budget);
        EXPECT_NEAR(objective_of(got), want.time, 1e-12 * want.time);
        EXPECT_EQ(got.prediction.offload_bytes, want.traffic);
        ASSERT_TRUE(got.stats.exact);
        EXPECT_NEAR(got.stats.lower_bound, want.time, 1e-12 * want.time);
      });
  EXPECT_GT(feasible, 200);  // most of the 288 cases have a plan
}

TEST(PlannerTest, BacklogBoundHoldsAgainstBruteForce) {
  // The bound that counts the D2H backlog (its increments linearised) never exceeds the
  // optimum, at depths 0 and 1.
  int checked = 0;
  for_each_budget(
      {1, 2, 3, 4, 5, 6}, {1.0, 2.0, 4.0}, {0.15, 0.25, 0.4, 0.6, 1.0},
      [](uint32_t seed, double ratio) { return synthetic(6, seed, ratio); },
      [&](const Planner& planner, const StepProfile& p, int64_t budget) {
        const Best want = brute_force(p, budget);
        if (!want.found) return;
        ++checked;
        EXPECT_LE(planner.linear_lower_bound(budget), want.time * (1 + 1e-12));
      });
  EXPECT_GT(checked, 120);
  // Where every layer must swap and the copies take 4x the forwards, the D2H queue never
  // empties before the first reload, which waits for it: no max(0, .) the bound
  // linearises is ever at 0, so the bound is that plan's time; the relaxation without
  // the backlog misses the wait (measured 0.60-0.76 of the time).
  for (int depth : {1, 0}) {
    for (uint32_t seed = 1; seed <= 4; ++seed) {
      StepProfile p = synthetic(6, seed, 4.0);
      p.prefetch_depth = depth;
      const Planner planner(p);
      const std::vector<uint64_t> swap_only(p.num_layers(), uint64_t{1} << 3);
      const Prediction only = evaluate(p, std::vector<int>(p.num_layers(), 3));
      const double want =
          only.step_seconds + kTrafficSecondsPerByte * static_cast<double>(only.offload_bytes);
      const double bound = planner.linear_lower_bound(only.peak_bytes, swap_only);
      SCOPED_TRACE("depth " + std::to_string(depth) + " seed " + std::to_string(seed));
      EXPECT_LE(bound, want * (1 + 1e-12));
      EXPECT_NEAR(bound, want, 1e-9 * want);
      EXPECT_LT(planner.relaxed_lower_bound(only.peak_bytes, swap_only), 0.9 * want);
    }
  }
  // No plan fits below the base bytes; depth 2 has no bound.
  const StepProfile p = synthetic(6, 1, 2.0);
  EXPECT_TRUE(std::isinf(Planner(p).linear_lower_bound(p.base_bytes - 1)));
  StepProfile deep = p;
  deep.prefetch_depth = 2;
  EXPECT_TRUE(std::isnan(Planner(deep).linear_lower_bound(peak_of(p, 0))));
}

TEST(PlannerTest, HostBudgetMatchesBruteForce) {
  for (uint32_t seed = 1; seed <= 4; ++seed) {
    const StepProfile p = synthetic(6, seed, 1.0);
    const Planner planner(p);
    const int64_t none = peak_of(p, 0);
    const int64_t all_swap = evaluate(p, std::vector<int>(6, 3)).host_peak_bytes;
    for (double fraction : {0.3, 0.5, 0.8}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
      for (double host_fraction : {0.0, 0.25, 0.5, 0.75}) {
        const int64_t host = static_cast<int64_t>(host_fraction * static_cast<double>(all_swap));
        const PlanResult got = planner.solve(budget, {}, host);
        const Best want = brute_force(p, budget, host);
        SCOPED_TRACE("seed " + std::to_string(seed) + " fraction " + std::to_string(fraction) +
                     " host " + std::to_string(host_fraction));
        ASSERT_EQ(got.feasible, want.found);
        if (!want.found) continue;
        EXPECT_LE(got.prediction.host_peak_bytes, host);
        EXPECT_NEAR(objective_of(got), want.time, 1e-12 * want.time);
      }
    }
  }
  // No host memory at all: no layer may swap.
  const StepProfile p = synthetic(6, 9, 1.0);
  const PlanResult r = Planner(p).solve(peak_of(p, 0) / 2, {}, 0);
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.prediction.offload_bytes, 0);
}

TEST(PlannerTest, HostPricedBoundHoldsAgainstBruteForce) {
  // The fallback's bound under a host budget (host bytes priced into the time, the best of
  // the prices tried) never exceeds the optimum, at depths 0 and 1, and is no weaker than
  // the bound that ignores the host budget (price 0 is among those tried).
  int bounded = 0;
  for (int depth : {1, 0}) {
    for (uint32_t seed = 1; seed <= 4; ++seed) {
      for (double ratio : {0.5, 2.0}) {
        StepProfile p = synthetic(6, seed, ratio);
        p.prefetch_depth = depth;
        const Planner planner(p);
        const int64_t none = peak_of(p, 0);
        const int64_t all_swap = evaluate(p, std::vector<int>(6, 3)).host_peak_bytes;
        for (double fraction : {0.3, 0.5, 0.8}) {
          const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
          for (double host_fraction : {0.0, 0.2, 0.5}) {
            const int64_t host =
                static_cast<int64_t>(host_fraction * static_cast<double>(all_swap));
            SCOPED_TRACE("depth " + std::to_string(depth) + " seed " + std::to_string(seed) +
                         " ratio " + std::to_string(ratio) + " fraction " +
                         std::to_string(fraction) + " host " + std::to_string(host_fraction));
            const Best want = brute_force(p, budget, host);
            if (!want.found) continue;
            const double bound = planner.relaxed_lower_bound(budget, {}, host);
            ASSERT_TRUE(std::isfinite(bound));
            EXPECT_LE(bound, want.time * (1 + 1e-12));
            EXPECT_GE(bound, planner.relaxed_lower_bound(budget) * (1 - 1e-12));
            ++bounded;
          }
        }
      }
    }
  }
  EXPECT_GT(bounded, 80);
}

TEST(PlannerTest, DeeperPrefetchIsExactInMemoryAndBoundedInTime) {
  // Depth 2 and 3: the memory constraints are exact and the time the searches minimise is
  // the depth-1 time (an upper bound of the depth-d time of the same plan, Planner.h);
  // polish() then improves the plan's depth-d time, so it is never slower at depth d than
  // the depth-1 optimum, and it is not called optimal.
  int checked = 0;
  for (int depth : {2, 3}) {
    for (uint32_t seed = 1; seed <= 3; ++seed) {
      StepProfile p = synthetic(6, seed, 2.0);
      p.prefetch_depth = depth;
      StepProfile one = p;
      one.prefetch_depth = 1;
      const Planner planner(p);
      const int64_t none = peak_of(p, 0);
      for (double fraction : {0.3, 0.5, 0.8}) {
        const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
        const PlanResult got = planner.solve(budget);
        const Best want = brute_force(p, budget, -1, &one);
        ASSERT_EQ(got.feasible, want.found);
        if (!want.found) continue;
        ++checked;
        EXPECT_LE(got.prediction.peak_bytes, budget);
        const Prediction at_depth = evaluate(p, want.assignment);
        EXPECT_LE(objective_of(got),
                  (at_depth.step_seconds +
                   kTrafficSecondsPerByte * static_cast<double>(at_depth.offload_bytes)) *
                      (1 + 1e-12));
        EXPECT_FALSE(got.stats.exact);
        // The prediction is the depth-d one, never slower than the depth-1 time.
        EXPECT_LE(got.prediction.step_seconds, evaluate(one, got.assignment).step_seconds);
      }
    }
  }
  EXPECT_GT(checked, 10);
}

TEST(PlannerTest, LargerBudgetIsNeverSlower) {
  const StepProfile p = synthetic(12, 7, 1.5);
  const Planner planner(p);
  const int64_t none = peak_of(p, 0);
  double previous = std::numeric_limits<double>::infinity();
  bool any = false;
  for (int i = 1; i <= 40; ++i) {
    const PlanResult r = planner.solve(none * i / 40);
    if (!r.feasible) {
      EXPECT_FALSE(any) << "budget " << i << "/40 infeasible after a smaller one was feasible";
      continue;
    }
    any = true;
    EXPECT_LE(r.prediction.peak_bytes, none * i / 40);
    EXPECT_LE(r.prediction.step_seconds, previous * (1 + 1e-12));
    previous = r.prediction.step_seconds;
  }
  EXPECT_TRUE(any);
  // With the whole "none" peak available, nothing needs to change.
  const PlanResult all = planner.solve(none);
  EXPECT_EQ(all.assignment, std::vector<int>(12, 0));
}

TEST(PlannerTest, MinPeakIsReachableAndNothingSmallerIs) {
  const StepProfile p = synthetic(6, 3, 1.0);
  const Planner planner(p);
  const PlanResult low = planner.min_peak();
  ASSERT_TRUE(low.feasible);
  int64_t true_min = std::numeric_limits<int64_t>::max();
  std::vector<int> a(6, 0);
  for (int code = 0; code < 4096; ++code) {
    for (int k = 0, c = code; k < 6; ++k, c /= 4) a[k] = c % 4;
    true_min = std::min(true_min, evaluate(p, a).peak_bytes);
  }
  EXPECT_EQ(low.prediction.peak_bytes, true_min);
  EXPECT_TRUE(planner.solve(true_min).feasible);
  EXPECT_FALSE(planner.solve(true_min - 1).feasible);
  // A byte quantum rounds up: never below the true minimum, within a few quanta of it.
  const int64_t q = kMiB / 3;
  const PlanResult coarse = Planner(p, q).min_peak();
  ASSERT_TRUE(coarse.feasible);
  EXPECT_GE(coarse.prediction.peak_bytes, true_min);
  EXPECT_LE(coarse.prediction.peak_bytes - true_min, 9 * q);
}

TEST(PlannerTest, StallsWhenCopiesOutgrowTheirWindows) {
  // Two layers swap; with a slow link the D2H backlog delays the first reload.
  StepProfile p;
  p.options = {"none", "swap"};
  p.layers = {{OptionCost{10, 0, 1.0, 2.0}, OptionCost{0, 10, 1.0, 2.0}},
              {OptionCost{10, 0, 1.0, 2.0}, OptionCost{0, 10, 1.0, 2.0}},
              {OptionCost{10, 0, 1.0, 2.0}, OptionCost{0, 10, 1.0, 2.0}}};
  p.d2h = CopyLink{0.0, 0.5};  // 5 s per layer
  p.h2d = CopyLink{0.0, 0.1};  // 1 s per layer
  // Forward ends at 3; D2H of L0 runs 1..6, of L1 6..11; L2's backward starts at 3 and
  // ends at 5; L1's reload waits for its D2H: 11..12; L1 backward 12..14; L0's reload
  // 12..13 hides under it; L0 backward 14..16.
  const Prediction pr = evaluate(p, {1, 1, 1});
  EXPECT_DOUBLE_EQ(pr.step_seconds, 16.0);
  EXPECT_DOUBLE_EQ(pr.stall_seconds, 7.0);
  EXPECT_EQ(pr.offload_bytes, 20);  // the last layer keeps its bytes
  // Peak: end of L2's forward holds L2's 10 bytes; L1's backward start holds L1 and the
  // prefetched L0.
  EXPECT_EQ(pr.peak_bytes, 20);
  EXPECT_TRUE(pr.peak_in_backward);
  // Depth 0: each reload is issued at its own layer's backward: L1's 11..12 (after its
  // D2H), L0's 14..15 (exposed): 17 s, and only one layer's reload is held at a time.
  StepProfile d0 = p;
  d0.prefetch_depth = 0;
  const Prediction exposed = evaluate(d0, {1, 1, 1});
  EXPECT_DOUBLE_EQ(exposed.step_seconds, 17.0);
  EXPECT_EQ(exposed.peak_bytes, 10);
  // Depth 2: L2's backward start issues L1 (11..12) and L0 (12..13): the same 16 s here,
  // but both reloads are held with L2's bytes: 30 bytes.
  StepProfile d2 = p;
  d2.prefetch_depth = 2;
  const Prediction deep = evaluate(d2, {1, 1, 1});
  EXPECT_DOUBLE_EQ(deep.step_seconds, 16.0);
  EXPECT_EQ(deep.peak_bytes, 30);
  const Prediction none = evaluate(p, {0, 0, 0});
  EXPECT_DOUBLE_EQ(none.step_seconds, 9.0);
  EXPECT_EQ(none.peak_bytes, 30);
  // Under a 20-byte budget only L0 may swap (swapping L1 puts L2 and the prefetched L1
  // at 30 bytes at L2's backward start): D2H 1..6, L2's backward 3..5, the reload of L0
  // waits for its D2H (6..7) as long as L1's backward (5..7) runs: no stall, 9 s.
  // (Swapping L2 too is the same plan: the last layer keeps its bytes.)
  const Planner planner(p);
  const PlanResult r = planner.solve(20);
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.assignment[0], 1);
  EXPECT_EQ(r.assignment[1], 0);
  EXPECT_DOUBLE_EQ(r.prediction.step_seconds, 9.0);
  EXPECT_EQ(r.prediction.peak_bytes, 20);
  EXPECT_FALSE(planner.solve(19).feasible);
}

TEST(PlannerTest, OffloadWindowKeepsTheLayersWhoseOffloadsWaitAtTheTurn) {
  // 8 layers of 1 s forward, 1000 offloaded bytes each, D2H 2 s per layer; window 2.
  // Forward ends: layer k at k + 1. 0 goes at 1 (done 3), 1 at 2 (3..5), 2 at 3 once 0
  // finished (5..7); 3 waits at 4 (window full) and goes at 5 (7..9); 4 and 5 wait; the
  // release points of layers 6 and 7 are near the turn, so nothing more goes: 4, 5, 6 stay
  // on device with the last layer 7.
  StepProfile p;
  p.options = {"none", "swap"};
  for (int k = 0; k < 8; ++k) {
    p.layers.push_back({OptionCost{1000, 0, 1.0, 2.0}, OptionCost{0, 1000, 1.0, 2.0}});
  }
  p.d2h = CopyLink{0.0, 0.002};
  p.h2d = CopyLink{0.0, 0.001};
  const std::vector<int> swap_all(8, 1);
  p.offload_window = 2;
  const Prediction w = evaluate(p, swap_all);
  EXPECT_EQ(w.offload_bytes, 4000);
  EXPECT_EQ(w.host_peak_bytes, 4000);
  EXPECT_EQ(w.peak_bytes, 4000);  // from the last layer's forward end on: layers 4..7
  EXPECT_EQ(w.peak_layer, 7);
  EXPECT_FALSE(w.peak_in_backward);
  // Backward: 7, 6, 5, 4 need no reload (8 s from the turn at 8); 3's reload is issued
  // when 4's backward begins (at 14; D2H done 9): 14..15 under 4's backward (14..16);
  // 2, 1, 0 follow likewise: no stall, 8 + 16 = 24 s.
  EXPECT_DOUBLE_EQ(w.step_seconds, 24.0);
  EXPECT_DOUBLE_EQ(w.stall_seconds, 0.0);
  // Without a window every release submits at once: 7 layers offloaded, the D2H backlog
  // (done at 3, 5, .., 15) delays the first reloads.
  p.offload_window = 0;
  const Prediction fifo = evaluate(p, swap_all);
  EXPECT_EQ(fifo.offload_bytes, 7000);
  EXPECT_EQ(fifo.peak_bytes, 2000);
  EXPECT_GT(fifo.stall_seconds, 0.0);
  p.offload_window = 2;
  // The planner solves for window 0 only; a bad window is refused.
  EXPECT_THROW(Planner{p}, c10::ValueError);
  p.offload_window = -1;
  EXPECT_THROW(evaluate(p, swap_all), c10::ValueError);
}

// Deferred bytes (CostModel.h): a layer input its caller still holds at the layer's
// release point leaves at the next release point and is reloaded with its own layer.
TEST(PlannerTest, DeferredBytesLeaveAtTheNextReleasePointAndReloadWithTheirLayer) {
  // L0 swaps all but 50 bytes (its input stays: the model holds it); L1 offloads 1000 at
  // its release point and defers its 100-byte input; L2 is the last layer (its bytes
  // stay) but its end is a release point: L1's input leaves there.
  StepProfile p;
  p.options = {"none", "swap"};
  p.layers = {{OptionCost{1050, 0, 1.0, 2.0}, OptionCost{50, 1000, 1.0, 2.0}},
              {OptionCost{1100, 0, 1.0, 2.0}, OptionCost{0, 1000, 1.0, 2.0, 100}},
              {OptionCost{1100, 0, 1.0, 0.5}, OptionCost{0, 1000, 1.0, 0.5, 100}}};
  p.d2h = CopyLink{0.0, 0.001};
  p.h2d = CopyLink{0.0, 0.001};
  const Prediction r = evaluate(p, {1, 1, 1});
  // Forward points: 1050; 50 + 1100; 150 + 1100 (L1's input still on the device). At
  // L2's backward: L0's 50, L2's 1100 and L1's reload of 1000 + 100 = 2250.
  EXPECT_EQ(r.peak_bytes, 2250);
  EXPECT_EQ(r.peak_layer, 2);
  EXPECT_TRUE(r.peak_in_backward);
  EXPECT_EQ(r.offload_bytes, 2100);
  EXPECT_EQ(r.host_peak_bytes, 2100);
  // D2H: L0 1..2, L1 2..3, L1's input 3..3.1 (after L2's forward). L1's reload, issued at
  // the turn (3), waits for that copy: 3.1..4.2; L2's backward ends at 3.5, so L1 stalls
  // 0.7 s; L0's reload 4.2..5.2 ends under L1's backward (4.2..6.2); step 8.2 s.
  EXPECT_NEAR(r.step_seconds, 8.2, 1e-12);
  EXPECT_NEAR(r.stall_seconds, 0.7, 1e-12);
  // A "none" last layer is on the chain too: its end is a release point all the same.
  const Prediction none_last = evaluate(p, {1, 1, 0});
  EXPECT_EQ(none_last.offload_bytes, 2100);
  EXPECT_EQ(none_last.peak_bytes, 2250);
}

TEST(PlannerTest, DeferredBytesQueueBehindTheNextLayersOwnOffload) {
  // swap, checkpoint, swap, none: L0's input leaves at L1's release point; L2's at L3's,
  // after nothing. D2H 1 ms per byte: L0 1..2, L0's input 2..2.1, L2 3..4, L2's input
  // 4..4.1.
  StepProfile p;
  p.options = {"none", "checkpoint", "swap"};
  for (int k = 0; k < 4; ++k) {
    p.layers.push_back({OptionCost{1100, 0, 1.0, 2.0}, OptionCost{100, 0, 1.0, 3.0},
                        OptionCost{0, 1000, 1.0, 2.0, 100}});
  }
  p.layers[3][0].backward_seconds = 0.05;
  p.d2h = CopyLink{0.0, 0.001};
  p.h2d = CopyLink{0.0, 0.0};
  const Prediction r = evaluate(p, {2, 1, 2, 0});
  EXPECT_EQ(r.offload_bytes, 2 * 1100);
  // Forward points 1100, 100 + 100 + 100, 200 + 1100, 300 + 1100; at L3's backward:
  // L1's 100, L3's 1100 and L2's reload of 1100.
  EXPECT_EQ(r.peak_bytes, 2300);
  EXPECT_EQ(r.peak_layer, 3);
  EXPECT_TRUE(r.peak_in_backward);
  // The turn at 4; L3's backward ends at 4.05, L2's reload waits for its input's copy
  // (done 4.1): 0.05 s of stall (its own offload was done at 4).
  EXPECT_NEAR(r.stall_seconds, 0.05, 1e-12);
  for (int64_t budget : {1300, 1500, 2300, 3000, 5000}) {
    const PlanResult got = Planner(p).solve(budget);
    if (got.feasible) EXPECT_LE(got.prediction.peak_bytes, budget);
  }
}

// Shared charge (CostModel.h): a storage every layer saves (a causal mask) is counted once,
// by the first layer that saves it; the uniform profiles charged layer 0.
StepProfile shared_profile() {
  // none keeps 1000 and shares nothing; checkpoint keeps 100 and shares 300 bytes (the
  // mask it saves with its inputs), which its layer 0 paid in the profile (400 kept).
  StepProfile p;
  p.options = {"none", "checkpoint"};
  for (int k = 0; k < 4; ++k) {
    OptionCost ck{k == 0 ? 400 : 100, 0, 1.0, 3.0};
    if (k > 0) ck.shared_bytes = 300;
    p.layers.push_back({OptionCost{1000, 0, 1.0, 2.0}, ck});
  }
  return p;
}

TEST(PlannerTest, SharedBytesAreChargedToTheFirstLayerOfAnOptionNewToThePlan) {
  const StepProfile p = shared_profile();
  // Uniform checkpoint: layer 0 paid the mask, as profiled: 400 + 3 x 100.
  EXPECT_EQ(evaluate(p, {1, 1, 1, 1}).peak_bytes, 700);
  // none first: layer 1 is the first checkpoint and pays the mask: 1000 + 400 + 100 + 100.
  EXPECT_EQ(evaluate(p, {0, 1, 1, 1}).peak_bytes, 1600);
  // ... once: a later return to checkpoint after none pays nothing more.
  EXPECT_EQ(evaluate(p, {0, 1, 0, 1}).peak_bytes, 1000 + 400 + 1000 + 100);
  // The planner's plan meets every budget with the charge, and min_peak's budget is met.
  const Planner planner(p);
  for (int64_t budget = 600; budget <= 4000; budget += 50) {
    const PlanResult got = planner.solve(budget);
    const Best want = brute_force(p, budget);
    SCOPED_TRACE("budget " + std::to_string(budget));
    ASSERT_EQ(got.feasible, want.found);
    if (got.feasible) EXPECT_LE(got.prediction.peak_bytes, budget);
  }
  const PlanResult least = planner.min_peak();
  ASSERT_TRUE(least.feasible);
  EXPECT_EQ(least.prediction.peak_bytes, 700);
  EXPECT_EQ(least.assignment, (std::vector<int>{1, 1, 1, 1}));
  EXPECT_FALSE(planner.solve(699).feasible);
}

// True when every option of `a` forms one contiguous run: the shared charge of evaluate()
// (first layer of an option new to the prefix) is then the charge of every run's first
// layer, the bound the search charging runs is exact for.
bool runs_once(const std::vector<int>& a) {
  for (size_t k = 1; k < a.size(); ++k) {
    if (a[k] == a[k - 1]) continue;
    for (size_t j = 0; j + 1 < k; ++j) {
      if (a[j] == a[k]) return false;
    }
  }
  return true;
}

// Five layers of three options, "fast" and "small" saving a shared tensor of
// share_unit x (1..8) bytes from layer 1 on (the mask every layer saves): the faster
// option is larger, the smaller slower, so the uncharged optimum mixes them.
StepProfile shared_mix_profile(uint32_t seed, int64_t share_unit) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> bytes(1, 8);
  std::uniform_real_distribution<double> sec(1.0, 2.0);
  StepProfile p;
  p.options = {"none", "fast", "small"};
  for (int k = 0; k < 5; ++k) {
    const int64_t share = k == 0 ? 0 : share_unit * bytes(rng);
    OptionCost none{1000 + 100 * bytes(rng), 0, 1.0, 2.0};
    OptionCost fast{300 + 100 * bytes(rng), 0, 1.0, 2.5 + sec(rng)};
    OptionCost small{100 * bytes(rng), 0, 1.0, 4.0 + sec(rng)};
    fast.shared_bytes = small.shared_bytes = share;
    p.layers.push_back({none, fast, small});
  }
  return p;
}

TEST(PlannerTest, APlanWhoseOptionsRunOnceWithinTheBudgetIsAlwaysFound) {
  // Two options that save a shared tensor (the mask every layer saves), one faster and
  // larger, one slower and smaller: the uncharged optimum mixes them, so it is over its
  // budget once charged. The search that charges runs compared labels whose last options
  // differ as if their futures were the same and dropped the uniform slower plan: a
  // budget it meets was reported infeasible (tester's 4-layer mask stack: checkpoint_swap
  // measured 4096 B, "smallest reachable 5120 B" once checkpoint was a candidate too).
  for (uint32_t seed = 0; seed < 40; ++seed) {
    const StepProfile p = shared_mix_profile(seed, 100);
    const Planner planner(p);
    for (int64_t budget = 500; budget <= 6000; budget += 100) {
      bool want = false;
      std::vector<int> a(5, 0);
      while (true) {
        if (runs_once(a) && evaluate(p, a).peak_bytes <= budget) want = true;
        size_t k = 0;
        while (k < a.size() && ++a[k] == 3) a[k++] = 0;
        if (k == a.size() || want) break;
      }
      const PlanResult got = planner.solve(budget);
      SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget));
      if (want) ASSERT_TRUE(got.feasible);
      if (got.feasible) EXPECT_LE(got.prediction.peak_bytes, budget);
    }
  }
}

// Under the shared charge every plan is the brute-force optimum (the search charges
// exactly, Planner.h) and its bound is its own objective.
TEST(PlannerTest, UnderTheSharedChargeTheReportedBoundHoldsAgainstBruteForce) {
  int bounded = 0, exact = 0;
  for (uint32_t seed = 0; seed < 30; ++seed) {
    const StepProfile p = shared_mix_profile(seed, 10);  // charges small against the budgets
    const Planner planner(p);
    for (int64_t budget = 500; budget <= 6000; budget += 37) {
      const Best want = brute_force(p, budget);
      const PlanResult got = planner.solve(budget);
      SCOPED_TRACE("seed " + std::to_string(seed) + " budget " + std::to_string(budget));
      if (!got.feasible) continue;
      ASSERT_TRUE(want.found);
      EXPECT_LE(got.prediction.peak_bytes, budget);
      const double objective = got.prediction.step_seconds +
                               kTrafficSecondsPerByte * static_cast<double>(got.prediction.offload_bytes);
      EXPECT_GE(objective, want.time * (1 - 1e-12));
      if (got.stats.exact) {
        ++exact;
        EXPECT_NEAR(objective, want.time, 1e-9 * want.time);
      }
      if (std::isfinite(got.stats.lower_bound)) {
        ++bounded;
        EXPECT_LE(got.stats.lower_bound, want.time * (1 + 1e-12));
        EXPECT_LE(got.stats.lower_bound, got.stats.objective * (1 + 1e-12));
      }
    }
  }
  // The search charges exactly (Planner.h): every plan is the optimum.
  EXPECT_GT(bounded, 0);
  EXPECT_EQ(exact, bounded);
}

// The synthetic profile with the swap option's input bytes deferred (the decoder-loop
// pattern); layer 0's input is held by the model all step (kept).
StepProfile with_deferred(StepProfile p) {
  for (size_t k = 0; k < p.layers.size(); ++k) {
    OptionCost& swap = p.layers[k][3];
    if (k == 0) continue;
    swap.deferred_bytes = swap.kept_bytes;
    swap.kept_bytes = 0;
  }
  return p;
}

TEST(PlannerTest, WithDeferredBytesThePlanMeetsItsBudgetAndIsTheOptimum) {
  int feasible = 0, missed = 0;
  double worst = 0.0;
  for (int depth : {1, 0}) {
    for (uint32_t seed = 1; seed <= 6; ++seed) {
      for (double ratio : {0.5, 1.0, 2.0, 4.0}) {
        StepProfile p = with_deferred(synthetic(6, seed, ratio));
        p.prefetch_depth = depth;
        const int64_t none = peak_of(p, 0);
        const Planner planner(p);
        for (double fraction : {0.15, 0.25, 0.4, 0.6, 0.8, 1.0}) {
          const int64_t budget = p.base_bytes + static_cast<int64_t>(
              fraction * static_cast<double>(none - p.base_bytes));
          const PlanResult got = planner.solve(budget);
          const Best want = brute_force(p, budget);
          SCOPED_TRACE("depth " + std::to_string(depth) + " seed " + std::to_string(seed) +
                       " ratio " + std::to_string(ratio) + " fraction " +
                       std::to_string(fraction));
          if (got.feasible) {
            ASSERT_TRUE(want.found);
            EXPECT_LE(got.prediction.peak_bytes, budget);
            EXPECT_GE(objective_of(got), want.time * (1.0 - 1e-12));
            worst = std::max(worst, objective_of(got) / want.time - 1.0);
            ++feasible;
          } else if (want.found) {
            ++missed;
          }
        }
      }
    }
  }
  std::printf("deferred: %d plans, %d missed, worst %.4f above the optimum\n", feasible, missed,
              worst);
  EXPECT_GT(feasible, 200);
  // Bytes and times are exact (WithDeferredBytesTheSearchIsExact): none missed, each the
  // optimum.
  EXPECT_EQ(missed, 0);
  EXPECT_LT(worst, 1e-12);
}

TEST(PlannerTest, WithDeferredBytesNoBoundOrOptimumIsClaimedThatEvaluateRefutes) {
  // Tester's input (session 22): 3 layers whose swapping options defer large inputs. The
  // search timed a deferred copy at its layer's release point, evaluate() one release
  // point later: the plan {1, 0, 1} was called optimal with its bound at its own 0.12440 s,
  // 0.9 % above the optimum 0.12324 s. The search now times that copy as evaluate() does
  // (WithDeferredBytesTheSearchTimesEveryPlanAsEvaluateDoes): its plan is the optimum.
  StepProfile p;
  p.options = {"o0", "o1", "o2"};
  p.layers = {
      {OptionCost{19922944, 29360128, 0.006344810274631429, 0.00801827921535906},
       OptionCost{3145728, 1048576, 0.006334097726130515, 0.008812599158519598},
       OptionCost{2097152, 9437184, 0.006391113331611196, 0.00667385236860063, 6291456}},
      {OptionCost{10485760, 15728640, 0.01259349292995538, 0.05153297723594015},
       OptionCost{27262976, 25165824, 0.01216160061461587, 0.04237672085852774, 16777216},
       OptionCost{15728640, 32505856, 0.012370789877350517, 0.04516423419167373, 17825792}},
      {OptionCost{41943040, 0, 0.012972160961518398, 0.03960837246868681},
       OptionCost{19922944, 37748736, 0.0129026233541009, 0.024042519962926306, 13631488},
       OptionCost{28311552, 0, 0.013125472763089256, 0.03716402781822244, 3145728}}};
  p.base_bytes = 4194304;
  p.tail_bytes = 41943040;
  p.outside_seconds = 0.0018557272808635283;
  p.tail_seconds = 0.006321033762751452;
  p.d2h = CopyLink{0.0030318407827992395, 1.2165646172273145e-09};
  p.h2d = CopyLink{0.0009746916939898013, 1.2165646172273145e-09};
  p.prefetch_depth = 1;
  const int64_t budget = 131072000;
  const PlanResult r = Planner(p).solve(budget);
  const Best want = brute_force(p, budget);
  ASSERT_TRUE(r.feasible);
  ASSERT_TRUE(want.found);
  EXPECT_LE(r.prediction.peak_bytes, budget);
  if (r.stats.exact) EXPECT_NEAR(objective_of(r), want.time, 1e-12 * want.time);
  if (!std::isnan(r.stats.lower_bound)) EXPECT_LE(r.stats.lower_bound, want.time * (1 + 1e-12));
  EXPECT_TRUE(r.stats.exact);
  EXPECT_NEAR(objective_of(r), want.time, 1e-12 * want.time);
  EXPECT_NEAR(r.stats.lower_bound, want.time, 1e-12 * want.time);
}

// Random small profiles whose options mix every way a layer's saves can leave: kept only,
// offloaded at its release point, deferred to the next one (the decoder loop's input:
// `checkpoint_swap` defers everything it saves), or both, with copy latencies; layer 0's
// input is never deferred (the model holds it).
StepProfile random_deferred(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> unit(0, 12);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  StepProfile p;
  p.options = {"none", "swap", "checkpoint_swap", "mixed"};
  p.base_bytes = 100;
  p.tail_bytes = 50 * unit(rng);
  p.tail_seconds = 0.3 * u(rng);
  p.outside_seconds = 0.1;
  p.d2h = CopyLink{0.05 * unit(rng) * u(rng), 2e-3 * u(rng)};
  p.h2d = CopyLink{0.05 * unit(rng) * u(rng), 2e-3 * u(rng)};
  for (size_t k = 0; k < n; ++k) {
    const int64_t in = 100 + 50 * unit(rng), body = 200 + 100 * unit(rng);
    const int64_t def = k == 0 ? 0 : in;
    const double f = u(rng), b = 2 * f * u(rng);
    p.layers.push_back({
        OptionCost{in + body, 0, f, b},
        OptionCost{in - def, body, f * u(rng), b * u(rng), def},
        OptionCost{in - def, 0, f * u(rng), b + f * u(rng), def},
        OptionCost{in - def + body / 2, body / 2, f * u(rng), b * u(rng), def / 2},
    });
  }
  return p;
}

// Trial `trial` of a fuzz loop: 2-5 random_deferred layers (seed trial + offset), prefetch
// depth 0 or 1.
StepProfile trial_profile(int trial, uint32_t offset) {
  StepProfile p = random_deferred(2 + trial % 4, static_cast<uint32_t>(trial) + offset);
  p.prefetch_depth = trial % 2;
  return p;
}

// Every byte count of `p` times `scale` (odd scales leave the bytes off any small grid, so
// that the rounded searches run).
void scale_bytes(StepProfile& p, int64_t scale) {
  for (auto& layer : p.layers) {
    for (auto& c : layer) {
      for (int64_t* b : {&c.kept_bytes, &c.offload_bytes, &c.deferred_bytes, &c.shared_bytes,
                         &c.held_bytes, &c.input_bytes, &c.output_bytes}) {
        *b *= scale;
      }
    }
  }
  p.base_bytes *= scale;
  p.tail_bytes *= scale;
}

// min_peak() and solve() at 4 budgets from the least peak up to none's, each checked
// against brute force: exact, feasible and optimal. Returns the solves checked (4).
int expect_exact_against_brute_force(const StepProfile& p) {
  const Planner planner(p);
  const int64_t least = brute_force_min_peak(p);
  const PlanResult low = planner.min_peak();
  EXPECT_TRUE(low.feasible);
  EXPECT_EQ(low.prediction.peak_bytes, least);
  const int64_t none = peak_of(p, 0);
  int solved = 0;
  for (double fraction : {0.0, 0.2, 0.5, 1.0}) {
    const int64_t budget = least + static_cast<int64_t>(
        fraction * static_cast<double>(std::max<int64_t>(0, none - least)));
    const PlanResult got = planner.solve(budget);
    const Best want = brute_force(p, budget);
    EXPECT_TRUE(want.found);
    EXPECT_TRUE(got.feasible);
    if (!got.feasible || !want.found) continue;
    EXPECT_LE(got.prediction.peak_bytes, budget);
    EXPECT_TRUE(got.stats.exact);
    EXPECT_NEAR(objective_of(got), want.time, 1e-12 * want.time);
    ++solved;
  }
  return solved;
}

// 400 random_deferred() profiles of 2-5 layers at depths 0 and 1, each changed by
// mutate(profile, rng) and checked by expect_exact_against_brute_force(): the solves
// checked.
template <typename Mutate>
int fuzz_against_brute_force(uint32_t rng_seed, uint32_t seed_offset, Mutate mutate) {
  std::mt19937 rng(rng_seed);
  int solved = 0;
  for (int trial = 0; trial < 400; ++trial) {
    StepProfile p = random_deferred(2 + trial % 4, static_cast<uint32_t>(trial) + seed_offset);
    p.prefetch_depth = trial % 2;
    mutate(p, rng);
    SCOPED_TRACE("trial " + std::to_string(trial));
    solved += expect_exact_against_brute_force(p);
  }
  return solved;
}

// The search times a deferred copy where evaluate() does (queued at the next release point
// behind that point's own offload, its own latency; the previous layer's reload waiting
// for it when it ends the queue): on every assignment (the search pinned to it by the
// allowed masks) the search's objective is evaluate()'s, at depths 0 and 1.
TEST(PlannerTest, WithDeferredBytesTheSearchTimesEveryPlanAsEvaluateDoes) {
  int checked = 0;
  for (uint32_t seed = 0; seed < 300; ++seed) {
    for (int depth : {0, 1}) {
      StepProfile p = random_deferred(2 + seed % 4, seed);
      p.prefetch_depth = depth;
      const Planner planner(p);
      std::mt19937 rng(seed + 7);
      for (int trial = 0; trial < 8; ++trial) {
        std::vector<uint64_t> allowed(p.num_layers());
        std::vector<int> a(p.num_layers());
        for (size_t k = 0; k < a.size(); ++k) {
          a[k] = static_cast<int>(rng() % p.num_options());
          allowed[k] = uint64_t{1} << a[k];
        }
        const PlanResult r = planner.solve(int64_t{1} << 40, allowed);
        SCOPED_TRACE("seed " + std::to_string(seed) + " depth " + std::to_string(depth) +
                     " trial " + std::to_string(trial));
        ASSERT_TRUE(r.feasible);
        ASSERT_EQ(r.assignment, a);
        EXPECT_TRUE(r.stats.exact);
        EXPECT_NEAR(r.stats.objective, objective_of(r), 1e-12 * objective_of(r));
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4800);
}

// With deferred bytes the search is exact again: every plan it calls optimal is the
// brute-force optimum, its bound holds, and (small profiles: no fallback) every plan is
// called optimal.
TEST(PlannerTest, WithDeferredBytesTheSearchIsExact) {
  int solved = 0, exact = 0;
  for (uint32_t seed = 0; seed < 120; ++seed) {
    for (int depth : {0, 1}) {
      StepProfile p = random_deferred(3 + seed % 3, seed + 1000);
      p.prefetch_depth = depth;
      const Planner planner(p);
      const int64_t none = peak_of(p, 0);
      for (double fraction : {0.3, 0.5, 0.7, 1.0}) {
        const int64_t budget = p.base_bytes + static_cast<int64_t>(
            fraction * static_cast<double>(none - p.base_bytes));
        const PlanResult got = planner.solve(budget);
        const Best want = brute_force(p, budget);
        SCOPED_TRACE("seed " + std::to_string(seed) + " depth " + std::to_string(depth) +
                     " fraction " + std::to_string(fraction));
        ASSERT_EQ(got.feasible, want.found);
        if (!got.feasible) continue;
        ++solved;
        EXPECT_LE(got.prediction.peak_bytes, budget);
        EXPECT_GE(objective_of(got), want.time * (1.0 - 1e-12));
        if (std::isfinite(got.stats.lower_bound)) {
          EXPECT_LE(got.stats.lower_bound, want.time * (1.0 + 1e-12));
        }
        if (got.stats.exact) {
          ++exact;
          EXPECT_NEAR(objective_of(got), want.time, 1e-12 * want.time);
        }
      }
    }
  }
  EXPECT_GT(solved, 500);
  EXPECT_EQ(exact, solved);
}

// Shared charges, held bytes and deferred inputs together on random small profiles: the
// search charges the first layer of each option exactly (each label carries the set of
// options used so far), so feasibility, optima and min_peak() are brute force's. Before,
// the search left the charge out and re-searched under a lowered budget and charging
// every run's first layer: a plan running an option in two separate runs within the
// budget was refused (tester: [1, 0, 1] at peak 0 met for budgets 0-9, refused at 10-19).
TEST(PlannerTest, WithSharedBytesTheSearchIsExact) {
  {
    StepProfile p;
    p.options = {"o0", "o1"};
    p.layers = {{OptionCost{10, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.5}},
                {OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0, 20}},
                {OptionCost{20, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0, 0, 20}}};
    p.d2h = p.h2d = CopyLink{0.0, 0.01};
    const Planner planner(p);
    for (int64_t budget = 0; budget <= 40; ++budget) expect_brute_force_optimum(planner, p, budget);
  }
  EXPECT_EQ(fuzz_against_brute_force(9, 5000, [](StepProfile& p, std::mt19937& rng) {
              for (auto& layer : p.layers) {
                for (auto& c : layer) {
                  if (rng() % 2) c.shared_bytes = 25 * static_cast<int64_t>(rng() % 5);
                  if (rng() % 4 == 0) {
                    c.held_bytes = static_cast<int64_t>(rng() % 3) * c.kept_bytes / 2;
                  }
                }
              }
            }),
            1600);
}

// The storage one layer hands the next (a tanh output that the next Linear saves) counts
// once, on whichever side saves it: "none" keeps it with its own saves (output_bytes), a
// checkpoint layer saves it as its input (input_bytes, charged unless the layer before
// saved it). Before, uniform profiles charged it to the first saver, so "none" after
// "checkpoint" was predicted without it and "checkpoint" after "none" with it twice (a
// fuzzer's tanh stack: every plan measured 39 488 B, mixed ones predicted down to 21 056).
TEST(PlannerTest, BoundaryStorageCountsOnceWhicheverLayerSavesIt) {
  StepProfile p;
  p.options = {"none", "checkpoint"};
  // Three layers; each saves 100 B of its own under none plus its 40 B output; checkpoint
  // keeps its 40 B input only. Layer 0's input is the model's (no boundary).
  p.layers = {
      {OptionCost{140, 0, 1.0, 1.0, 0, 0, 0, 0, 40}, OptionCost{40, 0, 1.0, 2.0}},
      {OptionCost{140, 0, 1.0, 1.0, 0, 0, 0, 40, 40}, OptionCost{0, 0, 1.0, 2.0, 0, 0, 0, 40, 0}},
      {OptionCost{140, 0, 1.0, 1.0, 0, 0, 0, 40, 40}, OptionCost{0, 0, 1.0, 2.0, 0, 0, 0, 40, 0}},
  };
  auto peak = [&](std::vector<int> a) { return evaluate(p, a).peak_bytes; };
  EXPECT_EQ(peak({0, 0, 0}), 420);            // uniform none: as profiled
  EXPECT_EQ(peak({1, 1, 1}), 120);            // uniform checkpoint: as profiled
  EXPECT_EQ(peak({1, 0, 1}), 40 + 180 + 0);   // none after checkpoint saves its input too
  EXPECT_EQ(peak({0, 1, 0}), 140 + 0 + 180);  // the checkpoint layer's output is saved by none
  EXPECT_EQ(peak({1, 1, 0}), 40 + 40 + 180);
  // The search charges alike: pinned to each assignment, it predicts evaluate()'s peak, and
  // its optimum at every budget is brute force's.
  const Planner planner(p);
  for (int a = 0; a < 8; ++a) {
    const std::vector<int> want{a & 1, a >> 1 & 1, a >> 2 & 1};
    std::vector<uint64_t> allowed;
    for (int o : want) allowed.push_back(uint64_t{1} << o);
    const PlanResult r = planner.solve(peak(want), allowed);
    ASSERT_TRUE(r.feasible) << a;
    EXPECT_EQ(r.prediction.peak_bytes, peak(want)) << a;
    EXPECT_FALSE(planner.solve(peak(want) - 1, allowed).feasible) << a;
  }
  for (int64_t budget = 100; budget <= 420; budget += 20) {
    expect_brute_force_optimum(planner, p, budget);
  }
  EXPECT_EQ(planner.min_peak().prediction.peak_bytes, brute_force_min_peak(p));
}

// Boundary charges on random small profiles (with deferred, shared and held bytes): the
// search is exact (feasibility, optima, min_peak() are brute force's), and pinned to any
// assignment it predicts what evaluate() does.
TEST(PlannerTest, WithBoundaryBytesTheSearchIsExact) {
  auto add_boundaries = [](StepProfile& p, std::mt19937& rng) {
    for (size_t k = 1; k < p.num_layers(); ++k) {
      const int64_t b = 30 * static_cast<int64_t>(1 + rng() % 4);
      for (auto& c : p.layers[k - 1]) {
        if (rng() % 2) c.output_bytes = b;  // (in its kept_bytes, as the profile counts it)
      }
      for (auto& c : p.layers[k]) {
        if (rng() % 2) c.input_bytes = b;
      }
      if (rng() % 3 == 0) p.layers[k][rng() % p.num_options()].shared_bytes = 25;
    }
  };
  int pinned = 0;
  for (uint32_t seed = 0; seed < 200; ++seed) {
    StepProfile p = trial_profile(static_cast<int>(seed), 9000);
    std::mt19937 rng(seed);
    add_boundaries(p, rng);
    const Planner planner(p);
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<uint64_t> allowed(p.num_layers());
      std::vector<int> a(p.num_layers());
      for (size_t k = 0; k < a.size(); ++k) {
        a[k] = static_cast<int>(rng() % p.num_options());
        allowed[k] = uint64_t{1} << a[k];
      }
      const Prediction e = evaluate(p, a);
      const PlanResult r = planner.solve(e.peak_bytes, allowed);
      SCOPED_TRACE("seed " + std::to_string(seed) + " trial " + std::to_string(trial));
      ASSERT_TRUE(r.feasible);
      ASSERT_EQ(r.assignment, a);
      EXPECT_EQ(r.prediction.peak_bytes, e.peak_bytes);
      EXPECT_NEAR(r.stats.objective, objective_of(r), 1e-12 * objective_of(r));
      EXPECT_FALSE(planner.solve(e.peak_bytes - 1, allowed).feasible);
      ++pinned;
    }
  }
  EXPECT_EQ(pinned, 1200);
  EXPECT_EQ(fuzz_against_brute_force(13, 7000, add_boundaries), 1600);
}

// A charge no option of the layer before can avoid (a decoder's hidden states: every
// option of layer k saves its input, no option of layer k-1 saves its output) is the
// layer's own bytes: every prediction, the plan and the search's work are those of the
// same profile with those bytes in kept_bytes. (The bounds had read kept_bytes without the
// charge: a tiled 100-layer Llama profile took 500 000 labels and 190 ms instead of
// 25 000 and 17 ms.)
TEST(PlannerTest, ABoundaryChargeNoOptionAvoidsCostsTheSearchNothing) {
  for (double ratio : {0.5, 2.0}) {
    const StepProfile folded = synthetic(100, 11, ratio);
    StepProfile split = folded;
    for (size_t k = 1; k < split.num_layers(); ++k) {
      for (auto& c : split.layers[k]) {
        const int64_t in = std::min<int64_t>(c.kept_bytes, kMiB);
        c.kept_bytes -= in;
        c.input_bytes = in;
      }
    }
    std::mt19937 rng(3);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<int> a(folded.num_layers());
      for (int& o : a) o = static_cast<int>(rng() % folded.num_options());
      EXPECT_EQ(evaluate(split, a).peak_bytes, evaluate(folded, a).peak_bytes);
    }
    const int64_t budget = peak_of(folded, 0) / 2;
    const PlanResult want = Planner(folded).solve(budget);
    const PlanResult got = Planner(split).solve(budget);
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    ASSERT_TRUE(got.feasible && want.feasible);
    EXPECT_EQ(got.assignment, want.assignment);
    EXPECT_EQ(got.stats.exact, want.stats.exact);
    EXPECT_EQ(got.stats.labels_created, want.stats.labels_created);
  }
}

TEST(PlannerTest, HeldBytesCountUntilTheStepEnds) {
  // The caller holds 500 bytes of the last layer's saves (its input) and 200 of the head's
  // past their backward. Uniform swap: forward points 1000, 1100, 1200, end of forward
  // 1400. Backward: at L2, its 1000 + L0's and L1's kept 200 + L1's reload 900 + the
  // head's held 200 = 2300; at L1, the kept 200 + reloads of L1 and L0 1800 + held 700
  // (L2's 500, the head's 200) = 2700; at L0, 100 + 900 + 700 = 1700.
  StepProfile p;
  p.options = {"none", "swap"};
  for (int k = 0; k < 3; ++k) {
    const int64_t held = k == 2 ? 500 : 0;
    p.layers.push_back({OptionCost{1000, 0, 1.0, 2.0, 0, 0, held},
                        OptionCost{100, 900, 1.0, 2.0, 0, 0, held}});
  }
  p.tail_bytes = 200;
  p.tail_held_bytes = 200;
  const Prediction swap = evaluate(p, {1, 1, 1});
  EXPECT_EQ(swap.peak_bytes, 2700);
  EXPECT_EQ(swap.peak_layer, 1);
  EXPECT_TRUE(swap.peak_in_backward);
  // Nothing held: the peak is L2's backward point, 1200 + 900.
  StepProfile free = p;
  free.tail_held_bytes = 0;
  for (auto& options : free.layers) {
    for (auto& c : options) c.held_bytes = 0;
  }
  EXPECT_EQ(evaluate(free, {1, 1, 1}).peak_bytes, 2100);
  // "none" peaks at the end of the forward either way (3000 + 200).
  EXPECT_EQ(evaluate(p, {0, 0, 0}).peak_bytes, 3200);
  // The planner sees it: at 2699 bytes uniform swap does not fit.
  const PlanResult got = Planner(p).solve(2699);
  if (got.feasible) {
    EXPECT_LE(got.prediction.peak_bytes, 2699);
    EXPECT_NE(got.assignment, (std::vector<int>{1, 1, 1}));
  }
  EXPECT_EQ(Planner(p).min_peak().prediction.peak_bytes,
            brute_force_min_peak(p));
  // Held bytes count at most what the layer left on the device: L1's swap option said to
  // hold 1000 bytes holds its 100 kept bytes (the 900 it offloaded were reloaded and freed).
  // Depth 0 and L0 keeping 1200 and offloading 1900 (its backward point the peak): at L0's
  // backward its 1200 + its reload 1900 + held 700 + L1's 100 = 3900.
  StepProfile kept = p;
  kept.prefetch_depth = 0;
  kept.layers[0][1].kept_bytes = 1200;
  kept.layers[0][1].offload_bytes = 1900;
  StepProfile over = kept, none_held = kept;
  kept.layers[1][1].held_bytes = 100;
  over.layers[1][1].held_bytes = 1000;
  EXPECT_NO_THROW(over.validate());
  EXPECT_EQ(evaluate(kept, {1, 1, 1}).peak_bytes, 3900);
  EXPECT_EQ(evaluate(kept, {1, 1, 1}).peak_layer, 0);
  EXPECT_EQ(evaluate(over, {1, 1, 1}).peak_bytes, 3900);
  EXPECT_EQ(evaluate(none_held, {1, 1, 1}).peak_bytes, 3800);
}

// The synthetic profile with the caller holding layer 2's and the last layer's inputs
// (every option keeps its inputs: the same bytes for each) and 4 MiB of the head's saves;
// `uneven`: only "none" holds layer 2's bytes (the others would not save that storage).
StepProfile with_held(StepProfile p, bool uneven) {
  const size_t n = p.layers.size();
  for (size_t k : {size_t{2}, n - 1}) {
    for (size_t o = 0; o < p.num_options(); ++o) {
      if (uneven && k == 2 && o != 0) continue;
      p.layers[k][o].held_bytes = p.layers[k][1].kept_bytes;  // checkpoint keeps the inputs
    }
  }
  p.tail_held_bytes = 4 * kMiB;
  return p;
}

TEST(PlannerTest, WithHeldBytesThePlanMeetsItsBudgetAndIsExact) {
  int feasible = 0, missed = 0, uneven_missed = 0, calls = 0;
  bool met_smaller = false;  // a smaller budget of the same profile was met
  for (bool uneven : {false, true}) {
    SCOPED_TRACE(uneven ? "options hold unlike bytes" : "options hold alike");
    for_each_budget(
        {1, 2, 3, 4}, {0.5, 2.0}, {0.2, 0.3, 0.45, 0.6, 0.8, 1.0},
        [&](uint32_t seed, double ratio) { return with_held(synthetic(6, seed, ratio), uneven); },
        [&](const Planner& planner, const StepProfile& p, int64_t budget) {
          if (calls++ % 6 == 0) met_smaller = false;  // (6 budgets, ascending, per profile)
          const PlanResult got = planner.solve(budget);
          const Best want = brute_force(p, budget);
          // Feasibility is monotone in the budget (a budget was refused while a smaller one
          // was met when charging the most found nothing).
          EXPECT_TRUE(got.feasible || !met_smaller);
          met_smaller = met_smaller || got.feasible;
          if (got.feasible) {
            ASSERT_TRUE(want.found);
            EXPECT_LE(got.prediction.peak_bytes, budget);
            EXPECT_TRUE(got.stats.exact);
            EXPECT_NEAR(objective_of(got), want.time, want.time * 1e-12);
            ++feasible;
          } else if (want.found) {
            (uneven ? uneven_missed : missed) += 1;
          }
        });
  }
  std::printf("held: %d plans, %d missed (%d where options hold unlike bytes)\n", feasible,
              missed, uneven_missed);
  EXPECT_GT(feasible, 150);
  EXPECT_EQ(missed, 0);
  EXPECT_EQ(uneven_missed, 0);
}

// Random small profiles whose options hold unlike bytes past their backward (a module's
// buffer that some strategies save, the caller's references), with deferred inputs: the
// search carries the room the backward sample points leave (Planner.h), so feasibility,
// optima and min_peak() are brute force's. Before, it charged later layers the most (or,
// as a relaxation, the least) and retried: budgets were refused above ones it met
// (tester: [0, 0, 1] at peak 20 refused at 30-34 and 49) and min_peak() returned 1900 B
// where 1010 B was met.
TEST(PlannerTest, WithUnlikeHeldBytesTheSearchIsExact) {
  // The tester's two inputs.
  {
    StepProfile p;
    p.options = {"o0", "o1"};
    p.layers = {{OptionCost{0, 20, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0, 20}},
                {OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0}},
                {OptionCost{0, 0, 1.0, 1.0, 30, 0, 30}, OptionCost{0, 0, 1.0, 2.0}}};
    p.d2h = p.h2d = CopyLink{0.0, 0.002};
    const Planner planner(p);
    for (int64_t budget = 20; budget <= 60; ++budget) {
      const PlanResult r = planner.solve(budget);
      SCOPED_TRACE("budget " + std::to_string(budget));
      ASSERT_TRUE(r.feasible);
      EXPECT_TRUE(r.stats.exact);
      EXPECT_NEAR(objective_of(r), brute_force(p, budget).time, 1e-12);
    }
  }
  {
    StepProfile p;
    p.options = {"o0", "o1"};
    p.layers = {{OptionCost{110, 0, 1.0, 1.0, 200}, OptionCost{0, 0, 1.0, 1.0, 590}},
                {OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0, 1450, 0, 1450}},
                {OptionCost{700, 0, 1.0, 2.1, 0, 0, 700}, OptionCost{1090, 500, 1.0, 1.0, 0, 0, 1590}}};
    p.d2h = p.h2d = CopyLink{0.0, 0.0006};
    p.prefetch_depth = 0;
    const PlanResult least = Planner(p).min_peak();
    ASSERT_TRUE(least.feasible);
    EXPECT_EQ(least.prediction.peak_bytes, brute_force_min_peak(p));
  }
  EXPECT_EQ(fuzz_against_brute_force(5, 77, [](StepProfile& p, std::mt19937& rng) {
              for (auto& layer : p.layers) {
                for (auto& c : layer) {
                  if (rng() % 3 == 0) {
                    c.held_bytes = static_cast<int64_t>(rng() % 3) * c.kept_bytes / 2;
                  }
                }
              }
              if (rng() % 2) p.tail_held_bytes = p.tail_bytes / 2;
            }),
            1600);
}

StepProfile six_options(size_t n, uint32_t seed, double copy_ratio) {
  StepProfile p = synthetic(n, seed, copy_ratio);
  p.options = {"none", "checkpoint", "selective", "swap", "selective_swap", "checkpoint_swap"};
  for (auto& layer : p.layers) {
    const OptionCost sel = layer[2], ck = layer[1];
    layer.push_back(OptionCost{ck.kept_bytes, sel.kept_bytes - ck.kept_bytes,
                               sel.forward_seconds, sel.backward_seconds});
    layer.push_back(OptionCost{0, ck.kept_bytes, ck.forward_seconds, ck.backward_seconds});
  }
  return p;
}

TEST(PlannerTest, SearchStaysSmallForHundredLayers) {
  // 100 layers x 6 options of random sizes (4 to 40 MiB), copies at half a forward (the
  // regime where swap pays): the exact search's fronts stay small (timings:
  // benchmarks/bench_planner.py). Bound: about 3x the widest front measured (9013).
  for (double ratio : {0.5}) {
    for (int depth : {0, 1}) {
      StepProfile p = six_options(100, 11, ratio);
      p.prefetch_depth = depth;
      const Planner planner(p);
      const int64_t none = peak_of(p, 0);
      for (int64_t budget : {none / 4, none / 2}) {
        const PlanResult r = planner.solve(budget);
        SCOPED_TRACE("ratio " + std::to_string(ratio) + " depth " + std::to_string(depth) +
                     " budget " + std::to_string(budget));
        ASSERT_TRUE(r.feasible);
        EXPECT_LE(r.prediction.peak_bytes, budget);
        std::printf("[planner] 100 layers, ratio %.1f, depth %d, budget %.2f none: %lld labels "
                    "kept (widest layer %lld), %lld created\n",
                    ratio, depth, static_cast<double>(budget) / static_cast<double>(none),
                    static_cast<long long>(r.stats.labels_kept),
                    static_cast<long long>(r.stats.widest_layer),
                    static_cast<long long>(r.stats.labels_created));
        EXPECT_TRUE(r.stats.exact);
        EXPECT_LT(r.stats.widest_layer, 30000);
        // The cut-off (branch and bound on rest_bound()) drops most labels at birth: at
        // depth 1 measured 45 000-100 000 created (1.3-2.1 million without it); at depth
        // 0, where every reload is exposed, 0.68-1.01 million with the capped searches
        // (0.99-1.73 million without a cut-off).
        EXPECT_LT(r.stats.labels_created, depth == 1 ? 300000 : 1500000);
      }
    }
  }
}

TEST(PlannerTest, SaturatedHundredLayersIsBoundedByItsRelaxation) {
  // 100 heterogeneous layers x 6 options, copies at twice a forward: the exact fronts
  // outgrow the search (10^5-10^6 labels per layer) and solve() falls back to its capped
  // searches (solve times: benchmarks/bench_planner.py --solve-only), which prove a plan
  // optimal where the one with a cut-off dropped nothing undominated, and then to the
  // deepening, whose exact searches prove the rest (deepening_labels: 0 skips it). The plan is
  // checked against an independent evaluation of the cost model: the prediction is
  // evaluate()'s, the peak meets the budget, the proven lower bound lies below the plan
  // and below every uniform plan that fits (each an upper bound of the optimum), and the
  // plan is no slower than any of them.
  for (uint32_t seed : {11u, 12u}) {
    StepProfile p = six_options(100, seed, 2.0);
    p.prefetch_depth = 1;
    const Planner planner(p);
    const int64_t none = peak_of(p, 0);
    for (double fraction : {0.25, 0.5}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
      SCOPED_TRACE("seed " + std::to_string(seed) + " fraction " + std::to_string(fraction));
      const PlanResult r = planner.solve(budget);
      ASSERT_TRUE(r.feasible);
      const Prediction again = evaluate(p, r.assignment);
      EXPECT_EQ(again.peak_bytes, r.prediction.peak_bytes);
      EXPECT_DOUBLE_EQ(again.step_seconds, r.prediction.step_seconds);
      EXPECT_LE(again.peak_bytes, budget);
      const double got = objective_of(r);
      ASSERT_TRUE(std::isfinite(r.stats.lower_bound));
      EXPECT_LE(r.stats.lower_bound, got);
      int fitting = 0;
      for (size_t o = 0; o < p.num_options(); ++o) {
        const std::vector<int> uniform(p.num_layers(), static_cast<int>(o));
        const Prediction u = evaluate(p, uniform);
        if (u.peak_bytes > budget) continue;
        ++fitting;
        const double objective =
            u.step_seconds + kTrafficSecondsPerByte * static_cast<double>(u.offload_bytes);
        EXPECT_LE(r.stats.lower_bound, objective);
        EXPECT_LE(got, objective);
      }
      EXPECT_GT(fitting, 0);
      // The work stays bounded: at most 4 phases x (kWideBins + 1) x kFallbackPerBin labels
      // per layer in the capped searches, about 6 x 10^5 in all with the first searches
      // with a cut-off, and the deepening's kDeepeningLabels at most (measured 3.0-3.4 x
      // 10^6 kept at 25 %, 0.9-1.0 x 10^5 at 50 %).
      EXPECT_LE(r.stats.widest_layer,
                std::max({4 * (kWideBins + 1) * kFallbackPerBin,
                          kExactLabelsPerLayer * 100, kDeepeningWidest}));
      EXPECT_LT(r.stats.labels_kept, 600000 + kDeepeningLabels);
      // All four are proven optimal (session 26, deepening allowed 24 million labels; with
      // 2 million, the two at 25 % stood 0.18-0.30 % above their bounds; before the
      // deepening 0.08-0.47 %; the fallback before that, a byte grid rounded up, 1.0-1.1 %).
      EXPECT_TRUE(r.stats.exact);
      EXPECT_NEAR(r.stats.lower_bound, got, 1e-12 * got);
      // Without the deepening the capped searches' plan stands, no faster, with a bound no
      // higher: the deepening's proof is what moved (and at 25 % the plan too).
      const PlanResult capped = planner.solve(budget, {}, -1, 0);
      ASSERT_TRUE(capped.feasible);
      EXPECT_LE(capped.prediction.peak_bytes, budget);
      EXPECT_GE(objective_of(capped), got * (1 - 1e-12));
      EXPECT_LE(capped.stats.lower_bound, got * (1 + 1e-12));
      if (fraction < 0.3) EXPECT_FALSE(capped.stats.exact);
      std::printf("[planner] saturated 100 layers, seed %u, budget %.2f none: plan %.4f s, "
                  "lower bound %.4f s (gap %.2f %%), exact %d, %lld labels kept\n",
                  seed, fraction, got, r.stats.lower_bound,
                  100.0 * (got / r.stats.lower_bound - 1.0), r.stats.exact ? 1 : 0,
                  static_cast<long long>(r.stats.labels_kept));
    }
  }
}

// Saturated 100-layer profiles (copies 2-3x a forward) at 30-50 % of none's peak. At 30 and
// 35 % the searches with a cut-off at the relaxation's bound and at the capped searches'
// plan both give up (the latter would keep millions of labels), so solve() raises its
// cut-off from the proven bound (the deepening, Planner.h) and proves the optimum there
// (these three were not proven optimal without it). Checked against what can refute it:
// the bound reported is the plan's objective, no single layer's change within the budget
// is faster, and no uniform plan is.
TEST(PlannerTest, SaturatedHundredLayersAreProvenOptimal) {
  struct Case {
    uint32_t seed;
    double ratio, fraction;
  };
  for (const Case& c : {Case{11, 2.0, 0.35}, Case{13, 2.0, 0.35}, Case{13, 3.0, 0.30},
                        Case{12, 3.0, 0.5}}) {
    {
      const StepProfile p = six_options(100, c.seed, c.ratio);
      const Planner planner(p);
      const int64_t budget = static_cast<int64_t>(c.fraction * static_cast<double>(peak_of(p, 0)));
      SCOPED_TRACE("seed " + std::to_string(c.seed) + " ratio " + std::to_string(c.ratio) +
                   " fraction " + std::to_string(c.fraction));
      const PlanResult r = planner.solve(budget);
      ASSERT_TRUE(r.feasible);
      EXPECT_TRUE(r.stats.exact);
      const double got = objective_of(r);
      EXPECT_NEAR(r.stats.lower_bound, got, 1e-12 * got);
      EXPECT_LE(r.prediction.peak_bytes, budget);
      expect_locally_optimal(p, r, budget);
      for (size_t o = 0; o < p.num_options(); ++o) {
        const Prediction u = evaluate(p, std::vector<int>(p.num_layers(), static_cast<int>(o)));
        if (u.peak_bytes > budget) continue;
        EXPECT_GE(u.step_seconds + kTrafficSecondsPerByte * static_cast<double>(u.offload_bytes),
                  got * (1 - 1e-12));
      }
    }
  }
}

TEST(PlannerTest, WholeMiBLayersAreBoundedWithoutRoundingLoss) {
  // rest_bound() bins kept bytes by their common quantum (1 MiB here) instead of budget /
  // kRestBins: rounded down at every layer, the coarse bins lost up to a bin per layer of
  // room, and these saturated 100-layer solves (copies 1x and 3x a forward) were left
  // without a proof of optimality (9 of 27 such solves proven, now 12).
  for (const auto& [seed, ratio, fraction] :
       {std::tuple{11u, 1.0, 0.4}, std::tuple{12u, 1.0, 0.4}, std::tuple{11u, 3.0, 0.6}}) {
    StepProfile p = six_options(100, seed, ratio);
    p.prefetch_depth = 1;
    const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(peak_of(p, 0)));
    const PlanResult r = Planner(p).solve(budget);
    SCOPED_TRACE("seed " + std::to_string(seed) + " ratio " + std::to_string(ratio));
    ASSERT_TRUE(r.feasible);
    EXPECT_LE(r.prediction.peak_bytes, budget);
    EXPECT_TRUE(r.stats.exact);
    EXPECT_NEAR(r.stats.lower_bound, objective_of(r), 1e-12 * objective_of(r));
  }
}

TEST(PlannerTest, WithATimeToleranceOrAByteQuantumNoPlanIsCalledOptimal) {
  // Tester's inputs (session 23): a time tolerance of 0.5 returned {0, 1} (6.4 s) marked
  // exact where {0, 0} takes 6.1 s; a byte quantum of 3 returned {1, 0} (8.4 s) marked
  // exact where {0, 0} (peak 10 = the budget, 4.0 s) was missed by the rounding.
  StepProfile p;
  p.options = {"o0", "o1"};
  p.layers = {{OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0}},
              {OptionCost{10, 0, 1.0, 3.1}, OptionCost{0, 0, 1.0, 3.4}}};
  const PlanResult loose = Planner(p, 1, 0.5).solve(10);
  ASSERT_TRUE(loose.feasible);
  EXPECT_FALSE(loose.stats.exact);
  EXPECT_TRUE(std::isnan(loose.stats.lower_bound));
  EXPECT_TRUE(Planner(p).solve(10).stats.exact);
  StepProfile q;
  q.options = {"o0", "o1"};
  q.layers = {{OptionCost{10, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 5.4}},
              {OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0}}};
  q.d2h = q.h2d = CopyLink{0.0, 0.007};
  const PlanResult rounded = Planner(q, 3).solve(10);
  ASSERT_TRUE(rounded.feasible);
  EXPECT_LE(rounded.prediction.peak_bytes, 10);
  EXPECT_FALSE(rounded.stats.exact);
  const PlanResult exact = Planner(q).solve(10);
  EXPECT_TRUE(exact.stats.exact);
  EXPECT_EQ(exact.assignment, (std::vector<int>{0, 0}));
}

TEST(PlannerTest, WithAByteQuantumTheBoundStillHoldsBelowTheOptimum) {
  // Bytes rounded up to a quantum make the searches pessimistic (their plans fit, but
  // they may miss plans that fit in exact bytes), so only relaxations may bound the loss.
  // 60 saturated layers, where the rounded searches fall back and report a bound: every
  // finite bound lies below the plan the planner finds in exact bytes (an upper bound of
  // the optimum), and below its optimum where it proves one.
  int bounded = 0;
  for (uint32_t seed : {11u, 12u}) {
    const StepProfile p = six_options(60, seed, 2.0);
    const Planner exact_bytes(p);
    const int64_t none = peak_of(p, 0);
    for (double fraction : {0.25, 0.4}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
      const PlanResult want = exact_bytes.solve(budget);
      ASSERT_TRUE(want.feasible);
      for (int64_t parts : {int64_t{64}, int64_t{256}, int64_t{1024}}) {
        const PlanResult got = Planner(p, budget / parts).solve(budget);
        SCOPED_TRACE("seed " + std::to_string(seed) + " fraction " + std::to_string(fraction) +
                     " parts " + std::to_string(parts));
        ASSERT_TRUE(got.feasible);
        EXPECT_LE(got.prediction.peak_bytes, budget);
        if (std::isnan(got.stats.lower_bound)) continue;
        ++bounded;
        EXPECT_LE(got.stats.lower_bound, objective_of(want) * (1 + 1e-12));
        if (want.stats.exact) EXPECT_LE(got.stats.lower_bound, want.stats.objective * (1 + 1e-12));
      }
    }
  }
  std::printf("[planner] byte quantum, 60 saturated layers: %d finite bounds checked\n", bounded);
  EXPECT_GT(bounded, 3);
}

TEST(PlannerTest, WithAByteQuantumMinPeakFindsAPlanWhereOneExistsAndBoundsTheLeast) {
  // With bytes rounded up per layer the memory-only searches can miss every plan within a
  // host budget that only exact bytes meet: min_peak() returned none where the least-offload
  // plan met it. Now that plan stands where the searches find nothing, and the bound is a
  // relaxation's (bytes rounded down), below brute force's least peak.
  std::mt19937 rng(77);
  int checked = 0, bounded_tight = 0;
  for (int trial = 0; trial < 120; ++trial) {
    StepProfile p = trial_profile(trial, 900);
    scale_bytes(p, 4099);
    const int64_t quantum = 1000 + static_cast<int64_t>(rng() % 30000);
    const int64_t most_host = evaluate(p, std::vector<int>(p.num_layers(), 1)).host_peak_bytes;
    const Planner planner(p, quantum);
    for (double fraction : {0.0, 0.3, 0.7, 1.0}) {
      const int64_t host = static_cast<int64_t>(fraction * static_cast<double>(most_host));
      SCOPED_TRACE("trial " + std::to_string(trial) + " quantum " + std::to_string(quantum) +
                   " host " + std::to_string(host));
      const int64_t want = brute_force_min_peak(p, host);
      const PlanResult got = planner.min_peak({}, host);
      ASSERT_EQ(got.feasible, want >= 0);
      if (!got.feasible) continue;
      ++checked;
      EXPECT_GE(got.prediction.peak_bytes, want);
      EXPECT_LE(got.prediction.host_peak_bytes, host);
      EXPECT_EQ(evaluate(p, got.assignment).peak_bytes, got.prediction.peak_bytes);
      EXPECT_LE(got.stats.least_peak_bound, want);
      if (got.stats.least_peak_bound == want) ++bounded_tight;
    }
  }
  {
    // Every option offloads 1001 bytes and the host budget is exactly what any plan
    // offloads: rounded up to 1000-byte quanta, no search meets it (the case that returned
    // none).
    StepProfile p;
    p.options = {"swap"};
    p.base_bytes = 100;
    p.tail_bytes = 50;
    p.tail_seconds = p.outside_seconds = 0.1;
    p.d2h = p.h2d = CopyLink{0.0, 1e-6};
    for (int k = 0; k < 3; ++k) p.layers.push_back({OptionCost{10, 1001, 1.0, 2.0}});
    const int64_t host = evaluate(p, {0, 0, 0}).host_peak_bytes;
    const PlanResult got = Planner(p, 1000).min_peak({}, host);
    ASSERT_TRUE(got.feasible);
    EXPECT_EQ(got.prediction.peak_bytes, brute_force_min_peak(p, host));
    EXPECT_LE(got.stats.least_peak_bound, got.prediction.peak_bytes);
  }
  std::printf("[planner] byte quantum, min_peak under a host budget: %d checked, %d bounds "
              "equal to the least\n", checked, bounded_tight);
  EXPECT_GT(checked, 300);
}

TEST(PlannerTest, UnderAHostBudgetABudgetAboveOneMetIsMet) {
  // Tester's input (session 22, shrunk from a random profile): 25 layers x 3 options, a
  // host budget. min_peak() met 184 526 663 bytes within it, but solve() at 289 787 835
  // found nothing: the exact search outgrew its limit and the capped search, keeping the
  // fastest labels of each bin of kept bytes (those that offload the most), lost every plan
  // within the host budget. Its bins are now split by host bytes too, and solve() falls
  // back to any plan within the budgets rather than none.
  StepProfile p;
  p.options = {"o0", "o1", "o2"};
  p.layers = {
      {OptionCost{31919056, 0, 0.012140328367600378, 0.022809530418442348}, OptionCost{3702111, 5891040, 0.012438220882707211, 0.05056783752431976}, OptionCost{3702111, 36328043, 0.012637755288121633, 0.03425356374137408}},
      {OptionCost{33764907, 0, 0.011015880371800511, 0.016759260000478005}, OptionCost{226447, 0, 0.011234262626549888, 0.05090315999685945}, OptionCost{226447, 20433754, 0.011191857091254908, 0.02921560061286789}},
      {OptionCost{23617415, 0, 0.010389970047060744, 0.02271520612471808}, OptionCost{3836701, 30798053, 0.010652143185142718, 0.034863164417218546}, OptionCost{3836701, 3254112, 0.010842097831949268, 0.05530296784252302}},
      {OptionCost{26373886, 0, 0.010374570853195864, 0.021121728112594405}, OptionCost{10036970, 7950579, 0.010784142604693058, 0.047080874654219014}, OptionCost{7930521, 21584668, 0.010427772889500904, 0.03347040139671473}},
      {OptionCost{22800261, 0, 0.009283909976861576, 0.022268821251912096}, OptionCost{4526222, 280884, 0.009346138338612435, 0.06787086011538518}, OptionCost{4526222, 37714170, 0.009492077429959438, 0.03314836652332836}},
      {OptionCost{37148856, 0, 0.00836954981266714, 0.018787390473086828}, OptionCost{9060789, 34088553, 0.008748682886973468, 0.02873298536306174}, OptionCost{8619523, 41291661, 0.00875444233810187, 0.02636481350990923}},
      {OptionCost{38828163, 0, 0.013598220851468756, 0.030488402453765186}, OptionCost{39869560, 811149, 0.013893156033380663, 0.09023946235420516}, OptionCost{1586407, 0, 0.013816199845518235, 0.09360554533695772}},
      {OptionCost{36667256, 0, 0.005403696075886222, 0.009438903152789533}, OptionCost{573133, 3902182, 0.005539634568837881, 0.024297036514438614}, OptionCost{573133, 21966259, 0.005532930441847633, 0.015774354240694267}},
      {OptionCost{24087995, 0, 0.014956353525804739, 0.03119412634145767}, OptionCost{151672, 14405247, 0.015624134995068302, 0.05468546468177818}, OptionCost{151672, 0, 0.015468763491936214, 0.09712837157456497}},
      {OptionCost{39660848, 0, 0.010492281412368255, 0.022554071446494045}, OptionCost{6245453, 0, 0.010666659815195668, 0.06552147195671501}, OptionCost{14908342, 7970661, 0.010897918427889054, 0.048124529945000036}},
      {OptionCost{27390969, 0, 0.007253035920994754, 0.017995647642962645}, OptionCost{25647247, 0, 0.007423499065338982, 0.056212885048937636}, OptionCost{5462307, 15497123, 0.007386069111269891, 0.03377365833388813}},
      {OptionCost{23755261, 0, 0.007149221734113038, 0.011242886432981635}, OptionCost{583835, 0, 0.0074055566253473796, 0.03332108922688986}, OptionCost{24401400, 4038531, 0.007214747124041984, 0.0261427689523029}},
      {OptionCost{22440653, 0, 0.012820718874713104, 0.02776199092835788}, OptionCost{20715105, 0, 0.013221177266618313, 0.08279523271271881}, OptionCost{9459988, 36117323, 0.013109572546569978, 0.04016634816058221}},
      {OptionCost{26721601, 0, 0.011374456736344914, 0.02113401074807319}, OptionCost{3528774, 14831310, 0.01145955546236121, 0.03823749086975287}, OptionCost{3528774, 6515829, 0.011867864748637881, 0.046308860919080444}},
      {OptionCost{22850764, 0, 0.006939746389576949, 0.011864977583269988}, OptionCost{769026, 5894406, 0.0070275094983509815, 0.027936066274874216}, OptionCost{769026, 0, 0.00713516515518072, 0.035935439351513755}},
      {OptionCost{22322433, 0, 0.010688959908781772, 0.018145642414600253}, OptionCost{5740445, 0, 0.010941374511445306, 0.05224232780927158}, OptionCost{5740445, 0, 0.010787373835112248, 0.05441343922500287}},
      {OptionCost{27541702, 0, 0.012228099615416741, 0.020986853599816797}, OptionCost{10343318, 20397211, 0.012589502365863823, 0.035526797816399495}, OptionCost{41705291, 27853167, 0.012432038109903511, 0.032086718421095554}},
      {OptionCost{40837949, 0, 0.014363667296843572, 0.029837579422134226}, OptionCost{3817501, 30811766, 0.014915073311162782, 0.04609777265293297}, OptionCost{3817501, 30621053, 0.014700153420937064, 0.045069399863936606}},
      {OptionCost{30151610, 0, 0.006965582971023776, 0.014332582999244997}, OptionCost{15101429, 0, 0.007311506836569501, 0.04108977037423842}, OptionCost{7375983, 10133781, 0.007144084229052834, 0.027509122507799712}},
      {OptionCost{36060383, 0, 0.011064586746866093, 0.024858891319321078}, OptionCost{2430501, 22125783, 0.011267039554212984, 0.040216628590607935}, OptionCost{9226974, 29233681, 0.011149870600996052, 0.03648593686442946}},
      {OptionCost{39517349, 0, 0.007006498787990703, 0.012415536019636296}, OptionCost{6111669, 0, 0.007038317103350991, 0.03607674769205508}, OptionCost{6111669, 0, 0.0073050184836464796, 0.038265964559693756}},
      {OptionCost{41614135, 0, 0.014358374101266152, 0.034062725622598225}, OptionCost{6725024, 34625900, 0.014463397200153378, 0.05027206679792531}, OptionCost{19115048, 0, 0.014621889742707011, 0.10519407904744922}},
      {OptionCost{41027455, 0, 0.012564090702409315, 0.0198541377575342}, OptionCost{22310172, 0, 0.012777911854384311, 0.06163695742018324}, OptionCost{3247929, 2265000, 0.012987595608555452, 0.050188189373339985}},
      {OptionCost{36915508, 0, 0.007827420440703937, 0.014168954466681549}, OptionCost{12949769, 26777219, 0.007928337593778822, 0.022047250612242168}, OptionCost{8108878, 36192932, 0.008019271798023196, 0.02108100029031234}},
      {OptionCost{25264231, 0, 0.012634308515285575, 0.02398837558606938}, OptionCost{6828016, 1453578, 0.012832245380583217, 0.06567479619986916}, OptionCost{6828016, 16031199, 0.012659214918693238, 0.044084529264193484}},
  };
  p.base_bytes = 9437184;
  p.tail_bytes = 20971520;
  p.outside_seconds = 0.01196998141541582;
  p.tail_seconds = 0.006839966695494905;
  p.d2h = CopyLink{0.0001, 1.3270414506836867e-09};
  p.h2d = CopyLink{0.0001, 1.3270414506836867e-09};
  p.prefetch_depth = 1;
  const Planner planner(p);
  const int64_t host = 204626404;
  const PlanResult least = planner.min_peak({}, host);
  ASSERT_TRUE(least.feasible);
  EXPECT_LE(least.prediction.host_peak_bytes, host);
  for (int64_t budget : {least.prediction.peak_bytes, int64_t{230000000}, int64_t{289787835},
                         int64_t{350000000}}) {
    const PlanResult r = planner.solve(budget, {}, host);
    SCOPED_TRACE("budget " + std::to_string(budget));
    ASSERT_TRUE(r.feasible);
    EXPECT_LE(r.prediction.peak_bytes, budget);
    EXPECT_LE(r.prediction.host_peak_bytes, host);
    // A larger budget never needs a slower plan: the plan at min_peak() fits here too.
    EXPECT_LE(objective_of(r), objective_of(least) * (1 + 1e-9));
  }
}

// min_peak() under a host budget spends its exact searches only where relaxations cannot
// decide (Planner.h): random profiles with deferred, held and shared bytes, in bytes and
// scaled by 4099 (where its rounded-down relaxations run), at host budgets from none to
// all: the least peak within the host budget is brute force's, and its plan meets both.
TEST(PlannerTest, MinPeakUnderAHostBudgetIsBruteForces) {
  std::mt19937 rng(31);
  int checked = 0, refused = 0;
  for (int trial = 0; trial < 240; ++trial) {
    StepProfile p = trial_profile(trial, 500);
    for (auto& layer : p.layers) {
      for (auto& c : layer) {
        if (rng() % 3 == 0) c.held_bytes = static_cast<int64_t>(rng() % 3) * c.kept_bytes / 2;
        if (rng() % 4 == 0) c.shared_bytes = 40 * static_cast<int64_t>(rng() % 3);
      }
    }
    scale_bytes(p, trial % 3 == 0 ? 1 : 4099);
    if (trial % 4 == 3) {  // only the options that offload (some host budgets are refused)
      p.options = {p.options[1], p.options[3]};
      for (auto& layer : p.layers) layer = {layer[1], layer[3]};
    }
    const int64_t most_host =
        evaluate(p, std::vector<int>(p.num_layers(), trial % 4 == 3 ? 0 : 1)).host_peak_bytes;
    const Planner planner(p);
    for (double fraction : {0.0, 0.2, 0.45, 0.7, 1.0}) {
      const int64_t host = static_cast<int64_t>(fraction * static_cast<double>(most_host));
      SCOPED_TRACE("trial " + std::to_string(trial) + " host " + std::to_string(host));
      const int64_t want = brute_force_min_peak(p, host);
      const PlanResult got = planner.min_peak({}, host);
      ASSERT_EQ(got.feasible, want >= 0);
      if (!got.feasible) {
        ++refused;
        continue;
      }
      EXPECT_EQ(got.prediction.peak_bytes, want);
      EXPECT_EQ(got.stats.least_peak_bound, want);  // proven: small fronts stay exact
      EXPECT_LE(got.prediction.host_peak_bytes, host);
      ++checked;
    }
  }
  std::printf("[planner] min_peak under a host budget: %d checked, %d refused\n", checked,
              refused);
  EXPECT_GT(checked, 900);
  EXPECT_GT(refused, 20);
}

// Random layers whose options all offload a lot, on a link 2-3x slower than the forwards
// (a tester's generator, session 22): the capped searches' plans are far from optimal
// there, the relaxation's bound far below them.
StepProfile random_offloading(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto uni = [&](double a, double b) { return a + (b - a) * u(rng); };
  auto mib = [&](int a, int b) {
    return std::uniform_int_distribution<int64_t>(a * kMiB, b * kMiB)(rng);
  };
  StepProfile p;
  const size_t s = 3 + rng() % 4;
  p.options = {"o0", "o1", "o2", "o3", "o4", "o5"};
  p.options.resize(s);
  p.base_bytes = mib(0, 10);
  p.tail_bytes = mib(0, 40);
  p.outside_seconds = uni(0.0, 0.02);
  p.tail_seconds = uni(0.0, 0.01);
  double forwards = 0.0, offloads = 0.0;
  int offloading = 0;
  for (size_t k = 0; k < n; ++k) {
    const double f = uni(0.5, 1.5) * 0.01, b = f * uni(1.5, 2.5);
    const int64_t common = mib(0, 10);
    std::vector<OptionCost> layer{OptionCost{mib(20, 40), 0, f, b}};
    for (size_t o = 1; o < s; ++o) {
      const int64_t off = u(rng) < 0.25 ? 0 : mib(1, 40);
      const int64_t kept = u(rng) < 0.6 ? common : mib(0, 40);
      const double mi_off = static_cast<double>(off) / static_cast<double>(kMiB);
      layer.push_back(OptionCost{kept, off, f * uni(1.0, 1.05),
                                 b * (1.0 + 2.0 / (1.0 + mi_off / 10.0)) * uni(0.95, 1.05)});
      if (off > 0) {
        offloads += static_cast<double>(off);
        ++offloading;
      }
    }
    forwards += f;
    p.layers.push_back(layer);
  }
  const double per_byte = uni(2.0, 3.0) * (forwards / static_cast<double>(n)) /
                          (offloads / std::max(1, offloading));
  p.d2h = CopyLink{1e-4, per_byte};
  p.h2d = CopyLink{1e-4, per_byte};
  p.prefetch_depth = 1;
  return p;
}

// Small random profiles whose options all offload a lot on a link 2-3x slower than the
// forwards, so labels of a layer differ by their D2H backlog (the fronts prune() keeps as
// staircases of time and time + backlog, and compares across `used` sets): every solve is
// brute force's optimum, at prefetch depths 0 and 1, with and without shared charges.
TEST(PlannerTest, SaturatedSmallProfilesMatchBruteForce) {
  std::mt19937 rng(7);
  int solved = 0;
  for (uint32_t seed = 0; seed < 240; ++seed) {
    size_t n = 3 + seed % 4;
    StepProfile p = random_offloading(n, seed + 1000);
    while (n > 2 && std::pow(static_cast<double>(p.num_options()), static_cast<double>(n)) > 5e4) {
      p.layers.pop_back();
      --n;
    }
    p.prefetch_depth = static_cast<int>(seed % 2);
    if (seed % 3 == 0) {  // shared charges: labels of unlike `used` sets
      for (size_t k = 1; k < n; ++k) {
        for (auto& c : p.layers[k]) c.shared_bytes = static_cast<int64_t>(rng() % 3) * kMiB;
      }
    }
    const Planner planner(p);
    const int64_t none = peak_of(p, 0);
    for (double fraction : {0.3, 0.5, 0.7, 1.0}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
      SCOPED_TRACE("seed " + std::to_string(seed) + " fraction " + std::to_string(fraction));
      const Best want = brute_force(p, budget);
      const PlanResult got = planner.solve(budget);
      ASSERT_EQ(got.feasible, want.found);
      if (!want.found) continue;
      EXPECT_LE(got.prediction.peak_bytes, budget);
      EXPECT_TRUE(got.stats.exact);
      EXPECT_NEAR(objective_of(got), want.time, 1e-12 * want.time);
      ++solved;
    }
  }
  std::printf("[planner] saturated small profiles: %d solves equal brute force\n", solved);
  EXPECT_GT(solved, 600);
}

TEST(PlannerTest, APlanNotProvenOptimalIsLocallyOptimal) {
  // Where the searches prove no plan optimal, solve() improves its plan one layer's option
  // at a time (polish()): no single change within the budget is faster. Without that, a
  // random 100-layer profile's plan lost 9.7 % of its step time to such changes.
  // Also a tester's 100-layer one (seed 101, 25 %), where polish() stopped after its 4
  // passes 0.5 % above the local optimum (it now runs until a pass changes nothing).
  int inexact = 0;
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u, 6u, 101u}) {
    const StepProfile p = random_offloading(seed == 101 ? 100 : 60, seed);
    const Planner planner(p);
    const int64_t none = peak_of(p, 0);
    for (double fraction : {seed == 101 ? 0.25 : 0.2, 0.35}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none));
      const PlanResult r = planner.solve(budget);
      if (!r.feasible) continue;
      SCOPED_TRACE("seed " + std::to_string(seed) + " fraction " + std::to_string(fraction));
      EXPECT_LE(r.prediction.peak_bytes, budget);
      const double got = objective_of(r);
      EXPECT_NEAR(r.stats.objective, got, 1e-12 * got);
      if (r.stats.exact) continue;
      ++inexact;
      EXPECT_LE(r.stats.lower_bound, got);
      expect_locally_optimal(p, r, budget);
    }
  }
  std::printf("[planner] random offloading profiles: %d plans not proven optimal, each locally "
              "optimal\n", inexact);
  EXPECT_GT(inexact, 3);
}

// A tester's 100-layer profile whose options all offload a lot, under a host budget: the
// deepening's exact searches scanned their fronts for 15 s (labels carrying host bytes
// stay out of prune()'s staircases) and created 4.2 million labels; they now give up as
// the other searches with a cut-off do (kCutScanPerLabel), about 2 million in all.
TEST(PlannerTest, UnderAHostBudgetTheDeepeningGivesUpWhereItScans) {
  const StepProfile p = random_offloading(100, 14);
  const Planner planner(p);
  const int64_t none = peak_of(p, 0);
  const int64_t budget = static_cast<int64_t>(0.4 * static_cast<double>(none));
  const int64_t host = none / 2;
  const PlanResult r = planner.solve(budget, {}, host);
  ASSERT_TRUE(r.feasible);
  EXPECT_LE(r.prediction.peak_bytes, budget);
  EXPECT_LE(r.prediction.host_peak_bytes, host);
  EXPECT_LE(r.stats.lower_bound, objective_of(r));
  EXPECT_LT(r.stats.labels_created, 3000000);
}

// 100 layers x the six strategies with byte counts that share no grid (a new-user
// tester's profile, session 24, had them): under a host budget the least peak is a
// knapsack over which saved bytes go to the host, and the exact (kept, host) fronts hold
// every distinct sum of offloaded bytes.
StepProfile odd_six_options(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> jitter(0.8, 1.2);
  StepProfile p;
  p.options = {"none", "checkpoint", "selective", "swap", "selective_swap", "checkpoint_swap"};
  p.base_bytes = 2 * kMiB;
  p.tail_bytes = 16 * kMiB;
  p.outside_seconds = 0.01;
  p.tail_seconds = 0.004;
  double per_byte = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const int64_t saved = static_cast<int64_t>(4 + rng() % 37) * kMiB + rng() % 4096;
    const int64_t inputs = saved / 8, matmul = saved / 3;
    const double f = 0.01 * jitter(rng) * std::vector<double>{0.1, 1.0, 5.0}[rng() % 3];
    const double b = 2 * f * jitter(rng), ck = b + f * jitter(rng), sel = b + 0.4 * f * jitter(rng);
    p.layers.push_back({OptionCost{saved, 0, f, b}, OptionCost{inputs, 0, f, ck},
                        OptionCost{inputs + matmul, 0, f, sel},
                        OptionCost{inputs, saved - inputs, 1.05 * f, 1.02 * b},
                        OptionCost{inputs, matmul, f, sel}, OptionCost{0, inputs, f, ck}});
    per_byte += 0.5 * f / static_cast<double>(saved - inputs);
  }
  p.d2h = p.h2d = CopyLink{1e-4, per_byte / static_cast<double>(n)};
  p.prefetch_depth = 1;
  return p;
}

TEST(PlannerTest, UnderAHostBudgetTheLeastPeakIsBoundedInWorkAndProvenWithinAGap) {
  // Before: min_peak() ran 4 exact probes of 311 million labels each near the least peak
  // (75 s each; the tester's own profile ran for minutes), and solve() at a budget below
  // it, 825 million labels to find no plan (255 s). Now the lookahead drops labels that
  // cannot meet both budgets, and the exact probes stop at kMinPeakExactLabels: the
  // plan's peak stands with a proven bound below it.
  const StepProfile p = odd_six_options(100, 5);
  const Planner planner(p);
  const int64_t host = 64 * kMiB;
  const PlanResult r = planner.min_peak({}, host);
  ASSERT_TRUE(r.feasible);
  const int64_t peak = r.prediction.peak_bytes, bound = r.stats.least_peak_bound;
  std::printf("[planner] least peak under a 64 MiB host budget: %lld bytes, proven >= %lld "
              "(gap %.4f %%), %lld labels\n",
              static_cast<long long>(peak), static_cast<long long>(bound),
              100.0 * static_cast<double>(peak - bound) / static_cast<double>(peak),
              static_cast<long long>(r.stats.labels_created));
  EXPECT_LE(r.prediction.host_peak_bytes, host);
  EXPECT_EQ(evaluate(p, r.assignment).peak_bytes, peak);
  EXPECT_LE(bound, peak);
  EXPECT_LE(static_cast<double>(peak - bound), 0.005 * static_cast<double>(peak));
  EXPECT_LT(r.stats.labels_created, 60000000);
  // The bound is proven: no plan below it. The peak found is a budget met.
  const PlanResult below = planner.solve(bound - 1, {}, host);
  EXPECT_FALSE(below.feasible);
  EXPECT_LT(below.stats.labels_created, 20000000);
  const PlanResult at = planner.solve(peak, {}, host);
  ASSERT_TRUE(at.feasible);
  EXPECT_LE(at.prediction.peak_bytes, peak);
  EXPECT_LE(at.prediction.host_peak_bytes, host);
  // Its bound is known (it was NaN where the memory-only plan stood; tester), and holds.
  ASSERT_TRUE(std::isfinite(at.stats.lower_bound));
  EXPECT_LE(at.stats.lower_bound, objective_of(at) * (1 + 1e-12));
  // Far below the least peak the lookahead refuses at once.
  const PlanResult half = planner.solve(peak / 2, {}, host);
  EXPECT_FALSE(half.feasible);
  EXPECT_LT(half.stats.labels_created, 5000000);
}

TEST(PlannerTest, TheLookaheadIsExactForByteCountsAboveDoublePrecision) {
  // Bytes up to 2^60 are valid; the lookahead's priced sums in doubles rounded by more
  // than their slack above 2^53, and dropped the only plan, which meets the budget to the
  // byte (a tester's fuzz at 2^45-2^47 scales: refusals and slower plans called exact).
  StepProfile p;
  p.options = {"none"};
  p.tail_seconds = 0.1;
  p.layers = {{OptionCost{66786476156391903, 0, 1.0, 2.0}},
              {OptionCost{48003320551332213, 0, 1.0, 2.0}}};
  const int64_t budget = evaluate(p, {0, 0}).peak_bytes;
  const Planner planner(p);
  for (int64_t host : {int64_t{-1}, int64_t{0}}) {
    const PlanResult r = planner.solve(budget, {}, host);
    ASSERT_TRUE(r.feasible) << "host " << host;
    EXPECT_EQ(r.prediction.peak_bytes, budget);
  }
  EXPECT_EQ(planner.min_peak({}, 0).stats.least_peak_bound, budget);
}

TEST(PlannerTest, HostBudgetOnThirtyLayersStaysSmallAndBounded) {
  // 30 layers x 6 options under a host budget: the host bytes make a second dimension of
  // the fronts. The fallback's bound used to search a byte grid of kept x host bytes
  // without limit (18.6 million labels, minutes for this solve); now the host-priced
  // relaxation, the grid only while its fronts stay small. The plan meets both budgets,
  // and the bound lies below the plan and below every uniform plan within both.
  for (double ratio : {0.5, 2.0}) {
    const StepProfile p = six_options(30, 11, ratio);
    const Planner planner(p);
    const int64_t none = peak_of(p, 0);
    const int64_t budget = static_cast<int64_t>(0.45 * static_cast<double>(none));
    const int64_t host = static_cast<int64_t>(0.3 * static_cast<double>(none));
    SCOPED_TRACE("ratio " + std::to_string(ratio));
    const PlanResult r = planner.solve(budget, {}, host);
    ASSERT_TRUE(r.feasible);
    EXPECT_LE(r.prediction.peak_bytes, budget);
    EXPECT_LE(r.prediction.host_peak_bytes, host);
    EXPECT_LT(r.stats.labels_created, 2000000);
    const double got = objective_of(r);
    ASSERT_TRUE(std::isfinite(r.stats.lower_bound));
    EXPECT_LE(r.stats.lower_bound, got * (1 + 1e-12));
    for (size_t o = 0; o < p.num_options(); ++o) {
      const Prediction u = evaluate(p, std::vector<int>(p.num_layers(), static_cast<int>(o)));
      if (u.peak_bytes > budget || u.host_peak_bytes > host) continue;
      EXPECT_LE(r.stats.lower_bound,
                u.step_seconds + kTrafficSecondsPerByte * static_cast<double>(u.offload_bytes));
    }
    // Measured 0.10 % at ratio 0.5 (fallback; 0.61-0.77 % before its bins were split by
    // host bytes), 1.25 million labels created; exact at ratio 2 (the cut-off search).
    EXPECT_LT(got / r.stats.lower_bound - 1.0, 0.02);
    std::printf("[planner] 30 layers, host budget 0.3 none, ratio %.1f: plan %.4f s, lower "
                "bound %.4f s (gap %.2f %%), %lld labels created\n",
                ratio, got, r.stats.lower_bound, 100.0 * (got / r.stats.lower_bound - 1.0),
                static_cast<long long>(r.stats.labels_created));
  }
}

TEST(PlannerTest, LowerBoundOfAnExactSearchIsItsOptimum) {
  StepProfile p = six_options(8, 5, 1.0);
  const Planner planner(p);
  const int64_t none = peak_of(p, 0);
  const PlanResult r = planner.solve(none / 2);
  ASSERT_TRUE(r.feasible);
  EXPECT_TRUE(r.stats.exact);
  EXPECT_NEAR(r.stats.lower_bound, objective_of(r), 1e-12);
  // A byte quantum or a tolerance makes the search inexact: no bound is claimed.
  EXPECT_TRUE(std::isnan(Planner(p, 1 << 20).solve(none / 2).stats.lower_bound));
  EXPECT_TRUE(std::isnan(Planner(p, 1, 0.01).solve(none / 2).stats.lower_bound));
}

TEST(PlannerTest, AnExactPlanFoundAfterTheCutOffsFailedKeepsItsBound) {
  // A tight budget where the first cut-off finds no plan and the fallback none either:
  // the exact search without a cut-off answers, and its bound is its optimum (it had
  // been reported NaN; tester's case, one huge layer among small ones).
  StepProfile p;
  p.options = {"o0", "o1", "o2"};
  p.layers = {
      {OptionCost{821037, 0, 0.005441378739412974, 0.012310786423208528},
       OptionCost{1367109, 0, 0.00507398389436226, 0.011751378853879616},
       OptionCost{0, 2106573, 0.005299825178671595, 0.013644033451916863}},
      {OptionCost{413738600, 0, 0.1682090951209947, 0.2666742040032694},
       OptionCost{0, 703413000, 0.17173976109670344, 0.5478234225485571},
       OptionCost{114689625, 458524815, 0.16843422994822005, 0.44394632576703186}},
      {OptionCost{2969889, 0, 0.00370620545473299, 0.008442267489529606},
       OptionCost{0, 288525, 0.003548312790384118, 0.01225316447993027},
       OptionCost{525227, 242431, 0.003820900018326929, 0.009593910343655159}},
      {OptionCost{2545221, 0, 0.0196836311669857, 0.044912288511739534},
       OptionCost{589921, 956619, 0.019620592553720454, 0.07982369286467102},
       OptionCost{1478817, 171894, 0.02038894143145154, 0.06672108307776009}}};
  p.base_bytes = 160971;
  p.tail_bytes = 2164549;
  p.outside_seconds = 0.01707944739067245;
  p.tail_seconds = 0.0030229616438263397;
  p.d2h = CopyLink{0.0001, 1.338934584969528e-10};
  p.h2d = CopyLink{0.000131680968766903, 1.5497987217102465e-10};
  p.prefetch_depth = 1;
  const int64_t budget = 417610660;
  const PlanResult r = Planner(p).solve(budget);
  const Best want = brute_force(p, budget);
  ASSERT_TRUE(want.found);
  ASSERT_TRUE(r.feasible);
  EXPECT_TRUE(r.stats.exact);
  EXPECT_NEAR(objective_of(r), want.time, 1e-12 * want.time);
  ASSERT_TRUE(std::isfinite(r.stats.lower_bound));
  EXPECT_NEAR(r.stats.lower_bound, objective_of(r), 1e-12 * want.time);
}

TEST(PlannerTest, RejectsBadInput) {
  StepProfile p = synthetic(3, 1, 1.0);
  p.layers[1].pop_back();
  EXPECT_THROW(Planner{p}, c10::ValueError);
  p = synthetic(3, 1, 1.0);
  p.layers[0][0].forward_seconds = -1.0;
  EXPECT_THROW(Planner{p}, c10::ValueError);
  p = synthetic(3, 1, 1.0);
  EXPECT_THROW(evaluate(p, {0, 0}), c10::ValueError);
  EXPECT_THROW(evaluate(p, {0, 0, 9}), c10::ValueError);
  const Planner planner(p);
  EXPECT_THROW(planner.solve(1 << 30, {1, 1}), c10::ValueError);
  EXPECT_THROW(planner.solve(1 << 30, {1, 0, 1}), c10::ValueError);
  EXPECT_THROW(planner.solve(1 << 30, {}, -1, -1), c10::ValueError);  // deepening_labels
  // A budget below the bytes held outside the layers can never be met; at them, only by
  // a plan holding nothing else (none here: every option keeps bytes).
  EXPECT_FALSE(planner.solve(p.base_bytes - 1).feasible);
  EXPECT_FALSE(planner.solve(p.base_bytes).feasible);
  p.prefetch_depth = -1;
  EXPECT_THROW(Planner{p}, c10::ValueError);
  p.prefetch_depth = 1;
  EXPECT_THROW((Planner{p, 0}), c10::ValueError);
  EXPECT_THROW((Planner{p, kMaxProfileBytes + 1}), c10::ValueError);
  // Bytes adding up past 2^60 would overflow the planner's sums and sort keys (a tester's
  // profile of two 2^61-byte layers was solved wrong and called exact): refused.
  p = synthetic(3, 1, 1.0);
  p.layers[1][0].kept_bytes = kMaxProfileBytes;
  EXPECT_THROW(Planner{p}, c10::ValueError);
  EXPECT_THROW(p.validate(), c10::ValueError);  // (planner_evaluate's binding checks it)
  p.layers[1][0].kept_bytes = kMaxProfileBytes / 2;  // the sum still fits
  EXPECT_NO_THROW(Planner{p});
}

TEST(PlannerTest, ABudgetOfTheBaseBytesIsMetByAPlanHoldingNothingElse) {
  // solve() had refused every budget <= base_bytes, while min_peak() returned a plan whose
  // peak was the base bytes (tester).
  StepProfile p;
  p.options = {"none", "swap"};
  p.base_bytes = 1000;
  p.layers = {{OptionCost{0, 0, 1.0, 1.0}, OptionCost{0, 0, 1.0, 1.0}},
              {OptionCost{64, 0, 1.0, 1.0}, OptionCost{0, 0, 1.5, 1.0}}};
  const Planner planner(p);
  const PlanResult r = planner.solve(1000);
  ASSERT_TRUE(r.feasible);
  EXPECT_EQ(r.prediction.peak_bytes, 1000);
  EXPECT_EQ(r.assignment[1], 1);
  EXPECT_FALSE(planner.solve(999).feasible);
  const PlanResult least = planner.min_peak();
  ASSERT_TRUE(least.feasible);
  EXPECT_EQ(least.prediction.peak_bytes, 1000);
}

TEST(PlannerTest, AllowedMasksRestrictOptions) {
  const StepProfile p = synthetic(6, 5, 1.0);
  const Planner planner(p);
  const int64_t none = peak_of(p, 0);
  // Only none or checkpoint: no swap chosen whatever the budget.
  const PlanResult r = planner.solve(none / 2, std::vector<uint64_t>(6, 0b0011));
  ASSERT_TRUE(r.feasible);
  for (int o : r.assignment) EXPECT_LE(o, 1);
  EXPECT_EQ(r.prediction.offload_bytes, 0);
}

}  // namespace
}  // namespace hyper_parallel::planner
