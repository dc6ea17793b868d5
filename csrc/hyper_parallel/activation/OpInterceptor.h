#pragma once
// OpInterceptor: per-op interception for selective checkpoint without a Python call per op
// (docs/design.md, "Selective checkpoint", "Interception in C++").
//
// torch's selective checkpoint, and our Python region modes, see every op of a region
// through a TorchDispatchMode at the Python dispatch key: one Python call per op (about
// 0.8x of torch's whole per-op cost). For a declarative policy (an OpPolicyTable) nothing
// in the per-op work needs Python, so a region with one runs the same work here, in a
// boxed fallback kernel on a dispatch key that the region adds to the thread's included
// key set while it runs:
//
//   * the key is DispatchKey::Fake. It sits below the autograd keys (the interception sees
//     the ops autograd records, and a cached output handed back in recompute is still
//     recorded by autograd above it, as at the Python key) and above BackendSelect and the
//     backends. On torch <= 2.13 no kernel or fallback of torch's own is registered on it
//     (2.6-2.12: reserved for the out-of-tree torchdistx; 2.13: a C++ FakeTensor key with
//     no kernels yet). install() registers our fallback only when the key is free, and
//     says so; otherwise available() is false and regions use the Python modes;
//   * the fallback passes an op straight through (redispatch below the key) unless a
//     region is active on this thread; ops on the meta backend (tracing with fake tensors)
//     always pass through;
//   * while it runs the op (and its own helper ops: copies of external state) the key is
//     excluded, so ops issued inside a kernel are not seen (as a mode is not re-entered
//     for the ops its own __torch_dispatch__ runs);
//   * regions nest: the innermost handles the op first and hands it to the next outer one
//     instead of the backend, as stacked dispatch modes do.
//
// Per op: its facts (op key, kind, written arguments) are memoised per operator; the
// policy comes from the region's OpPolicyTable (memoised per op key); forward records the
// call in the region's SacCache (MUST_SWAP outputs are packed into the current swap
// group), recompute replays it; tensors read from outside the region go through
// ExternalReads. Collectives (rare, and their record is Python's) call back into Python.
//
// Thread-safety: the region stack is per thread; a region is used by one thread at a time
// (its forward, then the recompute's thread). The op facts memo is process-wide (a
// shared mutex, with a per-thread cache in front); install() is idempotent and
// thread-safe.

#include "hyper_parallel/activation/ExternalReads.h"
#include "hyper_parallel/activation/SacCache.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hyper_parallel::activation {

// How selective checkpoint treats an op (values shared with _selective.py's _OpInfo.kind).
enum class OpKind : uint8_t {
  kPlain = 0,        // cacheable: the policy decides
  kIgnored = 1,      // never cached (writes an argument, returns a view, random, ...)
  kCollective = 2,   // a collective: kept results (Python's Collectives)
  kPassthrough = 3,  // ignore_sac_ops: runs, nothing recorded
};

struct OpFacts {
  int64_t key = -1;  // OpNames key (-1: never cached)
  OpKind kind = OpKind::kIgnored;
  std::vector<int> writes;  // schema positions of the arguments the op writes
  bool to_copy = false;     // aten::_to_copy (autocast's weight casts are not counted)
  bool seeded = false;      // tagged nondeterministic_seeded: cached with its RngStep
  // From the schema, whatever the classifier said (set once per operator):
  std::vector<int> declared_writes;  // the positions of `writes` the schema declares
                                     // (Tensor(a!): autograd bumps their versions; not the
                                     // batch norms' running statistics)
  bool view_of_first = false;        // returns a view or alias of its first argument
};

// Computes the facts of an op, once per operator. The Python layer installs the rules of
// _selective.py; without one, facts_from_schema() is used.
using OpClassifier = std::function<OpFacts(const c10::OperatorHandle&)>;

// "ns.op.overload" of an op, as str(torch.ops.ns.op.overload) prints ("aten.mm.default").
std::string op_full_name(const c10::OperatorHandle& op);
// Schema-only rules: mutable or aliasing-return ops are kIgnored with their written
// positions, others kPlain.
OpFacts facts_from_schema(const c10::OperatorHandle& op);

class SacRegion {
 public:
  // Handles a collective: runs (forward) or replays (recompute) it on the boxed `stack`,
  // leaving its outputs there.
  using CollectiveFn =
      std::function<void(const c10::OperatorHandle&, torch::jit::Stack*, bool recompute)>;

  // `cache`: the invocation's cache (its table is the policy; must not be null).
  explicit SacRegion(std::shared_ptr<SacCache> cache, ExternalReads::Describe describe = nullptr);
  ~SacRegion();
  SacRegion(const SacRegion&) = delete;
  SacRegion& operator=(const SacRegion&) = delete;

  const std::shared_ptr<SacCache>& cache() const { return cache_; }
  void set_collective_fn(CollectiveFn fn) { collective_ = std::move(fn); }

  // Forward: makes this region the innermost active one on this thread until exit().
  void enter_forward();
  // Recompute: starts a recompute pass (throws as ExternalReads::begin_recompute) and
  // makes this region the innermost active one on this thread until exit().
  void enter_recompute();
  // Leaves the thread's region stack (wherever it sits: an interrupted forward may exit
  // out of order). No-op when not on this thread's stack.
  void exit();
  // The forward is over (external tensors); call before SacCache::end_forward.
  void end_forward();
  // External tensors the forward wrote.
  int64_t written() const { return external_.written(); }
  // Recompute: what a saved-tensor pack hook must save in place of `t` (see
  // ExternalReads::recompute_save).
  // (its copies run with the interception key excluded: they are not the region's ops)
  ExternalReads::Save recompute_save(const at::Tensor& t);
  std::vector<at::Tensor> written_tensors() const { return external_.written_tensors(); }
  // Whether the forward read `t`'s value (ExternalReads::read_in_forward).
  bool read_in_forward(const at::Tensor& t) { return external_.read_in_forward(t); }
  // checkpoint_exclude_wrapper: ops of the forward pass through while > 0.
  void add_excluding(int delta) { excluding_ += delta; }

  // Ops this region handled (forward and recompute), and ops of this region that went to
  // Python (collectives).
  int64_t intercepted() const { return intercepted_; }
  int64_t python_calls() const { return python_calls_; }

  // The fallback's work for this region: handles the op at `level` of the thread's stack
  // (this region) and hands it to level - 1 (or the backend) to run.
  void handle(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
              size_t level);

 private:
  void forward(const c10::OperatorHandle& op, const OpFacts& facts, c10::DispatchKeySet ks,
               torch::jit::Stack* stack, size_t level);
  void recompute(const c10::OperatorHandle& op, const OpFacts& facts, c10::DispatchKeySet ks,
                 torch::jit::Stack* stack, size_t level);
  void push();

  std::shared_ptr<SacCache> cache_;
  ExternalReads external_;
  CollectiveFn collective_;
  bool recomputing_ = false;
  int excluding_ = 0;
  int64_t intercepted_ = 0;
  int64_t python_calls_ = 0;
};

class OpInterceptor {
 public:
  // Registers the fallback if the key is free (idempotent). Returns available().
  static bool install();
  // Whether regions can use the interception (install() succeeded).
  static bool available();
  // Why it is not available ("" when it is).
  static std::string unavailable_reason();
  static void set_classifier(OpClassifier classifier);
  // Forgets every memoised op facts (ignore_sac_ops changed the rules).
  static void forget_ops();
  // Ops handled by any region, process-wide (tests: proof of interception in C++).
  static int64_t intercepted_total();
  // Active regions on this thread.
  static size_t depth();
};

}  // namespace hyper_parallel::activation
