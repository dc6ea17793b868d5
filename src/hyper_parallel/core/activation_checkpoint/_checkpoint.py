"""Functional checkpoint: ``checkpoint`` and ``checkpoint_wrapper`` (SPEC 2).

Built on torch.utils.checkpoint's non-reentrant frame. A checkpoint region is also a
layer invocation for the swap engine, so that ``swap_inputs`` (the region's saved inputs)
and ``MUST_SWAP`` op outputs join the layer's swap group and follow the schedule.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from ._region import REGISTERED_ONLY, SWAP_ALL, Region
from ._swap import LayerCall, in_backward, resolve_layer
from ._swap_manager import SwapManager
from ._wrappers import ActivationWrapper, _refuse_double_wrap


def checkpoint(function, *args, policy_fn=None, swap_inputs=False, context_fn=None,
               group_swap=False, **kwargs):
    """Runs ``function(*args, **kwargs)`` as a checkpoint region (non-reentrant).

    Args:
        function: module or callable.
        policy_fn: ``policy_fn(ctx, op, *args, **kwargs) -> CheckpointPolicy | bool`` or a
            list of ops to save; ``None`` recomputes everything.
        swap_inputs: also swap the region's saved inputs.
        context_fn: returns ``(forward_ctx, recompute_ctx)``.
        group_swap: fuse the region's small swapped tensors into few copies.

    Returns:
        What ``function`` returns.
    """
    SwapManager()
    if policy_fn is not None:
        raise NotImplementedError("hyper_parallel: selective policies land with issue 4")
    if in_backward():
        return function(*args, **kwargs)
    node, name, excluded = resolve_layer(function)
    region = Region(node.layer_id if node is not None else -1, name,
                    SWAP_ALL if swap_inputs else REGISTERED_ONLY, None, group_swap, excluded)
    ckpt_kwargs = {"use_reentrant": False}
    if context_fn is not None:
        ckpt_kwargs["context_fn"] = context_fn
    with region:
        out = torch_checkpoint.checkpoint(function, *args, **ckpt_kwargs, **kwargs)
    region.attach_backward(out)
    return out


class CheckpointWrapper(ActivationWrapper):
    """Every call of the wrapped module is a :func:`checkpoint` call."""

    def __init__(self, module: nn.Module, **checkpoint_kwargs) -> None:
        super().__init__(module)
        self._hp_checkpoint_kwargs = checkpoint_kwargs

    def forward(self, *args, **kwargs):
        inner = self._checkpoint_wrapped_module
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(LayerCall(self, inner, inner), *args, **self._hp_checkpoint_kwargs,
                          **kwargs)


def checkpoint_wrapper(module_or_fn, **checkpoint_kwargs):
    """Wraps a module or callable so that every call is ``checkpoint(..., **checkpoint_kwargs)``."""
    if isinstance(module_or_fn, nn.Module):
        return CheckpointWrapper(module_or_fn, **checkpoint_kwargs)
    if not callable(module_or_fn):
        raise TypeError(f"hyper_parallel: checkpoint_wrapper expects an nn.Module or a callable, "
                        f"got {type(module_or_fn).__name__}")
    _refuse_double_wrap(module_or_fn)

    @functools.wraps(module_or_fn)
    def wrapped(*args, **kwargs):
        return checkpoint(target, *args, **checkpoint_kwargs, **kwargs)

    target = LayerCall(wrapped, module_or_fn)
    wrapped._hp_wrapped_fn = module_or_fn
    return wrapped
