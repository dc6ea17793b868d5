// OpInterceptor and SacRegion on their own (no Python): ops reach the C++ fallback only
// inside a region; forward records per the table, recompute hands cached outputs back;
// tensors from outside the region go through ExternalReads; regions nest and are per
// thread. Op facts come from the schema rules (no classifier is installed here).
#include "hyper_parallel/activation/OpInterceptor.h"

#include "hyper_parallel/activation/OpPolicyTable.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <thread>

namespace hyper_parallel::activation {
namespace {

std::shared_ptr<SacRegion> region_saving_mm() {
  auto table = std::make_shared<OpPolicyTable>();
  table->set("aten.mm", CheckpointPolicy::MUST_SAVE);
  return std::make_shared<SacRegion>(std::make_shared<SacCache>(table));
}

class OpInterceptorTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(OpInterceptor::install()) << OpInterceptor::unavailable_reason(); }
};

TEST_F(OpInterceptorTest, OnlyOpsInsideARegionAreIntercepted) {
  at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
  const int64_t before = OpInterceptor::intercepted_total();
  at::mm(a, b);
  EXPECT_EQ(OpInterceptor::intercepted_total(), before);
  auto region = region_saving_mm();
  region->enter_forward();
  EXPECT_EQ(OpInterceptor::depth(), 1u);
  at::relu(at::mm(a, b));
  region->exit();
  EXPECT_EQ(OpInterceptor::depth(), 0u);
  EXPECT_EQ(region->intercepted(), 2);
  EXPECT_EQ(OpInterceptor::intercepted_total(), before + 2);
  at::mm(a, b);
  EXPECT_EQ(OpInterceptor::intercepted_total(), before + 2);
}

TEST_F(OpInterceptorTest, RecomputeHandsBackTheSavedOutputAndRunsTheRest) {
  at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
  auto region = region_saving_mm();
  region->enter_forward();
  at::Tensor h = at::mm(a, b);
  at::Tensor y = at::relu(h);
  region->exit();
  region->end_forward();
  const SacCacheStats s = region->cache()->stats();
  EXPECT_EQ(s.saved_entries, 1);
  EXPECT_EQ(s.recompute_entries, 1);

  region->enter_recompute();
  at::Tensor h2 = at::mm(a * 0, b);  // a different input: the cached value comes back
  at::Tensor y2 = at::relu(h2);
  region->exit();
  EXPECT_EQ(h2.data_ptr(), h.data_ptr());
  EXPECT_TRUE(at::equal(y2, y));
  EXPECT_NE(y2.data_ptr(), y.data_ptr());  // relu ran again
  EXPECT_EQ(region->cache()->stats().replays, 1);
}

TEST_F(OpInterceptorTest, RecomputeReadsTheValueForwardReadOfWrittenOutsideState) {
  at::Tensor x = at::randn({3}), state = at::ones({3});
  auto region = region_saving_mm();
  region->enter_forward();
  at::Tensor y = at::mul(x, state);
  state.mul_(2);  // the region writes a tensor from outside it (BatchNorm's statistics)
  region->exit();
  region->end_forward();
  EXPECT_EQ(region->written(), 1);
  region->enter_recompute();
  at::Tensor y2 = at::mul(x, state);
  state.mul_(2);  // goes to the private copy, not to `state`
  region->exit();
  EXPECT_TRUE(at::equal(y2, y));
  EXPECT_TRUE(at::equal(state, at::full({3}, 2.0)));
}

TEST_F(OpInterceptorTest, TellsWhetherTheForwardReadAnOutsideTensorsValue) {
  // What _ForwardModuleState asks of a buffer the forward replaced: was the old one read?
  at::Tensor x = at::randn({3}), read = at::ones({3}), viewed = at::ones({3}),
             through_view = at::ones({4}), written = at::zeros({3}), never = at::ones({3});
  auto region = region_saving_mm();
  region->enter_forward();
  at::mul(x, read);
  at::Tensor v = viewed.view({3});                      // a view op reads no value
  at::add(x, through_view.slice(0, 1, 4));               // read through a view the region made
  written.fill_(1.0);                                    // a declared write reads no value
  region->exit();
  EXPECT_TRUE(region->read_in_forward(read));
  EXPECT_FALSE(region->read_in_forward(viewed));
  EXPECT_TRUE(region->read_in_forward(through_view));
  EXPECT_FALSE(region->read_in_forward(written));
  EXPECT_FALSE(region->read_in_forward(never));
  EXPECT_FALSE(region->read_in_forward(x * 1));         // the region's own tensor
  region->end_forward();
  EXPECT_TRUE(region->read_in_forward(read));            // (kept past the forward's end)
}

TEST_F(OpInterceptorTest, ATensorMadeWithoutAnOpOverOutsideMemoryIsNotTakenForTheRegions) {
  // `buf.data` in Python: a new TensorImpl over the buffer's storage, made without an op.
  // One made after a region tensor died took its address and was taken for the region's
  // own, so its read went unseen (tester, session 20).
  at::Tensor x = at::randn({4}), buf = at::ones({4});
  auto region = region_saving_mm();
  region->enter_forward();
  for (int i = 0; i < 8; ++i) {
    { at::Tensor dead = at::mul(x, 2.0); }  // the region's own, gone at once
    at::Tensor data = buf.variable_data();  // a new object over outside memory
    at::mul(data, x);
  }
  region->exit();
  EXPECT_TRUE(region->read_in_forward(buf));
  region->end_forward();
}

TEST_F(OpInterceptorTest, OutsideStateModifiedAfterForwardIsAClearError) {
  at::Tensor x = at::randn({3}), scale = at::ones({3});
  auto region = region_saving_mm();
  region->enter_forward();
  at::mul(x, scale);
  region->exit();
  region->end_forward();
  scale.add_(1);
  try {
    region->enter_recompute();
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string expected = "modified in place after the region's forward read it (version " +
                                 std::to_string(scale._version() - 1) + " -> " +
                                 std::to_string(scale._version()) + ")";
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
  }
  EXPECT_EQ(OpInterceptor::depth(), 0u);
}

TEST_F(OpInterceptorTest, NestedRegionsBothSeeTheOpsAndThreadsAreSeparate) {
  at::Tensor a = at::randn({4, 4}), b = at::randn({4, 4});
  auto outer = region_saving_mm();
  auto inner = region_saving_mm();
  outer->enter_forward();
  inner->enter_forward();
  int64_t other_thread = -1;
  std::thread t([&] {
    auto mine = region_saving_mm();
    mine->enter_forward();
    for (int i = 0; i < 5; ++i) at::mm(a, b);
    mine->exit();
    other_thread = mine->intercepted();
  });
  t.join();
  at::mm(a, b);
  inner->exit();
  at::mm(a, b);
  outer->exit();
  EXPECT_EQ(other_thread, 5);
  EXPECT_EQ(inner->intercepted(), 1);
  EXPECT_EQ(outer->intercepted(), 2);
  EXPECT_EQ(outer->cache()->stats().saved_entries, 2);
}

}  // namespace
}  // namespace hyper_parallel::activation
