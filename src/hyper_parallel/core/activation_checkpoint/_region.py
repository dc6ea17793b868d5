"""Regions: one layer invocation, as seen by the swap engine.

A region brackets the forward of one layer (a ``swap``/``checkpoint`` call, a wrapper's
forward, or a module registered with ``SwapManager().set_forward_prefetch_layer``). On
entry it starts a swap group in the C++ engine and, when asked, pushes the engine's
saved-tensor hooks; on exit it pops them, hands the group to the schedule, and attaches
a backward pre-hook to the outputs' ``grad_fn`` so the prefetch of earlier layers starts
when this layer's backward begins (docs/design.md, "Detecting the start of a layer's
backward"). If the forward raises, the group is aborted and nothing stays installed
(SPEC 4.6).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten

from hyper_parallel._extension import _C

from ._memory import sample_active_meter

SWAP_ALL = _C.PackMode.SWAP_ALL
REGISTERED_ONLY = _C.PackMode.REGISTERED_ONLY

_warned_unscheduled: set[str] = set()


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (e.g. recompute)."""
    return torch._C._current_graph_task_id() != -1


def in_checkpoint_forward() -> bool:
    """True inside the forward of a torch.utils.checkpoint region (ours are built on it):
    the innermost saved-tensor hooks are its frame's. Such a frame recomputes whatever is
    saved inside it, so no region may hide its hook with ours."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and getattr(top[0], "__module__", None) == "torch.utils.checkpoint"


class Region:
    """Context manager for one layer invocation.

    Args:
        layer_id: the engine's id of the layer (``-1`` when it is in no schedule).
        name: the group name (``SwapManager().get_current_group_name()``).
        pack_mode: ``SWAP_ALL`` (swap every eligible saved tensor), ``REGISTERED_ONLY``
            (only storages registered with the group) or ``None`` (push no hooks).
        policy_fn: per-tensor swap policy (``SWAP_ALL`` only), or ``None``.
        group_swap: fuse small tensors of the group into few copies.
        exclude: tensors whose storages are never swapped (the module's parameters and
            buffers).

    A region in no schedule that runs inside the forward of a scheduled layer (the user
    guide's ``layer.attn = swap_wrapper(layer.attn)`` with the chain registered over
    ``model.layers``) joins that layer's invocation: its saved tensors go into the
    enclosing group and follow the layer's offload/prefetch schedule.
    """

    __slots__ = ("_layer_id", "_name", "_pack_mode", "_policy_fn", "_group_swap",
                 "_exclude", "_manual", "group", "_pushed", "_joined")

    def __init__(self, layer_id=-1, name="", pack_mode=None, policy_fn=None, group_swap=False,
                 exclude=(), manual=False):
        self._layer_id = layer_id
        self._name = name
        self._pack_mode = pack_mode
        self._policy_fn = policy_fn
        self._group_swap = group_swap
        self._exclude = exclude
        self._manual = manual
        self.group = None
        self._pushed = False
        self._joined = False

    def __enter__(self):
        outer = _C.current_group() if self._layer_id < 0 and not self._manual else None
        if outer is not None and outer.layer >= 0:
            self.group, self._joined = outer, True  # the enclosing layer's invocation
            if self._group_swap:
                _C.set_group_swap(outer, True)
        else:
            self.group = _C.begin_forward(self._layer_id, self._name, self._manual,
                                          self._group_swap)
        try:
            if self._exclude:
                self.group.exclude(list(self._exclude))
            if (self._pack_mode is not None and torch.is_grad_enabled()
                    and not in_checkpoint_forward()):
                torch._C._autograd._push_saved_tensors_default_hooks(
                    _C.PackHook(self._pack_mode, self._policy_fn), _C.unpack_hook)
                self._pushed = True
        except BaseException:
            if not self._joined:
                _C.abort_forward(self.group)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        if self._pushed:
            self._pushed = False
            torch._C._autograd._pop_saved_tensors_default_hooks()
        if self._joined:
            return False  # the enclosing region ends (or aborts) the group
        if exc_type is not None:
            _C.abort_forward(self.group)
            return False
        unscheduled = _C.end_forward(self.group)
        sample_active_meter()
        if unscheduled and self._name not in _warned_unscheduled:
            _warned_unscheduled.add(self._name)
            warnings.warn(
                f"hyper_parallel: swap region '{self._name}' is not part of a prefetch "
                "schedule, so its activations are offloaded at the end of its forward and "
                "reloaded only when its own backward starts, without overlap. Register the layer order "
                "with SwapManager().set_forward_prefetch_layer(prev_layer, next_layer).",
                stacklevel=3,
            )
        return False

    def attach_backward(self, outputs) -> None:
        """Starts this invocation's prefetch when the gradient reaches any output."""
        group = self.group
        if group is None or self._joined or (group.num_records == 0 and group.layer < 0):
            return
        hook = _BackwardStart(group)
        seen = set()
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                node = t.grad_fn
                if id(node) not in seen:
                    seen.add(id(node))
                    node.register_prehook(hook)


class _BackwardStart:
    """Pre-hook on a region's output nodes: starts the prefetch once, then lets go of the
    group (so the group dies with its last saved tensor, not with the graph)."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, grad_outputs):
        group, self.group = self.group, None
        if group is not None:
            _C.backward_begin(group)
            sample_active_meter()
        return None
