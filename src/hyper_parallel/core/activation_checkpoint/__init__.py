"""Activation checkpoint and swap: the public API of hyper_parallel.

Recompute (``checkpoint``, ``checkpoint_wrapper``, per-op ``CheckpointPolicy``), swap
(``swap``, ``swap_wrapper``, ``swap_tensor_wrapper``, ``SwapManager``) or both, and whole
models in one call (``find_layers``, ``apply_activation_memory``,
``remove_activation_memory``).
"""

from ._apply import (
    STRATEGIES,
    ActivationMemoryReport,
    LayerPlan,
    apply_activation_memory,
    remove_activation_memory,
)
from ._checkpoint import CheckpointWrapper, checkpoint, checkpoint_wrapper
from ._layers import find_layers
from ._memory import SavedActivationMeter, saved_activation_memory
from ._policy import CheckpointPolicy
from ._swap import swap, swap_tensor_wrapper
from ._swap_manager import SwapManager
from ._wrappers import SwapWrapper, swap_wrapper

__all__ = [
    "STRATEGIES",
    "ActivationMemoryReport",
    "CheckpointPolicy",
    "CheckpointWrapper",
    "LayerPlan",
    "SavedActivationMeter",
    "SwapManager",
    "SwapWrapper",
    "apply_activation_memory",
    "checkpoint",
    "checkpoint_wrapper",
    "find_layers",
    "remove_activation_memory",
    "saved_activation_memory",
    "swap",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
