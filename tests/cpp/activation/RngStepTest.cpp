// RngStep: a random op's generator step, and SacCache replaying it with the op's cached
// outputs (docs/design.md, "Random ops").
#include "hyper_parallel/activation/RngStep.h"

#include "hyper_parallel/activation/SacCache.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <mutex>

namespace hyper_parallel::activation {
namespace {

at::Tensor cpu_state() {
  at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_state(const at::Tensor& state) {
  at::Generator gen = at::globalContext().defaultGenerator(c10::Device(c10::kCPU));
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

TEST(RngStepTest, ReplaysOnlyFromTheForwardsBeforeState) {
  const at::Tensor before = cpu_state();
  auto step = RngStep::before(c10::Device(c10::kCPU));
  ASSERT_TRUE(step.has_value());
  at::rand({16});
  const at::Tensor after = cpu_state();
  EXPECT_TRUE(step->after());

  at::rand({3});  // somewhere else in the stream: left alone
  const at::Tensor elsewhere = cpu_state();
  EXPECT_FALSE(step->replay());
  EXPECT_TRUE(at::equal(cpu_state(), elsewhere));

  set_cpu_state(before);
  EXPECT_TRUE(step->replay());
  EXPECT_TRUE(at::equal(cpu_state(), after));
}

TEST(RngStepTest, AnOpThatDrawsNothingHasNoStep) {
  auto step = RngStep::before(c10::Device(c10::kCPU));
  ASSERT_TRUE(step.has_value());
  at::ones({4}).mul(2);
  EXPECT_FALSE(step->after());
}

TEST(RngStepTest, GeneratorDeviceFollowsTheArguments) {
  const at::Tensor t = at::ones({2});
  std::vector<c10::IValue> args{c10::IValue(0.5), c10::IValue(t)};
  EXPECT_EQ(RngStep::generator_device(args), c10::Device(c10::kCPU));
  std::vector<c10::IValue> factory{c10::IValue(c10::Device(c10::kCPU, -1))};
  EXPECT_EQ(RngStep::generator_device(factory), c10::Device(c10::kCPU, -1));
  at::Generator own = at::globalContext().defaultGenerator(c10::Device(c10::kCPU)).clone();
  std::vector<c10::IValue> explicit_gen{c10::IValue(t), c10::IValue(own)};
  EXPECT_FALSE(RngStep::generator_device(explicit_gen).has_value());
}

TEST(RngStepTest, TheCacheReplaysTheStepWithTheCachedOutputs) {
  SacCache cache;
  const at::Tensor region_start = cpu_state();
  auto step = RngStep::before(c10::Device(c10::kCPU));
  const at::Tensor out = at::rand({8});  // the "random op", cached
  ASSERT_TRUE(step->after());
  const at::Tensor after = cpu_state();
  cache.record(/*op_key=*/0, CheckpointPolicy::MUST_SAVE, {c10::IValue(out)},
               OutputKind::kSingle, nullptr, std::move(step));

  set_cpu_state(region_start);  // recompute starts where forward did
  cache.begin_recompute();
  SacCache::Replay r = cache.replay(0, /*retain=*/false);
  ASSERT_FALSE(r.recompute);
  EXPECT_TRUE(at::equal(r.outputs.at(0).toTensor(), out));
  EXPECT_TRUE(at::equal(cpu_state(), after));  // as if the op had drawn again
}

}  // namespace
}  // namespace hyper_parallel::activation
