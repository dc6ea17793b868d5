"""Measuring saved-activation memory on any device (SPEC 6)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint

from hyper_parallel._extension import _C

from ._backends import backend_named


class SavedActivationMeter:
    """Result of :func:`saved_activation_memory`.

    Attributes:
        peak_bytes (int): the largest total, in bytes, of device (or host, on CPU) storage
            held for backward by saved activations during the measured code. Storages
            offloaded by swap count 0 while they are on the host; parameters never count.
        observed_storages (int): distinct storages seen (alive at the end).
    """

    def __init__(self) -> None:
        self._meter = _C.SavedBytesMeter()
        self._owner: str | None = None  # the library function metering the user's step
        self._thread = threading.get_ident()  # the thread that opened it

    @property
    def peak_bytes(self) -> int:
        return int(self._meter.peak)

    @property
    def observed_storages(self) -> int:
        return int(self._meter.observed_storages)

    def sample(self) -> int:
        """Current total in bytes (also updates the peak)."""
        return int(self._meter.sample())


_active: SavedActivationMeter | None = None


def active_meter():
    """The active meter's C++ ``SavedBytesMeter`` (``observe(tensor)``), or ``None``."""
    return None if _active is None else _active._meter


class _CountedVersionWrapper:
    """Stands in for torch.utils.checkpoint's ``_VersionWrapper`` (the box torch's own
    selective checkpoint caches each saved op output in) while a meter is active, so the
    meter counts torch's cache as it counts ours and the benchmarks compare alike."""

    def __init__(self, base, meter) -> None:
        self._base, self._meter = base, meter

    def __call__(self, val):
        if isinstance(val, torch.Tensor):
            self._meter.observe(val)
        return self._base(val)


@contextlib.contextmanager
def _counting_torch_sac(meter) -> Iterator[None]:
    base = getattr(torch_checkpoint, "_VersionWrapper", None)
    if base is None:  # another torch: its cache is not counted
        yield
        return
    torch_checkpoint._VersionWrapper = _CountedVersionWrapper(base, meter)
    try:
        yield
    finally:
        torch_checkpoint._VersionWrapper = base


def meter_active() -> bool:
    """Whether a saved_activation_memory meter samples region boundaries now."""
    return _active is not None


def sample_active_meter() -> None:
    """Called at region boundaries (where the engine frees or reloads memory)."""
    if _active is not None:
        _active.sample()


@contextlib.contextmanager
def saved_activation_memory(framework: str = "torch",
                            parameters=None) -> Iterator[SavedActivationMeter]:
    """Measures the peak bytes held by saved activations, on any device.

    ``framework="mindspore"`` measures MindSpore code instead (a meter with the same
    ``peak_bytes`` / ``observed_storages`` / ``sample()``; docs/design.md, "Backends").
    MindSpore hands parameters to saved-tensor hooks as plain tensors, so pass
    ``parameters=model.get_parameters()`` there to leave them out, as torch's meter does.

    Every tensor autograd saves inside the block is observed once per storage, whether it
    is saved directly, inside a swap region (then an offloaded storage counts 0 bytes
    while it is on the host) or as an input of a checkpoint region, and so is every op
    output a selective checkpoint caches: ours, and torch's own
    (``torch.utils.checkpoint.create_selective_checkpoint_contexts``), so that the two
    compare alike. Tensors that a checkpoint region recomputes are never saved, so they
    do not count. A storage counts from its save until it is freed: after the backward
    that released it, a storage the caller still holds (a list of micro-batch inputs, the
    last micro-batch's output in a loop variable) keeps counting, since its memory is
    still allocated; one that is freed leaves the total before the next save is counted,
    so a step of several gradient-accumulation micro-batches reads one micro-batch's peak
    plus what the caller holds.

    Example::

        with saved_activation_memory() as meter:
            loss = model(x).sum()
        loss.backward()
        print(meter.peak_bytes)

    Raises:
        RuntimeError: when another meter is already active.
    """
    global _active
    if framework != "torch":
        with backend_named(framework).saved_activation_memory(parameters) as other:
            yield other
        return
    if parameters is not None:
        raise ValueError("hyper_parallel: saved_activation_memory(parameters=...) is for "
                         "MindSpore; torch's meter never counts parameters.")
    if _active is not None and _active._thread != threading.get_ident():
        # (a tester, session 27: two threads planning at once were told their step_fn
        # opened a meter, which neither did)
        raise RuntimeError(
            f"hyper_parallel: another thread is measuring saved activations "
            f"({_active._owner or 'saved_activation_memory()'}); the meter counts the whole "
            "process, so two cannot run at once. Plan or measure one model at a time.")
    if _active is not None and _active._owner is not None:
        raise RuntimeError(
            f"hyper_parallel: step_fn opens saved_activation_memory() while {_active._owner} "
            "runs it under its own meter (it profiles and measures the step that way), and "
            "meters do not nest. Give the planner the step without the meter; the plan's "
            "predicted_peak_bytes and measured_peak_bytes give the peak.")
    meter = SavedActivationMeter()
    meter._meter.activate()
    _active = meter
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter._meter.observe, _C.unpack_hook), \
                _counting_torch_sac(meter._meter):
            yield meter
        meter.sample()
    finally:
        _active = None
        meter._meter.deactivate()
