"""Exclusion regions: parts of a checkpoint region that recompute does not run again
(``checkpoint_exclude_wrapper``; docs/design.md, "Exclusion regions and scheduled
recompute").

Some parts of a layer must run exactly once per step: a collective whose order across
ranks must not depend on each rank's backward, a MoE router that counts tokens, an
adapter with state. Inside a checkpoint region, such a part runs in forward as usual
but with its saved tensors kept (its own backward needs no recompute), and its output
kept in the region invocation's :class:`RecomputeState`; when the region is recomputed,
the part is not run: the kept output is handed back (detached, same ``requires_grad``),
so the ops after it recompute from the forward's values.

Cost: the part's saved tensors stay in memory as without checkpoint, plus its output
(``save_output=True``). With ``save_output=False`` only the output's shapes are kept and
recompute gets stand-ins of the same shape and dtype without storage: only for an output
that feeds nothing but another exclusion region (which does not read its inputs in
recompute). Any op that reads a stand-in raises (:class:`_StandIn`), where it used to
compute from uninitialised memory and give wrong gradients silently.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ._errors import ArgumentKindError
from ._diagnostics import _warn_once
from ._recompute_state import enclosing_states, in_debug_region, in_reentrant_region
from ._wrappers import ActivationWrapper


def _keep(t):
    return t


def _keep_detached(t):
    # A detached alias: a saved output that kept its grad_fn would close a cycle through
    # autograd's node that Python's collector cannot break (a graph dropped without a
    # backward would never be freed; BindSwap.cpp, pass_through).
    return t.detach()


class _Kept:
    """What one call of an exclusion region returned in forward (tensors with their
    version counter at that moment)."""

    __slots__ = ("value",)

    def __init__(self, out, save_output: bool, what: str = "the part") -> None:
        if save_output:
            self.value = tree_map(_versioned, out)
        else:
            self.value = tree_map(lambda x: _Shape(x, what) if isinstance(x, torch.Tensor)
                                  else x, out)

    def replay(self):
        return tree_map(_for_recompute, self.value)


class _Versioned:
    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t, t._version


def _versioned(x):
    return _Versioned(x) if isinstance(x, torch.Tensor) else x


class _Shape:
    __slots__ = ("shape", "dtype", "device", "requires_grad", "what")

    def __init__(self, t: torch.Tensor, what: str) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.requires_grad, self.what = t.requires_grad, what


class _StandIn(torch.Tensor):
    """What recompute gets in place of a ``save_output=False`` exclusion's output: a tensor
    with the output's shape, dtype, device and ``requires_grad`` and no storage. Shape
    queries work; every ATen op on it raises ``CheckpointError`` naming the part, since
    its values are not kept (the op would recompute from garbage)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape: _Shape):
        t = torch.Tensor._make_wrapper_subclass(cls, shape.shape, dtype=shape.dtype,
                                                device=shape.device,
                                                requires_grad=shape.requires_grad)
        t._hp_what = shape.what
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        what = next(a._hp_what for a in tree_leaves((args, kwargs or {}))
                    if isinstance(a, _StandIn))
        raise torch.utils.checkpoint.CheckpointError(
            f"hyper_parallel: recompute ran {func} on the output of "
            f"checkpoint_exclude_wrapper({what}, save_output=False); with save_output=False "
            "only the output's shape is kept, so recompute has no values for it. Pass that "
            "output only to another exclusion region (which does not read it in recompute), "
            "or keep it with save_output=True (the default).")

    def __repr__(self) -> str:  # (the default repr would read the values)
        return (f"_StandIn(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"output of checkpoint_exclude_wrapper({self._hp_what}, save_output=False))")


def _for_recompute(x):
    if isinstance(x, _Versioned):
        t = x.tensor
        out = t.detach().requires_grad_(t.requires_grad)
        if t.requires_grad and t._version != x.version:
            # The forward modified the output in place after the exclusion returned, so the
            # recompute will too: hand it a non-leaf (autograd refuses in-place ops on a
            # leaf that requires grad). One transient copy, during this recompute only.
            out = out.clone()
        return out
    if isinstance(x, _Shape):
        return _StandIn(x)
    return x


def run_excluded(key, fn, save_output: bool, what: str, args, kwargs):
    """``fn(*args, **kwargs)`` as an exclusion region of the enclosing checkpoint region
    invocation (``key`` identifies the wrapper; ``what`` names it in errors)."""
    if in_reentrant_region():
        raise torch.utils.checkpoint.CheckpointError(
            f"hyper_parallel: checkpoint_exclude_wrapper({what}) runs inside a "
            "use_reentrant=True checkpoint, whose backward replays the whole body and would "
            "run it a second time. Use use_reentrant=False (the default) for regions that "
            "hold exclusions, and around them.")
    states = enclosing_states()
    if not states:
        if in_debug_region():
            _warn_once(f"debug-exclusions:{what}", (
                f"hyper_parallel: checkpoint_exclude_wrapper({what}) runs inside a "
                "checkpoint with debug=True (torch's debug mode, which brings its own "
                "contexts), so its recompute runs the part again. Debug without the "
                "exclusion, or turn debug off to keep the part to one run."))
        return fn(*args, **kwargs)  # outside any checkpoint region: nothing to exclude
    # Regions nest: the invocations in forward (innermost first) up to the innermost one
    # being recomputed. A region nested in a recomputed one runs its forward again, and
    # the part must still not run: it gets the recomputed region's kept output, which the
    # nested invocations keep in turn for their own recompute.
    forward = []
    for state in states:
        if state.is_recomputing:
            out = state.next_exclusion(key, what).replay()
            break
        forward.append(state)
    else:
        # A region intercepted in C++ keeps its own count (state.native).
        natives = [state.native for state in forward if state.native is not None]
        for state in forward:
            state.excluding += 1
        for native in natives:
            native.add_excluding(1)
        try:
            # Shadows the checkpoint frame's hook: the part's own backward keeps its tensors.
            with torch.autograd.graph.saved_tensors_hooks(_keep_detached, _keep):
                out = fn(*args, **kwargs)
        finally:
            for state in forward:
                state.excluding -= 1
            for native in natives:
                native.add_excluding(-1)
    for state in forward:
        state.keep_exclusion(key, _Kept(out, save_output, what))
    return out


class CheckpointExcludeWrapper(ActivationWrapper):
    """A module whose calls inside a checkpoint region are not replayed by its recompute
    (see :func:`checkpoint_exclude_wrapper`)."""

    _hp_nests = True  # meant to sit inside a checkpointed layer: no nesting warning

    def __init__(self, module: nn.Module, save_output: bool = True) -> None:
        super().__init__(module)
        self._hp_save_output = save_output

    @property
    def save_output(self) -> bool:
        return self._hp_save_output

    def forward(self, *args, **kwargs):
        inner = self._checkpoint_wrapped_module
        return run_excluded(self, inner, self._hp_save_output, type(inner).__name__, args,
                            kwargs)


def checkpoint_exclude_wrapper(module, *, save_output=True):
    """Wraps a module or callable so that, inside a checkpoint region, it runs in the
    forward only: recompute hands back its forward output instead of running it again.

    For parts of a checkpointed layer that must not run twice: collectives, MoE routers
    (token counts, load-balancing statistics), adapters with state. Outside any
    checkpoint region (and inside torch's own checkpoint without our contexts) the
    wrapper is a plain call. In nested regions the part still runs once per step (a region
    nested in a recomputed one gets the kept output too). Where torch's frame runs without
    our contexts, the part runs again in recompute, with a warning: a region traced by
    ``torch.compile(checkpoint_wrapper(block))`` (compile the block inside the wrapper
    instead) and ``debug=True``. If the region modifies the kept output in place, the
    recompute gets a transient copy to modify again.

    Its saved tensors are kept as without checkpoint (they are not swapped by the
    enclosing region; wrap the part with ``swap_wrapper`` inside to swap them), and its
    output is kept until the region's graph is freed. Recompute follows the forward's
    calls in order: the k-th call in recompute gets the k-th call's output.

    Args:
        module: an ``nn.Module`` (returns a transparent wrapper module, as
            :func:`checkpoint_wrapper`) or a callable (returns a function called the same
            way).
        save_output: keep the output for recompute (default). ``False`` keeps only its
            shapes and hands recompute stand-ins without values: only for an output that
            is passed directly to another exclusion region (a dispatch feeding a
            combine), whose recompute does not read it; an op that reads a stand-in
            raises ``CheckpointError`` in backward.

    Returns:
        The wrapper.

    Raises:
        ArgumentKindError: (a TypeError and a ValueError) when ``module`` is neither a
            module nor callable, or ``save_output`` is not a bool.
        torch.utils.checkpoint.CheckpointError: in backward, when the recompute calls the
            wrapper more often than the forward did, or reads the output of a
            ``save_output=False`` wrapper with an op; in forward, when the wrapper runs
            inside a ``use_reentrant=True`` checkpoint (whose recompute would run the part
            again).
    """
    if not isinstance(save_output, bool):
        raise ArgumentKindError(f"hyper_parallel: checkpoint_exclude_wrapper's save_output must "
                                f"be a bool; got {save_output!r}")
    if isinstance(module, nn.Module):
        return CheckpointExcludeWrapper(module, save_output=save_output)
    if not callable(module):
        raise ArgumentKindError("hyper_parallel: checkpoint_exclude_wrapper's module must be an "
                                f"nn.Module or a callable; got {type(module).__name__}")
    what = getattr(module, "__qualname__", type(module).__name__)

    @functools.wraps(module)
    def wrapped(*args, **kwargs):
        return run_excluded(wrapped, module, save_output, what, args, kwargs)

    wrapped.save_output = save_output
    return wrapped
