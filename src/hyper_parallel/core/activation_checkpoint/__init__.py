"""Activation checkpoint and swap: the public API of hyper_parallel.

Recompute (``checkpoint``, ``checkpoint_sequential``, ``checkpoint_wrapper``, per-op
``CheckpointPolicy``, ``create_selective_checkpoint_contexts`` for torch's checkpoint), swap
(``swap``, ``swap_wrapper``, ``swap_tensor_wrapper``, ``SwapManager``) or both, whole models
in one call (``find_layers``, ``apply_activation_memory``, ``remove_activation_memory``),
chosen per layer under a byte budget by the planner (``plan_activation_memory``), and the
swap timeline (``activation_trace``).
"""

from ._apply import (
    STRATEGIES,
    ActivationMemoryReport,
    LayerPlan,
    apply_activation_memory,
    remove_activation_memory,
)
from ._checkpoint import CheckpointWrapper, checkpoint, checkpoint_sequential, checkpoint_wrapper
from ._layers import find_layers
from ._memory import SavedActivationMeter, saved_activation_memory
from ._planner import ActivationPlan, InfeasibleBudgetError, parse_budget, plan_activation_memory
from ._policy import CheckpointPolicy
from ._profile import ActivationProfile, profile_activation_memory
from ._selective import SelectiveCheckpointContext, create_selective_checkpoint_contexts
from ._swap import swap, swap_tensor_wrapper
from ._swap_manager import SwapManager
from ._trace import ActivationTrace, activation_trace
from ._wrappers import SwapWrapper, swap_wrapper

__all__ = [
    "ActivationTrace",
    "STRATEGIES",
    "ActivationMemoryReport",
    "ActivationPlan",
    "ActivationProfile",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "InfeasibleBudgetError",
    "LayerPlan",
    "SavedActivationMeter",
    "SelectiveCheckpointContext",
    "SwapManager",
    "SwapWrapper",
    "activation_trace",
    "apply_activation_memory",
    "checkpoint",
    "checkpoint_sequential",
    "checkpoint_wrapper",
    "create_selective_checkpoint_contexts",
    "find_layers",
    "parse_budget",
    "plan_activation_memory",
    "profile_activation_memory",
    "remove_activation_memory",
    "saved_activation_memory",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
