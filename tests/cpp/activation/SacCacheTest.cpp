// SacCache on its own: what forward records per (op, call index) and what recompute gets
// back. MUST_SWAP goes through a private SwapEngine with the CPU (worker-thread) backend.
#include "hyper_parallel/activation/SacCache.h"

#include "hyper_parallel/activation/SavedBytesMeter.h"
#include "hyper_parallel/activation/SwapEngine.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace hyper_parallel::activation {
namespace {

using P = CheckpointPolicy;

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::vector<c10::IValue> one(const at::Tensor& t) { return {c10::IValue(t)}; }

SwapEngineOptions cpu_options() {
  SwapEngineOptions o;
  o.cpu_swap = true;
  o.cpu_delay_ns_per_byte = 2.0;
  o.offload_window = 0;  // every release submits at once (deterministic off-device state)
  return o;
}

class SacCacheTest : public ::testing::Test {
 protected:
  int64_t mm = OpNames::intern("aten.mm.default");
  int64_t relu = OpNames::intern("aten.relu.default");
  int64_t split = OpNames::intern("saccachetest.split.default");
};

TEST_F(SacCacheTest, RecordsByOpAndCallIndexAndReplaysInOrder) {
  SacCache cache;
  at::Tensor a = at::randn({4, 4});
  at::Tensor b = at::randn({4, 4});
  EXPECT_EQ(cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr), 0);
  EXPECT_EQ(cache.record(relu, P::PREFER_RECOMPUTE, {}, OutputKind::kSingle, nullptr), 0);
  EXPECT_EQ(cache.record(mm, P::MUST_RECOMPUTE, {}, OutputKind::kSingle, nullptr), 1);
  EXPECT_EQ(cache.record(mm, P::PREFER_SAVE, one(b), OutputKind::kSingle, nullptr), 2);
  const auto s = cache.stats();
  EXPECT_EQ(s.saved_entries, 2);
  EXPECT_EQ(s.recompute_entries, 2);
  EXPECT_EQ(s.saved_tensors, 2);

  cache.begin_recompute();
  auto r0 = cache.replay(mm, /*retain=*/false);
  ASSERT_FALSE(r0.recompute);
  ASSERT_EQ(r0.outputs.size(), 1u);
  EXPECT_TRUE(at::equal(r0.outputs[0].toTensor(), a));
  EXPECT_TRUE(cache.replay(relu, false).recompute);
  EXPECT_TRUE(cache.replay(mm, false).recompute);
  auto r2 = cache.replay(mm, false);
  ASSERT_FALSE(r2.recompute);
  EXPECT_TRUE(at::equal(r2.outputs[0].toTensor(), b));
  EXPECT_EQ(cache.stats().dropped_entries, 2);
  EXPECT_EQ(cache.stats().saved_tensors, 0);
  EXPECT_EQ(cache.stats().replays, 2);
}

TEST_F(SacCacheTest, ReplayReturnsFreshAliasesSharingStorageAndVersion) {
  SacCache cache;
  at::Tensor a = at::randn({3, 5});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  cache.begin_recompute();
  at::Tensor got = cache.replay(mm, /*retain=*/true).outputs[0].toTensor();
  EXPECT_NE(got.unsafeGetTensorImpl(), a.unsafeGetTensorImpl());
  EXPECT_EQ(got.storage().unsafeGetStorageImpl(), a.storage().unsafeGetStorageImpl());
  EXPECT_EQ(got.data_ptr(), a.data_ptr());
  EXPECT_EQ(got.sizes(), a.sizes());
  EXPECT_EQ(got.strides(), a.strides());
  EXPECT_FALSE(got.requires_grad());
  // Shared version counter: a write through the alias is seen on the original.
  const auto v = a._version();
  got.add_(1);
  EXPECT_EQ(a._version(), v + 1);
}

TEST_F(SacCacheTest, TupleListAndNonTensorValuesRoundTrip) {
  SacCache cache;
  at::Tensor a = at::randn({2});
  at::Tensor b = at::randn({3});
  std::vector<c10::IValue> outs = {c10::IValue(a), c10::IValue(), c10::IValue(int64_t{7}),
                                   c10::IValue(2.5), c10::IValue(true), c10::IValue(b)};
  cache.record(split, P::MUST_SAVE, outs, OutputKind::kTuple, nullptr);
  cache.record(split, P::MUST_SAVE, {c10::IValue(a)}, OutputKind::kList, nullptr);
  cache.begin_recompute();
  auto r = cache.replay(split, false);
  EXPECT_EQ(r.kind, OutputKind::kTuple);
  ASSERT_EQ(r.outputs.size(), outs.size());
  EXPECT_TRUE(at::equal(r.outputs[0].toTensor(), a));
  EXPECT_TRUE(r.outputs[1].isNone());
  EXPECT_EQ(r.outputs[2].toInt(), 7);
  EXPECT_DOUBLE_EQ(r.outputs[3].toDouble(), 2.5);
  EXPECT_TRUE(r.outputs[4].toBool());
  EXPECT_TRUE(at::equal(r.outputs[5].toTensor(), b));
  EXPECT_EQ(cache.replay(split, false).kind, OutputKind::kList);
}

TEST_F(SacCacheTest, MutatedCachedTensorIsAClearError) {
  SacCache cache;
  at::Tensor a = at::randn({4, 4});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  const auto v = a._version();
  a.mul_(2);  // in place, after it was cached
  cache.begin_recompute();
  const std::string msg = message_of([&] { cache.replay(mm, false); });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the output of aten.mm.default (call #0")) << msg;
  const std::string versions =
      "(version " + std::to_string(v) + " -> " + std::to_string(v + 1) + ")";
  EXPECT_TRUE(contains(msg, "modified in place after it was cached " + versions)) << msg;
  EXPECT_TRUE(contains(msg, "Clone it before the in-place op")) << msg;
}

// A tensor sharing `t`'s storage with a version counter of its own: what
// aten::_unsafe_view returns under autograd (a plain ATen call here would share t's).
at::Tensor alias_with_own_counter(const at::Tensor& t) {
  at::Tensor u = t.view({-1}).detach();
  u.unsafeGetTensorImpl()->set_version_counter(c10::VariableVersion(0));
  return u;
}

// A write through such a tensor leaves the cached tensor's version as it was.
// before_write() (in forward) demotes the entry; watch() lets replay() see a write after
// the forward.
TEST_F(SacCacheTest, WritesThroughAnotherVersionCounterAreSeenThroughTheStorage) {
  SacCache cache;
  at::Tensor a = at::randn({4, 4});
  at::Tensor b = at::randn({4, 4});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  cache.record(mm, P::MUST_SAVE, one(b), OutputKind::kSingle, nullptr);
  at::Tensor ua = alias_with_own_counter(a);
  at::Tensor ub = alias_with_own_counter(b);
  ASSERT_EQ(ua.storage().unsafeGetStorageImpl(), a.storage().unsafeGetStorageImpl());
  cache.watch(one(ua));
  cache.watch(one(ub));
  cache.watch(one(at::randn({3})));  // another storage: nothing watched
  const auto va = a._version();
  cache.before_write(ua);  // an op is about to write ua
  ua.add_(1);
  EXPECT_EQ(a._version(), va);  // the cached tensor's own counter did not move
  const auto demoted = cache.end_forward();
  ASSERT_EQ(demoted.size(), 1u);
  EXPECT_EQ(demoted[0].call, 0);
  // After the forward: before_write is a no-op, the watch of ub stays.
  const auto vb = b._version();
  cache.before_write(ub);
  ub.mul_(2);
  EXPECT_EQ(b._version(), vb);  // the cached tensor's own counter did not move
  cache.begin_recompute();
  EXPECT_TRUE(cache.replay(mm, false).recompute);  // call #0: demoted
  const std::string msg = message_of([&] { cache.replay(mm, false); });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the output of aten.mm.default (call #1) that "
                            "selective checkpoint cached was modified in place after the "
                            "region's forward through a tensor sharing its memory")) << msg;
}

TEST_F(SacCacheTest, AWatchedWriteIsHandedBackWhenCacheEntryMutationIsAllowed) {
  SacCache cache(nullptr, nullptr, /*allow_mutation=*/true);
  at::Tensor a = at::zeros({4});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  at::Tensor ua = alias_with_own_counter(a);
  cache.watch(one(ua));
  EXPECT_TRUE(cache.end_forward().empty());
  ua.fill_(3);
  cache.begin_recompute();
  const auto r = cache.replay(mm, false);
  ASSERT_FALSE(r.recompute);
  EXPECT_TRUE(at::equal(r.outputs[0].toTensor(), at::full({4}, 3.0)));
}

TEST_F(SacCacheTest, EndForwardDemotesEntriesMutatedInsideTheForward) {
  SwapEngine engine(cpu_options());
  SacCache cache(nullptr, &engine);
  auto group = engine.begin_forward(-1, "sac", false, false);
  at::Tensor kept = at::randn({4});
  at::Tensor written = at::randn({4});
  at::Tensor swapped = at::randn({4});
  cache.record(mm, P::MUST_SAVE, one(kept), OutputKind::kSingle, nullptr);
  cache.record(mm, P::PREFER_SAVE, one(written), OutputKind::kSingle, nullptr);
  cache.record(relu, P::MUST_SWAP, one(swapped), OutputKind::kSingle, group);
  written.view({2, 2}).add_(1);  // through a view: same version counter
  swapped.zero_();
  const auto demoted = cache.end_forward();
  engine.abort_forward(group);
  ASSERT_EQ(demoted.size(), 2u);
  EXPECT_EQ(demoted[0].op_key, mm);
  EXPECT_EQ(demoted[0].call, 1);
  EXPECT_EQ(demoted[0].policy, P::PREFER_SAVE);
  EXPECT_EQ(demoted[1].op_key, relu);
  EXPECT_EQ(demoted[1].call, 0);
  EXPECT_EQ(demoted[1].policy, P::MUST_SWAP);
  const auto s = cache.stats();
  EXPECT_EQ(s.saved_entries, 1);
  EXPECT_EQ(s.swapped_entries, 0);
  EXPECT_EQ(s.recompute_entries, 2);
  cache.begin_recompute();
  EXPECT_TRUE(at::equal(cache.replay(mm, false).outputs[0].toTensor(), kept));
  EXPECT_TRUE(cache.replay(mm, false).recompute);
  EXPECT_TRUE(cache.replay(relu, false).recompute);
}

TEST_F(SacCacheTest, RecomputeRunningMoreCallsThanForwardIsAClearError) {
  SacCache cache;
  cache.record(mm, P::MUST_SAVE, one(at::ones({2})), OutputKind::kSingle, nullptr);
  cache.begin_recompute();
  cache.replay(mm, false);
  const std::string msg = message_of([&] { cache.replay(mm, false); });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the recompute of a selective checkpoint region "
                            "ran aten.mm.default (call #1) but its forward ran it 1 time(s)"))
      << msg;
}

// A cached call is matched by (op, call index); when the recompute's call at that index
// has inputs of other dtypes or shapes, the recomputed op sequence differs from the forward's
// and the cached outputs belong to another call: a clear error, never a wrong tensor.
TEST_F(SacCacheTest, ARecomputeCallWithOtherInputShapesOrDtypesIsAClearError) {
  const at::Tensor x = at::ones({4, 8}), w = at::ones({8, 8}), w2 = at::ones({8, 16});
  const std::vector<c10::IValue> fwd{x, w};
  const uint64_t sig = SacCache::input_signature(fwd);
  EXPECT_NE(sig, 0u);
  EXPECT_EQ(sig, SacCache::input_signature(std::vector<c10::IValue>{at::zeros({4, 8}),
                                                                     at::zeros({8, 8})}));
  // Non-tensor arguments (defaults the Python call omits) do not count.
  EXPECT_EQ(sig, SacCache::input_signature(std::vector<c10::IValue>{x, c10::IValue(), w, 1.0}));
  EXPECT_NE(sig, SacCache::input_signature(std::vector<c10::IValue>{x, w2}));
  EXPECT_NE(sig, SacCache::input_signature(std::vector<c10::IValue>{w, x}));
  EXPECT_NE(sig, SacCache::input_signature(
                     std::vector<c10::IValue>{x, w.to(at::kDouble)}));
  EXPECT_NE(sig, SacCache::input_signature(std::vector<c10::IValue>{x, w.reshape({64})}));

  SacCache cache;
  cache.record(mm, P::MUST_SAVE, one(at::ones({4, 8})), OutputKind::kSingle, nullptr,
               std::nullopt, sig);
  cache.record(mm, P::MUST_SAVE, one(at::ones({4, 8})), OutputKind::kSingle, nullptr,
               std::nullopt, sig);
  cache.begin_recompute();
  EXPECT_FALSE(cache.replay(mm, /*retain=*/true, [&] { return sig; }).recompute);
  const std::string msg = message_of(
      [&] {
        cache.replay(mm, false,
                     [&] { return SacCache::input_signature(std::vector<c10::IValue>{x, w2}); });
      });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the recompute of a selective checkpoint region "
                            "ran aten.mm.default (call #1) on inputs whose dtypes or shapes "
                            "differ")) << msg;
  // Unknown signatures (0) are not checked.
  cache.begin_recompute();
  EXPECT_FALSE(cache.replay(mm, true, [] { return uint64_t{0}; }).recompute);
}

TEST_F(SacCacheTest, OpsForwardNeverCachedRunFreelyInRecompute) {
  SacCache cache;
  cache.record(relu, P::PREFER_RECOMPUTE, {}, OutputKind::kSingle, nullptr);
  cache.begin_recompute();
  // Calls of ops forward never cached need not line up (autocast's weight-cast cache).
  EXPECT_TRUE(cache.replay(relu, false).recompute);
  EXPECT_TRUE(cache.replay(relu, false).recompute);
  EXPECT_TRUE(cache.replay(mm, false).recompute);  // never run in forward at all
}

TEST_F(SacCacheTest, AllowMutationHandsBackTheModifiedTensor) {
  SacCache cache(nullptr, nullptr, /*allow_mutation=*/true);
  at::Tensor a = at::ones({4});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  a.mul_(3);
  cache.begin_recompute();
  EXPECT_TRUE(at::equal(cache.replay(mm, false).outputs[0].toTensor(), at::full({4}, 3.0)));
}

TEST_F(SacCacheTest, RetainKeepsEntriesForASecondBackwardOtherwiseReleased) {
  SacCache cache;
  at::Tensor a = at::randn({8});
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  for (int pass = 0; pass < 3; ++pass) {  // retain_graph=True backwards
    cache.begin_recompute();
    auto r = cache.replay(mm, /*retain=*/true);
    ASSERT_FALSE(r.recompute);
    EXPECT_TRUE(at::equal(r.outputs[0].toTensor(), a));
  }
  EXPECT_EQ(cache.stats().saved_tensors, 1);
  cache.begin_recompute();
  cache.replay(mm, /*retain=*/false);  // the last backward releases it
  EXPECT_EQ(cache.stats().saved_tensors, 0);
  cache.begin_recompute();
  const std::string msg = message_of([&] { cache.replay(mm, false); });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the output of aten.mm.default (call #0) cached by "
                            "selective checkpoint was already used and released"))
      << msg;
  EXPECT_TRUE(contains(msg, "retain_graph=True")) << msg;
}

TEST_F(SacCacheTest, ReleasedEntryDropsItsStorageReference) {
  SacCache cache;
  at::Tensor a = at::randn({16});
  c10::Storage storage = a.storage();
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  const auto refs_cached = storage.use_count();
  cache.begin_recompute();
  { auto r = cache.replay(mm, false); }
  EXPECT_EQ(storage.use_count(), refs_cached - 1);
}

TEST_F(SacCacheTest, TablePolicyNeedsATable) {
  auto table = std::make_shared<OpPolicyTable>();
  table->set("aten.mm", P::MUST_SWAP);
  SacCache with(table);
  EXPECT_EQ(with.table_policy(mm), P::MUST_SWAP);
  EXPECT_EQ(with.table_policy(relu), P::PREFER_RECOMPUTE);
  SacCache without;
  EXPECT_TRUE(contains(message_of([&] { without.table_policy(mm); }),
                       "hyper_parallel: this selective-checkpoint cache has no policy table"));
}

TEST_F(SacCacheTest, SavedAndSwappedTensorsAreReportedToTheActiveMeter) {
  SavedBytesMeter meter;
  SavedBytesMeter::set_active(&meter);
  SacCache cache;
  at::Tensor a = at::randn({100});  // 400 bytes
  at::Tensor b = at::randn({50});   // 200 bytes
  cache.record(mm, P::MUST_SAVE, one(a), OutputKind::kSingle, nullptr);
  cache.record(mm, P::PREFER_RECOMPUTE, one(b), OutputKind::kSingle, nullptr);  // not kept
  cache.record(relu, P::MUST_SWAP, one(b), OutputKind::kSingle, nullptr);  // no group: saved
  SavedBytesMeter::set_active(nullptr);
  EXPECT_EQ(meter.observed_storages(), 2);
  EXPECT_EQ(meter.sample(), 600);
}

// ------------------------------------------------------------------ MUST_SWAP

TEST_F(SacCacheTest, MustSwapHoldsOnlyAHandleSoTheStorageIsOffloadedAndReloaded) {
  SwapEngine engine(cpu_options());
  SacCache cache(nullptr, &engine);
  auto group = engine.begin_forward(/*layer=*/-1, "sac", /*manual=*/false, false);
  at::Tensor expected;
  {
    at::Tensor out = at::randn({64, 32});
    expected = out.clone();
    cache.record(mm, P::MUST_SWAP, one(out), OutputKind::kSingle, group);
  }  // the op output dies with the forward: only the cache's handle references it
  EXPECT_EQ(cache.stats().swapped_entries, 1);
  EXPECT_EQ(cache.stats().swapped_tensors, 1);
  engine.end_forward(group);  // unscheduled group: released at the end of its forward
  {
    auto swapped = cache.cached_tensors(/*swapped=*/true);
    ASSERT_EQ(swapped.size(), 1u);
    EXPECT_EQ(swapped[0].storage().nbytes(), 0u);  // device memory released in place
  }
  EXPECT_EQ(engine.stats().offload_bytes, 64 * 32 * 4);
  cache.begin_recompute();
  auto r = cache.replay(mm, false);  // reloads on demand, ordered after the D2H copy
  ASSERT_FALSE(r.recompute);
  const at::Tensor& got = r.outputs[0].toTensor();
  EXPECT_EQ(got.storage().nbytes(), size_t{64 * 32 * 4});
  EXPECT_TRUE(at::equal(got, expected));
  EXPECT_EQ(engine.stats().on_demand_reloads, 1);
  EXPECT_EQ(cache.stats().swapped_tensors, 0);  // released after the replay
}

TEST_F(SacCacheTest, MustSwapFallsBackToSavingIneligibleTensors) {
  SwapEngine engine;  // CPU swap off: host tensors are not swappable
  SacCache cache(nullptr, &engine);
  auto group = engine.begin_forward(-1, "sac", false, false);
  at::Tensor out = at::randn({4, 4});
  cache.record(mm, P::MUST_SWAP, one(out), OutputKind::kSingle, group);
  engine.end_forward(group);
  EXPECT_EQ(cache.stats().swapped_tensors, 0);
  EXPECT_EQ(cache.stats().saved_tensors, 1);
  cache.begin_recompute();
  EXPECT_TRUE(at::equal(cache.replay(mm, false).outputs[0].toTensor(), out));
}

TEST_F(SacCacheTest, MutatedSwappedTensorIsAClearError) {
  SwapEngine engine(cpu_options());
  SacCache cache(nullptr, &engine);
  auto group = engine.begin_forward(-1, "sac", false, false);
  at::Tensor out = at::randn({16});
  cache.record(mm, P::MUST_SWAP, one(out), OutputKind::kSingle, group);
  out.add_(1);
  engine.abort_forward(group);
  cache.begin_recompute();
  const std::string msg = message_of([&] { cache.replay(mm, false); });
  EXPECT_TRUE(contains(msg, "hyper_parallel: the output of aten.mm.default (call #0")) << msg;
  EXPECT_TRUE(contains(msg, "swapped (MUST_SWAP) was modified in place")) << msg;
}

TEST_F(SacCacheTest, ClearReleasesEverything) {
  SacCache cache;
  cache.record(mm, P::MUST_SAVE, one(at::ones({3})), OutputKind::kSingle, nullptr);
  cache.record(relu, P::MUST_RECOMPUTE, {}, OutputKind::kSingle, nullptr);
  cache.clear();
  const auto s = cache.stats();
  EXPECT_EQ(s.saved_tensors, 0);
  EXPECT_EQ(s.dropped_entries, 1);
  EXPECT_EQ(s.recompute_entries, 1);
  EXPECT_TRUE(cache.cached_tensors(false).empty());
}

}  // namespace
}  // namespace hyper_parallel::activation
