"""Activation checkpoint and swap: the public API of hyper_parallel.

Recompute (``checkpoint``, ``checkpoint_sequential``, ``checkpoint_wrapper``, per-op
``CheckpointPolicy``, ``create_selective_checkpoint_contexts`` for torch's checkpoint), swap
(``swap``, ``swap_wrapper``, ``swap_tensor_wrapper``, ``async_save_on_cpu``, ``SwapManager``,
capped host memory with ``PinnedMemoryPool``) or both; exclusion regions
(``checkpoint_exclude_wrapper``) and scheduled recompute (``recompute_handle``,
``recompute_session_ctx``) for pipeline schedules; whole models in one call (``find_layers``,
``apply_activation_memory``, ``remove_activation_memory``), chosen per layer under a byte budget
by the planner (``plan_activation_memory``), and the swap timeline (``activation_trace``).
"""

from torch.utils.checkpoint import CheckpointError

from ._apply import (
    STRATEGIES,
    ActivationMemoryReport,
    LayerPlan,
    apply_activation_memory,
    remove_activation_memory,
)
from ._async_save import AsyncSaveOnCpu, async_save_on_cpu
from ._checkpoint import CheckpointWrapper, checkpoint, checkpoint_sequential, checkpoint_wrapper
from ._errors import ArgumentKindError
from ._exclude import CheckpointExcludeWrapper, checkpoint_exclude_wrapper
from ._host_pool import PinnedMemoryPool
from ._ignored_ops import ignore_sac_ops
from ._layers import find_layers
from ._memory import SavedActivationMeter, saved_activation_memory
from ._planner import (ActivationPlan, InfeasibleBudgetError, parse_budget, plan_activation_memory,
                       plan_from_profile)
from ._policy import CheckpointPolicy
from ._profile import ActivationProfile, measure_plan, profile_activation_memory
from ._recompute_state import RecomputeState, get_recompute_state, is_recomputing
from ._scheduled import (RecomputeHandle, clear_recompute_session, recompute_handle,
                         recompute_handle_collector_ctx, recompute_session_ctx)
from ._selective import SelectiveCheckpointContext, create_selective_checkpoint_contexts
from ._swap import swap, swap_tensor_wrapper
from ._swap_manager import SwapGroupError, SwapManager
from ._trace import ActivationTrace, activation_trace
from ._wrappers import ActivationWrapper, SwapWrapper, swap_wrapper

__all__ = [
    "STRATEGIES",
    "ActivationMemoryReport",
    "ActivationPlan",
    "ActivationProfile",
    "ActivationTrace",
    "ActivationWrapper",
    "ArgumentKindError",
    "AsyncSaveOnCpu",
    "CheckpointError",
    "CheckpointExcludeWrapper",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "InfeasibleBudgetError",
    "LayerPlan",
    "PinnedMemoryPool",
    "RecomputeHandle",
    "RecomputeState",
    "SavedActivationMeter",
    "SelectiveCheckpointContext",
    "SwapGroupError",
    "SwapManager",
    "SwapWrapper",
    "activation_trace",
    "apply_activation_memory",
    "async_save_on_cpu",
    "checkpoint",
    "checkpoint_exclude_wrapper",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "clear_recompute_session",
    "create_selective_checkpoint_contexts",
    "find_layers",
    "get_recompute_state",
    "ignore_sac_ops",
    "is_recomputing",
    "measure_plan",
    "parse_budget",
    "plan_activation_memory",
    "plan_from_profile",
    "profile_activation_memory",
    "recompute_handle",
    "recompute_handle_collector_ctx",
    "recompute_session_ctx",
    "remove_activation_memory",
    "saved_activation_memory",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
