"""Functional swap API: ``swap`` and ``swap_tensor_wrapper`` (SPEC 2)."""

from __future__ import annotations


import torch
from torch.utils._pytree import tree_flatten

from hyper_parallel._extension import _C

from . import _compile
from ._backends import backend_for, loaded_frameworks
from ._errors import check_callable, check_flag
from ._host_pool import native_pool
from ._policy_signature import check_swap_policy
from ._region import (SWAP_ALL, Region, _compiled_autograd_on, after_run_region, in_backward,
                      in_checkpoint_forward, meter_active, runs_plainly)
from ._swap_manager import SwapManager, layer_node
from ._warnings import warn as warn_user


def region_name(obj) -> str:
    node = layer_node(obj)
    if node is not None:
        return node.name
    if isinstance(obj, torch.nn.Module):
        return type(obj).__name__
    return getattr(obj, "__qualname__", type(obj).__name__)


class LayerCall:
    """A callable plus the object that identifies its layer in the schedule (a wrapper)
    and the module whose parameters and buffers are never swapped."""

    __slots__ = ("owner", "fn", "state_module")

    def __init__(self, owner, fn, state_module=None):
        self.owner = owner
        self.fn = fn
        self.state_module = state_module

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def resolve_layer(function):
    """(schedule node or None, region name, module whose parameters and buffers are never
    swapped, or None) of a call target."""
    if isinstance(function, LayerCall):
        node = layer_node(function.owner)
        if node is None and function.state_module is None:
            node = layer_node(function.fn)
        name = node.name if node is not None else region_name(function.fn)
        state = function.state_module
    else:
        node, name, state = layer_node(function), region_name(function), function
    return node, name, (state if isinstance(state, torch.nn.Module) else None)


def swap(function, *args, policy_fn=None, group_swap=False, cpu_pool=None, **kwargs):
    """Runs ``function(*args, **kwargs)`` and swaps the tensors it saves for backward.

    Saved activations are offloaded to host memory (D2H on a side stream) after the
    forward of this layer and prefetched back (H2D) before its backward, per the
    schedule declared with ``SwapManager().set_forward_prefetch_layer``. Nothing is
    recomputed; gradients are bitwise identical to running ``function`` directly.

    Args:
        function: an ``nn.Module`` or callable; its registered schedule node (if any)
            places this call in the prefetch chain.
            A ``mindspore.nn.Cell``, or a function called with MindSpore tensors,
            runs on the MindSpore backend (PyNative mode; op names in policies are
            MindSpore's, e.g. ``"MatMul"``; docs/design.md, "Backends").
        *args, **kwargs: passed to ``function``.
        policy_fn: ``policy_fn(tensor) -> CheckpointPolicy`` per saved tensor:
            ``MUST_SWAP`` offloads it, ``MUST_SAVE`` keeps it on device. ``None`` swaps
            every eligible tensor (parameters, buffers, host tensors and foreign storages
            are never swapped, SPEC 4.4: every ``nn.Parameter`` and the buffers of
            ``function`` when it is a module are excluded; a tensor something else still
            references, such as another module's buffer, is never released).
        group_swap: fuse tensors under the bucket threshold (32 MiB by default) into few
            large copies, one D2H and one H2D per bucket.
        cpu_pool: a :class:`PinnedMemoryPool` whose capped host memory holds the
            swapped tensors (``None``: the engine's pool). ``function`` cannot take a
            keyword argument named ``policy_fn``, ``group_swap`` or ``cpu_pool``.

    Returns:
        Whatever ``function`` returns.

    Raises:
        ValueError: when ``policy_fn`` returns anything but MUST_SAVE / MUST_SWAP.
        TypeError: (:class:`ArgumentKindError`) when ``group_swap`` is not a bool.
        TypeError: when ``policy_fn`` cannot be called as ``policy_fn(tensor)`` (a
            checkpoint policy ``(ctx, op, ...)`` given to swap, say), or when
            ``cpu_pool`` is not a PinnedMemoryPool.
        RuntimeError: when ``cpu_pool`` is full (the message names its cap).
    """
    check_callable("swap", function)
    check_flag("swap", "group_swap", group_swap)
    backend = backend_for(function, args=args, kwargs=kwargs)
    if backend is not None:  # a MindSpore Cell or tensors (docs/design.md, "Backends")
        _refuse_pool_on_backend(cpu_pool, "swap")
        return backend.swap(function, *args, policy_fn=policy_fn, group_swap=group_swap,
                            **kwargs)
    SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP on first use
    check_swap_policy(policy_fn)
    pool = native_pool(cpu_pool)
    if _compile.is_compiling():  # as a swap wrapper traced by dynamo (two graph breaks)
        return _compile.swap_traced(function, function, args, kwargs, policy_fn, group_swap,
                                    cpu_pool, state_module=function if isinstance(
                                        function, torch.nn.Module) else None)
    return _run_swapped(function, function, args, kwargs, policy_fn, group_swap, pool)


def _run_swapped(target, fn, args, kwargs, policy_fn, group_swap, pool):
    """``fn(*args, **kwargs)`` in the swap region of ``target`` (its layer, name and state
    module), or plainly in recompute and without grad."""
    if runs_plainly():
        return fn(*args, **kwargs)
    node, name, state = resolve_layer(target)
    return _C.run_region(node.layer_id if node is not None else -1, name, fn, args,
                         kwargs or None, policy_fn, group_swap, pool, state,
                         meter_active() or _compiled_autograd_on(), after_run_region)


def swap_call(call: LayerCall, args, kwargs, policy_fn, group_swap, pool):
    """``swap(call, *args, **kwargs)`` for a swap wrapper, whose options were checked when
    it was built (``pool``: the native pool or None): the per-layer hot path, with no
    repeated validation (issue 17)."""
    if loaded_frameworks():  # another framework's tensors may be in the call
        backend = backend_for(call, args=args, kwargs=kwargs)
        if backend is not None:
            return backend.swap(call, *args, policy_fn=policy_fn, group_swap=group_swap,
                                **kwargs)
    return _run_swapped(call, call.fn, args, kwargs, policy_fn, group_swap, pool)


def swap_module_call(wrapper, inner, args, kwargs, policy_fn, group_swap, pool):
    """What ``swap_call(LayerCall(wrapper, inner, inner), ...)`` does for a module swap
    wrapper whose caller already checked grad mode and recompute (SwapWrapper.forward):
    the wrapper names the layer, ``inner``'s parameters and buffers are never swapped."""
    if loaded_frameworks():
        return swap_call(LayerCall(wrapper, inner, inner), args, kwargs, policy_fn, group_swap,
                         pool)
    node = layer_node(wrapper)
    return _C.run_region(node.layer_id if node is not None else -1,
                         node.name if node is not None else region_name(inner), inner, args,
                         kwargs or None, policy_fn, group_swap, pool, inner,
                         meter_active() or _compiled_autograd_on(), after_run_region)


def swap_region(function, policy_fn=None, group_swap=False, cpu_pool=None) -> Region | None:
    """The (not yet entered) swap region of one call of ``function``, or ``None`` when
    the call runs plainly: in recompute or without grad. ``cpu_pool``: a
    PinnedMemoryPool or None (checked even when the call runs plainly)."""
    check_flag("swap", "group_swap", group_swap)
    SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP on first use
    check_swap_policy(policy_fn)
    pool = native_pool(cpu_pool)
    if runs_plainly():
        return None
    node, name, state = resolve_layer(function)
    return Region(node.layer_id if node is not None else -1, name, SWAP_ALL, policy_fn,
                  group_swap, cpu_pool=pool, state_module=state)


_warned_outside = False


def swap_tensor_wrapper(target, tag=None, group_swap=False, cpu_pool=None):
    """Registers the tensors in ``target`` with the current swap group; returns ``target``.

    Call it inside a layer's forward (a swap/checkpoint region, a wrapper, or a module
    registered with ``SwapManager().set_forward_prefetch_layer``), right where the tensor is
    made, before the ops that use it. The storages of the registered tensors are offloaded
    with the group and prefetched before its backward; other saved tensors of a plain
    registered module stay on device. A tensor an op of the layer had already saved when
    it was registered (autograd keeps it as itself) stays on the device while that saved
    tensor lives, counted in ``stats()["skipped"]["saved_before_registration"]``; that
    includes an op's output that the op itself saves (``tanh``, ``sigmoid``, ``exp``,
    ``softmax``), which ``swap_wrapper`` or a ``MUST_SWAP`` policy offloads.

    Args:
        target: a tensor or a nested container (tuple, list, dict) of tensors
            (MindSpore tensors register with the running MindSpore region).
        tag: a label for debugging; not used for scheduling.
        group_swap: fuse the group's small tensors into few large copies.
        cpu_pool: a :class:`PinnedMemoryPool` for the host blocks of the tensors
            registered from now on in the current group (``None``: keep the group's).

    Returns:
        ``target`` unchanged (the same objects).

    Raises:
        RuntimeError: at the end of the layer's forward, if a registered tensor was
            modified in place after registration (SPEC 4.7).
    """
    global _warned_outside
    check_flag("swap_tensor_wrapper", "group_swap", group_swap)
    if _compile.is_compiling():
        _compile.warn_registration_not_compiled()
        return target
    backend = backend_for(target, args=(target,))
    if backend is not None:  # MindSpore tensors (docs/design.md, "Backends")
        _refuse_pool_on_backend(cpu_pool, "swap_tensor_wrapper")
        return backend.swap_tensor_wrapper(target, tag=tag, group_swap=group_swap)
    SwapManager()
    pool = native_pool(cpu_pool)
    if runs_plainly() or in_checkpoint_forward():
        # Recompute, inference, or inside a checkpoint's forward (the tensor is recomputed
        # in backward, so keeping it for a swap would only cost a copy).
        return target
    group = _C.current_group()
    if group is None:
        if not _warned_outside:
            _warned_outside = True
            warn_user(
                "hyper_parallel: swap_tensor_wrapper was called outside any swap region, so "
                "nothing was registered. Call it inside the forward of a layer registered "
                "with SwapManager().set_forward_prefetch_layer(prev, next), or inside a "
                "swap/checkpoint region or SwapManager().group_context(name)."
            )
        return target
    if group_swap:
        _C.set_group_swap(group, True)
    if pool is not None:
        _C.set_group_pool(group, pool)
    for t in tree_flatten(target)[0]:
        if isinstance(t, torch.Tensor):
            _C.register_tensor(t)
    return target


def _refuse_pool_on_backend(cpu_pool, api: str) -> None:
    if cpu_pool is not None:
        raise ValueError(
            f"hyper_parallel: {api}(cpu_pool=...) is not supported for MindSpore Cells and "
            "tensors (MindSpore manages its own host memory for swap); drop cpu_pool.")
