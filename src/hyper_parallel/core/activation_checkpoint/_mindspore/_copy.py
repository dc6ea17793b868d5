"""Copies between a MindSpore tensor and a host block (docs/design.md, "Backends").

Two copiers, chosen once per process by the device MindSpore runs on:

* :class:`SyncCopier` (CPU, and any device without streams): the offload is
  ``np.copyto(block, tensor.asnumpy())`` (``asnumpy`` is zero-copy on CPU), the reload
  copies the block into a fresh numpy array wrapped by ``Tensor.from_numpy`` (zero-copy).
  Copies complete before the call returns; no events.
* :class:`StreamCopier` (Ascend/GPU): the same copies issued with
  ``Tensor.copy_(src, non_blocking=True)`` on one side stream per direction
  (``mindspore.runtime.Stream``), each ordered after an event recorded on the compute
  stream and followed by its own ``mindspore.runtime.Event``; the compute stream waits on
  that event before it reads a reloaded tensor, and a host block is reused only once its
  last copy's event completed (``HostPool.release(block, event)``). **Untested here**: the
  project's machines have no Ascend device, and on CPU MindSpore has no streams or events
  (``Event()`` fails with "CPU device is not supported").

Thread-safety: copiers hold no mutable state besides their streams.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor


def numpy_dtype(dtype):
    """The numpy dtype of a MindSpore dtype, or ``None`` when numpy has none (bfloat16)."""
    try:
        return np.dtype(ms.dtype_to_nptype(dtype))
    except (TypeError, KeyError, ValueError):
        return None


def host_view(block: np.ndarray, nbytes: int, dtype, shape) -> np.ndarray:
    return block[:nbytes].view(dtype).reshape(shape)


class SyncCopier:
    """Blocking copies (CPU). ``offload`` and ``reload`` return ``None`` as their event."""

    asynchronous = False

    def offload(self, tensor: Tensor, view: np.ndarray):
        np.copyto(view, tensor.asnumpy())
        return None

    def reload(self, view: np.ndarray):
        return Tensor.from_numpy(np.array(view, copy=True)), None

    def wait(self, event) -> None:
        pass


class StreamCopier:
    """Asynchronous copies on side streams (written for Ascend; untested, see module doc)."""

    asynchronous = True

    def __init__(self) -> None:
        self._d2h = ms.runtime.Stream()
        self._h2d = ms.runtime.Stream()

    def _after_compute(self, stream) -> None:
        ready = ms.runtime.Event()
        ready.record(ms.runtime.current_stream())
        stream.wait_event(ready)

    def offload(self, tensor: Tensor, view: np.ndarray):
        self._after_compute(self._d2h)
        host = Tensor.from_numpy(view)  # shares the pool block
        with ms.runtime.StreamCtx(self._d2h):
            host.copy_(tensor, non_blocking=True)
            done = ms.runtime.Event()
            done.record(self._d2h)
        # The device tensor must outlive the copy: the caller keeps it until wait(done).
        return done

    def reload(self, view: np.ndarray):
        self._after_compute(self._h2d)
        host = Tensor.from_numpy(view)
        with ms.runtime.StreamCtx(self._h2d):
            device = host.to(ms.get_context("device_target"), non_blocking=True)
            done = ms.runtime.Event()
            done.record(self._h2d)
        return device, done

    def wait(self, event) -> None:
        if event is not None:
            ms.runtime.current_stream().wait_event(event)


def make_copier():
    """:class:`StreamCopier` on a device with streams, else :class:`SyncCopier`."""
    if ms.get_context("device_target") in ("Ascend", "GPU"):
        return StreamCopier()
    return SyncCopier()
