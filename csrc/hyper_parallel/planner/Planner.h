#pragma once
// Planner: the exact optimizer over per-layer strategies (docs/design.md, "Planner").
//
// Minimises the predicted step time of CostModel.h under a peak-bytes budget; ties go to
// less host traffic: the objective is step_seconds + kTrafficSecondsPerByte * offload
// bytes (1e-15 s per byte: 1 us per GB, far below any measured time difference).
//
// Method: dynamic programming over the layers in forward order. A state is
//   (bytes kept so far, in quanta of the byte grid; the previous layer's option; phase)
// and holds a Pareto set of labels (objective so far, copy backlog).
// The byte grid makes the memory constraint a knapsack; every sample point of the cost
// model depends only on the kept prefix and on the current and previous layer, so it is
// checked exactly on the grid. Bytes are rounded to the nearest quantum and the plan
// found is checked with the exact bytes; if it overshoots, the search runs again with the
// budget lowered by the overshoot (a few times), then with bytes rounded up, so a plan
// returned always meets the budget. The time terms decompose because the D2H stream is FIFO
// and the prefetch depth is 1: a reload other than the first one of the backward never
// waits for its D2H copy (all copies queued before the last offload are done by then), so
// it stalls by max(0, reload - backward of the next layer); the first reload (of the last
// offloading layer m) waits for the D2H backlog left at m's release point minus the work
// that runs after it (forwards after m, the tail, backwards of layers above m + 1). The
// phase says whether m was already chosen, the label's backlog carries that queue; labels
// are pruned only when another label of the same state is no worse in objective and
// backlog. A backlog that the work before the first reload surely drains, whatever the
// later layers choose, is set to 0 (exact). So the search is exact for the model on the
// byte grid (a brute-force test checks it); the plan it returns always meets the budget
// and its prediction is evaluate()'s. With time_quantum_seconds > 0 the backlog is also
// rounded up to that grid (fewer distinct labels; exact only for times on the grid).
//
// Cost: O(layers * grid * options^2 * Pareto size). The Pareto sets stay small while
// copies fit their windows (the 8 layers x 6 options of bench_planner.py: 1 to 40 ms);
// when the copies compete with the forwards they grow with the layer count (100 layers x
// 6 options, grid 1024, copies at half a forward: 1.5 to 3 s on a loaded 2-core machine,
// PlannerTest.HundredLayers); rounding the backlog (time_quantum_seconds) did not make
// that case faster in our measurements.
//
// Thread-safety: a Planner is immutable after construction; solve() may run concurrently.

#include "hyper_parallel/planner/CostModel.h"

#include <cstdint>
#include <vector>

namespace hyper_parallel::planner {

inline constexpr double kTrafficSecondsPerByte = 1e-15;

struct PlanResult {
  bool feasible = false;
  std::vector<int> assignment;  // option index per layer (empty when infeasible)
  Prediction prediction;        // evaluate(profile, assignment)
};

class Planner {
 public:
  // `grid`: number of byte quanta the budget is split into (>= 16).
  // `time_quantum_seconds`: the backlog's time grid (0: exact).
  explicit Planner(StepProfile profile, int grid = 1024, double time_quantum_seconds = 0.0);

  // The fastest plan whose predicted peak is <= budget_bytes, or feasible = false.
  // `allowed[k]` (optional, one bit per option) restricts the options of layer k.
  PlanResult solve(int64_t budget_bytes, const std::vector<uint64_t>& allowed = {}) const;
  // The smallest predicted peak that some plan reaches (searched on the byte grid of the
  // none plan's peak), with the fastest plan at that peak.
  PlanResult min_peak(const std::vector<uint64_t>& allowed = {}) const;

  const StepProfile& profile() const { return profile_; }

 private:
  // Whether some plan fits `budget_bytes` on a grid of `quantum` bytes (memory only).
  bool fits(int64_t budget_bytes, int64_t quantum, const std::vector<uint64_t>& allowed) const;
  // `budget_bytes` is checked on the grid with bytes rounded up (`conservative`) or to
  // the nearest quantum.
  PlanResult solve_on_grid(int64_t budget_bytes, int64_t quantum,
                           const std::vector<uint64_t>& allowed, bool conservative = true) const;
  std::vector<uint64_t> masks(const std::vector<uint64_t>& allowed) const;

  StepProfile profile_;
  int grid_;
  double time_quantum_;
};

}  // namespace hyper_parallel::planner
