"""Warnings for swap settings that would otherwise save nothing without a word.

Checked at the end of each layer invocation's forward (``Region.__exit__``), from what the
engine recorded in its group: which saved tensors it skipped and why
(``SwapGroup.skipped``, the per-invocation part of ``SwapManager().stats()["skipped"]``)
and whether the forward ran against the declared chain. Each cause warns once per
process; the counters keep counting.
"""

from __future__ import annotations


from hyper_parallel._extension import _C
from ._warnings import warn as warn_user

_warned: set[str] = set()

#: What each skip reason means, for messages (keys as in ``stats()["skipped"]``).
REASONS = {
    "parameter": "parameters (leaves that require grad) and views of them",
    "buffer": "the layer's own buffers and frozen parameters",
    "host_tensor": "tensors already in host memory (CPU swap off)",
    "foreign_storage": "non-resizable or foreign storages (from_blob, DLPack, IPC)",
    "copy_on_write": "copy-on-write storages",
    "empty_storage": "empty storages",
    "no_storage": "tensors without a storage (sparse, nested)",
    "meta_or_fake": "meta or fake tensors",
    "subclass_or_functional": "tensor subclasses (other than DTensor) and functional tensors",
    "unsupported_device": "tensors on a device without a registered backend",
    "kept_by_policy": "tensors the policy_fn kept on device (MUST_SAVE)",
    "in_use_elsewhere": "storages still referenced outside the engine",
    "last_layer": "the last layer of the chain (its backward runs first)",
    "link_saturated": "layers whose offload still waited for the link when their backward began",
    "saved_before_registration": "tensors registered with swap_tensor_wrapper after an op of "
                                 "the layer had saved them",
    "host_pool_full": "storages a PinnedMemoryPool(when_full='keep') had no room for",
}


def _warn_once(cause: str, message: str) -> None:
    if cause not in _warned:
        _warned.add(cause)
        warn_user(message)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def describe_skipped(skipped: dict) -> str:
    """``{"host_tensor": (3, 4096)}`` -> ``"3 storages of tensors already in host ... (4096
    bytes)"``, the largest first."""
    parts = sorted(skipped.items(), key=lambda kv: -kv[1][1])
    return "; ".join(f"{n} storage{'s' * (n != 1)} of {REASONS.get(r, r)} ({_mib(b)})"
                     for r, (n, b) in parts)


def after_forward(group, name: str) -> None:
    """Warns (once per cause) about what this invocation of layer ``name`` did not swap.

    The engine counts skips only where a swap was asked for (a ``swap`` region, a
    ``MUST_SWAP`` op output, a ``swap_tensor_wrapper`` registration), so a checkpoint or
    plain layer that swaps nothing by design says nothing.

    Args:
        group: the invocation's ``_C.SwapGroup``.
        name: the region name (for messages).
    """
    if group.order_reversed:
        _warn_once(
            "order_reversed",
            f"hyper_parallel: layer '{name}' ran forward before the layer that precedes it in "
            "the prefetch chain (or right after the layer that follows it): the forward order "
            "is not the chain declared with SwapManager().set_forward_prefetch_layer(a, b) (b "
            "must run after a) or the order of apply_activation_memory's layers=, so offloads "
            "and prefetches happen at the wrong times. Declare the chain in forward order.")
    skipped = group.skipped
    if not skipped:
        return
    if "host_tensor" in skipped and not _C.cpu_swap():
        n, nbytes = skipped["host_tensor"]
        _warn_once(
            "host_tensor",
            f"hyper_parallel: swap region '{name}' skipped {n} saved tensor storage"
            f"{'s' * (n != 1)} ({_mib(nbytes)}) that already live in host memory: with CPU swap "
            "off, host tensors are never offloaded. Train on an accelerator, or turn the CPU "
            "backend on (HYPER_PARALLEL_CPU_SWAP=1 or SwapManager().set_cpu_swap(True)) to "
            "exercise swap on the CPU.")
    elif group.num_records == 0 and _C.layer_scheduled(group.layer):
        _warn_once(
            "nothing_swappable",
            f"hyper_parallel: layer '{name}' is in a prefetch chain but saved nothing that can be "
            f"swapped: {describe_skipped(skipped)}. SwapManager().stats()['skipped'] counts "
            "these by reason.")
