"""Plain Cells in a swap chain: forward hooks that make each call a region.

``SwapManager().set_forward_prefetch_layer(a, b)`` over plain Cells (not our wrappers)
installs these, as ``_LayerNode``'s hooks do for torch modules: the Cell's forward becomes
a ``REGISTERED_ONLY`` region (``swap_tensor_wrapper`` registrations inside it are
offloaded and prefetched with the layer), unless it already runs inside a region of the
same layer or inside a recompute. The region stack is per thread; the third hook is
registered with ``always_call=True`` and aborts a region left open by an exception.
"""

from __future__ import annotations

import threading

from mindspore import nn

from hyper_parallel._extension import _C

from ._region import REGISTERED_ONLY, MsRegion, in_backward

_tls = threading.local()
_INSTALLED = "_hp_ms_layer_hooks"


def _stack(node) -> list:
    stacks = _tls.__dict__.setdefault("stacks", {})
    return stacks.setdefault(id(node), [])


class _Hooks:
    __slots__ = ("node",)

    def __init__(self, node) -> None:
        self.node = node

    def pre(self, cell, args):
        stack = _stack(self.node)
        current = _C.current_group()
        if in_backward() or (current is not None and current.layer == self.node.layer_id):
            stack.append(None)
            return None
        region = MsRegion(self.node.layer_id, self.node.name, REGISTERED_ONLY)
        region.__enter__()
        stack.append(region)
        return None

    def post(self, cell, args, output):
        stack = _stack(self.node)
        region = stack.pop() if stack else None
        if region is not None:
            region.__exit__(None, None, None)
            region.finish(output)
        return None

    def always(self, cell, args, output=None):
        stack = _stack(self.node)
        if stack and output is None:  # the forward raised (post did not run)
            region = stack.pop()
            if region is not None:
                region.__exit__(RuntimeError, None, None)
        return None


def install_layer_hooks(obj, node) -> None:
    """Installs the region hooks on a plain Cell (once per node); wrappers and
    functions open their own regions."""
    if not isinstance(obj, nn.Cell) or getattr(obj, "_hp_is_wrapper", False):
        return
    installed = obj.__dict__.setdefault(_INSTALLED, {})
    if node.layer_id in installed:
        return
    hooks = _Hooks(node)
    installed[node.layer_id] = (obj.register_forward_pre_hook(hooks.pre),
                                obj.register_forward_hook(hooks.post),
                                obj.register_forward_hook(hooks.always, always_call=True))


def remove_layer_hooks(obj) -> None:
    """Removes every region hook installed on ``obj``."""
    for handles in obj.__dict__.pop(_INSTALLED, {}).values():
        for handle in handles:
            handle.remove()


def cells_of(model) -> list:
    """``model`` and its sub-Cells (for ``SwapManager().unregister``)."""
    return [model, *(cell for _, cell in model.cells_and_names() if cell is not model)]
