"""Capped host pools for swapped activations: ``PinnedMemoryPool`` (docs/design.md,
"Host memory").

By default every swapped activation gets its host block from the engine's pool for its
device (page-locked when an accelerator is used), bounded only by what the process can
allocate. A :class:`PinnedMemoryPool` is one C++ ``HostBufferPool`` of its own with a cap
in bytes; regions given ``cpu_pool=`` take their host blocks from it, so the host memory
of their activations never exceeds the cap. When a block does not fit, the pool first
drops its cached blocks, then waits for blocks whose last copy is still in flight;
when the blocks held by offloaded (not yet reloaded) activations alone leave no room,
the offload raises ``RuntimeError`` naming the cap, before any byte of that copy moved
(the activations it would have moved stay on device, intact), or, for a pool made with
``when_full="keep"``, the activations that do not fit stay on the device and training
goes on (one warning per pool; counted as ``"host_pool_full"`` in
``SwapManager().stats()["skipped"]``).
"""

from __future__ import annotations

from hyper_parallel._extension import _C


class PinnedMemoryPool:
    """A host memory pool with a cap, for ``cpu_pool=`` of ``checkpoint``, ``swap``,
    ``swap_wrapper``, ``swap_tensor_wrapper`` and ``async_save_on_cpu``.

    Args:
        max_host_bytes: the most bytes (int > 0) the pool holds from the system: blocks
            in use by offloaded activations, blocks waiting for their last copy, and free
            cached blocks together. Blocks are rounded up to size classes (4 KiB steps
            below 1 MiB, then four classes per power of two), so a pool holds somewhat
            fewer payload bytes than its cap.

        when_full: what an offload that finds no room under the cap does, once cached
            blocks were dropped and blocks of copies in flight waited for:
            ``"raise"`` (default): a ``RuntimeError`` naming the cap, raised in the forward
            (at the release point), the activations of that offload intact on the device;
            ``"keep"``: each storage whose block does not fit stays on the device, the
            others are offloaded (a fused ``group_swap`` bucket without room is tried
            storage by storage), and the step goes on: the cap bounds host memory and the
            device holds the rest. The first refusal of a pool warns (``UserWarning``);
            every refusal counts in :meth:`stats` (``refusals``) and each storage kept,
            once, in ``SwapManager().stats()["skipped"]["host_pool_full"]``.
            In both modes, when the blocks in use leave no room, nothing cached is
            dropped and no copy is waited for.

    Raises:
        ValueError: for a cap that is not a positive int, or ``when_full`` other than
            ``"raise"`` or ``"keep"``.

    Blocks are page-locked when the pool serves an accelerator device (set at its first
    offload; a pool serves one kind of device) and pageable for host tensors swapped
    through the CPU backend. The engine's ``SwapManager().stats()`` does not count a pool
    of its own; see :meth:`stats`.

    Thread-safety: a pool may be shared by regions on several threads (one C++ lock).
    """

    __slots__ = ("_pool",)

    def __init__(self, max_host_bytes: int, *, when_full: str = "raise") -> None:
        if (isinstance(max_host_bytes, bool) or not isinstance(max_host_bytes, int)
                or not 0 < max_host_bytes <= 1 << 62):
            raise ValueError("hyper_parallel: PinnedMemoryPool(max_host_bytes) needs an int "
                             f"number of bytes in [1, 2**62], got {max_host_bytes!r}")
        if not isinstance(when_full, str) or when_full not in ("raise", "keep"):
            raise ValueError("hyper_parallel: PinnedMemoryPool(when_full=) must be 'raise' (an "
                             "offload with no room under the cap raises) or 'keep' (what does "
                             f"not fit stays on the device), got {when_full!r}")
        self._pool = _C.HostPool(max_host_bytes, keep_when_full=when_full == "keep")

    @property
    def when_full(self) -> str:
        """``"raise"`` or ``"keep"`` (see the class docstring)."""
        return "keep" if self._pool.keep_when_full else "raise"

    @property
    def max_host_bytes(self) -> int:
        """The cap, in bytes."""
        return int(self._pool.max_host_bytes)

    def stats(self) -> dict:
        """Bytes and counts of the pool: ``bytes_in_use`` (held by offloaded
        activations), ``bytes_pending`` (given back, their last copy in flight),
        ``bytes_cached`` (free for reuse), ``allocations`` (blocks ever taken from the
        system), ``reuses``, ``cap_waits`` (offloads that waited for in-flight blocks to
        fit under the cap), ``refusals`` (storages a ``when_full="keep"`` pool had no
        room for: they stayed on the device)."""
        return dict(self._pool.stats())

    def empty_cache(self) -> None:
        """Returns the free cached blocks to the system."""
        self._pool.empty_cache()

    # A pool is a shared resource (like a process group): a deep copy of a model that uses
    # it uses the same pool, so the copies share one cap. Pickled (torch.save of a model),
    # a pool is saved as its cap and loaded as a new, empty pool with that cap.
    def __deepcopy__(self, memo) -> "PinnedMemoryPool":
        return self

    def __copy__(self) -> "PinnedMemoryPool":
        return self

    def __reduce__(self):
        return (_new_pool, (self.max_host_bytes, self.when_full))

    def __repr__(self) -> str:
        st = self._pool.stats()
        return (f"PinnedMemoryPool(max_host_bytes={self.max_host_bytes}, "
                f"when_full={self.when_full!r}, bytes_in_use={st['bytes_in_use']})")


def _new_pool(max_host_bytes: int, when_full: str = "raise") -> PinnedMemoryPool:
    """Unpickles a :class:`PinnedMemoryPool` (a new, empty pool with the same settings)."""
    return PinnedMemoryPool(max_host_bytes, when_full=when_full)


def native_pool(cpu_pool):
    """The C++ pool of ``cpu_pool`` (``None`` passes through).

    Raises:
        TypeError: for anything but a :class:`PinnedMemoryPool` or ``None``.
    """
    if cpu_pool is None:
        return None
    if not isinstance(cpu_pool, PinnedMemoryPool):
        raise TypeError("hyper_parallel: cpu_pool must be a PinnedMemoryPool (or None); got "
                        f"{type(cpu_pool).__name__}")
    return cpu_pool._pool
