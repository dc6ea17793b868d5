#include "hyper_parallel/activation/SwapStats.h"

namespace hyper_parallel::activation {

const char* to_string(SkipReason reason) {
  switch (reason) {
    case SkipReason::kParameter: return "parameter";
    case SkipReason::kBuffer: return "buffer";
    case SkipReason::kHostTensor: return "host_tensor";
    case SkipReason::kForeignStorage: return "foreign_storage";
    case SkipReason::kCopyOnWrite: return "copy_on_write";
    case SkipReason::kEmptyStorage: return "empty_storage";
    case SkipReason::kNoStorage: return "no_storage";
    case SkipReason::kMetaOrFake: return "meta_or_fake";
    case SkipReason::kSubclassOrFunctional: return "subclass_or_functional";
    case SkipReason::kUnsupportedDevice: return "unsupported_device";
    case SkipReason::kKeptByPolicy: return "kept_by_policy";
    case SkipReason::kInUseElsewhere: return "in_use_elsewhere";
    case SkipReason::kLastLayer: return "last_layer";
    case SkipReason::kLinkSaturated: return "link_saturated";
    case SkipReason::kHostPoolFull: return "host_pool_full";
    case SkipReason::kSavedBeforeRegistration: return "saved_before_registration";
    case SkipReason::kCount: break;
  }
  return "unknown";
}

}  // namespace hyper_parallel::activation
