"""``async_save_on_cpu``: swap what a block of code saves, without a wrapper.

torch's ``torch.autograd.graph.save_on_cpu`` copies every saved tensor to host memory
synchronously in its pack hook and back in its unpack hook. Here the block is one swap
region (docs/design.md, "Regions"): saved tensors are offloaded on the copy stream when
the block ends (overlapping what follows), their device memory is released in place, and
each is reloaded on demand when backward unpacks it (ordered after its D2H). Inside the
forward of a layer registered with ``SwapManager().set_forward_prefetch_layer`` the block
joins that layer's invocation and follows its prefetch schedule instead.
"""

from __future__ import annotations

from ._errors import check_flag
from ._host_pool import native_pool
from ._region import SWAP_ALL, Region
from ._swap_manager import SwapManager


class AsyncSaveOnCpu:
    """Context manager: tensors saved for backward inside the block are swapped to host
    memory (see :func:`async_save_on_cpu`). One instance is one block; enter it once."""

    __slots__ = ("_policy_fn", "_group_swap", "_pool", "_region")

    def __init__(self, policy_fn=None, group_swap: bool = False, cpu_pool=None) -> None:
        if policy_fn is not None and not callable(policy_fn):
            raise TypeError("hyper_parallel: async_save_on_cpu policy_fn must be a callable "
                            f"policy_fn(tensor) -> CheckpointPolicy; got {type(policy_fn).__name__}")
        check_flag("async_save_on_cpu", "group_swap", group_swap)
        self._policy_fn = policy_fn
        self._group_swap = group_swap
        self._pool = native_pool(cpu_pool)
        self._region = None

    def __enter__(self):
        if self._region is not None:
            raise RuntimeError("hyper_parallel: this async_save_on_cpu block is already "
                               "entered; create one per with-block.")
        SwapManager()  # applies HYPER_PARALLEL_CPU_SWAP on first use
        region = Region(-1, "async_save_on_cpu", SWAP_ALL, self._policy_fn, self._group_swap,
                        cpu_pool=self._pool, quiet=True)
        region.__enter__()
        self._region = region
        return self

    def __exit__(self, exc_type, exc, tb):
        region, self._region = self._region, None
        if region is not None:
            region.__exit__(exc_type, exc, tb)
        return False


def async_save_on_cpu(policy_fn=None, group_swap=False, cpu_pool=None) -> AsyncSaveOnCpu:
    """A ``with`` block whose saved activations are swapped to host memory, overlapped.

    Like ``torch.autograd.graph.save_on_cpu``, but the copies run on a side stream after
    the block and free the device memory in place, and backward reloads each tensor when
    it needs it (``save_on_cpu`` copies synchronously in its hooks). Gradients are
    bitwise those of running the block without it. Parameters, buffers, host tensors and
    foreign storages are never swapped (SPEC 4.4); inside a checkpoint region nothing is
    swapped (the region recomputes what it saves).

    Args:
        policy_fn: ``policy_fn(tensor) -> CheckpointPolicy`` per saved tensor, as in
            :func:`swap` (``MUST_SWAP`` swaps it, ``MUST_SAVE`` keeps it on device);
            ``None`` swaps every eligible tensor.
        group_swap: fuse small tensors into few large copies.
        cpu_pool: a :class:`PinnedMemoryPool` whose capped host memory holds them.

    Returns:
        An :class:`AsyncSaveOnCpu` context manager.

    Raises:
        TypeError: for a non-callable ``policy_fn``, a non-bool ``group_swap`` or a
            ``cpu_pool`` that is not a PinnedMemoryPool.

    Example::

        >>> with async_save_on_cpu():
        ...     loss = model(x).sum()
        >>> loss.backward()
    """
    return AsyncSaveOnCpu(policy_fn=policy_fn, group_swap=group_swap, cpu_pool=cpu_pool)
