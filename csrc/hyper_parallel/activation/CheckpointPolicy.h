#pragma once
// CheckpointPolicy: what to do with the output of one op inside a checkpoint region,
// or with one saved tensor inside a swap region.
//
// Values are the contract of SPEC.md section 2 and match torch.utils.checkpoint's
// CheckpointPolicy for 0..3. MUST_SWAP=4 plays the role of torch's MUST_CPU_OFFLOAD
// (torch also has PREFER_CPU_OFFLOAD=5, which we map to MUST_SWAP on input).
//
// Thread-safety: free functions, no state.

#include <cstdint>
#include <optional>
#include <string_view>

namespace hyper_parallel::activation {

enum class CheckpointPolicy : int8_t {
  MUST_SAVE = 0,
  PREFER_SAVE = 1,
  MUST_RECOMPUTE = 2,
  PREFER_RECOMPUTE = 3,
  MUST_SWAP = 4,
};

inline constexpr int kNumCheckpointPolicies = 5;

// "MUST_SAVE", ... ; never null.
const char* to_string(CheckpointPolicy policy);

// Inverse of to_string; also accepts torch's names MUST_CPU_OFFLOAD and
// PREFER_CPU_OFFLOAD (both -> MUST_SWAP). Returns nullopt for anything else.
std::optional<CheckpointPolicy> policy_from_string(std::string_view name);

// From an integer value 0..4. Throws c10::Error ("hyper_parallel: invalid ...") otherwise.
CheckpointPolicy policy_from_int(int64_t value);

// True for MUST_SAVE and PREFER_SAVE: the op output is kept on device.
constexpr bool is_save(CheckpointPolicy p) {
  return p == CheckpointPolicy::MUST_SAVE || p == CheckpointPolicy::PREFER_SAVE;
}
// True for MUST_RECOMPUTE and PREFER_RECOMPUTE: the op is run again in backward.
constexpr bool is_recompute(CheckpointPolicy p) {
  return p == CheckpointPolicy::MUST_RECOMPUTE || p == CheckpointPolicy::PREFER_RECOMPUTE;
}
constexpr bool is_swap(CheckpointPolicy p) { return p == CheckpointPolicy::MUST_SWAP; }

}  // namespace hyper_parallel::activation
