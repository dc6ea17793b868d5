"""The MindSpore backend: the guide's API on ``mindspore.nn.Cell`` in PyNative mode.

Imported by ``../_backends.py`` only once MindSpore is imported and a Cell or MindSpore
tensor reaches a public function; never import it directly. It implements the
``Backend`` protocol there. Shared with the torch backend, through ``hyper_parallel._C``:
the layer schedule (``SwapGroup``, ``Schedule``: chains, invocation links, the current
group), the op-policy tables (``OpPolicyTable`` with ``"mindspore.<Op>"`` entries), the
op-name registry and ``CheckpointPolicy``. MindSpore-specific: regions and hooks
(``_region.py``), records and copies (``_records.py``, ``_copy.py``), the host pool
(``_pool.py``), selective checkpoint (``_selective.py``) and the meter (``_meter.py``).
See docs/design.md, "Backends".
"""

from __future__ import annotations

import contextlib

import mindspore as ms
from mindspore import Tensor, nn

from . import _meter
from ._api import checkpoint, swap, swap_tensor_wrapper
from ._layers import cells_of, install_layer_hooks, remove_layer_hooks
from ._records import STORE
from ._region import keep, unpack
from ._wrappers import checkpoint_wrapper, swap_wrapper, wraps_each_other

__all__ = ["checkpoint", "checkpoint_wrapper", "swap", "swap_wrapper", "swap_tensor_wrapper",
           "install_layer_hooks", "remove_layer_hooks", "cells_of", "wraps_each_other",
           "owns", "stats", "reset", "saved_activation_memory"]


def owns(obj) -> bool:
    return isinstance(obj, (nn.Cell, Tensor))


def stats() -> dict:
    """This backend's counters (the keys of ``SwapManager().stats()``)."""
    return STORE.stats()


def reset(schedule: bool = True) -> None:
    STORE.reset_stats() if not schedule else STORE.reset()


@contextlib.contextmanager
def saved_activation_memory(parameters=None):
    """Measures the peak bytes held by saved activations of MindSpore code in the block
    (see ``_meter.py``); yields an :class:`~._meter.MsSavedBytesMeter`.

    Raises:
        RuntimeError: when another meter is active, or in graph mode.
    """
    if ms.get_context("mode") != ms.PYNATIVE_MODE:
        raise RuntimeError("hyper_parallel: saved_activation_memory on MindSpore needs "
                           "PyNative mode (mindspore.set_context(mode=mindspore.PYNATIVE_MODE)).")
    if _meter.active() is not None:
        raise RuntimeError("hyper_parallel: a saved_activation_memory() meter is already "
                           "active; nest no meters (use one around the whole step).")
    meter = _meter.MsSavedBytesMeter(parameters or ())
    _meter.set_active(meter)
    try:
        with ms.saved_tensors_hooks(keep, unpack):
            yield meter
    finally:
        _meter.set_active(None)
