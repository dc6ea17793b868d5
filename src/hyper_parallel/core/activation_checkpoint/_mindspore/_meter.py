"""The saved-activation meter for MindSpore (SPEC 6; docs/design.md, "Backends").

MindSpore reports no memory on CPU (``memory_allocated()`` is 0), so savings are measured
by the library itself, as the C++ ``SavedBytesMeter`` does for torch: the meter counts
the bytes of storages held for backward by saved activations, each storage once (keyed by
its data pointer), and keeps the peak. A storage counts while some holder keeps it:

* a tensor saved as is (outside any region, a parameter-free pass-through, an input a
  checkpoint region keeps): from its pack until autograd drops the saved slot;
* a swapped tensor: while it is on the device (0 while its copy lives in the host pool);
* an op output cached by selective checkpoint (``MUST_SAVE``): until its recompute uses it.

Only one meter is active at a time. MindSpore fires only the innermost saved-tensor hook,
so the meter is fed by every hook of this backend, and by its own hook outside regions.

Thread-safety: one lock guards the counts.
"""

from __future__ import annotations

import threading
import weakref


class MsSavedBytesMeter:
    """Peak bytes of saved activations (see module doc).

    Attributes:
        peak_bytes (int): the largest total seen, in bytes.
        observed_storages (int): distinct storages ever held while active.
    """

    def __init__(self, parameters=()) -> None:
        self.excluded = {int(p.data_ptr()) for p in parameters}
        self._lock = threading.Lock()
        self._counts: dict[int, list[int]] = {}  # key -> [holders, nbytes]
        self._current = 0
        self.peak_bytes = 0
        self.observed_storages = 0

    def hold(self, key: int, nbytes: int) -> tuple:
        """Counts one more holder of storage ``key`` (``nbytes`` bytes); returns a token
        for :meth:`drop`."""
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:
                self._counts[key] = [1, nbytes]
                self._current += nbytes
                self.observed_storages += 1
                self.peak_bytes = max(self.peak_bytes, self._current)
            else:
                entry[0] += 1
        return (self, key)

    def drop(self, token) -> None:
        meter, key = token
        if meter is not self:
            return
        with self._lock:
            entry = self._counts.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._counts[key]
                self._current -= entry[1]

    def sample(self) -> int:
        """Current total in bytes."""
        with self._lock:
            return self._current


_active: MsSavedBytesMeter | None = None


def active() -> MsSavedBytesMeter | None:
    return _active


def set_active(meter: MsSavedBytesMeter | None) -> None:
    global _active
    _active = meter


def storage_key(tensor) -> tuple[int, int]:
    """(key, nbytes) of the storage under ``tensor``."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def hold_tensor(tensor):
    """Token for ``tensor``'s storage on the active meter, or ``None``."""
    meter = _active
    if meter is None:
        return None
    if tensor.data_ptr() in meter.excluded:
        return None
    key, nbytes = storage_key(tensor)
    return meter.hold(key, nbytes)


def drop(token) -> None:
    if token is not None:
        token[0].drop(token)


class Kept:
    """A saved tensor kept as is while a meter is active: it counts until autograd drops
    its saved slot (this object)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor, token) -> None:
        self.tensor = tensor
        weakref.finalize(self, drop, token)
