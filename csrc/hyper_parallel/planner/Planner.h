#pragma once
// Planner: the exact optimizer over per-layer strategies (docs/design.md, "Planner").
//
// Minimises the predicted step time of CostModel.h under a peak-bytes budget on the
// device and, optionally, a budget of host bytes; ties go to less host traffic: the
// objective is step_seconds + kTrafficSecondsPerByte * offload bytes (1e-15 s per byte:
// 1 us per GB, far below any measured time difference).
//
// Method: dynamic programming over the layers in forward order with exact bytes. After
// layer k a label holds
//   (kept bytes of L0..Lk, host bytes, the offload class of Lk .. Lk-d+1, phase;
//    objective so far, D2H backlog)
// where the offload class of a layer is which of its distinct offload sizes it took (the
// backward sample points of the next d layers need them) and the phase says whether the
// last offloading layer m was chosen yet. Every sample point of the cost model depends
// only on the kept prefix, the current layer and the d layers before it, so the memory
// constraints are checked exactly, in bytes. The time terms decompose because the D2H
// stream is FIFO and reloads run in descending layer order: only the first reload of the
// backward (that of m) can wait for a D2H copy (all earlier ones finished before m's);
// with depth 1 every other reload of Lk stalls by max(0, reload - backward of Lk+1), with
// depth 0 by its whole reload time; m's reload waits for the backlog left at m's release
// point minus the work that runs after it (forwards after m, the tail, the backwards above
// it), which the label's backlog carries through the later layers.
//
// Pruning (exact): among labels of the same phase (and, at depth >= 2, the same
// classes), label A dominates B when
//   kept_A <= kept_B, host_A <= host_B, pending_A <= pending_B (deferred bytes, below),
//   (depth 1) the offload bytes of A's last layer <= B's, and
//   objective_A + max(0, backlog_A - backlog_B) <= objective_B.
// This is sound because every constraint of the later layers is monotone in the kept and
// host bytes, the two terms that read the last layer's offload class (the next layer's
// backward sample point and its reload stall) are non-decreasing in its bytes, and the
// final objective is (objective so far) + g(backlog) with g non-decreasing and
// 1-Lipschitz (the backlog only passes through max(0, b - x) + y and is finally added to
// the time). Labels are swept in increasing kept bytes per phase (and classes), each
// checked against the front of those before it; entries without host bytes, held-bytes
// slack or a backlog past `linear` (below) sit in staircases of (time, time + backlog) per
// pending figure, so one binary search judges a label against all of them (scanned, a
// saturated profile's labels cost up to 10^4 visits each). Labels whose `used` sets
// differ (shared charge, below) compare when the dominating one's set holds the other's.
// A backlog that the work
// before the first reload surely drains, whatever the later layers choose, is set to 0;
// two backlogs both at least the most work left (every later max(0, .) passes them
// through) compare by objective + backlog alone (both exact). So the search is exact for
// the cost model, at every depth d <= 1 and every budget (no byte grid: the brute-force
// GoogleTest checks it), and a larger budget never gives a slower plan (the feasible set
// only grows), unless solve() falls back (below) and the fallback's plan is not proven
// optimal.
//
// Branch and bound (solve(), without a time tolerance): rest_bound() solves the fallback's
// relaxation (below) backwards over kept bytes rounded down (kRestBins), which bounds from
// below the time any completion of a label can take (a second table, over completions
// that offload nothing, for labels past the last offload). The search drops, at birth,
// every label whose time plus that bound (plus, while draining, the backlog the remaining
// work cannot hide) exceeds a cut-off; every label on the path of a plan within the
// cut-off stays (dominance and the cut-off agree: the bound is non-decreasing in kept bytes
// and in the last layer's offload bytes), so the best plan found within it is the optimum.
// The first cut-off lies kCutoffFirst above the relaxation's optimum. When no plan is found
// within it, the capped searches (below) find a plan, and the deepening raises the cut-off
// from the best proven bound towards that plan's objective: (plan - bound) /
// kDeepeningFirst above it first, each next step kDeepeningGrowth times the last, the
// searches together allowed `deepening_labels` labels, kDeepeningLabels by default (only
// where the plan lies within kDeepeningGap of the bound; beyond it one search at the
// plan's objective runs), stopping early where the next search, guessed from the growth
// of the last two, would outgrow what is left. A search that ends without a plan within
// its cut-off proves the optimum above it; the first that finds one has found the
// optimum. Unsaturated 100-layer profiles: 14-30 ms, 20-50x fewer labels created;
// saturated 100-layer ones (copies 1-3x a forward, budgets 25-60 % of none; 27 of
// bench_planner's synthetic profiles): all 27 proven optimal, median 42 ms, the six
// hardest (25 % at copies 2-3x) 1.4-4.3 s and 7.7-15.5 million labels on a loaded CPU
// (with 2 million labels, until session 26: 21 proven, at most 0.5 s, the six within
// 0.2-0.4 % of their bounds and 0.03-0.09 % above the optima found now); decoder profiles
// tiled from a measured Llama (copies 1.6x and 2x a forward): 100 layers in 23-28 ms,
// 128 in 0.2 s, 160-200 in 1-2 s, proven optimal (one 200-layer solve stops early,
// within 0.008 %). Where the deepening cannot close the gap (200-300 saturated layers at
// 25 %: gaps 0.3-0.8 %) it spends 1-1.7 s and the capped plan stands.
//
// Deferred bytes (OptionCost::deferred_bytes, a layer input its caller still holds at the
// layer's release point; they leave at the next layer's release point): bytes and time are
// exact. The next layer's forward sample point counts them (the label carries its last
// layer's deferred bytes, `pending`). Their copy joins the D2H queue at the next release
// point, behind that layer's own offload, as a copy of its own (its own latency), and its
// layer's reload waits for it. So the reloads that can wait for a D2H copy are the first
// (of the last offloading layer m) and, when m defers nothing, the second (of m-1, whose
// deferred copy ends the queue). Working the schedule through (depth 1, times after the
// gradient of m+1 arrives, D: when the whole queue ends, B: m-1's deferred copy, H: reload
// times, b: backward times), L(m-1)'s backward begins at
//   max(max(b(m+1), H(m)) + M, D + max(H(m) + M - B, H(m-1))),  M = max(b(m), H(m-1)),
// which is the formula without deferred bytes with D less B' = min(B, H(m) +
// max(0, b(m) - H(m-1))) (depth 0: B' = min(B, H(m) + b(m))): the label choosing m as the
// last offload carries its backlog less B', and the rest of the search is unchanged; a
// deferred copy of m itself queues after everything (it is added at m+1's release point)
// and m-1's reload then cannot wait. Dominance also asks pending_A <= pending_B (the next
// queue is non-decreasing in it). PlannerTest checks the search's objective against
// evaluate()'s on 4 800 pinned assignments and its optima against brute force.

// Held bytes (OptionCost::held_bytes: saved storages the caller holds until the step
// ends): the backward sample point of Lk counts those of the later layers, which the
// forward search has not chosen yet. Where each layer's options hold alike (the caller
// holds one storage, which every strategy saves: the last layer's input), the search
// charges each later layer that amount, exactly. Where they differ (a module's buffer
// that only some strategies save in the forward), each label also carries its slack: the
// least room its backward sample points leave for the held bytes of the layers after
// them. Choosing Lk's option takes its held bytes out of the slack and adds Lk's own
// point's room; a label whose slack is below the least the layers left can hold is
// dropped, and dominance asks slack_A >= slack_B; a slack that covers the most the later
// layers can hold constrains nothing and is kept as "unconstrained", so such labels
// compare as without held bytes (and only they enter prune()'s staircase, whose entries
// are compared by host bytes and time alone): 100 layers x 6 options with a 1 MiB buffer
// held by two options in every layer solve in 10-20 ms unsaturated (23-62 ms before that
// cap). Exact (brute force: PlannerTest,
// 1 600 solves and 400 min_peak() calls; 24 000 and 6 000 in a longer local run); it
// replaced a search charging the most (or, as a relaxation, the least) and retrying under
// lowered budgets, which refused budgets above ones it met and made min_peak() return
// 1900 B where 1010 B was met (a tester's 3-layer profiles).
//
// Shared charge (CostModel.h): exact. Each label carries `used`, the options run so far
// that some later layer charges for (its option with shared bytes > 0); choosing option o
// at layer k >= 1 keeps its shared bytes when o is not in the set, and a label dominates
// another only when its set holds the other's (its future pays no charge the other's does
// not; sets that held each other only when equal split a 128-layer decoder solve's fronts
// 18-23 ways). The set stays small: on an
// 8-layer Llama profile tiled to 100 layers, where every strategy charges (the causal
// mask, `cache_position`, rotary `cos`/`sin`), the search is exact in 24 ms, at the
// measured link and at copies 2x a forward (it left the charge out and re-searched under a
// lowered budget and charging every run's first layer: 150-220 ms, not proven optimal,
// 0.04 %; and a plan running an option in two separate runs was refused, tester).
//
// Boundary charge (CostModel.h): exact. Each label carries `credit`, the bytes of its
// output's storage the layer just decided saves (capped at the most input_bytes of the
// next layer's options); the next layer's option keeps max(0, input_bytes - credit) more,
// and a label dominates another only when its credit is no less (prune()'s groups are
// (used set, credit) pairs). The profile is first rewritten by
// with_least_boundary_charges() (CostModel.h): the least charge of each option is in its
// kept_bytes, which the relaxations and bounds read, so a charge no option of the layer
// before avoids (a decoder's) costs the search nothing. Brute force:
// PlannerTest.WithBoundaryBytesTheSearchIsExact.
//
// The fallback and its bound: when the copies saturate the link (say 2x a forward over
// 100 layers) the exact fronts reach 10^5-10^6 labels per layer, the (time, backlog)
// trade-off being real at every kept value. solve() gives the exact search up once a
// front holds more than kMaxExactLabels labels or kExactLabelsPerLayer x (layers decided)
// (such fronts grow that fast only in the saturated case; the unsaturated 100-layer
// profiles of PlannerTest stay below 90 per layer and are solved exactly), then runs a
// capped search (a heuristic): the same labels with exact bytes, binned by phase and kept
// bytes (budget / kFallbackBins), each bin keeping the kFallbackPerBin fastest labels no
// other of the bin dominates; bytes being exact, its plan meets the budgets. A second
// capped search follows, with kWideBins bins and that plan's objective as its cut-off,
// which drops most labels at birth: where none of its bins overflowed (prune_capped()
// dropped only dominated labels), it kept every label the exact search keeps, so its plan
// is the optimum (stats.exact); otherwise the faster of the two plans stands, and the
// deepening (above) runs the exact search with cut-offs rising towards its objective (a
// single search at that objective, the way before, gave up on most saturated profiles:
// 3.4 million labels for the 128-layer decoder one). On the Python
// benchmark's saturated 100-layer profile (bench_planner.py --solve-only; optima found by
// an unbounded cut-off search in 20-30 s) the second pass brought the plan from 0.49 %
// and 0.20 % above the optimum to 0.03 % and 0.05 %. The cut-offs after the first also
// bound the D2H backlog: add_linear_bound() solves backwards, with the phases of the
// search, each completion's time plus its backlog increments linearised (a queue
// max(0, q - a) + c is at least q - a + c, and max(0, .) is non-decreasing, so the first
// reload's wait is at least the label's backlog plus the increments after it, less the
// tail), and a label's bound is the larger of that and rest_bound()'s. It proves how
// far that plan can be from the optimum with a relaxation: no D2H backlog (the first
// reload's wait, the only term that reads it, is >= 0), so one phase prices every layer
// (relaxed_bound(): labels swept in kept order by merging the per-option lists, no sort;
// within a bin of budget / kBoundBins kept bytes the labels of a class merge into one with
// the least kept bytes and the least time, a label no worse than each it replaces; with a
// host budget, the host bytes priced into the time: for a price y >= 0 per byte, the
// relaxation's optimum less y x host budget bounds every plan within the host budget
// (Lagrangian relaxation; y searched by golden section on a log scale), together with the
// relaxation on a byte grid rounded down when its search stays within kMaxExactLabels per
// layer, the larger of the two). Its optimum is <= the true optimum, and so are
// rest_bound()'s root, add_linear_bound()'s and the first cut-off when its search ended
// without a plan within it: stats.lower_bound, the largest of them, bounds the plan's
// loss: plan / lower_bound - 1 (0.08-0.47 % on the saturated 100-layer profiles of
// PlannerTest, where one of four is now solved exactly; 100-150 ms each; the exact optima
// lie between). When the plan's objective equals the bound, the plan is optimal and
// stats.exact is true.
//
// Polish: a plan the searches did not prove optimal is improved one layer's option at a
// time while evaluate() finds it faster within both budgets (polish(); the capped
// searches' plans were not even locally optimal on random profiles whose options all
// offload a lot: 9.7 % of a step on a tester's 100-layer one), until no single change
// is, so what solve() returns is locally optimal in the full cost model (kPolishPasses, a
// guard, was never reached: at most 10 passes measured; a cap of 4 left a tester's plan
// 0.5 % above its local optimum).
//
// Depth d >= 2: the memory constraints are exact (the d classes), the time minimised is
// the depth-1 time of the assignment, an upper bound of its depth-d time (a reload issued
// earlier never finishes later: the schedule is a max-plus system, monotone in its issue
// times); the prediction returned is evaluate()'s at depth d. The plan is never called
// optimal there (stats.exact false) and is polished at depth d.
//
// With time_tolerance > 0 a label is also dropped when another is within
// eps = tolerance x (least possible step time) / layers of dominating it; each layer's
// pruning then loses at most eps, so the plan found is within tolerance x its step time of
// the optimum.
// With byte_quantum > 1 the kept and host bytes of a label are rounded up to multiples of
// it after each layer (a sound over-estimate: a plan returned always meets its budgets;
// one whose peak lies within (layers + depth + 2) quanta of the budget may be missed),
// which bounds the distinct kept values per (classes, phase) by the number of quanta.
//
// Cost: O(layers * labels * options) label creations, a sort of each layer's labels by a
// 64-bit key (at depth 1; at other depths by the labels), and per label one binary search
// per offload class of no more bytes in the staircase of the entries without backlog or
// pending bytes (host bytes ascending, time descending: the least time at no more host
// bytes), plus a scan of the others (prune()); 100 unsaturated layers x 6 options:
// 1.3-2.1 million labels created without the cut-off, 45 000-100 000 with it. The fallback O(layers * options *
// (4 * kFallbackBins * kFallbackPerBin^2 + relaxation labels)); PlanResult::stats reports
// the labels of the searches (not relaxed_bound()'s; PlannerTest bounds them).
//
// Thread-safety: a Planner is immutable after construction; solve() may run concurrently.

#include "hyper_parallel/planner/CostModel.h"

#include <cstdint>
#include <limits>
#include <vector>

namespace hyper_parallel::planner {

inline constexpr double kTrafficSecondsPerByte = 1e-15;

struct SearchStats {
  int64_t labels_created = 0;  // labels offered to the fronts, all layers
  int64_t labels_kept = 0;     // labels that survived pruning, all layers
  int64_t widest_layer = 0;    // most labels kept after one layer
  bool exact = true;           // solve(): the plan is proven optimal for the cost model;
                               // never at depth >= 2 or with a time tolerance; with a byte
                               // quantum only where it reaches lower_bound
  bool overflowed = false;     // internal: the search stopped at its label limit
  bool truncated = false;      // internal: the capped search dropped an undominated label
  double objective = 0.0;      // the search's objective of the plan found (seconds)
  // A proven lower bound of the optimal objective (step seconds + traffic term) within
  // the budgets: the objective itself when the search was exact; after the fallback, the
  // optimum of the relaxation (see solve()); NaN where none is known (depth >= 2, a time
  // tolerance, or a byte quantum where the first search answered).
  double lower_bound = 0.0;
  // min_peak(): a proven lower bound (bytes) of the least peak any plan reaches within the
  // host budget; the plan's own peak where it is proven the least (always without a host
  // budget). -1 from solve().
  int64_t least_peak_bound = -1;
};

// Labels one layer of the exact search may keep before solve() falls back.
inline constexpr int64_t kMaxExactLabels = 20000;
// ... and once the front after layer k holds more than kExactLabelsPerLayer x (k + 1)
// labels (fronts growing that fast are the saturated case; see solve()).
inline constexpr int64_t kExactLabelsPerLayer = 150;
// The fallback's bins of kept bytes (budget / kFallbackBins) and labels per bin and phase.
inline constexpr int64_t kFallbackBins = 96;
inline constexpr int kFallbackPerBin = 3;
// Under a host budget, the capped searches' bins of host bytes (host budget / this) in each
// bin of kept bytes.
inline constexpr int64_t kFallbackHostBins = 8;
// Bins of the second capped search, the one with a cut-off (see solve()).
inline constexpr int64_t kWideBins = 384;
// Passes of polish() over the layers, at most (a guard: it stops when a pass changes
// nothing, after at most 10 passes on the profiles measured).
inline constexpr int kPolishPasses = 64;
// Bins of kept bytes of add_linear_bound() (budget / kLinearBins).
inline constexpr int64_t kLinearBins = 256;
// The relaxation's bins of kept bytes (budget / kBoundBins), see relaxed_bound().
inline constexpr int64_t kBoundBins = 512;
// Bins of kept bytes of rest_bound(), and the first cut-off of solve()'s branch and bound
// above the relaxation's optimum (relative; see the header comment for the second).
inline constexpr int64_t kRestBins = 2048;
inline constexpr double kCutoffFirst = 1e-3;
// A search with a cut-off gives up once its prune() visited more than kCutScanPerLabel
// front entries per label created (after kCutScanFloor labels): see search().
inline constexpr int64_t kCutScanPerLabel = 128;
inline constexpr int64_t kCutScanFloor = 20000;
// min_peak() under a host budget: its relaxations' grid, (upper - lower bound) / this; and
// the final labels of a memory-only search whose plans it evaluates for the least peak.
inline constexpr int64_t kMinPeakGrid = 4096;
// ... the labels its exact probes under a host budget may create in all (about 2 s), and
// those solve()'s memory-only fallback search may create under one before least_peak_plan()
// decides.
inline constexpr int64_t kMinPeakExactLabels = 8000000;
inline constexpr int64_t kFallbackMemoryLabels = 4000000;
inline constexpr size_t kPeakCandidates = 256;
// solve()'s deepening: the labels its exact searches may create in all by default (the
// optima of the hardest saturated 100-200-layer profiles measured took 5.6-15.5 million
// in all, about 3 million a second), the first cut-off's distance above the lower bound
// (the gap to the plan known / this), and the factor by which each next distance grows.
inline constexpr int64_t kDeepeningLabels = 24000000;
inline constexpr double kDeepeningFirst = 32.0;
inline constexpr double kDeepeningGrowth = 2.0;
// ... and the largest gap between the plan known and the bound (relative) it tries to close
// (the saturated profiles it solves lie within 0.1-0.6 %).
inline constexpr double kDeepeningGap = 0.01;
// ... and the most labels one layer of them may keep.
inline constexpr int64_t kDeepeningWidest = 250000;
// ... and the growth of the labels from the first search to the second, guessed before two
// are known (measured 1.1-13x per doubling of the cut-off's distance above the bound; a
// 300-layer saturated solve whose first search took 5.3 million labels ran a second that
// outgrew the 19 million left, 4.5 s for nothing).
inline constexpr int64_t kDeepeningGuessGrowth = 4;
// search()'s lookahead under a host budget: the prices of a host byte in kept bytes at
// which it checks that the layers left can still meet both budgets (Planner.cpp); kept and
// offloaded bytes trade about 1:1 between the strategies, so prices around 1.
// (In eighths: 1/8 .. 8; the check runs in integers.)
inline constexpr int kLookaheadPrices = 7;
inline constexpr int64_t kLookaheadEighths[kLookaheadPrices] = {1, 2, 4, 8, 16, 32, 64};
// Golden-section steps of host_priced_bound()'s price search.
inline constexpr int kHostPriceSteps = 24;

struct PlanResult {
  bool feasible = false;
  std::vector<int> assignment;  // option index per layer (empty when infeasible)
  Prediction prediction;        // evaluate(profile, assignment)
  SearchStats stats;
};

class Planner {
 public:
  // `byte_quantum`: kept and host bytes are rounded up to multiples of it (1: exact).
  // Throws c10::ValueError for a bad profile, a quantum < 1, or a prefetch depth whose
  // classes do not fit in 62 bits (about 10 layers of 6 offload sizes).
  // `time_tolerance`: relative slack of the pruning (0: exact; see the header comment).
  explicit Planner(StepProfile profile, int64_t byte_quantum = 1, double time_tolerance = 0.0);

  // The fastest plan whose predicted peak is <= budget_bytes and whose host bytes are
  // <= host_budget_bytes (< 0: unbounded), or feasible = false. When a layer's front
  // outgrows kMaxExactLabels or kExactLabelsPerLayer x (layers decided) (copies far
  // slower than the forwards, over many layers), the capped search of the header comment
  // runs instead: a heuristic whose plan meets the budgets; the result says
  // stats.exact = false (true when the bound proves the plan optimal), and
  // stats.lower_bound (at depth <= 1) is the relaxation's optimum, a proven bound of its
  // loss. At depth >= 2 or with a tolerance the exact search is retried up to
  // kMaxExactLabels alone (no bound to judge the heuristic by). Under a host budget,
  // where the capped searches find no plan and the memory-only search outgrows
  // kFallbackMemoryLabels, the least-peak plan min_peak() would find decides: a budget at
  // or above its peak is met, one in the proven gap below it (a fraction of a percent) is
  // refused.
  // `allowed[k]` (optional, one bit per option) restricts the options of layer k.
  // `deepening_labels`: the labels the deepening's exact searches may create in all (the
  // work spent proving a plan optimal where the capped searches could not; 0: none, the
  // capped searches' plan stands with its proven gap). Throws c10::ValueError when < 0.
  PlanResult solve(int64_t budget_bytes, const std::vector<uint64_t>& allowed = {},
                   int64_t host_budget_bytes = -1,
                   int64_t deepening_labels = kDeepeningLabels) const;
  // The smallest budget for which solve() finds a plan (exact: a binary search over bytes
  // of a memory-only search), with the fastest plan at it; feasible = false when even an
  // unbounded device budget cannot meet the host budget. Exact in bytes, held bytes and
  // shared charges included (PlannerTest checks it against brute force, with and without
  // a host budget); with a byte quantum > 1, plans within a few quanta of a budget may be
  // missed (the peak found may lie a few quanta above the least; stats.least_peak_bound
  // is then a relaxation's, bytes rounded down, and where no search meets a host budget
  // the plan of least offload stands). Cost: without a host budget, a memory-only search of milliseconds per step of
  // the binary search (about 36 for GiB budgets). Under one, each exact search keeps a
  // (kept, host) front per layer (a tester's 100-layer, 3-option profile: 50 000 labels,
  // 1.2 s each), so the least peak without the host budget and searches on a byte grid
  // (bytes rounded down, and up) bound it from below and the peaks of the plans found from
  // above, and exact searches run only between (Planner.cpp): that profile takes 1.4 s
  // (46 s before); a second tester's, 100 layers of odd byte counts, 7.7 s (292 s). The
  // least peak under a host budget is a knapsack problem: the exact probes stop after
  // kMinPeakExactLabels labels, and then the least peak found stands, with
  // stats.least_peak_bound the proven bound below it (a third tester's 100-layer profile
  // of odd byte counts, 64 MiB host: 2.2 s, from minutes; 0.08 % apart). Without a host
  // budget, and where the probes finish, the bound is the plan's peak.
  PlanResult min_peak(const std::vector<uint64_t>& allowed = {},
                      int64_t host_budget_bytes = -1) const;

  // A proven lower bound of the optimal objective (step seconds + traffic term) of the
  // plans within both budgets: the relaxation of the fallback (no D2H backlog, see
  // solve()), with a host budget priced into the time (host_priced_bound()). +inf when
  // no plan of the relaxation meets the device budget; NaN at depth >= 2 (the relaxation
  // prices the depth-1 stalls, an upper bound of the depth-d ones). O(layers x options x
  // kBoundBins x classes) per relaxation, kHostPriceSteps + 3 of them with a host budget.
  double relaxed_lower_bound(int64_t budget_bytes, const std::vector<uint64_t>& allowed = {},
                             int64_t host_budget_bytes = -1) const;

  // A proven lower bound of the optimal objective within the device budget that counts
  // the D2H backlog: the least time plus backlog increments, linearised, of any plan
  // (add_linear_bound(); the first reload's wait max(0, q) is at least q). Weak for a
  // whole step (a plan that stops offloading early drains everything on paper), tight
  // where every layer must swap and the copies outlast the forwards; solve() uses it per
  // label, where it bites on labels that carry a backlog. +inf when no plan fits the
  // relaxation; NaN at depth >= 2. O(layers x kLinearBins x classes^2 x options).
  double linear_lower_bound(int64_t budget_bytes, const std::vector<uint64_t>& allowed = {}) const;

  const StepProfile& profile() const { return profile_; }

 private:
  // solve() with a plan known to meet both budgets (or null): where the searches find
  // none, it stands in for the memory-only search's.
  PlanResult solve_known(int64_t budget_bytes, const std::vector<uint64_t>& allowed,
                         int64_t host_budget_bytes, const PlanResult* known,
                         int64_t deepening_labels) const;
  // solve_known() before polish().
  PlanResult solve_unpolished(int64_t budget_bytes, const std::vector<uint64_t>& allowed,
                              int64_t host_budget_bytes, const PlanResult* known,
                              int64_t deepening_labels) const;
  // The memory-only plan of least peak within the host budget (< 0: unbounded) that the
  // searches find, `m` from masks(); feasible = false when no plan meets the host budget.
  // *proven (optional): a proven lower bound of the least peak, the plan's own peak where
  // it is proven least (Planner.cpp: bisection; under a host budget, grids, then exact
  // probes limited to kMinPeakExactLabels).
  PlanResult least_peak_plan(const std::vector<uint64_t>& m, int64_t host_budget_bytes,
                             int64_t* proven) const;
  // Improves a plan the searches did not prove optimal by changing one layer's option at a
  // time while evaluate() finds it faster within both budgets (`allowed`: masks()). In
  // place; O(kPolishPasses x layers^2 x options).
  void polish(PlanResult& r, int64_t budget_bytes, const std::vector<uint64_t>& allowed,
              int64_t host_budget_bytes) const;
  // Whether some layer (>= 1) allows options holding unlike held_bytes.
  bool uneven_held(const std::vector<uint64_t>& masks) const;
  // rest_bound(): seconds[k][i * radix_ + c] is a lower bound of the time (seconds,
  // traffic term included) of layers k .. n-1 when the layers before k keep at least
  // i x bin_bytes and layer k-1 took offload class c; root the lower bound of a whole
  // step's objective (seconds[0][0] + tail + outside; +inf: no plan fits).
  struct RestBound {
    std::vector<std::vector<double>> seconds;
    // The same over the completions that offload nothing (for labels past the last
    // offload: search()'s kLastChosen and kDraining).
    std::vector<std::vector<double>> resident;
    int64_t bin_bytes = 1;
    double root = std::numeric_limits<double>::infinity();
    // add_linear_bound() (empty until it ran): linear[k][(i * radix_ + c) * 4 + phase] is a
    // lower bound of the time of layers k .. n-1 plus their D2H backlog increments,
    // linearised, for a label of that phase (search()) keeping at least
    // i x linear_bin_bytes whose last layer took offload class c: a label's time left is
    // at least its backlog plus that. linear_root: the whole step's (-inf: not built).
    std::vector<std::vector<double>> linear;
    int64_t linear_bin_bytes = 1;
    double linear_root = -std::numeric_limits<double>::infinity();
  };
  // The search's cut-off (branch and bound): a label whose time plus the bound of `rest`
  // on what is left, the tail and the time outside the layers exceeds `seconds` is dropped.
  struct Cutoff {
    const RestBound* rest = nullptr;
    double seconds = 0.0;
    // The search gives up once it created more labels than this (< 0: no limit), as any
    // search with a cut-off does once its prune() visited more than kCutScanPerLabel
    // front entries per label created (search()).
    int64_t created_limit = -1;
  };
  // max_labels < 0: no limit. `cutoff` (optional): see Cutoff.
  PlanResult search(int64_t budget_bytes, int64_t host_budget_bytes,
                    const std::vector<uint64_t>& allowed, bool memory_only, int64_t quantum,
                    double tolerance, int64_t max_labels, int per_kept = 0,
                    bool relaxed = false, int64_t bucket = 0,
                    int64_t labels_per_layer = 0,
                    const Cutoff* cutoff = nullptr) const;
  // The relaxation of relaxed_bound() (no D2H backlog, least held bytes, no pending or
  // shared bytes) solved backwards over kept bytes rounded down to multiples of bin_bytes
  // (budget / kRestBins). O(layers x kRestBins x classes x options).
  RestBound rest_bound(int64_t budget_bytes, const std::vector<uint64_t>& allowed) const;
  // Fills rest.linear (see RestBound) over kept bytes rounded down to multiples of
  // budget / kLinearBins. O(layers x kLinearBins x classes^2 x options).
  void add_linear_bound(RestBound& rest, int64_t budget_bytes,
                        const std::vector<uint64_t>& allowed) const;
  // The optimum of the relaxation (depth <= 1, no host budget): exact bytes, no D2H
  // backlog; +inf when no plan meets the budget.
  // `host_price` (seconds per byte) is added to every offloaded byte's time.
  double relaxed_bound(int64_t budget_bytes, const std::vector<uint64_t>& allowed,
                       double host_price = 0.0) const;
  // A lower bound of the optimum within both budgets (depth <= 1): the best Lagrangian
  // relaxation of the host budget over the prices tried (golden section over a log scale,
  // kHostPriceSteps steps), each by relaxed_bound().
  double host_priced_bound(int64_t budget_bytes, const std::vector<uint64_t>& allowed,
                           int64_t host_budget_bytes) const;
  std::vector<uint64_t> masks(const std::vector<uint64_t>& allowed) const;
  // Per layer k: the held bytes (OptionCost::held_bytes) of Lk+1 .. Ln-1, each layer's
  // most (`least`: least) over the options `allowed` (masks()) permits, plus the tail's.
  std::vector<int64_t> held_after(const std::vector<uint64_t>& allowed, bool least) const;

  StepProfile profile_;
  int64_t quantum_;
  double tolerance_;
  // Per layer: offload class of each option, and the offload bytes of each class
  // (class 0: no offload).
  std::vector<std::vector<int>> class_of_;
  std::vector<std::vector<int64_t>> class_bytes_;
  int depth_ = 0;       // min(prefetch depth, layers - 1)
  uint64_t radix_ = 1;  // classes per digit of the class code
};

}  // namespace hyper_parallel::planner
