#include "hyper_parallel/activation/OpInterceptor.h"

#include "hyper_parallel/activation/OpPolicyTable.h"
#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <unordered_set>

namespace hyper_parallel::activation {

namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

struct Tls {
  std::vector<SacRegion*> regions;
  bool prev_included = false;
  uint64_t facts_generation = 0;
  std::unordered_map<const void*, std::shared_ptr<const OpFacts>> facts;
};
thread_local Tls tls;

std::atomic<int64_t> g_intercepted{0};
std::atomic<bool> g_available{false};
std::atomic<uint64_t> g_generation{1};

struct FactsRegistry {
  std::shared_mutex mu;
  std::unordered_map<const void*, std::shared_ptr<const OpFacts>> facts;
  OpClassifier classifier;
  std::string reason = "not installed (hyper_parallel._C registers it at import)";
};
FactsRegistry& registry() {
  static FactsRegistry* r = new FactsRegistry();  // leaked: the fallback may run at exit
  return *r;
}

// The facts an op's schema gives, whatever the classifier said (OpFacts).
void add_schema_facts(const c10::FunctionSchema& schema, OpFacts& f) {
  const auto& args = schema.arguments();
  for (int w : f.writes) {
    if (w < 0 || static_cast<size_t>(w) >= args.size()) continue;
    const auto* alias = args[static_cast<size_t>(w)].alias_info();
    if (alias != nullptr && alias->isWrite()) f.declared_writes.push_back(w);
  }
  if (!args.empty() && !schema.returns().empty()) {
    const auto* out = schema.returns()[0].alias_info();
    const auto* in = args[0].alias_info();
    f.view_of_first = out != nullptr && !out->isWrite() && in != nullptr && !in->isWrite();
  }
}

// Shared: a forget_ops() during the op (from a Python callback) must not free them.
std::shared_ptr<const OpFacts> facts_for(const c10::OperatorHandle& op) {
  const void* id = &op.schema();
  Tls& t = tls;
  const uint64_t gen = g_generation.load(std::memory_order_acquire);
  if (t.facts_generation != gen) {
    t.facts.clear();
    t.facts_generation = gen;
  }
  if (auto it = t.facts.find(id); it != t.facts.end()) return it->second;
  auto& r = registry();
  std::shared_ptr<const OpFacts> facts;
  OpClassifier classifier;
  {
    std::shared_lock<std::shared_mutex> lock(r.mu);
    if (auto it = r.facts.find(id); it != r.facts.end()) facts = it->second;
    classifier = r.classifier;
  }
  if (!facts) {
    // Computed outside the lock: the classifier may take the GIL.
    OpFacts f = classifier ? classifier(op) : facts_from_schema(op);
    add_schema_facts(op.schema(), f);
    auto made = std::make_shared<OpFacts>(std::move(f));
    std::unique_lock<std::shared_mutex> lock(r.mu);
    facts = r.facts.emplace(id, std::move(made)).first->second;
  }
  t.facts.emplace(id, facts);
  return facts;
}

c10::DispatchKeySet below(c10::DispatchKeySet ks) {
  return ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
}

// Runs the op through the region at `level` (the next outer one) or, at the bottom, the
// kernels below the key.
void run_next(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack,
              size_t level) {
  if (level == 0) {
    op.redispatchBoxed(below(ks), stack);
  } else {
    tls.regions[level - 1]->handle(op, ks, stack, level - 1);
  }
}

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  auto& regions = tls.regions;
  if (regions.empty() || ks.highestBackendKey() == c10::BackendComponent::MetaBit) {
    op.redispatchBoxed(below(ks), stack);
    return;
  }
  // The op's own kernels, and our helper ops, are not seen again.
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kKey);
  regions.back()->handle(op, ks, stack, regions.size() - 1);
}

// A cast of a leaf that requires grad (a weight): never cached nor counted, whether or not
// autocast made it (_selective._weight_cast: autocast's cached casts run in recompute but
// not in a forward that found them cached, and autocast's state cannot tell them apart).
bool is_weight_cast(c10::ArrayRef<c10::IValue> args) {
  if (args.empty() || !args[0].isTensor()) return false;
  const at::Tensor& t = args[0].toTensor();
  return t.defined() && t.is_leaf() && t.requires_grad();
}

bool cacheable_leaf(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    return !t.defined() || !t.key_set().has(c10::DispatchKey::Python);
  }
  return v.isNone() || v.isBool() || v.isInt() || v.isDouble();
}

// The op's outputs as the cache holds them; false when one cannot be cached.
bool to_cached(c10::ArrayRef<c10::IValue> outs, std::vector<c10::IValue>& values,
               OutputKind& kind) {
  if (outs.size() == 1 && outs[0].isList()) {
    kind = OutputKind::kList;
    for (const c10::IValue& v : outs[0].toListRef()) {
      if (!cacheable_leaf(v)) return false;
      values.push_back(v);
    }
    return true;
  }
  kind = outs.size() == 1 ? OutputKind::kSingle : OutputKind::kTuple;
  for (const c10::IValue& v : outs) {
    if (!cacheable_leaf(v)) return false;
    // An undefined tensor is cached as None (as the Python path sees it).
    values.push_back(v.isTensor() && !v.toTensor().defined() ? c10::IValue() : v);
  }
  return true;
}

c10::IValue typed(c10::IValue&& v, const c10::TypePtr& type) {
  if (v.isNone() && type->kind() == c10::TypeKind::TensorType) return at::Tensor();
  return std::move(v);
}

void push_replay(const c10::FunctionSchema& schema, SacCache::Replay&& r,
                 torch::jit::Stack* stack) {
  torch::jit::drop(*stack, schema.arguments().size());
  const auto& returns = schema.returns();
  if (r.kind == OutputKind::kList) {
    HP_INTERNAL_ASSERT(returns.size() == 1, "a list output cached for ", schema.name());
    const c10::TypePtr elem = returns[0].type()->expectRef<c10::ListType>().getElementType();
    c10::impl::GenericList list(elem);
    list.reserve(r.outputs.size());
    for (auto& v : r.outputs) list.push_back(typed(std::move(v), elem));
    stack->emplace_back(std::move(list));
    return;
  }
  HP_INTERNAL_ASSERT(r.outputs.size() == returns.size(), "cached ", r.outputs.size(),
                     " outputs of ", schema.name(), " for ", returns.size(), " returns");
  for (size_t i = 0; i < returns.size(); ++i) {
    stack->push_back(typed(std::move(r.outputs[i]), returns[i].type()));
  }
}

void warn_no_generator(int64_t op_key, const c10::Device& device) {
  static std::mutex mu;
  static std::unordered_set<int64_t>* warned = new std::unordered_set<int64_t>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned->insert(op_key).second) return;
  }
  TORCH_WARN("hyper_parallel: selective checkpoint cannot cache the output of the random op ",
             OpNames::name(op_key), " on ", device, ": the device has no default generator "
             "whose state it could replay in recompute, so this op is recomputed in backward "
             "whatever the policy says.");
}

void warn_uncacheable(int64_t op_key) {
  static std::mutex mu;
  static std::unordered_set<int64_t>* warned = new std::unordered_set<int64_t>();
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!warned->insert(op_key).second) return;
  }
  TORCH_WARN("hyper_parallel: selective checkpoint cannot cache the output of ",
             OpNames::name(op_key), " (tensor subclasses, SymInts and nested outputs are not "
             "cached), so this op is recomputed in backward whatever the policy says.");
}

}  // namespace

// ---------------------------------------------------------------- facts

std::string op_full_name(const c10::OperatorHandle& op) {
  const auto& name = op.operator_name();
  return name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name);
}

OpFacts facts_from_schema(const c10::OperatorHandle& op) {
  const auto& schema = op.schema();
  OpFacts f;
  f.to_copy = schema.name() == "aten::_to_copy";
  bool aliasing = false;
  for (const auto& r : schema.returns()) aliasing |= r.alias_info() != nullptr;
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].alias_info() && args[i].alias_info()->isWrite()) f.writes.push_back(static_cast<int>(i));
  }
  if (aliasing || !f.writes.empty()) return f;
  f.kind = OpKind::kPlain;
  f.seeded = op.hasTag(at::Tag::nondeterministic_seeded);
  f.key = OpNames::intern(op_full_name(op));
  return f;
}

// ---------------------------------------------------------------- SacRegion

SacRegion::SacRegion(std::shared_ptr<SacCache> cache, ExternalReads::Describe describe)
    : cache_(std::move(cache)), external_(std::move(describe)) {
  HP_CHECK_VALUE(cache_ != nullptr && cache_->table() != nullptr,
                 "a C++-intercepted selective checkpoint region needs a cache with a policy "
                 "table (internal use)");
}

SacRegion::~SacRegion() { exit(); }

void SacRegion::push() {
  Tls& t = tls;
  if (t.regions.empty()) {
    t.prev_included = c10::impl::tls_is_dispatch_key_included(kKey);
    c10::impl::tls_set_dispatch_key_included(kKey, true);
  }
  t.regions.push_back(this);
}

void SacRegion::enter_forward() {
  recomputing_ = false;
  push();
}

void SacRegion::enter_recompute() {
  external_.begin_recompute();
  cache_->begin_recompute();
  recomputing_ = true;
  push();
}

void SacRegion::exit() {
  Tls& t = tls;
  for (size_t i = t.regions.size(); i-- > 0;) {
    if (t.regions[i] != this) continue;
    t.regions.erase(t.regions.begin() + static_cast<std::ptrdiff_t>(i));
    if (t.regions.empty()) c10::impl::tls_set_dispatch_key_included(kKey, t.prev_included);
    return;
  }
}

// How ExternalReads names an op's access of an outside tensor: the operator (its schema's
// address) and whether grad mode was off (the address plus one; schemas are aligned).
// State a first call initializes runs under no_grad, and the recompute's reads with grad
// on are not mistaken for it.
static const void* access_id(const c10::FunctionSchema& schema) {
  const auto* base = reinterpret_cast<const char*>(&schema);
  return c10::GradMode::is_enabled() ? base : base + 1;
}

ExternalReads::Save SacRegion::recompute_save(const at::Tensor& t) {
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kKey);
  return external_.recompute_save(t);
}

void SacRegion::end_forward() {
  c10::impl::ExcludeDispatchKeyGuard no_reentry(kKey);  // its value checks are not region ops
  external_.end_forward();
}

void SacRegion::handle(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack, size_t level) {
  const std::shared_ptr<const OpFacts> held = facts_for(op);
  const OpFacts& facts = *held;
  if (facts.kind == OpKind::kPassthrough) {
    run_next(op, ks, stack, level);
    return;
  }
  if (recomputing_) {
    recompute(op, facts, ks, stack, level);
  } else {
    forward(op, facts, ks, stack, level);
  }
}

void SacRegion::forward(const c10::OperatorHandle& op, const OpFacts& facts,
                        c10::DispatchKeySet ks, torch::jit::Stack* stack, size_t level) {
  // Writes to a cached output's storage through a tensor with another version counter
  // (SacCache::before_write / watch; aten::_unsafe_view's outputs), excluded part or not.
  const auto& args_schema = op.schema().arguments();
  for (int i : facts.writes) {
    const c10::IValue& v = torch::jit::peek(*stack, static_cast<size_t>(i), args_schema.size());
    if (v.isTensor()) {
      cache_->before_write(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) cache_->before_write(t);
    }
  }
  if (excluding_ > 0) {  // inside a checkpoint_exclude_wrapper: not replayed
    run_next(op, ks, stack, level);
    cache_->watch(torch::jit::last(*stack, op.schema().returns().size()));
    return;
  }
  ++intercepted_;
  g_intercepted.fetch_add(1, std::memory_order_relaxed);
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  external_.forward_inputs(facts.key, access_id(schema), torch::jit::last(*stack, nargs),
                           facts.writes, facts.declared_writes, facts.view_of_first);
  if (facts.kind == OpKind::kCollective && collective_) {
    ++python_calls_;
    collective_(op, stack, false);
    external_.forward_outputs(torch::jit::last(*stack, schema.returns().size()));
    return;
  }
  const bool weight_cast = facts.to_copy && is_weight_cast(torch::jit::last(*stack, nargs));
  CheckpointPolicy policy = CheckpointPolicy::PREFER_RECOMPUTE;
  std::optional<RngStep> rng;
  if (facts.kind == OpKind::kPlain && !weight_cast) {
    policy = cache_->table_policy(facts.key);
    if (facts.seeded && !is_recompute(policy)) {
      // A random op to cache: its generator's state before and after (RngStep.h).
      const auto device = RngStep::generator_device(torch::jit::last(*stack, nargs));
      if (device) {
        rng = RngStep::before(*device);
        if (!rng) {
          warn_no_generator(facts.key, *device);
          policy = CheckpointPolicy::PREFER_RECOMPUTE;
        }
      }
    }
  }
  // The inputs' dtypes and shapes, for replay() to check (plain ops write no argument, so
  // they are the same after the call; taken before it, while the stack holds them).
  const uint64_t inputs = facts.kind == OpKind::kPlain && !weight_cast && !is_recompute(policy)
                              ? SacCache::input_signature(torch::jit::last(*stack, nargs))
                              : 0;
  // A view op's first argument (what its outputs view, for ExternalReads' writes).
  at::Tensor viewed;
  if (facts.view_of_first) {
    const c10::IValue& first = torch::jit::peek(*stack, 0, nargs);
    if (first.isTensor()) viewed = first.toTensor();
  }
  run_next(op, ks, stack, level);
  if (rng && !rng->after()) rng.reset();
  const auto outs = torch::jit::last(*stack, schema.returns().size());
  external_.forward_outputs(outs, viewed.defined() ? &viewed : nullptr);
  cache_->watch(outs);
  if (facts.kind != OpKind::kPlain || weight_cast) return;
  if (is_recompute(policy)) {
    cache_->record(facts.key, policy, {}, OutputKind::kSingle, nullptr);
    return;
  }
  std::vector<c10::IValue> values;
  OutputKind kind = OutputKind::kSingle;
  if (!to_cached(outs, values, kind)) {
    cache_->record(facts.key, CheckpointPolicy::PREFER_RECOMPUTE, {}, kind, nullptr);
    warn_uncacheable(facts.key);
    return;
  }
  std::shared_ptr<SwapGroup> group;
  if (is_swap(policy)) group = SwapEngine::global().current_group();
  cache_->record(facts.key, policy, values, kind, group, std::move(rng), inputs);
}

void SacRegion::recompute(const c10::OperatorHandle& op, const OpFacts& facts,
                          c10::DispatchKeySet ks, torch::jit::Stack* stack, size_t level) {
  ++intercepted_;
  g_intercepted.fetch_add(1, std::memory_order_relaxed);
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  // Declared writes only: the batch norms' writes of their running statistics are not
  // autograd's either, so they bump no version (ExternalReads::recompute_args).
  static const std::vector<int> kNone;
  external_.recompute_args(facts.key, access_id(schema), *stack, nargs,
                           facts.kind == OpKind::kCollective ? kNone : facts.declared_writes);
  if (facts.kind == OpKind::kCollective && collective_) {
    ++python_calls_;
    collective_(op, stack, true);
    return;
  }
  if (facts.kind != OpKind::kPlain ||
      (facts.to_copy && is_weight_cast(torch::jit::last(*stack, nargs)))) {
    run_next(op, ks, stack, level);
    return;
  }
  const auto args = torch::jit::last(*stack, nargs);
  SacCache::Replay r =
      cache_->replay(facts.key, torch::autograd::get_current_graph_task_keep_graph(),
                     [args] { return SacCache::input_signature(args); });
  if (r.recompute) {
    run_next(op, ks, stack, level);
    return;
  }
  push_replay(schema, std::move(r), stack);
}

// ---------------------------------------------------------------- OpInterceptor

bool OpInterceptor::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& d = c10::Dispatcher::singleton();
    auto& r = registry();
    if (d.hasBackendFallbackForDispatchKey(kKey)) {
      r.reason = "this torch registers its own fallback on the Fake dispatch key";
      return;
    }
    if (!d.getRegistrationsForDispatchKey(kKey).empty()) {
      r.reason = "this torch registers kernels on the Fake dispatch key";
      return;
    }
    // Leaked: the registration must outlive every op call, including those at exit.
    auto* lib = new torch::Library(torch::Library::IMPL, "_", kKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    r.reason.clear();
    g_available.store(true);
  });
  return available();
}

bool OpInterceptor::available() { return g_available.load(); }

std::string OpInterceptor::unavailable_reason() {
  auto& r = registry();
  std::shared_lock<std::shared_mutex> lock(r.mu);
  return r.reason;
}

void OpInterceptor::set_classifier(OpClassifier classifier) {
  {
    auto& r = registry();
    std::unique_lock<std::shared_mutex> lock(r.mu);
    r.classifier = std::move(classifier);
  }
  forget_ops();
}

void OpInterceptor::forget_ops() {
  auto& r = registry();
  {
    std::unique_lock<std::shared_mutex> lock(r.mu);
    r.facts.clear();
  }
  g_generation.fetch_add(1, std::memory_order_acq_rel);
}

int64_t OpInterceptor::intercepted_total() { return g_intercepted.load(); }

size_t OpInterceptor::depth() { return tls.regions.size(); }

}  // namespace hyper_parallel::activation
