#pragma once
// RngStep: what one random op (tagged nondeterministic_seeded: dropout, bernoulli, the
// fused attention kernels, ...) did to its device's default generator during a selective
// checkpoint region's forward (docs/design.md, "Selective checkpoint", "Random ops").
//
// Selective checkpoint may cache a random op's outputs (the policy says MUST_SAVE or
// MUST_SWAP). Recompute then hands those outputs back instead of running the op, so the
// generator would not advance as it did in forward, and every random op recomputed after
// it would draw different numbers than forward drew (wrong gradients). The step keeps the
// generator's state before and after the op in forward; when recompute hands the cached
// outputs back it moves the generator to the "after" state, provided the generator is at
// the "before" state then (the checkpoint frame restored the forward's RNG state at the
// start of the region, preserve_rng_state=True). When it is not there (preserve_rng_state
// =False: recompute draws other numbers anyway), the generator is left alone, so a
// recompute never rewinds the training's RNG stream.
//
// An op that leaves the generator unchanged (scaled_dot_product attention at
// dropout_p = 0) records nothing beyond the comparison. An op given an explicit
// `generator=` argument does not use the default generator; the caller skips the step.
//
// Cost: two get_state() copies in forward (5056 bytes for the CPU generator's MT19937
// state, 16 bytes for a Philox generator's seed and offset) and one comparison plus one
// set_state() in recompute, per cached random op.
//
// Thread-safety: each call locks the generator's mutex as torch's Generator.get_state and
// set_state do; an RngStep itself is used by one thread at a time (the region's).

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace hyper_parallel::activation {

class RngStep {
 public:
  // The state of `device`'s default generator now, before the op runs. std::nullopt when
  // the device has no default generator (a backend without one registered).
  static std::optional<RngStep> before(const c10::Device& device);

  // The device whose default generator an op draws from, given its boxed arguments:
  // std::nullopt when it is passed an explicit generator; else the device of its first
  // tensor argument, else its Device argument, else the CPU (factory ops).
  static std::optional<c10::Device> generator_device(c10::ArrayRef<c10::IValue> args);

  // Right after the op: records the generator's state. Returns whether the op moved it
  // (false: nothing to replay; the caller may drop the step).
  bool after();

  // In recompute, where the op's cached outputs are handed back: if the generator is at
  // the forward's "before" state, sets it to the "after" state and returns true;
  // otherwise leaves it and returns false.
  bool replay() const;

 private:
  RngStep(at::Generator gen, at::Tensor state) : gen_(std::move(gen)), before_(std::move(state)) {}

  mutable at::Generator gen_;  // a handle; its mutex() and set_state() are non-const
  at::Tensor before_;  // CPU uint8 tensors, as Generator::get_state() returns them
  at::Tensor after_;
};

}  // namespace hyper_parallel::activation
