"""Measuring saved-activation memory on any device (SPEC 6)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from hyper_parallel._extension import _C


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


def sample_active_meter() -> None:
    """Called at region boundaries (where the engine frees or reloads memory)."""
    if _active is not None:
        _active.sample()


@contextlib.contextmanager
def saved_activation_memory() -> Iterator[SavedActivationMeter]:
    """Measures the peak bytes held by saved activations, on any device.

    Every tensor autograd saves inside the block is observed once per storage, whether it
    is saved directly, inside a swap region (then an offloaded storage counts 0 bytes
    while it is on the host) or as an input of a checkpoint region. Tensors that a
    checkpoint region recomputes are never saved, so they do not count.

    Example::

        with saved_activation_memory() as meter:
            loss = model(x).sum()
        loss.backward()
        print(meter.peak_bytes)

    Raises:
        RuntimeError: when another meter is already active.
    """
    global _active
    meter = SavedActivationMeter()
    meter._meter.activate()
    _active = meter
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter._meter.observe, _C.unpack_hook):
            yield meter
        meter.sample()
    finally:
        _active = None
        meter._meter.deactivate()
