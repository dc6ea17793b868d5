#include "hyper_parallel/activation/RngStep.h"

#include <ATen/Context.h>

#include <cstring>
#include <mutex>

namespace hyper_parallel::activation {
namespace {

at::Tensor state_of(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  const size_t n = a.nbytes();
  return n == b.nbytes() && std::memcmp(a.const_data_ptr(), b.const_data_ptr(), n) == 0;
}

}  // namespace

std::optional<RngStep> RngStep::before(const c10::Device& device) {
  at::Generator gen;
  try {
    gen = at::globalContext().defaultGenerator(device);
  } catch (const c10::Error&) {
    return std::nullopt;  // no generator registered for this backend
  }
  if (!gen.defined()) return std::nullopt;
  at::Tensor state = state_of(gen);
  return RngStep(std::move(gen), std::move(state));
}

std::optional<c10::Device> RngStep::generator_device(c10::ArrayRef<c10::IValue> args) {
  std::optional<c10::Device> tensor_device, device_arg;
  for (const auto& v : args) {
    if (v.isGenerator() && v.toGenerator().defined()) return std::nullopt;
    if (tensor_device) continue;
    if (v.isTensor() && v.toTensor().defined()) {
      tensor_device = v.toTensor().device();
    } else if (v.isTensorList() && !v.toTensorList().empty()) {
      const at::Tensor t = v.toTensorList().get(0);
      if (t.defined()) tensor_device = t.device();
    } else if (v.isDevice() && !device_arg) {
      device_arg = v.toDevice();
    }
  }
  if (tensor_device) return tensor_device;
  if (device_arg) return device_arg;
  return c10::Device(c10::kCPU);
}

bool RngStep::after() {
  after_ = state_of(gen_);
  return !same_bytes(before_, after_);
}

bool RngStep::replay() const {
  if (!after_.defined()) return false;
  std::lock_guard<std::mutex> lock(gen_.mutex());
  if (!same_bytes(gen_.get_state(), before_)) return false;
  gen_.set_state(after_);
  return true;
}

}  // namespace hyper_parallel::activation
