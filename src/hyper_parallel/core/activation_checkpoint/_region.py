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

import sys

import torch
from torch.utils._pytree import tree_flatten

from hyper_parallel._extension import _C

from ._diagnostics import after_forward
from ._memory import meter_active, sample_active_meter
from ._recompute_state import is_recomputing
from ._warnings import warn as warn_user

SWAP_ALL = _C.PackMode.SWAP_ALL
REGISTERED_ONLY = _C.PackMode.REGISTERED_ONLY

_warned_unscheduled: set[str] = set()


def _compiled_autograd_on() -> bool:
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "compiled_autograd_enabled", False))


def in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread (e.g. recompute), or
    while a checkpoint region is recomputed ahead of its backward (``recompute_handle``)."""
    return torch._C._current_graph_task_id() != -1 or is_recomputing()


_peek_func_transform = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack",
                               None)
_warned_func_transform = False


def in_func_transform() -> bool:
    """True inside a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``, ...).

    ``torch.func`` does not support saved-tensor hooks, on which every recompute and swap
    region is built (torch's own checkpoint raises there), so a region inside a transform
    runs its function plainly: the transform gets its gradients, without the region's
    memory saving. Warns once per process. False while dynamo traces (its transforms are
    traced, not run)."""
    global _warned_func_transform
    if _peek_func_transform is None or torch.compiler.is_compiling():
        return False
    if _peek_func_transform() is None:
        return False
    if not _warned_func_transform:
        _warned_func_transform = True
        warn_user("hyper_parallel: a checkpoint or swap region runs inside a torch.func "
                  "transform (grad, vjp, jacrev, vmap, ...), which does not support the "
                  "saved-tensor hooks recompute and swap use: the region runs its function "
                  "plainly (correct results, no memory saved). Apply the transform inside "
                  "the region, or use torch.autograd for the step, to keep the saving.")
    return True


def runs_plainly() -> bool:
    """True where a region saves nothing for backward and runs its function as it is:
    grad mode off, in a backward (a recompute), or inside a torch.func transform."""
    return not torch.is_grad_enabled() or in_backward() or in_func_transform()


def in_checkpoint_forward() -> bool:
    """True inside the forward of a torch.utils.checkpoint region (ours are built on it):
    the innermost saved-tensor hooks are its frame's. Such a frame recomputes whatever is
    saved inside it, so no region may hide its hook with ours. (The same test region entry
    makes in C++ before pushing its hook.)"""
    return _C.under_checkpoint_frame()


class Region:
    """Context manager for one layer invocation.

    Args:
        layer_id: the engine's id of the layer (``-1`` when it is in no schedule).
        name: the group name (``SwapManager().get_current_group_name()``).
        pack_mode: ``SWAP_ALL`` (swap every eligible saved tensor), ``REGISTERED_ONLY``
            (only storages registered with the group) or ``None`` (push no hooks).
        policy_fn: per-tensor swap policy (``SWAP_ALL`` only), or ``None``.
        group_swap: fuse small tensors of the group into few copies.
        manual: a group of the manual API (``SwapManager().group_context``).
        cpu_pool: the C++ host pool (``PinnedMemoryPool``'s) for this invocation's host
            blocks, or ``None`` for the engine's pool; ignored when the region joins an
            enclosing layer's group.
        quiet: do not warn when the region is in no prefetch schedule
            (``async_save_on_cpu``: reloading on demand is what it asks for).
        state_module: an ``nn.Module`` whose parameters and buffers (submodules included)
            are never swapped; walked in C++ on entry (csrc/bindings/BindSwap.cpp).

    A region in no schedule that runs inside the forward of a scheduled layer (the user
    guide's ``layer.attn = swap_wrapper(layer.attn)`` with the chain registered over
    ``model.layers``) joins that layer's invocation: its saved tensors go into the
    enclosing group and follow the layer's offload/prefetch schedule.
    """

    __slots__ = ("_layer_id", "_name", "_pack_mode", "_policy_fn", "_group_swap",
                 "_manual", "_token", "_cpu_pool", "_quiet", "_state_module")

    def __init__(self, layer_id=-1, name="", pack_mode=None, policy_fn=None, group_swap=False,
                 manual=False, cpu_pool=None, quiet=False, state_module=None):
        self._layer_id = layer_id
        self._name = name
        self._pack_mode = pack_mode
        self._policy_fn = policy_fn
        self._group_swap = group_swap
        self._manual = manual
        self._token = None
        self._cpu_pool = cpu_pool
        self._quiet = quiet
        self._state_module = state_module

    @property
    def group(self):
        """The swap group of this invocation (``None`` before entry)."""
        return self._token.group if self._token is not None else None

    # Entry and exit are each ONE C++ call (csrc/bindings/BindRegion.cpp): the group push,
    # the parameter exclusion and the hook push cannot be separated by a Python exception.
    # A token lost anyway (an exception right after region_enter returned) is abandoned by
    # its destructor, and its hook passes everything through until the next region call
    # pops it (docs/design.md, "Regions and threads").
    def __enter__(self):
        self._token = _C.region_enter(self._layer_id, self._name, self._manual,
                                      self._group_swap, None, self._pack_mode,
                                      self._policy_fn, True, self._cpu_pool, self._state_module,
                                      True)
        return self

    def __exit__(self, exc_type, exc, tb):
        token = self._token
        if token is None:
            return False
        if exc_type is not None:
            _C.region_exit(token, False)
            return False
        flags = _C.region_exit(token, True)  # 1: unscheduled with records, 2: diagnose
        if flags or meter_active():
            finish_flags(token, flags, self._name, self._quiet)
        return False

    def attach_backward(self, outputs) -> None:
        """Starts this invocation's prefetch when the gradient reaches any output.

        The hook is a C++ pre-hook on each output node (no Python call, no handle per
        call); a Python one is used while a saved-activation meter samples region
        boundaries, or under compiled autograd (which takes Python hooks only)."""
        if self._token is not None:
            _attach_backward(self._token, self._layer_id, outputs)


def after_run_region(token, flags: int, out, layer_id: int, name: str) -> None:
    """What ``_C.run_region`` (a swap wrapper's whole region in one C++ call, issue 17)
    leaves to Python after a successful exit: the meter's sample and diagnostics (flags
    & 3), and the Python backward-start hook when Python hooks are needed (the C++ exit
    attached none: flag 4 unset)."""
    finish_flags(token, flags, name, False)
    if not flags & 4:
        _attach_backward(token, layer_id, out)


def finish_flags(token, flags: int, name: str, quiet: bool) -> None:
    """What follows a successful region exit in Python: the meter's sample, the
    diagnostics (flag 2) and the unscheduled-region warning (flag 1)."""
    if not token.joined:
        sample_active_meter()
        if flags & 2:
            after_forward(token.group, name)
    if flags & 1 and not quiet:
        _warn_unscheduled(name)


def _warn_unscheduled(name: str) -> None:
    if name in _warned_unscheduled:
        return
    _warned_unscheduled.add(name)
    warn_user(
        f"hyper_parallel: swap region '{name}' is not part of a prefetch "
        "schedule, so its activations are offloaded at the end of its forward and "
        "reloaded only when its own backward starts, without overlap. Register the layer "
        "order with SwapManager().set_forward_prefetch_layer(prev_layer, next_layer)."
    )


def _attach_backward(token, layer_id: int, outputs) -> None:
    """Region.attach_backward for an exited region's ``token``: nothing for a joined region
    or an unscheduled one without records; a C++ pre-hook, or a Python one while a meter
    samples or under compiled autograd."""
    if token.joined:
        return
    group = token.group
    if layer_id < 0 and group.num_records == 0:
        return
    if not meter_active() and not _compiled_autograd_on():
        _C.attach_backward(group, outputs)
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
