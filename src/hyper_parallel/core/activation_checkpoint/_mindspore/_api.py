"""``checkpoint``, ``swap`` and ``swap_tensor_wrapper`` on MindSpore (PyNative mode).

Reached through the public functions of ``hyper_parallel.core.activation_checkpoint``
when their argument is a ``mindspore.nn.Cell`` or the call's arguments are MindSpore
tensors (``../_backends.py``). Same names, arguments and defaults as the torch backend;
the differences are MindSpore's (docs/design.md, "Backends"):

* checkpoint regions are ``mindspore.recompute(..., use_reentrant=False)`` with
  ``early_stop=False`` (MindSpore 2.10's early stop raises out of a nested Cell's
  construct and corrupts PyNative's graph stack: "Stack input_args_info_stack_ is
  empty"), so a recompute runs the region to its end;
* graph mode has no saved-tensor hooks and no dispatch modes: only
  ``checkpoint_wrapper(cell)`` (mapped onto ``Cell.recompute()``) works there; every
  other call raises a ``hyper_parallel:`` error that says PyNative is required.
"""

from __future__ import annotations

import threading

import mindspore as ms
from mindspore import Tensor, nn

from .. import _swap_manager
from ._region import REGISTERED_ONLY, SWAP_ALL, MsRegion, current_group, grad_enabled, \
    in_backward, register
from ._selective import compile_policy, context_fn as selective_context_fn
from .._warnings import warn as warn_user

_tls = threading.local()  # depth of our checkpoint forwards on this thread


def pynative() -> bool:
    return ms.get_context("mode") == ms.PYNATIVE_MODE


def require_pynative(what: str) -> None:
    if not pynative():
        raise RuntimeError(
            f"hyper_parallel: {what} on MindSpore needs PyNative mode: call "
            "mindspore.set_context(mode=mindspore.PYNATIVE_MODE) first. Graph mode has no "
            "saved-tensor hooks, so only checkpoint_wrapper(cell) without options works there "
            "(it maps onto Cell.recompute()).")


class LayerTarget:
    """A callable plus the object that identifies its layer in the schedule (a wrapper)."""

    __slots__ = ("owner", "fn")

    def __init__(self, owner, fn) -> None:
        self.owner = owner
        self.fn = fn


def resolve(function):
    """(callable, schedule node or None, region name, cell whose parameters are never
    swapped or None)."""
    owner, fn = (function.owner, function.fn) if isinstance(function, LayerTarget) else (
        function, function)
    node = _swap_manager.layer_node(owner)
    if node is None and fn is not owner:
        node = _swap_manager.layer_node(fn)
    if node is not None:
        name = node.name
    elif isinstance(fn, nn.Cell):
        name = type(fn).__name__
    else:
        name = getattr(fn, "__qualname__", type(fn).__name__)
    return fn, node, name, fn if isinstance(fn, nn.Cell) else None


def checkpoint(function, *args, policy_fn=None, swap_inputs=False, context_fn=None,
               group_swap=False, use_reentrant=None, preserve_rng_state=True,
               determinism_check="default", debug=False, **kwargs):
    """``checkpoint`` for a Cell or a function of MindSpore tensors (see the public
    :func:`hyper_parallel.core.activation_checkpoint.checkpoint`).

    ``policy_fn`` ops are MindSpore op names (``"MatMul"``); a callable gets ``op.name``.

    Raises:
        RuntimeError: in graph mode.
        ValueError: ``use_reentrant=True``, ``debug=True``, an unknown
            ``determinism_check``, or an invalid ``policy_fn`` entry or result.
        TypeError: a ``policy_fn`` or ``context_fn`` of the wrong type.
    """
    require_pynative("checkpoint")
    if use_reentrant:
        raise ValueError("hyper_parallel: checkpoint is always non-reentrant; pass "
                         "use_reentrant=False or omit it.")
    if debug:
        raise ValueError("hyper_parallel: checkpoint(debug=True) is torch-only; MindSpore "
                         "recompute has no debug trace. Drop debug=True.")
    if determinism_check not in ("default", "none"):
        raise ValueError("hyper_parallel: checkpoint determinism_check must be 'default' or "
                         f"'none'; got {determinism_check!r}.")
    if context_fn is not None and not callable(context_fn):
        raise TypeError("hyper_parallel: context_fn must be a callable returning "
                        f"(forward_ctx, recompute_ctx); got {type(context_fn).__name__}")
    policy = compile_policy(policy_fn)
    fn, node, name, _ = resolve(function)
    if not grad_enabled():
        return fn(*args, **kwargs)
    ctx = selective_context_fn(policy, context_fn) if (policy or context_fn) else None

    def run():
        _tls.depth = getattr(_tls, "depth", 0) + 1
        try:
            return ms.recompute(fn, *args, use_reentrant=False, early_stop=False,
                                context_fn=ctx, save_rng_state=preserve_rng_state, **kwargs)
        finally:
            _tls.depth -= 1

    if in_backward() or (node is None and not swap_inputs and current_group() is None
                         and (policy is None or not policy.may_swap)):
        return run()
    region = MsRegion(node.layer_id if node is not None else -1, name,
                      SWAP_ALL if swap_inputs else REGISTERED_ONLY, group_swap=group_swap)
    with region:
        out = run()
    region.finish(out)
    return out


def swap(function, *args, policy_fn=None, group_swap=False, **kwargs):
    """``swap`` for a Cell or a function of MindSpore tensors (see the public
    :func:`hyper_parallel.core.activation_checkpoint.swap`): every tensor it saves for
    backward (parameters excepted) is copied into the host pool at the end of its forward
    when the schedule releases it, and brought back for its backward.

    Raises:
        RuntimeError: in graph mode.
        ValueError: when ``policy_fn`` returns anything but MUST_SAVE / MUST_SWAP.
    """
    require_pynative("swap")
    fn, node, name, cell = resolve(function)
    if in_backward() or not grad_enabled():
        return fn(*args, **kwargs)
    params = list(cell.get_parameters()) if cell is not None else []
    region = MsRegion(node.layer_id if node is not None else -1, name, SWAP_ALL, policy_fn,
                      group_swap, params)
    with region:
        out = fn(*args, **kwargs)
    region.finish(out)
    return out


_warned_outside = False


def swap_tensor_wrapper(target, tag=None, group_swap=False):
    """``swap_tensor_wrapper`` for MindSpore tensors: registers them with the current
    swap group (of the running region, wrapper or chained Cell); returns ``target``."""
    global _warned_outside
    require_pynative("swap_tensor_wrapper")
    if in_backward() or not grad_enabled() or getattr(_tls, "depth", 0):
        return target  # recompute, inference, or inside a checkpoint's forward
    group = current_group()
    if group is None:
        if not _warned_outside:
            _warned_outside = True
            warn_user(
                "hyper_parallel: swap_tensor_wrapper was called outside any swap region, so "
                "nothing was registered. Call it inside the construct of a Cell registered "
                "with SwapManager().set_forward_prefetch_layer(prev, next), or inside a "
                "swap/checkpoint region.")
        return target
    for t in _leaves(target):
        register(group, t)
    return target


def _leaves(target) -> list:
    if isinstance(target, Tensor):
        return [target]
    if isinstance(target, (tuple, list)):
        return [t for item in target for t in _leaves(item)]
    if isinstance(target, dict):
        return [t for item in target.values() for t in _leaves(item)]
    return []
