#include "hyper_parallel/activation/CheckpointPolicy.h"

#include "hyper_parallel/common/Macros.h"

namespace hyper_parallel::activation {

const char* to_string(CheckpointPolicy policy) {
  switch (policy) {
    case CheckpointPolicy::MUST_SAVE: return "MUST_SAVE";
    case CheckpointPolicy::PREFER_SAVE: return "PREFER_SAVE";
    case CheckpointPolicy::MUST_RECOMPUTE: return "MUST_RECOMPUTE";
    case CheckpointPolicy::PREFER_RECOMPUTE: return "PREFER_RECOMPUTE";
    case CheckpointPolicy::MUST_SWAP: return "MUST_SWAP";
  }
  return "UNKNOWN";
}

std::optional<CheckpointPolicy> policy_from_string(std::string_view name) {
  for (int i = 0; i < kNumCheckpointPolicies; ++i) {
    auto p = static_cast<CheckpointPolicy>(i);
    if (name == to_string(p)) return p;
  }
  if (name == "MUST_CPU_OFFLOAD" || name == "PREFER_CPU_OFFLOAD") return CheckpointPolicy::MUST_SWAP;
  return std::nullopt;
}

CheckpointPolicy policy_from_int(int64_t value) {
  HP_CHECK_VALUE(value >= 0 && value < kNumCheckpointPolicies, "invalid CheckpointPolicy value ",
                 value, "; expected 0..4 (MUST_SAVE, PREFER_SAVE, MUST_RECOMPUTE, "
                 "PREFER_RECOMPUTE, MUST_SWAP)");
  return static_cast<CheckpointPolicy>(value);
}

}  // namespace hyper_parallel::activation
