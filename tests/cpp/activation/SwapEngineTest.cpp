// SwapEngine on its own: CPU tensors through the worker-thread copy backend, with a
// per-byte delay so that copies are still in flight when the engine frees, reloads and
// reuses memory. No autograd: tensors are packed directly, and "only our handles
// reference the storage" is obtained by dropping the test's own tensors after pack.
#include "hyper_parallel/activation/SwapEngine.h"

#include "hyper_parallel/activation/Eligibility.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace hyper_parallel::activation {
namespace {

// The offload window is off (every release submits at once) so that which storages are
// off device after a forward does not depend on how fast the workers run; the window's
// own tests set it.
SwapEngineOptions cpu_options(double delay_ns_per_byte = 4.0, int offload_window = 0) {
  SwapEngineOptions o;
  o.cpu_swap = true;
  o.cpu_delay_ns_per_byte = delay_ns_per_byte;
  o.offload_window = offload_window;
  return o;
}

// Layers l[0] -> l[1] -> ... -> l[n-1] registered with the engine.
std::vector<int64_t> make_chain(SwapEngine& engine, int n) {
  std::vector<int64_t> layers;
  for (int i = 0; i < n; ++i) layers.push_back(engine.new_layer());
  for (int i = 0; i + 1 < n; ++i) engine.link_layers(layers[i], layers[i + 1]);
  return layers;
}

std::shared_ptr<SwapGroup> begin(SwapEngine& engine, int64_t layer, bool group_swap = false) {
  return engine.begin_forward(layer, "", /*manual=*/false, group_swap);
}

std::shared_ptr<SavedHandle> pack(SwapEngine& engine, const std::shared_ptr<SwapGroup>& g,
                                  const at::Tensor& t) {
  return engine.pack(g, t, PackMode::kSwapAll);
}

size_t storage_nbytes(const SavedHandle& h) { return h.alias().storage().nbytes(); }

bool off_device(const SavedHandle& h) {
  const Residency r = h.record()->state();
  return r == Residency::kOffloading || r == Residency::kHost;
}

bool same(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && at::equal(a, b);
}

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

// ------------------------------------------------------------------ the basic swap

TEST(SwapEngineTest, SwapsInPlaceAndRestoresExactly) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  EXPECT_EQ(engine.current_group(), g);
  at::Tensor t = at::randn({64, 33});
  const at::Tensor expected = t.clone();
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  const size_t nbytes = t.storage().nbytes();
  auto h = pack(engine, g, t);
  ASSERT_NE(h, nullptr);
  EXPECT_STREQ(engine.residency_of(t), "device");
  t.reset();  // only the handle references the storage now

  EXPECT_FALSE(engine.end_forward(g));  // scheduled: no "no overlap" warning
  EXPECT_EQ(engine.current_group(), nullptr);
  // Freed in place: same StorageImpl, no bytes.
  EXPECT_EQ(h->alias().storage().unsafeGetStorageImpl(), key);
  EXPECT_EQ(storage_nbytes(*h), 0u);
  EXPECT_TRUE(off_device(*h));
  auto s = engine.stats();
  EXPECT_EQ(s.offload_bytes, static_cast<int64_t>(nbytes));
  EXPECT_EQ(s.offload_count, 1);
  EXPECT_EQ(s.resident_bytes, 0);
  EXPECT_EQ(s.peak_resident_bytes, static_cast<int64_t>(nbytes));

  at::Tensor out = engine.unpack(*h);
  EXPECT_TRUE(same(out, expected));
  EXPECT_EQ(out.storage().unsafeGetStorageImpl(), key);  // identity kept
  EXPECT_EQ(out.storage().nbytes(), nbytes);
  EXPECT_EQ(h->record()->state(), Residency::kDevice);
  EXPECT_STREQ(engine.residency_of(out), "device");
  s = engine.stats();
  EXPECT_EQ(s.reload_bytes, static_cast<int64_t>(nbytes));
  EXPECT_EQ(s.reload_count, 1);
  EXPECT_EQ(s.on_demand_reloads, 1);  // nothing prefetched it
  EXPECT_EQ(s.resident_bytes, static_cast<int64_t>(nbytes));
  // Unpacking again is a no-op on a resident storage.
  EXPECT_TRUE(same(engine.unpack(*h), expected));
  EXPECT_EQ(engine.stats().reload_count, 1);
}

TEST(SwapEngineTest, UnpackWhileTheOffloadIsInFlight) {
  // A large delay keeps the D2H copy running when unpack asks for the data back: the
  // reload must be ordered after it (SPEC 4.2).
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/50.0));
  auto layers = make_chain(engine, 2);
  for (int round = 0; round < 3; ++round) {
    auto g = begin(engine, layers[0]);
    at::Tensor t = at::randn({256, 256});
    const at::Tensor expected = t.clone();
    auto h = pack(engine, g, t);
    t.reset();
    engine.end_forward(g);
    ASSERT_TRUE(off_device(*h));
    EXPECT_TRUE(same(engine.unpack(*h), expected)) << "round " << round;
  }
}

TEST(SwapEngineTest, ViewsOfOneStorageAreSwappedOnceAndComeBackShared) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor base = at::randn({6, 8});
  std::vector<at::Tensor> views = {
      base,
      base.t(),                                        // transposed
      base.narrow(0, 2, 3).narrow(1, 1, 5),            // offset, non-contiguous
      base.select(0, 4).unsqueeze(0).expand({5, 8}),   // expanded, stride 0
      base.view({48}).narrow(0, 7, 20),                // flat slice with offset
      base.select(1, 3),                               // strided column
  };
  base.reset();
  EXPECT_EQ(views[3].stride(0), 0);
  std::vector<std::vector<int64_t>> strides;
  std::vector<int64_t> offsets;
  for (const auto& v : views) {
    strides.push_back(v.strides().vec());
    offsets.push_back(v.storage_offset());
  }
  std::vector<at::Tensor> expected;
  std::vector<std::shared_ptr<SavedHandle>> handles;
  for (const auto& v : views) {
    expected.push_back(v.clone());
    handles.push_back(pack(engine, g, v));
    ASSERT_NE(handles.back(), nullptr);
    EXPECT_EQ(handles.back()->record(), handles.front()->record());  // one record
  }
  views.clear();
  engine.end_forward(g);
  for (const auto& h : handles) EXPECT_EQ(storage_nbytes(*h), 0u);
  auto s = engine.stats();
  EXPECT_EQ(s.offload_bytes, static_cast<int64_t>(48 * sizeof(float)));  // storage bytes, once
  EXPECT_EQ(s.offload_count, 1);

  // Unpack in reverse order: the first unpack brings back the storage for every view.
  std::vector<at::Tensor> out(handles.size());
  for (size_t i = handles.size(); i-- > 0;) out[i] = engine.unpack(*handles[i]);
  for (size_t i = 0; i < out.size(); ++i) {
    EXPECT_TRUE(same(out[i], expected[i])) << "view " << i;
    EXPECT_EQ(out[i].strides().vec(), strides[i]) << "view " << i;
    EXPECT_EQ(out[i].storage_offset(), offsets[i]) << "view " << i;
    EXPECT_TRUE(out[i].is_alias_of(out[0])) << "view " << i;
  }
  EXPECT_EQ(out[3].stride(0), 0);
  EXPECT_EQ(out[2].storage_offset(), 2 * 8 + 1);
  s = engine.stats();
  EXPECT_EQ(s.reload_bytes, static_cast<int64_t>(48 * sizeof(float)));
  EXPECT_EQ(s.reload_count, 1);
  // Still one storage: a write through one restored view is seen by the others.
  out[0].select(0, 4).select(0, 3).fill_(123.0f);
  EXPECT_EQ(out[3][2][3].item<float>(), 123.0f);
  EXPECT_EQ(out[5][4].item<float>(), 123.0f);
  EXPECT_EQ(out[1][3][4].item<float>(), 123.0f);
}

TEST(SwapEngineTest, StorageSavedByTwoInvocationsIsCopiedOnce) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 3);
  at::Tensor shared = at::randn({100});
  const at::Tensor expected = shared.clone();
  auto g0 = begin(engine, layers[0]);
  auto h0 = pack(engine, g0, shared);
  engine.end_forward(g0);
  // Layer 1 reads layer 0's tensor: it must stay on device while the caller holds it.
  EXPECT_EQ(h0->record()->state(), Residency::kDevice);
  auto g1 = begin(engine, layers[1]);
  auto h1 = pack(engine, g1, shared.narrow(0, 10, 50));
  EXPECT_EQ(h1->record(), h0->record());
  shared.reset();
  engine.end_forward(g1);  // both holders released, no outside reference: offload
  EXPECT_EQ(storage_nbytes(*h0), 0u);
  EXPECT_EQ(engine.stats().offload_count, 1);
  EXPECT_EQ(engine.stats().offload_bytes, 400);
  EXPECT_TRUE(same(engine.unpack(*h1), expected.narrow(0, 10, 50)));
  EXPECT_TRUE(same(engine.unpack(*h0), expected));
  EXPECT_EQ(engine.stats().reload_count, 1);
}

// ------------------------------------------------------------------ when storages leave

TEST(SwapEngineTest, StorageInUseElsewhereIsDeferredThenFreed) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 3);
  at::Tensor keep = at::randn({32, 32});
  const at::Tensor expected = keep.clone();
  at::Tensor dropped = at::randn({16});
  const at::Tensor expected_dropped = dropped.clone();
  auto g0 = begin(engine, layers[0]);
  auto hk = pack(engine, g0, keep);
  auto hd = pack(engine, g0, dropped);
  dropped.reset();
  engine.end_forward(g0);
  // The tensor someone else still holds (a later consumer) is not freed...
  EXPECT_EQ(storage_nbytes(*hk), keep.nbytes());
  EXPECT_EQ(hk->record()->state(), Residency::kDevice);
  EXPECT_TRUE(same(keep, expected));  // and its bytes are intact
  EXPECT_GE(engine.stats().deferred_frees, 1);
  // ...while the other storage of the group is.
  EXPECT_EQ(storage_nbytes(*hd), 0u);
  EXPECT_EQ(engine.stats().offload_count, 1);

  // Still in use at the next release point: still deferred.
  auto g1 = begin(engine, layers[1]);
  engine.end_forward(g1);
  EXPECT_EQ(hk->record()->state(), Residency::kDevice);
  EXPECT_TRUE(same(keep, expected));

  // The reference is dropped; the next release point frees it, even though that
  // invocation (the last layer) keeps its own records.
  keep.reset();
  auto g2 = begin(engine, layers[2]);
  engine.end_forward(g2);
  EXPECT_EQ(storage_nbytes(*hk), 0u);
  EXPECT_TRUE(off_device(*hk));
  EXPECT_EQ(engine.stats().offload_count, 2);
  EXPECT_TRUE(same(engine.unpack(*hk), expected));
  EXPECT_TRUE(same(engine.unpack(*hd), expected_dropped));
}

// Who may release a storage (docs/design.md): a deferred release is retried only by the
// thread that deferred it, never by another thread's release point.
TEST(SwapEngineTest, DeferredReleaseIsRetriedOnlyByItsOwnThread) {
  SwapEngine engine(cpu_options());
  auto a = make_chain(engine, 2);
  auto b = make_chain(engine, 2);
  at::Tensor keep = at::randn({32, 32});
  auto g0 = begin(engine, a[0]);
  auto hk = pack(engine, g0, keep);
  engine.end_forward(g0);  // deferred: `keep` is still referenced
  keep.reset();
  std::thread other([&] {
    auto gb = begin(engine, b[0]);
    engine.end_forward(gb);  // another thread's release point
  });
  other.join();
  EXPECT_EQ(hk->record()->state(), Residency::kDevice);
  auto g1 = begin(engine, a[1]);
  engine.end_forward(g1);  // this thread's next release point frees it
  EXPECT_TRUE(off_device(*hk));
}

// Once a backward holds a storage (unpack handed it out, or the invocation's backward began)
// no release point takes it off the device again.
TEST(SwapEngineTest, StorageHandedToBackwardStaysResident) {
  SwapEngine engine(cpu_options());
  engine.set_debug_checks(true);
  auto layers = make_chain(engine, 3);
  at::Tensor keep = at::randn({32, 32});
  const at::Tensor expected = keep.clone();
  auto g0 = begin(engine, layers[0]);
  auto hk = pack(engine, g0, keep);
  engine.end_forward(g0);  // deferred
  keep.reset();
  at::Tensor in_backward = engine.unpack(*hk);  // autograd now reads it
  in_backward.reset();  // (autograd's reference is our alias: the use count cannot tell)
  auto g1 = begin(engine, layers[1]);
  engine.end_forward(g1);  // a release point: must not free it
  EXPECT_EQ(hk->record()->state(), Residency::kDevice);
  EXPECT_EQ(storage_nbytes(*hk), expected.nbytes());
  EXPECT_TRUE(same(engine.unpack(*hk), expected));

  // A group whose backward began (prefetched) is not released by a later release point.
  at::Tensor t = at::randn({16, 16});
  auto g2 = begin(engine, layers[0]);
  auto ht = pack(engine, g2, t);
  engine.end_forward(g2);  // deferred: `t` is referenced
  t.reset();
  engine.backward_begin(g2);
  auto g3 = begin(engine, layers[1]);
  engine.end_forward(g3);
  EXPECT_EQ(ht->record()->state(), Residency::kDevice);
  EXPECT_EQ(engine.stats().on_demand_reloads, 0);
}

// Region stacks: reset() ends, on every thread, regions that were left open, and a region
// whose outer region ended is dropped with it.
TEST(SwapEngineTest, ResetAndOuterEndDropRegionsLeftOpen) {
  SwapEngine engine(cpu_options());
  auto outer = begin(engine, -1);
  auto inner = begin(engine, -1);  // never ended (its bookkeeping was interrupted)
  EXPECT_EQ(SwapEngine::thread_region_count(&engine), 2u);
  engine.end_forward(outer);
  EXPECT_EQ(engine.current_group(), nullptr);
  EXPECT_TRUE(inner->aborted);
  auto left = begin(engine, -1);
  (void)left;
  std::thread other([&] {
    auto g = begin(engine, -1);
    (void)g;
    engine.reset(true);
    EXPECT_EQ(engine.current_group(), nullptr);
  });
  other.join();
  EXPECT_EQ(engine.current_group(), nullptr);  // this thread's stale entry too
  EXPECT_EQ(SwapEngine::thread_region_count(&engine), 0u);
}

TEST(SwapEngineTest, DeferredStorageHeldByTwoReleasedInvocationsIsOffloadedOnce) {
  // A storage deferred by two released invocations may sit twice in the deferred list;
  // the next release point must still offload it exactly once.
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 3);
  at::Tensor keep = at::randn({1000});
  const at::Tensor expected = keep.clone();
  auto g0 = begin(engine, layers[0]);
  auto h0 = pack(engine, g0, keep);
  engine.end_forward(g0);
  auto g1 = begin(engine, layers[1]);
  auto h1 = pack(engine, g1, keep.view({10, 100}));
  engine.end_forward(g1);
  EXPECT_EQ(h0->record()->state(), Residency::kDevice);
  keep.reset();
  auto g2 = begin(engine, layers[2]);
  EXPECT_NO_THROW(engine.end_forward(g2));
  EXPECT_EQ(storage_nbytes(*h0), 0u);
  const auto s = engine.stats();
  EXPECT_EQ(s.offload_count, 1);
  EXPECT_EQ(s.offload_bytes, 4000);
  EXPECT_TRUE(same(engine.unpack(*h1), expected.view({10, 100})));
  EXPECT_TRUE(same(engine.unpack(*h0), expected));
}

TEST(SwapEngineTest, LastLayerOfAChainKeepsItsStorages) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[1]);
  at::Tensor t = at::randn({40});
  const at::Tensor expected = t.clone();
  auto h = pack(engine, g, t);
  t.reset();
  EXPECT_FALSE(engine.end_forward(g));
  EXPECT_EQ(storage_nbytes(*h), 40 * sizeof(float));
  EXPECT_EQ(h->record()->state(), Residency::kDevice);
  EXPECT_EQ(engine.stats().offload_count, 0);
  EXPECT_TRUE(same(engine.unpack(*h), expected));
  EXPECT_EQ(engine.stats().reload_count, 0);
}

TEST(SwapEngineTest, UnscheduledGroupsReleaseAtForwardEnd) {
  SwapEngine engine(cpu_options());
  const int64_t lone = engine.new_layer();
  EXPECT_FALSE(engine.layer_scheduled(lone));
  for (int64_t layer : {lone, int64_t{-1}}) {
    auto g = begin(engine, layer);
    at::Tensor t = at::randn({7, 3});
    const at::Tensor expected = t.clone();
    auto h = pack(engine, g, t);
    t.reset();
    EXPECT_TRUE(engine.end_forward(g)) << "unscheduled group with records";
    EXPECT_EQ(storage_nbytes(*h), 0u);
    EXPECT_TRUE(same(engine.unpack(*h), expected));
  }
  // An unscheduled group without records does not ask for a warning.
  auto empty = begin(engine, lone);
  EXPECT_FALSE(engine.end_forward(empty));
}

TEST(SwapEngineTest, ManualGroupMovesOnlyWhenTold) {
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/20.0));
  auto g = engine.begin_forward(-1, "my_group", /*manual=*/true, /*group_swap=*/false);
  EXPECT_EQ(engine.find_group("my_group"), g);
  at::Tensor a = at::randn({300});
  at::Tensor b = at::randint(0, 1000, {77}, at::kLong);
  const at::Tensor ea = a.clone(), eb = b.clone();
  auto ha = pack(engine, g, a);
  auto hb = pack(engine, g, b);
  a.reset();
  b.reset();
  EXPECT_FALSE(engine.end_forward(g));
  EXPECT_EQ(ha->record()->state(), Residency::kDevice);
  // A wait before its launch is refused, and moves nothing.
  EXPECT_THROW(engine.wait_offload(g), c10::ValueError);
  EXPECT_THROW(engine.wait_load(g), c10::ValueError);
  EXPECT_EQ(ha->record()->state(), Residency::kDevice);
  engine.launch_offload(g);
  EXPECT_THROW(engine.wait_load(g), c10::ValueError);  // offloaded, not yet reloading
  EXPECT_EQ(storage_nbytes(*ha), 0u);
  EXPECT_EQ(storage_nbytes(*hb), 0u);
  engine.wait_offload(g);
  EXPECT_EQ(ha->record()->state(), Residency::kHost);
  EXPECT_EQ(hb->record()->state(), Residency::kHost);
  engine.launch_load(g);
  EXPECT_EQ(ha->record()->state(), Residency::kReloading);
  EXPECT_EQ(storage_nbytes(*ha), 300 * sizeof(float));
  engine.wait_load(g);
  EXPECT_EQ(ha->record()->state(), Residency::kDevice);
  EXPECT_EQ(hb->record()->state(), Residency::kDevice);
  EXPECT_TRUE(same(engine.unpack(*ha), ea));
  EXPECT_TRUE(same(engine.unpack(*hb), eb));
  EXPECT_EQ(engine.stats().on_demand_reloads, 0);
  EXPECT_THROW(engine.launch_offload(nullptr), c10::Error);
  EXPECT_THROW(engine.wait_load(nullptr), c10::Error);
}

// ------------------------------------------------------------------ backward side

// Two chained layers, forward run: layer 0 saved a [128, 64] float tensor (offloaded),
// layer 1 (the last) a [64] one (stays on device); `ea` / `eb` are their values.
struct TwoLayerForward {
  std::shared_ptr<SwapGroup> g0, g1;
  std::shared_ptr<SavedHandle> ha, hb;
  at::Tensor ea, eb;
};

TwoLayerForward run_two_layer_forward(SwapEngine& engine) {
  TwoLayerForward f;
  auto layers = make_chain(engine, 2);
  f.g0 = begin(engine, layers[0]);
  at::Tensor a = at::randn({128, 64});
  f.ea = a.clone();
  f.ha = pack(engine, f.g0, a);
  a.reset();
  engine.end_forward(f.g0);
  f.g1 = begin(engine, layers[1]);
  at::Tensor b = at::randn({64});
  f.eb = b.clone();
  f.hb = pack(engine, f.g1, b);
  b.reset();
  engine.end_forward(f.g1);
  return f;
}

TEST(SwapEngineTest, BackwardBeginPrefetchesThePredecessor) {
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/20.0));
  auto [g0, g1, ha, hb, ea, eb] = run_two_layer_forward(engine);
  ASSERT_TRUE(off_device(*ha));
  ASSERT_EQ(hb->record()->state(), Residency::kDevice);

  engine.backward_begin(g1);
  // The reload of layer 0 started: device memory is back (being filled).
  EXPECT_EQ(ha->record()->state(), Residency::kReloading);
  EXPECT_EQ(storage_nbytes(*ha), 128 * 64 * sizeof(float));
  EXPECT_STREQ(engine.residency_of(ha->alias()), "reloading");
  EXPECT_TRUE(same(engine.unpack(*hb), eb));
  EXPECT_TRUE(same(engine.unpack(*ha), ea));
  const auto s = engine.stats();
  EXPECT_EQ(s.on_demand_reloads, 0);
  EXPECT_EQ(s.reload_count, 1);
}

TEST(SwapEngineTest, TryUnpackHandsOutOnlyWhatNeedsNoWait) {
  // The unpack hook's fast path (issue 17): an offloaded storage is refused without any
  // change (no reload started, not marked as read by a backward); once its prefetch
  // completed it is handed out with unpack()'s bookkeeping.
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/2.0));
  auto [g0, g1, ha, hb, ea, eb] = run_two_layer_forward(engine);
  engine.synchronize();
  ASSERT_TRUE(off_device(*ha));
  const Residency before = ha->record()->state();

  EXPECT_FALSE(engine.try_unpack(*ha).defined());
  EXPECT_EQ(ha->record()->state(), before);
  EXPECT_EQ(storage_nbytes(*ha), 0u);
  EXPECT_FALSE(ha->record()->in_use_by_backward);
  EXPECT_EQ(engine.stats().reload_count, 0);

  at::Tensor out_b = engine.try_unpack(*hb);  // the last layer stayed on device
  ASSERT_TRUE(out_b.defined());
  EXPECT_TRUE(same(out_b, eb));
  EXPECT_TRUE(hb->record()->in_use_by_backward);

  engine.backward_begin(g1);  // prefetches layer 0
  engine.synchronize();
  at::Tensor out_a = engine.try_unpack(*ha);
  ASSERT_TRUE(out_a.defined());
  EXPECT_TRUE(same(out_a, ea));
  EXPECT_EQ(ha->record()->state(), Residency::kDevice);
  EXPECT_TRUE(ha->record()->in_use_by_backward);
  const auto s = engine.stats();
  EXPECT_EQ(s.on_demand_reloads, 0);
  EXPECT_EQ(s.reload_count, 1);
}

TEST(SwapEngineTest, PrefetchDepthControlsHowFarAheadReloadsStart) {
  for (int depth : {0, 1, 2}) {
    SwapEngine engine(cpu_options());
    engine.set_prefetch_depth(depth);
    EXPECT_EQ(engine.prefetch_depth(), depth);
    auto layers = make_chain(engine, 4);
    std::vector<std::shared_ptr<SwapGroup>> groups;
    std::vector<std::shared_ptr<SavedHandle>> handles;
    std::vector<at::Tensor> expected;
    for (int64_t layer : layers) {
      groups.push_back(begin(engine, layer));
      at::Tensor t = at::randn({50});
      expected.push_back(t.clone());
      handles.push_back(pack(engine, groups.back(), t));
      t.reset();
      engine.end_forward(groups.back());
    }
    for (int i = 0; i < 3; ++i) ASSERT_TRUE(off_device(*handles[i])) << i;
    engine.backward_begin(groups[3]);
    // Layers 2, 1, ... are reloaded up to `depth` layers ahead.
    for (int i = 0; i < 3; ++i) {
      const bool prefetched = i >= 3 - depth;
      EXPECT_EQ(handles[i]->record()->state() == Residency::kReloading, prefetched)
          << "depth " << depth << " layer " << i;
    }
    for (int i = 3; i-- > 0;) EXPECT_TRUE(same(engine.unpack(*handles[i]), expected[i]));
    EXPECT_EQ(engine.stats().on_demand_reloads, 3 - depth);
  }
  SwapEngine engine(cpu_options());
  EXPECT_THROW(engine.set_prefetch_depth(-1), c10::Error);
}

TEST(SwapEngineTest, OnDemandReloadsAreCounted) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  std::vector<std::shared_ptr<SavedHandle>> handles;
  std::vector<at::Tensor> expected;
  for (int i = 0; i < 4; ++i) {
    at::Tensor t = at::randn({10 + i});
    expected.push_back(t.clone());
    handles.push_back(pack(engine, g, t));
  }
  engine.end_forward(g);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(same(engine.unpack(*handles[i]), expected[i]));
  EXPECT_EQ(engine.stats().on_demand_reloads, 4);
  EXPECT_EQ(engine.stats().reload_count, 4);
  engine.reset(/*schedule=*/false);
  EXPECT_EQ(engine.stats().on_demand_reloads, 0);
  EXPECT_TRUE(engine.layer_scheduled(layers[0]));
  engine.reset(/*schedule=*/true);
  EXPECT_FALSE(engine.layer_scheduled(layers[0]));
}

TEST(SwapEngineTest, PrefetchTargetsAreTheInvocationThenItsPredecessors) {
  // What a backend that moves its own data (MindSpore) reloads when a layer's backward
  // begins: the invocation itself, then prefetch_depth predecessors, nearest first.
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 3);
  std::vector<std::shared_ptr<SwapGroup>> groups;
  for (auto layer : layers) {
    groups.push_back(begin(engine, layer));
    engine.end_forward(groups.back());
  }
  EXPECT_TRUE(groups[0]->released);
  EXPECT_FALSE(groups[2]->released);  // the last layer of the chain stays on device
  auto targets = engine.prefetch_targets(groups[2]);
  ASSERT_EQ(targets.size(), 2u);
  EXPECT_EQ(targets[0], groups[2]);
  EXPECT_EQ(targets[1], groups[1]);
  engine.set_prefetch_depth(2);
  EXPECT_EQ(engine.prefetch_targets(groups[2]).size(), 3u);
  engine.set_prefetch_depth(0);
  EXPECT_EQ(engine.prefetch_targets(groups[1]).size(), 1u);
}

TEST(SwapEngineTest, PrefetchSkipsStoragesThatDiedWhileOffloaded) {
  // Regression: a saved tensor whose handle dies while its storage is offloaded (a
  // discarded output's graph) leaves a record without a storage in its group; a
  // prefetch of that group failed with an internal error instead of skipping it.
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g0 = begin(engine, layers[0]);
  at::Tensor a = at::randn({100});
  at::Tensor b = at::randn({200});
  const at::Tensor ea = a.clone();
  auto ha = pack(engine, g0, a);
  auto hb = pack(engine, g0, b);
  a.reset();
  b.reset();
  engine.end_forward(g0);
  ASSERT_TRUE(off_device(*hb));
  hb.reset();  // the storage of b dies; its record stays in g0
  auto g1 = begin(engine, layers[1]);
  engine.end_forward(g1);
  EXPECT_NO_THROW(engine.backward_begin(g1));
  EXPECT_EQ(ha->record()->state(), Residency::kReloading);
  EXPECT_TRUE(same(engine.unpack(*ha), ea));
  EXPECT_EQ(engine.stats().reload_bytes, 400);
}

TEST(SwapEngineTest, FusedBucketWithADeadMemberReloadsTheOthers) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0], /*group_swap=*/true);
  std::vector<std::shared_ptr<SavedHandle>> handles;
  std::vector<at::Tensor> expected;
  for (int i = 0; i < 5; ++i) {
    at::Tensor t = at::randn({17 * (i + 1)});
    expected.push_back(t.clone());
    handles.push_back(pack(engine, g, t));
  }
  engine.end_forward(g);
  ASSERT_EQ(engine.stats().fused_copies, 1);
  handles[2].reset();  // a member in the middle of the bucket dies
  for (int i : {4, 0, 1, 3}) {
    at::Tensor out;
    EXPECT_NO_THROW(out = engine.unpack(*handles[i])) << i;
    EXPECT_TRUE(same(out, expected[i])) << i;
  }
}

// ------------------------------------------------------------------ in-place writes

TEST(SwapEngineTest, InPlaceWriteAfterPackIsDetectedAtUnpack) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor t = at::randn({20});
  auto h = pack(engine, g, t);
  t.add_(1.0);
  t.reset();
  engine.end_forward(g);
  const std::string msg = message_of([&] { engine.unpack(*h); });
  EXPECT_NE(msg.find("hyper_parallel:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("in-place"), std::string::npos) << msg;
  // Through a view too: the version counter is shared by all views of the storage.
  auto g2 = begin(engine, layers[0]);
  at::Tensor base = at::randn({4, 5});
  auto hv = pack(engine, g2, base.t());
  base.select(0, 1).mul_(2.0);
  base.reset();
  engine.end_forward(g2);
  EXPECT_THROW(engine.unpack(*hv), c10::Error);
}

TEST(SwapEngineTest, InPlaceWriteAfterRegistrationFailsTheForward) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor t = at::randn({8, 8});
  EXPECT_TRUE(engine.register_tensor(g, t));
  t.mul_(2.0);
  const std::string msg = message_of([&] { engine.end_forward(g); });
  EXPECT_NE(msg.find("hyper_parallel:"), std::string::npos) << msg;
  EXPECT_NE(msg.find("swap_tensor_wrapper"), std::string::npos) << msg;
  EXPECT_TRUE(g->aborted);
  EXPECT_EQ(engine.current_group(), nullptr);
  // Nothing was moved off the device, and the next step works.
  EXPECT_EQ(t.storage().nbytes(), 64 * sizeof(float));
  EXPECT_EQ(engine.stats().offload_count, 0);
  auto g2 = begin(engine, layers[0]);
  at::Tensor u = at::randn({8, 8});
  const at::Tensor eu = u.clone();
  EXPECT_TRUE(engine.register_tensor(g2, u));
  auto hu = engine.pack(g2, u, PackMode::kRegisteredOnly);
  ASSERT_NE(hu, nullptr);
  u.reset();
  EXPECT_NO_THROW(engine.end_forward(g2));
  EXPECT_EQ(storage_nbytes(*hu), 0u);
  EXPECT_TRUE(same(engine.unpack(*hu), eu));
}

TEST(SwapEngineTest, RegisteredOnlyModeSwapsOnlyRegisteredStorages) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor reg = at::randn({30});
  at::Tensor other = at::randn({30});
  const at::Tensor ereg = reg.clone();
  ASSERT_TRUE(engine.register_tensor(g, reg));
  EXPECT_EQ(engine.pack(g, other, PackMode::kRegisteredOnly), nullptr);
  auto h = engine.pack(g, reg.narrow(0, 5, 10), PackMode::kRegisteredOnly);
  ASSERT_NE(h, nullptr);
  reg.reset();  // the registration itself counts as one of our own references
  engine.end_forward(g);
  EXPECT_EQ(storage_nbytes(*h), 0u);
  EXPECT_EQ(engine.stats().offload_count, 1);
  EXPECT_TRUE(same(engine.unpack(*h), ereg.narrow(0, 5, 10)));
  EXPECT_EQ(other.storage().nbytes(), 30 * sizeof(float));
}

// ------------------------------------------------------------------ group_swap fusion

TEST(SwapEngineTest, GroupSwapFusesSmallTensors) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0], /*group_swap=*/true);
  std::vector<std::shared_ptr<SavedHandle>> handles;
  std::vector<at::Tensor> expected;
  int64_t float_bytes = 0;
  for (int i = 0; i < 24; ++i) {
    at::Tensor t = at::randn({1 + 13 * i});
    float_bytes += t.nbytes();
    expected.push_back(t.clone());
    handles.push_back(pack(engine, g, t));
  }
  engine.end_forward(g);
  auto s = engine.stats();
  EXPECT_EQ(s.fused_copies, 1);  // one float bucket
  EXPECT_EQ(s.offload_count, 24);
  EXPECT_EQ(s.offload_bytes, float_bytes);
  EXPECT_EQ(s.transfers, 1);
  for (const auto& h : handles) EXPECT_EQ(storage_nbytes(*h), 0u);
  // The first unpack brings the whole bucket back in one copy.
  EXPECT_TRUE(same(engine.unpack(*handles[7]), expected[7]));
  s = engine.stats();
  EXPECT_EQ(s.fused_copies, 2);
  EXPECT_EQ(s.reload_count, 24);
  EXPECT_EQ(s.transfers, 2);
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_TRUE(same(engine.unpack(*handles[i]), expected[i])) << i;
  }
  EXPECT_EQ(engine.stats().on_demand_reloads, 1);
}

TEST(SwapEngineTest, GroupSwapBucketsByDtypeAndThreshold) {
  SwapEngine engine(cpu_options());
  engine.set_fusion_threshold(1024);
  EXPECT_EQ(engine.fusion_threshold(), 1024);
  EXPECT_THROW(engine.set_fusion_threshold(0), c10::Error);
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0], /*group_swap=*/true);
  std::vector<std::shared_ptr<SavedHandle>> handles;
  std::vector<at::Tensor> expected;
  auto add = [&](at::Tensor t) {
    expected.push_back(t.clone());
    handles.push_back(pack(engine, g, t));
  };
  for (int i = 0; i < 10; ++i) add(at::randn({50}));                       // 200 B floats
  for (int i = 0; i < 6; ++i) add(at::randint(-9, 9, {3 + i}, at::kLong)); // small int64
  for (int i = 0; i < 5; ++i) add(at::randint(0, 2, {7 + i}, at::kInt).to(at::kBool));
  add(at::randn({600}));  // 2400 B: above the threshold, moves on its own
  engine.end_forward(g);
  const auto s = engine.stats();
  EXPECT_EQ(s.offload_count, static_cast<int64_t>(handles.size()));
  // floats: 2000 B in buckets of <= 1024 B (5 per bucket) -> 2; int64: 1; bool: 1.
  EXPECT_EQ(s.fused_copies, 4);
  for (size_t i = handles.size(); i-- > 0;) {
    EXPECT_TRUE(same(engine.unpack(*handles[i]), expected[i])) << i;
  }
}

// ------------------------------------------------------------------ eligibility

TEST(SwapEngineTest, IneligibleTensorsPassThrough) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);

  at::Tensor param = at::randn({6}).set_requires_grad(true);
  EXPECT_EQ(check_eligible(param, true), Ineligible::kParameter);
  EXPECT_EQ(pack(engine, g, param), nullptr);
  EXPECT_EQ(check_eligible(param.narrow(0, 1, 3), true), Ineligible::kParameter);
  EXPECT_EQ(pack(engine, g, param.narrow(0, 1, 3)), nullptr);
  EXPECT_FALSE(engine.register_tensor(g, param));

  std::vector<float> buffer(12, 1.5f);
  at::Tensor blob = at::from_blob(buffer.data(), {3, 4});
  EXPECT_EQ(check_eligible(blob, true), Ineligible::kForeignStorage);
  EXPECT_EQ(pack(engine, g, blob), nullptr);

  at::Tensor empty = at::empty({0, 5});
  EXPECT_EQ(check_eligible(empty, true), Ineligible::kEmpty);
  EXPECT_EQ(pack(engine, g, empty), nullptr);

  at::Tensor meta = at::empty({4, 4}, at::TensorOptions().device(at::kMeta));
  EXPECT_EQ(check_eligible(meta, true), Ineligible::kMetaOrFake);
  EXPECT_EQ(pack(engine, g, meta), nullptr);

  EXPECT_EQ(check_eligible(at::Tensor(), true), Ineligible::kUndefined);
  EXPECT_EQ(pack(engine, g, at::Tensor()), nullptr);

  // A host tensor with CPU swap off is not ours either.
  at::Tensor host = at::randn({4});
  EXPECT_EQ(check_eligible(host, false), Ineligible::kHostTensor);
  EXPECT_EQ(check_eligible(host, true), Ineligible::kNone);

  // An activation computed from a parameter (non-leaf, requires grad) is eligible.
  at::Tensor act = param * 2;
  EXPECT_EQ(check_eligible(act, true), Ineligible::kNone);

  // A storage excluded for this invocation (the module's own buffers) passes through.
  at::Tensor buf = at::randn({5});
  g->excluded.insert(buf.storage().unsafeGetStorageImpl());
  EXPECT_EQ(pack(engine, g, buf), nullptr);
  EXPECT_FALSE(engine.register_tensor(g, buf));

  engine.end_forward(g);
  // Passed-through tensors are untouched.
  EXPECT_TRUE(same(blob, at::full({3, 4}, 1.5f)));
  EXPECT_EQ(param.storage().nbytes(), 6 * sizeof(float));
  EXPECT_EQ(buf.storage().nbytes(), 5 * sizeof(float));
  EXPECT_EQ(engine.stats().offload_count, 0);
  EXPECT_EQ(engine.stats().live_records, 0);
}

TEST(SwapEngineTest, HostTensorsAreNotSwappedWithoutCpuSwap) {
  SwapEngine engine(SwapEngineOptions{});
  EXPECT_FALSE(engine.cpu_swap());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor t = at::randn({9});
  EXPECT_EQ(pack(engine, g, t), nullptr);
  engine.set_cpu_swap(true);
  EXPECT_TRUE(engine.cpu_swap());
  EXPECT_NE(pack(engine, g, t), nullptr);
  engine.end_forward(g);
  EXPECT_EQ(engine.pack(nullptr, t, PackMode::kSwapAll), nullptr);  // no group
}

TEST(SwapEngineTest, ActivationOfAParameterRoundTrips) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  at::Tensor param = at::randn({4, 4}).set_requires_grad(true);
  auto g = begin(engine, layers[0]);
  at::Tensor act = at::matmul(param, param).tanh();
  const at::Tensor expected = act.detach().clone();
  auto h = pack(engine, g, act);
  ASSERT_NE(h, nullptr);
  act.reset();
  engine.end_forward(g);
  EXPECT_EQ(storage_nbytes(*h), 0u);
  EXPECT_EQ(param.storage().nbytes(), 16 * sizeof(float));  // the parameter stayed
  EXPECT_TRUE(same(engine.unpack(*h), expected));
}

TEST(SwapEngineTest, IntegerAndBoolTensorsRoundTripExactly) {
  SwapEngine engine(cpu_options());
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  std::vector<at::Tensor> inputs = {
      at::randint(-(int64_t{1} << 40), int64_t{1} << 40, {33}, at::kLong),
      at::randint(-128, 128, {7}, at::kChar),             // 7 bytes
      at::randint(0, 2, {1}, at::kInt).to(at::kBool),     // a single byte
      at::randint(0, 2, {13}, at::kInt).to(at::kBool),    // 13 bytes
      at::randint(-1000, 1000, {5, 3}, at::kShort).t(),   // non-contiguous int16
      at::randn({11}).to(at::kHalf),
      at::randn({9}, at::kDouble),
  };
  std::vector<at::Tensor> expected;
  std::vector<std::shared_ptr<SavedHandle>> handles;
  for (auto& t : inputs) {
    expected.push_back(t.clone());
    handles.push_back(pack(engine, g, t));
    ASSERT_NE(handles.back(), nullptr) << t.scalar_type();
  }
  inputs.clear();
  engine.end_forward(g);
  int64_t total = 0;
  for (const auto& h : handles) {
    EXPECT_EQ(storage_nbytes(*h), 0u);
    total += h->record()->nbytes();
  }
  EXPECT_EQ(engine.stats().offload_bytes, total);
  for (size_t i = 0; i < handles.size(); ++i) {
    EXPECT_TRUE(same(engine.unpack(*handles[i]), expected[i])) << expected[i].scalar_type();
  }
}

// ------------------------------------------------------------------ host memory

void run_steady_state(bool group_swap) {
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/1.0));
  auto layers = make_chain(engine, 2);
  int64_t allocations_after_first = -1;
  for (int step = 0; step < 50; ++step) {
    auto g = begin(engine, layers[0], group_swap);
    std::vector<at::Tensor> expected;
    std::vector<std::shared_ptr<SavedHandle>> handles;
    for (at::Tensor t : {at::randn({1000}), at::randn({70000}), at::randint(0, 9, {5}, at::kLong),
                         at::randn({3, 17})}) {
      expected.push_back(t.clone());
      handles.push_back(pack(engine, g, t));
    }
    engine.end_forward(g);
    for (size_t i = 0; i < handles.size(); ++i) {
      ASSERT_TRUE(same(engine.unpack(*handles[i]), expected[i])) << "step " << step;
    }
    handles.clear();
    g.reset();
    const auto s = engine.stats();
    if (step == 0) {
      allocations_after_first = s.host_allocations;
      EXPECT_GT(allocations_after_first, 0);
    } else {
      ASSERT_EQ(s.host_allocations, allocations_after_first) << "step " << step;
    }
    EXPECT_EQ(s.pinned_bytes_in_use, 0) << "step " << step;  // every block went back
  }
  const auto s = engine.stats();
  EXPECT_EQ(s.host_reuses, 49 * s.host_allocations);
  EXPECT_EQ(s.live_records, 0);
  EXPECT_EQ(s.resident_bytes, 0);
}

TEST(SwapEngineTest, PoolReachesSteadyStateAfterTheFirstStep) { run_steady_state(false); }

TEST(SwapEngineTest, PoolReachesSteadyStateWithGroupSwap) { run_steady_state(true); }

// ------------------------------------------------------------------ threads

TEST(SwapEngineTest, TwoThreadsDriveTheEngineConcurrently) {
  SwapEngine engine(cpu_options(/*delay_ns_per_byte=*/2.0));
  std::atomic<int> mismatches{0};
  std::atomic<int> errors{0};
  std::atomic<int> steps{0};
  auto worker = [&](int seed) {
    try {
      auto layers = make_chain(engine, 3);
      at::Generator gen = at::detail::createCPUGenerator(seed);
      for (int step = 0; step < 25; ++step) {
        std::vector<std::shared_ptr<SwapGroup>> groups;
        std::vector<std::shared_ptr<SavedHandle>> handles;
        std::vector<at::Tensor> expected;
        for (int64_t layer : layers) {
          auto g = begin(engine, layer, /*group_swap=*/step % 2 == 1);
          if (engine.current_group() != g) mismatches += 1;
          at::Tensor base = at::randn({40 + step, 24}, gen);
          for (at::Tensor t : {base, base.t(), base.narrow(0, 3, 5), at::randn({64}, gen),
                               at::randint(0, 100, {9}, gen, at::kLong)}) {
            expected.push_back(t.clone());
            handles.push_back(pack(engine, g, t));
          }
          base.reset();
          engine.end_forward(g);
          groups.push_back(g);
        }
        for (int i = static_cast<int>(groups.size()); i-- > 0;) {
          engine.backward_begin(groups[i]);
        }
        for (size_t i = handles.size(); i-- > 0;) {
          if (!same(engine.unpack(*handles[i]), expected[i])) mismatches += 1;
        }
        steps += 1;
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
      errors += 1;
    }
  };
  std::thread t1(worker, 1), t2(worker, 2);
  t1.join();
  t2.join();
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(steps.load(), 50);
  engine.synchronize();
  const auto s = engine.stats();
  EXPECT_GT(s.offload_count, 0);
  EXPECT_EQ(s.live_records, 0);
  EXPECT_EQ(s.resident_bytes, 0);
}


// ------------------------------------------------------------------ what was not offloaded

int64_t skipped_bytes(const SwapStats& s, SkipReason r) {
  return s.skipped_bytes[static_cast<size_t>(r)];
}
int64_t skipped_count(const SwapStats& s, SkipReason r) {
  return s.skipped_count[static_cast<size_t>(r)];
}

TEST(SwapEngineTest, SkippedTensorsAreCountedByReasonOncePerStorage) {
  SwapEngine engine(SwapEngineOptions{});  // CPU swap off: host tensors are not swapped
  auto layers = make_chain(engine, 2);
  auto g = begin(engine, layers[0]);
  at::Tensor host = at::randn({10});
  at::Tensor weight = at::randn({4, 4}).requires_grad_(true);
  at::Tensor buffer = at::randn({3});
  g->excluded.insert(buffer.storage().unsafeGetStorageImpl());
  EXPECT_EQ(pack(engine, g, host), nullptr);
  EXPECT_EQ(pack(engine, g, host.narrow(0, 2, 3)), nullptr);  // same storage: counted once
  engine.set_cpu_swap(true);
  EXPECT_EQ(pack(engine, g, weight), nullptr);
  EXPECT_EQ(pack(engine, g, weight.t()), nullptr);  // a view of it: the same storage
  EXPECT_EQ(pack(engine, g, buffer), nullptr);
  // A registered-only region never asked for the others: nothing counted.
  at::Tensor other = at::randn({5}).requires_grad_(true);
  EXPECT_EQ(engine.pack(g, other, PackMode::kRegisteredOnly), nullptr);
  engine.end_forward(g);
  const auto s = engine.stats();
  EXPECT_EQ(skipped_count(s, SkipReason::kHostTensor), 1);
  EXPECT_EQ(skipped_bytes(s, SkipReason::kHostTensor), 40);
  EXPECT_EQ(skipped_count(s, SkipReason::kParameter), 1);
  EXPECT_EQ(skipped_bytes(s, SkipReason::kParameter), 64);
  EXPECT_EQ(skipped_count(s, SkipReason::kBuffer), 1);
  EXPECT_EQ(skipped_bytes(s, SkipReason::kBuffer), 12);
  EXPECT_EQ(g->skipped_count[static_cast<size_t>(SkipReason::kHostTensor)], 1);
  EXPECT_EQ(g->skipped_bytes[static_cast<size_t>(SkipReason::kBuffer)], 12);
  // A second invocation counts its own skips again; reset clears the counters.
  auto g2 = begin(engine, layers[1]);
  engine.count_skipped(g2, buffer, SkipReason::kKeptByPolicy);
  engine.end_forward(g2);
  EXPECT_EQ(skipped_bytes(engine.stats(), SkipReason::kKeptByPolicy), 12);
  engine.reset(false);
  EXPECT_EQ(skipped_count(engine.stats(), SkipReason::kParameter), 0);
  EXPECT_STREQ(to_string(SkipReason::kInUseElsewhere), "in_use_elsewhere");
}

TEST(SwapEngineTest, KeptOnDeviceIsCountedAtBackwardStart) {
  SwapEngine engine(cpu_options(0.0));
  auto layers = make_chain(engine, 2);
  at::Tensor kept = at::randn({25});  // still referenced outside the engine
  at::Tensor freed = at::randn({8});
  auto g0 = begin(engine, layers[0]);
  auto hk = pack(engine, g0, kept);
  auto hf = pack(engine, g0, freed);
  freed.reset();
  engine.end_forward(g0);
  auto g1 = begin(engine, layers[1]);  // the last layer keeps its own storages
  at::Tensor last = at::randn({6});
  auto hl = pack(engine, g1, last);
  last.reset();
  engine.end_forward(g1);
  engine.backward_begin(g1);
  engine.backward_begin(g1);  // a second start counts nothing again
  engine.backward_begin(g0);
  const auto s = engine.stats();
  EXPECT_EQ(skipped_count(s, SkipReason::kLastLayer), 1);
  EXPECT_EQ(skipped_bytes(s, SkipReason::kLastLayer), 24);
  EXPECT_EQ(skipped_count(s, SkipReason::kInUseElsewhere), 1);
  EXPECT_EQ(skipped_bytes(s, SkipReason::kInUseElsewhere), 100);
  EXPECT_EQ(s.offload_bytes, 32);  // the freed one left and is not counted as kept
  engine.unpack(*hf);
}


// One forward over a chain: each layer saves one fresh tensor of `numel` floats, then ends
// its forward (its release point); `before_end(i, f)` runs just before layer i's end.
struct ChainForward {
  std::vector<std::shared_ptr<SwapGroup>> groups;
  std::vector<std::shared_ptr<SavedHandle>> handles;
  std::vector<at::Tensor> expected;  // clones of the saved tensors
};

ChainForward forward_chain(SwapEngine& engine, const std::vector<int64_t>& layers, int64_t numel,
                           const std::function<void(size_t, const ChainForward&)>& before_end = {}) {
  ChainForward f;
  for (size_t i = 0; i < layers.size(); ++i) {
    f.groups.push_back(begin(engine, layers[i]));
    at::Tensor t = at::randn({numel});
    f.expected.push_back(t.clone());
    f.handles.push_back(pack(engine, f.groups.back(), t));
    t.reset();
    if (before_end) before_end(i, f);
    engine.end_forward(f.groups.back());
  }
  return f;
}

// The backward of forward_chain's layers, last first; every unpack is bitwise the saved tensor.
void backward_chain(SwapEngine& engine, const ChainForward& f) {
  for (size_t i = f.groups.size(); i-- > 0;) {
    engine.backward_begin(f.groups[i]);
    EXPECT_TRUE(same(engine.unpack(*f.handles[i]), f.expected[i])) << i;
  }
}

TEST(SwapEngineTest, OffloadWindowKeepsTrailingLayersResidentWhenTheLinkFallsBehind) {
  // 40 KB per layer at 2500 ns/B: 100 ms per offload; the forward below takes microseconds.
  SwapEngine engine(cpu_options(2500.0, /*offload_window=*/2));
  const ChainForward f = forward_chain(engine, make_chain(engine, 5), 10000);
  // Layers 0 and 1 fill the window; 2 and 3 wait; 4 is the last layer.
  EXPECT_TRUE(off_device(*f.handles[0]));
  EXPECT_TRUE(off_device(*f.handles[1]));
  EXPECT_FALSE(off_device(*f.handles[2]));
  EXPECT_FALSE(off_device(*f.handles[3]));
  backward_chain(engine, f);
  SwapStats s = engine.stats();
  EXPECT_EQ(s.offload_count, 2);
  EXPECT_EQ(s.reload_count, 2);
  EXPECT_EQ(s.skipped_count[static_cast<size_t>(SkipReason::kLinkSaturated)], 2);
  EXPECT_EQ(s.skipped_count[static_cast<size_t>(SkipReason::kLastLayer)], 1);
  EXPECT_THROW(engine.set_offload_window(-1), c10::Error);
}

TEST(SwapEngineTest, OffloadWindowSubmitsNoWaitingOffloadNearTheTurn) {
  // Window 1, 40 KB per layer at 250 ns/B (10 ms per offload), so each layer's offload
  // waits for the one before it. From layer 2 on the test lets the copy submitted two
  // release points earlier finish first, so a slot frees at every release point; near the
  // turn (the release points of layers 4 and 5 of a 6-layer chain) the waiting offload is
  // still not submitted.
  SwapEngine engine(cpu_options(250.0, /*offload_window=*/1));
  const ChainForward f =
      forward_chain(engine, make_chain(engine, 6), 10000, [&](size_t i, const ChainForward& g) {
        if (i >= 2 && i <= 4) engine.wait_offload(g.groups[i - 2]);  // a slot frees
      });
  // 0 went at once; 1 waited and went at layer 2's release point, 2 at layer 3's. 3 waited
  // and stays: a slot is free at layer 4's release point (its successor is the last layer)
  // and at layer 5's (the last layer), but those are near the turn; 4 queued behind 3.
  EXPECT_TRUE(off_device(*f.handles[0]));
  EXPECT_TRUE(off_device(*f.handles[1]));
  EXPECT_TRUE(off_device(*f.handles[2]));
  EXPECT_FALSE(off_device(*f.handles[3]));
  EXPECT_FALSE(off_device(*f.handles[4]));
  backward_chain(engine, f);
  SwapStats s = engine.stats();
  EXPECT_EQ(s.offload_count, 3);
  EXPECT_EQ(s.reload_count, 3);
  EXPECT_EQ(s.skipped_count[static_cast<size_t>(SkipReason::kLinkSaturated)], 2);
  EXPECT_EQ(s.skipped_count[static_cast<size_t>(SkipReason::kLastLayer)], 1);
}

TEST(SwapEngineTest, OffloadWindowNearTheTurnStillSubmitsALayerThatDidNotWait) {
  // A fast link (no delay): nothing waits, so the release point before the last layer
  // still offloads its own layer at once when the window has a free slot.
  SwapEngine engine(cpu_options(0.0, /*offload_window=*/1));
  const ChainForward f =
      forward_chain(engine, make_chain(engine, 3), 1000, [&](size_t i, const ChainForward& g) {
        if (i >= 1) engine.wait_offload(g.groups[i - 1]);
      });
  EXPECT_TRUE(off_device(*f.handles[0]));
  EXPECT_TRUE(off_device(*f.handles[1]));  // its successor is the last layer
  EXPECT_FALSE(off_device(*f.handles[2]));
  backward_chain(engine, f);
  EXPECT_EQ(engine.stats().offload_count, 2);
}

}  // namespace
}  // namespace hyper_parallel::activation
